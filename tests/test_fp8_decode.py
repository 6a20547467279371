"""The FP8 route's decode building blocks (``gbs.numba_kernels.fp8_decode``, ``gbs.layouts.E2M1E4M3Order``; issue 31
item 3) against the route's host model (``gbs.fp8_route``): bit-exact on the host, with the numpy model of ``prmt``;
assembled for sm_90a offline (2 ``prmt`` per word, no local memory); on the GPU, the kernel's bytes equal the host's.
"""
from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import pytest

from gbs.formats import BlockScaled, get_format, pack_fp4
from gbs.fp8_route import FOLD_WINDOW, e2m1_to_e4m3_table, fold_operand
from gbs.layouts import E2M1E4M3Order
from gbs.numba_kernels import fp8_decode as fd
from gbs.ptx_inline.arith import prmt_b32_host


def _is_nan_e4m3(b: np.ndarray) -> np.ndarray:
    return np.isnan(np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_prmt_host_model_selects_bytes_and_replicates_signs():
    a, b = 0x03020100, 0x87868584
    assert prmt_b32_host(a, b, 0x7654) == 0x87868584
    assert prmt_b32_host(a, b, 0x3210) == 0x03020100
    assert prmt_b32_host(a, b, 0x0C84) == 0x00FF0084   # nibble 8: byte 0's sign (0); C: byte 4's sign (1)


def test_e4m3_order_moves_only_the_sign_bits_and_round_trips():
    dest = E2M1E4M3Order.destinations()
    assert sorted(dest) == list(range(32))
    for element in range(8):
        assert dest[4 * element:4 * element + 3] == tuple(range(4 * element, 4 * element + 3))
        assert dest[4 * element + 3] == (8 * element + 7 if element < 4 else 8 * (element - 4) + 3)
    packed = np.random.default_rng(3).integers(0, 256, (7, 96), dtype=np.uint8)
    ordered = E2M1E4M3Order.swizzle(packed)
    np.testing.assert_array_equal(E2M1E4M3Order.unswizzle(ordered), packed)
    assert not np.array_equal(ordered, packed)
    with pytest.raises(ValueError, match="4-byte words"):
        E2M1E4M3Order.swizzle(packed[:, :6])


@pytest.mark.parametrize("d", range(FOLD_WINDOW[0], FOLD_WINDOW[1] + 1))
def test_every_code_at_every_position_decodes_to_the_route_table(d):
    """Each of the 16 codes at each of the 8 positions of a word, others random: its byte is
    ``e2m1_to_e4m3_table(d)[code]``, bit for bit (window row ``d + 8``)."""
    rng = np.random.default_rng(d + 100)
    table = e2m1_to_e4m3_table(d)
    row = fd.fold_table_row(127 + d - 6, 127)   # a block whose scale sits d - 6 below the chunk's largest
    assert row == d - FOLD_WINDOW[0]
    t_lo, t_hi = fd.MAGNITUDE_TABLES[row]
    for code in range(16):
        for position in range(8):
            codes = rng.integers(0, 16, 8, dtype=np.uint8)
            codes[position] = code
            word = E2M1E4M3Order.swizzle(pack_fp4(codes)).view("<u4")[0]
            got = np.array(fd.decode_word(word, t_lo, t_hi), np.uint32).view(np.uint8)
            np.testing.assert_array_equal(got, table[codes], err_msg=f"d={d} code={code} position={position}")


def test_nan_and_out_of_window_rows():
    """A NaN scale makes every element NaN (0x7F, or 0xFF with the sign: both E4M3 NaN); a block 9 or more below
    the chunk's largest is marked out of window: its zeros stay (signed) zeros, every other code becomes NaN, so a
    live block the route cannot represent is never silently dropped."""
    codes = np.arange(16, dtype=np.uint8)[:8]
    word = E2M1E4M3Order.swizzle(pack_fp4(np.concatenate([codes, codes + 8]))).view("<u4")
    assert fd.fold_table_row(0xFF, 200) == fd.NAN_ROW
    for w in word:
        got = np.array(fd.decode_word(w, *fd.MAGNITUDE_TABLES[fd.NAN_ROW]), np.uint32).view(np.uint8)
        assert _is_nan_e4m3(got).all()
    row = fd.fold_table_row(200 - 15, 200)   # d = -9
    assert fd.is_out_of_window(row) and not fd.is_out_of_window(fd.fold_table_row(200 - 14, 200))
    got = np.array([fd.decode_word(w, *fd.MAGNITUDE_TABLES[row]) for w in word], np.uint32).view(np.uint8)
    got = got.reshape(2, 8)                   # codes 0-7, 8-15
    np.testing.assert_array_equal(got[:, 0], [0x00, 0x80])
    assert _is_nan_e4m3(got[:, 1:]).all()


def test_power_of_two_bits_is_ldexp_in_fp32_with_subnormals_and_the_ends():
    for e in range(-160, 140):
        got = np.array([fd.power_of_two_bits(e)], np.uint32).view(np.float32)[0]
        with np.errstate(over="ignore"):
            want = np.float32(np.ldexp(1.0, e)) if e <= 127 else np.float32(np.inf)
        assert got == want, e


def test_chunk_max_skips_nan_scales():
    word = lambda b: int(np.array(b, np.uint8).view("<u4")[0])
    assert fd.chunk_max_scale(word([120, 130, 0xFF, 7])) == 130
    assert fd.chunk_max_scale(word([0xFF] * 4)) == 0
    assert fd.promotion_log2(130) == 130 - 127 - 6


def _mxfp4_operand(rng, rows, k, scales):
    codes = rng.integers(1, 16, (rows, k), dtype=np.uint8)
    codes[codes == 8] = 9   # every block live: a nonzero element in each
    return BlockScaled(pack_fp4(codes), scales.astype(np.uint8), get_format("mxfp4"))


def test_decode_operand_is_the_route_model_where_every_block_is_live():
    """A whole operand through the per-thread steps (chunk max, table row, word decode) gives
    ``gbs.fp8_route.fold_operand``'s bytes, bases and out-of-window blocks, with in-window, out-of-window (17 below
    the chunk's largest) and NaN-scale blocks; NaN bytes compared as NaN (0x7F, or 0xFF with the code's sign)."""
    rng = np.random.default_rng(21)
    rows, k = 6, 512
    scales = rng.integers(110, 140, (rows, k // 32))
    scales[0, 1] = scales[0, 0] - 17          # out of window in chunk 0 of row 0
    scales[1, 4:8] = [125, 125, 125, 125]
    scales[2, 9] = 0xFF                        # a NaN block
    scales[3, 12:16] = [130, 121, 120, 116]    # d = 6, -3, -4, -8: the window's low end
    q = _mxfp4_operand(rng, rows, k, scales)
    model = fold_operand(q)
    got, bases, outside = fd.decode_operand(E2M1E4M3Order.swizzle(q.data), q.scales)
    np.testing.assert_array_equal(bases, model.bases)
    np.testing.assert_array_equal(outside, ~model.in_window)
    # out-of-window blocks: NaN where the model (whose fallback adds them) has zeros; the rest the same bytes
    dropped = np.repeat(outside, 32, axis=1) & (np.unpackbits(q.data[..., None], axis=-1, bitorder="little")
                                                .reshape(rows, k, 4)[..., :3].any(-1))
    nan = _is_nan_e4m3(model.e4m3) | dropped
    np.testing.assert_array_equal(_is_nan_e4m3(got), nan)
    np.testing.assert_array_equal(got[~nan], model.e4m3[~nan])     # the same bytes, signed zeros included
    assert outside[0, 1] and _is_nan_e4m3(got[2, 9 * 32:10 * 32]).all() and dropped[0, 32:64].all()


def test_decode_operand_is_the_route_model_of_finite_scales_with_zero_blocks():
    """With all-zero blocks (whose scales a kernel still counts) the per-thread steps are
    ``fold_operand(base_over="finite")`` exactly: bytes (signed zeros included), bases and out-of-window blocks; and
    a large-scale zero block pushes a neighbour out of the window that the live-only model keeps."""
    rng = np.random.default_rng(22)
    rows, k = 4, 256
    scales = rng.integers(118, 126, (rows, k // 32)).astype(np.uint8)
    codes = rng.integers(1, 16, (rows, k), dtype=np.uint8)
    codes[0, 0:32] = 0                  # a zero block with the chunk's largest scale
    scales[0, 0], scales[0, 1] = 140, 120
    codes[1, 64:96] = 8                 # negative zeros
    q = BlockScaled(pack_fp4(codes), scales, get_format("mxfp4"))
    got, bases, outside = fd.decode_operand(E2M1E4M3Order.swizzle(q.data), q.scales)
    model = fold_operand(q, base_over="finite")
    inside = ~np.repeat(outside, 32, axis=1)
    np.testing.assert_array_equal(got[inside], model.e4m3[inside])
    live = (codes[0, 32:64] & 7) != 0
    assert _is_nan_e4m3(got[0, 32:64][live]).all() and live.any()   # the pushed-out live block: NaN, not dropped
    np.testing.assert_array_equal(bases, model.bases)
    np.testing.assert_array_equal(outside, ~model.in_window)
    assert outside[0, 1] and fold_operand(q).in_window[0, 1]   # 20 below the zero block; live-only: in window
    with pytest.raises(ValueError, match="base_over"):
        fold_operand(q, base_over="all")


def test_k_order_gives_each_lane_whole_words_of_its_block():
    """In the route's K order every A register of an E4M3 k32 step (the m16n8k32 layout per warp: lane, byte) holds
    4 consecutive elements of one FP4 word of the block, word = quad lane, low half in registers 0/1 (rows g, g + 8),
    high half in 2/3: one decode per word, no lane decodes a word it half uses. The order is a permutation."""
    from gbs.ptx_inline import hopper as hp

    assert sorted(fd.block_element_at(p) for p in range(32)) == list(range(32))
    for lane in range(32):
        for i in range(16):
            row, k = hp.mma_m16n8k32_a_position(lane, i)
            register, byte = divmod(i, 4)
            assert row == lane // 4 + 8 * (register % 2)
            assert fd.block_element_at(k) == 8 * (lane % 4) + 4 * (register // 2) + byte


def test_decode_kernel_assembles_for_sm90a_with_two_prmt_per_word():
    """Offline (ptxas): the decode loop holds 2 PRMT per word decoded (4 words per table row), no local memory;
    each word is mask, shift left, shift right, 2 PRMT, 2 LOP3 (evidence: fp8-decode-offline)."""
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from numba.cuda import types

    from gbs.ptx_inline import offline

    u32_2d = types.Array(types.uint32, 2, "C")
    cubin = offline.compile_cubin(fd.decode_words_kernel, (u32_2d,) * 4, offline.SM90A)
    assert offline.resource_usage(cubin).local_bytes == 0
    sass = offline.disassemble(cubin)
    inner = min(offline.sass_loops(sass), key=lambda loop: len(loop.opcodes))
    counts = collections.Counter(inner.opcodes)
    stores = counts["STG.E"]
    assert stores == 8 and counts["PRMT"] == stores   # 4 words -> 8 E4M3 words, one PRMT each


@pytest.mark.gpu
def test_gpu_decode_kernel_gives_the_host_bytes():
    from numba import cuda

    from gbs.numba_kernels import launch
    from gbs.numba_kernels import h200_ring as hr

    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    rng = np.random.default_rng(5)
    rows, k = 300, 256
    scales = rng.integers(100, 150, (rows, k // 32))
    scales[::7, 3] = 0xFF
    q = _mxfp4_operand(rng, rows, k, scales)
    ordered = E2M1E4M3Order.swizzle(q.data)
    want, _, _ = fd.decode_operand(ordered, q.scales)
    words = cuda.to_device(np.ascontiguousarray(ordered).view("<u4"))
    scale_words = cuda.to_device(np.ascontiguousarray(q.scales).view("<u4"))
    out = cuda.device_array((rows, k // 4), np.uint32)
    kernel = cuda.jit(fd.decode_words_kernel)
    kernel[(rows + 127) // 128, 128](words, scale_words, cuda.to_device(fd.MAGNITUDE_TABLES), out)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint8), want)
