"""The FP8 route's kernel (issue 31 item 3): the wgmma kernel's E4M3 consumer (``h200_wgmma._make_fp8_consumer``) on
MXFP4 x MXFP4 problems whose operands are in ``E2M1E4M3Order`` (``LAYOUT_E2M1_E4M3``).

CPU: the route's K order (the tokens' A registers and the weights' E4M3 buffer carry the same element at every K
position), the plan's rules and refusals (the streaming kernel, one operand re-laid, NVFP4, blocks outside the
window with the kernel's bases, counted by ``fp8_route.kernel_window_violations``), the build's SASS (E4M3 wgmma,
no local memory in the K loop).

GPU (the H200): against the exact reference, with the route's contract (``check_route``): bit-identical wherever the
tensor core sums every chunk exactly (``chunk_sum_bits_needed <= 14``, evidence: fp8-wgmma-precision) and the fp32
promotions are exact, every output within ``fp8_route_error_bound(chunk_error=HOPPER_CHUNK_ERROR)`` elsewhere,
skipped rows keep the poison, NaN blocks give NaN where the reference has it. Cases: ragged groups with an empty
group, a -1 slot and a 1-token group, N and K tails (gpt-oss K = 2880), DeepSeek's K = 7168, blocks at both ends of
the window, a block beyond it (NaN outputs, never silently dropped), NaN-scale blocks.
"""
from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np
import pytest

from gbs import fp8_route as fr
from gbs.exactness import FP64_UNIT, exact_values, gamma, round_to_bf16
from gbs.formats import pack_fp4, unswizzle_scales
from gbs.layouts import LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, E2M1E4M3Order
from gbs.numba_kernels import fp8_decode as fd
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_wgmma as hw
from gbs.numba_kernels import launch
from gbs.plan import plan_h200
from gbs.problem import build_problem
from gbs.reference import is_poison, reference_grouped_matmul

from gbs.ptx_inline import offline
from fp8_cases import gaussian_problem, w4a8_window_edges, window_edges, with_scales

ROUTE = LAYOUT_E2M1_E4M3
def on_route(problem):
    """MXFP4 weights (and MXFP4 tokens) in the route's layout; MXFP8 tokens (W4A8) stay as they are."""
    routed = problem.with_b_layout(ROUTE)
    return routed.with_a_layout(ROUTE) if problem.a_format.packed else routed


# ----------------------------------------------------------------------------------------------
# CPU: the K order, the plan, the build
# ----------------------------------------------------------------------------------------------
def test_the_tokens_registers_and_the_weights_buffer_carry_the_same_element_at_every_k():
    """Host emulation of both sides' placement for one row of one chunk: the weights' thread (row, pair) writes the
    decode of FP4 word s of block b to ``fp8_buffer_offset(row, s, high)`` + 4 b; quad lane q's A registers of step
    s hold the decode of word s of block q (registers 0 / 2: the low / high words). Position 4 q + i of step s (+16)
    then carries element ``fp8_k_of`` on both sides, a permutation of the chunk."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, 128, dtype=np.uint8)
    words = E2M1E4M3Order.swizzle(pack_fp4(codes)).view("<u4")        # 16 words: block b = words 4 b .. 4 b + 3
    t_lo, t_hi = fd.MAGNITUDE_TABLES[fd.fold_table_row(127, 127)]      # d = 6
    table = fr.e2m1_to_e4m3_table(6)
    for row in (0, 5, 13):
        buffer = np.zeros(hw.E4M3_ROW_BYTES, np.uint8)
        for block in range(4):
            for s in range(4):
                low, high = fd.decode_word(int(words[4 * block + s]), t_lo, t_hi)
                for part, word in ((0, low), (1, high)):
                    at = hw.fp8_buffer_offset(row, s, part) - row * hw.E4M3_ROW_BYTES + 4 * block
                    buffer[at:at + 4] = np.array([word], "<u4").view(np.uint8)
        for position in range(hw.FP8_CHUNK):
            s, rest = divmod(position, hw.WGMMA_K_E4M3)
            high, rest = divmod(rest, 16)
            chunk16 = (2 * s + high) ^ (row & hw.SW128_CHUNK_MASK)
            assert buffer[16 * chunk16 + rest] == table[codes[hw.fp8_k_of(position)]], (row, position)
    for position in range(hw.FP8_CHUNK):   # the A side: lane q = block, register word = word s of the block
        s, rest = divmod(position, hw.WGMMA_K_E4M3)
        high, rest = divmod(rest, 16)
        q, i = divmod(rest, 4)
        low, hi = fd.decode_word(int(words[4 * q + s]), t_lo, t_hi)
        byte = np.array([hi if high else low], "<u4").view(np.uint8)[i]
        assert byte == table[codes[hw.fp8_k_of(position)]]
    assert sorted(hw.fp8_k_of(p) for p in range(hw.FP8_CHUNK)) == list(range(hw.FP8_CHUNK))


def test_bf16_decode_of_the_route_layout_is_the_packed_decode():
    """``h200_decode.e2m1_e4m3_pair_bits`` of an ``E2M1E4M3Order`` word = ``e2m1_pair_bits`` of the packed word, for
    every register, on random words and on every code at every position."""
    from gbs.numba_kernels import h200_decode as hd

    rng = np.random.default_rng(5)
    words = rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32)
    every = np.array([int(c) << (4 * i) for c in range(16) for i in range(8)], np.uint32)
    words = np.concatenate([words, every])
    ordered = E2M1E4M3Order.swizzle(words.view(np.uint8)).view("<u4")
    for word, routed in zip(words.tolist(), ordered.tolist()):
        for j in range(4):
            assert hd.e2m1_e4m3_pair_bits(routed, j) == hd.e2m1_pair_bits(word, j), (hex(word), j)


def test_w4a8_factors_scale_buffer_order_and_spec():
    """W4A8's promotion factor is 2^(token exponent + tile base) in fp32 (subnormal, 0, +Inf at the ends) and NaN
    for a NaN token scale; the weights land in natural K order (16-byte chunk c of row r at c ^ (r % 8)); the spec
    takes MXFP8 tokens as quantized with the weights in the route's layout, nothing else."""
    as_float = lambda bits: float(np.array([bits], np.uint32).view(np.float32)[0])
    assert as_float(fd.token_factor_bits(127, 0)) == 1.0
    assert as_float(fd.token_factor_bits(130, -5)) == 2.0 ** -2
    assert as_float(fd.token_factor_bits(0, -20)) == 2.0 ** -147          # subnormal, exact
    assert as_float(fd.token_factor_bits(0, -30)) == 0.0
    assert np.isnan(as_float(fd.token_factor_bits(0xFF, 0)))
    assert [hw.fp8_natural_offset(9, c) for c in range(3)] == [9 * 128 + 16, 9 * 128, 9 * 128 + 48]
    hw.WgmmaSpec("mxfp8", "mxfp4", 128, 2, b_layout=ROUTE, fp8=True)
    with pytest.raises(ValueError, match="MXFP8 tokens as they are"):
        hw.WgmmaSpec("mxfp8", "mxfp8", 128, 2, fp8=True)
    with pytest.raises(ValueError, match="MXFP8 tokens as they are"):
        hw.WgmmaSpec("mxfp8", "mxfp4", 128, 2, fp8=True)   # weights not in the route's layout


def test_w4a8_factors_out_of_fp32_are_counted():
    """Tokens scaled 2^90 with weight bases near 2^40: 2^(e_token + base) passes 2^127 -> counted (the plan then
    takes the bf16 route); as quantized, none."""
    problem = gaussian_problem(128, 256, seed=4, group_sizes=(20,), expert_ids=(0,), experts=1, fmt="w4a8")
    assert fr.kernel_window_violations(problem) == dict(token_blocks=0, weight_blocks=0, factors=0)
    a = problem.a_operand().scales.copy()
    b = unswizzle_scales(problem.b_scales, problem.n, 8).copy()
    a[:] = 127 + 90
    b[:] = 127 + 50
    big = with_scales(problem, a_linear=a, b_linear=b)
    assert fr.kernel_window_violations(big)["factors"] > 0
    plan = plan_h200(on_route(big), fp8=True)   # 20 tokens: the bf16 route's own pick, the streaming kernel
    assert not getattr(plan.spec, "fp8", False) and "promotion factors leave fp32" in plan.explain()


def test_plan_runs_the_route_when_asked_and_the_bf16_route_otherwise():
    """``fp8=True`` plans the E4M3 consumer (128 x 128 tiles, the window checked on the host); without it the same
    operands take ``"auto"``'s bf16 route (the bf16 consumers read ``E2M1E4M3Order`` too: the route is not faster,
    evidence fp8-route-gpu); what the route cannot take is refused."""
    problem = gaussian_problem(320, 2880, seed=1)
    plan = plan_h200(on_route(problem), fp8=True)
    assert plan.kernel == "h200_wgmma" and plan.spec.fp8
    assert (plan.spec.mma_bn, plan.spec.tile_tokens, plan.spec.ab_swapped) == (hw.FP8_MMA_BN, 128, False)
    names = [r.name for r in plan.rules]
    assert {"route", "window", "K tail"} <= set(names)
    assert "evidence fp8-route-gpu" in plan.explain() and "FP8 route" in plan.describe()
    auto = plan_h200(on_route(problem))
    assert not auto.spec.fp8 and auto.ring.weight_side.layout == ROUTE
    assert plan_h200(on_route(problem), backend="h200_stream").kernel == "h200_stream"
    with pytest.raises(ValueError, match="backend 'auto' or 'h200_wgmma'"):
        plan_h200(on_route(problem), backend="h200_stream", fp8=True)
    with pytest.raises(ValueError, match="reads MXFP4 weights in"):
        plan_h200(problem.with_a_layout(LAYOUT_E2M1_H200).with_b_layout(ROUTE), fp8=True)
    with pytest.raises(ValueError, match="both operands"):
        hw.WgmmaSpec("mxfp4", "mxfp4", 128, 2, a_layout=LAYOUT_E2M1_H200, b_layout=ROUTE, fp8=True)
    with pytest.raises(ValueError, match="128-token x"):
        hw.WgmmaSpec("mxfp4", "mxfp4", 256, 2, a_layout=ROUTE, b_layout=ROUTE, fp8=True)
    nv = build_problem(np.ones((4, 256), np.float32), np.ones((1, 128, 256), np.float32), [4], [0], fmt="nvfp4")
    with pytest.raises(ValueError, match="ue8m0"):
        nv.with_b_layout(ROUTE)


def test_blocks_outside_the_kernels_window_are_counted_and_refused():
    """A weight block 15 binades below its 128-row tile's largest in that chunk (d = -9) is out of the kernel's
    window (its base is the tile's, not the row's); 14 below (d = -8) is in. Tokens: per row. Zero blocks never
    count."""
    problem = gaussian_problem(256, 512, seed=2, group_sizes=(40, 90), expert_ids=(0, 1), experts=2)
    assert fr.kernel_window_violations(problem) == dict(token_blocks=0, weight_blocks=0, factors=0)
    b = unswizzle_scales(problem.b_scales, problem.n, 16).copy()
    top = b[1, :128, 4:8].max()
    b[1, 0, 4:8] = top                    # row 0 sets the tile's top in chunk 1
    b[1, 7, 5] = top - 14                 # d = -8: in the window
    assert fr.kernel_window_violations(with_scales(problem, b_linear=b))["weight_blocks"] == 0
    b[1, 9, 6] = top - 15                 # d = -9: out
    bad = with_scales(problem, b_linear=b)
    assert fr.kernel_window_violations(bad) == dict(token_blocks=0, weight_blocks=1, factors=0)
    fallback = plan_h200(on_route(bad), fp8=True)   # the exact path: the bf16 consumer on the same operands
    assert not fallback.spec.fp8 and "0 token and 1 weight blocks" in fallback.explain()
    a = problem.a_operand().scales.copy()
    a[3, 0], a[3, 1] = 140, 140 - 15
    assert fr.kernel_window_violations(with_scales(problem, a_linear=a))["token_blocks"] == 1


def test_route_build_issues_e4m3_wgmma_without_local_memory_in_the_k_loop():
    """Offline (ptxas, sm_90a): 8 QGMMA (two chunks of 4 k32 steps per slice, unrolled), the first of each chunk
    starting a fresh accumulator, and no local memory from the first to the last."""
    spec = hw.WgmmaSpec("mxfp4", "mxfp4", 128, 4, a_layout=ROUTE, b_layout=ROUTE, fp8=True)
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    instructions = offline.sass_instructions(offline.disassemble(cubin))
    qgmma = [i for i, ins in enumerate(instructions) if ins.startswith("QGMMA.64x128x32.F32.E4M3.E4M3")]
    assert len(qgmma) == 8
    assert not [ins for ins in instructions[qgmma[0]:qgmma[-1]] if re.match(r"(LDL|STL)\b", ins)]
    assert not any(ins.startswith("HGMMA") for ins in instructions)


@pytest.mark.parametrize("tokens", ["mxfp4", "mxfp8"])
def test_route_build_pipelines_its_mmas(tokens):
    """No wait for 0 groups between MMAs that accumulate (``offline.serialized_wgmma``): MXFP4 tokens decoded into
    register A fragments; W4A8's MXFP8 tokens from the ring stage."""
    spec = hw.WgmmaSpec(tokens, "mxfp4", 128, 4, a_layout=ROUTE if tokens == "mxfp4" else "packed", b_layout=ROUTE,
                        fp8=True)
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    assert not offline.serialized_wgmma(offline.sass_instructions(offline.disassemble(cubin)))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
def _token_steps(a, chunk):
    """MXFP8 tokens as the route multiplies them (E4M3 bytes as quantized) for ``chunk_sum_bits_needed``."""
    rows, k = a.data.shape
    return fr.FoldedOperand(e4m3=np.ascontiguousarray(a.data).view(np.uint8), bases=np.zeros((rows, 1), np.int32),
                            shifts=np.zeros((rows, k // 32), np.int32), in_window=np.ones((rows, k // 32), bool),
                            source=a, chunk=chunk)


def route_chunk(problem) -> int:
    """K per promotion: 128 (MXFP4 tokens), 32 (MXFP8 tokens: their scales change every k32 step)."""
    return fr.PROMOTION_CHUNK if problem.a_format.packed else fr.MX_BLOCK


def chunk_exact(problem) -> np.ndarray:
    """(T, N) bool: every promoted sum of the output (a 128-K chunk, or a k32 step for W4A8) needs at most
    ``HOPPER_E4M3_SUM_BITS`` significant bits (the kernel's bases; the count does not depend on them)."""
    exact = np.zeros((problem.total_tokens, problem.n), bool)
    a = problem.a_operand()
    chunk = route_chunk(problem)
    for g in problem.active_slots():
        lo, hi = int(problem.a_offsets[g]), int(problem.a_offsets[g + 1])
        rows = type(a)(a.data[lo:hi], a.scales[lo:hi], a.fmt)
        fa = fr.fold_operand(rows, base_over="finite") if a.fmt.packed else _token_steps(rows, chunk)
        fb = fr.fold_operand(problem.b_operand(int(problem.expert_ids[g])), base_over="finite",
                             base_rows=fr.KERNEL_WEIGHT_BASE_ROWS)
        fb = dataclasses.replace(fb, chunk=chunk)
        exact[lo:hi] = (fr.chunk_sum_bits_needed(fa, fb) <= fr.HOPPER_E4M3_SUM_BITS).all(axis=2)
    return exact


def check_route(problem, out) -> dict:
    """The route's contract (module docstring); returns the counts, raises AssertionError on a breach."""
    written = problem.written_rows()
    assert np.all(is_poison(out[~written])), "rows of skipped slots were written"
    rows = np.flatnonzero(written)
    exact, magnitude, exact_sum = exact_values(problem)
    ref = reference_grouped_matmul(problem)
    o, r = out[rows].astype(np.float64), ref[rows].astype(np.float64)
    e, t = exact[rows], magnitude[rows]
    nan = np.isnan(r)
    np.testing.assert_array_equal(np.isnan(o), nan, err_msg="NaN where the reference has none, or none where it has")
    scale = float(np.max(np.abs(problem.expert_scales)))
    chunk = route_chunk(problem)
    chunk_error = fr.HOPPER_CHUNK_ERROR * chunk / fr.PROMOTION_CHUNK   # 33 x 2^-13 per k32 instruction
    bound = ((fr.fp8_route_error_bound(problem.k, chunk, chunk_error) + 2 * gamma(problem.k + 1, FP64_UNIT)) * t
             + fr.fp8_route_absolute_slack(problem.k, chunk, expert_scale=scale))
    with np.errstate(invalid="ignore"):
        inside = ((o >= round_to_bf16(e - bound)) & (o <= round_to_bf16(e + bound))) | nan
    assert inside.all(), f"{int((~inside).sum())} outputs outside the route's bound"
    must = (exact_sum & chunk_exact(problem))[rows] & ~nan
    identical = out.view(np.uint16)[rows] == ref.view(np.uint16)[rows]
    assert np.all(identical[must]), f"{int((must & ~identical).sum())} outputs with exact sums differ in bits"
    return dict(elements=int(o.size), bit_identical=int(identical.sum()), asserted=int(must.sum()),
                max_rel=float(np.nanmax(np.abs(o - e) / np.maximum(t, 1e-300))))


def _run(problem, plan=None):
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    routed = on_route(problem)
    return hl.run(routed, plan or plan_h200(routed, fp8=True), None)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(320, 2880), (256, 7168), (128, 256)])
def test_gpu_route_matches_the_reference_on_ragged_groups_and_tails(n, k):
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"route/{n}/{k}".encode()))
    counts = check_route(problem, _run(problem))
    assert counts["asserted"] > 0.5 * counts["elements"], counts   # Gaussian data: mostly exact chunk sums
    print(counts)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(320, 2880), (256, 7168)])
def test_gpu_w4a8_route_matches_the_reference_on_ragged_groups_and_tails(n, k):
    """W4A8: MXFP8 tokens straight from the ring as wgmma A, MXFP4 weights folded, a promotion per k32 step."""
    problem = gaussian_problem(n, k, seed=zlib.crc32(f"w4a8/{n}/{k}".encode()), fmt="w4a8")
    counts = check_route(problem, _run(problem))   # Gaussian E4M3 tokens: few sums exact in fp32 (the bound holds)
    print(counts)


@pytest.mark.gpu
def test_gpu_w4a8_route_nan_token_blocks_and_weight_window_edges():
    """A NaN-scale token block (its row NaN), a NaN token element, weight blocks at d = 6 and d = -8 of their tile."""
    edge = w4a8_window_edges(seed=11)
    assert fr.kernel_window_violations(edge) == dict(token_blocks=0, weight_blocks=0, factors=0)
    print(check_route(edge, _run(edge)))


@pytest.mark.gpu
def test_gpu_route_blocks_at_both_ends_of_the_window_and_nan_blocks():
    """Per chunk, a token row and a weight tile with blocks at d = 6 (the chunk's largest) and d = -8 (14 below):
    exact. A NaN-scale token block and a NaN-scale weight block: NaN rows / columns, as the reference."""
    edge = window_edges(seed=7)
    assert fr.kernel_window_violations(edge) == dict(token_blocks=0, weight_blocks=0, factors=0)
    counts = check_route(edge, _run(edge))
    print(counts)


@pytest.mark.gpu
def test_gpu_route_makes_a_block_beyond_the_window_nan_never_drops_it():
    """A live weight block 15 binades below its tile's top (d = -9), run with the plan of its in-window twin (the
    host check refuses it): the outputs of that weight row are NaN for every token of the expert, the rest exact."""
    problem = gaussian_problem(256, 512, seed=9, group_sizes=(50, 60), expert_ids=(0, 1), experts=2)
    b = unswizzle_scales(problem.b_scales, problem.n, 16).copy()
    b[1, :128, 4:8] = 126
    b[1, 0, 4:8] = 140
    twin = with_scales(problem, b_linear=b.copy())
    b[1, 9, 6] = 140 - 15
    bad = with_scales(problem, b_linear=b)
    plan = plan_h200(on_route(twin), fp8=True)
    assert plan.spec.fp8
    out = _run(bad, plan)
    assert np.isnan(out[50:110, 9].astype(np.float32)).all()
    keep = np.ones(bad.n, bool)
    keep[9] = False
    assert not np.isnan(out[:, keep].astype(np.float32)).any()


@pytest.mark.gpu
def test_gpu_route_falls_back_to_the_exact_bf16_route_for_blocks_beyond_the_window():
    """The same problem as above, planned with ``fp8=True`` itself: the plan takes the bf16 consumer on the same
    operands, and every output meets the bf16 route's contract (no NaN)."""
    from gbs.exactness import check_output

    problem = gaussian_problem(256, 512, seed=9, group_sizes=(50, 60), expert_ids=(0, 1), experts=2)
    b = unswizzle_scales(problem.b_scales, problem.n, 16).copy()
    b[1, :128, 4:8] = 126
    b[1, 0, 4:8] = 140
    b[1, 9, 6] = 140 - 15
    bad = with_scales(problem, b_linear=b)
    plan = plan_h200(on_route(bad), fp8=True)
    assert not plan.spec.fp8
    out = _run(bad, plan)
    result = check_output(bad, out, "h200_wgmma")
    assert result.passed, result.summary()


ROUTE_LAYOUT_BUILDS = {   # the bf16 consumers on E2M1E4M3Order operands: (backend, plan constraints)
    "stream_swapped_bn8": ("h200_stream", dict(ab_swapped=True, mma_bn=8, cta_group=1)),
    "stream_bn128": ("h200_stream", dict(ab_swapped=False, mma_bn=128, cta_group=1)),
    "wgmma_bn128_256_tokens": ("h200_wgmma", dict(mma_bn=128, tile_tokens=256)),
    "wgmma_swapped_bn32": ("h200_wgmma", dict(mma_bn=32, ab_swapped=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("build", list(ROUTE_LAYOUT_BUILDS))
def test_gpu_bf16_consumers_read_the_route_layout_bit_identically(build):
    """The streaming and wgmma kernels' bf16 decode of ``E2M1E4M3Order`` words (``h200_decode.e2m1_e4m3_pair_bits``)
    gives the packed operands' bits, tails and ragged groups included."""
    backend, knobs = ROUTE_LAYOUT_BUILDS[build]
    problem = gaussian_problem(320, 2880, seed=zlib.crc32(build.encode()))
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    # whole K (k_splits=1): split-K runs add their partials with atomics, in no fixed order
    packed = hl.run(problem, plan_h200(problem, backend=backend, k_splits=1, **knobs), None)
    routed = on_route(problem)
    out = hl.run(routed, plan_h200(routed, backend=backend, k_splits=1, **knobs), None)
    np.testing.assert_array_equal(out.view(np.uint16), packed.view(np.uint16))
