"""The grids of ``python -m gbs ablate`` and their work: problems x configs, the kernel specialisations in
the order of work, what is left to run, how it is shared out over workers, and the expected device time.

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

A JIT compile per kernel specialisation (format x knobs x stages, a ``Spec``) costs seconds, so the work
is a list of specialisations, each with the problems it still has to time (``pending_work``: rows already
in the CSV are not run again), in priority order (every knob set at its deepest ring first, then 6, 4, 2
stages; ``grid_specs``), so a sweep cut short still covers every knob set in every regime; ``shard_work``
gives each specialisation whole to one worker. ``estimate_sweep`` is the expected device time
(``--plan``, and the measured sweep's budget stop starts from the same estimates).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

from gbs.lab import ablation_data as ab
from gbs.lab.ablation_data import ProblemKey
from gbs.lab.bench import BACKEND_UNAVAILABLE
from gbs.lab.perfmodel import HardwareParams, ModelConfig, model_config, resolve_names
from gbs.lab.sweep_csv import sweep_key
from gbs.lab.timing import MIN_TIMED_LAUNCHES, WARMUP_BUDGET_S
from gbs.schedule import TileConfig

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

# Timing of one row (gbs.lab.timing.time_launches with a budget), as gbs.lab.sweep.DeviceRunner times it and the
# estimate assumes: decode rows run ~0.1-1 ms.
ROW_WARMUP = 3
ROW_REPS = 20
ROW_TIMING_BUDGET_S = 0.05
# Estimates for the plan and the budget stop, replaced by observed times as the sweep runs.
COMPILE_S_ESTIMATE = 6.0          # one h200_stream specialisation: 4-6 s measured offline on 2 cores
ROW_OVERHEAD_S = 0.01             # prepare (tensor maps) and event bookkeeping per row
HOST_LAUNCH_S = 20e-6             # host time to enqueue one launch
WORKER_SETUP_S_ESTIMATE = 40.0    # import, host problems, upload, read ceiling


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


def dispatch_pick(key: ProblemKey, smem_per_sm: int) -> ModelConfig | None:
    """What production's dtype routing (``gbs.lab.ablation_data.dispatch_config``) picks for the problem with
    this shared-memory budget; None when its tuned stage count does not fit the budget."""
    try:
        return ModelConfig.of(ab.dispatch_config(key, smem_per_sm))
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------
# The work: what is left, and its split over workers
# ----------------------------------------------------------------------------------------------
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
    """Wall time of one row under ``gbs.lab.timing.time_launches``' budget rule: a first call, one
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


__all__ = [
    "FULL_FORMATS", "GRIDS", "Grid", "SHAPE_NAMES", "SHAPE_TITLES", "STAGE_PRIORITY", "Spec", "SweepEstimate",
    "WorkItem", "build_grid", "dispatch_pick", "estimate_sweep", "grid_configs", "grid_problems", "grid_specs",
    "h200_kernel_stage_limit", "parse_formats", "parse_shapes", "pending_work", "row_seconds_estimate",
    "shard_work", "stage_counts", "work_cost",
]
