"""Shared case generators of the FP8 routes' tests (``test_fp8_route_kernel``, ``test_fp8_folded``,
``test_fold_device``): Gaussian problems on ragged groups, and problems with their scale bytes replaced. Host code
only (no kernel imports: the device fold's simulator worker imports it too)."""
from __future__ import annotations

import dataclasses

import numpy as np

from gbs.formats import swizzle_scales, unswizzle_scales
from gbs.problem import build_problem

GROUP_SIZES = (5, 0, 1, 37, 3, 70, 129, 300)   # empty group, -1 slot, 1 token, > 256, not tile multiples
EXPERT_IDS = (0, 4, 1, -1, 2, 5, 3, 6)


def gaussian_problem(n: int, k: int, seed: int, group_sizes=GROUP_SIZES, expert_ids=EXPERT_IDS, experts: int = 8,
                     fmt: str = "mxfp4"):
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((sum(group_sizes), k)).astype(np.float32)
    weights = rng.standard_normal((experts, n, k)).astype(np.float32)
    return build_problem(tokens, weights, list(group_sizes), list(expert_ids), fmt=fmt)


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
