"""Ablation rows and derived dispatch tables (gbs.lab.ablation_data): CSV schema and validation, modelled
sweeps, the derivation rule on synthetic rows with a known answer, the upstream table, and the
side-by-side comparison with its disagreements.
"""
from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest

from gbs.lab import ablation_data as ab
from gbs.lab import perfmodel as pm
from gbs.dispatch import REGIME_CONFIGS, grouped_matmul_nvfp4_dispatch
from gbs.numba_kernels import h200_launch, h200_ring
from gbs.schedule import TileConfig

DEEPSEEK_UP = (4096, 7168)
KIMI_UP = (512, 7168)
TOKENS = (2, 8, 32, 64, 256)          # decode, decode, small prefill, small prefill, large prefill
BN8 = TileConfig(True, 8, 1)
BN64_PAIR = TileConfig(True, 64, 2)
BN128_PAIR = TileConfig(True, 128, 2)
MEASURED = dict(gpu="h200", gpu_name="NVIDIA H200", source="measured", date="2026-11-29", commit="abc1234",
                bandwidth_ceiling_tbs=4.30, mma_ceiling_tflops=766.0)


def key(n_k=DEEPSEEK_UP, tokens=4, slots=8, routing="uniform", fmt="nvfp4"):
    return ab.ProblemKey(fmt, n_k[0], n_k[1], routing, slots, slots * tokens)


def measured_row(problem=None, config=pm.ModelConfig(True, 8, 1, 4), median=10.0, **overrides):
    fields = dict(MEASURED, median_us=median, p10_us=median * 0.98, p90_us=median * 1.03)
    fields.update(overrides)
    return ab.make_row(problem or key(), config, **fields)


# ----------------------------------------------------------------------------------------------
# Problems and rows
# ----------------------------------------------------------------------------------------------
def test_routing_for_names_a_reproducible_problem():
    uniform = ab.routing_for("uniform", 8, 30)
    assert uniform.group_sizes.tolist() == [4, 4, 4, 4, 4, 4, 3, 3]
    assert uniform.expert_ids.tolist() == list(range(8))
    ragged = ab.routing_for("ragged", 16, 500)
    assert ragged.group_sizes.sum() == 500 and len(set(ragged.group_sizes.tolist())) > 3
    assert np.array_equal(ragged.group_sizes, ab.routing_for("ragged", 16, 500).group_sizes)
    with pytest.raises(ValueError, match="top-k routing decides the slot count"):
        ab.routing_for("topk", 8, 64)
    shape = ab.problem_shape(key(tokens=4, slots=8))
    assert shape.group_sizes == (4,) * 8 and shape.regime == "decode"


def test_sweep_problems_cover_the_grid_and_skip_oversized_loads():
    keys = ab.sweep_problems("nvfp4", shapes=[DEEPSEEK_UP], tokens_per_expert=(1, 4096), num_active_experts=(8, 64),
                             routings=("uniform", "ragged"))
    assert len(keys) == 2 * 3          # 64 x 4096 tokens exceeds MAX_SWEEP_TOTAL_TOKENS
    assert {k.routing for k in keys} == {"uniform", "ragged"} and max(k.total_tokens for k in keys) == 8 * 4096
    assert {(k.n, k.k) for k in ab.sweep_problems("mxfp8", tokens_per_expert=(1,))} == set(ab.FP8_SHAPES)


def test_legal_configs_are_every_knob_set_and_stage_count():
    configs = ab.legal_configs("nvfp4", pm.B200)
    tiles = {c.tile_config for c in configs}
    assert len(tiles) == 6 * 2 + 3          # cta_group 1: 6 mma_bn x swapped or not; cta_group 2: 3, swapped
    for tile in tiles:
        stages = sorted(c.stages for c in configs if c.tile_config == tile)
        assert stages == list(range(1, pm.B200.max_stages("nvfp4", tile) + 1))
    assert max(c.stages for c in configs if c.tile_config == BN128_PAIR) == 7     # spec: NVFP4 large prefill auto


def test_make_row_fills_the_derived_columns():
    row = measured_row(key(tokens=32), median=20.0)
    assert row.avg_m == 32.0 and row.regime == "small_prefill" and row.total_tokens == 256
    assert row.tflops == pytest.approx(2 * 256 * 4096 * 7168 / 20e-6 / 1e12)
    weights = 8 * 4096 * (7168 // 2 + 7168 // 16)
    tokens = 256 * (7168 // 2 + 7168 // 16)
    assert row.gbps == pytest.approx((weights + tokens + 256 * 4096 * 2) / 20e-6 / 1e9)
    assert row.mma_ceiling_fraction == pytest.approx(row.tflops / 766.0)
    assert row.bandwidth_ceiling_fraction == pytest.approx(row.gbps / 4300.0)


def test_csv_round_trip(tmp_path):
    rows = ab.model_rows(pm.B200, [key(tokens=4), key(KIMI_UP, tokens=100, routing="ragged")],
                         configs=[pm.ModelConfig(True, 8, 1, 6), pm.ModelConfig(False, 128, 1, 5)], commit="abc1234")
    rows.append(measured_row())
    path = tmp_path / "data" / "ablations.csv"
    ab.write_ablations(str(path), rows)
    with open(path, newline="") as f:
        assert tuple(next(csv.reader(f))) == ab.ABLATION_COLUMNS
    assert ab.read_ablations(str(path)) == rows


@pytest.mark.parametrize("change, match", [
    (dict(source="guess"), "source must be one of"),
    (dict(gpu_name=""), "must name the GPU"),
    (dict(commit="unknown"), "must record the commit"),
    (dict(regime="decode"), "does not match the dispatch's classification"),
    (dict(avg_m=5.0), "avg_m = 5.0 but"),
    (dict(p10_us=11.0), "p10 <= median <= p90"),
    (dict(median_us=0.0), "median_us must be finite and > 0"),
    (dict(ab_swapped=False), "cta_group=2 requires ab_swapped"),
    (dict(mma_bn=8), "mma_bn=8 is illegal with cta_group=2"),
    # past both the H200 kernel's ring (7) and the SM100 formula's (8)
    (dict(stages=9), r"9 stages exceed the H200 kernel's maximum 7 .*and the SM100 formula's 8"),
    (dict(date="29/11/2026"), "ISO date"),
    (dict(routing="topk"), "routing must be one of"),
    (dict(format="fp16"), "format must be one of"),
    (dict(gpu="H200"), "lower-case id"),
    (dict(config_source="tuned"), "config_source must be one of"),
    (dict(stages_source="sweep"), "stages_source must be one of"),
    (dict(num_active_experts=True), "must be an int"),
])
def test_rows_reject_invalid_fields(change, match):
    row = measured_row(key(tokens=32), pm.ModelConfig(True, 64, 2, 6))
    with pytest.raises((ValueError, TypeError), match=match):
        dataclasses.replace(row, **change)


# W4A8 small-prefill knobs (upstream's 64-column pair): the H200 kernel's stage (128-K slices of packed FP4
# weights, the pair's 32 token rows per CTA) is far smaller than the SM100 formula's, so its ring is deeper than the
# formula allows. (W4A8's decode tiles take 256-K slices since evidence w4a8-k256: within the formula.)
W4A8_TILE = BN64_PAIR
W4A8_KEY = key(tokens=32, fmt="w4a8")
W4A8_KERNEL_MAX = h200_launch.max_pipeline_stages(h200_ring.StreamSpec("mxfp8", "mxfp4", True, 64, 2, 1))
W4A8_FORMULA_MAX = pm.H200.max_stages("w4a8", W4A8_TILE)


def w4a8_config(stages: int) -> pm.ModelConfig:
    return pm.ModelConfig(True, 64, 2, stages)


def test_stage_limits_per_gpu_and_source():
    assert W4A8_KERNEL_MAX > W4A8_FORMULA_MAX
    assert ab.row_max_stages("h200", "measured", "w4a8", W4A8_TILE) == W4A8_KERNEL_MAX
    assert ab.row_max_stages("h200", "model", "w4a8", W4A8_TILE) == W4A8_FORMULA_MAX
    assert ab.row_max_stages("b200", "measured", "w4a8", W4A8_TILE) == pm.B200.max_stages("w4a8", W4A8_TILE)
    # the NVFP4 large-prefill pair: the kernel holds the whole token tile in both CTAs, one stage less
    assert (ab.row_max_stages("h200", "measured", "nvfp4", BN128_PAIR),
            ab.row_max_stages("h200", "model", "nvfp4", BN128_PAIR)) == (6, 7)
    assert ab.row_max_stages("mi300", "measured", "nvfp4", BN8) is None


def test_measured_h200_rows_are_bounded_by_the_kernel_not_the_formula():
    deepest = w4a8_config(W4A8_KERNEL_MAX)
    row = measured_row(W4A8_KEY, deepest)
    assert row.stages == W4A8_KERNEL_MAX
    with pytest.raises(ValueError, match=rf"{W4A8_KERNEL_MAX + 1} stages exceed the H200 kernel's maximum "
                                         rf"{W4A8_KERNEL_MAX} for w4a8 bn64/cg2/sw .*formula's {W4A8_FORMULA_MAX}"):
        dataclasses.replace(row, stages=W4A8_KERNEL_MAX + 1)
    # within the formula (7) though past today's kernel (6): a row an earlier kernel layout ran, kept
    assert measured_row(key(tokens=256), pm.ModelConfig(True, 128, 2, 7)).stages == 7
    with pytest.raises(ValueError, match="exceed the H200 kernel's maximum 6 for nvfp4 bn128/cg2/sw .*formula's 7"):
        measured_row(key(tokens=256), pm.ModelConfig(True, 128, 2, 8))


def test_modelled_and_other_gpu_rows_keep_the_formula_limit():
    row = measured_row(W4A8_KEY, w4a8_config(W4A8_KERNEL_MAX))
    with pytest.raises(ValueError, match=rf"{W4A8_KERNEL_MAX} stages exceed the h200 maximum {W4A8_FORMULA_MAX} "
                                         r"for w4a8 bn64/cg2/sw \(the SM100 stage formula"):
        dataclasses.replace(row, source="model")
    b200_max = pm.B200.max_stages("w4a8", W4A8_TILE)
    with pytest.raises(ValueError, match=f"exceed the b200 maximum {b200_max}"):
        dataclasses.replace(row, gpu="b200", stages=b200_max + 1)
    model_pair = dataclasses.replace(measured_row(key(tokens=256), pm.ModelConfig(True, 128, 2, 6)),
                                     source="model", stages=7)
    assert model_pair.stages == 7


def test_model_rows_need_no_gpu_name_or_commit():
    row = dataclasses.replace(measured_row(), source="model", gpu_name="", commit="")
    assert row.source == "model"


def test_reading_names_the_bad_line_and_the_bad_header(tmp_path):
    path = tmp_path / "rows.csv"
    rows = [measured_row(), measured_row(median=12.0)]
    ab.write_ablations(str(path), rows)
    text = path.read_text().splitlines()
    text[2] = text[2].replace(",True,", ",maybe,", 1)
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"line 3: column ab_swapped: expected True or False"):
        ab.read_ablations(str(path))
    path.write_text("gpu,format,extra\n")
    with pytest.raises(ValueError, match=r"missing \['n', 'k'.*unexpected \['extra'\]"):
        ab.read_ablations(str(path))


def test_model_rows_mark_the_dispatch_pick_and_auto_stages():
    problems = [key(tokens=t) for t in (4, 32, 256)] + [key(KIMI_UP, tokens=4)]
    rows = ab.model_rows(pm.B200, problems, commit="abc1234")
    assert len(rows) == len(problems) * len(ab.legal_configs("nvfp4", pm.B200))
    for problem in problems:
        picked = [r for r in rows if r.key == problem and r.config_source == "dispatch"]
        want = pm.ModelConfig.of(ab.dispatch_config(problem, pm.B200.smem_per_sm))
        assert [r.config for r in picked] == [want]
    for row in rows:
        at_max = row.stages == pm.B200.max_stages("nvfp4", row.config.tile_config)
        assert row.stages_source == ("auto" if at_max else "override")
        assert row.source == "model" and row.gpu == "b200" and row.median_us == row.p10_us == row.p90_us


# ----------------------------------------------------------------------------------------------
# Derived tables on synthetic rows with a known answer
# ----------------------------------------------------------------------------------------------
# Relative time of each knob set per regime; the Kimi shape prefers the pair in decode.
KNOB_FACTOR = {
    "decode": {BN8: 1.0, BN64_PAIR: 1.3, BN128_PAIR: 1.6},
    "small_prefill": {BN8: 1.4, BN64_PAIR: 1.0, BN128_PAIR: 1.2},
    "large_prefill": {BN8: 2.0, BN64_PAIR: 1.2, BN128_PAIR: 1.0},
}
KIMI_DECODE_FACTOR = {BN8: 1.0, BN64_PAIR: 0.9, BN128_PAIR: 1.6}
# Relative time per stage count: decode fastest at 4, 3 within 2 %; prefill fastest at 6, 5 within 2 %.
STAGE_FACTOR = {
    "decode": {2: 1.10, 3: 1.015, 4: 1.0, 5: 1.005, 6: 1.01},
    "prefill": {2: 1.20, 3: 1.10, 4: 1.05, 5: 1.01, 6: 1.0},
}


def synthetic_rows():
    rows = []
    for n_k in (DEEPSEEK_UP, KIMI_UP):
        for tokens in TOKENS:
            problem = key(n_k, tokens)
            regime = problem.regime
            knobs = KIMI_DECODE_FACTOR if (n_k, regime) == (KIMI_UP, "decode") else KNOB_FACTOR[regime]
            stage_factor = STAGE_FACTOR["decode" if regime == "decode" else "prefill"]
            for tile, factor in knobs.items():
                for stages, s_factor in stage_factor.items():
                    config = pm.ModelConfig(tile.ab_swapped, tile.mma_bn, tile.cta_group, stages)
                    rows.append(measured_row(problem, config, median=0.1 * problem.total_tokens * factor * s_factor))
    return rows


def test_derived_table_on_synthetic_rows_fastest_rule():
    table = ab.derive_dispatch_table(synthetic_rows(), rule="fastest", label="H200 measured")
    assert {r: c.config for r, c in table.regime_configs.items()} == {
        "decode": BN8, "small_prefill": BN64_PAIR, "large_prefill": BN128_PAIR}
    assert table.regime_configs["decode"].wins == 2 and table.regime_configs["decode"].num_problems == 4
    up = table.entry(*DEEPSEEK_UP, "decode")
    assert (up.config, up.stages, up.special) == (BN8, 4, False)
    assert dict(up.stage_slowdowns)[6] == pytest.approx(1.01)
    kimi = table.entry(*KIMI_UP, "decode")
    assert (kimi.config, kimi.stages, kimi.special) == (BN64_PAIR, 4, True)
    assert "the regime config bn8/cg1/sw is x1.111 slower here" in kimi.evidence
    for n_k in (DEEPSEEK_UP, KIMI_UP):
        assert table.entry(*n_k, "small_prefill").stages == 6 and table.entry(*n_k, "large_prefill").stages == 6
        assert table.entry(*n_k, "large_prefill").config == BN128_PAIR
    assert [b.label() for b in table.shape_boundaries(*DEEPSEEK_UP)] == [
        "8|32: bn8/cg1/sw -> bn64/cg2/sw", "64|256: bn64/cg2/sw -> bn128/cg2/sw"]
    assert [b.label() for b in table.shape_boundaries(*KIMI_UP)] == ["64|256: bn64/cg2/sw -> bn128/cg2/sw"]


def test_within_rule_takes_fewer_stages_inside_the_tolerance():
    within = ab.derive_dispatch_table(synthetic_rows(), rule="within", tolerance=0.02)
    assert within.entry(*DEEPSEEK_UP, "decode").stages == 3
    assert within.entry(*DEEPSEEK_UP, "large_prefill").stages == 5
    assert within.entry(*DEEPSEEK_UP, "large_prefill").stages_source == "tuned"
    exact = ab.derive_dispatch_table(synthetic_rows(), rule="within", tolerance=0.0)
    assert exact.entry(*DEEPSEEK_UP, "decode").stages == 4


def test_boundaries_ignore_near_ties():
    rows = []
    for tokens in TOKENS:
        for tile, factor in ((BN8, 1.0), (BN64_PAIR, 1.01 if tokens < 64 else 0.995)):
            config = pm.ModelConfig(tile.ab_swapped, tile.mma_bn, tile.cta_group, 4)
            rows.append(measured_row(key(tokens=tokens), config, median=float(tokens) * factor))
    table = ab.derive_dispatch_table(rows, tolerance=0.02)
    # bn64 pair wins by 0.5 % at 64 and 256 tokens: within 2 % of bn8, the incumbent stays.
    assert table.shape_boundaries(*DEEPSEEK_UP) == ()
    assert len(ab.derive_dispatch_table(rows, tolerance=0.0).shape_boundaries(*DEEPSEEK_UP)) == 1


def test_tied_knob_sets_go_to_the_least_padded_tile():
    rows = []
    for tokens in (16, 32):
        for tile, factor in ((BN64_PAIR, 1.0), (TileConfig(True, 32, 1), 1.01), (TileConfig(True, 64, 1), 1.0)):
            config = pm.ModelConfig(tile.ab_swapped, tile.mma_bn, tile.cta_group, 4)
            rows.append(measured_row(key(tokens=tokens), config, median=10.0 * factor))
    # bn32 is 1 % slower: a tie within 2 %, and it pads 32 tokens per tile instead of 64.
    assert ab.derive_dispatch_table(rows).regime_configs["small_prefill"].config == TileConfig(True, 32, 1)
    # Without the tolerance the two fastest tie exactly: the pair wins, it loads half the token bytes per row.
    assert ab.derive_dispatch_table(rows, tolerance=0.0).regime_configs["small_prefill"].config == BN64_PAIR


def w4a8_prefill_rows(source="measured"):
    """Measured H200 rows where W4A8 small prefill gets faster with every stage, up to the row's limit."""
    deepest = ab.row_max_stages("h200", source, "w4a8", W4A8_TILE)
    return [measured_row(key(tokens=t, fmt="w4a8"), w4a8_config(s), median=10.0 + 1.0 / s,
                         source=source) for t in (32, 64) for s in (2, W4A8_FORMULA_MAX, deepest)]


def test_the_kernels_deepest_ring_is_labelled_auto():
    measured = ab.derive_dispatch_table(w4a8_prefill_rows()).entry(*DEEPSEEK_UP, "small_prefill")
    assert (measured.stages, measured.stages_source) == (W4A8_KERNEL_MAX, "auto")
    # the formula's deepest is not the kernel's: a tuned stage count for the H200 kernel
    tuned = ab.derive_dispatch_table([r for r in w4a8_prefill_rows() if r.stages <= W4A8_FORMULA_MAX])
    entry = tuned.entry(*DEEPSEEK_UP, "small_prefill")
    assert (entry.stages, entry.stages_source) == (
        W4A8_FORMULA_MAX, "tuned")
    # modelled rows: the formula's deepest is auto
    modelled = ab.derive_dispatch_table(w4a8_prefill_rows("model")).entry(*DEEPSEEK_UP, "small_prefill")
    assert (modelled.stages, modelled.stages_source) == (W4A8_FORMULA_MAX, "auto")


def test_comparison_says_when_a_measured_ring_is_past_the_model():
    upstream = ab.upstream_table("w4a8", shapes=[DEEPSEEK_UP], tokens_per_expert=(32, 64))
    h200 = ab.derive_dispatch_table(w4a8_prefill_rows(), label="H200 measured")
    b200 = ab.derive_dispatch_table(ab.model_rows(pm.B200, [W4A8_KEY], configs=[
        w4a8_config(4), w4a8_config(pm.B200.max_stages("w4a8", W4A8_TILE))], commit="abc1234"), label="B200 model")
    (stages,) = [d for d in ab.compare_tables(upstream, h200, b200).disagreements
                 if d.table == "H200 measured" and d.field == "stages"]
    assert (stages.upstream, stages.derived) == (str(upstream.entry(*DEEPSEEK_UP, "small_prefill").stages),
                                                 str(W4A8_KERNEL_MAX))
    assert (f"bn64/cg2/sw x{W4A8_KERNEL_MAX} is within the table's stage limit but past the model's: its SM100 "
            f"stage formula allows at most {W4A8_FORMULA_MAX}") in stages.reason


@pytest.mark.parametrize("rows, kwargs, match", [
    ([], {}, "at least one ablation row"),
    (None, dict(rule="best"), "rule must be one of"),
    (None, dict(tolerance=-0.1), "tolerance must be finite"),
    ("mixed-source", {}, "rows mix sources"),
    ("mixed-gpu", {}, "rows mix gpus"),
])
def test_derive_rejects_bad_input(rows, kwargs, match):
    base = synthetic_rows()[:10]
    if rows is None:
        rows = base
    elif rows == "mixed-source":
        rows = base + [dataclasses.replace(base[0], source="model")]
    elif rows == "mixed-gpu":
        rows = base + [dataclasses.replace(base[0], gpu="b200")]
    with pytest.raises(ValueError, match=match):
        ab.derive_dispatch_table(rows, **kwargs)


def test_upstream_table_is_the_dispatch():
    table = ab.upstream_table("nvfp4", shapes=[DEEPSEEK_UP, KIMI_UP, (2048, 4096)], tokens_per_expert=TOKENS)
    assert {r: (c.config.ab_swapped, c.config.mma_bn, c.config.cta_group)
            for r, c in table.regime_configs.items()} == REGIME_CONFIGS
    entry = table.entry(*DEEPSEEK_UP, "small_prefill")
    assert (entry.config, entry.stages, entry.stages_source) == (BN64_PAIR, 6, "tuned")
    assert table.entry(*DEEPSEEK_UP, "decode").stages_source == "decode-default"
    assert table.entry(2048, 4096, "small_prefill").stages_source == "auto"
    kimi = [table.entry(*KIMI_UP, r) for r in ("decode", "small_prefill", "large_prefill")]
    assert all(e.special and e.config.cta_group == 2 and e.stages == 6 for e in kimi)
    assert [b.label() for b in table.shape_boundaries(*KIMI_UP)] == ["8|32: bn64/cg2/sw -> bn128/cg2/sw"]
    assert [(b.avg_m_below, b.avg_m_above) for b in table.shape_boundaries(*DEEPSEEK_UP)] == [(8, 32), (64, 256)]
    config = grouped_matmul_nvfp4_dispatch(n=4096, k=7168, num_active_experts=8, estimated_total_m=8 * 256)
    assert table.entry(*DEEPSEEK_UP, "large_prefill").stages == config.num_pipeline_stages == 7


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comparison():
    shapes = [DEEPSEEK_UP, KIMI_UP]
    upstream = ab.upstream_table("nvfp4", shapes=shapes, tokens_per_expert=TOKENS)
    h200 = ab.derive_dispatch_table(synthetic_rows(), rule="fastest", label="H200 measured")
    b200_rows = ab.model_rows(pm.B200, [key(n_k, t) for n_k in shapes for t in TOKENS], commit="abc1234")
    b200 = ab.derive_dispatch_table(b200_rows, rule="within", label="B200 model")
    return ab.compare_tables(upstream, h200, b200), h200, b200


def test_comparison_lists_the_known_disagreements(comparison):
    result, _, _ = comparison
    h200 = {(d.n, d.k, d.regime, d.field): d for d in result.disagreements if d.table == "H200 measured"}
    assert set(h200) == {
        (*DEEPSEEK_UP, "decode", "stages"),            # 4 vs upstream's DECODE_DEFAULT_STAGES 6
        (*DEEPSEEK_UP, "large_prefill", "stages"),     # 6 vs the tuned 7
        (*KIMI_UP, "decode", "stages"),                # Kimi rule's 6
        (*KIMI_UP, "small_prefill", "config"),         # bn64 pair vs the Kimi rule's bn128 pair
        (*KIMI_UP, None, "boundaries"),                # switches at 64|256, upstream at 8|32
    }
    decode = h200[(*DEEPSEEK_UP, "decode", "stages")]
    assert (decode.upstream, decode.derived) == ("6", "4")
    assert "upstream's 6 stages: x1.010" in decode.reason and "NVIDIA H200 (model): bn8/cg1/sw x4" in decode.reason
    assert "prologue" in decode.reason
    # upstream's 7 stages do not fit the H200 kernel that timed the measured rows
    assert h200[(*DEEPSEEK_UP, "large_prefill", "stages")].reason.endswith(
        "bn128/cg2/sw x7 does not fit the H200 kernel's shared memory (at most 6 stages)")
    config = h200[(*KIMI_UP, "small_prefill", "config")]
    assert (config.upstream, config.derived) == ("bn128/cg2/sw", "bn64/cg2/sw")


def test_comparison_markdown_holds_every_table_and_disagreement(comparison):
    result, h200, b200 = comparison
    md = result.markdown
    for heading in ("### Regime configs", "### Knobs and stages per shape", "### Where the best knobs change",
                    "### Disagreements with upstream"):
        assert heading in md
    assert "| (4096, 7168) | decode | bn8/cg1/sw x6 (decode-default) | bn8/cg1/sw x4 (auto) |" not in md
    assert "| (4096, 7168) | decode | bn8/cg1/sw x6 (decode-default) | bn8/cg1/sw x4 (tuned) |" in md
    assert "*bn64/cg2/sw x4 (tuned)" in md                   # the Kimi exception of the synthetic rows
    for d in result.disagreements:
        assert d.line() in md and d.reason
    for d in (d for d in result.disagreements if d.table == "B200 model" and d.field in ("config", "stages")):
        assert "NVIDIA B200 (datasheet model):" in d.reason


def test_compare_rejects_tables_of_different_formats(comparison):
    _, h200, b200 = comparison
    other = ab.upstream_table("mxfp8", shapes=[DEEPSEEK_UP], tokens_per_expert=(2,))
    with pytest.raises(ValueError, match="different formats"):
        ab.compare_tables(other, h200, b200)
    with pytest.raises(TypeError, match="DispatchTables"):
        ab.compare_tables(other, h200, "b200")


# ----------------------------------------------------------------------------------------------
# Calibration from rows
# ----------------------------------------------------------------------------------------------
def test_calibrate_rows_fits_measured_rows():
    true = dataclasses.replace(pm.H200, bandwidth_fraction=0.8, dequant_cycles_per_element=0.02)
    rows = []
    for n_k in (DEEPSEEK_UP, KIMI_UP):
        for tokens in (1, 4, 32, 256):
            problem = key(n_k, tokens)
            for config in (pm.ModelConfig(True, 8, 1, 4), pm.ModelConfig(True, 64, 2, 6),
                           pm.ModelConfig(True, 128, 2, 3)):
                t = pm.model_config(ab.problem_shape(problem), config, true).time_us
                rows.append(measured_row(problem, config, median=t))
    result = ab.calibrate_rows(rows, pm.H200, free=("bandwidth_fraction", "dequant_cycles_per_element"))
    assert result.fitted["bandwidth_fraction"] == pytest.approx(0.8, rel=1e-3)
    assert result.fitted["dequant_cycles_per_element"] == pytest.approx(0.02, rel=1e-3)
    with pytest.raises(ValueError, match="measured rows only"):
        ab.calibrate_rows([dataclasses.replace(rows[0], source="model")], pm.H200)
    with pytest.raises(ValueError, match="hardware is 'b200'"):
        ab.calibrate_rows(rows, pm.B200)
