"""The H200 kernels' knobs as the tests name them, run through ``gbs.plan`` constraints and ``h200_launch``
(test data, not a library type: the library has the SM100 decision and one resolved plan per kernel)."""
from __future__ import annotations

from typing import NamedTuple

from gbs.dispatch import AUTO_STAGES
from gbs.formats import get_format
from gbs.numba_kernels import h200_launch
from gbs.numba_kernels.h200_ring import CONSUMER_WARPS_SMALL_N
from gbs.plan import plan_h200
from gbs.problem import PROBLEM_FORMATS

# The problem formats with block-scaled tokens: what the streaming kernel and the wgmma kernel's decoding consumers
# read (bf16 tokens, W4A16, have their own consumer: tests/test_w4a16_kernel.py)
SCALED_TOKEN_FORMATS = tuple(f for f, (a, _) in PROBLEM_FORMATS.items() if get_format(a).scaled)


class Stream(NamedTuple):
    """The streaming kernel's knobs."""

    ab_swapped: bool
    mma_bn: int
    cta_group: int
    stages: int = AUTO_STAGES
    small_n_warps: int = CONSUMER_WARPS_SMALL_N

    backend = "h200_stream"

    def plan(self, problem, **launch):
        return plan_h200(problem, backend=self.backend, **self._asdict(), **launch)


class Wgmma(NamedTuple):
    """The wgmma kernel's knobs."""

    mma_bn: int = 256
    stages: int = AUTO_STAGES
    tile_tokens: int = 128
    ab_swapped: bool = False

    backend = "h200_wgmma"

    def plan(self, problem, **launch):
        return plan_h200(problem, backend=self.backend, **self._asdict(), **launch)


def run(problem, knobs, out=None, **launch):
    """``knobs`` on a host problem (``k_splits`` / ``num_ctas`` / ``trace`` as plan constraints)."""
    return h200_launch.run(problem, knobs.plan(problem, **launch), out)


def prepare(device_problem, knobs, out=None, *, stream=0, **launch):
    """``knobs`` prepared on a ``launch.DeviceProblem``."""
    return h200_launch.prepare(device_problem, knobs.plan(device_problem, **launch), out, stream=stream)


def one_stage_spec(a_format: str, b_format: str, knobs):
    """``knobs``' build with one stage (what the stage questions take)."""
    from gbs.numba_kernels.h200_ring import StreamSpec
    from gbs.numba_kernels.h200_wgmma import WgmmaSpec

    if isinstance(knobs, Wgmma):
        return WgmmaSpec(a_format, b_format, knobs.mma_bn, 1, tile_tokens=knobs.tile_tokens,
                         ab_swapped=knobs.ab_swapped)
    return StreamSpec(a_format, b_format, knobs.ab_swapped, knobs.mma_bn, knobs.cta_group, 1,
                      small_n_warps=knobs.small_n_warps)


def max_stages(a_format: str, b_format: str, knobs) -> int:
    """The deepest ring of ``knobs``' build that fits the H200."""
    return h200_launch.max_pipeline_stages(one_stage_spec(a_format, b_format, knobs))


def can_implement(problem, knobs) -> tuple[bool, str]:
    """(True, "") if ``knobs`` plan for ``problem``, else (False, the reason)."""
    try:
        knobs.plan(problem)
    except (TypeError, ValueError) as err:
        return False, str(err)
    return True, ""


def plan_spec(problem, knobs, backend: str = "h200_stream"):
    """The build ``knobs`` (test knobs, or anything else ``gbs.plan.plan_h200`` takes as a config) plan for
    ``problem`` (its checks raise as the launch's would)."""
    if isinstance(knobs, (Stream, Wgmma)):
        return knobs.plan(problem).spec
    return plan_h200(problem, knobs, backend).spec


def check_kernel(problem, out, ref, kernel: str):
    """``out`` (skipped rows holding the poison sentinel) judged by what ``kernel`` guarantees
    (``gbs.exactness.check_output``): bit-identical to the reference wherever the accumulation is exact in any
    order, every element within the tensor-core bound, skipped rows untouched, written rows written."""
    from gbs import exactness

    return exactness.check_output(problem, out, kernel, ref=ref)
