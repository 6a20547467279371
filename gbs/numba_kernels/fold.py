"""MXFP4 tokens folded ahead on the GPU: the FP8 route's token operand (``gbs.layouts.E4M3FoldedScales``,
``a_layout="e4m3_folded"``) from tokens that arrive as MXFP4 (``pack_fp4`` bytes and their 128x4 UE8M0 atoms) from a
quantizer that cannot write it itself; the device twin of the token half of ``gbs.fp8_route.fold_problem``.

    from gbs.numba_kernels import fold
    a8, a8_scales = fold.fold_tokens(a, a_scales, a_offsets, a_scale_offsets)   # device arrays in, device arrays out
    problem = gbs.device_problem(a8, b8, a8_scales, b8_scales, ..., fmt="mxfp8", a_layout="e4m3_folded",
                                 b_layout="e4m3_folded")   # weights folded once: fp8_route.fold_problem

A block of ``THREADS`` threads folds ``CHUNKS_PER_BLOCK`` (token row, 128-K chunk) items at a time, one thread per
FP4 word (8 elements), so a warp reads 128 contiguous bytes and writes 256: each thread marks whether its word has a
nonzero element, one thread per 32-element block then gives the block's exponent if the block is live (a nonzero
element, a finite scale), and every thread takes its chunk's base ``max(e) - 6`` over those (0 for a chunk without
one; never below 2^-127, ``fp8_route.FOLDED_MIN_BASE``) and writes its word's elements times ``2^(e - base)`` as 8
E4M3 bytes through the 16-entry table of its block's shift (``fp8_route.E2M1_TO_E4M3_TABLES``, held in shared
memory), NaN bytes for a NaN-scale block; the chunk's first thread writes the base byte as all 4 of its scales.
Bit-identical to the host fold (``fold_problem``'s tokens), padding scale rows zero. One difference, by design: the host refuses a live block more
than 14 binades below its chunk's largest; here, where nothing can raise, such a block becomes NaN bytes, so the
outputs it touches are NaN, never silently wrong.

Constraints (checked before any device work): device arrays (``__cuda_array_interface__``), C-contiguous; ``a``
(tokens, K/2) bytes with K a multiple of 32; ``a_scales`` the (bands, ceil(K/128), 32, 4, 4) atoms of
``GroupedProblem``; ``a_offsets`` / ``a_scale_offsets`` its 4-byte routing arrays. Runs in Numba's CUDA simulator
too (``NUMBA_ENABLE_CUDASIM=1``).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, UE8M0_BIAS, UE8M0_NAN_BYTE, scale_byte_offset
from gbs.fp8_route import E2M1_TO_E4M3_TABLES, E4M3_NAN, FOLD_WINDOW, FOLDED_MIN_BASE, MX_BLOCK, PROMOTION_CHUNK
from gbs.numba_kernels.launch import device_view

BLOCKS_PER_CHUNK = PROMOTION_CHUNK // MX_BLOCK   # 4: one word of the row's scale atom
BLOCK_WORDS = MX_BLOCK // 8      # FP4 words (8 elements) per 32-element block
CHUNK_WORDS = BLOCKS_PER_CHUNK * BLOCK_WORDS     # 16 threads per chunk
THREADS = 256
CHUNKS_PER_BLOCK = THREADS // CHUNK_WORDS
BLOCK_EXPONENTS = CHUNKS_PER_BLOCK * BLOCKS_PER_CHUNK   # the 32-element blocks a thread block folds per step
MAX_BLOCKS = 132 * 8             # a full H200 at 8 blocks per SM; the block-stride loop takes the rest
TABLE_ROWS, TABLE_ENTRIES = E2M1_TO_E4M3_TABLES.shape
OUT_OF_WINDOW = TABLE_ROWS       # a table row that is no table: the block becomes NaN bytes
DEAD = -(1 << 30)                # the exponent of a block that does not set the base
E4M3_NAN_WORD = E4M3_NAN * 0x01010101
if (SF_ATOM_COLS, SF_ATOM_ROWS, SF_ATOM_BYTES) != (BLOCKS_PER_CHUNK, 128, 512):
    raise AssertionError("a 128-K chunk's scales are one word of its row in a 128x4 atom")


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
def e4m3_word(table, row, nibbles):
    """4 E2M1 nibbles (the low 16 bits of ``nibbles``) as 4 E4M3 bytes of table row ``row``, in one word."""
    word = np.uint32(0)
    for e in range(4):
        word |= np.uint32(table[row, (nibbles >> np.uint32(4 * e)) & np.uint32(0xF)]) << np.uint32(8 * e)
    return word


def fold_token_chunks(words, scale_words, a_offsets, a_scale_offsets, tables, tokens, row_words, chunks, out_pairs,
                      out_scale_words):
    """Kernel: ``CHUNKS_PER_BLOCK`` (token, chunk) items per block and step of a block-stride loop (every thread of a
    block takes the same steps: it synchronizes); ``words`` the tokens' FP4 words (tokens x ``row_words``),
    ``out_pairs`` their E4M3 bytes as 8-byte pairs of words (tokens x ``row_words``)."""
    table = cuda.shared.array((TABLE_ROWS, TABLE_ENTRIES), np.uint8)
    nonzero = cuda.shared.array(THREADS, np.int32)                        # per word: a nonzero element
    exponents = cuda.shared.array(BLOCK_EXPONENTS, np.int32)   # per 32-element block: e, or DEAD
    tid = cuda.threadIdx.x
    for i in range(tid, TABLE_ROWS * TABLE_ENTRIES, THREADS):
        table[i // TABLE_ENTRIES, i % TABLE_ENTRIES] = tables[i // TABLE_ENTRIES, i % TABLE_ENTRIES]
    lane = tid % CHUNK_WORDS      # the thread's word of its chunk
    block = lane // BLOCK_WORDS   # the word's 32-element block
    first_exponent = (tid // CHUNK_WORDS) * BLOCKS_PER_CHUNK
    items = tokens * chunks
    for first_item in range(cuda.blockIdx.x * CHUNKS_PER_BLOCK, items, cuda.gridDim.x * CHUNKS_PER_BLOCK):
        item = first_item + tid // CHUNK_WORDS
        token, chunk = item // chunks, item % chunks
        word = np.uint32(0)
        scale_word = np.uint32(0)
        s_index = 0
        src = 0
        chunk_words = 0           # the chunk's FP4 words: fewer in a K tail, none past the last item
        if item < items:
            g = group_of(a_offsets, token)
            lo = a_offsets[g]
            padded = np.uint32(token - lo) + np.uint32(SF_ATOM_ROWS) * (np.uint32(lo // SF_ATOM_ROWS)
                                                                          + np.uint32(a_scale_offsets[g]))
            # the chunk's 4 scale bytes: one word of the row's atom (an atom column group per chunk)
            s_index = atom_byte_offset(np.int64(padded), chunk * SF_ATOM_COLS, chunks) // 4
            scale_word = scale_words[s_index]
            chunk_words = min(CHUNK_WORDS, row_words - chunk * CHUNK_WORDS)
            src = token * row_words + chunk * CHUNK_WORDS + lane
            if lane < chunk_words:
                word = words[src]
        cuda.syncthreads()        # the last step's readers of nonzero / exponents are done (and the table is in)
        nonzero[tid] = 1 if (word & np.uint32(0x77777777)) != 0 else 0
        cuda.syncthreads()
        byte = np.int32((scale_word >> np.uint32(8 * block)) & np.uint32(0xFF))
        live = False
        for w in range(BLOCK_WORDS):
            live = live or nonzero[tid - lane % BLOCK_WORDS + w] != 0
        live = live and byte != UE8M0_NAN_BYTE and block * BLOCK_WORDS < chunk_words
        if lane % BLOCK_WORDS == 0:
            exponents[first_exponent + block] = byte - UE8M0_BIAS if live else DEAD
        cuda.syncthreads()
        top = DEAD
        for b in range(BLOCKS_PER_CHUNK):
            top = max(top, exponents[first_exponent + b])
        base = max(top - FOLD_WINDOW[1] if top != DEAD else 0, FOLDED_MIN_BASE)
        d = byte - UE8M0_BIAS - base
        if byte == UE8M0_NAN_BYTE or (live and d < FOLD_WINDOW[0]):
            row = OUT_OF_WINDOW
        elif live:
            row = d - FOLD_WINDOW[0]
        else:
            row = -FOLD_WINDOW[0]     # a dead block: d = 0, zeros keep their sign
        if lane < chunk_words:
            if row == OUT_OF_WINDOW:
                lo_word, hi_word = np.uint32(E4M3_NAN_WORD), np.uint32(E4M3_NAN_WORD)
            else:
                lo_word, hi_word = e4m3_word(table, row, word), e4m3_word(table, row, word >> np.uint32(16))
            out_pairs[src] = np.uint64(lo_word) | (np.uint64(hi_word) << np.uint64(32))
        if lane == 0 and chunk_words > 0:
            # the base as each real block's scale; a K tail's padding columns stay zero
            mask = np.uint32(0xFFFFFFFF) >> np.uint32(8 * (BLOCKS_PER_CHUNK - chunk_words // BLOCK_WORDS))
            out_scale_words[s_index] = (np.uint32(base + UE8M0_BIAS) * np.uint32(0x01010101)) & mask


@functools.cache
def _kernel():
    return cuda.jit(fold_token_chunks)


@functools.cache
def _device_tables():
    return cuda.to_device(np.ascontiguousarray(E2M1_TO_E4M3_TABLES))


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
    dst_scales.copy_to_device(scales, stream=stream)   # padding rows stay zero; the items rewrite every token's
    items = tokens * chunks
    if items:
        blocks = min(-(-items // CHUNKS_PER_BLOCK), MAX_BLOCKS)
        _kernel()[blocks, THREADS, stream](
            src.reshape(src.size).view(np.uint32), scales.reshape(scales.size).view(np.uint32), offsets,
            scale_offsets, _device_tables(), tokens, row_bytes // 4, chunks, dst.reshape(dst.size).view(np.uint64),
            dst_scales.reshape(dst_scales.size).view(np.uint32))
    return dst, dst_scales
