"""The device re-layout of FP4 operands into ``E2M1H200Order`` (``gbs.numba_kernels.relayout``).

Simulator runs (a worker subprocess with ``NUMBA_ENABLE_CUDASIM=1``, which numba reads when first imported):
bit-identical to the host ``E2M1H200Order.swizzle`` on random bytes of several shapes (an empty one
included), into a new array and into a given ``out``, the input untouched; UE4M3 scale bytes (all 256 values)
to the host ``UE4M3H200Scales.encode`` codes, sign-bit bytes to the NaN code; bad input refused before any
launch. Weights into ``E2M1H200TiledOrder`` (``to_e2m1_h200_tiled``): bit-identical to the host order in the
simulator, shapes without whole boxes stored padded with zeros (a given ``out``'s pad zeroed); into ``E2M1H200FusedOrder`` with their scale atoms
(``to_e2m1_h200_fused``, NVFP4 and MXFP4 blocks) the same, atoms of the wrong shape refused. Offline: the
kernels assemble for sm_90a without local memory. GPU: torch tokens and their scales re-laid on the device run
the H200 kernels with ``a_layout`` and give the packed tokens' bits; torch weights tiled or fused on the
device, with ``b_layout``, too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gbs.layouts import E2M1H200FusedOrder, E2M1H200Order, E2M1H200TiledOrder, UE4M3H200Scales

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(37, 24), (5, 4), (0, 8), (3, 2, 16)]   # odd rows, one word per row, empty, 3-D
# experts x 2 row tiles x 3 K boxes, one box, empty, and N / K tails (stored padded: gpt-oss's 2880 x 2880)
TILED_SHAPES = [(2, 256, 384), (128, 128), (0, 128, 128), (2, 200, 176)]
FUSED_CASES = [((2, 256, 384), 16), ((2, 256, 384), 32), ((128, 128), 32), ((0, 128, 128), 16),
               ((2, 200, 176), 16), ((2, 200, 176), 32)]   # (shape, block)

_SIMULATOR_SCRIPT = r"""
import json, sys
import numpy as np
from numba import cuda
from gbs.numba_kernels import relayout

shapes, tiled_shapes, fused_cases = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
rng = np.random.default_rng(5)
results = {"outputs": [], "errors": {}}
for shape in shapes:
    host = rng.integers(0, 256, shape, dtype=np.uint8)
    device = cuda.to_device(host)
    fresh = relayout.to_e2m1_h200(device).copy_to_host()
    out = cuda.device_array(tuple(shape), np.uint8)
    returned = relayout.to_e2m1_h200(device, out).copy_to_host()
    results["outputs"].append([host.tolist(), fresh.tolist(), out.copy_to_host().tolist(), returned.tolist(),
                               bool(np.array_equal(device.copy_to_host(), host))])
results["tiled"] = []
for shape in tiled_shapes:
    host = rng.integers(0, 256, shape, dtype=np.uint8)
    device = cuda.to_device(host)
    fresh = relayout.to_e2m1_h200_tiled(device).copy_to_host()
    out = cuda.to_device(np.full(fresh.shape, 0xA5, np.uint8))   # a given out's pad is zeroed too
    relayout.to_e2m1_h200_tiled(device, out)
    results["tiled"].append([host.tolist(), fresh.tolist(), out.copy_to_host().tolist(),
                             bool(np.array_equal(device.copy_to_host(), host))])
results["fused"] = []
for shape, block in fused_cases:
    *lead, n, kb = shape
    host = rng.integers(0, 256, shape, dtype=np.uint8)
    atoms = rng.integers(0, 256, (*lead, -(-n // 128), -(-(2 * kb // block) // 4), 32, 4, 4), dtype=np.uint8)
    device, device_atoms = cuda.to_device(host), cuda.to_device(atoms)
    fresh = relayout.to_e2m1_h200_fused(device, device_atoms).copy_to_host()
    out = cuda.to_device(np.full(fresh.shape, 0xA5, np.uint8))
    relayout.to_e2m1_h200_fused(device, device_atoms, out)
    results["fused"].append([host.tolist(), atoms.tolist(), fresh.tolist(), out.copy_to_host().tolist(),
                             list(fresh.shape), bool(np.array_equal(device.copy_to_host(), host))
                             and bool(np.array_equal(device_atoms.copy_to_host(), atoms))])
all_bytes = np.arange(256, dtype=np.uint8).reshape(2, 4, 32)
results["codes"] = [relayout.ue4m3_scales_to_h200(cuda.to_device(all_bytes)).copy_to_host().tolist(),
                    relayout.ue4m3_scales_to_h200(cuda.to_device(all_bytes[:, :0])).copy_to_host().shape]
bad = {"host": lambda: relayout.to_e2m1_h200(np.zeros((2, 8), np.uint8)),
       "scales_odd": lambda: relayout.ue4m3_scales_to_h200(cuda.to_device(np.zeros((2, 3), np.uint8))),
       "two_bytes": lambda: relayout.to_e2m1_h200(cuda.to_device(np.zeros((2, 8), np.uint16))),
       "odd_row": lambda: relayout.to_e2m1_h200(cuda.to_device(np.zeros((2, 6), np.uint8))),
       "strided": lambda: relayout.to_e2m1_h200(cuda.to_device(np.zeros((4, 16), np.uint8))[:, :8]),
       "out_shape": lambda: relayout.to_e2m1_h200(cuda.to_device(np.zeros((2, 8), np.uint8)),
                                                  cuda.device_array((2, 4), np.uint8)),
       "tiled_out": lambda: relayout.to_e2m1_h200_tiled(cuda.to_device(np.zeros((1, 192, 128), np.uint8)),
                                                        cuda.device_array((1, 192, 128), np.uint8)),
       "fused_short": lambda: relayout.to_e2m1_h200_fused(cuda.to_device(np.zeros((1, 128, 32), np.uint8)),
                                                          cuda.to_device(np.zeros((1, 1, 1, 32, 4, 4), np.uint8))),
       "tiled_host": lambda: relayout.to_e2m1_h200_tiled(np.zeros((1, 128, 128), np.uint8)),
       "fused_atoms": lambda: relayout.to_e2m1_h200_fused(cuda.to_device(np.zeros((1, 128, 128), np.uint8)),
                                                          cuda.to_device(np.zeros((1, 1, 3, 32, 4, 4), np.uint8))),
       "fused_out": lambda: relayout.to_e2m1_h200_fused(cuda.to_device(np.zeros((1, 128, 128), np.uint8)),
                                                        cuda.to_device(np.zeros((1, 1, 2, 32, 4, 4), np.uint8)),
                                                        cuda.device_array((1, 128, 128), np.uint8))}
for name, call in bad.items():
    try:
        call()
        results["errors"][name] = "no error"
    except (TypeError, ValueError) as err:
        results["errors"][name] = f"{type(err).__name__}: {err}"
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def simulated():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _SIMULATOR_SCRIPT, json.dumps(SHAPES), json.dumps(TILED_SHAPES),
                          json.dumps(FUSED_CASES)],
                         env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # Numba's CUDA simulator in a subprocess: ~100 s on a 2-core CPU
def test_device_relayout_is_the_host_swizzle_in_the_simulator(simulated):
    for shape, (host, fresh, given, returned, untouched) in zip(SHAPES, simulated["outputs"]):
        host = np.array(host, np.uint8).reshape(shape)
        want = E2M1H200Order.swizzle(host)
        for got in (fresh, given, returned):   # a new array; a given out, and the view of it that comes back
            np.testing.assert_array_equal(np.array(got, np.uint8).reshape(shape), want)
        assert untouched, "the input bytes are not modified"
    assert any(np.array(f).size and not np.array_equal(f, h) for h, f, *_ in simulated["outputs"]), \
        "random bytes change under the permutation"


def test_device_tiled_relayout_is_the_host_order_in_the_simulator(simulated):
    for shape, (host, fresh, given, untouched) in zip(TILED_SHAPES, simulated["tiled"]):
        host = np.array(host, np.uint8).reshape(shape)
        want = E2M1H200TiledOrder.swizzle(host)
        for got in (fresh, given):
            np.testing.assert_array_equal(np.array(got, np.uint8).reshape(want.shape), want)
        assert untouched, "the input bytes are not modified"
    first = np.array(simulated["tiled"][0][0], np.uint8).reshape(TILED_SHAPES[0])
    assert not np.array_equal(E2M1H200TiledOrder.swizzle(first), E2M1H200Order.swizzle(first)), "boxes move"


def test_device_fused_relayout_is_the_host_order_in_the_simulator(simulated):
    for (shape, block), (host, atoms, fresh, given, fused_shape, untouched) in zip(FUSED_CASES, simulated["fused"]):
        *lead, n, kb = shape
        host = np.array(host, np.uint8).reshape(shape)
        atoms = np.array(atoms, np.uint8).reshape(*lead, -(-n // 128), -(-(2 * kb // block) // 4), 32, 4, 4)
        want = E2M1H200FusedOrder.fuse(E2M1H200TiledOrder.swizzle(host), atoms, block)
        n_pad, k_pad = -(-n // 128) * 128, -(-2 * kb // 256) * 256
        assert tuple(fused_shape) == want.shape == (*lead, n_pad, k_pad // 2 + k_pad // block)
        for got in (fresh, given):
            np.testing.assert_array_equal(np.array(got, np.uint8).reshape(want.shape), want)
        assert untouched, "the input bytes are not modified"


def test_device_scale_codes_are_the_host_encoding_in_the_simulator(simulated):
    """Every byte value: UE4M3 bytes get ``UE4M3H200Scales.encode``'s code, sign-bit bytes (no UE4M3 value,
    which the host encoder refuses) the NaN code; an empty array stays empty."""
    codes, empty_shape = simulated["codes"]
    codes = np.array(codes, np.uint8).reshape(256)
    np.testing.assert_array_equal(codes[:128], UE4M3H200Scales.encode(np.arange(128, dtype=np.uint8)))
    assert set(codes[128:].tolist()) == {UE4M3H200Scales.NAN_BYTE}
    assert tuple(empty_shape) == (2, 0, 32)


@pytest.mark.parametrize("case, message", [
    ("host", "TypeError: a is a host array: host bytes take GroupedProblem.with_b_layout / with_a_layout"),
    ("scales_odd", "ValueError: scales: the last axis ((3,)) must be a multiple of 4 bytes"),
    ("two_bytes", "TypeError: a must hold bytes"),
    ("odd_row", "ValueError: a: the last axis ((6,)) must be a multiple of 4 bytes"),
    ("strided", "ValueError: a must be C-contiguous"),
    ("out_shape", "ValueError: out has shape (2, 4), a has (2, 8)"),
    ("tiled_out", "ValueError: out has shape (1, 192, 128), weights (1, 192, 128) are stored as (1, 256, 128)"),
    ("fused_short", "ValueError: b_scales of shape (1, 1, 1, 32, 4, 4) are not the 128x4 atoms"),
    ("tiled_host", "TypeError: b is a host array"),
    ("fused_atoms", "ValueError: b_scales of shape (1, 1, 3, 32, 4, 4) are not the 128x4 atoms"),
    ("fused_out", "ValueError: out has shape (1, 128, 128), weights (1, 128, 128) are stored as (1, 128, 136)"),
])
def test_device_relayout_refuses_bad_input(simulated, case, message):
    assert simulated["errors"][case].startswith(message), simulated["errors"][case]


def test_byte_tables_rebuild_the_host_swizzle():
    """The tables the kernel reads: OR of the four bytes' entries = ``swizzle``; the inverse tables undo it."""
    words = np.random.default_rng(1).integers(0, 2 ** 32, 1000, dtype=np.uint64).astype(np.uint32)
    for inverse, expect in ((False, E2M1H200Order.swizzle), (True, E2M1H200Order.unswizzle)):
        tables = E2M1H200Order.byte_tables(inverse)
        image = np.bitwise_or.reduce([tables[i][(words >> np.uint32(8 * i)) & np.uint32(0xFF)] for i in range(4)])
        np.testing.assert_array_equal(image, expect(words.view(np.uint8)).view(np.uint32))


def test_relayout_kernel_assembles_for_sm90a_without_local_memory():
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from numba.cuda import types

    from gbs.numba_kernels import relayout
    from gbs.ptx_inline import offline

    words = types.Array(types.uint32, 1, "C")
    tables = types.Array(types.uint32, 2, "C")
    for kernel, signature in ((relayout.relay_words, (words, tables, words)),
                              (relayout.map_bytes, (words, types.Array(types.uint32, 1, "C"), words)),
                              (relayout.relay_tiled_words, (words, tables, types.int64, types.int64, types.int64,
                                                            words)),
                              (relayout.place_scale_words, (words, types.int64, types.int64, types.int64,
                                                            types.int64, words)),
                              (relayout.zero_words, (words,))):
        cubin = offline.compile_cubin(kernel, signature, offline.SM90A)
        assert offline.resource_usage(cubin).local_bytes == 0


def _check_relaid_device_operands(problem, device, relaid, backend, **layout):
    """``gbs.grouped_matmul`` on the packed torch arrays ``device`` and on them with ``relaid`` swapped in
    (tagged ``layout``): the packed run passes the reference, the re-laid one gives its bits, skipped rows
    keeping the poison in both."""
    import torch

    import gbs
    from gbs.reference import check_acceptance, poison_output

    outs = []
    for arrays, tags in ((device, {}), (dict(device, **relaid), layout)):
        out = torch.from_numpy(poison_output(problem.total_tokens, problem.n).view(np.int16)).cuda()
        gbs.grouped_matmul(gbs.device_problem(**arrays, fmt="nvfp4", **tags), backend=backend,
                           out=out.view(torch.bfloat16))
        outs.append(out.cpu().numpy().view(np.uint16))
    assert check_acceptance(problem, outs[0].view(gbs.formats.BF16)).passed
    np.testing.assert_array_equal(outs[1], outs[0])


def _torch_problem(seed, group_sizes):
    """A synthetic NVFP4 problem (N 512, K 1024, 3 experts) and its arrays as CUDA torch tensors."""
    import torch

    from gbs.lab.cases import synthetic_problem
    from gbs.numba_kernels import launch

    problem = synthetic_problem("nvfp4", n=512, k=1024, group_sizes=group_sizes, expert_ids=[1, 0, -1, 2],
                                num_experts=3, seed=seed)
    return problem, {name: torch.from_numpy(np.ascontiguousarray(getattr(problem, name))).cuda()
                     for name in launch.PROBLEM_ARRAY_DTYPES}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["h200_stream", "h200_wgmma"])
def test_gpu_tokens_relaid_on_the_device_give_the_packed_bits(backend):
    """Torch tokens and their UE4M3 scales re-laid on the GPU (read back: the host swizzle's and encoder's
    bytes) run both H200 kernels with ``a_layout="e2m1_h200"`` and give the packed tokens' bits, skipped
    rows keeping the poison."""
    torch = pytest.importorskip("torch")
    from gbs.numba_kernels import relayout

    problem, device = _torch_problem(11, [150, 0, 1, 40])
    relaid = torch.as_tensor(relayout.to_e2m1_h200(device["a"]), device="cuda")
    np.testing.assert_array_equal(relaid.cpu().numpy(), E2M1H200Order.swizzle(problem.a))
    coded = torch.as_tensor(relayout.ue4m3_scales_to_h200(device["a_scales"]), device="cuda")
    np.testing.assert_array_equal(coded.cpu().numpy(), UE4M3H200Scales.encode(problem.a_scales))
    _check_relaid_device_operands(problem, device, {"a": relaid, "a_scales": coded}, backend, a_layout="e2m1_h200")


@pytest.mark.gpu
def test_gpu_weights_tiled_on_the_device_give_the_packed_bits():
    """Torch NVFP4 weights and their scales put in ``E2M1H200TiledOrder`` on the GPU (read back: the host
    order's bytes) run the streaming kernel with ``b_layout="e2m1_h200_tiled"`` and give the packed bits."""
    torch = pytest.importorskip("torch")
    from gbs.numba_kernels import relayout

    problem, device = _torch_problem(12, [4, 0, 1, 3])
    tiled = torch.as_tensor(relayout.to_e2m1_h200_tiled(device["b"]), device="cuda")
    np.testing.assert_array_equal(tiled.cpu().numpy(), E2M1H200TiledOrder.swizzle(problem.b))
    coded = torch.as_tensor(relayout.ue4m3_scales_to_h200(device["b_scales"]), device="cuda")
    _check_relaid_device_operands(problem, device, {"b": tiled, "b_scales": coded}, "h200_stream",
                                  b_layout="e2m1_h200_tiled")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["h200_stream", "h200_wgmma"])
def test_gpu_weights_fused_on_the_device_give_the_packed_bits(backend):
    """Torch NVFP4 weights and their scale codes put in ``E2M1H200FusedOrder`` on the GPU (read back: the host
    order's bytes) run both H200 kernels with ``b_layout="e2m1_h200_fused"`` and give the packed bits."""
    torch = pytest.importorskip("torch")
    from gbs.numba_kernels import relayout

    problem, device = _torch_problem(13, [150, 0, 1, 40])
    coded = torch.as_tensor(relayout.ue4m3_scales_to_h200(device["b_scales"]), device="cuda")
    fused = torch.as_tensor(relayout.to_e2m1_h200_fused(device["b"], coded), device="cuda")
    np.testing.assert_array_equal(fused.cpu().numpy(), problem.with_b_layout("e2m1_h200_fused").b)
    _check_relaid_device_operands(problem, device, {"b": fused, "b_scales": coded}, backend,
                                  b_layout="e2m1_h200_fused")
