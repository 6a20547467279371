"""Which backend runs a problem on this machine: the one place that reads the GPU's compute capability.

Backends, best first where the hardware allows: ``"sm100"`` (the tcgen05 kernel: Blackwell, compute capability
10.0; assembled and emulated here, never run: no such GPU in this project's machines), the two H200 kernels
(``"h200_wgmma"``, ``"h200_stream"``: compute capability 9.0; which of them ``"auto"`` runs is the H200 plan's
decision, ``gbs.plan``), ``"simt"`` (the plain Numba kernel: any CUDA GPU, or Numba's simulator) and
``"reference"`` (the exact CPU reference, always available).
"""
from __future__ import annotations

BACKENDS = ("auto", "sm100", "h200_wgmma", "h200_stream", "simt", "reference")
H200_BACKENDS = ("h200_stream", "h200_wgmma")   # also the backends that run device problems
SM100_COMPUTE_CAPABILITY = (10, 0)
H200_COMPUTE_CAPABILITY = (9, 0)


def gpu_available() -> bool:
    """A real CUDA GPU (not Numba's simulator) is usable from Numba."""
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


def _compute_capability() -> tuple[int, int]:
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability)


def select_backend(backend: str = "auto") -> str:
    """The backend ``backend`` resolves to on this machine (no problem needed): ``"auto"`` gives ``"reference"``
    without a GPU, ``"sm100"`` on compute capability 10.0, ``"h200_stream"`` on 9.0 (where the plan then picks
    between the two H200 kernels per problem) and ``"simt"`` elsewhere. ValueError for an unknown name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if not gpu_available():
        return "reference"
    return {SM100_COMPUTE_CAPABILITY: "sm100", H200_COMPUTE_CAPABILITY: "h200_stream"}.get(_compute_capability(),
                                                                                            "simt")


def check_device_backend(backend: str) -> str:
    """The backend ``backend`` resolves to here, if it runs device problems; else the error that says which do."""
    chosen = select_backend(backend)
    resolved = "" if chosen == backend else f" (backend={backend!r} resolved to {chosen!r} here)"
    if chosen == "reference":
        raise TypeError(f"the reference backend computes on the host and device arrays are never copied "
                        f"implicitly{resolved}: run gbs.grouped_matmul(gbs.interop.to_host(problem), "
                        f"backend='reference') (copies every array), or a device backend: {H200_BACKENDS}")
    if chosen not in H200_BACKENDS:
        raise NotImplementedError(f"backend {chosen!r} takes host GroupedProblems only (it copies them to the "
                                  f"device itself){resolved}; device problems run on {H200_BACKENDS} (an sm_90 "
                                  "GPU such as the H200), or copy explicitly with gbs.interop.to_host(problem)")
    return chosen
