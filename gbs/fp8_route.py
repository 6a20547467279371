"""Host model of the FP8 route (issue 31, item 3): MXFP4 block scales folded into the FP4 -> E4M3 decode,
E4M3 x E4M3 products summed per 128-K chunk, chunk sums promoted to an fp32 accumulator with the bases.

The exact numpy model of the route the H200 wgmma kernel's E4M3 consumer runs (``h200_wgmma``, layout
``e2m1_e4m3``; its decode: ``gbs.numba_kernels.fp8_decode``). It makes no claim about GPU speed; it fixes the
arithmetic, gives the kernel's GPU tests their model, and says what the kernel cannot represent
(``kernel_window_violations``: the plan refuses those host problems) and what its tensor core adds to the bound
(``HOPPER_CHUNK_ERROR``).

Design
------
1. **The exact window.** E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; E4M3 (OCP e4m3fn) holds normals
   1.mmm x 2^u, u in [-6, 8] (max 448) and subnormals k x 2^-9, k = 1..7. So ``x * 2**d`` is an E4M3 number for
   every E2M1 ``x`` iff ``-8 <= d <= 6`` (``FOLD_WINDOW``): 0.5 x 2^-9 is below E4M3's quantum and 6 x 2^7 = 768
   is above its maximum. For one ``d`` the decode is a 16-entry byte table (``e2m1_to_e4m3_table``), or 8
   magnitude bytes OR'd with the sign moved from bit 3 to bit 7. For codes 2..7 and ``d >= -6`` the byte is also
   an integer add on the exponent field, ``(code << 2) + ((6 + d) << 3)``; code 1 (0.5) and the subnormal results
   of ``d`` in {-8, -7} need their own table entries, zero stays zero.
2. **Folding** (``fold_operand``). An MXFP4 block has scale 2^e (UE8M0). Per row and K chunk (``chunk`` = 128 by
   default: the promotion interval; a last, shorter chunk when K is not a multiple of it) a base
   ``b = max(e) - FOLD_WINDOW[1]`` is taken over the chunk's live blocks (a nonzero element, a finite scale), so
   the largest block lands at ``d = e - b = 6`` and no block rises above the window. A live block with
   ``d < -8`` is **out of window**: its E4M3 bytes are (signed) zeros and it is marked in ``in_window`` (False), so the FP8
   MMA adds nothing for it and another path must add its exact contribution (the model's fallback below; the
   kernel's: another base, or the bf16 route). Never silently wrong. All-zero blocks ignore the base (their
   bytes are signed zeros; a chunk with no live block gets base 0). A NaN-scale block (0xFF) becomes E4M3 NaN
   bytes (0x7F), so the MMA propagates NaN as the reference does (its dequantized block is NaN).
3. **The MMA and the promotion** (``fp8_route_accumulate``, ``fp8_route_matmul``). For each output and chunk c:
   ``S_c = sum_k A8[k] B8[k]`` over the chunk's E4M3 values (the tensor core), then
   ``v_c = S_c * 2**(b_a + b_b) + F_c`` and ``acc = fp32(acc + v_c)`` (the promotion), where ``F_c`` is the exact
   sum of the chunk's products with an out-of-window block on either side (the fallback). Then, as
   ``gbs.reference``: ``bf16(fp32(acc * expert_scale))``.

Exactness and the error bound
-----------------------------
* Each E4M3 x E4M3 product is exact (<= 8 significant bits, a multiple of 2^-18, below 448^2 < 2^18), and a
  chunk's sum of at most 128 of them is a multiple of 2^-18 below 2^25: 43 bits, **exact in float64** in any
  order. The model takes ``S_c`` exact: an idealised tensor core. Whether a real accumulator of ``p``
  significant bits holds it exactly is ``chunk_sum_bits_needed(a, b) <= p`` (<= 24: exact in fp32 in any order;
  Hopper's FP8 accumulator keeps fewer bits, about 14 per the DeepSeek-V3 report: to be measured on the GPU).
* ``v_c`` is exact: a power-of-two scaling of ``S_c`` plus ``F_c``, a float64 sum of exact products (below).
  The promotion rounds once per chunk to fp32; the expert scale once more. With ``C = ceil(K / chunk)`` and
  ``terms = a_k b_k s`` (the reference's products and expert scale ``s``)::

      |fp32 result - exact| <= gamma_n(2^-24) sum|terms| + eps_chunk (1 + gamma_n) sum|terms| + n 2^-149 max(1, |s|)
      n = C + 1,   gamma_n(u) = n u / (1 - n u)

  (``fp8_route_error_bound``); ``eps_chunk`` is the relative error of the in-chunk sum per unit of its
  ``sum|terms|``: 0 in this model, to be bounded for the kernel's tensor core; the last term covers fp32
  subnormals. The host model rounds each promotion through float64 first (a double rounding of 2^-53 more per
  step, and float64 fallback sums, exact unless a chunk's exponents spread over about 40 bits): tests add the
  float64 slack ``2 gamma_{K+1}(2^-53) sum|terms|`` as ``gbs.exactness.check_output`` does. Where every term is a
  multiple of 2^q and ``sum|terms| < 2^(q+24)`` (``gbs.exactness.exact_values``' ``exact_accumulation``) each
  partial sum is an fp32 number, so the output is **bit-identical** to the reference there. The result is not
  bit-identical to the bf16 route elsewhere (another accumulation order): the reference and the bound are the
  contract.

Folded ahead
------------
``fold_problem`` writes a whole MXFP4 x MXFP4 problem in this form, once: MXFP8 operands (layout ``e4m3_folded``) whose
UE8M0 scales repeat over each chunk, per token row and per 128-row weight tile, so the kernel multiplies E4M3 bytes it
never decodes (``h200_wgmma.WgmmaSpec.chunk_scaled``). It refuses what it cannot fold exactly (no fallback inside).

Constraints: MXFP4 operands only (``fold_operand`` rejects the others: NVFP4's UE4M3 scales do not fold exactly
into E4M3, MXFP8 tokens already use E4M3's whole range and keep their scales outside the MMA); 2-D operands
(rows, K) in ``pack_fp4`` order (``problem.a_operand()`` / ``b_operand(e)``); ``chunk`` a multiple of 32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .exactness import FP32_TINY, FP32_UNIT, element_quanta, gamma
from .formats import (BF16, E4M3, UE8M0_BIAS, UE8M0_NAN_BYTE, BlockScaled, decode_elements, dequantize,
                      get_format)
from .problem import GroupedProblem
from .reference import poison_output

FOLD_WINDOW = (-8, 6)            # d with x * 2**d an E4M3 number for every E2M1 x (both ends included)
PROMOTION_CHUNK = 128            # K elements per fp32 promotion (4 x k32 wgmma steps), as DeepGEMM
MX_BLOCK = 32                    # elements per UE8M0 scale of MXFP4
E4M3_NAN = 0x7F                  # the byte a NaN block's elements become
_E4M3_BIAS, _E4M3_MIN_NORMAL_EXP, _E4M3_SUBNORMAL_QUANTUM_EXP = 7, -6, -9


# ----------------------------------------------------------------------------------------------
# 1. The exact window: E2M1 code x 2**d -> E4M3 byte
# ----------------------------------------------------------------------------------------------
def exact_e4m3_byte(value: float) -> int | None:
    """The E4M3 byte of ``value`` if ``value`` is exactly an E4M3 number (finite), else None.

    Built from the fields (sign, exponent bias 7, 3 mantissa bits, subnormals k x 2^-9), not from a cast, so a
    test that decodes it with ``ml_dtypes`` checks it independently. -0.0 gives 0x80."""
    value = float(value)
    sign = 0x80 if np.signbit(value) else 0
    mag = abs(value)
    if mag == 0:
        return sign
    if not np.isfinite(mag):
        return None
    mantissa, exponent = np.frexp(mag)               # mag = mantissa * 2**exponent, mantissa in [0.5, 1)
    unbiased = int(exponent) - 1                     # mag = (2 mantissa) * 2**unbiased
    if unbiased >= _E4M3_MIN_NORMAL_EXP:
        fraction = (2 * mantissa - 1) * 8            # the 3 mantissa bits, if exact
        field = unbiased + _E4M3_BIAS
        if fraction != int(fraction) or field > 15 or (field == 15 and fraction == 7):   # 0x7F is NaN
            return None
        return sign | (field << 3) | int(fraction)
    k = np.ldexp(mag, -_E4M3_SUBNORMAL_QUANTUM_EXP)  # subnormal: mag = k * 2**-9, k in 1..7
    return sign | int(k) if k == int(k) else None


def e2m1_scaled_exact(d: int) -> np.ndarray:
    """bool[16]: is ``x * 2**d`` an E4M3 number, for each E2M1 code (any integer ``d``)."""
    values = decode_elements(np.arange(16, dtype=np.uint8), "e2m1").astype(np.float64)
    return np.array([exact_e4m3_byte(np.ldexp(v, d)) is not None for v in values])


def e2m1_to_e4m3_table(d: int) -> np.ndarray:
    """uint8[16]: the E4M3 byte of every E2M1 code (0..15) scaled by ``2**d``; codes 0 / 8 give 0x00 / 0x80.

    Exact for every code iff ``d`` lies in ``FOLD_WINDOW`` ([-8, 6]); a ``ValueError`` outside it."""
    lo, hi = FOLD_WINDOW
    if not (isinstance(d, (int, np.integer)) and lo <= d <= hi):
        raise ValueError(f"folded exponent d = {d!r} is outside the exact window [{lo}, {hi}]: x * 2**d is not an "
                         f"E4M3 number for every E2M1 x there")
    values = decode_elements(np.arange(16, dtype=np.uint8), "e2m1").astype(np.float64)
    return np.array([exact_e4m3_byte(np.ldexp(v, int(d))) for v in values], np.uint8)


# tables[d - FOLD_WINDOW[0], code]: one row per folded exponent of the window
E2M1_TO_E4M3_TABLES = np.stack([e2m1_to_e4m3_table(d) for d in range(FOLD_WINDOW[0], FOLD_WINDOW[1] + 1)])


# ----------------------------------------------------------------------------------------------
# 2. Folding an MXFP4 operand
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FoldedOperand:
    """An MXFP4 operand (rows, K) as E4M3 bytes x 2**base per (row, chunk), plus what the fallback needs.

    ``e4m3``: (rows, K) uint8; zero for out-of-window blocks, 0x7F for NaN blocks.
    ``bases``: (rows, ceil(K / chunk)) int32.
    ``shifts``: (rows, K / 32) int32: the folded exponent ``d = e - base`` of each live block (the decode
    table's index), 0 for all-zero and NaN blocks.
    ``in_window``: (rows, K / 32) bool: False only for live blocks with ``d < -8`` (the fallback's blocks).
    ``source``: the MXFP4 operand folded (the fallback reads its exact values)."""

    e4m3: np.ndarray
    bases: np.ndarray
    shifts: np.ndarray
    in_window: np.ndarray
    source: BlockScaled
    chunk: int

    @property
    def k(self) -> int:
        return self.e4m3.shape[1]

    def element_bases(self) -> np.ndarray:
        """(rows, K) int: the base of each element's chunk."""
        return np.repeat(self.bases, self.chunk, axis=1)[:, :self.k]

    def out_of_window_elements(self) -> np.ndarray:
        """(rows, K) bool: elements of out-of-window blocks."""
        return np.repeat(~self.in_window, MX_BLOCK, axis=1)

    def e4m3_values(self) -> np.ndarray:
        """(rows, K) float64: the E4M3 values the MMA multiplies (exact)."""
        return self.e4m3.view(E4M3).astype(np.float64)

    def unfold(self) -> np.ndarray:
        """(rows, K) float32: E4M3 value x 2**base (exact); equals ``dequantize(source)`` on in-window blocks,
        0 on out-of-window blocks (the fallback carries them)."""
        return np.ldexp(self.e4m3_values(), self.element_bases()).astype(np.float32)


def _check_mxfp4_2d(q: BlockScaled) -> None:
    if q.fmt != get_format("mxfp4"):
        raise ValueError(f"the FP8 route folds MXFP4 operands only, got {q.fmt.name} (NVFP4's UE4M3 scales do not "
                         f"fold exactly into E4M3; MXFP8 keeps its scales outside the MMA)")
    if q.data.ndim != 2:
        raise ValueError(f"fold_operand takes a 2-D (rows, K) operand, got data of shape {q.data.shape}")


BASE_BLOCKS = ("live", "finite")   # which blocks set a chunk's base: see fold_operand


def fold_operand(q: BlockScaled, chunk: int = PROMOTION_CHUNK, *, base_over: str = "live",
                 base_rows: int = 1, min_base: int | None = None) -> FoldedOperand:
    """Fold the UE8M0 block scales of a 2-D MXFP4 operand into E4M3 bytes with a base per (row, chunk).

    Base rule: ``max(e) - 6`` over the chunk's live blocks (module docstring), or with ``base_over="finite"`` over
    every block with a finite scale, zero blocks included: what a kernel computes from the scale bytes alone
    (``gbs.numba_kernels.fp8_decode``; a chunk whose scales are all NaN gets base 0 here, -133 there, and NaN
    bytes either way). ``base_rows``: rows that share one base per chunk (1; 128: a weight tile's, so that the
    promotion takes one factor per token row, ``docs/design/h200_port.md``). ``min_base``: bases below it are raised
    to it (``fold_problem``: -127, the smallest UE8M0 scale; a chunk whose largest block is below 2^-121 then lands
    lower in the window, all of it still inside). Live blocks below the window are zeroed and marked out of window."""
    _check_mxfp4_2d(q)
    if base_over not in BASE_BLOCKS:
        raise ValueError(f"base_over must be one of {BASE_BLOCKS}, got {base_over!r}")
    if not (isinstance(base_rows, (int, np.integer)) and base_rows >= 1):
        raise ValueError(f"base_rows must be a positive int, got {base_rows!r}")
    if not (isinstance(chunk, (int, np.integer)) and chunk > 0 and chunk % MX_BLOCK == 0):
        raise ValueError(f"chunk must be a positive multiple of the MXFP4 block ({MX_BLOCK}), got {chunk!r}")
    codes = q.element_codes()                                   # (rows, K) 0..15
    rows, k = codes.shape
    scales = q.scales.astype(np.int32)                          # (rows, K / 32)
    blocks_per_chunk, nblocks = chunk // MX_BLOCK, scales.shape[1]
    nchunks = -(-nblocks // blocks_per_chunk)
    nan_block = scales == UE8M0_NAN_BYTE
    nonzero = np.any((codes & 0x7).reshape(rows, nblocks, MX_BLOCK) != 0, axis=2)
    live = nonzero & ~nan_block
    exponent = scales - UE8M0_BIAS

    padded = np.full((rows, nchunks * blocks_per_chunk), np.iinfo(np.int32).min, np.int64)
    counted = live if base_over == "live" else ~nan_block
    padded[:, :nblocks] = np.where(counted, exponent, np.iinfo(np.int32).min)
    chunk_max = padded.reshape(rows, nchunks, blocks_per_chunk).max(axis=2)
    if base_rows > 1:   # one base per group of rows: the group's largest
        groups = -(-rows // base_rows)
        grouped = np.full((groups * base_rows, nchunks), np.iinfo(np.int32).min, np.int64)
        grouped[:rows] = chunk_max
        group_max = grouped.reshape(groups, base_rows, nchunks).max(axis=1)
        chunk_max = np.repeat(group_max, base_rows, axis=0)[:rows]
    bases = np.where(chunk_max > np.iinfo(np.int32).min, chunk_max - FOLD_WINDOW[1], 0).astype(np.int32)
    if min_base is not None:
        bases = np.maximum(bases, min_base).astype(np.int32)

    block_bases = np.repeat(bases, blocks_per_chunk, axis=1)[:, :nblocks]
    shifts = np.where(live, exponent - block_bases, 0).astype(np.int32)
    in_window = ~live | (shifts >= FOLD_WINDOW[0])
    assert np.all(shifts <= FOLD_WINDOW[1]), "the base rule puts every block at or below the window's top"

    table_row = np.repeat(np.where(in_window, shifts, 0) - FOLD_WINDOW[0], MX_BLOCK, axis=1)
    e4m3 = E2M1_TO_E4M3_TABLES[table_row, codes]
    e4m3 = np.where(np.repeat(in_window, MX_BLOCK, axis=1), e4m3, e4m3 & 0x80)   # out of window: signed zeros
    e4m3 = np.where(np.repeat(nan_block, MX_BLOCK, axis=1), E4M3_NAN, e4m3).astype(np.uint8)
    return FoldedOperand(e4m3=e4m3, bases=bases, shifts=shifts, in_window=in_window, source=q, chunk=int(chunk))


def out_of_window_fraction(q: BlockScaled, chunk: int = PROMOTION_CHUNK) -> float:
    """Fraction of the live blocks (a nonzero element, a finite scale) of a 2-D MXFP4 operand that fall out of
    window when folded with ``chunk``."""
    f = fold_operand(q, chunk)
    codes = q.element_codes().reshape(f.in_window.shape + (MX_BLOCK,))
    live = np.any(codes & 0x7, axis=2) & (q.scales != UE8M0_NAN_BYTE)
    return float(np.sum(~f.in_window) / max(1, int(np.sum(live))))


# ----------------------------------------------------------------------------------------------
# 3. The FP8 MMA with fp32 promotion per chunk
# ----------------------------------------------------------------------------------------------
def _check_pair(a: FoldedOperand, b: FoldedOperand) -> None:
    if a.k != b.k or a.chunk != b.chunk:
        raise ValueError(f"operands must share K and the chunk: A has K = {a.k}, chunk {a.chunk}; "
                         f"B has K = {b.k}, chunk {b.chunk}")


def _chunks(k: int, chunk: int):
    return [slice(start, min(k, start + chunk)) for start in range(0, k, chunk)]


def fp8_route_accumulate(a: FoldedOperand, b: FoldedOperand) -> np.ndarray:
    """(M, N) float32: the accumulator after the last promotion (before the expert scale), A tokens x K,
    B weights N x K. Per chunk: the exact sum of the E4M3 products (float64: exact, module docstring) times
    ``2**(b_a + b_b)``, plus the exact fallback sum of the pairs with an out-of-window block, added to the fp32
    accumulator with one rounding."""
    _check_pair(a, b)
    a8, b8 = a.e4m3_values(), b.e4m3_values()
    a_out, b_out = a.out_of_window_elements(), b.out_of_window_elements()
    # the fallback's exact values (zero where the FP8 path carries the element; NaN only sits in-window)
    a_exact = dequantize(a.source).astype(np.float64)
    b_exact = dequantize(b.source).astype(np.float64)
    a_fallback = np.where(a_out, a_exact, 0.0)
    a_in, b_fallback = np.where(a_out, 0.0, a_exact), np.where(b_out, b_exact, 0.0)
    acc = np.zeros((a8.shape[0], b8.shape[0]), np.float32)
    for c, ks in enumerate(_chunks(a.k, a.chunk)):
        chunk_sum = a8[:, ks] @ b8[:, ks].T                          # exact: 43-bit multiples of 2**-18
        promoted = np.ldexp(chunk_sum, a.bases[:, c][:, None] + b.bases[:, c][None, :])
        fallback = a_fallback[:, ks] @ b_exact[:, ks].T + a_in[:, ks] @ b_fallback[:, ks].T
        with np.errstate(over="ignore", invalid="ignore"):
            acc = (acc.astype(np.float64) + (promoted + fallback)).astype(np.float32)
    # the MMA's NaN * 0 is NaN: make it independent of how the host BLAS treats zeros
    nan_a = np.any(np.isnan(a8), axis=1)
    nan_b = np.any(np.isnan(b8), axis=1)
    acc[nan_a[:, None] | nan_b[None, :]] = np.nan
    return acc


def fp8_route_matmul(a: FoldedOperand, b: FoldedOperand, expert_scale: float = 1.0) -> np.ndarray:
    """(M, N) bf16 of one group: ``fp8_route_accumulate`` then ``bf16(fp32(acc * expert_scale))``."""
    acc = fp8_route_accumulate(a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        return (acc.astype(np.float64) * np.float64(np.float32(expert_scale))).astype(np.float32).astype(BF16)


def fp8_route_grouped_matmul(problem: GroupedProblem, chunk: int = PROMOTION_CHUNK,
                             out: np.ndarray | None = None) -> np.ndarray:
    """The grouped matmul of an MXFP4 x MXFP4 problem through the FP8 route model; rows of skipped slots keep
    ``out`` (default: the poison sentinel), as ``gbs.reference.reference_grouped_matmul``."""
    p = problem
    if out is None:
        out = poison_output(p.total_tokens, p.n)
    slots = p.active_slots()
    if not slots:
        return out
    a = fold_operand(p.a_operand(), chunk)
    for g in slots:
        e = int(p.expert_ids[g])
        lo, hi = int(p.a_offsets[g]), int(p.a_offsets[g + 1])
        rows = FoldedOperand(a.e4m3[lo:hi], a.bases[lo:hi], a.shifts[lo:hi], a.in_window[lo:hi],
                             BlockScaled(a.source.data[lo:hi], a.source.scales[lo:hi], a.source.fmt), a.chunk)
        out[lo:hi] = fp8_route_matmul(rows, fold_operand(p.b_operand(e), chunk), p.expert_scales[e])
    return out


# ----------------------------------------------------------------------------------------------
# The bound, and where an accumulator of p bits sums a chunk exactly
# ----------------------------------------------------------------------------------------------
def fp8_route_roundings(k: int, chunk: int = PROMOTION_CHUNK) -> int:
    """n = ceil(K / chunk) promotions + 1 expert-scale multiply: the fp32 roundings any term goes through."""
    return -(-k // chunk) + 1


def fp8_route_error_bound(k: int, chunk: int = PROMOTION_CHUNK, chunk_error: float = 0.0) -> float:
    """The coefficient of ``sum|terms|`` in the bound on ``|fp32 result - exact|`` (module docstring):
    ``gamma_n(2^-24) + chunk_error (1 + gamma_n)``; add ``n 2^-149 max(1, |s|)`` for fp32 subnormals.
    ``chunk_error``: relative error of the in-chunk sum (0 for this model's exact chunk sums)."""
    g = gamma(fp8_route_roundings(k, chunk), FP32_UNIT)
    return g + chunk_error * (1 + g)


def fp8_route_absolute_slack(k: int, chunk: int = PROMOTION_CHUNK, expert_scale: float = 1.0) -> float:
    """The bound's absolute term: ``n 2^-149 max(1, |s|)`` (fp32 subnormal roundings)."""
    return fp8_route_roundings(k, chunk) * FP32_TINY * max(1.0, abs(float(expert_scale)))


def chunk_sum_bits_needed(a: FoldedOperand, b: FoldedOperand) -> np.ndarray:
    """(M, N, chunks) int: significant bits an accumulator needs to sum each chunk's E4M3 products exactly in
    any order: with every product a multiple of 2^q, ``floor(log2 sum|products|) - q + 1`` (q from the
    operands' smallest element quanta, so an upper bound); 0 for an all-zero chunk sum. <= 24: exact in fp32."""
    _check_pair(a, b)
    a8, b8 = a.e4m3_values(), b.e4m3_values()
    a8, b8 = np.where(np.isnan(a8), 0.0, a8), np.where(np.isnan(b8), 0.0, b8)
    qa, qb = element_quanta(a8), element_quanta(b8)
    chunks = _chunks(a.k, a.chunk)
    bits = np.zeros((a8.shape[0], b8.shape[0], len(chunks)), np.int64)
    big = np.iinfo(np.int32).max
    for c, ks in enumerate(chunks):
        total = np.abs(a8[:, ks]) @ np.abs(b8[:, ks]).T
        q = qa[:, ks].min(axis=1, initial=big)[:, None] + qb[:, ks].min(axis=1, initial=big)[None, :]
        _, exponent = np.frexp(np.where(total > 0, total, 1.0))
        bits[:, :, c] = np.where(total > 0, (exponent - 1) - q + 1, 0)
    return bits


# ----------------------------------------------------------------------------------------------
# 4. The H200 kernel's route: its bases, what it cannot represent, its tensor core's chunk error
# ----------------------------------------------------------------------------------------------
# Hopper's E4M3 wgmma keeps 14 significant bits of each k32 instruction's sum: adding 2^-g to a product (or an
# accumulator) of 1 is exact for g <= 13 and lost from g = 14, in one instruction or across two (evidence:
# fp8-wgmma-precision). Taken as: every addend of an instruction (its 32 products and the incoming accumulator) is
# cut to a multiple of 2^(E - 13), E the exponent of the largest. A chunk whose sum of |products| is below
# 2^(q + 14) (q: the exponent of the products' common quantum; ``chunk_sum_bits_needed <= 14``) is then summed
# exactly; otherwise each of its 4 instructions errs by at most 33 x 2^-13 of the chunk's sum of |terms|.
HOPPER_E4M3_SUM_BITS = 14
K32_STEPS_PER_CHUNK = PROMOTION_CHUNK // MX_BLOCK
HOPPER_CHUNK_ERROR = K32_STEPS_PER_CHUNK * (MX_BLOCK + 1) * 2.0 ** -(HOPPER_E4M3_SUM_BITS - 1)
KERNEL_WEIGHT_BASE_ROWS = 128      # the kernel's weight tile: one base per 128 rows and chunk
FP32_FACTOR_LOG2 = (-149, 127)     # promotion factors 2^e exact in fp32 (subnormals included)


def _chunk_tops(scales: np.ndarray) -> np.ndarray:
    """(..., C) UE8M0 bytes -> (..., ceil(C / 4)) int: each 128-K chunk's largest finite byte, 0 if none
    (``gbs.numba_kernels.fp8_decode.chunk_max_scale``); the atoms' padding columns are zeros."""
    s = np.where(scales == UE8M0_NAN_BYTE, 0, scales.astype(np.int64))
    pad = -s.shape[-1] % 4
    s = np.concatenate([s, np.zeros(s.shape[:-1] + (pad,), np.int64)], axis=-1)
    return s.reshape(*s.shape[:-1], -1, 4).max(axis=-1)


def _live_blocks(data: np.ndarray, blocks: int) -> np.ndarray:
    """(..., K/2) E2M1 bytes (``pack_fp4`` or ``E2M1E4M3Order``: magnitudes under 0x77 either way) -> (..., blocks)
    bool: a nonzero element in the 32-element block."""
    magnitude = (data & 0x77) != 0
    pad = blocks * (MX_BLOCK // 2) - magnitude.shape[-1]
    magnitude = np.concatenate([magnitude, np.zeros(magnitude.shape[:-1] + (pad,), bool)], axis=-1)
    return magnitude.reshape(*magnitude.shape[:-1], blocks, MX_BLOCK // 2).any(axis=-1)


def kernel_window_violations(problem: GroupedProblem) -> dict[str, int]:
    """What the H200 FP8 route (``h200_wgmma``'s E4M3 consumers) cannot compute exactly for an MXFP4 x MXFP4 or W4A8
    ``problem``, with the kernel's bases (per 128-row weight tile and chunk, per MXFP4 token row and chunk, over the
    finite scales: ``fp8_decode``): ``token_blocks`` / ``weight_blocks``, live blocks below the window (the kernel
    makes their outputs NaN; MXFP8 tokens are not folded: none); ``factors``, (slot, chunk) pairs whose promotion
    factor 2^(token exponent + weight base) may leave ``FP32_FACTOR_LOG2`` (checked on the extremes of the live
    blocks: a sufficient test). All 0: the route is exact up to the accumulation (``HOPPER_CHUNK_ERROR``)."""
    from .formats import unswizzle_scales

    p = problem
    if (p.a_format.name, p.b_format.name) not in (("mxfp4", "mxfp4"), ("mxfp8", "mxfp4")):
        raise ValueError(f"the FP8 route takes MXFP4 or MXFP8 tokens x MXFP4 weights, got {p.a_format.name} x "
                         f"{p.b_format.name}")
    blocks = p.a_format.scale_cols(p.k)
    a = p.a_operand()
    if p.a_format.packed:
        a_live = _live_blocks(a.data, blocks)
        a_top = _chunk_tops(a.scales)                                        # (T, chunks)
        a_exponent = np.repeat(a_top - UE8M0_BIAS - FOLD_WINDOW[1], 4, axis=1)[:, :blocks]   # the row's base
    else:   # MXFP8: the block's own scale multiplies at promotion
        codes = np.ascontiguousarray(a.data).view(np.uint8)
        pad = blocks * MX_BLOCK - codes.shape[1]
        nonzero = np.concatenate([(codes & 0x7F) != 0, np.zeros((codes.shape[0], pad), bool)], axis=1)
        a_live = nonzero.reshape(codes.shape[0], blocks, MX_BLOCK).any(axis=2)
        a_exponent = a.scales.astype(np.int64) - UE8M0_BIAS
    a_live &= a.scales != UE8M0_NAN_BYTE
    b_scales = unswizzle_scales(p.b_scales)                                  # (E, bands * 128, cols padded)
    e, rows, cols = b_scales.shape
    b_top = _chunk_tops(b_scales).reshape(e, rows // KERNEL_WEIGHT_BASE_ROWS, KERNEL_WEIGHT_BASE_ROWS, -1).max(2)
    b_live = _live_blocks(np.asarray(p.b), blocks)                           # (E, N, blocks)

    def outside(scales, top, live):
        d = scales.astype(np.int64) - np.repeat(top, 4, axis=-1)[..., :scales.shape[-1]] + FOLD_WINDOW[1]
        return live & (scales != UE8M0_NAN_BYTE) & (d < FOLD_WINDOW[0])

    token_blocks = int(outside(a.scales, a_top, a_live).sum()) if p.a_format.packed else 0
    b_row_top = np.repeat(b_top, KERNEL_WEIGHT_BASE_ROWS, axis=1)[:, :p.n]
    weight_blocks = int(outside(b_scales[:, :p.n, :blocks], b_row_top, b_live).sum())
    b_base = b_top - UE8M0_BIAS - FOLD_WINDOW[1]                              # (E, tiles, chunks)
    chunks = b_base.shape[-1]
    big = np.iinfo(np.int64).max

    def per_chunk(values, live, reduce, fill):   # (rows, blocks) -> (chunks,) over live blocks
        v = np.where(live, values, fill)
        v = np.concatenate([v, np.full((v.shape[0], chunks * 4 - v.shape[1]), fill)], axis=1)
        return reduce(reduce(v.reshape(v.shape[0], chunks, 4), axis=2), axis=0)

    factors = 0
    for g in p.active_slots():
        ex, lo, hi = int(p.expert_ids[g]), int(p.a_offsets[g]), int(p.a_offsets[g + 1])
        n_live = np.concatenate([b_live[ex], np.zeros((b_base.shape[1] * KERNEL_WEIGHT_BASE_ROWS - p.n, blocks),
                                                      bool)])
        tile_live = n_live.reshape(b_base.shape[1], KERNEL_WEIGHT_BASE_ROWS, blocks).any(axis=1)
        tile_live = np.concatenate([tile_live, np.zeros((tile_live.shape[0], chunks * 4 - blocks), bool)], axis=1)
        tile_live = tile_live.reshape(tile_live.shape[0], chunks, 4).any(axis=2)      # (tiles, chunks)
        a_min = per_chunk(a_exponent[lo:hi], a_live[lo:hi], np.min, big)
        a_max = per_chunk(a_exponent[lo:hi], a_live[lo:hi], np.max, -big)
        b_min = np.where(tile_live, b_base[ex], big).min(axis=0)
        b_max = np.where(tile_live, b_base[ex], -big).max(axis=0)
        both = (a_min < big) & tile_live.any(axis=0)
        low = np.where(both, a_min + b_min, 0) < FP32_FACTOR_LOG2[0]
        high = np.where(both, a_max + b_max, 0) > FP32_FACTOR_LOG2[1]
        factors += int((low | high).sum())
    return dict(token_blocks=token_blocks, weight_blocks=weight_blocks, factors=factors)


# ----------------------------------------------------------------------------------------------
# 4. Folded ahead: an MXFP4 problem as E4M3 operands with one scale per 128-K chunk
# ----------------------------------------------------------------------------------------------
def chunk_scale_bytes(bases: np.ndarray, blocks: int) -> np.ndarray:
    """(rows, chunks) int bases -> (rows, blocks) UE8M0 bytes: each 32-element block carries its chunk's base."""
    return np.repeat(bases + UE8M0_BIAS, PROMOTION_CHUNK // MX_BLOCK, axis=-1)[..., :blocks].astype(np.uint8)


FOLDED_MIN_BASE = -UE8M0_BIAS   # the smallest UE8M0 scale: a base never goes below it (the largest is 2^121)


def _folded_or_raise(f: FoldedOperand, what: str) -> np.ndarray:
    """``f``'s chunk scale bytes, or ValueError where the fold is not exact (a live block below its chunk's
    window)."""
    if not np.all(f.in_window):
        raise ValueError(f"{int(np.sum(~f.in_window))} {what} blocks lie more than 14 binades below their chunk's "
                         f"largest: they do not fold into E4M3 with one scale per chunk (the bf16 route is exact)")
    return chunk_scale_bytes(f.bases, -(-f.k // MX_BLOCK))


def fold_weights(b: BlockScaled) -> BlockScaled:
    """MXFP4 weights (a 3-D ``BlockScaled``, (experts, N, K), linear scales) folded once into E4M3 with one scale per
    128-row tile (from each expert's row 0) and 128-K chunk: an MXFP8 ``BlockScaled`` of the same values, exactly,
    twice their FP4 bytes; its scales go to ``GroupedProblem.b_scales`` through ``formats.swizzle_scales``, with
    ``b_layout="e4m3_folded"``. ValueError where a live block lies 15 or more binades below its tile's largest in the
    chunk. For weights of a host problem, ``fold_problem`` calls it."""
    from .formats import get_format

    if b.fmt != get_format("mxfp4") or b.data.ndim != 3:
        raise ValueError(f"fold_weights takes 3-D (experts, N, K) MXFP4 weights, got {b.fmt.name} of shape "
                         f"{b.data.shape}")
    experts, n, k = b.data.shape[0], b.data.shape[1], b.k
    data = np.empty((experts, n, k), np.uint8)
    scales = np.empty((experts, n, b.scales.shape[-1]), np.uint8)
    for e in range(experts):
        f = fold_operand(BlockScaled(b.data[e], b.scales[e], b.fmt), base_rows=KERNEL_WEIGHT_BASE_ROWS,
                         min_base=FOLDED_MIN_BASE)
        data[e], scales[e] = f.e4m3, _folded_or_raise(f, "weight")
    return BlockScaled(data.view(E4M3), scales, get_format("mxfp8"))


def _fold_tokens(p: GroupedProblem) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 tokens folded per row and 128-K chunk: (E4M3 bytes (tokens, K) uint8, linear UE8M0 bytes per block)."""
    a = fold_operand(p.a_operand(), min_base=FOLDED_MIN_BASE)
    return a.e4m3, _folded_or_raise(a, "token")


def fold_problem_tokens(problem: GroupedProblem) -> tuple[np.ndarray, np.ndarray]:
    """The token half of ``fold_problem`` for an MXFP4 x MXFP4 ``problem``, without folding its weights: (E4M3 bytes
    (tokens, K) uint8, scale atoms shaped as ``problem.a_scales``), what ``gbs.numba_kernels.fold.fold_tokens``
    computes on the GPU. ValueError where the fold is not exact."""
    from .formats import get_format, pad_group_scales
    from .layouts import LAYOUT_PACKED

    mxfp4 = get_format("mxfp4")
    if (problem.a_format, problem.b_format) != (mxfp4, mxfp4) or problem.a_layout != LAYOUT_PACKED:
        raise ValueError(f"fold_problem_tokens folds MXFP4 tokens in packed order, got {problem.a_format.name} "
                         f"({problem.a_layout!r}) x {problem.b_format.name}")
    data, scale_bytes = _fold_tokens(problem)
    return data, pad_group_scales(scale_bytes, problem.a_offsets)[0]


def fold_problem(problem: GroupedProblem) -> GroupedProblem:
    """An MXFP4 x MXFP4 ``problem`` as the same matmul in MXFP8 x MXFP8 whose scales are constant per 128-K chunk:
    per token row (``fold_operand``), and per 128-row weight tile (``fold_weights``), so the E4M3 MMAs of a chunk need
    one fp32 promotion with one factor per token row (``h200_wgmma.WgmmaSpec.chunk_scaled``); a W4A8 one (MXFP8
    tokens) with its weights folded alone, the tokens as they are (the kernel then promotes every k32 step with the
    token block's scale). Every value is the original's exactly, so the exact reference of the result is the
    problem's. The weights fold once (twice their FP4 bytes); the tokens every call (on the GPU:
    ``gbs.numba_kernels.fold.fold_tokens``). Bases never go below 2^-127 (``FOLDED_MIN_BASE``: a finite UE8M0 byte;
    the largest is 2^121). ValueError where the fold is not exact: a live block 15 or more binades below its chunk's
    largest (in the weight tile, for weights), or a promotion factor ``2^(e_token + e_tile)`` outside fp32's normal
    and subnormal range."""
    from .formats import get_format, pad_group_scales, swizzle_scales
    from .layouts import LAYOUT_E4M3_FOLDED, LAYOUT_PACKED

    p = problem
    mxfp4, mxfp8 = get_format("mxfp4"), get_format("mxfp8")
    if (p.a_format, p.b_format) not in ((mxfp4, mxfp4), (mxfp8, mxfp4)) or p.a_layout != LAYOUT_PACKED:
        raise ValueError(f"fold_problem folds MXFP4 x MXFP4 and W4A8 (MXFP8 x MXFP4) problems in packed order, got "
                         f"{p.a_format.name} ({p.a_layout!r}) x {p.b_format.name}")
    if not isinstance(p, GroupedProblem):
        raise TypeError(f"fold_problem takes a host GroupedProblem, got {type(p).__name__}")
    if p.a_format == mxfp8:   # W4A8: the tokens keep their per-32 scales (promoted per k32 step)
        a_data, a_layout = p.a, LAYOUT_PACKED
        a_bytes = p.a_operand().scales
        token_blocks = a_bytes[a_bytes != UE8M0_NAN_BYTE].astype(np.int64)
    else:
        a_data, a_bytes = _fold_tokens(p)
        a_data, a_layout = a_data.view(E4M3), LAYOUT_E4M3_FOLDED
        token_blocks = a_bytes[:, ::4].astype(np.int64)
    weights = [p.b_operand(e) for e in range(p.num_experts)]
    b = fold_weights(BlockScaled(np.stack([w.data for w in weights]), np.stack([w.scales for w in weights]), mxfp4))
    b_bytes = b.scales
    if token_blocks.size:
        tiles = b_bytes.astype(np.int64)
        low = int(token_blocks.min()) + int(tiles.min()) - 2 * UE8M0_BIAS
        high = int(token_blocks.max()) + int(tiles.max()) - 2 * UE8M0_BIAS
        if low < FP32_FACTOR_LOG2[0] or high > FP32_FACTOR_LOG2[1]:
            raise ValueError(f"promotion factors from 2^{low} to 2^{high} leave fp32 ({FP32_FACTOR_LOG2}): not folded")
    a_scales, a_scale_offsets = pad_group_scales(a_bytes, p.a_offsets)
    return GroupedProblem(a_format=mxfp8, b_format=mxfp8, a=a_data.copy(), b=b.data,
                          a_scales=a_scales, b_scales=swizzle_scales(b_bytes), a_offsets=p.a_offsets.copy(),
                          a_scale_offsets=a_scale_offsets, expert_ids=p.expert_ids.copy(),
                          expert_scales=p.expert_scales.copy(), num_active_experts=p.num_active_experts,
                          estimated_total_m=p.estimated_total_m, n=p.n, k=p.k, a_layout=a_layout,
                          b_layout=LAYOUT_E4M3_FOLDED)
