"""Explicit shared-memory loads and stores: ``ld.shared`` of 1, 2 or 4 32-bit words (and of one f32),
``st.shared`` of 1, 2 or 4.

Why not index a ``cuda.shared.array``: a kernel that addresses one dynamic shared buffer with
computed byte offsets (swizzled tiles, decoded-operand slots, scale atoms) holds 32-bit
shared-window addresses (``common.shared_address`` + offset), and these intrinsics take exactly
that; the vector forms give one LDS.64 / LDS.128 / STS.128 where NVVM would otherwise emit
separate 32-bit accesses.

Constraints: ``smem`` is a 32-bit shared-window address aligned to the access size (4 bytes for
``ld_shared_u32``, 8 for ``v2``, 16 for ``v4``); a misaligned address is a launch error
(misaligned address), not a silent wrong value. The loads only read, so they are emitted
without the ``~{memory}`` clobber (the store keeps it); as for any shared-memory read, data
written by other threads or by TMA is visible only after a barrier (``bar.sync``, an mbarrier
wait). sm_90a and sm_100a.
"""
from __future__ import annotations

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import I32, asm, struct_to_tuple
from .common import ptx_intrinsic

ld_shared_u32 = ptx_intrinsic(
    "ld_shared_u32", "ld.shared.u32 $0, [$1];", [("smem", "u32")], result="u32", memory=False,
    doc="32-bit load from the shared-window address ``smem`` (4-byte aligned).")


def _ld_shared_u32_vector(width: int):
    """Intrinsic: ``width`` (2 or 4) 32-bit words from a ``4 * width``-byte aligned shared-window address."""
    outputs = ", ".join(f"${i}" for i in range(width))
    text = f"ld.shared.v{width}.u32 {{{outputs}}}, [${width}];"
    constraints = ",".join(["=r"] * width + ["r"])
    words_type = types.UniTuple(types.uint32, width)

    @intrinsic
    def ld_shared_vector(typingctx, smem):
        if not isinstance(smem, types.Integer):
            raise TypeError(f"ld_shared_v{width}_u32: smem must be an integer shared-window address, got {smem}")

        def codegen(context, builder, sig, args):
            address = context.cast(builder, args[0], sig.args[0], types.uint32)
            words = asm(builder, ir.LiteralStructType([I32] * width), [I32], text, constraints, [address],
                        memory=False)
            return struct_to_tuple(context, builder, sig.return_type, words, width)

        return words_type(smem), codegen

    ld_shared_vector.__doc__ = f"{_ld_shared_u32_vector.__doc__}\n\nPTX: ``{text}``"
    return ld_shared_vector


ld_shared_f32 = ptx_intrinsic(
    "ld_shared_f32", "ld.shared.f32 $0, [$1];", [("smem", "u32")], result="f32", memory=False,
    doc="32-bit float load from the shared-window address ``smem`` (4-byte aligned).")

ld_shared_v2_u32 = _ld_shared_u32_vector(2)
ld_shared_v4_u32 = _ld_shared_u32_vector(4)

st_shared_u32 = ptx_intrinsic(
    "st_shared_u32", "st.shared.u32 [$0], $1;", [("smem", "u32"), ("word", "u32")],
    doc="Store one 32-bit word at the 4-byte aligned shared-window address ``smem``.")

st_shared_v2_u32 = ptx_intrinsic(
    "st_shared_v2_u32", "st.shared.v2.u32 [$0], {$1, $2};", [("smem", "u32"), ("w0", "u32"), ("w1", "u32")],
    doc="Store two 32-bit words at the 8-byte aligned shared-window address ``smem``.")

st_shared_v4_u32 = ptx_intrinsic(
    "st_shared_v4_u32", "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
    [("smem", "u32"), ("w0", "u32"), ("w1", "u32"), ("w2", "u32"), ("w3", "u32")],
    doc="Store four 32-bit words at the 16-byte aligned shared-window address ``smem``.")
