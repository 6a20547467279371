"""Command line: ``python -m gbs {dispatch,demo} --help``."""
from __future__ import annotations

import argparse
import sys
import time

from . import dispatch as dsp
from .lab.sweep import add_ablate_parser
from .backends import BACKENDS
from .lab.bench import add_bench_parser
from .lab.report import add_report_parser
from .formats import get_format
from .problem import PROBLEM_FORMATS, problem_format_name, problem_from_inputs, random_inputs, resolve_formats

# The demo's shapes (workloads.md): DeepSeek-V3 up / down projections and Kimi K2.5's TP-8 up-projection.
DEMO_DISPATCH_SHAPES = {"deepseek_up": (4096, 7168), "deepseek_down": (7168, 2048), "kimi_up": (512, 7168)}
DEMO_SLOTS = 64                        # active experts of one decode step (256 experts, top-8, 8+ tokens)
DEMO_AVG_M = {"decode": 4, "small_prefill": 32, "large_prefill": 256}
# The problem the demo runs: Kimi's (512, 7168) up-projection is small enough for a CPU reference.
DEMO_RUN_SHAPE = (512, 7168)
DEMO_RUN_EXPERTS = 32
DEMO_RUN_TOKENS = 24
DEMO_RUN_TOP_K = 2


def _config_row(name, avg_m, cfg):
    return (f"  {name:<14} {avg_m:>6} {cfg.regime:<14} {str(cfg.ab_swapped):<8} {cfg.mma_bn:>6} {cfg.cta_group:>4} "
            f"{cfg.num_pipeline_stages:>3} ({cfg.stages_source}, auto max {cfg.max_pipeline_stages})")


def dispatch_for_format(fmt: str, *, n: int, k: int, num_active_experts: int, estimated_total_m: int):
    """The SM100 decision for problem format ``fmt``: its pair's, or that of the pair ``dsp.route_formats`` names."""
    a_format, b_format = dsp.route_formats(*(f.name for f in resolve_formats(fmt)))
    return dsp.grouped_matmul_block_scaled_sm100_dispatch(
        a_format=a_format, b_format=b_format, n=n, k=k,
        num_active_experts=num_active_experts, estimated_total_m=estimated_total_m)


def route_note(fmt: str) -> str:
    """Says whose decision format ``fmt`` takes when the SM100 tables have no row for it; "" when they have."""
    a_format, b_format = resolve_formats(fmt)
    pair = (a_format.name, b_format.name)
    route = dsp.route_formats(*pair)
    if route == pair:
        return ""
    why = "upstream's routing has no E5M2 entry" if a_format.scaled else "tcgen05 has no bf16 x FP4 kind"
    return (f"{fmt} ({pair[0]} x {pair[1]}) has no SM100 route ({why}): this is "
            f"{problem_format_name(*map(get_format, route))}'s decision ({route[0]} x {route[1]}), which gbs's "
            "kernels take for it")


def cmd_dispatch(args) -> int:
    if args.tokens_per_expert is not None:
        counts = [int(t) for t in args.tokens_per_expert.split(",")]
        num_active, total = len(counts), sum(counts)
    else:
        if args.num_active_experts is None or args.estimated_total_m is None:
            raise SystemExit("give --tokens-per-expert, or both --num-active-experts and --estimated-total-m")
        num_active, total = args.num_active_experts, args.estimated_total_m
    if args.override:
        if args.format != "nvfp4":
            raise SystemExit("--override applies to the NVFP4 dispatch only (as upstream)")
        cfg = dsp.grouped_matmul_nvfp4_dispatch(
            n=args.n, k=args.k, num_active_experts=num_active, estimated_total_m=total, override=True,
            ab_swapped=not args.no_swap, mma_bn=args.mma_bn, cta_group=args.cta_group,
            num_pipeline_stages=args.stages)
    else:
        cfg = dispatch_for_format(args.format, n=args.n, k=args.k, num_active_experts=num_active,
                                  estimated_total_m=total)
    if not args.override and (note := route_note(args.format)):
        print(f"Note: {note}.")
    print(cfg.explain())
    print(f"mma_shape={cfg.mma_shape} cluster_shape={cfg.cluster_shape} "
          f"accum_stages={cfg.num_accum_pipeline_stages} num_sf_k_tiles={cfg.num_sf_k_tiles}")
    return 0


def _demo_shapes():
    """(shape name, N, K, active experts, average tokens per expert) of the demo's decision tables."""
    for name, (n, k) in DEMO_DISPATCH_SHAPES.items():
        slots = 8 if name == "kimi_up" else DEMO_SLOTS
        for avg_m in DEMO_AVG_M.values():
            yield name, n, k, slots, avg_m


def _print_regime_table(fmt: str) -> None:
    print(f"\n== Dispatch decisions (SM100 table, B200 shared memory), {fmt}, {DEMO_SLOTS} active experts "
          f"(kimi_up: 8) ==")
    print(f"  {'shape':<14} {'avg_m':>6} {'regime':<14} {'swapped':<8} {'mma_bn':>6} {'cg':>4} stages")
    for name, n, k, slots, avg_m in _demo_shapes():
        cfg = dispatch_for_format(fmt, n=n, k=k, num_active_experts=slots, estimated_total_m=avg_m * slots)
        print(_config_row(name, avg_m, cfg))


def _print_h200_plans(fmt: str) -> None:
    """What ``"auto"`` runs on an H200 for the same shapes (``gbs.plan.plan_h200(...).describe()``: host metadata
    only, FP4 operands re-laid as the H200 reads them)."""
    from .plan import ProblemMeta, plan_h200

    print(f"\n== What \"auto\" runs on an H200 for the same shapes, {fmt} (its plan, from host metadata) ==")
    for name, n, k, slots, avg_m in _demo_shapes():
        print(f"  {name:<14} {avg_m:>6}  {plan_h200(ProblemMeta.of(fmt, n, k, slots, avg_m)).describe()}")


def cmd_plan(args) -> int:
    from .plan import ProblemMeta, plan_h200

    meta = ProblemMeta.of(args.format, args.n, args.k, args.experts, args.tokens_per_expert, relaid=not args.packed,
                          fp8_route=args.fp8 and not args.folded, folded=args.folded)
    tile = {name: getattr(args, name) for name in ("mma_bn", "stages") if getattr(args, name) is not None}
    if args.swapped is not None:
        tile["ab_swapped"] = args.swapped == "yes"
    if args.fp8:
        tile["fp8"] = True
    plan = plan_h200(meta, backend=args.backend, **tile)
    print(plan.explain() if args.explain else plan.describe())
    return 0


def _cpu_models(text: str) -> tuple:
    from .demo import CPU_MODELS

    models = tuple(m for m in text.split(",") if m)
    if not models or any(m not in CPU_MODELS for m in models):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(CPU_MODELS)}, got {text!r}")
    return models


def cmd_demo(args) -> int:
    from . import demo
    from .backends import select_backend

    backend = select_backend(args.backend)
    print(f"gbs demo: backend {backend!r} (auto picks the H200 kernel on sm_90, the tcgen05 kernel on sm_100, "
          f"the SIMT kernel on other CUDA GPUs, else the exact CPU reference)")
    # Without a kernel to run, kernel models are checked instead; the SIMT kernel's simulator run
    # starts now, in a child process, and runs alongside the rest (demo.SimtRun says why).
    models = args.cpu_models if backend == "reference" else ()
    simt_run = demo.SimtRun(demo.DEMO_FORMATS, args.seed) if "simt" in models else None
    try:
        return _demo(args, backend, models, simt_run)
    finally:
        if simt_run is not None:
            simt_run.cancel()


def _demo(args, backend: str, models: tuple, simt_run) -> int:
    from . import demo, exactness
    from .api import grouped_matmul
    from .dispatch import dispatch_for
    from .reference import relative_errors

    formats = sorted(PROBLEM_FORMATS) if args.format == "all" else [args.format]
    for fmt in formats:
        if note := route_note(fmt):
            print(f"\n({note})")
            continue
        _print_regime_table(fmt)
        _print_h200_plans(fmt)
    checks = []
    n, k = DEMO_RUN_SHAPE
    print(f"\n== A routed MoE batch on the Kimi up-projection (N={n}, K={k}): {DEMO_RUN_TOKENS} tokens, "
          f"top-{DEMO_RUN_TOP_K} of {DEMO_RUN_EXPERTS} experts, plus one empty slot and one -1 slot ==")
    inputs = random_inputs(n=n, k=k, num_experts=DEMO_RUN_EXPERTS, total_tokens=DEMO_RUN_TOKENS,
                           routing="topk", top_k=DEMO_RUN_TOP_K, num_empty=1, num_skipped=1, seed=args.seed)
    print(f"  tokens per slot: {inputs.routing.group_sizes.tolist()}")
    print(f"  expert ids:      {inputs.routing.expert_ids.tolist()}")
    exact = inputs.unquantized_product()
    for fmt in formats:
        t0 = time.perf_counter()
        p = problem_from_inputs(inputs, fmt)
        cfg = dispatch_for(p)
        t1 = time.perf_counter()
        out = grouped_matmul(p, cfg, backend=backend)
        t2 = time.perf_counter()
        print(f"\n  [{fmt}] {p.num_active_experts} slots, {p.total_tokens} rows: {cfg.regime} -> "
              f"swapped={cfg.ab_swapped} mma_bn={cfg.mma_bn} cta_group={cfg.cta_group} "
              f"stages={cfg.num_pipeline_stages}")
        print(f"    built+quantized in {t1 - t0:.1f} s, {backend} ran in {t2 - t1:.2f} s")
        if backend != "reference":
            check = exactness.check_output(p, out, backend, fmt)
            checks.append(check)
            print(f"    check against the exact reference ({check.claim}): {check.summary()}")
            for line in check.mismatches:
                print(f"    {line}")
        else:
            written = p.written_rows()
            max_rel, rms_rel = relative_errors(out[written], exact[written])
            print(f"    quantization error of {fmt} vs the unquantized float32 matmul: "
                  f"rms {rms_rel:.2%}, max {max_rel:.2%} (a property of the format, not a kernel check)")
    if models:
        print(f"\n== No GPU here: kernel models on the CPU against the exact reference ({', '.join(models)}) ==")
        print(f"  simt: the SIMT kernel in Numba's CUDA simulator; {exactness.SIMT_EXACTNESS.claim}")
        print(f"  emulator: the SM100 tcgen05 kernel's host logic and data movement replayed on a hardware model; "
              f"{exactness.EMULATOR_EXACTNESS.claim}")
        print(f"  problem: {demo.describe_problem()}; the dispatch's config")
        print("  each output: bits vs gbs.reference, within RNE_bf16(exact -+ gamma_n * sum|a*b*scales|) per "
              "element, skipped rows still poisoned")
        checks += demo.verify_cpu_models(demo.DEMO_FORMATS, args.seed, models, simt_run)
        if simt_run is not None:
            print(f"  (the simulator's runs took {simt_run.seconds:.1f} s, alongside the rest)")
    mismatches = [m for c in checks for m in c.mismatches]
    if mismatches:
        for line in mismatches:
            print(line, file=sys.stderr)
        print(f"\nFAILED: {len(mismatches)} mismatch(es) against the exact reference")
        return 1
    if not checks:
        print("\nnothing verified: no kernel ran (give --cpu-models, or run on a GPU)")
        return 1
    ran = sorted({c.model for c in checks})
    print(f"\n{' and '.join(ran)}: {len(checks)} outputs checked against the exact reference\nverified")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gbs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("dispatch", help="print the dispatch decision and why",
                       description="Print the SM100 dispatch decision for a format, shape and token counts.")
    d.add_argument("--format", default="nvfp4", choices=sorted(PROBLEM_FORMATS))
    d.add_argument("--n", type=int, required=True, help="output columns (rows of each expert's weight)")
    d.add_argument("--k", type=int, required=True, help="reduction length in elements")
    d.add_argument("--tokens-per-expert", help="comma-separated token count of every group slot (0 for empty)")
    d.add_argument("--num-active-experts", type=int, help="group slots (with --estimated-total-m)")
    d.add_argument("--estimated-total-m", type=int, help="estimated total tokens (with --num-active-experts)")
    d.add_argument("--override", action="store_true", help="NVFP4 only: use the knobs below as upstream's override")
    d.add_argument("--no-swap", action="store_true", help="with --override: AB_swapped=False")
    d.add_argument("--mma-bn", type=int, default=8)
    d.add_argument("--cta-group", type=int, default=1)
    d.add_argument("--stages", type=int, default=-1, help="with --override: pipeline stages (-1 = auto)")
    d.set_defaults(func=cmd_dispatch)

    m = sub.add_parser("demo", help="the main job: dispatch per regime, run and check a routed MoE batch",
                       description="Show the dispatch of each regime, run the grouped matmul on the best "
                                   "backend of this machine on a routed MoE batch and check it.")
    m.add_argument("--format", default="nvfp4", choices=sorted(PROBLEM_FORMATS) + ["all"])
    m.add_argument("--backend", default="auto", choices=list(BACKENDS))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--cpu-models", type=_cpu_models, default=("simt", "emulator"),
                   help="without a GPU: the kernel models checked against the reference, comma-separated "
                        "(default simt,emulator)")
    m.set_defaults(func=cmd_demo)

    p = sub.add_parser("plan", help="what an H200 runs for a shape: kernel, knobs, split-K runs, grid",
                       description="The H200 plan (gbs.plan.plan_h200) for EXPERTS groups of TOKENS_PER_EXPERT "
                                   "tokens, from host metadata (no GPU needed; without one the grid is estimated "
                                   "from the launch bounds). --explain lists each rule and its evidence.")
    p.add_argument("--format", default="nvfp4", choices=sorted(PROBLEM_FORMATS))
    p.add_argument("--n", type=int, required=True, help="output columns (rows of each expert's weight)")
    p.add_argument("--k", type=int, required=True, help="reduction length in elements")
    p.add_argument("--experts", type=int, required=True, help="active group slots")
    p.add_argument("--tokens-per-expert", type=int, required=True)
    p.add_argument("--backend", default="auto", choices=("auto", "h200_stream", "h200_wgmma"))
    p.add_argument("--swapped", choices=("yes", "no"), help="constrain ab_swapped")
    p.add_argument("--mma-bn", type=int, help="constrain the MMA N tile")
    p.add_argument("--stages", type=int, help="constrain the ring depth (-1: the deepest that fits)")
    p.add_argument("--packed", action="store_true", help="operands as quantized, not re-laid for the H200")
    p.add_argument("--fp8", action="store_true", help="the FP8 route asked for: MXFP4 or W4A8 operands in its "
                                                     "in-kernel layout (never what auto picks), or with --folded "
                                                     "on operands folded ahead (with --mma-bn 128 or 192)")
    p.add_argument("--folded", action="store_true", help="MXFP4 or W4A8 folded ahead into E4M3 with one scale per "
                                                        "128 K (gbs.fp8_route.fold_problem): the FP8 route's own "
                                                        "operands, which auto runs on it from 33 tokens per expert")
    p.add_argument("--explain", action="store_true", help="each rule that fired and the evidence behind it")
    p.set_defaults(func=cmd_plan)

    add_bench_parser(sub)
    add_ablate_parser(sub)
    add_report_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:   # bad shapes, formats and configs: a message, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
