"""The 1D-1D problem (builder, generator, validation) and the exact reference."""
import dataclasses

import numpy as np
import pytest

from gbs.problem import (
    PROBLEM_FORMATS,
    build_problem,
    make_routing,
    random_problem,
)
from gbs.formats import BF16, dequantize, quantize
from gbs.reference import (
    MAX_REL_TOL,
    check_acceptance,
    is_poison,
    poison_output,
    reference_grouped_matmul,
    relative_errors,
)


def small_problem(fmt="nvfp4", seed=0, **kw):
    args = dict(n=72, k=128, num_experts=6, total_tokens=150, num_active_experts=4, routing="ragged",
                num_empty=1, num_skipped=1, seed=seed)
    args.update(kw)
    return random_problem(fmt, **args)


# ---------------------------------------------------------------------------------------------
# Routing and generator
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("routing", ["uniform", "ragged", "topk"])
def test_routing_is_reproducible_and_has_the_requested_slots(routing):
    tokens = 12 if routing == "topk" else 96    # top-k: 12 tokens x 2 experts leave experts to spare
    kw = dict(num_experts=32, total_tokens=tokens, num_active_experts=8, routing=routing, top_k=2,
              num_empty=2, num_skipped=3, seed=7)
    r1, r2 = make_routing(**kw), make_routing(**kw)
    np.testing.assert_array_equal(r1.group_sizes, r2.group_sizes)
    np.testing.assert_array_equal(r1.expert_ids, r2.expert_ids)
    assert np.sum(r1.expert_ids == -1) == 3
    live = r1.expert_ids[r1.expert_ids >= 0]
    assert len(set(live.tolist())) == live.size                     # distinct experts
    assert np.all(np.diff(live[r1.group_sizes[r1.expert_ids >= 0] > 0]) > 0)   # sorted, as a router emits
    assert np.all(r1.group_sizes[r1.expert_ids == -1] > 0)          # skipped slots still hold tokens
    live_tokens = r1.group_sizes[r1.expert_ids >= 0].sum()
    assert live_tokens == (tokens * 2 if routing == "topk" else tokens)
    if routing == "uniform":
        sizes = r1.group_sizes[r1.expert_ids >= 0]
        assert sorted(sizes[sizes > 0].tolist())[-1] - sorted(sizes[sizes > 0].tolist())[0] <= 1
    assert make_routing(**{**kw, "seed": 8}).group_sizes.tolist() != r1.group_sizes.tolist()


def test_routing_errors():
    with pytest.raises(ValueError, match="routing must be"):
        make_routing(num_experts=4, total_tokens=4, num_active_experts=2, routing="zipf")
    with pytest.raises(ValueError, match="num_active_experts"):
        make_routing(num_experts=4, total_tokens=4, num_active_experts=5)
    with pytest.raises(ValueError, match="unused experts"):
        make_routing(num_experts=4, total_tokens=4, num_active_experts=4, num_empty=1)
    with pytest.raises(ValueError, match="top_k"):
        make_routing(num_experts=4, total_tokens=4, routing="topk", top_k=5)


@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
def test_random_problem_fields(fmt):
    p = small_problem(fmt)
    assert p.format_name == fmt
    assert p.a_offsets[0] == 0 and p.a_offsets[-1] == p.total_tokens
    assert p.num_active_experts == len(p.expert_ids) == len(p.a_offsets) - 1
    assert p.estimated_total_m == p.total_tokens
    assert -1 in p.expert_ids and 0 in p.group_sizes
    if p.b_format.has_global_scale:   # NVFP4: two global decode scales; W4A16: the weights' alone (both small)
        assert np.all(p.expert_scales[p.expert_ids[p.expert_ids >= 0]] < 1e-3)
    else:
        np.testing.assert_array_equal(p.expert_scales, 1.0)
    p2 = small_problem(fmt)
    np.testing.assert_array_equal(p.a.view(np.uint8), p2.a.view(np.uint8))   # seeded


def test_build_problem_round_trips_scales_and_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 64)).astype(np.float32)
    w = rng.standard_normal((3, 40, 64)).astype(np.float32)
    p = build_problem(x, w, [4, 0, 6], [2, 0, -1], fmt="mxfp8")
    qa = quantize(x, "mxfp8")
    np.testing.assert_array_equal(dequantize(p.a_operand()), dequantize(qa))
    np.testing.assert_array_equal(dequantize(p.b_operand(2)), dequantize(quantize(w[2], "mxfp8")))
    assert p.active_slots() == [0]
    np.testing.assert_array_equal(p.written_rows(), [True] * 4 + [False] * 6)
    qw = quantize(w, "mxfp8")   # pre-quantized weights are accepted
    p2 = build_problem(x, qw, [4, 0, 6], [2, 0, -1], fmt="mxfp8")
    np.testing.assert_array_equal(p2.b.view(np.uint8), p.b.view(np.uint8))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(group_sizes=[4, 5]), ValueError, r"activations must be \(sum\(group_sizes\) = 9"),
    (dict(group_sizes=[-1, 11]), ValueError, "group_sizes must be >= 0"),
    (dict(expert_ids=[0]), ValueError, "expert_ids must be an integer array shaped like"),
    (dict(fmt="fp4"), ValueError, "unknown problem format"),
    (dict(weights=np.zeros((2, 8, 32), np.float32)), ValueError, "K = 64 but weights have K = 32"),
])
def test_build_problem_bad_input(kwargs, err, match):
    args = dict(activations=np.ones((10, 64), np.float32), weights=np.ones((2, 8, 64), np.float32),
                group_sizes=[4, 6], expert_ids=[0, 1], fmt="mxfp4")
    args.update(kwargs)
    with pytest.raises(err, match=match):
        build_problem(**args)


# ---------------------------------------------------------------------------------------------
# Validation: every field
# ---------------------------------------------------------------------------------------------
def _mutations(p):
    u32 = np.uint32
    yield "a dtype", dict(a=p.a.astype(np.int8)), TypeError, "a must have dtype uint8"
    yield "a shape", dict(a=p.a[:, :-1]), ValueError, "a must have shape"
    yield "b 2-D", dict(b=p.b[0]), ValueError, "b must be a 3-D"
    yield "b dtype", dict(b=p.b.view(np.int8)), TypeError, "b must have dtype uint8"
    bad = p.a_offsets.copy()
    bad[2] = bad[3] + 1
    yield "offsets not monotone", dict(a_offsets=bad), ValueError, "non-decreasing"
    bad = p.a_offsets.copy()
    bad[-1] += 1
    yield "offsets past the end", dict(a_offsets=bad), ValueError, r"a_offsets\[-1\]"
    bad = p.a_offsets.copy()
    bad[0] = 1
    yield "offsets[0] != 0", dict(a_offsets=bad), ValueError, r"a_offsets\[0\] must be 0"
    yield "offsets dtype", dict(a_offsets=p.a_offsets.astype(np.int64)), TypeError, "a_offsets must have dtype uint32"
    yield "offsets length", dict(a_offsets=p.a_offsets[:-1]), ValueError, "a_offsets must have shape"
    bad = p.a_scale_offsets.copy()
    bad[-1] += u32(1)
    yield "scale offsets", dict(a_scale_offsets=bad), ValueError, "a_scale_offsets"
    bad = p.expert_ids.copy()
    bad[0] = p.num_experts
    yield "expert id too large", dict(expert_ids=bad), ValueError, "out of range"
    bad = p.expert_ids.copy()
    bad[0] = -2
    yield "expert id -2", dict(expert_ids=bad), ValueError, "out of range"
    yield "expert ids dtype", dict(expert_ids=p.expert_ids.astype(np.int64)), TypeError, "expert_ids must have dtype int32"
    bad = p.expert_scales.copy()
    bad[0] = np.nan
    yield "expert scale NaN", dict(expert_scales=bad), ValueError, "expert_scales must be finite"
    yield "expert scales length", dict(expert_scales=p.expert_scales[:-1]), ValueError, "expert_scales must have shape"
    yield "a_scales shape", dict(a_scales=p.a_scales[:-1]), ValueError, "a_scales must have shape"
    yield "b_scales shape", dict(b_scales=p.b_scales[:-1]), ValueError, "b_scales must have shape"
    yield "K not multiple", dict(k=p.k + 8), ValueError, "not a multiple"
    yield "N mismatch", dict(n=p.n + 1), ValueError, "b must have shape"
    yield "num_active_experts", dict(num_active_experts=0), ValueError, "num_active_experts must be >= 1"
    yield "estimated_total_m < 0", dict(estimated_total_m=-1), ValueError, "estimated_total_m must be >= 0"
    yield "estimated_total_m float", dict(estimated_total_m=3.0), TypeError, "must be an integer"
    yield "formats", dict(a_format="nvfp4"), TypeError, "BlockFormat"


@pytest.mark.parametrize("case", list(range(23)))
def test_validation_rejects_every_bad_field(case):
    p = small_problem("nvfp4")
    name, change, err, match = list(_mutations(p))[case]
    with pytest.raises(err, match=match):
        dataclasses.replace(p, **change)


def test_validation_rejects_unsupported_format_pair():
    p = small_problem("mxfp4")
    from gbs.formats import get_format
    with pytest.raises(ValueError, match="unsupported operand pair"):
        dataclasses.replace(p, a_format=get_format("nvfp4"))


# ---------------------------------------------------------------------------------------------
# W4A16: bf16 tokens (no scales) x MXFP4 / NVFP4 weights
# ---------------------------------------------------------------------------------------------
W4A16_SIZES = [1, 0, 9, 4, 1, 6]         # 1-token groups, an empty group, a -1 slot
W4A16_IDS = [3, 1, 0, -1, 2, 4]


def w4a16_inputs(seed=0, n=40, k=96, experts=5):
    rng = np.random.default_rng(seed)
    activations = (rng.standard_normal((sum(W4A16_SIZES), k)) * 3).astype(np.float32)
    weights = (rng.standard_normal((experts, n, k)) * np.float32(0.05)).astype(np.float32)
    weights[2] *= np.float32(2.0 ** -12)   # an expert far below the others: its own NVFP4 global scale
    return activations, weights


@pytest.mark.parametrize("fmt, b_name", [("w4a16", "mxfp4"), ("w4a16_nvfp4", "nvfp4")])
def test_w4a16_problem_holds_bf16_tokens_without_scales(fmt, b_name):
    activations, weights = w4a16_inputs()
    p = build_problem(activations, weights, W4A16_SIZES, W4A16_IDS, fmt=fmt)
    assert p.format_name == fmt and (p.a_format.name, p.b_format.name) == ("bf16", b_name)
    assert p.a.dtype == BF16 and p.a.shape == (sum(W4A16_SIZES), 96)
    np.testing.assert_array_equal(p.a.view(np.uint16), activations.astype(BF16).view(np.uint16))
    bands = sum(-(-n // 128) for n in W4A16_SIZES)
    assert p.a_scales.shape == (bands, 0, 32, 4, 4) and p.a_scale_offsets.dtype == np.uint32
    np.testing.assert_array_equal(dequantize(p.a_operand()), activations.astype(BF16).astype(np.float32))
    assert p.with_a_layout("packed").a_layout == "packed"


def test_w4a16_nvfp4_expert_scales_are_the_weights_global_decode_scales():
    activations, weights = w4a16_inputs(seed=1)
    p = build_problem(activations, weights, W4A16_SIZES, W4A16_IDS, fmt="w4a16_nvfp4")
    qw = quantize(weights, "nvfp4")
    np.testing.assert_array_equal(p.expert_scales, qw.global_decode_scale)   # tokens have no global scale
    assert p.expert_scales[0] > 1000 * p.expert_scales[2]   # per expert: expert 2 is 2^-12 of the others
    both = build_problem(activations, weights, W4A16_SIZES, W4A16_IDS, fmt="nvfp4")   # NVFP4 tokens add theirs
    assert not np.allclose(both.expert_scales, p.expert_scales)
    np.testing.assert_array_equal(build_problem(activations, weights, W4A16_SIZES, W4A16_IDS,
                                                fmt="w4a16").expert_scales, 1.0)


@pytest.mark.parametrize("fmt, b_name", [("w4a16", "mxfp4"), ("w4a16_nvfp4", "nvfp4")])
def test_w4a16_reference_is_the_float64_product_of_bf16_tokens_and_decoded_weights(fmt, b_name):
    activations, weights = w4a16_inputs(seed=2)
    p = build_problem(activations, weights, W4A16_SIZES, W4A16_IDS, fmt=fmt)
    tokens = activations.astype(BF16).astype(np.float64)
    qw = quantize(weights, b_name)
    decoded = dequantize(qw, apply_global_scale=False).astype(np.float64)   # element x block scale, exact
    decode_scale = np.broadcast_to(qw.global_decode_scale, (weights.shape[0],)).astype(np.float64)
    ref = reference_grouped_matmul(p)
    offsets = np.concatenate([[0], np.cumsum(W4A16_SIZES)])
    for g, e in enumerate(W4A16_IDS):
        rows = slice(offsets[g], offsets[g + 1])
        if e < 0:
            assert np.all(is_poison(ref[rows]))
            continue
        want = (tokens[rows] @ decoded[e].T) * decode_scale[e]
        np.testing.assert_array_equal(ref[rows].view(np.uint16), want.astype(np.float32).astype(BF16).view(np.uint16))
    assert check_acceptance(p, ref).passed


def _w4a16_mutations(p):
    yield dict(a=p.a.view(np.uint16)), TypeError, "a must have dtype bfloat16, got uint16"
    yield dict(a=p.a.view(np.uint8)), TypeError, "a must have dtype bfloat16, got uint8"
    yield dict(a=p.a[:, :-2]), ValueError, r"a must have shape \(21, 96\)"
    bands = p.a_scales.shape[0]
    yield (dict(a_scales=np.zeros((bands, 1, 32, 4, 4), np.uint8)), ValueError,
           rf"a_scales must have shape \({bands}, 0, 32, 4, 4\), got \({bands}, 1, 32, 4, 4\)")
    yield dict(k=p.k + 16), ValueError, "K = 112 is not a multiple of the mxfp4 block size 32"
    yield dict(a_layout="e2m1_h200"), ValueError, "a_layout 'e2m1_h200' re-lays FP4 \\(E2M1\\) tokens; a is bf16"


@pytest.mark.parametrize("case", range(6))
def test_w4a16_validation_errors(case):
    p = build_problem(*w4a16_inputs(), W4A16_SIZES, W4A16_IDS, fmt="w4a16")
    change, err, match = list(_w4a16_mutations(p))[case]
    with pytest.raises(err, match=match):
        dataclasses.replace(p, **change)


def test_w4a16_tokens_take_no_h200_layout():
    p = build_problem(*w4a16_inputs(), W4A16_SIZES, W4A16_IDS, fmt="w4a16")
    for layout in ("e2m1_h200", "e2m1_h200_tiled", "e2m1_e4m3"):
        with pytest.raises(ValueError, match=f"a_layout '{layout}' re-lays FP4 \\(E2M1\\) tokens; a is bf16"):
            p.with_a_layout(layout)


# ---------------------------------------------------------------------------------------------
# Reference and acceptance
# ---------------------------------------------------------------------------------------------
def _naive_reference(p):
    """An independent, slow computation from formats.md's formula, element by element in float64."""
    from gbs.formats import decode_elements, decode_scales, unswizzle_scales
    from gbs.formats import padded_scale_rows
    out = np.full((p.total_tokens, p.n), np.nan)
    a_codes = p.a_operand().element_codes()
    a_val = decode_elements(a_codes, p.a_format.element).astype(np.float64)
    a_sc = decode_scales(unswizzle_scales(p.a_scales), p.a_format).astype(np.float64) if p.a_format.scaled else None
    rows = padded_scale_rows(p.a_offsets, p.a_scale_offsets)
    for g in range(p.num_active_experts):
        e = int(p.expert_ids[g])
        if e < 0:
            continue
        b_codes = p.b_operand(e).element_codes()
        b_val = decode_elements(b_codes, p.b_format.element).astype(np.float64)
        b_sc = decode_scales(unswizzle_scales(p.b_scales[e]), p.b_format).astype(np.float64)
        for m in range(int(p.a_offsets[g]), int(p.a_offsets[g + 1])):
            a_deq = a_val[m]   # bf16 tokens: as they are
            if p.a_format.scaled:
                a_deq = a_deq * np.repeat(a_sc[rows[m], :p.k // p.a_format.block_size], p.a_format.block_size)
            b_deq = b_val * np.repeat(b_sc[:p.n, :p.k // p.b_format.block_size], p.b_format.block_size, axis=1)
            out[m] = p.expert_scales[e] * (b_deq @ a_deq)
    return out


@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
def test_reference_matches_the_formula(fmt):
    p = small_problem(fmt, seed=3, total_tokens=40, n=24)
    ref = reference_grouped_matmul(p)
    naive = _naive_reference(p)
    written = p.written_rows()
    np.testing.assert_array_equal(ref[written], naive[written].astype(np.float32).astype(BF16))
    assert np.all(is_poison(ref[~written]))
    assert not np.all(is_poison(ref[written]))


def test_reference_leaves_skipped_rows_of_out_untouched_and_close_to_float():
    p = small_problem("mxfp8", seed=4)
    out = np.full((p.total_tokens, p.n), 3.0, np.float32).astype(BF16)
    ref = reference_grouped_matmul(p, out)
    assert ref is out
    assert np.all(out[~p.written_rows()].astype(np.float32) == 3.0)


def test_acceptance_metric_passes_the_reference_and_catches_errors():
    p = small_problem("nvfp4", seed=5)
    ref = reference_grouped_matmul(p)
    assert check_acceptance(p, ref.copy(), ref).passed
    assert check_acceptance(p, reference_grouped_matmul(p, accumulate=np.float32), ref).passed
    written = np.flatnonzero(p.written_rows())

    wrong = ref.copy()
    wrong[written[0]] = (ref[written[0]].astype(np.float32) * 1.05).astype(BF16)
    assert not check_acceptance(p, wrong, ref).passed                       # 5 % off in one row

    missing = ref.copy()
    missing[written[-1], 0] = poison_output(1, 1)[0, 0]
    res = check_acceptance(p, missing, ref)
    assert not res.passed and res.poisoned_written == 1

    clobbered = ref.copy()
    skipped = np.flatnonzero(~p.written_rows())
    clobbered[skipped[0]] = 0
    res = check_acceptance(p, clobbered, ref)
    assert not res.passed and res.clobbered_skipped == 1

    nan = ref.copy()
    nan[written[1], 1] = np.nan
    assert not check_acceptance(p, nan, ref).passed


def test_relative_errors():
    r = np.array([1.0, -2.0, 4.0])
    assert relative_errors(r, r) == (0.0, 0.0)
    max_rel, _ = relative_errors(r + np.array([0, 0, 0.02]), r)
    assert max_rel == pytest.approx(0.005)
    assert max_rel <= MAX_REL_TOL
    assert relative_errors(np.array([np.nan, 0, 0]), r)[0] == float("inf")


def test_random_problem_is_its_inputs_quantized_and_the_float_product_is_close():
    from gbs.problem import problem_from_inputs, random_inputs
    kw = dict(n=48, k=256, num_experts=6, total_tokens=20, num_active_experts=3, routing="ragged",
              num_empty=1, num_skipped=1, seed=9)
    inputs = random_inputs(**kw)
    p = problem_from_inputs(inputs, "mxfp8")
    same = random_problem("mxfp8", **kw)
    np.testing.assert_array_equal(p.b.view(np.uint8), same.b.view(np.uint8))
    np.testing.assert_array_equal(p.a.view(np.uint8), same.a.view(np.uint8))
    written = p.written_rows()
    exact = inputs.unquantized_product()
    _, rms_rel = relative_errors(reference_grouped_matmul(p)[written], exact[written])
    assert 0 < rms_rel < 0.06          # MXFP8's quantization error, nothing more
    assert np.all(exact[~written] == 0)
