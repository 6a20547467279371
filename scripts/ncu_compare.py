#!/usr/bin/env python3
"""Profile one gbs sweep point and a peer's kernel on the same case with Nsight Compute, and print their whole-kernel
metrics side by side (``gbs.lab.ncu.compare_kernels``): duration, SM clock, tensor-pipe and issue-slot use, L2
sectors and busy, DRAM bytes, registers, shared memory, launch shape, the largest stall reasons.

    # on the GPU machine (ncu on PATH): folded MXFP4 large prefill up beside torch FP8 row-wise's fastest setting
    python3 scripts/ncu_compare.py --out $OUT/ncu --a-layout e4m3_folded --b-layout e4m3_folded \\
        plan:auto:mxfp4:large_prefill_up
    # a saved export (the kernels of one or more exports in one file), anywhere
    python3 scripts/ncu_compare.py --summarize data/artifacts/2026-12-03-fold-ncu-raw-9611d4e.csv.gz

Each profile is one launch (``--launch-skip 3 --launch-count 1``; ``--set full --page raw --csv``; clocks not locked,
``--clock-control none``, as the bench runs) in a fresh process: ours through ``scripts/h200_stream_sweep.py`` with
the point and layouts given, the peer through this script's ``--launch-peer`` (``gbs.lab.peers``' own inputs and
launch, in the setting asked, on the point's case). Both exports go into ``OUT/ncu_raw.csv.gz``, each after a
``## name`` line (the file an evidence row cites), and the table into ``OUT/ncu_compare.txt``.
"""
from __future__ import annotations

import argparse
import gzip
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gbs.lab import ncu                            # noqa: E402
from gbs.lab.cases import BENCH_CASES              # noqa: E402
from gbs.problem import PROBLEM_FORMATS            # noqa: E402

SWEEP = ROOT / "scripts" / "h200_stream_sweep.py"
NCU_PROFILE = ("--clock-control", "none", "--set", "full", "--page", "raw", "--csv",
               "--launch-skip", "3", "--launch-count", "1")
OURS_KERNEL = "grouped_matmul_h200"   # both H200 kernels' names start so
PEER_KERNELS = {"torch_fp8_rowwise": "device_kernel", "torch_bf16": "device_kernel"}   # CUTLASS's kernel template
PEER_SETTINGS = {"torch_fp8_rowwise": "use_fast_accum=True"}   # the peer's fastest setting where it has several
PEER_LAUNCHES = 8


def point_field(point: str, names, what: str) -> str:
    """The one field of a sweep point that is among ``names`` (its bench case, its problem format)."""
    found = [field for field in point.split(":") if field in names]
    if len(found) != 1:
        raise ValueError(f"point {point!r}: want exactly one field naming a {what} (one of {sorted(names)})")
    return found[0]


def launch_peer(name: str, setting: str, case_name: str, fmt: str, launches: int) -> None:
    """``launches`` launches of peer ``name`` on ``case_name`` (``--launch-peer``: the process ncu profiles)."""
    from gbs.lab import peers
    found, skipped = peers.load_peers([name])
    if not found:
        raise SystemExit(f"peer {name} cannot run here: {skipped.get(name)}")
    peer = found[0]
    if setting not in peer.settings:
        raise SystemExit(f"peer {name}: setting {setting!r} is not one of {peer.settings}")
    case = BENCH_CASES[case_name]
    shape = peers.PeerShape(case.n, case.k, tuple(int(s) for s in case.group_sizes() if s > 0))
    inputs = peer.make_inputs(shape, fmt, 0, 0)
    for _ in range(launches):
        peer.launch(inputs, setting)
    import torch
    torch.cuda.synchronize()


def profile(command: list[str], kernel_regex: str, export: pathlib.Path) -> None:
    ncu_bin = shutil.which("ncu")
    if ncu_bin is None:
        raise SystemExit("ncu is not on PATH (Nsight Compute)")
    full = [ncu_bin, *NCU_PROFILE, "-k", f"regex:{kernel_regex}", *command]
    print("$", " ".join(full), flush=True)
    with open(export, "w") as out:
        subprocess.run(full, stdout=out, stderr=subprocess.STDOUT, check=True, cwd=ROOT)


def write_table(kernels: list[ncu.RawKernel]) -> str:
    rows = [["metric"] + [f"{k.export}: {k.kernel[:40]}" for k in kernels]] + ncu.compare_kernels(kernels)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("point", nargs="?", help="a scripts/h200_stream_sweep.py point (ours)")
    parser.add_argument("--out", default="ncu_out", help="directory for the exports and the table")
    parser.add_argument("--a-layout", default=None, help="the sweep's token layout")
    parser.add_argument("--b-layout", default=None, help="the sweep's weight layout")
    parser.add_argument("--case", default=None, help="the peer's bench case (default: the point's)")
    parser.add_argument("--peer", default="torch_fp8_rowwise", help="a gbs.lab.peers name")
    parser.add_argument("--peer-setting", default=None, help="its launch setting (default: PEER_SETTINGS' or '')")
    parser.add_argument("--summarize", metavar="EXPORT", help="print the table of a saved raw export; profile nothing")
    parser.add_argument("--launch-peer", metavar="CASE", help=argparse.SUPPRESS)   # the peer's profiled process
    parser.add_argument("--format", default="mxfp4", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setting = args.peer_setting if args.peer_setting is not None else PEER_SETTINGS.get(args.peer, "")
    if args.launch_peer:
        launch_peer(args.peer, setting, args.launch_peer, args.format, PEER_LAUNCHES)
        return 0
    if args.summarize:
        print(write_table(ncu.read_raw_exports(args.summarize)))
        return 0
    if not args.point:
        parser.error("give a sweep point (or --summarize EXPORT)")
    case = args.case or point_field(args.point, BENCH_CASES, "bench case (or give --case)")
    fmt = point_field(args.point, PROBLEM_FORMATS, "problem format")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layouts = [opt for flag, value in (("--a-layout", args.a_layout), ("--b-layout", args.b_layout)) if value
               for opt in (flag, value)]
    ours = [sys.executable, str(SWEEP), "--budget-s", "0.05", *layouts, args.point]
    peer = [sys.executable, str(pathlib.Path(__file__).resolve()), "--peer", args.peer, "--peer-setting", setting,
            "--format", fmt, "--launch-peer", case]
    exports = [(out / "ours_raw.csv", ours, OURS_KERNEL),
               (out / f"{args.peer}_raw.csv", peer, PEER_KERNELS.get(args.peer, args.peer))]
    for path, command, regex in exports:
        profile(command, regex, path)
    combined = out / "ncu_raw.csv.gz"
    with gzip.open(combined, "wt") as f:
        for path, _, _ in exports:
            f.write(f"{ncu.EXPORT_MARK}{path.name}\n{path.read_text()}\n")
            path.unlink()
    table = write_table(ncu.read_raw_exports(combined))
    (out / "ncu_compare.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
