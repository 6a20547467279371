#!/usr/bin/env python3
"""How long the GPU token fold takes: ``gbs.numba_kernels.fold.fold_tokens`` alone, on the bench cases' MXFP4 tokens.

    python3 scripts/fold_tokens_time.py [--cases large_prefill_up large_prefill_down] [--csv OUT.csv]   # an sm_90 GPU

Why: the folded FP8 route reads tokens folded into E4M3 with one scale per 128-K chunk; where they arrive as MXFP4
the bench method ``gbs_fp8_folded_relay`` folds them inside each timed call, and this says what that fold alone
costs, against the bytes it must move (FP4 bytes and scale atoms in, E4M3 bytes and atoms out).
Per case: the fold is checked bit-identical to the host fold (``gbs.fp8_route.fold_problem_tokens``) first, then
timed with CUDA events after warm-up (``gbs.lab.timing.time_launches``), its inputs and outputs rotated over copies
spanning 4x the L2. One CSV row per case (GPU, date, commit, median / p10 / p90 us, TB/s of the bytes moved).

Constraints: MXFP4 cases (K a multiple of 32).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from gbs.fp8_route import fold_problem_tokens
from gbs.lab.bench import write_csv
from gbs.lab.cases import BENCH_CASES
from gbs.lab.environment import environment_fields
from gbs.lab.timing import device_l2_bytes, rotation_count, time_launches

DEFAULT_CASES = ("large_prefill_up", "large_prefill_down", "gptoss_prefill_up")


def moved_bytes(problem) -> int:
    """Bytes the fold must read and write: FP4 tokens in, E4M3 tokens out (one byte per element), the atoms both
    ways (copied, then each token's chunk words rewritten)."""
    return problem.a.nbytes + problem.total_tokens * problem.k + 2 * problem.a_scales.nbytes


def time_case(name: str) -> dict:
    from numba import cuda

    from gbs.numba_kernels import fold
    from gbs.numba_kernels.launch import to_device

    problem = BENCH_CASES[name].problem("mxfp4")
    host_a, host_scales = fold_problem_tokens(problem)
    moved = moved_bytes(problem)
    copies = rotation_count(moved, device_l2_bytes())
    inputs = [to_device(problem) for _ in range(copies)]
    outs = [(cuda.device_array((problem.total_tokens, problem.k), np.uint8),
             cuda.device_array(problem.a_scales.shape, np.uint8)) for _ in range(copies)]

    def launch(i):
        d = inputs[i]
        fold.fold_tokens(d.a, d.a_scales, d.a_offsets, d.a_scale_offsets, out=outs[i][0], out_scales=outs[i][1])

    launch(0)
    cuda.synchronize()
    if not ((outs[0][0].copy_to_host() == host_a).all() and (outs[0][1].copy_to_host() == host_scales).all()):
        raise SystemExit(f"{name}: the GPU fold differs from the host fold: not timed")
    timing = time_launches(launch, num_inputs=copies)
    return dict(case=name, tokens=problem.total_tokens, k=problem.k, copies=copies,
                median_us=round(timing.median_us, 2), p10_us=round(timing.p10_us, 2),
                p90_us=round(timing.p90_us, 2), moved_bytes=moved,
                tb_per_s=round(moved / timing.median_us / 1e6, 3), host_bound=timing.host_bound)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=sorted(BENCH_CASES))
    parser.add_argument("--csv", help="write the rows here")
    args = parser.parse_args(argv)
    env = environment_fields()
    rows = []
    for name in args.cases:
        row = time_case(name)
        rows.append({**env, **row})
        print(f"{name:20} {row['tokens']}x{row['k']}: {row['median_us']:.1f} us (p10 {row['p10_us']:.1f}, "
              f"p90 {row['p90_us']:.1f}), {row['tb_per_s']:.2f} TB/s, bit-identical to the host fold", flush=True)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
