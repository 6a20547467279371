#!/usr/bin/env python3
"""Small cases of every GPU kernel variant, for compute-sanitizer (memcheck / racecheck) on a GPU.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_small.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_small.py [h200_stream h200_wgmma simt] [nvfp4 mxfp4 mxfp8 w4a8 w4a16 w4a16_nvfp4]
    compute-sanitizer --tool racecheck python3 scripts/sanitize_small.py h200_wgmma swapped nvfp4   # swapped tiles only
    compute-sanitizer --tool memcheck  python3 scripts/sanitize_small.py h200_wgmma swapped mxfp8_e5m2   # E5M2 tokens

Each case: a ragged problem (an empty group, a -1 slot, a 1-token group, N and group sizes that are
not multiples of the tile), output poisoned before the launch, checked against the reference. FP4 tokens
also run with both operands in the H200 order (``E2M1H200Order``: ``a_layout`` / ``b_layout``); MXFP4 also on the FP8
routes (``E2M1E4M3Order``, and folded ahead: ``gbs.fp8_route.fold_problem``, its tokens also folded on the GPU by
``gbs.numba_kernels.fold.fold_tokens``).
Exit status 1 if any case fails the acceptance check. One line per case (``PASS`` / ``FAIL`` with its id);
``--junitxml PATH`` also writes them as JUnit XML (one testcase per case, the id as its name; a case that
raises is an error there, written before the exception goes on), as ``scripts/gpu_run.sh sanitize`` does.
"""
import sys
import xml.etree.ElementTree as ET

import numpy as np

from gbs.numba_kernels import fold, h200_launch, launch, simt
from gbs.plan import plan_h200
from gbs.problem import build_problem, random_activations, random_weights
from gbs.fp8_route import fold_problem
from gbs.layouts import (LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E2M1_H200_TILED,
                         LAYOUT_E4M3_FOLDED)
from gbs.reference import check_acceptance, poison_output
from gbs.schedule import TileConfig

N, K = 200, 512
TILED_N = 256   # tiled weights need whole 128-row boxes
GROUP_SIZES = [3, 0, 1, 9, 5]
EXPERT_IDS = [2, 0, 1, -1, 3]
# ((ab_swapped, mma_bn, cta_group, stages), k_splits, num_ctas, small_n_warps): decode (decoded-token slots),
# the same on 2 CTAs (dynamic items: the producers take items from the global counter), split-K runs, 32-token
# slots (token-decode items of a whole rotation run), small prefill pair (8 warps) with split-K, not swapped,
# wide N; 8 small-N warps of 16 rows with split-K runs and on 2 CTAs
STREAM_CONFIGS = [((True, 8, 1, 2), 1, None, 4), ((True, 8, 1, 2), 1, 2, 4), ((True, 16, 1, 2), 2, None, 4),
                  ((True, 32, 1, 2), 1, None, 4), ((True, 64, 2, 3), 2, None, 4), ((False, 128, 1, 2), 1, None, 4),
                  ((True, 256, 1, 2), 1, None, 4), ((True, 16, 1, 2), 2, None, 8), ((True, 16, 1, 2), 1, 2, 8)]
WGMMA_CONFIGS = ((128, 128), (256, 128), (128, 256))   # (mma_bn, tile_tokens): 256-token tiles too
WGMMA_SWAPPED_MMA_BN = (32, 64)   # swapped tiles (weights on wgmma M): B items of 2 and 4 quarters (FP4 tokens)
# groups past 128 tokens for 256-token tiles: tiles whose second m64 tiles hold tokens (140; 300 = 256 + 44)
# besides tiles that skip them (every group above, and 300's last 44)
TWO_M_GROUP_SIZES = [3, 0, 140, 1, 300]
FORMATS = ("nvfp4", "mxfp4", "mxfp8", "w4a8")
NAMED_ONLY_FORMATS = ("mxfp8_e5m2",)   # only when named: the MXFP8 builds with the E5M2 token decode
# bf16 tokens: the builds that read them, the streaming kernel's swapped small-N tiles and the wgmma kernel's
# not-swapped ones (``bf16_tokens_reader``)
W4A16_FORMATS = ("w4a16", "w4a16_nvfp4")
ALL_FORMATS = FORMATS + NAMED_ONLY_FORMATS + W4A16_FORMATS   # in seed order: the default formats keep their seeds
DEFAULT_FORMATS = FORMATS + W4A16_FORMATS
KERNELS = ("h200_stream", "h200_wgmma", "simt")
SWAPPED_ONLY = "swapped"


def problem_for(fmt, seed, group_sizes=GROUP_SIZES, n=N):
    rng = np.random.default_rng(seed)
    return build_problem(random_activations(rng, sum(group_sizes), K), random_weights(rng, 4, n, K),
                         group_sizes, EXPERT_IDS, fmt=fmt)


def stream(problem, ab_swapped, mma_bn, cta_group, stages, *, warps=4, k_splits=None, num_ctas=None):
    """The streaming kernel with these knobs (``gbs.plan`` constraints), run on the host problem."""
    return h200_launch.run(problem, plan_h200(problem, backend="h200_stream", ab_swapped=ab_swapped, mma_bn=mma_bn,
                                              cta_group=cta_group, stages=stages, small_n_warps=warps,
                                              k_splits=k_splits, num_ctas=num_ctas))


def wgmma(problem, mma_bn, *, tile_tokens=128, ab_swapped=False, k_splits=None):
    """The wgmma kernel with these knobs (deepest ring; split-K as its plan decides unless given)."""
    return h200_launch.run(problem, plan_h200(problem, backend="h200_wgmma", mma_bn=mma_bn, tile_tokens=tile_tokens,
                                              ab_swapped=ab_swapped, k_splits=k_splits))


def folded_on_gpu(problem, folded):
    """``folded`` (``fold_problem(problem)``) run with its tokens folded on the GPU from ``problem``'s MXFP4 tokens
    (``fold.fold_tokens`` writing the launch's own token arrays, as the bench's relay does); C as bf16."""
    from numba import cuda

    device, mxfp4 = launch.to_device(folded), launch.to_device(problem)
    fold.fold_tokens(mxfp4.a, mxfp4.a_scales, mxfp4.a_offsets, mxfp4.a_scale_offsets, out=device.a,
                     out_scales=device.a_scales)
    out = poison_output(problem.total_tokens, problem.n)
    bits = cuda.to_device(out.view(np.uint16))
    h200_launch.prepare(device, plan_h200(folded, fp8=True), bits)()
    bits.copy_to_host(out.view(np.uint16))
    return out


def bf16_tokens_reader(kernel: str, knobs) -> bool:
    """Whether a case's build reads bf16 tokens: the streaming kernel's swapped small-N tiles, the wgmma kernel's
    not-swapped tiles, the SIMT kernel."""
    if kernel == "h200_stream":
        swapped, mma_bn = knobs[0][:2]
        return swapped and mma_bn <= 32
    if kernel == "h200_wgmma":
        return "swapped" not in knobs
    return True


def case_id(fmt: str, name: str, knobs) -> str:
    return f"{fmt}-{name}-{knobs}"


def write_junit(path: str, suite: str, results: list) -> None:
    """``results``: (case id, kernel, passed, message, error) per case, in order; JUnit XML at ``path``."""
    root = ET.Element("testsuite", name=suite, tests=str(len(results)),
                      failures=str(sum(1 for r in results if not r[2] and not r[4])),
                      errors=str(sum(1 for r in results if r[4])))
    for cid, kernel, passed, message, error in results:
        case = ET.SubElement(root, "testcase", classname=f"{suite}.{kernel}", name=cid)
        if error:
            ET.SubElement(case, "error", message=message).text = message
        elif not passed:
            ET.SubElement(case, "failure", message=message).text = message
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def split_junit(argv: list[str]) -> tuple[list[str], str | None]:
    """(the other arguments, the ``--junitxml`` path or None); ``--junitxml PATH`` or ``--junitxml=PATH``."""
    rest, path, it = [], None, iter(argv)
    for arg in it:
        if arg == "--junitxml":
            path = next(it, None)
            if path is None:
                raise SystemExit("--junitxml needs a path")
        elif arg.startswith("--junitxml="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return rest, path


def main(argv=None) -> int:
    argv, junit_path = split_junit(list(sys.argv[1:] if argv is None else argv))
    results = []
    try:
        return run_cases(set(argv), results)
    finally:
        if junit_path:
            write_junit(junit_path, "sanitize_small", results)


def run_cases(args: set, results: list) -> int:
    unknown = args - set(KERNELS) - set(ALL_FORMATS) - {SWAPPED_ONLY}
    if unknown:
        raise SystemExit(f"unknown arguments {sorted(unknown)}: give kernels {KERNELS} and / or formats "
                         f"{ALL_FORMATS} "
                         f"(and {SWAPPED_ONLY!r}: the swapped wgmma tiles only)")
    only_swapped = SWAPPED_ONLY in args
    kernels = (args & set(KERNELS)) or set(KERNELS)
    formats = (args & set(ALL_FORMATS)) or set(DEFAULT_FORMATS)
    failures = 0
    for seed, fmt in enumerate(ALL_FORMATS):
        if fmt not in formats:
            continue
        p = problem_for(fmt, seed)
        cases = [("h200_stream", (c, splits, ctas, warps), p,
                  lambda c=c, splits=splits, ctas=ctas, warps=warps: stream(
                      p, *c, warps=warps, k_splits=splits, num_ctas=ctas))
                 for c, splits, ctas, warps in STREAM_CONFIGS]
        cases += [("h200_wgmma", (bn, tokens), p, lambda bn=bn, tokens=tokens: wgmma(
                      p, bn, tile_tokens=tokens)) for bn, tokens in WGMMA_CONFIGS]
        cases += [("h200_wgmma", (bn, "swapped"), p, lambda bn=bn: wgmma(
                      p, bn, ab_swapped=True)) for bn in WGMMA_SWAPPED_MMA_BN]
        cases.append(("h200_wgmma", (32, "swapped", "2 split-K runs"), p, lambda: wgmma(
                      p, 32, ab_swapped=True, k_splits=2)))
        if "h200_wgmma" in kernels:   # its own problem, built only when it runs
            wide = problem_for(fmt, seed, TWO_M_GROUP_SIZES)
            cases.append(("h200_wgmma", (128, 256, TWO_M_GROUP_SIZES), wide,
                          lambda: wgmma(wide, 128, tile_tokens=256)))
        if p.a_format.packed:   # FP4 tokens and weights in the H200 order (a_layout / b_layout): the short decode
            relaid = p.with_b_layout(LAYOUT_E2M1_H200).with_a_layout(LAYOUT_E2M1_H200)
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200), relaid,
                          lambda: stream(relaid, True, 8, 1, 2)))
            boxed = problem_for(fmt, seed, n=TILED_N).with_b_layout(LAYOUT_E2M1_H200_TILED)
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200_TILED), boxed,
                          lambda: stream(boxed, True, 8, 1, 2)))
            fused = boxed.with_b_layout(LAYOUT_E2M1_H200_FUSED)   # each box followed by its scale atoms
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200_FUSED), fused,
                          lambda: stream(fused, True, 8, 1, 2)))
            if "h200_wgmma" in kernels:   # two boxes and two scale bands per stage; swapped: the fused boxes on M
                cases.append(("h200_wgmma", (256, 128, LAYOUT_E2M1_H200_FUSED), fused,
                              lambda: wgmma(fused, 256)))
                cases.append(("h200_wgmma", (32, "swapped", LAYOUT_E2M1_H200_FUSED), fused,
                              lambda: wgmma(fused, 32, ab_swapped=True)))
            if "h200_wgmma" in kernels:
                wide_relaid = wide.with_b_layout(LAYOUT_E2M1_H200).with_a_layout(LAYOUT_E2M1_H200)
                cases.append(("h200_wgmma", (128, 256, LAYOUT_E2M1_H200), wide_relaid,
                              lambda: wgmma(wide_relaid, 128, tile_tokens=256)))
        if fmt == "mxfp4" and "h200_wgmma" in kernels:   # the FP8 route: its E4M3 consumer
            route = p.with_a_layout(LAYOUT_E2M1_E4M3).with_b_layout(LAYOUT_E2M1_E4M3)
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E2M1_E4M3), route,
                          lambda: h200_launch.run(route, plan_h200(route, fp8=True), None)))
            cases.append(("h200_wgmma", (128, 256, LAYOUT_E2M1_E4M3, "bf16 route"), route,
                          lambda: wgmma(route, 128, tile_tokens=256)))
            folded = fold_problem(p)   # folded ahead: the chunk-scaled consumer, both operands from the ring
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E4M3_FOLDED), folded,
                          lambda: h200_launch.run(folded, plan_h200(folded, fp8=True, mma_bn=128), None)))
            cases.append(("h200_wgmma", (192, 128, LAYOUT_E4M3_FOLDED, "tokens folded on the GPU"), folded,
                          lambda: folded_on_gpu(p, folded)))
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E4M3_FOLDED, "cta pair sharing the weight tile"), folded,
                          lambda: h200_launch.run(folded, plan_h200(folded, fp8=True, cta_group=2, mma_bn=128), None)))
            cases.append(("h200_wgmma", (192, 128, LAYOUT_E4M3_FOLDED, "cta pair sharing the weight tile"), folded,
                          lambda: h200_launch.run(folded, plan_h200(folded, fp8=True, cta_group=2, mma_bn=192), None)))
            folded_wide = fold_problem(wide)   # groups past 128 tokens: the pair's second CTA with rows, or none
            cases.append(("h200_wgmma", (192, 128, LAYOUT_E4M3_FOLDED, "cta pair", TWO_M_GROUP_SIZES), folded_wide,
                          lambda: h200_launch.run(folded_wide, plan_h200(folded_wide, fp8=True, cta_group=2,
                                                                         mma_bn=192), None)))
            cases.append(("h200_wgmma", (192, 128, LAYOUT_E4M3_FOLDED, "one chunk set"), folded,   # N = 192 + 8
                          lambda: h200_launch.run(folded, plan_h200(folded, fp8=True), None)))   # the plan's tile
        if fmt == "w4a8" and "h200_wgmma" in kernels:   # W4A8 on the FP8 route: tokens as the wgmma A operand
            w4a8_route = p.with_b_layout(LAYOUT_E2M1_E4M3)
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E2M1_E4M3, "fp8"), w4a8_route,
                          lambda: h200_launch.run(w4a8_route, plan_h200(w4a8_route, fp8=True), None)))
            w4a8_folded = fold_problem(p)   # weights folded ahead: a promotion per k32 step
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E4M3_FOLDED, "fp8"), w4a8_folded,
                          lambda: h200_launch.run(w4a8_folded, plan_h200(w4a8_folded, fp8=True), None)))
        cases.append(("simt", (True, 8, 1), p, lambda: simt.grouped_matmul_simt(p, TileConfig(True, 8, 1))))
        if not p.a_format.scaled:   # bf16 tokens: the builds that read them, and both on fused weights
            cases = [case for case in cases if bf16_tokens_reader(*case[:2])]
            fused_bf16 = problem_for(fmt, seed, n=TILED_N).with_b_layout(LAYOUT_E2M1_H200_FUSED)
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200_FUSED), fused_bf16,
                          lambda: stream(fused_bf16, True, 8, 1, 2)))
            cases.append(("h200_wgmma", (128, 128, LAYOUT_E2M1_H200_FUSED), fused_bf16,
                          lambda: wgmma(fused_bf16, 128)))
        for name, knobs, problem, run in [case for case in cases if case[0] in kernels
                                          and (not only_swapped or "swapped" in case[1])]:
            cid = case_id(fmt, name, knobs)
            try:
                verdict = check_acceptance(problem, run())
            except BaseException as err:
                results.append((cid, name, False, f"{type(err).__name__}: {err}", True))
                print(f"{fmt:6} {name:12} {str(knobs):30} ERROR: {type(err).__name__}: {err}", flush=True)
                raise
            results.append((cid, name, verdict.passed, str(verdict), False))
            failures += not verdict.passed
            print(f"{fmt:6} {name:12} {str(knobs):30} {verdict}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
