"""Where a kernel's issued instructions go, from Nsight Compute's per-instruction counts.

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


__all__ = ["REGION_KINDS", "SassRegion", "instruction_shares", "read_source_counters", "region_kind",
           "sass_regions"]
