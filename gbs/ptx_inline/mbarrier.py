"""mbarrier intrinsics: the shared-memory transaction barriers that TMA copies and pipelines use.

An mbarrier is a 64-bit word in shared memory (``cuda.shared.array(1, np.uint64)``, 8-byte
aligned); every intrinsic takes its 32-bit shared-window address (``common.shared_address``).
A phase completes when the pending arrival count reaches zero AND the transaction count (bytes
announced by ``expect_tx`` minus bytes delivered by ``complete_tx``, e.g. by TMA) is zero;
waiters name the phase by its parity (0 for the first phase after init, then 1, 0, ...).

Protocol reminders (PTX ISA, "mbarrier"): init by one thread, then
``fence_mbarrier_init_release_cluster`` (cluster use) or ``fence_proxy_async_shared_cta`` (TMA
use) and a CTA/cluster barrier before anyone else touches it. sm_90 and newer (``.expect_tx``,
``try_wait`` and the ``.shared::cluster`` forms are sm_90 instructions).

Waits come in three kinds: ``mbarrier_try_wait_parity`` answers once (for a caller's own loop);
``mbarrier_wait_parity*`` loop in PTX until the phase completes, forever if it never does;
``wait_parity*_or_trap`` loop the same way but ``trap`` after ``WAIT_TIMEOUT_NS`` of
``%globaltimer``, turning a deadlock (a missing arrival, a wrong ``expect_tx`` count or parity)
into a launch error instead of a hung GPU. The loops pass ``SUSPEND_TIME_HINT_NS`` to ``try_wait``
(SASS ``NANOSLEEP.SYNCS``): the waiting warp sleeps until the phase completes instead of spinning
through issue slots other warps need. ``spin_wait_parity*_or_trap`` are the same bounded loops without
the hint (no ``NANOSLEEP``): a warp that has nothing else to do and must start the moment the phase
completes (a consumer waiting for its stage's bytes) retries after the hardware's short default
instead of sleeping, which on the H200 can wake it late (``h200_ring.CONSUMER_WAIT``).
"""
from __future__ import annotations

from .common import ptx_intrinsic

_MBAR = ("mbar", "u32")
# A correct pipeline waits microseconds; a bounded wait that exceeds this traps (the launch fails).
WAIT_TIMEOUT_NS = 10_000_000_000
# try_wait's suspendTimeHint in the wait loops (CUTLASS's ClusterBarrier::wait uses the same 10 ms): a
# waiting thread sleeps until the phase completes (or the hint runs out) instead of retrying after the
# short system-dependent default. Without it, ncu on the H200 counted 17-19 % of the streaming kernel's issued
# instructions in its producer's retry loop, taken from the consumers (evidence: producer-suspend-hint).
SUSPEND_TIME_HINT_NS = 10_000_000

mbarrier_init = ptx_intrinsic(
    "mbarrier_init", "mbarrier.init.shared::cta.b64 [$0], $1;", [_MBAR, ("count", "u32")],
    doc="""Initialise the mbarrier at ``mbar`` for ``count`` arrivals per phase (count in 1..2**20-1).

Phase 0 starts, transaction count 0. One thread initialises; see the module docstring for the
fence and barrier that must follow.""")

mbarrier_arrive = ptx_intrinsic(
    "mbarrier_arrive", "mbarrier.arrive.shared::cta.b64 $0, [$1];", [_MBAR], result="u64",
    doc="""Arrive once on the mbarrier at ``mbar`` (release, CTA scope); returns the opaque u64 state.

The state identifies the phase arrived on (for ``mbarrier.test_wait``); most code ignores it and
waits by parity.""")

mbarrier_arrive_expect_tx = ptx_intrinsic(
    "mbarrier_arrive_expect_tx", "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
    [_MBAR, ("tx_bytes", "u32")],
    doc="""Announce ``tx_bytes`` more bytes for the current phase, then arrive once.

The producer's single call before issuing TMA loads whose ``complete_tx`` total is
``tx_bytes`` (a TMA box always counts its full size, also where it hangs over the tensor edge).
The state result is discarded (sink ``_``).""")

mbarrier_expect_tx = ptx_intrinsic(
    "mbarrier_expect_tx", "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;",
    [_MBAR, ("tx_bytes", "u32")],
    doc="""Announce ``tx_bytes`` more bytes for the current phase without arriving (relaxed, CTA scope).""")

mbarrier_try_wait_parity = ptx_intrinsic(
    "mbarrier_try_wait_parity",
    "{\n .reg .pred done;\n mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2;\n"
    " selp.u32 $0, 1, 0, done;\n}",
    [_MBAR, ("parity", "u32")], result="u32",
    doc="""1 if the phase with ``parity`` (0/1) of the mbarrier at ``mbar`` has completed, else 0.

``try_wait`` may suspend the thread for a system-dependent time before answering 0; acquire
semantics at CTA scope when it answers 1. For a bounded or instrumented wait loop.""")

mbarrier_wait_parity = ptx_intrinsic(
    "mbarrier_wait_parity",
    "{\n .reg .pred done;\n wait_parity_retry:\n"
    f" mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1, {SUSPEND_TIME_HINT_NS};\n"
    " @!done bra wait_parity_retry;\n}",
    [_MBAR, ("parity", "u32")],
    doc="""Block until the phase with ``parity`` (0/1) of the mbarrier at ``mbar`` has completed.

A ``try_wait.parity`` loop in PTX (acquire, CTA scope), so the branch stays out of Numba's
control flow; the label is local to the ``{ }`` block, so the intrinsic can appear many times in
one kernel. Never returns if the phase never completes (a missing arrival or a short
``expect_tx``): use ``mbarrier_try_wait_parity`` for a bounded wait.""")

mbarrier_arrive_remote_cluster = ptx_intrinsic(
    "mbarrier_arrive_remote_cluster",
    "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];",
    [("remote_mbar", "u32")],
    doc="""Arrive once (release, cluster scope) on an mbarrier of another CTA of the cluster.

``remote_mbar`` is a shared::cluster address from ``cluster.mapa_shared_cluster(mbar, rank)``
(a local shared::cta address is also valid in the cluster window and names this CTA's barrier).
The consumer waits with ``mbarrier_wait_parity_acquire_cluster``.""")

mbarrier_arrive_remote = ptx_intrinsic(
    "mbarrier_arrive_remote",
    "mbarrier.arrive.shared::cluster.b64 _, [$0];",
    [("remote_mbar", "u32")],
    doc="""Arrive once on an mbarrier of a CTA of the cluster with the default semantics (release at CTA scope), as
CUTLASS's ``ClusterBarrier::arrive(cta_id)`` does for a multicast pipeline's consumer release: no GPU-scope fence
(``mbarrier_arrive_remote_cluster``'s release at cluster scope compiles to ``MEMBAR.ALL.GPU`` before each arrival).
For releasing shared memory that only the async proxy (TMA, wgmma) touches.""")

mbarrier_wait_parity_acquire_cluster = ptx_intrinsic(
    "mbarrier_wait_parity_acquire_cluster",
    "{\n .reg .pred done;\n wait_parity_cluster_retry:\n"
    f" mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$0], $1, {SUSPEND_TIME_HINT_NS};\n"
    " @!done bra wait_parity_cluster_retry;\n}",
    [_MBAR, ("parity", "u32")],
    doc="""Block until phase ``parity`` of this CTA's mbarrier at ``mbar`` completes, acquiring at
cluster scope: writes that other CTAs released with their arrivals
(``mbarrier_arrive_remote_cluster``) are visible afterwards. Same loop as
``mbarrier_wait_parity``.""")


def _wait_parity_or_trap(name: str, scope_suffix: str, suspend_hint_ns: int | None):
    """Bounded ``try_wait.parity`` loop: ``scope_suffix`` "" (acquire, CTA scope) or ".acquire.cluster";
    ``suspend_hint_ns`` the ``try_wait`` suspend hint, or None for none (the hardware's short default).

    The first try needs no timer; only a wait that goes on reads ``%globaltimer`` (ns) and
    compares the elapsed time with ``WAIT_TIMEOUT_NS`` after every further try. The labels are
    local to the ``{ }`` block, so the intrinsic can appear many times in one kernel."""
    hint = "" if suspend_hint_ns is None else f", {suspend_hint_ns}"
    try_wait = f" mbarrier.try_wait.parity{scope_suffix}.shared::cta.b64 done, [$0], $1{hint};\n"
    text = ("{\n .reg .pred done, again;\n .reg .u64 start, now;\n"
            + try_wait +
            " @done bra wait_done;\n"
            " mov.u64 start, %globaltimer;\n"
            " wait_retry:\n"
            + try_wait +
            " @done bra wait_done;\n"
            " mov.u64 now, %globaltimer;\n"
            " sub.u64 now, now, start;\n"
            f" setp.lt.u64 again, now, {WAIT_TIMEOUT_NS};\n"
            " @again bra wait_retry;\n"
            " trap;\n"
            " wait_done:\n}")
    scope = scope_suffix.lstrip(".") or "acquire.cta"
    sleep = ("without a suspend hint (retries after the hardware's short default)" if suspend_hint_ns is None
             else f"with a {suspend_hint_ns} ns suspend hint")
    return ptx_intrinsic(name, text, [_MBAR, ("parity", "u32")], doc=(
        f"Block until phase ``parity`` of the mbarrier at ``mbar`` completes ({scope}), {sleep}; ``trap`` after "
        f"{WAIT_TIMEOUT_NS // 10 ** 9} s of %globaltimer, so a deadlock becomes a launch error."))


wait_parity_or_trap = _wait_parity_or_trap("wait_parity_or_trap", "", SUSPEND_TIME_HINT_NS)
wait_parity_cluster_or_trap = _wait_parity_or_trap("wait_parity_cluster_or_trap", ".acquire.cluster",
                                                   SUSPEND_TIME_HINT_NS)
spin_wait_parity_or_trap = _wait_parity_or_trap("spin_wait_parity_or_trap", "", None)
spin_wait_parity_cluster_or_trap = _wait_parity_or_trap("spin_wait_parity_cluster_or_trap", ".acquire.cluster",
                                                        None)
