"""H200 operand byte layouts: FP4 bytes (and NVFP4's UE4M3 scales) re-laid once so that the H200 kernels decode and
stream them faster. The formats themselves (encodings, packing, the 128x4 scale layout) are ``gbs.formats``.

* ``LAYOUT_PACKED``: ``pack_fp4``'s nibbles, as quantized; every format's default and the only layout of FP8.
* ``E2M1H200Order`` (``"e2m1_h200"``): the bits of each 32-bit word permuted so the decode to bf16 takes 9 instead of
  13 integer instructions per word; NVFP4 scales as ``UE4M3H200Scales`` codes. Weights and tokens.
* ``E2M1H200TiledOrder`` (``"e2m1_h200_tiled"``): the same bits, each 128-row x 128-byte TMA box contiguous. Weights.
* ``E2M1H200FusedOrder`` (``"e2m1_h200_fused"``): tiled, each box followed by its K slice's scale atoms. Weights.
* ``E2M1E4M3Order`` (``"e2m1_e4m3"``): the in-kernel FP8 route's word order. MXFP4 tokens and weights.
* ``E4M3FoldedScales`` (``"e4m3_folded"``): MXFP8 bytes as quantized whose UE8M0 scales repeat over each 128-K
  chunk (per token row; per 128-row weight tile): MXFP4 folded ahead (``gbs.fp8_route.fold_problem``), which the
  FP8 route multiplies with E4M3 ``wgmma`` straight from the ring. Tokens and weights.

Each is a small class with ``swizzle`` / ``unswizzle`` (numpy, host side); ``gbs.numba_kernels.relayout`` does the
same on the GPU. Design: ``docs/design/formats.md``, "H200 operand layouts".
"""
from __future__ import annotations

import numpy as np

from .formats import SF_ATOM_COLS, SF_ATOM_SHAPE, decode_ue4m3, get_format

LAYOUT_PACKED = "packed"                    # pack_fp4's nibbles, as quantized (every format's default)
LAYOUT_E2M1_H200 = "e2m1_h200"              # E2M1H200Order: a one-time re-layout for the H200 kernels
LAYOUT_E2M1_H200_TILED = "e2m1_h200_tiled"  # E2M1H200TiledOrder: the same bits, weights stored box by box
LAYOUT_E2M1_H200_FUSED = "e2m1_h200_fused"  # E2M1H200FusedOrder: each box followed by its block scales
LAYOUT_E2M1_E4M3 = "e2m1_e4m3"              # E2M1E4M3Order: the FP8 route's word order (MXFP4, both operands)
LAYOUT_E4M3_FOLDED = "e4m3_folded"          # E4M3FoldedScales: MXFP8 with one scale per 128-K chunk (MXFP4 folded)


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


class _WordBitOrder:
    """A fixed permutation of the 32 bits of every aligned 4-byte word of packed E2M1 bytes (8 elements, element i
    in nibble i after ``pack_fp4``), applied with per-byte tables (``byte_tables``; ``_TABLES`` is set below, once the
    destinations are known)."""

    _TABLES: tuple[np.ndarray, np.ndarray]   # (forward, inverse) byte tables, (4, 256) uint32 each

    @classmethod
    def _words(cls, packed: np.ndarray) -> np.ndarray:
        packed = np.asarray(packed)
        if packed.dtype != np.uint8:   # a value cast would corrupt the codes: bytes only
            raise TypeError(f"{cls.__name__} takes packed FP4 bytes as uint8, got {packed.dtype}")
        packed = np.ascontiguousarray(packed)
        if packed.ndim < 1 or packed.shape[-1] % 4:
            raise ValueError(f"{cls.__name__} works on 4-byte words: the last axis ({packed.shape[-1:]}) "
                             "must be a multiple of 4 bytes (K a multiple of 8)")
        return packed.view("<u4")

    @classmethod
    def byte_tables(cls, inverse: bool = False) -> np.ndarray:
        """(4, 256) uint32: for byte ``i`` of a little-endian word and each of its 256 values, that byte's
        bits in their places in the re-laid word (``inverse``: back to ``pack_fp4`` order). A word's image is
        the OR of its four bytes' entries (``gbs.numba_kernels.relayout`` reads them on the device)."""
        return cls._TABLES[inverse].copy()

    @classmethod
    def _permute(cls, packed: np.ndarray, inverse: bool) -> np.ndarray:
        words = cls._words(packed)
        tables = cls._TABLES[inverse]   # per byte of the word: its 256 values' destination bits
        out = tables[0][words & np.uint32(0xFF)]
        for i in range(1, 4):
            out |= tables[i][(words >> np.uint32(8 * i)) & np.uint32(0xFF)]
        return out.view(np.uint8)

    @classmethod
    def swizzle(cls, packed: np.ndarray) -> np.ndarray:
        """``pack_fp4`` bytes (..., K/2) -> the same shape in this order (a new array)."""
        return cls._permute(packed, inverse=False)

    @classmethod
    def unswizzle(cls, ordered: np.ndarray, shape=None) -> np.ndarray:
        """Inverse of ``swizzle`` (``shape``: the logical shape, the stored one here)."""
        return cls._permute(ordered, inverse=True)


class E2M1H200Order(_WordBitOrder):
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
    and is the one ``gbs.plan.h200_weight_layout`` recommends.

    The kernels' producer loads a weight stage as a TMA box of 128 rows x one 128-byte K slice (16 KB).
    In row-major weights those are 128 pieces of 128 B, one per row, ``K / 2`` bytes apart; here each box
    is 16 KB of contiguous memory, so a stage is one DRAM stream instead of 128 (why that is faster is
    inferred, not measured: fewer DRAM pages opened per byte). Boxes are ordered (128-row tile, K slice),
    rows inside a box as before: byte ``c`` of row ``r`` of an expert's (N, K/2) matrix sits at byte
    ``box_row * 128 + c % 128`` of the expert's slab, ``box_row = (r // 128 * (K/2 // 128) + c // 128) * 128
    + r % 128`` (the kernels' tensor map reads the slabs as rows of 128 B). So ``b`` keeps its shape and
    dtype, padded to whole boxes where N or K/2 is not a multiple of ``BOX_ROWS`` / ``BOX_BYTES`` (``padded_shape``:
    zero bytes, which decode to zeros whatever their scales; gpt-oss's N = K = 2880 are not) and
    the scales keep the 128x4 layout (UE4M3 codes as in ``E2M1H200Order``). The kernels read it through a
    2-D tensor map over all the boxes (``h200_stream.tensor_map_args``); wider or narrower weight tiles (256
    or 8-64 rows, 64-byte K slices with FP8 tokens) are whole boxes or parts of them. Weights only: tokens
    are not tiled.

    NVFP4 weights stream faster tiled than row-major; MXFP4 weights tiled with separate scales stream slower
    (evidence: tiled-weight-layout).
    """

    BOX_ROWS = 128     # weight rows per box: the streaming kernel's M tile (``h200_ring.TILE_M_ROWS``)
    BOX_BYTES = 128    # bytes of K per box row: one FP4 K slice of 256 elements (``h200_ring.K_SLICE_BYTES``)
    ROLES = ("weights",)
    TILED = True

    @classmethod
    def whole_boxes(cls, shape) -> bool:
        """Whether weights of ``shape`` (..., N, K/2 bytes) tile into whole boxes."""
        return len(shape) >= 2 and not (shape[-2] % cls.BOX_ROWS or shape[-1] % cls.BOX_BYTES)

    @classmethod
    def padded_shape(cls, shape) -> tuple[int, ...]:
        """The stored shape of weights of logical ``shape`` (..., N, K/2 bytes): N and K/2 rounded up to whole
        boxes (gpt-oss: N 2880 -> 2944 rows, K 2880 -> 3072 elements). The pad is zero bytes: E2M1 zeros."""
        *lead, n, kb = shape
        return (*lead, -(-n // cls.BOX_ROWS) * cls.BOX_ROWS, -(-kb // cls.BOX_BYTES) * cls.BOX_BYTES)

    @classmethod
    def check_shape(cls, shape, fmt=None) -> None:
        """ValueError unless ``shape`` (..., N, K/2 bytes) is a stored shape: whole boxes (``fmt``: unused)."""
        if not cls.whole_boxes(shape):
            raise ValueError(f"{LAYOUT_E2M1_H200_TILED!r} stores weights in boxes of {cls.BOX_ROWS} rows x "
                             f"{cls.BOX_BYTES} bytes: a stored array is (..., N, K/2) padded to a multiple of "
                             f"{cls.BOX_ROWS} rows and {cls.BOX_BYTES} bytes (padded_shape), got {tuple(shape)}")

    @classmethod
    def tile(cls, rows: np.ndarray) -> np.ndarray:
        """(..., N, K/2) bytes -> ``padded_shape`` with each box contiguous (a new array; bytes unchanged, the
        pad zero)."""
        rows = np.asarray(rows)
        if rows.ndim < 2:
            raise ValueError(f"tile takes (..., N, K/2) bytes, got shape {rows.shape}")
        padded = np.zeros(cls.padded_shape(rows.shape), rows.dtype)
        padded[..., :rows.shape[-2], :rows.shape[-1]] = rows
        *lead, n, kb = padded.shape
        boxes = padded.reshape(*lead, n // cls.BOX_ROWS, cls.BOX_ROWS, kb // cls.BOX_BYTES, cls.BOX_BYTES)
        return np.ascontiguousarray(np.swapaxes(boxes, -3, -2)).reshape(padded.shape)

    @classmethod
    def untile(cls, tiled: np.ndarray, shape=None) -> np.ndarray:
        """Inverse of ``tile``: the rows, cut to the logical ``shape`` (..., N, K/2) where given."""
        tiled = np.asarray(tiled)
        cls.check_shape(tiled.shape)
        *lead, n, kb = tiled.shape
        boxes = tiled.reshape(*lead, n // cls.BOX_ROWS, kb // cls.BOX_BYTES, cls.BOX_ROWS, cls.BOX_BYTES)
        rows = np.swapaxes(boxes, -3, -2).reshape(tiled.shape)
        if shape is not None:
            if cls.padded_shape(shape) != tiled.shape:
                raise ValueError(f"tiled weights {tiled.shape} do not store weights of shape {tuple(shape)}")
            rows = rows[..., :shape[-2], :shape[-1]]
        return np.ascontiguousarray(rows)

    @classmethod
    def swizzle(cls, packed: np.ndarray) -> np.ndarray:
        """``pack_fp4`` weight bytes (..., N, K/2) -> ``padded_shape`` in this order (a new array)."""
        return cls.tile(super().swizzle(packed))

    @classmethod
    def unswizzle(cls, ordered: np.ndarray, shape=None) -> np.ndarray:
        """Inverse of ``swizzle`` (``shape``: the logical (..., N, K/2), where the stored one is padded)."""
        return super().unswizzle(cls.untile(ordered, shape))


class E2M1H200FusedOrder(E2M1H200TiledOrder):
    """``E2M1H200TiledOrder``'s boxes, each followed by its block scales: one contiguous chunk per stage of
    the H200 kernels (``gbs.plan.h200_weight_layout``: the H200 order of FP4 weights, NVFP4 and MXFP4).

    A weight stage is a 16 KB box (128 rows x one 128-byte K slice, 256 elements) plus that slice's 128x4
    scale atoms for the box's 128-row band: ``64 / block_size`` atoms of 512 B (MXFP4 2 = 1 KB, NVFP4 4 =
    2 KB). Tiled weights with separate scales still make a stage two DRAM streams; here each chunk is the
    box's 16 KB and then its atoms' bytes, exactly as ``b_scales`` holds them (UE4M3 codes as in
    ``E2M1H200Order``), so a stage is one stream of ``16 KB + 128 * 256 / block_size`` bytes. Chunks are
    ordered (expert, 128-row tile, K slice). An expert's chunks hold ``N * (K/2 + K/block_size)`` bytes:
    each row's weight and scale bytes, so ``b`` has shape ``(E, N, K/2 + K/block_size)``
    (``stored_row_bytes``), N and K padded as ``E2M1H200TiledOrder.padded_shape`` (zero weight bytes, zero scale
    bytes: the padded products are exact zeros).

    ``b_scales`` keeps the 128x4 atoms as well (the reference and the checks read them; ``GroupedProblem``
    checks that they equal the chunks' copies): on the device that copy costs 1/16 (MXFP4) or 1/8 (NVFP4)
    of the weight bytes, which the H200 kernels do not read. ``fuse`` / ``unfuse`` convert from / to tiled
    weights and atoms; ``GroupedProblem.with_b_layout`` does it for a problem.

    The fastest weight layout on the H200 for both FP4 formats (evidence: fused-weight-layout).
    """

    CHUNK_BOX_BYTES = E2M1H200TiledOrder.BOX_ROWS * E2M1H200TiledOrder.BOX_BYTES
    SLICE_ELEMENTS = 2 * E2M1H200TiledOrder.BOX_BYTES     # elements of K per box row (FP4: two per byte)

    @classmethod
    def chunk_scale_bytes(cls, block_size: int) -> int:
        """Bytes of one chunk's scale atoms: 128 rows x one scale byte per block of the K slice."""
        return cls.BOX_ROWS * (cls.SLICE_ELEMENTS // block_size)

    @classmethod
    def padded_k(cls, k: int) -> int:
        """K of the stored chunks: ``k`` rounded up to whole K slices."""
        return -(-k // cls.SLICE_ELEMENTS) * cls.SLICE_ELEMENTS

    @classmethod
    def stored_row_bytes(cls, k: int, block_size: int) -> int:
        """Bytes per weight row in ``b``'s shape: K/2 weight bytes and K/block_size scale bytes of the padded K."""
        k = cls.padded_k(k)
        return k // 2 + k // block_size

    @classmethod
    def _k(cls, shape, block_size: int) -> int:
        """The (padded) K of fused weights of ``shape``; ValueError unless they are whole chunks."""
        row_bytes = shape[-1] if len(shape) >= 2 else 0
        k = row_bytes * 2 * block_size // (block_size + 2)
        if (len(shape) < 2 or shape[-2] % cls.BOX_ROWS or k <= 0 or k % cls.SLICE_ELEMENTS
                or cls.stored_row_bytes(k, block_size) != row_bytes):
            raise ValueError(f"{LAYOUT_E2M1_H200_FUSED!r} stores weights with their scales in chunks of {cls.BOX_ROWS} "
                             f"rows: it needs (..., N, K/2 + K/{block_size}) bytes with N padded to a multiple of "
                             f"{cls.BOX_ROWS} and K to one of {cls.SLICE_ELEMENTS}, got {tuple(shape)}")
        return k

    @classmethod
    def check_shape(cls, shape, fmt=None) -> None:
        """ValueError unless ``shape`` is fused weights of format ``fmt`` (its block size) in whole chunks."""
        if fmt is None:
            raise TypeError(f"{LAYOUT_E2M1_H200_FUSED!r}: the shape check needs the weights' format")
        cls._k(shape, get_format(fmt).block_size)

    @classmethod
    def fuse(cls, tiled: np.ndarray, scale_atoms: np.ndarray, block_size: int) -> np.ndarray:
        """Tiled weights (``E2M1H200TiledOrder``, stored: (..., N_pad, K_pad/2)) and their 128x4 atoms (..., N_pad/128,
        ceil(K/block/4), 32, 4, 4; the atoms of a padded K slice zero-filled here) -> fused (..., N_pad, K_pad/2 +
        K_pad/block) (a new array)."""
        tiled, scale_atoms = np.asarray(tiled), np.asarray(scale_atoms)
        E2M1H200TiledOrder.check_shape(tiled.shape)
        *lead, n, kb = tiled.shape
        tiles, slices = n // cls.BOX_ROWS, kb // cls.BOX_BYTES
        cols = 2 * kb // block_size // SF_ATOM_COLS
        if (scale_atoms.dtype != np.uint8 or scale_atoms.ndim != tiled.ndim + 3
                or scale_atoms.shape[:-4] != (*lead, tiles) or scale_atoms.shape[-3:] != SF_ATOM_SHAPE
                or not cols - cls.SLICE_ELEMENTS // block_size // SF_ATOM_COLS < scale_atoms.shape[-4] <= cols):
            raise ValueError(f"fuse: scale atoms must be uint8 {(*lead, tiles, cols, *SF_ATOM_SHAPE)} (or fewer "
                             f"atom columns, within the last K slice) for weights {tiled.shape}, got "
                             f"{scale_atoms.dtype} {scale_atoms.shape}")
        padded = np.zeros((*lead, tiles, cols, *SF_ATOM_SHAPE), np.uint8)
        padded[..., :scale_atoms.shape[-4], :, :, :] = scale_atoms
        boxes = tiled.reshape(*lead, tiles, slices, cls.CHUNK_BOX_BYTES)
        atoms = padded.reshape(*lead, tiles, slices, cls.chunk_scale_bytes(block_size))
        fused = np.concatenate([boxes, atoms], axis=-1)
        return fused.reshape(*lead, n, cls.stored_row_bytes(2 * kb, block_size))

    @classmethod
    def unfuse(cls, fused: np.ndarray, block_size: int, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Inverse of ``fuse``: (tiled weights, scale atoms), new arrays; the atoms cut to a logical ``k``'s
        columns where given (the tiled weights stay padded: ``E2M1H200TiledOrder.untile`` cuts them)."""
        fused = np.asarray(fused)
        *lead, n, _ = fused.shape
        tiled = np.ascontiguousarray(cls._chunks(fused, block_size)[..., :cls.CHUNK_BOX_BYTES])
        return tiled.reshape(*lead, n, cls._k(fused.shape, block_size) // 2), cls.scale_atoms(fused, block_size, k)

    @classmethod
    def scale_atoms(cls, fused: np.ndarray, block_size: int, k: int | None = None) -> np.ndarray:
        """The copy of the 128x4 scale atoms that fused weights hold (a new array; the weight bytes are not
        copied: what ``GroupedProblem`` checks against ``b_scales``), cut to a logical ``k``'s atom columns."""
        fused = np.asarray(fused)
        *lead, n, _ = fused.shape
        atoms = cls._chunks(fused, block_size)[..., cls.CHUNK_BOX_BYTES:]
        atoms = atoms.reshape(*lead, n // cls.BOX_ROWS, cls._k(fused.shape, block_size) // block_size // SF_ATOM_COLS,
                              *SF_ATOM_SHAPE)
        if k is not None:
            if cls.padded_k(k) != cls._k(fused.shape, block_size):
                raise ValueError(f"fused weights {fused.shape} do not store K={k}")
            atoms = atoms[..., :-(-(k // block_size) // SF_ATOM_COLS), :, :, :]
        return np.ascontiguousarray(atoms)

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


class E2M1E4M3Order(_WordBitOrder):
    """The word order of the FP8 route (``gbs.fp8_route``, ``gbs.numba_kernels.fp8_decode``; the wgmma kernel's
    E4M3 consumer reads it, ``gbs.numba_kernels.h200_wgmma``): packed E2M1 bytes with each word's 8 sign bits moved
    so that the decode to E4M3 bytes, the block's UE8M0 exponent folded into an 8-byte magnitude table, takes 7
    integer instructions per word (2 ``prmt``). MXFP4 only, tokens and weights (the route needs both operands in it).

    Magnitude bits (m, e0, e1) stay in place: nibble i's low 3 bits are element i's, so ``word & 0x7777`` is a
    ``prmt`` selector of elements 0-3 (``prmt`` reads the low 16 bits) and ``(word & 0x77777777) >> 16`` of elements
    4-7. The sign of element i < 4 goes to bit ``8 i + 7`` (nibble 2 i + 1's bit 3) and of element i + 4 to bit
    ``8 i + 3`` (nibble 2 i's bit 3), so ``word & 0x80808080`` and ``(word << 4) & 0x80808080`` are the E4M3 sign
    bits of the two output words, bytes in K order. A bijection of each word's bits; the K order is unchanged.
    UE8M0 scales stay as they are (NVFP4's UE4M3 scales do not fold exactly: ``SCALE_DTYPES``)."""

    MAGNITUDE_MASK = 0x77777777
    SIGN_MASK = 0x80808080        # element i's sign at bit 8 i + 7 (i < 4; i + 4: at 8 i + 3, << 4)
    HIGH_SIGN_SHIFT = 4
    ROLES = ("tokens", "weights")
    SCALE_DTYPES = ("ue8m0",)       # the formats whose block scales fold into the decode
    WORD_ORDER = LAYOUT_E2M1_E4M3
    TILED = False

    @staticmethod
    def encode_scales(scale_bytes: np.ndarray, scale_dtype: str) -> np.ndarray:
        """UE8M0 scale bytes unchanged (a copy)."""
        return _scale_bytes(scale_bytes, scale_dtype).copy()

    decode_scales = encode_scales

    @staticmethod
    def destinations() -> tuple[int, ...]:
        """Destination bit of each source bit ``4 i + b`` (element i, bit b: 0 = m, 1 = e0, 2 = e1, 3 = sign)."""
        dest = []
        for element in range(8):
            dest += [4 * element + bit for bit in range(3)]
            dest.append(8 * element + 7 if element < 4 else 8 * (element - 4) + 3)
        return tuple(dest)


class E4M3FoldedScales:
    """MXFP8 operands whose UE8M0 block scales repeat over each 128-K chunk (``CHUNK``): per token row, and per
    128-row weight tile (``TILE_ROWS``, counted from each expert's row 0): DeepSeek-style 1 x 128 / 128 x 128
    power-of-two-scaled FP8. MXFP4 operands fold into it exactly where each block lies within 15 binades of its
    chunk's largest (``gbs.fp8_route.fold_problem``); the FP8 route then multiplies the E4M3 bytes with ``wgmma``
    straight from shared memory and applies one factor per token row and chunk at the fp32 promotion
    (``h200_wgmma.WgmmaSpec.chunk_scaled``). The bytes and scales are MXFP8's as stored (every MXFP8 kernel reads them
    as such); the tag promises the repetition, which ``check_token_scales`` / ``check_weight_scales`` verify."""

    CHUNK = 128
    TILE_ROWS = 128
    ROLES = ("tokens", "weights")
    ELEMENTS = ("e4m3",)
    SCALE_DTYPES = ("ue8m0",)
    WORD_ORDER = LAYOUT_PACKED
    TILED = False

    @staticmethod
    def swizzle(packed: np.ndarray) -> np.ndarray:
        """The bytes unchanged (a copy): the tag changes, not the bytes."""
        return np.array(packed, copy=True)

    @staticmethod
    def unswizzle(ordered: np.ndarray, shape=None) -> np.ndarray:
        return np.array(ordered, copy=True)

    @staticmethod
    def encode_scales(scale_bytes: np.ndarray, scale_dtype: str) -> np.ndarray:
        return _scale_bytes(scale_bytes, scale_dtype).copy()

    decode_scales = encode_scales

    @classmethod
    def _chunk_mismatch(cls, linear: np.ndarray) -> np.ndarray:
        """(..., blocks) -> bool (..., blocks): a block whose scale differs from its chunk's first block's."""
        per_chunk = cls.CHUNK // get_format("mxfp8").block_size
        first = np.repeat(linear[..., ::per_chunk], per_chunk, axis=-1)[..., :linear.shape[-1]]
        return linear != first

    @classmethod
    def check_token_scales(cls, linear: np.ndarray) -> None:
        """ValueError unless each token row's (rows, blocks) scale bytes repeat over every 128-K chunk."""
        bad = cls._chunk_mismatch(np.asarray(linear))
        if bad.any():
            row, block = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"a_layout {LAYOUT_E4M3_FOLDED!r}: token row {row}'s block {block} scale differs from its "
                             f"128-K chunk's first: not folded (build with gbs.fp8_route.fold_problem)")

    @classmethod
    def check_weight_scales(cls, linear: np.ndarray) -> None:
        """ValueError unless each expert's (E, N, blocks) scale bytes repeat over every 128-K chunk and over every
        128-row tile."""
        linear = np.asarray(linear)
        bad = cls._chunk_mismatch(linear)
        rows = linear.shape[1]
        tile_first = np.repeat(linear[:, ::cls.TILE_ROWS], cls.TILE_ROWS, axis=1)[:, :rows]
        bad |= linear != tile_first
        if bad.any():
            expert, row, block = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"b_layout {LAYOUT_E4M3_FOLDED!r}: expert {expert} row {row} block {block}: the scale differs "
                             f"from its 128-row tile's and 128-K chunk's first: not folded (build with "
                             f"gbs.fp8_route.fold_problem)")


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
    ``h200_decode.ELEMENT_LOG2_OFFSET``), so that ``value * s * 2**-8`` is an exact bf16 normal. From a
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


def _tables_of(dest: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, inverse) byte tables of the bit permutation ``dest`` (a bijection of 0..31)."""
    if sorted(dest) != list(range(32)):
        raise AssertionError("a word order must be a permutation of the 32 bits")
    return _byte_tables(dest), _byte_tables(tuple(int(i) for i in np.argsort(dest)))


E2M1H200Order._TABLES = _tables_of(_e2m1_h200_destinations())
E2M1E4M3Order._TABLES = _tables_of(E2M1E4M3Order.destinations())
OPERAND_LAYOUTS = {LAYOUT_PACKED: None, LAYOUT_E2M1_H200: E2M1H200Order, LAYOUT_E2M1_H200_TILED: E2M1H200TiledOrder,
                   LAYOUT_E2M1_H200_FUSED: E2M1H200FusedOrder, LAYOUT_E2M1_E4M3: E2M1E4M3Order,
                   LAYOUT_E4M3_FOLDED: E4M3FoldedScales}


def word_order(layout: str) -> str:
    """The order of the bits inside each 4-byte word of ``layout`` (what a kernel's decode reads):
    ``LAYOUT_PACKED``, ``LAYOUT_E2M1_H200`` (also the tiled layouts') or ``LAYOUT_E2M1_E4M3``."""
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


def stored_shape(layout: str, fmt, rows: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The array shape of an operand of format ``fmt`` with ``rows`` (e.g. (E, N) weights, (tokens,)) x ``k``
    elements stored in ``layout``: tiled and fused weights padded to whole boxes (``E2M1H200TiledOrder``)."""
    fmt = get_format(fmt)
    shape = (*rows, fmt.row_bytes(k))
    if not tiled_weights(layout):
        return shape
    *lead, n, kb = E2M1H200TiledOrder.padded_shape(shape)
    if fused_scales(layout):
        kb = E2M1H200FusedOrder.stored_row_bytes(k, fmt.block_size)
    return (*lead, n, kb)

