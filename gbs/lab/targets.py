"""The open issues' performance targets, as data (``data/targets.csv``), against the newest bench rows.

``python -m gbs report --write`` renders ``docs/targets.md`` from the targets and ``data/bench/*.csv``: one line per
target, headline column and case, with gbs's median, the peer's, the measured figure, the bound and the status
(met, not met, or not met with the evidence id of the arithmetic that rules it out). The rows are the README
headline's (``report.headline_sources``: the newest CSV that timed gbs on each column and case), so the targets move
with every bench run that lands.

A target row (``TARGET_COLUMNS``): ``columns`` and ``cases`` space-separated headline columns (formats, or a route
such as ``mxfp4_fp8_folded``) and bench cases; ``measure`` one of ``MEASURES``: ``speedup`` (the peer's median over
gbs's, at least ``bound``), ``median_us`` (gbs's median, at most ``bound``) or ``read_ceiling_pct`` (gbs's share of the
read ceiling measured with it, at least ``bound``); ``peer`` a bench peer (``torch_fp8``: the fastest ``torch_fp8*``
row) and ``peer_setting`` the start of one of its launch settings' names (humming's formats), blank for its fastest;
``ruled_out_by`` an evidence id (``data/h200_evidence.csv``) where arithmetic on measured figures shows the bound
out of reach.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from . import report

TARGETS_CSV = "data/targets.csv"
TARGETS_DOC = "docs/targets.md"
TARGET_COLUMNS = ("id", "issue", "goal", "columns", "cases", "measure", "peer", "peer_setting", "bound",
                  "ruled_out_by")
MEASURES = ("speedup", "median_us", "read_ceiling_pct")
FASTEST_TORCH_FP8 = "torch_fp8"


@dataclass(frozen=True)
class Target:
    id: str
    issue: str
    goal: str
    columns: tuple[str, ...]
    cases: tuple[str, ...]
    measure: str
    peer: str
    peer_setting: str
    bound: float
    ruled_out_by: str

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"target {self.id}: measure {self.measure!r} is not one of {MEASURES}")
        if (self.measure == "speedup") != bool(self.peer):
            raise ValueError(f"target {self.id}: a speedup needs a peer, the other measures none")
        if self.peer_setting and not self.peer:
            raise ValueError(f"target {self.id}: a peer setting without a peer")
        if not self.columns or not self.cases:
            raise ValueError(f"target {self.id}: no columns or no cases")


def read_targets(root=".") -> list[Target]:
    with open(Path(root) / TARGETS_CSV, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != TARGET_COLUMNS:
            raise ValueError(f"{TARGETS_CSV}: columns {reader.fieldnames}, want {TARGET_COLUMNS}")
        return [Target(r["id"], r["issue"], r["goal"], tuple(r["columns"].split()), tuple(r["cases"].split()),
                       r["measure"], r["peer"], r["peer_setting"], float(r["bound"]), r["ruled_out_by"])
                for r in reader]


def setting_median(row: dict | None, setting: str) -> float | None:
    """The median (us) of the peer's launch setting whose name starts with ``setting``: the row's own (its
    ``peer_setting``) or one its note lists among the other settings (``name: 734.0 us (...)``); None if absent."""
    if row is None:
        return None
    if (row.get("peer_setting") or "").startswith(setting):
        return report.median_of(row)
    note = row.get("note") or ""
    others = note[note.index(report.OTHER_SETTINGS_PREFIX) + len(report.OTHER_SETTINGS_PREFIX):] \
        if report.OTHER_SETTINGS_PREFIX in note else ""
    for entry in others.split("; "):
        match = re.match(r"(.+?): ([0-9.]+) us\b", entry)
        if match and match.group(1).startswith(setting):
            return float(match.group(2))
    return None


def peer_median(rows: list[dict], target: Target) -> float | None:
    row = report.fp8_peer_row(rows) if target.peer == FASTEST_TORCH_FP8 else report.peer_row(rows, target.peer)
    return setting_median(row, target.peer_setting) if target.peer_setting else report.median_of(row)


@dataclass(frozen=True)
class Outcome:
    """One target on one column and case: the figures it is judged on, and where they come from."""

    target: Target
    column: str
    case: str
    ours_us: float | None
    peer_us: float | None
    measured: float | None
    source: str | None

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.target.bound if self.target.measure == "median_us" else \
            self.measured >= self.target.bound

    @property
    def status(self) -> str:
        if self.met is None:
            return "not measured"
        if self.met:
            return "met"
        return f"not met: out of reach (evidence `{self.target.ruled_out_by}`)" if self.target.ruled_out_by \
            else "not met"


def outcomes(targets: list[Target], files: list[report.BenchFile]) -> list[Outcome]:
    sources = report.headline_sources(files)
    found = []
    for target in targets:
        for column in target.columns:
            for case in target.cases:
                f = sources.get(column, {}).get(case)
                rows = report.case_rows(report.headline_rows(f, column), case) if f else []
                ours = report.median_of(report.ours_row(rows)) if rows else None
                peer = peer_median(rows, target) if target.peer and rows else None
                if target.measure == "speedup":
                    measured = peer / ours if peer and ours else None
                elif target.measure == "median_us":
                    measured = ours
                else:
                    measured = report.pct_read_ceiling(report.ours_row(rows)) if ours else None
                found.append(Outcome(target, column, case, ours, peer, measured, f.path if f else None))
    return found


def _figure(o: Outcome) -> str:
    if o.measured is None:
        return "-"
    return {"speedup": f"{o.measured:.2f}x", "median_us": f"{o.measured:.1f} us",
            "read_ceiling_pct": f"{o.measured:.1f} %"}[o.target.measure]


def _bound(t: Target) -> str:
    return {"speedup": f">= {t.bound:.2f}x", "median_us": f"<= {t.bound:g} us",
            "read_ceiling_pct": f">= {t.bound:g} %"}[t.measure]


def render_targets(targets: list[Target], files: list[report.BenchFile]) -> str:
    """docs/targets.md, whole."""
    found = outcomes(targets, files)
    lines = ["# Performance targets against the newest bench rows", "",
             f"Generated by `{report.COMMAND}` from `{TARGETS_CSV}` (the targets, as the issues state them) and "
             f"`{report.BENCH_DIR}/*.csv` (the README headline's rows: the newest run of each column and case); do "
             "not edit by hand. gbs and the peer are timed in one process; `peer (us)` is the peer setting the target "
             "names (its fastest where it names none; `torch_fp8`: the fastest torch FP8 setting). \"Out of reach\" "
             "cites the evidence row whose arithmetic on measured figures rules the bound out.", ""]
    for target in targets:
        rows = [o for o in found if o.target is target]
        met = sum(1 for o in rows if o.met)
        lines += [f"## `{target.id}` (issue {target.issue}): {target.goal}", "",
                  f"{met} of {len(rows)} met.", ""]
        peer = f"{target.peer} {target.peer_setting}".strip() if target.peer else ""
        body = [[report.FORMAT_NAMES.get(o.column, o.column), f"`{o.case}`", report.format_number(o.ours_us),
                 report.format_number(o.peer_us) if peer else "", _figure(o), _bound(target), o.status,
                 f"`{o.source}`" if o.source else "-"] for o in rows]
        lines += report.markdown_table(["format", "case", "gbs (us)", f"peer (us): {peer}" if peer else "peer",
                                "measured", "bound", "status", "bench CSV"], body) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"
