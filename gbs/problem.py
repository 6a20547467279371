"""The grouped 1D-1D block-scaled problem: the tensors one MoE grouped matmul reads.

For each group slot ``g < num_active_experts`` with ``e = expert_ids[g] >= 0``, rows
``m in [a_offsets[g], a_offsets[g+1])`` of the output get
``C[m, n] = expert_scales[e] * sum_k deq(A)[m, k] * deq(B[e])[n, k]`` (fp32 accumulate, bf16 out).
Slots with ``expert_ids[g] == -1`` are skipped (their rows are not written) and slots with no
tokens launch no work. ``a`` holds the experts' tokens concatenated without padding; its scales
are padded per group to 128-row bands (``a_scale_offsets``), so a 128-row scale atom never mixes
two groups. W4A16's bf16 tokens have no scales: ``a_scales`` has no columns. See
``../shared/spec/formats.md``.

``build_problem`` makes one from float32 activations and weights; ``random_problem`` generates
realistic ones (top-k routing, ragged loads, empty groups, ``-1`` slots) from a seed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .formats import (BlockFormat, BlockScaled, ceil_div, gather_group_scales, get_format, group_scale_offsets,
                      pad_group_scales, quantize, swizzle_scales, unswizzle_scales)
from .layouts import (LAYOUT_E4M3_FOLDED, LAYOUT_PACKED, OPERAND_LAYOUTS, E2M1H200FusedOrder, E4M3FoldedScales,
                      UE4M3H200Scales, fused_scales, stored_shape, tiled_weights, weight_bytes_layout, word_order)

# Operand formats of a grouped matmul, by the name users pass around. W4A8 = MXFP8 activations x
# MXFP4 weights (the tcgen05 mxf8f6f4 kind takes the mix). W4A16 = plain bf16 activations (no block
# scales) x MXFP4 or NVFP4 weights: how Hopper serving runs FP4 MoE checkpoints (no tcgen05 kind).
PROBLEM_FORMATS: dict[str, tuple[str, str]] = {
    "nvfp4": ("nvfp4", "nvfp4"),
    "mxfp4": ("mxfp4", "mxfp4"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "mxfp8_e5m2": ("mxfp8_e5m2", "mxfp8_e5m2"),
    "w4a8": ("mxfp8", "mxfp4"),
    "w4a16": ("bf16", "mxfp4"),
    "w4a16_nvfp4": ("bf16", "nvfp4"),
}

ROUTINGS = ("uniform", "ragged", "topk")


def resolve_formats(fmt: str) -> tuple[BlockFormat, BlockFormat]:
    """(A format, B format) of a problem format name in ``PROBLEM_FORMATS``."""
    if fmt not in PROBLEM_FORMATS:
        raise ValueError(f"unknown problem format {fmt!r}; expected one of {sorted(PROBLEM_FORMATS)}")
    a_name, b_name = PROBLEM_FORMATS[fmt]
    return get_format(a_name), get_format(b_name)


def problem_format_name(a_format: BlockFormat, b_format: BlockFormat) -> str:
    for name, pair in PROBLEM_FORMATS.items():
        if pair == (a_format.name, b_format.name):
            return name
    raise ValueError(f"unsupported operand pair A={a_format.name}, B={b_format.name}; "
                     f"supported: {sorted(PROBLEM_FORMATS.values())}")


class ProblemShape:
    """What every kind of grouped problem (host ``GroupedProblem``, ``launch.DeviceProblem``,
    ``interop.DeviceGroupedProblem``) derives the same way from its ``a_format``, ``b_format``,
    ``a`` and ``b``."""

    @property
    def format_name(self) -> str:
        return problem_format_name(self.a_format, self.b_format)

    @property
    def num_experts(self) -> int:
        return self.b.shape[0]

    @property
    def total_tokens(self) -> int:
        return self.a.shape[0]


def is_int(value) -> bool:
    """An integer that is not a bool (numpy integers too)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _expect_array(name: str, arr, dtype, shape) -> None:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {arr.dtype}")
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {arr.shape}")


def check_k_blocks(k: int, *formats: BlockFormat) -> None:
    """ValueError unless K is a whole number of blocks of every block-scaled format among ``formats``."""
    for fmt in formats:
        if fmt.scaled and k % fmt.block_size:
            raise ValueError(f"K = {k} is not a multiple of the {fmt.name} block size {fmt.block_size}")


def operand_shape(fmt: BlockFormat, rows: tuple[int, ...], k: int) -> tuple[int, ...]:
    """Shape of an operand's element array: FP4 packs two elements per byte along K; FP8 and bf16 hold K."""
    return (*rows, fmt.row_bytes(k) if fmt.packed else k)


@dataclass(frozen=True)
class GroupedProblem(ProblemShape):
    """All inputs of one grouped 1D-1D block-scaled matmul (validated on construction)."""

    a_format: BlockFormat
    b_format: BlockFormat
    a: np.ndarray                 # (total_tokens, K/2) uint8 (FP4) or (total_tokens, K) e4m3/e5m2/bf16
    b: np.ndarray                 # (num_experts, N, K/2) uint8 or (num_experts, N, K) e4m3/e5m2
    a_scales: np.ndarray          # (sum_g ceil(n_g/128), ceil(Ca/4), 32, 4, 4) uint8; Ca = 0 for bf16 tokens
    b_scales: np.ndarray          # (num_experts, ceil(N/128), ceil(Cb/4), 32, 4, 4) uint8
    a_offsets: np.ndarray         # uint32[num_active_experts + 1]
    a_scale_offsets: np.ndarray   # uint32[num_active_experts]
    expert_ids: np.ndarray        # int32[num_active_experts], -1 = skip the slot
    expert_scales: np.ndarray     # float32[num_experts]
    num_active_experts: int
    estimated_total_m: int
    n: int
    k: int
    # the bytes of b and of a (and of their UE4M3 scales): names of gbs.formats.OPERAND_LAYOUTS. Tags, not checked
    # against the bytes: change them only with ``with_b_layout`` / ``with_a_layout`` (``dataclasses.replace`` of an
    # array alone keeps its tag)
    b_layout: str = LAYOUT_PACKED
    a_layout: str = LAYOUT_PACKED

    def __post_init__(self):
        self.validate()

    def with_b_layout(self, b_layout: str) -> "GroupedProblem":
        """The same problem with ``b`` re-laid as ``b_layout`` (``gbs.formats.OPERAND_LAYOUTS``: ``"packed"``, or
        ``"e2m1_h200"`` for FP4 weights, which the H200 kernels decode in fewer instructions; NVFP4's UE4M3
        ``b_scales`` are re-encoded with them, ``gbs.formats.UE4M3H200Scales``; ``"e2m1_h200_tiled"`` also stores
        them box by box, ``"e2m1_h200_fused"`` each box with its scales, ``gbs.formats.E2M1H200FusedOrder``).
        One-time weight preparation: returns a new problem (``b`` and ``b_scales`` copied), the result of the
        matmul is the same."""
        return self._with_layout("b", b_layout)

    def with_a_layout(self, a_layout: str) -> "GroupedProblem":
        """The same problem with the tokens ``a`` in ``a_layout`` (as ``with_b_layout``; ``"e2m1_h200"`` for
        FP4 tokens). The tokens change every call: in a model, the kernel that quantizes them writes this
        order (a bit permutation inside each 4-byte word, as cheap to write as ``pack_fp4``'s); this
        host re-layout is for tests, benchmarks and notebooks."""
        return self._with_layout("a", a_layout)

    def _with_layout(self, operand: str, layout: str) -> "GroupedProblem":
        fmt = getattr(self, f"{operand}_format")
        check_layout(layout, fmt, operand)
        raw, old = getattr(self, operand), getattr(self, f"{operand}_layout")
        raw_scales = getattr(self, f"{operand}_scales")
        scales = _relaid_scales(raw_scales, fmt, old, layout)
        rows = (raw.shape[0],) if operand == "a" else (raw.shape[0], self.n)
        logical = (*rows, fmt.row_bytes(self.k))   # tiled weights store it padded
        elements, elements_layout = _unfused(raw, fmt, old, self.k)
        relaid = _relaid(elements, elements_layout, weight_bytes_layout(layout), logical)
        if fused_scales(layout):
            relaid = E2M1H200FusedOrder.fuse(relaid, scales, fmt.block_size)
        return dataclasses.replace(self, **{operand: relaid if relaid is not raw else raw.copy(),
                                            f"{operand}_scales": scales if scales is not raw_scales else scales.copy(),
                                            f"{operand}_layout": layout})

    # -- derived (format_name, num_experts, total_tokens: ProblemShape) ---------------------------
    @property
    def group_sizes(self) -> np.ndarray:
        return np.diff(self.a_offsets.astype(np.int64))

    def active_slots(self) -> list[int]:
        """Slots that produce output: expert id >= 0 and at least one token."""
        sizes = self.group_sizes
        return [g for g in range(self.num_active_experts) if self.expert_ids[g] >= 0 and sizes[g] > 0]

    def written_rows(self) -> np.ndarray:
        """Boolean mask of the output rows the grouped matmul writes (rows of ``-1`` slots are not)."""
        mask = np.zeros(self.total_tokens, bool)
        for g in self.active_slots():
            mask[self.a_offsets[g]:self.a_offsets[g + 1]] = True
        return mask

    def a_operand(self) -> BlockScaled:
        """A as a ``BlockScaled`` with linear (unpadded) scales, for dequantization (in ``pack_fp4`` order
        whatever ``a_layout``)."""
        cols = self.a_format.scale_cols(self.k)
        scales = gather_group_scales(self.a_scales, self.a_offsets, self.a_scale_offsets, cols)
        scales = _relaid_scales(scales, self.a_format, self.a_layout, LAYOUT_PACKED)
        return BlockScaled(_relaid(self.a, self.a_layout, LAYOUT_PACKED, self.a.shape), scales, self.a_format)

    def b_operand(self, expert: int) -> BlockScaled:
        """B[expert] as a ``BlockScaled`` with linear scales (in ``pack_fp4`` order whatever ``b_layout``)."""
        scales = unswizzle_scales(self.b_scales[expert], self.n, self.b_format.scale_cols(self.k))
        scales = _relaid_scales(scales, self.b_format, self.b_layout, LAYOUT_PACKED)
        weights, weights_layout = _unfused(self.b[expert], self.b_format, self.b_layout, self.k)
        logical = (self.n, self.b_format.row_bytes(self.k))
        return BlockScaled(_relaid(weights, weights_layout, LAYOUT_PACKED, logical), scales, self.b_format)

    def nbytes(self) -> dict[str, int]:
        """Bytes each tensor occupies (the whole B, not only the active experts)."""
        return {f.name: getattr(self, f.name).nbytes for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raise ``TypeError`` / ``ValueError`` saying what is wrong."""
        for name in ("a_format", "b_format"):
            if not isinstance(getattr(self, name), BlockFormat):
                raise TypeError(f"{name} must be a BlockFormat (use gbs.formats.get_format)")
        problem_format_name(self.a_format, self.b_format)
        for name in ("num_active_experts", "estimated_total_m", "n", "k"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an integer, got {getattr(self, name)!r}")
        n, k, g = self.n, self.k, self.num_active_experts
        _expect(n > 0 and k > 0, f"N and K must be positive, got N={n}, K={k}")
        _expect(g >= 1, f"num_active_experts must be >= 1, got {g}")
        _expect(self.estimated_total_m >= 0, f"estimated_total_m must be >= 0, got {self.estimated_total_m}")
        check_k_blocks(k, self.a_format, self.b_format)
        check_layout(self.a_layout, self.a_format, "a")

        if not isinstance(self.b, np.ndarray) or self.b.ndim != 3:
            raise ValueError(f"b must be a 3-D (num_experts, N, K bytes) array, got "
                             f"{getattr(self.b, 'shape', type(self.b).__name__)}")
        check_layout(self.b_layout, self.b_format, "b", self.b.shape)
        num_experts = self.b.shape[0]
        _expect(num_experts >= 1, "b must hold at least one expert")
        if not isinstance(self.a, np.ndarray) or self.a.ndim != 2:
            raise ValueError(f"a must be a 2-D (total_tokens, K bytes) array, got "
                             f"{getattr(self.a, 'shape', type(self.a).__name__)}")
        total = self.a.shape[0]
        a_dtype = np.uint8 if self.a_format.packed else self.a_format.element_dtype
        b_dtype = np.uint8 if self.b_format.packed else self.b_format.element_dtype
        _expect_array("a", self.a, a_dtype, operand_shape(self.a_format, (total,), k))
        _expect_array("b", self.b, b_dtype, stored_shape(self.b_layout, self.b_format, (num_experts, n), k))

        _expect_array("a_offsets", self.a_offsets, np.uint32, (g + 1,))
        offsets = self.a_offsets.astype(np.int64)
        _expect(offsets[0] == 0, f"a_offsets[0] must be 0, got {offsets[0]}")
        steps = np.diff(offsets)
        if np.any(steps < 0):
            bad = int(np.argmax(steps < 0))
            raise ValueError(f"a_offsets must be non-decreasing: a_offsets[{bad + 1}] = {offsets[bad + 1]} "
                             f"< a_offsets[{bad}] = {offsets[bad]}")
        _expect(offsets[-1] == total, f"a_offsets[-1] = {offsets[-1]} must equal the token count of a ({total})")
        _expect_array("a_scale_offsets", self.a_scale_offsets, np.uint32, (g,))
        want = group_scale_offsets(self.a_offsets)
        if not np.array_equal(self.a_scale_offsets, want):
            bad = int(np.argmax(self.a_scale_offsets != want))
            raise ValueError(f"a_scale_offsets[{bad}] = {self.a_scale_offsets[bad]}, expected {want[bad]} "
                             "(sum_{j<g} ceil(n_j/128) - a_offsets[g] // 128)")
        _expect_array("expert_ids", self.expert_ids, np.int32, (g,))
        out_of_range = (self.expert_ids < -1) | (self.expert_ids >= num_experts)
        if np.any(out_of_range):
            bad = int(np.argmax(out_of_range))
            raise ValueError(f"expert_ids[{bad}] = {self.expert_ids[bad]} is out of range "
                             f"[-1, {num_experts}) (-1 skips the slot)")
        _expect_array("expert_scales", self.expert_scales, np.float32, (num_experts,))
        _expect(bool(np.all(np.isfinite(self.expert_scales))), "expert_scales must be finite")

        a_cols, b_cols = self.a_format.scale_cols(k), self.b_format.scale_cols(k)
        bands = int(np.sum(-(-steps // 128)))
        _expect_array("a_scales", self.a_scales, np.uint8, (bands, ceil_div(a_cols, 4), 32, 4, 4))
        _expect_array("b_scales", self.b_scales, np.uint8,
                      (num_experts, ceil_div(n, 128), ceil_div(b_cols, 4), 32, 4, 4))
        for name, fmt, layout, cols in (("a_scales", self.a_format, self.a_layout, a_cols),
                                        ("b_scales", self.b_format, self.b_layout, b_cols)):
            _check_padding_scales(name, getattr(self, name), fmt, layout, cols)
        if self.a_layout == LAYOUT_E4M3_FOLDED:
            E4M3FoldedScales.check_token_scales(gather_group_scales(self.a_scales, self.a_offsets, self.a_scale_offsets,
                                                                    a_cols))
        if self.b_layout == LAYOUT_E4M3_FOLDED:
            E4M3FoldedScales.check_weight_scales(unswizzle_scales(self.b_scales)[:, :n, :b_cols])
        if fused_scales(self.b_layout):
            fused_copy = E2M1H200FusedOrder.scale_atoms(self.b, self.b_format.block_size, k)
            if not np.array_equal(fused_copy, self.b_scales):
                bad = np.unravel_index(int(np.argmax(fused_copy != self.b_scales)), fused_copy.shape)
                raise ValueError(f"b ({self.b_layout!r}) holds a copy of the weights' scales that differs from "
                                 f"b_scales at atom index {tuple(int(i) for i in bad)}: build both with "
                                 "with_b_layout (or E2M1H200FusedOrder.fuse)")


OPERAND_ROLES = {"a": "tokens", "b": "weights"}


def _check_padding_scales(name: str, atoms: np.ndarray, fmt: BlockFormat, layout: str, cols: int) -> None:
    """The atoms' columns past K's last block (a K tail: K not a multiple of 4 blocks) scale the zeros the H200
    kernels read past K: they must not be NaN scales (0 x NaN is NaN). ``swizzle_scales`` writes zeros there."""
    if not fmt.scaled or cols % 4 == 0:
        return
    padding = unswizzle_scales(atoms)[..., cols:]
    if layout != LAYOUT_PACKED and fmt.scale_dtype == "ue4m3":
        nan = padding == UE4M3H200Scales.NAN_BYTE
    else:
        nan = (padding == 0xFF) if fmt.scale_dtype == "ue8m0" else ((padding & 0x7F) == 0x7F)
    if np.any(nan):
        raise ValueError(f"{name}: the 128x4 atoms' padding columns (past K's {cols} scale columns) hold NaN scale "
                         "bytes; they scale the zeros past K, so they must be finite (swizzle_scales writes zeros)")


def check_layout(layout, fmt: BlockFormat, operand: str, shape=None) -> str:
    """``layout`` if it is a layout of ``gbs.formats.OPERAND_LAYOUTS`` that operand ``operand`` (``"a"``:
    tokens, ``"b"``: weights) in ``fmt`` can have (the H200 orders re-lay FP4 only, the tiled one weights
    only) and, given the operand's ``shape``, store (tiles need whole boxes); else ValueError."""
    if not isinstance(layout, str) or layout not in OPERAND_LAYOUTS:
        raise ValueError(f"{operand}_layout must be one of {sorted(OPERAND_LAYOUTS)}, got {layout!r}")
    order = OPERAND_LAYOUTS[layout]
    if order is None:
        return layout
    elements = getattr(order, "ELEMENTS", ("e2m1",))
    if fmt.element not in elements:
        what = "re-lays FP4 (E2M1)" if elements == ("e2m1",) else f"holds {'/'.join(e.upper() for e in elements)}"
        raise ValueError(f"{operand}_layout {layout!r} {what} {OPERAND_ROLES[operand]}; {operand} is {fmt.name}")
    if fmt.scale_dtype not in getattr(order, "SCALE_DTYPES", (fmt.scale_dtype,)):
        raise ValueError(f"{operand}_layout {layout!r} takes {' or '.join(order.SCALE_DTYPES)} block scales "
                         f"(MXFP4); {operand} is {fmt.name} ({fmt.scale_dtype} scales)")
    if OPERAND_ROLES[operand] not in order.ROLES:
        raise ValueError(f"{operand}_layout {layout!r} is for {' or '.join(order.ROLES)}, not "
                         f"{OPERAND_ROLES[operand]}")
    if order.TILED and shape is not None:
        order.check_shape(shape, fmt)
    return layout


def layout_of(problem, operand: str) -> str:
    """The byte layout of ``problem.a`` / ``problem.b`` (``"packed"`` for objects without the field, e.g.
    the ``SimpleNamespace`` views ``gbs.lab.sweep`` and ``launch.to_device`` callers may pass)."""
    return getattr(problem, f"{operand}_layout", LAYOUT_PACKED)


def _unfused(raw: np.ndarray, fmt: BlockFormat, layout: str, k: int) -> tuple[np.ndarray, str]:
    """(element bytes, their layout) of an operand stored in ``layout``: fused weights without their scales."""
    if fused_scales(layout):
        return E2M1H200FusedOrder.unfuse(raw, fmt.block_size, k)[0], weight_bytes_layout(layout)
    return raw, layout


def _relaid(raw: np.ndarray, layout: str, new_layout: str, shape) -> np.ndarray:
    """``raw`` bytes in ``layout`` as ``new_layout`` (``raw`` itself when they are the same); ``shape``: the
    operand's logical (..., rows, K bytes), which tiled layouts store padded."""
    if layout == new_layout:
        return raw
    packed = raw if layout == LAYOUT_PACKED else OPERAND_LAYOUTS[layout].unswizzle(raw, shape)
    return packed if new_layout == LAYOUT_PACKED else OPERAND_LAYOUTS[new_layout].swizzle(packed)


def _relaid_scales(scales: np.ndarray, fmt: BlockFormat, layout: str, new_layout: str) -> np.ndarray:
    """An operand's scale bytes in ``layout`` as ``new_layout`` (``scales`` itself when they are the same)."""
    if layout == new_layout:
        return scales
    plain = scales if layout == LAYOUT_PACKED else OPERAND_LAYOUTS[layout].decode_scales(scales, fmt.scale_dtype)
    return plain if new_layout == LAYOUT_PACKED else OPERAND_LAYOUTS[new_layout].encode_scales(plain, fmt.scale_dtype)


def require_packed(problem, backend: str) -> None:
    """ValueError unless ``problem.a`` and ``problem.b`` hold their bytes as quantized (``pack_fp4`` order, or a tag
    that keeps them so: ``e4m3_folded``): for kernels that read the raw bytes and do not know the H200 re-layout."""
    for operand in ("a", "b"):
        layout = layout_of(problem, operand)
        if word_order(layout) != LAYOUT_PACKED or tiled_weights(layout):
            raise ValueError(f"{backend} reads {operand} in {LAYOUT_PACKED!r} order; this problem's {operand} is "
                             f"{layout!r} (use problem.with_{operand}_layout({LAYOUT_PACKED!r}), or an H200 backend)")


def build_problem(activations: np.ndarray, weights, group_sizes, expert_ids, *, fmt: str = "nvfp4",
                  scale_mode: str = "rceil", estimated_total_m: int | None = None) -> GroupedProblem:
    """Quantize float32 activations ``(total_tokens, K)`` and weights ``(num_experts, N, K)`` into a
    ``GroupedProblem``. ``group_sizes[g]`` tokens (consecutive rows) go to slot ``g`` with expert
    ``expert_ids[g]`` (-1 = skip). ``weights`` may also be an already quantized ``BlockScaled``
    (``quantize(w, b_format)``: quantize weights once, reuse them across problems).

    NVFP4: ``expert_scales[e] = 1 / (S_enc(activations) * S_enc(weights[e]))``: the two global
    decode scales the epilogue applies to the accumulator; W4A16 with NVFP4 weights: the weights' alone
    (bf16 tokens have none). MX formats: 1.0.
    """
    a_format, b_format = resolve_formats(fmt)
    group_sizes = np.asarray(group_sizes)
    if group_sizes.ndim != 1 or group_sizes.size == 0 or not np.issubdtype(group_sizes.dtype, np.integer):
        raise ValueError("group_sizes must be a non-empty 1-D integer array")
    if np.any(group_sizes < 0):
        raise ValueError(f"group_sizes must be >= 0, got {group_sizes.tolist()}")
    expert_ids = np.asarray(expert_ids)
    if expert_ids.shape != group_sizes.shape or not np.issubdtype(expert_ids.dtype, np.integer):
        raise ValueError(f"expert_ids must be an integer array shaped like group_sizes {group_sizes.shape}")
    activations = np.asarray(activations)
    if activations.ndim != 2 or activations.shape[0] != int(group_sizes.sum()):
        raise ValueError(f"activations must be (sum(group_sizes) = {int(group_sizes.sum())}, K), "
                         f"got {activations.shape}")

    qb = weights if isinstance(weights, BlockScaled) else quantize(weights, b_format, scale_mode)
    if qb.fmt != b_format or qb.data.ndim != 3:
        raise ValueError(f"weights must be (num_experts, N, K) float32 or a 3-D BlockScaled in {b_format.name}")
    qa = quantize(activations, a_format, scale_mode)
    k = activations.shape[1]
    if qb.k != k:
        raise ValueError(f"activations have K = {k} but weights have K = {qb.k}")

    a_offsets = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.uint32)
    a_scales, a_scale_offsets = pad_group_scales(qa.scales, a_offsets)
    expert_scales = (qa.global_decode_scale.astype(np.float64) * qb.global_decode_scale.astype(np.float64)
                     * np.ones(qb.data.shape[0])).astype(np.float32)
    total = int(a_offsets[-1])
    return GroupedProblem(
        a_format=a_format, b_format=b_format, a=qa.data, b=qb.data,
        a_scales=a_scales, b_scales=swizzle_scales(qb.scales),
        a_offsets=a_offsets, a_scale_offsets=a_scale_offsets,
        expert_ids=expert_ids.astype(np.int32), expert_scales=expert_scales,
        num_active_experts=int(group_sizes.size),
        estimated_total_m=total if estimated_total_m is None else estimated_total_m,
        n=qb.data.shape[1], k=k,
    )


# ----------------------------------------------------------------------------------------------
# Realistic random problems
# ----------------------------------------------------------------------------------------------
RAGGED_DIRICHLET_ALPHA = 0.3   # small alpha: a few hot experts take most tokens
ROUTER_LOGIT_STD = 1.0         # spread of the top-k router's per-expert popularity
ACTIVATION_OUTLIER_FRACTION = 0.01   # a few hidden channels carry large values, as in LLM activations
ACTIVATION_OUTLIER_GAIN = 20.0
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Routing:
    """Per-slot token counts and expert ids of one grouped matmul."""

    group_sizes: np.ndarray   # int64[num_active_experts]
    expert_ids: np.ndarray    # int32[num_active_experts]


def make_routing(*, num_experts: int, total_tokens: int, num_active_experts: int | None = None,
                 routing: str = "uniform", top_k: int = 8, num_empty: int = 0, num_skipped: int = 0,
                 seed: int = 0) -> Routing:
    """Token counts per group slot and their expert ids.

    ``uniform``: ``total_tokens`` spread evenly over ``num_active_experts`` slots.
    ``ragged``: the same total drawn from a Dirichlet(0.3): a few hot experts, many cold ones.
    ``topk``: ``total_tokens`` tokens each choose ``top_k`` distinct experts out of
    ``num_experts`` with skewed router popularity; every expert that got a token is a slot, so
    ``total_tokens * top_k`` rows in all (``num_active_experts`` is ignored).
    Then ``num_empty`` slots with no tokens and ``num_skipped`` slots with expert id -1 (their
    tokens stay in A, their output rows are not written) are inserted at random positions.
    Expert ids of the live slots are distinct and increasing, as a router's sort produces.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    rng = np.random.default_rng(seed)
    if routing == "topk":
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
        popularity = rng.normal(0.0, ROUTER_LOGIT_STD, num_experts)
        gumbel = rng.gumbel(size=(total_tokens, num_experts))
        choices = np.argsort(-(popularity + gumbel), axis=1)[:, :top_k]
        counts = np.bincount(choices.ravel(), minlength=num_experts)
        live_experts = np.flatnonzero(counts)
        sizes = counts[live_experts]
    else:
        if num_active_experts is None or num_active_experts < 1:
            raise ValueError("num_active_experts must be >= 1 for uniform and ragged routing")
        if num_active_experts > num_experts:
            raise ValueError(f"num_active_experts = {num_active_experts} > num_experts = {num_experts}")
        if routing == "uniform":
            sizes = np.full(num_active_experts, total_tokens // num_active_experts)
            sizes[: total_tokens % num_active_experts] += 1
        else:
            sizes = rng.multinomial(total_tokens, rng.dirichlet([RAGGED_DIRICHLET_ALPHA] * num_active_experts))
        live_experts = np.sort(rng.choice(num_experts, num_active_experts, replace=False))
    spare = np.setdiff1d(np.arange(num_experts), live_experts)
    if num_empty > spare.size:
        raise ValueError(f"num_empty = {num_empty} needs that many unused experts; only {spare.size} left")
    empty_experts = rng.choice(spare, num_empty, replace=False) if num_empty else np.empty(0, np.int64)

    live = [(int(e), int(c)) for e, c in zip(live_experts, sizes)]
    skipped_sizes = rng.integers(1, max(2, int(np.max(sizes, initial=1)) + 1), num_skipped)
    extra = [(int(e), 0) for e in empty_experts] + [(-1, int(c)) for c in skipped_sizes]
    extra = [extra[i] for i in rng.permutation(len(extra))]
    merged = list(live)
    for slot in extra:   # live slots keep increasing expert order; extras land anywhere among them
        merged.insert(int(rng.integers(0, len(merged) + 1)), slot)
    return Routing(group_sizes=np.array([s for _, s in merged], np.int64),
                   expert_ids=np.array([e for e, _ in merged], np.int32))


def random_activations(rng: np.random.Generator, tokens: int, k: int) -> np.ndarray:
    """Normal activations with a few outlier channels (float32)."""
    gain = np.where(rng.random(k) < ACTIVATION_OUTLIER_FRACTION, ACTIVATION_OUTLIER_GAIN, 1.0)
    return (rng.standard_normal((tokens, k)) * gain).astype(np.float32)


def random_weights(rng: np.random.Generator, num_experts: int, n: int, k: int) -> np.ndarray:
    """Normal weights, each expert with its own spread (float32)."""
    spread = WEIGHT_STD * rng.uniform(0.5, 2.0, (num_experts, 1, 1))
    return (rng.standard_normal((num_experts, n, k)) * spread).astype(np.float32)


@dataclass(frozen=True)
class RandomInputs:
    """The float32 tensors behind a ``random_problem``, before quantization."""

    routing: Routing
    num_experts: int
    experts: np.ndarray       # the experts the routing uses (sorted); only they get weights
    weights: np.ndarray       # float32 (len(experts), N, K), row i belongs to experts[i]
    activations: np.ndarray   # float32 (sum(group_sizes), K)

    def unquantized_product(self) -> np.ndarray:
        """float32 ``C`` of the unquantized tensors on the rows a grouped matmul writes (others 0)."""
        sizes, ids = self.routing.group_sizes, self.routing.expert_ids
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        out = np.zeros((self.activations.shape[0], self.weights.shape[1]), np.float32)
        for g, e in enumerate(ids):
            if e >= 0 and sizes[g] > 0:
                w = self.weights[int(np.searchsorted(self.experts, e))]
                out[offsets[g]:offsets[g + 1]] = self.activations[offsets[g]:offsets[g + 1]] @ w.T
        return out


def random_inputs(*, n: int, k: int, num_experts: int, total_tokens: int, num_active_experts: int | None = None,
                  routing: str = "uniform", top_k: int = 8, num_empty: int = 0, num_skipped: int = 0,
                  seed: int = 0) -> RandomInputs:
    """Routing from ``make_routing``, normal activations with outlier channels, per-expert weight
    spreads for the experts the routing uses."""
    plan = make_routing(num_experts=num_experts, total_tokens=total_tokens, num_active_experts=num_active_experts,
                        routing=routing, top_k=top_k, num_empty=num_empty, num_skipped=num_skipped, seed=seed)
    rng = np.random.default_rng(seed + 1)
    used = np.unique(plan.expert_ids[plan.expert_ids >= 0])
    weights = random_weights(rng, used.size, n, k)
    activations = random_activations(rng, int(plan.group_sizes.sum()), k)
    return RandomInputs(plan, num_experts, used, weights, activations)


def problem_from_inputs(inputs: RandomInputs, fmt: str = "nvfp4", scale_mode: str = "rceil") -> GroupedProblem:
    """Quantize ``inputs`` into a ``GroupedProblem``; experts without weights get zero bytes."""
    _, b_format = resolve_formats(fmt)
    weights = scatter_experts(quantize(inputs.weights, b_format, scale_mode), inputs.experts, inputs.num_experts)
    return build_problem(inputs.activations, weights, inputs.routing.group_sizes, inputs.routing.expert_ids,
                         fmt=fmt, scale_mode=scale_mode)


def random_problem(fmt: str = "nvfp4", *, n: int, k: int, num_experts: int, total_tokens: int,
                   num_active_experts: int | None = None, routing: str = "uniform", top_k: int = 8,
                   num_empty: int = 0, num_skipped: int = 0, scale_mode: str = "rceil",
                   seed: int = 0) -> GroupedProblem:
    """A reproducible random problem (``random_inputs`` quantized). Only the experts the routing
    uses get random weights (the rest are zero bytes), so large expert counts stay cheap to quantize."""
    inputs = random_inputs(n=n, k=k, num_experts=num_experts, total_tokens=total_tokens,
                           num_active_experts=num_active_experts, routing=routing, top_k=top_k,
                           num_empty=num_empty, num_skipped=num_skipped, seed=seed)
    return problem_from_inputs(inputs, fmt, scale_mode)


def scatter_experts(q: BlockScaled, experts: np.ndarray, num_experts: int) -> BlockScaled:
    """Place quantized weights of ``experts`` into a ``num_experts``-long stack; the other experts
    get zero bytes (zero weights, global scale 1)."""
    data = np.zeros((num_experts,) + q.data.shape[1:], q.data.dtype)
    scales = np.zeros((num_experts,) + q.scales.shape[1:], np.uint8)
    data[experts], scales[experts] = q.data, q.scales
    global_scale = None
    if q.global_scale is not None:
        global_scale = np.ones(num_experts, np.float32)
        global_scale[experts] = q.global_scale
    return BlockScaled(data, scales, q.fmt, global_scale)
