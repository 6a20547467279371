"""The fast H200 (sm_90a) grouped block-scaled matmul, streaming path: a TMA shared-memory ring,
block scales applied in software, exactly, and bf16 ``mma.sync`` on the tensor cores.

It computes the grouped 1D-1D problem of ``gbs.problem`` (``../shared/spec/formats.md``) for NVFP4,
MXFP4, MXFP8 (E4M3), MXFP8 E5M2 and W4A8 (MXFP8 tokens x MXFP4 weights) with every legal knob of
``gbs.dispatch`` implemented for real: ``ab_swapped`` True / False, ``mma_bn`` 8..256,
``cta_group`` 1 / 2 and ``num_pipeline_stages``. One kernel family, specialised at compile time by
``StreamSpec`` (formats and knobs) and cached per spec.

Structure (persistent: as many CTAs as fit, ``resident_ctas_per_sm`` per SM):
* The producer: warp 0, or with 8 consumer warps a whole warpgroup (warps 1-3 idle) whose registers
  ``setmaxnreg`` hands to the consumers. One thread takes the CTA's work items and walks to their tiles
  (``gbs.schedule``: slot order, ``-1`` and empty slots have no tiles, M-major inside a group): pair
  ``p`` of ``P`` takes item ``p`` first, then (``StreamSpec.dynamic_items``, single CTAs) the next free
  item of a global counter, so faster CTAs take more, or (pairs) items ``p + P, p + 2 P, ...``. For the
  first K slice of an item it writes the item's record (expert, tile, token and row ranges, first
  slice) beside the stage's barriers; after its last item, a record saying "no more work", armed with
  no bytes. For every K slice it waits for a free ring stage (``empty`` mbarrier),
  announces the stage's bytes (``arrive.expect_tx`` on ``full``) and issues the TMA loads: the weight
  rows' slice (3-D map over ``b``: rows past N read as zero and never bleed into the next expert; tiled
  weights, ``b_layout`` "e2m1_h200_tiled", one or two 16 KB boxes of a 2-D map over their boxes), the
  token rows' slice (2-D map over ``a``) and the 512-byte scale atoms of both, straight from the 128x4
  layouts (the weights' 6-D scales as stored: no re-layout; with fused weights, ``b_layout``
  "e2m1_h200_fused", the atoms that follow each box in ``b``, through a second 2-D map over its rows).
* The consumers: 4 warps (``mma_bn <= 32``; 8 of 16 rows with ``StreamConfig.small_n_warps``, which
  ``h200_plan`` picks for latency-bound tiles) or 8. They do not walk: after the ``full`` wait of an
  item's first stage they read its record. Each owns a ``WM x WN`` part of the CTA's ``128 x mma_bn``
  MMA tile (M = weight rows when ``ab_swapped``, else tokens), waits for a full stage, reads raw
  FP4/FP8 bytes and scale bytes from shared memory, decodes them to bf16 times their block scale in
  registers and issues ``mma.sync.m16n8k16.bf16`` into fp32 register accumulators; then one lane per
  warp releases the stage. After a tile's last slice it multiplies
  by ``expert_scales[e]`` (and the power of two below), rounds to bf16 (RNE) and stores
  ``C[token, n]`` with predicated 2-byte stores, masked to the group's tokens and to N: rows of
  skipped slots are never written.
* Decoded-token slots (``StreamSpec.predecoded_tokens``: swapped configs with at most 32 token
  columns, the decode regime): after the ``full`` wait the 4 consumer warps decode the stage's token
  slice ONCE, together (items of up to a rotation run of one row's quad-lane quarter:
  ``token_decode_groups``, one scale load per item), into bf16 B fragments (scaled) in one of two
  shared slots, meet at a named barrier, and then each reads a group's fragments with one 16-byte
  load (token rows past the tile's tokens are skipped: they only feed accumulator columns that are
  never stored); wider token tiles decode their tokens in registers, per warp.
* Split-K (``choose_k_splits``, its own ``StreamSpec.split_k`` build): with fewer tiles than resident
  CTAs, each tile's K slices are cut into runs taken by different CTAs; runs add fp32 partial tiles
  into a zeroed workspace (``red.global.add.f32``, which flushes fp32 subnormal partials to zero), the
  last run of a tile (a counter) reads the sums back (all its loads in flight at once), rounds and stores,
  zeroes the words it read and resets the counter: the workspace is zero again after every launch. The dynamic
  item counter lives in the last two words of the same counter array and is zeroed by the last producer to finish.
* The routing (a_offsets, expert_ids; up to ``ROUTING_SMEM_SLOTS`` slots) is copied into shared memory
  at launch, so the tile walk does not pay one dependent global load per slot it steps over.
* ``cta_group = 2``: a cluster of two CTAs covers ``2 x 128`` weight rows that share one token tile.
  Each CTA loads half of the token rows and multicasts them (``.multicast::cluster``) to both; the
  token scale atoms are multicast too. Every consumer warp releases a stage on the ``empty`` barriers
  of both CTAs (a multicast writes into the peer); the producers wait with cluster-scope acquire.
  Both CTAs of a pair take the same (static) items, so they run the same number of stages; a cluster barrier
  follows the mbarrier init and precedes exit.

Exact software block scaling. Hopper has no FP4 MMA and no block-scale hardware. Each element is
decoded with integer operations into bf16 bits that read as ``value * 2**-c`` (E2M1: the 3 magnitude
bits go to bf16 bits 6..8, so code 1 = 0.5 lands on the bf16 subnormal ``2**-127``: ``c = 126``;
E4M3 ``c = 120``; E5M2 ``c = 112``), then one ``fma.rn.bf16x2`` multiplies it by the block scale held
as the bf16 ``s * 2**(c - d)``. E2M1 x UE4M3 and E2M1/E4M3/E5M2 x UE8M0 products have at most 7
significant bits, so the result ``value * s * 2**-d`` is exact in bf16; ``d`` (8 for UE4M3, 16 for
UE8M0) keeps ``s * 2**(c - d)`` inside the bf16 range. The MMA accumulates exact products in fp32 and
the epilogue multiplies by ``2**(d_tokens + d_weights)``, exactly. The exact range covers UE8M0 scale
exponents (``byte - 127``) in [-116, +17] for E2M1, [-108, +23] for E4M3, [-101, +31] for E5M2 and
every UE4M3 scale (``exact_scale_exponent_range``); outside it a product underflows to zero or its
scale saturates to Inf. NaN scale bytes (UE8M0 0xFF, UE4M3 0x7F) make their block NaN; NaN element
codes of E4M3 / E5M2 are decoded as finite numbers (the quantizers never emit them: a NaN block gets
a NaN scale and zero codes).

The K permutation. A sum over K ignores the order of k, so each thread of a quad takes a contiguous
quarter of the K slice of its row (64 FP4 or 32 FP8 elements), and both operands are read with the
same permutation: a group of 8 consecutive elements feeds two MMA k16 steps. FP4 groups pair
elements ``(j, j + 4)`` in one bf16x2 register (two shifts and masks per register); FP8 x FP8 pairs
``(0, 2), (1, 3)`` of each 4-byte word (no byte moves); W4A8 reads its FP8 tokens with the FP4
pairing. Threads visit their groups in an order rotated by their quad index, so the 32 lanes of a
shared-memory load hit 32 different banks (TMA 128B / 64B swizzle does the rest).

Cost, from the SASS (ptxas 13.5, decode config nvfp4 swapped mma_bn 8, 2 stages, 121 registers, 3 CTAs
per SM): one 8-element group of a consumer warp (32 weight rows x 8 elements = 512 B of FP4 weights)
is ~90 instructions: 4 LDS for the weights and one LDS.128 for the decoded token fragments, 16
registers decoded at ~3 instructions each (mask, one IMAD that spreads magnitude and sign, mask; see
``e2m1_pair_bits``; ptxas folds the odd registers' shift into the IMAD), 16 HMUL2.BF16 for the
scales, 4 PRMT (NVFP4 block-scale selection), 4 HMMA, and one LOP3 per address: groups are walked
in unrolled rotation runs of 4 with per-thread column tables, prefetching the next group's words
into the other of two register buffers (358 instructions per run). Per stage add the token decode
(1/4 of it per warp), the scale conversion and a named barrier (~20 % on top). ncu on the H200
(notes/h200, run 9): issue slots 66 % busy, ALU pipe 66 %, FMA-heavy 56 %, DRAM 52 %: instruction-bound,
60 % of the read ceiling. Weights re-laid once in ``gbs.formats.E2M1H200Order`` (``b_layout``
"e2m1_h200", ``e2m1_h200_pair_bits``) decode in 9 instead of 13 integer instructions per word: 294 per
run, 73 % of the read ceiling (bench run 36, with the sleeping mbarrier waits and run-sized token-decode
items), bit-identical output. FP4 tokens in that order (``a_layout``) take the same decode, bit-identical
too; here the tokens are a few per weight row, so it does not show (run 72: decode 281 us either way).
In that order NVFP4's UE4M3 scales are ``gbs.formats.UE4M3H200Scales`` codes: each K slice's scale words
become bf16 pairs with a ``prmt`` and a shift-add per two scales (``ue4m3_code_pair_bits``) instead of the
exact float route (``cvt`` e4m3 -> f16 -> f32, multiply, pack: 6 per two), bit for bit the same bf16
except a zero scale as -0: the decode config's K-slice loop 470 -> 430 instructions (offline).
NVFP4 weights tiled (``gbs.formats.E2M1H200TiledOrder``: each stage's 128 rows x 128 B box is 16 KB of
contiguous memory instead of 128 row pieces ``K / 2`` bytes apart; only the producer's load changes) stream
faster: decode_up 85.6-85.9 -> 87.6-87.9 % of the read ceiling on 4.63 TB/s H200s, 83.6 -> 86.9 % on a
4.53 one (runs 95, 97, 98); MXFP4 weights tiled ran 3-4 % slower. Weights fused with their scales
(``gbs.formats.E2M1H200FusedOrder``: each box followed by its K slice's scale atoms, so a stage's weight bytes
are one contiguous chunk) stream fastest for both formats (run 100: MXFP4 decode_up 85.2 %, NVFP4 88.0 % of the
read ceiling): the producer loads the box and the atoms from the same buffer (``tensor_map_args``), the
consumers see the same stage (``gbs.api.H200_WEIGHT_LAYOUTS``).
FP8 decodes twice the bytes per instruction and streams at 87 %.

Constraints (``check_can_implement``): K a multiple of the K slice (256 elements when both operands
are FP4, else 128): pad K with zero elements (zero codes, any scale byte) otherwise; 16-byte aligned
device arrays (TMA); the pipeline's real shared-memory bytes within the H200's 227 KiB per block; tiled
weights (tiled or fused): N a multiple of 128 and K / 2 bytes of 128 (whole boxes).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32
from numba.cuda.cudadrv.driver import device_memset
from numba.cuda import types

from gbs import schedule
from gbs.dispatch import AUTO_STAGES, H200_SMEM_PER_SM, KernelConfig, pipeline_smem_terms, require_int
from gbs.numba_kernels import launch
from gbs.numba_kernels.simt import scale_byte_offset
from gbs.problem import PROBLEM_FORMATS, GroupedProblem, check_layout, layout_of
from gbs.ptx_inline import cluster as cl
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import copy as cp
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline.arith import e4m3x4_to_bf16x2, f32_to_bf16_bits, fma_bf16x2, min_u16x2, min_u16x2_host, prmt_b32
from gbs.ptx_inline.common import trap_if_nonzero
from gbs.ptx_inline.mbarrier import spin_wait_parity_or_trap, wait_parity_cluster_or_trap, wait_parity_or_trap
from gbs.ptx_inline.shared import ld_shared_u32, ld_shared_v2_u32, ld_shared_v4_u32, st_shared_v4_u32
from gbs.formats import BF16, SF_ATOM_BYTES, SF_ATOM_COLS, SF_LANE_BYTES, SF_ATOM_ROWS, UE8M0_BIAS, get_format
from gbs.layouts import (LAYOUT_E2M1_H200, LAYOUT_PACKED, E2M1H200FusedOrder, E2M1H200Order, E2M1H200TiledOrder, UE4M3H200Scales, fused_scales, tiled_weights, word_order)
from gbs.reference import poison_output

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
SM90 = (9, 0)
# The consumers wait for their stage's bytes without try_wait's suspend hint (``spin_wait_parity_or_trap``: a
# sleeping consumer can wake late); the producer keeps the hint (without it, its retry loop took 17-19 % of the
# issued instructions, ncu run 32). Alternating rounds on the H200 (notes/h200, runs 89-91): on a 4.63 TB/s GPU
# unhinted consumer waits took NVFP4 decode_up 267.7 -> 267.6 us, MXFP4 -0.5 %, small prefill -0.8 %, large
# prefill (``h200_wgmma`` waits the same way) 838.5 / 861.2 -> 825.8 / 832.8; an unhinted producer cost
# +0.6..+0.9 %. On a 4.52 TB/s GPU -0.2..-0.3 % (NVFP4 and MXFP4 decode_up), decode_down unchanged.
CONSUMER_WAIT = spin_wait_parity_or_trap
K_SLICE_BYTES = 128            # bytes of K per stage of a 1-byte (FP8) operand row (the SM100 K tile)
TILE_M_ROWS = schedule.MMA_M_ROWS   # rows of the CTA's MMA M side (weight rows when swapped)
TILED_BOX_ROWS, TILED_BOX_BYTES = E2M1H200TiledOrder.BOX_ROWS, E2M1H200TiledOrder.BOX_BYTES
if (TILED_BOX_ROWS, TILED_BOX_BYTES) != (TILE_M_ROWS, K_SLICE_BYTES):
    raise AssertionError("tiled weights' boxes are the swapped configs' weight boxes: 128 rows x 128 B")
# ``StreamSpec.m_rows``: the ring's M side may hold 256 token rows (not swapped, one CTA) for the wgmma
# kernel (``h200_wgmma.WgmmaConfig.tile_tokens``), which decodes each weight tile once for twice the
# tokens; this kernel's own consumers (mma.sync, 128-row warp grid) take 128.
RING_M_ROWS = (TILE_M_ROWS, 2 * TILE_M_ROWS)
WARP_SIZE = 32
QUAD = 4                       # lanes of a quad share an MMA row and split its K slice in 4
GROUP_ELEMENTS = 8             # K elements one decode group covers: 4 bf16x2 registers, 2 MMA steps
MMA_M, MMA_N = 16, 8           # mma.sync.m16n8k16
SMALL_N_MAX_MMA_BN = 32        # the small-N consumer grid: one column of warps, each on all of N
CONSUMER_WARPS_SMALL_N = 4     # mma_bn <= 32: 4 warps x (32 rows, mma_bn)
# ``StreamSpec.small_n_warps``: 8 warps of 16 rows instead of 4 of 32 (still one producer warp, no setmaxnreg):
# twice the warps per scheduler to hide the K slices' latency where CTAs are few (Kimi's split-K runs: one
# consumer warp per scheduler took ~0.9 us per 256-element slice, H200 run 56) or two per SM (32 tokens).
SMALL_N_WARP_CHOICES = (CONSUMER_WARPS_SMALL_N, 2 * CONSUMER_WARPS_SMALL_N)
# 9-warp CTAs built for two per SM (<= 113 registers by the launch bounds; two need <= 96 on the SM's
# sub-partitions, 5 warps each): offline, NVFP4 bn32 takes 94 registers this way (114 built for one, which
# would leave one CTA and 8 consumer warps per SM, as the 4-warp build has now), bn8 79; no local memory.
SMALL_N_EIGHT_WARPS_MIN_CTAS_PER_SM = 2
WARPGROUP_WARPS = 4
# With 8 consumer warps a lone producer warp would make 9 warps, and ptxas caps every thread at 168
# registers (3 warps on one SM sub-partition): the 64-128 fp32 accumulators then spill. Instead the
# producer gets a whole warpgroup (warp 0 issues, warps 1-3 idle) and setmaxnreg moves registers
# between warpgroups. It only redistributes the CTA's launch allocation (384 threads x 168), so
# 4 x 32 x 72 + 8 x 32 x 216 = 64512 exactly (more and setmaxnreg.inc would wait forever). The
# producer's tile walk spills below ~64; the mma_bn = 256 consumers (128 accumulators) fit in 216.
LAUNCH_BOUND_REGISTERS = 168   # ptxas's per-thread allocation for launch bounds (384, 1)
PRODUCER_WARPGROUP_REGISTERS = 72
CONSUMER_WARPGROUP_REGISTERS = 216
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
# (4 x 32 x 128 = 16384). Measured (run 31, W4A8 streaming bn16, re-laid weights): at 133 registers
# only 2 CTAs fit and the 396-CTA grid ran 595 us vs 472 us at 264 CTAs. 4 CTAs need <= 96 registers:
# forced there, ptxas spilled (session 9); since the consumers read work records instead of walking, the FP4
# decode builds take 95 without being forced, and the grid takes the fourth CTA (``resident_pairs``; NVFP4
# decode 279.5 us on 396 CTAs, 274.1 on 528: H200 run 56).
SMALL_N_MIN_CTAS_PER_SM = 3
# 32-token tiles (32 accumulators and 32 decoded-fragment words per thread) do not fit in 128
# registers: built for 3 CTAs, ptxas spilled (W4A8 / MXFP8 bn32: a 32 / 16-byte stack, 11 / 8 spill
# accesses, most in the K-slice loop); built for 2 (141 registers, no stack) they run faster (run 37,
# 32 x 32 tokens: W4A8 339.2 -> 304.7 us, MXFP8 355.3 -> 320.9). FP4 tokens at bn32 need 88 KiB of
# shared memory per CTA: 2 per SM either way.
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

# Element decode: bf16 bits that read as ``value * 2**-ELEMENT_LOG2_OFFSET`` (see the module docstring).
ELEMENT_LOG2_OFFSET = {"e2m1": 126, "e4m3": 120, "e5m2": 112}
# Scale pre-bias d: the scaled operand is ``value * s * 2**-d``; the epilogue multiplies by 2**(d_a + d_b).
SCALE_LOG2_PREBIAS = {"ue4m3": 8, "ue8m0": 16}
BF16_EXPONENT_MAX = 254        # largest biased exponent of a finite bf16
BF16_EXPONENT_SHIFT = 7
BF16_QUIET_NAN_BIT = 0x40
NEG_ZERO_BF16X2 = 0x80008000   # fma addend: x * s + (-0) == x * s exactly, also for x * s == +0
BF16_BYTES = 2
# Decoded tokens (``StreamSpec.predecoded_tokens``): two slots, used by alternate stages. A slot is
# rewritten two stages later, after every consumer warp passed the next stage's barrier, which it
# reaches only when done reading: one named barrier per stage is the whole protocol.
DECODED_TOKEN_SLOTS = 2
CONSUMER_BARRIER = 1           # named barrier id of the consumer warps (0 is __syncthreads)
# Split-K (``choose_k_splits``): a tile's K slices are cut into ``k_splits`` runs taken by different
# CTAs when there are too few tiles to fill the GPU (Kimi decode: 32 tiles for 132 SMs). Each run
# adds its fp32 partial tile into a zeroed workspace (``red.global.add.f32``) and bumps the tile's
# counter; the last one reads the sums back with plain L2 loads (``load_global_cg_f32_if``, all issued
# before the first is used: an ``atom.exch`` per word waited for each in turn; H200 run 118: split launches
# 3.4 us shorter, Kimi decode 3-6 %), rounds to bf16, stores C, zeroes the words for the next launch and resets
# the counter.
# The routing (a_offsets, expert_ids) is copied into shared memory at launch when it has at most
# this many slots: the tile walk then reads shared memory instead of one dependent global load per
# slot it steps over (ncu on Kimi: long-scoreboard stalls first; the producer's first walk alone
# delayed the first TMA by microseconds). Larger routings are walked in global memory.
ROUTING_SMEM_SLOTS = 512
MIN_SLICES_PER_SPLIT = 6       # shorter runs are mostly pipeline fill and epilogue (see h200_plan's notes)
SPLIT_FLAG_WORDS = 1           # shared word after the mbarriers: "this CTA closes the tile"
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
FRAGMENT_WORDS = 4             # one group's B fragments of one token row: (b0, b1) of both k16 steps
# Start-up trace (``StreamSpec.trace``, ``prepare(trace=True)``; a diagnostic build, never the plan): per CTA and
# event one record of (``%globaltimer`` ns, ``%clock64`` cycles), stamped by the producer's first thread (P) or
# lane 0 of consumer warp 0 (C). The buffer's address travels in one more 128-byte slot after the tensor maps,
# so the kernel signature and the untraced builds stay as they are. Events not reached stay 0.
TRACE_EVENTS = ("entry", "barriers_ready", "maps_ready", "producer_work_found", "first_slot_free",
                "first_tma_issued", "producer_exit", "consumer_ready", "first_full", "first_release",
                "first_epilogue", "consumer_exit")
(TRACE_ENTRY, TRACE_BARRIERS, TRACE_MAPS, TRACE_PRODUCER_WORK, TRACE_FIRST_SLOT, TRACE_FIRST_TMA,
 TRACE_PRODUCER_EXIT, TRACE_CONSUMER_READY, TRACE_FIRST_FULL, TRACE_FIRST_RELEASE, TRACE_FIRST_EPILOGUE,
 TRACE_CONSUMER_EXIT) = range(len(TRACE_EVENTS))
# the producer's chain, then the consumers' (both start at the CTA's entry; the first TMA feeds the first full)
TRACE_PRODUCER_CHAIN = (TRACE_ENTRY, TRACE_BARRIERS, TRACE_MAPS, TRACE_PRODUCER_WORK, TRACE_FIRST_SLOT,
                        TRACE_FIRST_TMA, TRACE_PRODUCER_EXIT)
TRACE_CONSUMER_CHAIN = (TRACE_ENTRY, TRACE_CONSUMER_READY, TRACE_FIRST_FULL, TRACE_FIRST_RELEASE,
                        TRACE_FIRST_EPILOGUE, TRACE_CONSUMER_EXIT)
TRACE_RECORD_WORDS = 2         # u64 globaltimer, u64 clock64
TRACE_LATER_TILES = 0x80000000   # the consumer's stage count once its first tile is stamped
TRACE_ADDRESS_OFFSET = np.uint64(cp.TENSOR_MAP_BYTES * NUM_TENSOR_MAPS)   # the slot after the maps
FRAGMENT_BYTES = 4 * FRAGMENT_WORDS


# ----------------------------------------------------------------------------------------------
# Configuration and compile-time spec
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
    row_bytes: int      # bytes of one row's K slice (128, or 64 for FP4 in a 128-element slice)
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
    def swizzle(self) -> str:
        return TMA_SWIZZLE[self.row_bytes]

    @property
    def swizzle_mask(self) -> int:
        return SWIZZLE_MASK[self.row_bytes]

    @property
    def data_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def sf_atoms_per_slice(self) -> int:
        """512-byte scale atoms (4 scale columns each) one 128-row band needs per K slice."""
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
        return self.k_slice // QUAD // self.fmt.block_size

    @property
    def log2_prebias(self) -> int:
        return SCALE_LOG2_PREBIAS[self.fmt.scale_dtype]


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
    split_k: bool = False   # built for split-K runs (``choose_k_splits``): the atomic epilogue
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
        schedule.TileConfig(self.ab_swapped, self.mma_bn, self.cta_group)
        check_layout(self.b_layout, get_format(self.b_format), "b")
        check_layout(self.a_layout, get_format(self.a_format), "a")
        if isinstance(self.stages, (bool, np.bool_)) or not isinstance(self.stages, (int, np.integer)) \
                or self.stages < 1:
            raise ValueError(f"stages must be a positive int, got {self.stages!r}")
        require_small_n_warps(self.small_n_warps)
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

    # -- formats and the K slice --------------------------------------------------------------
    @property
    def k_slice(self) -> int:
        """K elements per stage (``k_slice_elements``)."""
        return k_slice_elements(self.a_format, self.b_format)

    @property
    def pairing(self) -> str:
        """How 8-element groups fill bf16x2 registers: "stride4" with an FP4 operand, else "stride2"."""
        any_fp4 = get_format(self.a_format).packed or get_format(self.b_format).packed
        return "stride4" if any_fp4 else "stride2"

    @property
    def tile_shape(self) -> schedule.TileShape:
        shape = schedule.TileConfig(self.ab_swapped, self.mma_bn, self.cta_group).tile_shape
        return dataclasses.replace(shape, tokens=self.m_rows) if self.m_rows != TILE_M_ROWS else shape

    @property
    def dynamic_items(self) -> bool:
        """Past the first wave (item = CTA), producers take work items from a global counter, so CTAs
        that run faster take more (the CTAs of a static decode schedule finished 249-307 us apart, H200
        run 48). A CTA pair must work on the same tiles, so pairs keep the static schedule."""
        return self.cta_group == 1

    def _side(self, role: str, rows: int, scale_bands: int) -> OperandSide:
        fmt = self.a_format if role == "tokens" else self.b_format
        layout = self.a_layout if role == "tokens" else self.b_layout
        return OperandSide(role, get_format(fmt).name, rows, get_format(fmt).row_bytes(self.k_slice),
                           self.k_slice, scale_bands, layout)

    @property
    def m_side(self) -> OperandSide:
        """The ``m_rows``-row MMA M side (128; 256 token rows in the wgmma kernel's ring): weights when
        swapped, else tokens; one scale band per 128 rows."""
        return self._side("weights" if self.ab_swapped else "tokens", self.m_rows, self.m_rows // SF_ATOM_ROWS)

    @property
    def n_side(self) -> OperandSide:
        """The ``mma_bn``-row MMA N side (every CTA of a pair holds all of it)."""
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
        block scales once; with one group per item (as before, run 31-32) the per-item overhead
        made the token decode a quarter of the 16-token kernel's instructions."""
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
        """(bytes, rows) each CTA loads of the token slice: half the token tile per CTA of a pair."""
        side = self.token_side
        rows = self.mma_bn // self.cta_group if self.ab_swapped else self.m_rows
        return side.row_bytes, rows

    @property
    def weight_box(self) -> tuple[int, int, int]:
        """(bytes, rows, experts) of the weight slice each CTA loads."""
        side = self.weight_side
        return side.row_bytes, (TILE_M_ROWS if self.ab_swapped else self.mma_bn), 1

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
        Every legal ``mma_bn`` (a power of 2, ``dispatch.check_mma_tile``) is a whole number of boxes or
        divides one, so a tile's rows never straddle two boxes. A 256-row tile's second box past N reads
        the next expert's first box (the last expert's: the map's zero fill) where the row-major map reads
        zeros; those rows' outputs are never stored."""
        return -(-self.weight_box[1] // TILED_BOX_ROWS)

    @property
    def scale_box(self) -> tuple[int, int, int]:
        """One 128-row band's atoms of a K slice, as (128 B, 4 rows per atom, 1 band)."""
        return SCALE_MAP_ROW_BYTES, ATOM_MAP_ROWS * self.m_side.sf_atoms_per_slice, 1


def stage_loads(spec: StreamSpec) -> list[tuple[str, int, int, bool]]:
    """The TMA boxes one stage receives in each CTA: (what, stage offset, bytes, multicast).

    Every CTA of a pair receives the same boxes: its own loads plus what the peer multicasts (the
    token rows' halves; token scale bands). The producer issues exactly these (scales one band per
    box); the tests check that they tile the stage and sum to ``tx_bytes``.
    """
    lay, cg = spec.smem, spec.cta_group
    tokens_m = not spec.ab_swapped
    tok_data = lay.m_data if tokens_m else lay.n_data
    tok_sf = lay.m_scales if tokens_m else lay.n_scales
    w_data = lay.n_data if tokens_m else lay.m_data
    w_sf = lay.n_scales if tokens_m else lay.m_scales
    band_bytes = spec.m_side.sf_atoms_per_slice * SF_ATOM_BYTES
    parts = spec.tiled_weight_loads if spec.tiled_weights else 1
    part_bytes = math.prod(spec.weight_box) // parts
    loads = [("weights", w_data + p * part_bytes, part_bytes, False) for p in range(parts)]
    loads += [("weight scales", w_sf + b * band_bytes, band_bytes, False)
              for b in range(spec.weight_side.scale_bands)]
    box_bytes = math.prod(spec.token_box)
    loads += [("tokens", tok_data + r * box_bytes, box_bytes, cg > 1) for r in range(cg)]
    loads += [("token scales", tok_sf + b * band_bytes, band_bytes, cg > 1)
              for b in range(spec.token_side.scale_bands)]
    return loads


# ----------------------------------------------------------------------------------------------
# Device-capable helpers (integer Python: the host tests run them on numpy arrays, the kernel
# compiles them as device functions)
# ----------------------------------------------------------------------------------------------
E2M1_SPREAD = 0x1040          # nibble x (2**6 + 2**12): copies at bits 6..9 and 12..15, no overlap
E2M1_KEEP = 0x81C081C0        # magnitude of the first copy (bf16 bits 6..8), sign of the second (15)


def e2m1_pair_bits(word, j):
    """bf16x2 bits of FP4 elements ``j`` (low half) and ``j + 4`` (high half) of a 32-bit word of 8
    packed E2M1 codes (element i in nibble i), each reading as ``value * 2**-126``: the 3 magnitude
    bits land on bf16 bits 6..8 and the sign on bit 15 (so code 1 = 0.5 is the bf16 subnormal
    2**-127). One multiply does both moves: mask the nibble pair, multiply by ``2**6 + 2**12``
    (shifted down for odd ``j``), keep bits ``E2M1_KEEP``; ``j`` = 2, 3 first drop one byte."""
    if j >= 2:
        word = word >> 8
    odd = 4 * (j % 2)
    nibbles = word & (0x000F000F << odd)
    return np.uint32((nibbles * (E2M1_SPREAD >> odd)) & E2M1_KEEP)


# E2M1H200Order's decode constants as plain module names (numba reads globals, not class attributes)
H200_ORDER_MASK = E2M1H200Order.BF16_MASK
H200_ORDER_SHIFT_STEP = E2M1H200Order.SLOT_SHIFT_STEP
H200_ORDER_PRESHIFT = E2M1H200Order.SPREAD_PRESHIFT
H200_ORDER_SPREAD_MASK = E2M1H200Order.SPREAD_MASK
H200_ORDER_MULTIPLIER = E2M1H200Order.SPREAD_MULTIPLIER


def e2m1_h200_pair_bits(word, j):
    """``e2m1_pair_bits`` of the original word, from a word in ``E2M1H200Order`` (weights re-laid once
    with ``GroupedProblem.with_b_layout``): registers 0..2 are a mask of the word shifted left by 0, 3
    or 6; register 3 gathers its 8 spread bits with one multiply."""
    word = np.uint32(word)
    if j < 3:
        return np.uint32((word << np.uint32(H200_ORDER_SHIFT_STEP * j)) & np.uint32(H200_ORDER_MASK))
    spread = (word >> np.uint32(H200_ORDER_PRESHIFT)) & np.uint32(H200_ORDER_SPREAD_MASK)
    return np.uint32((spread * np.uint32(H200_ORDER_MULTIPLIER)) & np.uint32(H200_ORDER_MASK))


def fp8_pair_bits(word0, word1, j, e5m2, stride4):
    """bf16x2 bits of register ``j`` (0..3) of an 8-element FP8 group ``word0 | word1 << 32``, each
    reading as ``value * 2**-120`` (E4M3) or ``value * 2**-112`` (E5M2).

    The two codes are first put in bits 8..15 and 24..31 (sign already at bf16 bit 15 / 31), then
    exponent and mantissa move down to bf16 bits 4..10 (E4M3) or 5..11 (E5M2).
    ``stride4`` (the FP4 pairing, for W4A8): elements ``(j, j + 4)``. Otherwise ``(0, 2), (1, 3),
    (4, 6), (5, 7)`` for j = 0..3: bytes 0/2 of a word shifted up by 8, bytes 1/3 in place."""
    word0, word1 = np.int64(word0), np.int64(word1)   # one integer type for numba's typing
    if stride4:
        u = (((word0 >> (8 * j)) & 0xFF) << 8) | (((word1 >> (8 * j)) & 0xFF) << 24)
    else:
        word = word0 if j < 2 else word1
        u = word << 8 if j % 2 == 0 else word
    if e5m2:
        return np.uint32((u & 0x80008000) | ((u >> 3) & 0x0FE00FE0))
    return np.uint32((u & 0x80008000) | ((u >> 4) & 0x07F007F0))


def pair_elements(j, pairing):
    """Group-element indices (low half, high half) of register ``j`` under ``pairing`` (host only)."""
    if pairing == "stride4":
        return j, j + 4
    return ((0, 2), (1, 3), (4, 6), (5, 7))[j]


def ue8m0_scale_bits(scale_byte, exponent_offset):
    """bf16x2 bits (the same value in both halves) of the UE8M0 scale ``2**(byte - 127)`` times
    ``2**exponent_offset`` (``exponent_offset = c - d``): the byte plus the offset is the bf16 biased
    exponent; saturates to Inf past the bf16 range; byte 0xFF gives NaN."""
    biased = min(scale_byte + exponent_offset, BF16_EXPONENT_MAX + 1)
    bits = (biased << BF16_EXPONENT_SHIFT) | (((scale_byte + 1) >> 8) * BF16_QUIET_NAN_BIT)
    return np.uint32(bits | (bits << 16))


UE8M0_LANES = 0x00010001        # 1 in each 16-bit lane
UE8M0_LANE_INF = 0x7F807F80     # bf16 +Inf in each lane
UE8M0_LANE_QUIET = 0x00400040   # the bf16 quiet-NaN bit of each lane


def _ue8m0_pair_scale_bits(lane_min):
    """``ue8m0_pair_scale_bits`` with ``lane_min`` as the 16-bit-lane unsigned minimum (the device's
    ``min_u16x2`` or the host's ``min_u16x2_host``): one body for the kernels and for the tests."""
    def pair_scale_bits(lanes, exponent_offset):
        lanes = np.uint32(lanes)
        # each lane's (byte + offset) << 7 (below 0x10000: no lane carries into the next) is the scale's
        # bf16 while byte + offset <= 254, and at least +Inf's 0x7F80 past it: the minimum saturates
        biased = np.uint32(lanes * np.uint32(1 << BF16_EXPONENT_SHIFT)
                           + np.uint32((exponent_offset << BF16_EXPONENT_SHIFT) * UE8M0_LANES))
        quiet = (np.uint32(lanes + np.uint32(UE8M0_LANES)) >> np.uint32(2)) & np.uint32(UE8M0_LANE_QUIET)
        return np.uint32(lane_min(biased, np.uint32(UE8M0_LANE_INF)) | quiet)
    return pair_scale_bits


ue8m0_pair_scale_bits = _ue8m0_pair_scale_bits(min_u16x2_host)
ue8m0_pair_scale_bits.__doc__ = """``ue8m0_scale_bits`` of two scale bytes at once: ``lanes`` holds them
zero-extended in its 16-bit lanes (byte 0 in bits 0..7, byte 1 in bits 16..23); returns the bf16 image of each in
its lane. Each lane's ``(byte + offset) << 7`` is below 0x10000 (``exponent_offset`` < 257), so one 32-bit
multiply-add serves both lanes; its lane minimum with +Inf saturates, and bit 8 of ``lane + 1`` flags the NaN byte
0xFF: 5 instructions for two scales (``LEA``, ``VIMNMX.U16x2``, ``VIADD``, ``SHF``, ``LOP3``; 10 with integer
saturation, ~9 each with per-byte conversions: MXFP4 decode's per-stage scale work, ncu run 34). Host form; the
kernels compile the same body with ``arith.min_u16x2`` (``_ue8m0_pair_scale_bits``)."""


UE4M3_CODE_SHIFT, UE4M3_CODE_LANE_ADDEND = UE4M3H200Scales.CODE_SHIFT, UE4M3H200Scales.LANE_ADDEND


def ue4m3_code_pair_bits(lanes):
    """bf16x2 bits of two ``UE4M3H200Scales`` codes held zero-extended in the 16-bit lanes of ``lanes``
    (code 0 in bits 0..7, code 1 in bits 16..23): each lane's ``(code << 4) + (235 << 7)`` with one shift
    and one add; no lane carries into the next (``UE4M3H200Scales``)."""
    return np.uint32(np.uint32(np.uint32(lanes) << np.uint32(UE4M3_CODE_SHIFT)) + np.uint32(UE4M3_CODE_LANE_ADDEND))


def byte_pair_selector(first_byte):
    """``prmt`` selector that puts bytes ``first_byte`` and ``first_byte + 1`` of a word, zero-extended,
    into the two 16-bit lanes (the selector's 4 picks byte 0 of a zero second operand)."""
    return np.uint32(0x4040 | first_byte | ((first_byte + 1) << 8))


def byte_broadcast_selector(byte):
    """``prmt`` selector that puts byte ``byte`` of a word, zero-extended, into both 16-bit lanes."""
    return np.uint32(0x4040 | byte | (byte << 8))


ROTATION_RUN = 4   # groups are rotated inside aligned runs of 4 (every thread range has 4 or 8 groups)


def rotated_group(gi, q):
    """Group a quad lane ``q`` visits at step ``gi``: rotated by ``q`` inside aligned runs of 4, so
    the lanes of one shared-memory load use different banks while a scale block (4 groups of
    8 elements for 32-element blocks) is still visited at the same step by every lane. 32-bit."""
    gi = np.uint32(gi)
    return np.uint32((gi & np.uint32(~(ROTATION_RUN - 1) & 0xFFFFFFFF))
                     | (np.uint32(gi + np.uint32(q)) & np.uint32(ROTATION_RUN - 1)))


def scale_word_column(q, blocks_per_thread):
    """First scale column of the 4-column (one u32 per row) word that holds quad lane ``q``'s
    ``blocks_per_thread`` block scales of a K slice."""
    return (q * blocks_per_thread) // SF_ATOM_COLS * SF_ATOM_COLS


def scale_byte_index(q, blocks_per_thread, block):
    """Byte of that word holding the scale of the lane's ``block``-th block."""
    return (q * blocks_per_thread) % SF_ATOM_COLS + block


def bf16_broadcast_selector(index):
    """``prmt`` selector that copies bf16 number ``index`` (0..3) of the 8 bytes ``b:a`` into both
    halves of the result."""
    lo = 2 * index
    return (lo | ((lo + 1) << 4)) * 0x101


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


def swizzle_xor(row, row_bytes, mask):
    """What TMA's 128B (mask 7) / 64B (mask 3) swizzle XORs into the in-row byte offset of row
    ``row`` of a 1024-byte aligned tile with ``row_bytes``-byte rows (16-byte chunk bits 4.. XOR
    address bits 7..): the same for rows 8 apart, so a thread computes it once."""
    return ((row * row_bytes) >> 7 & mask) << 4


def group_column(q, gl, thread_bytes, group_bytes, xor):
    """Swizzled in-row byte offset of local group ``gl`` of quad lane ``q`` (32-bit arithmetic)."""
    return np.uint32(np.uint32(np.uint32(q * thread_bytes) + np.uint32(gl * group_bytes)) ^ np.uint32(xor))


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


def swizzled_offset(row, col, row_bytes, mask):
    """Byte offset of byte ``col`` (< row_bytes) of row ``row`` in such a swizzled tile."""
    return row * row_bytes + (col ^ swizzle_xor(row, row_bytes, mask))


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
def kernel_signature():
    """Argument types of every kernel of the family (the offline compile uses the same)."""
    u32_1d = types.Array(types.uint32, 1, "C")
    return (types.uint64, u32_1d, u32_1d, types.Array(types.int32, 1, "C"), types.Array(types.float32, 1, "C"),
            types.Array(types.uint16, 2, "C"), types.int64, types.int64, types.int64,
            types.Array(types.float32, 2, "C"), u32_1d, types.int64, types.int64)


def _device(func):
    return cuda.jit(device=True, forceinline=True)(func)


def _make_side_reader(side: OperandSide, pairing: str):
    """Device functions for one MMA side: ``load_group(address) -> (w0, w1)`` (w1 unused for FP4),
    ``decode(w0, w1, j)`` (unscaled bf16x2 bits of register j of the group), ``load_scales(address,
    q) -> (s0, s1)`` (per row and K slice: UE4M3 -> the two packed bf16x2 pairs of 4 blocks; UE8M0 ->
    the bf16x2 scale of each of the thread's 1 or 2 blocks), ``scale_selector(gl)`` and
    ``group_scale(s0, s1, selector, run)``: the scale of local group ``gl`` (visited at step ``gi``, in
    rotation run ``run = gi // ROTATION_RUN``),
    picked by ``selector = scale_selector(gl)`` for UE4M3 (which is affine in the group's rotation run:
    ``scale_selector_run_step``) and by the run for UE8M0 (a block is one run)."""
    element = side.element
    stride4 = pairing == "stride4"
    e5m2 = element == "e5m2"
    exponent_offset = ELEMENT_LOG2_OFFSET[element] - side.log2_prebias
    blocks = side.blocks_per_thread
    groups_per_block = side.groups // blocks
    ue4m3 = side.fmt.scale_dtype == "ue4m3"
    ue4m3_coded = ue4m3 and word_order(side.layout) == LAYOUT_E2M1_H200   # scale bytes are UE4M3H200Scales codes
    if ue4m3_coded and exponent_offset != UE4M3H200Scales.LOG2_MULTIPLIER:
        raise AssertionError("UE4M3H200Scales codes hold s * 2**118: the E2M1 x UE4M3 exponent offset")
    ue4m3_convert = e4m3x4_to_bf16x2(exponent_offset) if ue4m3 and not ue4m3_coded else None
    e2m1_bits = _device(e2m1_h200_pair_bits if word_order(side.layout) == LAYOUT_E2M1_H200 else e2m1_pair_bits)
    fp8_bits = _device(fp8_pair_bits)
    ue8m0_pair_bits = _device(_ue8m0_pair_scale_bits(min_u16x2))
    pair_selector = _device(byte_pair_selector)
    broadcast_byte = _device(byte_broadcast_selector)
    code_pair_bits = _device(ue4m3_code_pair_bits)
    byte_index = _device(scale_byte_index)
    broadcast_selector = _device(bf16_broadcast_selector)

    if side.packed:
        @_device
        def load_group(address):
            return ld_shared_u32(address), np.uint32(0)

        @_device
        def decode(w0, w1, j):
            return e2m1_bits(w0, j)
    else:
        @_device
        def load_group(address):
            return ld_shared_v2_u32(address)

        @_device
        def decode(w0, w1, j):
            return fp8_bits(w0, w1, j, e5m2, stride4)

    if ue4m3_coded:
        @_device
        def load_scales(address, q):
            # codes 0, 1 and 2, 3 into the 16-bit lanes, then one shift-add makes both bf16
            word = ld_shared_u32(address)
            return (code_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(0))),
                    code_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(2))))
    elif ue4m3:
        @_device
        def load_scales(address, q):
            return ue4m3_convert(ld_shared_u32(address))

    if ue4m3:
        @_device
        def scale_selector(gl):
            # the lane's 4 blocks are bf16 0..3 of s1:s0; group gl lies in block gl // groups_per_block
            return np.uint32(broadcast_selector(gl // groups_per_block))

        @_device
        def group_scale(s0, s1, selector, run):
            return prmt_b32(s0, s1, selector)
    else:
        if not 0 <= exponent_offset < 2 ** 8:
            raise AssertionError("ue8m0_pair_scale_bits: each lane (byte + offset) << 7 must stay below 0x10000")

        @_device
        def load_scales(address, q):
            word = ld_shared_u32(address)
            if blocks == 1:   # the one scale into both lanes: its bf16 twice
                s0 = ue8m0_pair_bits(prmt_b32(word, np.uint32(0), broadcast_byte(byte_index(q, blocks, 0))),
                                     exponent_offset)
                return s0, s0
            pair = ue8m0_pair_bits(prmt_b32(word, np.uint32(0), pair_selector(byte_index(q, blocks, 0))),
                                   exponent_offset)
            return (prmt_b32(pair, pair, np.uint32(broadcast_selector(0))),
                    prmt_b32(pair, pair, np.uint32(broadcast_selector(1))))

        @_device
        def scale_selector(gl):
            return np.uint32(0)

        if groups_per_block != ROTATION_RUN:
            raise AssertionError("UE8M0 blocks (32 elements) are one rotation run of 8-element groups")

        @_device
        def group_scale(s0, s1, selector, run):
            # a UE8M0 block is one rotation run, so the choice is static per run (the caller passes
            # the run, not the group: a division per group cost MXFP4 decode ~8 % of its SASS)
            if run == 0:
                return s0
            return s1

    return load_group, decode, load_scales, scale_selector, group_scale


def scale_selector_run_step(side: OperandSide) -> int:
    """What one rotation run (``ROTATION_RUN`` groups) adds to a UE4M3 ``prmt`` selector: the run
    moves ``ROTATION_RUN // groups_per_block`` blocks on, and each block adds 2 to both selector
    nibbles of each result half (``bf16_broadcast_selector`` is affine)."""
    if side.fmt.scale_dtype != "ue4m3":
        return 0
    groups_per_block = side.groups // side.blocks_per_thread
    return (ROTATION_RUN // groups_per_block) * (bf16_broadcast_selector(1) - bf16_broadcast_selector(0))


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
    stamp: object           # (tensor_maps, event): the start-up trace record of this CTA (trace builds)
    write_work_record: object  # (bars, stage, expert, tile, t0, t1, r0, r1, first slice, group start): producer
    unpack_work_record: object  # (4 record words) -> the item's fields
    read_work_record: object   # (bars, stage, lane) -> the item whose first K slice the stage holds


def make_ring(spec: StreamSpec) -> RingDeviceFunctions:
    """Device functions of ``spec``'s ring: a fresh set per call (see ``schedule.device_functions``).

    ``produce(dyn, bars, tensor_maps, a_offsets, a_scale_offsets, expert_ids, shared_offsets,
    shared_expert_ids, n, k_slices, max_tiles, split_counters, k_splits, slices_per_split)`` runs in every
    thread of the producer warps: thread 0 initialises ``full[s]`` (count 1) and ``empty[s]`` (count
    ``spec.consumer_warps * cta_group``: one arrival per consumer warp of each CTA of the pair) in
    ``bars``, all meet at ``block_sync``, then thread 0 takes the CTA's work items (item = pair index, then
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
    sf_band_bytes = spec.m_side.sf_atoms_per_slice * SF_ATOM_BYTES
    tok_bands, w_bands = spec.token_side.scale_bands, spec.weight_side.scale_bands
    empty_count = spec.consumer_warps * cta_group
    token_band_of = _device(token_scale_band)
    weight_band_of = _device(weight_scale_band)
    trace = spec.trace
    dynamic_items = spec.dynamic_items
    record_base = lay.work_record_base
    tiled = spec.tiled_weights
    tiled_loads = spec.tiled_weight_loads
    tiled_part_bytes = w_slice_bytes * min(spec.weight_box[1], TILED_BOX_ROWS)
    tiled_row_of = _device(tiled_weight_row)
    fused = spec.fused_weight_scales
    chunk_rows = spec.weight_chunk_rows

    @_device
    def stamp(tensor_maps, event):
        """This CTA's record of ``event`` in the trace buffer (trace builds only; the caller picks the thread)."""
        record = (np.uint64(cuda.blockIdx.x) * np.uint64(len(TRACE_EVENTS)) + np.uint64(event)) * np.uint64(
            8 * TRACE_RECORD_WORDS)
        address = cm.load_global_u64(tensor_maps + TRACE_ADDRESS_OFFSET) + record
        cm.store_global_u64(address, cm.read_globaltimer())
        cm.store_global_u64(address + np.uint64(8), cm.read_clock64())

    @_device
    def copy_routing(a_offsets, expert_ids, shared_offsets, shared_expert_ids):
        num_slots = expert_ids.shape[0]
        if num_slots <= ROUTING_SMEM_SLOTS:   # read by the walk after the block sync of each role
            i = cuda.threadIdx.x   # not range(): a run-time step divides
            while i <= num_slots:
                shared_offsets[i] = a_offsets[i]
                if i < num_slots:
                    shared_expert_ids[i] = expert_ids[i]
                i += cuda.blockDim.x

    @_device
    def routing_views(a_offsets, expert_ids, shared_offsets, shared_expert_ids):
        """The routing the tile walk reads: the shared copy when it holds every slot, else global."""
        num_slots = expert_ids.shape[0]
        if num_slots <= ROUTING_SMEM_SLOTS:
            return shared_offsets[:num_slots + 1], shared_expert_ids[:num_slots]
        return a_offsets[:], expert_ids[:]

    @_device
    def cta_position():
        """(rank in the pair, pair index, number of pairs) of this CTA."""
        rank = np.int64(0)
        if cta_group > 1:
            rank = np.int64(cl.cluster_ctarank())
        return rank, np.int64(cuda.blockIdx.x // cta_group), np.int64(cuda.gridDim.x // cta_group)

    @_device
    def block_sync():
        """Every thread of the CTA (and of the pair): after the mbarrier init, before exit."""
        if cta_group > 1:
            cl.cluster_arrive_release()
            cl.cluster_wait_acquire()
        else:
            cuda.syncthreads()

    @_device
    def next_work(work, cursor_slot, cursor_first, a_offsets, expert_ids, n, k_splits, slices_per_split):
        """Work item ``work`` (a tile, or with split-K one run of a tile's K slices): its tile, found
        by walking from the cursor (the first tile ``cursor_first`` of slot ``cursor_slot``):
        amortised O(1) per item instead of O(slots). Returns (slot, expert, tile, t0, t1, r0, r1,
        first K slice, new cursor); slot < 0 past the last tile. ``schedule.locate_tile``'s walk in
        32-bit arithmetic (tile and token counts fit): a launch's first walk is slow cold (4.35 us, the same
        walk again 0.77 us: H200 run 50; instruction fetch or first data / parameter reads, not yet told
        apart), and the 64-bit walk was ~3x the SASS with a 64-bit division call."""
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

    @_device
    def write_work_record(bars, stage, expert, tile, t0, t1, r0, r1, s_begin, group_start):
        """The record of the work item whose first K slice stage ``stage`` holds (``WORK_RECORD_WORDS``)."""
        rec = record_base + WORK_RECORD_WORDS * stage
        bars[rec] = np.uint64(expert) | (np.uint64(tile) << np.uint64(32))
        bars[rec + 1] = np.uint64(t0) | (np.uint64(t1) << np.uint64(32))
        bars[rec + 2] = np.uint64(r0) | (np.uint64(r1) << np.uint64(32))
        bars[rec + 3] = np.uint64(s_begin) | (np.uint64(group_start) << np.uint64(32))

    @_device
    def unpack_work_record(w0, w1, w2, w3):
        """(expert, tile, t0, t1, r0, r1, first K slice, group start) of a record's words (int32 expert, -1: no
        more work; the rest u32: half the registers of int64 across the K loop)."""
        low, high = np.uint64(0xFFFFFFFF), np.uint64(32)
        return (np.int32(np.uint32(w0 & low)), np.uint32(w0 >> high), np.uint32(w1 & low), np.uint32(w1 >> high),
                np.uint32(w2 & low), np.uint32(w2 >> high), np.uint32(w3 & low), np.uint32(w3 >> high))

    @_device
    def read_work_record(bars, stage, lane):
        """The record of stage ``stage`` (``unpack_work_record``), read by lane 0 and handed to its warp: the
        lane that reads it is then the lane whose arrival on ``empty`` lets the producer rewrite it (with
        every lane reading, compute-sanitizer's racecheck reported read / write hazards between the other
        lanes' reads and the producer's next record: H200 run 54)."""
        rec = record_base + WORK_RECORD_WORDS * np.uint32(stage)
        w0 = w1 = w2 = w3 = np.int64(0)
        if lane == 0:
            w0, w1, w2, w3 = np.int64(bars[rec]), np.int64(bars[rec + 1]), np.int64(bars[rec + 2]), np.int64(bars[rec + 3])
        warp = np.uint32(0xFFFFFFFF)
        return unpack_work_record(np.uint64(cuda.shfl_sync(warp, w0, 0)), np.uint64(cuda.shfl_sync(warp, w1, 0)),
                                  np.uint64(cuda.shfl_sync(warp, w2, 0)), np.uint64(cuda.shfl_sync(warp, w3, 0)))

    @_device
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
            if trace:
                stamp(tensor_maps, TRACE_BARRIERS)
            # every acquire first, then every prefetch: ptxas puts a full DEPBAR before each acquire
            # (UTMACCTL.IV), which would otherwise wait for the previous map's prefetch round trip
            for i in range(NUM_TENSOR_MAPS):
                cp.fence_proxy_tensormap_acquire_sys(tensor_maps + np.uint64(cp.TENSOR_MAP_BYTES * i))
            for i in range(NUM_TENSOR_MAPS):
                cp.prefetch_tensormap(tensor_maps + np.uint64(cp.TENSOR_MAP_BYTES * i))
            if trace:
                stamp(tensor_maps, TRACE_MAPS)
                first_tma = True
            map_tokens, map_weights = tensor_maps + MAP_TOKENS, tensor_maps + MAP_WEIGHTS
            map_token_sf, map_weight_sf = tensor_maps + MAP_TOKEN_SCALES, tensor_maps + MAP_WEIGHT_SCALES
            weight_bands_per_expert = (n + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS
            stage = np.int64(0)
            phase = np.int64(0)
            cursor_slot = np.uint32(0)
            cursor_first = np.uint32(0)
            counter = split_counters.shape[0] - SCHEDULE_COUNTER_WORDS
            work = pair   # a while loop: range() with a run-time step divides (a 64-bit division call)
            while work < max_tiles * k_splits:
                slot, expert, tile, t0, t1, r0, r1, s_begin, cursor_slot, cursor_first = next_work(
                    work, cursor_slot, cursor_first, walk_offsets, walk_expert_ids, n, k_splits, slices_per_split)
                if trace and first_tma:
                    stamp(tensor_maps, TRACE_PRODUCER_WORK)
                if slot < 0:
                    break
                group_start = np.int64(walk_offsets[slot])
                token_band = token_band_of(group_start, np.int64(a_scale_offsets[slot]), t0)
                w_row0 = r0 + rank * TILE_M_ROWS if swapped else r0
                w_band = weight_band_of(expert, weight_bands_per_expert, w_row0)
                for s in range(s_begin, min(s_begin + slices_per_split, k_slices)):
                    full = np.uint32(bar0 + MBARRIER_BYTES * stage)
                    empty = np.uint32(full + MBARRIER_BYTES * stages)
                    if cta_group > 1:   # the peer's consumers released it too (cluster acquire)
                        wait_parity_cluster_or_trap(empty, phase ^ 1)
                    else:
                        wait_parity_or_trap(empty, phase ^ 1)
                    if trace and first_tma:
                        stamp(tensor_maps, TRACE_FIRST_SLOT)
                    if s == s_begin:   # before the arrival that releases it
                        write_work_record(bars, stage, np.uint32(expert), np.uint32(tile), np.uint32(t0),
                                          np.uint32(t1), np.uint32(r0), np.uint32(r1), np.uint32(s_begin),
                                          np.uint32(group_start))
                    mb.mbarrier_arrive_expect_tx(full, tx_bytes)
                    dst = np.uint32(base + stage * stage_bytes)
                    sf_row = s * sf_rows_per_slice   # atoms of slice s, as rows of the scale maps
                    k_byte = s * w_slice_bytes
                    if tiled:
                        for p in range(tiled_loads):
                            w_row = tiled_row_of(np.int64(expert), w_row0 + p * TILED_BOX_ROWS, k_byte,
                                                 n // TILED_BOX_ROWS, k_slices * w_slice_bytes // TILED_BOX_BYTES,
                                                 chunk_rows)
                            cp.tma_load_2d(dst + w_data_off + p * tiled_part_bytes, map_weights,
                                           k_byte % TILED_BOX_BYTES, w_row, full)
                    else:
                        cp.tma_load_3d(dst + w_data_off, map_weights, k_byte, w_row0, expert, full)
                    for b in range(w_bands):
                        if fused:   # the atoms after the box of band b's rows; W4A8: after the other half's
                            chunk = tiled_row_of(np.int64(expert), (w_row0 // TILED_BOX_ROWS + b) * TILED_BOX_ROWS,
                                                 k_byte, n // TILED_BOX_ROWS,
                                                 k_slices * w_slice_bytes // TILED_BOX_BYTES, chunk_rows)
                            cp.tma_load_2d(dst + w_sf_off + b * sf_band_bytes, map_weight_sf, 0,
                                           chunk + TILED_BOX_ROWS + k_byte % TILED_BOX_BYTES // w_slice_bytes
                                           * sf_rows_per_slice, full)
                        else:
                            cp.tma_load_3d(dst + w_sf_off + b * sf_band_bytes, map_weight_sf, 0, sf_row,
                                           w_band + b, full)
                    if cta_group > 1:   # each CTA loads its half of the tokens for both
                        cp.tma_load_2d_multicast(dst + tok_data_off + rank * tok_box_bytes, map_tokens,
                                                 s * tok_slice_bytes, t0 + rank * tok_box_rows, full,
                                                 MULTICAST_PAIR)
                        if tok_bands > 1:
                            cp.tma_load_3d_multicast(dst + tok_sf_off + rank * sf_band_bytes, map_token_sf, 0,
                                                     sf_row, token_band + rank, full, MULTICAST_PAIR)
                        elif rank == 0:
                            cp.tma_load_3d_multicast(dst + tok_sf_off, map_token_sf, 0, sf_row, token_band, full,
                                                     MULTICAST_PAIR)
                    else:
                        cp.tma_load_2d(dst + tok_data_off, map_tokens, s * tok_slice_bytes, t0, full)
                        for b in range(tok_bands):
                            cp.tma_load_3d(dst + tok_sf_off + b * sf_band_bytes, map_token_sf, 0, sf_row,
                                           token_band + b, full)
                    if trace and first_tma:
                        stamp(tensor_maps, TRACE_FIRST_TMA)
                        first_tma = False
                    stage += 1
                    if stage == stages:
                        stage = 0
                        phase ^= 1
                if dynamic_items:   # the ring ahead of the consumers hides the atomic's round trip
                    work = np.int64(cuda.atomic.add(split_counters, counter, np.uint32(1))) + num_pairs
                else:
                    work += num_pairs
            # no more work: a record that says so, armed with no bytes
            full = np.uint32(bar0 + MBARRIER_BYTES * stage)
            empty = np.uint32(full + MBARRIER_BYTES * stages)
            if cta_group > 1:
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
            if trace:
                stamp(tensor_maps, TRACE_PRODUCER_EXIT)

    return RingDeviceFunctions(copy_routing, cta_position, block_sync, next_work, produce,
                               walk.cta_output_rows, stamp, write_work_record, unpack_work_record,
                               read_work_record)


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
    stamp, trace = ring.stamp, spec.trace
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
    decoded_offset = _device(decoded_token_offset)
    token_item = _device(token_decode_item)
    sf_row_step = _device(scale_row_step)
    n_group_words = n_side.group_bytes // 4
    m_load, m_decode, m_load_scales, m_selector, m_group_scale = _make_side_reader(m_side, spec.pairing)
    n_load, n_decode, n_load_scales, n_selector, n_group_scale = _make_side_reader(n_side, spec.pairing)
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
    sf_offset = _device(scale_byte_offset)
    rotated = _device(rotated_group)
    swizzle = _device(swizzle_xor)
    word_column = _device(scale_word_column)
    column = _device(group_column)
    prefetch = spec.prefetch_groups

    @_device
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
        if trace and cuda.threadIdx.x == 0:
            stamp(tensor_maps, TRACE_ENTRY)
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
            tracer = trace and cw == 0 and lane == 0   # the consumer thread that stamps (trace builds)
            traced_stages = np.uint32(0)
            stage = np.uint32(0)   # 32-bit: numba widens uint32 arithmetic, so every update casts back
            phase = np.uint32(0)
            if tracer:
                stamp(tensor_maps, TRACE_CONSUMER_READY)
            # one work item per pass, as the producer's records say; the bound is never reached first (a record
            # ends the loop) but keeps the loop warp-uniform for ptxas: with `while True` it moved the decoded
            # slot's base out of a uniform register and the K-slice loop grew by 7 instructions (NVFP4 bn8)
            item = np.int64(0)
            while item < max_tiles * k_splits:
                CONSUMER_WAIT(np.uint32(np.uint32(bar0) + np.uint32(MBARRIER_BYTES * stage)), phase)
                expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
                if expert < 0:
                    break
                if tracer and traced_stages == 0:
                    stamp(tensor_maps, TRACE_FIRST_FULL)
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
                    # the thread's rows (its rotated group in run 0, moved by whole runs: disjoint
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
                    if tracer and traced_stages == 0:
                        stamp(tensor_maps, TRACE_FIRST_RELEASE)
                    traced_stages = np.uint32(traced_stages + np.uint32(1))
                    decoded_slot ^= np.uint32(1)
                    stage = np.uint32(stage + np.uint32(1))
                    if stage == np.uint32(stages):
                        stage = np.uint32(0)
                        phase = np.uint32(phase ^ np.uint32(1))
                # epilogue: C[token, row] = bf16(acc * 2**epilogue_log2 * expert_scales[e])
                if tracer and traced_stages != 0 and traced_stages < np.uint32(TRACE_LATER_TILES):
                    stamp(tensor_maps, TRACE_FIRST_EPILOGUE)
                    traced_stages = np.uint32(TRACE_LATER_TILES)   # later tiles: no stamps
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
            if tracer:
                stamp(tensor_maps, TRACE_CONSUMER_EXIT)
        if cta_group > 1:   # no CTA of a pair exits while its peer may still multicast or arrive
            cl.cluster_arrive_release()
            cl.cluster_wait_acquire()

    return grouped_matmul_h200_stream


def k_slice_elements(a_format, b_format) -> int:
    """K elements per stage of a format pair (names or ``BlockFormat``): 256 when both operands are FP4 (128 bytes
    each), else 128."""
    both_fp4 = get_format(a_format).packed and get_format(b_format).packed
    return 2 * K_SLICE_BYTES if both_fp4 else K_SLICE_BYTES
