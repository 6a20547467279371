"""CUDA-event timing by the benchmark's rules, and the streaming-read ceiling.

Rules (DEVELOPERS.md, METHOD.md): every timing is CUDA events around one launch (or, for launches that
may overlap, around a few launches back to back: ``time_launches(back_to_back=...)``), after warm-up,
repeated, reported as median / p10 / p90 (``Timing``, ``time_launches``); the timed launches queue
behind a sleeping kernel (``hold_stream``), so the GPU runs them back to back and the events time the
GPU's work, not Python's launch overhead; a batch during which the GPU still ran out of queued launches
is timed again (``HOST_BOUND_RETRIES``) and, still host-bound, marked (``Timing.host_bound``); inputs
rotate over enough copies that the bytes of one rotation exceed ``L2_ROTATION_FACTOR`` times the L2
(``rotation_count``, ``device_l2_bytes``), so no launch reads what the previous one left in L2; the
streaming-read ceiling (``measure_read_bandwidth``) is measured in the same process as the kernels.

``gbs.lab.bench``, ``gbs.lab.sweep`` and ``scripts/h200_stream_sweep.py`` time with this module.
"""
from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

L2_ROTATION_FACTOR = 4          # one rotation of inputs spans 4x the L2
H200_L2_BYTES = 60 * 2 ** 20    # nvidia-h200: 60 MB of L2 (KINDS.md); read off the device when possible
WARMUP_LAUNCHES = 5
TIMED_LAUNCHES = 50
MIN_TIMED_LAUNCHES = 5          # a slow method still gets a median of this many launches
WARMUP_BUDGET_S = 0.2           # with a time budget, warm-up stops after about this long
TIMING_BUDGET_S = 1.0           # timed launches of one method, full mode ...
QUICK_TIMING_BUDGET_S = 0.3     # ... and --quick
READ_CEILING_BYTES = 4 * 2 ** 30
QUICK_READ_CEILING_BYTES = 2 ** 30   # still 16x the L2
READ_THREADS_PER_BLOCK = 256
READ_BLOCKS_PER_SM = 8          # 4-8 blocks of 256 per SM reached 4.30 TB/s (kernels.md)
READ_LOADS_IN_FLIGHT = 4        # 16-byte loads issued per thread before the first use
# The spacer kernel ahead of the timed launches holds the GPU for this many times the host's time to
# issue them, at most SPACER_MAX_S, so that every timed launch is queued before the GPU reaches it. It
# waits on %globaltimer: nanosleep alone sleeps anything from 0 to twice what it is asked, and a
# spacer that ended early let the GPU catch up with the host (timed launches of ~10 us kernels then
# read the host's ~25 us launch interval: evidence bench-spacer, data/h200_evidence.csv).
SPACER_MARGIN = 2.0
SPACER_MAX_S = 0.5
SPACER_SLEEP_NS = np.uint32(1000)
# If the GPU still drained the queue before the last timed launch was issued, time again (at most
# HOST_BOUND_RETRIES more batches) after more warm-up, behind this many times the spacer (and, once the
# spacer is at SPACER_MAX_S, with only as many launches as it covers); still host-bound: the Timing says
# so (``Timing.host_bound``), the CSV's ``host_bound`` column and the table mark the row.
SPACER_RETRY_FACTOR = 4.0
HOST_BOUND_RETRIES = 2
RETRY_WARMUP_FACTOR = 2          # a retry warms up with this many times the launches of the one before


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    launches: int
    host_bound: bool = False   # the GPU ran out of queued launches: the times include host gaps
    # every timed launch in issue order, (input set, us): for streaks or modes a median hides
    series: tuple[tuple[int, float], ...] = field(default=(), repr=False, compare=False)
    attempts: int = 1          # timed batches run: 1, or more after host-bound batches (HOST_BOUND_RETRIES)


def time_launches(launch, *, num_inputs: int = 1, warmup: int = WARMUP_LAUNCHES,
                  reps: int = TIMED_LAUNCHES, budget_s: float | None = None, back_to_back: int = 1) -> Timing:
    """Time ``launch(i)`` (i = input set, rotating over ``num_inputs``) with CUDA events, one pair
    of events per launch, after one untimed first call (compilation, module load) and ``warmup``
    untimed launches. With ``budget_s``, warm-up and timed launches are cut to about
    ``WARMUP_BUDGET_S`` and ``budget_s`` of the slower of host and GPU (at least 1 and
    ``MIN_TIMED_LAUNCHES``). Events go on the legacy default stream, which torch and Triton use too.
    ``back_to_back``: launches between one pair of events, each timed as the pair's time over their count (the
    timed launches rounded up to whole pairs): for launches that may overlap the one before them
    (programmatic dependent launch), which an event recorded between two launches may keep apart.

    A batch during which the GPU ran out of queued launches (host-bound: its times include the host's
    launch gaps) is timed again, up to ``HOST_BOUND_RETRIES`` times, each after ``RETRY_WARMUP_FACTOR``
    times more warm-up launches (which also re-measure the host's time per launch), behind a spacer
    ``SPACER_RETRY_FACTOR`` times longer (at least ``SPACER_MARGIN`` x the launches' host time), at most
    ``SPACER_MAX_S``, with no more launches than such a spacer covers (at least ``MIN_TIMED_LAUNCHES``).
    The last batch is returned; ``Timing.host_bound`` says whether it was still host-bound (with a
    RuntimeWarning), ``Timing.attempts`` how many batches ran."""
    from numba import cuda

    if num_inputs < 1 or reps < 1 or warmup < 0 or back_to_back < 1:
        raise ValueError(f"need num_inputs >= 1, reps >= 1, warmup >= 0, back_to_back >= 1; got {num_inputs}, {reps}, "
                         f"{warmup}, {back_to_back}")
    launch(0)
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    t0 = time.perf_counter()
    start.record()
    launch(1 % num_inputs)
    end.record()
    host_s = time.perf_counter() - t0
    end.synchronize()
    if budget_s is not None:
        per_launch_s = max(host_s, cuda.event_elapsed_time(start, end) * 1e-3, 1e-9)
        warmup = min(warmup, max(1, int(WARMUP_BUDGET_S / per_launch_s)))
        reps = min(reps, max(MIN_TIMED_LAUNCHES, int(budget_s / per_launch_s)))
    t0 = time.perf_counter()
    for i in range(warmup):
        launch((2 + i) % num_inputs)
    if warmup:
        host_s = (time.perf_counter() - t0) / warmup
    cuda.synchronize()
    spacer_s = min(SPACER_MAX_S, SPACER_MARGIN * reps * host_s)
    first_input = 2 + warmup
    times_us, host_bound = _timed_launches(launch, reps, first_input, num_inputs, spacer_s, back_to_back)
    attempts = 1
    retry_warmup = max(1, warmup)
    while host_bound and attempts <= HOST_BOUND_RETRIES:
        retry_warmup *= RETRY_WARMUP_FACTOR
        t0 = time.perf_counter()
        for i in range(retry_warmup):
            launch((first_input + i) % num_inputs)
        host_s = max(host_s, (time.perf_counter() - t0) / retry_warmup)
        cuda.synchronize()
        spacer_s = min(SPACER_MAX_S, max(SPACER_RETRY_FACTOR * spacer_s, SPACER_MARGIN * reps * host_s))
        reps = max(MIN_TIMED_LAUNCHES, min(reps, int(spacer_s / (SPACER_MARGIN * max(host_s, 1e-9)))))
        times_us, host_bound = _timed_launches(launch, reps, first_input, num_inputs, spacer_s, back_to_back)
        attempts += 1
    if host_bound:
        warnings.warn(f"time_launches: the GPU drained the queue before the host issued the last of {reps} "
                      f"launches in {attempts} batches, the last behind a {spacer_s * 1e3:.1f} ms spacer: the times "
                      f"include host gaps (marked host_bound)", RuntimeWarning, stacklevel=2)
    series = tuple(((first_input + i * back_to_back) % num_inputs, float(t)) for i, t in enumerate(times_us))
    return Timing(float(np.median(times_us)), float(np.percentile(times_us, 10)),
                  float(np.percentile(times_us, 90)), len(times_us) * back_to_back, bool(host_bound), series, attempts)


def _timed_launches(launch, reps: int, first_input: int, num_inputs: int, spacer_s: float, back_to_back: int):
    """Times (us per launch) of ``reps`` launches (rounded up to whole groups of ``back_to_back``, one pair of
    events around each group) queued behind a ``spacer_s`` spacer, and whether the spacer had already ended when
    the host finished queuing them (then the GPU may have waited for the host)."""
    from numba import cuda

    hold_stream(spacer_s)
    spacer_done = cuda.event()
    spacer_done.record()
    groups = -(-reps // back_to_back)
    starts = [cuda.event() for _ in range(groups)]
    ends = [cuda.event() for _ in range(groups)]
    for g in range(groups):
        starts[g].record()
        for i in range(g * back_to_back, (g + 1) * back_to_back):
            launch((first_input + i) % num_inputs)
        ends[g].record()
    host_bound = spacer_done.query()
    ends[-1].synchronize()
    return (np.array([cuda.event_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends)]) / back_to_back,
            host_bound)


@functools.lru_cache(maxsize=None)
def _spacer_kernel():
    from numba import cuda

    from ..ptx_inline.common import read_globaltimer

    @cuda.jit
    def hold(duration_ns):
        deadline = read_globaltimer() + np.uint64(duration_ns)
        while read_globaltimer() < deadline:
            cuda.nanosleep(SPACER_SLEEP_NS)

    return hold


def hold_stream(seconds: float) -> None:
    """Enqueue a one-thread kernel that holds the default stream for ``seconds`` of %globaltimer (no sync)."""
    duration_ns = int(seconds * 1e9)
    if duration_ns > 0:
        _spacer_kernel()[1, 1](np.uint64(duration_ns))


def rotation_count(bytes_per_input: int, l2_bytes: int = H200_L2_BYTES) -> int:
    """Input copies needed so that one rotation spans ``L2_ROTATION_FACTOR`` x the L2."""
    return max(1, -(-L2_ROTATION_FACTOR * l2_bytes // max(1, bytes_per_input)))


def device_l2_bytes() -> int:
    from numba import cuda

    attr = getattr(cuda.get_current_device(), "L2_CACHE_SIZE", None)
    return int(attr) if attr else H200_L2_BYTES


def _read_kernel():
    """Streaming read: each thread keeps ``READ_LOADS_IN_FLIGHT`` 16-byte ``ld.global.nc`` loads in
    flight and XORs them; one word per thread goes out so the loads are not dead."""
    from numba import cuda

    from ..ptx_inline.copy import ld_global_nc_v4_u32

    in_flight = READ_LOADS_IN_FLIGHT

    @cuda.jit
    def read_all(src_u32x4, base_address, sink):
        n_vec = src_u32x4.shape[0]
        tid = cuda.grid(1)
        stride = cuda.gridsize(1)
        acc = np.uint32(0)
        i = tid
        while i + (in_flight - 1) * stride < n_vec:
            w0 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i))
            w1 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + stride))
            w2 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + 2 * stride))
            w3 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + 3 * stride))
            acc ^= w0[0] ^ w0[1] ^ w0[2] ^ w0[3] ^ w1[0] ^ w1[1] ^ w1[2] ^ w1[3]
            acc ^= w2[0] ^ w2[1] ^ w2[2] ^ w2[3] ^ w3[0] ^ w3[1] ^ w3[2] ^ w3[3]
            i += in_flight * stride
        while i < n_vec:
            w = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i))
            acc ^= w[0] ^ w[1] ^ w[2] ^ w[3]
            i += stride
        sink[tid] = acc

    return read_all


def measure_read_bandwidth(nbytes: int = READ_CEILING_BYTES) -> tuple[float, Timing]:
    """Streaming-read ceiling of this GPU in TB/s (bytes read / median time), and its timing."""
    from numba import cuda

    vec = nbytes // 16
    src = cuda.to_device(np.random.default_rng(0).integers(0, 2 ** 32, (vec, 4), dtype=np.uint32))
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks = sms * READ_BLOCKS_PER_SM
    sink = cuda.device_array(blocks * READ_THREADS_PER_BLOCK, np.uint32)
    kernel = _read_kernel()
    base = np.uint64(src.__cuda_array_interface__["data"][0])
    timing = time_launches(lambda i: kernel[blocks, READ_THREADS_PER_BLOCK](src, base, sink), reps=20)
    return vec * 16 / (timing.median_us * 1e-6) / 1e12, timing
