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
* FP4 packing: two codes per byte, element ``2i`` in the low nibble.

NaN / Inf policy (``nonfinite=``):

* ``"propagate"`` (default, what hardware converters do): a block holding a NaN or an Inf gets a
  NaN scale (UE8M0 0xFF, UE4M3 0x7F) and its element codes are zero, so the whole block
  dequantizes to NaN and any product with it is NaN. NVFP4's global amax ignores such blocks.
* ``"raise"``: a ``ValueError`` naming the first non-finite element.
"""
from __future__ import annotations

import dataclasses
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
