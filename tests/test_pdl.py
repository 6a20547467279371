"""Programmatic dependent launch (PDL) of the H200 kernels: ``gbs.plan.plan_h200(..., pdl=True)`` ->
``h200_launch.prepare`` -> ``launch.PreparedLaunch(pdl=True)``, a launch with ``LaunchConfig(
programmatic_stream_serialization=True)`` that may start while the kernel before it in the stream runs; both kernels
execute ``griddepcontrol.wait`` before their first global access and then ``griddepcontrol.launch_dependents``
(``h200_ring``'s docstring).

CPU: the PTX of streaming and wgmma builds holds one wait and one trigger, the wait in the kernel's entry block and
before every global-memory access in the text (one ``.entry``, no ``.func``: every access is in the text after it, so
text order is a fair proxy of program order there; the entry block dominates every other); the launch passes the
attribute only when asked, and an installed cuda.core without the keyword is a clear error; the plan's knob, its rule
and description, and that it reaches the prepared launch; the sweep's ``--pdl`` / ``--back-to-back`` through
``scripts/compare_variants.py``.

GPU (``@pytest.mark.gpu``, H200): PDL bursts of one prepared launch give the plain launch's bits (split-K builds: the
kernel's acceptance, their fp32 reductions run in any order) and leave counters and workspace zeroed; a kernel that
triggers early and then rewrites the tokens, their scales and the expert ids, followed at once by a PDL launch: the
output is the NEW problem's (a wait placed too late reads the old bytes); a PDL launch after a plain kernel; and a
probe that a PDL launch through cuda.core really starts before the kernel ahead of it ends.
"""
from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np
import pytest

from gbs import plan as gbs_plan
from gbs.lab.cases import synthetic_problem
from gbs.numba_kernels import h200_launch as hl
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_stream as hs
from gbs.numba_kernels import h200_wgmma as hw
from gbs.numba_kernels import launch
from gbs.plan import ProblemMeta, plan_h200
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import offline
from gbs.formats import BF16
from gbs.reference import POISON_BITS, reference_grouped_matmul
from h200_knobs import Stream, Wgmma, check_kernel, prepare
from script_modules import load_script

# =============================================================================================
# PTX: one wait and one trigger, the wait ahead of every global access
# =============================================================================================
WAIT, TRIGGER = "griddepcontrol.wait;", "griddepcontrol.launch_dependents;"
# instructions that read or write global memory, or may (generic ld / st): every ld / st / atom / red outside the
# shared, param, local and const spaces, and the TMA and cp.async copies (their source is global). The tensor-map
# prefetch and fence read maps the host wrote, never a kernel, so they are not counted.
GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st|atom|red)(?!\.(?:shared|param|local|const)\b)\.\S+"
                           r"|cp\.async\.(?:bulk\.tensor|ca|cg)\.\S+)")
PTX_BUILDS = {   # the stream kernel's split-K and trace builds (the entry stamp writes global memory), two wgmma ones
    "stream-splitk": (hs, hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, split_k=True)),
    "stream-trace": (hs, hr.StreamSpec("nvfp4", "nvfp4", True, 8, 1, 2, trace=True)),
    "wgmma-prefill": (hw, hw.WgmmaSpec("nvfp4", "nvfp4", 128, 2)),
    "wgmma-swapped-splitk": (hw, hw.WgmmaSpec("nvfp4", "nvfp4", 32, 2, ab_swapped=True, split_k=True)),
}


def body_lines(ptx: str) -> list[str]:
    """The lines of the PTX's one kernel (``.entry``) body; AssertionError where there is another function."""
    assert len(re.findall(r"^\.(?:visible\s+)?\.entry\s", ptx, re.M)) == 1, "one kernel"
    assert not re.search(r"^\.(?:visible\s+|weak\s+)?\.func\s", ptx, re.M), "no separate device functions"
    assert not re.search(r"^\s*call(?:\.uni)?\s", ptx, re.M), "no calls: every access is in the kernel's text"
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\.(?:visible\s+)?\.entry\s", line))
    return lines[start:]


def grid_dependency_order(ptx: str) -> dict:
    """Where the kernel's grid dependency instructions sit: their counts, the first global access's line after the
    wait's (positive: after), and whether a label or branch comes before the wait (it is then outside the entry
    block)."""
    lines = body_lines(ptx)
    waits = [i for i, line in enumerate(lines) if line.strip() == WAIT]
    triggers = [i for i, line in enumerate(lines) if line.strip() == TRIGGER]
    accesses = [i for i, line in enumerate(lines) if GLOBAL_ACCESS.match(line)]
    wait = waits[0] if waits else len(lines)
    body_start = next(i for i, line in enumerate(lines) if line.strip() == "{")
    branches = [i for i, line in enumerate(lines[body_start:wait], body_start)
                if re.match(r"^\$L\w+:", line) or re.search(r"\bbra(?:\.uni)?\s", line)]
    return dict(waits=len(waits), triggers=len(triggers), first_access_after_wait=accesses[0] - wait,
                trigger_after_wait=(triggers[0] - wait) if triggers else None, branch_before_wait=bool(branches))


@pytest.fixture(scope="module")
def compiled_ptx():
    return {name: offline.compile_ptx(kernel.make_kernel_function(spec), hr.kernel_signature(), offline.SM90A)
            for name, (kernel, spec) in PTX_BUILDS.items()}


@pytest.mark.slow   # offline compiles
@pytest.mark.parametrize("build", list(PTX_BUILDS))
def test_every_thread_waits_for_the_kernel_before_ahead_of_its_first_global_access(compiled_ptx, build):
    order = grid_dependency_order(compiled_ptx[build])
    assert order["waits"] == 1 and order["triggers"] == 1, order
    assert order["first_access_after_wait"] > 0, f"a global access comes before the wait: {order}"
    assert not order["branch_before_wait"], f"the wait is outside the entry block (not every thread runs it): {order}"
    assert order["trigger_after_wait"] > 0, order


def test_the_order_check_finds_an_access_before_the_wait():
    """The check above can fail: a load ahead of the wait, or a wait past a branch, is reported."""
    head = ".visible .entry k(\n)\n{\n"
    late = head + "\tld.global.u32 \t%r1, [%rd1];\n\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n}\n"
    assert grid_dependency_order(late)["first_access_after_wait"] < 0
    generic = head + "\tld.u32 \t%r1, [%rd1];\n\tgriddepcontrol.wait;\n}\n"
    assert grid_dependency_order(generic)["first_access_after_wait"] < 0, "a generic load may read global memory"
    branched = head + "\t@%p1 bra \t$L__BB0_2;\n$L__BB0_2:\n\tgriddepcontrol.wait;\n\tst.global.u32 [%rd1], %r1;\n}\n"
    assert grid_dependency_order(branched)["branch_before_wait"]
    fine = head + "\tld.param.u64 \t%rd1, [p];\n\tgriddepcontrol.wait;\n\tld.shared.u32 %r1, [%r2];\n" \
                  "\tcp.async.bulk.tensor.2d.shared::cluster.global.tile [%r3], [%rd1, {%r4, %r5}], [%r6];\n}\n"
    assert grid_dependency_order(fine)["first_access_after_wait"] == 2


# =============================================================================================
# Launch: the attribute only when asked; a clear error without it
# =============================================================================================
def _fake_kernel():
    cufunc = type("CuFunc", (), {"kernel": "the kernel"})()
    library = type("Library", (), {"get_cufunc": lambda self: cufunc})()
    overload = type("Overload", (), {"shared_mem_per_block": 0, "argument_types": (), "_codelibrary": library,
                                     "_prepare_args": lambda self, *a: None})()
    return launch.CompiledKernel(overload, threads=128, dynamic_smem_bytes=1024, cluster_size=1, name="k")


@pytest.fixture
def recorded_configs(monkeypatch):
    """cuda.core's LaunchConfig replaced by a recorder of its keywords; no stream lookup (no GPU here)."""
    import cuda.core
    from numba.cuda.cudadrv import driver as nbdrv

    configs = []
    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **fields: configs.append(fields) or fields)
    monkeypatch.setattr(nbdrv, "_to_core_stream", lambda stream: stream)
    monkeypatch.setattr(launch, "gpu_compute_capability", lambda: None)
    return configs


def test_the_launch_asks_for_programmatic_serialization_only_when_told(recorded_configs):
    plain = launch.prepare_launch(_fake_kernel(), 4, ())
    dependent = launch.prepare_launch(_fake_kernel(), 4, (), pdl=True)
    assert (plain.pdl, dependent.pdl) == (False, True)
    assert launch.PDL_LAUNCH_OPTION == "programmatic_stream_serialization"
    assert launch.PDL_LAUNCH_OPTION not in recorded_configs[0]
    assert recorded_configs[1] == dict(recorded_configs[0], programmatic_stream_serialization=True)
    with pytest.raises(TypeError, match="pdl must be a bool"):
        launch.prepare_launch(_fake_kernel(), 4, (), pdl=1)


def test_a_cuda_core_without_the_keyword_is_a_clear_error(monkeypatch, recorded_configs):
    import cuda.core

    def old_launch_config(*, grid=None, cluster=None, block=None, shmem_size=None, is_cooperative=False):
        return "a config"

    monkeypatch.setattr(cuda.core, "LaunchConfig", old_launch_config)
    monkeypatch.setattr(cuda.core, "__version__", "0.9.0")
    assert launch.prepare_launch(_fake_kernel(), 4, ())._config == "a config", "plain launches still work"
    with pytest.raises(RuntimeError, match=r"cuda\.core 0\.9\.0 lacks it.*cuda-core>=1\.2\.0"):
        launch.prepare_launch(_fake_kernel(), 4, (), pdl=True)


def test_the_installed_cuda_core_takes_the_keyword():
    """The installed cuda.core builds a PDL config (no GPU needed: LaunchConfig is plain data)."""
    config = launch.make_launch_config(launch.launch_config_fields(_fake_kernel(), 4, pdl=True))
    assert config.programmatic_stream_serialization is True


# =============================================================================================
# Plan: the knob, its rule and its way to the launch
# =============================================================================================
def test_the_plan_asks_for_pdl_only_when_told():
    meta = ProblemMeta.of("nvfp4", 512, 7168, 8, 1)
    plain, dependent = plan_h200(meta), plan_h200(meta, pdl=True)
    assert plain.pdl is False and gbs_plan.PDL_RULE not in plain.rules
    assert "programmatic dependent launch" not in plain.describe() + plain.explain()
    assert dependent.pdl is True and dependent.rules[-1] == gbs_plan.PDL_RULE
    assert dependent.describe() == plain.describe() + "; programmatic dependent launch"
    assert "- launch: programmatic dependent launch, as asked" in dependent.explain()
    assert dataclasses.replace(dependent, pdl=False, rules=plain.rules) == plain, "nothing else changes"
    with pytest.raises(TypeError, match="pdl must be a bool"):
        plan_h200(meta, pdl="yes")


def test_the_plan_carries_pdl_to_the_prepared_launch(monkeypatch):
    """``h200_launch.prepare`` hands ``plan.pdl`` to the launch (its device work stubbed out: no GPU here)."""
    p = synthetic_problem("nvfp4", n=256, k=512, group_sizes=[4, 6], expert_ids=[0, 1], num_experts=2)
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(launch.DeviceProblem) if f.name != "host_routing"}
    device_problem = launch.DeviceProblem(**fields)
    asked = []
    monkeypatch.setattr(launch, "require_gpu", lambda *a: None)
    monkeypatch.setattr(launch, "device_address", lambda arr: 1 << 20)
    monkeypatch.setattr(launch, "device_tensor_maps", lambda images, stream=0: "maps")
    monkeypatch.setattr(launch, "prepare_launch", lambda kernel, grid, args, **kw: asked.append(kw["pdl"]) or "launch")
    monkeypatch.setattr(hl, "compiled_kernel", lambda spec: "kernel")
    monkeypatch.setattr(hl, "tensor_map_args", lambda *a: [])
    monkeypatch.setattr(hl, "device_out", lambda *a, **kw: "out")
    monkeypatch.setattr(hl, "zeroed_counters", lambda *a: "counters")
    monkeypatch.setattr(hl.cuda, "device_array", lambda *a, **kw: "workspace")
    for pdl in (False, True):
        prepared = hl.prepare(device_problem, plan_h200(p, backend="h200_stream", pdl=pdl))
        assert prepared._launch == "launch" and prepared.plan.pdl is pdl
    assert asked == [False, True]


# =============================================================================================
# The sweep: --pdl and --back-to-back, through compare_variants
# =============================================================================================
def test_compare_variants_passes_pdl_and_back_to_back_to_the_sweep(capsys, tmp_path):
    variants = load_script("compare_variants")
    rc = variants.main(["--dry-run", "--rounds", "1", "--out", str(tmp_path), "base=.:--back-to-back=10",
                        "pdl=.:--pdl=1,--back-to-back=10", "--", "plan:auto:nvfp4:kimi_decode"])
    base, dependent = [line for line in capsys.readouterr().out.splitlines() if line.startswith("==")]
    assert rc == 0 and "--back-to-back 10" in base and "--pdl" not in base
    assert "--pdl 1 --back-to-back 10" in dependent
    sweep = load_script("h200_stream_sweep")
    for bad in (["--pdl", "2", "p"], ["--pdl", "yes", "p"], ["--back-to-back", "0", "p"]):
        with pytest.raises(SystemExit):
            sweep.main(bad)


# =============================================================================================
# GPU (H200)
# =============================================================================================
PDL_BURST = 5            # PDL launches of one prepared launch back to back ...
BURST_QUEUE_HOLD_S = 0.05   # ... queued behind a sleeping kernel, so that the GPU runs them one after the other
# (name, format, N, K, group sizes, expert ids, knobs, plan constraints, deterministic: bit-identical to a plain launch)
BURST_CASES = [
    ("stream-decode-splitk", "nvfp4", 512, 7168, [1] * 8, list(range(8)), Stream(True, 8, 1, 2, small_n_warps=8),
     dict(k_splits=4), False),
    ("stream-dynamic-items", "nvfp4", 512, 7168, [5, 0, 1, 37, 3, 70, 129, 300], [0, 4, 1, -1, 2, 5, 3, 6],
     Stream(True, 8, 1), dict(num_ctas=3, k_splits=1), True),
    ("stream-prefill", "mxfp4", 1024, 2048, [40, 64, 0, 33], [2, 0, -1, 1], Stream(True, 64, 2), {}, True),
    ("wgmma-prefill", "nvfp4", 1024, 2048, [128, 200, 0, 64], [3, 1, -1, 0], Wgmma(128), {}, True),
    ("wgmma-swapped-splitk", "nvfp4", 512, 7168, [20, 17, 24], [0, 2, 1], Wgmma(32, ab_swapped=True),
     dict(k_splits=4), False),
]


def burst_problem(case):
    name, fmt, n, k, sizes, ids, *_ = case
    return synthetic_problem(fmt, n=n, k=k, group_sizes=sizes, expert_ids=ids, num_experts=8,
                             seed=zlib.crc32(f"pdl/{name}".encode()))


@pytest.mark.gpu
@pytest.mark.parametrize("case", BURST_CASES, ids=lambda c: c[0])
def test_gpu_pdl_bursts_give_the_plain_launch_result_and_clean_up(case):
    from numba import cuda

    from gbs.lab.timing import hold_stream

    name, fmt, n, k, sizes, ids, knobs, constraints, deterministic = case
    problem = burst_problem(case)
    device_problem = launch.to_device(problem)
    sentinel = np.full((problem.total_tokens, problem.n), 0x1234, np.uint16)
    plain_out, pdl_out = cuda.to_device(sentinel), cuda.to_device(sentinel)
    prepare(device_problem, knobs, plain_out, **constraints)()
    stream = cuda.stream()   # a blocking stream: its first launch waits for the legacy stream's sleeping kernel
    dependent = prepare(device_problem, knobs, pdl_out, stream=stream, pdl=True, **constraints)
    assert dependent.plan.pdl and dependent._launch.pdl
    cuda.synchronize()
    hold_stream(BURST_QUEUE_HOLD_S)
    for _ in range(PDL_BURST):
        dependent()
    cuda.synchronize()
    want, got = plain_out.copy_to_host(), pdl_out.copy_to_host()
    if deterministic:
        np.testing.assert_array_equal(got, want)
    skipped = ~problem.written_rows()
    assert np.all(got[skipped] == 0x1234), "rows of -1 slots are never written"
    merged = np.where(skipped[:, None], np.uint16(POISON_BITS), got).view(BF16)
    result = check_kernel(problem, merged, reference_grouped_matmul(problem), dependent.plan.kernel)
    assert result.passed, str(result)
    assert not np.any(dependent.split_counters.copy_to_host()), "tile and item counters reset after the burst"
    if dependent.plan.k_splits > 1:
        assert not np.any(dependent.split_sums.copy_to_host()), "workspace zeroed after the burst"


EARLY_TRIGGER_DELAY_NS = 200_000   # the writer's wait between its trigger and its writes


def early_trigger_writer():
    """A kernel that lets its dependent start at once (``launch_dependents`` first), waits on %globaltimer, then
    copies three byte arrays (grid-stride): with its dependent waiting too late, the dependent reads old bytes."""
    from numba import cuda

    @cuda.jit(device=True)
    def copy(dst, src):
        i = cuda.grid(1)
        while i < dst.shape[0]:
            dst[i] = src[i]
            i += cuda.gridsize(1)

    @cuda.jit
    def write_late(dst_a, src_a, dst_b, src_b, dst_c, src_c, delay_ns):
        cm.griddepcontrol_launch_dependents()
        deadline = cm.read_globaltimer() + np.uint64(delay_ns)
        while cm.read_globaltimer() < deadline:
            cuda.nanosleep(np.uint32(1000))
        copy(dst_a, src_a)
        copy(dst_b, src_b)
        copy(dst_c, src_c)

    return write_late


def _bytes(device_array):
    return device_array.reshape(device_array.size).view(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [BURST_CASES[0], BURST_CASES[3]], ids=lambda c: c[0])
def test_gpu_a_pdl_launch_reads_what_the_kernel_before_it_wrote(case):
    """A writer that triggers at once and writes new tokens, token scales and expert ids only later, then at once a
    PDL launch on the same stream: the output is the new problem's."""
    from numba import cuda

    name, fmt, n, k, sizes, ids, knobs, constraints, _ = case
    old = burst_problem(case)
    fresh = synthetic_problem(fmt, n=n, k=k, group_sizes=sizes, expert_ids=ids, num_experts=8,
                              seed=zlib.crc32(f"pdl-new/{name}".encode()))
    new_ids = np.where(old.expert_ids >= 0, (old.expert_ids + 3) % 8, -1).astype(np.int32)
    new = dataclasses.replace(old, a=fresh.a, a_scales=fresh.a_scales, expert_ids=new_ids)
    stream = cuda.stream()
    device_problem = launch.to_device(old, stream=stream)
    sources = [cuda.to_device(np.ascontiguousarray(arr).view(np.uint8).reshape(-1), stream=stream)
               for arr in (new.a, new.a_scales, new.expert_ids)]
    out = cuda.device_array((old.total_tokens, old.n), np.uint16, stream=stream)
    dependent = prepare(device_problem, knobs, out, stream=stream, pdl=True, **constraints)
    stream.synchronize()
    write = early_trigger_writer()
    write[4, 256, stream](_bytes(device_problem.a), sources[0], _bytes(device_problem.a_scales), sources[1],
                          _bytes(device_problem.expert_ids), sources[2], np.uint64(EARLY_TRIGGER_DELAY_NS))
    dependent()
    stream.synchronize()
    bits = out.copy_to_host()
    skipped = ~new.written_rows()
    merged = np.where(skipped[:, None], np.uint16(POISON_BITS), bits).view(BF16)
    result = check_kernel(new, merged, reference_grouped_matmul(new), dependent.plan.kernel)
    assert result.passed, f"not the new problem's output (the wait comes too late?): {result}"


@pytest.mark.gpu
def test_gpu_a_pdl_launch_after_a_plain_kernel():
    """A plain kernel (no grid dependency control) fills the output with a sentinel, then a PDL launch: the written
    rows are the plain launch's bits, the rows of -1 slots keep the sentinel."""
    from numba import cuda

    case = BURST_CASES[1]
    name, fmt, n, k, sizes, ids, knobs, constraints, _ = case
    problem = burst_problem(case)
    device_problem = launch.to_device(problem)
    plain_out = cuda.device_array((problem.total_tokens, problem.n), np.uint16)
    prepare(device_problem, knobs, plain_out, **constraints)()
    out = cuda.device_array((problem.total_tokens, problem.n), np.uint16)
    dependent = prepare(device_problem, knobs, out, pdl=True, **constraints)
    cuda.synchronize()

    @cuda.jit
    def fill(words, value):
        i = cuda.grid(1)
        if i < words.shape[0]:
            words[i] = value

    flat = out.reshape(out.size)
    fill[-(-flat.size // 256), 256](flat, np.uint16(0x4321))
    dependent()
    cuda.synchronize()
    got, want = out.copy_to_host(), plain_out.copy_to_host()
    written = problem.written_rows()
    np.testing.assert_array_equal(got[written], want[written])
    assert np.all(got[~written] == 0x4321)


PROBE_SPIN_NS = 200_000


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["legacy_default", "created"])
def test_gpu_a_pdl_launch_starts_before_the_kernel_ahead_of_it_ends(stream_kind):
    """The mechanism through cuda.core: behind a one-CTA kernel that triggers at once and then spins, a PDL launch's
    CTA starts (stamp before its wait) before that kernel ends, and its wait returns after it, seeing its last
    write. A failure on the legacy default stream alone says that timings there (``gbs.lab.timing``: events on the
    legacy default stream) cannot show what PDL saves."""
    from numba import cuda

    stream = cuda.legacy_default_stream() if stream_kind == "legacy_default" else cuda.stream()
    stamps = cuda.to_device(np.zeros(4, np.uint64), stream=stream)

    @cuda.jit
    def spin_after_trigger(stamps, spin_ns):
        cm.griddepcontrol_launch_dependents()
        start = cm.read_globaltimer()
        while cm.read_globaltimer() < start + np.uint64(spin_ns):
            pass
        if cuda.threadIdx.x == 0:
            stamps[0] = cm.read_globaltimer()   # the primary's last write, just before it ends

    def stamp_entry(stamps):
        entered = cm.read_globaltimer()
        cm.griddepcontrol_wait()
        if cuda.threadIdx.x == 0:
            stamps[1] = entered
            stamps[2] = cm.read_globaltimer()
            stamps[3] = stamps[0]

    from numba import types

    kernel = launch.compile_kernel(stamp_entry, (types.Array(types.uint64, 1, "C"),), threads=32,
                                   dynamic_smem_bytes=0, name="stamp_entry")
    dependent = launch.prepare_launch(kernel, 1, (stamps,), stream=stream, pdl=True)
    stream.synchronize()
    spin_after_trigger[1, 32, stream](stamps, np.uint64(PROBE_SPIN_NS))
    dependent()
    stream.synchronize()
    primary_end, entered, after_wait, seen = stamps.copy_to_host()
    assert seen == primary_end, "the wait returned before the primary's last write was visible"
    assert after_wait >= primary_end
    assert entered < primary_end, (f"no overlap on the {stream_kind} stream: the PDL launch's CTA entered "
                                   f"{entered - primary_end} ns after the kernel ahead of it ended")
