"""Offline checks of the Hopper / common inline-PTX families (no GPU needed).

Each family is compiled into a small kernel for sm_90a (mbarrier, TMA and cluster also for
sm_100a) through the launch path (NVVM -> LTO-IR -> nvJitLink), and the SASS must contain the
instructions the PTX promises; wgmma must be rejected for sm_100a. The pure-Python parts
(descriptor bits, canonical K-major layouts, register-fragment maps, tensor-map argument checks)
are unit-tested, including a model of how wgmma reads shared memory through a descriptor.

The kernels defined here are the ones tests/test_ptx_hopper_gpu.py runs on the H200, so what is
checked offline is what runs there. Each kernel is compiled once per session (``_compiled``).

SASS seen with ptxas / nvJitLink 13.5 (asserted below):
  mbarrier.init SYNCS.EXCH.64; arrive SYNCS.ARRIVE.TRANS64.A1T0; arrive.expect_tx
  SYNCS.ARRIVE.TRANS64; expect_tx SYNCS.ARRIVE.TRANS64.RED.A0TR; remote cluster arrive
  SYNCS.ARRIVE.TRANS64.RED.A1T0; try_wait SYNCS.PHASECHK.TRANS64.TRYWAIT; elect.sync ELECT;
  fence.proxy.async FENCE.VIEW.ASYNC.S; bar.sync/arrive id,n BAR.SYNC.DEFER_BLOCKING / BAR.ARV;
  barrier.cluster UCGABAR_ARV / UCGABAR_WAIT; cp.async.ca LDGSTS.E.128, .cg LDGSTS.E.BYPASS.128,
  commit LDGDEPBAR, wait_group DEPBAR.LE; ld.global.nc.L1::no_allocate.v4 LDG.E.NA.128.CONSTANT;
  TMA UTMALDG.2D/.3D (+ .MULTICAST), UTMASTG.2D; prefetch.tensormap UTMACCTL.PF;
  fence.proxy.tensormap acquire UTMACCTL.IV; ldmatrix LDSM.16.M88.4 / LDSM.16.MT88.4;
  mma.sync bf16 HMMA.16816.F32.BF16; mma.sync e4m3 m16n8k32: NO fp8 MMA on sm_90a -- ptxas
  converts the operands (F2FP.F16.E4M3.UNPACK_B) and issues two fp16 HMMA.16816.F32;
  griddepcontrol.wait ACQBULK, griddepcontrol.launch_dependents PREEXIT;
  wgmma bf16 HGMMA.64xNx16.F32.BF16, e4m3 QGMMA.64xNx32.F32.E4M3.E4M3, fence WARPGROUP.ARRIVE,
  wait WARPGROUP.DEPBAR.LE; setmaxnreg USETMAXREG.TRY_ALLOC/DEALLOC.CTAPOOL, but ONLY when the
  kernel has launch bounds or a register limit (otherwise ptxas drops it silently); it
  assembles for sm_100a too.
"""
from __future__ import annotations

import functools
import os
import subprocess
import tempfile

import numpy as np
import pytest
from llvmlite import ir
from numba import cuda
from numba.cuda import cgutils, types
from numba.cuda.extending import intrinsic

from gbs.ptx_inline import cluster as cl
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import copy as cp
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline import offline

SM90A, SM100A = offline.SM90A, offline.SM100A


# =============================================================================================
# Register tuple <-> array row, with constant indices (a run-time tuple index would put the
# tuple in local memory, and the wgmma kernels must show none)
# =============================================================================================
@functools.cache
def load_row(count: int):
    """Intrinsic ``load(arr2d, row)`` -> UniTuple of ``arr2d[row, 0:count]``."""

    @intrinsic
    def _load(typingctx, arr, row):
        tuple_type = types.UniTuple(arr.dtype, count)

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            r = context.cast(builder, args[1], sig.args[1], types.intp)
            intp = context.get_value_type(types.intp)
            values = [builder.load(cgutils.get_item_pointer(context, builder, aryty, ary,
                                                            [r, ir.Constant(intp, i)]))
                      for i in range(count)]
            return context.make_tuple(builder, tuple_type, values)

        return tuple_type(arr, row), codegen

    return _load


@intrinsic
def store_row(typingctx, arr, row, values):
    """``arr2d[row, i] = values[i]`` for every field of the UniTuple ``values``."""
    count = values.count

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        r = context.cast(builder, args[1], sig.args[1], types.intp)
        intp = context.get_value_type(types.intp)
        for i in range(count):
            value = context.cast(builder, builder.extract_value(args[2], i), values.dtype, aryty.dtype)
            builder.store(value, cgutils.get_item_pointer(context, builder, aryty, ary,
                                                          [r, ir.Constant(intp, i)]))
        return context.get_dummy_value()

    return types.void(arr, row, values), codegen


# =============================================================================================
# Kernels (also run on the GPU by test_ptx_hopper_gpu.py)
# =============================================================================================
_u8_1d = types.Array(types.uint8, 1, "C")
_u16_1d = types.Array(types.uint16, 1, "C")
_u32_1d = types.Array(types.uint32, 1, "C")
_u32_2d = types.Array(types.uint32, 2, "C")
_u32_3d = types.Array(types.uint32, 3, "C")
_u64_1d = types.Array(types.uint64, 1, "C")
_f32_2d = types.Array(types.float32, 2, "C")

# ---- common + mbarrier + cluster: every intrinsic once (compile-only) -------------------------
def k_sync_family(out, parity, tx_bytes):
    bars = cuda.shared.array(2, dtype=np.uint64)
    full = cm.shared_address(bars)
    peer = cm.shared_element_address(bars, 1)
    if cm.warp_index() == 0 and cm.elect_one_sync() != 0:
        mb.mbarrier_init(full, 1)
        mb.mbarrier_init(peer, cl.cluster_nctarank())
        cm.fence_mbarrier_init_release_cluster()
    cm.fence_proxy_async_shared_cta()
    cl.cluster_arrive_relaxed()
    cl.cluster_wait_acquire()
    state = mb.mbarrier_arrive(full)
    mb.mbarrier_arrive_expect_tx(full, tx_bytes)
    mb.mbarrier_expect_tx(full, tx_bytes)
    mb.mbarrier_wait_parity(full, parity)
    mb.mbarrier_arrive_remote_cluster(cl.mapa_shared_cluster(peer, cl.cluster_ctarank() ^ 1))
    mb.mbarrier_wait_parity_acquire_cluster(peer, parity)
    cm.named_barrier_arrive(1, 64)
    cm.named_barrier_sync(2, 128)
    out[cuda.threadIdx.x] = state + mb.mbarrier_try_wait_parity(full, parity) + cm.laneid()
    cl.cluster_arrive_release()
    cl.cluster_wait_acquire()


SIG_SYNC = (_u64_1d, types.uint32, types.uint32)


# ---- grid dependency control (programmatic dependent launch) -----------------------------------
def k_grid_dependency(out):
    cm.griddepcontrol_wait()
    cm.griddepcontrol_launch_dependents()
    out[cuda.threadIdx.x] = cm.laneid()


# ---- cp.async and the streaming load ---------------------------------------------------------
CP_WAIT_1 = cp.cp_async_wait_group(1)
CP_ASYNC_THREADS = 128
CP_ASYNC_WORDS = 2 * 4 * CP_ASYNC_THREADS  # two 16-byte chunks per thread


def k_cp_async(src, dst):
    """dst = src (CP_ASYNC_WORDS words) through shared memory: first half with cp.async.ca, second
    half with cp.async.cg, two commit groups; launch CP_ASYNC_THREADS threads."""
    smem = cuda.shared.array(CP_ASYNC_WORDS, dtype=np.uint32, alignment=16)  # cp.async: 16-B chunks
    tid = cuda.threadIdx.x
    half = CP_ASYNC_WORDS // 2
    src_addr = cm.generic_address(src)
    cp.cp_async_ca_16(cm.shared_element_address(smem, 4 * tid), src_addr + 16 * tid)
    cp.cp_async_commit_group()
    cp.cp_async_cg_16(cm.shared_element_address(smem, half + 4 * tid), src_addr + 4 * half + 16 * tid)
    cp.cp_async_commit_group()
    CP_WAIT_1()            # the .ca group is done ...
    cp.cp_async_wait_all()  # ... and now the .cg group
    cuda.syncthreads()
    for i in range(tid, CP_ASYNC_WORDS, CP_ASYNC_THREADS):
        dst[i] = smem[i]


NC_LOADS_IN_FLIGHT = 4


def k_nc_copy(src, dst):
    """dst = src (u32 words, a multiple of 16 * total threads): each thread issues
    NC_LOADS_IN_FLIGHT 16-byte ld.global.nc loads before storing any."""
    threads = cuda.gridDim.x * cuda.blockDim.x
    chunk = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    base = cm.generic_address(src)
    for first in range(chunk, src.size // 4, NC_LOADS_IN_FLIGHT * threads):
        v0 = cp.ld_global_nc_v4_u32(base + 16 * first)
        v1 = cp.ld_global_nc_v4_u32(base + 16 * (first + threads))
        v2 = cp.ld_global_nc_v4_u32(base + 16 * (first + 2 * threads))
        v3 = cp.ld_global_nc_v4_u32(base + 16 * (first + 3 * threads))
        for j, v in ((0, v0), (1, v1), (2, v2), (3, v3)):
            w = 4 * (first + j * threads)
            dst[w] = v[0]
            dst[w + 1] = v[1]
            dst[w + 2] = v[2]
            dst[w + 3] = v[3]


# ---- TMA -------------------------------------------------------------------------------------
TMA_THREADS = 128
TMA_POISON = 0xA5
TMA_MAX_POLLS = 1 << 22  # bounded mbarrier wait: a copy that never completes fails, not hangs


def k_tma_2d(tmap_in, tmap_out, c0, c1, out_c0, out_c1, nbytes, tile, status):
    """One CTA: poison nbytes of 1024-B-aligned dynamic shared memory, TMA-load box (c0, c1) of
    tmap_in completing on an mbarrier, copy the image to ``tile``, then TMA-store it to box
    (out_c0, out_c1) of tmap_out. status[0] = 1 if the mbarrier phase completed,
    status[1] = polls used, status[2] = shared address of the tile."""
    dyn = cuda.shared.array(0, dtype=np.uint8, alignment=1024)
    bar = cuda.shared.array(1, dtype=np.uint64)
    tid = cuda.threadIdx.x
    dst = cm.shared_address(dyn)
    mbar = cm.shared_address(bar)
    for i in range(tid, nbytes, TMA_THREADS):
        dyn[i] = np.uint8(TMA_POISON)
    cm.fence_proxy_async_shared_cta()  # poison stores before the TMA's async-proxy writes
    if tid == 0:
        cp.fence_proxy_tensormap_acquire_sys(tmap_in)
        cp.fence_proxy_tensormap_acquire_sys(tmap_out)
        cp.prefetch_tensormap(tmap_in)
        mb.mbarrier_init(mbar, 1)
        cm.fence_proxy_async_shared_cta()
    cuda.syncthreads()
    if tid == 0:
        mb.mbarrier_arrive_expect_tx(mbar, nbytes)
        cp.tma_load_2d(dst, tmap_in, c0, c1, mbar)
    done = np.uint32(0)
    polls = np.uint32(0)
    while done == 0 and polls < TMA_MAX_POLLS:
        done = mb.mbarrier_try_wait_parity(mbar, 0)
        polls += 1
    for i in range(tid, nbytes, TMA_THREADS):
        tile[i] = dyn[i]
    cuda.syncthreads()
    if tid == 0:
        status[0] = done
        status[1] = polls
        status[2] = dst
        if done != 0:
            cp.tma_store_2d(tmap_out, out_c0, out_c1, dst)
            cp.bulk_commit_group()
            cp.bulk_wait_group_read_0()


SIG_TMA_2D = (types.uint64, types.uint64, types.int32, types.int32, types.int32, types.int32,
              types.uint32, _u8_1d, _u32_1d)


def k_tma_family(tmap_2d, tmap_3d, out):
    """Compile-only: the 3-D and multicast TMA forms in a 2-CTA cluster pattern, GPU-scope map
    fence; every CTA expects four boxes of 8 KiB."""
    dyn = cuda.shared.array(0, dtype=np.uint8, alignment=1024)
    bar = cuda.shared.array(1, dtype=np.uint64)
    dst = cm.shared_address(dyn)
    mbar = cm.shared_address(bar)
    rank = cl.cluster_ctarank()
    if cuda.threadIdx.x == 0:
        cp.fence_proxy_tensormap_acquire_gpu(tmap_3d)
        cp.prefetch_tensormap(tmap_3d)
        mb.mbarrier_init(mbar, 1)
        cm.fence_mbarrier_init_release_cluster()
    cl.cluster_arrive_release()
    cl.cluster_wait_acquire()
    if cuda.threadIdx.x == 0:
        mb.mbarrier_arrive_expect_tx(mbar, 4 * 8192)
        cp.tma_load_3d(dst, tmap_3d, 0, 0, rank, mbar)
        cp.tma_load_2d_multicast(dst + 8192, tmap_2d, 0, 64 * rank, mbar, 3)
        cp.tma_load_3d_multicast(dst + 16384, tmap_3d, 0, 0, rank + 2, mbar, 3)
        cp.tma_load_2d_multicast(dst + 24576, tmap_2d, 128, 64 * rank, mbar, 3)
    mb.mbarrier_wait_parity(mbar, 0)
    out[cuda.threadIdx.x] = dyn[cuda.threadIdx.x]
    cl.cluster_arrive_release()
    cl.cluster_wait_acquire()


SIG_TMA_FAMILY = (types.uint64, types.uint64, _u8_1d)


# ---- ldmatrix and mma.sync (one warp) --------------------------------------------------------
LDMATRIX_ELEMS = 4 * 64  # four 8x8 b16 matrices, row-major, one after the other


def k_ldmatrix(src, plain, transposed):
    """Lane l gives row l % 8 of matrix l // 8; plain / transposed[lane, j] = register j."""
    smem = cuda.shared.array(LDMATRIX_ELEMS, dtype=np.uint16, alignment=16)  # 16-B rows
    lane = cm.laneid()
    for i in range(lane, LDMATRIX_ELEMS, 32):
        smem[i] = src[i]
    cuda.syncthreads()
    row_addr = cm.shared_element_address(smem, 64 * (lane // 8) + 8 * (lane % 8))
    regs = hp.ldmatrix_x4(row_addr)
    regs_t = hp.ldmatrix_x4_trans(row_addr)
    store_row(plain, lane, regs)
    store_row(transposed, lane, regs_t)


LOAD_ROW_2 = load_row(2)
LOAD_ROW_4 = load_row(4)


def k_mma_bf16(a_frag, b_frag, c_frag, d_frag):
    """One warp: d_frag[lane] = mma(a_frag[lane], b_frag[lane], c_frag[lane])."""
    lane = cm.laneid()
    d = hp.mma_bf16_m16n8k16(LOAD_ROW_4(a_frag, lane), LOAD_ROW_2(b_frag, lane),
                             LOAD_ROW_4(c_frag, lane))
    store_row(d_frag, lane, d)


def k_mma_e4m3(a_frag, b_frag, c_frag, d_frag):
    lane = cm.laneid()
    d = hp.mma_e4m3_m16n8k32(LOAD_ROW_4(a_frag, lane), LOAD_ROW_2(b_frag, lane),
                             LOAD_ROW_4(c_frag, lane))
    store_row(d_frag, lane, d)


SIG_LDMATRIX = (_u16_1d, _u32_2d, _u32_2d)
SIG_MMA = (_u32_2d, _u32_2d, _f32_2d, _f32_2d)


# ---- wgmma (one warpgroup) -------------------------------------------------------------------
A_ROWS = hp.WGMMA_M
TILE_K_BYTES = 128                   # each operand row holds a 128-byte K slice ...
K_STEPS = TILE_K_BYTES // hp.K_STEP_BYTES  # ... = 4 chained wgmmas
A_TILE_BYTES = A_ROWS * TILE_K_BYTES  # B starts here: 8 KiB, 1024-B aligned
# swizzle -> (LBO, SBO, start-address advance per K step), the canonical K-major layouts
KMAJOR_DESCRIPTOR_PARAMS = {
    "none": (hp.INTERLEAVE_LBO, 8 * TILE_K_BYTES, hp.INTERLEAVE_K_STEP),
    "128B": (hp.SW128_LBO, hp.SW128_SBO, hp.SW128_K_STEP),
}


def kmajor_offsets(rows: int, swizzle: str) -> np.ndarray:
    """offsets[r, kbyte]: byte offset of (r, kbyte) in a rows x TILE_K_BYTES K-major tile."""
    r = np.arange(rows)[:, None]
    kbyte = np.arange(TILE_K_BYTES)[None, :]
    if swizzle == "none":
        return hp.kmajor_interleave_offset(r, kbyte, TILE_K_BYTES)
    return hp.kmajor_sw128_offset(r, kbyte)


def smem_image(tile_bytes: np.ndarray, swizzle: str) -> np.ndarray:
    """Shared-memory image (uint8) of a rows x TILE_K_BYTES K-major operand tile."""
    image = np.empty(tile_bytes.size, np.uint8)
    image[kmajor_offsets(tile_bytes.shape[0], swizzle)] = tile_bytes
    return image


def _wgmma_kernel(n, swizzle, mma, a_from_registers):
    """One warpgroup: D[64 x n] (+)= A[64 x 128 B] @ B[n x 128 B]^T over K_STEPS chained wgmmas.
    ``image`` (u32) = A tile image then B tile image (A part unused when A is in registers);
    c / d[thread, i] = accumulator register i of warpgroup thread ``thread``; a_frag[s, thread]
    = the 4 A registers of K step s (register-A form); descriptors[0:2] = K-step-0 descriptors
    of A and B."""
    lbo, sbo, k_step = KMAJOR_DESCRIPTOR_PARAMS[swizzle]
    smem_words = (A_ROWS + n) * TILE_K_BYTES // 4
    load_acc = load_row(n // 2)

    def kernel(image, a_frag, c, d, scale_first, descriptors):
        smem = cuda.shared.array(smem_words, dtype=np.uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(tid, smem_words, hp.WGMMA_THREADS):
            smem[i] = image[i]
        cm.fence_proxy_async_shared_cta()  # st.shared -> async proxy (wgmma operand reads)
        cuda.syncthreads()
        a_base = cm.shared_address(smem)
        b_base = a_base + A_TILE_BYTES
        acc = load_acc(c, tid)
        hp.wgmma_fence()
        for s in range(K_STEPS):
            scale_d = scale_first if s == 0 else np.uint32(1)
            desc_b = hp.wgmma_smem_descriptor_device(b_base + s * k_step, lbo, sbo, swizzle)
            if a_from_registers:
                acc = mma(acc, LOAD_ROW_4(a_frag[s], tid), desc_b, scale_d)
            else:
                desc_a = hp.wgmma_smem_descriptor_device(a_base + s * k_step, lbo, sbo, swizzle)
                acc = mma(acc, desc_a, desc_b, scale_d)
        hp.wgmma_commit_group()
        hp.wgmma_wait_group_0()
        acc = hp.wgmma_fence_accumulators(acc)
        store_row(d, tid, acc)
        if tid == 0:
            descriptors[0] = hp.wgmma_smem_descriptor_device(a_base, lbo, sbo, swizzle)
            descriptors[1] = hp.wgmma_smem_descriptor_device(b_base, lbo, sbo, swizzle)

    kernel.__name__ = kernel.__qualname__ = (
        f"k_wgmma_{'rs' if a_from_registers else 'ss'}_n{n}_{swizzle}")
    return kernel


@functools.cache
def make_wgmma_ss_kernel(n: int, swizzle: str, dtype: str):
    """wgmma kernel with both operands in shared memory; dtype "bf16" or "e4m3"."""
    mma = hp.wgmma_bf16_ss(n) if dtype == "bf16" else hp.wgmma_e4m3_ss(n)
    return _wgmma_kernel(n, swizzle, mma, a_from_registers=False)


@functools.cache
def make_wgmma_rs_kernel(n: int, swizzle: str, dtype: str = "bf16"):
    """wgmma kernel with A from registers, B in shared memory; dtype "bf16" or "e4m3"."""
    mma = hp.wgmma_bf16_rs(n) if dtype == "bf16" else hp.wgmma_e4m3_rs(n)
    return _wgmma_kernel(n, swizzle, mma, a_from_registers=True)


SIG_WGMMA = (_u32_1d, _u32_3d, _f32_2d, _f32_2d, types.uint32, _u64_1d)

_WGMMA_N8 = hp.wgmma_bf16_ss(8)
_ZERO_N8 = hp.wgmma_zero_accumulators(8)


def k_wgmma_two_groups(out, desc_a, desc_b):
    """Compile-only: two commit groups started from zero accumulators, drained by wait_group 1
    then wait_group 0."""
    tid = cuda.threadIdx.x
    hp.wgmma_fence()
    first = _WGMMA_N8(_ZERO_N8(), desc_a, desc_b, 0)
    hp.wgmma_commit_group()
    second = _WGMMA_N8(_ZERO_N8(), desc_a + 2, desc_b + 2, 0)
    hp.wgmma_commit_group()
    hp.wgmma_wait_group_1()
    store_row(out, 2 * tid, hp.wgmma_fence_accumulators(first))
    hp.wgmma_wait_group_0()
    store_row(out, 2 * tid + 1, hp.wgmma_fence_accumulators(second))


# ---- setmaxnreg ------------------------------------------------------------------------------
SETMAXNREG_THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232
_DEC = hp.setmaxnreg_dec(PRODUCER_REGS)
_INC = hp.setmaxnreg_inc(CONSUMER_REGS)


def k_setmaxnreg(out):
    """Warpgroup 0 gives registers away, the others take more (the producer/consumer split)."""
    if cm.warp_index() < 4:
        _DEC()
    else:
        _INC()
    out[cuda.threadIdx.x] = cm.warp_index()


# =============================================================================================
# Compile once per session
# =============================================================================================
KERNELS = {
    "sync": (k_sync_family, SIG_SYNC),
    "grid_dependency": (k_grid_dependency, (_u32_1d,)),
    "cp_async": (k_cp_async, (_u32_1d, _u32_1d)),
    "nc_copy": (k_nc_copy, (_u32_1d, _u32_1d)),
    "tma_2d": (k_tma_2d, SIG_TMA_2D),
    "tma_family": (k_tma_family, SIG_TMA_FAMILY),
    "ldmatrix": (k_ldmatrix, SIG_LDMATRIX),
    "mma_bf16": (k_mma_bf16, SIG_MMA),
    "mma_e4m3": (k_mma_e4m3, SIG_MMA),
    "wgmma_bf16_n8_none": (make_wgmma_ss_kernel(8, "none", "bf16"), SIG_WGMMA),
    "wgmma_bf16_n256_128B": (make_wgmma_ss_kernel(256, "128B", "bf16"), SIG_WGMMA),
    "wgmma_e4m3_n64_128B": (make_wgmma_ss_kernel(64, "128B", "e4m3"), SIG_WGMMA),
    "wgmma_bf16_rs_n64_none": (make_wgmma_rs_kernel(64, "none"), SIG_WGMMA),
    "wgmma_e4m3_rs_n64_128B": (make_wgmma_rs_kernel(64, "128B", "e4m3"), SIG_WGMMA),
    "wgmma_two_groups": (k_wgmma_two_groups, (_f32_2d, types.uint64, types.uint64)),
}


@functools.cache
def _compiled(name: str, cc) -> tuple[bytes, str]:
    """(cubin, SASS) of KERNELS[name] for target cc."""
    pyfunc, sig = KERNELS[name]
    cubin = offline.compile_cubin(pyfunc, sig, cc)
    return cubin, offline.disassemble(cubin)


def sass(name, cc=SM90A) -> str:
    return _compiled(name, cc)[1]


def instructions_starting(sass_text, prefix):
    return [ins for ins in offline.sass_instructions(sass_text) if ins.startswith(prefix)]


BOTH_TARGETS = pytest.mark.parametrize("cc", [SM90A, SM100A], ids=["sm_90a", "sm_100a"])


# =============================================================================================
# SASS checks
# =============================================================================================
@BOTH_TARGETS
def test_mbarrier_sass(cc):
    ops = offline.sass_opcodes(sass("sync", cc))
    expected = {
        "SYNCS.EXCH.64",                     # mbarrier.init
        "SYNCS.ARRIVE.TRANS64.A1T0",         # mbarrier.arrive (count 1, no bytes)
        "SYNCS.ARRIVE.TRANS64",              # mbarrier.arrive.expect_tx
        "SYNCS.ARRIVE.TRANS64.RED.A0TR",     # mbarrier.expect_tx (no arrival)
        "SYNCS.ARRIVE.TRANS64.RED.A1T0",     # remote arrive.release.cluster.shared::cluster
        "SYNCS.PHASECHK.TRANS64.TRYWAIT",    # try_wait.parity (all three waits)
    }
    assert expected <= ops, sorted(expected - ops)


@BOTH_TARGETS
def test_common_and_cluster_sass(cc):
    text = sass("sync", cc)
    ops = offline.sass_opcodes(text)
    assert {"ELECT", "FENCE.VIEW.ASYNC.S", "BAR.ARV", "UCGABAR_ARV", "UCGABAR_WAIT"} <= ops
    assert any(op.startswith("BAR.SYNC") for op in ops)
    assert len(instructions_starting(text, "UCGABAR_WAIT")) == 2  # two cluster barriers
    # named barriers keep their ids (1: arrive with 64 threads, 2: sync)
    assert any(ins.startswith("BAR.ARV 0x1, 0x40") for ins in offline.sass_instructions(text))
    assert any(ins.startswith("BAR.SYNC") and " 0x2, 0x80" in ins for ins in offline.sass_instructions(text))
    sregs = " ".join(instructions_starting(text, "S2R") + instructions_starting(text, "S2UR"))
    assert "SR_LANEID" in sregs and "SR_CgaCtaId" in sregs


@BOTH_TARGETS
def test_grid_dependency_control_sass(cc):
    """griddepcontrol.wait is ACQBULK, launch_dependents PREEXIT, once each and in that order, before the store."""
    ins = offline.sass_instructions(sass("grid_dependency", cc))
    ops = [i.split()[0] for i in ins]
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    assert ops.index("ACQBULK") < ops.index("PREEXIT") < next(i for i, op in enumerate(ops) if op.startswith("STG"))


def test_mapa_reaches_the_ptx():
    ptx = offline.compile_ptx(k_sync_family, SIG_SYNC, SM90A)
    assert "mapa.shared::cluster.u32" in ptx
    assert "%warpid" not in ptx  # warp_index derives from %tid.x


def test_cp_async_sass():
    text = sass("cp_async")
    ops = offline.sass_opcodes(text)
    assert {"LDGSTS.E.128", "LDGSTS.E.BYPASS.128", "LDGDEPBAR", "DEPBAR.LE"} <= ops, sorted(ops)
    # two commit groups, plus the one cp.async.wait_all implies before waiting for zero
    assert len(instructions_starting(text, "LDGDEPBAR")) == 3
    assert instructions_starting(text, "DEPBAR.LE") == ["DEPBAR.LE SB0, 0x1", "DEPBAR.LE SB0, 0x0"]


def test_nc_load_is_one_128bit_readonly_load_each():
    text = sass("nc_copy")
    loads = instructions_starting(text, "LDG")
    assert len(loads) == NC_LOADS_IN_FLIGHT and all(
        ld.startswith("LDG.E.NA.128.CONSTANT") for ld in loads), loads
    assert not offline.uses_local_memory(text)


@BOTH_TARGETS
def test_tma_sass(cc):
    ops_2d = offline.sass_opcodes(sass("tma_2d", cc))
    assert {"UTMALDG.2D", "UTMASTG.2D", "UTMACCTL.PF", "UTMACCTL.IV", "SYNCS.EXCH.64",
            "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT"} <= ops_2d, sorted(ops_2d)
    text = sass("tma_family", cc)
    assert len(instructions_starting(text, "UTMALDG.2D.MULTICAST")) == 2
    assert len(instructions_starting(text, "UTMALDG.3D.MULTICAST")) == 1
    assert len([i for i in instructions_starting(text, "UTMALDG.3D") if "MULTICAST" not in i]) == 1
    assert "UTMACCTL.IV" in offline.sass_opcodes(text)


@BOTH_TARGETS
def test_ldmatrix_and_mma_bf16_sass(cc):
    ld = instructions_starting(sass("ldmatrix", cc), "LDSM")
    assert sorted(i.split()[0] for i in ld) == ["LDSM.16.M88.4", "LDSM.16.MT88.4"]
    text = sass("mma_bf16", cc)
    assert len(instructions_starting(text, "HMMA.16816.F32.BF16")) == 1
    assert not offline.uses_local_memory(text)


def test_mma_e4m3_is_emulated_with_fp16_hmma_on_sm90a():
    """sm_90a has no fp8 mma.sync: ptxas unpacks e4m3 pairs to f16x2 (8 A + 4 B registers) and
    issues two m16n8k16 fp16 HMMAs (K = 32 = 2 x 16)."""
    text = sass("mma_e4m3")
    assert len(instructions_starting(text, "F2FP.F16.E4M3.UNPACK_B")) == 12
    hmma = instructions_starting(text, "HMMA")
    assert [i.split()[0] for i in hmma] == ["HMMA.16816.F32"] * 2
    assert not any("QMMA" in op or "E4M3" in op for op in offline.sass_opcodes(text) if "MMA" in op)
    assert not offline.uses_local_memory(text)


@pytest.mark.parametrize("name, opcode, count", [
    ("wgmma_bf16_n8_none", "HGMMA.64x8x16.F32.BF16", K_STEPS),
    ("wgmma_bf16_n256_128B", "HGMMA.64x256x16.F32.BF16", K_STEPS),
    ("wgmma_e4m3_n64_128B", "QGMMA.64x64x32.F32.E4M3.E4M3", K_STEPS),
    ("wgmma_bf16_rs_n64_none", "HGMMA.64x64x16.F32.BF16", K_STEPS),
    ("wgmma_e4m3_rs_n64_128B", "QGMMA.64x64x32.F32.E4M3.E4M3", K_STEPS),
])
def test_wgmma_sass(name, opcode, count):
    text = sass(name)
    mma = [i for i in offline.sass_instructions(text) if "GMMA" in i.split()[0]]
    assert [i.split()[0] for i in mma] == [opcode] * count, mma
    ops = offline.sass_opcodes(text)
    assert {"WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE", "FENCE.VIEW.ASYNC.S"} <= ops
    assert not offline.uses_local_memory(text), "accumulators spilled to local memory"
    if "_rs_" in name:  # A operand is a register quad (R..), not a shared-memory descriptor (gdesc)
        assert all(i.split()[2].startswith("R") for i in mma), mma


@pytest.mark.parametrize("name", [n for n in KERNELS if n.startswith("wgmma")])
def test_wgmma_keeps_registers_and_does_not_serialize(name):
    """ptxas -v: no spills and no 'wgmma ... serialized' warning (ptxas prints one when it cannot
    keep the accumulators in place across the asynchronous wgmma chain)."""
    pyfunc, sig = KERNELS[name]
    ptx = offline.compile_ptx(pyfunc, sig, SM90A)
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([offline.find_cuda_tool("ptxas"), "-arch=sm_90a", "-v", path,
                              "-o", os.path.join(td, "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "serializ" not in res.stderr.lower(), res.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr
    usage = offline.resource_usage(_compiled(name, SM90A)[0])
    assert usage.local_bytes == 0
    if name == "wgmma_bf16_n256_128B":  # 128 accumulators per thread stay in registers
        assert 128 < usage.registers <= 255


def test_wgmma_wait_group_counts():
    text = sass("wgmma_two_groups")
    assert len(instructions_starting(text, "HGMMA.64x8x16.F32.BF16")) == 2
    assert instructions_starting(text, "WARPGROUP.DEPBAR.LE") == [
        "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert not offline.uses_local_memory(text)


def test_wgmma_rejected_for_sm100a():
    pyfunc, sig = KERNELS["wgmma_bf16_n8_none"]
    with pytest.raises(Exception, match="not supported on .target 'sm_100a'"):
        offline.compile_cubin(pyfunc, sig, SM100A)


def test_setmaxnreg_needs_launch_bounds():
    """Without launch bounds ptxas drops setmaxnreg silently: kernels that use it must be jitted
    with ``launch_bounds=(threads, 1)``."""
    bare = offline.disassemble(offline.compile_cubin(k_setmaxnreg, (_u32_1d,), SM90A))
    assert not offline.has_opcode(bare, "USETMAXREG")
    bounded = offline.disassemble(offline.compile_cubin(
        k_setmaxnreg, (_u32_1d,), SM90A, launch_bounds=(SETMAXNREG_THREADS, 1)))
    assert {"USETMAXREG.TRY_ALLOC.CTAPOOL", "USETMAXREG.DEALLOC.CTAPOOL"} <= offline.sass_opcodes(bounded)


def test_setmaxnreg_assembles_for_sm100a_too():
    """Unlike wgmma, setmaxnreg is not sm_90a-only (PTX ISA: sm_90a, sm_100a, ...)."""
    bounded = offline.disassemble(offline.compile_cubin(
        k_setmaxnreg, (_u32_1d,), SM100A, launch_bounds=(SETMAXNREG_THREADS, 1)))
    assert offline.has_opcode(bounded, "USETMAXREG")


def test_typing_errors_are_clear():
    def bad_mma(out):
        acc = hp.mma_bf16_m16n8k16((np.uint32(1),), (np.uint32(1), np.uint32(2)),
                                   (np.float32(0), np.float32(0), np.float32(0), np.float32(0)))
        out[0] = acc[0]

    with pytest.raises(TypeError, match="mma_bf16_m16n8k16: a must be UniTuple"):
        offline.compile_ptx(bad_mma, (types.Array(types.float32, 1, "C"),), SM90A)

    def bad_address(out, x):
        out[0] = cm.shared_address(x)

    with pytest.raises(TypeError, match="shared_address: expected a shared-memory array"):
        offline.compile_ptx(bad_address, (_u32_1d, types.uint32), SM90A)

    def bad_mbarrier(out, x):
        mb.mbarrier_init(x, 1)

    with pytest.raises(TypeError, match="mbarrier_init: argument 'mbar' must be an integer"):
        offline.compile_ptx(bad_mbarrier, (_u32_1d, types.float32), SM90A)


def test_factory_arguments_are_checked():
    for bad in (0, 12, 264, "64"):
        with pytest.raises(ValueError, match="multiple of 8 in 8..256"):
            hp.wgmma_bf16_ss(bad)
    with pytest.raises(ValueError):
        hp.wgmma_e4m3_ss(4)
    with pytest.raises(ValueError):
        hp.wgmma_bf16_rs(257)
    for bad in (16, 100, 264):
        with pytest.raises(ValueError, match="multiple of 8 in 24..256"):
            hp.setmaxnreg_inc(bad)
    with pytest.raises(ValueError, match="0..7"):
        hp.wgmma_wait_group(8)
    with pytest.raises(ValueError):
        cp.cp_async_wait_group(-1)
    with pytest.raises(ValueError):
        cp.bulk_wait_group_read(1.5)
    assert hp.wgmma_bf16_ss(64) is hp.wgmma_bf16_ss(64)  # cached per N
    assert hp.accumulator_type(256) == types.UniTuple(types.float32, 128)


# =============================================================================================
# Descriptor
# =============================================================================================
def test_descriptor_known_values():
    """The two descriptors the H200 probe used (and verified numerically)."""
    assert hp.wgmma_smem_descriptor(0x400, 128, 1024, "none") == 0x0000004000080040
    assert hp.wgmma_smem_descriptor(0x420, 16, 1024, "128B") == 0x4000004000010042


@pytest.mark.parametrize("swizzle, mode", list(hp.WGMMA_SWIZZLE_MODES.items()))
def test_descriptor_fields(swizzle, mode):
    rng = np.random.default_rng(7)
    for _ in range(200):
        start, lbo, sbo = (16 * int(x) for x in rng.integers(0, 1 << 14, 3))
        start += 16 * int(rng.integers(0, 1 << 14)) << 14  # bits above 18 are dropped
        d = hp.wgmma_smem_descriptor(start, lbo, sbo, swizzle)
        assert d >> 64 == 0
        assert d & 0x3FFF == (start & 0x3FFFF) >> 4
        assert (d >> 16) & 0x3FFF == lbo >> 4
        assert (d >> 32) & 0x3FFF == sbo >> 4
        assert (d >> 49) & 0x7 == 0                       # base offset
        assert d >> 62 == mode
        reserved = (0x3 << 14) | (0x3 << 30) | (0x7 << 46) | (0x3FF << 52)
        assert d & reserved == 0


def test_descriptor_rejects_bad_input():
    with pytest.raises(ValueError, match="swizzle must be one of"):
        hp.wgmma_smem_descriptor(0, 16, 1024, "256B")
    with pytest.raises(ValueError, match="lbo must be a multiple of 16"):
        hp.wgmma_smem_descriptor(0, 8, 1024, "none")
    with pytest.raises(ValueError, match="sbo must be a multiple of 16"):
        hp.wgmma_smem_descriptor(0, 16, 1 << 18, "none")
    with pytest.raises(ValueError, match="start_addr must be a 16-byte aligned"):
        hp.wgmma_smem_descriptor(0x408, 16, 1024, "none")
    with pytest.raises(TypeError, match="lbo must be an integer"):
        hp.wgmma_smem_descriptor(0, 16.0, 1024, "none")


@pytest.mark.parametrize("swizzle", list(hp.WGMMA_SWIZZLE_MODES))
def test_descriptor_advance_equals_the_descriptor_of_the_moved_address(swizzle):
    """Advancing a descriptor by n 16-byte units is the descriptor built at start + 16 n, for every shared
    address (the kernel's B-buffer and k16-step offsets stay below 228 KiB)."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        start = 16 * int(rng.integers(0, 228 * 1024 // 16))
        units = int(rng.integers(0, (228 * 1024 - start) // 16 + 1))
        lbo, sbo = 16 * int(rng.integers(0, 1 << 14)), 16 * int(rng.integers(0, 1 << 14))
        desc = hp.wgmma_smem_descriptor(start, lbo, sbo, swizzle)
        assert int(hp.wgmma_descriptor_advance(np.uint64(desc), units)) == \
            hp.wgmma_smem_descriptor(start + 16 * units, lbo, sbo, swizzle)


def test_descriptor_in_kernel_equals_host_value():
    """The kernel intrinsic folds to the host function's value for constant inputs."""
    def k(out, addr):
        out[0] = hp.wgmma_smem_descriptor_device(np.uint32(0x420), 16, 1024, "128B")
        out[1] = hp.wgmma_smem_descriptor_device(addr, 128, 1024, "none")

    ptx = offline.compile_ptx(k, (_u64_1d, types.uint32), SM90A)
    assert str(hp.wgmma_smem_descriptor(0x420, 16, 1024, "128B")) in ptx
    # the run-time descriptor: (addr & 0x3FFFF) >> 4 or'ed with the constant LBO/SBO fields
    assert str(hp.wgmma_smem_descriptor(0, 128, 1024, "none")) in ptx

    def bad(out, addr):
        out[0] = hp.wgmma_smem_descriptor_device(addr, 16, 1024, "256B")

    with pytest.raises(ValueError, match="swizzle must be one of"):
        offline.compile_ptx(bad, (_u64_1d, types.uint32), SM90A)


# =============================================================================================
# Canonical K-major layouts
# =============================================================================================
def wgmma_operand_read_model(image, start, lbo, sbo, swizzle, rows):
    """The bytes (rows x 32) a K-major wgmma operand reads for one K step, straight from the PTX
    ISA canonical layouts ("Shared Memory Matrix Layout"), for a 1024-B-aligned image:
    no swizzle ((8,m),(16 B,2)) : ((16 B, SBO), (1, LBO)); 128B swizzle ((8,m),(32 B)) :
    ((128 B, SBO), 1) then Swizzle<3,4,3> on the byte address (bits 4-6 ^= bits 7-9)."""
    r = np.arange(rows)[:, None]
    kbyte = np.arange(hp.K_STEP_BYTES)[None, :]
    if swizzle == "none":
        addr = start + (r // 8) * sbo + (r % 8) * 16 + (kbyte // 16) * lbo + kbyte % 16
    else:
        linear = start + (r // 8) * sbo + (r % 8) * 128 + kbyte
        addr = linear ^ (((linear >> 7) & 7) << 4)
    return image[addr]


@pytest.mark.parametrize("swizzle", ["none", "128B"])
@pytest.mark.parametrize("rows", [8, 64, 256])
def test_layout_is_what_wgmma_reads(swizzle, rows):
    rng = np.random.default_rng(rows)
    tile = rng.integers(0, 256, (rows, TILE_K_BYTES), dtype=np.uint8)
    image = smem_image(tile, swizzle)
    lbo, sbo, k_step = KMAJOR_DESCRIPTOR_PARAMS[swizzle]
    for s in range(K_STEPS):
        got = wgmma_operand_read_model(image, s * k_step, lbo, sbo, swizzle, rows)
        np.testing.assert_array_equal(got, tile[:, 32 * s:32 * s + 32])
    if swizzle == "none" and rows > 8:  # the model tells LBO from SBO: swapped, it reads wrong bytes
        swapped = wgmma_operand_read_model(image, 0, sbo, lbo, swizzle, rows)
        assert not np.array_equal(swapped, tile[:, :32])


@pytest.mark.parametrize("row_bytes", [32, 128, 256])
def test_interleave_offsets_are_a_bijection(row_bytes):
    rows = 64
    r = np.arange(rows)[:, None]
    kbyte = np.arange(row_bytes)[None, :]
    offsets = hp.kmajor_interleave_offset(r, kbyte, row_bytes)
    assert sorted(offsets.ravel().tolist()) == list(range(rows * row_bytes))
    # core matrices are 128 contiguous bytes; LBO apart along K, 8 * row_bytes apart along rows
    assert hp.kmajor_interleave_offset(0, 16, row_bytes) == hp.INTERLEAVE_LBO
    assert hp.kmajor_interleave_offset(8, 0, row_bytes) == 8 * row_bytes
    assert hp.kmajor_interleave_offset(0, 32, row_bytes) == hp.INTERLEAVE_K_STEP


def test_sw128_offsets_bijection_and_xor_rule():
    rows = 64
    r = np.arange(rows)[:, None]
    kbyte = np.arange(hp.SW128_ROW_BYTES)[None, :]
    offsets = hp.kmajor_sw128_offset(r, kbyte)
    assert sorted(offsets.ravel().tolist()) == list(range(rows * hp.SW128_ROW_BYTES))
    assert np.array_equal(offsets // 128, np.broadcast_to(r, offsets.shape))   # rows stay rows
    assert np.array_equal((offsets % 128) // 16, (kbyte // 16) ^ (r % 8))     # chunk c -> c ^ r%8
    assert np.array_equal(offsets % 16, np.broadcast_to(kbyte % 16, offsets.shape))
    linear = r * 128 + kbyte  # the same as an XOR of address bits 7-9 into bits 4-6
    assert np.array_equal(offsets, linear ^ (((linear >> 7) & 7) << 4))


# =============================================================================================
# Register fragment maps
# =============================================================================================
def _covers_once(positions, shape):
    seen = np.zeros(shape, int)
    for row, col in positions:
        seen[row, col] += 1
    return bool((seen == 1).all())


def test_mma_fragment_maps_are_bijections():
    lanes = range(32)
    assert _covers_once([hp.mma_m16n8_c_position(l, i) for l in lanes for i in range(4)], (16, 8))
    assert _covers_once([hp.mma_m16n8k16_a_position(l, i) for l in lanes for i in range(8)], (16, 16))
    assert _covers_once([hp.mma_m16n8k16_b_position(l, i) for l in lanes for i in range(4)], (16, 8))
    assert _covers_once([hp.mma_m16n8k32_a_position(l, i) for l in lanes for i in range(16)], (16, 32))
    assert _covers_once([hp.mma_m16n8k32_b_position(l, i) for l in lanes for i in range(8)], (32, 8))
    # lane 0 register 0 holds the first pair (k 0, 1) of row 0, as the PTX figures show
    assert [hp.mma_m16n8k16_a_position(0, i) for i in range(2)] == [(0, 0), (0, 1)]
    assert hp.mma_m16n8k32_a_position(5, 4) == (9, 4)  # register 1 = row + 8


@pytest.mark.parametrize("n", [8, 64, 256])
def test_wgmma_fragment_maps_are_bijections(n):
    threads = range(hp.WGMMA_THREADS)
    assert _covers_once([hp.wgmma_accumulator_position(t, i) for t in threads for i in range(n // 2)],
                        (hp.WGMMA_M, n))
    assert _covers_once([hp.wgmma_a_register_position(t, i) for t in threads for i in range(8)],
                        (hp.WGMMA_M, 16))


# =============================================================================================
# Tensor-map arguments (checked before the driver is touched)
# =============================================================================================
def test_tensor_map_arguments_are_checked():
    good = dict(global_address=1 << 20, dtype="uint8", dims=(512, 256), strides=(512,),
                box=(128, 64), swizzle="128B")
    assert cp.check_tensor_map_args(**good) == ("UINT8", 1)
    float_map = {**good, "dtype": np.dtype("float32"), "dims": (128, 256), "box": (32, 64)}
    assert cp.check_tensor_map_args(**float_map) == ("FLOAT32", 4)
    cases = [
        ({"dtype": "float64"}, "dtype 'float64' not supported"),
        ({"swizzle": "256B"}, "swizzle '256B' not supported"),
        ({"global_address": (1 << 20) + 8}, "16-byte aligned"),
        ({"strides": (500,)}, "multiple of 16"),
        ({"strides": (256,)}, "smaller than the 512 bytes"),
        ({"box": (128, 300)}, "box sizes must be in 1..256"),
        ({"box": (8, 64)}, "multiple of 16 B"),
        ({"box": (256, 64)}, "inner box extent <= 128 B"),
        ({"box": (128,)}, "need 2 box sizes"),
        ({"l2_promotion": "512B"}, "l2_promotion '512B' not supported"),
    ]
    from cuda.bindings import driver   # importable without a GPU: every name must be a driver enum member
    for promotion, suffix in cp.TENSOR_MAP_L2_PROMOTIONS.items():
        assert cp.check_tensor_map_args(**good, l2_promotion=promotion) == ("UINT8", 1)
        assert hasattr(driver.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{suffix}")
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            cp.check_tensor_map_args(**{**good, **change})
    with pytest.raises(TypeError, match="dims must be integers"):
        cp.check_tensor_map_args(**{**good, "dims": (512.0, 256)})
    # the encoder checks before importing the driver: no GPU needed to see the error
    with pytest.raises(ValueError, match="swizzle"):
        cp.encode_tensor_map_2d(1 << 20, "uint8", (512, 256), 512, (128, 64), swizzle="128")
    with pytest.raises(ValueError, match="need 3 box sizes"):
        cp.encode_tensor_map_3d(1 << 20, "bfloat16", (64, 32, 4), (128, 4096), (64, 32))
    with pytest.raises(ValueError, match="l2_promotion"):
        cp.encode_tensor_map_2d(1 << 20, "uint8", (512, 256), 512, (128, 64), l2_promotion="128")
    assert cp.tensor_map_box_bytes("bfloat16", (64, 32)) == 4096
