"""``offline.sass_loops`` (the loop reading behind the SASS instruction counts quoted in docs and notes)
and ``scripts/h200_sass_report.py`` (CPU only: compiles offline for sm_90a)."""
from __future__ import annotations

import pytest

from gbs.ptx_inline import offline

from script_modules import load_script

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/              @P0 BRA 0x10 ;
        /*0040*/                   LDL R5, [R1] ;
        /*0050*/              @!P1 BRA 0x0 ;
        /*0060*/                   BRA 0x60 ;
        /*0070*/                   EXIT ;
"""


def test_sass_loops_finds_nested_backward_branches_innermost_first():
    loops = offline.sass_loops(LISTING)
    assert [(loop.start, loop.end) for loop in loops] == [(0x10, 0x30), (0x0, 0x50)]   # BRA 0x60 is no loop
    inner, outer = loops
    assert inner.opcodes == ("LDS", "HMMA.16816.F32.BF16", "BRA")
    assert inner.count("HMMA") == 1 and inner.count("LDL") == 0
    assert outer.size == 6 and outer.count("LDL") == 1


PIPELINED = ["WARPGROUP.ARRIVE", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], RZ, !UPT",
             "UIADD3 UR12, UR11, 0x2, URZ", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0",
             "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FFMA R179, R88, R184, R179",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0", "QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR12], RZ, !UPT"]


def test_serialized_wgmma_finds_waits_for_all_groups_between_accumulating_mmas():
    """The pipelined order (wait for 1 group, a fresh set after a wait for 0) passes; a wait for 0 groups before an
    MMA that accumulates onto the last, or right after an MMA, is serialization (the pair build's C7512)."""
    assert offline.serialized_wgmma(PIPELINED) == []
    between = PIPELINED[:3] + ["MOV R2, R3", "MOV R4, R5", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + PIPELINED[3:]
    assert offline.serialized_wgmma(between) == ["6: " + PIPELINED[3]]
    after = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert offline.serialized_wgmma(after) == ["0: " + after[0]]


def test_report_reads_the_decode_kernels_hot_loop():
    text = load_script("h200_sass_report").report("stream:nvfp4:T:8:1:2")
    assert "innermost HMMA loop" in text and "16 HMMA, 0 local accesses" in text


def test_report_spec_takes_the_weight_layout():
    script = load_script("h200_sass_report")
    spec, _, _ = script.parse_spec("stream:nvfp4:T:8:1:2:e2m1_h200")
    assert spec.b_layout == "e2m1_h200" and script.parse_spec("stream:nvfp4:T:8:1:2")[0].b_layout == "packed"
    assert script.parse_spec("wgmma:nvfp4:128:e2m1_h200")[0].ring.weight_side.layout == "e2m1_h200"
    folded, _, prefix = script.parse_spec("wgmma:mxfp8:192:e4m3_folded")   # the FP8 route on operands folded ahead
    assert folded.chunk_scaled and folded.a_layout == "e4m3_folded" and folded.mma_bn == 192 and prefix == "QGMMA"


@pytest.mark.parametrize("bad", ["stream:nvfp4:8:1:2", "wgmma:fp16:128", "gemm:nvfp4:128"])
def test_report_rejects_malformed_specs(bad):
    with pytest.raises(ValueError, match="want|format must be"):
        load_script("h200_sass_report").parse_spec(bad)


def test_stage_instructions_add_the_run_loops_other_trips():
    """Per K slice a prefetching streaming consumer runs the stage loop once and its innermost (rotation-run) loop
    ``groups // 4`` times: listing sizes 6 (stage) and 3 (run) with 2 runs make 9; one run per slice: the run loop
    itself; the 8-warp grid (no prefetch) is not modelled."""
    from gbs.numba_kernels import h200_ring as hr

    script = load_script("h200_sass_report")
    inner, outer = offline.sass_loops(LISTING)
    two_runs = hr.StreamSpec("mxfp4", "mxfp4", True, 8, 1, 2)                 # 256-K slices: 2 runs of 4 groups
    one_run = hr.StreamSpec("mxfp8", "mxfp8", True, 8, 1, 2)                  # a 32-byte FP8 quarter: 4 groups, 1 run
    eight_warps = hr.StreamSpec("nvfp4", "nvfp4", True, 16, 1, 2, small_n_warps=8)
    assert two_runs.weight_side.groups == 8 and one_run.weight_side.groups == 4
    assert script.stage_instructions(two_runs, inner, [inner, outer]) == outer.size + inner.size == 9
    assert script.stage_instructions(one_run, inner, [inner, outer]) == inner.size
    assert script.stage_instructions(two_runs, inner, [inner]) is None
    assert eight_warps.prefetch_groups and script.stage_instructions(eight_warps, inner, [inner, outer]) == 9
    wide = hr.StreamSpec("nvfp4", "nvfp4", False, 128, 1, 2)
    assert not wide.prefetch_groups and script.stage_instructions(wide, inner, [inner, outer]) is None


def test_every_build_of_the_catalogue_parses_to_its_own_spec():
    """``ALL_SPECS`` names each variant once: every text parses (no compile here) and no two give the same spec."""
    script = load_script("h200_sass_report")
    specs = [script.parse_spec(text)[0] for text in script.ALL_SPECS]
    assert len(set(map(repr, specs))) == len(specs) == len(set(script.ALL_SPECS))
    by_text = dict(zip(script.ALL_SPECS, specs))
    route = by_text["wgmma:mxfp4:128:e2m1_e4m3"]   # the in-kernel FP8 route: both operands in E2M1E4M3Order
    assert route.fp8 and route.a_layout == route.b_layout == "e2m1_e4m3" and not route.chunk_scaled
    w4a8 = by_text["wgmma:w4a8:128:e2m1_e4m3"]     # MXFP8 tokens as quantized
    assert w4a8.fp8 and (w4a8.a_format, w4a8.a_layout) == ("mxfp8", "packed")
    steps = by_text["wgmma:w4a8:128:e4m3_folded"]  # W4A8 on weights folded ahead: a promotion per k32 step
    assert steps.chunk_scaled and steps.step_scaled and steps.a_layout == "packed"
    pair = by_text["wgmma:mxfp8:128:cg2:e4m3_folded"]
    assert pair.cta_group == 2 and pair.chunk_scaled
    wide_pair = by_text["wgmma:mxfp8:192:cg2:e4m3_folded"]   # the 192-row tile's pair: 96 weight rows per CTA
    assert (wide_pair.mma_bn, wide_pair.cta_group, wide_pair.stages, wide_pair.ring.weight_box[1]) == (192, 2, 5, 96)
    split = by_text["wgmma:nvfp4:32:swap:splitk"]
    assert split.split_k and split.ab_swapped and split.mma_bn == 32


FACTS = {"spec": "wgmma:x", "registers": 168, "local_bytes": 0, "instructions": 2480, "sass": "a" * 64,
         "mma": "QGMMA", "serialized": 0, "loop": {"size": 205}}


def test_compare_names_each_spec_whose_sass_differs(tmp_path, capsys):
    script = load_script("h200_sass_report")
    same = dict(FACTS, spec="wgmma:same")
    grown = dict(FACTS, spec="wgmma:grown", sass="b" * 64, instructions=2490, serialized=2, loop={"size": 215})
    before = {"wgmma:same": same, "wgmma:grown": FACTS | {"spec": "wgmma:grown"}, "wgmma:gone": same}
    after = {"wgmma:same": same, "wgmma:grown": grown}
    lines = script.compare(before, after)
    assert lines[0] == f"wgmma:same: same SASS ({'a' * 12})"
    assert lines[1] == (f"wgmma:grown: SASS differs ({'a' * 12} -> {'b' * 12}): instructions 2480 -> 2490, "
                        f"serialized 0 -> 2, innermost loop 205 -> 215")
    assert lines[2] == "wgmma:gone: only before"
    # with opcode counts on both sides (every file written since they were added), what came and went; the NOP
    # padding is not counted, so an added instruction shows where the listing's length does not
    counted = dict(FACTS, opcodes={"QGMMA": 4, "FFMA": 96})
    entry = dict(counted, sass="c" * 64, opcodes={"QGMMA": 4, "FFMA": 96, "ACQBULK": 1, "PREEXIT": 1})
    reordered = dict(counted, sass="d" * 64)
    assert script.compare({"w": counted}, {"w": entry}) == [
        f"w: SASS differs ({'a' * 12} -> {'c' * 12}): opcodes ACQBULK +1, PREEXIT +1"]
    assert script.compare({"w": counted}, {"w": reordered}) == [
        f"w: SASS differs ({'a' * 12} -> {'d' * 12}): the same opcodes, reordered"]
    # the command line: exit status 1 when anything differs, 0 when every spec is the same
    import json
    paths = [tmp_path / "before.jsonl", tmp_path / "after.jsonl"]
    for path, found in zip(paths, (before, after)):
        path.write_text("".join(json.dumps(f) + "\n" for f in found.values()))
    assert script.main(["--compare", *map(str, paths)]) == 1
    assert script.main(["--compare", str(paths[1]), str(paths[1])]) == 0
    assert "same SASS" in capsys.readouterr().out
