"""Thread identity, shared-memory addresses, proxy fences, named barriers, grid dependency control
(programmatic dependent launch), predicated global stores and the run-time check ``trap_if_nonzero`` (sm_90a and
sm_100a); plus ``ptx_intrinsic``, the builder of fixed-operand intrinsics that the instruction-family modules use.

Every intrinsic here wraps one PTX instruction (or, for addresses and ``warp_index``, a few LLVM
instructions with no PTX of their own; for the predicated forms, a ``setp`` and the guarded
instruction) and is called from inside ``@cuda.jit`` kernels.

Constraints that hold for the whole module:
- Shared-memory addresses are the 32-bit offsets into the CTA's shared window (what
  ``__cvta_generic_to_shared`` gives in CUDA C++); every mbarrier, TMA, wgmma and ldmatrix
  intrinsic of this package takes addresses in that form.
- ``warp_index`` assumes a 1-D block (``blockDim.y == blockDim.z == 1``), which all kernels of
  this package use; ``%warpid`` is not used because the PTX ISA says it may change during
  execution (it names the hardware slot, not the logical warp).
"""
from __future__ import annotations

from llvmlite import ir
from numba.cuda import nvvmutils, types
from numba.cuda.extending import intrinsic

from ._llvm import F32, I16, I32, I64, VOID, asm, pure_asm, special_register_u32, void_intrinsic

WARP_SIZE = 32
_LOG2_WARP_SIZE = 5
FULL_WARP_MASK = 0xFFFFFFFF
# Shared-memory LLVM address space of NVPTX (generic is 0).
_SHARED_ADDRSPACE = 3

laneid = special_register_u32(
    "%laneid", "Lane of the calling thread within its warp, 0..31 (u32).")


@intrinsic
def warp_index(typingctx):
    """Logical warp index of the calling thread in a 1-D block: ``threadIdx.x // 32`` (u32).

    Derived from ``%tid.x`` rather than ``%warpid``, which the PTX ISA documents as volatile.
    """
    def codegen(context, builder, sig, args):
        tid = nvvmutils.call_sreg(builder, "tid.x")
        return builder.lshr(tid, ir.Constant(I32, _LOG2_WARP_SIZE))

    return types.uint32(), codegen


@intrinsic
def elect_one_sync(typingctx):
    """1 in exactly one active lane of the full warp, 0 in the others (u32).

    PTX: ``elect.sync _|P, 0xffffffff;`` then ``selp.u32 $0, 1, 0, P;``. All 32 lanes must execute
    it together (``.sync`` with the full member mask). Use it to pick the one thread that issues
    TMA copies or mbarrier arrivals in a warp-uniform branch without comparing lane ids.
    """
    text = (f"{{\n .reg .pred elected;\n elect.sync _|elected, {FULL_WARP_MASK:#x};\n"
            " selp.u32 $0, 1, 0, elected;\n}")

    def codegen(context, builder, sig, args):
        return asm(builder, I32, [], text, "=r", [])

    return types.uint32(), codegen


def _check_array(name, arr):
    if not isinstance(arr, types.Array):
        raise TypeError(f"{name}: expected a shared-memory array (cuda.shared.array), got {arr}")


def _shared_u32(builder, pointer):
    """Generic pointer -> 32-bit shared-window address (addrspacecast to 3, ptrtoint)."""
    byte_ptr = builder.bitcast(pointer, ir.IntType(8).as_pointer())
    shared_ptr = builder.addrspacecast(byte_ptr, ir.IntType(8).as_pointer(_SHARED_ADDRSPACE))
    return builder.ptrtoint(shared_ptr, I32)


@intrinsic
def shared_address(typingctx, arr):
    """32-bit shared-window address of ``arr[0]`` (u32) for an array made by ``cuda.shared.array``.

    Lowered as ``addrspacecast`` of the data pointer to the shared address space, then
    ``ptrtoint`` to i32 (``cvta.to.shared.u32`` in PTX, often folded away). The array MUST live
    in shared memory: for a global array the result is meaningless.
    """
    _check_array("shared_address", arr)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return _shared_u32(builder, array.data)

    return types.uint32(arr), codegen


@intrinsic
def shared_element_address(typingctx, arr, index):
    """32-bit shared-window address of ``arr[index]`` of a 1-D shared array (u32).

    ``index`` counts elements (not bytes); no bounds check. Same lowering as ``shared_address``
    plus an in-bounds GEP, so the address arithmetic happens in 32 bits.
    """
    _check_array("shared_element_address", arr)
    if arr.ndim != 1:
        raise TypeError(f"shared_element_address: expected a 1-D shared array, got {arr.ndim}-D")
    if not isinstance(index, types.Integer):
        raise TypeError(f"shared_element_address: index must be an integer, got {index}")

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        return _shared_u32(builder, builder.gep(array.data, [idx], inbounds=True))

    return types.uint32(arr, index), codegen


@intrinsic
def generic_address(typingctx, arr):
    """64-bit generic address of ``arr[0]`` (u64) for any device array.

    For global arrays this is the global address (CUDA maps global memory identically into the
    generic space), the form ``cp.async``, ``ld.global.nc`` and the TMA tensor-map operand take.
    """
    if not isinstance(arr, types.Array):
        raise TypeError(f"generic_address: expected a device array, got {arr}")

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(array.data, I64)

    return types.uint64(arr), codegen


fence_proxy_async_shared_cta = void_intrinsic(
    "fence.proxy.async.shared::cta;",
    "Order this thread's generic-proxy shared-memory accesses (st.shared, mbarrier.init) before "
    "later async-proxy accesses (TMA, wgmma operand reads) of the CTA's shared memory. Issue it "
    "in the writing threads, then synchronise (bar.sync / mbarrier) before the async operation.")

fence_mbarrier_init_release_cluster = void_intrinsic(
    "fence.mbarrier_init.release.cluster;",
    "Make prior mbarrier.init of this thread visible cluster-wide (release, cluster scope) "
    "before a cluster barrier, so that remote arrivals and multicast TMA completions never hit "
    "an uninitialised barrier.")


# ---------------------------------------------------------------------------------------------
# Builder for the fixed-operand intrinsics of the instruction-family modules
# ---------------------------------------------------------------------------------------------
# operand kind -> (numba type, LLVM type, inline-asm constraint letter)
OPERAND_KINDS = {
    "u16": (types.uint16, I16, "h"),
    "u32": (types.uint32, I32, "r"),
    "s32": (types.int32, I32, "r"),
    "u64": (types.uint64, I64, "l"),
    "f32": (types.float32, F32, "f"),
}


def ptx_intrinsic(name: str, text: str, operands, *, result: str | None = None, memory: bool = True,
                  pure: bool = False, doc: str):
    """An intrinsic emitting ``text`` with fixed-kind operands, e.g. ``[("mbar", "u32"), ("count", "u32")]``.

    Each argument may be any Numba integer (any float for ``f32``); it is converted to the operand's
    kind (``u16``, ``u32``, ``s32``, ``u64``, ``f32``, see ``OPERAND_KINDS``) before the asm. In ``text`` the result, if
    any, is ``$0`` and the operands follow in order (LLVM numbers outputs first). ``memory``
    adds the ``~{memory}`` clobber (keep it for anything that touches memory or orders it).
    ``pure`` emits register-only arithmetic through ``_llvm.pure_asm`` (no side effect, no
    clobber, ``memory`` ignored): LLVM deletes it when its result is unused, so it needs a ``result``.
    """
    kinds = [kind for _, kind in operands]
    for kind in kinds + ([result] if result else []):
        if kind not in OPERAND_KINDS:
            raise ValueError(f"{name}: operand kind {kind!r} not one of {sorted(OPERAND_KINDS)}")
    if pure and not result:
        raise ValueError(f"{name}: a pure intrinsic needs a result (LLVM drops pure asm whose result is unused)")
    names = [arg for arg, _ in operands]
    nb_types = [OPERAND_KINDS[k][0] for k in kinds]
    ll_types = [OPERAND_KINDS[k][1] for k in kinds]
    constraints = [OPERAND_KINDS[k][2] for k in kinds]
    if result:
        ret_nb, ret_ll, ret_letter = OPERAND_KINDS[result]
        constraints = ["=" + ret_letter] + constraints
    else:
        ret_nb, ret_ll = types.void, VOID
    constraint_text = ",".join(constraints)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, want) for v, t, want in zip(args, sig.args, nb_types)]
        if pure:
            out = pure_asm(builder, ret_ll, ll_types, text, constraint_text, vals)
        else:
            out = asm(builder, ret_ll, ll_types, text, constraint_text, vals, memory=memory)
        return out if result else context.get_dummy_value()

    def typer(*arg_types):
        for arg, ty, kind in zip(names, arg_types, kinds):
            want = types.Float if kind == "f32" else types.Integer
            if not isinstance(ty, want):
                raise TypeError(f"{name}: argument {arg!r} must be {'a float' if kind == 'f32' else 'an integer'}, "
                                f"got {ty}")
        return ret_nb(*arg_types), codegen

    # numba-cuda 0.30.4 types but does not lower a *args intrinsic: spell the parameters out.
    params = ", ".join(names)
    namespace = {"typer": typer}
    exec(f"def {name}(typingctx, {params}):\n    return typer({params})\n", namespace)
    template = namespace[name]
    template.__doc__ = f"{doc}\n\nPTX: ``{text}``"
    return intrinsic(template)


read_globaltimer = ptx_intrinsic(
    "read_globaltimer", "mov.u64 $0, %globaltimer;", [], result="u64",
    doc="The GPU's global nanosecond timer (u64; the same clock on every SM: for timelines across CTAs).")

read_clock64 = ptx_intrinsic(
    "read_clock64", "mov.u64 $0, %clock64;", [], result="u64",
    doc="This SM's cycle counter (u64; compare readings of one CTA only: SM counters are not synchronised).")

load_global_u64 = ptx_intrinsic(
    "load_global_u64", "ld.global.u64 $0, [$1];", [("address", "u64")], result="u64",
    doc="64-bit load from the 8-byte aligned global address ``address``.")

store_global_u64 = ptx_intrinsic(
    "store_global_u64", "st.global.u64 [$0], $1;", [("address", "u64"), ("value", "u64")],
    doc="64-bit store of ``value`` at the 8-byte aligned global address ``address``.")


warp_max_u32 = ptx_intrinsic(
    "warp_max_u32", "redux.sync.max.u32 $0, $1, 0xffffffff;", [("value", "u32")], result="u32", memory=False,
    doc="The largest ``value`` of the full warp, in every lane (``redux.sync``, sm_80+; every lane must call it).")


named_barrier_sync = ptx_intrinsic(
    "named_barrier_sync", "bar.sync $0, $1;", [("barrier_id", "u32"), ("nthreads", "u32")],
    doc="""Wait at named barrier ``barrier_id`` until ``nthreads`` threads have arrived.

``bar.sync`` is ``barrier.sync.aligned``: all threads of a warp execute it together.
``barrier_id`` in 1..15 (0 is the one ``cuda.syncthreads()`` uses); ``nthreads`` a multiple of
32 (every thread of an arriving warp counts).""")

named_barrier_arrive = ptx_intrinsic(
    "named_barrier_arrive", "bar.arrive $0, $1;", [("barrier_id", "u32"), ("nthreads", "u32")],
    doc="""Arrive at named barrier ``barrier_id`` without waiting (the producer side of a hand-off).

Same operand rules as ``named_barrier_sync``; arriving and waiting warps must use the same
``nthreads``.""")


# ---------------------------------------------------------------------------------------------
# Grid dependency control (programmatic dependent launch, PTX ISA 7.8, sm_90+). A launch with the
# programmatic-stream-serialization attribute may start while the kernel before it in the stream still
# runs; both instructions do nothing in a launch without that dependency.
# ---------------------------------------------------------------------------------------------
griddepcontrol_wait = void_intrinsic(
    "griddepcontrol.wait;",
    "Wait until every prerequisite grid (the kernel before a programmatic dependent launch) has completed and "
    "its memory operations are visible to this grid. Every thread that touches global memory another kernel "
    "may write must execute it before that access (SASS: ACQBULK).")

griddepcontrol_launch_dependents = void_intrinsic(
    "griddepcontrol.launch_dependents;",
    "Let the grid launched after this one with a programmatic dependency be scheduled once every CTA of this "
    "grid has executed this or exited; it says nothing about this grid's memory (the dependent's "
    "``griddepcontrol_wait`` does). One thread per CTA is enough: more have no further effect (SASS: PREEXIT).")

# ---------------------------------------------------------------------------------------------
# Predicated global stores and reductions: branch-free epilogue bodies (NVVM unrolls them fully,
# so accumulator arrays stay in registers; an ``if`` around each access would stop the unrolling
# of large tiles and send the accumulators to local memory)
# ---------------------------------------------------------------------------------------------
store_global_u16_if = ptx_intrinsic(
    "store_global_u16_if",
    "{\n .reg .pred p;\n setp.ne.u32 p, $2, 0;\n @p st.global.u16 [$0], $1;\n}",
    [("address", "u64"), ("value", "u16"), ("predicate", "u32")],
    doc="Store the 16-bit ``value`` at the global address ``address`` if ``predicate`` is nonzero.")

store_global_u16x2_if = ptx_intrinsic(
    "store_global_u16x2_if",
    "{\n .reg .pred pp, pl, ph;\n .reg .b32 w;\n setp.ne.u32 pp, $3, 0;\n setp.ne.u32 pl, $4, 0;\n"
    " setp.ne.u32 ph, $5, 0;\n mov.b32 w, {$1, $2};\n @pp st.global.b32 [$0], w;\n"
    " @pl st.global.u16 [$0], $1;\n @ph st.global.u16 [$0+2], $2;\n}",
    [("address", "u64"), ("lo", "u16"), ("hi", "u16"), ("pair", "u32"), ("lo_only", "u32"), ("hi_only", "u32")],
    doc="""Store two adjacent 16-bit values at global ``address`` (``lo``) and ``address + 2`` (``hi``):
one 32-bit store if ``pair`` is nonzero (the caller guarantees both are wanted and ``address`` is
4-byte aligned), else ``lo`` alone if ``lo_only`` and ``hi`` alone if ``hi_only`` are nonzero.""")

red_add_f32_if = ptx_intrinsic(
    "red_add_f32_if",
    "{\n .reg .pred p;\n setp.ne.u32 p, $2, 0;\n @p red.global.add.f32 [$0], $1;\n}",
    [("address", "u64"), ("value", "f32"), ("predicate", "u32")],
    doc="Atomically add ``value`` to the f32 at global ``address`` (no result) if ``predicate`` is nonzero.")

load_global_cg_f32_if = ptx_intrinsic(
    "load_global_cg_f32_if",
    "{\n .reg .pred p;\n setp.ne.u32 p, $2, 0;\n mov.b32 $0, 0;\n @p ld.global.cg.f32 $0, [$1];\n}",
    [("address", "u64"), ("predicate", "u32")], result="f32",
    doc="""If ``predicate`` is nonzero, the f32 at global ``address`` read from L2 (``.cg``: never a stale L1 line);
else +0. A plain load: the caller orders it after the writers' reductions (their fences, an atomic counter, a
fence before this). Loads issued back to back overlap their latencies, where an ``atom.exch`` per word, each
used at once, waits in turn.""")

store_global_cg_zero_u32_if = ptx_intrinsic(
    "store_global_cg_zero_u32_if",
    "{\n .reg .pred p;\n .reg .b32 z;\n setp.ne.u32 p, $1, 0;\n mov.b32 z, 0;\n"
    " @p st.global.cg.b32 [$0], z;\n}",
    [("address", "u64"), ("predicate", "u32")],
    doc="If ``predicate`` is nonzero, store +0 (all 32 bits clear) at global ``address``, cached in L2 only.")

# ---------------------------------------------------------------------------------------------
# Run-time checks
# ---------------------------------------------------------------------------------------------
trap_if_nonzero = ptx_intrinsic(
    "trap_if_nonzero", "{\n .reg .pred p;\n setp.ne.u32 p, $0, 0;\n @p trap;\n}", [("value", "u32")],
    doc="Abort the kernel (``trap``: the launch fails with an error) if ``value`` is nonzero.")
