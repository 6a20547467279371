"""Evidence as data: every evidence id the code, the docs and the plan's rules cite is a row of
data/h200_evidence.csv; every row is complete (date, commit, GPU, command, claim, numbers), its artifacts (paths
separated by ";") exist and read, and every kept artifact is cited by a row."""
import csv
import gzip
import pathlib
import re

import pytest

from gbs import evidence

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULE_EVIDENCE = re.compile(r"Rule\([^()]*?,\s*\"([a-z0-9-]+)\"\)", re.S)


def cited_ids(text: str) -> set[str]:
    """Evidence ids a text cites: ``evidence: <id>`` / ``(evidence: <id>, <id>)`` and ``Rule(..., "<id>")``."""
    ids = set()
    for match in re.finditer(r"evidence[:=]\s*\(?([^)\n]*)", text):
        ids |= set(re.findall(r"\b([a-z0-9]+(?:-[a-z0-9]+)+|[a-z]+\d*)\b", match.group(1).split(")")[0]))
    ids |= set(RULE_EVIDENCE.findall(text))
    return {i for i in ids if "-" in i}


def cited_everywhere() -> dict[str, set[str]]:
    files = [*ROOT.glob("gbs/**/*.py"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]
    return {str(path.relative_to(ROOT)): cited_ids(path.read_text()) for path in files}


def rows() -> list[dict]:
    with open(evidence.EVIDENCE_CSV, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == evidence.COLUMNS
        return list(reader)


def artifacts(row) -> list[str]:
    return [path.strip() for path in row["artifact"].split(";") if path.strip()]


def test_the_table_has_its_columns_unique_slug_ids_and_complete_rows():
    table = rows()
    ids = [row["id"] for row in table]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    for row in table:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", row["id"]), row["id"]
        for column in ("date", "commit", "gpu", "command", "claim", "numbers"):
            assert row[column].strip(), f"{row['id']}: empty {column}"


def test_every_artifact_exists_reads_and_is_cited():
    cited = set()
    for row in rows():
        for name in artifacts(row):
            path = ROOT / name
            assert path.is_file(), f"{row['id']}: artifact {name} is not in the repository"
            with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
                assert f.read(1), f"{row['id']}: {name} is empty"
            cited.add(name)
    kept = {f"data/artifacts/{p.name}" for p in (ROOT / "data" / "artifacts").iterdir()}
    assert not kept - cited, f"kept but cited by no evidence row: {sorted(kept - cited)}"


def test_history_cites_only_existing_ids():
    ids = {row["id"] for row in rows()}
    text = (ROOT / "docs" / "history.md").read_text()
    cited = {i.strip() for group in re.findall(r"\[([a-z0-9][a-z0-9, -]*)\](?!\()", text) for i in group.split(",")}
    assert cited, "docs/history.md cites no evidence id"
    assert cited <= ids, sorted(cited - ids)


def test_every_cited_id_is_a_row():
    table = evidence.table()
    missing = {path: sorted(ids - set(table)) for path, ids in cited_everywhere().items() if ids - set(table)}
    assert not missing, f"evidence ids cited but not in {evidence.EVIDENCE_CSV.name}: {missing}"


def test_the_plan_rules_cite_evidence():
    plan_ids = cited_ids((ROOT / "gbs" / "plan.py").read_text())
    assert {"smalln-tiles", "smalln-stages", "smalln-eight-warps", "stream-split-k", "wgmma-min-tokens",
            "swapped-tiles", "swapped-split-k", "fp8-swapped-tiles", "wgmma-tile-width", "two-m-tiles",
            "ragged-tile-count", "fused-weight-layout"} <= plan_ids


def test_a_citation_of_a_missing_row_is_caught():
    """The scan finds a planted citation of an id the table does not hold (the check above can fail)."""
    planted = 'x = 1   # evidence: no-such-measurement\nRule("tile", "bn8", "another-missing-row")\n'
    assert {"no-such-measurement", "another-missing-row"} <= cited_ids(planted) - set(evidence.table())


@pytest.mark.parametrize("path", ["gbs", "scripts"])
def test_no_run_numbers_in_code(path):
    """Measurements live in the evidence table; code cites ids, not "run 123"."""
    pattern = re.compile(r"\bruns? \d{1,3}\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / path).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
