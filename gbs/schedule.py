"""The tile walk of the grouped SM100 kernel: which output tile comes n-th and which CTA takes it.

Shared by every kernel of the project (the SIMT kernel, the H200 kernels, the SM100 CPU emulator)
so that they all visit the same tiles in the same order (``../shared/spec/kernels.md``):

* Group slots are walked in slot order; a slot with ``expert_ids[g] < 0`` or no tokens has no
  tiles (no work is ever scheduled for it).
* Tile extent (``TileShape``): ``ab_swapped`` -> ``mma_bn`` tokens x ``128 * cta_group`` weight
  rows (weights in the MMA "A" slot); not swapped -> ``128 * cta_group`` tokens x ``mma_bn``
  weight rows.
* Inside a group the tiles are M-major: local tile ``j`` of slot ``g`` is token block
  ``m_blk = j % mb_g`` and weight-row block ``n_blk = j // mb_g``, ``mb_g = ceil(n_g / tokens)``.
  Tiles that cross the group's end (or N) are clipped here and masked at the store.
* Persistent grid of ``num_ctas`` CTAs, ``cta_group`` CTAs per pair: CTA ``c`` is rank
  ``c % cta_group`` of pair ``p = c // cta_group``; pair ``p`` takes tiles ``p, p + num_pairs, ...``.
  With ``cta_group = 2`` CTA ``r`` writes the weight rows ``[row_start + 128 r, + 128)`` of the
  tile (its half of the M = 256 MMA) and stages half of the token tile in shared memory.

Functions marked *device-capable* are plain integer Python on arrays: they run on the host with
numpy arrays and compile for the GPU through ``device_functions()``. They call no other module
function except through ``rebind`` (numba resolves a device function's callees by name), and
take no dataclasses. The walk itself is linear in the number of slots (G <= 256).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from gbs.dispatch import check_mma_tile

MMA_M_ROWS = 128   # rows of one CTA's side of the MMA M dimension (weight rows when swapped)


# ----------------------------------------------------------------------------------------------
# Tile shape from the config knobs
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """The three knobs that shape the tile walk, validated like the dispatch's configs.

    ``TileConfig.of(config)`` takes a ``gbs.dispatch.KernelConfig`` (or anything with the three
    attributes); constructing one directly serves formats the SM100 dispatch has no route for.
    """

    ab_swapped: bool
    mma_bn: int
    cta_group: int

    def __post_init__(self):
        ab_swapped, mma_bn, cta_group = check_mma_tile(self.ab_swapped, self.mma_bn, self.cta_group)
        object.__setattr__(self, "ab_swapped", ab_swapped)
        object.__setattr__(self, "mma_bn", mma_bn)
        object.__setattr__(self, "cta_group", cta_group)

    @classmethod
    def of(cls, config) -> "TileConfig":
        if isinstance(config, cls):
            return config
        missing = [name for name in ("ab_swapped", "mma_bn", "cta_group") if not hasattr(config, name)]
        if missing:
            raise TypeError(f"config must be a KernelConfig or TileConfig (it lacks {missing}), "
                            f"got {type(config).__name__}")
        return cls(config.ab_swapped, config.mma_bn, config.cta_group)

    @property
    def tile_shape(self) -> "TileShape":
        m_side = MMA_M_ROWS * self.cta_group
        if self.ab_swapped:
            return TileShape(tokens=self.mma_bn, weight_rows=m_side, cta_group=self.cta_group)
        return TileShape(tokens=m_side, weight_rows=self.mma_bn, cta_group=self.cta_group)


@dataclass(frozen=True)
class TileShape:
    """Extent of one output tile (tokens x weight rows) and the CTAs that share it."""

    tokens: int
    weight_rows: int
    cta_group: int = 1

    def __post_init__(self):
        for name in ("tokens", "weight_rows", "cta_group"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TileShape.{name} must be a positive int, got {value!r}")
        if self.weight_rows % self.cta_group or self.tokens % self.cta_group:
            raise ValueError(f"a {self.tokens} x {self.weight_rows} tile cannot be split over "
                             f"cta_group={self.cta_group} CTAs")

    @classmethod
    def from_config(cls, config) -> "TileShape":
        """The tile of a ``KernelConfig`` / ``TileConfig``."""
        return TileConfig.of(config).tile_shape

    @property
    def cta_weight_rows(self) -> int:
        """Weight rows each CTA of the pair writes (128 when ``cta_group = 2``)."""
        return self.weight_rows // self.cta_group

    @property
    def cta_tokens(self) -> int:
        """Tokens each CTA of the pair stages in shared memory (half the token tile for a pair)."""
        return self.tokens // self.cta_group


# ----------------------------------------------------------------------------------------------
# Device-capable walk functions
# ----------------------------------------------------------------------------------------------
def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative ints (device-capable)."""
    return (a + b - 1) // b


def slot_token_blocks(slot, a_offsets, expert_ids, tile_tokens):
    """Token blocks ``mb_g`` of a slot; 0 for an ``expert_id < 0`` slot or an empty group
    (device-capable)."""
    if expert_ids[slot] < 0:
        return np.int64(0)
    return np.int64(ceil_div(np.int64(a_offsets[slot + 1]) - np.int64(a_offsets[slot]), tile_tokens))


def locate_tile(tile_index, a_offsets, expert_ids, n, tile_tokens, tile_rows):
    """Where tile ``tile_index`` of the walk lies (device-capable).

    Returns ``(slot, expert, m_blk, n_blk, token_start, token_end, row_start, row_end)`` with the
    token and weight-row ranges clipped to the group's end and to N; ``slot = -1`` (and zeros)
    when ``tile_index`` is past the last tile. Walks the slots with a running prefix.
    """
    row_blocks = ceil_div(np.int64(n), tile_rows)
    remaining = np.int64(tile_index)
    for slot in range(expert_ids.shape[0]):
        token_blocks = slot_token_blocks(slot, a_offsets, expert_ids, tile_tokens)
        count = token_blocks * row_blocks
        if remaining < count:
            # 32-bit: a 64-bit division is a called subroutine on the GPU (tile counts fit in 32 bits)
            n_blk = np.int64(np.uint32(remaining) // np.uint32(token_blocks))
            m_blk = remaining - n_blk * token_blocks
            token_start = np.int64(a_offsets[slot]) + m_blk * tile_tokens
            token_end = min(token_start + tile_tokens, np.int64(a_offsets[slot + 1]))
            row_start = n_blk * tile_rows
            row_end = min(row_start + tile_rows, np.int64(n))
            return (np.int64(slot), np.int64(expert_ids[slot]), m_blk, n_blk,
                    token_start, token_end, row_start, row_end)
        remaining -= count
    none = np.int64(0)
    return (np.int64(-1), np.int64(-1), none, none, none, none, none, none)


def cta_output_rows(row_start, row_end, rank, cta_group, tile_rows):
    """Weight rows ``[lo, hi)`` that CTA ``rank`` of a pair writes for a tile whose (clipped) rows
    are ``[row_start, row_end)``; empty (``lo == hi``) when its half lies past N (device-capable)."""
    part = tile_rows // cta_group
    lo = min(row_start + rank * part, row_end)
    hi = min(lo + part, row_end)
    return lo, hi


def rebind(func, **callees):
    """``func`` with the module functions it calls replaced by their device versions."""
    globals_ = dict(func.__globals__, **callees)
    return types.FunctionType(func.__code__, globals_, func.__name__, func.__defaults__, func.__closure__)


class DeviceFunctions(NamedTuple):
    """``cuda.jit(device=True)`` versions of the device-capable walk functions."""

    ceil_div: object
    slot_token_blocks: object
    locate_tile: object
    cta_output_rows: object


def device_functions() -> DeviceFunctions:
    """Fresh device versions of the walk functions, for use inside Numba CUDA kernels.

    Fresh on every call: numba-cuda caches a device function's compiled overloads per argument
    types, not per target, so a kernel built for another target needs its own set.
    """
    from numba import cuda

    def device(func, **callees):
        return cuda.jit(device=True)(rebind(func, **callees))

    d_ceil_div = device(ceil_div)
    d_token_blocks = device(slot_token_blocks, ceil_div=d_ceil_div)
    d_locate = device(locate_tile, ceil_div=d_ceil_div, slot_token_blocks=d_token_blocks)
    return DeviceFunctions(d_ceil_div, d_token_blocks, d_locate, device(cta_output_rows))


# ----------------------------------------------------------------------------------------------
# Host view of the walk
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tile:
    """One output tile: ``C[token_start:token_end, row_start:row_end]`` of slot ``slot``."""

    index: int         # position in the walk
    slot: int
    expert: int
    m_blk: int         # token block inside the group
    n_blk: int         # weight-row block
    token_start: int
    token_end: int     # clipped to the group's end
    row_start: int
    row_end: int       # clipped to N

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


def _walk_inputs(a_offsets, expert_ids, n, shape):
    a_offsets = np.asarray(a_offsets, dtype=np.int64)
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    if a_offsets.ndim != 1 or expert_ids.ndim != 1 or a_offsets.size != expert_ids.size + 1:
        raise ValueError(f"need a_offsets of length len(expert_ids) + 1, got {a_offsets.shape} "
                         f"and {expert_ids.shape}")
    if np.any(np.diff(a_offsets) < 0):
        raise ValueError("a_offsets must be non-decreasing")
    if not isinstance(shape, TileShape):
        raise TypeError(f"shape must be a TileShape, got {type(shape).__name__}")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    return a_offsets, expert_ids, int(n)


def slot_tile_counts(a_offsets, expert_ids, n, shape: TileShape) -> np.ndarray:
    """Tiles of each slot (int64, 0 for skipped or empty slots)."""
    a_offsets, expert_ids, n = _walk_inputs(a_offsets, expert_ids, n, shape)
    token_blocks = np.where(expert_ids >= 0, ceil_div(np.diff(a_offsets), shape.tokens), 0)
    return token_blocks * ceil_div(n, shape.weight_rows)


def total_tiles(a_offsets, expert_ids, n, shape: TileShape) -> int:
    """Length of the walk."""
    return int(slot_tile_counts(a_offsets, expert_ids, n, shape).sum())


def iter_tiles(a_offsets, expert_ids, n, shape: TileShape) -> Iterator[Tile]:
    """Every tile of the walk, in order (nested loops; ``locate_tile`` is the random-access form)."""
    a_offsets, expert_ids, n = _walk_inputs(a_offsets, expert_ids, n, shape)
    row_blocks = ceil_div(n, shape.weight_rows)
    index = 0
    for slot in range(expert_ids.size):
        token_blocks = int(slot_token_blocks(slot, a_offsets, expert_ids, shape.tokens))
        group_start, group_end = int(a_offsets[slot]), int(a_offsets[slot + 1])
        for local in range(token_blocks * row_blocks):
            m_blk, n_blk = local % token_blocks, local // token_blocks
            token_start = group_start + m_blk * shape.tokens
            row_start = n_blk * shape.weight_rows
            yield Tile(index, slot, int(expert_ids[slot]), m_blk, n_blk,
                       token_start, min(token_start + shape.tokens, group_end),
                       row_start, min(row_start + shape.weight_rows, n))
            index += 1


def tile_at(tile_index: int, a_offsets, expert_ids, n, shape: TileShape) -> Tile | None:
    """Tile ``tile_index`` through ``locate_tile`` (the kernels' random access); None past the end."""
    a_offsets, expert_ids, n = _walk_inputs(a_offsets, expert_ids, n, shape)
    fields = [int(v) for v in locate_tile(tile_index, a_offsets, expert_ids, n, shape.tokens, shape.weight_rows)]
    return None if fields[0] < 0 else Tile(int(tile_index), *fields)


# ----------------------------------------------------------------------------------------------
# Tiles to CTAs
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CtaWork:
    """What CTA ``cta`` (rank ``rank`` of its pair) does for one tile.

    It writes ``C[token_start:token_end, row_start:row_end]`` (its weight-row half when
    ``cta_group = 2``; possibly empty when that half lies past N) and stages tokens
    ``[staged_token_start, staged_token_end)`` of the token tile in its shared memory.
    """

    cta: int
    rank: int
    tile: Tile
    token_start: int
    token_end: int
    row_start: int
    row_end: int
    staged_token_start: int
    staged_token_end: int


def check_num_ctas(num_ctas, cta_group: int) -> int:
    """``num_ctas`` as an int: positive and a whole number of CTA pairs."""
    if isinstance(num_ctas, (bool, np.bool_)) or not isinstance(num_ctas, (int, np.integer)) or num_ctas < 1:
        raise ValueError(f"num_ctas must be a positive int, got {num_ctas!r}")
    if num_ctas % cta_group:
        raise ValueError(f"num_ctas={num_ctas} must be a multiple of cta_group={cta_group} "
                         "(CTAs come in pairs)")
    return int(num_ctas)


def pair_tile_indices(cta: int, num_ctas: int, num_tiles: int, cta_group: int) -> range:
    """Walk indices CTA ``cta`` works on: its pair ``p`` takes ``p, p + num_ctas / cta_group, ...``."""
    num_ctas = check_num_ctas(num_ctas, cta_group)
    if not 0 <= cta < num_ctas:
        raise ValueError(f"cta must be in [0, {num_ctas}), got {cta}")
    return range(cta // cta_group, num_tiles, num_ctas // cta_group)


def cta_work(tile: Tile, cta: int, shape: TileShape) -> CtaWork:
    """The part of ``tile`` that CTA ``cta`` handles."""
    rank = cta % shape.cta_group
    row_start, row_end = cta_output_rows(tile.row_start, tile.row_end, rank, shape.cta_group, shape.weight_rows)
    staged_start = min(tile.token_start + rank * shape.cta_tokens, tile.token_end)
    staged_end = min(staged_start + shape.cta_tokens, tile.token_end)
    return CtaWork(cta, rank, tile, tile.token_start, tile.token_end, row_start, row_end, staged_start, staged_end)


def assign_tiles(num_ctas: int, a_offsets, expert_ids, n, shape: TileShape) -> list[list[CtaWork]]:
    """For each CTA of a persistent grid, the work it does, in order."""
    num_ctas = check_num_ctas(num_ctas, shape.cta_group)
    tiles = list(iter_tiles(a_offsets, expert_ids, n, shape))
    return [[cta_work(tiles[t], cta, shape) for t in pair_tile_indices(cta, num_ctas, len(tiles), shape.cta_group)]
            for cta in range(num_ctas)]
