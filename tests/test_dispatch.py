"""Tests of gbs.dispatch against ../shared/spec/dispatch.md, table row by table row.

Case generators (``enumerate_*``) list the spec's cases; pytest parametrizes over them. Expected
values are written out from the spec, not recomputed with the module's own helpers.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbs import dispatch as d
from gbs.dispatch import (
    B200_SMEM_PER_SM,
    H200_SMEM_PER_SM,
    KIMI_SHAPE,
    LEGAL_MMA_BN,
    auto_pipeline_stages,
    check_config,
    classify_regime,
    grouped_matmul_block_scaled_sm100_dispatch,
    grouped_matmul_mxfp8_dispatch,
    grouped_matmul_nvfp4_dispatch,
    pipeline_smem_terms,
)

DECODE, SMALL, LARGE = "decode", "small_prefill", "large_prefill"
REGIME_KNOBS = {DECODE: (True, 8, 1), SMALL: (True, 64, 2), LARGE: (True, 128, 2)}
# Workload shapes (workloads.md), Kimi's excluded (its own rule).
SHAPES = [(4096, 7168), (7168, 2048), (7168, 256), (2048, 4096), (6144, 6144), (6144, 3072)]
SF_K_TILES = {"nvfp4": 4, "mxfp4": 2, "mxfp8": 1}


def tokens_for(regime: str, slots: int) -> int:
    """A token estimate strictly inside ``regime`` for ``slots`` group slots."""
    return {DECODE: 4 * slots, SMALL: 32 * slots, LARGE: 128 * slots}[regime]


def knobs(cfg):
    return cfg.ab_swapped, cfg.mma_bn, cfg.cta_group


# ------------------------------------------------------------------------------------- regimes
def enumerate_regime_boundaries():
    """(estimated_total_m, slots, regime): both sides of the two integer boundaries."""
    for slots in (1, 3, 8, 64, 256):
        yield 0, slots, DECODE
        yield 8 * slots, slots, DECODE
        yield 8 * slots + 1, slots, SMALL
        yield 64 * slots, slots, SMALL
        yield 64 * slots + 1, slots, LARGE
        yield 4096 * slots, slots, LARGE
    # Exactness beyond float precision: a division-based test would misclassify these.
    big = 2**60 + 1
    yield 8 * big, big, DECODE
    yield 8 * big + 1, big, SMALL


@pytest.mark.parametrize("m, slots, regime", list(enumerate_regime_boundaries()))
def test_classify_regime_boundaries(m, slots, regime):
    assert classify_regime(m, slots) == regime


def test_regime_counts_slots_not_experts_with_tokens():
    # 64 slots of which many hold expert -1 or no tokens still count as 64: 512 tokens = decode.
    slots = 64
    assert classify_regime(512, slots) == DECODE
    assert classify_regime(513, slots) == SMALL
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=slots,
                                        estimated_total_m=512)
    assert (cfg.regime, knobs(cfg)) == (DECODE, (True, 8, 1))
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=slots,
                                        estimated_total_m=513)
    assert (cfg.regime, knobs(cfg)) == (SMALL, (True, 64, 2))


@pytest.mark.parametrize("m, slots, regime", list(enumerate_regime_boundaries())[:30])
@pytest.mark.parametrize("dispatch", ["nvfp4", "mxfp8"])
def test_regime_knobs_at_boundaries(dispatch, m, slots, regime):
    fn = grouped_matmul_nvfp4_dispatch if dispatch == "nvfp4" else grouped_matmul_mxfp8_dispatch
    cfg = fn(n=2048, k=4096, num_active_experts=slots, estimated_total_m=m)
    assert cfg.regime == regime
    assert knobs(cfg) == REGIME_KNOBS[regime]
    assert cfg.rule == "regime"


# ------------------------------------------------------------------------- NVFP4 stage tables
def enumerate_nvfp4_stage_cases():
    """(n, k, regime, stages, source) for every shape x regime."""
    tuned = {(4096, 7168, SMALL): 6, (4096, 7168, LARGE): 7, (7168, 2048, SMALL): 6,
             (7168, 2048, LARGE): 6, (7168, 256, LARGE): 6}
    auto = {SMALL: 8, LARGE: 7}   # NVFP4 auto on B200 (spec table)
    for n, k in SHAPES:
        yield n, k, DECODE, 6, "decode-default"
        for regime in (SMALL, LARGE):
            if (n, k, regime) in tuned:
                yield n, k, regime, tuned[(n, k, regime)], "tuned"
            else:
                yield n, k, regime, auto[regime], "auto"


@pytest.mark.parametrize("n, k, regime, stages, source", list(enumerate_nvfp4_stage_cases()))
@pytest.mark.parametrize("slots", [8, 64])
def test_nvfp4_stages(n, k, regime, stages, source, slots):
    cfg = grouped_matmul_nvfp4_dispatch(n=n, k=k, num_active_experts=slots,
                                        estimated_total_m=tokens_for(regime, slots))
    assert (cfg.regime, cfg.rule) == (regime, "regime")
    assert knobs(cfg) == REGIME_KNOBS[regime]
    assert (cfg.num_pipeline_stages, cfg.stages_source) == (stages, source)


def test_nvfp4_tuned_table_is_the_spec_table():
    assert [tuple(r) for r in d.NVFP4_TUNED_STAGES] == [
        (4096, 7168, 64, 6), (4096, 7168, -1, 7), (7168, 2048, 64, 6), (7168, 2048, -1, 6),
        (7168, 256, -1, 6)]
    assert [tuple(r) for r in d.MXFP8_TUNED_DECODE_STAGES] == [(6144, 6144, 6, 5.3),
                                                               (6144, 3072, 6, 7.3)]
    assert (d.DECODE_AVG_M, d.SMALL_PREFILL_AVG_M, d.DECODE_DEFAULT_STAGES) == (8, 64, 6)
    assert KIMI_SHAPE == (512, 7168)
    assert (B200_SMEM_PER_SM, H200_SMEM_PER_SM) == (233472, 232448)


def test_tuned_row_needs_exact_regime():
    # (7168, 256) has a large-prefill row only: small prefill falls back to auto.
    cfg = grouped_matmul_nvfp4_dispatch(n=7168, k=256, num_active_experts=64,
                                        estimated_total_m=64 * 64)
    assert (cfg.regime, cfg.num_pipeline_stages, cfg.stages_source) == (SMALL, 8, "auto")
    cfg = grouped_matmul_nvfp4_dispatch(n=7168, k=256, num_active_experts=64,
                                        estimated_total_m=64 * 64 + 1)
    assert (cfg.regime, cfg.num_pipeline_stages, cfg.stages_source) == (LARGE, 6, "tuned")


# ----------------------------------------------------------------------------------------- Kimi
def enumerate_kimi_cases():
    """(slots, estimated_total_m, regime, mma_bn)."""
    for slots in (1, 8, 64):
        yield slots, 0, DECODE, 64
        yield slots, 8 * slots, DECODE, 64
        yield slots, 8 * slots + 1, SMALL, 128
        yield slots, 64 * slots, SMALL, 128
        yield slots, 64 * slots + 1, LARGE, 128
        yield slots, 1000 * slots, LARGE, 128


@pytest.mark.parametrize("slots, m, regime, mma_bn", list(enumerate_kimi_cases()))
def test_kimi_rule(slots, m, regime, mma_bn):
    cfg = grouped_matmul_nvfp4_dispatch(n=512, k=7168, num_active_experts=slots,
                                        estimated_total_m=m)
    assert knobs(cfg) == (True, mma_bn, 2)
    assert (cfg.num_pipeline_stages, cfg.stages_source) == (6, "tuned")
    assert (cfg.rule, cfg.regime) == ("kimi", regime)
    assert "Kimi" in cfg.explain()


def test_kimi_rule_only_for_exact_shape_and_not_under_override():
    cfg = grouped_matmul_nvfp4_dispatch(n=512, k=4096, num_active_experts=8, estimated_total_m=8)
    assert (cfg.rule, knobs(cfg)) == ("regime", (True, 8, 1))
    cfg = grouped_matmul_nvfp4_dispatch(n=512, k=7168, num_active_experts=8, estimated_total_m=8,
                                        override=True, ab_swapped=True, mma_bn=16, cta_group=1)
    assert (cfg.rule, cfg.regime, knobs(cfg)) == ("override", "override", (True, 16, 1))
    assert cfg.stages_source == "override" and cfg.num_pipeline_stages == cfg.max_pipeline_stages
    # The MXFP8 dispatch has no Kimi rule.
    cfg = grouped_matmul_mxfp8_dispatch(n=512, k=7168, num_active_experts=8, estimated_total_m=8)
    assert (cfg.rule, knobs(cfg), cfg.stages_source) == ("regime", (True, 8, 1), "auto")


# -------------------------------------------------------------------------------- stages = auto
def enumerate_auto_stage_table():
    """(format, ab_swapped, mma_bn, cta_group, stages): the spec's B200 auto table."""
    regime_columns = [(True, 8, 1), (True, 64, 2), (True, 128, 2), (False, 128, 1)]
    for fmt, row in (("nvfp4", (10, 8, 7, 5)), ("mxfp8", (12, 10, 8, 5))):
        for (swapped, bn, cg), stages in zip(regime_columns, row):
            yield fmt, swapped, bn, cg, stages
    yield "mxfp4", False, 128, 1, 5


@pytest.mark.parametrize("fmt, swapped, bn, cg, stages", list(enumerate_auto_stage_table()))
def test_auto_stage_table(fmt, swapped, bn, cg, stages):
    assert auto_pipeline_stages(mma_bn=bn, cta_group=cg, ab_swapped=swapped,
                                num_sf_k_tiles=SF_K_TILES[fmt]) == stages


def test_pipeline_smem_terms_nvfp4_decode():
    t = pipeline_smem_terms(mma_bn=8, cta_group=1, ab_swapped=True, num_sf_k_tiles=4)
    assert t.c_tile_bytes == 2 * 128 * 8
    assert t.fixed == 1024 + 2 * 2048 + 12 + 320 + 16 * 2
    assert t.budget == 233472 - t.fixed == 227988
    assert (t.a_tile, t.b_tile, t.sfa, t.sfb) == (16384, 1024, 2048, 2048)
    assert t.per_stage == 16384 + 1024 + 2048 + 2048 + 32 == 21536
    assert t.stages == 227988 // 21536 == 10


def test_pipeline_smem_terms_unswapped_and_wide():
    t = pipeline_smem_terms(mma_bn=256, cta_group=2, ab_swapped=True, num_sf_k_tiles=1)
    assert t.c_tile_bytes == 2 * 128 * 32          # min(32, mma_bn)
    assert t.accum_stages == 1                     # mma_bn > 128
    assert t.b_tile == 128 * 128                   # 256 / cta_group rows
    assert t.sfb == 2 * 512                        # ceil(256 / 128) atoms
    t = pipeline_smem_terms(mma_bn=16, cta_group=1, ab_swapped=False, num_sf_k_tiles=2)
    assert t.c_tile_bytes == 2 * 128 * 64


def test_smaller_smem_budget_gives_fewer_auto_stages():
    # MXFP8 small prefill: 215700 // 21536 = 10 on B200, 214676 // 21536 = 9 with H200's budget.
    b200 = grouped_matmul_mxfp8_dispatch(n=2048, k=4096, num_active_experts=8,
                                         estimated_total_m=256)
    h200 = grouped_matmul_mxfp8_dispatch(n=2048, k=4096, num_active_experts=8,
                                         estimated_total_m=256, smem_per_sm=H200_SMEM_PER_SM)
    assert (b200.num_pipeline_stages, h200.num_pipeline_stages) == (10, 9)
    assert h200.max_pipeline_stages == 9
    # Monotone in the budget for every legal tile.
    for cg, bns in LEGAL_MMA_BN.items():
        for bn in bns:
            for swapped in ((True,) if cg == 2 else (True, False)):
                stages = [auto_pipeline_stages(mma_bn=bn, cta_group=cg, ab_swapped=swapped,
                                               num_sf_k_tiles=4, smem_per_sm=s)
                          for s in (120_000, H200_SMEM_PER_SM, B200_SMEM_PER_SM)]
                assert stages == sorted(stages) and stages[0] < stages[2]


def test_smem_too_small_is_an_error():
    with pytest.raises(ValueError, match="too small for one pipeline stage"):
        auto_pipeline_stages(mma_bn=8, cta_group=1, ab_swapped=True, num_sf_k_tiles=4,
                             smem_per_sm=20_000)
    with pytest.raises(ValueError, match="too small"):
        grouped_matmul_block_scaled_sm100_dispatch(a_format="mxfp4", b_format="mxfp4", n=256,
                                                   k=256, num_active_experts=1,
                                                   estimated_total_m=1, smem_per_sm=4096)


def test_tuned_stages_that_do_not_fit_are_an_error_not_a_cap():
    # NVFP4 decode at 120000 B: budget 114516 // 21536 = 5 < DECODE_DEFAULT_STAGES.
    with pytest.raises(ValueError, match="DECODE_DEFAULT_STAGES.*does not fit"):
        grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8,
                                      smem_per_sm=120_000)
    # H200's budget fits every tuned value (the tightest: (4096, 7168) large prefill, 7 of 7).
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8,
                                        estimated_total_m=8 * 65, smem_per_sm=H200_SMEM_PER_SM)
    assert (cfg.num_pipeline_stages, cfg.max_pipeline_stages) == (7, 7)


# -------------------------------------------------------------------------------------- MXFP8
def enumerate_mxfp8_cases():
    """(n, k, regime, fuse_swiglu, stages, source)."""
    auto = {DECODE: 12, SMALL: 10, LARGE: 8}   # MXFP8 auto on B200 (spec table)
    for n, k in SHAPES + [KIMI_SHAPE]:
        for regime in (DECODE, SMALL, LARGE):
            for fuse in (False, True):
                if regime == DECODE and (n, k) in ((6144, 6144), (6144, 3072)) and not fuse:
                    yield n, k, regime, fuse, 6, "tuned"
                else:
                    yield n, k, regime, fuse, auto[regime], "auto"


@pytest.mark.parametrize("n, k, regime, fuse, stages, source", list(enumerate_mxfp8_cases()))
@pytest.mark.parametrize("b_format", ["mxfp8", "mxfp4"])
def test_mxfp8_dispatch(n, k, regime, fuse, stages, source, b_format):
    slots = 16
    cfg = grouped_matmul_mxfp8_dispatch(n=n, k=k, num_active_experts=slots,
                                        estimated_total_m=tokens_for(regime, slots),
                                        fuse_swiglu=fuse, b_format=b_format)
    assert (cfg.regime, cfg.rule, knobs(cfg)) == (regime, "regime", REGIME_KNOBS[regime])
    assert (cfg.num_pipeline_stages, cfg.stages_source) == (stages, source)
    assert (cfg.a_format, cfg.b_format, cfg.mma_kind) == ("mxfp8", b_format, "mxf8f6f4")
    assert (cfg.num_sf_k_tiles, cfg.k_tile_elements) == (1, 128)
    assert cfg.fuse_swiglu is fuse


@pytest.mark.parametrize("n, k, gain", [(6144, 6144, "5.3 %"), (6144, 3072, "7.3 %")])
def test_mxfp8_tuned_decode_boundary(n, k, gain):
    # The rows need the decode regime (avg_m <= 8): 64 tokens over 8 slots yes, 65 no.
    cfg = grouped_matmul_mxfp8_dispatch(n=n, k=k, num_active_experts=8, estimated_total_m=64)
    assert (cfg.num_pipeline_stages, cfg.stages_source) == (6, "tuned")
    assert "MXFP8_TUNED_DECODE_STAGES" in cfg.explain() and gain in cfg.explain()
    cfg = grouped_matmul_mxfp8_dispatch(n=n, k=k, num_active_experts=8, estimated_total_m=65)
    assert (cfg.num_pipeline_stages, cfg.stages_source) == (10, "auto")


# ------------------------------------------------------------------------------------- routing
def enumerate_routes():
    """(a, b, rule, mma_kind, num_sf_k_tiles, k_tile_elements, decode knobs, decode stages)."""
    yield "nvfp4", "nvfp4", "regime", "mxf4nvf4", 4, 256, (True, 8, 1), 6
    yield "mxfp4", "mxfp4", "default", "mxf4", 2, 256, (False, 128, 1), 5
    yield "mxfp8", "mxfp8", "default", "mxf8f6f4", 1, 128, (False, 128, 1), 5
    yield "mxfp8", "mxfp4", "regime", "mxf8f6f4", 1, 128, (True, 8, 1), 12


@pytest.mark.parametrize("a, b, rule, kind, sf, ktile, decode_knobs, stages",
                         list(enumerate_routes()))
def test_routing(a, b, rule, kind, sf, ktile, decode_knobs, stages):
    cfg = grouped_matmul_block_scaled_sm100_dispatch(a_format=a, b_format=b, n=2048, k=4096,
                                                     num_active_experts=8, estimated_total_m=8)
    assert (cfg.a_format, cfg.b_format, cfg.rule) == (a, b, rule)
    assert (cfg.mma_kind, cfg.num_sf_k_tiles, cfg.k_tile_elements) == (kind, sf, ktile)
    assert knobs(cfg) == decode_knobs
    assert cfg.num_pipeline_stages == stages
    assert cfg.regime == ("decode" if rule == "regime" else "default")
    if rule == "default":
        assert cfg.stages_source == "auto" and "default config" in cfg.explain()


def test_routing_nvfp4_uses_nvfp4_rules_incl_kimi():
    cfg = grouped_matmul_block_scaled_sm100_dispatch(a_format="nvfp4", b_format="nvfp4", n=512,
                                                     k=7168, num_active_experts=8,
                                                     estimated_total_m=8 * 100)
    assert (cfg.rule, knobs(cfg), cfg.num_pipeline_stages) == ("kimi", (True, 128, 2), 6)


def test_routing_accepts_block_format_objects_and_any_case():
    cfg = grouped_matmul_block_scaled_sm100_dispatch(
        a_format=d.get_format("mxfp8"), b_format="MXFP4", n=256, k=256, num_active_experts=1,
        estimated_total_m=1)
    assert (cfg.a_format, cfg.b_format) == ("mxfp8", "mxfp4")


@pytest.mark.parametrize("a, b", [
    ("nvfp4", "mxfp4"), ("mxfp4", "nvfp4"), ("nvfp4", "mxfp8"), ("mxfp4", "mxfp8"),
    ("mxfp8_e5m2", "mxfp8_e5m2"), ("mxfp8", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp4"),
    ("bf16", "nvfp4"), ("nvfp4", "fp16"), ("", "mxfp8"),
])
def test_routing_rejects_unsupported_pairs(a, b):
    with pytest.raises(ValueError, match="supported .A x B. pairs: nvfp4 x nvfp4, mxfp4 x mxfp4, "
                                         "mxfp8 x mxfp8, mxfp8 x mxfp4"):
        grouped_matmul_block_scaled_sm100_dispatch(a_format=a, b_format=b, n=256, k=256,
                                                   num_active_experts=1, estimated_total_m=1)


@pytest.mark.parametrize("pair, route", [
    (("mxfp8_e5m2", "mxfp8_e5m2"), ("mxfp8", "mxfp8")),
    (("bf16", "mxfp4"), ("mxfp8", "mxfp4")),   # W4A16 takes W4A8's decision
    (("bf16", "nvfp4"), ("mxfp8", "mxfp4")),
    (("nvfp4", "nvfp4"), ("nvfp4", "nvfp4")), (("mxfp8", "mxfp4"), ("mxfp8", "mxfp4")),
])
def test_route_formats_maps_the_pairs_without_an_sm100_row(pair, route):
    assert d.route_formats(*pair) == route
    assert route in d.SUPPORTED_FORMAT_PAIRS


@pytest.mark.parametrize("fmt, regime, decided", [("w4a16", DECODE, DECODE), ("w4a16_nvfp4", LARGE, LARGE),
                                                  ("mxfp8_e5m2", SMALL, "default")])   # MXFP8: no regime table
def test_dispatch_for_a_routed_problem_is_the_route_pairs_decision(fmt, regime, decided):
    from types import SimpleNamespace

    from gbs.problem import resolve_formats

    a_format, b_format = resolve_formats(fmt)
    meta = SimpleNamespace(a_format=a_format, b_format=b_format, n=4096, k=7168, num_active_experts=8,
                           estimated_total_m=tokens_for(regime, 8))
    route = d.route_formats(a_format.name, b_format.name)
    cfg = d.dispatch_for(meta)
    assert (cfg.a_format, cfg.b_format) == route and cfg.regime == decided
    assert cfg == grouped_matmul_block_scaled_sm100_dispatch(a_format=route[0], b_format=route[1], n=4096, k=7168,
                                                            num_active_experts=8,
                                                            estimated_total_m=tokens_for(regime, 8))
    with pytest.raises(ValueError, match="bf16 tokens have no SM100 route" if a_format.name == "bf16" else "E5M2"):
        grouped_matmul_block_scaled_sm100_dispatch(a_format=a_format, b_format=b_format, n=4096, k=7168,
                                                   num_active_experts=8, estimated_total_m=64)


def test_mxfp8_dispatch_rejects_other_weight_formats():
    with pytest.raises(ValueError, match="unsupported operand formats"):
        grouped_matmul_mxfp8_dispatch(n=256, k=256, num_active_experts=1, estimated_total_m=1,
                                      b_format="nvfp4")


# ------------------------------------------------------------------------------------ override
def enumerate_legal_overrides():
    """(ab_swapped, mma_bn, cta_group, stages, expected stages, expected max)."""
    for cg, bns in LEGAL_MMA_BN.items():
        for bn in bns:
            for swapped in ((True,) if cg == 2 else (True, False)):
                max_stages = auto_pipeline_stages(mma_bn=bn, cta_group=cg, ab_swapped=swapped,
                                                  num_sf_k_tiles=4)
                yield swapped, bn, cg, -1, max_stages, max_stages
                yield swapped, bn, cg, 1, 1, max_stages
                yield swapped, bn, cg, max_stages, max_stages, max_stages


@pytest.mark.parametrize("swapped, bn, cg, stages, expected, max_stages",
                         list(enumerate_legal_overrides()))
def test_override_passes_legal_values_through(swapped, bn, cg, stages, expected, max_stages):
    # The Kimi shape and a decode load would change every knob without override.
    cfg = grouped_matmul_nvfp4_dispatch(n=512, k=7168, num_active_experts=8, estimated_total_m=8,
                                        override=True, ab_swapped=swapped, mma_bn=bn,
                                        cta_group=cg, num_pipeline_stages=np.int32(stages))
    assert knobs(cfg) == (swapped, bn, cg)
    assert (cfg.num_pipeline_stages, cfg.max_pipeline_stages) == (expected, max_stages)
    assert (cfg.regime, cfg.rule, cfg.stages_source) == ("override", "override", "override")


def test_override_known_auto_values():
    # spec table: NVFP4 default config (128, cg1, not swapped) -> 5; decode tile -> 10.
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=0,
                                        override=True, ab_swapped=False, mma_bn=128, cta_group=1)
    assert cfg.num_pipeline_stages == 5
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=0,
                                        override=True)
    assert (knobs(cfg), cfg.num_pipeline_stages) == ((True, 8, 1), 10)


def enumerate_illegal_overrides():
    """(ab_swapped, mma_bn, cta_group, stages, error type, message fragment)."""
    yield True, 8, 3, -1, ValueError, "cta_group must be one of"
    yield True, 8, 0, -1, ValueError, "cta_group must be >= 1"
    for bn in (0, 7, 24, 48, 96, 512):
        yield True, bn, 1, -1, ValueError, "mma_bn"
    for bn in (8, 16, 32, 48, 192):
        yield True, bn, 2, -1, ValueError, "illegal with cta_group=2"
    for bn in (64, 128, 256):
        yield False, bn, 2, -1, ValueError, "requires ab_swapped=True"
    for stages in (0, -2, -100):
        yield True, 8, 1, stages, ValueError, "positive int or -1"
    yield True, 8, 1, 11, ValueError, "exceeds the auto maximum 10"
    yield True, 64, 2, 9, ValueError, "exceeds the auto maximum 8"
    yield True, 256, 1, 100, ValueError, "exceeds the auto maximum"
    yield True, 8.0, 1, -1, TypeError, "mma_bn must be an int"
    yield True, True, 1, -1, TypeError, "mma_bn must be an int"
    yield True, 8, 1.0, -1, TypeError, "cta_group must be an int"
    yield 1, 8, 1, -1, TypeError, "ab_swapped must be a bool"
    yield True, 8, 1, 6.0, TypeError, "num_pipeline_stages must be an int"
    yield True, 8, 1, None, TypeError, "num_pipeline_stages must be an int"


@pytest.mark.parametrize("swapped, bn, cg, stages, error, message",
                         list(enumerate_illegal_overrides()))
def test_override_rejects_illegal(swapped, bn, cg, stages, error, message):
    with pytest.raises(error, match=message):
        grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8,
                                      override=True, ab_swapped=swapped, mma_bn=bn, cta_group=cg,
                                      num_pipeline_stages=stages)


@pytest.mark.parametrize("swapped, bn, cg, stages, error, message",
                         list(enumerate_illegal_overrides()))
def test_check_config_rejects_illegal(swapped, bn, cg, stages, error, message):
    with pytest.raises(error, match=message):
        check_config(ab_swapped=swapped, mma_bn=bn, cta_group=cg, num_pipeline_stages=stages,
                     num_sf_k_tiles=4)


@pytest.mark.parametrize("regime", [DECODE, SMALL, LARGE])
def test_without_override_the_four_knobs_are_ignored(regime):
    m = tokens_for(regime, 8)
    plain = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8,
                                          estimated_total_m=m)
    # Illegal, even ill-typed knobs do not matter when override=False.
    ignored = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8,
                                            estimated_total_m=m, ab_swapped=False, mma_bn=7,
                                            cta_group=5, num_pipeline_stages=1000)
    assert ignored == plain


def test_override_must_be_bool():
    with pytest.raises(TypeError, match="override must be a bool"):
        grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8,
                                      override=1)


# ------------------------------------------------------------------------------ derived fields
@pytest.mark.parametrize("swapped, bn, cg, accum", [
    (True, 8, 1, 2), (False, 128, 1, 2), (True, 256, 1, 1), (True, 64, 2, 2), (True, 128, 2, 2),
    (True, 256, 2, 1),
])
def test_derived_fields(swapped, bn, cg, accum):
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8,
                                        override=True, ab_swapped=swapped, mma_bn=bn,
                                        cta_group=cg)
    assert cfg.mma_shape == (128 * cg, bn, 32)
    assert cfg.cluster_shape == (cg, 1, 1)
    assert cfg.num_accum_pipeline_stages == accum
    assert (cfg.mma_kind, cfg.num_sf_k_tiles, cfg.k_tile_elements) == ("mxf4nvf4", 4, 256)
    terms = cfg.smem_terms()
    assert terms.budget // terms.per_stage == cfg.max_pipeline_stages


def test_config_records_inputs_and_is_frozen():
    cfg = grouped_matmul_nvfp4_dispatch(n=np.int64(7168), k=np.int32(2048),
                                        num_active_experts=np.uint16(32),
                                        estimated_total_m=np.int64(1000))
    assert (cfg.n, cfg.k, cfg.num_active_experts, cfg.estimated_total_m, cfg.smem_per_sm) == (
        7168, 2048, 32, 1000, B200_SMEM_PER_SM)
    assert all(type(v) is int for v in (cfg.n, cfg.k, cfg.num_active_experts))
    with pytest.raises(AttributeError):
        cfg.mma_bn = 16


def test_config_constructor_validates():
    common = dict(a_format="nvfp4", b_format="nvfp4", stages_source="auto", regime="default",
                  rule="default", n=256, k=256, num_active_experts=1, estimated_total_m=1,
                  smem_per_sm=B200_SMEM_PER_SM)
    with pytest.raises(ValueError, match="illegal with cta_group=2"):
        d.KernelConfig(ab_swapped=True, mma_bn=8, cta_group=2, num_pipeline_stages=4, **common)
    with pytest.raises(ValueError, match="regime must be one of"):
        d.KernelConfig(ab_swapped=True, mma_bn=8, cta_group=1, num_pipeline_stages=4,
                       **{**common, "regime": "prefill"})


# ----------------------------------------------------------------------------- explain()
def test_explain_decode_comparison_and_stage_rule():
    cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=64,
                                        estimated_total_m=256)
    text = cfg.explain()
    assert "estimated_total_m=256 <= 64 slots x 8 = 512 -> decode" in text
    assert "regime table" in text and "DECODE_DEFAULT_STAGES = 6" in text


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(n=4096, k=7168, estimated_total_m=513),
     ["513 > 64 slots x 8 = 512 and <= 64 slots x 64 = 4096 -> small_prefill",
      "NVFP4_TUNED_STAGES row", "(4096, 7168, 64, 6)"]),
    (dict(n=4096, k=7168, estimated_total_m=4097),
     ["4097 > 64 slots x 64 = 4096 -> large_prefill", "(4096, 7168, -1, 7)"]),
    (dict(n=2048, k=4096, estimated_total_m=600),
     ["no NVFP4_TUNED_STAGES row", "215700 B // 24608 B per stage = 8"]),
    (dict(n=512, k=7168, estimated_total_m=512),
     ["Kimi K2.5 rule", "mma_bn=64 since estimated_total_m=512 <= 64 slots x 8 = 512",
      "-> decode", "Kimi rule fixes 6 stages"]),
    (dict(n=512, k=7168, estimated_total_m=100, override=True, mma_bn=16),
     ["override=True", "no regime, tuned table or Kimi rule", "num_pipeline_stages=-1 -> auto"]),
    (dict(n=512, k=7168, estimated_total_m=100, override=True, num_pipeline_stages=3),
     ["the caller's num_pipeline_stages=3"]),
])
def test_explain_names_the_rule(kwargs, fragments):
    text = grouped_matmul_nvfp4_dispatch(num_active_experts=64, **kwargs).explain()
    for fragment in fragments:
        assert fragment in text


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n=6144, k=6144, estimated_total_m=8), "MXFP8_TUNED_DECODE_STAGES row"),
    (dict(n=6144, k=6144, estimated_total_m=8, fuse_swiglu=True), "fused SwiGLU"),
    (dict(n=2048, k=4096, estimated_total_m=8), "no MXFP8_TUNED_DECODE_STAGES row"),
    (dict(n=6144, k=6144, estimated_total_m=9), "MXFP8 tunes decode only"),
])
def test_explain_mxfp8_stage_rule(kwargs, fragment):
    assert fragment in grouped_matmul_mxfp8_dispatch(num_active_experts=1, **kwargs).explain()


# ---------------------------------------------------------------------------- input validation
def enumerate_bad_inputs():
    """(overrides of a valid NVFP4 call, error type, message fragment)."""
    yield dict(n=0), ValueError, "n must be >= 1"
    yield dict(n=-128), ValueError, "n must be >= 1"
    yield dict(n=4096.0), TypeError, "n must be an int"
    yield dict(n=np.float64(4096)), TypeError, "n must be an int"
    yield dict(n=True), TypeError, "n must be an int"
    yield dict(n="4096"), TypeError, "n must be an int"
    yield dict(k=0), ValueError, "k must be >= 1"
    yield dict(k=7160), ValueError, "multiple of the nvfp4 scale block size 16"
    yield dict(k=np.float32(7168)), TypeError, "k must be an int"
    yield dict(num_active_experts=0), ValueError, "num_active_experts must be >= 1"
    yield dict(num_active_experts=np.bool_(True)), TypeError, "num_active_experts must be an int"
    yield dict(estimated_total_m=-1), ValueError, "estimated_total_m must be >= 0"
    yield dict(estimated_total_m=1.5), TypeError, "estimated_total_m must be an int"
    yield dict(smem_per_sm=0), ValueError, "smem_per_sm must be >= 1"
    yield dict(smem_per_sm=2e5), TypeError, "smem_per_sm must be an int"


@pytest.mark.parametrize("bad, error, message", list(enumerate_bad_inputs()))
def test_bad_inputs(bad, error, message):
    args = dict(n=4096, k=7168, num_active_experts=8, estimated_total_m=8)
    with pytest.raises(error, match=message):
        grouped_matmul_nvfp4_dispatch(**{**args, **bad})


def test_k_block_size_depends_on_format():
    # K=48: a multiple of NVFP4's 16, not of the MX formats' 32.
    grouped_matmul_nvfp4_dispatch(n=256, k=48, num_active_experts=1, estimated_total_m=1)
    with pytest.raises(ValueError, match="mxfp8 scale block size 32"):
        grouped_matmul_mxfp8_dispatch(n=256, k=48, num_active_experts=1, estimated_total_m=1)
    with pytest.raises(ValueError, match="mxfp4 scale block size 32"):
        grouped_matmul_block_scaled_sm100_dispatch(a_format="mxfp4", b_format="mxfp4", n=256,
                                                   k=48, num_active_experts=1,
                                                   estimated_total_m=1)


def test_fuse_swiglu_must_be_bool():
    with pytest.raises(TypeError, match="fuse_swiglu must be a bool"):
        grouped_matmul_mxfp8_dispatch(n=256, k=256, num_active_experts=1, estimated_total_m=1,
                                      fuse_swiglu="yes")


# ---------------------------------------------------------------------------- property test
PAIRS = list(d.SUPPORTED_FORMAT_PAIRS)


def _assert_legal(cfg):
    resolved = check_config(ab_swapped=cfg.ab_swapped, mma_bn=cfg.mma_bn,
                            cta_group=cfg.cta_group, num_pipeline_stages=cfg.num_pipeline_stages,
                            num_sf_k_tiles=cfg.num_sf_k_tiles, smem_per_sm=cfg.smem_per_sm)
    assert resolved == cfg.num_pipeline_stages
    assert 1 <= cfg.num_pipeline_stages <= cfg.max_pipeline_stages
    assert cfg.max_pipeline_stages == auto_pipeline_stages(
        mma_bn=cfg.mma_bn, cta_group=cfg.cta_group, ab_swapped=cfg.ab_swapped,
        num_sf_k_tiles=cfg.num_sf_k_tiles, smem_per_sm=cfg.smem_per_sm)
    assert cfg.mma_bn in LEGAL_MMA_BN[cfg.cta_group]
    assert cfg.cta_group == 1 or cfg.ab_swapped


@settings(max_examples=300, deadline=None)
@given(pair=st.sampled_from(PAIRS),
       n=st.integers(1, 65536),
       k_blocks=st.integers(1, 1024),
       slots=st.integers(1, 1024),
       m_per_slot=st.integers(0, 300),
       m_extra=st.integers(0, 1023),
       smem=st.one_of(st.sampled_from([B200_SMEM_PER_SM, H200_SMEM_PER_SM]),
                      st.integers(60_000, 300_000)),
       fuse=st.booleans())
def test_property_dispatch_is_always_legal(pair, n, k_blocks, slots, m_per_slot, m_extra, smem,
                                           fuse):
    args = dict(n=n, k=32 * k_blocks, num_active_experts=slots,
                estimated_total_m=slots * m_per_slot + m_extra % slots, smem_per_sm=smem)
    try:
        if pair == ("mxfp8", "mxfp4") or (pair == ("mxfp8", "mxfp8") and fuse):
            cfg = grouped_matmul_mxfp8_dispatch(fuse_swiglu=fuse, b_format=pair[1], **args)
        else:
            cfg = grouped_matmul_block_scaled_sm100_dispatch(a_format=pair[0], b_format=pair[1],
                                                             **args)
    except ValueError as err:
        # Only a small budget may refuse: a B200-tuned stage count or even one stage not fitting.
        assert smem < H200_SMEM_PER_SM
        assert "does not fit" in str(err) or "too small" in str(err)
        return
    _assert_legal(cfg)
    assert (cfg.a_format, cfg.b_format) == pair
    if cfg.stages_source == "auto":
        assert cfg.num_pipeline_stages == cfg.max_pipeline_stages


@settings(max_examples=300, deadline=None)
@given(swapped=st.booleans(), bn=st.sampled_from([0, 8, 16, 24, 32, 64, 96, 128, 256, 512]),
       cg=st.integers(0, 3), stages=st.integers(-3, 14),
       smem=st.integers(60_000, 300_000))
def test_property_override_is_legal_or_rejected(swapped, bn, cg, stages, smem):
    legal_tile = cg in LEGAL_MMA_BN and bn in LEGAL_MMA_BN[cg] and (cg == 1 or swapped)
    try:
        cfg = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8,
                                            estimated_total_m=100, override=True,
                                            ab_swapped=swapped, mma_bn=bn, cta_group=cg,
                                            num_pipeline_stages=stages, smem_per_sm=smem)
    except ValueError:
        if legal_tile and (stages == -1 or stages >= 1):
            max_stages = pipeline_smem_terms(mma_bn=bn, cta_group=cg, ab_swapped=swapped,
                                             num_sf_k_tiles=4, smem_per_sm=smem).stages
            assert max_stages < 1 or stages > max_stages
        return
    assert legal_tile and (stages == -1 or stages >= 1)
    _assert_legal(cfg)
    assert knobs(cfg) == (swapped, bn, cg)
    assert cfg.num_pipeline_stages == (stages if stages > 0 else cfg.max_pipeline_stages)
