"""The benchmark's problems: its cases (``BenchCase``, ``BENCH_CASES``), synthetic problems of any size
(``synthetic_problem``), and the useful work of a problem (``useful_flops``, ``useful_bytes``).

A case is one (N, K) with a number of expert slots and tokens per slot, uniform or ragged; its
problem is synthetic: random element codes and realistic scale bytes, built in seconds for any size.
``python -m gbs bench`` runs ``QUICK_CASES`` x ``QUICK_FORMATS`` with ``--quick``, every case x
``FULL_FORMATS`` otherwise; the sweep (``gbs.lab.sweep``), the performance model, the ablation rows and
the kernels' tests build their problems and count their work here too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import E4M3, group_scale_offsets, swizzle_scales
from ..problem import GroupedProblem, make_routing, operand_shape, resolve_formats

# ----------------------------------------------------------------------------------------------
# Synthetic problems and their useful work
# ----------------------------------------------------------------------------------------------
# Realistic scale bytes for synthetic problems: UE8M0 exponents near 1.0, UE4M3 values near the
# NVFP4 recipe's (amax_block / 6 * S_enc lands in [~16, 448]).
SYNTHETIC_UE8M0_RANGE = (120, 131)
SYNTHETIC_UE4M3_RANGE = (0x50, 0x7E)
# Distinct random bytes per synthetic operand; an odd count, so repeats never line up with rows.
SYNTHETIC_RANDOM_BYTES = 2 ** 24 - 1


def synthetic_problem(fmt: str, *, n: int, k: int, group_sizes, expert_ids, num_experts: int,
                      seed: int = 0) -> GroupedProblem:
    """A valid problem with random element codes and realistic scale bytes, built in seconds for
    any size (for timing; quantizing real weights of 64 DeepSeek experts takes minutes on a CPU).
    Random codes are never all zero and exercise every element value. An operand larger than
    ``SYNTHETIC_RANDOM_BYTES`` repeats one random block of that size (a kernel's time does not
    depend on the values, and drawing gigabytes on the host takes a minute)."""
    a_format, b_format = resolve_formats(fmt)
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int64)
    a_offsets = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.uint32)
    total = int(a_offsets[-1])

    def random_bytes(low, high, shape, fix=None):
        """Random bytes in [low, high) of ``shape``: one block drawn (then ``fix``ed in place), repeated."""
        block = rng.integers(low, high, min(int(np.prod(shape)), SYNTHETIC_RANDOM_BYTES), dtype=np.uint8)
        if fix is not None:
            fix(block)
        return np.resize(block, shape)

    def clear_e4m3_nans(raw):   # S.1111.111 -> S.1111.110 so timing sees numbers
        raw[(raw & 0x7F) == 0x7F] ^= np.uint8(0x01)

    def clear_e5m2_nans(raw):   # exponent 11111 -> 10111
        raw[(raw & 0x7C) == 0x7C] ^= np.uint8(0x40)

    def codes(fmt_, shape):
        if fmt_.packed:
            return random_bytes(0, 256, shape)
        if not fmt_.scaled:   # bf16 tokens: normal values (their bits would be NaN / Inf / huge for 1 in 256)
            block = rng.standard_normal(min(int(np.prod(shape)), SYNTHETIC_RANDOM_BYTES)).astype(fmt_.element_dtype)
            return np.resize(block, shape)
        fix = clear_e4m3_nans if fmt_.element_dtype == E4M3 else clear_e5m2_nans
        return random_bytes(0, 256, shape, fix).view(fmt_.element_dtype)

    def scale_bytes(fmt_, shape):
        return random_bytes(*(SYNTHETIC_UE4M3_RANGE if fmt_.scale_dtype == "ue4m3" else SYNTHETIC_UE8M0_RANGE), shape)

    a = codes(a_format, operand_shape(a_format, (total,), k))
    b = codes(b_format, operand_shape(b_format, (num_experts, n), k))
    a_cols, b_cols = a_format.scale_cols(k), b_format.scale_cols(k)
    bands = int(np.sum(-(-group_sizes // 128)))
    a_scales = swizzle_scales(scale_bytes(a_format, (bands * 128, a_cols)))
    b_scales = swizzle_scales(scale_bytes(b_format, (num_experts, n, b_cols)))
    expert_scales = rng.uniform(0.5, 2.0, num_experts).astype(np.float32)
    return GroupedProblem(
        a_format=a_format, b_format=b_format, a=a, b=b, a_scales=a_scales, b_scales=b_scales,
        a_offsets=a_offsets, a_scale_offsets=group_scale_offsets(a_offsets),
        expert_ids=np.asarray(expert_ids, np.int32), expert_scales=expert_scales,
        num_active_experts=int(group_sizes.size), estimated_total_m=total, n=n, k=k)


def useful_bytes(problem: GroupedProblem) -> int:
    """Bytes a grouped matmul must move at least: the active experts' weights and scales once, the
    live tokens and their scales once, the written output once (bf16)."""
    p = problem
    live = p.active_slots()
    experts = {int(p.expert_ids[g]) for g in live}
    tokens = int(sum(p.group_sizes[g] for g in live))
    b_row = p.b_format.row_bytes(p.k) + p.b_format.scale_cols(p.k)
    a_row = p.a_format.row_bytes(p.k) + p.a_format.scale_cols(p.k)
    return len(experts) * p.n * b_row + tokens * a_row + tokens * p.n * 2


def useful_flops(problem: GroupedProblem) -> int:
    tokens = int(sum(problem.group_sizes[g] for g in problem.active_slots()))
    return 2 * tokens * problem.n * problem.k


# ----------------------------------------------------------------------------------------------
# Cases: the table shapes
# ----------------------------------------------------------------------------------------------
BENCH_ROUTINGS = ("uniform", "ragged")   # gbs.problem.make_routing's, over exactly ``slots`` experts
BENCH_ROUTING_SEED = 0                    # a case's group sizes are fixed: the same problem in every run


@dataclass(frozen=True)
class BenchCase:
    """One benchmark shape, (N, K): ``slots`` experts with ``tokens_per_expert`` tokens each
    (``routing="uniform"``), or the same total drawn by ``make_routing``'s ``"ragged"`` (a few hot
    experts, many cold or empty ones: ``tokens_per_expert`` is then the average)."""

    name: str
    n: int
    k: int
    slots: int
    tokens_per_expert: int
    routing: str = "uniform"

    def __post_init__(self):
        if self.routing not in BENCH_ROUTINGS:
            raise ValueError(f"routing must be one of {BENCH_ROUTINGS}, got {self.routing!r}")

    @property
    def label(self) -> str:
        ragged = "" if self.routing == "uniform" else f" ({self.routing})"
        return f"{self.n}x{self.k} {self.slots}x{self.tokens_per_expert}{ragged}"

    @property
    def total_tokens(self) -> int:
        return self.slots * self.tokens_per_expert

    def group_sizes(self) -> np.ndarray:
        return make_routing(num_experts=self.slots, total_tokens=self.total_tokens, num_active_experts=self.slots,
                            routing=self.routing, seed=BENCH_ROUTING_SEED).group_sizes

    def problem(self, fmt: str, seed: int = 0) -> GroupedProblem:
        """A synthetic problem with one expert per slot (only live experts cost bytes anywhere)."""
        return synthetic_problem(fmt, n=self.n, k=self.k, group_sizes=self.group_sizes(),
                                 expert_ids=np.arange(self.slots), num_experts=self.slots, seed=seed)


BENCH_CASES: dict[str, BenchCase] = {c.name: c for c in (
    BenchCase("decode_up", 4096, 7168, 64, 4),            # DeepSeek-V3 up-projection, decode
    BenchCase("decode_down", 7168, 2048, 64, 4),          # DeepSeek-V3 down-projection, decode
    BenchCase("kimi_decode", 512, 7168, 8, 1),            # Kimi K2.5 TP-8 up-projection, one token each
    BenchCase("small_prefill_up", 4096, 7168, 32, 32),
    BenchCase("kimi_small_prefill", 512, 7168, 8, 32),    # Kimi TP-8 up-projection, 32 tokens each: 32 swapped tiles
    BenchCase("large_prefill_up", 4096, 7168, 8, 1024),
    BenchCase("large_prefill_down", 7168, 2048, 8, 1024),
    # the same 8192 tokens over 32 experts as a router spreads them: 0-1694 each, four empty (workloads.md:
    # "ragged loads (a few hot experts)"); the H200 plans see only the average (host metadata)
    BenchCase("large_prefill_ragged", 4096, 7168, 32, 256, routing="ragged"),
    # gpt-oss-120b (MXFP4 checkpoint, 128 experts, top-4): K = 2880 is 11 FP4 slices + 64, N = 2880 22 boxes + 64
    # rows; no caller padding (issue 31 item 4)
    BenchCase("gptoss_decode_up", 5760, 2880, 64, 4),
    BenchCase("gptoss_decode_down", 2880, 2880, 64, 4),
    BenchCase("gptoss_prefill_up", 5760, 2880, 32, 256),
    BenchCase("gptoss_prefill_down", 2880, 2880, 32, 256),
)}
QUICK_CASES = ("decode_up", "kimi_decode", "small_prefill_up", "large_prefill_up")
QUICK_FORMATS = ("nvfp4", "mxfp8")
FULL_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "w4a8", "w4a16", "w4a16_nvfp4")
