"""First GPU run of the ``humming`` bench peer (issue 31 item 1): print the API facts the peer's stubs assume
(tensor shapes and dtypes after its quantizer, the SM90 input-scale layout), then run the peer's own check and
each setting's output check at a small and a prefill shape. Correctness only: timings printed here are smoke
(other work may share the GPU), the bench times.

    python scripts/humming_probe.py
"""
import sys
import time

import numpy as np

from gbs.lab import peers as peer_lib
from gbs.lab.peers import HUMMING_SETTINGS, PeerShape


def describe(name, value):
    shape = tuple(value.shape) if hasattr(value, "shape") else None
    return f"{name}: {type(value).__name__} {shape} {getattr(value, 'dtype', '')}"


def api_facts(peer):
    import humming
    import torch

    print("humming", getattr(humming, "__version__", "?"), "torch", torch.__version__)
    shape = PeerShape(256, 512, (5, 37, 130))
    inputs = peer.make_inputs(shape, "mxfp4", 1 << 20, seed=0)
    for setting, entry in inputs["settings"].items():
        print(f"[{setting}] element dtype {entry['element_dtype']}; m_major_scale {entry['m_major_scale']}")
        for name, value in entry["quantized"].items():
            print("   quantized", describe(name, value))
        print("  ", describe("a", entry["a"]))
        if entry["a_scale"] is not None:
            print("  ", describe("a_scale", entry["a_scale"]))
        config = entry["layer"].humming_config
        print("   config", {k: getattr(config, k) for k in dir(config)
                             if not k.startswith("_") and not callable(getattr(config, k))})
        out = peer.launch(inputs, setting)
        print("  ", describe("out", out), "nan", bool(torch.isnan(out).any()))
        ref = peer.setting_reference(peer.device_reference(inputs), setting)
        err = (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        print(f"   max abs err / max |ref| = {err:.3e}")


def main() -> int:
    peer = peer_lib.HummingPeer()
    api_facts(peer)
    check = peer_lib.check_peer(peer, "mxfp4")
    print("check_peer:", check)
    ok = check.passed
    for shape in (PeerShape(4096, 7168, (32,) * 32), PeerShape(2048, 7168, (1,) * 8)):
        t0 = time.time()
        inputs = peer.make_inputs(shape, "mxfp4", 1 << 20, seed=0)
        reference = peer.device_reference(inputs)
        for setting in HUMMING_SETTINGS:
            c = peer_lib.check_at_shape(peer, inputs, reference, setting)
            ok &= c.passed
            print(f"  N={shape.n} K={shape.k} groups={shape.num_groups}x{shape.group_sizes[0]} [{setting}]: {c}")
        print(f"  ({time.time() - t0:.1f} s with humming's compiles)")
        peer_lib.free_cached_memory()
    print("PROBE", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
