"""``python -m gbs ablate``: the config sweep on the H200, ``data/ablations.csv``, and what is read from it.

The sweep times every legal ``ab_swapped`` x ``mma_bn`` x ``cta_group`` x ``num_pipeline_stages`` of
the H200 kernel (``gbs.numba_kernels.h200_stream``) on a grid of problems, through the override
path of the dispatch (``override_config``: the ``KernelConfig`` that ``override=True`` builds, the
same object production hands the kernel), with the benchmark rules of ``gbs.lab.bench``: CUDA events
after warm-up, inputs rotated past the L2, median / p10 / p90. Each timed launch becomes one
``gbs.lab.ablation_data.AblationRow`` (``source="measured"``) in the CSV.

Grids (``--grid``):

* ``minimal``: NVFP4 and MXFP8; DeepSeek up (4096, 7168) and down (7168, 2048) with 64 slots,
  Kimi (512, 7168) with 8; uniform loads of ``MINIMAL_AVG_M`` tokens per slot (decode 2-8, small
  prefill 16-64, large prefill 128, 512; fewer slots where the total would pass
  ``MINIMAL_MAX_TOTAL_TOKENS``) plus one ragged load per regime; every legal knob set with stages
  ``{2, 4, 6, deepest}``.
* ``full``: every format and shape of ``gbs.lab.ablation_data`` (``sweep_problems``: 8 and 64 slots, 1-4096
  tokens per slot, uniform and ragged) with every stage count that fits.

The deepest stage count of a knob set is the smaller of the SM100 formula with the H200 budget
(what the dispatch and the CSV schema allow) and the kernel's own shared-memory limit
(``h200_launch.max_pipeline_stages``); a config the kernel still refuses is not recorded.

How the device time is spent. A JIT compile per kernel specialisation (format x knobs x stages)
costs seconds, so the work is ordered by specialisation: each compiled kernel times every problem
of its format before the next is built, and specialisations go in priority order (every knob set
at its deepest ring first, then 6, 4, 2 stages; ``grid_specs``), so a sweep cut short still covers
every knob set in every regime. The work is sharded by specialisation over every visible GPU
(``--workers-per-gpu`` processes per GPU, each with its own ``CUDA_VISIBLE_DEVICES``; no NCCL):
a process compiles its next kernel on the CPU while another of the same GPU holds that GPU's lock
and times, so compiles overlap timing and timing never overlaps timing. Problems are built once
per process on the device (weights per (format, shape) shared by every load; rotation copies as
extra experts and token copies), the read ceiling is measured once per process.

Resumable and multi-process safe. Every finished row is appended at once to the worker's own part
file (``<csv>.parts/``); the parent merges the parts into the CSV at the end, and any mode merges
leftover parts of an interrupted run first. Rows whose key (``KEY_COLUMNS``) is already in the CSV
are not run again. ``--budget-s`` stops every worker cleanly before a compile or a row that would
pass the deadline (estimates from what was observed so far), so the next call continues.

Other modes (no GPU needed): ``--plan`` prints the work and the expected device time; ``--model``
writes ``source="model"`` rows for the H200 and the B200 (``gbs.lab.perfmodel``) on the same grid;
``--calibrate`` fits the H200 model to the measured rows and prints its error; ``--tables``
prints the upstream, H200-derived and B200-model-derived dispatch tables side by side;
``--plot [DIR]`` writes one heatmap PNG per (GPU, source, format, shape, regime).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import glob
import math
import os
import queue
import sys
import textwrap
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from gbs.lab import ablation_data as ab
from gbs.lab.ablation_data import ABLATION_COLUMNS, AblationRow, ProblemKey
from gbs.lab.bench import (
    BACKEND_UNAVAILABLE,
    MIN_TIMED_LAUNCHES,
    QUICK_READ_CEILING_BYTES,
    WARMUP_BUDGET_S,
    Timing,
    device_l2_bytes,
    environment_fields,
    gpu_slug,
    measure_read_bandwidth,
    rotation_count,
    synthetic_problem,
    time_launches,
    useful_bytes,
)
from gbs.dispatch import (
    REGIME_OVERRIDE,
    RULE_OVERRIDE,
    STAGES_AUTO,
    STAGES_OVERRIDE,
    KernelConfig,
    grouped_matmul_nvfp4_dispatch,
)
from gbs.lab.perfmodel import B200, H200, HARDWARE, HardwareParams, ModelConfig, model_config, model_error, \
    resolve_names, tile_label
from gbs.schedule import TileConfig

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
DEFAULT_CSV = os.path.join("data", "ablations.csv")
DEFAULT_PLOT_DIR = os.path.join("figures", "ablations")
PARTS_SUFFIX = ".parts"           # <csv>.parts/: one part file per worker process

# A row's identity: the CSV key columns (avg_m and regime follow from total tokens and slots) and the
# source, so a measured and a modelled row of one config are two rows.
KEY_COLUMNS = ("gpu", "format", "n", "k", "routing", "num_active_experts", "total_tokens",
               "ab_swapped", "mma_bn", "cta_group", "stages", "source")

# Workload shapes by name (workloads.md).
SHAPE_NAMES = {
    "deepseek_up": (4096, 7168), "deepseek_down": (7168, 2048), "kimi_up": (512, 7168), "kimi_down": (7168, 256),
    "small_moe_up": (2048, 4096), "mxfp8_gate_up": (6144, 6144), "mxfp8_down": (6144, 3072),
}
SHAPE_TITLES = {(4096, 7168): "DeepSeek up", (7168, 2048): "DeepSeek down", (512, 7168): "Kimi up",
                (7168, 256): "Kimi down", (2048, 4096): "small MoE up", (6144, 6144): "MXFP8 MoE gate_up",
                (6144, 3072): "MXFP8 MoE down"}

GRID_MINIMAL = "minimal"
GRID_FULL = "full"
GRIDS = (GRID_MINIMAL, GRID_FULL)
MINIMAL_FORMATS = ("nvfp4", "mxfp8")
FULL_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "w4a8")
# Slots per shape in the minimal grid: a DeepSeek decode step has 64 active experts on a GPU, Kimi's
# TP-8 layer 8; other shapes given with --shapes get MINIMAL_DEFAULT_SLOTS.
MINIMAL_SLOTS = {(4096, 7168): 64, (7168, 2048): 64, (512, 7168): 8}
MINIMAL_DEFAULT_SLOTS = 64
MINIMAL_AVG_M = (2, 4, 8, 16, 32, 64, 128, 512)      # decode 2-8, small prefill 16-64, large prefill
MINIMAL_RAGGED_AVG_M = (4, 32, 128)                   # one ragged load per regime
MINIMAL_MAX_TOTAL_TOKENS = 16384                      # bounds the bytes of the large loads
MINIMAL_STAGES = (2, 4, 6)                            # plus the knob set's deepest ring
# Order of work inside a grid: the deepest ring (auto) first, then these, then the rest ascending.
STAGE_PRIORITY = (6, 4, 2)

# Timing of one row (gbs.lab.bench.time_launches with a budget): decode rows run ~0.1-1 ms.
ROW_WARMUP = 3
ROW_REPS = 20
ROW_TIMING_BUDGET_S = 0.05
# Estimates for the plan and the budget stop, replaced by observed times as the sweep runs.
COMPILE_S_ESTIMATE = 6.0          # one h200_stream specialisation: 4-6 s measured offline on 2 cores
ROW_OVERHEAD_S = 0.01             # prepare (tensor maps) and event bookkeeping per row
HOST_LAUNCH_S = 20e-6             # host time to enqueue one launch
DEFAULT_ROW_S = 0.5               # a problem not timed yet in this process
WORKER_SETUP_S_ESTIMATE = 40.0    # import, host problems, upload, read ceiling
MERGE_MARGIN_S = 5.0              # kept back from --budget-s for merging the part files
DEFAULT_WORKERS_PER_GPU = 4       # one times while the others compile (a compile costs ~3-5x a spec's rows)
MAX_FAILED_SPECS_IN_A_ROW = 3     # then the worker stops: its CUDA context is likely broken
MAX_NOTES = 20                    # failure notes a worker reports back
RESULT_WAIT_S = 5.0               # wait for a finished worker's summary
GPU_LOCK_TIMEOUT_S = 300.0        # a worker holds its GPU for one specialisation's rows (seconds)
WORKER_GRACE_S = 120.0            # a worker still alive this long after the deadline is terminated
TOKEN_PROBLEM_N = 128             # token operands do not depend on N: built with one 128-row weight band
CALIBRATION_MAX_ROWS = 300        # the fit runs on a stratified sample; the error is reported on all rows
MAX_LOAD_PANELS = 5               # heatmap panels per figure besides the regime's geometric mean
HEATMAP_VMAX = 3.0                # colour saturates at 3x the best time
HEATMAP_CMAP = "YlOrRd"
DEEPEST_COLUMN = "deepest"        # heatmap column shared by the knob sets' deepest rings (minimal grid)
TIE_TOLERANCE = 0.01              # a dispatch pick within 1 % of the fastest "ties" it in a title
POINTS_PER_INCH = 72
TITLE_CHAR_PT = 8.0               # average width of a character of the 13-pt bold figure title
DETAIL_CHAR_PT = 5.2              # ... and of the 9-pt caption

NO_GPU_STATUS = 2
NO_GPU_MESSAGE = ("python -m gbs ablate (a measured sweep) needs a CUDA GPU and Numba finds none here. Without a GPU "
                  "use --plan, --model, --calibrate, --tables or --plot; on the H200 run e.g. "
                  "`GBS_COMMIT=<sha> python -m gbs ablate --grid minimal --budget-s 540`.")


class ConfigNotRunnable(ValueError):
    """The kernel refuses a config the SM100 dispatch allows (e.g. a ring deeper than its real
    shared memory); nothing is recorded for it."""


# ----------------------------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------------------------
class Spec(NamedTuple):
    """One kernel specialisation: a format and a full config (a JIT compile each)."""

    format: str
    config: ModelConfig

    def label(self) -> str:
        return f"{self.format} {self.config.label()}"


@dataclass(frozen=True)
class Grid:
    """Problems and configs of a sweep on one GPU model."""

    name: str
    gpu: str                                              # HardwareParams key the stage counts are for
    problems: dict                                        # format -> tuple[ProblemKey, ...]
    configs: dict                                         # format -> tuple[ModelConfig, ...]

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(self.problems)

    @property
    def num_rows(self) -> int:
        return sum(len(self.problems[f]) * len(self.configs[f]) for f in self.formats)


StageLimit = Callable[[str, TileConfig], int]


def h200_kernel_stage_limit() -> StageLimit | None:
    """The H200 kernel's deepest ring per (format, knobs) from its real shared-memory bytes, or None
    when ``gbs.numba_kernels.h200_stream`` does not import."""
    try:
        from gbs.numba_kernels import h200_launch, h200_ring
    except BACKEND_UNAVAILABLE:
        return None

    def stage_limit(fmt: str, tile: TileConfig) -> int:
        one_stage = h200_ring.StreamSpec(*resolve_names(fmt), tile.ab_swapped, tile.mma_bn, tile.cta_group, 1)
        return h200_launch.max_pipeline_stages(one_stage)

    return stage_limit


def parse_shapes(text: str | None) -> tuple[tuple[int, int], ...] | None:
    """``"deepseek_up,7168x2048"`` -> ((4096, 7168), (7168, 2048)); None stays None."""
    if text is None:
        return None
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item in SHAPE_NAMES:
            shapes.append(SHAPE_NAMES[item])
            continue
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"unknown shape {item!r}: give NxK (e.g. 4096x7168) or one of {sorted(SHAPE_NAMES)}")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise ValueError(f"--shapes is empty; give NxK values or names from {sorted(SHAPE_NAMES)}")
    return tuple(dict.fromkeys(shapes))


def parse_formats(text: str | None, grid: str) -> tuple[str, ...]:
    """Comma-separated formats, default the grid's; ValueError names the allowed ones."""
    if text is None:
        return MINIMAL_FORMATS if grid == GRID_MINIMAL else FULL_FORMATS
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FULL_FORMATS]
    if unknown or not names:
        raise ValueError(f"unknown formats {unknown or list(names)}; expected a comma-separated subset of "
                         f"{list(FULL_FORMATS)}")
    return names


def grid_problems(grid: str, fmt: str, shapes: Sequence[tuple[int, int]] | None = None) -> tuple[ProblemKey, ...]:
    """The problems of a grid for one format (see the module docstring)."""
    if grid == GRID_FULL:
        return tuple(ab.sweep_problems(fmt, shapes=shapes, routings=ab.ABLATION_ROUTINGS))
    if grid != GRID_MINIMAL:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    keys = []
    for n, k in (shapes if shapes is not None else tuple(MINIMAL_SLOTS)):
        base_slots = MINIMAL_SLOTS.get((n, k), MINIMAL_DEFAULT_SLOTS)
        for routing, loads in (("uniform", MINIMAL_AVG_M), ("ragged", MINIMAL_RAGGED_AVG_M)):
            for avg_m in loads:
                slots = max(1, min(base_slots, MINIMAL_MAX_TOTAL_TOKENS // avg_m))
                keys.append(ProblemKey(fmt, n, k, routing, slots, slots * avg_m))
    return tuple(keys)


def stage_counts(grid: str, deepest: int) -> tuple[int, ...]:
    """Stage counts swept for a knob set whose deepest ring is ``deepest``."""
    if deepest < 1:
        return ()
    if grid == GRID_FULL:
        return tuple(range(1, deepest + 1))
    return tuple(sorted({s for s in MINIMAL_STAGES if s <= deepest} | {deepest}))


def grid_configs(grid: str, fmt: str, hw: HardwareParams, kernel_stage_limit: StageLimit | None = None
                 ) -> tuple[ModelConfig, ...]:
    """Every legal knob set (``gbs.lab.ablation_data.legal_configs``) with the grid's stage counts up to the
    deepest ring that fits both ``hw``'s budget (SM100 formula) and the kernel (``kernel_stage_limit``)."""
    tiles = dict.fromkeys(c.tile_config for c in ab.legal_configs(fmt, hw))
    configs = []
    for tile in tiles:
        deepest = hw.max_stages(fmt, tile)
        if kernel_stage_limit is not None:
            deepest = min(deepest, kernel_stage_limit(fmt, tile))
        configs += [ModelConfig.from_tile(tile, s) for s in stage_counts(grid, deepest)]
    return tuple(configs)


def build_grid(grid: str, hw: HardwareParams, *, formats: Sequence[str] | None = None,
               shapes: Sequence[tuple[int, int]] | None = None,
               kernel_stage_limit: StageLimit | None = None) -> Grid:
    formats = tuple(formats) if formats is not None else parse_formats(None, grid)
    return Grid(grid, hw.key, {f: grid_problems(grid, f, shapes) for f in formats},
                {f: grid_configs(grid, f, hw, kernel_stage_limit) for f in formats})


def _stage_rank(stages: int, deepest: int) -> tuple[int, int]:
    if stages == deepest:
        return 0, 0
    if stages in STAGE_PRIORITY:
        return 1 + STAGE_PRIORITY.index(stages), 0
    return 1 + len(STAGE_PRIORITY), stages


def grid_specs(grid: Grid) -> list[Spec]:
    """Every specialisation of the grid, in the order of work: by stage priority (each knob set's
    deepest ring, then ``STAGE_PRIORITY``, then the rest), then format, then knob set."""
    ranked = []
    for f_index, fmt in enumerate(grid.formats):
        tiles = list(dict.fromkeys(c.tile_config for c in grid.configs[fmt]))
        deepest = {t: max(c.stages for c in grid.configs[fmt] if c.tile_config == t) for t in tiles}
        for config in grid.configs[fmt]:
            tile = config.tile_config
            ranked.append(((_stage_rank(config.stages, deepest[tile]), f_index, tiles.index(tile)),
                           Spec(fmt, config)))
    return [spec for _, spec in sorted(ranked, key=lambda item: item[0])]


# ----------------------------------------------------------------------------------------------
# Resumability and sharding
# ----------------------------------------------------------------------------------------------
def sweep_key(gpu: str, source: str, key: ProblemKey, config: ModelConfig) -> tuple:
    """The ``KEY_COLUMNS`` values of the row of a (problem, config) on ``gpu`` from ``source``."""
    values = dict(key._asdict(), gpu=gpu, source=source, ab_swapped=config.ab_swapped, mma_bn=config.mma_bn,
                  cta_group=config.cta_group, stages=config.stages)
    return tuple(values[column] for column in KEY_COLUMNS)


def row_key(row: AblationRow) -> tuple:
    return tuple(getattr(row, column) for column in KEY_COLUMNS)


WorkItem = tuple  # (Spec, tuple[ProblemKey, ...]): one specialisation and the problems still to time


def pending_work(grid: Grid, done: Iterable[tuple], gpu: str) -> list[WorkItem]:
    """(spec, problems without a measured row on ``gpu``) in the order of work; specs with
    nothing left are dropped, so a finished specialisation is never compiled again."""
    done = set(done)
    work = []
    for spec in grid_specs(grid):
        keys = tuple(k for k in grid.problems[spec.format]
                     if sweep_key(gpu, ab.SOURCE_MEASURED, k, spec.config) not in done)
        if keys:
            work.append((spec, keys))
    return work


def shard_work(work: Sequence[WorkItem], num_workers: int, cost: Callable[[WorkItem], float] | None = None
               ) -> list[list[WorkItem]]:
    """Split the work by specialisation: each item goes whole to the worker with the least
    estimated work so far (ties: the lowest index), so every worker compiles distinct kernels,
    the loads balance and each worker keeps the order of work."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    loads = [0.0] * num_workers
    shards: list[list[WorkItem]] = [[] for _ in range(num_workers)]
    for item in work:
        i = min(range(num_workers), key=lambda w: (loads[w], w))
        shards[i].append(item)
        loads[i] += cost(item) if cost is not None else 1.0
    return shards


# ----------------------------------------------------------------------------------------------
# Device-time estimate
# ----------------------------------------------------------------------------------------------
def row_seconds_estimate(kernel_us: float, row_budget_s: float = ROW_TIMING_BUDGET_S) -> float:
    """Wall time of one row under ``gbs.lab.bench.time_launches``' budget rule: a first call, one
    sizing launch, warm-up and timed launches, plus the row's overhead."""
    per_launch = max(kernel_us * 1e-6, HOST_LAUNCH_S)
    warmup = min(ROW_WARMUP, max(1, int(WARMUP_BUDGET_S / per_launch)))
    reps = min(ROW_REPS, max(MIN_TIMED_LAUNCHES, int(row_budget_s / per_launch)))
    return (2 + warmup + reps) * per_launch + ROW_OVERHEAD_S


@dataclass(frozen=True)
class SweepEstimate:
    specs: int
    rows: int
    compile_s: float                  # CPU, overlapped with timing when several workers share a GPU
    timing_s: float                   # GPU, serialised per GPU
    wall_s: float                     # the busiest GPU, setup included

    def describe(self, gpus: int, workers_per_gpu: int) -> str:
        return (f"{self.specs} specialisations x ~{COMPILE_S_ESTIMATE:g} s compile = {self.compile_s:.0f} s of CPU; "
                f"{self.rows} rows ~ {self.timing_s:.0f} s of GPU timing (perf-model kernel times); "
                f"{gpus} GPU(s) x {workers_per_gpu} worker(s): ~{self.wall_s:.0f} s wall "
                f"({WORKER_SETUP_S_ESTIMATE:g} s setup included)")


def work_cost(item: WorkItem, hw: HardwareParams, row_budget_s: float = ROW_TIMING_BUDGET_S) -> tuple[float, float]:
    """(compile s, timing s) of one work item, kernel times from ``hw``'s model."""
    spec, keys = item
    timing = sum(row_seconds_estimate(model_config(ab.problem_shape(k), spec.config, hw).time_us, row_budget_s)
                 for k in keys)
    return COMPILE_S_ESTIMATE, timing


def estimate_sweep(shards: Sequence[Sequence[WorkItem]], hw: HardwareParams, gpus: int,
                   row_budget_s: float = ROW_TIMING_BUDGET_S) -> SweepEstimate:
    """Expected device time: shard ``w`` runs on GPU ``w % gpus``; a GPU's timing is serial, its
    workers compile in parallel, so a GPU takes max(its timing, its slowest worker's compile +
    timing) after setup."""
    compile_total = timing_total = 0.0
    per_gpu_timing = [0.0] * gpus
    per_gpu_worker = [0.0] * gpus
    specs = rows = 0
    for w, shard in enumerate(shards):
        c = t = 0.0
        for item in shard:
            ci, ti = work_cost(item, hw, row_budget_s)
            c, t = c + ci, t + ti
            specs, rows = specs + 1, rows + len(item[1])
        compile_total, timing_total = compile_total + c, timing_total + t
        per_gpu_timing[w % gpus] += t
        per_gpu_worker[w % gpus] = max(per_gpu_worker[w % gpus], c + t)
    wall = max((max(a, b) for a, b in zip(per_gpu_timing, per_gpu_worker)), default=0.0)
    return SweepEstimate(specs, rows, compile_total, timing_total, wall + (WORKER_SETUP_S_ESTIMATE if specs else 0))


# ----------------------------------------------------------------------------------------------
# CSV: part files, merge, atomic writes
# ----------------------------------------------------------------------------------------------
def parts_dir(csv_path: str) -> str:
    return csv_path + PARTS_SUFFIX


class PartWriter:
    """Appends rows to one worker's part file, one flushed line per row (a killed worker loses
    at most the line it was writing)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.path = path
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=ABLATION_COLUMNS)
        if new:
            self._writer.writeheader()
            self._file.flush()

    def write(self, row: AblationRow) -> None:
        self._writer.writerow(row.to_csv_dict())
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_part(path: str, log: Callable[[str], None] = print) -> list[AblationRow]:
    """Rows of a part file. A bad LAST line is a write cut short by a kill: dropped with a note;
    a bad line elsewhere is a ValueError naming the file and line."""
    with open(path, newline="") as f:
        records = list(csv.DictReader(f))
    rows = []
    for i, record in enumerate(records):
        try:
            if None in record or any(v is None for v in record.values()):
                raise ValueError("wrong number of fields")
            rows.append(AblationRow.from_csv_dict(record))
        except (TypeError, ValueError) as err:
            if i == len(records) - 1:
                log(f"note: dropped the last line of {path} (cut short: {err})")
                break
            raise ValueError(f"{path}, record {i + 1}: {err}") from None
    return rows


def load_rows(csv_path: str) -> list[AblationRow]:
    """The CSV's rows (validated), or none when it does not exist yet."""
    return ab.read_ablations(csv_path) if os.path.exists(csv_path) else []


def _sort_key(row: AblationRow) -> tuple:
    return (row.gpu, row.source, row.format, row.n, row.k, row.routing, row.num_active_experts, row.total_tokens,
            row.cta_group, row.mma_bn, not row.ab_swapped, row.stages)


def merge_rows(existing: Sequence[AblationRow], new: Sequence[AblationRow], *, replace: bool
               ) -> tuple[list[AblationRow], int, int]:
    """(merged rows in a stable order, rows added, rows replaced). A key already present keeps its
    existing row unless ``replace``; among the new rows the last of a key wins."""
    merged = {row_key(r): r for r in existing}
    added = replaced = 0
    for row in new:
        key = row_key(row)
        if key not in merged:
            added += 1
        elif replace and merged[key] != row:
            replaced += 1
        else:
            continue
        merged[key] = row
    return sorted(merged.values(), key=_sort_key), added, replaced


def write_rows_atomic(csv_path: str, rows: Sequence[AblationRow]) -> None:
    """``gbs.lab.ablation_data.write_ablations`` into a temporary file, then renamed over ``csv_path``."""
    tmp = f"{csv_path}.tmp-{os.getpid()}"
    ab.write_ablations(tmp, rows)
    os.replace(tmp, csv_path)


def update_csv(csv_path: str, new: Sequence[AblationRow], *, replace: bool) -> tuple[int, int, int]:
    """Merge ``new`` into the CSV; returns (rows added, replaced, rows in the CSV)."""
    merged, added, replaced = merge_rows(load_rows(csv_path), new, replace=replace)
    if added or replaced or not os.path.exists(csv_path):
        write_rows_atomic(csv_path, merged)
    return added, replaced, len(merged)


def merge_parts(csv_path: str, log: Callable[[str], None] = print) -> int:
    """Merge every part file of ``csv_path`` into it and delete the parts; returns rows added."""
    paths = sorted(glob.glob(os.path.join(parts_dir(csv_path), "*.csv")))
    if not paths:
        return 0
    rows = [row for path in paths for row in read_part(path, log)]
    added, _, total = update_csv(csv_path, rows, replace=False)
    for path in paths:
        os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(parts_dir(csv_path))
    log(f"merged {len(paths)} part file(s): {added} new rows, {total} rows in {csv_path}")
    return added


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


def dispatch_pick(key: ProblemKey, smem_per_sm: int) -> ModelConfig | None:
    """What production's dtype routing (``gbs.lab.ablation_data.dispatch_config``) picks for the problem with
    this shared-memory budget; None when its tuned stage count does not fit the budget."""
    try:
        return ModelConfig.of(ab.dispatch_config(key, smem_per_sm))
    except ValueError:
        return None


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
    ``gbs.lab.bench.L2_ROTATION_FACTOR`` x the L2 (``rotation_count`` of its useful bytes); copy ``c``
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
        """Synthetic operands on the host (``gbs.lab.bench.synthetic_problem``), no GPU work."""
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
        """Streaming-read ceiling of this GPU in TB/s (``gbs.lab.bench.measure_read_bandwidth``)."""
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


def _log(message: str) -> None:
    print(message, flush=True)


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
    _log(f"[{label}] ready in {time.time() - t0:.0f} s on {env['gpu']}: {len(runner.problems)} problems, "
         f"read ceiling {read_tbs:.2f} TB/s, {len(work)} specialisations to run")
    ctx = RowContext(gpu_slug(env["gpu"]), env["gpu"], env["date"], env["commit"], read_tbs, hw)
    with PartWriter(part_path) as writer:
        return run_shard(work, runner, ctx, writer.write, deadline=deadline, log=_log, label=label)


def _worker_process(worker: Callable[..., ShardSummary], kwargs: dict, gpu_lock, results) -> None:
    """Entry point of a spawned worker (its CUDA_VISIBLE_DEVICES names one GPU)."""
    try:
        summary = worker(gpu_lock=gpu_lock, **kwargs)
    except BaseException as err:  # reported to the parent, which merges what was written
        summary = ShardSummary(kwargs["label"], stopped="crashed", notes=[f"{type(err).__name__}: {err}"])
        _log(f"[{kwargs['label']}] crashed: {type(err).__name__}: {err}")
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
            _log(f"[{label}] still running {WORKER_GRACE_S:g} s after the deadline: terminated")
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
# Modes
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
    _log(f"ablate plan: grid {grid.name}, stage counts up to {limit} on the {grid.gpu} budget")
    for line in _grid_counts(grid):
        _log(line)
    rows = sum(len(keys) for _, keys in work)
    _log(f"  to run: {len(work)} specialisations, {rows} rows ({grid.num_rows - rows} of the grid already in "
         f"{args.csv})")
    _log("  estimate: " + estimate_sweep(shards, hw, gpus, args.row_budget_s).describe(gpus, args.workers_per_gpu))


def cmd_plan(args) -> int:
    kernel_limit = h200_kernel_stage_limit()
    merge_parts(args.csv, _log)
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
        _log(f"note: no model for {devices[0][1]!r}; stage counts use the H200's budget")
    merge_parts(args.csv, _log)
    grid = build_grid(args.grid, hw, formats=grid_formats, shapes=shapes, kernel_stage_limit=kernel_limit)
    work = pending_work(grid, {row_key(r) for r in load_rows(args.csv)}, gpu_key)
    shards = shard_work(work, len(devices) * args.workers_per_gpu,
                        cost=lambda item: sum(work_cost(item, hw, args.row_budget_s)))
    _log(f"gbs ablate on {len(devices)} x {devices[0][1]} ({env['date']}, commit {env['commit']})")
    _print_plan(grid, work, shards, hw, len(devices), args, kernel_limit)
    if not work:
        _log("nothing to run: every row of the grid is in the CSV")
        return 0
    deadline = None if args.budget_s is None else start + args.budget_s - MERGE_MARGIN_S
    summaries = run_workers(shards, [d[0] for d in devices], args.csv, hw_key=hw.key, seed=args.seed,
                            row_budget_s=args.row_budget_s, deadline=deadline)
    added = merge_parts(args.csv, _log)
    _log("\nsummary:")
    for summary in summaries:
        _log("  " + describe_summary(summary))
        for note in summary.notes:
            _log(f"    {note}")
    remaining = sum(len(keys) for _, keys in pending_work(grid, {row_key(r) for r in load_rows(args.csv)}, gpu_key))
    _log(f"{added} rows added to {args.csv} in {time.time() - start:.0f} s; "
         + (f"{remaining} rows of the grid remain: run the same command again to continue" if remaining
            else "the grid is complete"))
    return 1 if any(s.failed or s.stopped in ("failures", "crashed") for s in summaries) else 0


def cmd_model(args) -> int:
    """Modelled rows for the H200 (the measured grid's configs) and the B200 (its own stage limits)."""
    formats, shapes = parse_formats(args.formats, args.grid), parse_shapes(args.shapes)
    merge_parts(args.csv, _log)
    commit = environment_fields()["commit"]
    date = datetime.date.today().isoformat()
    rows = []
    for hw, limit in ((H200, h200_kernel_stage_limit()), (B200, None)):
        grid = build_grid(args.grid, hw, formats=formats, shapes=shapes, kernel_stage_limit=limit)
        for fmt in grid.formats:
            rows += ab.model_rows(hw, grid.problems[fmt], configs=grid.configs[fmt], date=date, commit=commit)
        _log(f"modelled {hw.name}: {grid.num_rows} rows")
    added, replaced, total = update_csv(args.csv, rows, replace=True)
    _log(f"{args.csv}: {added} modelled rows added, {replaced} replaced, {total} rows in all")
    return 0


def calibration_sample(rows: Sequence[AblationRow], max_rows: int) -> list[AblationRow]:
    """At most ``max_rows`` rows, spread evenly over each (format, shape, regime) group in proportion
    to its size (deterministic), so the fit sees every group."""
    if len(rows) <= max_rows:
        return list(rows)
    groups: dict[tuple, list[AblationRow]] = {}
    for row in sorted(rows, key=_sort_key):
        groups.setdefault((row.format, row.n, row.k, row.regime), []).append(row)
    sample = []
    for members in groups.values():
        take = max(1, round(max_rows * len(members) / len(rows)))
        sample += [members[int(i)] for i in np.linspace(0, len(members) - 1, min(take, len(members)))]
    return sample


def cmd_calibrate(args) -> int:
    merge_parts(args.csv, _log)
    rows = [r for r in load_rows(args.csv) if r.source == ab.SOURCE_MEASURED and r.gpu == H200.key]
    if not rows:
        print(f"no measured {H200.key} rows in {args.csv}: run the sweep on the H200 first", file=sys.stderr)
        return 1
    sample = calibration_sample(rows, CALIBRATION_MAX_ROWS)
    result = ab.calibrate_rows(sample, H200)
    cases = [(ab.problem_shape(r.key), r.config) for r in rows]
    measured = [r.median_us for r in rows]
    before, after = model_error(cases, measured, H200), model_error(cases, measured, result.hardware)
    _log(f"calibrated the H200 model on {len(sample)} of {len(rows)} measured rows "
         f"({result.iterations} iterations, {'converged' if result.converged else 'not converged'})")
    for name in result.free:
        _log(f"  {name}: {getattr(result.initial, name):.4g} -> {getattr(result.hardware, name):.4g}"
             + (" (not constrained by these rows)" if name in result.unidentified else ""))
    _log(f"\n### Before (all {len(rows)} measured rows)\n\n{before.to_markdown()}")
    _log(f"\n### After\n\n{after.to_markdown()}")
    return 0


def cmd_tables(args) -> int:
    merge_parts(args.csv, _log)
    rows = load_rows(args.csv)
    printed = 0
    for fmt in FULL_FORMATS:
        mine = [r for r in rows if r.format == fmt and r.gpu == H200.key and r.source == args.h200_source]
        theirs = [r for r in rows if r.format == fmt and r.gpu == B200.key and r.source == ab.SOURCE_MODEL]
        if not mine and not theirs:
            continue
        if not mine or not theirs:
            _log(f"{fmt}: skipped: needs {H200.key} {args.h200_source} rows and {B200.key} model rows "
                 f"(has {len(mine)} and {len(theirs)}; run the sweep / --model)")
            continue
        shapes = sorted({r.key.shape for r in mine})
        tokens = sorted({int(r.avg_m) for r in mine if float(r.avg_m).is_integer()})
        try:
            tables = (ab.upstream_table(fmt, shapes=shapes, tokens_per_expert=tokens),
                      ab.derive_dispatch_table(mine, label=f"H200 {args.h200_source}"),
                      ab.derive_dispatch_table(theirs, label="B200 model"))
        except ValueError as err:
            _log(f"{fmt}: cannot derive the tables: {err}")
            continue
        _log(ab.compare_tables(*tables).markdown + "\n")
        printed += 1
    if not printed:
        print(f"no format of {args.csv} has both H200 and B200 rows", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# Heatmaps
# ----------------------------------------------------------------------------------------------
def _shape_title(n: int, k: int) -> str:
    name = SHAPE_TITLES.get((n, k))
    return f"{name} ({n}, {k})" if name else f"({n}, {k})"


def stage_columns(configs: Iterable[ModelConfig]) -> tuple[list[str], dict[ModelConfig, int]]:
    """Heatmap column labels and each config's column: one column per stage count, except that when
    several knob sets' deepest rings are stage counts no other config uses (the minimal grid's
    ``{2, 4, 6, deepest}``), those share one "deepest" column whose cells name their stage count."""
    configs = set(configs)
    deepest: dict[TileConfig, int] = {}
    for c in configs:
        deepest[c.tile_config] = max(deepest.get(c.tile_config, 0), c.stages)
    inner = {c.stages for c in configs if c.stages != deepest[c.tile_config]}
    lone = {d for d in deepest.values() if d not in inner}
    merged = lone if len(lone) > 1 else set()
    stages = sorted({c.stages for c in configs} - merged)
    labels = [str(s) for s in stages] + ([DEEPEST_COLUMN] if merged else [])
    return labels, {c: (len(stages) if c.stages in merged else stages.index(c.stages)) for c in configs}


def _cell_text(value: float, stages: int | None) -> str:
    if not np.isfinite(value):
        return ""
    text = f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return text if stages is None else f"{text}\nx{stages}"


def heatmap_figure(rows: Sequence[AblationRow]):
    """One figure for the rows of one (GPU, source, format, shape, regime): a panel of the geometric
    mean over the regime's loads of time / the load's best time, then one panel per load (at most
    ``MAX_LOAD_PANELS``, evenly spaced); rows = knob sets, columns = stages. A solid box marks the
    fastest config, a dashed one (in its regime's colour) the dispatch's pick."""
    import matplotlib as mpl
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    from gbs.lab import plotting

    first = rows[0]
    group = {(r.gpu, r.source, r.format, r.n, r.k, r.regime) for r in rows}
    if len(group) != 1:
        raise ValueError(f"heatmap_figure takes the rows of one (gpu, source, format, shape, regime), "
                         f"got {sorted(group)}")
    hw = HARDWARE.get(first.gpu)
    smem = (hw or H200).smem_per_sm
    times: dict[ProblemKey, dict[ModelConfig, float]] = {}
    for row in rows:
        times.setdefault(row.key, {})[row.config] = row.median_us
    keys = sorted(times, key=lambda k: (k.routing != "uniform", k.avg_m, k.num_active_experts))
    ratios = {key: {c: t / min(times[key].values()) for c, t in times[key].items()} for key in keys}
    common = set.intersection(*(set(r) for r in ratios.values()))
    geomean = {c: float(np.exp(np.mean([np.log(ratios[k][c]) for k in keys]))) for c in common}
    configs = {c for r in ratios.values() for c in r}
    tiles = sorted({c.tile_config for c in configs}, key=lambda t: (t.cta_group, t.mma_bn, not t.ab_swapped))
    labels, column = stage_columns(configs)
    deepest_column = len(labels) - 1 if labels[-1] == DEEPEST_COLUMN else None
    row_of = {t: i for i, t in enumerate(tiles)}
    shown = keys if len(keys) <= MAX_LOAD_PANELS else [keys[int(i)] for i in np.linspace(0, len(keys) - 1,
                                                                                            MAX_LOAD_PANELS)]
    picks = {key: dispatch_pick(key, smem) for key in keys}
    regime_pick = picks[keys[0]] if len(set(picks.values())) == 1 else None

    panels = [("geomean of " + (f"{len(keys)} loads" if len(keys) > 1 else "1 load"), geomean, regime_pick)]
    panels += [(f"{k.num_active_experts} x {k.avg_m:g} {k.routing}", ratios[k], picks[k]) for k in shown]
    source = "modelled with gbs.lab.perfmodel" if first.source == ab.SOURCE_MODEL else f"measured on {first.gpu_name}"
    width = 2.0 + len(panels) * (0.55 * len(labels) + 0.3)
    with mpl.rc_context(plotting.STYLE):
        fig = Figure(figsize=(max(width, 8.0), 2.3 + 0.32 * len(tiles)), layout="constrained")
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        image = None
        for ax, (title, values, pick) in zip(axes, panels):
            data = np.full((len(tiles), len(labels)), np.nan)
            text = [[""] * len(labels) for _ in tiles]
            for config, ratio in values.items():
                i, j = row_of[config.tile_config], column[config]
                data[i, j] = ratio
                text[i][j] = _cell_text(ratio, config.stages if j == deepest_column else None)
            image = plotting.annotated_heatmap(
                ax, data, x_labels=labels, y_labels=[tile_label(t) for t in tiles], cmap=HEATMAP_CMAP, vmin=1.0,
                vmax=HEATMAP_VMAX, annotations=text, fontsize=6.5)
            ax.set_title(title, fontsize=9, fontweight="normal", loc="center")
            ax.set_xlabel("stages")
            if values:
                best = min(values, key=values.get)
                ax.add_patch(Rectangle((column[best] - 0.5, row_of[best.tile_config] - 0.5), 1, 1, fill=False,
                                       ec="black", lw=2.2))
            if pick in values:
                ax.add_patch(Rectangle((column[pick] - 0.38, row_of[pick.tile_config] - 0.38), 0.76, 0.76,
                                       fill=False, ls="--", lw=1.8, ec=plotting.config_color(pick)))
        fig.colorbar(image, ax=list(axes), label="time / best time of the load", shrink=0.9)
        handles = [Patch(fill=False, ec="black", lw=2.2, label="fastest")]
        if regime_pick is not None:
            handles.append(Patch(fill=False, ec=plotting.config_color(regime_pick), ls="--", lw=1.8,
                                 label=f"dispatch's pick {regime_pick.label()}"))
        axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.12), fontsize=8, ncols=2)
        detail = (f"{first.format.upper()}, {_shape_title(first.n, first.k)}, "
                  f"{plotting.REGIME_LABELS.get(first.regime, first.regime)}, {source} ({first.date}, commit "
                  f"{first.commit}). Colour = time / the load's fastest config (first panel: geometric mean over the "
                  f"regime's {len(keys)} loads; {len(shown)} shown).")
        width_pt = fig.get_figwidth() * POINTS_PER_INCH
        plotting.finding_title(
            fig, textwrap.fill(_finding(first, keys, geomean, regime_pick), int(width_pt / TITLE_CHAR_PT)),
            textwrap.fill(detail, int(width_pt / DETAIL_CHAR_PT)))
    return fig


def _finding(first: AblationRow, keys, geomean: dict, pick: ModelConfig | None) -> str:
    """The title: what is fastest over the regime's loads and where the dispatch's pick stands."""
    from gbs.lab import plotting

    who = (f"Modelled {first.gpu.upper()}" if first.source == ab.SOURCE_MODEL else f"{first.gpu.upper()} measured")
    where = (f"{first.format.upper()} {_shape_title(first.n, first.k)}, "
             f"{plotting.REGIME_LABELS.get(first.regime, first.regime)}")
    if not geomean:
        return f"{who}, {where}: no config was run on every load"
    best = min(geomean, key=geomean.get)
    text = f"{who}, {where}: {best.label()} is fastest"
    if len(keys) > 1:
        text += f" (x{geomean[best]:.2f} of each load's best)"
    if pick is None:
        return text + "; the dispatch has no single pick here"
    if pick not in geomean:
        return text + f"; the dispatch's {pick.label()} was not run"
    slowdown = geomean[pick] / geomean[best]
    if pick == best:
        return text + "; the dispatch picks it"
    if slowdown < 1 + TIE_TOLERANCE:
        return text + f"; the dispatch's {pick.label()} ties it (within {100 * TIE_TOLERANCE:g} %)"
    return text + f"; the dispatch's {pick.label()} is {slowdown:.2f}x slower"


def plot_heatmaps(rows: Sequence[AblationRow], out_dir: str) -> list[str]:
    """One PNG per (GPU, source, format, shape, regime) of ``rows``; returns the paths."""
    groups: dict[tuple, list[AblationRow]] = {}
    for row in rows:
        groups.setdefault((row.gpu, row.source, row.format, row.n, row.k, row.regime), []).append(row)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for (gpu, source, fmt, n, k, regime), members in sorted(groups.items()):
        path = os.path.join(out_dir, f"{gpu}-{source}-{fmt}-{n}x{k}-{regime}.png")
        heatmap_figure(members).savefig(path)
        paths.append(path)
    return paths


def cmd_plot(args) -> int:
    merge_parts(args.csv, _log)
    rows = load_rows(args.csv)
    if args.formats is not None:   # only what was asked for explicitly: the grid's default formats do not filter
        formats = parse_formats(args.formats, args.grid)
        rows = [r for r in rows if r.format in formats]
    if args.shapes is not None:
        shapes = parse_shapes(args.shapes)
        rows = [r for r in rows if r.key.shape in shapes]
    if not rows:
        print(f"no rows to plot in {args.csv}: run the sweep or --model first", file=sys.stderr)
        return 1
    paths = plot_heatmaps(rows, args.plot)
    _log(f"wrote {len(paths)} heatmaps to {args.plot}")
    return 0


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
    "ConfigNotRunnable", "DeviceRunner", "Grid", "KEY_COLUMNS", "PartWriter", "RowContext", "ShardSummary", "Spec",
    "SweepEstimate", "add_ablate_parser", "build_grid", "calibration_sample", "dispatch_pick", "estimate_sweep",
    "grid_configs", "grid_problems", "grid_specs", "heatmap_figure", "merge_parts", "merge_rows",
    "override_config", "pending_work", "plot_heatmaps", "read_part", "row_key", "run_shard", "shard_work",
    "stage_counts", "sweep_key", "update_csv",
]
