"""data/h200_evidence.csv: its columns, unique ids, kept files that exist, and ids that docs/history.md cites."""
from __future__ import annotations

import csv
import gzip
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "data" / "h200_evidence.csv"
COLUMNS = ["id", "date", "commit", "gpu", "command", "claim", "numbers", "artifact"]


def _rows() -> list[dict]:
    with open(EVIDENCE, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        return list(reader)


def test_ids_are_unique_slugs_and_every_row_is_filled():
    rows = _rows()
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    for row in rows:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", row["id"]), row["id"]
        assert all(row[c].strip() for c in COLUMNS if c != "artifact"), row["id"]


def test_every_artifact_exists_and_reads():
    for row in _rows():
        if not row["artifact"]:
            continue
        path = ROOT / row["artifact"]
        assert path.is_file(), f"{row['id']}: {row['artifact']} is missing"
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            assert f.read(1), f"{row['id']}: {row['artifact']} is empty"


def test_every_kept_artifact_is_cited_or_read_by_a_test():
    cited = {row["artifact"] for row in _rows()}
    kept = {f"data/artifacts/{p.name}" for p in (ROOT / "data" / "artifacts").iterdir()}
    assert not kept - cited, sorted(kept - cited)


def test_history_cites_only_existing_ids():
    ids = {row["id"] for row in _rows()}
    text = (ROOT / "docs" / "history.md").read_text()
    cited = {i.strip() for group in re.findall(r"\[([a-z0-9][a-z0-9, -]*)\](?!\()", text) for i in group.split(",")}
    assert cited, "docs/history.md cites no evidence id"
    assert cited <= ids, sorted(cited - ids)
