"""The GPU scripts' command lines, on the CPU: ``scripts/h200_stream_sweep.py``'s points (the wgmma
operands suffix included) and trace summary, ``scripts/sanitize_small.py``'s kernel / format filters, and
``scripts/compare_variants.py``'s variants, trees, commands and summary. Their GPU runs are cited by the
evidence rows of ``data/h200_evidence.csv``."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from gbs.dispatch import AUTO_STAGES
from gbs.numba_kernels import h200_trace

from script_modules import load_script



@pytest.fixture(scope="module")
def sweep():
    return load_script("h200_stream_sweep")


@pytest.mark.parametrize("point, config, num_ctas, k_splits", [
    ("wgmma:mxfp8:large_prefill_up:256:auto",
     dict(backend="h200_wgmma", mma_bn=256, stages=AUTO_STAGES, tile_tokens=128, ab_swapped=False), None, 1),
    ("wgmma:mxfp8:4096,7168,32,64:128:auto:66",
     dict(backend="h200_wgmma", mma_bn=128, stages=AUTO_STAGES, tile_tokens=128, ab_swapped=False), 66, 1),
    ("wgmma:nvfp4:decode_up:128:3:132",
     dict(backend="h200_wgmma", mma_bn=128, stages=3, tile_tokens=128, ab_swapped=False), 132, 1),
    ("wgmma:nvfp4:large_prefill_up:128:auto:t256",
     dict(backend="h200_wgmma", mma_bn=128, stages=AUTO_STAGES, tile_tokens=256, ab_swapped=False), None, 1),
    ("wgmma:nvfp4:small_prefill_up:32:auto:swap",
     dict(backend="h200_wgmma", mma_bn=32, stages=AUTO_STAGES, tile_tokens=128, ab_swapped=True), None, 1),
    ("wgmma:mxfp4:small_prefill_up:64:6:132:swap",
     dict(backend="h200_wgmma", mma_bn=64, stages=6, tile_tokens=128, ab_swapped=True), 132, 1),
    ("wgmma:nvfp4:kimi_decode:32:auto:swap:k4",
     dict(backend="h200_wgmma", mma_bn=32, stages=AUTO_STAGES, tile_tokens=128, ab_swapped=True), None, 4),
    ("wgmma:nvfp4:kimi_decode:32:auto:swap:kauto",
     dict(backend="h200_wgmma", mma_bn=32, stages=AUTO_STAGES, tile_tokens=128, ab_swapped=True), None, None),
])
def test_sweep_parses_wgmma_points(sweep, point, config, num_ctas, k_splits):
    parsed = sweep.parse_point(point)
    assert parsed.config == config and parsed.num_ctas == num_ctas and parsed.k_splits == k_splits
    assert parsed.fmt == point.split(":")[1]


def test_sweep_parses_stream_and_plan_points(sweep):
    fmt, case, config, k_splits, ctas = sweep.parse_point("nvfp4:512,256,8,1:T:8:1:2:4:144")
    assert (fmt, case.n, case.k, config, k_splits, ctas) == (
        "nvfp4", 512, 256, dict(backend="h200_stream", ab_swapped=True, mma_bn=8, cta_group=1, stages=2,
                                small_n_warps=4), 4, 144)
    assert sweep.parse_point("nvfp4:kimi_decode:T:8:1:2:4:w8").config["small_n_warps"] == 8
    point = sweep.parse_point("nvfp4:kimi_decode:T:8:1:2:4:128:w8")
    assert (point.k_splits, point.num_ctas, point.config["small_n_warps"]) == (4, 128, 8)
    assert sweep.parse_point("plan:auto:w4a8:kimi_decode").config == "auto"
    assert sweep.parse_point("plan:auto:mxfp4:large_prefill_up:cg2").config == dict(backend="auto", fp8=True,
                                                                                   cta_group=2)
    assert sweep.parse_point("plan:auto:mxfp4:large_prefill_up:cg2n128").config == dict(backend="auto", fp8=True,
                                                                                       cta_group=2, mma_bn=128)
    assert sweep.parse_point("plan:auto:mxfp4:large_prefill_up:n192").config == dict(backend="auto", fp8=True,
                                                                                    mma_bn=192)
    assert sweep.parse_point("plan:auto:mxfp4:large_prefill_up:n128").config == dict(backend="auto", fp8=True,
                                                                                    mma_bn=128)


def test_sweep_fp8_route_suffixes_plan_their_tiles(sweep):
    """Plan points on operands folded ahead (``--b-layout e4m3_folded``): the plan's 128 x 192 tile on one CTA per
    tile, ``:cg2`` its pair (2 x 128 tokens sharing 192 weight rows), ``:cg2n128`` the pair on 128 rows, ``:n128`` /
    ``:n192`` one CTA per 128- or 192-row tile; ``:nopromo`` / ``:nomma`` the 192-row tile's diagnostic builds."""
    from gbs.fp8_route import fold_problem

    point = sweep.parse_point("plan:auto:mxfp4:512,512,4,160")
    problem = fold_problem(point.case.problem(point.fmt))
    tiles = {suffix: sweep.plan_of(problem, sweep.parse_point(f"plan:auto:mxfp4:512,512,4,160{suffix}").config).spec
             for suffix in ("", ":cg2", ":cg2n128", ":n128", ":n192", ":nopromo", ":nomma")}
    assert {suffix: (spec.mma_bn, spec.cta_group, spec.ring.tile_shape.tokens, spec.diagnostic)
            for suffix, spec in tiles.items()} == {
        "": (192, 1, 128, None), ":cg2": (192, 2, 256, None), ":cg2n128": (128, 2, 256, None),
        ":n128": (128, 1, 128, None), ":n192": (192, 1, 128, None), ":nopromo": (192, 1, 128, "no_promotion"),
        ":nomma": (192, 1, 128, "no_mma")}
    assert all(spec.chunk_scaled for spec in tiles.values())


@pytest.mark.parametrize("point", ["wgmma:mxfp8:large_prefill_up:256:auto:e4m3", "wgmma:mxfp8:x:128:auto",
                                   "wgmma:nvfp4:small_prefill_up:128:auto:swap",
                                   "nvfp4:decode_up:Y:8:1:2:1", "plan:simt:nvfp4:decode_up",
                                   "plan:auto:mxfp4:large_prefill_up:cg4", "plan:auto:mxfp4:large_prefill_up:n256",
                                   "plan:auto:mxfp4:large_prefill_up:cg2n256",
                                   "plan:auto:mxfp4:large_prefill_up:cg2:n128",
                                   "plan:auto:mxfp4:large_prefill_up:nopromo:cg2"])
def test_sweep_refuses_bad_points(sweep, point):
    with pytest.raises(ValueError):
        sweep.parse_point(point)


def test_sweep_series_rows_keep_issue_order_input_sets_and_the_gpu(sweep):
    from gbs.lab.timing import Timing

    timing = Timing(10.5, 10.0, 12.0, 3, series=((2, 10.0), (0, 12.0), (1, 10.5)))
    rows = sweep.series_rows("plan:auto:nvfp4:decode_up", timing, {"gpu_uuid": "GPU-1234", "commit": "abc1234"})
    assert [(r["launch"], r["input_set"], r["us"]) for r in rows] == [(0, 2, 10.0), (1, 0, 12.0), (2, 1, 10.5)]
    assert {r["point"] for r in rows} == {"plan:auto:nvfp4:decode_up"}
    assert {(r["gpu_uuid"], r["commit"]) for r in rows} == {("GPU-1234", "abc1234")}
    assert sweep.series_rows("p", Timing(1.0, 1.0, 1.0, 1), {"gpu_uuid": "x", "commit": "y"}) == []


def test_sanitize_small_refuses_unknown_arguments():
    sanitize = load_script("sanitize_small")
    with pytest.raises(SystemExit, match="unknown arguments.*'mxfp9'"):
        sanitize.main(["h200_wgmma", "mxfp9"])


def test_sanitize_small_runs_the_chosen_kernel_and_format_only(monkeypatch, capsys):
    """The simt kernel on MXFP8 only, in Numba's CUDA simulator's stead: the kernel call is replaced by the
    reference, so this checks the selection and the report, not the kernel."""
    sanitize = load_script("sanitize_small")
    from gbs.reference import reference_grouped_matmul

    calls = []
    monkeypatch.setattr(sanitize.simt, "grouped_matmul_simt",
                        lambda p, config: calls.append(p.a_format.name) or reference_grouped_matmul(p))
    assert sanitize.main(["simt", "mxfp8"]) == 0
    assert calls == ["mxfp8"]
    out = capsys.readouterr().out
    assert "mxfp8  simt" in out and "PASS" in out and out.strip().endswith("0 failed")
    calls.clear()   # E5M2 tokens run only when named, and then alone
    assert sanitize.main(["simt", "mxfp8_e5m2"]) == 0
    assert calls == ["mxfp8_e5m2"]
    assert sanitize.main(["simt"]) == 0
    assert "mxfp8_e5m2" not in calls[1:] and len(calls) == 1 + len(sanitize.DEFAULT_FORMATS)   # token formats: W4A8 reads mxfp8


def test_sanitize_small_checks_256_token_tiles_on_groups_past_128_tokens(monkeypatch, capsys):
    """The wgmma cases on one format: every config on the small groups, and 256-token tiles also on groups
    whose tiles hold more than 128 tokens (their second m64 tiles run), with packed FP4 operands and with both
    in the H200 order, mma_bn 256 on fused weights (two scale bands per stage), and the swapped tiles (32 and 64
    tokens, 32 in 2 split-K runs, and 32 on fused weights), each checked against its own problem."""
    sanitize = load_script("sanitize_small")
    from gbs.reference import reference_grouped_matmul

    calls = []
    monkeypatch.setattr(sanitize.h200_launch, "run",
                        lambda p, plan: calls.append((p.total_tokens, plan.spec.tile_tokens, p.a_layout,
                                                      plan.spec.ab_swapped)) or reference_grouped_matmul(p))
    assert sanitize.main(["h200_wgmma", "nvfp4"]) == 0
    small, wide = sum(sanitize.GROUP_SIZES), sum(sanitize.TWO_M_GROUP_SIZES)
    assert max(sanitize.TWO_M_GROUP_SIZES) > 128
    assert sorted(calls) == sorted([(small, tokens, "packed", False) for _, tokens in sanitize.WGMMA_CONFIGS]
                                   + [(wide, 256, "packed", False), (wide, 256, "e2m1_h200", False),
                                      (small, 128, "packed", False)]
                                   + [(small, 128, "packed", True)] * (len(sanitize.WGMMA_SWAPPED_MMA_BN) + 2))
    assert capsys.readouterr().out.strip().endswith("0 failed")
    calls.clear()
    assert sanitize.main(["h200_wgmma", "nvfp4", "swapped"]) == 0
    assert sorted(calls) == [(small, 128, "packed", True)] * (len(sanitize.WGMMA_SWAPPED_MMA_BN) + 2)


def test_sweep_trace_summary_is_per_launch_and_skips_unlaunched_copies(sweep):
    events = len(h200_trace.TRACE_EVENTS)
    records = np.zeros((3, 2, events, h200_trace.TRACE_RECORD_WORDS), np.uint64)
    for copy, start in ((0, 1_000_000), (1, 5_000_000)):   # copy 2: never launched (all zero)
        for cta in range(2):
            for i, event in enumerate(h200_trace.TRACE_PRODUCER_CHAIN):
                records[copy, cta, event, 0] = start + 100 * cta + 1000 * i
            for i, event in enumerate(h200_trace.TRACE_CONSUMER_CHAIN[1:], start=1):
                records[copy, cta, event, 0] = start + 100 * cta + 2000 * i
    lines = sweep.trace_summary(records)
    assert "2 launches" in lines[0]
    phase_rows = {" ".join(line.split()[:-5]): [float(v) for v in line.split()[-5:-2]] for line in lines[1:]}
    # median / p10 / p90 of the two CTAs' skews (0 and 100 ns) of both launches, not 4 ms across launches
    assert phase_rows["entry skew"] == [50.0, 0.0, 100.0], "skew is measured inside each launch"
    assert phase_rows["launch span"][0] == 100 + 2000 * (len(h200_trace.TRACE_CONSUMER_CHAIN) - 1)
    assert phase_rows["entry -> barriers_ready"] == [1000.0] * 3
    assert sweep.trace_summary(records[2:]) == ["no launch wrote its trace"]


@pytest.fixture(scope="module")
def variants():
    return load_script("compare_variants")


def test_compare_variants_parses_trees_and_variables(variants):
    v = variants.parse_variant("diag=wt/x:GBS_A=1,GBS_B=two")
    assert (v.name, str(v.tree), v.env) == ("diag", "wt/x", {"GBS_A": "1", "GBS_B": "two"})
    assert variants.parse_variant("main=.").env == {} and variants.parse_variant("main=.").sweep_args == ()
    v = variants.parse_variant("tiled=wt/x:--b-layout=e2m1_h200_tiled,GBS_A=1")
    assert (v.env, v.sweep_args) == ({"GBS_A": "1"}, ("--b-layout", "e2m1_h200_tiled"))
    for bad in ("wt/x", "1x=wt/x", "x=", "x=wt:NOVALUE", "x=wt:--=1", "x=wt:--b layout=1"):
        with pytest.raises(ValueError):
            variants.parse_variant(bad)


def test_compare_variants_alternates_fresh_processes_per_tree(variants, tmp_path, capsys):
    tree = tmp_path / "tree"
    variants.make_tree("HEAD", str(tree))
    assert (tree / "gbs" / "numba_kernels" / "h200_stream.py").exists()
    assert (tree / "scripts" / "h200_stream_sweep.py").exists()
    with pytest.raises(SystemExit, match="exists"):
        variants.make_tree("HEAD", str(tree))
    rc = variants.main(["--dry-run", "--rounds", "2", "--out", str(tmp_path / "o"), "a=.",
                        f"b={tree}:GBS_X=1", "--", "plan:auto:nvfp4:decode_up"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("==")]
    assert rc == 0 and [line.split(",")[0] for line in lines] == ["== a", "== b", "== a", "== b"]
    assert all("GBS_X=1" in line for line in lines[1::2]) and not any("GBS_X" in line for line in lines[::2])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert all(f"GBS_COMMIT={head}" in line for line in lines[1::2]), "the tree's runs record its revision"
    assert str(tree / "scripts" / "h200_stream_sweep.py") in lines[1], "a tree runs its own sweep script"
    assert not (tmp_path / "o").exists(), "a dry run writes nothing"
    assert not any("--a-layout" in line for line in lines), "packed tokens: the flag older trees lack stays off"
    variants.main(["--dry-run", "--a-layout", "e2m1_h200", "--out", str(tmp_path / "o"), "a=.", "--", "p"])
    assert "--a-layout e2m1_h200" in capsys.readouterr().out
    variants.main(["--dry-run", "--rounds", "1", "--out", str(tmp_path / "o"), "a=.", "t=.:--b-layout=e2m1_h200_tiled",
                   "--", "p"])
    a_line, t_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("==")]
    assert "e2m1_h200_tiled" not in a_line
    assert t_line.index("--b-layout e2m1_h200 ") < t_line.index("--b-layout e2m1_h200_tiled"), "the variant's last"
    with pytest.raises(SystemExit):
        variants.main(["a=.", "a=wt/x", "--", "p"])   # two variants of one name
    with pytest.raises(SystemExit):
        variants.main(["a=."])                        # no points


def test_compare_variants_summary_is_the_median_over_rounds(variants, tmp_path):
    for name, times in (("a", (10.0, 12.0, 11.0)), ("b", (5.0, 6.0, 4.0))):
        for r, t in enumerate(times):
            with open(tmp_path / f"{name}-r{r}.csv", "w") as f:
                f.write(f"point,median_us\np1,{t}\n")
    table = variants.summary([variants.parse_variant("a=."), variants.parse_variant("b=.")], tmp_path, 3)
    assert "11.0 us" in table[1] and "5.0 us (0.455x)" in table[1]


@pytest.fixture(scope="module")
def overlap_probe():
    return load_script("wgmma_overlap_probe")


@pytest.mark.parametrize("case_name", ["base", "ss", "interleaved", "pingpong"])
def test_overlap_probe_keeps_its_mmas_and_its_work(overlap_probe, case_name):
    """The probe's kernels assemble for sm_90a with their 8 wgmma per iteration and all of the work (LLVM folds
    work whose result is unused or affine: the first versions measured nothing), without local memory."""
    from numba import types
    from gbs.ptx_inline import offline

    case = next(c for c in overlap_probe.CASES if c.name == case_name)
    rounds = 8
    sig = (types.Array(types.float32, 1, "C"), types.Array(types.uint64, 2, "C"), types.int64)
    for with_mma in (True, False):
        kernel = overlap_probe.make_kernel(case if with_mma else overlap_probe.Case("alone"), rounds, with_mma)
        cubin = offline.compile_cubin(kernel.py_func, sig, offline.SM90A, launch_bounds=(256, 1))
        ins = offline.sass_instructions(offline.disassemble(cubin))
        assert offline.resource_usage(cubin).local_bytes == 0
        hgmma = sum(i.startswith("HGMMA.64x128x16.F32.BF16") for i in ins)
        # the loop body holds two iterations (the A sets alternate); the interleaved case loops over its k16 steps
        assert (hgmma > 0) == with_mma and (case.interleaved or hgmma % (4 * overlap_probe.K_STEPS) == 0)
        # 4 chains x 3 XORs per round (each chain's 3 shift-XOR pairs), written out for two iterations per loop
        # body; the interleaved case keeps its quarter-rounds in a loop of their own
        xors = sum(i.startswith("LOP3") for i in ins)
        assert xors >= (4 * 3 if case.interleaved and with_mma else 2 * rounds * 4 * 3)


def test_overlap_probe_refuses_bad_cases(overlap_probe):
    with pytest.raises(ValueError):
        overlap_probe.make_kernel(overlap_probe.Case("x", sync="sometimes"), 8, True)
    with pytest.raises(ValueError):
        overlap_probe.make_kernel(overlap_probe.Case("base"), 6, True)
    with pytest.raises(ValueError):
        overlap_probe.make_work("int64")


def test_sanitize_small_writes_a_junit_testcase_per_case(monkeypatch, capsys, tmp_path):
    """``--junitxml``: one testcase per case, named by its id; a case that fails its check (a planted fault: the
    reference with one element changed) is a failure there and in the exit status."""
    import xml.etree.ElementTree as ET

    from gbs.reference import reference_grouped_matmul

    sanitize = load_script("sanitize_small")

    def simt(problem, config):
        out = reference_grouped_matmul(problem)
        if problem.a_format.name == "mxfp4":
            out[0, 0] = 1e4
        return out

    monkeypatch.setattr(sanitize.simt, "grouped_matmul_simt", simt)
    path = tmp_path / "sanitize.xml"
    assert sanitize.main(["simt", "--junitxml", str(path)]) == 1
    suite = ET.parse(path).getroot()
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert sorted(cases) == sorted(f"{fmt}-simt-(True, 8, 1)" for fmt in sanitize.DEFAULT_FORMATS)
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == (str(len(sanitize.DEFAULT_FORMATS)), "1",
                                                                              "0")
    assert cases["mxfp4-simt-(True, 8, 1)"].find("failure") is not None
    assert cases["nvfp4-simt-(True, 8, 1)"].find("failure") is None
    assert "1 failed" in capsys.readouterr().out
    # a case that raises: an error in the XML, written before the exception goes on
    monkeypatch.setattr(sanitize.simt, "grouped_matmul_simt", lambda p, c: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sanitize.main(["simt", "nvfp4", f"--junitxml={path}"])
    suite = ET.parse(path).getroot()
    assert suite.get("errors") == "1" and "ZeroDivisionError" in suite.find("testcase/error").get("message")


def test_sanitize_small_runs_bf16_tokens_only_on_the_builds_that_read_them(monkeypatch, capsys):
    """W4A16: the streaming kernel's swapped small-N cases (and one on fused weights), the wgmma kernel's
    not-swapped ones (and one on fused weights); no swapped wgmma tile, no wide streaming tile."""
    sanitize = load_script("sanitize_small")
    from gbs.reference import reference_grouped_matmul

    calls = []
    monkeypatch.setattr(sanitize.h200_launch, "run",
                        lambda p, plan: calls.append((plan.kernel, plan.spec.ab_swapped, plan.spec.mma_bn,
                                                      p.b_layout)) or reference_grouped_matmul(p))
    assert sanitize.main(["h200_stream", "h200_wgmma", "w4a16"]) == 0
    stream = [c for c in calls if c[0] == "h200_stream"]
    wgmma = [c for c in calls if c[0] == "h200_wgmma"]
    assert stream and all(swapped and bn <= 32 for _, swapped, bn, _ in stream)
    assert wgmma and not any(swapped for _, swapped, _, _ in wgmma)
    assert {layout for *_, layout in stream} == {layout for *_, layout in wgmma} == {"packed", "e2m1_h200_fused"}
    assert capsys.readouterr().out.strip().endswith("0 failed")


def test_fold_tokens_time_counts_the_bytes_the_fold_moves_and_refuses_unknown_cases():
    """``scripts/fold_tokens_time.py``: FP4 bytes in, one E4M3 byte per element out, the atoms both ways; a case
    name the bench does not have is refused before any GPU work."""
    timer = load_script("fold_tokens_time")
    from gbs.lab.cases import BENCH_CASES

    p = BENCH_CASES["gptoss_prefill_down"].problem("mxfp4")
    assert timer.moved_bytes(p) == p.total_tokens * p.k // 2 + p.total_tokens * p.k + 2 * p.a_scales.nbytes
    with pytest.raises(SystemExit):
        timer.main(["--cases", "no_such_case"])


def test_sanitize_small_runs_the_folded_route_on_both_pairs(monkeypatch, capsys):
    """MXFP4's folded-route cases: one CTA per 128- and 192-row tile, and CTA pairs on both widths, the 192-row pair
    also on groups past 128 tokens (a pair's second CTA with rows, part of a tile or none)."""
    sanitize = load_script("sanitize_small")
    from gbs.reference import reference_grouped_matmul

    calls = []
    monkeypatch.setattr(sanitize.h200_launch, "run",
                        lambda p, plan, out=None: calls.append((p.total_tokens, plan.spec.mma_bn, plan.spec.cta_group,
                                                                p.b_layout)) or reference_grouped_matmul(p))
    monkeypatch.setattr(sanitize, "folded_on_gpu", lambda problem, folded: reference_grouped_matmul(folded))
    assert sanitize.main(["h200_wgmma", "mxfp4"]) == 0
    small, wide = sum(sanitize.GROUP_SIZES), sum(sanitize.TWO_M_GROUP_SIZES)
    folded = sorted((tokens, bn, cg) for tokens, bn, cg, layout in calls if layout == "e4m3_folded")
    assert folded == sorted([(small, 128, 1), (small, 128, 2), (small, 192, 2), (wide, 192, 2), (small, 192, 1)])
    assert capsys.readouterr().out.strip().endswith("0 failed")
