"""MXFP4 tokens folded ahead on the GPU: the FP8 route's token operand (``gbs.layouts.E4M3FoldedScales``,
``a_layout="e4m3_folded"``) from tokens that arrive as MXFP4 (``pack_fp4`` bytes and their 128x4 UE8M0 atoms) from a
quantizer that cannot write it itself; the device twin of the token half of ``gbs.fp8_route.fold_problem``.

    from gbs.numba_kernels import fold
    a8, a8_scales = fold.fold_tokens(a, a_scales, a_offsets, a_scale_offsets)   # device arrays in, device arrays out
    problem = gbs.device_problem(a8, b8, a8_scales, b8_scales, ..., fmt="mxfp8", a_layout="e4m3_folded",
                                 b_layout="e4m3_folded")   # weights folded once: fp8_route.fold_problem

One thread per 32-element block (16 bytes in, two 8-byte loads; 32 E4M3 bytes out), the threads of a launch laid
over (token row, 128-K chunk, block) so that a warp reads 512 contiguous bytes of a row and writes 1 KB. Each thread
gives its block's exponent if the block is live (a nonzero element, a finite scale) through shared memory; the 4
threads of a chunk take its base ``max(e) - 6`` over those (0 for a chunk without one; never below 2^-127,
``fp8_route.FOLDED_MIN_BASE``) and write their elements times ``2^(e - base)`` as E4M3 bytes through the table row of
their block's shift (``fp8_route.E2M1_TO_E4M3_TABLES``: its 8 magnitudes, held in shared memory as 2 words, picked by
byte permutes), NaN bytes for a NaN-scale block; the chunk's first thread writes the base byte as all 4 of its scales.
Bit-identical to the host fold (``fold_problem``'s tokens), padding scale rows zero. One difference, by design: the
host refuses a live block more than 14 binades below its chunk's largest; here, where nothing can raise, such a block
becomes NaN bytes, so the outputs it touches are NaN, never silently wrong.

Constraints (checked before any device work): device arrays (``__cuda_array_interface__``), C-contiguous; ``a``
(tokens, K/2) bytes with K a multiple of 32; ``a_scales`` the (bands, ceil(K/128), 32, 4, 4) atoms of
``GroupedProblem``; ``a_offsets`` / ``a_scale_offsets`` its 4-byte routing arrays. Runs in Numba's CUDA simulator
too (``NUMBA_ENABLE_CUDASIM=1``).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import config, cuda

from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, UE8M0_BIAS, UE8M0_NAN_BYTE, scale_byte_offset
from gbs.fp8_route import E2M1_TO_E4M3_TABLES, E4M3_NAN, FOLD_WINDOW, FOLDED_MIN_BASE, MX_BLOCK, PROMOTION_CHUNK
from gbs.numba_kernels.launch import device_view
from gbs.ptx_inline.arith import prmt_b32, prmt_b32_host

BLOCKS_PER_CHUNK = PROMOTION_CHUNK // MX_BLOCK   # 4: one word of the row's scale atom
BLOCK_PAIRS = MX_BLOCK // 16     # a block's FP4 bytes as 8-byte words
OUT_PAIRS = 2 * BLOCK_PAIRS      # its E4M3 bytes as 8-byte words
THREADS = 128                    # 32 chunks per thread block
MAX_THREADS = 1 << 31            # the flat thread index is an int32
# each table row's 8 magnitudes (E2M1 codes 0-7) as 2 words, for a byte permute; codes 8-15 are the same with E4M3's
# sign bit, which a second permute sets from bit 3 of each code
MAGNITUDE_WORDS = np.ascontiguousarray(E2M1_TO_E4M3_TABLES[:, :8]).view(np.uint32)
TABLE_ROWS, TABLE_WORDS = MAGNITUDE_WORDS.shape
OUT_OF_WINDOW = TABLE_ROWS       # a table row that is no table: the block becomes NaN bytes
SIGN_BYTES = 0x80808080
DEAD = -(1 << 30)                # the exponent of a block that does not set the base
E4M3_NAN_PAIR = E4M3_NAN * 0x0101010101010101
if (SF_ATOM_COLS, SF_ATOM_ROWS, SF_ATOM_BYTES) != (BLOCKS_PER_CHUNK, 128, 512):
    raise AssertionError("a 128-K chunk's scales are one word of its row in a 128x4 atom")
if THREADS % BLOCKS_PER_CHUNK:
    raise AssertionError("a thread block holds whole chunks: their 4 exponents meet in its shared memory")
if (E2M1_TO_E4M3_TABLES[:, 8:] != E2M1_TO_E4M3_TABLES[:, :8] | 0x80).any():
    raise AssertionError("a negative E2M1 code's E4M3 byte is its magnitude's with the sign bit")
# the simulator runs no PTX: there the permute is its host twin
byte_permute = prmt_b32_host if config.ENABLE_CUDASIM else prmt_b32


@cuda.jit(device=True)
def group_of(a_offsets, token):
    """The slot whose tokens hold ``token`` (binary search; ``a_offsets`` non-decreasing, empty slots skipped)."""
    lo, hi = 0, a_offsets.size - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a_offsets[mid] <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


atom_byte_offset = cuda.jit(device=True)(scale_byte_offset)


@cuda.jit(device=True)
def e4m3_word(magnitudes_lo, magnitudes_hi, nibbles):
    """4 E2M1 codes (the low 16 bits of ``nibbles``) as 4 E4M3 bytes in one word: two byte permutes, the magnitudes
    from a table row's 2 words, the sign bits from each code's bit 3."""
    magnitude = byte_permute(magnitudes_lo, magnitudes_hi, nibbles & np.uint32(0x7777))
    sign = byte_permute(np.uint32(0), np.uint32(SIGN_BYTES), (nibbles >> np.uint32(1)) & np.uint32(0x4444))
    return np.uint32(magnitude | sign)


@cuda.jit(device=True)
def e4m3_pair(magnitudes_lo, magnitudes_hi, word):
    """An FP4 word's 8 E2M1 codes as 8 E4M3 bytes (``e4m3_word`` of each half), one 8-byte word."""
    lo = e4m3_word(magnitudes_lo, magnitudes_hi, word)
    hi = e4m3_word(magnitudes_lo, magnitudes_hi, word >> np.uint32(16))
    return np.uint64(lo) | (np.uint64(hi) << np.uint64(32))


def fold_token_blocks(pairs, scale_words, a_offsets, a_scale_offsets, tables, tokens, row_pairs, chunks, out_pairs,
                      out_scale_words):
    """Kernel: thread ``t`` folds block ``t % 4`` of chunk ``t // 4 % chunks`` of token row ``t // (4 chunks)``;
    ``pairs`` the tokens' FP4 bytes as 8-byte words (tokens x ``row_pairs``), ``out_pairs`` their E4M3 bytes in
    8-byte words (tokens x 2 ``row_pairs``). Threads past the last row or the row's last block fold nothing but
    reach the barrier."""
    table = cuda.shared.array((TABLE_ROWS, TABLE_WORDS), np.uint32)
    exponents = cuda.shared.array(THREADS, np.int32)      # per thread's block: e, or DEAD
    tid = np.int32(cuda.threadIdx.x)
    for i in range(tid, TABLE_ROWS * TABLE_WORDS, THREADS):
        table[i // TABLE_WORDS, i % TABLE_WORDS] = tables[i // TABLE_WORDS, i % TABLE_WORDS]
    row_slots = np.int32(chunks) * BLOCKS_PER_CHUNK
    item = np.int32(cuda.blockIdx.x) * THREADS + tid
    token = item // row_slots
    chunk = item % row_slots // BLOCKS_PER_CHUNK
    block = item % BLOCKS_PER_CHUNK
    row_blocks = np.int32(row_pairs) // BLOCK_PAIRS
    real = token < tokens and chunk * BLOCKS_PER_CHUNK + block < row_blocks
    lo_pair = np.uint64(0)
    hi_pair = np.uint64(0)
    scale_word = np.uint32(0)
    s_index = np.int32(0)
    src = np.int64(0)
    if token < tokens:
        g = group_of(a_offsets, token)
        lo = a_offsets[g]
        padded = np.int32(np.uint32(token - lo) + np.uint32(SF_ATOM_ROWS) * (np.uint32(lo // SF_ATOM_ROWS)
                                                                           + np.uint32(a_scale_offsets[g])))
        # the chunk's 4 scale bytes: one word of the row's atom (an atom column group per chunk)
        s_index = np.int32(atom_byte_offset(padded, chunk * SF_ATOM_COLS, chunks) // 4)
        scale_word = scale_words[s_index]
        if real:
            src = np.int64(token) * row_pairs + (chunk * BLOCKS_PER_CHUNK + block) * BLOCK_PAIRS
            lo_pair = pairs[src]
            hi_pair = pairs[src + 1]
    byte = np.int32((scale_word >> np.uint32(8 * block)) & np.uint32(0xFF))
    live = real and ((lo_pair | hi_pair) & np.uint64(0x7777777777777777)) != 0 and byte != UE8M0_NAN_BYTE
    exponents[tid] = byte - UE8M0_BIAS if live else DEAD
    cuda.syncthreads()    # the chunk's 4 exponents (and the table) are in
    top = np.int32(DEAD)
    for b in range(BLOCKS_PER_CHUNK):
        top = max(top, exponents[tid - block + b])
    base = max(top - FOLD_WINDOW[1] if top != DEAD else 0, FOLDED_MIN_BASE)
    d = byte - UE8M0_BIAS - base
    if byte == UE8M0_NAN_BYTE or (live and d < FOLD_WINDOW[0]):
        row = OUT_OF_WINDOW
    elif live:
        row = d - FOLD_WINDOW[0]
    else:
        row = -FOLD_WINDOW[0]     # a dead block: d = 0, zeros keep their sign
    if real:
        out = (np.uint64(E4M3_NAN_PAIR), np.uint64(E4M3_NAN_PAIR), np.uint64(E4M3_NAN_PAIR),
               np.uint64(E4M3_NAN_PAIR))
        if row != OUT_OF_WINDOW:
            magnitudes_lo, magnitudes_hi = table[row, 0], table[row, 1]
            out = (e4m3_pair(magnitudes_lo, magnitudes_hi, np.uint32(lo_pair & np.uint64(0xFFFFFFFF))),
                   e4m3_pair(magnitudes_lo, magnitudes_hi, np.uint32(lo_pair >> np.uint64(32))),
                   e4m3_pair(magnitudes_lo, magnitudes_hi, np.uint32(hi_pair & np.uint64(0xFFFFFFFF))),
                   e4m3_pair(magnitudes_lo, magnitudes_hi, np.uint32(hi_pair >> np.uint64(32))))
        for w in range(OUT_PAIRS):
            out_pairs[2 * src + w] = out[w]
        if block == 0:
            # the base as each real block's scale; a K tail's padding columns stay zero
            chunk_blocks = min(np.int32(BLOCKS_PER_CHUNK), row_blocks - chunk * BLOCKS_PER_CHUNK)
            mask = np.uint32(0xFFFFFFFF) >> np.uint32(8 * (BLOCKS_PER_CHUNK - chunk_blocks))
            out_scale_words[s_index] = (np.uint32(base + UE8M0_BIAS) * np.uint32(0x01010101)) & mask


@functools.cache
def _kernel():
    return cuda.jit(fold_token_blocks)


@functools.cache
def _device_tables():
    return cuda.to_device(MAGNITUDE_WORDS)


def _device(name: str, value, dtype, ndim: int):
    """A numba device array of ``dtype`` over ``value`` (no copy), or TypeError / ValueError saying why not."""
    arr = device_view(name, value, "host tokens fold with gbs.fp8_route.fold_problem")
    if arr.dtype.itemsize != np.dtype(dtype).itemsize or arr.ndim != ndim:
        raise TypeError(f"{name} must be {ndim}-D with {np.dtype(dtype).itemsize}-byte elements, got "
                        f"{arr.ndim}-D {arr.dtype}")
    return arr.view(dtype)


def fold_tokens(a, a_scales, a_offsets, a_scale_offsets, *, out=None, out_scales=None, stream=0):
    """MXFP4 tokens (``a``: (tokens, K/2) ``pack_fp4`` bytes; ``a_scales``: their atoms; the routing arrays) folded
    into E4M3 with one UE8M0 scale per 128-K chunk, enqueued on ``stream``: (E4M3 bytes (tokens, K) uint8, scale atoms
    shaped as ``a_scales``), new device arrays or ``out`` / ``out_scales`` filled and returned. The result is the
    operand ``a_layout="e4m3_folded"`` takes (module docstring)."""
    src = _device("a", a, np.uint8, 2)
    scales = _device("a_scales", a_scales, np.uint8, 5)
    offsets = _device("a_offsets", a_offsets, np.uint32, 1)
    scale_offsets = _device("a_scale_offsets", a_scale_offsets, np.uint32, 1)
    tokens, row_bytes = (int(x) for x in src.shape)
    k = 2 * row_bytes
    if k % MX_BLOCK:
        raise ValueError(f"K = {k}: MXFP4 tokens need K a multiple of {MX_BLOCK}")
    chunks = -(-k // PROMOTION_CHUNK)
    if tuple(scales.shape[1:]) != (chunks, 32, 4, 4):
        raise ValueError(f"a_scales has shape {tuple(scales.shape)}: K = {k} takes (bands, {chunks}, 32, 4, 4) atoms")
    if int(offsets.shape[0]) != int(scale_offsets.shape[0]) + 1:
        raise ValueError(f"a_offsets has {offsets.shape[0]} entries, a_scale_offsets {scale_offsets.shape[0]}: "
                         "want one more offset than slots")
    dst = cuda.device_array((tokens, k), np.uint8, stream=stream) if out is None else _device("out", out, np.uint8, 2)
    if tuple(dst.shape) != (tokens, k):
        raise ValueError(f"out has shape {tuple(dst.shape)}, want {(tokens, k)}")
    if out_scales is None:
        dst_scales = cuda.device_array(scales.shape, np.uint8, stream=stream)
    else:
        dst_scales = _device("out_scales", out_scales, np.uint8, 5)
        if tuple(dst_scales.shape) != tuple(scales.shape):
            raise ValueError(f"out_scales has shape {tuple(dst_scales.shape)}, a_scales {tuple(scales.shape)}")
    dst_scales.copy_to_device(scales, stream=stream)   # padding rows stay zero; the kernel rewrites every token's
    threads = tokens * chunks * BLOCKS_PER_CHUNK
    if threads >= MAX_THREADS:
        raise ValueError(f"{tokens} tokens x K = {k}: more than {MAX_THREADS} blocks of 32; fold them in parts")
    if threads:
        _kernel()[-(-threads // THREADS), THREADS, stream](
            src.reshape(src.size).view(np.uint64), scales.reshape(scales.size).view(np.uint32), offsets,
            scale_offsets, _device_tables(), tokens, row_bytes // 8, chunks, dst.reshape(dst.size).view(np.uint64),
            dst_scales.reshape(dst_scales.size).view(np.uint32))
    return dst, dst_scales
