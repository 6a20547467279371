"""Offline checks of the shared-memory, register-arithmetic and bounded-wait intrinsics
(gbs.ptx_inline.shared, .arith, mbarrier.wait_parity*_or_trap, common.trap_if_nonzero), plus GPU
numerics of the same kernels (marked ``gpu``: they skip without a CUDA GPU).

Three tiny kernels are compiled for sm_90a through the launch path (NVVM -> LTO-IR -> nvJitLink)
and their SASS must hold what the PTX promises; the same kernels also assemble for sm_100a.
SASS seen with ptxas / nvJitLink 13.5 (asserted below):
  ld.shared.u32 / .v2 / .v4 LDS / LDS.64 / LDS.128; st.shared.v4 STS.128; prmt PRMT;
  fma.rn.bf16x2 HFMA2.MMA.BF16_V2 on sm_90a (HFMA2.BF16_V2 on sm_100a), with a -0 addend
  sometimes HMUL2.BF16_V2; cvt.rn.bf16.f32 and cvt.rn.bf16x2.f32 F2FP.BF16.F32.PACK_AB;
  cvt.rn.f16x2.e4m3x2 F2FP.F16.E4M3.UNPACK_B; cvt.f32.f16 HADD2.F32; the bounded wait: one
  SYNCS.PHASECHK.TRANS64.TRYWAIT, then a %globaltimer read (CS2R SR_GLOBALTIMERLO) and a retry
  loop of TRYWAIT + timer, ending in BPT.TRAP; its .acquire.cluster form adds a CCTL.IVALL
  (L1 invalidate: the cluster-scope acquire) to each try; trap BPT.TRAP.
"""
from __future__ import annotations

import functools
import re
import zlib

import ml_dtypes
import numpy as np
import pytest
from numba import cuda
from numba.cuda import types

from gbs.numba_kernels.simt import bf16_bits_rne
from gbs.ptx_inline import arith as ar
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline import offline
from gbs.ptx_inline import shared as sh

SM90A, SM100A = offline.SM90A, offline.SM100A

_u16_1d = types.Array(types.uint16, 1, "C")
_u32_1d = types.Array(types.uint32, 1, "C")
_f32_1d = types.Array(types.float32, 1, "C")


# =============================================================================================
# Kernels (one warp; the GPU tests below run them)
# =============================================================================================
THREADS = 32
WORDS_PER_THREAD = 4            # one 16-byte st.shared.v4 per thread
SHARED_WORDS = THREADS * WORDS_PER_THREAD
SHARED_OUT_WORDS = 7            # ld u32 + ld v2 + ld v4


def k_shared(src, dst):
    """Each thread stores src[4t:4t+4] with one st.shared.v4, then reads back word t (u32), words
    2t, 2t+1 (v2) and the 4 words of thread t ^ 1 (v4): dst[7t:7t+7] in that order."""
    smem = cuda.shared.array(SHARED_WORDS, dtype=np.uint32, alignment=16)
    t = cuda.threadIdx.x
    base = cm.shared_address(smem)
    w = WORDS_PER_THREAD * t
    sh.st_shared_v4_u32(base + 4 * w, src[w], src[w + 1], src[w + 2], src[w + 3])
    cuda.syncthreads()
    single = sh.ld_shared_u32(base + 4 * t)
    pair = sh.ld_shared_v2_u32(base + 8 * t)
    quad = sh.ld_shared_v4_u32(base + 16 * (t ^ 1))
    o = SHARED_OUT_WORDS * t
    dst[o] = single
    dst[o + 1] = pair[0]
    dst[o + 2] = pair[1]
    dst[o + 3] = quad[0]
    dst[o + 4] = quad[1]
    dst[o + 5] = quad[2]
    dst[o + 6] = quad[3]


def k_shared_f32(src, dst):
    """Each thread stores word src[t] with st.shared.u32, then reads word t ^ 1 back as an f32:
    dst[t] (the float whose bits are that word)."""
    smem = cuda.shared.array(THREADS, dtype=np.uint32, alignment=16)
    t = cuda.threadIdx.x
    base = cm.shared_address(smem)
    sh.st_shared_u32(base + 4 * t, src[t])
    cuda.syncthreads()
    dst[t] = sh.ld_shared_f32(base + 4 * (t ^ 1))


E4M3_LOG2_MULTIPLIER = 118      # the H200 kernel's UE4M3 scale pre-bias for E2M1 elements
E4M3_TO_BF16X2 = ar.e4m3x4_to_bf16x2(E4M3_LOG2_MULTIPLIER)
ARITH_OUT_WORDS = 4
E4M3_LANES = 8                  # lanes whose ``a`` carries chosen E4M3 bytes in the GPU test


def k_arith(a, b, c, floats, out, bf16_bits):
    """Thread t: out[4t:4t+4] = fma_bf16x2(a, b, c), prmt_b32(a, b, c), e4m3x4_to_bf16x2(a);
    bf16_bits[t] = f32_to_bf16_bits(floats[t])."""
    t = cuda.threadIdx.x
    x, y, z = a[t], b[t], c[t]
    o = ARITH_OUT_WORDS * t
    out[o] = ar.fma_bf16x2(x, y, z)
    out[o + 1] = ar.prmt_b32(x, y, z)
    lo, hi = E4M3_TO_BF16X2(x)
    out[o + 2] = lo
    out[o + 3] = hi
    bf16_bits[t] = ar.f32_to_bf16_bits(floats[t])


def k_waits(flags, parity):
    """The bounded waits, with and without the suspend hint, on phases that complete (every thread arrives once
    first), then trap_if_nonzero(flags[0]); flags[1 + t] = 1 when thread t got past all five."""
    bars = cuda.shared.array(2, dtype=np.uint64)
    local = cm.shared_address(bars)
    cluster_bar = cm.shared_element_address(bars, 1)
    if cuda.threadIdx.x == 0:
        mb.mbarrier_init(local, THREADS)
        mb.mbarrier_init(cluster_bar, THREADS)
        cm.fence_mbarrier_init_release_cluster()
    cuda.syncthreads()
    mb.mbarrier_arrive(local)
    mb.mbarrier_arrive(cluster_bar)
    mb.wait_parity_or_trap(local, parity)
    mb.wait_parity_cluster_or_trap(cluster_bar, parity)
    mb.spin_wait_parity_or_trap(local, parity)
    mb.spin_wait_parity_cluster_or_trap(cluster_bar, parity)
    cm.trap_if_nonzero(flags[0])
    flags[1 + cuda.threadIdx.x] = 1


def k_pure_unused(a, b, c, smem_offset, out):
    """Pure intrinsics with used and unused results; a shared load whose result is unused."""
    smem = cuda.shared.array(4, dtype=np.uint32, alignment=16)
    address = cm.shared_address(smem) + smem_offset
    out[0] = ar.fma_bf16x2(a, b, c)
    out[1] = ar.f32_to_bf16_bits(np.float32(a))
    ar.prmt_b32(a, b, c)                 # unused: deleted
    ar.fma_bf16x2(b, a, c)               # unused: deleted
    lo, hi = E4M3_TO_BF16X2(a)           # hi unused, lo used: the asm stays
    out[2] = lo
    sh.ld_shared_u32(address)            # unused, but a side effect: stays


SIG_SHARED = (_u32_1d, _u32_1d)
SIG_ARITH = (_u32_1d, _u32_1d, _u32_1d, _f32_1d, _u32_1d, _u16_1d)
SIG_WAITS = (_u32_1d, types.uint32)
SIG_PURE = (types.uint32, types.uint32, types.uint32, types.uint32, _u32_1d)

SIG_SHARED_F32 = (_u32_1d, _f32_1d)

KERNELS = {"shared": (k_shared, SIG_SHARED), "shared_f32": (k_shared_f32, SIG_SHARED_F32), "arith": (k_arith, SIG_ARITH),
           "waits": (k_waits, SIG_WAITS)}


@functools.cache
def sass(name: str, cc=SM90A) -> str:
    pyfunc, sig = KERNELS[name]
    return offline.disassemble(offline.compile_cubin(pyfunc, sig, cc))


def instructions_starting(sass_text, prefix):
    return [ins for ins in offline.sass_instructions(sass_text) if ins.startswith(prefix)]


def opcodes_starting(sass_text, prefix):
    return [ins.split()[0] for ins in instructions_starting(sass_text, prefix)]


# =============================================================================================
# SASS checks (sm_90a)
# =============================================================================================
def test_shared_loads_and_store_are_single_vector_instructions():
    text = sass("shared")
    assert opcodes_starting(text, "STS") == ["STS.128"]
    assert sorted(opcodes_starting(text, "LDS")) == ["LDS", "LDS.128", "LDS.64"]
    assert not offline.uses_local_memory(text)


def test_f32_load_and_u32_store_are_single_instructions():
    text = sass("shared_f32")
    assert opcodes_starting(text, "STS") == ["STS"]
    assert opcodes_starting(text, "LDS") == ["LDS"]
    assert not offline.uses_local_memory(text)


def test_arith_sass():
    text = sass("arith")
    ops = offline.sass_opcodes(text)
    assert opcodes_starting(text, "HFMA2") == ["HFMA2.MMA.BF16_V2"]
    assert opcodes_starting(text, "PRMT") == ["PRMT"]
    # e4m3x4: two byte-pair unpacks, four f16 -> f32, four multiplies by 2**118, two bf16x2 packs;
    # f32_to_bf16_bits: the third pack
    assert opcodes_starting(text, "F2FP.F16.E4M3.UNPACK_B") == ["F2FP.F16.E4M3.UNPACK_B"] * 2
    assert len(instructions_starting(text, "HADD2.F32")) == 4
    multiplies = instructions_starting(text, "FMUL")
    assert len(multiplies) == 4
    assert all(float(m.split(",")[-1]) == pytest.approx(2.0 ** E4M3_LOG2_MULTIPLIER) for m in multiplies)
    assert opcodes_starting(text, "F2FP.BF16.F32.PACK_AB") == ["F2FP.BF16.F32.PACK_AB"] * 3
    assert "STG.E.U16" in ops   # the u16 result of f32_to_bf16_bits
    assert not offline.uses_local_memory(text)


def test_fma_with_negative_zero_addend_may_become_a_multiply():
    """With c = -0 (the H200 kernel's scale multiply) ptxas may emit HMUL2.BF16_V2: same value."""
    def k_scale(words, out):
        t = cuda.threadIdx.x
        out[t] = ar.fma_bf16x2(words[t], words[t + THREADS], 0x80008000)

    text = offline.disassemble(offline.compile_cubin(k_scale, (_u32_1d, _u32_1d), SM90A))
    bf16_ops = [op for op in offline.sass_opcodes(text) if "BF16_V2" in op]
    assert len(bf16_ops) == 1 and bf16_ops[0] in {"HFMA2.MMA.BF16_V2", "HFMA2.BF16_V2", "HMUL2.BF16_V2"}


def test_bounded_waits_and_trap_sass():
    text = sass("waits")
    # each wait: a first try, then the timed retry loop's try
    assert len(instructions_starting(text, "SYNCS.PHASECHK.TRANS64.TRYWAIT")) == 8
    timers = instructions_starting(text, "CS2R")
    assert len(timers) == 8 and all("SR_GLOBALTIMER" in ins for ins in timers)
    # four timeout traps and trap_if_nonzero's
    assert len(instructions_starting(text, "BPT.TRAP")) == 5
    assert len(instructions_starting(text, "CCTL.IVALL")) == 4   # only the cluster-acquire waits' tries
    # the suspend hint: one sleep per hinted try, none in the spin waits
    sleeps = [ins for ins in offline.sass_instructions(text) if "NANOSLEEP" in ins]
    assert len(sleeps) == 4 and all(f"{mb.SUSPEND_TIME_HINT_NS:#x}" in ins for ins in sleeps)


def test_bounded_wait_ptx():
    ptx = offline.compile_ptx(*KERNELS["waits"], SM90A)
    assert ptx.count("mbarrier.try_wait.parity.shared::cta.b64") == 4
    assert ptx.count("mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64") == 4
    tries = re.findall(r"mbarrier\.try_wait\.parity\S* done, \[[^]]+\], [^;]+;", ptx)
    hinted = [t for t in tries if t.endswith(f", {mb.SUSPEND_TIME_HINT_NS};")]
    assert len(tries) == 8 and len(hinted) == 4   # the spin waits' tries end at the parity
    assert ptx.count(f"setp.lt.u64 again, now, {mb.WAIT_TIMEOUT_NS};") == 4
    assert ptx.count("%globaltimer") == 8
    assert len(re.findall(r"^\s*trap;", ptx, re.M)) == 4
    assert "@p trap;" in ptx


def test_pure_intrinsics_with_unused_results_are_deleted_loads_are_not():
    """Pure asm whose result is unused disappears from the PTX; the shared load (side-effect asm,
    so that no load is dropped or moved across the barriers that order it) stays."""
    ptx = offline.compile_ptx(k_pure_unused, SIG_PURE, SM90A)
    assert ptx.count("fma.rn.bf16x2") == 1
    assert ptx.count("cvt.rn.bf16.f32") == 1
    assert ptx.count("prmt.b32") == 0
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2
    assert ptx.count("ld.shared.u32") == 1


@pytest.mark.parametrize("name, opcodes", [
    ("shared", {"STS.128", "LDS", "LDS.64", "LDS.128"}),
    ("arith", {"HFMA2.BF16_V2", "PRMT", "F2FP.F16.E4M3.UNPACK_B", "F2FP.BF16.F32.PACK_AB"}),
    ("waits", {"SYNCS.PHASECHK.TRANS64.TRYWAIT", "BPT.TRAP", "CCTL.IVALL"}),
])
def test_assembles_for_sm100a(name, opcodes):
    ops = offline.sass_opcodes(sass(name, SM100A))
    assert opcodes <= ops, sorted(opcodes - ops)


# =============================================================================================
# Factory and typing errors
# =============================================================================================
@pytest.mark.parametrize("log2_multiplier, immediate", [(118, "0f7A800000"), (0, "0f3F800000"),
                                                        (-126, "0f00800000"), (127, "0f7F000000")])
def test_e4m3_multiplier_is_the_f32_power_of_two(log2_multiplier, immediate):
    convert = ar.e4m3x4_to_bf16x2(log2_multiplier)
    assert f"mul.f32 f0, f0, {immediate};" in convert.__doc__
    assert ar.e4m3x4_to_bf16x2(np.int64(log2_multiplier)) is convert   # one intrinsic per value


def test_e4m3_factory_rejects_bad_multipliers():
    for bad in (-127, 128):
        with pytest.raises(ValueError, match=r"outside -126\.\.127"):
            ar.e4m3x4_to_bf16x2(bad)
    for bad in (1.0, True, "118"):
        with pytest.raises(TypeError, match="log2_multiplier must be an integer"):
            ar.e4m3x4_to_bf16x2(bad)


def test_pure_ptx_intrinsic_needs_a_result():
    with pytest.raises(ValueError, match="a pure intrinsic needs a result"):
        cm.ptx_intrinsic("no_result", "prmt.b32 $0, $0, $0, $0;", [("a", "u32")], pure=True, doc="bad")


def test_typing_errors_are_clear():
    def bad_vector_load(out, x):
        out[0] = sh.ld_shared_v4_u32(x)[0]

    with pytest.raises(TypeError, match="ld_shared_v4_u32: smem must be an integer"):
        offline.compile_ptx(bad_vector_load, (_u32_1d, types.float32), SM90A)

    def bad_fma(out, x):
        out[0] = ar.fma_bf16x2(x, 1, 2)

    with pytest.raises(TypeError, match="fma_bf16x2: argument 'a' must be an integer"):
        offline.compile_ptx(bad_fma, (_u32_1d, types.float32), SM90A)

    def bad_convert(out, x):
        out[0] = E4M3_TO_BF16X2(x)[0]

    with pytest.raises(TypeError, match="e4m3x4_to_bf16x2: word must be an integer"):
        offline.compile_ptx(bad_convert, (_u32_1d, types.float32), SM90A)

    def bad_round(out, x):
        out[0] = ar.f32_to_bf16_bits(x)

    with pytest.raises(TypeError, match="f32_to_bf16_bits: argument 'value' must be a float"):
        offline.compile_ptx(bad_round, (_u16_1d, types.uint32), SM90A)


# =============================================================================================
# Host references for the GPU numerics (checked here on values the PTX ISA spells out)
# =============================================================================================
def prmt_reference(a: int, b: int, selector: int) -> int:
    """prmt.b32 default mode: byte i = byte (s & 7) of b:a, or its sign replicated when s & 8."""
    source = (b << 32) | a
    result = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        result |= byte << (8 * i)
    return result


def test_prmt_reference():
    a, b = 0x83828180, 0x07060504
    assert prmt_reference(a, b, 0x3210) == a
    assert prmt_reference(a, b, 0x7654) == b
    assert prmt_reference(a, b, 0x5140) == 0x05810480
    assert prmt_reference(a, b, 0x8888) == 0xFFFFFFFF   # byte 0 = 0x80: sign set
    assert prmt_reference(a, b, 0xCCCC) == 0            # byte 4 = 0x04: sign clear


def bf16_words(rng, count, low, high):
    """(u32 words, float64 values (count, 2)) of two random integers in [low, high) each, rounded to
    bf16 (exact when |x| <= 256); value [:, 0] is the low half of the word."""
    bits = rng.integers(low, high, (count, 2)).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    words = bits[:, 0].astype(np.uint32) | (bits[:, 1].astype(np.uint32) << 16)
    return words, bits.view(ml_dtypes.bfloat16).astype(np.float64)


# =============================================================================================
# GPU numerics (H200 / any sm_90+ GPU)
# =============================================================================================
@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.gpu
def test_shared_round_trip_on_gpu(rng):
    src = rng.integers(0, 2 ** 32, SHARED_WORDS, dtype=np.uint64).astype(np.uint32)
    dst = np.full(THREADS * SHARED_OUT_WORDS, 0xDEADBEEF, np.uint32)
    d_dst = cuda.to_device(dst)
    cuda.jit(k_shared)[1, THREADS](cuda.to_device(src), d_dst)
    out = d_dst.copy_to_host().reshape(THREADS, SHARED_OUT_WORDS)
    t = np.arange(THREADS)
    np.testing.assert_array_equal(out[:, 0], src[t])
    np.testing.assert_array_equal(out[:, 1:3], src[:2 * THREADS].reshape(THREADS, 2))
    np.testing.assert_array_equal(out[:, 3:7], src.reshape(THREADS, WORDS_PER_THREAD)[t ^ 1])


@pytest.mark.gpu
def test_shared_f32_round_trip_on_gpu(rng):
    src = rng.standard_normal(THREADS).astype(np.float32).view(np.uint32)
    d_dst = cuda.to_device(np.full(THREADS, np.nan, np.float32))
    cuda.jit(k_shared_f32)[1, THREADS](cuda.to_device(src), d_dst)
    np.testing.assert_array_equal(d_dst.copy_to_host().view(np.uint32), src[np.arange(THREADS) ^ 1])


@pytest.mark.gpu
def test_arith_on_gpu(rng):
    a, a_values = bf16_words(rng, THREADS, -256, 257)
    b, b_values = bf16_words(rng, THREADS, -256, 257)
    c, c_values = bf16_words(rng, THREADS, -2 ** 15, 2 ** 15)
    # the first lanes' a words are E4M3 test bytes (incl. the NaNs 0x7F, 0xFF), not bf16 integers
    a[:E4M3_LANES] = np.arange(E4M3_LANES, dtype=np.uint32) * 0x01020304 + 0x7F7E00FF
    floats = rng.standard_normal(THREADS).astype(np.float32) * np.float32(2.0 ** 60)
    floats[:7] = [3.4e38, -3.4e38, np.inf, -np.inf, 0.0, -0.0, np.nan]   # overflow to +-Inf, signed zeros
    out = np.full(THREADS * ARITH_OUT_WORDS, 0xDEADBEEF, np.uint32)
    bits = np.full(THREADS, 0xBEEF, np.uint16)
    d_out, d_bits = cuda.to_device(out), cuda.to_device(bits)
    cuda.jit(k_arith)[1, THREADS](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c),
                                  cuda.to_device(floats), d_out, d_bits)
    out = d_out.copy_to_host().reshape(THREADS, ARITH_OUT_WORDS)
    bits = d_bits.copy_to_host()

    # fma on the integer lanes: a * b + c is an integer below 2**17, exact in f32, so one RNE
    # of it to bf16 is the reference
    lanes = slice(E4M3_LANES, THREADS)
    exact = (a_values[lanes].astype(np.float64) * b_values[lanes] + c_values[lanes]).astype(np.float32)
    ref = [bf16_bits_rne(int(x)) for x in exact.view(np.uint32).ravel()]
    np.testing.assert_array_equal(out[lanes, 0].copy().view(np.uint16), np.array(ref, np.uint16))

    assert [int(x) for x in out[:, 1]] == [prmt_reference(int(x), int(y), int(z)) for x, y, z in zip(a, b, c)]

    e4m3 = a.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** E4M3_LOG2_MULTIPLIER
    converted = out[:, 2:4].copy().view(ml_dtypes.bfloat16).astype(np.float64).ravel()
    nan = np.isnan(e4m3)
    assert np.array_equal(np.isnan(converted), nan) and nan.sum() >= 2
    np.testing.assert_array_equal(converted[~nan], e4m3[~nan])

    finite = ~np.isnan(floats)
    np.testing.assert_array_equal(bits[finite], [bf16_bits_rne(int(x)) for x in floats[finite].view(np.uint32)])
    assert np.isnan(bits[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()


@pytest.mark.gpu
def test_bounded_waits_pass_completed_phases_on_gpu():
    flags = np.zeros(1 + THREADS, np.uint32)
    d_flags = cuda.to_device(flags)
    cuda.jit(k_waits)[1, THREADS](d_flags, 0)
    np.testing.assert_array_equal(d_flags.copy_to_host()[1:], 1)
