"""Launch helper shared by the inline-PTX kernels (H200 streaming kernel, and later the wgmma prefill
kernel and the SM100 kernel): device-resident problems, compiled overloads with more than 48 KiB of
dynamic shared memory, plain or cluster launches through cuda.core, tensor maps in device memory.

The recipes are the ones verified on the H200 (``../shared/spec/kernels.md``, "Toolchain recipes"):

* ``compile_kernel``: ``cuda.jit(..., launch_bounds=...)`` then ``compile(signature)`` gives the exact
  overload that runs; the dynamic shared-memory limit is raised on THAT overload with
  ``cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)`` (a ``specialize()``d
  dispatcher would be another kernel, still capped at 48 KiB).
* ``prepare_launch``: arguments are marshalled once by the overload's own ``_prepare_args`` (device
  arrays only: nothing is copied or written back), then every call is one ``cuda.core.launch`` with a
  ``LaunchConfig`` (with a cluster, cuda.core counts the grid in clusters): no host copies, no syncs. With
  ``pdl`` every call is a programmatic dependent launch (``LaunchConfig(programmatic_stream_serialization=True)``,
  cuda.core 1.2.0 or later): it may start while the kernel before it in the stream runs, so the kernel must
  execute ``griddepcontrol.wait`` before it touches memory that kernel may write (the H200 kernels do).
  ``check_launch`` is the ``can_implement``-style gate every prepared launch passes first (nothing it
  checks changes between calls of the same prepared launch): a grid that is not a whole number of
  clusters, an unsupported cluster size or more shared memory than a block may use is a
  ``ValueError`` with the reason, not a driver error or a silently wrong launch.
* ``device_tensor_maps``: 128-byte ``CUtensorMap`` images (from
  ``gbs.ptx_inline.copy.encode_tensor_map_2d/3d``) copied into one device buffer, 128 bytes apart
  (64-byte alignment is what the TMA needs); kernels take the buffer's address as a u64 and run
  ``fence.proxy.tensormap::generic.acquire`` before the first use of each map.
* ``to_device``: a ``gbs.problem.GroupedProblem`` (numpy, copied once) or any object with the same
  field names whose arrays expose ``__cuda_array_interface__`` (wrapped without a copy), as a small
  ``DeviceProblem`` that kernels read.

Everything here except ``device_tensor_maps``, ``to_device`` and the launch itself runs without a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gbs.dispatch import require_int
from gbs.ptx_inline.copy import TENSOR_MAP_BYTES
from gbs.problem import ProblemShape
from gbs.formats import BlockFormat, get_format
from gbs.layouts import LAYOUT_PACKED, stored_shape

# Device limits that do not depend on the model (CUDA programming guide, compute capability 9.0).
MAX_THREADS_PER_BLOCK = 1024
MAX_PORTABLE_CLUSTER_SIZE = 8
TMA_ADDRESS_ALIGN = 16                     # TMA global addresses and row strides: 16-byte multiples
# The LaunchConfig keyword of a programmatic dependent launch, and the cuda.core release that added it
PDL_LAUNCH_OPTION = "programmatic_stream_serialization"
PDL_MIN_CUDA_CORE = "1.2.0"

# Field names of a grouped problem and the dtypes kernels read them as (FP8, packed FP4 and bf16 tokens travel as
# raw bytes; the output is the bf16 bits as uint16).
PROBLEM_ARRAY_DTYPES = {
    "a": np.uint8,
    "b": np.uint8,
    "a_scales": np.uint8,
    "b_scales": np.uint8,
    "a_offsets": np.uint32,
    "a_scale_offsets": np.uint32,
    "expert_ids": np.int32,
    "expert_scales": np.float32,
}
PROBLEM_ARRAY_NDIM = {"a": 2, "b": 3, "a_scales": 5, "b_scales": 6, "a_offsets": 1, "a_scale_offsets": 1,
                      "expert_ids": 1, "expert_scales": 1}
# Reinterpretations allowed without a copy (same item size): ml_dtypes FP8 / bf16 are not numba dtypes.
_BYTE_VIEWS = {"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2", "int8", "uint8"}


class NoSuitableGPUError(RuntimeError):
    """No CUDA GPU of the compute capability a kernel is built for is visible to Numba."""


def gpu_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the current device, or None without a usable (non-simulated) GPU."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM or not cuda.is_available():
        return None
    return tuple(cuda.get_current_device().compute_capability)


def require_gpu(compute_capability: tuple[int, int], what: str) -> None:
    """Raise ``NoSuitableGPUError`` unless the current device has exactly ``compute_capability``
    (arch-specific targets such as sm_90a run on that architecture only)."""
    have = gpu_compute_capability()
    want = f"sm_{compute_capability[0]}{compute_capability[1]}"
    if have is None:
        raise NoSuitableGPUError(f"{what} needs an {want} GPU (e.g. an H200); no CUDA GPU is visible to Numba")
    if tuple(have) != tuple(compute_capability):
        raise NoSuitableGPUError(f"{what} needs an {want} GPU; the current device is "
                                 f"sm_{have[0]}{have[1]}")


# ----------------------------------------------------------------------------------------------
# Device-resident problems
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceProblem(ProblemShape):
    """A grouped 1D-1D problem whose arrays live on the device (numba device arrays).

    Same fields as ``gbs.problem.GroupedProblem`` (``a`` and ``b`` as raw bytes); the integers are host
    values. Only shapes and dtypes are checked here: the routing (``a_offsets``, ``expert_ids``) may
    be produced on the device by an earlier kernel, so kernels must not trust more than the shapes.
    """

    a_format: BlockFormat
    b_format: BlockFormat
    a: Any
    b: Any
    a_scales: Any
    b_scales: Any
    a_offsets: Any
    a_scale_offsets: Any
    expert_ids: Any
    expert_scales: Any
    num_active_experts: int
    estimated_total_m: int
    n: int
    k: int
    b_layout: str = LAYOUT_PACKED   # the bytes of b (``gbs.formats.OPERAND_LAYOUTS``)
    a_layout: str = LAYOUT_PACKED   # the bytes of a (the same)
    # host copies of the routing where the caller has them ({"a_offsets": ..., "expert_ids": ...}: a
    # GroupedProblem's arrays, or the copies a validated device problem kept), for the plans' tile estimates
    # (``h200_wgmma.tile_token_rows``); None: the plans assume groups of the average size
    host_routing: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    def arrays(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PROBLEM_ARRAY_DTYPES}


def device_view(name: str, value, host_hint: str):
    """A numba device array over ``value`` (no copy): a numba device array as it is, any other
    ``__cuda_array_interface__`` object wrapped. TypeError for a host array (``host_hint`` says what takes it) or
    anything else, ValueError unless C-contiguous."""
    from numba import cuda

    if isinstance(value, np.ndarray):
        raise TypeError(f"{name} is a host array: {host_hint}")
    if hasattr(value, "copy_to_host") and hasattr(value, "is_c_contiguous"):   # a numba device array
        arr = value
    elif hasattr(value, "__cuda_array_interface__"):
        arr = cuda.as_cuda_array(value)
    else:
        raise TypeError(f"{name} must be a GPU array (__cuda_array_interface__), got {type(value).__name__}")
    if not arr.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    return arr


def _as_device_array(name: str, value, stream):
    """A numba device array for ``value``: numpy arrays are copied, ``__cuda_array_interface__``
    objects are wrapped in place (no copy)."""
    from numba import cuda

    want = np.dtype(PROBLEM_ARRAY_DTYPES[name])
    if cuda.is_cuda_array(value):
        try:
            arr = cuda.as_cuda_array(value)
        except (TypeError, ValueError, NotImplementedError) as err:
            raise TypeError(f"{name}: cannot wrap its __cuda_array_interface__ ({err}); expose it as "
                            f"{want.name} (FP8 / FP4 bytes as uint8)") from None
        if arr.dtype != want:
            if arr.dtype.itemsize == want.itemsize and arr.dtype.kind in "iu" and want.kind in "iu":
                arr = arr.view(want)
            else:
                raise TypeError(f"{name} must have dtype {want.name} on the device, got {arr.dtype}")
        if not arr.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device")
        return arr
    if isinstance(value, np.ndarray):
        if value.dtype != want:
            if value.dtype.itemsize == want.itemsize and (value.dtype.name in _BYTE_VIEWS
                                                          or value.dtype.kind in "iu"):
                value = value.view(want)
            elif name == "a" and value.dtype.name == "bfloat16":   # bf16 tokens: their rows' bytes
                value = np.ascontiguousarray(value).view(want)
            else:
                raise TypeError(f"{name} must have dtype {want.name}, got {value.dtype}")
        return cuda.to_device(np.ascontiguousarray(value), stream=stream)
    raise TypeError(f"{name} must be a numpy array or expose __cuda_array_interface__, "
                    f"got {type(value).__name__}")


def _check_device_shapes(p: DeviceProblem) -> None:
    for name, ndim in PROBLEM_ARRAY_NDIM.items():
        if len(getattr(p, name).shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(getattr(p, name).shape)}")
    g, k, n = p.num_active_experts, p.k, p.n
    num_experts, total = p.b.shape[0], p.a.shape[0]
    want = {
        "a": (total, p.a_format.row_bytes(k)),
        "b": stored_shape(p.b_layout, p.b_format, (num_experts, n), k),
        "a_offsets": (g + 1,),
        "a_scale_offsets": (g,),
        "expert_ids": (g,),
        "expert_scales": (num_experts,),
        "b_scales": (num_experts, -(-n // 128), -(-p.b_format.scale_cols(k) // 4), 32, 4, 4),
    }
    for name, shape in want.items():
        if tuple(getattr(p, name).shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(getattr(p, name).shape)}")
    a_scales = tuple(p.a_scales.shape)
    if a_scales[1:] != (-(-p.a_format.scale_cols(k) // 4), 32, 4, 4):
        raise ValueError(f"a_scales must have shape (bands, {-(-p.a_format.scale_cols(k) // 4)}, 32, 4, 4), "
                         f"got {a_scales}")


def to_device(problem, *, stream=0) -> DeviceProblem:
    """``problem`` as a ``DeviceProblem``.

    ``problem``: a ``GroupedProblem`` (validated, its numpy arrays copied to the device once), or any
    object with the attributes ``a_format``, ``b_format`` (format names or ``BlockFormat``),
    ``num_active_experts``, ``estimated_total_m``, ``n``, ``k`` and the eight arrays of
    ``PROBLEM_ARRAY_DTYPES``, each a numpy array (copied) or a ``__cuda_array_interface__`` object
    (used in place: keep it alive while kernels read it). FP8 and FP4 bytes go as uint8.
    """
    from gbs.problem import GroupedProblem, check_layout, layout_of, problem_format_name

    if isinstance(problem, GroupedProblem):
        problem.validate()
    missing = [f.name for f in dataclasses.fields(DeviceProblem)
               if not hasattr(problem, f.name) and f.default is dataclasses.MISSING]
    if missing:
        raise TypeError(f"problem lacks {missing}: pass a GroupedProblem or an object with its fields")
    ints = {}
    for name in ("num_active_experts", "estimated_total_m", "n", "k"):
        value = getattr(problem, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        ints[name] = int(value)
    arrays = {name: _as_device_array(name, getattr(problem, name), stream) for name in PROBLEM_ARRAY_DTYPES}
    a_format, b_format = get_format(problem.a_format), get_format(problem.b_format)
    routing = getattr(problem, "host_routing", None)
    if routing is None and all(isinstance(getattr(problem, name), np.ndarray) for name in ("a_offsets", "expert_ids")):
        routing = {name: np.array(getattr(problem, name)) for name in ("a_offsets", "expert_ids")}
    device = DeviceProblem(a_format=a_format, b_format=b_format, **ints, **arrays, host_routing=routing,
                           b_layout=check_layout(layout_of(problem, "b"), b_format, "b"),
                           a_layout=check_layout(layout_of(problem, "a"), a_format, "a"))
    problem_format_name(device.a_format, device.b_format)   # ValueError for an unsupported pair
    _check_device_shapes(device)
    return device


def device_address(arr) -> int:
    """Device address of element 0 of a numba device array (or any ``__cuda_array_interface__``)."""
    return int(arr.__cuda_array_interface__["data"][0])


def device_tensor_maps(maps: Sequence[np.ndarray], *, stream=0):
    """Copy 128-byte tensor-map images into one device buffer, map i at byte ``128 * i``; returns the
    device array (pass ``device_address(buffer)`` to the kernel and keep the buffer alive)."""
    from numba import cuda

    images = [np.asarray(m, dtype=np.uint8).reshape(-1) for m in maps]
    for i, image in enumerate(images):
        if image.size != TENSOR_MAP_BYTES:
            raise ValueError(f"tensor map {i} has {image.size} bytes, expected {TENSOR_MAP_BYTES}")
    buffer = cuda.to_device(np.concatenate(images), stream=stream)
    if device_address(buffer) % 64:
        raise RuntimeError("tensor-map buffer is not 64-byte aligned")
    return buffer


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompiledKernel:
    """One compiled overload and the launch shape it was built for."""

    overload: Any            # numba _Kernel: the exact overload that runs
    threads: int             # threads per block (its launch bounds)
    dynamic_smem_bytes: int  # dynamic shared memory every launch requests (limit raised to this)
    cluster_size: int        # CTAs per cluster along x (1 = no cluster)
    name: str

    @property
    def registers(self) -> int:
        return self.overload.regs_per_thread

    @property
    def static_smem_bytes(self) -> int:
        return self.overload.shared_mem_per_block

    @property
    def local_bytes(self) -> int:
        return self.overload.local_mem_per_thread


def set_max_dynamic_shared_memory(overload, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory on exactly this compiled overload."""
    from cuda.bindings import driver as cu
    from numba.cuda.cudadrv.driver import driver

    cufunc = overload._codelibrary.get_cufunc()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)


def compile_kernel(pyfunc: Callable, signature, *, threads: int, dynamic_smem_bytes: int,
                   cluster_size: int = 1, name: str | None = None, min_blocks: int = 1) -> CompiledKernel:
    """JIT-compile ``pyfunc`` for the current GPU with launch bounds ``(threads, min_blocks)`` (ptxas
    fits the registers to ``min_blocks`` CTAs per SM) and raise its dynamic shared-memory limit to
    ``dynamic_smem_bytes``."""
    from numba import cuda

    if not 1 <= threads <= MAX_THREADS_PER_BLOCK or threads % 32:
        raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS_PER_BLOCK}], got {threads}")
    min_blocks = require_int("min_blocks", min_blocks, 1)
    overload = cuda.jit(pyfunc, launch_bounds=(threads, min_blocks)).compile(tuple(signature))
    # Always opt in: the 48 KiB default caps static + dynamic, so a kernel with exactly 48 KiB of
    # dynamic shared memory and any static bytes already needs it (seen on the H200: a launch with
    # 49152 B dynamic + 2048 B static failed with CUDA_ERROR_INVALID_VALUE).
    set_max_dynamic_shared_memory(overload, dynamic_smem_bytes)
    return CompiledKernel(overload, threads, int(dynamic_smem_bytes), int(cluster_size),
                          name or getattr(pyfunc, "__name__", "kernel"))


def device_smem_optin_limit() -> int:
    """Largest shared memory (dynamic + static) one block may use on the current device."""
    from numba import cuda

    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def check_launch(kernel: CompiledKernel, grid: int, *, smem_limit: int | None = None) -> None:
    """ValueError unless ``grid`` CTAs of ``kernel`` can launch as built: a positive whole number of
    clusters, a cluster size the hardware takes, and shared memory within ``smem_limit`` (the
    device's opt-in maximum when None and a GPU is present)."""
    if isinstance(grid, (bool, np.bool_)) or not isinstance(grid, (int, np.integer)) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")
    if not 1 <= kernel.cluster_size <= MAX_PORTABLE_CLUSTER_SIZE:
        raise ValueError(f"cluster size {kernel.cluster_size} is outside [1, {MAX_PORTABLE_CLUSTER_SIZE}]")
    if grid % kernel.cluster_size:
        raise ValueError(f"grid {grid} is not a multiple of the cluster size {kernel.cluster_size}")
    if smem_limit is None and gpu_compute_capability() is not None:
        smem_limit = device_smem_optin_limit()
    if smem_limit is not None:
        total = kernel.dynamic_smem_bytes + kernel.static_smem_bytes
        if total > smem_limit:
            raise ValueError(f"{kernel.name} needs {kernel.dynamic_smem_bytes} B dynamic + "
                             f"{kernel.static_smem_bytes} B static shared memory, more than the "
                             f"{smem_limit} B a block may use here")


def launch_config_fields(kernel: CompiledKernel, grid: int, *, pdl: bool = False) -> dict:
    """``cuda.core.LaunchConfig`` keywords for ``grid`` CTAs of ``kernel``. With a cluster, cuda.core
    counts the grid in CLUSTERS (its documented convention; verified on the H200, kernels.md). ``pdl``: a
    programmatic dependent launch (``PDL_LAUNCH_OPTION``)."""
    fields = {"block": (kernel.threads, 1, 1), "shmem_size": kernel.dynamic_smem_bytes}
    if pdl:
        fields[PDL_LAUNCH_OPTION] = True
    if kernel.cluster_size == 1:
        return dict(fields, grid=(grid, 1, 1))
    return dict(fields, grid=(grid // kernel.cluster_size, 1, 1), cluster=(kernel.cluster_size, 1, 1))


def make_launch_config(fields: dict):
    """``cuda.core.LaunchConfig(**fields)``; a RuntimeError naming the installed cuda.core where it lacks the
    programmatic-dependent-launch keyword ``fields`` asks for."""
    import cuda.core
    from cuda.core import LaunchConfig

    try:
        return LaunchConfig(**fields)
    except TypeError as err:
        if PDL_LAUNCH_OPTION not in fields or PDL_LAUNCH_OPTION not in str(err):
            raise
        version = getattr(cuda.core, "__version__", "of unknown version")
        raise RuntimeError(f"a programmatic dependent launch (pdl=True) needs cuda.core's LaunchConfig("
                           f"{PDL_LAUNCH_OPTION}=True), which cuda.core {PDL_MIN_CUDA_CORE} added; the installed "
                           f"cuda.core {version} lacks it ({err}): install cuda-core>={PDL_MIN_CUDA_CORE}, or plan "
                           "with pdl=False") from None


class PreparedLaunch:
    """A launch with its arguments marshalled once: calling it enqueues the kernel on ``stream`` (the
    one given at preparation unless overridden) and returns at once; no host copies, no syncs. With
    ``pdl`` every call is a programmatic dependent launch (module docstring).

    ``keepalive`` holds device buffers the arguments point into (tensor maps, problem arrays)."""

    def __init__(self, kernel: CompiledKernel, grid: int, args: Sequence, *, stream=0, keepalive=(),
                 pdl: bool = False):
        from numba.cuda.cudadrv import driver as nbdrv

        if not isinstance(pdl, (bool, np.bool_)):
            raise TypeError(f"pdl must be a bool, got {pdl!r}")
        check_launch(kernel, grid)
        overload = kernel.overload
        if len(args) != len(overload.argument_types):
            raise ValueError(f"{kernel.name} takes {len(overload.argument_types)} arguments, got {len(args)}")
        self.kernel = kernel
        self.grid = int(grid)
        self._stream = nbdrv._to_core_stream(stream)
        self._function = overload._codelibrary.get_cufunc().kernel
        writeback: list = []
        self._args: list = []
        for ty, value in zip(overload.argument_types, args):
            overload._prepare_args(ty, value, stream, writeback, self._args)
        if writeback:
            raise ValueError(f"{kernel.name}: every array argument must already be on the device "
                             "(a host array would be copied on each launch)")
        self.pdl = bool(pdl)
        self._config = make_launch_config(launch_config_fields(kernel, self.grid, pdl=self.pdl))
        self._keepalive = (tuple(args), tuple(keepalive))

    def __call__(self, stream=None) -> None:
        from cuda.core import launch
        from numba.cuda.cudadrv import driver as nbdrv

        target = self._stream if stream is None else nbdrv._to_core_stream(stream)
        launch(target, self._config, self._function, *self._args)


def prepare_launch(kernel: CompiledKernel, grid: int, args: Sequence, *, stream=0, keepalive=(),
                   pdl: bool = False) -> PreparedLaunch:
    """``PreparedLaunch(kernel, grid, args, ...)``: checked once here, then launched by calling it."""
    return PreparedLaunch(kernel, grid, args, stream=stream, keepalive=keepalive, pdl=pdl)
