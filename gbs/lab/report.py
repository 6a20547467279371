"""``python -m gbs report``: the results tables of README.md and docs/results.md, rendered from the bench CSVs.

Every number the README and ``docs/results.md`` show comes from a CSV under ``data/bench/`` (rows as
``gbs.lab.bench.build_rows`` writes them) through this module; ``tests/test_report.py`` checks that the
committed text equals what it renders from the committed CSVs.

* ``render_headline(files)``: the README's one compact table, between ``HEADLINE_BEGIN`` and
  ``HEADLINE_END``: per bench case, the torch peers' medians and, per format, gbs's median, its speed-up over
  torch bf16 and torch FP8 and its share of the measured read ceiling; for each format the newest CSV that
  holds it. Peers in ``NOT_HEADLINE_PEERS`` never appear there.
* ``render_results(files)``: ``docs/results.md`` whole: per CSV and format, gbs's rows, the peers' rows and,
  apart, the peers that are not headline peers; every case, median, p10-p90 spread and ratio.
* ``docs/targets.md``: the issues' targets (``data/targets.csv``) judged on the headline's rows
  (``gbs.lab.targets``).

Rows flagged host-bound (column ``host_bound`` true: the timing included host gaps) or not verified
(column ``verified`` false: the bench did not check that output) carry ``HOST_BOUND_MARK`` /
``UNVERIFIED_MARK`` in every table; a CSV without those columns is said not to record them.

``python -m gbs report`` prints both, ``--write`` rewrites them, ``--check`` exits 1 naming each file whose
committed text differs from the rendering.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from .cases import BENCH_CASES

BENCH_DIR = "data/bench"
README = "README.md"
RESULTS = "docs/results.md"
HEADLINE_BEGIN = "<!-- results:headline:begin -->"
HEADLINE_END = "<!-- results:headline:end -->"
COMMAND = "python -m gbs report --write"
REPO_ROOT = Path(__file__).resolve().parents[2]   # gbs/lab/report.py -> the repository

KIND_OURS = "ours"
KIND_PEER = "peer"
STATUS_OK = "ok"
FORMAT_ORDER = ("nvfp4", "mxfp4", "mxfp4_fp8_folded", "mxfp8", "w4a8")
FORMAT_NAMES = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "mxfp8": "MXFP8", "mxfp8_e5m2": "MXFP8 (E5M2)",
                "w4a8": "W4A8", "w4a16": "W4A16 (MXFP4)", "w4a16_nvfp4": "W4A16 (NVFP4)",
                "mxfp4_fp8_folded": "MXFP4 folded (FP8 route)"}
# Methods the headline gives a column of their own beside their format's "auto" one: routes a user opts into by
# preparing the operands differently (column -> (format, method)).
HEADLINE_ROUTES = {"mxfp4_fp8_folded": ("mxfp4", "gbs_fp8_folded")}
AUTO_PREFIX = "gbs_auto"   # gbs's methods that run a format's "auto" plan (the format's own column)
# Headline peers: torch bf16, and torch FP8 (the fastest of the ``torch_fp8*`` methods a CSV holds).
BF16_PEER = "torch_bf16"
HUMMING_PEER = "humming"   # the strongest Hopper MoE peer: its own column in the headline where a CSV has it
FP8_PEER_PREFIX = "torch_fp8"
# Peers timed in a way no user would run them: in docs/results.md apart, never in the README.
NOT_HEADLINE_PEERS = {
    "triton_dot_scaled": "not a headline peer: one launch per group, untuned (a Python loop over groups with "
                         "fixed tiles; issue 32, item 5)",
}
HOST_BOUND_MARK = "†"
UNVERIFIED_MARK = "‡"
HOST_BOUND_NOTE = (f"{HOST_BOUND_MARK} host-bound: the GPU ran out of queued launches, so the timing includes "
                   f"host gaps (column `host_bound`)")
UNVERIFIED_NOTE = f"{UNVERIFIED_MARK} output not verified by the bench (column `verified` false)"
_TRUE = {"true", "1", "yes", "y"}
_FALSE = {"false", "0", "no", "n"}


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)   # one object per file: hashed by identity
class BenchFile:
    """The rows of one bench CSV; ``path`` as the tables cite it (relative to the repository)."""

    path: str
    columns: tuple[str, ...]
    rows: tuple[dict, ...]

    def values(self, column: str, rows=None) -> list[str]:
        """The distinct non-blank values of ``column``, in order of appearance."""
        seen = {}
        for r in self.rows if rows is None else rows:
            v = (r.get(column) or "").strip()
            if v:
                seen.setdefault(v, None)
        return list(seen)

    def joined(self, column: str, rows=None) -> str:
        return ", ".join(self.values(column, rows)) or "not recorded"

    @property
    def formats(self) -> list[str]:
        return _ordered_formats(self.values("format"))

    def rows_of(self, fmt: str) -> list[dict]:
        return [r for r in self.rows if r.get("format") == fmt]

    def records(self, column: str) -> bool:
        return column in self.columns

    @property
    def date(self) -> str:
        return max(self.values("date"), default="")


def read_bench_csv(path, root=".") -> BenchFile:
    path = Path(path)
    with open(Path(root) / path if not path.is_absolute() else path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = tuple(dict(r) for r in reader)
        columns = tuple(reader.fieldnames or ())
    return BenchFile(path=path.as_posix(), columns=columns, rows=rows)


def load_bench_dir(root=".", bench_dir: str = BENCH_DIR) -> list[BenchFile]:
    """Every ``*.csv`` of ``bench_dir`` (sorted by name), paths relative to ``root``."""
    files = sorted((Path(root) / bench_dir).glob("*.csv"))
    if not files:
        raise FileNotFoundError(f"no bench CSV under {Path(root) / bench_dir}")
    return [read_bench_csv(Path(bench_dir) / f.name, root) for f in files]


def _ordered_formats(formats) -> list[str]:
    known = [f for f in FORMAT_ORDER if f in formats]
    return known + [f for f in formats if f not in known]


def _float(value):
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x else None   # NaN: blank


def _flag(row: dict, column: str):
    """True / False, or None when the row does not record it (column missing or blank)."""
    value = (row.get(column) or "").strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


def marks(row: dict) -> str:
    return (HOST_BOUND_MARK if _flag(row, "host_bound") is True else "") + \
        (UNVERIFIED_MARK if _flag(row, "verified") is False else "")


def median_of(row):
    return _float(row.get("median_us")) if row and row.get("status", STATUS_OK) == STATUS_OK else None


def ratio(peer_row, ours_row):
    """Peer median / gbs median (> 1: gbs is faster), or None."""
    p, o = median_of(peer_row), median_of(ours_row)
    return p / o if p and o else None


def pct_read_ceiling(row):
    """The row's own useful bytes per second as a percentage of the read ceiling measured with it."""
    us, nbytes, tbps = median_of(row), _float(row.get("useful_bytes")), _float(row.get("read_ceiling_tbps"))
    if us and nbytes and tbps:
        return 100 * nbytes / (us * 1e-6) / (tbps * 1e12)
    return _float(row.get("pct_read_ceiling"))


def tflops(row):
    us, flops = median_of(row), _float(row.get("useful_flops"))
    return flops / (us * 1e-6) / 1e12 if us and flops else None


def gbps(row):
    us, nbytes = median_of(row), _float(row.get("useful_bytes"))
    return nbytes / (us * 1e-6) / 1e9 if us and nbytes else None


# ----------------------------------------------------------------------------------------------
# Grouping
# ----------------------------------------------------------------------------------------------
def cases(rows) -> list[str]:
    return list(dict.fromkeys(r["case"] for r in rows))


def case_rows(rows, case: str) -> list[dict]:
    return [r for r in rows if r["case"] == case]


def runs_auto_plan(row: dict) -> bool:
    """A gbs row whose method runs its format's "auto" plan (``AUTO_PREFIX``), not a route a user opts into."""
    return row.get("kind") == KIND_OURS and row.get("method", "").startswith(AUTO_PREFIX)


def ours_row(rows) -> dict | None:
    """gbs's row of one (format, case): the first ``gbs_auto*`` method that ran (a skipped one, e.g. a weight layout
    that does not apply to the format, only where none ran), else the first ours."""
    ours = [r for r in rows if r.get("kind") == KIND_OURS]
    auto = [r for r in ours if runs_auto_plan(r)]
    ran = [r for r in auto if r.get("status", STATUS_OK) == STATUS_OK]
    return (ran or auto or ours or [None])[0]


def peer_methods(rows, headline: bool | None = None) -> list[str]:
    """Peer methods in order of appearance; ``headline`` True / False keeps only (not) headline peers."""
    names = list(dict.fromkeys(r["method"] for r in rows if r.get("kind") == KIND_PEER))
    if headline is None:
        return names
    return [m for m in names if (m not in NOT_HEADLINE_PEERS) == headline]


def peer_row(rows, method: str) -> dict | None:
    return next((r for r in rows if r.get("kind") == KIND_PEER and r["method"] == method), None)


def fp8_peer_row(rows) -> dict | None:
    """The fastest timed ``torch_fp8*`` peer of one (format, case), else its first such row."""
    fp8 = [r for r in rows if r.get("kind") == KIND_PEER and r["method"].startswith(FP8_PEER_PREFIX)]
    timed = [r for r in fp8 if median_of(r)]
    return min(timed, key=median_of) if timed else (fp8 or [None])[0]


def case_label(row: dict) -> tuple[str, str]:
    """("N x K", "experts x tokens") of a row's case, from its own columns."""
    shape = f"{row.get('n', '?')}x{row.get('k', '?')}"
    load = f"{row.get('slots', '?')} x {row.get('tokens_per_expert', '?')}"
    if row.get("routing", "uniform") not in ("", "uniform"):
        load += f" {row['routing']} (average)"
    return shape, load


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------
def format_number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1f} %"


def _us(row) -> str:
    """The median in us with the row's marks, or its status and note."""
    if row is None:
        return "-"
    us = median_of(row)
    if us is None:
        note = (row.get("note") or "").strip()
        return _cell(f"{row.get('status') or 'no time'}" + (f": {note}" if note else ""))
    return f"{us:.1f}{marks(row)}"


def _spread(row) -> str:
    lo, hi = _float(row.get("p10_us")), _float(row.get("p90_us"))
    return "-" if lo is None or hi is None or median_of(row) is None else f"{lo:.1f}-{hi:.1f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _flag_lines(files: list[BenchFile], rows_by_file: dict[str, list[dict]]) -> list[str]:
    """The footnotes on host-bound and unverified rows of ``rows_by_file`` (the rows a table shows)."""
    lines = []
    for column, mark, note, bad in (("host_bound", HOST_BOUND_MARK, HOST_BOUND_NOTE, True),
                                    ("verified", UNVERIFIED_MARK, UNVERIFIED_NOTE, False)):
        missing = [f.path for f in files if not f.records(column)]
        flagged = sum(_flag(r, column) is bad for f in files for r in rows_by_file.get(f.path, ()))
        recorded = [f for f in files if f.records(column)]
        if recorded:
            lines.append(f"{note}: {flagged} row(s) marked {mark}" if flagged else
                         f"`{column}`: no row shown here is flagged")
        if missing:
            lines.append(f"`{column}`: not recorded in " + ", ".join(f"`{p}`" for p in missing))
    return lines


# ----------------------------------------------------------------------------------------------
# The README headline table
# ----------------------------------------------------------------------------------------------
def headline_columns(f: BenchFile) -> list[str]:
    """The headline columns ``f`` has rows for: its formats, and the ``HEADLINE_ROUTES`` whose method it ran."""
    routes = [c for c, (fmt, method) in HEADLINE_ROUTES.items()
              if any(r.get("method") == method for r in f.rows_of(fmt))]
    return _ordered_formats(f.formats + routes)


def headline_rows(f: BenchFile, column: str) -> list[dict]:
    """``f``'s rows of a headline column: a format's (its peers and its ``gbs_auto*`` rows: a route a user opts into,
    timed alone in a run, never stands in for the format's plan), or a route's (its format's peers and the route's
    own rows)."""
    if column not in HEADLINE_ROUTES:
        return [r for r in f.rows_of(column) if r.get("kind") != KIND_OURS or runs_auto_plan(r)]
    fmt, method = HEADLINE_ROUTES[column]
    return [r for r in f.rows_of(fmt) if r.get("kind") != KIND_OURS or r.get("method") == method]


def headline_sources(files: list[BenchFile]) -> dict[str, dict[str, BenchFile]]:
    """For each headline column (format or route) and case, the newest CSV (latest ``date``, then file name) that has
    timed gbs on it: a run of a few cases (e.g. gpt-oss's) adds its rows without hiding the other cases' last full
    run."""
    chosen: dict[str, dict[str, BenchFile]] = {}
    for f in files:
        for fmt in headline_columns(f):
            for case in cases(headline_rows(f, fmt)):
                if ours_row(case_rows(headline_rows(f, fmt), case)) is None:
                    continue
                best = chosen.setdefault(fmt, {}).get(case)
                if best is None or (f.date, f.path) > (best.date, best.path):
                    chosen[fmt][case] = f
    return {fmt: chosen[fmt] for fmt in _ordered_formats(list(chosen))}


def _peer_range(rows: list[dict | None]) -> str:
    """The peers' medians of one case over the formats' processes: one value, or min-max."""
    timed = [r for r in rows if median_of(r) is not None]
    if not timed:
        return "-"
    lo, hi = min(timed, key=median_of), max(timed, key=median_of)
    if f"{median_of(lo):.1f}" == f"{median_of(hi):.1f}":
        return _us(lo) + "".join(m for r in timed for m in marks(r) if m not in marks(lo))
    return f"{_us(lo)}-{_us(hi)}"


def render_headline(files: list[BenchFile]) -> str:
    """The README's table (without the markers), a blank line before and after."""
    sources = headline_sources(files)
    if not sources:
        raise ValueError("no bench CSV holds a gbs row")
    per_case = {fmt: {case: case_rows(headline_rows(f, fmt), case) for case, f in by_case.items()}
                for fmt, by_case in sources.items()}
    # the benchmark's cases in its own order (BENCH_CASES), then any other in the order of the runs that cover the
    # most cases (the full runs) first
    widest_first = sorted({f.path: f for by_case in sources.values() for f in by_case.values()}.values(),
                          key=lambda f: (-len({r["case"] for r in f.rows}), f.date, f.path))
    case_order = list(dict.fromkeys(c for f in widest_first for fmt, by_case in sources.items()
                                    for c in cases(headline_rows(f, fmt)) if by_case.get(c) is f))
    known = list(BENCH_CASES)
    case_order.sort(key=lambda c: known.index(c) if c in known else len(known))
    with_humming = any(peer_row(rs, HUMMING_PEER) for by_case in per_case.values() for rs in by_case.values())
    header = ["case", "N x K", "experts x tokens", "torch bf16 (us)", "torch FP8 (us)"] + \
        (["humming (us)"] if with_humming else []) + [FORMAT_NAMES.get(fmt, fmt) for fmt in sources]
    body, shown = [], {}
    fp8_methods = {}
    for case in case_order:
        per_fmt = {fmt: by_case.get(case, []) for fmt, by_case in per_case.items()}
        first = next(rs[0] for rs in per_fmt.values() if rs)
        bf16s, fp8s, hums, cells = [], [], [], []
        for fmt, rs in per_fmt.items():
            ours, bf16, fp8 = ours_row(rs), peer_row(rs, BF16_PEER), fp8_peer_row(rs)
            hum = peer_row(rs, HUMMING_PEER)
            bf16s.append(bf16)
            fp8s.append(fp8)
            hums.append(hum)
            if fp8 is not None:
                fp8_methods.setdefault(fp8["method"], None)
            if rs:
                shown.setdefault(sources[fmt][case].path, []).extend(r for r in (ours, bf16, fp8, hum) if r is not None)
            if ours is None:
                cells.append("-")
                continue
            cells.append(f"{_us(ours)}: {_x(ratio(bf16, ours))} / {_x(ratio(fp8, ours))}, "
                         f"{_pct(pct_read_ceiling(ours))}")
        shape, load = case_label(first)
        body.append([f"`{case}`", shape, load, _peer_range(bf16s), _peer_range(fp8s)]
                    + ([_peer_range(hums)] if with_humming else []) + cells)
    lines = ["", *markdown_table(header, body), ""]
    lines.append("Each format's cell: gbs's median in us: its speed-up over torch bf16 / over torch FP8 (the "
                 "peer's median over gbs's, both timed in the same process), its share of the read ceiling "
                 "measured in that process (the bytes it must read per second). The torch columns give the "
                 "range of the peer over those processes. torch FP8 is "
                 + " / ".join(f"`{m}`" for m in fp8_methods) + " (the fastest where there are several)."
                 + (" humming is humming-kernels' fastest verified format on the case (each of its formats: "
                    "docs/results.md); only the processes that timed it." if with_humming else ""))
    lines.append("")
    used = list(dict.fromkeys(f for by_case in sources.values() for f in by_case.values()))
    for f in used:
        fmts = [fmt for fmt, by_case in sources.items() if f in by_case.values()]
        rows = [r for fmt in fmts for case, src in sources[fmt].items() if src is f
                for r in case_rows(headline_rows(f, fmt), case)]
        shown_cases = list(dict.fromkeys(r["case"] for r in rows))
        alone = all(len(set(sources[fmt].values())) == 1 for fmt in fmts)   # its formats' only source
        label = ", ".join(FORMAT_NAMES.get(fmt, fmt) for fmt in fmts) + \
            ("" if alone else " (" + ", ".join(f"`{c}`" for c in shown_cases) + ")")
        lines.append(f"- {label}: `{f.path}`: {f.joined('gpu', rows)}, {f.joined('date', rows)}, "
                     f"commit {f.joined('commit', rows)}, read ceiling "
                     + " / ".join(f"{float(v):.2f}" for v in f.values("read_ceiling_tbps", rows)) + " TB/s")
    flags = _flag_lines(used, shown)
    if flags:
        lines.append("")
        lines += [f"{line}." for line in flags]
    lines.append("")
    lines.append(f"Generated by `{COMMAND}` from `{BENCH_DIR}/`; every case, p10-p90 spread and peer: "
                 f"[docs/results.md](docs/results.md).")
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# docs/results.md
# ----------------------------------------------------------------------------------------------
RESULTS_INTRO = """\
# Results

<!-- Generated by `{command}` from the CSVs in `{bench_dir}/`. Do not edit by hand:
     tests/test_report.py checks that this file equals the rendering of the committed CSVs. -->

Every table here is rendered by `{command}` (module `gbs/lab/report.py`) from one CSV of `{bench_dir}/`,
as `python -m gbs bench` wrote it (`gbs/lab/bench.py`, `build_rows`). The README's headline table comes from
the same rows. What the columns mean:

- **median, p10-p90**: CUDA-event times of single launches after warm-up, inputs rotated past 4x the L2
  (the bench's rules, `gbs/lab/timing.py`).
- **TFLOP/s, GB/s**: the useful FLOPs and the fewest bytes *that method* must move (`useful_flops`,
  `useful_bytes`), per second of its median; **% read**: those bytes per second against the streaming-read
  ceiling measured in the same process (`read_ceiling_tbps`).
- **x peer**: the peer's median over gbs's median, both from the same process (> 1: gbs is faster).
- **ran**: the knobs of the kernel gbs ran (`ran_knobs`); **SM100 decision**: `ab_swapped`, `mma_bn`,
  `cta_group`, `stages` of the SM100 dispatch for the case, of which the H200 plan keeps what it can.
- **earlier figure**: the torch peers as measured before on this H200 (`bench.EARLIER_TORCH_FIGURES`), for
  comparison with this run's peer rows.
- {host_bound_note}; {unverified_note}. Where a CSV has no such column, its section says "not recorded".

Nothing here ran on a Blackwell GPU: the SM100 kernel is assembled and emulated only. The ablation sweep's
tables are rendered by `python -m gbs ablate --tables` from `data/ablations.csv`.
"""


def _decision(row) -> str:
    parts = []
    if row.get("ab_swapped"):
        parts.append("swapped" if _flag(row, "ab_swapped") else "not swapped")
    for column, prefix in (("mma_bn", "bn"), ("cta_group", "cg"), ("stages", "st")):
        if row.get(column):
            parts.append(f"{prefix}{row[column]}")
    return " ".join(parts) or "-"


def _file_header(f: BenchFile) -> list[str]:
    versions = ", ".join(f"{lib} {f.joined(lib)}" for lib in ("numpy", "numba", "numba_cuda", "ml_dtypes",
                                                               "torch", "triton") if f.records(lib))
    ceilings = []
    for column, unit, source in (("read_ceiling_tbps", "TB/s read", None),
                                 ("bf16_peak_tflops", "TFLOP/s dense bf16", "bf16_peak_source"),
                                 ("fp8_peak_tflops", "TFLOP/s dense fp8", "fp8_peak_source")):
        vals = [f"{float(v):.2f}" for v in f.values(column) if _float(v) is not None]
        if vals:
            src = f" ({f.joined(source)})" if source and f.records(source) else ""
            ceilings.append(f"{' / '.join(vals)} {unit}{src}")
    command = f.joined("command") if f.records("command") else "not recorded in the CSV"
    lines = [f"## `{f.path}`", "",
             f"- GPU: {f.joined('gpu')} ({f.joined('gpu_uuid')}); date {f.joined('date')}; commit "
             f"{f.joined('commit')}",
             f"- ceilings measured in the run: {'; '.join(ceilings) or 'not recorded'}",
             f"- versions: {versions or 'not recorded'}",
             f"- bench command: {command}; tables rendered by `{COMMAND}`"]
    lines += [f"- {line}" for line in _flag_lines([f], {f.path: list(f.rows)})]
    return lines + [""]


OTHER_SETTINGS_PREFIX = "other settings: "   # how bench._peer_row's note lists the settings that were not the row


def _computes_in(row) -> str:
    """The peer's format, and the launch setting that made the row (the fastest verified) where it has several."""
    setting = row.get("peer_setting")
    return (row.get("method_format") or "-") + (f": {setting}" if setting else "")


def _other_settings(row) -> str:
    """The peer's other settings with their medians, as the bench's note lists them; "-" where it has none."""
    note = row.get("note") or ""
    return note[note.index(OTHER_SETTINGS_PREFIX) + len(OTHER_SETTINGS_PREFIX):] \
        if OTHER_SETTINGS_PREFIX in note else "-"


def _format_tables(f: BenchFile, fmt: str) -> list[str]:
    rows = f.rows_of(fmt)
    name = FORMAT_NAMES.get(fmt, fmt)
    headline_peers, other_peers = peer_methods(rows, True), peer_methods(rows, False)
    lines = [f"### {name}: gbs", ""]
    body = []
    for case in cases(rows):
        rs = case_rows(rows, case)
        for ours in (r for r in rs if r.get("kind") == KIND_OURS):
            shape, load = case_label(ours)
            body.append([f"`{case}`", shape, load, f"`{ours['method']}`", _us(ours), _spread(ours),
                         format_number(tflops(ours)), format_number(gbps(ours), 0), _pct(pct_read_ceiling(ours))]
                        + [_x(ratio(peer_row(rs, p), ours)) for p in headline_peers]
                        + [f"`{ours['ran_knobs']}`" if ours.get("ran_knobs") else "-", _decision(ours)])
    lines += markdown_table(["case", "N x K", "experts x tokens", "method", "median (us)", "p10-p90 (us)", "TFLOP/s",
                     "GB/s", "% read"] + [f"x {p}" for p in headline_peers] + ["ran", "SM100 decision"], body)
    lines += ["", f"### {name}: peers", ""]
    body = []
    for case in cases(rows):
        for r in (peer_row(case_rows(rows, case), p) for p in headline_peers):
            if r is None:
                continue
            shape, load = case_label(r)
            body.append([f"`{case}`", shape, load, f"`{r['method']}`", _computes_in(r), _us(r),
                         _spread(r), format_number(tflops(r)), format_number(gbps(r), 0), _pct(pct_read_ceiling(r)),
                         _other_settings(r), r.get("earlier_figure") or "-"])
    lines += markdown_table(["case", "N x K", "experts x tokens", "peer", "computes in", "median (us)", "p10-p90 (us)",
                     "TFLOP/s", "GB/s", "% read", "its other settings", "earlier figure"], body)
    for method in other_peers:
        lines += ["", f"### {name}: `{method}`, {NOT_HEADLINE_PEERS[method]}", ""]
        body = []
        for case in cases(rows):
            rs = case_rows(rows, case)
            r = peer_row(rs, method)
            if r is None:
                continue
            shape, load = case_label(r)
            body.append([f"`{case}`", shape, load, r.get("method_format") or "-", _us(r), _spread(r),
                         format_number(tflops(r)), _x(ratio(r, ours_row(rs)))])
        lines += markdown_table(["case", "N x K", "experts x tokens", "computes in", "median (us)", "p10-p90 (us)",
                         "TFLOP/s", "its median over gbs's"], body)
    return lines + [""]


def render_results(files: list[BenchFile]) -> str:
    """docs/results.md, whole."""
    lines = [RESULTS_INTRO.format(command=COMMAND, bench_dir=BENCH_DIR, host_bound_note=HOST_BOUND_NOTE,
                                  unverified_note=UNVERIFIED_NOTE)]
    newest_first = sorted(sorted(files, key=lambda f: f.path), key=lambda f: f.date, reverse=True)
    for f in newest_first:
        lines += _file_header(f)
        for fmt in f.formats:
            lines += _format_tables(f, fmt)
    return "\n".join(lines).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------------------
# README block, write and check
# ----------------------------------------------------------------------------------------------
def replace_headline(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``."""
    begin, end = readme.find(HEADLINE_BEGIN), readme.find(HEADLINE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{README} lacks the markers {HEADLINE_BEGIN} ... {HEADLINE_END}")
    return readme[:begin + len(HEADLINE_BEGIN)] + "\n" + block.strip("\n") + "\n" + readme[end:]


def rendered(root=".", files: list[BenchFile] | None = None) -> dict[str, str]:
    """{relative path: the text it should hold}: README.md (its block replaced), docs/results.md and, where the
    repository states targets (``gbs.lab.targets``), docs/targets.md."""
    from .targets import TARGETS_CSV, TARGETS_DOC, read_targets, render_targets

    root = Path(root)
    files = load_bench_dir(root) if files is None else files
    readme = (root / README).read_text(encoding="utf-8")
    texts = {README: replace_headline(readme, render_headline(files)), RESULTS: render_results(files)}
    if (root / TARGETS_CSV).exists():
        texts[TARGETS_DOC] = render_targets(read_targets(root), files)
    return texts


def check(root=".", files: list[BenchFile] | None = None) -> list[str]:
    """The files whose committed text differs from the rendering (a README without markers differs)."""
    root = Path(root)
    try:
        expected = rendered(root, files)
    except ValueError:
        return [README]
    differ = []
    for rel, text in expected.items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            differ.append(rel)
    return differ


def write(root=".", files: list[BenchFile] | None = None) -> list[str]:
    """Rewrite the README block and docs/results.md; returns the files that changed."""
    root = Path(root)
    changed = []
    for rel, text in rendered(root, files).items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(rel)
    return changed


def cmd_report(args) -> int:
    root = Path(args.root)
    if args.check:
        differ = check(root)
        for rel in differ:
            print(f"{rel}: differs from what `{COMMAND}` renders from {BENCH_DIR}/ (run it)", file=sys.stderr)
        if not differ:
            print(f"{', '.join(rendered(root))} match {BENCH_DIR}/ (the README: its headline block)")
        return 1 if differ else 0
    if args.write:
        changed = write(root)
        print("rewrote " + ", ".join(changed) if changed else "nothing to rewrite: already up to date")
        return 0
    files = load_bench_dir(root)
    print(f"{HEADLINE_BEGIN}{render_headline(files)}{HEADLINE_END}\n")
    print(render_results(files), end="")
    return 0   # docs/targets.md: --write or --check


def add_report_parser(sub) -> None:
    """Register ``report`` on an ``argparse`` subparsers object (``python -m gbs report``)."""
    r = sub.add_parser("report", help="render the results tables of README.md, docs/results.md and docs/targets.md "
                                      f"from {BENCH_DIR}/*.csv",
                       description="Render the README's headline table and docs/results.md from the bench CSVs "
                                   f"in {BENCH_DIR}/ (and docs/targets.md: data/targets.csv judged on them): print the "
                                   "first two (default), rewrite all (--write) or check the committed text against "
                                   "them (--check: exit 1 naming each file that differs).")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite the block of {README}, {RESULTS} and "
                                                              "docs/targets.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if a committed table differs")
    r.add_argument("--root", default=str(REPO_ROOT), help=f"repository root (default: {REPO_ROOT})")
    r.set_defaults(func=cmd_report)
