"""The rows of ``python -m gbs ablate`` on disk: their keys, the workers' part files, and merging into the CSV.

A row's key (``KEY_COLUMNS``: ``sweep_key`` of a (problem, config) to run, ``row_key`` of a row) says
whether it is already in ``data/ablations.csv``. Every finished row is appended at once to its worker's
own part file (``PartWriter``, under ``<csv>.parts/``; a killed worker loses at most the line it was
writing); ``merge_parts`` merges the parts into the CSV (``update_csv``: validated, in a stable order,
written to a temporary file and renamed over the CSV) and deletes them. ``log`` is the flushed progress
line that every sweep mode prints (workers' lines interleave in one log).
"""
from __future__ import annotations

import contextlib
import csv
import glob
import os
from typing import Callable, Sequence

from gbs.lab import ablation_data as ab
from gbs.lab.ablation_data import ABLATION_COLUMNS, AblationRow, ProblemKey
from gbs.lab.perfmodel import ModelConfig

PARTS_SUFFIX = ".parts"           # <csv>.parts/: one part file per worker process

# A row's identity: the CSV key columns (avg_m and regime follow from total tokens and slots) and the
# source, so a measured and a modelled row of one config are two rows.
KEY_COLUMNS = ("gpu", "format", "n", "k", "routing", "num_active_experts", "total_tokens",
               "ab_swapped", "mma_bn", "cta_group", "stages", "source")


def log(message: str) -> None:
    print(message, flush=True)


# ----------------------------------------------------------------------------------------------
# Row keys
# ----------------------------------------------------------------------------------------------
def sweep_key(gpu: str, source: str, key: ProblemKey, config: ModelConfig) -> tuple:
    """The ``KEY_COLUMNS`` values of the row of a (problem, config) on ``gpu`` from ``source``."""
    values = dict(key._asdict(), gpu=gpu, source=source, ab_swapped=config.ab_swapped, mma_bn=config.mma_bn,
                  cta_group=config.cta_group, stages=config.stages)
    return tuple(values[column] for column in KEY_COLUMNS)


def row_key(row: AblationRow) -> tuple:
    return tuple(getattr(row, column) for column in KEY_COLUMNS)


# ----------------------------------------------------------------------------------------------
# CSV: part files, merge, atomic writes
# ----------------------------------------------------------------------------------------------
def parts_dir(csv_path: str) -> str:
    return csv_path + PARTS_SUFFIX


class PartWriter:
    """Appends rows to one worker's part file, one flushed line per row (a killed worker loses
    at most the line it was writing)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.path = path
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=ABLATION_COLUMNS)
        if new:
            self._writer.writeheader()
            self._file.flush()

    def write(self, row: AblationRow) -> None:
        self._writer.writerow(row.to_csv_dict())
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_part(path: str, log: Callable[[str], None] = print) -> list[AblationRow]:
    """Rows of a part file. A bad LAST line is a write cut short by a kill: dropped with a note;
    a bad line elsewhere is a ValueError naming the file and line."""
    with open(path, newline="") as f:
        records = list(csv.DictReader(f))
    rows = []
    for i, record in enumerate(records):
        try:
            if None in record or any(v is None for v in record.values()):
                raise ValueError("wrong number of fields")
            rows.append(AblationRow.from_csv_dict(record))
        except (TypeError, ValueError) as err:
            if i == len(records) - 1:
                log(f"note: dropped the last line of {path} (cut short: {err})")
                break
            raise ValueError(f"{path}, record {i + 1}: {err}") from None
    return rows


def load_rows(csv_path: str) -> list[AblationRow]:
    """The CSV's rows (validated), or none when it does not exist yet."""
    return ab.read_ablations(csv_path) if os.path.exists(csv_path) else []


def row_order(row: AblationRow) -> tuple:
    """The CSV's stable order of rows: GPU, source, format, shape, load, then knob set and stages."""
    return (row.gpu, row.source, row.format, row.n, row.k, row.routing, row.num_active_experts, row.total_tokens,
            row.cta_group, row.mma_bn, not row.ab_swapped, row.stages)


def merge_rows(existing: Sequence[AblationRow], new: Sequence[AblationRow], *, replace: bool
               ) -> tuple[list[AblationRow], int, int]:
    """(merged rows in a stable order, rows added, rows replaced). A key already present keeps its
    existing row unless ``replace``; among the new rows the last of a key wins."""
    merged = {row_key(r): r for r in existing}
    added = replaced = 0
    for row in new:
        key = row_key(row)
        if key not in merged:
            added += 1
        elif replace and merged[key] != row:
            replaced += 1
        else:
            continue
        merged[key] = row
    return sorted(merged.values(), key=row_order), added, replaced


def write_rows_atomic(csv_path: str, rows: Sequence[AblationRow]) -> None:
    """``gbs.lab.ablation_data.write_ablations`` into a temporary file, then renamed over ``csv_path``."""
    tmp = f"{csv_path}.tmp-{os.getpid()}"
    ab.write_ablations(tmp, rows)
    os.replace(tmp, csv_path)


def update_csv(csv_path: str, new: Sequence[AblationRow], *, replace: bool) -> tuple[int, int, int]:
    """Merge ``new`` into the CSV; returns (rows added, replaced, rows in the CSV)."""
    merged, added, replaced = merge_rows(load_rows(csv_path), new, replace=replace)
    if added or replaced or not os.path.exists(csv_path):
        write_rows_atomic(csv_path, merged)
    return added, replaced, len(merged)


def merge_parts(csv_path: str, log: Callable[[str], None] = print) -> int:
    """Merge every part file of ``csv_path`` into it and delete the parts; returns rows added."""
    paths = sorted(glob.glob(os.path.join(parts_dir(csv_path), "*.csv")))
    if not paths:
        return 0
    rows = [row for path in paths for row in read_part(path, log)]
    added, _, total = update_csv(csv_path, rows, replace=False)
    for path in paths:
        os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(parts_dir(csv_path))
    log(f"merged {len(paths)} part file(s): {added} new rows, {total} rows in {csv_path}")
    return added


__all__ = [
    "KEY_COLUMNS", "PARTS_SUFFIX", "PartWriter", "load_rows", "log", "merge_parts", "merge_rows", "parts_dir",
    "read_part", "row_key", "row_order", "sweep_key", "update_csv", "write_rows_atomic",
]
