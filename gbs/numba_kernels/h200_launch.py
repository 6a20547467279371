"""The H200 launch layer both H200 kernels share: static checks, the stage and residency questions the planner
asks, tensor maps, the split-K workspace and counters, and ``prepare``, which turns a resolved
``gbs.plan.H200Plan`` into a launch that enqueues with no host copies or syncs.

Nothing here decides a knob: the plan carries the build (``StreamSpec`` / ``WgmmaSpec``), the split-K runs and the
grid; this module only checks that the problem fits them and marshals the launch. Design:
``docs/design/h200_port.md``.

Use::

    from gbs.plan import plan_h200
    from gbs.numba_kernels import h200_launch, launch
    plan = plan_h200(problem)                        # or plan_h200(problem, backend="h200_stream", mma_bn=8, ...)
    prepared = h200_launch.prepare(launch.to_device(problem), plan)
    prepared()                                       # enqueue; prepared.out holds C (bf16 bits)

Constraints (``check_can_implement``): K a multiple of the build's K slice (256 elements when both operands are
FP4, else 128); rows of 16-byte multiples and 16-byte aligned arrays (TMA); N and the token count below 2**31;
the output 4-byte aligned for the wgmma kernel (paired bf16 stores); the build's shared memory within the H200's
227 KiB per block; tiled or fused weights in whole 128-row x 128-byte boxes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from gbs.dispatch import H200_SMEM_PER_SM
from gbs.formats import BF16, get_format
from gbs.numba_kernels import launch
from gbs.numba_kernels import h200_ring as hr
from gbs.numba_kernels import h200_stream as hs
from gbs.numba_kernels import h200_trace as ht
from gbs.numba_kernels import h200_wgmma as hw
from gbs.problem import PROBLEM_FORMATS, GroupedProblem, check_layout, layout_of
from gbs.ptx_inline import copy as cp
from gbs.reference import poison_output

SM90 = hr.SM90
WGMMA_OUT_ALIGN = hw.OUT_ALIGN   # the wgmma epilogue's paired bf16 stores need 4-byte aligned rows


def ring_of(spec):
    """The TMA ring's spec of a build (the wgmma kernel runs the streaming kernel's ring)."""
    return spec.ring if isinstance(spec, hw.WgmmaSpec) else spec


# ----------------------------------------------------------------------------------------------
# Pure questions the planner asks
# ----------------------------------------------------------------------------------------------
def max_pipeline_stages(spec, smem_limit: int = H200_SMEM_PER_SM) -> int:
    """Deepest ring of ``spec``'s build whose real shared-memory bytes fit ``smem_limit`` (0: not one stage)."""
    stages = 0
    while dataclasses.replace(spec, stages=stages + 1).smem.total_bytes <= smem_limit:
        stages += 1
    return stages


def resident_ctas_per_sm(spec, registers_per_thread: int | None) -> int:
    """CTAs of ``spec`` one SM holds at once: shared memory (228 KiB per SM, each CTA's reserved KiB included),
    threads (2048) and registers: each of the 4 sub-partitions holds 16384 for its warps (allocated per thread in
    steps of 8), so the SM holds 4 x (16384 // warp registers) warps, whatever the CTA's warp count. Without a
    register count (no compile), the launch bounds' guarantee: at least ``spec.min_ctas_per_sm``."""
    by_smem = hr.SM90_SMEM_PER_SM // spec.smem.total_bytes
    by_threads = hr.SM90_THREADS_PER_SM // spec.threads
    if registers_per_thread is None:
        by_registers = spec.min_ctas_per_sm
    else:
        warp_registers = hr.WARP_SIZE * -(-registers_per_thread // hr.REGISTER_ALLOC_STEP) * hr.REGISTER_ALLOC_STEP
        warps = hr.SM90_SUBPARTITIONS * (hr.SM90_REGISTERS_PER_SM // hr.SM90_SUBPARTITIONS // warp_registers)
        by_registers = warps // (spec.threads // hr.WARP_SIZE)
    return max(1, min(by_smem, by_threads, by_registers))


def resident_pairs(spec, registers_per_thread: int | None, sm_count: int) -> int:
    """CTA pairs (single CTAs when ``cta_group`` is 1) ``sm_count`` SMs hold at once."""
    return max(1, sm_count * resident_ctas_per_sm(spec, registers_per_thread) // spec.cta_group)


def max_tiles_bound(ring, total_tokens: int, num_slots: int, n: int) -> int:
    """An upper bound of the tile walk's length from shapes only: every slot has at most
    ``ceil(tokens / tile_tokens) + 1`` token blocks in all."""
    shape = ring.tile_shape
    token_blocks = -(-total_tokens // shape.tokens) + num_slots
    return token_blocks * -(-n // shape.weight_rows)


def k_slices_of(k: int, k_slice: int) -> int:
    """K slices (pipeline stages' worth of K) of a problem: the last one partial where ``k_slice`` does not divide K
    (its tail past K reads as zeros: TMA fills what lies outside the tokens' rows, and tiled weights are stored padded
    with zero bytes)."""
    return -(-k // k_slice)


def split_runs(k_slices: int, k_splits: int) -> tuple[int, int]:
    """(k_splits, slices_per_split) closest to ``k_splits`` runs of ``k_slices`` with none empty."""
    if not 1 <= k_splits <= k_slices:
        raise ValueError(f"k_splits must be in [1, {k_slices}] (the K slices), got {k_splits}")
    per_split = -(-k_slices // k_splits)
    return -(-k_slices // per_split), per_split



# ----------------------------------------------------------------------------------------------
# Static checks
# ----------------------------------------------------------------------------------------------
def check_can_implement(problem, spec) -> None:
    """Whether ``spec``'s build runs ``problem`` (a ``GroupedProblem``, a ``launch.DeviceProblem`` or a device
    problem): formats, layouts, the K slice, TMA rows, sizes, shared memory. TypeError / ValueError saying what is
    wrong and what is allowed; nothing on the device."""
    if isinstance(problem, GroupedProblem):
        problem.validate()
    formats = (get_format(problem.a_format).name, get_format(problem.b_format).name)
    if formats not in PROBLEM_FORMATS.values():
        raise ValueError(f"unsupported operand formats A={formats[0]} x B={formats[1]}; supported: "
                         f"{sorted(PROBLEM_FORMATS.values())}")
    if formats != (spec.a_format, spec.b_format):
        raise ValueError(f"the build is for {spec.a_format} x {spec.b_format}, the problem is {formats[0]} x "
                         f"{formats[1]}")
    for operand in ("a", "b"):
        if layout_of(problem, operand) != getattr(spec, f"{operand}_layout"):
            raise ValueError(f"the build reads {operand} in layout {getattr(spec, f'{operand}_layout')!r}, the "
                             f"problem's is {layout_of(problem, operand)!r}")
    for name, row_bytes in (("a", problem.a_format.row_bytes(problem.k)),
                            ("b", problem.b_format.row_bytes(problem.k))):
        if row_bytes % launch.TMA_ADDRESS_ALIGN:
            fmt = getattr(problem, f"{name}_format")
            step = launch.TMA_ADDRESS_ALIGN * 8 // fmt.element_bits
            raise ValueError(f"K={problem.k}: rows of {name} ({fmt.name}) are {row_bytes} bytes; TMA needs a multiple "
                             f"of {launch.TMA_ADDRESS_ALIGN} (K a multiple of {step}); pad K to "
                             f"{-(-problem.k // step) * step} with zero elements in A and B")
    deepest = max_pipeline_stages(dataclasses.replace(spec, stages=1))
    if not 1 <= spec.stages <= deepest:
        one = dataclasses.replace(spec, stages=1).smem
        raise ValueError(f"{spec.stages} pipeline stages do not fit the H200: this build's first stage takes "
                         f"{one.total_bytes} B of the {H200_SMEM_PER_SM} B a block may use, so at most {deepest} "
                         f"stages for {spec}")
    if spec.stages < spec.min_stages:
        raise ValueError(f"{spec.stages} pipeline stage(s): this build needs at least {spec.min_stages} (bf16 tokens on "
                         "the wgmma kernel: a stage stays held until the next slice's MMAs, so one stage would wait "
                         "on itself)")
    if problem.n >= 2 ** 31 or problem.total_tokens >= 2 ** 31:
        raise ValueError("N and the token count must be below 2**31 (TMA coordinates are s32)")


# ----------------------------------------------------------------------------------------------
# Tensor maps, output, workspace
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMapArgs:
    """The ``cuTensorMapEncodeTiled`` arguments of one map (byte elements; innermost first)."""

    name: str
    global_address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]     # bytes, one fewer than dims
    box: tuple[int, ...]
    swizzle: str
    l2_promotion: str = cp.DEFAULT_L2_PROMOTION

    def check(self) -> None:
        cp.check_tensor_map_args(self.global_address, "uint8", self.dims, self.strides, self.box, self.swizzle,
                                 self.l2_promotion)

    def encode(self) -> np.ndarray:
        if len(self.dims) == 2:
            return cp.encode_tensor_map_2d(self.global_address, "uint8", self.dims, self.strides[0], self.box,
                                           self.swizzle, self.l2_promotion)
        return cp.encode_tensor_map_3d(self.global_address, "uint8", self.dims, self.strides, self.box, self.swizzle,
                                       self.l2_promotion)


def tensor_map_args(ring, shapes: dict, addresses: dict) -> list[TensorMapArgs]:
    """The four maps the ring reads, in its order (``MAP_TOKENS``...): tokens (2-D over ``a``), weights (3-D over
    ``b``; 2-D over its 128-byte box rows when tiled), token scales and weight scales (3-D views of the 128x4 atoms
    as rows of 128 bytes: (128 B, 4 rows per atom x column groups, 128-row bands); with fused weights 2-D over
    ``b``'s rows, like the weights, whose chunks hold the atoms). ``shapes`` / ``addresses``: per array name of
    ``launch.PROBLEM_ARRAY_DTYPES``, its shape and device address."""
    a, b = shapes["a"], shapes["b"]
    tok_bytes, tok_rows = ring.token_box
    w_bytes, w_rows, w_experts = ring.weight_box

    def scale_map(name, bands):
        rows = hr.ATOM_MAP_ROWS * shapes[name][-4]   # 4 rows of 128 B per atom, per column group
        return TensorMapArgs(name, addresses[name], (hr.SCALE_MAP_ROW_BYTES, rows, bands),
                             (hr.SCALE_MAP_ROW_BYTES, hr.SCALE_MAP_ROW_BYTES * rows), ring.scale_box, "none")

    weight_scales = scale_map("b_scales", shapes["b_scales"][0] * shapes["b_scales"][1])
    if ring.tiled_weights:   # rows of one box's width over every expert's boxes (E2M1H200TiledOrder)
        check_layout(ring.b_layout, get_format(ring.b_format), "b", b)
        box_rows = (hr.TILED_BOX_BYTES, math.prod(b) // hr.TILED_BOX_BYTES)
        weights = TensorMapArgs("b", addresses["b"], box_rows, (hr.TILED_BOX_BYTES,),
                                (w_bytes, min(w_rows, hr.TILED_BOX_ROWS)), hr.TMA_SWIZZLE[w_bytes])
        if ring.fused_weight_scales:   # the same rows: each box's atoms follow it (E2M1H200FusedOrder)
            weight_scales = TensorMapArgs("b_scales", addresses["b"], box_rows, (hr.TILED_BOX_BYTES,),
                                          ring.scale_box[:2], "none")
    else:
        weights = TensorMapArgs("b", addresses["b"], (b[2], b[1], b[0]), (b[2], b[1] * b[2]),
                                (w_bytes, w_rows, w_experts), hr.TMA_SWIZZLE[w_bytes])
    # bf16 tokens have no scales (``a_scales`` holds no bytes): the weights' map stands in, never read
    token_scales = scale_map("a_scales", shapes["a_scales"][0]) if get_format(ring.a_format).scaled else weight_scales
    return [
        TensorMapArgs("a", addresses["a"], (a[1], a[0]), (a[1],), (tok_bytes, tok_rows), hr.TMA_SWIZZLE[tok_bytes]),
        weights,
        token_scales,
        weight_scales,
    ]


def device_out(problem: launch.DeviceProblem, out, align: int = 2):
    """The output as a device array of bf16 bits, checked (``align``: byte alignment its kernel needs)."""
    shape = (problem.total_tokens, problem.n)
    if out is None:
        return cuda.device_array(shape, dtype=np.uint16)
    if not cuda.is_cuda_array(out):
        raise TypeError(f"out must be a device array (__cuda_array_interface__), got {type(out).__name__}")
    arr = cuda.as_cuda_array(out)
    if arr.dtype.itemsize != 2:
        raise TypeError(f"out must hold bf16 (2-byte) elements, got {arr.dtype}")
    if arr.dtype != np.uint16:
        arr = arr.view(np.uint16)
    if tuple(arr.shape) != shape or not arr.is_c_contiguous():
        raise ValueError(f"out must be a C-contiguous {shape} (total_tokens, N) array, got {tuple(arr.shape)}")
    if launch.device_address(arr) % align:
        raise ValueError(f"out must be {align}-byte aligned on the device (this kernel stores bf16 pairs), got "
                         f"address {launch.device_address(arr):#x}: pass an array that starts at an allocation")
    return arr


def zeroed_counters(tile_counters: int, stream=0):
    """The kernels' ``split_counters`` argument: ``tile_counters`` split-K tile counters, then the
    ``SCHEDULE_COUNTER_WORDS`` of the work-item counter; zeroed once here, on the launch's stream. Every launch
    leaves them zeroed (the last run of a tile resets its counter; the last producer zeroes the item counter), so a
    prepared launch must not run concurrently with itself."""
    counters = cuda.device_array(tile_counters + hr.SCHEDULE_COUNTER_WORDS, np.uint32, stream=stream)
    device_memset(counters, 0, counters.nbytes, stream=stream)
    return counters


# ----------------------------------------------------------------------------------------------
# Compile, prepare, run
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def compiled_kernel(spec) -> launch.CompiledKernel:
    """The JIT-compiled kernel of a build for the current GPU (cached per spec)."""
    family, name = (hw, "h200_wgmma") if isinstance(spec, hw.WgmmaSpec) else (hs, "h200_stream")
    return launch.compile_kernel(family.make_kernel_function(spec), hr.kernel_signature(), threads=spec.threads,
                                 min_blocks=spec.min_ctas_per_sm, dynamic_smem_bytes=spec.smem.dynamic_bytes,
                                 cluster_size=spec.cta_group, name=f"grouped_matmul_{name}[{spec}]")


@dataclass
class H200Launch:
    """A prepared launch of a plan: calling it enqueues the kernel, no host copies or syncs. ``out`` is the device
    output (uint16 bf16 bits, (total_tokens, N)). It owns the counters and the split-K workspace, which every
    launch leaves zeroed: a prepared launch must not run concurrently with itself (programmatic dependent launches
    of it back to back may overlap: each waits for the one before it ahead of its first global access)."""

    plan: object                    # the gbs.plan.H200Plan it runs
    out: object
    _launch: launch.PreparedLaunch | None
    split_sums: object = None       # the split-K workspace (fp32, (total_tokens, N))
    split_counters: object = None   # split-K tile counters, then SCHEDULE_COUNTER_WORDS of the item counter
    trace_buffer: object = None     # trace builds: (num_ctas, TRACE_EVENTS, 2) u64, the last launch's stamps

    def __call__(self, stream=None) -> None:
        if self._launch is not None:   # no tiles (no tokens): nothing to run
            self._launch(stream)


def prepare(problem_device: launch.DeviceProblem, plan, out=None, *, stream=0) -> H200Launch:
    """Compile the plan's build (cached), build the tensor maps and the workspace, marshal the arguments; returns
    an ``H200Launch``. ``out``: a device array of bf16 bits, (total_tokens, N) (default: a new uninitialised one;
    rows of skipped slots are never written). Every call of it is a programmatic dependent launch where the plan
    says so (``plan.pdl``)."""
    if not isinstance(problem_device, launch.DeviceProblem):
        raise TypeError("prepare takes a launch.DeviceProblem (see launch.to_device)")
    spec = plan.spec
    launch.require_gpu(SM90, f"the H200 kernel ({plan.kernel})")
    check_can_implement(problem_device, spec)
    out_array = device_out(problem_device, out, align=WGMMA_OUT_ALIGN if plan.kernel == "h200_wgmma" else 2)
    if plan.num_ctas == 0:
        return H200Launch(plan, out_array, None)
    for name, arr in problem_device.arrays().items():
        if launch.device_address(arr) % launch.TMA_ADDRESS_ALIGN:
            raise ValueError(f"{name} must be {launch.TMA_ADDRESS_ALIGN}-byte aligned on the device (TMA)")
    kernel = compiled_kernel(spec)
    split = plan.k_splits > 1
    split_counters = zeroed_counters(plan.max_tiles * spec.cta_group if split else 0, stream)
    if split:
        split_sums = cuda.device_array((problem_device.total_tokens, problem_device.n), np.float32, stream=stream)
        device_memset(split_sums, 0, split_sums.nbytes, stream=stream)
    else:
        split_sums = cuda.device_array((1, 1), np.float32)
    arrays = problem_device.arrays()
    images = [m.encode() for m in tensor_map_args(ring_of(spec), {k: tuple(v.shape) for k, v in arrays.items()},
                                                  {k: launch.device_address(v) for k, v in arrays.items()})]
    trace_buffer = None
    if isinstance(spec, hr.StreamSpec) and spec.trace:   # the diagnostic build: its stamps' buffer
        trace_buffer, slot = ht.trace_buffer(plan.num_ctas, stream)
        images.append(slot)
    maps = launch.device_tensor_maps(images, stream=stream)
    k_slices = k_slices_of(problem_device.k, spec.k_slice)
    args = (np.uint64(launch.device_address(maps)), problem_device.a_offsets, problem_device.a_scale_offsets,
            problem_device.expert_ids, problem_device.expert_scales, out_array, np.int64(problem_device.n),
            np.int64(k_slices), np.int64(plan.max_tiles), split_sums, split_counters, np.int64(plan.k_splits),
            np.int64(plan.slices_per_split))
    prepared = launch.prepare_launch(kernel, plan.num_ctas, args, stream=stream, pdl=plan.pdl,
                                     keepalive=(maps, problem_device, split_sums, split_counters, trace_buffer))
    return H200Launch(plan, out_array, prepared, split_sums, split_counters, trace_buffer)


def run(problem: GroupedProblem, plan, out: np.ndarray | None = None) -> np.ndarray:
    """Run ``plan`` on a host problem (copies in, launch, copy back); returns ``C`` (bf16, (total_tokens, N)).
    ``out``: if given (bf16, C-contiguous), rows of skipped slots keep its contents and it is written in place;
    default: a fresh array holding ``gbs.reference.poison_output``. ``launch.NoSuitableGPUError`` without sm_90."""
    launch.require_gpu(SM90, f"the H200 kernel ({plan.kernel})")
    check_can_implement(problem, plan.spec)
    shape = (problem.total_tokens, problem.n)
    if out is None:
        out = poison_output(*shape)
    elif not isinstance(out, np.ndarray) or out.dtype != BF16 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous bfloat16 numpy array of shape {shape}")
    bits = out.view(np.uint16)
    device_bits = cuda.to_device(bits)
    prepare(launch.to_device(problem), plan, device_bits)()
    device_bits.copy_to_host(bits)
    return out
