"""Benchmark and ``python -m gbs bench``: our kernels and the peers, timed side by side.

The benchmark: for each (format, case) of ``gbs.lab.cases`` it builds the synthetic problem, asks the
dispatch for its config, times each of our backends (``BACKEND_LOADERS``: ``prepare(problem, config)``
-> a launcher that takes no arguments and writes its output into ``launcher.out`` or
``launcher.device_out``) and each peer of ``gbs.lab.peers`` (torch bf16 / FP8 grouped matmuls, a Triton
``tl.dot_scaled`` grouped loop, a device copy of the same bytes) on the live groups, and makes one row per
method: time, TFLOP/s and GB/s of the method's own useful bytes, percentages of the measured ceilings,
speed-ups over each peer, the dispatch config, and the environment (``gbs.lab.environment``). It prints
the table last and writes the rows as CSV (default ``data/bench/<date>-<gpu>.csv``, where ``python -m gbs report`` reads it).

Timing follows the rules of ``gbs.lab.timing`` (DEVELOPERS.md, METHOD.md): CUDA events around single
launches queued behind a spacer kernel, after warm-up, inputs rotated past ``L2_ROTATION_FACTOR`` times the
L2, median / p10 / p90; the ceilings (streaming read, dense bf16 / fp8 matmul) are measured in the same
process as the kernels.

Nothing is timed unchecked (issue 32): each of our methods first runs once on a poisoned output and
is compared with the case's exact reference (``CaseReference``: computed once per (case, format) on
the host, shared by every method) by ``gbs.lab.verify`` (per-row normalised max error within
``ROW_ERR_BOUND``, skipped rows still poisoned), and once more after its timed launches; each peer
setting is compared with a float64 reference of its own inputs at the bench shape. A failure is a
FAIL row with ``verified`` False and its ``max_row_err``, and the run exits 1. A timing that stays
host-bound after ``HOST_BOUND_RETRIES`` retries is marked (``host_bound``) in the CSV and the table.

``python -m gbs bench --quick`` runs the short benchmark of the GPU runner (``scripts/gpu_run.sh``);
``add_bench_parser`` registers the subcommand. Without a GPU it exits with status 2 and a message.
"""
from __future__ import annotations

import csv
import functools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import peers as peer_lib
from .cases import BENCH_CASES, FULL_FORMATS, QUICK_CASES, QUICK_FORMATS, BenchCase, useful_bytes, useful_flops
from .environment import environment_fields, gpu_slug
from .report import OTHER_SETTINGS_PREFIX
from .timing import (
    QUICK_READ_CEILING_BYTES,
    QUICK_TIMING_BUDGET_S,
    READ_CEILING_BYTES,
    TIMING_BUDGET_S,
    Timing,
    device_l2_bytes,
    measure_read_bandwidth,
    rotation_count,
    time_launches,
)
from .verify import check_output
from ..formats import BF16
from ..layouts import LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E2M1_H200_TILED, LAYOUT_PACKED, word_order
from ..problem import PROBLEM_FORMATS, GroupedProblem
from ..reference import poison_output, reference_grouped_matmul

# ----------------------------------------------------------------------------------------------
# What to run, and the figures a run is compared with
# ----------------------------------------------------------------------------------------------
# The torch peers as a teammate measured them on this H200 (torch 2.11): what this run's torch rows
# should reproduce. (value, unit).
EARLIER_TORCH_FIGURES: dict[str, dict[str, tuple[float, str]]] = {
    "decode_up": {"torch_bf16": (1301, "us"), "torch_fp8_rowwise": (729, "us")},
    "decode_down": {"torch_bf16": (669, "us"), "torch_fp8_rowwise": (410, "us")},
    "kimi_decode": {"torch_bf16": (67.8, "us"), "torch_fp8_rowwise": (58.9, "us")},
    "small_prefill_up": {"torch_bf16": (675, "us"), "torch_fp8_rowwise": (395, "us")},
    "large_prefill_up": {"torch_bf16": (703, "TFLOP/s"), "torch_fp8_rowwise": (1002, "TFLOP/s")},
    "large_prefill_down": {"torch_bf16": (631, "TFLOP/s"), "torch_fp8_rowwise": (747, "TFLOP/s")},
}
# Dense matmul peaks measured on this H200 (kernels.md, 2026-11-29): used when not measured.
KERNELS_MD_PEAK_TFLOPS = {"bf16": 766.0, "fp8": 1340.0}
KERNELS_MD_SOURCE = "kernels.md"
MEASURED_SOURCE = "measured"
# processes that compile JIT peers' kernels ahead of the checks (``Peer.compile_ahead``): half the host's cores
COMPILE_AHEAD_WORKERS = max(1, (os.cpu_count() or 2) // 2)


def _names(value, what: str, allowed) -> tuple[str, ...]:
    """Validated names from a comma-separated string or a sequence; ValueError lists the allowed."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or names}; expected a comma-separated subset of {list(allowed)}")
    return tuple(dict.fromkeys(names))


def select_cases(quick: bool, formats=None, shapes=None) -> list[tuple[str, BenchCase]]:
    """(format, case) pairs to run, case-major (peers that ignore the format are timed once per case)."""
    formats = _names(formats, "formats", PROBLEM_FORMATS) if formats else (QUICK_FORMATS if quick else FULL_FORMATS)
    shapes = _names(shapes, "shapes", BENCH_CASES) if shapes else (QUICK_CASES if quick else tuple(BENCH_CASES))
    return [(fmt, BENCH_CASES[name]) for name in shapes for fmt in formats]


# ----------------------------------------------------------------------------------------------
# Our kernels
# ----------------------------------------------------------------------------------------------
def _load_simt():
    from ..numba_kernels import simt

    def prepare(problem: GroupedProblem, config):
        prepared = simt.prepare(problem, config)
        if prepared.num_tiles == 0:
            raise ValueError("the problem has no tiles (every slot is -1 or empty)")
        return prepared   # callable; ``device_out`` is what ``launcher_output`` reads back

    return prepare


def _load_h200_stream(plan: bool):
    """``h200_stream`` as ``gbs.grouped_matmul`` runs it (``plan``: the decision mapped onto the H200 by
    ``gbs.plan``), or with the SM100 decision's own knobs (stages capped to fit)."""
    from ..numba_kernels import h200_launch
    from ..numba_kernels.launch import to_device
    from ..plan import plan_h200

    def prepare(problem: GroupedProblem, config):
        return h200_launch.prepare(to_device(problem), plan_h200(problem, None if plan else config, "h200_stream"))

    return prepare


def _load_h200_kernel(backend: str, layout: str = LAYOUT_PACKED, *, relay_tokens: bool = False, **constraints):
    """``gbs.plan.plan_h200`` for ``backend`` without a config: ``"auto"`` is what ``gbs.grouped_matmul(problem)``
    runs on an H200 (the wgmma kernel for prefill, the streaming kernel otherwise, each with its measured plan),
    ``"h200_wgmma"`` the wgmma kernel with its plan.
    ``layout``: FP4 weights re-laid once (``GroupedProblem.with_b_layout``) and FP4 tokens in the same
    word order (``with_a_layout``, ``gbs.formats.word_order``: their quantizer would write it, and the
    quantization is not timed either), both untimed, before the runs (tiled weights stored padded to whole
    boxes where N or K needs it). ``relay_tokens``: the FP4 tokens arrive
    packed instead, and each timed launch first re-lays them on the GPU (``TokensFirstLaunch``)."""
    from ..numba_kernels import h200_launch
    from ..numba_kernels.launch import to_device
    from ..plan import plan_h200

    last = [None, None]   # the last problem and its re-laid copy: one re-layout per bench case

    def prepare(problem: GroupedProblem, config):
        packed = problem
        if layout == LAYOUT_E2M1_E4M3 and problem.b_format.name != "mxfp4":
            raise NotImplementedError(f"{LAYOUT_E2M1_E4M3} re-lays MXFP4 weights, not {problem.b_format.name}")
        if layout != LAYOUT_PACKED:
            if not problem.b_format.packed:
                raise NotImplementedError(f"no {layout} re-layout for {problem.b_format.name} weights")
            if relay_tokens and not problem.a_format.packed:
                raise NotImplementedError(f"{problem.a_format.name} tokens: no FP4 tokens to re-lay")
            if last[0] is not problem:
                last[:] = [None, None]   # drop the previous case's copy before making this one
                relaid = problem.with_b_layout(layout)
                last[:] = [problem, relaid.with_a_layout(word_order(layout)) if problem.a_format.packed else relaid]
            problem = last[1]
        device = to_device(problem)
        launcher = h200_launch.prepare(device, plan_h200(problem, None, backend, **constraints))
        if not relay_tokens:
            return launcher
        from numba import cuda

        from ..numba_kernels import relayout

        packed_tokens = cuda.to_device(packed.a)
        packed_scales = cuda.to_device(packed.a_scales) if packed.a_format.scale_dtype == "ue4m3" else None

        def relay():   # UE4M3 scales into their H200 codes; MX scales stay as they are
            relayout.to_e2m1_h200(packed_tokens, device.a)
            if packed_scales is not None:
                relayout.ue4m3_scales_to_h200(packed_scales, device.a_scales)

        return TokensFirstLaunch(launcher, relay)

    return prepare


def _load_fp8_folded(fold_tokens_on_gpu: bool = False):
    """MXFP4 x MXFP4 folded ahead into E4M3 with one scale per 128-K chunk (``gbs.fp8_route.fold_problem``: the
    weights once, the tokens as their quantizer would write them; both untimed, as the quantization is), then
    ``gbs.plan.plan_h200``'s "auto" plan: the FP8 route from 33 tokens per expert, the folded operands as MXFP8
    below; W4A8 folds its weights only and runs the route (``fp8=True``) on every case. ``fold_tokens_on_gpu``: the
    tokens arrive as MXFP4 instead, and each timed launch first folds them on the GPU (``TokensFirstLaunch``).
    NotImplementedError for other formats; ValueError where a block does not fold exactly."""
    from ..fp8_route import fold_problem
    from ..numba_kernels import h200_launch
    from ..numba_kernels.launch import to_device
    from ..plan import plan_h200

    last = [None, None]   # the last problem and its folded copy: one fold per bench case

    def prepare(problem: GroupedProblem, config):
        if problem.format_name not in ("mxfp4", "w4a8") or (fold_tokens_on_gpu and problem.format_name != "mxfp4"):
            raise NotImplementedError(f"the fold takes MXFP4 x MXFP4 (and W4A8's weights), not {problem.format_name}")
        if last[0] is not problem:
            last[:] = [None, None]
            last[:] = [problem, fold_problem(problem)]
        device = to_device(last[1])
        # W4A8's route on folded weights is not planned by "auto" (evidence: w4a8-fold-bench): asked for here
        fp8 = True if problem.format_name == "w4a8" else None
        launcher = h200_launch.prepare(device, plan_h200(last[1], fp8=fp8))
        if not fold_tokens_on_gpu:
            return launcher
        from ..numba_kernels import fold

        mxfp4 = to_device(problem)
        return TokensFirstLaunch(launcher, lambda: fold.fold_tokens(
            mxfp4.a, mxfp4.a_scales, mxfp4.a_offsets, mxfp4.a_scale_offsets, out=device.a, out_scales=device.a_scales))

    return prepare


class TokensFirstLaunch:
    """A prepared launch whose tokens arrive in another form than the one it reads: each call first runs
    ``prepare_tokens`` (GPU work writing the launch's own token arrays: ``relayout`` into ``E2M1H200Order``, or
    ``fold.fold_tokens`` for the folded FP8 route), then enqueues the launch, on the same (default) stream, so a
    timing covers both. Other attributes are the launch's."""

    def __init__(self, launcher, prepare_tokens):
        self.launcher, self.prepare_tokens = launcher, prepare_tokens

    def __call__(self):
        self.prepare_tokens()
        return self.launcher()

    def __getattr__(self, name):
        return getattr(self.launcher, name)


def launch_knobs(launcher) -> str:
    """What a prepared launch runs, in words (``h200_stream``: tile knobs, ring, split-K runs, grid, and
    ``w8`` for 8 small-N consumer warps; ``t256`` for the wgmma kernel's 256-token tiles; ``e2m1_h200:ab``
    for the operands it reads in ``E2M1H200Order``, ``b`` weights, ``a`` tokens; ``e2m1_h200_tiled:b`` tiled
    weights)."""
    plan = getattr(launcher, "plan", None)
    if plan is None:
        return ""
    spec = plan.ring
    kernel = "wgmma " if plan.kernel == "h200_wgmma" else ""
    warps = " w8" if getattr(spec, "small_n_warps", None) == 8 else ""
    from ..numba_kernels.h200_ring import TILE_M_ROWS   # a prepared launch: numba is there
    tokens = f" t{spec.m_rows}" if getattr(spec, "m_rows", TILE_M_ROWS) != TILE_M_ROWS else ""
    relaid = {}   # layout -> the operands in it
    for op in "ab":
        layout = getattr(spec, f"{op}_layout", LAYOUT_PACKED)
        if layout != LAYOUT_PACKED:
            relaid[layout] = relaid.get(layout, "") + op
    layouts = "".join(f" {layout}:{ops}" for layout, ops in relaid.items())
    return (f"{kernel}{'swap' if spec.ab_swapped else 'noswap'} bn{spec.mma_bn} cg{spec.cta_group} st{spec.stages} "
            f"splits{plan.k_splits} ctas{plan.num_ctas}{warps}{tokens}{layouts}")


# Backend name -> loader returning ``prepare(problem, config) -> launch()`` (``gbs_auto_h200_layout``: what
# ``gbs.grouped_matmul`` runs once the FP4 weights are re-laid for the H200 and FP4 tokens come in that
# order; ``gbs_auto_h200_tiled``: the same with the weights tiled box by box, ``E2M1H200TiledOrder``;
# ``gbs_auto_h200_fused``: each box followed by its scales, ``E2M1H200FusedOrder``, the recommended one;
# ``gbs_auto_h200_relay``: the tokens arriving packed and re-laid on the GPU in each timed call;
# ``gbs_auto_e4m3_order``: "auto" on operands in the FP8 route's word order (the bf16 consumers); ``gbs_fp8_route``:
# MXFP4 x MXFP4 in ``E2M1E4M3Order`` on the wgmma kernel's E4M3 consumer, ``plan_h200(fp8=True)``; ``gbs_fp8_folded``:
# MXFP4 x MXFP4 folded ahead, ``gbs.fp8_route.fold_problem``, and "auto"'s plan of it; ``gbs_fp8_folded_relay``: the
# same with the tokens arriving as MXFP4 and folded on the GPU in each timed call); a loader raises
# ImportError / NotImplementedError / AttributeError while the backend is not there yet.
BACKEND_LOADERS = {"simt": _load_simt, "gbs_auto": functools.partial(_load_h200_kernel, "auto"),
                   "gbs_auto_h200_layout": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_H200),
                   "gbs_auto_h200_tiled": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_H200_TILED),
                   "gbs_auto_h200_fused": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_H200_FUSED),
                   "gbs_auto_h200_relay": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_H200,
                                                            relay_tokens=True),
                   "h200_stream": functools.partial(_load_h200_stream, True),
                   "h200_stream_sm100_knobs": functools.partial(_load_h200_stream, False),
                   "h200_wgmma": functools.partial(_load_h200_kernel, "h200_wgmma"),
                   "gbs_auto_e4m3_order": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_E4M3),
                   "gbs_fp8_route": functools.partial(_load_h200_kernel, "auto", LAYOUT_E2M1_E4M3, fp8=True),
                   "gbs_fp8_folded": _load_fp8_folded,
                   "gbs_fp8_folded_relay": functools.partial(_load_fp8_folded, True)}
BACKEND_UNAVAILABLE = (ImportError, NotImplementedError, AttributeError)
METHODS = tuple(BACKEND_LOADERS) + peer_lib.PEER_NAMES


def select_methods(names=None) -> tuple[str, ...]:
    return _names(names, "backends", METHODS) if names else METHODS


def load_backends(names) -> tuple[dict, dict[str, str]]:
    """``prepare`` of each backend that loads, and the reason for each one that does not."""
    prepares, skipped = {}, {}
    for name in names:
        try:
            prepares[name] = BACKEND_LOADERS[name]()
        except BACKEND_UNAVAILABLE as err:
            skipped[name] = f"{type(err).__name__}: {err}"
    return prepares, skipped


# ----------------------------------------------------------------------------------------------
# Measurements and rows
# ----------------------------------------------------------------------------------------------
KIND_OURS = "ours"
KIND_PEER = "peer"
STATUS_OK = "ok"
STATUS_SKIPPED = "skipped"
STATUS_FAIL = "FAIL"


@dataclass(frozen=True)
class Measurement:
    """One method on one (format, case): its timing, or why there is none."""

    method: str
    kind: str                  # KIND_OURS | KIND_PEER
    method_format: str         # what the method computes in (e.g. "bf16 x bf16")
    useful_flops: int
    useful_bytes: int          # the fewest bytes THIS method must move
    timing: Timing | None = None
    status: str = STATUS_OK    # STATUS_OK | STATUS_SKIPPED | STATUS_FAIL
    note: str = ""
    input_sets: int = 0        # rotated input copies
    knobs: str = ""            # what our kernel ran (``launch_knobs``)
    # the output check before the timing (``gbs.lab.verify``): None where nothing ran
    verified: bool | None = None
    max_row_err: float | None = None
    setting: str = ""          # peers: the launch setting timed (the fastest verified one)
    headline: bool | None = None   # peers: may the headline tables quote this peer (``Peer.headline``)


@dataclass(frozen=True)
class Ceilings:
    read_tbps: float
    bf16_tflops: float
    fp8_tflops: float
    bf16_source: str
    fp8_source: str


def _ratio(numerator, denominator):
    """numerator / denominator, or None (a blank cell) when either is missing or zero."""
    return numerator / denominator if numerator and denominator else None


def _percent(value, ceiling):
    return 100 * value / ceiling if value and ceiling else None


def build_rows(fmt: str, case: BenchCase, config, measurements: list[Measurement], ceilings: Ceilings,
               env: dict) -> list[dict]:
    """One CSV row per measurement, every row with the same keys. ``speedup_vs_<peer>`` =
    peer median / this median (> 1: this method is faster); blank without both timings."""
    peer_us = {m.method: m.timing.median_us for m in measurements if m.kind == KIND_PEER and m.timing}
    rows = []
    for m in measurements:
        us = m.timing.median_us if m.timing else None
        tflops = _ratio(m.useful_flops, us * 1e6) if us else None
        gbps = _ratio(m.useful_bytes, us * 1e3) if us else None
        ours = m.kind == KIND_OURS
        earlier = EARLIER_TORCH_FIGURES.get(case.name, {}).get(m.method)
        row = {
            "format": fmt, "case": case.name, "n": case.n, "k": case.k, "routing": case.routing,
            "slots": case.slots, "tokens_per_expert": case.tokens_per_expert, "total_tokens": case.total_tokens,
            "regime": config.regime, "method": m.method, "kind": m.kind, "method_format": m.method_format,
            "status": m.status, "note": m.note,
            "verified": m.verified, "max_row_err": m.max_row_err,
            "median_us": us, "p10_us": m.timing.p10_us if m.timing else None,
            "p90_us": m.timing.p90_us if m.timing else None, "launches": m.timing.launches if m.timing else None,
            "host_bound": m.timing.host_bound if m.timing else None,
            "timing_attempts": m.timing.attempts if m.timing else None,
            "input_sets": m.input_sets, "useful_flops": m.useful_flops, "useful_bytes": m.useful_bytes,
            "tflops": tflops, "gbps": gbps,
            "pct_read_ceiling": _percent(gbps, ceilings.read_tbps * 1e3),
            "pct_bf16_peak": _percent(tflops, ceilings.bf16_tflops),
            "pct_fp8_peak": _percent(tflops, ceilings.fp8_tflops),
        }
        for peer in peer_lib.PEER_NAMES:
            row[f"speedup_vs_{peer}"] = _ratio(peer_us.get(peer), us)
        row.update({
            "ab_swapped": config.ab_swapped if ours else None, "mma_bn": config.mma_bn if ours else None,
            "cta_group": config.cta_group if ours else None,
            "stages": config.num_pipeline_stages if ours else None, "ran_knobs": m.knobs,
            "peer_setting": m.setting, "peer_headline": None if ours else m.headline,
            "earlier_figure": f"{earlier[0]:g} {earlier[1]}" if earlier else "",
            "read_ceiling_tbps": ceilings.read_tbps, "bf16_peak_tflops": ceilings.bf16_tflops,
            "bf16_peak_source": ceilings.bf16_source, "fp8_peak_tflops": ceilings.fp8_tflops,
            "fp8_peak_source": ceilings.fp8_source,
        })
        row.update(env)
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (e.g. "6.1f"), or a "-" of the same width when blank."""
    if value is None or value == "":
        return "-".rjust(int(spec.split(".")[0] or 0))
    return format(value, spec)


SPEEDUP_HEADERS = {"torch_bf16": "x_bf16", "torch_fp8_rowwise": "x_fp8", "triton_dot_scaled": "x_trit",
                   "humming": "x_hum", "copy": "x_copy"}


METHOD_WIDTH = max(map(len, METHODS))   # the method column fits every method name
# A row whose p10-p90 spread exceeds this fraction of its median gets a note in the table: its median may sit in
# one of two modes. Evidence bench-torch-bimodal (data/h200_evidence.csv): torch bf16 on large_prefill_up took
# 705.6 us (p10 636.9, p90 708.0) in one process and 630.1 (628.8-631.6) in the other of the same call; our rows
# spread 0.5-3 % at that size.
WIDE_SPREAD_FRACTION = 0.08


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (skipped / failed methods show their reason)."""
    speedups = "".join(f" {SPEEDUP_HEADERS[p]:>6}" for p in peer_lib.PEER_NAMES)
    header = (f"{'case':<18} {'fmt':<6} {'method':<{METHOD_WIDTH}} {'us':>9} {'p10-p90 us':>17} {'TFLOP/s':>8} "
              f"{'GB/s':>7} {'%read':>6} {'%bf16':>6} {'%fp8':>6}{speedups}  config / note")
    lines = [header, "-" * len(header)]
    for r in rows:
        case = f"{r['case']}"
        head = f"{case:<18} {r['format']:<6} {r['method']:<{METHOD_WIDTH}}"
        if r["median_us"] is None:
            lines.append(f"{head} {r['status']}: {r['note']}")
            continue
        spread = f"{r['p10_us']:.1f}-{r['p90_us']:.1f}"
        ratios = "".join(f" {_fmt(r[f'speedup_vs_{p}'], '6.2f')}" for p in peer_lib.PEER_NAMES)
        if r["kind"] == KIND_OURS:   # what ran; the SM100 decision in brackets when it differs
            decided = f"swap{int(r['ab_swapped'])} bn{r['mma_bn']} cg{r['cta_group']} st{r['stages']}"
            extra = f"{r['ran_knobs'] or decided} ({r['regime']}: decided {decided})"
        else:
            extra = r["method_format"] + (f", {r['peer_setting']}" if r["peer_setting"] else "")
            extra += "; NOT HEADLINE" if r["peer_headline"] is False else ""
            extra += f"; earlier {r['earlier_figure']}" if r["earlier_figure"] else ""
        if r["host_bound"]:
            extra = f"HOST-BOUND (times include host gaps after {r['timing_attempts']} batches); {extra}"
        if r["note"]:
            extra += f"; {r['note']}"
        spread_fraction = (r["p90_us"] - r["p10_us"]) / r["median_us"]
        if spread_fraction > WIDE_SPREAD_FRACTION:
            extra += f"; wide spread: p10-p90 is {100 * spread_fraction:.0f} % of the median, compare with care"
        rates = (f"{_fmt(r['tflops'], '8.1f')} {_fmt(r['gbps'], '7.0f')} {_fmt(r['pct_read_ceiling'], '6.1f')} "
                 f"{_fmt(r['pct_bf16_peak'], '6.1f')} {_fmt(r['pct_fp8_peak'], '6.1f')}")
        lines.append(f"{head} {r['median_us']:>9.1f} {spread:>17} {rates}{ratios}  {extra}")
    return "\n".join(lines)


TABLE_LEGEND = """\
us: median of CUDA-event timings per launch (p10-p90 beside it); launches queued behind a sleeping kernel, so
    the GPU's time, without Python's launch gaps; inputs rotated over copies spanning 4x the L2.
TFLOP/s: 2 x live tokens x N x K / time. GB/s: the fewest bytes THIS method moves (its weights and tokens once,
    the bf16 output once) / time: bf16 weights are 4x the FP4 bytes; the copy reads and writes half our bytes each.
%read: of the streaming-read ceiling measured in this run; %bf16, %fp8: of the dense matmul peaks above.
x_<peer>: the peer's time / this row's time (> 1: this row is faster). "wide spread": p10-p90 above 8 % of the
    median (two modes, or noise at a few us): its ratios may move between runs.
Every timed row's output was checked first (CSV verified, max_row_err): ours against the exact reference of the
    case (per-row max |err| / max |ref| <= 2^-7 + 2^-9, skipped rows untouched), each peer against a float64
    reference of its own inputs; a failing output is a FAIL row, never timed. HOST-BOUND: the GPU ran out of
    queued launches even after the retries, so the time includes host gaps (CSV host_bound).
Peers run only the live groups (torch has no -1 skip semantics) on their own random data; torch_fp8_rowwise is
    timed with and without use_fast_accum and the faster verified setting is its row (the other in its note);
    triton_dot_scaled (NOT HEADLINE) launches one untuned kernel per group from Python (MX scales only)."""


def write_csv(path: str, rows: list[dict]) -> None:
    """Write rows (dicts) as CSV, creating the folder; the columns are every key in first-seen order (a row without
    one leaves its cell empty)."""
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def default_csv_path(env: dict, root: str = "data/bench") -> str:
    return os.path.join(root, f"{env['date']}-{gpu_slug(env['gpu'])}.csv")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def measure_ceilings(read_bytes: int, measure_peaks: bool, budget_s: float) -> Ceilings:
    """Streaming-read ceiling, always measured; dense bf16 / fp8 matmul peaks measured when asked
    and torch is there, else the kernels.md figures (labelled)."""
    read_tbps, _ = measure_read_bandwidth(read_bytes)
    peaks = {kind: (KERNELS_MD_PEAK_TFLOPS[kind], KERNELS_MD_SOURCE) for kind in peer_lib.DENSE_PEAK_KINDS}
    if measure_peaks:
        l2 = device_l2_bytes()
        for kind in peer_lib.DENSE_PEAK_KINDS:
            try:
                copies = rotation_count(peer_lib.dense_peak_input_bytes(kind), l2)
                launch, flops = peer_lib.dense_peak_launcher(kind, copies)
                timing = time_launches(launch, num_inputs=copies, budget_s=budget_s)
                peaks[kind] = (flops / (timing.median_us * 1e6), MEASURED_SOURCE)
            except Exception as err:   # no torch, no fp8 matmul: keep the labelled kernels.md figure
                print(f"  {kind} peak not measured ({type(err).__name__}: {err}); using kernels.md")
    return Ceilings(read_tbps, peaks["bf16"][0], peaks["fp8"][0], peaks["bf16"][1], peaks["fp8"][1])


class CaseReference:
    """The exact reference (``gbs.reference.reference_grouped_matmul``: float64, rounded once to bf16, skipped
    rows poisoned) of one (case, format), computed on first use, on the host (seconds for a large prefill case),
    then shared by every one of our methods of that case."""

    def __init__(self, problem: GroupedProblem):
        self.problem = problem
        self.seconds: float | None = None
        self._out: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self._out is None:
            t0 = time.perf_counter()
            self._out = reference_grouped_matmul(self.problem)
            self.seconds = time.perf_counter() - t0
        return self._out


class VerificationError(RuntimeError):
    """The bench cannot read back or check a method's output (no output array, wrong shape or dtype)."""


# Attributes of a prepared launch holding its output on the device, bf16 bits, (total_tokens, N): the H200
# kernels' ``StreamLaunch`` / ``H200Launch`` (``out``), the SIMT kernel's ``PreparedSimt`` (``device_out``).
OUTPUT_ATTRIBUTES = ("out", "device_out")


def launcher_output(launcher):
    """The device array a prepared launch writes its output into; ``VerificationError`` if it has none."""
    for name in OUTPUT_ATTRIBUTES:
        array = getattr(launcher, name, None)
        if array is not None:
            return array
    raise VerificationError(f"{type(launcher).__name__} exposes no output array ({' / '.join(OUTPUT_ATTRIBUTES)}): "
                            "the bench cannot check what it computes, so it does not time it")


def verify_launch(launcher, problem: GroupedProblem, reference: np.ndarray, *, poison: bool = True):
    """Run ``launcher`` once and compare its output with ``reference`` (``gbs.lab.verify.check_output``: per-row
    normalised max error within ``ROW_ERR_BOUND``, rows of skipped slots still poisoned, written rows not).
    ``poison``: fill the output with the sentinel first (False: check what the launches before left, e.g. after
    the timed ones; the skipped rows still hold the first check's poison)."""
    from numba import cuda

    device_out = launcher_output(launcher)
    shape = (problem.total_tokens, problem.n)
    if tuple(device_out.shape) != shape or np.dtype(device_out.dtype).itemsize != 2:
        raise VerificationError(f"output on the device is {tuple(device_out.shape)} {device_out.dtype}, want {shape} "
                                "of bf16 bits (2-byte elements)")
    if poison:
        device_out.copy_to_device(poison_output(*shape).view(np.uint16).view(device_out.dtype))
    launcher()
    cuda.synchronize()
    out = np.ascontiguousarray(device_out.copy_to_host()).view(np.uint16).view(BF16)
    return check_output(out, reference, written=problem.written_rows())


def _our_measurement(name: str, prepare, problem: GroupedProblem, config, budget_s: float, l2: int,
                     reference: CaseReference) -> Measurement:
    """Prepare ``copies`` launches (unsupported: skipped), check the first one's output against the case's
    reference (a failure: a FAIL row, not timed), time them, and check that output again after the timed
    launches (a launch that leaves state behind: a FAIL row)."""
    base = dict(method=name, kind=KIND_OURS, method_format=problem.format_name,
                useful_flops=useful_flops(problem), useful_bytes=useful_bytes(problem))
    copies = rotation_count(sum(problem.nbytes().values()), l2)
    try:
        launchers = [prepare(problem, config) for _ in range(copies)]
        base["knobs"] = launch_knobs(launchers[0])
    except (NotImplementedError, ValueError, TypeError) as err:   # this config / format is not supported
        return Measurement(**base, status=STATUS_SKIPPED, note=f"{type(err).__name__}: {err}")
    except Exception as err:   # a crash: recorded, the run goes on
        return Measurement(**base, status=STATUS_FAIL, note=f"{type(err).__name__}: {err}")
    try:
        before = verify_launch(launchers[0], problem, reference.get())
    except Exception as err:   # no output to read, or a crash in the checked launch
        return Measurement(**base, status=STATUS_FAIL, verified=False,
                           note=f"output check could not run, not timed ({type(err).__name__}: {err})")
    if not before.passed:
        return Measurement(**base, status=STATUS_FAIL, verified=False, max_row_err=before.max_row_err,
                           note=f"OUTPUT CHECK FAILED, not timed: {before}")
    try:
        timing = time_launches(lambda i: launchers[i](), num_inputs=copies, budget_s=budget_s)
        after = verify_launch(launchers[0], problem, reference.get(), poison=False)
    except Exception as err:
        return Measurement(**base, status=STATUS_FAIL, verified=True, max_row_err=before.max_row_err,
                           note=f"checked, then crashed while timed ({type(err).__name__}: {err})")
    if not after.passed:
        return Measurement(**base, status=STATUS_FAIL, verified=False, max_row_err=after.max_row_err,
                           note=f"OUTPUT CHECK FAILED after the timed launches (a launch left state behind?): {after}")
    return Measurement(**base, timing=timing, input_sets=copies, verified=True,
                       max_row_err=max(before.max_row_err, after.max_row_err))


def _peer_measurement(peer, shape, fmt: str, ours_bytes: int, budget_s: float, l2: int) -> Measurement:
    """Build the peer's rotated inputs, compute the float64 reference of the first set once (on the GPU,
    ``Peer.device_reference``), then for each of its launch settings check the output at this shape
    (``peer_lib.check_at_shape``; a failure is not timed) and time it. The row is the fastest verified
    setting's; the note gives the others."""
    nbytes = peer.useful_bytes(shape, fmt, ours_bytes)
    base = dict(method=peer.name, kind=KIND_PEER, method_format=peer.method_format(fmt),
                useful_flops=peer.useful_flops(shape), useful_bytes=nbytes, headline=peer.headline)
    copies = rotation_count(nbytes, l2)
    try:
        inputs = [peer.make_inputs(shape, fmt, ours_bytes, seed=i) for i in range(copies)]
        reference = peer.device_reference(inputs[0])
    except Exception as err:   # peers are others' code: any failure is recorded, the run goes on
        return Measurement(**base, status=STATUS_FAIL, note=peer_lib.describe_error(err))
    results = []   # (setting, check or None, timing or None, why not timed)
    for setting in peer.settings:
        try:
            check = peer_lib.check_at_shape(peer, inputs[0], reference, setting)
        except Exception as err:
            results.append((setting, None, None, f"output check could not run ({peer_lib.describe_error(err)})"))
            continue
        if not check.passed:
            results.append((setting, check, None, f"OUTPUT CHECK FAILED, not timed: {check}"))
            continue
        try:
            timing = time_launches(lambda i, s=setting: peer.launch(inputs[i], s), num_inputs=copies,
                                   budget_s=budget_s)
        except Exception as err:
            results.append((setting, check, None, f"crashed while timed ({peer_lib.describe_error(err)})"))
            continue
        results.append((setting, check, timing, ""))
    return _peer_row(base, copies, results)


def _peer_row(base: dict, copies: int, results: list) -> Measurement:
    """The measurement of a peer from its settings' (setting, check, timing, why not timed): the fastest
    verified setting's timing, or a FAIL naming every setting's reason; the note lists the other settings."""
    def describe(setting, check, timing, why):
        head = f"{setting}: " if setting else ""
        if timing is not None:
            return f"{head}{timing.median_us:.1f} us (max row err {check.max_row_err:.2e})"
        return head + why

    timed = [r for r in results if r[2] is not None]
    if not timed:
        worst = max((r[1].max_row_err for r in results if r[1] is not None), default=None)
        return Measurement(**base, status=STATUS_FAIL, verified=False, max_row_err=worst,
                           note="; ".join(describe(*r) for r in results))
    best = min(timed, key=lambda r: r[2].median_us)
    others = "; ".join(describe(*r) for r in results if r is not best)
    return Measurement(**base, timing=best[2], input_sets=copies, verified=True, max_row_err=best[1].max_row_err,
                       setting=best[0], note=OTHER_SETTINGS_PREFIX + others if others else "")


def _progress(fmt: str, case: BenchCase, m: Measurement) -> str:
    where = f"  [{fmt} {case.name}] {m.method}:"
    if m.timing is None:
        return f"{where} {m.status}: {m.note}"
    t = m.timing
    checked = f"verified, max row err {m.max_row_err:.2e}" if m.verified else "NOT VERIFIED"
    bound = f"; HOST-BOUND after {t.attempts} batches" if t.host_bound else ""
    setting = f" [{m.setting}]" if m.setting else ""
    return (f"{where}{setting} {t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f}; {t.launches} launches, "
            f"{m.input_sets} input sets; {checked}{bound})" + (f"; {m.note}" if m.note else ""))


def run_bench(selection: list[tuple[str, BenchCase]], methods, csv_path: str | None, *,
              budget_s: float = TIMING_BUDGET_S, read_bytes: int = READ_CEILING_BYTES,
              measure_peaks: bool = True, seed: int = 0) -> int:
    """Run the benchmark on this GPU; print the table last, write the CSV. Returns 1 if one of our
    kernels crashed, else 0 (peer failures are reported in their rows)."""
    from ..dispatch import dispatch_for

    env = environment_fields()
    csv_path = csv_path or default_csv_path(env)
    print(f"gbs bench on {env['gpu']} {env['gpu_uuid']} ({env['date']}, commit {env['commit']}; torch {env['torch']}, "
          f"triton {env['triton']}, numba-cuda {env['numba_cuda']})")
    ceilings = measure_ceilings(read_bytes, measure_peaks, budget_s)
    print(f"ceilings: streaming read {ceilings.read_tbps:.2f} TB/s (measured); dense bf16 "
          f"{ceilings.bf16_tflops:.0f} TFLOP/s ({ceilings.bf16_source}); fp8 {ceilings.fp8_tflops:.0f} TFLOP/s "
          f"({ceilings.fp8_source})")

    our_names = [m for m in methods if m in BACKEND_LOADERS]
    prepares, skipped = load_backends(our_names)
    peers, peer_skips = peer_lib.load_peers([m for m in methods if m in peer_lib.PEER_NAMES])
    skipped.update(peer_skips)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}")

    formats = list(dict.fromkeys(fmt for fmt, _ in selection))
    peer_shapes = [peer_lib.PeerShape(peer_lib.CHECK_N, peer_lib.CHECK_K, peer_lib.CHECK_GROUP_SIZES)]
    peer_shapes += [peer_lib.PeerShape(case.n, case.k, tuple(int(s) for s in case.group_sizes() if s > 0))
                    for _, case in selection]
    for peer in peers:
        for failure in peer.compile_ahead(peer_shapes, workers=COMPILE_AHEAD_WORKERS):
            print(f"  {peer.name} compile ahead failed: {failure}")
    checks = {}
    print("peer checks (small shape vs float64; a FAIL is not timed):")
    for peer in peers:
        for fmt in formats if peer.format_dependent else formats[:1]:
            checks[peer.name, fmt if peer.format_dependent else None] = check = peer_lib.check_peer(peer, fmt)
            print(f"  {check}")

    l2 = device_l2_bytes()
    rows, shape_timings = [], {}
    for fmt, case in selection:
        problem = case.problem(fmt, seed)
        config = dispatch_for(problem)
        print(f"[{fmt} {case.name}] {case.label}: {config.regime}, swap={config.ab_swapped} "
              f"mma_bn={config.mma_bn} cta_group={config.cta_group} stages={config.num_pipeline_stages}")
        ours_bytes = useful_bytes(problem)
        measurements = []
        reference = CaseReference(problem)   # computed once, on the first method that prepares
        for name in our_names:
            if name in prepares:
                m = _our_measurement(name, prepares[name], problem, config, budget_s, l2, reference)
            else:
                m = Measurement(name, KIND_OURS, problem.format_name, useful_flops(problem), ours_bytes,
                                status=STATUS_SKIPPED, note=skipped[name])
            measurements.append(m)
        shape = peer_lib.PeerShape.from_problem(problem)
        for peer in peers:
            check = checks[peer.name, fmt if peer.format_dependent else None]
            key = (peer.name, shape)
            if not check.passed:
                m = Measurement(peer.name, KIND_PEER, peer.method_format(fmt), peer.useful_flops(shape),
                                peer.useful_bytes(shape, fmt, ours_bytes), status=STATUS_FAIL, verified=False,
                                headline=peer.headline, note=f"correctness check failed, not timed ({check.message})")
            elif not peer.format_dependent and key in shape_timings:
                m = shape_timings[key]   # the same computation as for the previous format
            else:
                m = _peer_measurement(peer, shape, fmt, ours_bytes, budget_s, l2)
                if not peer.format_dependent:
                    shape_timings[key] = m
            measurements.append(m)
        for name in methods:
            if name in peer_skips:
                measurements.append(Measurement(name, KIND_PEER, "", 0, 0, status=STATUS_SKIPPED,
                                                note=peer_skips[name], headline=peer_lib.PEER_CLASSES[name].headline))
        if reference.seconds is not None:
            print(f"  [{fmt} {case.name}] exact reference computed in {reference.seconds:.1f} s (host)")
        for m in measurements:
            print(_progress(fmt, case, m))
        rows += build_rows(fmt, case, config, measurements, ceilings, env)
        write_csv(csv_path, rows)   # after every case: a run cut short keeps what it measured
        del problem, measurements
        peer_lib.free_cached_memory()

    print(f"\nwrote {len(rows)} rows to {csv_path}\n")
    print(TABLE_LEGEND)
    print(f"read ceiling {ceilings.read_tbps:.2f} TB/s; bf16 peak {ceilings.bf16_tflops:.0f} TFLOP/s "
          f"({ceilings.bf16_source}); fp8 peak {ceilings.fp8_tflops:.0f} TFLOP/s ({ceilings.fp8_source})\n")
    print(format_table(rows))
    failed = [f"{r['format']} {r['case']} {r['method']}" for r in rows
              if r["kind"] == KIND_OURS and r["status"] == STATUS_FAIL]
    wrong = [f"{r['format']} {r['case']} {r['method']}" for r in rows if r["verified"] is False]
    if wrong:
        print(f"\nOUTPUT CHECK FAILED ({len(wrong)} rows, not timed as good): {', '.join(wrong)}", file=sys.stderr)
    if failed:
        print(f"\nour methods failed on {len(failed)} rows: {', '.join(failed)}", file=sys.stderr)
    host_bound = [f"{r['format']} {r['case']} {r['method']}" for r in rows if r["host_bound"]]
    if host_bound:
        print(f"\nhost-bound timings (marked in the CSV and the table): {', '.join(host_bound)}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
NO_GPU_STATUS = 2
NO_GPU_MESSAGE = ("python -m gbs bench needs a CUDA GPU and Numba finds none here. Run it on a GPU machine, "
                  "e.g. `scripts/gpu_run.sh bench` on the H200.")


def cmd_bench(args) -> int:
    """Handler of ``python -m gbs bench``: validates the options, then needs a GPU (status 2 without)."""
    from ..backends import gpu_available

    selection = select_cases(args.quick, args.formats, args.shapes)
    methods = select_methods(args.backends)
    if not gpu_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return NO_GPU_STATUS
    return run_bench(selection, methods, args.csv,
                     budget_s=QUICK_TIMING_BUDGET_S if args.quick else TIMING_BUDGET_S,
                     read_bytes=QUICK_READ_CEILING_BYTES if args.quick else READ_CEILING_BYTES,
                     measure_peaks=not args.skip_peaks, seed=args.seed)


def add_bench_parser(subparsers):
    """Register ``bench`` on an ``argparse`` subparsers object (``python -m gbs bench``)."""
    quick_rows = ", ".join(QUICK_CASES)
    b = subparsers.add_parser(
        "bench", help="time our kernels and the torch / Triton peers side by side on this GPU",
        description="Time our grouped block-scaled kernels (under the dispatch's config) and the peers "
                    "(torch._grouped_mm bf16, torch._scaled_grouped_mm FP8 row-wise, a Triton tl.dot_scaled "
                    "grouped loop, a device copy of the same bytes) in one process, with the streaming-read "
                    "ceiling and the dense matmul peaks measured in the same run. Prints a table last and writes "
                    "a CSV. Needs a CUDA GPU (exit status 2 without one).")
    b.add_argument("--quick", action="store_true",
                   help=f"the short run of scripts/gpu_run.sh: cases {quick_rows}; formats "
                        f"{', '.join(QUICK_FORMATS)} (under 2 minutes on an H200)")
    b.add_argument("--csv", default=None, help="output CSV (default data/bench/<date>-<gpu>.csv)")
    b.add_argument("--formats", default=None,
                   help=f"comma-separated problem formats (default {','.join(FULL_FORMATS)}; "
                        f"any of {','.join(PROBLEM_FORMATS)})")
    b.add_argument("--backends", default=None,
                   help=f"comma-separated methods to time, ours and peers (default all: {','.join(METHODS)})")
    b.add_argument("--shapes", default=None,
                   help="comma-separated cases (default all): " + "; ".join(
                       f"{c.name} = {c.label}" for c in BENCH_CASES.values()))
    b.add_argument("--skip-peaks", action="store_true",
                   help="do not measure the dense bf16 / fp8 matmul peaks; use kernels.md's 766 / 1340 TFLOP/s")
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic problems")
    b.set_defaults(func=cmd_bench)
    return b
