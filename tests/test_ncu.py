"""gbs.lab.ncu: reading ncu's per-instruction counts into regions and shares (CPU only)."""
from __future__ import annotations

import gzip
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
