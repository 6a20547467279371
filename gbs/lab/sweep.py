"""``python -m gbs ablate``: the config sweep on the H200 into ``data/ablations.csv``, and its command line.

The sweep times every legal ``ab_swapped`` x ``mma_bn`` x ``cta_group`` x ``num_pipeline_stages`` of
the H200 kernel (``gbs.numba_kernels.h200_stream``) on a grid of problems (``gbs.lab.sweep_grid``), through
the override path of the dispatch (``override_config``: the ``KernelConfig`` that ``override=True`` builds,
the same object production hands the kernel), with the benchmark's timing rules (``gbs.lab.timing``): CUDA
events after warm-up, inputs rotated past the L2, median / p10 / p90. Each timed launch becomes one
``gbs.lab.ablation_data.AblationRow`` (``source="measured"``) in the CSV.

How the device time is spent. A JIT compile per kernel specialisation (format x knobs x stages)
costs seconds, so the work is ordered by specialisation: each compiled kernel times every problem
of its format before the next is built, and specialisations go in priority order
(``gbs.lab.sweep_grid.grid_specs``), so a sweep cut short still covers every knob set in every regime.
The work is sharded by specialisation over every visible GPU (``--workers-per-gpu`` processes per GPU,
each with its own ``CUDA_VISIBLE_DEVICES``; no NCCL): a process compiles its next kernel on the CPU while
another of the same GPU holds that GPU's lock and times, so compiles overlap timing and timing never
overlaps timing. Problems are built once per process on the device (weights per (format, shape) shared by
every load; rotation copies as extra experts and token copies), the read ceiling is measured once per process.

Resumable and multi-process safe. Every finished row is appended at once to the worker's own part
file (``<csv>.parts/``, ``gbs.lab.sweep_csv``); the parent merges the parts into the CSV at the end, and any
mode merges leftover parts of an interrupted run first. Rows whose key (``sweep_csv.KEY_COLUMNS``) is already in
the CSV are not run again. ``--budget-s`` stops every worker cleanly before a compile or a row that would pass
the deadline (estimates from what was observed so far), so the next call continues.

Other modes (no GPU needed): ``--plan`` prints the work and the expected device time; ``--model``,
``--calibrate``, ``--tables`` and ``--plot [DIR]`` are ``gbs.lab.sweep_report``'s (modelled rows, the model's
calibration, the dispatch tables, the heatmaps).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import queue
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from gbs.dispatch import (
    REGIME_OVERRIDE,
    RULE_OVERRIDE,
    STAGES_AUTO,
    STAGES_OVERRIDE,
    KernelConfig,
    grouped_matmul_nvfp4_dispatch,
)
from gbs.lab import ablation_data as ab
from gbs.lab.ablation_data import AblationRow, ProblemKey
from gbs.lab.cases import synthetic_problem, useful_bytes
from gbs.lab.environment import environment_fields, gpu_slug
from gbs.lab.perfmodel import H200, HARDWARE, HardwareParams, ModelConfig, resolve_names
from gbs.lab.sweep_csv import PARTS_SUFFIX, PartWriter, load_rows, log, merge_parts, parts_dir, row_key
from gbs.lab.sweep_grid import (
    COMPILE_S_ESTIMATE,
    FULL_FORMATS,
    GRID_MINIMAL,
    GRIDS,
    ROW_REPS,
    ROW_TIMING_BUDGET_S,
    ROW_WARMUP,
    SHAPE_NAMES,
    Grid,
    Spec,
    StageLimit,
    WorkItem,
    build_grid,
    dispatch_pick,
    estimate_sweep,
    h200_kernel_stage_limit,
    parse_formats,
    parse_shapes,
    pending_work,
    shard_work,
    work_cost,
)
from gbs.lab.sweep_report import DEFAULT_PLOT_DIR, cmd_calibrate, cmd_model, cmd_plot, cmd_tables
from gbs.lab.timing import (
    MIN_TIMED_LAUNCHES,
    QUICK_READ_CEILING_BYTES,
    Timing,
    device_l2_bytes,
    measure_read_bandwidth,
    rotation_count,
    time_launches,
)

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
DEFAULT_CSV = os.path.join("data", "ablations.csv")
DEFAULT_ROW_S = 0.5               # a problem not timed yet in this process
MERGE_MARGIN_S = 5.0              # kept back from --budget-s for merging the part files
DEFAULT_WORKERS_PER_GPU = 4       # one times while the others compile (a compile costs ~3-5x a spec's rows)
MAX_FAILED_SPECS_IN_A_ROW = 3     # then the worker stops: its CUDA context is likely broken
MAX_NOTES = 20                    # failure notes a worker reports back
RESULT_WAIT_S = 5.0               # wait for a finished worker's summary
GPU_LOCK_TIMEOUT_S = 300.0        # a worker holds its GPU for one specialisation's rows (seconds)
WORKER_GRACE_S = 120.0            # a worker still alive this long after the deadline is terminated
TOKEN_PROBLEM_N = 128             # token operands do not depend on N: built with one 128-row weight band

NO_GPU_STATUS = 2
NO_GPU_MESSAGE = ("python -m gbs ablate (a measured sweep) needs a CUDA GPU and Numba finds none here. Without a GPU "
                  "use --plan, --model, --calibrate, --tables or --plot; on the H200 run e.g. "
                  "`GBS_COMMIT=<sha> python -m gbs ablate --grid minimal --budget-s 540`.")


class ConfigNotRunnable(ValueError):
    """The kernel refuses a config the SM100 dispatch allows (e.g. a ring deeper than its real
    shared memory); nothing is recorded for it."""


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------
def override_config(key: ProblemKey, config: ModelConfig, smem_per_sm: int) -> KernelConfig:
    """The ``KernelConfig`` of ``config`` on ``key``'s problem through the override path: NVFP4 by
    ``grouped_matmul_nvfp4_dispatch(override=True, ...)``; the other routes have no override entry
    upstream, so the same object that override builds (rule, regime and stage source "override"),
    validated by ``KernelConfig`` itself. ValueError when the stages do not fit ``smem_per_sm``."""
    config = ModelConfig.of(config)
    problem = dict(n=key.n, k=key.k, num_active_experts=key.num_active_experts,
                   estimated_total_m=key.total_tokens, smem_per_sm=smem_per_sm)
    if key.format == "nvfp4":
        return grouped_matmul_nvfp4_dispatch(override=True, ab_swapped=config.ab_swapped, mma_bn=config.mma_bn,
                                             cta_group=config.cta_group, num_pipeline_stages=config.stages, **problem)
    a_format, b_format = resolve_names(key.format)
    return KernelConfig(a_format=a_format, b_format=b_format, ab_swapped=config.ab_swapped, mma_bn=config.mma_bn,
                        cta_group=config.cta_group, num_pipeline_stages=config.stages,
                        stages_source=STAGES_OVERRIDE, regime=REGIME_OVERRIDE, rule=RULE_OVERRIDE,
                        stages_reason=f"the caller's num_pipeline_stages={config.stages}.", **problem)


@dataclass(frozen=True)
class RowContext:
    """What every measured row of one worker shares."""

    gpu: str
    gpu_name: str
    date: str
    commit: str
    read_ceiling_tbs: float
    hw: HardwareParams                # budget of the dispatch / stage source, and the MMA ceiling

    def row(self, key: ProblemKey, config: ModelConfig, timing: Timing) -> AblationRow:
        pick = dispatch_pick(key, self.hw.smem_per_sm)
        deepest = self.hw.max_stages(key.format, config.tile_config)
        return ab.make_row(
            key, config, median_us=timing.median_us, p10_us=timing.p10_us, p90_us=timing.p90_us, gpu=self.gpu,
            gpu_name=self.gpu_name, source=ab.SOURCE_MEASURED, date=self.date, commit=self.commit,
            bandwidth_ceiling_tbs=self.read_ceiling_tbs, mma_ceiling_tflops=self.hw.mma_tflops(key.format),
            config_source=ab.CONFIG_SOURCE_DISPATCH if config == pick else ab.CONFIG_SOURCE_SWEEP,
            stages_source=STAGES_AUTO if config.stages == deepest else STAGES_OVERRIDE)


# ----------------------------------------------------------------------------------------------
# One worker's loop (GPU-independent: the runner does the device work)
# ----------------------------------------------------------------------------------------------
@dataclass
class ShardSummary:
    """What one worker did (picklable: it travels back from a worker process)."""

    label: str
    specs_total: int = 0
    specs_run: int = 0
    rows_total: int = 0
    measured: int = 0
    not_runnable: int = 0
    failed: int = 0
    stopped: str | None = None        # None, "budget", "failures" or "crashed"
    compile_s: float = 0.0
    timing_s: float = 0.0
    wall_s: float = 0.0
    notes: list = dataclasses.field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.rows_total - self.measured - self.not_runnable - self.failed

    def note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text)


def _problem_text(key: ProblemKey) -> str:
    return (f"{key.format} {key.n}x{key.k} {key.routing:<7} {key.num_active_experts:>2}x{key.avg_m:<4g} "
            f"{key.regime:<13}")


def run_shard(work: Sequence[WorkItem], runner, ctx: RowContext, emit: Callable[[AblationRow], None], *,
              deadline: float | None = None, clock: Callable[[], float] = time.time,
              log: Callable[[str], None] = print, label: str = "worker") -> ShardSummary:
    """Compile and time every work item in order; each finished row goes to ``emit`` at once.

    ``runner``: ``compile(spec)`` (CPU; ``ConfigNotRunnable`` when the kernel refuses the config),
    ``gpu()`` (a context manager holding this GPU: timing never overlaps another worker's) and
    ``measure(spec, key) -> Timing``. With a ``deadline`` (``clock()`` seconds) no compile or row
    starts that is expected to end after it (estimates: the slowest compile and each problem's
    last row time seen so far); the summary says "budget" and how many rows remain."""
    summary = ShardSummary(label, specs_total=len(work), rows_total=sum(len(keys) for _, keys in work))
    start = clock()
    compile_estimate = COMPILE_S_ESTIMATE
    row_seconds: dict[ProblemKey, float] = {}
    failed_in_a_row = 0

    def time_left() -> float:
        return math.inf if deadline is None else deadline - clock()

    def stop(reason: str) -> None:
        summary.stopped = reason

    for spec, keys in work:
        if time_left() < compile_estimate + row_seconds.get(keys[0], DEFAULT_ROW_S):
            stop("budget")
            break
        t0 = clock()
        try:
            runner.compile(spec)
        except ConfigNotRunnable as err:
            summary.not_runnable += len(keys)
            log(f"[{label}] {spec.label()}: not runnable here, nothing recorded ({err})")
            continue
        except Exception as err:  # a compile crash: recorded, the sweep goes on
            summary.failed += len(keys)
            summary.note(f"{spec.label()}: compile failed: {type(err).__name__}: {err}")
            log(f"[{label}] FAIL {spec.label()}: compile: {type(err).__name__}: {err}")
            failed_in_a_row += 1
            if failed_in_a_row >= MAX_FAILED_SPECS_IN_A_ROW:
                stop("failures")
                break
            continue
        compile_s = clock() - t0
        summary.compile_s += compile_s
        compile_estimate = compile_s if summary.specs_run == 0 else max(compile_estimate, compile_s)
        summary.specs_run += 1
        spec_failed = False
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(runner.gpu())
            except TimeoutError as err:
                summary.note(f"{spec.label()}: {err}")
                stop("failures")
                break
            for i, key in enumerate(keys):
                if time_left() < row_seconds.get(key, DEFAULT_ROW_S):
                    stop("budget")
                    break
                t0 = clock()
                try:
                    timing = runner.measure(spec, key)
                except ConfigNotRunnable as err:
                    summary.not_runnable += 1
                    log(f"[{label}] {_problem_text(key)} {spec.config.label()}: not runnable here ({err})")
                    continue
                except Exception as err:  # a launch crash: the rest of this spec is skipped
                    summary.failed += len(keys) - i
                    summary.note(f"{spec.label()} on {_problem_text(key).strip()}: {type(err).__name__}: {err}")
                    log(f"[{label}] FAIL {_problem_text(key)} {spec.config.label()}: {type(err).__name__}: {err}")
                    spec_failed = True
                    break
                row_seconds[key] = clock() - t0
                summary.timing_s += row_seconds[key]
                row = ctx.row(key, spec.config, timing)
                emit(row)
                summary.measured += 1
                log(f"[{label} {summary.measured + summary.not_runnable + summary.failed}/{summary.rows_total} "
                    f"{clock() - start:5.0f}s] {_problem_text(key)} {spec.config.label():<16} "
                    f"{timing.median_us:9.1f} us (p10 {timing.p10_us:.1f}, p90 {timing.p90_us:.1f}) "
                    f"{row.gbps:6.0f} GB/s = {100 * row.bandwidth_ceiling_fraction:3.0f}% read "
                    f"{row.tflops:6.1f} TFLOP/s")
        if summary.stopped:
            break
        failed_in_a_row = failed_in_a_row + 1 if spec_failed else 0
        if failed_in_a_row >= MAX_FAILED_SPECS_IN_A_ROW:
            stop("failures")
            break
    summary.wall_s = clock() - start
    return summary


def describe_summary(summary: ShardSummary) -> str:
    text = (f"[{summary.label}] {summary.measured} rows measured, {summary.not_runnable} not runnable, "
            f"{summary.failed} failed, {summary.remaining} remaining; {summary.specs_run}/{summary.specs_total} "
            f"specialisations compiled ({summary.compile_s:.0f} s), {summary.timing_s:.0f} s timing, "
            f"{summary.wall_s:.0f} s in all")
    if summary.stopped:
        text += f"; stopped: {summary.stopped}"
    return text


# ----------------------------------------------------------------------------------------------
# The device side (a GPU with the H200 kernel)
# ----------------------------------------------------------------------------------------------
def rotation_plan(problems: Sequence[ProblemKey], l2_bytes: int) -> tuple[dict, dict]:
    """(rotation copies per problem, weight experts per (format, N, K)): a problem's copies span
    ``gbs.lab.timing.L2_ROTATION_FACTOR`` x the L2 (``rotation_count`` of its useful bytes); copy ``c``
    reads experts ``c * slots ... (c + 1) * slots - 1`` of its shape's shared weights."""
    copies = {key: rotation_count(useful_bytes(ab.problem_shape(key)), l2_bytes) for key in problems}
    experts: dict[tuple, int] = {}
    for key in problems:
        shape = (key.format, key.n, key.k)
        experts[shape] = max(experts.get(shape, 0), copies[key] * key.num_active_experts)
    return copies, experts


class DeviceRunner:
    """Problems on this process's GPU and the H200 kernel, for ``run_shard``.

    Weights are built once per (format, shape) with enough experts for every problem's rotation
    copies (copy ``c`` of a problem uses experts ``c * slots ...``); tokens once per problem with
    one device copy per rotation copy; one output per copy. ``build_host`` needs no GPU lock,
    ``upload`` does (with ``measure_ceiling``)."""

    def __init__(self, problems: Sequence[ProblemKey], hw: HardwareParams, *, seed: int = 0,
                 row_budget_s: float = ROW_TIMING_BUDGET_S, gpu_lock=None, l2_bytes: int | None = None):
        self.hw = hw
        self.seed = seed
        self.row_budget_s = row_budget_s
        self._lock = gpu_lock
        self.problems = tuple(dict.fromkeys(problems))
        self.copies, self.weight_experts = rotation_plan(self.problems,
                                                         device_l2_bytes() if l2_bytes is None else l2_bytes)
        self._host: dict = {}
        self._weights: dict = {}
        self._inputs: dict = {}

    @contextlib.contextmanager
    def gpu(self):
        """Hold this GPU's lock (shared by its workers); TimeoutError if another worker keeps it for
        ``GPU_LOCK_TIMEOUT_S`` (it died holding it)."""
        if self._lock is None:
            yield
            return
        if not self._lock.acquire(timeout=GPU_LOCK_TIMEOUT_S):
            raise TimeoutError(f"the GPU lock was not released in {GPU_LOCK_TIMEOUT_S:g} s (a worker died holding it?)")
        try:
            yield
        finally:
            self._lock.release()

    def build_host(self) -> None:
        """Synthetic operands on the host (``gbs.lab.cases.synthetic_problem``), no GPU work."""
        for (fmt, n, k), experts in self.weight_experts.items():
            self._host[fmt, n, k] = synthetic_problem(fmt, n=n, k=k, group_sizes=[1], expert_ids=[0],
                                                      num_experts=experts, seed=self.seed)
        for key in self.problems:
            routing = ab.routing_for(key.routing, key.num_active_experts, key.total_tokens)
            self._host[key] = synthetic_problem(key.format, n=TOKEN_PROBLEM_N, k=key.k,
                                                group_sizes=routing.group_sizes, expert_ids=routing.expert_ids,
                                                num_experts=key.num_active_experts, seed=self.seed + 1)

    def upload(self) -> None:
        """Copy every operand to the device once (hold the GPU lock) and drop the host copies."""
        from numba import cuda

        from gbs.numba_kernels import launch

        def to_device(name, array):
            return cuda.to_device(np.ascontiguousarray(array).view(launch.PROBLEM_ARRAY_DTYPES[name]))

        for (fmt, n, k) in self.weight_experts:
            host = self._host.pop((fmt, n, k))
            self._weights[fmt, n, k] = SimpleNamespace(
                a_format=host.a_format, b_format=host.b_format, b=to_device("b", host.b),
                b_scales=to_device("b_scales", host.b_scales), expert_scales=to_device("expert_scales",
                                                                                       host.expert_scales))
        for key in self.problems:
            host = self._host.pop(key)
            weights = self._weights[key.format, key.n, key.k]
            offsets = to_device("a_offsets", host.a_offsets)
            scale_offsets = to_device("a_scale_offsets", host.a_scale_offsets)
            inputs = []
            for copy in range(self.copies[key]):
                view = SimpleNamespace(
                    a_format=weights.a_format, b_format=weights.b_format, a=to_device("a", host.a), b=weights.b,
                    a_scales=to_device("a_scales", host.a_scales), b_scales=weights.b_scales, a_offsets=offsets,
                    a_scale_offsets=scale_offsets,
                    expert_ids=to_device("expert_ids", host.expert_ids + copy * key.num_active_experts),
                    expert_scales=weights.expert_scales, num_active_experts=key.num_active_experts,
                    estimated_total_m=key.total_tokens, n=key.n, k=key.k)
                inputs.append((launch.to_device(view), cuda.device_array((key.total_tokens, key.n), np.uint16)))
            self._inputs[key] = inputs
        cuda.synchronize()

    def measure_ceiling(self) -> float:
        """Streaming-read ceiling of this GPU in TB/s (``gbs.lab.timing.measure_read_bandwidth``)."""
        return measure_read_bandwidth(QUICK_READ_CEILING_BYTES)[0]

    def _config(self, spec: Spec, key: ProblemKey) -> KernelConfig:
        try:
            return override_config(key, spec.config, self.hw.smem_per_sm)
        except ValueError as err:
            raise ConfigNotRunnable(str(err)) from None

    def _plan(self, problem, spec: Spec, key: ProblemKey):
        """The streaming kernel with exactly this row's knobs and stages (``gbs.plan`` constraints: a ring that
        does not fit is refused, not capped)."""
        from gbs.plan import plan_h200

        config = self._config(spec, key)
        return plan_h200(problem, backend="h200_stream", ab_swapped=config.ab_swapped, mma_bn=config.mma_bn,
                         cta_group=config.cta_group, stages=config.num_pipeline_stages)

    def compile(self, spec: Spec) -> None:
        from gbs.numba_kernels import h200_launch

        key = next(k for k in self.problems if k.format == spec.format)
        try:
            plan = self._plan(self._inputs[key][0][0], spec, key)
        except (TypeError, ValueError) as err:
            raise ConfigNotRunnable(str(err)) from None
        h200_launch.compiled_kernel(plan.spec)

    def measure(self, spec: Spec, key: ProblemKey) -> Timing:
        from gbs.numba_kernels import h200_launch

        try:
            launchers = [h200_launch.prepare(problem, self._plan(problem, spec, key), out)
                         for problem, out in self._inputs[key]]
        except (TypeError, ValueError, NotImplementedError) as err:
            raise ConfigNotRunnable(str(err)) from None
        return time_launches(lambda i: launchers[i](), num_inputs=len(launchers), warmup=ROW_WARMUP,
                             reps=ROW_REPS, budget_s=self.row_budget_s)


def run_worker(label: str, work: Sequence[WorkItem], part_path: str, *, hw_key: str, seed: int,
               row_budget_s: float, deadline: float | None, gpu_lock=None) -> ShardSummary:
    """One worker on the current GPU: host problems, upload and ceiling (under the GPU lock), then
    ``run_shard`` appending rows to ``part_path``."""
    t0 = time.time()
    hw = HARDWARE.get(hw_key, H200)
    env = environment_fields()
    runner = DeviceRunner([k for _, keys in work for k in keys], hw, seed=seed, row_budget_s=row_budget_s,
                          gpu_lock=gpu_lock)
    runner.build_host()
    with runner.gpu():
        runner.upload()
        read_tbs = runner.measure_ceiling()
    log(f"[{label}] ready in {time.time() - t0:.0f} s on {env['gpu']}: {len(runner.problems)} problems, "
         f"read ceiling {read_tbs:.2f} TB/s, {len(work)} specialisations to run")
    ctx = RowContext(gpu_slug(env["gpu"]), env["gpu"], env["date"], env["commit"], read_tbs, hw)
    with PartWriter(part_path) as writer:
        return run_shard(work, runner, ctx, writer.write, deadline=deadline, log=log, label=label)


def _worker_process(worker: Callable[..., ShardSummary], kwargs: dict, gpu_lock, results) -> None:
    """Entry point of a spawned worker (its CUDA_VISIBLE_DEVICES names one GPU)."""
    try:
        summary = worker(gpu_lock=gpu_lock, **kwargs)
    except BaseException as err:  # reported to the parent, which merges what was written
        summary = ShardSummary(kwargs["label"], stopped="crashed", notes=[f"{type(err).__name__}: {err}"])
        log(f"[{kwargs['label']}] crashed: {type(err).__name__}: {err}")
    results.put(summary)


@contextlib.contextmanager
def _visible_devices(value: str):
    """``CUDA_VISIBLE_DEVICES=value`` for processes started inside (spawn copies the environment)."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def visible_gpus() -> list[tuple[str, str, tuple[int, int]]]:
    """(CUDA_VISIBLE_DEVICES entry, name, compute capability) of every GPU this process sees,
    without creating a context."""
    from numba import cuda

    ids = [s.strip() for s in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
    gpus = []
    for i, device in enumerate(cuda.gpus):
        name = device.name.decode() if isinstance(device.name, bytes) else device.name
        gpus.append((ids[i] if i < len(ids) else str(i), name, tuple(device.compute_capability)))
    return gpus


def run_workers(shards: Sequence[Sequence[WorkItem]], gpus: Sequence[str], csv_path: str, *, hw_key: str,
                seed: int, row_budget_s: float, deadline: float | None,
                worker: Callable[..., ShardSummary] = run_worker) -> list[ShardSummary]:
    """Shard ``w`` on GPU ``gpus[w % len(gpus)]``: in this process when there is one shard, else
    one spawned process per shard with one lock per GPU. ``worker`` (a module-level function,
    ``run_worker``'s signature) does one shard."""
    import multiprocessing

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    jobs = []
    for w, shard in enumerate(shards):
        if shard:
            gpu = gpus[w % len(gpus)]
            jobs.append((gpu, dict(label=f"gpu{gpu}.{w // len(gpus)}", work=list(shard),
                                   part_path=os.path.join(parts_dir(csv_path), f"{stamp}-w{w}-{os.getpid()}.csv"),
                                   hw_key=hw_key, seed=seed, row_budget_s=row_budget_s, deadline=deadline)))
    if len(jobs) == 1:
        return [worker(**jobs[0][1])]
    context = multiprocessing.get_context("spawn")
    locks = {gpu: context.Lock() for gpu in gpus}
    results = context.Queue()
    processes = []
    for gpu, kwargs in jobs:
        with _visible_devices(gpu):
            process = context.Process(target=_worker_process, args=(worker, kwargs, locks[gpu], results),
                                      name=kwargs["label"])
            process.start()
        processes.append((process, kwargs["label"]))
    for process, label in processes:   # a summary is small: it sits in the pipe while its worker exits
        process.join(None if deadline is None else max(0.0, deadline - time.time()) + WORKER_GRACE_S)
        if process.is_alive():   # hung past the deadline: its part file keeps what it finished
            log(f"[{label}] still running {WORKER_GRACE_S:g} s after the deadline: terminated")
            process.terminate()
            process.join()
    summaries = []
    with contextlib.suppress(queue.Empty):
        while len(summaries) < len(processes):
            summaries.append(results.get(timeout=RESULT_WAIT_S))
    for process, label in processes:
        if not any(s.label == label for s in summaries):   # killed hard: its part file still holds its rows
            summaries.append(ShardSummary(label, stopped="crashed", notes=[f"exit code {process.exitcode}"]))
    return summaries


# ----------------------------------------------------------------------------------------------
# Plan and measured sweep
# ----------------------------------------------------------------------------------------------
def _grid_counts(grid: Grid) -> list[str]:
    lines = []
    for fmt in grid.formats:
        problems = grid.problems[fmt]
        regimes = {r: sum(p.regime == r for p in problems) for r in ab.REGIMES}
        tiles = len({c.tile_config for c in grid.configs[fmt]})
        lines.append(f"  {fmt}: {len(problems)} problems ({len({p.shape for p in problems})} shapes; "
                     + ", ".join(f"{r} {c}" for r, c in regimes.items())
                     + f") x {len(grid.configs[fmt])} configs ({tiles} knob sets) = "
                       f"{len(problems) * len(grid.configs[fmt])} rows")
    return lines


def _sweep_setup(args, hw: HardwareParams, gpu_key: str, kernel_limit: StageLimit | None):
    grid = build_grid(args.grid, hw, formats=parse_formats(args.formats, args.grid), shapes=parse_shapes(args.shapes),
                      kernel_stage_limit=kernel_limit)
    done = {row_key(r) for r in load_rows(args.csv)}
    return grid, pending_work(grid, done, gpu_key)


def _print_plan(grid: Grid, work, shards, hw, gpus: int, args, kernel_limit) -> None:
    limit = "the SM100 formula and the kernel's own limit" if kernel_limit else \
        "the SM100 formula only (h200_stream did not import)"
    log(f"ablate plan: grid {grid.name}, stage counts up to {limit} on the {grid.gpu} budget")
    for line in _grid_counts(grid):
        log(line)
    rows = sum(len(keys) for _, keys in work)
    log(f"  to run: {len(work)} specialisations, {rows} rows ({grid.num_rows - rows} of the grid already in "
         f"{args.csv})")
    log("  estimate: " + estimate_sweep(shards, hw, gpus, args.row_budget_s).describe(gpus, args.workers_per_gpu))


def cmd_plan(args) -> int:
    kernel_limit = h200_kernel_stage_limit()
    merge_parts(args.csv, log)
    grid, work = _sweep_setup(args, H200, H200.key, kernel_limit)
    gpus = args.gpus or 1
    shards = shard_work(work, gpus * args.workers_per_gpu, cost=lambda item: sum(work_cost(item, H200,
                                                                                          args.row_budget_s)))
    _print_plan(grid, work, shards, H200, gpus, args, kernel_limit)
    return 0


def cmd_measure(args) -> int:
    """The measured sweep (needs a CUDA GPU of compute capability 9.0 and the commit)."""
    from gbs.backends import gpu_available

    grid_formats, shapes = parse_formats(args.formats, args.grid), parse_shapes(args.shapes)
    if args.budget_s is not None and args.budget_s <= MERGE_MARGIN_S:
        raise ValueError(f"--budget-s must be more than {MERGE_MARGIN_S:g} s, got {args.budget_s}")
    if not gpu_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return NO_GPU_STATUS
    start = time.time()
    env = environment_fields()
    if env["commit"] in ("", "unknown"):
        print("measured rows must record the commit: run inside the git checkout or set GBS_COMMIT=<sha>",
              file=sys.stderr)
        return NO_GPU_STATUS
    devices = visible_gpus()[: args.gpus or None]
    wrong = [f"{name} (sm_{cc[0]}{cc[1]})" for _, name, cc in devices if tuple(cc) != (9, 0)]
    if wrong or len({name for _, name, _ in devices}) != 1:
        print(f"the sweep times the H200 kernel (sm_90) on identical GPUs; visible: "
              f"{[f'{n} (sm_{c[0]}{c[1]})' for _, n, c in devices]}", file=sys.stderr)
        return NO_GPU_STATUS
    kernel_limit = h200_kernel_stage_limit()
    if kernel_limit is None:
        print("gbs.numba_kernels.h200_stream does not import; nothing to time", file=sys.stderr)
        return NO_GPU_STATUS
    gpu_key = gpu_slug(devices[0][1])
    hw = HARDWARE.get(gpu_key, H200)
    if gpu_key not in HARDWARE:
        log(f"note: no model for {devices[0][1]!r}; stage counts use the H200's budget")
    merge_parts(args.csv, log)
    grid = build_grid(args.grid, hw, formats=grid_formats, shapes=shapes, kernel_stage_limit=kernel_limit)
    work = pending_work(grid, {row_key(r) for r in load_rows(args.csv)}, gpu_key)
    shards = shard_work(work, len(devices) * args.workers_per_gpu,
                        cost=lambda item: sum(work_cost(item, hw, args.row_budget_s)))
    log(f"gbs ablate on {len(devices)} x {devices[0][1]} ({env['date']}, commit {env['commit']})")
    _print_plan(grid, work, shards, hw, len(devices), args, kernel_limit)
    if not work:
        log("nothing to run: every row of the grid is in the CSV")
        return 0
    deadline = None if args.budget_s is None else start + args.budget_s - MERGE_MARGIN_S
    summaries = run_workers(shards, [d[0] for d in devices], args.csv, hw_key=hw.key, seed=args.seed,
                            row_budget_s=args.row_budget_s, deadline=deadline)
    added = merge_parts(args.csv, log)
    log("\nsummary:")
    for summary in summaries:
        log("  " + describe_summary(summary))
        for note in summary.notes:
            log(f"    {note}")
    remaining = sum(len(keys) for _, keys in pending_work(grid, {row_key(r) for r in load_rows(args.csv)}, gpu_key))
    log(f"{added} rows added to {args.csv} in {time.time() - start:.0f} s; "
         + (f"{remaining} rows of the grid remain: run the same command again to continue" if remaining
            else "the grid is complete"))
    return 1 if any(s.failed or s.stopped in ("failures", "crashed") for s in summaries) else 0


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def cmd_ablate(args) -> int:
    """Handler of ``python -m gbs ablate``: the chosen modes in order (plan, model, measured sweep,
    calibrate, tables, plot); the measured sweep when no mode is given."""
    parse_formats(args.formats, args.grid)
    parse_shapes(args.shapes)
    if args.workers_per_gpu < 1 or (args.gpus is not None and args.gpus < 1):
        raise ValueError("--gpus and --workers-per-gpu must be >= 1")
    if args.row_budget_s <= 0:
        raise ValueError(f"--row-budget-s must be > 0, got {args.row_budget_s}")
    analysis = args.plan or args.model or args.calibrate or args.tables or args.plot is not None
    steps = [(args.plan, cmd_plan), (args.model, cmd_model), (args.measure or not analysis, cmd_measure),
             (args.calibrate, cmd_calibrate), (args.tables, cmd_tables), (args.plot is not None, cmd_plot)]
    status = 0
    for chosen, step in steps:
        if chosen:
            status = step(args)
            if status:
                return status
    return status


def add_ablate_parser(subparsers):
    """Register ``ablate`` on an ``argparse`` subparsers object (``python -m gbs ablate``)."""
    p = subparsers.add_parser(
        "ablate", help="sweep every legal config on the H200 into data/ablations.csv; model, calibrate, tables, plots",
        description="Time every legal (ab_swapped, mma_bn, cta_group, stages) of the H200 kernel through the "
                    "dispatch's override path on a grid of MoE problems (three regimes, uniform and ragged loads), "
                    "appending one row per (problem, config) to the CSV; resumable, sharded by kernel "
                    "specialisation over every visible GPU, stopped cleanly by --budget-s. Without a mode flag "
                    "it runs the measured sweep (needs a CUDA GPU: exit status 2 without one).")
    p.add_argument("--grid", choices=GRIDS, default=GRID_MINIMAL,
                   help="minimal: NVFP4 and MXFP8, DeepSeek up/down and Kimi, avg_m 2-512, stages {2,4,6,deepest}; "
                        "full: every format, shape, load of gbs.lab.ablation_data and every stage count")
    p.add_argument("--formats", default=None, help=f"comma-separated subset of {','.join(FULL_FORMATS)}")
    names = ", ".join(f"{name}={n}x{k}" for name, (n, k) in SHAPE_NAMES.items())
    p.add_argument("--shapes", default=None, help=f"comma-separated NxK or names ({names})")
    p.add_argument("--csv", default=DEFAULT_CSV, help=f"the ablation CSV (default {DEFAULT_CSV}); part files of "
                                                      f"workers go to <csv>{PARTS_SUFFIX}/")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the measured sweep: no compile or row starts that would end after "
                        "it; the next call continues (default: none)")
    p.add_argument("--gpus", type=int, default=None, help="use the first N visible GPUs (default all; --plan: 1)")
    p.add_argument("--workers-per-gpu", type=int, default=DEFAULT_WORKERS_PER_GPU,
                   help=f"worker processes per GPU (default {DEFAULT_WORKERS_PER_GPU}): one times while the others "
                        "compile; timing is serialised per GPU by a lock")
    p.add_argument("--row-budget-s", type=float, default=ROW_TIMING_BUDGET_S,
                   help=f"timed launches of one row stop after about this long (default {ROW_TIMING_BUDGET_S}; at "
                        f"least {MIN_TIMED_LAUNCHES}, at most {ROW_REPS} launches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic operands")
    p.add_argument("--measure", action="store_true", help="run the measured sweep (the default without other modes)")
    p.add_argument("--plan", action="store_true", help="print the work left and the expected device time (no GPU)")
    p.add_argument("--model", action="store_true",
                   help="write modelled rows (source=model) for the H200 and the B200 on the grid (no GPU)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the H200 model to the measured rows; print rank correlation and median error per regime")
    p.add_argument("--tables", action="store_true",
                   help="print the upstream, H200-derived and B200-model-derived dispatch tables side by side")
    p.add_argument("--h200-source", choices=ab.SOURCES, default=ab.SOURCE_MEASURED,
                   help="rows the H200 table of --tables is derived from (default measured)")
    p.add_argument("--plot", nargs="?", const=DEFAULT_PLOT_DIR, default=None, metavar="DIR",
                   help=f"write one heatmap PNG per (GPU, source, format, shape, regime) (default {DEFAULT_PLOT_DIR})")
    p.set_defaults(func=cmd_ablate)
    return p


__all__ = [
    "ConfigNotRunnable", "DeviceRunner", "RowContext", "ShardSummary", "add_ablate_parser", "cmd_ablate",
    "describe_summary", "override_config", "rotation_plan", "run_shard", "run_worker", "run_workers",
    "visible_gpus",
]
