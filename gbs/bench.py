"""Benchmark harness: CUDA-event timing, the streaming-read ceiling, fast synthetic problems, CSV rows.

Rules (DEVELOPERS.md, METHOD.md): every timing is CUDA events around one launch, after warm-up,
repeated, reported as median / p10 / p90; inputs rotate over enough copies that the bytes of one
rotation exceed ``L2_ROTATION_FACTOR`` times the L2, so no launch reads what the previous one left
in L2; the ceilings (streaming read) are measured in the same process as the kernels.

``python -m gbs bench --quick`` runs the short benchmark of the GPU runner (``scripts/gpu_run.sh``).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import subprocess
from dataclasses import dataclass

import numpy as np

from .problem import GroupedProblem, operand_shape, resolve_formats
from .quant import E4M3, group_scale_offsets, swizzle_scales

L2_ROTATION_FACTOR = 4          # one rotation of inputs spans 4x the L2
H200_L2_BYTES = 60 * 2 ** 20    # nvidia-h200: 60 MB of L2 (KINDS.md); read off the device when possible
WARMUP_LAUNCHES = 5
TIMED_LAUNCHES = 50
READ_CEILING_BYTES = 4 * 2 ** 30
READ_THREADS_PER_BLOCK = 256
READ_BLOCKS_PER_SM = 8          # 4-8 blocks of 256 per SM reached 4.30 TB/s (kernels.md)
READ_LOADS_IN_FLIGHT = 4        # 16-byte loads issued per thread before the first use

# Realistic scale bytes for synthetic problems: UE8M0 exponents near 1.0, UE4M3 values near the
# NVFP4 recipe's (amax_block / 6 * S_enc lands in [~16, 448]).
SYNTHETIC_UE8M0_RANGE = (120, 131)
SYNTHETIC_UE4M3_RANGE = (0x50, 0x7E)


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    launches: int


def time_launches(launch, *, num_inputs: int = 1, warmup: int = WARMUP_LAUNCHES,
                  reps: int = TIMED_LAUNCHES) -> Timing:
    """Time ``launch(i)`` (i = input set, rotating over ``num_inputs``) with CUDA events, one pair
    of events per launch, after ``warmup`` untimed launches."""
    from numba import cuda

    for i in range(warmup):
        launch(i % num_inputs)
    cuda.synchronize()
    starts = [cuda.event() for _ in range(reps)]
    ends = [cuda.event() for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        launch((warmup + i) % num_inputs)
        ends[i].record()
    ends[-1].synchronize()
    times_us = np.array([cuda.event_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends)])
    return Timing(float(np.median(times_us)), float(np.percentile(times_us, 10)),
                  float(np.percentile(times_us, 90)), reps)


def rotation_count(bytes_per_input: int, l2_bytes: int = H200_L2_BYTES) -> int:
    """Input copies needed so that one rotation spans ``L2_ROTATION_FACTOR`` x the L2."""
    return max(1, -(-L2_ROTATION_FACTOR * l2_bytes // max(1, bytes_per_input)))


def device_l2_bytes() -> int:
    from numba import cuda

    attr = getattr(cuda.get_current_device(), "L2_CACHE_SIZE", None)
    return int(attr) if attr else H200_L2_BYTES


def _read_kernel():
    """Streaming read: each thread keeps ``READ_LOADS_IN_FLIGHT`` 16-byte ``ld.global.nc`` loads in
    flight and XORs them; one word per thread goes out so the loads are not dead."""
    from numba import cuda

    from .ptx_inline.copy import ld_global_nc_v4_u32

    in_flight = READ_LOADS_IN_FLIGHT

    @cuda.jit
    def read_all(src_u32x4, base_address, sink):
        n_vec = src_u32x4.shape[0]
        tid = cuda.grid(1)
        stride = cuda.gridsize(1)
        acc = np.uint32(0)
        i = tid
        while i + (in_flight - 1) * stride < n_vec:
            w0 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i))
            w1 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + stride))
            w2 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + 2 * stride))
            w3 = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i + 3 * stride))
            acc ^= w0[0] ^ w0[1] ^ w0[2] ^ w0[3] ^ w1[0] ^ w1[1] ^ w1[2] ^ w1[3]
            acc ^= w2[0] ^ w2[1] ^ w2[2] ^ w2[3] ^ w3[0] ^ w3[1] ^ w3[2] ^ w3[3]
            i += in_flight * stride
        while i < n_vec:
            w = ld_global_nc_v4_u32(base_address + np.uint64(16) * np.uint64(i))
            acc ^= w[0] ^ w[1] ^ w[2] ^ w[3]
            i += stride
        sink[tid] = acc

    return read_all


def measure_read_bandwidth(nbytes: int = READ_CEILING_BYTES) -> tuple[float, Timing]:
    """Streaming-read ceiling of this GPU in TB/s (bytes read / median time), and its timing."""
    from numba import cuda

    vec = nbytes // 16
    src = cuda.to_device(np.random.default_rng(0).integers(0, 2 ** 32, (vec, 4), dtype=np.uint32))
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks = sms * READ_BLOCKS_PER_SM
    sink = cuda.device_array(blocks * READ_THREADS_PER_BLOCK, np.uint32)
    kernel = _read_kernel()
    base = np.uint64(src.__cuda_array_interface__["data"][0])
    timing = time_launches(lambda i: kernel[blocks, READ_THREADS_PER_BLOCK](src, base, sink), reps=20)
    return vec * 16 / (timing.median_us * 1e-6) / 1e12, timing


def synthetic_problem(fmt: str, *, n: int, k: int, group_sizes, expert_ids, num_experts: int,
                      seed: int = 0) -> GroupedProblem:
    """A valid problem with random element codes and realistic scale bytes, built in seconds for
    any size (for timing; quantizing real weights of 64 DeepSeek experts takes minutes on a CPU).
    Random codes are never all zero and exercise every element value."""
    a_format, b_format = resolve_formats(fmt)
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int64)
    a_offsets = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.uint32)
    total = int(a_offsets[-1])

    def codes(fmt_, shape):
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        if fmt_.packed:
            return raw
        # FP8: clear NaN encodings (E4M3 S.1111.111, E5M2 exponent 11111) so timing sees numbers
        if fmt_.element_dtype == E4M3:
            raw = np.where((raw & 0x7F) == 0x7F, raw ^ 0x01, raw)
        else:
            raw = np.where((raw & 0x7C) == 0x7C, raw ^ 0x40, raw)
        return raw.view(fmt_.element_dtype)

    def scale_bytes(fmt_, shape):
        lo, hi = SYNTHETIC_UE4M3_RANGE if fmt_.scale_dtype == "ue4m3" else SYNTHETIC_UE8M0_RANGE
        return rng.integers(lo, hi, shape, dtype=np.uint8)

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


def environment_fields() -> dict:
    """GPU, date, commit and versions for every CSV row."""
    import ml_dtypes
    import numba

    try:
        from numba import cuda

        gpu = cuda.get_current_device().name
        gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    except Exception:
        gpu = "none"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    try:
        import numba_cuda

        numba_cuda_version = numba_cuda.__version__
    except Exception:
        numba_cuda_version = "unknown"
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": commit,
            "numpy": np.__version__, "numba": numba.__version__, "numba_cuda": numba_cuda_version,
            "ml_dtypes": ml_dtypes.__version__}


def write_csv(path: str, rows: list[dict]) -> None:
    """Write rows (dicts with the same keys) as CSV, creating the folder."""
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(rows[0])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def dataclass_row(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
