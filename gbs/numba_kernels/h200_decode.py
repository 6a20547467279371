"""The exact software block-scale decode of the H200 kernels: FP4 / FP8 element codes and their block
scales, read from a ring stage in shared memory, become bf16 MMA operands in registers, exactly.

Both consumers use it: ``h200_stream`` (``mma.sync``) and ``h200_wgmma`` (``wgmma``, whose A fragments and bf16
B buffer come from the same readers). ``make_side_reader`` builds the device functions of one MMA side
(``h200_ring.OperandSide``); the integer helpers below are plain Python that the host tests run on numpy
values and the kernels compile as device functions. Formats and layouts: ``docs/design/formats.md``, the H200
operand orders ``gbs.layouts``; the port as a whole: ``docs/design/h200_port.md``.

Exact software block scaling. Hopper has no FP4 MMA and no block-scale hardware. Each element is
decoded with integer operations into bf16 bits that read as ``value * 2**-c`` (E2M1: the 3 magnitude
bits go to bf16 bits 6..8, so code 1 = 0.5 lands on the bf16 subnormal ``2**-127``: ``c = 126``;
E4M3 ``c = 120``; E5M2 ``c = 112``), then one ``fma.rn.bf16x2`` multiplies it by the block scale held
as the bf16 ``s * 2**(c - d)``. E2M1 x UE4M3 and E2M1/E4M3/E5M2 x UE8M0 products have at most 7
significant bits, so the result ``value * s * 2**-d`` is exact in bf16; ``d`` (8 for UE4M3, 16 for
UE8M0) keeps ``s * 2**(c - d)`` inside the bf16 range. The MMA accumulates exact products in fp32 and
the epilogue multiplies by ``2**(d_tokens + d_weights)``, exactly. The exact range covers UE8M0 scale
exponents (``byte - 127``) in [-116, +17] for E2M1, [-108, +23] for E4M3, [-101, +31] for E5M2 and
every UE4M3 scale (``exact_scale_exponent_range``); outside it a product underflows to zero or its
scale saturates to Inf. NaN scale bytes (UE8M0 0xFF, UE4M3 0x7F) make their block NaN; NaN element
codes of E4M3 / E5M2 are decoded as finite numbers (the quantizers never emit them: a NaN block gets
a NaN scale and zero codes).

The K permutation. A sum over K ignores the order of k, so each thread of a quad takes a contiguous
quarter of the K slice of its row (64 FP4 or 32 FP8 elements), and both operands are read with the
same permutation: a group of 8 consecutive elements feeds two MMA k16 steps. FP4 groups pair
elements ``(j, j + 4)`` in one bf16x2 register (two shifts and masks per register); FP8 x FP8 pairs
``(0, 2), (1, 3)`` of each 4-byte word (no byte moves); W4A8 reads its FP8 tokens with the FP4
pairing. Threads visit their groups in an order rotated by their quad index, so the 32 lanes of a
shared-memory load hit 32 different banks (TMA 128B / 64B swizzle does the rest).

The cost, read offline from the SASS (ptxas 13.5): a packed E2M1 word decodes in 13 integer instructions
(``e2m1_pair_bits``: mask, one IMAD that spreads magnitude and sign, mask per register), a word in
``gbs.layouts.E2M1H200Order`` in 9 (``e2m1_h200_pair_bits``), bit-identical (evidence: h200-weight-order).
NVFP4 scales in that order are ``gbs.layouts.UE4M3H200Scales`` codes: a ``prmt`` and a shift-add per two scales
(``ue4m3_code_pair_bits``) instead of the exact float route (``cvt`` e4m3 -> f16 -> f32, multiply, pack: 6 per
two), the same bf16 except a zero scale as -0 (evidence: ue4m3-codes). UE8M0 scales take 5 instructions per two
(``ue8m0_pair_scale_bits``; evidence: ue8m0-min-u16x2).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from gbs.formats import SF_ATOM_COLS, UE8M0_BIAS
from gbs.layouts import LAYOUT_E2M1_E4M3, LAYOUT_E2M1_H200, E2M1H200Order, UE4M3H200Scales, word_order
from gbs.ptx_inline.arith import e4m3x4_to_bf16x2, min_u16x2, min_u16x2_host, prmt_b32
from gbs.ptx_inline.shared import ld_shared_u32, ld_shared_v2_u32

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
# Element decode: bf16 bits that read as ``value * 2**-ELEMENT_LOG2_OFFSET`` (see the module docstring).
ELEMENT_LOG2_OFFSET = {"e2m1": 126, "e4m3": 120, "e5m2": 112}
# Scale pre-bias d: the scaled operand is ``value * s * 2**-d``; the epilogue multiplies by 2**(d_a + d_b).
SCALE_LOG2_PREBIAS = {"ue4m3": 8, "ue8m0": 16}
BF16_EXPONENT_MAX = 254        # largest biased exponent of a finite bf16
BF16_EXPONENT_SHIFT = 7
BF16_QUIET_NAN_BIT = 0x40
NEG_ZERO_BF16X2 = 0x80008000   # fma addend: x * s + (-0) == x * s exactly, also for x * s == +0
QUAD = 4                       # lanes of a quad share an MMA row and split its K slice in 4
GROUP_ELEMENTS = 8             # K elements one decode group covers: 4 bf16x2 registers, 2 MMA steps


def inline_device(func):
    """``func`` as a device function inlined into its caller (every helper of the H200 kernels)."""
    return cuda.jit(device=True, forceinline=True)(func)


# ----------------------------------------------------------------------------------------------
# Element and scale decode (integer Python: the host tests run them on numpy values, the kernels
# compile them as device functions)
# ----------------------------------------------------------------------------------------------
E2M1_SPREAD = 0x1040          # nibble x (2**6 + 2**12): copies at bits 6..9 and 12..15, no overlap
E2M1_KEEP = 0x81C081C0        # magnitude of the first copy (bf16 bits 6..8), sign of the second (15)


def e2m1_pair_bits(word, j):
    """bf16x2 bits of FP4 elements ``j`` (low half) and ``j + 4`` (high half) of a 32-bit word of 8
    packed E2M1 codes (element i in nibble i), each reading as ``value * 2**-126``: the 3 magnitude
    bits land on bf16 bits 6..8 and the sign on bit 15 (so code 1 = 0.5 is the bf16 subnormal
    2**-127). One multiply does both moves: mask the nibble pair, multiply by ``2**6 + 2**12``
    (shifted down for odd ``j``), keep bits ``E2M1_KEEP``; ``j`` = 2, 3 first drop one byte."""
    if j >= 2:
        word = word >> 8
    odd = 4 * (j % 2)
    nibbles = word & (0x000F000F << odd)
    return np.uint32((nibbles * (E2M1_SPREAD >> odd)) & E2M1_KEEP)


# E2M1H200Order's decode constants as plain module names (numba reads globals, not class attributes)
H200_ORDER_MASK = E2M1H200Order.BF16_MASK
H200_ORDER_SHIFT_STEP = E2M1H200Order.SLOT_SHIFT_STEP
H200_ORDER_PRESHIFT = E2M1H200Order.SPREAD_PRESHIFT
H200_ORDER_SPREAD_MASK = E2M1H200Order.SPREAD_MASK
H200_ORDER_MULTIPLIER = E2M1H200Order.SPREAD_MULTIPLIER


def e2m1_h200_pair_bits(word, j):
    """``e2m1_pair_bits`` of the original word, from a word in ``E2M1H200Order`` (weights re-laid once
    with ``GroupedProblem.with_b_layout``): registers 0..2 are a mask of the word shifted left by 0, 3
    or 6; register 3 gathers its 8 spread bits with one multiply."""
    word = np.uint32(word)
    if j < 3:
        return np.uint32((word << np.uint32(H200_ORDER_SHIFT_STEP * j)) & np.uint32(H200_ORDER_MASK))
    spread = (word >> np.uint32(H200_ORDER_PRESHIFT)) & np.uint32(H200_ORDER_SPREAD_MASK)
    return np.uint32((spread * np.uint32(H200_ORDER_MULTIPLIER)) & np.uint32(H200_ORDER_MASK))


E4M3_ORDER_MAGNITUDES = 0x00070007   # E2M1E4M3Order: elements j and j + 4's magnitude bits, once shifted by 4 j


def e2m1_e4m3_pair_bits(word, j):
    """``e2m1_pair_bits`` of the original word, from a word in ``E2M1E4M3Order`` (the FP8 route's layout, read by the
    bf16 route too): the magnitudes sit where ``pack_fp4`` put them; element j's sign at bit 8 j + 7 goes to bf16 bit
    15 and element j + 4's at bit 8 j + 3 to bit 31 (shifts by constants once ``j`` is unrolled)."""
    word = np.uint32(word)
    magnitudes = ((word >> np.uint32(4 * j)) & np.uint32(E4M3_ORDER_MAGNITUDES)) << np.uint32(6)
    if j < 1:
        sign_lo = word << np.uint32(8 - 8 * j)
    else:
        sign_lo = word >> np.uint32(8 * j - 8)
    sign_hi = word << np.uint32(28 - 8 * j)
    return np.uint32(magnitudes | (sign_lo & np.uint32(0x8000)) | (sign_hi & np.uint32(0x80000000)))


def fp8_pair_bits(word0, word1, j, e5m2, stride4):
    """bf16x2 bits of register ``j`` (0..3) of an 8-element FP8 group ``word0 | word1 << 32``, each
    reading as ``value * 2**-120`` (E4M3) or ``value * 2**-112`` (E5M2).

    The two codes are first put in bits 8..15 and 24..31 (sign already at bf16 bit 15 / 31), then
    exponent and mantissa move down to bf16 bits 4..10 (E4M3) or 5..11 (E5M2).
    ``stride4`` (the FP4 pairing, for W4A8): elements ``(j, j + 4)``. Otherwise ``(0, 2), (1, 3),
    (4, 6), (5, 7)`` for j = 0..3: bytes 0/2 of a word shifted up by 8, bytes 1/3 in place."""
    word0, word1 = np.int64(word0), np.int64(word1)   # one integer type for numba's typing
    if stride4:
        u = (((word0 >> (8 * j)) & 0xFF) << 8) | (((word1 >> (8 * j)) & 0xFF) << 24)
    else:
        word = word0 if j < 2 else word1
        u = word << 8 if j % 2 == 0 else word
    if e5m2:
        return np.uint32((u & 0x80008000) | ((u >> 3) & 0x0FE00FE0))
    return np.uint32((u & 0x80008000) | ((u >> 4) & 0x07F007F0))


def pair_elements(j, pairing):
    """Group-element indices (low half, high half) of register ``j`` under ``pairing`` (host only)."""
    if pairing == "stride4":
        return j, j + 4
    return ((0, 2), (1, 3), (4, 6), (5, 7))[j]


def ue8m0_scale_bits(scale_byte, exponent_offset):
    """bf16x2 bits (the same value in both halves) of the UE8M0 scale ``2**(byte - 127)`` times
    ``2**exponent_offset`` (``exponent_offset = c - d``): the byte plus the offset is the bf16 biased
    exponent; saturates to Inf past the bf16 range; byte 0xFF gives NaN."""
    biased = min(scale_byte + exponent_offset, BF16_EXPONENT_MAX + 1)
    bits = (biased << BF16_EXPONENT_SHIFT) | (((scale_byte + 1) >> 8) * BF16_QUIET_NAN_BIT)
    return np.uint32(bits | (bits << 16))


UE8M0_LANES = 0x00010001        # 1 in each 16-bit lane
UE8M0_LANE_INF = 0x7F807F80     # bf16 +Inf in each lane
UE8M0_LANE_QUIET = 0x00400040   # the bf16 quiet-NaN bit of each lane


def _ue8m0_pair_scale_bits(lane_min):
    """``ue8m0_pair_scale_bits`` with ``lane_min`` as the 16-bit-lane unsigned minimum (the device's
    ``min_u16x2`` or the host's ``min_u16x2_host``): one body for the kernels and for the tests."""
    def pair_scale_bits(lanes, exponent_offset):
        lanes = np.uint32(lanes)
        # each lane's (byte + offset) << 7 (below 0x10000: no lane carries into the next) is the scale's
        # bf16 while byte + offset <= 254, and at least +Inf's 0x7F80 past it: the minimum saturates
        biased = np.uint32(lanes * np.uint32(1 << BF16_EXPONENT_SHIFT)
                           + np.uint32((exponent_offset << BF16_EXPONENT_SHIFT) * UE8M0_LANES))
        quiet = (np.uint32(lanes + np.uint32(UE8M0_LANES)) >> np.uint32(2)) & np.uint32(UE8M0_LANE_QUIET)
        return np.uint32(lane_min(biased, np.uint32(UE8M0_LANE_INF)) | quiet)
    return pair_scale_bits


ue8m0_pair_scale_bits = _ue8m0_pair_scale_bits(min_u16x2_host)
ue8m0_pair_scale_bits.__doc__ = """``ue8m0_scale_bits`` of two scale bytes at once: ``lanes`` holds them
zero-extended in its 16-bit lanes (byte 0 in bits 0..7, byte 1 in bits 16..23); returns the bf16 image of each in
its lane. Each lane's ``(byte + offset) << 7`` is below 0x10000 (``exponent_offset`` < 257), so one 32-bit
multiply-add serves both lanes; its lane minimum with +Inf saturates, and bit 8 of ``lane + 1`` flags the NaN byte
0xFF: 5 instructions for two scales (``LEA``, ``VIMNMX.U16x2``, ``VIADD``, ``SHF``, ``LOP3``; 10 with integer
saturation, ~9 each with per-byte conversions: the MXFP4 decode's per-stage scale work). Host form; the
kernels compile the same body with ``arith.min_u16x2`` (``_ue8m0_pair_scale_bits``)."""


UE4M3_CODE_SHIFT, UE4M3_CODE_LANE_ADDEND = UE4M3H200Scales.CODE_SHIFT, UE4M3H200Scales.LANE_ADDEND


def ue4m3_code_pair_bits(lanes):
    """bf16x2 bits of two ``UE4M3H200Scales`` codes held zero-extended in the 16-bit lanes of ``lanes``
    (code 0 in bits 0..7, code 1 in bits 16..23): each lane's ``(code << 4) + (235 << 7)`` with one shift
    and one add; no lane carries into the next (``UE4M3H200Scales``)."""
    return np.uint32(np.uint32(np.uint32(lanes) << np.uint32(UE4M3_CODE_SHIFT)) + np.uint32(UE4M3_CODE_LANE_ADDEND))


def byte_pair_selector(first_byte):
    """``prmt`` selector that puts bytes ``first_byte`` and ``first_byte + 1`` of a word, zero-extended,
    into the two 16-bit lanes (the selector's 4 picks byte 0 of a zero second operand)."""
    return np.uint32(0x4040 | first_byte | ((first_byte + 1) << 8))


def byte_broadcast_selector(byte):
    """``prmt`` selector that puts byte ``byte`` of a word, zero-extended, into both 16-bit lanes."""
    return np.uint32(0x4040 | byte | (byte << 8))


ROTATION_RUN = 4   # groups are rotated inside aligned runs of 4 (every thread range has 4 or 8 groups)


def rotated_group(gi, q):
    """Group a quad lane ``q`` visits at step ``gi``: rotated by ``q`` inside aligned runs of 4, so
    the lanes of one shared-memory load use different banks while a scale block (4 groups of
    8 elements for 32-element blocks) is still visited at the same step by every lane. 32-bit."""
    gi = np.uint32(gi)
    return np.uint32((gi & np.uint32(~(ROTATION_RUN - 1) & 0xFFFFFFFF))
                     | (np.uint32(gi + np.uint32(q)) & np.uint32(ROTATION_RUN - 1)))


def scale_word_column(q, blocks_per_thread):
    """First scale column of the 4-column (one u32 per row) word that holds quad lane ``q``'s
    ``blocks_per_thread`` block scales of a K slice."""
    return (q * blocks_per_thread) // SF_ATOM_COLS * SF_ATOM_COLS


PRMT_LOW_HALVES, PRMT_HIGH_HALVES = 0x5410, 0x7632   # prmt: the low (high) bf16 of a, then that of b


def bf16_stride4_pairs_of(prmt):
    """``pairs(w0, w1, w2, w3)``: 8 bf16 elements (element 2 i + h in half h of word i) as the FP4 decode pairs them,
    registers j = (j, j + 4), j = 0..3 (``e2m1_pair_bits``): how bf16 tokens (W4A16) meet FP4 weights in an MMA;
    ``prmt``: ``prmt_b32`` (device) or ``prmt_b32_host``."""
    def pairs(w0, w1, w2, w3):
        return (prmt(w0, w2, np.uint32(PRMT_LOW_HALVES)), prmt(w0, w2, np.uint32(PRMT_HIGH_HALVES)),
                prmt(w1, w3, np.uint32(PRMT_LOW_HALVES)), prmt(w1, w3, np.uint32(PRMT_HIGH_HALVES)))

    return pairs


def scale_byte_index(q, blocks_per_thread, block):
    """Byte of that word holding the scale of the lane's ``block``-th block."""
    return (q * blocks_per_thread) % SF_ATOM_COLS + block


def bf16_broadcast_selector(index):
    """``prmt`` selector that copies bf16 number ``index`` (0..3) of the 8 bytes ``b:a`` into both
    halves of the result."""
    lo = 2 * index
    return (lo | ((lo + 1) << 4)) * 0x101


def swizzle_xor(row, row_bytes, mask):
    """What TMA's 128B (mask 7) / 64B (mask 3) swizzle XORs into the in-row byte offset of row
    ``row`` of a 1024-byte aligned tile with ``row_bytes``-byte rows (16-byte chunk bits 4.. XOR
    address bits 7..): the same for rows 8 apart, so a thread computes it once."""
    return ((row * row_bytes) >> 7 & mask) << 4


def group_column(q, gl, thread_bytes, group_bytes, xor):
    """Swizzled in-row byte offset of local group ``gl`` of quad lane ``q`` (32-bit arithmetic)."""
    return np.uint32(np.uint32(np.uint32(q * thread_bytes) + np.uint32(gl * group_bytes)) ^ np.uint32(xor))



def swizzled_offset(row, col, row_bytes, mask):
    """Byte offset of byte ``col`` (< row_bytes) of row ``row`` in such a swizzled tile."""
    return row * row_bytes + (col ^ swizzle_xor(row, row_bytes, mask))


# ----------------------------------------------------------------------------------------------
# The readers of one MMA side
# ----------------------------------------------------------------------------------------------
def make_side_reader(side, pairing: str):
    """Device functions for one MMA side (``side``: an ``h200_ring.OperandSide``, which imports this module): ``load_group(address) -> (w0, w1)`` (w1 unused for FP4),
    ``decode(w0, w1, j)`` (unscaled bf16x2 bits of register j of the group), ``load_scales(address,
    q) -> (s0, s1)`` (per row and K slice: UE4M3 -> the two packed bf16x2 pairs of the word's 4 blocks, or of lane
    q's 2 blocks first where it has 2; UE8M0 ->
    the bf16x2 scale of each of the thread's 1 or 2 blocks), ``scale_selector(gl)`` and
    ``group_scale(s0, s1, selector, run)``: the scale of local group ``gl`` (visited at step ``gi``, in
    rotation run ``run = gi // ROTATION_RUN``),
    picked by ``selector = scale_selector(gl)`` for UE4M3 (which is affine in the group's rotation run:
    ``scale_selector_run_step``) and by the run for UE8M0 (a block is one run)."""
    if not side.fmt.scaled:   # bf16 tokens: their consumers read them as they are (no decode, no scales)
        return None, None, None, inline_device(_no_scale_selector), None
    element = side.element
    stride4 = pairing == "stride4"
    e5m2 = element == "e5m2"
    exponent_offset = ELEMENT_LOG2_OFFSET[element] - side.log2_prebias
    blocks = side.blocks_per_thread
    groups_per_block = side.groups // blocks
    ue4m3 = side.fmt.scale_dtype == "ue4m3"
    ue4m3_coded = ue4m3 and word_order(side.layout) == LAYOUT_E2M1_H200   # scale bytes are UE4M3H200Scales codes
    if ue4m3_coded and exponent_offset != UE4M3H200Scales.LOG2_MULTIPLIER:
        raise AssertionError("UE4M3H200Scales codes hold s * 2**118: the E2M1 x UE4M3 exponent offset")
    ue4m3_convert = e4m3x4_to_bf16x2(exponent_offset) if ue4m3 and not ue4m3_coded else None
    e2m1_bits = inline_device({LAYOUT_E2M1_H200: e2m1_h200_pair_bits, LAYOUT_E2M1_E4M3: e2m1_e4m3_pair_bits}.get(
        word_order(side.layout), e2m1_pair_bits))
    fp8_bits = inline_device(fp8_pair_bits)
    ue8m0_pair_bits = inline_device(_ue8m0_pair_scale_bits(min_u16x2))
    pair_selector = inline_device(byte_pair_selector)
    broadcast_byte = inline_device(byte_broadcast_selector)
    code_pair_bits = inline_device(ue4m3_code_pair_bits)
    byte_index = inline_device(scale_byte_index)
    broadcast_selector = inline_device(bf16_broadcast_selector)

    if side.packed:
        @inline_device
        def load_group(address):
            return ld_shared_u32(address), np.uint32(0)

        @inline_device
        def decode(w0, w1, j):
            return e2m1_bits(w0, j)
    else:
        @inline_device
        def load_group(address):
            return ld_shared_v2_u32(address)

        @inline_device
        def decode(w0, w1, j):
            return fp8_bits(w0, w1, j, e5m2, stride4)

    # UE4M3 with 2 blocks per lane (NVFP4 weights in a 128-K slice, W4A16): the lane's blocks are bytes 2 (q % 2) and
    # 2 (q % 2) + 1 of its scale word; they are moved to bytes 0 and 1, so the selectors are those of 4 blocks
    lane_pair_shift = 16 if ue4m3 and blocks == 2 else 0
    if ue4m3 and blocks not in (2, 4):
        raise AssertionError("UE4M3 scales: 2 or 4 blocks per lane (a 128- or 256-K slice)")
    if ue4m3_coded:
        @inline_device
        def load_scales(address, q):
            # codes 0, 1 and 2, 3 into the 16-bit lanes, then one shift-add makes both bf16
            word = ld_shared_u32(address) >> np.uint32(lane_pair_shift * (q & 1))
            return (code_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(0))),
                    code_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(2))))
    elif ue4m3:
        @inline_device
        def load_scales(address, q):
            return ue4m3_convert(ld_shared_u32(address) >> np.uint32(lane_pair_shift * (q & 1)))

    if ue4m3:
        @inline_device
        def scale_selector(gl):
            # the lane's 4 blocks are bf16 0..3 of s1:s0; group gl lies in block gl // groups_per_block
            return np.uint32(broadcast_selector(gl // groups_per_block))

        @inline_device
        def group_scale(s0, s1, selector, run):
            return prmt_b32(s0, s1, selector)
    else:
        if not 0 <= exponent_offset < 2 ** 8:
            raise AssertionError("ue8m0_pair_scale_bits: each lane (byte + offset) << 7 must stay below 0x10000")

        @inline_device
        def load_scales(address, q):
            word = ld_shared_u32(address)
            if blocks == 1:   # the one scale into both lanes: its bf16 twice
                s0 = ue8m0_pair_bits(prmt_b32(word, np.uint32(0), broadcast_byte(byte_index(q, blocks, 0))),
                                     exponent_offset)
                return s0, s0
            pair = ue8m0_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(byte_index(q, blocks, 0))),
                                   exponent_offset)
            return (prmt_b32(pair, pair, np.uint32(broadcast_selector(0))),
                    prmt_b32(pair, pair, np.uint32(broadcast_selector(1))))

        @inline_device
        def scale_selector(gl):
            return np.uint32(0)

        if groups_per_block != ROTATION_RUN:
            raise AssertionError("UE8M0 blocks (32 elements) are one rotation run of 8-element groups")

        @inline_device
        def group_scale(s0, s1, selector, run):
            # a UE8M0 block is one rotation run, so the choice is static per run (the caller passes
            # the run, not the group: a division per group cost MXFP4 decode ~8 % of its SASS)
            if run == 0:
                return s0
            return s1

    return load_group, decode, load_scales, scale_selector, group_scale


def _no_scale_selector(gl):
    return np.uint32(0)


def scale_selector_run_step(side) -> int:
    """For an ``h200_ring.OperandSide``: what one rotation run (``ROTATION_RUN`` groups) adds to a UE4M3 ``prmt`` selector: the run
    moves ``ROTATION_RUN // groups_per_block`` blocks on, and each block adds 2 to both selector
    nibbles of each result half (``bf16_broadcast_selector`` is affine)."""
    if side.fmt.scale_dtype != "ue4m3":
        return 0
    groups_per_block = side.groups // side.blocks_per_thread
    return (ROTATION_RUN // groups_per_block) * (bf16_broadcast_selector(1) - bf16_broadcast_selector(0))




def exact_scale_exponent_range(element: str, scale_dtype: str = "ue8m0") -> tuple[int, int]:
    """Unbiased UE8M0 scale exponents ``byte - 127`` for which every decoded, scaled element is exact
    (bf16 quantum ``2**-133`` below, the scale's bf16 image ``2**(e + c - d)`` finite above)."""
    if scale_dtype != "ue8m0":
        raise ValueError("UE4M3 scales are exact over their whole range here; ask for 'ue8m0'")
    c, d = ELEMENT_LOG2_OFFSET[element], SCALE_LOG2_PREBIAS["ue8m0"]
    element_quantum_log2 = {"e2m1": -1, "e4m3": -9, "e5m2": -16}[element]
    lowest_byte = (-133 + 127 + d) - element_quantum_log2
    highest_byte = BF16_EXPONENT_MAX - c + d
    return lowest_byte - UE8M0_BIAS, highest_byte - UE8M0_BIAS
