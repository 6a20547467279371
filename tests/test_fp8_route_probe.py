"""``scripts/fp8_route_probe.py`` (issue 31 item 3): its per-thread index arithmetic, emulated on the host for one
CTA, makes the chunk sums and bases of ``gbs.fp8_route`` (the route's K order, the 128B-swizzled weight buffer and
the E4M3 A registers agree), and its kernel assembles for sm_90a with what it claims (offline)."""
from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import pytest

from gbs.fp8_route import fold_operand
from gbs.formats import quantize
from gbs.numba_kernels import fp8_decode as fd
from gbs.ptx_inline import hopper as hp

from script_modules import load_script



@pytest.fixture(scope="module")
def probe():
    return load_script("fp8_route_probe")


def _e4m3(b: np.ndarray) -> np.ndarray:
    return b.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def emulate_chunk(probe, inputs, c: int, weight_offsets=None):
    """One CTA's chunk ``c`` (tile 0, 0) as its 256 threads compute it: (A (128, 128) E4M3 bytes in wgmma K
    positions, B (128, 128) likewise, the tile's weight base, the token rows' bases)."""
    weight_offsets = weight_offsets or probe.weight_word_offsets
    a_words, a_scales, b_words, b_scales, tables = inputs
    tab = tables.reshape(-1)
    top = max(fd.chunk_max_scale(int(b_scales[r, c])) for r in range(probe.TILE))
    buffer = np.zeros(probe.TILE * probe.CHUNK, np.uint8)
    for tid in range(probe.THREADS):
        b_row, b_half = divmod(tid, 2)
        sw = int(b_scales[b_row, c])
        for j in range(2):
            block = 2 * b_half + j
            t = fd.fold_table_row((sw >> (8 * block)) & 0xFF, top)
            for w in range(probe.BLOCK_WORDS):
                word = b_words[b_row, c * probe.WORDS_PER_CHUNK + block * probe.BLOCK_WORDS + w]
                lo, hi = fd.decode_word(word, tab[2 * t], tab[2 * t + 1])
                off_lo, off_hi = weight_offsets(b_row, block, w)
                buffer[off_lo:off_lo + 4] = np.array([lo], "<u4").view(np.uint8)
                buffer[off_hi:off_hi + 4] = np.array([hi], "<u4").view(np.uint8)
    b = np.array([[buffer[hp.kmajor_sw128_offset(col, k)] for k in range(probe.CHUNK)] for col in range(probe.TILE)],
                 np.uint8)
    a_registers = probe.make_a_registers(fd.decode_word, fd.fold_table_row)
    a = np.zeros((probe.TILE, probe.CHUNK), np.uint8)
    row_bases = np.zeros(probe.TILE, np.int64)
    for tid in range(probe.THREADS):
        wg, local = divmod(tid, 128)
        warp, lane = divmod(local, 32)
        g, q = divmod(lane, 4)
        row_lo = wg * 64 + warp * 16 + g
        sw_lo, sw_hi = int(a_scales[row_lo, c]), int(a_scales[row_lo + 8, c])
        top_lo, top_hi = fd.chunk_max_scale(sw_lo), fd.chunk_max_scale(sw_hi)
        row_bases[row_lo], row_bases[row_lo + 8] = fd.promotion_log2(top_lo), fd.promotion_log2(top_hi)
        for step in range(4):
            regs = np.array(a_registers(a_words, row_lo, row_lo + 8, c * probe.WORDS_PER_CHUNK, step, q, sw_lo, sw_hi,
                                        top_lo, top_hi, tab), "<u4").view(np.uint8)
            for i in range(16):
                row, k = hp.wgmma_e4m3_a_register_position(local, i)
                a[wg * 64 + row, step * 32 + k] = regs[i]
    return a, b, fd.promotion_log2(top), row_bases


def test_one_cta_makes_the_route_model_s_chunk_sums_and_bases(probe):
    inputs, _, _, outside = probe.operands(128, 128, 256, seed=3)
    assert outside == 0
    rng = np.random.default_rng(3)   # the operands' data again, for the model
    qa = quantize(rng.standard_normal((128, 256)).astype(np.float32), "mxfp4")
    qb = quantize(rng.standard_normal((128, 256)).astype(np.float32), "mxfp4")
    fa, fb = fold_operand(qa, base_over="finite"), fold_operand(qb, base_over="finite", base_rows=128)
    for c in range(2):
        a, b, tile_base, row_bases = emulate_chunk(probe, inputs, c)
        ks = slice(128 * c, 128 * (c + 1))
        np.testing.assert_array_equal(_e4m3(a) @ _e4m3(b).T, _e4m3(fa.e4m3[:, ks]) @ _e4m3(fb.e4m3[:, ks]).T)
        assert (fb.bases[:, c] == tile_base).all()
        np.testing.assert_array_equal(row_bases, fa.bases[:, c])
    # a planted fault: the weights' high halves stored where the low ones go
    swapped = lambda row, block, w: probe.weight_word_offsets(row, block, w)[::-1]
    a, b, _, _ = emulate_chunk(probe, inputs, 0, swapped)
    assert not np.array_equal(_e4m3(a) @ _e4m3(b).T, _e4m3(fa.e4m3[:, :128]) @ _e4m3(fb.e4m3[:, :128]).T)


def test_probe_kernel_assembles_for_sm90a(probe):
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from numba.cuda import types

    from gbs.ptx_inline import offline

    u32 = types.Array(types.uint32, 2, "C")
    sig = (u32, u32, u32, u32, u32, types.Array(types.float32, 2, "C"), types.Array(types.uint64, 1, "C"))
    for variant, ffmas in (("full", 64), ("no_promotion", 0)):
        cubin = offline.compile_cubin(probe.make_kernel(variant), sig, offline.SM90A)
        ops = collections.Counter(i.split()[0] for i in offline.sass_instructions(offline.disassemble(cubin)))
        assert ops["QGMMA.64x128x32.F32.E4M3.E4M3"] == 4 and ops["FFMA"] == ffmas and ops["PRMT"] == 32, ops
        assert offline.resource_usage(cubin).local_bytes == 0
