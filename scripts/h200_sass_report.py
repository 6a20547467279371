#!/usr/bin/env python3
"""Offline SASS facts of the H200 kernels (no GPU): for each spec, registers, local memory, and the
innermost loop that holds the tensor-core instructions (HMMA for ``h200_stream``, HGMMA for
``h200_wgmma``) with its instruction mix, and a hash of the whole SASS (sha256 of the instruction list): how the
instruction counts quoted in the kernels' docstrings are read, and how a refactor shows it left a build's machine
code unchanged (the same hash before and after). ~8 s per spec.

Usage: .venv/bin/python scripts/h200_sass_report.py [stream:FMT:T|F:MMA_BN:CTA_GROUP:STAGES[:w8] | wgmma:FMT:MMA_BN[:t256] ...]
(``:w8``: 8 consumer warps on a small-N tile, ``h200_ring.StreamSpec.small_n_warps``; ``:t256``: 256-token
tiles, ``h200_wgmma.WgmmaSpec.tile_tokens``; the wgmma specs take the deepest ring that fits.)
A spec may end in ``:e2m1_h200``, ``:e2m1_h200_tiled`` or ``:e2m1_h200_fused``: the weights re-laid for the H200
(``gbs.formats.E2M1H200Order``, ``E2M1H200TiledOrder``, ``E2M1H200FusedOrder``); ``wgmma:mxfp8:MMA_BN:e4m3_folded``: the
FP8 route on tokens and weights folded ahead (``gbs.fp8_route.fold_problem``; QGMMA loops).
Default: the decode and prefill configurations ``gbs.grouped_matmul`` runs for NVFP4, MXFP4 and MXFP8,
and NVFP4's two with re-laid weights.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import sys

from gbs.numba_kernels import h200_decode, h200_launch, h200_ring, h200_stream, h200_wgmma
from gbs.problem import PROBLEM_FORMATS
from gbs.ptx_inline import offline
from gbs.layouts import LAYOUT_E2M1_H200, LAYOUT_E4M3_FOLDED, LAYOUT_PACKED, OPERAND_LAYOUTS

DEFAULT_SPECS = ("stream:nvfp4:T:8:1:2", "stream:mxfp4:T:8:1:2", "stream:mxfp8:T:8:1:2",
                 "wgmma:nvfp4:128", "wgmma:mxfp4:128", "wgmma:mxfp8:256",
                 f"stream:nvfp4:T:8:1:2:{LAYOUT_E2M1_H200}", f"wgmma:nvfp4:128:{LAYOUT_E2M1_H200}")
MIX_OPCODES = 8   # most frequent opcodes shown per loop


def parse_spec(text: str):
    """(spec, kernel module, tensor-core opcode prefix) of a command-line spec."""
    kind, fmt, *knobs = text.split(":")
    if fmt not in PROBLEM_FORMATS:
        raise ValueError(f"{text!r}: format must be one of {sorted(PROBLEM_FORMATS)}")
    a_format, b_format = PROBLEM_FORMATS[fmt]
    b_layout = LAYOUT_PACKED
    if knobs and knobs[-1] in OPERAND_LAYOUTS:
        b_layout = knobs.pop()
    small_n_warps = h200_ring.CONSUMER_WARPS_SMALL_N
    if kind == "stream" and knobs and knobs[-1].startswith("w") and knobs[-1][1:].isdigit():
        small_n_warps = int(knobs.pop()[1:])
    if kind == "stream" and len(knobs) == 4 and knobs[0] in ("T", "F"):
        spec = h200_ring.StreamSpec(a_format, b_format, knobs[0] == "T", int(knobs[1]), int(knobs[2]),
                                      int(knobs[3]), b_layout=b_layout, small_n_warps=small_n_warps)
        return spec, h200_stream, "HMMA"
    tile_tokens = h200_wgmma.TILE_TOKENS[0]
    swapped = kind == "wgmma" and bool(knobs) and knobs[-1] == "swap"
    if swapped:
        knobs.pop()
    if kind == "wgmma" and knobs and knobs[-1].startswith("t") and knobs[-1][1:].isdigit():
        tile_tokens = int(knobs.pop()[1:])
    if kind == "wgmma" and len(knobs) == 1:
        folded = b_layout == LAYOUT_E4M3_FOLDED   # the FP8 route on both operands folded ahead: E4M3 MMAs

        def wgmma_spec(stages):
            return h200_wgmma.WgmmaSpec(a_format, b_format, int(knobs[0]), stages, b_layout=b_layout,
                                        tile_tokens=tile_tokens, ab_swapped=swapped, fp8=folded,
                                        a_layout=LAYOUT_E4M3_FOLDED if folded else LAYOUT_PACKED)

        return wgmma_spec(h200_launch.max_pipeline_stages(wgmma_spec(1))), h200_wgmma, "QGMMA" if folded else "HGMMA"
    raise ValueError(f"{text!r}: want stream:FMT:T|F:MMA_BN:CTA_GROUP:STAGES[:w8] or wgmma:FMT:MMA_BN[:t256][:swap] "
                     f"(either may end in a layout, e.g. :{LAYOUT_E2M1_H200}; :w8 = 8 small-N consumer warps, "
                     f":t256 = 256-token tiles, :swap = weights on wgmma M)")


def stage_instructions(spec, hot, loops):
    """Instructions a streaming consumer thread issues per K slice: the loop around the innermost MMA loop (the
    stage loop, once) plus the innermost loop's other trips (a prefetching config's rotation runs: ``groups //
    ROTATION_RUN`` per slice). None where the innermost MMA loop is the stage loop itself (one run per slice, or
    the 8-warp grid's group loop, whose trips this does not model)."""
    if not spec.prefetch_groups:
        return None
    trips = spec.weight_side.groups // h200_decode.ROTATION_RUN
    if trips == 1:
        return hot.size
    around = [loop for loop in loops if loop.start <= hot.start and loop.end >= hot.end and loop.size > hot.size]
    return around[0].size + (trips - 1) * hot.size if around else None


def report(text: str) -> str:
    spec, kernel, mma_prefix = parse_spec(text)
    cubin = offline.compile_cubin(kernel.make_kernel_function(spec), h200_ring.kernel_signature(),
                                  offline.SM90A, launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    sass = offline.disassemble(cubin)
    resources = offline.resource_usage(cubin)
    mma_loops = [loop for loop in offline.sass_loops(sass) if loop.count(mma_prefix)]
    instructions = offline.sass_instructions(sass)
    digest = hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:12]
    lines = [f"{text}: {resources.registers} registers (entry), {resources.local_bytes} B local, "
             f"{len(instructions)} instructions, sass {digest}"]
    if mma_loops:
        hot = mma_loops[0]
        mix = ", ".join(f"{op} {n}" for op, n in collections.Counter(
            op.split(".")[0] for op in hot.opcodes).most_common(MIX_OPCODES))
        lines.append(f"  innermost {mma_prefix} loop: {hot.size} instructions, {hot.count(mma_prefix)} {mma_prefix}, "
                     f"{hot.count('LDL') + hot.count('STL')} local accesses; {mix}")
        stage = stage_instructions(spec, hot, offline.sass_loops(sass)) if kernel is h200_stream else None
        if stage is not None:
            lines.append(f"  per K slice ({spec.k_slice} K): {stage} instructions per thread "
                         f"({stage * 256 // spec.k_slice} per 256 K), the stage loop with its runs")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=list(DEFAULT_SPECS))
    args = parser.parse_args(argv)
    for text in args.specs:
        print(report(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
