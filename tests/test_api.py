"""gbs.grouped_matmul: backend selection, config checks, the dispatch's decision per problem."""
import numpy as np
import pytest

from gbs import grouped_matmul
from gbs.api import dispatch_for, h200_weight_layout, resolve_config, select_backend
from gbs.dispatch import grouped_matmul_nvfp4_dispatch
from gbs.problem import PROBLEM_FORMATS, random_problem
from gbs.formats import get_format
from gbs.reference import check_acceptance, is_poison, reference_grouped_matmul


@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
def test_reference_backend_for_every_format(fmt):
    p = random_problem(fmt, n=40, k=128, num_experts=5, total_tokens=30, num_active_experts=3, routing="ragged",
                       num_empty=1, num_skipped=1, seed=11)
    out = grouped_matmul(p, backend="reference")
    assert check_acceptance(p, out).passed
    assert np.all(is_poison(out[~p.written_rows()]))
    cfg = dispatch_for(p)
    route = "mxfp8" if fmt == "mxfp8_e5m2" else None   # E5M2 takes the E4M3 route's decision
    assert cfg.a_format == (route or p.a_format.name)


def test_config_for_other_formats_is_rejected():
    p = random_problem("mxfp8", n=40, k=128, num_experts=3, total_tokens=8, num_active_experts=2, seed=0)
    nvfp4_cfg = grouped_matmul_nvfp4_dispatch(n=40, k=128, num_active_experts=2, estimated_total_m=8)
    with pytest.raises(ValueError, match="decided for nvfp4 x nvfp4"):
        grouped_matmul(p, nvfp4_cfg, backend="reference")
    with pytest.raises(TypeError, match="KernelConfig"):
        grouped_matmul(p, {"mma_bn": 8}, backend="reference")
    with pytest.raises(TypeError, match="GroupedProblem"):
        grouped_matmul(np.zeros(3), backend="reference")


def test_backend_selection():
    assert select_backend("reference") == "reference"
    assert select_backend("auto") in ("simt", "reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("cuda")


def test_sm100_backend_says_what_hardware_it_needs():
    p = random_problem("nvfp4", n=64, k=256, num_experts=3, total_tokens=8, num_active_experts=2, seed=1)
    with pytest.raises(RuntimeError, match=r"compute capability 10\.0.*use backend"):
        grouped_matmul(p, backend="sm100")


def test_resolve_config_checks_and_maps_the_e5m2_route():
    from gbs.schedule import TileConfig

    p = random_problem("mxfp8_e5m2", n=40, k=128, num_experts=3, total_tokens=8, num_active_experts=2, seed=2)
    knobs = resolve_config(p)
    assert isinstance(knobs, TileConfig) and knobs == TileConfig.of(dispatch_for(p))
    q = random_problem("nvfp4", n=40, k=128, num_experts=3, total_tokens=8, num_active_experts=2, seed=2)
    assert resolve_config(q) == dispatch_for(q)
    with pytest.raises(ValueError, match="decided for mxfp8 x mxfp8"):
        resolve_config(q, dispatch_for(p))


def test_problem_type_error_names_both_problem_kinds():
    with pytest.raises(TypeError, match=r"GroupedProblem \(host arrays\) or a DeviceGroupedProblem"):
        grouped_matmul({"a": np.zeros(3)}, backend="reference")


def test_h200_kernel_routes_prefill_to_wgmma_when_the_dispatch_decides():
    """Host-only: which H200 kernel and knobs ``"auto"`` picks (no GPU needed to decide)."""
    from gbs.api import h200_kernel
    from gbs.lab.bench import BENCH_CASES
    from gbs.numba_kernels import h200_stream, h200_wgmma

    prefill = BENCH_CASES["large_prefill_up"].problem("nvfp4")
    decode = BENCH_CASES["decode_up"].problem("nvfp4")
    kernel, knobs = h200_kernel(prefill)
    assert kernel is h200_wgmma and knobs == h200_wgmma.wgmma_plan(prefill)
    kernel, knobs = h200_kernel(decode)
    assert kernel is h200_stream and knobs == h200_stream.h200_plan(decode, dispatch_for(decode))
    # 32 tokens per expert: FP4 x FP4 on the wgmma kernel's swapped 32-token tiles (runs 107-108), FP8 tokens on
    # the streaming kernel's 32-token tiles (runs 33-34, 108)
    for fmt in ("nvfp4", "mxfp4", "mxfp8", "w4a8"):
        kernel, knobs = h200_kernel(BENCH_CASES["small_prefill_up"].problem(fmt))
        if fmt in ("nvfp4", "mxfp4"):
            assert kernel is h200_wgmma and (knobs.ab_swapped, knobs.mma_bn) == (True, 32), fmt
        else:
            assert kernel is h200_stream, fmt
    # a caller's config is honoured by the streaming kernel (all SM100 knobs), not re-routed
    kernel, _ = h200_kernel(prefill, dispatch_for(prefill))
    assert kernel is h200_stream
    # asking for the wgmma kernel with knobs it does not have says which
    with pytest.raises(ValueError, match="mma_bn in"):
        h200_kernel(decode, dispatch_for(decode), "h200_wgmma")
    with pytest.raises(ValueError, match="not an H200 backend"):
        h200_kernel(decode, None, "simt")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "w4a8"])
def test_h200_auto_leaves_no_token_count_to_the_wide_streaming_tiles(fmt):
    """Past the streaming kernel's small-N mapping (at most ``H200_SMALL_N_MAX_TOKENS`` per expert) its
    token tiles lose 2.4-5x to the wgmma kernel (sweep run 24): "auto" must route every such problem to
    the wgmma kernel, and keep decode (4 tokens per expert) on the streaming kernel."""
    from gbs.api import h200_kernel
    from gbs.lab.bench import BenchCase
    from gbs.numba_kernels import h200_stream, h200_wgmma

    def kernel_at(tokens):
        return h200_kernel(BenchCase("t", 256, 256, 4, tokens).problem(fmt))[0]

    limit = h200_stream.H200_SMALL_N_MAX_TOKENS
    assert kernel_at(limit + 1) is h200_wgmma and kernel_at(4 * limit) is h200_wgmma
    assert kernel_at(4) is h200_stream and kernel_at(limit // 2) is h200_stream
    if fmt in ("nvfp4", "mxfp4"):   # the swapped 32-token tile from 17 tokens (runs 107-109) at any tile count
        wave = h200_kernel(BenchCase("t", 4096, 256, 32, limit).problem(fmt))[0]
        assert wave is h200_wgmma and kernel_at(h200_wgmma.SWAPPED_MIN_TOKENS_PER_EXPERT - 1) is h200_stream
        few_long = h200_kernel(BenchCase("t", 256, 3072, 4, limit).problem(fmt))[0]
        assert few_long is h200_wgmma, "8 tiles on 132 SMs, K 3072: the swapped tiles' split-K runs (runs 119-121)"
        assert kernel_at(limit) is h200_wgmma
    else:
        assert kernel_at(limit) is h200_stream, "32 FP8 tokens: one 32-token tile per expert wins (runs 34, 108)"
    assert h200_wgmma.min_tokens_per_expert(BenchCase("t", 256, 256, 4, 1).problem(fmt)) <= limit + 1


def test_wgmma_backend_takes_a_configs_tile_on_its_own_ring():
    """``backend="h200_wgmma"`` with a KernelConfig: the config's tile, this kernel's deepest ring (the
    SM100 stage count is a B200 number)."""
    from gbs.api import h200_kernel
    from gbs.lab.bench import BENCH_CASES
    from gbs.dispatch import AUTO_STAGES
    from gbs.numba_kernels import h200_wgmma

    problem = BENCH_CASES["large_prefill_up"].problem("mxfp8")
    decision = dispatch_for(problem)   # MXFP8's default route: not swapped, mma_bn 128, cta_group 1
    kernel, knobs = h200_kernel(problem, decision, "h200_wgmma")
    assert kernel is h200_wgmma
    assert knobs == h200_wgmma.WgmmaConfig(decision.mma_bn, AUTO_STAGES)
    assert h200_wgmma.check_can_implement(problem, knobs).mma_bn == decision.mma_bn


def test_h200_weight_layout_is_the_measured_one_per_weight_format():
    """FP4 weights (NVFP4, MXFP4 and W4A8's) fused with their scales in the H200 word order, FP8 weights
    packed; every answer is a layout ``with_b_layout`` accepts for that format."""
    assert h200_weight_layout("nvfp4") == "e2m1_h200_fused"
    assert h200_weight_layout(get_format("mxfp4")) == "e2m1_h200_fused"
    assert h200_weight_layout("mxfp8") == "packed"
    assert h200_weight_layout("nvfp4", 4096, 7168) == "e2m1_h200_fused"
    assert h200_weight_layout("nvfp4", 200, 7168) == h200_weight_layout("mxfp4", 4096, 7168 + 128) == "e2m1_h200"
    assert h200_weight_layout("mxfp8", 200, 7168) == "packed"
    for fmt in PROBLEM_FORMATS:
        problem = random_problem(fmt, n=256, k=512, num_experts=3, total_tokens=12, num_active_experts=2, seed=1)
        relaid = problem.with_b_layout(h200_weight_layout(problem.b_format))
        np.testing.assert_array_equal(reference_grouped_matmul(relaid).view(np.uint16),
                                      reference_grouped_matmul(problem).view(np.uint16))


@pytest.mark.parametrize("case, fmt, want", [
    ("decode_up", "nvfp4", "h200_stream swapped bn8 cg1 2 stages; split-K runs chosen at launch"),
    ("kimi_decode", "nvfp4", "h200_stream swapped bn8 cg1 2 stages, 8 consumer warps; split-K runs chosen at launch"),
    ("small_prefill_up", "mxfp4", "h200_wgmma swapped bn32, whole K per tile"),       # 1024 tiles
    ("kimi_small_prefill", "nvfp4", "h200_wgmma swapped bn32, 4 split-K runs per tile"),   # 32 tiles (run 122)
    ("kimi_small_prefill", "w4a8", "h200_wgmma swapped bn32, 4 split-K runs per tile"),    # FP8 tokens (run 125)
    ("small_prefill_up", "w4a8", "h200_stream swapped bn32 cg1 2 stages; split-K runs chosen at launch"),
    ("large_prefill_up", "mxfp4", "h200_wgmma not swapped bn128, 256-token tiles"),
])
def test_describe_h200_plan_names_the_kernel_knobs_and_split(case, fmt, want):
    """``describe_h200_plan`` says what "auto" runs on an H200 from host metadata alone (the bench cases)."""
    from gbs.api import describe_h200_plan
    from gbs.lab.bench import BENCH_CASES

    assert describe_h200_plan(BENCH_CASES[case].problem(fmt)) == want
