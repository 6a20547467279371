"""Block-scaled formats: encodings, quantize / dequantize, FP4 packing, the 128x4 scale layout.

Formats (``FORMATS``), scaled in blocks along the last axis (K), and plain bf16 (tokens of W4A16, no scales):

=============  =========  =====  ======  ==========================================
name           elements   block  scale   notes
=============  =========  =====  ======  ==========================================
``nvfp4``      E2M1       16     UE4M3   plus one FP32 global scale per tensor / expert
``mxfp4``      E2M1       32     UE8M0
``mxfp8``      E4M3       32     UE8M0   OCP "fn" E4M3, max 448
``mxfp8_e5m2`` E5M2       32     UE8M0
``bf16``       BF16       --     none    unscaled (``scaled`` is False, ``block_size`` 0): tokens as they are
=============  =========  =====  ======  ==========================================

Conventions (``../shared/spec/formats.md``):

* Elements round to nearest even and saturate to the finite maximum (``cvt.rn.satfinite``); bf16 too
  (finite float32 values past bf16's maximum give it, not Inf).
* UE8M0 exponents: ``"rceil"`` (default, never clips: ``e = ceil(log2(amax / max_elem))``) or
  ``"floor"`` (OCP MX v1.0: ``e = floor(log2(amax)) - emax_elem``, can clip the block maximum),
  computed exactly from the float bits, clamped to [-127, 127]; an all-zero block gets 0x00.
* FP4 packing: two codes per byte, element ``2i`` in the low nibble (``LAYOUT_PACKED``); FP4
  weights may be re-laid once for the H200 kernels (``gbs.layouts``).

NaN / Inf policy (``nonfinite=``):

* ``"propagate"`` (default, what hardware converters do): a block holding a NaN or an Inf gets a
  NaN scale (UE8M0 0xFF, UE4M3 0x7F) and its element codes are zero, so the whole block
  dequantizes to NaN and any product with it is NaN. NVFP4's global amax ignores such blocks.
  bf16 has no blocks: NaN and Inf stay bf16 NaN and Inf, element by element.
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
    "bf16": (BF16, 16, 3.3895313892515355e38, 127),
}
E4M3_NAN_BYTE = 0x7F   # S.1111.111 with S = 0: the UE4M3 NaN
UE8M0_NAN_BYTE = 0xFF
UE8M0_BIAS = 127
NVFP4_GLOBAL_NUMERATOR = 448.0 * 6.0   # S_enc = 448 * 6 / amax(tensor)

SCALE_MODES = ("rceil", "floor")
NONFINITE_POLICIES = ("propagate", "raise")


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled recipe: element encoding, block length along K, scale encoding (or an unscaled
    format: bf16, ``scale_dtype`` "none" and ``block_size`` 0, so that an unguarded division by it fails)."""

    name: str
    element: str       # "e2m1" | "e4m3" | "e5m2" | "bf16"
    block_size: int    # elements along K sharing one scale; 0 when not scaled
    scale_dtype: str   # "ue4m3" | "ue8m0" | "none"

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
    def scaled(self) -> bool:
        """Has block scales (every format but bf16)."""
        return self.scale_dtype != "none"

    @property
    def has_global_scale(self) -> bool:
        return self.scale_dtype == "ue4m3"

    def row_bytes(self, k: int) -> int:
        """Bytes of one K-long row of elements."""
        return k * self.element_bits // 8

    def scale_cols(self, k: int) -> int:
        """Scale columns (blocks) of one K-long row; 0 when not scaled."""
        return k // self.block_size if self.scaled else 0


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("nvfp4", "e2m1", 16, "ue4m3"),
        BlockFormat("mxfp4", "e2m1", 32, "ue8m0"),
        BlockFormat("mxfp8", "e4m3", 32, "ue8m0"),
        BlockFormat("mxfp8_e5m2", "e5m2", 32, "ue8m0"),
        BlockFormat("bf16", "bf16", 0, "none"),
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
    if fmt.scaled and x.shape[-1] % fmt.block_size:
        raise ValueError(f"K = {x.shape[-1]} is not a multiple of the {fmt.name} block size {fmt.block_size}")
    return x.astype(np.float32, copy=False)


def _raise_on_nonfinite(x: np.ndarray) -> None:
    bad = np.argwhere(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"non-finite value {x[tuple(bad[0])]} at index {tuple(int(i) for i in bad[0])} "
                         "(nonfinite='raise'; nonfinite='propagate' encodes it: a NaN block scale, bf16's NaN "
                         "or Inf)")


# ----------------------------------------------------------------------------------------------
# Element and scale encodings
# ----------------------------------------------------------------------------------------------
def _code_dtype(element: str) -> np.dtype:
    """The unsigned integers raw codes of ``element`` are held in: uint8, uint16 for bf16."""
    return np.dtype(np.uint16) if _ELEMENTS[element][1] == 16 else np.dtype(np.uint8)


def encode_elements(x: np.ndarray, element: str) -> np.ndarray:
    """Round float32 values to the element encoding (RNE, saturating); returns raw codes as uint8
    (uint16 for bf16).

    E2M1 codes are 4-bit (0..15, bit 3 = sign), unpacked. NaN inputs are not expected here (the
    block's scale carries NaN); ml_dtypes would map NaN to -0.0 for E2M1.
    """
    dtype, _, max_value, _ = _ELEMENTS[element]
    # E4M3/E5M2 casts in ml_dtypes do not saturate (480 -> NaN): clip first. E2M1's cast does.
    clipped = np.clip(x, -max_value, max_value).astype(np.float32)
    codes = clipped.astype(dtype).view(_code_dtype(element))
    return codes & np.uint8(0x0F) if element == "e2m1" else codes


def decode_elements(codes: np.ndarray, element: str) -> np.ndarray:
    """float32 values of raw element codes (uint16 for bf16; E2M1 codes in the low nibble, upper bits ignored)."""
    dtype = _ELEMENTS[element][0]
    codes = np.asarray(codes)
    if element == "bf16" and codes.dtype.itemsize == 1:
        raise TypeError("bf16 codes are 16-bit: view bf16 data as uint16, not as bytes")
    codes = codes.astype(_code_dtype(element), copy=False)
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
    if not fmt.scaled:
        raise ValueError(f"{fmt.name} has no block scales to decode")
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
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockScaled:
    """A block-scaled tensor quantized along its last axis (K).

    ``data``: element codes, (..., K/2) uint8 for FP4 (packed), (..., K) E4M3/E5M2/bf16 otherwise.
    ``scales``: the linear scale bytes, (..., K/block) uint8 (UE8M0 or UE4M3 bytes); (..., 0) for bf16.
    ``global_scale``: NVFP4 only: the float32 encode scale ``S_enc = 448*6/amax`` of the tensor,
    shape () for 2-D input and (E,) (one per expert) for 3-D input; ``None`` for MX formats and bf16.
    """

    data: np.ndarray
    scales: np.ndarray
    fmt: BlockFormat
    global_scale: np.ndarray | None = None

    @property
    def k(self) -> int:
        return self.data.shape[-1] * 2 if self.fmt.packed else self.data.shape[-1]

    @property
    def global_decode_scale(self) -> np.ndarray:
        """``1 / S_enc`` (float32); 1.0 for MX formats and bf16. The grouped matmul folds this into
        ``expert_scales``."""
        if self.global_scale is None:
            return np.float32(1.0)
        return (1.0 / self.global_scale.astype(np.float64)).astype(np.float32)

    def element_codes(self) -> np.ndarray:
        """Unpacked element codes as uint8 (uint16 for bf16), shape (..., K)."""
        return unpack_fp4(self.data) if self.fmt.packed else self.data.view(_code_dtype(self.fmt.element))


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

    ``fmt``: "nvfp4", "mxfp4", "mxfp8" (E4M3), "mxfp8_e5m2" or "bf16" (the values rounded to bf16, no
    scales). ``scale_mode`` ("rceil" or "floor") picks the UE8M0 exponent rule of the MX formats (NVFP4's
    UE4M3 scales are rounded to nearest and ignore it, bf16 has none). For NVFP4 a 3-D array (experts, N, K)
    gets one global scale per expert. See the module docstring for the NaN / Inf policy.
    """
    fmt = get_format(fmt)
    _check_scale_mode(scale_mode)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    x = _check_float_input(x, fmt)
    if nonfinite == "raise":
        _raise_on_nonfinite(x)
    if not fmt.scaled:   # bf16: RNE, finite values saturating, NaN and Inf kept as they are
        finite = np.clip(x, -fmt.element_max, fmt.element_max).astype(np.float32)
        data = np.where(np.isfinite(x), finite, x).astype(fmt.element_dtype)
        return BlockScaled(data=data, scales=np.zeros(x.shape[:-1] + (0,), np.uint8), fmt=fmt)

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

    ``element * block_scale`` is exact in float32 for every encodable pair; bf16 values are returned
    as they are. For NVFP4 with ``apply_global_scale`` the result is then divided by ``S_enc`` (one
    float32 rounding), as the recipe's ``q * fp32(s_block) / S_enc``; the grouped matmul instead keeps
    the exact product and applies the global scales to the accumulator (``expert_scales``).
    """
    fmt = q.fmt
    if not fmt.scaled:
        if q.scales.shape[-1]:
            raise ValueError(f"{fmt.name} has no block scales, got scales of shape {q.scales.shape}")
        return q.data.astype(np.float32)
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
SF_ATOM_SHAPE = (SF_LANES, SF_ATOM_ROWS // SF_LANES, SF_ATOM_COLS)   # an atom's axes in the scale arrays


def scale_byte_offset(row, col, col_groups):
    """Byte offset of scale (row, col) in the 128x4 layout with ``col_groups = ceil(C/4)``.

    Plain integer arithmetic: runs on ints, integer numpy arrays, and inside Numba CUDA kernels
    (``cuda.jit(device=True)(scale_byte_offset)``)."""
    atom = (row // SF_ATOM_ROWS) * col_groups + col // SF_ATOM_COLS
    return (atom * SF_ATOM_BYTES + (row % SF_LANES) * SF_LANE_BYTES
            + ((row % SF_ATOM_ROWS) // SF_LANES) * SF_ATOM_COLS + col % SF_ATOM_COLS)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, b > 0."""
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
        return ceil_div(self.rows, SF_ATOM_ROWS)

    @property
    def col_groups(self) -> int:
        return ceil_div(self.cols, SF_ATOM_COLS)

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
