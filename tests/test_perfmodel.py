"""The analytic performance model (gbs.lab.perfmodel): physical sanity, the tile-walk counts against
gbs.schedule, the breakdown terms the issue names, and calibration on synthetic measurements.

Every check can fail: they compare against hand-computed counts (tiles, padding, bytes), against
the shared tile walk, or against parameters the fit must recover.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gbs.lab import perfmodel as pm
from gbs.lab.cases import useful_bytes
from gbs.dispatch import B200_SMEM_PER_SM, H200_SMEM_PER_SM, classify_regime, grouped_matmul_nvfp4_dispatch
from gbs.problem import make_routing, random_problem
from gbs.schedule import TileConfig, assign_tiles

DEEPSEEK_UP = (4096, 7168)
KIMI_UP = (512, 7168)
H200_NO_DEQUANT = dataclasses.replace(pm.H200, dequant_cycles_per_element=0.0)


def uniform(n_k, slots, tokens, fmt="nvfp4"):
    n, k = n_k
    return pm.ProblemShape.uniform(fmt, n=n, k=k, num_active_experts=slots, tokens_per_expert=tokens)


# ----------------------------------------------------------------------------------------------
# Hardware parameters and inputs
# ----------------------------------------------------------------------------------------------
def test_hardware_figures_match_their_sources():
    assert pm.H200.num_sms == 132 and pm.B200.num_sms == 148
    assert pm.H200.hbm_sustained_tbs == 4.30            # kernels.md streaming read
    assert pm.H200.bf16_tflops == 766.0 and pm.H200.fp8_tflops == 1340.0
    assert pm.H200.smem_per_sm == H200_SMEM_PER_SM and pm.B200.smem_per_sm == B200_SMEM_PER_SM
    assert pm.B200.hbm_peak_tbs == 8.0 and pm.B200.fp8_tflops == 4500.0
    # Hopper multiplies bf16 after software dequant whatever the format; B200 FP4 kinds run at the
    # FP4 rate, kind::mxf8f6f4 (MXFP8, W4A8) at the FP8 rate.
    assert {pm.H200.mma_operand(f) for f in pm.MODEL_FORMATS} == {"bf16"}
    assert [pm.B200.mma_operand(f) for f in ("nvfp4", "mxfp4", "mxfp8", "w4a8")] == ["fp4", "fp4", "fp8", "fp8"]
    assert pm.B200.mma_tflops("w4a8") == 4500.0 and pm.H200.mma_tflops("nvfp4") == 766.0


@pytest.mark.parametrize("field, value, error", [
    ("num_sms", 0, ValueError), ("clock_ghz", -1.0, ValueError), ("memory_latency_ns", float("nan"), TypeError),
    ("key", "", ValueError), ("block_scaled_mma", 1, TypeError), ("bf16_tflops", None, ValueError),
    ("tile_overhead_cycles", -5.0, ValueError),
])
def test_hardware_params_reject_bad_fields(field, value, error):
    with pytest.raises(error, match=field):
        dataclasses.replace(pm.H200, **{field: value})


def test_hardware_without_the_needed_mma_rate_says_so():
    no_fp4 = dataclasses.replace(pm.B200, fp4_tflops=None)
    with pytest.raises(ValueError, match="no fp4 MMA rate"):
        pm.model_config(uniform(DEEPSEEK_UP, 8, 4), pm.ModelConfig(True, 8, 1, 4), no_fp4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(format="mxfp8_e5m2"), "format must be one of"),
    (dict(group_sizes=(1, 2)), "one expert id per group slot"),
    (dict(group_sizes=(-1,)), "group_sizes"),
    (dict(expert_ids=(-2,)), "expert_ids"),
    (dict(k=7160), "not a multiple of the nvfp4 block size"),
    (dict(group_sizes=(), expert_ids=()), "at least one slot"),
])
def test_problem_shape_rejects_bad_input(kwargs, match):
    fields = dict(format="nvfp4", n=512, k=7168, group_sizes=(4,), expert_ids=(0,))
    fields.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        pm.ProblemShape(**fields)


def test_problem_shape_of_a_real_problem_has_its_useful_bytes():
    problem = random_problem("nvfp4", n=256, k=256, num_experts=6, total_tokens=40, num_active_experts=4,
                             routing="ragged", num_empty=1, num_skipped=1, seed=3)
    shape = pm.ProblemShape.from_problem(problem)
    assert shape.group_sizes == tuple(int(s) for s in problem.group_sizes)
    assert shape.active_slots() == problem.active_slots()
    assert useful_bytes(shape) == useful_bytes(problem)
    assert shape.estimated_total_m == problem.estimated_total_m
    assert shape.regime == classify_regime(problem.estimated_total_m, problem.num_active_experts)


def test_model_config_validates_knobs_and_stages():
    with pytest.raises(ValueError, match="cta_group=2 requires ab_swapped"):
        pm.ModelConfig(False, 128, 2, 4)
    with pytest.raises(ValueError, match="mma_bn=8 is illegal with cta_group=2"):
        pm.ModelConfig(True, 8, 2, 4)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        pm.ModelConfig(True, 8, 1, 0)
    with pytest.raises(ValueError, match="do not fit"):   # NVFP4 bn128/cg2: at most 7 stages (spec table)
        pm.model_config(uniform(DEEPSEEK_UP, 8, 256), pm.ModelConfig(True, 128, 2, 8), pm.B200)
    with pytest.raises(TypeError, match="ModelConfig or a dispatch KernelConfig"):
        pm.ModelConfig.of((True, 8, 1, 4))


def test_dispatch_kernel_config_is_modelled_like_its_knobs():
    shape = uniform(DEEPSEEK_UP, 64, 4)
    config = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=64, estimated_total_m=256)
    as_knobs = pm.ModelConfig(True, 8, 1, 6)
    assert pm.ModelConfig.of(config) == as_knobs
    assert pm.model_config(shape, config, pm.B200) == pm.model_config(shape, as_knobs, pm.B200)


# ----------------------------------------------------------------------------------------------
# The tile walk, counted
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [TileConfig(True, 8, 1), TileConfig(True, 64, 2), TileConfig(False, 64, 1),
                                  TileConfig(True, 256, 2)])
def test_walk_summary_matches_the_shared_tile_walk(tile):
    routing = make_routing(num_experts=12, total_tokens=300, num_active_experts=7, routing="ragged",
                           num_empty=2, num_skipped=2, seed=5)
    n, num_ctas = 704, 16          # 704 = 2.75 x 256: the last weight-row block is partial
    shape = tile.tile_shape
    offsets = np.concatenate([[0], np.cumsum(routing.group_sizes)])
    work = assign_tiles(num_ctas, offsets, routing.expert_ids, n, shape)
    summary = pm.walk_summary(tuple(int(s) for s in routing.group_sizes), tuple(int(e) for e in routing.expert_ids),
                              n, tile, num_ctas // tile.cta_group)
    leaders = work[::tile.cta_group]          # rank 0 of each pair sees every tile of the pair
    per_pair = sorted({(sum(w.tile.num_rows == shape.weight_rows for w in tiles),
                        sum(w.tile.num_rows < shape.weight_rows for w in tiles)) for tiles in leaders} - {(0, 0)})
    assert sorted(summary.pair_classes) == per_pair
    assert summary.num_tiles == sum(len(t) for t in leaders)
    assert summary.partial_tiles == sum(w.tile.num_rows < shape.weight_rows for t in leaders for w in t)
    assert summary.max_tiles_per_pair == max(len(t) for t in leaders)
    assert summary.partial_tile_rows == (n - 1) % shape.weight_rows + 1


# ----------------------------------------------------------------------------------------------
# Physical sanity
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", [pm.H200, pm.B200], ids=["h200", "b200"])
@pytest.mark.parametrize("knobs", [(True, 8, 1, 4), (True, 64, 2, 6), (False, 128, 1, 3)])
def test_time_grows_with_the_bytes_to_move(hw, knobs):
    # 64 experts keep every SM busy, so more bytes per launch must mean more time (with fewer
    # tiles than SMs a larger N only fills idle SMs, and the time may stay put).
    config = pm.ModelConfig(*knobs)
    for vary in ("k", "experts", "n"):
        times = []
        for scale in (1, 2, 4):
            if vary == "k":
                shape = uniform((4096, 1024 * scale), 64, 4)
            elif vary == "experts":
                shape = uniform(DEEPSEEK_UP, 64 * scale, 4)
            else:
                shape = uniform((1024 * scale, 7168), 64, 4)
            times.append(pm.model_config(shape, config, hw).time_us)
        assert times[0] < times[1] < times[2], (vary, times)
    slower_memory = dataclasses.replace(hw, hbm_sustained_tbs=hw.hbm_sustained_tbs / 2)
    shape = uniform(DEEPSEEK_UP, 64, 4)
    assert pm.model_config(shape, config, slower_memory).time_us >= pm.model_config(shape, config, hw).time_us


@pytest.mark.parametrize("hw", [pm.B200, H200_NO_DEQUANT], ids=["b200", "h200-no-dequant"])
def test_decode_is_memory_bound(hw):
    estimate = pm.model_config(uniform(DEEPSEEK_UP, 64, 4), pm.ModelConfig(True, 8, 1, 6), hw)
    assert estimate.bound == "dram"
    assert estimate.gbps / 1e3 > 0.95 * hw.hbm_sustained_tbs
    assert estimate.tflops < 0.1 * hw.mma_tflops("nvfp4")


def test_h200_software_dequant_is_the_decode_limit_at_the_default_cost():
    # ~4 SIMT ops per element over 128 lanes is slower than streaming the FP4 bytes: the H200 port's
    # decode is bounded by dequantization, not by HBM, unless the dequant is cheaper than that.
    estimate = pm.model_config(uniform(DEEPSEEK_UP, 64, 4), pm.ModelConfig(True, 8, 1, 6), pm.H200)
    assert estimate.bound == "dequant" and estimate.critical_path_us > estimate.dram_time_us


@pytest.mark.parametrize("hw, floor", [(H200_NO_DEQUANT, 0.9), (pm.B200, 0.7)], ids=["h200-no-dequant", "b200"])
def test_large_prefill_approaches_the_mma_rate(hw, floor):
    shape = uniform(DEEPSEEK_UP, 8, 4096)
    best = max((pm.model_config(shape, pm.auto_config("nvfp4", TileConfig(True, bn, 2), hw), hw)
                for bn in (128, 256)), key=lambda e: e.tflops)
    assert best.tflops > floor * hw.mma_tflops("nvfp4")
    assert best.critical_mma_us > 0.75 * best.time_us
    assert best.padding_waste == 0.0


def test_two_cta_pair_halves_token_bytes_per_weight_row():
    shape = uniform(DEEPSEEK_UP, 32, 32)
    single = pm.model_config(shape, pm.ModelConfig(True, 64, 1, 6), pm.B200)
    pair = pm.model_config(shape, pm.ModelConfig(True, 64, 2, 6), pm.B200)
    assert pair.token_bytes_per_weight_row == single.token_bytes_per_weight_row / 2
    assert pair.weight_bytes_loaded == single.weight_bytes_loaded
    assert pair.token_bytes_loaded * 2 == single.token_bytes_loaded
    assert pair.bytes_without_sharing - pair.l2_bytes == pair.token_bytes_loaded
    assert single.bytes_without_sharing == single.l2_bytes
    # NVFP4: a 256-element K slice of one token is 128 B + 16 scale bytes; 64 tokens over 128 rows.
    assert single.token_bytes_per_weight_row == 64 * 144 / 128


def test_padding_waste_of_mma_bn_8_vs_64_at_4_tokens():
    shape = uniform(DEEPSEEK_UP, 64, 4)
    narrow = pm.model_config(shape, pm.ModelConfig(True, 8, 1, 6), pm.B200)
    wide = pm.model_config(shape, pm.ModelConfig(True, 64, 1, 6), pm.B200)
    assert narrow.padding_waste == pytest.approx(1 - 4 / 8)
    assert wide.padding_waste == pytest.approx(1 - 4 / 64)
    assert narrow.num_tiles == wide.num_tiles == 64 * 4096 // 128


def test_kimi_up_projection_starves_the_grid():
    shape = uniform(KIMI_UP, 8, 4)
    single = pm.model_config(shape, pm.ModelConfig(True, 8, 1, 6), pm.B200)
    assert single.num_tiles == 8 * 4                      # 4 tiles of 128 weight rows per expert
    assert single.busy_ctas == 32 and single.grid_occupancy == pytest.approx(32 / 148)
    assert single.wave_quantisation == pytest.approx(148 / 32)
    pair = pm.model_config(shape, pm.ModelConfig(True, 64, 2, 6), pm.B200)
    assert pair.num_tiles == 8 * 2 and pair.busy_ctas == 32  # 2 pair tiles per expert, still 32 CTAs
    # Too few CTAs to pull the bytes: the per-CTA critical path, not DRAM, bounds the launch.
    assert single.critical_path_us > single.dram_time_us and single.bound in ("latency", "sm_load")
    big_grid = pm.model_config(uniform(DEEPSEEK_UP, 8, 4), pm.ModelConfig(True, 8, 1, 6), pm.B200)
    assert big_grid.busy_ctas == 148 and big_grid.bound == "dram"


def test_stages_against_latency_and_prologue():
    shape = uniform(KIMI_UP, 8, 4)        # latency-bound: few CTAs, each streaming its tiles
    times = {s: pm.model_config(shape, pm.ModelConfig(True, 8, 1, s), pm.B200) for s in (1, 2, 4, 8, 10)}
    assert times[1].time_us > times[2].time_us > times[4].time_us
    assert times[1].stream_limit == "latency"
    # One stage cannot overlap a load with the MMA that consumes the previous one.
    assert times[1].tile_stream_us == pytest.approx(
        times[1].k_iters * (pm.B200.memory_latency_ns * 1e-3 + times[1].tile_mma_us / times[1].k_iters))
    prologues = [times[s].prologue_us for s in sorted(times)]
    assert prologues == sorted(prologues) and prologues[0] < prologues[-1]
    assert times[4].bytes_in_flight == 4 * times[4].stage_bytes
    # DRAM-bound decode: past the latency-bandwidth product extra stages only add prologue.
    dram = uniform(DEEPSEEK_UP, 64, 4)
    few, many = (pm.model_config(dram, pm.ModelConfig(True, 8, 1, s), pm.B200) for s in (4, 10))
    assert few.bytes_in_flight > few.latency_bandwidth_bytes
    assert many.time_us - few.time_us == pytest.approx(many.prologue_us - few.prologue_us)


def test_wave_quantisation_of_one_tile_too_many():
    # 75 tiles of bn8/cg1 over 148 SMs: one wave; 150 tiles: two waves on 2 SMs only.
    one_wave = pm.model_config(uniform((128 * 75, 256), 1, 8), pm.ModelConfig(True, 8, 1, 2), pm.B200)
    assert one_wave.num_tiles == 75 and one_wave.wave_quantisation == pytest.approx(148 / 75)
    two = pm.model_config(uniform((128 * 150, 256), 1, 8), pm.ModelConfig(True, 8, 1, 2), pm.B200)
    assert two.max_tiles_per_pair == 2 and two.wave_quantisation == pytest.approx(2 * 148 / 150)


def test_empty_problem_costs_the_launch_only():
    shape = pm.ProblemShape("nvfp4", 4096, 7168, (5, 0, 3), (-1, 2, -1))
    estimate = pm.model_config(shape, pm.ModelConfig(True, 8, 1, 6), pm.B200)
    assert estimate.num_tiles == 0 and estimate.dram_bytes == 0 and estimate.useful_flops == 0
    assert estimate.time_us == pytest.approx(pm.B200.launch_overhead_us)


def test_explanations_name_the_terms():
    shape = uniform(DEEPSEEK_UP, 8, 4)
    text = pm.model_config(shape, pm.ModelConfig(True, 8, 1, 6), pm.B200).explain()
    for word in ("prologue", "DRAM", "critical path", "in flight per SM", "padding waste", "wave quantisation"):
        assert word in text
    why = pm.explain_difference(shape, pm.ModelConfig(True, 8, 1, 3), pm.ModelConfig(True, 8, 1, 10), pm.B200)
    assert "bn8/cg1/sw x3" in why and "bn8/cg1/sw x10" in why and "prologue" in why
    knobs = pm.explain_difference(shape, pm.ModelConfig(True, 8, 1, 6), pm.ModelConfig(True, 64, 2, 6), pm.B200)
    assert "padding waste 50 vs 94 %" in knobs


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------
def test_spearman_on_known_orders():
    assert pm.spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert pm.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert pm.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1])
    assert np.isnan(pm.spearman([1, 2], [1, 2])) and np.isnan(pm.spearman([1, 1, 1], [1, 2, 3]))


TRUE_H200 = dataclasses.replace(pm.H200, bandwidth_fraction=0.85, memory_latency_ns=900.0, stage_setup_cycles=300.0,
                                tile_overhead_cycles=1500.0, dequant_cycles_per_element=0.012)


def synthetic_cases():
    cases = []
    for n_k in (DEEPSEEK_UP, KIMI_UP, (7168, 256)):
        for slots, tokens in ((8, 1), (8, 4), (64, 4), (16, 32), (8, 256)):
            shape = uniform(n_k, slots, tokens)
            for knobs in ((True, 8, 1), (True, 64, 2), (True, 128, 2), (True, 32, 1)):
                cases += [(shape, pm.ModelConfig(*knobs, stages)) for stages in (1, 2, 4, 7)]
    return cases


def test_calibration_recovers_known_parameters_from_noisy_model_times():
    cases = synthetic_cases()
    rng = np.random.default_rng(1)
    measured = np.array([pm.model_config(s, c, TRUE_H200).time_us for s, c in cases]) * np.exp(
        rng.normal(0.0, 0.01, len(cases)))
    result = pm.calibrate(cases, measured, pm.H200)
    assert result.converged and result.unidentified == ()
    for name in pm.DEFAULT_FREE_PARAMETERS:
        assert result.fitted[name] == pytest.approx(getattr(TRUE_H200, name), rel=0.1), name
    assert result.after.rms_log_error < 0.015 < result.before.rms_log_error
    assert result.after.median_relative_error < 0.01
    assert set(result.after.median_relative_error_by_regime) == {"decode", "small_prefill", "large_prefill"}
    assert len(result.after.spearman_by_group) == 9
    assert min(result.after.spearman_by_group.values()) > 0.9
    # The fitted hardware is the start with only the free fields changed.
    assert dataclasses.replace(result.hardware, **{n: getattr(pm.H200, n) for n in result.free}) == pm.H200
    assert "median relative error" in result.after.to_markdown()


def test_calibration_reports_parameters_the_cases_do_not_constrain():
    cases = synthetic_cases()[:40]
    measured = [pm.model_config(s, c, pm.B200).time_us * 1.1 for s, c in cases]
    with_dequant = dataclasses.replace(pm.B200, dequant_cycles_per_element=0.01)   # unused: block-scaled MMA
    result = pm.calibrate(cases, measured, with_dequant, free=("dequant_cycles_per_element", "launch_overhead_us"))
    assert result.unidentified == ("dequant_cycles_per_element",)
    assert result.fitted["dequant_cycles_per_element"] == pytest.approx(0.01)


@pytest.mark.parametrize("kwargs, match", [
    (dict(free=("clock_ghz",)), "free must be distinct names"),
    (dict(free=()), "free must be distinct names"),
    (dict(hw=pm.B200, free=("dequant_cycles_per_element",)), "must start > 0"),
    (dict(measured=[1.0]), "one measured time per case"),
    (dict(measured=[-1.0, 2.0]), "finite and > 0"),
])
def test_calibration_rejects_bad_input(kwargs, match):
    cases = synthetic_cases()[:2]
    measured = kwargs.pop("measured", [10.0, 20.0])
    hw = kwargs.pop("hw", pm.H200)
    with pytest.raises(ValueError, match=match):
        pm.calibrate(cases, measured, hw, **kwargs)
