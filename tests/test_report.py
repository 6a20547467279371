"""The results tables: README's headline block and docs/results.md equal what ``python -m gbs report`` renders
from the committed CSVs of ``data/bench/``; a number edited by hand is caught; the rendering itself (ratios,
the read-ceiling share, host-bound / unverified marks, the peers kept out of the headline) on tiny CSVs."""
from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest

from gbs.__main__ import main
from gbs.lab import report
from gbs.lab.bench import write_csv

REPO = Path(__file__).resolve().parents[1]


def _copy_repo_texts(dst: Path) -> Path:
    """README.md, docs/results.md and data/bench/*.csv of the repository, copied under ``dst``."""
    (dst / "docs").mkdir(parents=True)
    shutil.copy(REPO / report.README, dst / report.README)
    shutil.copy(REPO / report.RESULTS, dst / report.RESULTS)
    shutil.copytree(REPO / report.BENCH_DIR, dst / report.BENCH_DIR)
    return dst


def _headline_block(readme: str) -> str:
    return readme[readme.index(report.HEADLINE_BEGIN):readme.index(report.HEADLINE_END)]


# ----------------------------------------------------------------------------------------------
# The committed text against the committed CSVs
# ----------------------------------------------------------------------------------------------
def test_committed_tables_equal_the_rendering_of_the_committed_csvs():
    assert report.check(REPO) == [], "run `python -m gbs report --write` and commit the result"


def test_cli_check_passes_on_the_repository(capsys):
    assert main(["report", "--check", "--root", str(REPO)]) == 0


def test_readme_is_a_front_door():
    readme = (REPO / report.README).read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    lines = readme.splitlines()
    assert "make demo" in "\n".join(lines[:5]) and "make test" in "\n".join(lines[:5])
    block = _headline_block(readme)
    assert "triton" not in block.lower()   # not a headline peer (issue 32, item 5)
    for doc in ("docs/design/formats.md", "docs/design/dispatch.md", "docs/design/sm100_kernel.md",
                "docs/design/h200_port.md", "docs/design/workloads.md", "docs/design/toolchain.md",
                "docs/results.md", "docs/history.md", "data/h200_evidence.csv"):
        assert doc in readme, doc


def test_no_measured_number_in_readme_prose_outside_the_block():
    """Outside the generated block, no figure with a unit of time, rate or speed-up."""
    readme = (REPO / report.README).read_text(encoding="utf-8")
    begin, end = readme.index(report.HEADLINE_BEGIN), readme.index(report.HEADLINE_END)
    prose = readme[:begin] + readme[end:]
    figure = re.compile(r"\d[\d.,]*\s*(us|µs|ms|TB/s|GB/s|TFLOP/s|x\b|%)")
    found = [m.group(0) for m in figure.finditer(prose)]
    assert not found, found


def test_ratios_and_shares_agree_with_the_columns_the_bench_wrote():
    """The report recomputes ratios and read-ceiling shares from medians, bytes and ceilings; the bench's own
    columns say the same."""
    for f in report.load_bench_dir(REPO):
        for fmt in f.formats:
            rows = f.rows_of(fmt)
            for case in report.cases(rows):
                rs = report.case_rows(rows, case)
                ours = report.ours_row(rs)
                for peer in report.peer_methods(rs):
                    column = f"speedup_vs_{peer}"
                    if column in f.columns and ours.get(column):
                        assert report.ratio(report.peer_row(rs, peer), ours) == pytest.approx(
                            float(ours[column]), rel=1e-9), (f.path, fmt, case, peer)
                for r in rs:
                    if r.get("pct_read_ceiling"):
                        assert report.pct_read_ceiling(r) == pytest.approx(float(r["pct_read_ceiling"]), rel=1e-9)


# ----------------------------------------------------------------------------------------------
# A number edited by hand is caught
# ----------------------------------------------------------------------------------------------
def _plant_edit(text: str, after: str) -> tuple[str, str, str]:
    """``text`` with the first timed value (a number with one decimal, e.g. a median in us) of the first table
    row after ``after`` raised by 0.1, as a hand edit would; and the value before and after."""
    start = text.index(after)
    m = re.compile(r"^\| `[^`]*` \|.*?\| (\d+\.\d)\b", re.M).search(text, start)
    old = m.group(1)
    new = f"{float(old) + 0.1:.1f}"
    return text[:m.start(1)] + new + text[m.end(1):], old, new


@pytest.mark.parametrize("target,after", [(report.README, report.HEADLINE_BEGIN), (report.RESULTS, "## ")])
def test_a_number_edited_by_hand_is_reported(tmp_path, target, after, capsys):
    root = _copy_repo_texts(tmp_path)
    assert report.check(root) == []
    path = root / target
    text = path.read_text(encoding="utf-8")
    edited, old, new = _plant_edit(text, after)
    assert old != new and edited != text
    path.write_text(edited, encoding="utf-8")
    assert report.check(root) == [target]
    assert main(["report", "--check", "--root", str(root)]) == 1
    assert target in capsys.readouterr().err
    assert report.write(root) == [target]   # --write puts the rendering back
    assert path.read_text(encoding="utf-8") == text and report.check(root) == []


def test_a_readme_without_markers_is_reported(tmp_path):
    root = _copy_repo_texts(tmp_path)
    readme = root / report.README
    readme.write_text(readme.read_text(encoding="utf-8").replace(report.HEADLINE_END, ""), encoding="utf-8")
    assert report.check(root) == [report.README]


def test_a_changed_csv_is_reported(tmp_path):
    """Data changed and text not re-rendered: both files differ."""
    root = _copy_repo_texts(tmp_path)
    path = sorted((root / report.BENCH_DIR).glob("*.csv"))[-1]   # the newest: the one the README renders
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    ours = next(r for r in rows if r["kind"] == "ours")
    ours["median_us"] = str(float(ours["median_us"]) * 0.5)
    write_csv(str(path), rows)
    assert report.check(root) == [report.README, report.RESULTS]


# ----------------------------------------------------------------------------------------------
# Rendering on tiny synthetic CSVs
# ----------------------------------------------------------------------------------------------
BASE = {"case": "decode_up", "n": "4096", "k": "7168", "routing": "uniform", "slots": "64",
        "tokens_per_expert": "4", "status": "ok", "note": "", "useful_flops": "1000000000",
        "read_ceiling_tbps": "4.0", "gpu": "NVIDIA H200", "gpu_uuid": "GPU-x", "commit": "abc1234",
        "p10_us": "", "p90_us": ""}


def _row(method, kind, median, *, fmt="nvfp4", nbytes=400_000_000, date="2026-12-01", **extra):
    row = dict(BASE, format=fmt, method=method, kind=kind, method_format=f"{method} fmt", median_us=str(median),
               p10_us=str(median * 0.99), p90_us=str(median * 1.01), useful_bytes=str(nbytes), date=date)
    row.update(extra)
    return row


def _bench_files(tmp_path: Path, tables: dict[str, list[dict]]) -> list[report.BenchFile]:
    (tmp_path / report.BENCH_DIR).mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        write_csv(str(tmp_path / report.BENCH_DIR / name), rows)
    return report.load_bench_dir(tmp_path)


def _flagged_rows(host_bound_peer="False", verified_ours="True"):
    return [
        _row("gbs_auto", "ours", 100.0, host_bound="False", verified=verified_ours),
        _row("torch_bf16", "peer", 400.0, host_bound=host_bound_peer, verified="True"),
        _row("torch_fp8_rowwise", "peer", 250.0, host_bound="False", verified="True"),
        _row("torch_fp8_rowwise_fast_accum", "peer", 200.0, host_bound="False", verified="True"),
        _row("triton_dot_scaled", "peer", 5000.0, host_bound="False", verified="True"),
        _row("copy", "peer", 90.0, host_bound="False", verified=""),
    ]


def test_headline_ratios_share_and_fastest_fp8_peer(tmp_path):
    files = _bench_files(tmp_path, {"run.csv": _flagged_rows()})
    headline = report.render_headline(files)
    # 400 / 100, and the faster of the two torch FP8 peers: 200 / 100; 400 MB in 100 us of 4 TB/s: 100 %
    assert "| 100.0: 4.00x / 2.00x, 100.0 % |" in headline
    assert "| 400.0 | 200.0 |" in headline
    assert "`torch_fp8_rowwise_fast_accum`" in headline
    assert "triton" not in headline.lower() and "5000" not in headline
    assert "abc1234" in headline and "NVIDIA H200" in headline and "2026-12-01" in headline
    assert "`host_bound`: no row shown here is flagged" in headline


def test_full_tables_keep_triton_apart_with_its_label(tmp_path):
    files = _bench_files(tmp_path, {"run.csv": _flagged_rows()})
    results = report.render_results(files)
    main_tables, triton = results.split("### NVFP4: `triton_dot_scaled`, not a headline peer")
    assert "triton" not in main_tables.split("### NVFP4: gbs")[1].lower()
    assert triton.startswith(": one launch per group, untuned")
    assert "| 5000.0 |" in triton and "| 50.00x |" in triton   # 5000 / 100
    assert "| 4.00x | 2.50x | 2.00x | 0.90x |" in results        # x bf16, x fp8, x fp8 fast, x copy
    assert "99.0-101.0" in results                                 # p10-p90 of ours


def test_host_bound_and_unverified_rows_are_marked_in_every_table(tmp_path):
    files = _bench_files(tmp_path, {"run.csv": _flagged_rows(host_bound_peer="True", verified_ours="False")})
    headline, results = report.render_headline(files), report.render_results(files)
    for text in (headline, results):
        assert f"100.0{report.UNVERIFIED_MARK}" in text       # ours, not verified
        assert f"400.0{report.HOST_BOUND_MARK}" in text       # torch bf16, host-bound
        assert report.HOST_BOUND_NOTE in text and report.UNVERIFIED_NOTE in text
    assert f"{report.UNVERIFIED_MARK}: " not in headline.split("|---|")[0]
    assert "copy" in results and f"90.0{report.UNVERIFIED_MARK}" not in results   # blank: not flagged


def test_csvs_without_the_flag_columns_say_not_recorded(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("host_bound", "verified")} for r in _flagged_rows()]
    files = _bench_files(tmp_path, {"old.csv": rows})
    for text in (report.render_headline(files), report.render_results(files)):
        assert "`host_bound`: not recorded in `data/bench/old.csv`" in text
        assert "`verified`: not recorded in `data/bench/old.csv`" in text
        assert report.HOST_BOUND_MARK + "|" not in text


def test_headline_takes_each_format_from_its_newest_csv(tmp_path):
    old = [_row("gbs_auto", "ours", 300.0, date="2026-11-30"), _row("torch_bf16", "peer", 600.0, date="2026-11-30")]
    new = [_row("gbs_auto", "ours", 150.0), _row("torch_bf16", "peer", 600.0)]
    mx = [_row("gbs_auto", "ours", 200.0, fmt="mxfp8", date="2026-11-30"),
          _row("torch_bf16", "peer", 600.0, fmt="mxfp8", date="2026-11-30")]
    files = _bench_files(tmp_path, {"a-new.csv": new, "b-old.csv": old + mx})
    sources = report.headline_sources(files)
    assert [(fmt, case, f.path) for fmt, by_case in sources.items() for case, f in by_case.items()] == [
        ("nvfp4", "decode_up", "data/bench/a-new.csv"), ("mxfp8", "decode_up", "data/bench/b-old.csv")]
    headline = report.render_headline(files)
    assert "150.0: 4.00x" in headline and "200.0: 3.00x" in headline and "300.0" not in headline
    assert "| NVFP4 | MXFP8 |" in headline


def test_headline_adds_a_newer_run_of_other_cases_without_hiding_the_full_run(tmp_path):
    """A newer CSV of a few cases (the gpt-oss run) adds its rows; the cases it did not run keep the older full
    run's, and the footnote names which cases each file gave."""
    full = [_row("gbs_auto", "ours", 150.0), _row("torch_bf16", "peer", 600.0)]
    few = [_row("gbs_auto", "ours", 80.0, case="gptoss_decode_up", date="2026-12-02"),
           _row("torch_bf16", "peer", 320.0, case="gptoss_decode_up", date="2026-12-02")]
    files = _bench_files(tmp_path, {"full.csv": full, "few.csv": few})
    sources = report.headline_sources(files)
    assert {case: f.path for case, f in sources["nvfp4"].items()} == {
        "decode_up": "data/bench/full.csv", "gptoss_decode_up": "data/bench/few.csv"}
    headline = report.render_headline(files)
    assert "150.0: 4.00x" in headline and "80.0: 4.00x" in headline
    assert "- NVFP4 (`gptoss_decode_up`): `data/bench/few.csv`" in headline
    assert "- NVFP4 (`decode_up`): `data/bench/full.csv`" in headline
    assert headline.index("`decode_up` |") < headline.index("`gptoss_decode_up` |")   # the older run's first


def test_headline_keeps_the_benchmarks_case_order_when_a_newer_run_replaces_a_case(tmp_path):
    """A newer CSV of the large prefill cases replaces those rows of the full run; the table keeps BENCH_CASES'
    order (decode, then prefill), not the order of the files that gave the rows."""
    full = [_row(m, k, t, case=c) for c in ("decode_up", "large_prefill_up", "large_prefill_ragged")
            for m, k, t in (("gbs_auto", "ours", 150.0), ("torch_bf16", "peer", 600.0))]
    newer = [_row(m, k, t, case="large_prefill_up", date="2026-12-02")
             for m, k, t in (("gbs_auto", "ours", 120.0), ("torch_bf16", "peer", 600.0))]
    headline = report.render_headline(_bench_files(tmp_path, {"full.csv": full, "newer.csv": newer}))
    assert "120.0: 5.00x" in headline
    rows = [headline.index(f"`{c}` |") for c in ("decode_up", "large_prefill_up", "large_prefill_ragged")]
    assert rows == sorted(rows)


def test_headline_gives_a_route_its_own_column_beside_its_format(tmp_path):
    """``HEADLINE_ROUTES``: the folded FP8 route's rows form a column of their own, with the format's peers; the
    format's own column keeps its "auto" row, and a run without the route's method adds no column."""
    rows = [_row("gbs_auto_h200_fused", "ours", 200.0, fmt="mxfp4"), _row("gbs_fp8_folded", "ours", 100.0, fmt="mxfp4"),
            _row("torch_bf16", "peer", 400.0, fmt="mxfp4"), _row("torch_fp8_rowwise", "peer", 50.0, fmt="mxfp4")]
    headline = report.render_headline(_bench_files(tmp_path / "with", {"run.csv": rows}))
    assert "| MXFP4 | MXFP4 folded (FP8 route) |" in headline
    assert "| 200.0: 2.00x / 0.25x, 50.0 % | 100.0: 4.00x / 0.50x, 100.0 % |" in headline
    without = report.render_headline(_bench_files(tmp_path / "without", {"run.csv": [rows[0], *rows[2:]]}))
    assert "folded" not in without and "| 200.0: 2.00x / 0.25x, 50.0 % |" in without
    # a newer run of the route alone (and another opt-in route) fills the route's column, not the format's
    newer = [_row("gbs_fp8_folded", "ours", 90.0, fmt="mxfp4", date="2026-12-02"),
             _row("gbs_fp8_folded_relay", "ours", 95.0, fmt="mxfp4", date="2026-12-02"),
             _row("torch_bf16", "peer", 360.0, fmt="mxfp4", date="2026-12-02")]
    both = report.render_headline(_bench_files(tmp_path / "both", {"run.csv": rows, "zz.csv": newer}))
    assert "| 200.0: 2.00x / 0.25x, 50.0 % | 90.0: 4.00x / -, 111.1 % |" in both


def test_skipped_rows_show_their_reason(tmp_path):
    rows = _flagged_rows()
    rows[1].update(status="skipped", note="no torch", median_us="")
    results = report.render_results(_bench_files(tmp_path, {"run.csv": rows}))
    assert "skipped: no torch" in results


def test_write_then_check_on_a_fresh_tree(tmp_path):
    _bench_files(tmp_path, {"run.csv": _flagged_rows()})
    (tmp_path / "README.md").write_text(f"# x\n\n{report.HEADLINE_BEGIN}\n{report.HEADLINE_END}\n", encoding="utf-8")
    assert report.check(tmp_path) == [report.README, report.RESULTS]
    assert report.write(tmp_path) == [report.README, report.RESULTS]
    assert report.check(tmp_path) == [] and report.write(tmp_path) == []
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# x\n") and "100.0: 4.00x / 2.00x" in readme


def test_headline_takes_the_auto_method_that_ran_over_a_skipped_one():
    """MXFP8 weights have no fused FP4 layout: ``gbs_auto_h200_fused`` is skipped and ``gbs_auto`` ran."""
    rows = [dict(kind="ours", method="gbs_auto_h200_fused", status="skipped"),
            dict(kind="ours", method="gbs_auto", status="ok", median_us="291.1")]
    assert report.ours_row(rows)["method"] == "gbs_auto"
    assert report.ours_row(rows[:1])["method"] == "gbs_auto_h200_fused"   # nothing ran: the skipped row says why
