"""The SM100 (B200) grouped 1D-1D block-scaled matmul kernel: a warp-specialised persistent Numba
CUDA kernel with inline PTX (TMA, mbarriers, ``tcgen05``), built per ``Sm100KernelSpec``.

Nothing here has run: no Blackwell GPU is within this project's reach. CI assembles the kernel for
sm_100a (ptxas through nvJitLink; ``gbs.numba_kernels.sm100_build``) for every dispatch outcome and
checks its SASS and resources; the CPU emulator (``gbs.sm100_emulator``) replays the host-visible
logic the kernel compiles in (the device-capable functions of ``sm100_spec`` and
``sm100_addressing``) against the reference.

Design (``docs/design/sm100_kernel.md``, "Grid and warp roles", "The pipeline", "The MMA",
"Epilogue"):

* Persistent grid, clusters of ``cta_group`` CTAs; CTA pair ``p`` walks tiles ``p, p + pairs, ...``
  of ``gbs.schedule``. Warp 6 (the tile scheduler) writes each tile's fields into a two-slot ring in
  shared memory, then a terminator (slot -1); every other role reads the ring.
* Warp 4 (TMA) fills a stage with a 128-byte K slice of both tiles and their scale atoms (full /
  empty mbarriers, ``expect_tx``). With ``cta_group = 2`` each CTA loads its half, completing on the
  even CTA's full barrier (``.cta_group::2`` TMA through a ``mapa`` address); the even CTA's warp 5
  issues ``M = 256`` MMAs and commits with multicast to both CTAs' empty barriers.
* Warp 5 copies the stage's scale atoms SMEM -> TMEM (``tcgen05.cp.32x128b.warpx4``), issues four
  block-scaled MMAs per K slice into a TMEM accumulator stage and commits it to the epilogue.
* With ``mma_bn < 64`` warp 7 loads the MMA-B scale atoms on their own barrier and warps 8-11 write
  the tile's scale rows into TMEM lanes ``0..mma_bn-1`` with ``tcgen05.st``.
* Warps 0-3 (epilogue): ``tcgen05.ld`` a chunk, times ``expert_scales[e]``, RNE to bf16; whole-group
  chunks through a double-buffered shared-memory buffer and a TMA store, the rest element by
  element with bounds checks; then release the accumulator stage (to the even CTA's MMA warp).

Assumed as CUTLASS / upstream do, unverifiable without Blackwell: ``tcgen05.cp.cta_group::2``
copies each CTA's own scale atoms into its own TMEM; the ``.cta_group::2`` TMA completes on the
even CTA's barrier through a ``mapa`` address.

Constraint: the kernel body is a closure over the spec's fields, which Numba freezes as constants;
every helper it calls is a fresh ``cuda.jit(device=True)`` version of a device-capable function.
"""
from __future__ import annotations

import functools

import numpy as np

from gbs import schedule
from gbs.formats import SF_ATOM_ROWS, scale_byte_offset
from gbs.numba_kernels.simt import bf16_bits_rne
from gbs.numba_kernels.sm100_addressing import (accumulator_output, c_buffer_offset, chunk_is_live,
                                                chunk_uses_tma_store, encode_smem_descriptor, mma_scale_columns,
                                                mma_scale_slot, operand_descriptor, scale_atom_descriptor,
                                                scale_copy_offsets, sfb_column_adjust, sfb_store_word_offset,
                                                stage_k_coordinates, tile_load_coordinates, tma_store_coordinates,
                                                tma_swizzled_offset, token_scale_row)
from gbs.numba_kernels.sm100_spec import (
    A_TILE_BYTES, ACCUM_EMPTY, ACCUM_FULL, EPILOGUE_BARRIER_ID, EPILOGUE_THREADS, MAP_OUT, MAP_TOKEN_SCALES,
    MAP_TOKENS, MAP_WEIGHT_SCALES, MAP_WEIGHTS, MMA_WARP, MMAS_PER_K_SLICE, NUM_C_BUFFERS, NUM_EPILOGUE_WARPS,
    NUM_SFB_STORE_WARPS, OUTPUT_BYTES, SCALE_TMEM_COLUMNS, SCHED_EMPTY, SCHED_FULL, SCHEDULER_FIELDS,
    SCHEDULER_SLOT_BYTES, SCHEDULER_SLOTS, SCHEDULER_WARP, SFB_FULL, SFB_LOAD_WARP, SFB_STORE_WARP0, SFB_TMEM_FULL,
    STAGE_EMPTY, STAGE_FULL, SWIZZLE_ATOM_BYTES, TENSOR_MAP_BYTES, TMA_WARP, TMEM_ALLOC_COLUMNS, Sm100KernelSpec,
    fixed_barrier, pipeline_position, smem_offsets, stage_barrier, tmem_columns)
from gbs.ptx_inline import sm100_descriptors as desc
from gbs.schedule import rebind

_FULL_MASK = 0xFFFFFFFF
_PAIR_MASK = 0b11   # both CTAs of the pair (multicast commit)
# PTX of ``tma_load_cta_pair``; rank, coordinate operands and mbarrier operand filled in.
TMA_LOAD_CTA_PAIR_PTX = ("cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                         ".cta_group::2 [$0], [$1, {{{coords}}}], [${mbar}];")


@functools.cache
def tma_load_cta_pair(rank: int):
    """TMA load whose completion goes to an mbarrier in either CTA of the pair (``.cta_group::2``:
    ``mbar`` is a shared::cluster address, e.g. ``mapa`` of the even CTA's barrier). SASS
    ``UTMALDG.<rank>D.2CTA``. Operands as ``copy.tma_load_<rank>d``."""
    from gbs.ptx_inline.common import ptx_intrinsic

    names = ("c0", "c1", "c2")[:rank]
    text = TMA_LOAD_CTA_PAIR_PTX.format(rank=rank, coords=", ".join(f"${i + 2}" for i in range(rank)), mbar=rank + 2)
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


def kernel_signature():
    """Argument types of ``make_kernel_function``'s kernel (for offline compiles and launches)."""
    from numba.cuda import types

    return (types.uint8[::1], types.int64[::1], types.int64[::1], types.int32[::1], types.float32[::1],
            types.uint16[:, ::1], types.int64, types.int64, types.int64, types.int64)

