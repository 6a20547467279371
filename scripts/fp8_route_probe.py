#!/usr/bin/env python3
"""The FP8 route's consumer arithmetic on the H200, before it goes into the ring's kernel (issue 31 item 3;
``docs/design/h200_port.md``, the FP8 route sections): MXFP4 tokens (M, K) x MXFP4 weights (N, K), both in
``gbs.layouts.E2M1E4M3Order`` with linear UE8M0 scales, one CTA of two warpgroups per 128 x 128 output tile, K in
128-element chunks. Per chunk:

* every thread decodes an eighth of a weight row's chunk (``fp8_decode``) into a shared E4M3 buffer (K-major, 128B
  swizzle, the route's K order ``fp8_decode.block_element_at``), relative to one base for the tile's 128 rows
  (``fold_operand(base_rows=128)``: a shared-memory max of the rows' largest scales);
* each lane decodes its A registers: FP4 word ``lane % 4`` of each 32-element block of its two token rows, one base
  per row;
* fence, barrier, 4 x ``wgmma m64n128k32`` (A in registers) into a fresh chunk accumulator, wait;
* the promotion: ``total = fma(chunk, 2^(base_row + base_tile), total)``, one FFMA per accumulator.

Serial on purpose (decode, MMA, promotion one after the other, no TMA ring): it checks the arithmetic against
``gbs.fp8_route.fp8_route_accumulate`` (bit for bit where the tensor core sums each chunk exactly; otherwise the
difference, relative to the sum of |terms|, is the measured ``eps_chunk``) and shows each part's share of the time
(variants without the promotion, or decoding the weights once), not the pipelined kernel's speed.

    python3 scripts/fp8_route_probe.py [--csv OUT.csv]      # needs an sm_90 GPU (under a minute)

Constraints: sm_90a; M, N multiples of 128, K of 128; no out-of-window blocks (the probe has no fallback: it
reports how many the data has).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from numba import cuda

from gbs.formats import quantize
from gbs.fp8_route import fold_operand, fp8_route_accumulate
from gbs.layouts import E2M1E4M3Order
from gbs.numba_kernels import fp8_decode as fd
from gbs.lab.bench import write_csv
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import hopper as hp

TILE = 128                  # tokens x weights per CTA
CHUNK = 128                 # K per promotion
WORDS_PER_CHUNK = CHUNK // 8
BLOCK_WORDS = 4             # FP4 words of a 32-element block
THREADS = 256               # two warpgroups of 64 token rows
B_BUFFER_WORDS = TILE * CHUNK // 4
TABLE_WORDS = 2 * (fd.OUT_OF_WINDOW_ROW + 1)
MMA = hp.wgmma_e4m3_rs(TILE)
ZERO = hp.wgmma_zero_accumulators(TILE)
VARIANTS = ("full", "no_promotion", "weights_decoded_once")

decode_word = fd.decode_word_device
chunk_max = fd.chunk_max_scale_device
table_row = fd.fold_table_row_device
promotion_log2 = fd.promotion_log2_device


def make_a_registers(decode, table_row):
    """The A registers of k32 step ``block`` for a lane (``decode``, ``table_row``: ``fp8_decode``'s, device or host):
    rows g and g + 8, FP4 word q of the block, low halves in registers 0 / 1 and high halves in 2 / 3 (the route's K
    order against ``hopper.wgmma_e4m3_a_register_position``)."""
    def a_registers(a_words, row_lo, row_hi, chunk_word, block, q, sw_lo, sw_hi, top_lo, top_hi, tab):
        t = table_row((sw_lo >> (8 * block)) & 0xFF, top_lo)
        lo_g, hi_g = decode(a_words[row_lo, chunk_word + block * BLOCK_WORDS + q], tab[2 * t], tab[2 * t + 1])
        t = table_row((sw_hi >> (8 * block)) & 0xFF, top_hi)
        lo_h, hi_h = decode(a_words[row_hi, chunk_word + block * BLOCK_WORDS + q], tab[2 * t], tab[2 * t + 1])
        return (np.uint32(lo_g), np.uint32(lo_h), np.uint32(hi_g), np.uint32(hi_h))

    return a_registers


def weight_word_offsets(b_row, block, w):
    """Byte offsets in the E4M3 weight buffer (K-major, 128B swizzle: ``hopper.kmajor_sw128_offset``) of the two
    output words of FP4 word ``w`` of ``block`` in weight row ``b_row``: K bytes 32 block + 4 w and + 16."""
    low, high = block * 32 + 4 * w, block * 32 + 16 + 4 * w
    return (b_row * 128 + (((low >> 4) ^ (b_row & 7)) << 4) + (low & 15),
            b_row * 128 + (((high >> 4) ^ (b_row & 7)) << 4) + (high & 15))


a_registers = cuda.jit(device=True, forceinline=True)(make_a_registers(decode_word, table_row))
weight_offsets = cuda.jit(device=True, forceinline=True)(weight_word_offsets)


def make_kernel(variant: str):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    promote = variant != "no_promotion"
    decode_weights_every_chunk = variant != "weights_decoded_once"

    def kernel(a_words, a_scales, b_words, b_scales, tables, out, clocks):
        smem_b = cuda.shared.array(B_BUFFER_WORDS, dtype=np.uint32, alignment=1024)
        tab = cuda.shared.array(TABLE_WORDS, dtype=np.uint32)
        top_tile = cuda.shared.array(1, dtype=np.int32)
        tid = cuda.threadIdx.x
        n0, m0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
        if tid < TABLE_WORDS:
            tab[tid] = tables[tid // 2, tid % 2]
        wg, warp, lane = tid // 128, (tid % 128) // 32, tid % 32
        g, q = lane // 4, lane % 4
        row_lo = m0 + wg * 64 + warp * 16 + g
        row_hi = row_lo + 8
        b_row, b_half = tid // 2, tid % 2   # weight row, and which two of its chunk's 4 blocks
        buffer = np.uint32(cm.shared_address(smem_b))
        total = ZERO()
        chunk_acc = ZERO()
        start = cm.read_clock64()
        for c in range(a_words.shape[1] // WORDS_PER_CHUNK):
            cuda.syncthreads()   # the previous chunk's MMAs and reads are done
            if tid == 0:
                top_tile[0] = 0
            cuda.syncthreads()
            b_sw = b_scales[n0 + b_row, c]
            cuda.atomic.max(top_tile, 0, np.int32(chunk_max(b_sw)))
            cuda.syncthreads()
            top = top_tile[0]
            if decode_weights_every_chunk or c == 0:
                for j in range(2):
                    block = 2 * b_half + j
                    t = table_row((b_sw >> (8 * block)) & 0xFF, top)
                    t_lo, t_hi = tab[2 * t], tab[2 * t + 1]
                    for w in range(BLOCK_WORDS):
                        lo, hi = decode_word(b_words[n0 + b_row, c * WORDS_PER_CHUNK + block * BLOCK_WORDS + w],
                                             t_lo, t_hi)
                        off_lo, off_hi = weight_offsets(b_row, block, w)
                        smem_b[off_lo // 4] = lo
                        smem_b[off_hi // 4] = hi
            sw_lo, sw_hi = a_scales[row_lo, c], a_scales[row_hi, c]
            top_lo, top_hi = chunk_max(sw_lo), chunk_max(sw_hi)
            word0 = c * WORDS_PER_CHUNK
            a0 = a_registers(a_words, row_lo, row_hi, word0, 0, q, sw_lo, sw_hi, top_lo, top_hi, tab)
            a1 = a_registers(a_words, row_lo, row_hi, word0, 1, q, sw_lo, sw_hi, top_lo, top_hi, tab)
            a2 = a_registers(a_words, row_lo, row_hi, word0, 2, q, sw_lo, sw_hi, top_lo, top_hi, tab)
            a3 = a_registers(a_words, row_lo, row_hi, word0, 3, q, sw_lo, sw_hi, top_lo, top_hi, tab)
            cm.fence_proxy_async_shared_cta()   # st.shared of the weights -> the MMAs' async proxy
            cuda.syncthreads()
            hp.wgmma_fence()
            chunk_acc = MMA(chunk_acc, a0, hp.wgmma_smem_descriptor_device(buffer, 16, 1024, "128B"), np.uint32(0))
            chunk_acc = MMA(chunk_acc, a1, hp.wgmma_smem_descriptor_device(buffer + 32, 16, 1024, "128B"),
                            np.uint32(1))
            chunk_acc = MMA(chunk_acc, a2, hp.wgmma_smem_descriptor_device(buffer + 64, 16, 1024, "128B"),
                            np.uint32(1))
            chunk_acc = MMA(chunk_acc, a3, hp.wgmma_smem_descriptor_device(buffer + 96, 16, 1024, "128B"),
                            np.uint32(1))
            hp.wgmma_commit_group()
            hp.wgmma_wait_group_0()
            chunk_acc = hp.wgmma_fence_accumulators(chunk_acc)
            if promote:
                tile_log2 = promotion_log2(top)
                f_lo = cuda.libdevice.ldexpf(np.float32(1.0), np.int32(promotion_log2(top_lo) + tile_log2))
                f_hi = cuda.libdevice.ldexpf(np.float32(1.0), np.int32(promotion_log2(top_hi) + tile_log2))
                total = hp.promote_accumulator_rows(total, chunk_acc, f_lo, f_hi)
        elapsed = cm.read_clock64() - start
        if not promote:
            total = chunk_acc
        for i in range(TILE // 2):
            row = wg * 64 + warp * 16 + g + 8 * ((i >> 1) & 1)
            col = 8 * (i >> 2) + 2 * q + (i & 1)
            out[m0 + row, n0 + col] = total[i]
        if tid == 0:
            clocks[cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x] = elapsed

    return kernel


def operands(m: int, n: int, k: int, seed: int = 0):
    """(device inputs, model result, out-of-window blocks): Gaussian tokens and weights quantized to MXFP4 (RCEIL),
    in E2M1E4M3Order words and scale words; the model is ``fp8_route_accumulate`` with the probe's bases."""
    rng = np.random.default_rng(seed)
    qa = quantize(rng.standard_normal((m, k)).astype(np.float32), "mxfp4")
    qb = quantize(rng.standard_normal((n, k)).astype(np.float32), "mxfp4")
    fa = fold_operand(qa, base_over="finite")
    fb = fold_operand(qb, base_over="finite", base_rows=TILE)
    outside = int((~fa.in_window).sum() + (~fb.in_window).sum())
    words = lambda q: np.ascontiguousarray(E2M1E4M3Order.swizzle(q.data)).view("<u4")
    scale_words = lambda q: np.ascontiguousarray(q.scales).view("<u4")
    inputs = (words(qa), scale_words(qa), words(qb), scale_words(qb), fd.MAGNITUDE_TABLES)
    terms = np.abs(fa.unfold().astype(np.float64)) @ np.abs(fb.unfold().astype(np.float64)).T
    return inputs, fp8_route_accumulate(fa, fb), terms, outside


def run(variant: str, inputs, m: int, n: int):
    kernel = cuda.jit(make_kernel(variant))
    device = [cuda.to_device(x) for x in inputs]
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    clocks = cuda.device_array((m // TILE) * (n // TILE), np.uint64)
    kernel[(n // TILE, m // TILE), THREADS](*device, out, clocks)
    kernel[(n // TILE, m // TILE), THREADS](*device, out, clocks)   # compiled: the second run's clocks
    cuda.synchronize()
    return out.copy_to_host(), float(np.median(clocks.copy_to_host()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    if not cuda.is_available():
        print("needs a CUDA GPU (sm_90a)")
        return 2
    inputs, want, terms, outside = operands(args.m, args.n, args.k)
    print(f"M {args.m} N {args.n} K {args.k}: {outside} out-of-window blocks (the probe has no fallback)")
    rows = []
    for variant in VARIANTS:
        got, clocks = run(variant, inputs, args.m, args.n)
        chunks = args.k // CHUNK
        row = dict(variant=variant, clocks_per_chunk=round(clocks / chunks, 1))
        if variant != "no_promotion":
            same = int(np.sum(got.view(np.uint32) == want.view(np.uint32)))
            err = np.abs(got.astype(np.float64) - want.astype(np.float64)) / np.maximum(terms, 1e-300)
            row.update(bit_identical=f"{same}/{got.size}", max_err_per_sum_abs_terms=float(np.nanmax(err)),
                       nan=int(np.isnan(got).sum()))
        rows.append(row)
        print(row, flush=True)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
