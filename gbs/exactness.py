"""What each kernel guarantees about its output, asserted element by element against the exact reference.

A kernel (or kernel model) computes, per output, an fp32 value ``y`` in which every term ``a*b*sa*sb*s`` (element
products, the two block scales, the expert scale) went through at most ``n`` fp32 operations of unit roundoff
``u``; so ``|y - exact| <= gamma_n * sum|terms|`` (``gamma_n = n u / (1 - n u)``; Higham, Accuracy and Stability of
Numerical Algorithms, 3.1), and ``out = RNE_bf16(y)``. Hence ``out`` lies between ``RNE_bf16(exact - bound)`` and
``RNE_bf16(exact + bound)`` (``check_output``): for most elements that interval holds one bf16 value, so the
check is bit-exact except where the bound straddles a bf16 rounding boundary. ``exact`` is the reference's float64
value before its rounding (``exact_values``, checked to round to ``gbs.reference``'s bits).

Where the summation is exact whatever its order, the output is bit-identical to the reference, and that is
asserted too (``exact_accumulation``): every term of an output is a multiple of ``2**q`` with ``q`` the sum of the
row's and the column's smallest element quanta; when ``sum|terms| < 2**(q + 23)`` every partial sum, in any
order, any split into runs and any tensor-core alignment, is exactly an fp32 number, so the accumulator is exact;
the epilogue's ``acc * 2**d * s`` then rounds once to fp32 (an exact 24-bit accumulator times a 24-bit scale is
exact in float64, which the reference rounds to fp32 the same way) and once to bf16, as the reference does. The
accumulators of the H200 kernels hold the products pre-scaled by ``2**-32`` at most (``h200_decode``'s pre-bias),
and split-K adds partials with ``red.global.add.f32``, which flushes subnormals: so also ``q - 32 >= -126``.

W4A16 (bf16 tokens, no block scales, x MXFP4 / NVFP4 weights) is checked the same way: the H200 kernels take the
tokens as they are and decode the weights to bf16 exactly (value x scale x ``2**-d``), so every product of 8 x 8
significant bits is exact in fp32 and accumulates in fp32, as on the other formats' bf16 route; the SIMT kernel
sums the weights' blocks of products and multiplies by their scales (the tokens' "scale" is 1).

Rows of skipped slots must still hold the poison sentinel, every written row must be written. Used by the demo
(kernel models on the CPU, or the GPU's kernel), the GPU tests and the benchmark's output checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formats import BF16, dequantize
from .problem import GroupedProblem
from .reference import is_poison, reference_grouped_matmul

FP32_UNIT = 2.0 ** -24          # unit roundoff of fp32 round-to-nearest
TENSOR_CORE_UNIT = 2.0 ** -22   # per product, of a tensor core's aligned, truncated sum (TENSOR_CORE_EXACTNESS)
FP64_UNIT = 2.0 ** -53
FP32_TINY = 2.0 ** -149         # bounds the absolute error an fp32 operation can make in the subnormal range


def _is_power_of_two(x) -> np.ndarray:
    mantissa, _ = np.frexp(np.asarray(x, np.float64))
    return np.abs(mantissa) == 0.5


@dataclass(frozen=True)
class Exactness:
    """``roundings(problem)``: fp32 operations any one term goes through (``n``); ``unit``: their
    unit roundoff; ``bit_exact_pow2``: bits equal the reference's where the expert scale is a power of two."""

    model: str
    claim: str
    unit: float
    bit_exact_pow2: bool = False
    roundings_kind: str = "simt"

    def roundings(self, problem: GroupedProblem) -> int:
        block, k = problem.b_format.block_size, problem.k   # the weights' blocks: scaled tokens share them
        if self.roundings_kind == "simt":
            # block-sum adds, x a-scale, x b-scale, the adds over K's blocks, x expert scale
            return block + 2 + -(-k // block) + 1
        if self.roundings_kind == "epilogue":
            return 2          # fp32(accumulator), x expert scale in fp32
        return 2 * k + 8      # see TENSOR_CORE_EXACTNESS


SIMT_EXACTNESS = Exactness(
    "simt", "fp32 sum of each block's products, x both block scales, fp32 adds over the K blocks, x expert "
    "scale: n = block + 2 + K/block + 1 roundings", FP32_UNIT)
EMULATOR_EXACTNESS = Exactness(
    "emulator", "exact (float64) MMA sums, fp32 accumulator x fp32 expert scale: n = 2 roundings; "
    "bit-identical to the reference where the expert scale is a power of two", FP32_UNIT, True, "epilogue")
# Tensor cores add each MMA step's k >= 16 exact products to the fp32 accumulator with alignment and
# truncation: at most (k + 1) 2^-22 of the step's magnitude (Fasi et al. 2021, "Numerical behavior of
# NVIDIA tensor cores"), so at most 1.07 K 2^-22 sum|terms| over K, in any order or split. Asserted as
# n = 2K + 8 roundings of 2^-22 (slack for split-K partial sums and the epilogue): a worst case, loose
# for large K; the kernels' own tight bounds belong to their GPU tests.
TENSOR_CORE_EXACTNESS = Exactness(
    "tensor cores", "fp32 tensor-core accumulation (truncating, any order or split over K): n = 2K + 8 "
    "roundings of 2^-22", TENSOR_CORE_UNIT, False, "any")
EXACTNESS = {"simt": SIMT_EXACTNESS, "emulator": EMULATOR_EXACTNESS, "sm100": TENSOR_CORE_EXACTNESS,
             "h200_stream": TENSOR_CORE_EXACTNESS, "h200_wgmma": TENSOR_CORE_EXACTNESS}


# The accumulators' pre-scaling (h200_decode: 2**-(d_a + d_b), d up to 16 each) and fp32's smallest normal:
# exact accumulation also needs the scaled terms to stay normal (split-K's red.global.add flushes subnormals).
ACCUMULATOR_PREBIAS_LOG2 = 32
FP32_MIN_NORMAL_LOG2 = -126
FP32_SIGNIFICAND_BITS = 24


def element_quanta(x: np.ndarray) -> np.ndarray:
    """log2 of each float64 element's least significant set bit (``x`` is a multiple of ``2**q``); a large value
    for zeros (they add nothing), a small one for non-finite elements (never exact)."""
    x = np.asarray(x, np.float64)
    finite = np.isfinite(x)
    mantissa, exponent = np.frexp(np.where(finite, x, 1.0))
    digits = np.abs(np.ldexp(mantissa, 53)).astype(np.int64)   # x = digits * 2**(exponent - 53), digits an integer
    lowest_bit = np.where(digits == 0, 1, digits & -digits).astype(np.float64)   # zeros: replaced below
    lowest = np.log2(lowest_bit).astype(np.int64)
    q = exponent.astype(np.int64) - 53 + lowest
    return np.where(~finite, np.iinfo(np.int32).min, np.where(x == 0, np.iinfo(np.int32).max, q))


def exact_values(problem: GroupedProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exact, magnitude, exact_accumulation), (total_tokens, N), NaN / False on unwritten rows: the reference's
    float64 value before its rounding (``expert_scale * A_deq @ B_deq^T``), ``sum_k |a_k b_k| * |expert_scale|``,
    and where every fp32 accumulation of the output is exact whatever its order (module docstring)."""
    p = problem
    exact = np.full((p.total_tokens, p.n), np.nan)
    magnitude = np.full((p.total_tokens, p.n), np.nan)
    exact_sum = np.zeros((p.total_tokens, p.n), bool)
    a = dequantize(p.a_operand()).astype(np.float64)
    a_quantum = element_quanta(a).min(axis=1, initial=np.iinfo(np.int32).max)
    for g in p.active_slots():
        e = int(p.expert_ids[g])
        lo, hi = int(p.a_offsets[g]), int(p.a_offsets[g + 1])
        b = dequantize(p.b_operand(e)).astype(np.float64)
        s = np.float64(p.expert_scales[e])
        terms = np.abs(a[lo:hi]) @ np.abs(b).T
        exact[lo:hi] = (a[lo:hi] @ b.T) * s
        magnitude[lo:hi] = terms * abs(s)
        q = a_quantum[lo:hi, None] + element_quanta(b).min(axis=1, initial=np.iinfo(np.int32).max)[None, :]
        with np.errstate(over="ignore", invalid="ignore"):
            exact_sum[lo:hi] = ((terms < np.ldexp(1.0, np.clip(q + FP32_SIGNIFICAND_BITS - 1, -1074, 1023)))
                                & (q - ACCUMULATOR_PREBIAS_LOG2 >= FP32_MIN_NORMAL_LOG2) & np.isfinite(terms)
                                & np.isfinite(s) & (s != 0))
    return exact, magnitude, exact_sum


def round_to_bf16(x) -> np.ndarray:
    """float64 ``x`` rounded once to the nearest bf16 (ties to even), as float64 (exact)."""
    x = np.asarray(x, np.float64)
    _, exponent = np.frexp(np.abs(x))
    quantum = np.ldexp(1.0, np.maximum(exponent - 1, -126) - 7)   # bf16: 8 significant bits, min exponent -126
    return np.round(x / quantum) * quantum                          # np.round: half to even; /quantum is exact


def gamma(n: int, unit: float) -> float:
    if n * unit >= 1:
        raise ValueError(f"{n} roundings of unit {unit} leave no bound")
    return n * unit / (1 - n * unit)


@dataclass
class ModelCheck:
    """The outcome of one output's check."""

    model: str
    fmt: str
    claim: str
    elements: int = 0                # written outputs
    bit_identical: int = 0           # ... equal to the reference's bits
    outside: int = 0                 # ... outside the bound
    ambiguous: int = 0               # ... where the bound admits more than one bf16 value
    exact_accumulation: int = 0      # ... whose accumulation is exact in any order (bit-identity asserted there)
    max_row_error: float = 0.0       # max over rows of max|out - ref| / max|ref| in the row
    roundings: int = 0
    mismatches: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        verdict = "ok" if self.passed else "MISMATCH"
        within = "all" if not self.outside else f"{self.elements - self.outside}/{self.elements}"
        return (f"{verdict}: bit-identical to the reference {self.bit_identical}/{self.elements} (asserted at the "
                f"{self.exact_accumulation} with exact accumulation), {within} within "
                f"the bound (n={self.roundings}; it admits more than one bf16 value at {self.ambiguous}), max "
                f"per-row normalised error {self.max_row_error:.2e}")


def _where(problem: GroupedProblem, row: int, col: int) -> str:
    slot = int(np.searchsorted(problem.a_offsets, row, side="right")) - 1
    return f"row {row} (slot {slot}, expert {int(problem.expert_ids[slot])}) column {col}"


def check_output(problem: GroupedProblem, out: np.ndarray, model: str, fmt: str | None = None,
                 ref: np.ndarray | None = None, exact: tuple | None = None) -> ModelCheck:
    """Check ``out`` (poisoned before the run) against the reference with ``model``'s exactness
    (``EXACTNESS``); the mismatches are listed in the result (``raise_on_mismatch`` raises them)."""
    spec = EXACTNESS[model]
    fmt = fmt or problem.format_name
    if ref is None:
        ref = reference_grouped_matmul(problem)
    exact_v, magnitude, exact_sum = exact_values(problem) if exact is None else exact
    n = spec.roundings(problem)
    result = ModelCheck(model, fmt, spec.claim, roundings=n)
    out = np.asarray(out)
    if out.shape != ref.shape or out.dtype != BF16:
        result.mismatches.append(f"MISMATCH: {model} {fmt}: output {out.shape} {out.dtype}, expected {ref.shape} "
                                 f"bfloat16")
        return result
    written = problem.written_rows()
    skipped = np.flatnonzero(~written)
    clobbered = skipped[~np.all(is_poison(out[skipped]), axis=1)]
    if clobbered.size:
        result.mismatches.append(f"MISMATCH: {model} {fmt}: rows {clobbered.tolist()} of skipped (-1) slots were "
                                 f"written (the poison sentinel is gone)")
    unwritten = np.flatnonzero(written & np.any(is_poison(out), axis=1))
    if unwritten.size:
        result.mismatches.append(f"MISMATCH: {model} {fmt}: rows {unwritten.tolist()} were not (fully) written "
                                 f"(they still hold the poison sentinel)")
    rows = np.flatnonzero(written)
    ref_bits = ref.view(np.uint16)[rows]
    if not np.array_equal(exact_v[rows].astype(np.float32).astype(BF16).view(np.uint16), ref_bits):
        raise RuntimeError("the demo's exact values do not round to gbs.reference's bits: the check is broken")
    with np.errstate(invalid="ignore"):
        o = out[rows].astype(np.float64)
    r = ref[rows].astype(np.float64)
    e, t = exact_v[rows], magnitude[rows]
    # The model's fp32 value is within `bound` of exact; the float64 `exact` itself is within
    # gamma_{K+1} (float64) of the true value, and so is the emulator's float64 accumulator.
    bound = (gamma(n, spec.unit) + 2 * gamma(problem.k + 1, FP64_UNIT)) * t + n * FP32_TINY * max(
        1.0, float(np.max(np.abs(problem.expert_scales))))
    with np.errstate(invalid="ignore"):
        lo, hi = round_to_bf16(e - bound), round_to_bf16(e + bound)
        # a NaN / Inf operand (a NaN block, a NaN or Inf bf16 token): the output is NaN where the exact value is, and
        # the same Inf where it is one
        nonfinite = ~np.isfinite(e)
        inside = np.where(nonfinite, (np.isnan(e) & np.isnan(o)) | (np.isinf(e) & (o == e)), (o >= lo) & (o <= hi))
    identical = (out.view(np.uint16)[rows] == ref_bits) | (np.isnan(o) & np.isnan(r))
    result.elements = int(o.size)
    result.bit_identical = int(identical.sum())
    result.ambiguous = int(np.sum((lo != hi) & ~nonfinite))
    result.outside = int(np.sum(~inside))
    with np.errstate(invalid="ignore"):
        row_error = np.max(np.abs(o - r), axis=1) / np.maximum(np.max(np.abs(r), axis=1), np.finfo(float).tiny)
    result.max_row_error = float(np.max(row_error, initial=0.0)) if np.all(np.isfinite(o)) else float("inf")
    must_match = exact_sum[rows]
    result.exact_accumulation = int(must_match.sum())
    differ = np.argwhere(must_match & ~identical)
    if differ.size:
        i, j = differ[0]
        result.mismatches.append(
            f"MISMATCH: {model} {fmt}: {len(differ)} outputs whose accumulation is exact in any order are not "
            f"bit-identical to the reference; first at {_where(problem, int(rows[i]), int(j))}: out {o[i, j]!r}, "
            f"reference {r[i, j]!r}")
    bad = np.argwhere(~inside)
    if bad.size:
        i, j = bad[0]
        result.mismatches.append(
            f"MISMATCH: {model} {fmt}: {len(bad)} of {o.size} outputs outside what the kernel guarantees "
            f"({spec.claim}); first at {_where(problem, int(rows[i]), int(j))}: out {o[i, j]!r}, reference "
            f"{r[i, j]!r}, exact {e[i, j]:.9g}, allowed [{lo[i, j]!r}, {hi[i, j]!r}]")
    if spec.bit_exact_pow2:
        pow2 = _is_power_of_two(problem.expert_scales[np.maximum(problem.expert_ids, 0)])
        must = np.zeros(problem.total_tokens, bool)
        for g in problem.active_slots():
            must[problem.a_offsets[g]:problem.a_offsets[g + 1]] = pow2[g]
        differ = np.argwhere(~identical & must[rows][:, None])
        if differ.size:
            i, j = differ[0]
            result.mismatches.append(
                f"MISMATCH: {model} {fmt}: {len(differ)} outputs not bit-identical to the reference although "
                f"their expert scale is a power of two; first at {_where(problem, int(rows[i]), int(j))}: "
                f"out {o[i, j]!r}, reference {r[i, j]!r}")
    return result


