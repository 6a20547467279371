"""Shared case generators of the FP8 routes' tests (``test_fp8_route_kernel``, ``test_fp8_folded``,
``test_fold_device``): Gaussian problems on ragged groups, and problems with their scale bytes replaced. Host code
only (no kernel imports: the device fold's simulator worker imports it too)."""
from __future__ import annotations

import dataclasses

import numpy as np

from gbs.formats import swizzle_scales, unswizzle_scales
from gbs.fp8_route import KERNEL_WEIGHT_BASE_ROWS
from gbs.problem import build_problem

GROUP_SIZES = (5, 0, 1, 37, 3, 70, 129, 300)   # empty group, -1 slot, 1 token, > 256, not tile multiples
EXPERT_IDS = (0, 4, 1, -1, 2, 5, 3, 6)


def gaussian_problem(n: int, k: int, seed: int, group_sizes=GROUP_SIZES, expert_ids=EXPERT_IDS, experts: int = 8,
                     fmt: str = "mxfp4"):
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((sum(group_sizes), k)).astype(np.float32)
    weights = rng.standard_normal((experts, n, k)).astype(np.float32)
    return build_problem(tokens, weights, list(group_sizes), list(expert_ids), fmt=fmt)


def fold_tiles_apart(n: int, k: int, seed: int):
    """A Gaussian MXFP4 problem on ragged groups whose weight rows of 128-row tile t are scaled by 2^(3 t), so each
    fold tile (``gbs.fp8_route.fold_weights``) has its own base."""
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((sum(GROUP_SIZES), k)).astype(np.float32)
    weights = rng.standard_normal((8, n, k)).astype(np.float32)
    weights *= np.exp2(3.0 * (np.arange(n) // KERNEL_WEIGHT_BASE_ROWS)).astype(np.float32)[None, :, None]
    return build_problem(tokens, weights, list(GROUP_SIZES), list(EXPERT_IDS), fmt="mxfp4")


def with_scales(problem, a_linear=None, b_linear=None):
    """``problem`` with linear scale bytes replaced (tokens: (T, C), written into each group's 128-row bands;
    weights (E, N, C))."""
    changes = {}
    if b_linear is not None:
        changes["b_scales"] = swizzle_scales(b_linear.astype(np.uint8))
    if a_linear is not None:
        atoms = problem.a_scales.copy()
        for g, (lo, hi) in enumerate(zip(problem.a_offsets[:-1].tolist(), problem.a_offsets[1:].tolist())):
            if hi == lo:
                continue
            first = int(problem.a_scale_offsets[g])   # the group's first 128-row band
            bands = slice(first, first + -(-(hi - lo) // 128))
            band = unswizzle_scales(atoms[bands][None])[0]
            band[:hi - lo, :a_linear.shape[1]] = a_linear[lo:hi]
            atoms[bands] = swizzle_scales(band[None])[0]
        changes["a_scales"] = atoms
    return dataclasses.replace(problem, **changes)


def w4a8_window_edges(seed: int):
    """A W4A8 problem with a NaN-scale token block (its row NaN), a NaN token element, and weight blocks at d = 6
    and d = -8 of their 128-row tile's window."""
    problem = gaussian_problem(256, 1024, seed=seed, group_sizes=(70, 1, 200), expert_ids=(0, 1, 2), experts=3,
                               fmt="w4a8")
    a = problem.a_operand().scales.copy()
    b = unswizzle_scales(problem.b_scales, problem.n, 32).copy()
    b[:, :, 0::4] = 132
    b[:, 5, 2::4] = 132 - 14
    a[10, 9] = 0xFF
    edge = with_scales(problem, a_linear=a, b_linear=b)
    tokens = edge.a.copy()
    tokens.view(np.uint8)[40, 77] = 0x7F   # an E4M3 NaN element
    return dataclasses.replace(edge, a=tokens)


def window_edges(seed: int):
    """An MXFP4 problem with, per chunk, token rows whose blocks lie at d = 6 and d = -8 of their base (14 binades
    apart), weight tiles likewise (one row's block 14 below the tile's top), a NaN-scale token block and a NaN-scale
    weight block."""
    problem = gaussian_problem(256, 1024, seed=seed, group_sizes=(70, 1, 200), expert_ids=(0, 1, 2), experts=3)
    a = problem.a_operand().scales.copy()
    b = unswizzle_scales(problem.b_scales, problem.n, 32).copy()
    a[:, 0::4] = 130
    a[:, 1::4] = 130 - 14
    b[:, :, 0::4] = 132
    b[:, 5, 2::4] = 132 - 14
    a[10, 9] = 0xFF
    b[2, 17, 20] = 0xFF
    return with_scales(problem, a_linear=a, b_linear=b)
