"""Bit-level encoders and decoders for the Blackwell (SM100, ``tcgen05``) block-scaled MMA.

What is here, each field cited from the PTX ISA (9.x numbering; section 9.7.16/9.7.17
"TensorCore 5th Generation Family Instructions"):

* the 32-bit **instruction descriptor** of ``tcgen05.mma ... .block_scale`` for
  ``.kind::mxf8f6f4`` (ISA table "Instruction descriptor format for .kind::mxf8f6f4") and
  ``.kind::mxf4`` / ``.kind::mxf4nvf4`` (table "... for .kind::mxf4 and .kind::mxf4nvf4");
* the 64-bit **shared-memory matrix descriptor** of tcgen05 (table "Shared memory descriptor
  layout"), also the source operand of ``tcgen05.cp``;
* **tensor-memory addresses** (lane << 16 | column, "Tensor Memory Addressing") and where one
  128x4 scale-factor atom lands in tensor memory after ``tcgen05.cp.32x128b.warpx4``;
* the **legal (kind, cta_group, M, N)** shapes (table "Various combinations of .kind and shapes").

Two layers:

* ``encode_*``, ``with_scale_factor_ids``, ``tmem_address``: integer arithmetic only, no
  checks, no strings, so ``cuda.jit(device=True)(fn)`` (or ``numba.njit``) compiles them for use
  inside kernels. In a kernel they may return a signed 64-bit value; the bits are the same.
* ``BlockScaledInstrDesc``, ``SmemDescriptor``, ``check_*``: host-side, validated against the
  ISA (``ValueError`` naming the field and the allowed values), with ``decode`` for tests and the
  emulator.

Where the ISA disagrees with ``shared/spec/kernels.md``: the spec puts M at bits [24,29) as
``M >> 4`` (as CUTLASS's ``UMMA::InstrDescriptorBlockScaled`` does); the ISA tables for the
block-scaled kinds reserve bits 24-26 and put ``M >> 7`` in bits 27-28. For the only legal
block-scaled M values (128, 256) both give the same bits (M=128 -> bit 27, M=256 -> bit 28);
this module follows the ISA and rejects any other M.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gbs.formats import SF_ATOM_COLS, SF_ATOM_ROWS

# ----------------------------------------------------------------------------------------------
# Block-scaled MMA kinds
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockScaledKind:
    """One ``tcgen05.mma .kind::*.block_scale`` variant as this project issues it.

    ``scale_vec`` is the ``.scale_vec::NX`` qualifier the wrapper in ``tcgen05.py`` uses: the
    number of scale factors per row (of A) / column (of B) that one MMA consumes, each
    covering ``k_per_mma / scale_vec`` elements of K (ISA "Valid combinations of
    scale_vectorsize and shapes").
    """

    name: str
    k_per_mma: int                # dense K of one MMA (ISA "Various combinations of .kind and shapes")
    scale_vec: int                # .scale_vec::1X / 2X / 4X
    formats: dict = field(hash=False)   # element format name -> atype/btype code
    scale_types: tuple            # allowed scale types, ISA "Valid combinations of scale_vectorsize ..."
    mn_major_formats: frozenset   # formats that may be MN-major (transpose bits 15/16)

    @property
    def block_size(self) -> int:
        """Elements along K that share one scale factor."""
        return self.k_per_mma // self.scale_vec

    @property
    def scale_factor_ids(self) -> tuple:
        """Legal SFA_ID / SFB_ID values: the byte of the 32-bit TMEM word where this MMA's
        ``scale_vec`` scale bytes start (1X: any byte; 2X: byte 0 or 2; 4X: the whole word, 0)."""
        return tuple(range(0, SF_ATOM_COLS, self.scale_vec))

    @property
    def mmas_per_scale_atom(self) -> int:
        """MMAs along K served by one 128x4 scale atom (4 scale columns / ``scale_vec``)."""
        return SF_ATOM_COLS // self.scale_vec


# ISA table "Instruction descriptor format for .kind::mxf8f6f4": atype/btype codes.
_MXF8F6F4_FORMATS = {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}
# ISA table "... for .kind::mxf4 and .kind::mxf4nvf4": E2M1 = 1 (btype is 2 bits, bit 12 reserved).
_MXF4_FORMATS = {"e2m1": 1}

BLOCK_SCALED_KINDS: dict[str, BlockScaledKind] = {
    k.name: k
    for k in (
        # MXFP8 and W4A8 (E2M1 weights x E4M3 tokens); CUTLASS (UMMA::InstrDescriptor comment)
        # allows MN-major only for the 8-bit formats.
        BlockScaledKind("mxf8f6f4", 32, 1, _MXF8F6F4_FORMATS, ("ue8m0",), frozenset({"e4m3", "e5m2"})),
        # MXFP4: block 32, UE8M0 only; the ISA table fixes transpose to 0 (K-major only).
        BlockScaledKind("mxf4", 64, 2, _MXF4_FORMATS, ("ue8m0",), frozenset()),
        # NVFP4 (block 16, UE4M3) with scale_vec::4X; UE8M0 is also legal with 4X.
        BlockScaledKind("mxf4nvf4", 64, 4, _MXF4_FORMATS, ("ue4m3", "ue8m0"), frozenset()),
    )
}

SCALE_TYPES = {"ue4m3": 0, "ue8m0": 1}   # bit 23, "Scale Matrix Type, for both scale_A / scale_B"
MAJORS = {"k": 0, "mn": 1}               # bits 15/16 "Transpose A/B": 0 = K-major, 1 = MN-major


def get_kind(kind: str | BlockScaledKind) -> BlockScaledKind:
    """The ``BlockScaledKind`` named ``kind`` (``"mxf8f6f4"``, ``"mxf4"``, ``"mxf4nvf4"``)."""
    if isinstance(kind, BlockScaledKind):
        return kind
    if kind in BLOCK_SCALED_KINDS:
        return BLOCK_SCALED_KINDS[kind]
    raise ValueError(f"unknown block-scaled MMA kind {kind!r}; expected one of {sorted(BLOCK_SCALED_KINDS)}")


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------
CTA_GROUPS = (1, 2)
MMA_N_MAX = 256
# ISA table "Various combinations of .kind and shapes", rows mxf8f6f4 / mxf4 / mxf4nvf4, dense,
# no .ws (the same for all three kinds): cta_group -> (legal M values, N step).
_MMA_SHAPES = {1: ((128,), 8), 2: ((128, 256), 16)}


def check_cta_group(cta_group: int) -> int:
    if cta_group not in CTA_GROUPS:
        raise ValueError(f"cta_group must be 1 or 2, got {cta_group!r}")
    return cta_group


def legal_mma_m_values(cta_group: int) -> tuple:
    """M values of a block-scaled ``tcgen05.mma`` for ``cta_group`` (1: 128; 2: 128 or 256)."""
    return _MMA_SHAPES[check_cta_group(cta_group)][0]


def legal_mma_n_values(cta_group: int) -> tuple:
    """N values of a block-scaled ``tcgen05.mma``: cta_group 1: 8..256 step 8; 2: 16..256 step 16."""
    step = _MMA_SHAPES[check_cta_group(cta_group)][1]
    return tuple(range(step, MMA_N_MAX + 1, step))


def check_mma_shape(kind: str | BlockScaledKind, cta_group: int, m: int, n: int) -> None:
    """Raise ``ValueError`` unless (kind, cta_group, M, N) is a legal dense block-scaled MMA.

    ISA: cta_group::1 M = 128, N multiple of 8 in [8, 256]; cta_group::2 M = 128 or 256, N
    multiple of 16 in [16, 256]; the same for mxf8f6f4, mxf4 and mxf4nvf4 (K = 96 is sm_103a only).
    """
    kind = get_kind(kind)
    if m not in legal_mma_m_values(cta_group):
        raise ValueError(f"{kind.name} cta_group::{cta_group}: M must be one of "
                         f"{legal_mma_m_values(cta_group)}, got {m!r}")
    step = _MMA_SHAPES[cta_group][1]
    if not isinstance(n, int) or n % step or not step <= n <= MMA_N_MAX:
        raise ValueError(f"{kind.name} cta_group::{cta_group}: N must be a multiple of {step} in "
                         f"[{step}, {MMA_N_MAX}], got {n!r}")


# ----------------------------------------------------------------------------------------------
# Instruction descriptor (32 bits)
# ----------------------------------------------------------------------------------------------
# Bit positions, ISA tables "Instruction descriptor format for .kind::mxf8f6f4" and
# "... for .kind::mxf4 and .kind::mxf4nvf4". Bits 0-1, 3, 6, 24-26 reserved (0); bit 2 sparsity
# (dense only here); bit 12 reserved for mxf4/mxf4nvf4 (2-bit btype); bit 31 reserved
# (mxf8f6f4) or "K dimension" (mxf4*: 0 = dense K 64, 1 = K 96, sm_103a only).
IDESC_SPARSE_BIT = 2
IDESC_B_SF_ID_SHIFT = 4      # [4, 6)   Matrix B scale factor data ID
IDESC_A_FORMAT_SHIFT = 7     # [7, 10)  atype
IDESC_B_FORMAT_SHIFT = 10    # [10, 13) btype ([10, 12) for mxf4*)
IDESC_NEGATE_A_BIT = 13
IDESC_NEGATE_B_BIT = 14
IDESC_A_MAJOR_BIT = 15       # "Transpose A": 1 = MN-major
IDESC_B_MAJOR_BIT = 16
IDESC_N_SHIFT = 17           # [17, 23) N >> 3
IDESC_SCALE_TYPE_BIT = 23    # 0 UE4M3, 1 UE8M0
IDESC_M_SHIFT = 27           # [27, 29) M >> 7
IDESC_A_SF_ID_SHIFT = 29     # [29, 31) Matrix A scale factor data ID
IDESC_K_DIM_BIT = 31
_SF_ID_MASK = 0x3
_IDESC_USED_BITS = (
    (_SF_ID_MASK << IDESC_B_SF_ID_SHIFT) | (0x7 << IDESC_A_FORMAT_SHIFT) | (0x7 << IDESC_B_FORMAT_SHIFT)
    | (1 << IDESC_NEGATE_A_BIT) | (1 << IDESC_NEGATE_B_BIT) | (1 << IDESC_A_MAJOR_BIT)
    | (1 << IDESC_B_MAJOR_BIT) | (0x3F << IDESC_N_SHIFT) | (1 << IDESC_SCALE_TYPE_BIT)
    | (0x3 << IDESC_M_SHIFT) | (_SF_ID_MASK << IDESC_A_SF_ID_SHIFT))
_IDESC_SF_ID_BITS = (_SF_ID_MASK << IDESC_B_SF_ID_SHIFT) | (_SF_ID_MASK << IDESC_A_SF_ID_SHIFT)


def encode_block_scaled_instr_desc(a_format, b_format, a_major, b_major, negate_a, negate_b,
                                   m, n, scale_type, a_sf_id, b_sf_id):
    """Pack the fields of a dense block-scaled instruction descriptor (all integer codes, no
    checks; usable in kernels). ``m``/``n`` are the MMA shape, stored as ``M >> 7`` and
    ``N >> 3``; formats, majors and scale type are the ISA codes (``BlockScaledKind.formats``,
    ``MAJORS``, ``SCALE_TYPES``)."""
    return ((b_sf_id << IDESC_B_SF_ID_SHIFT) | (a_format << IDESC_A_FORMAT_SHIFT)
            | (b_format << IDESC_B_FORMAT_SHIFT) | (negate_a << IDESC_NEGATE_A_BIT)
            | (negate_b << IDESC_NEGATE_B_BIT) | (a_major << IDESC_A_MAJOR_BIT)
            | (b_major << IDESC_B_MAJOR_BIT) | ((n >> 3) << IDESC_N_SHIFT)
            | (scale_type << IDESC_SCALE_TYPE_BIT) | ((m >> 7) << IDESC_M_SHIFT)
            | (a_sf_id << IDESC_A_SF_ID_SHIFT))


def with_scale_factor_ids(idesc, a_sf_id, b_sf_id):
    """``idesc`` with its SFA_ID (bits 29-30) and SFB_ID (bits 4-5) replaced: the per-MMA part
    of the descriptor (which bytes of the scale words this MMA reads). Usable in kernels."""
    return ((idesc & ~_IDESC_SF_ID_BITS & 0xFFFFFFFF)
            | ((a_sf_id & _SF_ID_MASK) << IDESC_A_SF_ID_SHIFT)
            | ((b_sf_id & _SF_ID_MASK) << IDESC_B_SF_ID_SHIFT))


def _field_code(table: dict, value, what: str, kind_name: str) -> int:
    if value not in table:
        raise ValueError(f"{kind_name}: {what} must be one of {sorted(table)}, got {value!r}")
    return table[value]


@dataclass(frozen=True)
class BlockScaledInstrDesc:
    """The fields of a dense block-scaled ``tcgen05.mma`` instruction descriptor.

    ``m`` must be 128 or 256 and ``n`` a multiple of 8 in [8, 256] (the cta_group-specific
    limits are ``check_mma_shape``'s); ``a_sf_id``/``b_sf_id`` must be in
    ``kind.scale_factor_ids``.
    """

    kind: str
    m: int
    n: int
    a_format: str
    b_format: str
    scale_type: str
    a_sf_id: int = 0
    b_sf_id: int = 0
    a_major: str = "k"
    b_major: str = "k"
    negate_a: bool = False
    negate_b: bool = False

    def encode(self) -> int:
        """The 32-bit descriptor; ``ValueError`` for any field the ISA does not allow."""
        kind = get_kind(self.kind)
        a_code = _field_code(kind.formats, self.a_format, "a_format", kind.name)
        b_code = _field_code(kind.formats, self.b_format, "b_format", kind.name)
        scale_code = _field_code({s: SCALE_TYPES[s] for s in kind.scale_types}, self.scale_type,
                                 "scale_type", kind.name)
        majors = []
        for operand, fmt, major in (("a", self.a_format, self.a_major), ("b", self.b_format, self.b_major)):
            code = _field_code(MAJORS, major, f"{operand}_major", kind.name)
            if code and fmt not in kind.mn_major_formats:
                raise ValueError(f"{kind.name}: {operand}_major 'mn' is not supported for {fmt} "
                                 f"(MN-major allowed for {sorted(kind.mn_major_formats) or 'no format'})")
            majors.append(code)
        if self.m not in (128, 256):
            raise ValueError(f"{kind.name}: M must be 128 or 256 (descriptor field M >> 7), got {self.m!r}")
        if not isinstance(self.n, int) or self.n % 8 or not 8 <= self.n <= MMA_N_MAX:
            raise ValueError(f"{kind.name}: N must be a multiple of 8 in [8, {MMA_N_MAX}], got {self.n!r}")
        for name, sf_id in (("a_sf_id", self.a_sf_id), ("b_sf_id", self.b_sf_id)):
            if sf_id not in kind.scale_factor_ids:
                raise ValueError(f"{kind.name} (scale_vec::{kind.scale_vec}X): {name} must be one of "
                                 f"{kind.scale_factor_ids}, got {sf_id!r}")
        for name, flag in (("negate_a", self.negate_a), ("negate_b", self.negate_b)):
            if not isinstance(flag, bool):
                raise ValueError(f"{kind.name}: {name} must be a bool, got {flag!r}")
        return encode_block_scaled_instr_desc(a_code, b_code, majors[0], majors[1], int(self.negate_a),
                                              int(self.negate_b), self.m, self.n, scale_code,
                                              self.a_sf_id, self.b_sf_id)

    @classmethod
    def decode(cls, idesc: int, kind: str | BlockScaledKind) -> "BlockScaledInstrDesc":
        """Fields of ``idesc`` read as a ``kind`` descriptor (format codes are per kind);
        ``ValueError`` for reserved bits set, sparsity, K = 96, or any field ``encode`` rejects."""
        kind = get_kind(kind)
        if not isinstance(idesc, int) or not 0 <= idesc < 1 << 32:
            raise ValueError(f"instruction descriptor must be a 32-bit unsigned int, got {idesc!r}")
        if idesc & (1 << IDESC_SPARSE_BIT):
            raise ValueError(f"descriptor {idesc:#010x} has the sparsity bit (2) set; "
                             "only dense MMAs are supported")
        if idesc & (1 << IDESC_K_DIM_BIT):
            raise ValueError(f"descriptor {idesc:#010x} has bit 31 set (K = 96, sm_103a only)")
        if idesc & ~_IDESC_USED_BITS:
            raise ValueError(f"descriptor {idesc:#010x} has reserved bits set: "
                             f"{idesc & ~_IDESC_USED_BITS:#010x}")

        def name_of(table, code, what):
            for name, c in table.items():
                if c == code:
                    return name
            raise ValueError(f"{kind.name}: {what} code {code} is not one of {table}")

        field = lambda shift, width: (idesc >> shift) & ((1 << width) - 1)  # noqa: E731
        majors = {v: k for k, v in MAJORS.items()}
        desc = cls(
            kind=kind.name,
            m=field(IDESC_M_SHIFT, 2) << 7,
            n=field(IDESC_N_SHIFT, 6) << 3,
            a_format=name_of(kind.formats, field(IDESC_A_FORMAT_SHIFT, 3), "a_format"),
            b_format=name_of(kind.formats, field(IDESC_B_FORMAT_SHIFT, 3), "b_format"),
            scale_type=name_of(SCALE_TYPES, field(IDESC_SCALE_TYPE_BIT, 1), "scale_type"),
            a_sf_id=field(IDESC_A_SF_ID_SHIFT, 2),
            b_sf_id=field(IDESC_B_SF_ID_SHIFT, 2),
            a_major=majors[field(IDESC_A_MAJOR_BIT, 1)],
            b_major=majors[field(IDESC_B_MAJOR_BIT, 1)],
            negate_a=bool(field(IDESC_NEGATE_A_BIT, 1)),
            negate_b=bool(field(IDESC_NEGATE_B_BIT, 1)),
        )
        desc.encode()   # the kind's rules (scale type, SF IDs, majors, M) hold for decoded fields too
        return desc


# ----------------------------------------------------------------------------------------------
# Shared-memory matrix descriptor (64 bits)
# ----------------------------------------------------------------------------------------------
# ISA table "Shared memory descriptor layout" (tcgen05):
#   [0,14) start address, [16,30) leading dimension byte offset (LBO), [32,46) stride dimension
#   byte offset (SBO), each matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4;
#   [46,49) fixed constant 0b001; [49,52) matrix base offset; [52] LBO mode (0 relative,
#   1 absolute address); [53,61) fixed 0; [61,64) swizzle mode.
SMEM_DESC_ADDRESS_MASK = 0x3FFFF          # byte addresses/offsets are 18 bits, 16-byte units
SMEM_DESC_ALIGN = 16
SMEM_DESC_LBO_SHIFT = 16
SMEM_DESC_SBO_SHIFT = 32
SMEM_DESC_VERSION_SHIFT = 46
SMEM_DESC_VERSION = 0b001                 # the tcgen05 descriptor (wgmma's has 0 here)
SMEM_DESC_BASE_OFFSET_SHIFT = 49
SMEM_DESC_LBO_MODE_BIT = 52
SMEM_DESC_SWIZZLE_SHIFT = 61
_SMEM_DESC_FIELD_MASK = 0x3FFF            # 14-bit encoded fields
_SMEM_DESC_USED_BITS = (
    _SMEM_DESC_FIELD_MASK | (_SMEM_DESC_FIELD_MASK << SMEM_DESC_LBO_SHIFT)
    | (_SMEM_DESC_FIELD_MASK << SMEM_DESC_SBO_SHIFT) | (0x7 << SMEM_DESC_VERSION_SHIFT)
    | (0x7 << SMEM_DESC_BASE_OFFSET_SHIFT) | (1 << SMEM_DESC_LBO_MODE_BIT) | (0x7 << SMEM_DESC_SWIZZLE_SHIFT))

# Swizzle modes, bits 61-63 (SM100 encoding; 3, 5, 7 invalid). SM90 wgmma used 2 bits at 62-63
# with 1 = 128B, 2 = 64B, 3 = 32B: the same patterns shifted by one bit.
SWIZZLE_NONE = 0
SWIZZLE_128B_BASE32B = 1   # 128-byte swizzle with 32-byte atomicity (MN-major tf32 only)
SWIZZLE_128B = 2
SWIZZLE_64B = 4
SWIZZLE_32B = 6
SWIZZLE_MODES = {"none": SWIZZLE_NONE, "128b_base32b": SWIZZLE_128B_BASE32B, "128b": SWIZZLE_128B,
                 "64b": SWIZZLE_64B, "32b": SWIZZLE_32B}
# Bytes after which a swizzle pattern repeats (ISA "Starting address of repeating pattern"):
# the base offset is 0 when the pattern starts on this boundary.
SWIZZLE_PATTERN_BYTES = {SWIZZLE_128B: 1024, SWIZZLE_64B: 512, SWIZZLE_32B: 256}


def encode_smem_descriptor(start_address, leading_byte_offset, stride_byte_offset, swizzle_mode,
                           base_offset, lbo_mode):
    """Pack a tcgen05 shared-memory descriptor (byte values; no checks; usable in kernels).

    ``start_address`` is the shared-window (``shared::cta``) byte address of the matrix; LBO/SBO
    are byte offsets; the three are stored as ``(x & 0x3FFFF) >> 4``. Bits 46-48 get 0b001.
    """
    return (((start_address & SMEM_DESC_ADDRESS_MASK) >> 4)
            | (((leading_byte_offset & SMEM_DESC_ADDRESS_MASK) >> 4) << SMEM_DESC_LBO_SHIFT)
            | (((stride_byte_offset & SMEM_DESC_ADDRESS_MASK) >> 4) << SMEM_DESC_SBO_SHIFT)
            | (SMEM_DESC_VERSION << SMEM_DESC_VERSION_SHIFT)
            | ((base_offset & 0x7) << SMEM_DESC_BASE_OFFSET_SHIFT)
            | ((lbo_mode & 0x1) << SMEM_DESC_LBO_MODE_BIT)
            | ((swizzle_mode & 0x7) << SMEM_DESC_SWIZZLE_SHIFT))


@dataclass(frozen=True)
class SmemDescriptor:
    """A tcgen05 shared-memory matrix descriptor, field by field (bytes, not 16-byte units).

    K-major operands (ISA "Leading/Stride dimension byte offset"): SBO = offset between 8-row
    groups; LBO = offset between the two 16-byte core-matrix columns of a K step without
    swizzle, "not used, assumed 1" with swizzle. ``swizzle`` is one of ``SWIZZLE_MODES``' values.
    """

    start_address: int
    leading_byte_offset: int
    stride_byte_offset: int
    swizzle: int = SWIZZLE_NONE
    base_offset: int = 0
    lbo_mode: int = 0   # 0: LBO is a byte offset; 1: an absolute byte address

    def encode(self) -> int:
        """The 64-bit descriptor; ``ValueError`` for misaligned / out-of-range fields."""
        for name in ("start_address", "leading_byte_offset", "stride_byte_offset"):
            value = getattr(self, name)
            if (not isinstance(value, int) or not 0 <= value <= SMEM_DESC_ADDRESS_MASK
                    or value % SMEM_DESC_ALIGN):
                raise ValueError(f"{name} must be a multiple of {SMEM_DESC_ALIGN} in "
                                 f"[0, {SMEM_DESC_ADDRESS_MASK}], got {value!r}")
        if self.swizzle not in SWIZZLE_MODES.values():
            raise ValueError(f"swizzle must be one of {SWIZZLE_MODES}, got {self.swizzle!r}")
        if self.base_offset not in range(8):
            raise ValueError(f"base_offset must be in [0, 8), got {self.base_offset!r}")
        if self.base_offset and self.swizzle == SWIZZLE_NONE:
            raise ValueError("base_offset is only meaningful with a swizzle mode (ISA: 0 for no swizzle)")
        if self.lbo_mode not in (0, 1):
            raise ValueError(f"lbo_mode must be 0 (relative offset) or 1 (absolute address), "
                             f"got {self.lbo_mode!r}")
        return encode_smem_descriptor(self.start_address, self.leading_byte_offset, self.stride_byte_offset,
                                      self.swizzle, self.base_offset, self.lbo_mode)

    @classmethod
    def decode(cls, desc: int) -> "SmemDescriptor":
        """Fields of a 64-bit descriptor; ``ValueError`` unless bits 46-48 are 0b001 and the
        fixed-zero bits (14-15, 30-31, 53-60) are clear."""
        if not isinstance(desc, int) or not 0 <= desc < 1 << 64:
            raise ValueError(f"shared-memory descriptor must be a 64-bit unsigned int, got {desc!r}")
        version = (desc >> SMEM_DESC_VERSION_SHIFT) & 0x7
        if version != SMEM_DESC_VERSION:
            raise ValueError(f"descriptor {desc:#018x}: bits 46-48 must be 0b001 (tcgen05), "
                             f"got {version:#05b}")
        if desc & ~_SMEM_DESC_USED_BITS:
            raise ValueError(f"descriptor {desc:#018x} has fixed-zero bits set: "
                             f"{desc & ~_SMEM_DESC_USED_BITS:#018x}")
        return cls(
            start_address=(desc & _SMEM_DESC_FIELD_MASK) << 4,
            leading_byte_offset=((desc >> SMEM_DESC_LBO_SHIFT) & _SMEM_DESC_FIELD_MASK) << 4,
            stride_byte_offset=((desc >> SMEM_DESC_SBO_SHIFT) & _SMEM_DESC_FIELD_MASK) << 4,
            swizzle=(desc >> SMEM_DESC_SWIZZLE_SHIFT) & 0x7,
            base_offset=(desc >> SMEM_DESC_BASE_OFFSET_SHIFT) & 0x7,
            lbo_mode=(desc >> SMEM_DESC_LBO_MODE_BIT) & 0x1,
        )


def swizzle_base_offset(pattern_start_address: int, swizzle: int) -> int:
    """The descriptor's base offset for a swizzle pattern starting at ``pattern_start_address``:
    0 on the pattern's natural boundary, else ``(addr >> 7) & 7`` (ISA formula)."""
    if swizzle not in SWIZZLE_PATTERN_BYTES:
        raise ValueError(f"swizzle must be one of 128B/64B/32B ({sorted(SWIZZLE_PATTERN_BYTES)}), "
                         f"got {swizzle!r}")
    if pattern_start_address % SWIZZLE_PATTERN_BYTES[swizzle] == 0:
        return 0
    return (pattern_start_address >> 7) & 0x7


# ----------------------------------------------------------------------------------------------
# Tensor memory
# ----------------------------------------------------------------------------------------------
TMEM_LANE_PARTITION = 32      # lanes one warp can access: warp w, lanes [32 * (w % 4), +32)
TMEM_COLUMNS = 512            # 32-bit cells per lane on sm_100a
TMEM_ALLOC_MIN_COLUMNS = 32   # allocation unit; the count must be a power of 2
TMEM_LANE_SHIFT = 16          # address = lane << 16 | column ("Tensor Memory Addressing")


def tmem_address(lane, column):
    """Tensor-memory address of (lane, column): ``lane << 16 | column``. Usable in kernels."""
    return (lane << TMEM_LANE_SHIFT) | column


def tmem_lane(address: int) -> int:
    return (address >> TMEM_LANE_SHIFT) & 0xFFFF


def tmem_column(address: int) -> int:
    return address & 0xFFFF


def check_tmem_alloc_columns(ncols: int) -> int:
    """``ncols`` for ``tcgen05.alloc``/``dealloc``: a power of 2 in [32, 512] (ISA "Tensor Memory
    Allocation"); ``ValueError`` otherwise."""
    if (not isinstance(ncols, int) or not TMEM_ALLOC_MIN_COLUMNS <= ncols <= TMEM_COLUMNS
            or ncols & (ncols - 1)):
        raise ValueError(f"tensor-memory allocation must be a power of 2 in "
                         f"[{TMEM_ALLOC_MIN_COLUMNS}, {TMEM_COLUMNS}] columns, got {ncols!r}")
    return ncols


# One 128x4 scale atom (gbs.formats.ScaleLayout128x4, 512 bytes = 32 rows of 16 bytes) copied by
# tcgen05.cp.32x128b.warpx4: shared-memory row j (16 bytes) goes to TMEM lane j of each of the
# four 32-lane partitions (the ISA requires scales "duplicated to all 32 lane partitions"),
# its four 32-bit words to four consecutive columns. Word w of row j holds the 4 scale bytes of
# atom row 32*w + j, so atom row r sits in column base + r // 32, lane r % 32, byte = scale column.
SCALE_ATOM_TMEM_COLUMNS = SF_ATOM_ROWS // TMEM_LANE_PARTITION   # 4: tcgen05.cp always writes 4 columns


def scale_atom_tmem_columns(base_column: int) -> range:
    """TMEM columns one 128x4 scale atom occupies when copied to ``base_column`` (all 128 lanes)."""
    return range(base_column, base_column + SCALE_ATOM_TMEM_COLUMNS)


def scale_atom_tmem_cell(row: int, scale_col: int) -> tuple:
    """(column offset from the atom's base column, lane within each 32-lane partition, byte in
    the 32-bit cell) of scale (``row``, ``scale_col``) of one 128x4 atom."""
    if not 0 <= row < SF_ATOM_ROWS or not 0 <= scale_col < SF_ATOM_COLS:
        raise ValueError(f"atom coordinates must be row in [0, {SF_ATOM_ROWS}), scale_col in "
                         f"[0, {SF_ATOM_COLS}); got ({row!r}, {scale_col!r})")
    return row // TMEM_LANE_PARTITION, row % TMEM_LANE_PARTITION, scale_col


def mma_scale_position(kind: str | BlockScaledKind, mma_index: int) -> tuple:
    """For the ``mma_index``-th MMA along K of a run of scale atoms copied to consecutive 4-column
    slots: (column offset of its atom from the first atom's column, its scale factor ID).

    mxf8f6f4 (1X): 4 MMAs per atom, IDs 0,1,2,3; mxf4 (2X): 2 per atom, IDs 0,2; mxf4nvf4 (4X):
    one atom per MMA, ID 0.
    """
    kind = get_kind(kind)
    if not isinstance(mma_index, int) or mma_index < 0:
        raise ValueError(f"mma_index must be a non-negative int, got {mma_index!r}")
    atom, within = divmod(mma_index, kind.mmas_per_scale_atom)
    return atom * SCALE_ATOM_TMEM_COLUMNS, within * kind.scale_vec
