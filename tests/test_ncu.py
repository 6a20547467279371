"""gbs.lab.ncu: reading ncu's per-instruction counts into regions and shares (CPU only)."""
from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from gbs.lab import ncu

NOTES = Path(__file__).resolve().parent.parent / "data" / "artifacts"
HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'


def _export(path: Path, rows, preamble=("==PROF== Connected to process 1", "some program output")) -> Path:
    lines = list(preamble) + [HEADER]
    lines += [f'"0x{16 * i:x}","{source}","{samples}","{executed}"' for i, (source, executed, samples) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = [
    ("LDC R1, c[0x0][0x28]", 10, 1),                 # prologue
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", 40, 3),   # a wait retried 4x
    ("@!P0 NANOSLEEP.SYNCS 0x989680", 40, 5),
    ("LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT", 100, 2),  # the MMA loop
    ("HMMA.16816.F32.BF16 R4, R8, R12, R4", 100, 7),
    ("STS.128 [R5], R8", 20, 1),                     # token decode
    ("EXIT", 10, 0),
]


def test_regions_group_equal_counts_in_order(tmp_path):
    regions = ncu.sass_regions(ncu.read_source_counters(_export(tmp_path / "src.csv", ROWS)))
    assert [(r.first, r.executed_each, len(r.instructions)) for r in regions] == [
        (0, 10, 1), (1, 40, 2), (3, 100, 2), (5, 20, 1), (6, 10, 1)]
    assert [r.issued for r in regions] == [10, 80, 200, 20, 10]
    assert regions[2].samples == 9
    assert [ncu.region_kind(r) for r in regions] == ["other", "mbarrier waits", "MMA loop", "token decode", "other"]


def test_shares_sum_to_one_and_read_gzip(tmp_path):
    plain = _export(tmp_path / "src.csv", ROWS)
    packed = tmp_path / "src.csv.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    shares = ncu.instruction_shares(packed)
    assert shares == ncu.instruction_shares(plain)
    assert list(shares) == ["MMA loop", "mbarrier waits", "token decode", "other"]
    assert shares == pytest.approx({"MMA loop": 200 / 320, "mbarrier waits": 80 / 320, "token decode": 20 / 320,
                                    "other": 20 / 320})


def test_bad_exports_are_refused(tmp_path):
    (tmp_path / "a.csv").write_text("==PROF== Disconnected from process 1\n")
    with pytest.raises(ValueError, match="no ncu source-page header"):
        ncu.read_source_counters(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text('"Address","Source"\n"0x0","EXIT"\n')
    with pytest.raises(ValueError, match="Instructions Executed"):
        ncu.read_source_counters(tmp_path / "b.csv")
    with pytest.raises(ValueError, match="no instruction was executed"):
        ncu.instruction_shares(_export(tmp_path / "c.csv", [("EXIT", 0, 0)]))


def test_the_measured_exports_show_what_the_notes_say():
    """The H200 exports kept in notes/h200 (runs 32 and 34): the streaming kernel's producer retried its
    mbarrier wait for ~20 % of the issued instructions before the waits slept, ~4-5 % after (what remains
    is every warp's one try per stage)."""
    before = ncu.instruction_shares(NOTES / "2026-11-30-ncu-source-nvfp4-decode-run32.csv.gz")
    after = ncu.instruction_shares(NOTES / "2026-11-30-ncu-source-nvfp4-decode-relaid-run34.csv.gz")
    assert before["mbarrier waits"] > 0.15 > 0.06 > after["mbarrier waits"]
    assert after["MMA loop"] > before["MMA loop"]


# ----------------------------------------------------------------------------------------------
# Whole-kernel metrics (--page raw) and scripts/ncu_compare.py
# ----------------------------------------------------------------------------------------------
RAW_HEADER = ('"ID","Kernel Name","gpu__time_duration.sum","lts__t_sectors.sum","launch__grid_size",'
              '"launch__block_size","smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_wait_not_issued",'
              '"smsp__pcsamp_warps_issue_stalled_barrier"')
RAW_UNITS = '"","","ns","sector","","","","",""'


def _raw(kernel, duration_ns, sectors, wait, barrier):
    return f'"0","{kernel}","{duration_ns:,}","{sectors:,}","132","384","{wait}","999","{barrier}"'


def test_raw_exports_read_every_kernel_of_every_export(tmp_path):
    path = tmp_path / "both.csv.gz"
    text = "\n".join([f"{ncu.EXPORT_MARK}ours.csv", "==PROF== Connected to process 1", "our program's output",
                      RAW_HEADER, RAW_UNITS, _raw("grouped_matmul_h200_wgmma", 431_700, 100_000_000, 30, 10),
                      "==PROF== Disconnected", f"{ncu.EXPORT_MARK}peer.csv", RAW_HEADER, RAW_UNITS,
                      _raw("device_kernel<GemmUniversal>", 354_000, 50_000_000, 0, 0)])
    path.write_bytes(gzip.compress(text.encode()))
    ours, peer = ncu.read_raw_exports(path)
    assert (ours.export, ours.kernel, peer.export, peer.kernel) == (
        "ours.csv", "grouped_matmul_h200_wgmma", "peer.csv", "device_kernel<GemmUniversal>")
    assert ours.number("lts__t_sectors.sum") == 100_000_000 and ours.metrics["gpu__time_duration.sum"][1] == "ns"
    assert ours.number("no_such_metric") is None
    # the not-issued counts are not reasons of their own; a kernel without samples has no shares
    assert ours.stall_shares() == {"wait": 0.75, "barrier": 0.25} and peer.stall_shares() == {}
    table = {row[0]: row[1:] for row in ncu.compare_kernels([ours, peer], stalls=2)}
    assert table["duration (us)"] == ["431.7", "354.0"]
    assert table["L2 sectors"] == ["100,000,000", "50,000,000"]
    assert table["grid x block"] == ["132 x 384", "132 x 384"]
    assert table["tensor pipe busy (% active)"] == ["-", "-"]   # not in this export
    assert table["stall #1 (% of samples)"] == ["wait 75.0", "-"]
    assert table["stall #2 (% of samples)"] == ["barrier 25.0", "-"]


def test_a_file_without_a_raw_export_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("==PROF== Disconnected from process 1\n")
    with pytest.raises(ValueError, match="no ncu raw export"):
        ncu.read_raw_exports(tmp_path / "a.csv")


def test_the_kept_fold_export_shows_what_its_evidence_row_says():
    """data/artifacts' export of the folded route and torch's FP8 kernel on large prefill up (evidence fold-ncu /
    fold-floors): the tensor pipe busy about half of the active cycles against torch's 88 %, 2.3x torch's L2
    sectors, 70 % L2 busy against 45 %."""
    ours, torch = ncu.read_raw_exports(NOTES / "2026-12-03-fold-ncu-raw-9611d4e.csv.gz")
    assert ours.kernel.startswith("grouped_matmul_h200_wgmma") and "device_kernel" in torch.kernel
    table = {row[0]: row[1:] for row in ncu.compare_kernels([ours, torch])}
    assert table["tensor pipe busy (% active)"] == ["52.59", "88.31"]
    assert table["L2 busy (% elapsed)"] == ["69.71", "44.95"]
    assert 2.2 < ours.number("lts__t_sectors.sum") / torch.number("lts__t_sectors.sum") < 2.4


def test_ncu_compare_script_summarizes_and_finds_the_points_case(capsys, monkeypatch):
    from script_modules import load_script
    script = load_script("ncu_compare")
    assert script.point_field("plan:auto:mxfp4:large_prefill_up:n192", script.BENCH_CASES, "case") == \
        "large_prefill_up"
    assert script.point_field("wgmma:w4a8:decode_up:128:4", script.PROBLEM_FORMATS, "format") == "w4a8"
    with pytest.raises(ValueError, match="bench case"):
        script.point_field("plan:auto:mxfp4:4096,7168,8,1024", script.BENCH_CASES, "bench case")
    assert script.main(["--summarize", str(NOTES / "2026-12-03-fold-ncu-raw-9611d4e.csv.gz")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"tensor pipe busy \(% active\) +52\.59 +88\.31", out)
    monkeypatch.setattr(script.shutil, "which", lambda name: None)   # no Nsight Compute here
    with pytest.raises(SystemExit, match="ncu is not on PATH"):
        script.main(["plan:auto:mxfp4:large_prefill_up", "--out", "/tmp/gbs-ncu-test"])
