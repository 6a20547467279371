"""GPU numerics of the Hopper / common inline-PTX families (written for the H200, sm_90a).

Runs the kernels that tests/test_ptx_hopper.py checks offline, on fresh random data, against
float64 numpy references: mma.sync bf16 and e4m3, ldmatrix (plain and .trans), wgmma bf16
m64nNk16 (N = 8, 64, 256; no-swizzle and 128B layouts; scale-d 0 and 1), wgmma e4m3 m64n64k32,
wgmma bf16 with A in registers, a TMA 2-D load completing on an mbarrier (in bounds and hanging
over the tensor edge) followed by a TMA store, cp.async, and the 16-byte ld.global.nc copy.
Outputs are poisoned (NaN / 0xA5 / 0xDEADBEEF) before each launch; inputs are never all zero.
Register fragments are packed on the host with the position functions of gbs.ptx_inline.hopper,
so a pass also validates those maps against the hardware.
"""
from __future__ import annotations

import os
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from gbs.ptx_inline import copy as cp
from gbs.ptx_inline import hopper as hp

sys.path.insert(0, os.path.dirname(__file__))
import test_ptx_hopper as kernels  # noqa: E402  (the kernels the offline checks compile)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.is_available(),
                       reason="needs a CUDA GPU (numba.cuda.is_available() is False)"),
]


# Without a GPU the module-level skip above applies; these only narrow the kind of GPU.
_CC = tuple(cuda.get_current_device().compute_capability) if cuda.is_available() else None
needs_sm90 = pytest.mark.skipif(_CC is not None and _CC != (9, 0),
                                reason="wgmma is sm_90a-only: needs a Hopper (compute capability 9.0) GPU")
needs_sm90_or_newer = pytest.mark.skipif(_CC is not None and _CC < (9, 0),
                                         reason="needs compute capability >= 9.0 (TMA, mbarrier tx counts)")

BF16_TOL = 1e-3   # bf16 x bf16 products are exact in fp32: expect ~1e-7
FP8_WGMMA_TOL = 1e-2  # fp8 wgmma accumulates with reduced internal precision
POISON_U32 = 0xDEADBEEF


@pytest.fixture
def rng(request):
    """Fresh random data per test, reproducible from the test id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def random_bf16(rng, shape):
    """(bit patterns uint16, float64 values) of random bf16 numbers, none zero."""
    values = rng.standard_normal(shape).astype(np.float32)
    values[values == 0] = 1.0
    bits = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return bits, bits.view(ml_dtypes.bfloat16).astype(np.float64)


def random_e4m3(rng, shape):
    """(bytes uint8, float64 values) of random finite FP8 E4M3 numbers."""
    values = (rng.standard_normal(shape) * 4).clip(-448, 448).astype(np.float32)
    bits = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return bits, bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def pack_registers(bits, position, threads, elems, elem_bits):
    """u32 registers [thread, elems * elem_bits // 32]: element i of ``thread`` is
    ``bits[position(thread, i)]``, packed lowest element in the lowest bits."""
    per_reg = 32 // elem_bits
    regs = np.zeros((threads, elems // per_reg), np.uint64)
    for t in range(threads):
        for i in range(elems):
            value = int(bits[position(t, i)])
            regs[t, i // per_reg] |= np.uint64(value << (elem_bits * (i % per_reg)))
    return regs.astype(np.uint32)


def gather(matrix, position, threads, elems):
    return np.array([[matrix[position(t, i)] for i in range(elems)] for t in range(threads)], matrix.dtype)


def scatter(regs, position, shape):
    out = np.full(shape, np.nan)
    for t in range(regs.shape[0]):
        for i in range(regs.shape[1]):
            out[position(t, i)] = regs[t, i]
    return out


# =============================================================================================
# mma.sync and ldmatrix (one warp)
# =============================================================================================
def _run_mma(kernel, a_regs, b_regs, c):
    c_regs = gather(c, hp.mma_m16n8_c_position, 32, 4)
    d_regs = cuda.to_device(np.full((32, 4), np.nan, np.float32))
    cuda.jit(kernel)[1, 32](cuda.to_device(a_regs), cuda.to_device(b_regs), cuda.to_device(c_regs), d_regs)
    return scatter(d_regs.copy_to_host(), hp.mma_m16n8_c_position, (16, 8))


def test_mma_bf16_m16n8k16(rng):
    a_bits, a = random_bf16(rng, (16, 16))
    b_bits, b = random_bf16(rng, (16, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_regs = pack_registers(a_bits, hp.mma_m16n8k16_a_position, 32, 8, 16)
    b_regs = pack_registers(b_bits, hp.mma_m16n8k16_b_position, 32, 4, 16)
    d = _run_mma(kernels.k_mma_bf16, a_regs, b_regs, c)
    assert rel_err(d, a @ b + c) < BF16_TOL


def test_mma_e4m3_m16n8k32(rng):
    a_bits, a = random_e4m3(rng, (16, 32))
    b_bits, b = random_e4m3(rng, (32, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_regs = pack_registers(a_bits, hp.mma_m16n8k32_a_position, 32, 16, 8)
    b_regs = pack_registers(b_bits, hp.mma_m16n8k32_b_position, 32, 8, 8)
    d = _run_mma(kernels.k_mma_e4m3, a_regs, b_regs, c)
    assert rel_err(d, a @ b + c) < BF16_TOL


def test_ldmatrix_x4_plain_and_transposed(rng):
    matrices = rng.integers(1, 1 << 16, (4, 8, 8), dtype=np.uint16)
    plain = cuda.to_device(np.full((32, 4), POISON_U32, np.uint32))
    transposed = cuda.to_device(np.full((32, 4), POISON_U32, np.uint32))
    cuda.jit(kernels.k_ldmatrix)[1, 32](cuda.to_device(matrices.reshape(-1)), plain, transposed)
    lane = np.arange(32)[:, None]
    j = np.arange(4)[None, :]
    row, col = lane // 4, 2 * (lane % 4)
    m = matrices.astype(np.uint32)
    want_plain = m[j, row, col] | m[j, row, col + 1] << 16
    want_trans = m[j, col, row] | m[j, col + 1, row] << 16
    np.testing.assert_array_equal(plain.copy_to_host(), want_plain)
    np.testing.assert_array_equal(transposed.copy_to_host(), want_trans)


# =============================================================================================
# wgmma (one warpgroup)
# =============================================================================================
def _wgmma_operands(rng, n, dtype):
    """A (64 x 128 bytes) and B^T (n x 128 bytes) as byte tiles + float64 values (K-major)."""
    if dtype == "bf16":
        a_bits, a = random_bf16(rng, (kernels.A_ROWS, kernels.TILE_K_BYTES // 2))
        b_bits, b_t = random_bf16(rng, (n, kernels.TILE_K_BYTES // 2))
    else:
        a_bits, a = random_e4m3(rng, (kernels.A_ROWS, kernels.TILE_K_BYTES))
        b_bits, b_t = random_e4m3(rng, (n, kernels.TILE_K_BYTES))
    return a_bits, a, b_bits, b_t


def _run_wgmma(kernel, image, a_frag, c, n, scale_first):
    threads, count = hp.WGMMA_THREADS, n // 2
    c_regs = gather(c, hp.wgmma_accumulator_position, threads, count)
    d_regs = cuda.to_device(np.full((threads, count), np.nan, np.float32))
    descriptors = cuda.to_device(np.zeros(2, np.uint64))
    cuda.jit(kernel)[1, threads](cuda.to_device(image.view(np.uint32)), cuda.to_device(a_frag),
                                 cuda.to_device(c_regs), d_regs, np.uint32(scale_first), descriptors)
    d = scatter(d_regs.copy_to_host(), hp.wgmma_accumulator_position, (hp.WGMMA_M, n))
    return d, [int(x) for x in descriptors.copy_to_host()]


def _check_descriptors(descriptors, swizzle):
    """The kernel's K-step-0 descriptors equal the host function's, at a 1024-B-aligned tile."""
    lbo, sbo, _ = kernels.KMAJOR_DESCRIPTOR_PARAMS[swizzle]
    starts = [(d & 0x3FFF) << 4 for d in descriptors]
    assert starts[0] % hp.SW128_ALIGN == 0 and starts[1] == starts[0] + kernels.A_TILE_BYTES
    assert descriptors == [hp.wgmma_smem_descriptor(s, lbo, sbo, swizzle) for s in starts]


def _unused_a_registers(rng):
    return rng.integers(1, 1 << 32, (kernels.K_STEPS, hp.WGMMA_THREADS, 4), dtype=np.uint32)


@needs_sm90
@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize("scale_first", [0, 1])
def test_wgmma_bf16_ss(rng, n, swizzle, scale_first):
    a_bits, a, b_bits, b_t = _wgmma_operands(rng, n, "bf16")
    image = np.concatenate([kernels.smem_image(a_bits.view(np.uint8), swizzle),
                            kernels.smem_image(b_bits.view(np.uint8), swizzle)])
    c = rng.standard_normal((hp.WGMMA_M, n)).astype(np.float32)
    kernel = kernels.make_wgmma_ss_kernel(n, swizzle, "bf16")
    d, descriptors = _run_wgmma(kernel, image, _unused_a_registers(rng), c, n, scale_first)
    ref = a @ b_t.T + (c if scale_first else 0.0)
    assert rel_err(d, ref) < BF16_TOL
    _check_descriptors(descriptors, swizzle)


@needs_sm90
@pytest.mark.parametrize("swizzle", ["none", "128B"])
def test_wgmma_e4m3_ss_m64n64k32(rng, swizzle):
    n = 64
    a_bits, a, b_bits, b_t = _wgmma_operands(rng, n, "e4m3")
    image = np.concatenate([kernels.smem_image(a_bits, swizzle), kernels.smem_image(b_bits, swizzle)])
    c = rng.standard_normal((hp.WGMMA_M, n)).astype(np.float32)
    kernel = kernels.make_wgmma_ss_kernel(n, swizzle, "e4m3")
    d, descriptors = _run_wgmma(kernel, image, _unused_a_registers(rng), c, n, scale_first=1)
    assert rel_err(d, a @ b_t.T + c) < FP8_WGMMA_TOL
    _check_descriptors(descriptors, swizzle)


@needs_sm90
@pytest.mark.parametrize("swizzle", ["none", "128B"])
def test_wgmma_bf16_rs_a_from_registers(rng, swizzle):
    n = 64
    a_bits, a, b_bits, b_t = _wgmma_operands(rng, n, "bf16")
    k_step_elems = hp.K_STEP_BYTES // 2
    a_frag = np.stack([
        pack_registers(a_bits[:, s * k_step_elems:(s + 1) * k_step_elems], hp.wgmma_a_register_position,
                       hp.WGMMA_THREADS, 8, 16)
        for s in range(kernels.K_STEPS)])
    poison_a_tile = np.full(kernels.A_TILE_BYTES, 0xFF, np.uint8)  # bf16 NaNs: must not be read
    image = np.concatenate([poison_a_tile, kernels.smem_image(b_bits.view(np.uint8), swizzle)])
    c = rng.standard_normal((hp.WGMMA_M, n)).astype(np.float32)
    kernel = kernels.make_wgmma_rs_kernel(n, swizzle)
    d, _ = _run_wgmma(kernel, image, a_frag, c, n, scale_first=1)
    assert rel_err(d, a @ b_t.T + c) < BF16_TOL


@needs_sm90
def test_wgmma_e4m3_rs_a_from_registers(rng):
    """E4M3 A from registers (the FP8 route's token operand) at ``wgmma_e4m3_a_register_position``."""
    n = 64
    a_bits, a, b_bits, b_t = _wgmma_operands(rng, n, "e4m3")
    k_step = hp.K_STEP_BYTES
    a_frag = np.stack([
        pack_registers(a_bits[:, s * k_step:(s + 1) * k_step], hp.wgmma_e4m3_a_register_position,
                       hp.WGMMA_THREADS, 16, 8)
        for s in range(kernels.K_STEPS)])
    poison_a_tile = np.full(kernels.A_TILE_BYTES, 0x7F, np.uint8)  # e4m3 NaNs: must not be read
    image = np.concatenate([poison_a_tile, kernels.smem_image(b_bits, "128B")])
    c = rng.standard_normal((hp.WGMMA_M, n)).astype(np.float32)
    kernel = kernels.make_wgmma_rs_kernel(n, "128B", "e4m3")
    d, _ = _run_wgmma(kernel, image, a_frag, c, n, scale_first=1)
    assert rel_err(d, a @ b_t.T + c) < FP8_WGMMA_TOL


# =============================================================================================
# TMA + mbarrier
# =============================================================================================
G_ROWS, G_COLS = 256, 512           # uint8 global tensors
BOX_COLS, BOX_ROWS = 128, 64        # one box: 64 rows x 128 bytes
BOX_BYTES = BOX_COLS * BOX_ROWS
OUT_POISON = 0x5A


def _box(g, c0, c1):
    """Box at (c0, c1) (column, row) of g, zero where it hangs over the edge."""
    out = np.zeros((BOX_ROWS, BOX_COLS), np.uint8)
    r0, r1 = max(c1, 0), min(c1 + BOX_ROWS, g.shape[0])
    q0, q1 = max(c0, 0), min(c0 + BOX_COLS, g.shape[1])
    out[r0 - c1:r1 - c1, q0 - c0:q1 - c0] = g[r0:r1, q0:q1]
    return out


@needs_sm90_or_newer
@pytest.mark.parametrize("c0, c1, out_c0, out_c1", [
    (128, 64, 256, 128),                       # in bounds
    (G_COLS - 64, G_ROWS - 32, 0, 0),          # hangs over the right and bottom edges: zero fill
])
def test_tma_2d_load_mbarrier_and_store(rng, c0, c1, out_c0, out_c1):
    g = rng.integers(1, 256, (G_ROWS, G_COLS), dtype=np.uint8)
    g[g == kernels.TMA_POISON] = 1
    d_g = cuda.to_device(g)
    d_out = cuda.to_device(np.full((G_ROWS, G_COLS), OUT_POISON, np.uint8))
    maps = [cp.encode_tensor_map_2d(arr.__cuda_array_interface__["data"][0], "uint8", (G_COLS, G_ROWS),
                                    G_COLS, (BOX_COLS, BOX_ROWS), swizzle="none") for arr in (d_g, d_out)]
    d_maps = cuda.to_device(np.concatenate(maps))  # 128 B apart; the allocation is 256-B aligned
    maps_addr = d_maps.__cuda_array_interface__["data"][0]
    assert maps_addr % 64 == 0
    tile = cuda.to_device(np.zeros(BOX_BYTES, np.uint8))
    status = cuda.to_device(np.zeros(3, np.uint32))
    cuda.jit(kernels.k_tma_2d)[1, kernels.TMA_THREADS, 0, BOX_BYTES](
        np.uint64(maps_addr), np.uint64(maps_addr + cp.TENSOR_MAP_BYTES), np.int32(c0), np.int32(c1),
        np.int32(out_c0), np.int32(out_c1), np.uint32(BOX_BYTES), tile, status)
    cuda.synchronize()
    done, polls, smem_addr = (int(x) for x in status.copy_to_host())
    assert done == 1, f"mbarrier phase never completed after {polls} polls"
    assert smem_addr % 128 == 0
    box = _box(g, c0, c1)
    np.testing.assert_array_equal(tile.copy_to_host().reshape(BOX_ROWS, BOX_COLS), box)
    want = np.full((G_ROWS, G_COLS), OUT_POISON, np.uint8)
    want[out_c1:out_c1 + BOX_ROWS, out_c0:out_c0 + BOX_COLS] = box
    np.testing.assert_array_equal(d_out.copy_to_host(), want)


@needs_sm90_or_newer
def test_tensor_map_is_128_bytes_and_rejects_bad_box():
    d_g = cuda.to_device(np.ones((G_ROWS, G_COLS), np.uint8))
    addr = d_g.__cuda_array_interface__["data"][0]
    tmap = cp.encode_tensor_map_3d(addr, "bfloat16", (64, 32, 8), (G_COLS, G_COLS * 32), (64, 32, 2),
                                   swizzle="128B")
    assert tmap.dtype == np.uint8 and tmap.shape == (cp.TENSOR_MAP_BYTES,) and tmap.any()
    with pytest.raises(ValueError, match="inner box extent"):
        cp.encode_tensor_map_2d(addr, "bfloat16", (256, G_ROWS), G_COLS, (128, 64), swizzle="128B")


# =============================================================================================
# cp.async and the streaming 16-byte load
# =============================================================================================
def test_cp_async_copy(rng):
    src = rng.integers(1, 1 << 32, kernels.CP_ASYNC_WORDS, dtype=np.uint32)
    dst = cuda.to_device(np.full_like(src, POISON_U32))
    cuda.jit(kernels.k_cp_async)[1, kernels.CP_ASYNC_THREADS](cuda.to_device(src), dst)
    np.testing.assert_array_equal(dst.copy_to_host(), src)


def test_ld_global_nc_v4_copy(rng):
    blocks, threads = 8, 256
    words = 2 * kernels.NC_LOADS_IN_FLIGHT * 4 * blocks * threads  # two loop trips per thread
    src = rng.integers(1, 1 << 32, words, dtype=np.uint32)
    dst = cuda.to_device(np.full_like(src, POISON_U32))
    cuda.jit(kernels.k_nc_copy)[blocks, threads](cuda.to_device(src), dst)
    np.testing.assert_array_equal(dst.copy_to_host(), src)
