"""Peers timed beside our kernels in ``python -m gbs bench``: what a PyTorch / Triton user has today.

* ``torch_bf16``: ``torch._grouped_mm`` in bf16 (CUTLASS on SM90): the dense baseline. Its weights
  are bf16, 4x the bytes of FP4 weights.
* ``torch_fp8_rowwise``: ``torch._scaled_grouped_mm`` with E4M3 operands and float32 row-wise
  scales (one per token row, one per weight row): the FP8 baseline, coarser than MX block scales.
  Timed with ``use_fast_accum=False`` and ``=True`` (torch's fastest setting: the FP8 MMAs accumulate
  without promotion to fp32); each output is checked, and the faster verified setting is the peer's row.
* ``triton_dot_scaled``: a Triton kernel around ``tl.dot_scaled`` (which Hopper emulates by
  upcasting to bf16), launched once per live group from a Python loop, with fixed tiles. NOT a
  headline peer (``headline = False``): see ``TritonDotScaledPeer``.
* ``humming``: humming-kernels 0.1.20 (PyPI ``humming-kernels``), the strongest Hopper MoE peer measured by hand
  (``shared/spec/hopper_fp8_route.md``): its own quantizer, packing and heuristics through ``HummingLayer`` in
  the grouped-contiguous MoE form, in three formats (its ``settings``; one verified reference per format). See
  ``HummingPeer``.
* ``copy``: a device-to-device copy (``Tensor.copy_``) that reads half of our kernel's useful bytes
  and writes the other half: the same DRAM traffic, at the rate a copy reaches.

Every peer sees only the live groups (slots with an expert and at least one token): torch's grouped
matmuls have no ``-1`` skip semantics. Peers build their own random inputs on the GPU for a shape
(N, K, live group sizes); none of them reads our problem's bytes. Before timing, ``check_peer`` runs
each peer once on a small shape against a float64 reference of its own inputs, and the bench checks
each setting's output at the bench shape too (``check_at_shape``, against ``Peer.device_reference``:
the float64 result of the first input set, computed once on the GPU), with the per-row metric of
``gbs.lab.verify``; an output that fails is not timed.

torch, Triton and humming are imported only when a peer is loaded: torch and Triton are on the H200 image
(torch 2.11 + cu130, Triton 3.6), humming-kernels travels there as a wheel (``scripts/fetch_gpu_wheels.sh``);
none of them is in the CPU CI environment. Triton compiles its kernel on first use, humming its kernels (NVRTC)
on the first launch of a layer, which is the untimed output check.
"""
from __future__ import annotations

import functools
import sys
import traceback
from dataclasses import dataclass

import numpy as np

from ..problem import GroupedProblem, resolve_formats
from ..formats import UE8M0_BIAS, decode_elements, unpack_fp4
from ..reference import MAX_REL_TOL, RMS_REL_TOL, relative_errors
from .verify import ROW_ERR_BOUND, OutputCheck, check_output


def describe_error(err: BaseException) -> str:
    """``Type: message`` of a peer's exception; where the message is empty (a bare ``assert`` in the peer's code,
    as humming's shape checks are), the file and line that raised it, so a note says what the peer refused."""
    text = f"{type(err).__name__}: {err}"
    frames = traceback.extract_tb(err.__traceback__)
    if str(err) or not frames:
        return text
    path = frames[-1].filename.replace("\\", "/")
    path = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
    return f"{text}raised at {path}:{frames[-1].lineno}"


PEER_NAMES = ("torch_bf16", "torch_fp8_rowwise", "triton_dot_scaled", "humming", "copy")

BF16_BYTES = 2
FP8_BYTES = 1
ROW_SCALE_BYTES = 4          # float32 row-wise scale (torch_fp8_rowwise)
OUTPUT_BYTES = 2             # every method writes bf16
COPY_ALIGN_BYTES = 16
TORCH_ALIGN = 16             # _scaled_grouped_mm: K and N multiples of 16 (GroupedBlas.cpp)

# Triton peer tiles: tokens x weight rows x K per program. A decode group (<= 64 tokens) gets a
# 64-token tile (the smallest wgmma M on Hopper); larger groups 128.
TRITON_SCALE_BLOCK = 32      # tl.dot_scaled: one UE8M0 scale per 32 elements along K
TRITON_BLOCK_N = 128
TRITON_BLOCK_K = 128
TRITON_SMALL_BLOCK_M = 64
TRITON_LARGE_BLOCK_M = 128
TRITON_NUM_WARPS = 4
TRITON_NUM_STAGES = 3
# Random scale bytes near 1.0 (2^-7 .. 2^3): products stay far from bf16 / fp32 overflow.
TRITON_UE8M0_RANGE = (120, 131)

# torch_fp8_rowwise's launch settings (``Peer.settings``): torch's default, and its fastest.
FP8_ACCURATE = "use_fast_accum=False"
FP8_FAST = "use_fast_accum=True"
# Fast accumulation on Hopper: the FP8 MMAs keep the running sum in an accumulator of ~13 mantissa bits,
# truncated (e8m13, not fp32), for each K=32 MMA step; unpromoted, each of the K/32 adds may lose up to
# 2^-13 of the running sum. The check's bound for it is ``ROW_ERR_BOUND + (K / 32) * FAST_ACCUM_LOSS_PER_ADD``
# (K=7168: 3.7e-2): a worst case, not an estimate; the measured max_row_err is in the CSV.
FAST_ACCUM_MMA_K = 32
FAST_ACCUM_LOSS_PER_ADD = 2.0 ** -13

# humming's launch settings (``HummingPeer.settings``): the three formats it runs FP4 MoE weights in on Hopper,
# labelled as ``shared/spec/hopper_fp8_route.md`` measured them. Each: (weight format, FP8 tokens?).
HUMMING_MXFP4_BF16 = "MXFP4 weights x bf16 tokens"
HUMMING_NVFP4_BF16 = "NVFP4 weights x bf16 tokens"
HUMMING_MXFP4_FP8 = "MXFP4 weights x FP8 tokens (fp32 scales per 1x128, not MX)"
HUMMING_SETTINGS = {HUMMING_MXFP4_BF16: ("mxfp4", False), HUMMING_NVFP4_BF16: ("nvfp4", False),
                    HUMMING_MXFP4_FP8: ("mxfp4", True)}
# ``HummingLayer`` weight configs in humming's own schema (``humming.schema.humming.HummingWeightSchema``; the
# same schemas its ``mxfp4`` and ``modelopt`` NVFP4 checkpoint loaders convert to): MXFP4 = E2M1 with a UE8M0
# scale per 32; NVFP4 = E2M1 with an E4M3 scale per 16 and an fp32 scale per expert ("tensor" scale_2).
HUMMING_WEIGHT_CONFIGS = {
    "mxfp4": {"quant_method": "humming", "dtype": "float4e2m1", "scale_dtype": "float8e8m0", "group_size": 32},
    "nvfp4": {"quant_method": "humming", "dtype": "float4e2m1", "scale_dtype": "float8e4m3", "group_size": 16,
              "scale_type": "group", "scale_2_type": "tensor"},
}
HUMMING_WEIGHT_SCALE_BLOCK = {"mxfp4": 32, "nvfp4": 16}
HUMMING_TENSOR_SCALE_BYTES = 4   # NVFP4's fp32 scale per expert
# FP8 tokens: E4M3 with a dynamic fp32 scale per 1 x 128 (humming's DynamicGroup input mode; on SM90 its scale
# dtype resolves to float32), quantized by humming's own input kernel.
HUMMING_FP8_GROUP = 128
HUMMING_FP8_INPUT_CONFIG = {"quant_method": "humming", "dtype": "float8e4m3", "group_size": HUMMING_FP8_GROUP}
HUMMING_COMPUTE_CONFIG = {"gemm_type": "grouped_contiguous"}   # tokens sorted by expert; E + 1 offsets
HUMMING_DTYPE = "bfloat16"       # HummingLayer's torch_dtype: bf16 tokens, scales and output

# The correctness check's shape: ragged groups, one longer than the large tile, N and K multiples
# of every alignment above.
CHECK_N = 256
CHECK_K = 512
CHECK_GROUP_SIZES = (5, 37, 130)
CHECK_SEED = 1234

# Dense matmul peaks measured in the same run (kernels.md measured 766 / 1340 TFLOP/s here).
DENSE_PEAK_SIZE = 8192
DENSE_PEAK_KINDS = ("bf16", "fp8")


@dataclass(frozen=True)
class PeerShape:
    """What a peer computes: live group sizes (tokens) x N weight rows x K."""

    n: int
    k: int
    group_sizes: tuple[int, ...]

    def __post_init__(self):
        if self.n < 1 or self.k < 1:
            raise ValueError(f"N and K must be positive, got N={self.n}, K={self.k}")
        if not self.group_sizes or min(self.group_sizes) < 1:
            raise ValueError(f"a peer shape needs at least one group and no empty groups, got {self.group_sizes}")

    @classmethod
    def from_problem(cls, problem: GroupedProblem) -> "PeerShape":
        """The live groups of ``problem`` (expert id >= 0 and at least one token), in slot order."""
        sizes = problem.group_sizes
        live = tuple(int(sizes[g]) for g in problem.active_slots())
        if not live:
            raise ValueError("the problem has no live group (every slot is -1 or empty)")
        return cls(problem.n, problem.k, live)

    @property
    def tokens(self) -> int:
        return sum(self.group_sizes)

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def flops(self) -> int:
        return 2 * self.tokens * self.n * self.k

    def offsets(self) -> np.ndarray:
        """Cumulative group ends (torch's ``offs``)."""
        return np.cumsum(self.group_sizes).astype(np.int32)

    def output_bytes(self) -> int:
        return self.tokens * self.n * OUTPUT_BYTES


def triton_formats(fmt: str) -> tuple[str, str, str]:
    """(lhs format, rhs format, note) of the Triton peer for a problem format: the element formats
    of A (tokens) and B (weights), with UE8M0 block-32 scales; the note says when that is a proxy."""
    a_format, b_format = resolve_formats(fmt)
    proxies = [f.name for f in (a_format, b_format)
               if f.scale_dtype != "ue8m0" or f.block_size != TRITON_SCALE_BLOCK]
    note = ""
    if proxies:
        note = (f"{'/'.join(sorted(set(proxies)))} runs as its MX proxy (UE8M0 block-32 scales): "
                "tl.dot_scaled takes no other scales")
    return a_format.element, b_format.element, note


def _element_bits(element: str) -> int:
    return 4 if element == "e2m1" else 8


def _mx_row_bytes(element: str, k: int) -> int:
    """Bytes of one K-long row in an MX format: elements plus one UE8M0 byte per 32."""
    return k * _element_bits(element) // 8 + k // TRITON_SCALE_BLOCK


def _check_multiple(what: str, value: int, multiple: int, peer: str) -> None:
    if value % multiple:
        raise ValueError(f"{peer}: {what} = {value} must be a multiple of {multiple}")


# ----------------------------------------------------------------------------------------------
# Peers
# ----------------------------------------------------------------------------------------------
class Peer:
    """One peer: builds inputs for a shape on the GPU, launches once per call, and can check its
    output against a float64 reference of the same inputs."""

    name = ""
    label = ""
    format_dependent = False   # False: one timing of a shape serves every problem format
    headline = True            # False: a labelled, non-headline peer (CSV peer_headline; say why in the class)
    settings: tuple[str, ...] = ("",)   # launch settings the bench checks and times; the fastest verified is the row

    def method_format(self, fmt: str) -> str:
        raise NotImplementedError

    def row_err_bound(self, setting: str, k: int) -> float:
        """The per-row normalised error an output of ``setting`` must stay within (``gbs.lab.verify``)."""
        return ROW_ERR_BOUND

    def useful_flops(self, shape: PeerShape) -> int:
        return shape.flops

    def useful_bytes(self, shape: PeerShape, fmt: str, our_useful_bytes: int) -> int:
        """The fewest bytes this method must move for ``shape``."""
        raise NotImplementedError

    def make_inputs(self, shape: PeerShape, fmt: str, our_useful_bytes: int, seed: int):
        raise NotImplementedError

    def compile_ahead(self, shapes, workers: int) -> list[str]:
        """Compile ahead what the first launches on ``shapes`` would compile (peers whose JIT is slow); returns
        what failed, as text. Most peers compile in well under a second: nothing to do."""
        return []

    def launch(self, inputs, setting: str = ""):
        """Run once (asynchronously; no host copies, no syncs) with launch ``setting`` (one of
        ``settings``); returns the output tensor."""
        raise NotImplementedError

    def reference(self, inputs) -> np.ndarray:
        """float64 result the launch must produce (small shapes only: it runs on the host)."""
        raise NotImplementedError

    def device_reference(self, inputs):
        """The same float64 result computed on the GPU (torch float64 matmuls), for bench shapes."""
        raise NotImplementedError

    def setting_reference(self, reference, setting: str = ""):
        """The part of ``device_reference``'s result that ``setting``'s output is checked against: all of it
        for peers whose settings compute the same thing (every peer but ``HummingPeer``)."""
        return reference


def _torch():
    import torch

    return torch


def _generator(seed: int):
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return gen


def _host64(tensor) -> np.ndarray:
    """float64 host copy of a torch tensor (synchronises with its stream) or of a numpy array."""
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    if tensor.dtype == _torch().float64:   # a float64 device reference: no detour through float32
        return tensor.cpu().numpy()
    return tensor.float().cpu().numpy().astype(np.float64)   # bf16 / FP8 / float32: exact in float32


def _device64(tensor):
    """A torch tensor as float64 on its device (FP8 through float32: both conversions exact)."""
    return tensor.float().double()


def _grouped_device_reference(a64, weights64, group_sizes):
    """C[rows of group g] = a64[rows] @ weights64(g).T, float64 on the GPU (``weights64(g)``: (N, K))."""
    torch = _torch()
    out = None
    start = 0
    for g, size in enumerate(group_sizes):
        w = weights64(g)
        if out is None:
            out = torch.empty((a64.shape[0], w.shape[0]), dtype=torch.float64, device=a64.device)
        out[start:start + size] = a64[start:start + size] @ w.T
        start += size
    return out


def _grouped_reference(a: np.ndarray, b: np.ndarray, group_sizes) -> np.ndarray:
    """C[rows of group g] = A[rows] @ B[g].T in float64."""
    out = np.empty((a.shape[0], b.shape[1]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[start:start + size] = a[start:start + size] @ b[g].T
        start += size
    return out


class TorchBf16Peer(Peer):
    name = "torch_bf16"
    label = "torch._grouped_mm bf16"

    def method_format(self, fmt):
        return "bf16 x bf16"

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        return (shape.num_groups * shape.n * shape.k * BF16_BYTES + shape.tokens * shape.k * BF16_BYTES
                + shape.output_bytes())

    def make_inputs(self, shape, fmt, our_useful_bytes, seed):
        torch = _torch()
        gen = _generator(seed)
        a = torch.randn((shape.tokens, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen)
        # Weights stored as experts' (N, K) rows, passed as the (G, K, N) transpose view
        b = torch.randn((shape.num_groups, shape.n, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen)
        offs = torch.from_numpy(shape.offsets()).to("cuda")
        return {"a": a, "b": b, "offs": offs, "group_sizes": shape.group_sizes, "k": shape.k}

    def launch(self, inputs, setting=""):
        return _torch()._grouped_mm(inputs["a"], inputs["b"].transpose(-2, -1), offs=inputs["offs"])

    def reference(self, inputs):
        return _grouped_reference(_host64(inputs["a"]), _host64(inputs["b"]), inputs["group_sizes"])

    def device_reference(self, inputs):
        b = inputs["b"]
        return _grouped_device_reference(_device64(inputs["a"]), lambda g: _device64(b[g]), inputs["group_sizes"])


class TorchFp8RowwisePeer(Peer):
    """``torch._scaled_grouped_mm`` (CUTLASS on SM90) in both of its accumulation settings: ``use_fast_accum``
    False (torch's default: partial sums promoted to fp32) and True (its fastest: the FP8 MMAs accumulate
    unpromoted); the bench checks and times both and reports the faster verified one."""

    name = "torch_fp8_rowwise"
    label = "torch._scaled_grouped_mm e4m3, f32 row-wise scales"
    settings = (FP8_ACCURATE, FP8_FAST)

    def method_format(self, fmt):
        return "e4m3 x e4m3, f32 row scales"

    def row_err_bound(self, setting, k):
        if setting == FP8_FAST:
            return ROW_ERR_BOUND + -(-k // FAST_ACCUM_MMA_K) * FAST_ACCUM_LOSS_PER_ADD
        return ROW_ERR_BOUND

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        weights = shape.num_groups * shape.n * (shape.k * FP8_BYTES + ROW_SCALE_BYTES)
        tokens = shape.tokens * (shape.k * FP8_BYTES + ROW_SCALE_BYTES)
        return weights + tokens + shape.output_bytes()

    def make_inputs(self, shape, fmt, our_useful_bytes, seed):
        _check_multiple("K", shape.k, TORCH_ALIGN, self.name)
        _check_multiple("N", shape.n, TORCH_ALIGN, self.name)
        torch = _torch()
        gen = _generator(seed)
        e4m3 = torch.float8_e4m3fn
        a = torch.randn((shape.tokens, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen).to(e4m3)
        b = torch.randn((shape.num_groups, shape.n, shape.k), dtype=torch.bfloat16, device="cuda",
                        generator=gen).to(e4m3)
        scale_a = torch.rand(shape.tokens, dtype=torch.float32, device="cuda", generator=gen) + 0.5
        scale_b = torch.rand((shape.num_groups, shape.n), dtype=torch.float32, device="cuda", generator=gen) + 0.5
        offs = torch.from_numpy(shape.offsets()).to("cuda")
        return {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "offs": offs,
                "group_sizes": shape.group_sizes, "k": shape.k}

    def launch(self, inputs, setting=FP8_ACCURATE):
        if setting not in self.settings:
            raise ValueError(f"{self.name}: setting must be one of {self.settings}, got {setting!r}")
        torch = _torch()
        # mat_b must be "transposed" (column-major (G, K, N)); scale_b is (G, N) (GroupedBlas.cpp). The signature in
        # torch 2.11: (mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
        # use_fast_accum=False); the SM90 row-wise path hands use_fast_accum to its CUTLASS kernel choice.
        return torch._scaled_grouped_mm(inputs["a"], inputs["b"].transpose(-2, -1), inputs["scale_a"],
                                        inputs["scale_b"], offs=inputs["offs"], out_dtype=torch.bfloat16,
                                        use_fast_accum=setting == FP8_FAST)

    def reference(self, inputs):
        a = _host64(inputs["a"]) * _host64(inputs["scale_a"])[:, None]
        b = _host64(inputs["b"]) * _host64(inputs["scale_b"])[:, :, None]
        return _grouped_reference(a, b, inputs["group_sizes"])

    def device_reference(self, inputs):
        a = _device64(inputs["a"]) * _device64(inputs["scale_a"])[:, None]
        b, scale_b = inputs["b"], inputs["scale_b"]
        return _grouped_device_reference(a, lambda g: _device64(b[g]) * _device64(scale_b[g])[:, None],
                                         inputs["group_sizes"])


class CopyPeer(Peer):
    name = "copy"
    label = "device-to-device copy (Tensor.copy_)"

    def method_format(self, fmt):
        return "bytes"

    @staticmethod
    def copy_bytes(our_useful_bytes: int) -> int:
        """Bytes copied: half our useful bytes, so read + written equals them (16-byte multiple)."""
        half = our_useful_bytes // 2
        return max(COPY_ALIGN_BYTES, half - half % COPY_ALIGN_BYTES)

    def useful_flops(self, shape):
        return 0

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        return 2 * self.copy_bytes(our_useful_bytes)

    def make_inputs(self, shape, fmt, our_useful_bytes, seed):
        torch = _torch()
        nbytes = self.copy_bytes(our_useful_bytes)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=_generator(seed))
        return {"src": src, "dst": torch.empty_like(src)}

    def row_err_bound(self, setting, k):
        return 0.0   # a copy is exact: one wrong byte fails

    def launch(self, inputs, setting=""):
        return inputs["dst"].copy_(inputs["src"])

    def reference(self, inputs):
        return inputs["src"].cpu().numpy().astype(np.float64)

    def device_reference(self, inputs):
        return inputs["src"]


class TritonDotScaledPeer(Peer):
    """A Triton ``tl.dot_scaled`` kernel per live group, launched from a Python loop with fixed, untuned tiles
    (``TRITON_BLOCK_*``, ``TRITON_NUM_WARPS`` / ``_STAGES``).

    Not a headline peer (``headline = False``; CSV ``peer_headline`` False; the table says NOT HEADLINE): it is
    not what a Triton user would run. A decode case launches one kernel per expert (64 launches of a few
    microseconds each for ``decode_up``), so its time is mostly launch gaps and tail effects, and its tiles were
    never tuned for these shapes; a fair Triton peer is one persistent grouped launch that reads the offsets
    array, with an autotuned tile (issue 32, item 5). It stays in the bench, labelled, as a check that
    ``tl.dot_scaled`` runs these formats on this GPU and as an upper bound of what a naive Triton port costs;
    speed-ups over it must not be quoted as "faster than Triton"."""

    name = "triton_dot_scaled"
    label = "Triton tl.dot_scaled, one launch per group (untuned; not headline)"
    format_dependent = True
    headline = False

    def method_format(self, fmt):
        lhs, rhs, note = triton_formats(fmt)
        return f"{lhs} x {rhs}, ue8m0/32" + (" (MX proxy)" if note else "")

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        lhs, rhs, _ = triton_formats(fmt)
        return (shape.num_groups * shape.n * _mx_row_bytes(rhs, shape.k) + shape.tokens * _mx_row_bytes(lhs, shape.k)
                + shape.output_bytes())

    @staticmethod
    def block_m(shape: PeerShape) -> int:
        return TRITON_SMALL_BLOCK_M if max(shape.group_sizes) <= TRITON_SMALL_BLOCK_M else TRITON_LARGE_BLOCK_M

    def make_inputs(self, shape, fmt, our_useful_bytes, seed, block_m: int | None = None):
        _check_multiple("K", shape.k, TRITON_BLOCK_K, self.name)
        _check_multiple("N", shape.n, TRITON_BLOCK_N, self.name)
        torch = _torch()
        gen = _generator(seed)
        lhs, rhs, _ = triton_formats(fmt)

        def elements(rows: tuple[int, ...], element: str):
            if element == "e2m1":   # every FP4 code is a number; two per byte, low nibble first
                return torch.randint(0, 256, (*rows, shape.k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
            values = torch.randn((*rows, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen)
            return values.to(dtype).view(torch.uint8)

        def scales(rows: tuple[int, ...]):
            lo, hi = TRITON_UE8M0_RANGE
            return torch.randint(lo, hi, (*rows, shape.k // TRITON_SCALE_BLOCK), dtype=torch.uint8,
                                 device="cuda", generator=gen)

        tokens, experts = (shape.tokens,), (shape.num_groups, shape.n)
        a, a_scale, b, b_scale = elements(tokens, lhs), scales(tokens), elements(experts, rhs), scales(experts)
        out = torch.full((shape.tokens, shape.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        block_m = self.block_m(shape) if block_m is None else block_m
        kernel = _triton_group_kernel()
        launches = []   # the per-group views and grids, built once: the timed loop only launches
        start = 0
        for g, size in enumerate(shape.group_sizes):
            rows = slice(start, start + size)
            grid = (-(-size // block_m), shape.n // TRITON_BLOCK_N)
            launches.append((grid, (a[rows], a_scale[rows], b[g], b_scale[g], out[rows], size, shape.n, shape.k,
                                    a.stride(0), a_scale.stride(0), b.stride(1), b_scale.stride(1), out.stride(0))))
            start += size
        return {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "out": out, "formats": (lhs, rhs),
                "group_sizes": shape.group_sizes, "block_m": block_m, "kernel": kernel, "launches": launches,
                "k": shape.k}

    def launch(self, inputs, setting=""):
        kernel, (lhs, rhs), block_m = inputs["kernel"], inputs["formats"], inputs["block_m"]
        for grid, args in inputs["launches"]:
            kernel[grid](*args, A_FORMAT=lhs, B_FORMAT=rhs, BLOCK_M=block_m, BLOCK_N=TRITON_BLOCK_N,
                         BLOCK_K=TRITON_BLOCK_K, num_warps=TRITON_NUM_WARPS, num_stages=TRITON_NUM_STAGES)
        return inputs["out"]

    def reference(self, inputs):
        lhs, rhs = inputs["formats"]
        a = _mx_values(inputs["a"], inputs["a_scale"], lhs)
        b = _mx_values(inputs["b"], inputs["b_scale"], rhs)
        return _grouped_reference(a, b, inputs["group_sizes"])

    def device_reference(self, inputs):
        lhs, rhs = inputs["formats"]
        b, b_scale = inputs["b"], inputs["b_scale"]
        return _grouped_device_reference(_mx_values_device(inputs["a"], inputs["a_scale"], lhs),
                                         lambda g: _mx_values_device(b[g], b_scale[g], rhs), inputs["group_sizes"])


class HummingPeer(Peer):
    """humming-kernels 0.1.20 (PyPI ``humming-kernels``; JIT-compiled CUDA GEMMs through NVRTC or nvcc), the
    strongest Hopper MoE peer measured by hand on these cases (``shared/spec/hopper_fp8_route.md``, issue 31
    item 1), run the way its users run it: a ``humming.layer.HummingLayer`` per format (``num_experts`` = the
    live groups) loaded with ``load_from_unquantized`` (its own quantizer) and ``transform()`` (its own
    packing), called with ``compute_config={"gemm_type": "grouped_contiguous"}`` and ``expert_layout`` = the
    E + 1 group offsets (int64, first 0, last the token count) over tokens sorted by expert; the layer forwards
    to ``humming.forward.humming_forward``, which picks its kernel with its own heuristics (no tuning config).

    Settings (``HUMMING_SETTINGS``; each checked, each timed, the fastest verified is the row):
    "MXFP4 weights x bf16 tokens" (E2M1, UE8M0 per 32), "NVFP4 weights x bf16 tokens" (E2M1, E4M3 per 16,
    fp32 per expert) and "MXFP4 weights x FP8 tokens (fp32 scales per 1x128, not MX)": E4M3 tokens with one fp32
    scale per token and 128 K, quantized by humming's own input kernel (``humming.forward.may_quant_input``)
    in ``make_inputs``; the timed launch gets the quantized tokens, as ``torch_fp8_rowwise``'s does.

    Its formats are its own, not the problem's (``format_dependent = False``): one timing of a shape serves
    every problem format. The settings compute different things (other weights, other tokens), so
    ``device_reference`` returns one float64 result per setting (``setting_reference`` picks it), each the
    matmul of that setting's dequantized operands: the quantized weights as its quantizer stored them (element
    values from ``humming.utils.weight.dequantize_weight`` without scales, times the scales in float64) and the
    tokens (bf16, or E4M3 times their fp32 scales). Bounds: bf16 tokens, ``ROW_ERR_BOUND`` (one bf16 rounding of
    the output plus fp32 accumulation, ``gbs.lab.verify``); FP8 tokens, ``torch_fp8_rowwise``'s fast-accumulation
    bound (FP8 MMAs may keep ~13 mantissa bits between promotions: ``ROW_ERR_BOUND + ceil(K / 32) 2^-13``, a
    worst case that does not rely on how often humming promotes). ``useful_bytes`` is the fewest of its settings'
    (MXFP4 weights x FP8 tokens).

    A headline peer. Its API points (tensor shapes and dtypes after its quantizer, the SM90 token-scale layout)
    were confirmed on the H200 (evidence ``bench-humming``, ``scripts/humming_probe.py``); the CPU tests run it
    against a stub ``humming`` module (``tests/test_peers_humming.py``). Its kernels compile per shape (NVRTC,
    about half a minute each): ``compile_ahead`` does that in parallel before the bench's checks."""

    name = "humming"
    label = "humming-kernels HummingLayer, grouped_contiguous"
    settings = tuple(HUMMING_SETTINGS)

    def method_format(self, fmt):
        return "humming FP4 weights, format per setting"

    def row_err_bound(self, setting, k):
        if HUMMING_SETTINGS[setting or self.settings[0]][1]:
            return ROW_ERR_BOUND + -(-k // FAST_ACCUM_MMA_K) * FAST_ACCUM_LOSS_PER_ADD
        return ROW_ERR_BOUND

    @staticmethod
    def setting_bytes(shape: PeerShape, setting: str) -> int:
        """The fewest bytes ``setting`` moves: packed E2M1 weights and their scales, the tokens (bf16, or E4M3
        plus an fp32 scale per 128), the bf16 output."""
        weights, fp8 = HUMMING_SETTINGS[setting]
        row = shape.k // 2 + -(-shape.k // HUMMING_WEIGHT_SCALE_BLOCK[weights])
        weight_bytes = shape.num_groups * shape.n * row
        if weights == "nvfp4":
            weight_bytes += shape.num_groups * HUMMING_TENSOR_SCALE_BYTES
        if fp8:
            token_bytes = shape.tokens * (shape.k * FP8_BYTES + -(-shape.k // HUMMING_FP8_GROUP) * ROW_SCALE_BYTES)
        else:
            token_bytes = shape.tokens * shape.k * BF16_BYTES
        return weight_bytes + token_bytes + shape.output_bytes()

    def useful_bytes(self, shape, fmt, our_useful_bytes):
        return min(self.setting_bytes(shape, s) for s in self.settings)

    def make_inputs(self, shape, fmt, our_useful_bytes, seed, settings=None):
        """Random bf16 tokens and weights (one draw for every setting), then per setting in ``settings`` (default
        all) a layer holding the weights as humming's quantizer and packing leave them, and its tokens."""
        torch = _torch()
        gen = _generator(seed)
        tokens = torch.randn((shape.tokens, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen)
        raw = torch.randn((shape.num_groups, shape.n, shape.k), dtype=torch.bfloat16, device="cuda", generator=gen)
        layout = np.concatenate(([0], shape.offsets())).astype(np.int64)   # E + 1 offsets
        per_setting = {setting: self._setting_inputs(shape, setting, tokens, raw)
                       for setting in (settings or self.settings)}
        del raw
        return {"settings": per_setting, "tokens_bf16": tokens, "expert_layout": torch.from_numpy(layout).to("cuda"),
                "group_sizes": shape.group_sizes, "n": shape.n, "k": shape.k}

    @staticmethod
    def _setting_inputs(shape, setting: str, tokens, raw) -> dict:
        torch = _torch()
        hk = _humming()
        weights, fp8 = HUMMING_SETTINGS[setting]
        layer = hk.HummingLayer(shape_n=shape.n, shape_k=shape.k,
                                weight_config=dict(HUMMING_WEIGHT_CONFIGS[weights]),
                                input_config=dict(HUMMING_FP8_INPUT_CONFIG) if fp8 else None,
                                num_experts=shape.num_groups, torch_dtype=getattr(torch, HUMMING_DTYPE)).cuda()
        layer.load_from_unquantized(raw)   # its quantizer
        quantized = {name: getattr(layer, name).detach().clone()   # before its packing: for the reference
                     for name in ("weight", "weight_scale", "weight_scale_2")
                     if getattr(layer, name, None) is not None}
        element_dtype = layer.weight_schema.b_dtype
        layer.transform()                  # its packing
        a, a_scale, m_major = tokens, None, False
        if fp8:
            config = layer.humming_config
            a, a_scale = hk.may_quant_input(config, tokens)   # its token quantizer: E4M3 + fp32 per 1x128
            m_major = bool(getattr(config, "use_block_scaled_mma", False)) and config.input_scale_group_size > 0
        return {"layer": layer, "a": a, "a_scale": a_scale, "m_major_scale": m_major,
                "quantized": quantized, "element_dtype": element_dtype, "weights": weights}

    def compile_ahead(self, shapes, workers: int) -> list[str]:
        """humming compiles a kernel (NVRTC, about half a minute each on the H200 host) on the first launch of each
        (setting, shape) its heuristics tell apart; the bench would wait for them one by one. Launch every
        (shape, setting) once first, in ``workers`` processes sharing humming's on-disk cache, so the bench's own
        (untimed) first launches find them compiled. Returns the failures (the bench's checks report them again)."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        tasks = [(shape, setting) for shape in dict.fromkeys(shapes) for setting in self.settings]
        if not tasks:
            return []
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(_humming_launch_once, tasks))
        return [f"{shape.n}x{shape.k} {shape.num_groups} groups [{setting}]: {why}"
                for (shape, setting), why in zip(tasks, outcomes) if why]

    def launch(self, inputs, setting=""):
        setting = setting or self.settings[0]
        if setting not in HUMMING_SETTINGS:
            raise ValueError(f"{self.name}: setting must be one of {self.settings}, got {setting!r}")
        entry = inputs["settings"][setting]
        return entry["layer"](entry["a"], input_scale=entry["a_scale"], expert_layout=inputs["expert_layout"],
                              compute_config=HUMMING_COMPUTE_CONFIG)

    # -- references ------------------------------------------------------------------------------
    @staticmethod
    def _tokens64(entry, k: int):
        """float64 tokens of a setting on the GPU: bf16 as they are, E4M3 times their fp32 scale per 1x128."""
        torch = _torch()
        a, scale = entry["a"], entry["a_scale"]
        values = _device64(a)
        if scale is None:
            return values
        if scale.dtype != torch.float32:
            raise ValueError(f"humming: expected fp32 token scales per 1x{HUMMING_FP8_GROUP}, got {scale.dtype}")
        rows, groups = a.shape[0], -(-k // HUMMING_FP8_GROUP)
        if entry["m_major_scale"]:   # (groups, rows rounded up to 4)
            scale = scale[:, :rows].transpose(0, 1)
        if tuple(scale.shape) != (rows, groups):
            raise ValueError(f"humming: token scales of shape {tuple(scale.shape)}, expected {(rows, groups)}")
        return values * scale.double().repeat_interleave(HUMMING_FP8_GROUP, dim=-1)[:, :k]

    @staticmethod
    def _weights64(entry, g: int, num_groups: int):
        """float64 (N, K) weights of expert ``g`` as humming's quantizer stored them: E2M1 element values (its
        own unpacking, no scale: exact in fp32) times the block scales, times NVFP4's scale per expert."""
        q = entry["quantized"]
        values = _humming().dequantize_weight(q["weight"][g], None, None, None, entry["element_dtype"], packed=True)
        values = values.double()
        scale = q["weight_scale"][g].float().double()
        values = values * scale.repeat_interleave(values.shape[-1] // scale.shape[-1], dim=-1)
        if "weight_scale_2" in q:
            s2 = q["weight_scale_2"].reshape(-1).double()
            if s2.numel() not in (1, num_groups):
                raise ValueError(f"humming: {s2.numel()} weight_scale_2 values for {num_groups} experts")
            values = values * s2[g if s2.numel() == num_groups else 0]
        return values

    def _reference_of(self, inputs, setting: str):
        entry = inputs["settings"][setting]
        groups = len(inputs["group_sizes"])
        return _grouped_device_reference(self._tokens64(entry, inputs["k"]),
                                         lambda g: self._weights64(entry, g, groups), inputs["group_sizes"])

    def device_reference(self, inputs):
        return {setting: self._reference_of(inputs, setting) for setting in self.settings}

    def setting_reference(self, reference, setting=""):
        return reference[setting or self.settings[0]]

    def reference(self, inputs):
        """The first setting's (the one ``launch`` runs by default) float64 result, the matmul done on the host."""
        entry = inputs["settings"][self.settings[0]]
        groups = len(inputs["group_sizes"])
        a = _host64(self._tokens64(entry, inputs["k"]))
        b = np.stack([_host64(self._weights64(entry, g, groups)) for g in range(groups)])
        return _grouped_reference(a, b, inputs["group_sizes"])


@functools.lru_cache(maxsize=None)
def _humming():
    """The parts of humming-kernels the peer uses; raises (ImportError, or what its import raises) where it
    cannot load. Imported on first use: it imports torch, triton and the CUDA bindings."""
    from types import SimpleNamespace

    from humming.forward import may_quant_input
    from humming.layer import HummingLayer
    from humming.utils.weight import dequantize_weight

    return SimpleNamespace(HummingLayer=HummingLayer, may_quant_input=may_quant_input,
                           dequantize_weight=dequantize_weight)


def _humming_launch_once(task) -> str:
    """One (shape, setting) of ``HummingPeer.compile_ahead`` in a worker process: build, launch, sync; the
    error as text (empty when it ran)."""
    shape, setting = task
    try:
        peer = HummingPeer()
        inputs = peer.make_inputs(shape, "", 0, seed=0, settings=(setting,))
        peer.launch(inputs, setting)
        _torch().cuda.synchronize()
        return ""
    except Exception as err:   # reported by the caller; the bench's own check fails it again
        return describe_error(err)


def _mx_values(codes, scale_bytes, element: str) -> np.ndarray:
    """float64 values of MX operand bytes (elements x their UE8M0 block scales), on the host."""
    codes = codes.cpu().numpy()
    if element == "e2m1":
        codes = unpack_fp4(codes)
    values = decode_elements(codes, element).astype(np.float64)
    exponents = scale_bytes.cpu().numpy().astype(np.int64) - UE8M0_BIAS
    return values * np.repeat(np.ldexp(1.0, exponents), TRITON_SCALE_BLOCK, axis=-1)


def _mx_values_device(codes, scale_bytes, element: str):
    """``_mx_values`` on the GPU with torch: float64 values of MX operand bytes (FP4 two per byte, low
    nibble first) times their UE8M0 block-32 scales."""
    torch = _torch()
    if element == "e2m1":
        table = torch.from_numpy(decode_elements(np.arange(16, dtype=np.uint8), "e2m1").astype(np.float64))
        table = table.to(codes.device)
        low, high = table[(codes & 0x0F).long()], table[(codes >> 4).long()]
        values = torch.stack((low, high), dim=-1).flatten(-2)
    else:
        dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
        values = _device64(codes.view(dtype))
    scales = torch.exp2(scale_bytes.double() - UE8M0_BIAS)
    return values * scales.repeat_interleave(TRITON_SCALE_BLOCK, dim=-1)


# Bound by ``_triton_group_kernel`` on first use: Triton's JIT resolves the names a kernel uses
# through the module's globals, so ``tl`` must be one (importing Triton here would cost every
# ``python -m gbs`` command a second, and fail on machines without it).
triton = tl = None


@functools.lru_cache(maxsize=None)
def _triton_group_kernel():
    """The Triton kernel of one group; ImportError when Triton is not installed."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def dot_scaled_group(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, m, n, k,
                         stride_am, stride_a_scale_m, stride_bn, stride_b_scale_n, stride_cm,
                         A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[m, n] = sum_k A[m, k] B[n, k] of one group: A (m, K) tokens and B (N, K) weights, both
        K-major (FP4 two per byte), with (rows, K/32) UE8M0 scale bytes; bf16 out, rows >= m masked."""
        A_PACK: tl.constexpr = 2 if A_FORMAT == "e2m1" else 1
        B_PACK: tl.constexpr = 2 if B_FORMAT == "e2m1" else 1
        SCALES_PER_BLOCK_K: tl.constexpr = BLOCK_K // 32
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < m
        offs_ak = tl.arange(0, BLOCK_K // A_PACK)
        offs_bk = tl.arange(0, BLOCK_K // B_PACK)
        offs_sk = tl.arange(0, SCALES_PER_BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_ak[None, :]
        b_ptrs = b_ptr + offs_bk[:, None] + offs_n[None, :] * stride_bn   # (K slice, N): B read transposed
        a_scale_ptrs = a_scale_ptr + offs_m[:, None] * stride_a_scale_m + offs_sk[None, :]
        b_scale_ptrs = b_scale_ptr + offs_n[:, None] * stride_b_scale_n + offs_sk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, tl.cdiv(k, BLOCK_K)):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
            a_scale = tl.load(a_scale_ptrs, mask=row_ok[:, None], other=0)
            b = tl.load(b_ptrs)
            b_scale = tl.load(b_scale_ptrs)
            acc = tl.dot_scaled(a, a_scale, A_FORMAT, b, b_scale, B_FORMAT, acc)
            a_ptrs += BLOCK_K // A_PACK
            b_ptrs += BLOCK_K // B_PACK
            a_scale_ptrs += SCALES_PER_BLOCK_K
            b_scale_ptrs += SCALES_PER_BLOCK_K
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(tl.bfloat16), mask=row_ok[:, None] & (offs_n[None, :] < n))

    return dot_scaled_group


PEER_CLASSES: dict[str, type[Peer]] = {cls.name: cls for cls in (TorchBf16Peer, TorchFp8RowwisePeer,
                                                                 TritonDotScaledPeer, HummingPeer, CopyPeer)}


def load_peers(names=PEER_NAMES) -> tuple[list[Peer], dict[str, str]]:
    """The peers of ``names`` that can run here, and the reason for each one that cannot."""
    unknown = [n for n in names if n not in PEER_CLASSES]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; expected some of {list(PEER_NAMES)}")
    peers, skipped = [], {}
    try:
        torch = _torch()
    except ImportError as err:
        return [], {name: f"torch is not installed ({err})" for name in names}
    if not torch.cuda.is_available():
        return [], {name: "torch sees no CUDA GPU" for name in names}
    capability = torch.cuda.get_device_capability()
    for name in names:
        if name == "torch_fp8_rowwise" and capability not in ((9, 0), (10, 0)):
            skipped[name] = (f"torch._scaled_grouped_mm runs on compute capability 9.0 / 10.0 only, "
                             f"this GPU is {capability}")
            continue
        if name == "humming":
            try:
                _humming()
            except Exception as err:   # ImportError where it is not installed; its import also loads CUDA bindings
                skipped[name] = f"humming-kernels could not be imported ({type(err).__name__}: {err})"
                continue
        if name == "triton_dot_scaled":
            try:
                _triton_group_kernel()
            except ImportError as err:
                skipped[name] = f"triton is not installed ({err})"
                continue
        peers.append(PEER_CLASSES[name]())
    return peers, skipped


@dataclass(frozen=True)
class PeerCheck:
    peer: str
    fmt: str
    passed: bool
    max_rel: float
    rms_rel: float
    message: str

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict} {self.peer} ({self.fmt}): {self.message}"


def check_peer(peer: Peer, fmt: str) -> PeerCheck:
    """Run ``peer`` once on the small check shape and compare with the float64 reference of its own
    inputs (max rel <= 1e-2, RMS rel <= 4e-3, no NaN: every output written). The Triton peer is
    checked with both of its token tiles. Errors are a FAIL with the message, never an exception."""
    shape = PeerShape(CHECK_N, CHECK_K, CHECK_GROUP_SIZES)
    block_ms = (TRITON_SMALL_BLOCK_M, TRITON_LARGE_BLOCK_M) if isinstance(peer, TritonDotScaledPeer) else (None,)
    worst = (0.0, 0.0)
    try:
        for block_m in block_ms:
            extra = {} if block_m is None else {"block_m": block_m}
            inputs = peer.make_inputs(shape, fmt, our_useful_bytes=1 << 20, seed=CHECK_SEED, **extra)
            out = peer.launch(inputs)
            got = _host64(out)
            errors = relative_errors(got, peer.reference(inputs))
            worst = (max(worst[0], errors[0]), max(worst[1], errors[1]))
    except Exception as err:   # a broken peer call must not stop the benchmark
        return PeerCheck(peer.name, fmt, False, float("inf"), float("inf"), describe_error(err))
    passed = worst[0] <= MAX_REL_TOL and worst[1] <= RMS_REL_TOL
    return PeerCheck(peer.name, fmt, passed, worst[0], worst[1],
                     f"max rel {worst[0]:.2e}, rms rel {worst[1]:.2e} vs float64 "
                     f"(limits {MAX_REL_TOL:g} / {RMS_REL_TOL:g})")


def check_at_shape(peer: Peer, inputs, reference, setting: str = "") -> OutputCheck:
    """Launch ``peer`` once on ``inputs`` with ``setting`` and compare its output, row by row, with
    ``reference`` (``Peer.device_reference`` of the same inputs) within ``Peer.row_err_bound``."""
    got = _host64(peer.launch(inputs, setting))
    reference = peer.setting_reference(reference, setting)
    return check_output(got, _host64(reference), bound=peer.row_err_bound(setting, int(inputs.get("k", 0))))


def free_cached_memory() -> None:
    """Hand torch's cached blocks back to the driver (our kernels allocate through Numba)."""
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Dense matmul peaks
# ----------------------------------------------------------------------------------------------
def dense_peak_input_bytes(kind: str, size: int = DENSE_PEAK_SIZE) -> int:
    if kind not in DENSE_PEAK_KINDS:
        raise ValueError(f"kind must be one of {DENSE_PEAK_KINDS}, got {kind!r}")
    return 2 * size * size * (BF16_BYTES if kind == "bf16" else FP8_BYTES)


def dense_peak_launcher(kind: str, copies: int, size: int = DENSE_PEAK_SIZE):
    """(launch(i), flops): a ``size``^3 matmul on input set ``i % copies`` of random data:
    ``torch.matmul`` in bf16, or ``torch._scaled_mm`` on E4M3 with per-tensor scales."""
    if kind not in DENSE_PEAK_KINDS:
        raise ValueError(f"kind must be one of {DENSE_PEAK_KINDS}, got {kind!r}")
    torch = _torch()
    gen = _generator(CHECK_SEED)
    sets = []
    for _ in range(copies):
        a = torch.randn((size, size), dtype=torch.bfloat16, device="cuda", generator=gen)
        b = torch.randn((size, size), dtype=torch.bfloat16, device="cuda", generator=gen)
        if kind == "fp8":
            a = a.to(torch.float8_e4m3fn)
            b = b.to(torch.float8_e4m3fn).t()   # _scaled_mm takes mat2 column-major
        sets.append((a, b))
    one = torch.ones((), dtype=torch.float32, device="cuda")
    if kind == "bf16":
        def launch(i):
            a, b = sets[i % copies]
            return torch.matmul(a, b)
    else:
        def launch(i):
            a, b = sets[i % copies]
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    return launch, 2 * size ** 3
