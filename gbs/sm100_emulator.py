"""CPU emulator of the SM100 kernel's host-visible logic: replays a grouped problem tile by tile,
stage by stage, exactly as ``gbs.numba_kernels.sm100_kernel`` programs the hardware, and counts
each CTA's work for the performance model.

Two layers, kept apart on purpose:

* **What the kernel decides** comes from the kernel's own modules (``sm100_spec``,
  ``sm100_addressing``), never re-derived here: the tile walk (``schedule.locate_tile``,
  ``cta_output_rows``), the shared-memory carve-up (``smem_offsets``), the TMEM column plan,
  per-tile TMA coordinates and scale bands (``tile_load_coordinates``), the tensor maps
  (``tensor_map_specs``), descriptor construction (``operand_descriptor``,
  ``scale_atom_descriptor``, ``BlockScaledInstrDesc``), the per-MMA scale slot and SF ID, the
  scale-row words the store warps write, the epilogue's chunking, store choice, buffer offsets,
  output coordinates and bf16 rounding.
* **What the hardware does with it** is modelled here from the PTX ISA / CUDA documentation, so
  that a wrong decision shows up as a wrong result: the TMA tile copy (zero fill out of bounds,
  128B swizzle as "16-byte chunk c of row r lands at c ^ (r % 8)", the unpacking FP4 data type),
  ``tcgen05.cp .32x128b.warpx4`` (32 rows of 16 B to 4 columns of all four 32-lane partitions),
  ``tcgen05.st``, the block-scaled ``tcgen05.mma`` reading operands through decoded descriptors
  (SW128 K-major addressing) and scales from TMEM (row ``m`` at lane ``m``, column
  ``base + m // 32``, bytes from the SF ID on; the CTA pair splits M and N), ``tcgen05.ld``, and
  the TMA store (clipped at the tensor's edges). TMEM cells remember whether they hold scales or
  accumulators, so an overlapping column plan is an error, not a silent wrong answer.

Numerics: the MMA model accumulates exactly (float64: every product of two block-scaled values
and their sums are exact for realistic data); the epilogue then does what the kernel does:
fp32 accumulator x fp32 expert scale, round to nearest even bf16 (``bf16_bits_rne``). The
hardware accumulates in fp32 and may differ from this in the last fp32 bits.

The pipeline is replayed in order (no concurrency), which is enough for every host-visible
choice; what it cannot show (barrier protocol, timing, races) is the GPU's to prove.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from gbs import schedule
# The kernel's functions are called through their modules, so that a test can swap one for a wrong one.
from gbs.numba_kernels import sm100, sm100_spec
from gbs.numba_kernels import sm100_addressing as addr
from gbs.numba_kernels.simt import bf16_bits_rne
from gbs.numba_kernels.sm100_addressing import FP4_UNPACK_DTYPE, ProblemShape, TensorMapSpec
from gbs.numba_kernels.sm100_spec import (A_TILE_BYTES, B200_SM_COUNT, MAP_OUT, MAP_TOKEN_SCALES, MAP_TOKENS,
                                          MAP_WEIGHT_SCALES, MAP_WEIGHTS, MMA_A_ROWS, MMA_K_BYTES, MMAS_PER_K_SLICE,
                                          NUM_C_BUFFERS, NUM_EPILOGUE_WARPS, NUM_SFB_STORE_WARPS, OUTPUT_BYTES,
                                          SCALE_ROWS_PER_ATOM, SCALE_TMEM_COLUMNS, SMEM_REGIONS, TMEM_ALLOC_COLUMNS,
                                          Sm100KernelSpec, SmemPlan, TmemPlan)
from gbs.problem import GroupedProblem
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.formats import SF_ATOM_ROWS, SF_LANE_BYTES, decode_elements, decode_ue4m3, decode_ue8m0

# Shared-window address of the dynamic shared memory in the emulated CTA: 1024-byte aligned
# (the kernel declares that alignment), after the 1 KiB per-block reservation.
EMULATED_SMEM_BASE = 1024
EMULATED_TMEM_BASE = 0       # what tcgen05.alloc returns: lane 0, column 0
TMEM_LANES = 128
SWIZZLE_CHUNK = 16
# Hardware swizzle patterns as the TMA documentation states them for rows of the pattern's width:
# 16-byte chunk c of box row r goes to chunk c ^ f(r).
TMA_SWIZZLE_ROW_XOR = {
    "none": lambda r: 0,
    "32B": lambda r: (r // 4) % 2,
    "64B": lambda r: (r // 2) % 4,
    "128B": lambda r: r % 8,
}
TMA_SWIZZLE_ROW_BYTES = {"32B": 32, "64B": 64, "128B": 128}
_CELL_EMPTY, _CELL_SCALE, _CELL_ACCUM = 0, 1, 2


class EmulatorError(AssertionError):
    """The emulated kernel did something the hardware model forbids (a kernel bug)."""


def _expect(condition, message):
    if not condition:
        raise EmulatorError(message)


# ----------------------------------------------------------------------------------------------
# Work counts
# ----------------------------------------------------------------------------------------------
@dataclass
class CtaCounts:
    """What one CTA did: tiles, K slices (pipeline stages filled), TMA loads and the bytes each
    operand delivered to its shared memory, MMAs / scale copies issued (the even CTA issues for
    its pair), ``tcgen05.st`` warp instructions, TMA stores and element-wise stored outputs."""

    cta: int
    tiles: int = 0
    k_slices: int = 0
    tma_loads: int = 0
    token_bytes: int = 0
    weight_bytes: int = 0
    token_scale_bytes: int = 0
    weight_scale_bytes: int = 0
    mmas: int = 0
    scale_copies: int = 0
    scale_stores: int = 0
    tma_stores: int = 0
    tma_store_bytes: int = 0
    elements_stored: int = 0

    @property
    def bytes_loaded(self) -> int:
        return self.token_bytes + self.weight_bytes + self.token_scale_bytes + self.weight_scale_bytes


_MAP_COUNTER = {MAP_TOKENS: "token_bytes", MAP_WEIGHTS: "weight_bytes",
                MAP_TOKEN_SCALES: "token_scale_bytes", MAP_WEIGHT_SCALES: "weight_scale_bytes"}


@dataclass
class Emulation:
    """Result of one emulated launch."""

    out: np.ndarray                 # bf16 (total_tokens, N)
    counts: list                    # CtaCounts per CTA of the grid
    spec: Sm100KernelSpec
    stages: int
    num_ctas: int
    num_tiles: int
    smem: SmemPlan
    tmem: TmemPlan


# ----------------------------------------------------------------------------------------------
# Machine state of one CTA
# ----------------------------------------------------------------------------------------------
@dataclass
class CtaState:
    smem: np.ndarray                                  # dynamic shared memory bytes
    words: np.ndarray = field(default=None)           # TMEM 32-bit cells [lane, column] (scales)
    accum: np.ndarray = field(default=None)           # TMEM accumulators, exact shadow [lane, column]
    cells: np.ndarray = field(default=None)           # what each TMEM cell holds
    c_uses: int = 0

    def __post_init__(self):
        self.words = np.zeros((TMEM_LANES, TMEM_ALLOC_COLUMNS), np.uint32)
        self.accum = np.zeros((TMEM_LANES, TMEM_ALLOC_COLUMNS), np.float64)
        self.cells = np.zeros((TMEM_LANES, TMEM_ALLOC_COLUMNS), np.int8)


def _smem_index(address):
    return address - EMULATED_SMEM_BASE


def _smem_read(smem: np.ndarray, index, what: str) -> np.ndarray:
    """Bytes of shared memory at ``index`` (any shape); an access outside the dynamic shared
    memory is a kernel bug, not a numpy error."""
    index = np.asarray(index)
    _expect(index.size == 0 or (index.min() >= 0 and index.max() < smem.size),
            f"{what} reads shared memory outside [0, {smem.size})")
    return smem[index]


def _tmem_column(address: int) -> int:
    return desc.tmem_column(address) - EMULATED_TMEM_BASE


# ----------------------------------------------------------------------------------------------
# Hardware models
# ----------------------------------------------------------------------------------------------
def _gather_box(global_bytes: np.ndarray, coords, box) -> np.ndarray:
    """The box (outermost axis first) of a byte tensor, zero where it leaves the tensor."""
    shape = global_bytes.shape[::-1]                      # innermost first, like coords
    index, valid = [], []
    for c, b, d in zip(coords, box, shape):
        i = c + np.arange(b)
        index.append(np.clip(i, 0, d - 1))
        valid.append((i >= 0) & (i < d))
    grid = np.ix_(*index[::-1])
    inside = functools.reduce(np.logical_and, np.ix_(*[v.astype(np.int64) for v in valid[::-1]])).astype(bool)
    return np.where(inside, global_bytes[grid], 0).astype(np.uint8)


def tma_load_box(map_spec: TensorMapSpec, global_bytes: np.ndarray, coords) -> np.ndarray:
    """Shared-memory image (bytes) of one TMA tile-mode box: rows of the box innermost extent,
    outer dimensions flattened in order, 128B swizzle applied per row."""
    if map_spec.dtype == FP4_UNPACK_DTYPE:
        # 16 packed 4-bit values (8 B) -> the first 8 B of a 16-byte chunk; dims count elements.
        _expect(coords[0] % 2 == 0 and map_spec.box[0] % 16 == 0, "FP4 unpack box must cover whole 16-value groups")
        packed = _gather_box(global_bytes, (coords[0] // 2,) + tuple(coords[1:]),
                             (map_spec.box[0] // 2,) + tuple(map_spec.box[1:]))
        groups = packed.reshape(-1, map_spec.box[0] // 16, 8)
        rows = np.concatenate([groups, np.zeros_like(groups)], axis=2).reshape(groups.shape[0], -1)
    else:
        _expect(map_spec.dtype == "uint8", f"no load model for {map_spec.dtype}")
        rows = _gather_box(global_bytes, coords, map_spec.box).reshape(-1, map_spec.box[0])
    if map_spec.swizzle != "none":
        _expect(rows.shape[1] == TMA_SWIZZLE_ROW_BYTES[map_spec.swizzle],
                f"{map_spec.name}: swizzled box rows must be {map_spec.swizzle} wide, got {rows.shape[1]} B")
        chunks = rows.reshape(rows.shape[0], -1, SWIZZLE_CHUNK)
        out = np.empty_like(chunks)
        r = np.arange(rows.shape[0])[:, None]
        out[r, np.arange(chunks.shape[1])[None, :] ^ TMA_SWIZZLE_ROW_XOR[map_spec.swizzle](r)] = chunks
        rows = out.reshape(rows.shape)
    image = rows.reshape(-1)
    _expect(image.size == map_spec.smem_box_bytes, f"{map_spec.name}: box image {image.size} B != "
                                                   f"expected {map_spec.smem_box_bytes} B")
    return image


def tma_store_box(map_spec: TensorMapSpec, image: np.ndarray, coords, out_bits: np.ndarray) -> int:
    """Write a bf16 box image to the output, un-swizzling and clipping at the tensor's edges
    (not at group boundaries); returns the bytes written."""
    inner, outer = map_spec.box
    row_bytes = inner * OUTPUT_BYTES
    xor = TMA_SWIZZLE_ROW_XOR[map_spec.swizzle]
    if map_spec.swizzle != "none":
        _expect(row_bytes == TMA_SWIZZLE_ROW_BYTES[map_spec.swizzle], "store box rows must match the swizzle")
    x = np.arange(inner)
    byte = x * OUTPUT_BYTES
    written = 0
    for r in range(outer):
        offsets = r * row_bytes + ((byte // SWIZZLE_CHUNK) ^ xor(r)) * SWIZZLE_CHUNK + byte % SWIZZLE_CHUNK
        values = image[offsets] | (image[offsets + 1].astype(np.uint16) << 8)
        token, cols = coords[1] + r, coords[0] + x
        keep = (cols < out_bits.shape[1]) & (token < out_bits.shape[0])
        if token < out_bits.shape[0]:
            out_bits[token, cols[keep]] = values[keep]
            written += int(keep.sum()) * OUTPUT_BYTES
    return written


def scale_copy(ctas, issuer: int, cta_group: int, taddr: int, sdesc: int) -> None:
    """``tcgen05.cp.cta_group::<g>.32x128b.warpx4``: 32 rows of 16 B (8-row core matrices SBO
    apart, no swizzle) -> lanes ``j + 32 p`` (every partition p), columns ``col .. col + 3``;
    with a pair, each CTA copies its own shared memory into its own TMEM."""
    d = desc.SmemDescriptor.decode(int(sdesc))
    _expect(d.swizzle == desc.SWIZZLE_NONE, "scale atoms are copied without swizzle")
    _expect(desc.tmem_lane(taddr) == 0, "tcgen05.cp 32x128b.warpx4 targets lane 0")
    rows = np.arange(SCALE_ROWS_PER_ATOM)
    start = _smem_index(d.start_address)
    column = _tmem_column(taddr)
    for rank in range(issuer, issuer + cta_group):
        cta = ctas[rank]
        addresses = start + (rows // 8)[:, None] * d.stride_byte_offset + (rows % 8)[:, None] * 16 + np.arange(16)
        words = _smem_read(cta.smem, addresses, "tcgen05.cp").view(np.uint32).reshape(SCALE_ROWS_PER_ATOM, 4)
        for partition in range(4):
            lanes = slice(32 * partition, 32 * partition + 32)
            cta.words[lanes, column:column + 4] = words
            cta.cells[lanes, column:column + 4] = _CELL_SCALE


def _read_operand(smem: np.ndarray, sdesc: int, rows: int) -> np.ndarray:
    """Bytes (rows, 32) one MMA reads through a K-major SW128 descriptor: row r, byte b at
    start + (r // 8) * SBO + (r % 8) * 128 + b, then the swizzle XOR of address bits [4, 7)
    with bits [7, 10) (the pattern repeats every 1024 bytes of the shared window)."""
    d = desc.SmemDescriptor.decode(int(sdesc))
    _expect(d.swizzle == desc.SWIZZLE_128B and d.base_offset == 0, "operands are 128B-swizzled, base offset 0")
    r = np.arange(rows)[:, None]
    address = d.start_address + (r // 8) * d.stride_byte_offset + (r % 8) * 128 + np.arange(MMA_K_BYTES)
    address = address ^ (((address >> 7) & 7) << 4)
    return _smem_read(smem, _smem_index(address), "tcgen05.mma operand")


_FP4_VALUES = decode_elements(np.arange(16, dtype=np.uint8), "e2m1").astype(np.float64)
_FP8_VALUES = {e: decode_elements(np.arange(256, dtype=np.uint8), e).astype(np.float64) for e in ("e4m3", "e5m2")}


def _decode_operand(raw: np.ndarray, element: str, kind: str) -> np.ndarray:
    """Element values of the bytes one MMA reads: packed FP4 for mxf4/mxf4nvf4; for mxf8f6f4 one
    byte per FP8 element, or 16 FP4 values in the first 8 bytes of each 16-byte chunk."""
    if element == "e2m1":
        if kind == "mxf8f6f4":
            raw = raw.reshape(raw.shape[0], -1, 16)[:, :, :8].reshape(raw.shape[0], -1)
        nibbles = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
        return _FP4_VALUES[nibbles]
    return _FP8_VALUES[element][raw]


def _read_scales(cta: CtaState, base_column: int, count: int, sf_id: int, scale_vec: int, scale_type: str):
    """Scales of rows 0..count-1 read from TMEM: row x at lane x % 128, column base + x // 32,
    bytes ``sf_id .. sf_id + scale_vec - 1``."""
    x = np.arange(count)
    lanes, columns = x % TMEM_LANES, base_column + x // 32
    _expect(np.all(cta.cells[lanes, columns] == _CELL_SCALE),
            f"MMA reads scales from TMEM columns {sorted(set(columns.tolist()))} that hold no scales")
    words = cta.words[lanes, columns]
    raw = np.stack([(words >> (8 * (sf_id + q))) & 0xFF for q in range(scale_vec)], axis=1).astype(np.uint8)
    decode = decode_ue4m3 if scale_type == "ue4m3" else decode_ue8m0
    return decode(raw).astype(np.float64)


def block_scaled_mma(ctas, issuer: int, cta_group: int, kind: str, d_tmem: int, a_desc: int, b_desc: int,
                     idesc: int, sfa_tmem: int, sfb_tmem: int, accumulate: int) -> None:
    """``tcgen05.mma.cta_group::<g>.kind::<kind>.block_scale``: D[m, n] (+)= sum over the MMA's K
    of A[m] B[n] with each ``block`` of K scaled by its A-row and B-row scale. A's M = 128 * g rows
    come 128 from each CTA, B's N columns N / g from each CTA; each CTA's TMEM holds its 128 rows
    of D (all N columns) and the scales for them."""
    fields = desc.BlockScaledInstrDesc.decode(int(idesc), kind)
    spec_kind = desc.get_kind(kind)
    _expect(fields.m == MMA_A_ROWS * cta_group, f"descriptor M={fields.m} with cta_group {cta_group}")
    desc.check_mma_shape(kind, cta_group, fields.m, fields.n)
    n, b_rows = fields.n, fields.n // cta_group
    b = np.concatenate([_decode_operand(_read_operand(ctas[issuer + r].smem, b_desc, b_rows), fields.b_format, kind)
                        for r in range(cta_group)])
    vec, k_elems = spec_kind.scale_vec, spec_kind.k_per_mma
    block = k_elems // vec
    _expect(b.shape[1] == k_elems, f"B operand decodes to {b.shape[1]} elements, the MMA's K is {k_elems}")
    d_column = _tmem_column(d_tmem)
    _expect(desc.tmem_lane(d_tmem) == 0, "D starts at lane 0")
    for r in range(cta_group):
        cta = ctas[issuer + r]
        a = _decode_operand(_read_operand(cta.smem, a_desc, MMA_A_ROWS), fields.a_format, kind)
        sa = _read_scales(cta, _tmem_column(sfa_tmem), MMA_A_ROWS, fields.a_sf_id, vec, fields.scale_type)
        sb = _read_scales(cta, _tmem_column(sfb_tmem), n, fields.b_sf_id, vec, fields.scale_type)
        products = np.einsum("mqb,nqb->mnq", a.reshape(len(a), vec, block), b.reshape(n, vec, block))
        with np.errstate(invalid="ignore", over="ignore"):
            partial = np.einsum("mnq,mq,nq->mn", products, sa, sb)
        columns = slice(d_column, d_column + n)
        _expect(np.all(cta.cells[:, columns] != _CELL_SCALE), f"accumulator columns {d_column}..{d_column + n - 1} "
                                                              "overlap scale columns")
        previous = cta.accum[:, columns] if accumulate else 0.0
        cta.accum[:, columns] = previous + partial
        cta.cells[:, columns] = _CELL_ACCUM


def tmem_load(cta: CtaState, warp: int, taddr: int, count: int) -> np.ndarray:
    """``tcgen05.ld.32x32b.x<count>`` by warp ``warp``: its 32-lane partition, ``count`` columns."""
    _expect(desc.tmem_lane(taddr) == 32 * (warp % 4), f"warp {warp} may only read lanes {32 * (warp % 4)}..+31")
    lanes = slice(32 * (warp % 4), 32 * (warp % 4) + 32)
    column = _tmem_column(taddr)
    _expect(np.all(cta.cells[lanes, column:column + count] == _CELL_ACCUM), "epilogue reads a non-accumulator column")
    return cta.accum[lanes, column:column + count]


@functools.cache
def _bf16_bits():
    """``bf16_bits_rne`` as a compiled ufunc (the same function the kernel compiles)."""
    import numba

    return numba.vectorize(["int64(int64)"])(bf16_bits_rne)


def _to_bf16_bits(accumulators: np.ndarray, expert_scale: np.float32) -> np.ndarray:
    """fp32 accumulator x fp32 expert scale, rounded to bf16 bits, as the epilogue does."""
    with np.errstate(invalid="ignore", over="ignore"):
        values = accumulators.astype(np.float32) * np.float32(expert_scale)
    return _bf16_bits()(values.view(np.uint32).astype(np.int64)).astype(np.uint16)


# ----------------------------------------------------------------------------------------------
# The emulated kernel
# ----------------------------------------------------------------------------------------------
def _global_operands(problem: GroupedProblem, spec: Sm100KernelSpec) -> list:
    """The byte tensors behind the tensor maps, outermost axis first (as the maps describe them)."""
    tokens = np.ascontiguousarray(problem.a).view(np.uint8)
    weights = np.ascontiguousarray(problem.b).view(np.uint8)
    rows = SCALE_ROWS_PER_ATOM * problem.a_scales.shape[1]
    token_scales = np.ascontiguousarray(problem.a_scales).reshape(problem.a_scales.shape[0], rows, SF_LANE_BYTES)
    weight_scales = np.ascontiguousarray(problem.b_scales).reshape(-1, rows, SF_LANE_BYTES)
    return [tokens, weights, token_scales, weight_scales]


class _Launch:
    """One emulated launch: the grid's CTA pairs run one after the other."""

    def __init__(self, problem: GroupedProblem, spec: Sm100KernelSpec, stages: int, num_ctas: int, out):
        self.p, self.spec, self.stages, self.num_ctas = problem, spec, stages, num_ctas
        self.smem_plan, self.tmem_plan = sm100_spec.check_launch_plan(spec, stages)
        self.maps = addr.tensor_map_specs(spec, ProblemShape.of(problem))
        self.globals = _global_operands(problem, spec)
        self.out_bits = out.view(np.uint16)
        self.counts = [CtaCounts(cta) for cta in range(num_ctas)]
        self.shape = spec.tile_shape
        self.a_offsets = problem.a_offsets.astype(np.int64)
        self.a_scale_offsets = problem.a_scale_offsets.astype(np.int64)
        self.num_tiles = schedule.total_tiles(problem.a_offsets, problem.expert_ids, problem.n, self.shape)
        self.offsets = dict(zip(SMEM_REGIONS, self.smem_plan.offsets))
        self.num_k_slices = -(-problem.k // spec.k_slice_elements)
        self.row_bands = -(-problem.n // SF_ATOM_ROWS)

    def run(self) -> None:
        g = self.spec.cta_group
        for pair in range(self.num_ctas // g):
            ctas = [CtaState(np.zeros(self.smem_plan.dynamic_bytes, np.uint8)) for _ in range(g)]
            k_iter, acc_iter = 0, 0
            # What the scheduler warp hands out: the pair's walk indices, located one by one.
            for tile_index in schedule.pair_tile_indices(pair * g, self.num_ctas, self.num_tiles, g):
                fields = [int(v) for v in schedule.locate_tile(tile_index, self.a_offsets, self.p.expert_ids,
                                                               self.p.n, self.shape.tokens, self.shape.weight_rows)]
                _expect(fields[0] >= 0, f"tile {tile_index} of {self.num_tiles} not found")
                k_iter = self._tile(pair, ctas, fields, k_iter, acc_iter)
                acc_iter += 1

    def _check_against_schedule(self, pair, fields, coordinates):
        """Each CTA loads the token rows and weight rows ``schedule.cta_work`` assigns it."""
        spec, g = self.spec, self.spec.cta_group
        tile = schedule.Tile(-1, *fields)
        for rank in range(g):
            work = schedule.cta_work(tile, pair * g + rank, self.shape)
            token_row, weight_row = coordinates[rank][:2]
            if work.staged_token_start < work.staged_token_end:
                _expect(token_row == work.staged_token_start, f"CTA rank {rank} loads tokens from {token_row}, "
                                                              f"the schedule stages {work.staged_token_start}")
            if spec.ab_swapped and work.row_start < work.row_end:
                _expect(weight_row == work.row_start, f"CTA rank {rank} loads weight rows from {weight_row}, "
                                                      f"the schedule gives it {work.row_start}")

    # -- one tile ------------------------------------------------------------------------------
    def _tile(self, pair, ctas, fields, k_iter, acc_iter):
        spec, g = self.spec, self.spec.cta_group
        slot, expert, _, _, token_start, token_end, row_start, row_end = fields
        coordinates = [addr.tile_load_coordinates(spec.ab_swapped, spec.b_rows_per_cta, rank, expert, token_start,
                                               row_start, int(self.a_offsets[slot]), int(self.a_scale_offsets[slot]),
                                               self.row_bands) for rank in range(g)]
        self._check_against_schedule(pair, fields, coordinates)
        acc, _ = sm100_spec.pipeline_position(acc_iter, spec.accum_stages)
        d_tmem = EMULATED_TMEM_BASE + acc * spec.mma_bn
        sfb_row = coordinates[0][4]
        sfb_adjust = addr.sfb_column_adjust(sfb_row, spec.sfb_by_store_warps)
        for rank in range(g):
            self.counts[pair * g + rank].tiles += 1
        for kk in range(self.num_k_slices):
            stage, _ = sm100_spec.pipeline_position(k_iter, self.stages)
            for rank in range(g):
                self._load_stage(ctas[rank], self.counts[pair * g + rank], coordinates[rank], expert, stage, kk)
            if spec.sfb_by_store_warps:
                self._store_sfb(ctas[0], self.counts[pair * g], sfb_row, stage)
            self._mma_stage(ctas, self.counts[pair * g], stage, d_tmem, sfb_adjust, kk)
            k_iter += 1
        for rank in range(g):
            self._epilogue(ctas[rank], self.counts[pair * g + rank], rank, fields, acc)
        return k_iter

    def _load_stage(self, cta, counts, coordinates, expert, stage, kk):
        """The TMA warp's loads of one stage (and the scale warp's, when there is one)."""
        spec = self.spec
        token_row, weight_row, token_band, weight_band, _ = coordinates
        tokens_k, weights_k, scales_k = addr.stage_k_coordinates(kk, spec.tokens_k_step, spec.weights_k_step,
                                                              spec.scale_rows_per_stage)
        boxes = {MAP_TOKENS: (tokens_k, token_row), MAP_WEIGHTS: (weights_k, weight_row, expert),
                 MAP_TOKEN_SCALES: (0, scales_k, token_band), MAP_WEIGHT_SCALES: (0, scales_k, weight_band)}
        delivered = 0
        for map_index, coords in boxes.items():
            map_spec = self.maps[map_index]
            image = tma_load_box(map_spec, self.globals[map_index], coords)
            region, stride = spec.load_regions[map_index]
            start = self.smem_plan.offsets[region] + stage * stride
            _expect(image.size == stride, f"{map_spec.name} box of {image.size} B into a {stride}-byte stage slot")
            cta.smem[start:start + image.size] = image
            counts.tma_loads += 1
            setattr(counts, _MAP_COUNTER[map_index], getattr(counts, _MAP_COUNTER[map_index]) + image.size)
            if not (spec.sfb_by_store_warps and map_index == spec.sfb_map):
                delivered += image.size
        _expect(delivered == spec.expect_tx_bytes, f"stage loads deliver {delivered} B, expect_tx announces "
                                                   f"{spec.expect_tx_bytes} B")
        counts.k_slices += 1

    def _store_sfb(self, cta, counts, sfb_row, stage):
        """Warps 8-11: the tile's MMA-B scale rows -> lanes 0..31 of each partition, ``tcgen05.st``."""
        spec = self.spec
        atoms = self.offsets["sfb"] + stage * spec.sfb_stage_bytes
        _, sfb_base, _ = sm100_spec.tmem_columns(self.stages, spec.accum_stages, spec.mma_bn, spec.sfa_stage_columns,
                                        spec.sfb_stage_columns)
        lanes = np.arange(32)
        for j in range(spec.num_sf_k_tiles):
            offsets = atoms + addr.sfb_store_word_offset(sfb_row, lanes, j, spec.num_sf_k_tiles)
            valid = lanes < spec.mma_bn
            words = np.zeros(32, np.uint32)
            byte_index = offsets[valid][:, None] + np.arange(4)
            _expect(np.all((byte_index >= atoms) & (byte_index < atoms + spec.sfb_stage_bytes)),
                    "store warps read outside the stage's MMA-B scale atoms")
            words[valid] = _smem_read(cta.smem, byte_index, "store warps").view(np.uint32).reshape(-1)
            column = sfb_base + stage * spec.sfb_stage_columns + j * SCALE_TMEM_COLUMNS
            for partition in range(NUM_SFB_STORE_WARPS):
                cta.words[32 * partition:32 * partition + 32, column] = words
                cta.cells[32 * partition:32 * partition + 32, column] = _CELL_SCALE
                counts.scale_stores += 1

    def _mma_stage(self, ctas, counts, stage, d_tmem, sfb_adjust, kk):
        """The MMA warp's work on one stage: scale copies, then four MMAs (even CTA only)."""
        spec, g = self.spec, self.spec.cta_group
        nsf, bands = spec.num_sf_k_tiles, spec.sfb_atoms
        sfa_base, sfb_base, _ = sm100_spec.tmem_columns(self.stages, spec.accum_stages, spec.mma_bn,
                                                        spec.sfa_stage_columns, spec.sfb_stage_columns)
        sfa_tmem = EMULATED_TMEM_BASE + sfa_base + stage * spec.sfa_stage_columns
        sfb_tmem = EMULATED_TMEM_BASE + sfb_base + stage * spec.sfb_stage_columns
        smem = EMULATED_SMEM_BASE
        sfa_smem = smem + self.offsets["sfa"] + stage * spec.sfa_stage_bytes
        sfb_smem = smem + self.offsets["sfb"] + stage * spec.sfb_stage_bytes
        for j in range(nsf):
            column, offset = addr.scale_copy_offsets(j, 0, nsf, 1)
            scale_copy(ctas, 0, g, sfa_tmem + column, addr.scale_atom_descriptor(sfa_smem + offset))
            counts.scale_copies += 1
            if not spec.sfb_by_store_warps:
                for band in range(bands):
                    column, offset = addr.scale_copy_offsets(j, band, nsf, bands)
                    scale_copy(ctas, 0, g, sfb_tmem + column, addr.scale_atom_descriptor(sfb_smem + offset))
                    counts.scale_copies += 1
        a_tile = smem + self.offsets["a_tiles"] + stage * A_TILE_BYTES
        b_tile = smem + self.offsets["b_tiles"] + stage * spec.b_tile_bytes
        for i in range(MMAS_PER_K_SLICE):
            sfa_column, sfb_column, sf_id = addr.mma_scale_columns(i, spec.kind.scale_vec, bands, sfb_adjust)
            block_scaled_mma(ctas, 0, g, spec.kind.name, d_tmem, addr.operand_descriptor(a_tile, i),
                             addr.operand_descriptor(b_tile, i),
                             desc.with_scale_factor_ids(spec.instr_desc, sf_id, sf_id), sfa_tmem + sfa_column,
                             sfb_tmem + sfb_column, 1 if (kk > 0 or i > 0) else 0)
            counts.mmas += 1

    def _epilogue(self, cta, counts, rank, fields, acc):
        spec, p = self.spec, self.p
        slot, expert, _, _, token_start, token_end, row_start, row_end = fields
        row_lo, row_hi = schedule.cta_output_rows(row_start, row_end, rank, spec.cta_group, self.shape.weight_rows)
        chunk = spec.chunk_columns
        lanes = np.arange(MMA_A_ROWS)
        out_map = self.maps[MAP_OUT]
        for c in range(spec.num_chunks):
            if not addr.chunk_is_live(spec.ab_swapped, c, chunk, token_start, token_end, row_lo, row_hi):
                continue
            address = EMULATED_TMEM_BASE + acc * spec.mma_bn + c * chunk
            values = np.concatenate([tmem_load(cta, w, (w * 32 << desc.TMEM_LANE_SHIFT) + address, chunk)
                                     for w in range(NUM_EPILOGUE_WARPS)])
            bits = _to_bf16_bits(values, p.expert_scales[expert])            # [lane, column in chunk]
            columns = np.arange(chunk)
            if addr.chunk_uses_tma_store(spec.ab_swapped, c, chunk, token_start, token_end):
                image = np.zeros(spec.c_buffer_bytes, np.uint8)
                offsets = addr.c_buffer_offset(spec.ab_swapped, lanes[:, None], columns[None, :], chunk,
                                            spec.c_swizzle_bytes)
                image[offsets] = (bits & 0xFF).astype(np.uint8)
                image[offsets + 1] = (bits >> 8).astype(np.uint8)
                start = self.offsets["c_buffers"] + (cta.c_uses % NUM_C_BUFFERS) * spec.c_buffer_bytes
                cta.smem[start:start + image.size] = image
                coords = addr.tma_store_coordinates(spec.ab_swapped, c, chunk, token_start, row_lo)
                counts.tma_store_bytes += tma_store_box(out_map, cta.smem[start:start + image.size], coords,
                                                        self.out_bits)
                counts.tma_stores += 1
                cta.c_uses += 1
            else:
                tokens, cols = np.broadcast_arrays(*addr.accumulator_output(
                    spec.ab_swapped, lanes[:, None], c * chunk + columns[None, :], token_start, row_lo))
                keep = (tokens < token_end) & (cols < row_hi)
                self.out_bits[tokens[keep], cols[keep]] = bits[keep]
                counts.elements_stored += int(keep.sum())


def emulate(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
            num_ctas: int | None = None) -> Emulation:
    """Replay the SM100 kernel on ``problem`` with ``config`` (``KernelConfig`` or ``TileConfig``)
    on the CPU. ``num_ctas``: persistent grid (default: one CTA per B200 SM, whole pairs, no more
    pairs than tiles). ``out``: written in place (default: poisoned)."""
    from gbs.numba_kernels.simt import check_out

    spec, stages = sm100.check_can_implement(problem, config)
    out = check_out(problem, out)
    num_tiles = schedule.total_tiles(problem.a_offsets, problem.expert_ids, problem.n, spec.tile_shape)
    if num_ctas is None:
        num_ctas = sm100.default_num_ctas(num_tiles, spec.cta_group, B200_SM_COUNT)
    num_ctas = schedule.check_num_ctas(num_ctas, spec.cta_group)
    launch = _Launch(problem, spec, stages, num_ctas, out)
    launch.run()
    return Emulation(out, launch.counts, spec, stages, num_ctas, launch.num_tiles, launch.smem_plan, launch.tmem_plan)
