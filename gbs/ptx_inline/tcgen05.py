"""Blackwell (sm_100a) ``tcgen05`` instructions as Numba intrinsics: tensor-memory allocation,
block-scaled MMA, scale-factor copy, tensor-memory loads/stores, commit and fences.

Each factory returns (and caches) one intrinsic per PTX form; ``cta_group`` (1 or 2) selects
``.cta_group::1`` (one CTA) or ``.cta_group::2`` (the CTA pair: MMA over both CTAs' tensor
memory, allocation by one warp in each CTA). Build the intrinsic outside the kernel and call it
inside, e.g.::

    mma = tcgen05.mma_block_scaled("mxf4nvf4", cta_group=2)
    commit = tcgen05.commit(cta_group=2)

    @cuda.jit
    def kernel(...):
        mma(d_tmem, a_desc, b_desc, idesc, sfa_tmem, sfb_tmem, accumulate)
        commit(mbar_address)

Operand conventions (PTX ISA 9.7.16/9.7.17, "TensorCore 5th Generation Family Instructions"):

* shared-memory addresses are u32 shared-window addresses (``shared::cta``; for the
  ``shared::cluster`` mbarrier of ``commit`` a CTA-local address names the barrier in the
  executing CTA, or in each CTA of ``cta_mask`` for the multicast form);
* tensor-memory addresses are u32 ``lane << 16 | column`` (``sm100_descriptors.tmem_address``);
* shared-memory matrix descriptors are u64 (``sm100_descriptors.SmemDescriptor``), the
  instruction descriptor is u32 (``sm100_descriptors.BlockScaledInstrDesc``);
* MMA, ``cp`` and ``commit`` are issued by one thread; ``alloc``/``dealloc``/``relinquish``
  by one whole warp (``.sync.aligned``); ``ld``/``st``/``wait`` by whole warps, warp ``w % 4``
  of a warpgroup reaching TMEM lanes ``32 * (w % 4)`` to ``32 * (w % 4) + 31``.

Everything here assembles only for sm_100a-class targets; ptxas rejects it for sm_90a. There is
no Blackwell GPU in this project's reach: CI proves the forms with ptxas/nvJitLink and the SASS
(``tests/test_ptx_tcgen05.py``), not by running them.
"""
from __future__ import annotations

import functools

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from gbs.ptx_inline._llvm import F32, I32, VOID, asm, struct_to_tuple, tuple_fields, void_intrinsic
from gbs.ptx_inline.common import ptx_intrinsic
from gbs.ptx_inline.sm100_descriptors import check_cta_group, get_kind

# tcgen05.ld/st .32x32b: each thread of the warp moves .num 32-bit cells of its own lane
# (ISA table "Various-combinations of .num and .shape"): x1 .. x128.
LD_ST_32X32B_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
_ELEMENT_TYPES = {"u32": (types.uint32, I32, "r"), "f32": (types.float32, F32, "f")}


def _named(fn, name: str, doc: str):
    """Give an intrinsic's definition the name Numba shows in typing errors, and its doc."""
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


# ----------------------------------------------------------------------------------------------
# Tensor-memory allocation (ISA "Tensor Memory Allocation and Management Instructions")
# ----------------------------------------------------------------------------------------------
@functools.cache
def alloc(cta_group: int):
    """``alloc(smem_dst, ncols)``: allocate ``ncols`` TMEM columns (a power of 2 in [32, 512])
    and write their base address (lane 0, first column) to the u32 at shared address
    ``smem_dst``. One whole warp executes it; with cta_group 2 one warp in each CTA of the pair.
    SASS: ``UTCATOMSWS.FIND_AND_SET.ALIGN`` (``UTCATOMSWS.2CTA...`` for cta_group 2)."""
    check_cta_group(cta_group)
    return ptx_intrinsic(
        f"tcgen05_alloc_cta_group{cta_group}",
        f"tcgen05.alloc.cta_group::{cta_group}.sync.aligned.shared::cta.b32 [$0], $1;",
        [("smem_dst", "u32"), ("ncols", "u32")], doc=alloc.__doc__)


@functools.cache
def dealloc(cta_group: int):
    """``dealloc(taddr, ncols)``: free ``ncols`` TMEM columns from address ``taddr``; all of a
    kernel's allocations must be freed before it exits. SASS: ``UTCATOMSWS.AND``."""
    check_cta_group(cta_group)
    return ptx_intrinsic(
        f"tcgen05_dealloc_cta_group{cta_group}",
        f"tcgen05.dealloc.cta_group::{cta_group}.sync.aligned.b32 $0, $1;",
        [("taddr", "u32"), ("ncols", "u32")], doc=dealloc.__doc__)


@functools.cache
def relinquish_alloc_permit(cta_group: int):
    """``relinquish_alloc_permit()``: this CTA (pair) will not allocate again, letting other
    CTAs on the SM allocate without waiting. SASS: ``UVIRTCOUNT.DEALLOC.SMPOOL``."""
    check_cta_group(cta_group)
    return void_intrinsic(f"tcgen05.relinquish_alloc_permit.cta_group::{cta_group}.sync.aligned;",
                          relinquish_alloc_permit.__doc__)


# ----------------------------------------------------------------------------------------------
# Block-scaled MMA (ISA "tcgen05.mma", "Block Scaling")
# ----------------------------------------------------------------------------------------------
def mma_block_scaled_ptx(kind: str, cta_group: int) -> str:
    """The PTX of ``mma_block_scaled(kind, cta_group)`` in LLVM inline-asm form (``$N`` operands)."""
    spec = get_kind(kind)
    check_cta_group(cta_group)
    # enable_input_d is a predicate operand: build it from the u32 argument inside a scope.
    return ("{\n.reg .pred p;\nsetp.ne.b32 p, $6, 0;\n"
            f"tcgen05.mma.cta_group::{cta_group}.kind::{spec.name}.block_scale.scale_vec::{spec.scale_vec}X "
            "[$0], $1, $2, $3, [$4], [$5], p;\n}")


@functools.cache
def mma_block_scaled(kind: str, cta_group: int):
    """``mma(d_tmem, a_desc, b_desc, idesc, scale_a_tmem, scale_b_tmem, accumulate)``: one
    block-scaled MMA, D (f32, TMEM) = (A * scale_A) x (B * scale_B) [+ D if ``accumulate`` != 0].

    A and B come from shared memory through u64 descriptors, the scales from TMEM (copied there
    by ``cp_32x128b_warpx4``), ``idesc`` is the u32 instruction descriptor. ``kind`` and its
    scale-vector qualifier (``sm100_descriptors.BLOCK_SCALED_KINDS``):

    * ``"mxf4nvf4"`` -> ``.kind::mxf4nvf4.block_scale.scale_vec::4X`` (NVFP4: block 16, UE4M3;
      ptxas requires the qualifier for this kind), K = 64, SASS ``UTCOMMA.4X``;
    * ``"mxf4"`` -> ``.kind::mxf4.block_scale.scale_vec::2X`` (MXFP4: block 32, UE8M0; 2X is
      also what ptxas assumes without a qualifier, 4X is rejected), K = 64, SASS ``UTCOMMA``;
    * ``"mxf8f6f4"`` -> ``.kind::mxf8f6f4.block_scale.scale_vec::1X`` (MXFP8 and W4A8, block 32,
      UE8M0; 1X is the default), K = 32, SASS ``UTCQMMA``.

    (The PTX 8.8+ aliases ``.block16`` / ``.block32`` assemble to the same SASS.)

    cta_group 2 adds ``.2CTA`` to the SASS opcode: the even CTA of the pair issues an MMA over
    both CTAs' shared and tensor memory.
    """
    return ptx_intrinsic(
        f"tcgen05_mma_{get_kind(kind).name}_cta_group{cta_group}",
        mma_block_scaled_ptx(kind, cta_group),
        [("d_tmem", "u32"), ("a_desc", "u64"), ("b_desc", "u64"), ("idesc", "u32"),
         ("scale_a_tmem", "u32"), ("scale_b_tmem", "u32"), ("accumulate", "u32")],
        doc=mma_block_scaled.__doc__)


# ----------------------------------------------------------------------------------------------
# Scale factors shared memory -> tensor memory (ISA "tcgen05.cp")
# ----------------------------------------------------------------------------------------------
@functools.cache
def cp_32x128b_warpx4(cta_group: int):
    """``cp(taddr, sdesc)``: copy 32 rows x 16 bytes (one 512-byte 128x4 scale atom) described by
    the u64 shared-memory descriptor ``sdesc`` into TMEM at ``taddr``, replicated to the four
    32-lane partitions: 4 columns x 128 lanes (``sm100_descriptors.scale_atom_tmem_cell``).
    Asynchronous, ordered before later MMAs of the same thread. SASS
    ``UTCCP.T.S.4x32dp128bit`` (``UTCCP.T.S.2CTA...`` for cta_group 2)."""
    check_cta_group(cta_group)
    return ptx_intrinsic(f"tcgen05_cp_32x128b_warpx4_cta_group{cta_group}",
                         f"tcgen05.cp.cta_group::{cta_group}.32x128b.warpx4 [$0], $1;",
                         [("taddr", "u32"), ("sdesc", "u64")], doc=cp_32x128b_warpx4.__doc__)


# ----------------------------------------------------------------------------------------------
# Tensor memory <-> registers (ISA "tcgen05.ld", "tcgen05.st", "tcgen05.wait")
# ----------------------------------------------------------------------------------------------
def _check_count(count: int) -> int:
    if count not in LD_ST_32X32B_COUNTS:
        raise ValueError(f"tcgen05 .32x32b count must be one of {LD_ST_32X32B_COUNTS}, got {count!r}")
    return count


def _check_element_type(element: str):
    if element not in _ELEMENT_TYPES:
        raise ValueError(f"element must be one of {sorted(_ELEMENT_TYPES)}, got {element!r}")
    return _ELEMENT_TYPES[element]


@functools.cache
def ld_32x32b(count: int, element: str = "f32"):
    """``ld(taddr) -> UniTuple(element, count)``: each thread of the warp reads ``count``
    consecutive 32-bit TMEM columns from ``taddr`` in its own lane (lane = the warp's
    32-lane partition base + lane id; ``taddr`` holds the partition's first lane). ``element``
    ``"f32"`` (accumulators) or ``"u32"`` (raw bits). Asynchronous: ``wait_ld()`` before using
    the values. SASS ``LDTM.x{count}`` (``LDTM`` for 1)."""
    _check_count(count)
    numba_type, llvm_type, constraint = _check_element_type(element)
    tuple_type = types.UniTuple(numba_type, count)
    regs = ", ".join(f"${i}" for i in range(count))
    text = f"tcgen05.ld.sync.aligned.32x32b.x{count}.b32 {{{regs}}}, [${count}];"
    constraints = ",".join([f"={constraint}"] * count + ["r"])
    # one output: LLVM inline asm returns the scalar itself, not a one-field struct
    ret = llvm_type if count == 1 else ir.LiteralStructType([llvm_type] * count)

    def _ld(typingctx, taddr):
        if not isinstance(taddr, types.Integer):
            raise TypeError(f"tcgen05 ld: taddr must be an integer (u32 TMEM address), got {taddr}")

        def codegen(context, builder, sig, args):
            value = asm(builder, ret, [I32], text, constraints, list(args))
            if count == 1:
                return context.make_tuple(builder, sig.return_type, [value])
            return struct_to_tuple(context, builder, sig.return_type, value, count)

        return tuple_type(types.uint32), codegen

    return intrinsic(_named(_ld, f"tcgen05_ld_32x32b_x{count}_{element}",
                            f"{ld_32x32b.__doc__}\n\nPTX: ``{text}``"))


@functools.cache
def st_32x32b(count: int):
    """``st(taddr, values)``: each thread of the warp writes the ``count`` 32-bit values of the
    ``UniTuple`` ``values`` (uint32 or float32) to consecutive TMEM columns from ``taddr`` in its
    own lane. Asynchronous: ``wait_st()`` before an MMA or another thread reads them. SASS
    ``STTM.x{count}``."""
    _check_count(count)
    regs = ", ".join(f"${i + 1}" for i in range(count))
    text = f"tcgen05.st.sync.aligned.32x32b.x{count}.b32 [$0], {{{regs}}};"

    def _st(typingctx, taddr, values):
        if not isinstance(taddr, types.Integer):
            raise TypeError(f"tcgen05 st: taddr must be an integer (u32 TMEM address), got {taddr}")
        if not (isinstance(values, types.UniTuple) and values.count == count
                and values.dtype in (types.uint32, types.float32)):
            raise TypeError(f"tcgen05 st x{count}: values must be a UniTuple of {count} uint32 or "
                            f"float32, got {values}")
        numba_type = values.dtype
        llvm_type, constraint = (F32, "f") if numba_type == types.float32 else (I32, "r")

        def codegen(context, builder, sig, args):
            fields = tuple_fields(builder, args[1], count)
            asm(builder, VOID, [I32] + [llvm_type] * count, text, ",".join(["r"] + [constraint] * count),
                [args[0]] + fields)
            return context.get_dummy_value()

        return types.void(types.uint32, values), codegen

    return intrinsic(_named(_st, f"tcgen05_st_32x32b_x{count}",
                            f"{st_32x32b.__doc__}\n\nPTX: ``{text}``"))


wait_ld = void_intrinsic("tcgen05.wait::ld.sync.aligned;",
                         "Wait until this thread's earlier ``tcgen05.ld`` results are in registers.")
wait_st = void_intrinsic("tcgen05.wait::st.sync.aligned;",
                         "Wait until this thread's earlier ``tcgen05.st`` writes are done.")


# ----------------------------------------------------------------------------------------------
# Completion and ordering (ISA "tcgen05.commit", "tcgen05.fence")
# ----------------------------------------------------------------------------------------------
@functools.cache
def commit(cta_group: int):
    """``commit(mbar)``: make the mbarrier at shared address ``mbar`` track completion of all
    earlier asynchronous tcgen05 operations (mma, cp) of this thread: one arrive when they are
    done. SASS ``UTCBAR`` (``UTCBAR.2CTA`` for cta_group 2)."""
    check_cta_group(cta_group)
    return ptx_intrinsic(
        f"tcgen05_commit_cta_group{cta_group}",
        f"tcgen05.commit.cta_group::{cta_group}.mbarrier::arrive::one.shared::cluster.b64 [$0];",
        [("mbar", "u32")], doc=commit.__doc__)


@functools.cache
def commit_multicast(cta_group: int):
    """``commit_multicast(mbar, cta_mask)``: as ``commit``, arriving on the mbarrier at the same
    shared offset ``mbar`` in every CTA of the cluster whose bit is set in the 16-bit
    ``cta_mask`` (e.g. both CTAs of a pair: 0b11). SASS ``UTCBAR.MULTICAST``
    (``UTCBAR.2CTA.MULTICAST``)."""
    check_cta_group(cta_group)
    return ptx_intrinsic(
        f"tcgen05_commit_multicast_cta_group{cta_group}",
        f"tcgen05.commit.cta_group::{cta_group}.mbarrier::arrive::one.shared::cluster"
        ".multicast::cluster.b64 [$0], $1;",
        [("mbar", "u32"), ("cta_mask", "u16")], doc=commit_multicast.__doc__)


fence_before_thread_sync = void_intrinsic(
    "tcgen05.fence::before_thread_sync;",
    "Order this thread's earlier tcgen05 operations before a following thread synchronization "
    "(barrier, mbarrier arrive) - e.g. after the MMA warp's commit, before signalling.")
fence_after_thread_sync = void_intrinsic(
    "tcgen05.fence::after_thread_sync;",
    "Order this thread's later tcgen05 operations after a preceding thread synchronization "
    "(barrier, mbarrier wait) - e.g. after waiting on a full barrier, before issuing MMAs.")
