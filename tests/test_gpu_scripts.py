"""The GPU scripts' command lines, on the CPU: ``scripts/h200_stream_sweep.py``'s points (the wgmma
operands suffix included) and trace summary, and ``scripts/sanitize_small.py``'s kernel / format filters.
Their GPU runs are recorded in ``notes/h200/``."""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from gbs.dispatch import AUTO_STAGES
from gbs.numba_kernels import h200_stream, h200_wgmma

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep():
    return load_script("h200_stream_sweep")


@pytest.mark.parametrize("point, config, num_ctas", [
    ("wgmma:mxfp8:large_prefill_up:256:auto", h200_wgmma.WgmmaConfig(256, AUTO_STAGES), None),
    ("wgmma:mxfp8:large_prefill_up:128:4:e4m3", h200_wgmma.WgmmaConfig(128, 4, "e4m3"), None),
    ("wgmma:mxfp8:4096,7168,32,64:128:auto:66:e4m3", h200_wgmma.WgmmaConfig(128, AUTO_STAGES, "e4m3"), 66),
    ("wgmma:nvfp4:decode_up:128:3:132", h200_wgmma.WgmmaConfig(128, 3), 132),
])
def test_sweep_parses_wgmma_points(sweep, point, config, num_ctas):
    fmt, case, parsed, k_splits, ctas = sweep.parse_point(point)
    assert parsed == config and ctas == num_ctas and k_splits is None and fmt == point.split(":")[1]


def test_sweep_parses_stream_and_plan_points(sweep):
    fmt, case, config, k_splits, ctas = sweep.parse_point("nvfp4:512,256,8,1:T:8:1:2:4:144")
    assert (fmt, case.n, case.k, config, k_splits, ctas) == (
        "nvfp4", 512, 256, h200_stream.StreamConfig(True, 8, 1, 2), 4, 144)
    assert sweep.parse_point("plan:auto:w4a8:kimi_decode")[2] == "auto"


@pytest.mark.parametrize("point", ["wgmma:mxfp8:large_prefill_up:256:auto:e4m3", "wgmma:mxfp8:x:128:auto",
                                   "nvfp4:decode_up:Y:8:1:2:1", "plan:simt:nvfp4:decode_up"])
def test_sweep_refuses_bad_points(sweep, point):
    with pytest.raises(ValueError):
        sweep.parse_point(point)


def test_sanitize_small_refuses_unknown_arguments():
    sanitize = load_script("sanitize_small")
    with pytest.raises(SystemExit, match="unknown arguments.*'mxfp9'"):
        sanitize.main(["h200_wgmma", "mxfp9"])


def test_sanitize_small_runs_the_chosen_kernel_and_format_only(monkeypatch, capsys):
    """The simt kernel on MXFP8 only, in Numba's CUDA simulator's stead: the kernel call is replaced by the
    reference, so this checks the selection and the report, not the kernel."""
    sanitize = load_script("sanitize_small")
    from gbs.reference import reference_grouped_matmul

    calls = []
    monkeypatch.setattr(sanitize.simt, "grouped_matmul_simt",
                        lambda p, config: calls.append(p.a_format.name) or reference_grouped_matmul(p))
    assert sanitize.main(["simt", "mxfp8"]) == 0
    assert calls == ["mxfp8"]
    out = capsys.readouterr().out
    assert "mxfp8  simt" in out and "PASS" in out and out.strip().endswith("0 failed")


def test_sweep_trace_summary_is_per_launch_and_skips_unlaunched_copies(sweep):
    events = len(h200_stream.TRACE_EVENTS)
    records = np.zeros((3, 2, events, h200_stream.TRACE_RECORD_WORDS), np.uint64)
    for copy, start in ((0, 1_000_000), (1, 5_000_000)):   # copy 2: never launched (all zero)
        for cta in range(2):
            for i, event in enumerate(h200_stream.TRACE_PRODUCER_CHAIN):
                records[copy, cta, event, 0] = start + 100 * cta + 1000 * i
            for i, event in enumerate(h200_stream.TRACE_CONSUMER_CHAIN[1:], start=1):
                records[copy, cta, event, 0] = start + 100 * cta + 2000 * i
    lines = sweep.trace_summary(records)
    assert "2 launches" in lines[0]
    phase_rows = {" ".join(line.split()[:-5]): [float(v) for v in line.split()[-5:-2]] for line in lines[1:]}
    # median / p10 / p90 of the two CTAs' skews (0 and 100 ns) of both launches, not 4 ms across launches
    assert phase_rows["entry skew"] == [50.0, 0.0, 100.0], "skew is measured inside each launch"
    assert phase_rows["launch span"][0] == 100 + 2000 * (len(h200_stream.TRACE_CONSUMER_CHAIN) - 1)
    assert phase_rows["entry -> barriers_ready"] == [1000.0] * 3
    assert sweep.trace_summary(records[2:]) == ["no launch wrote its trace"]
