"""Register-only arithmetic and conversions: packed bf16 FMA, byte permute, f32 -> bf16, and four
E4M3 bytes -> two bf16x2 words scaled by a power of two.

These touch no memory and no state, so they are emitted as pure inline asm (``_llvm.pure_asm``:
no side-effect flag, no ``~{memory}`` clobber): a call whose result is unused is deleted, as
ordinary arithmetic would be. Operands are u32
words holding packed bf16x2 / byte quadruples (``f32_to_bf16_bits`` takes an f32 and returns the
u16 bits). ``fma.rn.bf16x2``, ``cvt.rn.bf16.f32`` and ``prmt`` assemble for sm_80+,
``cvt.rn.f16x2.e4m3x2`` for sm_89+; every kernel of this package targets sm_90a or sm_100a.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import I32, pure_asm, struct_to_tuple
from .common import ptx_intrinsic

_U32_OPERANDS = ("a", "b", "c")

fma_bf16x2 = ptx_intrinsic(
    "fma_bf16x2", "fma.rn.bf16x2 $0, $1, $2, $3;", [(arg, "u32") for arg in _U32_OPERANDS],
    result="u32", pure=True,
    doc="""``a * b + c`` on two packed bf16 lanes, one rounding to nearest even; bf16 subnormals are
kept (no ``.ftz``). With ``c`` = -0 in both lanes (0x80008000) it is the plain product ``a * b``,
also for a +0 / -0 product (a +0 addend would turn -0 into +0).""")

prmt_b32 = ptx_intrinsic(
    "prmt_b32", "prmt.b32 $0, $1, $2, $3;", [(arg, "u32") for arg in _U32_OPERANDS], result="u32", pure=True,
    doc="""Byte permute (default mode): byte i of the result is byte ``c[4i:4i+4]`` (0..7; bit 3 of each
nibble replicates the byte's sign instead when set) of the 8 bytes ``b:a`` (``a`` = bytes 0-3).""")



def prmt_b32_host(a, b, c):
    """``prmt_b32`` on the host (numpy arrays or integers of u32 words), for tests and host models."""
    a, b, c = np.uint64(a), np.uint64(b), np.uint64(c)
    source = (b << np.uint64(32)) | a
    out = np.uint64(0)
    for i in range(4):
        nibble = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (source >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        sign_mode = (nibble & np.uint64(8)) != 0
        byte = np.where(sign_mode, np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out = out | (np.uint64(byte) << np.uint64(8 * i))
    return np.uint32(out)


min_u16x2 = ptx_intrinsic(
    "min_u16x2", "min.u16x2 $0, $1, $2;", [("a", "u32"), ("b", "u32")], result="u32", pure=True,
    doc="""The unsigned minimum of each 16-bit lane of ``a`` and ``b`` (sm_90+; one ``VIMNMX.U16x2``).
``min_u16x2_host`` is the same on numpy / Python integers.""")


def min_u16x2_host(a, b):
    """``min_u16x2`` on the host (numpy arrays or integers of u32 words), for tests and host models."""
    a, b = np.uint32(a), np.uint32(b)
    lo = np.minimum(a & np.uint32(0xFFFF), b & np.uint32(0xFFFF))
    hi = np.minimum(a >> np.uint32(16), b >> np.uint32(16))
    return np.uint32((hi << np.uint32(16)) | lo)


f32_from_bits = ptx_intrinsic(
    "f32_from_bits", "mov.b32 $0, $1;", [("bits", "u32")], result="f32", pure=True,
    doc="The fp32 number whose bits are ``bits`` (a register move).")

f32_to_bf16_bits = ptx_intrinsic(
    "f32_to_bf16_bits", "cvt.rn.bf16.f32 $0, $1;", [("value", "f32")], result="u16", pure=True,
    doc="bf16 bits (u16) of an f32, rounded to nearest even in hardware; NaN stays NaN, overflow -> Inf.")

# The multiplier 2**k is an immediate f32 operand: normal powers of two only (biased exponent 1..254).
F32_EXPONENT_BIAS = 127
F32_MANTISSA_BITS = 23
MIN_LOG2_MULTIPLIER = 1 - F32_EXPONENT_BIAS
MAX_LOG2_MULTIPLIER = F32_EXPONENT_BIAS


def e4m3x4_to_bf16x2(log2_multiplier: int):
    """Intrinsic ``(word) -> (lo, hi)``: the four E4M3 bytes of the u32 ``word`` (byte i = value i)
    as two bf16x2 words ``(v0, v1), (v2, v3)`` (v0 in the low half of ``lo``) of ``v * 2**log2_multiplier``.

    E4M3 -> f16 in hardware (``cvt.rn.f16x2.e4m3x2``, exact), f16 -> f32 (exact), times the
    power of two, f32 -> bf16 (``cvt.rn.bf16x2.f32``). Exact for every finite E4M3 value (4
    significant bits, 2**-9 <= |v| <= 448) when ``-117 <= log2_multiplier <= 119``, where every
    product is an f32 / bf16 normal; NaN bytes (0x7F, 0xFF) stay NaN. UE4M3 block scales (sign bit
    0) are read the same way. ``log2_multiplier`` must lie in
    ``MIN_LOG2_MULTIPLIER..MAX_LOG2_MULTIPLIER`` (-126..127): 2**k is encoded as a normal f32."""
    if isinstance(log2_multiplier, bool) or not isinstance(log2_multiplier, numbers.Integral):
        raise TypeError(f"e4m3x4_to_bf16x2: log2_multiplier must be an integer, got {log2_multiplier!r}")
    if not MIN_LOG2_MULTIPLIER <= log2_multiplier <= MAX_LOG2_MULTIPLIER:
        raise ValueError(f"e4m3x4_to_bf16x2: log2_multiplier {log2_multiplier} outside "
                         f"{MIN_LOG2_MULTIPLIER}..{MAX_LOG2_MULTIPLIER} (2**k must be a normal f32)")
    return _e4m3x4_to_bf16x2(int(log2_multiplier))


@functools.cache
def _e4m3x4_to_bf16x2(log2_multiplier: int):
    """The intrinsic of ``e4m3x4_to_bf16x2`` for a checked ``log2_multiplier``, one per value."""
    multiplier = f"0f{(log2_multiplier + F32_EXPONENT_BIAS) << F32_MANTISSA_BITS:08X}"
    text = ("{\n .reg .b16 lo, hi, h0, h1, h2, h3;\n .reg .b32 x01, x23;\n .reg .f32 f0, f1, f2, f3;\n"
            " mov.b32 {lo, hi}, $2;\n"
            " cvt.rn.f16x2.e4m3x2 x01, lo;\n cvt.rn.f16x2.e4m3x2 x23, hi;\n"
            " mov.b32 {h0, h1}, x01;\n mov.b32 {h2, h3}, x23;\n"
            " cvt.f32.f16 f0, h0;\n cvt.f32.f16 f1, h1;\n cvt.f32.f16 f2, h2;\n cvt.f32.f16 f3, h3;\n"
            f" mul.f32 f0, f0, {multiplier};\n mul.f32 f1, f1, {multiplier};\n"
            f" mul.f32 f2, f2, {multiplier};\n mul.f32 f3, f3, {multiplier};\n"
            " cvt.rn.bf16x2.f32 $0, f1, f0;\n cvt.rn.bf16x2.f32 $1, f3, f2;\n}")

    @intrinsic
    def e4m3x4_to_bf16x2_scaled(typingctx, word):
        if not isinstance(word, types.Integer):
            raise TypeError(f"e4m3x4_to_bf16x2: word must be an integer (four E4M3 bytes), got {word}")

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.uint32)
            pairs = pure_asm(builder, ir.LiteralStructType([I32, I32]), [I32], text, "=r,=r,r", [value])
            return struct_to_tuple(context, builder, sig.return_type, pairs, 2)

        return types.UniTuple(types.uint32, 2)(word), codegen

    e4m3x4_to_bf16x2_scaled.__doc__ = f"{e4m3x4_to_bf16x2.__doc__}\n\nPTX: ``{text}``"
    return e4m3x4_to_bf16x2_scaled
