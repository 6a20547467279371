"""K and N that are not whole tiles (issue 31 item 4): gpt-oss-120b's MoE layers (up 5760 x 2880, down 2880 x 2880,
``shared/spec/workloads.md``) run on both H200 kernels without the caller padding anything.

How: the last K slice is partial (``h200_launch.k_slices_of``): TMA fills the tokens' (and row-major weights') bytes
past K, and their scale atoms past the last column group, with zeros; tiled and fused weights are stored padded to
whole 128-row x 128-byte boxes with zero bytes (``E2M1H200TiledOrder.padded_shape``), so the fast weight layout
applies to every shape. Zero elements contribute exact zeros whatever their scale, so the result is the exact
reference's (bit-identical where the accumulation is exact, ``gbs.exactness``).

CPU: the plans of the gpt-oss shapes in every format and regime (fused weights, the partial slice counted); the
producer's loads of padded tiled weights are checked against the row-major map in ``tests/test_h200_stream.py``
(``test_tiled_weight_loads_fill_the_stage_with_the_row_major_box``). GPU (the H200): every format on each kernel
build that a regime uses (streaming decode, split-K, swapped wgmma and its split-K, wgmma at 128 and 256 columns
and 256-token tiles), ragged groups with an empty group, a -1 slot and a 1-token group, poisoned output: packed
operands against the exact reference, and the H200 layouts bit-identical to them.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from gbs.formats import get_format
from gbs.lab.cases import synthetic_problem
from gbs.layouts import LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_PACKED
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import launch
from gbs.plan import ProblemMeta, h200_weight_layout, plan_h200
from gbs.problem import PROBLEM_FORMATS
from gbs.reference import reference_grouped_matmul

from h200_knobs import Stream, Wgmma, check_kernel, run

GPT_OSS_SHAPES = {"up": (5760, 2880), "down": (2880, 2880)}
REGIMES = {"decode": (64, 4), "small_prefill": (32, 32), "large_prefill": (32, 256)}   # experts x tokens each


@pytest.mark.parametrize("fmt", list(PROBLEM_FORMATS))
@pytest.mark.parametrize("layer", list(GPT_OSS_SHAPES))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_gpt_oss_shapes_plan_on_the_fast_layout_with_a_partial_last_slice(fmt, layer, regime):
    n, k = GPT_OSS_SHAPES[layer]
    experts, tokens = REGIMES[regime]
    meta = ProblemMeta.of(fmt, n, k, experts, tokens)
    if meta.b_format.packed:
        assert meta.b_layout == h200_weight_layout(meta.b_format) == LAYOUT_E2M1_H200_FUSED
    plan = plan_h200(meta)
    slices = hl.k_slices_of(k, plan.spec.k_slice)
    assert slices * plan.spec.k_slice > k > (slices - 1) * plan.spec.k_slice   # 2880: 11 slices + 64, or 22 + 64
    assert plan.k_splits * plan.slices_per_split >= slices > (plan.k_splits - 1) * plan.slices_per_split
    tail = next(r for r in plan.rules if r.name == "K tail")
    assert tail.evidence == "k-n-tails-gpu" and f"the last {k - (slices - 1) * plan.spec.k_slice}" in tail.decided
    assert "evidence k-n-tails-gpu" in plan.explain()


def test_k_slices_of_counts_the_partial_slice():
    assert [hl.k_slices_of(k, 256) for k in (256, 2816, 2880, 3072)] == [1, 11, 12, 12]
    assert hl.k_slices_of(2880, 128) == 23


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
TAIL_N, TAIL_K = 320, 2880   # N: 2 x 128 + 64 (a 256-row tile half past N); K: gpt-oss's
TAIL_SIZES = (5, 0, 1, 37, 3, 70, 129, 300)   # empty group, -1 slot, 1 token, > 256, not tile multiples
TAIL_IDS = (0, 4, 1, -1, 2, 5, 3, 6)
TAIL_BUILDS = {   # name: (knobs, plan constraints)
    "stream": (Stream(True, 8, 1), {}),
    "stream_split": (Stream(True, 8, 1), {"k_splits": 3}),
    "wgmma_swapped": (Wgmma(32, ab_swapped=True), {}),
    "wgmma_swapped_split": (Wgmma(32, ab_swapped=True), {"k_splits": 3}),
    "wgmma_bn128_256_tokens": (Wgmma(128, tile_tokens=256), {}),
    "wgmma_bn256": (Wgmma(256), {}),
}


def tail_builds(fmt: str) -> list[str]:
    """The builds that read ``fmt``'s tokens: bf16 tokens (W4A16) only the wgmma kernel's not-swapped tiles."""
    if get_format(PROBLEM_FORMATS[fmt][0]).scaled:
        return list(TAIL_BUILDS)
    return [name for name, (knobs, _) in TAIL_BUILDS.items() if isinstance(knobs, Wgmma) and not knobs.ab_swapped]


TAIL_CASES = [(fmt, build) for fmt in PROBLEM_FORMATS for build in tail_builds(fmt)]


def tail_problem(fmt: str, tag: str):
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    return synthetic_problem(fmt, n=TAIL_N, k=TAIL_K, group_sizes=list(TAIL_SIZES), expert_ids=list(TAIL_IDS),
                             num_experts=8, seed=zlib.crc32(tag.encode()))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, build", TAIL_CASES)
def test_gpu_k_and_n_tails_match_the_reference_on_every_layout(fmt, build):
    problem = tail_problem(fmt, f"tails/{fmt}/{build}")
    knobs, constraints = TAIL_BUILDS[build]
    packed = run(problem, knobs, **constraints)   # poisoned output: skipped rows keep it
    result = check_kernel(problem, packed, reference_grouped_matmul(problem), knobs.backend)
    assert result.passed, f"{build} {fmt}: {result}"
    if not problem.b_format.packed:
        return
    relaid = problem.with_b_layout(LAYOUT_E2M1_H200_FUSED)
    if problem.a_format.packed:
        relaid = relaid.with_a_layout(LAYOUT_E2M1_H200)
    assert relaid.b.shape[1:] != problem.b.shape[1:]   # stored padded
    plan = knobs.plan(relaid, **constraints)
    assert hl.ring_of(plan.spec).weight_side.layout == LAYOUT_E2M1_H200_FUSED
    out = run(relaid, knobs, **constraints)
    result = check_kernel(problem, out, reference_grouped_matmul(problem), knobs.backend)
    assert result.passed, f"{build} {fmt} re-laid: {result}"
    if plan.k_splits == 1:   # split-K runs add their partials with atomics, in no fixed order
        np.testing.assert_array_equal(out.view(np.uint16), packed.view(np.uint16))


def test_tail_builds_are_legal_plans_on_the_cpu():
    """The GPU test's builds plan (on the CPU) for every format, packed and re-laid: a build the GPU test would
    find refused fails here first."""
    for fmt in PROBLEM_FORMATS:
        meta = ProblemMeta.of(fmt, TAIL_N, TAIL_K, len(TAIL_SIZES), max(TAIL_SIZES), relaid=False)
        for name in tail_builds(fmt):
            knobs, constraints = TAIL_BUILDS[name]
            for layout_meta in (meta, ProblemMeta.of(fmt, TAIL_N, TAIL_K, len(TAIL_SIZES), max(TAIL_SIZES))):
                plan = knobs.plan(layout_meta, **constraints)
                assert plan.kernel == knobs.backend, (fmt, name)
                assert (plan.k_splits > 1) == ("split" in name), (fmt, name, plan.k_splits)
        assert meta.b_layout == LAYOUT_PACKED


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "w4a8"])
def test_nan_scales_in_the_padding_columns_of_a_k_tail_are_refused(fmt):
    """Past K the kernels multiply zero elements by the atoms' padding columns: a NaN there would make the row NaN,
    so a problem with a K tail refuses NaN padding scales (both operands); zeros, as quantized, pass."""
    import dataclasses

    from gbs.formats import swizzle_scales, unswizzle_scales

    p = synthetic_problem(fmt, n=128, k=352, group_sizes=[3], expert_ids=[0], num_experts=1)
    p.validate()
    for name, fmt_ in (("a_scales", p.a_format), ("b_scales", p.b_format)):
        linear = unswizzle_scales(getattr(p, name))
        cols = fmt_.scale_cols(p.k)
        assert cols % 4 and not linear[..., cols:].any()
        linear[..., 0, cols] = 0xFF if fmt_.scale_dtype == "ue8m0" else 0x7F
        bad = swizzle_scales(linear)
        with pytest.raises(ValueError, match=f"{name}: the 128x4 atoms' padding columns"):
            dataclasses.replace(p, **{name: bad})
