"""gbs.grouped_matmul: backend selection, config checks, the dispatch's decision per problem."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gbs import grouped_matmul
from gbs.api import resolve_config
from gbs.backends import select_backend
from gbs.dispatch import dispatch_for, route_formats
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
    # E5M2 takes the E4M3 route's decision, W4A16 W4A8's
    assert (cfg.a_format, cfg.b_format) == route_formats(p.a_format.name, p.b_format.name)


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


@pytest.mark.parametrize("fmt", ["w4a16", "w4a16_nvfp4"])
def test_w4a16_runs_w4a8s_tile_and_the_sm100_kernel_refuses_it(fmt):
    from gbs import sm100_emulator
    from gbs.schedule import TileConfig

    p = random_problem(fmt, n=40, k=96, num_experts=4, total_tokens=20, num_active_experts=3, routing="ragged",
                       num_skipped=1, seed=3)
    cfg = dispatch_for(p)
    assert (cfg.a_format, cfg.b_format) == ("mxfp8", "mxfp4")
    assert resolve_config(p) == TileConfig.of(cfg) and resolve_config(p, cfg) == TileConfig.of(cfg)
    nvfp4 = dispatch_for(random_problem("nvfp4", n=40, k=96, num_experts=4, total_tokens=20, num_active_experts=3))
    with pytest.raises(ValueError, match=f"decided for nvfp4 x nvfp4, the problem is bf16 x {p.b_format.name}"):
        resolve_config(p, nvfp4)
    refusal = f"no tcgen05 kind for bf16 x {p.b_format.name}: .* there is no bf16 x FP4 kind"
    with pytest.raises(ValueError, match=refusal):   # before the hardware check
        grouped_matmul(p, backend="sm100")
    with pytest.raises(ValueError, match=refusal):
        sm100_emulator.emulate(p, resolve_config(p))


SIMT_W4A16 = textwrap.dedent("""
    import numpy as np
    from gbs import grouped_matmul
    from gbs.exactness import check_output
    from gbs.problem import build_problem, random_activations, random_weights
    from gbs.reference import poison_output
    rng = np.random.default_rng(4)
    sizes, ids = [1, 0, 11, 3, 1, 9], [2, 0, 4, -1, 1, 3]   # 1-token groups, an empty group, a -1 slot
    for fmt in ("w4a16", "w4a16_nvfp4"):   # N = 72 and K = 96: neither a tile multiple
        p = build_problem(random_activations(rng, sum(sizes), 96), random_weights(rng, 5, 72, 96), sizes, ids, fmt=fmt)
        out = grouped_matmul(p, backend="simt", out=poison_output(p.total_tokens, p.n))
        check = check_output(p, out, "simt")
        print(fmt, check.summary())
        assert check.passed, check.mismatches
        assert check.bit_identical > 0.9 * check.elements
""")


@pytest.mark.slow   # Numba's CUDA simulator in a subprocess
def test_w4a16_on_the_simt_backend_within_its_exactness():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", SIMT_W4A16], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count("ok: bit-identical to the reference") == 2, res.stdout
