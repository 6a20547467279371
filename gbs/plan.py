"""The H200 plan: one frozen answer to "what runs this problem on an H200, with which knobs, split and grid".

``plan_h200(problem, config=None, backend="auto", **constraints)`` turns a problem's host metadata (formats,
layouts, N, K, slot count, token estimate and, where it is on the host, the routing) and either the SM100 decision
(``gbs.dispatch``, the default), a caller's ``KernelConfig``, or a caller's constraints on single knobs into an
``H200Plan``: the kernel, its build (``StreamSpec`` / ``WgmmaSpec``: formats, layouts, tile, stages, warps), the
split-K runs per tile and the persistent grid. ``plan.describe()`` is what the demo and CLI print, ``plan.explain()``
lists each rule that fired with the evidence behind its threshold (``data/h200_evidence.csv``, ``gbs.evidence``).
``gbs.grouped_matmul`` and ``gbs.interop.prepare`` launch exactly this plan (``h200_launch.prepare``): the kernels
receive it resolved and never plan. The planner asks the kernels only pure questions: which stage counts fit their
shared memory (``h200_launch.max_pipeline_stages``), how many registers a build takes (a compile, on an sm_90 GPU),
how many CTAs an SM then holds.

The rules (design: ``docs/design/h200_port.md``):

* Kernel. ``"auto"`` runs the wgmma kernel for prefill where the decision is the dispatch's (``prefers``): from
  ``SWAPPED_MIN_TOKENS_PER_EXPERT`` tokens per expert for FP4 x FP4 (its swapped tiles), from
  ``WGMMA_MIN_TOKENS_PER_EXPERT`` otherwise, and for FP8 tokens from ``SWAPPED_MIN_TOKENS_PER_EXPERT`` where their
  swapped tiles split into runs. Everything else, and every caller's config, runs the streaming kernel.
* Streaming kernel (``stream_knobs``): up to ``SMALL_N_MAX_TOKENS`` tokens per expert the token tile is cut to the
  tokens (8, 16 or 32 columns, one CTA per tile, ``SMALL_N_STAGES`` stages), on 8 consumer warps where FP4 tokens
  are latency-bound; wider problems keep the SM100 decision's tile on the deepest ring. A caller's config keeps its
  tile, its stages capped at what fits. Split-K (``stream_k_splits``) where the tiles do not fill the resident CTAs.
* wgmma kernel (``wgmma_knobs``): the measured tile width per format pair, 256-token tiles where their cheaper rows
  outweigh the padding, swapped tiles where cheaper (FP4 x FP4) or where FP8 tokens' swapped tiles split; few
  swapped tiles in split-K runs (``swapped_k_splits``).
* Launch (``pdl``): a programmatic dependent launch only where the caller asks (measured no faster: evidence
  pdl-ab): the kernel may then start while the kernel before it in the stream runs, and waits for it before its
  first global access (``h200_ring``'s docstring).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .dispatch import AUTO_STAGES, KernelConfig, dispatch_for, require_int, route_formats
from .formats import get_format
from .layouts import LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E4M3_FOLDED, LAYOUT_PACKED
from .numba_kernels import h200_launch as hl
from .numba_kernels.h200_ring import CONSUMER_WARPS_SMALL_N, TILE_M_ROWS, StreamSpec, k_slice_elements
from .numba_kernels.h200_wgmma import (DIAGNOSTIC_NO_MMA, DIAGNOSTIC_NO_PROMOTION, E4M3_ROW_BYTES, FOLDED_WIDE_MMA_BN,
                                       FP8_MMA_BN, FP8_ROUTE_FORMATS, SWAPPED_MMA_BN, TILE_TOKENS, TWO_M_TILES_MMA_BN,
                                       WgmmaSpec)
from .problem import GroupedProblem, layout_of, problem_format_name
from .schedule import check_num_ctas

KERNELS = ("h200_stream", "h200_wgmma")
H200_SM_COUNT = 132   # the H200's SMs: what the estimates below plan for (a launch reads the device's)

# Streaming kernel, small-N mapping (evidence: smalln-tiles, smalln-stages, smalln-eight-warps).
SMALL_N_MAX_TOKENS = 32
SMALL_N_MMA_BN = (8, 16, 32)     # token tile widths the small-N mapping chooses from
SMALL_N_STAGES = 2               # shallow rings: 3 CTAs per SM hide the decode's latency better than depth
EIGHT_WARP_MMA_BN = 32           # the small-N width that runs on 8 warps whatever the tile count
# Streaming split-K: runs shorter than this are mostly pipeline fill and epilogue (evidence: stream-split-k).
STREAM_MIN_SLICES_PER_SPLIT = 6

# wgmma kernel (evidence: wgmma-min-tokens, swapped-tiles, swapped-split-k, fp8-swapped-tiles, wgmma-tile-width,
# two-m-tiles, ragged-tile-count).
WGMMA_MIN_TOKENS_PER_EXPERT = SMALL_N_MAX_TOKENS + 1
SWAPPED_MIN_TOKENS_PER_EXPERT = 17
SWAPPED_ROW_COST = {32: 2.19, 64: 1.32}   # per token x weight row, relative to the 128-token tile's
SWAPPED_MIN_SLICES_PER_SPLIT = 2
SWAPPED_SPLIT_MIN_K_SLICES = 12
FP8_TOKENS_SWAPPED_FORMATS = ("mxfp8", "mxfp8_e5m2", "w4a8")
FP8_TOKENS_SWAPPED_MIN_RUNS = 2
WGMMA_MMA_BN_FP4 = 128
WGMMA_MMA_BN_FP8 = 256
# W4A16 (bf16 tokens) above SMALL_N_MAX_TOKENS per expert: the wgmma kernel's bf16-token consumer on this tile, as
# measured (evidence: w4a16-tiles)
W4A16_MMA_BN = 128
W4A16_TILE_TOKENS = 128
TWO_M_TILES_ROW_COST = {("mxfp4", "mxfp4"): 0.93, ("mxfp8", "mxfp8"): 0.96, ("nvfp4", "nvfp4"): 0.93}

# The layout FP4 weights are re-laid into for the H200 kernels (evidence: fused-weight-layout).
H200_WEIGHT_LAYOUTS = {"nvfp4": LAYOUT_E2M1_H200_FUSED, "mxfp4": LAYOUT_E2M1_H200_FUSED}


@dataclass(frozen=True)
class Rule:
    """One rule that fired while planning: what it decided and the evidence id behind its threshold (None where
    the rule is a fact of the design, e.g. what fits in shared memory, or the SM100 dispatch's)."""

    name: str
    decided: str
    evidence: str | None = None


@dataclass(frozen=True)
class H200Plan:
    """Everything a launch on the H200 needs, resolved: ``h200_launch.prepare`` runs it as it is."""

    kernel: str                        # one of KERNELS
    spec: StreamSpec | WgmmaSpec       # the build: formats, layouts, tile, stages, warps, split-K epilogue
    k_splits: int                      # split-K runs per tile (1: none)
    slices_per_split: int              # K slices per run
    num_ctas: int                      # persistent grid (0: no tokens, nothing to launch)
    max_tiles: int                     # bound of the tile walk's length, from shapes
    registers: int | None              # per thread of the build; None: not compiled (no sm_90 GPU here)
    sm_count: int                      # SMs the grid was sized for
    rules: tuple[Rule, ...]
    pdl: bool = False                  # programmatic dependent launch (launch.PreparedLaunch)

    @property
    def ring(self) -> StreamSpec:
        """The TMA ring's spec (the wgmma kernel runs the streaming kernel's ring)."""
        return hl.ring_of(self.spec)

    def describe(self) -> str:
        """One line: the kernel, its knobs, the split and the grid."""
        s = self.spec
        orientation = "swapped" if s.ab_swapped else "not swapped"
        if isinstance(s, StreamSpec):
            knobs = f"bn{s.mma_bn} cg{s.cta_group} {s.stages} stages"
            if s.small_n and s.small_n_warps != CONSUMER_WARPS_SMALL_N:
                knobs += f", {s.small_n_warps} consumer warps"
        else:
            knobs = f"bn{s.mma_bn}, {s.tile_tokens}-token tiles" if not s.ab_swapped else f"bn{s.mma_bn}"
            knobs += f", {s.stages} stages" + (", FP8 route" if s.fp8 else "")
            knobs += ", CTA pairs" if s.cta_group > 1 else ""
        split = f"{self.k_splits} split-K runs of {self.slices_per_split} slices" if self.k_splits > 1 else "whole K"
        grid = f"{self.num_ctas} CTAs" + ("" if self.registers is not None else " (estimated: no sm_90 GPU to compile)")
        return f"{self.kernel} {orientation} {knobs}; {split}; {grid}" + ("; programmatic dependent launch" if self.pdl
                                                                         else "")

    def explain(self) -> str:
        """The rules that fired, in order, each with its evidence (id, claim and numbers from the evidence table)."""
        from . import evidence

        lines = [self.describe()]
        for rule in self.rules:
            lines.append(f"- {rule.name}: {rule.decided}")
            if rule.evidence:
                lines.append(f"    evidence {rule.evidence}: {evidence.summary(rule.evidence)}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Host metadata
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProblemMeta:
    """A problem's host metadata alone (no arrays): what the plan needs to decide, e.g. for a shape on the CLI."""

    a_format: object                   # gbs.formats.BlockFormat
    b_format: object
    n: int
    k: int
    num_active_experts: int
    estimated_total_m: int
    total_tokens: int
    a_layout: str = LAYOUT_PACKED
    b_layout: str = LAYOUT_PACKED

    @classmethod
    def of(cls, fmt: str, n: int, k: int, experts: int, tokens_per_expert: int, *, relaid: bool = True,
           fp8_route: bool = False, folded: bool = False):
        """``experts`` groups of ``tokens_per_expert`` tokens in format ``fmt`` (``gbs.problem.PROBLEM_FORMATS``);
        ``relaid``: FP4 weights in ``h200_weight_layout``'s layout and FP4 tokens in the H200 word order;
        ``fp8_route``: MXFP4 operands in the FP8 route's layout instead (``LAYOUT_E2M1_E4M3``; plan with
        ``fp8=True``); ``folded``: an MXFP4 or W4A8 problem as ``gbs.fp8_route.fold_problem`` leaves it (MXFP8
        operands, the weights in ``LAYOUT_E4M3_FOLDED``, MXFP4 tokens too)."""
        from .problem import resolve_formats

        a_format, b_format = resolve_formats(fmt)
        total = experts * tokens_per_expert
        layouts = {}
        if folded:
            if fmt not in ("mxfp4", "w4a8") or fp8_route:
                raise ValueError(f"folded: MXFP4 or W4A8 problems as fold_problem leaves them (not with fp8_route), "
                                 f"got {fmt!r}, fp8_route={fp8_route}")
            mxfp8 = get_format("mxfp8")
            layouts = dict(b_layout=LAYOUT_E4M3_FOLDED,
                           a_layout=LAYOUT_E4M3_FOLDED if a_format.packed else LAYOUT_PACKED)
            a_format, b_format = mxfp8, mxfp8
        elif fp8_route:
            layouts = dict(b_layout=LAYOUT_E2M1_E4M3, a_layout=LAYOUT_E2M1_E4M3 if a_format.packed else LAYOUT_PACKED)
        elif relaid:
            layouts = dict(b_layout=h200_weight_layout(b_format),
                           a_layout=LAYOUT_E2M1_H200 if a_format.packed else LAYOUT_PACKED)
        return cls(a_format, b_format, n, k, experts, total, total, **layouts)


def average_tokens_per_expert(problem) -> int:
    """Tokens per active slot, rounded up, from ``estimated_total_m`` (host metadata only)."""
    return -(-problem.estimated_total_m // max(problem.num_active_experts, 1))


def _formats(problem) -> tuple[str, str]:
    return get_format(problem.a_format).name, get_format(problem.b_format).name


def _both_fp4(problem) -> bool:
    return problem.a_format.packed and problem.b_format.packed


def _k_slices(problem) -> int:
    return hl.k_slices_of(problem.k, k_slice_elements(problem.a_format, problem.b_format))


def tile_token_rows(problem, tile_tokens: int) -> int:
    """Token rows the tiles of ``tile_tokens`` cover, each group's last tile padded: each live group's own size
    where the routing is on the host (a ``GroupedProblem``, or the copies a validated device problem keeps,
    ``host_routing``), else ``num_active_experts`` groups of the average size (evidence: ragged-tile-count)."""
    routing = getattr(problem, "host_routing", None)   # device problems: present only once validated
    offsets, expert_ids = ((routing["a_offsets"], routing["expert_ids"]) if routing else
                           (getattr(problem, "a_offsets", None), getattr(problem, "expert_ids", None)))
    if isinstance(offsets, np.ndarray) and isinstance(expert_ids, np.ndarray):
        sizes = np.diff(offsets.astype(np.int64))[expert_ids >= 0]
        return int((-(-sizes // tile_tokens)).sum()) * tile_tokens
    return problem.num_active_experts * -(-average_tokens_per_expert(problem) // tile_tokens) * tile_tokens


def estimated_tiles(problem, tile_tokens: int, weight_rows: int) -> int:
    """Tiles of ``tile_tokens`` x ``weight_rows`` the walk visits (``tile_token_rows``)."""
    return tile_token_rows(problem, tile_tokens) // tile_tokens * -(-problem.n // weight_rows)


def estimated_small_n_tiles(problem) -> int:
    """Weight-row tiles of a swapped small-N streaming plan (one token tile per expert)."""
    return problem.num_active_experts * -(-problem.n // TILE_M_ROWS)


# ----------------------------------------------------------------------------------------------
# Split-K runs
# ----------------------------------------------------------------------------------------------
def stream_k_splits(max_tiles: int, k_slices: int, pair_slots: int) -> tuple[int, int]:
    """(k_splits, slices_per_split) of the streaming kernel on ``pair_slots`` resident CTA pairs: no split while the
    tiles fill the slots, else about one run per free slot of at least ``STREAM_MIN_SLICES_PER_SPLIT`` slices."""
    for name, value in (("max_tiles", max_tiles), ("k_slices", k_slices), ("pair_slots", pair_slots)):
        require_int(name, value, 1)
    wanted = max(1, min(pair_slots // max_tiles, k_slices // STREAM_MIN_SLICES_PER_SPLIT))
    return hl.split_runs(k_slices, wanted)


def swapped_k_splits(tiles: int, k_slices: int, resident_ctas: int) -> tuple[int, int]:
    """(k_splits, slices_per_split) for ``tiles`` swapped wgmma tiles on ``resident_ctas`` CTAs: as many runs per
    tile as fit one wave, each at least ``SWAPPED_MIN_SLICES_PER_SPLIT`` slices; no split from a wave of tiles or
    below ``SWAPPED_SPLIT_MIN_K_SLICES`` slices (evidence: swapped-split-k)."""
    for name, value in (("tiles", tiles), ("k_slices", k_slices), ("resident_ctas", resident_ctas)):
        require_int(name, value, 1)
    if k_slices < SWAPPED_SPLIT_MIN_K_SLICES:
        return 1, k_slices
    return hl.split_runs(k_slices, max(1, min(resident_ctas // tiles, k_slices // SWAPPED_MIN_SLICES_PER_SPLIT)))


def swapped_split_plan(problem, mma_bn: int, resident_ctas: int = H200_SM_COUNT) -> tuple[int, int]:
    """``swapped_k_splits`` for ``problem``'s swapped tiles of ``mma_bn`` tokens (host metadata only)."""
    tiles = max(1, estimated_tiles(problem, mma_bn, TILE_M_ROWS))   # 0: every slot -1
    return swapped_k_splits(tiles, _k_slices(problem), resident_ctas)


# ----------------------------------------------------------------------------------------------
# Which kernel
# ----------------------------------------------------------------------------------------------
def fp8_tokens_swapped_bn(problem) -> int | None:
    """For FP8 tokens: the swapped tile width (32 up to 32 tokens per expert, else 64) where its tiles split into
    ``FP8_TOKENS_SWAPPED_MIN_RUNS`` runs or more, else None (evidence: fp8-swapped-tiles)."""
    if problem_format_name(problem.a_format, problem.b_format) not in FP8_TOKENS_SWAPPED_FORMATS:
        return None
    bn = SWAPPED_MMA_BN[0] if average_tokens_per_expert(problem) <= SWAPPED_MMA_BN[0] else SWAPPED_MMA_BN[1]
    return bn if swapped_split_plan(problem, bn)[0] >= FP8_TOKENS_SWAPPED_MIN_RUNS else None


def min_tokens_per_expert(problem) -> int:
    """Average tokens per expert from which ``"auto"`` runs the wgmma kernel: the swapped tiles' for FP4 x FP4, the
    128-token tiles' otherwise."""
    return SWAPPED_MIN_TOKENS_PER_EXPERT if _both_fp4(problem) else WGMMA_MIN_TOKENS_PER_EXPERT


def fp8_route_knobs(problem, mma_bn: int | None = None) -> tuple[dict | None, list[Rule]]:
    """The wgmma kernel's FP8 route (``fp8=True``; in-kernel, ``"auto"`` does not take it, evidence fp8-route-gpu; on
    operands folded ahead it does where the route wins, ``prefers_fp8_route``) for ``problem``: its knobs and rules,
    or None and the rule that falls back to the bf16 route where a host problem has blocks the route's bases cannot
    represent (the bf16 consumer reads the same operands exactly). Device problems are not checked on the host: such
    blocks give NaN outputs. ``mma_bn``: the tile width as asked, or None: ``FOLDED_WIDE_MMA_BN`` on operands folded
    ahead, else ``FP8_MMA_BN`` (``WgmmaSpec`` refuses the wide tile elsewhere)."""
    wide = folded_operands(problem)
    width = mma_bn if mma_bn is not None else FOLDED_WIDE_MMA_BN if wide else FP8_MMA_BN
    knobs = dict(mma_bn=width, ab_swapped=False, tile_tokens=TILE_TOKENS[0], fp8=True)
    if mma_bn is not None:
        why = " (DeepGEMM's sm90 FP8 tile; a factor per 64-column group: it spans two 128-row fold tiles)" \
            if width == FOLDED_WIDE_MMA_BN else ""
        width_rules = [Rule("tile width", f"bn{width} as asked{why}")]
    elif wide:
        width_rules = [Rule("tile width", f"bn{width}: DeepGEMM's sm90 FP8 tile, fewer L2 -> SM bytes and instructions "
                                        f"per FLOP than bn{FP8_MMA_BN} (one chunk set, promoted after each slice's "
                                        f"MMAs while the other warpgroup's run; a factor per 64-column group, as the "
                                        f"tile spans two 128-row fold tiles): 0.87x / 0.90x bn{FP8_MMA_BN}'s time on "
                                        f"large prefill up / down", "fold-n192-ab")]
    else:
        width_rules = []
    if layout_of(problem, "b") == LAYOUT_E4M3_FOLDED:   # folded ahead (WgmmaSpec refuses a pair it cannot run)
        if wide:
            sets = "one chunk set, promoted after each slice's MMAs," if width == FOLDED_WIDE_MMA_BN else \
                "two chunk sets"
            return knobs, [Rule("route", f"FP8 on operands folded ahead ({LAYOUT_E4M3_FOLDED}, "
                                         f"gbs.fp8_route.fold_problem): E4M3 wgmma on both operands straight from the "
                                         f"ring, fp32 promotion per 128 K with one factor per token row; 128 x "
                                         f"{width} tiles ({sets} and the total)", "fp8-fold-gpu")] + width_rules
        return knobs, [Rule("route", f"FP8 on weights folded ahead ({LAYOUT_E4M3_FOLDED}), MXFP8 tokens as quantized "
                                     f"(W4A8): E4M3 wgmma from the ring, fp32 promotion per k32 step with the token "
                                     f"block's scale; 128 x {FP8_MMA_BN} tiles (asked for: slower than the bf16 route on "
                                     f"large prefill up, 1.4 % faster on down)", "w4a8-fold-bench")] + width_rules
    tokens_fp4 = problem.a_format.packed
    want = (LAYOUT_E2M1_E4M3 if tokens_fp4 else LAYOUT_PACKED, LAYOUT_E2M1_E4M3)
    if _formats(problem) not in FP8_ROUTE_FORMATS or (layout_of(problem, "a"), layout_of(problem, "b")) != want:
        raise ValueError(f"fp8=True (the FP8 route) reads MXFP4 weights in {LAYOUT_E2M1_E4M3!r} "
                         f"(GroupedProblem.with_b_layout) with MXFP4 tokens in it too (with_a_layout) or MXFP8 tokens "
                         f"(W4A8) as they are, or a problem folded ahead (gbs.fp8_route.fold_problem); got "
                         f"{_formats(problem)[0]} ({layout_of(problem, 'a')!r}) x {_formats(problem)[1]} "
                         f"({layout_of(problem, 'b')!r})")
    if isinstance(problem, GroupedProblem):
        from .fp8_route import kernel_window_violations

        found = kernel_window_violations(problem)
        if any(found.values()):
            return None, [Rule("route", f"bf16, not the FP8 route asked for: {found['token_blocks']} token and "
                                        f"{found['weight_blocks']} weight blocks lie below the window of their chunk's "
                                        f"base, {found['factors']} promotion factors leave fp32 (the bf16 route is "
                                        "exact for them)", "route-layout-gpu")]
        window = [Rule("window", "every live block folds into its chunk's window (checked on the host)")]
    else:
        window = [Rule("window", "not checked (no host arrays: a device problem or shape metadata): blocks below "
                                 "the window give NaN outputs")]
    interval = "128 K" if tokens_fp4 else "32 K (the MXFP8 tokens' scales)"
    return (knobs,
            [Rule("route", f"FP8 (asked for): MXFP4 decoded to E4M3 with the block scales folded in, E4M3 wgmma, fp32 "
                           f"promotion per {interval}; 128 x "
                           f"{FP8_MMA_BN} tiles (chunk and total accumulators)",
                  "fp8-route-gpu" if tokens_fp4 else "w4a8-fp8-route-gpu")] + width_rules + window)


def pair_rule(pair: int, mma_bn: int) -> Rule:
    """The rule of a CTA pair asked for (``cta_group=2``: its two 128-token tiles share the weight tile, each CTA
    loading half of its rows multicast to both) on the route's tile width."""
    shared = f"cta_group={pair} as asked: a CTA pair's token tiles share the {mma_bn}-row weight tile by multicast"
    if mma_bn == FP8_MMA_BN:
        return Rule("pair", f"{shared}; as fast as one CTA per tile on large prefill up, 10 % slower on down",
                    "fold-pair-pipelined")
    single_kb, pair_kb = ((TILE_M_ROWS + mma_bn // ctas) * E4M3_ROW_BYTES // 1024 for ctas in (1, pair))
    return Rule("pair", f"{shared}, each CTA loading {mma_bn // pair} of its rows: {pair_kb} instead of {single_kb} KB "
                        f"per CTA and 128-K slice from L2; against one CTA per tile 2-4 % faster on both up shapes, 2 % "
                        f"slower on both down shapes, 11 % slower on ragged groups", "fold-pair-n192-ab")


def folded_operands(problem) -> bool:
    """Both operands in ``LAYOUT_E4M3_FOLDED`` (MXFP4 folded ahead into E4M3 with one scale per 128-K chunk)."""
    return (layout_of(problem, "a"), layout_of(problem, "b")) == (LAYOUT_E4M3_FOLDED, LAYOUT_E4M3_FOLDED)


def prefers_fp8_route(problem) -> Rule | None:
    """The rule that runs a folded ``problem`` on the FP8 route under ``"auto"`` (no config, no constraints), or None:
    its 128-token tiles from ``WGMMA_MIN_TOKENS_PER_EXPERT`` tokens per expert, where it beats the bf16 route
    (evidence: fp8-fold-bench); below, the folded operands run as the MXFP8 they are."""
    tokens = average_tokens_per_expert(problem)
    if folded_operands(problem) and tokens >= WGMMA_MIN_TOKENS_PER_EXPERT:
        return Rule("kernel", f"h200_wgmma, FP8 route: operands folded ahead, {tokens} tokens per expert >= "
                             f"{WGMMA_MIN_TOKENS_PER_EXPERT}", "fp8-fold-bench")
    return None


def prefers_wgmma(problem) -> Rule | None:
    """The rule that sends ``problem`` to the wgmma kernel under ``"auto"``, or None (host metadata only)."""
    tokens = average_tokens_per_expert(problem)
    if tokens >= min_tokens_per_expert(problem):
        evidence = "swapped-tiles" if _both_fp4(problem) else "wgmma-min-tokens"
        return Rule("kernel", f"h200_wgmma: {tokens} tokens per expert >= {min_tokens_per_expert(problem)}", evidence)
    if tokens >= SWAPPED_MIN_TOKENS_PER_EXPERT and fp8_tokens_swapped_bn(problem) is not None:
        return Rule("kernel", f"h200_wgmma: FP8 tokens, {tokens} per expert, swapped tiles that split",
                    "fp8-swapped-tiles")
    return None


# ----------------------------------------------------------------------------------------------
# Knobs per kernel
# ----------------------------------------------------------------------------------------------
def estimated_tile_work(problem, tile_tokens: int, mma_bn: int, row_cost: float, split_k: bool = False) -> float:
    """A launch's estimated time in token x weight-row products at the 128-token tile's cost: the tiles in waves of
    ``H200_SM_COUNT`` CTAs (at least one), each ``tile_tokens * mma_bn * row_cost``; with ``split_k`` (swapped
    tiles) each tile's work shared by its ``swapped_split_plan`` runs."""
    tiles = estimated_tiles(problem, tile_tokens, mma_bn)
    runs = swapped_split_plan(problem, tile_tokens)[0] if split_k else 1
    return max(1.0, tiles * runs / H200_SM_COUNT) * tile_tokens * mma_bn * row_cost / runs


def wgmma_tile_tokens(problem, mma_bn: int) -> int:
    """256 where the format pair has a measured ``TWO_M_TILES_ROW_COST`` and its cheaper rows outweigh the padding
    and the waves (``estimated_tile_work``), else 128 (evidence: two-m-tiles)."""
    row_cost = TWO_M_TILES_ROW_COST.get(_formats(problem))
    if row_cost is None:
        return TILE_TOKENS[0]
    wide = estimated_tile_work(problem, TILE_TOKENS[1], TWO_M_TILES_MMA_BN[0], row_cost)
    return TILE_TOKENS[1] if wide < estimated_tile_work(problem, TILE_TOKENS[0], mma_bn, 1.0) else TILE_TOKENS[0]


def wgmma_knobs(problem) -> tuple[dict, list[Rule]]:
    """The wgmma kernel's knobs for ``problem`` (host metadata only) and the rules that chose them."""
    bn = fp8_tokens_swapped_bn(problem)
    if bn is not None:
        return (dict(mma_bn=bn, ab_swapped=True),
                [Rule("tile", f"swapped bn{bn}: FP8 tokens on few tiles, in split-K runs", "fp8-swapped-tiles")])
    if not get_format(problem.a_format).scaled:
        return (dict(mma_bn=W4A16_MMA_BN, ab_swapped=False, tile_tokens=W4A16_TILE_TOKENS),
                [Rule("tile", f"bf16 tokens: {W4A16_TILE_TOKENS} tokens x bn{W4A16_MMA_BN}, not swapped (the tokens are "
                              "wgmma's A operand in shared memory)", "w4a16-tiles")])
    both_fp4 = _both_fp4(problem)
    mma_bn = WGMMA_MMA_BN_FP4 if both_fp4 else WGMMA_MMA_BN_FP8
    rules = [Rule("tile width", f"bn{mma_bn} ({'FP4 x FP4' if both_fp4 else 'an FP8 operand'})", "wgmma-tile-width")]
    tile_tokens = wgmma_tile_tokens(problem, mma_bn)
    if tile_tokens != TILE_TOKENS[0]:
        mma_bn = TWO_M_TILES_MMA_BN[0]
        rules.append(Rule("token tile", f"{tile_tokens} tokens at bn{mma_bn}: cheaper rows outweigh the padding",
                          "two-m-tiles"))
    if getattr(problem, "host_routing", None) or isinstance(getattr(problem, "a_offsets", None), np.ndarray):
        rules.append(Rule("tile count", "each group's own tiles (routing on the host)", "ragged-tile-count"))
    plain = dict(mma_bn=mma_bn, ab_swapped=False, tile_tokens=tile_tokens)
    if not both_fp4:
        return plain, rules
    row_cost = TWO_M_TILES_ROW_COST.get(_formats(problem), 1.0) if tile_tokens != TILE_TOKENS[0] else 1.0
    work = {None: estimated_tile_work(problem, tile_tokens, mma_bn, row_cost)}
    for bn, cost in SWAPPED_ROW_COST.items():   # a swapped tile: bn tokens by 128 weight rows, in its runs
        work[bn] = estimated_tile_work(problem, bn, TILE_M_ROWS, cost, split_k=True)
    best = min(work, key=work.get)
    if best is None:
        return plain, rules
    return dict(mma_bn=best, ab_swapped=True), rules + [
        Rule("tile", f"swapped bn{best}: the cheapest estimated work ({work[best]:.3g} vs {work[None]:.3g} for "
                     f"{tile_tokens}-token tiles)", "swapped-tiles")]


def stream_knobs(problem, decision) -> tuple[dict, list[Rule]]:
    """The streaming kernel's knobs for an SM100 ``decision`` the caller did not choose (host metadata only)."""
    tokens = average_tokens_per_expert(problem)
    if tokens > SMALL_N_MAX_TOKENS:
        return (dict(ab_swapped=decision.ab_swapped, mma_bn=decision.mma_bn, cta_group=decision.cta_group),
                [Rule("tile", f"the SM100 decision's tile ({tokens} tokens per expert > {SMALL_N_MAX_TOKENS}), "
                              "deepest ring", "smalln-tiles")])
    mma_bn = next((bn for bn in SMALL_N_MMA_BN if bn >= tokens), SMALL_N_MMA_BN[-1])
    rules = [Rule("tile", f"small-N: swapped bn{mma_bn} cg1 for {tokens} tokens per expert", "smalln-tiles"),
             Rule("stages", f"{SMALL_N_STAGES} stages (several CTAs per SM)", "smalln-stages")]
    latency_bound = mma_bn == EIGHT_WARP_MMA_BN or estimated_small_n_tiles(problem) < H200_SM_COUNT
    warps = CONSUMER_WARPS_SMALL_N
    if problem.a_format.packed and latency_bound:
        warps = 2 * CONSUMER_WARPS_SMALL_N
        rules.append(Rule("warps", f"{warps} consumer warps: FP4 tokens, latency-bound tiles", "smalln-eight-warps"))
    return dict(ab_swapped=True, mma_bn=mma_bn, cta_group=1, stages=SMALL_N_STAGES, small_n_warps=warps), rules


def h200_weight_layout(weight_format) -> str:
    """The layout FP4 weights of ``weight_format`` are re-laid into for the H200 kernels (``H200_WEIGHT_LAYOUTS``),
    whatever N and K (tiled layouts store them padded to whole boxes); ``"packed"`` for FP8 weights."""
    fmt = get_format(weight_format)
    if not fmt.packed:
        return LAYOUT_PACKED
    return H200_WEIGHT_LAYOUTS[fmt.name]


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------
def _build_spec(kernel: str, problem, knobs: dict, trace: bool, diagnostic: str | None = None):
    """The build of ``kernel`` for ``problem`` with ``knobs`` (stages resolved by the caller)."""
    a, b = _formats(problem)
    layouts = dict(a_layout=layout_of(problem, "a"), b_layout=layout_of(problem, "b"))
    if kernel == "h200_stream":
        if diagnostic is not None:
            raise ValueError(f"diagnostic={diagnostic!r} is a build of the wgmma kernel's folded FP8 route")
        return StreamSpec(a, b, knobs["ab_swapped"], knobs["mma_bn"], knobs.get("cta_group", 1), knobs["stages"],
                          small_n_warps=knobs.get("small_n_warps", CONSUMER_WARPS_SMALL_N), trace=trace, **layouts)
    if trace:
        raise ValueError("trace=True is the streaming kernel's diagnostic build")
    return WgmmaSpec(a, b, knobs["mma_bn"], knobs["stages"], tile_tokens=knobs.get("tile_tokens", TILE_TOKENS[0]),
                     ab_swapped=knobs.get("ab_swapped", False), fp8=knobs.get("fp8", False),
                     cta_group=knobs.get("cta_group", 1), diagnostic=diagnostic, **layouts)


def _resolve_stages(kernel: str, problem, knobs: dict, capped: bool) -> tuple[int, Rule | None]:
    """The stage count and the rule that set it: the deepest that fits for ``AUTO_STAGES``; a requested count
    capped at the deepest if ``capped`` (a caller's SM100 config: B200 stage counts); else the requested count with
    no rule (``h200_launch.check_can_implement`` then refuses one that does not fit)."""
    deepest = hl.max_pipeline_stages(_build_spec(kernel, problem, dict(knobs, stages=1), False))
    stages = knobs.get("stages", AUTO_STAGES)
    if stages == AUTO_STAGES:
        return deepest, Rule("stages", f"{deepest}: the deepest ring that fits 227 KiB")
    if capped and stages > deepest:
        return deepest, Rule("stages", f"{deepest}: the config's {stages} capped at the deepest that fits")
    return stages, None   # as asked: the rule that asked says so


def registers_of(spec) -> int | None:
    """Registers per thread of ``spec``'s build: compiled (cached) on an sm_90 GPU, else None."""
    from .numba_kernels import launch

    if launch.gpu_compute_capability() != hl.SM90:
        return None
    return hl.compiled_kernel(spec).registers


def _sm_count() -> int:
    from .numba_kernels import launch

    if launch.gpu_compute_capability() != hl.SM90:
        return H200_SM_COUNT
    from numba import cuda

    return cuda.get_current_device().MULTIPROCESSOR_COUNT


PDL_RULE = Rule("launch", "programmatic dependent launch, as asked: each launch may start while the kernel before "
                          "it in the stream runs (its CTAs land on SMs that kernel leaves) and waits for that kernel "
                          "to complete before its first global access; not planned unasked: back to back it took "
                          "under 1 % off decode and 13 % longer on Kimi decode", "pdl-ab")
def diagnostic_rule(diagnostic: str) -> Rule:
    """The rule of a diagnostic build asked for (``h200_wgmma.DIAGNOSTICS``): what it leaves out."""
    left_out = {DIAGNOSTIC_NO_PROMOTION: "the per-slice fp32 promotion (the whole K on the E4M3 accumulator, one "
                                         "promotion per tile)",
                DIAGNOSTIC_NO_MMA: "the MMAs (empty wgmma groups)"}[diagnostic]
    return Rule("diagnostic", f"{diagnostic} as asked: a timing-only build without {left_out}; its outputs are wrong")


PROBLEM_METADATA = ("a_format", "b_format", "n", "k", "num_active_experts", "estimated_total_m", "total_tokens")
TILE_CONSTRAINTS = ("ab_swapped", "mma_bn", "cta_group", "stages", "small_n_warps", "tile_tokens", "fp8")


def plan_h200(problem, config: KernelConfig | None = None, backend: str = "auto", *, k_splits: int | None = None,
              num_ctas: int | None = None, trace: bool = False, pdl: bool = False, diagnostic: str | None = None,
              **tile) -> H200Plan:
    """The plan an H200 runs ``problem`` with (a ``GroupedProblem``, a device problem, or any object with the
    problem's host metadata).

    ``config``: a ``KernelConfig`` (its tile; its stages capped at what fits), or None: the dispatch's SM100
    decision mapped onto the H200 by the rules above. ``backend``: ``"auto"``, ``"h200_stream"`` or
    ``"h200_wgmma"``. Constraints on single knobs (``TILE_CONSTRAINTS``: ``ab_swapped``, ``mma_bn``, ``cta_group``,
    ``stages`` (``AUTO_STAGES``: deepest), ``small_n_warps``, ``tile_tokens``) replace the rules' tile; with them or a
    config, ``"auto"`` is the streaming kernel. ``fp8``: True runs the wgmma kernel's FP8 route on its own tile (the
    only constraints it takes: ``cta_group`` 2, never chosen unasked, and ``mma_bn``, 128 or, on operands folded
    ahead, 192: the plan's there, for one CTA per tile or a pair), False never, unset where it wins
    (``prefers_fp8_route``). ``k_splits`` / ``num_ctas`` replace the split and the grid. ``trace``: the streaming
    kernel's start-up trace build (a diagnostic). ``diagnostic``: one of ``h200_wgmma.DIAGNOSTICS`` on the folded
    route's 128 x 192 tile, a timing-only build whose outputs are wrong (``diagnostic_rule``). ``pdl``: every launch of
    the plan a programmatic dependent launch (``PDL_RULE``). TypeError / ValueError saying what is wrong."""
    if not isinstance(pdl, (bool, np.bool_)):
        raise TypeError(f"pdl must be a bool, got {pdl!r}")
    if backend not in ("auto",) + KERNELS:
        raise ValueError(f"not an H200 backend: {backend!r} (one of {('auto',) + KERNELS})")
    missing = [name for name in PROBLEM_METADATA if not hasattr(problem, name)]
    if missing:
        raise TypeError(f"problem must be a GroupedProblem, a device problem or a ProblemMeta (it lacks {missing}), "
                        f"got {type(problem).__name__}")
    unknown = set(tile) - set(TILE_CONSTRAINTS)
    if unknown:
        raise TypeError(f"unknown plan constraints {sorted(unknown)}; the knobs are {TILE_CONSTRAINTS}")
    if config is not None and tile:
        raise ValueError("give a KernelConfig or knob constraints, not both")
    decision = dispatch_for(problem) if config is None else config
    if not isinstance(decision, KernelConfig):
        raise TypeError(f"config must be a KernelConfig from gbs.dispatch, got {type(decision).__name__}")
    route = route_formats(*_formats(problem))
    if (decision.a_format, decision.b_format) != route:
        raise ValueError(f"config was decided for {decision.a_format} x {decision.b_format}, the problem is "
                         f"{_formats(problem)[0]} x {_formats(problem)[1]}")
    fp8 = tile.pop("fp8", None)
    if fp8 is not None and not isinstance(fp8, (bool, np.bool_)):
        raise TypeError(f"fp8 must be a bool, got {fp8!r}")
    chosen = config is not None or bool(tile)
    rules = [Rule("decision", "the caller's KernelConfig" if config is not None else
                  "knob constraints: " + ", ".join(f"{k}={v}" for k, v in tile.items()) if tile else
                  f"SM100 dispatch: {decision.regime} ({decision.rule}) -> swapped={decision.ab_swapped} "
                  f"bn{decision.mma_bn} cg{decision.cta_group}")]
    route_knobs = None
    if fp8 is None:   # not asked either way: folded operands take the route where it wins
        fired = None if chosen or backend == "h200_stream" else prefers_fp8_route(problem)
        fp8 = fired is not None
        rules += [fired] if fired else []
    if fp8:
        pair, width = tile.pop("cta_group", None), tile.pop("mma_bn", None)
        if backend == "h200_stream" or config is not None or tile:
            raise ValueError("fp8=True is the wgmma kernel's FP8 route with its own tile: backend 'auto' or "
                             "'h200_wgmma', no config, no knob constraints but cta_group and mma_bn")
        route_knobs, fired = fp8_route_knobs(problem, width)
        rules += fired
        if pair is not None and route_knobs is not None:
            route_knobs["cta_group"] = pair
            if pair > 1:
                rules.append(pair_rule(pair, route_knobs["mma_bn"]))
    kernel = "h200_wgmma" if route_knobs is not None else backend
    if not get_format(problem.a_format).scaled:
        rules.append(Rule("W4A16", "bf16 tokens: the SM100 tables have no bf16-token row (tcgen05 has no bf16 x FP4 "
                                   "kind); the decision above is W4A8's (the same FP4 weights and K slices)"))
        if kernel == "auto":
            tokens = average_tokens_per_expert(problem)
            kernel = "h200_stream" if tokens <= SMALL_N_MAX_TOKENS and not chosen else "h200_wgmma"
            rules.append(Rule("kernel", f"{kernel}: bf16 tokens, {tokens} per expert (the streaming kernel's swapped "
                                        f"small-N tiles up to {SMALL_N_MAX_TOKENS}, the wgmma kernel's not-swapped "
                                        "tiles above: the two tiles that read bf16 tokens)", "w4a16-tiles"))
    if backend == "auto" and kernel == "auto":
        wgmma_rule = None if chosen else prefers_wgmma(problem)
        kernel = "h200_wgmma" if wgmma_rule else "h200_stream"
        rules.append(wgmma_rule or Rule("kernel", "h200_stream: decode and small prefill, and every chosen config",
                                        "wgmma-min-tokens" if not chosen else None))
    if kernel == "h200_stream":
        if tile:
            knobs = dict(tile)
        elif config is not None:
            knobs = dict(ab_swapped=config.ab_swapped, mma_bn=config.mma_bn, cta_group=config.cta_group,
                         stages=config.num_pipeline_stages)
        else:
            knobs, fired = stream_knobs(problem, decision)
            rules += fired
        for name in ("ab_swapped", "mma_bn"):
            if name not in knobs:
                raise TypeError(f"the streaming kernel's constraints need {name}")
    else:
        if config is not None and config.cta_group != 1:
            raise ValueError(f"the wgmma kernel runs cta_group=1 only (one CTA per tile), got {config.cta_group}")
        if tile.get("cta_group", 1) != 1 or "small_n_warps" in tile:
            raise ValueError("the wgmma kernel takes mma_bn, ab_swapped, tile_tokens and stages (cta_group 1)")
        if route_knobs is not None:
            knobs = route_knobs
        elif tile:
            knobs = {k: v for k, v in tile.items() if k != "cta_group"}
            knobs.setdefault("mma_bn", WGMMA_MMA_BN_FP8)
        elif config is not None:
            knobs = dict(mma_bn=config.mma_bn, ab_swapped=config.ab_swapped)
        else:
            knobs, fired = wgmma_knobs(problem)
            rules += fired
    stages, stage_rule = _resolve_stages(kernel, problem, knobs, capped=config is not None and kernel == "h200_stream")
    if stage_rule is not None:
        rules.append(stage_rule)
    spec = _build_spec(kernel, problem, dict(knobs, stages=stages), trace, diagnostic)
    if diagnostic is not None:
        rules.append(diagnostic_rule(diagnostic))
    hl.check_can_implement(problem, spec)
    plan = _launch_geometry(problem, kernel, spec, rules, k_splits, num_ctas)
    if not pdl:
        return plan
    return dataclasses.replace(plan, pdl=True, rules=plan.rules + (PDL_RULE,))


def _launch_geometry(problem, kernel, spec, rules, k_splits, num_ctas) -> H200Plan:
    """The split-K runs and the grid of ``spec`` for ``problem``: the kernel's registers and the SMs decide how
    many CTAs are resident, and the rules how many runs fill them."""
    max_tiles = hl.max_tiles_bound(hl.ring_of(spec), problem.total_tokens, problem.num_active_experts, problem.n)
    sm_count = _sm_count()
    k_slices = hl.k_slices_of(problem.k, spec.k_slice)
    if problem.total_tokens == 0:
        return H200Plan(kernel, spec, 1, k_slices, 0, max_tiles, None, sm_count,
                        tuple(rules) + (Rule("grid", "no tokens: nothing to launch"),))
    if num_ctas is not None:
        num_ctas = check_num_ctas(num_ctas, spec.cta_group)
    if spec.k_slice != k_slice_elements(problem.a_format, problem.b_format):   # the ring's choice (StreamSpec.k_slice)
        rules.append(Rule("K slice", f"{spec.k_slice} K per stage: the FP4 weights' 128-byte rows with the tokens "
                                     f"copied into decoded-token slots ({spec.token_side.boxes} TMA boxes per token "
                                     f"row): half the stages per K of the format pair's {spec.k_slice // 2}",
                          "w4a8-k256"))
    if problem.k % spec.k_slice:
        rules.append(Rule("K tail", f"K {problem.k}: {k_slices} slices of {spec.k_slice}, the last "
                                    f"{problem.k - (k_slices - 1) * spec.k_slice} (zeros read past K)", "k-n-tails-gpu"))
    registers = registers_of(spec)
    pairs = hl.resident_pairs(spec, registers, sm_count)
    if k_splits is not None:
        k_splits, per_split = hl.split_runs(k_slices, require_int("k_splits", k_splits, 1))
        rules.append(Rule("split-K", f"{k_splits} runs: as asked"))
    elif kernel == "h200_stream":
        k_splits, per_split = stream_k_splits(max_tiles, k_slices, pairs)
        rules.append(Rule("split-K", f"{k_splits} runs of {per_split} slices ({max_tiles} tiles at most, {pairs} "
                                     f"resident CTA pairs)", "stream-split-k"))
    elif spec.ab_swapped:
        k_splits, per_split = swapped_split_plan(problem, spec.mma_bn, pairs)
        rules.append(Rule("split-K", f"{k_splits} runs of {per_split} slices ({pairs} resident CTAs)",
                          "swapped-split-k"))
    else:
        k_splits, per_split = 1, k_slices
    if k_splits > 1:
        if isinstance(spec, WgmmaSpec) and not spec.ab_swapped:
            raise ValueError(f"k_splits={k_splits}: split-K runs are the swapped tiles' (ab_swapped=True); this "
                             f"config takes k_splits=1")
        spec = dataclasses.replace(spec, split_k=True)
        registers = registers_of(spec)
    if num_ctas is None:   # every resident CTA slot, never more pairs than work items (tiles x runs)
        num_ctas = min(hl.resident_pairs(spec, registers, sm_count), max_tiles * k_splits) * spec.cta_group
        rules.append(Rule("grid", f"{num_ctas} persistent CTAs on {sm_count} SMs"))
    return H200Plan(kernel, spec, k_splits, per_split, num_ctas, max_tiles, registers, sm_count, tuple(rules))
