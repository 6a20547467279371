"""Where the SM100 kernel reads and writes, per tile and per K slice: TMA box coordinates and scale
bands, the tensor maps the host encodes, the MMA's shared-memory descriptors and scale columns,
the scale words the store warps write, and the epilogue's chunking and output addresses.

Design (``docs/design/sm100_kernel.md``, "Tile walk", "The pipeline", "Tensor memory and the scale
copies", "The MMA", "Epilogue"):

* With ``cta_group = 2`` each CTA of a pair loads its 128 weight rows and half of the token tile;
  both CTAs load the scales of the whole token tile (each CTA's TMEM holds all N columns).
* Operand tiles are 128-byte K slices, 128B-swizzled and K-major; an MMA's descriptor is the tile's
  start advanced by 32 bytes per MMA (4 MMAs of K = 64 FP4 or 32 FP8 elements per slice).
* The scale tensors are read by TMA as 3-D arrays of 16-byte rows: ``(16 bytes, 32 * col_groups
  rows, 128-row bands)``; one 128x4 atom is 32 such rows (512 contiguous bytes), a stage's
  ``num_sf_k_tiles`` atoms of one band are one box, and a box hanging past the last column group
  reads zeros (never the next band's scales).
* W4A8 (``kind::mxf8f6f4`` with E2M1 weights): the FP4 operand must sit in shared memory in the
  mxf8f6f4 "16 values in 16 bytes" layout (PTX ISA "Packing formats ... mxf8f6f4 smem": 16 packed
  E2M1 values in the first 8 bytes of each 16-byte chunk, 8 bytes of padding). The TMA does the
  unpacking: a tensor map of data type ``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B`` (PTX
  ``.b4x16_p64``) over the packed weights, dimensions in 4-bit elements, box 128 elements (64 bytes
  of global memory -> 128 bytes of shared memory). Its rules: global base 32-byte aligned, inner
  dimension a multiple of 128 elements (so W4A8 needs K % 128 == 0), swizzle 128B or none.
  Unverified here: that the transaction count of such a box is its shared-memory footprint (128
  bytes per row).
* Epilogue: ``tcgen05.ld`` chunks of ``min(32, mma_bn)`` tokens (swapped) or ``min(64, mma_bn)``
  weight rows; chunks inside the group go through shared memory and a TMA store, chunks crossing
  the group's end are stored element by element with bounds checks. ``C`` is never padded.

Assumed as CUTLASS / upstream do, unverifiable without Blackwell: the block-scaled MMA reads the
scales of row ``m`` from lane ``m``, column ``base + m // 32`` (the layout ``tcgen05.cp`` makes of a
128x4 atom).

Every function above the tensor maps is *device-capable*: plain integer Python, compiled into the
kernel with ``cuda.jit(device=True)`` (callees swapped in by ``schedule.rebind``) and called as is
by the CPU emulator (``gbs.sm100_emulator``), so the two cannot disagree on an address.
"""
from __future__ import annotations

from dataclasses import dataclass

from gbs.numba_kernels.sm100_spec import (MMA_A_ROWS, MMA_K_BYTES, K_SLICE_BYTES, OUTPUT_BYTES, SCALE_ROWS_PER_ATOM,
                                          SCALE_TMEM_COLUMNS, SWIZZLE_ATOM_BYTES, Sm100KernelSpec)
from gbs.problem import GroupedProblem
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, SF_LANE_BYTES, SF_LANES, get_format
from gbs.formats import scale_byte_offset

OPERAND_SBO = SWIZZLE_ATOM_BYTES          # stride between 8-row groups of a K-major SW128 tile
OPERAND_LBO = 16                          # "not used, assumed 1" with swizzle (ISA)
SCALE_CORE_SBO = 8 * SF_LANE_BYTES        # scale atom = 4 core matrices of 8 rows x 16 B, stacked
# A module global, so that the kernel build can swap in its device version (``schedule.rebind``).
encode_smem_descriptor = desc.encode_smem_descriptor
# TMA data type of the packed FP4 weights of W4A8: 16 E2M1 values (8 B) -> 16 B of shared memory.
FP4_UNPACK_DTYPE = "16U4_ALIGN16B"
FP4_UNPACK_INNER_MULTIPLE = 128           # cuTensorMapEncodeTiled: inner dim multiple of 128 elements
FP4_UNPACK_ADDRESS_ALIGN = 32


# ----------------------------------------------------------------------------------------------
# TMA loads: box coordinates and scale bands of a tile and a K slice
# ----------------------------------------------------------------------------------------------
def token_scale_row(token, group_start, a_scale_offset):
    """Padded scale row of ``token`` of a group starting at ``group_start``
    (``docs/design/formats.md``, "The grouped 1D-1D problem")."""
    return token - group_start + SF_ATOM_ROWS * (group_start // SF_ATOM_ROWS + a_scale_offset)


def tile_load_coordinates(ab_swapped, b_rows_per_cta, rank, expert, token_start, row_start, group_start,
                          a_scale_offset, row_bands):
    """What CTA ``rank`` of a pair loads for a tile (device-capable).

    Returns ``(token_row, weight_row, token_band, weight_band, sfb_row_in_atom)``: the first row
    of its token box (tokens map) and of its weight box (weights map, expert ``expert``), the
    128-row scale bands of the tile in the two scale maps (tokens: padded scale row // 128;
    weights: ``expert * row_bands + row // 128``), and the row where the tile's first MMA-B row
    sits inside its scale atom. With a pair (swapped), CTA ``rank`` loads weight rows
    ``row_start + 128 rank`` and tokens ``token_start + rank * b_rows_per_cta``; both CTAs load
    the scales of the whole token tile (each CTA's TMEM holds all N columns)."""
    token_scale = token_scale_row(token_start, group_start, a_scale_offset)
    if ab_swapped:
        weight_row = row_start + rank * MMA_A_ROWS
        token_row = token_start + rank * b_rows_per_cta
        sfb_row_in_atom = token_scale % SF_ATOM_ROWS
    else:
        weight_row, token_row = row_start, token_start
        sfb_row_in_atom = row_start % SF_ATOM_ROWS
    return (token_row, weight_row, token_scale // SF_ATOM_ROWS, expert * row_bands + weight_row // SF_ATOM_ROWS,
            sfb_row_in_atom)


def stage_k_coordinates(k_slice, tokens_k_step, weights_k_step, scale_rows_per_stage):
    """Innermost coordinates of K slice ``k_slice``: (tokens box c0, weights box c0, scale boxes c1)."""
    return k_slice * tokens_k_step, k_slice * weights_k_step, k_slice * scale_rows_per_stage


# ----------------------------------------------------------------------------------------------
# The MMA: scale copies, descriptors, scale columns; the store warps' scale words
# ----------------------------------------------------------------------------------------------
def sfb_column_adjust(sfb_row_in_atom, sfb_by_store_warps):
    """Columns to add to the MMA-B scale TMEM address: a tile whose rows start at row ``r`` of
    its atom finds row ``r + n`` in column ``(r + n) // 32`` (``tcgen05.cp`` layout), so the MMA
    reads from ``r // 32`` columns further (``mma_bn = 64``: 0 or 2). The store warps write the
    tile's rows from lane 0 instead: no adjustment."""
    if sfb_by_store_warps:
        return 0
    return sfb_row_in_atom // SF_LANES


def scale_copy_offsets(sf_tile, band, num_sf_k_tiles, bands):
    """(TMEM column offset, shared-memory byte offset) within a stage of the scale atom of scale
    K tile ``sf_tile`` and band ``band`` (of ``bands`` per tile, ``ceil(mma_bn / 128)`` on the
    MMA-B side, 1 on the MMA-A side): the TMA box holds ``[band][sf_tile]`` atoms, TMEM
    ``[sf_tile][band]`` so that one MMA's N columns find their bands side by side."""
    return (sf_tile * bands + band) * SCALE_TMEM_COLUMNS, (band * num_sf_k_tiles + sf_tile) * SF_ATOM_BYTES


def mma_scale_columns(mma_index, scale_vec, sfb_bands, sfb_adjust):
    """(SFA column offset, SFB column offset, scale-factor ID) of MMA ``mma_index`` of a K slice,
    relative to the stage's scale columns."""
    atom, sf_id = mma_scale_slot(mma_index, scale_vec)
    return atom * SCALE_TMEM_COLUMNS, atom * sfb_bands * SCALE_TMEM_COLUMNS + sfb_adjust, sf_id


def operand_descriptor(tile_address, mma_index):
    """SW128 K-major shared-memory descriptor of MMA ``mma_index`` of a K slice: the tile's
    start address advanced by 32 bytes per MMA (the hardware applies the swizzle XOR to the
    computed addresses, so the tile itself must be 1024-byte aligned)."""
    return encode_smem_descriptor(tile_address + mma_index * MMA_K_BYTES, OPERAND_LBO, OPERAND_SBO,
                                  desc.SWIZZLE_128B, 0, 0)


def scale_atom_descriptor(atom_address):
    """``tcgen05.cp`` source descriptor of one 512-byte scale atom: 32 rows of 16 bytes, no
    swizzle, 8-row core matrices ``SCALE_CORE_SBO`` apart (contiguous)."""
    return encode_smem_descriptor(atom_address, 0, SCALE_CORE_SBO, desc.SWIZZLE_NONE, 0, 0)


def mma_scale_slot(mma_index, scale_vec):
    """(scale atom, scale-factor ID) of MMA ``mma_index`` of a K slice: an atom's 4 scale columns
    serve ``4 / scale_vec`` MMAs, each reading ``scale_vec`` bytes from byte ``sf_id`` of the
    32-bit TMEM cells (device-capable form of ``sm100_descriptors.mma_scale_position``)."""
    per_atom = SF_ATOM_COLS // scale_vec
    return mma_index // per_atom, (mma_index % per_atom) * scale_vec


def sfb_store_word_offset(sfb_row_in_atom, lane, sf_tile, num_sf_k_tiles):
    """Byte offset, in a stage's MMA-B scale atoms, of the 4 scale bytes that store-warp lane
    ``lane`` writes for scale K tile ``sf_tile``: tile row ``lane`` is atom row
    ``sfb_row_in_atom + lane`` (the 128x4 layout with ``num_sf_k_tiles`` column groups)."""
    return scale_byte_offset(sfb_row_in_atom + lane, sf_tile * SF_ATOM_COLS, num_sf_k_tiles)


# ----------------------------------------------------------------------------------------------
# Epilogue: chunks, store choice, output coordinates, buffer offsets
# ----------------------------------------------------------------------------------------------
def chunk_is_live(ab_swapped, chunk, chunk_columns, token_start, token_end, row_lo, row_hi):
    """Whether epilogue chunk ``chunk`` holds any output this CTA writes."""
    if row_lo >= row_hi or token_start >= token_end:
        return False
    if ab_swapped:
        return token_start + chunk * chunk_columns < token_end
    return row_lo + chunk * chunk_columns < row_hi


def chunk_uses_tma_store(ab_swapped, chunk, chunk_columns, token_start, token_end):
    """Whether every token of chunk ``chunk`` belongs to the tile's group: then the TMA store
    (which clips only at the tensor's edges: N and the token count) writes it; otherwise the
    element-wise bounds-checked store does."""
    if ab_swapped:
        return token_start + (chunk + 1) * chunk_columns <= token_end
    return token_start + MMA_A_ROWS <= token_end


def tma_store_coordinates(ab_swapped, chunk, chunk_columns, token_start, row_lo):
    """(c0, c1) = (output column, token) of the TMA store box of chunk ``chunk``."""
    if ab_swapped:
        return row_lo, token_start + chunk * chunk_columns
    return row_lo + chunk * chunk_columns, token_start


def accumulator_output(ab_swapped, lane, column, token_start, row_lo):
    """(token, output column) of accumulator TMEM cell (``lane``, ``column``) of this CTA: lanes
    are its 128 MMA-A rows, columns the ``mma_bn`` MMA-B rows."""
    if ab_swapped:
        return token_start + column, row_lo + lane
    return token_start + lane, row_lo + column


def tma_swizzled_offset(offset, swizzle_bytes):
    """Shared-memory byte offset where a TMA with a ``swizzle_bytes`` pattern (16 = none, 32, 64,
    128) keeps byte ``offset`` of a dense box (buffer aligned to the pattern): the 16-byte chunk
    bits are XORed with the address bits above 128 bytes."""
    return offset ^ (((offset >> 7) & (swizzle_bytes // 16 - 1)) << 4)


def c_buffer_offset(ab_swapped, lane, column_in_chunk, chunk_columns, swizzle_bytes):
    """Byte offset of one bf16 output in an epilogue chunk buffer: the dense TMA-store box is
    (tokens x 128 output columns) when swapped, (128 tokens x ``chunk_columns``) otherwise."""
    if ab_swapped:
        return (column_in_chunk * MMA_A_ROWS + lane) * OUTPUT_BYTES
    return tma_swizzled_offset((lane * chunk_columns + column_in_chunk) * OUTPUT_BYTES, swizzle_bytes)


# ----------------------------------------------------------------------------------------------
# Tensor maps (what the host encodes and the emulator's TMA model reads)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMapSpec:
    """One tensor map: element type ("uint8", "bfloat16", or ``FP4_UNPACK_DTYPE``), dimensions in
    elements innermost first, strides in bytes, box in elements, swizzle name, and the bytes one
    box puts into shared memory (the ``expect_tx`` count)."""

    name: str
    dtype: str
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: str
    smem_box_bytes: int

    @property
    def k_step(self) -> int:
        """Innermost coordinate advance per K slice (elements)."""
        return self.box[0]


@dataclass(frozen=True)
class ProblemShape:
    """The sizes the tensor maps and the kernel need."""

    total_tokens: int
    n: int
    k: int
    num_experts: int
    token_scale_bands: int

    @classmethod
    def of(cls, problem: GroupedProblem) -> "ProblemShape":
        return cls(problem.total_tokens, problem.n, problem.k, problem.num_experts, problem.a_scales.shape[0])


def scale_col_groups(spec: Sm100KernelSpec, k: int) -> int:
    return -(-(k // spec.block_size) // SF_ATOM_COLS)


def tensor_map_specs(spec: Sm100KernelSpec, shape: ProblemShape) -> tuple[TensorMapSpec, ...]:
    """The five tensor maps, in ``MAP_*`` order."""
    a_fmt, b_fmt = get_format(spec.a_format), get_format(spec.b_format)
    token_row_bytes, weight_row_bytes = a_fmt.row_bytes(shape.k), b_fmt.row_bytes(shape.k)
    a_rows, b_rows = MMA_A_ROWS, spec.b_rows_per_cta
    token_box_rows, weight_box_rows = (b_rows, a_rows) if spec.ab_swapped else (a_rows, b_rows)
    tokens = TensorMapSpec("tokens", "uint8", (token_row_bytes, shape.total_tokens), (token_row_bytes,),
                           (spec.tokens_k_step, token_box_rows), "128B", K_SLICE_BYTES * token_box_rows)
    weight_strides = (weight_row_bytes, weight_row_bytes * shape.n)
    if spec.weights_unpacked_by_tma:
        # W4A8: unpacking TMA, dims and box in 4-bit elements; 128 elements -> 128 B of smem.
        weights = TensorMapSpec("weights", FP4_UNPACK_DTYPE, (shape.k, shape.n, shape.num_experts), weight_strides,
                                (spec.weights_k_step, weight_box_rows, 1), "128B", K_SLICE_BYTES * weight_box_rows)
    else:
        weights = TensorMapSpec("weights", "uint8", (weight_row_bytes, shape.n, shape.num_experts), weight_strides,
                                (spec.weights_k_step, weight_box_rows, 1), "128B", K_SLICE_BYTES * weight_box_rows)
    groups = scale_col_groups(spec, shape.k)
    scale_rows = SCALE_ROWS_PER_ATOM * groups
    box_rows = spec.scale_rows_per_stage
    token_bands_box = spec.sfb_atoms if spec.ab_swapped else 1
    weight_bands_box = 1 if spec.ab_swapped else spec.sfb_atoms
    strides = (SF_LANE_BYTES, SF_LANE_BYTES * scale_rows)
    token_scales = TensorMapSpec("token_scales", "uint8", (SF_LANE_BYTES, scale_rows, shape.token_scale_bands),
                                 strides, (SF_LANE_BYTES, box_rows, token_bands_box), "none",
                                 SF_ATOM_BYTES * spec.num_sf_k_tiles * token_bands_box)
    weight_bands = shape.num_experts * -(-shape.n // SF_ATOM_ROWS)
    weight_scales = TensorMapSpec("weight_scales", "uint8", (SF_LANE_BYTES, scale_rows, weight_bands),
                                  strides, (SF_LANE_BYTES, box_rows, weight_bands_box), "none",
                                  SF_ATOM_BYTES * spec.num_sf_k_tiles * weight_bands_box)
    chunk = spec.chunk_columns
    out_box = (MMA_A_ROWS, chunk) if spec.ab_swapped else (chunk, MMA_A_ROWS)
    swizzle = {16: "none", 32: "32B", 64: "64B", 128: "128B"}[spec.c_swizzle_bytes]
    out = TensorMapSpec("out", "bfloat16", (shape.n, shape.total_tokens), (shape.n * OUTPUT_BYTES,), out_box,
                        swizzle, spec.c_buffer_bytes)
    return tokens, weights, token_scales, weight_scales, out

