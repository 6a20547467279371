"""Hopper tensor-core intrinsics: ldmatrix, mma.sync (bf16, e4m3), wgmma (bf16, e4m3), setmaxnreg,
plus the pure-Python wgmma shared-memory descriptor and the canonical K-major tile layouts.

Targets: ``ldmatrix``, ``mma.sync`` and ``setmaxnreg`` assemble for sm_90a and sm_100a (e4m3
``mma.sync`` needs sm_89+ and is emulated with fp16 HMMA there); ``wgmma.*`` only for sm_90a
(ptxas rejects it for sm_100a, whose tensor cores are driven by tcgen05). Register fragments are
``UniTuple``s so that LLVM keeps them in registers: index them with constants only (a run-time
index sends the tuple to local memory).

wgmma usage (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"), executed by all
128 threads of a warpgroup (4 consecutive warps, the first warp index a multiple of 4)::

    fence_proxy_async_shared_cta(); syncthreads()  # st.shared of the operands -> async proxy
    wgmma_fence()                                   # acc / A registers written by ordinary code
    acc = mma(acc, desc_a, desc_b, scale_d)         # one call per K step, chained
    wgmma_commit_group(); wgmma_wait_group_0()
    acc = wgmma_fence_accumulators(acc)             # acc readable only from here on

Shared-memory descriptors (PTX "Matrix Descriptor Format", verified on the H200 by
shared/examples/hopper_tensor_core_probe.py): bits 0-13 start address >> 4, 16-29 leading
dimension byte offset (LBO) >> 4, 32-45 stride dimension byte offset (SBO) >> 4, 49-51 base
offset (0 here: swizzled tiles start on a pattern boundary, 1024 B for 128B swizzle), 62-63
swizzle mode. Both operands K-major (B stored N x K), the only form e4m3 accepts.

Canonical K-major layouts of a tile of ``rows`` x ``row_bytes`` (rows = M for A, N for B; one
"core matrix" = 8 rows x 16 bytes; the K step of one MMA is 32 bytes = k16 bf16 = k32 e4m3):
- no swizzle ("interleave"): core matrices stored as 128 contiguous bytes; those along K of one
  8-row group adjacent (LBO = 128 B), 8-row groups ``8 * row_bytes`` apart (SBO; 1024 B for a
  128-byte K slice); K step +256 B of start address. ``kmajor_interleave_offset``.
- 128B swizzle: one 128-byte K row per tile row, 8 rows = one 1024-B atom (SBO = 1024 B; LBO
  unused, encoded as 16 B); the 16-byte chunk c of row r sits at chunk ``c ^ (r % 8)``; tile
  1024-B aligned; K step +32 B of start address (the hardware applies the XOR to the addresses
  it generates). ``kmajor_sw128_offset``.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from ._llvm import F32, I32, I64, asm, struct_to_tuple, tuple_fields, void_intrinsic

_U32X2 = types.UniTuple(types.uint32, 2)
_U32X4 = types.UniTuple(types.uint32, 4)
_F32X4 = types.UniTuple(types.float32, 4)


def _check_tuple(name, what, ty, want):
    if ty != want:
        raise TypeError(f"{name}: {what} must be {want}, got {ty}")


def _check_integer(name, what, ty):
    if not isinstance(ty, types.Integer):
        raise TypeError(f"{name}: {what} must be an integer, got {ty}")


# ---------------------------------------------------------------------------------------------
# ldmatrix
# ---------------------------------------------------------------------------------------------
def _ldmatrix_x4(trans: bool):
    text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
            "{$0, $1, $2, $3}, [$4];")
    name = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"

    @intrinsic
    def _impl(typingctx, row_addr):
        _check_integer(name, "row_addr", row_addr)

        def codegen(context, builder, sig, args):
            addr = context.cast(builder, args[0], sig.args[0], types.uint32)
            regs = asm(builder, ir.LiteralStructType([I32] * 4), [I32], text, "=r,=r,=r,=r,r", [addr])
            return struct_to_tuple(context, builder, sig.return_type, regs, 4)

        return _U32X4(row_addr), codegen

    layout = ("each matrix is transposed on the way: register j of lane l holds the elements "
              "(row 2*(l%4), column l//4) and (row 2*(l%4)+1, column l//4) of stored matrix j "
              "(lower row in the low half)" if trans else
              "register j of lane l holds row l//4, columns 2*(l%4) and 2*(l%4)+1 of matrix j "
              "(lower column in the low half)")
    _impl.__doc__ = f"""Load four 8x8 b16 matrices from shared memory into ``UniTuple(uint32, 4)``.

Lanes 8j..8j+7 give the 32-bit shared addresses of rows 0..7 of matrix j (16 contiguous bytes
per row, 16-byte aligned); {layout}. Warp-wide (``.sync.aligned``).

PTX: ``{text}``"""
    return _impl


ldmatrix_x4 = _ldmatrix_x4(trans=False)
ldmatrix_x4_trans = _ldmatrix_x4(trans=True)


# ---------------------------------------------------------------------------------------------
# mma.sync m16n8 (one warp)
# ---------------------------------------------------------------------------------------------
def _mma_sync(name: str, text: str, doc: str):
    @intrinsic
    def _impl(typingctx, a, b, c):
        _check_tuple(name, "a", a, _U32X4)
        _check_tuple(name, "b", b, _U32X2)
        _check_tuple(name, "c", c, _F32X4)

        def codegen(context, builder, sig, args):
            operands = (tuple_fields(builder, args[0], 4) + tuple_fields(builder, args[1], 2)
                        + tuple_fields(builder, args[2], 4))
            d = asm(builder, ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4, text,
                    "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", operands, memory=False)
            return struct_to_tuple(context, builder, sig.return_type, d, 4)

        return _F32X4(a, b, c), codegen

    _impl.__doc__ = f"{doc}\n\nPTX: ``{text}``"
    return _impl


_MMA_OPERANDS = "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
_MMA_C_LAYOUT = ("c/d (4 x f32): element i of lane l is row l//4 + 8*(i//2), column "
                 "2*(l%4) + i%2 (``mma_m16n8_c_position``).")

mma_bf16_m16n8k16 = _mma_sync(
    "mma_bf16_m16n8k16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " + _MMA_OPERANDS,
    f"""D[16x8] = A[16x16] @ B[16x8] + C in fp32 from bf16 operands; one warp; returns D.

a: ``UniTuple(uint32, 4)``, 8 bf16 (two per register, lower index in the low half) at the
positions of ``mma_m16n8k16_a_position``; b: ``UniTuple(uint32, 2)``, 4 bf16 at
``mma_m16n8k16_b_position``; {_MMA_C_LAYOUT} C is tied to D (the same registers).""")

mma_e4m3_m16n8k32 = _mma_sync(
    "mma_e4m3_m16n8k32", "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 " + _MMA_OPERANDS,
    f"""D[16x8] = A[16x32] @ B[32x8] + C in fp32 from FP8 E4M3 operands; one warp; returns D.

a: ``UniTuple(uint32, 4)``, 16 e4m3 bytes (byte 0 = lowest) at ``mma_m16n8k32_a_position``;
b: ``UniTuple(uint32, 2)``, 8 e4m3 bytes at ``mma_m16n8k32_b_position``; {_MMA_C_LAYOUT}
C is tied to D. sm_89+. On sm_90a (and sm_100a) there is no fp8 mma.sync in hardware: ptxas
converts the 24 operand bytes to fp16 (12 ``F2FP.F16.E4M3.UNPACK_B``) and issues two fp16
``HMMA.16816.F32``, so it costs more than the bf16 form; fp8 at full rate is wgmma (QGMMA).""")


def mma_m16n8_c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of accumulator element ``i`` (0..3) of ``lane`` in an m16n8 mma.sync tile."""
    return lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2


def mma_m16n8k16_a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of bf16 element ``i`` (0..7; register i//2, half i%2) of A held by ``lane``."""
    return lane // 4 + 8 * ((i // 2) % 2), 2 * (lane % 4) + i % 2 + 8 * (i // 4)


def mma_m16n8k16_b_position(lane: int, i: int) -> tuple[int, int]:
    """(k, col) of bf16 element ``i`` (0..3; register i//2, half i%2) of B held by ``lane``."""
    return 2 * (lane % 4) + i % 2 + 8 * (i // 2), lane // 4


def mma_m16n8k32_a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of e4m3 byte ``i`` (0..15; register i//4, byte i%4) of A held by ``lane``."""
    return lane // 4 + 8 * ((i // 4) % 2), 4 * (lane % 4) + i % 4 + 16 * (i // 8)


def mma_m16n8k32_b_position(lane: int, i: int) -> tuple[int, int]:
    """(k, col) of e4m3 byte ``i`` (0..7; register i//4, byte i%4) of B held by ``lane``."""
    return 4 * (lane % 4) + i % 4 + 16 * (i // 4), lane // 4


# ---------------------------------------------------------------------------------------------
# wgmma (sm_90a)
# ---------------------------------------------------------------------------------------------
WGMMA_M = 64
WGMMA_THREADS = 128
WGMMA_N_VALUES = tuple(range(8, 257, 8))

wgmma_fence = void_intrinsic(
    "wgmma.fence.sync.aligned;",
    "Order prior register writes (accumulators, register A fragments) and shared-memory "
    "accesses before the following wgmma.mma_async; all 128 threads of the warpgroup.")

wgmma_commit_group = void_intrinsic(
    "wgmma.commit_group.sync.aligned;",
    "Close the warpgroup's pending wgmma.mma_async operations into one wgmma group.")


@functools.cache
def wgmma_wait_group(pending: int):
    """Intrinsic ``wgmma.wait_group.sync.aligned pending;`` (``pending`` a literal 0..7): wait until
    at most ``pending`` wgmma groups are in flight. Accumulators of a group (and the shared
    memory it reads) may be touched only after a wait that covers it."""
    if not isinstance(pending, int) or not 0 <= pending <= 7:
        raise ValueError(f"wgmma_wait_group: pending must be an int in 0..7, got {pending!r}")
    return void_intrinsic(f"wgmma.wait_group.sync.aligned {pending};",
                          f"Wait until at most {pending} wgmma groups are pending.")


wgmma_wait_group_0 = wgmma_wait_group(0)
wgmma_wait_group_1 = wgmma_wait_group(1)


def _check_n(name, n):
    if n not in WGMMA_N_VALUES:
        raise ValueError(f"{name}: n must be a multiple of 8 in 8..256, got {n!r}")
    return n // 2  # fp32 accumulator registers per thread: 64 * n / 128


def accumulator_type(n: int):
    """Numba type of the fp32 accumulators of an m64nN wgmma: ``UniTuple(float32, n // 2)``."""
    return types.UniTuple(types.float32, _check_n("accumulator_type", n))


def wgmma_accumulator_position(thread: int, i: int) -> tuple[int, int]:
    """(row, col) in the 64 x N tile of accumulator register ``i`` of warpgroup thread ``thread``
    (0..127): row = 16*warp + lane//4 + 8*((i>>1)&1), col = 8*(i>>2) + 2*(lane%4) + (i&1)."""
    warp, lane = thread // 32, thread % 32
    return 16 * warp + lane // 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)


def wgmma_a_register_position(thread: int, i: int) -> tuple[int, int]:
    """(row, k) in the 64 x 16 bf16 A tile of element ``i`` (0..7) held by warpgroup thread
    ``thread`` for ``wgmma_bf16_rs``: warp w holds rows 16w..16w+15 in the mma.sync m16n8k16 A
    fragment layout."""
    row, k = mma_m16n8k16_a_position(thread % 32, i)
    return 16 * (thread // 32) + row, k


def wgmma_e4m3_a_register_position(thread: int, i: int) -> tuple[int, int]:
    """(row, k) in the 64 x 32 e4m3 A tile of byte ``i`` (0..15; register i // 4, byte i % 4) held by warpgroup
    thread ``thread`` for ``wgmma_e4m3_rs``: warp w holds rows 16w..16w+15 in the mma.sync m16n8k32 A layout."""
    row, k = mma_m16n8k32_a_position(thread % 32, i)
    return 16 * (thread // 32) + row, k


@functools.cache
def wgmma_zero_accumulators(n: int):
    """Intrinsic returning ``UniTuple(float32, n // 2)`` of zeros: defined accumulator registers to
    start a chain (the first wgmma usually passes scale_d = 0 and ignores them anyway)."""
    count = _check_n("wgmma_zero_accumulators", n)
    acc_t = types.UniTuple(types.float32, count)

    @intrinsic
    def _impl(typingctx):
        def codegen(context, builder, sig, args):
            zero = ir.Constant(F32, 0.0)
            return context.make_tuple(builder, acc_t, [zero] * count)

        return acc_t(), codegen

    return _impl


@intrinsic
def wgmma_fence_accumulators(typingctx, acc):
    """Return ``acc`` through an empty asm statement that claims to rewrite every register.

    Place it after ``wgmma_wait_group_*``: LLVM then cannot compute with the accumulators
    before the wait (the wgmma asm outputs are otherwise ordinary SSA values it may schedule
    early), the role of CUTLASS's ``warpgroup_fence_operand``. Any ``UniTuple(float32, k)``.
    """
    if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32):
        raise TypeError(f"wgmma_fence_accumulators: acc must be a UniTuple of float32, got {acc}")
    count = acc.count

    def codegen(context, builder, sig, args):
        constraints = ",".join(["=f"] * count + [str(i) for i in range(count)])
        regs = asm(builder, ir.LiteralStructType([F32] * count), [F32] * count, "", constraints,
                   tuple_fields(builder, args[0], count))
        return struct_to_tuple(context, builder, sig.return_type, regs, count)

    return acc(acc), codegen


@intrinsic
def accumulators_to_array(typingctx, acc, arr):
    """``arr[i] = acc[i]`` for every field of the fp32 ``UniTuple`` ``acc`` (``arr``: a 1-D float32
    array, e.g. ``cuda.local.array``, at least as long), with constant indices: an epilogue can then
    walk the accumulators with a loop index (a loop-indexed tuple ``getitem`` is a switch per read)."""
    if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32):
        raise TypeError(f"accumulators_to_array: acc must be a UniTuple of float32, got {acc}")
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32):
        raise TypeError(f"accumulators_to_array: arr must be a 1-D float32 array, got {arr}")
    count = acc.count

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[1])(context, builder, args[1])
        intp = context.get_value_type(types.intp)
        for i in range(count):
            pointer = cgutils.get_item_pointer(context, builder, sig.args[1], ary, [ir.Constant(intp, i)])
            builder.store(builder.extract_value(args[0], i), pointer)
        return context.get_dummy_value()

    return types.void(acc, arr), codegen


@intrinsic
def promote_accumulator_rows(typingctx, total, chunk, factor_lo, factor_hi):
    """``total[i] + chunk[i] * factor`` (one FFMA per accumulator) with ``factor_lo`` for the accumulators of a
    thread's row g (``(i >> 1) & 1 == 0``: ``wgmma_accumulator_position``) and ``factor_hi`` for row g + 8: the FP8
    route's promotion of a chunk's E4M3 partial sums into the fp32 total (one power of two per token row). Each factor
    is a float32, or a ``UniTuple(float32, G)`` of one per column group: the tile's N columns in G equal groups, so
    accumulator i takes field ``i // (count // G)`` (its column ``8 (i >> 2) + ...`` lies in group ``column // (N /
    G)``)."""
    for name, arg in (("total", total), ("chunk", chunk)):
        if not (isinstance(arg, types.UniTuple) and arg.dtype == types.float32):
            raise TypeError(f"promote_accumulator_rows: {name} must be a UniTuple of float32, got {arg}")
    if total.count != chunk.count:
        raise TypeError(f"promote_accumulator_rows: total has {total.count} accumulators, chunk {chunk.count}")
    if factor_lo != factor_hi:
        raise TypeError(f"promote_accumulator_rows: the factors differ in type, {factor_lo} and {factor_hi}")
    if isinstance(factor_lo, types.UniTuple) and factor_lo.dtype == types.float32:
        groups = factor_lo.count
    elif factor_lo == types.float32:
        groups = 1
    else:
        raise TypeError(f"promote_accumulator_rows: the factors must be float32 or a UniTuple of them, got {factor_lo}")
    if total.count % (4 * groups):
        raise TypeError(f"promote_accumulator_rows: {total.count} accumulators do not split into {groups} column "
                        f"groups of whole 8-column blocks")
    per_group = total.count // groups

    def codegen(context, builder, sig, args):
        t, c, f_lo, f_hi = args
        if groups > 1:
            f_lo, f_hi = tuple_fields(builder, f_lo, groups), tuple_fields(builder, f_hi, groups)
        out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
        for i in range(sig.return_type.count):
            factor = f_hi if (i >> 1) & 1 else f_lo
            if groups > 1:
                factor = factor[i // per_group]
            out = builder.insert_value(out, builder.fma(builder.extract_value(c, i), factor,
                                                        builder.extract_value(t, i)), i)
        return out

    return total(total, chunk, factor_lo, factor_hi), codegen


def _wgmma_intrinsic(name, text, count, operand_kinds, doc):
    """wgmma with ``count`` tied f32 accumulators followed by operands of ``operand_kinds``
    ('a4' = UniTuple(uint32, 4) register A, 'desc' = u64 descriptor, 'scale' = u32 predicate)."""
    acc_t = types.UniTuple(types.float32, count)
    ll_types, letters = [], []
    for kind in operand_kinds:
        if kind == "a4":
            ll_types += [I32] * 4
            letters += ["r"] * 4
        elif kind == "desc":
            ll_types.append(I64)
            letters.append("l")
        else:
            ll_types.append(I32)
            letters.append("r")
    constraints = ",".join(["=f"] * count + letters + [str(i) for i in range(count)])

    def codegen(context, builder, sig, args):
        operands = []
        for kind, value, ty in zip(operand_kinds, args[1:], sig.args[1:]):
            if kind == "a4":
                operands += tuple_fields(builder, value, 4)
            else:
                want = types.uint64 if kind == "desc" else types.uint32
                operands.append(context.cast(builder, value, ty, want))
        accs = tuple_fields(builder, args[0], count)
        regs = asm(builder, ir.LiteralStructType([F32] * count), ll_types + [F32] * count, text,
                   constraints, operands + accs)
        return struct_to_tuple(context, builder, sig.return_type, regs, count)

    def typer(acc, *operand_types):
        _check_tuple(name, "acc", acc, acc_t)
        for kind, ty in zip(operand_kinds, operand_types):
            if kind == "a4":
                _check_tuple(name, "a", ty, _U32X4)
            else:
                _check_integer(name, "descriptor" if kind == "desc" else "scale_d", ty)
        return acc_t(acc, *operand_types), codegen

    if operand_kinds == ("desc", "desc", "scale"):
        @intrinsic
        def _impl(typingctx, acc, desc_a, desc_b, scale_d):
            return typer(acc, desc_a, desc_b, scale_d)
    else:
        @intrinsic
        def _impl(typingctx, acc, a, desc_b, scale_d):
            return typer(acc, a, desc_b, scale_d)

    _impl.__doc__ = f"{doc}\n\nPTX:\n{text}"
    return _impl


def _wgmma_text(shape_types: str, count: int, operands: str, tail: str):
    """``{ setp scale_d; wgmma {$0..$count-1}, <operands>, scale_d, <tail>; }``: the accumulators
    are outputs 0..count-1, the operands follow, then the u32 scale_d input."""
    accs = ", ".join(f"${i}" for i in range(count))
    scale = count + operands.count("$")
    return ("{\n .reg .pred scale_d;\n"
            f" setp.ne.b32 scale_d, ${scale}, 0;\n"
            f" wgmma.mma_async.sync.aligned.{shape_types} {{{accs}}}, {operands}, scale_d, {tail};\n}}")


_WGMMA_COMMON_DOC = """acc: ``UniTuple(float32, {count})`` ({n} / 2 registers per thread, tied to D) at the
positions of ``wgmma_accumulator_position``; scale_d (u32): 0 -> D = A @ B (acc ignored), else
D = A @ B + acc.
Asynchronous: see the module docstring for fence / commit / wait."""


@functools.cache
def wgmma_bf16_ss(n: int):
    """Intrinsic ``acc = f(acc, desc_a, desc_b, scale_d)``: one wgmma m64nNk16, fp32 += bf16 x bf16,
    A (64 x 16) and B (N x 16) K-major in shared memory, given by u64 descriptors
    (``wgmma_smem_descriptor``). imm-scale-a = imm-scale-b = 1, no transposes."""
    count = _check_n("wgmma_bf16_ss", n)
    text = _wgmma_text(f"m64n{n}k16.f32.bf16.bf16", count, f"${count}, ${count + 1}", "1, 1, 0, 0")
    return _wgmma_intrinsic(f"wgmma_bf16_ss({n})", text, count, ("desc", "desc", "scale"),
                            "D[64x%d] (+)= A[64x16] @ B[16x%d], bf16 in, fp32 accumulate, operands in "
                            "shared memory.\n\n" % (n, n) + _WGMMA_COMMON_DOC.format(count=count, n=n))


@functools.cache
def wgmma_e4m3_ss(n: int):
    """Intrinsic ``acc = f(acc, desc_a, desc_b, scale_d)``: one wgmma m64nNk32, fp32 += e4m3 x e4m3,
    A (64 x 32 bytes) and B (N x 32 bytes) K-major in shared memory (FP8 wgmma has no transpose
    operands); imm-scale-a = imm-scale-b = 1."""
    count = _check_n("wgmma_e4m3_ss", n)
    text = _wgmma_text(f"m64n{n}k32.f32.e4m3.e4m3", count, f"${count}, ${count + 1}", "1, 1")
    return _wgmma_intrinsic(f"wgmma_e4m3_ss({n})", text, count, ("desc", "desc", "scale"),
                            "D[64x%d] (+)= A[64x32] @ B[32x%d], e4m3 in, fp32 accumulate, operands in "
                            "shared memory.\n\n" % (n, n) + _WGMMA_COMMON_DOC.format(count=count, n=n))


@functools.cache
def wgmma_bf16_rs(n: int):
    """Intrinsic ``acc = f(acc, a, desc_b, scale_d)``: one wgmma m64nNk16, fp32 += bf16 x bf16,
    A (64 x 16) from registers (``a``: ``UniTuple(uint32, 4)`` per thread at
    ``wgmma_a_register_position``, two bf16 per register, lower k in the low half), B (N x 16)
    K-major in shared memory. imm-scale-a = imm-scale-b = 1, imm-trans-b = 0 (B K-major).
    The path for A dequantised in registers (FP4/FP8 -> bf16)."""
    return _wgmma_register_a("wgmma_bf16_rs", n, 16, "bf16", "1, 1, 0")


@functools.cache
def wgmma_e4m3_rs(n: int):
    """Intrinsic ``acc = f(acc, a, desc_b, scale_d)``: one wgmma m64nNk32, fp32 += e4m3 x e4m3, A (64 x 32)
    from registers (``a``: ``UniTuple(uint32, 4)`` per thread, 4 e4m3 per register, lowest k in the low byte, at
    ``mma_m16n8k32_a_position`` of the thread's warp: rows 16 w + lane // 4 (+ 8 in registers 1, 3), k 4 (lane % 4)
    (+ 16 in registers 2, 3)), B (N x 32 bytes) K-major in shared memory; imm-scale-a = imm-scale-b = 1. The FP8
    route's path: A decoded in registers (FP4 -> E4M3, ``gbs.numba_kernels.fp8_decode``)."""
    return _wgmma_register_a("wgmma_e4m3_rs", n, 32, "e4m3", "1, 1")


def _wgmma_register_a(name: str, n: int, k: int, dtype: str, tail: str):
    """An m64nNk``k`` wgmma with A (4 u32 registers per thread) from registers and B from a shared-memory
    descriptor; ``tail``: the immediates after scale_d (FP8 takes no transpose)."""
    count = _check_n(name, n)
    a_regs = ", ".join(f"${count + i}" for i in range(4))
    text = _wgmma_text(f"m64n{n}k{k}.f32.{dtype}.{dtype}", count, f"{{{a_regs}}}, ${count + 4}", tail)
    return _wgmma_intrinsic(f"{name}({n})", text, count, ("a4", "desc", "scale"),
                            "D[64x%d] (+)= A[64x%d] @ B[%dx%d], %s in, fp32 accumulate, A in "
                            "registers.\n\n" % (n, k, k, n, dtype) + _WGMMA_COMMON_DOC.format(count=count, n=n))


# ---------------------------------------------------------------------------------------------
# setmaxnreg (sm_90a and sm_100a)
# ---------------------------------------------------------------------------------------------
SETMAXNREG_MIN, SETMAXNREG_MAX, SETMAXNREG_STEP = 24, 256, 8


def _setmaxnreg(action: str, count: int):
    if not isinstance(count, int) or not (SETMAXNREG_MIN <= count <= SETMAXNREG_MAX
                                          and count % SETMAXNREG_STEP == 0):
        raise ValueError(f"setmaxnreg_{action}: count must be a multiple of {SETMAXNREG_STEP} in "
                         f"{SETMAXNREG_MIN}..{SETMAXNREG_MAX}, got {count!r}")
    verb = "Raise" if action == "inc" else "Lower"
    return void_intrinsic(
        f"setmaxnreg.{action}.sync.aligned.u32 {count};",
        f"{verb} the per-thread register limit of the calling warpgroup to {count} (producer "
        f"warpgroups dec, math warpgroups inc, so the register file is split unevenly). All "
        f"threads of the warpgroup execute it together. The kernel must be compiled with a "
        f"register bound (``cuda.jit(launch_bounds=(threads, 1))``): without one ptxas drops "
        f"setmaxnreg silently (SASS USETMAXREG appears only with it).")


@functools.cache
def setmaxnreg_inc(count: int):
    """Intrinsic ``setmaxnreg.inc.sync.aligned.u32 count;`` (count a literal, multiple of 8 in 24..256)."""
    return _setmaxnreg("inc", count)


@functools.cache
def setmaxnreg_dec(count: int):
    """Intrinsic ``setmaxnreg.dec.sync.aligned.u32 count;`` (count a literal, multiple of 8 in 24..256)."""
    return _setmaxnreg("dec", count)


# ---------------------------------------------------------------------------------------------
# Shared-memory matrix descriptor and canonical K-major layouts (pure Python: host and kernel)
# ---------------------------------------------------------------------------------------------
WGMMA_SWIZZLE_MODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
DESCRIPTOR_FIELD_MASK = 0x3FFFF  # the 18 address bits a field keeps (it stores bits 4..17)
CORE_MATRIX_BYTES = 128          # 8 rows x 16 bytes
K_STEP_BYTES = 32                # K bytes of one wgmma: k16 bf16 or k32 e4m3
INTERLEAVE_LBO = 128
INTERLEAVE_K_STEP = 256          # start address advance per K step, no swizzle
SW128_ROW_BYTES = 128
SW128_LBO = 16                   # unused by the hardware for swizzled K-major; encodes as 1
SW128_SBO = 1024
SW128_K_STEP = 32
SW128_ALIGN = 1024


def _descriptor_bits(start_addr, lbo, sbo, mode):
    """The descriptor formula, shared by the host function and the kernel intrinsic."""
    return (((start_addr & DESCRIPTOR_FIELD_MASK) >> 4) | (((lbo & DESCRIPTOR_FIELD_MASK) >> 4) << 16)
            | (((sbo & DESCRIPTOR_FIELD_MASK) >> 4) << 32) | (mode << 62))


def _swizzle_mode(swizzle) -> int:
    if swizzle not in WGMMA_SWIZZLE_MODES:
        raise ValueError(f"swizzle must be one of {list(WGMMA_SWIZZLE_MODES)}, got {swizzle!r}")
    return WGMMA_SWIZZLE_MODES[swizzle]


def wgmma_smem_descriptor(start_addr: int, lbo: int, sbo: int, swizzle: str) -> int:
    """64-bit wgmma shared-memory matrix descriptor.

    ``((start_addr & 0x3FFFF) >> 4) | ((lbo & 0x3FFFF) >> 4) << 16 | ((sbo & 0x3FFFF) >> 4) << 32
    | mode << 62`` with mode "none" 0, "128B" 1, "64B" 2, "32B" 3; base offset (bits 49-51) 0.
    start_addr: 32-bit shared address of the operand's first core matrix for this K step,
    16-byte aligned. lbo / sbo: leading / stride dimension byte offsets, multiples of 16 in
    0..0x3fff0 (their K-major meaning: module docstring).

    In kernels use ``wgmma_smem_descriptor_device`` (same formula, swizzle a string literal).
    """
    mode = _swizzle_mode(swizzle)
    for name, value in (("start_addr", start_addr), ("lbo", lbo), ("sbo", sbo)):
        if not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if start_addr % 16 or not 0 <= start_addr < 1 << 32:
        raise ValueError(f"start_addr must be a 16-byte aligned 32-bit shared address, got {start_addr:#x}")
    for name, value in (("lbo", lbo), ("sbo", sbo)):
        if value % 16 or not 0 <= value <= DESCRIPTOR_FIELD_MASK:
            raise ValueError(f"{name} must be a multiple of 16 bytes in 0..0x3fff0, got {value:#x}")
    return _descriptor_bits(int(start_addr), int(lbo), int(sbo), mode)


@intrinsic
def wgmma_smem_descriptor_device(typingctx, start_addr, lbo, sbo, swizzle):
    """``wgmma_smem_descriptor`` inside kernels: u64 from integer start_addr / lbo / sbo and a
    swizzle name that is a string literal at the call site (resolved at compile time). No
    run-time checks: start_addr's low 4 bits are dropped, lbo / sbo masked to their fields."""
    if not isinstance(swizzle, types.StringLiteral):
        return None  # Numba retries with literal argument types
    mode = _swizzle_mode(swizzle.literal_value)
    for name, ty in (("start_addr", start_addr), ("lbo", lbo), ("sbo", sbo)):
        _check_integer("wgmma_smem_descriptor_device", name, ty)
    bits_sig = types.uint64(types.uint64, types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.uint64) for v, t in zip(args[:3], sig.args[:3])]
        vals.append(context.get_constant(types.uint64, mode))
        return context.compile_internal(builder, _descriptor_bits, bits_sig, vals)

    return types.uint64(start_addr, lbo, sbo, swizzle), codegen


DESCRIPTOR_LOW_WORD = 0xFFFFFFFF
DESCRIPTOR_UNIT_BYTES = 16      # an address field counts 16-byte units (bits 4..17 of the address)


def wgmma_descriptor_advance(desc, units):
    """``desc`` with its start address moved ``units`` x ``DESCRIPTOR_UNIT_BYTES`` on (the field's unit: pass a
    byte offset // ``DESCRIPTOR_UNIT_BYTES``, a constant where possible): the low 32-bit word plus ``units``,
    the high word (stride offset, swizzle mode) untouched, so a kernel adds one integer per descriptor
    instead of rebuilding it (4 uniform instructions). The start-address field (bits 0-13) must not
    overflow: start address + offset below ``DESCRIPTOR_FIELD_MASK + 1``, which every shared address (at most
    228 KiB) is. Host and device."""
    low = np.uint32(np.uint64(desc) & np.uint64(DESCRIPTOR_LOW_WORD))
    high = np.uint64(desc) & np.uint64(~DESCRIPTOR_LOW_WORD & 0xFFFFFFFFFFFFFFFF)
    return high | np.uint64(np.uint32(low + np.uint32(units)))


def kmajor_interleave_offset(row, kbyte, row_bytes):
    """Byte offset of K byte ``kbyte`` of ``row`` in a no-swizzle K-major tile whose rows hold
    ``row_bytes`` bytes of K (a multiple of 32): core matrix (row // 8, kbyte // 16) at
    ``(row // 8) * 8 * row_bytes + (kbyte // 16) * 128``, inside it row-major 8 x 16 bytes.
    Descriptor: LBO = ``INTERLEAVE_LBO``, SBO = ``8 * row_bytes``, start + 256 B per K step."""
    return ((row // 8) * (8 * row_bytes) + (kbyte // 16) * CORE_MATRIX_BYTES
            + (row % 8) * 16 + kbyte % 16)


def kmajor_sw128_offset(row, kbyte):
    """Byte offset of K byte ``kbyte`` (0..127) of ``row`` in a 128B-swizzled K-major tile
    (128 bytes of K per row, 1024-B aligned): 16-byte chunk ``kbyte // 16`` of row r is stored at
    chunk ``(kbyte // 16) ^ (r % 8)``. Descriptor: SBO = 1024 B, start + 32 B per K step."""
    return row * SW128_ROW_BYTES + (((kbyte // 16) ^ (row % 8)) * 16) + kbyte % 16
