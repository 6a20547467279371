"""FP4 operands into ``gbs.formats.E2M1H200Order`` on the GPU: for tokens that arrive in ``pack_fp4`` order
with UE4M3 / UE8M0 scale bytes (from a quantizer that cannot write the H200 order itself) before a launch
with ``a_layout="e2m1_h200"``, and for weights that already live on the GPU (a one-time step:
``to_e2m1_h200_fused`` writes ``b_layout="e2m1_h200_fused"``, the one ``gbs.plan.h200_weight_layout`` recommends;
``to_e2m1_h200_tiled`` the tiled order, ``to_e2m1_h200`` the row-major one).

    from gbs.numba_kernels import relayout
    a_h200 = relayout.to_e2m1_h200(a)      # a: (tokens, K/2) FP4 bytes on the GPU, any __cuda_array_interface__
    a_scales_h200 = relayout.ue4m3_scales_to_h200(a_scales)   # NVFP4 only: MX scales need nothing
    problem = gbs.device_problem(a_h200, b, a_scales_h200, ..., fmt="nvfp4", a_layout="e2m1_h200")
    b_scales_h200 = relayout.ue4m3_scales_to_h200(b_scales)   # NVFP4 weights, once
    b_h200 = relayout.to_e2m1_h200_fused(b, b_scales_h200)    # (experts, N, K/2 + K/block) weights and scales
    problem = gbs.device_problem(..., b_h200, ..., b_scales_h200, ..., b_layout="e2m1_h200_fused")

``ue4m3_scales_to_h200`` maps each UE4M3 scale byte to its ``gbs.formats.UE4M3H200Scales`` code (one thread per
4-byte word, a 256-byte table), bit-identical to ``UE4M3H200Scales.encode`` on every UE4M3 byte; a byte with
the sign bit set (not a UE4M3 value: the host encoder rejects it) becomes the NaN code, so its block's
outputs are NaN rather than wrong numbers.

One thread per 4-byte word (grid-stride loop): the word's image is the OR of its four bytes' entries in the
order's byte tables (``E2M1H200Order.byte_tables``, 4 KiB, read through L1), bit-identical to
``E2M1H200Order.swizzle``. It reads and writes each byte once; for 8192 tokens x K 7168 it costs about what FP4
tokens in this order save the 256-token prefill kernel, so in large prefill it about pays for itself and in small
prefill it does not (evidence: relay-cost, token-order). A quantizer that writes the order directly costs nothing
extra: this kernel is for the ones that do not. Bit-identical to the host swizzle on the H200 (evidence:
relayout-on-gpu). ``to_e2m1_h200_tiled`` writes each word's image where ``E2M1H200TiledOrder`` puts it (a warp's 32
words are one 128-byte box row, so its writes stay coalesced); bit-identical to the host order on the H200.
``to_e2m1_h200_fused`` writes the same words one chunk pitch apart (``E2M1H200FusedOrder``: each box
followed by its scale atoms) and a second kernel copies the atoms behind their boxes.

Constraints (checked before any device work): a C-contiguous device array of 1-byte elements whose last
axis is a multiple of 4 bytes (K a multiple of 8); ``out``, if given, the same; tiled or fused weights
(..., N, K/2) of any N and K (stored padded to whole boxes), fused ones with their 128x4 atoms. Runs in Numba's CUDA
simulator too (``NUMBA_ENABLE_CUDASIM=1``).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from gbs.formats import FORMATS, SF_ATOM_BYTES
from gbs.layouts import E2M1H200FusedOrder, E2M1H200Order, E2M1H200TiledOrder, UE4M3H200Scales
from gbs.numba_kernels.launch import device_view

THREADS = 256
BOX_ROWS = E2M1H200TiledOrder.BOX_ROWS
BOX_WORDS = E2M1H200TiledOrder.BOX_BYTES // 4   # words of one box row
ATOM_WORDS = SF_ATOM_BYTES // 4
FP4_BLOCK_SIZES = sorted({fmt.block_size for fmt in FORMATS.values() if fmt.packed})   # NVFP4 16, MXFP4 32
MAX_BLOCKS = 132 * 8   # a few waves of the H200's SMs; the grid-stride loop takes the rest


@cuda.jit(device=True)
def word_image(tables, w):
    """The image of word ``w`` under the byte ``tables``: the OR of its four bytes' entries."""
    return tables[0, w & 0xFF] | tables[1, (w >> 8) & 0xFF] | tables[2, (w >> 16) & 0xFF] | tables[3, w >> 24]


def relay_words(words, tables, out_words):
    """Kernel: ``out_words[i]`` = the image of ``words[i]`` under the byte ``tables``."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, words.size, stride):
        out_words[i] = word_image(tables, words[i])


def relay_tiled_words(words, tables, rows, row_words, chunk_words, out_words):
    """Kernel: the image of ``words[i]`` (word ``i`` of row-major (matrices x ``rows``, ``row_words``) weights)
    under the byte ``tables``, at its place in ``E2M1H200TiledOrder`` in ``out_words``, boxes ``chunk_words``
    apart (a box's words, or more: ``E2M1H200FusedOrder``'s chunks); rows and K padded to whole boxes."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    k_boxes = (row_words + BOX_WORDS - 1) // BOX_WORDS
    slab = ((rows + BOX_ROWS - 1) // BOX_ROWS) * k_boxes * chunk_words
    for i in range(start, words.size, stride):
        row, col = i // row_words, i % row_words
        r = row % rows
        box = (r // BOX_ROWS) * k_boxes + col // BOX_WORDS
        out_words[(row // rows) * slab + box * chunk_words + (r % BOX_ROWS) * BOX_WORDS + col % BOX_WORDS] = \
            word_image(tables, words[i])


def place_scale_words(scale_words, atoms_per_band, atoms_per_chunk, k_boxes, chunk_words, out_words):
    """Kernel: word ``i`` of 128x4 scale atoms (bands of ``atoms_per_band`` atoms of ``ATOM_WORDS``; the last K box's
    chunk may hold fewer) behind the box of its chunk (``atoms_per_chunk`` each, ``k_boxes`` per band) in
    ``E2M1H200FusedOrder`` words ``out_words``."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    box_words = BOX_ROWS * BOX_WORDS
    for i in range(start, scale_words.size, stride):
        atom, word = i // ATOM_WORDS, i % ATOM_WORDS
        band, column = atom // atoms_per_band, atom % atoms_per_band
        chunk = band * k_boxes + column // atoms_per_chunk   # chunks run (band, K box)
        out_words[chunk * chunk_words + box_words + (column % atoms_per_chunk) * ATOM_WORDS + word] = scale_words[i]


def zero_words(out_words):
    """Kernel: every word of ``out_words`` zero (the pad of weights stored padded to whole boxes)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, out_words.size, stride):
        out_words[i] = 0


def map_bytes(words, table, out_words):
    """Kernel: each byte of ``words[i]`` replaced by its ``table`` entry, into ``out_words[i]``."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, words.size, stride):
        w = words[i]
        out_words[i] = (table[w & 0xFF] | (table[(w >> 8) & 0xFF] << 8) | (table[(w >> 16) & 0xFF] << 16)
                        | (table[w >> 24] << 24))


def ue4m3_code_table() -> np.ndarray:
    """(256,) uint32: the ``UE4M3H200Scales`` code of each byte; sign-bit bytes -> the NaN code."""
    table = np.full(256, UE4M3H200Scales.NAN_BYTE, np.uint32)
    table[:128] = UE4M3H200Scales.encode(np.arange(128, dtype=np.uint8))
    return table


@functools.cache
def _kernel():
    return cuda.jit(relay_words)


@functools.cache
def _tiled_kernel():
    return cuda.jit(relay_tiled_words)


@functools.cache
def _scale_kernel():
    return cuda.jit(place_scale_words)


@functools.cache
def _zero_kernel():
    return cuda.jit(zero_words)


@functools.cache
def _map_kernel():
    return cuda.jit(map_bytes)


@functools.cache
def _device_code_table():
    return cuda.to_device(ue4m3_code_table())


@functools.cache
def _device_tables():
    return cuda.to_device(E2M1H200Order.byte_tables())


def _byte_array(name: str, value):
    """A numba device array of uint8 over ``value`` (no copy), or TypeError / ValueError saying why not."""
    arr = device_view(name, value, "host bytes take GroupedProblem.with_b_layout / with_a_layout "
                                   "(gbs.formats.OPERAND_LAYOUTS' swizzle / encode_scales)")
    if arr.dtype.itemsize != 1:
        raise TypeError(f"{name} must hold bytes (uint8: FP4 pairs or scale bytes), got {arr.dtype}")
    shape = tuple(arr.shape)   # the simulator's shape takes no negative indices
    if not shape or shape[-1] % 4:
        raise ValueError(f"{name}: the last axis ({shape[-1:]}) must be a multiple of 4 bytes (FP4: K a multiple "
                         "of 8)")
    return arr.view(np.uint8)


def _grid_blocks(arr) -> int:
    """Blocks of ``THREADS`` for one thread per 4-byte word of ``arr`` (the grid-stride loop takes the rest)."""
    return min(-(-(arr.size // 4) // THREADS), MAX_BLOCKS)


def _word_launch(name: str, value, out, stream):
    """(source, destination) byte device arrays of one shape and the grid for their words."""
    src = _byte_array(name, value)
    dst = cuda.device_array(src.shape, np.uint8, stream=stream) if out is None else _byte_array("out", out)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"out has shape {tuple(dst.shape)}, {name} has {tuple(src.shape)}")
    return src, dst, _grid_blocks(src)


def to_e2m1_h200(a, out=None, *, stream=0):
    """``a``'s FP4 bytes (``pack_fp4`` order) re-laid in ``E2M1H200Order`` on the GPU, enqueued on
    ``stream``: a new numba device array, or ``out`` (a device array of the same shape) filled and
    returned as a numba view of it. ``a`` is not modified."""
    src, dst, blocks = _word_launch("a", a, out, stream)
    if blocks:
        _kernel()[blocks, THREADS, stream](src.reshape(src.size).view(np.uint32), _device_tables(),
                                           dst.reshape(dst.size).view(np.uint32))
    return dst


def to_e2m1_h200_tiled(b, out=None, *, stream=0):
    """FP4 weight bytes ``b`` (``pack_fp4`` order, (..., N, K/2)) in ``E2M1H200TiledOrder`` on the GPU, enqueued on
    ``stream``: a new numba device array of ``E2M1H200TiledOrder.padded_shape`` (N and K/2 padded to multiples of
    128 with zero bytes), or ``out`` of that shape filled and returned as a numba view of it. ``b`` is not
    modified. NVFP4's weight scales take ``ue4m3_scales_to_h200`` too."""
    src = _byte_array("b", b)
    shape = tuple(src.shape)   # the simulator's shape takes no negative indices
    if len(shape) < 2:
        raise ValueError(f"b must be (..., N, K/2) weight bytes, got shape {shape}")
    dst = _padded_out(out, E2M1H200TiledOrder.padded_shape(shape), shape, stream)
    _launch_tiled(src, dst, BOX_ROWS * BOX_WORDS, stream)
    return dst


def _padded_out(out, stored_shape, shape, stream):
    """The destination of weights ``shape`` stored as ``stored_shape``: ``out`` (checked) or a new array; zeroed
    first where the stored shape holds a pad (the kernels write only the weights' own words)."""
    dst = cuda.device_array(stored_shape, np.uint8, stream=stream) if out is None else _byte_array("out", out)
    if tuple(dst.shape) != tuple(stored_shape):
        raise ValueError(f"out has shape {tuple(dst.shape)}, weights {shape} are stored as {tuple(stored_shape)}")
    if E2M1H200TiledOrder.padded_shape(shape) != shape:
        words = dst.reshape(dst.size).view(np.uint32)
        _zero_kernel()[_grid_blocks(dst), THREADS, stream](words)
    return dst


def _launch_tiled(src, dst, chunk_words, stream):
    shape = tuple(src.shape)
    blocks = _grid_blocks(src)
    if blocks:
        _tiled_kernel()[blocks, THREADS, stream](src.reshape(src.size).view(np.uint32), _device_tables(),
                                                 np.int64(shape[-2]), np.int64(shape[-1] // 4), np.int64(chunk_words),
                                                 dst.reshape(dst.size).view(np.uint32))


def to_e2m1_h200_fused(b, b_scales, out=None, *, stream=0):
    """FP4 weight bytes ``b`` (``pack_fp4`` order, (..., N, K/2)) and their 128x4 scale atoms ``b_scales``
    ((..., ceil(N/128), ceil(K/block/4), 32, 4, 4), in the H200 encoding: NVFP4's through ``ue4m3_scales_to_h200``
    first, UE8M0 as they are) in ``E2M1H200FusedOrder`` on the GPU, enqueued on ``stream``: a new numba device
    array of ``gbs.layouts.stored_shape`` (..., N_pad, K_pad/2 + K_pad/block: N and K padded to whole chunks, the
    pad zero), or ``out`` of that shape filled and returned as a numba view of it. Neither input is modified;
    pass ``b_scales`` as the problem's too."""
    src = _byte_array("b", b)
    scales = _byte_array("b_scales", b_scales)
    shape, scale_shape = tuple(src.shape), tuple(scales.shape)
    if len(shape) < 2:
        raise ValueError(f"b must be (..., N, K/2) weight bytes, got shape {shape}")
    *lead, n, kb = shape
    k = 2 * kb
    atoms_per_band = scale_shape[len(lead) + 1] if len(scale_shape) == len(shape) + 3 else 0
    # the block size the atoms' columns imply (both for K <= 64: refused, no FP4 MoE weight is that short)
    blocks = [size for size in FP4_BLOCK_SIZES if k % size == 0 and -(-(k // size) // 4) == atoms_per_band]
    want = (*lead, -(-n // BOX_ROWS), atoms_per_band, 32, 4, 4)
    if scale_shape != want or len(blocks) != 1:   # before any launch: nothing is written
        raise ValueError(f"b_scales of shape {scale_shape} are not the 128x4 atoms of 16- or 32-element blocks of "
                         f"weights {shape} (or K is too short to tell which)")
    block = blocks[0]
    *_, n_pad, kb_pad = E2M1H200TiledOrder.padded_shape(shape)
    dst = _padded_out(out, (*lead, n_pad, E2M1H200FusedOrder.stored_row_bytes(k, block)), shape, stream)
    chunk_scale_bytes = E2M1H200FusedOrder.chunk_scale_bytes(block)
    chunk_words = (E2M1H200FusedOrder.CHUNK_BOX_BYTES + chunk_scale_bytes) // 4
    _launch_tiled(src, dst, chunk_words, stream)
    scale_blocks = _grid_blocks(scales)
    if scale_blocks:
        _scale_kernel()[scale_blocks, THREADS, stream](scales.reshape(scales.size).view(np.uint32),
                                                       np.int64(atoms_per_band),
                                                       np.int64(chunk_scale_bytes // SF_ATOM_BYTES),
                                                       np.int64(kb_pad // E2M1H200TiledOrder.BOX_BYTES),
                                                       np.int64(chunk_words), dst.reshape(dst.size).view(np.uint32))
    return dst


def ue4m3_scales_to_h200(scales, out=None, *, stream=0):
    """UE4M3 scale bytes (any C-contiguous shape whose last axis is a multiple of 4, e.g. the 128x4 atoms of
    ``a_scales``) as ``UE4M3H200Scales`` codes on the GPU, enqueued on ``stream``: a new numba device array
    or ``out`` (as ``to_e2m1_h200``). ``scales`` is not modified."""
    src, dst, blocks = _word_launch("scales", scales, out, stream)
    if blocks:
        _map_kernel()[blocks, THREADS, stream](src.reshape(src.size).view(np.uint32), _device_code_table(),
                                               dst.reshape(dst.size).view(np.uint32))
    return dst
