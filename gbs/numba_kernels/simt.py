"""The plain SIMT grouped block-scaled matmul: Numba CUDA without inline PTX, every format.

Formats: NVFP4, MXFP4, MXFP8 (E4M3), MXFP8 E5M2, W4A8 (MXFP8 E4M3 tokens x MXFP4 weights) and W4A16
(bf16 tokens x MXFP4 or NVFP4 weights). It reads the operands exactly as the tensor-core kernels do:
packed FP4 / FP8 / bf16 bytes (as 32-bit words along K), scales in the swizzled 128x4 layout (byte
address from the atom formula, token scale rows through ``a_scale_offsets``), and decodes E2M1 / E4M3 /
E5M2 / bf16 / UE8M0 / UE4M3 in the kernel with integer arithmetic (subnormals included; a NaN scale
byte makes its block NaN). Block-scale semantics as on tcgen05: the element products of each
16/32-element block (the weights' blocks) are summed in fp32, then multiplied by the two block scales
(bf16 tokens: 1) and added to the fp32 accumulator. The epilogue multiplies by ``expert_scales[e]``,
rounds to bf16 (round to nearest even on the fp32 bits, NaN stays NaN) and stores the bf16 bits;
stores are masked to the group and N, rows of skipped slots are never written.

Structure: a persistent grid walks the tiles of ``gbs.schedule`` (tile shape from the config's
``ab_swapped`` / ``mma_bn`` / ``cta_group``; a CTA pair per tile, CTA ``r`` writing its weight-row
half as on SM100). Each CTA covers its part of the tile in sub-tiles of at most
``threads x OUTPUTS_PER_THREAD`` outputs; for each ``K_CHUNK`` slice of K the block decodes the sub-tile's
token and weight rows (coalesced 32-bit loads along K) and their scales (once per block) into
shared memory, then every thread accumulates ``OUTPUTS_PER_THREAD`` outputs from there.

The device-capable helpers (``decode_*``, ``scale_byte_offset``, ``bf16_bits_rne``) are plain
integer Python: the host tests call them directly, kernels compile them with
``cuda.jit(device=True)``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32

from gbs import schedule
from gbs.problem import GroupedProblem, require_packed
from gbs.formats import BF16, SF_ATOM_COLS, SF_ATOM_ROWS, UE8M0_BIAS, UE8M0_NAN_BYTE, get_format, scale_byte_offset
from gbs.reference import poison_output

THREADS_PER_BLOCK = 256
# The simulator runs every thread as a Python thread and polls them all at each barrier: a small
# block keeps it fast (the kernel is the same; only the sub-tiles get smaller).
SIMULATOR_THREADS_PER_BLOCK = 32
OUTPUTS_PER_THREAD = 4     # a sub-tile holds threads x OUTPUTS_PER_THREAD outputs
SUB_TILE_MAX_ROWS = 128    # weight rows of a sub-tile (one 128-row weight tile per CTA) ...
SUB_TILE_TOKENS = 8        # ... leaving room for this many tokens; tokens then fill the rest
                           # (<= 160 staged rows: shared memory stays under 48 KiB)
K_CHUNK = 64               # K elements staged per step: 4 NVFP4 / 2 MX blocks, 32 B of FP4 per row
SMEM_ROW_STRIDE = K_CHUNK + 1   # odd stride: threads reading different rows hit different banks
WORD_BITS = 32             # operands are read as 32-bit words along K (8 FP4 or 4 FP8 elements)
WARP_SIZE = 32
MAX_THREADS_PER_BLOCK = 1024
RESIDENT_CTAS_PER_SM = 4   # default persistent grid: a few blocks per SM to hide load latency
SIMULATOR_CTA_PAIRS = 2    # default persistent grid in the simulator (blocks run one at a time)

# 128x4 scale atom: row r sits at lane r % 32 (16 bytes per lane), slice (r % 128) // 32 (4 bytes).

E2M1_UNIT = np.float32(0.25)        # E2M1 magnitudes are multiples of 2^-2 (after the shift below)
E4M3_UNIT = np.float32(2.0 ** -10)  # E4M3: (8 + m) << e times 2^-(bias 7 + 3 mantissa bits)
E5M2_UNIT = np.float32(2.0 ** -17)  # E5M2: (4 + m) << e times 2^-(bias 15 + 2 mantissa bits)
BF16_UNIT_LOG2 = -134               # bf16: (128 + m) times 2^(e - bias 127 - 7 mantissa bits)
NAN32 = np.float32(np.nan)
INF32 = np.float32(np.inf)


# ----------------------------------------------------------------------------------------------
# Device-capable decoders (integer arithmetic, exact)
# ----------------------------------------------------------------------------------------------
def decode_e2m1(code):
    """float32 value of a 4-bit E2M1 code (bit 3 = sign; 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    code = np.int64(code)
    exponent = (code >> 1) & 0x3
    mantissa = code & 0x1
    if exponent == 0:   # subnormal: m * 2^-1
        magnitude = mantissa << 1
    else:               # (1 + m/2) * 2^(e-1)
        magnitude = (2 + mantissa) << exponent
    value = np.float32(magnitude) * E2M1_UNIT
    if code & 0x8:
        return -value
    return value


def decode_e4m3(code):
    """float32 value of an E4M3 ("fn": no Inf, NaN = S.1111.111) byte; also decodes UE4M3."""
    code = np.int64(code)
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return NAN32
    if exponent == 0:   # subnormal: m * 2^-9
        magnitude = mantissa << 1
    else:               # (1 + m/8) * 2^(e-7)
        magnitude = (8 + mantissa) << exponent
    value = np.float32(magnitude) * E4M3_UNIT
    if code & 0x80:
        return -value
    return value


def decode_e5m2(code):
    """float32 value of an E5M2 byte (IEEE-like: exponent 31 is Inf / NaN)."""
    code = np.int64(code)
    exponent = (code >> 2) & 0x1F
    mantissa = code & 0x3
    if exponent == 0x1F:
        if mantissa != 0:
            return NAN32
        value = INF32
    elif exponent == 0:   # subnormal: m * 2^-16
        value = np.float32(mantissa << 1) * E5M2_UNIT
    else:                 # (1 + m/4) * 2^(e-15)
        value = np.float32((4 + mantissa) << exponent) * E5M2_UNIT
    if code & 0x80:
        return -value
    return value


def decode_bf16(code):
    """float32 value of bf16 bits (IEEE: exponent 255 is Inf / NaN)."""
    code = np.int64(code)
    exponent = (code >> 7) & 0xFF
    mantissa = code & 0x7F
    if exponent == 0xFF:
        if mantissa != 0:
            return NAN32
        value = INF32
    elif exponent == 0:   # subnormal: m * 2^-133
        value = np.float32(math.ldexp(np.float32(mantissa), BF16_UNIT_LOG2 + 1))
    else:                 # (1 + m/128) * 2^(e-127)
        value = np.float32(math.ldexp(np.float32(128 + mantissa), int(exponent + BF16_UNIT_LOG2)))
    if code & 0x8000:
        return -value
    return value


def decode_no_scale(code):
    """The block scale of an operand without scales (bf16 tokens): 1."""
    return np.float32(1.0)


def decode_ue8m0(code):
    """float32 value of a UE8M0 scale byte: 2^(b - 127); 0x00 = 2^-127; 0xFF = NaN."""
    code = np.int64(code)
    if code == UE8M0_NAN_BYTE:
        return NAN32
    return np.float32(math.ldexp(np.float32(1.0), int(code - UE8M0_BIAS)))


def bf16_bits_rne(bits):
    """bf16 bits of the float32 with bit pattern ``bits``: round to nearest even; overflow
    rounds to Inf; a NaN stays a (quiet) NaN with its sign."""
    bits = np.int64(bits)
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return (bits >> 16) | 0x0040
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


ELEMENT_DECODERS = {"e2m1": decode_e2m1, "e4m3": decode_e4m3, "e5m2": decode_e5m2, "bf16": decode_bf16}
SCALE_DECODERS = {"ue4m3": decode_e4m3, "ue8m0": decode_ue8m0, "none": decode_no_scale}


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimtKernelSpec:
    """Everything the kernel is specialised on (compile-time constants): operand formats (names
    of ``gbs.formats.FORMATS``), tile shape, threads per block."""

    a_format: str
    b_format: str
    tile_tokens: int
    tile_rows: int
    cta_group: int
    threads: int = THREADS_PER_BLOCK

    @classmethod
    def for_problem(cls, problem: GroupedProblem, config, threads: int = THREADS_PER_BLOCK) -> "SimtKernelSpec":
        shape = schedule.TileShape.from_config(config)
        return cls(problem.a_format.name, problem.b_format.name, shape.tokens, shape.weight_rows,
                   shape.cta_group, threads)

    @property
    def block_size(self) -> int:
        """The weights' block, which scaled tokens share (``check_can_implement``)."""
        return get_format(self.b_format).block_size

    @property
    def sub_tile(self) -> tuple[int, int]:
        """(tokens, weight rows) of the sub-tiles a CTA covers its part of the tile with."""
        sub_outputs = self.threads * OUTPUTS_PER_THREAD
        min_tokens = min(self.tile_tokens, SUB_TILE_TOKENS)
        sub_rows = min(self.tile_rows // self.cta_group, SUB_TILE_MAX_ROWS, sub_outputs // min_tokens)
        sub_tokens = min(self.tile_tokens, sub_outputs // sub_rows)
        return sub_tokens, sub_rows


def _make_stager(format_name: str, threads: int, block_size: int):
    """Device function: decode rows ``[first_row, first_row + num_rows)`` of one operand, K
    elements ``[k0, k0 + num_blocks * block_size)``, into ``values`` and their block scales into
    ``block_scales`` (scale row = operand row + ``scale_row_shift``; 1 for an operand without scales)."""
    fmt = get_format(format_name)
    bits, scaled = fmt.element_bits, fmt.scaled
    per_word = WORD_BITS // bits
    mask = (1 << bits) - 1
    decode_element = cuda.jit(device=True)(ELEMENT_DECODERS[fmt.element])
    decode_scale = cuda.jit(device=True)(SCALE_DECODERS[fmt.scale_dtype])
    sf_offset = cuda.jit(device=True)(scale_byte_offset)

    # ``tid`` comes in as an argument: Numba's simulator swaps the ``cuda`` module of device
    # functions per thread without a lock, and a device function reading ``cuda.threadIdx`` there
    # sometimes saw another thread's index (left shared-memory entries unstaged, seen as NaN).
    @cuda.jit(device=True)
    def stage(words, scales, first_row, num_rows, scale_row_shift, scale_col_groups, k0, num_blocks,
              values, block_scales, tid):
        words_per_row = num_blocks * block_size // per_word
        first_word = k0 // per_word
        # Consecutive threads read consecutive words of a row: coalesced along K.
        for idx in range(tid, num_rows * words_per_row, threads):
            row = idx // words_per_row
            w = idx - row * words_per_row
            word = words[first_row + row, first_word + w]
            for e in range(per_word):
                values[row, w * per_word + e] = decode_element((word >> (e * bits)) & mask)
        first_col = k0 // block_size
        for idx in range(tid, num_rows * num_blocks, threads):
            row = idx // num_blocks
            blk = idx - row * num_blocks
            if scaled:
                offset = sf_offset(first_row + row + scale_row_shift, first_col + blk, scale_col_groups)
                block_scales[row, blk] = decode_scale(scales[offset])
            else:   # bf16 tokens: their scale array is empty
                block_scales[row, blk] = decode_scale(0)

    return stage


def make_kernel_function(spec: SimtKernelSpec):
    """The kernel as a Python function (closure over ``spec``), ready for ``cuda.jit`` or an
    offline compile; built fresh on every call (fresh device functions: see
    ``schedule.device_functions``)."""
    walk = schedule.device_functions()
    locate_tile, cta_output_rows = walk.locate_tile, walk.cta_output_rows
    threads = spec.threads
    block = spec.block_size
    stage_a = _make_stager(spec.a_format, threads, block)
    stage_b = _make_stager(spec.b_format, threads, block)
    to_bf16 = cuda.jit(device=True)(bf16_bits_rne)
    blocks_per_chunk = K_CHUNK // block
    tile_tokens, tile_rows, cta_group = spec.tile_tokens, spec.tile_rows, spec.cta_group
    sub_tokens, sub_rows = spec.sub_tile

    def grouped_matmul_simt_kernel(a_words, b_words, a_scales, b_scales, a_offsets, a_scale_offsets,
                                   expert_ids, expert_scales, out, n, k, num_tiles):
        a_vals = cuda.shared.array((sub_tokens, SMEM_ROW_STRIDE), float32)
        b_vals = cuda.shared.array((sub_rows, SMEM_ROW_STRIDE), float32)
        a_sf = cuda.shared.array((sub_tokens, blocks_per_chunk), float32)
        b_sf = cuda.shared.array((sub_rows, blocks_per_chunk), float32)
        acc = cuda.local.array(OUTPUTS_PER_THREAD, float32)
        result = cuda.local.array(1, float32)
        result_bits = result.view(np.uint32)

        tid = cuda.threadIdx.x
        rank = cuda.blockIdx.x % cta_group
        num_pairs = cuda.gridDim.x // cta_group
        scale_col_groups = (k // block + SF_ATOM_COLS - 1) // SF_ATOM_COLS
        for tile in range(cuda.blockIdx.x // cta_group, num_tiles, num_pairs):
            slot, expert, _, _, token_start, token_end, tile_row_start, tile_row_end = locate_tile(
                tile, a_offsets, expert_ids, n, tile_tokens, tile_rows)
            row_start, row_end = cta_output_rows(tile_row_start, tile_row_end, rank, cta_group, tile_rows)
            group_start = a_offsets[slot]
            # padded scale row of token m = m + a_scale_row_shift (formats.md)
            a_scale_row_shift = SF_ATOM_ROWS * (group_start // SF_ATOM_ROWS + a_scale_offsets[slot]) - group_start
            b_words_e = b_words[expert]
            b_scales_e = b_scales[expert]
            expert_scale = expert_scales[expert]
            for sub_token in range(token_start, token_end, sub_tokens):
                num_tokens = min(sub_tokens, token_end - sub_token)
                for sub_row in range(row_start, row_end, sub_rows):
                    num_rows = min(sub_rows, row_end - sub_row)
                    for j in range(OUTPUTS_PER_THREAD):
                        acc[j] = float32(0.0)
                    for k0 in range(0, k, K_CHUNK):
                        num_blocks = min(K_CHUNK, k - k0) // block
                        stage_a(a_words, a_scales, sub_token, num_tokens, a_scale_row_shift, scale_col_groups,
                                k0, num_blocks, a_vals, a_sf, tid)
                        stage_b(b_words_e, b_scales_e, sub_row, num_rows, 0, scale_col_groups,
                                k0, num_blocks, b_vals, b_sf, tid)
                        cuda.syncthreads()
                        for j in range(OUTPUTS_PER_THREAD):
                            idx = tid + j * threads
                            ti = idx // sub_rows
                            ri = idx - ti * sub_rows
                            if ti < num_tokens and ri < num_rows:
                                total = acc[j]
                                for blk in range(num_blocks):
                                    first = blk * block
                                    partial = float32(0.0)
                                    for e in range(block):   # fp32 sum of the block's products
                                        partial += a_vals[ti, first + e] * b_vals[ri, first + e]
                                    total += partial * a_sf[ti, blk] * b_sf[ri, blk]
                                acc[j] = total
                        cuda.syncthreads()
                    for j in range(OUTPUTS_PER_THREAD):
                        idx = tid + j * threads
                        ti = idx // sub_rows
                        ri = idx - ti * sub_rows
                        if ti < num_tokens and ri < num_rows:
                            result[0] = acc[j] * expert_scale
                            out[sub_token + ti, sub_row + ri] = np.uint16(to_bf16(result_bits[0]))

    return grouped_matmul_simt_kernel


@functools.lru_cache(maxsize=None)
def _launchable_kernel(spec: SimtKernelSpec):
    return cuda.jit(make_kernel_function(spec))


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------
def check_can_implement(problem: GroupedProblem, config) -> schedule.TileConfig:
    """Static checks before any device work; returns the tile knobs. TypeError / ValueError
    saying what is wrong.

    ``config``: a ``gbs.dispatch.KernelConfig`` (its formats must be the problem's) or a
    ``gbs.schedule.TileConfig`` (any legal knobs; the only way to run formats the SM100 dispatch
    has no route for, such as MXFP8 E5M2).
    """
    if not isinstance(problem, GroupedProblem):
        raise TypeError(f"problem must be a GroupedProblem, got {type(problem).__name__}")
    problem.validate()   # the arrays of a frozen problem can still have been swapped or mutated
    require_packed(problem, "the SIMT kernel")
    for fmt in (problem.a_format, problem.b_format):
        if fmt.element not in ELEMENT_DECODERS or fmt.scale_dtype not in SCALE_DECODERS:
            raise ValueError(f"format {fmt.name} ({fmt.element} elements, {fmt.scale_dtype} scales) has no "
                             f"decoder here; elements: {sorted(ELEMENT_DECODERS)}, scales: {sorted(SCALE_DECODERS)}")
    tile_config = schedule.TileConfig.of(config)
    for side in ("a_format", "b_format"):
        want = getattr(problem, side).name
        got = getattr(config, side, want)
        if got != want:
            raise ValueError(f"config was decided for {side}={got!r} but the problem's {side} is {want!r}")
    a, b = problem.a_format, problem.b_format
    if not b.scaled or (a.scaled and a.block_size != b.block_size):
        raise ValueError(f"the weights must be block-scaled and scaled tokens share their block size, got "
                         f"{a.name} ({a.block_size}) x {b.name} ({b.block_size})")
    # The kernel reads 32-bit words along K: K elements must fill whole words (implied by the block
    # sizes of every supported format; checked so that a new format cannot break it silently).
    for fmt in (a, b):
        if problem.k % (WORD_BITS // fmt.element_bits):
            raise ValueError(f"K={problem.k} does not fill whole 32-bit words of {fmt.name} elements")
    return tile_config


def can_implement(problem: GroupedProblem, config) -> tuple[bool, str]:
    """(True, "") if the SIMT kernel runs ``problem`` with ``config``, else (False, the reason)."""
    try:
        check_can_implement(problem, config)
    except (TypeError, ValueError) as err:
        return False, str(err)
    return True, ""


def check_out(problem: GroupedProblem, out) -> np.ndarray:
    shape = (problem.total_tokens, problem.n)
    if out is None:
        return poison_output(*shape)
    if not isinstance(out, np.ndarray) or out.dtype != BF16:
        raise TypeError(f"out must be a bfloat16 numpy array, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != shape:
        raise ValueError(f"out must have shape {shape} (total_tokens, N), got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    return out


def _simulated() -> bool:
    from numba import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


def default_threads_per_block() -> int:
    return SIMULATOR_THREADS_PER_BLOCK if _simulated() else THREADS_PER_BLOCK


def _check_threads(threads) -> int:
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads_per_block must be an int, got {threads!r}")
    if threads < WARP_SIZE or threads > MAX_THREADS_PER_BLOCK or threads % WARP_SIZE:
        raise ValueError(f"threads_per_block must be a multiple of {WARP_SIZE} in "
                         f"[{WARP_SIZE}, {MAX_THREADS_PER_BLOCK}], got {threads}")
    return int(threads)


def default_num_ctas(num_tiles: int, cta_group: int) -> int:
    """Persistent grid size: a few resident blocks per SM (a fixed small grid in the simulator),
    never more pairs than tiles."""
    if _simulated():
        pairs = SIMULATOR_CTA_PAIRS
    else:
        sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT
        pairs = max(1, sm_count * RESIDENT_CTAS_PER_SM // cta_group)
    return max(1, min(num_tiles, pairs)) * cta_group


class PreparedSimt:
    """The SIMT kernel bound to device-resident inputs: ``launch()`` queues one launch on the
    default stream with no host copies or syncs (what a benchmark times); ``device_out`` holds
    the bf16 bits of ``C`` as uint16 (``None`` when there are no tiles: nothing to launch)."""

    def __init__(self, kernel, grid, threads, device_args, device_out, host_out, n, k, num_tiles):
        self._kernel, self._grid, self._threads = kernel, grid, threads
        self._args = (*device_args, device_out, n, k, num_tiles)
        self.device_out = device_out
        self.host_out = host_out   # the bf16 array ``copy_out`` fills (the caller's ``out``)
        self.num_tiles = num_tiles

    def launch(self) -> None:
        if self.num_tiles:
            self._kernel[self._grid, self._threads](*self._args)

    __call__ = launch

    def copy_out(self) -> np.ndarray:
        """Copy ``C`` back into ``host_out`` (rows the kernel did not write keep their contents)."""
        if self.num_tiles:
            self.device_out.copy_to_host(self.host_out.view(np.uint16))
        return self.host_out


def prepare(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
            num_ctas: int | None = None, threads_per_block: int | None = None) -> PreparedSimt:
    """Check, compile and copy the inputs (and ``out``, default poisoned) to the device once."""
    from numba import cuda

    tile_config = check_can_implement(problem, config)
    shape = tile_config.tile_shape
    out = check_out(problem, out)
    threads = _check_threads(default_threads_per_block() if threads_per_block is None else threads_per_block)
    if num_ctas is not None:
        num_ctas = schedule.check_num_ctas(num_ctas, shape.cta_group)
    num_tiles = schedule.total_tiles(problem.a_offsets, problem.expert_ids, problem.n, shape)
    if num_tiles == 0:   # every slot skipped or empty: no device work at all
        return PreparedSimt(None, 0, threads, (), None, out, problem.n, problem.k, 0)
    if num_ctas is None:
        num_ctas = default_num_ctas(num_tiles, shape.cta_group)
    kernel = _launchable_kernel(SimtKernelSpec.for_problem(problem, tile_config, threads))

    def as_words(x):   # the kernel reads operands as 32-bit words along K
        return np.ascontiguousarray(x).view(np.uint8).view(np.uint32)

    args = [
        as_words(problem.a),
        as_words(problem.b),
        np.ascontiguousarray(problem.a_scales).reshape(-1),
        np.ascontiguousarray(problem.b_scales).reshape(problem.num_experts, -1),
        problem.a_offsets.astype(np.int64),
        problem.a_scale_offsets.astype(np.int64),
        np.ascontiguousarray(problem.expert_ids),
        np.ascontiguousarray(problem.expert_scales),
    ]
    device_args = [cuda.to_device(x) for x in args]
    device_out = cuda.to_device(out.view(np.uint16))
    return PreparedSimt(kernel, num_ctas, threads, device_args, device_out, out, problem.n, problem.k, num_tiles)


def grouped_matmul_simt(problem: GroupedProblem, config, out: np.ndarray | None = None, *,
                        num_ctas: int | None = None, threads_per_block: int | None = None) -> np.ndarray:
    """Run the SIMT kernel; returns ``C`` (bf16, (total_tokens, N)).

    ``config``: see ``check_can_implement``. ``out``: if given, written in place and returned;
    rows of skipped slots keep its contents (default: a fresh poisoned array). ``num_ctas``: CTAs
    of the persistent grid, a multiple of ``cta_group`` (default ``default_num_ctas``).
    ``threads_per_block``: a multiple of 32 (default 256; 32 in the simulator).
    """
    prepared = prepare(problem, config, out, num_ctas=num_ctas, threads_per_block=threads_per_block)
    prepared.launch()
    return prepared.copy_out()
