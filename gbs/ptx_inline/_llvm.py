"""The one way this package emits inline PTX: an LLVM ``InlineAsm`` call inside a Numba intrinsic.

LLVM's inline-asm dialect: operands are ``$0 $1 ...``; PTX special registers take a single ``%``
(``%laneid``); constraints ``r`` (u32), ``l`` (u64), ``f`` (f32), ``h`` (u16), ``=r`` outputs,
tied read-write operands as ``=f`` outputs plus ``"N"`` inputs. ``asm`` marks every call as having
side effects and clobbering ``~{memory}`` unless the caller says otherwise, so LLVM neither drops
nor reorders it across loads and stores. ``pure_asm`` is the one exception, for register-only
arithmetic (no memory, no state): without the side-effect flag LLVM deletes a call whose result
is unused (identical calls are not merged: the call carries no ``readnone`` attribute).
"""
from __future__ import annotations

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
VOID = ir.VoidType()


def asm(builder, ret, argtys, text, constraints, args, *, memory=True):
    """Emit ``text`` as an inline-asm call returning ``ret`` (an llvmlite type)."""
    if memory and "~{memory}" not in constraints:
        constraints = f"{constraints},~{{memory}}" if constraints else "~{memory}"
    fnty = ir.FunctionType(ret, argtys)
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)


def pure_asm(builder, ret, argtys, text, constraints, args):
    """Emit ``text`` as inline asm WITHOUT the side-effect flag or memory clobber: LLVM deletes the
    call when its result is unused. Only for register-only arithmetic."""
    fnty = ir.FunctionType(ret, argtys)
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=False), args)


def void_intrinsic(text: str, doc: str):
    """A no-argument, no-result intrinsic that emits ``text`` (fences, barriers, commits)."""

    @intrinsic
    def _impl(typingctx):
        def codegen(context, builder, sig, args):
            asm(builder, VOID, [], text, "", [])
            return context.get_dummy_value()

        return types.void(), codegen

    _impl.__doc__ = f"{doc}\n\nPTX: ``{text}``"
    return _impl


def special_register_u32(reg: str, doc: str):
    """A no-argument intrinsic returning the u32 special register ``reg`` (e.g. ``%laneid``)."""
    text = f"mov.u32 $0, {reg};"

    @intrinsic
    def _impl(typingctx):
        def codegen(context, builder, sig, args):
            return asm(builder, I32, [], text, "=r", [], memory=False)

        return types.uint32(), codegen

    _impl.__doc__ = f"{doc}\n\nPTX: ``{text}``"
    return _impl


def struct_to_tuple(context, builder, tuple_type, value, count):
    """Turn an inline-asm struct result into a Numba ``UniTuple`` of ``count`` fields."""
    return context.make_tuple(builder, tuple_type, [builder.extract_value(value, i) for i in range(count)])


def tuple_fields(builder, value, count):
    """The ``count`` fields of a Numba ``UniTuple`` argument, as LLVM values."""
    return [builder.extract_value(value, i) for i in range(count)]
