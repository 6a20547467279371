"""The start-up trace of the H200 streaming kernel: a diagnostic build, chosen at compile time
(``StreamSpec.trace``; ``gbs.plan.plan_h200(..., trace=True)``), never what ``"auto"`` plans.

A traced launch writes, per CTA and event (``TRACE_EVENTS``), one record of (``%globaltimer`` ns, ``%clock64``
cycles): the producer's first thread stamps the producer's chain (``TRACE_PRODUCER_CHAIN``: from the CTA's
entry through the mbarrier init, the tensor-map prefetch, the first work item, the first free slot and the
first TMA issue to its exit), lane 0 of consumer warp 0 the consumers' (``TRACE_CONSUMER_CHAIN``: ready, the
first full stage, the first release, the first epilogue, exit). Events a CTA never reaches stay 0. The entry is
stamped after the kernel's ``griddepcontrol.wait`` (``h200_ring``): under a programmatic dependent launch it marks
the end of the kernel before, not the CTA's start.
``trace_phases`` turns one launch's buffer into per-CTA phase durations; ``scripts/h200_stream_sweep.py
--trace`` runs it beside a timed point. The buffer's address travels in one more 128-byte slot after the
tensor maps (``TRACE_ADDRESS_OFFSET``), so the kernel signature stays the same for every build.

The hooks (``make_trace``): the ring and the kernel body call ``begin`` at the first event of a thread's chain
and ``stamp`` at each later one, one line per event. ``begin(tensor_maps, event, stamps)`` records ``event``
when ``stamps`` (this thread is the chain's stamping thread) and returns what is still pending for the thread:
every other event, or nothing; ``stamp(tensor_maps, event, pending)`` records ``event`` if it is pending and
returns ``pending`` without it, so each event is stamped once per CTA however often its site runs (the first
work item, slot, TMA, full stage, release and epilogue of the CTA). An untraced build gets hooks that do
nothing (``begin`` returns 0, ``stamp`` its ``pending``), written as intrinsics that emit no IR: the calls and
the pending word leave no trace in the module, so its SASS is that of a kernel without the sites (checked
build by build when the trace moved here).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda import types
from numba.cuda.extending import intrinsic

from gbs.ptx_inline import common as cm
from gbs.ptx_inline import copy as cp

TRACE_EVENTS = ("entry", "barriers_ready", "maps_ready", "producer_work_found", "first_slot_free",
                "first_tma_issued", "producer_exit", "consumer_ready", "first_full", "first_release",
                "first_epilogue", "consumer_exit")
(TRACE_ENTRY, TRACE_BARRIERS, TRACE_MAPS, TRACE_PRODUCER_WORK, TRACE_FIRST_SLOT, TRACE_FIRST_TMA,
 TRACE_PRODUCER_EXIT, TRACE_CONSUMER_READY, TRACE_FIRST_FULL, TRACE_FIRST_RELEASE, TRACE_FIRST_EPILOGUE,
 TRACE_CONSUMER_EXIT) = range(len(TRACE_EVENTS))
# the producer's chain, then the consumers' (both start at the CTA's entry; the first TMA feeds the first full)
TRACE_PRODUCER_CHAIN = (TRACE_ENTRY, TRACE_BARRIERS, TRACE_MAPS, TRACE_PRODUCER_WORK, TRACE_FIRST_SLOT,
                        TRACE_FIRST_TMA, TRACE_PRODUCER_EXIT)
TRACE_CONSUMER_CHAIN = (TRACE_ENTRY, TRACE_CONSUMER_READY, TRACE_FIRST_FULL, TRACE_FIRST_RELEASE,
                        TRACE_FIRST_EPILOGUE, TRACE_CONSUMER_EXIT)
TRACE_RECORD_WORDS = 2         # u64 globaltimer, u64 clock64
TRACE_ALL_EVENTS = (1 << len(TRACE_EVENTS)) - 1   # the pending word: bit e = event e still to stamp
TENSOR_MAPS_BEFORE_SLOT = 4    # the kernels' tensor maps (``h200_ring.NUM_TENSOR_MAPS``, which checks it)
TRACE_ADDRESS_OFFSET = np.uint64(cp.TENSOR_MAP_BYTES * TENSOR_MAPS_BEFORE_SLOT)   # the slot after the maps


def _device(func):
    return cuda.jit(device=True, forceinline=True)(func)


# The untraced build's hooks: intrinsics, not device functions, so that nothing of them reaches the module (a
# device function, even one that compiles to no instruction, leaves its environment's declaration in the
# PTX, and those declarations alone changed ptxas's code for a wgmma build).
@intrinsic
def _begin_nothing(typingctx, tensor_maps, event, stamps):
    """``begin`` of an untraced build: nothing pending."""
    def codegen(context, builder, signature, args):
        return context.get_constant(types.uint32, 0)

    return types.uint32(tensor_maps, event, stamps), codegen


@intrinsic
def _stamp_nothing(typingctx, tensor_maps, event, pending):
    """``stamp`` of an untraced build: ``pending`` as it was."""
    def codegen(context, builder, signature, args):
        return args[2]

    return pending(tensor_maps, event, pending), codegen


@dataclass(frozen=True)
class TraceHooks:
    """The trace's device functions of one build (``make_trace``)."""

    begin: object   # (tensor_maps, event, stamps) -> pending: the first event of a thread's chain
    stamp: object   # (tensor_maps, event, pending) -> pending: a later event, once per CTA


def make_trace(enabled: bool) -> TraceHooks:
    """The hooks of a traced build (``enabled``: device functions, a fresh set per call like the ring's) or of an
    untraced one (intrinsics that emit nothing)."""
    if not enabled:
        return TraceHooks(_begin_nothing, _stamp_nothing)

    @_device
    def record(tensor_maps, event):
        """This CTA's record of ``event`` in the trace buffer."""
        record = (np.uint64(cuda.blockIdx.x) * np.uint64(len(TRACE_EVENTS)) + np.uint64(event)) * np.uint64(
            8 * TRACE_RECORD_WORDS)
        address = cm.load_global_u64(tensor_maps + TRACE_ADDRESS_OFFSET) + record
        cm.store_global_u64(address, cm.read_globaltimer())
        cm.store_global_u64(address + np.uint64(8), cm.read_clock64())

    @_device
    def begin(tensor_maps, event, stamps):
        pending = np.uint32(0)
        if stamps:
            record(tensor_maps, event)
            pending = np.uint32(TRACE_ALL_EVENTS ^ (1 << event))
        return pending

    @_device
    def stamp(tensor_maps, event, pending):
        if pending & np.uint32(1 << event):
            record(tensor_maps, event)
        return np.uint32(pending & np.uint32(TRACE_ALL_EVENTS ^ (1 << event)))

    return TraceHooks(begin, stamp)


def trace_phases(records: np.ndarray) -> dict[str, np.ndarray]:
    """Per-CTA durations (ns, float; NaN where an event was not reached) between consecutive events of the
    producer's chain and of the consumers' chain (``TRACE_PRODUCER_CHAIN`` / ``TRACE_CONSUMER_CHAIN``) in one
    launch's trace buffer copied to the host (``(ctas, events, 2)`` u64: globaltimer, clock64), keyed
    "event_a -> event_b", plus "first_tma_issued -> first_full" (the first load's latency), "launch span" (first
    entry to last exit, one value) and "entry skew" (each CTA's entry after the first CTA's)."""
    records = np.asarray(records)
    if records.ndim != 3 or records.shape[1:] != (len(TRACE_EVENTS), TRACE_RECORD_WORDS):
        raise ValueError(f"want one launch's (ctas, {len(TRACE_EVENTS)}, {TRACE_RECORD_WORDS}) trace, "
                         f"got {records.shape}")
    ns = np.where(records[:, :, 0] == 0, np.nan, records[:, :, 0].astype(np.float64))
    entry = ns[:, TRACE_ENTRY]
    phases = {"entry skew": entry - np.nanmin(entry)}
    for chain in (TRACE_PRODUCER_CHAIN, TRACE_CONSUMER_CHAIN):
        for a, b in zip(chain, chain[1:]):
            phases[f"{TRACE_EVENTS[a]} -> {TRACE_EVENTS[b]}"] = ns[:, b] - ns[:, a]
    phases["first_tma_issued -> first_full"] = ns[:, TRACE_FIRST_FULL] - ns[:, TRACE_FIRST_TMA]
    last_exit = np.nanmax(np.fmax(ns[:, TRACE_CONSUMER_EXIT], ns[:, TRACE_PRODUCER_EXIT]))
    phases["launch span"] = np.array([last_exit - np.nanmin(entry)])
    return phases


def trace_buffer(num_ctas: int, stream=0):
    """(buffer, slot): a zeroed ``(num_ctas, TRACE_EVENTS, TRACE_RECORD_WORDS)`` u64 device buffer (events a CTA
    never reaches read 0) and the 128-byte image that carries its address in the slot after the tensor maps
    (``TRACE_ADDRESS_OFFSET``), for a trace build's launch."""
    from numba.cuda.cudadrv.driver import device_memset

    from gbs.numba_kernels import launch

    buffer = cuda.device_array((num_ctas, len(TRACE_EVENTS), TRACE_RECORD_WORDS), np.uint64, stream=stream)
    device_memset(buffer, 0, buffer.nbytes, stream=stream)
    slot = np.zeros(cp.TENSOR_MAP_BYTES, np.uint8)
    slot[:8] = np.array([launch.device_address(buffer)], np.uint64).view(np.uint8)
    return buffer, slot
