"""The FP8 route on operands folded ahead (issue 31 item 3): MXFP4 x MXFP4 re-encoded once as E4M3 with one UE8M0 scale
per 128-K chunk (``gbs.fp8_route.fold_problem``, layout ``e4m3_folded``), multiplied by the wgmma kernel's
chunk-scaled consumer (``h200_wgmma._make_chunk_scaled_consumer``: both operands straight from the ring, two chunk
sets, one fp32 promotion per 128 K; on 128 x 192 tiles one set, a factor per 64-column group; CTA pairs of 2 x 128
tokens sharing a 128- or 192-row weight tile by multicast).

CPU: the fold keeps the exact reference bit for bit (ragged groups, an empty group, a -1 slot, a 1-token group, N and
K tails, blocks at both ends of the window, NaN blocks); it refuses what it cannot fold exactly; the layout tag
refuses scales that do not repeat per chunk and tile; the promotion factor; the column groups' fold tiles; the plan;
the builds' SASS.

GPU (the H200): the route's contract against the exact reference (``test_fp8_route_kernel.check_route``:
bit-identical where the tensor core sums every chunk exactly, within ``HOPPER_CHUNK_ERROR``'s bound elsewhere, skipped
rows keep the poison, NaN where the reference has it), on 128 x 128 tiles, 128 x 192 tiles and CTA pairs of both.
"""
from __future__ import annotations

import collections
import dataclasses
import zlib

import numpy as np
import pytest

from gbs import fp8_route as fr
from gbs.formats import UE8M0_NAN_BYTE, BlockScaled, swizzle_scales, unswizzle_scales
from gbs.layouts import LAYOUT_E4M3_FOLDED
from gbs.numba_kernels import fp8_decode as fd
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_wgmma as hw
from gbs.numba_kernels import launch
from gbs.plan import plan_h200
from gbs.problem import random_problem
from gbs.ptx_inline import offline
from gbs.reference import is_poison, reference_grouped_matmul
from fp8_cases import fold_tiles_apart, gaussian_problem, w4a8_window_edges, window_edges, with_scales
from test_fp8_route_kernel import check_route
from test_h200_stream import _shapes_and_fake_addresses, tma_box_3d_any


def same_bits(x, y) -> bool:
    return np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))


# ----------------------------------------------------------------------------------------------
# CPU: the fold
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(320, 2880), (130, 448), (256, 1024)])
def test_fold_keeps_the_exact_reference_bit_for_bit(n, k):
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"fold/{n}/{k}".encode()))
    folded = fr.fold_problem(problem)
    assert (folded.a_format.name, folded.b_format.name) == ("mxfp8", "mxfp8")
    assert (folded.a_layout, folded.b_layout) == (LAYOUT_E4M3_FOLDED, LAYOUT_E4M3_FOLDED)
    assert folded.b.nbytes == 2 * problem.b.nbytes   # one byte per element
    assert same_bits(reference_grouped_matmul(folded), reference_grouped_matmul(problem))


def test_the_tokens_alone_fold_as_in_the_whole_problem():
    problem = gaussian_problem(320, 2880, seed=11, group_sizes=(3, 0, 1, 150), expert_ids=(0, 2, -1, 1), experts=3)
    data, atoms = fr.fold_problem_tokens(problem)
    folded = fr.fold_problem(problem)
    assert data.dtype == np.uint8 and np.array_equal(data, folded.a.view(np.uint8))
    assert np.array_equal(atoms, folded.a_scales)
    with pytest.raises(ValueError, match="MXFP4 tokens"):
        fr.fold_problem_tokens(random_problem("nvfp4", n=64, k=128, num_experts=2, total_tokens=9,
                                              num_active_experts=2, seed=1))


def test_fold_keeps_blocks_at_both_ends_of_the_window_and_nan_blocks():
    edge = window_edges(seed=3)
    folded = fr.fold_problem(edge)
    ref = reference_grouped_matmul(edge)
    assert np.isnan(ref.astype(np.float32)).any(), "the NaN blocks reach the reference"
    assert same_bits(reference_grouped_matmul(folded), ref)


@pytest.mark.parametrize("operand", ["a", "b"])
def test_fold_refuses_a_live_block_beyond_the_window(operand):
    """A block 15 binades below its chunk's largest (its tile's, for weights) does not fold exactly: ValueError,
    never silent zeros; 14 below folds."""
    problem = gaussian_problem(256, 256, seed=5, group_sizes=(40, 90), expert_ids=(0, 1), experts=2)
    for gap, ok in ((14, True), (15, False)):
        if operand == "a":
            a = problem.a_operand().scales.copy()
            a[:, :4] = 130
            a[7, 2] = 130 - gap
            case = with_scales(problem, a_linear=a)
        else:
            b = unswizzle_scales(problem.b_scales, problem.n, 8).copy()
            b[:, :128, :4] = 130
            b[1, 100, 3] = 130 - gap
            case = with_scales(problem, b_linear=b)
        if ok:
            assert same_bits(reference_grouped_matmul(fr.fold_problem(case)), reference_grouped_matmul(case))
        else:
            with pytest.raises(ValueError, match="binades below"):
                fr.fold_problem(case)


@pytest.mark.parametrize("n, k", [(320, 2880), (130, 448)])
def test_w4a8_fold_keeps_the_tokens_and_the_exact_reference(n, k):
    """W4A8: the weights fold, the MXFP8 tokens stay as quantized (their scales are promoted per k32 step)."""
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"w4a8-fold/{n}/{k}".encode()), fmt="w4a8")
    folded = fr.fold_problem(problem)
    assert (folded.a_layout, folded.b_layout) == ("packed", LAYOUT_E4M3_FOLDED)
    assert np.array_equal(folded.a.view(np.uint8), problem.a.view(np.uint8))
    assert np.array_equal(folded.a_scales, problem.a_scales)
    assert same_bits(reference_grouped_matmul(folded), reference_grouped_matmul(problem))


def test_fold_weights_alone_is_the_problems_weight_fold():
    """``fold_weights`` (a checkpoint's weights, once, without tokens) gives the bytes and scales ``fold_problem``
    puts in ``b``; 2-D or non-MXFP4 weights are refused."""
    problem = gaussian_problem(200, 448, seed=8, group_sizes=(3, 9), expert_ids=(1, 0), experts=2)
    weights = [problem.b_operand(e) for e in range(2)]
    stacked = BlockScaled(np.stack([w.data for w in weights]), np.stack([w.scales for w in weights]), weights[0].fmt)
    folded_b = fr.fold_weights(stacked)
    folded = fr.fold_problem(problem)
    assert folded_b.fmt.name == "mxfp8"
    assert np.array_equal(folded_b.data.view(np.uint8), folded.b.view(np.uint8))
    assert np.array_equal(swizzle_scales(folded_b.scales), folded.b_scales)
    with pytest.raises(ValueError, match="3-D"):
        fr.fold_weights(weights[0])


def test_fold_refuses_other_formats():
    for fmt in ("nvfp4", "mxfp8", "w4a16"):
        problem = random_problem(fmt, n=128, k=256, num_experts=2, total_tokens=8, num_active_experts=2)
        with pytest.raises(ValueError, match="folds MXFP4 x MXFP4"):
            fr.fold_problem(problem)


def test_folded_layout_refuses_scales_that_do_not_repeat():
    """The tag promises one scale per (token row, chunk) and per (128-row weight tile, chunk): a problem that breaks
    it is refused at construction, and an ordinary MXFP8 problem cannot be tagged."""
    folded = fr.fold_problem(gaussian_problem(200, 512, seed=2, group_sizes=(30, 140), expert_ids=(0, 1), experts=2))
    a = unswizzle_scales(folded.a_scales).copy()
    a[3, 1] += 1                                     # block 1 of chunk 0 of token row 3
    with pytest.raises(ValueError, match="token row 3's block 1"):
        dataclasses.replace(folded, a_scales=swizzle_scales(a))
    b = unswizzle_scales(folded.b_scales).copy()
    b[1, 130, 4:8] += 1                              # row 130 (tile 1, not its first row), chunk 1
    with pytest.raises(ValueError, match="expert 1 row 130"):
        dataclasses.replace(folded, b_scales=swizzle_scales(b))
    ordinary = random_problem("mxfp8", n=128, k=512, num_experts=2, total_tokens=40, num_active_experts=2)
    with pytest.raises(ValueError, match="not folded"):
        ordinary.with_a_layout(LAYOUT_E4M3_FOLDED)
    with pytest.raises(ValueError, match="holds E4M3"):
        gaussian_problem(128, 256, seed=1, group_sizes=(4,), expert_ids=(0,), experts=1).with_b_layout(
            LAYOUT_E4M3_FOLDED)


def test_chunk_factor_is_the_fp32_power_of_two_of_both_scales_for_every_pair_of_bytes():
    """The consumer's promotion factor, ``ue8m0_f32(token) * ue8m0_f32(tile)`` in fp32, against 2^(t + w - 254)
    rounded once from float64 (subnormals exact, 0 below 2^-149, +Inf from 2^128) and NaN with a NaN scale."""
    scale = np.array([fd.ue8m0_f32_bits(b) for b in range(256)], np.uint32).view(np.float32)
    assert scale[127] == 1.0 and scale[0] == np.float32(2.0 ** -127) and np.isnan(scale[UE8M0_NAN_BYTE])
    token, tile = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    with np.errstate(over="ignore", under="ignore"):
        got = scale[token] * scale[tile]
        want = np.ldexp(1.0, token + tile - 254).astype(np.float32)
    finite = (token != UE8M0_NAN_BYTE) & (tile != UE8M0_NAN_BYTE)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()
    assert (got[finite] == 0).sum() > 0 and np.isinf(got[finite]).sum() > 0   # both ends are reached


# ----------------------------------------------------------------------------------------------
# CPU: the plan and the build
# ----------------------------------------------------------------------------------------------
def test_plan_runs_folded_prefill_on_the_route_and_the_rest_as_mxfp8():
    folded = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(64, 40), expert_ids=(0, 1), experts=2))
    plan = plan_h200(folded)
    assert plan.kernel == "h200_wgmma" and plan.spec.chunk_scaled and plan.spec.fp8
    assert {r.name: r.evidence for r in plan.rules}["route"] == "fp8-fold-gpu"
    assert not plan_h200(folded, fp8=False).spec.fp8        # asked not to: the bf16 route reads them as MXFP8
    w4a8 = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(64, 40), expert_ids=(0, 1), experts=2,
                                            fmt="w4a8"))
    assert not plan_h200(w4a8).spec.fp8                      # not measured yet: only when asked
    assert plan_h200(w4a8, fp8=True).spec.step_scaled
    decode = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(4, 2), expert_ids=(0, 1), experts=2))
    assert plan_h200(decode).kernel == "h200_stream"         # below 33 tokens per expert: the streaming kernel
    assert plan_h200(decode, fp8=True).spec.chunk_scaled    # asked for
    with pytest.raises(ValueError, match="own tile"):
        plan_h200(folded, fp8=True, backend="h200_stream")
    wide = plan_h200(folded)   # the plan's tile on operands folded ahead: 128 x 192 (measured faster)
    assert wide.spec.chunk_scaled and (wide.spec.mma_bn, wide.spec.chunk_sets, wide.spec.stages) == (192, 1, 5)
    assert {r.name: r.evidence for r in wide.rules}["tile width"] == "fold-n192-ab"
    assert wide.spec == plan_h200(folded, fp8=True).spec == plan_h200(folded, fp8=True, mma_bn=192).spec
    assert wide.max_tiles == hl.max_tiles_bound(wide.ring, folded.total_tokens, folded.num_active_experts, 256)
    narrow = plan_h200(folded, fp8=True, mma_bn=128)   # asked for: two chunk sets
    assert (narrow.spec.mma_bn, narrow.spec.chunk_sets) == (128, 2)
    assert {r.name: r.evidence for r in narrow.rules}["tile width"] is None
    assert plan_h200(w4a8, fp8=True).spec.mma_bn == 128                   # W4A8 promotes per step: 128 rows
    with pytest.raises(ValueError, match="both folded ahead"):
        plan_h200(w4a8, fp8=True, mma_bn=192)


def test_plan_takes_a_pair_only_when_asked_on_its_own_tile_width():
    """``cta_group=2`` asked for: the pair on the plan's width (192 rows on operands folded ahead, 128 as asked, each
    rule citing its measurement; W4A8's 128); ``"auto"`` never takes a pair."""
    folded = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(64, 40), expert_ids=(0, 1), experts=2))
    assert plan_h200(folded).spec.cta_group == 1 and plan_h200(folded, fp8=True).spec.cta_group == 1
    pair = plan_h200(folded, fp8=True, cta_group=2)
    assert (pair.spec.mma_bn, pair.spec.cta_group, pair.spec.chunk_sets, pair.spec.stages) == (192, 2, 1, 5)
    assert pair.spec == plan_h200(folded, fp8=True, cta_group=2, mma_bn=192).spec
    rules = {r.name: r for r in pair.rules}
    assert rules["pair"].evidence == "fold-pair-n192-ab" and "11 % slower on ragged" in rules["pair"].decided
    assert "96 of its rows: 28 instead of 40 KB" in rules["pair"].decided and "CTA pairs" in pair.describe()
    assert pair.num_ctas % 2 == 0
    assert pair.max_tiles == hl.max_tiles_bound(pair.ring, folded.total_tokens, folded.num_active_experts, 256)
    narrow = plan_h200(folded, fp8=True, cta_group=2, mma_bn=128)
    assert (narrow.spec.mma_bn, narrow.spec.cta_group, narrow.spec.chunk_sets) == (128, 2, 2)
    assert {r.name: r.evidence for r in narrow.rules}["pair"] == "fold-pair-pipelined"
    w4a8 = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(64, 40), expert_ids=(0, 1), experts=2,
                                            fmt="w4a8"))
    w4a8_pair = plan_h200(w4a8, fp8=True, cta_group=2).spec
    assert (w4a8_pair.mma_bn, w4a8_pair.cta_group, w4a8_pair.step_scaled) == (128, 2, True)


def test_spec_takes_folded_operands_only_on_its_128_x_128_and_128_x_192_tiles():
    """128 x 128 (two chunk sets), and 128 x 192 (one set) with the tokens folded too, on one CTA or a pair: W4A8, the
    other routes and the SM100 tile rules keep refusing 192 rows."""
    folded = dict(a_layout=LAYOUT_E4M3_FOLDED, b_layout=LAYOUT_E4M3_FOLDED)
    spec = hw.WgmmaSpec("mxfp8", "mxfp8", 128, 6, fp8=True, **folded)
    assert spec.chunk_scaled and spec.buffers == 0 and spec.chunk_sets == 2
    assert not hw.WgmmaSpec("mxfp8", "mxfp8", 128, 6, **folded).chunk_scaled
    wide = hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, fp8=True, **folded)
    assert wide.chunk_scaled and not wide.step_scaled and wide.chunk_sets == 1 and hl.max_pipeline_stages(wide) == 5
    assert (wide.ring.tile_shape.tokens, wide.ring.tile_shape.weight_rows) == (128, 192)
    assert wide.ring.weight_box[1] == 192 and wide.ring.n_side.scale_bands == 2
    with pytest.raises(ValueError, match="128-token x 128-row"):
        hw.WgmmaSpec("mxfp8", "mxfp8", 256, 4, fp8=True, **folded)
    with pytest.raises(ValueError, match="128-token x 128-row"):
        hw.WgmmaSpec("mxfp8", "mxfp8", 128, 4, fp8=True, tile_tokens=256, **folded)
    with pytest.raises(ValueError, match="both folded ahead"):   # W4A8: its tokens' scales change per k32 step
        hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, fp8=True, b_layout=LAYOUT_E4M3_FOLDED)
    with pytest.raises(ValueError, match="both folded ahead"):
        hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, **folded)
    with pytest.raises(ValueError, match="both folded ahead"):
        hw.WgmmaSpec("mxfp4", "mxfp4", 192, 4)
    pair = hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, fp8=True, cta_group=2, **folded)
    assert pair.chunk_sets == 1 and hl.max_pipeline_stages(pair) == 5 and pair.smem == wide.smem
    with pytest.raises(ValueError, match="mma_bn=192 is illegal"):   # the SM100 rules (and the streaming kernel's)
        hr.StreamSpec("mxfp8", "mxfp8", False, 192, 1, 2)


@pytest.mark.parametrize("mma_bn, groups", [(128, 1), (192, 3)])
def test_each_column_group_is_promoted_with_its_fold_tiles_scale(mma_bn, groups):
    """A tile starts at a multiple of its width: 128-row tiles lie in one 128-row fold tile, 192-row tiles (from row 0
    or 64 of one) in two, so their 64-column groups take their own factors. Every column of a group lies in the fold
    tile whose scale the consumer reads (its first row's, ``column_group_scale_row``, inside the stage's scale
    bands)."""
    columns = hw.fold_column_group(mma_bn)
    assert columns * groups == mma_bn
    bands = hw.WgmmaSpec("mxfp8", "mxfp8", mma_bn, 1, fp8=True, a_layout=LAYOUT_E4M3_FOLDED,
                         b_layout=LAYOUT_E4M3_FOLDED).ring.n_side.scale_bands
    offsets = set()
    for r0 in range(0, 8 * 1024, mma_bn):
        offsets.add(r0 % hw.FOLD_TILE_ROWS)
        for g in range(groups):
            tile = hw.column_group_fold_tile(r0, g, mma_bn)
            assert {(r0 + c) // fr.KERNEL_WEIGHT_BASE_ROWS for c in range(columns * g, columns * (g + 1))} == {tile}
            row = hw.column_group_scale_row(r0, g, columns)
            assert row < bands * hw.FOLD_TILE_ROWS and r0 - r0 % hw.FOLD_TILE_ROWS + row == r0 + columns * g
    assert offsets == ({0} if mma_bn == 128 else {0, 64})
    if mma_bn == 192:   # the 192-row tiles at rows 0 and 192: fold tiles (0, 0, 1) and (1, 2, 2)
        assert [[hw.column_group_fold_tile(r0, g, 192) for g in range(3)] for r0 in (0, 192)] == [[0, 0, 1], [1, 2, 2]]


@pytest.mark.parametrize("a_layout, mma_bn, stages, mmas, promotions", [
    (LAYOUT_E4M3_FOLDED, 128, 6, 8, 2), ("packed", 128, 6, 4, 5), (LAYOUT_E4M3_FOLDED, 192, 5, 4, 1)])
def test_build_issues_pipelined_e4m3_wgmma_on_shared_operands_without_local_memory(a_layout, mma_bn, stages, mmas,
                                                                                     promotions):
    """Folded tokens: two slice bodies (one per chunk set) of 4 k32 steps; on the 192-row tile one slice body (one
    set, promoted after a wait for its group: no MMA waits for another that accumulates); W4A8: one slice body of 4
    single steps in alternating sets. Both operands shared-memory descriptors; no wait for 0 groups right after an
    MMA (ptxas serializes wgmma when other instructions touch accumulators it cannot prove retired: C7514); no local
    access in the loop that issues them (the accumulators fit the consumers' setmaxnreg budget)."""
    spec = hw.WgmmaSpec("mxfp8", "mxfp8", mma_bn, 1, fp8=True, a_layout=a_layout, b_layout=LAYOUT_E4M3_FOLDED)
    spec = dataclasses.replace(spec, stages=hl.max_pipeline_stages(spec))
    assert spec.stages == stages and spec.step_scaled == (a_layout == "packed")
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    sass = offline.disassemble(cubin)
    assert offline.resource_usage(cubin).local_bytes == 0
    instructions = offline.sass_instructions(sass)
    found = [i for i, ins in enumerate(instructions) if ins.startswith("QGMMA")]
    assert len(found) == mmas and all(f"64x{mma_bn}x32.F32.E4M3.E4M3" in instructions[i]
                                      and instructions[i].count("gdesc") == 1 for i in found), found
    assert not offline.serialized_wgmma(instructions)
    ops = collections.Counter(ins.split()[0].split(".")[0] for ins in instructions)
    assert ops["FFMA"] >= promotions * mma_bn // 2, "the promotions: one FFMA per accumulator"
    mma_loop = next(loop for loop in offline.sass_loops(sass) if loop.count("QGMMA"))
    assert mma_loop.count("QGMMA") == mmas and mma_loop.count("LDL") + mma_loop.count("STL") == 0


@pytest.mark.parametrize("diagnostic", hw.DIAGNOSTICS)
def test_diagnostic_builds_leave_out_the_promotion_or_the_mmas(diagnostic):
    """The 192-row tile's timing-only builds: ``no_promotion`` keeps the 4 pipelined MMAs per slice and no FFMA in
    their loop (the plan's build has one per accumulator there), ``no_mma`` issues no MMA and keeps the promotion."""
    def loops_and_ops(spec):
        cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                      launch_bounds=(spec.threads, spec.min_ctas_per_sm))
        sass = offline.disassemble(cubin)
        return offline.sass_loops(sass), offline.sass_instructions(sass)

    folded = dict(fp8=True, a_layout=LAYOUT_E4M3_FOLDED, b_layout=LAYOUT_E4M3_FOLDED)
    plain = hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, **folded)
    loops, instructions = loops_and_ops(dataclasses.replace(plain, diagnostic=diagnostic))
    if diagnostic == hw.DIAGNOSTIC_NO_PROMOTION:
        mma_loop = next(loop for loop in loops if loop.count("QGMMA"))
        assert mma_loop.count("QGMMA") == 4 and mma_loop.count("FFMA") == 0
        assert not offline.serialized_wgmma(instructions)
        plain_loop = next(loop for loop in loops_and_ops(plain)[0] if loop.count("QGMMA"))
        assert plain_loop.count("FFMA") == 192 // 2, "the plan's build promotes in the loop: one FFMA per accumulator"
    else:
        assert not any(ins.startswith("QGMMA") for ins in instructions)
        assert max(loop.count("FFMA") for loop in loops) == 192 // 2


def test_plan_builds_a_diagnostic_only_when_asked_on_the_192_row_tile():
    """``diagnostic=`` replaces the build of the plan's folded 192-row tile (one CTA or a pair) and says so in a rule;
    never unasked, and refused on any other tile, kernel or name."""
    folded = fr.fold_problem(gaussian_problem(256, 512, seed=4, group_sizes=(64, 40), expert_ids=(0, 1), experts=2))
    assert plan_h200(folded).spec.diagnostic is None and plan_h200(folded, fp8=True).spec.diagnostic is None
    plan = plan_h200(folded, fp8=True, diagnostic=hw.DIAGNOSTIC_NO_PROMOTION)
    assert plan.spec == dataclasses.replace(plan_h200(folded, fp8=True).spec, diagnostic=hw.DIAGNOSTIC_NO_PROMOTION)
    assert {r.name: r.decided for r in plan.rules}["diagnostic"].endswith("its outputs are wrong")
    pair = plan_h200(folded, fp8=True, cta_group=2, diagnostic=hw.DIAGNOSTIC_NO_MMA).spec
    assert (pair.mma_bn, pair.cta_group, pair.diagnostic) == (192, 2, hw.DIAGNOSTIC_NO_MMA)
    with pytest.raises(ValueError, match="diagnostic builds are"):
        plan_h200(folded, fp8=True, mma_bn=128, diagnostic=hw.DIAGNOSTIC_NO_MMA)
    with pytest.raises(ValueError, match="diagnostic builds are"):
        plan_h200(folded, fp8=True, diagnostic="fast_accumulation")
    decode = gaussian_problem(256, 512, seed=4, group_sizes=(4, 2), expert_ids=(0, 1), experts=2)
    with pytest.raises(ValueError, match="wgmma kernel's folded FP8 route"):
        plan_h200(decode, diagnostic=hw.DIAGNOSTIC_NO_MMA)


def test_the_192_row_stage_holds_the_weight_tile_and_both_scale_bands():
    """The 128 x 192 ring: a 192-row weight box (rows past N read as zeros, the map's bounds per expert) and two weight
    scale bands from the band of the tile's first row, which cover rows 64..255 of a tile starting mid-band."""
    spec = plan_h200(fr.fold_problem(gaussian_problem(448, 512, seed=9)), fp8=True, mma_bn=192).spec
    ring = spec.ring
    loads = hr.stage_loads(ring)
    assert sum(size for _, _, size, _ in loads) == ring.tx_bytes
    assert [size for what, _, size, _ in loads if what == "weights"] == [192 * 128]
    assert [what for what, *_ in loads].count("weight scales") == 2
    spans = sorted((offset, offset + size) for _, offset, size, _ in loads)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans
    assert max(hi for _, hi in spans) <= ring.smem.stage_bytes


def test_a_cta_pair_shares_the_weight_tile():
    """cta_group=2 (folded route only): a 256-token tile over two CTAs, each loading its own 128 token rows and half
    the weight rows multicast to both; the stage's boxes tile it and sum to the bytes its barrier expects."""
    folded = fr.fold_problem(gaussian_problem(320, 512, seed=1))
    single, pair = plan_h200(folded, fp8=True, mma_bn=128), plan_h200(folded, fp8=True, cta_group=2, mma_bn=128)
    assert (single.spec.cta_group, pair.spec.cta_group) == (1, 2) and pair.num_ctas % 2 == 0
    ring = pair.spec.ring
    assert (ring.tile_shape.tokens, ring.tile_shape.weight_rows) == (256, 128)
    assert ring.weight_box[1] == 64 and ring.token_box[1] == 128 and ring.tx_bytes == single.spec.ring.tx_bytes
    loads = hr.stage_loads(ring)
    assert sum(size for _, _, size, _ in loads) == ring.tx_bytes
    assert {what for what, _, _, multicast in loads if multicast} == {"weights", "weight scales"}
    spans = sorted((offset, offset + size) for _, offset, size, _ in loads)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans
    assert max(hi for _, hi in spans) <= ring.smem.stage_bytes
    with pytest.raises(ValueError, match="folded weights only"):
        hw.WgmmaSpec("mxfp4", "mxfp4", 128, 4, cta_group=2)
    with pytest.raises(ValueError, match="cta_group must be 1 or 2"):
        hw.WgmmaSpec("mxfp8", "mxfp8", 128, 4, fp8=True, cta_group=4, a_layout=LAYOUT_E4M3_FOLDED,
                     b_layout=LAYOUT_E4M3_FOLDED)


def test_a_192_row_pair_shares_the_weight_tile_in_halves_of_96_rows():
    """The pair on 192-row tiles: a 256 x 192 tile, each CTA loading its own 128 token rows and 96 weight rows (whole
    1024-byte swizzle atoms, so the peer's half lands at row 96 of the stage's wgmma operand) multicast to both, and
    one of the tile's two weight scale bands each, multicast. The stage is the one-CTA 192 tile's. The bands are the
    tile's, not a half's: a half straddling a fold tile's edge (rows 96..191 of the tile at 0, 192..287 of the one at
    192) finds every row's fold tile in them, as do the column groups the consumer promotes."""
    folded = fr.fold_problem(gaussian_problem(704, 512, seed=3))
    single, pair = plan_h200(folded, fp8=True, mma_bn=192), plan_h200(folded, fp8=True, cta_group=2)
    ring, one = pair.spec.ring, single.spec.ring
    assert (ring.tile_shape.tokens, ring.tile_shape.weight_rows, ring.tile_shape.cta_group) == (256, 192, 2)
    assert ring.shares_weights and not ring.shares_tokens and ring.empty_arrivals_per_cta == 2
    assert ring.weight_box == (128, 96, 1) and ring.token_box == (128, 128) and ring.m_rows == 128
    assert (ring.smem, ring.tx_bytes, ring.weight_side.scale_bands) == (one.smem, one.tx_bytes, 2)
    loads = hr.stage_loads(ring)
    assert sum(size for _, _, size, _ in loads) == ring.tx_bytes
    halves = [(offset, size) for what, offset, size, multicast in loads if what == "weights" and multicast]
    assert halves == [(ring.smem.n_data + rank * 96 * 128, 96 * 128) for rank in range(2)]
    assert all(offset % hr.DATA_ALIGN == 0 for offset, _ in halves)
    bands = [offset for what, offset, _, multicast in loads if what == "weight scales" and multicast]
    assert bands == [ring.smem.n_scales + b * ring.scale_band_bytes for b in range(2)]
    assert [multicast for what, *_, multicast in loads if what.startswith("token")] == [False, False]
    spans = sorted((offset, offset + size) for _, offset, size, _ in loads)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans
    assert max(hi for _, hi in spans) <= ring.smem.stage_bytes
    straddling = set()
    for r0 in range(0, folded.n, 192):
        band_start = r0 - r0 % hr.SF_ATOM_ROWS
        staged = range(band_start // hw.FOLD_TILE_ROWS, band_start // hw.FOLD_TILE_ROWS + 2)   # the stage's bands
        for rank in range(2):
            tiles = {row // hw.FOLD_TILE_ROWS for row in range(r0 + 96 * rank, r0 + 96 * (rank + 1))}
            assert tiles <= set(staged)
            straddling |= {(r0, rank)} if len(tiles) > 1 else set()
        assert {hw.column_group_fold_tile(r0, g, 192) for g in range(3)} <= set(staged)
    assert {(0, 1), (192, 0)} <= straddling
    with pytest.raises(ValueError, match="ab_swapped False"):
        hr.StreamSpec("mxfp8", "mxfp8", True, 192, 2, 2, warpgroup_consumers=True)
    with pytest.raises(ValueError, match="whole 1024-byte swizzle atoms"):   # 4-row halves: the second misaligned
        hr.StreamSpec("mxfp8", "mxfp8", False, 8, 2, 2, warpgroup_consumers=True)


def test_the_192_row_pairs_halves_load_the_one_cta_tiles_bytes():
    """Through the tensor maps the launch encodes: CTA ``rank`` of a 192-row pair loads weight rows ``r0 + 96 rank``
    (a 96-row box) into the stage at ``96 rank`` rows, and the two halves hold the one-CTA tile's 192-row box byte for
    byte, for every expert, tile (N = 320: the last tile's second half 32 rows below N, then zeros) and K slice; the
    scale map is the one-CTA tile's, CTA ``rank`` loading its band ``rank``; each CTA's own 128 token rows are the
    one-CTA tiles' boxes. Both maps swizzle alike (same box width, destinations 1024-byte aligned)."""
    folded = fr.fold_problem(gaussian_problem(320, 384, seed=12, group_sizes=(300, 9), expert_ids=(1, 0), experts=2))
    layouts = dict(a_layout=LAYOUT_E4M3_FOLDED, b_layout=LAYOUT_E4M3_FOLDED)
    single, pair = (hw.WgmmaSpec("mxfp8", "mxfp8", 192, 5, fp8=True, cta_group=cg, **layouts).ring for cg in (1, 2))
    shapes, addresses = _shapes_and_fake_addresses(folded)
    one_maps, pair_maps = (hl.tensor_map_args(ring, shapes, addresses) for ring in (single, pair))
    for args in pair_maps:
        args.check()
    assert pair_maps[1].box == (128, 96, 1) and one_maps[1].box == (128, 192, 1)
    assert pair_maps[1].swizzle == one_maps[1].swizzle == "128B"
    assert (pair_maps[0], pair_maps[2], pair_maps[3]) == (one_maps[0], one_maps[2], one_maps[3])
    b = folded.b.view(np.uint8)
    for expert in range(folded.num_experts):
        for r0 in range(0, folded.n, 192):
            for s in range(hl.k_slices_of(folded.k, single.k_slice)):
                want = tma_box_3d_any(b, one_maps[1], (128 * s, r0, expert))
                got = np.concatenate([tma_box_3d_any(b, pair_maps[1], (128 * s, r0 + 96 * rank, expert))
                                      for rank in range(2)])
                assert np.array_equal(got, want), (expert, r0, s)
                assert not got[(folded.n - r0) * 128:].any()   # rows past N: zeros, never the next expert's
    bands = [offset for what, offset, *_ in hr.stage_loads(pair) if what == "weight scales"]
    assert bands == [offset for what, offset, *_ in hr.stage_loads(single) if what == "weight scales"]
    assert [what for what, *_ in hr.stage_loads(pair)].count("tokens") == 1 and pair.token_box == single.token_box


def _pair_build(mma_bn):
    spec = hw.WgmmaSpec("mxfp8", "mxfp8", mma_bn, 1, fp8=True, a_layout=LAYOUT_E4M3_FOLDED, b_layout=LAYOUT_E4M3_FOLDED,
                        cta_group=2)
    spec = dataclasses.replace(spec, stages=hl.max_pipeline_stages(spec))
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    return spec, cubin


@pytest.mark.parametrize("mma_bn, stages, mmas", [(128, 6, 8), (192, 5, 4)])
def test_the_pair_build_multicasts_weights_and_releases_both_ctas(mma_bn, stages, mmas):
    """Both pair builds: the deepest ring (the one-CTA tile's), pipelined MMAs (no wait for 0 groups between MMAs that
    accumulate, nor right after one), no local memory, the weight halves multicast, remote arrivals on the peer's
    ``empty`` barriers, and the cluster barrier after init and before exit in each role's branch."""
    spec, cubin = _pair_build(mma_bn)
    assert spec.stages == stages
    assert offline.resource_usage(cubin).local_bytes == 0
    sass = offline.disassemble(cubin)
    instructions = offline.sass_instructions(sass)
    assert not offline.serialized_wgmma(instructions)   # the 57ebc6f pair build had every MMA waited for (C7512)
    ops = collections.Counter(ins.split()[0] for ins in instructions)
    assert ops[f"QGMMA.64x{mma_bn}x32.F32.E4M3.E4M3"] == mmas
    assert ops["UTMALDG.3D.MULTICAST"] >= 2 and ops["UTMALDG.2D"] >= 1   # weight halves (and scales); own tokens
    assert ops["UCGABAR_ARV"] >= 2 and ops["UCGABAR_WAIT"] >= 2          # the pair meets after init, before exit
    mma_loop = next(loop for loop in offline.sass_loops(sass) if loop.count("QGMMA"))
    assert mma_loop.count("QGMMA") == mmas and mma_loop.count("LDL") + mma_loop.count("STL") == 0
    assert mma_loop.count("SYNCS.ARRIVE.TRANS64.RED") >= 1   # the release reaches the peer CTA's barrier


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
def _run_folded(problem, cta_group=None, mma_bn=None):
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    folded = fr.fold_problem(problem)
    asked = {name: value for name, value in (("cta_group", cta_group), ("mma_bn", mma_bn)) if value is not None}
    plan = plan_h200(folded, fp8=True, **asked)
    assert plan.spec.chunk_scaled and plan.spec.step_scaled == (not problem.a_format.packed)
    assert all(getattr(plan.spec, name) == value for name, value in asked.items())
    return hl.run(folded, plan, None)


# (cta_group, mma_bn): one CTA per tile, a CTA pair sharing the weight tile, the 128 x 192 tile and its pair
FOLDED_TILES = [(1, 128), (2, 128), (1, 192), (2, 192)]
WIDE_TILES = [(1, 192), (2, 192)]


@pytest.mark.gpu
@pytest.mark.parametrize("cta_group, mma_bn", FOLDED_TILES)
@pytest.mark.parametrize("n, k", [(320, 2880), (256, 7168), (128, 256), (448, 1024)])
def test_gpu_folded_route_matches_the_reference_on_ragged_groups_and_tails(n, k, cta_group, mma_bn):
    """Ragged groups: an empty group, a -1 slot (its rows keep the poison), a 1-token group, groups past 256 tokens
    and not multiples of 128 (a pair's second CTA has part of a tile, or none); N and K tails (gpt-oss K = 2880: a
    partial last chunk); one CTA per tile, a CTA pair sharing the weight tile, and 192-row tiles on one CTA or a pair
    (N not a multiple of 192: a last tile of 128 or 64 rows starting mid fold tile (320, 256), at a fold tile's start
    (448), or the only one (128); a pair's second 96-row half partly past N (320, 128) or wholly (256, 448))."""
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"folded/{n}/{k}".encode()))
    counts = check_route(problem, _run_folded(problem, cta_group, mma_bn))
    assert counts["asserted"] > 0.5 * counts["elements"], counts   # Gaussian data: mostly exact chunk sums
    print(counts)


@pytest.mark.gpu
@pytest.mark.parametrize("cta_group, mma_bn", [(1, 128)] + WIDE_TILES)
def test_gpu_folded_route_takes_each_fold_tiles_own_factor(cta_group, mma_bn):
    """Weight rows of 128-row fold tile t scaled by 2^(3 t): every fold tile has its own base, so a column promoted
    with a neighbouring tile's factor is off by a power of 8 (the 192-row tiles span two fold tiles, and a pair's
    96-row halves straddle their edges; ragged groups, N = 704 not a multiple of 192)."""
    problem = fold_tiles_apart(704, 1024, seed=23)
    counts = check_route(problem, _run_folded(problem, cta_group, mma_bn))
    assert counts["asserted"] > 0.5 * counts["elements"], counts
    print(counts)


@pytest.mark.gpu
@pytest.mark.parametrize("cta_group, mma_bn", [(1, 128)] + WIDE_TILES)
def test_gpu_folded_route_window_edges_and_nan_blocks(cta_group, mma_bn):
    edge = window_edges(seed=7)
    counts = check_route(edge, _run_folded(edge, cta_group, mma_bn))
    print(counts)


@pytest.mark.gpu
@pytest.mark.parametrize("cta_group", [1, 2])
@pytest.mark.parametrize("diagnostic", hw.DIAGNOSTICS)
def test_gpu_diagnostic_builds_store_every_tile_they_time(diagnostic, cta_group):
    """The timing-only builds do the route's whole memory work on ragged groups (an empty group, a -1 slot, a 1-token
    group, an N tail): every written row is stored (``no_mma``: zeros, its chunk set never filled; ``no_promotion``:
    finite values, not the reference's), the skipped rows keep the poison."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    problem = gaussian_problem(320, 2880, seed=zlib.crc32(f"diagnostic/{diagnostic}".encode()))
    folded = fr.fold_problem(problem)
    out = hl.run(folded, plan_h200(folded, fp8=True, cta_group=cta_group, diagnostic=diagnostic), None)
    written = problem.written_rows()
    assert np.all(is_poison(out[~written])), "rows of skipped slots were written"
    stored = out[written].astype(np.float32)
    assert np.all(np.isfinite(stored)) and not np.any(is_poison(out[written]))
    if diagnostic == hw.DIAGNOSTIC_NO_MMA:
        assert np.all(stored == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(320, 2880), (256, 7168)])
def test_gpu_w4a8_on_folded_weights_matches_the_reference(n, k):
    """W4A8 with the weights folded ahead (``WgmmaSpec.step_scaled``): ragged groups, a -1 slot, a 1-token group,
    N and K tails."""
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"w4a8-folded/{n}/{k}".encode()), fmt="w4a8")
    print(check_route(problem, _run_folded(problem)))


@pytest.mark.gpu
def test_gpu_w4a8_on_folded_weights_nan_token_blocks_and_weight_window_edges():
    """A NaN-scale token block, a NaN token element, weight blocks at both ends of their tile's window."""
    edge = w4a8_window_edges(seed=17)
    print(check_route(edge, _run_folded(edge)))
