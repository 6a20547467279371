"""The demo's kernel check: kernel models (or the real kernel) against the exact reference, with the
exactness each one has, asserted element by element.

Without a GPU, ``python -m gbs demo`` runs two kernel models on one small routed problem
(``demo_problem``: ragged groups, an empty group, a ``-1`` slot, a 1-token group, a low-magnitude
group, N and token counts that are not tile multiples) in every format, with the dispatch's config:

* ``simt``: the SIMT kernel (``gbs.numba_kernels.simt``) in Numba's CUDA simulator. It decodes the
  operands itself (integer arithmetic), walks the tiles and sums in fp32.
* ``emulator``: the SM100 emulator (``gbs.sm100_emulator``): the tcgen05 kernel's host logic (tile
  walk, TMA boxes, swizzles, descriptors, TMEM scale placement, epilogue stores) replayed on a model
  of the hardware, with exact (float64) MMA sums; it computes ``C``, so ``C`` is what is compared.
  Not for W4A16 (``EMULATED_FORMATS``): tcgen05 has no bf16 x FP4 kind.

With a GPU the demo checks the real kernel's output the same way (``check_output``).

What is asserted (``Exactness``): a model computes, per output, an fp32 value ``y`` in which every
term ``a*b*sa*sb*s`` (element products, the two block scales, the expert scale) went through at most
``n`` fp32 operations of unit roundoff ``u``; so ``|y - exact| <= gamma_n * sum|terms|``
(``gamma_n = n u / (1 - n u)``, Higham, Accuracy and Stability of Numerical Algorithms, 3.1), and
``out = RNE_bf16(y)``. Hence ``out`` lies between ``RNE_bf16(exact - bound)`` and
``RNE_bf16(exact + bound)``: for most elements that interval holds one bf16 value, so the check is
bit-exact except where the bound straddles a bf16 rounding boundary (the count is printed; with FP4
operands many exact values are bf16 ties, which it always straddles).
``exact`` is the reference's float64 value before its rounding (``exact_values``, checked to round to
``gbs.reference``'s bits), ``sum|terms|`` is computed per element from the problem. Where the model's
summation order makes it so, bit equality with ``gbs.reference`` is asserted as well. Rows of
skipped slots must still hold the poison sentinel, every written row must be written.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .exactness import check_output, exact_values
from .formats import BF16, get_format
from .problem import PROBLEM_FORMATS, GroupedProblem, build_problem, random_activations, random_weights
from .reference import poison_output, reference_grouped_matmul

# The small routed problem: slot sizes and expert ids. Slot 1 is empty, slot 2 has one token, slot 3
# is skipped (-1: its rows must keep the poison), slot 4's 9 tokens cross an 8-token tile by one.
DEMO_GROUP_SIZES = (5, 0, 1, 2, 9)
DEMO_EXPERT_IDS = (0, 1, 2, -1, 3)
DEMO_NUM_EXPERTS = 4
DEMO_N = 144             # one full 128-row weight tile and a 16-row partial one
DEMO_K = 128             # W4A8 needs K % 128 == 0; a partial K tile for the FP4 formats' 256-element tiles
DEMO_QUIET_EXPERT = 0    # its weights are scaled down: a low-magnitude group, where a global tolerance sees nothing
DEMO_QUIET_GAIN = 2.0 ** -10
DEMO_FORMATS = tuple(sorted(PROBLEM_FORMATS))
CPU_MODELS = ("simt", "emulator")
# the formats the SM100 kernel, so its emulator, runs: not W4A16's unscaled bf16 tokens (no tcgen05 kind)
EMULATED_FORMATS = tuple(f for f in DEMO_FORMATS if all(get_format(name).scaled for name in PROBLEM_FORMATS[f]))



class Mismatch(AssertionError):
    """A kernel (model) output disagrees with the reference beyond what the kernel guarantees."""


# ----------------------------------------------------------------------------------------------
# The problem
# ----------------------------------------------------------------------------------------------
def demo_problem(fmt: str, seed: int = 0) -> GroupedProblem:
    """The demo's small routed problem in format ``fmt`` (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    activations = random_activations(rng, sum(DEMO_GROUP_SIZES), DEMO_K)
    weights = random_weights(rng, DEMO_NUM_EXPERTS, DEMO_N, DEMO_K)
    weights[DEMO_QUIET_EXPERT] *= np.float32(DEMO_QUIET_GAIN)
    return build_problem(activations, weights, np.array(DEMO_GROUP_SIZES), np.array(DEMO_EXPERT_IDS), fmt=fmt)


def demo_config(problem: GroupedProblem):
    """What the kernels run the problem with: the dispatch's decision (E5M2: the E4M3 route's tile knobs)."""
    from .api import resolve_config

    return resolve_config(problem)


def describe_problem() -> str:
    return (f"N={DEMO_N}, K={DEMO_K}, {sum(DEMO_GROUP_SIZES)} token rows in slots of {list(DEMO_GROUP_SIZES)} "
            f"tokens, expert ids {list(DEMO_EXPERT_IDS)} (an empty slot, a 1-token slot, a -1 slot, expert "
            f"{DEMO_QUIET_EXPERT}'s weights scaled by 2^{int(np.log2(DEMO_QUIET_GAIN))})")


def fingerprint(problem: GroupedProblem) -> str:
    """A hash of the problem's arrays: the simulator's child process must have run the same problem."""
    h = hashlib.sha256()
    for name in ("a", "b", "a_scales", "b_scales", "a_offsets", "a_scale_offsets", "expert_ids", "expert_scales"):
        h.update(np.ascontiguousarray(getattr(problem, name)).tobytes())
    return h.hexdigest()


def raise_on_mismatch(checks) -> None:
    lines = [m for c in checks for m in c.mismatches]
    if lines:
        raise Mismatch("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# Running the models
# ----------------------------------------------------------------------------------------------
def run_emulator(problem: GroupedProblem, config) -> np.ndarray:
    from . import sm100_emulator

    return sm100_emulator.emulate(problem, config, out=poison_output(problem.total_tokens, problem.n)).out


def run_simt(problem: GroupedProblem, config) -> np.ndarray:
    """The SIMT kernel in this process (a GPU, or Numba's simulator if this process imported numba with it)."""
    from .numba_kernels import simt

    return simt.grouped_matmul_simt(problem, config, out=poison_output(problem.total_tokens, problem.n))


def simulator_active() -> bool:
    from numba import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


class SimtRun:
    """The SIMT kernel's outputs on the demo problems, from Numba's CUDA simulator.

    Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when it is first imported; by the time the demo runs,
    ``gbs`` has imported numba for the real CUDA target (``gbs.api`` probes the GPU with it), and
    setting the variable earlier (before any import in ``__main__``) would take the real CUDA target
    from the whole process, and would depend on nobody importing numba first. So the simulator runs
    in a child process started with the variable set: the one place it reliably takes effect,
    whatever imported what. The child runs alongside the parent's own work (the tables, the
    emulator, the reference), saves each output with a hash of its problem, and the checks are made
    here. In a process whose numba already simulates (tests, the child) it runs in-process.
    """

    def __init__(self, formats, seed: int = 0):
        self.formats, self.seed = tuple(formats), seed
        self.seconds = float("nan")    # the simulator's wall time, once ``result`` returned
        self._proc = self._tmp = self._outputs = None
        if simulator_active():
            return
        self._tmp = tempfile.TemporaryDirectory(prefix="gbs-demo-")
        self._path = Path(self._tmp.name) / "simt.npz"
        package_root = str(Path(__file__).resolve().parent.parent)   # the child imports this gbs
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gbs.demo", "simt-worker", "--out", str(self._path), "--seed", str(seed),
             "--formats", ",".join(self.formats)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result(self) -> dict:
        """{format: (output, problem fingerprint)}; RuntimeError if the simulator run failed."""
        if self._outputs is None:
            self._outputs = self._run()
        return self._outputs

    def _run(self) -> dict:
        if self._proc is None:
            outs, t0 = {}, time.perf_counter()
            for fmt in self.formats:
                problem = demo_problem(fmt, self.seed)
                outs[fmt] = (run_simt(problem, demo_config(problem)), fingerprint(problem))
            self.seconds = time.perf_counter() - t0
            return outs
        try:
            log, _ = self._proc.communicate()
            if self._proc.returncode != 0:
                raise RuntimeError(f"the SIMT simulator run exited with {self._proc.returncode}:\n{log[-3000:]}")
            with np.load(self._path) as saved:
                self.seconds = float(saved["seconds"])
                return {fmt: (saved[f"out_{fmt}"].view(BF16), str(saved[f"fingerprint_{fmt}"]))
                        for fmt in self.formats}
        finally:
            self._tmp.cleanup()

    def cancel(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
        if self._tmp is not None:
            self._tmp.cleanup()


def verify_cpu_models(formats=DEMO_FORMATS, seed: int = 0, models=CPU_MODELS, simt_run: SimtRun | None = None,
                      echo=print) -> list:
    """Run ``models`` on the demo problem in each format and check them; prints a line per run and
    returns the ``ModelCheck``s (``raise_on_mismatch`` turns failures into an exception). The emulator runs
    ``EMULATED_FORMATS`` only."""
    checks = []
    simt_outputs = None
    if "simt" in models:
        simt_outputs = (simt_run or SimtRun(formats, seed)).result()
    for fmt in formats:
        problem = demo_problem(fmt, seed)
        config = demo_config(problem)
        ref = reference_grouped_matmul(problem)
        exact = exact_values(problem)
        knobs = (f"swapped={config.ab_swapped} mma_bn={config.mma_bn} cta_group={config.cta_group}")
        for model in models:
            if model == "emulator" and fmt not in EMULATED_FORMATS:
                continue
            if model == "simt":
                out, digest = simt_outputs[fmt]
                if digest != fingerprint(problem):
                    raise RuntimeError(f"the simulator ran another {fmt} problem than this process built")
            else:
                out = run_emulator(problem, config)
            check = check_output(problem, out, model, fmt, ref, exact)
            checks.append(check)
            echo(f"  [{model:<8} {fmt:<10}] {knobs}: {check.summary()}")
            for line in check.mismatches:
                echo(f"    {line}")
    return checks


def _worker(argv) -> int:
    """``python -m gbs.demo simt-worker``: run the SIMT kernel on the demo problems, save the outputs."""
    parser = argparse.ArgumentParser(prog="python -m gbs.demo simt-worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(DEMO_FORMATS))
    args = parser.parse_args(argv)
    if not simulator_active():
        raise SystemExit("the SIMT worker needs NUMBA_ENABLE_CUDASIM=1 in its environment")
    run = SimtRun(args.formats.split(","), args.seed)
    saved = {}
    for fmt, (out, digest) in run.result().items():
        saved[f"out_{fmt}"], saved[f"fingerprint_{fmt}"] = out.view(np.uint16), np.array(digest)
    np.savez(args.out, seconds=np.array(run.seconds), **saved)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["simt-worker"]:
        raise SystemExit("usage: python -m gbs.demo simt-worker --out FILE [--seed S] [--formats a,b]")
    sys.exit(_worker(sys.argv[2:]))
