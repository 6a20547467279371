"""The H200 wgmma (prefill) kernel: host checks of its K permutation, buffers and legality (CPU), its
SASS (offline, sm_90a), and its numerics on the GPU (``-m gpu``, skipped without one: run them on the
H200 through the device tool, ``scripts/gpu_run.sh tests``).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import types
import zlib

import numpy as np
import pytest

from gbs.lab.cases import synthetic_problem
from gbs.dispatch import AUTO_STAGES, H200_SMEM_PER_SM, dispatch_for
from gbs import plan as gbs_plan
from gbs.numba_kernels import h200_decode as hd
from gbs.numba_kernels import h200_launch
from gbs.numba_kernels import h200_ring as hr

from gbs.numba_kernels import h200_wgmma as hw
from gbs.numba_kernels import launch
from gbs.problem import PROBLEM_FORMATS
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import offline
from gbs.formats import SF_ATOM_BYTES, SF_ATOM_ROWS, get_format, scale_byte_offset
from gbs.reference import POISON_BITS, reference_grouped_matmul
from h200_knobs import SCALED_TOKEN_FORMATS, Wgmma, check_kernel, plan_spec, prepare, run

FORMATS = SCALED_TOKEN_FORMATS
FITTING = [(fmt, bn) for fmt in FORMATS for bn in hw.WGMMA_MMA_BN]
# (format, mma_bn, ab_swapped): every tile of both orientations
ORIENTED = [(fmt, bn, False) for fmt, bn in FITTING] + [(fmt, bn, True) for fmt in FORMATS for bn in hw.SWAPPED_MMA_BN]


def spec_of(fmt: str, mma_bn: int, stages: int | None = None, tile_tokens: int = 128,
            ab_swapped: bool = False) -> hw.WgmmaSpec:
    a, b = PROBLEM_FORMATS[fmt]
    if stages is None:   # the deepest ring beside the bf16 buffers
        stages = 1
        while spec_of(fmt, mma_bn, stages + 1, tile_tokens, ab_swapped).smem.total_bytes <= H200_SMEM_PER_SM:
            stages += 1
    return hw.WgmmaSpec(a, b, mma_bn, stages, tile_tokens=tile_tokens, ab_swapped=ab_swapped)


def sub_step_group(spec: hw.WgmmaSpec, sub: int, step: int, q: int) -> int:
    """The group (inside its quarter) quad lane ``q`` reads at group step ``step`` of sub-step ``sub``, the
    way the kernel addresses it: ``rotated(first_c + step, q)`` in run 0, moved by whole runs."""
    first_c, run = hw.sub_step_groups(spec.groups_per_sub, sub // hw.A_FRAGMENT_SETS, sub % hw.A_FRAGMENT_SETS)
    return int(hd.rotated_group(first_c + step, q)) + hd.ROTATION_RUN * run


def real_k(spec: hw.WgmmaSpec, sub: int, step: int, q: int, j: int, hi: int) -> int:
    """Real k (inside the K slice) of register ``j``'s half ``hi`` of that group."""
    return (q * (spec.k_slice // hd.QUAD) + sub_step_group(spec, sub, step, q) * hd.GROUP_ELEMENTS
            + hd.pair_elements(j, spec.ring.pairing)[hi])


def writer_k(spec: hw.WgmmaSpec, sub: int, step: int, q: int, j: int, hi: int) -> tuple[int, int]:
    """(kappa, real k) of the element the kernel's weight decode writes for group step ``step`` of
    sub-step ``sub``, quad lane ``q``'s quarter, register ``j``, half ``hi``: register j goes to word q
    of the chunk ``b_buffer_offset(kb = 2 step + j // 2, h = j % 2)``; kappa is where that byte sits in
    the canonical layout (column block kappa // 64, 128B swizzle)."""
    kb, h = 2 * step + j // 2, j % 2
    offset = hw.b_buffer_offset(spec.mma_bn, 5, kb, h) + 4 * q + 2 * hi   # any row: 5
    block, in_block = divmod(offset, spec.mma_bn * hw.BF16_ROW_BYTES)
    kappa = None
    for byte in range(hw.BF16_ROW_BYTES):
        if hp.kmajor_sw128_offset(5, byte) == in_block:
            kappa = block * hw.SW128_KAPPA + byte // 2
    return kappa, real_k(spec, sub, step, q, j, hi)


@pytest.mark.parametrize("fmt, bn, swapped", ORIENTED)
def test_b_operand_k_is_a_permutation_of_the_slice(fmt, bn, swapped):
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    seen = [hw.b_operand_k(spec, sub, kappa) for sub in range(spec.subs_per_slice) for kappa in range(spec.sub_k)]
    assert sorted(seen) == list(range(spec.k_slice))


@pytest.mark.parametrize("fmt, bn, swapped", ORIENTED)
def test_b_writer_puts_every_element_at_its_kappa(fmt, bn, swapped):
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    for sub in range(spec.subs_per_slice):
        for step in range(spec.groups_per_sub):
            for q in range(hd.QUAD):
                for j in range(4):
                    for hi in range(2):
                        kappa, real = writer_k(spec, sub, step, q, j, hi)
                        assert hw.b_operand_k(spec, sub, kappa) == real


@pytest.mark.parametrize("fmt, bn, swapped", ORIENTED)
def test_b_items_cover_every_row_step_and_quarter_once(fmt, bn, swapped):
    """Each (B row, group step, quarter) of a sub-step is decoded by exactly one consumer thread; where a
    thread takes fewer than 4 quarters (the swapped 32- and 64-token buffers), the chunk words it writes
    (4 bytes per quarter, at the quarter's word) are its own."""
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    items = [hw.b_item_row(spec, t, it) for t in range(hw.CONSUMER_THREADS) for it in range(spec.b_items)]
    quarters = [(row, step, first + qq) for row, step, first in items for qq in range(spec.b_quarters)]
    assert sorted(quarters) == [(r, s, q) for r in range(bn) for s in range(spec.groups_per_sub)
                                for q in range(hd.QUAD)]
    assert all(first % spec.b_quarters == 0 for _, _, first in items), "8- / 4-byte aligned chunk words"


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_loads_of_a_warp_hit_distinct_banks(fmt):
    """One weight load instruction (fixed item and quarter): the 32 lanes' words (8 rows x 4 group
    steps, or 16 x 2 for the 128-element slices) in the TMA-swizzled raw stage."""
    spec = spec_of(fmt, 128)
    side = spec.ring.n_side
    worst = 1
    for warp in range(8):
        for item in range(spec.b_items):
            for q in range(hd.QUAD):
                banks = collections.Counter()
                for lane in range(hr.WARP_SIZE):
                    row, step, _ = hw.b_item_row(spec, hr.WARP_SIZE * warp + lane, item)
                    gl = int(hd.rotated_group(step, q))   # sub-step 0 (other runs XOR whole runs)
                    col = int(hd.group_column(q, gl, side.thread_bytes, side.group_bytes,
                                              hd.swizzle_xor(row, side.row_bytes, side.swizzle_mask)))
                    for word in range(side.group_bytes // 4):
                        banks[((row * side.row_bytes + col) // 4 + word) % 32] += 1
                worst = max(worst, max(banks.values()))
    # 8 rows x 4 steps (FP4 x FP4): conflict-free. 16 rows x 2 steps: two words per bank at most
    # (FP8's 8-byte loads need 2 wavefronts anyway; W4A8's 64-byte FP4 rows repeat banks every 2 rows).
    assert worst <= (1 if spec.lanes_per_group_step == 8 else 2)


@pytest.mark.parametrize("fmt, bn, swapped", ORIENTED)
def test_a_fragments_carry_the_elements_b_operand_k_expects(fmt, bn, swapped):
    """The kernel stores register j of group step p and row half i at ``a_fragment_index(p, j, i)``: A
    register ``index % 4`` of k16 step ``index // 4``. wgmma reads that register as (row g + 8 i, k, k + 1)
    (``wgmma_a_register_position``); kappa ``16 (index // 4) + k`` must carry the real k that the
    thread decoded there, for the same permutation the B writer uses."""
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    for sub in range(spec.subs_per_slice):
        for thread in range(0, hp.WGMMA_THREADS, 5):   # every quad lane and row, in a few warps
            lane = thread % 32
            g, q = lane // 4, lane % 4
            for p in range(spec.groups_per_sub):
                for j in range(4):
                    for i in range(2):
                        index = hw.a_fragment_index(p, j, i)
                        kb, reg = divmod(index, 4)
                        for hi in range(2):
                            row, k = hp.wgmma_a_register_position(thread, 2 * reg + hi)
                            assert row == 16 * (thread // 32) + g + 8 * i
                            assert hw.b_operand_k(spec, sub, hw.WGMMA_K * kb + k) == real_k(spec, sub, p, q, j, hi)


@pytest.mark.parametrize("bn", hw.SWAPPED_MMA_BN)
def test_swapped_epilogue_stores_each_weight_row_and_token_once(bn):
    """The swapped epilogue's (weight row, token) of every consumer thread's accumulator is the transpose of
    ``wgmma_accumulator_position`` and covers the 128 x ``mma_bn`` tile once."""
    seen = collections.Counter()
    for cw in range(hw.CONSUMER_WARPGROUPS * hw.WARPGROUP_WARPS):
        warpgroup, warp = divmod(cw, hw.WARPGROUP_WARPS)
        for lane in range(hr.WARP_SIZE):
            m_row = warpgroup * hw.TOKENS_PER_WARPGROUP + warp * hw.ROWS_PER_WARP + lane // 4
            for i in range(bn // 2):
                row, token = hw.swapped_accumulator_position(m_row, lane % 4, i)
                mma_row, mma_col = hp.wgmma_accumulator_position(hr.WARP_SIZE * warp + lane, i)
                assert (row, token) == (warpgroup * hw.TOKENS_PER_WARPGROUP + mma_row, mma_col)
                seen[row, token] += 1
    assert sorted(seen) == [(r, t) for r in range(128) for t in range(bn)] and set(seen.values()) == {1}


def test_a_fragment_indices_fill_one_set():
    indices = sorted(hw.a_fragment_index(p, j, i) for p in range(4) for j in range(4) for i in range(2))
    assert indices == list(range(32))


def test_b_buffer_offset_is_the_canonical_sw128_layout():
    for bn in hw.WGMMA_MMA_BN + hw.SWAPPED_MMA_BN:
        for row in range(16):
            for kb in range(8):
                for h in range(2):
                    block = bn * hw.BF16_ROW_BYTES * (kb // 4)
                    assert hw.b_buffer_offset(bn, row, kb, h) == block + hp.kmajor_sw128_offset(
                        row, 32 * (kb % 4) + 16 * h)


@pytest.mark.parametrize("fmt, bn, swapped", ORIENTED)
def test_ring_and_buffers_fit_and_one_more_stage_does_not(fmt, bn, swapped):
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    assert spec.stages >= 2
    assert spec.smem.total_bytes <= H200_SMEM_PER_SM
    assert spec.buffers_offset % hw.SW128_ATOM_BYTES == 0 and spec.buffer_bytes % hw.SW128_ATOM_BYTES == 0
    assert spec.buffers_offset >= spec.ring.smem.dynamic_bytes
    deeper = dataclasses.replace(spec, stages=spec.stages + 1)
    assert deeper.smem.total_bytes > H200_SMEM_PER_SM
    # a producer warpgroup and two consumer warpgroups at every tile width (the 32-token ring too)
    assert spec.ring.producer_warps == hw.WARPGROUP_WARPS and spec.ring.consumer_warps == 2 * hw.WARPGROUP_WARPS
    assert spec.threads == 384 and not spec.ring.predecoded_tokens


@pytest.mark.parametrize("fmt", FORMATS)
def test_swapped_ring_puts_weights_on_m_and_tokens_on_n(fmt):
    """``ab_swapped``: the ring's 128-row M side is the weights (A fragments), its ``mma_bn``-row N side the
    tokens (the bf16 B buffer), in one scale band (a token tile starts at a multiple of ``mma_bn`` inside its
    group, and ``mma_bn`` divides 128)."""
    for bn in hw.SWAPPED_MMA_BN:
        ring = spec_of(fmt, bn, ab_swapped=True).ring
        assert ring.m_side.role == "weights" and ring.m_side.rows == 128
        assert ring.n_side.role == "tokens" and ring.n_side.rows == bn and ring.n_side.scale_bands == 1
        assert ring.tile_shape.tokens == bn and ring.tile_shape.weight_rows == 128
        assert SF_ATOM_ROWS % bn == 0


@pytest.mark.parametrize("fmt, bn, swapped, items, quarters, sub_k", [
    ("nvfp4", 128, False, 2, 4, 128), ("nvfp4", 256, False, 2, 4, 64), ("mxfp8", 256, False, 2, 4, 64),
    ("mxfp8", 128, False, 1, 4, 64), ("w4a8", 256, False, 2, 4, 64), ("nvfp4", 64, True, 1, 4, 128),
    ("nvfp4", 32, True, 1, 2, 128), ("mxfp8", 64, True, 1, 2, 64), ("w4a8", 32, True, 1, 1, 64)])
def test_sub_step_shape(fmt, bn, swapped, items, quarters, sub_k):
    spec = spec_of(fmt, bn, ab_swapped=swapped)
    assert spec.b_items == items and spec.b_quarters == quarters and spec.sub_k == sub_k and spec.threads == 384
    assert spec.k_steps * hw.WGMMA_K == sub_k and spec.column_blocks * hw.SW128_KAPPA == sub_k


def _problem(fmt, n=512, k=1024, sizes=(5, 0, 1, 37, 130, 300), ids=(0, 4, 1, -1, 2, 3), seed=0):
    return synthetic_problem(fmt, n=n, k=k, group_sizes=list(sizes), expert_ids=list(ids), num_experts=5, seed=seed)


def test_256_token_tiles_cover_each_token_row_once():
    """The consumers' rows of a 256-token tile (the kernel's ``m_row`` + 128 per m64 tile, g + 8 i per
    lane, as the A fragments, their scales and the epilogue use them): every token row 0..255 exactly once
    per quad lane, and rows 128.. read their scales from the stage's second band (``scale_byte_offset``
    moves a whole band of atoms)."""
    spec = spec_of("nvfp4", 128, tile_tokens=256)
    atoms = spec.ring.m_side.sf_atoms_per_slice
    m_tile_rows = hw.CONSUMER_WARPGROUPS * hw.TOKENS_PER_WARPGROUP
    for q in range(hd.QUAD):
        rows = collections.Counter()
        for cw in range(hw.CONSUMER_WARPGROUPS * hw.WARPGROUP_WARPS):
            for g in range(8):
                warpgroup, warp = divmod(cw, hw.WARPGROUP_WARPS)
                m_row = warpgroup * hw.TOKENS_PER_WARPGROUP + warp * hw.ROWS_PER_WARP + g
                for mt in range(spec.m_tiles):
                    for i in range(2):
                        row = m_row + m_tile_rows * mt + 8 * i
                        rows[row] += 1
                        band = scale_byte_offset(row, 0, atoms) // (atoms * SF_ATOM_BYTES)
                        assert band == row // SF_ATOM_ROWS
        assert sorted(rows) == list(range(256)) and set(rows.values()) == {1}


@pytest.mark.parametrize("constraints, error, match", [
    (dict(ab_swapped=True, mma_bn=128), ValueError, "mma_bn in \\(32, 64\\) with ab_swapped=True"),
    (dict(ab_swapped=True, mma_bn=8), ValueError, "mma_bn in \\(32, 64\\) with ab_swapped=True"),
    (dict(ab_swapped=False, mma_bn=128, cta_group=2), ValueError, "cta_group 1"),
    (dict(mma_bn=128, stages=9), ValueError, "do not fit"),
    (dict(mma_n=128), TypeError, "unknown plan constraints"),
])
def test_illegal_constraints_are_refused_with_the_reason(constraints, error, match):
    with pytest.raises(error, match=match):
        gbs_plan.plan_h200(_problem("nvfp4"), backend="h200_wgmma", **constraints)


def test_a_config_with_a_pair_is_refused():
    problem = _problem("nvfp4")
    decision = dataclasses.replace(dispatch_for(problem), ab_swapped=True, mma_bn=64, cta_group=2)
    with pytest.raises(ValueError, match="cta_group=1 only"):
        gbs_plan.plan_h200(problem, decision, "h200_wgmma")


def test_wgmma_spec_checks_its_knobs():
    with pytest.raises(ValueError, match="mma_bn in"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 64, 2)
    with pytest.raises(TypeError, match="stages must be an int"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 128, 2.0)
    with pytest.raises(ValueError, match="tile_tokens in"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 128, 2, tile_tokens=192)
    with pytest.raises(ValueError, match="tile_tokens=256 takes mma_bn"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 256, 2, tile_tokens=256)   # 2 x 128 accumulators per thread
    with pytest.raises(ValueError, match="ab_swapped False"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 32, 2, tile_tokens=256, ab_swapped=True)
    with pytest.raises(TypeError, match="ab_swapped must be a bool"):
        hw.WgmmaSpec("nvfp4", "nvfp4", 32, 2, ab_swapped=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_256_token_tiles_share_one_weight_decode(fmt):
    """``tile_tokens`` = 256: each warpgroup two m64 tiles on the same B buffer, 64-kappa sub-steps, the ring's
    M side 256 token rows (two scale bands, one 256-row TMA box), at least 2 stages beside the buffers; the
    weight decode per sub-step is the 128-token tile's, for twice the tokens."""
    spec = spec_of(fmt, 128, tile_tokens=256)
    narrow = spec_of(fmt, 128)
    assert spec.m_tiles == 2 and narrow.m_tiles == 1
    assert spec.sub_k == hw.WIDE_SUB_K and spec.ring.m_side.rows == 256 and spec.ring.m_side.scale_bands == 2
    assert spec.ring.tile_shape.tokens == 256 and spec.ring.token_box[1] == 256
    assert 2 <= spec.stages and spec.smem.total_bytes <= H200_SMEM_PER_SM
    assert spec.buffer_bytes == hw.WIDE_SUB_K * 128 * 2, "a sub-step's 128 weight rows of bf16"
    # each item: one weight row's group step in all 4 quarters (32 elements)
    assert spec.b_items * narrow.sub_k == narrow.b_items * spec.sub_k, "weight work per kappa unchanged"


def test_k_tails_plan_and_rows_tma_cannot_load_are_refused():
    """K = 384 is 1.5 FP4 slices: planned, the last slice partial; K = 400 makes 200-byte FP4 rows, which TMA
    cannot address: refused with the K to pad to."""
    assert plan_spec(_problem("nvfp4", k=384), Wgmma(128)).k_slice == 256
    with pytest.raises(ValueError, match="pad K to 416"):
        plan_spec(_problem("nvfp4", k=400), Wgmma(128))


# Local memory the offline compile may use (ptxas 13.5), per (mma_bn, tile_tokens). 128 x 128: nothing in
# the K loop (first to last HGMMA), <= ~45 scalar accesses of the tile walk / epilogue outside it. 256 wide
# (128 accumulators at the 232-register budget): a few spilled loop invariants reloaded in the K loop and
# the epilogue's accumulator copy in local memory (measured on the H200 anyway: MXFP8 +8 %, W4A8 +16 %).
# 256 tokens (2 x 64 accumulators and two tiles' A fragments, 240 registers per consumer thread): nothing from
# the first to the last HGMMA since the K loop re-reads the lane (ptxas had hoisted and spilled the token
# columns / selectors: 17 reloads per sub-step pair for NVFP4, whose L1 misses made 3 stages 10 % slower, ncu
# run 67); 104-130 in all, ~75 of them the producer's at 24 registers.
# Swapped 32- / 64-token tiles (16 / 32 accumulators): as 128 x 128 (NVFP4 bn32, packed operands: 38 outside the loop).
LOCAL_IN_K_LOOP = {(128, 128): 0, (256, 128): 8, (128, 256): 0, (32, 128): 0, (64, 128): 0}
LOCAL_TOTAL = {(128, 128): 64, (256, 128): 256, (128, 256): 160, (32, 128): 64, (64, 128): 64}


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
@pytest.mark.parametrize("fmt, bn, tile_tokens, swapped", [
    ("nvfp4", 128, 128, False), ("mxfp8", 128, 128, False), ("w4a8", 128, 128, False), ("mxfp8", 256, 128, False),
    ("w4a8", 256, 128, False), ("nvfp4", 128, 256, False), ("mxfp4", 128, 256, False), ("nvfp4", 32, 128, True),
    ("w4a8", 64, 128, True)])
def test_sass_has_hgmma_and_bounded_local_memory(fmt, bn, tile_tokens, swapped):
    """Offline (ptxas 13.5, sm_90a): the consumers issue HGMMA with A from registers (two register
    sets, so the wgmma pipeline is not serialized: at most one wait per sub-step), and local memory
    stays within the budgets above. A B item of two quarters (swapped NVFP4 at 32 tokens, W4A8 at 64) writes
    its half of each chunk with one STS.64."""
    spec = spec_of(fmt, bn, tile_tokens=tile_tokens, ab_swapped=swapped)
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    instructions = offline.sass_instructions(offline.disassemble(cubin))
    hgmma = [i for i, ins in enumerate(instructions) if ins.startswith(f"HGMMA.64x{bn}x16.F32.BF16")]
    local = [(i, ins.split()[0]) for i, ins in enumerate(instructions) if re.match(r"(LDL|STL)\b", ins)]
    waits = [ins for ins in instructions[hgmma[0]:hgmma[-1] + 1] if ins.startswith("WARPGROUP.DEPBAR")]
    assert len(hgmma) >= hw.A_FRAGMENT_SETS * spec.m_tiles * spec.k_steps, "two sub-steps' wgmmas, unrolled"
    assert len(waits) <= len(hgmma) // (spec.m_tiles * spec.k_steps), "no wait between the wgmmas of one sub-step"
    assert not offline.serialized_wgmma(instructions)
    assert len([op for i, op in local if hgmma[0] <= i <= hgmma[-1]]) <= LOCAL_IN_K_LOOP[bn, tile_tokens]
    assert len(local) <= LOCAL_TOTAL[bn, tile_tokens], local
    if spec.b_quarters == 2:
        assert any(ins.startswith("STS.64") for ins in instructions[hgmma[0] - 400:hgmma[-1]])


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
def test_h200_token_layout_shortens_the_256_token_k_loop():
    """FP4 tokens in ``E2M1H200Order`` (``a_layout``): the token decode, two thirds of the elements a
    256-token K loop decodes, takes 9 instead of 13 integer instructions per word. Offline (ptxas 13.5,
    NVFP4 with re-laid weights): 660 -> 596 instructions per 128 kappa, no local memory in the loop."""
    sizes = {}
    for a_layout in ("packed", "e2m1_h200"):
        spec = dataclasses.replace(spec_of("nvfp4", 128, tile_tokens=256), b_layout="e2m1_h200", a_layout=a_layout)
        cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(spec.threads, spec.min_ctas_per_sm))
        hot = [loop for loop in offline.sass_loops(offline.disassemble(cubin)) if loop.count("HGMMA")][0]
        assert hot.count("LDL") + hot.count("STL") == 0
        sizes[a_layout] = hot.size
    assert sizes["e2m1_h200"] <= sizes["packed"] - 50, sizes


def test_register_splits_fill_the_launch_allocation():
    """``setmaxnreg``: the producer warpgroup's registers plus the two consumer warpgroups' are exactly the
    launch's 384 threads x 168, for the 128-token split and the 256-token one (multiples of 8, 24..256)."""
    launch_allocation = hr.WARP_SIZE * (hr.WARPGROUP_WARPS + 2 * hr.WARPGROUP_WARPS) * 168
    for producer, consumer in ((hw.PRODUCER_REGISTERS, hw.CONSUMER_REGISTERS),
                               (hw.PRODUCER_REGISTERS_TWO_M_TILES, hw.CONSUMER_REGISTERS_TWO_M_TILES)):
        assert hp.WGMMA_THREADS * (producer + 2 * consumer) == launch_allocation
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in (producer, consumer))


def reuse_is_safe(buffers: int, sub_steps: int = 12) -> bool:
    """Model of the consumers' order per sub-step v: write B buffer v % buffers, wait_group 1 (covers
    the MMAs of v - 2 and older), barrier of both warpgroups, issue v's MMAs. A write is safe when every
    MMA that read the buffer before is covered by a wait both warpgroups passed before a barrier the
    writer passed."""
    covered_at_barrier = {}   # v -> newest sub-step whose MMAs every thread has waited for at v's barrier
    for v in range(sub_steps):
        last_reader = v - buffers   # the previous sub-step that used this buffer
        done = max((covered_at_barrier[u] for u in covered_at_barrier if u < v), default=-1)
        if last_reader >= 0 and last_reader > done:
            return False
        covered_at_barrier[v] = v - 2   # wait_group 1 before v's commit: v - 1 may still run
    return True


def test_three_buffers_are_the_fewest_the_sub_step_order_allows():
    assert hw.BF16_BUFFERS == 3 and reuse_is_safe(3) and not reuse_is_safe(2)


def _metadata(fmt, n, slots, tokens_per_expert, k=7168):
    """Host metadata of a balanced problem: all the plan reads."""
    a_format, b_format = (get_format(name) for name in PROBLEM_FORMATS[fmt])
    return types.SimpleNamespace(a_format=a_format, b_format=b_format, n=n, k=k, num_active_experts=slots,
                                 estimated_total_m=slots * tokens_per_expert, total_tokens=slots * tokens_per_expert)


def wgmma_plan(problem) -> Wgmma:
    """The wgmma kernel's knobs the plan's rules pick for ``problem`` (stages: the deepest, resolved later)."""
    knobs, _ = gbs_plan.wgmma_knobs(problem)
    return Wgmma(**knobs)


# what compare run 64 (run 63 for W4A8, sweep run 69 for NVFP4) measured faster: 256-token tiles or the
# 128-token plan
@pytest.mark.parametrize("fmt, n, slots, tokens, want_tokens", [
    ("mxfp4", 4096, 8, 1024, 256), ("mxfp4", 7168, 8, 1024, 256), ("mxfp4", 4096, 32, 256, 256),
    ("mxfp4", 4096, 16, 384, 128),          # the second tile of every expert half empty
    ("mxfp8", 4096, 8, 1024, 256), ("mxfp8", 7168, 8, 1024, 256), ("mxfp8", 4096, 32, 256, 256),
    ("nvfp4", 4096, 8, 1024, 256), ("nvfp4", 7168, 8, 1024, 256), ("w4a8", 4096, 8, 1024, 128),
    ("w4a8", 4096, 1, 256, 128),            # 32 wide tiles on 132 SMs: one wave either way, twice as long
])
def test_plan_takes_256_token_tiles_where_they_were_measured_faster(fmt, n, slots, tokens, want_tokens):
    problem = _metadata(fmt, n, slots, tokens)
    plan = wgmma_plan(problem)
    assert plan.tile_tokens == want_tokens
    assert plan.mma_bn == (128 if want_tokens == 256 or gbs_plan._both_fp4(problem) else 256)
    assert plan.stages == AUTO_STAGES


@pytest.mark.parametrize("tiles, k_slices, want", [
    (32, 28, (4, 7)),    # 512 x 7168 x 8 x 32: 4 runs 22.0-22.2 us (2: 27.5, 3: 23.4, 7: 24.7; runs 120-121)
    (32, 16, (4, 4)),    # 512 x 4096 x 8 x 32: 17.6 (2 runs: 21.3)
    (32, 12, (4, 3)),    # K 3072: 4 runs of 3 slices 16.2 (3 of 4: 17.0)
    (64, 28, (2, 14)),   # 4096 x 7168 x 2 x 32: 29.0-29.7 (1 run: 38.6)
    (96, 28, (1, 28)), (132, 28, (1, 28)),   # a wave of tiles or more: no split
    (8, 28, (14, 2)),    # 512 x 7168 x 2 x 32: 14 runs of 2 slices 14.6 (7 of 4: 16.2)
    (16, 28, (7, 4)),    # 8 runs wanted: 28 slices go in 7 runs of 4 (17.3)
    (32, 8, (1, 8)), (56, 8, (1, 8)),   # K 2048: 1 run 16.1 / 17.4 (2 runs 16.7 / 17.3)
    (1, 11, (1, 11)), (30, 14, (4, 4)),   # below 12 slices never; 14 slices in 4 runs (4, 4, 4, 2)
])
def test_swapped_k_splits_fill_one_wave_with_runs_of_at_least_two_slices(tiles, k_slices, want):
    assert gbs_plan.swapped_k_splits(tiles, k_slices, gbs_plan.H200_SM_COUNT) == want
    runs, per_run = want
    assert (runs - 1) * per_run < k_slices <= runs * per_run


def test_swapped_k_splits_refuses_bad_counts():
    for bad in ((0, 28, 132), (32, 0, 132), (32, 28, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            gbs_plan.swapped_k_splits(*bad)
    with pytest.raises(TypeError, match="must be an int"):
        gbs_plan.swapped_k_splits(32.0, 28, 132)


# what sweep runs 107-108 measured fastest at 32 experts, 4096 x 7168 (notes/h200 "Session 24"): (mma_bn, ab_swapped)
@pytest.mark.parametrize("fmt, n, slots, tokens, want", [
    ("nvfp4", 4096, 32, 32, (32, True)), ("nvfp4", 4096, 32, 48, (64, True)), ("nvfp4", 4096, 32, 64, (64, True)),
    ("nvfp4", 4096, 32, 128, (128, False)), ("mxfp4", 4096, 32, 32, (32, True)), ("mxfp4", 4096, 32, 64, (64, True)),
    ("nvfp4", 7168, 32, 32, (32, True)),
    ("mxfp4", 4096, 1, 256, (64, True)),    # one wave either way: the shorter tile (modelled, not measured)
    # few tiles, in split-K runs (runs 121, 123): 32 bn64 tiles in 4 runs 25.9-26.5 us against 64 bn32 tiles in 2
    # runs 27.6-27.8; 8 x 48 25.8 vs 27.7; 8 x 128: bn64 in 2 runs 34.3 against 128-token tiles 63.6
    ("nvfp4", 512, 8, 64, (64, True)), ("nvfp4", 512, 8, 32, (32, True)), ("nvfp4", 512, 8, 48, (64, True)),
    ("mxfp4", 512, 8, 64, (64, True)), ("nvfp4", 512, 8, 128, (64, True)), ("nvfp4", 4096, 2, 128, (64, True)),
    ("mxfp8", 4096, 32, 48, (256, False)), ("w4a8", 4096, 32, 64, (256, False)),   # FP8 tokens: never swapped
])
def test_plan_takes_swapped_tiles_where_they_were_measured_faster(fmt, n, slots, tokens, want):
    plan = wgmma_plan(_metadata(fmt, n, slots, tokens))
    assert (plan.mma_bn, plan.ab_swapped) == want and plan.stages == AUTO_STAGES
    if plan.ab_swapped:
        assert plan.tile_tokens == 128


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
@pytest.mark.parametrize("fmt, bn", [("nvfp4", 32), ("mxfp8", 32), ("w4a8", 64)])   # FP8 tokens: run 125's plan
def test_swapped_split_k_build_reads_every_sum_before_it_stores(fmt, bn):
    """``WgmmaSpec.split_k`` (swapped tiles only): the K loop is no longer than the plain swapped build's and has no
    local memory (offline, 2026-12-01: NVFP4 bn32 the same loop; MXFP8 bn32 371 against 384 instructions, W4A8 bn64
    450 against 450); the epilogue adds the partials (``red.global.add.f32``) and the last run reads every sum with
    a plain L2 load before its first output store (no ``atom.exch``)."""
    with pytest.raises(ValueError, match="ab_swapped must be True"):
        dataclasses.replace(spec_of(fmt, 128), split_k=True)
    plain = spec_of(fmt, bn, ab_swapped=True)
    loops = {}
    for spec in (plain, dataclasses.replace(plain, split_k=True)):
        assert spec.ring.split_k == spec.split_k
        cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(spec.threads, spec.min_ctas_per_sm))
        sass = offline.disassemble(cubin)
        instructions = offline.sass_instructions(sass)
        loops[spec.split_k] = [(loop.size, loop.count("LDL") + loop.count("STL"))
                               for loop in offline.sass_loops(sass) if loop.count("HGMMA")][0]
        reads = [i for i, ins in enumerate(instructions) if ins.startswith("LDG.E.STRONG.GPU")]
        reds = [ins for ins in instructions if ins.startswith("REDG") and "F32" in ins]
        assert bool(reads) == bool(reds) == spec.split_k
        assert not [ins for ins in instructions if ins.startswith("ATOMG") and "EXCH" in ins]
        if spec.split_k:
            first_store = min(i for i, ins in enumerate(instructions) if ins.startswith("STG.E.U16") and i > reads[0])
            assert max(reads) < first_store, "every read before the first store"
    assert loops[True][0] <= loops[False][0] and loops[True][1] == loops[False][1] == 0, loops


@pytest.mark.parametrize("fmt, n, slots, tokens, k, want", [
    # swapped tiles in split-K runs against the streaming plan (runs 119-121, us), by swapped tiles:
    ("nvfp4", 512, 2, 32, 7168, True), ("nvfp4", 512, 4, 32, 7168, True),    # 8, 16: 14.6 vs 19.9, 17.3 vs 20.5
    ("nvfp4", 512, 8, 32, 7168, True), ("mxfp4", 512, 8, 32, 7168, True),    # 32 (Kimi): 22.0 / 21.5 vs 23.9 / 24.5
    ("nvfp4", 512, 8, 24, 7168, True), ("nvfp4", 512, 8, 17, 7168, True),    # 21.5 vs 22.0; 20.8 vs 20.9
    ("nvfp4", 4096, 2, 32, 7168, True), ("mxfp4", 4096, 2, 32, 7168, True),  # 64: 29.7 / 28.8 vs 33.7 / 34.8
    ("nvfp4", 512, 8, 32, 3072, True), ("nvfp4", 512, 8, 32, 2048, True),    # 16.2 vs 19.1; no split 16.1 vs 18.7
    ("nvfp4", 7168, 1, 32, 2048, True), ("nvfp4", 4096, 4, 32, 7168, True),  # 17.4 vs 19.6; 128 tiles (run 116)
    ("nvfp4", 512, 8, 48, 7168, True), ("mxfp8", 512, 8, 48, 7168, True),    # from 33 tokens: the average alone
    ("nvfp4", 4096, 32, 16, 7168, False), ("nvfp4", 512, 8, 16, 7168, False),  # 16 tokens: the streaming kernel
    # FP8 tokens: swapped only where their tiles split (run 125): 32 tiles 23.8 / 29.2 us vs the streaming 29.2 / 30.2
    ("w4a8", 512, 8, 32, 7168, True), ("mxfp8", 512, 8, 32, 7168, True), ("w4a8", 4096, 2, 32, 7168, True),
    ("mxfp8", 4096, 32, 32, 7168, False), ("w4a8", 4096, 32, 24, 7168, False),   # 1024 tiles: no split
    ("w4a8", 512, 8, 32, 1024, False), ("mxfp8_e5m2", 512, 8, 32, 7168, True),   # 8 slices; E5M2 as E4M3 (run 129)
    ("w4a8", 512, 8, 16, 7168, False), ("w4a8", 4096, 3, 32, 7168, False),   # 96 tiles, 1 run: 51.5 vs 54.4 (run 129)
])
def test_auto_takes_swapped_tiles_from_17_fp4_tokens_at_any_tile_count(fmt, n, slots, tokens, k, want):
    """With split-K runs for few swapped tiles (``swapped_k_splits``) the swapped tiles beat the streaming
    kernel's split-K at every tile count measured (8-128 tiles, K 2048-7168): ``prefers`` is the average
    tokens per expert alone for FP4 x FP4; FP8 tokens also from 17 where their swapped tiles split."""
    assert (gbs_plan.prefers_wgmma(_metadata(fmt, n, slots, tokens, k)) is not None) is want


def test_device_problem_keeps_host_routing_for_the_split_estimate(monkeypatch):
    """``launch.to_device`` keeps host copies of the routing (a ``GroupedProblem``'s arrays, or the ``host_routing``
    a validated device problem carries) so ``prepare``'s split counts each group's own tiles; without them the
    estimate is the average's. The device copies are replaced by the host arrays here (no GPU)."""
    monkeypatch.setattr(launch, "_as_device_array", lambda name, value, stream: value)
    problem = synthetic_problem("nvfp4", n=576, k=4096, group_sizes=[32, 30, 1, 0, 32, 17, 31, 32],
                                expert_ids=[3, 0, 5, 1, -1, 2, 4, 6], num_experts=7, seed=3)
    device = launch.to_device(problem)
    assert set(device.host_routing) == {"a_offsets", "expert_ids"}
    assert device.host_routing["a_offsets"] is not problem.a_offsets, "a copy: later edits do not move the plan"
    np.testing.assert_array_equal(device.host_routing["expert_ids"], problem.expert_ids)
    assert gbs_plan.estimated_tiles(device, 32, hr.TILE_M_ROWS) == 30      # six live groups x 5 bands
    carried = types.SimpleNamespace(**{f: getattr(problem, f) for f in ("a_format", "b_format", "num_active_experts",
                                                                        "estimated_total_m", "n", "k", "b_layout",
                                                                        "a_layout")},
                                    **{name: getattr(problem, name) for name in launch.PROBLEM_ARRAY_DTYPES},
                                    host_routing=device.host_routing)
    assert launch.to_device(carried).host_routing is device.host_routing
    opaque = types.SimpleNamespace(**vars(carried))
    del opaque.host_routing
    opaque.a_offsets = types.SimpleNamespace(shape=problem.a_offsets.shape)   # not a host array: no copy kept
    averaged = launch.to_device(opaque)
    assert averaged.host_routing is None
    assert gbs_plan.estimated_tiles(averaged, 32, hr.TILE_M_ROWS) == 40    # 8 slots of ceil(175 / 8) = 22 tokens
    assert gbs_plan.swapped_k_splits(30, 16, gbs_plan.H200_SM_COUNT)[0] == 4 and gbs_plan.swapped_k_splits(40, 16, gbs_plan.H200_SM_COUNT)[0] == 3


@pytest.mark.parametrize("fmt, n, slots, tokens, want", [
    # run 125 (us), MXFP8 / W4A8, the plan before (128- or 256-token tiles, 16-32 on 132 SMs) -> swapped in runs:
    ("mxfp8", 512, 8, 48, (64, 4)), ("w4a8", 512, 8, 48, (64, 4)),     # 116.2 / 123.0 -> 29.6 / 27.2
    ("mxfp8", 512, 8, 64, (64, 4)), ("w4a8", 512, 8, 64, (64, 4)),     # 116.4 / 123.1 -> 30.6 / 28.1
    ("mxfp8", 512, 8, 128, (64, 2)), ("w4a8", 4096, 2, 64, (64, 2)),   # 117.5 -> 42.3; 123.2 -> 41.1
    ("w4a8", 512, 8, 32, (32, 4)),                                     # streaming 29.2 -> 23.8
    ("mxfp8", 4096, 32, 48, None), ("w4a8", 4096, 32, 64, None),       # full waves: the measured plan
    ("mxfp8_e5m2", 512, 8, 48, (64, 4)),                               # run 129: 124.5 -> 29.4
    ("nvfp4", 512, 8, 64, None), ("mxfp8", 4096, 3, 32, None),         # 96 tiles, 1 run: 53.2 vs 61.2 in 2 (run 129)
])
def test_fp8_tokens_take_swapped_tiles_where_they_split(fmt, n, slots, tokens, want):
    problem = _metadata(fmt, n, slots, tokens)
    swapped_bn = gbs_plan.fp8_tokens_swapped_bn(problem)
    if want is None:
        assert swapped_bn is None
        return
    bn, runs = want
    assert swapped_bn == bn and wgmma_plan(problem) == Wgmma(bn, AUTO_STAGES, ab_swapped=True)
    k_slices = problem.k // hr.k_slice_elements(problem.a_format, problem.b_format)
    assert gbs_plan.swapped_k_splits(gbs_plan.estimated_tiles(problem, bn, hr.TILE_M_ROWS), k_slices, gbs_plan.H200_SM_COUNT)[0] == runs


def test_wide_tiles_cost_the_padding_of_the_last_tile_and_the_waves():
    problem = _metadata("mxfp4", 4096, 16, 384)   # 3 tiles of 128 or 2 of 256 per expert, 32 columns
    assert gbs_plan.estimated_tile_work(problem, 128, 128, 1.0) == pytest.approx(16 * 3 * 32 / 132 * 128 * 128)
    assert gbs_plan.estimated_tile_work(problem, 256, 128, 0.5) == pytest.approx(16 * 2 * 32 / 132 * 256 * 128 * 0.5)
    single = _metadata("mxfp4", 4096, 1, 256)     # fewer tiles than SMs: one wave, whatever the count
    assert gbs_plan.estimated_tile_work(single, 128, 128, 1.0) == 128 * 128


def test_plan_counts_each_ragged_group_s_own_tiles_on_host_problems():
    """Sweep run 71: the bench's large_prefill_ragged (average 256 tokens, groups 0-1694) ran 11-12 % faster
    on 128-token tiles (its tiles cover 10240 rows vs 12800), which only the group sizes show."""
    from gbs.lab.cases import BENCH_CASES

    case = BENCH_CASES["large_prefill_ragged"]
    sizes = case.group_sizes()
    for fmt in ("nvfp4", "mxfp4"):
        averaged = _metadata(fmt, case.n, case.slots, case.tokens_per_expert)
        assert wgmma_plan(averaged).tile_tokens == 256   # a device problem: the average only
        host = types.SimpleNamespace(**vars(averaged), expert_ids=np.arange(case.slots, dtype=np.int32),
                                     a_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint32))
        assert gbs_plan.tile_token_rows(host, 128) == 10240 and gbs_plan.tile_token_rows(host, 256) == 12800
        assert wgmma_plan(host).tile_tokens == 128
    # -1 slots cost no tiles, empty groups none either
    skipped = types.SimpleNamespace(**vars(_metadata("mxfp4", 4096, 3, 200)), expert_ids=np.array([0, -1, 2]),
                                    a_offsets=np.array([0, 300, 600, 600], np.uint32))
    assert gbs_plan.tile_token_rows(skipped, 128) == 384 and gbs_plan.tile_token_rows(skipped, 256) == 512
    real = synthetic_problem("mxfp4", n=256, k=256, group_sizes=[300, 0, 40], expert_ids=[0, 1, -1], num_experts=2)
    assert gbs_plan.tile_token_rows(real, 128) == 384


def test_a_kernel_config_decided_for_other_formats_is_refused():


    problem = _problem("w4a8")
    mxfp8 = dispatch_for(_problem("mxfp8"))
    with pytest.raises(ValueError, match="config was decided for"):
        plan_spec(problem, mxfp8)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
GPU_SIZES = (5, 0, 1, 37, 3, 70, 129, 300)   # empty group, -1 slot, 1 token, > 256, not tile multiples
GPU_IDS = (0, 4, 1, -1, 2, 5, 3, 6)
# (format, mma_bn, tile_tokens): 256-token tiles with FP4 and FP8 tokens (300 tokens: a full and a partial
# 256-token tile; 129: one tile past its second scale band's first row)
GPU_CASES = ([(fmt, 128, 128) for fmt in FORMATS] + [("nvfp4", 256, 128), ("mxfp8", 256, 128), ("w4a8", 256, 128),
                                                      ("mxfp4", 256, 128)]
             + [(fmt, 128, 256) for fmt in FORMATS])


def ragged_gpu_problem(fmt: str, n: int, seed_tag: str):
    """The GPU tests' ragged routing (``GPU_SIZES`` / ``GPU_IDS``) at K 2048, seeded by ``seed_tag``; skips without
    an sm_90 GPU."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    return synthetic_problem(fmt, n=n, k=2048, group_sizes=list(GPU_SIZES), expert_ids=list(GPU_IDS), num_experts=8,
                             seed=zlib.crc32(seed_tag.encode()))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, bn, tile_tokens", GPU_CASES)
def test_gpu_matches_the_reference(fmt, bn, tile_tokens):
    problem = ragged_gpu_problem(fmt, 4096 + 64, f"wgmma/{fmt}")
    ref = reference_grouped_matmul(problem)
    config = Wgmma(bn, AUTO_STAGES, tile_tokens=tile_tokens)
    out = run(problem, config)   # poisoned output: skipped rows keep it
    result = check_kernel(problem, out, ref, "h200_wgmma")
    assert result.passed, f"{plan_spec(problem, config)}: {result}"


# swapped tiles (weights on M, tokens on N): every way the B decode splits (4, 2 and 1 quarters per item)
SWAPPED_GPU_CASES = [("nvfp4", 32), ("nvfp4", 64), ("mxfp4", 32), ("mxfp8", 32), ("mxfp8_e5m2", 64), ("w4a8", 32),
                     ("w4a8", 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, bn", SWAPPED_GPU_CASES)
def test_gpu_swapped_tiles_match_the_reference(fmt, bn):
    """Weights on wgmma M, ``mma_bn`` tokens on N: ragged groups (empty, a -1 slot, 1 token, groups of several
    token tiles and a partial last one), N not a multiple of the 128-row weight tile; poisoned output (skipped
    rows keep the poison: ``gbs.exactness``)."""
    problem = ragged_gpu_problem(fmt, 1024 + 64, f"wgmma-swapped/{fmt}/{bn}")
    config = Wgmma(bn, AUTO_STAGES, ab_swapped=True)
    out = run(problem, config)
    result = check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma")
    assert result.passed, f"{plan_spec(problem, config)}: {result}"


SWAPPED_SPLIT_GPU_CASES = [("nvfp4", 32, 2), ("mxfp4", 32, 4), ("nvfp4", 64, 3), ("w4a8", 32, 5), ("mxfp8", 64, 3)]


def run_split_launch_three_times(problem, config, k_splits):
    """``prepare(k_splits=...)`` once, the launch run three times over a sentinel: rows of skipped slots keep it,
    every run passes the acceptance, and the workspace and counters are zero again after each. Returns the
    prepared launch."""
    from numba import cuda

    ref = reference_grouped_matmul(problem)
    sentinel = np.full((problem.total_tokens, problem.n), 0x1234, np.uint16)
    device_out = cuda.to_device(sentinel)
    prepared = prepare(launch.to_device(problem), config, device_out, k_splits=k_splits)
    assert prepared.plan.k_splits > 1 and prepared.plan.ring.split_k
    skipped = ~problem.written_rows()
    for _ in range(3):
        device_out.copy_to_device(sentinel)
        prepared()
        bits = device_out.copy_to_host()
        assert np.all(bits[skipped] == 0x1234), "rows of -1 slots are never written"
        merged = np.where(skipped[:, None], np.uint16(POISON_BITS), bits).view(ref.dtype)
        result = check_kernel(problem, merged, ref, "h200_wgmma")
        assert result.passed, f"{prepared.plan.k_splits} runs: {result}"
        assert not np.any(prepared.split_sums.copy_to_host()), "workspace zeroed by the last run"
        assert not np.any(prepared.split_counters.copy_to_host()), "tile and item counters reset"
    return prepared


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, bn, k_splits", SWAPPED_SPLIT_GPU_CASES)
def test_gpu_swapped_split_k_matches_the_reference_and_cleans_up(fmt, bn, k_splits):
    """Swapped tiles in split-K runs (``prepare(k_splits=...)``): every run adds its partial, the tile's last run
    reads the sums back and stores."""
    problem = ragged_gpu_problem(fmt, 1024 + 64, f"wgmma-swapped-split/{fmt}/{bn}")
    run_split_launch_three_times(problem, Wgmma(bn, AUTO_STAGES, ab_swapped=True), k_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_few_swapped_tiles_split_k_by_default(fmt):
    """A Kimi-like problem (N 512 + 64: 5 weight bands, the last one partial; 8 slots of up to 32 tokens with a -1
    slot, an empty group and a 1-token group; K 4096): ~30 swapped tiles, so ``prepare``'s default cuts each into
    ``swapped_k_splits`` runs (4 runs of 4 slices on 132 SMs), counting the groups' own tiles."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    problem = synthetic_problem(fmt, n=512 + 64, k=4096, group_sizes=[32, 30, 1, 0, 32, 17, 31, 32],
                                expert_ids=[3, 0, 5, 1, -1, 2, 4, 6], num_experts=7,
                                seed=zlib.crc32(f"wgmma-swapped-default-split/{fmt}".encode()))
    config = wgmma_plan(problem)
    assert (config.ab_swapped, config.mma_bn) == (True, 32)
    prepared = run_split_launch_three_times(problem, config, None)
    want = gbs_plan.swapped_k_splits(gbs_plan.estimated_tiles(problem, 32, hr.TILE_M_ROWS), 16, gbs_plan.H200_SM_COUNT)[0]
    assert prepared.plan.k_splits == want == 4


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_swapped_tiles_read_the_h200_layouts_to_the_same_bits(fmt):
    """Swapped, FP4 weights fused with their scales (read on the M side) and FP4 tokens in ``E2M1H200Order``
    (decoded into the B buffer): bit-identical to packed operands."""
    problem = ragged_gpu_problem(fmt, 1024 + 128, f"wgmma-swapped-layouts/{fmt}")
    config = Wgmma(32, AUTO_STAGES, ab_swapped=True)
    packed = run(problem, config)
    assert check_kernel(problem, packed, reference_grouped_matmul(problem), "h200_wgmma").passed
    relaid = problem.with_a_layout("e2m1_h200").with_b_layout("e2m1_h200_fused")
    spec = plan_spec(relaid, config)
    assert spec.ring.weight_side == spec.ring.m_side and spec.ring.weight_side.layout == "e2m1_h200_fused"
    np.testing.assert_array_equal(run(relaid, config).view(np.uint16), packed.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["e2m1_h200", "e2m1_h200_tiled", "e2m1_h200_fused"])
@pytest.mark.parametrize("fmt, bn", [("nvfp4", 128), ("w4a8", 256), ("mxfp4", 256)])
def test_gpu_h200_weight_layout_gives_the_same_bits(fmt, bn, layout):
    """Weights in ``E2M1H200Order`` (decoded by the shared weight reader; row-major, tiled box by box, or
    each box with its scales: two box loads and two scale bands per stage at mma_bn 256, half a box's width
    and half its atoms with W4A8's 64-byte K slices) give bit-identical output. N is not a multiple of 128
    where the layout allows it, and not of 256 with tiled weights: the last 256-row tile's second box lies
    past N (it reads the next expert's first box; never stored)."""
    n = 1024 + (64 if layout == "e2m1_h200" else 128)
    problem = ragged_gpu_problem(fmt, n, f"wgmma-layout/{fmt}")
    config = Wgmma(bn, AUTO_STAGES)
    packed = run(problem, config)
    relaid = problem.with_b_layout(layout)
    assert plan_spec(relaid, config).ring.weight_side.layout == layout
    np.testing.assert_array_equal(run(relaid, config).view(np.uint16), packed.view(np.uint16))
    assert check_kernel(problem, packed, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, bn, tile_tokens", [("nvfp4", 128, 128), ("nvfp4", 128, 256), ("mxfp4", 128, 256)])
def test_gpu_h200_token_layout_gives_the_same_bits(fmt, bn, tile_tokens):
    """FP4 tokens in ``E2M1H200Order`` (``a_layout``) decode to the same A fragments: bit-identical output,
    weights packed or re-laid too."""
    problem = ragged_gpu_problem(fmt, 1024 + 64, f"wgmma-token-layout/{fmt}/{tile_tokens}")
    config = Wgmma(bn, AUTO_STAGES, tile_tokens=tile_tokens)
    packed = run(problem, config)
    assert check_kernel(problem, packed, reference_grouped_matmul(problem), "h200_wgmma").passed
    for relaid in (problem.with_a_layout("e2m1_h200"), problem.with_a_layout("e2m1_h200").with_b_layout("e2m1_h200")):
        assert plan_spec(relaid, config).ring.token_side.layout == "e2m1_h200"
        np.testing.assert_array_equal(run(relaid, config).view(np.uint16), packed.view(np.uint16))


@pytest.mark.gpu
def test_gpu_prepared_launch_reruns_and_uses_fewer_ctas():
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    from numba import cuda

    problem = _problem("nvfp4", n=1024, k=2048)
    ref = reference_grouped_matmul(problem)
    sentinel = np.full((problem.total_tokens, problem.n), 0x1234, np.uint16)
    device_out = cuda.to_device(sentinel)
    prepared = prepare(launch.to_device(problem), Wgmma(128), device_out, num_ctas=3)
    skipped = ~problem.written_rows()
    for _ in range(2):
        device_out.copy_to_device(sentinel)
        prepared()
        bits = device_out.copy_to_host()
        assert np.all(bits[skipped] == 0x1234)
        merged = np.where(skipped[:, None], np.uint16(POISON_BITS), bits).view(ref.dtype)
        assert check_kernel(problem, merged, ref, "h200_wgmma").passed
        # 3 CTAs take the tiles past the first three from the global counter; the last producer zeroes it
        assert not prepared.split_counters.copy_to_host().any(), "the work-item counter is zero again"


@pytest.mark.gpu
def test_gpu_auto_backend_runs_prefill_on_wgmma():
    """``gbs.grouped_matmul`` with the dispatch's decision: prefill-sized groups go to this kernel."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    import gbs

    problem = synthetic_problem("nvfp4", n=640, k=1024, group_sizes=[300, 0, 200, 129], expert_ids=[1, 0, -1, 2],
                                num_experts=3, seed=5)
    assert gbs_plan.plan_h200(problem).kernel == "h200_wgmma"
    out = gbs.grouped_matmul(problem)
    assert check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_gpu_auto_backend_takes_256_token_tiles_and_matches_the_reference(fmt):
    """The plan's 256-token tiles through ``gbs.grouped_matmul``: ragged groups (a 1-token group, an
    empty one, a -1 slot, sizes not multiples of 256) averaging ~820 tokens on 4096 weight rows (the plan
    counts the live groups' own tiles: 15 of 256 tokens against 29 of 128)."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    import gbs

    problem = synthetic_problem(fmt, n=4096, k=1024, group_sizes=[2000, 1, 0, 1500, 600],
                                expert_ids=[2, 0, 1, 3, -1], num_experts=4, seed=7)
    plan = gbs_plan.plan_h200(problem)
    assert plan.kernel == "h200_wgmma" and plan.spec.tile_tokens == 256
    out = gbs.grouped_matmul(problem)
    assert check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, sizes, want_bn", [("nvfp4", [32, 30, 1, 32, 32, 31], 32),
                                                 ("mxfp4", [64, 0, 50, 1, 60, 64], 64)])
def test_gpu_auto_backend_takes_swapped_tiles_for_small_prefill(fmt, sizes, want_bn):
    """Tens of FP4 tokens per expert (a -1 slot, a 1-token group; MXFP4 an empty group and groups of 50-64 tokens):
    ``gbs.grouped_matmul`` runs the swapped tile the plan picks, on weights fused with their scales and tokens
    in the H200 order, within the acceptance; rows of the -1 slot keep the poison."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    import gbs

    problem = synthetic_problem(fmt, n=4096 + 128, k=1024, group_sizes=sizes, expert_ids=[2, 0, -1, 3, 1, 4],
                                num_experts=5, seed=zlib.crc32(f"auto-swapped/{fmt}".encode()))
    relaid = problem.with_b_layout(gbs_plan.h200_weight_layout(problem.b_format)).with_a_layout(
        "e2m1_h200")
    plan = gbs_plan.plan_h200(relaid)
    assert plan.kernel == "h200_wgmma" and (plan.spec.ab_swapped, plan.spec.mma_bn) == (True, want_bn)
    out = gbs.grouped_matmul(relaid)
    assert check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, sizes, want_bn", [("w4a8", [48, 40, 1, 0, 48, 33, 47, 48], 64),
                                                 ("mxfp8", [32, 30, 1, 0, 32, 17, 31, 32], 32),
                                                 ("mxfp8_e5m2", [48, 40, 1, 0, 48, 33, 47, 48], 64)])
def test_gpu_auto_backend_takes_split_swapped_tiles_for_few_fp8_token_tiles(fmt, sizes, want_bn):
    """FP8 tokens on ~30 swapped tiles (N 576: 5 weight bands, the last partial; a -1 slot, an empty group, a
    1-token group; K 2048: 16 slices): ``gbs.grouped_matmul`` runs the swapped tiles in 4 split-K runs
    (``fp8_tokens_swapped_plan``) within the acceptance; rows of the -1 slot keep the poison."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    import gbs

    problem = synthetic_problem(fmt, n=512 + 64, k=2048, group_sizes=sizes, expert_ids=[3, 0, 5, 1, -1, 2, 4, 6],
                                num_experts=7, seed=zlib.crc32(f"auto-fp8-few/{fmt}".encode()))
    plan = gbs_plan.plan_h200(problem)
    assert plan.kernel == "h200_wgmma" and (plan.spec.ab_swapped, plan.spec.mma_bn) == (True, want_bn)
    assert plan.k_splits == 4
    out = gbs.grouped_matmul(problem)
    assert check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_odd_n_takes_the_single_store_paths(fmt):
    """N odd: bf16 pairs are not 4-byte aligned in every token row, so the epilogue stores single
    values (and a tile's last column alone)."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    problem = synthetic_problem(fmt, n=389, k=1024, group_sizes=[130, 0, 7], expert_ids=[1, 0, 2], num_experts=3,
                                seed=zlib.crc32(f"odd-n/{fmt}".encode()))
    out = h200_launch.run(problem, gbs_plan.plan_h200(problem, backend="h200_wgmma"))
    assert check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma").passed


@pytest.mark.gpu
def test_gpu_misaligned_output_is_refused_before_launch():
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    from numba import cuda

    problem = _problem("nvfp4", n=256, k=512)
    flat = cuda.device_array(problem.total_tokens * problem.n + 1, np.uint16)
    misaligned = flat[1:].reshape(problem.total_tokens, problem.n)
    with pytest.raises(ValueError, match="4-byte aligned"):
        prepare(launch.to_device(problem), Wgmma(128), misaligned)
