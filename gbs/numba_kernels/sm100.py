"""The SM100 (B200) grouped 1D-1D block-scaled matmul: a warp-specialized persistent Numba kernel
with inline PTX (TMA, mbarriers, ``tcgen05``), its host wrapper, and the host-side pure functions
that both the kernel and the CPU emulator (``gbs.sm100_emulator``) use.

Nothing here has run: no Blackwell GPU is within this project's reach. CI assembles the kernel for
sm_100a (ptxas through nvJitLink) for every dispatch outcome and checks its SASS and resources;
the emulator replays the kernel's host-visible logic (the functions marked *device-capable* below,
compiled into the kernel with ``cuda.jit(device=True)``) on the CPU against the reference.

Kernel design (``../shared/spec/kernels.md``, "The SM100 (B200) kernel"):

* Persistent grid, clusters of ``cta_group`` CTAs; CTA pair ``p`` walks tiles ``p, p + pairs, ...``
  of ``gbs.schedule``. Warps: 0-3 epilogue, 4 TMA loads, 5 MMA (one lane issues), 6 tile scheduler
  (224 threads); with ``mma_bn < 64`` warp 7 loads the MMA-B scale atoms and warps 8-11 write the
  tile's scale rows into tensor memory with ``tcgen05.st`` (384 threads): the MMA reads row ``n``
  of the MMA-B scales from lane ``n``, and ``tcgen05.cp`` only places whole 32-row slices of an
  atom, so a tile of 8 or 16 rows that starts inside a slice cannot be copied there (the spec,
  like upstream, takes this path for every ``mma_bn < 64``).
* Operands: "MMA A" is the 128-row side (weights when ``ab_swapped``, else tokens), "MMA B" the
  ``mma_bn`` side. One pipeline stage holds a 128-byte K slice of both tiles (128B-swizzled, K-major)
  and their 128x4 scale atoms; full/empty mbarriers, TMA with ``expect_tx``. With ``cta_group = 2``
  each CTA loads its 128 weight rows and half of the token tile, completing on the even CTA's full
  barrier (``.cta_group::2`` TMA); the even CTA issues ``M = 256`` MMAs and commits with multicast
  to both CTAs' empty barriers.
* Four MMAs per K slice (K = 64 FP4 or 32 FP8 elements each); scale atoms copied SMEM -> TMEM with
  ``tcgen05.cp.32x128b.warpx4`` into per-stage TMEM columns; accumulators double-buffered in TMEM
  when ``mma_bn <= 128``.
* Epilogue: ``tcgen05.ld`` chunks of ``min(32, mma_bn)`` tokens (swapped) or ``min(64, mma_bn)``
  weight rows, times ``expert_scales[e]``, RNE to bf16; chunks inside the group go through shared
  memory (double-buffered) and a TMA store, chunks crossing the group's end are stored element by
  element with bounds checks. ``C`` is never padded.
* W4A8 (``kind::mxf8f6f4`` with E2M1 weights): the FP4 operand must sit in shared memory in the
  mxf8f6f4 "16 values in 16 bytes" layout (PTX ISA "Packing formats ... mxf8f6f4 smem": 16 packed
  E2M1 values in the first 8 bytes of each 16-byte chunk, 8 bytes of padding). The TMA does the
  unpacking: a tensor map of data type ``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B`` (PTX ``.b4x16_p64``)
  over the packed weights, dimensions in 4-bit elements, box 128 elements (64 bytes of global
  memory -> 128 bytes of shared memory). Its rules: global base 32-byte aligned, inner dimension a
  multiple of 128 elements (so W4A8 needs K % 128 == 0), swizzle 128B or none. Unverified here:
  that the transaction count of such a box is its shared-memory footprint (128 bytes per row).

Unverifiable without Blackwell, and assumed as CUTLASS / upstream do: ``tcgen05.cp.cta_group::2``
copies each CTA's own scale atoms into its own TMEM; the block-scaled MMA reads the scales of
row ``m`` from lane ``m``, column ``base + m // 32`` (the layout ``tcgen05.cp`` makes of a 128x4
atom); the ``.cta_group::2`` TMA completes on the even CTA's barrier through a ``mapa`` address.

The scale tensors are read by TMA as 3-D arrays of 16-byte rows: ``(16 bytes, 32 * col_groups
rows, 128-row bands)``; one 128x4 atom is 32 such rows (512 contiguous bytes), a stage's
``num_sf_k_tiles`` atoms of one band are one box, and a box hanging past the last column group
reads zeros (never the next band's scales).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gbs import dispatch, schedule
from gbs.numba_kernels.simt import bf16_bits_rne
from gbs.problem import GroupedProblem, require_packed
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, SF_LANE_BYTES, SF_LANES, get_format
from gbs.formats import scale_byte_offset
from gbs.schedule import rebind

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
SM100_COMPUTE_CAPABILITY = (10, 0)
SUGGESTED_BACKENDS = ("h200_stream", "simt", "reference")
B200_SM_COUNT = 148

MMA_A_ROWS = schedule.MMA_M_ROWS          # rows of one CTA's side of the MMA M dimension
K_SLICE_BYTES = dispatch.K_TILE_BYTES     # bytes of every operand row per pipeline stage
MMAS_PER_K_SLICE = 4                      # 4 MMAs of K = 64 (FP4) or 32 (FP8) per 128-byte slice
MMA_K_BYTES = K_SLICE_BYTES // MMAS_PER_K_SLICE   # shared-memory bytes of one MMA's K step
A_TILE_BYTES = MMA_A_ROWS * K_SLICE_BYTES
SWIZZLE_128B_BYTES = 128                  # operand tiles: 128-byte rows, 128B swizzle
SWIZZLE_ATOM_BYTES = 1024                 # 8 rows x 128 B: the 128B swizzle pattern; tile alignment
OPERAND_SBO = SWIZZLE_ATOM_BYTES          # stride between 8-row groups of a K-major SW128 tile
OPERAND_LBO = 16                          # "not used, assumed 1" with swizzle (ISA)
SCALE_CORE_SBO = 8 * SF_LANE_BYTES        # scale atom = 4 core matrices of 8 rows x 16 B, stacked
SCALE_ROWS_PER_ATOM = SF_LANES            # 16-byte rows of one 512-byte atom
SCALE_TMEM_COLUMNS = desc.SCALE_ATOM_TMEM_COLUMNS   # tcgen05.cp 32x128b.warpx4 writes 4 columns
TMEM_ALLOC_COLUMNS = desc.TMEM_COLUMNS    # the whole tensor memory: one CTA per SM
MBARRIER_BYTES = 8
NUM_C_BUFFERS = dispatch.NUM_OUTPUT_STAGES
SWAPPED_CHUNK_MAX = dispatch.SWAPPED_C_TILE_MAX_COLS      # tokens per epilogue chunk (swapped)
UNSWAPPED_CHUNK_MAX = dispatch.UNSWAPPED_C_TILE_COLS      # weight rows per epilogue chunk
OUTPUT_BYTES = dispatch.OUTPUT_BYTES
SFB_STORE_MMA_BN = 64                     # mma_bn below this: MMA-B scales written with tcgen05.st

# Warp roles.
NUM_EPILOGUE_WARPS = 4
EPILOGUE_THREADS = NUM_EPILOGUE_WARPS * 32
TMA_WARP = 4
MMA_WARP = 5
SCHEDULER_WARP = 6
SFB_LOAD_WARP = 7
SFB_STORE_WARP0 = 8                       # warps 8-11: one per 32-lane TMEM partition
NUM_SFB_STORE_WARPS = 4
BASE_THREADS = 7 * 32                     # 224
SFB_STORE_THREADS = 12 * 32               # 384
EPILOGUE_BARRIER_ID = 1                   # named barrier of the 4 epilogue warps (0 = syncthreads)

# Tile-scheduler ring in shared memory: slots of 8 int32 (the fields of ``schedule.locate_tile``).
SCHEDULER_SLOTS = 2
SCHEDULER_FIELDS = 8
SCHEDULER_SLOT_BYTES = SCHEDULER_FIELDS * 4
TMEM_ADDRESS_BYTES = 4

# mbarriers: per pipeline stage, then per accumulator stage, then per scheduler slot.
STAGE_FULL, STAGE_EMPTY, SFB_FULL, SFB_TMEM_FULL = 0, 1, 2, 3
ACCUM_FULL, ACCUM_EMPTY, SCHED_FULL, SCHED_EMPTY = 0, 1, 2, 3

# Tensor maps, in the order the kernel's ``tensor_maps`` argument holds them (128 bytes each).
MAP_TOKENS, MAP_WEIGHTS, MAP_TOKEN_SCALES, MAP_WEIGHT_SCALES, MAP_OUT = range(5)
MAP_NAMES = ("tokens", "weights", "token_scales", "weight_scales", "out")
TENSOR_MAP_BYTES = 128
# TMA data type of the packed FP4 weights of W4A8: 16 E2M1 values (8 B) -> 16 B of shared memory.
FP4_UNPACK_DTYPE = "16U4_ALIGN16B"
FP4_UNPACK_INNER_MULTIPLE = 128           # cuTensorMapEncodeTiled: inner dim multiple of 128 elements
FP4_UNPACK_ADDRESS_ALIGN = 32


# ----------------------------------------------------------------------------------------------
# What a kernel is specialised on
# ----------------------------------------------------------------------------------------------
def mma_kind_for(a_format: str, b_format: str) -> str:
    """The ``tcgen05.mma`` kind of a token format x weight format pair (ValueError otherwise)."""
    a, b = get_format(a_format), get_format(b_format)
    if a.block_size != b.block_size or a.scale_dtype != b.scale_dtype:
        raise ValueError(f"operands must share block size and scale type, got {a.name} "
                         f"({a.block_size}, {a.scale_dtype}) and {b.name} ({b.block_size}, {b.scale_dtype})")
    if a.element == b.element == "e2m1":
        return dispatch.MMA_KIND_NVFP4 if a.scale_dtype == "ue4m3" else dispatch.MMA_KIND_MXFP4
    if a.scale_dtype != "ue8m0" or a.block_size != 32:
        raise ValueError(f"no tcgen05 kind for {a.name} x {b.name}: mxf8f6f4 needs UE8M0 block-32 scales")
    return dispatch.MMA_KIND_F8F6F4


@dataclass(frozen=True)
class Sm100KernelSpec:
    """Everything one compiled kernel is specialised on: token (``a_format``) and weight
    (``b_format``) formats and the tile knobs. The pipeline depth is a launch argument."""

    a_format: str
    b_format: str
    ab_swapped: bool
    mma_bn: int
    cta_group: int

    def __post_init__(self):
        for side in ("a_format", "b_format"):
            object.__setattr__(self, side, get_format(getattr(self, side)).name)
        ab_swapped, mma_bn, cta_group = dispatch.check_mma_tile(self.ab_swapped, self.mma_bn, self.cta_group)
        object.__setattr__(self, "ab_swapped", ab_swapped)
        object.__setattr__(self, "mma_bn", mma_bn)
        object.__setattr__(self, "cta_group", cta_group)
        mma_kind_for(self.a_format, self.b_format)

    @classmethod
    def of(cls, problem_or_formats, config) -> "Sm100KernelSpec":
        """From a ``GroupedProblem`` (or an (a_format, b_format) pair) and a ``KernelConfig`` /
        ``TileConfig``."""
        if isinstance(problem_or_formats, GroupedProblem):
            formats = (problem_or_formats.a_format.name, problem_or_formats.b_format.name)
        else:
            formats = tuple(problem_or_formats)
        tile = schedule.TileConfig.of(config)
        return cls(formats[0], formats[1], tile.ab_swapped, tile.mma_bn, tile.cta_group)

    # -- formats and the MMA ------------------------------------------------------------------
    @functools.cached_property
    def kind(self) -> desc.BlockScaledKind:
        return desc.get_kind(mma_kind_for(self.a_format, self.b_format))

    @property
    def token_element(self) -> str:
        return get_format(self.a_format).element

    @property
    def weight_element(self) -> str:
        return get_format(self.b_format).element

    @property
    def mma_a_element(self) -> str:
        return self.weight_element if self.ab_swapped else self.token_element

    @property
    def mma_b_element(self) -> str:
        return self.token_element if self.ab_swapped else self.weight_element

    @property
    def mma_m(self) -> int:
        return MMA_A_ROWS * self.cta_group

    @property
    def scale_type(self) -> str:
        return get_format(self.a_format).scale_dtype

    @property
    def block_size(self) -> int:
        return get_format(self.a_format).block_size

    @property
    def k_slice_elements(self) -> int:
        """K elements per 128-byte slice: 256 for the FP4 kinds, 128 for mxf8f6f4 (which holds
        every operand, FP4 included, one element per byte of shared memory)."""
        return dispatch.k_tile_elements_for_kind(self.kind.name)

    @functools.cached_property
    def num_sf_k_tiles(self) -> int:
        """Scale atoms (4 scale columns each) per K slice: NVFP4 4, MXFP4 2, MXFP8 / W4A8 1."""
        return self.k_slice_elements // (self.block_size * SF_ATOM_COLS)

    @functools.cached_property
    def instr_desc(self) -> int:
        """The base instruction descriptor (scale-factor IDs 0; the kernel sets them per MMA)."""
        return desc.BlockScaledInstrDesc(self.kind.name, self.mma_m, self.mma_bn, self.mma_a_element,
                                         self.mma_b_element, self.scale_type).encode()

    # -- tiles, stages, tensor memory ------------------------------------------------------------
    @property
    def tile_shape(self) -> schedule.TileShape:
        return schedule.TileConfig(self.ab_swapped, self.mma_bn, self.cta_group).tile_shape

    @property
    def b_rows_per_cta(self) -> int:
        return self.mma_bn // self.cta_group

    @property
    def b_tile_bytes(self) -> int:
        return self.b_rows_per_cta * K_SLICE_BYTES

    @property
    def sfb_atoms(self) -> int:
        """128-row scale atoms per scale K tile on the MMA-B side: ceil(mma_bn / 128)."""
        return -(-self.mma_bn // SF_ATOM_ROWS)

    @property
    def sfa_stage_bytes(self) -> int:
        return self.num_sf_k_tiles * SF_ATOM_BYTES

    @property
    def sfb_stage_bytes(self) -> int:
        return self.num_sf_k_tiles * self.sfb_atoms * SF_ATOM_BYTES

    @property
    def sfb_by_store_warps(self) -> bool:
        """``mma_bn < 64``: MMA-B scales go to TMEM through warps 7-11 and ``tcgen05.st``."""
        return self.mma_bn < SFB_STORE_MMA_BN

    @property
    def threads(self) -> int:
        return SFB_STORE_THREADS if self.sfb_by_store_warps else BASE_THREADS

    @property
    def stage_barrier_kinds(self) -> int:
        """mbarriers per stage: full, empty (+ MMA-B scales loaded, MMA-B scales in TMEM)."""
        return 4 if self.sfb_by_store_warps else 2

    @property
    def accum_stages(self) -> int:
        return dispatch.num_accum_pipeline_stages(self.mma_bn)

    @property
    def sched_consumer_warps(self) -> int:
        """Warps that read every scheduler slot (each arrives once on its empty barrier)."""
        base = NUM_EPILOGUE_WARPS + 2   # epilogue, TMA, MMA
        return base + 1 + NUM_SFB_STORE_WARPS if self.sfb_by_store_warps else base

    @property
    def expect_tx_bytes(self) -> int:
        """Bytes one CTA's main-pipeline TMA loads deliver per stage (the MMA-B scales ride
        on their own barrier when the store warps write them)."""
        sfb = 0 if self.sfb_by_store_warps else self.sfb_stage_bytes
        return A_TILE_BYTES + self.b_tile_bytes + self.sfa_stage_bytes + sfb

    @property
    def weights_unpacked_by_tma(self) -> bool:
        """W4A8: packed FP4 weights into the mxf8f6f4 one-byte-per-element layout (unpacking TMA)."""
        return self.kind.name == dispatch.MMA_KIND_F8F6F4 and get_format(self.b_format).packed

    @property
    def tokens_k_step(self) -> int:
        """Tokens-map innermost coordinate per K slice (bytes: uint8 map)."""
        return K_SLICE_BYTES

    @property
    def weights_k_step(self) -> int:
        """Weights-map innermost coordinate per K slice (bytes, or 4-bit elements when unpacked)."""
        return self.k_slice_elements if self.weights_unpacked_by_tma else K_SLICE_BYTES

    @property
    def scale_rows_per_stage(self) -> int:
        """16-byte scale rows of one stage's scale box: ``num_sf_k_tiles`` atoms of 32 rows."""
        return SCALE_ROWS_PER_ATOM * self.num_sf_k_tiles

    @property
    def load_regions(self) -> tuple:
        """(shared-memory region index in ``SMEM_REGIONS``, bytes per stage) of each TMA-loaded
        map, in ``MAP_*`` order (tokens, weights, token scales, weight scales)."""
        a, b = (SMEM_REGIONS.index("a_tiles"), A_TILE_BYTES), (SMEM_REGIONS.index("b_tiles"), self.b_tile_bytes)
        sfa, sfb = (SMEM_REGIONS.index("sfa"), self.sfa_stage_bytes), (SMEM_REGIONS.index("sfb"), self.sfb_stage_bytes)
        return (b, a, sfb, sfa) if self.ab_swapped else (a, b, sfa, sfb)

    @property
    def sfb_map(self) -> int:
        """The scale map of the MMA-B side (tokens when swapped)."""
        return MAP_TOKEN_SCALES if self.ab_swapped else MAP_WEIGHT_SCALES

    @property
    def sfa_stage_columns(self) -> int:
        return self.num_sf_k_tiles * SCALE_TMEM_COLUMNS

    @property
    def sfb_stage_columns(self) -> int:
        return self.num_sf_k_tiles * self.sfb_atoms * SCALE_TMEM_COLUMNS

    # -- epilogue -------------------------------------------------------------------------------
    @property
    def chunk_columns(self) -> int:
        """Accumulator columns the epilogue moves per step (``tcgen05.ld .32x32b.x<n>``)."""
        cap = SWAPPED_CHUNK_MAX if self.ab_swapped else UNSWAPPED_CHUNK_MAX
        return min(cap, self.mma_bn)

    @property
    def num_chunks(self) -> int:
        return self.mma_bn // self.chunk_columns

    @property
    def c_buffer_bytes(self) -> int:
        return MMA_A_ROWS * self.chunk_columns * OUTPUT_BYTES

    @property
    def c_swizzle_bytes(self) -> int:
        """Swizzle span of the bf16 output chunk in shared memory (16 = none): swapped chunks are
        rows of 128 weight columns (256 B, no swizzle); unswapped rows of ``chunk`` columns."""
        if self.ab_swapped:
            return SF_LANE_BYTES
        return min(self.chunk_columns * OUTPUT_BYTES, SWIZZLE_128B_BYTES)


# ----------------------------------------------------------------------------------------------
# Device-capable functions: plain integer Python, compiled into the kernel, called by the emulator
# ----------------------------------------------------------------------------------------------
def smem_offsets(stages, b_tile_bytes, sfa_stage_bytes, sfb_stage_bytes, c_buffer_bytes,
                 stage_barrier_kinds, accum_stages):
    """Byte offsets of the regions of the kernel's dynamic shared memory (device-capable):
    ``(a_tiles, b_tiles, c_buffers, sfa, sfb, barriers, scheduler slots, tmem address, total)``.

    A and B tiles (128B-swizzled) and the bf16 output buffers are multiples of 1024 bytes and
    come first, so each stays 1024-byte aligned; scale atoms (512 B, read by TMA and tcgen05.cp)
    follow, then the 8-byte mbarriers, the scheduler ring and the TMEM base address."""
    a_tiles = 0
    b_tiles = a_tiles + stages * A_TILE_BYTES
    c_buffers = b_tiles + stages * b_tile_bytes
    sfa = c_buffers + NUM_C_BUFFERS * c_buffer_bytes
    sfb = sfa + stages * sfa_stage_bytes
    barriers = sfb + stages * sfb_stage_bytes
    num_barriers = stage_barrier_kinds * stages + 2 * accum_stages + 2 * SCHEDULER_SLOTS
    sched = barriers + num_barriers * MBARRIER_BYTES
    tmem_slot = sched + SCHEDULER_SLOTS * SCHEDULER_SLOT_BYTES
    total = tmem_slot + TMEM_ADDRESS_BYTES
    return a_tiles, b_tiles, c_buffers, sfa, sfb, barriers, sched, tmem_slot, total


def stage_barrier(barriers, kind, stage, stages):
    """Byte offset of pipeline-stage mbarrier ``kind`` (``STAGE_FULL``...) of ``stage``."""
    return barriers + (kind * stages + stage) * MBARRIER_BYTES


def fixed_barrier(barriers, kind, index, stages, stage_barrier_kinds, accum_stages):
    """Byte offset of accumulator / scheduler mbarrier ``kind`` (``ACCUM_FULL``...) ``index``."""
    first = stage_barrier_kinds * stages
    if kind == ACCUM_FULL:
        position = first + index
    elif kind == ACCUM_EMPTY:
        position = first + accum_stages + index
    elif kind == SCHED_FULL:
        position = first + 2 * accum_stages + index
    else:
        position = first + 2 * accum_stages + SCHEDULER_SLOTS + index
    return barriers + position * MBARRIER_BYTES


def tmem_columns(stages, accum_stages, mma_bn, sfa_stage_columns, sfb_stage_columns):
    """TMEM column plan (device-capable): ``(sfa_base, sfb_base, columns_used)``. Accumulator
    stage ``s`` occupies columns ``[s * mma_bn, (s + 1) * mma_bn)``; pipeline stage ``t`` copies
    its scale atoms to ``sfa_base + t * sfa_stage_columns`` and ``sfb_base + t * sfb_stage_columns``."""
    sfa_base = accum_stages * mma_bn
    sfb_base = sfa_base + stages * sfa_stage_columns
    return sfa_base, sfb_base, sfb_base + stages * sfb_stage_columns


def pipeline_position(iteration, stages):
    """(stage, phase parity) of the ``iteration``-th use of a ring of ``stages`` slots."""
    return iteration % stages, (iteration // stages) & 1


def token_scale_row(token, group_start, a_scale_offset):
    """Padded scale row of ``token`` of a group starting at ``group_start`` (formats.md)."""
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


encode_smem_descriptor = desc.encode_smem_descriptor


# ----------------------------------------------------------------------------------------------
# Host plans built from the device-capable functions
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmemPlan:
    """The kernel's shared memory for one (spec, stages), in real bytes."""

    stages: int
    offsets: tuple            # smem_offsets(...)
    dynamic_bytes: int        # what the launch asks for
    reserved_bytes: int       # per-block system reservation (sm_90+: 1 KiB)
    per_stage_bytes: int      # tiles + scale atoms + mbarriers of one stage
    fixed_bytes: int          # everything else, reservation included
    stage_tiles: dict         # per-stage component -> bytes

    @property
    def total_bytes(self) -> int:
        return self.dynamic_bytes + self.reserved_bytes

    def region(self, name: str) -> int:
        return self.offsets[SMEM_REGIONS.index(name)]


SMEM_REGIONS = ("a_tiles", "b_tiles", "c_buffers", "sfa", "sfb", "barriers", "sched", "tmem_slot", "total")


def check_stages(stages) -> int:
    if isinstance(stages, (bool, np.bool_)) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    return int(stages)


def smem_plan(spec: Sm100KernelSpec, stages: int) -> SmemPlan:
    stages = check_stages(stages)
    offsets = smem_offsets(stages, spec.b_tile_bytes, spec.sfa_stage_bytes, spec.sfb_stage_bytes,
                           spec.c_buffer_bytes, spec.stage_barrier_kinds, spec.accum_stages)
    tiles = dict(a_tile=A_TILE_BYTES, b_tile=spec.b_tile_bytes, sfa=spec.sfa_stage_bytes,
                 sfb=spec.sfb_stage_bytes, stage_barriers=spec.stage_barrier_kinds * MBARRIER_BYTES)
    per_stage = sum(tiles.values())
    dynamic = offsets[-1]
    reserved = dispatch.SMEM_RESERVED_BYTES
    return SmemPlan(stages, offsets, dynamic, reserved, per_stage, dynamic + reserved - stages * per_stage, tiles)


@dataclass(frozen=True)
class TmemPlan:
    stages: int
    accum_columns: tuple      # first column of each accumulator stage
    sfa_base: int
    sfb_base: int
    columns_used: int
    columns_allocated: int = TMEM_ALLOC_COLUMNS


def tmem_plan(spec: Sm100KernelSpec, stages: int) -> TmemPlan:
    """TMEM columns of one (spec, stages); ValueError when they exceed the 512 columns."""
    stages = check_stages(stages)
    sfa_base, sfb_base, used = tmem_columns(stages, spec.accum_stages, spec.mma_bn, spec.sfa_stage_columns,
                                            spec.sfb_stage_columns)
    if used > TMEM_ALLOC_COLUMNS:
        raise ValueError(f"{spec}: {stages} stages need {used} TMEM columns (accumulators + per-stage "
                         f"scale atoms), more than the {TMEM_ALLOC_COLUMNS} there are")
    return TmemPlan(stages, tuple(s * spec.mma_bn for s in range(spec.accum_stages)), sfa_base, sfb_base, used)


def launch_smem_bytes(plan: SmemPlan, smem_per_sm: int = dispatch.B200_SMEM_PER_SM) -> int:
    """Dynamic shared memory to request at launch: the plan's, raised (if needed) so that two
    blocks cannot share an SM. The kernel allocates all 512 TMEM columns, so a second resident
    block would stall in ``tcgen05.alloc`` until the first exits, while other SMs sit idle."""
    two_blocks = smem_per_sm // 2 - plan.reserved_bytes   # largest request that still fits twice
    return max(plan.dynamic_bytes, two_blocks + 1)


def max_dynamic_smem_bytes(smem_per_sm: int = dispatch.B200_SMEM_PER_SM) -> int:
    """Largest dynamic shared memory one block may use: the SM's budget minus the reservation."""
    return smem_per_sm - dispatch.SMEM_RESERVED_BYTES


def check_launch_plan(spec: Sm100KernelSpec, stages: int,
                      smem_per_sm: int = dispatch.B200_SMEM_PER_SM) -> tuple[SmemPlan, TmemPlan]:
    """Both plans, or ValueError if the shared memory or the TMEM columns do not fit."""
    smem = smem_plan(spec, stages)
    if smem.total_bytes > smem_per_sm:
        raise ValueError(f"{spec} with {stages} stages needs {smem.total_bytes} B of shared memory "
                         f"({smem.dynamic_bytes} dynamic + {smem.reserved_bytes} reserved), more than "
                         f"{smem_per_sm} B")
    return smem, tmem_plan(spec, stages)


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


# ----------------------------------------------------------------------------------------------
# Checks before any device work
# ----------------------------------------------------------------------------------------------
def check_can_implement(problem: GroupedProblem, config) -> tuple[Sm100KernelSpec, int]:
    """(spec, stages) for ``problem`` with ``config`` (a ``KernelConfig``, whose stages are used,
    or a ``TileConfig``, which gets auto stages); TypeError / ValueError saying what is wrong."""
    if not isinstance(problem, GroupedProblem):
        raise TypeError(f"problem must be a GroupedProblem, got {type(problem).__name__}")
    problem.validate()
    require_packed(problem, "the SM100 kernel")
    for side in ("a_format", "b_format"):
        want, got = getattr(problem, side).name, getattr(config, side, None)
        if got is not None and got != want:
            raise ValueError(f"config was decided for {side}={got!r} but the problem's {side} is {want!r}")
    spec = Sm100KernelSpec.of(problem, config)
    if isinstance(config, dispatch.KernelConfig):
        stages = config.num_pipeline_stages
    else:
        stages = dispatch.auto_pipeline_stages(mma_bn=spec.mma_bn, cta_group=spec.cta_group,
                                               ab_swapped=spec.ab_swapped, num_sf_k_tiles=spec.num_sf_k_tiles)
    check_launch_plan(spec, stages)
    a_fmt, b_fmt = problem.a_format, problem.b_format
    for name, fmt in (("token", a_fmt), ("weight", b_fmt)):
        if fmt.row_bytes(problem.k) % 16:
            raise ValueError(f"K={problem.k}: {name} rows of {fmt.row_bytes(problem.k)} B are not a multiple of "
                             "16 B (TMA row stride); K must be a multiple of 32 for FP4, 16 for FP8")
    if spec.weights_unpacked_by_tma and problem.k % FP4_UNPACK_INNER_MULTIPLE:
        raise ValueError(f"W4A8 needs K % {FP4_UNPACK_INNER_MULTIPLE} == 0 (the unpacking TMA of the FP4 "
                         f"weights takes whole 128-element rows), got K={problem.k}")
    if (problem.n * OUTPUT_BYTES) % 16:
        raise ValueError(f"N={problem.n}: output rows of {problem.n * OUTPUT_BYTES} B are not a multiple of "
                         "16 B (TMA store row stride); N must be a multiple of 8")
    return spec, stages


def require_sm100() -> None:
    """RuntimeError unless a compute capability 10.0 GPU (B200 / GB200) is the current device."""
    from numba import config as numba_config
    from numba import cuda

    alternatives = ", ".join(f"'{b}'" for b in SUGGESTED_BACKENDS)
    need = ("the SM100 tcgen05 kernel needs an NVIDIA Blackwell data-center GPU of compute capability "
            f"{SM100_COMPUTE_CAPABILITY[0]}.{SM100_COMPUTE_CAPABILITY[1]} (B200 / GB200, sm_100a)")
    instead = (f"use backend {alternatives} instead ('h200_stream' on an H200 / Hopper GPU, 'simt' on any "
               "CUDA GPU, 'reference' on the CPU)")
    if numba_config.ENABLE_CUDASIM or not cuda.is_available():
        raise RuntimeError(f"{need}; no CUDA GPU is available here (Numba's simulator cannot run inline "
                           f"PTX); {instead}")
    device = cuda.get_current_device()
    cc = tuple(device.compute_capability)
    if cc != SM100_COMPUTE_CAPABILITY:
        name = device.name.decode() if isinstance(device.name, bytes) else device.name
        raise RuntimeError(f"{need}; the current GPU ({name}) has compute capability {cc[0]}.{cc[1]}; {instead}")


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
_FULL_MASK = 0xFFFFFFFF
_PAIR_MASK = 0b11   # both CTAs of the pair (multicast commit)
_TMA_TEXT = ("cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
             ".cta_group::2 [$0], [$1, {{{coords}}}], [${mbar}];")


@functools.cache
def tma_load_cta_pair(rank: int):
    """TMA load whose completion goes to an mbarrier in either CTA of the pair (``.cta_group::2``:
    ``mbar`` is a shared::cluster address, e.g. ``mapa`` of the even CTA's barrier). SASS
    ``UTMALDG.<rank>D.2CTA``. Operands as ``copy.tma_load_<rank>d``."""
    from gbs.ptx_inline.common import ptx_intrinsic

    names = ("c0", "c1", "c2")[:rank]
    text = _TMA_TEXT.format(rank=rank, coords=", ".join(f"${i + 2}" for i in range(rank)), mbar=rank + 2)
    return ptx_intrinsic(f"tma_load_{rank}d_cta_pair", text,
                         [("dst_smem", "u32"), ("tensor_map", "u64")] + [(c, "s32") for c in names]
                         + [("mbar", "u32")], doc=tma_load_cta_pair.__doc__)


def _device(func, **callees):
    from numba import cuda

    return cuda.jit(device=True)(rebind(func, **callees) if callees else func)


def make_kernel_function(spec: Sm100KernelSpec):
    """The kernel as a Python function (closure over ``spec``), for ``cuda.jit`` or an offline
    compile; fresh device functions on every call (see ``schedule.device_functions``).

    Signature: ``(tensor_maps u8[:], a_offsets i64[:], a_scale_offsets i64[:], expert_ids i32[:],
    expert_scales f32[:], out u16[:, :], n, k, num_tiles, stages)``; launch with ``spec.threads``
    threads, clusters of ``spec.cta_group`` CTAs and ``smem_plan(spec, stages).dynamic_bytes``
    bytes of dynamic shared memory."""
    from numba import cuda, float32, int64, uint16, uint32

    from gbs.ptx_inline import cluster, copy, mbarrier, tcgen05
    from gbs.ptx_inline.common import (fence_mbarrier_init_release_cluster, fence_proxy_async_shared_cta,
                                       generic_address, laneid, named_barrier_sync, shared_address,
                                       warp_index)

    walk = schedule.device_functions()
    locate_tile, cta_output_rows, ceil_div = walk.locate_tile, walk.cta_output_rows, walk.ceil_div
    d_offsets = _device(smem_offsets)
    d_stage_barrier = _device(stage_barrier)
    d_fixed_barrier = _device(fixed_barrier)
    d_tmem_columns = _device(tmem_columns)
    d_position = _device(pipeline_position)
    d_scale_row = _device(token_scale_row)
    d_coordinates = _device(tile_load_coordinates, token_scale_row=d_scale_row)
    d_k_coordinates = _device(stage_k_coordinates)
    d_sfb_adjust = _device(sfb_column_adjust)
    d_encode = _device(encode_smem_descriptor)
    d_operand_desc = _device(operand_descriptor, encode_smem_descriptor=d_encode)
    d_scale_desc = _device(scale_atom_descriptor, encode_smem_descriptor=d_encode)
    d_copy_offsets = _device(scale_copy_offsets)
    d_mma_scales = _device(mma_scale_columns, mma_scale_slot=_device(mma_scale_slot))
    d_sf_ids = _device(desc.with_scale_factor_ids)
    d_sfb_word = _device(sfb_store_word_offset, scale_byte_offset=_device(scale_byte_offset))
    d_live = _device(chunk_is_live)
    d_uses_tma = _device(chunk_uses_tma_store)
    d_store_coords = _device(tma_store_coordinates)
    d_output = _device(accumulator_output)
    d_swizzled = _device(tma_swizzled_offset)
    d_c_offset = _device(c_buffer_offset, tma_swizzled_offset=d_swizzled)
    d_bf16 = _device(bf16_bits_rne)

    # Compile-time constants of this specialisation.
    cta_group, swapped, mma_bn = spec.cta_group, spec.ab_swapped, spec.mma_bn
    two_ctas = cta_group == 2
    store_warps = spec.sfb_by_store_warps
    tile_tokens, tile_rows = spec.tile_shape.tokens, spec.tile_shape.weight_rows
    b_rows, b_tile_bytes = spec.b_rows_per_cta, spec.b_tile_bytes
    sfa_stage_bytes, sfb_stage_bytes = spec.sfa_stage_bytes, spec.sfb_stage_bytes
    sfa_cols, sfb_cols = spec.sfa_stage_columns, spec.sfb_stage_columns
    nsf, sfb_atoms, scale_vec = spec.num_sf_k_tiles, spec.sfb_atoms, spec.kind.scale_vec
    k_slice_elements = spec.k_slice_elements
    barrier_kinds, accum_stages = spec.stage_barrier_kinds, spec.accum_stages
    consumers = spec.sched_consumer_warps
    expect_tx = spec.expect_tx_bytes * cta_group
    instr_desc = spec.instr_desc
    chunk, num_chunks = spec.chunk_columns, spec.num_chunks
    c_bytes, c_swizzle = spec.c_buffer_bytes, spec.c_swizzle_bytes
    tokens_k_step, weights_k_step, scale_rows = spec.tokens_k_step, spec.weights_k_step, spec.scale_rows_per_stage
    # Where each map's box goes: (index into smem_offsets, bytes per stage), MAP_* order.
    (tokens_region, tokens_stride), (weights_region, weights_stride), (token_sf_region, token_sf_stride), \
        (weight_sf_region, weight_sf_stride) = spec.load_regions
    sfb_map = spec.sfb_map
    # With the store warps the MMA-B scales ride on their own barrier, loaded by warp 7.
    load_token_scales = not (store_warps and sfb_map == MAP_TOKEN_SCALES)
    load_weight_scales = not (store_warps and sfb_map == MAP_WEIGHT_SCALES)

    mma = tcgen05.mma_block_scaled(spec.kind.name, cta_group)
    scale_copy = tcgen05.cp_32x128b_warpx4(cta_group)
    commit = tcgen05.commit(cta_group)
    commit_multicast = tcgen05.commit_multicast(cta_group)
    alloc, dealloc = tcgen05.alloc(cta_group), tcgen05.dealloc(cta_group)
    relinquish = tcgen05.relinquish_alloc_permit(cta_group)
    load_chunk = tcgen05.ld_32x32b(chunk)
    store_word = tcgen05.st_32x32b(1)
    tma_2d = tma_load_cta_pair(2) if two_ctas else copy.tma_load_2d
    tma_3d = tma_load_cta_pair(3) if two_ctas else copy.tma_load_3d
    wait_store_read_1 = copy.bulk_wait_group_read(1)

    @cuda.jit(device=True)
    def next_tile(sched_words, sched, barriers, stages, index, lane):
        """Read scheduler slot ``index % SLOTS`` (whole warp), release it, return its fields."""
        slot, phase = d_position(index, SCHEDULER_SLOTS)
        mbarrier.mbarrier_wait_parity(d_fixed_barrier(barriers, SCHED_FULL, slot, stages, barrier_kinds,
                                                      accum_stages), phase)
        base = (sched + slot * SCHEDULER_SLOT_BYTES) // 4
        fields = (int64(sched_words[base]), int64(sched_words[base + 1]), int64(sched_words[base + 2]),
                  int64(sched_words[base + 3]), int64(sched_words[base + 4]), int64(sched_words[base + 5]),
                  int64(sched_words[base + 6]), int64(sched_words[base + 7]))
        cuda.syncwarp(_FULL_MASK)
        if lane == 0:
            mbarrier.mbarrier_arrive(d_fixed_barrier(barriers, SCHED_EMPTY, slot, stages, barrier_kinds,
                                                     accum_stages))
        return fields

    def grouped_matmul_sm100_kernel(tensor_maps, a_offsets, a_scale_offsets, expert_ids, expert_scales, out,
                                    n, k, num_tiles, stages):
        dyn = cuda.shared.array(0, dtype=np.uint8, alignment=SWIZZLE_ATOM_BYTES)
        words = dyn.view(np.uint32)
        sched_words = dyn.view(np.int32)
        halves = dyn.view(np.uint16)
        smem = int64(shared_address(dyn))
        offs = d_offsets(stages, b_tile_bytes, sfa_stage_bytes, sfb_stage_bytes, c_bytes, barrier_kinds,
                         accum_stages)
        a_tiles, b_tiles, c_buffers, sfa_atoms, sfb_atoms_off, barriers, sched, tmem_slot, _ = offs
        sfa_base, sfb_base, _ = d_tmem_columns(stages, accum_stages, mma_bn, sfa_cols, sfb_cols)
        warp = warp_index()
        lane = laneid()
        tid = cuda.threadIdx.x
        rank = int64(cluster.cluster_ctarank()) if two_ctas else int64(0)
        pair = cuda.blockIdx.x // cta_group
        num_pairs = cuda.gridDim.x // cta_group
        num_k_slices = ceil_div(k, k_slice_elements)
        row_bands = ceil_div(n, SF_ATOM_ROWS)
        maps = int64(generic_address(tensor_maps))

        # ---- prologue: barriers, TMEM, everyone synchronised (cluster-wide for a pair) ----
        if tid == 0:
            for s in range(stages):
                mbarrier.mbarrier_init(smem + d_stage_barrier(barriers, STAGE_FULL, s, stages), 1)
                mbarrier.mbarrier_init(smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages), 1)
                if store_warps:
                    mbarrier.mbarrier_init(smem + d_stage_barrier(barriers, SFB_FULL, s, stages), 1)
                    mbarrier.mbarrier_init(smem + d_stage_barrier(barriers, SFB_TMEM_FULL, s, stages),
                                           NUM_SFB_STORE_WARPS)
            for a in range(accum_stages):
                mbarrier.mbarrier_init(smem + d_fixed_barrier(barriers, ACCUM_FULL, a, stages, barrier_kinds,
                                                              accum_stages), 1)
                mbarrier.mbarrier_init(smem + d_fixed_barrier(barriers, ACCUM_EMPTY, a, stages, barrier_kinds,
                                                              accum_stages), NUM_EPILOGUE_WARPS * cta_group)
            for q in range(SCHEDULER_SLOTS):
                mbarrier.mbarrier_init(smem + d_fixed_barrier(barriers, SCHED_FULL, q, stages, barrier_kinds,
                                                              accum_stages), 1)
                mbarrier.mbarrier_init(smem + d_fixed_barrier(barriers, SCHED_EMPTY, q, stages, barrier_kinds,
                                                              accum_stages), consumers)
            fence_mbarrier_init_release_cluster()
            fence_proxy_async_shared_cta()
        if warp == MMA_WARP:
            alloc(smem + tmem_slot, TMEM_ALLOC_COLUMNS)
            relinquish()
        tcgen05.fence_before_thread_sync()
        if two_ctas:
            cluster.cluster_arrive_release()
            cluster.cluster_wait_acquire()
        else:
            cuda.syncthreads()
        tcgen05.fence_after_thread_sync()
        tmem_base = int64(words[tmem_slot // 4])

        if warp == SCHEDULER_WARP:
            # ---- tile scheduler: the pair's tiles, then a terminator (slot -1) ----
            index = int64(0)
            while True:
                slot_q, phase = d_position(index, SCHEDULER_SLOTS)
                mbarrier.mbarrier_wait_parity(smem + d_fixed_barrier(barriers, SCHED_EMPTY, slot_q, stages,
                                                                     barrier_kinds, accum_stages), phase ^ 1)
                tile = pair + index * num_pairs
                if lane == 0:
                    fields = locate_tile(tile if tile < num_tiles else num_tiles, a_offsets, expert_ids, n,
                                         tile_tokens, tile_rows)
                    base = (sched + slot_q * SCHEDULER_SLOT_BYTES) // 4
                    for f in range(SCHEDULER_FIELDS):
                        sched_words[base + f] = fields[f]
                    mbarrier.mbarrier_arrive(smem + d_fixed_barrier(barriers, SCHED_FULL, slot_q, stages,
                                                                    barrier_kinds, accum_stages))
                cuda.syncwarp(_FULL_MASK)
                index += 1
                if tile >= num_tiles:
                    break

        elif warp == TMA_WARP:
            # ---- producer: one 128-byte K slice of both tiles and their scale atoms per stage ----
            if lane == 0:
                for m in (MAP_TOKENS, MAP_WEIGHTS, MAP_TOKEN_SCALES, MAP_WEIGHT_SCALES):
                    copy.fence_proxy_tensormap_acquire_sys(maps + m * TENSOR_MAP_BYTES)
                    copy.prefetch_tensormap(maps + m * TENSOR_MAP_BYTES)
            index = int64(0)
            k_iter = int64(0)
            while True:
                slot, expert, _, _, token_start, _, row_start, _ = next_tile(
                    sched_words, sched, smem + barriers, stages, index, lane)
                index += 1
                if slot < 0:
                    break
                token_row, weight_row, token_band, weight_band, _ = d_coordinates(
                    swapped, b_rows, rank, expert, token_start, row_start, a_offsets[slot], a_scale_offsets[slot],
                    row_bands)
                for kk in range(num_k_slices):
                    s, phase = d_position(k_iter, stages)
                    mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages),
                                                  phase ^ 1)
                    if lane == 0:
                        full = smem + d_stage_barrier(barriers, STAGE_FULL, s, stages)
                        if rank == 0:
                            mbarrier.mbarrier_arrive_expect_tx(full, expect_tx)
                        if two_ctas:   # the pair's loads all complete on the even CTA's barrier
                            full = int64(cluster.mapa_shared_cluster(full, 0))
                        tokens_k, weights_k, scales_k = d_k_coordinates(kk, tokens_k_step, weights_k_step, scale_rows)
                        tma_2d(smem + offs[tokens_region] + s * tokens_stride, maps + MAP_TOKENS * TENSOR_MAP_BYTES,
                               tokens_k, token_row, full)
                        tma_3d(smem + offs[weights_region] + s * weights_stride, maps + MAP_WEIGHTS * TENSOR_MAP_BYTES,
                               weights_k, weight_row, expert, full)
                        if load_token_scales:
                            tma_3d(smem + offs[token_sf_region] + s * token_sf_stride,
                                   maps + MAP_TOKEN_SCALES * TENSOR_MAP_BYTES, 0, scales_k, token_band, full)
                        if load_weight_scales:
                            tma_3d(smem + offs[weight_sf_region] + s * weight_sf_stride,
                                   maps + MAP_WEIGHT_SCALES * TENSOR_MAP_BYTES, 0, scales_k, weight_band, full)
                    cuda.syncwarp(_FULL_MASK)
                    k_iter += 1
            # Drain: every stage's last use released, so no MMA still reads this CTA's tiles and
            # no commit is still to arrive on its barriers.
            for _ in range(stages):
                s, phase = d_position(k_iter, stages)
                mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages), phase ^ 1)
                k_iter += 1

        elif warp == MMA_WARP:
            # ---- MMA issue (the even CTA of a pair issues for both) ----
            index = int64(0)
            k_iter = int64(0)
            acc_iter = int64(0)
            while True:
                slot, expert, _, _, token_start, _, row_start, _ = next_tile(
                    sched_words, sched, smem + barriers, stages, index, lane)
                index += 1
                if slot < 0:
                    break
                if rank != 0:
                    continue
                _, _, _, _, sfb_row = d_coordinates(swapped, b_rows, rank, expert, token_start, row_start,
                                                    a_offsets[slot], a_scale_offsets[slot], row_bands)
                sfb_adjust = d_sfb_adjust(sfb_row, store_warps)
                acc, acc_phase = d_position(acc_iter, accum_stages)
                accum_empty = smem + d_fixed_barrier(barriers, ACCUM_EMPTY, acc, stages, barrier_kinds, accum_stages)
                if two_ctas:
                    mbarrier.mbarrier_wait_parity_acquire_cluster(accum_empty, acc_phase ^ 1)
                else:
                    mbarrier.mbarrier_wait_parity(accum_empty, acc_phase ^ 1)
                tcgen05.fence_after_thread_sync()
                d_tmem = tmem_base + acc * mma_bn
                for kk in range(num_k_slices):
                    s, phase = d_position(k_iter, stages)
                    mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, STAGE_FULL, s, stages), phase)
                    if store_warps:
                        mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, SFB_TMEM_FULL, s, stages),
                                                      phase)
                    tcgen05.fence_after_thread_sync()
                    if lane == 0:
                        sfa_tmem = tmem_base + sfa_base + s * sfa_cols
                        sfb_tmem = tmem_base + sfb_base + s * sfb_cols
                        sfa_smem = smem + sfa_atoms + s * sfa_stage_bytes
                        sfb_smem = smem + sfb_atoms_off + s * sfb_stage_bytes
                        for j in range(nsf):
                            column, offset = d_copy_offsets(j, 0, nsf, 1)
                            scale_copy(sfa_tmem + column, d_scale_desc(sfa_smem + offset))
                            if not store_warps:
                                for band in range(sfb_atoms):
                                    column, offset = d_copy_offsets(j, band, nsf, sfb_atoms)
                                    scale_copy(sfb_tmem + column, d_scale_desc(sfb_smem + offset))
                        a_tile = smem + a_tiles + s * A_TILE_BYTES
                        b_tile = smem + b_tiles + s * b_tile_bytes
                        for i in range(MMAS_PER_K_SLICE):
                            sfa_column, sfb_column, sf_id = d_mma_scales(i, scale_vec, sfb_atoms, sfb_adjust)
                            mma(d_tmem, d_operand_desc(a_tile, i), d_operand_desc(b_tile, i),
                                d_sf_ids(instr_desc, sf_id, sf_id), sfa_tmem + sfa_column, sfb_tmem + sfb_column,
                                1 if (kk > 0 or i > 0) else 0)
                        empty = smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages)
                        if two_ctas:
                            commit_multicast(empty, _PAIR_MASK)
                        else:
                            commit(empty)
                    cuda.syncwarp(_FULL_MASK)
                    k_iter += 1
                if lane == 0:
                    accum_full = smem + d_fixed_barrier(barriers, ACCUM_FULL, acc, stages, barrier_kinds,
                                                        accum_stages)
                    if two_ctas:
                        commit_multicast(accum_full, _PAIR_MASK)
                    else:
                        commit(accum_full)
                cuda.syncwarp(_FULL_MASK)
                acc_iter += 1

        elif warp < NUM_EPILOGUE_WARPS:
            # ---- epilogue: TMEM -> x expert scale -> bf16 -> TMA store or masked stores ----
            index = int64(0)
            acc_iter = int64(0)
            c_uses = int64(0)
            lane_row = warp * 32 + lane
            tmem_lanes = tmem_base + ((warp * 32) << desc.TMEM_LANE_SHIFT)
            if tid == 0:   # the one thread that issues the TMA stores
                copy.fence_proxy_tensormap_acquire_sys(maps + MAP_OUT * TENSOR_MAP_BYTES)
            while True:
                slot, expert, _, _, token_start, token_end, row_start, row_end = next_tile(
                    sched_words, sched, smem + barriers, stages, index, lane)
                index += 1
                if slot < 0:
                    break
                acc, acc_phase = d_position(acc_iter, accum_stages)
                mbarrier.mbarrier_wait_parity(smem + d_fixed_barrier(barriers, ACCUM_FULL, acc, stages,
                                                                     barrier_kinds, accum_stages), acc_phase)
                tcgen05.fence_after_thread_sync()
                row_lo, row_hi = cta_output_rows(row_start, row_end, rank, cta_group, tile_rows)
                scale = expert_scales[expert]
                for c in range(num_chunks):
                    if not d_live(swapped, c, chunk, token_start, token_end, row_lo, row_hi):
                        continue
                    values = load_chunk(tmem_lanes + acc * mma_bn + c * chunk)
                    tcgen05.wait_ld()
                    if d_uses_tma(swapped, c, chunk, token_start, token_end):
                        buffer = c_buffers + (c_uses % NUM_C_BUFFERS) * c_bytes
                        if tid == 0:
                            wait_store_read_1()   # the store that last read this buffer is done
                        named_barrier_sync(EPILOGUE_BARRIER_ID, EPILOGUE_THREADS)
                        for j, v in enumerate(values):
                            bits = d_bf16(uint32(cuda.libdevice.float_as_int(float32(v * scale))))
                            halves[(buffer + d_c_offset(swapped, lane_row, j, chunk, c_swizzle)) // OUTPUT_BYTES] = \
                                uint16(bits)
                        fence_proxy_async_shared_cta()
                        named_barrier_sync(EPILOGUE_BARRIER_ID, EPILOGUE_THREADS)
                        if tid == 0:
                            c0, c1 = d_store_coords(swapped, c, chunk, token_start, row_lo)
                            copy.tma_store_2d(maps + MAP_OUT * TENSOR_MAP_BYTES, c0, c1, smem + buffer)
                            copy.bulk_commit_group()
                        c_uses += 1
                    else:
                        for j, v in enumerate(values):
                            token, column = d_output(swapped, lane_row, c * chunk + j, token_start, row_lo)
                            if token < token_end and column < row_hi:
                                bits = d_bf16(uint32(cuda.libdevice.float_as_int(float32(v * scale))))
                                out[token, column] = uint16(bits)
                # Release the accumulator stage to the MMA warp (of the even CTA).
                tcgen05.fence_before_thread_sync()
                cuda.syncwarp(_FULL_MASK)
                if lane == 0:
                    accum_empty = smem + d_fixed_barrier(barriers, ACCUM_EMPTY, acc, stages, barrier_kinds,
                                                         accum_stages)
                    if two_ctas:
                        mbarrier.mbarrier_arrive_remote_cluster(cluster.mapa_shared_cluster(accum_empty, 0))
                    else:
                        mbarrier.mbarrier_arrive(accum_empty)
                acc_iter += 1
            if tid == 0:
                copy.bulk_wait_group_read_0()

        elif store_warps and warp == SFB_LOAD_WARP:
            # ---- MMA-B scale atoms of each stage, on their own barrier ----
            if lane == 0:
                copy.fence_proxy_tensormap_acquire_sys(maps + sfb_map * TENSOR_MAP_BYTES)
            index = int64(0)
            k_iter = int64(0)
            while True:
                slot, expert, _, _, token_start, _, row_start, _ = next_tile(
                    sched_words, sched, smem + barriers, stages, index, lane)
                index += 1
                if slot < 0:
                    break
                _, _, token_band, weight_band, _ = d_coordinates(swapped, b_rows, rank, expert, token_start,
                                                                 row_start, a_offsets[slot], a_scale_offsets[slot],
                                                                 row_bands)
                sfb_band = token_band if sfb_map == MAP_TOKEN_SCALES else weight_band
                for kk in range(num_k_slices):
                    s, phase = d_position(k_iter, stages)
                    mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages),
                                                  phase ^ 1)
                    if lane == 0:
                        loaded = smem + d_stage_barrier(barriers, SFB_FULL, s, stages)
                        mbarrier.mbarrier_arrive_expect_tx(loaded, sfb_stage_bytes)
                        _, _, scales_k = d_k_coordinates(kk, tokens_k_step, weights_k_step, scale_rows)
                        copy.tma_load_3d(smem + sfb_atoms_off + s * sfb_stage_bytes,
                                         maps + sfb_map * TENSOR_MAP_BYTES, 0, scales_k, sfb_band, loaded)
                    cuda.syncwarp(_FULL_MASK)
                    k_iter += 1
            for _ in range(stages):
                s, phase = d_position(k_iter, stages)
                mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, STAGE_EMPTY, s, stages), phase ^ 1)
                k_iter += 1

        elif store_warps and warp >= SFB_STORE_WARP0:
            # ---- the tile's MMA-B scale rows -> TMEM lanes 0..mma_bn-1 of every partition ----
            partition = warp - SFB_STORE_WARP0
            index = int64(0)
            k_iter = int64(0)
            while True:
                slot, expert, _, _, token_start, _, row_start, _ = next_tile(
                    sched_words, sched, smem + barriers, stages, index, lane)
                index += 1
                if slot < 0:
                    break
                _, _, _, _, sfb_row = d_coordinates(swapped, b_rows, rank, expert, token_start, row_start,
                                                    a_offsets[slot], a_scale_offsets[slot], row_bands)
                for kk in range(num_k_slices):
                    s, phase = d_position(k_iter, stages)
                    mbarrier.mbarrier_wait_parity(smem + d_stage_barrier(barriers, SFB_FULL, s, stages), phase)
                    atoms = sfb_atoms_off + s * sfb_stage_bytes
                    column = tmem_base + ((partition * 32) << desc.TMEM_LANE_SHIFT) + sfb_base + s * sfb_cols
                    for j in range(nsf):
                        word = uint32(0)
                        if lane < mma_bn:
                            word = words[(atoms + d_sfb_word(sfb_row, lane, j, nsf)) // 4]
                        store_word(column + j * SCALE_TMEM_COLUMNS, (word,))
                    tcgen05.wait_st()
                    tcgen05.fence_before_thread_sync()
                    cuda.syncwarp(_FULL_MASK)
                    if lane == 0:
                        mbarrier.mbarrier_arrive(smem + d_stage_barrier(barriers, SFB_TMEM_FULL, s, stages))
                    k_iter += 1

        # ---- teardown: all roles done (both CTAs of a pair), then free the tensor memory ----
        tcgen05.fence_before_thread_sync()
        cuda.syncthreads()
        if two_ctas:
            cluster.cluster_arrive_release()
            cluster.cluster_wait_acquire()
        if warp == MMA_WARP:
            tcgen05.fence_after_thread_sync()
            dealloc(tmem_base, TMEM_ALLOC_COLUMNS)

    return grouped_matmul_sm100_kernel


# ----------------------------------------------------------------------------------------------
# Every configuration the dispatch can return, and the offline build CI checks
# ----------------------------------------------------------------------------------------------
_REPRESENTATIVE_SLOTS = 8
# (label, dispatch entry point, keyword arguments): problems that drive every rule of
# ``gbs.dispatch`` (regimes, tuned and auto stages, the Kimi rule, the routing's default) to each
# distinct outcome; estimated_total_m = slots x avg_m.
_DISPATCH_CASES = (
    ("nvfp4 decode", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=8)),
    ("nvfp4 small prefill, tuned", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=64)),
    ("nvfp4 small prefill, auto", "route", dict(a_format="nvfp4", b_format="nvfp4", n=2048, k=2048, m=64)),
    ("nvfp4 large prefill, tuned 7", "route", dict(a_format="nvfp4", b_format="nvfp4", n=4096, k=7168, m=512)),
    ("nvfp4 large prefill, tuned 6", "route", dict(a_format="nvfp4", b_format="nvfp4", n=7168, k=2048, m=512)),
    ("nvfp4 large prefill, auto", "route", dict(a_format="nvfp4", b_format="nvfp4", n=2048, k=2048, m=512)),
    ("nvfp4 Kimi 64/2", "route", dict(a_format="nvfp4", b_format="nvfp4", n=512, k=7168, m=8)),
    ("nvfp4 Kimi 128/2", "route", dict(a_format="nvfp4", b_format="nvfp4", n=512, k=7168, m=512)),
    ("mxfp4 default", "route", dict(a_format="mxfp4", b_format="mxfp4", n=4096, k=7168, m=512)),
    ("mxfp8 default", "route", dict(a_format="mxfp8", b_format="mxfp8", n=4096, k=7168, m=512)),
    ("mxfp8 decode, tuned", "mxfp8", dict(b_format="mxfp8", n=6144, k=6144, m=8)),
    ("mxfp8 decode, auto", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=8)),
    ("mxfp8 small prefill", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=64)),
    ("mxfp8 large prefill", "mxfp8", dict(b_format="mxfp8", n=4096, k=4096, m=512)),
    ("w4a8 decode, tuned", "route", dict(a_format="mxfp8", b_format="mxfp4", n=6144, k=6144, m=8)),
    ("w4a8 decode, auto", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=8)),
    ("w4a8 small prefill", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=64)),
    ("w4a8 large prefill", "route", dict(a_format="mxfp8", b_format="mxfp4", n=4096, k=4096, m=512)),
)


def dispatch_outcomes() -> list[tuple[str, dispatch.KernelConfig]]:
    """(label, config) for every distinct decision of the SM100 dispatch (knobs and stages):
    NVFP4 regimes with tuned / decode-default / auto stages and both Kimi rules, the routing's
    default config (MXFP4, MXFP8), and the MXFP8 regime dispatch (MXFP8 and W4A8 weights)."""
    outcomes = []
    for label, entry, case in _DISPATCH_CASES:
        case = dict(case)
        avg_m = case.pop("m")
        common = dict(num_active_experts=_REPRESENTATIVE_SLOTS, estimated_total_m=_REPRESENTATIVE_SLOTS * avg_m)
        if entry == "route":
            config = dispatch.grouped_matmul_block_scaled_sm100_dispatch(**case, **common)
        else:
            config = dispatch.grouped_matmul_mxfp8_dispatch(**case, **common)
        outcomes.append((label, config))
    return outcomes


@dataclass(frozen=True)
class AssembledKernel:
    """One kernel assembled offline for sm_100a: cubin, SASS listing, ptxas resources."""

    spec: Sm100KernelSpec
    cubin: bytes
    sass: str
    registers: int
    static_shared_bytes: int     # what cuobjdump reports: the 1 KiB reservation (all else is dynamic)
    local_bytes: int


def assemble(spec: Sm100KernelSpec) -> AssembledKernel:
    """Compile ``spec``'s kernel for sm_100a through NVVM and nvJitLink (no GPU needed) with the
    launch bounds of its thread count (so ptxas caps registers for one block per SM)."""
    from gbs.ptx_inline import offline

    cubin = offline.compile_cubin(make_kernel_function(spec), kernel_signature(), offline.SM100A,
                                  launch_bounds=(spec.threads, 1))
    resources = offline.resource_usage(cubin)
    return AssembledKernel(spec, cubin, offline.disassemble(cubin), resources.registers, resources.shared_bytes,
                           resources.local_bytes)


def own_max_stages(spec: Sm100KernelSpec, smem_per_sm: int = dispatch.B200_SMEM_PER_SM) -> int:
    """The deepest pipeline this kernel's real shared memory and TMEM plans allow (>= the formula's)."""
    stages = 0
    while True:
        try:
            check_launch_plan(spec, stages + 1, smem_per_sm)
        except ValueError:
            return stages
        stages += 1


RESOURCE_COLUMNS = ("label", "knobs", "stages", "threads", "registers", "smem_total", "per_stage", "formula_per_stage",
                    "fixed", "formula_fixed", "tmem_columns", "own_max_stages", "formula_max_stages")


def resource_rows(outcomes, assemble_fn=assemble) -> list[dict]:
    """Registers, shared memory (real per-stage / fixed bytes beside the stages=auto formula's)
    and TMEM columns of each (label, KernelConfig); ``assemble_fn(spec)`` gives the registers."""
    rows = []
    for label, config in outcomes:
        spec = Sm100KernelSpec.of((config.a_format, config.b_format), config)
        smem, tmem = check_launch_plan(spec, config.num_pipeline_stages)
        terms = config.smem_terms()
        knobs = f"{'T' if spec.ab_swapped else 'F'}/{spec.mma_bn}/{spec.cta_group}"
        rows.append(dict(label=label, knobs=knobs, stages=config.num_pipeline_stages, threads=spec.threads,
                         registers=assemble_fn(spec).registers, smem_total=smem.total_bytes,
                         per_stage=smem.per_stage_bytes, formula_per_stage=terms.per_stage, fixed=smem.fixed_bytes,
                         formula_fixed=terms.fixed, tmem_columns=tmem.columns_used,
                         own_max_stages=own_max_stages(spec), formula_max_stages=config.max_pipeline_stages))
    return rows


def format_resource_table(rows) -> str:
    """The rows as a fixed-width text table (bytes; TMEM in columns of 512)."""
    header = ("config", "AB/bn/cg", "stages", "thr", "regs", "smem B", "stage B (formula)", "fixed B (formula)",
              "TMEM cols", "max stages own/formula")
    lines = [header]
    for r in rows:
        lines.append((r["label"], r["knobs"], str(r["stages"]), str(r["threads"]), str(r["registers"]),
                      str(r["smem_total"]), f"{r['per_stage']} ({r['formula_per_stage']})",
                      f"{r['fixed']} ({r['formula_fixed']})", f"{r['tmem_columns']}/{TMEM_ALLOC_COLUMNS}",
                      f"{r['own_max_stages']}/{r['formula_max_stages']}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def kernel_signature():
    """Argument types of ``make_kernel_function``'s kernel (for offline compiles and launches)."""
    from numba.cuda import types

    return (types.uint8[::1], types.int64[::1], types.int64[::1], types.int32[::1], types.float32[::1],
            types.uint16[:, ::1], types.int64, types.int64, types.int64, types.int64)


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------
def _encode_fp4_unpack_map(address: int, map_spec: TensorMapSpec) -> np.ndarray:
    """cuTensorMapEncodeTiled for the unpacking FP4 map (``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B``),
    a data type ``copy.encode_tensor_map_*`` does not take (its dims count 4-bit elements)."""
    from cuda.bindings import driver

    if address % FP4_UNPACK_ADDRESS_ALIGN or map_spec.dims[0] % FP4_UNPACK_INNER_MULTIPLE:
        raise ValueError(f"the {FP4_UNPACK_DTYPE} map needs a {FP4_UNPACK_ADDRESS_ALIGN}-byte aligned base and an "
                         f"inner dimension that is a multiple of {FP4_UNPACK_INNER_MULTIPLE}, got {address:#x}, "
                         f"{map_spec.dims}")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B, len(map_spec.dims), int(address),
        [u64(d) for d in map_spec.dims], [u64(s) for s in map_spec.strides], [u32(b) for b in map_spec.box],
        [u32(1)] * len(map_spec.dims), driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled({FP4_UNPACK_DTYPE}, {map_spec}) failed: {err}")
    return np.array([int(w) for w in tensor_map.opaque], dtype=np.uint64).view(np.uint8).copy()


def _encode_tensor_maps(map_specs, addresses) -> np.ndarray:
    from gbs.ptx_inline import copy

    encoded = []
    for map_spec, address in zip(map_specs, addresses):
        if map_spec.dtype == FP4_UNPACK_DTYPE:
            encoded.append(_encode_fp4_unpack_map(address, map_spec))
        elif len(map_spec.dims) == 2:
            encoded.append(copy.encode_tensor_map_2d(address, map_spec.dtype, map_spec.dims, map_spec.strides[0],
                                                     map_spec.box, map_spec.swizzle))
        else:
            encoded.append(copy.encode_tensor_map_3d(address, map_spec.dtype, map_spec.dims, map_spec.strides,
                                                     map_spec.box, map_spec.swizzle))
    return np.concatenate(encoded)


@functools.lru_cache(maxsize=None)
def _compiled_kernel(spec: Sm100KernelSpec):
    """The launchable overload of ``spec``'s kernel (compiled on first use)."""
    from numba import cuda

    sig = kernel_signature()
    dispatcher = cuda.jit(make_kernel_function(spec), launch_bounds=(spec.threads, 1))
    dispatcher.compile(sig)
    return dispatcher.overloads[sig]


def _launch(spec: Sm100KernelSpec, plan: SmemPlan, num_ctas: int, args) -> None:
    """Cluster launch with > 48 KiB of dynamic shared memory (kernels.md recipe; not run here)."""
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch
    from numba import cuda
    from numba.cuda.cudadrv import driver

    kernel = _compiled_kernel(spec)
    cufunc = kernel._codelibrary.get_cufunc()
    smem_bytes = launch_smem_bytes(plan)
    driver.driver.cuKernelSetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       smem_bytes, cufunc.handle, 0)
    stream = driver._to_core_stream(cuda.default_stream())   # what numba's own launches pass to cuda.core
    kernel_args, writeback = [], []
    for ty, value in zip(kernel.argument_types, args):
        kernel._prepare_args(ty, value, stream, writeback, kernel_args)
    cluster = (spec.cta_group, 1, 1) if spec.cta_group > 1 else None
    # With a cluster, cuda.core's grid counts clusters.
    config = LaunchConfig(grid=num_ctas // spec.cta_group, cluster=cluster, block=spec.threads,
                          shmem_size=smem_bytes)
    launch(stream, config, cufunc.kernel, *kernel_args)
    cuda.synchronize()
    for write in writeback:
        write()


def default_num_ctas(num_tiles: int, cta_group: int, sm_count: int) -> int:
    """One CTA per SM (whole pairs), never more pairs than tiles."""
    return max(1, min(num_tiles, sm_count // cta_group)) * cta_group


def grouped_matmul_sm100(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
                         num_ctas: int | None = None) -> np.ndarray:
    """Run the SM100 kernel; returns ``C`` (bf16, (total_tokens, N)).

    ``config``: a ``gbs.dispatch.KernelConfig`` (its knobs and stages) or a ``TileConfig`` (auto
    stages). ``out``: written in place if given (rows of skipped slots keep their contents);
    default a fresh poisoned array. ``num_ctas``: persistent grid, a multiple of ``cta_group``.
    Needs a compute capability 10.0 GPU (B200 / GB200): anywhere else a RuntimeError says so and
    names the backends to use instead.
    """
    from numba import cuda

    from gbs.numba_kernels.simt import check_out

    spec, stages = check_can_implement(problem, config)
    out = check_out(problem, out)
    shape = spec.tile_shape
    if num_ctas is not None:
        num_ctas = schedule.check_num_ctas(num_ctas, shape.cta_group)
    require_sm100()
    num_tiles = schedule.total_tiles(problem.a_offsets, problem.expert_ids, problem.n, shape)
    if num_tiles == 0:   # every slot skipped or empty: nothing to launch
        return out
    if num_ctas is None:
        num_ctas = default_num_ctas(num_tiles, spec.cta_group, cuda.get_current_device().MULTIPROCESSOR_COUNT)
    plan, _ = check_launch_plan(spec, stages)

    operands = [np.ascontiguousarray(problem.a).view(np.uint8),
                np.ascontiguousarray(problem.b).view(np.uint8),
                np.ascontiguousarray(problem.a_scales),
                np.ascontiguousarray(problem.b_scales)]
    device_operands = [cuda.to_device(x) for x in operands]
    out_bits = out.view(np.uint16)
    device_out = cuda.to_device(out_bits)
    addresses = [d.device_ctypes_pointer.value for d in device_operands] + [device_out.device_ctypes_pointer.value]
    maps = _encode_tensor_maps(tensor_map_specs(spec, ProblemShape.of(problem)), addresses)
    args = (cuda.to_device(maps), cuda.to_device(problem.a_offsets.astype(np.int64)),
            cuda.to_device(problem.a_scale_offsets.astype(np.int64)), cuda.to_device(problem.expert_ids),
            cuda.to_device(problem.expert_scales), device_out, problem.n, problem.k, num_tiles, stages)
    _launch(spec, plan, num_ctas, args)
    device_out.copy_to_host(out_bits)
    return out
