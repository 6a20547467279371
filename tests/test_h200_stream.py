"""The H200 streaming kernel (gbs.numba_kernels.h200_stream) and its launch helper (launch.py).

CI (no GPU):
* numpy models of the host-capable pieces the kernel compiles: the E2M1 / E4M3 / E5M2 -> bf16 decodes
  (exhaustive), the UE8M0 scale image, the exactness of every element x scale product inside
  ``exact_scale_exponent_range`` (and that the range is tight), one thread's view of a K slice
  (TMA swizzle emulated independently, rotated groups, pairing, scale blocks) against the
  dequantized operand, the scale-atom addressing after a TMA box (weights' 6-D scales and the
  per-group padded token scales, two-band tiles included), bank-conflict-free shared-memory loads,
  the stage carve-up (boxes tile the stage and sum to expect_tx), the tensor-map arguments;
* ``can_implement`` / ``StreamConfig`` rejections with their messages, the launch-helper checks;
* offline compiles for sm_90a through nvJitLink (the launch path) of every format and a config
  matrix covering decode (8, cg1), small prefill (64, cg2), large prefill (128, cg2), not swapped
  (128, cg1) and mma_bn 256, with SASS checks: HMMA.16816.F32.BF16, UTMALDG, SYNCS, no LDL/STL, the
  multicast / cluster barrier for pairs, setmaxnreg with 8 consumer warps.

GPU (``@pytest.mark.gpu``, H200): every format and regime on small-but-real shapes (N 512 x K 7168,
N 4096 x K 2048) with ragged groups, an empty group, a ``-1`` slot, a 1-token group and sizes that
are not tile multiples; outputs poisoned before the launch and judged by what the kernel guarantees
(``gbs.exactness``: bit-identical wherever the accumulation is exact in any order, the tensor-core bound
element by element everywhere, skipped rows untouched); both
orientations, cta_group 1 and 2, 2 stages and the maximum; persistent grids of one CTA pair (many
tiles per CTA: mbarrier phases across tiles). A failure prints where the output is wrong and which
hypotheses (power-of-two factor, peer half, multicast half, transposed tile, shifted scales) fit.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import multiprocessing
import re
import zlib

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from gbs import schedule
from gbs.lab.cases import synthetic_problem
from gbs.dispatch import AUTO_STAGES, H200_SMEM_PER_SM, grouped_matmul_nvfp4_dispatch, pipeline_smem_terms
from gbs import plan as gbs_plan
from gbs.numba_kernels import h200_decode as hd
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_stream as hs
from gbs.numba_kernels import h200_trace as ht
from gbs.numba_kernels import launch
from gbs.numba_kernels.simt import scale_byte_offset
from gbs.problem import PROBLEM_FORMATS, build_problem, random_activations, random_weights
from gbs.ptx_inline import offline
from gbs.ptx_inline.arith import min_u16x2, min_u16x2_host
from gbs.formats import (BF16, SF_ATOM_ROWS, BlockScaled, decode_elements, decode_scales, decode_ue4m3, dequantize, gather_group_scales, get_format, pack_fp4, unpack_fp4, unswizzle_scales)
from gbs.layouts import (LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E2M1_H200_TILED, OPERAND_LAYOUTS, E2M1H200Order, UE4M3H200Scales)
from gbs.reference import (MAX_REL_TOL, POISON_BITS, RMS_REL_TOL, is_poison, reference_grouped_matmul,
                           relative_errors)
from h200_knobs import (SCALED_TOKEN_FORMATS, Stream, Wgmma, can_implement, check_kernel, max_stages, plan_spec, prepare,
                        run)

FORMATS = SCALED_TOKEN_FORMATS
CONFIGS = {
    "decode": Stream(True, 8, 1),
    "small_prefill": Stream(True, 64, 2),
    "large_prefill": Stream(True, 128, 2),
    "not_swapped": Stream(False, 128, 1),
    "wide": Stream(True, 256, 2),
    "wide_cg1": Stream(True, 256, 1),
    "not_swapped_wide": Stream(False, 256, 1),
    "not_swapped_decode": Stream(False, 8, 1),
    "mid": Stream(True, 32, 1),
}


def spec_of(fmt: str, config: Stream, stages: int | None = None,
            small_n_warps: int = hr.CONSUMER_WARPS_SMALL_N) -> hr.StreamSpec:
    a, b = PROBLEM_FORMATS[fmt]
    stages = max_stages(a, b, config) if stages is None else stages
    return hr.StreamSpec(a, b, config.ab_swapped, config.mma_bn, config.cta_group, stages,
                         small_n_warps=small_n_warps)


def spec_for_case(fmt: str, name: str) -> hr.StreamSpec:
    """``spec_of`` for a ``CONFIGS`` name, or "wgmma_ring_256": the wgmma kernel's ring with 256 token rows
    (``StreamSpec.m_rows``; its own consumers are ``h200_wgmma``'s)."""
    if name == "wgmma_ring_256":
        return dataclasses.replace(spec_of(fmt, CONFIGS["not_swapped"]), m_rows=2 * hr.TILE_M_ROWS)
    return spec_of(fmt, CONFIGS[name])


def eight_warps(config: Stream) -> Stream:
    return config._replace(small_n_warps=8)


def eight_warp_legal(fmt: str, config: Stream) -> bool:
    """Whether ``small_n_warps=8`` builds for ``fmt`` and ``config`` (``StreamSpec``'s checks)."""
    try:
        spec_of(fmt, config, small_n_warps=8)
    except ValueError:
        return False
    return True


def bf16_value(bits) -> np.ndarray:
    """float64 value of bf16 bit patterns."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def register_halves(reg) -> tuple[np.ndarray, np.ndarray]:
    reg = np.asarray(reg, np.uint32)
    return bf16_value(reg & 0xFFFF), bf16_value(reg >> 16)


def exactly_bf16(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x.astype(BF16).astype(np.float64) == x


# =============================================================================================
# Element and scale decodes (exhaustive)
# =============================================================================================
@pytest.mark.parametrize("j", range(4))
def test_e2m1_pair_decode_is_exact_for_every_code_pair(j):
    lo, hi = np.meshgrid(np.arange(16, dtype=np.uint32), np.arange(16, dtype=np.uint32), indexing="ij")
    lo, hi = lo.ravel(), hi.ravel()
    noise = np.uint32(0x5A5A5A5A)   # other nibbles: the decode must ignore them
    word = (noise & ~((np.uint32(0xF) << 4 * j) | (np.uint32(0xF) << 4 * (j + 4)))) | (lo << 4 * j) | (
        hi << 4 * (j + 4))
    got_lo, got_hi = register_halves(hd.e2m1_pair_bits(word, j))
    scale = 2.0 ** hd.ELEMENT_LOG2_OFFSET["e2m1"]
    np.testing.assert_array_equal(got_lo * scale, decode_elements(lo.astype(np.uint8), "e2m1"))
    np.testing.assert_array_equal(got_hi * scale, decode_elements(hi.astype(np.uint8), "e2m1"))
    assert np.any(got_lo[lo == 1] > 0) and np.all(got_lo[lo == 1] < 2.0 ** -126), "0.5 must be a bf16 subnormal"


def _finite_fp8_codes(element: str) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint8)
    return codes[np.isfinite(decode_elements(codes, element))]


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pairing", ["stride4", "stride2"])
def test_fp8_pair_decode_is_exact_for_every_finite_code(element, pairing):
    rng = np.random.default_rng(1)
    codes = _finite_fp8_codes(element)
    lo, hi = np.meshgrid(codes, codes, indexing="ij")
    lo, hi = lo.ravel(), hi.ravel()
    scale = 2.0 ** hd.ELEMENT_LOG2_OFFSET[element]
    for j in range(4):
        group = rng.choice(codes, (lo.size, 8))
        e_lo, e_hi = hd.pair_elements(j, pairing)
        group[:, e_lo], group[:, e_hi] = lo, hi
        words = np.ascontiguousarray(group).view(np.uint32)   # little endian: byte i = element i
        got_lo, got_hi = register_halves(
            hd.fp8_pair_bits(words[:, 0], words[:, 1], j, element == "e5m2", pairing == "stride4"))
        np.testing.assert_array_equal(got_lo * scale, decode_elements(lo, element), err_msg=f"register {j}")
        np.testing.assert_array_equal(got_hi * scale, decode_elements(hi, element), err_msg=f"register {j}")


@pytest.mark.parametrize("pairing", ["stride4", "stride2"])
def test_each_pairing_covers_the_group_once(pairing):
    slots = [e for j in range(4) for e in hd.pair_elements(j, pairing)]
    assert sorted(slots) == list(range(hd.GROUP_ELEMENTS))


@pytest.mark.parametrize("element", ["e2m1", "e4m3", "e5m2"])
def test_ue8m0_scale_image(element):
    offset = hd.ELEMENT_LOG2_OFFSET[element] - hd.SCALE_LOG2_PREBIAS["ue8m0"]
    for byte in range(256):
        bits = int(hd.ue8m0_scale_bits(byte, offset))
        lo, hi = register_halves(bits)
        assert bits >> 16 == bits & 0xFFFF, "both halves hold the scale"
        if byte == 255:
            assert np.isnan(lo), "0xFF is NaN"
        elif byte + offset > hd.BF16_EXPONENT_MAX:
            assert lo == np.inf, f"byte {byte}: past the bf16 range the image saturates to Inf"
        else:
            assert lo == 2.0 ** (byte - 127 + offset), f"byte {byte}"


@pytest.mark.parametrize("element", ["e2m1", "e4m3", "e5m2"])
def test_ue8m0_pair_scale_bits_match_the_single_image(element):
    """Two scales per call (MXFP4's two blocks per quad lane): every byte pair gives, lane by lane,
    exactly ``ue8m0_scale_bits``' image (saturation and NaN included); the selector puts bytes
    (0, 1) or (2, 3) of a word into the lanes."""
    offset = hd.ELEMENT_LOG2_OFFSET[element] - hd.SCALE_LOG2_PREBIAS["ue8m0"]
    single = np.array([int(hd.ue8m0_scale_bits(b, offset)) & 0xFFFF for b in range(256)], np.uint32)
    b0, b1 = (a.ravel().astype(np.uint32) for a in np.meshgrid(np.arange(256), np.arange(256)))
    pair = hd.ue8m0_pair_scale_bits(b0 | (b1 << 16), offset)
    assert np.array_equal(pair, single[b0] | (single[b1] << 16))
    word = 0x44332211
    for first in (0, 2):
        selector = int(hd.byte_pair_selector(first))
        picked = [(word >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF if (selector >> (4 * i)) & 7 < 4 else 0
                  for i in range(4)]
        assert picked == [(word >> (8 * first)) & 0xFF, 0, (word >> (8 * first + 8)) & 0xFF, 0]
    for byte in range(4):   # one scale (MXFP8 / W4A8's one block per quad lane): the same byte in both lanes
        selector = int(hd.byte_broadcast_selector(byte))
        picked = [(word >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF if (selector >> (4 * i)) & 7 < 4 else 0
                  for i in range(4)]
        assert picked == [(word >> (8 * byte)) & 0xFF, 0, (word >> (8 * byte)) & 0xFF, 0]


def test_min_u16x2_host_is_the_lane_minimum():
    rng = np.random.default_rng(7)
    a, b = (rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    got = min_u16x2_host(a, b)
    assert np.array_equal(got & 0xFFFF, np.minimum(a & 0xFFFF, b & 0xFFFF))
    assert np.array_equal(got >> 16, np.minimum(a >> 16, b >> 16))
    assert int(min_u16x2_host(0x80000001, 0x7FFF8000)) == 0x7FFF0001   # unsigned lanes, no carry


def k_ue8m0_pair(lanes, out):
    """The kernels' ``_ue8m0_pair_scale_bits`` (device ``min_u16x2``) over ``lanes`` (MXFP4's offset)."""
    i = cuda.grid(1)
    if i < lanes.size:
        out[i] = UE8M0_PAIR_DEVICE(lanes[i], MXFP4_UE8M0_OFFSET)


def k_copy_lanes(lanes, out):
    """``k_ue8m0_pair`` without the conversion: the SASS around it."""
    i = cuda.grid(1)
    if i < lanes.size:
        out[i] = lanes[i]


MXFP4_UE8M0_OFFSET = hd.ELEMENT_LOG2_OFFSET["e2m1"] - hd.SCALE_LOG2_PREBIAS["ue8m0"]


UE8M0_PAIR_DEVICE = cuda.jit(device=True, forceinline=True)(hd._ue8m0_pair_scale_bits(min_u16x2))


def test_ue8m0_pair_scale_bits_compile_to_five_instructions():
    """What the kernels run per two UE8M0 scales (after the lanes' ``prmt``): the multiply-add, the lane
    minimum with +Inf, and the NaN flag (add, shift, merge)."""
    from numba.cuda import types

    sig = (types.Array(types.uint32, 1, "C"), types.Array(types.uint32, 1, "C"))
    pair, copy = ([ins for ins in offline.sass_instructions(offline.disassemble(offline.compile_cubin(
        k, sig, offline.SM90A))) if not ins.startswith("NOP")] for k in (k_ue8m0_pair, k_copy_lanes))
    assert sum(ins.startswith("VIMNMX.U16x2") for ins in pair) == 1
    assert len(pair) - len(copy) == 5


@pytest.mark.gpu
def test_gpu_ue8m0_pair_scale_bits_match_the_host_form_for_every_byte_pair():
    b0, b1 = (a.ravel().astype(np.uint32) for a in np.meshgrid(np.arange(256), np.arange(256)))
    lanes = b0 | (b1 << 16)
    out = cuda.device_array(lanes.size, np.uint32)
    cuda.jit(k_ue8m0_pair)[(lanes.size + 255) // 256, 256](cuda.to_device(lanes), out)
    assert np.array_equal(out.copy_to_host(), hd.ue8m0_pair_scale_bits(lanes, MXFP4_UE8M0_OFFSET))


def test_ue4m3_scale_image_is_exact_and_finite():
    """The device converts UE4M3 -> f16 -> f32, multiplies by 2**(c - d) and rounds to bf16; every
    non-NaN byte must land on a finite bf16 exactly."""
    bytes_ = np.arange(0x7F, dtype=np.uint8)
    image = decode_ue4m3(bytes_).astype(np.float64) * 2.0 ** (hd.ELEMENT_LOG2_OFFSET["e2m1"]
                                                              - hd.SCALE_LOG2_PREBIAS["ue4m3"])
    assert np.all(np.isfinite(image)) and np.all(image < 2.0 ** 128)
    assert np.all(exactly_bf16(image))


def _scaled_products(element: str, scale_dtype: str, scale_bytes: np.ndarray) -> np.ndarray:
    codes = np.arange(16 if element == "e2m1" else 256, dtype=np.uint8)
    values = decode_elements(codes, element).astype(np.float64)
    values = values[np.isfinite(values)]
    scales = decode_scales(scale_bytes, "nvfp4" if scale_dtype == "ue4m3" else "mxfp8").astype(np.float64)
    return np.outer(values, scales) * 2.0 ** -hd.SCALE_LOG2_PREBIAS[scale_dtype]


@pytest.mark.parametrize("element", ["e2m1", "e4m3", "e5m2"])
def test_scaled_elements_are_exact_in_bf16_over_the_documented_range(element):
    low, high = hd.exact_scale_exponent_range(element)
    inside = np.arange(low, high + 1) + 127
    assert np.all(exactly_bf16(_scaled_products(element, "ue8m0", inside.astype(np.uint8))))
    offset = hd.ELEMENT_LOG2_OFFSET[element] - hd.SCALE_LOG2_PREBIAS["ue8m0"]
    assert low + 127 + offset >= 1 and high + 127 + offset == hd.BF16_EXPONENT_MAX
    # tight below: one more step down and some product falls off the bf16 subnormal grid
    assert not np.all(exactly_bf16(_scaled_products(element, "ue8m0", np.array([low + 126], np.uint8))))
    if element == "e2m1":
        assert np.all(exactly_bf16(_scaled_products("e2m1", "ue4m3", np.arange(0x7F, dtype=np.uint8))))


# =============================================================================================
# One thread's view of a K slice: TMA swizzle, rotated groups, pairing, scale blocks
# =============================================================================================
def tma_swizzle_image(tile: np.ndarray, swizzle: str) -> np.ndarray:
    """Bytes of a (rows, row_bytes) box as TMA writes them to 1024-byte aligned shared memory:
    16-byte chunk index (address bits 4..) XOR address bits 7.. (3 bits for 128B, 2 for 64B)."""
    mask = {"128B": 7, "64B": 3, "none": 0}[swizzle]
    flat = tile.reshape(-1)
    address = np.arange(flat.size)
    image = np.empty_like(flat)
    image[address ^ (((address >> 7) & mask) << 4)] = flat
    return image


def stage_side_image(side, tile: np.ndarray) -> np.ndarray:
    """A side's K slice as the ring leaves it in a stage: rows wider than a TMA box (``side.boxes`` > 1) arrive as
    128-byte-wide boxes, each swizzled on its own, stored box after box."""
    return np.concatenate([tma_swizzle_image(np.ascontiguousarray(tile[:, b * side.box_bytes:(b + 1) * side.box_bytes]),
                                             side.swizzle) for b in range(side.boxes)])


def stage_group_address(side, row, q, gl):
    """The kernels' address of local group ``gl`` of quad lane ``q`` in row ``row`` of ``stage_side_image``: the
    quarter's box (its region), then ``group_column`` inside the box's row (h200_stream's token copy)."""
    quarters_per_box = side.box_bytes // side.thread_bytes
    xor = hd.swizzle_xor(row, side.box_bytes, side.swizzle_mask)
    return ((q // quarters_per_box) * side.rows * side.box_bytes + row * side.box_bytes
            + hd.group_column(q % quarters_per_box, gl, side.thread_bytes, side.group_bytes, xor).astype(np.int64))


def prmt(a, b, selector):
    """numpy model of ``prmt.b32`` (default mode): byte i of the result = byte selector[4i:4i+4] & 7
    of the 8 bytes b:a (no sign replication: selectors here never set bit 3)."""
    source = np.stack([np.asarray(a, np.uint32), np.asarray(b, np.uint32)], axis=-1).view(np.uint8)
    picks = [(selector >> (4 * i)) & 0x7 for i in range(4)]
    assert all(((selector >> (4 * i)) & 0x8) == 0 for i in range(4))
    return np.stack([source[..., p] for p in picks], axis=-1).view(np.uint32)[..., 0]


def thread_scale_bits(side: hr.OperandSide, scale_words: np.ndarray, q: int, gi: int, gl: int) -> np.ndarray:
    """numpy model of the kernel's load_scales + group_scale, per row (the device-only steps: the
    hardware UE4M3 conversion and prmt): the bf16x2 scale image the lane uses for group ``gl``."""
    offset = hd.ELEMENT_LOG2_OFFSET[side.element] - side.log2_prebias
    blocks = side.blocks_per_thread
    groups_per_block = side.groups // blocks

    def byte(block):
        return ((scale_words >> np.uint32(8 * hd.scale_byte_index(q, blocks, block))) & 0xFF).astype(np.int64)

    if side.fmt.scale_dtype == "ue8m0":
        assert gl // groups_per_block == gi // groups_per_block, "UE8M0: the block is static per step"
        block = gi // groups_per_block
        return np.array([int(hd.ue8m0_scale_bits(int(b), offset)) for b in byte(block)], np.uint32)
    # UE4M3: the device converts the word's 4 bytes into two bf16x2 pairs, then prmt selects one
    halves = [(decode_ue4m3(byte(b).astype(np.uint8)).astype(np.float64) * 2.0 ** offset)
              .astype(np.float32).astype(BF16).view(np.uint16).astype(np.uint32) for b in range(4)]
    s0, s1 = halves[0] | (halves[1] << 16), halves[2] | (halves[3] << 16)
    return prmt(s0, s1, hd.bf16_broadcast_selector(gl // groups_per_block))


SIDE_CASES = [("nvfp4", "decode", "m"), ("nvfp4", "decode", "n"), ("mxfp4", "not_swapped", "n"),
              ("mxfp8", "large_prefill", "m"), ("mxfp8_e5m2", "wide", "n"), ("w4a8", "decode", "m"),
              ("w4a8", "decode", "n"), ("w4a8", "not_swapped", "n")]


@pytest.mark.parametrize("fmt,config,which", SIDE_CASES)
def test_thread_view_of_a_k_slice_matches_the_dequantized_operand(fmt, config, which):
    """Every (row, quad lane, group, register, half) the kernel decodes, scaled by the block scale it
    selects, against the dequantized operand at the K index the shared pairing assigns."""
    rng = np.random.default_rng(7)
    spec = spec_of(fmt, CONFIGS[config])
    side = spec.m_side if which == "m" else spec.n_side
    fmt_obj = side.fmt
    rows = side.rows
    if fmt_obj.packed:
        tile = rng.integers(0, 256, (rows, side.row_bytes), dtype=np.uint8)
        codes = unpack_fp4(tile)
    else:
        tile = rng.choice(_finite_fp8_codes(side.element), (rows, side.row_bytes)).astype(np.uint8)
        codes = tile
    values = decode_elements(codes, side.element).astype(np.float64)
    cols = spec.k_slice // fmt_obj.block_size
    lo_byte, hi_byte = (0x40, 0x7E) if fmt_obj.scale_dtype == "ue4m3" else (110, 140)
    scale_bytes = rng.integers(lo_byte, hi_byte, (rows, cols), dtype=np.uint8)
    block_scales = decode_scales(scale_bytes, fmt_obj).astype(np.float64)
    expected = values * np.repeat(block_scales, fmt_obj.block_size, axis=1) * 2.0 ** -side.log2_prebias
    # shared memory as the TMA leaves it: swizzled data boxes, scale atoms band after band
    image = stage_side_image(side, tile)
    atoms = side.sf_atoms_per_slice
    scale_image = np.zeros(side.scale_bands * atoms * 512, np.uint8)
    r_idx, c_idx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    scale_image[scale_byte_offset(r_idx, c_idx, atoms)] = scale_bytes
    row = np.arange(rows)
    xor = hd.swizzle_xor(row, side.box_bytes, side.swizzle_mask)
    np.testing.assert_array_equal(xor, hd.swizzle_xor(row % 8, side.box_bytes, side.swizzle_mask),
                                  err_msg="rows 8 apart share the swizzle XOR (the kernel computes it once)")
    got = np.full_like(expected, np.nan)
    k_per_thread = spec.k_slice // hd.QUAD
    for q in range(hd.QUAD):
        word_at = scale_byte_offset(row, hd.scale_word_column(q, side.blocks_per_thread), atoms)
        scale_words = np.stack([scale_image[a:a + 4] for a in word_at]).view(np.uint32).ravel()
        for gi in range(side.groups):
            gl = int(hd.rotated_group(gi, q))
            col = q * side.thread_bytes + gl * side.group_bytes
            box, box_col = divmod(col, side.box_bytes)
            # the kernel's formula, against the swizzle written from the address bits
            address = stage_group_address(side, row, q, gl)
            np.testing.assert_array_equal(address, box * rows * side.box_bytes
                                          + hd.swizzled_offset(row, box_col, side.box_bytes, side.swizzle_mask))
            words = np.stack([image[a:a + side.group_bytes] for a in address]).view(np.uint32)
            scale_halves = register_halves(thread_scale_bits(side, scale_words, q, gi, gl))
            for j in range(4):
                if fmt_obj.packed:
                    reg = hd.e2m1_pair_bits(words[:, 0], j)
                else:
                    reg = hd.fp8_pair_bits(words[:, 0], words[:, 1], j, side.element == "e5m2",
                                           spec.pairing == "stride4")
                for half, value in enumerate(register_halves(reg)):
                    k = q * k_per_thread + hd.GROUP_ELEMENTS * gl + hd.pair_elements(j, spec.pairing)[half]
                    product = value * scale_halves[half]
                    assert np.all(exactly_bf16(product)), "the bf16 fma must be exact"
                    assert np.all(np.isnan(got[:, k])), f"K index {k} visited twice"
                    got[:, k] = product
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", ["decode", "small_prefill", "not_swapped", "wide"])
def test_shared_memory_loads_are_bank_conflict_free(fmt, config):
    spec = spec_of(fmt, CONFIGS[config])
    warp_rows, warp_cols = spec.warp_tile
    lanes = np.arange(hr.WARP_SIZE)
    g, q = lanes >> 2, lanes & 3
    for side, warp_span, rows_per_thread in ((spec.m_side, warp_rows, 2 * warp_rows // 16),
                                             (spec.n_side, warp_cols, warp_cols // 8)):
        for base in range(0, side.rows, warp_span):
            for i in range(rows_per_thread):
                row = base + g + 8 * i
                for gi in range(side.groups):
                    gl = hd.rotated_group(gi, q).astype(np.int64)
                    xor = hd.swizzle_xor(base + g, side.row_bytes, side.swizzle_mask)
                    address = row * side.row_bytes + hd.group_column(q, gl, side.thread_bytes, side.group_bytes,
                                                                     xor).astype(np.int64)
                    if side.group_bytes == 4:
                        banks = (address // 4) % 32
                        assert len(set(banks)) == 32, f"{side.role} rows {base}+{8 * i}, step {gi}: {banks}"
                    else:   # LDS.64: two half-warp wavefronts of 16 x 8 bytes
                        for half in (lanes < 16, lanes >= 16):
                            slots = (address[half] // 8) % 16
                            assert len(set(slots)) == 16, f"{side.role} rows {base}+{8 * i}, step {gi}: {slots}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bn", [8, 16, 32])
def test_decoded_token_slot_is_a_bijection_read_without_bank_conflicts(fmt, bn):
    """Every (token row, quad lane, group) owns its own 16-byte chunk of the slot, and each 8-lane
    phase of the consumers' LDS.128 (rows g, g + 1 x lanes q = 0..3 at their rotated groups) covers
    the 8 distinct 16-byte bank groups of a 128-byte line."""
    spec = spec_of(fmt, Stream(True, bn, 1))
    assert spec.predecoded_tokens
    side, groups = spec.n_side, spec.n_side.groups
    rows, qs, gls = np.meshgrid(np.arange(side.rows), np.arange(hd.QUAD), np.arange(groups), indexing="ij")
    offsets = hs.decoded_token_offset(rows, qs, gls, groups).astype(np.int64).ravel()
    assert len(set(offsets)) == offsets.size and offsets.min() == 0
    assert offsets.max() + hs.FRAGMENT_BYTES == spec.smem.decoded_token_slot_bytes
    assert np.all(offsets % hs.FRAGMENT_BYTES == 0)
    lanes = np.arange(hr.WARP_SIZE)
    g, q = lanes >> 2, lanes & 3
    _, warp_cols = spec.warp_tile
    for j in range(warp_cols // 8):
        for gi in range(groups):
            gl = hd.rotated_group(gi, q).astype(np.int64)
            address = hs.decoded_token_offset(g + 8 * j, q, gl, groups).astype(np.int64)
            for phase in range(4):
                chunks = (address[8 * phase:8 * phase + 8] // hs.FRAGMENT_BYTES) % 8
                assert len(set(chunks)) == 8, f"rows {8 * j}+, step {gi}, phase {phase}: {chunks}"


@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
def test_fp4_weights_take_256_k_slices_in_the_narrow_decoded_token_tiles(fmt):
    """FP4 weights stream 128-byte rows (256 K) per stage where both operands are FP4 and, with FP8 or bf16 tokens,
    in the decoded-token tiles of 8 or 16 columns (their token rows then 2 or 4 boxes); 32-column tiles, the
    register-decoded tiles and FP8 weights keep 128 K (evidence: w4a8-k256)."""
    a, b = (get_format(f) for f in PROBLEM_FORMATS[fmt])
    for config in (Stream(True, 8, 1), Stream(True, 16, 1), Stream(True, 32, 1), Stream(False, 64, 1),
                   Stream(True, 128, 1)):
        if not a.scaled and not (config.ab_swapped and config.mma_bn <= 32):
            continue   # bf16 tokens: the decoded-token tiles only
        spec = spec_of(fmt, config)
        wide = b.packed and (a.packed or (config.ab_swapped and config.mma_bn in (8, 16)))
        assert spec.k_slice == (256 if wide else 128), (fmt, config)
        assert spec.weight_side.row_bytes == b.row_bytes(spec.k_slice)
        tokens = spec.token_side
        assert tokens.boxes == max(1, tokens.row_bytes // 128) and tokens.box_bytes == min(128, tokens.row_bytes)


def test_predecoded_tokens_only_where_they_fit():
    for fmt in FORMATS:
        for name, config in CONFIGS.items():
            spec = spec_of(fmt, config)
            assert spec.predecoded_tokens == (config.ab_swapped and config.mma_bn <= 32), (fmt, name)
            slot = spec.smem.decoded_token_slot_bytes
            assert slot == (spec.mma_bn * spec.k_slice * hr.BF16_BYTES if spec.predecoded_tokens else 0)
            lay = spec.smem
            assert lay.dynamic_bytes == spec.stages * lay.stage_bytes + hr.DECODED_TOKEN_SLOTS * slot
            assert lay.decoded_tokens % hr.DATA_ALIGN == 0
            # the consumers split the decode evenly: every thread takes whole items
            if spec.predecoded_tokens:
                items = spec.n_side.rows * hd.QUAD * spec.n_side.groups // spec.token_decode_groups
                assert items % (hr.WARP_SIZE * spec.consumer_warps) == 0


@pytest.mark.parametrize("warps", hr.SMALL_N_WARP_CHOICES)
@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))   # bf16 tokens (W4A16) too: their copy is the pairing
@pytest.mark.parametrize("bn", [8, 16, 32])
def test_token_decode_items_cover_the_slice_once_with_conflict_free_loads(fmt, bn, warps):
    """The cooperative token decode: every (token row, quad lane, group) is decoded by exactly one
    item of one consumer thread; every thread has the same number of items, each inside one rotation
    run (one block-scale choice per run for UE8M0) and, for whole 16-byte chunks, the 8 lanes of a
    load phase read 8 different 16-byte bank groups (TMA's swizzle XOR included)."""
    if not eight_warp_legal(fmt, Stream(True, bn, 1)) and warps != hr.CONSUMER_WARPS_SMALL_N:
        pytest.skip(f"{fmt} bn{bn} has fewer token-decode items than 8 warps have threads: rejected "
                    "(test_eight_small_n_warps_are_checked)")
    spec = spec_of(fmt, Stream(True, bn, 1), small_n_warps=warps)
    side, groups, item_groups = spec.n_side, spec.n_side.groups, spec.token_decode_groups
    threads = hr.WARP_SIZE * spec.consumer_warps
    chunks = groups // item_groups
    items = side.rows * hd.QUAD * chunks
    assert items % threads == 0 and hd.ROTATION_RUN % item_groups == 0
    assert items // threads >= 1 and (item_groups == hd.ROTATION_RUN or items == threads), \
        "as many groups per item as keep every thread busy"
    quarters_per_box = side.box_bytes // side.thread_bytes
    seen = collections.Counter()
    for item in range(items):
        row, q, first = hs.token_decode_item(item, chunks, item_groups, quarters_per_box, side.rows)
        assert first // hd.ROTATION_RUN == (first + item_groups - 1) // hd.ROTATION_RUN
        for c in range(item_groups):
            seen[(row, q, first + c)] += 1
    assert seen == collections.Counter({(r, q, g): 1 for r in range(side.rows) for q in range(hd.QUAD)
                                        for g in range(groups)})
    item_bytes = item_groups * side.group_bytes
    if item_bytes >= 16:
        for phase_start in range(0, items, 8):
            for piece in range(item_bytes // 16):
                banks = []
                for item in range(phase_start, phase_start + 8):
                    row, q, first = hs.token_decode_item(item, chunks, item_groups, quarters_per_box, side.rows)
                    address = int(stage_group_address(side, row, q, first + piece * 16 // side.group_bytes))
                    banks.append(address // 16 % 8)
                assert len(set(banks)) == 8, (phase_start, piece, banks)


def test_swapped_scale_rows_sit_at_fixed_steps_from_the_first():
    """Swapped (weights on M, tiles from row 0 of an atom): a thread's rows g + 8 i lie
    ``scale_row_step(i)`` bytes after row g in the 128x4 layout, for every warp of every config, so the
    kernel adds constants to one per-tile base instead of recomputing each row's offset per stage
    (16-row warps of ``small_n_warps`` = 8 included)."""
    for name, config, warps in [(name, config, 4) for name, config in CONFIGS.items()] + [
            (name, config, 8) for name, config in CONFIGS.items() if config.mma_bn <= hr.SMALL_N_MAX_MMA_BN]:
        if not config.ab_swapped:
            continue
        spec = spec_of("nvfp4", config, small_n_warps=warps)
        warp_rows, _ = spec.warp_tile
        for warp_m in range(spec.warp_grid[0]):
            for g in range(8):
                first = warp_m * warp_rows + g
                for i in range(2 * warp_rows // hs.MMA_M):
                    for col, atoms in ((0, 1), (4, 4), (12, 7)):
                        step = scale_byte_offset(first + 8 * i, col, atoms) - scale_byte_offset(first, col, atoms)
                        assert step == hs.scale_row_step(i), (name, warp_m, g, i)


def test_eight_small_n_warps_are_checked():
    """``small_n_warps`` = 8: a column of 8 warps of 16 rows, one producer warp, no setmaxnreg, the same
    decoded-token slots and prefetching as 4 warps; refused for the large-N grid, for counts other than
    4 and 8, and where the stage's token-decode items would not split evenly over 256 threads."""
    spec = spec_of("nvfp4", CONFIGS["decode"], stages=2, small_n_warps=8)
    assert spec.warp_grid == (8, 1) and spec.warp_tile == (16, 8) and spec.consumer_warps == 8
    assert spec.producer_warps == 1 and spec.threads == 9 * hr.WARP_SIZE and not spec.uses_setmaxnreg
    assert spec.predecoded_tokens and spec.prefetch_groups
    assert spec.min_ctas_per_sm == hr.SMALL_N_EIGHT_WARPS_MIN_CTAS_PER_SM == 2, "two 9-warp CTAs per SM"
    assert spec_of("nvfp4", CONFIGS["decode"], small_n_warps=8).min_ctas_per_sm == 1, "the deepest ring fills the SM"
    assert hl.resident_ctas_per_sm(spec, 96) == 2, "5 warps of 96 registers per sub-partition"
    four = spec_of("nvfp4", CONFIGS["decode"], stages=2)
    assert spec.smem == four.smem and spec.tx_bytes == four.tx_bytes, "the ring does not change"
    assert not spec_of("nvfp4", CONFIGS["not_swapped_decode"], small_n_warps=8).predecoded_tokens
    with pytest.raises(ValueError, match="mma_bn <= 32"):
        spec_of("nvfp4", CONFIGS["small_prefill"], small_n_warps=8)
    with pytest.raises(ValueError, match="one of"):
        spec_of("nvfp4", CONFIGS["decode"], small_n_warps=6)
    with pytest.raises(ValueError, match="do not split evenly"):   # FP8 x FP8 (128-K slices): 128 items at bn8
        spec_of("mxfp8", CONFIGS["decode"], small_n_warps=8)
    assert eight_warp_legal("w4a8", Stream(True, 16, 1))
    rng = np.random.default_rng(3)
    problem = build_problem(random_activations(rng, 4, 256), random_weights(rng, 2, 64, 256), [3, 1], [1, 0],
                            fmt="nvfp4")
    assert plan_spec(problem, eight_warps(CONFIGS["decode"])).small_n_warps == 8
    with pytest.raises(ValueError, match="mma_bn <= 32"):
        plan_spec(problem, eight_warps(CONFIGS["small_prefill"]))
    for bad in (6, True, "8", None):   # the plan refuses what is not a warp count
        with pytest.raises(ValueError, match="small_n_warps must be one of"):
            plan_spec(problem, Stream(True, 8, 1, 2, bad))


def test_small_n_builds_ask_for_three_ctas_per_sm():
    """The 4-warp configs' launch bounds ask ptxas for min(3, what shared memory allows) CTAs per SM
    (<= 128 registers for 3); the 8-warp configs for one (setmaxnreg redistributes 384 x 168)."""
    for fmt in FORMATS:
        for name, config in CONFIGS.items():
            spec = spec_of(fmt, config, stages=2)
            by_smem = hr.SM90_SMEM_PER_SM // spec.smem.total_bytes
            target = hr.SMALL_N_WIDE_MIN_CTAS_PER_SM if spec.mma_bn >= 32 else hr.SMALL_N_MIN_CTAS_PER_SM
            expected = 1 if spec.uses_setmaxnreg else min(target, by_smem)
            assert spec.min_ctas_per_sm == expected >= 1, (fmt, name)


@pytest.mark.parametrize("max_tiles, k_slices, pair_slots, want", [
    (2048, 28, 396, (1, 28)),    # DeepSeek decode: the tiles fill the GPU, no split
    (36, 28, 396, (4, 7)),       # Kimi 8 x 1 at bn8: 11 slots per tile, but runs of >= 6 slices
    (36, 28, 132, (3, 10)),      # 3 runs of 10, 10, 8 slices
    (16, 28, 66, (4, 7)),        # pairs (cta_group 2)
    (1, 1, 132, (1, 1)),         # one slice cannot be split
    (5, 7, 132, (1, 7)),         # 7 slices: one run of >= 6
    (2, 28, 132, (4, 7)),        # 66 slots per tile, capped by the slice count: 4 runs of 7
    (10, 56, 396, (8, 7)),       # MXFP8 Kimi (56 slices): 39 slots per tile, 9 runs wanted: 8 of 7 (none empty)
])
def test_choose_k_splits(max_tiles, k_slices, pair_slots, want):
    got = gbs_plan.stream_k_splits(max_tiles, k_slices, pair_slots)
    assert got == want
    k_splits, per_split = got
    assert (k_splits - 1) * per_split < k_slices <= k_splits * per_split, "no empty run"


def test_split_runs_and_its_errors():
    assert hl.split_runs(28, 5) == (5, 6)
    assert hl.split_runs(28, 28) == (28, 1)
    assert hl.split_runs(7, 4) == (4, 2)
    assert hl.split_runs(9, 4) == (3, 3), "4 runs of 3 would leave one empty: 3 runs"
    for bad in (0, 29):
        with pytest.raises(ValueError, match="k_splits must be in"):
            hl.split_runs(28, bad)
    with pytest.raises(ValueError, match="max_tiles"):
        gbs_plan.stream_k_splits(0, 28, 132)


# (n = 512: 4 weight-row tiles per expert)
@pytest.mark.parametrize("fmt, total_tokens, slots, decided, want", [
    ("nvfp4", 256, 64, Stream(True, 8, 1, 6), Stream(True, 8, 1, 2)),      # decode: 256 tiles
    ("nvfp4", 8, 8, Stream(True, 64, 2, 6), Stream(True, 8, 1, 2, 8)),     # Kimi: 32 tiles
    ("mxfp4", 8, 8, Stream(True, 64, 2, 6), Stream(True, 8, 1, 2, 8)),
    ("nvfp4", 1024, 32, Stream(True, 64, 2, 6), Stream(True, 32, 1, 2, 8)),   # small prefill
    ("mxfp4", 512, 32, Stream(True, 64, 2, 6), Stream(True, 16, 1, 2, 8)),    # 128 tiles
    ("mxfp4", 528, 33, Stream(True, 64, 2, 6), Stream(True, 16, 1, 2)),       # 132 tiles
    ("w4a8", 640, 32, Stream(True, 64, 2, 6), Stream(True, 32, 1, 2)),     # FP8 tokens
    ("w4a8", 8, 8, Stream(True, 64, 2, 6), Stream(True, 8, 1, 2)),
    ("mxfp8", 4096, 64, Stream(True, 64, 2, 9), Stream(True, 64, 2, AUTO_STAGES)),
    ("mxfp8", 256, 64, Stream(False, 128, 1, 5), Stream(True, 8, 1, 2)),   # default route
    ("mxfp8", 16384, 32, Stream(False, 128, 1, 5), Stream(False, 128, 1, AUTO_STAGES)),
])
def test_h200_plan(fmt, total_tokens, slots, decided, want):
    """Small token tiles are cut to the tokens per expert, without a pair, on a 2-stage ring, on 8 warps
    for FP4 tokens where they are latency-bound (32-token tiles, or fewer tiles than SMs); the rest
    keep the decision's tile knobs with the deepest ring that fits."""
    problem = _problem(fmt, n=512, k=1024, group_sizes=[total_tokens // slots] * slots,
                       expert_ids=list(range(slots)), num_experts=slots)
    knobs, _ = gbs_plan.stream_knobs(problem, decided)
    assert Stream(**{"stages": AUTO_STAGES, **knobs}) == want
    a, b = PROBLEM_FORMATS[fmt]
    deepest = max_stages(a, b, want)
    assert plan_spec(problem, want).stages == (deepest if want.stages == AUTO_STAGES else want.stages)


def test_split_spec_is_its_own_kernel():
    spec = spec_of("nvfp4", CONFIGS["decode"])
    split = dataclasses.replace(spec, split_k=True)
    assert split != spec and hash(split) != hash(spec)



@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
def test_split_k_epilogue_reads_every_sum_before_it_stores():
    """The split-K build's last run reads its sums with plain L2 loads (``ld.global.cg``), every one issued before
    the first output store, so their latencies overlap; no ``atom.exch`` per word, which waited for each in turn.
    The build without split-K has neither."""
    spec = spec_of("nvfp4", CONFIGS["decode"], stages=2, small_n_warps=8)
    for split in (False, True):
        build = dataclasses.replace(spec, split_k=split)
        cubin = offline.compile_cubin(hs.make_kernel_function(build), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(build.threads, build.min_ctas_per_sm))
        instructions = offline.sass_instructions(offline.disassemble(cubin))
        reads = [i for i, ins in enumerate(instructions) if ins.startswith("LDG.E.STRONG.GPU")]
        zeroes = [i for i, ins in enumerate(instructions) if ins.startswith("STG.E.STRONG.GPU")]
        outputs = [i for i, ins in enumerate(instructions) if ins.startswith("STG.E.U16")]
        assert not [ins for ins in instructions if ins.startswith("ATOMG") and "EXCH" in ins]
        assert bool(reads) == bool(zeroes) == split
        if split:
            assert len(reads) == len(zeroes) >= 4, "one read and one zero per accumulator word"
            assert max(reads) < min(i for i in outputs if i > min(reads)), "every read before the first store"

# =============================================================================================
# Scale atoms after a TMA box: the kernel's addressing against the 128x4 layouts
# =============================================================================================
def tma_box_3d(tensor: np.ndarray, args: hl.TensorMapArgs, coords: tuple[int, int, int]) -> np.ndarray:
    """Bytes of a 3-D box of a C-contiguous (dims reversed) byte tensor, zero outside (no swizzle)."""
    assert args.swizzle == "none" and len(args.dims) == 3
    view = tensor.reshape(args.dims[::-1])
    out = np.zeros(args.box[::-1], np.uint8)
    c0, c1, c2 = coords
    src = view[c2:c2 + args.box[2], c1:c1 + args.box[1], c0:c0 + args.box[0]]
    out[:src.shape[0], :src.shape[1], :src.shape[2]] = src
    return out.reshape(-1)


def _problem(fmt, *, n, k, group_sizes, expert_ids, num_experts=4, seed=0):
    return synthetic_problem(fmt, n=n, k=k, group_sizes=group_sizes, expert_ids=expert_ids,
                             num_experts=num_experts, seed=seed)


def _shapes_and_fake_addresses(problem):
    shapes = {name: problem.__getattribute__(name).shape for name in launch.PROBLEM_ARRAY_DTYPES}
    addresses = {name: (i + 1) << 20 for i, name in enumerate(launch.PROBLEM_ARRAY_DTYPES)}
    return shapes, addresses


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", ["decode", "not_swapped_wide", "wide"])
def test_weight_scale_atoms_land_where_the_consumers_read(fmt, config):
    spec = spec_of(fmt, CONFIGS[config])
    p = _problem(fmt, n=640, k=2 * spec.k_slice, group_sizes=[3], expert_ids=[2])
    shapes, addresses = _shapes_and_fake_addresses(p)
    args = hl.tensor_map_args(spec, shapes, addresses)[3]
    side = spec.weight_side
    bands_per_expert = p.b_scales.shape[1]
    linear = unswizzle_scales(p.b_scales, p.n, p.b_format.scale_cols(p.k))   # (E, N, C)
    atoms = side.sf_atoms_per_slice
    cols_per_slice = spec.k_slice // p.b_format.block_size
    for expert in (0, 2, 3):
        for row0 in (0, 256, 512):       # the CTA's first weight row (a band boundary)
            for s in range(p.k // spec.k_slice):
                image = np.concatenate([
                    tma_box_3d(p.b_scales, args, (0, s * hr.ATOM_MAP_ROWS * atoms,
                                                  hr.weight_scale_band(expert, bands_per_expert, row0) + b))
                    for b in range(side.scale_bands)])
                for r in range(side.rows):
                    for q in range(hd.QUAD):
                        word = image[scale_byte_offset(r, hd.scale_word_column(q, side.blocks_per_thread), atoms):][:4]
                        for b in range(side.blocks_per_thread):
                            got = word[hd.scale_byte_index(q, side.blocks_per_thread, b)]
                            row = row0 + r
                            if row >= p.n:      # rows past N are zero data, masked at the store
                                continue
                            col = s * cols_per_slice + q * side.blocks_per_thread + b
                            assert got == linear[expert, row, col], f"expert {expert} row {row} slice {s} q {q} b {b}"


@pytest.mark.parametrize("config", ["decode", "small_prefill", "wide", "not_swapped", "wide_cg1", "wgmma_ring_256"])
def test_token_scale_atoms_land_where_the_consumers_read(config):
    fmt = "nvfp4"
    spec = spec_for_case(fmt, config)
    sizes = [5, 0, 1, 300, 130, 7]
    p = _problem(fmt, n=256, k=spec.k_slice, group_sizes=sizes, expert_ids=[0, 1, -1, 2, 3, 1])
    shapes, addresses = _shapes_and_fake_addresses(p)
    args = hl.tensor_map_args(spec, shapes, addresses)[2]
    side = spec.token_side
    linear = gather_group_scales(p.a_scales, p.a_offsets, p.a_scale_offsets, p.a_format.scale_cols(p.k))
    atoms = side.sf_atoms_per_slice
    shape = spec.tile_shape
    for tile in schedule.iter_tiles(p.a_offsets, p.expert_ids, p.n, shape):
        g = tile.slot
        start = int(p.a_offsets[g])
        band = hr.token_scale_band(start, int(p.a_scale_offsets[g]), tile.token_start)
        image = np.concatenate([tma_box_3d(p.a_scales, args, (0, 0, band + b)) for b in range(side.scale_bands)])
        row0 = (tile.token_start - start) % SF_ATOM_ROWS
        for t in range(tile.num_tokens):
            for q in range(hd.QUAD):
                bpt = side.blocks_per_thread
                word = image[scale_byte_offset(row0 + t, hd.scale_word_column(q, bpt), atoms):][:4]
                got = word[[hd.scale_byte_index(q, bpt, b) for b in range(bpt)]]
                want = linear[tile.token_start + t, q * side.blocks_per_thread:(q + 1) * side.blocks_per_thread]
                np.testing.assert_array_equal(got, want, err_msg=f"tile {tile}, token {t}, q {q}")


@pytest.mark.parametrize("config, k_splits, slices_per_split, num_pairs", [
    ("decode", 1, 28, 5), ("decode", 4, 7, 13), ("decode", 3, 3, 1), ("not_swapped", 1, 4, 3),
    ("wide_cg1", 2, 2, 7), ("wgmma_ring_256", 1, 4, 3)])
def test_device_walk_visits_the_tiles_of_the_host_walk(config, k_splits, slices_per_split, num_pairs):
    """The kernels' 32-bit walk (``make_ring(spec).next_work``, run here as Python) with its cursor, as every
    CTA pair steps through its work items, finds exactly ``schedule.iter_tiles``' tiles and K runs: ragged
    groups, an empty group, a -1 slot, a 1-token group, N not a multiple of the tile."""
    spec = dataclasses.replace(spec_for_case("nvfp4", config), split_k=k_splits > 1)
    next_work = hr.make_ring(spec).next_work.py_func
    sizes = [5, 0, 1, 300, 130, 7, 9]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint32)
    expert_ids = np.array([0, 1, -1, 2, 3, 1, 2], np.int32)
    n = 2 * spec.tile_shape.weight_rows + 40
    want = list(schedule.iter_tiles(offsets, expert_ids, n, spec.tile_shape))
    got = {}
    for pair in range(num_pairs):
        cursor_slot, cursor_first = np.uint32(0), np.uint32(0)
        work = pair
        while True:
            slot, expert, tile, t0, t1, r0, r1, s_begin, cursor_slot, cursor_first = next_work(
                work, cursor_slot, cursor_first, offsets, expert_ids, n, k_splits, slices_per_split)
            if slot < 0:
                assert work >= len(want) * k_splits
                break
            got[work] = (int(tile), int(slot), int(expert), int(t0), int(t1), int(r0), int(r1), int(s_begin))
            work += num_pairs
    assert sorted(got) == list(range(len(want) * k_splits))
    for work, fields in got.items():
        t = want[work // k_splits]
        assert fields == (t.index, t.slot, t.expert, t.token_start, t.token_end, t.row_start, t.row_end,
                          (work % k_splits) * slices_per_split), work


def test_work_records_round_trip_through_the_stage_words():
    """What the producer writes into a stage's record the consumers read back (``make_ring``'s device
    functions, run here as Python on a host copy of the shared ``bars`` words), the end mark included."""
    spec = spec_of("nvfp4", CONFIGS["decode"], stages=3)
    ring = hr.make_ring(spec)
    bars = np.zeros(2 * spec.stages + hr.SPLIT_FLAG_WORDS + hr.WORK_RECORD_WORDS * spec.stages, np.uint64)
    write_record = ring.write_work_record.py_func
    unpack_record = ring.unpack_work_record.py_func
    record_base = 2 * spec.stages + hr.SPLIT_FLAG_WORDS
    items = {0: (5, 7, 100, 108, 256, 384, 3, 96), 1: (0, 0, 0, 1, 0, 40, 0, 0),
             2: (hr.NO_MORE_WORK, 0, 0, 0, 0, 0, 0, 0)}
    for stage, fields in items.items():
        write_record(bars, stage, *map(np.uint32, fields))
    assert not bars[:2 * spec.stages + hr.SPLIT_FLAG_WORDS].any(), "the mbarriers and the split flag are untouched"
    for stage, fields in items.items():
        rec = record_base + hr.WORK_RECORD_WORDS * stage
        got = tuple(int(v) for v in unpack_record(*bars[rec:rec + hr.WORK_RECORD_WORDS]))
        want = (-1,) + fields[1:] if fields[0] == hr.NO_MORE_WORK else fields
        assert got == want, stage


@pytest.mark.parametrize("width", [np.uint32, np.int64])
def test_next_stage_walks_the_ring_and_flips_the_phase_after_the_last_stage(width):
    """``make_ring(spec).next_stage`` (run here as Python), as the producer and the consumers step the ring: stages
    0, 1, 2, 0... with the phase flipped at each wrap, in the caller's integer width (the streaming consumer's
    32-bit position, the others' 64-bit one)."""
    next_stage = hr.make_ring(spec_of("nvfp4", CONFIGS["decode"], stages=3)).next_stage.py_func
    stage, phase, walked = width(0), width(0), []
    for _ in range(7):
        stage, phase = next_stage(stage, phase)
        assert type(stage) is width and type(phase) is width
        walked.append((int(stage), int(phase)))
    assert walked == [(1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 0), (1, 0)]


def test_ring_m_rows_256_is_the_wgmma_rings_only():
    """``StreamSpec.m_rows`` = 256: 256 token rows in two scale bands, one token box of 256 rows (TMA's
    limit), 256-token tiles for the walk; refused where the tokens are not the M side or a pair shares
    them, and by this kernel's own consumers."""
    spec = spec_for_case("nvfp4", "wgmma_ring_256")
    assert spec.m_side.role == "tokens" and spec.m_side.rows == 256 and spec.m_side.scale_bands == 2
    assert spec.token_box[1] == 256 and spec.tile_shape.tokens == 256 and spec.tile_shape.weight_rows == 128
    loads = hr.stage_loads(spec)
    assert [size for what, _, size, _ in loads if what == "tokens"] == [256 * spec.token_side.row_bytes]
    assert len([what for what, _, _, _ in loads if what == "token scales"]) == 2
    assert sum(size for _, _, size, _ in loads) == spec.tx_bytes
    for config in ("decode", "small_prefill", "mid"):
        with pytest.raises(ValueError, match="m_rows=256"):
            dataclasses.replace(spec_of("nvfp4", CONFIGS[config]), m_rows=256)
    with pytest.raises(ValueError, match="m_rows must be one of"):
        dataclasses.replace(spec_of("nvfp4", CONFIGS["not_swapped"]), m_rows=192)
    with pytest.raises(ValueError, match="consumers take 128 M rows"):
        hs.make_kernel_function(spec)


def test_dynamic_items_only_for_single_ctas():
    from gbs.numba_kernels import h200_wgmma

    assert spec_of("nvfp4", CONFIGS["decode"]).dynamic_items
    assert spec_of("nvfp4", CONFIGS["not_swapped"]).dynamic_items
    assert not spec_of("nvfp4", CONFIGS["small_prefill"]).dynamic_items, "a pair takes static items"
    a, b = PROBLEM_FORMATS["nvfp4"]
    assert h200_wgmma.WgmmaSpec(a, b, 128, 2).ring.dynamic_items, "the wgmma kernel's single CTAs too"


# =============================================================================================
# Stage carve-up, boxes, tensor maps, stages
# =============================================================================================
ALL_KNOBS = [Stream(sw, bn, cg) for sw in (True, False) for cg in (1, 2) for bn in (8, 16, 32, 64, 128, 256)
             if not (cg == 2 and (not sw or bn < 64))]


@pytest.mark.parametrize("fmt", FORMATS)
def test_stage_boxes_tile_the_stage_and_sum_to_expect_tx(fmt):
    for config in ALL_KNOBS:
        spec = spec_of(fmt, config)
        lay = spec.smem
        loads = sorted(hr.stage_loads(spec), key=lambda x: x[1])
        assert sum(size for _, _, size, _ in loads) == spec.tx_bytes
        end = 0
        for what, offset, size, _ in loads:
            assert offset >= end, f"{config}: {what} overlaps the previous box"
            align = hr.DATA_ALIGN if what in ("weights", "tokens") and size >= hr.DATA_ALIGN else hr.SCALE_ALIGN
            assert offset % align == 0, f"{config}: {what} at {offset}"
            end = offset + size
        assert end <= lay.stage_bytes and lay.stage_bytes % hr.DATA_ALIGN == 0
        assert spec.tx_bytes < 2 ** 20, "expect_tx counts fit the mbarrier's tx field"
        # the deepest ring fits the H200, one more stage does not
        assert lay.total_bytes <= H200_SMEM_PER_SM
        assert dataclasses.replace(spec, stages=spec.stages + 1).smem.total_bytes > H200_SMEM_PER_SM
        assert all(box <= 256 for box in spec.token_box + spec.weight_box + spec.scale_box)


def test_real_and_formula_stage_counts_for_the_regimes():
    """Report both (the formula counts SM100's bytes); pin the real ones the docs quote."""
    got = {}
    for fmt in FORMATS:
        a, b = PROBLEM_FORMATS[fmt]
        for name in ("decode", "small_prefill", "large_prefill", "not_swapped"):
            config = CONFIGS[name]
            formula = pipeline_smem_terms(mma_bn=config.mma_bn, cta_group=config.cta_group,
                                          ab_swapped=config.ab_swapped,
                                          num_sf_k_tiles=spec_of(fmt, config, 1).m_side.sf_atoms_per_slice,
                                          smem_per_sm=H200_SMEM_PER_SM).stages
            got[fmt, name] = (max_stages(a, b, config), formula)
    assert got["nvfp4", "decode"] == (10, 10)
    assert got["nvfp4", "small_prefill"] == (7, 8), "the shared routing copy (4 KiB) costs the 8th stage"
    assert got["nvfp4", "large_prefill"] == (6, 7), "both CTAs of a pair hold the whole token tile here"
    assert got["mxfp8", "decode"][0] >= 12
    assert all(real >= 4 for real, _ in got.values())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", ["decode", "small_prefill", "not_swapped", "wide", "not_swapped_wide"])
def test_tensor_map_arguments_are_valid(fmt, config):
    spec = spec_of(fmt, CONFIGS[config])
    p = _problem(fmt, n=512, k=4 * spec.k_slice, group_sizes=[9, 0, 200], expert_ids=[1, 0, 3])
    shapes, addresses = _shapes_and_fake_addresses(p)
    maps = hl.tensor_map_args(spec, shapes, addresses)
    assert [m.name for m in maps] == ["a", "b", "a_scales", "b_scales"]
    for m in maps:
        m.check()
    assert math_prod(maps[0].box) == math_prod(spec.token_box)
    assert maps[1].dims == (p.b.shape[2] * p.b.itemsize, p.n, p.num_experts)
    # scale views cover the arrays exactly
    for m, arr in ((maps[2], p.a_scales), (maps[3], p.b_scales)):
        assert math_prod(m.dims) == arr.size


FP4_WEIGHT_FORMATS = tuple(f for f in FORMATS if get_format(PROBLEM_FORMATS[f][1]).packed)


def tma_box_2d(tensor: np.ndarray, args: hl.TensorMapArgs, coords: tuple[int, int]) -> np.ndarray:
    """Bytes of a 2-D box of a C-contiguous byte tensor, zero outside (before the swizzle, which both weight
    maps apply alike: same box width, same shared-memory destination)."""
    assert len(args.dims) == 2 and args.strides == (args.dims[0],)
    view = tensor.reshape(args.dims[::-1])
    (x, y), (width, rows) = coords, args.box
    out = np.zeros((rows, width), np.uint8)
    src = view[y:y + rows, x:x + width]
    out[:src.shape[0], :src.shape[1]] = src
    return out.reshape(-1)


@pytest.mark.parametrize("n, k_tail", [(384, 0), (200, 96)])   # whole boxes; N and K tails (stored padded)
@pytest.mark.parametrize("layout", [LAYOUT_E2M1_H200_TILED, LAYOUT_E2M1_H200_FUSED])
@pytest.mark.parametrize("fmt", FP4_WEIGHT_FORMATS)
@pytest.mark.parametrize("config", ["decode", "not_swapped", "not_swapped_wide", "not_swapped_decode", "wide"])
def test_tiled_weight_loads_fill_the_stage_with_the_row_major_box(fmt, config, layout, n, k_tail):
    """Tiled weights (``E2M1H200TiledOrder``, and ``E2M1H200FusedOrder`` with the scales in the chunks): the
    producer's 2-D loads (``tiled_weight_row``, one per 128-row box part) put in a stage the bytes its 3-D
    load of the untiled weights does, for every expert, weight tile and K slice (64-byte slices of W4A8
    included: half a box's width), on every row below N; fused, the weight-scale loads from ``b`` put there
    the bytes of the 3-D loads of ``b_scales``, band by band. With N and K tails (N = 200, K 96 past whole
    slices) the tiled weights are stored padded and the last K slice reads the pad's zeros where the row-major
    map reads its zero fill."""
    base = spec_of(fmt, CONFIGS[config])
    spec = dataclasses.replace(base, b_layout=layout)
    p = _problem(fmt, n=n, k=4 * spec.k_slice + k_tail, group_sizes=[3], expert_ids=[2])   # 256-row tiles past N
    untiled = p.with_b_layout(LAYOUT_E2M1_H200)
    tiled = p.with_b_layout(layout)
    assert not np.array_equal(tiled.b[..., :untiled.b.shape[2]], untiled.b)
    shapes, addresses = _shapes_and_fake_addresses(tiled)
    maps = hl.tensor_map_args(spec, shapes, addresses)
    row_major_maps = hl.tensor_map_args(dataclasses.replace(spec, b_layout=LAYOUT_E2M1_H200),
                                        _shapes_and_fake_addresses(untiled)[0], addresses)
    row_major, row_major_scales = row_major_maps[1], dataclasses.replace(row_major_maps[3], swizzle="none")
    for m in maps:
        m.check()
    assert maps[1].swizzle == row_major.swizzle and maps[1].box[0] == row_major.box[0]
    fused = layout == LAYOUT_E2M1_H200_FUSED
    assert (maps[3].global_address == maps[1].global_address) == fused
    w_bytes, w_rows, _ = spec.weight_box
    parts = spec.tiled_weight_loads
    assert parts == (2 if w_rows == 256 else 1) and maps[1].box[1] * parts == w_rows
    k_slices, bands = hl.k_slices_of(p.k, spec.k_slice), spec.weight_side.scale_bands
    row_tiles = -(-p.n // hr.TILED_BOX_ROWS)   # what the producer computes: the stored (padded) boxes
    k_boxes = -(-k_slices * w_bytes // hr.TILED_BOX_BYTES)
    assert tiled.b.shape[1] == row_tiles * hr.TILED_BOX_ROWS
    sf_rows = spec.scale_box[1]
    for expert in range(p.num_experts):
        for row0 in range(0, p.n, w_rows):
            for s in range(k_slices):
                want = tma_box_3d_any(untiled.b, row_major, (s * w_bytes, row0, expert))
                k_byte = s * w_bytes
                got = np.concatenate([
                    tma_box_2d(tiled.b, maps[1], (k_byte % hr.TILED_BOX_BYTES, hr.tiled_weight_row(
                        expert, row0 + part * hr.TILED_BOX_ROWS, k_byte, row_tiles, k_boxes, spec.weight_chunk_rows)))
                    for part in range(parts)])
                # rows past N: zero fill in the row-major map, the next expert's first box (or the tiled map's
                # zero fill) here; their outputs are never stored
                valid = min(w_rows, p.n - row0) * w_bytes
                np.testing.assert_array_equal(got[:valid], want[:valid],
                                              err_msg=f"expert {expert} row {row0} slice {s}")
                if not fused:
                    continue
                for b in range(bands):
                    band_row = (row0 // hr.TILED_BOX_ROWS + b) * hr.TILED_BOX_ROWS
                    if band_row >= p.n:
                        continue
                    chunk = hr.tiled_weight_row(expert, band_row, k_byte, row_tiles, k_boxes, spec.weight_chunk_rows)
                    got_sf = tma_box_2d(tiled.b, maps[3], (0, chunk + hr.TILED_BOX_ROWS + k_byte % hr.TILED_BOX_BYTES
                                                           // w_bytes * sf_rows))
                    want_sf = tma_box_3d(untiled.b_scales, row_major_scales,
                                         (0, s * sf_rows, hr.weight_scale_band(expert, row_tiles, row0) + b))
                    np.testing.assert_array_equal(got_sf, want_sf, err_msg=f"scales: expert {expert} row {row0} "
                                                  f"slice {s} band {b}")
    loads = [(offset, size) for what, offset, size, _ in hr.stage_loads(spec) if what == "weights"]
    assert [size for _, size in loads] == [w_bytes * w_rows // parts] * parts
    assert sum(size for _, _, size, _ in hr.stage_loads(spec)) == spec.tx_bytes == base.tx_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_k_tail_reads_zeros_past_k_through_the_exact_maps(fmt):
    """K = 3 slices + 96 elements: the tokens' and row-major weights' maps span exactly K's bytes and the scale maps
    exactly the atoms' column groups, so the partial last slice's boxes hold the operand's bytes up to K and TMA's
    zero fill past it (the scale columns past the last atom group too): nothing past K can add to the sum."""
    spec = spec_of(fmt, CONFIGS["decode"])
    k = 3 * spec.k_slice + 96
    p = _problem(fmt, n=200, k=k, group_sizes=[5, 3], expert_ids=[1, 0])
    shapes, addresses = _shapes_and_fake_addresses(p)
    tokens, weights, token_sf, weight_sf = hl.tensor_map_args(spec, shapes, addresses)
    a_bytes, b_bytes = p.a_format.row_bytes(k), p.b_format.row_bytes(k)
    assert tokens.dims[0] == a_bytes and weights.dims[0] == b_bytes
    last = hl.k_slices_of(k, spec.k_slice) - 1
    slice_bytes = spec.token_side.row_bytes   # the slice's boxes (2 for FP8 tokens in a 256-K slice)
    assert 0 < a_bytes - last * slice_bytes < slice_bytes
    for box in range(spec.token_side.boxes):
        start = last * slice_bytes + box * tokens.box[0]
        t_box = tma_box_2d(p.a.view(np.uint8), dataclasses.replace(tokens, swizzle="none"),
                           (start, 0)).reshape(tokens.box[1], tokens.box[0])
        inside = min(max(0, a_bytes - start), tokens.box[0])
        np.testing.assert_array_equal(t_box[:p.total_tokens, :inside], p.a.view(np.uint8)[:, start:start + inside])
        assert not t_box[:, inside:].any()
    w_box = tma_box_3d_any(p.b.view(np.uint8), weights, (last * weights.box[0], 0, 1))
    w_box = w_box.reshape(weights.box[2], weights.box[1], weights.box[0])[0]
    assert not w_box[:, b_bytes - last * weights.box[0]:].any()
    for args, scales in ((token_sf, p.a_scales), (weight_sf, p.b_scales)):
        groups = scales.shape[-4]   # the atoms' column groups: K's scale columns rounded up to 4
        assert args.dims[1] == hr.ATOM_MAP_ROWS * groups
        rows = tma_box_3d(scales, args, (0, last * spec.scale_box[1], 0)).reshape(args.box[::-1])[0]
        present = groups * hr.ATOM_MAP_ROWS - last * spec.scale_box[1]
        assert 0 < present <= rows.shape[0] and not rows[present:].any()


def tma_box_3d_any(tensor: np.ndarray, args: hl.TensorMapArgs, coords: tuple[int, int, int]) -> np.ndarray:
    """``tma_box_3d`` for a swizzled map, before the swizzle (see ``tma_box_2d``)."""
    return tma_box_3d(tensor, dataclasses.replace(args, swizzle="none"), coords)


def test_tiled_weights_are_refused_where_they_cannot_be_read():
    """The tiled layout: weights only, FP4 only, stored in whole boxes (N and K/2 padded to multiples of 128):
    each a clear error before anything is written; every legal weight tile reads whole boxes or a part of one."""
    p = _problem("nvfp4", n=512, k=512, group_sizes=[4], expert_ids=[0])
    with pytest.raises(ValueError, match="'e2m1_h200_tiled' is for weights, not tokens"):
        p.with_a_layout(LAYOUT_E2M1_H200_TILED)
    with pytest.raises(ValueError, match="re-lays FP4"):
        _problem("mxfp8", n=512, k=512, group_sizes=[4], expert_ids=[0]).with_b_layout(LAYOUT_E2M1_H200_TILED)
    for n, k in ((512 + 64, 512), (512, 512 + 64)):   # stored padded by with_b_layout; not as a bare tag
        odd = _problem("nvfp4", n=n, k=k, group_sizes=[4], expert_ids=[0])
        stored = odd.with_b_layout(LAYOUT_E2M1_H200_TILED).b.shape
        assert stored == (odd.num_experts, 640 if n > 512 else 512, 384 if k > 512 else 256)
        with pytest.raises(ValueError, match="boxes of 128 rows x 128 bytes"):
            dataclasses.replace(odd, b_layout=LAYOUT_E2M1_H200_TILED)   # a tag on bytes that are not stored padded
    a, b = PROBLEM_FORMATS["nvfp4"]
    for config in ALL_KNOBS:   # every legal weight tile is whole boxes or a power-of-2 part of one
        spec = hr.StreamSpec(a, b, config.ab_swapped, config.mma_bn, config.cta_group, 2,
                             b_layout=LAYOUT_E2M1_H200_TILED)
        rows = spec.weight_box[1]
        assert rows % hr.TILED_BOX_ROWS == 0 or hr.TILED_BOX_ROWS % rows == 0, config
    tiled = p.with_b_layout(LAYOUT_E2M1_H200_TILED)
    shapes, addresses = _shapes_and_fake_addresses(tiled)
    shapes["b"] = (4, 512 + 64, 256)
    with pytest.raises(ValueError, match="boxes of 128 rows x 128 bytes"):
        hl.tensor_map_args(hr.StreamSpec(a, b, True, 8, 1, 2, b_layout=LAYOUT_E2M1_H200_TILED), shapes, addresses)


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
def test_tiled_weights_build_only_the_producer_differently():
    """Offline SASS: tiled and fused weights change the producer's loads only: the hot K-slice loop, registers
    and local memory are the row-major build's; tiled, 2-D weight loads replace the 3-D ones, fused, the weight
    scales' 3-D loads become 2-D too."""
    facts = {}
    for layout in (LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_TILED, LAYOUT_E2M1_H200_FUSED):
        spec = dataclasses.replace(spec_of("nvfp4", CONFIGS["decode"]), b_layout=layout)
        cubin = offline.compile_cubin(hs.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(spec.threads, spec.min_ctas_per_sm))
        sass = offline.disassemble(cubin)
        hot = [loop for loop in offline.sass_loops(sass) if loop.count("HMMA")][0]
        resources = offline.resource_usage(cubin)
        loads = collections.Counter(op.split()[0].split(".")[1] for op in offline.sass_instructions(sass)
                                    if op.startswith("UTMALDG."))
        facts[layout] = (hot.opcodes, resources.registers, resources.local_bytes, loads["2D"], loads["3D"])
    (hot, regs, local, loads_2d, loads_3d), (t_hot, t_regs, t_local, t_loads_2d, t_loads_3d), fused = facts.values()
    assert t_hot == hot and t_regs == regs and t_local == local == 0
    assert t_loads_2d - loads_2d == loads_3d - t_loads_3d > 0, "2-D weight loads in place of the 3-D ones"
    f_hot, f_regs, f_local, f_loads_2d, f_loads_3d = fused
    assert f_hot == hot and f_regs == regs and f_local == 0
    assert f_loads_2d - t_loads_2d == t_loads_3d - f_loads_3d > 0, "2-D weight-scale loads in place of the 3-D ones"


def math_prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def test_max_tiles_bound_covers_the_walk():
    rng = np.random.default_rng(3)
    for _ in range(50):
        sizes = rng.integers(0, 300, rng.integers(1, 9))
        ids = np.where(rng.random(sizes.size) < 0.2, -1, rng.integers(0, 4, sizes.size))
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for config in (CONFIGS["decode"], CONFIGS["wide"], CONFIGS["not_swapped"]):
            spec = spec_of("nvfp4", config)
            n = int(rng.integers(1, 1000))
            walk = schedule.total_tiles(offsets, ids, n, spec.tile_shape)
            assert hl.max_tiles_bound(spec, int(sizes.sum()), sizes.size, n) >= walk


# =============================================================================================
# can_implement and config errors
# =============================================================================================
def test_can_implement_accepts_dispatch_configs_and_reports_why_not():
    p = _problem("nvfp4", n=256, k=512, group_sizes=[4, 0, 9], expert_ids=[0, -1, 1])
    ok, why = can_implement(p, Stream(True, 8, 1))
    assert ok and why == ""
    decided = grouped_matmul_nvfp4_dispatch(n=256, k=512, num_active_experts=3, estimated_total_m=13)
    assert plan_spec(p, decided).stages == decided.num_pipeline_stages


def test_k_tails_run_and_rows_tma_cannot_load_are_rejected_with_the_padding_to_use():
    """K need not be a multiple of the K slice (gpt-oss's 2880: the last slice reads zeros past K); rows whose
    bytes TMA cannot address (not a multiple of 16) are refused with the K to pad to."""
    for fmt, k in (("nvfp4", 384), ("mxfp4", 352), ("mxfp8", 416), ("w4a8", 352)):
        p = _problem(fmt, n=200, k=k, group_sizes=[4], expert_ids=[0])
        assert can_implement(p, Stream(True, 8, 1))[0], (fmt, k)
        assert hl.k_slices_of(k, plan_spec(p, Stream(True, 8, 1)).k_slice) == -(-k // (256 if fmt in (
            "nvfp4", "mxfp4", "w4a8") else 128)), "FP4 weights: 256-K slices in the decoded-token tiles"
    odd = _problem("nvfp4", n=128, k=400, group_sizes=[4], expert_ids=[0])
    with pytest.raises(ValueError, match=r"K=400: rows of a \(nvfp4\) are 200 bytes; TMA needs a multiple of 16 "
                                         r"\(K a multiple of 32\); pad K to 416"):
        plan_spec(odd, Stream(True, 8, 1))
    ok, why = can_implement(odd, Stream(True, 8, 1))
    assert not ok and "pad K to 416" in why


def test_too_many_stages_are_refused_and_a_configs_are_capped():
    """A stage constraint that does not fit is refused, naming the limit; a caller's SM100 config (B200 stage
    counts) is capped at the deepest ring, and the plan says so; the launch layer refuses a build that does not
    fit whatever asked for it."""
    p = _problem("nvfp4", n=256, k=512, group_sizes=[40], expert_ids=[0])
    with pytest.raises(ValueError, match=r"7 pipeline stages do not fit the H200.*at most 6 stages"):
        plan_spec(p, Stream(True, 128, 2, 7))
    decided = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8000)
    assert decided.num_pipeline_stages == 7 and decided.mma_bn == 128
    plan = gbs_plan.plan_h200(p, decided)
    assert plan.spec.stages == 6 and any("capped" in rule.decided for rule in plan.rules)
    with pytest.raises(ValueError, match="do not fit the H200"):
        hl.check_can_implement(p, dataclasses.replace(plan.spec, stages=7))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(ab_swapped=False, mma_bn=128, cta_group=2), ValueError, "cta_group=2 requires ab_swapped"),
    (dict(ab_swapped=True, mma_bn=24, cta_group=1), ValueError, "mma_bn=24 is illegal"),
    (dict(ab_swapped=True, mma_bn=32, cta_group=2), ValueError, "mma_bn=32 is illegal with cta_group=2"),
    (dict(ab_swapped=True, mma_bn=8, cta_group=1, stages=0), ValueError, "stages must be a positive int"),
    (dict(ab_swapped=True, mma_bn=8, cta_group=1, stages=2.0), ValueError, "stages must be a positive int"),
    (dict(ab_swapped=1, mma_bn=8, cta_group=1), TypeError, "ab_swapped must be a bool"),
])
def test_plan_constraints_reject_illegal_knobs(kwargs, error, match):
    p = _problem("nvfp4", n=128, k=512, group_sizes=[4], expert_ids=[0])
    with pytest.raises(error, match=match):
        plan_spec(p, Stream(**kwargs))


def test_config_for_other_formats_and_bad_types_are_rejected():
    p = _problem("mxfp4", n=128, k=512, group_sizes=[4], expert_ids=[0])
    nvfp4_config = grouped_matmul_nvfp4_dispatch(n=128, k=512, num_active_experts=1, estimated_total_m=4)
    with pytest.raises(ValueError, match="decided for nvfp4 x nvfp4, the problem is mxfp4 x mxfp4"):
        plan_spec(p, nvfp4_config)
    with pytest.raises(TypeError, match="problem must be"):
        plan_spec("problem", Stream(True, 8, 1))
    with pytest.raises(TypeError, match="KernelConfig"):
        plan_spec(p, object())
    with pytest.raises(ValueError, match="stages must be a positive int"):
        hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 0)
    with pytest.raises(ValueError, match="unsupported operand formats"):
        hr.StreamSpec("nvfp4", "mxfp4", True, 8, 1, 2)


@pytest.mark.skipif(launch.gpu_compute_capability() is not None, reason="checks the no-GPU error")
def test_running_without_a_gpu_is_a_clear_error():
    p = _problem("nvfp4", n=128, k=256, group_sizes=[4], expert_ids=[0])
    with pytest.raises(launch.NoSuitableGPUError, match="needs an sm_90 GPU"):
        run(p, Stream(True, 8, 1))


# =============================================================================================
# Launch helper (host side)
# =============================================================================================
def _fake_kernel(cluster=1, dynamic=1000, static=2048):
    overload = type("Overload", (), {"shared_mem_per_block": static})()
    return launch.CompiledKernel(overload, threads=160, dynamic_smem_bytes=dynamic, cluster_size=cluster, name="k")


def test_check_launch_rejects_bad_grids_clusters_and_shared_memory():
    launch.check_launch(_fake_kernel(2), 4, smem_limit=H200_SMEM_PER_SM)
    with pytest.raises(ValueError, match="not a multiple of the cluster size 2"):
        launch.check_launch(_fake_kernel(2), 5, smem_limit=H200_SMEM_PER_SM)
    with pytest.raises(ValueError, match="positive int"):
        launch.check_launch(_fake_kernel(), 0, smem_limit=H200_SMEM_PER_SM)
    with pytest.raises(ValueError, match="cluster size 9"):
        launch.check_launch(_fake_kernel(9), 9, smem_limit=H200_SMEM_PER_SM)
    with pytest.raises(ValueError, match="B dynamic"):
        launch.check_launch(_fake_kernel(dynamic=H200_SMEM_PER_SM), 1, smem_limit=H200_SMEM_PER_SM)


def test_compile_kernel_checks_its_launch_bounds_before_compiling():
    """Bad launch bounds are refused before any JIT work (no GPU needed to see the error)."""
    for threads in (0, 100, 2048):
        with pytest.raises(ValueError, match="threads must be a multiple of 32"):
            launch.compile_kernel(None, (), threads=threads, dynamic_smem_bytes=0)
    for min_blocks in (0, -1):
        with pytest.raises(ValueError, match="min_blocks must be >= 1"):
            launch.compile_kernel(None, (), threads=160, dynamic_smem_bytes=0, min_blocks=min_blocks)
    for min_blocks in (1.5, True):
        with pytest.raises(TypeError, match="min_blocks must be an int"):
            launch.compile_kernel(None, (), threads=160, dynamic_smem_bytes=0, min_blocks=min_blocks)


def test_cluster_launches_count_the_grid_in_clusters():
    assert launch.launch_config_fields(_fake_kernel(2), 132)["grid"] == (66, 1, 1)
    assert launch.launch_config_fields(_fake_kernel(2), 132)["cluster"] == (2, 1, 1)
    assert launch.launch_config_fields(_fake_kernel(1), 132) == {
        "grid": (132, 1, 1), "block": (160, 1, 1), "shmem_size": 1000}


def test_device_problem_shape_checks():
    p = _problem("nvfp4", n=256, k=512, group_sizes=[4, 6], expert_ids=[0, 1])
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(launch.DeviceProblem)
              if f.name != "host_routing"}   # the plans' host copies, not a shape
    launch._check_device_shapes(launch.DeviceProblem(**fields))
    bad = dict(fields, b_scales=p.b_scales[:, :1])
    with pytest.raises(ValueError, match="b_scales must have shape"):
        launch._check_device_shapes(launch.DeviceProblem(**bad))
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        launch._check_device_shapes(launch.DeviceProblem(**dict(fields, expert_ids=p.expert_ids[:1])))
    with pytest.raises(TypeError, match="lacks"):
        launch.to_device(object())


def test_tensor_map_buffer_rejects_wrong_sizes():
    with pytest.raises(ValueError, match="tensor map 1 has 64 bytes"):
        launch.device_tensor_maps([np.zeros(128, np.uint8), np.zeros(64, np.uint8)])


# =============================================================================================
# Offline compile + SASS (sm_90a, nvJitLink), two worker processes
# =============================================================================================
COMPILE_MATRIX = [   # every format, and each regime's config with at least one format (JIT time: ~4 s each)
    ("nvfp4", "decode"), ("nvfp4", "small_prefill"), ("nvfp4", "large_prefill"), ("nvfp4", "not_swapped"),
    ("nvfp4", "wide"), ("mxfp4", "decode"), ("mxfp8", "decode"), ("mxfp8", "not_swapped"),
    ("mxfp8_e5m2", "small_prefill"), ("w4a8", "decode"), ("w4a8", "wide_cg1"),
    # h200_plan's 2-stage small-N builds, whose launch bounds cap the registers for 2-3 CTAs per SM
    ("nvfp4", "decode", 2), ("w4a8", "mid", 2),
    # 8 consumer warps of 16 rows on a small-N tile (``small_n_warps``), one producer warp, no setmaxnreg
    ("nvfp4", "decode", 2, 8), ("mxfp8", "mid", 2, 8),
]
COMPILE_WORKERS = 2
MAX_SCALAR_SPILL_ACCESSES = 4   # one spilled word: a store and a few reloads outside the K loop


def _compile_one(case):
    """Worker: compile one spec offline; return its SASS facts (runs in a fresh process)."""
    fmt, config, *knobs = case
    stages = knobs[0] if knobs else None
    small_n_warps = knobs[1] if len(knobs) > 1 else hr.CONSUMER_WARPS_SMALL_N
    spec = spec_of(fmt, CONFIGS[config], stages=stages, small_n_warps=small_n_warps)
    cubin = offline.compile_cubin(hs.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    sass = offline.disassemble(cubin)
    instructions = offline.sass_instructions(sass)
    ops = collections.Counter(ins.split()[0] for ins in instructions)
    setmaxnreg = [int(m.group(1), 16) for ins in instructions
                  if (m := re.search(r"USETMAXREG\S* .*?(0x[0-9a-f]+)", ins))]
    hmma = [i for i, ins in enumerate(instructions) if ins.startswith("HMMA")]
    local = [(i, ins.split()[0]) for i, ins in enumerate(instructions) if re.match(r"(LDL|STL)\b", ins)]
    return dict(case=case, ops=dict(ops), local=local,
                local_in_k_loop=[op for i, op in local if hmma and hmma[0] <= i <= hmma[-1]],
                resources=offline.resource_usage(cubin), setmaxnreg=sorted(setmaxnreg), spec=spec)


@pytest.fixture(scope="module")
def compiled():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(COMPILE_WORKERS, mp_context=ctx) as pool:
        results = list(pool.map(_compile_one, COMPILE_MATRIX))
    table = ["format      config          stages  threads  registers (entry; setmaxnreg)  smem static+dynamic"]
    for r in results:
        spec = r["spec"]
        table.append(f"{r['case'][0]:11} {r['case'][1]:15} {spec.stages:6}  {spec.threads:7}  "
                     f"{r['resources'].registers:4}; {str(r['setmaxnreg'] or '-'):23} "
                     f"{r['resources'].shared_bytes}+{spec.smem.dynamic_bytes}")
    print("\n" + "\n".join(table))
    return {r["case"]: r for r in results}


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
@pytest.mark.parametrize("case", COMPILE_MATRIX, ids=lambda c: "-".join(map(str, c)))
def test_compiles_for_sm90a_with_the_promised_sass(compiled, case):
    r = compiled[case]
    ops, spec = r["ops"], r["spec"]

    def count(prefix):
        return sum(n for op, n in ops.items() if op.startswith(prefix))

    assert count("HMMA.16816.F32.BF16") >= 1, "bf16 mma.sync"
    assert count("UTMALDG") >= 3, "TMA loads of data and scales"
    assert count("SYNCS.ARRIVE.TRANS64") >= 1 and count("SYNCS.PHASECHK.TRANS64") >= 2, "mbarrier expect_tx / waits"
    assert count("SYNCS.EXCH.64") >= 2 * spec.stages, "full and empty mbarrier per stage"
    assert count("HFMA2.BF16") + count("HMUL2.BF16") >= 1, "scale multiply in bf16x2"
    assert all(op == "HMMA.16816.F32.BF16" for op in ops if op.startswith("HMMA")), \
        "only bf16 MMAs (an e4m3 mma.sync would be emulated through fp16 on sm_90a)"
    # The bn256 consumers run at exactly their setmaxnreg budget: ptxas may park one scalar (a
    # 64-bit address) in local memory outside the K loop. Accumulators and fragments never go there.
    assert not r["local_in_k_loop"], "no local memory (LDL/STL) in the K loop"
    if not spec.uses_setmaxnreg:   # ptxas puts spills on the stack (cuobjdump: LOCAL 0, STACK > 0)
        assert r["resources"].stack_bytes == 0 and not r["local"], "the small-N builds do not spill"
    assert not [op for _, op in r["local"] if op.endswith(".128")], "no accumulator arrays in local memory"
    assert len(r["local"]) <= MAX_SCALAR_SPILL_ACCESSES, f"at most a spilled scalar: {r['local']}"
    if spec.cta_group == 2:
        assert count("UTMALDG.2D.MULTICAST") >= 1 and count("UCGABAR_WAIT") >= 1
    if spec.uses_setmaxnreg:
        assert r["setmaxnreg"] == sorted([hs.PRODUCER_WARPGROUP_REGISTERS, hs.CONSUMER_WARPGROUP_REGISTERS])
        assert r["resources"].registers == hs.LAUNCH_BOUND_REGISTERS, "the pool setmaxnreg redistributes"
    else:
        assert count("USETMAXREG") == 0
    assert count("BPT.TRAP") >= 3, "bounded mbarrier waits (and the alignment check) trap instead of hanging"
    assert r["resources"].shared_bytes == spec.smem.static_bytes, "static shared memory as budgeted"


def test_resident_ctas_per_sm():
    decode = spec_of("nvfp4", CONFIGS["decode"])
    assert hl.resident_ctas_per_sm(decode, 96) == 1, "the deepest ring fills the SM"
    four = dataclasses.replace(decode, stages=4)
    assert four.smem.total_bytes * 2 <= hr.SM90_SMEM_PER_SM
    assert hl.resident_ctas_per_sm(four, 96) == 2, "two shallower rings share the SM"
    shallow = dataclasses.replace(decode, stages=2)
    assert hl.resident_ctas_per_sm(shallow, 96) == 4
    # registers per sub-partition (16384 each): 5-warp CTAs, so 3 CTAs need 4 warps on one of them
    assert hl.resident_ctas_per_sm(shallow, 128) == 3
    assert hl.resident_ctas_per_sm(shallow, 133) == 2, "ncu's Block Limit Registers at 133 (run 31)"
    assert hl.resident_ctas_per_sm(shallow, 200) == 1, "2 warps of 200 registers per sub-partition"
    wide = spec_of("nvfp4", CONFIGS["large_prefill"], stages=2)
    assert hl.resident_ctas_per_sm(wide, hs.LAUNCH_BOUND_REGISTERS) == 1, "384 x 168 registers per CTA"


def test_setmaxnreg_split_fits_the_launch_allocation():
    """setmaxnreg only moves registers inside the CTA's allocation: asking for more waits forever."""
    spec = spec_of("nvfp4", CONFIGS["large_prefill"])
    assert spec.uses_setmaxnreg and spec.threads == 384 and spec.producer_warps == hr.WARPGROUP_WARPS
    pool = spec.threads * hs.LAUNCH_BOUND_REGISTERS
    assert pool == 384 * (65536 // 384 // 8 * 8)
    used = (hr.WARP_SIZE * spec.producer_warps * hs.PRODUCER_WARPGROUP_REGISTERS
            + hr.WARP_SIZE * spec.consumer_warps * hs.CONSUMER_WARPGROUP_REGISTERS)
    assert used <= pool
    for regs in (hs.PRODUCER_WARPGROUP_REGISTERS, hs.CONSUMER_WARPGROUP_REGISTERS):
        assert regs % 8 == 0 and 24 <= regs <= 256


# =============================================================================================
# GPU: numerics on the H200
# =============================================================================================
GPU_SHAPES = {"n512_k7168": (512, 7168), "n4096_k2048": (4096, 2048)}
# ragged: an empty group, a -1 slot, a 1-token group, sizes not multiples of any tile, one > 256
GPU_GROUP_SIZES = [5, 0, 1, 37, 3, 70, 129, 300]
GPU_EXPERT_IDS = [0, 4, 1, -1, 2, 5, 3, 6]
GPU_NUM_EXPERTS = 8
MAX = AUTO_STAGES

GPU_CASES = [
    # (format, shape, ab_swapped, mma_bn, cta_group, stages, num_ctas)
    ("nvfp4", "n512_k7168", True, 8, 1, MAX, None),
    ("mxfp4", "n512_k7168", True, 8, 1, 2, None),
    ("mxfp8", "n4096_k2048", True, 8, 1, MAX, None),
    ("mxfp8_e5m2", "n512_k7168", True, 8, 1, 2, None),
    ("w4a8", "n4096_k2048", True, 8, 1, MAX, None),
    ("nvfp4", "n4096_k2048", True, 16, 1, MAX, None),
    ("nvfp4", "n512_k7168", True, 32, 1, 2, 1),
    # the token decode's item shapes: FP8 tokens 2 groups (one 16-byte load) at bn16, FP4 4 groups at
    # bn32 (FP8 tokens in 4-group items: the e5m2 swap32 split-K case)
    ("w4a8", "n512_k7168", True, 16, 1, MAX, None),
    ("mxfp4", "n4096_k2048", True, 32, 1, MAX, None),
    ("nvfp4", "n512_k7168", True, 64, 2, MAX, None),
    ("nvfp4", "n4096_k2048", True, 128, 2, 2, 2),
    ("nvfp4", "n512_k7168", True, 128, 2, MAX, None),
    ("nvfp4", "n4096_k2048", False, 128, 1, MAX, None),
    ("nvfp4", "n512_k7168", False, 8, 1, 2, None),
    ("nvfp4", "n4096_k2048", True, 256, 1, 2, None),
    ("nvfp4", "n512_k7168", True, 256, 2, MAX, None),
    ("nvfp4", "n4096_k2048", False, 256, 1, MAX, None),
    ("mxfp4", "n4096_k2048", True, 64, 2, 2, None),
    ("mxfp4", "n512_k7168", False, 128, 1, MAX, None),
    ("mxfp8", "n512_k7168", True, 128, 2, MAX, 2),
    ("mxfp8", "n4096_k2048", False, 64, 1, 2, None),
    ("mxfp8_e5m2", "n4096_k2048", True, 64, 2, MAX, None),
    ("mxfp8_e5m2", "n512_k7168", True, 256, 2, 2, None),
    ("w4a8", "n512_k7168", True, 128, 2, MAX, None),
    ("w4a8", "n4096_k2048", False, 128, 1, 2, 1),
    ("w4a8", "n512_k7168", True, 256, 1, MAX, None),
]


_GPU_PROBLEMS: dict = {}


def gpu_problem(fmt: str, shape: str):
    """Synthetic problem (random codes, realistic scales) and its reference, cached per test session."""
    key = (fmt, shape)
    if key not in _GPU_PROBLEMS:
        n, k = GPU_SHAPES[shape]
        p = _problem(fmt, n=n, k=k, group_sizes=GPU_GROUP_SIZES, expert_ids=GPU_EXPERT_IDS,
                     num_experts=GPU_NUM_EXPERTS, seed=zlib.crc32(f"{fmt}/{shape}".encode()))
        _GPU_PROBLEMS[key] = (p, reference_grouped_matmul(p))
    return _GPU_PROBLEMS[key]


def _slot_of_tokens(problem) -> np.ndarray:
    return np.repeat(np.arange(problem.num_active_experts), problem.group_sizes)


def diagnose(problem, spec: hr.StreamSpec, out: np.ndarray, ref: np.ndarray) -> str:
    """Where the output is wrong and which known failure modes fit, for the test log."""
    with np.errstate(invalid="ignore"):   # the poison sentinel is a NaN payload
        o = np.asarray(out).astype(np.float64)
        r = np.asarray(ref).astype(np.float64)
    written = problem.written_rows()
    lines = [f"spec {spec}; tile {spec.tile_shape}"]
    poison = is_poison(out)
    unwritten = np.flatnonzero(written & poison.any(axis=1))
    clobbered = np.flatnonzero(~written & ~poison.all(axis=1))
    slot_of = _slot_of_tokens(problem)
    if unwritten.size:
        lines.append(f"{unwritten.size} written rows still hold poison, first tokens {unwritten[:8].tolist()} "
                     f"(slots {sorted(set(slot_of[unwritten].tolist()))}): tiles never stored / masked too much")
    if clobbered.size:
        lines.append(f"{clobbered.size} rows of skipped slots were written, first {clobbered[:8].tolist()}: "
                     "the epilogue mask or the tile walk lets -1 slots through")
    scale = np.max(np.abs(r[written])) if written.any() else 1.0
    with np.errstate(invalid="ignore"):
        bad = written[:, None] & ~poison & ((np.abs(o - r) > 1e-2 * scale) | np.isnan(o))
    if bad.any():
        tokens, cols = np.nonzero(bad)
        lines.append(f"{bad.sum()} wrong elements; first (token, col): "
                     f"{list(zip(tokens[:6].tolist(), cols[:6].tolist()))}; "
                     f"values {o[tokens[:3], cols[:3]].tolist()} vs ref {r[tokens[:3], cols[:3]].tolist()}")
        for g in sorted(set(slot_of[tokens].tolist())):
            lines.append(f"  slot {g} (expert {problem.expert_ids[g]}, {problem.group_sizes[g]} tokens): "
                         f"{int(bad[slot_of == g].sum())} wrong")
        shape = spec.tile_shape
        token_in_tile = (tokens - problem.a_offsets[slot_of[tokens]]) % shape.tokens
        col_in_tile = cols % shape.weight_rows
        if spec.cta_group == 2 and np.all(col_in_tile >= shape.cta_weight_rows):
            lines.append("  only weight rows of rank 1's half are wrong: the peer CTA of the pair (its weight "
                         "box row, its empty-barrier arrivals, its epilogue row offset)")
        if spec.cta_group == 2 and np.all(token_in_tile >= shape.cta_tokens):
            lines.append("  only the second half of each token tile is wrong: the multicast from the peer")
        if np.isnan(o[bad]).any():
            lines.append("  NaN outputs: a NaN scale byte read from the wrong place, or stale shared memory")
        if np.all(o[bad] == 0):
            lines.append("  wrong values are 0: a box read outside its tensor (zero fill) or the wrong stage")
        good = (np.abs(r) > 0.1 * scale) & written[:, None] & ~poison
        ratio = o[good] / r[good]
        if ratio.size:
            med = float(np.median(ratio))
            if med > 0 and abs(np.log2(med) - round(np.log2(med))) < 0.01 and round(np.log2(med)) != 0:
                lines.append(f"  out / ref = 2**{round(np.log2(med))} almost everywhere: a power of two is "
                             f"missing (epilogue 2**{spec.epilogue_log2}, scale pre-bias or element offset)")
            lines.append(f"  median out/ref {med:.4g}, correlation {np.corrcoef(o[good], r[good])[0, 1]:.4f}")
        lines.extend(_transpose_hint(o, r, problem, spec))
        lines.extend(_variant_hints(problem, out, int(slot_of[tokens[0]])))
    return "\n".join(lines)


def slot_output(problem, slot: int, a_operand=None, b_operand=None) -> np.ndarray:
    """bf16 rows of one slot computed from (possibly altered) linear-scale operands."""
    expert = int(problem.expert_ids[slot])
    lo, hi = int(problem.a_offsets[slot]), int(problem.a_offsets[slot + 1])
    qa = problem.a_operand() if a_operand is None else a_operand
    qb = problem.b_operand(expert) if b_operand is None else b_operand
    acc = dequantize(qa).astype(np.float64)[lo:hi] @ dequantize(qb).astype(np.float64).T
    return (acc * np.float64(problem.expert_scales[expert])).astype(np.float32).astype(BF16)


def _without_subnormal_elements(q: BlockScaled) -> BlockScaled:
    codes = q.element_codes().copy()
    if q.fmt.packed:
        codes[(codes & 0x7) == 1] = 0                     # E2M1 +-0.5
        return dataclasses.replace(q, data=pack_fp4(codes))
    exponent_mask = 0x78 if q.fmt.element == "e4m3" else 0x7C
    codes[(codes & exponent_mask) == 0] = 0               # FP8 subnormals
    return dataclasses.replace(q, data=codes.view(q.fmt.element_dtype))


def _neighbour_block_scales(q: BlockScaled) -> BlockScaled:
    cols = np.arange(q.scales.shape[-1]) ^ 1              # blocks 2i <-> 2i+1
    return dataclasses.replace(q, scales=np.ascontiguousarray(q.scales[..., cols]))


def _variant_hints(problem, out, slot: int) -> list[str]:
    """Which altered computation reproduces the kernel's rows of ``slot`` (expensive: on failure only)."""
    got = np.asarray(out)[int(problem.a_offsets[slot]):int(problem.a_offsets[slot + 1])]
    expert = int(problem.expert_ids[slot])
    qa, qb = problem.a_operand(), problem.b_operand(expert)
    unpadded = dataclasses.replace(qa, scales=unswizzle_scales(problem.a_scales, cols=qa.scales.shape[-1])[
        :problem.total_tokens])
    variants = {
        "bf16 subnormals flushed (E2M1 +-0.5 / FP8 subnormals lost in fma.bf16x2 or the MMA)":
            (_without_subnormal_elements(qa), _without_subnormal_elements(qb)),
        "weight scales of the neighbouring block (scale byte / group-to-block selection)":
            (qa, _neighbour_block_scales(qb)),
        "token scales of the neighbouring block": (_neighbour_block_scales(qa), qb),
        "token scales read without the per-group padding (a_scale_offsets ignored)": (unpadded, qb),
    }
    hints = []
    for what, (a_op, b_op) in variants.items():
        try:
            alt = slot_output(problem, slot, a_op, b_op)
        except ValueError:
            continue
        max_rel, rms_rel = relative_errors(got, alt)
        if max_rel <= 1e-2 and rms_rel <= 4e-3:
            hints.append(f"  slot {slot} matches the variant: {what}")
    return hints or [f"  slot {slot} matches none of the scale / subnormal variants"]


def _transpose_hint(o, r, problem, spec):
    """Does a tile look transposed (C written as [row, token] inside a square corner)?"""
    n = min(8, problem.n)
    for g in range(problem.num_active_experts):
        lo = int(problem.a_offsets[g])
        if problem.expert_ids[g] >= 0 and problem.group_sizes[g] >= n:
            block_o, block_r = o[lo:lo + n, :n], r[lo:lo + n, :n]
            if not np.allclose(block_o, block_r, rtol=1e-2) and np.allclose(block_o, block_r.T, rtol=1e-2):
                return [f"  slot {g}: the first {n}x{n} corner matches the transposed reference: the epilogue "
                        "swaps token and weight-row indices"]
            break
    return []


def test_diagnostic_variants_recognise_their_own_failure_mode():
    """The GPU diagnostics are only useful if a real failure of each kind is named: feed them the
    output the wrong computation would give."""
    problem = _problem("nvfp4", n=128, k=512, group_sizes=[6, 3], expert_ids=[1, 0])
    slot = 0
    fake = reference_grouped_matmul(problem)
    fake[:6] = slot_output(problem, slot, b_operand=_neighbour_block_scales(problem.b_operand(1)))
    assert any("weight scales of the neighbouring block" in h for h in _variant_hints(problem, fake, slot))
    fake[:6] = slot_output(problem, slot, _without_subnormal_elements(problem.a_operand()),
                           _without_subnormal_elements(problem.b_operand(1)))
    assert any("subnormals flushed" in h for h in _variant_hints(problem, fake, slot))
    text = diagnose(problem, spec_of("nvfp4", CONFIGS["decode"]), fake, reference_grouped_matmul(problem))
    assert "wrong elements" in text and "slot 0" in text


def _gpu_case_id(case):
    fmt, shape, sw, bn, cg, stages, ctas = case
    return f"{fmt}-{shape}-{'swap' if sw else 'noswap'}{bn}-cg{cg}-st{'max' if stages == MAX else stages}" + (
        f"-ctas{ctas * cg}" if ctas else "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_case_id)
def test_gpu_matches_the_reference(case):
    fmt, shape, sw, bn, cg, stages, pairs = case
    problem, ref = gpu_problem(fmt, shape)
    config = Stream(sw, bn, cg, stages)
    spec = plan_spec(problem, config)
    out = run(problem, config, num_ctas=None if pairs is None else pairs * cg)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, spec, out, ref)}"


# (format, shape, ab_swapped, mma_bn, k_splits): 8 consumer warps of 16 rows (``small_n_warps``); the Kimi-like
# split-K runs, FP4 and FP8 tokens, 32 token columns, tokens on M
EIGHT_WARP_CASES = [("nvfp4", "n512_k7168", True, 8, 4), ("mxfp4", "n512_k7168", True, 8, None),
                    ("w4a8", "n4096_k2048", True, 16, None), ("mxfp8", "n512_k7168", True, 16, 3),
                    ("nvfp4", "n4096_k2048", True, 32, None), ("nvfp4", "n512_k7168", False, 8, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", EIGHT_WARP_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'swap' if c[2] else 'noswap'}{c[3]}"
                         f"-splits{c[4]}")
def test_gpu_eight_small_n_warps_match_the_reference(case):
    fmt, shape, sw, bn, k_splits = case
    problem, ref = gpu_problem(fmt, shape)
    config = Stream(sw, bn, 1, 2, small_n_warps=8)
    spec = plan_spec(problem, config)
    out = run(problem, config, k_splits=k_splits)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, spec, out, ref)}"


# (format, N, K, group sizes, expert ids, the plan's (mma_bn, small_n_warps)): Kimi-like (a -1 slot, an empty
# group; 4 weight-row tiles per expert: split-K runs), 32-token tiles (ragged, sizes not multiples of 32)
PLANNED_CASES = [("nvfp4", 512, 7168, [1, 1, 0, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, -1, 4, 5, 6, 7], (8, 8)),
                 ("mxfp4", 512, 7168, [1, 1, 1, 1, 1, 1, 1, 1], list(range(8)), (8, 8)),
                 ("nvfp4", 1000, 2048, [32, 29, 0, 31, 32], [3, 1, 0, -1, 2], (32, 8)),
                 ("w4a8", 1000, 2048, [32, 29, 0, 31, 32], [3, 1, 0, -1, 2], (32, 4))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PLANNED_CASES, ids=lambda c: f"{c[0]}-n{c[1]}-k{c[2]}-bn{c[5][0]}-w{c[5][1]}")
def test_gpu_the_plan_runs_and_matches_the_reference(case):
    """``gbs.grouped_matmul`` without a config on the streaming kernel runs the plan's knobs (8 small-N
    warps for FP4 tokens where latency-bound) within the acceptance (skipped rows keep the poison)."""
    import gbs

    fmt, n, k, sizes, ids, (mma_bn, warps) = case
    problem = _problem(fmt, n=n, k=k, group_sizes=sizes, expert_ids=ids, num_experts=8,
                       seed=zlib.crc32(f"plan/{fmt}/{n}".encode()))
    plan = gbs_plan.plan_h200(problem, backend="h200_stream")
    assert (plan.spec.mma_bn, plan.spec.small_n_warps) == (mma_bn, warps)
    out = gbs.grouped_matmul(problem, backend="h200_stream")
    ref = reference_grouped_matmul(problem)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, plan.spec, out, ref)}"


@pytest.mark.gpu
def test_gpu_prepared_launch_reruns_identically_and_keeps_skipped_rows():
    from numba import cuda

    problem, ref = gpu_problem("nvfp4", "n512_k7168")
    config = Stream(True, 8, 1)
    device_problem = launch.to_device(problem)
    sentinel = np.full((problem.total_tokens, problem.n), 0x1234, np.uint16)
    device_out = cuda.to_device(sentinel)
    prepared = prepare(device_problem, config, device_out)
    prepared()
    first = device_out.copy_to_host()
    for _ in range(3):
        prepared()
    again = device_out.copy_to_host()
    np.testing.assert_array_equal(first, again)
    skipped = ~problem.written_rows()
    assert np.all(first[skipped] == 0x1234), "rows of -1 slots are never written"
    out = first.view(BF16)
    poisoned = np.where(skipped[:, None], np.uint16(POISON_BITS), first).view(BF16)
    assert check_kernel(problem, poisoned, ref, "h200_stream").passed, diagnose(problem, prepared.plan.ring, out, ref)


def rerun_and_check(problem, ref, config, launches=3, **prepare_args):
    """Prepare one launch writing over a sentinel, run it ``launches`` times (the sentinel restored before
    each): every run matches the reference on the written rows, keeps the sentinel on rows of skipped
    slots and leaves the launch's counters (and a split-K workspace) zeroed. Returns the prepared launch."""
    from numba import cuda

    sentinel = np.full((problem.total_tokens, problem.n), 0x1234, np.uint16)
    device_out = cuda.to_device(sentinel)
    prepared = prepare(launch.to_device(problem), config, device_out, **prepare_args)
    skipped = ~problem.written_rows()
    for launch_index in range(launches):
        device_out.copy_to_device(sentinel)
        prepared()
        bits = device_out.copy_to_host()
        assert np.all(bits[skipped] == 0x1234), "rows of -1 slots are never written"
        merged = np.where(skipped[:, None], np.uint16(POISON_BITS), bits).view(BF16)
        result = check_kernel(problem, merged, ref, "h200_stream")
        assert result.passed, f"launch {launch_index}: {result}\n{diagnose(problem, prepared.plan.ring, merged, ref)}"
        if prepared.plan.k_splits > 1:
            assert not np.any(prepared.split_sums.copy_to_host()), "workspace zeroed by the last run"
        assert not np.any(prepared.split_counters.copy_to_host()), "tile and item counters reset"
    return prepared


@pytest.mark.gpu
@pytest.mark.parametrize("num_ctas", [1, 3, 7])
def test_gpu_dynamic_items_cover_every_tile_and_leave_the_counter_zero(num_ctas):
    """Grids far smaller than the tile count: past the first wave every item comes from the global
    counter; three launches in a row give the reference's result and leave the counters at zero."""
    problem, ref = gpu_problem("nvfp4", "n512_k7168")
    prepared = rerun_and_check(problem, ref, Stream(True, 8, 1), num_ctas=num_ctas, k_splits=1)
    assert prepared.plan.ring.dynamic_items and prepared.plan.num_ctas == num_ctas


def test_h200_weight_order_decodes_to_the_packed_registers():
    """Every register the kernel decodes from a re-laid word equals ``e2m1_pair_bits`` of the packed
    word (so a kernel on re-laid weights computes bit for bit what it computes on packed ones)."""
    rng = np.random.default_rng(11)
    words = np.concatenate([rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32),
                            np.array([0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x01234567], np.uint32)])
    relaid = E2M1H200Order.swizzle(words.view(np.uint8)).view(np.uint32)
    with np.errstate(over="ignore"):   # the spread multiply wraps at 32 bits on purpose (as on the GPU)
        for word, ordered in zip(words, relaid):
            for j in range(4):
                assert hd.e2m1_h200_pair_bits(ordered, j) == hd.e2m1_pair_bits(word, j), (hex(word), j)


def test_h200_scale_codes_convert_to_the_packed_scale_registers():
    """The coded UE4M3 conversion the kernels run on re-laid operands (``ue4m3_code_pair_bits`` of the two
    codes ``byte_pair_selector`` puts in a register's 16-bit lanes), for every pair of UE4M3 bytes: the bf16
    bits the exact float route gives for packed operands (``s * 2**(c - d)``), except zero as -0 (a zero
    product either way) and NaN as the quiet NaN."""
    u = np.arange(128, dtype=np.uint8)
    codes = UE4M3H200Scales.encode(u).astype(np.uint32)
    u0, u1 = (a.ravel() for a in np.meshgrid(u, u))
    bits = hd.ue4m3_code_pair_bits(codes[u0] | (codes[u1] << np.uint32(16)))
    offset = hd.ELEMENT_LOG2_OFFSET["e2m1"] - hd.SCALE_LOG2_PREBIAS["ue4m3"]
    want = (decode_ue4m3(u).astype(np.float64) * 2.0 ** offset).astype(ml_dtypes.bfloat16).view(np.uint16)
    want[0], want[0x7F] = 0x8000, 0x7FC0
    np.testing.assert_array_equal(bits & np.uint32(0xFFFF), want[u0])
    np.testing.assert_array_equal(bits >> np.uint32(16), want[u1])


def test_h200_weight_order_is_a_bit_permutation_of_each_word():
    rng = np.random.default_rng(12)
    packed = rng.integers(0, 256, (2, 3, 64), dtype=np.uint8)
    relaid = E2M1H200Order.swizzle(packed)
    assert relaid.shape == packed.shape and not np.array_equal(relaid, packed)
    np.testing.assert_array_equal(E2M1H200Order.unswizzle(relaid), packed)
    ones = lambda x: np.unpackbits(x.reshape(-1, 4), axis=1).sum(axis=1)   # noqa: E731
    np.testing.assert_array_equal(ones(relaid), ones(packed))   # bits move only inside their word
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        E2M1H200Order.swizzle(packed[..., :6])


@pytest.mark.parametrize("layout", [LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_TILED, LAYOUT_E2M1_H200_FUSED])
def test_h200_weight_layout_reaches_the_spec_and_is_refused_where_it_cannot_apply(layout):
    problem = _problem("nvfp4", n=128, k=512, group_sizes=[5, 0, 3], expert_ids=[1, -1, 0])
    relaid = problem.with_b_layout(layout)
    np.testing.assert_array_equal(reference_grouped_matmul(relaid).view(np.uint16),
                                  reference_grouped_matmul(problem).view(np.uint16))
    np.testing.assert_array_equal(relaid.with_b_layout("packed").b, problem.b)
    np.testing.assert_array_equal(relaid.b_scales, UE4M3H200Scales.encode(problem.b_scales))   # coded with them
    np.testing.assert_array_equal(relaid.with_b_layout("packed").b_scales, problem.b_scales)
    np.testing.assert_array_equal(relaid.b_operand(1).scales, problem.b_operand(1).scales)
    mx = _problem("mxfp4", n=128, k=512, group_sizes=[5, 3], expert_ids=[1, 0])
    np.testing.assert_array_equal(mx.with_b_layout(layout).b_scales, mx.b_scales)   # UE8M0 as is
    signed = dataclasses.replace(problem, b_scales=problem.b_scales | np.uint8(0x80))
    with pytest.raises(ValueError, match="has the sign bit set"):
        signed.with_b_layout(layout)
    config = Stream(True, 8, 1)
    assert plan_spec(relaid, config).b_layout == layout
    assert plan_spec(problem, config).b_layout == "packed"
    assert plan_spec(relaid, config).m_side.layout == layout
    assert plan_spec(relaid, config).n_side.layout == "packed"   # tokens stay packed
    with pytest.raises(ValueError, match="re-lays FP4"):
        _problem("mxfp8", n=128, k=512, group_sizes=[4], expert_ids=[0]).with_b_layout(layout)
    with pytest.raises(ValueError, match="b_layout must be one of"):
        problem.with_b_layout("tiled")
    with pytest.raises(ValueError, match="b_layout must be one of"):
        hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, b_layout="tiled")
    from gbs.numba_kernels import simt, sm100
    with pytest.raises(ValueError, match="SIMT kernel reads b in 'packed' order"):
        simt.check_can_implement(relaid, schedule.TileConfig(True, 8, 1))
    with pytest.raises(ValueError, match="SM100 kernel reads b in 'packed' order"):
        sm100.check_can_implement(relaid, schedule.TileConfig(True, 8, 1))
    wgmma_spec = plan_spec(relaid, Wgmma(128))
    assert wgmma_spec.b_layout == layout and wgmma_spec.ring.weight_side.layout == layout
    if layout == LAYOUT_E2M1_H200_FUSED:   # b holds a copy of the scales too; its bytes come only with them
        assert relaid.nbytes() == {**problem.nbytes(), "b": problem.b.nbytes + problem.b_scales.nbytes}
        with pytest.raises(TypeError, match="holds the weights' scales too"):
            OPERAND_LAYOUTS[layout].swizzle(problem.b)
        return
    assert relaid.nbytes() == problem.nbytes()
    with pytest.raises(TypeError, match="packed FP4 bytes as uint8"):
        OPERAND_LAYOUTS[layout].swizzle(problem.b.view(np.int8))


def test_h200_token_layout_reaches_the_spec_and_is_refused_where_it_cannot_apply():
    """FP4 tokens in ``E2M1H200Order`` (``a_layout``, as their quantizer would write them): the same
    reference result, the token side of both kernels' specs reads that order, the raw-byte backends and
    FP8 tokens refuse it."""
    problem = _problem("nvfp4", n=128, k=512, group_sizes=[5, 0, 3], expert_ids=[1, -1, 0])
    relaid = problem.with_a_layout(LAYOUT_E2M1_H200)
    assert relaid.a_layout == LAYOUT_E2M1_H200 and relaid.b_layout == "packed"
    assert not np.array_equal(relaid.a, problem.a)
    np.testing.assert_array_equal(relaid.a_operand().data, problem.a)
    np.testing.assert_array_equal(relaid.a_scales, UE4M3H200Scales.encode(problem.a_scales))
    np.testing.assert_array_equal(relaid.a_operand().scales, problem.a_operand().scales)
    np.testing.assert_array_equal(reference_grouped_matmul(relaid).view(np.uint16),
                                  reference_grouped_matmul(problem).view(np.uint16))
    np.testing.assert_array_equal(relaid.with_a_layout("packed").a, problem.a)
    for config, token_side in ((Stream(True, 8, 1), "n_side"), (Stream(False, 128, 1), "m_side")):
        spec = plan_spec(relaid, config)
        assert spec.a_layout == LAYOUT_E2M1_H200 and getattr(spec, token_side).layout == LAYOUT_E2M1_H200
        assert spec.weight_side.layout == "packed"
    from gbs.numba_kernels import simt, sm100
    wgmma_spec = plan_spec(relaid, Wgmma(128))
    assert wgmma_spec.ring.token_side.layout == LAYOUT_E2M1_H200 and wgmma_spec.ring.weight_side.layout == "packed"
    with pytest.raises(ValueError, match="SIMT kernel reads a in 'packed' order"):
        simt.check_can_implement(relaid, schedule.TileConfig(True, 8, 1))
    with pytest.raises(ValueError, match="SM100 kernel reads a in 'packed' order"):
        sm100.check_can_implement(relaid, schedule.TileConfig(True, 8, 1))
    with pytest.raises(ValueError, match="a_layout 'e2m1_h200' re-lays FP4 \\(E2M1\\) tokens; a is mxfp8"):
        _problem("w4a8", n=128, k=512, group_sizes=[4], expert_ids=[0]).with_a_layout(LAYOUT_E2M1_H200)
    with pytest.raises(ValueError, match="a_layout must be one of"):
        hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, a_layout="tiled")
    with pytest.raises(ValueError, match="a_layout must be one of"):
        dataclasses.replace(problem, a_layout="tiled")


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
def test_h200_weight_layout_shortens_the_decode_loop():
    """The point of the re-layout, read from the SASS (ptxas, sm_90a): the decode config's hot loop
    (4 groups of 16 registers) loses at least 50 of its ~358 instructions, with no spills."""
    sizes = {}
    for layout in ("packed", LAYOUT_E2M1_H200):
        spec = hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, b_layout=layout)
        cubin = offline.compile_cubin(hs.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(spec.threads, spec.min_ctas_per_sm))
        assert offline.resource_usage(cubin).local_bytes == 0
        hot = [loop for loop in offline.sass_loops(offline.disassemble(cubin)) if loop.count("HMMA")][0]
        sizes[layout] = hot.size
    assert sizes[LAYOUT_E2M1_H200] <= sizes["packed"] - 50, sizes


H200_LAYOUT_CASES = [   # (format, shape, ab_swapped, mma_bn, cta_group, k_splits): weights on M and on N
    ("nvfp4", "n512_k7168", True, 8, 1, 1), ("mxfp4", "n4096_k2048", True, 16, 1, 3),
    ("w4a8", "n4096_k2048", False, 128, 1, 1), ("nvfp4", "n512_k7168", True, 64, 2, 1),
    ("nvfp4", "n4096_k2048", False, 64, 1, 1), ("mxfp4", "n512_k7168", True, 256, 2, 1),
    ("w4a8", "n512_k7168", True, 8, 1, 1),   # the decode's 64-byte weight slices: half a box, half its atoms
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_TILED, LAYOUT_E2M1_H200_FUSED])
@pytest.mark.parametrize("case", H200_LAYOUT_CASES, ids=lambda c: f"{c[0]}-{'swap' if c[2] else 'noswap'}{c[3]}-cg{c[4]}")
def test_gpu_h200_weight_layout_gives_the_same_bits(case, layout):
    """Weights re-laid in ``E2M1H200Order`` (row-major, tiled box by box, or each box with its scales) decode
    to the same bf16
    registers, so the output is bit-identical to the packed weights' without split-K (whose atomic adds
    land in any order) and passes the reference either way."""
    fmt, shape, sw, bn, cg, splits = case
    problem, ref = gpu_problem(fmt, shape)
    config = Stream(sw, bn, cg)
    relaid = problem.with_b_layout(layout)
    assert plan_spec(relaid, config).b_layout == layout
    out = run(relaid, config, k_splits=splits)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, plan_spec(relaid, config), out, ref)}"
    if splits == 1:
        packed = run(problem, config, k_splits=1)
        np.testing.assert_array_equal(out.view(np.uint16), packed.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("nvfp4", "n512_k7168", True, 8, 1, 4), ("mxfp4", "n4096_k2048", True, 32, 1, 8),
                                  ("nvfp4", "n4096_k2048", False, 128, 1, 4)],
                         ids=lambda c: f"{c[0]}-{'swap' if c[2] else 'noswap'}{c[3]}-w{c[5]}")
def test_gpu_h200_token_layout_gives_the_same_bits(case):
    """FP4 tokens in ``E2M1H200Order`` (``a_layout``): the decoded-token slots (swapped) and the M-side
    token decode (not swapped) give bit-identical output."""
    fmt, shape, sw, bn, cg, warps = case
    problem, ref = gpu_problem(fmt, shape)
    config = Stream(sw, bn, cg, AUTO_STAGES, warps)
    relaid = problem.with_a_layout(LAYOUT_E2M1_H200)
    assert plan_spec(relaid, config).token_side.layout == LAYOUT_E2M1_H200
    out = run(relaid, config, k_splits=1)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, plan_spec(relaid, config), out, ref)}"
    np.testing.assert_array_equal(out.view(np.uint16), run(problem, config, k_splits=1).view(np.uint16))


def _with_zero_and_nan_scales(problem, rng):
    """``problem`` with ~3 % of the weight and token scale bytes 0 (their element codes left nonzero: the
    blocks are zero by the scale alone) and one weight block NaN."""
    b_scales, a_scales = problem.b_scales.copy(), problem.a_scales.copy()
    for scales in (b_scales, a_scales):
        scales.reshape(-1)[rng.random(scales.size) < 0.03] = 0
    b_scales[1, 0, 0, 5, 0, 1] = 0x7F   # expert 1, row 5, block 1
    return dataclasses.replace(problem, b_scales=b_scales, a_scales=a_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["h200_stream", "h200_wgmma"])
def test_gpu_h200_scale_codes_keep_zero_and_nan_blocks(kernel):
    """Both operands in the H200 order, UE4M3 scales as codes, with zero-scale blocks whose element codes
    are not zero and one NaN weight block: the same output bits as the packed operands (NaN where they are
    NaN), and the reference's values wherever the NaN block does not reach."""

    base, _ = gpu_problem("nvfp4", "n512_k7168")
    problem = _with_zero_and_nan_scales(base, np.random.default_rng(23))
    relaid = problem.with_b_layout(LAYOUT_E2M1_H200).with_a_layout(LAYOUT_E2M1_H200)
    assert np.any(relaid.b_scales == UE4M3H200Scales.ZERO_BYTE) and np.any(relaid.b_scales == UE4M3H200Scales.NAN_BYTE)
    knobs = Stream(True, 8, 1) if kernel == "h200_stream" else Wgmma(128, AUTO_STAGES, tile_tokens=256)
    packed = run(problem, knobs, k_splits=1).view(np.uint16)
    coded = run(relaid, knobs, k_splits=1).view(np.uint16)
    np.testing.assert_array_equal(coded, packed)
    ref = reference_grouped_matmul(problem)
    with np.errstate(invalid="ignore"):
        nan = np.isnan(ref.astype(np.float32)) & problem.written_rows()[:, None]
    assert nan.any() and not nan.all()
    assert np.all(np.isnan(coded.view(BF16).astype(np.float32)[nan]))
    clean = ~nan.any(axis=0)   # output columns (weight rows) the NaN block does not feed
    rows = problem.written_rows()
    max_rel, rms_rel = relative_errors(coded.view(BF16)[rows][:, clean], ref[rows][:, clean])
    assert max_rel <= MAX_REL_TOL and rms_rel <= RMS_REL_TOL, (max_rel, rms_rel)
    assert np.all(is_poison(coded.view(BF16))[~rows]), "skipped rows keep the poison"


SPLIT_CASES = [   # (format, ab_swapped, mma_bn, cta_group, k_splits)
    ("nvfp4", True, 8, 1, 3), ("mxfp4", True, 16, 1, 14), ("mxfp8", True, 64, 2, 5),
    ("w4a8", False, 128, 1, 2), ("mxfp8_e5m2", True, 32, 1, 4), ("nvfp4", True, 256, 2, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}-{'swap' if c[1] else 'noswap'}{c[2]}-cg{c[3]}-"
                                                        f"splits{c[4]}")
def test_gpu_split_k_matches_the_reference_and_cleans_up(case):
    """Split-K: every run adds its partial tile, the last one stores; skipped rows keep their
    contents, and the workspace and counters are zero again after every launch (so a prepared
    launch reruns correctly)."""
    fmt, sw, bn, cg, k_splits = case
    problem, ref = gpu_problem(fmt, "n512_k7168")
    prepared = rerun_and_check(problem, ref, Stream(sw, bn, cg, 2), k_splits=k_splits)
    assert prepared.plan.k_splits == k_splits and prepared.plan.ring.split_k


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_quantized_real_data_decode(fmt):
    """Real quantization (outlier channels, per-expert spreads) rather than random codes."""
    rng = np.random.default_rng(11)
    sizes, ids = [3, 1, 0, 6], [2, 0, 1, -1]
    weights = random_weights(rng, 3, 256, 1024)
    acts = random_activations(rng, int(np.sum(sizes)), 1024)
    problem = build_problem(acts, weights, sizes, ids, fmt=fmt)
    config = Stream(True, 8, 1)
    spec = plan_spec(problem, config)
    out = run(problem, config)
    ref = reference_grouped_matmul(problem)
    result = check_kernel(problem, out, ref, "h200_stream")
    assert result.passed, f"{result}\n{diagnose(problem, spec, out, ref)}"


@pytest.mark.gpu
def test_gpu_compiled_kernel_resources():
    """The JIT overload that runs: no local memory, dynamic shared memory as budgeted."""
    spec = spec_of("nvfp4", CONFIGS["large_prefill"])
    kernel = hl.compiled_kernel(spec)
    assert kernel.local_bytes == 0
    assert kernel.dynamic_smem_bytes == spec.smem.dynamic_bytes
    assert kernel.dynamic_smem_bytes + kernel.static_smem_bytes <= launch.device_smem_optin_limit()
    # the small-N builds fit at least their launch bounds' CTAs, some more: NVFP4 bn8 since the work records
    # (93 registers <= 96: 528 decode CTAs, H200 runs 55-56), W4A8 bn32 (122 registers: 396 CTAs, bench run 60)
    for fmt, bn, warps, ctas, resident in (("nvfp4", 8, 4, 3, 4), ("nvfp4", 16, 4, 3, 3), ("w4a8", 32, 4, 2, 3),
                                            ("nvfp4", 32, 8, 2, 2)):
        small = spec_of(fmt, Stream(True, bn, 1), stages=2, small_n_warps=warps)
        built = hl.compiled_kernel(small)
        assert built.local_bytes == 0
        assert small.min_ctas_per_sm == ctas
        assert hl.resident_ctas_per_sm(small, built.registers) == resident, (fmt, bn, warps, built.registers)


def test_gpu_case_list_covers_every_format_and_knob():
    assert {c[0] for c in GPU_CASES} == set(FORMATS)
    assert {(c[2], c[4]) for c in GPU_CASES} >= {(True, 1), (True, 2), (False, 1)}
    assert {c[3] for c in GPU_CASES} == {8, 16, 32, 64, 128, 256}
    assert {c[5] for c in GPU_CASES} >= {2, MAX}
    assert len({(c[0], c[2], c[3], c[4], c[5]) for c in GPU_CASES}) <= 26, "JIT time: keep the spec count small"
    # every case is legal, and the ragged routing has what the brief asks for
    sizes = np.array(GPU_GROUP_SIZES)
    assert 0 in sizes and 1 in sizes and -1 in GPU_EXPERT_IDS and sizes.max() > 256
    for fmt, shape, sw, bn, cg, stages, _ in GPU_CASES:
        n, k = GPU_SHAPES[shape]
        assert k % spec_of(fmt, Stream(sw, bn, cg)).k_slice == 0
        a, b = PROBLEM_FORMATS[fmt]
        assert stages == MAX or stages <= max_stages(a, b, Stream(sw, bn, cg))


def test_formats_module_constants_agree_with_quant():
    for element, offset in hd.ELEMENT_LOG2_OFFSET.items():
        dtype = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn,
                 "e5m2": ml_dtypes.float8_e5m2}[element]
        one = np.array([1.0], np.float32).astype(dtype).view(np.uint8)[0]
        if element == "e2m1":
            bits = hd.e2m1_pair_bits(np.uint32(one), 0) & 0xFFFF
        else:
            bits = hd.fp8_pair_bits(np.uint32(one), np.uint32(0), 0, element == "e5m2", True) & 0xFFFF
        assert bf16_value(bits) == 2.0 ** -offset, element
    for name in FORMATS:
        for fmt_name in PROBLEM_FORMATS[name]:
            assert get_format(fmt_name).scale_dtype in hd.SCALE_LOG2_PREBIAS


# ----------------------------------------------------------------------------------------------
# The start-up trace build (a diagnostic: StreamSpec.trace, prepare(trace=True))
# ----------------------------------------------------------------------------------------------
def test_trace_phases_are_the_gaps_between_reached_events():
    events = len(ht.TRACE_EVENTS)
    records = np.zeros((3, events, ht.TRACE_RECORD_WORDS), np.uint64)
    # CTAs 0 and 1 work; CTA 2 has no tile (it finds no work: no slot, no TMA, no stage, no epilogue)
    for cta in range(2):
        for i, event in enumerate(ht.TRACE_PRODUCER_CHAIN):
            records[cta, event, 0] = 1_000_000 + 100 * cta + 500 * i
        for i, event in enumerate(ht.TRACE_CONSUMER_CHAIN[1:], start=1):
            records[cta, event, 0] = 1_000_000 + 100 * cta + 1500 * i
    for event in (ht.TRACE_ENTRY, ht.TRACE_BARRIERS, ht.TRACE_MAPS, ht.TRACE_PRODUCER_WORK, ht.TRACE_PRODUCER_EXIT,
                  ht.TRACE_CONSUMER_READY, ht.TRACE_CONSUMER_EXIT):
        records[2, event, 0] = 1_000_300 + 10 * event
    records[:, :, 1] = 7   # clock64 words: not used by the phases
    phases = ht.trace_phases(records)
    np.testing.assert_array_equal(phases["entry skew"], [0, 100, 300])
    np.testing.assert_array_equal(phases["entry -> barriers_ready"], [500, 500, 10])
    np.testing.assert_array_equal(phases["maps_ready -> producer_work_found"], [500, 500, 10])
    assert np.isnan(phases["first_slot_free -> first_tma_issued"][2])
    np.testing.assert_array_equal(phases["first_full -> first_release"][:2], [1500, 1500])
    np.testing.assert_array_equal(phases["entry -> consumer_ready"], [1500, 1500, 10 * ht.TRACE_CONSUMER_READY])
    np.testing.assert_array_equal(phases["first_tma_issued -> first_full"][:2], [3000 - 2500] * 2)
    # the last exit of any role in any CTA, after the first entry
    assert phases["launch span"][0] == 100 + 1500 * (len(ht.TRACE_CONSUMER_CHAIN) - 1)
    with pytest.raises(ValueError, match="trace"):
        ht.trace_phases(records[:, :3])
    with pytest.raises(ValueError, match="one launch"):
        ht.trace_phases(records[None])


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
def test_trace_build_stamps_and_the_plain_build_does_not():
    """Offline (sm_90a): the trace build reads %globaltimer / %clock64 (SASS S2UR / CS2R of them); the plain
    build reads no timer in its K loop or anywhere but the bounded waits' deadlock timer."""
    spec = spec_of("nvfp4", Stream(True, 8, 1), stages=2)
    texts = {}
    for trace in (False, True):
        traced = dataclasses.replace(spec, trace=trace)
        cubin = offline.compile_cubin(hs.make_kernel_function(traced), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(traced.threads, traced.min_ctas_per_sm))
        texts[trace] = offline.disassemble(cubin)
    clock = re.compile(r"SR_CLOCK")
    assert not clock.search(texts[False])
    assert len(clock.findall(texts[True])) >= len(ht.TRACE_EVENTS)


@pytest.mark.gpu
def test_gpu_trace_build_stamps_every_working_cta_and_computes_the_same_bits():
    """The start-up trace build (``plan_h200(..., trace=True)``, a diagnostic) writes the same output bits as the
    plain build of the same plan and stamps, for every CTA that found work, each event of both chains once, in
    order (the phases between them are positive)."""
    from numba import cuda

    problem, ref = gpu_problem("nvfp4", "n512_k7168")
    knobs = Stream(True, 8, 1, 2)
    plain = run(problem, knobs, k_splits=1)
    traced_launch = prepare(launch.to_device(problem), knobs, cuda.to_device(plain.view(np.uint16) * 0),
                            k_splits=1, trace=True)
    traced_launch()
    traced = traced_launch.out.copy_to_host()
    written = problem.written_rows()
    np.testing.assert_array_equal(traced[written], plain.view(np.uint16)[written])
    records = traced_launch.trace_buffer.copy_to_host()
    assert records.shape == (traced_launch.plan.num_ctas, len(ht.TRACE_EVENTS), ht.TRACE_RECORD_WORDS)
    working = records[:, ht.TRACE_FIRST_FULL, 0] != 0
    assert working.any()
    for chain in (ht.TRACE_PRODUCER_CHAIN, ht.TRACE_CONSUMER_CHAIN):
        stamps = records[working][:, list(chain), 0].astype(np.int64)
        assert np.all(stamps > 0) and np.all(np.diff(stamps, axis=1) >= 0), chain
    assert ht.trace_phases(records)["launch span"][0] > 0
