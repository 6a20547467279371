"""gbs.interop: device problems over the caller's arrays, through gbs.grouped_matmul.

CPU tests use stand-ins of device arrays: host numpy arrays behind a ``__cuda_array_interface__``
with made-up addresses (``FakeCudaArray``), and fake torch / CuPy objects (only their type's module
and the attributes gbs reads); the routing copy is replaced by a read of the stand-in's host array.
GPU tests (``gpu`` marker; torch / CuPy ones skip without those packages) run the H200 kernel on
torch, CuPy, Numba and DLPack-only inputs of a ragged problem and check the result, the kind of the
output, that the kernel read the caller's memory, and that skipped rows kept ``out``'s poison.
"""
import dataclasses
import itertools
import types

import numpy as np
import pytest

import gbs
from gbs import interop
from gbs.api import resolve_config
from gbs.dispatch import dispatch_for
from gbs.numba_kernels import launch
from gbs.problem import PROBLEM_FORMATS, build_problem, random_problem
from gbs.formats import BF16
from gbs.reference import POISON_BITS, check_acceptance, is_poison, poison_output

FAKE_HEAP = 0x7F00_0000_0000   # where stand-in "device" addresses start
FAKE_ALLOCATION_ALIGN = 4096
_fake_allocations = itertools.count()


class FakeCudaArray:
    """A host array behind a ``__cuda_array_interface__`` with a made-up, 4096-aligned address."""

    def __init__(self, host, *, offset=0, typestr=None, strides=None, mask=None, readonly=False):
        self.host = np.ascontiguousarray(host)
        self.address = FAKE_HEAP + FAKE_ALLOCATION_ALIGN * next(_fake_allocations) + offset
        self.typestr, self.strides, self.mask, self.readonly = typestr, strides, mask, readonly

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": self.host.shape, "typestr": self.typestr or self.host.dtype.str,
                "data": (self.address, self.readonly), "strides": self.strides, "mask": self.mask}


class FakeCupyArray(FakeCudaArray):
    __module__ = "cupy._core.core"   # array_kind looks at the type's module only

    def __init__(self, host, device_id=0):
        super().__init__(host)
        self.device = types.SimpleNamespace(id=device_id)


class FakeTorchDtype:
    def __init__(self, name, is_floating_point=False, is_signed=True, is_complex=False):
        self.name, self.is_floating_point, self.is_signed, self.is_complex = name, is_floating_point, is_signed, is_complex

    def __str__(self):
        return f"torch.{self.name}"


class FakeTorchTensor:
    """The attributes of a torch tensor that gbs reads."""

    __module__ = "torch"

    def __init__(self, host, dtype, device="cuda", index=0, contiguous=True):
        self.host = np.ascontiguousarray(host)
        self.shape, self.dtype, self.layout = self.host.shape, dtype, "torch.strided"
        self.device = types.SimpleNamespace(type=device, index=index)
        self._address = FAKE_HEAP + FAKE_ALLOCATION_ALIGN * next(_fake_allocations)
        self._contiguous = contiguous

    def data_ptr(self):
        return self._address

    def element_size(self):
        return self.host.dtype.itemsize

    def is_contiguous(self):
        return self._contiguous


class DLPackOnly:
    """Exposes only the DLPack protocol of ``inner``."""

    def __init__(self, inner):
        self._inner = inner

    def __dlpack__(self, **kwargs):
        return self._inner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._inner.__dlpack_device__()


def device_bytes(x: np.ndarray) -> np.ndarray:
    """FP8 / FP4 operands and bf16 tokens as the raw bytes a device problem takes them in."""
    return x.view(np.uint8) if x.dtype.itemsize == 1 or x.dtype == BF16 else x


def fake_arrays(problem, make=FakeCudaArray, **overrides):
    arrays = {name: make(device_bytes(getattr(problem, name))) for name in launch.PROBLEM_ARRAY_DTYPES}
    return dict(arrays, **overrides)


@pytest.fixture
def routing_copies(monkeypatch):
    """Replace the device->host copy by a read of the stand-in's host array; returns the list of
    stand-ins copied."""
    copied = []

    def read_stand_in(array, stream=0):
        copied.append(array.owner)
        return array.owner.host.view(array.dtype).copy()

    monkeypatch.setattr(interop, "copy_to_host", read_stand_in)
    return copied


def same_objects(got, want) -> bool:
    return len(got) == len(want) and all(g is w for g, w in zip(got, want))


def ragged(fmt="nvfp4", k=256, seed=5):
    return random_problem(fmt, n=96, k=k, num_experts=7, total_tokens=60, num_active_experts=3, routing="ragged",
                          num_empty=1, num_skipped=1, seed=seed)


# ----------------------------------------------------------------------------------------------
# Kinds, layouts, streams
# ----------------------------------------------------------------------------------------------
def test_array_kind_by_type_and_protocol():
    host = np.zeros((2, 16), np.uint8)

    class NumbaLike(FakeCudaArray):
        __module__ = "numba.cuda.cudadrv.devicearray"

    assert interop.array_kind(host) == "numpy"
    assert interop.array_kind(FakeCudaArray(host)) == "cuda_array_interface"
    assert interop.array_kind(NumbaLike(host)) == "numba"
    assert interop.array_kind(FakeCupyArray(host)) == "cupy"
    assert interop.array_kind(FakeTorchTensor(host, FakeTorchDtype("uint8", is_signed=False))) == "torch"
    assert interop.array_kind(DLPackOnly(host)) == "dlpack"
    with pytest.raises(TypeError, match="not an array gbs can read"):
        interop.array_kind([1, 2, 3])


def test_device_array_exposes_the_kernel_view_without_a_stream():
    fake = FakeCudaArray(np.arange(6, dtype=np.int32))
    arr = interop.device_array(fake, np.uint32, name="a_offsets")
    cai = arr.__cuda_array_interface__
    assert (cai["typestr"], cai["data"], cai["shape"], cai["strides"], cai["stream"]) == (
        "<u4", (fake.address, False), (6,), None, None)
    assert arr.source_dtype == "int32" and arr.owner is fake and arr.nbytes == 24
    assert "owner" not in repr(arr)   # a tensor's repr would copy its values to the host


@pytest.mark.parametrize("typestr", ["|u1", "|i1", "|V1"])
def test_any_one_byte_type_is_raw_bytes(typestr):
    arr = interop.device_array(FakeCudaArray(np.zeros((4, 16), np.uint8), typestr=typestr), np.uint8, name="a")
    assert arr.dtype == np.uint8


def test_torch_tensors_are_read_through_their_own_attributes():
    fp8 = FakeTorchDtype("float8_e4m3fn", is_floating_point=True)
    tensor = FakeTorchTensor(np.zeros((3, 128), np.uint8), fp8, index=1)
    arr = interop.device_array(tensor, np.uint8, name="a")
    assert (arr.kind, arr.address, arr.shape, arr.source_dtype, arr.device_id) == (
        "torch", tensor.data_ptr(), (3, 128), "torch.float8_e4m3fn", 1)
    with pytest.raises(TypeError, match=r"tensor\.cuda\(\)"):
        interop.device_array(FakeTorchTensor(np.zeros(4, np.uint8), fp8, device="cpu"), np.uint8, name="a")
    with pytest.raises(ValueError, match="C-contiguous"):
        interop.device_array(FakeTorchTensor(np.zeros((4, 4), np.uint8), fp8, contiguous=False), np.uint8, name="a")
    with pytest.raises(TypeError, match="4-byte integers"):
        interop.device_array(tensor, np.uint32, name="a_offsets")
    bf16 = FakeTorchTensor(np.zeros((2, 8), np.uint16), FakeTorchDtype("bfloat16", is_floating_point=True))
    half = FakeTorchTensor(np.zeros((2, 8), np.uint16), FakeTorchDtype("float16", is_floating_point=True))
    assert interop.device_array(bf16, interop.OUTPUT_DTYPE, name="out").dtype == np.uint16
    with pytest.raises(TypeError, match="not float16"):
        interop.device_array(half, interop.OUTPUT_DTYPE, name="out")


@pytest.mark.parametrize("make, error, match", [
    (lambda: np.zeros(4, np.uint32), TypeError, "host numpy array"),
    (lambda: FakeCudaArray(np.zeros(4, np.float32)), TypeError, "4-byte integers"),
    (lambda: FakeCudaArray(np.zeros(4, np.int64)), TypeError, "4-byte integers"),
    (lambda: FakeCudaArray(np.zeros(4, np.uint32), typestr=">u4"), TypeError, "byte order"),
    (lambda: FakeCudaArray(np.zeros(4, np.uint32), mask=object()), TypeError, "masked"),
    (lambda: FakeCudaArray(np.zeros(4, np.uint32), strides=(8,)), ValueError, "C-contiguous"),
    (lambda: FakeCudaArray(np.zeros(4, np.uint32), offset=8), ValueError, "16-byte aligned"),
    (lambda: DLPackOnly(np.zeros(4, np.uint32)), TypeError, "not CUDA memory"),
])
def test_bad_device_arrays_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        interop.problem_array(make(), "a_offsets")


def test_contiguity_ignores_strides_of_unit_dimensions():
    fake = FakeCudaArray(np.zeros((1, 16), np.uint8), strides=(999, 1))
    assert interop.problem_array(fake, "a").shape == (1, 16)
    assert not interop._c_contiguous((2, 16), (32, 1), 1)


def test_stream_handles():
    assert interop.stream_handle(7) == 7
    assert interop.stream_handle(np.int64(9)) == 9
    assert interop.stream_handle(types.SimpleNamespace(cuda_stream=11)) == 11   # torch.cuda.Stream
    assert interop.stream_handle(types.SimpleNamespace(ptr=13)) == 13           # cupy.cuda.Stream

    class Protocol:
        def __cuda_stream__(self):
            return (0, 15)

    assert interop.stream_handle(Protocol()) == 15
    for bad in (True, "default", 1.5):
        with pytest.raises(TypeError, match="stream"):
            interop.stream_handle(bad)
    assert interop.caller_stream("cuda_array_interface") == 0 and interop.caller_stream("numba") == 0


# ----------------------------------------------------------------------------------------------
# Device problems: derived sizes, cheap checks, routing validation, dispatch
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(PROBLEM_FORMATS))
def test_device_problem_takes_its_sizes_and_the_dispatch_from_host_metadata(fmt, routing_copies):
    p = ragged(fmt)
    arrays = fake_arrays(p)
    dp = interop.device_problem(**arrays, fmt=fmt)
    for name in ("n", "k", "num_active_experts", "estimated_total_m", "total_tokens", "num_experts", "format_name"):
        assert getattr(dp, name) == getattr(p, name), name
    assert dp.kind == "cuda_array_interface" and dp.device_id is None
    assert same_objects(routing_copies, [arrays[name] for name in interop.ROUTING_ARRAYS])   # nothing else
    assert dispatch_for(dp) == dispatch_for(p)
    assert resolve_config(dp) == resolve_config(p)
    assert interop.device_problem(**fake_arrays(p), fmt=fmt, estimated_total_m=4096, validate=False) \
        .estimated_total_m == 4096


@pytest.mark.parametrize("fmt", ["w4a16", "w4a16_nvfp4"])
def test_bf16_tokens_are_taken_as_they_are_and_read_as_their_bytes(fmt, routing_copies):
    """W4A16: torch.bfloat16 tokens, or their bits as 2-byte integers, are the device problem's ``a`` without a
    copy, read as ``(total_tokens, 2K)`` bytes at the caller's address; other 2-byte or 4-byte tokens are refused."""
    p = ragged(fmt)
    bits = p.a.view(np.uint16)
    torch_tokens = FakeTorchTensor(bits, FakeTorchDtype("bfloat16", is_floating_point=True))
    for tokens in (torch_tokens, FakeCudaArray(bits), FakeCudaArray(bits.view(np.int16))):
        dp = interop.device_problem(**fake_arrays(p, a=tokens), fmt=fmt, stream=0)   # no torch here: no stream query
        assert dp.a.shape == (p.total_tokens, 2 * p.k) and dp.a.dtype == np.uint8 and dp.k == p.k
        assert dp.a.owner is tokens and dp.a.address == (tokens.data_ptr() if tokens is torch_tokens else tokens.address)
    assert interop.device_problem(**fake_arrays(p, a=torch_tokens), fmt=fmt, stream=0).kind == "torch"
    for wrong in (FakeTorchTensor(bits, FakeTorchDtype("float16", is_floating_point=True)),
                  FakeCudaArray(bits.astype(np.float32))):
        with pytest.raises(TypeError, match="a must hold 1-byte elements .*or bf16 tokens"):
            interop.device_problem(**fake_arrays(p, a=wrong), fmt=fmt, stream=0)


def test_device_problem_carries_the_h200_weight_layout_to_the_kernels(routing_copies):
    """``device_problem(b_layout=..., a_layout=...)`` tags the caller's re-laid weights / tokens; the kernels'
    view and the explicit host copy keep the tags, and FP8 operands refuse them."""
    p = ragged("nvfp4").with_b_layout("e2m1_h200")
    dp = interop.device_problem(**fake_arrays(p), fmt="nvfp4", b_layout="e2m1_h200")
    assert dp.b_layout == "e2m1_h200" and dp.launch_view().b_layout == "e2m1_h200"
    assert interop.device_problem(**fake_arrays(p), fmt="nvfp4").launch_view().b_layout == "packed"
    host = interop.to_host(dp)
    assert host.b_layout == "e2m1_h200"
    np.testing.assert_array_equal(host.with_b_layout("packed").b, ragged("nvfp4").b)
    with pytest.raises(ValueError, match="re-lays FP4"):
        interop.device_problem(**fake_arrays(ragged("mxfp8")), fmt="mxfp8", b_layout="e2m1_h200")
    tokens = ragged("nvfp4").with_a_layout("e2m1_h200")
    dp = interop.device_problem(**fake_arrays(tokens), fmt="nvfp4", a_layout="e2m1_h200")
    assert dp.a_layout == "e2m1_h200" and dp.launch_view().a_layout == "e2m1_h200" and dp.b_layout == "packed"
    assert interop.to_host(dp).a_layout == "e2m1_h200"
    with pytest.raises(ValueError, match="a_layout 'e2m1_h200' re-lays FP4"):
        interop.device_problem(**fake_arrays(ragged("w4a8")), fmt="w4a8", a_layout="e2m1_h200")
    # tiled weights: stored padded to whole boxes (N 96 as 128 rows; unpadded bytes are refused), weights only
    with pytest.raises(ValueError, match=r"b must have shape \(7, 128, 128\), got \(7, 96, 128\)"):
        interop.device_problem(**fake_arrays(ragged("nvfp4")), fmt="nvfp4", b_layout="e2m1_h200_tiled")
    boxed = random_problem("nvfp4", n=128, k=256, num_experts=3, total_tokens=20, num_active_experts=2,
                           seed=6).with_b_layout("e2m1_h200_tiled")
    dp = interop.device_problem(**fake_arrays(boxed), fmt="nvfp4", b_layout="e2m1_h200_tiled")
    assert dp.launch_view().b_layout == "e2m1_h200_tiled"
    np.testing.assert_array_equal(interop.to_host(dp).with_b_layout("packed").b, boxed.with_b_layout("packed").b)
    with pytest.raises(ValueError, match="is for weights, not tokens"):
        interop.device_problem(**fake_arrays(boxed), fmt="nvfp4", a_layout="e2m1_h200_tiled")
    # fused weights: b holds each box's scales too, (E, N, K/2 + K/16); the routing check and the host copy take it
    fused = boxed.with_b_layout("e2m1_h200_fused")
    dp = interop.device_problem(**fake_arrays(fused), fmt="nvfp4", b_layout="e2m1_h200_fused")
    assert dp.launch_view().b_layout == "e2m1_h200_fused" and dp.b.shape == (3, 128, 128 + 16)
    np.testing.assert_array_equal(interop.to_host(dp).with_b_layout("packed").b, boxed.with_b_layout("packed").b)
    with pytest.raises(ValueError, match=r"b must have shape \(3, 128, 144\)"):
        interop.device_problem(**fake_arrays(boxed), fmt="nvfp4", b_layout="e2m1_h200_fused")


def test_int32_routing_is_read_as_the_kernels_dtypes(routing_copies):
    p = ragged()
    arrays = fake_arrays(p, a_offsets=FakeCudaArray(p.a_offsets.astype(np.int32)),
                         expert_ids=FakeCudaArray(p.expert_ids.view(np.uint32)))
    dp = interop.device_problem(**arrays)
    assert (dp.a_offsets.dtype, dp.expert_ids.dtype) == (np.uint32, np.int32)
    assert dp.a_offsets.source_dtype == "int32"


def test_validated_routing_stays_on_the_host_for_the_plans(routing_copies):
    """``validate_routing`` keeps the copies it checked (``host_routing``), so the wgmma plan counts each
    group's own tiles for a device problem as it does for the host one; without validation it has the
    average only."""
    from gbs.plan import tile_token_rows

    p = ragged()
    dp = interop.device_problem(**fake_arrays(p))
    assert set(dp.host_routing) == set(interop.ROUTING_ARRAYS)
    for name in interop.ROUTING_ARRAYS:
        np.testing.assert_array_equal(dp.host_routing[name], getattr(p, name))
    assert tile_token_rows(dp, 128) == tile_token_rows(p, 128)
    blind = interop.device_problem(**fake_arrays(p), validate=False)
    assert blind.host_routing is None
    average = -(-p.total_tokens // p.num_active_experts)
    assert tile_token_rows(blind, 128) == p.num_active_experts * -(-average // 128) * 128
    assert tile_token_rows(blind, 128) != tile_token_rows(dp, 128)   # the empty / -1 slots


def test_validate_false_reads_nothing(routing_copies):
    p = ragged()
    broken = p.a_offsets.copy()
    broken[1], broken[2] = broken[2], broken[1] + 1000
    arrays = fake_arrays(p, a_offsets=FakeCudaArray(broken))
    dp = interop.device_problem(**arrays, validate=False)   # the caller vouches for the routing
    assert routing_copies == []
    with pytest.raises(ValueError, match="non-decreasing"):
        dp.validate_routing()
    assert same_objects(routing_copies, [arrays[name] for name in interop.ROUTING_ARRAYS])


def _mutate(p, field, edit):
    host = getattr(p, field).copy()
    edit(host)
    return host


@pytest.mark.parametrize("field, edit, match", [
    ("a_offsets", lambda x: x.__setitem__(2, x[-1] + 5), "non-decreasing"),
    ("a_offsets", lambda x: x.__setitem__(-1, x[-1] + 1), "must equal the token count"),
    ("a_offsets", lambda x: x.__setitem__(0, 1), r"a_offsets\[0\] must be 0"),
    ("a_scale_offsets", lambda x: x.__setitem__(-1, x[-1] + 1), r"a_scale_offsets\[\d+\] = \d+, expected"),
    ("expert_ids", lambda x: x.__setitem__(0, 7), r"expert_ids\[0\] = 7 is out of range \[-1, 7\)"),
    ("expert_ids", lambda x: x.__setitem__(1, -2), r"expert_ids\[1\] = -2 is out of range"),
])
def test_routing_errors_are_groupedproblems_own(field, edit, match, routing_copies):
    p = ragged()
    bad = _mutate(p, field, edit)
    arrays = fake_arrays(p, **{field: FakeCudaArray(bad)})
    with pytest.raises(ValueError, match=match):
        interop.device_problem(**arrays)
    dp = interop.device_problem(**arrays, validate=False)
    routing = {name: bad if name == field else getattr(p, name) for name in interop.ROUTING_ARRAYS}
    with pytest.raises(ValueError, match=match):   # check_routing alone, on host values
        dp.check_routing(**routing)
    dp.check_routing(**{name: getattr(p, name) for name in interop.ROUTING_ARRAYS})


def test_token_scale_bands_are_checked_against_the_routing(routing_copies):
    p = ragged()
    extra_band = np.concatenate([p.a_scales, p.a_scales[:1]])   # any band count passes the shape checks
    arrays = fake_arrays(p, a_scales=FakeCudaArray(extra_band))
    interop.device_problem(**arrays, validate=False)
    with pytest.raises(ValueError, match="a_scales must have shape"):
        interop.device_problem(**arrays)


@pytest.mark.parametrize("field, value, error, match", [
    ("a", lambda p: FakeCudaArray(p.a.view(np.uint8)[None]), ValueError, "a must be 2-D"),
    ("b", lambda p: FakeCudaArray(p.b.view(np.uint8)[:, :, :64]), ValueError, r"b must have shape"),
    ("b_scales", lambda p: FakeCudaArray(p.b_scales[:-1]), ValueError, r"b_scales must have shape"),
    ("expert_scales", lambda p: FakeCudaArray(p.expert_scales[:-1]), ValueError, r"expert_scales must have shape"),
    ("a_scale_offsets", lambda p: FakeCudaArray(p.a_scale_offsets[:-1]), ValueError,
     r"a_scale_offsets must have shape"),
    ("a_scales", lambda p: FakeCudaArray(p.a_scales[..., :2]), ValueError, r"a_scales must have shape"),
    ("a", lambda p: FakeCudaArray(np.zeros((p.total_tokens, 4), np.uint8)), ValueError, "block size 16"),
    ("b", lambda p: p.b, TypeError, "host numpy array"),
])
def test_shapes_and_kinds_are_checked_without_reading_the_device(field, value, error, match, routing_copies):
    p = ragged()
    with pytest.raises(error, match=match):
        interop.device_problem(**fake_arrays(p, **{field: value(p)}))
    assert routing_copies == []   # refused before the routing copy


def test_arrays_must_share_one_gpu():
    p = ragged()
    arrays = fake_arrays(p, make=FakeCupyArray, b=FakeCupyArray(p.b.view(np.uint8), device_id=1))
    with pytest.raises(ValueError, match="different GPUs"):   # stream given: CuPy's current one needs CuPy
        interop.device_problem(**arrays, validate=False, stream=0)
    assert interop.device_problem(**fake_arrays(p, make=FakeCupyArray), validate=False, stream=0).device_id == 0


def test_direct_construction_and_replace_run_the_cheap_checks():
    p = ragged()
    dp = interop.device_problem(**fake_arrays(p), validate=False)
    fields = {f.name: getattr(dp, f.name) for f in dataclasses.fields(dp)}
    direct = interop.DeviceGroupedProblem(**dict(fields, a_format="nvfp4", b_format="nvfp4",
                                                 expert_ids=FakeCudaArray(p.expert_ids)))
    assert direct.a_format is p.a_format and isinstance(direct.expert_ids, interop.DeviceArray)
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        dataclasses.replace(dp, expert_ids=FakeCudaArray(p.expert_ids[:-1]))
    with pytest.raises(TypeError, match="num_active_experts must be an integer"):
        dataclasses.replace(dp, num_active_experts=3.0)
    with pytest.raises(TypeError, match="read as uint8; it must be read as uint32"):
        dataclasses.replace(dp, a_offsets=dp.a)


def test_unsupported_format_is_refused():
    with pytest.raises(ValueError, match="unknown problem format"):
        interop.device_problem(**fake_arrays(ragged()), fmt="int4", validate=False)


# ----------------------------------------------------------------------------------------------
# grouped_matmul on device problems without a GPU: backends and the checks before device work
# ----------------------------------------------------------------------------------------------
def test_only_device_backends_take_device_problems():
    dp = interop.device_problem(**fake_arrays(ragged()), validate=False)
    with pytest.raises(TypeError, match=r"never copied implicitly.*to_host"):
        gbs.grouped_matmul(dp, backend="reference")
    for backend in ("simt", "sm100"):
        with pytest.raises(NotImplementedError, match=r"host GroupedProblems only.*h200_stream"):
            gbs.grouped_matmul(dp, backend=backend)
    if not gbs.backends.gpu_available():
        with pytest.raises(TypeError, match="backend='auto' resolved to 'reference'"):
            gbs.grouped_matmul(dp)
    with pytest.raises(TypeError, match="DeviceGroupedProblem"):
        interop.to_host(ragged())


@pytest.mark.skipif(gbs.backends.gpu_available(), reason="checks the refusal on a machine without a GPU")
def test_h200_stream_checks_everything_host_side_before_asking_for_the_gpu():
    p = ragged()
    dp = interop.device_problem(**fake_arrays(p), validate=False)
    with pytest.raises(launch.NoSuitableGPUError, match="sm_90"):
        gbs.grouped_matmul(dp, backend="h200_stream")
    odd_k = interop.device_problem(**fake_arrays(ragged(k=80)), validate=False)   # 40-byte rows
    with pytest.raises(ValueError, match="TMA needs a multiple of 16"):
        gbs.grouped_matmul(odd_k, backend="h200_stream")
    bits = poison_output(p.total_tokens, p.n).view(np.uint16)
    with pytest.raises(ValueError, match=r"out must have shape \(\d+, 96\)"):
        gbs.grouped_matmul(dp, backend="h200_stream", out=FakeCudaArray(bits[:-1]))
    with pytest.raises(TypeError, match="not float16"):
        gbs.grouped_matmul(dp, backend="h200_stream", out=FakeCudaArray(bits.view(np.float16)))
    with pytest.raises(ValueError, match="read-only"):
        gbs.grouped_matmul(dp, backend="h200_stream", out=FakeCudaArray(bits, readonly=True))
    with pytest.raises(TypeError, match="host numpy array"):
        gbs.grouped_matmul(dp, backend="h200_stream", out=bits)


def test_stream_is_for_device_problems_only():
    with pytest.raises(ValueError, match="stream applies to device problems"):
        gbs.grouped_matmul(ragged(), backend="reference", stream=0)


def test_device_problem_is_exported():
    assert gbs.device_problem is interop.device_problem


# ----------------------------------------------------------------------------------------------
# On the H200: torch, CuPy, Numba and DLPack-only inputs
# ----------------------------------------------------------------------------------------------
GPU_EXPERTS = 6
GPU_N = 160   # not a multiple of 128: the last weight-row tile is partial


def gpu_problem(fmt):
    """Ragged: an empty group, a -1 slot and a one-token group."""
    rng = np.random.default_rng(17)
    k = 512 if fmt == "nvfp4" else 256
    group_sizes, expert_ids = [37, 0, 1, 12, 70], [0, 2, 3, -1, 5]
    activations = rng.standard_normal((sum(group_sizes), k)).astype(np.float32)
    weights = (0.02 * rng.standard_normal((GPU_EXPERTS, GPU_N, k))).astype(np.float32)
    return build_problem(activations, weights, group_sizes, expert_ids, fmt=fmt)


class Library:
    """How one array library uploads, allocates, reads back and points at its arrays."""

    def __init__(self, name):
        self.name = name
        if name in ("torch", "dlpack"):
            self.torch = pytest.importorskip("torch")
        if name == "cupy":
            self.cupy = pytest.importorskip("cupy")

    def upload(self, host: np.ndarray):
        host = np.ascontiguousarray(device_bytes(host))
        if self.name in ("torch", "dlpack"):
            if host.dtype == np.uint32:   # older torch has no uint32: int32 is accepted as well
                host = host.view(np.int32)
            tensor = self.torch.from_numpy(host).cuda()
            return DLPackOnly(tensor) if self.name == "dlpack" else tensor
        if self.name == "cupy":
            return self.cupy.asarray(host)
        from numba import cuda

        return cuda.to_device(host)

    def poisoned_out(self, total_tokens, n):
        bits = poison_output(total_tokens, n).view(np.uint16)
        if self.name == "torch":
            return self.torch.from_numpy(bits.view(np.int16)).cuda().view(self.torch.bfloat16)
        if self.name == "cupy":
            return self.cupy.asarray(bits)
        from numba import cuda

        return cuda.to_device(bits)

    def address(self, arr) -> int:
        if isinstance(arr, DLPackOnly):
            return arr._inner.data_ptr()
        if self.name == "torch":
            return arr.data_ptr()
        if self.name == "cupy":
            return arr.data.ptr
        return arr.__cuda_array_interface__["data"][0]   # Numba (and the Numba out of DLPack inputs)

    def synchronize(self):
        from numba import cuda

        if self.name in ("torch", "dlpack"):
            self.torch.cuda.synchronize()
        elif self.name == "cupy":
            self.cupy.cuda.get_current_stream().synchronize()
        cuda.synchronize()

    def to_bf16(self, out) -> np.ndarray:
        if self.name == "torch":
            return out.view(self.torch.int16).cpu().numpy().view(np.uint16).view(BF16)
        if self.name == "cupy":
            return out.get().view(BF16)
        return out.copy_to_host().view(BF16)

    def check_output_kind(self, out, a):
        if self.name == "torch":
            assert isinstance(out, self.torch.Tensor) and out.dtype == self.torch.bfloat16 and out.device == a.device
        elif self.name == "cupy":
            assert isinstance(out, self.cupy.ndarray) and out.dtype == np.uint16 and out.device.id == a.device.id
        else:   # Numba in, or DLPack-only in: a Numba device array of bf16 bits
            from numba.cuda.cudadrv.devicearray import DeviceNDArray

            assert isinstance(out, DeviceNDArray) and out.dtype == np.uint16


@pytest.fixture
def kernel_spy(monkeypatch):
    """Record what h200_launch.prepare was handed (the problem the kernel reads, out, stream)."""
    from gbs.numba_kernels import h200_launch

    calls = []
    real_prepare = h200_launch.prepare

    def spy(problem_device, plan, out=None, **kwargs):
        calls.append((problem_device, out, kwargs))
        return real_prepare(problem_device, plan, out, **kwargs)

    monkeypatch.setattr(h200_launch, "prepare", spy)
    return calls


LIBRARIES = ["torch", "cupy", "numba", "dlpack"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_h200_on_device_arrays_without_copies(library, fmt, kernel_spy):
    lib = Library(library)
    p = gpu_problem(fmt)
    device = {name: lib.upload(getattr(p, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
    dp = gbs.device_problem(**device, fmt=fmt)
    out = lib.poisoned_out(p.total_tokens, p.n)
    result = gbs.grouped_matmul(dp, backend="h200_stream", out=out)
    assert result is out
    lib.synchronize()
    host = lib.to_bf16(result)
    assert check_acceptance(p, host).passed
    assert np.all(is_poison(host[~p.written_rows()]))   # skipped rows kept out's poison
    (kernel_problem, kernel_out, _), = kernel_spy
    for name, arr in device.items():   # the kernel read the caller's memory: nothing was copied
        assert launch.device_address(getattr(kernel_problem, name)) == lib.address(arr), name
    assert launch.device_address(kernel_out) == lib.address(out)

    fresh = gbs.grouped_matmul(dp, backend="h200_stream")   # out=None: a new output of a's kind
    lib.check_output_kind(fresh, device["a"])
    lib.synchronize()
    fresh_bits = lib.to_bf16(fresh).view(np.uint16).copy()
    fresh_bits[~p.written_rows()] = POISON_BITS   # uninitialised rows: not compared
    assert check_acceptance(p, fresh_bits.view(BF16)).passed


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["h200_stream", "h200_wgmma"])
def test_h200_layouts_of_device_arrays_give_the_same_bits(backend):
    """Torch arrays holding FP4 weights and tokens in ``E2M1H200Order``, tagged with ``b_layout`` /
    ``a_layout``: both H200 kernels read them in place and give the packed arrays' bits."""
    pytest.importorskip("torch")
    lib = Library("torch")
    p = gpu_problem("nvfp4")
    relaid = p.with_b_layout("e2m1_h200").with_a_layout("e2m1_h200")
    results = []
    for problem, layouts in ((p, {}), (relaid, {"a_layout": "e2m1_h200", "b_layout": "e2m1_h200"})):
        device = {name: lib.upload(getattr(problem, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
        out = lib.poisoned_out(p.total_tokens, p.n)
        gbs.grouped_matmul(gbs.device_problem(**device, fmt="nvfp4", **layouts), backend=backend, out=out)
        lib.synchronize()
        results.append(lib.to_bf16(out))
    assert check_acceptance(p, results[0]).passed
    np.testing.assert_array_equal(results[1].view(np.uint16), results[0].view(np.uint16))


@pytest.mark.gpu
def test_torch_runs_on_the_current_stream_and_prepare_reruns(kernel_spy):
    torch = pytest.importorskip("torch")
    lib = Library("torch")
    p = gpu_problem("nvfp4")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        device = {name: lib.upload(getattr(p, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
        dp = gbs.device_problem(**device, fmt="nvfp4")
        out = lib.poisoned_out(p.total_tokens, p.n)
        gbs.grouped_matmul(dp, backend="h200_stream", out=out)
        (_, _, kwargs), = kernel_spy
        assert interop.stream_handle(kwargs["stream"]) == side.cuda_stream
        prepared = interop.prepare(dp, out=out, backend="h200_stream")
        assert prepared.stream == side.cuda_stream
        assert prepared.kernel_addresses()["a"] == device["a"].data_ptr()
        out.copy_(lib.poisoned_out(p.total_tokens, p.n))
        prepared()   # a rerun on the same arrays: only the kernel is enqueued
    side.synchronize()
    assert check_acceptance(p, lib.to_bf16(out)).passed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["w4a16", "w4a16_nvfp4"])
def test_torch_bf16_tokens_run_as_they_are(fmt):
    """W4A16 on torch arrays, the tokens a ``torch.bfloat16`` tensor (no byte view by the caller): ``"auto"`` runs
    it (the wgmma kernel for these groups) and matches the reference, skipped rows poisoned."""
    torch = pytest.importorskip("torch")
    lib = Library("torch")
    p = gpu_problem(fmt)
    device = {name: lib.upload(getattr(p, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
    device["a"] = torch.from_numpy(p.a.view(np.int16)).cuda().view(torch.bfloat16)
    out = lib.poisoned_out(p.total_tokens, p.n)
    gbs.grouped_matmul(gbs.device_problem(**device, fmt=fmt), out=out)
    lib.synchronize()
    assert check_acceptance(p, lib.to_bf16(out)).passed


@pytest.mark.gpu
def test_device_routing_is_validated_and_to_host_copies_back():
    torch = pytest.importorskip("torch")
    lib = Library("torch")
    p = gpu_problem("mxfp8")
    device = {name: lib.upload(getattr(p, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
    round_trip = interop.to_host(gbs.device_problem(**device, fmt="mxfp8"))
    for name in launch.PROBLEM_ARRAY_DTYPES:
        assert np.array_equal(device_bytes(getattr(round_trip, name)), device_bytes(getattr(p, name))), name
    device["a_offsets"][2] = 1000   # beyond the tokens, decreasing after
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="non-decreasing"):
        gbs.device_problem(**device, fmt="mxfp8")
    gbs.device_problem(**device, fmt="mxfp8", validate=False)   # the caller vouches: no check, no copy


@pytest.mark.gpu
def test_validated_routing_sets_the_split_of_few_swapped_tiles():
    """A Kimi-like problem on torch arrays (N 576: 5 weight bands; 8 slots of up to 32 tokens with a -1 slot, an
    empty group and a 1-token group; K 4096): ``"auto"`` runs the wgmma kernel's swapped tiles in split-K runs.
    With the routing validated (its host copies kept) the split counts the groups' own 30 tiles (4 runs); without
    (``validate=False``) the average's 40 (3 runs). Both match the reference and keep the poison in skipped rows."""
    pytest.importorskip("torch")
    from gbs.lab.cases import synthetic_problem

    lib = Library("torch")
    p = synthetic_problem("nvfp4", n=512 + 64, k=4096, group_sizes=[32, 30, 1, 0, 32, 17, 31, 32],
                          expert_ids=[3, 0, 5, 1, -1, 2, 4, 6], num_experts=7, seed=29)
    device = {name: lib.upload(getattr(p, name)) for name in launch.PROBLEM_ARRAY_DTYPES}
    for validate, runs in ((True, 4), (False, 3)):
        out = lib.poisoned_out(p.total_tokens, p.n)
        prepared = interop.prepare(gbs.device_problem(**device, fmt="nvfp4", validate=validate), out=out)
        assert prepared.plan.kernel == "h200_wgmma" and prepared.plan.k_splits == runs
        prepared()
        lib.synchronize()
        host = lib.to_bf16(out)
        assert check_acceptance(p, host).passed, f"validate={validate}"
        assert np.all(is_poison(host[~p.written_rows()]))


@pytest.mark.parametrize("pdl", [False, True])
def test_prepare_plans_a_programmatic_dependent_launch_only_when_asked(pdl, routing_copies, monkeypatch):
    """``interop.prepare(..., pdl=True)``: the serving path's prepared launch, chained after the kernel that writes
    the tokens, asks the plan for a programmatic dependent launch (the plan carries it to the launch:
    tests/test_pdl.py); planned before any device work, so here the GPU check stops it after the plan."""
    import gbs.plan

    planned = []
    real_plan = gbs.plan.plan_h200
    monkeypatch.setattr(gbs.plan, "plan_h200", lambda *a, **kw: planned.append(real_plan(*a, **kw)) or planned[-1])
    dp = interop.device_problem(**fake_arrays(ragged("nvfp4")), fmt="nvfp4")
    with pytest.raises(launch.NoSuitableGPUError):
        interop.prepare(dp, backend="h200_wgmma", pdl=pdl)
    assert [plan.pdl for plan in planned] == [pdl]
    assert planned[0].describe().endswith("; programmatic dependent launch") == pdl
    with pytest.raises(TypeError, match="pdl must be a bool"):
        interop.prepare(dp, backend="h200_wgmma", pdl="yes")
