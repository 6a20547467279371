"""What one SM100 (B200) kernel build is: its constants, warp roles and barrier kinds, the build
spec ``Sm100KernelSpec`` with every field derived from it, and the kernel's shared-memory and
tensor-memory plans.

Design (``docs/design/sm100_kernel.md``, "Specialisation", "Grid and warp roles", "The pipeline",
"Tensor memory and the scale copies"):

* A build is specialised on the token and weight formats (which fix the ``tcgen05.mma`` kind) and
  the tile knobs ``(ab_swapped, mma_bn, cta_group)``; the pipeline depth is a launch argument, so
  the plans here take ``stages`` beside the spec.
* Warps: 0-3 epilogue, 4 TMA loads, 5 MMA (one lane issues), 6 tile scheduler (224 threads); with
  ``mma_bn < 64`` warp 7 loads the MMA-B scale atoms and warps 8-11 write the tile's scale rows
  into tensor memory with ``tcgen05.st`` (384 threads): the MMA reads row ``n`` of the MMA-B
  scales from lane ``n``, and ``tcgen05.cp`` only places whole 32-row slices of an atom, so a tile
  of 8 or 16 rows that starts inside a slice cannot be copied there (upstream takes this path for
  every ``mma_bn < 64`` too).
* "MMA A" is the 128-row side (weights when ``ab_swapped``, else tokens), "MMA B" the ``mma_bn``
  side. One pipeline stage holds a 128-byte K slice of both tiles and their 128x4 scale atoms.
* Shared memory, in address order: A tiles, B tiles, the two bf16 output buffers (all multiples
  of 1024 bytes, so each stays 1024-byte aligned for the 128B swizzle), scale atoms, mbarriers
  (per stage, per accumulator stage, per scheduler slot), the scheduler ring, the TMEM address.
* Tensor memory: the kernel allocates all 512 columns (one CTA per SM); accumulator stages come
  first (double-buffered when ``mma_bn <= 128``), then each stage's MMA-A and MMA-B scale columns.

The layout functions (``smem_offsets``, ``stage_barrier``, ``fixed_barrier``, ``tmem_columns``,
``pipeline_position``) are *device-capable*: plain integer Python that the kernel compiles with
``cuda.jit(device=True)`` and the CPU emulator (``gbs.sm100_emulator``) calls, so both use one
layout. Constraint: they must stay integer-only and free of Python objects the device cannot take.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gbs import dispatch, schedule
from gbs.problem import GroupedProblem
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, SF_LANE_BYTES, SF_LANES, get_format

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
B200_SM_COUNT = 148                       # SMs of a B200: the emulator's default persistent grid

MMA_A_ROWS = schedule.MMA_M_ROWS          # rows of one CTA's side of the MMA M dimension
K_SLICE_BYTES = dispatch.K_TILE_BYTES     # bytes of every operand row per pipeline stage
MMAS_PER_K_SLICE = 4                      # 4 MMAs of K = 64 (FP4) or 32 (FP8) per 128-byte slice
MMA_K_BYTES = K_SLICE_BYTES // MMAS_PER_K_SLICE   # shared-memory bytes of one MMA's K step
A_TILE_BYTES = MMA_A_ROWS * K_SLICE_BYTES
SWIZZLE_128B_BYTES = 128                  # operand tiles: 128-byte rows, 128B swizzle
SWIZZLE_ATOM_BYTES = 1024                 # 8 rows x 128 B: the 128B swizzle pattern; tile alignment
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


# ----------------------------------------------------------------------------------------------
# What a kernel is specialised on
# ----------------------------------------------------------------------------------------------
def mma_kind_for(a_format: str, b_format: str) -> str:
    """The ``tcgen05.mma`` kind of a token format x weight format pair (ValueError otherwise)."""
    a, b = get_format(a_format), get_format(b_format)
    if not (a.scaled and b.scaled):
        raise ValueError(f"no tcgen05 kind for {a.name} x {b.name}: the block-scaled kinds take FP4 / FP8 operands "
                         "with block scales, and there is no bf16 x FP4 kind; W4A16 runs on the H200, SIMT and "
                         "reference backends")
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
# The memory layout (device-capable: compiled into the kernel, called by the emulator)
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


def own_max_stages(spec: Sm100KernelSpec, smem_per_sm: int = dispatch.B200_SMEM_PER_SM) -> int:
    """The deepest pipeline this kernel's real shared memory and TMEM plans allow (>= the formula's)."""
    stages = 0
    while True:
        try:
            check_launch_plan(spec, stages + 1, smem_per_sm)
        except ValueError:
            return stages
        stages += 1

