"""Where a kernel's time and issued instructions go, from Nsight Compute's exports.

Two readers: ``read_raw_exports`` / ``compare_kernels`` put whole-kernel metrics of ours and a peer side by side
(``scripts/ncu_compare.py`` profiles both and prints them); the rest reads per-instruction counts, below.

Export one launch on the GPU machine (about half a minute per kernel; ``data/artifacts`` keeps the ones evidence rows cite)::

    ncu --section SourceCounters --page source --print-source sass --csv \\
        -k regex:grouped_matmul_h200_stream --launch-skip 3 --launch-count 1 \\
        python3 scripts/h200_stream_sweep.py --budget-s 0.05 nvfp4:decode_up:T:8:1:2:1 > src.csv

The CSV has one row per SASS instruction with "Instructions Executed" (warp-level issues summed over
the launch). Instructions that always run together (a loop body, a straight block) share that count,
so maximal runs of equal counts (``sass_regions``) are the kernel's basic regions, and each region's
count times its length is what it cost in issue slots. ``instruction_shares`` sorts the regions into
a few kinds by what they contain (``REGION_KINDS``): this is how the producer's mbarrier retry loop
(17-19 % of the streaming kernel's issues before the waits slept) and the per-item token decode cost
were found (evidence: producer-suspend-hint, ncu-decode-regions-run34; the exports in data/artifacts/).
"""
from __future__ import annotations

import csv
import gzip
import io
from dataclasses import dataclass
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
SOURCE = "Source"

# (kind, opcodes that put a region in it), first match wins. The MMA loop is where the tensor-core
# instructions are (the decode of the operands is unrolled around them); waits try an mbarrier (and retry:
# the timer read of the trap bound, YIELD, the sleeping NANOSLEEP); the token decode stores
# decoded fragments (STS.128) for the consumer warps. The rest is per-stage and per-tile work.
REGION_KINDS = (
    ("MMA loop", ("HMMA", "HGMMA")),
    ("mbarrier waits", ("SR_GLOBALTIMER", "YIELD", "NANOSLEEP", "TRYWAIT")),
    ("token decode", ("STS.128",)),
)
OTHER = "other"


@dataclass(frozen=True)
class SassRegion:
    """A maximal run of consecutive SASS instructions with the same execution count."""

    first: int                  # index of its first instruction in the listing
    executed_each: int          # warp-level issues of each of its instructions
    instructions: tuple[str, ...]
    samples: int                # warp-state samples landing on it

    @property
    def issued(self) -> int:
        return self.executed_each * len(self.instructions)


def read_source_counters(path) -> list[dict]:
    """The per-instruction rows of an ``ncu --page source --csv`` export (plain or ``.gz``); the lines
    ncu prints before the header (warnings, the program's own output) are skipped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if header is None:
        raise ValueError(f"{path}: no ncu source-page header (run ncu with --page source --csv)")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))
    missing = {EXECUTED, SOURCE} - set(rows[0] if rows else ())
    if missing:
        raise ValueError(f"{path}: columns {sorted(missing)} missing (collect --section SourceCounters)")
    return rows


def sass_regions(rows: list[dict]) -> list[SassRegion]:
    """Consecutive instructions grouped by equal execution count, in listing order."""
    regions: list[SassRegion] = []
    for index, row in enumerate(rows):
        executed = int(row[EXECUTED])
        samples = int(row.get(SAMPLES) or 0)
        source = row[SOURCE].strip()
        last = regions[-1] if regions else None
        if last is not None and last.executed_each == executed:
            regions[-1] = SassRegion(last.first, executed, last.instructions + (source,), last.samples + samples)
        else:
            regions.append(SassRegion(index, executed, (source,), samples))
    return regions


def region_kind(region: SassRegion) -> str:
    """``REGION_KINDS``' name of the first kind whose opcodes appear in the region, else ``OTHER``."""
    text = " ".join(region.instructions)
    return next((kind for kind, marks in REGION_KINDS if any(mark in text for mark in marks)), OTHER)


def instruction_shares(path) -> dict[str, float]:
    """Fraction of the launch's issued instructions per region kind (every kind of ``REGION_KINDS``
    and ``OTHER``, summing to 1)."""
    regions = sass_regions(read_source_counters(path))
    total = sum(region.issued for region in regions)
    if total == 0:
        raise ValueError(f"{path}: no instruction was executed")
    shares = dict.fromkeys([kind for kind, _ in REGION_KINDS] + [OTHER], 0.0)
    for region in regions:
        shares[region_kind(region)] += region.issued / total
    return shares


# ----------------------------------------------------------------------------------------------
# Whole-kernel metrics: ``ncu --set full --page raw --csv``, ours beside a peer's (scripts/ncu_compare.py)
# ----------------------------------------------------------------------------------------------
# (label, raw metric): the rows of ``compare_kernels``, what a tile or data-movement decision is read from. A metric
# an export lacks (another ncu version, or not collected) shows as "-".
RAW_METRICS = (
    ("duration (us)", "gpu__time_duration.sum"),
    ("SM clock (GHz)", "sm__cycles_elapsed.avg.per_second"),
    ("tensor pipe busy (% active)", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe busy (% elapsed)", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
    ("issue slots busy (% elapsed)", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("warp instructions", "smsp__inst_executed.sum"),
    ("L2 sectors", "lts__t_sectors.sum"),
    ("L2 sectors (% of peak)", "lts__t_sectors.sum.pct_of_peak_sustained_elapsed"),
    ("L2 busy (% elapsed)", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM bytes read", "dram__bytes_read.sum"),
    ("registers per thread", "launch__registers_per_thread"),
    ("shared memory per block", "launch__shared_mem_per_block"),
    ("grid x block", None),        # launch__grid_size x launch__block_size
    ("cluster size", "launch__cluster_size"),
)
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
EXPORT_MARK = "## "   # scripts/ncu_compare.py's line before each export it concatenates


@dataclass(frozen=True)
class RawKernel:
    """One profiled launch of an ``ncu --page raw --csv`` export: the export's name, the kernel's, its metrics."""

    export: str
    kernel: str
    metrics: dict      # raw metric -> (value text as ncu printed it, unit)

    def number(self, metric: str) -> float | None:
        """The metric as a number (ncu's thousands separators dropped), or None where absent or not numeric."""
        value = self.metrics.get(metric, ("", ""))[0].replace(",", "")
        try:
            return float(value)
        except ValueError:
            return None

    def stall_shares(self) -> dict[str, float]:
        """Each stall reason's share of the warp-state samples (PC sampling), largest first."""
        counts = {m[len(STALL_PREFIX):]: self.number(m) or 0.0 for m in self.metrics
                  if m.startswith(STALL_PREFIX) and not m.endswith("_not_issued")}
        total = sum(counts.values())
        if not total:
            return {}
        return dict(sorted(((k, v / total) for k, v in counts.items() if v), key=lambda kv: -kv[1]))


def read_raw_exports(path) -> list[RawKernel]:
    """Every kernel row of one or more ``--page raw --csv`` exports in one file (plain or ``.gz``; several exports
    each after an ``EXPORT_MARK`` line naming it). Lines that are not the CSV (ncu's notes, the program's output) are
    skipped; the line after each header holds the units."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    kernels, export, i = [], path.name, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(EXPORT_MARK):
            export = line[len(EXPORT_MARK):].strip()
        elif line.startswith('"ID"'):
            block = [line]
            while i + 1 < len(lines) and lines[i + 1].startswith('"'):
                i += 1
                block.append(lines[i])
            header, units, *rows = csv.reader(io.StringIO("\n".join(block)))
            for row in rows:
                metrics = {name: (value, unit) for name, unit, value in zip(header, units, row)}
                kernels.append(RawKernel(export, metrics.get("Kernel Name", ("?", ""))[0], metrics))
        i += 1
    if not kernels:
        raise ValueError(f"{path}: no ncu raw export (run ncu with --page raw --csv)")
    return kernels


def _metric_text(kernel: RawKernel, label: str, metric: str | None) -> str:
    if label == "grid x block":
        grid, block = kernel.number("launch__grid_size"), kernel.number("launch__block_size")
        return "-" if grid is None or block is None else f"{grid:.0f} x {block:.0f}"
    value = kernel.number(metric)
    if value is None:
        return "-"
    if metric == "gpu__time_duration.sum":    # ns
        return f"{value / 1e3:.1f}"
    if metric == "sm__cycles_elapsed.avg.per_second":   # Hz
        return f"{value / 1e9:.3f}"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def compare_kernels(kernels: list[RawKernel], stalls: int = 5) -> list[list[str]]:
    """Rows (label, one value per kernel) of ``RAW_METRICS``, then each kernel's ``stalls`` largest stall reasons
    as shares of its samples."""
    rows = [[label] + [_metric_text(k, label, metric) for k in kernels] for label, metric in RAW_METRICS]
    for rank in range(stalls):
        row = [f"stall #{rank + 1} (% of samples)"]
        for k in kernels:
            top = list(k.stall_shares().items())
            row.append(f"{top[rank][0]} {100 * top[rank][1]:.1f}" if rank < len(top) else "-")
        rows.append(row)
    return rows


__all__ = ["RAW_METRICS", "REGION_KINDS", "RawKernel", "SassRegion", "compare_kernels", "instruction_shares",
           "read_raw_exports", "read_source_counters", "region_kind", "sass_regions"]
