"""The shared tile walk (gbs.schedule): tile shapes, coverage, order, random access, CTA assignment.

Every legal (ab_swapped, mma_bn, cta_group) of the SM100 dispatch is walked over hand-made
routings (empty groups, -1 slots, 1-token groups, groups that are not tile multiples, N that is
not a tile multiple) and generated ones. The device versions of the walk are checked against the
host in Numba's CUDA simulator (a subprocess: the simulator is chosen when numba is imported) and
compiled offline for sm_90a and sm_100a.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types as pytypes
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from gbs import schedule as s
from gbs.dispatch import LEGAL_MMA_BN, grouped_matmul_nvfp4_dispatch
from gbs.problem import make_routing

REPO = Path(__file__).resolve().parents[1]


def enumerate_configs():
    """Every legal knob set: swapped with cta_group 1 and 2, not swapped with cta_group 1."""
    for cta_group, mma_bns in LEGAL_MMA_BN.items():
        for mma_bn in mma_bns:
            yield s.TileConfig(True, mma_bn, cta_group)
            if cta_group == 1:
                yield s.TileConfig(False, mma_bn, cta_group)


CONFIGS = list(enumerate_configs())


def enumerate_routings():
    """(name, group_sizes, expert_ids)."""
    yield "mixed", [0, 37, 1, 5, 130, 0, 9], [3, 1, 7, -1, 2, 5, 0]
    yield "all-skipped-or-empty", [4, 0, 3], [-1, 2, -1]
    yield "one-token", [1], [0]
    yield "exact-multiples", [128, 256, 8], [0, 1, 2]
    for seed in range(3):
        r = make_routing(num_experts=16, total_tokens=300, num_active_experts=6, routing="ragged",
                         num_empty=2, num_skipped=2, seed=seed)
        yield f"ragged{seed}", r.group_sizes.tolist(), r.expert_ids.tolist()


ROUTINGS = list(enumerate_routings())
N_VALUES = (40, 128, 300)


def offsets(group_sizes):
    return np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.uint32)


def live_mask(group_sizes, expert_ids):
    """Boolean per token: does its slot produce output?"""
    return np.repeat(np.asarray(expert_ids) >= 0, group_sizes)


def config_id(c):
    return f"{'swap' if c.ab_swapped else 'noswap'}-bn{c.mma_bn}-cg{c.cta_group}"


# ----------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_tile_shape_follows_the_orientation(config):
    shape = s.TileShape.from_config(config)
    m_side = 128 * config.cta_group
    if config.ab_swapped:
        assert (shape.tokens, shape.weight_rows) == (config.mma_bn, m_side)
    else:
        assert (shape.tokens, shape.weight_rows) == (m_side, config.mma_bn)
    assert shape.cta_group == config.cta_group
    if config.cta_group == 2:
        assert shape.cta_weight_rows == 128 and shape.cta_tokens == config.mma_bn // 2


def test_tile_shape_from_a_dispatch_config():
    kimi = grouped_matmul_nvfp4_dispatch(n=512, k=7168, num_active_experts=8, estimated_total_m=16)
    assert (kimi.ab_swapped, kimi.mma_bn, kimi.cta_group) == (True, 64, 2)
    assert s.TileShape.from_config(kimi) == s.TileShape(tokens=64, weight_rows=256, cta_group=2)
    assert s.TileConfig.of(kimi) == s.TileConfig(True, 64, 2)


@pytest.mark.parametrize("knobs, match", [
    ((True, 8, 2), "mma_bn=8 is illegal with cta_group=2"),
    ((True, 24, 1), "mma_bn=24 is illegal"),
    ((False, 128, 2), "cta_group=2 requires ab_swapped=True"),
    ((True, 64, 4), "cta_group must be one of"),
])
def test_illegal_knobs_are_rejected(knobs, match):
    with pytest.raises(ValueError, match=match):
        s.TileConfig(*knobs)
    with pytest.raises(ValueError, match=match):
        s.TileShape.from_config(pytypes.SimpleNamespace(ab_swapped=knobs[0], mma_bn=knobs[1], cta_group=knobs[2]))


def test_bad_types_are_rejected():
    with pytest.raises(TypeError, match="lacks"):
        s.TileConfig.of({"ab_swapped": True, "mma_bn": 8, "cta_group": 1})
    with pytest.raises(TypeError, match="ab_swapped must be a bool"):
        s.TileConfig(1, 8, 1)
    with pytest.raises(ValueError, match="positive int"):
        s.TileShape(0, 128)
    with pytest.raises(ValueError, match="cannot be split"):
        s.TileShape(8, 129, cta_group=2)
    shape = s.TileShape(8, 128)
    with pytest.raises(ValueError, match="len\\(expert_ids\\) \\+ 1"):
        s.total_tiles([0, 4], [0, 1], 64, shape)
    with pytest.raises(ValueError, match="non-decreasing"):
        s.total_tiles([0, 4, 2], [0, 1], 64, shape)
    with pytest.raises(TypeError, match="TileShape"):
        s.total_tiles([0, 4], [0], 64, (8, 128))
    with pytest.raises(ValueError, match="n must be"):
        s.total_tiles([0, 4], [0], 0, shape)


# ------------------------------------------------------------------------------------------- walk
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("name, sizes, experts", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_walk_covers_every_live_output_exactly_once(config, name, sizes, experts):
    shape = s.TileShape.from_config(config)
    a_offsets = offsets(sizes)
    for n in N_VALUES:
        covered = np.zeros((int(a_offsets[-1]), n), np.int64)
        tiles = list(s.iter_tiles(a_offsets, experts, n, shape))
        for t in tiles:
            assert experts[t.slot] >= 0 and sizes[t.slot] > 0, "tile for a skipped or empty slot"
            assert t.expert == experts[t.slot]
            assert a_offsets[t.slot] <= t.token_start < t.token_end <= a_offsets[t.slot + 1]
            assert 0 <= t.row_start < t.row_end <= n
            assert t.num_tokens <= shape.tokens and t.num_rows <= shape.weight_rows
            # clipped only at the group's end / at N
            assert t.num_tokens == shape.tokens or t.token_end == a_offsets[t.slot + 1]
            assert t.num_rows == shape.weight_rows or t.row_end == n
            covered[t.token_start:t.token_end, t.row_start:t.row_end] += 1
        expected = np.broadcast_to(live_mask(sizes, experts)[:, None], covered.shape).astype(np.int64)
        np.testing.assert_array_equal(covered, expected)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("name, sizes, experts", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_walk_order_counts_and_random_access(config, name, sizes, experts):
    shape = s.TileShape.from_config(config)
    a_offsets = offsets(sizes)
    n = 300
    tiles = list(s.iter_tiles(a_offsets, experts, n, shape))
    counts = s.slot_tile_counts(a_offsets, experts, n, shape)
    row_blocks = -(-n // shape.weight_rows)
    for slot, (size, expert) in enumerate(zip(sizes, experts)):
        want = 0 if expert < 0 else -(-size // shape.tokens) * row_blocks
        assert counts[slot] == want
    assert s.total_tiles(a_offsets, experts, n, shape) == len(tiles) == counts.sum()
    assert [t.index for t in tiles] == list(range(len(tiles)))
    # slot order, then M-major inside a slot: (n_blk, m_blk) increases lexicographically
    keys = [(t.slot, t.n_blk, t.m_blk) for t in tiles]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for t in tiles:
        mb = -(-sizes[t.slot] // shape.tokens)
        first = int(np.sum(counts[:t.slot]))
        assert t.index - first == t.n_blk * mb + t.m_blk
        assert t.token_start == a_offsets[t.slot] + t.m_blk * shape.tokens
        assert t.row_start == t.n_blk * shape.weight_rows
    for t in tiles:
        assert s.tile_at(t.index, a_offsets, experts, n, shape) == t
    assert s.tile_at(len(tiles), a_offsets, experts, n, shape) is None


def test_known_walk():
    """A walk written out by hand: tokens 8, rows 128, N 200 -> 2 row blocks."""
    sizes, experts = [10, 0, 3, 4], [2, 5, -1, 0]
    tiles = list(s.iter_tiles(offsets(sizes), experts, 200, s.TileShape(8, 128)))
    got = [(t.slot, t.m_blk, t.n_blk, t.token_start, t.token_end, t.row_start, t.row_end) for t in tiles]
    assert got == [
        (0, 0, 0, 0, 8, 0, 128), (0, 1, 0, 8, 10, 0, 128),
        (0, 0, 1, 0, 8, 128, 200), (0, 1, 1, 8, 10, 128, 200),
        (3, 0, 0, 13, 17, 0, 128), (3, 0, 1, 13, 17, 128, 200),
    ]


# ------------------------------------------------------------------------------------------- CTAs
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.mma_bn in (8, 64, 256)], ids=config_id)
@pytest.mark.parametrize("num_pairs", [1, 3, 148])
def test_cta_assignment(config, num_pairs):
    shape = s.TileShape.from_config(config)
    name, sizes, experts = ROUTINGS[0]
    a_offsets = offsets(sizes)
    n = 300
    num_ctas = num_pairs * config.cta_group
    tiles = list(s.iter_tiles(a_offsets, experts, n, shape))
    work = s.assign_tiles(num_ctas, a_offsets, experts, n, shape)
    assert len(work) == num_ctas
    covered = np.zeros((int(a_offsets[-1]), n), np.int64)
    for cta, items in enumerate(work):
        pair, rank = divmod(cta, config.cta_group)
        assert [w.tile.index for w in items] == list(range(pair, len(tiles), num_pairs))
        for w in items:
            assert (w.cta, w.rank) == (cta, rank)
            assert (w.token_start, w.token_end) == (w.tile.token_start, w.tile.token_end)
            lo = min(w.tile.row_start + rank * shape.cta_weight_rows, w.tile.row_end)
            assert (w.row_start, w.row_end) == (lo, min(lo + shape.cta_weight_rows, w.tile.row_end))
            covered[w.token_start:w.token_end, w.row_start:w.row_end] += 1
    expected = np.broadcast_to(live_mask(sizes, experts)[:, None], covered.shape).astype(np.int64)
    np.testing.assert_array_equal(covered, expected)
    if config.cta_group == 2:
        # The two CTAs of a pair stage disjoint halves of the token tile that together cover it.
        for even, odd in zip(work[0::2], work[1::2]):
            for a, b in zip(even, odd):
                assert a.tile == b.tile
                assert a.staged_token_start == a.tile.token_start
                assert a.staged_token_end == b.staged_token_start
                assert b.staged_token_end == a.tile.token_end
                assert a.staged_token_end - a.staged_token_start <= shape.cta_tokens


def test_rank_one_of_a_pair_past_n_writes_nothing():
    shape = s.TileShape.from_config(s.TileConfig(True, 64, 2))
    (tile,) = s.iter_tiles(offsets([5]), [0], 100, shape)
    first, second = s.cta_work(tile, 0, shape), s.cta_work(tile, 1, shape)
    assert (first.row_start, first.row_end) == (0, 100)
    assert second.row_start == second.row_end == 100


@pytest.mark.parametrize("num_ctas, cta_group, match", [
    (3, 2, "multiple of cta_group=2"),
    (0, 1, "positive int"),
    (2.0, 1, "positive int"),
])
def test_bad_num_ctas(num_ctas, cta_group, match):
    with pytest.raises(ValueError, match=match):
        s.check_num_ctas(num_ctas, cta_group)


def test_pair_tile_indices_checks_the_cta():
    assert s.pair_tile_indices(5, 8, 20, 2) == range(2, 20, 4)
    with pytest.raises(ValueError, match="cta must be in"):
        s.pair_tile_indices(8, 8, 20, 2)


# ---------------------------------------------------------------------------------- device side
_SIMULATOR_SCRIPT = r"""
import json, sys
import numpy as np
from numba import cuda
from gbs import schedule as s

case = json.loads(sys.argv[1])
walk = s.device_functions()
locate, cta_rows = walk.locate_tile, walk.cta_output_rows
tokens, rows, cta_group = case["tokens"], case["rows"], case["cta_group"]

@cuda.jit
def kernel(a_offsets, expert_ids, n, out):
    t = cuda.grid(1)
    if t < out.shape[0]:
        fields = locate(t, a_offsets, expert_ids, n, tokens, rows)
        for i in range(8):
            out[t, i] = fields[i]
        for rank in range(cta_group):
            lo, hi = cta_rows(fields[6], fields[7], rank, cta_group, rows)
            out[t, 8 + 2 * rank] = lo
            out[t, 9 + 2 * rank] = hi

a_offsets = np.array(case["a_offsets"], np.int64)
expert_ids = np.array(case["expert_ids"], np.int32)
out = np.zeros((case["count"], 12), np.int64)
kernel[1, case["count"]](a_offsets, expert_ids, case["n"], out)
print(json.dumps(out.tolist()))
"""


def host_device_rows(a_offsets, experts, n, shape, count):
    """What the simulated kernel must write: locate_tile fields, then each rank's output rows."""
    rows = []
    for t in range(count):
        tile = s.tile_at(t, a_offsets, experts, n, shape)
        if tile is None:
            fields = [-1, -1, 0, 0, 0, 0, 0, 0]
        else:
            fields = [tile.slot, tile.expert, tile.m_blk, tile.n_blk, tile.token_start, tile.token_end,
                      tile.row_start, tile.row_end]
        halves = [0, 0, 0, 0]
        for rank in range(shape.cta_group):
            lo, hi = s.cta_output_rows(fields[6], fields[7], rank, shape.cta_group, shape.weight_rows)
            halves[2 * rank:2 * rank + 2] = [lo, hi]
        rows.append(fields + halves)
    return rows


@pytest.mark.parametrize("config", [s.TileConfig(True, 8, 1), s.TileConfig(True, 64, 2), s.TileConfig(False, 16, 1)],
                         ids=config_id)
def test_device_walk_matches_host_in_the_simulator(config):
    shape = s.TileShape.from_config(config)
    name, sizes, experts = ROUTINGS[0]
    a_offsets = offsets(sizes)
    n = 300
    count = s.total_tiles(a_offsets, experts, n, shape) + 2   # two past the end
    case = dict(tokens=shape.tokens, rows=shape.weight_rows, cta_group=shape.cta_group, n=n, count=count,
                a_offsets=a_offsets.tolist(), expert_ids=experts)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _SIMULATOR_SCRIPT, json.dumps(case)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == host_device_rows(a_offsets, experts, n, shape, count)


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_device_walk_compiles_offline(target):
    from numba import config as numba_config
    from numba.cuda import types

    if numba_config.ENABLE_CUDASIM:
        pytest.skip("offline compilation needs numba without the simulator")
    from gbs.ptx_inline import offline

    cc = {"sm_90a": offline.SM90A, "sm_100a": offline.SM100A}[target]
    walk = s.device_functions()
    locate, cta_rows = walk.locate_tile, walk.cta_output_rows

    def kernel(a_offsets, expert_ids, n, out):
        t = cuda.grid(1)
        if t < out.shape[0]:
            fields = locate(t, a_offsets, expert_ids, n, 8, 256)
            lo, hi = cta_rows(fields[6], fields[7], 1, 2, 256)
            out[t] = fields[0] + fields[4] + lo + hi

    sig = (types.int64[::1], types.int32[::1], types.int64, types.int64[::1])
    ptx = offline.compile_ptx(kernel, sig, cc)
    assert f".target {target}" in ptx
