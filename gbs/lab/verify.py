"""Output checks of the benchmark (issue 32, item 3): every output the bench times is first compared with
an exact reference, row by row, and a failure is recorded, never timed as good.

The metric is the per-row normalised max error: for each output row, ``max_j |out - ref| / max_j |ref|``
(a NaN or infinity anywhere in the row, or a wrong value in an all-zero reference row, is ``inf``). It
is stricter than ``gbs.reference.check_acceptance``'s ratio to the global maximum: a corrupted element
in a low-magnitude row (a low-magnitude group) shows at the size it has in its own row.

Bound (``ROW_ERR_BOUND``): the reference rounds the exact float64 value ``x`` to bf16 once; a kernel that
accumulates in fp32 (in any order, split-K runs included) and rounds once to bf16 outputs ``bf16(y)`` with
``|y - x|`` tiny next to ``|x|`` at these K (fp32 keeps 24 bits; the terms are bounded). Two roundings of
nearly the same value differ by at most one bf16 unit in the last place, and one ulp of ``x`` is at most
``2**-7 |x| <= 2**-7 max_j |ref|`` (bf16 keeps 8 significant bits). So a correct kernel's row error is at
most ``2**-7`` plus its fp32 accumulation error relative to the row's largest element (at worst about
``K 2**-24 sum|a b| / max|ref|``; for the bench's random operands orders of magnitude below that), for
which ``2**-9`` is left: ``ROW_ERR_BOUND = 2**-7 + 2**-9`` (9.77e-3). Kernels that round exactly as the reference
read 0; a corrupted element at above 1 % of its row's largest value fails.

Rows a method must not write (slots with ``expert_id == -1``) must still hold the poison sentinel
(``gbs.reference.POISON_BITS``) they were filled with before the launch; written rows must hold none.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference import is_poison

ROW_ERR_BOUND = 2.0 ** -7 + 2.0 ** -9


def row_errors(out, ref) -> np.ndarray:
    """Per-row ``max |out - ref| / max |ref|`` in float64 (``out``, ``ref``: same shape, 2-D; a 1-D array is
    one row). ``inf`` for a row holding a NaN or an infinity in either, and for a row whose reference is
    all zero but whose output is not; 0 for a row equal to an all-zero reference."""
    with np.errstate(invalid="ignore", over="ignore"):   # bf16 NaN -> float64 warns; handled below
        o = np.asarray(out).astype(np.float64)
        r = np.asarray(ref).astype(np.float64)
    if o.shape != r.shape:
        raise ValueError(f"output shape {o.shape} != reference shape {r.shape}")
    if o.ndim == 1:
        o, r = o[None, :], r[None, :]
    elif o.ndim != 2:
        raise ValueError(f"row errors take 1-D or 2-D arrays, got {o.ndim}-D")
    if o.shape[1] == 0:
        return np.zeros(o.shape[0])
    finite = np.isfinite(o).all(axis=1) & np.isfinite(r).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        worst = np.abs(o - r).max(axis=1)
        scale = np.abs(r).max(axis=1)
        errors = np.where(scale > 0, worst / np.where(scale > 0, scale, 1.0), np.where(worst == 0, 0.0, np.inf))
    errors[~finite] = np.inf
    return errors


@dataclass(frozen=True)
class OutputCheck:
    """One output compared with its reference: the worst per-row normalised error (``max_row_err``, at
    ``worst_row``), written rows left holding the poison, skipped rows changed, and the verdict."""

    max_row_err: float
    worst_row: int             # -1 when no row was compared
    unwritten_rows: int        # rows that must be written but still hold the poison sentinel
    clobbered_rows: int        # rows that must not be written but were
    bound: float
    rows: int                  # rows compared

    @property
    def passed(self) -> bool:
        return self.unwritten_rows == 0 and self.clobbered_rows == 0 and self.max_row_err <= self.bound

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        where = f" (row {self.worst_row})" if self.worst_row >= 0 else ""
        return (f"{verdict}: max row err {self.max_row_err:.2e}{where} (bound {self.bound:.2e}) over {self.rows} rows; "
                f"unwritten rows {self.unwritten_rows}, clobbered skipped rows {self.clobbered_rows}")


def check_output(out, ref, *, written=None, bound: float = ROW_ERR_BOUND) -> OutputCheck:
    """Compare ``out`` with ``ref`` row by row. ``written``: a boolean mask of the rows the method must
    write (the others must still hold the poison sentinel; ``out`` must then be bf16, poisoned before the
    launch); None: every row is written and nothing is checked for poison."""
    out = np.asarray(out)
    ref = np.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
    unwritten = clobbered = 0
    if written is None:
        rows = np.arange(out.shape[0] if out.ndim > 1 else 1)
        errors = row_errors(out, ref)
    else:
        written = np.asarray(written, bool)
        if written.shape != out.shape[:1]:
            raise ValueError(f"written mask of shape {written.shape} for an output of {out.shape[0]} rows")
        poison = is_poison(out)
        unwritten = int(np.sum(np.any(poison[written], axis=1)))
        clobbered = int(np.sum(~np.all(poison[~written], axis=1)))
        rows = np.flatnonzero(written)
        errors = row_errors(out[written], ref[written])
    if errors.size == 0:
        return OutputCheck(0.0, -1, unwritten, clobbered, bound, 0)
    worst = int(np.argmax(errors))
    return OutputCheck(float(errors[worst]), int(rows[worst]), unwritten, clobbered, bound, int(errors.size))
