"""The demo's kernel-model check (gbs.demo) fails when the kernel model is wrong: planted faults.

Each fault is planted in a kernel model (the SM100 emulator in this process, the SIMT kernel in a
simulator subprocess) and the demo's check must report a MISMATCH; where the fault is small (one
ulp of one element of the low-magnitude group), the old acceptance metric (1e-2 of the global
maximum) is shown to pass the same output. The passing
run of both models in every format is tests/test_cli.py's demo test.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gbs import __main__ as cli
from gbs import demo, exactness
from gbs import sm100_emulator as em
from gbs.__main__ import main
from gbs.reference import check_acceptance, reference_grouped_matmul

REPO = Path(__file__).resolve().parent.parent


def quiet_row(problem) -> int:
    """The first row of the low-magnitude group (the slot of ``DEMO_QUIET_EXPERT``)."""
    slot = list(problem.expert_ids).index(demo.DEMO_QUIET_EXPERT)
    return int(problem.a_offsets[slot])


def skipped_row(problem) -> int:
    return int(problem.a_offsets[list(problem.expert_ids).index(-1)])


def plant_in_emulator(monkeypatch, change):
    """Wrap ``sm100_emulator.emulate``: ``change(problem, out)`` edits the emulated output in place."""
    emulate = em.emulate
    outputs = []

    def faulty(problem, config, out=None, **kw):
        result = emulate(problem, config, out, **kw)
        change(problem, result.out.view(np.uint16))
        outputs.append((problem, result.out))
        return result

    monkeypatch.setattr(em, "emulate", faulty)
    return outputs


def test_the_emulator_passes_in_every_format():
    checks = demo.verify_cpu_models(models=("emulator",), echo=lambda line: None)
    assert [c.fmt for c in checks] == list(demo.EMULATED_FORMATS) and all(c.passed for c in checks)
    assert set(demo.DEMO_FORMATS) - set(demo.EMULATED_FORMATS) == {"w4a16", "w4a16_nvfp4"}   # no tcgen05 kind
    assert all(c.bit_identical == c.elements > 0 for c in checks)


def test_one_ulp_in_one_element_of_the_quiet_group_is_caught(monkeypatch):
    """MXFP8 (expert scale 1): the emulator must be bit-identical; one ulp off in one element fails,
    although the old acceptance metric passes it."""
    def one_ulp(problem, bits):
        bits[quiet_row(problem), 7] += 1
    outputs = plant_in_emulator(monkeypatch, one_ulp)
    (check,) = demo.verify_cpu_models(("mxfp8",), models=("emulator",), echo=lambda line: None)
    assert not check.passed and check.bit_identical == check.elements - 1
    text = "\n".join(check.mismatches)
    assert "MISMATCH: emulator mxfp8: 1 of 2160 outputs outside" in text
    assert "not bit-identical to the reference" in text and "row 0 (slot 0, expert 0) column 7" in text
    with pytest.raises(demo.Mismatch, match="MISMATCH: emulator mxfp8"):
        demo.raise_on_mismatch([check])
    problem, out = outputs[0]
    assert check_acceptance(problem, out).passed      # what the old check said


def test_a_dropped_expert_scale_is_caught(monkeypatch):
    """NVFP4: the epilogue forgets one expert's global scale (1-token group, expert 2)."""
    problem = demo.demo_problem("nvfp4")
    forgotten = problem.expert_scales[2]
    to_bf16 = em._to_bf16_bits
    monkeypatch.setattr(em, "_to_bf16_bits", lambda acc, scale: to_bf16(acc, 1.0 if scale == forgotten else scale))
    (check,) = demo.verify_cpu_models(("nvfp4",), models=("emulator",), echo=lambda line: None)
    assert not check.passed
    found = "\n".join(check.mismatches)
    assert f"MISMATCH: emulator nvfp4: {problem.n} of 2160 outputs outside" in found
    assert f"MISMATCH: emulator nvfp4: {problem.n} outputs whose accumulation is exact in any order" in found
    assert "row 5 (slot 2, expert 2)" in found


def test_a_written_skipped_row_is_caught(monkeypatch):
    def clobber(problem, bits):
        bits[skipped_row(problem), 3] = 0
    plant_in_emulator(monkeypatch, clobber)
    (check,) = demo.verify_cpu_models(("w4a8",), models=("emulator",), echo=lambda line: None)
    assert check.mismatches == ["MISMATCH: emulator w4a8: rows [6] of skipped (-1) slots were written "
                                "(the poison sentinel is gone)"]


def test_an_unwritten_row_is_caught(monkeypatch):
    def forget(problem, bits):
        bits[-1, -1] = 0x7FAB
    plant_in_emulator(monkeypatch, forget)
    (check,) = demo.verify_cpu_models(("mxfp4",), models=("emulator",), echo=lambda line: None)
    assert "MISMATCH: emulator mxfp4: rows [16] were not (fully) written" in check.mismatches[0]


@pytest.fixture
def small_batch(monkeypatch):
    """The demo command's routed batch on a small shape: these tests are about its verdict, not the shape."""
    monkeypatch.setattr(cli, "DEMO_RUN_SHAPE", (256, 512))


def test_the_demo_command_fails_loudly(monkeypatch, capsys, small_batch):
    def one_ulp(problem, bits):
        bits[quiet_row(problem) + 1, 100] -= 1
    plant_in_emulator(monkeypatch, one_ulp)
    assert main(["demo", "--backend", "reference", "--cpu-models", "emulator"]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH: emulator nvfp4" in captured.err and "MISMATCH: emulator mxfp8" in captured.err
    assert "FAILED" in captured.out and "verified" not in captured.out


def _fake_gpu(monkeypatch, change=None):
    """The GPU branch of the demo on this machine: ``h200_stream`` selected, the kernel stood in for by the
    reference (``change`` edits its output's bits)."""
    from gbs import api, backends

    def kernel(problem, config=None, backend="auto", out=None):
        result = reference_grouped_matmul(problem)
        if change is not None:
            change(problem, result, result.view(np.uint16))
        return result

    monkeypatch.setattr(backends, "select_backend", lambda backend="auto": "h200_stream")
    monkeypatch.setattr(api, "grouped_matmul", kernel)


def test_the_gpu_path_checks_the_kernel(monkeypatch, capsys, small_batch):
    _fake_gpu(monkeypatch)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "check against the exact reference (fp32 tensor-core accumulation" in out
    assert "No GPU here" not in out and out.strip().endswith("h200_stream: 1 outputs checked against the exact "
                                                              "reference\nverified")


def test_the_gpu_path_fails_on_a_wrong_sign(monkeypatch, capsys, small_batch):
    def flip(problem, values, bits):
        row = int(np.flatnonzero(problem.written_rows())[-1])
        bits[row, int(np.argmax(np.abs(values[row].astype(np.float32))))] ^= 0x8000
    _fake_gpu(monkeypatch, flip)
    assert main(["demo"]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH: h200_stream nvfp4: 1 of" in captured.err and "FAILED" in captured.out


SIMT_FAULT = textwrap.dedent("""
    from gbs import demo, exactness
    from gbs.numba_kernels import simt
    from gbs.reference import check_acceptance
    assert demo.simulator_active()
    # the epilogue truncates to bf16 instead of rounding to nearest even: <= 1 ulp, about half the outputs
    simt.bf16_bits_rne = lambda bits: bits >> 16
    run = demo.SimtRun(["mxfp8"])
    print("old check:", check_acceptance(demo.demo_problem("mxfp8"), run.result()["mxfp8"][0]))
    demo.raise_on_mismatch(demo.verify_cpu_models(["mxfp8"], models=["simt"], simt_run=run))
""")


def test_a_simt_kernel_fault_is_caught():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", SIMT_FAULT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "demo.Mismatch: MISMATCH: simt mxfp8:" in res.stderr, res.stderr[-2000:]
    assert "outputs outside what the kernel guarantees" in res.stderr


def test_round_to_bf16_is_one_rounding_to_nearest_even():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * np.exp2(rng.integers(-130, 100, 20000))).astype(np.float32)
    ties = (np.arange(1, 200, dtype=np.float32) * 2 + 1) * np.float32(2.0 ** -9)    # 9 significant bits: ties
    x = np.concatenate([x, ties, -ties, np.float32([0.0, 2.0 ** -140])])
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64)   # ml_dtypes: float32 -> bf16, RNE
    np.testing.assert_array_equal(exactness.round_to_bf16(x.astype(np.float64)), want)
