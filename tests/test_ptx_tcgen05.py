"""The Blackwell tcgen05 family: descriptor bit fields against the PTX ISA, and every intrinsic
form assembled for sm_100a (ptxas through nvJitLink) with the SASS it must produce.

No GPU is needed (or used): kernels are compiled offline with ``offline.compile_cubin`` once per
session (``functools.cache``) and only their SASS is inspected.
"""
from __future__ import annotations

import functools
import itertools

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda
from numba.cuda import types

from gbs import formats
from gbs.ptx_inline import offline
from gbs.ptx_inline.common import shared_address
from gbs.ptx_inline import sm100_descriptors as d
from gbs.ptx_inline import tcgen05

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1


# ==============================================================================================
# Instruction descriptor
# ==============================================================================================
# Hand-computed from the ISA tables (bit positions in the comments).
HAND_IDESCS = [
    # NVFP4 M128 N8: atype E2M1=1 @7, btype 1 @10, N>>3=1 @17, UE4M3=0 @23, M>>7=1 @27
    (dict(kind="mxf4nvf4", m=128, n=8, a_format="e2m1", b_format="e2m1", scale_type="ue4m3"),
     (1 << 7) | (1 << 10) | (1 << 17) | (1 << 27), 0x08020480),
    # MXFP8 M256 N128: E4M3=0, N>>3=16 @17, UE8M0=1 @23, M>>7=2 @27
    (dict(kind="mxf8f6f4", m=256, n=128, a_format="e4m3", b_format="e4m3", scale_type="ue8m0"),
     (16 << 17) | (1 << 23) | (2 << 27), 0x10A00000),
    # W4A8 M128 N16: atype E2M1=5 @7, btype E4M3=0, SFA_ID=3 @29, SFB_ID=1 @4
    (dict(kind="mxf8f6f4", m=128, n=16, a_format="e2m1", b_format="e4m3", scale_type="ue8m0",
          a_sf_id=3, b_sf_id=1),
     (1 << 4) | (5 << 7) | (2 << 17) | (1 << 23) | (1 << 27) | (3 << 29), 0x68840290),
    # MXFP4 M256 N256: E2M1=1, N>>3=32 @17, UE8M0 @23, M>>7=2 @27, SF IDs 2 and 2
    (dict(kind="mxf4", m=256, n=256, a_format="e2m1", b_format="e2m1", scale_type="ue8m0",
          a_sf_id=2, b_sf_id=2),
     (2 << 4) | (1 << 7) | (1 << 10) | (32 << 17) | (1 << 23) | (2 << 27) | (2 << 29), 0x50C004A0),
]


@pytest.mark.parametrize("fields, from_bits, expected", HAND_IDESCS, ids=lambda x: None)
def test_instr_desc_hand_computed(fields, from_bits, expected):
    assert from_bits == expected   # the hex literal and the bit sum are the same statement
    desc = d.BlockScaledInstrDesc(**fields)
    assert desc.encode() == expected
    assert d.BlockScaledInstrDesc.decode(expected, fields["kind"]) == desc


@pytest.mark.parametrize("m", [128, 256])
def test_instr_desc_m_field_matches_spec_encoding(m):
    """kernels.md / CUTLASS write M >> 4 at [24, 29); the ISA reserves 24-26 and puts M >> 7 at
    [27, 29). For the legal M values they are the same bits."""
    idesc = d.BlockScaledInstrDesc("mxf4nvf4", m, 64, "e2m1", "e2m1", "ue4m3").encode()
    assert idesc & (0x1F << 24) == (m >> 4) << 24


def _valid_descs():
    cases = []
    for kind in d.BLOCK_SCALED_KINDS.values():
        for a_fmt, b_fmt in itertools.product(kind.formats, repeat=2):
            for scale, a_major, b_major in itertools.product(
                    kind.scale_types, ("k", "mn") if a_fmt in kind.mn_major_formats else ("k",),
                    ("k", "mn") if b_fmt in kind.mn_major_formats else ("k",)):
                cases.append((kind, a_fmt, b_fmt, scale, a_major, b_major))
    return cases


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(_valid_descs()), m=st.sampled_from([128, 256]),
       n=st.sampled_from(range(8, 257, 8)), data=st.data(),
       negate_a=st.booleans(), negate_b=st.booleans())
def test_instr_desc_round_trip(case, m, n, data, negate_a, negate_b):
    kind, a_fmt, b_fmt, scale, a_major, b_major = case
    a_sf_id = data.draw(st.sampled_from(kind.scale_factor_ids))
    b_sf_id = data.draw(st.sampled_from(kind.scale_factor_ids))
    desc = d.BlockScaledInstrDesc(kind.name, m, n, a_fmt, b_fmt, scale, a_sf_id, b_sf_id,
                                  a_major, b_major, negate_a, negate_b)
    value = desc.encode()
    assert 0 <= value <= MASK32
    assert d.BlockScaledInstrDesc.decode(value, kind.name) == desc
    # the per-MMA scale-factor IDs can be swapped in without re-encoding
    other = d.with_scale_factor_ids(value, kind.scale_factor_ids[-1], kind.scale_factor_ids[0])
    assert other == d.BlockScaledInstrDesc(kind.name, m, n, a_fmt, b_fmt, scale, kind.scale_factor_ids[-1],
                                           kind.scale_factor_ids[0], a_major, b_major,
                                           negate_a, negate_b).encode()


BASE = dict(kind="mxf4nvf4", m=128, n=64, a_format="e2m1", b_format="e2m1", scale_type="ue4m3")


@pytest.mark.parametrize("change, message", [
    (dict(kind="mxf4", a_format="e4m3", scale_type="ue8m0"), "a_format"),
    (dict(kind="mxf8f6f4", a_format="e2m1", b_format="e4m3"), "scale_type"),   # UE4M3 needs mxf4nvf4
    (dict(kind="mxf4", scale_type="ue4m3"), "scale_type"),
    (dict(kind="f16"), "unknown block-scaled MMA kind"),
    (dict(m=64), "M must be 128 or 256"),
    (dict(m=192), "M must be 128 or 256"),
    (dict(n=12), "N must be a multiple of 8"),
    (dict(n=264), "N must be a multiple of 8"),
    (dict(n=0), "N must be a multiple of 8"),
    (dict(a_sf_id=2), "a_sf_id"),                      # 4X: the whole word, ID 0 only
    (dict(kind="mxf4", scale_type="ue8m0", b_sf_id=1), "b_sf_id"),   # 2X: 0 or 2
    (dict(kind="mxf8f6f4", a_format="e4m3", b_format="e4m3", scale_type="ue8m0", a_sf_id=4), "a_sf_id"),
    (dict(a_major="mn"), "a_major 'mn' is not supported for e2m1"),
    (dict(kind="mxf8f6f4", a_format="e2m1", b_format="e4m3", scale_type="ue8m0", a_major="mn"), "a_major"),
    (dict(b_major="row"), "b_major"),
    (dict(negate_a=1), "negate_a must be a bool"),
])
def test_instr_desc_rejects_illegal_fields(change, message):
    with pytest.raises(ValueError, match=message):
        d.BlockScaledInstrDesc(**{**BASE, **change}).encode()


def test_instr_desc_mn_major_fp8_is_legal():
    desc = d.BlockScaledInstrDesc("mxf8f6f4", 128, 32, "e4m3", "e5m2", "ue8m0", a_major="mn", b_major="mn")
    value = desc.encode()
    assert value >> 15 & 1 and value >> 16 & 1 and (value >> 10) & 7 == 1


@pytest.mark.parametrize("value, kind, message", [
    (0x08020480 | 1 << 2, "mxf4nvf4", "sparsity"),
    (0x08020480 | 1 << 31, "mxf4nvf4", "bit 31"),
    (0x08020480 | 1 << 25, "mxf4nvf4", "reserved bits"),      # 24-26 reserved: M is M >> 7 only
    (0x08020480 | 1 << 6, "mxf4nvf4", "reserved bits"),
    (0x08020480 | 1 << 12, "mxf4nvf4", "b_format code 5"),    # bit 12 reserved for mxf4*
    (0x08020480, "mxf8f6f4", "scale_type must be one of"),    # UE4M3 is not an mxf8f6f4 scale
    (0x08020480 | 1 << 29, "mxf4nvf4", "a_sf_id"),             # 4X reads the whole word: ID 0
    (0x08020480 | 0b11 << 27, "mxf4nvf4", "M must be 128 or 256"),
    (1 << 32, "mxf4", "32-bit"),
])
def test_instr_desc_decode_rejects(value, kind, message):
    with pytest.raises(ValueError, match=message):
        d.BlockScaledInstrDesc.decode(value, kind)


def test_kind_table_matches_formats_and_spec():
    """Block sizes of the kinds equal the formats' (gbs.quant); a 128-byte K slice of a stage is
    4 MMAs for every kind (kernels.md); mxf8f6f4 format codes as kernels.md lists them."""
    pairs = {"mxf4nvf4": "nvfp4", "mxf4": "mxfp4", "mxf8f6f4": "mxfp8"}
    for kind_name, fmt_name in pairs.items():
        kind, fmt = d.get_kind(kind_name), formats.get_format(fmt_name)
        assert kind.block_size == fmt.block_size
        assert fmt.scale_dtype in kind.scale_types
        assert 128 // fmt.row_bytes(kind.k_per_mma) == 4
    mxf8 = d.get_kind("mxf8f6f4")
    assert (mxf8.formats["e4m3"], mxf8.formats["e5m2"], mxf8.formats["e2m1"]) == (0, 1, 5)
    assert d.get_kind("mxf4").formats == d.get_kind("mxf4nvf4").formats == {"e2m1": 1}


# ==============================================================================================
# Shapes
# ==============================================================================================
@pytest.mark.parametrize("kind", sorted(d.BLOCK_SCALED_KINDS))
def test_mma_shapes(kind):
    for n in range(8, 257, 8):
        d.check_mma_shape(kind, 1, 128, n)
    for m, n in itertools.product((128, 256), range(16, 257, 16)):
        d.check_mma_shape(kind, 2, m, n)
    assert len(d.legal_mma_n_values(1)) == 32 and len(d.legal_mma_n_values(2)) == 16
    for cta_group, m, n, message in [(1, 256, 64, "M must be one of"), (1, 64, 64, "M must be one of"),
                                     (2, 64, 64, "M must be one of"), (1, 128, 4, "multiple of 8"),
                                     (1, 128, 264, "multiple of 8"), (2, 256, 24, "multiple of 16"),
                                     (2, 256, 8, "multiple of 16"), (3, 128, 64, "cta_group")]:
        with pytest.raises(ValueError, match=message):
            d.check_mma_shape(kind, cta_group, m, n)


# ==============================================================================================
# Shared-memory descriptor
# ==============================================================================================
def test_smem_descriptor_hand_computed():
    # K-major 128B-swizzled tile at 0x400: LBO 16 (unused), SBO 1024 (8 rows x 128 B)
    value = d.SmemDescriptor(0x400, 16, 1024, d.SWIZZLE_128B).encode()
    assert value == (0x40 | 1 << 16 | 64 << 32 | 1 << 46 | 2 << 61) == 0x4000404000010040
    # a 128x4 scale atom for tcgen05.cp: 32 rows of 16 B, SBO 128 (8 rows), no swizzle
    assert d.SmemDescriptor(0x200, 0, 128).encode() == (0x20 | 8 << 32 | 1 << 46) == 0x0000400800000020
    # address bits above 18 are dropped by matrix-descriptor-encode
    assert d.encode_smem_descriptor(0x40400, 16, 1024, d.SWIZZLE_128B, 0, 0) & 0x3FFF == 0x40


@pytest.mark.parametrize("sm90_mode, sm100_mode",
                         [(1, d.SWIZZLE_128B), (2, d.SWIZZLE_64B), (3, d.SWIZZLE_32B)])
def test_swizzle_encoding_is_sm90_shifted(sm90_mode, sm100_mode):
    """SM90 wgmma puts 1/2/3 (128B/64B/32B) in bits 62-63 (kernels.md, verified on the H200);
    SM100's 3-bit field at 61-63 holds the same bits: 2/4/6."""
    assert sm100_mode << 61 == sm90_mode << 62


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 0x3FFF), lbo=st.integers(0, 0x3FFF), sbo=st.integers(0, 0x3FFF),
       swizzle=st.sampled_from(sorted(d.SWIZZLE_MODES.values())), base=st.integers(0, 7),
       lbo_mode=st.integers(0, 1))
def test_smem_descriptor_round_trip(start, lbo, sbo, swizzle, base, lbo_mode):
    base = base if swizzle else 0
    desc = d.SmemDescriptor(start << 4, lbo << 4, sbo << 4, swizzle, base, lbo_mode)
    value = desc.encode()
    assert 0 <= value <= MASK64 and (value >> 46) & 7 == 0b001
    assert d.SmemDescriptor.decode(value) == desc


@pytest.mark.parametrize("fields, message", [
    (dict(start_address=0x408), "start_address must be a multiple of 16"),
    (dict(start_address=0x40000), "start_address"),
    (dict(leading_byte_offset=-16), "leading_byte_offset"),
    (dict(stride_byte_offset=1000), "stride_byte_offset"),
    (dict(swizzle=3), "swizzle must be one of"),
    (dict(swizzle=d.SWIZZLE_NONE, base_offset=1), "base_offset"),
    (dict(base_offset=8), "base_offset"),
    (dict(lbo_mode=2), "lbo_mode"),
])
def test_smem_descriptor_rejects(fields, message):
    good = dict(start_address=0x400, leading_byte_offset=16, stride_byte_offset=1024, swizzle=d.SWIZZLE_128B)
    with pytest.raises(ValueError, match=message):
        d.SmemDescriptor(**{**good, **fields}).encode()


@pytest.mark.parametrize("value, message", [
    (0x4000004000010040, "bits 46-48 must be 0b001"),             # an SM90-style descriptor
    (0x4000404000010040 | 1 << 14, "fixed-zero bits"),
    (0x4000404000010040 | 1 << 55, "fixed-zero bits"),
    (1 << 64, "64-bit"),
])
def test_smem_descriptor_decode_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        d.SmemDescriptor.decode(value)


def test_swizzle_base_offset():
    assert d.swizzle_base_offset(0x800, d.SWIZZLE_128B) == 0
    assert d.swizzle_base_offset(0x880, d.SWIZZLE_128B) == 1
    assert d.swizzle_base_offset(0x300, d.SWIZZLE_64B) == 6
    with pytest.raises(ValueError, match="swizzle"):
        d.swizzle_base_offset(0x800, d.SWIZZLE_NONE)


# ==============================================================================================
# Tensor memory
# ==============================================================================================
def test_tmem_address():
    assert d.tmem_address(32, 64) == 0x00200040
    assert (d.tmem_lane(0x00600010), d.tmem_column(0x00600010)) == (96, 16)
    for ncols in (32, 64, 128, 256, 512):
        assert d.check_tmem_alloc_columns(ncols) == ncols
    for ncols in (0, 16, 48, 96, 1024, 32.0):
        with pytest.raises(ValueError, match="power of 2"):
            d.check_tmem_alloc_columns(ncols)


def test_scale_atom_tmem_cells_follow_the_128x4_layout():
    """A 512-byte atom read as 32 rows of 16 bytes (tcgen05.cp 32x128b): byte ``off`` of the
    atom lands in lane off // 16, column off % 16 // 4, byte off % 4 - the cell our helper names."""
    cells = set()
    for row, col in itertools.product(range(formats.SF_ATOM_ROWS), range(formats.SF_ATOM_COLS)):
        off = formats.scale_offset(row, col, formats.SF_ATOM_COLS)
        cell = d.scale_atom_tmem_cell(row, col)
        assert cell == ((off % 16) // 4, off // 16, off % 4)
        cells.add(cell)
    assert len(cells) == formats.SF_ATOM_BYTES
    assert list(d.scale_atom_tmem_columns(8)) == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="atom coordinates"):
        d.scale_atom_tmem_cell(128, 0)


@pytest.mark.parametrize("kind, expected", [
    ("mxf4nvf4", [(0, 0), (4, 0), (8, 0), (12, 0)]),   # one atom per MMA (kernels.md)
    ("mxf4", [(0, 0), (0, 2), (4, 0), (4, 2)]),
    ("mxf8f6f4", [(0, 0), (0, 1), (0, 2), (0, 3)]),    # one atom per 128-byte K slice
])
def test_mma_scale_position(kind, expected):
    positions = [d.mma_scale_position(kind, i) for i in range(4)]
    assert positions == expected
    assert all(sf_id in d.get_kind(kind).scale_factor_ids for _, sf_id in positions)


def test_encoders_compile_in_nopython_mode():
    """The kernel-side encoders are integer-only: Numba compiles them and gets the same bits
    (the SASS tests below also call them inside sm_100a kernels)."""
    smem = numba.njit(d.encode_smem_descriptor)
    assert smem(np.uint32(0x400), 16, 1024, d.SWIZZLE_128B, 0, 0) & MASK64 == 0x4000404000010040
    assert smem(np.uint64(0x400), np.uint64(16), np.uint64(1024), np.uint64(d.SWIZZLE_32B), 0, 0) & MASK64 \
        == d.SmemDescriptor(0x400, 16, 1024, d.SWIZZLE_32B).encode()
    idesc = numba.njit(d.encode_block_scaled_instr_desc)
    assert idesc(5, 0, 0, 0, 0, 0, 128, 16, 1, 3, 1) & MASK32 == 0x68840290
    sf_ids = numba.njit(d.with_scale_factor_ids)
    assert sf_ids(np.uint32(0x68840290), 0, 0) & MASK32 == 0x08840280
    assert numba.njit(d.tmem_address)(np.uint32(32), np.uint32(64)) == 0x00200040


# ==============================================================================================
# Intrinsics: factory checks
# ==============================================================================================
@pytest.mark.parametrize("make, args, message", [
    (tcgen05.alloc, (3,), "cta_group"),
    (tcgen05.commit, (0,), "cta_group"),
    (tcgen05.mma_block_scaled, ("f16", 1), "unknown block-scaled MMA kind"),
    (tcgen05.mma_block_scaled, ("mxf4", 4), "cta_group"),
    (tcgen05.ld_32x32b, (3,), "count must be one of"),
    (tcgen05.ld_32x32b, (4, "f16"), "element must be one of"),
    (tcgen05.st_32x32b, (256,), "count must be one of"),
])
def test_factories_reject_bad_parameters(make, args, message):
    with pytest.raises(ValueError, match=message):
        make(*args)


def test_mma_ptx_qualifiers():
    """NVFP4 needs scale_vec::4X (ptxas rejects mxf4nvf4 without a qualifier); mxf4 and
    mxf8f6f4 spell out their defaults 2X and 1X."""
    assert ".kind::mxf4nvf4.block_scale.scale_vec::4X " in tcgen05.mma_block_scaled_ptx("mxf4nvf4", 1)
    assert ("tcgen05.mma.cta_group::2.kind::mxf4.block_scale.scale_vec::2X "
            in tcgen05.mma_block_scaled_ptx("mxf4", 2))
    assert ".kind::mxf8f6f4.block_scale.scale_vec::1X " in tcgen05.mma_block_scaled_ptx("mxf8f6f4", 1)


# ==============================================================================================
# Intrinsics: sm_100a kernels and their SASS
# ==============================================================================================
def _sass(kernel, sig, cc=offline.SM100A):
    return offline.disassemble(offline.compile_cubin(kernel, sig, cc))


U32_ARRAY, U64_ARRAY, F32_ARRAY = types.uint32[::1], types.uint64[::1], types.float32[::1]
TMEM_COLUMNS_USED = 128


def _mma_kernel(kind: str, cta_group: int):
    """Copy two scale atoms to TMEM and issue one MMA; descriptors encoded in the kernel."""
    cp = tcgen05.cp_32x128b_warpx4(cta_group)
    mma = tcgen05.mma_block_scaled(kind, cta_group)
    encode_smem = cuda.jit(device=True)(d.encode_smem_descriptor)
    set_sf_ids = cuda.jit(device=True)(d.with_scale_factor_ids)
    tmem_address = cuda.jit(device=True)(d.tmem_address)

    def kernel(words, addrs):
        tiles = cuda.shared.array(2048, numba.uint8)
        base = shared_address(tiles)
        a_desc = encode_smem(base, 16, 1024, d.SWIZZLE_128B, 0, 0)
        b_desc = encode_smem(base + 1024, 16, 1024, d.SWIZZLE_128B, 0, 0)
        sfa_tmem = tmem_address(0, words[1])
        sfb_tmem = sfa_tmem + d.SCALE_ATOM_TMEM_COLUMNS
        tcgen05.fence_after_thread_sync()
        cp(sfa_tmem, addrs[0])
        cp(sfb_tmem, addrs[1])
        idesc = set_sf_ids(words[2], words[3], words[4])
        mma(words[0], a_desc, b_desc, idesc, sfa_tmem, sfb_tmem, words[5])

    return kernel


@functools.cache
def mma_sass(kind: str, cta_group: int) -> str:
    return _sass(_mma_kernel(kind, cta_group), (U32_ARRAY, U64_ARRAY))


@functools.cache
def lifecycle_sass(cta_group: int) -> str:
    """alloc + relinquish (warp 0) -> fences around a barrier -> commit, commit multicast
    (thread 0) -> dealloc (warp 0)."""
    alloc, dealloc = tcgen05.alloc(cta_group), tcgen05.dealloc(cta_group)
    relinquish = tcgen05.relinquish_alloc_permit(cta_group)
    commit, commit_multicast = tcgen05.commit(cta_group), tcgen05.commit_multicast(cta_group)

    def kernel(out):
        tmem_base = cuda.shared.array(1, numba.uint32)
        mbar = cuda.shared.array(1, numba.uint64)
        if cuda.threadIdx.x < 32:
            alloc(shared_address(tmem_base), TMEM_COLUMNS_USED)
            relinquish()
        tcgen05.fence_before_thread_sync()
        cuda.syncthreads()
        tcgen05.fence_after_thread_sync()
        if cuda.threadIdx.x == 0:
            commit(shared_address(mbar))
            commit_multicast(shared_address(mbar), 0b11)
        cuda.syncthreads()
        if cuda.threadIdx.x < 32:
            out[0] = tmem_base[0]
            dealloc(tmem_base[0], TMEM_COLUMNS_USED)

    return _sass(kernel, (U32_ARRAY,))


LD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


@functools.cache
def ld_st_sass() -> str:
    """Every .32x32b load size (f32, summed), a u32 x4 load stored back, an f32 x32 store."""
    loads = [tcgen05.ld_32x32b(n) for n in LD_COUNTS]
    load_u32 = tcgen05.ld_32x32b(4, "u32")
    store_u32, store_f32 = tcgen05.st_32x32b(4), tcgen05.st_32x32b(32)
    ld1, ld2, ld4, ld8, ld16, ld32, ld64, ld128 = loads

    def kernel(out, taddr):
        t = taddr[0]
        total = numba.float32(0)
        # one load at a time, each waited for and summed (the sizes have different tuple types)
        values = ld1(t)
        tcgen05.wait_ld()
        for v in values:
            total += v
        values2 = ld2(t)
        tcgen05.wait_ld()
        for v in values2:
            total += v
        values4 = ld4(t)
        tcgen05.wait_ld()
        for v in values4:
            total += v
        values8 = ld8(t)
        tcgen05.wait_ld()
        for v in values8:
            total += v
        values16 = ld16(t)
        tcgen05.wait_ld()
        for v in values16:
            total += v
        values32 = ld32(t)
        tcgen05.wait_ld()
        for v in values32:
            total += v
        values64 = ld64(t)
        tcgen05.wait_ld()
        for v in values64:
            total += v
        values128 = ld128(t)
        tcgen05.wait_ld()
        for v in values128:
            total += v
        out[cuda.threadIdx.x] = total
        bits = load_u32(t)
        tcgen05.wait_ld()
        store_u32(t + 4, bits)
        store_f32(t + 8, values32)
        tcgen05.wait_st()

    return _sass(kernel, (F32_ARRAY, U32_ARRAY))


MMA_OPCODES = {"mxf4nvf4": "UTCOMMA.4X", "mxf4": "UTCOMMA", "mxf8f6f4": "UTCQMMA"}


@pytest.mark.parametrize("cta_group", [1, 2])
@pytest.mark.parametrize("kind", sorted(MMA_OPCODES))
def test_mma_sass(kind, cta_group):
    ops = offline.sass_opcodes(mma_sass(kind, cta_group))
    mma_ops = {op for op in ops if op.startswith(("UTCOMMA", "UTCQMMA", "UTCHMMA", "UTCIMMA"))}
    family, *qualifiers = MMA_OPCODES[kind].split(".")
    expected = ".".join([family] + (["2CTA"] if cta_group == 2 else []) + qualifiers)
    assert mma_ops == {expected}
    cp = "UTCCP.T.S.2CTA.4x32dp128bit" if cta_group == 2 else "UTCCP.T.S.4x32dp128bit"
    assert cp in ops


@pytest.mark.parametrize("cta_group", [1, 2])
def test_lifecycle_sass(cta_group):
    ops = offline.sass_opcodes(lifecycle_sass(cta_group))
    two = ".2CTA" if cta_group == 2 else ""
    assert f"UTCATOMSWS{two}.FIND_AND_SET.ALIGN" in ops         # alloc
    assert "UTCATOMSWS.AND" in ops                               # dealloc (same opcode for both groups)
    assert "UVIRTCOUNT.DEALLOC.SMPOOL" in ops                    # relinquish_alloc_permit
    assert f"UTCBAR{two}" in ops and f"UTCBAR{two}.MULTICAST" in ops


def test_ld_st_sass_without_local_memory():
    sass = ld_st_sass()
    ops = offline.sass_opcodes(sass)
    assert {"LDTM", "STTM.x4", "STTM.x32"} <= ops
    assert {f"LDTM.x{n}" for n in LD_COUNTS if n > 1} <= ops
    assert not offline.uses_local_memory(sass)


def test_fences_and_waits_assemble():
    """Fences and waits lower to no SASS opcode of their own (scheduling constraints), so the
    check is that they reach the PTX in order and that ptxas accepts them."""
    def kernel(out):
        tcgen05.fence_before_thread_sync()
        cuda.syncthreads()
        tcgen05.fence_after_thread_sync()
        tcgen05.wait_ld()
        tcgen05.wait_st()
        out[0] = 1

    ptx = offline.compile_ptx(kernel, (U32_ARRAY,), offline.SM100A)
    lines = ["tcgen05.fence::before_thread_sync;", "bar.sync", "tcgen05.fence::after_thread_sync;",
             "tcgen05.wait::ld.sync.aligned;", "tcgen05.wait::st.sync.aligned;"]
    positions = [ptx.index(line) for line in lines]
    assert positions == sorted(positions)
    assert offline.compile_cubin(kernel, (U32_ARRAY,), offline.SM100A)


@pytest.mark.parametrize("kind", ["mxf4nvf4", "mxf8f6f4"])
def test_tcgen05_rejected_for_sm90a(kind):
    """The same kernel does not assemble for Hopper: nvJitLink's ptxas names the target. (A
    fresh build: its device-function dispatchers must not carry sm_100a overloads.)"""
    with pytest.raises(Exception, match="not supported on .target 'sm_90a'"):
        offline.compile_cubin(_mma_kernel(kind, 1), (U32_ARRAY, U64_ARRAY), offline.SM90A)


def test_st_rejects_wrong_tuple_length():
    store = tcgen05.st_32x32b(4)

    def kernel(taddr):
        store(taddr[0], (numba.uint32(1), numba.uint32(2)))

    with pytest.raises(TypeError, match="values must be a UniTuple of 4 uint32 or float32"):
        offline.compile_ptx(kernel, (U32_ARRAY,), offline.SM100A)
