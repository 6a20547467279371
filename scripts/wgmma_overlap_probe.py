#!/usr/bin/env python3
"""Does other work overlap with ``wgmma`` on the H200? A probe of the 256-token consumer's pattern.

    python3 scripts/wgmma_overlap_probe.py [--csv OUT.csv]     # needs an sm_90 GPU (under a minute)

Why: the 256-token wgmma kernel's time fits "MMA time + the consumers' decode time" (diagnostic builds without the
token decode / without both decodes ran faster by about what the removed instructions cost to issue; evidence:
wgmma-decode-split), as if the decode never ran under the MMAs. This probe runs the consumer's pattern without any
decode or data: per iteration each of two warpgroups (one CTA per SM, 132 CTAs) issues 8 ``wgmma m64n128k16``
(two m64 tiles x 4 k16 steps, 64 kappa: the 256-token kernel's sub-step; B a buffer in shared memory), commits,
waits for the previous group (``wait_group 1``), then runs ``rounds`` rounds of work on 4 independent chains
(24 instructions per round) whose result becomes the A registers of the next iteration (the decode's role).

Cases (``CASES``): the kernel's pattern (``base``: A in registers, the two tiles' accumulators alternating per
k16 step, integer work); the work issued between the k16 steps (``interleaved``: a group per step); the
accumulators one tile after the other (``grouped``); A from shared memory (``ss``); the work as fp32 FMAs or
packed bf16 FMAs instead of integer shifts and XORs; a named barrier of both warpgroups per iteration as the
kernel has (``lockstep``, ``ss_lockstep``) or the warpgroups taking turns (``pingpong``, ``ss_pingpong``).
Printed per iteration: SM clocks (thread 0 of warpgroup 0), the clocks the wgmma issue took, and the same work
alone (same barriers, no MMA). Overlap means the time stays near max(MMA, work); none means their sum. Run 79
(2026-11-30, ``data/artifacts/2026-11-30-wgmma-overlap-probe-run79.csv.gz``, evidence: decode-overlap-probe): work + 0.54-0.82 x MMA in 29 of 30
points, i.e. little overlap in any arrangement.

Constraints: sm_90a, 256 threads per CTA, one CTA per SM; rounds a multiple of 4.
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import numpy as np
from numba import cuda

from gbs.lab.bench import write_csv
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline.arith import fma_bf16x2

MMA_BN = 128
K_STEPS = 4                 # 64 kappa per iteration: the 256-token kernel's sub-step
B_BUFFER_BYTES = MMA_BN * 128   # 128 rows x 64 bf16 (128B swizzle); A (ss) reads its first 64 rows
B_WORDS = B_BUFFER_BYTES // 4
SW128_ATOM = 1024
ITERS = 2048
ROUNDS = (0, 8, 16, 32)     # 24 instructions per round (4 chains x 6)
A_ONE = 0x3C003C00          # bf16 pairs of 2**-7: finite sums
A_MASK = 0x3C7F3C7F         # keeps the work's A registers finite bf16
WORKS = ("int", "fp32", "bf16x2")


class Case(NamedTuple):
    name: str
    a_source: str = "regs"      # "regs" (wgmma rs) or "smem" (ss)
    acc_order: str = "alternate"   # "alternate": lo, hi per k16 step (the kernel's); "grouped": lo x4, hi x4
    interleaved: bool = False   # a group per k16 step, a quarter of the work after each
    work: str = "int"
    sync: str = "none"          # "lockstep": a named barrier of both warpgroups before each batch (the
    # kernel's); "pingpong": the warpgroups take turns (0 issues, then 1, ...; two barriers, arrive / sync)


CASES = (Case("base"), Case("interleaved", interleaved=True), Case("grouped", acc_order="grouped"),
         Case("ss", a_source="smem"), Case("fp32_work", work="fp32"), Case("bf16x2_work", work="bf16x2"),
         Case("lockstep", sync="lockstep"), Case("ss_lockstep", a_source="smem", sync="lockstep"),
         Case("pingpong", sync="pingpong"), Case("ss_pingpong", a_source="smem", sync="pingpong"))
SYNCS = ("none", "lockstep", "pingpong")
TURN_BARRIERS = (1, 2)      # pingpong: warpgroup 1 waits on 2 (0 has issued), 0 on 1


def make_work(kind: str):
    """``work(x0..x3, rounds)``: 6 dependent instructions per chain and round that LLVM cannot fold."""
    if kind == "int":
        def round_(x):
            x ^= x << np.uint32(13)
            x ^= x >> np.uint32(17)
            x ^= x << np.uint32(5)
            return x
    elif kind == "fp32":
        def round_(x):
            f = cuda.libdevice.int_as_float(np.int32(x))   # a bit cast
            for _ in range(6):
                f = f * np.float32(0.999) + np.float32(1e-3)
            return np.uint32(cuda.libdevice.float_as_int(f))
    elif kind == "bf16x2":
        def round_(x):
            for _ in range(6):
                x = fma_bf16x2(x, np.uint32(0x3F7F3F7F), np.uint32(0x3A803A80))
            return x
    else:
        raise ValueError(f"work must be one of {WORKS}")
    round_dev = cuda.jit(device=True, forceinline=True)(round_)

    @cuda.jit(device=True, forceinline=True)
    def work(x0, x1, x2, x3, rounds):
        for _ in range(rounds):
            x0, x1, x2, x3 = round_dev(x0), round_dev(x1), round_dev(x2), round_dev(x3)
        return x0, x1, x2, x3

    return work


def make_kernel(case: Case, rounds: int, with_mma: bool):
    if rounds % K_STEPS:
        raise ValueError(f"rounds must be a multiple of {K_STEPS}")
    ss = case.a_source == "smem"
    mma = hp.wgmma_bf16_ss(MMA_BN) if ss else hp.wgmma_bf16_rs(MMA_BN)
    zero_acc = hp.wgmma_zero_accumulators(MMA_BN)
    work = make_work(case.work)
    interleaved, grouped = case.interleaved, case.acc_order == "grouped"
    if case.sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}")
    lockstep, pingpong = case.sync == "lockstep", case.sync == "pingpong"
    turn0, turn1 = TURN_BARRIERS

    if ss:   # A: the buffer's first 64 rows
        @cuda.jit(device=True, forceinline=True)
        def operand(a, b_addr, kb):
            return hp.wgmma_smem_descriptor_device(b_addr + kb * 32, 16, SW128_ATOM, "128B")
    else:
        @cuda.jit(device=True, forceinline=True)
        def operand(a, b_addr, kb):
            return a

    @cuda.jit(device=True, forceinline=True)
    def step(acc, acc_hi, a, b_addr, x0, x1, x2, x3, warpgroup, first):
        """One iteration: MMAs on A set ``a``, and the work that writes the other set."""
        if lockstep:
            cm.named_barrier_sync(turn0, 256)
        if pingpong:   # wait for the other warpgroup's turn to end
            if warpgroup == 1:
                cm.named_barrier_sync(turn1, 256)
            elif not first:
                cm.named_barrier_sync(turn0, 256)
        t0 = cm.read_clock64()
        if with_mma:
            hp.wgmma_fence()
            if grouped:
                for kb in range(K_STEPS):
                    desc = hp.wgmma_smem_descriptor_device(b_addr + kb * 32, 16, SW128_ATOM, "128B")
                    acc = mma(acc, operand(a, b_addr, kb), desc, np.uint32(1))
                for kb in range(K_STEPS):
                    desc = hp.wgmma_smem_descriptor_device(b_addr + kb * 32, 16, SW128_ATOM, "128B")
                    acc_hi = mma(acc_hi, operand(a, b_addr, kb), desc, np.uint32(1))
            else:
                for kb in range(K_STEPS):
                    desc = hp.wgmma_smem_descriptor_device(b_addr + kb * 32, 16, SW128_ATOM, "128B")
                    acc = mma(acc, operand(a, b_addr, kb), desc, np.uint32(1))
                    acc_hi = mma(acc_hi, operand(a, b_addr, kb), desc, np.uint32(1))
                    if interleaved:
                        hp.wgmma_commit_group()
                        if kb == 0:
                            hp.wgmma_wait_group_1()   # the previous iteration (the other A set) is done
                        x0, x1, x2, x3 = work(x0, x1, x2, x3, rounds // K_STEPS)
            if not interleaved:
                hp.wgmma_commit_group()
        issue = cm.read_clock64() - t0
        if pingpong:   # this warpgroup's turn ends
            cm.named_barrier_arrive(turn1 if warpgroup == 0 else turn0, 256)
        if not interleaved:
            hp.wgmma_wait_group_1()
            x0, x1, x2, x3 = work(x0, x1, x2, x3, rounds)
        new = (np.uint32(x0 & np.uint32(A_MASK)), np.uint32(x1 & np.uint32(A_MASK)),
               np.uint32(x2 & np.uint32(A_MASK)), np.uint32(x3 & np.uint32(A_MASK)))
        return acc, acc_hi, new, x0, x1, x2, x3, issue

    @cuda.jit(launch_bounds=(256, 1))
    def probe(out, clocks, iters):
        smem = cuda.shared.array(B_WORDS, dtype=np.uint32, alignment=SW128_ATOM)
        tid = cuda.threadIdx.x
        for i in range(tid, B_WORDS, 256):
            smem[i] = np.uint32(A_ONE)
        cuda.syncthreads()
        b_addr = np.uint32(cm.shared_address(smem))
        acc = zero_acc()
        acc_hi = zero_acc()
        x0, x1, x2, x3 = np.uint32(tid + 1), np.uint32(tid + 2), np.uint32(tid + 3), np.uint32(tid + 4)
        a0 = (np.uint32(A_ONE), np.uint32(A_ONE), np.uint32(A_ONE), np.uint32(A_ONE))
        issue = np.uint64(0)
        start = cm.read_clock64()
        warpgroup = tid // 128
        for i in range(iters // 2):   # pairs: the A sets alternate with static names, as in the kernel
            acc, acc_hi, a1, x0, x1, x2, x3, t = step(acc, acc_hi, a0, b_addr, x0, x1, x2, x3, warpgroup, i == 0)
            issue += t
            acc, acc_hi, a0, x0, x1, x2, x3, t = step(acc, acc_hi, a1, b_addr, x0, x1, x2, x3, warpgroup, False)
            issue += t
        if pingpong and warpgroup == 0:   # warpgroup 1's last turn
            cm.named_barrier_sync(turn0, 256)
        hp.wgmma_wait_group_0()
        acc = hp.wgmma_fence_accumulators(acc)
        acc_hi = hp.wgmma_fence_accumulators(acc_hi)
        elapsed = cm.read_clock64() - start
        # every chain stays live (with A from shared memory the A registers are unused)
        out[cuda.blockIdx.x * 256 + tid] = acc[0] + acc_hi[MMA_BN // 2 - 1] + np.float32(x0 ^ x1 ^ x2 ^ x3 ^ a0[0])
        if tid == 0:
            clocks[cuda.blockIdx.x, 0] = elapsed
            clocks[cuda.blockIdx.x, 1] = issue

    return probe


def time_case(kernel, ctas, out, clocks):
    """(clocks per iteration, issue clocks per iteration): medians over the CTAs' thread 0."""
    kernel[ctas, 256](out, clocks, 16)   # compile, warm up
    kernel[ctas, 256](out, clocks, ITERS)
    cuda.synchronize()
    c = clocks.copy_to_host()
    return float(np.median(c[:, 0])) / ITERS, float(np.median(c[:, 1])) / ITERS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv")
    parser.add_argument("--ctas", type=int, default=132)
    args = parser.parse_args(argv)
    if not cuda.is_available():
        print("needs a CUDA GPU (sm_90a)")
        return 2
    out = cuda.device_array(args.ctas * 256, np.float32)
    clocks = cuda.device_array((args.ctas, 2), np.uint64)
    rows = []
    alone = {}
    for case in CASES:
        for rounds in ROUNDS:
            key = (case.work, case.sync, rounds)   # the work alone: same work and barriers, no MMA
            if key not in alone:
                plain = Case("alone", work=case.work, sync=case.sync)
                alone[key] = time_case(make_kernel(plain, rounds, False), args.ctas, out, clocks)[0]
            both, issue = time_case(make_kernel(case, rounds, True), args.ctas, out, clocks)
            mma_only = next((r["clocks_per_iter"] for r in rows if r["case"] == case.name and r["rounds"] == 0), both)
            row = dict(case=case.name, rounds=rounds, clocks_per_iter=round(both, 1), issue_clocks=round(issue, 1),
                       work_alone_clocks=round(alone[key], 1), sum_clocks=round(mma_only + alone[key], 1))
            rows.append(row)
            print(f"{case.name:12} rounds={rounds:3}: {both:7.1f} clk/iter (issue {issue:6.1f}); work alone "
                  f"{alone[key]:7.1f}, MMA alone {mma_only:7.1f}, sum {mma_only + alone[key]:7.1f}", flush=True)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
