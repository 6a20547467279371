"""Thread-block-cluster intrinsics (sm_90+): CTA rank, cluster barrier, distributed shared memory.

A kernel using them must be launched with a cluster shape (numba's launcher has none: launch
through ``cuda.core.launch`` with ``LaunchConfig(cluster=...)``, see kernels.md); launched
without one, every CTA is a cluster of 1 (rank 0 of 1).

``barrier.cluster`` is ``.aligned`` here: every thread of each warp executes the same arrive and
wait, and every thread of every CTA of the cluster must arrive before any wait returns.
"""
from __future__ import annotations

from ._llvm import special_register_u32, void_intrinsic
from .common import ptx_intrinsic

cluster_ctarank = special_register_u32(
    "%cluster_ctarank", "Rank of this CTA in its cluster, 0..cluster_nctarank-1 (u32).")

cluster_nctarank = special_register_u32(
    "%cluster_nctarank", "Number of CTAs in this CTA's cluster (u32).")

cluster_arrive_release = void_intrinsic(
    "barrier.cluster.arrive.release.aligned;",
    "Arrive at the cluster barrier, releasing this thread's prior memory operations (cluster "
    "scope) to the threads that complete the matching wait. Split arrive/wait lets independent "
    "work run in between.")

cluster_arrive_relaxed = void_intrinsic(
    "barrier.cluster.arrive.relaxed.aligned;",
    "Arrive at the cluster barrier without release semantics: only for pure execution "
    "synchronisation (nothing written before it needs to be seen after the wait).")

cluster_wait_acquire = void_intrinsic(
    "barrier.cluster.wait.acquire.aligned;",
    "Wait until all threads of the cluster have arrived at the current cluster barrier phase, "
    "acquiring what their release-arrivals published.")

mapa_shared_cluster = ptx_intrinsic(
    "mapa_shared_cluster", "mapa.shared::cluster.u32 $0, $1, $2;",
    [("smem", "u32"), ("cta_rank", "u32")], result="u32", memory=False,
    doc="""Shared::cluster address of the variable at shared address ``smem`` in CTA ``cta_rank``.

Every CTA of a cluster has the same shared-memory layout, so this maps a local address to the
same variable in the peer CTA (distributed shared memory): the operand of
``mbarrier_arrive_remote_cluster`` and of ``ld/st.shared::cluster``.""")
