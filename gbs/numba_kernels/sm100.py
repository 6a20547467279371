"""The SM100 (B200) backend's host side: the checks before any device work, the tensor maps'
encoding, the cluster launch, and ``grouped_matmul_sm100``, which ``gbs.api`` calls for backend
``"sm100"``.

The kernel itself (``sm100_kernel``), its build spec and memory plans (``sm100_spec``), the
coordinates and tensor maps it uses (``sm100_addressing``) and its offline builds (``sm100_build``)
live beside this module; ``docs/design/sm100_kernel.md`` is the design.

Nothing here has run: no Blackwell GPU is within this project's reach. Every check that needs no
GPU comes first (``check_can_implement``: problem, config, shared memory, TMEM, TMA alignment), so a
bad problem or config is rejected on any machine; then ``require_sm100`` says which hardware is
needed and which backends to use instead. Constraints the launch keeps (``docs/design/toolchain.md``,
"Launching"): more than 48 KiB of dynamic shared memory needs the function attribute raised first,
a pair of CTAs is launched as a cluster, and the shared-memory request keeps a second block off
each SM (the kernel allocates all 512 TMEM columns).
"""
from __future__ import annotations

import functools

import numpy as np

from gbs import dispatch, schedule
from gbs.numba_kernels.sm100_addressing import (FP4_UNPACK_ADDRESS_ALIGN, FP4_UNPACK_DTYPE,
                                                FP4_UNPACK_INNER_MULTIPLE, ProblemShape, TensorMapSpec,
                                                tensor_map_specs)
from gbs.numba_kernels.sm100_kernel import kernel_signature, make_kernel_function
from gbs.numba_kernels.sm100_spec import (OUTPUT_BYTES, SmemPlan, Sm100KernelSpec, check_launch_plan,
                                          launch_smem_bytes)
from gbs.problem import GroupedProblem, require_packed

SM100_COMPUTE_CAPABILITY = (10, 0)
SUGGESTED_BACKENDS = ("h200_stream", "simt", "reference")


# ----------------------------------------------------------------------------------------------
# Checks before any device work
# ----------------------------------------------------------------------------------------------
def check_can_implement(problem: GroupedProblem, config) -> tuple[Sm100KernelSpec, int]:
    """(spec, stages) for ``problem`` with ``config`` (a ``KernelConfig``, whose stages are used,
    or a ``TileConfig``, which gets auto stages); TypeError / ValueError saying what is wrong."""
    if not isinstance(problem, GroupedProblem):
        raise TypeError(f"problem must be a GroupedProblem, got {type(problem).__name__}")
    problem.validate()
    require_packed(problem, "the SM100 kernel")
    for side in ("a_format", "b_format"):
        want, got = getattr(problem, side).name, getattr(config, side, None)
        if got is not None and got != want:
            raise ValueError(f"config was decided for {side}={got!r} but the problem's {side} is {want!r}")
    spec = Sm100KernelSpec.of(problem, config)
    if isinstance(config, dispatch.KernelConfig):
        stages = config.num_pipeline_stages
    else:
        stages = dispatch.auto_pipeline_stages(mma_bn=spec.mma_bn, cta_group=spec.cta_group,
                                               ab_swapped=spec.ab_swapped, num_sf_k_tiles=spec.num_sf_k_tiles)
    check_launch_plan(spec, stages)
    a_fmt, b_fmt = problem.a_format, problem.b_format
    for name, fmt in (("token", a_fmt), ("weight", b_fmt)):
        if fmt.row_bytes(problem.k) % 16:
            raise ValueError(f"K={problem.k}: {name} rows of {fmt.row_bytes(problem.k)} B are not a multiple of "
                             "16 B (TMA row stride); K must be a multiple of 32 for FP4, 16 for FP8")
    if spec.weights_unpacked_by_tma and problem.k % FP4_UNPACK_INNER_MULTIPLE:
        raise ValueError(f"W4A8 needs K % {FP4_UNPACK_INNER_MULTIPLE} == 0 (the unpacking TMA of the FP4 "
                         f"weights takes whole 128-element rows), got K={problem.k}")
    if (problem.n * OUTPUT_BYTES) % 16:
        raise ValueError(f"N={problem.n}: output rows of {problem.n * OUTPUT_BYTES} B are not a multiple of "
                         "16 B (TMA store row stride); N must be a multiple of 8")
    return spec, stages


def require_sm100() -> None:
    """RuntimeError unless a compute capability 10.0 GPU (B200 / GB200) is the current device."""
    from numba import config as numba_config
    from numba import cuda

    alternatives = ", ".join(f"'{b}'" for b in SUGGESTED_BACKENDS)
    need = ("the SM100 tcgen05 kernel needs an NVIDIA Blackwell data-center GPU of compute capability "
            f"{SM100_COMPUTE_CAPABILITY[0]}.{SM100_COMPUTE_CAPABILITY[1]} (B200 / GB200, sm_100a)")
    instead = (f"use backend {alternatives} instead ('h200_stream' on an H200 / Hopper GPU, 'simt' on any "
               "CUDA GPU, 'reference' on the CPU)")
    if numba_config.ENABLE_CUDASIM or not cuda.is_available():
        raise RuntimeError(f"{need}; no CUDA GPU is available here (Numba's simulator cannot run inline "
                           f"PTX); {instead}")
    device = cuda.get_current_device()
    cc = tuple(device.compute_capability)
    if cc != SM100_COMPUTE_CAPABILITY:
        name = device.name.decode() if isinstance(device.name, bytes) else device.name
        raise RuntimeError(f"{need}; the current GPU ({name}) has compute capability {cc[0]}.{cc[1]}; {instead}")


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------
def _encode_fp4_unpack_map(address: int, map_spec: TensorMapSpec) -> np.ndarray:
    """cuTensorMapEncodeTiled for the unpacking FP4 map (``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B``),
    a data type ``copy.encode_tensor_map_*`` does not take (its dims count 4-bit elements)."""
    from cuda.bindings import driver

    if address % FP4_UNPACK_ADDRESS_ALIGN or map_spec.dims[0] % FP4_UNPACK_INNER_MULTIPLE:
        raise ValueError(f"the {FP4_UNPACK_DTYPE} map needs a {FP4_UNPACK_ADDRESS_ALIGN}-byte aligned base and an "
                         f"inner dimension that is a multiple of {FP4_UNPACK_INNER_MULTIPLE}, got {address:#x}, "
                         f"{map_spec.dims}")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B, len(map_spec.dims), int(address),
        [u64(d) for d in map_spec.dims], [u64(s) for s in map_spec.strides], [u32(b) for b in map_spec.box],
        [u32(1)] * len(map_spec.dims), driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled({FP4_UNPACK_DTYPE}, {map_spec}) failed: {err}")
    return np.array([int(w) for w in tensor_map.opaque], dtype=np.uint64).view(np.uint8).copy()


def _encode_tensor_maps(map_specs, addresses) -> np.ndarray:
    from gbs.ptx_inline import copy

    encoded = []
    for map_spec, address in zip(map_specs, addresses):
        if map_spec.dtype == FP4_UNPACK_DTYPE:
            encoded.append(_encode_fp4_unpack_map(address, map_spec))
        elif len(map_spec.dims) == 2:
            encoded.append(copy.encode_tensor_map_2d(address, map_spec.dtype, map_spec.dims, map_spec.strides[0],
                                                     map_spec.box, map_spec.swizzle))
        else:
            encoded.append(copy.encode_tensor_map_3d(address, map_spec.dtype, map_spec.dims, map_spec.strides,
                                                     map_spec.box, map_spec.swizzle))
    return np.concatenate(encoded)


@functools.lru_cache(maxsize=None)
def _compiled_kernel(spec: Sm100KernelSpec):
    """The launchable overload of ``spec``'s kernel (compiled on first use)."""
    from numba import cuda

    sig = kernel_signature()
    dispatcher = cuda.jit(make_kernel_function(spec), launch_bounds=(spec.threads, 1))
    dispatcher.compile(sig)
    return dispatcher.overloads[sig]


def _launch(spec: Sm100KernelSpec, plan: SmemPlan, num_ctas: int, args) -> None:
    """Cluster launch with > 48 KiB of dynamic shared memory (``docs/design/toolchain.md``,
    "Launching"; not run here)."""
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch
    from numba import cuda
    from numba.cuda.cudadrv import driver

    kernel = _compiled_kernel(spec)
    cufunc = kernel._codelibrary.get_cufunc()
    smem_bytes = launch_smem_bytes(plan)
    driver.driver.cuKernelSetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       smem_bytes, cufunc.handle, 0)
    stream = driver._to_core_stream(cuda.default_stream())   # what numba's own launches pass to cuda.core
    kernel_args, writeback = [], []
    for ty, value in zip(kernel.argument_types, args):
        kernel._prepare_args(ty, value, stream, writeback, kernel_args)
    cluster = (spec.cta_group, 1, 1) if spec.cta_group > 1 else None
    # With a cluster, cuda.core's grid counts clusters.
    config = LaunchConfig(grid=num_ctas // spec.cta_group, cluster=cluster, block=spec.threads,
                          shmem_size=smem_bytes)
    launch(stream, config, cufunc.kernel, *kernel_args)
    cuda.synchronize()
    for write in writeback:
        write()


def default_num_ctas(num_tiles: int, cta_group: int, sm_count: int) -> int:
    """One CTA per SM (whole pairs), never more pairs than tiles."""
    return max(1, min(num_tiles, sm_count // cta_group)) * cta_group


def grouped_matmul_sm100(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
                         num_ctas: int | None = None) -> np.ndarray:
    """Run the SM100 kernel; returns ``C`` (bf16, (total_tokens, N)).

    ``config``: a ``gbs.dispatch.KernelConfig`` (its knobs and stages) or a ``TileConfig`` (auto
    stages). ``out``: written in place if given (rows of skipped slots keep their contents);
    default a fresh poisoned array. ``num_ctas``: persistent grid, a multiple of ``cta_group``.
    Needs a compute capability 10.0 GPU (B200 / GB200): anywhere else a RuntimeError says so and
    names the backends to use instead.
    """
    from numba import cuda

    from gbs.numba_kernels.simt import check_out

    spec, stages = check_can_implement(problem, config)
    out = check_out(problem, out)
    shape = spec.tile_shape
    if num_ctas is not None:
        num_ctas = schedule.check_num_ctas(num_ctas, shape.cta_group)
    require_sm100()
    num_tiles = schedule.total_tiles(problem.a_offsets, problem.expert_ids, problem.n, shape)
    if num_tiles == 0:   # every slot skipped or empty: nothing to launch
        return out
    if num_ctas is None:
        num_ctas = default_num_ctas(num_tiles, spec.cta_group, cuda.get_current_device().MULTIPROCESSOR_COUNT)
    plan, _ = check_launch_plan(spec, stages)

    operands = [np.ascontiguousarray(problem.a).view(np.uint8),
                np.ascontiguousarray(problem.b).view(np.uint8),
                np.ascontiguousarray(problem.a_scales),
                np.ascontiguousarray(problem.b_scales)]
    device_operands = [cuda.to_device(x) for x in operands]
    out_bits = out.view(np.uint16)
    device_out = cuda.to_device(out_bits)
    addresses = [d.device_ctypes_pointer.value for d in device_operands] + [device_out.device_ctypes_pointer.value]
    maps = _encode_tensor_maps(tensor_map_specs(spec, ProblemShape.of(problem)), addresses)
    args = (cuda.to_device(maps), cuda.to_device(problem.a_offsets.astype(np.int64)),
            cuda.to_device(problem.a_scale_offsets.astype(np.int64)), cuda.to_device(problem.expert_ids),
            cuda.to_device(problem.expert_scales), device_out, problem.n, problem.k, num_tiles, stages)
    _launch(spec, plan, num_ctas, args)
    device_out.copy_to_host(out_bits)
    return out
