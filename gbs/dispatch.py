"""Kernel-config dispatch of the grouped (1D-1D) block-scaled SM100 matmul, decision for decision.

Reproduces ``../shared/spec/dispatch.md`` (the dispatch of Modular's MAX grouped block-scaled SM100
matmul): from the problem (N, K, number of group slots, estimated token count) and the operand
formats it picks ``AB_swapped``, ``mma_bn``, ``cta_group`` and the shared-memory pipeline depth, and
records which rule fired in a frozen ``KernelConfig`` whose ``explain()`` says why in words.

Entry points (keyword-only arguments):

* ``grouped_matmul_nvfp4_dispatch``: NVFP4 x NVFP4; regime table, NVFP4 tuned stages, the Kimi
  K2.5 rule, or the caller's knobs when ``override=True``.
* ``grouped_matmul_mxfp8_dispatch``: MXFP8 (E4M3) activations x MXFP8 or MXFP4 (W4A8) weights;
  regime table, two tuned decode rows, auto stages elsewhere.
* ``grouped_matmul_block_scaled_sm100_dispatch``: routing by operand formats (the spec's table).

Constraints and conventions:

* K counts unpacked elements (FP4: two per byte) and must be a multiple of the scale block size.
* ``num_active_experts`` counts group slots, including slots with expert id -1 or no tokens.
* ``estimated_total_m`` only steers the decision; regimes are integer comparisons
  ``estimated_total_m <= num_active_experts * bound`` (no division, so no rounding).
* Everything is pure Python on integers: no GPU needed. ``smem_per_sm`` is the shared-memory
  budget the stage formula starts from (B200 by default; ``H200_SMEM_PER_SM`` for the Hopper port).
* An illegal configuration is a ``ValueError``, never silently changed; a wrong type is a
  ``TypeError``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from gbs.formats import BlockFormat, get_format

# ---------------------------------------------------------------------------------------------
# Regimes: avg_m = estimated_total_m / num_active_experts, compared without dividing.
DECODE_AVG_M = 8            # decode: estimated_total_m <= slots * 8
SMALL_PREFILL_AVG_M = 64    # small prefill: estimated_total_m <= slots * 64; above: large prefill
LARGE_PREFILL_BOUND = -1    # the "no upper bound" marker of the tuned-stage table rows

REGIME_DECODE = "decode"
REGIME_SMALL_PREFILL = "small_prefill"
REGIME_LARGE_PREFILL = "large_prefill"
REGIME_DEFAULT = "default"      # the routing's default config (no regime dispatch)
REGIME_OVERRIDE = "override"    # caller's knobs (NVFP4 override=True)

# Upper avg_m bound of each regime as written in the tuned-stage table rows.
REGIME_AVG_M_BOUND = {
    REGIME_DECODE: DECODE_AVG_M,
    REGIME_SMALL_PREFILL: SMALL_PREFILL_AVG_M,
    REGIME_LARGE_PREFILL: LARGE_PREFILL_BOUND,
}

# Config of each regime, (AB_swapped, mma_bn, cta_group); shared by the NVFP4 and MXFP8 dispatch.
REGIME_CONFIGS = {
    REGIME_DECODE: (True, 8, 1),
    REGIME_SMALL_PREFILL: (True, 64, 2),
    REGIME_LARGE_PREFILL: (True, 128, 2),
}
# Routing's default config (MXFP4 x MXFP4, MXFP8 x MXFP8); stages auto.
DEFAULT_CONFIG = (False, 128, 1)

# ---------------------------------------------------------------------------------------------
# Pipeline stages.
AUTO_STAGES = -1            # "pick the deepest pipeline that fits" (override's num_pipeline_stages)
DECODE_DEFAULT_STAGES = 6   # every NVFP4 decode shape: measured minimum at 6 on B200 for several
                            # shapes (deeper adds prologue latency; shallower hides less latency)


class TunedStagesRow(NamedTuple):
    """One NVFP4 tuned-stage row; ``regime_avg_m``: the regime's avg_m bound, -1 large prefill."""

    n: int
    k: int
    regime_avg_m: int
    stages: int


# Rows of the spec's NVFP4_TUNED_STAGES; shapes from workloads.md. Each row is a stage count
# upstream tuned on B200 and uses instead of auto (auto's B200 value in brackets); the spec gives
# no per-row timing, only the row.
NVFP4_TUNED_STAGES: tuple[TunedStagesRow, ...] = (
    # DeepSeek-V3 / Kimi up-projection, small prefill: tuned 6 (auto 8).
    TunedStagesRow(4096, 7168, SMALL_PREFILL_AVG_M, 6),
    # DeepSeek-V3 / Kimi up-projection, large prefill: tuned 7 (auto 7; pinned, not computed).
    TunedStagesRow(4096, 7168, LARGE_PREFILL_BOUND, 7),
    # DeepSeek-V3 down-projection, small prefill: tuned 6 (auto 8).
    TunedStagesRow(7168, 2048, SMALL_PREFILL_AVG_M, 6),
    # DeepSeek-V3 down-projection, large prefill: tuned 6 (auto 7).
    TunedStagesRow(7168, 2048, LARGE_PREFILL_BOUND, 6),
    # Kimi K2.5 TP=8 down-projection (K=256: a single 256-element K slice), large prefill:
    # tuned 6 (auto 7).
    TunedStagesRow(7168, 256, LARGE_PREFILL_BOUND, 6),
)


class TunedDecodeRow(NamedTuple):
    """One MXFP8 tuned decode row (decode regime, no fused SwiGLU epilogue only)."""

    n: int
    k: int
    stages: int
    b200_gain_vs_auto_pct: float   # measured speed-up over auto stages on B200


# Spec: measured at 16 tokens per expert, in the spec's order (6144, 6144) then (6144, 3072).
MXFP8_TUNED_DECODE_STAGES: tuple[TunedDecodeRow, ...] = (
    # MXFP8 MoE EP=8 gate_up: 6 stages 5.3 % faster than auto (12) on B200.
    TunedDecodeRow(6144, 6144, 6, 5.3),
    # MXFP8 MoE EP=8 down: 6 stages 7.3 % faster than auto (12) on B200.
    TunedDecodeRow(6144, 3072, 6, 7.3),
)

# Kimi K2.5, tensor-parallel 8, up-projection (N, K): only 4 tiles of 128 weight rows per expert,
# so the grid is starved and every regime does best with the 2-CTA pair and 6 stages.
KIMI_SHAPE = (512, 7168)
KIMI_STAGES = 6
KIMI_CTA_GROUP = 2
KIMI_DECODE_MMA_BN = 64     # estimated_total_m <= slots * DECODE_AVG_M
KIMI_PREFILL_MMA_BN = 128   # otherwise

# ---------------------------------------------------------------------------------------------
# Shared memory and the stages=auto formula.
B200_SMEM_PER_SM = 233472   # 228 KiB per SM on B200 (the formula itself reserves 1 KiB of it)
# 227 KiB: Hopper's opt-in maximum of dynamic shared memory per block (the SM has 228 KiB, 1 KiB is
# reserved per block). The formula subtracts its own 1 KiB reserve on top, so on H200 the budget
# is 1 KiB more conservative than strictly needed.
H200_SMEM_PER_SM = 232448

SMEM_RESERVED_BYTES = 1024      # reserved per block (upstream: B200 smem per SM - 1024)
NUM_OUTPUT_STAGES = 2           # the bf16 output tile is double-buffered
# The next three are spec values; the split into barriers/addresses is our reading of upstream.
FIXED_BOOKKEEPING_BYTES = 12    # TMEM address (4 B) + one 8-B mbarrier
FIXED_SCHEDULER_BYTES = 320     # tile-scheduler (CLC) responses and their mbarriers
ACCUM_STAGE_BARRIER_BYTES = 16  # full + empty mbarrier (8 B each) per accumulator stage
STAGE_BARRIER_BYTES = 32        # mbarriers per input pipeline stage
K_TILE_BYTES = 128              # K slice per stage: 128 bytes of every operand row
TILE_ROWS = 128                 # rows of the 128-row operand tile (weights when swapped)
SF_ATOM_BYTES = 512             # one 128-row x 4-scale scale-factor atom (128x4 layout)
SF_ATOM_K = 4                   # scale columns per atom
SF_ATOM_ROWS = 128              # rows per atom
OUTPUT_BYTES = 2                # bf16 output element
SWAPPED_C_TILE_MAX_COLS = 32    # swapped: C tile is 128 x min(32, mma_bn) tokens
UNSWAPPED_C_TILE_COLS = 64      # not swapped: C tile is 128 x 64
TMEM_STAGE_MMA_BN_MAX = 128     # 2 accumulator stages up to mma_bn=128 (512 TMEM columns also
                                # hold the scale factors)

# ---------------------------------------------------------------------------------------------
# Legal knobs (SM100).
CTA_GROUPS = (1, 2)
LEGAL_MMA_BN = {
    1: (8, 16, 32, 64, 128, 256),   # one CTA, UMMA M=128
    2: (64, 128, 256),              # CTA pair, UMMA M=256 (mma_bn < 64 needs cta_group=1)
}
# K of the config's UMMA shape as the spec records it; the instructions themselves step K by 64
# FP4 / 32 FP8 elements per MMA (kernels.md), which this field does not describe.
UMMA_K = 32

# mma kinds per operand-format pair and how the routing treats the pair.
MMA_KIND_NVFP4 = "mxf4nvf4"
MMA_KIND_MXFP4 = "mxf4"
MMA_KIND_F8F6F4 = "mxf8f6f4"
# Shared-memory bits per element: kind::mxf8f6f4 holds every operand, FP4 included, one element
# per byte (so its K slice is 128 elements); the FP4 kinds keep FP4 packed (256 elements).
_SMEM_ELEMENT_BITS = {MMA_KIND_NVFP4: 4, MMA_KIND_MXFP4: 4, MMA_KIND_F8F6F4: 8}

_ROUTE_NVFP4 = "nvfp4 dispatch"
_ROUTE_DEFAULT = "default config"
_ROUTE_MXFP8 = "mxfp8 regime dispatch"
# (A format, B format) -> (mma kind, route); B is the weight operand (W4A8: B = MXFP4).
SUPPORTED_FORMAT_PAIRS = {
    ("nvfp4", "nvfp4"): (MMA_KIND_NVFP4, _ROUTE_NVFP4),
    ("mxfp4", "mxfp4"): (MMA_KIND_MXFP4, _ROUTE_DEFAULT),
    ("mxfp8", "mxfp8"): (MMA_KIND_F8F6F4, _ROUTE_DEFAULT),
    ("mxfp8", "mxfp4"): (MMA_KIND_F8F6F4, _ROUTE_MXFP8),   # W4A8
}

RULE_OVERRIDE = "override"
RULE_KIMI = "kimi"
RULE_REGIME = "regime"
RULE_DEFAULT = "default"

STAGES_TUNED = "tuned"
STAGES_DECODE_DEFAULT = "decode-default"
STAGES_AUTO = "auto"
STAGES_OVERRIDE = "override"

REGIMES = (REGIME_DECODE, REGIME_SMALL_PREFILL, REGIME_LARGE_PREFILL, REGIME_DEFAULT,
           REGIME_OVERRIDE)
RULES = (RULE_OVERRIDE, RULE_KIMI, RULE_REGIME, RULE_DEFAULT)
STAGES_SOURCES = (STAGES_TUNED, STAGES_DECODE_DEFAULT, STAGES_AUTO, STAGES_OVERRIDE)


# ---------------------------------------------------------------------------------------------
# Input checks.
def require_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``; bools and floats are rejected."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _require_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _format_pair(a_format: str | BlockFormat, b_format: str | BlockFormat) -> tuple[str, str]:
    """Canonical names of a supported (A, B) format pair, else ValueError listing the pairs."""
    supported = ", ".join(f"{a} x {b}" for a, b in SUPPORTED_FORMAT_PAIRS)
    try:
        pair = (get_format(a_format).name, get_format(b_format).name)
    except ValueError as err:
        raise ValueError(f"{err}; supported (A x B) pairs: {supported}") from None
    if pair not in SUPPORTED_FORMAT_PAIRS:
        raise ValueError(
            f"unsupported operand formats A={pair[0]} x B={pair[1]}; supported (A x B) pairs: "
            f"{supported} (mixed scale types, E5M2 and bf16 tokens have no SM100 route; dispatch_for maps E5M2 "
            "and W4A16 problems to the pair that decides for them, ROUTE_AS)")
    return pair


def _check_k(k: int, pair: tuple[str, str]) -> None:
    for name in pair:
        block = get_format(name).block_size
        if k % block:
            raise ValueError(f"K={k} (unpacked elements) must be a multiple of the {name} "
                             f"scale block size {block}")


# ---------------------------------------------------------------------------------------------
# Pure decision functions.
def classify_regime(estimated_total_m, num_active_experts) -> str:
    """``"decode"``, ``"small_prefill"`` or ``"large_prefill"``, by integer comparison."""
    estimated_total_m = require_int("estimated_total_m", estimated_total_m, 0)
    num_active_experts = require_int("num_active_experts", num_active_experts, 1)
    if estimated_total_m <= num_active_experts * DECODE_AVG_M:
        return REGIME_DECODE
    if estimated_total_m <= num_active_experts * SMALL_PREFILL_AVG_M:
        return REGIME_SMALL_PREFILL
    return REGIME_LARGE_PREFILL


def regime_comparison(estimated_total_m: int, num_active_experts: int) -> str:
    """The integer comparison that decides the regime, in words."""
    regime = classify_regime(estimated_total_m, num_active_experts)
    m, slots = int(estimated_total_m), int(num_active_experts)
    decode = f"{slots} slots x {DECODE_AVG_M} = {slots * DECODE_AVG_M}"
    small = f"{slots} slots x {SMALL_PREFILL_AVG_M} = {slots * SMALL_PREFILL_AVG_M}"
    if regime == REGIME_DECODE:
        return f"estimated_total_m={m} <= {decode} -> {regime}"
    if regime == REGIME_SMALL_PREFILL:
        return f"estimated_total_m={m} > {decode} and <= {small} -> {regime}"
    return f"estimated_total_m={m} > {small} -> {regime}"


def check_mma_tile(ab_swapped, mma_bn, cta_group) -> tuple[bool, int, int]:
    """Validated (ab_swapped, mma_bn, cta_group); ValueError names the legal values."""
    ab_swapped = _require_bool("ab_swapped", ab_swapped)
    mma_bn = require_int("mma_bn", mma_bn, 1)
    cta_group = require_int("cta_group", cta_group, 1)
    if cta_group not in CTA_GROUPS:
        raise ValueError(f"cta_group must be one of {CTA_GROUPS}, got {cta_group}")
    if mma_bn not in LEGAL_MMA_BN[cta_group]:
        raise ValueError(f"mma_bn={mma_bn} is illegal with cta_group={cta_group}; legal: "
                         f"{LEGAL_MMA_BN[cta_group]} (mma_bn < 64 needs cta_group=1)")
    if cta_group == 2 and not ab_swapped:
        raise ValueError("cta_group=2 requires ab_swapped=True (the CTA pair splits weight rows)")
    return ab_swapped, mma_bn, cta_group


def num_accum_pipeline_stages(mma_bn: int) -> int:
    """Accumulator (TMEM) stages: 2 while two mma_bn-wide accumulators fit, else 1."""
    return 1 if mma_bn > TMEM_STAGE_MMA_BN_MAX else 2


@dataclass(frozen=True)
class PipelineSmemTerms:
    """The terms of the stages=auto formula, in bytes (``stages = budget // per_stage``)."""

    smem_per_sm: int
    c_tile_bytes: int      # one bf16 output tile (double-buffered in ``fixed``)
    accum_stages: int
    fixed: int             # everything outside the input pipeline
    budget: int            # smem_per_sm - fixed
    a_tile: int            # 128-row operand tile, one 128-byte K slice
    b_tile: int            # mma_bn / cta_group rows per CTA, one 128-byte K slice
    sfa: int               # A scale atoms
    sfb: int               # B scale atoms
    stage_barriers: int
    per_stage: int         # a_tile + b_tile + sfa + sfb + stage_barriers

    @property
    def stages(self) -> int:
        return self.budget // self.per_stage if self.budget > 0 else 0


def pipeline_smem_terms(*, mma_bn, cta_group, ab_swapped, num_sf_k_tiles,
                        smem_per_sm=B200_SMEM_PER_SM) -> PipelineSmemTerms:
    """Shared-memory terms of one config, exactly as the spec's stages=auto formula counts them."""
    ab_swapped, mma_bn, cta_group = check_mma_tile(ab_swapped, mma_bn, cta_group)
    num_sf_k_tiles = require_int("num_sf_k_tiles", num_sf_k_tiles, 1)
    smem_per_sm = require_int("smem_per_sm", smem_per_sm, 1)
    c_cols = min(SWAPPED_C_TILE_MAX_COLS, mma_bn) if ab_swapped else UNSWAPPED_C_TILE_COLS
    c_tile_bytes = OUTPUT_BYTES * TILE_ROWS * c_cols
    accum_stages = num_accum_pipeline_stages(mma_bn)
    fixed = (SMEM_RESERVED_BYTES + NUM_OUTPUT_STAGES * c_tile_bytes + FIXED_BOOKKEEPING_BYTES
             + FIXED_SCHEDULER_BYTES + ACCUM_STAGE_BARRIER_BYTES * accum_stages)
    a_tile = TILE_ROWS * K_TILE_BYTES
    b_tile = (mma_bn // cta_group) * K_TILE_BYTES
    sfa = num_sf_k_tiles * SF_ATOM_BYTES
    sfb = num_sf_k_tiles * -(-mma_bn // SF_ATOM_ROWS) * SF_ATOM_BYTES
    return PipelineSmemTerms(
        smem_per_sm=smem_per_sm, c_tile_bytes=c_tile_bytes, accum_stages=accum_stages,
        fixed=fixed, budget=smem_per_sm - fixed, a_tile=a_tile, b_tile=b_tile, sfa=sfa, sfb=sfb,
        stage_barriers=STAGE_BARRIER_BYTES,
        per_stage=a_tile + b_tile + sfa + sfb + STAGE_BARRIER_BYTES)


def auto_pipeline_stages(*, mma_bn, cta_group, ab_swapped, num_sf_k_tiles,
                         smem_per_sm=B200_SMEM_PER_SM) -> int:
    """The deepest input pipeline that fits ``smem_per_sm``; ValueError if not one stage fits."""
    terms = pipeline_smem_terms(mma_bn=mma_bn, cta_group=cta_group, ab_swapped=ab_swapped,
                                num_sf_k_tiles=num_sf_k_tiles, smem_per_sm=smem_per_sm)
    if terms.stages < 1:
        raise ValueError(
            f"smem_per_sm={terms.smem_per_sm} is too small for one pipeline stage of mma_bn="
            f"{mma_bn}, cta_group={cta_group}: budget {terms.budget} B after {terms.fixed} B "
            f"fixed, one stage needs {terms.per_stage} B")
    return terms.stages


def check_config(*, ab_swapped, mma_bn, cta_group, num_pipeline_stages, num_sf_k_tiles,
                 smem_per_sm=B200_SMEM_PER_SM) -> int:
    """Validate a knob set; return the resolved stage count (``AUTO_STAGES`` -> the auto maximum).

    ValueError for an illegal (ab_swapped, mma_bn, cta_group), a stage count that is neither
    positive nor ``AUTO_STAGES``, or more stages than fit in ``smem_per_sm``.
    """
    if isinstance(num_pipeline_stages, (bool, np.bool_)) or not isinstance(
            num_pipeline_stages, (int, np.integer)):
        raise TypeError(f"num_pipeline_stages must be an int, got "
                        f"{type(num_pipeline_stages).__name__} {num_pipeline_stages!r}")
    if num_pipeline_stages < 1 and num_pipeline_stages != AUTO_STAGES:
        raise ValueError(f"num_pipeline_stages must be a positive int or {AUTO_STAGES} (auto), "
                         f"got {num_pipeline_stages}")
    max_stages = auto_pipeline_stages(mma_bn=mma_bn, cta_group=cta_group, ab_swapped=ab_swapped,
                                      num_sf_k_tiles=num_sf_k_tiles, smem_per_sm=smem_per_sm)
    if num_pipeline_stages == AUTO_STAGES:
        return max_stages
    if num_pipeline_stages > max_stages:
        raise ValueError(
            f"num_pipeline_stages={num_pipeline_stages} exceeds the auto maximum {max_stages} for "
            f"mma_bn={mma_bn}, cta_group={cta_group}, ab_swapped={ab_swapped}, "
            f"num_sf_k_tiles={num_sf_k_tiles}, smem_per_sm={smem_per_sm}")
    return int(num_pipeline_stages)


def _pair_mma_kind(a_format: str, b_format: str) -> str:
    return SUPPORTED_FORMAT_PAIRS[(a_format, b_format)][0]


def k_tile_elements_for_kind(mma_kind: str) -> int:
    return K_TILE_BYTES * 8 // _SMEM_ELEMENT_BITS[mma_kind]


def sf_k_tiles_per_stage(a_format: str, b_format: str) -> int:
    """Scale atoms per K slice: K-slice elements / (block size x 4 scale columns per atom)."""
    block = get_format(a_format).block_size   # both operands of a supported pair share it
    return k_tile_elements_for_kind(_pair_mma_kind(a_format, b_format)) // (block * SF_ATOM_K)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """One dispatch decision: knobs, derived SM100 fields, inputs, and the rule that fired.

    Constructing one validates it (``check_config``); derived fields are computed, not passed.
    """

    a_format: str
    b_format: str
    ab_swapped: bool
    mma_bn: int
    cta_group: int
    num_pipeline_stages: int
    stages_source: str      # "tuned" | "decode-default" | "auto" | "override"
    regime: str             # "decode" | "small_prefill" | "large_prefill" | "default" | "override"
    rule: str               # "override" | "kimi" | "regime" | "default"
    n: int
    k: int
    num_active_experts: int
    estimated_total_m: int
    smem_per_sm: int
    fuse_swiglu: bool = False
    # Why these stages, in words (set by the dispatch that decided).
    stages_reason: str = dataclasses.field(default="", compare=False, repr=False)
    # Derived.
    mma_kind: str = dataclasses.field(init=False)
    mma_shape: tuple[int, int, int] = dataclasses.field(init=False)
    cluster_shape: tuple[int, int, int] = dataclasses.field(init=False)
    num_accum_pipeline_stages: int = dataclasses.field(init=False)
    num_sf_k_tiles: int = dataclasses.field(init=False)
    k_tile_elements: int = dataclasses.field(init=False)
    max_pipeline_stages: int = dataclasses.field(init=False)

    def __post_init__(self):
        a_format, b_format = _format_pair(self.a_format, self.b_format)
        for name, value, allowed in (("regime", self.regime, REGIMES), ("rule", self.rule, RULES),
                                     ("stages_source", self.stages_source, STAGES_SOURCES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        mma_kind = _pair_mma_kind(a_format, b_format)
        num_sf_k_tiles = sf_k_tiles_per_stage(a_format, b_format)
        if self.num_pipeline_stages == AUTO_STAGES:
            raise ValueError("a KernelConfig holds resolved stages, not AUTO_STAGES")
        stages = check_config(ab_swapped=self.ab_swapped, mma_bn=self.mma_bn,
                              cta_group=self.cta_group,
                              num_pipeline_stages=self.num_pipeline_stages,
                              num_sf_k_tiles=num_sf_k_tiles, smem_per_sm=self.smem_per_sm)
        derived = dict(
            a_format=a_format, b_format=b_format, num_pipeline_stages=stages,
            mma_kind=mma_kind,
            mma_shape=(TILE_ROWS * self.cta_group, self.mma_bn, UMMA_K),
            cluster_shape=(self.cta_group, 1, 1),
            num_accum_pipeline_stages=num_accum_pipeline_stages(self.mma_bn),
            num_sf_k_tiles=num_sf_k_tiles,
            k_tile_elements=k_tile_elements_for_kind(mma_kind),
            max_pipeline_stages=auto_pipeline_stages(
                mma_bn=self.mma_bn, cta_group=self.cta_group, ab_swapped=self.ab_swapped,
                num_sf_k_tiles=num_sf_k_tiles, smem_per_sm=self.smem_per_sm),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def smem_terms(self) -> PipelineSmemTerms:
        return pipeline_smem_terms(mma_bn=self.mma_bn, cta_group=self.cta_group,
                                   ab_swapped=self.ab_swapped, num_sf_k_tiles=self.num_sf_k_tiles,
                                   smem_per_sm=self.smem_per_sm)

    def explain(self) -> str:
        """Which rule fired and why, which stage rule fired, in words."""
        knobs = (f"AB_swapped={self.ab_swapped}, mma_bn={self.mma_bn}, "
                 f"cta_group={self.cta_group}")
        head = (f"{self.a_format} x {self.b_format} (kind::{self.mma_kind}), N={self.n}, "
                f"K={self.k}, {self.num_active_experts} group slots, "
                f"estimated_total_m={self.estimated_total_m}, smem_per_sm={self.smem_per_sm}.")
        if self.rule == RULE_OVERRIDE:
            rule = (f"Rule: override=True -> the caller's knobs as given ({knobs}), checked for "
                    "legality; no regime, tuned table or Kimi rule consulted.")
        elif self.rule == RULE_KIMI:
            m, slots = self.estimated_total_m, self.num_active_experts
            cmp = "<=" if m <= slots * DECODE_AVG_M else ">"
            rule = (f"Rule: Kimi K2.5 rule, (N, K) == KIMI_SHAPE {KIMI_SHAPE} (grid-starved: "
                    f"{self.n // TILE_ROWS} weight tiles per expert) -> "
                    f"cta_group={KIMI_CTA_GROUP}, AB_swapped=True, {KIMI_STAGES} stages; "
                    f"mma_bn={self.mma_bn} since "
                    f"estimated_total_m={m} {cmp} {slots} slots x {DECODE_AVG_M} = "
                    f"{slots * DECODE_AVG_M}. Regime by avg_m: "
                    f"{regime_comparison(m, slots)}.")
        elif self.rule == RULE_REGIME:
            rule = (f"Rule: regime table, "
                    f"{regime_comparison(self.estimated_total_m, self.num_active_experts)} "
                    f"-> {knobs}.")
        else:
            rule = (f"Rule: default config of the dtype routing for {self.a_format} x "
                    f"{self.b_format} -> {knobs}; no regime dispatch for this pair.")
        stages = (f"Stages: {self.num_pipeline_stages} ({self.stages_source}): "
                  f"{self.stages_reason} Auto maximum for this config and budget: "
                  f"{self.max_pipeline_stages}.")
        return "\n".join((head, rule, stages))


# ---------------------------------------------------------------------------------------------
def _validated_problem(pair, n, k, num_active_experts, estimated_total_m, smem_per_sm) -> dict:
    n = require_int("n", n, 1)
    k = require_int("k", k, 1)
    _check_k(k, pair)
    return dict(
        a_format=pair[0], b_format=pair[1], n=n, k=k,
        num_active_experts=require_int("num_active_experts", num_active_experts, 1),
        estimated_total_m=require_int("estimated_total_m", estimated_total_m, 0),
        smem_per_sm=require_int("smem_per_sm", smem_per_sm, 1))


def _auto_reason(problem, knobs, why: str) -> str:
    terms = pipeline_smem_terms(mma_bn=knobs[1], cta_group=knobs[2], ab_swapped=knobs[0],
                                num_sf_k_tiles=sf_k_tiles_per_stage(problem["a_format"],
                                                               problem["b_format"]),
                                smem_per_sm=problem["smem_per_sm"])
    return (f"{why} -> auto: budget {terms.budget} B // {terms.per_stage} B per stage "
            f"= {terms.stages}.")


def _auto_stages(problem, knobs) -> int:
    return auto_pipeline_stages(
        mma_bn=knobs[1], cta_group=knobs[2], ab_swapped=knobs[0],
        num_sf_k_tiles=sf_k_tiles_per_stage(problem["a_format"], problem["b_format"]),
        smem_per_sm=problem["smem_per_sm"])


def _fixed_stages(problem, knobs, stages: int, what: str) -> int:
    """A tuned/default stage count; ValueError (not a silent cap) if it does not fit the budget."""
    max_stages = _auto_stages(problem, knobs)
    if stages > max_stages:
        raise ValueError(
            f"{what} ({stages} stages, tuned on B200) does not fit smem_per_sm="
            f"{problem['smem_per_sm']}: at most {max_stages} stages for AB_swapped={knobs[0]}, "
            f"mma_bn={knobs[1]}, cta_group={knobs[2]}")
    return stages


def _make_config(problem, knobs, *, stages, stages_source, stages_reason, regime, rule,
                 fuse_swiglu=False) -> KernelConfig:
    ab_swapped, mma_bn, cta_group = knobs
    return KernelConfig(ab_swapped=ab_swapped, mma_bn=mma_bn, cta_group=cta_group,
                        num_pipeline_stages=stages, stages_source=stages_source,
                        stages_reason=stages_reason, regime=regime, rule=rule,
                        fuse_swiglu=fuse_swiglu, **problem)


def _nvfp4_tuned_row(n: int, k: int, regime: str) -> TunedStagesRow | None:
    bound = REGIME_AVG_M_BOUND[regime]
    for row in NVFP4_TUNED_STAGES:
        if (row.n, row.k, row.regime_avg_m) == (n, k, bound):
            return row
    return None


def grouped_matmul_nvfp4_dispatch(*, n, k, num_active_experts, estimated_total_m, override=False,
                                  ab_swapped=True, mma_bn=8, cta_group=1, num_pipeline_stages=-1,
                                  smem_per_sm=B200_SMEM_PER_SM) -> KernelConfig:
    """NVFP4 x NVFP4 config. ``override=False`` ignores the four knobs (Kimi rule, regime table,
    tuned stages); ``override=True`` uses them as given, stages auto when not > 0 (-1)."""
    override = _require_bool("override", override)
    problem = _validated_problem(("nvfp4", "nvfp4"), n, k, num_active_experts, estimated_total_m,
                                 smem_per_sm)
    n, k = problem["n"], problem["k"]
    m, slots = problem["estimated_total_m"], problem["num_active_experts"]

    if override:
        knobs = check_mma_tile(ab_swapped, mma_bn, cta_group)
        stages = check_config(ab_swapped=knobs[0], mma_bn=knobs[1], cta_group=knobs[2],
                              num_pipeline_stages=num_pipeline_stages,
                              num_sf_k_tiles=sf_k_tiles_per_stage("nvfp4", "nvfp4"),
                              smem_per_sm=problem["smem_per_sm"])
        if num_pipeline_stages == AUTO_STAGES:
            reason = _auto_reason(problem, knobs, f"caller's num_pipeline_stages={AUTO_STAGES}")
        else:
            reason = f"the caller's num_pipeline_stages={stages}."
        return _make_config(problem, knobs, stages=stages, stages_source=STAGES_OVERRIDE,
                            stages_reason=reason, regime=REGIME_OVERRIDE, rule=RULE_OVERRIDE)

    regime = classify_regime(m, slots)
    if (n, k) == KIMI_SHAPE:
        mma_bn_kimi = KIMI_DECODE_MMA_BN if m <= slots * DECODE_AVG_M else KIMI_PREFILL_MMA_BN
        knobs = (True, mma_bn_kimi, KIMI_CTA_GROUP)
        stages = _fixed_stages(problem, knobs, KIMI_STAGES, "the Kimi rule's stage count")
        return _make_config(problem, knobs, stages=stages, stages_source=STAGES_TUNED,
                            stages_reason=f"the Kimi rule fixes {KIMI_STAGES} stages in every "
                                          "regime.",
                            regime=regime, rule=RULE_KIMI)

    knobs = REGIME_CONFIGS[regime]
    if regime == REGIME_DECODE:
        stages = _fixed_stages(problem, knobs, DECODE_DEFAULT_STAGES, "DECODE_DEFAULT_STAGES")
        source = STAGES_DECODE_DEFAULT
        reason = (f"decode regime -> DECODE_DEFAULT_STAGES = {DECODE_DEFAULT_STAGES} for every "
                  "shape (measured minimum on B200).")
    elif (row := _nvfp4_tuned_row(n, k, regime)) is not None:
        stages = _fixed_stages(problem, knobs, row.stages, f"NVFP4_TUNED_STAGES row {tuple(row)}")
        source = STAGES_TUNED
        reason = f"NVFP4_TUNED_STAGES row (N, K, regime avg_m bound, stages) = {tuple(row)}."
    else:
        stages = _auto_stages(problem, knobs)
        source = STAGES_AUTO
        reason = _auto_reason(problem, knobs,
                              f"no NVFP4_TUNED_STAGES row for (N={n}, K={k}, {regime})")
    return _make_config(problem, knobs, stages=stages, stages_source=source,
                        stages_reason=reason, regime=regime, rule=RULE_REGIME)


def grouped_matmul_mxfp8_dispatch(*, n, k, num_active_experts, estimated_total_m,
                                  fuse_swiglu=False, smem_per_sm=B200_SMEM_PER_SM,
                                  b_format="mxfp8") -> KernelConfig:
    """MXFP8 (E4M3) activations x ``b_format`` weights ("mxfp8", or "mxfp4" for W4A8): the regime
    table, stages auto except the tuned decode rows (not with a fused SwiGLU epilogue)."""
    fuse_swiglu = _require_bool("fuse_swiglu", fuse_swiglu)
    pair = _format_pair("mxfp8", b_format)
    problem = _validated_problem(pair, n, k, num_active_experts, estimated_total_m, smem_per_sm)
    n, k = problem["n"], problem["k"]
    regime = classify_regime(problem["estimated_total_m"], problem["num_active_experts"])
    knobs = REGIME_CONFIGS[regime]
    row = next((r for r in MXFP8_TUNED_DECODE_STAGES if (r.n, r.k) == (n, k)), None)

    if regime == REGIME_DECODE and row is not None and not fuse_swiglu:
        stages = _fixed_stages(problem, knobs, row.stages,
                               f"MXFP8_TUNED_DECODE_STAGES row {tuple(row)}")
        source = STAGES_TUNED
        reason = (f"decode regime, no fused SwiGLU, MXFP8_TUNED_DECODE_STAGES row "
                  f"(N={row.n}, K={row.k}, stages={row.stages}): "
                  f"{row.b200_gain_vs_auto_pct} % faster than auto on B200.")
    else:
        if regime != REGIME_DECODE:
            why = f"MXFP8 tunes decode only, this is {regime}"
        elif row is None:
            why = f"no MXFP8_TUNED_DECODE_STAGES row for (N={n}, K={k})"
        else:
            why = "a fused SwiGLU epilogue excludes the tuned decode row"
        stages = _auto_stages(problem, knobs)
        source = STAGES_AUTO
        reason = _auto_reason(problem, knobs, why)
    return _make_config(problem, knobs, stages=stages, stages_source=source,
                        stages_reason=reason, regime=regime, rule=RULE_REGIME,
                        fuse_swiglu=fuse_swiglu)


def grouped_matmul_block_scaled_sm100_dispatch(*, a_format, b_format, n, k, num_active_experts,
                                               estimated_total_m,
                                               smem_per_sm=B200_SMEM_PER_SM) -> KernelConfig:
    """Route by operand formats (A = activations, B = weights), per the spec's dtype table."""
    pair = _format_pair(a_format, b_format)
    route = SUPPORTED_FORMAT_PAIRS[pair][1]
    common = dict(n=n, k=k, num_active_experts=num_active_experts,
                  estimated_total_m=estimated_total_m, smem_per_sm=smem_per_sm)
    if route == _ROUTE_NVFP4:
        return grouped_matmul_nvfp4_dispatch(**common)
    if route == _ROUTE_MXFP8:
        return grouped_matmul_mxfp8_dispatch(b_format=pair[1], **common)
    problem = _validated_problem(pair, **common)
    stages = _auto_stages(problem, DEFAULT_CONFIG)
    reason = _auto_reason(problem, DEFAULT_CONFIG, "the default config always uses auto stages")
    return _make_config(problem, DEFAULT_CONFIG, stages=stages, stages_source=STAGES_AUTO,
                        stages_reason=reason, regime=REGIME_DEFAULT, rule=RULE_DEFAULT)


# (A, B) format pairs the SM100 routing has no entry for -> the pair whose decision gbs's own kernels take.
ROUTE_AS = {
    # Upstream's routing has no E5M2 entry (an error there). Tiles, stages and scales do not depend on the FP8
    # flavour, so E5M2 takes E4M3's decision.
    ("mxfp8_e5m2", "mxfp8_e5m2"): ("mxfp8", "mxfp8"),
    # W4A16: tcgen05 has no bf16 x FP4 kind, so the tables have no bf16-token row. W4A16 takes W4A8's decision:
    # the same FP4 weights, read in the same K slices (NVFP4 weights too: the tile is what it decides).
    ("bf16", "mxfp4"): ("mxfp8", "mxfp4"),
    ("bf16", "nvfp4"): ("mxfp8", "mxfp4"),
}


def route_formats(a_name: str, b_name: str) -> tuple[str, str]:
    """The (A, B) format names whose SM100 route decides for ``a_name`` x ``b_name``: the pair itself, or the one
    ``ROUTE_AS`` maps it to (E5M2 takes E4M3's, W4A16 W4A8's)."""
    return ROUTE_AS.get((a_name, b_name), (a_name, b_name))


def dispatch_for(problem) -> KernelConfig:
    """The SM100 decision for a problem (a ``GroupedProblem``, a device problem, or anything with its host
    metadata: ``a_format``, ``b_format``, ``n``, ``k``, ``num_active_experts``, ``estimated_total_m``); MXFP8 E5M2
    and W4A16 problems take the decision of the pair ``route_formats`` names (MXFP8 E4M3's, W4A8's)."""
    a_format, b_format = route_formats(problem.a_format.name, problem.b_format.name)
    return grouped_matmul_block_scaled_sm100_dispatch(
        a_format=a_format, b_format=b_format, n=problem.n, k=problem.k,
        num_active_experts=problem.num_active_experts, estimated_total_m=problem.estimated_total_m)
