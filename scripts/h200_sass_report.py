#!/usr/bin/env python3
"""Offline SASS facts of the H200 kernels (no GPU): for each spec, registers, local memory, and the
innermost loop that holds the tensor-core instructions (HMMA for ``h200_stream``, HGMMA for
``h200_wgmma``) with its instruction mix, and a hash of the whole SASS (sha256 of the instruction list): how the
instruction counts quoted in the kernels' docstrings are read, and how a refactor shows it left a build's machine
code unchanged (the same hash before and after). ~8 s per spec.

Usage: .venv/bin/python scripts/h200_sass_report.py [--all] [--json FILE]
       [stream:FMT:T|F:MMA_BN:CTA_GROUP:STAGES[:w8][:splitk][:trace]
        | wgmma:FMT:MMA_BN[:t256][:swap][:splitk][:cg2][:nopromo|:nomma] ...]
       .venv/bin/python scripts/h200_sass_report.py --compare BEFORE.jsonl AFTER.jsonl
(``:w8``: 8 consumer warps on a small-N tile, ``h200_ring.StreamSpec.small_n_warps``; ``:t256``: 256-token
tiles, ``h200_wgmma.WgmmaSpec.tile_tokens``; ``:swap``: weights on wgmma's M side; ``:splitk``: the split-K build
(either kernel); ``:trace``: the streaming kernel's start-up trace build; ``:cg2``: the CTA pair; ``:nopromo`` /
``:nomma``: the folded 192-row tile's diagnostic builds (``h200_wgmma.DIAGNOSTICS``); the wgmma specs
take the deepest ring that fits.)
A spec may end in a weight layout: ``:e2m1_h200``, ``:e2m1_h200_tiled`` or ``:e2m1_h200_fused`` (the weights re-laid
for the H200); ``wgmma:mxfp4:128:e2m1_e4m3`` / ``wgmma:w4a8:128:e2m1_e4m3``: the in-kernel FP8 route (QGMMA loops);
``wgmma:mxfp8:MMA_BN:e4m3_folded``: the FP8 route on tokens and weights folded ahead (``gbs.fp8_route.fold_problem``),
``wgmma:w4a8:128:e4m3_folded``: MXFP8 tokens on weights folded ahead. Each report also counts the MMAs ptxas
serialized (``offline.serialized_wgmma``).
Default: the decode and prefill configurations ``gbs.grouped_matmul`` runs for NVFP4, MXFP4 and MXFP8,
and NVFP4's two with re-laid weights. ``--all``: every build of ``ALL_SPECS`` (each consumer and producer variant of
both kernels; a few minutes), the set a refactor of shared device code checks: ``--json`` writes one line of facts
per spec, ``--compare`` names the specs whose SASS differs between two such files (exit status 1 if any).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys

from gbs.numba_kernels import h200_decode, h200_launch, h200_ring, h200_stream, h200_wgmma
from gbs.problem import PROBLEM_FORMATS
from gbs.ptx_inline import offline
from gbs.layouts import LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, LAYOUT_E4M3_FOLDED, LAYOUT_PACKED, OPERAND_LAYOUTS

DEFAULT_SPECS = ("stream:nvfp4:T:8:1:2", "stream:mxfp4:T:8:1:2", "stream:mxfp8:T:8:1:2",
                 "wgmma:nvfp4:128", "wgmma:mxfp4:128", "wgmma:mxfp8:256",
                 f"stream:nvfp4:T:8:1:2:{LAYOUT_E2M1_H200}", f"wgmma:nvfp4:128:{LAYOUT_E2M1_H200}")
# Every build variant of the two kernels' device code: consumers (bf16, W4A16, FP8 in-kernel, folded: two sets, one
# set, per-step), producer paths (packed, re-laid, tiled, fused, multicast pairs), split-K and trace builds.
ALL_SPECS = DEFAULT_SPECS + (
    "stream:nvfp4:T:16:1:2:w8", "stream:nvfp4:T:128:2:4", "stream:nvfp4:T:8:1:2:splitk", "stream:nvfp4:T:8:1:2:trace",
    "stream:nvfp4:F:128:1:4",
    "stream:nvfp4:T:128:1:4:e2m1_h200_tiled", "stream:nvfp4:T:128:1:4:e2m1_h200_fused", "stream:w4a16:T:8:1:2",
    "wgmma:nvfp4:128:t256", "wgmma:nvfp4:64:swap", "wgmma:nvfp4:32:swap:splitk",
    "wgmma:w4a16:128", "wgmma:w4a16_nvfp4:256", "wgmma:w4a16:128:t256",
    f"wgmma:mxfp4:128:{LAYOUT_E2M1_E4M3}", f"wgmma:w4a8:128:{LAYOUT_E2M1_E4M3}",
    f"wgmma:mxfp8:128:{LAYOUT_E4M3_FOLDED}", f"wgmma:mxfp8:128:cg2:{LAYOUT_E4M3_FOLDED}",
    f"wgmma:w4a8:128:{LAYOUT_E4M3_FOLDED}", f"wgmma:mxfp8:192:{LAYOUT_E4M3_FOLDED}",
    f"wgmma:mxfp8:192:cg2:{LAYOUT_E4M3_FOLDED}", f"wgmma:mxfp8:192:nopromo:{LAYOUT_E4M3_FOLDED}",
    f"wgmma:mxfp8:192:nomma:{LAYOUT_E4M3_FOLDED}")
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
    trace = kind == "stream" and bool(knobs) and knobs[-1] == "trace"
    if trace:
        knobs.pop()
    split_k = bool(knobs) and knobs[-1] == "splitk"
    if split_k:
        knobs.pop()
    small_n_warps = h200_ring.CONSUMER_WARPS_SMALL_N
    if kind == "stream" and knobs and knobs[-1].startswith("w") and knobs[-1][1:].isdigit():
        small_n_warps = int(knobs.pop()[1:])
    if kind == "stream" and len(knobs) == 4 and knobs[0] in ("T", "F"):
        spec = h200_ring.StreamSpec(a_format, b_format, knobs[0] == "T", int(knobs[1]), int(knobs[2]),
                                      int(knobs[3]), b_layout=b_layout, small_n_warps=small_n_warps,
                                      split_k=split_k, trace=trace)
        return spec, h200_stream, "HMMA"
    tile_tokens, cta_group = h200_wgmma.TILE_TOKENS[0], 1
    swapped = kind == "wgmma" and bool(knobs) and knobs[-1] == "swap"
    if swapped:
        knobs.pop()
    diagnostic = h200_wgmma.DIAGNOSTIC_TAGS.get(knobs[-1]) if kind == "wgmma" and knobs else None
    if diagnostic is not None:
        knobs.pop()
    if kind == "wgmma" and knobs and knobs[-1] == "cg2":
        cta_group = 2
        knobs.pop()
    if kind == "wgmma" and knobs and knobs[-1].startswith("t") and knobs[-1][1:].isdigit():
        tile_tokens = int(knobs.pop()[1:])
    if kind == "wgmma" and len(knobs) == 1:
        # the FP8 route: in-kernel on E2M1E4M3Order weights, or on weights folded ahead (with the tokens too, but
        # W4A8's MXFP8 tokens as quantized); its MMAs are QGMMA
        fp8 = b_layout in (LAYOUT_E2M1_E4M3, LAYOUT_E4M3_FOLDED)
        a_layout = LAYOUT_PACKED
        if b_layout == LAYOUT_E4M3_FOLDED and fmt != "w4a8":
            a_layout = LAYOUT_E4M3_FOLDED
        elif b_layout == LAYOUT_E2M1_E4M3 and a_format == "mxfp4":
            a_layout = LAYOUT_E2M1_E4M3
        if b_layout == LAYOUT_E4M3_FOLDED:   # folded operands are E4M3 with one scale per 128-K chunk
            a_format = "mxfp8"
            b_format = "mxfp8"

        def wgmma_spec(stages):
            return h200_wgmma.WgmmaSpec(a_format, b_format, int(knobs[0]), stages, b_layout=b_layout,
                                        tile_tokens=tile_tokens, ab_swapped=swapped, fp8=fp8, a_layout=a_layout,
                                        cta_group=cta_group, split_k=split_k, diagnostic=diagnostic)

        return wgmma_spec(h200_launch.max_pipeline_stages(wgmma_spec(1))), h200_wgmma, "QGMMA" if fp8 else "HGMMA"
    raise ValueError(f"{text!r}: want stream:FMT:T|F:MMA_BN:CTA_GROUP:STAGES[:w8][:splitk][:trace] or "
                     f"wgmma:FMT:MMA_BN[:t256][:cg2][:nopromo|:nomma][:swap][:splitk] (either may end in a layout, e.g. "
                     f":{LAYOUT_E2M1_H200}; :w8 = 8 small-N consumer warps, :t256 = 256-token tiles, :cg2 = the CTA "
                     f"pair, :swap = weights on wgmma M, :splitk = split-K runs)")


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


def facts(text: str) -> dict:
    """What the report says of one spec, as data: registers, local bytes, instruction count, the SASS hash (of the
    whole instruction list), the innermost MMA loop's size, MMA and local-access counts and opcode mix, the streaming
    consumer's instructions per K slice, and the MMAs ptxas serialized."""
    spec, kernel, mma_prefix = parse_spec(text)
    cubin = offline.compile_cubin(kernel.make_kernel_function(spec), h200_ring.kernel_signature(),
                                  offline.SM90A, launch_bounds=(spec.threads, spec.min_ctas_per_sm))
    sass = offline.disassemble(cubin)
    resources = offline.resource_usage(cubin)
    loops = offline.sass_loops(sass)
    mma_loops = [loop for loop in loops if loop.count(mma_prefix)]
    instructions = offline.sass_instructions(sass)
    found = dict(spec=text, registers=resources.registers, local_bytes=resources.local_bytes,
                 instructions=len(instructions), sass=hashlib.sha256("\n".join(instructions).encode()).hexdigest(),
                 mma=mma_prefix, serialized=len(offline.serialized_wgmma(instructions)), loop=None,
                 opcodes=dict(collections.Counter(ins.split()[0] for ins in instructions if ins.split()[0] != "NOP")))
    if mma_loops:
        hot = mma_loops[0]
        found["loop"] = dict(
            size=hot.size, mma=hot.count(mma_prefix), local=hot.count("LDL") + hot.count("STL"),
            mix=collections.Counter(op.split(".")[0] for op in hot.opcodes).most_common(MIX_OPCODES),
            per_slice=stage_instructions(spec, hot, loops) if kernel is h200_stream else None,
            k_slice=spec.k_slice if kernel is h200_stream else None)
    return found


def describe(found: dict) -> str:
    lines = [f"{found['spec']}: {found['registers']} registers (entry), {found['local_bytes']} B local, "
             f"{found['instructions']} instructions, sass {found['sass'][:12]}, "
             f"{found['serialized']} serialized {found['mma']}"]
    hot = found["loop"]
    if hot is not None:
        mix = ", ".join(f"{op} {n}" for op, n in hot["mix"])
        lines.append(f"  innermost {found['mma']} loop: {hot['size']} instructions, {hot['mma']} {found['mma']}, "
                     f"{hot['local']} local accesses; {mix}")
        stage = hot["per_slice"]
        if stage is not None:
            lines.append(f"  per K slice ({hot['k_slice']} K): {stage} instructions per thread "
                         f"({stage * 256 // hot['k_slice']} per 256 K), the stage loop with its runs")
    return "\n".join(lines)


def report(text: str) -> str:
    return describe(facts(text))


def read_facts(path) -> dict[str, dict]:
    with open(path) as f:
        return {found["spec"]: found for found in map(json.loads, filter(None, map(str.strip, f)))}


def compare(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """One line per spec of either file: same SASS, or what changed (instructions, innermost loop, registers,
    local bytes, serialized MMAs, and the count of each opcode but NOP, the padding), or missing on one side."""
    lines = []
    for spec in dict.fromkeys(list(before) + list(after)):
        a, b = before.get(spec), after.get(spec)
        if a is None or b is None:
            lines.append(f"{spec}: only {'after' if a is None else 'before'}")
        elif a["sass"] == b["sass"]:
            lines.append(f"{spec}: same SASS ({a['sass'][:12]})")
        else:
            changes = [f"{key} {a[key]} -> {b[key]}" for key in ("instructions", "registers", "local_bytes",
                                                                 "serialized") if a[key] != b[key]]
            loop_a, loop_b = (a["loop"] or {}).get("size"), (b["loop"] or {}).get("size")
            if loop_a != loop_b:
                changes.append(f"innermost loop {loop_a} -> {loop_b}")
            if "opcodes" in a and "opcodes" in b:   # files written before the opcode counts have none
                delta = collections.Counter(b["opcodes"])
                delta.subtract(a["opcodes"])
                moved = ", ".join(f"{op} {n:+d}" for op, n in sorted(delta.items()) if n)
                changes.append(f"opcodes {moved}" if moved else "the same opcodes, reordered")
            lines.append(f"{spec}: SASS differs ({a['sass'][:12]} -> {b['sass'][:12]}): "
                         f"{', '.join(changes) or 'same counts, other instructions'}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*")
    parser.add_argument("--all", action="store_true", help="every spec of ALL_SPECS")
    parser.add_argument("--json", metavar="FILE", help="also write one line of facts per spec (JSON lines)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --json files")
    args = parser.parse_args(argv)
    if args.compare:
        lines = compare(read_facts(args.compare[0]), read_facts(args.compare[1]))
        print("\n".join(lines))
        return int(any(": same SASS" not in line for line in lines))
    specs = list(ALL_SPECS if args.all else ()) + args.specs or list(DEFAULT_SPECS)
    out = open(args.json, "w") if args.json else None
    try:
        for text in specs:
            found = facts(text)
            print(describe(found), flush=True)
            if out is not None:
                out.write(json.dumps(found) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
