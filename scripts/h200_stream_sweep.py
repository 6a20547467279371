#!/usr/bin/env python3
"""Time the H200 streaming kernel over explicit knob sets, including the H200-only ones the dispatch
does not have (split-K runs, grid size), on the benchmark's shapes; for tuning the H200 mapping.

    python3 scripts/h200_stream_sweep.py --csv $OUT/sweep.csv \\
        nvfp4:decode_up:T:8:1:2:auto  nvfp4:kimi_decode:T:8:1:2:1  nvfp4:kimi_decode:T:8:1:2:7

Each point is ``format:case:ab_swapped(T/F):mma_bn:cta_group:stages:k_splits`` (``k_splits``: an int
or ``auto``; a point may add ``:num_ctas``, and end in ``:w8`` for 8 small-N consumer warps:
``StreamSpec.small_n_warps``),
``wgmma:format:case:mma_bn:stages[:num_ctas][:t256][:swap][:k<runs>|:kauto]`` for the wgmma kernel
(``h200_wgmma``; stages an int or ``auto``; ``:swap`` = weights on wgmma M; ``:k4`` = 4 split-K runs per swapped
tile, ``:kauto`` = ``gbs.plan.swapped_k_splits``), or ``plan:backend:format:case[:cg2|:cg2n128|:n128|:n192]``
for what ``gbs.plan.plan_h200(problem, None, backend)`` runs (backend ``auto``, ``h200_stream`` or
``h200_wgmma``: the kernels' measured plans; ``:cg2``: ``fp8=True, cta_group=2``, the folded FP8 route on CTA
pairs on the plan's tile width (2 x 128 tokens x 192 weight rows on operands folded ahead; before the pair took 192
rows, ``:cg2`` ran 128); ``:cg2n128``: the pair on 128-row tiles (``mma_bn=128``); ``:n128`` / ``:n192``:
``fp8=True, mma_bn=128|192``, one CTA per 128 x 128 tile or per 128 x 192 tile (the plan's own on operands folded
ahead); ``:nopromo`` / ``:nomma``: that 128 x 192 tile's timing-only builds without its per-slice promotion or without
its MMAs, ``h200_wgmma.DIAGNOSTICS``: their outputs are wrong). A case is a name of ``gbs.lab.cases.BENCH_CASES`` or
``N,K,slots,tokens_per_expert`` (e.g. ``4096,7168,32,64``: where the kernel choice flips). Timing is the
benchmark's (``gbs.lab.timing.time_launches``: CUDA events, warm-up, input sets rotated past L2, medians),
and the streaming-read ceiling is measured in the same run. ``--trace DIR`` also runs each streaming point's
start-up trace build (``h200_trace.TRACE_EVENTS``: where a launch's fixed time goes); ``--series CSV`` writes
every timed launch (input set, us) in issue order. ``--pdl 1`` plans every point with ``pdl=True``: each timed
launch is a programmatic dependent launch (``gbs.plan.H200Plan.pdl``); ``--back-to-back N`` times N launches per
pair of CUDA events (``time_launches(back_to_back=N)``): an event recorded between two launches may keep a PDL
launch from overlapping the one before, so compare PDL with and without it at the same N (through
``scripts/compare_variants.py``: ``pdl=DIR:--pdl=1,--back-to-back=10`` beside ``base=DIR:--back-to-back=10``).
Needs an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

from gbs.lab.bench import write_csv
from gbs.lab.cases import BENCH_CASES, BenchCase, useful_bytes, useful_flops
from gbs.lab.environment import environment_fields
from gbs.lab.timing import device_l2_bytes, measure_read_bandwidth, rotation_count, time_launches
from gbs.dispatch import AUTO_STAGES
from gbs.fp8_route import fold_problem
from gbs.layouts import LAYOUT_E4M3_FOLDED, LAYOUT_PACKED, OPERAND_LAYOUTS
from gbs.numba_kernels import h200_launch, h200_ring, h200_trace, h200_wgmma
from gbs.numba_kernels.launch import to_device
from gbs.plan import plan_h200


PLAN_BACKENDS = ("auto", "h200_stream", "h200_wgmma")


class SweepPoint(NamedTuple):
    fmt: str
    case: BenchCase
    config: object          # gbs.plan constraints (a dict with the backend), or a plan's backend name
    k_splits: int | None = None
    num_ctas: int | None = None


def parse_case(text: str, point: str) -> BenchCase:
    """A ``BENCH_CASES`` name or ``N,K,slots,tokens_per_expert``."""
    if text in BENCH_CASES:
        return BENCH_CASES[text]
    fields = text.split(",")
    if len(fields) != 4 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"point {point!r}: case {text!r} is neither one of {sorted(BENCH_CASES)} "
                         f"nor N,K,slots,tokens_per_expert (positive integers)")
    return BenchCase(text.replace(",", "x"), *map(int, fields))


def parse_wgmma_point(text: str):
    parts = text.split(":")
    k_splits = 1   # split-K runs (swapped tiles): a last ":k<runs>" or ":kauto" (gbs.plan.swapped_k_splits)
    if parts[-1] == "kauto" or (parts[-1].startswith("k") and parts[-1][1:].isdigit()):
        runs = parts.pop()[1:]
        k_splits = None if runs == "auto" else int(runs)
    swapped = parts[-1] == "swap"
    if swapped:
        parts.pop()
    tile_tokens = h200_wgmma.TILE_TOKENS[0]
    if parts[-1].startswith("t") and parts[-1][1:].isdigit():
        tile_tokens = int(parts.pop()[1:])
    if len(parts) not in (5, 6):
        raise ValueError(f"point {text!r}: want wgmma:format:case:mma_bn:stages[:num_ctas][:t256][:swap]"
                         f"[:k<runs>|:kauto]")
    _, fmt, case, bn, stages = parts[:5]
    legal = h200_wgmma.SWAPPED_MMA_BN if swapped else h200_wgmma.WGMMA_MMA_BN
    if int(bn) not in legal:
        raise ValueError(f"point {text!r}: the wgmma kernel takes mma_bn in {legal} with ab_swapped={swapped}")
    config = dict(backend="h200_wgmma", mma_bn=int(bn), stages=AUTO_STAGES if stages == "auto" else int(stages),
                  tile_tokens=tile_tokens, ab_swapped=swapped)
    num_ctas = int(parts[5]) if len(parts) == 6 else None
    return SweepPoint(fmt, parse_case(case, text), config, k_splits, num_ctas=num_ctas)


# a plan point's last field: the folded FP8 route with a knob of its own (plan_h200(fp8=True, ...)), or one of its
# 192-row tile's diagnostic builds (h200_wgmma.DIAGNOSTIC_TAGS)
FP8_ROUTE_SUFFIXES = {"cg2": dict(cta_group=2), "cg2n128": dict(cta_group=2, mma_bn=h200_wgmma.FP8_MMA_BN),
                      "n128": dict(mma_bn=h200_wgmma.FP8_MMA_BN), "n192": dict(mma_bn=h200_wgmma.FOLDED_WIDE_MMA_BN),
                      **{tag: dict(diagnostic=name) for tag, name in h200_wgmma.DIAGNOSTIC_TAGS.items()}}


def parse_plan_point(text: str):
    parts = text.split(":")
    route = FP8_ROUTE_SUFFIXES.get(parts[-1])
    if route is not None:
        parts.pop()
    if len(parts) != 4 or parts[1] not in PLAN_BACKENDS:
        raise ValueError(f"point {text!r}: want plan:backend:format:case[:{'|:'.join(FP8_ROUTE_SUFFIXES)}], backend in "
                         f"{PLAN_BACKENDS}")
    _, backend, fmt, case = parts
    config = backend if route is None else dict(backend=backend, fp8=True, **route)
    return SweepPoint(fmt, parse_case(case, text), config)


def plan_of(problem, config, k_splits=None, num_ctas=None, pdl=False):
    """The plan a point's ``config`` (a backend name, or constraints with the backend) runs ``problem`` with;
    ``pdl``: its launches programmatic dependent launches."""
    if isinstance(config, str):
        return plan_h200(problem, None, config, pdl=pdl)
    constraints = dict(config)
    return plan_h200(problem, backend=constraints.pop("backend"), num_ctas=num_ctas, k_splits=k_splits, pdl=pdl,
                     **constraints)


def parse_point(text: str):
    if text.startswith("wgmma:"):
        return parse_wgmma_point(text)
    if text.startswith("plan:"):
        return parse_plan_point(text)
    parts = text.split(":")
    small_n_warps = h200_ring.CONSUMER_WARPS_SMALL_N
    if parts[-1].startswith("w") and parts[-1][1:].isdigit():
        small_n_warps = int(parts.pop()[1:])
    if len(parts) not in (7, 8):
        raise ValueError(f"point {text!r}: want format:case:T|F:mma_bn:cta_group:stages:k_splits[:num_ctas][:w8]")
    fmt, case, swapped, bn, cg, stages, splits = parts[:7]
    if swapped not in ("T", "F"):
        raise ValueError(f"point {text!r}: ab_swapped T or F")
    config = dict(backend="h200_stream", ab_swapped=swapped == "T", mma_bn=int(bn), cta_group=int(cg),
                  stages=int(stages), small_n_warps=small_n_warps)
    k_splits = None if splits == "auto" else int(splits)
    num_ctas = int(parts[7]) if len(parts) == 8 else None
    return SweepPoint(fmt, parse_case(case, text), config, k_splits, num_ctas)


def trace_point(directory: str, text: str, problem, first, copies: int, budget_s: float, back_to_back: int) -> None:
    """Run the trace build of ``first``'s launch (same spec, grid and split-K runs) as the bench times it,
    then print the per-CTA phases of the last launch of every input copy and save the stamps."""
    import pathlib

    import numpy as np
    from numba import cuda

    spec, plan = first.plan.spec, first.plan
    traced_plan = plan_h200(problem, backend="h200_stream", ab_swapped=spec.ab_swapped, mma_bn=spec.mma_bn,
                            cta_group=spec.cta_group, stages=spec.stages, small_n_warps=spec.small_n_warps,
                            num_ctas=plan.num_ctas, k_splits=plan.k_splits, trace=True, pdl=plan.pdl)
    traced = [h200_launch.prepare(to_device(problem), traced_plan) for _ in range(copies)]
    timing = time_launches(lambda i: traced[i](), num_inputs=copies, budget_s=budget_s, back_to_back=back_to_back)
    cuda.synchronize()
    records = np.stack([launch.trace_buffer.copy_to_host() for launch in traced])   # (copies, ctas, events, 2)
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / (text.replace(":", "_").replace(",", "x") + ".npy"), records)
    print(f"    trace build {timing.median_us:.1f} us; " + "\n".join(trace_summary(records)))


def trace_summary(records) -> list[str]:
    """Lines of phase medians / p10 / p90 (ns) over the CTAs of every launch in ``records`` ((launches, ctas,
    events, 2) stamps; launches whose buffer was never written, input copies the timing did not reach, are left
    out); the phases are ``h200_trace.trace_phases``' of each launch, so skew and span stay per launch."""
    import numpy as np

    launched = [r for r in records if r[:, :, 0].any()]
    if not launched:
        return ["no launch wrote its trace"]
    per_launch = [h200_trace.trace_phases(r) for r in launched]
    lines = [f"ns, median / p10 / p90 over the CTAs of {len(launched)} launches (the last launch of each input copy):"]
    for phase in per_launch[0]:
        values = np.concatenate([phases[phase] for phases in per_launch])
        values = values[~np.isnan(values)]
        if values.size:
            p10, median, p90 = np.percentile(values, (10, 50, 90))
            lines.append(f"      {phase:36} {median:9.0f} {p10:9.0f} {p90:9.0f}   ({values.size} CTAs)")
    return lines


def series_rows(point: str, timing, env: dict) -> list[dict]:
    """One row per timed launch of ``point`` in issue order (``Timing.series``), naming the GPU and build."""
    return [dict(point=point, launch=i, input_set=input_set, us=us, gpu_uuid=env["gpu_uuid"], commit=env["commit"])
            for i, (input_set, us) in enumerate(timing.series)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="+")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--budget-s", type=float, default=1.0, help="timed seconds per point")
    parser.add_argument("--b-layout", default=LAYOUT_PACKED, choices=sorted(OPERAND_LAYOUTS),
                        help="weights re-laid once before timing (GroupedProblem.with_b_layout; FP4 weights); "
                             f"{LAYOUT_E4M3_FOLDED}: MXFP4 tokens and weights folded ahead (gbs.fp8_route.fold_problem)")
    parser.add_argument("--a-layout", default=LAYOUT_PACKED, choices=sorted(OPERAND_LAYOUTS),
                        help="tokens in this order, as their quantizer would write them (GroupedProblem.with_a_layout; "
                             "FP4 tokens; untimed, as the quantization is)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="streaming-kernel points: also run the start-up trace build (h200_trace.TRACE_EVENTS) "
                             "with the same grid, print its phases and save the stamps as DIR/<point>.npy")
    parser.add_argument("--series", default=None, metavar="CSV",
                        help="also write every timed launch's time, in issue order (does one point run in modes "
                             "or streaks?)")
    parser.add_argument("--pdl", type=int, choices=(0, 1), default=0,
                        help="1: every point planned with pdl=True, each timed launch a programmatic dependent launch "
                             "(a value, not a flag, so that compare_variants' --pdl=1 items reach it)")
    parser.add_argument("--back-to-back", type=int, default=1, metavar="N",
                        help="launches between one pair of CUDA events, each timed as the pair's time / N (default 1: "
                             "events around every launch)")
    args = parser.parse_args(argv)
    if args.back_to_back < 1:
        parser.error("--back-to-back must be >= 1")
    pdl = bool(args.pdl)
    points = [parse_point(p) for p in args.points]
    read_tbps, _ = measure_read_bandwidth()
    l2 = device_l2_bytes()
    env = environment_fields()
    print(f"streaming read ceiling {read_tbps:.2f} TB/s (measured now on {env['gpu']} {env['gpu_uuid']})")
    rows, problems, series = [], {}, []
    for text, (fmt, case, config, k_splits, num_ctas) in zip(args.points, points):
        key = (fmt, case.name)
        if key not in problems:
            problems[key] = case.problem(fmt)
            if args.b_layout == LAYOUT_E4M3_FOLDED:   # both operands folded ahead (MXFP4 only; untimed)
                problems[key] = fold_problem(problems[key])
            elif args.b_layout != LAYOUT_PACKED and problems[key].b_format.packed:
                problems[key] = problems[key].with_b_layout(args.b_layout)
            if args.a_layout != LAYOUT_PACKED and problems[key].a_format.packed:
                problems[key] = problems[key].with_a_layout(args.a_layout)
        problem = problems[key]
        copies = rotation_count(sum(problem.nbytes().values()), l2)
        try:
            plan = plan_of(problem, config, k_splits, num_ctas, pdl=pdl)
            launches = [h200_launch.prepare(to_device(problem), plan) for _ in range(copies)]
            timing = time_launches(lambda i: launches[i](), num_inputs=copies, budget_s=args.budget_s,
                                   back_to_back=args.back_to_back)
        except Exception as err:   # a point that does not build or run: recorded, the sweep goes on
            print(f"{text:44} {type(err).__name__}: {err}", flush=True)
            rows.append(dict(point=text, status="fail", note=f"{type(err).__name__}: {err}"))
            continue
        first = launches[0].plan
        gbps = useful_bytes(problem) / (timing.median_us * 1e3)
        tflops = useful_flops(problem) / (timing.median_us * 1e6)
        spec = first.ring
        row = dict(point=text, status="ok", format=fmt, case=case.name, b_layout=problem.b_layout, a_layout=problem.a_layout, ab_swapped=spec.ab_swapped,
                   mma_bn=spec.mma_bn, cta_group=spec.cta_group, stages=spec.stages,
                   k_splits=first.k_splits, num_ctas=first.num_ctas, pdl=first.pdl, back_to_back=args.back_to_back,
                   consumer_warps=spec.consumer_warps if first.kernel == "h200_stream" else None,
                   median_us=timing.median_us,
                   p10_us=timing.p10_us, p90_us=timing.p90_us, gbps=gbps, tflops=tflops,
                   read_ceiling_fraction=gbps / (read_tbps * 1e3), read_ceiling_tbps=read_tbps, **env)
        rows.append(row)
        series += series_rows(text, timing, env)
        print(f"{text:44} {timing.median_us:9.1f} us  {gbps:7.0f} GB/s  {100 * row['read_ceiling_fraction']:5.1f} %"
              f"  {tflops:6.1f} TFLOP/s  ctas {first.num_ctas} splits {first.k_splits}", flush=True)
        if args.csv:   # after every point: a call cut at its time limit keeps what it measured
            write_csv(args.csv, [r for r in rows if r["status"] == "ok"])
        if args.trace and first.kernel == "h200_stream" and first.max_tiles:
            trace_point(args.trace, text, problem, launches[0], copies, args.budget_s, args.back_to_back)
    if args.series:
        write_csv(args.series, series)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
