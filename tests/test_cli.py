"""The command line: help on every command, dispatch output, clear errors, and the demo (the main job)."""
import subprocess
import sys

import pytest

from gbs.__main__ import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gbs", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("command", [[], ["dispatch"], ["demo"]])
def test_help_on_every_command(command):
    res = run_cli(*command, "--help")
    assert res.returncode == 0 and "usage:" in res.stdout


def test_dispatch_prints_the_rule_and_the_comparison(capsys):
    assert main(["dispatch", "--n", "4096", "--k", "7168", "--num-active-experts", "64",
                 "--estimated-total-m", "512"]) == 0
    out = capsys.readouterr().out
    assert "512 <= 64 slots x 8 = 512 -> decode" in out
    assert "mma_bn=8" in out and "cta_group=1" in out
    # the empty slot counts: 36 tokens <= 5 slots x 8 is decode (4 slots would make it small prefill)
    assert main(["dispatch", "--n", "4096", "--k", "7168", "--tokens-per-expert", "9,9,0,9,9"]) == 0
    assert "estimated_total_m=36 <= 5 slots x 8 = 40 -> decode" in capsys.readouterr().out


def test_dispatch_errors_are_messages_not_tracebacks():
    res = run_cli("dispatch", "--n", "512", "--k", "7168", "--tokens-per-expert", "1,1", "--override",
                  "--mma-bn", "8", "--cta-group", "2")
    assert res.returncode == 2
    assert "error: mma_bn=8 is illegal with cta_group=2" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("dispatch", "--n", "512", "--k", "7000", "--tokens-per-expert", "1")
    assert res.returncode == 2 and "multiple" in res.stderr


def test_dispatch_of_w4a16_is_w4a8s_and_says_so(capsys):
    args = ["--n", "4096", "--k", "7168", "--tokens-per-expert", "40,40,40"]
    for fmt in ("w4a16", "w4a16_nvfp4"):
        assert main(["dispatch", "--format", fmt, *args]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Note: {fmt} (bf16 x {'nvfp4' if fmt.endswith('nvfp4') else 'mxfp4'}) has no SM100 "
                              "route (tcgen05 has no bf16 x FP4 kind): this is w4a8's decision (mxfp8 x mxfp4)")
        assert main(["dispatch", "--format", "w4a8", *args]) == 0
        assert out.split("\n", 1)[1] == capsys.readouterr().out   # the rest is W4A8's, word for word


def test_demo_runs_and_verifies_on_the_cpu():
    """Without a GPU the demo checks the SIMT kernel (simulator) and the SM100 emulator against the
    exact reference in every format; tests/test_demo.py plants faults in them."""
    res = run_cli("demo", "--format", "nvfp4", "--backend", "reference")
    assert res.returncode == 0, res.stdout + res.stderr
    for regime in ("decode", "small_prefill", "large_prefill"):
        assert regime in res.stdout
    assert "No GPU here: kernel models on the CPU against the exact reference (simt, emulator)" in res.stdout
    for fmt in ("nvfp4", "mxfp4", "mxfp8", "mxfp8_e5m2", "w4a8", "w4a16", "w4a16_nvfp4"):
        for model in ("simt",) if fmt.startswith("w4a16") else ("simt", "emulator"):   # W4A16: no tcgen05 kind
            line = next(x for x in res.stdout.splitlines() if x.startswith(f"  [{model:<8} {fmt:<10}]"))
            assert ": ok: bit-identical to the reference" in line, line
    assert not any(x.startswith("  [emulator w4a16") for x in res.stdout.splitlines())
    assert "MISMATCH" not in res.stdout + res.stderr
    assert res.stdout.strip().endswith("emulator and simt: 12 outputs checked against the exact reference\nverified")
    # the H200 plans of the same shapes, from host metadata (no GPU here)
    assert "kimi_up            32  h200_wgmma swapped bn32, 8 stages; 4 split-K runs of 7 slices; 132 CTAs" in res.stdout
    assert "deepseek_up         4  h200_stream swapped bn8" in res.stdout


def test_plan_fp8_prints_the_route_when_asked_and_refuses_nvfp4(capsys):
    assert main(["plan", "--format", "mxfp4", "--n", "4096", "--k", "7168", "--experts", "8",
                 "--tokens-per-expert", "1024", "--fp8", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "FP8 route" in out and "evidence fp8-route-gpu" in out and "window: not checked" in out
    assert main(["plan", "--format", "w4a8", "--n", "4096", "--k", "7168", "--experts", "8",
                 "--tokens-per-expert", "1024", "--fp8", "--explain"]) == 0
    assert "promotion per 32 K" in capsys.readouterr().out
    res = run_cli("plan", "--format", "nvfp4", "--n", "4096", "--k", "7168", "--experts", "8",
                  "--tokens-per-expert", "1024", "--fp8")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_plan_folded_prints_the_plans_route_and_tile_and_refuses_nvfp4(capsys):
    """Operands folded ahead: auto takes the FP8 route from 33 tokens per expert, on its 128 x 192 tile (W4A8 on
    folded weights: only when asked, on 128-row tiles); below, the streaming kernel."""
    shape = ["--n", "4096", "--k", "7168", "--experts", "8"]
    assert main(["plan", "--format", "mxfp4", *shape, "--tokens-per-expert", "1024", "--folded", "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("h200_wgmma not swapped bn192") and "FP8 route" in out and "evidence fold-n192-ab" in out
    assert main(["plan", "--format", "mxfp4", *shape, "--tokens-per-expert", "1024", "--folded", "--fp8", "--mma-bn",
                 "128"]) == 0
    assert capsys.readouterr().out.startswith("h200_wgmma not swapped bn128")
    assert main(["plan", "--format", "mxfp4", *shape, "--tokens-per-expert", "32", "--folded"]) == 0
    assert capsys.readouterr().out.startswith("h200_stream")
    assert main(["plan", "--format", "w4a8", *shape, "--tokens-per-expert", "1024", "--folded", "--fp8"]) == 0
    assert "bn128" in capsys.readouterr().out
    res = run_cli("plan", "--format", "nvfp4", *shape, "--tokens-per-expert", "1024", "--folded")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "folded" in res.stderr
