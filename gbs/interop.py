"""Device arrays of the ecosystem through ``gbs.grouped_matmul``, without copies.

``device_problem(a, b, a_scales, b_scales, a_offsets, a_scale_offsets, expert_ids, expert_scales,
fmt=...)`` describes a grouped problem whose arrays already live on the GPU (same field names and
layouts as ``gbs.problem.GroupedProblem``); ``gbs.grouped_matmul`` runs it on the caller's memory and
returns the output as the same kind of array as ``a``.

Accepted arrays (detected lazily by type and module; torch and CuPy are never imported by gbs unless
the caller passes their arrays):

* PyTorch CUDA tensors (read through ``data_ptr()`` and ``is_contiguous()``, not
  ``__cuda_array_interface__``, so every dtype works, FP8 and ``float4_e2m1fn_x2`` included);
* CuPy arrays, Numba device arrays, and any object exposing ``__cuda_array_interface__`` (v3; masks
  are refused);
* DLPack-only CUDA exporters (``__dlpack__`` + ``__dlpack_device__``): numba-cuda 0.30.4 has no
  ``cuda.from_dlpack``, so they are read through ``cuda.core.utils.StridedMemoryView`` (the cuda.core
  numba-cuda runs on), also without a copy. The exporter is asked to order its work before the
  stream given to ``device_problem`` (default: the legacy default stream).

Host (numpy, CPU torch) arrays are refused: host problems are ``GroupedProblem``s, and nothing here
copies silently. Element types: ``a``, ``b``, ``a_scales``, ``b_scales``: any 1-byte type (uint8,
int8, FP8, packed FP4, E8M0: the raw bytes; the problem's formats say how to read them); W4A16's bf16
tokens ``a`` as they are (``torch.bfloat16``, or their bits as 2-byte integers: read as their bytes);
``a_offsets``, ``a_scale_offsets``, ``expert_ids``: 4-byte integers (int32 or uint32, read as the
kernels' uint32 / uint32 / int32); ``expert_scales``: float32. Every array must be C-contiguous and
16-byte aligned (the TMA's rule: allocations of torch / CuPy / Numba always are, offset views may not
be). Checked on construction, always and cheaply from the arrays' metadata: the above, the shapes
(``N``, ``K`` and the slot count come from ``b``, ``a`` and ``expert_ids``), the formats, one device.

Routing checks (offsets non-decreasing and within ``a``, ``a_scale_offsets`` consistent, expert ids
in ``[-1, num_experts)``, the band count of ``a_scales``) need the values: ``device_problem`` copies
``a_offsets``, ``a_scale_offsets`` and ``expert_ids`` (``12 * slots + 4`` bytes) to the host on the
stream, waits for it, and runs ``GroupedProblem.validate`` on them (with zero-byte stand-ins for the
big arrays); the checked copies stay with the problem (``host_routing``), and the wgmma kernel's plan
reads the group sizes from them (``gbs.plan.tile_token_rows``). ``validate=False`` skips that copy and
its synchronisation (CUDA-graph style hot paths, routing produced on the device): the kernel then trusts
the routing, bad offsets make it write out of bounds, and the plan sees only the average group.
``expert_scales`` values are never read on the host.

Backends: only the H200 kernels (``"h200_stream"``, ``"h200_wgmma"``; ``"auto"`` on an sm_90 GPU runs what
``gbs.plan.plan_h200`` decides) run device problems. ``"simt"`` and
``"sm100"`` copy host ``GroupedProblem``s to the device themselves: a ``NotImplementedError`` says so;
``"reference"`` computes on the host: a ``TypeError`` points to ``to_host(problem)``, the explicit copy
(every array, the whole weight stack included).

Outputs (``(total_tokens, N)``, bf16): torch in, a ``torch.bfloat16`` tensor on ``a``'s device out;
CuPy in, a CuPy ``uint16`` array of the bf16 bits (CuPy has no bf16: ``torch.as_tensor(out,
device="cuda").view(torch.bfloat16)``, or ``(out.astype(cupy.uint32) << 16).view(cupy.float32)`` for
float32 values); anything else (Numba, other ``__cuda_array_interface__`` or DLPack objects), a Numba
device array of ``uint16`` bf16 bits (``.copy_to_host().view(ml_dtypes.bfloat16)``). A new output is
uninitialised: rows of skipped (``-1``) slots are never written, so pass ``out`` (any accepted device
array: torch ``bfloat16`` or ``int16`` / ``uint16`` bits; not float16) when those rows are read; it is
written in place and returned.

Streams: the kernel is enqueued on the caller's current stream (``torch.cuda.current_stream()`` for
torch, ``cupy.cuda.get_current_stream()`` for CuPy), otherwise on the legacy default stream (handle
0); ``stream=`` overrides it (a handle, or an object with ``__cuda_stream__``, ``cuda_stream`` or
``ptr``). Inputs must be ready in that stream's order, as for any torch / CuPy operation (a new torch
/ CuPy output is allocated by that library on its current stream: with another ``stream=``, pass
``out``). The call is asynchronous: it returns once the kernel is enqueued. Host work per call: the
dispatch and the kernel's ``prepare`` (tensor maps encoded and copied to the device on the stream, any
workspace the config needs, a JIT compile the first time a kernel spec is seen); the routing copy
above happens in ``device_problem``. ``prepare`` here does all of it once and returns a
``DeviceLaunch`` whose calls only enqueue the kernel. No autograd: outputs are plain tensors.

Multi-GPU: the kernel runs on Numba's current device (``numba.cuda.select_device``); arrays whose
device is known (torch, CuPy, DLPack) must all be on it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .problem import (GroupedProblem, ProblemShape, is_int, check_k_blocks, check_layout, operand_shape,
                      problem_format_name, resolve_formats)
from .formats import BlockFormat, get_format
from .layouts import LAYOUT_PACKED, stored_shape, weight_bytes_layout

KINDS = ("torch", "cupy", "numba", "cuda_array_interface", "dlpack")
# The arrays the routing checks read (copied to the host when validating).
ROUTING_ARRAYS = ("a_offsets", "a_scale_offsets", "expert_ids")
OUTPUT_DTYPE = np.dtype(np.uint16)   # the kernels store bf16 bits
# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged); DLPack names CUDA's legacy default
# stream 1 (0 is not allowed for CUDA).
DLPACK_CUDA_DEVICE_TYPES = (2, 13)
DLPACK_LEGACY_DEFAULT_STREAM = 1
BF16_DTYPE_NAMES = ("torch.bfloat16", "bfloat16")


# ----------------------------------------------------------------------------------------------
# One device array
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """What the caller's object says about its memory, before any check."""

    owner: Any
    kind: str
    address: int
    shape: tuple[int, ...]
    item_kind: str        # numpy kind letter of the caller's element type: b, i, u, f, c, V
    itemsize: int
    source_dtype: str     # the caller's element type by name, for messages
    device_id: int | None
    readonly: bool
    contiguous: bool


# The caller's element types each kernel dtype accepts: (description, predicate over a _Layout).
_ELEMENT_RULES: dict[np.dtype, tuple[str, Callable[[_Layout], bool]]] = {
    np.dtype(np.uint8): ("1-byte elements (uint8, int8 or an FP8 / FP4 / E8M0 dtype: the raw bytes)",
                         lambda lay: lay.itemsize == 1 and lay.item_kind not in "bc"),
    np.dtype(np.uint32): ("4-byte integers (int32 or uint32)",
                          lambda lay: lay.itemsize == 4 and lay.item_kind in "iu"),
    np.dtype(np.int32): ("4-byte integers (int32 or uint32)",
                         lambda lay: lay.itemsize == 4 and lay.item_kind in "iu"),
    np.dtype(np.float32): ("float32", lambda lay: lay.itemsize == 4 and lay.item_kind == "f"),
    OUTPUT_DTYPE: ("bf16: torch.bfloat16, or its bits as uint16 / int16 (not float16)",
                   lambda lay: lay.itemsize == 2 and (lay.item_kind in "iu" or lay.source_dtype in BF16_DTYPE_NAMES)),
}


@dataclass(frozen=True, eq=False)
class DeviceArray:
    """One C-contiguous device array as the kernels read it: the caller's object (kept alive while
    this is) and its layout. ``__cuda_array_interface__`` exposes the same memory as ``dtype`` (the
    kernel's view, same item size as the caller's elements) with no stream: gbs orders its work by
    launching on the caller's stream, so wrapping it (``numba.cuda.as_cuda_array``) never syncs."""

    owner: Any = dataclasses.field(repr=False)   # repr would print (and copy) a tensor's values
    kind: str
    address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    source_dtype: str
    device_id: int | None
    readonly: bool

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "shape": self.shape, "typestr": self.dtype.str, "data": (self.address, self.readonly),
                "strides": None, "stream": None}


def array_kind(obj) -> str:
    """``"numpy"`` for host numpy arrays, else the kind of device array ``obj`` is, one of ``KINDS``
    (by its type's module and the protocols it exposes; torch and CuPy are not imported)."""
    if isinstance(obj, DeviceArray):
        return obj.kind
    root = type(obj).__module__.partition(".")[0]
    if root in ("torch", "cupy"):
        return root
    if isinstance(obj, np.ndarray):
        return "numpy"
    if hasattr(obj, "__cuda_array_interface__"):
        return "numba" if root == "numba" else "cuda_array_interface"
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"{type(obj).__module__}.{type(obj).__name__} is not an array gbs can read: pass a torch "
                    "CUDA tensor, a CuPy or Numba device array, an object with __cuda_array_interface__ or a "
                    "DLPack CUDA tensor (host numpy arrays go in a gbs.GroupedProblem)")


def _c_contiguous(shape: tuple[int, ...], byte_strides, itemsize: int) -> bool:
    if 0 in shape:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(tuple(byte_strides))):
        if extent != 1 and stride != expected:   # extent-1 dimensions may carry any stride
            return False
        expected *= extent
    return True


def _torch_layout(t, name: str) -> _Layout:
    if t.device.type != "cuda":
        raise TypeError(f"{name} is a torch tensor on {t.device}: device problems take CUDA tensors "
                        "(tensor.cuda()); host data goes in a gbs.GroupedProblem (tensor.numpy())")
    if str(t.layout) != "torch.strided":
        raise TypeError(f"{name} is a {t.layout} torch tensor; only dense (torch.strided) tensors are accepted")
    dtype = t.dtype
    if str(dtype) == "torch.bool":
        item_kind = "b"
    elif dtype.is_complex:
        item_kind = "c"
    elif dtype.is_floating_point:
        item_kind = "f"
    else:
        item_kind = "i" if dtype.is_signed else "u"
    return _Layout(t, "torch", int(t.data_ptr()), tuple(int(s) for s in t.shape), item_kind, int(t.element_size()),
                   str(dtype), t.device.index, False, bool(t.is_contiguous()))


def _cai_layout(obj, kind: str, name: str) -> _Layout:
    desc = obj.__cuda_array_interface__
    if desc.get("mask") is not None:
        raise TypeError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
    shape = tuple(int(s) for s in desc["shape"])
    dtype = np.dtype(desc["typestr"])
    if not dtype.isnative:
        raise TypeError(f"{name} has non-native byte order ({desc['typestr']!r})")
    address, readonly = desc["data"]
    strides = desc.get("strides")
    contiguous = strides is None or _c_contiguous(shape, strides, dtype.itemsize)
    device_id = int(obj.device.id) if kind == "cupy" else None
    return _Layout(obj, kind, int(address), shape, dtype.kind, dtype.itemsize, dtype.name, device_id, bool(readonly),
                   contiguous)


def _dlpack_layout(obj, name: str, dlpack_stream: int) -> _Layout:
    device_type, _ = obj.__dlpack_device__()
    if int(device_type) not in DLPACK_CUDA_DEVICE_TYPES:
        raise TypeError(f"{name} is a DLPack tensor on device type {int(device_type)}, not CUDA memory "
                        f"(types {DLPACK_CUDA_DEVICE_TYPES}); host data goes in a gbs.GroupedProblem")
    from cuda.core.utils import StridedMemoryView

    view = StridedMemoryView.from_dlpack(obj, stream_ptr=dlpack_stream)
    if not view.is_device_accessible:
        raise TypeError(f"{name}: its DLPack memory is not accessible from the GPU")
    dtype = np.dtype(view.dtype)
    shape = tuple(int(s) for s in view.shape)
    strides = view.strides   # in elements, or None when C-contiguous
    contiguous = strides is None or _c_contiguous(shape, [s * dtype.itemsize for s in strides], dtype.itemsize)
    # the view holds the DLPack capsule and the exporter: it is what keeps the memory alive
    return _Layout(view, "dlpack", int(view.ptr), shape, dtype.kind, dtype.itemsize, dtype.name, int(view.device_id),
                   bool(view.readonly), contiguous)


def _layout(obj, name: str, dlpack_stream: int) -> _Layout:
    kind = array_kind(obj)
    if kind == "numpy":
        raise TypeError(f"{name} is a host numpy array: device problems take device arrays only (nothing is "
                        "copied implicitly); put host arrays in a gbs.GroupedProblem")
    if kind == "torch":
        return _torch_layout(obj, name)
    if kind == "dlpack":
        return _dlpack_layout(obj, name, dlpack_stream)
    return _cai_layout(obj, kind, name)


def device_array(obj, dtype, *, name: str = "array", align: int | None = None,
                 dlpack_stream: int = DLPACK_LEGACY_DEFAULT_STREAM) -> DeviceArray:
    """``obj`` (any accepted device array) as a ``DeviceArray`` read as ``dtype`` (a key of
    ``_ELEMENT_RULES``: the item size must match and the caller's element type be one that dtype
    accepts). C-contiguous, ``align``-byte aligned (default: the item size). No copy; TypeError /
    ValueError naming ``name`` and what is allowed."""
    dtype = np.dtype(dtype)
    description, accepts = _ELEMENT_RULES[dtype]
    if isinstance(obj, DeviceArray):
        if obj.dtype != dtype:
            raise TypeError(f"{name} is a DeviceArray read as {obj.dtype}; it must be read as {dtype}")
        layout = _Layout(obj.owner, obj.kind, obj.address, obj.shape, obj.dtype.kind, obj.dtype.itemsize,
                         obj.source_dtype, obj.device_id, obj.readonly, True)
    else:
        layout = _layout(obj, name, dlpack_stream)
    if not accepts(layout):
        raise TypeError(f"{name} must hold {description}; got {layout.source_dtype}")
    if not layout.contiguous:
        raise ValueError(f"{name} must be C-contiguous on the device (e.g. .contiguous() / cupy.ascontiguousarray)")
    align = dtype.itemsize if align is None else align
    if 0 not in layout.shape and layout.address % align:
        raise ValueError(f"{name} must be {align}-byte aligned on the device, its address is {layout.address:#x} "
                         "(an offset view of a larger allocation?)")
    return DeviceArray(layout.owner, layout.kind, layout.address, layout.shape, dtype, layout.source_dtype,
                       layout.device_id, layout.readonly)


def problem_array(obj, name: str, *, dlpack_stream: int = DLPACK_LEGACY_DEFAULT_STREAM) -> DeviceArray:
    """``device_array`` for the problem field ``name``: read as the kernels read it
    (``launch.PROBLEM_ARRAY_DTYPES``), aligned for the TMA (``launch.TMA_ADDRESS_ALIGN``); the tokens ``a`` as their
    bytes (``token_bytes``)."""
    from .numba_kernels import launch

    if name == "a" and not isinstance(obj, DeviceArray):
        obj = token_bytes(_layout(obj, name, dlpack_stream))
    return device_array(obj, launch.PROBLEM_ARRAY_DTYPES[name], name=name, align=launch.TMA_ADDRESS_ALIGN,
                        dlpack_stream=dlpack_stream)


def token_bytes(layout: _Layout) -> DeviceArray:
    """The tokens ``a`` as a ``DeviceArray`` of their bytes: 1-byte elements as they are, bf16 tokens (W4A16:
    ``torch.bfloat16``, or their bits as 2-byte integers) two bytes per element, ``(total_tokens, 2K)``. No copy."""
    description, one_byte = _ELEMENT_RULES[np.dtype(np.uint8)]
    _, bf16 = _ELEMENT_RULES[OUTPUT_DTYPE]
    if not (one_byte(layout) or bf16(layout)):
        raise TypeError(f"a must hold {description}, or bf16 tokens (W4A16: torch.bfloat16, or their bits as 2-byte "
                        f"integers); got {layout.source_dtype}")
    if not layout.contiguous:
        raise ValueError("a must be C-contiguous on the device (e.g. .contiguous() / cupy.ascontiguousarray)")
    shape = (*layout.shape[:-1], layout.shape[-1] * layout.itemsize) if layout.shape else layout.shape
    return DeviceArray(layout.owner, layout.kind, layout.address, shape, np.dtype(np.uint8), layout.source_dtype,
                       layout.device_id, layout.readonly)


# ----------------------------------------------------------------------------------------------
# Streams and copies
# ----------------------------------------------------------------------------------------------
def stream_handle(stream) -> int:
    """The CUDA stream handle of ``stream``: an int, or an object with ``__cuda_stream__`` (cuda.core,
    Numba), ``cuda_stream`` (torch) or ``ptr`` (CuPy)."""
    if isinstance(stream, (bool, np.bool_)):
        raise TypeError(f"stream must be a stream handle or a stream object, got {stream!r}")
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        _, handle = stream.__cuda_stream__()
        return int(handle)
    for attribute in ("cuda_stream", "ptr"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise TypeError(f"stream must be an int handle or a stream object (__cuda_stream__, .cuda_stream as torch, "
                    f".ptr as CuPy), got {type(stream).__name__}")


def caller_stream(kind: str, device_id: int | None = None) -> int:
    """The stream handle work on arrays of ``kind`` goes to by default: torch's or CuPy's current
    stream; 0 (the legacy default stream) for everything else."""
    if kind == "torch":
        import torch

        return int(torch.cuda.current_stream(device_id).cuda_stream)
    if kind == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def numba_stream(handle: int):
    """A Numba stream for ``handle`` (0 stays 0: Numba's name for the legacy default stream)."""
    if not handle:
        return 0
    from numba import cuda

    return cuda.external_stream(handle)


def copy_to_host(array: DeviceArray, stream: int = 0) -> np.ndarray:
    """A host copy of ``array`` (as ``array.dtype``), made on ``stream`` and waited for."""
    from numba import cuda

    nb_stream = numba_stream(stream)
    host = cuda.as_cuda_array(array).copy_to_host(stream=nb_stream)
    if nb_stream:
        nb_stream.synchronize()
    return host


# ----------------------------------------------------------------------------------------------
# The device problem
# ----------------------------------------------------------------------------------------------
def _host_operand_dtype(fmt: BlockFormat) -> np.dtype:
    """The dtype a ``GroupedProblem`` holds an operand of ``fmt`` in (FP4 as packed bytes)."""
    return np.dtype(np.uint8) if fmt.packed else np.dtype(fmt.element_dtype)


@dataclass(frozen=True, eq=False)
class DeviceGroupedProblem(ProblemShape):
    """A grouped 1D-1D block-scaled problem whose arrays live on the GPU: the fields and layouts of
    ``gbs.problem.GroupedProblem``; the integers are host values (the dispatch reads only them).

    Build it with ``device_problem(...)`` (derives ``n``, ``k``, ``num_active_experts`` and validates
    the routing by default). Constructed directly, the arrays may be any accepted device arrays (they
    become ``DeviceArray``s) and only the cheap checks run; ``validate_routing()`` adds the rest.
    """

    a_format: BlockFormat
    b_format: BlockFormat
    a: DeviceArray
    b: DeviceArray
    a_scales: DeviceArray
    b_scales: DeviceArray
    a_offsets: DeviceArray
    a_scale_offsets: DeviceArray
    expert_ids: DeviceArray
    expert_scales: DeviceArray
    num_active_experts: int
    estimated_total_m: int
    n: int
    k: int
    b_layout: str = LAYOUT_PACKED   # the bytes of b (``gbs.formats.OPERAND_LAYOUTS``; re-lay on the host, once)
    a_layout: str = LAYOUT_PACKED   # the bytes of a (the same; written so by the tokens' quantizer)
    # not a field: the routing arrays' host copies ``validate_routing`` checked (``ROUTING_ARRAYS`` -> numpy
    # arrays in the kernels' dtypes), which the H200 plans may read (``gbs.plan.tile_token_rows``); None
    # until then. A launch prepared from them keeps its plan if the device routing changes later: only
    # the choice of tile can be stale, never the result.
    host_routing = None

    def __post_init__(self):
        for name in ("a_format", "b_format"):
            object.__setattr__(self, name, get_format(getattr(self, name)))
        problem_format_name(self.a_format, self.b_format)   # ValueError for an unsupported pair
        check_layout(self.b_layout, self.b_format, "b")
        check_layout(self.a_layout, self.a_format, "a")
        for name in ("num_active_experts", "estimated_total_m", "n", "k"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.n <= 0 or self.k <= 0:
            raise ValueError(f"N and K must be positive, got N={self.n}, K={self.k}")
        check_layout(self.b_layout, self.b_format, "b", stored_shape(self.b_layout, self.b_format, (self.n,), self.k))
        if self.num_active_experts < 1:
            raise ValueError(f"num_active_experts must be >= 1, got {self.num_active_experts}")
        if self.estimated_total_m < 0:
            raise ValueError(f"estimated_total_m must be >= 0, got {self.estimated_total_m}")
        check_k_blocks(self.k, self.a_format, self.b_format)
        from .numba_kernels import launch

        for name in launch.PROBLEM_ARRAY_DTYPES:
            object.__setattr__(self, name, problem_array(getattr(self, name), name))
        devices = {name: arr.device_id for name, arr in self.arrays().items() if arr.device_id is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"the arrays live on different GPUs: {devices}")
        launch._check_device_shapes(self.launch_view())

    # -- derived -------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """The kind of ``a``: what ``grouped_matmul`` returns (see the module docstring)."""
        return self.a.kind

    @property
    def device_id(self) -> int | None:
        """The GPU the arrays live on, where their kind says (torch, CuPy, DLPack), else None."""
        return next((arr.device_id for arr in self.arrays().values() if arr.device_id is not None), None)

    def arrays(self) -> dict[str, DeviceArray]:
        from .numba_kernels import launch

        return {name: getattr(self, name) for name in launch.PROBLEM_ARRAY_DTYPES}

    def launch_view(self):
        """This problem as a ``launch.DeviceProblem`` over the ``DeviceArray``s: what the kernels'
        host-side checks take (shapes only, no device access)."""
        from .numba_kernels import launch

        return launch.DeviceProblem(**{f.name: getattr(self, f.name) for f in dataclasses.fields(launch.DeviceProblem)})

    # -- routing -------------------------------------------------------------------------------
    def check_routing(self, a_offsets: np.ndarray, a_scale_offsets: np.ndarray, expert_ids: np.ndarray) -> None:
        """``GroupedProblem.validate`` on host copies of the routing arrays (as the kernels read them:
        uint32, uint32, int32) with zero-byte stand-ins of this problem's shapes for the rest;
        ValueError / TypeError as there."""
        def stand_in(name: str, dtype, shape=None) -> np.ndarray:
            return np.broadcast_to(np.zeros((), dtype), getattr(self, name).shape if shape is None else shape)

        # fused weights stand in as their weight bytes alone: the scale copy's check would read every byte
        b_layout = weight_bytes_layout(self.b_layout)
        b_shape = (self.num_experts, self.n, self.b_format.row_bytes(self.k))
        a_shape = operand_shape(self.a_format, (self.total_tokens,), self.k)   # bf16: K elements of the 2K bytes
        GroupedProblem(
            a_format=self.a_format, b_format=self.b_format,
            a=stand_in("a", _host_operand_dtype(self.a_format), a_shape),
            b=stand_in("b", _host_operand_dtype(self.b_format), b_shape),
            a_scales=stand_in("a_scales", np.uint8), b_scales=stand_in("b_scales", np.uint8),
            a_offsets=np.asarray(a_offsets), a_scale_offsets=np.asarray(a_scale_offsets),
            expert_ids=np.asarray(expert_ids), expert_scales=stand_in("expert_scales", np.float32),
            num_active_experts=self.num_active_experts, estimated_total_m=self.estimated_total_m, n=self.n, k=self.k,
            b_layout=b_layout, a_layout=self.a_layout)

    def validate_routing(self, stream=None) -> None:
        """Copy ``ROUTING_ARRAYS`` to the host on ``stream`` (default: the caller's current stream of
        this problem's kind), wait for them, ``check_routing``, and keep them as ``host_routing``."""
        handle = self.stream_for(stream)
        routing = {name: copy_to_host(getattr(self, name), handle) for name in ROUTING_ARRAYS}
        self.check_routing(**routing)
        object.__setattr__(self, "host_routing", routing)

    def stream_for(self, stream=None) -> int:
        """The stream handle work on this problem goes to: ``stream`` if given, else ``caller_stream``."""
        return caller_stream(self.kind, self.device_id) if stream is None else stream_handle(stream)


def device_problem(a, b, a_scales, b_scales, a_offsets, a_scale_offsets, expert_ids, expert_scales, *,
                   fmt: str = "nvfp4", estimated_total_m: int | None = None, validate: bool = True,
                   stream=None, b_layout: str = LAYOUT_PACKED,
                   a_layout: str = LAYOUT_PACKED) -> DeviceGroupedProblem:
    """A ``DeviceGroupedProblem`` over the caller's device arrays (no copies of them).

    Shapes as in ``GroupedProblem``: ``a`` (total_tokens, K bytes), ``b`` (num_experts, N, K bytes),
    ``a_scales`` (bands, ceil(K/block/4), 32, 4, 4), ``b_scales`` (num_experts, ceil(N/128),
    ceil(K/block/4), 32, 4, 4), ``a_offsets`` (slots + 1,), ``a_scale_offsets`` / ``expert_ids``
    (slots,), ``expert_scales`` (num_experts,). ``fmt``: a name of ``gbs.problem.PROBLEM_FORMATS``.
    ``estimated_total_m``: the dispatch's token estimate (default: the token count of ``a``).
    ``validate``: copy the routing arrays to the host and check them (see the module docstring).
    ``stream``: the stream the routing copy and DLPack exports are ordered on (default: the caller's
    current stream for torch / CuPy, else the legacy default stream). ``b_layout``: the byte layout of
    ``b`` and ``b_scales`` (``gbs.formats.OPERAND_LAYOUTS``: FP4 weights re-laid once with
    ``gbs.formats.E2M1H200Order.swizzle``, NVFP4's UE4M3 scales with ``E2M1H200Order.encode_scales``, e.g. by
    ``GroupedProblem.with_b_layout``, decode faster on the H200 kernels). ``a_layout``: the byte layout of
    ``a`` and ``a_scales`` (the same layouts: FP4 tokens written in ``E2M1H200Order`` by their quantizer, or
    re-laid on the GPU by ``gbs.numba_kernels.relayout``, decode faster too). The tag is not checked against
    the bytes: NVFP4 scales in the wrong encoding give wrong numbers. Tiled and fused weights are stored padded to
    whole boxes (``gbs.layouts.stored_shape``). Where K is not a multiple of 4 blocks the atoms' padding columns
    must hold finite scales (zeros, as ``gbs.formats.swizzle_scales`` writes): the kernels multiply the zeros past
    K by them, and a NaN there makes its row NaN (host problems check it; device bytes are not read).
    """
    a_format, b_format = resolve_formats(fmt)
    given = None if stream is None else stream_handle(stream)
    arrays = {"a": problem_array(a, "a", dlpack_stream=given or DLPACK_LEGACY_DEFAULT_STREAM)}
    handle = caller_stream(arrays["a"].kind, arrays["a"].device_id) if given is None else given
    others = {"b": b, "a_scales": a_scales, "b_scales": b_scales, "a_offsets": a_offsets,
              "a_scale_offsets": a_scale_offsets, "expert_ids": expert_ids, "expert_scales": expert_scales}
    for name, value in others.items():
        arrays[name] = problem_array(value, name, dlpack_stream=handle or DLPACK_LEGACY_DEFAULT_STREAM)
    for name, ndim in (("a", 2), ("b", 3), ("expert_ids", 1)):
        if len(arrays[name].shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {arrays[name].shape}")
    total_tokens, row_bytes = arrays["a"].shape
    problem = DeviceGroupedProblem(
        a_format=a_format, b_format=b_format, **arrays, num_active_experts=arrays["expert_ids"].shape[0],
        estimated_total_m=total_tokens if estimated_total_m is None else estimated_total_m,
        n=arrays["b"].shape[1], k=row_bytes * 8 // a_format.element_bits, b_layout=b_layout, a_layout=a_layout)
    if validate:
        problem.validate_routing(handle)
    return problem


def to_host(problem: DeviceGroupedProblem, stream=None) -> GroupedProblem:
    """The explicit copy: every array of ``problem`` copied to the host on ``stream`` (default: the
    caller's current stream), as a validated ``GroupedProblem`` (for the reference backend, the
    host-only backends, debugging). It copies the whole weight stack."""
    if not isinstance(problem, DeviceGroupedProblem):
        raise TypeError(f"to_host takes a DeviceGroupedProblem, got {type(problem).__name__}")
    handle = problem.stream_for(stream)
    host = {name: copy_to_host(arr, handle) for name, arr in problem.arrays().items()}
    host["a"] = host["a"].view(_host_operand_dtype(problem.a_format))
    host["b"] = host["b"].view(_host_operand_dtype(problem.b_format))
    return GroupedProblem(a_format=problem.a_format, b_format=problem.b_format, **host,
                          num_active_experts=problem.num_active_experts,
                          estimated_total_m=problem.estimated_total_m, n=problem.n, k=problem.k,
                          b_layout=problem.b_layout, a_layout=problem.a_layout)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
def _new_output(problem: DeviceGroupedProblem, nb_stream):
    """An uninitialised (total_tokens, N) output of the problem's kind (module docstring)."""
    shape = (problem.total_tokens, problem.n)
    if problem.kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch.bfloat16, device=problem.a.owner.device)
    if problem.kind == "cupy":
        import cupy

        with cupy.cuda.Device(problem.device_id):
            return cupy.empty(shape, dtype=cupy.uint16)
    from numba import cuda

    return cuda.device_array(shape, dtype=OUTPUT_DTYPE, stream=nb_stream)


def _output_array(problem: DeviceGroupedProblem, out, dlpack_stream: int) -> DeviceArray:
    arr = device_array(out, OUTPUT_DTYPE, name="out", dlpack_stream=dlpack_stream)
    shape = (problem.total_tokens, problem.n)
    if arr.shape != shape:
        raise ValueError(f"out must have shape {shape} (total_tokens, N), got {arr.shape}")
    if arr.readonly:
        raise ValueError("out is read-only")
    if None not in (arr.device_id, problem.device_id) and arr.device_id != problem.device_id:
        raise ValueError(f"out lives on GPU {arr.device_id}, the problem on GPU {problem.device_id}")
    return arr


@dataclass(eq=False)
class DeviceLaunch:
    """A grouped matmul bound to device arrays and an output: calling it enqueues the kernel on
    ``stream`` and returns at once (no copies, no syncs); ``out`` holds the result in stream order."""

    problem: DeviceGroupedProblem
    out: Any             # what grouped_matmul returns: the caller's ``out`` or a new array of the problem's kind
    stream: int          # the CUDA stream handle the kernel is enqueued on (0: the legacy default stream)
    kernel_problem: Any  # launch.DeviceProblem: Numba views of the caller's memory, what the kernel reads
    kernel_out: Any      # the Numba view of ``out`` the kernel writes
    h200_launch: Any     # h200_launch.H200Launch: the plan, bound to these arrays

    @property
    def plan(self):
        """The ``gbs.plan.H200Plan`` this launch runs."""
        return self.h200_launch.plan

    def __call__(self) -> None:
        self.h200_launch()

    def kernel_addresses(self) -> dict[str, int]:
        """Device address of every array the kernel reads and of ``out``, by field name."""
        from .numba_kernels import launch

        addresses = {name: launch.device_address(arr) for name, arr in self.kernel_problem.arrays().items()}
        return dict(addresses, out=launch.device_address(self.kernel_out))


def prepare(problem: DeviceGroupedProblem, config=None, out=None, *, stream=None, backend: str = "auto",
            pdl: bool = False) -> DeviceLaunch:
    """Everything ``grouped_matmul`` does for a device problem except the launch: the config (the
    dispatch's from host metadata unless given), the backend, the checks, the output, the stream,
    the tensor maps, the compile. Call the result to enqueue the kernel; call it again to rerun on
    the same arrays (their current contents). ``pdl``: every call a programmatic dependent launch
    (``gbs.plan.plan_h200``'s knob): it may start while the kernel before it in the stream (the one
    that writes the tokens, say) still runs, and waits for it before reading anything."""
    from .backends import check_device_backend
    from .plan import plan_h200

    if not isinstance(problem, DeviceGroupedProblem):
        raise TypeError(f"problem must be a DeviceGroupedProblem (gbs.interop.device_problem), "
                        f"got {type(problem).__name__}")
    check_device_backend(backend)
    plan = plan_h200(problem, config, backend, pdl=pdl)   # before any device work: "auto" lets the plan pick the kernel
    from .numba_kernels import h200_launch, launch

    handle = problem.stream_for(stream)
    dlpack_stream = handle or DLPACK_LEGACY_DEFAULT_STREAM
    out_array = None if out is None else _output_array(problem, out, dlpack_stream)
    launch.require_gpu(h200_launch.SM90, f"the H200 kernel ({plan.kernel})")
    from numba import cuda

    current = cuda.get_current_device().id
    if problem.device_id is not None and problem.device_id != current:
        raise ValueError(f"the arrays live on GPU {problem.device_id} but Numba's current device is {current}: "
                         f"numba.cuda.select_device({problem.device_id}) first")
    nb_stream = numba_stream(handle)
    if out is None:
        out = _new_output(problem, nb_stream)
        out_array = _output_array(problem, out, dlpack_stream)
    kernel_problem = launch.to_device(problem)   # wraps the DeviceArrays: no copy, no sync
    prepared = h200_launch.prepare(kernel_problem, plan, out_array, stream=nb_stream)
    return DeviceLaunch(problem, out, handle, kernel_problem, prepared.out, prepared)
