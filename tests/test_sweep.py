"""``python -m gbs ablate`` (gbs.lab.sweep, sweep_grid, sweep_csv, sweep_report): the grid and its legality
filter, the order of work and the sharding by specialisation, resumability, the budget stop, CSV part files
and merging, the device-side problem assembly (with numba's device copies stubbed), the --model / --plot /
--tables / --calibrate modes end to end on modelled rows, the no-GPU message; and on a GPU a short real
sweep."""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

from gbs.lab import sweep, sweep_csv, sweep_grid, sweep_report
from gbs.lab import ablation_data as ab
from gbs.backends import gpu_available
from gbs.lab.timing import Timing
from gbs.lab.perfmodel import B200, H200, ModelConfig, model_config
from gbs.schedule import TileConfig

KIMI_UP = (512, 7168)
DEEPSEEK_UP = (4096, 7168)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONTEXT = sweep.RowContext("h200", "NVIDIA H200", "2026-11-29", "abc1234", 4.3, H200)


def two_stages(fmt, tile):
    """A kernel whose ring holds at most 2 stages: every knob set sweeps exactly {2}."""
    return 2


def tiny_grid(formats=("nvfp4",), shapes=(KIMI_UP,), limit=two_stages):
    return sweep_grid.build_grid("minimal", H200, formats=formats, shapes=shapes, kernel_stage_limit=limit)


def parser():
    p = argparse.ArgumentParser(prog="python -m gbs")
    sweep.add_ablate_parser(p.add_subparsers(dest="command", required=True))
    return p


def run_cli(*argv) -> int:
    args = parser().parse_args(["ablate", *argv])
    return args.func(args)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class FakeRunner:
    """Compiles and times on a fake clock; configs can be made unrunnable or crash."""

    def __init__(self, clock, *, compile_s=5.0, row_s=1.0, not_runnable=(), crash_compile=(), crash_measure=()):
        self.clock, self.compile_s, self.row_s = clock, compile_s, row_s
        self.not_runnable, self.crash_compile, self.crash_measure = set(not_runnable), set(crash_compile), \
            set(crash_measure)
        self.compiled, self.measured, self.row_windows = [], [], []

    def compile(self, spec):
        self.clock.advance(self.compile_s)
        self.compiled.append(spec)
        if spec in self.not_runnable:
            raise sweep.ConfigNotRunnable("5 stages do not fit this kernel")
        if spec in self.crash_compile:
            raise RuntimeError("ptxas crashed")

    @contextlib.contextmanager
    def gpu(self):
        yield

    def measure(self, spec, key):
        start = self.clock()
        self.clock.advance(self.row_s)
        if spec in self.crash_measure:
            raise RuntimeError("illegal address")
        self.measured.append((spec, key))
        self.row_windows.append((start, self.clock()))
        return Timing(10.0 + key.total_tokens, 9.0 + key.total_tokens, 12.0 + key.total_tokens, 5)


# ----------------------------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------------------------
def test_minimal_problems_by_hand():
    up = sweep_grid.grid_problems("minimal", "nvfp4", [DEEPSEEK_UP])
    # 64 slots up to avg_m 128; 512 tokens per slot would make 32768 > 16384, so 32 slots
    assert [(p.routing, p.num_active_experts, p.avg_m) for p in up] == [
        ("uniform", 64, 2), ("uniform", 64, 4), ("uniform", 64, 8), ("uniform", 64, 16), ("uniform", 64, 32),
        ("uniform", 64, 64), ("uniform", 64, 128), ("uniform", 32, 512),
        ("ragged", 64, 4), ("ragged", 64, 32), ("ragged", 64, 128)]
    kimi = sweep_grid.grid_problems("minimal", "mxfp8", [KIMI_UP])
    assert {p.num_active_experts for p in kimi} == {8} and max(p.total_tokens for p in kimi) == 8 * 512
    default = sweep_grid.grid_problems("minimal", "nvfp4")
    assert {p.shape for p in default} == {(4096, 7168), (7168, 2048), (512, 7168)} and len(default) == 33
    for regime in ab.REGIMES:   # every shape covers the three regimes, uniform and ragged
        assert {(p.shape, p.routing) for p in default if p.regime == regime} == {
            (s, r) for s in sweep_grid.MINIMAL_SLOTS for r in ("uniform", "ragged")}
    full = sweep_grid.grid_problems("full", "nvfp4", [KIMI_UP])
    # 8 slots x 1..4096 tokens (13 loads), 64 slots up to 1024 (64 x 2048 > 65536 tokens): 11; two routings
    assert len(full) == 2 * (13 + 11) and {p.routing for p in full} == {"uniform", "ragged"}


def test_stage_counts_and_legality_by_hand():
    assert sweep_grid.stage_counts("minimal", 10) == (2, 4, 6, 10)
    assert sweep_grid.stage_counts("minimal", 6) == (2, 4, 6)
    assert sweep_grid.stage_counts("minimal", 3) == (2, 3)
    assert sweep_grid.stage_counts("minimal", 1) == (1,)
    assert sweep_grid.stage_counts("full", 4) == (1, 2, 3, 4) and sweep_grid.stage_counts("full", 0) == ()
    # 15 legal knob sets: 6 mma_bn x 2 swaps with one CTA, 3 mma_bn (>= 64, swapped only) with the pair
    capped = sweep_grid.grid_configs("minimal", "nvfp4", H200, two_stages)
    assert len(capped) == 15 and {c.stages for c in capped} == {2}
    assert all(c.ab_swapped and c.mma_bn >= 64 for c in capped if c.cta_group == 2)
    # H200 budget, NVFP4, deepest rings of the SM100 formula: bn8 sw 10 / ns 9, bn16 9 / 8, bn32 8 / 8,
    # bn64 7 / 6, bn128 5 / 5, bn256 3 / 3, pair bn64 8, bn128 7, bn256 5 -> {2,4,6,deepest} sizes
    # 4+4 + 4+4 + 4+4 + 4+3 + 3+3 + 2+2 + 4+4+3 = 52
    configs = sweep_grid.grid_configs("minimal", "nvfp4", H200)
    assert len(configs) == 52
    assert all(c.stages <= H200.max_stages("nvfp4", c.tile_config) for c in configs)
    deepest = {c.tile_config: max(d.stages for d in configs if d.tile_config == c.tile_config) for c in configs}
    assert deepest[TileConfig(True, 8, 1)] == 10 and deepest[TileConfig(True, 256, 2)] == 5
    # the kernel's own limit wins where it is lower (the kernel holds fewer stages of the pair tiles)
    limited = sweep_grid.grid_configs("minimal", "nvfp4", H200, lambda f, t: 6 if t.cta_group == 2 else 99)
    assert {c.stages for c in limited if c.tile_config == TileConfig(True, 256, 2)} == {2, 4, 5}
    assert {c.stages for c in limited if c.tile_config == TileConfig(True, 128, 2)} == {2, 4, 6}


def test_order_of_work_puts_every_knob_sets_deepest_ring_first():
    grid = sweep_grid.build_grid("minimal", H200, formats=("nvfp4", "mxfp8"))
    specs = sweep_grid.grid_specs(grid)
    assert len(specs) == len(set(specs)) == sum(len(grid.configs[f]) for f in grid.formats)
    first = specs[:30]      # 15 knob sets x 2 formats, each at its deepest ring
    for spec in first:
        same_tile = [c.stages for c in grid.configs[spec.format] if c.tile_config == spec.config.tile_config]
        assert spec.config.stages == max(same_tile)
    assert [s.format for s in first] == ["nvfp4"] * 15 + ["mxfp8"] * 15
    later = [s.config.stages for s in specs[30:]]
    # then 6, 4 and 2 stages (where not already the deepest)
    assert later == sorted(later, key=lambda s: sweep_grid.STAGE_PRIORITY.index(s))


def test_sharding_is_a_partition_by_specialisation():
    grid = sweep_grid.build_grid("minimal", H200, formats=("nvfp4",), shapes=(KIMI_UP,))
    work = sweep_grid.pending_work(grid, set(), "h200")
    costs = {item[0]: sum(sweep_grid.work_cost(item, H200)) for item in work}
    shards = sweep_grid.shard_work(work, 3, cost=lambda item: costs[item[0]])
    flat = [item[0] for shard in shards for item in shard]
    assert set(flat) == {item[0] for item in work} and len(flat) == len(work)
    order = [item[0] for item in work]
    for shard in shards:    # each worker keeps the order of work
        positions = [order.index(item[0]) for item in shard]
        assert positions == sorted(positions)
    loads = [sum(costs[item[0]] for item in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(costs.values())
    assert sweep_grid.shard_work(work, 1) == [work]
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        sweep_grid.shard_work(work, 0)


def test_estimate_counts_compiles_and_rows():
    grid = tiny_grid()
    work = sweep_grid.pending_work(grid, set(), "h200")
    estimate = sweep_grid.estimate_sweep(sweep_grid.shard_work(work, 2), H200, gpus=1)
    assert estimate.specs == 15 and estimate.rows == 15 * 11
    assert estimate.compile_s == 15 * sweep_grid.COMPILE_S_ESTIMATE
    assert estimate.wall_s >= estimate.timing_s + sweep_grid.WORKER_SETUP_S_ESTIMATE   # one GPU times serially
    # a slow kernel gets the minimum of timed launches, a fast one the budget's worth, capped
    assert sweep_grid.row_seconds_estimate(100_000) == pytest.approx((2 + 2 + 5) * 0.1 + sweep_grid.ROW_OVERHEAD_S)
    assert sweep_grid.row_seconds_estimate(10) < sweep_grid.row_seconds_estimate(1000) < sweep_grid.row_seconds_estimate(10_000)


def test_parse_errors_name_what_is_allowed():
    assert sweep_grid.parse_shapes("deepseek_up, 7168x2048,kimi_up") == ((4096, 7168), (7168, 2048), (512, 7168))
    with pytest.raises(ValueError, match="unknown shape 'deepseek_sideways'.*NxK"):
        sweep_grid.parse_shapes("deepseek_sideways")
    with pytest.raises(ValueError, match="unknown formats.*nvfp5.*nvfp4"):
        sweep_grid.parse_formats("nvfp4,nvfp5", "minimal")
    assert sweep_grid.parse_formats(None, "full") == ("nvfp4", "mxfp4", "mxfp8", "w4a8")


# ----------------------------------------------------------------------------------------------
# Rows through the override path
# ----------------------------------------------------------------------------------------------
def test_override_config_is_the_dispatch_override():
    key = ab.ProblemKey("nvfp4", 4096, 7168, "uniform", 64, 256)
    nvfp4 = sweep.override_config(key, ModelConfig(False, 128, 1, 4), H200.smem_per_sm)
    assert (nvfp4.rule, nvfp4.regime, nvfp4.stages_source) == ("override", "override", "override")
    assert (nvfp4.ab_swapped, nvfp4.mma_bn, nvfp4.cta_group, nvfp4.num_pipeline_stages) == (False, 128, 1, 4)
    mxfp8 = sweep.override_config(key._replace(format="mxfp8"), ModelConfig(True, 64, 2, 9), H200.smem_per_sm)
    assert (mxfp8.a_format, mxfp8.b_format, mxfp8.rule, mxfp8.num_pipeline_stages) == ("mxfp8", "mxfp8", "override", 9)
    with pytest.raises(ValueError, match="exceeds the auto maximum"):
        sweep.override_config(key, ModelConfig(True, 256, 2, 6), H200.smem_per_sm)


def test_measured_rows_mark_the_dispatch_pick_and_auto_stages():
    key = ab.ProblemKey("nvfp4", 4096, 7168, "uniform", 64, 256)    # decode: bn8/cg1/sw x6
    timing = Timing(700.0, 690.0, 720.0, 20)
    picked = CONTEXT.row(key, ModelConfig(True, 8, 1, 6), timing)
    assert picked.source == "measured" and picked.config_source == "dispatch" and picked.stages_source == "override"
    deepest = CONTEXT.row(key, ModelConfig(True, 8, 1, 10), timing)
    assert deepest.config_source == "sweep" and deepest.stages_source == "auto"
    assert picked.bandwidth_ceiling_fraction == pytest.approx(picked.gbps / 4300)
    assert sweep_grid.dispatch_pick(key, H200.smem_per_sm) == ModelConfig(True, 8, 1, 6)


# ----------------------------------------------------------------------------------------------
# The worker loop: resumability, budget, failures
# ----------------------------------------------------------------------------------------------
def test_run_shard_then_resume_from_the_csv(tmp_path):
    grid = tiny_grid()
    csv_path = str(tmp_path / "ablations.csv")
    clock = FakeClock()
    first = FakeRunner(clock)
    work = sweep_grid.pending_work(grid, set(), "h200")
    part = os.path.join(sweep_csv.parts_dir(csv_path), "w0.csv")
    with sweep_csv.PartWriter(part) as writer:
        # room for 3 compiles + rows: the deadline falls inside the third specialisation
        summary = sweep.run_shard(work, first, CONTEXT, writer.write, deadline=5 + 11 + 5 + 11 + 5 + 4.5,
                                  clock=clock, log=lambda _: None)
    assert summary.stopped == "budget" and summary.measured == 11 + 11 + 4
    assert summary.remaining == 15 * 11 - summary.measured
    assert sweep_csv.merge_parts(csv_path, log=lambda _: None) == 26
    assert not os.path.exists(sweep_csv.parts_dir(csv_path))

    done = {sweep_csv.row_key(r) for r in sweep_csv.load_rows(csv_path)}
    rest = sweep_grid.pending_work(grid, done, "h200")
    assert len(rest) == 13 and len(rest[0][1]) == 7      # two specs done, the third has 7 problems left
    second = FakeRunner(FakeClock())
    rows = []
    summary = sweep.run_shard(rest, second, CONTEXT, rows.append, log=lambda _: None)
    assert summary.stopped is None and summary.measured == 15 * 11 - 26
    assert not set(first.measured) & set(second.measured)          # nothing timed twice
    assert work[0][0] not in second.compiled                        # a finished spec is not compiled again
    sweep_csv.update_csv(csv_path, rows, replace=False)
    assert len(sweep_csv.load_rows(csv_path)) == 15 * 11
    assert sweep_grid.pending_work(grid, {sweep_csv.row_key(r) for r in sweep_csv.load_rows(csv_path)}, "h200") == []


def test_budget_stop_starts_nothing_that_would_end_after_the_deadline():
    grid = tiny_grid()
    work = sweep_grid.pending_work(grid, set(), "h200")
    for deadline in (3.0, 20.0, 57.3):
        clock = FakeClock()
        runner = FakeRunner(clock, compile_s=2.0, row_s=0.5)
        rows = []
        summary = sweep.run_shard(work, runner, CONTEXT, rows.append, deadline=deadline, clock=clock,
                                  log=lambda _: None)
        assert summary.stopped == "budget"
        assert len(rows) == summary.measured and summary.remaining == 15 * 11 - len(rows)
        assert all(end <= deadline for _, end in runner.row_windows)
        assert clock() <= deadline
    assert len(rows) > 11          # the last deadline left room for more than one specialisation


def test_unrunnable_configs_record_nothing_and_failures_stop_the_worker():
    grid = tiny_grid()
    work = sweep_grid.pending_work(grid, set(), "h200")
    specs = [spec for spec, _ in work]
    clock = FakeClock()
    runner = FakeRunner(clock, not_runnable={specs[0]}, crash_measure={specs[1]})
    rows = []
    notes = []
    summary = sweep.run_shard(work, runner, CONTEXT, rows.append, clock=clock, log=notes.append)
    assert summary.not_runnable == 11 and summary.failed == 11 and summary.measured == 13 * 11
    assert {(r.ab_swapped, r.mma_bn, r.cta_group) for r in rows}.isdisjoint(
        {(s.config.ab_swapped, s.config.mma_bn, s.config.cta_group) for s in specs[:2]})
    assert any("not runnable here" in n for n in notes) and any("FAIL" in n for n in notes)
    # three specialisations failing in a row: the CUDA context is likely gone, the worker stops
    crashing = FakeRunner(FakeClock(), crash_compile=set(specs[:3]))
    summary = sweep.run_shard(work, crashing, CONTEXT, rows.append, clock=crashing.clock, log=lambda _: None)
    assert summary.stopped == "failures" and summary.measured == 0 and summary.failed == 33
    assert len(crashing.compiled) == 3


def fake_worker(label, work, part_path, *, hw_key, seed, row_budget_s, deadline, gpu_lock=None):
    """A spawned worker without a GPU: FakeRunner rows into its part file; "gpu1.*" dies hard."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == "1":
        os._exit(3)
    runner = FakeRunner(FakeClock(), compile_s=0.0, row_s=0.0)
    runner.gpu = lambda: gpu_lock        # the shared multiprocessing lock of this GPU
    with sweep_csv.PartWriter(part_path) as writer:
        summary = sweep.run_shard(work, runner, CONTEXT, writer.write, deadline=deadline, log=lambda _: None,
                                  label=label)
    summary.note(f"visible={visible}")
    return summary


@pytest.mark.slow   # spawns worker processes: ~17 s on a 2-core CPU
def test_workers_are_spawned_one_gpu_each_and_a_dead_one_is_reported(tmp_path):
    csv_path = str(tmp_path / "ablations.csv")
    work = sweep_grid.pending_work(tiny_grid(), set(), "h200")
    shards = sweep_grid.shard_work(work, 3)     # shards 0 and 2 share GPU "0" (and its lock), shard 1 gets GPU "1"
    summaries = sweep.run_workers(shards, ["0", "1"], csv_path, hw_key="h200", seed=0, row_budget_s=0.05,
                                  deadline=None, worker=fake_worker)
    by_label = {s.label: s for s in summaries}
    assert sorted(by_label) == ["gpu0.0", "gpu0.1", "gpu1.0"]
    assert by_label["gpu1.0"].stopped == "crashed" and by_label["gpu1.0"].notes == ["exit code 3"]
    for label, shard in (("gpu0.0", shards[0]), ("gpu0.1", shards[2])):
        assert by_label[label].notes == ["visible=0"]
        assert by_label[label].measured == sum(len(keys) for _, keys in shard)
    assert sweep_csv.merge_parts(csv_path, log=lambda _: None) == by_label["gpu0.0"].measured + by_label["gpu0.1"].measured
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != "1"      # the parent's environment is restored


# ----------------------------------------------------------------------------------------------
# CSV
# ----------------------------------------------------------------------------------------------
def measured(key, config, median=10.0):
    return CONTEXT.row(key, config, Timing(median, median * 0.9, median * 1.1, 5))


def test_merge_keeps_existing_rows_unless_replacing():
    key = ab.ProblemKey("nvfp4", 512, 7168, "uniform", 8, 32)
    a, b = ModelConfig(True, 8, 1, 4), ModelConfig(True, 8, 1, 6)
    old = [measured(key, a, 10.0)]
    merged, added, replaced = sweep_csv.merge_rows(old, [measured(key, a, 20.0), measured(key, b)], replace=False)
    assert (added, replaced) == (1, 0) and [r.median_us for r in merged if r.config == a] == [10.0]
    merged, added, replaced = sweep_csv.merge_rows(old, [measured(key, a, 20.0)], replace=True)
    assert (added, replaced) == (0, 1) and merged[0].median_us == 20.0
    modelled = ab.model_rows(H200, [key], configs=[a])
    merged, added, _ = sweep_csv.merge_rows(old, modelled, replace=False)
    assert added == 1 and {r.source for r in merged} == {"measured", "model"}   # source is part of the key
    row = old[0]
    assert sweep_csv.row_key(row) == sweep_csv.sweep_key("h200", "measured", row.key, row.config)
    assert sweep_csv.KEY_COLUMNS == ("gpu", "format", "n", "k", "routing", "num_active_experts", "total_tokens",
                                 "ab_swapped", "mma_bn", "cta_group", "stages", "source")


def test_part_files_survive_a_kill_and_merge(tmp_path):
    csv_path = str(tmp_path / "data" / "ablations.csv")
    key = ab.ProblemKey("nvfp4", 512, 7168, "uniform", 8, 32)
    configs = [ModelConfig(True, 8, 1, s) for s in (2, 4, 6)]
    parts = sweep_csv.parts_dir(csv_path)
    for name, chosen in (("a.csv", configs[:2]), ("b.csv", configs[1:])):   # configs[1] in both
        with sweep_csv.PartWriter(os.path.join(parts, name)) as writer:
            for config in chosen:
                writer.write(measured(key, config))
    with open(os.path.join(parts, "b.csv"), "a") as f:     # a write cut short by a kill
        f.write("h200,nvfp4,512,71")
    notes = []
    assert sweep_csv.merge_parts(csv_path, log=notes.append) == 3
    assert any("dropped the last line" in n for n in notes)
    with open(csv_path, newline="") as f:
        assert tuple(next(csv.reader(f))) == ab.ABLATION_COLUMNS
    assert len(sweep_csv.load_rows(csv_path)) == 3 and not os.path.exists(parts)
    # a bad line that is not the last one is an error naming the file
    bad = os.path.join(parts, "c.csv")
    with sweep_csv.PartWriter(bad) as writer:
        writer.write(measured(key, configs[0]))
    lines = open(bad).read().splitlines()
    open(bad, "w").write("\n".join([lines[0], lines[1].replace("nvfp4", "nvfp5"), lines[1]]) + "\n")
    with pytest.raises(ValueError, match="c.csv, record 1"):
        sweep_csv.merge_parts(csv_path, log=lambda _: None)


# ----------------------------------------------------------------------------------------------
# Device-side problem assembly, with numba's device copies stubbed by host arrays
# ----------------------------------------------------------------------------------------------
class HostDeviceArray(np.ndarray):
    """A host array standing in for a numba device array (wrapped in place by launch.to_device)."""

    @property
    def __cuda_array_interface__(self):
        return self.__array_interface__

    def is_c_contiguous(self):
        return self.flags.c_contiguous


def test_rotation_plan_and_device_problems(monkeypatch):
    from numba import cuda

    small = ab.ProblemKey("nvfp4", 256, 512, "uniform", 4, 8)
    ragged = ab.ProblemKey("nvfp4", 256, 512, "ragged", 4, 64)
    other = ab.ProblemKey("mxfp8", 256, 512, "uniform", 2, 4)
    l2 = 2 ** 20
    copies, experts = sweep.rotation_plan([small, ragged, other], l2)
    for key in (small, ragged, other):
        assert copies[key] * ab.useful_bytes(ab.problem_shape(key)) >= 4 * l2 > \
            (copies[key] - 1) * ab.useful_bytes(ab.problem_shape(key))
    assert experts[("nvfp4", 256, 512)] == 4 * max(copies[small], copies[ragged])
    assert experts[("mxfp8", 256, 512)] == 2 * copies[other]

    monkeypatch.setattr(cuda, "to_device", lambda array, stream=0: np.array(array).view(HostDeviceArray))
    monkeypatch.setattr(cuda, "device_array", lambda shape, dtype: np.zeros(shape, dtype).view(HostDeviceArray))
    monkeypatch.setattr(cuda, "as_cuda_array", lambda array: array)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    runner = sweep.DeviceRunner([small, ragged, other], H200, l2_bytes=l2)
    runner.build_host()
    runner.upload()      # every view passes gbs.numba_kernels.launch.to_device's shape checks
    for key in (small, ragged, other):
        inputs = runner._inputs[key]
        assert len(inputs) == copies[key]
        slots = key.num_active_experts
        for c, (problem, out) in enumerate(inputs):
            assert problem.expert_ids.tolist() == [c * slots + g for g in range(slots)]
            assert problem.b.shape[0] == experts[(key.format, key.n, key.k)] and out.shape == (key.total_tokens, key.n)
            assert np.diff(problem.a_offsets.astype(int)).tolist() == \
                ab.routing_for(key.routing, key.num_active_experts, key.total_tokens).group_sizes.tolist()
        assert inputs[0][0].b is inputs[-1][0].b and inputs[0][0].a is not inputs[-1][0].a


# ----------------------------------------------------------------------------------------------
# Modes end to end (no GPU)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modelled_csv(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ablate") / "ablations.csv")
    assert run_cli("--model", "--formats", "nvfp4", "--shapes", "kimi_up", "--csv", path) == 0
    return path


def test_model_writes_rows_for_both_gpus_and_is_idempotent(modelled_csv, capsys):
    rows = sweep_csv.load_rows(modelled_csv)
    assert {r.source for r in rows} == {"model"} and {r.gpu for r in rows} == {"h200", "b200"}
    for hw, limit in ((H200, sweep_grid.h200_kernel_stage_limit()), (B200, None)):
        grid = sweep_grid.build_grid("minimal", hw, formats=("nvfp4",), shapes=(KIMI_UP,), kernel_stage_limit=limit)
        assert sum(r.gpu == hw.key for r in rows) == grid.num_rows
    b200 = [r for r in rows if r.gpu == "b200"]
    assert max(r.stages for r in b200 if (r.mma_bn, r.cta_group) == (256, 2)) == B200.max_stages(
        "nvfp4", TileConfig(True, 256, 2))
    capsys.readouterr()
    assert run_cli("--model", "--formats", "nvfp4", "--shapes", "kimi_up", "--csv", modelled_csv) == 0
    assert "0 modelled rows added, 0 replaced" in capsys.readouterr().out


def test_plot_writes_heatmaps_with_findings(modelled_csv, tmp_path, capsys):
    b200_only = str(tmp_path / "b200.csv")    # two loads each of decode and small prefill: two figures
    sweep_csv.update_csv(b200_only, [r for r in sweep_csv.load_rows(modelled_csv) if r.gpu == "b200" and r.avg_m in (4, 32)],
                     replace=False)
    out = str(tmp_path / "figs")
    assert run_cli("--plot", out, "--csv", b200_only) == 0
    names = sorted(os.listdir(out))
    assert names == [f"b200-model-nvfp4-512x7168-{r}.png" for r in ("decode", "small_prefill")]
    for name in names:
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == PNG_MAGIC
    assert "wrote 2 heatmaps" in capsys.readouterr().out
    decode = [r for r in sweep_csv.load_rows(b200_only) if r.regime == "decode"]
    title = sweep_report.heatmap_figure(decode).get_suptitle().replace("\n", " ")
    assert title.startswith("Modelled B200, NVFP4 Kimi up (512, 7168), decode:") and "dispatch" in title


def test_stage_columns_merge_lone_deepest_rings():
    configs = [ModelConfig(True, 8, 1, s) for s in (2, 4, 6, 10)] + [ModelConfig(True, 256, 2, s) for s in (2, 4)] \
        + [ModelConfig(True, 256, 1, s) for s in (2, 3)]
    labels, column = sweep_report.stage_columns(configs)
    assert labels == ["2", "4", "6", "deepest"]
    assert column[ModelConfig(True, 8, 1, 10)] == column[ModelConfig(True, 256, 1, 3)] == 3
    assert column[ModelConfig(True, 256, 2, 4)] == 1       # its deepest ring is a shared column already
    dense = [ModelConfig(True, 8, 1, s) for s in range(1, 6)] + [ModelConfig(True, 64, 1, s) for s in range(1, 4)]
    assert sweep_report.stage_columns(dense)[0] == ["1", "2", "3", "4", "5"]


def test_tables_side_by_side(modelled_csv, capsys):
    assert run_cli("--tables", "--h200-source", "model", "--csv", modelled_csv) == 0
    out = capsys.readouterr().out
    assert "## Dispatch tables (nvfp4): upstream vs derived" in out
    assert "| regime | upstream (nvfp4, tuned on B200) | H200 model | B200 model |" in out
    assert "### Disagreements with upstream" in out
    assert run_cli("--tables", "--csv", modelled_csv) == 1     # no measured H200 rows yet
    assert "nvfp4: skipped: needs h200 measured rows" in capsys.readouterr().out


def test_calibrate_on_measured_rows(tmp_path, capsys):
    path = str(tmp_path / "ablations.csv")
    rng = np.random.default_rng(0)
    rows = []
    grid = sweep_grid.build_grid("minimal", H200, formats=("nvfp4",), shapes=(KIMI_UP,),
                            kernel_stage_limit=lambda f, t: 4)
    for key in grid.problems["nvfp4"][::2]:
        for config in grid.configs["nvfp4"][::3]:
            truth = 1.4 * model_config(ab.problem_shape(key), config, H200).time_us * rng.uniform(0.95, 1.05)
            rows.append(CONTEXT.row(key, config, Timing(truth, truth * 0.98, truth * 1.02, 5)))
    sweep_csv.update_csv(path, rows, replace=False)
    assert run_cli("--calibrate", "--csv", path) == 0
    out = capsys.readouterr().out
    assert f"on {len(rows)} of {len(rows)} measured rows" in out and "### Before" in out and "### After" in out
    assert "| regime | median relative error |" in out
    errors = [float(line.split("median relative error ")[1].split(" %")[0]) for line in out.splitlines()
              if line.startswith("all ")]
    assert len(errors) == 2 and errors[1] < errors[0]
    assert len(sweep_report.calibration_sample(rows, 10)) <= 10 + len({(r.n, r.k, r.regime) for r in rows})


def test_no_gpu_is_a_message_with_status_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("gbs.backends.gpu_available", lambda: False)
    assert run_cli("--csv", str(tmp_path / "a.csv")) == sweep.NO_GPU_STATUS == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    # options are checked first: a typo is an error, not a GPU hunt
    with pytest.raises(ValueError, match="unknown formats"):
        run_cli("--formats", "nvfp5")
    assert run_cli("--plan", "--csv", str(tmp_path / "a.csv")) == 0
    assert "ablate plan: grid minimal" in capsys.readouterr().out


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the no-GPU path is not taken")
def test_no_gpu_in_a_fresh_process_prints_no_traceback(tmp_path):
    script = ("import argparse, sys; from gbs.lab.sweep import add_ablate_parser; p = argparse.ArgumentParser(); "
              "add_ablate_parser(p.add_subparsers(dest='c')); a = p.parse_args(['ablate', '--csv', sys.argv[1]]); "
              "sys.exit(a.func(a))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a.csv")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------------------------
# GPU: a short real sweep
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_short_sweep_on_the_gpu(tmp_path, monkeypatch):
    from gbs.numba_kernels.launch import gpu_compute_capability

    limit = sweep_grid.h200_kernel_stage_limit()
    if limit is None or gpu_compute_capability() != (9, 0):
        pytest.skip("needs the H200 kernel (gbs.numba_kernels.h200_stream) and an sm_90 GPU")
    grid = sweep_grid.build_grid("minimal", H200, formats=("nvfp4",), shapes=(KIMI_UP,), kernel_stage_limit=limit)
    work = [(spec, keys[:3]) for spec, keys in sweep_grid.pending_work(grid, set(), "h200")[:2]]
    csv_path = str(tmp_path / "ablations.csv")
    part = os.path.join(sweep_csv.parts_dir(csv_path), "gpu.csv")
    monkeypatch.setenv("GBS_COMMIT", os.environ.get("GBS_COMMIT", "gpu-test"))
    summary = sweep.run_worker("gpu0", work, part, hw_key="h200", seed=0, row_budget_s=0.02, deadline=None)
    assert summary.measured + summary.not_runnable == 6 and summary.failed == 0
    sweep_csv.merge_parts(csv_path, log=print)
    rows = sweep_csv.load_rows(csv_path)
    assert len(rows) == summary.measured and all(r.source == "measured" and r.gpu == "h200" for r in rows)
    assert all(0 < r.bandwidth_ceiling_fraction < 1.5 for r in rows)
