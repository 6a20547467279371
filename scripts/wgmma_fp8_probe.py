#!/usr/bin/env python3
"""The FP8 route's two open facts on the H200, measured before its kernel is written (issue 31 item 3;
``docs/design/h200_port.md``, "The FP8 route: the decode, and what the kernel must cost").

    python3 scripts/wgmma_fp8_probe.py [--csv OUT.csv]      # needs an sm_90 GPU (under a minute)

1. **Precision** (``precision``): does ``wgmma ... .e4m3`` add E4M3 products exactly into its fp32 accumulator?
   One warpgroup, ``m64n8k32`` from shared memory: row 0 of A times column 0 of B holds a large product (k = 0) and a
   small one 2^-g below it, in the same k32 instruction (k = 1) or in the next one accumulated onto it (k = 32,
   ``scale_d = 1``), every other element zero. Printed per gap g: whether ``acc == big + small`` exactly. The largest
   g that survives is how many bits below the largest product the tensor core keeps (the DeepSeek-V3 report: about
   14); ``gbs.fp8_route`` needs each 128-K chunk sum exact (``chunk_sum_bits_needed``), or a stated ``eps_chunk``.
2. **Cost** (``throughput``): 132 CTAs x 2 warpgroups, per iteration 128 K of a 64 x 128 tile per warpgroup, A and
   B in shared memory: bf16 (8 x k16) against e4m3 (4 x k32); and e4m3 with the route's promotion (a chunk
   accumulator set zeroed by the first step, then ``total += chunk * factor`` per accumulator): serial (wait for
   the chunk, then promote), or two chunk sets in turn (promote the previous chunk while this one runs), with one
   FFMA per accumulator (a factor per row and tile) or FMUL + FFMA (a factor per row and column). Printed: SM clocks
   per iteration (thread 0 of warpgroup 0, median over CTAs) and FLOP per SM clock.

Constraints: sm_90a; 128 threads (precision), 256 (throughput), one CTA per SM.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic

import ml_dtypes

from gbs.lab.bench import write_csv
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import hopper as hp

ROW_BYTES = 128             # one 128B-swizzled row: 128 e4m3 (one 128-K chunk) or 64 bf16
SW128_ATOM = 1024
PRECISION_N = 8
MMA_BN = 128
CHUNK_STEPS = 4             # k32 steps per 128-K chunk
BF16_STEPS = 8              # k16 steps of the same 128 K
A_ROWS, B_ROWS = 64, MMA_BN
A_WORDS = A_ROWS * ROW_BYTES // 4
PRECISION_B_WORDS = PRECISION_N * ROW_BYTES // 4
SMEM_WORDS = (A_ROWS + B_ROWS) * ROW_BYTES // 4
ITERS = 1024
E4M3_ONE = 0x38
VARIANTS = ("bf16", "e4m3", "e4m3_promote_serial", "e4m3_promote_overlap", "e4m3_promote_overlap_2ops",
            "e4m3_promote_k32_overlap")


# ----------------------------------------------------------------------------------------------
# 1. Precision
# ----------------------------------------------------------------------------------------------
def e4m3_byte(value: float) -> int:
    byte = int(np.array([value], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0])
    if float(np.array([byte], np.uint8).view(ml_dtypes.float8_e4m3fn)[0]) != value:
        raise ValueError(f"{value} is not an E4M3 number")
    return byte


def sw128_words(rows: int, entries: dict) -> np.ndarray:
    """uint32 words of a 128B-swizzled K-major tile of ``rows`` x 128 bytes with byte ``entries[(row, k)]``."""
    tile = np.zeros(rows * ROW_BYTES, np.uint8)
    for (row, k), byte in entries.items():
        tile[hp.kmajor_sw128_offset(row, k)] = byte
    return tile.view("<u4").copy()


def gap_operands(gap: int, same_instruction: bool):
    """(A words, B words, big, small): products 2^(2s) at k = 0 and 2^-(u + v) at k = 1 (same instruction) or 32
    (the next), with 2s + u + v = gap; s <= 8, u, v <= 9 (E4M3's range down to its smallest subnormal)."""
    s = min(8, gap // 2)
    u = min(9, gap - 2 * s)
    v = gap - 2 * s - u
    k_small = 1 if same_instruction else 32
    a = {(0, 0): e4m3_byte(2.0 ** s), (0, k_small): e4m3_byte(2.0 ** -u)}
    b = {(0, 0): e4m3_byte(2.0 ** s), (0, k_small): e4m3_byte(2.0 ** -v)}
    return sw128_words(A_ROWS, a), sw128_words(PRECISION_N, b), 2.0 ** (2 * s), 2.0 ** -(u + v)


PRECISION_MMA = hp.wgmma_e4m3_ss(PRECISION_N)
PRECISION_ZERO = hp.wgmma_zero_accumulators(PRECISION_N)


def precision_kernel(a_words, b_words, steps, out):
    """One warpgroup: ``steps`` k32 wgmma steps (the first with scale_d = 0) of A (64 rows) x B (8 rows); thread 0's
    accumulator 0 (row 0, column 0) to ``out[0]``."""
    smem_a = cuda.shared.array(A_WORDS, dtype=np.uint32, alignment=SW128_ATOM)
    smem_b = cuda.shared.array(PRECISION_B_WORDS, dtype=np.uint32, alignment=SW128_ATOM)
    tid = cuda.threadIdx.x
    for i in range(tid, a_words.size, 128):
        smem_a[i] = a_words[i]
    for i in range(tid, b_words.size, 128):
        smem_b[i] = b_words[i]
    cm.fence_proxy_async_shared_cta()
    cuda.syncthreads()
    a_addr, b_addr = np.uint32(cm.shared_address(smem_a)), np.uint32(cm.shared_address(smem_b))
    acc = PRECISION_ZERO()
    hp.wgmma_fence()
    for kb in range(steps):
        desc_a = hp.wgmma_smem_descriptor_device(a_addr + kb * 32, 16, SW128_ATOM, "128B")
        desc_b = hp.wgmma_smem_descriptor_device(b_addr + kb * 32, 16, SW128_ATOM, "128B")
        acc = PRECISION_MMA(acc, desc_a, desc_b, np.uint32(kb))
    hp.wgmma_commit_group()
    hp.wgmma_wait_group_0()
    acc = hp.wgmma_fence_accumulators(acc)
    if tid == 0:
        out[0] = acc[0]


def precision(rows: list) -> None:
    kernel = cuda.jit(precision_kernel)
    out = cuda.device_array(1, np.float32)
    for same in (True, False):
        kept = []
        for gap in range(0, 35):
            a, b, big, small = gap_operands(gap, same)
            kernel[1, 128](cuda.to_device(a), cuda.to_device(b), 1 if same else 2, out)
            got = float(out.copy_to_host()[0])
            exact = got == big + small
            representable = float(np.float32(big + small)) == big + small
            kept.append(exact)
            rows.append(dict(part="precision", case="same_instruction" if same else "next_instruction", gap=gap,
                             got=repr(got), exact=big + small, kept=exact, fp32_representable=representable))
        survived = [g for g, k in enumerate(kept) if k]
        print(f"precision, small product {'in the same' if same else 'in the next'} k32 instruction: kept exactly "
              f"for gaps {survived[:1]}..{max(survived) if survived else None}; first lost at "
              f"{next((g for g, k in enumerate(kept) if not k), None)} (fp32 keeps 23)", flush=True)


# ----------------------------------------------------------------------------------------------
# 2. Cost
# ----------------------------------------------------------------------------------------------
def _fma_tuple(builder, total, chunk, factor_of, ty):
    out = ir.Constant(ty, ir.Undefined)
    for i in range(len(total.type.elements) if hasattr(total.type, "elements") else total.type.count):
        out = builder.insert_value(out, builder.fma(builder.extract_value(chunk, i), factor_of(i),
                                                    builder.extract_value(total, i)), i)
    return out


@intrinsic
def promote_by_row(typingctx, total, chunk, factor):
    """``total[i] + chunk[i] * factor``: one FFMA per accumulator (a factor per row and tile)."""
    def codegen(context, builder, sig, args):
        t, c, f = args
        return _fma_tuple(builder, t, c, lambda i: f, context.get_value_type(sig.return_type))

    return total(total, chunk, factor), codegen


@intrinsic
def promote_by_element(typingctx, total, chunk, factors, factor):
    """``total[i] + chunk[i] * (factors[i] * factor)``: FMUL + FFMA per accumulator (a factor per row and
    column)."""
    def codegen(context, builder, sig, args):
        t, c, fs, f = args
        return _fma_tuple(builder, t, c, lambda i: builder.fmul(builder.extract_value(fs, i), f),
                          context.get_value_type(sig.return_type))

    return total(total, chunk, factors, factor), codegen


@intrinsic
def tuple_sum(typingctx, values):
    """The sum of a float32 tuple's fields: every accumulator stays live (nothing of the loop is dead code)."""
    def codegen(context, builder, sig, args):
        total = builder.extract_value(args[0], 0)
        for i in range(1, sig.args[0].count):
            total = builder.fadd(total, builder.extract_value(args[0], i))
        return total

    return values.dtype(values), codegen


def make_throughput_kernel(variant: str):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    bf16 = variant == "bf16"
    mma = hp.wgmma_bf16_ss(MMA_BN) if bf16 else hp.wgmma_e4m3_ss(MMA_BN)
    per_k32 = "k32" in variant
    # wgmma steps per promoted chunk, and chunks per 128 K: W4A8's scheme promotes every single k32 step
    steps = BF16_STEPS if bf16 else 1 if per_k32 else CHUNK_STEPS
    chunks = CHUNK_STEPS if per_k32 else 1
    zero = hp.wgmma_zero_accumulators(MMA_BN)
    promoting = variant.startswith("e4m3_promote")
    overlap = "overlap" in variant
    two_ops = variant.endswith("2ops")

    @cuda.jit(device=True, forceinline=True)
    def chunk_mmas(acc, a_addr, b_addr, fresh, first):
        """``steps`` wgmma steps from step ``first`` of the 128 K in shared memory, committed as one group."""
        hp.wgmma_fence()
        for kb in range(steps):
            column = ((first + kb) % CHUNK_STEPS) * 32
            desc_a = hp.wgmma_smem_descriptor_device(a_addr + column, 16, SW128_ATOM, "128B")
            desc_b = hp.wgmma_smem_descriptor_device(b_addr + column, 16, SW128_ATOM, "128B")
            acc = mma(acc, desc_a, desc_b, np.uint32(0 if (fresh and kb == 0) else 1))
        hp.wgmma_commit_group()
        return acc

    @cuda.jit(device=True, forceinline=True)
    def promote_into(total, chunk, factor):
        chunk = hp.wgmma_fence_accumulators(chunk)
        if two_ops:   # per-element factors: the chunk's own values, which nothing can hoist
            return promote_by_element(total, chunk, chunk, factor)
        return promote_by_row(total, chunk, factor)

    def kernel(out, clocks, iters):
        smem = cuda.shared.array(SMEM_WORDS, dtype=np.uint32, alignment=SW128_ATOM)
        tid = cuda.threadIdx.x
        for i in range(tid, smem.size, 256):
            smem[i] = np.uint32(E4M3_ONE * 0x01010101)   # e4m3 ones (bf16: a finite pair)
        cm.fence_proxy_async_shared_cta()
        cuda.syncthreads()
        a_addr = np.uint32(cm.shared_address(smem))
        b_addr = a_addr + np.uint32(A_ROWS * ROW_BYTES)
        total = zero()
        chunk0 = zero()
        chunk1 = zero()
        factor = np.float32(1.0) + np.float32(tid) * np.float32(1e-7)
        start = cm.read_clock64()
        for i in range(iters // 2):
            if not promoting:
                total = chunk_mmas(total, a_addr, b_addr, False, 0)
                hp.wgmma_wait_group_1()
                total = chunk_mmas(total, a_addr, b_addr, False, 0)
                hp.wgmma_wait_group_1()
            elif not overlap:
                chunk0 = chunk_mmas(chunk0, a_addr, b_addr, True, 0)
                hp.wgmma_wait_group_0()
                total = promote_into(total, chunk0, factor)
                chunk0 = chunk_mmas(chunk0, a_addr, b_addr, True, 0)
                hp.wgmma_wait_group_0()
                total = promote_into(total, chunk0, factor)
            else:   # chunk i + 1 runs while chunk i is promoted (per k32: 8 single-step chunks per 2 x 128 K)
                for c in range(chunks):
                    chunk1 = chunk_mmas(chunk1, a_addr, b_addr, True, c)
                    hp.wgmma_wait_group_1()
                    total = promote_into(total, chunk0, factor)
                    chunk0 = chunk_mmas(chunk0, a_addr, b_addr, True, c)
                    hp.wgmma_wait_group_1()
                    total = promote_into(total, chunk1, factor)
            factor = factor * np.float32(1.0000001)
        hp.wgmma_wait_group_0()
        total = hp.wgmma_fence_accumulators(total)
        chunk0 = hp.wgmma_fence_accumulators(chunk0)
        chunk1 = hp.wgmma_fence_accumulators(chunk1)
        elapsed = cm.read_clock64() - start
        out[cuda.blockIdx.x * 256 + tid] = tuple_sum(total) + tuple_sum(chunk0) + tuple_sum(chunk1)
        if tid == 0:
            clocks[cuda.blockIdx.x] = elapsed

    return kernel


def throughput(rows: list, ctas: int) -> None:
    out = cuda.device_array(ctas * 256, np.float32)
    clocks = cuda.device_array(ctas, np.uint64)
    flop = 2 * 2 * 64 * MMA_BN * 128   # per SM and iteration: 2 warpgroups x 64 x 128 x 128 K
    base = None
    for variant in VARIANTS:
        kernel = cuda.jit(launch_bounds=(256, 1))(make_throughput_kernel(variant))
        kernel[ctas, 256](out, clocks, 16)   # compile, warm up
        kernel[ctas, 256](out, clocks, ITERS)
        cuda.synchronize()
        per_iter = float(np.median(clocks.copy_to_host())) / (ITERS // 2 * 2)
        base = base or per_iter
        rows.append(dict(part="throughput", case=variant, clocks_per_iter=round(per_iter, 1),
                         flop_per_sm_clock=round(flop / per_iter, 1)))
        print(f"{variant:28} {per_iter:8.1f} clk per 128 K, {flop / per_iter:7.1f} FLOP / SM clock "
              f"({base / per_iter:.2f}x bf16)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv")
    parser.add_argument("--ctas", type=int, default=132)
    args = parser.parse_args(argv)
    if not cuda.is_available():
        print("needs a CUDA GPU (sm_90a)")
        return 2
    rows: list = []
    precision(rows)
    throughput(rows, args.ctas)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
