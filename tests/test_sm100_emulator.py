"""The SM100 CPU emulator: the kernel's host-visible logic replayed tile by tile must give exactly
the bits of an independent computation (and pass the reference's acceptance) on ragged problems
(empty group, -1 slot, 1-token group, sizes and N not multiples of the tile, K tails), both
orientations, cta_group 1 and 2, every format; a deliberately wrong kernel function must change
the result or trip the hardware model; per-CTA work counts match hand counts.
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from gbs import api, dispatch, formats
from gbs import sm100_emulator as em
from gbs.numba_kernels import sm100_addressing, sm100_spec
from gbs.numba_kernels.sm100_addressing import (FP4_UNPACK_DTYPE, OPERAND_LBO, OPERAND_SBO, TensorMapSpec,
                                                encode_smem_descriptor, mma_scale_slot, scale_atom_descriptor,
                                                tma_swizzled_offset)
from gbs.numba_kernels.sm100_spec import SCALE_TMEM_COLUMNS
from gbs.problem import build_problem
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.formats import SF_ATOM_BYTES, dequantize, scale_byte_offset
from gbs.reference import check_acceptance, is_poison, poison_output
from gbs.schedule import TileConfig

# Group sizes / expert ids of the ragged problem: a 5-token group, an empty group, a 1-token
# group, a skipped (-1) slot, groups of 30 and 140 tokens (140 crosses 128- and 64-token tiles).
RAGGED_SIZES = (5, 0, 1, 17, 30, 140)
RAGGED_IDS = (0, 1, 2, -1, 3, 1)
RAGGED_N = 320                       # not a multiple of 128 or 256
K_BY_FORMAT = {"nvfp4": 320, "mxfp4": 320, "mxfp8": 320, "mxfp8_e5m2": 320, "w4a8": 384}   # K tails
DISPATCH_KNOBS = [(True, 8, 1), (True, 64, 2), (True, 128, 2), (False, 128, 1)]
MORE_KNOBS = [(True, 16, 1), (True, 32, 1), (False, 16, 1), (False, 32, 1), (True, 64, 1), (False, 64, 1),
              (True, 256, 1), (False, 256, 1), (True, 256, 2)]


def ragged_problem(fmt: str, sizes=RAGGED_SIZES, ids=RAGGED_IDS, n=RAGGED_N, k_dim=None, seed=0):
    rng = np.random.default_rng(seed)
    k_dim = K_BY_FORMAT[fmt] if k_dim is None else k_dim
    activations = rng.standard_normal((sum(sizes), k_dim)).astype(np.float32)
    weights = (rng.standard_normal((max(ids) + 1, n, k_dim)) * rng.uniform(0.02, 0.1, (max(ids) + 1, 1, 1)))
    return build_problem(activations, weights.astype(np.float32), np.array(sizes), np.array(ids), fmt=fmt)


def expected_bits(problem) -> np.ndarray:
    """What the kernel computes, from the quantized operands alone: exact products and sums,
    rounded to the fp32 accumulator, times the fp32 expert scale in fp32, RNE to bf16; skipped
    rows keep the poison."""
    out = poison_output(problem.total_tokens, problem.n).view(np.uint16).copy()
    a = dequantize(problem.a_operand()).astype(np.float64)
    for g in problem.active_slots():
        e, lo, hi = int(problem.expert_ids[g]), int(problem.a_offsets[g]), int(problem.a_offsets[g + 1])
        acc = (a[lo:hi] @ dequantize(problem.b_operand(e)).astype(np.float64).T).astype(np.float32)
        out[lo:hi] = (acc * problem.expert_scales[e]).astype(ml_dtypes.bfloat16).view(np.uint16)
    return out


_PROBLEMS = {}


def problem_for(fmt):
    if fmt not in _PROBLEMS:
        _PROBLEMS[fmt] = ragged_problem(fmt)
    return _PROBLEMS[fmt]


def assert_exact(problem, result):
    np.testing.assert_array_equal(result.out.view(np.uint16), expected_bits(problem))
    assert check_acceptance(problem, result.out).passed


CASES = ([(fmt, knobs) for fmt in ("nvfp4", "mxfp4", "mxfp8", "w4a8") for knobs in DISPATCH_KNOBS]
         + [(fmt, knobs) for fmt in ("nvfp4", "mxfp8") for knobs in MORE_KNOBS]
         + [("w4a8", (False, 16, 1)), ("mxfp4", (True, 256, 2)), ("mxfp8_e5m2", (True, 64, 2))])


@pytest.mark.parametrize("fmt, knobs", CASES, ids=[f"{f}-{'T' if s else 'F'}{bn}-cg{cg}" for f, (s, bn, cg) in CASES])
def test_emulator_reproduces_the_ragged_problem_exactly(fmt, knobs):
    problem = problem_for(fmt)
    num_ctas = 6 if knobs[2] == 2 else 5     # several tiles per CTA: stages and buffers are reused
    result = em.emulate(problem, TileConfig(*knobs), num_ctas=num_ctas)
    assert_exact(problem, result)
    assert result.num_tiles == sum(c.tiles for c in result.counts) // knobs[2]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "w4a8"])
def test_emulator_with_the_dispatch_decision(fmt):
    """The config the dispatch picks for the problem (its knobs and stage count), default grid."""
    problem = problem_for(fmt)
    config = api.dispatch_for(problem)
    result = em.emulate(problem, config)
    assert result.stages == config.num_pipeline_stages
    assert_exact(problem, result)


def test_pipeline_ring_wraps_with_few_stages():
    """Two stages, four K slices per tile: every stage slot and scale TMEM column set is reused."""
    problem = ragged_problem("nvfp4", k_dim=1024)
    config = dispatch.grouped_matmul_nvfp4_dispatch(n=problem.n, k=problem.k, num_active_experts=6,
                                                    estimated_total_m=193, override=True, ab_swapped=True,
                                                    mma_bn=64, cta_group=2, num_pipeline_stages=2)
    result = em.emulate(problem, config, num_ctas=2)
    assert result.stages == 2 and result.counts[0].k_slices > 2 * 4
    assert_exact(problem, result)


def test_nothing_happens_when_every_slot_is_skipped_or_empty():
    problem = ragged_problem("mxfp8", sizes=(4, 0, 9), ids=(-1, 0, -1))
    result = em.emulate(problem, TileConfig(True, 8, 1))
    assert result.num_tiles == 0 and all(c.tiles == 0 for c in result.counts)
    assert np.all(is_poison(result.out))


def test_emulate_rejects_a_bad_grid():
    with pytest.raises(ValueError, match="multiple of cta_group"):
        em.emulate(problem_for("nvfp4"), TileConfig(True, 64, 2), num_ctas=3)


# ----------------------------------------------------------------------------------------------
# A wrong kernel decision is caught
# ----------------------------------------------------------------------------------------------
def _differs_or_raises(problem, knobs, num_ctas=4) -> bool:
    try:
        result = em.emulate(problem, TileConfig(*knobs), num_ctas=num_ctas)
    except em.EmulatorError:
        return True
    return not np.array_equal(result.out.view(np.uint16), expected_bits(problem))


def _defining_module(name):
    """The kernel module that defines function ``name`` (the emulator calls it through that module)."""
    return next(m for m in (sm100_addressing, sm100_spec) if getattr(getattr(m, name, None), "__module__", None)
                == m.__name__)


def _wrap(func, change):
    return lambda *args: change(func(*args), *args)


MUTATIONS = [
    # the MMA-B scale column adjustment of 64-token tiles that start mid-atom
    ("sfb_column_adjust", lambda r, *a: 0, "nvfp4", (True, 64, 2)),
    # the scale-factor ID of MXFP8 (bytes 0..3 of the scale cells)
    ("mma_scale_columns", lambda r, *a: (r[0], r[1], 0), "mxfp8", (True, 128, 2)),
    # the descriptor's K step (32 B per MMA)
    ("operand_descriptor", lambda r, tile, i: encode_smem_descriptor(tile + 16 * i, OPERAND_LBO, OPERAND_SBO,
                                                                       desc.SWIZZLE_128B, 0, 0), "nvfp4", (True, 8, 1)),
    # the output chunk's swizzle (unswapped, 128B)
    ("tma_swizzled_offset", lambda r, offset, span: offset, "mxfp8", (False, 128, 1)),
    # the token scale band
    ("tile_load_coordinates", lambda r, *a: (r[0], r[1], r[2] + 1, r[3], r[4]), "mxfp4", (True, 128, 2)),
    # the pair's token half
    ("tile_load_coordinates", lambda r, *a: (r[0] - a[2] * a[1], r[1], r[2], r[3], r[4]), "nvfp4", (True, 64, 2)),
    # band-major vs K-tile-major scale atoms in TMEM (two bands per K tile)
    ("scale_copy_offsets", lambda r, j, band, nsf, bands: (r[0], (j * bands + band) * SF_ATOM_BYTES), "mxfp4",
     (False, 256, 1)),
    # the scale rows the store warps write
    ("sfb_store_word_offset", lambda r, row, lane, j, nsf: scale_byte_offset(row + lane + 1, j * 4, nsf), "nvfp4",
     (True, 16, 1)),
    # TMA stores for chunks that cross the group's end
    ("chunk_uses_tma_store", lambda r, *a: True, "nvfp4", (True, 64, 2)),
    # output coordinates of the element-wise store
    ("accumulator_output", lambda r, *a: (r[0], r[1] + 1), "mxfp8", (False, 128, 1)),
    # overlapping TMEM plan: the hardware model refuses it
    ("tmem_columns", lambda r, *a: (0, r[1], r[2]), "mxfp8", (True, 8, 1)),
]


@pytest.mark.parametrize("name, change, fmt, knobs", MUTATIONS, ids=[f"{m[0]}-{m[2]}" for m in MUTATIONS])
def test_a_wrong_kernel_function_is_caught(monkeypatch, name, change, fmt, knobs):
    problem = problem_for(fmt)
    assert not _differs_or_raises(problem, knobs)          # the real function passes ...
    module = _defining_module(name)
    monkeypatch.setattr(module, name, _wrap(getattr(module, name), change))
    assert _differs_or_raises(problem, knobs)              # ... the wrong one does not


def test_a_wrong_instruction_descriptor_is_caught(monkeypatch):
    """W4A8 with the operand formats swapped in the descriptor (E4M3 read as A, E2M1 as B)."""
    problem = problem_for("w4a8")
    wrong = property(lambda spec: desc.BlockScaledInstrDesc(spec.kind.name, spec.mma_m, spec.mma_bn,
                                                            spec.mma_b_element, spec.mma_a_element,
                                                            spec.scale_type).encode())
    monkeypatch.setattr(sm100_spec.Sm100KernelSpec, "instr_desc", wrong)
    assert _differs_or_raises(problem, (True, 8, 1))


# ----------------------------------------------------------------------------------------------
# The hardware models against documented layouts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("swizzle, span", [("32B", 32), ("64B", 64), ("128B", 128)])
def test_tma_swizzle_rule_matches_the_kernels_address_form(swizzle, span):
    """The TMA documentation's per-row rule (chunk c of row r -> c ^ f(r)) and the kernel's
    address-bit XOR (``tma_swizzled_offset``) are the same permutation of a pattern-aligned box."""
    xor = em.TMA_SWIZZLE_ROW_XOR[swizzle]
    for row, byte in itertools.product(range(32), range(span)):
        offset = row * span + byte
        by_row = row * span + ((byte // 16) ^ xor(row)) * 16 + byte % 16
        assert tma_swizzled_offset(offset, span) == by_row
    assert tma_swizzled_offset(1234, 16) == 1234     # 16 = no swizzle


def test_tma_load_model_zero_fills_and_swizzles():
    data = np.arange(3 * 200, dtype=np.int64).astype(np.uint8).reshape(3, 200)     # 3 rows x 200 bytes
    spec = TensorMapSpec("t", "uint8", (200, 3), (200,), (128, 8), "128B", 1024)
    image = em.tma_load_box(spec, data, (128, 1)).reshape(8, 128)
    for r in range(8):
        row = np.zeros(128, np.uint8)
        if 1 + r < 3:
            row[:72] = data[1 + r, 128:200]                   # 72 bytes inside, the rest zero
        chunks = row.reshape(8, 16)
        assert np.array_equal(image[r].reshape(8, 16)[np.arange(8) ^ (r % 8)], chunks)


def test_fp4_unpacking_load_model():
    """16U4_ALIGN16B: each 16 packed E2M1 values (8 B) fill the first half of a 16-byte chunk."""
    packed = np.arange(1 * 2 * 64, dtype=np.uint8).reshape(1, 2, 64)     # (experts, rows, K/2 bytes)
    spec = TensorMapSpec("w", FP4_UNPACK_DTYPE, (128, 2, 1), (64, 128), (128, 2, 1), "none", 256)
    image = em.tma_load_box(spec, packed, (0, 0, 0)).reshape(2, 8, 16)
    assert np.array_equal(image[:, :, :8], packed.reshape(2, 8, 8))
    assert not image[:, :, 8:].any()


def test_scale_copy_model_matches_the_documented_tmem_cells():
    """tcgen05.cp 32x128b.warpx4 of one 128x4 atom puts scale (row, col) where
    ``sm100_descriptors.scale_atom_tmem_cell`` says (in every 32-lane partition)."""
    atom = np.random.default_rng(3).integers(0, 256, SF_ATOM_BYTES, dtype=np.uint8)
    cta = em.CtaState(np.concatenate([np.zeros(64, np.uint8), atom]))
    em.scale_copy([cta], 0, 1, 8, scale_atom_descriptor(em.EMULATED_SMEM_BASE + 64))
    for row, col in itertools.product(range(128), range(4)):
        column, lane, byte = desc.scale_atom_tmem_cell(row, col)
        for partition in range(4):
            word = int(cta.words[lane + 32 * partition, 8 + column])
            assert (word >> (8 * byte)) & 0xFF == atom[formats.scale_offset(row, col, 4)]


@pytest.mark.parametrize("kind", sorted(desc.BLOCK_SCALED_KINDS))
def test_device_scale_slot_matches_mma_scale_position(kind):
    spec = desc.get_kind(kind)
    for i in range(8):
        atom, sf_id = mma_scale_slot(i, spec.scale_vec)
        assert (atom * SCALE_TMEM_COLUMNS, sf_id) == desc.mma_scale_position(kind, i)


# ----------------------------------------------------------------------------------------------
# Per-CTA work against hand counts
# ----------------------------------------------------------------------------------------------
def _counts(result, cta):
    c = result.counts[cta]
    return dict(tiles=c.tiles, k_slices=c.k_slices, tma_loads=c.tma_loads, token_bytes=c.token_bytes,
                weight_bytes=c.weight_bytes, token_scale_bytes=c.token_scale_bytes,
                weight_scale_bytes=c.weight_scale_bytes, mmas=c.mmas, scale_copies=c.scale_copies,
                scale_stores=c.scale_stores, tma_stores=c.tma_stores, tma_store_bytes=c.tma_store_bytes,
                elements_stored=c.elements_stored)


def test_work_counts_decode_by_hand():
    """MXFP8, 8 tokens x 128 weight rows per tile, N = 256 (2 row blocks), K = 256 (2 slices of
    128). Slots: 8 tokens, 3 tokens, empty, skipped, 12 tokens -> tiles (walk order)
    t0 s0 n0, t1 s0 n1, t2 s1 n0, t3 s1 n1, t4 s4 m0n0, t5 s4 m1n0, t6 s4 m0n1, t7 s4 m1n1;
    3 CTAs: CTA c takes t_c, t_c+3, t_c+6. Per tile: 2 slices x (4 loads: 1 KiB tokens, 16 KiB
    weights, 512 B per scale atom; 4 MMAs; 1 scale copy (MMA-A); 4 tcgen05.st warp stores).
    Full 8-token tiles leave by one 2 KiB TMA store, partial ones element by element (x 128 rows)."""
    problem = ragged_problem("mxfp8", sizes=(8, 3, 0, 5, 12), ids=(0, 1, 2, -1, 1), n=256, k_dim=256)
    result = em.emulate(problem, TileConfig(True, 8, 1), num_ctas=3)
    assert_exact(problem, result)

    def per_tiles(tiles, tma_stores, elements):
        slices = 2 * tiles
        return dict(tiles=tiles, k_slices=slices, tma_loads=4 * slices, token_bytes=1024 * slices,
                    weight_bytes=16384 * slices, token_scale_bytes=512 * slices, weight_scale_bytes=512 * slices,
                    mmas=4 * slices, scale_copies=slices, scale_stores=4 * slices, tma_stores=tma_stores,
                    tma_store_bytes=2048 * tma_stores, elements_stored=elements)

    assert _counts(result, 0) == per_tiles(3, 2, 3 * 128)          # t0 (TMA), t3 (3 tokens), t6 (TMA)
    assert _counts(result, 1) == per_tiles(3, 2, 4 * 128)          # t1 (TMA), t4 (TMA), t7 (4 tokens)
    assert _counts(result, 2) == per_tiles(2, 0, 3 * 128 + 4 * 128)   # t2 (3 tokens), t5 (4 tokens)


def test_work_counts_cta_pair_by_hand():
    """NVFP4, pairs of CTAs over 64 tokens x 256 weight rows, N = 384 (the second row block's odd
    CTA lies past N), K = 512 (2 slices of 256). Slots of 70 and 20 tokens -> t0 s0 m0n0,
    t1 s0 m1n0, t2 s0 m0n1, t3 s0 m1n1, t4 s1 m0n0, t5 s1 m0n1; pair 0 (CTAs 0, 1) takes t0 t2
    t4, pair 1 (CTAs 2, 3) t1 t3 t5. Every CTA loads 16 KiB of weights, 4 KiB of tokens (its 32)
    and 4 + 4 scale atoms per slice; the even CTA issues 4 MMAs and 8 scale copies per slice.
    Epilogue chunks of 32 tokens: t0 two TMA stores per CTA, t2 two on CTA 0 (CTA 1 has no rows);
    partial chunks store 6 (t1, t3) or 20 (t4, t5) tokens x 128 rows element-wise."""
    problem = ragged_problem("nvfp4", sizes=(70, 20), ids=(0, 1), n=384, k_dim=512)
    result = em.emulate(problem, TileConfig(True, 64, 2), num_ctas=4)
    assert_exact(problem, result)

    def cta(even, tma_stores, elements):
        slices = 6
        return dict(tiles=3, k_slices=slices, tma_loads=4 * slices, token_bytes=4096 * slices,
                    weight_bytes=16384 * slices, token_scale_bytes=2048 * slices, weight_scale_bytes=2048 * slices,
                    mmas=4 * slices if even else 0, scale_copies=8 * slices if even else 0, scale_stores=0,
                    tma_stores=tma_stores, tma_store_bytes=8192 * tma_stores, elements_stored=elements)

    assert _counts(result, 0) == cta(True, 4, 20 * 128)
    assert _counts(result, 1) == cta(False, 2, 20 * 128)
    assert _counts(result, 2) == cta(True, 0, (6 + 6 + 20) * 128)
    assert _counts(result, 3) == cta(False, 0, 6 * 128)
    assert sum(c.bytes_loaded for c in result.counts) == 4 * 6 * (16384 + 4096 + 2048 + 2048)
