"""W4A16 on the H200 (issue 31 item 2): bf16 tokens x MXFP4 / NVFP4 weights on the wgmma kernel's bf16-token consumer
(``h200_wgmma._make_bf16_tokens_consumer``).

CPU: the weights' natural K order (every element of a decoded FP4 word lands where wgmma's K-major B operand reads
element k, the same order the tokens' TMA boxes have), the threads' weight lanes (each row and half once,
bank-conflict-free 16-byte accesses), the NVFP4 scale selectors, the ring's two token boxes per slice and no token
scale atoms, the plan's rules and refusals, the build's SASS (HGMMA with both operands in shared memory, no local
memory in the K loop).

GPU (the H200): against the exact reference with ``gbs.exactness`` (bf16 tokens times exactly decoded weights are
exact in fp32: bit-identical wherever the accumulation is exact in any order): ragged groups with an empty group, a
-1 slot and a 1-token group, N not a multiple of the tile, K tails (gpt-oss K = 2880), the H200 weight layouts, NaN
and Inf tokens, every tile the plan may pick.
"""
from __future__ import annotations

import dataclasses
import math
import re
import zlib

import numpy as np
import pytest

from gbs.dispatch import AUTO_STAGES, H200_SMEM_PER_SM
from gbs.formats import BF16, SF_ATOM_COLS, get_format
from gbs.lab.cases import synthetic_problem
from gbs.layouts import LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_FUSED, LAYOUT_E2M1_H200_TILED, LAYOUT_PACKED
from gbs.numba_kernels import h200_decode as hd
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_wgmma as hw
from gbs.numba_kernels import launch
from gbs.plan import plan_h200
from gbs.problem import PROBLEM_FORMATS, build_problem
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import offline
from gbs.ptx_inline.arith import prmt_b32_host
from gbs.reference import reference_grouped_matmul
from h200_knobs import Stream, Wgmma, check_kernel, run

W4A16 = ("w4a16", "w4a16_nvfp4")
TILES = ((128, 128), (256, 128), (128, 256))   # (mma_bn, tile_tokens)


def spec_of(fmt: str, mma_bn: int = 128, tile_tokens: int = 128, stages: int = 2,
            b_layout: str = LAYOUT_PACKED) -> hw.WgmmaSpec:
    a, b = PROBLEM_FORMATS[fmt]
    return hw.WgmmaSpec(a, b, mma_bn, stages, tile_tokens=tile_tokens, b_layout=b_layout)


# ----------------------------------------------------------------------------------------------
# The weights' natural K order and the threads' lanes
# ----------------------------------------------------------------------------------------------
def test_natural_pairs_put_a_word_s_elements_in_k_order():
    """Each FP4 decoder (packed and the H200 orders) gives registers of pairs (j, j + 4); ``natural_pairs`` makes
    them (0, 1), (2, 3), (4, 5), (6, 7): the low bf16 of register i is element 2 i, the high one 2 i + 1."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    natural = hw.natural_pairs_of(prmt_b32_host)
    for decode in (hd.e2m1_pair_bits, hd.e2m1_h200_pair_bits):
        pairs = [np.asarray(decode(words, j), np.uint32) for j in range(4)]
        element = [pairs[e % 4] & 0xFFFF if e < 4 else pairs[e - 4] >> 16 for e in range(8)]
        regs = natural(*pairs)
        for i in range(4):
            assert np.array_equal(np.asarray(regs[i]) & 0xFFFF, element[2 * i])
            assert np.array_equal(np.asarray(regs[i]) >> 16, element[2 * i + 1])


@pytest.mark.parametrize("mma_bn", hw.WGMMA_MMA_BN)
def test_weight_chunks_are_where_wgmma_reads_natural_k(mma_bn):
    """Word w of a thread's half h holds K 32 h + 8 w .. + 7 of the sub-step; its chunk is where the canonical
    K-major 128B-swizzle layout keeps those bytes (the tokens' TMA boxes have that layout)."""
    for row in range(mma_bn):
        for half in range(2):
            for w in range(4):
                k = 32 * half + 8 * w
                assert hw.b_buffer_offset(mma_bn, row, 2 * half + w // 2, w % 2) == hp.kmajor_sw128_offset(row, 2 * k)


def test_weight_lanes_cover_each_row_and_half_once_without_bank_conflicts():
    """The 256 consumer threads cover the 128 rows x 2 halves once; the 8 lanes of each 16-byte access phase read
    their raw quarters (64-byte rows, 64B swizzle) and write their B chunks (128B swizzle) in 8 distinct 16-byte
    bank groups, in both sub-steps and for every word."""
    lanes = [hw.bf16_tokens_weight_lane(t) for t in range(hw.CONSUMER_THREADS)]
    assert sorted(lanes) == [(r, h) for r in range(128) for h in range(2)]
    for warp in range(hw.CONSUMER_THREADS // 32):
        for phase in range(4):
            group = lanes[32 * warp + 8 * phase: 32 * warp + 8 * phase + 8]
            for u in range(2):
                raw = {(64 * r + ((16 * (2 * u + h)) ^ hd.swizzle_xor(r, 64, 3))) % 128 // 16 for r, h in group}
                assert len(raw) == 8
            for w in range(4):
                chunks = {hw.b_buffer_offset(128, r, 2 * h + w // 2, w % 2) % 128 // 16 for r, h in group}
                assert len(chunks) == 8


def test_nvfp4_lane_blocks_are_the_bytes_its_reader_shifts_down():
    """NVFP4 weights in a 128-K slice: quarter q holds blocks 2 q and 2 q + 1, bytes 2 (q % 2) and + 1 of the scale
    word at column ``scale_word_column``; the side reader shifts that word by 16 (q % 2) bits, so they are bytes 0
    and 1, which the selectors of groups 0, 1 and 2, 3 pick (the same selectors as 4 blocks per lane)."""
    per_thread = 128 // hd.QUAD // get_format("nvfp4").block_size
    assert per_thread == 2
    for q in range(hd.QUAD):
        column = hd.scale_word_column(q, per_thread)
        for b in range(per_thread):
            byte = q * per_thread + b - column
            assert 0 <= byte < SF_ATOM_COLS and byte == hd.scale_byte_index(q, per_thread, b)
            assert byte - 2 * (q % 2) == b


def test_bf16_token_pairs_are_the_fp4_pairing():
    """The streaming kernel's copy of bf16 tokens into B fragments pairs elements (j, j + 4) as the FP4 decode does."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2 ** 32, (4, 512), dtype=np.uint64).astype(np.uint32)
    element = [words[e // 2] & 0xFFFF if e % 2 == 0 else words[e // 2] >> 16 for e in range(8)]
    regs = hd.bf16_stride4_pairs_of(prmt_b32_host)(*words)
    for j in range(4):
        assert np.array_equal(np.asarray(regs[j]) & 0xFFFF, element[j])
        assert np.array_equal(np.asarray(regs[j]) >> 16, element[j + 4])


# ----------------------------------------------------------------------------------------------
# The ring, the spec, the plan
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", W4A16)
@pytest.mark.parametrize("mma_bn, tile_tokens", TILES)
def test_ring_stages_two_token_boxes_per_slice_and_no_token_scales(fmt, mma_bn, tile_tokens):
    spec = spec_of(fmt, mma_bn, tile_tokens).ring
    tokens = spec.token_side
    assert (tokens.row_bytes, tokens.box_bytes, tokens.boxes, tokens.scale_bytes) == (256, 128, 2, 0)
    assert spec.token_box == (128, tile_tokens) and spec.token_region_bytes == tile_tokens * 128
    loads = hr.stage_loads(spec)
    assert not [x for x in loads if x[0] == "token scales"]
    boxes = [x for x in loads if x[0] == "tokens"]
    assert [off for _, off, _, _ in boxes] == [spec.smem.m_data, spec.smem.m_data + spec.token_region_bytes]
    assert all(off % 1024 == 0 for _, off, _, _ in boxes), "wgmma operands: 1024-byte aligned"
    assert sum(size for _, _, size, _ in loads) == spec.tx_bytes
    spans = sorted((off, off + size) for _, off, size, _ in loads)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "boxes do not overlap"
    # the weights' scale band is the weights' own (NVFP4: 2 atoms per 128-K slice), not the tokens' (none)
    assert spec.scale_band_bytes == (2 if fmt == "w4a16_nvfp4" else 1) * 512


def test_tensor_maps_read_two_boxes_and_stand_in_for_the_token_scales():
    problem = synthetic_problem("w4a16", n=384, k=2880, group_sizes=[3, 200], expert_ids=[0, 1], num_experts=2)
    spec = spec_of("w4a16")
    shapes = {"a": problem.a.view(np.uint8).shape, "b": problem.b.shape, "a_scales": problem.a_scales.shape,
              "b_scales": problem.b_scales.shape}
    maps = hl.tensor_map_args(spec.ring, shapes, {"a": 1 << 20, "b": 2 << 20, "a_scales": 3 << 20, "b_scales": 4 << 20})
    tokens, _, token_scales, weight_scales = maps
    assert (tokens.dims, tokens.box, tokens.swizzle) == ((2 * 2880, 203), (128, 128), "128B")
    assert token_scales.global_address == weight_scales.global_address == 4 << 20
    for m in maps:
        m.check()


def test_spec_and_plan_refuse_what_the_consumers_cannot_run():
    with pytest.raises(ValueError, match="ab_swapped and fp8 must be False"):
        hw.WgmmaSpec("bf16", "mxfp4", 32, 2, ab_swapped=True)
    with pytest.raises(ValueError, match="swapped small-N tiles only"):
        hr.StreamSpec("bf16", "mxfp4", False, 128, 1, 2)
    with pytest.raises(ValueError, match="swapped small-N tiles only"):
        hr.StreamSpec("bf16", "mxfp4", True, 64, 1, 2)
    assert hr.StreamSpec("bf16", "mxfp4", True, 8, 1, 2).predecoded_tokens
    problem = synthetic_problem("w4a16", n=256, k=512, group_sizes=[4, 60], expert_ids=[0, 1], num_experts=2)
    with pytest.raises(ValueError, match="swapped small-N tiles only"):
        plan_h200(problem, backend="h200_stream", ab_swapped=False, mma_bn=128, cta_group=1)
    with pytest.raises(ValueError, match="FP8 route"):
        plan_h200(problem, fp8=True)
    with pytest.raises(ValueError, match="needs at least 2"):   # one stage would wait on itself
        plan_h200(problem, backend="h200_wgmma", mma_bn=128, stages=1)
    assert plan_h200(problem, backend="h200_wgmma", mma_bn=128, stages=2).spec.stages == 2


@pytest.mark.parametrize("fmt", W4A16)
@pytest.mark.parametrize("tokens, kernel", [(1, "h200_stream"), (8, "h200_stream"), (32, "h200_stream"),
                                            (33, "h200_wgmma"), (1024, "h200_wgmma")])
def test_auto_runs_bf16_tokens_on_the_two_tiles_that_read_them(fmt, tokens, kernel):
    """Up to 32 tokens per expert the streaming kernel's swapped small-N tiles, above the wgmma kernel's not-swapped
    ones; the plan says the SM100 decision it started from is W4A8's."""
    problem = synthetic_problem(fmt, n=512, k=1024, group_sizes=[tokens] * 4, expert_ids=[0, 1, 2, 3], num_experts=4)
    plan = plan_h200(problem)
    assert plan.kernel == kernel
    if kernel == "h200_wgmma":
        assert plan.spec.bf16_tokens and not plan.spec.ab_swapped
    else:
        assert plan.spec.ab_swapped and plan.spec.predecoded_tokens
    text = plan.explain()
    assert "no bf16-token row" in text and "W4A8" in text


def test_k_tail_plans_a_partial_last_slice():
    problem = synthetic_problem("w4a16", n=256, k=2880, group_sizes=[9], expert_ids=[0], num_experts=1)
    plan = plan_h200(problem)
    # the streaming kernel's decoded-token tiles: 256-K slices of FP4 weights, 4 token boxes (11 slices + 64)
    assert plan.spec.k_slice == 256 and plan.spec.token_side.boxes == 4 and hl.k_slices_of(2880, 256) == 12


# ----------------------------------------------------------------------------------------------
# SASS (offline, sm_90a)
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
@pytest.mark.parametrize("fmt, mma_bn, tile_tokens", [("w4a16", 128, 128), ("w4a16_nvfp4", 256, 128),
                                                      ("w4a16", 128, 256)])
def test_sass_issues_shared_memory_hgmma_without_local_memory_in_the_k_loop(fmt, mma_bn, tile_tokens):
    spec = spec_of(fmt, mma_bn, tile_tokens, b_layout=LAYOUT_E2M1_H200_FUSED)
    cubin = offline.compile_cubin(hw.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    instructions = offline.sass_instructions(offline.disassemble(cubin))
    hgmma = [i for i, ins in enumerate(instructions) if ins.startswith(f"HGMMA.64x{mma_bn}x16.F32.BF16")]
    assert len(hgmma) >= 2 * 4 * spec.m_tiles, "both sub-steps' MMAs"
    assert all("gdesc" in instructions[i] for i in hgmma), "A from shared memory (a descriptor, no registers)"
    assert not offline.serialized_wgmma(instructions)
    local = [i for i, ins in enumerate(instructions) if re.match(r"(LDL|STL)\b", ins)]
    assert not [i for i in local if hgmma[0] <= i <= hgmma[-1]], "no local memory in the K loop"


@pytest.mark.slow   # offline compiles: > 10 s on a 2-core CPU
@pytest.mark.parametrize("fmt, mma_bn, warps", [("w4a16", 8, 4), ("w4a16_nvfp4", 32, 8)])
def test_streaming_sass_copies_tokens_with_16_byte_accesses_and_no_local_memory(fmt, mma_bn, warps):
    """The streaming kernel's W4A16 build: HMMA, the token copy's 16-byte shared loads and stores, PRMT pairing, no
    local memory anywhere (as the block-scaled small-N builds)."""
    from gbs.numba_kernels import h200_stream as hs

    a, b = PROBLEM_FORMATS[fmt]
    spec = hr.StreamSpec(a, b, True, mma_bn, 1, 2, b_layout=LAYOUT_E2M1_H200_FUSED, small_n_warps=warps)
    cubin = offline.compile_cubin(hs.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A,
                                  launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    instructions = offline.sass_instructions(offline.disassemble(cubin))
    assert any(ins.startswith("HMMA.16816.F32.BF16") for ins in instructions)
    assert any(ins.startswith("LDS.128") for ins in instructions)
    assert any(ins.startswith("STS.128") for ins in instructions)
    assert any(ins.startswith("PRMT") for ins in instructions)
    assert not [ins for ins in instructions if re.match(r"(LDL|STL)\b", ins)]


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
GROUP_SIZES = (5, 0, 1, 37, 3, 70, 129, 300)   # empty group, -1 slot, 1 token, > 256, not tile multiples
EXPERT_IDS = (0, 4, 1, -1, 2, 5, 3, 6)


def gpu_problem(fmt: str, n: int, k: int, seed_tag: str):
    """Gaussian bf16 tokens and quantized Gaussian weights on the ragged routing; skips without an sm_90 GPU."""
    if launch.gpu_compute_capability() != hr.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    rng = np.random.default_rng(zlib.crc32(seed_tag.encode()))
    tokens = rng.standard_normal((sum(GROUP_SIZES), k)).astype(np.float32)
    weights = (rng.standard_normal((8, n, k)) * 0.05).astype(np.float32)
    return build_problem(tokens, weights, list(GROUP_SIZES), list(EXPERT_IDS), fmt=fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", W4A16)
@pytest.mark.parametrize("mma_bn, tile_tokens", TILES)
@pytest.mark.parametrize("layout", [LAYOUT_PACKED, LAYOUT_E2M1_H200_FUSED])
def test_gpu_matches_the_reference(fmt, mma_bn, tile_tokens, layout):
    problem = gpu_problem(fmt, 1024 + 64, 2048, f"w4a16/{fmt}").with_b_layout(layout)
    out = run(problem, Wgmma(mma_bn, AUTO_STAGES, tile_tokens=tile_tokens))
    result = check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma")
    assert result.passed, result


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", W4A16)
@pytest.mark.parametrize("mma_bn, warps", [(8, 4), (16, 8), (32, 4), (32, 8)])
@pytest.mark.parametrize("layout", [LAYOUT_PACKED, LAYOUT_E2M1_H200_FUSED])
def test_gpu_streaming_small_n_tiles_match_the_reference(fmt, mma_bn, warps, layout):
    """The streaming kernel's swapped small-N tiles (each stage's bf16 tokens copied once into B fragments), on the
    ragged routing (groups wider than the tile take several), N not a tile multiple, gpt-oss's K = 2880 tail."""
    problem = gpu_problem(fmt, 512 + 64, 2880, f"w4a16-stream/{fmt}/{mma_bn}").with_b_layout(layout)
    out = run(problem, Stream(True, mma_bn, 1, small_n_warps=warps))
    result = check_kernel(problem, out, reference_grouped_matmul(problem), "h200_stream")
    assert result.passed, result


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", W4A16)
@pytest.mark.parametrize("layout", [LAYOUT_E2M1_H200, LAYOUT_E2M1_H200_TILED])
def test_gpu_gpt_oss_k_tail_and_h200_layouts(fmt, layout):
    """gpt-oss K = 2880 (22.5 slices: the last one reads TMA's zeros past K), N = 2880 (not a tile multiple)."""
    problem = gpu_problem(fmt, 2880, 2880, f"w4a16-tail/{fmt}").with_b_layout(layout)
    out = run(problem, Wgmma(128, AUTO_STAGES))
    result = check_kernel(problem, out, reference_grouped_matmul(problem), "h200_wgmma")
    assert result.passed, result


@pytest.mark.gpu
def test_gpu_nan_and_inf_tokens_reach_their_rows_only():
    """A NaN token element makes its row NaN; an Inf makes its row +-Inf or NaN as the reference says; the other
    rows stay exact. ``gbs.grouped_matmul``'s auto plan runs it."""
    problem = gpu_problem("w4a16", 512, 1024, "w4a16-nonfinite")
    a = problem.a.copy()
    a[44, 100] = np.float32("nan")   # rows 43-45: expert 2's 3 tokens; 46-115: expert 5's 70
    a[50, 7] = np.float32("inf")
    problem = dataclasses.replace(problem, a=a)
    ref = reference_grouped_matmul(problem)
    import gbs

    out = gbs.grouped_matmul(problem)
    result = check_kernel(problem, out, ref, "h200_wgmma")
    assert result.passed, result
    assert np.isnan(out[44].astype(np.float32)).all()
