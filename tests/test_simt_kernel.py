"""The SIMT grouped kernel (gbs.numba_kernels.simt): simulator runs, host helpers, bad input, GPU runs.

Simulator runs: every format x a set of legal configs (swapped / not, cta_group 1 / 2, several
mma_bn) and the dispatch's own config, on fresh random data with ragged groups, an empty group, a
-1 slot, a 1-token group and sizes that are not tile multiples, plus a group longer than a
128-token tile, N > 128 (both CTAs of a pair write), NaN scale bytes, odd persistent grids, and
W4A16 (bf16 tokens) checked element by element with ``gbs.exactness``.
Outputs are poisoned before the launch and judged with ``check_acceptance``; all configs of one
problem must give identical bits (the kernel sums every output in the same order whatever the
tile); and the same output must FAIL against a problem whose scales were laid out linearly
instead of in the 128x4 atoms (so the kernel really reads the swizzled layout).

Numba picks the simulator when it is first imported (``NUMBA_ENABLE_CUDASIM=1``), so the runs
happen in worker subprocesses (this file run as a script), two in parallel; the rest of the suite
keeps the real numba. The workers save each output; the assertions are made here.

GPU tests (``@pytest.mark.gpu``) run the same kernel on larger shapes, including DeepSeek's
N 4096 x K 7168 and Kimi K2.5's 512 x 7168.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import traceback
import types as pytypes
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gbs import schedule
from gbs.api import resolve_config
from gbs.exactness import check_output
from gbs.dispatch import LEGAL_MMA_BN, grouped_matmul_mxfp8_dispatch
from gbs.numba_kernels import simt
from gbs.problem import (
    PROBLEM_FORMATS,
    build_problem,
    random_activations,
    random_problem,
    random_weights,
)
from gbs.formats import (BF16, E4M3_NAN_BYTE, UE8M0_NAN_BYTE, decode_elements, get_format, decode_ue4m3, decode_ue8m0, scale_offset, unswizzle_scales)
from gbs.reference import (
    MAX_REL_TOL,
    RMS_REL_TOL,
    check_acceptance,
    poison_output,
    reference_grouped_matmul,
    relative_errors,
)

REPO = Path(__file__).resolve().parents[1]
FORMATS = tuple(PROBLEM_FORMATS)
NUM_EXPERTS = 8
SIM_WORKERS = 2
# The simulator runs each CUDA thread as a Python thread. A 1e-4 s GIL switch interval ran about
# 2x faster but once (1 full CI run of 4) gave a NaN output in mxfp4-ragged-noswap-bn8-cg1 that no
# rerun reproduced: the simulator swaps module globals between threads, and more preemption widens
# its windows. Python's default interval keeps the runs deterministic enough to trust.
SIM_SWITCH_INTERVAL_S = 5e-3
SIM_TIMEOUT_S = 600

T = schedule.TileConfig
SIM_CONFIGS = (T(True, 8, 1), T(True, 32, 1), T(True, 64, 2), T(True, 128, 2), T(False, 8, 1), T(False, 128, 1))


# ----------------------------------------------------------------------------------------------
# Simulated problems and runs
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimProblem:
    """A small problem rebuilt identically in the worker and here from its fields."""

    name: str
    fmt: str
    seed: int
    n: int
    k: int
    group_sizes: tuple[int, ...]
    expert_ids: tuple[int, ...]
    nan_scale: str = ""    # "a": one token block's scale byte is NaN; "b": one weight row block's

    def build(self):
        rng = np.random.default_rng(self.seed)
        activations = random_activations(rng, sum(self.group_sizes), self.k)
        weights = random_weights(rng, NUM_EXPERTS, self.n, self.k)
        problem = build_problem(activations, weights, np.array(self.group_sizes), np.array(self.expert_ids),
                                fmt=self.fmt)
        if self.nan_scale:
            problem = with_nan_scale(problem, self.nan_scale)
        return problem

    @property
    def cost(self) -> int:
        live = sum(sz for sz, e in zip(self.group_sizes, self.expert_ids) if e >= 0)
        return live * self.n * self.k


def nan_scale_target(problem, operand: str):
    """(row, scale column) that ``with_nan_scale`` poisons: A -> a token of the largest live
    group; B -> weight row 3 of that group's expert. Scale column 1."""
    sizes = problem.group_sizes
    g = max(problem.active_slots(), key=lambda slot: sizes[slot])
    if operand == "a":
        return int(problem.a_offsets[g]) + 2, 1, g
    return 3, 1, g


def with_nan_scale(problem, operand: str):
    """A copy with one NaN scale byte (UE8M0 0xFF / UE4M3 0x7F) in the swizzled layout."""
    row, col, g = nan_scale_target(problem, operand)
    fmt = problem.a_format if operand == "a" else problem.b_format
    nan_byte = UE8M0_NAN_BYTE if fmt.scale_dtype == "ue8m0" else E4M3_NAN_BYTE
    cols = fmt.scale_cols(problem.k)
    if operand == "a":
        scales = problem.a_scales.copy()
        padded_row = row - int(problem.a_offsets[g]) + 128 * (int(problem.a_offsets[g]) // 128
                                                             + int(problem.a_scale_offsets[g]))
        scales.reshape(-1)[scale_offset(padded_row, col, cols)] = nan_byte
        return dataclasses.replace(problem, a_scales=scales)
    scales = problem.b_scales.copy()
    expert = int(problem.expert_ids[g])
    scales[expert].reshape(-1)[scale_offset(row, col, cols)] = nan_byte
    return dataclasses.replace(problem, b_scales=scales)


def ragged_problem(fmt: str, seed: int) -> SimProblem:
    """Ragged groups: a 1-token group, an empty group, a -1 slot, two groups of odd sizes."""
    rng = np.random.default_rng(1000 + seed)
    sizes = [1, 0, int(rng.integers(9, 21)), int(rng.integers(2, 7)), int(rng.integers(3, 9))]
    experts = [int(e) for e in rng.choice(NUM_EXPERTS, 5, replace=False)]
    experts[3] = -1
    order = rng.permutation(5)
    k = 80 if fmt == "nvfp4" else int(rng.choice([64, 96, 128]))   # 80: 5 NVFP4 scale columns, a partial atom
    return SimProblem(f"{fmt}-ragged", fmt, seed, int(rng.choice([40, 56, 72])), k,
                      tuple(sizes[i] for i in order), tuple(experts[i] for i in order))


@dataclass(frozen=True)
class SimRun:
    problem: SimProblem
    config: schedule.TileConfig | None    # None: the SM100 dispatch's config for the problem
    num_ctas: int | None = None

    @property
    def run_id(self) -> str:
        c = self.config
        knobs = "dispatch" if c is None else f"{'swap' if c.ab_swapped else 'noswap'}-bn{c.mma_bn}-cg{c.cta_group}"
        grid = "" if self.num_ctas is None else f"-ctas{self.num_ctas}"
        return f"{self.problem.name}-{knobs}{grid}"

    def execute(self):
        problem = self.problem.build()
        config = resolve_config(problem) if self.config is None else self.config
        return simt.grouped_matmul_simt(problem, config, out=poison_output(problem.total_tokens, problem.n),
                                        num_ctas=self.num_ctas)


def enumerate_problems():
    for seed, fmt in enumerate(FORMATS):
        yield ragged_problem(fmt, seed)
    yield SimProblem("mxfp4-long-group", "mxfp4", 11, 40, 64, (130, 3, 0), (4, -1, 2))
    yield SimProblem("nvfp4-wide-n", "nvfp4", 12, 160, 64, (6, 5, 2), (1, 6, -1))
    yield SimProblem("mxfp8-nan-a-scale", "mxfp8", 13, 40, 64, (4, 6, 2), (2, -1, 5), nan_scale="a")
    yield SimProblem("nvfp4-nan-b-scale", "nvfp4", 14, 40, 64, (4, 6, 2), (2, -1, 5), nan_scale="b")
    # K 96: a partial 64-element K chunk; N 72: a partial weight tile
    yield SimProblem("w4a16_nvfp4-tails", "w4a16_nvfp4", 15, 72, 96, (1, 0, 12, 3, 1), (6, 2, 0, -1, 3))


PROBLEMS = list(enumerate_problems())


def enumerate_runs():
    for p in PROBLEMS:
        if p.name.endswith("-ragged"):
            for config in SIM_CONFIGS:
                yield SimRun(p, config)
            if p.fmt != "mxfp8_e5m2":    # E5M2 has no SM100 route, so no dispatch config
                yield SimRun(p, None)
        elif p.name == "mxfp4-long-group":
            yield SimRun(p, T(False, 8, 1))     # two 128-token blocks, the second ragged
            yield SimRun(p, T(True, 64, 2), num_ctas=2)    # a single pair walks every tile
        elif p.name == "w4a16_nvfp4-tails":
            yield SimRun(p, T(False, 8, 1))
            yield SimRun(p, T(True, 64, 2), num_ctas=2)
        elif p.name == "nvfp4-wide-n":
            yield SimRun(p, T(True, 64, 2), num_ctas=10)   # rank 1 writes rows 128..159; idle pairs
            yield SimRun(p, T(True, 16, 1), num_ctas=1)
        else:
            yield SimRun(p, T(True, 8, 1))


RUNS = list(enumerate_runs())
RUNS_BY_ID = {r.run_id: r for r in RUNS}
assert len(RUNS_BY_ID) == len(RUNS), "run ids must be unique"


def _worker_main(out_dir: str, run_ids: list[str]) -> None:
    """Simulator worker: run each run, save its bf16 bits (or the traceback) and its time."""
    sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)
    from numba import config as numba_config

    assert numba_config.ENABLE_CUDASIM, "the worker must run with NUMBA_ENABLE_CUDASIM=1"
    for run_id in run_ids:
        start = time.perf_counter()
        try:
            out = RUNS_BY_ID[run_id].execute()
            np.save(os.path.join(out_dir, f"{run_id}.npy"), out.view(np.uint16))
        except Exception:
            Path(out_dir, f"{run_id}.err").write_text(traceback.format_exc())
        Path(out_dir, f"{run_id}.time").write_text(f"{time.perf_counter() - start:.3f}")


def shard_runs(runs, count):
    """Greedy split by cost (largest first) so that the workers finish together."""
    shards = [[] for _ in range(count)]
    loads = [0] * count
    for run in sorted(runs, key=lambda r: -r.problem.cost):
        i = loads.index(min(loads))
        shards[i].append(run.run_id)
        loads[i] += run.problem.cost
    return [s for s in shards if s]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """run_id -> bf16 output (or the worker's traceback string); runs all simulator workers once."""
    out_dir = tmp_path_factory.mktemp("simt_sim")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, str(out_dir), *shard], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for shard in shard_runs(RUNS, max(1, min(SIM_WORKERS, os.cpu_count() or 1)))]
    logs = [p.communicate(timeout=SIM_TIMEOUT_S) for p in procs]
    wall = time.perf_counter() - start
    results, times = {}, {}
    for run in RUNS:
        npy, err = out_dir / f"{run.run_id}.npy", out_dir / f"{run.run_id}.err"
        if npy.exists():
            results[run.run_id] = np.load(npy).view(BF16)
        elif err.exists():
            results[run.run_id] = err.read_text()
        else:
            results[run.run_id] = "worker died:\n" + "\n".join(e[-2000:] for _, e in logs)
        timing = out_dir / f"{run.run_id}.time"
        times[run.run_id] = float(timing.read_text()) if timing.exists() else float("nan")
    print(f"\nsimulator: {len(RUNS)} runs in {wall:.1f} s wall over {len(procs)} workers; slowest: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:3]))
    return results


def output_of(simulated, run):
    result = simulated[run.run_id]
    if isinstance(result, str):
        pytest.fail(f"simulator run {run.run_id} raised:\n{result}")
    return result


def expected_nan_mask(problem, nan_scale):
    """Outputs a NaN scale byte must turn NaN: its token's row or its weight row's column."""
    row, _, g = nan_scale_target(problem, nan_scale)
    mask = np.zeros((problem.total_tokens, problem.n), bool)
    if nan_scale == "a":
        mask[row, :] = True
    else:
        expert = problem.expert_ids[g]
        for slot in problem.active_slots():
            if problem.expert_ids[slot] == expert:
                mask[problem.a_offsets[slot]:problem.a_offsets[slot + 1], row] = True
    return mask


@pytest.mark.slow   # Numba's CUDA simulator in a subprocess: ~30 s on a 2-core CPU
@pytest.mark.parametrize("run", RUNS, ids=[r.run_id for r in RUNS])
def test_simulated_kernel_passes_acceptance(simulated, run):
    out = output_of(simulated, run)
    problem = run.problem.build()
    if not run.problem.nan_scale:
        acceptance = check_acceptance(problem, out)
        assert acceptance.passed, str(acceptance)
        return
    # A NaN scale byte makes its whole block NaN: exactly the rows / columns that use it are NaN
    # (as in the reference), and everything else still passes.
    nan_mask = expected_nan_mask(problem, run.problem.nan_scale)
    ref = reference_grouped_matmul(problem)
    written = problem.written_rows()
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32))[written], nan_mask[written])
    np.testing.assert_array_equal(np.isnan(ref.astype(np.float32))[written], nan_mask[written])
    clean = written & ~nan_mask.any(axis=1)
    cols = ~nan_mask.any(axis=0)
    max_rel, rms_rel = relative_errors(out[clean][:, cols], ref[clean][:, cols])
    assert max_rel <= MAX_REL_TOL and rms_rel <= RMS_REL_TOL


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if not p.nan_scale], ids=lambda p: p.name)
def test_every_config_gives_the_same_bits(simulated, problem):
    outs = {r.run_id: output_of(simulated, r) for r in RUNS if r.problem == problem}
    assert len(outs) >= 2
    first_id, first = next(iter(outs.items()))
    for run_id, out in outs.items():
        np.testing.assert_array_equal(out.view(np.uint16), first.view(np.uint16),
                                      err_msg=f"{run_id} differs from {first_id}")


def with_linear_scale_layout(problem, operand: str):
    """The problem with ``operand``'s scales laid out linearly (rows x columns) instead of in
    128x4 atoms: what a kernel that ignored the swizzle would effectively compute."""
    name = f"{operand}_scales"
    swizzled = getattr(problem, name)
    linear = unswizzle_scales(swizzled)
    return dataclasses.replace(problem, **{name: np.ascontiguousarray(linear).reshape(swizzled.shape)})


SCALED_OPERANDS = [(p, operand) for operand in ("a", "b") for p in PROBLEMS if p.name.endswith("-ragged")
                   and get_format(PROBLEM_FORMATS[p.fmt]["ab".index(operand)]).scaled]   # bf16 tokens have none


@pytest.mark.parametrize("problem, operand", SCALED_OPERANDS, ids=[f"{o}-{p.name}" for p, o in SCALED_OPERANDS])
def test_a_wrong_scale_layout_is_detected(simulated, problem, operand):
    run = next(r for r in RUNS if r.problem == problem)
    out = output_of(simulated, run)
    built = problem.build()
    assert check_acceptance(built, out).passed
    wrong = check_acceptance(with_linear_scale_layout(built, operand), out)
    assert not wrong.passed, f"the kernel's output also matches linearly laid-out {operand} scales: {wrong}"


@pytest.mark.parametrize("run", [r for r in RUNS if r.problem.fmt.startswith("w4a16")], ids=lambda r: r.run_id)
def test_w4a16_is_within_the_simt_exactness(simulated, run):
    """bf16 tokens x FP4 weights: every output within the SIMT kernel's bound, bit-identical where the
    accumulation is exact (``gbs.exactness``)."""
    problem = run.problem.build()
    assert problem.a_format.name == "bf16"
    check = check_output(problem, output_of(simulated, run), "simt")
    assert check.passed, "\n".join(check.mismatches)
    assert check.bit_identical > 0.9 * check.elements


# ----------------------------------------------------------------------------------------------
# Host-side helpers (the device-capable functions run as plain Python here)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("element, decode, codes", [
    ("e2m1", simt.decode_e2m1, np.arange(16)),
    ("e4m3", simt.decode_e4m3, np.arange(256)),
    ("e5m2", simt.decode_e5m2, np.arange(256)),
    ("bf16", simt.decode_bf16, np.arange(2 ** 16)),
])
def test_element_decoders_match_ml_dtypes(element, decode, codes):
    got = np.array([decode(int(c)) for c in codes], np.float32)
    want = decode_elements(codes.astype(np.uint16 if element == "bf16" else np.uint8), element)
    np.testing.assert_array_equal(got, want)   # NaN == NaN here; signed zeros and Inf compared too
    np.testing.assert_array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


def test_scale_decoders_match_quant():
    codes = np.arange(256)
    np.testing.assert_array_equal(np.array([simt.decode_ue8m0(int(c)) for c in codes], np.float32),
                                  decode_ue8m0(codes.astype(np.uint8)))
    assert simt.decode_ue8m0(0) == np.float32(2.0 ** -127) and np.isnan(simt.decode_ue8m0(0xFF))
    positive = np.arange(128)
    np.testing.assert_array_equal(np.array([simt.decode_e4m3(int(c)) for c in positive], np.float32),
                                  decode_ue4m3(positive.astype(np.uint8)))
    assert np.isnan(simt.decode_e4m3(E4M3_NAN_BYTE))
    assert simt.decode_no_scale(0) == np.float32(1.0)   # bf16 tokens


def test_bf16_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | 0x8000      # exactly half-way
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
                        0x007FFFFF, 0x3F808000, 0x3F818000, 0x7FC00000, 0xFFC00001, 0x7F800001], np.uint32)
    bits = np.concatenate([bits, ties, special])
    got = np.array([simt.bf16_bits_rne(int(b)) for b in bits], np.uint32).astype(np.uint16)
    values = bits.view(np.float32)
    with np.errstate(invalid="ignore"):   # NaN inputs
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(BF16).astype(np.float32)))
    assert simt.bf16_bits_rne(0x3F808000) == 0x3F80 and simt.bf16_bits_rne(0x3F818000) == 0x3F82   # ties to even


@pytest.mark.parametrize("threads", [32, 256, 1024])
def test_sub_tiles_fit_the_threads_and_shared_memory(threads):
    for cta_group, mma_bns in LEGAL_MMA_BN.items():
        for mma_bn in mma_bns:
            for swapped in (True, False) if cta_group == 1 else (True,):
                shape = T(swapped, mma_bn, cta_group).tile_shape
                spec = simt.SimtKernelSpec("nvfp4", "nvfp4", shape.tokens, shape.weight_rows, cta_group, threads)
                sub_tokens, sub_rows = spec.sub_tile
                assert 1 <= sub_tokens <= shape.tokens and 1 <= sub_rows <= shape.cta_weight_rows
                assert sub_tokens * sub_rows <= threads * simt.OUTPUTS_PER_THREAD
                smem = (sub_tokens + sub_rows) * (simt.SMEM_ROW_STRIDE + simt.K_CHUNK // 16) * 4
                assert smem <= 48 * 1024


@pytest.mark.parametrize("fmt, knobs", [("nvfp4", (True, 8, 1)), ("w4a8", (False, 128, 1)),
                                        ("mxfp8_e5m2", (True, 128, 2)), ("w4a16_nvfp4", (True, 64, 2))])
def test_kernel_compiles_for_sm90a_without_local_memory(fmt, knobs):
    from numba import config as numba_config
    from numba.cuda import types

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from gbs.ptx_inline import offline

    problem = tiny_problem(fmt)
    spec = simt.SimtKernelSpec.for_problem(problem, T(*knobs))
    sig = (types.uint32[:, ::1], types.uint32[:, :, ::1], types.uint8[::1], types.uint8[:, ::1],
           types.int64[::1], types.int64[::1], types.int32[::1], types.float32[::1], types.uint16[:, ::1],
           types.int64, types.int64, types.int64)
    cubin = offline.compile_cubin(simt.make_kernel_function(spec), sig, offline.SM90A)
    assert not offline.uses_local_memory(offline.disassemble(cubin))
    assert offline.resource_usage(cubin).shared_bytes <= 48 * 1024


# ----------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch
# ----------------------------------------------------------------------------------------------
def tiny_problem(fmt="nvfp4", **kw):
    args = dict(n=40, k=64, num_experts=4, total_tokens=12, num_active_experts=3, routing="ragged",
                num_empty=0, num_skipped=1, seed=5)
    args.update(kw)
    return random_problem(fmt, **args)


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the kernel would be built or launched."""
    def refuse(spec):
        raise AssertionError("the kernel was launched")
    monkeypatch.setattr(simt, "_launchable_kernel", refuse)


def tampered(problem, **fields):
    """A problem whose arrays were replaced after validation (frozen dataclasses allow it)."""
    copy = dataclasses.replace(problem)
    for name, value in fields.items():
        object.__setattr__(copy, name, value)
    return copy


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize("make_args, error, match", [
    (lambda p: ("not a problem", T(True, 8, 1)), TypeError, "problem must be a GroupedProblem"),
    (lambda p: (p, (True, 8, 1)), TypeError, "KernelConfig or TileConfig"),
    (lambda p: (p, pytypes.SimpleNamespace(ab_swapped=True, mma_bn=8, cta_group=2)), ValueError,
     "mma_bn=8 is illegal with cta_group=2"),
    (lambda p: (p, pytypes.SimpleNamespace(ab_swapped=False, mma_bn=64, cta_group=2)), ValueError,
     "requires ab_swapped=True"),
    (lambda p: (p, grouped_matmul_mxfp8_dispatch(n=40, k=64, num_active_experts=3, estimated_total_m=12)),
     ValueError, "decided for a_format='mxfp8'"),
    (lambda p: (tampered(p, a=p.a.view(np.int8)), T(True, 8, 1)), TypeError, "a must have dtype uint8"),
    (lambda p: (tampered(p, b=p.b[:, :, :-1]), T(True, 8, 1)), ValueError, "b must have shape"),
    (lambda p: (tampered(p, expert_ids=p.expert_ids.astype(np.int64)), T(True, 8, 1)), TypeError,
     "expert_ids must have dtype int32"),
    (lambda p: (tampered(p, k=72), T(True, 8, 1)), ValueError, "K = 72 is not a multiple of the nvfp4 block size"),
    (lambda p: (tampered(p, k=96), T(True, 8, 1)), ValueError, "a must have shape"),
])
def test_bad_problem_or_config_is_rejected_before_launch(make_args, error, match):
    problem, config = make_args(tiny_problem())
    with pytest.raises(error, match=match):
        simt.grouped_matmul_simt(problem, config)
    ok, reason = simt.can_implement(problem, config)
    assert not ok and reason


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize("make_kw, error, match", [
    (lambda p: dict(out=np.zeros((p.total_tokens, p.n), np.float32)), TypeError, "bfloat16"),
    (lambda p: dict(out=poison_output(p.total_tokens + 1, p.n)), ValueError, "must have shape"),
    (lambda p: dict(out=poison_output(p.n, p.total_tokens).T), ValueError, "C-contiguous"),
    (lambda p: dict(num_ctas=3), ValueError, "multiple of cta_group=2"),
    (lambda p: dict(num_ctas=0), ValueError, "positive int"),
    (lambda p: dict(threads_per_block=48), ValueError, "multiple of 32"),
    (lambda p: dict(threads_per_block=2048), ValueError, "multiple of 32"),
])
def test_bad_launch_arguments_are_rejected(make_kw, error, match):
    problem = tiny_problem()
    with pytest.raises(error, match=match):
        simt.grouped_matmul_simt(problem, T(True, 64, 2), **make_kw(problem))


def test_can_implement_accepts_every_format_and_legal_config():
    for fmt in FORMATS:
        problem = tiny_problem(fmt)
        for config in SIM_CONFIGS:
            assert simt.can_implement(problem, config) == (True, "")
        assert simt.can_implement(problem, resolve_config(problem)) == (True, "")


@pytest.mark.usefixtures("no_launch")
def test_nothing_is_launched_when_every_slot_is_skipped_or_empty():
    rng = np.random.default_rng(3)
    problem = build_problem(random_activations(rng, 7, 64), random_weights(rng, 3, 40, 64),
                            np.array([4, 0, 3]), np.array([-1, 1, -1]), fmt="mxfp8")
    out = np.full((7, 40), 1.5, BF16)
    assert simt.grouped_matmul_simt(problem, T(True, 8, 1), out=out) is out
    assert np.all(out.astype(np.float32) == 1.5)


# ----------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200)
# ----------------------------------------------------------------------------------------------
GPU_SHAPES = {"deepseek-up": (4096, 7168), "kimi-up": (512, 7168)}
# 8 experts x a few tokens, with an empty group and a -1 slot.
GPU_GROUP_SIZES = (3, 5, 0, 7, 2, 1, 4, 6, 2)
GPU_EXPERT_IDS = (0, 1, 2, 3, -1, 4, 5, 6, 7)
GPU_ALTERNATIVE_CONFIGS = (T(True, 8, 1), T(True, 128, 2), T(False, 64, 1))


def gpu_configs(problem):
    """The dispatch's config (E5M2, W4A16: their route's tile) and the alternatives, distinct knobs."""
    configs = [resolve_config(problem), *GPU_ALTERNATIVE_CONFIGS]
    seen, distinct = set(), []
    for config in configs:
        knobs = schedule.TileConfig.of(config)
        if knobs not in seen:
            seen.add(knobs)
            distinct.append(config)
    return distinct


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", list(GPU_SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_kernel_on_model_shapes(fmt, shape_name):
    from gbs.lab.cases import synthetic_problem   # random codes and scales: built in seconds at this size

    n, k = GPU_SHAPES[shape_name]
    problem = synthetic_problem(fmt, n=n, k=k, group_sizes=GPU_GROUP_SIZES, expert_ids=GPU_EXPERT_IDS,
                                num_experts=NUM_EXPERTS, seed=1)
    ref = reference_grouped_matmul(problem)
    outs = []
    for config in gpu_configs(problem):
        simt.grouped_matmul_simt(problem, config)   # compile and warm up
        start = time.perf_counter()
        out = simt.grouped_matmul_simt(problem, config, out=poison_output(problem.total_tokens, n))
        seconds = time.perf_counter() - start
        acceptance = check_acceptance(problem, out, ref)
        knobs = schedule.TileConfig.of(config)
        print(f"\n{fmt} {shape_name} {knobs}: {seconds * 1e3:.1f} ms incl. host<->device copies; {acceptance}")
        assert acceptance.passed, f"{knobs}: {acceptance}"
        outs.append(out.view(np.uint16))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2:])
