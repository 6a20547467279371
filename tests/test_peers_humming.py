"""The ``humming`` peer (gbs.lab.peers.HummingPeer, issue 31 item 1) on the CPU, with stubs: a fake ``humming``
package and a fake ``torch`` (numpy-backed) put into ``sys.modules``. They record what the peer hands to
humming's API; they assert nothing about humming's numerics (the stub layer computes the exact matmul of the
operands the peer dequantizes, or a corrupted copy of it).

What the stubs pin (confirmed against humming-kernels 0.1.20 on the H200: evidence ``bench-humming``):
- ``HummingLayer(shape_n, shape_k, weight_config, input_config, num_experts, torch_dtype).cuda()``, then
  ``load_from_unquantized((E, N, K) bf16)``, then ``transform()``; its pre-transform parameters ``weight``
  (int32, 8 E2M1 per word), ``weight_scale`` (E, N, K / block), NVFP4's ``weight_scale_2`` (one per expert);
- ``humming.forward.may_quant_input(layer.humming_config, bf16 tokens)`` -> (E4M3 tokens, fp32 (M, K / 128));
- ``layer(tokens, input_scale=..., expert_layout=(E + 1) int64 offsets, compute_config={"gemm_type":
  "grouped_contiguous"})`` -> (M, N) bf16;
- ``humming.utils.weight.dequantize_weight(weight[g], None, None, None, b_dtype, packed=True)`` -> element values.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from gbs.lab import peers

SHAPE = peers.PeerShape(16, 256, (3, 5, 1))
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


# ---- a numpy "torch": only what HummingPeer touches ------------------------------------------------------
class T:
    """A numpy array posing as a torch tensor."""

    def __init__(self, array, dtype=None):
        self.a = np.asarray(array)
        self.dtype = dtype or str(self.a.dtype)

    shape = property(lambda self: self.a.shape)
    device = "cuda"
    def __getitem__(self, idx): return T(self.a[idx], self.dtype)
    def __mul__(self, other): return T(self.a * (other.a if isinstance(other, T) else other), "float64")
    def __matmul__(self, other): return T(self.a @ other.a, "float64")
    def __setitem__(self, idx, value): self.a[idx] = value.a
    @property
    def T(self): return T(self.a.T, self.dtype)
    def transpose(self, i, j): return T(np.swapaxes(self.a, i, j), self.dtype)
    def float(self): return T(self.a.astype(np.float32), "float32")
    def double(self): return T(self.a.astype(np.float64), "float64")
    def cpu(self): return self
    def numpy(self): return self.a
    def to(self, *_): return self
    def detach(self): return self
    def clone(self): return T(self.a.copy(), self.dtype)
    def reshape(self, *shape): return T(self.a.reshape(*shape), self.dtype)
    def numel(self): return self.a.size
    def repeat_interleave(self, n, dim): return T(np.repeat(self.a, n, axis=dim), self.dtype)


class FakeGenerator:
    def __init__(self, device=None): self.rng = None
    def manual_seed(self, seed): self.rng = np.random.default_rng(seed)


def _randn(shape, dtype=None, device=None, generator=None):
    return T(generator.rng.standard_normal(shape).astype(np.float32), dtype)


def _empty(shape, dtype=None, device=None):
    return T(np.empty(shape, dtype=np.float64), dtype or "float64")


fake_torch = types.SimpleNamespace(bfloat16="bfloat16", float32="float32", float64="float64", Generator=FakeGenerator,
                                   randn=_randn, empty=_empty, from_numpy=lambda a: T(a))


# ---- a fake humming ------------------------------------------------------------------------------------------
class FakeLayer:
    instances: list["FakeLayer"] = []
    corrupt = False   # the stub kernel's output gets a wrong element
    refuse = False    # the stub kernel refuses the shape by a bare assert, as humming does

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls, self.events = [], []
        wc = kwargs["weight_config"]
        self.block = wc["group_size"]
        self.weight_schema = types.SimpleNamespace(b_dtype=wc["dtype"])
        self.humming_config = types.SimpleNamespace(input_scale_group_size=(kwargs["input_config"] or {}).get("group_size", 0),
                                                    use_block_scaled_mma=False)
        FakeLayer.instances.append(self)

    def cuda(self):
        self.events.append("cuda")
        return self

    def load_from_unquantized(self, raw):
        self.events.append("load")
        e, n, k = raw.shape
        rng = np.random.default_rng(len(FakeLayer.instances))
        self.codes = rng.integers(0, 16, (e, n, k))   # stub quantizer: random E2M1 codes, 8 per int32
        words = (self.codes.reshape(e, n, k // 8, 8) << (4 * np.arange(8))).sum(-1).astype(np.int64)
        self.weight = T(words, "int32")
        self.weight_scale = T(np.exp2(rng.integers(-3, 3, (e, n, k // self.block))).astype(np.float32), "scale")
        if "scale_2_type" in self.kwargs["weight_config"]:
            self.weight_scale_2 = T(rng.uniform(0.5, 2.0, e).astype(np.float32), "float32")

    def transform(self):
        self.events.append("transform")
        self.weight = "packed by transform"   # the reference must not read the packed weights

    def values(self):
        v = E2M1[self.codes] * np.repeat(self.weight_scale.a.astype(np.float64), self.block, axis=-1)
        if hasattr(self, "weight_scale_2"):
            v = v * self.weight_scale_2.a.astype(np.float64)[:, None, None]
        return v

    def __call__(self, a, input_scale=None, expert_layout=None, compute_config=None):
        self.calls.append({"a": a, "input_scale": input_scale, "expert_layout": expert_layout,
                           "compute_config": compute_config})
        tokens = a.a.astype(np.float64)
        if input_scale is not None:
            tokens = tokens * np.repeat(input_scale.a, 128, axis=-1)[:, :tokens.shape[1]]
        offs, w = expert_layout.a, self.values()
        out = np.concatenate([tokens[offs[g]:offs[g + 1]] @ w[g].T for g in range(len(offs) - 1)])
        if FakeLayer.corrupt:
            out[-1, -1] += 0.05 * np.abs(out[-1]).max()
        if FakeLayer.refuse:
            raise AssertionError   # what humming's bare shape asserts raise (pytest would rewrite an assert here)
        return T(out, "bfloat16")


def fake_may_quant_input(config, tokens):
    a = tokens.a.astype(np.float64)
    rows, k = a.shape
    scale = np.abs(a).reshape(rows, k // 128, 128).max(-1) / 448.0
    q = a / np.repeat(scale, 128, axis=-1)   # stub: no E4M3 rounding (numerics are humming's business)
    return T(q, "float8_e4m3fn"), T(scale.astype(np.float32), "float32")


def fake_dequantize_weight(weight, scale, zero_point, scale_2, dtype, packed=False):
    assert scale is None and zero_point is None and scale_2 is None and packed and dtype == "float4e2m1"
    words = weight.a
    codes = (words[..., None] >> (4 * np.arange(8))) & 0xF
    return T(E2M1[codes.reshape(*words.shape[:-1], -1)].astype(np.float32), "float32")


@pytest.fixture
def fake_humming(monkeypatch):
    FakeLayer.instances, FakeLayer.corrupt, FakeLayer.refuse = [], False, False
    modules = {"humming": types.ModuleType("humming"), "humming.layer": types.ModuleType("humming.layer"),
               "humming.forward": types.ModuleType("humming.forward"),
               "humming.utils": types.ModuleType("humming.utils"),
               "humming.utils.weight": types.ModuleType("humming.utils.weight")}
    modules["humming.layer"].HummingLayer = FakeLayer
    modules["humming.forward"].may_quant_input = fake_may_quant_input
    modules["humming.utils.weight"].dequantize_weight = fake_dequantize_weight
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(peers, "_torch", lambda: fake_torch)
    peers._humming.cache_clear()
    yield
    peers._humming.cache_clear()


def test_settings_labels_headline_and_registry():
    peer = peers.HummingPeer()
    assert peer.name == "humming" and "humming" in peers.PEER_NAMES and peers.PEER_CLASSES["humming"] is peers.HummingPeer
    assert peer.settings == ("MXFP4 weights x bf16 tokens", "NVFP4 weights x bf16 tokens",
                             "MXFP4 weights x FP8 tokens (fp32 scales per 1x128, not MX)")
    assert peer.headline is True and peer.format_dependent is False
    assert "bench-humming" in peers.HummingPeer.__doc__   # the evidence row of its first GPU run


def test_bounds_and_useful_bytes():
    peer = peers.HummingPeer()
    k = 7168
    assert peer.row_err_bound(peers.HUMMING_MXFP4_BF16, k) == peers.ROW_ERR_BOUND
    assert peer.row_err_bound(peers.HUMMING_NVFP4_BF16, k) == peers.ROW_ERR_BOUND
    assert peer.row_err_bound(peers.HUMMING_MXFP4_FP8, k) == peers.ROW_ERR_BOUND + (k // 32) * 2.0 ** -13
    out = 9 * 16 * 2
    mx_w = 3 * 16 * (128 + 8)
    assert peer.setting_bytes(SHAPE, peers.HUMMING_MXFP4_BF16) == mx_w + 9 * 256 * 2 + out
    assert peer.setting_bytes(SHAPE, peers.HUMMING_NVFP4_BF16) == 3 * 16 * (128 + 16) + 3 * 4 + 9 * 256 * 2 + out
    assert peer.setting_bytes(SHAPE, peers.HUMMING_MXFP4_FP8) == mx_w + 9 * (256 + 2 * 4) + out
    assert peer.useful_bytes(SHAPE, "nvfp4", 0) == peer.setting_bytes(SHAPE, peers.HUMMING_MXFP4_FP8)


def test_skipped_with_the_reason_when_humming_does_not_import(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, get_device_capability=lambda: (9, 0))
    monkeypatch.setattr(peers, "_torch", lambda: types.SimpleNamespace(cuda=fake_cuda))
    monkeypatch.setitem(sys.modules, "humming", None)   # import humming -> ImportError
    peers._humming.cache_clear()
    loaded, skipped = peers.load_peers(["humming"])
    assert loaded == [] and "humming-kernels could not be imported" in skipped["humming"]


def test_loaded_when_humming_imports(fake_humming, monkeypatch):
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, get_device_capability=lambda: (9, 0))
    monkeypatch.setattr(peers, "_torch", lambda: types.SimpleNamespace(cuda=fake_cuda))
    loaded, skipped = peers.load_peers(["humming"])
    assert skipped == {} and isinstance(loaded[0], peers.HummingPeer)


def test_inputs_in_the_layout_its_api_wants(fake_humming):
    peer = peers.HummingPeer()
    inputs = peer.make_inputs(SHAPE, "nvfp4", 0, seed=1)
    assert len(FakeLayer.instances) == 3
    by_setting = dict(zip(peer.settings, FakeLayer.instances))
    for setting, layer in by_setting.items():
        kw = layer.kwargs
        assert (kw["shape_n"], kw["shape_k"], kw["num_experts"], kw["torch_dtype"]) == (16, 256, 3, "bfloat16")
        assert layer.events == ["cuda", "load", "transform"]   # its quantizer, then its packing
    mx, nv, fp8 = (by_setting[s].kwargs for s in peer.settings)
    assert mx["weight_config"] == {"quant_method": "humming", "dtype": "float4e2m1", "scale_dtype": "float8e8m0",
                                   "group_size": 32} == fp8["weight_config"]
    assert nv["weight_config"]["scale_dtype"] == "float8e4m3" and nv["weight_config"]["group_size"] == 16
    assert nv["weight_config"]["scale_2_type"] == "tensor"
    assert mx["input_config"] is None and nv["input_config"] is None
    assert fp8["input_config"] == {"quant_method": "humming", "dtype": "float8e4m3", "group_size": 128}
    # FP8 tokens come quantized from its own quantizer; bf16 tokens are the raw ones
    e_fp8 = inputs["settings"][peers.HUMMING_MXFP4_FP8]
    assert e_fp8["a"].dtype == "float8_e4m3fn"
    assert e_fp8["a_scale"].shape == (9, 2) and e_fp8["a_scale"].dtype == "float32"
    assert inputs["settings"][peers.HUMMING_MXFP4_BF16]["a"] is inputs["tokens_bf16"]
    assert inputs["tokens_bf16"].shape == (9, 256) and inputs["tokens_bf16"].dtype == "bfloat16"
    np.testing.assert_array_equal(inputs["expert_layout"].a, [0, 3, 8, 9])   # E + 1 offsets
    assert inputs["expert_layout"].a.dtype == np.int64

    for setting in peer.settings:
        out = peer.launch(inputs, setting)
        call = by_setting[setting].calls[-1]
        assert call["compute_config"] == {"gemm_type": "grouped_contiguous"}
        assert call["expert_layout"] is inputs["expert_layout"]
        assert (call["input_scale"] is None) == (setting != peers.HUMMING_MXFP4_FP8)
        assert out.shape == (9, 16)
    peer.launch(inputs)   # the default setting is the first
    assert len(by_setting[peers.HUMMING_MXFP4_BF16].calls) == 2
    with pytest.raises(ValueError, match="setting must be one of"):
        peer.launch(inputs, "W4A4")


def test_each_setting_checked_against_its_own_reference(fake_humming):
    peer = peers.HummingPeer()
    inputs = peer.make_inputs(SHAPE, "mxfp4", 0, seed=2)
    reference = peer.device_reference(inputs)
    assert set(reference) == set(peer.settings)
    for setting in peer.settings:
        check = peers.check_at_shape(peer, inputs, reference, setting)
        assert check.passed and check.max_row_err < 1e-6, (setting, check)   # stub output goes through float32
    # the references differ (other weights, other tokens): one setting's output fails another's reference
    wrong = {s: reference[peers.HUMMING_NVFP4_BF16] for s in peer.settings}
    assert not peers.check_at_shape(peer, inputs, wrong, peers.HUMMING_MXFP4_BF16).passed
    np.testing.assert_allclose(peer.reference(inputs), reference[peer.settings[0]].a, rtol=0, atol=1e-12)


def test_a_corrupted_output_fails_the_check_before_timing(fake_humming, monkeypatch):
    from gbs.lab import bench

    FakeLayer.corrupt = True
    timed = []
    monkeypatch.setattr(bench, "time_launches", lambda *a, **kw: timed.append(a) or None)
    m = bench._peer_measurement(peers.HummingPeer(), SHAPE, "mxfp4", 1000, 1.0, 1)
    assert timed == [] and m.status == bench.STATUS_FAIL and m.verified is False
    assert m.note.count("OUTPUT CHECK FAILED, not timed") == 3


def test_a_shape_the_peer_refuses_names_where_it_refused(fake_humming, monkeypatch):
    """A bare ``assert`` in the peer (humming's shape checks, e.g. on gpt-oss's 2880 x 2880) has no message: the row's
    note names the file and line that raised it, and nothing is timed."""
    from gbs.lab import bench

    FakeLayer.refuse = True
    timed = []
    monkeypatch.setattr(bench, "time_launches", lambda *a, **kw: timed.append(a) or None)
    m = bench._peer_measurement(peers.HummingPeer(), SHAPE, "mxfp4", 1000, 1.0, 1)
    assert timed == [] and m.status == bench.STATUS_FAIL
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "raise AssertionError   #" in text)
    assert m.note.count(f"output check could not run (AssertionError: raised at tests/test_peers_humming.py:{line})") == 3
