"""The exact reference of the grouped 1D-1D block-scaled matmul, and the acceptance metric.

Reference (``../shared/spec/formats.md``): dequantize exactly (every element x block-scale
product is exact in float32; W4A16's bf16 tokens are taken as they are), multiply per active group
in float64, apply the expert scale, round once to bf16. Rows of skipped slots (``expert_id == -1``)
are left as they were in ``out``.
Tests, benchmarks, the CLI and the notebooks all check kernels with ``reference_grouped_matmul``
and ``check_acceptance``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import GroupedProblem
from .formats import BF16, dequantize

# Acceptance of a kernel output against the reference (formats.md, "Numerical acceptance").
MAX_REL_TOL = 1e-2    # max |out - ref| / max |ref|
RMS_REL_TOL = 4e-3    # RMS(out - ref) / RMS(ref)
# bf16 sentinel the tests write into outputs before a launch: a NaN payload no kernel produces.
POISON_BITS = 0x7FAB


def poison_output(total_tokens: int, n: int) -> np.ndarray:
    """A (total_tokens, N) bf16 array filled with the sentinel NaN ``POISON_BITS``."""
    return np.full((total_tokens, n), POISON_BITS, np.uint16).view(BF16)


def is_poison(out: np.ndarray) -> np.ndarray:
    """Elementwise: does ``out`` (bf16) still hold the sentinel?"""
    return np.asarray(out).view(np.uint16) == POISON_BITS


def reference_grouped_matmul(problem: GroupedProblem, out: np.ndarray | None = None, *,
                             accumulate: type = np.float64) -> np.ndarray:
    """``C`` (bf16, (total_tokens, N)) of the grouped matmul; skipped rows keep ``out``'s contents
    (default: the poison sentinel). ``accumulate``: float64 (default) or float32 matmul."""
    if accumulate not in (np.float64, np.float32):
        raise ValueError("accumulate must be np.float64 or np.float32")
    p = problem
    if out is None:
        out = poison_output(p.total_tokens, p.n)
    elif out.shape != (p.total_tokens, p.n) or out.dtype != BF16:
        raise ValueError(f"out must be a ({p.total_tokens}, {p.n}) bfloat16 array, got {out.shape} {out.dtype}")
    slots = p.active_slots()
    if not slots:
        return out
    a_deq = dequantize(p.a_operand()).astype(accumulate)
    for g in slots:
        e = int(p.expert_ids[g])
        lo, hi = int(p.a_offsets[g]), int(p.a_offsets[g + 1])
        b_deq = dequantize(p.b_operand(e)).astype(accumulate)
        acc = (a_deq[lo:hi] @ b_deq.T).astype(np.float64) * np.float64(p.expert_scales[e])
        out[lo:hi] = acc.astype(np.float32).astype(BF16)
    return out


@dataclass(frozen=True)
class Acceptance:
    """Outcome of comparing a kernel output with the reference on the written rows."""

    max_rel_error: float
    rms_rel_error: float
    has_nan: bool
    poisoned_written: int      # written rows the kernel left holding the sentinel
    clobbered_skipped: int     # skipped rows the kernel changed
    passed: bool

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: max rel err {self.max_rel_error:.2e} (<= {MAX_REL_TOL:g}), "
                f"rms rel err {self.rms_rel_error:.2e} (<= {RMS_REL_TOL:g}), NaN: {self.has_nan}, "
                f"unwritten rows: {self.poisoned_written}, clobbered skipped rows: {self.clobbered_skipped}")


def relative_errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, RMS(out - ref) / RMS(ref)) in float64; NaN in either -> inf."""
    with np.errstate(invalid="ignore"):   # bf16 NaN -> float64 warns; NaN is handled below
        o = np.asarray(out).astype(np.float64)
        r = np.asarray(ref).astype(np.float64)
    if o.size == 0:
        return 0.0, 0.0
    if not (np.all(np.isfinite(o)) and np.all(np.isfinite(r))):
        return float("inf"), float("inf")
    diff = o - r
    max_ref = np.max(np.abs(r))
    rms_ref = np.sqrt(np.mean(r * r))
    max_rel = float(np.max(np.abs(diff)) / max_ref) if max_ref > 0 else float(np.max(np.abs(diff)) > 0) * np.inf
    rms_rel = float(np.sqrt(np.mean(diff * diff)) / rms_ref) if rms_ref > 0 else float(np.any(diff)) * np.inf
    return max_rel, rms_rel


def check_acceptance(problem: GroupedProblem, out: np.ndarray, ref: np.ndarray | None = None) -> Acceptance:
    """Compare ``out`` with the reference on written rows; skipped rows must still hold the poison.

    ``out`` must have been poisoned with ``poison_output`` before the launch.
    """
    if ref is None:
        ref = reference_grouped_matmul(problem)
    out = np.asarray(out)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
    written = problem.written_rows()
    poison = is_poison(out)
    poisoned_written = int(np.sum(np.any(poison[written], axis=1)))
    clobbered = int(np.sum(~np.all(poison[~written], axis=1)))
    o, r = out[written], ref[written]
    has_nan = bool(np.any(np.isnan(o.astype(np.float32))))
    max_rel, rms_rel = relative_errors(o, r)
    passed = (not has_nan and poisoned_written == 0 and clobbered == 0
              and max_rel <= MAX_REL_TOL and rms_rel <= RMS_REL_TOL)
    return Acceptance(max_rel, rms_rel, has_nan, poisoned_written, clobbered, passed)
