"""The FP8 route's decode (issue 31 item 3): MXFP4 codes in ``gbs.layouts.E2M1E4M3Order`` become E4M3 bytes with
their block's UE8M0 exponent folded in, relative to a base per row and 128-K chunk (``gbs.fp8_route``: the
arithmetic, the exact window [-8, 6], the promotion and its error bound).

The wgmma kernel's E4M3 consumer (``h200_wgmma``, the FP8 route) runs them; they are bit-exact against
``gbs.fp8_route`` on the host (``tests/test_fp8_decode.py``) and take 7 integer instructions per word of 8 elements
(offline: ``decode_words_kernel``).

Per row and chunk (the 4 UE8M0 scale bytes of a row's 128 K elements are one 32-bit word of the 128x4 atom):

* ``chunk_max_scale(scale_word)``: the largest finite scale byte (0xFF, NaN, excluded); the chunk's base exponent
  is ``max - 127 - 6`` (``promotion_log2``), the power of two the promotion multiplies the chunk's partial sum by.
  A kernel cannot tell an all-zero block from its bytes without reading them, so its base counts every finite
  scale (``gbs.fp8_route.fold_operand`` only live blocks): where they differ, fewer blocks are in the window, and
  the others still take the exact fallback.
* ``fold_table_row(scale_byte, max_byte)``: the block's row of ``MAGNITUDE_TABLES``: ``d + 8`` for the folded
  exponent ``d = scale - max + 6`` in the window, ``NAN_ROW`` for a NaN scale (E4M3 NaN bytes: the block is NaN, as
  in the reference), ``OUT_OF_WINDOW_ROW`` for ``d < -8`` (``is_out_of_window``): zero stays zero (padding
  past K, all-zero blocks), every nonzero code becomes E4M3 NaN, so a live block the route cannot represent makes
  its outputs NaN, never silently wrong (``gbs.plan`` refuses such host problems before a launch).
* ``decode_word(word, t_lo, t_hi)`` (host; ``decode_word_device`` in kernels): 8 E2M1 codes -> 8 E4M3 bytes in K
  order, two words: ``prmt`` of the row's 8 magnitude bytes by the magnitude nibbles, OR the sign bits that
  ``E2M1E4M3Order`` put at bit 7 of each byte (elements 4-7: after a shift by 4). Mask, 2 ``prmt``, 2 ``lop3``, a
  shift right and a shift left: 7 instructions for 8 elements, where the bf16 route's decode takes 9 per word for
  half the elements per register and 4 ``fma.bf16x2`` for the scale (``h200_decode``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from gbs.fp8_route import E2M1_TO_E4M3_TABLES, FOLD_WINDOW
from gbs.formats import UE8M0_BIAS
from gbs.layouts import E2M1E4M3Order
from gbs.numba_kernels.h200_decode import inline_device
from gbs.ptx_inline.arith import prmt_b32, prmt_b32_host

UE8M0_NAN = 0xFF
E4M3_NAN = 0x7F
WINDOW_ROWS = FOLD_WINDOW[1] - FOLD_WINDOW[0] + 1    # 15: d = -8 .. 6
NAN_ROW = WINDOW_ROWS                                # E4M3 NaN for every code
OUT_OF_WINDOW_ROW = WINDOW_ROWS + 1                  # zero for code 0, NaN for the others: never silently wrong
LOW_NIBBLES = 0x7777


def _magnitude_tables() -> np.ndarray:
    """(17, 2) uint32: per row, the E4M3 bytes of E2M1 magnitudes 0..7 (``gbs.fp8_route.e2m1_to_e4m3_table``)
    packed little-endian, codes 0-3 in word 0: what ``prmt`` selects from (``b:a`` = word 1 : word 0)."""
    rows = np.zeros((OUT_OF_WINDOW_ROW + 1, 8), np.uint8)
    rows[:WINDOW_ROWS] = E2M1_TO_E4M3_TABLES[:, :8]
    rows[NAN_ROW] = E4M3_NAN
    rows[OUT_OF_WINDOW_ROW, 1:] = E4M3_NAN
    return np.ascontiguousarray(rows).view("<u4").astype(np.uint32)


MAGNITUDE_TABLES = _magnitude_tables()


def chunk_max_scale(scale_word):
    """The largest of the 4 UE8M0 bytes of ``scale_word`` below 0xFF (a row's 4 block scales of one 128-K chunk);
    0 when all are NaN. Integer Python: the host runs it on ints, kernels compile it."""
    best = 0
    for i in range(4):
        byte = (scale_word >> (8 * i)) & 0xFF
        if byte != UE8M0_NAN and byte > best:
            best = byte
    return best


def promotion_log2(max_byte):
    """log2 of the power of two that multiplies a chunk's partial sum at promotion (per operand: the product of
    both sides' is applied): the base ``max - 127 - 6`` that puts the chunk's largest block at ``d = 6``."""
    return max_byte - UE8M0_BIAS - FOLD_WINDOW[1]


def power_of_two_bits(e):
    """The fp32 bits of ``2**e`` (the promotion factor): normal for e >= -126, subnormal down to -149, 0 below,
    +Inf above 127. Integer Python (host and kernels); a register move makes it a float (``arith.f32_from_bits``),
    where ``ldexpf`` costs a libdevice call."""
    if e > 128:
        e = 128
    if e >= -126:
        return (e + 127) << 23
    if e >= -149:
        return 1 << (e + 149)
    return 0


F32_NAN_BITS = 0x7FC00000


def make_token_factor_bits(power_bits):
    """``token_factor_bits`` over ``power_bits`` (``power_of_two_bits``, or its device function in kernels)."""
    def token_factor_bits(scale_byte, tile_log2):
        """The fp32 bits of W4A8's promotion factor for one token row and k32 step: its MXFP8 block's scale
        ``2^(scale_byte - 127)`` times the weight tile's base ``2^tile_log2``; NaN for a NaN scale (0xFF: the
        block's elements are NaN in the reference)."""
        if scale_byte == UE8M0_NAN:
            return F32_NAN_BITS
        return power_bits(scale_byte - UE8M0_BIAS + tile_log2)

    return token_factor_bits


token_factor_bits = make_token_factor_bits(power_of_two_bits)

UE8M0_ZERO_BITS = 0x00400000   # 2^-127, scale byte 0: an fp32 subnormal


def ue8m0_f32_bits(scale_byte):
    """The fp32 bits of a UE8M0 scale ``2^(byte - 127)``, exact for every byte: ``byte << 23`` for 1..254, the
    subnormal 2^-127 for 0, NaN for 0xFF. The folded route's promotion factor ``2^(token_byte + tile_byte - 254)``
    is the fp32 product of two: exact where fp32 holds it, 0 below 2^-149, +Inf from 2^128, NaN with either scale
    NaN (tests/test_fp8_folded.py checks all 65536 pairs). One FMUL of two selects per token row and slice, where a
    branchy clamp of the exponent sum took a third of the consumers' stall samples (evidence: fold-ncu)."""
    bits = np.uint32(scale_byte) << np.uint32(23)   # 32-bit in kernels: two selects, no branch
    if scale_byte == 0:
        bits = np.uint32(UE8M0_ZERO_BITS)
    if scale_byte == UE8M0_NAN:
        bits = np.uint32(F32_NAN_BITS)
    return bits


def fold_table_row(scale_byte, max_byte):
    """Row of ``MAGNITUDE_TABLES`` for a block of scale ``scale_byte`` in a chunk whose largest is ``max_byte``."""
    if scale_byte == UE8M0_NAN:
        return NAN_ROW
    d = scale_byte - max_byte + FOLD_WINDOW[1]
    if d < FOLD_WINDOW[0]:
        return OUT_OF_WINDOW_ROW
    return d - FOLD_WINDOW[0]


def is_out_of_window(row) -> bool:
    return row == OUT_OF_WINDOW_ROW


def make_word_decoder(prmt):
    """The decode of one 32-bit word in ``E2M1E4M3Order`` with the byte permute ``prmt`` (the PTX intrinsic in
    kernels, its numpy model on the host): (E4M3 bytes of elements 0-3, of elements 4-7)."""
    magnitudes, signs, shift = E2M1E4M3Order.MAGNITUDE_MASK, E2M1E4M3Order.SIGN_MASK, E2M1E4M3Order.HIGH_SIGN_SHIFT

    def decode_word(word, t_lo, t_hi):
        selectors = word & magnitudes
        low = prmt(t_lo, t_hi, selectors) | (word & signs)
        high = prmt(t_lo, t_hi, selectors >> 16) | ((word << shift) & signs)
        return low, high

    return decode_word


decode_word = make_word_decoder(prmt_b32_host)
decode_word_device = inline_device(make_word_decoder(prmt_b32))
chunk_max_scale_device = inline_device(chunk_max_scale)
fold_table_row_device = inline_device(fold_table_row)
promotion_log2_device = inline_device(promotion_log2)
power_of_two_bits_device = inline_device(power_of_two_bits)
token_factor_bits_device = inline_device(make_token_factor_bits(power_of_two_bits_device))
ue8m0_f32_bits_device = inline_device(ue8m0_f32_bits)


def block_element_at(position):
    """The element of a 32-element MX block that K position ``position`` (0..31) of a k32 ``wgmma`` step carries
    in the route's K order (``docs/design/h200_port.md``): position 4q + i -> 8q + i, 16 + 4q + i -> 8q + 4 + i, so
    quad lane q's A registers of a row are the two output words of the block's FP4 word q."""
    half, rest = divmod(position, 16)
    q, i = divmod(rest, 4)
    return 8 * q + 4 * half + i


def decode_words_kernel(words, scale_words, tables, out):
    """Kernel (offline instruction counts and GPU checks): thread i decodes the 32 words (256 elements: two
    128-K chunks) of row i, ``scale_words[i, c]`` holding the row's 4 block scales of chunk c, into E4M3 bytes
    ``out[i]`` (64 words); the tables are ``MAGNITUDE_TABLES``."""
    row = cuda.grid(1)
    if row >= words.shape[0]:
        return
    for chunk in range(scale_words.shape[1]):
        scale_word = scale_words[row, chunk]
        top = chunk_max_scale_device(scale_word)
        for block in range(4):
            t = fold_table_row_device((scale_word >> (8 * block)) & 0xFF, top)
            t_lo, t_hi = tables[t, 0], tables[t, 1]
            for w in range(4):
                i = (chunk * 4 + block) * 4 + w
                low, high = decode_word_device(words[row, i], t_lo, t_hi)
                out[row, 2 * i] = low
                out[row, 2 * i + 1] = high


def decode_operand(ordered: np.ndarray, scale_bytes: np.ndarray, chunk: int = 128):
    """Host model of what a kernel's threads compute for an MXFP4 operand: ``ordered`` (rows, K/2) bytes in
    ``E2M1E4M3Order``, ``scale_bytes`` (rows, K/32) linear UE8M0 bytes -> (E4M3 bytes (rows, K), promotion log2
    per (row, chunk), out-of-window mask per block). K a multiple of ``chunk``, ``chunk`` of 32 x 4 = 128."""
    rows, half_k = ordered.shape
    k = 2 * half_k
    if chunk != 128 or k % chunk or scale_bytes.shape != (rows, k // 32):
        raise ValueError(f"decode_operand: K = {k} in 128-K chunks, scales (rows, K/32); got {scale_bytes.shape}")
    words = np.ascontiguousarray(ordered).view("<u4")
    out = np.zeros((rows, k // 4), np.uint32)
    bases = np.zeros((rows, k // chunk), np.int64)
    outside = np.zeros((rows, k // 32), bool)
    for r in range(rows):
        for c in range(k // chunk):
            scale_word = int(np.ascontiguousarray(scale_bytes[r, 4 * c:4 * c + 4]).view("<u4")[0])
            top = chunk_max_scale(scale_word)
            bases[r, c] = promotion_log2(top)
            for block in range(4):
                row = fold_table_row(int(scale_bytes[r, 4 * c + block]), top)
                outside[r, 4 * c + block] = is_out_of_window(row)
                t_lo, t_hi = MAGNITUDE_TABLES[row]
                for w in range(4):
                    i = (4 * c + block) * 4 + w
                    out[r, 2 * i], out[r, 2 * i + 1] = decode_word(words[r, i], t_lo, t_hi)
    return out.view(np.uint8), bases, outside
