"""The public entry point: ``grouped_matmul(problem, config=None, backend="auto", out=None, *, stream=None)``.

``problem`` is either

* a ``gbs.problem.GroupedProblem`` (numpy arrays on the host): every backend takes it; GPU backends
  copy it to the device and the result back, synchronously, and return a bf16 numpy array; or
* a ``gbs.interop.DeviceGroupedProblem`` (``gbs.device_problem(...)``: PyTorch / CuPy / Numba /
  ``__cuda_array_interface__`` / DLPack arrays already on the GPU): run on the caller's memory with no
  copies, enqueued on the caller's stream (asynchronous), the output returned as the same kind of
  array as the problem's ``a`` (a ``torch.bfloat16`` tensor for torch; ``uint16`` bf16 bits for CuPy
  and Numba). Only the H200 kernels (``"h200_stream"``, ``"h200_wgmma"``) take device problems so far;
  the others say so, and ``gbs.interop.to_host`` is the explicit copy. See ``gbs.interop`` for what is accepted and checked.

Backends, best first where the hardware allows:

* ``"sm100"``: the tcgen05 kernel (Blackwell B200/GB200, compute capability 10.0; assembled and
  emulated in CI, never run here: no such GPU exists in this project's machines; no W4A16: tcgen05 has
  no bf16 x FP4 kind);
* ``"h200_wgmma"``: the H200 prefill kernel (``gbs.numba_kernels.h200_wgmma``: weights decoded to bf16 in
  shared memory, tokens into registers, ``wgmma``; or swapped, weights into registers, tokens into shared memory);
* ``"h200_stream"``: the H200 streaming kernel (``gbs.numba_kernels.h200_stream``: TMA ring, software block
  scales, ``mma.sync`` bf16), for decode and small prefill.
  On an H200 ``"auto"`` runs what ``gbs.plan.plan_h200`` decides (``python -m gbs plan`` prints it): the kernel,
  its knobs, the split-K runs and the grid, from the SM100 decision, or a given config's tile (its stages capped at
  what fits the H200);
* ``"simt"``: the plain Numba CUDA kernel (any CUDA GPU, or Numba's simulator with
  ``NUMBA_ENABLE_CUDASIM=1``);
* ``"reference"``: the exact CPU reference (``gbs.reference``), always available.

``config`` is a ``gbs.dispatch.KernelConfig``; by default the dispatch picks it from the problem's
host metadata (formats, N, K, ``num_active_experts``, ``estimated_total_m``: no device reads) with
``grouped_matmul_block_scaled_sm100_dispatch``, so that every backend is steered by the same
decision (the reference ignores it).

``out``: rows of skipped (``-1``) slots keep its contents. Host problems: a bf16 numpy array,
default the poison sentinel of ``gbs.reference.poison_output``. Device problems: a device array
(module docstring of ``gbs.interop``), default a new uninitialised one.
"""
from __future__ import annotations

from .backends import H200_BACKENDS, select_backend
from .dispatch import KernelConfig, dispatch_for, route_formats
from .problem import GroupedProblem
from .reference import reference_grouped_matmul


def resolve_config(problem, config: KernelConfig | None = None):
    """The knobs the SIMT and SM100 kernels run ``problem`` with: ``config`` (a ``KernelConfig`` decided for the
    problem's formats) or the dispatch's decision; for problems decided on another pair's route (E5M2, W4A16:
    ``gbs.dispatch.route_formats``) only its tile (``schedule.TileConfig``, auto stages). TypeError / ValueError
    saying what is wrong."""
    config = dispatch_for(problem) if config is None else config
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig from gbs.dispatch, got {type(config).__name__}")
    formats = (problem.a_format.name, problem.b_format.name)
    route = route_formats(*formats)
    if (config.a_format, config.b_format) != route:
        raise ValueError(f"config was decided for {config.a_format} x {config.b_format}, "
                         f"the problem is {formats[0]} x {formats[1]}")
    if route != formats:   # decided on another pair's route: the tile only
        from .schedule import TileConfig

        return TileConfig.of(config)
    return config


def grouped_matmul(problem, config: KernelConfig | None = None, backend: str = "auto", out=None, *,
                   stream=None):
    """Run the grouped 1D-1D block-scaled matmul; returns ``C`` (bf16, (total_tokens, N)).

    ``problem``: a ``GroupedProblem`` (returns a bf16 numpy array) or a
    ``gbs.interop.DeviceGroupedProblem`` (returns a device array of the kind of its ``a``, enqueued
    on ``stream``, default the caller's current stream; see ``gbs.interop``). Rows of skipped slots
    keep the contents of ``out`` (host default: the poison sentinel of
    ``gbs.reference.poison_output``; device default: uninitialised). FP4 weights re-laid for the H200
    (``problem.with_b_layout(gbs.plan.h200_weight_layout(problem.b_format))``) and FP4 tokens
    in the H200 word order (``problem.with_a_layout("e2m1_h200")``) run on the H200 backends and the reference; the
    SIMT and SM100 backends read packed operands only and say so.
    """
    if not isinstance(problem, GroupedProblem):
        from .interop import DeviceGroupedProblem, prepare

        if not isinstance(problem, DeviceGroupedProblem):
            raise TypeError(f"problem must be a GroupedProblem (host arrays) or a DeviceGroupedProblem "
                            f"(device arrays, gbs.device_problem), got {type(problem).__name__}")
        prepared = prepare(problem, config, out, stream=stream, backend=backend)
        prepared()
        return prepared.out
    if stream is not None:
        raise ValueError("stream applies to device problems only: host problems run synchronously")
    knobs = resolve_config(problem, config)
    chosen = select_backend(backend)
    if chosen == "reference":
        return reference_grouped_matmul(problem, out)
    if chosen in H200_BACKENDS:   # raises, naming the hardware they need, without an sm_90 GPU
        from .numba_kernels import h200_launch
        from .plan import plan_h200

        return h200_launch.run(problem, plan_h200(problem, config, backend), out)
    if chosen == "sm100":   # raises, naming the hardware it needs, on anything but compute capability 10.0
        from .numba_kernels import sm100

        return sm100.grouped_matmul_sm100(problem, knobs, out=out)
    from .numba_kernels import simt

    return simt.grouped_matmul_simt(problem, knobs, out=out)
