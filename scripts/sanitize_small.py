#!/usr/bin/env python3
"""Small cases of every GPU kernel variant, for compute-sanitizer (memcheck / racecheck) on a GPU.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_small.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_small.py [h200_stream h200_wgmma simt] [nvfp4 mxfp4 mxfp8 w4a8]
    compute-sanitizer --tool racecheck python3 scripts/sanitize_small.py h200_wgmma swapped nvfp4   # swapped tiles only
    compute-sanitizer --tool memcheck  python3 scripts/sanitize_small.py h200_wgmma swapped mxfp8_e5m2   # E5M2 tokens

Each case: a ragged problem (an empty group, a -1 slot, a 1-token group, N and group sizes that are
not multiples of the tile), output poisoned before the launch, checked against the reference. FP4 tokens
also run with both operands in the H200 order (``E2M1H200Order``: ``a_layout`` / ``b_layout``).
Exit status 1 if any case fails the acceptance check.
"""
import sys

import numpy as np

from gbs.numba_kernels import h200_stream, h200_wgmma, simt
from gbs.numba_kernels.h200_stream import StreamConfig
from gbs.problem import build_problem, random_activations, random_weights
from gbs.layouts import LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E2M1_H200_TILED
from gbs.reference import check_acceptance
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
ALL_FORMATS = FORMATS + NAMED_ONLY_FORMATS   # in seed order: the default formats keep their seeds
KERNELS = ("h200_stream", "h200_wgmma", "simt")
SWAPPED_ONLY = "swapped"


def problem_for(fmt, seed, group_sizes=GROUP_SIZES, n=N):
    rng = np.random.default_rng(seed)
    return build_problem(random_activations(rng, sum(group_sizes), K), random_weights(rng, 4, n, K),
                         group_sizes, EXPERT_IDS, fmt=fmt)


def main(argv=None) -> int:
    args = set(sys.argv[1:] if argv is None else argv)
    unknown = args - set(KERNELS) - set(ALL_FORMATS) - {SWAPPED_ONLY}
    if unknown:
        raise SystemExit(f"unknown arguments {sorted(unknown)}: give kernels {KERNELS} and / or formats "
                         f"{ALL_FORMATS} "
                         f"(and {SWAPPED_ONLY!r}: the swapped wgmma tiles only)")
    only_swapped = SWAPPED_ONLY in args
    kernels = (args & set(KERNELS)) or set(KERNELS)
    formats = (args & set(ALL_FORMATS)) or set(FORMATS)
    failures = 0
    for seed, fmt in enumerate(ALL_FORMATS):
        if fmt not in formats:
            continue
        p = problem_for(fmt, seed)
        cases = [("h200_stream", (c, splits, ctas, warps), p,
                  lambda c=c, splits=splits, ctas=ctas, warps=warps: h200_stream.grouped_matmul_h200(
                      p, StreamConfig(*c, small_n_warps=warps), k_splits=splits, num_ctas=ctas))
                 for c, splits, ctas, warps in STREAM_CONFIGS]
        cases += [("h200_wgmma", (bn, tokens), p, lambda bn=bn, tokens=tokens: h200_wgmma.grouped_matmul_h200(
                      p, h200_wgmma.WgmmaConfig(bn, tile_tokens=tokens))) for bn, tokens in WGMMA_CONFIGS]
        cases += [("h200_wgmma", (bn, "swapped"), p, lambda bn=bn: h200_wgmma.grouped_matmul_h200(
                      p, h200_wgmma.WgmmaConfig(bn, ab_swapped=True))) for bn in WGMMA_SWAPPED_MMA_BN]
        cases.append(("h200_wgmma", (32, "swapped", "2 split-K runs"), p, lambda: h200_wgmma.grouped_matmul_h200(
                      p, h200_wgmma.WgmmaConfig(32, ab_swapped=True), k_splits=2)))
        if "h200_wgmma" in kernels:   # its own problem, built only when it runs
            wide = problem_for(fmt, seed, TWO_M_GROUP_SIZES)
            cases.append(("h200_wgmma", (128, 256, TWO_M_GROUP_SIZES), wide,
                          lambda: h200_wgmma.grouped_matmul_h200(wide, h200_wgmma.WgmmaConfig(128, tile_tokens=256))))
        if p.a_format.packed:   # FP4 tokens and weights in the H200 order (a_layout / b_layout): the short decode
            relaid = p.with_b_layout(LAYOUT_E2M1_H200).with_a_layout(LAYOUT_E2M1_H200)
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200), relaid,
                          lambda: h200_stream.grouped_matmul_h200(relaid, StreamConfig(True, 8, 1, 2))))
            boxed = problem_for(fmt, seed, n=TILED_N).with_b_layout(LAYOUT_E2M1_H200_TILED)
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200_TILED), boxed,
                          lambda: h200_stream.grouped_matmul_h200(boxed, StreamConfig(True, 8, 1, 2))))
            fused = boxed.with_b_layout(LAYOUT_E2M1_H200_FUSED)   # each box followed by its scale atoms
            cases.append(("h200_stream", ((True, 8, 1, 2), LAYOUT_E2M1_H200_FUSED), fused,
                          lambda: h200_stream.grouped_matmul_h200(fused, StreamConfig(True, 8, 1, 2))))
            if "h200_wgmma" in kernels:   # two boxes and two scale bands per stage; swapped: the fused boxes on M
                cases.append(("h200_wgmma", (256, 128, LAYOUT_E2M1_H200_FUSED), fused,
                              lambda: h200_wgmma.grouped_matmul_h200(fused, h200_wgmma.WgmmaConfig(256))))
                swapped_32 = h200_wgmma.WgmmaConfig(32, ab_swapped=True)
                cases.append(("h200_wgmma", (32, "swapped", LAYOUT_E2M1_H200_FUSED), fused,
                              lambda: h200_wgmma.grouped_matmul_h200(fused, swapped_32)))
            if "h200_wgmma" in kernels:
                wide_relaid = wide.with_b_layout(LAYOUT_E2M1_H200).with_a_layout(LAYOUT_E2M1_H200)
                cases.append(("h200_wgmma", (128, 256, LAYOUT_E2M1_H200), wide_relaid,
                              lambda: h200_wgmma.grouped_matmul_h200(wide_relaid,
                                                                     h200_wgmma.WgmmaConfig(128, tile_tokens=256))))
        cases.append(("simt", (True, 8, 1), p, lambda: simt.grouped_matmul_simt(p, TileConfig(True, 8, 1))))
        for name, knobs, problem, run in [case for case in cases if case[0] in kernels
                                          and (not only_swapped or "swapped" in case[1])]:
            verdict = check_acceptance(problem, run())
            failures += not verdict.passed
            print(f"{fmt:6} {name:12} {str(knobs):30} {verdict}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
