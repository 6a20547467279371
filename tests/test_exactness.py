"""gbs.exactness: the element-wise guarantee checks (exact values, quanta, exact accumulation, the bound)."""
import numpy as np
import pytest

from gbs import exactness
from gbs.problem import random_problem
from gbs.reference import reference_grouped_matmul


def test_element_quanta_is_the_lowest_set_bit():
    x = np.array([0.75, 6.0, 0.5, 0.0, 3 * 2.0 ** -20, -1.5, np.inf])
    q = exactness.element_quanta(x)
    assert q[:3].tolist() == [-2, 1, -1] and q[4] == -20 and q[5] == -1
    assert q[3] > 1000 and q[6] < -1000   # zeros add nothing; non-finite is never exact


def test_exact_accumulation_holds_for_small_k_and_fails_with_a_wide_range():
    p = random_problem("mxfp4", n=64, k=64, num_experts=2, total_tokens=6, num_active_experts=2, seed=3)
    exact, magnitude, exact_sum = exactness.exact_values(p)
    rows = p.written_rows()
    assert exact_sum[rows].all(), "64 FP4 terms with two scale blocks: every sum is exact in fp32"
    # one huge block scale next to tiny ones: the sum needs more than 24 bits
    wide = random_problem("mxfp4", n=64, k=64, num_experts=2, total_tokens=6, num_active_experts=2, seed=3)
    scales = wide.a_scales.copy()
    scales[..., 0] = 127 + 40    # first scale column of every row: 2**40
    wide = wide.__class__(**{**wide.__dict__, "a_scales": scales})
    assert not exactness.exact_values(wide)[2][rows].any()


def test_a_fault_the_bound_admits_is_caught_where_accumulation_is_exact():
    """Where the bound straddles a bf16 rounding boundary it admits two values; where the accumulation is exact
    only the reference's is right, and the check says so."""
    p = random_problem("mxfp4", n=128, k=128, num_experts=3, total_tokens=20, num_active_experts=3, seed=5)
    ref = reference_grouped_matmul(p)
    exact, magnitude, exact_sum = exactness.exact_values(p)
    spec = exactness.EXACTNESS["h200_stream"]
    bound = exactness.gamma(spec.roundings(p), spec.unit) * magnitude
    lo, hi = exactness.round_to_bf16(exact - bound), exactness.round_to_bf16(exact + bound)
    candidates = np.argwhere((lo != hi) & exact_sum & p.written_rows()[:, None])
    assert candidates.size, "some outputs admit two bf16 values under the tensor-core bound"
    i, j = candidates[0]
    out = ref.copy()
    other = hi[i, j] if ref[i, j].astype(np.float64) == lo[i, j] else lo[i, j]
    out[i, j] = np.float64(other)
    check = exactness.check_output(p, out, "h200_stream")
    assert check.outside == 0, "the bound alone would pass it"
    assert not check.passed and "accumulation is exact in any order" in check.mismatches[0]
    assert exactness.check_output(p, ref, "h200_stream").passed


@pytest.mark.parametrize("fmt, block", [("w4a16", 32), ("w4a16_nvfp4", 16)])
def test_w4a16_bound_and_exact_accumulation(fmt, block):
    """bf16 tokens x FP4 weights: the SIMT model counts the weights' blocks; the reference passes every model; a
    token rounded as W4A8 would round it (MXFP8) is outside the bound, one ulp where accumulation is exact fails."""
    p = random_problem(fmt, n=72, k=96, num_experts=4, total_tokens=24, num_active_experts=3, routing="ragged",
                       num_empty=1, num_skipped=1, seed=7)
    assert exactness.SIMT_EXACTNESS.roundings(p) == block + 2 + 96 // block + 1
    ref = reference_grouped_matmul(p)
    for model in exactness.EXACTNESS:
        assert exactness.check_output(p, ref, model).passed, model
    exact, magnitude, exact_sum = exactness.exact_values(p)
    rows = p.written_rows()
    assert exact_sum[rows].any()   # 8-bit tokens x FP4 weights: sums of 96 products can be exact in fp32
    w4a8 = random_problem("w4a8", n=72, k=96, num_experts=4, total_tokens=24, num_active_experts=3,
                          routing="ragged", num_empty=1, num_skipped=1, seed=7)
    check = exactness.check_output(p, reference_grouped_matmul(w4a8), "h200_wgmma")
    if fmt == "w4a16":   # the same weights: only the tokens' rounding differs
        assert check.outside > 0 and not check.passed
    i, j = np.argwhere(exact_sum & rows[:, None])[0]
    out = ref.copy()
    out.view(np.uint16)[i, j] += 1
    check = exactness.check_output(p, out, "h200_stream")
    assert not check.passed and "accumulation is exact in any order" in "\n".join(check.mismatches)


def test_nan_and_inf_tokens_must_give_nan_and_inf_where_the_exact_value_is():
    """A NaN bf16 token makes its row NaN and an Inf one its row +-Inf or NaN: the reference passes, a kernel that
    drops either (finite numbers there, or the other infinity) fails."""
    p = random_problem("w4a16", n=64, k=64, num_experts=2, total_tokens=8, num_active_experts=2, seed=4)
    rows = np.flatnonzero(p.written_rows())
    a = p.a.copy()
    a[rows[0], 3] = np.float32("nan")
    a[rows[1], :] = 0
    a[rows[1], 5] = np.float32("inf")   # one nonzero term per output: +-Inf or NaN (zero weights), never finite
    p = p.__class__(**{**p.__dict__, "a": a})
    ref = reference_grouped_matmul(p)
    assert np.isnan(ref[rows[0]].astype(np.float32)).all() and np.isinf(ref[rows[1]].astype(np.float32)).any()
    assert exactness.check_output(p, ref, "h200_wgmma", ref=ref).passed
    finite = ref.copy()
    finite[rows[0]] = 0
    assert not exactness.check_output(p, finite, "h200_wgmma", ref=ref).passed
    flipped = ref.copy()
    col = int(np.flatnonzero(np.isinf(ref[rows[1]].astype(np.float32)))[0])
    flipped[rows[1], col] = -ref[rows[1], col]
    assert not exactness.check_output(p, flipped, "h200_wgmma", ref=ref).passed
