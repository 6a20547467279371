"""The H200 kernels' knobs as the tests name them, run through ``gbs.plan`` constraints and ``h200_launch``
(test data, not a library type: the library has the SM100 decision and one resolved plan per kernel)."""
from __future__ import annotations

from typing import NamedTuple

from gbs.dispatch import AUTO_STAGES
from gbs.numba_kernels import h200_launch
from gbs.plan import plan_h200

CONSUMER_WARPS_SMALL_N = 4


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
