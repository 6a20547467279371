"""The H200 (sm_90a) prefill path: the grouped block-scaled matmul on ``wgmma`` (warpgroup MMA), for large
prefill (tokens on wgmma M) and, swapped, for small prefill (weights on wgmma M).

Run it through ``gbs.grouped_matmul(problem)`` (``"auto"`` picks it on an H200 for prefill: ``gbs.plan``),
``gbs.grouped_matmul(problem, backend="h200_wgmma")``, or directly::

    from gbs.numba_kernels import h200_launch, launch
    from gbs.plan import plan_h200
    prepared = h200_launch.prepare(launch.to_device(problem), plan_h200(problem, backend="h200_wgmma"))
    prepared()                       # enqueue; prepared.out holds C (bf16 bits)

The streaming kernel (``h200_stream``) feeds ``mma.sync`` from registers that every consumer warp
decodes itself: right for decode, where the weight bytes bound the time, but far from the tensor cores'
rate on prefill. Hopper has no FP4 MMA and no block-scale hardware, so here the operands are decoded to bf16
(exactly, scale applied: ``h200_decode``) and the tensor cores get warpgroup MMAs. Design:
``docs/design/h200_port.md``. Per CTA (one per SM, 384 threads):

* The ring is ``h200_ring``'s (``make_ring``: the streaming kernel's tile walk, work records and dynamic items,
  TMA maps, 128x4 scale atoms, producer warpgroup), for a not-swapped ``128 x mma_bn`` tile: 128 tokens (wgmma
  M) by ``mma_bn`` weight rows (wgmma N, 128 or 256). The consumers take each tile from the producer's record
  in the stage of its first K slice. ``setmaxnreg`` leaves the producer 40 registers and gives the consumers
  232.
* Two consumer warpgroups, 64 tokens each. Per sub-step (``WgmmaSpec.sub_k``: 64 elements of K, or
  128 = half a raw K slice when both operands are FP4 and ``mma_bn`` is 128):
  - the 256 threads decode the tile's weight rows from the raw stage, scaled, into the wgmma B
    operand (canonical K-major, 128B swizzle, ``b_buffer_offset``) in one of ``BF16_BUFFERS`` shared
    buffers; a warp's 32 lanes cover 8 rows x 4 group steps, so its raw loads hit distinct banks
    (16 rows x 2 steps with 64-element sub-steps: at most 2 words per bank; by ncu, a first version
    where a warp read 32 rows at one column had 3.9-way conflicts: evidence: wgmma-ncu-run17);
  - each thread decodes its token rows straight into wgmma A fragments (registers; two sets that
    alternate, since an in-flight wgmma still reads the previous set);
  - ``wait_group 1`` (the MMAs of two sub-steps ago are done), a named barrier of the 256 threads
    (the buffer is complete), then each warpgroup issues ``wgmma.mma_async.m64n{mma_bn}k16.f32.bf16.bf16``
    per 16 elements of K, commits, and decodes the next sub-step while they run. With three buffers
    a buffer is rewritten only after every thread passed a wait that covers its MMAs.
* Epilogue: ``wait_group 0``, ``C = bf16(acc * 2**epilogue_log2 * expert_scales[e])``, paired 4-byte
  stores where both columns are in range (rows of skipped slots are never written).
* ``WgmmaSpec.tile_tokens`` = 256 (``mma_bn`` 128): the ring's M side holds 256 token rows (two scale
  bands, ``h200_ring.StreamSpec.m_rows``) and each warpgroup runs two m64 tiles (rows ``r`` and ``r + 128``)
  on the same B buffer, so the weights are decoded once for twice the tokens (the weight decode is about a
  quarter of NVFP4 large prefill's time: evidence: wgmma-decode-split); 64-kappa sub-steps keep the A fragments of
  both tiles in registers, and the consumers take 240 registers (the producer 24). Offline (ptxas 13.5, NVFP4
  re-laid): 660 K-loop instructions per 128 kappa x 256 tokens against 931 per 256 kappa x 128 tokens, no
  local accesses in the loop (the loop re-reads the lane rather than hold lane-derived columns and
  selectors, which ptxas spilled). Faster where the second tiles are full (evidence: two-m-tiles); the plan
  weighs it against the groups' padding (``wgmma_tile_tokens``; evidence: ragged-tile-count).
* FP4 tokens in ``gbs.layouts.E2M1H200Order`` (``a_layout``, as their quantizer would write them): two
  thirds of the elements a 256-token K loop decodes are tokens, and that order decodes in 9 instead of 13
  integer instructions per word (NVFP4: 660 -> 596 per 128 kappa); a few percent faster, not the 10 % of
  the instructions (the loop is latency-bound; evidence: token-order).
* Each wgmma's B descriptor is buffer 0's advanced by a 32-bit add (``hopper.wgmma_descriptor_advance``),
  not rebuilt (4 uniform instructions): NVFP4 256-token K loop 596 -> 575 instructions per 128 kappa, MXFP4
  549 -> 530, NVFP4 128-token 931 -> 882, MXFP8 / W4A8 bn256 807 / 813 -> 773 / 781 (offline;
  evidence: desc-advance). The sub-step arithmetic is 32-bit (an int64 loop counter made the rotation run's floor
  division ~14 uniform instructions): 575 -> 539 (MXFP4 530 -> 486; evidence: u32-steps).

* Swapped tiles (``WgmmaSpec.ab_swapped``: 32 or 64 tokens, small prefill): the ring is the streaming
  kernel's swapped one (``StreamSpec.warpgroup_consumers``: a producer warpgroup and two consumer warpgroups even
  at 32 columns), so its M side is 128 weight rows and its N side ``mma_bn`` tokens. The same consumer then
  decodes each warpgroup's 64 weight rows into A fragments (the weights are decoded once per tile, as the
  streaming kernel does) and the tile's tokens into the bf16 B buffer; where the buffer has fewer (row, group
  step) pairs than the 256 consumer threads, each takes 2 (or 1) of the 4 quarters of one (``b_quarters``) and
  writes 8 (or 4) bytes of each 16-byte chunk. The epilogue stores the transposed accumulator
  (``swapped_accumulator_position``). One ``wgmma m64n32k16`` per 64 x 16 weights replaces the streaming
  kernel's 4 x 4 ``mma.sync`` and their B-fragment loads: faster for FP4 x FP4 from 17 tokens per expert
  (evidence: swapped-tiles); FP8 tokens take them only where their tiles are few enough to split
  (evidence: fp8-swapped-tiles).
* Split-K runs of swapped tiles (``WgmmaSpec.split_k``, its own build): where the swapped tiles are fewer than
  a wave, the ring's producers hand out runs of a tile's K slices (the ring's split-K walk), and the epilogue is
  the streaming kernel's split-K protocol: each run adds its scaled partial to a zeroed fp32 workspace
  (``red.global.add.f32``), bumps the tile's counter, and the last run reads every sum back with plain L2
  loads before it stores the bf16 outputs and zeroes the words (evidence: swapped-split-k).

* The FP8 route (``WgmmaSpec.fp8``: MXFP4 x MXFP4 in ``gbs.layouts.E2M1E4M3Order``, 128 x 128 tiles,
  ``_make_fp8_consumer``; the bf16 consumer reads that layout too): each block's UE8M0 exponent folded into its FP4 -> E4M3 decode (``fp8_decode``) relative
  to a base per token row and per 128-row weight tile and 128-K chunk, 4 x ``wgmma m64n128k32 .e4m3`` per chunk into
  a chunk accumulator, promoted into the fp32 total with one FFMA per accumulator; W4A8 (``WgmmaSpec.fp8`` with
  MXFP8 tokens, ``_make_fp8_tokens_consumer``): the tokens straight from the ring stage as the E4M3 A operand, a
  promotion per k32 step. Exact up to the tensor core's 14-bit sums (``gbs.fp8_route``); both slower than the bf16
  route so far (evidence: fp8-route-gpu, w4a8-fp8-route-gpu; ``docs/design/h200_port.md``, "The FP8 route: the
  kernel, and what it measured"). ``gbs.plan`` runs them only when asked (``fp8=True``).
* The FP8 route on operands folded ahead (``WgmmaSpec.chunk_scaled``: ``fp8`` with both operands in
  ``LAYOUT_E4M3_FOLDED``, MXFP8 bytes whose scales repeat per 128-K chunk, ``gbs.fp8_route.fold_problem``;
  ``_make_chunk_scaled_consumer``): both operands are wgmma's shared-memory operands straight from the ring, 4 x
  ``wgmma m64n128k32 .e4m3`` per slice into one of two chunk sets, the other set promoted meanwhile with one factor
  per token row. 1.5x the bf16 route on large prefill (evidence: fp8-fold-bench); ``gbs.plan`` runs it for folded
  problems from 33 tokens per expert. ``WgmmaSpec.cta_group`` = 2: a CTA pair (a cluster) takes a 256-token tile,
  128 token rows each, and shares its weight tile: each CTA loads half the weight rows and multicasts them to both
  (the ring's ``StreamSpec.shares_weights``), so a CTA reads 24 instead of 32 KB per 128-K chunk from L2; each
  warpgroup releases a stage once in each CTA (asked for only: no faster, evidence: fold-pair-pipelined). 128 x 192
  tiles (``FOLDED_WIDE_MMA_BN``, the plan's on folded tokens and weights: 0.87x / 0.90x the 128-row tile's time on
  large prefill up / down, evidence: fold-n192-ab): one chunk set of 96 accumulators, 4 x ``wgmma m64n192k32`` per
  slice, waited for and promoted before the next slice while the other warpgroup's MMAs run (DeepGEMM's order); a
  tile spans two 128-row fold tiles, so each 64-column group takes its own fold tile's factor
  (``column_group_scale_row``); fewer consumer instructions per weight row than the 128-row tile, no local memory,
  5 stages (evidence: fold-n192-sass). Its pair (``cta_group`` 2 on 192 rows, asked for only: within 2 % of one CTA,
  11 % slower on ragged groups; evidence: fold-pair-n192-ab): 2 x 128 tokens share the 192-row tile, each CTA
  loading 96 of its rows and one of its two scale bands multicast, so a CTA reads 28 instead of 40 KB per 128-K
  slice from L2; the same stage, 5 stages. W4A8 on folded weights
  (``WgmmaSpec.step_scaled``): the MXFP8 tokens as quantized, each k32 step promoted with its token block's scale
  while the next runs (run only when asked: no faster than the bf16 route, evidence: w4a8-fold-bench).

* W4A16 (``WgmmaSpec.bf16_tokens``: bf16 tokens, not swapped, ``_make_bf16_tokens_consumer``): the stage's two
  128-byte token boxes per slice are wgmma's A operand in shared memory as TMA wrote them, and the weights are decoded
  into the B buffer in natural K order (``natural_pairs_of``, ``bf16_tokens_weight_lane``) instead of the K
  permutation below (evidence: w4a16-gpu, bench-w4a16).

Why the decode does not hide under the MMAs (``scripts/wgmma_overlap_probe.py``): while ``wgmma``
runs, the SM's other instructions progress at a fraction of their rate, so a sub-step takes about the
decode's own time plus 54-82 % of the MMA time, whatever the arrangement (A in registers or shared memory,
warpgroups in lock step or ping-pong, the decode between the k16 steps), at the kernel's ratio of decode to MMA
time (evidence: decode-overlap-probe). Only less decode time helps.

The K permutation: the A fragments come from ``h200_decode``'s reader of the M side (each quad lane a
contiguous quarter of the K slice, 8-element groups visited in rotated order), so wgmma's k index
``kappa`` is a permutation of the real k; ``b_operand_k`` gives it, the weight decode writes every
element at its ``kappa``, and the host tests check the two agree element by element.

Where the time goes (ncu): issue slots 44 % busy with 2.25 warps per scheduler (one CTA per SM: shared
memory and registers), 0.67 eligible; the decode is ~500 instructions per thread and 128-kappa sub-step
against ~1500 cycles of MMA, and with two warps per scheduler its latency is not hidden
(evidence: wgmma-ncu-run17). A variant with a dedicated weight-decode warpgroup (512 threads) was no faster (slower for
MXFP4 and MXFP8: one decoder warp per scheduler is latency-bound the same way, and m64n256 cannot compile under
a 128-register launch bound; evidence: decoder-warpgroup).
MXFP8 takes the bf16 route too: feeding its E4M3 bytes to ``wgmma k32`` and promoting each 32-element
block's partial product in fp32 was slower on the H200 (evidence: e4m3-route; ``docs/history.md``).

Diagnostic builds (``WgmmaSpec.diagnostic``, the 128 x 192 folded tile only; never planned unasked, their outputs are
wrong): ``"no_promotion"`` accumulates the whole K in the chunk set as torch's fast accumulation does and promotes once
per tile, ``"no_mma"`` issues empty wgmma groups; timing them against the build beside them splits its time into the
promotion, the MMAs and the rest (``plan_h200(..., diagnostic=...)``, sweep suffixes ``:nopromo`` / ``:nomma``).

Constraints (``check_can_implement``, ``prepare``): ``cta_group`` 1 (2: the folded FP8 route only); ``mma_bn`` 128
or 256 (192: the folded FP8 route with folded tokens, one CTA or a pair), or with ``ab_swapped`` 32 or 64 (128-row
tiles); rows TMA can address (K a multiple of 32 with FP4 operands, 16 with FP8; a partial last K slice reads zeros past K, ``h200_launch.k_slices_of``); N and the token count below 2**31; 16-byte aligned inputs (TMA) and a 4-byte aligned output
(paired bf16 stores); the ring plus the bf16 buffers within the H200's 227 KiB per block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32

from gbs.dispatch import require_int
from gbs.formats import SF_ATOM_ROWS, get_format
from gbs.fp8_route import KERNEL_WEIGHT_BASE_ROWS
from gbs.layouts import LAYOUT_E2M1_E4M3, LAYOUT_E4M3_FOLDED, LAYOUT_PACKED
from gbs.numba_kernels import fp8_decode as fd
from gbs.numba_kernels import h200_decode as hd
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels.h200_ring import CONSUMER_WAIT
from gbs.numba_kernels.simt import scale_byte_offset
from gbs.ptx_inline import cluster as cl
from gbs.ptx_inline import common as cm
from gbs.ptx_inline import hopper as hp
from gbs.ptx_inline import mbarrier as mb
from gbs.ptx_inline.arith import f32_from_bits, f32_to_bf16_bits, fma_bf16x2, prmt_b32
from gbs.ptx_inline.shared import (ld_shared_u32, ld_shared_v2_u32, ld_shared_v4_u32, st_shared_u32, st_shared_v2_u32,
                                   st_shared_v4_u32)

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------
KERNEL_NAME = "h200_wgmma"
WGMMA_MMA_BN = (128, 256)     # weight rows per tile: wgmma N
# ``ab_swapped``: weights on wgmma M (the ring's 128-row side, decoded into A fragments) and ``mma_bn`` tokens on
# wgmma N (decoded into the bf16 B buffer): the small-prefill tile (tens of tokens per expert), where the tokens
# would fill little of an m64 tile and the weights are decoded once per tile either way.
SWAPPED_MMA_BN = (32, 64)
CONSUMER_WARPGROUPS = 2
CONSUMER_THREADS = CONSUMER_WARPGROUPS * hp.WGMMA_THREADS
TOKENS_PER_WARPGROUP = hp.WGMMA_M   # 64: the tile's 128 tokens
WARPGROUP_WARPS = hr.WARPGROUP_WARPS
ROWS_PER_WARP = TOKENS_PER_WARPGROUP // WARPGROUP_WARPS   # 16 token rows of a warpgroup's 64 per warp
WGMMA_K = 16
SW128_KAPPA = 64              # kappa per 128-byte bf16 row of one 128B-swizzle column block
BF16_ROW_BYTES = 2 * SW128_KAPPA
A_FRAGMENT_SETS = 2           # consecutive sub-steps alternate two register sets of A fragments
ROTATION_RUN_LOG2 = 2         # log2(h200_decode.ROTATION_RUN)
if 1 << ROTATION_RUN_LOG2 != hd.ROTATION_RUN:
    raise AssertionError("ROTATION_RUN_LOG2 must be log2(h200_decode.ROTATION_RUN)")
WIDE_SUB_K = 64               # mma_bn 256: 64-kappa sub-steps (three 128-kappa buffers of 256 rows do not fit)
# Tokens per tile (``WgmmaSpec.tile_tokens``): 128 (each consumer warpgroup one m64 tile), or 256 (two m64
# tiles per warpgroup on the same bf16 B buffer: the weight decode, about a quarter of NVFP4 large prefill's
# time (evidence: wgmma-decode-split), is done once for twice the tokens). 256 takes mma_bn 128 (2 x 64 accumulators
# per thread, as mma_bn 256 has 128) and 64-kappa sub-steps (the A fragments of two m64 tiles: 2 sets x 2
# tiles x 4 k16 steps x 4 registers).
TILE_TOKENS = (2 * TOKENS_PER_WARPGROUP, 4 * TOKENS_PER_WARPGROUP)
TWO_M_TILES_MMA_BN = (128,)
# Registers per thread after setmaxnreg: the producer warpgroup only walks tiles and issues TMA (it
# spills a little below ~64 registers, outside any hot loop) and the consumers need every register
# they can get (accumulators + two A fragment sets + decode temporaries); 4 x 32 x 40 + 8 x 32 x 232
# = 64512 = 384 x 168, the launch allocation (see h200_stream's setmaxnreg constants).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# 256-token tiles (2 x 64 accumulators, two tiles' A fragments) move 16 more per consumer thread from the
# producer (4 x 32 x 24 + 8 x 32 x 240 = 64512): offline (ptxas 13.5, NVFP4 re-laid, before the K loop
# re-read the lane) the consumers' K loop had 17 local accesses instead of 34 at 232 (647 instructions instead
# of 689), the producer's TMA loop 75 instead of 10 (one thread, a few microseconds per stage at 8 x 1024
# tokens: the ring hides it; the measured 256-token times include it, evidence: two-m-tiles).
PRODUCER_REGISTERS_TWO_M_TILES = 24
CONSUMER_REGISTERS_TWO_M_TILES = 240
# Three B buffers: the MMAs of sub-step u read buffer u % 3 while the threads write u + 1's. At sub-step
# v the wait (wait_group 1, before v's commit) covers the MMAs of v - 2 and older, so buffer u % 3 is
# rewritten at u + 3 only after every thread's wait at u + 2 and u + 2's barrier. Two buffers would
# need a second barrier per sub-step (``tests/test_h200_wgmma.py`` models the order).
BF16_BUFFERS = 3
SW128_ATOM_BYTES = 1024       # 8 rows x 128 B: the descriptor's stride byte offset, the buffers' alignment
SW128_LEADING_BYTES = 16      # unused by K-major 128B swizzle; encoded as 16 B
SW128_CHUNK_MASK = 7
OUT_ALIGN = 4                 # the epilogue's paired bf16 stores (st.global.b32) need 4-byte aligned rows
# The FP8 route (``WgmmaSpec.fp8``): one 128-K chunk per sub-step (the promotion interval), E4M3 B buffers of one
# 128-byte row per weight row; two buffers (each sub-step waits for its warpgroup's previous MMAs before the
# promotion, so buffer u % 2 is free again once every thread passed sub-step u + 1's barrier), and after them the
# scratch: 2 x 8 words of the warps' chunk maxima (the weight tile's bases of a slice's two chunks) and the
# 17 x 8-byte magnitude table (``fp8_decode.MAGNITUDE_TABLES``).
FP8_CHUNK = 128
FP8_ROUTE_FORMATS = (("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"))   # (tokens, weights): MXFP4 x MXFP4 and W4A8
CHUNK_SCALED_FORMATS = (("mxfp8", "mxfp8"),)   # the FP8 route on operands folded ahead (``WgmmaSpec.chunk_scaled``)
E4M3_ROW_BYTES = 128
FP8_BUFFERS = 2
FP8_MMA_BN = 128
# The folded route's wide tile (``WgmmaSpec.chunk_scaled`` with folded tokens, the ring's ``WGMMA_ONLY_MMA_BN``): 128
# tokens x 192 weight rows, DeepGEMM's sm90 FP8 tile; one chunk set of 96 accumulators and the total (two sets and the
# total would need 288 registers per thread), each slice's set promoted once its MMAs are done while the other
# warpgroup's run. Fewer L2 -> SM bytes and per-slice instructions per FLOP than 128 x 128, whose kernel still takes
# 0.82x its time on large prefill up without any MMA (evidence: fold-floors); measured 0.87x / 0.90x its time on
# large prefill up / down (evidence: fold-n192-ab).
FOLDED_WIDE_MMA_BN = hr.WGMMA_ONLY_MMA_BN[0]
# Timing-only builds of that tile (``WgmmaSpec.diagnostic``): its per-slice promotion, or its MMAs, left out
DIAGNOSTIC_NO_PROMOTION = "no_promotion"
DIAGNOSTIC_NO_MMA = "no_mma"
DIAGNOSTICS = (DIAGNOSTIC_NO_PROMOTION, DIAGNOSTIC_NO_MMA)
DIAGNOSTIC_TAGS = {"nopromo": DIAGNOSTIC_NO_PROMOTION, "nomma": DIAGNOSTIC_NO_MMA}   # the scripts' point / spec suffixes
# Weights folded ahead carry one scale per 128-row fold tile from the expert's row 0 (``gbs.fp8_route.fold_weights``);
# a 192-row tile spans two, so its promotion takes a factor per column group (``fold_column_group``).
FOLD_TILE_ROWS = KERNEL_WEIGHT_BASE_ROWS
WGMMA_K_E4M3 = 32
FP8_MAXIMA_BYTES = 2 * CONSUMER_WARPGROUPS * WARPGROUP_WARPS * 4
FP8_SCRATCH_BYTES = 256       # the maxima (64 B) and the table (136 B), rounded up
@dataclass(frozen=True)
class WgmmaSpec:
    """Everything the kernel is specialised on (hashable: compiled kernels are cached per spec)."""

    a_format: str
    b_format: str
    mma_bn: int
    stages: int
    b_layout: str = LAYOUT_PACKED   # the weights' byte layout (``gbs.layouts.OPERAND_LAYOUTS``)
    a_layout: str = LAYOUT_PACKED   # the tokens' byte layout
    tile_tokens: int = TILE_TOKENS[0]
    ab_swapped: bool = False
    split_k: bool = False   # built for split-K runs (swapped tiles only: ``prepare(k_splits=...)``)
    fp8: bool = False       # the FP8 route's E4M3 consumer (``_make_fp8_consumer``), else the bf16 one
    cta_group: int = 1      # 2: a CTA pair's two token tiles share the weight tile (``chunk_scaled`` only)
    diagnostic: str | None = None   # a timing-only build (``DIAGNOSTICS``; the folded 128 x 192 tile only)

    def __post_init__(self):
        bn = require_int("mma_bn", self.mma_bn, 1)
        tokens = require_int("tile_tokens", self.tile_tokens, 1)
        if not isinstance(self.ab_swapped, (bool, np.bool_)):
            raise TypeError(f"ab_swapped must be a bool, got {self.ab_swapped!r}")
        object.__setattr__(self, "ab_swapped", bool(self.ab_swapped))
        if tokens not in TILE_TOKENS:
            raise ValueError(f"the wgmma kernel takes tile_tokens in {TILE_TOKENS}, got {tokens}")
        if tokens != TILE_TOKENS[0] and (bn not in TWO_M_TILES_MMA_BN or self.ab_swapped):
            raise ValueError(f"tile_tokens={tokens} takes mma_bn in {TWO_M_TILES_MMA_BN} and ab_swapped False (two "
                             f"m64 token tiles per warpgroup), got mma_bn={bn}, ab_swapped={self.ab_swapped}")
        legal_bn = SWAPPED_MMA_BN if self.ab_swapped else WGMMA_MMA_BN + (FOLDED_WIDE_MMA_BN,)
        if bn not in legal_bn:
            raise ValueError(f"the wgmma kernel takes mma_bn in {legal_bn} with ab_swapped={self.ab_swapped}, got {bn}")
        if isinstance(self.stages, (bool, np.bool_)) or not isinstance(self.stages, (int, np.integer)):
            raise TypeError(f"stages must be an int, got {self.stages!r}")
        object.__setattr__(self, "mma_bn", int(bn))
        object.__setattr__(self, "tile_tokens", int(tokens))
        if self.split_k and not self.ab_swapped:
            raise ValueError("split_k=True is the swapped tiles' epilogue (few tiles of 128 weight rows): "
                             "ab_swapped must be True")
        if self.cta_group not in (1, 2) or isinstance(self.cta_group, (bool, np.bool_)):
            raise ValueError(f"cta_group must be 1 or 2, got {self.cta_group!r}")
        object.__setattr__(self, "cta_group", int(self.cta_group))
        if self.cta_group != 1 and not (self.fp8 and self.b_layout == LAYOUT_E4M3_FOLDED):
            raise ValueError("cta_group=2 (two CTAs' token tiles sharing the weight tile) is built for the FP8 "
                             f"route on folded weights only ({LAYOUT_E4M3_FOLDED!r}, fp8=True)")
        if bn == FOLDED_WIDE_MMA_BN and not (self.fp8 and self.a_layout == self.b_layout == LAYOUT_E4M3_FOLDED):
            raise ValueError(f"mma_bn={bn} is the FP8 route's tile on tokens and weights both folded ahead (fp8=True, "
                             f"{LAYOUT_E4M3_FOLDED!r}: one chunk set, promoted per slice; W4A8's per-step promotion "
                             f"takes {FP8_MMA_BN}); got fp8={self.fp8}, {self.a_format} ({self.a_layout!r}) x "
                             f"{self.b_format} ({self.b_layout!r})")
        self.ring   # format pair, layout and stage checks
        if not isinstance(self.fp8, (bool, np.bool_)):
            raise TypeError(f"fp8 must be a bool, got {self.fp8!r}")
        object.__setattr__(self, "fp8", bool(self.fp8))
        if self.bf16_tokens and (self.ab_swapped or self.fp8):
            raise ValueError(f"{self.a_format} tokens (W4A16) are wgmma's A operand straight from the ring stage: "
                             f"ab_swapped and fp8 must be False, got ab_swapped={self.ab_swapped}, fp8={self.fp8}")
        if self.diagnostic is not None and (self.diagnostic not in DIAGNOSTICS or not self.chunk_scaled
                                            or bn != FOLDED_WIDE_MMA_BN):
            raise ValueError(f"diagnostic builds are {DIAGNOSTICS} of the folded FP8 route's {FOLDED_WIDE_MMA_BN}-row "
                             f"tile; got diagnostic={self.diagnostic!r} with mma_bn={bn}, fp8={self.fp8}, "
                             f"b_layout={self.b_layout!r}")
        if self.chunk_scaled:
            if (self.a_format, self.b_format) not in CHUNK_SCALED_FORMATS or \
                    self.a_layout not in (LAYOUT_E4M3_FOLDED, LAYOUT_PACKED):
                raise ValueError(f"the FP8 route on weights folded ahead ({LAYOUT_E4M3_FOLDED!r}) takes "
                                 f"{CHUNK_SCALED_FORMATS} with the tokens folded too or MXFP8 as quantized; got "
                                 f"{self.a_format} ({self.a_layout!r}) x {self.b_format}")
            if bn not in (FP8_MMA_BN, FOLDED_WIDE_MMA_BN) or tokens != TILE_TOKENS[0] or self.ab_swapped:
                raise ValueError(f"the FP8 route on folded operands takes 128-token x {FP8_MMA_BN}-row tiles (or "
                                 f"{FOLDED_WIDE_MMA_BN}-row), not swapped (its chunk sets and total fill the "
                                 f"registers); got mma_bn={bn}, tile_tokens={tokens}, ab_swapped={self.ab_swapped}")
        elif self.fp8:
            tokens_fp4 = self.a_format == "mxfp4"
            want = (LAYOUT_E2M1_E4M3 if tokens_fp4 else LAYOUT_PACKED, LAYOUT_E2M1_E4M3)
            if (self.a_format, self.b_format) not in FP8_ROUTE_FORMATS or (self.a_layout, self.b_layout) != want:
                raise ValueError(f"the FP8 route takes MXFP4 weights in {LAYOUT_E2M1_E4M3!r} with MXFP4 tokens in it "
                                 f"too (both operands) or MXFP8 tokens as they are; got {self.a_format} "
                                 f"({self.a_layout!r}) x {self.b_format} ({self.b_layout!r})")
            if (bn, tokens, self.ab_swapped) != (FP8_MMA_BN, TILE_TOKENS[0], False):
                raise ValueError(f"the FP8 route takes 128-token x {FP8_MMA_BN}-row tiles, not swapped (its chunk and "
                                 f"total accumulators fill the registers); got mma_bn={bn}, tile_tokens={tokens}, "
                                 f"ab_swapped={self.ab_swapped}")

    @property
    def ring(self) -> hr.StreamSpec:
        """The TMA ring's spec: the streaming kernel's tile in this orientation with a producer warpgroup and 8
        consumer warps (its readers also decode for this kernel, in the operands' layouts)."""
        return hr.StreamSpec(self.a_format, self.b_format, self.ab_swapped, self.mma_bn, self.cta_group, self.stages,
                             b_layout=self.b_layout, m_rows=self.tile_tokens, a_layout=self.a_layout,
                             warpgroup_consumers=True, split_k=self.split_k)

    @property
    def chunk_scaled(self) -> bool:
        """The FP8 route on weights folded ahead (``LAYOUT_E4M3_FOLDED``, ``gbs.fp8_route.fold_problem``), the tokens
        folded too or MXFP8 as quantized (W4A8, ``step_scaled``): ``_make_chunk_scaled_consumer``."""
        return self.fp8 and self.b_layout == LAYOUT_E4M3_FOLDED

    @property
    def chunk_sets(self) -> int:
        """Chunk accumulator sets of the chunk-scaled consumer: 2 (a slice's MMAs run into one while the other set is
        promoted), 1 on the wide tile (``FOLDED_WIDE_MMA_BN``: each slice promoted once its MMAs are done)."""
        return 1 if self.mma_bn == FOLDED_WIDE_MMA_BN else 2

    @property
    def step_scaled(self) -> bool:
        """``chunk_scaled`` with MXFP8 tokens as quantized: their scales change every k32 step, so each step is
        promoted on its own."""
        return self.chunk_scaled and self.a_layout != LAYOUT_E4M3_FOLDED

    @property
    def min_stages(self) -> int:
        """The fewest ring stages the build runs with: 2 for bf16 tokens (a warp releases a stage only once its wait
        covers the slice's MMAs, during the next slice), else 1."""
        return 2 if self.bf16_tokens else 1

    @property
    def bf16_tokens(self) -> bool:
        """Tokens without block scales (W4A16): ``_make_bf16_tokens_consumer``."""
        return not get_format(self.a_format).scaled

    @property
    def threads(self) -> int:
        return self.ring.threads

    @property
    def min_ctas_per_sm(self) -> int:
        return self.ring.min_ctas_per_sm   # one CTA per SM (setmaxnreg's launch allocation)

    @property
    def k_slice(self) -> int:
        return self.ring.k_slice

    @property
    def m_tiles(self) -> int:
        """m64 accumulator tiles per consumer warpgroup: 1, or 2 with 256-token tiles."""
        return self.tile_tokens // (CONSUMER_WARPGROUPS * TOKENS_PER_WARPGROUP)

    @property
    def sub_k(self) -> int:
        """kappa (K elements) per sub-step: half a raw K slice (128 for FP4 x FP4, else 64), or 64
        with ``mma_bn`` 256 or 256-token tiles."""
        if self.fp8:
            return FP8_CHUNK
        return WIDE_SUB_K if self.mma_bn == 256 or self.m_tiles > 1 else self.k_slice // 2

    @property
    def subs_per_slice(self) -> int:
        """Sub-steps per raw K slice: 2 or 4 (even: the A fragment sets alternate inside a slice)."""
        return self.k_slice // self.sub_k

    @property
    def k_steps(self) -> int:
        """wgmma k16 steps per warpgroup and sub-step."""
        return self.sub_k // WGMMA_K

    @property
    def groups_per_sub(self) -> int:
        """8-element groups each quad lane decodes per sub-step and row: 4 (one rotation run) or 2."""
        return self.ring.m_side.groups // self.subs_per_slice

    @property
    def column_blocks(self) -> int:
        """128B-swizzle column blocks (64 kappa each) of a B buffer."""
        return self.sub_k // SW128_KAPPA

    @property
    def b_items(self) -> int:
        """B rows (weights; tokens when swapped) each consumer thread decodes per sub-step, one group step each
        (at least one: ``b_quarters``)."""
        return max(1, self.groups_per_sub * self.mma_bn // CONSUMER_THREADS)

    @property
    def b_quarters(self) -> int:
        """Quad lanes' quarters (of the K slice) of its row that one B item decodes: 4, or 2 or 1 where the B
        buffer has fewer (row, group step) pairs than there are consumer threads (the swapped 32- and 64-token
        tiles): the consumer warps then form ``b_quarter_parts`` groups, each taking its share of the quarters
        and writing its 8 or 4 bytes of every 16-byte chunk."""
        return min(hd.QUAD, self.groups_per_sub * self.mma_bn * hd.QUAD // CONSUMER_THREADS)

    @property
    def b_quarter_parts(self) -> int:
        """Groups of consumer warps that split each B row's quarters (1, 2 or 4)."""
        return hd.QUAD // self.b_quarters

    @property
    def warps_per_b_part(self) -> int:
        return CONSUMER_WARPGROUPS * WARPGROUP_WARPS // self.b_quarter_parts

    @property
    def lanes_per_group_step(self) -> int:
        """Lanes of a warp that share a group step: 8 rows x 4 steps (or 16 x 2) per weight load,
        so the 32 lanes read distinct banks (rows 8 apart share the swizzle, steps differ in the
        word their rotation picks)."""
        return hr.WARP_SIZE // self.groups_per_sub

    @property
    def buffer_bytes(self) -> int:
        if self.fp8:
            return self.mma_bn * E4M3_ROW_BYTES
        return self.column_blocks * self.mma_bn * BF16_ROW_BYTES

    @property
    def buffers(self) -> int:
        if self.chunk_scaled:
            return 0   # both operands are read from the ring stage
        return FP8_BUFFERS if self.fp8 else BF16_BUFFERS

    @property
    def buffers_offset(self) -> int:
        """Offset of the first bf16 B buffer in the dynamic shared memory (after the ring)."""
        return -(-self.ring.smem.dynamic_bytes // SW128_ATOM_BYTES) * SW128_ATOM_BYTES

    @property
    def scratch_offset(self) -> int:
        """Offset of the FP8 route's scratch (after the buffers)."""
        return self.buffers_offset + self.buffers * self.buffer_bytes

    @property
    def smem(self) -> "WgmmaSmem":
        """The ring, then the B buffers (``BF16_BUFFERS`` bf16, or ``FP8_BUFFERS`` E4M3 and the scratch)."""
        scratch = FP8_SCRATCH_BYTES if self.fp8 and not self.chunk_scaled else 0
        return WgmmaSmem(self.scratch_offset + scratch, self.ring.smem.static_bytes)


@dataclass(frozen=True)
class WgmmaSmem:
    dynamic_bytes: int
    static_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.dynamic_bytes + self.static_bytes


# ----------------------------------------------------------------------------------------------
# The K permutation (host model; the kernel computes the same addresses)
# ----------------------------------------------------------------------------------------------
def b_operand_k(spec: WgmmaSpec, sub: int, kappa: int) -> int:
    """Real k (inside the K slice) that wgmma's k index ``kappa`` (0 .. sub_k - 1) of sub-step
    ``sub`` (0 .. subs_per_slice - 1) carries.

    A fragments (``h200_decode``'s reader): quad lane ``q`` holds, for its rotated group ``gl`` at
    step ``gi = groups_per_sub * sub + p``, register ``j`` = elements (j, j + 4) (FP4 pairing; FP8 x
    FP8 pairs (0,2),(1,3),(4,6),(5,7)) of its quarter, and feeds them to k16 step ``kb = 2 p + j // 2``
    at ``kappa = 16 kb + 2 q + 8 (j % 2)`` (+1 for the high half)."""
    ring = spec.ring
    kb, r = divmod(kappa, WGMMA_K)
    h, r = divmod(r, 8)
    q, hi = divmod(r, 2)
    p, j_half = divmod(kb, 2)
    j = 2 * j_half + h
    gi = spec.groups_per_sub * sub + p
    gl = int(hd.rotated_group(gi, q))
    element = hd.pair_elements(j, ring.pairing)[hi]
    quarter = spec.k_slice // hd.QUAD
    return q * quarter + gl * hd.GROUP_ELEMENTS + element


def b_buffer_offset(mma_bn: int, row: int, kb: int, h: int) -> int:
    """Byte offset in a B buffer of the 16-byte chunk holding kappa ``16 kb + 8 h`` .. ``+ 7`` of weight
    row ``row`` (quad lane q's register is word q of it): column block ``kb // 4`` (``mma_bn`` rows of
    128 B, 1024-byte aligned, 128B swizzle: chunk c of row r at c ^ (r % 8))."""
    chunk = 2 * (kb % 4) + h
    return (kb // 4) * mma_bn * BF16_ROW_BYTES + row * BF16_ROW_BYTES + 16 * (chunk ^ (row & SW128_CHUNK_MASK))


def sub_step_groups(groups_per_sub: int, sub_pair: int, parity: int) -> tuple[int, int]:
    """(first group step inside its rotation run, the rotation run) of sub-step ``2 sub_pair + parity``,
    whose ``groups_per_sub`` (2 or 4) group steps ``gi = groups_per_sub * sub`` .. stay inside one run
    of 4. A pair of sub-steps covers ``2 groups_per_sub`` groups, a whole number of runs, so the first
    step depends on the parity only (a constant once the pair is unrolled)."""
    # a shift, not a floor division: on a signed loop counter the division costs the kernel a sign fix-up
    return (groups_per_sub * parity % hd.ROTATION_RUN,
            (groups_per_sub * (A_FRAGMENT_SETS * sub_pair + parity)) >> ROTATION_RUN_LOG2)


def a_fragment_index(p: int, j: int, i: int) -> int:
    """Index, in one A fragment set, of decoded register ``j`` of group step ``p`` and row half ``i``
    (rows g and g + 8): k16 step ``2 p + j // 2``, wgmma A register ``2 (j % 2) + i`` of it (the
    mma.sync m16n8k16 A layout per warp: ``hopper.wgmma_a_register_position``)."""
    return 4 * (2 * p + j // 2) + 2 * (j % 2) + i


def b_item_row(spec: WgmmaSpec, consumer_thread: int, item: int) -> tuple[int, int, int]:
    """(B row, group step within the sub-step, first of its ``b_quarters`` quarters) of a consumer thread's
    ``item``."""
    warp, lane = divmod(consumer_thread, hr.WARP_SIZE)
    part, warp = divmod(warp, spec.warps_per_b_part)
    lanes = spec.lanes_per_group_step
    return lanes * (spec.b_items * warp + item) + lane % lanes, lane // lanes, part * spec.b_quarters


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
_device = hd.inline_device


def make_kernel_function(spec: WgmmaSpec):
    """The kernel as a Python function (closure over ``spec``); built fresh on every call: the frame
    (``_kernel_frame``) around the consumer (``_make_bf16_consumer``)."""
    ring = hr.make_ring(spec.ring)
    make_consumer = _make_bf16_tokens_consumer if spec.bf16_tokens else _make_bf16_consumer
    if spec.fp8:
        make_consumer = _make_fp8_consumer if spec.a_format == "mxfp4" else _make_fp8_tokens_consumer
    if spec.chunk_scaled:
        make_consumer = _make_chunk_scaled_consumer
    return _kernel_frame(spec, ring, make_consumer(spec, ring))


def _kernel_frame(spec: WgmmaSpec, ring, consume):
    """The kernel around a consumer: the shared arrays, the routing copy, the producer warpgroup (the ring's
    ``produce`` after ``setmaxnreg`` down to ``PRODUCER_REGISTERS``) and the two consumer warpgroups
    (``setmaxnreg`` up, the block sync, then ``consume(dyn, bars, consumer_warp, expert_scales, out, n,
    k_slices, max_tiles)``, which takes its tiles from the producer's work records)."""
    ring_spec = spec.ring
    copy_routing, block_sync, produce = ring.copy_routing, ring.block_sync, ring.produce
    producer_warps = ring_spec.producer_warps
    if not ring_spec.uses_setmaxnreg:
        raise AssertionError("the wgmma kernel's ring has a producer warpgroup (8 consumer warps)")
    two_m_tiles = spec.m_tiles == 2
    cta_group = spec.cta_group
    producer_regs = hp.setmaxnreg_dec(PRODUCER_REGISTERS_TWO_M_TILES if two_m_tiles else PRODUCER_REGISTERS)
    consumer_regs = hp.setmaxnreg_inc(CONSUMER_REGISTERS_TWO_M_TILES if two_m_tiles else CONSUMER_REGISTERS)
    barrier_words = ring_spec.smem.barrier_words
    routing_offset_words = hr.ROUTING_SMEM_SLOTS + 1
    # module constants as plain names (numba needs literals for shared-array sizes and alignment)
    DYNAMIC_SMEM_ALIGN, ROUTING_SMEM_SLOTS = hr.DYNAMIC_SMEM_ALIGN, hr.ROUTING_SMEM_SLOTS

    @_device
    def leave_cluster():
        """A pair's CTAs meet before exit: no CTA leaves while its peer may still multicast into it or arrive on
        its barriers. Called inside each role's branch: where the two branches joined first, ptxas serialized the
        consumers' wgmma (C7512, "insufficient register resources": the join holds the producer's 40-register
        budget), a wait for every MMA after each one."""
        if cta_group > 1:
            cl.cluster_arrive_release()
            cl.cluster_wait_acquire()

    def grouped_matmul_h200_wgmma(tensor_maps, a_offsets, a_scale_offsets, expert_ids, expert_scales,
                                  out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                                  slices_per_split):
        dyn = cuda.shared.array(0, dtype=np.uint8, alignment=DYNAMIC_SMEM_ALIGN)
        bars = cuda.shared.array(barrier_words, dtype=np.uint64)
        shared_offsets = cuda.shared.array(routing_offset_words, dtype=np.uint32)
        shared_expert_ids = cuda.shared.array(ROUTING_SMEM_SLOTS, dtype=np.int32)
        cm.griddepcontrol_wait()   # programmatic dependent launch: before the first global access (h200_ring)
        cm.griddepcontrol_launch_dependents()
        copy_routing(a_offsets, expert_ids, shared_offsets, shared_expert_ids)
        warp = cm.warp_index()
        if warp < producer_warps:
            producer_regs()
            produce(dyn, bars, tensor_maps, a_offsets, a_scale_offsets, expert_ids, shared_offsets, shared_expert_ids,
                    n, k_slices, max_tiles, split_counters, k_splits, slices_per_split)
            cuda.syncwarp()
            leave_cluster()
        else:
            consumer_regs()
            block_sync()   # the mbarriers are initialised
            consume(dyn, bars, warp - producer_warps, expert_scales, out, n, k_slices, max_tiles, split_sums,
                    split_counters, k_splits, slices_per_split)
            leave_cluster()

    return grouped_matmul_h200_wgmma


def _make_bf16_consumer(spec: WgmmaSpec, ring):
    """The consumer (module docstring): both operands decoded, scaled, to bf16; a device function for
    ``_kernel_frame``."""
    ring_spec = spec.ring
    # numba reads device functions from plain names, not attributes
    read_work_record, next_stage = ring.read_work_record, ring.next_stage
    stages, lay = ring_spec.stages, ring_spec.smem
    stage_bytes = lay.stage_bytes
    m_side, n_side = ring_spec.m_side, ring_spec.n_side
    m_data_off, n_data_off, m_sf_off, n_sf_off = lay.m_data, lay.n_data, lay.m_scales, lay.n_scales
    atoms = m_side.sf_atoms_per_slice
    mma_bn = spec.mma_bn
    groups_per_sub, k_steps, items = spec.groups_per_sub, spec.k_steps, spec.b_items
    b_quarters, b_parts = spec.b_quarters, spec.b_quarter_parts
    warps_per_part = spec.warps_per_b_part
    swapped = spec.ab_swapped
    lanes_per_step = spec.lanes_per_group_step
    block_bytes = mma_bn * BF16_ROW_BYTES
    buffers_off, buffer_bytes = spec.buffers_offset, spec.buffer_bytes
    consumer_threads = CONSUMER_THREADS
    num_acc = mma_bn // 2
    epilogue_scale = np.float32(2.0 ** ring_spec.epilogue_log2)
    m_load, m_decode, m_load_scales, m_selector, m_group_scale = hd.make_side_reader(m_side, ring_spec.pairing)
    n_load, n_decode, n_load_scales, n_selector, n_group_scale = hd.make_side_reader(n_side, ring_spec.pairing)
    m_sel_step, n_sel_step = hd.scale_selector_run_step(m_side), hd.scale_selector_run_step(n_side)
    m_run_bytes, n_run_bytes = hd.ROTATION_RUN * m_side.group_bytes, hd.ROTATION_RUN * n_side.group_bytes
    m_blocks, n_blocks = m_side.blocks_per_thread, n_side.blocks_per_thread
    m_row_bytes, n_row_bytes = m_side.row_bytes, n_side.row_bytes
    m_mask, n_mask = m_side.swizzle_mask, n_side.swizzle_mask
    m_thread_bytes, n_thread_bytes = m_side.thread_bytes, n_side.thread_bytes
    m_group_bytes, n_group_bytes = m_side.group_bytes, n_side.group_bytes
    mma = hp.wgmma_bf16_rs(mma_bn)
    zero_acc = hp.wgmma_zero_accumulators(mma_bn)
    sf_offset = _device(scale_byte_offset)
    rotated = _device(hd.rotated_group)
    swizzle = _device(hd.swizzle_xor)
    word_column = _device(hd.scale_word_column)
    column = _device(hd.group_column)
    chunk_offset = _device(b_buffer_offset)
    step_groups = _device(sub_step_groups)
    a_index = _device(a_fragment_index)
    advance = _device(hp.wgmma_descriptor_advance)
    buffer_units = buffer_bytes // hp.DESCRIPTOR_UNIT_BYTES
    store_tile = _make_store_tile(num_acc, swapped)
    split_k = spec.split_k
    add_partial, take_store = _make_split_epilogue(num_acc)
    split_flag = 2 * stages   # the ring's shared flag word after the mbarriers (h200_ring.SPLIT_FLAG_WORDS)
    # local-array sizes must be plain constants in numba
    w_sc_words, w_dec_words = 2 * hd.QUAD * items, 4 * hd.QUAD
    m_tiles = spec.m_tiles
    two_m_tiles = m_tiles == 2   # a second m64 tile per warpgroup: 128 token rows further
    m_tile_rows = CONSUMER_WARPGROUPS * TOKENS_PER_WARPGROUP
    a_frag_words, m_sc_words, rotation_run = A_FRAGMENT_SETS * m_tiles * 4 * k_steps, 4 * m_tiles, hd.ROTATION_RUN
    subs_per_slice = spec.subs_per_slice
    # module constants as plain names (numba reads globals of other modules at compile time only by name)
    CONSUMER_BARRIER, MBARRIER_BYTES, NEG_ZERO_BF16X2, QUAD = (
        hr.CONSUMER_BARRIER, hr.MBARRIER_BYTES, hd.NEG_ZERO_BF16X2, hd.QUAD)
    DESCRIPTOR_UNIT_BYTES = hp.DESCRIPTOR_UNIT_BYTES
    ROTATION_RUN = hd.ROTATION_RUN

    def consume(dyn, bars, cw, expert_scales, out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                slices_per_split):
        lane = cm.laneid()
        base = np.int64(hr.lane0_u32(cm.shared_address(dyn)))
        bar0 = np.int64(hr.lane0_u32(cm.shared_address(bars)))
        g = lane >> 2
        q = lane & 3
        # A side: token rows m_row and m_row + 8 of the tile (warpgroup cw // 4, warp cw % 4)
        m_row = (cw // WARPGROUP_WARPS) * TOKENS_PER_WARPGROUP + (cw % WARPGROUP_WARPS) * ROWS_PER_WARP + g
        m_xor = np.uint32(swizzle(m_row, m_row_bytes, m_mask))
        m_row_addr = np.uint32(m_data_off + m_row * m_row_bytes)
        m_col = word_column(q, m_blocks)
        # B side: weight rows (tokens when swapped) w_row0 + lanes_per_step * it, group step w_step of each
        # sub-step, quarters q_base .. q_base + b_quarters - 1
        if b_parts == 1:
            w_row0 = lanes_per_step * items * cw + lane % lanes_per_step
            q_base = 0
        else:
            w_row0 = lanes_per_step * items * (cw % warps_per_part) + lane % lanes_per_step
            q_base = (cw // warps_per_part) * b_quarters
        w_step = lane // lanes_per_step
        buffers = np.uint32(base + buffers_off)
        # buffer 0's descriptor; each wgmma's is this one advanced (one 32-bit add, not a rebuild)
        desc0 = hp.wgmma_smem_descriptor_device(buffers, SW128_LEADING_BYTES, SW128_ATOM_BYTES, "128B")
        m_col0 = cuda.local.array(rotation_run, np.uint32)
        m_sel0 = cuda.local.array(rotation_run, np.uint32)
        for c in range(ROTATION_RUN):
            gl0 = rotated(c, q)
            m_col0[c] = column(q, gl0, m_thread_bytes, m_group_bytes, m_xor)
            m_sel0[c] = m_selector(gl0)
        m_sc = cuda.local.array(m_sc_words, np.uint32)      # (s0, s1) of rows m_row, m_row + 8 per m64 tile
        w_sc = cuda.local.array(w_sc_words, np.uint32)      # (s0, s1) per item and quarter
        m_w = cuda.local.array(4, np.uint32)
        w_dec = cuda.local.array(w_dec_words, np.uint32)    # [quarter][register]
        # two sets (the sub-steps of a slice alternate): an in-flight wgmma still reads the other's; each
        # set holds the warpgroup's m64 tiles in turn
        a_frag = cuda.local.array(a_frag_words, np.uint32)
        acc_out = cuda.local.array(num_acc, float32)
        acc = zero_acc()
        if two_m_tiles:   # the second m64 tile's accumulators (a constant: pruned otherwise)
            acc_hi = zero_acc()
        buffer = np.uint32(0)
        stage = np.int64(0)
        phase = np.int64(0)
        item = np.int64(0)
        while item < max_tiles:   # one tile per pass, as the producer's records say (a record ends the loop)
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
            if expert < 0:
                break
            if swapped:   # weights on M (the tile starts on a 128-row band), tokens on N
                m_sf_row0 = r0 % SF_ATOM_ROWS
                n_sf_row0 = (t0 - group_start) % SF_ATOM_ROWS
            else:
                m_sf_row0 = (t0 - group_start) % SF_ATOM_ROWS
                n_sf_row0 = r0 % SF_ATOM_ROWS
            acc = zero_acc()
            if two_m_tiles:
                acc_hi = zero_acc()
            slices = k_slices
            if split_k:   # this run's K slices of the tile (the last run may be shorter)
                slices = min(np.int64(slices_per_split), k_slices - np.int64(s_begin))
            for _ in range(slices):
                full = bar0 + MBARRIER_BYTES * stage
                CONSUMER_WAIT(full, phase)
                st = np.uint32(base + stage * stage_bytes)
                for i in range(2):
                    address = np.uint32(st + m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row + 8 * i), m_col,
                                                                  atoms))
                    m_sc[2 * i], m_sc[2 * i + 1] = m_load_scales(address, q)
                if two_m_tiles:   # rows past 128 are in the stage's second scale band
                    for i in range(2):
                        address = np.uint32(st + m_sf_off + sf_offset(
                            np.uint32(m_sf_row0 + m_row + m_tile_rows + 8 * i), m_col, atoms))
                        m_sc[4 + 2 * i], m_sc[4 + 2 * i + 1] = m_load_scales(address, q)
                for it in range(items):
                    for qq in range(b_quarters):
                        quarter = q_base + qq
                        address = np.uint32(st + n_sf_off + sf_offset(
                            np.uint32(n_sf_row0 + w_row0 + lanes_per_step * it), word_column(quarter, n_blocks),
                            atoms))
                        w_sc[8 * it + 2 * qq], w_sc[8 * it + 2 * qq + 1] = n_load_scales(address, quarter)
                st_m = np.uint32(st + m_row_addr)
                if two_m_tiles:   # 128 rows further: the same swizzle (it repeats every 8 rows)
                    st_m_hi = np.uint32(st_m + m_tile_rows * m_row_bytes)
                # sub-steps in pairs, the inner one unrolled: the A set and the group steps' place in
                # their rotation run are then constants (register and table indices)
                for sub_pair in range(subs_per_slice // A_FRAGMENT_SETS):
                    for parity in range(A_FRAGMENT_SETS):
                        a_set = 4 * k_steps * m_tiles * parity
                        # 32-bit: the loop's int64 counter made the run's floor division ~14 uniform instructions
                        first_c, run = step_groups(groups_per_sub, np.uint32(sub_pair), parity)
                        m_run, n_run = np.uint32(run * m_run_bytes), np.uint32(run * n_run_bytes)
                        m_sel_run, n_sel_run = np.uint32(run * m_sel_step), np.uint32(run * n_sel_step)
                        b_addr = np.uint32(buffers + buffer * buffer_bytes)
                        # 1. the weights: bf16 B operand rows into the free buffer
                        if two_m_tiles:   # the group step from the lane read again (see the tokens, 3.)
                            c_w = first_c + cm.laneid() // lanes_per_step
                        else:
                            c_w = first_c + w_step   # this thread's group step in the first rotation run
                        for it in range(items):
                            w_row = w_row0 + lanes_per_step * it
                            st_w = np.uint32(st + n_data_off + w_row * n_row_bytes)
                            w_xor = np.uint32(swizzle(w_row, n_row_bytes, n_mask))
                            for qq in range(b_quarters):
                                quarter = q_base + qq
                                gl = rotated(c_w, quarter)
                                w0, w1 = n_load(st_w | (column(quarter, gl, n_thread_bytes, n_group_bytes, w_xor)
                                                        ^ n_run))
                                scale = n_group_scale(w_sc[8 * it + 2 * qq], w_sc[8 * it + 2 * qq + 1],
                                                      np.uint32(n_selector(gl) + n_sel_run), run)
                                for j in range(4):
                                    w_dec[4 * qq + j] = fma_bf16x2(n_decode(w0, w1, j), scale, NEG_ZERO_BF16X2)
                            for kbl in range(2):
                                for h in range(2):
                                    j = 2 * kbl + h
                                    # word q of the chunk is quarter q's register j
                                    chunk = b_addr + chunk_offset(mma_bn, w_row, 2 * w_step + kbl, h)
                                    if b_quarters == QUAD:
                                        st_shared_v4_u32(chunk, w_dec[j], w_dec[4 + j], w_dec[8 + j], w_dec[12 + j])
                                    elif b_quarters == 2:
                                        st_shared_v2_u32(chunk + 4 * q_base, w_dec[j], w_dec[4 + j])
                                    else:
                                        st_shared_u32(chunk + 4 * q_base, w_dec[j])
                        cm.fence_proxy_async_shared_cta()   # generic-proxy writes -> wgmma reads
                        # 2. this warpgroup's MMAs of two sub-steps ago (reading this A set and the
                        # buffer written next) are done
                        hp.wgmma_wait_group_1()
                        # 3. the tokens: A fragments of the sub-step's group steps
                        if two_m_tiles:   # the lane read again (volatile): its columns and selectors are
                            q_now = cm.laneid() & 3   # recomputed here, not held (or spilled) across the loop
                        for p in range(groups_per_sub):
                            c = first_c + p
                            if two_m_tiles:
                                m_col_c = column(q_now, rotated(c, q_now), m_thread_bytes, m_group_bytes, m_xor)
                                m_sel_c = m_selector(rotated(c, q_now))
                            else:
                                m_col_c, m_sel_c = m_col0[c], m_sel0[c]
                            for i in range(2):
                                m_w[2 * i], m_w[2 * i + 1] = m_load((st_m | (m_col_c ^ m_run)) + 8 * i * m_row_bytes)
                            for i in range(2):
                                scale = m_group_scale(m_sc[2 * i], m_sc[2 * i + 1], np.uint32(m_sel_c + m_sel_run),
                                                      run)
                                for j in range(4):
                                    # register j -> k16 step 2 p + j // 2, a-register 2 (j % 2) + i
                                    a_frag[a_set + a_index(p, j, i)] = fma_bf16x2(
                                        m_decode(m_w[2 * i], m_w[2 * i + 1], j), scale, NEG_ZERO_BF16X2)
                        if two_m_tiles:   # the same for the second m64 tile (written out: a loop over the
                            # tiles or a device function changed the 128-token builds' register allocation)
                            for p in range(groups_per_sub):
                                c = first_c + p
                                m_col_c = column(q_now, rotated(c, q_now), m_thread_bytes, m_group_bytes, m_xor)
                                m_sel_c = m_selector(rotated(c, q_now))
                                for i in range(2):
                                    m_w[2 * i], m_w[2 * i + 1] = m_load((st_m_hi | (m_col_c ^ m_run))
                                                                        + 8 * i * m_row_bytes)
                                for i in range(2):
                                    scale = m_group_scale(m_sc[4 + 2 * i], m_sc[5 + 2 * i],
                                                          np.uint32(m_sel_c + m_sel_run), run)
                                    for j in range(4):
                                        a_frag[a_set + 4 * k_steps + a_index(p, j, i)] = fma_bf16x2(
                                            m_decode(m_w[2 * i], m_w[2 * i + 1], j), scale, NEG_ZERO_BF16X2)
                        # 4. meet the other warpgroup: the buffer is complete, then issue
                        cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                        hp.wgmma_fence()
                        b_desc = advance(desc0, buffer * buffer_units)
                        for kb in range(k_steps):
                            offset = (kb // 4) * block_bytes + (kb % 4) * 2 * WGMMA_K   # bytes, a constant
                            desc = advance(b_desc, offset // DESCRIPTOR_UNIT_BYTES)
                            acc = mma(acc, (a_frag[a_set + 4 * kb], a_frag[a_set + 4 * kb + 1],
                                            a_frag[a_set + 4 * kb + 2], a_frag[a_set + 4 * kb + 3]), desc, np.uint32(1))
                            if two_m_tiles:   # the same B operand for the warpgroup's second m64 tile
                                hi = a_set + 4 * k_steps + 4 * kb
                                acc_hi = mma(acc_hi, (a_frag[hi], a_frag[hi + 1], a_frag[hi + 2], a_frag[hi + 3]), desc,
                                             np.uint32(1))
                        hp.wgmma_commit_group()
                        buffer = np.uint32(buffer + np.uint32(1))   # 32-bit (a plain += widens to 64)
                        if buffer == np.uint32(BF16_BUFFERS):
                            buffer = np.uint32(0)
                # every read of the raw stage is done (the MMAs read the bf16 buffers)
                cuda.syncwarp()
                if lane == 0:
                    mb.mbarrier_arrive(bar0 + MBARRIER_BYTES * (stages + stage))
                stage, phase = next_stage(stage, phase)
            hp.wgmma_wait_group_0()
            acc = hp.wgmma_fence_accumulators(acc)
            hp.accumulators_to_array(acc, acc_out)
            if split_k:   # the streaming kernel's split-K protocol: add this run's partial; the tile's last run stores
                sums_address = np.int64(cm.generic_address(split_sums))
                add_partial(acc_out, sums_address, n, t0, t1, r0, r1, m_row, q, expert_scales[expert] * epilogue_scale)
                cuda.threadfence()
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                if cw == 0 and lane == 0:
                    runs_done = cuda.atomic.add(split_counters, tile, np.uint32(1))
                    bars[split_flag] = np.uint64(np.int64(runs_done) == k_splits - 1)
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                if bars[split_flag] != 0:   # every run's sums are in
                    cuda.threadfence()
                    take_store(acc_out, out, sums_address, n, t0, t1, r0, r1, m_row, q)
                    if cw == 0 and lane == 0:
                        split_counters[tile] = np.uint32(0)
                # every consumer has read the flag before the next tile's thread 0 writes it
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
            else:
                store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, expert_scales[expert] * epilogue_scale)
            if two_m_tiles:
                acc_hi = hp.wgmma_fence_accumulators(acc_hi)
                hp.accumulators_to_array(acc_hi, acc_out)
                store_tile(acc_out, out, n, t0, t1, r0, r1, m_row + m_tile_rows, q,
                           expert_scales[expert] * epilogue_scale)
            item += 1


    return _device(consume)


# W4A16 (``WgmmaSpec.bf16_tokens``): bf16 tokens are wgmma's A operand straight from the ring stage, so the weights are
# written in natural K order: each consumer thread decodes one quarter (32 K, 16 bytes) of a weight row per sub-step.
BF16_TOKENS_QUARTER_WORDS = 4                # FP4 words (8 elements each) of a row's 32-K quarter


def bf16_tokens_weight_lane(consumer_thread: int) -> tuple[int, int]:
    """(weight row in the first 128, half of the 64-K sub-step) that a consumer thread decodes with bf16 tokens. The
    8 lanes of a 16-byte shared access are 8 consecutive rows of one half: their raw quarters (64B swizzle) and their
    B-buffer chunks (128B swizzle) fall in 8 different 16-byte bank groups."""
    warp, lane = divmod(consumer_thread, hr.WARP_SIZE)
    return 16 * warp + 8 * (lane // 16) + lane % 8, (lane // 8) & 1


def natural_pairs_of(prmt):
    """``natural_pairs(r0, r1, r2, r3)``: the bf16x2 registers of 8 consecutive elements, (0, 1), (2, 3), (4, 5),
    (6, 7), from the FP4 decode's pairs (j, j + 4) in registers j = 0..3 (``h200_decode.e2m1_pair_bits``); ``prmt``:
    ``prmt_b32`` (device) or ``prmt_b32_host``."""
    def natural_pairs(r0, r1, r2, r3):
        return (prmt(r0, r1, np.uint32(hd.PRMT_LOW_HALVES)), prmt(r2, r3, np.uint32(hd.PRMT_LOW_HALVES)),
                prmt(r0, r1, np.uint32(hd.PRMT_HIGH_HALVES)), prmt(r2, r3, np.uint32(hd.PRMT_HIGH_HALVES)))

    return natural_pairs


def _make_bf16_tokens_consumer(spec: WgmmaSpec, ring):
    """The W4A16 consumer (bf16 tokens x MXFP4 / NVFP4 weights; a device function for ``_kernel_frame``). A slice's
    128 K of a token row are two 128-byte TMA boxes in the stage (``StreamSpec.token_region_bytes`` apart), each the
    wgmma A operand of one 64-K sub-step (``wgmma_bf16_ss``): the tokens are not touched by the threads. Per sub-step
    the 256 threads decode the tile's weights, scaled, to bf16 in natural K order into the free B buffer
    (``bf16_tokens_weight_lane``, ``natural_pairs``), then ``wait_group 1``, the named barrier, and each warpgroup's 4
    MMAs (two m64 tiles with 256-token tiles). The MMAs read the raw stage, so a warp releases it once its wait
    covers the slice's last MMAs: in the next slice's second sub-step, or at the tile's end."""
    ring_spec = spec.ring
    read_work_record, next_stage = ring.read_work_record, ring.next_stage
    stages, lay = ring_spec.stages, ring_spec.smem
    stage_bytes = lay.stage_bytes
    m_side, n_side = ring_spec.m_side, ring_spec.n_side
    region_bytes = ring_spec.token_region_bytes
    if (m_side.boxes, m_side.box_bytes, n_side.row_bytes, spec.subs_per_slice) != (2, BF16_ROW_BYTES, 64, 2):
        raise AssertionError("W4A16 reads two 128-byte token boxes and 64-byte FP4 weight rows per 128-K slice")
    if (lay.m_data | stage_bytes | region_bytes) % SW128_ATOM_BYTES:
        raise AssertionError("the tokens' stage boxes must be 1024-byte aligned: they are a wgmma operand")
    m_data_off, n_data_off, n_sf_off = lay.m_data, lay.n_data, lay.n_scales
    atoms = n_side.sf_atoms_per_slice
    mma_bn = spec.mma_bn
    num_acc = mma_bn // 2
    items = mma_bn // (CONSUMER_THREADS // 2)   # 128 rows x 2 halves per pass of the 256 threads
    buffers_off, buffer_bytes = spec.buffers_offset, spec.buffer_bytes
    _, n_decode, n_load_scales, n_selector, n_group_scale = hd.make_side_reader(n_side, ring_spec.pairing)
    n_blocks = n_side.blocks_per_thread
    ue4m3 = n_side.fmt.scale_dtype == "ue4m3"
    if BF16_TOKENS_QUARTER_WORDS // n_blocks not in (2, 4):
        raise AssertionError("a weight quarter (32 K) is one MX block or two NVFP4 blocks")
    n_row_bytes, n_mask = n_side.row_bytes, n_side.swizzle_mask
    mma = hp.wgmma_bf16_ss(mma_bn)
    zero_acc = hp.wgmma_zero_accumulators(mma_bn)
    sf_offset = _device(scale_byte_offset)
    swizzle = _device(hd.swizzle_xor)
    word_column = _device(hd.scale_word_column)
    chunk_offset = _device(b_buffer_offset)
    weight_lane = _device(bf16_tokens_weight_lane)
    advance = _device(hp.wgmma_descriptor_advance)
    store_tile = _make_store_tile(num_acc)
    epilogue_scale = np.float32(2.0 ** ring_spec.epilogue_log2)
    two_m_tiles = spec.m_tiles == 2
    m_tile_rows = CONSUMER_WARPGROUPS * TOKENS_PER_WARPGROUP
    consumer_threads = CONSUMER_THREADS
    w_sc_words = 2 * 2 * items   # (s0, s1) per item and sub-step
    CONSUMER_BARRIER, MBARRIER_BYTES, NEG_ZERO_BF16X2 = hr.CONSUMER_BARRIER, hr.MBARRIER_BYTES, hd.NEG_ZERO_BF16X2
    UNIT, SW128_ATOM_BYTES_, SW128_LEADING_BYTES_ = hp.DESCRIPTOR_UNIT_BYTES, SW128_ATOM_BYTES, SW128_LEADING_BYTES
    TOKENS_PER_WARPGROUP_, ROWS_PER_WARP_, WARPGROUP_WARPS_ = TOKENS_PER_WARPGROUP, ROWS_PER_WARP, WARPGROUP_WARPS
    ROW_BYTES, STEP_BYTES, BUFFERS = BF16_ROW_BYTES, 2 * WGMMA_K, BF16_BUFFERS
    HALF_ROWS = CONSUMER_THREADS // 2

    natural_pairs = _device(natural_pairs_of(prmt_b32))

    def decode_store(word, scale, address):
        """One FP4 word's 8 elements, scaled, as 16 bytes of bf16 in natural order at ``address``."""
        c0, c1, c2, c3 = natural_pairs(fma_bf16x2(n_decode(word, 0, 0), scale, NEG_ZERO_BF16X2),
                                       fma_bf16x2(n_decode(word, 0, 1), scale, NEG_ZERO_BF16X2),
                                       fma_bf16x2(n_decode(word, 0, 2), scale, NEG_ZERO_BF16X2),
                                       fma_bf16x2(n_decode(word, 0, 3), scale, NEG_ZERO_BF16X2))
        st_shared_v4_u32(address, c0, c1, c2, c3)

    decode_store = _device(decode_store)

    def sub_step_mmas(acc, a_desc, b_desc):
        """The 4 k16 MMAs of a 64-K sub-step, written out (a loop over them was not unrolled everywhere)."""
        acc = mma(acc, a_desc, b_desc, np.uint32(1))
        acc = mma(acc, advance(a_desc, STEP_BYTES // UNIT), advance(b_desc, STEP_BYTES // UNIT), np.uint32(1))
        acc = mma(acc, advance(a_desc, 2 * STEP_BYTES // UNIT), advance(b_desc, 2 * STEP_BYTES // UNIT), np.uint32(1))
        return mma(acc, advance(a_desc, 3 * STEP_BYTES // UNIT), advance(b_desc, 3 * STEP_BYTES // UNIT),
                   np.uint32(1))

    sub_step_mmas = _device(sub_step_mmas)

    def consume(dyn, bars, cw, expert_scales, out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                slices_per_split):
        lane = cm.laneid()
        base = hr.lane0_u32(cm.shared_address(dyn))
        bar0 = np.int64(hr.lane0_u32(cm.shared_address(bars)))
        g = lane >> 2
        q = lane & 3
        warpgroup = np.int32(hr.lane0_u32(cw // WARPGROUP_WARPS_))
        m_row = warpgroup * TOKENS_PER_WARPGROUP_ + (cw % WARPGROUP_WARPS_) * ROWS_PER_WARP_ + g
        # the warpgroup's 64 token rows of the stage's first box (descriptor units of 16 bytes)
        a_units = np.uint32((m_data_off + warpgroup * TOKENS_PER_WARPGROUP_ * ROW_BYTES) // UNIT)
        w_row0, half = weight_lane(cw * 32 + lane)
        buffers = np.uint32(base + buffers_off)
        desc_a0 = hp.wgmma_smem_descriptor_device(base, SW128_LEADING_BYTES_, SW128_ATOM_BYTES_, "128B")
        desc_b0 = hp.wgmma_smem_descriptor_device(buffers, SW128_LEADING_BYTES_, SW128_ATOM_BYTES_, "128B")
        w_sc = cuda.local.array(w_sc_words, np.uint32)
        acc_out = cuda.local.array(num_acc, float32)
        acc = zero_acc()
        if two_m_tiles:
            acc_hi = zero_acc()
        buffer = np.uint32(0)
        stage = np.int64(0)
        phase = np.int64(0)
        item = np.int64(0)
        while item < max_tiles:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
            if expert < 0:
                break
            n_sf_row0 = r0 % SF_ATOM_ROWS
            acc = zero_acc()
            if two_m_tiles:
                acc_hi = zero_acc()
            held = np.int64(-1)   # the stage this warp still has to release (its MMAs may be in flight)
            for _ in range(k_slices):
                CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
                st = np.uint32(base + stage * stage_bytes)
                for it in range(items):
                    for u in range(2):
                        quarter = 2 * u + half
                        address = np.uint32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + w_row0 + HALF_ROWS * it),
                                                                      word_column(quarter, n_blocks), atoms))
                        w_sc[4 * it + 2 * u], w_sc[4 * it + 2 * u + 1] = n_load_scales(address, quarter)
                a_stage = np.uint32(stage * (stage_bytes // UNIT)) + a_units
                for u in range(2):   # sub-step u: K 64 u .. 64 u + 63 of the slice, the stage's token box u
                    b_addr = np.uint32(buffers + buffer * buffer_bytes)
                    for it in range(items):
                        w_row = w_row0 + HALF_ROWS * it
                        source = np.uint32(st + n_data_off + w_row * n_row_bytes) + (
                            np.uint32(16 * (2 * u + half)) ^ np.uint32(swizzle(w_row, n_row_bytes, n_mask)))
                        w0, w1, w2, w3 = ld_shared_v4_u32(source)
                        s0, s1 = w_sc[4 * it + 2 * u], w_sc[4 * it + 2 * u + 1]
                        # NVFP4: words 0, 1 are the quarter's first block, 2, 3 its second; MXFP4: one block
                        scale_lo = n_group_scale(s0, s1, n_selector(0), 0)
                        scale_hi = n_group_scale(s0, s1, n_selector(2), 0) if ue4m3 else scale_lo
                        # word w: K 32 half + 8 w .. + 7 of the sub-step, k16 step 2 half + w // 2, its half w % 2
                        decode_store(w0, scale_lo, b_addr + chunk_offset(mma_bn, w_row, 2 * half, 0))
                        decode_store(w1, scale_lo, b_addr + chunk_offset(mma_bn, w_row, 2 * half, 1))
                        decode_store(w2, scale_hi, b_addr + chunk_offset(mma_bn, w_row, 2 * half + 1, 0))
                        decode_store(w3, scale_hi, b_addr + chunk_offset(mma_bn, w_row, 2 * half + 1, 1))
                    cm.fence_proxy_async_shared_cta()   # generic-proxy writes -> wgmma reads
                    # this warpgroup's MMAs of two sub-steps ago are done: in the second sub-step, every MMA that
                    # read the previous slice's stage
                    hp.wgmma_wait_group_1()
                    if u == 1 and held >= 0:
                        cuda.syncwarp()
                        if lane == 0:
                            mb.mbarrier_arrive(bar0 + MBARRIER_BYTES * (stages + held))
                        held = np.int64(-1)
                    cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)   # the buffer is complete
                    hp.wgmma_fence()
                    a_desc = advance(desc_a0, a_stage + np.uint32(u * (region_bytes // UNIT)))
                    b_desc = advance(desc_b0, buffer * (buffer_bytes // UNIT))
                    acc = sub_step_mmas(acc, a_desc, b_desc)
                    if two_m_tiles:   # the warpgroup's second m64 tile: 128 token rows further
                        acc_hi = sub_step_mmas(acc_hi, advance(a_desc, (m_tile_rows * ROW_BYTES) // UNIT), b_desc)
                    hp.wgmma_commit_group()
                    buffer = np.uint32(buffer + np.uint32(1))
                    if buffer == np.uint32(BUFFERS):
                        buffer = np.uint32(0)
                held = stage
                stage, phase = next_stage(stage, phase)
            hp.wgmma_wait_group_0()
            cuda.syncwarp()
            if lane == 0 and held >= 0:
                mb.mbarrier_arrive(bar0 + MBARRIER_BYTES * (stages + held))
            acc = hp.wgmma_fence_accumulators(acc)
            hp.accumulators_to_array(acc, acc_out)
            out_scale = expert_scales[expert] * epilogue_scale
            store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, out_scale)
            if two_m_tiles:
                acc_hi = hp.wgmma_fence_accumulators(acc_hi)
                hp.accumulators_to_array(acc_hi, acc_out)
                store_tile(acc_out, out, n, t0, t1, r0, r1, m_row + m_tile_rows, q, out_scale)
            item += 1

    return _device(consume)


def fp8_weight_source(chunk: int, pair: int, block: int, xor: int) -> int:
    """In-row byte offset, in the raw stage (128-byte rows, 128B swizzle: ``xor`` from ``h200_decode.swizzle_xor``),
    of the 8 bytes (FP4 words ``2 pair`` and ``2 pair + 1`` of MX block ``block`` of the slice's 128-K chunk
    ``chunk``) that a consumer thread of word pair ``pair`` decodes in its weight row."""
    return ((64 * chunk + 16 * block) ^ xor) + 8 * pair


def fp8_buffer_offset(b_row: int, step: int, high: int) -> int:
    """Byte offset in an E4M3 B buffer (K-major, one 128-byte row per weight row, 128B swizzle) of the 16 bytes of
    k32 step ``step`` that hold K positions ``16 high`` .. ``16 high + 15``: position ``4 q + i`` (+16) carries
    element ``i`` (+4) of FP4 word ``step`` of block ``q`` (``fp8_a_word``)."""
    return b_row * E4M3_ROW_BYTES + 16 * ((2 * step + high) ^ (b_row & SW128_CHUNK_MASK))


def fp8_k_of(chunk_position: int) -> int:
    """The element of the 128-K chunk that the route's ``wgmma`` K index ``chunk_position`` (0..127: step
    ``chunk_position // 32``) carries: quad lane q's A registers of step s are FP4 word s of block q, so position
    ``4 q + i`` of step s is element ``8 s + i`` of block q, and ``16 + 4 q + i`` element ``8 s + 4 + i``. A sum over K
    ignores the order; the weights' buffer is written in the same one (``fp8_buffer_offset``)."""
    step, position = divmod(chunk_position, WGMMA_K_E4M3)
    high, rest = divmod(position, 16)
    block, i = divmod(rest, 4)
    return 32 * block + 8 * step + 4 * high + i


def _make_fp8_helpers(spec: WgmmaSpec):
    """Device functions both FP8 consumers use: ``fill_table(table, thread)`` (the 17 x 8-byte magnitude table into
    shared memory, one word per consumer thread) and ``tile_top(slot)`` (the largest of the 8 consumer warps' chunk
    maxima at ``slot``: the weight tile's base byte)."""
    table_words = fd.MAGNITUDE_TABLES.size
    magnitude_table = np.ascontiguousarray(fd.MAGNITUDE_TABLES).reshape(-1)

    def fill_table(table, thread):
        if thread < table_words:
            st_shared_u32(table + 4 * thread, magnitude_table[thread])

    def tile_top(slot):
        t_a0, t_a1, t_a2, t_a3 = ld_shared_v4_u32(slot)
        t_b0, t_b1, t_b2, t_b3 = ld_shared_v4_u32(slot + 16)
        return max(max(max(t_a0, t_a1), max(t_a2, t_a3)), max(max(t_b0, t_b1), max(t_b2, t_b3)))

    return _device(fill_table), _device(tile_top)


def _make_fp8_consumer(spec: WgmmaSpec, ring):
    """The FP8 route's consumer (``docs/design/h200_port.md``, "The FP8 route"): MXFP4 x MXFP4 in ``E2M1E4M3Order``,
    each block's UE8M0 exponent folded into its FP4 -> E4M3 decode (``fp8_decode``) relative to a base per token
    row and per weight tile (128 rows) and chunk; per 128-K chunk 4 x ``wgmma m64n128k32 .e4m3`` (A in registers)
    into a chunk accumulator, which is promoted into the fp32 total with one FFMA per accumulator,
    ``total += chunk * 2^(base_row + base_tile)``, once the next chunk is decoded. A device function for
    ``_kernel_frame``."""
    ring_spec = spec.ring
    read_work_record, next_stage = ring.read_work_record, ring.next_stage
    stages, lay = ring_spec.stages, ring_spec.smem
    stage_bytes = lay.stage_bytes
    m_side, n_side = ring_spec.m_side, ring_spec.n_side
    m_data_off, n_data_off, m_sf_off, n_sf_off = lay.m_data, lay.n_data, lay.m_scales, lay.n_scales
    atoms = m_side.sf_atoms_per_slice
    if (m_side.row_bytes, n_side.row_bytes, spec.subs_per_slice) != (E4M3_ROW_BYTES, E4M3_ROW_BYTES, 2):
        raise AssertionError("the FP8 route reads 128-byte FP4 rows (256-K slices: two 128-K chunks each)")
    mma_bn = spec.mma_bn
    num_acc = mma_bn // 2
    buffers_off, buffer_bytes = spec.buffers_offset, spec.buffer_bytes
    scratch_off = spec.scratch_offset
    table_off = scratch_off + FP8_MAXIMA_BYTES
    fill_table, tile_top = _make_fp8_helpers(spec)
    m_mask, n_mask = m_side.swizzle_mask, n_side.swizzle_mask
    mma = hp.wgmma_e4m3_rs(mma_bn)
    zero_acc = hp.wgmma_zero_accumulators(mma_bn)
    promote = hp.promote_accumulator_rows
    sf_offset = _device(scale_byte_offset)
    swizzle = _device(hd.swizzle_xor)
    weight_source = _device(fp8_weight_source)
    buffer_offset = _device(fp8_buffer_offset)
    advance = _device(hp.wgmma_descriptor_advance)
    chunk_max, table_row = fd.chunk_max_scale_device, fd.fold_table_row_device
    base_log2, decode, power_bits = fd.promotion_log2_device, fd.decode_word_device, fd.power_of_two_bits_device
    store_tile = _make_store_tile(num_acc)
    consumer_threads = CONSUMER_THREADS
    CONSUMER_BARRIER, MBARRIER_BYTES = hr.CONSUMER_BARRIER, hr.MBARRIER_BYTES
    DESCRIPTOR_UNIT_BYTES, SW128_ATOM_BYTES_, SW128_LEADING_BYTES_ = (
        hp.DESCRIPTOR_UNIT_BYTES, SW128_ATOM_BYTES, SW128_LEADING_BYTES)
    TOKENS_PER_WARPGROUP_, ROWS_PER_WARP_, WARPGROUP_WARPS_ = TOKENS_PER_WARPGROUP, ROWS_PER_WARP, WARPGROUP_WARPS
    ROW_BYTES, STEPS, A_WORDS = E4M3_ROW_BYTES, FP8_CHUNK // WGMMA_K_E4M3, A_FRAGMENT_SETS * 4 * (FP8_CHUNK //
                                                                                                WGMMA_K_E4M3)
    A_SET_WORDS = A_WORDS // A_FRAGMENT_SETS

    def consume(dyn, bars, cw, expert_scales, out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                slices_per_split):
        lane = cm.laneid()
        base = hr.lane0_u32(cm.shared_address(dyn))
        bar0 = np.int64(hr.lane0_u32(cm.shared_address(bars)))
        thread = np.uint32(cw * 32 + lane)
        fill_table(np.uint32(base + table_off), thread)
        g = lane >> 2
        q = lane & 3
        # A side: token rows m_row and m_row + 8 (warpgroup cw // 4, warp cw % 4); lane q reads block q of each chunk
        m_row = (cw // WARPGROUP_WARPS_) * TOKENS_PER_WARPGROUP_ + (cw % WARPGROUP_WARPS_) * ROWS_PER_WARP_ + g
        m_xor = np.uint32(swizzle(m_row, ROW_BYTES, m_mask))
        m_row_addr = np.uint32(m_data_off + m_row * ROW_BYTES)
        # B side: weight row b_row, FP4 words 2 pair, 2 pair + 1 of each block (k32 steps 2 pair, 2 pair + 1)
        b_row = thread >> 1
        pair = thread & 1
        b_xor = np.uint32(swizzle(b_row, ROW_BYTES, n_mask))
        b_row_addr = np.uint32(n_data_off + b_row * ROW_BYTES)
        buffers = np.uint32(base + buffers_off)
        maxima = np.uint32(base + scratch_off)
        table = np.uint32(base + table_off)
        desc0 = hp.wgmma_smem_descriptor_device(buffers, SW128_LEADING_BYTES_, SW128_ATOM_BYTES_, "128B")
        a_frag = cuda.local.array(A_WORDS, np.uint32)
        low = cuda.local.array(8, np.uint32)    # [step of the pair][block]
        high = cuda.local.array(8, np.uint32)
        acc_out = cuda.local.array(num_acc, float32)
        total = zero_acc()
        chunk_acc = zero_acc()
        factor_lo = float32(0.0)
        factor_hi = float32(0.0)
        cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)   # the table is in
        buffer = np.uint32(0)
        stage = np.int64(0)
        phase = np.int64(0)
        item = np.int64(0)
        while item < max_tiles:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
            if expert < 0:
                break
            m_sf_row0 = (t0 - group_start) % SF_ATOM_ROWS
            n_sf_row0 = r0 % SF_ATOM_ROWS
            for _ in range(k_slices):
                CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
                st = np.uint32(base + stage * stage_bytes)
                st_m = np.uint32(st + m_row_addr)
                st_b = np.uint32(st + b_row_addr)
                # 1. the weight tile's bases of both chunks: the largest finite scale byte of its 128 rows (the
                # warps' maxima through shared memory: one barrier per slice)
                w_scales0 = ld_shared_u32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + b_row), 0, atoms))
                w_scales1 = ld_shared_u32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + b_row), 4, atoms))
                warp_top0 = cm.warp_max_u32(chunk_max(w_scales0))
                warp_top1 = cm.warp_max_u32(chunk_max(w_scales1))
                if lane == 0:
                    st_shared_u32(maxima + 4 * cw, warp_top0)
                    st_shared_u32(maxima + 32 + 4 * cw, warp_top1)
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                tile_top0, tile_top1 = tile_top(maxima), tile_top(maxima + 32)
                for chunk in range(2):   # unrolled: the chunk picks the A set
                    a_set = A_SET_WORDS * chunk
                    w_scales = w_scales1 if chunk else w_scales0
                    top = tile_top1 if chunk else tile_top0
                    # 2. the weights: E4M3 rows of the chunk into the free buffer
                    b_addr = np.uint32(buffers + buffer * buffer_bytes)
                    for block in range(4):
                        row = table_row(np.int32((w_scales >> (8 * block)) & 0xFF), np.int32(top))
                        tab_lo, tab_hi = ld_shared_v2_u32(table + 8 * row)
                        w0, w1 = ld_shared_v2_u32(st_b + weight_source(chunk, pair, block, b_xor))
                        low[block], high[block] = decode(w0, tab_lo, tab_hi)
                        low[4 + block], high[4 + block] = decode(w1, tab_lo, tab_hi)
                    for j in range(2):
                        step = 2 * pair + j
                        st_shared_v4_u32(b_addr + buffer_offset(b_row, step, 0), low[4 * j], low[4 * j + 1],
                                         low[4 * j + 2], low[4 * j + 3])
                        st_shared_v4_u32(b_addr + buffer_offset(b_row, step, 1), high[4 * j], high[4 * j + 1],
                                         high[4 * j + 2], high[4 * j + 3])
                    cm.fence_proxy_async_shared_cta()   # generic-proxy writes -> wgmma reads
                    # 3. the tokens: FP4 words 0..3 of block q of rows m_row, m_row + 8, one base per row
                    a_scales_lo = ld_shared_u32(st + m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row), 4 * chunk,
                                                                          atoms))
                    a_scales_hi = ld_shared_u32(st + m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row + 8),
                                                                          4 * chunk, atoms))
                    top_lo, top_hi = np.int32(chunk_max(a_scales_lo)), np.int32(chunk_max(a_scales_hi))
                    tab_lo_g, tab_hi_g = ld_shared_v2_u32(table + 8 * table_row(
                        np.int32((a_scales_lo >> (8 * q)) & 0xFF), top_lo))
                    tab_lo_h, tab_hi_h = ld_shared_v2_u32(table + 8 * table_row(
                        np.int32((a_scales_hi >> (8 * q)) & 0xFF), top_hi))
                    source = np.uint32((64 * chunk + 16 * q) ^ m_xor)
                    g0, g1, g2, g3 = ld_shared_v4_u32(st_m + source)
                    h0, h1, h2, h3 = ld_shared_v4_u32(st_m + 8 * ROW_BYTES + source)
                    a_frag[a_set + 0], a_frag[a_set + 2] = decode(g0, tab_lo_g, tab_hi_g)
                    a_frag[a_set + 1], a_frag[a_set + 3] = decode(h0, tab_lo_h, tab_hi_h)
                    a_frag[a_set + 4], a_frag[a_set + 6] = decode(g1, tab_lo_g, tab_hi_g)
                    a_frag[a_set + 5], a_frag[a_set + 7] = decode(h1, tab_lo_h, tab_hi_h)
                    a_frag[a_set + 8], a_frag[a_set + 10] = decode(g2, tab_lo_g, tab_hi_g)
                    a_frag[a_set + 9], a_frag[a_set + 11] = decode(h2, tab_lo_h, tab_hi_h)
                    a_frag[a_set + 12], a_frag[a_set + 14] = decode(g3, tab_lo_g, tab_hi_g)
                    a_frag[a_set + 13], a_frag[a_set + 15] = decode(h3, tab_lo_h, tab_hi_h)
                    tile_log2 = base_log2(np.int32(top))
                    next_lo = f32_from_bits(np.uint32(power_bits(np.int32(base_log2(top_lo) + tile_log2))))
                    next_hi = f32_from_bits(np.uint32(power_bits(np.int32(base_log2(top_hi) + tile_log2))))
                    # 4. the previous chunk's MMAs (this warpgroup's) are done: promote it
                    hp.wgmma_wait_group_0()
                    chunk_acc = hp.wgmma_fence_accumulators(chunk_acc)
                    # the promotion pinned here (a side-effecting asm on its results): else LLVM sinks its FFMAs
                    # below this chunk's MMAs, reading copies of the old chunk that ptxas puts in the new MMAs'
                    # accumulators (C7514: every accumulating MMA of the kernel serialized)
                    total = hp.wgmma_fence_accumulators(promote(total, chunk_acc, factor_lo, factor_hi))
                    factor_lo, factor_hi = next_lo, next_hi
                    # 5. meet the other warpgroup (the buffer is complete), then issue this chunk's MMAs
                    cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                    hp.wgmma_fence()
                    b_desc = advance(desc0, buffer * (buffer_bytes // DESCRIPTOR_UNIT_BYTES))
                    for s in range(STEPS):
                        chunk_acc = mma(chunk_acc, (a_frag[a_set + 4 * s], a_frag[a_set + 4 * s + 1],
                                                    a_frag[a_set + 4 * s + 2], a_frag[a_set + 4 * s + 3]),
                                        advance(b_desc, (WGMMA_K_E4M3 * s) // DESCRIPTOR_UNIT_BYTES),
                                        np.uint32(s != 0))
                    hp.wgmma_commit_group()
                    buffer ^= np.uint32(1)
                # every read of the raw stage is done (the MMAs read the E4M3 buffers)
                cuda.syncwarp()
                if lane == 0:
                    mb.mbarrier_arrive(bar0 + MBARRIER_BYTES * (stages + stage))
                stage, phase = next_stage(stage, phase)
            hp.wgmma_wait_group_0()
            chunk_acc = hp.wgmma_fence_accumulators(chunk_acc)
            total = promote(total, chunk_acc, factor_lo, factor_hi)
            hp.accumulators_to_array(total, acc_out)
            store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, expert_scales[expert])
            total = zero_acc()
            chunk_acc = zero_acc()   # the next tile's first promotion adds 0 x 0
            factor_lo = float32(0.0)
            factor_hi = float32(0.0)
            item += 1

    return _device(consume)


def fp8_natural_offset(b_row: int, chunk16: int) -> int:
    """Byte offset in an E4M3 B buffer (128-byte rows, 128B swizzle) of 16-byte chunk ``chunk16`` (K bytes
    ``16 chunk16`` .. ``+ 15`` in natural K order: W4A8's tokens come from the ring as they are) of weight row
    ``b_row``."""
    return b_row * E4M3_ROW_BYTES + 16 * (chunk16 ^ (b_row & SW128_CHUNK_MASK))


def _make_fp8_tokens_consumer(spec: WgmmaSpec, ring):
    """W4A8 on the FP8 route: the MXFP8 tokens are the wgmma A operand straight from the ring stage (E4M3 bytes as
    quantized, K-major with TMA's 128B swizzle: no decode); the MXFP4 weights are decoded to E4M3 in natural K order
    with their exponents folded relative to a base per 128-row tile and 128-K slice (``fp8_decode``). The tokens'
    scales change every 32 K, so each k32 step accumulates into a fresh chunk set (two sets in turn) and is promoted,
    ``total += step * 2^(e_token + base_tile)``, one FFMA per accumulator (evidence: fp8-w4a8-promotion), while the
    other warpgroup's MMAs run. The raw stage is read by the MMAs, so it is released after the slice's last wait. A
    device function for ``_kernel_frame``."""
    ring_spec = spec.ring
    read_work_record, next_stage = ring.read_work_record, ring.next_stage
    stages, lay = ring_spec.stages, ring_spec.smem
    stage_bytes = lay.stage_bytes
    m_side, n_side = ring_spec.m_side, ring_spec.n_side
    m_data_off, n_data_off, m_sf_off, n_sf_off = lay.m_data, lay.n_data, lay.m_scales, lay.n_scales
    atoms = m_side.sf_atoms_per_slice
    if (m_side.row_bytes, n_side.row_bytes, spec.k_slice) != (E4M3_ROW_BYTES, E4M3_ROW_BYTES // 2, FP8_CHUNK):
        raise AssertionError("W4A8's FP8 route reads 128-byte E4M3 token rows and 64-byte FP4 weight rows per slice")
    if m_data_off % SW128_ATOM_BYTES or stage_bytes % SW128_ATOM_BYTES:
        raise AssertionError("the tokens' stage rows must be 1024-byte aligned: they are a wgmma operand")
    mma_bn = spec.mma_bn
    num_acc = mma_bn // 2
    buffers_off, buffer_bytes = spec.buffers_offset, spec.buffer_bytes
    scratch_off = spec.scratch_offset
    table_off = scratch_off + FP8_MAXIMA_BYTES
    fill_table, tile_top = _make_fp8_helpers(spec)
    n_mask = n_side.swizzle_mask
    n_row_bytes = n_side.row_bytes
    mma = hp.wgmma_e4m3_ss(mma_bn)
    zero_acc = hp.wgmma_zero_accumulators(mma_bn)
    promote = hp.promote_accumulator_rows
    sf_offset = _device(scale_byte_offset)
    swizzle = _device(hd.swizzle_xor)
    natural_offset = _device(fp8_natural_offset)
    advance = _device(hp.wgmma_descriptor_advance)
    chunk_max, table_row = fd.chunk_max_scale_device, fd.fold_table_row_device
    base_log2, decode, factor_bits = fd.promotion_log2_device, fd.decode_word_device, fd.token_factor_bits_device
    store_tile = _make_store_tile(num_acc)
    consumer_threads = CONSUMER_THREADS
    CONSUMER_BARRIER, MBARRIER_BYTES = hr.CONSUMER_BARRIER, hr.MBARRIER_BYTES
    UNIT, SW128_ATOM_BYTES_, SW128_LEADING_BYTES_ = hp.DESCRIPTOR_UNIT_BYTES, SW128_ATOM_BYTES, SW128_LEADING_BYTES
    TOKENS_PER_WARPGROUP_, ROWS_PER_WARP_, WARPGROUP_WARPS_ = TOKENS_PER_WARPGROUP, ROWS_PER_WARP, WARPGROUP_WARPS
    ROW_BYTES, STEP_BYTES = E4M3_ROW_BYTES, WGMMA_K_E4M3
    if FP8_CHUNK // WGMMA_K_E4M3 != 4:
        raise AssertionError("the consumer writes out 4 k32 steps per slice")

    def mma_step(acc, a_desc, b_desc, s):
        """k32 step ``s`` of the slice into a fresh chunk set, committed as its own group."""
        hp.wgmma_fence()
        acc = mma(acc, advance(a_desc, (STEP_BYTES * s) // UNIT), advance(b_desc, (STEP_BYTES * s) // UNIT),
                  np.uint32(0))
        hp.wgmma_commit_group()
        return acc

    def step_factors(a_scales_lo, a_scales_hi, s, tile_log2):
        """The promotion factors of step ``s`` for rows m_row and m_row + 8."""
        return (f32_from_bits(np.uint32(factor_bits(np.int32((a_scales_lo >> (8 * s)) & 0xFF), tile_log2))),
                f32_from_bits(np.uint32(factor_bits(np.int32((a_scales_hi >> (8 * s)) & 0xFF), tile_log2))))

    mma_step, step_factors = _device(mma_step), _device(step_factors)

    def consume(dyn, bars, cw, expert_scales, out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                slices_per_split):
        lane = cm.laneid()
        base = hr.lane0_u32(cm.shared_address(dyn))
        bar0 = np.int64(hr.lane0_u32(cm.shared_address(bars)))
        thread = np.uint32(cw * 32 + lane)
        fill_table(np.uint32(base + table_off), thread)
        g = lane >> 2
        q = lane & 3
        warpgroup = np.int32(hr.lane0_u32(cw // WARPGROUP_WARPS_))
        m_row = warpgroup * TOKENS_PER_WARPGROUP_ + (cw % WARPGROUP_WARPS_) * ROWS_PER_WARP_ + g
        # the warpgroup's 64 token rows of a stage, as wgmma's A operand (descriptor units of 16 bytes)
        a_units = np.uint32((m_data_off + warpgroup * TOKENS_PER_WARPGROUP_ * ROW_BYTES) // UNIT)
        # B side: weight row b_row, MX blocks 2 half and 2 half + 1 of the slice
        b_row = thread >> 1
        half = thread & 1
        b_xor = np.uint32(swizzle(b_row, n_row_bytes, n_mask))
        b_row_addr = np.uint32(n_data_off + b_row * n_row_bytes)
        buffers = np.uint32(base + buffers_off)
        maxima = np.uint32(base + scratch_off)
        table = np.uint32(base + table_off)
        desc_a0 = hp.wgmma_smem_descriptor_device(base, SW128_LEADING_BYTES_, SW128_ATOM_BYTES_, "128B")
        desc_b0 = hp.wgmma_smem_descriptor_device(buffers, SW128_LEADING_BYTES_, SW128_ATOM_BYTES_, "128B")
        acc_out = cuda.local.array(num_acc, float32)
        total = zero_acc()
        chunk = zero_acc()
        cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)   # the table is in
        buffer = np.uint32(0)
        stage = np.int64(0)
        phase = np.int64(0)
        item = np.int64(0)
        while item < max_tiles:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
            if expert < 0:
                break
            m_sf_row0 = (t0 - group_start) % SF_ATOM_ROWS
            n_sf_row0 = r0 % SF_ATOM_ROWS
            for _ in range(k_slices):
                CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
                st = np.uint32(base + stage * stage_bytes)
                # 1. the weight tile's base: the largest finite scale byte of its 128 rows in this slice
                w_scales = ld_shared_u32(st + n_sf_off + sf_offset(np.uint32(n_sf_row0 + b_row), 0, atoms))
                warp_top = cm.warp_max_u32(chunk_max(w_scales))
                if lane == 0:
                    st_shared_u32(maxima + 32 * buffer + 4 * cw, warp_top)
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)
                top = tile_top(maxima + 32 * buffer)
                # 2. the weights: E4M3 in natural K order into the free buffer (a block's 4 words -> 32 bytes)
                b_addr = np.uint32(buffers + buffer * buffer_bytes)
                st_b = np.uint32(st + b_row_addr)
                for j in range(2):
                    block = 2 * half + j
                    row = table_row(np.int32((w_scales >> (8 * block)) & 0xFF), np.int32(top))
                    tab_lo, tab_hi = ld_shared_v2_u32(table + 8 * row)
                    w0, w1, w2, w3 = ld_shared_v4_u32(st_b + ((16 * block) ^ b_xor))
                    l0, h0 = decode(w0, tab_lo, tab_hi)
                    l1, h1 = decode(w1, tab_lo, tab_hi)
                    l2, h2 = decode(w2, tab_lo, tab_hi)
                    l3, h3 = decode(w3, tab_lo, tab_hi)
                    st_shared_v4_u32(b_addr + natural_offset(b_row, 2 * block), l0, h0, l1, h1)
                    st_shared_v4_u32(b_addr + natural_offset(b_row, 2 * block + 1), l2, h2, l3, h3)
                cm.fence_proxy_async_shared_cta()   # generic-proxy writes -> wgmma reads
                # the token rows' block scales of the slice (rows m_row, m_row + 8)
                a_scales_lo = ld_shared_u32(st + m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row), 0, atoms))
                a_scales_hi = ld_shared_u32(st + m_sf_off + sf_offset(np.uint32(m_sf_row0 + m_row + 8), 0, atoms))
                tile_log2 = np.int32(base_log2(np.int32(top)))
                cm.named_barrier_sync(CONSUMER_BARRIER, consumer_threads)   # the buffer is complete
                a_desc = advance(desc_a0, np.uint32(stage * (stage_bytes // UNIT)) + a_units)
                b_desc = advance(desc_b0, buffer * (buffer_bytes // UNIT))
                # the 4 k32 steps written out, each into the fresh chunk set and promoted once it is done (two
                # sets in turn spill: 3 x 64 accumulators over the consumers' registers); the other warpgroup's
                # MMAs run meanwhile
                chunk = mma_step(chunk, a_desc, b_desc, 0)
                factor_lo, factor_hi = step_factors(a_scales_lo, a_scales_hi, 0, tile_log2)
                hp.wgmma_wait_group_0()
                chunk = hp.wgmma_fence_accumulators(chunk)
                total = promote(total, chunk, factor_lo, factor_hi)
                chunk = mma_step(chunk, a_desc, b_desc, 1)
                factor_lo, factor_hi = step_factors(a_scales_lo, a_scales_hi, 1, tile_log2)
                hp.wgmma_wait_group_0()
                chunk = hp.wgmma_fence_accumulators(chunk)
                total = promote(total, chunk, factor_lo, factor_hi)
                chunk = mma_step(chunk, a_desc, b_desc, 2)
                factor_lo, factor_hi = step_factors(a_scales_lo, a_scales_hi, 2, tile_log2)
                hp.wgmma_wait_group_0()
                chunk = hp.wgmma_fence_accumulators(chunk)
                total = promote(total, chunk, factor_lo, factor_hi)
                chunk = mma_step(chunk, a_desc, b_desc, 3)
                factor_lo, factor_hi = step_factors(a_scales_lo, a_scales_hi, 3, tile_log2)
                hp.wgmma_wait_group_0()
                chunk = hp.wgmma_fence_accumulators(chunk)
                total = promote(total, chunk, factor_lo, factor_hi)
                # every MMA that read the raw stage (this warpgroup's) is done
                cuda.syncwarp()
                if lane == 0:
                    mb.mbarrier_arrive(bar0 + MBARRIER_BYTES * (stages + stage))
                buffer ^= np.uint32(1)
                stage, phase = next_stage(stage, phase)
            hp.accumulators_to_array(total, acc_out)
            store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, expert_scales[expert])
            total = zero_acc()
            item += 1

    return _device(consume)


def _make_chunk_scaled_consumer(spec: WgmmaSpec, ring):
    """The FP8 route on operands already folded (``WgmmaSpec.chunk_scaled``): E4M3 tokens and weights whose UE8M0
    scales are constant per 128-K chunk, per token row and per 128-row weight tile (``gbs.fp8_route.fold_problem``
    writes MXFP4 that way, exactly). Both operands are wgmma's shared-memory operands straight from the ring stage
    (no thread touches them): per slice 4 x ``wgmma m64n128k32 .e4m3`` into one of two chunk sets; while they run,
    the previous slice's set is promoted, ``total += chunk * 2^(e_token + e_tile - 254)``, one FFMA per accumulator,
    and its stage released (``tile_chunks``). The 128 x 192 tile (``FOLDED_WIDE_MMA_BN``, ``tile_serial``): one set,
    DeepGEMM's order: per slice 4 x ``wgmma m64n192k32 .e4m3``, the factors read while they run (one per token row and
    64-column group: the tile spans two fold tiles, ``column_group_scale_row``), the wait for them, the stage released,
    the set promoted while the other warpgroup's MMAs run. W4A8 (``WgmmaSpec.step_scaled``: MXFP8 tokens as quantized,
    folded weights): the tokens' scales change every k32 step, so the sets alternate per step and each step is promoted
    with its block's factor (``tile_steps``). A device function for ``_kernel_frame``."""
    ring_spec = spec.ring
    read_work_record, next_stage = ring.read_work_record, ring.next_stage
    stages, lay = ring_spec.stages, ring_spec.smem
    stage_bytes = lay.stage_bytes
    m_side, n_side = ring_spec.m_side, ring_spec.n_side
    m_data_off, n_data_off, m_sf_off, n_sf_off = lay.m_data, lay.n_data, lay.m_scales, lay.n_scales
    atoms = m_side.sf_atoms_per_slice
    if (m_side.row_bytes, n_side.row_bytes, spec.k_slice) != (E4M3_ROW_BYTES, E4M3_ROW_BYTES, FP8_CHUNK):
        raise AssertionError("the chunk-scaled route reads 128-byte E4M3 rows of both operands per 128-K slice")
    if m_data_off % SW128_ATOM_BYTES or n_data_off % SW128_ATOM_BYTES or stage_bytes % SW128_ATOM_BYTES:
        raise AssertionError("both operands' stage rows must be 1024-byte aligned: they are wgmma operands")
    mma_bn, cta_group = spec.mma_bn, spec.cta_group
    num_acc = mma_bn // 2
    mma = hp.wgmma_e4m3_ss(mma_bn)
    zero_acc = hp.wgmma_zero_accumulators(mma_bn)
    promote = hp.promote_accumulator_rows
    sf_offset = _device(scale_byte_offset)
    advance = _device(hp.wgmma_descriptor_advance)
    scale_bits = fd.ue8m0_f32_bits_device
    store_tile = _make_store_tile(num_acc)
    group_row = _device(column_group_scale_row)
    one_set = spec.chunk_sets == 1
    GROUP_COLUMNS = fold_column_group(mma_bn)
    if one_set and mma_bn // GROUP_COLUMNS != 3:
        raise AssertionError("the one-set consumer writes out 3 column groups' factors")
    MBARRIER_BYTES = hr.MBARRIER_BYTES
    UNIT, SW128_ATOM_BYTES_, SW128_LEADING_BYTES_ = hp.DESCRIPTOR_UNIT_BYTES, SW128_ATOM_BYTES, SW128_LEADING_BYTES
    TOKENS_PER_WARPGROUP_, ROWS_PER_WARP_, WARPGROUP_WARPS_ = TOKENS_PER_WARPGROUP, ROWS_PER_WARP, WARPGROUP_WARPS
    ROW_BYTES, STEP_UNITS = E4M3_ROW_BYTES, WGMMA_K_E4M3 // hp.DESCRIPTOR_UNIT_BYTES
    ROWS_PER_CTA = ring_spec.m_rows
    WARP_SIZE_ = hr.WARP_SIZE
    STAGE_UNITS = stage_bytes // UNIT
    lane0_u32 = hr.lane0_u32
    if FP8_CHUNK // WGMMA_K_E4M3 != 4:
        raise AssertionError("the consumer writes out 4 k32 steps per slice")

    def slice_mmas(acc, a_desc, b_desc, onto):
        """The slice's 4 k32 steps into a fresh chunk set (``onto`` 1: onto the set as it is), one wgmma group."""
        hp.wgmma_fence()
        acc = mma(acc, a_desc, b_desc, onto)
        acc = mma(acc, advance(a_desc, STEP_UNITS), advance(b_desc, STEP_UNITS), np.uint32(1))
        acc = mma(acc, advance(a_desc, 2 * STEP_UNITS), advance(b_desc, 2 * STEP_UNITS), np.uint32(1))
        acc = mma(acc, advance(a_desc, 3 * STEP_UNITS), advance(b_desc, 3 * STEP_UNITS), np.uint32(1))
        hp.wgmma_commit_group()
        return acc

    def tile_scale(st, n_sf_row):
        """The folded weights' scale of the slice in stage ``st`` at row ``n_sf_row`` of its scale bands (block 0; every
        row of a fold tile carries the tile's) as an fp32 factor."""
        return f32_from_bits(scale_bits(ld_shared_u32(st + n_sf_off + sf_offset(n_sf_row, 0, atoms)) & np.uint32(0xFF)))

    def stage_scales(st, m_sf_row, n_sf_row):
        """The slice's scales in stage ``st``: the weight tile's as an fp32 factor (``tile_scale``) and the 4 block
        bytes of token rows m_row and m_row + 8."""
        return (tile_scale(st, n_sf_row), ld_shared_u32(st + m_sf_off + sf_offset(m_sf_row, 0, atoms)),
                ld_shared_u32(st + m_sf_off + sf_offset(m_sf_row + np.uint32(8), 0, atoms)))

    def release(bar0, stage, lane):
        """One arrival per warp on the stage's ``empty`` barrier; in a pair one per warpgroup in each CTA (the peer's
        producer multicasts into this CTA's stage too): ``lane`` is then the warpgroup's first warp's lane, and
        ``WARP_SIZE`` in its other warps. CTA-scope release as CUTLASS's multicast pipelines: the cluster-scope
        release put a GPU-scope fence before every arrival and the pair ran 2.3x slower (evidence: fold-pair-ab)."""
        cuda.syncwarp()
        empty = np.uint32(bar0 + MBARRIER_BYTES * (stages + stage))
        if cta_group > 1:
            if lane < cta_group:   # lane r arrives in CTA r
                mb.mbarrier_arrive_remote(cl.mapa_shared_cluster(empty, lane))
        elif lane == 0:
            mb.mbarrier_arrive(empty)

    def step_mma(acc, a_desc, b_desc, s):
        """k32 step ``s`` of the slice into a fresh chunk set, one wgmma group."""
        hp.wgmma_fence()
        acc = mma(acc, advance(a_desc, s * STEP_UNITS), advance(b_desc, s * STEP_UNITS), np.uint32(0))
        hp.wgmma_commit_group()
        return acc

    def step_factor(token_word, s, tile_factor):
        """A token row's promotion factor of k32 step ``s``: its block's scale (byte ``s`` of the row's slice word)
        times the weight tile's, an exact fp32 product (``fp8_decode.ue8m0_f32_bits``)."""
        return f32_from_bits(scale_bits((token_word >> np.uint32(8 * s)) & np.uint32(0xFF))) * tile_factor

    def empty_group(acc, a_desc, b_desc, onto):
        """``slice_mmas`` without the MMAs (the ``"no_mma"`` diagnostic): an empty group keeps the waits."""
        hp.wgmma_fence()
        hp.wgmma_commit_group()
        return acc

    if spec.diagnostic == DIAGNOSTIC_NO_MMA:
        slice_mmas = empty_group
    tile_scale = _device(tile_scale)
    slice_mmas, stage_scales, release = _device(slice_mmas), _device(stage_scales), _device(release)
    step_mma, step_factor = _device(step_mma), _device(step_factor)

    def column_group_factors(st, m_sf_row, row_0, row_1, row_2):
        """The 128 x 192 tile's promotion factors of the slice in stage ``st``: token rows m_row and m_row + 8 times
        each 64-column group's fold tile (``column_group_scale_row``: rows ``row_0..2`` of the scale bands)."""
        w_0, lo_word, hi_word = stage_scales(st, m_sf_row, row_0)
        w_1, w_2 = tile_scale(st, row_1), tile_scale(st, row_2)
        return ((step_factor(lo_word, 0, w_0), step_factor(lo_word, 0, w_1), step_factor(lo_word, 0, w_2)),
                (step_factor(hi_word, 0, w_0), step_factor(hi_word, 0, w_1), step_factor(hi_word, 0, w_2)))

    column_group_factors = _device(column_group_factors)

    def end_slice(last, total, f_lo, f_hi, bar0, lane, stage, phase, done, k_slices):
        """After a slice's MMAs are issued (the last into set ``last``, factors ``f_lo`` / ``f_hi``): the ring moves
        on, and after a tile's last slice its set is promoted and its stage released. Returns the set, the total,
        the ring position, the stage now held and the slices done."""
        held = stage
        stage, phase = next_stage(stage, phase)
        done += np.int32(1)
        if done == k_slices:
            hp.wgmma_wait_group_0()
            last = hp.wgmma_fence_accumulators(last)
            release(bar0, held, lane)
            total = promote(total, last, f_lo, f_hi)
        return last, total, stage, phase, held, done

    end_slice = _device(end_slice)

    def slice_into(fresh, other, other_lo, other_hi, total, base, bar0, lane, stage, phase, held, done, k_slices,
                   m_sf_row, n_sf_row, desc_a0, desc_b0):
        """The next K slice into chunk set ``fresh``; then the slice before (in ``other``, its factors ``other_lo`` /
        ``other_hi``) is promoted and its stage ``held`` released, and after a tile's last slice ``fresh`` too."""
        CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
        units = np.uint32(stage * STAGE_UNITS)
        fresh = slice_mmas(fresh, advance(desc_a0, units), advance(desc_b0, units), np.uint32(0))
        # while they run, the factors of this slice's promotion; folded tokens: the chunk's 4 block scales are
        # equal, block 0's is the row's
        tile_factor, lo_word, hi_word = stage_scales(np.uint32(base + stage * stage_bytes), m_sf_row, n_sf_row)
        f_lo, f_hi = step_factor(lo_word, 0, tile_factor), step_factor(hi_word, 0, tile_factor)
        if done > 0:
            hp.wgmma_wait_group_1()
            other = hp.wgmma_fence_accumulators(other)
            release(bar0, held, lane)
            total = promote(total, other, other_lo, other_hi)
        fresh, total, stage, phase, held, done = end_slice(fresh, total, f_lo, f_hi, bar0, lane, stage, phase, done,
                                                           k_slices)
        return fresh, other, total, f_lo, f_hi, stage, phase, held, done

    slice_into = _device(slice_into)

    def tile_chunks(total, set_x, set_y, base, bar0, lane, stage, phase, k_slices, m_sf_row, n_sf_row, desc_a0,
                    desc_b0):
        """One tile's K slices into the two chunk sets in turn (``slice_into``); returns the total, the sets and the
        ring position."""
        last_lo = float32(0.0)   # the factors of the last slice issued
        last_hi = float32(0.0)
        done = np.int32(0)   # 32-bit slice counts: no 64-bit compares in the loop
        held = np.int64(0)    # the stage whose MMAs run in the other set
        while True:
            set_x, set_y, total, last_lo, last_hi, stage, phase, held, done = slice_into(
                set_x, set_y, last_lo, last_hi, total, base, bar0, lane, stage, phase, held, done, k_slices, m_sf_row,
                n_sf_row, desc_a0, desc_b0)
            if done == k_slices:
                break
            set_y, set_x, total, last_lo, last_hi, stage, phase, held, done = slice_into(
                set_y, set_x, last_lo, last_hi, total, base, bar0, lane, stage, phase, held, done, k_slices, m_sf_row,
                n_sf_row, desc_a0, desc_b0)
            if done == k_slices:
                break
        return total, set_x, set_y, stage, phase

    def tile_steps(total, set_x, set_y, base, bar0, lane, stage, phase, k_slices, m_sf_row, n_sf_row, desc_a0,
                   desc_b0):
        """W4A8: one tile's k32 steps, each into one of the two sets while the step before is promoted with its
        block's factor; a stage is released once its last step is promoted (during the next slice)."""
        fy_lo = float32(0.0)
        fy_hi = float32(0.0)
        set_y = zero_acc()
        done = np.int32(0)
        held = np.int64(0)    # the stage whose last step runs in set y
        while True:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            tile_factor, lo_word, hi_word = stage_scales(np.uint32(base + stage * stage_bytes), m_sf_row, n_sf_row)
            units = np.uint32(stage * STAGE_UNITS)
            a_desc, b_desc = advance(desc_a0, units), advance(desc_b0, units)
            set_x = step_mma(set_x, a_desc, b_desc, 0)
            # the previous slice's last step (in a tile's first slice: set y's zeros times 0, adding nothing; no
            # branch around the accumulators, which would make ptxas serialize the MMAs)
            hp.wgmma_wait_group_1()
            set_y = hp.wgmma_fence_accumulators(set_y)
            if done > 0:
                release(bar0, held, lane)
            total = promote(total, set_y, fy_lo, fy_hi)
            set_y = step_mma(set_y, a_desc, b_desc, 1)
            hp.wgmma_wait_group_1()
            set_x = hp.wgmma_fence_accumulators(set_x)
            total = promote(total, set_x, step_factor(lo_word, 0, tile_factor), step_factor(hi_word, 0, tile_factor))
            set_x = step_mma(set_x, a_desc, b_desc, 2)
            hp.wgmma_wait_group_1()
            set_y = hp.wgmma_fence_accumulators(set_y)
            total = promote(total, set_y, step_factor(lo_word, 1, tile_factor), step_factor(hi_word, 1, tile_factor))
            set_y = step_mma(set_y, a_desc, b_desc, 3)
            hp.wgmma_wait_group_1()
            set_x = hp.wgmma_fence_accumulators(set_x)
            total = promote(total, set_x, step_factor(lo_word, 2, tile_factor), step_factor(hi_word, 2, tile_factor))
            fy_lo, fy_hi = step_factor(lo_word, 3, tile_factor), step_factor(hi_word, 3, tile_factor)
            set_y, total, stage, phase, held, done = end_slice(set_y, total, fy_lo, fy_hi, bar0, lane, stage, phase,
                                                               done, k_slices)
            if done == k_slices:
                break
        return total, set_x, set_y, stage, phase

    def tile_serial(total, chunk, base, bar0, lane, stage, phase, k_slices, m_sf_row, r0, desc_a0, desc_b0):
        """The wide tile's K slices into its one chunk set (``chunk_sets`` 1), each promoted once its MMAs are done
        with a factor per token row and column group: the group's fold tile's scale (``column_group_scale_row``) times
        the row's. Returns the total, the set and the ring position."""
        row_0 = np.uint32(group_row(r0, 0, GROUP_COLUMNS))
        row_1 = np.uint32(group_row(r0, 1, GROUP_COLUMNS))
        row_2 = np.uint32(group_row(r0, 2, GROUP_COLUMNS))
        done = np.int32(0)
        while True:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            units = np.uint32(stage * STAGE_UNITS)
            chunk = slice_mmas(chunk, advance(desc_a0, units), advance(desc_b0, units), np.uint32(0))
            # while they run, the factors; folded tokens: the chunk's 4 block scales are equal, block 0's is the row's
            f_lo, f_hi = column_group_factors(np.uint32(base + stage * stage_bytes), m_sf_row, row_0, row_1, row_2)
            hp.wgmma_wait_group_0()
            chunk = hp.wgmma_fence_accumulators(chunk)
            release(bar0, stage, lane)
            total = promote(total, chunk, f_lo, f_hi)
            stage, phase = next_stage(stage, phase)
            done += np.int32(1)
            if done == k_slices:
                break
        return total, chunk, stage, phase

    def tile_unpromoted(total, chunk, base, bar0, lane, stage, phase, k_slices, m_sf_row, r0, desc_a0, desc_b0):
        """``tile_serial`` without its per-slice promotion (the ``"no_promotion"`` diagnostic): every slice onto the
        chunk set, each stage released once the next slice's MMAs are issued, one promotion per tile with the last
        slice's factors (wrong results; the factors are still read every slice)."""
        row_0 = np.uint32(group_row(r0, 0, GROUP_COLUMNS))
        row_1 = np.uint32(group_row(r0, 1, GROUP_COLUMNS))
        row_2 = np.uint32(group_row(r0, 2, GROUP_COLUMNS))
        done = np.int32(0)
        held = stage
        while True:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            units = np.uint32(stage * STAGE_UNITS)
            chunk = slice_mmas(chunk, advance(desc_a0, units), advance(desc_b0, units), np.uint32(done > 0))
            f_lo, f_hi = column_group_factors(np.uint32(base + stage * stage_bytes), m_sf_row, row_0, row_1, row_2)
            hp.wgmma_wait_group_1()
            if done > 0:
                release(bar0, held, lane)
            held = stage
            stage, phase = next_stage(stage, phase)
            done += np.int32(1)
            if done == k_slices:
                break
        hp.wgmma_wait_group_0()
        chunk = hp.wgmma_fence_accumulators(chunk)
        release(bar0, held, lane)
        total = promote(total, chunk, f_lo, f_hi)
        return total, chunk, stage, phase

    if one_set:
        run_tile = tile_unpromoted if spec.diagnostic == DIAGNOSTIC_NO_PROMOTION else tile_serial
    else:
        run_tile = tile_steps if spec.step_scaled else tile_chunks
    run_tile = _device(run_tile)

    def consume(dyn, bars, cw, expert_scales, out, n, k_slices, max_tiles, split_sums, split_counters, k_splits,
                slices_per_split):
        lane = cm.laneid()
        # warp-uniform to ptxas: descriptors in uniform registers, barrier addresses kept (hr.lane0_u32)
        base = lane0_u32(cm.shared_address(dyn))
        bar0 = np.int64(lane0_u32(cm.shared_address(bars)))
        g = lane >> 2
        q = lane & 3
        warpgroup = np.int32(lane0_u32(cw // WARPGROUP_WARPS_))
        m_row = warpgroup * TOKENS_PER_WARPGROUP_ + (cw % WARPGROUP_WARPS_) * ROWS_PER_WARP_ + g
        # the warpgroup's 64 token rows and the tile's weight rows of stage 0, as wgmma operands
        desc_a0 = hp.wgmma_smem_descriptor_device(
            np.uint32(base + m_data_off + warpgroup * TOKENS_PER_WARPGROUP_ * ROW_BYTES), SW128_LEADING_BYTES_,
            SW128_ATOM_BYTES_, "128B")
        desc_b0 = hp.wgmma_smem_descriptor_device(np.uint32(base + n_data_off), SW128_LEADING_BYTES_,
                                                  SW128_ATOM_BYTES_, "128B")
        acc_out = cuda.local.array(num_acc, float32)
        total = zero_acc()
        set_x = zero_acc()
        if not one_set:
            set_y = zero_acc()
        stage = np.int64(0)
        phase = np.int64(0)
        item = np.int64(0)
        # a pair's tile is 2 x 128 tokens: this CTA's are the rank-th 128 (none where the group ends before)
        own_offset = np.uint32(cl.cluster_ctarank() * ROWS_PER_CTA) if cta_group > 1 else np.uint32(0)
        # the lane ``release`` reads: a pair's stages take one arrival per warpgroup and CTA
        release_lane = lane if cta_group == 1 or cw % WARPGROUP_WARPS_ == 0 else np.uint32(WARP_SIZE_)
        slices = np.int32(k_slices)
        while item < max_tiles:
            CONSUMER_WAIT(bar0 + MBARRIER_BYTES * stage, phase)
            expert, tile, t0, t1, r0, r1, s_begin, group_start = read_work_record(bars, stage, lane)
            if expert < 0:
                break
            t0 = np.uint32(t0 + own_offset)
            m_sf_row = np.uint32((t0 - group_start) % SF_ATOM_ROWS + m_row)
            if one_set:
                total, set_x, stage, phase = run_tile(total, set_x, base, bar0, release_lane, stage, phase, slices,
                                                      m_sf_row, r0, desc_a0, desc_b0)
            else:   # a 128-row tile: one fold tile
                n_sf_row = np.uint32(group_row(r0, 0, GROUP_COLUMNS))
                total, set_x, set_y, stage, phase = run_tile(total, set_x, set_y, base, bar0, release_lane, stage,
                                                             phase, slices, m_sf_row, n_sf_row, desc_a0, desc_b0)
            hp.accumulators_to_array(total, acc_out)
            store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, expert_scales[expert])
            total = zero_acc()
            item += 1

    return _device(consume)


def swapped_accumulator_position(m_row: int, q: int, i: int) -> tuple[int, int]:
    """(weight row, token) inside a swapped tile of accumulator ``i`` of the consumer thread whose first M row
    is ``m_row`` (warpgroup row base + warp row base + g) and quad lane ``q``: ``wgmma_accumulator_position``'s
    (row, column) with rows = weights and columns = tokens. Host and device."""
    return m_row + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * q + (i & 1)


def fold_column_group(mma_bn: int) -> int:
    """Columns (weight rows) of a chunk-scaled tile of ``mma_bn`` rows that one promotion factor covers: gcd(mma_bn,
    128) (``FOLD_TILE_ROWS``); a tile starts at a multiple of ``mma_bn``, so no group straddles a fold tile's edge.
    The whole 128-row tile; 64 of the 192-row tile (3 groups: it starts at row 0 or 64 of a fold tile)."""
    return math.gcd(mma_bn, FOLD_TILE_ROWS)


def column_group_scale_row(r0, g, group_columns):
    """Row, in the stage's weight scale bands (from the band of the tile's first row ``r0``), of the scale byte column
    group ``g`` (``group_columns`` wide, ``fold_column_group``) is promoted with: its first row's, ``r0 + group_columns
    g``, whose fold tile holds the whole group (folded weights carry a tile's scale on every row). Host and device."""
    return r0 % SF_ATOM_ROWS + group_columns * g


def column_group_fold_tile(r0: int, g: int, mma_bn: int) -> int:
    """The fold tile (128-row weight tile of ``gbs.fp8_route.fold_weights``, from the expert's row 0) whose scale the
    consumer reads for column group ``g`` of the tile starting at weight row ``r0`` (``column_group_scale_row``)."""
    band_start = r0 - r0 % SF_ATOM_ROWS
    return (band_start + column_group_scale_row(r0, g, fold_column_group(mma_bn))) // FOLD_TILE_ROWS


def _make_split_epilogue(num_acc: int):
    """Device functions of the swapped tiles' split-K epilogue (``WgmmaSpec.split_k``): ``add_partial(acc_out,
    sums_address, n, t0, t1, r0, r1, m_row, q, out_scale)`` adds a thread's scaled accumulators to the fp32
    workspace (``red.global.add.f32``; a thread's two columns are two tokens, one output row apart, so no pairs);
    ``take_store(acc_out, out, sums_address, n, t0, t1, r0, r1, m_row, q)`` reads every sum of the thread into
    ``acc_out`` first (plain L2 loads, their latencies overlapping), then stores them as bf16 and zeroes the words
    for the next launch. Outputs past ``t1`` / ``r1`` are left alone."""
    swapped_position = _device(swapped_accumulator_position)

    def element(n, t0, t1, r0, r1, m_row, q, i):
        row_in_tile, token_in_tile = swapped_position(m_row, q, i)
        row, token = r0 + row_in_tile, t0 + token_in_tile
        return token * n + row, np.uint32((token < t1) & (row < r1))

    element = _device(element)

    def add_partial(acc_out, sums_address, n, t0, t1, r0, r1, m_row, q, out_scale):
        for i in range(num_acc):
            word, valid = element(n, t0, t1, r0, r1, m_row, q, i)
            cm.red_add_f32_if(sums_address + word * 4, acc_out[i] * out_scale, valid)

    def take_store(acc_out, out, sums_address, n, t0, t1, r0, r1, m_row, q):
        out_address = np.int64(cm.generic_address(out))
        for i in range(num_acc):
            word, valid = element(n, t0, t1, r0, r1, m_row, q, i)
            acc_out[i] = cm.load_global_cg_f32_if(sums_address + word * 4, valid)
        for i in range(num_acc):
            word, valid = element(n, t0, t1, r0, r1, m_row, q, i)
            cm.store_global_u16_if(out_address + word * 2, f32_to_bf16_bits(acc_out[i]), valid)
            cm.store_global_cg_zero_u32_if(sums_address + word * 4, valid)

    return _device(add_partial), _device(take_store)


def _make_store_tile(num_acc: int, swapped: bool = False):
    """Device function ``store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, out_scale)``: the epilogue
    of the consumer, ``C[token, row] = bf16(acc * out_scale)`` for a thread's ``num_acc`` accumulators
    (copied to ``acc_out``) with paired 4-byte stores where both columns are in range and 4-byte aligned;
    tokens past ``t1`` and rows past ``r1`` are not written. ``swapped``: the accumulator's rows are weight
    rows and its columns tokens, so a thread's two columns are two output rows: one 2-byte store each."""
    swapped_position = _device(swapped_accumulator_position)

    def store_tile_swapped(acc_out, out, n, t0, t1, r0, r1, m_row, q, out_scale):
        out_address = np.int64(cm.generic_address(out))
        for i in range(num_acc):
            row_in_tile, token_in_tile = swapped_position(m_row, q, i)
            row, token = r0 + row_in_tile, t0 + token_in_tile
            cm.store_global_u16_if(out_address + (token * n + row) * 2, f32_to_bf16_bits(acc_out[i] * out_scale),
                                   np.uint32((token < t1) & (row < r1)))

    if swapped:
        return _device(store_tile_swapped)

    def store_tile(acc_out, out, n, t0, t1, r0, r1, m_row, q, out_scale):
        out_address = np.int64(cm.generic_address(out))
        n_pairs_aligned = np.uint32(n % 2 == 0)   # bf16 pairs (token, 2 c) are 4-byte aligned
        for i in range(0, num_acc, 2):
            # wgmma_accumulator_position: row g + 8 ((i >> 1) & 1), columns 8 (i >> 2) + 2 q + (0, 1)
            token = t0 + m_row + 8 * ((i >> 1) & 1)
            row = r0 + 8 * (i >> 2) + 2 * q
            lo_ok = np.uint32((token < t1) & (row < r1))
            hi_ok = np.uint32((token < t1) & (row + 1 < r1))
            pair_ok = lo_ok & hi_ok & n_pairs_aligned
            cm.store_global_u16x2_if(out_address + (token * n + row) * 2,
                                     f32_to_bf16_bits(acc_out[i] * out_scale),
                                     f32_to_bf16_bits(acc_out[i + 1] * out_scale),
                                     pair_ok, lo_ok & ~pair_ok, hi_ok & ~pair_ok)

    return _device(store_tile)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
