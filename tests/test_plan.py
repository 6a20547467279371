"""The H200 plan's rules, tested apart from the kernels (host metadata only, no GPU): which kernel, which knobs,
which split and grid, and that the launch and the description are one plan."""
import dataclasses

import numpy as np
import pytest

from gbs.dispatch import AUTO_STAGES, dispatch_for
from gbs.formats import get_format
from gbs.lab.cases import BENCH_CASES, BenchCase
from gbs.plan import (SMALL_N_MAX_TOKENS, SWAPPED_MIN_TOKENS_PER_EXPERT, H200Plan, ProblemMeta, Rule,
                      h200_weight_layout, min_tokens_per_expert, plan_h200, stream_k_splits, swapped_k_splits)
from gbs.problem import PROBLEM_FORMATS, random_problem
from gbs.reference import reference_grouped_matmul


def knobs(plan: H200Plan) -> tuple:
    s = plan.spec
    return plan.kernel, s.ab_swapped, s.mma_bn, s.cta_group


def test_auto_routes_prefill_to_wgmma_and_decode_to_the_streaming_kernel():
    prefill = BENCH_CASES["large_prefill_up"].problem("nvfp4")
    decode = BENCH_CASES["decode_up"].problem("nvfp4")
    assert plan_h200(prefill).kernel == "h200_wgmma"
    assert knobs(plan_h200(decode)) == ("h200_stream", True, 8, 1)
    # 32 tokens per expert: FP4 x FP4 on the swapped 32-token wgmma tiles, FP8 tokens on the streaming kernel
    for fmt in ("nvfp4", "mxfp4", "mxfp8", "w4a8"):
        plan = plan_h200(BENCH_CASES["small_prefill_up"].problem(fmt))
        if fmt in ("nvfp4", "mxfp4"):
            assert knobs(plan)[:3] == ("h200_wgmma", True, 32), fmt
        else:
            assert plan.kernel == "h200_stream", fmt
    # a caller's config is honoured by the streaming kernel (all SM100 knobs), not re-routed
    assert plan_h200(prefill, dispatch_for(prefill)).kernel == "h200_stream"
    with pytest.raises(ValueError, match="mma_bn in"):
        plan_h200(decode, dispatch_for(decode), "h200_wgmma")
    with pytest.raises(ValueError, match="not an H200 backend"):
        plan_h200(decode, None, "simt")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "w4a8"])
def test_auto_leaves_no_token_count_to_the_wide_streaming_tiles(fmt):
    """Past the small-N mapping the streaming kernel's token tiles lose to the wgmma kernel (evidence:
    wgmma-min-tokens): every such problem goes to the wgmma kernel, decode stays on the streaming kernel."""
    def kernel_at(tokens, n=256, k=256, experts=4):
        return plan_h200(BenchCase("t", n, k, experts, tokens).problem(fmt)).kernel

    limit = SMALL_N_MAX_TOKENS
    assert kernel_at(limit + 1) == kernel_at(4 * limit) == "h200_wgmma"
    assert kernel_at(4) == kernel_at(limit // 2) == "h200_stream"
    if fmt in ("nvfp4", "mxfp4"):   # the swapped 32-token tile from 17 tokens at any tile count (swapped-tiles)
        assert kernel_at(limit, 4096, 256, 32) == "h200_wgmma"
        assert kernel_at(SWAPPED_MIN_TOKENS_PER_EXPERT - 1) == "h200_stream"
        assert kernel_at(limit, 256, 3072, 4) == "h200_wgmma", "8 tiles, K 3072: the swapped tiles' split-K runs"
        assert kernel_at(limit) == "h200_wgmma"
    else:
        assert kernel_at(limit) == "h200_stream", "32 FP8 tokens: one 32-token tile per expert"
    assert min_tokens_per_expert(BenchCase("t", 256, 256, 4, 1).problem(fmt)) <= limit + 1


def test_wgmma_backend_takes_a_configs_tile_on_its_own_ring():
    """``backend="h200_wgmma"`` with a KernelConfig: the config's tile, this kernel's deepest ring (the SM100
    stage count is a B200 number)."""
    problem = BENCH_CASES["large_prefill_up"].problem("mxfp8")
    decision = dispatch_for(problem)   # MXFP8's default route: not swapped, mma_bn 128, cta_group 1
    plan = plan_h200(problem, decision, "h200_wgmma")
    deepest = plan_h200(problem, backend="h200_wgmma", mma_bn=decision.mma_bn, stages=AUTO_STAGES)
    assert knobs(plan) == ("h200_wgmma", False, decision.mma_bn, 1) and plan.spec == deepest.spec


def test_streaming_config_stages_are_capped_and_constraints_are_not():
    """A caller's SM100 config keeps its tile with its B200 stage count capped at the H200's deepest ring; a
    constraint asking for more stages than fit is refused, naming the limit."""
    problem = BENCH_CASES["large_prefill_up"].problem("nvfp4")
    decision = dispatch_for(problem)
    capped = plan_h200(problem, decision)
    deepest = plan_h200(problem, ab_swapped=decision.ab_swapped, mma_bn=decision.mma_bn,
                        cta_group=decision.cta_group).spec.stages
    assert capped.spec.stages == min(decision.num_pipeline_stages, deepest)
    with pytest.raises(ValueError, match="do not fit the H200"):
        plan_h200(problem, ab_swapped=True, mma_bn=128, cta_group=2, stages=deepest + 1)
    with pytest.raises(TypeError, match="unknown plan constraints"):
        plan_h200(problem, mma_n=8)
    with pytest.raises(ValueError, match="not both"):
        plan_h200(problem, decision, mma_bn=8)


def test_h200_weight_layout_is_the_measured_one_per_weight_format():
    """FP4 weights fused with their scales in the H200 word order (evidence: fused-weight-layout), FP8 weights
    packed; every answer is a layout ``with_b_layout`` accepts for that format."""
    assert h200_weight_layout("nvfp4") == "e2m1_h200_fused"
    assert h200_weight_layout(get_format("mxfp4")) == "e2m1_h200_fused"
    assert h200_weight_layout("mxfp8") == "packed"
    for fmt in PROBLEM_FORMATS:
        for n, k in ((256, 512), (192, 352)):   # whole boxes, and N and K tails (gpt-oss's 2880: stored padded)
            problem = random_problem(fmt, n=n, k=k, num_experts=3, total_tokens=12, num_active_experts=2, seed=1)
            relaid = problem.with_b_layout(h200_weight_layout(problem.b_format))
            np.testing.assert_array_equal(reference_grouped_matmul(relaid).view(np.uint16),
                                          reference_grouped_matmul(problem).view(np.uint16))


@pytest.mark.parametrize("case, fmt, want", [
    ("decode_up", "nvfp4", "h200_stream swapped bn8 cg1 2 stages; whole K"),
    ("kimi_decode", "nvfp4", "h200_stream swapped bn8 cg1 2 stages, 8 consumer warps; 4 split-K runs of 7 slices"),
    ("small_prefill_up", "mxfp4", "h200_wgmma swapped bn32, 8 stages; whole K"),        # 1024 tiles
    ("kimi_small_prefill", "nvfp4", "h200_wgmma swapped bn32, 8 stages; 4 split-K runs of 7 slices"),   # 32 tiles
    ("kimi_small_prefill", "w4a8", "h200_wgmma swapped bn32, 16 stages; 4 split-K runs of 14 slices"),   # FP8 tokens
    ("small_prefill_up", "w4a8", "h200_stream swapped bn32 cg1 2 stages; whole K"),
    ("large_prefill_up", "mxfp4", "h200_wgmma not swapped bn128, 256-token tiles, 3 stages; whole K"),
])
def test_describe_names_the_kernel_knobs_and_split(case, fmt, want):
    """``describe`` says what "auto" runs on an H200 from host metadata alone (the bench cases); without an sm_90
    GPU the grid is an estimate and says so."""
    described = plan_h200(BENCH_CASES[case].problem(fmt)).describe()
    assert described.startswith(want + "; "), described
    assert described.endswith("(estimated: no sm_90 GPU to compile)")


@pytest.mark.parametrize("case, fmt, k_slice", [
    ("decode_up", "w4a8", 256), ("decode_up", "w4a16", 256), ("kimi_decode", "w4a16_nvfp4", 256),
    ("small_prefill_up", "w4a8", 128), ("small_prefill_up", "w4a16", 128),   # 32-token tiles keep 128 K
    ("decode_up", "mxfp4", 256), ("decode_up", "mxfp8", 128), ("large_prefill_up", "w4a8", 128)])
def test_the_k_slice_rule_names_the_streaming_tiles_that_widen_it(case, fmt, k_slice):
    """The ring widens FP4 weights' K slice to 256 with FP8 / bf16 tokens in the 8- and 16-column decoded-token
    tiles; the plan says so in a rule citing the measurement, and only where the slice differs from the pair's."""
    plan = plan_h200(BENCH_CASES[case].problem(fmt))
    assert plan.spec.k_slice == k_slice
    widened = [r for r in plan.rules if r.name == "K slice"]
    pair = 256 if all(get_format(f).packed for f in PROBLEM_FORMATS[fmt]) else 128
    assert len(widened) == (k_slice != pair), plan.explain()
    if widened:
        assert widened[0].evidence == "w4a8-k256" and "256 K per stage" in widened[0].decided


def test_explain_lists_every_rule_with_its_evidence():
    plan = plan_h200(BENCH_CASES["kimi_decode"].problem("nvfp4"))
    text = plan.explain()
    assert text.splitlines()[0] == plan.describe()
    for rule in plan.rules:
        assert f"- {rule.name}: {rule.decided}" in text
        if rule.evidence:
            assert f"evidence {rule.evidence}:" in text
    assert {"smalln-tiles", "smalln-stages", "smalln-eight-warps", "stream-split-k"} <= {r.evidence for r in plan.rules}


def test_the_plan_is_frozen_and_what_the_launch_reads():
    plan = plan_h200(BENCH_CASES["decode_up"].problem("nvfp4"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.k_splits = 2
    assert isinstance(plan.rules[0], Rule) and plan.num_ctas > 0 and plan.max_tiles > 0


def test_split_rules():
    # streaming: no split while the tiles fill the resident pairs; runs of >= 6 slices otherwise
    assert stream_k_splits(400, 28, 396) == (1, 28)
    assert stream_k_splits(32, 28, 396) == (4, 7)
    assert stream_k_splits(1, 5, 396) == (1, 5)
    # swapped wgmma: one wave of runs of >= 2 slices, none below 12 slices
    assert swapped_k_splits(32, 28, 132) == (4, 7)
    assert swapped_k_splits(8, 28, 132) == (14, 2)
    assert swapped_k_splits(32, 8, 132) == (1, 8)
    assert swapped_k_splits(200, 28, 132) == (1, 28)
    with pytest.raises(ValueError):
        swapped_k_splits(0, 28, 132)


def test_problem_meta_plans_like_the_problem_it_describes():
    """The CLI's metadata-only problem gives the same plan as the bench problem of the same shape."""
    case = BENCH_CASES["kimi_small_prefill"]
    problem = case.problem("nvfp4")
    meta = ProblemMeta.of("nvfp4", problem.n, problem.k, problem.num_active_experts,
                          problem.estimated_total_m // problem.num_active_experts, relaid=False)
    assert dataclasses.replace(plan_h200(meta), rules=()) == dataclasses.replace(plan_h200(problem), rules=())
