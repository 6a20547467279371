"""Test-suite wide settings: GPU-marked tests skip, with the reason, on machines without a CUDA GPU;
SM100-marked tests (they need a Blackwell GPU, compute capability 10.0) skip everywhere else, the H200
included. Markers are declared in pyproject.toml and strict (``--strict-markers``): ``gpu``, ``sm100``,
``slow`` (CPU tests over ~10 s, mostly offline kernel compiles: they still run in CI; deselect them
locally with ``-m "not slow"``)."""
import pytest

from gbs.backends import gpu_available

GPU_SKIP_REASON = ("needs a CUDA GPU (none here); run `scripts/gpu_run.sh` on a GPU machine, "
                   "e.g. the H200 through the device tool")
SM100_SKIP_REASON = "needs a Blackwell SM100 GPU (compute capability 10.0: B200 / GB200); this machine has {}"
SM100 = (10, 0)


def _compute_capability():
    """The current GPU's compute capability, or None without one."""
    from gbs.numba_kernels.launch import gpu_compute_capability

    return gpu_compute_capability()


def skip_markers(has_gpu: bool, capability) -> dict:
    """marker name -> the skip it brings on this machine (none when it can run here)."""
    skips = {}
    if not has_gpu:
        skips["gpu"] = pytest.mark.skip(reason=GPU_SKIP_REASON)
    if not has_gpu or tuple(capability or ()) != SM100:
        here = f"sm_{capability[0]}{capability[1]}" if has_gpu and capability else "no GPU"
        skips["sm100"] = pytest.mark.skip(reason=SM100_SKIP_REASON.format(here))
    return skips


def pytest_collection_modifyitems(config, items):
    has_gpu = gpu_available()
    skips = skip_markers(has_gpu, _compute_capability() if has_gpu else None)
    for item in items:
        for name, skip in skips.items():
            if name in item.keywords:
                item.add_marker(skip)
                break
