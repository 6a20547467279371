"""``scripts/wgmma_fp8_probe.py`` (issue 31 item 3's two open facts, measured on the H200): its operands are what
it says (host), and its kernels assemble for sm_90a with the instructions it times (offline)."""
from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import pytest

from gbs.ptx_inline import hopper as hp

from script_modules import load_script



@pytest.fixture(scope="module")
def probe():
    return load_script("wgmma_fp8_probe")


def _tile_values(words: np.ndarray, rows: int) -> np.ndarray:
    """(rows, 128) float values of a 128B-swizzled K-major E4M3 tile."""
    tile = words.view(np.uint8)
    values = np.zeros((rows, 128))
    for r in range(rows):
        for k in range(128):
            values[r, k] = float(np.array([tile[hp.kmajor_sw128_offset(r, k)]], np.uint8)
                                 .view(ml_dtypes.float8_e4m3fn)[0])
    return values


@pytest.mark.parametrize("gap", [0, 1, 13, 14, 24, 34])
@pytest.mark.parametrize("same", [True, False])
def test_precision_operands_hold_a_big_and_a_small_product_gap_apart(probe, gap, same):
    a, b, big, small = probe.gap_operands(gap, same)
    av, bv = _tile_values(a, probe.A_ROWS), _tile_values(b, probe.PRECISION_N)
    k_small = 1 if same else 32
    assert av[0, 0] * bv[0, 0] == big and av[0, k_small] * bv[0, k_small] == small == big * 2.0 ** -gap
    products = av @ bv.T
    assert products[0, 0] == big + small
    assert np.count_nonzero(av) == 2 and np.count_nonzero(bv) == 2
    assert (k_small < 32) == same   # the same k32 step, or the next


def test_probe_kernels_assemble_for_sm90a_with_what_they_time(probe):
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from numba.cuda import types

    from gbs.ptx_inline import offline

    f32, u64 = types.Array(types.float32, 1, "C"), types.Array(types.uint64, 1, "C")
    want = {"bf16": ("HGMMA.64x128x16.F32.BF16", 16, 0), "e4m3": ("QGMMA.64x128x32.F32.E4M3.E4M3", 8, 0),
            "e4m3_promote_serial": ("QGMMA.64x128x32.F32.E4M3.E4M3", 8, 128),
            "e4m3_promote_k32_overlap": ("QGMMA.64x128x32.F32.E4M3.E4M3", 2, 128)}   # a loop of 2 steps per body
    for variant, (opcode, mmas, ffmas) in want.items():   # two 128-K chunks per unrolled loop body
        cubin = offline.compile_cubin(probe.make_throughput_kernel(variant), (f32, u64, types.int64), offline.SM90A,
                                      launch_bounds=(256, 1))
        ops = collections.Counter(i.split()[0] for i in offline.sass_instructions(offline.disassemble(cubin)))
        assert ops[opcode] == mmas and ops["FFMA"] >= ffmas, (variant, ops)
        assert offline.resource_usage(cubin).local_bytes == 0, variant
