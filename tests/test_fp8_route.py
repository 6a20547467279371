"""gbs.fp8_route: the host model of the FP8 route (issue 31, item 3): the exact window, folding, the MMA with
fp32 promotion per chunk, against ``gbs.reference`` with the stated bound.

Out-of-window blocks, **modelled on synthetic data, not measured on a GPU** (``python tests/test_fp8_route.py``
prints this table; 1024 rows x K 7168, quantized MXFP4 RCEIL, seed 0). Each cell: fraction of the blocks out of
window / fraction of (128-row tile x chunk) pairs holding at least one (the granularity a kernel branches at).

=========================================  =================  =================  =================
data (rows x K)                            chunk 128          chunk 256          chunk 512
=========================================  =================  =================  =================
Gaussian weights (std 0.02)                0 / 0              0 / 0              0 / 0
Gaussian tokens, 1 % channels x 20         0 / 0              0 / 0              0 / 0
Student-t, 3 dof                           0 / 0              0 / 0              0 / 0
Student-t, 1 dof (Cauchy)                  9.6e-5 / 0.029     2.0e-4 / 0.076     4.5e-4 / 0.205
Gaussian, one block per row x 2^12         0 / 0              0 / 0              0 / 0
Gaussian, one block per row x 2^14         1.1e-3 / 0.214     2.5e-3 / 0.442     5.4e-3 / 0.839
Gaussian, one block per row x 2^15         1.2e-2 / 0.897     2.9e-2 / 0.996     6.1e-2 / 1.000
Gaussian, one block per row x 2^16         1.3e-2 / 0.902     3.1e-2 / 0.987     6.7e-2 / 1.000
=========================================  =================  =================  =================
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from gbs import fp8_route as fr
from gbs.exactness import FP64_UNIT, exact_values, gamma, round_to_bf16
from gbs.formats import BF16, BlockScaled, decode_elements, dequantize, get_format, pack_fp4, quantize
from gbs.problem import build_problem, random_activations, random_problem
from gbs.reference import reference_grouped_matmul

E2M1_VALUES = decode_elements(np.arange(16, dtype=np.uint8), "e2m1").astype(np.float64)
MXFP4 = get_format("mxfp4")


def mxfp4_operand(codes, scale_bytes) -> BlockScaled:
    """A 2-D MXFP4 operand from element codes (rows, K) and scale bytes (rows, K / 32)."""
    return BlockScaled(pack_fp4(np.asarray(codes, np.uint8)), np.asarray(scale_bytes, np.uint8), MXFP4)


def random_codes(rng, rows, k):
    return rng.integers(0, 16, (rows, k)).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# 1. The exact window
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", range(fr.FOLD_WINDOW[0], fr.FOLD_WINDOW[1] + 1))
def test_every_code_scaled_by_every_window_exponent_decodes_back_exactly(d):
    table = fr.e2m1_to_e4m3_table(d)
    decoded = table.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(decoded, np.ldexp(E2M1_VALUES, d))
    assert np.array_equal(np.signbit(decoded), np.signbit(E2M1_VALUES)), "code 8 is -0, byte 0x80"
    assert table[0] == 0x00 and table[8] == 0x80
    assert np.array_equal(table[8:], table[:8] | 0x80), "8 magnitude bytes, the sign moved from bit 3 to bit 7"
    assert np.array_equal(fr.E2M1_TO_E4M3_TABLES[d - fr.FOLD_WINDOW[0]], table)


def test_the_window_is_tight():
    assert not fr.e2m1_scaled_exact(-9).all() and not fr.e2m1_scaled_exact(7).all()
    exact_everywhere = [d for d in range(-40, 40) if fr.e2m1_scaled_exact(d).all()]
    assert exact_everywhere == list(range(-8, 7))
    for d in (-9, 7, 100):
        with pytest.raises(ValueError, match=r"\[-8, 6\]"):
            fr.e2m1_to_e4m3_table(d)


def test_exact_e4m3_byte_inverts_every_e4m3_byte():
    for byte in range(256):
        value = np.array([byte], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)[0]
        assert fr.exact_e4m3_byte(value) == (None if np.isnan(value) else byte)
    assert fr.exact_e4m3_byte(2.0 ** -10) is None and fr.exact_e4m3_byte(449.0) is None
    assert fr.exact_e4m3_byte(1.0625) is None      # 4 mantissa bits


def test_codes_2_to_7_fold_as_an_integer_add_on_the_exponent_field_from_d_minus_6():
    """The docstring's claim, for a kernel that adds instead of looking up."""
    for d in range(-6, 7):
        table = fr.e2m1_to_e4m3_table(d)
        assert [int(table[c]) for c in range(2, 8)] == [(c << 2) + ((6 + d) << 3) for c in range(2, 8)]
    assert fr.e2m1_to_e4m3_table(0)[1] != (1 << 2) + (6 << 3), "code 1 (0.5) needs its own entry"


# ----------------------------------------------------------------------------------------------
# 2. Folding
# ----------------------------------------------------------------------------------------------
def assert_unfolds_exactly(f: fr.FoldedOperand):
    exact, unfolded = dequantize(f.source), f.unfold()
    inside = ~f.out_of_window_elements()
    assert np.array_equal(unfolded[inside], exact[inside], equal_nan=True)
    assert np.all(unfolded[~inside] == 0), "out-of-window blocks carry nothing on the FP8 path"


@pytest.mark.parametrize("chunk", [32, 128, 256])
@pytest.mark.parametrize("data", ["gaussian", "student_t1", "tokens_with_outliers"])
def test_unfolding_equals_dequantize_on_random_data(data, chunk):
    rng = np.random.default_rng(7)
    x = {"gaussian": lambda: 0.02 * rng.standard_normal((24, 352)),
         "student_t1": lambda: rng.standard_t(1, (24, 352)),   # ragged: block exponents spread widely
         "tokens_with_outliers": lambda: random_activations(rng, 24, 352)}[data]()
    f = fr.fold_operand(quantize(x.astype(np.float32), "mxfp4"), chunk)
    assert f.bases.shape == (24, -(-352 // chunk)) and f.e4m3.shape == (24, 352)
    assert np.all(f.shifts <= 6) and np.all(f.shifts[f.in_window] >= -8)
    assert_unfolds_exactly(f)


def test_blocks_at_both_ends_of_the_window_and_beyond():
    rng = np.random.default_rng(1)
    codes = random_codes(rng, 2, 256)
    codes[:, ::32] = 7                         # every block live (a 6 in it)
    e = 127 + 20                               # chunk 0: d = 6, -8, -9, 3;  chunk 1: d = 6, -7, -20, 6
    scales = np.array([[e, e - 14, e - 15, e - 3, e, e - 13, e - 26, e]] * 2, np.uint8)
    f = fr.fold_operand(mxfp4_operand(codes, scales))
    assert f.bases.tolist() == [[14, 14]] * 2
    assert f.shifts[0].tolist() == [6, -8, -9, 3, 6, -7, -20, 6]
    assert f.in_window[0].tolist() == [True, True, False, True, True, True, False, True]
    assert_unfolds_exactly(f)


def test_zero_and_nan_blocks_do_not_move_the_base():
    rng = np.random.default_rng(2)
    codes = random_codes(rng, 3, 128)
    codes[0, 32:64] = 8                        # an all (-)zero block with a huge scale
    codes[1, :] = 0                            # a chunk of zero blocks
    scales = np.full((3, 4), 127, np.uint8)
    scales[0, 1] = 250
    scales[2, 3] = 0xFF                        # a NaN block beside live ones
    scales[2, 2] = 0xFF
    codes[2, 64:96] = 0                        # a NaN block with zero codes is NaN too
    f = fr.fold_operand(mxfp4_operand(codes, scales))
    assert f.bases[:, 0].tolist() == [-6, 0, -6]
    assert f.in_window.all()
    assert np.all(f.e4m3[0, 32:64] == 0x80), "signed zeros stay signed zeros"
    assert np.all(f.e4m3[2, 64:] == fr.E4M3_NAN)
    assert np.isnan(f.unfold()[2, 64:]).all() and np.isnan(dequantize(f.source)[2, 64:]).all()
    assert_unfolds_exactly(f)


def test_fold_operand_rejects_what_it_cannot_fold():
    x = np.ones((2, 64), np.float32)
    for fmt in ("nvfp4", "mxfp8"):
        with pytest.raises(ValueError, match="MXFP4 operands only"):
            fr.fold_operand(quantize(x, fmt))
    with pytest.raises(ValueError, match="multiple of"):
        fr.fold_operand(quantize(x, "mxfp4"), chunk=48)
    with pytest.raises(ValueError, match="2-D"):
        fr.fold_operand(quantize(np.ones((2, 2, 64), np.float32), "mxfp4"))


def test_out_of_window_fraction_on_the_surveys_extremes():
    rng = np.random.default_rng(0)
    gaussian = quantize((0.02 * rng.standard_normal((256, 1024))).astype(np.float32), "mxfp4")
    assert fr.out_of_window_fraction(gaussian) == 0.0
    x = rng.standard_normal((256, 1024))
    x[:, 64:96] *= 2.0 ** 16                   # one outlier block per row: the other 3 blocks of its chunk fall out
    assert fr.out_of_window_fraction(quantize(x.astype(np.float32), "mxfp4")) == pytest.approx(3 / 32, abs=0.01)


# ----------------------------------------------------------------------------------------------
# 3. The MMA with promotion, against the reference
# ----------------------------------------------------------------------------------------------
def compare_with_reference(problem, out, chunk):
    """(outside the bound, bit-identical, exact-accumulation outputs, of which not bit-identical) on written
    rows; NaN must match NaN."""
    ref = reference_grouped_matmul(problem)
    exact, magnitude, exact_sum = exact_values(problem)
    rows = problem.written_rows()
    o, r = out[rows].astype(np.float64), ref[rows].astype(np.float64)
    e, t, must = exact[rows], magnitude[rows], exact_sum[rows]
    assert np.array_equal(np.isnan(o), np.isnan(r)), "NaN exactly where the reference has NaN"
    s = float(np.max(np.abs(problem.expert_scales)))
    bound = ((fr.fp8_route_error_bound(problem.k, chunk) + 2 * gamma(problem.k + 1, FP64_UNIT)) * t
             + fr.fp8_route_absolute_slack(problem.k, chunk, s))
    finite = ~np.isnan(r)
    with np.errstate(invalid="ignore"):
        inside = (o >= round_to_bf16(e - bound)) & (o <= round_to_bf16(e + bound))
    identical = out[rows].view(np.uint16) == ref[rows].view(np.uint16)
    return (int(np.sum(~inside & finite)), int(np.sum(identical)), int(np.sum(must & finite)),
            int(np.sum(must & finite & ~identical)))


PROBLEMS = [dict(n=64, k=320, num_experts=6, total_tokens=40, num_active_experts=4, routing="ragged",
                 num_empty=1, num_skipped=1, seed=11),
            dict(n=96, k=512, num_experts=8, total_tokens=9, num_active_experts=5, routing="uniform",
                 num_skipped=1, seed=12),                       # 1- and 2-token groups
            dict(n=32, k=2880, num_experts=4, total_tokens=6, top_k=2, routing="topk", seed=13)]   # gpt-oss K


@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize("shape", PROBLEMS, ids=["ragged", "tiny_groups", "gpt_oss_k"])
def test_matches_the_reference_within_the_bound_and_bitwise_where_exact(shape, chunk):
    p = random_problem("mxfp4", **shape)
    out = fr.fp8_route_grouped_matmul(p, chunk)
    outside, identical, exact, exact_differ = compare_with_reference(p, out, chunk)
    assert outside == 0 and exact_differ == 0
    assert exact > 0 and identical >= exact
    assert np.all(out[~p.written_rows()].view(np.uint16) == 0x7FAB), "skipped rows keep the poison"


def test_non_power_of_two_expert_scales_round_once_more():
    p = random_problem("mxfp4", **PROBLEMS[0])
    rng = np.random.default_rng(3)
    p = dataclasses.replace(p, expert_scales=rng.uniform(0.3, 3.0, p.num_experts).astype(np.float32))
    outside, _, _, exact_differ = compare_with_reference(p, fr.fp8_route_grouped_matmul(p), 128)
    assert outside == 0 and exact_differ == 0


def wide_range_operands(seed=8, rows=24, k=1024, spread=40):
    """Folded MXFP4 operands whose 128-K chunks sit 2**0 .. 2**spread apart (each chunk in window): their sums
    need more than fp32's 24 bits, so the promotions round."""
    rng = np.random.default_rng(seed)

    def operand(n):
        gains = np.repeat(2.0 ** rng.integers(0, spread, (n, k // 128)), 128, axis=1)
        return fr.fold_operand(quantize((rng.standard_normal((n, k)) * gains).astype(np.float32), "mxfp4"))
    return operand(rows), operand(rows + 8)


def test_the_fp32_accumulator_stays_within_the_bound_where_promotions_round():
    a, b = wide_range_operands()
    assert a.in_window.all() and b.in_window.all()
    acc = fr.fp8_route_accumulate(a, b).astype(np.float64)
    xa, xb = dequantize(a.source).astype(np.float64), dequantize(b.source).astype(np.float64)
    exact, magnitude = xa @ xb.T, np.abs(xa) @ np.abs(xb).T
    n = fr.fp8_route_roundings(a.k) - 1                            # no expert scale here
    bound = (gamma(n, 2.0 ** -24) + 2 * gamma(a.k + 1, FP64_UNIT)) * magnitude + n * 2.0 ** -149
    error = np.abs(acc - exact)
    assert np.all(error <= bound)
    assert np.sum(acc != exact.astype(np.float32)) > 0, "some promotions round: the bound is exercised"
    assert np.max(error / bound) > 1e-3


def outlier_problem(gain_log2=20, seed=21):
    """Tokens and weights with one block x 2**gain in some rows: the other blocks of its chunk fall out of window.
    The other operand is zero where the outliers sit, so the out-of-window blocks carry most of the result (with
    outliers that meet nonzero values, dropping them would mostly hide below bf16's resolution)."""
    rng = np.random.default_rng(seed)
    k, n, experts = 384, 48, 3
    x = rng.standard_normal((30, k)).astype(np.float32)
    w = (0.02 * rng.standard_normal((experts, n, k))).astype(np.float32)
    x[::3, 32:64] *= np.float32(2.0 ** gain_log2)
    w[:, :, 32:64] = 0
    w[:, ::2, 160:192] *= np.float32(2.0 ** gain_log2)
    x[:, 160:192] = 0
    return build_problem(x, w, np.array([12, 0, 18]), np.array([0, 1, 2]), fmt="mxfp4")


def test_out_of_window_blocks_take_the_exact_fallback():
    p = outlier_problem()
    a = fr.fold_operand(p.a_operand())
    b = fr.fold_operand(p.b_operand(0))
    assert (~a.in_window).sum() >= 30 and (~b.in_window).sum() >= 40, "both operands have out-of-window blocks"
    outside, _, exact, exact_differ = compare_with_reference(p, fr.fp8_route_grouped_matmul(p), 128)
    assert outside == 0 and exact_differ == 0 and exact > 0
    # without the fallback (the FP8 path alone: out-of-window blocks add nothing) the check sees it
    no_fallback = fr.fp8_route_grouped_matmul(p)
    for g in p.active_slots():
        lo, hi, e = int(p.a_offsets[g]), int(p.a_offsets[g + 1]), int(p.expert_ids[g])
        b_e = fr.fold_operand(p.b_operand(e)).unfold().astype(np.float64)
        no_fallback[lo:hi] = (a.unfold()[lo:hi].astype(np.float64) @ b_e.T).astype(np.float32).astype(BF16)
    assert compare_with_reference(p, no_fallback, 128)[0] > 100


def test_nan_blocks_make_exactly_the_reference_outputs_nan():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((20, 256)).astype(np.float32)
    w = (0.02 * rng.standard_normal((2, 40, 256))).astype(np.float32)
    x[3, 70] = np.nan
    w[1, 5, 200] = np.inf
    p = build_problem(x, w, np.array([8, 12]), np.array([0, 1]), fmt="mxfp4")
    out = fr.fp8_route_grouped_matmul(p)
    nan = np.isnan(out.astype(np.float32))
    assert nan[3].all() and nan[8:, 5].all() and nan.sum() == 40 + 12
    outside, _, _, exact_differ = compare_with_reference(p, out, 128)
    assert outside == 0 and exact_differ == 0


def test_a_base_off_by_one_is_caught():
    p = random_problem("mxfp4", **PROBLEMS[0])
    a = fr.fold_operand(p.a_operand())
    g = p.active_slots()[0]
    lo, hi, e = int(p.a_offsets[g]), int(p.a_offsets[g + 1]), int(p.expert_ids[g])
    bases = a.bases.copy()
    bases[lo, 1] += 1                          # planted fault: chunk 1 of the slot's first token doubles
    faulty = dataclasses.replace(a, bases=bases)
    rows = dataclasses.replace(faulty, e4m3=faulty.e4m3[lo:hi], bases=faulty.bases[lo:hi],
                               shifts=faulty.shifts[lo:hi], in_window=faulty.in_window[lo:hi],
                               source=BlockScaled(a.source.data[lo:hi], a.source.scales[lo:hi], MXFP4))
    out = fr.fp8_route_grouped_matmul(p)
    out[lo:hi] = fr.fp8_route_matmul(rows, fr.fold_operand(p.b_operand(e)), p.expert_scales[e])
    outside, _, _, exact_differ = compare_with_reference(p, out, 128)
    assert outside > p.n // 2 and exact_differ > 0


def test_chunk_sums_needing_at_most_24_bits_are_exact_in_fp32_in_sequence():
    p = random_problem("mxfp4", **PROBLEMS[0])
    a = fr.fold_operand(p.a_operand())
    b = fr.fold_operand(p.b_operand(int(p.expert_ids[p.active_slots()[0]])))
    bits = fr.chunk_sum_bits_needed(a, b)
    assert bits.max() <= 43                    # 2**-18 quanta below 2**25: the float64 model is exact
    a8, b8 = a.e4m3_values(), b.e4m3_values()
    for c, ks in enumerate(slice(start, start + a.chunk) for start in range(0, a.k, a.chunk)):
        products = (a8[:, None, ks] * b8[None, :, ks]).astype(np.float32)    # exact
        sequential = np.zeros(products.shape[:2], np.float32)
        for j in range(products.shape[2]):
            sequential = sequential + products[:, :, j]
        exact = a8[:, ks] @ b8[:, ks].T
        fits = bits[:, :, c] <= 24
        assert fits.all() and np.array_equal(sequential[fits].astype(np.float64), exact[fits])


def test_the_bound_counts_one_rounding_per_chunk_and_one_for_the_expert_scale():
    assert fr.fp8_route_roundings(7168) == 57 and fr.fp8_route_roundings(2880) == 24
    assert fr.fp8_route_roundings(2880, 256) == 13
    assert fr.fp8_route_error_bound(7168) == pytest.approx(57 * 2.0 ** -24, rel=1e-5)
    assert fr.fp8_route_error_bound(7168, chunk_error=2.0 ** -13) > 2.0 ** -13


# ----------------------------------------------------------------------------------------------
# The survey behind the module docstring's table
# ----------------------------------------------------------------------------------------------
def window_survey(rows=1024, k=7168, seed=0, chunks=(128, 256, 512)):
    """{data name: [(block fraction, tile x chunk fraction) per chunk]} on synthetic MXFP4 (RCEIL) tensors."""
    rng = np.random.default_rng(seed)

    def outlier_blocks(gain_log2):
        x = rng.standard_normal((rows, k))
        block = rng.integers(0, k // 32, rows)
        for i in range(rows):
            x[i, block[i] * 32:(block[i] + 1) * 32] *= 2.0 ** gain_log2
        return x

    data = {"Gaussian weights (std 0.02)": lambda: 0.02 * rng.standard_normal((rows, k)),
            "Gaussian tokens, 1 % channels x 20": lambda: random_activations(rng, rows, k),
            "Student-t, 3 dof": lambda: rng.standard_t(3, (rows, k)),
            "Student-t, 1 dof (Cauchy)": lambda: rng.standard_t(1, (rows, k))}
    for g in (12, 14, 15, 16):
        data[f"Gaussian, one block per row x 2^{g}"] = lambda g=g: outlier_blocks(g)
    table = {}
    for name, make in data.items():
        q = quantize(make().astype(np.float32), "mxfp4")
        cells = []
        for chunk in chunks:
            out = ~fr.fold_operand(q, chunk).in_window
            per_chunk = out.reshape(rows // 128, 128, -1, chunk // 32).any(axis=(1, 3))
            cells.append((float(out.mean()), float(per_chunk.mean())))
        table[name] = cells
    return table


if __name__ == "__main__":
    for name, cells in window_survey().items():
        print(f"{name:42s}", "  ".join(f"{b:.1e} / {t:.3f}" for b, t in cells))


def test_base_rows_share_one_base_per_group_and_chunk():
    """``base_rows=128``: every row of a 128-row group gets the group's base per chunk (the largest block's), the
    values are still exact where in the window, and a row far below its group's largest drops out of the window."""
    rng = np.random.default_rng(31)
    q = quantize(rng.standard_normal((200, 256)).astype(np.float32), "mxfp4")
    scales = q.scales.copy()
    scales[5, 0] = scales[:128, :4].max() + 16          # row 5 lifts group 0's base in chunk 0
    q = BlockScaled(q.data, scales, q.fmt)
    f = fr.fold_operand(q, base_over="finite", base_rows=128)
    own = fr.fold_operand(q, base_over="finite")
    assert (f.bases[:128, 0] == own.bases[5, 0]).all() and (f.bases[128:, 0] == own.bases[128:, 0].max()).all()
    inside = np.repeat(f.in_window, 32, axis=1)
    np.testing.assert_array_equal(f.unfold()[inside], own.unfold()[inside])
    shared, alone = (~f.in_window[:128, :4]).sum(), (~own.in_window[:128, :4]).sum()
    assert shared > alone + 100   # the other rows of the group fall 16 below the lifted base
    with pytest.raises(ValueError, match="base_rows"):
        fr.fold_operand(q, base_rows=0)


def test_host_chunk_tops_are_the_kernel_s_chunk_maxima():
    """``fp8_route._chunk_tops`` (vectorized, the plan's window count) and ``fp8_decode.chunk_max_scale`` (the kernel's
    scalar form on a row's 4-byte scale word) agree on every chunk, NaN bytes and all-NaN chunks included, and on a
    partial last chunk (the atoms' zero padding)."""
    from gbs.numba_kernels import fp8_decode as fd

    rng = np.random.default_rng(3)
    scales = rng.integers(0, 256, (64, 23), dtype=np.uint8)
    scales[rng.random(scales.shape) < 0.2] = 0xFF
    scales[0, :4] = 0xFF   # an all-NaN chunk: 0
    tops = fr._chunk_tops(scales)
    padded = np.concatenate([scales, np.zeros((64, 1), np.uint8)], axis=1)
    words = padded.view("<u4")   # byte i of a word = block 4 c + i of chunk c
    assert tops.shape == words.shape
    assert [[fd.chunk_max_scale(int(w)) for w in row] for row in words] == tops.tolist()
    assert tops[0, 0] == 0
