"""The measured evidence the code's thresholds rest on: ``data/h200_evidence.csv``, one row per measured fact (id,
date, commit, GPU, command, claim, numbers, artifact). Code cites a row by its id (``evidence: <id>`` in a comment,
``Rule(..., evidence=<id>)`` in the plan); ``tests/test_evidence.py`` checks that every cited id exists."""
from __future__ import annotations

import csv
import functools
from pathlib import Path

EVIDENCE_CSV = Path(__file__).resolve().parent.parent / "data" / "h200_evidence.csv"
COLUMNS = ("id", "date", "commit", "gpu", "command", "claim", "numbers", "artifact")


@functools.cache
def table() -> dict[str, dict[str, str]]:
    """Every row of the evidence table by id (empty where the checkout has no ``data/``: an installed wheel)."""
    if not EVIDENCE_CSV.exists():
        return {}
    with open(EVIDENCE_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    return {row["id"]: row for row in rows}


def summary(evidence_id: str) -> str:
    """One line for ``evidence_id``: its claim, numbers, GPU, date and commit (or that the table lacks it)."""
    row = table().get(evidence_id)
    if row is None:
        return f"(no row {evidence_id!r} in {EVIDENCE_CSV.name})"
    return f"{row['claim']} [{row['numbers']}] ({row['gpu']}, {row['date']}, commit {row['commit']})"
