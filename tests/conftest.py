"""Test-suite wide settings: GPU-marked tests skip, with the reason, on machines without a CUDA GPU."""
import pytest

from gbs.backends import gpu_available

GPU_SKIP_REASON = ("needs a CUDA GPU (none here); run `scripts/gpu_run.sh` on a GPU machine, "
                   "e.g. the H200 through the device tool")


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
