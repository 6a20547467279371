"""The fast H200 (sm_90a) grouped block-scaled matmul, streaming path: the TMA shared-memory ring
(``h200_ring``), block scales applied in software, exactly (``h200_decode``), and bf16 ``mma.sync`` on the
tensor cores, fed from registers that every consumer warp decodes itself.

It computes the grouped 1D-1D problem of ``gbs.problem`` (``docs/design/formats.md``) for NVFP4, MXFP4,
MXFP8 (E4M3), MXFP8 E5M2 and W4A8 (MXFP8 tokens x MXFP4 weights) with every legal knob of ``gbs.dispatch``, and
W4A16 (bf16 tokens x MXFP4 / NVFP4 weights) in its swapped small-N tiles (the decoded-token slots below),
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
  warp. bf16 tokens (W4A16, no scales) take these tiles only: their "decode" is the pairing alone
  (``h200_decode.bf16_stride4_pairs_of``). With FP4 weights these tiles (8 and 16 columns) stream 256-K slices
  whatever the tokens (``StreamSpec.k_slice``): FP8 and bf16 token rows are then 2 or 4 TMA boxes, a quarter's
  box found from its lane, the items ordered box by box (``token_decode_item``; evidence: w4a8-k256).
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

Constraints (``check_can_implement``): the ring's (``h200_ring``): rows TMA can address (K a multiple of 32 with
FP4 operands, 16 with FP8; a partial last K slice reads zeros past K), finite scales in the atoms' padding columns
of a K tail, 16-byte aligned device arrays, the ring's real shared-memory bytes within the H200's 227 KiB per
block, tiled weights stored in whole boxes (padded).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from gbs.formats import SF_ATOM_COLS, SF_ATOM_ROWS, SF_LANE_BYTES
from gbs.numba_kernels.h200_decode import (NEG_ZERO_BF16X2, QUAD, ROTATION_RUN, bf16_stride4_pairs_of, group_column,
                                           inline_device, make_side_reader, rotated_group, scale_selector_run_step,
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
from gbs.ptx_inline.arith import f32_to_bf16_bits, fma_bf16x2, prmt_b32
from gbs.ptx_inline.shared import ld_shared_u32, ld_shared_v2_u32, ld_shared_v4_u32, st_shared_v4_u32

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


def token_decode_item(item, chunks, groups, quarters_per_box, rows):
    """(token row, quad lane, first local group) of item ``item`` of the cooperative token decode: the
    row's quarter of quad lane ``q`` cut into ``chunks`` runs of ``groups`` consecutive groups, chunks
    fastest, so the 8 lanes of one 16-byte load phase read one row's 8 chunks (distinct banks). Rows wider
    than a TMA box (``quarters_per_box`` < 4 of their ``QUAD`` quarters per box, boxes ``rows`` rows apart) go
    box by box, rows inside: a phase then reads 8 chunks of one box row, or of consecutive rows of one box,
    whose swizzles differ (distinct banks again)."""
    chunk = item % chunks
    if quarters_per_box == QUAD:   # the whole row in one box (a compile-time branch in the kernel)
        return item // (QUAD * chunks), (item // chunks) % QUAD, chunk * groups
    row_items = quarters_per_box * chunks
    box, rest = item // (rows * row_items), item % (rows * row_items)
    return rest // row_items, box * quarters_per_box + (rest // chunks) % quarters_per_box, chunk * groups


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
    next_stage = ring.next_stage
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
    bf16_tokens = not n_side.fmt.scaled   # W4A16: the swapped small-N tiles copy them into B fragments
    n_box_bytes, n_region_bytes = n_side.box_bytes, spec.token_region_bytes   # read by the token copy only
    n_boxes, token_rows = n_side.boxes, n_side.rows
    quarters_per_box = n_box_bytes // n_side.thread_bytes   # quad-lane quarters of a row per box: 4, 2 or 1
    box_quarter_bits = quarters_per_box.bit_length() - 1
    if bf16_tokens and not predecode:
        raise AssertionError("bf16 tokens: the swapped small-N tiles' token copy (StreamSpec.predecoded_tokens)")
    stride4_pairs = inline_device(bf16_stride4_pairs_of(prmt_b32))
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
        # programmatic dependent launch: before the first global access (h200_ring's docstring), the trace's
        # entry stamp included
        cm.griddepcontrol_wait()
        cm.griddepcontrol_launch_dependents()
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
                                                             item_groups, quarters_per_box, token_rows)
                            # token columns past the tile's tokens only feed accumulator columns the
                            # epilogue never stores (MMA columns are independent): leave them stale
                            if d_row >= t1 - t0:
                                continue
                            if not bf16_tokens:
                                address = np.uint32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + d_row),
                                                                              word_column(d_q, n_blocks), atoms))
                                d_s0, d_s1 = n_load_scales(address, d_q)
                            d_xor = np.uint32(swizzle(d_row, n_box_bytes, n_mask))
                            if n_boxes > 1:   # rows wider than a box (one per token region): quarter d_q lies in
                                # box d_q // quarters_per_box, at quarter d_q % quarters_per_box of its row
                                d_row_addr = np.uint32(st + n_data_off + (d_q >> box_quarter_bits) * n_region_bytes
                                                       + d_row * n_box_bytes)
                                d_q_col = d_q & (quarters_per_box - 1)
                            else:
                                d_row_addr = np.uint32(st + n_data_off + d_row * n_box_bytes)
                                d_q_col = d_q
                            # the item's words: 16-byte loads of whole (swizzled) chunks where it spans them
                            for piece in range(max(1, item_bytes // 16)):
                                d_addr = d_row_addr + column(d_q_col, d_first + piece * piece_groups, n_thread_bytes,
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
                                if bf16_tokens:   # as they are, paired (j, j + 4) like the weights' decode
                                    b_0, b_1, b_2, b_3 = stride4_pairs(d_words[4 * c], d_words[4 * c + 1],
                                                                       d_words[4 * c + 2], d_words[4 * c + 3])
                                else:
                                    d_scale = n_group_scale(d_s0, d_s1, n_selector(d_gl), d_gl // ROTATION_RUN)
                                    d_w0 = d_words[c * n_group_words]
                                    d_w1 = d_words[c * n_group_words + n_group_words - 1]   # FP8: the 2nd word
                                    b_0 = fma_bf16x2(n_decode(d_w0, d_w1, 0), d_scale, NEG_ZERO_BF16X2)
                                    b_1 = fma_bf16x2(n_decode(d_w0, d_w1, 1), d_scale, NEG_ZERO_BF16X2)
                                    b_2 = fma_bf16x2(n_decode(d_w0, d_w1, 2), d_scale, NEG_ZERO_BF16X2)
                                    b_3 = fma_bf16x2(n_decode(d_w0, d_w1, 3), d_scale, NEG_ZERO_BF16X2)
                                st_shared_v4_u32(dslot + decoded_offset(d_row, d_q, d_gl, n_groups), b_0, b_1, b_2, b_3)
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
                    stage, phase = next_stage(stage, phase)
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
