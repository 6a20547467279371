"""The benchmark (gbs.lab.bench with gbs.lab.cases, gbs.lab.timing, gbs.lab.environment, gbs.lab.peers): CLI,
no-GPU exit, case selection, row maths, useful bytes.

CPU tests: the ``bench`` parser and its --help, the no-GPU message and exit status 2, option
validation, the quick / full case lists, rows and speed-up ratios built from fake timings, the
table, the CSV, useful bytes / FLOPs of our problems and of every peer worked out by hand,
rotation counts, synthetic problems of every format (valid, no NaN codes, scales in range, also
when an operand repeats its random block), the spacer kernel compiled for sm_90. The output checks
(issue 32): the per-row metric by hand, stub kernels with planted faults (a corrupted element, a
clobbered skipped row, a launch that goes wrong after the timing, no output array) that must make the
row a FAIL with ``verified`` False and never be timed, one reference per case, a whole ``run_bench`` on
stubs; host-bound retries on stub events; the peers' settings (the fastest verified one is the row),
the FP8 peer's ``use_fast_accum`` flag and the Triton peer's non-headline label.
GPU tests (``@pytest.mark.gpu``): a tiny benchmark run end to end that writes a CSV, and each peer's
device reference against its host reference.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import subprocess
import sys
import types

import numpy as np
import pytest

from gbs.lab import bench, cases, environment, peers, timing
from gbs.backends import gpu_available
from gbs.dispatch import dispatch_for
from gbs.dispatch import grouped_matmul_block_scaled_sm100_dispatch
from gbs.numba_kernels import h200_ring as hr
from gbs.problem import PROBLEM_FORMATS
from gbs.formats import decode_elements, unswizzle_scales

L2 = 60 * 2 ** 20


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gbs")
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_parser().parse_args(["bench", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    for option in ("--quick", "--csv", "--formats", "--backends", "--shapes", "--skip-peaks", "--seed"):
        assert option in text
    assert "status 2" in text and "torch._grouped_mm" in text
    assert "decode_up = 4096x7168 64x4" in text


def test_parser_defaults_and_values():
    args = bench_parser().parse_args(["bench"])
    assert (args.quick, args.csv, args.formats, args.backends, args.shapes) == (False, None, None, None, None)
    assert args.func is bench.cmd_bench
    args = bench_parser().parse_args(["bench", "--quick", "--csv", "out.csv", "--formats", "nvfp4,w4a8",
                                      "--backends", "simt,copy", "--shapes", "kimi_decode", "--skip-peaks"])
    assert args.quick and args.skip_peaks and args.csv == "out.csv"
    assert bench.select_methods(args.backends) == ("simt", "copy")
    assert bench.select_cases(args.quick, args.formats, args.shapes) == [
        ("nvfp4", cases.BENCH_CASES["kimi_decode"]), ("w4a8", cases.BENCH_CASES["kimi_decode"])]


def test_no_gpu_exits_2_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr("gbs.backends.gpu_available", lambda: False)
    args = bench_parser().parse_args(["bench", "--quick"])
    assert bench.cmd_bench(args) == bench.NO_GPU_STATUS == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "scripts/gpu_run.sh bench" in err


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the no-GPU path is not taken")
def test_no_gpu_in_a_fresh_process_prints_no_traceback():
    script = ("import argparse, sys; from gbs.lab.bench import add_bench_parser; p = argparse.ArgumentParser(); "
              "add_bench_parser(p.add_subparsers(dest='c')); a = p.parse_args(['bench', '--quick']); "
              "sys.exit(a.func(a))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_bad_names_are_value_errors_naming_the_allowed_ones(monkeypatch):
    with pytest.raises(ValueError, match="unknown formats.*nvfp5.*nvfp4"):
        bench.select_cases(False, "nvfp4,nvfp5")
    with pytest.raises(ValueError, match="unknown shapes.*decode_sideways.*decode_up"):
        bench.select_cases(True, None, "decode_sideways")
    with pytest.raises(ValueError, match="unknown backends.*cublas.*torch_bf16"):
        bench.select_methods("simt,cublas")
    with pytest.raises(ValueError, match="unknown formats"):
        bench.select_cases(True, ",")
    # options are checked before the GPU: a typo is a message (status 2 from the CLI), not a GPU hunt
    monkeypatch.setattr("gbs.backends.gpu_available", lambda: pytest.fail("GPU looked up before the options"))
    with pytest.raises(ValueError, match="unknown backends"):
        bench.cmd_bench(bench_parser().parse_args(["bench", "--backends", "cutlass"]))


def test_quick_and_full_selections():
    quick = bench.select_cases(True)
    assert [(f, c.name) for f, c in quick] == [
        (f, name) for name in ("decode_up", "kimi_decode", "small_prefill_up", "large_prefill_up")
        for f in ("nvfp4", "mxfp8")]
    assert [(c.n, c.k, c.slots, c.tokens_per_expert) for _, c in quick[::2]] == [
        (4096, 7168, 64, 4), (512, 7168, 8, 1), (4096, 7168, 32, 32), (4096, 7168, 8, 1024)]
    full = bench.select_cases(False)
    assert len(full) == len(cases.BENCH_CASES) * 6
    assert {f for f, _ in full} == {"nvfp4", "mxfp4", "mxfp8", "w4a8", "w4a16", "w4a16_nvfp4"}
    # case-major: the formats of one case are adjacent (format-independent peers are timed once)
    assert [c.name for _, c in full[:6]] == ["decode_up"] * 6
    assert bench.select_methods() == ("simt", "gbs_auto", "gbs_auto_h200_layout", "gbs_auto_h200_tiled",
                                      "gbs_auto_h200_fused",
                                      "gbs_auto_h200_relay", "h200_stream",
                                      "h200_stream_sm100_knobs",
                                      "h200_wgmma", "gbs_auto_e4m3_order", "gbs_fp8_route", "gbs_fp8_folded",
                                      "gbs_fp8_folded_relay",
                                      "torch_bf16",
                                      "torch_fp8_rowwise", "triton_dot_scaled", "humming", "copy")


def test_uniform_cases_are_even_and_the_ragged_case_is_a_fixed_router_draw():
    for case in cases.BENCH_CASES.values():
        sizes = case.group_sizes()
        assert sizes.sum() == case.total_tokens and len(sizes) == case.slots
        if case.routing == "uniform":
            assert (sizes == case.tokens_per_expert).all()
    ragged = cases.BENCH_CASES["large_prefill_ragged"]
    sizes = ragged.group_sizes()
    assert (sizes == 0).any() and sizes.max() > 4 * ragged.tokens_per_expert, "hot, cold and empty experts"
    assert (sizes == ragged.group_sizes()).all(), "the same draw in every run"
    problem = ragged.problem("nvfp4")
    assert (np.diff(problem.a_offsets) == sizes).all()
    with pytest.raises(ValueError, match="routing must be one of"):
        cases.BenchCase("x", 256, 256, 4, 4, routing="topk")


def test_every_case_dispatches_to_the_regime_its_name_says():
    for case in cases.BENCH_CASES.values():
        regime = grouped_matmul_block_scaled_sm100_dispatch(
            a_format="nvfp4", b_format="nvfp4", n=case.n, k=case.k, num_active_experts=case.slots,
            estimated_total_m=case.total_tokens).regime
        expected = "decode" if "decode" in case.name else "small_prefill" if "small" in case.name else "large_prefill"
        assert regime == expected, case


# ----------------------------------------------------------------------------------------------
# Useful bytes and FLOPs, by hand
# ----------------------------------------------------------------------------------------------
def routed_problem(fmt):
    """Slots: expert 1 with 3 tokens, an empty slot, a -1 slot with 5 tokens, expert 3 with 2."""
    return cases.synthetic_problem(fmt, n=256, k=128, group_sizes=[3, 0, 5, 2], expert_ids=[1, 0, -1, 3],
                                   num_experts=4)


@pytest.mark.parametrize("fmt, a_row, b_row", [
    ("nvfp4", 64 + 8, 64 + 8),     # K/2 FP4 bytes + K/16 UE4M3 scales
    ("mxfp4", 64 + 4, 64 + 4),     # K/2 + K/32
    ("mxfp8", 128 + 4, 128 + 4),   # K + K/32
    ("w4a8", 128 + 4, 64 + 4),     # MXFP8 tokens, MXFP4 weights
])
def test_useful_bytes_and_flops_by_hand(fmt, a_row, b_row):
    p = routed_problem(fmt)
    live_tokens, live_experts = 3 + 2, 2   # the -1 slot's 5 tokens and the empty slot cost nothing
    assert cases.useful_flops(p) == 2 * live_tokens * 256 * 128
    assert cases.useful_bytes(p) == live_experts * 256 * b_row + live_tokens * a_row + live_tokens * 256 * 2


def test_peer_shape_keeps_only_live_groups():
    shape = peers.PeerShape.from_problem(routed_problem("nvfp4"))
    assert shape == peers.PeerShape(256, 128, (3, 2))
    assert (shape.tokens, shape.num_groups, shape.flops) == (5, 2, 2 * 5 * 256 * 128)
    assert shape.offsets().tolist() == [3, 5] and shape.offsets().dtype == np.int32
    with pytest.raises(ValueError, match="no live group"):
        peers.PeerShape.from_problem(cases.synthetic_problem(
            "nvfp4", n=128, k=64, group_sizes=[4, 0], expert_ids=[-1, 0], num_experts=1))
    with pytest.raises(ValueError, match="no empty groups"):
        peers.PeerShape(128, 64, (4, 0))


def test_peer_useful_bytes_by_hand():
    shape = peers.PeerShape(n=512, k=256, group_sizes=(3, 5))   # 2 experts, 8 tokens
    out = 8 * 512 * 2
    assert peers.TorchBf16Peer().useful_bytes(shape, "nvfp4", 0) == 2 * 512 * 256 * 2 + 8 * 256 * 2 + out
    assert peers.TorchFp8RowwisePeer().useful_bytes(shape, "nvfp4", 0) == (
        2 * 512 * (256 + 4) + 8 * (256 + 4) + out)
    triton = peers.TritonDotScaledPeer()
    assert triton.useful_bytes(shape, "nvfp4", 0) == 2 * 512 * (128 + 8) + 8 * (128 + 8) + out   # MX proxy
    assert triton.useful_bytes(shape, "mxfp8", 0) == 2 * 512 * (256 + 8) + 8 * (256 + 8) + out
    assert triton.useful_bytes(shape, "w4a8", 0) == 2 * 512 * (128 + 8) + 8 * (256 + 8) + out
    copy = peers.CopyPeer()
    assert copy.copy_bytes(1000) == 496 and copy.useful_bytes(shape, "nvfp4", 1000) == 992
    assert copy.copy_bytes(3) == peers.COPY_ALIGN_BYTES
    assert copy.useful_flops(shape) == 0 and triton.useful_flops(shape) == shape.flops
    # bf16 weights are 4x the FP4 bytes: the ratio the GB/s column has to show
    bf16_weights = peers.TorchBf16Peer().useful_bytes(shape, "nvfp4", 0) - 8 * 256 * 2 - out
    assert bf16_weights == 4 * (2 * 512 * 256 // 2)


def test_triton_formats_and_proxy_note():
    assert peers.triton_formats("mxfp4") == ("e2m1", "e2m1", "")
    assert peers.triton_formats("mxfp8") == ("e4m3", "e4m3", "")
    assert peers.triton_formats("w4a8") == ("e4m3", "e2m1", "")
    assert peers.triton_formats("mxfp8_e5m2") == ("e5m2", "e5m2", "")
    lhs, rhs, note = peers.triton_formats("nvfp4")
    assert (lhs, rhs) == ("e2m1", "e2m1") and "nvfp4" in note and "proxy" in note
    assert "MX proxy" in peers.TritonDotScaledPeer().method_format("nvfp4")
    assert "proxy" not in peers.TritonDotScaledPeer().method_format("mxfp4")
    with pytest.raises(ValueError, match="unknown problem format"):
        peers.triton_formats("int4")


def test_peer_registry():
    assert tuple(peers.PEER_CLASSES) == peers.PEER_NAMES
    assert all(cls.name == name for name, cls in peers.PEER_CLASSES.items())
    with pytest.raises(ValueError, match="unknown peers"):
        peers.load_peers(["cublaslt"])
    assert peers.TritonDotScaledPeer.block_m(peers.PeerShape(128, 128, (4, 64))) == peers.TRITON_SMALL_BLOCK_M
    assert peers.TritonDotScaledPeer.block_m(peers.PeerShape(128, 128, (4, 65))) == peers.TRITON_LARGE_BLOCK_M
    with pytest.raises(ValueError, match="dense_peak|kind must be one of"):
        peers.dense_peak_input_bytes("int8")
    assert peers.dense_peak_input_bytes("bf16") == 2 * 8192 * 8192 * 2


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_peers_without_torch_are_skipped_with_the_reason():
    loaded, skipped = peers.load_peers()
    assert loaded == [] and set(skipped) == set(peers.PEER_NAMES)
    assert all("torch is not installed" in reason for reason in skipped.values())


# ----------------------------------------------------------------------------------------------
# Rotation, synthetic problems, timing helpers
# ----------------------------------------------------------------------------------------------
def test_rotation_count():
    assert timing.rotation_count(4 * L2, L2) == 1
    assert timing.rotation_count(4 * L2 - 1, L2) == 2
    assert timing.rotation_count(L2, L2) == 4
    assert timing.rotation_count(L2 // 3, L2) == 12
    assert timing.rotation_count(10 * 2 ** 30, L2) == 1
    assert timing.rotation_count(2 ** 20) == 4 * timing.H200_L2_BYTES // 2 ** 20
    for nbytes in (1, 12345, 7 * 2 ** 20, 300 * 2 ** 20):   # one rotation always spans 4x the L2
        copies = timing.rotation_count(nbytes, L2)
        assert copies * nbytes >= 4 * L2 and (copies == 1 or (copies - 1) * nbytes < 4 * L2)


@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
@pytest.mark.parametrize("random_bytes", [cases.SYNTHETIC_RANDOM_BYTES, 1001])
def test_synthetic_problem_is_valid_for_every_format(fmt, random_bytes, monkeypatch):
    # random_bytes=1001: every operand repeats a small block, the path of gigabyte operands
    monkeypatch.setattr(cases, "SYNTHETIC_RANDOM_BYTES", random_bytes)
    group_sizes, expert_ids = [130, 0, 7, 3], [2, 0, -1, 1]
    p = cases.synthetic_problem(fmt, n=256, k=256, group_sizes=group_sizes, expert_ids=expert_ids, num_experts=3,
                                seed=5)
    p.validate()
    assert p.format_name == fmt and p.total_tokens == 140 and p.n == 256 and p.k == 256
    assert p.a_offsets.tolist() == [0, 130, 130, 137, 140] and p.expert_ids.tolist() == expert_ids
    assert p.estimated_total_m == 140
    for fmt_, codes in ((p.a_format, p.a), (p.b_format, p.b)):
        raw = codes.view(np.uint8)
        assert np.any(raw != 0)
        if not fmt_.scaled:   # bf16 tokens: normal values
            assert np.all(np.isfinite(codes.astype(np.float32))) and np.unique(codes).size > 64
            continue
        values = decode_elements(raw, fmt_.element) if not fmt_.packed else decode_elements(raw & 0x0F, "e2m1")
        assert np.all(np.isfinite(values)), f"{fmt_.name} codes hold NaN"
        assert np.unique(raw).size > 64   # codes exercise the whole byte range
    low, high = cases.SYNTHETIC_UE4M3_RANGE if p.b_format.scale_dtype == "ue4m3" else cases.SYNTHETIC_UE8M0_RANGE
    b_scales = unswizzle_scales(p.b_scales[0], p.n, p.b_format.scale_cols(p.k))
    assert b_scales.min() >= low and b_scales.max() < high
    assert np.all((p.expert_scales >= 0.5) & (p.expert_scales <= 2.0))
    again = cases.synthetic_problem(fmt, n=256, k=256, group_sizes=group_sizes, expert_ids=expert_ids,
                                    num_experts=3, seed=5)
    assert np.array_equal(again.b.view(np.uint8), p.b.view(np.uint8))   # seeded


def test_time_launches_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_inputs >= 1"):
        timing.time_launches(lambda i: None, num_inputs=0)
    with pytest.raises(ValueError, match="reps >= 1"):
        timing.time_launches(lambda i: None, reps=0)


def test_spacer_kernel_compiles_for_sm90():
    from numba import cuda, uint64

    ptx, _ = cuda.compile_ptx(timing._spacer_kernel().py_func, (uint64,), cc=(9, 0))
    assert "nanosleep.u32" in ptx
    assert ptx.count("%globaltimer") >= 2   # the deadline, then the wait on it


def test_environment_fields_and_csv_path():
    env = environment.environment_fields()
    for key in ("gpu", "gpu_uuid", "date", "commit", "numpy", "numba", "numba_cuda", "ml_dtypes", "torch", "triton"):
        assert env[key]
    assert environment.gpu_slug("NVIDIA H200") == "h200"
    assert environment.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert environment.gpu_slug("  ") == "gpu"
    assert bench.default_csv_path({"date": "2026-11-29", "gpu": "NVIDIA H200"}) == "data/bench/2026-11-29-h200.csv"


# ----------------------------------------------------------------------------------------------
# Rows, ratios, table, CSV
# ----------------------------------------------------------------------------------------------
CEILINGS = bench.Ceilings(read_tbps=4.0, bf16_tflops=800.0, fp8_tflops=1600.0, bf16_source="measured",
                          fp8_source="kernels.md")


def fake_measurements(problem, fmt="nvfp4"):
    """simt 100 us, h200_stream skipped, torch_bf16 50 us, torch_fp8 200 us, triton FAIL, copy 25 us."""
    shape = peers.PeerShape.from_problem(problem)
    ours = dict(kind=bench.KIND_OURS, method_format=fmt, useful_flops=cases.useful_flops(problem),
                useful_bytes=cases.useful_bytes(problem))

    def timed(us):
        return timing.Timing(us, 0.9 * us, 1.2 * us, 40)

    def peer(name, us, **extra):
        p = peers.PEER_CLASSES[name]()
        return bench.Measurement(name, bench.KIND_PEER, p.method_format(fmt), p.useful_flops(shape),
                                 p.useful_bytes(shape, fmt, ours["useful_bytes"]),
                                 timing=timed(us) if us else None, input_sets=2, **extra)

    return [bench.Measurement("simt", timing=timed(100.0), input_sets=3, **ours),
            bench.Measurement("h200_stream", status=bench.STATUS_SKIPPED, note="ImportError: not yet", **ours),
            peer("torch_bf16", 50.0), peer("torch_fp8_rowwise", 200.0),
            peer("triton_dot_scaled", None, status=bench.STATUS_FAIL, note="correctness check failed"),
            peer("copy", 25.0)]


def test_rows_ratios_and_percentages_from_fake_timings():
    case = cases.BENCH_CASES["kimi_decode"]
    problem = case.problem("nvfp4")
    config = dispatch_for(problem)
    env = {"gpu": "NVIDIA H200", "date": "2026-11-29", "commit": "abc1234"}
    rows = bench.build_rows("nvfp4", case, config, fake_measurements(problem), CEILINGS, env)
    assert [r["method"] for r in rows] == ["simt", "h200_stream", "torch_bf16", "torch_fp8_rowwise",
                                           "triton_dot_scaled", "copy"]
    assert len({tuple(r) for r in rows}) == 1   # every row has the same keys (one CSV header)
    simt, skipped, bf16, fp8, triton, copy = rows

    flops, nbytes = 2 * 8 * 512 * 7168, cases.useful_bytes(problem)
    assert simt["useful_flops"] == flops and simt["useful_bytes"] == nbytes
    assert simt["tflops"] == pytest.approx(flops / 100e-6 / 1e12)
    assert simt["gbps"] == pytest.approx(nbytes / 100e-6 / 1e9)
    assert simt["pct_read_ceiling"] == pytest.approx(100 * nbytes / 100e-6 / 4.0e12)
    assert simt["pct_bf16_peak"] == pytest.approx(100 * flops / 100e-6 / 800e12)
    assert simt["pct_fp8_peak"] == pytest.approx(100 * flops / 100e-6 / 1600e12)
    assert (simt["median_us"], simt["p10_us"], simt["p90_us"], simt["launches"], simt["input_sets"]) == (
        100.0, 90.0, 120.0, 40, 3)
    # speed-up = peer time / this time; blank where the peer has no timing
    assert simt["speedup_vs_torch_bf16"] == pytest.approx(0.5)
    assert simt["speedup_vs_torch_fp8_rowwise"] == pytest.approx(2.0)
    assert simt["speedup_vs_copy"] == pytest.approx(0.25)
    assert simt["speedup_vs_triton_dot_scaled"] is None
    assert bf16["speedup_vs_torch_bf16"] == pytest.approx(1.0)
    assert bf16["speedup_vs_torch_fp8_rowwise"] == pytest.approx(4.0)
    # bf16 moves 4x the weight bytes of FP4 + its own tokens: its GB/s counts them
    assert bf16["gbps"] == pytest.approx(bf16["useful_bytes"] / 50e-6 / 1e9)
    assert bf16["useful_bytes"] > 3.5 * nbytes
    # copy: no FLOPs, bytes = ours (half read, half written)
    assert copy["tflops"] is None and copy["pct_bf16_peak"] is None
    assert copy["useful_bytes"] == 2 * peers.CopyPeer.copy_bytes(nbytes)
    # skipped and failed rows: reasons, no numbers
    for row, status in ((skipped, "skipped"), (triton, "FAIL")):
        assert row["status"] == status and row["note"]
        assert row["median_us"] is None and row["tflops"] is None and row["speedup_vs_torch_bf16"] is None
    # config on our rows only; earlier figures on the torch rows; ceilings and env on every row
    assert (simt["ab_swapped"], simt["mma_bn"], simt["cta_group"], simt["stages"]) == (
        config.ab_swapped, config.mma_bn, config.cta_group, config.num_pipeline_stages)
    assert bf16["mma_bn"] is None and copy["stages"] is None
    assert bf16["earlier_figure"] == "67.8 us" and fp8["earlier_figure"] == "58.9 us"
    assert simt["earlier_figure"] == ""
    assert all(r["regime"] == "decode" and r["gpu"] == "NVIDIA H200" and r["read_ceiling_tbps"] == 4.0
               and r["fp8_peak_source"] == "kernels.md" for r in rows)


def test_table_shows_every_row_and_the_reasons():
    case = cases.BENCH_CASES["kimi_decode"]
    problem = case.problem("nvfp4")
    rows = bench.build_rows("nvfp4", case, dispatch_for(problem), fake_measurements(problem), CEILINGS, {})
    table = bench.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert "x_bf16" in table[0] and "%read" in table[0]
    assert "skipped: ImportError: not yet" in table[3]
    assert "FAIL: correctness check failed" in table[6]
    simt_line = table[2]
    assert "100.0" in simt_line and "90.0-120.0" in simt_line and " 0.50 " in simt_line
    assert "decided swap1 bn64 cg2 st6" in simt_line and "(decode:" in simt_line
    assert "earlier 67.8 us" in table[4]
    # columns line up: the median sits under the "us" header on every timed line
    us_start = 18 + 1 + 6 + 1 + bench.METHOD_WIDTH + 1
    us_column = slice(us_start, us_start + 9)
    assert table[0][us_column].strip() == "us"
    timed = [line for line in table[2:] if "skipped" not in line and "FAIL" not in line]
    assert [float(line[us_column]) for line in timed] == [100.0, 50.0, 200.0, 25.0]
    # the fakes spread 30 % (p10 0.9x, p90 1.2x the median): flagged; a row within 8 % is not
    assert "wide spread: p10-p90 is 30 % of the median" in simt_line
    tight = dict(rows[0], p10_us=97.0, p90_us=104.0)
    assert "wide spread" not in bench.format_table([tight]).splitlines()[2]


def test_write_csv_round_trip(tmp_path):
    case = cases.BENCH_CASES["kimi_decode"]
    problem = case.problem("nvfp4")
    rows = bench.build_rows("nvfp4", case, dispatch_for(problem), fake_measurements(problem), CEILINGS,
                            {"gpu": "NVIDIA H200"})
    path = tmp_path / "results" / "bench.csv"
    bench.write_csv(str(path), rows)
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["method"] for r in read] == [r["method"] for r in rows]
    assert list(read[0]) == list(rows[0])
    assert float(read[0]["speedup_vs_torch_bf16"]) == pytest.approx(0.5)
    assert read[1]["median_us"] == "" and read[1]["status"] == "skipped"
    bench.write_csv(str(path), [{"part": "a", "x": 1}, {"part": "b", "y": 2}])   # the probes' rows differ in keys
    with open(path, newline="") as f:
        assert list(csv.DictReader(f)) == [{"part": "a", "x": "1", "y": ""}, {"part": "b", "x": "", "y": "2"}]


def test_measurement_is_frozen():
    m = bench.Measurement("simt", bench.KIND_OURS, "nvfp4", 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.status = "ok"


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_tiny_bench_end_to_end_writes_a_csv(tmp_path, capsys):
    case = cases.BenchCase("tiny", n=256, k=512, slots=3, tokens_per_expert=5)
    path = tmp_path / "tiny.csv"
    status = bench.run_bench([("nvfp4", case), ("mxfp8", case)], bench.METHODS, str(path), budget_s=0.05,
                             read_bytes=2 ** 28, measure_peaks=False)
    out = capsys.readouterr().out
    assert status == 0, out
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(bench.METHODS)
    simt = [r for r in rows if r["method"] == "simt"]
    assert [r["status"] for r in simt] == ["ok", "ok"], out
    assert all(float(r["median_us"]) > 0 and float(r["gbps"]) > 0 for r in simt)
    assert all(r["gpu"] != "none" and float(r["read_ceiling_tbps"]) > 1.0 for r in rows)
    assert out.rstrip().splitlines()[-1].startswith("tiny")   # the table comes last
    # every timed row was checked first, and says whether its timing was host-bound (issue 32, items 3, 4)
    timed = [r for r in rows if r["median_us"]]
    assert timed and all(r["verified"] == "True" and float(r["max_row_err"]) <= 2 ** -7 + 2 ** -9 for r in timed
                         if r["method"] != "torch_fp8_rowwise"), out
    assert all(r["host_bound"] in ("True", "False") for r in timed)
    assert all(r["verified"] == "" for r in rows if r["status"] == "skipped")
    fp8 = [r for r in rows if r["method"] == "torch_fp8_rowwise" and r["status"] == "ok"]
    assert all(r["peer_setting"] in peers.TorchFp8RowwisePeer.settings for r in fp8)
    assert {r["peer_headline"] for r in rows if r["method"] == "triton_dot_scaled"} <= {"False"}


@pytest.mark.gpu
def test_time_launches_series_is_every_timed_launch_in_issue_order():
    issued = []
    measured = timing.time_launches(issued.append, num_inputs=3, warmup=2, reps=7)
    assert [s for s, _ in measured.series] == issued[-7:] == [(4 + i) % 3 for i in range(7)]
    times = [us for _, us in measured.series]
    assert measured.launches == 7 and all(us > 0 for us in times)
    assert measured.median_us == pytest.approx(float(np.median(times)))


def test_relay_method_re_lays_the_packed_tokens_before_each_launch(monkeypatch):
    """``gbs_auto_h200_relay``: the kernel gets the problem with both operands in the H200 order, and each
    call first re-lays the packed tokens (and, NVFP4, codes their UE4M3 scales) into the kernel's own
    arrays, then launches; MXFP4's UE8M0 scales stay; FP8 tokens have nothing to re-lay (refused).
    Host-only: kernel, copies and the re-layout are stubbed."""
    import gbs.numba_kernels.h200_launch as h200_launch
    import gbs.numba_kernels.launch as launch
    import gbs.numba_kernels.relayout as relayout
    from numba import cuda

    events, seen = [], []

    class Launched:
        spec, k_splits, num_ctas = "spec", 1, 132

        def __call__(self):
            events.append("launch")

    monkeypatch.setattr(h200_launch, "prepare", lambda device, plan: seen.append(device) or Launched())
    monkeypatch.setattr(launch, "to_device", lambda problem: types.SimpleNamespace(
        a=("device a", problem.a_layout), a_scales=("device a_scales", problem.a_layout)))
    monkeypatch.setattr(cuda, "to_device", lambda host: ("packed copy", host.shape))
    monkeypatch.setattr(relayout, "to_e2m1_h200", lambda packed, out: events.append(("relay", packed, out)))
    monkeypatch.setattr(relayout, "ue4m3_scales_to_h200", lambda packed, out: events.append(("codes", packed, out)))
    prepare = bench.BACKEND_LOADERS["gbs_auto_h200_relay"]()
    for fmt, codes in (("nvfp4", True), ("mxfp4", False)):
        events.clear()
        problem = cases.BenchCase("t", 256, 256, 2, 3).problem(fmt)
        launcher = prepare(problem, None)
        assert seen[-1].a == ("device a", "e2m1_h200") and launcher.num_ctas == 132
        launcher()
        launcher()
        relay = [("relay", ("packed copy", problem.a.shape), ("device a", "e2m1_h200"))]
        if codes:
            relay.append(("codes", ("packed copy", problem.a_scales.shape), ("device a_scales", "e2m1_h200")))
        assert events == (relay + ["launch"]) * 2
    with pytest.raises(NotImplementedError, match="no FP4 tokens to re-lay"):
        prepare(cases.BenchCase("t", 256, 256, 2, 3).problem("w4a8"), None)


def test_launch_knobs_names_what_ran():
    class FakePlan:
        kernel, k_splits, num_ctas = "h200_stream", 4, 144
        ring = hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2)

    class FakeLaunch:
        plan = FakePlan

    assert bench.launch_knobs(FakeLaunch()) == "swap bn8 cg1 st2 splits4 ctas144"
    FakePlan.ring = hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, small_n_warps=8)
    assert bench.launch_knobs(FakeLaunch()) == "swap bn8 cg1 st2 splits4 ctas144 w8"
    FakePlan.ring = hr.StreamSpec("mxfp4", "mxfp4", False, 128, 1, 3, m_rows=256)
    FakePlan.kernel = "h200_wgmma"
    assert bench.launch_knobs(FakeLaunch()) == "wgmma noswap bn128 cg1 st3 splits4 ctas144 t256"
    FakePlan.ring = hr.StreamSpec("mxfp4", "mxfp4", False, 128, 1, 3, m_rows=256, b_layout="e2m1_h200")
    assert bench.launch_knobs(FakeLaunch()).endswith(" t256 e2m1_h200:b")
    FakePlan.ring = dataclasses.replace(FakePlan.ring, a_layout="e2m1_h200")
    assert bench.launch_knobs(FakeLaunch()).endswith(" t256 e2m1_h200:ab")
    FakePlan.ring = dataclasses.replace(FakePlan.ring, b_layout="e2m1_h200_tiled")
    assert bench.launch_knobs(FakeLaunch()).endswith(" t256 e2m1_h200:a e2m1_h200_tiled:b")
    assert bench.launch_knobs(object()) == ""


@pytest.mark.parametrize("method, layout", [("gbs_auto_h200_layout", "e2m1_h200"),
                                            ("gbs_auto_h200_tiled", "e2m1_h200_tiled"),
                                            ("gbs_auto_h200_fused", "e2m1_h200_fused")])
@pytest.mark.parametrize("fmt, relaid", [("nvfp4", True), ("w4a8", True), ("mxfp8", False)])
def test_h200_layout_method_relays_fp4_operands_once_per_case(fmt, relaid, method, layout, monkeypatch):
    """``gbs_auto_h200_layout`` / ``_tiled`` / ``_fused`` hand the kernels the re-laid weights (row-major,
    tiled, or tiled with their scales) and
    FP4 tokens in the H200 word order (W4A8's FP8 tokens stay as they are), re-laying each bench case once
    however many rotation copies are prepared, and skip FP8 weights (no re-layout: the row would only
    repeat ``gbs_auto``); N and K tails (gpt-oss-like) are re-laid too, tiled weights stored padded. Host-only:
    kernel and copy are stubbed."""
    import gbs.numba_kernels.h200_launch as h200_launch
    import gbs.numba_kernels.launch as launch
    from gbs.layouts import E2M1H200Order

    seen, relayouts = [], []
    monkeypatch.setattr(h200_launch, "prepare", lambda problem, plan: seen.append(problem))
    monkeypatch.setattr(launch, "to_device", lambda problem: problem)
    swizzle = E2M1H200Order.swizzle
    monkeypatch.setattr(E2M1H200Order, "swizzle", classmethod(lambda cls, b: relayouts.append(1) or swizzle(b)))
    prepare = bench.BACKEND_LOADERS[method]()
    problem = cases.BenchCase("t", 256, 256, 2, 3).problem(fmt)
    if not relaid:
        with pytest.raises(NotImplementedError, match=f"no {layout} re-layout for mxfp8"):
            prepare(problem, None)
        return
    for _ in range(3):
        prepare(problem, None)
    fp4_tokens = problem.a_format.packed
    assert len(relayouts) == 1 + fp4_tokens
    assert all(p.b_layout == layout and p.a_layout == ("e2m1_h200" if fp4_tokens else "packed") for p in seen)
    np.testing.assert_array_equal(seen[0].b_operand(1).data, problem.b_operand(1).data)
    np.testing.assert_array_equal(seen[0].b_operand(1).scales, problem.b_operand(1).scales)
    np.testing.assert_array_equal(seen[0].a_operand().data, problem.a)
    tail = cases.BenchCase("t", 200, 352, 2, 3).problem(fmt)
    prepare(tail, None)
    assert seen[-1].b.shape[1] == (256 if layout != "e2m1_h200" else 200)
    np.testing.assert_array_equal(seen[-1].b_operand(1).data, tail.b_operand(1).data)


# ----------------------------------------------------------------------------------------------
# Output checks (issue 32, item 3): the metric, our launches, the peers
# ----------------------------------------------------------------------------------------------
from gbs.formats import BF16  # noqa: E402
from gbs.lab import verify  # noqa: E402
from gbs.reference import POISON_BITS, check_acceptance, reference_grouped_matmul  # noqa: E402


def test_row_errors_by_hand():
    ref = np.array([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [0.5, 0.25, 0.0], [0.0, 0.0, 0.0]])
    out = np.array([[1.0, -4.0, 2.5], [0.0, 0.0, 0.0], [0.5, 0.25, np.nan], [0.0, 1e-30, 0.0]])
    np.testing.assert_array_equal(verify.row_errors(out, ref), [0.5 / 4.0, 0.0, np.inf, np.inf])
    assert verify.row_errors(np.array([1.0, 2.0]), np.array([1.0, 4.0])).tolist() == [0.5]   # 1-D: one row
    with pytest.raises(ValueError, match="shape"):
        verify.row_errors(np.zeros((2, 3)), np.zeros((3, 2)))
    assert verify.ROW_ERR_BOUND == pytest.approx(2 ** -7 + 2 ** -9)


def test_one_bf16_ulp_passes_and_a_corrupted_element_fails():
    ref = np.array([[1.0, 3.0, -0.75], [100.0, 7.0, 1.0]]).astype(BF16)
    ulp = ref.copy()
    ulp.view(np.uint16)[0, 1] += 1   # 3.0 -> the next bf16 up: one ulp of the row's largest element
    check = verify.check_output(ulp, ref)
    assert check.passed and 0 < check.max_row_err <= 2 ** -7 and check.worst_row == 0
    bad = ref.copy()
    bad[1, 1] = 9.0   # 2.0 off in a row whose largest element is 100: 2 % of it
    check = verify.check_output(bad, ref)
    assert not check.passed and check.max_row_err == pytest.approx(0.02) and check.worst_row == 1
    assert "FAIL" in str(check) and "row 1" in str(check)


def low_magnitude_group_problem():
    """Slots: expert 0 with 6 tokens, a -1 slot with 3, expert 1 with 4 tokens at 1/1000 of expert 0's scale."""
    p = cases.synthetic_problem("nvfp4", n=256, k=128, group_sizes=[6, 3, 4], expert_ids=[0, -1, 1], num_experts=2,
                                seed=3)
    return dataclasses.replace(p, expert_scales=np.array([1.0, 1e-3], np.float32))


def test_per_row_check_catches_a_fault_the_global_acceptance_misses():
    """A corrupted element in a low-magnitude group: far under 1 % of the global maximum (check_acceptance
    passes), but the whole size of its own row's largest element (the per-row check fails)."""
    p = low_magnitude_group_problem()
    ref = reference_grouped_matmul(p)
    out = ref.copy()
    row = 10   # the low-magnitude group's rows are 9..12
    col = int(np.argmax(np.abs(ref[row].astype(np.float64))))
    out[row, col] = BF16.type(-2 * float(ref[row, col]))
    assert check_acceptance(p, out, ref).passed, "the global metric must miss it for this test to mean anything"
    check = verify.check_output(out, ref, written=p.written_rows())
    assert not check.passed and check.worst_row == row and check.max_row_err == pytest.approx(3.0)
    assert verify.check_output(ref, ref, written=p.written_rows()).max_row_err == 0.0


def test_check_output_counts_unwritten_and_clobbered_rows():
    p = low_magnitude_group_problem()
    ref = reference_grouped_matmul(p)   # the -1 slot's rows 6..8 hold the poison
    check = verify.check_output(ref, ref, written=p.written_rows())
    assert check.passed and check.rows == 10 and (check.unwritten_rows, check.clobbered_rows) == (0, 0)
    clobbered = ref.copy()
    clobbered[7, 3] = BF16.type(0.0)
    assert verify.check_output(clobbered, ref, written=p.written_rows()).clobbered_rows == 1
    unwritten = ref.copy()
    unwritten.view(np.uint16)[2, 5] = POISON_BITS
    check = verify.check_output(unwritten, ref, written=p.written_rows())
    assert not check.passed and check.unwritten_rows == 1 and check.max_row_err == np.inf


class FakeDeviceArray:
    """The host side of a numba device array as the bench uses it: shape, dtype, copies both ways."""

    def __init__(self, shape):
        self.host = np.zeros(shape, np.uint16)
        self.shape, self.dtype = shape, self.host.dtype

    def copy_to_device(self, host):
        assert host.dtype == self.dtype and host.shape == self.shape
        self.host[...] = host

    def copy_to_host(self):
        return self.host.copy()


class FakeLaunch:
    """A prepared launch writing the exact reference's bits into the written rows of ``out``. Planted faults:
    ``corrupt`` = (row, col) doubled plus one from call ``corrupt_from`` on; ``clobber``: also writes a skipped row."""

    def __init__(self, problem, corrupt=None, corrupt_from=1, clobber=None, output="out"):
        setattr(self, output, FakeDeviceArray((problem.total_tokens, problem.n)))
        self._out = getattr(self, output)
        self.ref_bits = reference_grouped_matmul(problem).view(np.uint16)
        self.written = problem.written_rows()
        self.corrupt, self.corrupt_from, self.clobber = corrupt, corrupt_from, clobber
        self.calls = 0

    def __call__(self):
        self.calls += 1
        bits = self._out.host
        bits[self.written] = self.ref_bits[self.written]
        if self.corrupt and self.calls >= self.corrupt_from:
            row, col = self.corrupt
            value = np.array(bits[row, col]).view(BF16).astype(np.float32)
            bits[row, col] = np.array(2 * value + 1).astype(BF16).view(np.uint16)
        if self.clobber is not None:
            bits[self.clobber] = 0


class Bare:
    """A launch with no output array: the bench cannot check it, so it must not time it."""

    def __call__(self):
        pass


@pytest.fixture
def no_gpu_sync(monkeypatch):
    from numba import cuda

    monkeypatch.setattr(cuda, "synchronize", lambda: None)


def fake_timer(calls):
    """time_launches' stand-in: three launches, a fixed timing; records that it ran."""
    def time_launches(launch, *, num_inputs=1, budget_s=None, **_):
        calls.append(num_inputs)
        for i in range(3):
            launch(i % num_inputs)
        return timing.Timing(10.0, 9.0, 11.0, 3)

    return time_launches


def measure_ours(problem, make_launch, monkeypatch, reference=None):
    timed = []
    monkeypatch.setattr(bench, "time_launches", fake_timer(timed))
    reference = reference or bench.CaseReference(problem)
    m = bench._our_measurement("simt", lambda p, c: make_launch(p), problem, None, 1.0, 1, reference)
    return m, timed


def test_our_output_is_verified_before_it_is_timed(monkeypatch, no_gpu_sync):
    p = low_magnitude_group_problem()
    launches = []
    m, timed = measure_ours(p, lambda q: launches.append(FakeLaunch(q)) or launches[-1], monkeypatch)
    assert m.status == bench.STATUS_OK and m.verified is True and m.max_row_err == 0.0 and timed == [1]
    assert launches[0].calls == 1 + 3 + 1   # checked, timed, checked again
    # the SIMT kernel's prepared launch names its output device_out
    m, _ = measure_ours(p, lambda q: FakeLaunch(q, output="device_out"), monkeypatch)
    assert m.verified is True


@pytest.mark.parametrize("fault, note", [
    (dict(corrupt=(10, 0)), "OUTPUT CHECK FAILED, not timed"),       # the low-magnitude group
    (dict(corrupt=(0, 0)), "OUTPUT CHECK FAILED, not timed"),
    (dict(clobber=7), "clobbered skipped rows 1"),                     # the -1 slot's rows
    (dict(corrupt=(2, 5), corrupt_from=3), "after the timed launches"),   # right once, wrong after the timing
])
def test_a_planted_fault_makes_the_row_a_fail_never_timed_as_good(fault, note, monkeypatch, no_gpu_sync):
    p = low_magnitude_group_problem()
    m, timed = measure_ours(p, lambda q: FakeLaunch(q, **fault), monkeypatch)
    assert m.status == bench.STATUS_FAIL and m.verified is False and m.timing is None, m
    assert note in m.note
    assert timed == ([1] if "after" in note else [])   # a first check that fails: never timed
    row = bench.build_rows("nvfp4", cases.BENCH_CASES["kimi_decode"], dispatch_for(p), [m], CEILINGS, {})[0]
    assert row["verified"] is False and row["median_us"] is None and row["status"] == "FAIL"
    assert bench.format_table([row]).splitlines()[2].split(None, 3)[3].startswith("FAIL: ")


def test_a_launch_without_an_output_array_is_a_fail_not_a_skip(monkeypatch, no_gpu_sync):
    m, timed = measure_ours(low_magnitude_group_problem(), lambda q: Bare(), monkeypatch)
    assert m.status == bench.STATUS_FAIL and m.verified is False and timed == []
    assert "exposes no output array" in m.note
    with pytest.raises(bench.VerificationError, match="out / device_out"):
        bench.launcher_output(Bare())


def test_the_reference_is_computed_once_per_case_for_every_method(monkeypatch, no_gpu_sync):
    p = low_magnitude_group_problem()
    made = []
    monkeypatch.setattr(bench, "reference_grouped_matmul", lambda q: made.append(q) or reference_grouped_matmul(q))
    reference = bench.CaseReference(p)
    for _ in range(3):
        assert measure_ours(p, FakeLaunch, monkeypatch, reference)[0].verified
    assert made == [p] and reference.seconds is not None
    # a method that is skipped at prepare never costs a reference
    lazy = bench.CaseReference(p)
    m = bench._our_measurement("simt", lambda q, c: (_ for _ in ()).throw(NotImplementedError("no")), p, None, 1.0,
                               1, lazy)
    assert m.status == bench.STATUS_SKIPPED and m.verified is None and lazy.seconds is None and len(made) == 1


def test_run_bench_with_stub_kernels_records_the_checks_and_fails_loudly(tmp_path, monkeypatch, capsys, no_gpu_sync):
    """The whole run on the host: a right kernel and one with a planted fault; the CSV says which is which,
    the faulty one is not timed, and the run exits 1 with a message."""
    monkeypatch.setattr(bench, "measure_ceilings", lambda *a: CEILINGS)
    monkeypatch.setattr(bench, "device_l2_bytes", lambda: 1)
    monkeypatch.setattr(bench, "time_launches", fake_timer([]))
    monkeypatch.setattr(peers, "load_peers", lambda names: ([], {}))
    monkeypatch.setattr(bench, "load_backends", lambda names: (
        {"simt": lambda p, c: FakeLaunch(p), "gbs_auto": lambda p, c: FakeLaunch(p, corrupt=(1, 2))}, {}))
    case = cases.BenchCase("tiny", n=256, k=256, slots=3, tokens_per_expert=5)
    path = tmp_path / "tiny.csv"
    status = bench.run_bench([("nvfp4", case)], ("simt", "gbs_auto"), str(path), budget_s=0.05, read_bytes=1,
                             measure_peaks=False)
    out, err = capsys.readouterr()
    assert status == 1
    assert "OUTPUT CHECK FAILED (1 rows, not timed as good): nvfp4 tiny gbs_auto" in err
    assert "exact reference computed in" in out and "verified, max row err 0.00e+00" in out
    with open(path, newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert (rows["simt"]["verified"], rows["simt"]["max_row_err"], rows["simt"]["host_bound"]) == ("True", "0.0", "False")
    assert rows["gbs_auto"]["verified"] == "False" and rows["gbs_auto"]["median_us"] == ""
    assert float(rows["gbs_auto"]["max_row_err"]) > verify.ROW_ERR_BOUND


# ----------------------------------------------------------------------------------------------
# Host-bound timings (issue 32, item 4)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def fake_events(monkeypatch):
    """numba.cuda's events and sync, host-only: every event pair reads 0.01 ms."""
    from numba import cuda

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

        def query(self):   # the spacer still runs: not host-bound
            return False

    monkeypatch.setattr(cuda, "event", Event)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "event_elapsed_time", lambda a, b: 0.01)


def scripted_batches(monkeypatch, verdicts):
    """_timed_launches' stand-in: host-bound or not per batch, from ``verdicts``; records (reps, spacer_s)."""
    batches = []

    def timed(launch, reps, first_input, num_inputs, spacer_s, back_to_back=1):
        batches.append((reps, spacer_s))
        for i in range(reps):
            launch((first_input + i) % num_inputs)
        return np.full(reps, 5.0 + len(batches)), verdicts[len(batches) - 1]

    monkeypatch.setattr(timing, "_timed_launches", timed)
    return batches


def test_a_host_bound_batch_is_retried_with_more_warmup_and_a_longer_spacer(monkeypatch, fake_events):
    batches = scripted_batches(monkeypatch, [True, True, False])
    issued = []
    measured = timing.time_launches(issued.append, num_inputs=2, warmup=3, reps=10)
    assert measured.host_bound is False and measured.attempts == 3 and measured.median_us == 8.0   # the third batch's
    assert len(batches) == 3 and batches[1][1] > batches[0][1] and batches[2][1] > batches[1][1]
    # 1 first call + 1 host-time probe + 3 warm-up + 10 timed, then 6 + 10 and 12 + 10 (warm-up doubles)
    assert len(issued) == 2 + 3 + 10 + 6 + 10 + 12 + 10


def test_still_host_bound_after_the_retries_is_marked_and_warned(monkeypatch, fake_events):
    batches = scripted_batches(monkeypatch, [True] * (1 + timing.HOST_BOUND_RETRIES))
    with pytest.warns(RuntimeWarning, match="include host gaps"):
        measured = timing.time_launches(lambda i: None, reps=10)
    assert measured.host_bound is True and measured.attempts == 1 + timing.HOST_BOUND_RETRIES == len(batches)
    assert all(spacer <= timing.SPACER_MAX_S for _, spacer in batches)


def test_a_retry_at_the_spacer_cap_queues_only_what_the_spacer_covers(monkeypatch, fake_events):
    monkeypatch.setattr(timing, "SPACER_MAX_S", 1e-9)   # any host time exceeds it: the cap binds at once
    batches = scripted_batches(monkeypatch, [True, False])
    measured = timing.time_launches(lambda i: None, reps=50)
    assert [reps for reps, _ in batches] == [50, timing.MIN_TIMED_LAUNCHES]
    assert measured.launches == timing.MIN_TIMED_LAUNCHES and not measured.host_bound


def test_back_to_back_launches_share_a_pair_of_events(monkeypatch, fake_events):
    """``back_to_back=3``: 7 timed launches become 3 groups of 3 (9 launches) behind one event pair each, every
    group's time split over its launches; the series names each group's first input set."""
    pairs = []
    monkeypatch.setattr(timing, "hold_stream", lambda seconds: None)
    from numba import cuda

    monkeypatch.setattr(cuda, "event_elapsed_time", lambda a, b: pairs.append((a, b)) or 0.03)
    issued = []
    measured = timing.time_launches(issued.append, num_inputs=4, warmup=2, reps=7, back_to_back=3)
    timed = issued[2 + 2:]
    assert len(timed) == 9 and len(pairs) == 3   # one event pair per group
    assert measured.launches == 9 and measured.median_us == pytest.approx(10.0)
    assert [s for s, _ in measured.series] == [timed[0], timed[3], timed[6]]
    with pytest.raises(ValueError, match="back_to_back >= 1"):
        timing.time_launches(lambda i: None, back_to_back=0)


def test_host_bound_rows_are_marked_in_the_csv_and_the_table():
    case = cases.BENCH_CASES["kimi_decode"]
    problem = case.problem("nvfp4")
    ms = fake_measurements(problem)
    ms[0] = dataclasses.replace(ms[0], timing=timing.Timing(100.0, 99.0, 101.0, 40, host_bound=True, attempts=3))
    rows = bench.build_rows("nvfp4", case, dispatch_for(problem), ms, CEILINGS, {})
    assert [r["host_bound"] for r in rows] == [True, None, False, False, None, False]
    assert rows[0]["timing_attempts"] == 3 and rows[2]["timing_attempts"] == 1
    table = bench.format_table(rows).splitlines()
    assert "HOST-BOUND (times include host gaps after 3 batches)" in table[2]
    assert not any("HOST-BOUND" in line for line in table[3:])


# ----------------------------------------------------------------------------------------------
# Peers: settings, checks at the bench shape, headline (issue 32, items 3, 5, 6)
# ----------------------------------------------------------------------------------------------
class FakePeer(peers.Peer):
    """A numpy peer with two settings; ``wrong``: settings whose output is corrupted."""

    name = "torch_fp8_rowwise"
    settings = ("slow", "fast")

    def __init__(self, wrong=()):
        self.wrong, self.launched = set(wrong), []

    def method_format(self, fmt):
        return "fake"

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        return 1000

    def make_inputs(self, shape, fmt, our_useful_bytes, seed):
        rng = np.random.default_rng(seed)
        return {"a": rng.standard_normal((shape.tokens, shape.k)), "b": rng.standard_normal((shape.n, shape.k)),
                "k": shape.k}

    def device_reference(self, inputs):
        return inputs["a"] @ inputs["b"].T

    def launch(self, inputs, setting=""):
        self.launched.append(setting)
        out = (inputs["a"] @ inputs["b"].T).astype(np.float32)
        if setting in self.wrong:
            out[1, 1] += 10 * np.abs(out[1]).max()
        return out


@pytest.mark.parametrize("wrong, us, expect_setting, expect_note", [
    ((), {"slow": 20.0, "fast": 12.0}, "fast", "other settings: slow: 20.0 us (max row err"),
    ((), {"slow": 9.0, "fast": 12.0}, "slow", "other settings: fast: 12.0 us"),
    (("fast",), {"slow": 20.0, "fast": 12.0}, "slow", "fast: OUTPUT CHECK FAILED, not timed"),   # planted fault
])
def test_the_peer_row_is_its_fastest_verified_setting(wrong, us, expect_setting, expect_note, monkeypatch):
    peer = FakePeer(wrong)
    timed = []

    def time_launches(launch, *, num_inputs=1, budget_s=None, **_):
        launch(0)
        timed.append(peer.launched[-1])
        return timing.Timing(us[peer.launched[-1]], 1.0, 1.0, 5)

    monkeypatch.setattr(bench, "time_launches", time_launches)
    m = bench._peer_measurement(peer, peers.PeerShape(32, 64, (3, 5)), "nvfp4", 1000, 1.0, 1)
    assert m.status == bench.STATUS_OK and m.verified is True and m.setting == expect_setting
    assert m.timing.median_us == us[expect_setting] and expect_note in m.note
    assert timed == [s for s in peer.settings if s not in wrong]   # a setting that fails its check is not timed
    row = bench.build_rows("nvfp4", cases.BENCH_CASES["kimi_decode"], dispatch_for(cases.BENCH_CASES["kimi_decode"]
                           .problem("nvfp4")), [m], CEILINGS, {})[0]
    assert row["peer_setting"] == expect_setting and row["verified"] is True and row["peer_headline"] is True


def test_a_peer_whose_every_setting_fails_is_a_fail_row(monkeypatch):
    monkeypatch.setattr(bench, "time_launches", lambda *a, **k: pytest.fail("a failed output was timed"))
    m = bench._peer_measurement(FakePeer(("slow", "fast")), peers.PeerShape(32, 64, (3, 5)), "nvfp4", 1000, 1.0, 1)
    assert m.status == bench.STATUS_FAIL and m.verified is False and m.timing is None
    assert m.note.count("OUTPUT CHECK FAILED") == 2 and m.max_row_err > 1


def test_check_at_shape_uses_the_peers_bound():
    peer = FakePeer()
    inputs = peer.make_inputs(peers.PeerShape(16, 32, (4,)), "nvfp4", 0, seed=0)
    reference = peer.device_reference(inputs)
    assert peers.check_at_shape(peer, inputs, reference, "slow").passed
    assert not peers.check_at_shape(FakePeer(("slow",)), inputs, reference, "slow").passed
    copy = peers.CopyPeer()
    assert copy.row_err_bound("", 0) == 0.0   # a copy with one wrong byte fails


def test_fp8_peer_settings_flag_and_bounds(monkeypatch):
    fp8 = peers.TorchFp8RowwisePeer()
    assert fp8.settings == (peers.FP8_ACCURATE, peers.FP8_FAST) == ("use_fast_accum=False", "use_fast_accum=True")
    assert fp8.row_err_bound(peers.FP8_ACCURATE, 7168) == verify.ROW_ERR_BOUND
    assert fp8.row_err_bound(peers.FP8_FAST, 7168) == pytest.approx(verify.ROW_ERR_BOUND + 224 * 2 ** -13)
    calls = []
    fake_torch = types.SimpleNamespace(bfloat16="bf16", _scaled_grouped_mm=lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(peers, "_torch", lambda: fake_torch)
    b = types.SimpleNamespace(transpose=lambda *dims: "b^T")
    inputs = {"a": "a", "b": b, "scale_a": "sa", "scale_b": "sb", "offs": "offs"}
    for setting in fp8.settings:
        fp8.launch(inputs, setting)
    fp8.launch(inputs)   # the small-shape check's default: torch's default
    assert [kw["use_fast_accum"] for kw in calls] == [False, True, False]
    with pytest.raises(ValueError, match="setting must be one of"):
        fp8.launch(inputs, "use_fast_accum=maybe")


def test_triton_peer_is_labelled_not_headline():
    assert peers.TritonDotScaledPeer.headline is False and "not headline" in peers.TritonDotScaledPeer.label
    assert "Not a headline peer" in peers.TritonDotScaledPeer.__doc__
    assert [n for n, cls in peers.PEER_CLASSES.items() if not cls.headline] == ["triton_dot_scaled"]
    case = cases.BENCH_CASES["kimi_decode"]
    problem = case.problem("nvfp4")
    ms = [dataclasses.replace(m, headline=peers.PEER_CLASSES[m.method].headline) if m.kind == bench.KIND_PEER
          else m for m in fake_measurements(problem)]
    ms[4] = dataclasses.replace(ms[4], status=bench.STATUS_OK, note="", timing=timing.Timing(500.0, 490.0, 510.0, 5))
    rows = bench.build_rows("nvfp4", case, dispatch_for(problem), ms, CEILINGS, {})
    assert [r["peer_headline"] for r in rows] == [None, None, True, True, False, True]
    table = bench.format_table(rows).splitlines()
    assert "NOT HEADLINE" in table[6] and sum("NOT HEADLINE" in line for line in table) == 1
    assert "NOT HEADLINE" in bench.TABLE_LEGEND


@pytest.mark.gpu
@pytest.mark.parametrize("name", peers.PEER_NAMES)
def test_peer_device_reference_matches_the_host_reference(name):
    """On the GPU with torch: each peer's float64 reference computed on the device (the bench shape's) equals the
    host one (the small check's) on the check shape, and every setting's output passes ``check_at_shape``."""
    loaded, skipped = peers.load_peers([name])
    if not loaded:
        pytest.skip(skipped[name])
    peer = loaded[0]
    shape = peers.PeerShape(peers.CHECK_N, peers.CHECK_K, peers.CHECK_GROUP_SIZES)
    for fmt in ("nvfp4", "w4a8"):
        inputs = peer.make_inputs(shape, fmt, 1 << 20, seed=peers.CHECK_SEED)
        device = peer.device_reference(inputs)
        host = peer.reference(inputs)   # float64 sums in another order: equal to ~1e-16 of the largest term
        device_first = peer.setting_reference(device, peer.settings[0])   # humming: one reference per setting
        np.testing.assert_allclose(peers._host64(device_first), host, rtol=0, atol=1e-12 * np.abs(host).max())
        for setting in peer.settings:
            check = peers.check_at_shape(peer, inputs, device, setting)
            assert check.passed, f"{name} {fmt} {setting}: {check}"
