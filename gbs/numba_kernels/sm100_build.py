"""The SM100 kernel's offline builds: every configuration the dispatch can return, each kernel
assembled for sm_100a without a GPU (NVVM and nvJitLink), and the resource table CI and
``scripts/sm100_report.py`` print (registers, shared memory beside the stages=auto formula of
``docs/design/dispatch.md``, TMEM columns).

Design (``docs/design/sm100_kernel.md``, "How it is checked without a Blackwell GPU"): the kernel
has never run, so each distinct build (formats x knobs; the pipeline depth is a launch argument)
is assembled with the launch bounds of its thread count, and its SASS and ptxas resources are
what the tests check. ``dispatch_outcomes`` must keep driving every rule of ``gbs.dispatch`` to
each distinct outcome, so that no configuration the dispatch can return goes unassembled.
"""
from __future__ import annotations

from dataclasses import dataclass

from gbs import dispatch
from gbs.numba_kernels.sm100_kernel import kernel_signature, make_kernel_function
from gbs.numba_kernels.sm100_spec import TMEM_ALLOC_COLUMNS, Sm100KernelSpec, check_launch_plan, own_max_stages

_REPRESENTATIVE_SLOTS = 8
# (label, dispatch entry point, keyword arguments): problems that drive every rule of
# ``gbs.dispatch`` (regimes, tuned and auto stages, the Kimi rule, the routing's default) to each
# distinct outcome; estimated_total_m = slots x avg_m.
_DISPATCH_CASES = (
    ("nvfp4 decode", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=8)),
    ("nvfp4 small prefill, tuned", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=64)),
    ("nvfp4 small prefill, auto", "route", dict(a_format="nvfp4", b_format="nvfp4", n=2048, k=2048, m=64)),
    ("nvfp4 large prefill, tuned 7", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=512)),
    ("nvfp4 large prefill, tuned 6", "route", dict(a_format="nvfp4", b_format="nvfp4", n=7168, k=2048, m=512)),
    ("nvfp4 large prefill, auto", "route", dict(a_format="nvfp4", b_format="nvfp4", n=2048, k=2048, m=512)),
    ("nvfp4 Kimi 64/2", "route", dict(a_format="nvfp4", b_format="nvfp4", n=512, k=7168, m=8)),
    ("nvfp4 Kimi 128/2", "route", dict(a_format="nvfp4", b_format="nvfp4", n=512, k=7168, m=512)),
    ("mxfp4 default", "route", dict(a_format="mxfp4", b_format="mxfp4", n=4096, k=7168, m=512)),
    ("mxfp8 default", "route", dict(a_format="mxfp8", b_format="mxfp8", n=4096, k=7168, m=512)),
    ("mxfp8 decode, tuned", "mxfp8", dict(b_format="mxfp8", n=6144, k=6144, m=8)),
    ("mxfp8 decode, auto", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=8)),
    ("mxfp8 small prefill", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=64)),
    ("mxfp8 large prefill", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=512)),
    ("w4a8 decode, tuned", "route", dict(a_format="mxfp8", b_format="mxfp4", n=6144, k=6144, m=8)),
    ("w4a8 decode, auto", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=8)),
    ("w4a8 small prefill", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=64)),
    ("w4a8 large prefill", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=512)),
)


def dispatch_outcomes() -> list[tuple[str, dispatch.KernelConfig]]:
    """(label, config) for every distinct decision of the SM100 dispatch (knobs and stages):
    NVFP4 regimes with tuned / decode-default / auto stages and both Kimi rules, the routing's
    default config (MXFP4, MXFP8), and the MXFP8 regime dispatch (MXFP8 and W4A8 weights)."""
    outcomes = []
    for label, entry, case in _DISPATCH_CASES:
        case = dict(case)
        avg_m = case.pop("m")
        common = dict(num_active_experts=_REPRESENTATIVE_SLOTS, estimated_total_m=_REPRESENTATIVE_SLOTS * avg_m)
        if entry == "route":
            config = dispatch.grouped_matmul_block_scaled_sm100_dispatch(**case, **common)
        else:
            config = dispatch.grouped_matmul_mxfp8_dispatch(**case, **common)
        outcomes.append((label, config))
    return outcomes


@dataclass(frozen=True)
class AssembledKernel:
    """One kernel assembled offline for sm_100a: cubin, SASS listing, ptxas resources."""

    spec: Sm100KernelSpec
    cubin: bytes
    sass: str
    registers: int
    static_shared_bytes: int     # what cuobjdump reports: the 1 KiB reservation (all else is dynamic)
    local_bytes: int


def assemble(spec: Sm100KernelSpec) -> AssembledKernel:
    """Compile ``spec``'s kernel for sm_100a through NVVM and nvJitLink (no GPU needed) with the
    launch bounds of its thread count (so ptxas caps registers for one block per SM)."""
    from gbs.ptx_inline import offline

    cubin = offline.compile_cubin(make_kernel_function(spec), kernel_signature(), offline.SM100A,
                                  launch_bounds=(spec.threads, 1))
    resources = offline.resource_usage(cubin)
    return AssembledKernel(spec, cubin, offline.disassemble(cubin), resources.registers, resources.shared_bytes,
                           resources.local_bytes)


RESOURCE_COLUMNS = ("label", "knobs", "stages", "threads", "registers", "smem_total", "per_stage", "formula_per_stage",
                    "fixed", "formula_fixed", "tmem_columns", "own_max_stages", "formula_max_stages")


def resource_rows(outcomes, assemble_fn=assemble) -> list[dict]:
    """Registers, shared memory (real per-stage / fixed bytes beside the stages=auto formula's)
    and TMEM columns of each (label, KernelConfig); ``assemble_fn(spec)`` gives the registers."""
    rows = []
    for label, config in outcomes:
        spec = Sm100KernelSpec.of((config.a_format, config.b_format), config)
        smem, tmem = check_launch_plan(spec, config.num_pipeline_stages)
        terms = config.smem_terms()
        knobs = f"{'T' if spec.ab_swapped else 'F'}/{spec.mma_bn}/{spec.cta_group}"
        rows.append(dict(label=label, knobs=knobs, stages=config.num_pipeline_stages, threads=spec.threads,
                         registers=assemble_fn(spec).registers, smem_total=smem.total_bytes,
                         per_stage=smem.per_stage_bytes, formula_per_stage=terms.per_stage, fixed=smem.fixed_bytes,
                         formula_fixed=terms.fixed, tmem_columns=tmem.columns_used,
                         own_max_stages=own_max_stages(spec), formula_max_stages=config.max_pipeline_stages))
    return rows


def format_resource_table(rows) -> str:
    """The rows as a fixed-width text table (bytes; TMEM in columns of 512)."""
    header = ("config", "AB/bn/cg", "stages", "thr", "regs", "smem B", "stage B (formula)", "fixed B (formula)",
              "TMEM cols", "max stages own/formula")
    lines = [header]
    for r in rows:
        lines.append((r["label"], r["knobs"], str(r["stages"]), str(r["threads"]), str(r["registers"]),
                      str(r["smem_total"]), f"{r['per_stage']} ({r['formula_per_stage']})",
                      f"{r['fixed']} ({r['formula_fixed']})", f"{r['tmem_columns']}/{TMEM_ALLOC_COLUMNS}",
                      f"{r['own_max_stages']}/{r['formula_max_stages']}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)

