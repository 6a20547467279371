"""Ablation rows (``data/ablations.csv``) and the dispatch tables derived from them.

One ``AblationRow`` is one timed (or modelled) launch: GPU, format, N, K, routing, active experts,
total tokens, avg_m, regime, the four knobs (``ab_swapped``, ``mma_bn``, ``cta_group``, stages),
median / p10 / p90 time, TFLOP/s, GB/s, fractions of the ceilings, ``source`` (``measured`` or
``model``), GPU name, date, commit, and where the config and its stages came from
(``config_source``: ``dispatch`` when the knobs and stages are the dispatch's pick for that
problem, else ``sweep``; ``stages_source``: the dispatch's stage-source names). Only rows that
were timed on a GPU say ``measured``; those must carry the GPU's name and the commit.

Stage limits (``row_max_stages``). A row's ``stages`` must fit the shared memory of what produced
it. A measured H200 row was timed on the H200 kernel (``gbs.numba_kernels.h200_stream``), whose
real bytes per stage differ from SM100's, so its limit is that kernel's deepest ring
(``h200_launch.max_pipeline_stages``): deeper than the SM100 formula for most knob sets (W4A8
decode: 21 vs 12), shallower for a few (the NVFP4 large-prefill pair: 6 vs 7). Validation accepts a
measured H200 row within either limit: the kernel's layout, and so its deepest ring, moves between
commits, and the rows of earlier sweeps (capped by the formula) record what ran then. Modelled rows, and
rows of any other GPU, are bounded by the SM100 stage formula with that GPU's budget
(``HARDWARE[gpu].max_stages``): what the performance model and the dispatch assume. A derived
table calls a stage count ``auto`` when it is that limit.

Problems are named by ``ProblemKey`` (format, N, K, routing, slots, total tokens); the token
count of each slot comes from ``gbs.problem.make_routing`` with ``ABLATION_ROUTING_SEED``
(``routing_for``), so measured and modelled rows of one key describe the same problem. Top-k
routing is not an ablation routing: its slot count is an outcome of the draw, not an input.

``derive_dispatch_table(rows, rule, tolerance)`` turns the rows of one (GPU, format, source)
into a ``DispatchTable`` with a stated rule:

* per problem, a knob set's time is its best time over stages;
* regime config: the knob set with the smallest geometric-mean slowdown against each problem's
  fastest config over all problems of the regime (regimes by the dispatch's avg_m bounds);
  knob sets within ``tolerance`` of that are ties, broken toward the fewest tokens per tile
  (least padded MMA work), then the fewest token bytes per weight row (the 2-CTA pair);
* shape exception: a (N, K, regime) whose own best knob set beats the regime config by more
  than ``tolerance`` (geometric mean) keeps its own (as upstream's Kimi rule does);
* stages per (N, K, regime): per stage count the geometric-mean slowdown of the entry's knob
  set over the group's problems; ``rule="fastest"`` takes the smallest, ``rule="within"`` the
  fewest stages within ``tolerance`` of the smallest;
* boundaries: along each shape's swept avg_m grid, where the chosen knob set has to change:
  the incumbent stays while it is within ``tolerance`` of the best knob set there; a new one
  is the regime's config when that is within ``tolerance``, else the best (so DRAM-bound
  near-ties make no boundaries).

``upstream_table`` builds the same object from ``gbs.dispatch`` (the upstream decisions);
``compare_tables`` puts upstream, H200-measured and B200-model tables side by side as markdown
and lists every disagreement with upstream with its reason: the table's own evidence
(slowdowns) and the performance model's breakdown (``gbs.lab.perfmodel.explain_difference``).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from gbs.lab.cases import useful_bytes, useful_flops
from gbs.dispatch import (
    DECODE_AVG_M,
    LEGAL_MMA_BN,
    REGIME_DECODE,
    REGIME_LARGE_PREFILL,
    REGIME_SMALL_PREFILL,
    RULE_KIMI,
    SMALL_PREFILL_AVG_M,
    STAGES_AUTO,
    STAGES_SOURCES,
    require_int,
    classify_regime,
    grouped_matmul_block_scaled_sm100_dispatch,
    grouped_matmul_mxfp8_dispatch,
)
from gbs.lab.perfmodel import (
    HARDWARE,
    HardwareParams,
    ModelConfig,
    ProblemShape,
    auto_config,
    calibrate,
    explain_difference,
    model_config,
    resolve_names,
    tile_label,
)
from gbs.problem import Routing, make_routing
from gbs.schedule import TileConfig

ABLATION_COLUMNS = (
    "gpu", "format", "n", "k", "routing", "num_active_experts", "total_tokens", "avg_m", "regime",
    "ab_swapped", "mma_bn", "cta_group", "stages",
    "median_us", "p10_us", "p90_us", "tflops", "gbps", "mma_ceiling_fraction", "bandwidth_ceiling_fraction",
    "source", "gpu_name", "date", "commit", "config_source", "stages_source",
)
SOURCE_MEASURED = "measured"
SOURCE_MODEL = "model"
SOURCES = (SOURCE_MEASURED, SOURCE_MODEL)
CONFIG_SOURCE_DISPATCH = "dispatch"
CONFIG_SOURCE_SWEEP = "sweep"
CONFIG_SOURCES = (CONFIG_SOURCE_DISPATCH, CONFIG_SOURCE_SWEEP)
STAGES_OVERRIDE = "override"      # a sweep's explicit stage count (the dispatch's name for it)
ABLATION_ROUTINGS = ("uniform", "ragged")
ABLATION_ROUTING_SEED = 0
REGIMES = (REGIME_DECODE, REGIME_SMALL_PREFILL, REGIME_LARGE_PREFILL)
RULE_FASTEST = "fastest"
RULE_WITHIN = "within"
RULES = (RULE_FASTEST, RULE_WITHIN)
RULE_UPSTREAM = "upstream"        # the rule column of ``upstream_table``: decisions as tuned upstream
DEFAULT_TOLERANCE = 0.02
AVG_M_RELATIVE_TOLERANCE = 1e-9   # avg_m must equal total_tokens / num_active_experts
_GPU_KEY = re.compile(r"^[a-z0-9][a-z0-9_-]*$")

# Shapes the tuned dispatch was built on (workloads.md), per problem format.
FP4_SHAPES = ((4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (2048, 4096))
FP8_SHAPES = FP4_SHAPES + ((6144, 6144), (6144, 3072))
ABLATION_SHAPES = {"nvfp4": FP4_SHAPES, "mxfp4": FP4_SHAPES, "mxfp8": FP8_SHAPES, "w4a8": FP8_SHAPES}
# Token loads per regime (workloads.md): decode 1-8 per expert, small prefill 9-64, large 65-4096.
DEFAULT_TOKENS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_NUM_ACTIVE_EXPERTS = (8, 64)
MAX_SWEEP_TOTAL_TOKENS = 65536    # skip (slots x tokens) above this: 64 x 4096 says nothing 8 x 4096 does not
UPSTREAM_SLOTS = 8                # slot count at which upstream_table asks the dispatch
H200_KERNEL_GPU = "h200"          # measured rows of this GPU come from gbs.numba_kernels.h200_stream


# ----------------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------------
class ProblemKey(NamedTuple):
    """The problem of an ablation row (everything but the config and the GPU)."""

    format: str
    n: int
    k: int
    routing: str
    num_active_experts: int
    total_tokens: int

    @property
    def avg_m(self) -> float:
        return self.total_tokens / self.num_active_experts

    @property
    def regime(self) -> str:
        return classify_regime(self.total_tokens, self.num_active_experts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k


def routing_for(routing: str, num_active_experts: int, total_tokens: int) -> Routing:
    """Group sizes and expert ids of an ablation problem: ``make_routing`` over exactly
    ``num_active_experts`` experts with ``ABLATION_ROUTING_SEED`` (uniform: even counts; ragged:
    a Dirichlet draw, so some slots may be empty)."""
    if routing not in ABLATION_ROUTINGS:
        raise ValueError(f"routing must be one of {ABLATION_ROUTINGS} for ablations, got {routing!r} (top-k "
                         "routing decides the slot count itself, so a row could not name its problem)")
    return make_routing(num_experts=num_active_experts, total_tokens=total_tokens,
                        num_active_experts=num_active_experts, routing=routing, seed=ABLATION_ROUTING_SEED)


@functools.lru_cache(maxsize=4096)
def problem_shape(key: ProblemKey) -> ProblemShape:
    """The model's shape of an ablation problem."""
    return ProblemShape.from_routing(key.format, n=key.n, k=key.k,
                                     routing=routing_for(key.routing, key.num_active_experts, key.total_tokens))


def sweep_problems(fmt: str, *, shapes: Iterable[tuple[int, int]] | None = None,
                   tokens_per_expert: Iterable[int] = DEFAULT_TOKENS_PER_EXPERT,
                   num_active_experts: Iterable[int] = DEFAULT_NUM_ACTIVE_EXPERTS,
                   routings: Iterable[str] = ("uniform",),
                   max_total_tokens: int = MAX_SWEEP_TOTAL_TOKENS) -> list[ProblemKey]:
    """Every (shape, routing, slots, tokens per expert) of the grid, as ``ProblemKey``s."""
    resolve_names(fmt)
    shapes = tuple(shapes) if shapes is not None else ABLATION_SHAPES[fmt]
    keys = []
    for n, k in shapes:
        for routing in routings:
            routing_for(routing, 1, 1)    # reject unknown routings before the loops
            for slots in num_active_experts:
                for per_expert in tokens_per_expert:
                    if slots * per_expert <= max_total_tokens:
                        keys.append(ProblemKey(fmt, int(n), int(k), routing, int(slots), int(slots * per_expert)))
    return keys


def legal_configs(fmt: str, hw: HardwareParams) -> list[ModelConfig]:
    """Every legal (ab_swapped, mma_bn, cta_group) with every stage count from 1 to the deepest
    that fits ``hw``'s shared memory (``cta_group = 2`` needs ``ab_swapped``)."""
    configs = []
    for cta_group, mma_bns in LEGAL_MMA_BN.items():
        for mma_bn in mma_bns:
            for ab_swapped in ((True,) if cta_group == 2 else (True, False)):
                tile = TileConfig(ab_swapped, mma_bn, cta_group)
                configs += [ModelConfig.from_tile(tile, s) for s in range(1, hw.max_stages(fmt, tile) + 1)]
    return configs


def dispatch_config(key: ProblemKey, smem_per_sm: int):
    """The dtype routing's ``KernelConfig`` for the problem (what ``grouped_matmul_block_scaled_sm100_dispatch``
    picks with a ``smem_per_sm`` budget): MXFP8 x MXFP8 and MXFP4 x MXFP4 get the default config."""
    a_name, b_name = resolve_names(key.format)
    return grouped_matmul_block_scaled_sm100_dispatch(
        a_format=a_name, b_format=b_name, n=key.n, k=key.k, num_active_experts=key.num_active_experts,
        estimated_total_m=key.total_tokens, smem_per_sm=smem_per_sm)


def tuned_dispatch_config(key: ProblemKey, smem_per_sm: int):
    """The decision of the dispatch upstream tuned for the format: the MXFP8 regime dispatch
    (``grouped_matmul_mxfp8_dispatch``, with its tuned decode rows) for MXFP8 activations, whose
    MXFP8 x MXFP8 routing would otherwise give the untuned default config; ``dispatch_config``
    for the others."""
    a_name, b_name = resolve_names(key.format)
    if a_name != "mxfp8":
        return dispatch_config(key, smem_per_sm)
    return grouped_matmul_mxfp8_dispatch(n=key.n, k=key.k, num_active_experts=key.num_active_experts,
                                         estimated_total_m=key.total_tokens, smem_per_sm=smem_per_sm,
                                         b_format=b_name)


@functools.lru_cache(maxsize=256)
def _h200_kernel_max_stages(fmt: str, tile: TileConfig) -> int:
    # imported here: numba-cuda's import costs about a second and only measured H200 rows need it
    from gbs.numba_kernels import h200_launch, h200_ring

    one_stage = h200_ring.StreamSpec(*resolve_names(fmt), tile.ab_swapped, tile.mma_bn, tile.cta_group, 1)
    return h200_launch.max_pipeline_stages(one_stage)


def row_max_stages(gpu: str, source: str, fmt: str, config) -> int | None:
    """The deepest legal ring of a row of ``gpu`` and ``source`` with ``config``'s knobs, or None
    for a GPU without a model (nothing to check against).

    Measured H200 rows: the H200 kernel's own limit from its real shared-memory bytes
    (``h200_launch.max_pipeline_stages``), since that kernel timed them. Modelled rows and other
    GPUs: the SM100 stage formula with the GPU's budget (``HARDWARE[gpu].max_stages``)."""
    tile = TileConfig.of(config)
    if gpu == H200_KERNEL_GPU and source == SOURCE_MEASURED:
        return _h200_kernel_max_stages(fmt, tile)
    if gpu in HARDWARE:
        return HARDWARE[gpu].max_stages(fmt, tile)
    return None


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------
def _positive_finite(name: str, value, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


@dataclass(frozen=True)
class AblationRow:
    """One row of ``data/ablations.csv``; construction validates every field.

    ``stages`` is bounded by ``row_max_stages``: for a measured H200 row the H200 kernel's real
    deepest ring (it is what ran), for modelled rows and other GPUs the SM100 formula with the
    GPU's budget (what the model assumes)."""

    gpu: str
    format: str
    n: int
    k: int
    routing: str
    num_active_experts: int
    total_tokens: int
    avg_m: float
    regime: str
    ab_swapped: bool
    mma_bn: int
    cta_group: int
    stages: int
    median_us: float
    p10_us: float
    p90_us: float
    tflops: float
    gbps: float
    mma_ceiling_fraction: float
    bandwidth_ceiling_fraction: float
    source: str
    gpu_name: str
    date: str
    commit: str
    config_source: str
    stages_source: str

    def __post_init__(self):
        if not isinstance(self.gpu, str) or not _GPU_KEY.match(self.gpu):
            raise ValueError(f"gpu must be a lower-case id such as 'h200' or 'b200', got {self.gpu!r}")
        resolve_names(self.format)
        for name, minimum in (("n", 1), ("k", 1), ("num_active_experts", 1), ("total_tokens", 0), ("stages", 1)):
            object.__setattr__(self, name, require_int(name, getattr(self, name), minimum))
        if self.routing not in ABLATION_ROUTINGS:
            raise ValueError(f"routing must be one of {ABLATION_ROUTINGS}, got {self.routing!r}")
        avg_m = _positive_finite("avg_m", self.avg_m, allow_zero=True)
        want = self.total_tokens / self.num_active_experts
        if abs(avg_m - want) > AVG_M_RELATIVE_TOLERANCE * max(1.0, want):
            raise ValueError(f"avg_m = {avg_m} but total_tokens / num_active_experts = {want}")
        object.__setattr__(self, "avg_m", avg_m)
        regime = self.key.regime
        if self.regime != regime:
            raise ValueError(f"regime {self.regime!r} does not match the dispatch's classification {regime!r} of "
                             f"{self.total_tokens} tokens over {self.num_active_experts} slots")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        self._check_stages()
        for name in ("median_us", "p10_us", "p90_us"):
            object.__setattr__(self, name, _positive_finite(name, getattr(self, name)))
        if not self.p10_us <= self.median_us <= self.p90_us:
            raise ValueError(f"need p10 <= median <= p90, got {self.p10_us}, {self.median_us}, {self.p90_us}")
        for name in ("tflops", "gbps", "mma_ceiling_fraction", "bandwidth_ceiling_fraction"):
            object.__setattr__(self, name, _positive_finite(name, getattr(self, name), allow_zero=True))
        for name in ("gpu_name", "date", "commit"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.source == SOURCE_MEASURED and not self.gpu_name.strip():
            raise ValueError("a measured row must name the GPU it ran on (gpu_name)")
        if self.source == SOURCE_MEASURED and self.commit.strip() in ("", "unknown"):
            raise ValueError("a measured row must record the commit it ran (commit)")
        try:
            datetime.date.fromisoformat(self.date)
        except ValueError:
            raise ValueError(f"date must be an ISO date YYYY-MM-DD, got {self.date!r}") from None
        if self.config_source not in CONFIG_SOURCES:
            raise ValueError(f"config_source must be one of {CONFIG_SOURCES}, got {self.config_source!r}")
        if self.stages_source not in STAGES_SOURCES:
            raise ValueError(f"stages_source must be one of {STAGES_SOURCES}, got {self.stages_source!r}")

    def _check_stages(self) -> None:
        tile = self.config.tile_config
        max_stages = row_max_stages(self.gpu, self.source, self.format, tile)
        if max_stages is None or self.stages <= max_stages:
            return
        where = f"for {self.format} {tile_label(tile)}"
        if self.gpu == H200_KERNEL_GPU and self.source == SOURCE_MEASURED:
            # A measured row records what ran at its commit: the kernel's layout (and so its deepest
            # ring) moves by a stage or so between commits (f11c031's shared routing copy cost the
            # NVFP4 bn32 / bn64-pair and MXFP8 bn64-pair rings their last stage after the first sweep measured
            # them; evidence: ablate-run5). The sweep never went past the formula, so rows within it stay valid.
            formula = HARDWARE[self.gpu].max_stages(self.format, tile)
            if self.stages <= formula:
                return
            raise ValueError(f"{self.stages} stages exceed the H200 kernel's maximum {max_stages} {where} (its real "
                             f"shared-memory bytes, h200_launch.max_pipeline_stages) and the SM100 formula's "
                             f"{formula} with the {self.gpu} budget (the bound of sweeps before the kernel's own)")
        raise ValueError(f"{self.stages} stages exceed the {self.gpu} maximum {max_stages} {where} (the SM100 "
                         f"stage formula with the {self.gpu} budget, which bounds {self.source} rows)")

    @property
    def key(self) -> ProblemKey:
        return ProblemKey(self.format, self.n, self.k, self.routing, self.num_active_experts, self.total_tokens)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig(self.ab_swapped, self.mma_bn, self.cta_group, self.stages)

    def to_csv_dict(self) -> dict[str, str]:
        return {name: (repr(v) if isinstance(v, float) else str(v))
                for name, v in ((c, getattr(self, c)) for c in ABLATION_COLUMNS)}

    @classmethod
    def from_csv_dict(cls, record: dict[str, str]) -> "AblationRow":
        missing = [c for c in ABLATION_COLUMNS if c not in record]
        if missing:
            raise ValueError(f"missing columns {missing}")
        values = {}
        for f in dataclasses.fields(cls):
            text = record[f.name]
            try:
                if f.type == "int":
                    values[f.name] = int(text)
                elif f.type == "float":
                    values[f.name] = float(text)
                elif f.type == "bool":
                    values[f.name] = _parse_bool(text)
                else:
                    values[f.name] = text
            except ValueError as err:
                raise ValueError(f"column {f.name}: {err}") from None
        return cls(**values)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise ValueError(f"expected True or False, got {text!r}")


def make_row(key: ProblemKey, config, *, median_us: float, p10_us: float, p90_us: float, gpu: str,
             gpu_name: str, source: str, date: str, commit: str, bandwidth_ceiling_tbs: float,
             mma_ceiling_tflops: float, config_source: str = CONFIG_SOURCE_SWEEP,
             stages_source: str = STAGES_OVERRIDE) -> AblationRow:
    """A row with the derived columns filled in: avg_m, regime, TFLOP/s and GB/s of the problem's
    useful FLOPs and bytes (``gbs.lab.cases.useful_flops`` / ``useful_bytes``) at the median time, and
    their fractions of the given ceilings (measured ones for measured rows)."""
    config = ModelConfig.of(config)
    shape = problem_shape(key)
    seconds = _positive_finite("median_us", median_us) * 1e-6
    tflops = useful_flops(shape) / seconds / 1e12
    gbps = useful_bytes(shape) / seconds / 1e9
    return AblationRow(
        gpu=gpu, format=key.format, n=key.n, k=key.k, routing=key.routing,
        num_active_experts=key.num_active_experts, total_tokens=key.total_tokens, avg_m=key.avg_m,
        regime=key.regime, ab_swapped=config.ab_swapped, mma_bn=config.mma_bn, cta_group=config.cta_group,
        stages=config.stages, median_us=median_us, p10_us=p10_us, p90_us=p90_us, tflops=tflops, gbps=gbps,
        mma_ceiling_fraction=tflops / _positive_finite("mma_ceiling_tflops", mma_ceiling_tflops),
        bandwidth_ceiling_fraction=gbps / 1e3 / _positive_finite("bandwidth_ceiling_tbs", bandwidth_ceiling_tbs),
        source=source, gpu_name=gpu_name, date=date, commit=commit, config_source=config_source,
        stages_source=stages_source)


def write_ablations(path: str, rows: Sequence[AblationRow]) -> None:
    """Write rows as CSV with exactly ``ABLATION_COLUMNS`` (creates the folder)."""
    for i, row in enumerate(rows):
        if not isinstance(row, AblationRow):
            raise TypeError(f"rows[{i}] must be an AblationRow, got {type(row).__name__}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ABLATION_COLUMNS)
        writer.writeheader()
        writer.writerows(row.to_csv_dict() for row in rows)


def read_ablations(path: str) -> list[AblationRow]:
    """Read and validate every row; ValueError names the line and what is wrong."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        if set(header) != set(ABLATION_COLUMNS) or len(header) != len(ABLATION_COLUMNS):
            missing = [c for c in ABLATION_COLUMNS if c not in header]
            extra = [c for c in header if c not in ABLATION_COLUMNS]
            raise ValueError(f"{path}: header must be the ablation columns; missing {missing}, unexpected {extra}")
        rows = []
        for record in reader:
            try:
                rows.append(AblationRow.from_csv_dict(record))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}, line {reader.line_num}: {err}") from None
    return rows


def model_rows(hw: HardwareParams, problems: Iterable[ProblemKey], *, configs: Sequence[ModelConfig] | None = None,
               date: str | None = None, commit: str | None = None) -> list[AblationRow]:
    """``source="model"`` rows of ``hw``'s model for every problem and config (default: every
    legal config of the problem's format, ``legal_configs``). Ceiling fractions are against
    ``hw``'s sustained bandwidth and dense MMA rate. A row is ``config_source="dispatch"`` when
    its knobs and stages are what the dispatch picks for the problem with ``hw``'s budget."""
    date = date or datetime.date.today().isoformat()
    if commit is None:
        from gbs.lab.environment import environment_fields

        commit = environment_fields()["commit"]
    rows = []
    for key in problems:
        shape = problem_shape(key)
        try:
            picked = ModelConfig.of(dispatch_config(key, hw.smem_per_sm))
        except ValueError:      # a tuned stage count that does not fit this GPU: the dispatch has no pick
            picked = None
        for config in (configs if configs is not None else legal_configs(key.format, hw)):
            estimate = model_config(shape, config, hw)
            # a modelled row's limit is the SM100 formula with hw's budget (as in row_max_stages)
            auto = config.stages == hw.max_stages(key.format, config.tile_config)
            rows.append(make_row(
                key, config, median_us=estimate.time_us, p10_us=estimate.time_us, p90_us=estimate.time_us,
                gpu=hw.key, gpu_name=hw.name, source=SOURCE_MODEL, date=date, commit=commit,
                bandwidth_ceiling_tbs=hw.hbm_sustained_tbs, mma_ceiling_tflops=hw.mma_tflops(key.format),
                config_source=CONFIG_SOURCE_DISPATCH if config == picked else CONFIG_SOURCE_SWEEP,
                stages_source=STAGES_AUTO if auto else STAGES_OVERRIDE))
    return rows


def calibrate_rows(measured_rows: Sequence[AblationRow], hw: HardwareParams, **kwargs):
    """``gbs.lab.perfmodel.calibrate`` on measured rows (their problems and configs, median times)."""
    rows = [r for r in measured_rows if r.source == SOURCE_MEASURED]
    if len(rows) != len(measured_rows):
        raise ValueError("calibrate_rows takes measured rows only (source='measured')")
    if not rows:
        raise ValueError("need at least one measured row to calibrate")
    gpus = {r.gpu for r in rows}
    if gpus != {hw.key}:
        raise ValueError(f"rows are from {sorted(gpus)}, the hardware is {hw.key!r}")
    cases = [(problem_shape(r.key), r.config) for r in rows]
    return calibrate(cases, [r.median_us for r in rows], hw, **kwargs)


# ----------------------------------------------------------------------------------------------
# Derived tables
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegimeChoice:
    """The knob set of one regime and the evidence behind it."""

    regime: str
    config: TileConfig
    geomean_slowdown: float               # of this knob set vs each problem's fastest (1.0 = always fastest)
    wins: int                             # problems where it is the fastest knob set
    num_problems: int
    alternatives: tuple[tuple[TileConfig, float], ...]   # every candidate and its geomean slowdown, best first
    problems: tuple[ProblemKey, ...] = ()


@dataclass(frozen=True)
class ShapeEntry:
    """Knobs and stages of one (N, K, regime)."""

    n: int
    k: int
    regime: str
    config: TileConfig
    stages: int
    stages_source: str                    # derived: "tuned" or "auto"; upstream: the dispatch's source
    special: bool                         # knobs differ from the regime config (a shape exception)
    evidence: str
    stage_slowdowns: tuple[tuple[int, float], ...] = ()   # derived: stages -> geomean slowdown
    problems: tuple[ProblemKey, ...] = ()

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_tile(self.config, self.stages)


@dataclass(frozen=True)
class Boundary:
    """Between two swept avg_m values of one shape the best knob set changes."""

    n: int
    k: int
    avg_m_below: float
    avg_m_above: float
    config_below: TileConfig
    config_above: TileConfig

    def label(self) -> str:
        return (f"{self.avg_m_below:g}|{self.avg_m_above:g}: {tile_label(self.config_below)} -> "
                f"{tile_label(self.config_above)}")


@dataclass(frozen=True)
class DispatchTable:
    """A dispatch table: regime bounds and configs, per-shape knobs and stages, and where the
    best knobs change along avg_m."""

    label: str
    gpu: str
    format: str
    source: str                           # "upstream", "measured" or "model"
    rule: str
    tolerance: float
    regime_configs: dict                  # regime -> RegimeChoice
    entries: tuple[ShapeEntry, ...]
    boundaries: tuple[Boundary, ...]
    regime_bounds: tuple[int, int] = (DECODE_AVG_M, SMALL_PREFILL_AVG_M)

    def entry(self, n: int, k: int, regime: str) -> ShapeEntry | None:
        return next((e for e in self.entries if (e.n, e.k, e.regime) == (n, k, regime)), None)

    def shape_boundaries(self, n: int, k: int) -> tuple[Boundary, ...]:
        return tuple(b for b in self.boundaries if (b.n, b.k) == (n, k))


def _geomean(values) -> float:
    return float(np.exp(np.mean(np.log(values))))


def _problem_times(rows: Sequence[AblationRow]) -> dict[ProblemKey, dict[ModelConfig, float]]:
    """Median time of every (problem, config); repeated rows of one config: median of medians."""
    collected: dict[ProblemKey, dict[ModelConfig, list[float]]] = {}
    for row in rows:
        collected.setdefault(row.key, {}).setdefault(row.config, []).append(row.median_us)
    return {key: {cfg: float(np.median(ts)) for cfg, ts in by_cfg.items()} for key, by_cfg in collected.items()}


def _knob_times(times: dict[ModelConfig, float]) -> dict[TileConfig, float]:
    best: dict[TileConfig, float] = {}
    for cfg, t in times.items():
        tile = cfg.tile_config
        best[tile] = min(t, best.get(tile, math.inf))
    return best


def _rank_knobs(keys, knob_times, best) -> list[tuple[TileConfig, float]]:
    """Knob sets present in every problem of ``keys``, by geomean slowdown (best first)."""
    common = set.intersection(*(set(knob_times[key]) for key in keys))
    ranked = [(tile, _geomean([knob_times[key][tile] / best[key] for key in keys])) for tile in common]
    return sorted(ranked, key=lambda item: (item[1], _least_mma_work(item[0])))


def _least_mma_work(tile: TileConfig) -> tuple:
    """Tie-break order of knob sets: fewest tokens per tile (least padded MMA work on small
    groups), then fewest token bytes per weight row (the 2-CTA pair's sharing)."""
    shape = tile.tile_shape
    return shape.tokens, shape.tokens / shape.weight_rows


def _pick_knobs(ranked: list[tuple[TileConfig, float]], tolerance: float) -> TileConfig:
    """Among knob sets within ``tolerance`` of the best geomean, the first by ``_least_mma_work``:
    when the times cannot tell them apart (every knob set DRAM-bound, say), the least waste."""
    best = ranked[0][1]
    return min((tile for tile, slow in ranked if slow <= (1 + tolerance) * best), key=_least_mma_work)


def _boundaries(n: int, k: int, points: Sequence[tuple[float, list[tuple[TileConfig, float]], TileConfig | None]],
                tolerance: float = 0.0) -> list[Boundary]:
    """Where the chosen knob set has to change along avg_m. ``points``: (avg_m, knob sets ranked
    best first with their slowdowns, the regime's config there). At each avg_m the incumbent is
    kept while it stays within ``tolerance`` of the best; otherwise (and at the first avg_m) the
    regime's config is taken if it is within ``tolerance``, else the best. So near-ties (every
    knob set DRAM-bound, say) make no boundaries."""
    def acceptable(tile, ranked):
        slowdowns = dict(ranked)
        return tile is not None and tile in slowdowns and slowdowns[tile] <= (1 + tolerance) * ranked[0][1]

    def choose(ranked, preferred):
        return preferred if acceptable(preferred, ranked) else ranked[0][0]

    points = sorted(points, key=lambda p: p[0])
    if not points:
        return []
    boundaries = []
    previous_avg_m, ranked, preferred = points[0]
    incumbent = choose(ranked, preferred)
    for avg_m, ranked, preferred in points[1:]:
        if not acceptable(incumbent, ranked):
            chosen = choose(ranked, preferred)
            boundaries.append(Boundary(n, k, previous_avg_m, avg_m, incumbent, chosen))
            incumbent = chosen
        previous_avg_m = avg_m
    return boundaries


def derive_dispatch_table(rows: Sequence[AblationRow], rule: str = RULE_FASTEST,
                          tolerance: float = DEFAULT_TOLERANCE, label: str | None = None) -> DispatchTable:
    """The dispatch table the rows support, by the module's stated rule (see the docstring).

    ``rows`` must come from one GPU, one format and one source (measured and modelled times are
    never mixed). ``rule="fastest"`` takes the fastest stage count; ``rule="within"`` the fewest
    stages whose geometric-mean time is within ``tolerance`` (a fraction) of the fastest. Under
    both rules ``tolerance`` is also the margin within which knob sets count as tied (regime
    configs, shape exceptions, boundaries); ``tolerance=0`` makes every choice the exact fastest.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    tolerance = _positive_finite("tolerance", tolerance, allow_zero=True)
    if not rows:
        raise ValueError("need at least one ablation row")
    for what in ("gpu", "format", "source"):
        values = sorted({getattr(r, what) for r in rows})
        if len(values) != 1:
            raise ValueError(f"rows mix {what}s {values}; derive one table per (gpu, format, source)")
    gpu, fmt, source = rows[0].gpu, rows[0].format, rows[0].source
    times = _problem_times(rows)
    best = {key: min(by_cfg.values()) for key, by_cfg in times.items()}
    knob_times = {key: _knob_times(by_cfg) for key, by_cfg in times.items()}

    regime_configs = {}
    for regime in REGIMES:
        keys = [key for key in times if key.regime == regime]
        if not keys:
            continue
        ranked = _rank_knobs(keys, knob_times, best)
        if not ranked:
            raise ValueError(f"no knob set was run on every {regime} problem; cannot pick a regime config")
        chosen = _pick_knobs(ranked, tolerance)
        wins = sum(min(knob_times[key], key=knob_times[key].get) == chosen for key in keys)
        regime_configs[regime] = RegimeChoice(regime, chosen, dict(ranked)[chosen], wins, len(keys), tuple(ranked),
                                              tuple(keys))

    entries = []
    for (n, k, regime) in sorted({(key.n, key.k, key.regime) for key in times}):
        keys = [key for key in times if (key.n, key.k, key.regime) == (n, k, regime)]
        ranked_list = _rank_knobs(keys, knob_times, best)
        ranked = dict(ranked_list)
        own = _pick_knobs(ranked_list, tolerance)
        regime_tile = regime_configs[regime].config
        special = regime_tile not in ranked or ranked[regime_tile] > (1 + tolerance) * ranked[own]
        tile = own if special else regime_tile
        stage_counts = set.intersection(*({cfg.stages for cfg in times[key] if cfg.tile_config == tile}
                                          for key in keys))
        if not stage_counts:
            raise ValueError(f"{tile_label(tile)} shares no stage count over the ({n}, {k}) {regime} problems; "
                             "run the same stage counts on every problem of a group")
        slowdowns = sorted((s, _geomean([times[key][ModelConfig.from_tile(tile, s)]
                                         / best[key] for key in keys])) for s in stage_counts)
        fastest = min(slowdowns, key=lambda item: (item[1], item[0]))
        if rule == RULE_FASTEST:
            stages = fastest[0]
        else:
            stages = min(s for s, slow in slowdowns if slow <= (1 + tolerance) * fastest[1])
        max_stages = row_max_stages(gpu, source, fmt, tile)
        regime_note = ("" if not special else
                       f"; the regime config {tile_label(regime_tile)} is "
                       + (f"x{ranked[regime_tile] / ranked[own]:.3f} slower here" if regime_tile in ranked
                          else "not run on every problem here"))
        entries.append(ShapeEntry(
            n, k, regime, tile, stages, STAGES_AUTO if stages == max_stages else "tuned", special,
            evidence=(f"{len(keys)} problems; {tile_label(tile)} x{stages}: geomean x"
                      f"{dict(slowdowns)[stages]:.3f} of each problem's fastest{regime_note}"),
            stage_slowdowns=tuple(slowdowns), problems=tuple(keys)))

    boundaries = []
    for n, k in sorted({key.shape for key in times}):
        by_avg_m: dict[float, list[ProblemKey]] = {}
        for key in times:
            if key.shape == (n, k):
                by_avg_m.setdefault(key.avg_m, []).append(key)
        points = [(avg_m, ranked, regime_configs[keys[0].regime].config) for avg_m, keys in by_avg_m.items()
                  if (ranked := _rank_knobs(keys, knob_times, best))]
        boundaries += _boundaries(n, k, points, tolerance)

    return DispatchTable(
        label=label or f"{gpu} {source}", gpu=gpu, format=fmt, source=source, rule=rule, tolerance=tolerance,
        regime_configs=regime_configs, entries=tuple(entries), boundaries=tuple(boundaries))


def upstream_table(fmt: str = "nvfp4", *, shapes: Iterable[tuple[int, int]] | None = None,
                   tokens_per_expert: Iterable[int] = DEFAULT_TOKENS_PER_EXPERT,
                   smem_per_sm: int | None = None) -> DispatchTable:
    """The upstream (Modular MAX, tuned on B200) decisions as a ``DispatchTable``: ``gbs.dispatch``
    (``tuned_dispatch_config``: the MXFP8 regime dispatch for MXFP8 activations) asked at
    ``UPSTREAM_SLOTS`` slots for every tokens-per-expert of the grid and every shape."""
    shapes = tuple(shapes) if shapes is not None else ABLATION_SHAPES[fmt]
    smem = smem_per_sm if smem_per_sm is not None else HARDWARE["b200"].smem_per_sm
    entries: dict[tuple[int, int, str], ShapeEntry] = {}
    boundaries = []
    regime_tiles: dict[str, set] = {}
    for n, k in shapes:
        points = []
        for per_expert in tokens_per_expert:
            key = ProblemKey(fmt, n, k, "uniform", UPSTREAM_SLOTS, UPSTREAM_SLOTS * per_expert)
            config = tuned_dispatch_config(key, smem)
            tile = TileConfig.of(config)
            regime = key.regime
            points.append((key.avg_m, [(tile, 1.0)], None))
            if config.rule != RULE_KIMI:
                regime_tiles.setdefault(regime, set()).add(tile)
            entry = ShapeEntry(n, k, regime, tile, config.num_pipeline_stages, config.stages_source,
                               special=config.rule == RULE_KIMI, evidence=f"dispatch rule {config.rule}: "
                               f"{config.stages_reason}", problems=(key,))
            previous = entries.setdefault((n, k, regime), entry)
            if (previous.config, previous.stages) != (entry.config, entry.stages):
                raise ValueError(f"the dispatch changes its decision for ({n}, {k}) inside {regime}: "
                                 f"{previous.model_config.label()} vs {entry.model_config.label()}")
            if previous is not entry:
                entries[(n, k, regime)] = dataclasses.replace(previous, problems=previous.problems + (key,))
        boundaries += _boundaries(n, k, points)
    regime_configs = {}
    for regime, tiles in regime_tiles.items():
        if len(tiles) != 1:
            raise ValueError(f"the dispatch gives {regime} several knob sets {tiles}; not a regime table")
        (tile,) = tiles
        regime_configs[regime] = RegimeChoice(regime, tile, 1.0, 0, 0, ((tile, 1.0),))
    return DispatchTable(label=f"upstream ({fmt}, tuned on B200)", gpu="b200", format=fmt, source="upstream",
                         rule=RULE_UPSTREAM, tolerance=0.0, regime_configs=regime_configs,
                         entries=tuple(entries.values()), boundaries=tuple(boundaries))


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Disagreement:
    """One place where a derived table differs from upstream, and why."""

    table: str
    n: int | None              # None for a regime-level difference
    k: int | None
    regime: str | None
    field: str                 # "regime config", "config", "stages", "boundaries"
    upstream: str
    derived: str
    reason: str

    def line(self) -> str:
        where = f"({self.n}, {self.k}) {self.regime}" if self.n is not None else (self.regime or "all")
        return (f"- **{self.table}**, {where}, {self.field}: upstream {self.upstream}, derived {self.derived}. "
                f"{self.reason}")


@dataclass(frozen=True)
class TableComparison:
    markdown: str
    disagreements: tuple[Disagreement, ...]


def _representative(problems: Sequence[ProblemKey]) -> ProblemKey:
    """The median-avg_m problem (uniform routing preferred): where a table's choice is explained."""
    pool = [p for p in problems if p.routing == "uniform"] or list(problems)
    pool = sorted(pool, key=lambda p: (p.avg_m, p.num_active_experts))
    return pool[len(pool) // 2]


def _model_reason(table: DispatchTable, problems, preferred: ModelConfig, other: ModelConfig,
                  hardware: dict) -> str:
    """The model's explanation on ``table``'s GPU at the representative problem. A config past the
    table's own stage limit (``row_max_stages``: the H200 kernel's for measured H200 tables) could
    not have run; one past the model's SM100 formula only cannot be modelled."""
    hw = hardware.get(table.gpu)
    if hw is None or not problems:
        return "no performance model for this GPU"
    key = _representative(problems)
    source = table.source if table.source in SOURCES else SOURCE_MODEL   # upstream's: the dispatch's formula
    for config in (preferred, other):
        limit = row_max_stages(table.gpu, source, key.format, config.tile_config)
        if limit is not None and config.stages > limit:
            what = ("the H200 kernel's" if table.gpu == H200_KERNEL_GPU and source == SOURCE_MEASURED
                    else f"{hw.name}'s")
            return f"{config.label()} does not fit {what} shared memory (at most {limit} stages)"
    for config in (preferred, other):
        formula = hw.max_stages(key.format, config.tile_config)
        if config.stages > formula:
            return (f"{config.label()} is within the table's stage limit but past the model's: its SM100 stage "
                    f"formula allows at most {formula} on {hw.name}, so it cannot be modelled")
    return f"At {key.num_active_experts} x {key.avg_m:g} tokens ({key.routing}): " + \
        explain_difference(problem_shape(key), preferred, other, hw)


def _entry_text(entry: ShapeEntry | None) -> str:
    if entry is None:
        return "-"
    return f"{'*' if entry.special else ''}{tile_label(entry.config)} x{entry.stages} ({entry.stages_source})"


def compare_tables(upstream: DispatchTable, derived_h200: DispatchTable, derived_b200_model: DispatchTable, *,
                   hardware: dict | None = None) -> TableComparison:
    """Side-by-side markdown of the three tables and every disagreement with upstream, with reasons:
    the derived table's evidence (geomean slowdowns from its rows) and the performance model's
    breakdown on that table's GPU (``hardware``: gpu key -> HardwareParams, default the module's)."""
    tables = (upstream, derived_h200, derived_b200_model)
    for t in tables:
        if not isinstance(t, DispatchTable):
            raise TypeError(f"compare_tables takes DispatchTables, got {type(t).__name__}")
    if len({t.format for t in tables}) != 1:
        raise ValueError(f"tables are for different formats {[t.format for t in tables]}")
    hardware = dict(HARDWARE if hardware is None else hardware)
    derived = (derived_h200, derived_b200_model)
    disagreements: list[Disagreement] = []

    lines = [f"## Dispatch tables ({upstream.format}): upstream vs derived",
             "", "Knobs as `bn<mma_bn>/cg<cta_group>/<sw: AB swapped | ns: not swapped>`, `xN` = N stages; "
             "`*` = a shape exception to its regime config. Derived rules: "
             + "; ".join(f"{t.label}: {t.rule}" + (f" (tolerance {100 * t.tolerance:g} %)" if t.rule == RULE_WITHIN
                                                    else "") for t in derived) + ".",
             "", "### Regime configs (regimes by avg_m: decode <= "
             f"{upstream.regime_bounds[0]}, small prefill <= {upstream.regime_bounds[1]}, large prefill above)",
             "", "| regime | " + " | ".join(t.label for t in tables) + " |", "|---" * (len(tables) + 1) + "|"]
    for regime in REGIMES:
        cells = []
        for t in tables:
            choice = t.regime_configs.get(regime)
            if choice is None:
                cells.append("-")
            elif t.source == "upstream":
                cells.append(tile_label(choice.config))
            else:
                cells.append(f"{tile_label(choice.config)} (x{choice.geomean_slowdown:.3f}, "
                             f"{choice.wins}/{choice.num_problems} wins)")
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
        up = upstream.regime_configs.get(regime)
        for t in derived:
            mine = t.regime_configs.get(regime)
            if up is None or mine is None or mine.config == up.config:
                continue
            slow = dict(mine.alternatives).get(up.config)
            evidence = (f"In the {t.source} rows upstream's {tile_label(up.config)} is "
                        + (f"x{slow:.3f} of each problem's fastest (geomean over {mine.num_problems} problems) vs "
                           f"x{mine.geomean_slowdown:.3f} for {tile_label(mine.config)}." if slow is not None
                           else "not run on every problem."))
            pick = [p for p in mine.problems if not ((e := t.entry(p.n, p.k, regime)) and e.special)]
            hw = hardware.get(t.gpu)
            reason = evidence
            if hw is not None and pick:
                fmt = upstream.format
                reason += " " + _model_reason(t, pick, auto_config(fmt, mine.config, hw),
                                              auto_config(fmt, up.config, hw), hardware)
            disagreements.append(Disagreement(t.label, None, None, regime, "regime config", tile_label(up.config),
                                              tile_label(mine.config), reason))

    keys = sorted({(e.n, e.k, e.regime) for t in tables for e in t.entries},
                  key=lambda x: (x[0], x[1], REGIMES.index(x[2]) if x[2] in REGIMES else len(REGIMES)))
    lines += ["", "### Knobs and stages per shape", "",
              "| (N, K) | regime | " + " | ".join(t.label for t in tables) + " |", "|---" * (len(tables) + 2) + "|"]
    for n, k, regime in keys:
        up = upstream.entry(n, k, regime)
        lines.append(f"| ({n}, {k}) | {regime} | " + " | ".join(_entry_text(t.entry(n, k, regime)) for t in tables)
                     + " |")
        for t in derived:
            mine = t.entry(n, k, regime)
            if up is None or mine is None:
                continue
            if mine.config != up.config:
                field, up_text, mine_text = "config", tile_label(up.config), tile_label(mine.config)
            elif mine.stages != up.stages:
                field, up_text, mine_text = "stages", str(up.stages), str(mine.stages)
            else:
                continue
            slow = dict(mine.stage_slowdowns).get(up.stages) if mine.config == up.config else None
            evidence = mine.evidence + (f"; upstream's {up.stages} stages: x{slow:.3f}" if slow is not None else "")
            reason = (f"{t.source.capitalize()} evidence: {evidence}. "
                      + _model_reason(t, mine.problems, mine.model_config, up.model_config, hardware))
            disagreements.append(Disagreement(t.label, n, k, regime, field, up_text, mine_text, reason))

    shapes = sorted({(n, k) for n, k, _ in keys})
    lines += ["", "### Where the best knobs change along avg_m (swept grid: `below|above: from -> to`)", "",
              "| (N, K) | " + " | ".join(t.label for t in tables) + " |", "|---" * (len(tables) + 1) + "|"]
    for n, k in shapes:
        lines.append(f"| ({n}, {k}) | " + " | ".join(
            "; ".join(b.label() for b in t.shape_boundaries(n, k)) or "none" for t in tables) + " |")
        up_bounds = {(b.avg_m_below, b.avg_m_above) for b in upstream.shape_boundaries(n, k)}
        for t in derived:
            mine = t.shape_boundaries(n, k)
            if not any(t.entry(n, k, r) for r in REGIMES) or {(b.avg_m_below, b.avg_m_above) for b in mine} == up_bounds:
                continue
            reason = ("The derived table's best knob set changes at "
                      + ("; ".join(b.label() for b in mine) or "no swept avg_m")
                      + f" where upstream switches at {', '.join(f'{lo:g}|{hi:g}' for lo, hi in sorted(up_bounds))}"
                      + " (thresholds are only located to the swept grid).")
            disagreements.append(Disagreement(
                t.label, n, k, None, "boundaries",
                "; ".join(b.label() for b in upstream.shape_boundaries(n, k)) or "none",
                "; ".join(b.label() for b in mine) or "none", reason))

    lines += ["", "### Disagreements with upstream", ""]
    lines += [d.line() for d in disagreements] or ["none"]
    return TableComparison("\n".join(lines), tuple(disagreements))


__all__ = [
    "ABLATION_COLUMNS", "ABLATION_ROUTINGS", "ABLATION_SHAPES", "AblationRow", "Boundary", "DispatchTable",
    "Disagreement", "ProblemKey", "RegimeChoice", "ShapeEntry", "TableComparison", "calibrate_rows",
    "compare_tables", "derive_dispatch_table", "dispatch_config", "legal_configs", "make_row", "model_rows",
    "problem_shape", "read_ablations", "routing_for", "row_max_stages", "sweep_problems", "tuned_dispatch_config",
    "upstream_table", "write_ablations",
]
