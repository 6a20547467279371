"""The issues' targets (``data/targets.csv``) judged on bench rows: docs/targets.md equals its rendering from the
committed CSVs; each measure, a peer's named setting read from its note, missing rows and the out-of-reach mark on
tiny CSVs; bad target rows are refused."""
from __future__ import annotations

import pytest

from gbs import evidence
from gbs.lab import report, targets
from gbs.lab.cases import BENCH_CASES
from test_report import REPO, _bench_files, _row

HUMMING_NOTE = ("other settings: MXFP4 weights x bf16 tokens: 734.0 us (max row err 7.81e-03); "
                "NVFP4 weights x bf16 tokens: 771.5 us (max row err 9.16e-03)")


def _target(**fields) -> targets.Target:
    base = dict(id="t", issue="31", goal="g", columns=("nvfp4",), cases=("decode_up",), measure="speedup",
                peer="torch_bf16", peer_setting="", bound=1.0, ruled_out_by="")
    return targets.Target(**{**base, **fields})


def test_the_committed_targets_page_is_the_rendering_and_names_only_known_things():
    assert report.check(REPO) == []
    assert targets.TARGETS_DOC in report.rendered(REPO)
    ids = set(evidence.table())
    for target in targets.read_targets(REPO):
        assert set(target.cases) <= set(BENCH_CASES), target.id
        assert set(target.columns) <= set(report.FORMAT_NAMES), target.id
        assert not target.ruled_out_by or target.ruled_out_by in ids, target.id


def test_each_measure_against_its_bound(tmp_path):
    rows = [_row("gbs_auto", "ours", 100.0, nbytes=360_000_000), _row("torch_bf16", "peer", 95.0)]
    files = _bench_files(tmp_path, {"run.csv": rows})
    speedup, slow, fast_enough, too_slow, ceiling = targets.outcomes(
        [_target(bound=0.9), _target(bound=1.0, ruled_out_by="promotion-floor"),
         _target(measure="median_us", peer="", bound=120.0), _target(measure="median_us", peer="", bound=90.0),
         _target(measure="read_ceiling_pct", peer="", bound=88)], files)
    assert (speedup.ours_us, speedup.peer_us, speedup.measured, speedup.status) == (100.0, 95.0, 0.95, "met")
    assert slow.status == "not met: out of reach (evidence `promotion-floor`)"
    assert (fast_enough.status, too_slow.status, fast_enough.measured) == ("met", "not met", 100.0)
    assert ceiling.measured == pytest.approx(90.0) and ceiling.status == "met"   # 3.6 GB in 100 us of 4.0 TB/s
    page = targets.render_targets([_target(bound=1.0)], files)
    assert "| NVFP4 | `decode_up` | 100.0 | 95.0 | 0.95x | >= 1.00x | not met | `data/bench/run.csv` |" in page


def test_a_named_peer_setting_is_read_from_the_row_or_its_note(tmp_path):
    humming = _row("humming", "peer", 589.9, peer_setting="MXFP4 weights x FP8 tokens (fp32 scales per 1x128)",
                   note=HUMMING_NOTE)
    files = _bench_files(tmp_path, {"run.csv": [_row("gbs_auto", "ours", 700.0), humming]})
    own, bf16, nvfp4, absent = targets.outcomes([
        _target(peer="humming", peer_setting="MXFP4 weights x FP8"),
        _target(peer="humming", peer_setting="MXFP4 weights x bf16"),
        _target(peer="humming", peer_setting="NVFP4 weights x bf16"),
        _target(peer="humming", peer_setting="W4A8 tokens")], files)
    assert (own.peer_us, bf16.peer_us, nvfp4.peer_us, absent.peer_us) == (589.9, 734.0, 771.5, None)
    assert absent.status == "not measured"


def test_a_case_or_peer_without_rows_is_not_measured(tmp_path):
    files = _bench_files(tmp_path, {"run.csv": [_row("gbs_auto", "ours", 100.0)]})
    no_peer, no_case = targets.outcomes([_target(), _target(cases=("kimi_decode",))], files)
    assert no_peer.status == no_case.status == "not measured" and no_case.source is None


@pytest.mark.parametrize("fields, message", [
    (dict(measure="tflops"), "not one of"), (dict(peer=""), "needs a peer"),
    (dict(measure="median_us"), "the other measures none"), (dict(cases=()), "no columns or no cases")])
def test_bad_targets_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        _target(**fields)


def test_a_targets_csv_with_other_columns_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / targets.TARGETS_CSV).write_text("id,goal\nx,y\n")
    with pytest.raises(ValueError, match="columns"):
        targets.read_targets(tmp_path)
