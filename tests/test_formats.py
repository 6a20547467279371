"""Encodings, quantize / dequantize, packing and the 128x4 scale layout (gbs.formats) against docs/design/formats.md."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gbs.formats import (BF16, FORMATS, ScaleLayout128x4, decode_elements, decode_scales, decode_ue4m3, decode_ue8m0, dequantize, encode_elements, gather_group_scales, get_format, group_scale_offsets, pack_fp4, pad_group_scales, padded_scale_rows, quantize, scale_offset, swizzle_scales, ue8m0_exponent, unpack_fp4, unswizzle_scales)

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SCALED_FORMATS = sorted(name for name, f in FORMATS.items() if f.scaled)   # all but bf16


# ---------------------------------------------------------------------------------------------
# Element encodings
# ---------------------------------------------------------------------------------------------
def test_every_e2m1_code_decodes_per_the_table():
    codes = np.arange(16, dtype=np.uint8)
    want = np.array(E2M1_VALUES + [-v for v in E2M1_VALUES], np.float32)
    np.testing.assert_array_equal(decode_elements(codes, "e2m1"), want)
    assert np.signbit(decode_elements(np.uint8(8), "e2m1"))   # code 8 is -0.0


def test_every_e2m1_value_encodes_to_its_code():
    values = np.array(E2M1_VALUES + [-v for v in E2M1_VALUES[1:]], np.float32)
    codes = encode_elements(values, "e2m1")
    np.testing.assert_array_equal(decode_elements(codes, "e2m1"), values)


@pytest.mark.parametrize("x, want", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),   # ties to even
    (0.2499, 0.0), (0.2501, 0.5), (5.01, 6.0),
    (7.0, 6.0), (100.0, 6.0), (-7.0, -6.0), (np.float32(3.4e38), 6.0),                       # saturation
])
def test_e2m1_round_to_nearest_even_and_saturate(x, want):
    got = decode_elements(encode_elements(np.array([x], np.float32), "e2m1"), "e2m1")[0]
    assert got == want


def test_e2m1_byte_with_high_bits_reads_low_nibble():
    # ml_dtypes would read 0x13 as a wrong sign; the decoder masks the nibble
    assert decode_elements(np.uint8(0x13), "e2m1") == 1.5


@pytest.mark.parametrize("x, want", [(448.0, 448.0), (449.0, 448.0), (480.0, 448.0), (1e6, 448.0),
                                     (-1e6, -448.0), (2.0 ** -9, 2.0 ** -9), (2.0 ** -11, 0.0)])
def test_e4m3_clips_to_448_and_keeps_subnormals(x, want):
    assert decode_elements(encode_elements(np.array([x], np.float32), "e4m3"), "e4m3")[0] == want


def test_e4m3_raw_cast_trap_is_real():
    # the reason encode_elements clips first: ml_dtypes does not saturate E4M3
    assert np.isnan(np.float32(480.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("x, want", [(57344.0, 57344.0), (60000.0, 57344.0), (1e9, 57344.0), (2.0 ** -16, 2.0 ** -16)])
def test_e5m2_saturates(x, want):
    assert decode_elements(encode_elements(np.array([x], np.float32), "e5m2"), "e5m2")[0] == want


# ---------------------------------------------------------------------------------------------
# Scale encodings
# ---------------------------------------------------------------------------------------------
def test_ue8m0_edge_bytes():
    v = decode_ue8m0(np.array([0x00, 0x01, 0x7F, 0xFE, 0xFF], np.uint8))
    assert v[0] == np.float32(2.0 ** -127) and v[0] > 0     # a float32 subnormal, not zero
    assert v[1] == np.float32(2.0 ** -126)
    assert v[2] == 1.0
    assert v[3] == np.float32(2.0 ** 127)
    assert np.isnan(v[4])


def test_ue4m3_nan_byte():
    assert np.isnan(decode_ue4m3(np.uint8(0x7F)))
    assert decode_ue4m3(np.uint8(0x7E)) == 448.0




@pytest.mark.parametrize("element, max_value", [("e2m1", 6.0), ("e4m3", 448.0), ("e5m2", 57344.0)])
def test_rceil_never_clips_and_is_tight(element, max_value):
    rng = np.random.default_rng(0)
    amax = np.concatenate([
        np.exp2(rng.uniform(-60, 60, 2000)),
        max_value * np.exp2(np.arange(-20, 20)),             # exactly max * 2^j: no rounding up
        np.nextafter(max_value * np.exp2(np.arange(-20, 20)), np.inf),
    ]).astype(np.float32)
    e = ue8m0_exponent(amax, element, "rceil").astype(np.int64) - 127
    assert np.all(amax <= max_value * np.exp2(e.astype(np.float64)))          # never clips
    assert np.all(amax > max_value * np.exp2(e.astype(np.float64) - 1))       # smallest such exponent


@pytest.mark.parametrize("element, emax", [("e2m1", 2), ("e4m3", 8), ("e5m2", 15)])
def test_floor_exponent_from_bits_below_powers_of_two(element, emax):
    # just below 2^j, float32 log2 rounds up to j; the bit-exact floor is j - 1
    j = np.arange(-30, 30)
    below = np.nextafter(np.exp2(j).astype(np.float32), np.float32(0))
    assert np.floor(np.log2(below[j == 20]))[0] == 20     # the float32 log2 trap is real
    e = ue8m0_exponent(below, element, "floor").astype(np.int64) - 127
    np.testing.assert_array_equal(e, j - 1 - emax)
    at = ue8m0_exponent(np.exp2(j).astype(np.float32), element, "floor").astype(np.int64) - 127
    np.testing.assert_array_equal(at, j - emax)


def test_ue8m0_zero_block_nonfinite_and_clamp():
    b = ue8m0_exponent(np.array([0.0, np.nan, np.inf, 1e-45, 3e38], np.float32), "e2m1", "rceil")
    assert b[0] == 0x00 and b[1] == 0xFF and b[2] == 0xFF
    assert b[3] == 0x00                       # 2^-149 / 6 needs 2^-151: clamped to 2^-127
    assert b[4] == 127 + 126                  # 3e38 / 6 ~ 2^125.2 -> 2^126


def test_floor_and_rceil_differ_exactly_where_the_spec_says():
    # MXFP4: FLOOR picks 2^(floor(log2 amax) - 2), which clips (amax / scale > 6) exactly when amax's
    # mantissa is above 1.5; RCEIL then picks the next exponent up, and agrees with FLOOR elsewhere.
    for mantissa in [1.0, 1.25, 1.5, 1.5078125, 1.5625, 1.75, 1.99]:
        for binade in [-3, 0, 5]:
            x = np.zeros((1, 32), np.float32)
            x[0, 0] = mantissa * 2.0 ** binade
            x[0, 1] = 0.1
            floor_q, rceil_q = quantize(x, "mxfp4", "floor"), quantize(x, "mxfp4", "rceil")
            floor_scale = decode_ue8m0(floor_q.scales[0, 0])
            rceil_scale = decode_ue8m0(rceil_q.scales[0, 0])
            clips = mantissa > 1.5
            assert (x[0, 0] / floor_scale > 6.0) == clips
            assert x[0, 0] / rceil_scale <= 6.0                     # RCEIL never clips
            assert (floor_scale != rceil_scale) == clips
            if clips:
                assert dequantize(floor_q)[0, 0] == 6.0 * floor_scale  # saturated to the max


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", SCALED_FORMATS)
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_quantize_shapes_dtypes_and_relative_error(fmt, scale_mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    q = quantize(x, fmt, scale_mode)
    f = get_format(fmt)
    assert q.data.shape == (64, 128 if f.packed else 256)
    assert q.data.dtype == (np.uint8 if f.packed else f.element_dtype)
    assert q.scales.shape == (64, 256 // f.block_size) and q.scales.dtype == np.uint8
    assert (q.global_scale is not None) == (fmt == "nvfp4")
    d = dequantize(q)
    rel = np.sqrt(np.mean((d - x) ** 2) / np.mean(x ** 2))
    limit = {"nvfp4": 0.12, "mxfp4": 0.2, "mxfp8": 0.04, "mxfp8_e5m2": 0.08}[fmt]
    assert rel < limit, rel
    assert not np.allclose(d, 0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_quantize_is_a_fixed_point(fmt):
    """Dequantized values are exactly representable: quantizing them again changes nothing."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 64)) * np.exp2(rng.integers(-8, 8, (8, 1)))).astype(np.float32)
    q = quantize(x, fmt)
    d = dequantize(q, apply_global_scale=False)
    if fmt == "nvfp4":
        return_trip = dequantize(quantize(dequantize(q), fmt))
        assert np.allclose(return_trip, dequantize(q), rtol=0, atol=np.abs(x).max() * 1e-6)
    else:
        # the scale may shrink (the block max can round down) but every value survives exactly
        np.testing.assert_array_equal(dequantize(quantize(d, fmt)), d)


def test_dequantize_is_exact_element_times_scale():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 100
    for fmt in SCALED_FORMATS:
        q = quantize(x, fmt)
        f = q.fmt
        codes = q.element_codes().astype(np.int64)
        elem = decode_elements(codes.astype(np.uint8), f.element).astype(np.float64)
        scales = (decode_ue4m3 if f.scale_dtype == "ue4m3" else decode_ue8m0)(q.scales).astype(np.float64)
        exact = elem * np.repeat(scales, f.block_size, axis=1)
        np.testing.assert_array_equal(dequantize(q, apply_global_scale=False).astype(np.float64), exact)


def test_nvfp4_two_level_recipe_by_hand():
    x = np.zeros((1, 32), np.float32)
    x[0, :16] = np.linspace(-3, 3, 16)
    x[0, 16:] = np.linspace(-12, 12, 16)
    q = quantize(x, "nvfp4")
    s_enc = np.float32(448 * 6) / np.float32(12)
    assert q.global_scale == s_enc
    s0 = (np.float32(3) / np.float32(6) * s_enc).astype(ml_dtypes.float8_e4m3fn)
    s1 = (np.float32(12) / np.float32(6) * s_enc).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q.scales[0], np.array([s0, s1]).view(np.uint8))
    assert dequantize(q)[0, 31] == pytest.approx(12.0, rel=1e-6)


def test_nvfp4_per_expert_global_scale_for_3d_weights():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 8, 32)).astype(np.float32) * np.array([1, 10, 100], np.float32)[:, None, None]
    q = quantize(w, "nvfp4")
    assert q.global_scale.shape == (3,)
    np.testing.assert_allclose(q.global_scale, 2688.0 / np.abs(w).max(axis=(1, 2)), rtol=1e-6)


def test_zero_tensor_and_zero_blocks():
    x = np.zeros((2, 64), np.float32)
    x[1, 40] = 1.0
    for fmt in FORMATS:
        q = quantize(x, fmt)
        d = dequantize(q)
        np.testing.assert_array_equal(d, x)
        if q.fmt.scale_dtype == "ue8m0":
            assert q.scales[0, 0] == 0x00
    assert quantize(np.zeros((1, 16), np.float32), "nvfp4").global_scale == 1.0


def test_nvfp4_tiny_amax_saturates_the_global_scale_instead_of_nan():
    """amax below 448*6 / FLT_MAX: S_enc is the largest float32, not inf (``0 * inf`` made every all-zero
    block's scale NaN; found by the property test below with one value 1.09e-37 among zeros)."""
    x = np.zeros((3, 64), np.float32)
    x[0, 0] = np.float32(1.0907055e-37)
    q = quantize(x, "nvfp4")
    assert q.global_scale == np.finfo(np.float32).max
    for apply in (False, True):
        assert np.all(np.isfinite(dequantize(q, apply_global_scale=apply)))
    d = dequantize(q)
    assert np.all(d.ravel()[1:] == 0) and d[0, 0] == pytest.approx(x[0, 0], rel=0.25)


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_nonfinite_propagate_makes_only_that_block_nan(fmt):
    x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 63] = -np.inf
    q = quantize(x, fmt)
    d = dequantize(q)
    b = q.fmt.block_size
    assert np.all(np.isnan(d[0, :b])) and np.all(np.isfinite(d[0, b:]))
    assert np.all(np.isnan(d[1, -b:])) and np.all(np.isfinite(d[1, :-b]))
    nan_byte = 0x7F if fmt == "nvfp4" else 0xFF
    assert q.scales[0, 0] == nan_byte and q.scales[1, -1] == nan_byte
    if fmt == "nvfp4":   # the global amax ignores the non-finite blocks
        finite_blocks = np.abs(x).reshape(2, 4, 16)[np.isfinite(x).reshape(2, 4, 16).all(axis=2)]
        assert q.global_scale == np.float32(2688.0) / np.float32(finite_blocks.max())


def test_nonfinite_raise():
    x = np.ones((2, 32), np.float32)
    x[1, 5] = np.inf
    with pytest.raises(ValueError, match=r"non-finite .* index \(1, 5\)"):
        quantize(x, "mxfp8", nonfinite="raise")


@pytest.mark.parametrize("bad, err, match", [
    (np.ones((2, 30), np.float32), ValueError, "not a multiple of the mxfp4 block size 32"),
    (np.ones((2, 32), np.float64), TypeError, "float64"),
    (np.ones((2, 32), np.int32), TypeError, "dtype int32"),
    (np.ones((2, 0), np.float32), ValueError, "at least one element"),
])
def test_quantize_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        quantize(bad, "mxfp4")


def test_quantize_bad_options():
    x = np.ones((1, 32), np.float32)
    with pytest.raises(ValueError, match="unknown block-scaled format"):
        quantize(x, "fp4")
    with pytest.raises(ValueError, match="scale_mode"):
        quantize(x, "mxfp4", "ceil")
    with pytest.raises(ValueError, match="nonfinite"):
        quantize(x, "mxfp4", nonfinite="ignore")


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(SCALED_FORMATS), mode=st.sampled_from(["rceil", "floor"]),
       x=hnp.arrays(np.float32, (3, 64), elements=st.floats(-2.0 ** 100, 2.0 ** 100, width=32, allow_subnormal=True)))
def test_property_roundtrip_error_is_bounded_by_the_block_scale(fmt, mode, x):
    q = quantize(x, fmt, mode)
    d = dequantize(q, apply_global_scale=False).astype(np.float64)
    f = q.fmt
    scales = (decode_ue4m3 if f.scale_dtype == "ue4m3" else decode_ue8m0)(q.scales).astype(np.float64)
    assert np.all(np.isfinite(d))
    # every dequantized value is an element value times its block's scale, within +-max*scale
    assert np.all(np.abs(d) <= f.element_max * np.repeat(scales, f.block_size, axis=1))
    if fmt != "nvfp4" and mode == "rceil":
        # RCEIL never clips: the error is at most half an element step at the block's top binade
        half_ulp = {"e2m1": 1.0, "e4m3": 16.0, "e5m2": 4096.0}[f.element]
        err = np.abs(d - x.astype(np.float64))
        assert np.all(err <= np.repeat(scales, f.block_size, axis=1) * half_ulp * (1 + 1e-9))


# ---------------------------------------------------------------------------------------------
# bf16 (W4A16's tokens): no block scales
# ---------------------------------------------------------------------------------------------
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def test_bf16_is_an_unscaled_format():
    f = get_format("bf16")
    assert (f.element, f.block_size, f.scale_dtype, f.scaled) == ("bf16", 0, "none", False)
    assert all(FORMATS[name].scaled for name in SCALED_FORMATS)
    assert f.element_dtype == BF16 and f.element_bits == 16 and not f.packed and not f.has_global_scale
    assert f.element_max == BF16_MAX == 3.3895313892515355e38 and f.element_emax == 127
    assert f.scale_cols(96) == 0 and f.row_bytes(96) == 192
    with pytest.raises(ValueError, match="bf16 has no block scales to decode"):
        decode_scales(np.zeros(4, np.uint8), "bf16")
    with pytest.raises(TypeError, match="bf16 codes are 16-bit"):
        decode_elements(np.zeros(4, np.uint8), "bf16")


def test_bf16_quantize_rounds_to_nearest_even_and_dequantizes_as_is():
    ulp = 2.0 ** -7   # bf16 at 1.0: 8 significant bits
    x = np.array([[1 + ulp / 2, 1 + 1.5 * ulp, -(1 + 2.5 * ulp), 1 + ulp / 2 + 2.0 ** -20,   # ties to even, above a tie
                   3 * 2.0 ** -135, 2.0 ** -134, 0.0, -0.0,                                   # subnormals: RNE too
                   np.finfo(np.float32).max, -3.39e38, BF16_MAX, 1e-45]], np.float32)       # saturating past the max
    want = np.array([[1.0, 1 + 2 * ulp, -(1 + 2 * ulp), 1 + ulp, 2.0 ** -133, 0.0, 0.0, -0.0,
                      BF16_MAX, -BF16_MAX, BF16_MAX, 0.0]])
    q = quantize(x, "bf16")
    assert q.data.dtype == BF16 and q.data.shape == x.shape and q.k == 12
    assert q.scales.shape == (1, 0) and q.scales.dtype == np.uint8 and q.global_scale is None
    assert q.global_decode_scale == 1.0
    d = dequantize(q)
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d, want)
    np.testing.assert_array_equal(np.signbit(d), np.signbit(want))
    np.testing.assert_array_equal(q.element_codes(), q.data.view(np.uint16))
    np.testing.assert_array_equal(decode_elements(q.element_codes(), "bf16"), d)
    # any float32 in bf16's range rounds as ml_dtypes' RNE cast, in any shape and any K (no blocks)
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 2 ** 32, (3, 5, 30), dtype=np.uint64).astype(np.uint32)
    y = bits.view(np.float32)
    y = np.where(np.isfinite(y) & (np.abs(y) <= BF16_MAX), y, np.float32(1.5))
    np.testing.assert_array_equal(quantize(y, "bf16").data.view(np.uint16), y.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(dequantize(quantize(d, "bf16")), d)   # a fixed point


def test_bf16_nonfinite_values_stay_element_by_element_or_raise():
    x = np.random.default_rng(7).standard_normal((2, 40)).astype(np.float32)
    x[0, 3], x[1, 39], x[1, 0] = np.nan, -np.inf, np.inf
    d = dequantize(quantize(x, "bf16"))   # nonfinite="propagate": only those elements, no block
    bad = ~np.isfinite(x)
    np.testing.assert_array_equal(np.isnan(d), np.isnan(x))
    assert d[1, 39] == -np.inf and d[1, 0] == np.inf
    np.testing.assert_array_equal(d[~bad], x[~bad].astype(BF16).astype(np.float32))
    with pytest.raises(ValueError, match=r"non-finite value nan at index \(0, 3\)"):
        quantize(x, "bf16", nonfinite="raise")
    with pytest.raises(TypeError, match="float64"):
        quantize(x.astype(np.float64), "bf16")


def test_bf16_dequantize_refuses_scales():
    q = quantize(np.ones((2, 32), np.float32), "bf16")
    with pytest.raises(ValueError, match=r"bf16 has no block scales, got scales of shape \(2, 1\)"):
        dequantize(q.__class__(q.data, np.zeros((2, 1), np.uint8), q.fmt))


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------
def test_fp4_packing_low_nibble_is_even_element():
    codes = np.array([[0x1, 0x2, 0xF, 0x8]], np.uint8)
    packed = pack_fp4(codes)
    np.testing.assert_array_equal(packed, [[0x21, 0x8F]])
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(np.zeros((1, 3), np.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(np.array([16, 0], np.uint8))


@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 8).map(lambda v: 2 * v)),
                  elements=st.integers(0, 15)))
def test_property_pack_unpack(codes):
    np.testing.assert_array_equal(unpack_fp4(pack_fp4(codes)), codes)


# ---------------------------------------------------------------------------------------------
# 128x4 scale layout and per-group padding
# ---------------------------------------------------------------------------------------------
def _naive_offset(r, c, cols):
    col_groups = (cols + 3) // 4
    return ((r // 128) * col_groups + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


@pytest.mark.parametrize("rows, cols", [(1, 1), (128, 4), (129, 5), (300, 7), (256, 448)])
def test_swizzle_matches_the_offset_formula_and_pads_with_zeros(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    s = rng.integers(1, 256, (rows, cols), dtype=np.uint8)
    sw = swizzle_scales(s)
    layout = ScaleLayout128x4(rows, cols)
    assert sw.shape == layout.shape and sw.size == layout.nbytes
    flat = sw.reshape(-1)
    seen = np.zeros(flat.size, bool)
    for r in range(rows):
        for c in range(cols):
            off = _naive_offset(r, c, cols)
            assert off == scale_offset(r, c, cols) == layout.offset(r, c)
            assert flat[off] == s[r, c]
            seen[off] = True
    assert np.all(flat[~seen] == 0)        # padding entries are zero
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    assert sw[r // 128, c // 4, r % 32, (r % 128) // 32, c % 4].tolist() == s.tolist()   # the 5-D index
    np.testing.assert_array_equal(unswizzle_scales(sw, rows, cols), s)


def test_swizzle_keeps_leading_expert_axis():
    s = np.random.default_rng(0).integers(0, 256, (3, 200, 9), dtype=np.uint8)
    sw = swizzle_scales(s)
    assert sw.shape == (3, 2, 3, 32, 4, 4)
    for e in range(3):
        np.testing.assert_array_equal(sw[e], swizzle_scales(s[e]))
    np.testing.assert_array_equal(unswizzle_scales(sw, 200, 9), s)


def test_swizzle_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        swizzle_scales(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        swizzle_scales(np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="32, 4, 4"):
        unswizzle_scales(np.zeros((1, 1, 32, 4, 3), np.uint8))


@pytest.mark.parametrize("counts", [[5, 0, 195, 130], [128, 128, 1], [0, 0, 3], [1], [300, 0, 0, 129, 127]])
def test_group_scale_offsets_and_padding(counts):
    a_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    aso = group_scale_offsets(a_offsets)
    bands = 0
    for g, n_g in enumerate(counts):   # the formula of formats.md, by hand
        assert aso[g] == bands - a_offsets[g] // 128
        bands += -(-n_g // 128)
    rows = padded_scale_rows(a_offsets, aso)
    starts = [128 * int(sum(-(-n // 128) for n in counts[:g])) for g in range(len(counts))]
    for g, n_g in enumerate(counts):
        np.testing.assert_array_equal(rows[a_offsets[g]:a_offsets[g + 1]], starts[g] + np.arange(n_g))
    total = int(a_offsets[-1])
    s = np.random.default_rng(1).integers(1, 256, (total, 6), dtype=np.uint8)
    a_scales, aso2 = pad_group_scales(s, a_offsets)
    np.testing.assert_array_equal(aso, aso2)
    assert a_scales.shape == (bands, 2, 32, 4, 4)
    np.testing.assert_array_equal(gather_group_scales(a_scales, a_offsets, aso, 6), s)
    linear = unswizzle_scales(a_scales)
    assert np.count_nonzero(linear) == s.size      # everything else is zero padding
