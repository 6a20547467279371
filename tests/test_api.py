"""gbs.grouped_matmul: backend selection, config checks, the dispatch's decision per problem."""
import numpy as np
import pytest

from gbs import grouped_matmul
from gbs.api import resolve_config
from gbs.backends import select_backend
from gbs.dispatch import dispatch_for
from gbs.dispatch import grouped_matmul_nvfp4_dispatch
from gbs.problem import PROBLEM_FORMATS, random_problem
from gbs.reference import check_acceptance, is_poison


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
