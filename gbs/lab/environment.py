"""Where a measurement ran: GPU (name and UUID), date, commit and package versions (``environment_fields``),
and a GPU's short name for file names and CSV keys (``gpu_slug``). Every bench, sweep and ablation row
carries these fields."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import re
import subprocess

import numpy as np


def _git_commit() -> str:
    """Short HEAD of the checkout holding this file, "+dirty" with local changes; "unknown" without git."""
    here = os.path.dirname(__file__)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here).stdout.strip()
    except OSError:
        return "unknown"
    if not commit:
        return "unknown"
    return commit + "+dirty" if changed else commit


def environment_fields() -> dict:
    """GPU, date, commit and versions for every CSV row (a commit with "+dirty" had local changes).

    ``gpu_uuid`` names the physical GPU: lent H200s differ (read ceilings of ~4.52 or ~4.63 TB/s, and one
    build ran 3 % apart on two of them: evidence gpu-kinds), so before / after figures are only compared
    on one ``gpu_uuid``. ``GBS_COMMIT`` in the environment overrides git: the device tool's copy of the working
    tree has no ``.git`` or a stale one (on 2026-12-02 its ``git rev-parse HEAD`` named the session's first commit,
    not the tree that ran), so start `scripts/gpu_run.sh` there with ``GBS_COMMIT=<sha>`` taken here."""
    import ml_dtypes
    import numba

    try:
        from numba import cuda

        device = cuda.get_current_device()
        gpu = device.name.decode() if isinstance(device.name, bytes) else device.name
        gpu_uuid = str(getattr(device, "uuid", "unknown"))
    except Exception:
        gpu, gpu_uuid = "none", "none"
    commit = os.environ.get("GBS_COMMIT") or _git_commit()
    try:
        import numba_cuda

        numba_cuda_version = numba_cuda.__version__
    except Exception:
        numba_cuda_version = "unknown"
    return {"gpu": gpu, "gpu_uuid": gpu_uuid, "date": datetime.date.today().isoformat(), "commit": commit,
            "numpy": np.__version__, "numba": numba.__version__, "numba_cuda": numba_cuda_version,
            "ml_dtypes": ml_dtypes.__version__, "torch": _installed_version("torch"),
            "triton": _installed_version("triton")}


def _installed_version(package: str) -> str:
    """A package's version without importing it (torch takes seconds); "none" if absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def gpu_slug(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'h200': lower case, vendor dropped, other runs of symbols -> '-'."""
    name = re.sub(r"^nvidia\s+", "", gpu_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"

