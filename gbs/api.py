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
  emulated in CI, never run here: no such GPU exists in this project's machines);
* ``"h200_wgmma"``: the H200 prefill kernel (``gbs.numba_kernels.h200_wgmma``: the same TMA ring,
  weights decoded to bf16 in shared memory, tokens into registers, ``wgmma``; or swapped, for FP4 small
  prefill: weights into registers, tokens into shared memory); ``"auto"`` on an H200 picks it when the
  dispatch decides (``config=None``) and the experts average at least ``h200_wgmma.min_tokens_per_expert``
  tokens (17 for NVFP4 / MXFP4: its swapped 32-token tiles, in split-K runs where they are fewer than a wave,
  sweep runs 107-109 and 119-121; 33 with FP8 tokens: past the streaming kernel's small-N mapping, sweep runs 24
  and 33, or 17 where their swapped tiles split, run 125); its knobs are ``h200_wgmma.wgmma_plan``'s;
* ``"h200_stream"``: the H200 (Hopper, sm_90a) streaming kernel: TMA ring of ``num_pipeline_stages``
  K slices, software block scales, ``mma.sync`` bf16 (what ``"auto"`` runs on compute capability 9.0
  for decode, and for every problem given a ``config``). Without a config the SM100 decision is
  mapped onto it (``h200_stream.h200_plan``); a given config keeps ``ab_swapped`` / ``mma_bn`` /
  ``cta_group``, its stages capped at what fits the H200's shared memory with this kernel's real
  stage bytes;
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

import dataclasses

from .dispatch import AUTO_STAGES, KernelConfig, grouped_matmul_block_scaled_sm100_dispatch
from .problem import GroupedProblem
from .formats import get_format
from .layouts import LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_PACKED, E2M1H200TiledOrder
from .reference import reference_grouped_matmul

BACKENDS = ("auto", "sm100", "h200_wgmma", "h200_stream", "simt", "reference")
SM100_COMPUTE_CAPABILITY = (10, 0)
H200_COMPUTE_CAPABILITY = (9, 0)


def gpu_available() -> bool:
    """A real CUDA GPU (not Numba's simulator) is usable from Numba."""
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


# The byte layout to re-lay each FP4 weight format into, once, for the H200 kernels (``h200_weight_layout``).
# ``E2M1H200FusedOrder``: the bits of each word re-laid (``E2M1H200Order``: the decode's 9 instead of 13
# instructions per word, UE4M3 scale codes), each 128-row x 128-byte TMA box stored contiguously and followed by
# its K slice's scale atoms, so a stage's weight bytes are one DRAM stream. Measured in alternating rounds, both
# operands re-laid (notes/h200/README.md, sessions 22-23), row-major / tiled (scales apart) / fused:
# - run 100 (4.63 TB/s H200; fused as a diagnostic copy): decode_up MXFP4 255.9 / 264.9 / 253.8 us (85.2 % of the
#   read ceiling), NVFP4 268.5 / 261.0 / 260.5 (88.0 %);
# - run 101 (4.53 TB/s H200, this layout): decode_up MXFP4 263.5 / 270.4 / 263.3 us, NVFP4 279.1 / 268.9 / 269.1
#   (row-major's slow mode), W4A8 289.8 / 284.7 / 287.5, MXFP4 decode_down 140.7 / 140.7 / 139.3, NVFP4 small
#   prefill 291.8 / 294.6 / 292.6, MXFP4 large prefill (wgmma) 809.0 / 804.6 / 802.7.
# Fused is the fastest or within 1 % of it on every point; tiled weights with separate scales lose 2.6-3.8 % on
# MXFP4 decode (runs 95, 98, 100, 101), which the fused chunks undo.
H200_WEIGHT_LAYOUTS = {"nvfp4": LAYOUT_E2M1_H200_FUSED, "mxfp4": LAYOUT_E2M1_H200_FUSED}


def h200_weight_layout(weight_format, n: int | None = None, k: int | None = None) -> str:
    """The layout ``GroupedProblem.with_b_layout`` / ``gbs.device_problem(b_layout=...)`` should get for FP4
    weights of ``weight_format`` (a format or its name; ``H200_WEIGHT_LAYOUTS``, measured on the H200);
    ``"packed"`` for FP8 weights, which have no H200 layout. Given the weights' ``n`` and ``k``: the row-major
    H200 order (``"e2m1_h200"``) where they do not make whole 128-row x 256-element boxes."""
    fmt = get_format(weight_format)
    if not fmt.packed:
        return LAYOUT_PACKED
    layout = H200_WEIGHT_LAYOUTS[fmt.name]
    whole_boxes = n is None or k is None or E2M1H200TiledOrder.whole_boxes((n, fmt.row_bytes(k)))
    if not whole_boxes:
        return LAYOUT_E2M1_H200
    return layout


# Upstream's SM100 routing has no E5M2 entry (an error there). Tiles, stages and scales do not
# depend on the FP8 flavour, so gbs's own kernels take the E4M3 route's decision for E5M2.
_ROUTE_AS = {"mxfp8_e5m2": "mxfp8"}


def dispatch_for(problem) -> KernelConfig:
    """The SM100 dispatch decision for a problem (its formats, N, K and token estimate: host values
    of a ``GroupedProblem`` or a device problem).

    MXFP8 E5M2 problems take the MXFP8 (E4M3) decision (upstream routes no E5M2)."""
    a_name, b_name = problem.a_format.name, problem.b_format.name
    return grouped_matmul_block_scaled_sm100_dispatch(
        a_format=_ROUTE_AS.get(a_name, a_name), b_format=_ROUTE_AS.get(b_name, b_name), n=problem.n, k=problem.k,
        num_active_experts=problem.num_active_experts, estimated_total_m=problem.estimated_total_m)


def _compute_capability() -> tuple[int, int]:
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability)


def select_backend(backend: str = "auto") -> str:
    """The backend family ``backend`` resolves to on this machine (no problem needed): on an H200
    ``"auto"`` gives ``"h200_stream"``, and ``h200_kernel`` then picks between the two H200 kernels per
    problem (``grouped_matmul`` does both)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not gpu_available():
            return "reference"
        return {SM100_COMPUTE_CAPABILITY: "sm100", H200_COMPUTE_CAPABILITY: "h200_stream"}.get(
            _compute_capability(), "simt")
    return backend


def resolve_config(problem, config: KernelConfig | None = None):
    """The knobs a kernel backend runs ``problem`` (a ``GroupedProblem`` or a device problem) with:
    ``config`` (a ``KernelConfig`` decided for the problem's formats) or the dispatch's decision; for
    problems decided on another format's route (E5M2) only its tile knobs (``schedule.TileConfig``,
    auto stages). TypeError / ValueError saying what is wrong."""
    config = dispatch_for(problem) if config is None else config
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig from gbs.dispatch, got {type(config).__name__}")
    problem_route = tuple(_ROUTE_AS.get(f.name, f.name) for f in (problem.a_format, problem.b_format))
    if (config.a_format, config.b_format) != problem_route:
        raise ValueError(f"config was decided for {config.a_format} x {config.b_format}, "
                         f"the problem is {problem.a_format.name} x {problem.b_format.name}")
    if problem.a_format.name in _ROUTE_AS:   # decided on the E4M3 route: hand the kernel only the knobs
        from .schedule import TileConfig

        return TileConfig.of(config)
    return config


def h200_stream_knobs(problem, config: KernelConfig | None = None):
    """The ``h200_stream`` knobs for ``problem``: a given ``config`` as is (its stages capped at what
    fits the H200, ``h200_stream.h200_stream_config``); without one, the dispatch's SM100 decision
    mapped onto the H200 (``h200_stream.h200_plan``: measured retunes of the small-N tiles and rings)."""
    from .numba_kernels import h200_stream

    knobs = resolve_config(problem, config)
    if config is None:
        return h200_stream.h200_plan(problem, knobs)
    return h200_stream.h200_stream_config(problem, knobs)


def h200_kernel(problem, config: KernelConfig | None = None, backend: str = "auto"):
    """(kernel module, knobs) an H200 backend runs ``problem`` with: ``"h200_wgmma"`` ->
    (``h200_wgmma``, ``wgmma_plan`` or the given config's tile), ``"h200_stream"`` -> (``h200_stream``,
    ``h200_stream_knobs``); ``"auto"`` -> the wgmma kernel for prefill when the dispatch decides
    (``h200_wgmma.prefers``), else the streaming kernel."""
    from .numba_kernels import h200_stream, h200_wgmma

    if backend == "auto":
        backend = "h200_wgmma" if config is None and h200_wgmma.prefers(problem) else "h200_stream"
    if backend == "h200_wgmma":
        if config is None:
            return h200_wgmma, h200_wgmma.wgmma_plan(problem)
        # the config's tile, on this kernel's deepest ring (the SM100 stage counts are B200 numbers)
        tile = h200_wgmma.WgmmaConfig.of(resolve_config(problem, config))
        return h200_wgmma, dataclasses.replace(tile, num_pipeline_stages=AUTO_STAGES)
    if backend != "h200_stream":
        raise ValueError(f"not an H200 backend: {backend!r}")
    return h200_stream, h200_stream_knobs(problem, config)


def describe_h200_plan(problem) -> str:
    """What ``"auto"`` runs for ``problem`` on an H200, in words, from host metadata only (a ``GroupedProblem``, a
    device problem, or any object with ``a_format``, ``b_format``, ``n``, ``k``, ``num_active_experts`` and
    ``estimated_total_m``; no GPU needed): the kernel (``h200_kernel``), its knobs and, for the wgmma kernel's
    swapped tiles, the split-K runs per tile its plan estimates (``h200_wgmma.swapped_split_plan``, one CTA per
    SM). The streaming kernel picks its split-K runs at launch, from the CTAs its registers let each SM hold."""
    from .numba_kernels import h200_stream, h200_wgmma

    kernel, knobs = h200_kernel(problem)
    orientation = "swapped" if knobs.ab_swapped else "not swapped"
    if kernel is h200_stream:
        warps = (f", {knobs.small_n_warps} consumer warps" if knobs.small_n_warps != h200_stream.CONSUMER_WARPS_SMALL_N
                 else "")
        return (f"h200_stream {orientation} bn{knobs.mma_bn} cg{knobs.cta_group} {knobs.num_pipeline_stages} stages"
                f"{warps}; split-K runs chosen at launch")
    if not knobs.ab_swapped:
        return f"h200_wgmma {orientation} bn{knobs.mma_bn}, {knobs.tile_tokens}-token tiles"
    runs = h200_wgmma.swapped_split_plan(problem, knobs.mma_bn)[0]
    return f"h200_wgmma {orientation} bn{knobs.mma_bn}, " + (f"{runs} split-K runs per tile" if runs > 1 else
                                                              "whole K per tile")


def grouped_matmul(problem, config: KernelConfig | None = None, backend: str = "auto", out=None, *,
                   stream=None):
    """Run the grouped 1D-1D block-scaled matmul; returns ``C`` (bf16, (total_tokens, N)).

    ``problem``: a ``GroupedProblem`` (returns a bf16 numpy array) or a
    ``gbs.interop.DeviceGroupedProblem`` (returns a device array of the kind of its ``a``, enqueued
    on ``stream``, default the caller's current stream; see ``gbs.interop``). Rows of skipped slots
    keep the contents of ``out`` (host default: the poison sentinel of
    ``gbs.reference.poison_output``; device default: uninitialised). FP4 weights re-laid for the H200
    (``problem.with_b_layout(h200_weight_layout(problem.b_format, problem.n, problem.k))``:
    ``"e2m1_h200_fused"``; or ``"e2m1_h200"``, ``"e2m1_h200_tiled"``) and FP4 tokens in the H200 word order
    (``a_layout="e2m1_h200"``, written so by
    their quantizer; ``problem.with_a_layout``) run on the H200 backends and the reference; the SIMT and
    SM100 backends read packed operands only and say so.
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
    if chosen in ("h200_stream", "h200_wgmma"):   # raise, naming the hardware they need, without an sm_90 GPU
        kernel, kernel_knobs = h200_kernel(problem, config, "auto" if backend == "auto" else chosen)
        return kernel.grouped_matmul_h200(problem, kernel_knobs, out=out)
    if chosen == "sm100":   # raises, naming the hardware it needs, on anything but compute capability 10.0
        from .numba_kernels import sm100

        return sm100.grouped_matmul_sm100(problem, knobs, out=out)
    from .numba_kernels import simt

    return simt.grouped_matmul_simt(problem, knobs, out=out)
