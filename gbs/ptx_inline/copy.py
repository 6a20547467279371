"""Asynchronous and streaming copies: cp.async (LDGSTS), TMA tensor loads/stores, the 16-byte
non-coherent global load, and the host-side tensor-map encoder.

Device intrinsics (sm_90a and sm_100a unless noted):
- shared-memory operands are 32-bit shared-window addresses (``common.shared_address``);
  global operands are 64-bit generic addresses (``common.generic_address`` + byte offset);
- a tensor map is 128 bytes in GLOBAL memory (a device array made from
  ``encode_tensor_map_2d/3d``), 64-byte aligned, passed as its u64 address: Numba cannot declare a
  ``__grid_constant__`` CUtensorMap parameter. The map is read through the tensormap proxy, so
  before its first use the issuing thread runs ``fence_proxy_tensormap_acquire_sys`` (map written
  by a host memcpy) or ``..._gpu`` (map written by an earlier kernel), then optionally
  ``prefetch_tensormap``;
- TMA coordinates are signed 32-bit element indices, innermost dimension first (``c0`` is the
  contiguous one), and may lie partly or wholly outside the tensor: those elements are filled
  with zeros and still count towards the mbarrier's transaction bytes;
- TMA destinations and sources in shared memory: 128-byte aligned, 1024-byte aligned with
  128B swizzle (the swizzle pattern is a function of the shared address bits 4-9).

Host: ``encode_tensor_map_2d/3d`` call ``cuTensorMapEncodeTiled`` through cuda.bindings (imported
when called: the argument checks run without a GPU, the encoding needs the NVIDIA driver).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import I32, I64, asm, struct_to_tuple, void_intrinsic
from .common import ptx_intrinsic

# ---------------------------------------------------------------------------------------------
# cp.async (sm_80+): 16-byte global -> shared copies, tracked per thread in commit groups
# ---------------------------------------------------------------------------------------------
_CP_ASYNC_BYTES = 16

cp_async_ca_16 = ptx_intrinsic(
    "cp_async_ca_16", f"cp.async.ca.shared.global [$0], [$1], {_CP_ASYNC_BYTES};",
    [("dst_smem", "u32"), ("src_global", "u64")],
    doc="""Start a 16-byte copy global -> shared, caching in L1 and L2 (``.ca``).

Both addresses 16-byte aligned. Completion is tracked by ``cp_async_commit_group`` +
``cp_async_wait_group(n)`` / ``cp_async_wait_all`` in the issuing thread; other threads see the
data only after that wait and a barrier.""")

cp_async_cg_16 = ptx_intrinsic(
    "cp_async_cg_16", f"cp.async.cg.shared.global [$0], [$1], {_CP_ASYNC_BYTES};",
    [("dst_smem", "u32"), ("src_global", "u64")],
    doc="""Start a 16-byte copy global -> shared, caching in L2 only (``.cg``, bypasses L1).

The usual choice for streamed operands; same rules as ``cp_async_ca_16``.""")

cp_async_commit_group = void_intrinsic(
    "cp.async.commit_group;",
    "Close the calling thread's pending cp.async copies into one group.")

cp_async_wait_all = void_intrinsic(
    "cp.async.wait_all;",
    "Wait until all of the calling thread's cp.async copies (committed or not) have completed.")


@functools.cache
def cp_async_wait_group(pending: int):
    """Intrinsic ``cp.async.wait_group pending;``: wait until at most ``pending`` of the calling
    thread's most recent commit groups are still in flight (``pending`` is a literal >= 0).

    Bind the result to a module-level name and call that inside kernels.
    """
    if not isinstance(pending, int) or pending < 0:
        raise ValueError(f"cp_async_wait_group: pending must be an int >= 0, got {pending!r}")
    return void_intrinsic(f"cp.async.wait_group {pending};",
                          f"Wait until at most {pending} cp.async commit groups are pending.")


# ---------------------------------------------------------------------------------------------
# TMA (cp.async.bulk.tensor, sm_90+)
# ---------------------------------------------------------------------------------------------
_TMA_LOAD = "cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
_COORD_NAMES = ("c0", "c1", "c2")


def _tma_load(rank: int, multicast: bool):
    coords = [(name, "s32") for name in _COORD_NAMES[:rank]]
    operands = [("dst_smem", "u32"), ("tensor_map", "u64")] + coords + [("mbar", "u32")]
    coord_text = ", ".join(f"${i + 2}" for i in range(rank))
    text = _TMA_LOAD.format(rank=rank)
    if multicast:
        operands.append(("cta_mask", "u16"))
        text += f".multicast::cluster [$0], [$1, {{{coord_text}}}], [${rank + 2}], ${rank + 3};"
        what = (f"Load one {rank}-D box into the shared memory of every CTA of the cluster named by "
                f"``cta_mask`` (bit r = CTA rank r), at the same CTA-relative offset ``dst_smem``; each "
                f"destination CTA's mbarrier at the CTA-relative offset ``mbar`` receives the box's "
                f"bytes as complete_tx, so every receiving CTA announces them with its own expect_tx.")
        name = f"tma_load_{rank}d_multicast"
    else:
        text += f" [$0], [$1, {{{coord_text}}}], [${rank + 2}];"
        what = (f"Load one {rank}-D box of the tensor map at ``tensor_map`` into shared memory at "
                f"``dst_smem``; completion: the box's byte count arrives as complete_tx on the "
                f"mbarrier at ``mbar`` (announce it first with ``mbarrier_arrive_expect_tx``).")
        name = f"tma_load_{rank}d"
    doc = what + " Coordinates ``c0..`` are s32 element indices, innermost first. Issue from one thread."
    return ptx_intrinsic(name, text, operands, doc=doc)


tma_load_2d = _tma_load(2, multicast=False)
tma_load_3d = _tma_load(3, multicast=False)
tma_load_2d_multicast = _tma_load(2, multicast=True)
tma_load_3d_multicast = _tma_load(3, multicast=True)

tma_store_2d = ptx_intrinsic(
    "tma_store_2d", "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$0, {$1, $2}], [$3];",
    [("tensor_map", "u64"), ("c0", "s32"), ("c1", "s32"), ("src_smem", "u32")],
    doc="""Store the 2-D box at ``src_smem`` to the tensor at box coordinates (c0, c1).

Elements outside the tensor are not written (the TMA clips the box). The shared-memory writes
that produced the box must be fenced with ``fence_proxy_async_shared_cta`` and a barrier first.
Tracked per thread by ``bulk_commit_group`` + ``bulk_wait_group_read(n)``.""")

bulk_commit_group = void_intrinsic(
    "cp.async.bulk.commit_group;",
    "Close the calling thread's pending bulk (TMA store) operations into one bulk group.")


@functools.cache
def bulk_wait_group_read(pending: int):
    """Intrinsic ``cp.async.bulk.wait_group.read pending;``: wait until at most ``pending`` bulk
    groups of the calling thread still READ their shared-memory source (the buffers of the others
    may be overwritten; their global writes may still be in flight). ``pending`` literal >= 0."""
    if not isinstance(pending, int) or pending < 0:
        raise ValueError(f"bulk_wait_group_read: pending must be an int >= 0, got {pending!r}")
    return void_intrinsic(f"cp.async.bulk.wait_group.read {pending};",
                          f"Wait until at most {pending} bulk groups still read shared memory.")


bulk_wait_group_read_0 = bulk_wait_group_read(0)

prefetch_tensormap = ptx_intrinsic(
    "prefetch_tensormap", "prefetch.tensormap [$0];", [("tensor_map", "u64")],
    doc="Bring the tensor map at generic address ``tensor_map`` into the TMA unit's descriptor cache.")

_FENCE_TENSORMAP_DOC = """Acquire the 128-byte tensor map at ``tensor_map`` for the tensormap proxy at
{scope} scope, in the thread that then issues TMA operations with it. Needed because the map
was written through the generic proxy; {when}"""

fence_proxy_tensormap_acquire_gpu = ptx_intrinsic(
    "fence_proxy_tensormap_acquire_gpu",
    "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", [("tensor_map", "u64")],
    doc=_FENCE_TENSORMAP_DOC.format(
        scope="GPU", when="this scope covers maps written on the device (by an earlier kernel)."))

fence_proxy_tensormap_acquire_sys = ptx_intrinsic(
    "fence_proxy_tensormap_acquire_sys",
    "fence.proxy.tensormap::generic.acquire.sys [$0], 128;", [("tensor_map", "u64")],
    doc=_FENCE_TENSORMAP_DOC.format(
        scope="system", when="the CUDA programming guide uses this scope for maps copied in by a "
                             "host memcpy (the way ``encode_tensor_map_*`` maps arrive)."))

# ---------------------------------------------------------------------------------------------
# Streaming 16-byte load
# ---------------------------------------------------------------------------------------------
_U32X4 = types.UniTuple(types.uint32, 4)
_U32X4_STRUCT = ir.LiteralStructType([I32] * 4)
_LD_NC_V4 = "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];"


@intrinsic
def ld_global_nc_v4_u32(typingctx, src_global):
    """16 bytes from global memory through the read-only (non-coherent) path, not allocated in L1:
    returns ``UniTuple(uint32, 4)`` (word 0 = lowest address).

    ``src_global`` is a 16-byte-aligned generic address of memory that no thread writes while the
    kernel runs (``.nc``). No ``~{memory}`` clobber, so LLVM may schedule ordinary memory
    operations around it; issue several before using the first result to keep loads in flight
    (4 per thread reached 4.30 TB/s on the H200, kernels.md).
    """
    if not isinstance(src_global, types.Integer):
        raise TypeError(f"ld_global_nc_v4_u32: src_global must be an integer address, got {src_global}")

    def codegen(context, builder, sig, args):
        address = context.cast(builder, args[0], sig.args[0], types.uint64)
        words = asm(builder, _U32X4_STRUCT, [I64], _LD_NC_V4, "=r,=r,=r,=r,l", [address], memory=False)
        return struct_to_tuple(context, builder, sig.return_type, words, 4)

    return _U32X4(src_global), codegen


ld_global_nc_v4_u32.__doc__ += f"\n\nPTX: ``{_LD_NC_V4}``"


# ---------------------------------------------------------------------------------------------
# Host: tensor-map encoding
# ---------------------------------------------------------------------------------------------
TENSOR_MAP_BYTES = 128
# dtype name -> (CUtensorMapDataType member suffix, element bytes). One-byte formats (FP8,
# packed FP4 pairs, scale bytes) travel as UINT8: the TMA copies bits and fills OOB with zeros.
TENSOR_MAP_DTYPES = {
    "uint8": ("UINT8", 1), "int8": ("UINT8", 1), "float8_e4m3fn": ("UINT8", 1),
    "float8_e5m2": ("UINT8", 1), "float8_e8m0fnu": ("UINT8", 1), "float4_e2m1fn_x2": ("UINT8", 1),
    "uint16": ("UINT16", 2), "int16": ("UINT16", 2), "float16": ("FLOAT16", 2),
    "bfloat16": ("BFLOAT16", 2),
    "uint32": ("UINT32", 4), "int32": ("INT32", 4), "float32": ("FLOAT32", 4),
}
# swizzle name -> (CUtensorMapSwizzle member suffix, max inner box bytes)
TENSOR_MAP_SWIZZLES = {"none": ("NONE", None), "32B": ("32B", 32), "64B": ("64B", 64),
                       "128B": ("128B", 128)}
# L2 promotion name -> CUtensorMapL2promotion member suffix: the L2 line fill a box's global reads ask for
# (a 128-byte row piece with "256B" also brings its neighbour into L2, for a later box to hit)
TENSOR_MAP_L2_PROMOTIONS = {"none": "NONE", "64B": "L2_64B", "128B": "L2_128B", "256B": "L2_256B"}
DEFAULT_L2_PROMOTION = "128B"
_TMA_ADDRESS_ALIGN = 16
_TMA_STRIDE_ALIGN = 16
_TMA_MAX_STRIDE = 1 << 40
_TMA_MAX_DIM = 1 << 32
_TMA_MAX_BOX = 256


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    return np.dtype(dtype).name


def check_tensor_map_args(global_address, dtype, dims, strides, box, swizzle, l2_promotion=DEFAULT_L2_PROMOTION):
    """Validate ``encode_tensor_map_*`` arguments against the cuTensorMapEncodeTiled rules; returns
    (driver dtype suffix, element bytes). Raises ValueError / TypeError naming the bad argument."""
    name = _dtype_name(dtype)
    if name not in TENSOR_MAP_DTYPES:
        raise ValueError(f"dtype {name!r} not supported; use one of {sorted(TENSOR_MAP_DTYPES)}")
    if swizzle not in TENSOR_MAP_SWIZZLES:
        raise ValueError(f"swizzle {swizzle!r} not supported; use one of {list(TENSOR_MAP_SWIZZLES)}")
    if l2_promotion not in TENSOR_MAP_L2_PROMOTIONS:
        raise ValueError(f"l2_promotion {l2_promotion!r} not supported; use one of {list(TENSOR_MAP_L2_PROMOTIONS)}")
    dt_suffix, esize = TENSOR_MAP_DTYPES[name]
    rank = len(dims)
    if len(box) != rank or len(strides) != rank - 1:
        raise ValueError(f"rank {rank}: need {rank} box sizes and {rank - 1} strides, got "
                         f"box={tuple(box)}, strides={tuple(strides)}")
    for what, values in (("dims", dims), ("strides", strides), ("box", box)):
        for v in values:
            if not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what} must be integers, got {tuple(values)}")
    if not isinstance(global_address, (int, np.integer)) or global_address % _TMA_ADDRESS_ALIGN:
        raise ValueError(f"global_address must be a {_TMA_ADDRESS_ALIGN}-byte aligned integer, "
                         f"got {global_address!r}")
    if any(not 1 <= d <= _TMA_MAX_DIM for d in dims):
        raise ValueError(f"dims must be in 1..2**32 elements, got {tuple(dims)}")
    extent = dims[0] * esize  # bytes spanned by one row of the innermost dimension
    for i, s in enumerate(strides):
        if s % _TMA_STRIDE_ALIGN or not 0 < s < _TMA_MAX_STRIDE:
            raise ValueError(f"strides[{i}]={s} must be a multiple of {_TMA_STRIDE_ALIGN} bytes below 2**40")
        if s < extent:
            raise ValueError(f"strides[{i}]={s} bytes is smaller than the {extent} bytes of the "
                             f"dimensions inside it (rows would overlap)")
        extent = s * dims[i + 1]
    if any(not 1 <= b <= _TMA_MAX_BOX for b in box):
        raise ValueError(f"box sizes must be in 1..{_TMA_MAX_BOX} elements, got {tuple(box)}")
    inner_bytes = box[0] * esize
    if inner_bytes % 16:
        raise ValueError(f"inner box extent {box[0]} x {esize} B = {inner_bytes} B must be a "
                         f"multiple of 16 B")
    span = TENSOR_MAP_SWIZZLES[swizzle][1]
    if span is not None and inner_bytes > span:
        raise ValueError(f"swizzle {swizzle} needs an inner box extent <= {span} B, got {inner_bytes} B")
    return dt_suffix, esize


def _encode_tiled(global_address, dtype, dims, strides, box, swizzle, l2_promotion):
    dt_suffix, _ = check_tensor_map_args(global_address, dtype, dims, strides, box, swizzle, l2_promotion)
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit failed: {err}")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dt_suffix}"),
        len(dims), int(global_address),
        [u64(int(d)) for d in dims], [u64(int(s)) for s in strides],
        [u32(int(b)) for b in box], [u32(1)] * len(dims),  # element strides: every element
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{TENSOR_MAP_SWIZZLES[swizzle][0]}"),
        getattr(driver.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{TENSOR_MAP_L2_PROMOTIONS[l2_promotion]}"),
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled(dims={tuple(dims)}, strides={tuple(strides)}, "
                           f"box={tuple(box)}, swizzle={swizzle}) failed: {err}")
    words = np.array([int(w) for w in tensor_map.opaque], dtype=np.uint64)
    if words.nbytes != TENSOR_MAP_BYTES:
        raise RuntimeError(f"CUtensorMap has {words.nbytes} bytes, expected {TENSOR_MAP_BYTES}")
    return words.view(np.uint8).copy()


def encode_tensor_map_2d(global_address, dtype, dims, row_stride, box, swizzle="none",
                         l2_promotion=DEFAULT_L2_PROMOTION):
    """128-byte CUtensorMap (numpy uint8 array) for a 2-D tile-mode TMA over global memory.

    global_address: device address of element (0, 0), 16-byte aligned.
    dtype: element type name or numpy/ml_dtypes dtype (``TENSOR_MAP_DTYPES``).
    dims: (inner, outer) extents in elements, innermost (contiguous) first, as the kernel's
        coordinates (c0, c1) are; for a row-major (rows, cols) matrix: ``(cols, rows)``.
    row_stride: bytes between consecutive outer rows, a multiple of 16.
    box: (inner, outer) box extents in elements, each 1..256; inner box bytes a multiple of 16
        and at most the swizzle span (32/64/128 B) when swizzled.
    swizzle: "none", "32B", "64B" or "128B".
    l2_promotion: "none", "64B", "128B" (default) or "256B" (``TENSOR_MAP_L2_PROMOTIONS``).
    Out-of-bounds elements read as zero, no interleave.
    Copy the result to the device (``cuda.to_device``) and pass its address to the kernel.
    """
    return _encode_tiled(global_address, dtype, tuple(dims), (row_stride,), tuple(box), swizzle, l2_promotion)


def encode_tensor_map_3d(global_address, dtype, dims, strides, box, swizzle="none",
                         l2_promotion=DEFAULT_L2_PROMOTION):
    """128-byte CUtensorMap for a 3-D tile-mode TMA: as ``encode_tensor_map_2d`` with
    ``dims``/``box`` = (inner, middle, outer) and ``strides`` = (middle stride, outer stride) in
    bytes, each a multiple of 16."""
    return _encode_tiled(global_address, dtype, tuple(dims), tuple(strides), tuple(box), swizzle, l2_promotion)


def tensor_map_box_bytes(dtype, box) -> int:
    """Bytes one TMA box of ``box`` elements delivers (the ``expect_tx`` count)."""
    name = _dtype_name(dtype)
    if name not in TENSOR_MAP_DTYPES:
        raise ValueError(f"dtype {name!r} not supported; use one of {sorted(TENSOR_MAP_DTYPES)}")
    return math.prod(box) * TENSOR_MAP_DTYPES[name][1]
