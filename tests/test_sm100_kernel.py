"""The SM100 tcgen05 kernel: assembled for sm_100a (ptxas through nvJitLink, no GPU) for every
configuration the dispatch can return, its SASS and resources checked; its shared-memory and
TMEM plans checked against the budgets and the stages=auto formula; the host wrapper's errors.

Each distinct kernel (formats x knobs; the pipeline depth is a launch argument) is compiled once
per session (``functools.cache``), about 5 s each on one core.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from gbs import dispatch
from gbs.numba_kernels.sm100 import SM100_COMPUTE_CAPABILITY, grouped_matmul_sm100
from gbs.numba_kernels.sm100_build import (AssembledKernel, assemble, dispatch_outcomes, format_resource_table,
                                           resource_rows)
from gbs.numba_kernels.sm100_kernel import TMA_LOAD_CTA_PAIR_PTX
from gbs.numba_kernels.sm100_spec import (A_TILE_BYTES, MBARRIER_BYTES, SCHEDULER_SLOT_BYTES, SCHEDULER_SLOTS,
                                          SMEM_REGIONS, SWIZZLE_ATOM_BYTES, TMEM_ADDRESS_BYTES, Sm100KernelSpec,
                                          check_launch_plan, launch_smem_bytes, max_dynamic_smem_bytes, smem_plan,
                                          tmem_plan)
from gbs.problem import build_problem
from gbs.ptx_inline import offline
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.reference import check_acceptance
from gbs.schedule import TileConfig

OUTCOMES = dispatch_outcomes()
# One kernel per (formats, knobs); the labels of the dispatch outcomes it serves.
KERNELS: dict[Sm100KernelSpec, list[str]] = {}
for _label, _config in OUTCOMES:
    KERNELS.setdefault(Sm100KernelSpec.of((_config.a_format, _config.b_format), _config), []).append(_label)
KERNEL_SPECS = list(KERNELS)
REGISTER_FILE = 64 * 1024          # 32-bit registers per SM
MAX_REGISTERS_PER_THREAD = 255


def assembled(spec: Sm100KernelSpec) -> AssembledKernel:
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    return _assembled(spec)


@functools.cache
def _assembled(spec: Sm100KernelSpec) -> AssembledKernel:
    return assemble(spec)


def _spec_id(spec):
    return f"{spec.a_format}x{spec.b_format}-{'T' if spec.ab_swapped else 'F'}{spec.mma_bn}-cg{spec.cta_group}"


def expected_opcodes(spec: Sm100KernelSpec) -> set[str]:
    """SASS each kernel must contain (``docs/design/sm100_kernel.md``, ``toolchain.md``; tests/test_ptx_tcgen05.py)."""
    two = ".2CTA" if spec.cta_group == 2 else ""
    mma = {"mxf4nvf4": f"UTCOMMA{two}.4X", "mxf4": f"UTCOMMA{two}", "mxf8f6f4": f"UTCQMMA{two}"}[spec.kind.name]
    ops = {mma, f"UTCCP.T.S{two}.4x32dp128bit", f"UTMALDG.2D{two}", f"UTMALDG.3D{two}", "UTMASTG.2D",
           f"LDTM.x{spec.chunk_columns}", f"UTCATOMSWS{two}.FIND_AND_SET.ALIGN", "UTCATOMSWS.AND",
           "UVIRTCOUNT.DEALLOC.SMPOOL", "UTCBAR.2CTA.MULTICAST" if two else "UTCBAR"}
    if spec.sfb_by_store_warps:
        ops |= {"STTM", "UTMALDG.3D"}     # the scale warp's plain load, then tcgen05.st x1
    if two:
        ops |= {"UCGABAR_ARV", "UCGABAR_WAIT"}
    return ops


def test_dispatch_outcomes_cover_every_rule():
    """The matrix holds each regime, each stage source, both Kimi rules and the default config,
    for every routed format pair."""
    seen = {(c.a_format, c.b_format, c.regime, c.rule, c.stages_source) for _, c in OUTCOMES}
    for regime in (dispatch.REGIME_DECODE, dispatch.REGIME_SMALL_PREFILL, dispatch.REGIME_LARGE_PREFILL):
        for pair in (("nvfp4", "nvfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4")):
            assert any(s[:3] == (*pair, regime) for s in seen), (pair, regime)
    assert {s[4] for s in seen} == {dispatch.STAGES_TUNED, dispatch.STAGES_DECODE_DEFAULT, dispatch.STAGES_AUTO}
    kimi = {(c.mma_bn, c.cta_group, c.num_pipeline_stages) for _, c in OUTCOMES if c.rule == dispatch.RULE_KIMI}
    assert kimi == {(64, 2, dispatch.KIMI_STAGES), (128, 2, dispatch.KIMI_STAGES)}
    defaults = {(c.a_format, c.ab_swapped, c.mma_bn, c.cta_group)
                for _, c in OUTCOMES if c.rule == dispatch.RULE_DEFAULT}
    assert defaults == {("mxfp4", False, 128, 1), ("mxfp8", False, 128, 1)}
    knobs = {(s.ab_swapped, s.mma_bn, s.cta_group) for s in KERNEL_SPECS}
    assert knobs == {(True, 8, 1), (True, 64, 2), (True, 128, 2), (False, 128, 1)}
    assert len(KERNEL_SPECS) == 11


@pytest.mark.slow   # offline compiles: 5-9 s per build, ~80 s for the 11 on a 2-core CPU
@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=_spec_id)
def test_kernel_assembles_with_the_expected_sass(spec):
    kernel = assembled(spec)
    ops = offline.sass_opcodes(kernel.sass)
    missing = expected_opcodes(spec) - ops
    assert not missing, f"{_spec_id(spec)} for {KERNELS[spec]}: missing {sorted(missing)}"
    mma_ops = {op for op in ops if op.startswith(("UTCOMMA", "UTCQMMA", "UTCHMMA", "UTCIMMA"))}
    assert len(mma_ops) == 1, mma_ops                       # one MMA form: the spec's kind and group
    if spec.cta_group == 2:   # every operand load completes on the pair's barrier
        assert not {op for op in ops if op.startswith("UTMALDG") and ".2CTA" not in op}
    assert not offline.uses_local_memory(kernel.sass)
    assert kernel.local_bytes == 0


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=_spec_id)
def test_kernel_resources_fit_one_block_per_sm(spec):
    kernel = assembled(spec)
    assert kernel.registers <= MAX_REGISTERS_PER_THREAD
    assert kernel.registers * spec.threads <= REGISTER_FILE
    # All of the kernel's shared memory is dynamic; cuobjdump shows only the per-block reservation.
    assert kernel.static_shared_bytes == dispatch.SMEM_RESERVED_BYTES


@pytest.mark.parametrize("label, config", OUTCOMES, ids=[label for label, _ in OUTCOMES])
def test_dispatch_config_fits_smem_and_tmem(label, config):
    spec = Sm100KernelSpec.of((config.a_format, config.b_format), config)
    smem, tmem = check_launch_plan(spec, config.num_pipeline_stages)
    assert smem.total_bytes <= dispatch.B200_SMEM_PER_SM              # 228 KiB
    assert smem.dynamic_bytes <= max_dynamic_smem_bytes()
    assert tmem.columns_used <= desc.TMEM_COLUMNS
    assert config.num_pipeline_stages <= config.max_pipeline_stages


@pytest.mark.parametrize("label, config", OUTCOMES, ids=[label for label, _ in OUTCOMES])
def test_smem_plan_beside_the_stages_formula(label, config):
    """Per stage the kernel holds exactly the formula's tiles and scale atoms; its barriers are
    16 B per stage (full + empty) where the formula counts 32 (the store-warp path has 4 barriers:
    32 B). Outside the stages it needs 232 B less than the formula's 12 + 320 bookkeeping bytes
    (a 2-slot scheduler ring of 32 B each + 4 mbarriers, and the 4-byte TMEM address), the same
    output buffers and accumulator barriers. So the formula's stage count always fits."""
    spec = Sm100KernelSpec.of((config.a_format, config.b_format), config)
    plan = smem_plan(spec, config.num_pipeline_stages)
    terms = config.smem_terms()
    tiles = plan.stage_tiles
    assert (tiles["a_tile"], tiles["b_tile"], tiles["sfa"], tiles["sfb"]) == (terms.a_tile, terms.b_tile, terms.sfa,
                                                                              terms.sfb)
    assert tiles["stage_barriers"] == (32 if spec.sfb_by_store_warps else 16)
    assert plan.per_stage_bytes == terms.per_stage - terms.stage_barriers + tiles["stage_barriers"]
    assert terms.c_tile_bytes == spec.c_buffer_bytes          # for every outcome (mma_bn >= 64 or swapped)
    bookkeeping = (SCHEDULER_SLOTS * (SCHEDULER_SLOT_BYTES + 2 * MBARRIER_BYTES) + TMEM_ADDRESS_BYTES)
    assert plan.fixed_bytes == (terms.fixed - dispatch.FIXED_BOOKKEEPING_BYTES - dispatch.FIXED_SCHEDULER_BYTES
                                + bookkeeping)
    assert terms.fixed - plan.fixed_bytes == 232
    assert plan.total_bytes <= terms.fixed + config.num_pipeline_stages * terms.per_stage


@pytest.mark.parametrize("pair", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4")])
def test_every_legal_config_fits_with_auto_stages(pair):
    """Beyond the dispatch: every legal override (knobs x auto stages) fits both budgets."""
    for cta_group, mma_bn in itertools.chain(((1, n) for n in dispatch.LEGAL_MMA_BN[1]),
                                             ((2, n) for n in dispatch.LEGAL_MMA_BN[2])):
        for swapped in (True, False) if cta_group == 1 else (True,):
            spec = Sm100KernelSpec(*pair, swapped, mma_bn, cta_group)
            stages = dispatch.auto_pipeline_stages(mma_bn=mma_bn, cta_group=cta_group, ab_swapped=swapped,
                                                   num_sf_k_tiles=spec.num_sf_k_tiles)
            smem, tmem = check_launch_plan(spec, stages)
            assert smem.total_bytes <= dispatch.B200_SMEM_PER_SM and tmem.columns_used <= desc.TMEM_COLUMNS


def test_plans_reject_what_does_not_fit():
    spec = Sm100KernelSpec("nvfp4", "nvfp4", True, 128, 2)
    with pytest.raises(ValueError, match="TMEM columns"):
        tmem_plan(spec, 9)                       # 256 + 9 * 32 > 512
    with pytest.raises(ValueError, match="shared memory"):
        check_launch_plan(spec, 8)               # 8 * 28688 + fixed > 228 KiB
    with pytest.raises(ValueError, match="stages must be a positive int"):
        smem_plan(spec, 0)


def test_smem_regions_are_aligned_and_disjoint():
    for spec in KERNEL_SPECS:
        plan = smem_plan(spec, 7)
        o = dict(zip(SMEM_REGIONS, plan.offsets))
        for region in ("a_tiles", "b_tiles", "c_buffers"):     # 128B-swizzled: 1024-byte aligned
            assert o[region] % SWIZZLE_ATOM_BYTES == 0
        assert o["sfa"] % 128 == 0 and o["sfb"] % 128 == 0 and o["barriers"] % MBARRIER_BYTES == 0
        assert list(plan.offsets) == sorted(plan.offsets)
        assert o["b_tiles"] - o["a_tiles"] == 7 * A_TILE_BYTES
        assert o["sched"] - o["barriers"] == MBARRIER_BYTES * (7 * spec.stage_barrier_kinds + 2 * spec.accum_stages
                                                               + 2 * SCHEDULER_SLOTS)


def test_instruction_descriptor_of_each_kernel():
    for spec in KERNEL_SPECS:
        fields = desc.BlockScaledInstrDesc.decode(spec.instr_desc, spec.kind.name)
        assert (fields.m, fields.n) == (128 * spec.cta_group, spec.mma_bn)
        assert (fields.a_format, fields.b_format) == (spec.mma_a_element, spec.mma_b_element)
        assert fields.scale_type == spec.scale_type
    w4a8 = Sm100KernelSpec("mxfp8", "mxfp4", True, 8, 1)
    assert (w4a8.mma_a_element, w4a8.mma_b_element) == ("e2m1", "e4m3")   # weights in the A slot
    assert w4a8.weights_unpacked_by_tma and w4a8.weights_k_step == 128


def test_tma_load_cta_pair_ptx():
    text = TMA_LOAD_CTA_PAIR_PTX.format(rank=3, coords="$2, $3, $4", mbar=5)
    assert text.startswith("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                           ".cta_group::2 ")


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------
def _tiny(fmt="nvfp4", k_dim=256, n=128, sizes=(3, 0, 9), ids=(0, -1, 1)):
    rng = np.random.default_rng(1)
    act = rng.standard_normal((sum(sizes), k_dim)).astype(np.float32)
    w = (rng.standard_normal((2, n, k_dim)) * 0.05).astype(np.float32)
    return build_problem(act, w, np.array(sizes), np.array(ids), fmt=fmt)


def _sm100_present() -> bool:
    from gbs.backends import gpu_available

    if not gpu_available():
        return False
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability) == SM100_COMPUTE_CAPABILITY


@pytest.mark.skipif(_sm100_present(), reason="an SM100 GPU is present: the kernel would run")
def test_without_sm100_the_backend_says_what_it_needs():
    problem = _tiny()
    with pytest.raises(RuntimeError) as err:
        grouped_matmul_sm100(problem, TileConfig(True, 8, 1))
    message = str(err.value)
    for needed in ("compute capability 10.0", "B200", "GB200", "'h200_stream'", "'simt'", "'reference'"):
        assert needed in message


@pytest.mark.parametrize("make_args, error, match", [
    (lambda: ("not a problem", TileConfig(True, 8, 1)), TypeError, "GroupedProblem"),
    (lambda: (_tiny("w4a8", k_dim=320), TileConfig(True, 8, 1)), ValueError, "K % 128"),
    (lambda: (_tiny("nvfp4", k_dim=48), TileConfig(True, 8, 1)), ValueError, "multiple of 32 for FP4"),
    (lambda: (_tiny("nvfp4", n=132), TileConfig(True, 8, 1)), ValueError, "N must be a multiple of 8"),
    (lambda: (_tiny("nvfp4"), dispatch.grouped_matmul_block_scaled_sm100_dispatch(
        a_format="mxfp8", b_format="mxfp8", n=128, k=256, num_active_experts=3, estimated_total_m=12)),
     ValueError, "decided for a_format='mxfp8'"),
    (lambda: (_tiny("nvfp4"), "knobs"), TypeError, "KernelConfig or TileConfig"),
])
def test_bad_problem_or_config_is_rejected_before_the_hardware_check(make_args, error, match):
    with pytest.raises(error, match=match):
        grouped_matmul_sm100(*make_args())


def test_bad_grid_is_rejected():
    with pytest.raises(ValueError, match="multiple of cta_group"):
        grouped_matmul_sm100(_tiny(), TileConfig(True, 64, 2), num_ctas=3)


@pytest.mark.gpu
@pytest.mark.sm100   # skips (conftest) unless the GPU is a compute capability 10.0 one (B200 / GB200)
@pytest.mark.parametrize("fmt, knobs", [("nvfp4", (True, 8, 1)), ("nvfp4", (True, 128, 2)),
                                        ("mxfp8", (False, 128, 1)), ("w4a8", (True, 64, 2))])
def test_kernel_on_sm100(fmt, knobs):
    problem = _tiny(fmt, k_dim=512, n=256, sizes=(5, 0, 140, 1, 30), ids=(0, 1, -1, 1, 0))
    out = grouped_matmul_sm100(problem, TileConfig(*knobs))
    assert check_acceptance(problem, out).passed


def test_resource_table():
    """Registers / shared memory / TMEM per dispatch outcome (printed: run pytest with -s or -rP
    to see it; ``scripts/sm100_report.py`` prints the same table)."""
    rows = resource_rows(OUTCOMES, assembled)
    print("\n" + format_resource_table(rows))
    for row in rows:
        assert row["smem_total"] <= dispatch.B200_SMEM_PER_SM and row["tmem_columns"] <= desc.TMEM_COLUMNS
        assert row["stages"] <= row["formula_max_stages"] <= row["own_max_stages"]


def test_launch_keeps_one_block_per_sm():
    """All 512 TMEM columns are allocated: the launch's shared memory must forbid a second block."""
    for spec in KERNEL_SPECS:
        plan = smem_plan(spec, 2)
        request = launch_smem_bytes(plan)
        assert request >= plan.dynamic_bytes
        assert 2 * (request + plan.reserved_bytes) > dispatch.B200_SMEM_PER_SM
        assert request + plan.reserved_bytes <= dispatch.B200_SMEM_PER_SM
