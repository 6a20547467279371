"""Block-scaled formats: encodings, quantize / dequantize, FP4 packing, the 128x4 scale layout.

Formats (``FORMATS``), all scaled in blocks along the last axis (K):

=============  =========  =====  ======  ==========================================
name           elements   block  scale   notes
=============  =========  =====  ======  ==========================================
``nvfp4``      E2M1       16     UE4M3   plus one FP32 global scale per tensor / expert
``mxfp4``      E2M1       32     UE8M0
``mxfp8``      E4M3       32     UE8M0   OCP "fn" E4M3, max 448
``mxfp8_e5m2`` E5M2       32     UE8M0
=============  =========  =====  ======  ==========================================

Conventions (``../shared/spec/formats.md``):

* Elements round to nearest even and saturate to the finite maximum (``cvt.rn.satfinite``).
* UE8M0 exponents: ``"rceil"`` (default, never clips: ``e = ceil(log2(amax / max_elem))``) or
  ``"floor"`` (OCP MX v1.0: ``e = floor(log2(amax)) - emax_elem``, can clip the block maximum),
  computed exactly from the float bits, clamped to [-127, 127]; an all-zero block gets 0x00.
* FP4 packing: two codes per byte, element ``2i`` in the low nibble (``LAYOUT_PACKED``); FP4
  weights may be re-laid once for the H200 kernels (``E2M1H200Order``).

NaN / Inf policy (``nonfinite=``):

* ``"propagate"`` (default, what hardware converters do): a block holding a NaN or an Inf gets a
  NaN scale (UE8M0 0xFF, UE4M3 0x7F) and its element codes are zero, so the whole block
  dequantizes to NaN and any product with it is NaN. NVFP4's global amax ignores such blocks.
* ``"raise"``: a ``ValueError`` naming the first non-finite element.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)

# Element encodings: (numpy dtype, bits, largest finite value, emax = floor(log2(max))).
_ELEMENTS = {
    "e2m1": (E2M1, 4, 6.0, 2),
    "e4m3": (E4M3, 8, 448.0, 8),
    "e5m2": (E5M2, 8, 57344.0, 15),
}
E4M3_NAN_BYTE = 0x7F   # S.1111.111 with S = 0: the UE4M3 NaN
UE8M0_NAN_BYTE = 0xFF
UE8M0_BIAS = 127
NVFP4_GLOBAL_NUMERATOR = 448.0 * 6.0   # S_enc = 448 * 6 / amax(tensor)

SCALE_MODES = ("rceil", "floor")
NONFINITE_POLICIES = ("propagate", "raise")


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled recipe: element encoding, block length along K, scale encoding."""

    name: str
    element: str       # "e2m1" | "e4m3" | "e5m2"
    block_size: int    # elements along K sharing one scale
    scale_dtype: str   # "ue4m3" | "ue8m0"

    @property
    def element_dtype(self) -> np.dtype:
        return _ELEMENTS[self.element][0]

    @property
    def element_bits(self) -> int:
        return _ELEMENTS[self.element][1]

    @property
    def element_max(self) -> float:
        return _ELEMENTS[self.element][2]

    @property
    def element_emax(self) -> int:
        return _ELEMENTS[self.element][3]

    @property
    def packed(self) -> bool:
        """FP4 elements are stored two per byte."""
        return self.element_bits == 4

    @property
    def has_global_scale(self) -> bool:
        return self.scale_dtype == "ue4m3"

    def row_bytes(self, k: int) -> int:
        """Bytes of one K-long row of elements."""
        return k * self.element_bits // 8

    def scale_cols(self, k: int) -> int:
        """Scale columns (blocks) of one K-long row."""
        return k // self.block_size


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("nvfp4", "e2m1", 16, "ue4m3"),
        BlockFormat("mxfp4", "e2m1", 32, "ue8m0"),
        BlockFormat("mxfp8", "e4m3", 32, "ue8m0"),
        BlockFormat("mxfp8_e5m2", "e5m2", 32, "ue8m0"),
    )
}


def get_format(fmt: str | BlockFormat) -> BlockFormat:
    """The ``BlockFormat`` named by ``fmt`` (a name of ``FORMATS`` or a ``BlockFormat``)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(f"unknown block-scaled format {fmt!r}; expected one of {sorted(FORMATS)}")


def _check_scale_mode(scale_mode: str) -> str:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    return scale_mode


def _check_float_input(x, fmt: BlockFormat) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.float64:
        # ml_dtypes rounds float64 twice (through float32): make the caller choose that rounding.
        raise TypeError("quantize takes float32 (or float16 / bfloat16) arrays; "
                        "convert float64 with x.astype(np.float32) first")
    if x.dtype not in (np.float32, np.float16, BF16):
        raise TypeError(f"quantize takes a float32 array, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize needs at least one element along the last axis (K), got shape {x.shape}")
    if x.shape[-1] % fmt.block_size:
        raise ValueError(f"K = {x.shape[-1]} is not a multiple of the {fmt.name} block size {fmt.block_size}")
    return x.astype(np.float32, copy=False)


def _raise_on_nonfinite(x: np.ndarray) -> None:
    bad = np.argwhere(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"non-finite value {x[tuple(bad[0])]} at index {tuple(int(i) for i in bad[0])} "
                         "(nonfinite='raise'; use nonfinite='propagate' to encode NaN scales)")


# ----------------------------------------------------------------------------------------------
# Element and scale encodings
# ----------------------------------------------------------------------------------------------
def encode_elements(x: np.ndarray, element: str) -> np.ndarray:
    """Round float32 values to the element encoding (RNE, saturating); returns raw codes as uint8.

    E2M1 codes are 4-bit (0..15, bit 3 = sign), unpacked. NaN inputs are not expected here (the
    block's scale carries NaN); ml_dtypes would map NaN to -0.0 for E2M1.
    """
    dtype, _, max_value, _ = _ELEMENTS[element]
    # E4M3/E5M2 casts in ml_dtypes do not saturate (480 -> NaN): clip first. E2M1's cast does.
    clipped = np.clip(x, -max_value, max_value).astype(np.float32)
    codes = clipped.astype(dtype).view(np.uint8)
    return codes & np.uint8(0x0F) if element == "e2m1" else codes


def decode_elements(codes: np.ndarray, element: str) -> np.ndarray:
    """float32 values of raw element codes (E2M1 codes in the low nibble, upper bits ignored)."""
    dtype = _ELEMENTS[element][0]
    codes = np.asarray(codes, dtype=np.uint8)
    if element == "e2m1":
        codes = codes & np.uint8(0x0F)   # a byte with bits above 3 set reads a wrong sign otherwise
    return codes.view(dtype).astype(np.float32)


def ue8m0_exponent(amax: np.ndarray, element: str, scale_mode: str = "rceil") -> np.ndarray:
    """UE8M0 scale bytes for block maxima ``amax`` (float32, >= 0 or non-finite).

    The exponent comes from the float bits (``np.frexp``), never from float32 ``log2`` (which
    misrounds just below powers of two) nor from a cast to ``float8_e8m0fnu`` (round-to-nearest,
    and 0 -> NaN).
    """
    _check_scale_mode(scale_mode)
    _, _, max_value, emax = _ELEMENTS[element]
    amax = np.asarray(amax, dtype=np.float32)
    finite = np.isfinite(amax)
    positive = finite & (amax > 0)
    safe = np.where(positive, amax, 1.0).astype(np.float64)
    if scale_mode == "floor":
        _, e2 = np.frexp(safe)                    # safe = m * 2**e2, m in [0.5, 1)
        exponent = (e2 - 1) - emax                # floor(log2(amax)) - emax_elem
    else:
        # ceil(log2(amax / max)): amax / max in float64 is correctly rounded and cannot land on a
        # power of two unless it is one, so the ceiling is exact.
        m, e2 = np.frexp(safe / max_value)
        exponent = np.where(m == 0.5, e2 - 1, e2)
    exponent = np.clip(exponent, -UE8M0_BIAS, UE8M0_BIAS)
    out = np.where(positive, exponent + UE8M0_BIAS, 0).astype(np.uint8)
    return np.where(finite, out, np.uint8(UE8M0_NAN_BYTE)).astype(np.uint8)


def decode_ue8m0(scale_bytes: np.ndarray) -> np.ndarray:
    """float32 values of UE8M0 bytes: 2**(b - 127); 0x00 = 2**-127 (a float32 subnormal); 0xFF = NaN."""
    b = np.asarray(scale_bytes, dtype=np.uint8).astype(np.int32)
    values = np.ldexp(np.float32(1.0), np.minimum(b, UE8M0_NAN_BYTE - 1) - UE8M0_BIAS).astype(np.float32)
    return np.where(b == UE8M0_NAN_BYTE, np.float32(np.nan), values).astype(np.float32)


def decode_ue4m3(scale_bytes: np.ndarray) -> np.ndarray:
    """float32 values of UE4M3 bytes (ordinary E4M3 bytes of positive values; 0x7F = NaN)."""
    return decode_elements(scale_bytes, "e4m3")


def decode_scales(scale_bytes: np.ndarray, fmt: str | BlockFormat) -> np.ndarray:
    """float32 values of a format's scale bytes."""
    fmt = get_format(fmt)
    return decode_ue4m3(scale_bytes) if fmt.scale_dtype == "ue4m3" else decode_ue8m0(scale_bytes)


# ----------------------------------------------------------------------------------------------
# FP4 packing
# ----------------------------------------------------------------------------------------------
def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte along the last axis: element 2i -> low nibble, 2i+1 -> high."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last axis, got {codes.shape[-1]}")
    if np.any(codes > 0x0F):
        raise ValueError("FP4 codes must be in 0..15")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_fp4``: (..., K/2) bytes -> (..., K) codes in 0..15."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


# ----------------------------------------------------------------------------------------------
# FP4 weight byte layouts
# ----------------------------------------------------------------------------------------------
LAYOUT_PACKED = "packed"                    # pack_fp4's nibbles, as quantized (every format's default)
LAYOUT_E2M1_H200 = "e2m1_h200"              # E2M1H200Order: a one-time re-layout for the H200 kernels
LAYOUT_E2M1_H200_TILED = "e2m1_h200_tiled"  # E2M1H200TiledOrder: the same bits, weights stored box by box
LAYOUT_E2M1_H200_FUSED = "e2m1_h200_fused"  # E2M1H200FusedOrder: each box followed by its block scales


def _e2m1_h200_destinations() -> tuple[int, ...]:
    """Destination bit of each source bit ``4 i + b`` of a 32-bit word (element i, bit b: 0 = m,
    1 = e0, 2 = e1, 3 = sign); see ``E2M1H200Order``."""
    dest = [0] * 32
    for j, shift in enumerate(E2M1H200Order.SLOT_SHIFTS):          # elements j, j + 4: a clean slot
        for half, element in ((0, j), (16, j + 4)):
            for bit, target in enumerate(E2M1H200Order.BF16_TARGET_BITS):
                dest[4 * element + bit] = target + half - shift
    for half, element in ((0, 3), (16, 7)):                          # elements 3, 7: the spread slot
        for bit, position in enumerate(E2M1H200Order.SPREAD_SLOT_BITS):
            dest[4 * element + bit] = position + half
    return tuple(dest)


class E2M1H200Order:
    """Packed E2M1 operands (weights, or tokens) with the 32 bits of every aligned 4-byte word (8 elements,
    element i in nibble i after ``pack_fp4``) permuted, so that the H200 kernels decode them in fewer
    instructions.

    The kernels turn elements ``(j, j + 4)`` of a word into one bf16x2 register whose halves read as
    ``value * 2**-126``: magnitude bits (m, e0, e1) on bf16 bits 6, 7, 8 and the sign on bit 15 (+16
    for the high half), i.e. the bits of ``BF16_MASK``. From ``pack_fp4`` order that takes a mask, a
    multiply and a mask per register, plus a shift per word (13 instructions per word). Here register
    ``j`` < 3 is already in place up to a left shift (``SLOT_SHIFTS``: ``(word << 3 j) & BF16_MASK``,
    1 or 2 instructions), and elements 3 and 7 fill the 8 bits left over (``SPREAD_SLOT_BITS``: m, e0,
    e1, sign at bits 14, 10, 11, 13 and +16), decoded as ``(((word >> 8) & SPREAD_MASK) *
    SPREAD_MULTIPLIER) & BF16_MASK`` (4): 9 instructions per word. Three left shifts are all a
    word can hold: the slots ``BF16_MASK >> s`` are disjoint only for s in {0, 3, 6}.

    A bijection of the bits of each word: ``swizzle`` / ``unswizzle`` (numpy; every 4-byte word of each
    row, so the row's bytes must be a multiple of 4: K a multiple of 8). The K order the kernels see is
    unchanged. UE4M3 block scales (NVFP4) are part of the order too: ``encode_scales`` / ``decode_scales``
    re-encode each byte (``UE4M3H200Scales``: one ``prmt`` and one shift-add per two scales instead of
    the exact float conversion's six instructions); UE8M0 scales (MX formats) stay as they are.
    ``GroupedProblem.with_b_layout`` applies both to the weights (once), ``with_a_layout`` to the tokens
    (which, in a model, their quantizer writes in this order: placing the bits and picking the scale code
    costs it no more than ``pack_fp4``'s nibbles and the UE4M3 byte).
    """

    BF16_TARGET_BITS = (6, 7, 8, 15)          # m, e0, e1, sign of the low bf16 half
    BF16_MASK = 0x81C081C0                     # those bits in both halves
    SLOT_SHIFT_STEP = 3                        # register j < 3 sits at BF16_MASK >> (SLOT_SHIFT_STEP * j)
    SLOT_SHIFTS = (0, SLOT_SHIFT_STEP, 2 * SLOT_SHIFT_STEP)
    SPREAD_SLOT_BITS = (14, 10, 11, 13)        # m, e0, e1, sign of element 3 (element 7: +16)
    SPREAD_PRESHIFT = 8
    SPREAD_MASK = 0x006C006C                   # SPREAD_SLOT_BITS >> SPREAD_PRESHIFT, both halves
    SPREAD_MULTIPLIER = (1 << 0) | (1 << 5) | (1 << 10)   # three shifted copies; BF16_MASK keeps the right bits
    ROLES = ("tokens", "weights")   # what the operand may be (``gbs.problem.check_layout``)
    WORD_ORDER = LAYOUT_E2M1_H200   # the bits of each word: which decode the kernels run
    TILED = False                   # weights stored box by box (``E2M1H200TiledOrder``)

    @staticmethod
    def _words(packed: np.ndarray) -> np.ndarray:
        packed = np.asarray(packed)
        if packed.dtype != np.uint8:   # a value cast would corrupt the codes: bytes only
            raise TypeError(f"E2M1H200Order takes packed FP4 bytes as uint8, got {packed.dtype}")
        packed = np.ascontiguousarray(packed)
        if packed.ndim < 1 or packed.shape[-1] % 4:
            raise ValueError(f"E2M1H200Order works on 4-byte words: the last axis ({packed.shape[-1:]}) "
                             "must be a multiple of 4 bytes (K a multiple of 8)")
        return packed.view("<u4")

    @staticmethod
    def byte_tables(inverse: bool = False) -> np.ndarray:
        """(4, 256) uint32: for byte ``i`` of a little-endian word and each of its 256 values, that byte's
        bits in their places in the re-laid word (``inverse``: back to ``pack_fp4`` order). A word's image is
        the OR of its four bytes' entries (``gbs.numba_kernels.relayout`` reads them on the device)."""
        return _E2M1_H200_TABLES[inverse].copy()

    @classmethod
    def _permute(cls, packed: np.ndarray, inverse: bool) -> np.ndarray:
        words = cls._words(packed)
        tables = _E2M1_H200_TABLES[inverse]   # per byte of the word: its 256 values' destination bits
        out = tables[0][words & np.uint32(0xFF)]
        for i in range(1, 4):
            out |= tables[i][(words >> np.uint32(8 * i)) & np.uint32(0xFF)]
        return out.view(np.uint8)

    @classmethod
    def swizzle(cls, packed: np.ndarray) -> np.ndarray:
        """``pack_fp4`` bytes (..., K/2) -> the same shape in this order (a new array)."""
        return cls._permute(packed, inverse=False)

    @classmethod
    def unswizzle(cls, ordered: np.ndarray) -> np.ndarray:
        """Inverse of ``swizzle``."""
        return cls._permute(ordered, inverse=True)

    @staticmethod
    def encode_scales(scale_bytes: np.ndarray, scale_dtype: str) -> np.ndarray:
        """An operand's block-scale bytes (any shape, e.g. the 128x4 atoms) in this order: UE4M3 bytes
        re-encoded (``UE4M3H200Scales.encode``, a new array), UE8M0 bytes unchanged (a copy)."""
        if scale_dtype == "ue4m3":
            return UE4M3H200Scales.encode(scale_bytes)
        return _scale_bytes(scale_bytes, scale_dtype).copy()

    @staticmethod
    def decode_scales(scale_bytes: np.ndarray, scale_dtype: str) -> np.ndarray:
        """Inverse of ``encode_scales``."""
        if scale_dtype == "ue4m3":
            return UE4M3H200Scales.decode(scale_bytes)
        return _scale_bytes(scale_bytes, scale_dtype).copy()


class E2M1H200TiledOrder(E2M1H200Order):
    """``E2M1H200Order``'s bits, with each expert's weight matrix stored box by box: faster than row-major for
    NVFP4 weights, slower for MXFP4; ``E2M1H200FusedOrder`` (each box followed by its scales) is faster for both
    and is the one ``gbs.api.h200_weight_layout`` recommends.

    The kernels' producer loads a weight stage as a TMA box of 128 rows x one 128-byte K slice (16 KB).
    In row-major weights those are 128 pieces of 128 B, one per row, ``K / 2`` bytes apart; here each box
    is 16 KB of contiguous memory, so a stage is one DRAM stream instead of 128 (why that is faster is
    inferred, not measured: fewer DRAM pages opened per byte). Boxes are ordered (128-row tile, K slice),
    rows inside a box as before: byte ``c`` of row ``r`` of an expert's (N, K/2) matrix sits at byte
    ``box_row * 128 + c % 128`` of the expert's slab, ``box_row = (r // 128 * (K/2 // 128) + c // 128) * 128
    + r % 128`` (the kernels' tensor map reads the slabs as rows of 128 B). So ``b`` keeps its shape and
    dtype (N and K/2 multiples of ``BOX_ROWS`` / ``BOX_BYTES``, which every ``workloads.md`` shape is) and
    the scales keep the 128x4 layout (UE4M3 codes as in ``E2M1H200Order``). The kernels read it through a
    2-D tensor map over all the boxes (``h200_stream.tensor_map_args``); wider or narrower weight tiles (256
    or 8-64 rows, 64-byte K slices with FP8 tokens) are whole boxes or parts of them. Weights only: tokens
    are not tiled.

    Measured on the H200 against row-major weights (``notes/h200/README.md``, session 22, runs 95, 97 and
    98): NVFP4 decode 267.3 -> 260.6 us on a 4.63 TB/s GPU (87.9 % of the read ceiling) and 279.5 -> 269.4
    us on a 4.53 TB/s one, where it also removed the bimodal launch times; MXFP4 decode 2-4 % slower.
    """

    BOX_ROWS = 128     # weight rows per box: the streaming kernel's M tile (``h200_stream.TILE_M_ROWS``)
    BOX_BYTES = 128    # bytes of K per box row: one FP4 K slice of 256 elements (``h200_stream.K_SLICE_BYTES``)
    ROLES = ("weights",)
    TILED = True

    @classmethod
    def whole_boxes(cls, shape) -> bool:
        """Whether weights of ``shape`` (..., N, K/2 bytes) tile into whole boxes."""
        return len(shape) >= 2 and not (shape[-2] % cls.BOX_ROWS or shape[-1] % cls.BOX_BYTES)

    @classmethod
    def check_shape(cls, shape, fmt=None) -> None:
        """ValueError unless ``shape`` (..., N, K/2 bytes) tiles into whole boxes (``fmt``: unused here)."""
        if not cls.whole_boxes(shape):
            raise ValueError(f"{LAYOUT_E2M1_H200_TILED!r} stores weights in boxes of {cls.BOX_ROWS} rows x "
                             f"{cls.BOX_BYTES} bytes: it needs (..., N, K/2) with N a multiple of {cls.BOX_ROWS} "
                             f"and K/2 of {cls.BOX_BYTES} bytes (K of {2 * cls.BOX_BYTES}), got {tuple(shape)}")

    @classmethod
    def tile(cls, rows: np.ndarray) -> np.ndarray:
        """(..., N, K/2) bytes -> the same shape with each box contiguous (a new array; bytes unchanged)."""
        rows = np.asarray(rows)
        cls.check_shape(rows.shape)
        *lead, n, kb = rows.shape
        boxes = rows.reshape(*lead, n // cls.BOX_ROWS, cls.BOX_ROWS, kb // cls.BOX_BYTES, cls.BOX_BYTES)
        return np.ascontiguousarray(np.swapaxes(boxes, -3, -2)).reshape(rows.shape)

    @classmethod
    def untile(cls, tiled: np.ndarray) -> np.ndarray:
        """Inverse of ``tile``."""
        tiled = np.asarray(tiled)
        cls.check_shape(tiled.shape)
        *lead, n, kb = tiled.shape
        boxes = tiled.reshape(*lead, n // cls.BOX_ROWS, kb // cls.BOX_BYTES, cls.BOX_ROWS, cls.BOX_BYTES)
        return np.ascontiguousarray(np.swapaxes(boxes, -3, -2)).reshape(tiled.shape)

    @classmethod
    def swizzle(cls, packed: np.ndarray) -> np.ndarray:
        """``pack_fp4`` weight bytes (..., N, K/2) -> the same shape in this order (a new array)."""
        cls.check_shape(np.shape(packed))
        return cls.tile(super().swizzle(packed))

    @classmethod
    def unswizzle(cls, ordered: np.ndarray) -> np.ndarray:
        """Inverse of ``swizzle``."""
        return super().unswizzle(cls.untile(ordered))


class E2M1H200FusedOrder(E2M1H200TiledOrder):
    """``E2M1H200TiledOrder``'s boxes, each followed by its block scales: one contiguous chunk per stage of
    the H200 kernels (``gbs.api.h200_weight_layout``: the H200 order of FP4 weights, NVFP4 and MXFP4).

    A weight stage is a 16 KB box (128 rows x one 128-byte K slice, 256 elements) plus that slice's 128x4
    scale atoms for the box's 128-row band: ``64 / block_size`` atoms of 512 B (MXFP4 2 = 1 KB, NVFP4 4 =
    2 KB). Tiled weights with separate scales still make a stage two DRAM streams; here each chunk is the
    box's 16 KB and then its atoms' bytes, exactly as ``b_scales`` holds them (UE4M3 codes as in
    ``E2M1H200Order``), so a stage is one stream of ``16 KB + 128 * 256 / block_size`` bytes. Chunks are
    ordered (expert, 128-row tile, K slice). An expert's chunks hold ``N * (K/2 + K/block_size)`` bytes:
    each row's weight and scale bytes, so ``b`` has shape ``(E, N, K/2 + K/block_size)``
    (``stored_row_bytes``); N and K/2 must be multiples of 128 (every ``workloads.md`` shape is).

    ``b_scales`` keeps the 128x4 atoms as well (the reference and the checks read them; ``GroupedProblem``
    checks that they equal the chunks' copies): on the device that copy costs 1/16 (MXFP4) or 1/8 (NVFP4)
    of the weight bytes, which the H200 kernels do not read. ``fuse`` / ``unfuse`` convert from / to tiled
    weights and atoms; ``GroupedProblem.with_b_layout`` does it for a problem.

    Measured on the H200 (``notes/h200/README.md``, session 23), row-major / tiled / fused: run 100 (4.63 TB/s;
    a diagnostic that copied the chunks at launch preparation) decode_up MXFP4 255.9 / 264.9 / 253.8 us (85.2 %
    of the read ceiling), NVFP4 268.5 / 261.0 / 260.5 (88.0 %); run 101 (4.53 TB/s, this layout) MXFP4 263.5 /
    270.4 / 263.3, NVFP4 279.1 / 268.9 / 269.1; bench run 102 (4.53 TB/s): NVFP4 87.2 %, MXFP4 85.8 %. With the
    scales in its chunks MXFP4 gains instead of losing (why separate scales made tiled MXFP4 lose is inferred,
    not measured: two DRAM streams per stage; the scale stream's order and address did not matter, run 100).
    """

    CHUNK_BOX_BYTES = E2M1H200TiledOrder.BOX_ROWS * E2M1H200TiledOrder.BOX_BYTES
    SLICE_ELEMENTS = 2 * E2M1H200TiledOrder.BOX_BYTES     # elements of K per box row (FP4: two per byte)

    @classmethod
    def chunk_scale_bytes(cls, block_size: int) -> int:
        """Bytes of one chunk's scale atoms: 128 rows x one scale byte per block of the K slice."""
        return cls.BOX_ROWS * (cls.SLICE_ELEMENTS // block_size)

    @classmethod
    def stored_row_bytes(cls, k: int, block_size: int) -> int:
        """Bytes per weight row in ``b``'s shape: K/2 weight bytes and K/block_size scale bytes."""
        return k // 2 + k // block_size

    @classmethod
    def _k(cls, shape, block_size: int) -> int:
        """K of fused weights of ``shape``; ValueError unless they are whole chunks."""
        row_bytes = shape[-1] if len(shape) >= 2 else 0
        k = row_bytes * 2 * block_size // (block_size + 2)
        if (len(shape) < 2 or shape[-2] % cls.BOX_ROWS or k <= 0 or k % cls.SLICE_ELEMENTS
                or cls.stored_row_bytes(k, block_size) != row_bytes):
            raise ValueError(f"{LAYOUT_E2M1_H200_FUSED!r} stores weights with their scales in chunks of {cls.BOX_ROWS} "
                             f"rows: it needs (..., N, K/2 + K/{block_size}) bytes with N a multiple of "
                             f"{cls.BOX_ROWS} and K of {cls.SLICE_ELEMENTS}, got {tuple(shape)}")
        return k

    @classmethod
    def check_shape(cls, shape, fmt=None) -> None:
        """ValueError unless ``shape`` is fused weights of format ``fmt`` (its block size) in whole chunks."""
        if fmt is None:
            raise TypeError(f"{LAYOUT_E2M1_H200_FUSED!r}: the shape check needs the weights' format")
        cls._k(shape, get_format(fmt).block_size)

    @classmethod
    def fuse(cls, tiled: np.ndarray, scale_atoms: np.ndarray, block_size: int) -> np.ndarray:
        """Tiled weights (..., N, K/2) (``E2M1H200TiledOrder``) and their 128x4 atoms (..., N/128, K/block/4,
        32, 4, 4) -> fused (..., N, K/2 + K/block) (a new array)."""
        tiled, scale_atoms = np.asarray(tiled), np.asarray(scale_atoms)
        E2M1H200TiledOrder.check_shape(tiled.shape)
        *lead, n, kb = tiled.shape
        tiles, slices = n // cls.BOX_ROWS, kb // cls.BOX_BYTES
        want = (*lead, tiles, 2 * kb // block_size // SF_ATOM_COLS, *_ATOM_SHAPE)
        if scale_atoms.dtype != np.uint8 or scale_atoms.shape != want:
            raise ValueError(f"fuse: scale atoms must be uint8 {want} for weights {tiled.shape}, got "
                             f"{scale_atoms.dtype} {scale_atoms.shape}")
        boxes = tiled.reshape(*lead, tiles, slices, cls.CHUNK_BOX_BYTES)
        atoms = scale_atoms.reshape(*lead, tiles, slices, cls.chunk_scale_bytes(block_size))
        fused = np.concatenate([boxes, atoms], axis=-1)
        return fused.reshape(*lead, n, cls.stored_row_bytes(2 * kb, block_size))

    @classmethod
    def unfuse(cls, fused: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Inverse of ``fuse``: (tiled weights, scale atoms), new arrays."""
        fused = np.asarray(fused)
        *lead, n, _ = fused.shape
        tiled = np.ascontiguousarray(cls._chunks(fused, block_size)[..., :cls.CHUNK_BOX_BYTES])
        return tiled.reshape(*lead, n, cls._k(fused.shape, block_size) // 2), cls.scale_atoms(fused, block_size)

    @classmethod
    def scale_atoms(cls, fused: np.ndarray, block_size: int) -> np.ndarray:
        """The copy of the 128x4 scale atoms that fused weights hold (a new array; the weight bytes are not
        copied: what ``GroupedProblem`` checks against ``b_scales``)."""
        fused = np.asarray(fused)
        *lead, n, _ = fused.shape
        atoms = np.ascontiguousarray(cls._chunks(fused, block_size)[..., cls.CHUNK_BOX_BYTES:])
        return atoms.reshape(*lead, n // cls.BOX_ROWS, cls._k(fused.shape, block_size) // block_size // SF_ATOM_COLS,
                             *_ATOM_SHAPE)

    @classmethod
    def _chunks(cls, fused: np.ndarray, block_size: int) -> np.ndarray:
        """A (..., row tiles, K slices, chunk bytes) view of fused weights."""
        k = cls._k(fused.shape, block_size)
        *lead, n, _ = fused.shape
        return fused.reshape(*lead, n // cls.BOX_ROWS, k // cls.SLICE_ELEMENTS, -1)

    @classmethod
    def swizzle(cls, packed: np.ndarray) -> np.ndarray:
        raise TypeError(f"{LAYOUT_E2M1_H200_FUSED!r} holds the weights' scales too: build it with "
                        "GroupedProblem.with_b_layout or E2M1H200FusedOrder.fuse")

    unswizzle = swizzle


def _scale_bytes(scale_bytes, scale_dtype: str) -> np.ndarray:
    scale_bytes = np.asarray(scale_bytes)
    if scale_dtype not in ("ue4m3", "ue8m0"):
        raise ValueError(f"scale_dtype must be 'ue4m3' or 'ue8m0', got {scale_dtype!r}")
    if scale_bytes.dtype != np.uint8:
        raise TypeError(f"block-scale bytes must be uint8, got {scale_bytes.dtype}")
    return scale_bytes


class UE4M3H200Scales:
    """UE4M3 block scales re-encoded for the H200 kernels (the scale part of ``E2M1H200Order``).

    The kernels multiply each decoded E2M1 register (``value * 2**-126``) by the bf16 ``s * 2**118`` of
    its block scale ``s`` (``LOG2_MULTIPLIER``: 126 minus the UE4M3 pre-bias 8 of
    ``h200_stream.ELEMENT_LOG2_OFFSET``), so that ``value * s * 2**-8`` is an exact bf16 normal. From a
    UE4M3 byte that bf16 costs an exact float route (``cvt`` e4m3 -> f16 -> f32, a multiply, a pack:
    3 instructions per scale). Here each byte ``h`` already holds the bf16's exponent (offset by
    ``EXPONENT_BASE``) and its 3 mantissa bits, ``h = (exponent - EXPONENT_BASE) << 3 | mantissa``, so
    the bf16 bits are ``(h << 4) + (EXPONENT_BASE << 7)``: one ``prmt`` puts two bytes in the 16-bit
    lanes of a register and one shift-add makes both bf16 (``bf16_bits``), 1 instruction per scale.

    Every UE4M3 value has a code, exactly: ``s`` from 2**-9 (the smallest subnormal) to 448 gives bf16
    exponents 236..253, codes 0x08..0x96 (subnormal UE4M3 bytes become normal numbers here).
    ``ZERO_BYTE`` (0xA8) is the code of 0: ``(0xA8 << 4) + 0x7580 = 0x8000``, the bf16 -0, so a zero
    scale still zeroes its block whatever its element codes; ``NAN_BYTE`` (0xA4) gives the bf16 quiet
    NaN 0x7FC0 (UE4M3 0x7F). No code carries out of its 16-bit lane. Bytes with the sign bit set are
    not UE4M3 (``formats.md``: sign 0) and are rejected; ``decode`` rejects bytes that are not codes.
    """

    EXPONENT_BASE = 235        # bf16 biased exponent of code exponent 0 (codes use 1..18, 20, 21)
    LOG2_MULTIPLIER = 118      # the kernels' bf16 scale is s * 2**LOG2_MULTIPLIER
    ZERO_BYTE = 0xA8           # bf16 -0: exponent field 256 carries into the sign bit, mantissa 0
    NAN_BYTE = 0xA4            # bf16 0x7FC0 (exponent 255, the quiet bit)
    LANE_ADDEND = (EXPONENT_BASE << 7) * 0x00010001   # the shift-add's constant, both 16-bit lanes
    CODE_SHIFT = 4             # code bits 0..7 -> bf16 bits 4..11 (mantissa 4..6, exponent 7..11)

    @classmethod
    def bf16_bits(cls, codes) -> np.ndarray:
        """uint16 bf16 bits of each code: what the kernels compute (per 16-bit lane)."""
        codes = np.asarray(codes).astype(np.uint32)
        return ((codes << np.uint32(cls.CODE_SHIFT)) + np.uint32(cls.EXPONENT_BASE << 7)).astype(np.uint16)

    @classmethod
    def encode(cls, ue4m3_bytes: np.ndarray) -> np.ndarray:
        """UE4M3 bytes (uint8, any shape) -> their codes (a new array); ValueError on a sign bit."""
        ue4m3_bytes = _scale_bytes(ue4m3_bytes, "ue4m3")
        signed = ue4m3_bytes >= 0x80
        if np.any(signed):
            index = np.unravel_index(int(np.argmax(signed)), ue4m3_bytes.shape)
            raise ValueError(f"UE4M3 scale byte {int(ue4m3_bytes[index]):#04x} at {tuple(int(i) for i in index)} "
                             "has the sign bit set: UE4M3 scales are unsigned (an e4m3 byte of a positive value)")
        return _UE4M3_H200_CODES[ue4m3_bytes]

    @classmethod
    def decode(cls, codes: np.ndarray) -> np.ndarray:
        """Codes -> the UE4M3 bytes (a new array); ValueError on a byte that is no code."""
        codes = _scale_bytes(codes, "ue4m3")
        ue4m3 = _UE4M3_H200_INVERSE[codes]
        bad = ue4m3 < 0
        if np.any(bad):
            index = np.unravel_index(int(np.argmax(bad)), codes.shape)
            raise ValueError(f"byte {int(codes[index]):#04x} at {tuple(int(i) for i in index)} is not a "
                             "UE4M3H200Scales code")
        return ue4m3.astype(np.uint8)


def _ue4m3_h200_codes() -> np.ndarray:
    """(128,) uint8: the code of each UE4M3 byte 0x00..0x7F (see ``UE4M3H200Scales``)."""
    u = np.arange(128, dtype=np.uint8)
    with np.errstate(over="ignore"):
        multiplier = decode_ue4m3(u).astype(np.float32) * np.float32(2.0 ** UE4M3H200Scales.LOG2_MULTIPLIER)
    bits = multiplier.view(np.uint32)
    if np.any(bits[1:0x7F] & np.uint32(0x000FFFFF)):
        raise AssertionError("a UE4M3 scale times 2**118 is not exact in bf16 with 3 mantissa bits")
    exponent = (bits >> np.uint32(23)).astype(np.int64) - UE4M3H200Scales.EXPONENT_BASE
    codes = (exponent << 3) | ((bits >> np.uint32(20)) & np.uint32(7)).astype(np.int64)
    codes[0], codes[0x7F] = UE4M3H200Scales.ZERO_BYTE, UE4M3H200Scales.NAN_BYTE
    if codes[1:0x7F].min() < 1 << 3 or codes[1:0x7F].max() >= 19 << 3:
        raise AssertionError("UE4M3 codes outside the exponent window")
    return codes.astype(np.uint8)


_UE4M3_H200_CODES = _ue4m3_h200_codes()
_UE4M3_H200_INVERSE = np.full(256, -1, np.int16)
_UE4M3_H200_INVERSE[_UE4M3_H200_CODES] = np.arange(128, dtype=np.int16)


def _byte_tables(dest: tuple[int, ...]) -> np.ndarray:
    """(4, 256) uint32: where the set bits of each byte value, at byte i of a word, go under ``dest``."""
    values = np.arange(256, dtype=np.uint32)
    tables = np.zeros((4, 256), np.uint32)
    for src, dst in enumerate(dest):
        tables[src // 8] |= ((values >> np.uint32(src % 8)) & np.uint32(1)) << np.uint32(dst)
    return tables


_E2M1_H200_DEST = _e2m1_h200_destinations()
_E2M1_H200_TABLES = (_byte_tables(_E2M1_H200_DEST),
                     _byte_tables(tuple(int(i) for i in np.argsort(_E2M1_H200_DEST))))
OPERAND_LAYOUTS = {LAYOUT_PACKED: None, LAYOUT_E2M1_H200: E2M1H200Order, LAYOUT_E2M1_H200_TILED: E2M1H200TiledOrder,
                   LAYOUT_E2M1_H200_FUSED: E2M1H200FusedOrder}


def word_order(layout: str) -> str:
    """The order of the bits inside each 4-byte word of ``layout`` (what a kernel's decode reads):
    ``LAYOUT_PACKED`` or ``LAYOUT_E2M1_H200`` (also the tiled layout's)."""
    order = OPERAND_LAYOUTS[layout]
    return LAYOUT_PACKED if order is None else order.WORD_ORDER


def tiled_weights(layout: str) -> bool:
    """Whether ``layout`` stores weights box by box (``E2M1H200TiledOrder``, ``E2M1H200FusedOrder``)."""
    order = OPERAND_LAYOUTS[layout]
    return order is not None and order.TILED


def fused_scales(layout: str) -> bool:
    """Whether ``layout`` stores the weights' block scales in ``b`` with them (``E2M1H200FusedOrder``)."""
    return layout == LAYOUT_E2M1_H200_FUSED


def weight_bytes_layout(layout: str) -> str:
    """The layout of the weight bytes alone of ``layout`` (a fused layout's without its scales)."""
    return LAYOUT_E2M1_H200_TILED if fused_scales(layout) else layout


def stored_row_bytes(layout: str, fmt, k: int) -> int:
    """Bytes per row of an operand of format ``fmt`` stored in ``layout`` (its array's last axis)."""
    fmt = get_format(fmt)
    if fused_scales(layout):
        return E2M1H200FusedOrder.stored_row_bytes(k, fmt.block_size)
    return fmt.row_bytes(k)


# ----------------------------------------------------------------------------------------------
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockScaled:
    """A block-scaled tensor quantized along its last axis (K).

    ``data``: element codes, (..., K/2) uint8 for FP4 (packed), (..., K) E4M3/E5M2 otherwise.
    ``scales``: the linear scale bytes, (..., K/block) uint8 (UE8M0 or UE4M3 bytes).
    ``global_scale``: NVFP4 only: the float32 encode scale ``S_enc = 448*6/amax`` of the tensor,
    shape () for 2-D input and (E,) (one per expert) for 3-D input; ``None`` for MX formats.
    """

    data: np.ndarray
    scales: np.ndarray
    fmt: BlockFormat
    global_scale: np.ndarray | None = None

    @property
    def k(self) -> int:
        return self.data.shape[-1] * 8 // self.fmt.element_bits

    @property
    def global_decode_scale(self) -> np.ndarray:
        """``1 / S_enc`` (float32); 1.0 for MX formats. The grouped matmul folds this into
        ``expert_scales``."""
        if self.global_scale is None:
            return np.float32(1.0)
        return (1.0 / self.global_scale.astype(np.float64)).astype(np.float32)

    def element_codes(self) -> np.ndarray:
        """Unpacked element codes as uint8, shape (..., K)."""
        return unpack_fp4(self.data) if self.fmt.packed else self.data.view(np.uint8)


def _nvfp4_global_scale(absx: np.ndarray, block_finite: np.ndarray, per_expert: bool) -> np.ndarray:
    """``S_enc = 448*6 / amax`` over the finite blocks of the tensor (per expert for 3-D); amax 0 gives 1,
    and an amax below ``448*6 / FLT_MAX`` (~7.9e-36) the largest finite float32 instead of an infinite
    S_enc, which would make every all-zero block's scale ``0 * inf`` = NaN."""
    finite_abs = np.where(np.repeat(block_finite, absx.shape[-1] // block_finite.shape[-1], axis=-1), absx, 0)
    axes = tuple(range(1, absx.ndim)) if per_expert else None
    amax = np.max(finite_abs, axis=axes).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.minimum(np.float32(NVFP4_GLOBAL_NUMERATOR) / amax, np.finfo(np.float32).max).astype(np.float32)
    return np.where(amax > 0, s_enc, np.float32(1.0)).astype(np.float32)   # amax 0 -> S_enc = 1


def quantize(x, fmt: str | BlockFormat, scale_mode: str = "rceil", *, nonfinite: str = "propagate") -> BlockScaled:
    """Quantize a float32 array along its last axis (K) to a block-scaled format.

    ``fmt``: "nvfp4", "mxfp4", "mxfp8" (E4M3) or "mxfp8_e5m2". ``scale_mode`` ("rceil" or
    "floor") picks the UE8M0 exponent rule of the MX formats (NVFP4's UE4M3 scales are rounded to
    nearest and ignore it). For NVFP4 a 3-D array (experts, N, K) gets one global scale per expert.
    See the module docstring for the NaN / Inf policy.
    """
    fmt = get_format(fmt)
    _check_scale_mode(scale_mode)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    x = _check_float_input(x, fmt)
    if nonfinite == "raise":
        _raise_on_nonfinite(x)

    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // fmt.block_size, fmt.block_size))
    block_finite = np.all(np.isfinite(blocks), axis=-1)
    absb = np.where(block_finite[..., None], np.abs(blocks), np.float32(0))
    block_amax = np.max(absb, axis=-1).astype(np.float32)
    global_scale = None

    if fmt.scale_dtype == "ue8m0":
        scale_bytes = ue8m0_exponent(np.where(block_finite, block_amax, np.float32(np.inf)), fmt.element, scale_mode)
        exponent = scale_bytes.astype(np.int32) - UE8M0_BIAS
        scaled = np.ldexp(absb.astype(np.float64) * np.sign(blocks), -exponent[..., None]).astype(np.float32)
    else:  # NVFP4: two-level scaling, all arithmetic in float32 as the recipe states
        global_scale = _nvfp4_global_scale(np.abs(x), block_finite, per_expert=(x.ndim == 3))
        s_enc = global_scale.reshape(global_scale.shape + (1,) * (blocks.ndim - 1 - global_scale.ndim))
        block_scale = np.minimum(block_amax / np.float32(6.0) * s_enc, np.float32(448.0)).astype(np.float32)
        scale_bytes = block_scale.astype(E4M3).view(np.uint8)
        decode_scale = (decode_ue4m3(scale_bytes) / s_enc).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = (np.where(block_finite[..., None], blocks, 0) / decode_scale[..., None]).astype(np.float32)
        scaled = np.where(decode_scale[..., None] > 0, scaled, np.float32(0))   # scale rounded to 0
        scale_bytes = np.where(block_finite, scale_bytes, np.uint8(E4M3_NAN_BYTE)).astype(np.uint8)

    scaled = np.where(block_finite[..., None], scaled, np.float32(0))
    codes = encode_elements(scaled.reshape(x.shape), fmt.element)
    data = pack_fp4(codes) if fmt.packed else codes.view(fmt.element_dtype)
    return BlockScaled(data=data, scales=scale_bytes.astype(np.uint8), fmt=fmt, global_scale=global_scale)


def dequantize(q: BlockScaled, *, apply_global_scale: bool = True) -> np.ndarray:
    """float32 values of a ``BlockScaled`` tensor.

    ``element * block_scale`` is exact in float32 for every encodable pair. For NVFP4 with
    ``apply_global_scale`` the result is then divided by ``S_enc`` (one float32 rounding), as the
    recipe's ``q * fp32(s_block) / S_enc``; the grouped matmul instead keeps the exact product and
    applies the global scales to the accumulator (``expert_scales``).
    """
    fmt = q.fmt
    codes = q.element_codes()
    if codes.shape[-1] != q.scales.shape[-1] * fmt.block_size:
        raise ValueError(f"data holds K = {codes.shape[-1]} elements but scales cover "
                         f"{q.scales.shape[-1]} blocks of {fmt.block_size}")
    values = decode_elements(codes, fmt.element).astype(np.float64)
    scales = decode_scales(q.scales, fmt).astype(np.float64)
    out = values.reshape(q.scales.shape + (fmt.block_size,)) * scales[..., None]
    out = out.reshape(codes.shape)
    if apply_global_scale and q.global_scale is not None:
        s_enc = q.global_scale.reshape(q.global_scale.shape + (1,) * (out.ndim - q.global_scale.ndim))
        return (out.astype(np.float32) / s_enc).astype(np.float32)
    return out.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# The 128x4 scale-factor layout
# ----------------------------------------------------------------------------------------------
SF_ATOM_ROWS = 128   # rows of one atom: the MMA's 128-row side
SF_ATOM_COLS = 4     # scale columns of one atom: 4 bytes, one 32-bit TMEM word per row
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS
SF_LANES = 32        # rows of one 32-lane slice of an atom (one TMEM lane group)
SF_LANE_BYTES = 16   # bytes per lane: 4 slices x 4 scale columns
_ATOM_SHAPE = (SF_LANES, SF_ATOM_ROWS // SF_LANES, SF_ATOM_COLS)   # an atom's axes in the scale arrays


def scale_byte_offset(row, col, col_groups):
    """Byte offset of scale (row, col) in the 128x4 layout with ``col_groups = ceil(C/4)``.

    Plain integer arithmetic: runs on ints, integer numpy arrays, and inside Numba CUDA kernels
    (``cuda.jit(device=True)(scale_byte_offset)``)."""
    atom = (row // SF_ATOM_ROWS) * col_groups + col // SF_ATOM_COLS
    return (atom * SF_ATOM_BYTES + (row % SF_LANES) * SF_LANE_BYTES
            + ((row % SF_ATOM_ROWS) // SF_LANES) * SF_ATOM_COLS + col % SF_ATOM_COLS)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ScaleLayout128x4:
    """The "128x4" scale-factor layout that tcgen05 (``tcgen05.cp 32x128b.warpx4``) and cuBLAS read.

    Scales of an ``R x C`` matrix (C = K / block) are padded to 128-row bands and 4-column groups
    and stored as 512-byte atoms, band-major then column-group-major. Inside an atom, row ``r``
    lives in 32-lane slice ``(r % 128) // 32`` at lane ``r % 32``: the 16 bytes at
    ``lane * 16`` hold, for each of the four slices, the 4 scale bytes of that row, so one
    16-byte read gives a TMEM lane its four 32-row slices' 4-byte words::

        offset(r, c) = ((r // 128) * ceil(C/4) + c // 4) * 512
                       + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)

    As an array: ``(ceil(R/128), ceil(C/4), 32, 4, 4)`` indexed
    ``[r // 128, c // 4, r % 32, (r % 128) // 32, c % 4]``. Padding entries are zero.
    """

    rows: int
    cols: int

    @property
    def row_bands(self) -> int:
        return _ceil_div(self.rows, SF_ATOM_ROWS)

    @property
    def col_groups(self) -> int:
        return _ceil_div(self.cols, SF_ATOM_COLS)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.row_bands, self.col_groups, 32, 4, SF_ATOM_COLS)

    @property
    def nbytes(self) -> int:
        return self.row_bands * SF_ATOM_ROWS * self.col_groups * SF_ATOM_COLS

    def offset(self, r, c):
        """Byte offset of scale (r, c); works on ints and integer numpy arrays."""
        return scale_byte_offset(r, c, self.col_groups)


def scale_offset(r, c, cols: int):
    """``ScaleLayout128x4(_, cols).offset(r, c)``: the byte offset of scale (r, c)."""
    return ScaleLayout128x4(0, cols).offset(r, c)


def swizzle_scales(scales: np.ndarray) -> np.ndarray:
    """Linear ``(..., R, C)`` scale bytes -> the 128x4 layout ``(..., ceil(R/128), ceil(C/4), 32, 4, 4)``.

    Leading axes are kept (weights: ``(E, N, C)`` -> the 6-D ``(E, ceil(N/128), ceil(C/4), 32, 4, 4)``).
    """
    scales = np.asarray(scales)
    if scales.dtype != np.uint8:
        raise TypeError(f"scale bytes must be uint8, got {scales.dtype}")
    if scales.ndim < 2:
        raise ValueError(f"scales must be at least 2-D (rows, cols), got shape {scales.shape}")
    *lead, rows, cols = scales.shape
    layout = ScaleLayout128x4(rows, cols)
    padded = np.zeros((*lead, layout.row_bands * 128, layout.col_groups * 4), np.uint8)
    padded[..., :rows, :cols] = scales
    # [band, slice, lane, group, col] -> [band, group, lane, slice, col]
    atoms = padded.reshape(*lead, layout.row_bands, 4, 32, layout.col_groups, 4)
    n = len(lead)
    order = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    return np.ascontiguousarray(atoms.transpose(order))


def unswizzle_scales(swizzled: np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    """Inverse of ``swizzle_scales``; ``rows`` / ``cols`` crop the padding (default: keep it)."""
    swizzled = np.asarray(swizzled)
    if swizzled.ndim < 5 or swizzled.shape[-3:] != (32, 4, 4):
        raise ValueError(f"expected a (..., bands, groups, 32, 4, 4) scale array, got shape {swizzled.shape}")
    *lead, bands, groups, _, _, _ = swizzled.shape
    n = len(lead)
    order = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    linear = swizzled.transpose(order).reshape(*lead, bands * 128, groups * 4)
    rows = bands * 128 if rows is None else rows
    cols = groups * 4 if cols is None else cols
    if rows > bands * 128 or cols > groups * 4:
        raise ValueError(f"cannot crop ({rows}, {cols}) out of a padded ({bands * 128}, {groups * 4}) layout")
    return np.ascontiguousarray(linear[..., :rows, :cols])


# ----------------------------------------------------------------------------------------------
# Per-group padding of the token (A) scales
# ----------------------------------------------------------------------------------------------
def group_scale_offsets(a_offsets: np.ndarray) -> np.ndarray:
    """``a_scale_offsets[g] = sum_{j<g} ceil(n_j / 128) - a_offsets[g] // 128`` (uint32).

    Token ``m`` of slot ``g`` then has padded scale row
    ``(m - a_offsets[g]) + 128 * (a_offsets[g] // 128 + a_scale_offsets[g])``: every slot's
    scale rows start on a fresh 128-row band, so a tile never mixes two slots' scales.
    """
    a_offsets = np.asarray(a_offsets, dtype=np.int64)
    counts = np.diff(a_offsets)
    bands_before = np.concatenate([[0], np.cumsum(-(-counts // 128))])[:-1]
    return (bands_before - a_offsets[:-1] // 128).astype(np.uint32)


def padded_scale_rows(a_offsets: np.ndarray, a_scale_offsets: np.ndarray) -> np.ndarray:
    """Padded scale row of every token (int64 array of length ``a_offsets[-1]``)."""
    a_offsets = np.asarray(a_offsets, dtype=np.int64)
    a_scale_offsets = np.asarray(a_scale_offsets, dtype=np.int64)
    rows = np.empty(int(a_offsets[-1]), np.int64)
    for g in range(len(a_offsets) - 1):
        lo, hi = a_offsets[g], a_offsets[g + 1]
        rows[lo:hi] = np.arange(hi - lo) + 128 * (lo // 128 + a_scale_offsets[g])
    return rows


def pad_group_scales(scales: np.ndarray, a_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token scales ``(total_tokens, C)`` -> (``a_scales`` 5-D per-group padded, ``a_scale_offsets``).

    ``a_scales`` has shape ``(sum_g ceil(n_g/128), ceil(C/4), 32, 4, 4)``; padding is zero.
    """
    scales = np.asarray(scales)
    a_offsets = np.asarray(a_offsets)
    if scales.ndim != 2 or scales.shape[0] != int(a_offsets[-1]):
        raise ValueError(f"token scales must be (a_offsets[-1] = {int(a_offsets[-1])}, C), got {scales.shape}")
    a_scale_offsets = group_scale_offsets(a_offsets)
    counts = np.diff(a_offsets.astype(np.int64))
    total_rows = int(np.sum(-(-counts // 128))) * 128
    linear = np.zeros((total_rows, scales.shape[1]), np.uint8)
    linear[padded_scale_rows(a_offsets, a_scale_offsets)] = scales
    return swizzle_scales(linear), a_scale_offsets


def gather_group_scales(a_scales: np.ndarray, a_offsets: np.ndarray, a_scale_offsets: np.ndarray,
                        cols: int) -> np.ndarray:
    """Inverse of ``pad_group_scales``: the ``(total_tokens, cols)`` linear token scales."""
    linear = unswizzle_scales(a_scales, cols=cols)
    return linear[padded_scale_rows(a_offsets, a_scale_offsets)]
