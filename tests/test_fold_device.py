"""MXFP4 tokens folded on the GPU (``gbs.numba_kernels.fold.fold_tokens``) against the host fold
(``gbs.fp8_route.fold_problem``'s tokens).

Simulator runs (a worker subprocess with ``NUMBA_ENABLE_CUDASIM=1``): bit-identical E4M3 bytes and scale atoms on
ragged groups (an empty group, a -1 slot, a 1-token group, groups past 128 rows), a K tail (gpt-oss K = 2880: a chunk
of 2 blocks), blocks at both ends of the window, blocks whose one nonzero word sets their chunk's base, NaN-scale
blocks, chunks whose largest block is below 2^-121 (the base stops at 2^-127); a block beyond the window becomes NaN
bytes where the host refuses it; into given ``out`` arrays; bad input refused before any launch; the SIMT kernel runs
a folded problem exactly (its bytes are MXFP8's as quantized). Offline: the kernel assembles for sm_90a.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SIMULATOR_SCRIPT = r"""
import dataclasses, json, sys
import numpy as np
from numba import cuda
from gbs import fp8_route as fr
from gbs.formats import UE8M0_NAN_BYTE, unswizzle_scales
from gbs.numba_kernels import fold
sys.path.insert(0, "tests")
from fp8_cases import gaussian_problem, with_scales

def device_fold(p, out=False):
    args = [cuda.to_device(x) for x in (p.a, p.a_scales, p.a_offsets, p.a_scale_offsets)]
    kw = {}
    if out:
        kw = dict(out=cuda.to_device(np.full((p.total_tokens, p.k), 0x55, np.uint8)),
                  out_scales=cuda.to_device(np.full(p.a_scales.shape, 0x55, np.uint8)))
    a8, s8 = fold.fold_tokens(*args, **kw)
    return a8.copy_to_host(), s8.copy_to_host()

def compare(p, **kw):
    host = fr.fold_problem(p)
    a8, s8 = device_fold(p, **kw)
    return dict(bytes=int((a8 != host.a.view(np.uint8)).sum()), scales=int((s8 != host.a_scales).sum()),
                elements=int(a8.size))

results = {}
ragged = gaussian_problem(160, 448, seed=1)
results["ragged"] = compare(ragged)
results["ragged_out"] = compare(ragged, out=True)
tail = gaussian_problem(130, 2880, seed=2, group_sizes=(3, 0, 1, 9), expert_ids=(0, 2, 1, -1), experts=3)
results["k_tail"] = compare(tail)
edges = gaussian_problem(128, 512, seed=3, group_sizes=(20, 1, 6), expert_ids=(0, 1, 2), experts=3)
a = edges.a_operand().scales.copy()
a[:, 0::4] = 130
a[:, 1::4] = 130 - 14
a[4, 9] = UE8M0_NAN_BYTE
a[5, 4:8] = 3          # a chunk below 2^-121: the base stops at 2^-127
results["edges"] = compare(with_scales(edges, a_linear=a))
# blocks whose one nonzero word (each of the 4 in turn) holds the chunk's largest scale: it alone sets the base
lone = edges.a.copy()
lone_scales = edges.a_operand().scales.copy()
for q in range(4):
    word = lone[10 + q, 16 + 4 * q:20 + 4 * q] | 0x11
    lone[10 + q, 16:32] = 0
    lone[10 + q, 16 + 4 * q:20 + 4 * q] = word
    lone_scales[10 + q, :4] = 130
    lone_scales[10 + q, 1] = 138
results["lone_words"] = compare(with_scales(dataclasses.replace(edges, a=lone), a_linear=lone_scales))
twin = fr.fold_problem(with_scales(edges, a_linear=a)).a.view(np.uint8)   # blocks 14 below: in the window
results["host_refuses"], results["beyond_nan"], results["beyond_rest"] = [], [], []
for gap in (15, 20):   # below the window: the host refuses, the device writes NaN bytes
    beyond = a.copy()
    beyond[7, 1] = 130 - gap
    try:
        fr.fold_problem(with_scales(edges, a_linear=beyond))
        results["host_refuses"].append(False)
    except ValueError:
        results["host_refuses"].append(True)
    a8, _ = device_fold(with_scales(edges, a_linear=beyond))
    results["beyond_nan"].append(bool((a8[7, 32:64] == fr.E4M3_NAN).all()))
    rest = np.ones(a8.shape, bool)
    rest[7, 32:64] = False
    results["beyond_rest"].append(int((a8[rest] != twin[rest]).sum()))
# the SIMT kernel reads folded operands as the MXFP8 they are (bytes as quantized)
from gbs.exactness import check_output
from gbs.numba_kernels import simt
from gbs.schedule import TileConfig
small = fr.fold_problem(gaussian_problem(130, 256, seed=4, group_sizes=(5, 0, 3), expert_ids=(0, 1, -1), experts=2))
results["simt_folded"] = check_output(small, simt.grouped_matmul_simt(small, TileConfig(True, 8, 1)), "simt").passed
p = ragged
bad = {"host": lambda: fold.fold_tokens(p.a, p.a_scales, p.a_offsets, p.a_scale_offsets),
       "k": lambda: fold.fold_tokens(cuda.to_device(np.ascontiguousarray(p.a[:, :200])), cuda.to_device(p.a_scales),
                                     cuda.to_device(p.a_offsets), cuda.to_device(p.a_scale_offsets)),
       "atoms": lambda: fold.fold_tokens(cuda.to_device(p.a), cuda.to_device(np.ascontiguousarray(p.a_scales[:, :2])),
                                         cuda.to_device(p.a_offsets), cuda.to_device(p.a_scale_offsets)),
       "routing": lambda: fold.fold_tokens(cuda.to_device(p.a), cuda.to_device(p.a_scales),
                                           cuda.to_device(p.a_offsets[:-1]), cuda.to_device(p.a_scale_offsets)),
       "out": lambda: fold.fold_tokens(cuda.to_device(p.a), cuda.to_device(p.a_scales), cuda.to_device(p.a_offsets),
                                       cuda.to_device(p.a_scale_offsets), out=cuda.to_device(np.zeros((3, 8), np.uint8)))}
results["errors"] = {}
for name, call in bad.items():
    try:
        call()
        results["errors"][name] = None
    except (TypeError, ValueError) as err:
        results["errors"][name] = type(err).__name__ + ": " + str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def simulated():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", _SIMULATOR_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["ragged", "ragged_out", "k_tail", "edges", "lone_words"])
def test_device_fold_is_the_host_fold_bit_for_bit(simulated, case):
    counts = simulated[case]
    assert counts["elements"] > 0 and counts["bytes"] == 0 and counts["scales"] == 0, counts


def test_a_block_beyond_the_window_becomes_nan_bytes_where_the_host_refuses(simulated):
    assert simulated["host_refuses"] == [True, True] and simulated["beyond_nan"] == [True, True], simulated
    assert simulated["beyond_rest"] == [0, 0], simulated


def test_the_simt_kernel_reads_folded_operands_as_mxfp8(simulated):
    assert simulated["simt_folded"] is True


def test_bad_input_is_refused_before_any_launch(simulated):
    errors = simulated["errors"]
    assert errors["host"].startswith("TypeError") and "host array" in errors["host"]
    assert errors["k"].startswith("ValueError") and "multiple of 32" in errors["k"]
    assert "atoms" in errors["atoms"] and "one more offset" in errors["routing"] and "out has shape" in errors["out"]


def test_kernel_assembles_for_sm90a():
    from numba import types

    from gbs.numba_kernels import fold
    from gbs.ptx_inline import offline

    words, table = types.Array(types.uint32, 1, "C"), types.Array(types.uint32, 2, "C")
    signature = (types.Array(types.uint64, 1, "C"), words, words, words, table, types.int64, types.int64, types.int64,
                 types.Array(types.uint64, 1, "C"), words)
    cubin = offline.compile_cubin(fold.fold_token_blocks, signature, offline.SM90A, launch_bounds=(fold.THREADS, 1))
    usage = offline.resource_usage(cubin)
    # the block's 4 output words stay in registers (a dynamically indexed tuple could spill to local memory)
    assert usage.registers > 0 and usage.local_bytes == 0 and usage.stack_bytes == 0, usage


@pytest.mark.gpu
def test_gpu_tokens_folded_on_the_device_run_the_route_as_the_host_fold_does():
    """On the H200: the device fold's bytes are the host fold's, and the FP8 route on them gives the host-folded
    problem's output bit for bit (ragged groups, a -1 slot: its rows keep the poison in both)."""
    import numpy as np
    from numba import cuda

    from fp8_cases import gaussian_problem
    from gbs import fp8_route as fr
    from gbs.numba_kernels import fold, h200_launch, h200_ring, launch
    from gbs.plan import plan_h200
    from gbs.reference import poison_output

    if launch.gpu_compute_capability() != h200_ring.SM90:
        pytest.skip("needs an sm_90 GPU (H200); run through the device tool")
    problem = gaussian_problem(320, 2880, seed=21)
    folded = fr.fold_problem(problem)
    plan = plan_h200(folded, fp8=True)
    host_out = h200_launch.run(folded, plan, None)
    device = launch.to_device(folded)
    mxfp4 = launch.to_device(problem)
    a8, s8 = fold.fold_tokens(mxfp4.a, mxfp4.a_scales, mxfp4.a_offsets, mxfp4.a_scale_offsets, out=device.a,
                              out_scales=device.a_scales)
    np.testing.assert_array_equal(a8.copy_to_host().view(np.uint8), folded.a.view(np.uint8))
    np.testing.assert_array_equal(s8.copy_to_host(), folded.a_scales)
    out = cuda.to_device(poison_output(problem.total_tokens, problem.n).view(np.uint16))
    h200_launch.prepare(device, plan, out)()
    np.testing.assert_array_equal(out.copy_to_host(), host_out.view(np.uint16))
