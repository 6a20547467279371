"""The TMA shared-memory ring both H200 (sm_90a) kernels share: what a ring stage holds, the producer that
fills it, the tile walk, and the work records that tell the consumers which tile a stage belongs to.
``h200_stream`` puts its ``mma.sync`` consumers on it, ``h200_wgmma`` its warpgroup consumers
(``WgmmaSpec.ring``); the port and why it is built this way: ``docs/design/h200_port.md``.

``StreamSpec`` is the compile-time spec of a ring and of the streaming kernel built on it (formats and byte
layouts, orientation, tile, stages, consumer warps); ``make_ring`` returns its device functions
(``RingDeviceFunctions``), a fresh set per kernel build. The ring:

* Persistent CTAs (as many as fit, ``StreamSpec.min_ctas_per_sm`` per SM). The producer is warp 0, or, with 8
  consumer warps, a whole warpgroup (warps 1-3 idle) whose registers ``setmaxnreg`` hands to the consumers.
  One thread takes the CTA's work items and walks to their tiles (``gbs.schedule``: slot order, ``-1`` and
  empty slots have no tiles, M-major inside a group): pair ``p`` of ``P`` takes item ``p`` first, then
  (``StreamSpec.dynamic_items``, single CTAs) the next free item of a global counter, so faster CTAs take
  more, or (pairs) items ``p + P, p + 2 P, ...``. The walk keeps a cursor, so it costs amortised O(1) per item.
* Stages. For every K slice the producer waits for a free stage (``empty`` mbarrier), announces the stage's
  bytes (``arrive.expect_tx`` on ``full``) and issues the TMA loads (``stage_loads``): the weight rows' slice
  (3-D map over ``b``: rows past N read as zero and never bleed into the next expert; tiled weights,
  ``b_layout`` "e2m1_h200_tiled", one or two 16 KB boxes of a 2-D map over their boxes), the token rows' slice
  (2-D map over ``a``) and the 512-byte scale atoms of both, straight from the 128x4 layouts (the weights'
  6-D scales as stored: no re-layout; with fused weights, ``b_layout`` "e2m1_h200_fused", the atoms that
  follow each box in ``b``, through a second 2-D map over its rows). Swizzled rows (TMA 128B / 64B) and the
  stage layout: ``StreamSmemLayout``.
* Work records. For the first K slice of an item the producer writes the item's record (expert, tile, token
  and row ranges, first slice, group start) beside the stage's barriers, before the arrival that arms the
  stage; after its last item, a record saying "no more work", armed with no bytes. The consumers do not
  walk: after the ``full`` wait of an item's first stage, lane 0 of each warp reads the record
  (``read_work_record``) and hands it to its warp (evidence: work-records). One lane of each consumer warp
  releases a stage.
* Split-K (``StreamSpec.split_k``): with fewer tiles than resident CTAs a work item is one run of a tile's K
  slices (``next_work``), and the consumers' epilogue adds fp32 partial tiles into a zeroed workspace; the
  tile's last run stores it (the kernels' docstrings). The dynamic item counter lives in the last
  ``SCHEDULE_COUNTER_WORDS`` words of the same counter array; the last producer to finish zeroes it.
* The routing (a_offsets, expert_ids; up to ``ROUTING_SMEM_SLOTS`` slots) is copied into shared memory at
  launch, so the tile walk does not pay one dependent global load per slot it steps over.
* ``cta_group = 2``: a cluster of two CTAs covers ``2 x 128`` weight rows that share one token tile (swapped). Each
  CTA loads half of the token rows and multicasts them (``.multicast::cluster``) to both; the token scale atoms
  are multicast too. Not swapped (the wgmma kernel's pair, ``StreamSpec.shares_weights``), the pair covers ``2 x
  128`` token rows that share one weight tile (128 or 192 rows): each CTA loads its own 128 token rows, and half of
  the weight rows (64 or 96) multicast to both, and the weight scale bands likewise (``multicast_scale_bands``: the
  128-row tile's one band from CTA 0, the 192-row tile's two from one CTA each). Every consumer warp releases a
  stage on the ``empty`` barriers of both CTAs (a multicast writes into the peer); the producers wait with
  cluster-scope acquire (the weight-sharing pair: CTA scope on both sides, as CUTLASS's multicast pipelines, since
  only TMA and wgmma touch its stages; cluster scope cost GPU-scope fences and L1 invalidations in the loop:
  evidence fold-pair-ab). Both CTAs of a pair take the same (static) items, so they run the same number of stages;
  a cluster barrier follows the mbarrier init and precedes exit.
* Token rows wider than 128 bytes per K slice (bf16 tokens, W4A16: 256 bytes per 128 K; FP8 and bf16 tokens in the
  streaming kernel's 256-K slices: 256 or 512 bytes) arrive as 128-byte TMA boxes (the 128B swizzle's widest)
  stored one after the other (``StreamSpec.token_region_bytes`` apart), each a wgmma K-major operand of 64 bf16 K
  elements where the wgmma kernel reads them; bf16 tokens have no scale atoms (``a_scales`` holds none).
* The start-up trace (``StreamSpec.trace``, ``h200_trace``) stamps the producer's events here, one hook call
  per event, which compile to nothing in untraced builds.
* Programmatic dependent launch (``gbs.plan.H200Plan.pdl``: the launch may start while the kernel before it in
  the stream runs). Both kernels' frames open with ``griddepcontrol.wait`` in every thread, then
  ``griddepcontrol.launch_dependents``. The wait comes before the first global access: the routing copy
  (``copy_routing``) is the frames' first statement, the trace's entry stamp the stream kernel's, and all that
  follows reads or writes what another kernel may write (routing, tokens and scales through TMA, the output,
  the split-K workspace and counters, the item counter, the trace buffer). The set-up that reads none of it
  (mbarrier init, tensor-map prefetch, ``setmaxnreg``) follows the routing copy, so it waits too: running it
  ahead of the wait would reorder every build's prologue, for a gain no measurement has bounded yet. The trigger
  right after the wait is safe: a dependent grid is scheduled only once every CTA of this grid has triggered or
  exited, so all of ours are resident by then, its CTAs take only SM room ours leave, and they wait for this
  grid's completion in their own ``griddepcontrol.wait``; nothing of ours waits on them. Always in the code, no
  build knob: without the launch attribute both do nothing, and in every build's SASS they add two instructions
  at the entry (ACQBULK, PREEXIT) and only reorder the parameter moves around them: registers, local memory and
  the MMA loops are unchanged (``scripts/h200_sass_report.py --all``, ``--compare``).

Constraints: rows TMA can address (K a multiple of 32 with FP4 operands, 16 with FP8); K need not be a multiple of
the K slice (``k_slice_elements``: 256 elements with FP4 weights and FP4 or slot-copied tokens, else 128): the last slice reads TMA's
zeros past K and past the atoms' last column group, and tiled weights stored padded; 16-byte aligned device arrays
(TMA); the ring's real shared-memory bytes (``StreamSmemLayout.total_bytes``) within the H200's 227 KiB per block;
tiled weights (tiled or fused) stored in whole boxes (``E2M1H200TiledOrder.padded_shape``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda import types

from gbs import schedule
from gbs.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, get_format
from gbs.layouts import LAYOUT_PACKED, E2M1H200FusedOrder, E2M1H200TiledOrder, fused_scales, tiled_weights
from gbs.numba_kernels import h200_trace
from gbs.numba_kernels.h200_decode import GROUP_ELEMENTS, QUAD, ROTATION_RUN, SCALE_LOG2_PREBIAS, inline_device
from gbs.problem import PROBLEM_FORMATS, check_layout
from gbs.ptx_inline import cluster as cl
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import copy as cp
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline.common import trap_if_nonzero
from gbs.ptx_inline.mbarrier import spin_wait_parity_or_trap, wait_parity_cluster_or_trap, wait_parity_or_trap
from gbs.numba_kernels.h200_trace import (TRACE_BARRIERS, TRACE_FIRST_SLOT, TRACE_FIRST_TMA, TRACE_MAPS,
                                          TRACE_PRODUCER_EXIT, TRACE_PRODUCER_WORK)

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
SM90 = (9, 0)
# The consumers wait for their stage's bytes without try_wait's suspend hint (``spin_wait_parity_or_trap``: a
# sleeping consumer can wake late), a little faster; the producer keeps the hint: without it, its retry loop took
# the consumers' issue slots (evidence: consumer-spin-waits, producer-suspend-hint).
CONSUMER_WAIT = spin_wait_parity_or_trap
K_SLICE_BYTES = 128            # bytes of K per stage of a 1-byte (FP8) operand row (the SM100 K tile)
TILE_M_ROWS = schedule.MMA_M_ROWS   # rows of the CTA's MMA M side (weight rows when swapped)
TILED_BOX_ROWS, TILED_BOX_BYTES = E2M1H200TiledOrder.BOX_ROWS, E2M1H200TiledOrder.BOX_BYTES
if (TILED_BOX_ROWS, TILED_BOX_BYTES) != (TILE_M_ROWS, K_SLICE_BYTES):
    raise AssertionError("tiled weights' boxes are the swapped configs' weight boxes: 128 rows x 128 B")
# ``StreamSpec.m_rows``: the ring's M side may hold 256 token rows (not swapped, one CTA) for the wgmma
# kernel (``h200_wgmma.WgmmaSpec.tile_tokens``), which decodes each weight tile once for twice the
# tokens; the streaming kernel's own consumers (mma.sync, 128-row warp grid) take 128.
RING_M_ROWS = (TILE_M_ROWS, 2 * TILE_M_ROWS)
# Weight-row widths of a tile only the wgmma kernel's ring takes (``warpgroup_consumers``, not swapped, one CTA or the
# weight-sharing pair, weights in rows): the SM100 family's widths are powers of two (``dispatch.check_mma_tile``),
# wgmma's N any multiple of 8 up to 256, and a TMA box up to 256 rows. 192: the folded FP8 route's 128 x 192 tile
# (``h200_wgmma.WgmmaSpec``), and its pair's 256 x 192.
WGMMA_ONLY_MMA_BN = (192,)
WARP_SIZE = 32
SMALL_N_MAX_MMA_BN = 32        # the small-N consumer grid: one column of warps, each on all of N
CONSUMER_WARPS_SMALL_N = 4     # mma_bn <= 32: 4 warps x (32 rows, mma_bn)
# ``StreamSpec.small_n_warps``: 8 warps of 16 rows instead of 4 of 32 (still one producer warp, no setmaxnreg):
# twice the warps per scheduler to hide the K slices' latency where CTAs are few (split-K runs) or two per SM
# (32 tokens) (evidence: smalln-eight-warps).
SMALL_N_WARP_CHOICES = (CONSUMER_WARPS_SMALL_N, 2 * CONSUMER_WARPS_SMALL_N)
# 9-warp CTAs built for two per SM (<= 113 registers by the launch bounds; two need <= 96 on the SM's
# sub-partitions, 5 warps each): offline, NVFP4 bn32 takes 94 registers this way (114 built for one, which
# would leave one CTA and 8 consumer warps per SM, as the 4-warp build has now), bn8 79; no local memory.
SMALL_N_EIGHT_WARPS_MIN_CTAS_PER_SM = 2
WARPGROUP_WARPS = 4
DATA_ALIGN = 1024              # TMA destinations with 128B / 64B swizzle: 1024-byte aligned
DYNAMIC_SMEM_ALIGN = 1024      # the dynamic shared array is declared 1024-aligned (checked at run time)
# sm_90 reserves 1 KiB of shared memory per block and the cubin counts it as static, with the
# mbarrier array padded up to the dynamic array's alignment: static = 1 KiB + 1 KiB here. The
# legality check counts static + dynamic against H200_SMEM_PER_SM (227 KiB): conservative by 1 KiB
# if the driver leaves the reserved KiB out of that limit.
SM90_RESERVED_SMEM = 1024
SM90_SMEM_PER_SM = 233472      # 228 KiB per SM for all resident blocks (their reserved KiB included)
SM90_THREADS_PER_SM = 2048
SM90_REGISTERS_PER_SM = 65536
SM90_SUBPARTITIONS = 4         # each holds a quarter of the registers for the warps it runs
REGISTER_ALLOC_STEP = 8        # registers are allocated per thread in multiples of 8
# The 4-consumer-warp configs are built (launch bounds' minimum CTAs per SM) for up to this many
# resident CTAs: 3 CTAs of 5 warps put 4 warps on some sub-partition, so <= 128 registers per thread
# (4 x 32 x 128 = 16384); past 128 registers only 2 CTAs fit, which ran slower
# (evidence: smalln-register-partitions). 4 CTAs need <= 96 registers: the FP4 decode builds take 95 without
# being forced (the consumers read work records instead of walking), and the grid takes the fourth CTA where
# shared memory allows (evidence: four-ctas-grid).
SMALL_N_MIN_CTAS_PER_SM = 3
# 32-token tiles (32 accumulators and 32 decoded-fragment words per thread) do not fit in 128
# registers: built for 3 CTAs, ptxas spilled (W4A8 / MXFP8 bn32: a 32 / 16-byte stack, 11 / 8 spill
# accesses, most in the K-slice loop); built for 2 (141 registers, no stack) they run faster
# (evidence: smalln-wide-two-ctas). FP4 tokens at bn32 need 88 KiB of shared memory per CTA: 2 per SM either way.
SMALL_N_WIDE_MMA_BN = 32
SMALL_N_WIDE_MIN_CTAS_PER_SM = 2
SCALE_ALIGN = 128              # scale atoms: plain TMA boxes, 128-byte aligned
MBARRIER_BYTES = 8
SWIZZLE_MASK = {128: 7, 64: 3}   # row bytes -> the XOR mask of TMA 128B / 64B swizzle (16-B chunks)
TMA_SWIZZLE = {128: "128B", 64: "64B"}
SCALE_MAP_ROW_BYTES = 128      # scale tensors are viewed as rows of 128 B: one 512-B atom = 4 rows
ATOM_MAP_ROWS = SF_ATOM_BYTES // SCALE_MAP_ROW_BYTES
MULTICAST_PAIR = 0b11          # ctaMask of a 2-CTA cluster
# The four tensor maps, in this order in the kernel's map buffer (u64 byte offsets).
NUM_TENSOR_MAPS = 4
MAP_TOKENS, MAP_WEIGHTS, MAP_TOKEN_SCALES, MAP_WEIGHT_SCALES = (
    np.uint64(cp.TENSOR_MAP_BYTES * i) for i in range(NUM_TENSOR_MAPS))
if NUM_TENSOR_MAPS != h200_trace.TENSOR_MAPS_BEFORE_SLOT:
    raise AssertionError("the trace buffer's address rides in the slot after the kernels' tensor maps")
BF16_BYTES = 2
# Decoded tokens (``StreamSpec.predecoded_tokens``): two slots, used by alternate stages. A slot is
# rewritten two stages later, after every consumer warp passed the next stage's barrier, which it
# reaches only when done reading: one named barrier per stage is the whole protocol.
DECODED_TOKEN_SLOTS = 2
CONSUMER_BARRIER = 1           # named barrier id of the consumer warps (0 is __syncthreads)
# The routing (a_offsets, expert_ids) is copied into shared memory at launch when it has at most
# this many slots: the tile walk then reads shared memory instead of one dependent global load per
# slot it steps over, stalling on each (evidence: routing-in-smem). Larger routings are walked in global
# memory.
ROUTING_SMEM_SLOTS = 512
SPLIT_FLAG_WORDS = 1           # shared word after the mbarriers: "this CTA closes the tile" (split-K)
# Work records (both H200 kernels): per ring stage, after the split flag, the work item whose first
# K slice the stage holds, written by the producer before it arms the stage and read by the consumers after
# its ``full`` wait (the mbarrier's release / acquire orders them): u64 words (expert | tile << 32),
# (t0 | t1 << 32), (r0 | r1 << 32), (first K slice | group start << 32); expert -1: no more work.
WORK_RECORD_WORDS = 4
NO_MORE_WORK = np.uint32(0xFFFFFFFF)   # the record's expert field after the CTA's last item
# Dynamic items (``StreamSpec.dynamic_items``): two u32 words at the end of ``split_counters``: the next
# item past the static first wave (each producer's atomicAdd), and the producers done (the last one
# zeroes both for the next launch).
SCHEDULE_COUNTER_WORDS = 2


# ----------------------------------------------------------------------------------------------
# The compile-time spec and the shared-memory layout
# ----------------------------------------------------------------------------------------------
def require_small_n_warps(warps) -> int:
    """``warps`` as an int if it is one of ``SMALL_N_WARP_CHOICES`` (the config's and the spec's check), else
    ValueError."""
    if isinstance(warps, (bool, np.bool_)) or warps not in SMALL_N_WARP_CHOICES:
        raise ValueError(f"small_n_warps must be one of {SMALL_N_WARP_CHOICES}, got {warps!r}")
    return int(warps)


def consumer_warp_grid(mma_bn: int, small_n_warps: int = CONSUMER_WARPS_SMALL_N) -> tuple[int, int]:
    """(warps along M, warps along N) of the consumers for a ``128 x mma_bn`` CTA tile.

    Small N: ``small_n_warps`` warps (4 of 32 rows, or 8 of 16) x all of N (weights decoded once, tokens
    once per warp). From 64 up: 8 warps, 32 x (mma_bn / 2) for 64 and 128 and 64 x 64 for 256 (128 fp32
    accumulators per thread, the most that fits with the operands in registers)."""
    if mma_bn <= SMALL_N_MAX_MMA_BN:
        return small_n_warps, 1
    if mma_bn <= 128:
        return 4, 2
    return 2, 4


@dataclass(frozen=True)
class OperandSide:
    """One MMA side as staged in a ring stage: which operand, its format, rows and K-slice bytes."""

    role: str           # "tokens" or "weights"
    format: str         # a name of gbs.formats.FORMATS
    rows: int           # rows staged per stage in each CTA
    row_bytes: int      # bytes of one row's K slice (128; 64 for FP4 in a 128-element slice; 256 or 512 for FP8 or
    #                     bf16 tokens in a 256-element one, 256 for bf16 tokens in a 128-element one)
    k_slice: int        # K elements per stage
    scale_bands: int    # 128-row scale bands staged per stage
    layout: str = LAYOUT_PACKED   # byte layout of the operand (``gbs.formats.OPERAND_LAYOUTS``: weights or tokens)

    @property
    def fmt(self):
        return get_format(self.format)

    @property
    def element(self) -> str:
        return self.fmt.element

    @property
    def packed(self) -> bool:
        return self.fmt.packed

    @property
    def box_bytes(self) -> int:
        """Bytes of a row one TMA box holds (the 128B swizzle's widest): the whole K slice, or 128 of a wider one."""
        return min(self.row_bytes, K_SLICE_BYTES)

    @property
    def boxes(self) -> int:
        """TMA boxes per K slice: 1, or 2-4 for wider token rows, stored one after the other (``rows x box_bytes``
        each)."""
        return self.row_bytes // self.box_bytes

    @property
    def swizzle(self) -> str:
        return TMA_SWIZZLE[self.box_bytes]

    @property
    def swizzle_mask(self) -> int:
        return SWIZZLE_MASK[self.box_bytes]

    @property
    def data_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def sf_atoms_per_slice(self) -> int:
        """512-byte scale atoms (4 scale columns each) one 128-row band needs per K slice (none for bf16 tokens)."""
        if not self.fmt.scaled:
            return 0
        return self.k_slice // (self.fmt.block_size * SF_ATOM_COLS)

    @property
    def scale_bytes(self) -> int:
        return self.scale_bands * self.sf_atoms_per_slice * SF_ATOM_BYTES

    @property
    def group_bytes(self) -> int:
        """Bytes of one 8-element decode group: a 4-byte FP4 word or two FP8 words."""
        return GROUP_ELEMENTS * self.fmt.element_bits // 8

    @property
    def thread_bytes(self) -> int:
        """Bytes of a row's K slice one lane of a quad reads (a contiguous quarter)."""
        return self.row_bytes // QUAD

    @property
    def groups(self) -> int:
        return self.thread_bytes // self.group_bytes

    @property
    def blocks_per_thread(self) -> int:
        return self.k_slice // QUAD // self.fmt.block_size if self.fmt.scaled else 0

    @property
    def log2_prebias(self) -> int:
        """The scale pre-bias d (``h200_decode``); 0 for bf16 tokens, read as they are."""
        return SCALE_LOG2_PREBIAS[self.fmt.scale_dtype] if self.fmt.scaled else 0


@dataclass(frozen=True)
class StreamSmemLayout:
    """Byte offsets inside one ring stage, the stage size, the decoded-token slots after the ring
    (``decoded_token_slot_bytes`` each, ``DECODED_TOKEN_SLOTS`` of them; 0 when tokens are decoded
    in registers) and the kernel's shared-memory totals."""

    m_data: int
    n_data: int
    m_scales: int
    n_scales: int
    stage_bytes: int
    stages: int
    decoded_token_slot_bytes: int = 0

    @property
    def decoded_tokens(self) -> int:
        """Offset of the first decoded-token slot (right after the ring, 1024-byte aligned)."""
        return self.stages * self.stage_bytes

    @property
    def dynamic_bytes(self) -> int:
        return self.decoded_tokens + DECODED_TOKEN_SLOTS * self.decoded_token_slot_bytes

    @property
    def work_record_base(self) -> int:
        """u64 words of the kernels' ``bars`` array before the first work record: the full / empty
        mbarriers and the split-K flag word."""
        return 2 * self.stages + SPLIT_FLAG_WORDS

    @property
    def barrier_words(self) -> int:
        """u64 words of ``bars``: the mbarriers, the split-K flag word and the stages' work records."""
        return self.work_record_base + WORK_RECORD_WORDS * self.stages

    @property
    def barrier_bytes(self) -> int:
        return self.barrier_words * MBARRIER_BYTES

    @property
    def routing_bytes(self) -> int:
        """The shared copy of the routing: a_offsets (u32) and expert_ids (s32) of up to
        ``ROUTING_SMEM_SLOTS`` slots."""
        return 4 * (ROUTING_SMEM_SLOTS + 1) + 4 * ROUTING_SMEM_SLOTS

    @property
    def static_bytes(self) -> int:
        """What the cubin reports as static: the reserved KiB, the mbarriers and the routing copy,
        padded to the dynamic array's alignment."""
        return SM90_RESERVED_SMEM + _align(self.barrier_bytes + self.routing_bytes, DYNAMIC_SMEM_ALIGN)

    @property
    def total_bytes(self) -> int:
        return self.dynamic_bytes + self.static_bytes


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class StreamSpec:
    """Everything the kernel is specialised on; hashable (compiled kernels are cached per spec)."""

    a_format: str       # token operand
    b_format: str       # weight operand
    ab_swapped: bool
    mma_bn: int
    cta_group: int
    stages: int
    split_k: bool = False   # built for split-K runs (``gbs.plan``: ``stream_k_splits``): the atomic epilogue
    b_layout: str = LAYOUT_PACKED   # the weights' byte layout (``gbs.formats.OPERAND_LAYOUTS``)
    a_layout: str = LAYOUT_PACKED   # the tokens' byte layout (the same layouts)
    trace: bool = False     # stamps the start-up events (``TRACE_EVENTS``): a diagnostic build
    small_n_warps: int = CONSUMER_WARPS_SMALL_N   # consumer warps of a small-N tile (``SMALL_N_WARP_CHOICES``)
    m_rows: int = TILE_M_ROWS   # rows of the ring's M side (``RING_M_ROWS``; 256: the wgmma kernel's ring only)
    # the wgmma kernel's ring: a producer warpgroup and two consumer warpgroups at every mma_bn (its swapped
    # 32-token tile too), never the small-N grid
    warpgroup_consumers: bool = False

    def __post_init__(self):
        pair = (get_format(self.a_format).name, get_format(self.b_format).name)
        if pair not in PROBLEM_FORMATS.values():
            raise ValueError(f"unsupported operand formats A={pair[0]} x B={pair[1]}; "
                             f"supported: {sorted(PROBLEM_FORMATS.values())}")
        # the SM100 tile rules; the wgmma kernel's pair shares weights, and its ring takes widths of its own, tiles the
        # SM100 family does not have
        wgmma_pair = self.shares_weights and self.warpgroup_consumers
        if self.wgmma_only_width:
            if self.ab_swapped or self.tiled_weights:
                raise ValueError(f"mma_bn={self.mma_bn} (a wgmma-only tile width) takes ab_swapped False and the "
                                 f"weights in rows; got ab_swapped={self.ab_swapped}, b_layout={self.b_layout!r}")
        else:
            schedule.TileConfig(self.ab_swapped, self.mma_bn, 1 if wgmma_pair else self.cta_group)
        if wgmma_pair and self.tiled_weights:
            raise ValueError(f"cta_group={self.cta_group} not swapped (the wgmma kernel's pair of token tiles sharing "
                             f"the weight tile) takes the weights in rows, not tiled; got b_layout={self.b_layout!r}")
        if wgmma_pair and math.prod(self.weight_box) % DATA_ALIGN:
            raise ValueError(f"mma_bn={self.mma_bn} over a pair: each CTA's half of the weight rows "
                             f"({math.prod(self.weight_box)} B) must be whole {DATA_ALIGN}-byte swizzle atoms, so that "
                             f"the second half's TMA destination is aligned as the swizzle needs (DATA_ALIGN)")
        check_layout(self.b_layout, get_format(self.b_format), "b")
        check_layout(self.a_layout, get_format(self.a_format), "a")
        if isinstance(self.stages, (bool, np.bool_)) or not isinstance(self.stages, (int, np.integer)) \
                or self.stages < 1:
            raise ValueError(f"stages must be a positive int, got {self.stages!r}")
        require_small_n_warps(self.small_n_warps)
        if not get_format(self.a_format).scaled and not (self.warpgroup_consumers or self.predecoded_tokens):
            raise ValueError(f"{self.a_format} tokens: the streaming kernel reads them in its swapped small-N tiles "
                             f"only (ab_swapped, mma_bn <= {SMALL_N_MAX_MMA_BN}: each stage's tokens copied once into "
                             "B fragments), the wgmma kernel in its not-swapped tiles")
        if self.m_rows not in RING_M_ROWS:
            raise ValueError(f"m_rows must be one of {RING_M_ROWS}, got {self.m_rows!r}")
        if self.m_rows != TILE_M_ROWS and (self.ab_swapped or self.cta_group != 1 or self.small_n):
            raise ValueError(f"m_rows={self.m_rows} (token rows of the wgmma kernel's ring) needs ab_swapped False, "
                             f"cta_group 1 and mma_bn > {SMALL_N_MAX_MMA_BN}")
        if self.small_n_warps != CONSUMER_WARPS_SMALL_N:
            if not self.small_n:
                raise ValueError(f"small_n_warps={self.small_n_warps} needs mma_bn <= {SMALL_N_MAX_MMA_BN} "
                                 f"(got {self.mma_bn}: wider tiles have their own 8-warp grid)")
            side = self.n_side
            items = side.rows * QUAD * (side.groups // self.token_decode_groups)
            if self.predecoded_tokens and items % (WARP_SIZE * self.consumer_warps):
                raise ValueError(
                    f"small_n_warps={self.small_n_warps} at mma_bn={self.mma_bn} with {side.format} tokens: the "
                    f"stage's {items} token-decode items do not split evenly over {WARP_SIZE * self.consumer_warps} "
                    f"consumer threads; use {CONSUMER_WARPS_SMALL_N} warps or a wider mma_bn")

    @property
    def min_stages(self) -> int:
        """The fewest ring stages the streaming kernel runs with (its consumers release each stage in its slice)."""
        return 1

    # -- formats and the K slice --------------------------------------------------------------
    @property
    def k_slice(self) -> int:
        """K elements per stage (``k_slice_elements``): FP4 weights' 256 with any tokens in the decoded-token tiles
        narrower than ``SMALL_N_WIDE_MMA_BN`` columns; at 32 columns the wider slots and stages leave 2 CTAs per SM
        instead of 3, slower (evidence: w4a8-k256)."""
        return k_slice_elements(self.a_format, self.b_format,
                                self.predecoded_tokens and self.mma_bn < SMALL_N_WIDE_MMA_BN)

    @property
    def pairing(self) -> str:
        """How 8-element groups fill bf16x2 registers: "stride4" with an FP4 operand, else "stride2"."""
        any_fp4 = get_format(self.a_format).packed or get_format(self.b_format).packed
        return "stride4" if any_fp4 else "stride2"

    @property
    def wgmma_only_width(self) -> bool:
        """A weight-row width of the wgmma kernel's ring that the SM100 tile rules do not have (``WGMMA_ONLY_MMA_BN``)."""
        return self.warpgroup_consumers and self.mma_bn in WGMMA_ONLY_MMA_BN

    @property
    def tile_shape(self) -> schedule.TileShape:
        if self.shares_weights or self.wgmma_only_width:
            return schedule.TileShape(tokens=self.cta_group * self.m_rows, weight_rows=self.mma_bn,
                                      cta_group=self.cta_group)
        shape = schedule.TileConfig(self.ab_swapped, self.mma_bn, self.cta_group).tile_shape
        return dataclasses.replace(shape, tokens=self.m_rows) if self.m_rows != TILE_M_ROWS else shape

    @property
    def empty_arrivals_per_cta(self) -> int:
        """Arrivals each CTA's consumers give a stage's ``empty`` barrier: one per consumer warp, or in the
        weight-sharing pair one per consumer warpgroup (one thread of each signals each CTA of the pair, as CUTLASS's
        multicast pipelines do: a warpgroup's wgmma reads are done once its wait returns in any of its warps)."""
        return self.consumer_warps // WARPGROUP_WARPS if self.shares_weights else self.consumer_warps

    @property
    def shares_tokens(self) -> bool:
        """A CTA pair whose two weight tiles share one token tile (swapped): each CTA loads its own weight rows and
        multicasts half of the token rows."""
        return self.cta_group > 1 and self.ab_swapped

    @property
    def shares_weights(self) -> bool:
        """A CTA pair whose two token tiles share one weight tile (not swapped: the wgmma kernel's pair): each CTA
        loads its own token rows and multicasts half of the weight rows."""
        return self.cta_group > 1 and not self.ab_swapped

    @property
    def dynamic_items(self) -> bool:
        """Past the first wave (item = CTA), producers take work items from a global counter, so CTAs
        that run faster take more (on a static decode schedule the CTAs of a launch finished far apart:
        evidence: dynamic-items). A CTA pair must work on the same tiles, so pairs keep the static schedule."""
        return self.cta_group == 1

    def _side(self, role: str, rows: int, scale_bands: int) -> OperandSide:
        fmt = get_format(self.a_format if role == "tokens" else self.b_format)
        layout = self.a_layout if role == "tokens" else self.b_layout
        return OperandSide(role, fmt.name, rows, fmt.row_bytes(self.k_slice), self.k_slice,
                           scale_bands if fmt.scaled else 0, layout)

    @property
    def m_side(self) -> OperandSide:
        """The ``m_rows``-row MMA M side (128; 256 token rows in the wgmma kernel's ring): weights when
        swapped, else tokens; one scale band per 128 rows."""
        return self._side("weights" if self.ab_swapped else "tokens", self.m_rows, self.m_rows // SF_ATOM_ROWS)

    @property
    def n_side(self) -> OperandSide:
        """The ``mma_bn``-row MMA N side (every CTA of a pair holds all of it), with the scale bands from the one holding
        its first row: ``ceil(mma_bn / 128)`` cover it (a 192-row tile starts at row 0 or 64 of a band)."""
        return self._side("tokens" if self.ab_swapped else "weights", self.mma_bn,
                          -(-self.mma_bn // SF_ATOM_ROWS))

    @property
    def token_side(self) -> OperandSide:
        return self.n_side if self.ab_swapped else self.m_side

    @property
    def weight_side(self) -> OperandSide:
        return self.m_side if self.ab_swapped else self.n_side

    # -- consumers -----------------------------------------------------------------------------
    @property
    def small_n(self) -> bool:
        """The small-N consumer grid (one column of warps, each on all ``mma_bn`` columns)."""
        return self.mma_bn <= SMALL_N_MAX_MMA_BN and not self.warpgroup_consumers

    @property
    def warp_grid(self) -> tuple[int, int]:
        if self.warpgroup_consumers:
            return 2 * WARPGROUP_WARPS, 1
        return consumer_warp_grid(self.mma_bn, self.small_n_warps)

    @property
    def consumer_warps(self) -> int:
        wm, wn = self.warp_grid
        return wm * wn

    @property
    def uses_setmaxnreg(self) -> bool:
        """A whole producer warpgroup and setmaxnreg (the large-N grid's 8 warps), see the constants."""
        return not self.small_n

    @property
    def producer_warps(self) -> int:
        """Warps before the consumers: warp 0 issues the TMA loads, the others (if any) idle."""
        return WARPGROUP_WARPS if self.uses_setmaxnreg else 1

    @property
    def threads(self) -> int:
        return WARP_SIZE * (self.producer_warps + self.consumer_warps)

    @property
    def predecoded_tokens(self) -> bool:
        """Swapped small-N configs (4 consumer warps, the decode regime) decode each stage's token
        slice ONCE, cooperatively, into bf16 in shared memory (``decoded_token_offset``), instead of
        once per consumer warp in registers: the warps then read ready MMA B fragments (one 16-byte
        load per token row and group). Wider token tiles (8 warps) would need up to 128 KiB."""
        return self.ab_swapped and self.small_n

    @property
    def token_decode_groups(self) -> int:
        """8-element groups of one quad lane's quarter that one item of the cooperative token decode
        covers (``predecoded_tokens``): as many as every consumer thread still gets a whole item of
        (at most a rotation run: one 16-byte load for FP4). An item loads and converts its row's
        block scales once; with one group per item the per-item overhead
        made the token decode a quarter of the 16-token kernel's instructions (evidence: token-decode-items)."""
        side = self.n_side
        per_thread = side.rows * QUAD * side.groups // (WARP_SIZE * self.consumer_warps)
        return max(1, min(ROTATION_RUN, per_thread))

    @property
    def prefetch_groups(self) -> bool:
        """Small-N configs (one consumer warp per SM sub-partition, nothing else to hide latency
        with) load the next 8-element group's words while decoding the current one, and their N
        rows with the group; the large-N 8-warp configs keep registers for their accumulators instead."""
        return self.small_n

    @property
    def warp_tile(self) -> tuple[int, int]:
        """(rows, cols) of the MMA tile one consumer warp owns."""
        wm, wn = self.warp_grid
        return TILE_M_ROWS // wm, self.mma_bn // wn

    @property
    def epilogue_log2(self) -> int:
        """The epilogue's exact power of two: undoes both operands' scale pre-bias."""
        return self.m_side.log2_prebias + self.n_side.log2_prebias

    @property
    def min_ctas_per_sm(self) -> int:
        """The launch bounds' minimum CTAs per SM (ptxas fits its register allocation to it): the 4-warp
        configs ask for what their shared memory allows, up to ``SMALL_N_MIN_CTAS_PER_SM`` (or
        ``SMALL_N_WIDE_MIN_CTAS_PER_SM`` from ``SMALL_N_WIDE_MMA_BN`` token columns), the 8 small-N warps
        up to ``SMALL_N_EIGHT_WARPS_MIN_CTAS_PER_SM``; the large-N configs (``setmaxnreg``) for one."""
        if self.uses_setmaxnreg:
            return 1
        if self.small_n_warps != CONSUMER_WARPS_SMALL_N:
            return max(1, min(SMALL_N_EIGHT_WARPS_MIN_CTAS_PER_SM, SM90_SMEM_PER_SM // self.smem.total_bytes))
        target = SMALL_N_WIDE_MIN_CTAS_PER_SM if self.mma_bn >= SMALL_N_WIDE_MMA_BN else SMALL_N_MIN_CTAS_PER_SM
        return max(1, min(target, SM90_SMEM_PER_SM // self.smem.total_bytes))

    # -- shared memory -------------------------------------------------------------------------
    @property
    def smem(self) -> StreamSmemLayout:
        m, n = self.m_side, self.n_side
        m_data = 0
        n_data = _align(m_data + m.data_bytes, DATA_ALIGN)
        m_scales = _align(n_data + n.data_bytes, SCALE_ALIGN)
        n_scales = _align(m_scales + m.scale_bytes, SCALE_ALIGN)
        stage = _align(n_scales + n.scale_bytes, DATA_ALIGN)
        slot = n.rows * self.k_slice * BF16_BYTES if self.predecoded_tokens else 0
        return StreamSmemLayout(m_data, n_data, m_scales, n_scales, stage, self.stages, slot)

    @property
    def tx_bytes(self) -> int:
        """Bytes every CTA's ``full`` barrier expects per stage (whole TMA boxes, multicasts included)."""
        m, n = self.m_side, self.n_side
        return m.data_bytes + n.data_bytes + m.scale_bytes + n.scale_bytes

    # -- TMA boxes (innermost first) -------------------------------------------------------------
    @property
    def token_box(self) -> tuple[int, int]:
        """(bytes, rows) of each box a CTA loads of the token slice (``token_side.boxes`` per slice): half the token
        tile per CTA of a pair."""
        side = self.token_side
        rows = self.mma_bn // self.cta_group if self.ab_swapped else self.m_rows
        return side.box_bytes, rows

    @property
    def token_region_bytes(self) -> int:
        """Stage bytes from one token box (128 bytes of each row) to the next: all the tile's token rows."""
        return self.token_side.data_bytes // self.token_side.boxes

    @property
    def weight_box(self) -> tuple[int, int, int]:
        """(bytes, rows, experts) of the weight slice each CTA loads (half the tile's rows in a pair that shares
        them)."""
        side = self.weight_side
        return side.row_bytes, (TILE_M_ROWS if self.ab_swapped else self.mma_bn // self.cta_group), 1

    @property
    def tiled_weights(self) -> bool:
        """The weights are stored box by box (``gbs.formats.E2M1H200TiledOrder``): a 2-D tensor map over all
        boxes, ``tiled_weight_loads`` loads per stage."""
        return tiled_weights(self.b_layout)

    @property
    def fused_weight_scales(self) -> bool:
        """The weights' scale atoms follow each box in ``b`` (``gbs.formats.E2M1H200FusedOrder``): the weight-scale
        map reads ``b`` too (``tensor_map_args``), a chunk of ``weight_chunk_rows`` rows per box."""
        return fused_scales(self.b_layout)

    @property
    def weight_chunk_rows(self) -> int:
        """128-byte rows from one box of the tiled weights' map to the next: the box, plus its scale atoms when
        they are fused."""
        scale_bytes = E2M1H200FusedOrder.chunk_scale_bytes(get_format(self.b_format).block_size)
        return TILED_BOX_ROWS + (scale_bytes // TILED_BOX_BYTES if self.fused_weight_scales else 0)

    @property
    def tiled_weight_loads(self) -> int:
        """TMA loads of a stage's weight box from tiled weights: one per 128-row box (two for mma_bn 256).
        Every legal ``mma_bn`` of tiled weights (a power of 2, ``dispatch.check_mma_tile``; ``WGMMA_ONLY_MMA_BN``
        reads weights in rows) is a whole number of boxes or divides one, so a tile's rows never straddle two boxes. A 256-row tile's second box past N reads
        the next expert's first box (the last expert's: the map's zero fill) where the row-major map reads
        zeros; those rows' outputs are never stored."""
        return -(-self.weight_box[1] // TILED_BOX_ROWS)

    @property
    def scale_box(self) -> tuple[int, int, int]:
        """One 128-row band's atoms of a K slice, as (128 B, 4 rows per atom, 1 band)."""
        return SCALE_MAP_ROW_BYTES, ATOM_MAP_ROWS * self.weight_side.sf_atoms_per_slice, 1

    @property
    def scale_band_bytes(self) -> int:
        """Bytes of one 128-row band's atoms per K slice (the weights'; scaled tokens have as many)."""
        return self.weight_side.sf_atoms_per_slice * SF_ATOM_BYTES


def stage_loads(spec: StreamSpec) -> list[tuple[str, int, int, bool]]:
    """The TMA boxes one stage receives in each CTA: (what, stage offset, bytes, multicast).

    Every CTA of a pair receives the same boxes: its own loads plus what the peer multicasts (the
    token rows' halves and token scale bands; not swapped, the weight rows' halves and weight scale bands). The
    producer issues exactly these (scales one band per box); the tests check that they tile the stage and sum to
    ``tx_bytes``.
    """
    lay, cg = spec.smem, spec.cta_group
    tokens_m = not spec.ab_swapped
    shares_tokens, shares_weights = spec.shares_tokens, spec.shares_weights
    tok_data = lay.m_data if tokens_m else lay.n_data
    tok_sf = lay.m_scales if tokens_m else lay.n_scales
    w_data = lay.n_data if tokens_m else lay.m_data
    w_sf = lay.n_scales if tokens_m else lay.m_scales
    band_bytes = spec.scale_band_bytes
    if shares_weights:   # a box per CTA of the pair: its half of the rows, multicast
        parts, part_bytes = cg, math.prod(spec.weight_box)
    else:
        parts = spec.tiled_weight_loads if spec.tiled_weights else 1
        part_bytes = math.prod(spec.weight_box) // parts
    loads = [("weights", w_data + p * part_bytes, part_bytes, shares_weights) for p in range(parts)]
    loads += [("weight scales", w_sf + b * band_bytes, band_bytes, shares_weights)
              for b in range(spec.weight_side.scale_bands)]
    box_bytes = math.prod(spec.token_box)
    loads += [("tokens", tok_data + p * spec.token_region_bytes + r * box_bytes, box_bytes, shares_tokens)
              for p in range(spec.token_side.boxes) for r in range(cg if shares_tokens else 1)]
    loads += [("token scales", tok_sf + b * band_bytes, band_bytes, shares_tokens)
              for b in range(spec.token_side.scale_bands)]
    return loads


def k_slice_elements(a_format, b_format, token_slots: bool = False) -> int:
    """K elements per stage of a format pair (names or ``BlockFormat``): 256 (a 128-byte FP4 weight row) when both
    operands are FP4, or when the weights are FP4 and the tokens are copied into the streaming kernel's decoded-token
    slots (``StreamSpec.predecoded_tokens``: FP8 or bf16 token rows of 2 or 4 boxes, read by no MMA), else 128. Half
    the stages per K halves the per-stage work of a decode tile (evidence: w4a8-k256)."""
    fp4_weights = get_format(b_format).packed
    if fp4_weights and (get_format(a_format).packed or token_slots):
        return 2 * K_SLICE_BYTES
    return K_SLICE_BYTES


# ----------------------------------------------------------------------------------------------
# Index helpers of the producer (integer Python, also device functions)
# ----------------------------------------------------------------------------------------------
def token_scale_band(group_start, scale_offset, token_start):
    """128-row band of ``a_scales`` holding token ``token_start`` of the group starting at
    ``group_start`` (``a_scale_offsets[g] = scale_offset``); the token's row in it is
    ``(token_start - group_start) % 128`` (formats.md: padded row ``m - start + 128 * (start // 128
    + a_scale_offsets[g])``)."""
    return group_start // SF_ATOM_ROWS + scale_offset + (token_start - group_start) // SF_ATOM_ROWS


def weight_scale_band(expert, bands_per_expert, row):
    """Band of the 6-D weight scales, viewed as (experts x bands) bands, holding weight ``row``."""
    return expert * bands_per_expert + row // SF_ATOM_ROWS


def tiled_weight_row(expert, row, k_byte, row_tiles, k_boxes, chunk_rows):
    """Row of the tiled weights' 2-D map (``gbs.formats.E2M1H200TiledOrder``: 128-byte rows, box after box)
    where weight ``row`` (a box's first row, or a row of it) of ``expert`` starts in the box holding K
    byte ``k_byte``; the box's byte column is ``k_byte % TILED_BOX_BYTES``. ``row_tiles``, ``k_boxes``:
    boxes per expert along N and along K; ``chunk_rows``: map rows per box (``StreamSpec.weight_chunk_rows``:
    128, or more where each box is followed by its scale atoms)."""
    box = (expert * row_tiles + row // TILED_BOX_ROWS) * k_boxes + k_byte // TILED_BOX_BYTES
    return box * chunk_rows + row % TILED_BOX_ROWS



# ----------------------------------------------------------------------------------------------
# The ring's device functions
# ----------------------------------------------------------------------------------------------
@inline_device
def lane0_u32(value):
    """Lane 0's ``value`` handed to its whole warp (``shfl.sync``): ptxas then knows the result warp-uniform, holds
    the wgmma descriptors built from it in uniform registers, and keeps a shared-window address instead of
    rebuilding it from the cluster CTA id at every use (as CUTLASS's ``canonical_warp_group_idx``; evidence:
    fold-uniform-ab). Every lane of the warp must call it."""
    return np.uint32(cuda.shfl_sync(np.uint32(0xFFFFFFFF), np.int32(value), 0))


def kernel_signature():
    """Argument types of every kernel of the family (the offline compile uses the same)."""
    u32_1d = types.Array(types.uint32, 1, "C")
    return (types.uint64, u32_1d, u32_1d, types.Array(types.int32, 1, "C"), types.Array(types.float32, 1, "C"),
            types.Array(types.uint16, 2, "C"), types.int64, types.int64, types.int64,
            types.Array(types.float32, 2, "C"), u32_1d, types.int64, types.int64)


@dataclass(frozen=True)
class RingDeviceFunctions:
    """The device functions of the TMA ring both H200 kernels share (``make_ring``): the routing copy,
    the barrier set-up, the producer (which walks the tiles) and the work records the consumers read."""

    copy_routing: object    # (a_offsets, expert_ids, shared_offsets, shared_expert_ids): every thread
    cta_position: object    # -> (rank in the pair, pair, pairs)
    block_sync: object      # every thread of the CTA (and the pair)
    next_work: object       # (work, cursor...) -> (slot, expert, tile, t0, t1, r0, r1, first slice, cursor...)
    produce: object         # the producer warp(s): barrier init, block sync, TMA issue loop
    cta_output_rows: object
    trace: h200_trace.TraceHooks   # the start-up trace's hooks of this build (no-ops unless ``spec.trace``)
    write_work_record: object  # (bars, stage, expert, tile, t0, t1, r0, r1, first slice, group start): producer
    unpack_work_record: object  # (4 record words) -> the item's fields
    read_work_record: object   # (bars, stage, lane) -> the item whose first K slice the stage holds
    next_stage: object         # (stage, phase) -> the ring position after stage: producer and consumers


def make_ring(spec: StreamSpec) -> RingDeviceFunctions:
    """Device functions of ``spec``'s ring: a fresh set per call (see ``schedule.device_functions``).

    ``produce(dyn, bars, tensor_maps, a_offsets, a_scale_offsets, expert_ids, shared_offsets,
    shared_expert_ids, n, k_slices, max_tiles, split_counters, k_splits, slices_per_split)`` runs in every
    thread of the producer warps: thread 0 initialises ``full[s]`` (count 1) and ``empty[s]`` (count
    ``spec.empty_arrivals_per_cta * cta_group``: one arrival per consumer warp, or warpgroup, of each CTA of the
    pair) in ``bars``, all meet at ``block_sync``, then thread 0 takes the CTA's work items (item = pair index, then
    with ``spec.dynamic_items`` from the global counter, else every ``pairs``-th), walks to their tiles and
    fills the ring (module docstring). It writes each item's record into the stage of its first K slice
    and, after the last item, a record saying so (``NO_MORE_WORK``, armed by a plain arrival); consumers
    call ``block_sync`` once and then read the records (``read_work_record``) after each item's first
    ``full`` wait."""
    walk = schedule.device_functions()
    shape = spec.tile_shape
    tile_tokens, tile_rows = shape.tokens, shape.weight_rows
    cta_group, stages, swapped, split_k = spec.cta_group, spec.stages, spec.ab_swapped, spec.split_k
    lay, tx_bytes = spec.smem, spec.tx_bytes
    stage_bytes = lay.stage_bytes
    tok_data_off, tok_sf_off = (lay.n_data, lay.n_scales) if swapped else (lay.m_data, lay.m_scales)
    w_data_off, w_sf_off = (lay.m_data, lay.m_scales) if swapped else (lay.n_data, lay.n_scales)
    tok_slice_bytes, w_slice_bytes = spec.token_side.row_bytes, spec.weight_side.row_bytes
    tok_box_rows = spec.token_box[1]
    tok_box_bytes = math.prod(spec.token_box)
    sf_rows_per_slice = spec.scale_box[1]
    sf_band_bytes = spec.scale_band_bytes
    tok_boxes, tok_box_row_bytes, tok_region_bytes = spec.token_side.boxes, spec.token_box[0], spec.token_region_bytes
    tok_bands, w_bands = spec.token_side.scale_bands, spec.weight_side.scale_bands
    empty_count = spec.empty_arrivals_per_cta * cta_group
    shares_tokens, shares_weights = spec.shares_tokens, spec.shares_weights
    w_box_rows, w_box_bytes = spec.weight_box[1], math.prod(spec.weight_box)
    token_band_of = inline_device(token_scale_band)
    weight_band_of = inline_device(weight_scale_band)
    trace = h200_trace.make_trace(spec.trace)
    trace_begin, trace_stamp = trace.begin, trace.stamp   # numba reads device functions from plain names
    dynamic_items = spec.dynamic_items
    record_base = lay.work_record_base
    tiled = spec.tiled_weights
    tiled_loads = spec.tiled_weight_loads
    tiled_part_bytes = w_slice_bytes * min(spec.weight_box[1], TILED_BOX_ROWS)
    tiled_row_of = inline_device(tiled_weight_row)
    fused = spec.fused_weight_scales
    chunk_rows = spec.weight_chunk_rows

    @inline_device
    def copy_routing(a_offsets, expert_ids, shared_offsets, shared_expert_ids):
        num_slots = expert_ids.shape[0]
        if num_slots <= ROUTING_SMEM_SLOTS:   # read by the walk after the block sync of each role
            i = cuda.threadIdx.x   # not range(): a run-time step divides
            while i <= num_slots:
                shared_offsets[i] = a_offsets[i]
                if i < num_slots:
                    shared_expert_ids[i] = expert_ids[i]
                i += cuda.blockDim.x

    @inline_device
    def routing_views(a_offsets, expert_ids, shared_offsets, shared_expert_ids):
        """The routing the tile walk reads: the shared copy when it holds every slot, else global."""
        num_slots = expert_ids.shape[0]
        if num_slots <= ROUTING_SMEM_SLOTS:
            return shared_offsets[:num_slots + 1], shared_expert_ids[:num_slots]
        return a_offsets[:], expert_ids[:]

    @inline_device
    def cta_position():
        """(rank in the pair, pair index, number of pairs) of this CTA."""
        rank = np.int64(0)
        if cta_group > 1:
            rank = np.int64(cl.cluster_ctarank())
        return rank, np.int64(cuda.blockIdx.x // cta_group), np.int64(cuda.gridDim.x // cta_group)

    @inline_device
    def block_sync():
        """Every thread of the CTA (and of the pair): after the mbarrier init, before exit."""
        if cta_group > 1:
            cl.cluster_arrive_release()
            cl.cluster_wait_acquire()
        else:
            cuda.syncthreads()

    @inline_device
    def next_work(work, cursor_slot, cursor_first, a_offsets, expert_ids, n, k_splits, slices_per_split):
        """Work item ``work`` (a tile, or with split-K one run of a tile's K slices): its tile, found
        by walking from the cursor (the first tile ``cursor_first`` of slot ``cursor_slot``):
        amortised O(1) per item instead of O(slots). Returns (slot, expert, tile, t0, t1, r0, r1,
        first K slice, new cursor); slot < 0 past the last tile. ``schedule.locate_tile``'s walk in
        32-bit arithmetic (tile and token counts fit): a launch's first walk is slow because it is cold
        (instruction fetch or first data / parameter reads), not because of its length, and the 64-bit walk was
        ~3x the SASS with a 64-bit division call (evidence: first-walk-cold, walk-32bit)."""
        work = np.uint32(work)
        tile = work
        if split_k:
            tile = np.uint32(work // np.uint32(k_splits))
        s_begin = np.uint32(np.uint32(work - tile * np.uint32(k_splits)) * np.uint32(slices_per_split))
        row_blocks = np.uint32(np.uint32(np.uint32(n) + np.uint32(tile_rows - 1)) // np.uint32(tile_rows))
        remaining = np.uint32(tile - cursor_first)
        slot = np.uint32(cursor_slot)
        num_slots = np.uint32(expert_ids.shape[0])
        while slot < num_slots:
            lo = np.uint32(a_offsets[slot])
            hi = np.uint32(a_offsets[slot + np.uint32(1)])
            expert = np.int32(expert_ids[slot])
            blocks = np.uint32(0)
            if expert >= 0:
                blocks = np.uint32(np.uint32(np.uint32(hi - lo) + np.uint32(tile_tokens - 1)) // np.uint32(tile_tokens))
            count = np.uint32(blocks * row_blocks)
            if remaining < count:
                n_blk = np.uint32(remaining // blocks)
                m_blk = np.uint32(remaining - n_blk * blocks)
                t0 = np.uint32(lo + m_blk * np.uint32(tile_tokens))
                r0 = np.uint32(n_blk * np.uint32(tile_rows))
                return (np.int64(slot), np.int64(expert), np.int64(tile), np.int64(t0),
                        np.int64(min(np.uint32(t0 + np.uint32(tile_tokens)), hi)), np.int64(r0),
                        np.int64(min(np.uint32(r0 + np.uint32(tile_rows)), np.uint32(n))), np.int64(s_begin),
                        slot, np.uint32(np.uint32(tile - m_blk) - np.uint32(n_blk * blocks)))
            remaining = np.uint32(remaining - count)
            slot = np.uint32(slot + np.uint32(1))
        none = np.int64(0)
        return (np.int64(-1), np.int64(-1), np.int64(tile), none, none, none, none, np.int64(s_begin),
                np.uint32(cursor_slot), np.uint32(cursor_first))

    @inline_device
    def write_work_record(bars, stage, expert, tile, t0, t1, r0, r1, s_begin, group_start):
        """The record of the work item whose first K slice stage ``stage`` holds (``WORK_RECORD_WORDS``)."""
        rec = record_base + WORK_RECORD_WORDS * stage
        bars[rec] = np.uint64(expert) | (np.uint64(tile) << np.uint64(32))
        bars[rec + 1] = np.uint64(t0) | (np.uint64(t1) << np.uint64(32))
        bars[rec + 2] = np.uint64(r0) | (np.uint64(r1) << np.uint64(32))
        bars[rec + 3] = np.uint64(s_begin) | (np.uint64(group_start) << np.uint64(32))

    @inline_device
    def unpack_work_record(w0, w1, w2, w3):
        """(expert, tile, t0, t1, r0, r1, first K slice, group start) of a record's words (int32 expert, -1: no
        more work; the rest u32: half the registers of int64 across the K loop)."""
        low, high = np.uint64(0xFFFFFFFF), np.uint64(32)
        return (np.int32(np.uint32(w0 & low)), np.uint32(w0 >> high), np.uint32(w1 & low), np.uint32(w1 >> high),
                np.uint32(w2 & low), np.uint32(w2 >> high), np.uint32(w3 & low), np.uint32(w3 >> high))

    @inline_device
    def read_work_record(bars, stage, lane):
        """The record of stage ``stage`` (``unpack_work_record``), read by lane 0 and handed to its warp: the
        lane that reads it is then the lane whose arrival on ``empty`` lets the producer rewrite it (with
        every lane reading, compute-sanitizer's racecheck reported read / write hazards between the other
        lanes' reads and the producer's next record: evidence: record-lane0-read)."""
        rec = record_base + WORK_RECORD_WORDS * np.uint32(stage)
        w0 = w1 = w2 = w3 = np.int64(0)
        if lane == 0:
            w0, w1, w2, w3 = np.int64(bars[rec]), np.int64(bars[rec + 1]), np.int64(bars[rec + 2]), np.int64(bars[rec + 3])
        warp = np.uint32(0xFFFFFFFF)
        return unpack_work_record(np.uint64(cuda.shfl_sync(warp, w0, 0)), np.uint64(cuda.shfl_sync(warp, w1, 0)),
                                  np.uint64(cuda.shfl_sync(warp, w2, 0)), np.uint64(cuda.shfl_sync(warp, w3, 0)))

    @inline_device
    def next_stage(stage, phase):
        """Stage and phase after ``stage``: one definition, so the producer and every consumer walk the ring alike."""
        stage = type(stage)(stage + 1)   # type(): the caller's width (numba widens 32-bit arithmetic to 64)
        if stage == stages:
            stage = type(stage)(0)
            phase = type(phase)(phase ^ 1)
        return stage, phase

    @inline_device
    def multicast_scale_bands(dst, scale_map, sf_row, band, bands, rank, full):
        """A pair's scale bands of one operand into both CTAs' stage at ``dst``: with two bands or more each CTA
        loads band ``band + rank``, a single band CTA 0 loads, none nothing (``bands`` is a constant)."""
        if bands > 1:
            cp.tma_load_3d_multicast(dst + rank * sf_band_bytes, scale_map, 0, sf_row, band + rank, full,
                                     MULTICAST_PAIR)
        elif bands == 1 and rank == 0:
            cp.tma_load_3d_multicast(dst, scale_map, 0, sf_row, band, full, MULTICAST_PAIR)

    @inline_device
    def produce(dyn, bars, tensor_maps, a_offsets, a_scale_offsets, expert_ids, shared_offsets,
                shared_expert_ids, n, k_slices, max_tiles, split_counters, k_splits, slices_per_split):
        first_thread = cuda.threadIdx.x == 0
        # shared-window addresses as signed int64 (numba turns uint64 + int64 into float64)
        base = np.int64(cm.shared_address(dyn))
        bar0 = np.int64(cm.shared_address(bars))
        if first_thread:
            trap_if_nonzero(base % DYNAMIC_SMEM_ALIGN)   # TMA swizzle needs it: fail loudly
            for s in range(stages):
                mb.mbarrier_init(bar0 + MBARRIER_BYTES * s, 1)                      # full[s]
                mb.mbarrier_init(bar0 + MBARRIER_BYTES * (stages + s), empty_count)  # empty[s]
            cm.fence_mbarrier_init_release_cluster()
            cm.fence_proxy_async_shared_cta()
        block_sync()
        rank, pair, num_pairs = cta_position()
        walk_offsets, walk_expert_ids = routing_views(a_offsets, expert_ids, shared_offsets, shared_expert_ids)
        if first_thread:
            traced = trace_begin(tensor_maps, TRACE_BARRIERS, True)   # the trace's pending events (trace builds)
            # every acquire first, then every prefetch: ptxas puts a full DEPBAR before each acquire
            # (UTMACCTL.IV), which would otherwise wait for the previous map's prefetch round trip
            for i in range(NUM_TENSOR_MAPS):
                cp.fence_proxy_tensormap_acquire_sys(tensor_maps + np.uint64(cp.TENSOR_MAP_BYTES * i))
            for i in range(NUM_TENSOR_MAPS):
                cp.prefetch_tensormap(tensor_maps + np.uint64(cp.TENSOR_MAP_BYTES * i))
            traced = trace_stamp(tensor_maps, TRACE_MAPS, traced)
            map_tokens, map_weights = tensor_maps + MAP_TOKENS, tensor_maps + MAP_WEIGHTS
            map_token_sf, map_weight_sf = tensor_maps + MAP_TOKEN_SCALES, tensor_maps + MAP_WEIGHT_SCALES
            weight_bands_per_expert = (n + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS
            # tiled weights' boxes per expert, N and K padded to whole boxes (E2M1H200TiledOrder.padded_shape)
            weight_row_tiles = (n + TILED_BOX_ROWS - 1) // TILED_BOX_ROWS
            weight_k_boxes = (k_slices * w_slice_bytes + TILED_BOX_BYTES - 1) // TILED_BOX_BYTES
            stage = np.int64(0)
            phase = np.int64(0)
            cursor_slot = np.uint32(0)
            cursor_first = np.uint32(0)
            counter = split_counters.shape[0] - SCHEDULE_COUNTER_WORDS
            work = pair   # a while loop: range() with a run-time step divides (a 64-bit division call)
            while work < max_tiles * k_splits:
                slot, expert, tile, t0, t1, r0, r1, s_begin, cursor_slot, cursor_first = next_work(
                    work, cursor_slot, cursor_first, walk_offsets, walk_expert_ids, n, k_splits, slices_per_split)
                traced = trace_stamp(tensor_maps, TRACE_PRODUCER_WORK, traced)
                if slot < 0:
                    break
                group_start = np.int64(walk_offsets[slot])
                t_own = t0 + rank * TILE_M_ROWS if shares_weights else t0   # the CTA's own token rows
                token_band = token_band_of(group_start, np.int64(a_scale_offsets[slot]), t_own)
                w_row0 = r0 + rank * TILE_M_ROWS if swapped else r0
                w_band = weight_band_of(expert, weight_bands_per_expert, w_row0)
                for s in range(s_begin, min(s_begin + slices_per_split, k_slices)):
                    full = np.uint32(bar0 + MBARRIER_BYTES * stage)
                    empty = np.uint32(full + MBARRIER_BYTES * stages)
                    if shares_tokens:   # the peer's consumers released it too (cluster acquire)
                        wait_parity_cluster_or_trap(empty, phase ^ 1)
                    else:
                        wait_parity_or_trap(empty, phase ^ 1)
                    traced = trace_stamp(tensor_maps, TRACE_FIRST_SLOT, traced)
                    if s == s_begin:   # before the arrival that releases it
                        write_work_record(bars, stage, np.uint32(expert), np.uint32(tile), np.uint32(t0),
                                          np.uint32(t1), np.uint32(r0), np.uint32(r1), np.uint32(s_begin),
                                          np.uint32(group_start))
                    mb.mbarrier_arrive_expect_tx(full, tx_bytes)
                    dst = np.uint32(base + stage * stage_bytes)
                    sf_row = s * sf_rows_per_slice   # atoms of slice s, as rows of the scale maps
                    k_byte = s * w_slice_bytes
                    if shares_weights:   # each CTA loads its half of the weights for both
                        cp.tma_load_3d_multicast(dst + w_data_off + rank * w_box_bytes, map_weights, k_byte,
                                                 w_row0 + rank * w_box_rows, expert, full, MULTICAST_PAIR)
                        multicast_scale_bands(dst + w_sf_off, map_weight_sf, sf_row, w_band, w_bands, rank, full)
                    elif tiled:
                        for p in range(tiled_loads):
                            w_row = tiled_row_of(np.int64(expert), w_row0 + p * TILED_BOX_ROWS, k_byte,
                                                 weight_row_tiles, weight_k_boxes, chunk_rows)
                            cp.tma_load_2d(dst + w_data_off + p * tiled_part_bytes, map_weights,
                                           k_byte % TILED_BOX_BYTES, w_row, full)
                    else:
                        cp.tma_load_3d(dst + w_data_off, map_weights, k_byte, w_row0, expert, full)
                    for b in range(0 if shares_weights else w_bands):
                        if fused:   # the atoms after the box of band b's rows; W4A8: after the other half's
                            chunk = tiled_row_of(np.int64(expert), (w_row0 // TILED_BOX_ROWS + b) * TILED_BOX_ROWS,
                                                 k_byte, weight_row_tiles, weight_k_boxes, chunk_rows)
                            cp.tma_load_2d(dst + w_sf_off + b * sf_band_bytes, map_weight_sf, 0,
                                           chunk + TILED_BOX_ROWS + k_byte % TILED_BOX_BYTES // w_slice_bytes
                                           * sf_rows_per_slice, full)
                        else:
                            cp.tma_load_3d(dst + w_sf_off + b * sf_band_bytes, map_weight_sf, 0, sf_row,
                                           w_band + b, full)
                    if shares_tokens:   # each CTA loads its half of the tokens for both
                        for p in range(tok_boxes):
                            cp.tma_load_2d_multicast(dst + tok_data_off + p * tok_region_bytes + rank * tok_box_bytes,
                                                     map_tokens, s * tok_slice_bytes + p * tok_box_row_bytes,
                                                     t0 + rank * tok_box_rows, full, MULTICAST_PAIR)
                        multicast_scale_bands(dst + tok_sf_off, map_token_sf, sf_row, token_band, tok_bands, rank,
                                              full)
                    else:
                        for p in range(tok_boxes):   # rows wider than 128 bytes: a box per region
                            cp.tma_load_2d(dst + tok_data_off + p * tok_region_bytes, map_tokens,
                                           s * tok_slice_bytes + p * tok_box_row_bytes, t_own, full)
                        for b in range(tok_bands):
                            cp.tma_load_3d(dst + tok_sf_off + b * sf_band_bytes, map_token_sf, 0, sf_row,
                                           token_band + b, full)
                    traced = trace_stamp(tensor_maps, TRACE_FIRST_TMA, traced)
                    stage, phase = next_stage(stage, phase)
                if dynamic_items:   # the ring ahead of the consumers hides the atomic's round trip
                    work = np.int64(cuda.atomic.add(split_counters, counter, np.uint32(1))) + num_pairs
                else:
                    work += num_pairs
            # no more work: a record that says so, armed with no bytes
            full = np.uint32(bar0 + MBARRIER_BYTES * stage)
            empty = np.uint32(full + MBARRIER_BYTES * stages)
            if shares_tokens:
                wait_parity_cluster_or_trap(empty, phase ^ 1)
            else:
                wait_parity_or_trap(empty, phase ^ 1)
            write_work_record(bars, stage, NO_MORE_WORK, np.uint32(0), np.uint32(0), np.uint32(0),
                              np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
            mb.mbarrier_arrive(full)
            if dynamic_items:   # the last producer to finish zeroes the counters for the next launch
                cuda.threadfence()   # this CTA's last take of an item comes before its "done"
                if cuda.atomic.add(split_counters, counter + 1, np.uint32(1)) == np.uint32(num_pairs - 1):
                    split_counters[counter] = np.uint32(0)
                    split_counters[counter + 1] = np.uint32(0)
            trace_stamp(tensor_maps, TRACE_PRODUCER_EXIT, traced)

    return RingDeviceFunctions(copy_routing, cta_position, block_sync, next_work, produce,
                               walk.cta_output_rows, trace, write_work_record, unpack_work_record,
                               read_work_record, next_stage)
