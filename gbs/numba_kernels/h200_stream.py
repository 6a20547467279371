"""The fast H200 (sm_90a) grouped block-scaled matmul, streaming path: the TMA shared-memory ring
(``h200_ring``), block scales applied in software, exactly (``h200_decode``), and bf16 ``mma.sync`` on the
tensor cores, fed from registers that every consumer warp decodes itself.

It computes the grouped 1D-1D problem of ``gbs.problem`` (``docs/design/formats.md``) for NVFP4, MXFP4,
MXFP8 (E4M3), MXFP8 E5M2 and W4A8 (MXFP8 tokens x MXFP4 weights) with every legal knob of ``gbs.dispatch``
implemented for real: ``ab_swapped`` True / False, ``mma_bn`` 8..256, ``cta_group`` 1 / 2 and the stage
count. One kernel family, specialised at compile time by ``h200_ring.StreamSpec`` (formats, layouts and knobs)
and cached per spec. It is the decode kernel: there the weight bytes bound the time and each weight is read
once; prefill, where the MMAs do, runs on ``h200_wgmma``. The port and its choices: ``docs/design/h200_port.md``.

Structure (persistent CTAs; the ring's producer fills the stages and writes the work records, see
``h200_ring``):
* The consumers: 4 warps (``mma_bn <= 32``; 8 of 16 rows with ``small_n_warps``, for latency-bound small-N
  tiles) or 8. They do not walk: after the ``full`` wait of an item's first stage they read its record. Each
  owns a ``WM x WN`` part of the CTA's ``128 x mma_bn`` MMA tile (M = weight rows when ``ab_swapped``, else
  tokens; ``consumer_warp_grid``), waits for a full stage, reads raw FP4/FP8 bytes and scale bytes from
  shared memory, decodes them to bf16 times their block scale in registers (``h200_decode.make_side_reader``)
  and issues ``mma.sync.m16n8k16.bf16`` into fp32 register accumulators; then one lane per warp releases the
  stage. After a tile's last slice it multiplies by ``expert_scales[e]`` (and the power of two of the scales'
  pre-bias), rounds to bf16 (RNE) and stores ``C[token, n]`` with predicated 2-byte stores, masked to the
  group's tokens and to N: rows of skipped slots are never written.
* Registers: the 4-warp small-N configs are built for three CTAs per SM (two with 32-token tiles), their
  occupancy hiding the decode's latency; the 8-warp configs of the large-N grid give the producer a whole
  warpgroup and move its registers to the consumers with ``setmaxnreg`` (``CONSUMER_WARPGROUP_REGISTERS``).
  Prefetching configs (small N) load the next group's words while decoding the current one, in unrolled
  rotation runs with per-thread column tables.
* Decoded-token slots (``StreamSpec.predecoded_tokens``: swapped configs with at most 32 token columns, the
  decode regime): after the ``full`` wait the consumer warps decode the stage's token slice ONCE, together
  (items of up to a rotation run of one row's quad-lane quarter: ``token_decode_groups``, one scale load per
  item), into bf16 B fragments (scaled) in one of two shared slots, meet at a named barrier, and then each
  reads a group's fragments with one 16-byte load (token rows past the tile's tokens are skipped: they only
  feed accumulator columns that are never stored); wider token tiles decode their tokens in registers, per
  warp.
* Split-K (``StreamSpec.split_k``, its own build): with fewer tiles than resident CTAs, each tile's K slices
  are cut into runs taken by different CTAs (the ring's work items); runs add fp32 partial tiles into a
  zeroed workspace (``red.global.add.f32``, which flushes fp32 subnormal partials to zero), the last run of a
  tile (a counter) reads the sums back (all its loads in flight at once: evidence: split-take-loads), rounds
  and stores, zeroes the words it read and resets the counter: the workspace is zero again after every launch.
* ``cta_group = 2``: a cluster of two CTAs covers ``2 x 128`` weight rows that share one token tile (the
  ring multicasts the token rows); every consumer warp releases a stage on the ``empty`` barriers of both
  CTAs, and no CTA of a pair exits while its peer may still multicast or arrive.
* The start-up trace (``StreamSpec.trace``, ``h200_trace``) stamps the consumers' events with one hook call
  each; untraced builds compile them to nothing.

Cost, from the SASS (ptxas 13.5, decode config NVFP4 swapped ``mma_bn`` 8, 2 stages, 3 CTAs per SM): one
8-element group of a consumer warp (32 weight rows x 8 elements = 512 B of FP4 weights) is ~90
instructions: 4 LDS for the weights and one LDS.128 for the decoded token fragments, 16 registers decoded at
~3 instructions each, 16 HMUL2.BF16 for the scales, 4 PRMT (NVFP4 block-scale selection), 4 HMMA and one LOP3
per address (358 instructions per rotation run of 4 groups). Per stage add the token decode (a quarter of it
per warp), the scale conversion and a named barrier (~20 % on top). By ncu the kernel is instruction-bound,
not memory-bound (evidence: decode-ncu-run9). Weights re-laid once in ``gbs.layouts.E2M1H200Order``
(``b_layout`` "e2m1_h200") decode in 9 instead of 13 integer instructions per word (294 per run),
bit-identical (evidence: h200-weight-order); FP4 tokens in that order (``a_layout``) take the same decode. Tiled weights (``gbs.layouts.E2M1H200TiledOrder``:
each stage's 128 rows x 128 B box is 16 KB of contiguous memory; only the producer's load changes) stream
faster for NVFP4 (evidence: tiled-weight-layout); weights fused with their scales
(``gbs.layouts.E2M1H200FusedOrder``: each box followed by its K slice's scale atoms, so a stage's weight bytes
are one contiguous chunk) stream fastest for both FP4 formats (evidence: fused-weight-layout). FP8 decodes
twice the bytes per instruction.

Constraints (``check_can_implement``): the ring's (``h200_ring``): K a multiple of the K slice (256 elements
when both operands are FP4, else 128; pad K with zero elements otherwise), 16-byte aligned device arrays,
the ring's real shared-memory bytes within the H200's 227 KiB per block, tiled weights in whole boxes.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from gbs.formats import SF_ATOM_COLS, SF_ATOM_ROWS, SF_LANE_BYTES
from gbs.numba_kernels.h200_decode import (NEG_ZERO_BF16X2, QUAD, ROTATION_RUN, group_column, inline_device,
                                           make_side_reader, rotated_group, scale_selector_run_step,
                                           scale_word_column, swizzle_xor)
from gbs.numba_kernels.h200_ring import (CONSUMER_BARRIER, CONSUMER_WAIT, DYNAMIC_SMEM_ALIGN, MBARRIER_BYTES,
                                         ROUTING_SMEM_SLOTS, TILE_M_ROWS, WARP_SIZE, StreamSpec, make_ring)
from gbs.numba_kernels.h200_trace import (TRACE_CONSUMER_EXIT, TRACE_CONSUMER_READY, TRACE_ENTRY,
                                          TRACE_FIRST_EPILOGUE, TRACE_FIRST_FULL, TRACE_FIRST_RELEASE)
from gbs.numba_kernels.simt import scale_byte_offset
from gbs.ptx_inline import cluster as cl
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline.arith import f32_to_bf16_bits, fma_bf16x2
from gbs.ptx_inline.shared import ld_shared_u32, ld_shared_v2_u32, ld_shared_v4_u32, st_shared_v4_u32

# What StreamConfig and the host side at the end of this module read (both are being replaced by gbs.plan and
# h200_launch; these imports go with them).
import dataclasses
import functools
import math
from dataclasses import dataclass

from numba.cuda.cudadrv.driver import device_memset

from gbs import schedule
from gbs.dispatch import AUTO_STAGES, H200_SMEM_PER_SM, KernelConfig, pipeline_smem_terms, require_int
from gbs.formats import BF16, UE8M0_BIAS, get_format
from gbs.numba_kernels import launch
from gbs.numba_kernels.h200_decode import BF16_EXPONENT_MAX, ELEMENT_LOG2_OFFSET, SCALE_LOG2_PREBIAS
from gbs.numba_kernels.h200_ring import (
    ATOM_MAP_ROWS, CONSUMER_WARPS_SMALL_N, K_SLICE_BYTES, REGISTER_ALLOC_STEP, SCALE_MAP_ROW_BYTES,
    SCHEDULE_COUNTER_WORDS, SM90, SM90_REGISTERS_PER_SM, SM90_SMEM_PER_SM, SM90_SUBPARTITIONS, SM90_THREADS_PER_SM,
    TILED_BOX_BYTES, TILED_BOX_ROWS, TMA_SWIZZLE, _align, kernel_signature, require_small_n_warps)
from gbs.numba_kernels.h200_trace import (TRACE_CONSUMER_CHAIN, TRACE_EVENTS, TRACE_FIRST_TMA,
                                          TRACE_PRODUCER_CHAIN, TRACE_PRODUCER_EXIT, TRACE_RECORD_WORDS)
from gbs.problem import PROBLEM_FORMATS, GroupedProblem, check_layout, layout_of
from gbs.ptx_inline import copy as cp
from gbs.reference import poison_output

# ----------------------------------------------------------------------------------------------
# Constants of this kernel (the ring's and the decode's are in h200_ring, h200_decode)
# ----------------------------------------------------------------------------------------------
MMA_M, MMA_N = 16, 8           # mma.sync.m16n8k16
# With 8 consumer warps a lone producer warp would make 9 warps, and ptxas caps every thread at 168
# registers (3 warps on one SM sub-partition): the 64-128 fp32 accumulators then spill. Instead the
# producer gets a whole warpgroup (warp 0 issues, warps 1-3 idle) and setmaxnreg moves registers
# between warpgroups. It only redistributes the CTA's launch allocation (384 threads x 168), so
# 4 x 32 x 72 + 8 x 32 x 216 = 64512 exactly (more and setmaxnreg.inc would wait forever). The
# producer's tile walk spills below ~64; the mma_bn = 256 consumers (128 accumulators) fit in 216.
LAUNCH_BOUND_REGISTERS = 168   # ptxas's per-thread allocation for launch bounds (384, 1)
PRODUCER_WARPGROUP_REGISTERS = 72
CONSUMER_WARPGROUP_REGISTERS = 216
FRAGMENT_WORDS = 4             # one group's B fragments of one token row: (b0, b1) of both k16 steps
FRAGMENT_BYTES = 4 * FRAGMENT_WORDS
# Split-K runs (``choose_k_splits``) of at least this many K slices: shorter runs are mostly pipeline fill
# and epilogue (evidence: stream-split-k).
MIN_SLICES_PER_SPLIT = 6


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamConfig:
    """The knobs this kernel takes: ``gbs.dispatch`` legality (``TileConfig``) plus a stage count
    (``AUTO_STAGES`` = the deepest ring that fits the H200) and, an H200-only knob, the consumer warps
    of a small-N tile (``SMALL_N_WARP_CHOICES``: 4 of 32 rows or 8 of 16; ``StreamSpec`` checks it
    against the tile and the formats)."""

    ab_swapped: bool
    mma_bn: int
    cta_group: int
    num_pipeline_stages: int = AUTO_STAGES
    small_n_warps: int = CONSUMER_WARPS_SMALL_N

    def __post_init__(self):
        tile = schedule.TileConfig(self.ab_swapped, self.mma_bn, self.cta_group)
        object.__setattr__(self, "ab_swapped", tile.ab_swapped)
        object.__setattr__(self, "mma_bn", tile.mma_bn)
        object.__setattr__(self, "cta_group", tile.cta_group)
        stages = self.num_pipeline_stages
        if isinstance(stages, (bool, np.bool_)) or not isinstance(stages, (int, np.integer)):
            raise TypeError(f"num_pipeline_stages must be an int, got {stages!r}")
        if stages < 1 and stages != AUTO_STAGES:
            raise ValueError(f"num_pipeline_stages must be >= 1 or {AUTO_STAGES} (auto), got {stages}")
        object.__setattr__(self, "num_pipeline_stages", int(stages))
        object.__setattr__(self, "small_n_warps", require_small_n_warps(self.small_n_warps))

    @classmethod
    def of(cls, config) -> "StreamConfig":
        """A ``StreamConfig`` from a ``KernelConfig`` (its stages), a ``StreamConfig``, a
        ``schedule.TileConfig`` (auto stages) or anything with those attributes (4 small-N warps
        unless it says otherwise)."""
        if isinstance(config, cls):
            return config
        tile = schedule.TileConfig.of(config)   # TypeError naming what the config lacks
        return cls(tile.ab_swapped, tile.mma_bn, tile.cta_group, getattr(config, "num_pipeline_stages", AUTO_STAGES),
                   getattr(config, "small_n_warps", CONSUMER_WARPS_SMALL_N))


# ----------------------------------------------------------------------------------------------
# Device helpers of the decoded-token slots and the scale rows (integer Python, also device functions)
# ----------------------------------------------------------------------------------------------
def decoded_token_offset(row, q, gl, groups):
    """Byte offset, in a decoded-token slot, of the 4 B-fragment words of token ``row``, quad lane
    ``q`` and local group ``gl`` (rows of ``QUAD * groups`` 16-byte chunks). Odd rows flip the
    chunk index (bit 2 with 8 groups, bit 0 with 4) so that the 8 lanes of one phase of a 16-byte
    load (rows g, g + 1 x quad lanes 0..3, each at its rotated group) hit 8 different 16-byte bank
    groups (32-bit)."""
    flip = np.uint32(ROTATION_RUN if groups > ROTATION_RUN else 1)
    chunk = np.uint32(np.uint32(q * groups) + np.uint32(gl)) ^ np.uint32(np.uint32(row & 1) * flip)
    return np.uint32(np.uint32(row * (QUAD * groups * FRAGMENT_BYTES)) + chunk * np.uint32(FRAGMENT_BYTES))


def token_decode_item(item, chunks, groups):
    """(token row, quad lane, first local group) of item ``item`` of the cooperative token decode: the
    row's quarter of quad lane ``q`` cut into ``chunks`` runs of ``groups`` consecutive groups, chunks
    fastest, so the 8 lanes of one 16-byte load phase read one row's 8 chunks (distinct banks)."""
    chunk = item % chunks
    return item // (QUAD * chunks), (item // chunks) % QUAD, chunk * groups


def scale_row_step(i):
    """``scale_byte_offset(g + 8 i, ...) - scale_byte_offset(g, ...)`` for any g < 8 with row g on a
    32-row boundary of its 128-row atom: 16 bytes per row inside a 32-row block, 4 per block. Also for
    row g 16 rows past such a boundary when i < 2 (the 16-row warps of ``small_n_warps`` = 8): rows g
    and g + 8 then stay in the block."""
    return SF_LANE_BYTES * 8 * (i % 4) + SF_ATOM_COLS * (i // 4)



# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
def make_kernel_function(spec: StreamSpec):
    """The kernel as a Python function (closure over ``spec``), for ``cuda.jit`` or an offline
    compile; built fresh on every call (fresh device functions, see ``schedule.device_functions``). Its
    consumers take their work from the producer's records."""
    if spec.m_rows != TILE_M_ROWS or spec.warpgroup_consumers:
        raise ValueError(f"this kernel's consumers take {TILE_M_ROWS} M rows on their own warp grid (m_rows="
                         f"{spec.m_rows}, warpgroup_consumers={spec.warpgroup_consumers}: the wgmma kernel's ring)")
    ring = make_ring(spec)   # numba reads device functions from plain names, not attributes
    copy_routing, cta_position, read_work_record = ring.copy_routing, ring.cta_position, ring.read_work_record
    block_sync, produce, cta_output_rows = ring.block_sync, ring.produce, ring.cta_output_rows
    trace_begin, trace_stamp = ring.trace.begin, ring.trace.stamp   # the start-up trace's hooks (h200_trace)
    shape = spec.tile_shape
    tile_rows = shape.weight_rows
    cta_group, stages, swapped = spec.cta_group, spec.stages, spec.ab_swapped
    m_side, n_side, lay = spec.m_side, spec.n_side, spec.smem
    stage_bytes = lay.stage_bytes
    m_data_off, n_data_off, m_sf_off, n_sf_off = lay.m_data, lay.n_data, lay.m_scales, lay.n_scales
    atoms = m_side.sf_atoms_per_slice
    wm_warps, _ = spec.warp_grid
    warp_rows, warp_cols = spec.warp_tile
    m_tiles, n_tiles = warp_rows // MMA_M, warp_cols // MMA_N
    m_rows, n_rows = 2 * m_tiles, n_tiles            # rows each thread reads per side
    num_acc = m_tiles * n_tiles * 4
    predecode = spec.predecoded_tokens
    split_k = spec.split_k
    # local-array sizes must be plain constants in numba
    n_row_words = FRAGMENT_WORDS if predecode else 2   # words a thread holds per N row and group
    m_pair_words, n_pair_words, a_frag_words = 2 * m_rows, n_row_words * n_rows, 4 * m_tiles
    m_buffer_words, n_buffer_words = 2 * m_pair_words, 2 * n_pair_words   # two groups' words
    groups = m_side.groups
    consumer_threads = WARP_SIZE * spec.consumer_warps
    decoded_off = lay.decoded_tokens
    decoded_slot_bytes = lay.decoded_token_slot_bytes
    n_groups = n_side.groups
    item_groups = spec.token_decode_groups
    item_chunks = n_groups // item_groups
    decode_items = n_side.rows * QUAD * item_chunks // consumer_threads   # (row, quad lane, groups) per thread
    item_bytes = item_groups * n_side.group_bytes
    item_words = item_bytes // 4
    piece_groups = 16 // n_side.group_bytes if item_bytes >= 16 else item_groups   # groups per 16-byte load
    decoded_row_bytes = QUAD * n_groups * FRAGMENT_BYTES
    decoded_offset = inline_device(decoded_token_offset)
    token_item = inline_device(token_decode_item)
    sf_row_step = inline_device(scale_row_step)
    n_group_words = n_side.group_bytes // 4
    m_load, m_decode, m_load_scales, m_selector, m_group_scale = make_side_reader(m_side, spec.pairing)
    n_load, n_decode, n_load_scales, n_selector, n_group_scale = make_side_reader(n_side, spec.pairing)
    m_sel_step, n_sel_step = scale_selector_run_step(m_side), scale_selector_run_step(n_side)
    outer_trips, inner_trips = (groups // ROTATION_RUN, ROTATION_RUN) if spec.prefetch_groups else (groups, 1)
    # Column XOR of one rotation run (see the group loop): 4 groups of data, 4 decoded fragments.
    m_run_bytes = ROTATION_RUN * m_side.group_bytes
    n_run_bytes = ROTATION_RUN * (FRAGMENT_BYTES if spec.predecoded_tokens else n_side.group_bytes)
    m_blocks, n_blocks = m_side.blocks_per_thread, n_side.blocks_per_thread
    m_row_bytes, n_row_bytes = m_side.row_bytes, n_side.row_bytes
    m_mask, n_mask = m_side.swizzle_mask, n_side.swizzle_mask
    m_thread_bytes, n_thread_bytes = m_side.thread_bytes, n_side.thread_bytes
    m_group_bytes, n_group_bytes = m_side.group_bytes, n_side.group_bytes
    epilogue_scale = np.float32(2.0 ** spec.epilogue_log2)
    producer_warps, uses_setmaxnreg = spec.producer_warps, spec.uses_setmaxnreg
    producer_regs = hp.setmaxnreg_dec(PRODUCER_WARPGROUP_REGISTERS)
    consumer_regs = hp.setmaxnreg_inc(CONSUMER_WARPGROUP_REGISTERS)
    num_barriers = 2 * stages
    barrier_words = lay.barrier_words   # a plain constant for cuda.shared.array
    routing_offset_words = ROUTING_SMEM_SLOTS + 1
    sf_offset = inline_device(scale_byte_offset)
    rotated = inline_device(rotated_group)
    swizzle = inline_device(swizzle_xor)
    word_column = inline_device(scale_word_column)
    column = inline_device(group_column)
    prefetch = spec.prefetch_groups

    @inline_device
    def acc_position(m_row_base, n_col_base, mi, nj, i, t0, r0, row_lo):
        """(token, weight row) of the thread's accumulator ``i`` of MMA tile (mi, nj): mma.sync's
        accumulator i sits at row g + 8 (i // 2), column 2 q + i % 2 of the 16 x 8 tile."""
        m_row = m_row_base + MMA_M * mi + 8 * (i // 2)
        n_col = n_col_base + MMA_N * nj + i % 2
        if swapped:
            return t0 + n_col, row_lo + m_row
        return t0 + m_row, r0 + n_col

    def grouped_matmul_h200_stream(tensor_maps, a_offsets, a_scale_offsets, expert_ids, expert_scales,
                                   out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                                   slices_per_split):
        dyn = cuda.shared.array(0, dtype=np.uint8, alignment=DYNAMIC_SMEM_ALIGN)
        bars = cuda.shared.array(barrier_words, dtype=np.uint64)
        shared_offsets = cuda.shared.array(routing_offset_words, dtype=np.uint32)
        shared_expert_ids = cuda.shared.array(ROUTING_SMEM_SLOTS, dtype=np.int32)
        trace_begin(tensor_maps, TRACE_ENTRY, cuda.threadIdx.x == 0)
        copy_routing(a_offsets, expert_ids, shared_offsets, shared_expert_ids)
        warp = cm.warp_index()
        # Each role's branch starts with setmaxnreg (ptxas budgets the code it dominates) and
        # computes everything it needs after it, so nothing stays live across the re-allocation.
        if warp < producer_warps:
            # ------------------------------------------------------------------ producer
            if uses_setmaxnreg:
                producer_regs()
            produce(dyn, bars, tensor_maps, a_offsets, a_scale_offsets, expert_ids, shared_offsets, shared_expert_ids,
                    n, k_slices, max_tiles, split_counters, k_splits, slices_per_split)
            cuda.syncwarp()
        else:
            # ------------------------------------------------------------------ consumers
            if uses_setmaxnreg:
                consumer_regs()
            block_sync()   # the mbarriers are initialised
            lane = cm.laneid()
            base = np.int64(cm.shared_address(dyn))
            bar0 = np.int64(cm.shared_address(bars))
            rank, _, _ = cta_position()
            cw = warp - producer_warps
            warp_m = cw % wm_warps
            warp_n = cw // wm_warps
            g = lane >> 2
            q = lane & 3
            m_row_base = warp_m * warp_rows + g
            n_row_base = warp_n * warp_cols + g
            n_col_base = warp_n * warp_cols + 2 * q
            out_address = np.int64(cm.generic_address(out))
            # swizzle XOR of the thread's rows (rows g + 8 i share it) and its first scale column
            m_xor = np.uint32(swizzle(m_row_base, m_row_bytes, m_mask))
            n_xor = np.uint32(swizzle(n_row_base, n_row_bytes, n_mask))
            m_row_addr = np.uint32(m_data_off + m_row_base * m_row_bytes)   # stage-relative
            n_row_addr = np.uint32(n_data_off + n_row_base * n_row_bytes)
            m_col = word_column(q, m_blocks)
            n_col = word_column(q, n_blocks)
            acc = cuda.local.array(num_acc, float32)
            m_sc = cuda.local.array(m_pair_words, np.uint32)
            n_sc = cuda.local.array(n_pair_words, np.uint32)
            m_gs = cuda.local.array(m_rows, np.uint32)
            m_w = cuda.local.array(m_buffer_words, np.uint32)   # two groups' words (see the group loop)
            n_w = cuda.local.array(n_buffer_words, np.uint32)
            a_frag = cuda.local.array(a_frag_words, np.uint32)
            d_words = cuda.local.array(item_words, np.uint32)   # one token-decode item's raw words
            consumer_tid = cw * WARP_SIZE + lane
            # per thread, loop-invariant: columns and UE4M3 scale selectors of its run-0 groups
            m_col0 = cuda.local.array(ROTATION_RUN, np.uint32)
            n_col0 = cuda.local.array(ROTATION_RUN, np.uint32)
            m_sel0 = cuda.local.array(ROTATION_RUN, np.uint32)
            n_sel0 = cuda.local.array(ROTATION_RUN, np.uint32)
            for c in range(ROTATION_RUN):
                gl0 = rotated(c, q)
                m_col0[c] = column(q, gl0, m_thread_bytes, m_group_bytes, m_xor)
                if predecode:
                    n_col0[c] = decoded_offset(n_row_base, q, gl0, n_groups)
                else:
                    n_col0[c] = column(q, gl0, n_thread_bytes, n_group_bytes, n_xor)
                m_sel0[c] = m_selector(gl0)
                n_sel0[c] = n_selector(gl0)
            decoded_slot = np.uint32(0)   # which decoded-token slot this stage uses (alternates)
            stage = np.uint32(0)   # 32-bit: numba widens uint32 arithmetic, so every update casts back
            phase = np.uint32(0)
            traced = trace_begin(tensor_maps, TRACE_CONSUMER_READY, cw == 0 and lane == 0)   # lane 0 of warp 0 stamps
            # one work item per pass, as the producer's records say; the bound is never reached first (a record
            # ends the loop) but keeps the loop warp-uniform for ptxas: with `while True` it moved the decoded
            # slot's base out of a uniform register and the K-slice loop grew by 7 instructions (NVFP4 bn8)
            item = np.int64(0)
            while item < max_tiles * k_splits:
                CONSUMER_WAIT(np.uint32(np.uint32(bar0) + np.uint32(MBARRIER_BYTES * stage)), phase)
                expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
                if expert < 0:
                    break
                traced = trace_stamp(tensor_maps, TRACE_FIRST_FULL, traced)
                token_sf_row0 = (t0 - group_start) % SF_ATOM_ROWS
                if swapped:
                    m_sf_row0 = np.int64(0)
                    n_sf_row0 = token_sf_row0
                else:
                    m_sf_row0 = token_sf_row0
                    n_sf_row0 = r0 % SF_ATOM_ROWS
                for mi in range(m_tiles):   # nested like the MMA loops, so NVVM unrolls it fully
                    for nj in range(n_tiles):
                        for i in range(4):
                            acc[4 * (mi * n_tiles + nj) + i] = float32(0.0)
                # the thread's rows g + 8 i lie in one 128-row atom, at a fixed distance from row g (when
                # the tile starts on a 32-row boundary: swapped, weights on M): one base per tile
                m_sf_first = np.uint32(m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row_base), m_col, atoms))
                for _ in range(np.int32(min(slices_per_split, k_slices - s_begin))):   # this run's K slices
                    # (the first slice's phase completed before the record was read: this wait returns at once)
                    CONSUMER_WAIT(np.uint32(np.uint32(bar0) + np.uint32(MBARRIER_BYTES * stage)), phase)
                    st = np.uint32(np.uint32(base) + np.uint32(stage * np.uint32(stage_bytes)))
                    for i in range(m_rows):
                        if swapped:
                            address = np.uint32(st + m_sf_first + np.uint32(sf_row_step(i)))
                        else:
                            row = np.uint32(m_sf_row0 + m_row_base + 8 * i)
                            address = np.uint32(st + m_sf_off + sf_offset(row, m_col, atoms))
                        m_sc[2 * i], m_sc[2 * i + 1] = m_load_scales(address, q)
                    if predecode:
                        # this stage's token slice -> bf16 B fragments (scaled) in a decoded slot
                        dslot = np.uint32(base + decoded_off + decoded_slot * decoded_slot_bytes)
                        for it in range(decode_items):
                            d_row, d_q, d_first = token_item(consumer_tid + it * consumer_threads, item_chunks,
                                                             item_groups)
                            # token columns past the tile's tokens only feed accumulator columns the
                            # epilogue never stores (MMA columns are independent): leave them stale
                            if d_row >= t1 - t0:
                                continue
                            address = np.uint32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + d_row),
                                                                          word_column(d_q, n_blocks), atoms))
                            d_s0, d_s1 = n_load_scales(address, d_q)
                            d_xor = np.uint32(swizzle(d_row, n_row_bytes, n_mask))
                            d_row_addr = np.uint32(st + n_data_off + d_row * n_row_bytes)
                            # the item's words: 16-byte loads of whole (swizzled) chunks where it spans them
                            for piece in range(max(1, item_bytes // 16)):
                                d_addr = d_row_addr + column(d_q, d_first + piece * piece_groups, n_thread_bytes,
                                                             n_group_bytes, d_xor)
                                if item_bytes >= 16:
                                    (d_words[4 * piece], d_words[4 * piece + 1], d_words[4 * piece + 2],
                                     d_words[4 * piece + 3]) = ld_shared_v4_u32(d_addr)
                                elif item_bytes == 8:
                                    d_words[0], d_words[1] = ld_shared_v2_u32(d_addr)
                                else:
                                    d_words[0] = ld_shared_u32(d_addr)
                            for c in range(item_groups):
                                d_gl = d_first + c
                                d_scale = n_group_scale(d_s0, d_s1, n_selector(d_gl), d_gl // ROTATION_RUN)
                                d_w0 = d_words[c * n_group_words]
                                d_w1 = d_words[c * n_group_words + n_group_words - 1]   # FP8: the group's 2nd word
                                st_shared_v4_u32(dslot + decoded_offset(d_row, d_q, d_gl, n_groups),
                                                 fma_bf16x2(n_decode(d_w0, d_w1, 0), d_scale, NEG_ZERO_BF16X2),
                                                 fma_bf16x2(n_decode(d_w0, d_w1, 1), d_scale, NEG_ZERO_BF16X2),
                                                 fma_bf16x2(n_decode(d_w0, d_w1, 2), d_scale, NEG_ZERO_BF16X2),
                                                 fma_bf16x2(n_decode(d_w0, d_w1, 3), d_scale, NEG_ZERO_BF16X2))
                        cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                    else:
                        for j in range(n_rows):
                            row = np.uint32(n_sf_row0 + n_row_base + 8 * j)
                            address = np.uint32(st + n_sf_off + sf_offset(row, n_col, atoms))
                            n_sc[2 * j], n_sc[2 * j + 1] = n_load_scales(address, q)
                    # Group gi = ROTATION_RUN * run + c sits at column ``col0[c] ^ run * run_bytes`` of
                    # the thread's rows (its rotated group in the first run, moved by whole runs: disjoint
                    # bits, so XOR); the row bases are multiples of the row bytes, so OR adds them.
                    st_m = np.uint32(st + m_row_addr)
                    if predecode:
                        st_n = dslot
                    else:
                        st_n = np.uint32(st + n_row_addr)
                    for i in range(m_rows):   # group 0's words; each group then prefetches the next's
                        m_w[2 * i], m_w[2 * i + 1] = m_load((st_m | m_col0[0]) + 8 * i * m_row_bytes)
                    if predecode:
                        for j in range(n_rows):
                            (n_w[4 * j], n_w[4 * j + 1], n_w[4 * j + 2], n_w[4 * j + 3]) = ld_shared_v4_u32(
                                st_n + n_col0[0] + 8 * j * decoded_row_bytes)
                    elif prefetch:
                        for j in range(n_rows):
                            n_w[2 * j], n_w[2 * j + 1] = n_load((st_n | n_col0[0]) + 8 * j * n_row_bytes)
                    # Prefetching (4-warp) configs: runs of ROTATION_RUN unrolled groups. The 8-warp
                    # configs, at their register budget, walk the groups one at a time (outer loop).
                    for run in range(np.int32(outer_trips)):   # 32-bit loop counter
                        m_run, n_run = np.uint32(run * m_run_bytes), np.uint32(run * n_run_bytes)
                        m_sel_run, n_sel_run = np.uint32(run * m_sel_step), np.uint32(run * n_sel_step)
                        for c in range(inner_trips):
                            if prefetch:   # groups alternate the two word buffers: no copies
                                group_run = run
                                m_sel, n_sel = m_sel0[c] + m_sel_run, n_sel0[c] + n_sel_run
                                cur_m, cur_n = (c % 2) * m_pair_words, (c % 2) * n_pair_words
                                nxt_m, nxt_n = (1 - c % 2) * m_pair_words, (1 - c % 2) * n_pair_words
                                # the next group: c + 1 of this run, or c = 0 of the next run (after the
                                # last run: another in-row column, loaded and unused)
                                if c < ROTATION_RUN - 1:
                                    m_next = st_m | (m_col0[c + 1] ^ m_run)
                                    n_next = n_col0[c + 1] ^ n_run
                                else:
                                    m_next = st_m | (m_col0[0] ^ np.uint32(m_run + m_run_bytes))
                                    n_next = n_col0[0] ^ np.uint32(n_run + n_run_bytes)
                                for i in range(m_rows):
                                    m_w[nxt_m + 2 * i], m_w[nxt_m + 2 * i + 1] = m_load(m_next + 8 * i * m_row_bytes)
                                for j in range(n_rows):
                                    if predecode:
                                        (n_w[nxt_n + 4 * j], n_w[nxt_n + 4 * j + 1], n_w[nxt_n + 4 * j + 2],
                                         n_w[nxt_n + 4 * j + 3]) = ld_shared_v4_u32(
                                            st_n + n_next + 8 * j * decoded_row_bytes)
                                    else:
                                        n_w[nxt_n + 2 * j], n_w[nxt_n + 2 * j + 1] = n_load(
                                            (st_n | n_next) + 8 * j * n_row_bytes)
                            else:   # literal offsets (computed ones cost the 8-warp configs spills)
                                gi = run
                                group_run = np.uint32(gi) // np.uint32(ROTATION_RUN)
                                cur_m, cur_n = 0, 0
                                gl = rotated(gi, q)
                                m_sel, n_sel = m_selector(gl), n_selector(gl)
                                n_off = st_n | column(q, gl, n_thread_bytes, n_group_bytes, n_xor)
                                if gi > 0:
                                    m_off = st_m | column(q, gl, m_thread_bytes, m_group_bytes, m_xor)
                                    for i in range(m_rows):
                                        m_w[2 * i], m_w[2 * i + 1] = m_load(m_off + 8 * i * m_row_bytes)
                            for i in range(m_rows):
                                m_gs[i] = m_group_scale(m_sc[2 * i], m_sc[2 * i + 1], m_sel, group_run)
                            for step in range(2):
                                for mi in range(m_tiles):
                                    for h in range(2):        # k 2q.. (h = 0) and k 2q+8.. (h = 1)
                                        for rr in range(2):   # rows g (rr = 0) and g + 8 (rr = 1)
                                            i = 2 * mi + rr
                                            a_frag[4 * mi + 2 * h + rr] = fma_bf16x2(
                                                m_decode(m_w[cur_m + 2 * i], m_w[cur_m + 2 * i + 1], 2 * step + h),
                                                m_gs[i], NEG_ZERO_BF16X2)
                                for nj in range(n_tiles):
                                    if predecode:
                                        b0 = n_w[cur_n + 4 * nj + 2 * step]
                                        b1 = n_w[cur_n + 4 * nj + 2 * step + 1]
                                    else:
                                        if prefetch:
                                            n_w0, n_w1 = n_w[cur_n + 2 * nj], n_w[cur_n + 2 * nj + 1]
                                        else:   # N rows just in time (reloaded for step 1): fewer live registers
                                            n_w0, n_w1 = n_load(n_off + 8 * nj * n_row_bytes)
                                        n_scale = n_group_scale(n_sc[2 * nj], n_sc[2 * nj + 1], n_sel, group_run)
                                        b0 = fma_bf16x2(n_decode(n_w0, n_w1, 2 * step), n_scale, NEG_ZERO_BF16X2)
                                        b1 = fma_bf16x2(n_decode(n_w0, n_w1, 2 * step + 1), n_scale,
                                                        NEG_ZERO_BF16X2)
                                    for mi in range(m_tiles):
                                        cc = 4 * (mi * n_tiles + nj)
                                        d = hp.mma_bf16_m16n8k16(
                                            (a_frag[4 * mi], a_frag[4 * mi + 1], a_frag[4 * mi + 2],
                                             a_frag[4 * mi + 3]),
                                            (b0, b1), (acc[cc], acc[cc + 1], acc[cc + 2], acc[cc + 3]))
                                        acc[cc], acc[cc + 1], acc[cc + 2], acc[cc + 3] = d
                    cuda.syncwarp()
                    if lane == 0:
                        empty = np.uint32(np.uint32(bar0) + np.uint32(MBARRIER_BYTES * (stages + stage)))
                        if cta_group > 1:
                            for peer in range(cta_group):
                                mb.mbarrier_arrive_remote_cluster(cl.mapa_shared_cluster(empty, peer))
                        else:
                            mb.mbarrier_arrive(empty)
                    traced = trace_stamp(tensor_maps, TRACE_FIRST_RELEASE, traced)
                    decoded_slot ^= np.uint32(1)
                    stage = np.uint32(stage + np.uint32(1))
                    if stage == np.uint32(stages):
                        stage = np.uint32(0)
                        phase = np.uint32(phase ^ np.uint32(1))
                # epilogue: C[token, row] = bf16(acc * 2**epilogue_log2 * expert_scales[e])
                traced = trace_stamp(tensor_maps, TRACE_FIRST_EPILOGUE, traced)
                out_scale = expert_scales[expert] * epilogue_scale
                row_lo, row_hi = cta_output_rows(r0, r1, rank, cta_group, tile_rows)
                if not split_k:
                    for mi in range(m_tiles):
                        for nj in range(n_tiles):
                            for i in range(4):
                                token, row = acc_position(m_row_base, n_col_base, mi, nj, i, t0, r0, row_lo)
                                value = f32_to_bf16_bits(acc[4 * (mi * n_tiles + nj) + i] * out_scale)
                                cm.store_global_u16_if(out_address + (token * n + row) * 2, value,
                                                       np.uint32((token < t1) & (row < row_hi)))
                else:   # add this run's partial tile; the tile's last run stores the sum
                    sums_address = np.int64(cm.generic_address(split_sums))
                    for mi in range(m_tiles):
                        for nj in range(n_tiles):
                            for i in range(4):
                                token, row = acc_position(m_row_base, n_col_base, mi, nj, i, t0, r0, row_lo)
                                cm.red_add_f32_if(sums_address + (token * n + row) * 4,
                                                  acc[4 * (mi * n_tiles + nj) + i] * out_scale,
                                                  np.uint32((token < t1) & (row < row_hi)))
                    cuda.threadfence()
                    cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                    if consumer_tid == 0:
                        runs_done = cuda.atomic.add(split_counters, tile * cta_group + rank, np.uint32(1))
                        bars[num_barriers] = np.uint64(runs_done == k_splits - 1)
                    cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                    if bars[num_barriers] != 0:   # every run's sums are in: read them all, then round and
                        cuda.threadfence()        # store, leaving zeros (the reads' latencies overlap)
                        for mi in range(m_tiles):
                            for nj in range(n_tiles):
                                for i in range(4):
                                    token, row = acc_position(m_row_base, n_col_base, mi, nj, i, t0, r0, row_lo)
                                    acc[4 * (mi * n_tiles + nj) + i] = cm.load_global_cg_f32_if(
                                        sums_address + (token * n + row) * 4, np.uint32((token < t1) & (row < row_hi)))
                        for mi in range(m_tiles):
                            for nj in range(n_tiles):
                                for i in range(4):
                                    token, row = acc_position(m_row_base, n_col_base, mi, nj, i, t0, r0, row_lo)
                                    valid = np.uint32((token < t1) & (row < row_hi))
                                    cm.store_global_u16_if(out_address + (token * n + row) * 2,
                                                           f32_to_bf16_bits(acc[4 * (mi * n_tiles + nj) + i]), valid)
                                    cm.store_global_cg_zero_u32_if(sums_address + (token * n + row) * 4, valid)
                        if consumer_tid == 0:
                            split_counters[tile * cta_group + rank] = np.uint32(0)
                item += 1
            trace_stamp(tensor_maps, TRACE_CONSUMER_EXIT, traced)
        if cta_group > 1:   # no CTA of a pair exits while its peer may still multicast or arrive
            cl.cluster_arrive_release()
            cl.cluster_wait_acquire()

    return grouped_matmul_h200_stream



# ----------------------------------------------------------------------------------------------
# Host side: checks, stages, tensor maps, prepare and run
# ----------------------------------------------------------------------------------------------
def _problem_formats(problem) -> tuple[str, str]:
    return get_format(problem.a_format).name, get_format(problem.b_format).name


def _spec_for(formats: tuple[str, str], config: StreamConfig, stages: int) -> StreamSpec:
    return StreamSpec(formats[0], formats[1], config.ab_swapped, config.mma_bn, config.cta_group, stages)


def split_spec(spec: StreamSpec, k_splits: int) -> StreamSpec:
    """``spec`` built for ``k_splits`` runs per tile (the split-K epilogue only when > 1)."""
    return dataclasses.replace(spec, split_k=k_splits > 1)


def max_pipeline_stages(a_format: str, b_format: str, config, smem_limit: int = H200_SMEM_PER_SM) -> int:
    """Deepest ring the kernel's REAL shared-memory bytes (``StreamSmemLayout.total_bytes``) allow
    within ``smem_limit`` (0 if not even one stage fits)."""
    config = StreamConfig.of(config)
    spec = _spec_for((get_format(a_format).name, get_format(b_format).name), config, 1)
    stages = 0
    while dataclasses.replace(spec, stages=stages + 1).smem.total_bytes <= smem_limit:
        stages += 1
    return stages


def formula_pipeline_stages(a_format: str, b_format: str, config, smem_limit: int = H200_SMEM_PER_SM) -> int:
    """The spec's stages=auto formula (``gbs.dispatch.auto_pipeline_stages``) with the H200 budget,
    for the report: it counts SM100's bytes (half the token tile per CTA of a pair, FP4 unpacked to
    bytes for W4A8, bf16 output tiles), not this kernel's."""
    config = StreamConfig.of(config)
    spec = _spec_for((get_format(a_format).name, get_format(b_format).name), config, 1)
    num_sf_k_tiles = spec.m_side.sf_atoms_per_slice
    terms = pipeline_smem_terms(mma_bn=config.mma_bn, cta_group=config.cta_group, ab_swapped=config.ab_swapped,
                                num_sf_k_tiles=num_sf_k_tiles, smem_per_sm=smem_limit)
    return terms.stages


def check_config_formats(formats: tuple[str, str], config) -> None:
    """A ``KernelConfig`` must have been decided for the problem's formats (``formats``: the problem's
    (a, b) format names); other configs carry no formats. ValueError naming the mismatch."""
    if not isinstance(config, KernelConfig):
        return
    for side, want in (("a_format", formats[0]), ("b_format", formats[1])):
        got = getattr(config, side)
        # upstream routes no E5M2: its problems run on the E4M3 decision (gbs.api.dispatch_for)
        if got != want and not (want == "mxfp8_e5m2" and got == "mxfp8"):
            raise ValueError(f"config was decided for {side}={got!r} but the problem's {side} is {want!r}")


def check_can_implement(problem, config) -> StreamSpec:
    """Static checks before any device work; returns the resolved ``StreamSpec``.

    ``problem``: a ``GroupedProblem`` or ``launch.DeviceProblem``. ``config``: a ``KernelConfig``
    (its formats must be the problem's; its stage count is taken as is), a ``StreamConfig`` or a
    ``schedule.TileConfig`` (auto stages). TypeError / ValueError saying what is wrong and what is allowed.
    """
    if not isinstance(problem, (GroupedProblem, launch.DeviceProblem)):
        raise TypeError(f"problem must be a GroupedProblem or DeviceProblem, got {type(problem).__name__}")
    if isinstance(problem, GroupedProblem):
        problem.validate()
    formats = _problem_formats(problem)
    if formats not in PROBLEM_FORMATS.values():
        raise ValueError(f"unsupported operand formats A={formats[0]} x B={formats[1]}; supported: "
                         f"{sorted(PROBLEM_FORMATS.values())}")
    check_config_formats(formats, config)
    stream_config = StreamConfig.of(config)
    probe = _spec_for(formats, stream_config, 1)
    k_slice = probe.k_slice
    if problem.k % k_slice:
        kind = "both operands are FP4" if k_slice == 2 * K_SLICE_BYTES else "an operand is FP8"
        raise ValueError(
            f"K={problem.k} is not a multiple of this kernel's {k_slice}-element K slice ({kind}: "
            f"{K_SLICE_BYTES} bytes of every row per pipeline stage); pad K to "
            f"{-(-problem.k // k_slice) * k_slice} with zero elements (zero codes; any scale byte) in A and B")
    for name, row_bytes in (("a", problem.a_format.row_bytes(problem.k)),
                            ("b", problem.b_format.row_bytes(problem.k))):
        if row_bytes % launch.TMA_ADDRESS_ALIGN:
            raise ValueError(f"rows of {name} are {row_bytes} bytes; TMA needs a multiple of "
                             f"{launch.TMA_ADDRESS_ALIGN}")
    real_max = max_pipeline_stages(*formats, stream_config)
    stages = stream_config.num_pipeline_stages
    if stages == AUTO_STAGES:
        stages = real_max
    if not 1 <= stages <= real_max:
        one = probe.smem
        raise ValueError(
            f"{stages} pipeline stages do not fit the H200: this kernel's stage is {one.stage_bytes} B, "
            f"{one.static_bytes} B are static (reserved KiB, mbarriers) and a block may use "
            f"{H200_SMEM_PER_SM} B, so at most {real_max} stages for "
            f"{formats[0]} x {formats[1]}, ab_swapped={stream_config.ab_swapped}, "
            f"mma_bn={stream_config.mma_bn}, cta_group={stream_config.cta_group} (the SM100 formula with the "
            f"H200 budget says {formula_pipeline_stages(*formats, stream_config)}); "
            f"use num_pipeline_stages <= {real_max} or {AUTO_STAGES} (auto)")
    if problem.n >= 2 ** 31 or problem.total_tokens >= 2 ** 31:
        raise ValueError("N and the token count must be below 2**31 (TMA coordinates are s32)")
    return dataclasses.replace(_spec_for(formats, stream_config, stages), b_layout=layout_of(problem, "b"),
                               a_layout=layout_of(problem, "a"),
                               small_n_warps=stream_config.small_n_warps)   # the spec checks the layout and the warps


def h200_stream_config(problem, config) -> StreamConfig:
    """``config``'s knobs with its stage count capped at what fits this kernel on the H200.

    The dispatch's stage counts are B200 numbers (e.g. NVFP4 large prefill at N 4096, K 7168: 7),
    and this kernel's pair holds the whole token tile in both CTAs, so some do not fit; passing the
    config as is makes ``check_can_implement`` refuse it. This is the explicit opt-in to the cap."""
    stream_config = StreamConfig.of(config)
    real_max = max_pipeline_stages(*_problem_formats(problem), stream_config)
    stages = stream_config.num_pipeline_stages
    stages = real_max if stages == AUTO_STAGES else min(stages, real_max)
    return dataclasses.replace(stream_config, num_pipeline_stages=max(stages, 1))


# The H200 mapping of an SM100 decision (``h200_plan``): measured on the H200 with this kernel
# (``scripts/h200_stream_sweep.py`` and ``gbs bench``, 2026-11-30, commits 7d43acb - 2656874;
# notes/h200/README.md, runs 8, 9 and 12):
# * Token tiles of at most 32 columns run on 4 consumer warps with the decoded-token slots; wider
#   ones on 8 warps whose register budget allows one CTA per SM. When an expert has at most
#   ``H200_SMALL_N_MAX_TOKENS`` tokens on average, the tile is cut to the tokens (8, 16 or 32 columns),
#   without the 2-CTA pair: NVFP4 4096 x 7168, 32 x 32 tokens: swapped bn16 cg1 579.6 us, the SM100
#   decision (bn64 cg2, 6 stages) 867.4 us; Kimi 512 x 7168, 8 x 1: bn8 cg1 38.1 us, bn64 cg2 115.5 us.
#   32 columns (one token tile for 17-32 tokens, two CTAs per SM) since the token decode takes whole
#   rotation runs (run 34, re-laid weights, 4096 x 7168, 32 x 32 tokens): NVFP4 bn32 328.1 us vs bn16 403.4
#   (run 33), MXFP4 342.0 vs 426.2, W4A8 341.0 vs 461.8, MXFP8 358.9 vs 501.8. Past 32 tokens the wgmma
#   kernel wins (NVFP4 64 tokens: bn32 634.0, bn16 769.4, wgmma 506.7; 48: bn16 596.3, wgmma 505.5).
#   The same holds for the MXFP8 x MXFP8 default route (not swapped, bn128, no regime table upstream):
#   4096 x 7168, 64 x 4: swapped bn8 485.2 us (86.6 % of the read ceiling), bn128 2852.7 us (bench,
#   commit 2656874).
# * Those 4-warp configs take ``H200_SMALL_N_STAGES`` stages, so that three CTAs share an SM (two
#   with 32-token tiles: ``SMALL_N_WIDE_MIN_CTAS_PER_SM``); their occupancy hides the decode's latency
#   better than a deep ring: NVFP4 4096 x 7168, 64 x 4: 2 stages 409.6 us, 3: 410.4, 4: 428.0, the SM100
#   decision's 6: 511.7. W4A8 / MXFP8 32 x 32 tokens at bn32 (run 37): 2 CTAs without spills 304.7 /
#   320.9 us, 3 CTAs at the 128-register cap (spilling) 339.2 / 355.3 (bench run 36).
# * Split-K runs (``choose_k_splits``) fill the GPU when tiles are few: Kimi NVFP4 bn8 4 runs of 7
#   slices 21.0 us, 7 of 4: 22.3, 10 of 3: 25.5, unsplit 38.2 (hence ``MIN_SLICES_PER_SPLIT``).
# * 8 consumer warps of 16 rows (``StreamConfig.small_n_warps``) for FP4 tokens where the K slices'
#   latency, not the weight stream, bounds the time (H200 runs 58-59, re-laid weights, two runs each): 32-token
#   tiles, NVFP4 4096 x 7168, 32 x 32 tokens 310.8 / 308.4 -> 294.8 / 293.6 us, MXFP4 312.0 -> 310.2 (312.9 in
#   run 58); and tiles too few for the SMs (split-K runs), Kimi NVFP4 17.5 / 17.4 -> 16.5 / 16.5 us, MXFP4
#   16.9 -> 16.6. Not where the tiles fill the GPU (NVFP4 decode, 2048 tiles: 273 -> 314.9 us) nor for FP8
#   tokens at 32 (W4A8 276.1 -> 313.5, MXFP8 292.4 -> 327.1: their 4-warp builds hold three CTAs per SM).
H200_SMALL_N_MAX_TOKENS = 32
H200_SMALL_N_MMA_BN = (8, 16, 32)   # token tile widths the small-N mapping chooses from
H200_SMALL_N_STAGES = 2
H200_EIGHT_WARP_MMA_BN = 32   # the small-N tile width that runs on 8 warps whatever the tile count
H200_SM_COUNT = 132   # fewer tiles than this (``estimated_small_n_tiles``): split-K runs, 8 warps


def k_slice_elements(a_format, b_format) -> int:
    """K elements per stage of a format pair (names or ``BlockFormat``): 256 when both operands are FP4 (128 bytes
    each), else 128."""
    both_fp4 = get_format(a_format).packed and get_format(b_format).packed
    return 2 * K_SLICE_BYTES if both_fp4 else K_SLICE_BYTES


def average_tokens_per_expert(problem) -> int:
    """Tokens per active expert, rounded up, from host metadata only (``estimated_total_m``): what the
    H200 mappings (``h200_plan``, ``h200_wgmma.prefers``) decide on."""
    return -(-problem.estimated_total_m // max(problem.num_active_experts, 1))


def h200_plan(problem, decision) -> StreamConfig:
    """The knobs this kernel runs an SM100 ``decision`` (a ``KernelConfig`` / ``TileConfig``) with
    when the caller did not choose them (``gbs.grouped_matmul`` with ``config=None``), from host
    metadata only (works for device problems): see the measurements above. Decisions whose experts
    average more than ``H200_SMALL_N_MAX_TOKENS`` tokens keep their tile knobs, with the deepest ring
    that fits (``h200_stream_config``)."""
    stream_config = StreamConfig.of(decision)
    tokens_per_expert = average_tokens_per_expert(problem)
    if tokens_per_expert > H200_SMALL_N_MAX_TOKENS:
        return h200_stream_config(problem, dataclasses.replace(stream_config, num_pipeline_stages=AUTO_STAGES))
    mma_bn = next((bn for bn in H200_SMALL_N_MMA_BN if bn >= tokens_per_expert), H200_SMALL_N_MMA_BN[-1])
    latency_bound = mma_bn == H200_EIGHT_WARP_MMA_BN or estimated_small_n_tiles(problem) < H200_SM_COUNT
    fp4_tokens = get_format(problem.a_format).packed
    warps = 2 * CONSUMER_WARPS_SMALL_N if fp4_tokens and latency_bound else CONSUMER_WARPS_SMALL_N
    return h200_stream_config(problem, StreamConfig(True, mma_bn, 1, H200_SMALL_N_STAGES, warps))


def estimated_small_n_tiles(problem) -> int:
    """Weight-row tiles of a swapped small-N plan (one token tile per expert), from host metadata only."""
    return problem.num_active_experts * -(-problem.n // TILE_M_ROWS)


def can_implement(problem, config) -> tuple[bool, str]:
    """(True, "") if this kernel runs ``problem`` with ``config``, else (False, the reason)."""
    try:
        check_can_implement(problem, config)
    except (TypeError, ValueError) as err:
        return False, str(err)
    return True, ""


def max_tiles_bound(spec: StreamSpec, total_tokens: int, num_slots: int, n: int) -> int:
    """An upper bound of the tile walk's length from shapes only (no routing values needed):
    every slot has at most ``ceil(tokens / tile_tokens) + 1`` token blocks in all."""
    shape = spec.tile_shape
    token_blocks = -(-total_tokens // shape.tokens) + num_slots
    return token_blocks * -(-n // shape.weight_rows)


@dataclass(frozen=True)
class TensorMapArgs:
    """The ``cuTensorMapEncodeTiled`` arguments of one map (byte elements; innermost first)."""

    name: str
    global_address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]     # bytes, one fewer than dims
    box: tuple[int, ...]
    swizzle: str
    l2_promotion: str = cp.DEFAULT_L2_PROMOTION

    def check(self) -> None:
        cp.check_tensor_map_args(self.global_address, "uint8", self.dims, self.strides, self.box, self.swizzle,
                                 self.l2_promotion)

    def encode(self) -> np.ndarray:
        if len(self.dims) == 2:
            return cp.encode_tensor_map_2d(self.global_address, "uint8", self.dims, self.strides[0], self.box,
                                           self.swizzle, self.l2_promotion)
        return cp.encode_tensor_map_3d(self.global_address, "uint8", self.dims, self.strides, self.box, self.swizzle,
                                       self.l2_promotion)


def tensor_map_args(spec: StreamSpec, shapes: dict, addresses: dict) -> list[TensorMapArgs]:
    """The four maps the kernel reads, in its order (``MAP_TOKENS``...): tokens (2-D over ``a``),
    weights (3-D over ``b``; 2-D over its 128-byte box rows when tiled), token scales and weight scales (3-D
    views of the 128x4 atoms as rows of 128 bytes: (128 B, 4 rows per atom x column groups, 128-row bands);
    with fused weights 2-D over ``b``'s rows, like the weights, whose chunks hold the atoms).
    ``shapes`` / ``addresses``: per array name of ``launch.PROBLEM_ARRAY_DTYPES``, its shape and device
    address."""
    a, b = shapes["a"], shapes["b"]
    tok_bytes, tok_rows = spec.token_box
    w_bytes, w_rows, w_experts = spec.weight_box

    def scale_map(name, bands):
        rows = ATOM_MAP_ROWS * shapes[name][-4]   # 4 rows of 128 B per atom, per column group
        return TensorMapArgs(name, addresses[name], (SCALE_MAP_ROW_BYTES, rows, bands),
                             (SCALE_MAP_ROW_BYTES, SCALE_MAP_ROW_BYTES * rows), spec.scale_box, "none")

    weight_scales = scale_map("b_scales", shapes["b_scales"][0] * shapes["b_scales"][1])
    if spec.tiled_weights:   # rows of one box's width over every expert's boxes (E2M1H200TiledOrder)
        check_layout(spec.b_layout, get_format(spec.b_format), "b", b)
        box_rows = (TILED_BOX_BYTES, math.prod(b) // TILED_BOX_BYTES)
        weights = TensorMapArgs("b", addresses["b"], box_rows, (TILED_BOX_BYTES,),
                                (w_bytes, min(w_rows, TILED_BOX_ROWS)), TMA_SWIZZLE[w_bytes])
        if spec.fused_weight_scales:   # the same rows: each box's atoms follow it (E2M1H200FusedOrder)
            weight_scales = TensorMapArgs("b_scales", addresses["b"], box_rows, (TILED_BOX_BYTES,),
                                          spec.scale_box[:2], "none")
    else:
        weights = TensorMapArgs("b", addresses["b"], (b[2], b[1], b[0]), (b[2], b[1] * b[2]),
                                (w_bytes, w_rows, w_experts), TMA_SWIZZLE[w_bytes])
    return [
        TensorMapArgs("a", addresses["a"], (a[1], a[0]), (a[1],), (tok_bytes, tok_rows), TMA_SWIZZLE[tok_bytes]),
        weights,
        scale_map("a_scales", shapes["a_scales"][0]),
        weight_scales,
    ]


@functools.lru_cache(maxsize=None)
def compiled_kernel(spec: StreamSpec) -> launch.CompiledKernel:
    """The JIT-compiled kernel of ``spec`` for the current GPU (cached per spec)."""
    return launch.compile_kernel(make_kernel_function(spec), kernel_signature(), threads=spec.threads,
                                 min_blocks=spec.min_ctas_per_sm, dynamic_smem_bytes=spec.smem.dynamic_bytes,
                                 cluster_size=spec.cta_group, name=f"grouped_matmul_h200_stream[{spec}]")


def resident_ctas_per_sm(spec: StreamSpec, registers_per_thread: int) -> int:
    """CTAs of ``spec`` one SM holds at once: shared memory (228 KiB per SM, each CTA's reserved
    KiB included), threads (2048) and registers: each of the 4 sub-partitions holds 16384 for its
    warps (allocated per thread in steps of 8), so the SM holds 4 x (16384 // warp registers) warps,
    whatever the CTA's warp count (133 registers: 12 warps, two 5-warp CTAs, as ncu's "Block Limit
    Registers" says; 65536 // (160 x 136) would say three). A ring shallow enough for two CTAs gives
    each SM sub-partition two independent pipelines to hide latency with (the 4-warp configs have one
    consumer warp per sub-partition)."""
    by_smem = SM90_SMEM_PER_SM // spec.smem.total_bytes
    by_threads = SM90_THREADS_PER_SM // spec.threads
    warp_registers = WARP_SIZE * _align(registers_per_thread, REGISTER_ALLOC_STEP)
    warps = SM90_SUBPARTITIONS * (SM90_REGISTERS_PER_SM // SM90_SUBPARTITIONS // warp_registers)
    by_registers = warps // (spec.threads // WARP_SIZE)
    return max(1, min(by_smem, by_threads, by_registers))


def resident_pairs(spec: StreamSpec, registers_per_thread: int) -> int:
    """CTA pairs (single CTAs when ``cta_group`` is 1) the whole GPU holds at once."""
    sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return max(1, sm_count * resident_ctas_per_sm(spec, registers_per_thread) // spec.cta_group)


def default_num_ctas(spec: StreamSpec, work_items: int, registers_per_thread: int) -> int:
    """Persistent grid: every resident CTA slot of every SM, never more pairs than work items
    (tiles, times the split-K runs)."""
    pairs = max(1, min(resident_pairs(spec, registers_per_thread), work_items))
    return pairs * spec.cta_group


def choose_k_splits(max_tiles: int, k_slices: int, pair_slots: int) -> tuple[int, int]:
    """(k_splits, slices_per_split) for a grid of ``pair_slots`` resident CTA pairs: no split while
    the tiles fill the slots; otherwise about one run per free slot, each at least
    ``MIN_SLICES_PER_SPLIT`` K slices long, the runs as even as the slice count allows (none empty)."""
    for name, value in (("max_tiles", max_tiles), ("k_slices", k_slices), ("pair_slots", pair_slots)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    wanted = max(1, min(pair_slots // max_tiles, k_slices // MIN_SLICES_PER_SPLIT))
    return split_runs(k_slices, wanted)


def zeroed_counters(tile_counters: int, stream=0):
    """The kernels' ``split_counters`` argument: ``tile_counters`` split-K tile counters, then the
    ``SCHEDULE_COUNTER_WORDS`` of the work-item counter; zeroed once here, on the launch's stream
    (synchronous for the default 0). Every launch leaves them zeroed (``MIN_SLICES_PER_SPLIT``'s notes;
    the last producer zeroes the item counter), so a prepared launch must not run concurrently with itself."""
    counters = cuda.device_array(tile_counters + SCHEDULE_COUNTER_WORDS, np.uint32, stream=stream)
    device_memset(counters, 0, counters.nbytes, stream=stream)
    return counters


def split_runs(k_slices: int, k_splits: int) -> tuple[int, int]:
    """(k_splits, slices_per_split) closest to ``k_splits`` runs of ``k_slices`` with none empty."""
    if not 1 <= k_splits <= k_slices:
        raise ValueError(f"k_splits must be in [1, {k_slices}] (the K slices), got {k_splits}")
    per_split = -(-k_slices // k_splits)
    return -(-k_slices // per_split), per_split


@dataclass
class StreamLaunch:
    """A prepared launch: ``launch()`` (or calling the object) enqueues the kernel, no host copies or
    syncs. ``out`` is the device output (uint16 bf16 bits, (total_tokens, N)). The launch owns counters
    (the work-item counter; with ``k_splits > 1`` also one per tile, and a zeroed fp32 workspace) that
    every launch leaves zeroed: a prepared launch must not run concurrently with itself."""

    spec: StreamSpec
    out: object
    num_ctas: int
    max_tiles: int
    _launch: launch.PreparedLaunch | None
    k_splits: int = 1
    split_sums: object = None       # the split-K workspace (fp32, (total_tokens, N))
    split_counters: object = None   # split-K tile counters, then SCHEDULE_COUNTER_WORDS of the item counter
    kernel: str = "h200_stream"     # which kernel family runs (h200_wgmma's launches say so)
    trace_buffer: object = None     # trace builds: (num_ctas, TRACE_EVENTS, 2) u64, the last launch's stamps

    def __call__(self, stream=None) -> None:
        if self._launch is not None:   # no tiles (no tokens): nothing to run
            self._launch(stream)


def trace_phases(records: np.ndarray) -> dict[str, np.ndarray]:
    """Per-CTA durations (ns, float; NaN where an event was not reached) between consecutive events of the
    producer's chain and of the consumers' chain (``TRACE_PRODUCER_CHAIN`` / ``TRACE_CONSUMER_CHAIN``) in one
    launch's trace buffer copied to the host (``(ctas, events, 2)`` u64: globaltimer, clock64), keyed
    "event_a -> event_b", plus "first_tma_issued -> first_full" (the first load's latency), "launch span" (first
    entry to last exit, one value) and "entry skew" (each CTA's entry after the first CTA's)."""
    records = np.asarray(records)
    if records.ndim != 3 or records.shape[1:] != (len(TRACE_EVENTS), TRACE_RECORD_WORDS):
        raise ValueError(f"want one launch's (ctas, {len(TRACE_EVENTS)}, {TRACE_RECORD_WORDS}) trace, "
                         f"got {records.shape}")
    ns = np.where(records[:, :, 0] == 0, np.nan, records[:, :, 0].astype(np.float64))
    entry = ns[:, TRACE_ENTRY]
    phases = {"entry skew": entry - np.nanmin(entry)}
    for chain in (TRACE_PRODUCER_CHAIN, TRACE_CONSUMER_CHAIN):
        for a, b in zip(chain, chain[1:]):
            phases[f"{TRACE_EVENTS[a]} -> {TRACE_EVENTS[b]}"] = ns[:, b] - ns[:, a]
    phases["first_tma_issued -> first_full"] = ns[:, TRACE_FIRST_FULL] - ns[:, TRACE_FIRST_TMA]
    last_exit = np.nanmax(np.fmax(ns[:, TRACE_CONSUMER_EXIT], ns[:, TRACE_PRODUCER_EXIT]))
    phases["launch span"] = np.array([last_exit - np.nanmin(entry)])
    return phases


def _device_out(problem: launch.DeviceProblem, out, align: int = 2):
    """The output as a device array of bf16 bits, checked (``align``: byte alignment its kernel needs)."""
    shape = (problem.total_tokens, problem.n)
    if out is None:
        return cuda.device_array(shape, dtype=np.uint16)
    if not cuda.is_cuda_array(out):
        raise TypeError(f"out must be a device array (__cuda_array_interface__), got {type(out).__name__}")
    arr = cuda.as_cuda_array(out)
    if arr.dtype.itemsize != 2:
        raise TypeError(f"out must hold bf16 (2-byte) elements, got {arr.dtype}")
    if arr.dtype != np.uint16:
        arr = arr.view(np.uint16)
    if tuple(arr.shape) != shape or not arr.is_c_contiguous():
        raise ValueError(f"out must be a C-contiguous {shape} (total_tokens, N) array, got {tuple(arr.shape)}")
    if launch.device_address(arr) % align:
        raise ValueError(f"out must be {align}-byte aligned on the device (this kernel stores bf16 pairs), got "
                         f"address {launch.device_address(arr):#x}: pass an array that starts at an allocation")
    return arr


def prepare(problem_device: launch.DeviceProblem, config, out=None, *, num_ctas: int | None = None,
            k_splits: int | None = None, stream=0, trace: bool = False) -> StreamLaunch:
    """Compile (cached), build the tensor maps and marshal the arguments once; returns a
    ``StreamLaunch`` that launches with no host copies or syncs (for the benchmark).

    ``out``: a device array of bf16 bits, (total_tokens, N) (default: a new uninitialised one; rows of
    skipped slots are never written). ``num_ctas``: persistent grid size, a multiple of ``cta_group``
    (default: every resident CTA slot, ``resident_ctas_per_sm`` per SM). ``k_splits``: split-K runs
    per tile (default: ``choose_k_splits`` for that grid; 1 = no split). ``trace``: run the diagnostic
    build that stamps ``TRACE_EVENTS`` per CTA into ``StreamLaunch.trace_buffer`` (``trace_phases`` reads a copy).
    """
    if not isinstance(problem_device, launch.DeviceProblem):
        raise TypeError("prepare takes a launch.DeviceProblem (see launch.to_device)")
    launch.require_gpu(SM90, "the H200 streaming kernel")
    spec = dataclasses.replace(check_can_implement(problem_device, config), trace=bool(trace))
    device_out = _device_out(problem_device, out)
    max_tiles = max_tiles_bound(spec, problem_device.total_tokens, problem_device.num_active_experts,
                                problem_device.n)
    if problem_device.total_tokens == 0:
        return StreamLaunch(spec, device_out, 0, 0, None)
    for name, arr in problem_device.arrays().items():
        if launch.device_address(arr) % launch.TMA_ADDRESS_ALIGN:
            raise ValueError(f"{name} must be {launch.TMA_ADDRESS_ALIGN}-byte aligned on the device (TMA)")
    if num_ctas is not None:   # before any compile
        schedule.check_num_ctas(num_ctas, spec.cta_group)
    kernel = compiled_kernel(spec)
    k_slices = problem_device.k // spec.k_slice
    if k_splits is None:
        k_splits, slices_per_split = choose_k_splits(max_tiles, k_slices,
                                                     resident_pairs(spec, kernel.registers))
    else:
        k_splits, slices_per_split = split_runs(k_slices, require_int("k_splits", k_splits, 1))
    if k_splits > 1:
        spec = split_spec(spec, k_splits)
        kernel = compiled_kernel(spec)
    if num_ctas is None:   # the runs are the work items
        num_ctas = default_num_ctas(spec, max_tiles * k_splits, kernel.registers)
    num_ctas = schedule.check_num_ctas(num_ctas, spec.cta_group)
    split_counters = zeroed_counters(max_tiles * spec.cta_group if k_splits > 1 else 0, stream)
    if k_splits > 1:
        split_sums = cuda.device_array((problem_device.total_tokens, problem_device.n), np.float32, stream=stream)
        device_memset(split_sums, 0, split_sums.nbytes, stream=stream)
    else:
        split_sums = cuda.device_array((1, 1), np.float32)
    arrays = problem_device.arrays()
    map_args = tensor_map_args(spec, {k: tuple(v.shape) for k, v in arrays.items()},
                               {k: launch.device_address(v) for k, v in arrays.items()})
    images = [m.encode() for m in map_args]
    trace_buffer = None
    if trace:   # zeroed: events a CTA never reaches read 0; its address rides in the slot after the maps
        trace_buffer = cuda.device_array((num_ctas, len(TRACE_EVENTS), TRACE_RECORD_WORDS), np.uint64, stream=stream)
        device_memset(trace_buffer, 0, trace_buffer.nbytes, stream=stream)
        slot = np.zeros(cp.TENSOR_MAP_BYTES, np.uint8)
        slot[:8] = np.array([launch.device_address(trace_buffer)], np.uint64).view(np.uint8)
        images.append(slot)
    maps = launch.device_tensor_maps(images, stream=stream)
    args = (np.uint64(launch.device_address(maps)), problem_device.a_offsets, problem_device.a_scale_offsets,
            problem_device.expert_ids, problem_device.expert_scales, device_out, np.int64(problem_device.n),
            np.int64(k_slices), np.int64(max_tiles), split_sums, split_counters, np.int64(k_splits),
            np.int64(slices_per_split))
    prepared = launch.prepare_launch(kernel, num_ctas, args, stream=stream,
                                     keepalive=(maps, problem_device, split_sums, split_counters, trace_buffer))
    return StreamLaunch(spec, device_out, num_ctas, max_tiles, prepared, k_splits, split_sums, split_counters,
                        trace_buffer=trace_buffer)


def grouped_matmul_h200(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
                        num_ctas: int | None = None, k_splits: int | None = None) -> np.ndarray:
    """Run the H200 streaming kernel on a host problem; returns ``C`` (bf16, (total_tokens, N)).

    ``out``: if given (bf16, C-contiguous), rows of skipped slots keep its contents and it is written
    in place and returned; default: a fresh array holding ``gbs.reference.poison_output``.
    Raises ``launch.NoSuitableGPUError`` without an sm_90 GPU.
    """
    launch.require_gpu(SM90, "the H200 streaming kernel")
    check_can_implement(problem, config)
    shape = (problem.total_tokens, problem.n)
    if out is None:
        out = poison_output(*shape)
    elif not isinstance(out, np.ndarray) or out.dtype != BF16 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous bfloat16 numpy array of shape {shape}")
    device_problem = launch.to_device(problem)
    bits = out.view(np.uint16)
    device_out = cuda.to_device(bits)
    prepared = prepare(device_problem, config, device_out, num_ctas=num_ctas, k_splits=k_splits)
    prepared()
    device_out.copy_to_host(bits)
    return out


def exact_scale_exponent_range(element: str, scale_dtype: str = "ue8m0") -> tuple[int, int]:
    """Unbiased UE8M0 scale exponents ``byte - 127`` for which every decoded, scaled element is exact
    (bf16 quantum ``2**-133`` below, the scale's bf16 image ``2**(e + c - d)`` finite above)."""
    if scale_dtype != "ue8m0":
        raise ValueError("UE4M3 scales are exact over their whole range here; ask for 'ue8m0'")
    c, d = ELEMENT_LOG2_OFFSET[element], SCALE_LOG2_PREBIAS["ue8m0"]
    element_quantum_log2 = {"e2m1": -1, "e4m3": -9, "e5m2": -16}[element]
    lowest_byte = (-133 + 127 + d) - element_quantum_log2
    highest_byte = BF16_EXPONENT_MAX - c + d
    return lowest_byte - UE8M0_BIAS, highest_byte - UE8M0_BIAS
