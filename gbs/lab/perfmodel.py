"""Analytic performance model of one kernel config on one grouped block-scaled matmul problem.

The model walks the same tiles as the kernels (``gbs.schedule``) but only counts them: it works
from a problem *shape* (``ProblemShape``: format, N, K, tokens per group slot, expert ids) and
never builds tensors, so a DeepSeek-size sweep of every legal config costs seconds on a CPU.

One config = ``ModelConfig(ab_swapped, mma_bn, cta_group, stages)`` (or a dispatch
``KernelConfig``). One machine = ``HardwareParams`` (``H200``: figures measured on the project's
H200 where we have them; ``B200``: datasheet figures, the rest labelled assumed). The time of a
launch (seconds inside, microseconds in ``ModelEstimate``)::

    time = launch + prologue + max(t_dram, t_l2, critical_path)
    prologue      = memory_latency + stages * stage_setup_cycles / clock
    t_dram        = dram_bytes / (hbm_sustained * bandwidth_fraction)
    t_l2          = l2_bytes / l2_bandwidth
    critical_path = sum over the busiest CTA pair's tiles of tile_time (+ the last epilogue
                    when epilogues overlap the next mainloop)
    tile_time     = combine(mainloop, epilogue) + tile_overhead_cycles / clock
    mainloop      = max(k_iters * max((memory_latency + slice_compute) / stages,
                                      stage_bytes / sm_load_bw),
                        t_mma + t_dequant)      (slice_compute = (t_mma + t_dequant) / k_iters)
    t_mma         = k_iters * 2 * 128 * mma_bn * k_tile_elements / (mma_rate / num_sms)
    t_dequant     = k_iters * (weight rows + staged tokens) * k_tile_elements
                    * dequant_cycles_per_element / clock          (software block scales only)
    combine       = max(...) when the accumulator is double-buffered (TMEM, mma_bn <= 128),
                    else the sum (the epilogue stalls the next tile)

Assumptions, stated once: every re-read of a weight tile hits L2 (the walk is M-major, so the
tiles in flight at one time share weight blocks); token re-reads (one per weight-row block) hit
L2 while a slot's tokens fit in half the L2, else they come from DRAM again; a tile's TMA box
always loads the tile's whole token extent (rows past a group's end are the next group's) but
no weight rows past N (TMA zero-fills out-of-bounds boxes without reading memory). All tiles of
a launch run the same per-tile cost model; the MMA rate is the dense rate whatever mma_bn is.

``calibrate`` fits a few named ``HardwareParams`` fields (the free parameters) to measured times
by least squares on log time (Levenberg-Marquardt in log-parameter space, numpy only) and
reports the error before and after: Spearman rank correlation per (N, K, regime) group and the
median relative error per regime. ``explain_difference`` says in words why the model prefers
one config over another (used by ``gbs.lab.ablation_data.compare_tables``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from gbs.lab.cases import useful_bytes, useful_flops
from gbs.lab.timing import H200_L2_BYTES
from gbs.dispatch import (
    B200_SMEM_PER_SM,
    H200_SMEM_PER_SM,
    MMA_KIND_F8F6F4,
    OUTPUT_BYTES,
    SUPPORTED_FORMAT_PAIRS,
    k_tile_elements_for_kind,
    sf_k_tiles_per_stage,
    require_int,
    auto_pipeline_stages,
    classify_regime,
    num_accum_pipeline_stages,
)
from gbs.problem import PROBLEM_FORMATS, Routing, resolve_formats
from gbs.schedule import MMA_M_ROWS, TileConfig, ceil_div

SCALE_BYTES_PER_BLOCK = 1       # UE8M0 / UE4M3: one byte per scale block
L2_TOKEN_SHARE = 0.5            # a slot's tokens are re-read from L2 while they fit in half of it
BYTES_PER_TB = 1e12
US = 1e-6
NS = 1e-9

# Formats the model covers: the pairs the SM100 dispatch routes (it needs the MMA kind).
MODEL_FORMATS = tuple(name for name, pair in PROBLEM_FORMATS.items() if pair in SUPPORTED_FORMAT_PAIRS)


# ----------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareParams:
    """One GPU as the model sees it. Every field of ``H200`` / ``B200`` says where it comes from.

    The fields in ``CALIBRATABLE_PARAMETERS`` are the model's free parameters: ``calibrate``
    returns a copy with fitted values.
    """

    key: str                        # short id of the GPU in ablation rows ("h200", "b200")
    name: str                       # what the rows' gpu_name says for modelled rows
    num_sms: int                    # persistent grid: one CTA per SM
    clock_ghz: float                # SM clock: converts the cycle counts below to time
    hbm_peak_tbs: float             # datasheet HBM bandwidth (for reference only)
    hbm_sustained_tbs: float        # streaming-read ceiling: what t_dram divides by
    bandwidth_fraction: float       # fraction of the sustained ceiling the grouped kernel reaches
    l2_bytes: int                   # L2 capacity: decides whether token re-reads hit L2
    l2_bandwidth_tbs: float         # L2 -> SM bandwidth of the whole chip (t_l2)
    sm_load_bytes_per_cycle: float  # one SM's load (and store) port from L2
    smem_per_sm: int                # shared-memory budget of the stages=auto formula
    bf16_tflops: float              # dense MMA rates of the whole chip per operand type
    fp8_tflops: float | None
    fp4_tflops: float | None
    block_scaled_mma: bool          # True: the MMA applies block scales (no software dequant)
    accumulator_double_buffer: bool  # two accumulators (TMEM) let the epilogue overlap the mainloop
    memory_latency_ns: float        # load-to-use latency of a pipeline stage from DRAM
    stage_setup_cycles: float       # prologue cost per pipeline stage (barrier init, first issues)
    tile_overhead_cycles: float     # fixed cost per tile (scheduler, barriers, accumulator hand-off)
    epilogue_cycles: float          # fixed cost of one tile's epilogue besides its output bytes
    dequant_cycles_per_element: float  # software dequant: SM cycles per operand element
    launch_overhead_us: float       # one launch queued behind others (CUDA-event timing)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("key", "name"):
                if not isinstance(value, str) or not value:
                    raise ValueError(f"HardwareParams.{f.name} must be a non-empty string, got {value!r}")
            elif f.name in ("block_scaled_mma", "accumulator_double_buffer"):
                if not isinstance(value, bool):
                    raise TypeError(f"HardwareParams.{f.name} must be a bool, got {value!r}")
            elif value is None:
                if f.name not in ("fp8_tflops", "fp4_tflops"):
                    raise ValueError(f"HardwareParams.{f.name} must be set")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"HardwareParams.{f.name} must be a finite number, got {value!r}")
            elif value < 0 or (value == 0 and f.name not in _MAY_BE_ZERO):
                raise ValueError(f"HardwareParams.{f.name} must be {'>= 0' if f.name in _MAY_BE_ZERO else '> 0'}, "
                                 f"got {value}")

    @property
    def clock_hz(self) -> float:
        return self.clock_ghz * 1e9

    @property
    def sm_load_bandwidth(self) -> float:
        """Bytes per second one SM can pull from L2."""
        return self.sm_load_bytes_per_cycle * self.clock_hz

    def mma_operand(self, fmt: str) -> str:
        """Operand type the tensor cores multiply for problem format ``fmt``: "fp4" / "fp8" with
        block-scaled MMA (kind::mxf4nvf4 and mxf4 are FP4, kind::mxf8f6f4 runs at the FP8 rate),
        "bf16" after software dequantization otherwise."""
        if not self.block_scaled_mma:
            return "bf16"
        return "fp8" if _mma_kind(fmt) == MMA_KIND_F8F6F4 else "fp4"

    def mma_tflops(self, fmt: str) -> float:
        """Dense MMA rate of the whole chip for format ``fmt`` (TFLOP/s)."""
        operand = self.mma_operand(fmt)
        rate = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "fp4": self.fp4_tflops}[operand]
        if rate is None:
            raise ValueError(f"{self.name} has no {operand} MMA rate for format {fmt}")
        return rate

    def max_stages(self, fmt: str, config) -> int:
        """The deepest pipeline of ``config``'s knobs that fits this GPU's shared memory."""
        return _max_stages(fmt, TileConfig.of(config), self.smem_per_sm)


@functools.lru_cache(maxsize=1024)
def _max_stages(fmt: str, tile: TileConfig, smem_per_sm: int) -> int:
    return auto_pipeline_stages(mma_bn=tile.mma_bn, cta_group=tile.cta_group, ab_swapped=tile.ab_swapped,
                                num_sf_k_tiles=sf_k_tiles_per_stage(*resolve_names(fmt)), smem_per_sm=smem_per_sm)


_MAY_BE_ZERO = {"stage_setup_cycles", "tile_overhead_cycles", "epilogue_cycles", "dequant_cycles_per_element",
                "launch_overhead_us"}

CALIBRATABLE_PARAMETERS = ("bandwidth_fraction", "memory_latency_ns", "stage_setup_cycles", "tile_overhead_cycles",
                           "epilogue_cycles", "dequant_cycles_per_element", "launch_overhead_us")
DEFAULT_FREE_PARAMETERS = ("bandwidth_fraction", "memory_latency_ns", "stage_setup_cycles", "tile_overhead_cycles",
                           "dequant_cycles_per_element")

H200_MEASURED_READ_TBS = 4.30   # kernels.md: inline-PTX streaming read on the project's H200
H200_DATASHEET_HBM_TBS = 4.8

H200 = HardwareParams(
    key="h200",
    name="NVIDIA H200 (model)",
    num_sms=132,                            # measured here (device attribute, kernels.md)
    clock_ghz=1.98,                         # datasheet: H100/H200 SXM boost clock
    hbm_peak_tbs=H200_DATASHEET_HBM_TBS,    # datasheet
    hbm_sustained_tbs=H200_MEASURED_READ_TBS,  # measured here: streaming-read ceiling
    bandwidth_fraction=1.0,                 # assumed (calibrated on the H200 rows)
    l2_bytes=H200_L2_BYTES,                 # measured here (device report, gbs.lab.timing)
    l2_bandwidth_tbs=10.0,                  # assumed: third-party H100 microbenchmarks, ~10 TB/s
    sm_load_bytes_per_cycle=64.0,           # assumed: 64 B/clk L2 -> SM per SM
    smem_per_sm=H200_SMEM_PER_SM,           # datasheet: 227 KiB opt-in per block (gbs.dispatch)
    bf16_tflops=766.0,                      # measured here: cuBLAS bf16 8192^3
    fp8_tflops=1340.0,                      # measured here: torch._scaled_mm fp8 8192^3
    fp4_tflops=None,                        # datasheet: Hopper has no FP4 MMA
    block_scaled_mma=False,                 # datasheet: no block-scale hardware; the port dequantizes to bf16
    accumulator_double_buffer=False,        # assumed: register accumulators, epilogue stalls the next tile
    memory_latency_ns=600.0,                # assumed: HBM load-to-use under load (calibrated)
    stage_setup_cycles=100.0,               # assumed (calibrated)
    tile_overhead_cycles=500.0,             # assumed (calibrated)
    epilogue_cycles=300.0,                  # assumed
    dequant_cycles_per_element=1 / 32,      # assumed: ~4 SIMT ops per element over 128 lanes (calibrated)
    launch_overhead_us=2.0,                 # assumed: back-to-back launches timed by CUDA events
)

B200 = HardwareParams(
    key="b200",
    name="NVIDIA B200 (datasheet model)",
    num_sms=148,                            # datasheet
    clock_ghz=1.86,                         # assumed: third-party spec tables list a ~1.86 GHz tensor clock
    hbm_peak_tbs=8.0,                       # datasheet: HBM3e
    hbm_sustained_tbs=8.0 * H200_MEASURED_READ_TBS / H200_DATASHEET_HBM_TBS,  # assumed: H200's measured/datasheet ratio
    bandwidth_fraction=1.0,                 # assumed
    l2_bytes=126 * 10 ** 6,                 # assumed: third-party measurement (two dies)
    l2_bandwidth_tbs=10.0 * 8.0 / H200_DATASHEET_HBM_TBS,  # assumed: the H200 figure scaled by the HBM ratio
    sm_load_bytes_per_cycle=128.0,          # assumed: twice Hopper's port (tcgen05 needs ~100 B/clk at FP4 peak)
    smem_per_sm=B200_SMEM_PER_SM,           # datasheet: 228 KiB per SM (gbs.dispatch)
    bf16_tflops=2250.0,                     # datasheet: dense
    fp8_tflops=4500.0,                      # datasheet: dense
    fp4_tflops=9000.0,                      # datasheet: DGX/HGX B200 dense FP4 (GB200's B200 is listed at 10 PFLOP/s)
    block_scaled_mma=True,                  # datasheet: tcgen05 block-scaled MMA kinds
    accumulator_double_buffer=True,         # design (kernels.md): 2 TMEM accumulator stages when mma_bn <= 128
    memory_latency_ns=700.0,                # assumed: a little above the H200 (two dies)
    stage_setup_cycles=100.0,               # assumed (same as the H200's start value)
    tile_overhead_cycles=300.0,             # assumed: hardware tile scheduler, one elected MMA thread
    epilogue_cycles=300.0,                  # assumed
    dequant_cycles_per_element=0.0,         # datasheet: scales applied inside the MMA
    launch_overhead_us=2.0,                 # assumed
)

HARDWARE = {hw.key: hw for hw in (H200, B200)}


# ----------------------------------------------------------------------------------------------
# Problem shapes and configs
# ----------------------------------------------------------------------------------------------
def resolve_names(fmt: str) -> tuple[str, str]:
    """(A format name, B format name) of a problem format the model covers."""
    if fmt not in MODEL_FORMATS:
        raise ValueError(f"format must be one of {MODEL_FORMATS} (formats with an SM100 MMA kind), got {fmt!r}")
    return PROBLEM_FORMATS[fmt]


def _mma_kind(fmt: str) -> str:
    return SUPPORTED_FORMAT_PAIRS[resolve_names(fmt)][0]


@dataclass(frozen=True)
class ProblemShape:
    """What the model needs of a grouped problem: format, N, K, tokens and expert id per slot.

    Has the attributes ``gbs.lab.cases.useful_bytes`` / ``useful_flops`` read (``a_format``,
    ``b_format``, ``group_sizes``, ``expert_ids``, ``active_slots()``), so those define the
    useful bytes and FLOPs here too.
    """

    format: str
    n: int
    k: int
    group_sizes: tuple[int, ...]
    expert_ids: tuple[int, ...]

    def __post_init__(self):
        resolve_names(self.format)
        object.__setattr__(self, "n", require_int("n", self.n, 1))
        object.__setattr__(self, "k", require_int("k", self.k, 1))
        sizes = tuple(require_int("group_sizes[i]", s, 0) for s in self.group_sizes)
        ids = tuple(require_int("expert_ids[i]", e, -1) for e in self.expert_ids)
        if not sizes or len(sizes) != len(ids):
            raise ValueError(f"need one expert id per group slot and at least one slot, got {len(sizes)} sizes "
                             f"and {len(ids)} ids")
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "expert_ids", ids)
        for fmt in (self.a_format, self.b_format):
            if self.k % fmt.block_size:
                raise ValueError(f"K = {self.k} is not a multiple of the {fmt.name} block size {fmt.block_size}")

    @classmethod
    def uniform(cls, fmt: str, *, n: int, k: int, num_active_experts: int, tokens_per_expert: int) -> "ProblemShape":
        """``num_active_experts`` slots (experts 0, 1, ...) with the same token count each."""
        slots = require_int("num_active_experts", num_active_experts, 1)
        return cls(fmt, n, k, (tokens_per_expert,) * slots, tuple(range(slots)))

    @classmethod
    def from_routing(cls, fmt: str, *, n: int, k: int, routing: Routing) -> "ProblemShape":
        return cls(fmt, n, k, tuple(int(s) for s in routing.group_sizes), tuple(int(e) for e in routing.expert_ids))

    @classmethod
    def from_problem(cls, problem) -> "ProblemShape":
        """The shape of a ``gbs.problem.GroupedProblem``."""
        return cls(problem.format_name, problem.n, problem.k, tuple(int(s) for s in problem.group_sizes),
                   tuple(int(e) for e in problem.expert_ids))

    @property
    def a_format(self):
        return resolve_formats(self.format)[0]

    @property
    def b_format(self):
        return resolve_formats(self.format)[1]

    @property
    def num_active_experts(self) -> int:
        """Group slots, including empty and ``-1`` ones (the dispatch's count)."""
        return len(self.group_sizes)

    @property
    def estimated_total_m(self) -> int:
        """All rows of A (what a caller passes the dispatch)."""
        return sum(self.group_sizes)

    @property
    def avg_m(self) -> float:
        return self.estimated_total_m / self.num_active_experts

    @property
    def regime(self) -> str:
        return classify_regime(self.estimated_total_m, self.num_active_experts)

    def active_slots(self) -> list[int]:
        """Slots that produce output: expert id >= 0 and at least one token."""
        return [g for g, (size, expert) in enumerate(zip(self.group_sizes, self.expert_ids)) if expert >= 0 and size]

    @property
    def live_tokens(self) -> int:
        return sum(self.group_sizes[g] for g in self.active_slots())


@dataclass(frozen=True)
class ModelConfig:
    """The four knobs of one kernel config; validated like the dispatch's override."""

    ab_swapped: bool
    mma_bn: int
    cta_group: int
    stages: int

    def __post_init__(self):
        tile = TileConfig(self.ab_swapped, self.mma_bn, self.cta_group)
        object.__setattr__(self, "ab_swapped", tile.ab_swapped)
        object.__setattr__(self, "mma_bn", tile.mma_bn)
        object.__setattr__(self, "cta_group", tile.cta_group)
        object.__setattr__(self, "stages", require_int("stages", self.stages, 1))

    @classmethod
    def of(cls, config) -> "ModelConfig":
        """A ``ModelConfig`` from itself or a dispatch ``KernelConfig`` (its resolved stages)."""
        if isinstance(config, cls):
            return config
        if not hasattr(config, "num_pipeline_stages"):
            raise TypeError(f"config must be a ModelConfig or a dispatch KernelConfig, got {type(config).__name__}")
        tile = TileConfig.of(config)
        return cls(tile.ab_swapped, tile.mma_bn, tile.cta_group, config.num_pipeline_stages)

    @classmethod
    def from_tile(cls, tile: TileConfig, stages: int) -> "ModelConfig":
        return cls(tile.ab_swapped, tile.mma_bn, tile.cta_group, stages)

    @property
    def tile_config(self) -> TileConfig:
        return TileConfig(self.ab_swapped, self.mma_bn, self.cta_group)

    def label(self) -> str:
        """Compact form for tables: ``bn8/cg1/sw x6`` (sw = AB swapped, ns = not swapped)."""
        return f"{tile_label(self.tile_config)} x{self.stages}"


def tile_label(tile: TileConfig) -> str:
    """``bn8/cg1/sw``: mma_bn, cta_group, AB swapped (sw) or not (ns)."""
    return f"bn{tile.mma_bn}/cg{tile.cta_group}/{'sw' if tile.ab_swapped else 'ns'}"


def check_stages(fmt: str, config: ModelConfig, hw: HardwareParams) -> None:
    """ValueError when ``config.stages`` does not fit ``hw``'s shared memory for this format."""
    max_stages = hw.max_stages(fmt, config.tile_config)
    if config.stages > max_stages:
        raise ValueError(f"{config.stages} stages do not fit {hw.name}'s {hw.smem_per_sm} B of shared memory for "
                         f"{fmt} with {tile_label(config.tile_config)}: at most {max_stages}")


def auto_config(fmt: str, tile: TileConfig, hw: HardwareParams) -> ModelConfig:
    """``tile``'s knobs with stages = auto (the deepest pipeline that fits ``hw``)."""
    return ModelConfig.from_tile(tile, hw.max_stages(fmt, tile))


# ----------------------------------------------------------------------------------------------
# The tile walk, counted
# ----------------------------------------------------------------------------------------------
class WalkSummary(NamedTuple):
    """Counts of one tile walk over a persistent grid (from ``gbs.schedule``'s walk rules).

    Tiles are "full" or "partial" (the last weight-row block when N is not a multiple of the
    tile's rows); ``pair_classes`` holds the distinct (full, partial) tile counts of the CTA
    pairs, so the busiest pair is found whatever the per-tile costs are.
    """

    num_tiles: int
    partial_tiles: int
    partial_tile_rows: int          # weight rows of a partial tile (whole tile, both CTAs)
    pair_classes: tuple[tuple[int, int], ...]
    max_tiles_per_pair: int
    busy_pairs: int


@functools.lru_cache(maxsize=4096)
def walk_summary(group_sizes: tuple[int, ...], expert_ids: tuple[int, ...], n: int, tile: TileConfig,
                 num_pairs: int) -> WalkSummary:
    """Count the walk: slots in order (``-1`` and empty slots have no tiles), M-major inside a slot
    (local tile j is weight-row block ``j // mb``), pair p takes tiles p, p + num_pairs, ..."""
    shape = tile.tile_shape
    sizes = np.asarray(group_sizes, np.int64)
    token_blocks = np.where(np.asarray(expert_ids) >= 0, ceil_div(sizes, shape.tokens), 0)
    row_blocks = ceil_div(n, shape.weight_rows)
    last_rows = n - (row_blocks - 1) * shape.weight_rows
    slot_tiles = token_blocks * row_blocks
    num_tiles = int(slot_tiles.sum())
    if num_tiles == 0:
        return WalkSummary(0, 0, last_rows, (), 0, 0)
    pair = np.arange(num_tiles) % num_pairs
    tiles_per_pair = np.bincount(pair, minlength=num_pairs)
    if last_rows < shape.weight_rows:
        slot_start = np.repeat(np.cumsum(slot_tiles) - slot_tiles, slot_tiles)
        local = np.arange(num_tiles) - slot_start
        partial = local >= np.repeat(token_blocks * (row_blocks - 1), slot_tiles)
        partial_per_pair = np.bincount(pair[partial], minlength=num_pairs)
    else:
        partial_per_pair = np.zeros(num_pairs, np.int64)
    classes = np.unique(np.stack([tiles_per_pair - partial_per_pair, partial_per_pair], axis=1), axis=0)
    return WalkSummary(num_tiles, int(partial_per_pair.sum()), int(last_rows),
                       tuple((int(f), int(p)) for f, p in classes if f + p),
                       int(tiles_per_pair.max()), int(min(num_tiles, num_pairs)))


# ----------------------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelEstimate:
    """The model's time for one (problem, config, GPU) and every term behind it.

    Times are microseconds; bytes are bytes; "tile_*" terms are one full tile of one CTA;
    "critical_*" terms are sums over the busiest CTA pair's tiles.
    """

    time_us: float                  # launch + prologue + max(dram, l2, critical path)
    launch_us: float                # launch overhead
    prologue_us: float              # first-stage latency + stages x per-stage setup
    dram_time_us: float             # DRAM bytes / (sustained bandwidth x bandwidth_fraction)
    l2_time_us: float               # bytes all CTAs load / L2 bandwidth
    critical_path_us: float         # busiest pair: sum of its tile times
    critical_stream_us: float       # ... of which streaming its stages (latency- or port-bound)
    critical_mma_us: float          # ... of which MMA issue at the dense rate
    critical_dequant_us: float      # ... of which software dequantization
    critical_epilogue_us: float     # ... of which epilogues (overlapped or not, as combined)
    critical_overhead_us: float     # ... of which fixed per-tile overhead
    tile_stream_us: float           # one tile's K slices as fast as the stages (or the SM port) allow
    tile_mma_us: float              # one tile's MMAs (padded tokens and K included)
    tile_dequant_us: float          # one tile's software dequant (0 with block-scaled MMA)
    tile_epilogue_us: float         # one tile's epilogue (fixed + output bytes over the SM port)
    tile_overhead_us: float         # one tile's fixed overhead
    stream_limit: str               # "latency" (too few stages in flight) or "sm_load" (the SM's port)
    stage_bytes: int                # bytes one CTA loads per K slice (weights + tokens + scales)
    bytes_in_flight: int            # stages x stage_bytes: what one SM keeps requested
    latency_bandwidth_bytes: float  # latency x (DRAM share of one SM): in flight needed to stream at full rate
    k_iters: int                    # K slices per tile
    num_tiles: int
    max_tiles_per_pair: int         # tiles of the busiest pair
    busy_ctas: int                  # CTAs with at least one tile
    grid_occupancy: float           # busy CTAs / SMs
    wave_quantisation: float        # max tiles per pair x pairs / tiles (1.0 = perfectly balanced)
    padding_waste: float            # 1 - useful FLOPs / MMA FLOPs (padded tokens, K, rows)
    useful_flops: int
    mma_flops: int
    dram_bytes: int                 # unique bytes (+ token re-reads that miss L2)
    l2_bytes: int                   # bytes all CTAs load from L2, with the 2-CTA token sharing, + output
    bytes_without_sharing: int      # l2_bytes if each CTA of a pair loaded the whole token tile
    weight_bytes_loaded: int        # weights + their scales over all tiles
    token_bytes_loaded: int         # tokens + their scales over all tiles (with sharing)
    token_bytes_per_weight_row: float  # token bytes loaded per weight row loaded, per K slice
    bound: str                      # "dram", "l2", or the critical path's main term
    stages: int

    @property
    def memory_time_us(self) -> float:
        return max(self.dram_time_us, self.l2_time_us)

    @property
    def tflops(self) -> float:
        return self.useful_flops / (self.time_us * US) / 1e12

    @property
    def gbps(self) -> float:
        return self.dram_bytes / (self.time_us * US) / 1e9

    def explain(self) -> str:
        """Every term in words, one line each."""
        kib = 1024
        return "\n".join((
            f"time {self.time_us:.2f} us = launch {self.launch_us:.2f} + prologue {self.prologue_us:.2f} + "
            f"max(DRAM {self.dram_time_us:.2f}, L2 {self.l2_time_us:.2f}, critical path {self.critical_path_us:.2f}); "
            f"bound: {self.bound}",
            f"tiles {self.num_tiles}, busiest pair {self.max_tiles_per_pair}, busy CTAs {self.busy_ctas} "
            f"({100 * self.grid_occupancy:.0f} % of the SMs), wave quantisation x{self.wave_quantisation:.2f}",
            f"per tile: stream {self.tile_stream_us:.3f} us ({self.stream_limit}-bound), MMA {self.tile_mma_us:.3f}, "
            f"dequant {self.tile_dequant_us:.3f}, epilogue {self.tile_epilogue_us:.3f}, overhead "
            f"{self.tile_overhead_us:.3f}",
            f"pipeline: {self.stages} stages x {self.stage_bytes / kib:.1f} KiB = {self.bytes_in_flight / kib:.1f} KiB "
            f"in flight per SM vs latency x bandwidth share {self.latency_bandwidth_bytes / kib:.1f} KiB",
            f"bytes: DRAM {self.dram_bytes / 1e6:.2f} MB, L2->SM {self.l2_bytes / 1e6:.2f} MB "
            f"(without 2-CTA token sharing {self.bytes_without_sharing / 1e6:.2f} MB), token bytes per weight row "
            f"{self.token_bytes_per_weight_row:.2f} per K slice",
            f"MMA work {self.mma_flops / 1e9:.2f} GFLOP for {self.useful_flops / 1e9:.2f} useful "
            f"(padding waste {100 * self.padding_waste:.1f} %)",
        ))


class _ShapeTotals(NamedTuple):
    useful_bytes: int
    useful_flops: int
    live_tokens: int
    live_sizes: tuple[int, ...]     # token count of every live slot


@functools.lru_cache(maxsize=4096)
def _shape_totals(shape: "ProblemShape") -> _ShapeTotals:
    live = shape.active_slots()
    return _ShapeTotals(useful_bytes(shape), useful_flops(shape), shape.live_tokens,
                        tuple(shape.group_sizes[g] for g in live))


class _FormatBytes(NamedTuple):
    k_tile_elements: int
    k_iters: int
    weight_row_slice: int     # bytes of one weight row's K slice, scales included
    token_row_slice: int      # bytes of one token row's K slice, scales included


@functools.lru_cache(maxsize=256)
def _format_bytes(fmt: str, k: int) -> _FormatBytes:
    a_format, b_format = resolve_formats(fmt)
    k_tile = k_tile_elements_for_kind(_mma_kind(fmt))

    def row_slice(f):
        return k_tile * f.element_bits // 8 + k_tile // f.block_size * SCALE_BYTES_PER_BLOCK

    return _FormatBytes(k_tile, ceil_div(k, k_tile), row_slice(b_format), row_slice(a_format))


def _stage_cycle(latency: float, slice_compute: float, stages: int) -> float:
    """Time per K slice that ``stages`` buffers allow: a buffer is busy for one memory latency
    (its load) plus one slice's compute (its consumer) before it can be refilled."""
    return (latency + slice_compute) / stages


def model_config(shape: ProblemShape, config, hw: HardwareParams) -> ModelEstimate:
    """Estimate one launch of ``config`` (``ModelConfig`` or dispatch ``KernelConfig``) on ``shape``."""
    if not isinstance(shape, ProblemShape):
        raise TypeError(f"shape must be a ProblemShape, got {type(shape).__name__}")
    if not isinstance(hw, HardwareParams):
        raise TypeError(f"hw must be a HardwareParams, got {type(hw).__name__}")
    config = ModelConfig.of(config)
    check_stages(shape.format, config, hw)
    tile = config.tile_config
    cg = config.cta_group
    num_pairs = hw.num_sms // cg
    walk = walk_summary(shape.group_sizes, shape.expert_ids, shape.n, tile, num_pairs)
    tshape = tile.tile_shape
    fb = _format_bytes(shape.format, shape.k)
    clock = hw.clock_hz
    latency = hw.memory_latency_ns * NS
    sm_port = hw.sm_load_bandwidth
    mma_rate_sm = hw.mma_tflops(shape.format) * 1e12 / hw.num_sms
    dram_rate = hw.hbm_sustained_tbs * BYTES_PER_TB * hw.bandwidth_fraction

    def tile_terms(cta_rows: int):
        """(stream, mma, dequant, epilogue) seconds of one CTA's tile with ``cta_rows`` weight rows."""
        stage = cta_rows * fb.weight_row_slice + tshape.cta_tokens * fb.token_row_slice
        mma = fb.k_iters * 2 * MMA_M_ROWS * config.mma_bn * fb.k_tile_elements / mma_rate_sm
        dequant = 0.0 if hw.block_scaled_mma else (
            fb.k_iters * (cta_rows + tshape.cta_tokens) * fb.k_tile_elements * hw.dequant_cycles_per_element / clock)
        stream = fb.k_iters * max(_stage_cycle(latency, (mma + dequant) / fb.k_iters, config.stages),
                                  stage / sm_port)
        epilogue = hw.epilogue_cycles / clock + cta_rows * tshape.tokens * OUTPUT_BYTES / sm_port
        return stage, stream, mma, dequant, epilogue

    overlap = hw.accumulator_double_buffer and num_accum_pipeline_stages(config.mma_bn) == 2
    overhead = hw.tile_overhead_cycles / clock

    def tile_time(terms):
        _, stream, mma, dequant, epilogue = terms
        mainloop = max(stream, mma + dequant)
        return (max(mainloop, epilogue) if overlap else mainloop + epilogue) + overhead

    full = tile_terms(tshape.cta_weight_rows)
    partial = tile_terms(min(tshape.cta_weight_rows, walk.partial_tile_rows))
    full_time, partial_time = tile_time(full), tile_time(partial)
    busiest = max(walk.pair_classes, key=lambda c: c[0] * full_time + c[1] * partial_time, default=(0, 0))
    tail = full[4] if overlap and walk.num_tiles else 0.0
    critical = busiest[0] * full_time + busiest[1] * partial_time + tail

    def critical_sum(index):
        return busiest[0] * full[index] + busiest[1] * partial[index]

    # Bytes: every tile's loads go through L2; DRAM sees each byte once unless tokens spill L2.
    full_tiles = walk.num_tiles - walk.partial_tiles
    weight_loaded = fb.k_iters * fb.weight_row_slice * (
        full_tiles * tshape.weight_rows + walk.partial_tiles * walk.partial_tile_rows)
    token_loaded = fb.k_iters * fb.token_row_slice * walk.num_tiles * tshape.tokens
    totals = _shape_totals(shape)
    token_row_bytes = fb.k_iters * fb.token_row_slice
    row_blocks = ceil_div(shape.n, tshape.weight_rows)
    spilled = sum(size * token_row_bytes * (row_blocks - 1) for size in totals.live_sizes
                  if size * token_row_bytes > L2_TOKEN_SHARE * hw.l2_bytes)
    dram_bytes = totals.useful_bytes + spilled
    l2_bytes = (weight_loaded + token_loaded + totals.live_tokens * shape.n * OUTPUT_BYTES) if walk.num_tiles else 0
    t_dram = dram_bytes / dram_rate
    t_l2 = l2_bytes / (hw.l2_bandwidth_tbs * BYTES_PER_TB)
    prologue = (latency + config.stages * hw.stage_setup_cycles / clock) if walk.num_tiles else 0.0
    launch = hw.launch_overhead_us * US
    time = launch + prologue + max(t_dram, t_l2, critical)

    stage_bytes, stream, mma, dequant, epilogue = full
    latency_period = _stage_cycle(latency, (mma + dequant) / fb.k_iters, config.stages)
    stream_limit = "latency" if latency_period >= stage_bytes / sm_port else "sm_load"
    mma_flops = walk.num_tiles * cg * fb.k_iters * 2 * MMA_M_ROWS * config.mma_bn * fb.k_tile_elements
    flops = totals.useful_flops
    if max(t_dram, t_l2, critical) == 0:
        bound = "launch"
    elif t_dram >= max(t_l2, critical):
        bound = "dram"
    elif t_l2 >= critical:
        bound = "l2"
    else:
        parts = {"stream": critical_sum(1), "mma": critical_sum(2), "dequant": critical_sum(3),
                 "epilogue": critical_sum(4), "overhead": (busiest[0] + busiest[1]) * overhead}
        bound = max(parts, key=parts.get)
        if bound == "stream":
            bound = stream_limit
    return ModelEstimate(
        time_us=time / US, launch_us=launch / US, prologue_us=prologue / US,
        dram_time_us=t_dram / US, l2_time_us=t_l2 / US, critical_path_us=critical / US,
        critical_stream_us=critical_sum(1) / US, critical_mma_us=critical_sum(2) / US,
        critical_dequant_us=critical_sum(3) / US,
        critical_epilogue_us=(critical_sum(4) + tail) / US,
        critical_overhead_us=(busiest[0] + busiest[1]) * overhead / US,
        tile_stream_us=stream / US, tile_mma_us=mma / US, tile_dequant_us=dequant / US,
        tile_epilogue_us=epilogue / US, tile_overhead_us=overhead / US,
        stream_limit=stream_limit,
        stage_bytes=int(stage_bytes), bytes_in_flight=int(config.stages * stage_bytes),
        latency_bandwidth_bytes=latency * dram_rate / hw.num_sms,
        k_iters=fb.k_iters, num_tiles=walk.num_tiles, max_tiles_per_pair=walk.max_tiles_per_pair,
        busy_ctas=walk.busy_pairs * cg, grid_occupancy=walk.busy_pairs * cg / hw.num_sms,
        wave_quantisation=(walk.max_tiles_per_pair * num_pairs / walk.num_tiles) if walk.num_tiles else 1.0,
        padding_waste=(1 - flops / mma_flops) if mma_flops else 0.0,
        useful_flops=int(flops), mma_flops=int(mma_flops), dram_bytes=int(dram_bytes), l2_bytes=int(l2_bytes),
        bytes_without_sharing=int(l2_bytes + token_loaded * (cg - 1)),
        weight_bytes_loaded=int(weight_loaded), token_bytes_loaded=int(token_loaded),
        token_bytes_per_weight_row=tshape.tokens * fb.token_row_slice / tshape.weight_rows,
        bound=bound, stages=config.stages)


# ----------------------------------------------------------------------------------------------
# Why one config beats another
# ----------------------------------------------------------------------------------------------
_DIFF_TERMS = (
    ("prologue", "prologue_us"),
    ("DRAM time", "dram_time_us"),
    ("L2 time", "l2_time_us"),
    ("critical path", "critical_path_us"),
    ("  of which streaming", "critical_stream_us"),
    ("  of which MMA", "critical_mma_us"),
    ("  of which dequant", "critical_dequant_us"),
    ("  of which epilogue", "critical_epilogue_us"),
    ("  of which tile overhead", "critical_overhead_us"),
)


def explain_difference(shape: ProblemShape, preferred, other, hw: HardwareParams) -> str:
    """Why the model finds ``preferred`` faster (or not) than ``other`` on ``shape``, in words:
    both times and bounds, then the terms that differ most, then the context that explains them
    (bytes in flight vs the latency-bandwidth product, waves, padding, token sharing)."""
    a_cfg, b_cfg = ModelConfig.of(preferred), ModelConfig.of(other)
    a, b = model_config(shape, a_cfg, hw), model_config(shape, b_cfg, hw)
    pct = 100 * (b.time_us / a.time_us - 1)
    head = (f"{hw.name}: {a_cfg.label()} {a.time_us:.2f} us ({a.bound}-bound) vs {b_cfg.label()} "
            f"{b.time_us:.2f} us ({b.bound}-bound), the latter {pct:+.1f} %")
    diffs = sorted(((label, getattr(a, attr), getattr(b, attr)) for label, attr in _DIFF_TERMS
                    if not label.startswith(" ")), key=lambda d: -abs(d[2] - d[1]))
    parts = [f"{label} {va:.2f} vs {vb:.2f} us" for label, va, vb in diffs[:2] if abs(vb - va) > 1e-3]
    context = []
    if a.stages != b.stages:
        context.append(f"in flight per SM {a.bytes_in_flight / 1024:.0f} vs {b.bytes_in_flight / 1024:.0f} KiB against "
                       f"a latency-bandwidth need of {a.latency_bandwidth_bytes / 1024:.0f} KiB (per-tile streaming "
                       f"{a.tile_stream_us:.2f} vs {b.tile_stream_us:.2f} us, {a.stream_limit}/{b.stream_limit}-bound); "
                       f"prologue {a.prologue_us:.2f} vs {b.prologue_us:.2f} us")
    if a_cfg.tile_config != b_cfg.tile_config:
        context.append(f"tiles {a.num_tiles} vs {b.num_tiles} (busy CTAs {a.busy_ctas} vs {b.busy_ctas}, wave "
                       f"quantisation x{a.wave_quantisation:.2f} vs x{b.wave_quantisation:.2f}), padding waste "
                       f"{100 * a.padding_waste:.0f} vs {100 * b.padding_waste:.0f} %, L2->SM bytes "
                       f"{a.l2_bytes / 1e6:.1f} vs {b.l2_bytes / 1e6:.1f} MB, token bytes per weight row "
                       f"{a.token_bytes_per_weight_row:.1f} vs {b.token_bytes_per_weight_row:.1f}")
    return "; ".join([head] + (["largest differences: " + ", ".join(parts)] if parts else []) + context)


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------
def spearman(x, y) -> float:
    """Spearman rank correlation (ties get their average rank); NaN with < 3 points or a constant."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size != y.size:
        raise ValueError(f"need equally long sequences, got {x.size} and {y.size}")
    if x.size < 3:
        return float("nan")
    rx, ry = _average_ranks(x), _average_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.size)
    sorted_values = values[order]
    start = 0
    for end in range(1, values.size + 1):
        if end == values.size or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2
            start = end
    return ranks


@dataclass(frozen=True)
class ErrorMetrics:
    """How well model times match measured ones."""

    spearman_by_group: dict           # (n, k, regime) -> rank correlation over that group's cases
    median_relative_error_by_regime: dict  # regime -> median |model / measured - 1|
    median_relative_error: float
    rms_log_error: float              # sqrt(mean(log(model / measured)^2)): what the fit minimises
    num_cases: int

    def to_markdown(self) -> str:
        lines = ["| group | Spearman |", "|---|---|"]
        lines += [f"| ({n}, {k}) {regime} | {rho:.3f} |" for (n, k, regime), rho in sorted(self.spearman_by_group.items())]
        lines += ["", "| regime | median relative error |", "|---|---|"]
        lines += [f"| {r} | {100 * e:.1f} % |" for r, e in sorted(self.median_relative_error_by_regime.items())]
        lines.append(f"\nall {self.num_cases} cases: median relative error {100 * self.median_relative_error:.1f} %, "
                     f"RMS log error {self.rms_log_error:.3f}")
        return "\n".join(lines)


def _checked_cases(cases, measured_us) -> tuple[list, np.ndarray]:
    cases = [(shape, ModelConfig.of(config)) for shape, config in cases]
    measured = np.asarray(measured_us, float)
    if measured.shape != (len(cases),):
        raise ValueError(f"need one measured time per case: {len(cases)} cases, {measured.shape} times")
    if not cases:
        raise ValueError("need at least one (shape, config) case")
    if not np.all(np.isfinite(measured) & (measured > 0)):
        raise ValueError("measured times must be finite and > 0 (microseconds)")
    return cases, measured


def model_error(cases: Sequence, measured_us, hw: HardwareParams) -> ErrorMetrics:
    """Error of ``hw``'s model against measured times; ``cases`` are (ProblemShape, config) pairs."""
    cases, measured = _checked_cases(cases, measured_us)
    model = np.array([model_config(shape, config, hw).time_us for shape, config in cases])
    return _metrics(cases, model, measured)


def _metrics(cases, model: np.ndarray, measured: np.ndarray) -> ErrorMetrics:
    groups: dict = {}
    regimes: dict = {}
    for i, (shape, _) in enumerate(cases):
        groups.setdefault((shape.n, shape.k, shape.regime), []).append(i)
        regimes.setdefault(shape.regime, []).append(i)
    rel = np.abs(model / measured - 1)
    return ErrorMetrics(
        spearman_by_group={g: spearman(model[idx], measured[idx]) for g, idx in groups.items()},
        median_relative_error_by_regime={r: float(np.median(rel[idx])) for r, idx in regimes.items()},
        median_relative_error=float(np.median(rel)),
        rms_log_error=float(np.sqrt(np.mean(np.log(model / measured) ** 2))),
        num_cases=len(cases))


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted hardware parameters and the model's error before and after the fit."""

    hardware: HardwareParams          # ``initial`` with the free parameters fitted
    initial: HardwareParams
    free: tuple[str, ...]
    unidentified: tuple[str, ...]     # free parameters the cases do not constrain (left at their start)
    before: ErrorMetrics
    after: ErrorMetrics
    iterations: int
    converged: bool

    @property
    def fitted(self) -> dict:
        return {name: getattr(self.hardware, name) for name in self.free}


LM_MAX_ITERATIONS = 100
LM_FD_STEP = 1e-4           # forward-difference step in log-parameter space
LM_TOLERANCE = 1e-10        # stop when the cost improves by less than this (relative)
LM_INITIAL_DAMPING = 1e-2
IDENTIFIABLE_GRADIENT = 1e-8  # a Jacobian column below this (log/log) leaves the parameter untouched
LM_MAX_FACTOR = 1e3         # a fitted parameter stays within this factor of its start: a weakly constrained
                            # one must not run to 0 or inf (HardwareParams rejects both)


def calibrate(cases: Sequence, measured_us, hw: HardwareParams, *,
              free: Sequence[str] = DEFAULT_FREE_PARAMETERS) -> CalibrationResult:
    """Fit the ``free`` fields of ``hw`` so that model times match ``measured_us`` (one per
    (ProblemShape, config) case) in the least-squares sense on log time.

    Levenberg-Marquardt on ``log(parameter)`` (parameters stay positive), forward-difference
    Jacobian, each parameter kept within ``LM_MAX_FACTOR`` of its start. Parameters that no case is
    sensitive to are reported in ``unidentified``.
    """
    cases, measured = _checked_cases(cases, measured_us)
    free = tuple(free)
    unknown = [name for name in free if name not in CALIBRATABLE_PARAMETERS]
    if unknown or not free or len(set(free)) != len(free):
        raise ValueError(f"free must be distinct names from {CALIBRATABLE_PARAMETERS}, got {list(free)}")
    starts = [getattr(hw, name) for name in free]
    if any(v <= 0 for v in starts):
        raise ValueError(f"free parameters must start > 0 (fitted in log space): "
                         f"{ {n: v for n, v in zip(free, starts) if v <= 0} }")
    log_measured = np.log(measured)

    def residuals(x):
        trial = dataclasses.replace(hw, **{name: float(np.exp(v)) for name, v in zip(free, x)})
        return np.log([model_config(shape, config, trial).time_us for shape, config in cases]) - log_measured

    x = np.log(starts)
    lower, upper = x - np.log(LM_MAX_FACTOR), x + np.log(LM_MAX_FACTOR)
    r = residuals(x)
    cost = float(r @ r)
    damping = LM_INITIAL_DAMPING
    converged = False
    iterations = 0
    active = np.ones(len(free), bool)
    for iterations in range(1, LM_MAX_ITERATIONS + 1):
        jac = np.empty((r.size, len(free)))
        for j in range(len(free)):
            step = np.zeros(len(free))
            step[j] = LM_FD_STEP
            jac[:, j] = (residuals(x + step) - r) / LM_FD_STEP
        active = np.abs(jac).max(axis=0) > IDENTIFIABLE_GRADIENT
        jac[:, ~active] = 0.0
        normal = jac.T @ jac
        gradient = jac.T @ r
        improved = False
        while damping < 1e12:
            system = normal + damping * np.diag(np.where(active, np.diag(normal), 1.0))
            delta = -np.linalg.solve(system, gradient)
            trial_x = np.clip(x + delta, lower, upper)
            trial_r = residuals(trial_x)
            trial_cost = float(trial_r @ trial_r)
            if trial_cost < cost:
                improved = True
                relative = (cost - trial_cost) / max(cost, 1e-300)
                x, r, cost = trial_x, trial_r, trial_cost
                damping = max(damping / 3, 1e-12)
                break
            damping *= 4
        if not improved or relative < LM_TOLERANCE:
            converged = True
            break
    fitted = dataclasses.replace(hw, **{name: float(np.exp(v)) for name, v in zip(free, x)})
    initial_model = np.array([model_config(s, c, hw).time_us for s, c in cases])
    fitted_model = np.exp(r + log_measured)
    return CalibrationResult(
        hardware=fitted, initial=hw, free=free,
        unidentified=tuple(name for name, a in zip(free, active) if not a),
        before=_metrics(cases, initial_model, measured), after=_metrics(cases, fitted_model, measured),
        iterations=iterations, converged=converged)


__all__ = [
    "B200", "CALIBRATABLE_PARAMETERS", "DEFAULT_FREE_PARAMETERS", "H200", "HARDWARE",
    "MODEL_FORMATS", "CalibrationResult", "ErrorMetrics", "HardwareParams", "ModelConfig", "ModelEstimate",
    "ProblemShape", "WalkSummary", "auto_config", "calibrate", "check_stages", "explain_difference",
    "model_config", "model_error", "spearman", "tile_label", "walk_summary",
]
