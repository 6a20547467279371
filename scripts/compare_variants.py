#!/usr/bin/env python3
"""Time the same sweep points on several source trees in one device call, in alternating rounds, so a
before / after comparison shares the GPU's state (clocks, temperature, the read ceiling of that call).

    # on the machine with the repository: a tree per revision (the gbs package and the scripts)
    python3 scripts/compare_variants.py --make-tree main wt/main
    python3 scripts/compare_variants.py --make-tree wip/some-branch wt/branch
    # on the GPU (the device tool copies untracked trees such as wt/ with the working tree)
    python3 scripts/compare_variants.py --rounds 2 --out $OUT main=wt/main new=wt/branch \\
        diag=wt/branch:GBS_SOME_SWITCH=1 tiled=wt/main:--b-layout=e2m1_h200_tiled -- plan:auto:nvfp4:decode_up

A variant is ``NAME=DIR[:ITEM[,ITEM...]]``, each item ``VAR=VALUE`` (an environment variable of its runs) or
``--OPTION=VALUE`` (a sweep option of its runs after the common ones, e.g. ``--b-layout=e2m1_h200_tiled``: two
weight layouts on one tree); a tree written by ``--make-tree`` names its commit in
``REVISION``, which its runs record as ``GBS_COMMIT``. Each run is a fresh process of the variant's own
``scripts/h200_stream_sweep.py`` (the tree's, else this checkout's) with ``DIR`` first on ``PYTHONPATH`` and
the variables set, so no variant's compiled kernels or module state serve another. Rounds alternate the
variants (A B A B ...). Each run writes ``OUT/<name>-r<round>.csv``; at the end a summary gives, per point,
each variant's median over the rounds and its ratio to the first variant. ``--dry-run`` prints the
commands instead of running them. Timing is the sweep's (``gbs.lab.timing.time_launches``)."""
from __future__ import annotations

import argparse
import csv
import os
import pathlib
import statistics
import subprocess
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWEEP = pathlib.Path("scripts") / "h200_stream_sweep.py"
TREE_PATHS = ("gbs", "scripts")   # what --make-tree takes from a revision
REVISION_FILE = "REVISION"        # --make-tree writes the revision's commit id there


class Variant(NamedTuple):
    name: str
    tree: pathlib.Path
    env: dict
    sweep_args: tuple = ()   # its own sweep options, after the common ones (argparse: the last one counts)


def parse_variant(text: str) -> Variant:
    """``NAME=DIR[:VAR=VALUE|--OPTION=VALUE,...]``."""
    name, sep, rest = text.partition("=")
    if not sep or not name.isidentifier() or not rest:
        raise ValueError(f"variant {text!r}: want NAME=DIR[:VAR=VALUE,...] (NAME an identifier)")
    tree, _, assignments = rest.partition(":")
    env, sweep_args = {}, []
    for item in filter(None, assignments.split(",")):
        var, sep, value = item.partition("=")
        option = var.startswith("--") and var[2:].replace("-", "_").isidentifier()
        if not sep or not (option or var.isidentifier()):
            raise ValueError(f"variant {text!r}: {item!r} is not VAR=VALUE or --OPTION=VALUE")
        if option:
            sweep_args += [var, value]
        else:
            env[var] = value
    return Variant(name, pathlib.Path(tree), env, tuple(sweep_args))


def make_tree(rev: str, directory: str) -> None:
    """Write ``TREE_PATHS`` of git revision ``rev`` into ``directory`` (``git archive``; must not exist yet),
    and its short commit id into ``directory/REVISION_FILE``: the commit its runs record."""
    target = pathlib.Path(directory)
    if target.exists():
        raise SystemExit(f"{target} exists: remove it first (a tree is one revision)")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *TREE_PATHS], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    (target / REVISION_FILE).write_text(commit + "\n")


def tree_environment(variant: Variant) -> dict:
    """The variables of ``variant``'s runs: its own, over ``GBS_COMMIT`` from its tree's ``REVISION_FILE``
    (so each variant's CSV rows name the commit that ran, not the one of the call's working tree)."""
    revision = variant.tree / REVISION_FILE
    env = {"GBS_COMMIT": revision.read_text().strip()} if revision.exists() else {}
    return {**env, **variant.env}


def run_commands(variants, points, rounds: int, out: pathlib.Path, sweep_args) -> list[tuple[str, int, list, dict]]:
    """(variant name, round, argv, environment) of every run, in the order they run."""
    runs = []
    for r in range(rounds):
        for v in variants:
            tree = v.tree.resolve()
            sweep = tree / SWEEP if (tree / SWEEP).exists() else ROOT / SWEEP
            argv = [sys.executable, str(sweep), *sweep_args, *v.sweep_args, "--csv", str(out / f"{v.name}-r{r}.csv"),
                    *points]
            env = dict(os.environ, **tree_environment(v))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
            runs.append((v.name, r, argv, env))
    return runs


def summary(variants, out: pathlib.Path, rounds: int) -> list[str]:
    """Per point: each variant's median over the rounds (us) and its ratio to the first variant."""
    times = {}   # (point, variant) -> [median_us of each round]
    for v in variants:
        for r in range(rounds):
            path = out / f"{v.name}-r{r}.csv"
            if not path.exists():
                continue
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    times.setdefault((row["point"], v.name), []).append(float(row["median_us"]))
    points = list(dict.fromkeys(point for point, _ in times))
    first = variants[0].name
    lines = [f"{'point':44}" + "".join(f"{v.name:>22}" for v in variants)]
    for point in points:
        base = times.get((point, first))
        cells = []
        for v in variants:
            t = times.get((point, v.name))
            if not t:
                cells.append(f"{'-':>22}")
                continue
            med = statistics.median(t)
            ratio = f" ({med / statistics.median(base):.3f}x)" if base and v.name != first else ""
            cells.append(f"{f'{med:.1f} us{ratio}':>22}")
        lines.append(f"{point:44}" + "".join(cells))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-tree", nargs=2, metavar=("REV", "DIR"), help="write a variant tree and exit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="variants_out", help="directory for the per-run CSVs")
    parser.add_argument("--budget-s", default="0.3", help="the sweep's timing budget per point")
    parser.add_argument("--b-layout", default="e2m1_h200", help="the sweep's weight layout")
    parser.add_argument("--a-layout", default="packed", help="the sweep's FP4 token layout (trees from before "
                        "a_layout existed take only the default)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("variants", nargs="*", metavar="NAME=DIR[:VAR=VALUE|--OPTION=VALUE,...]",
                        help="then -- and the points")
    words = list(sys.argv[1:] if argv is None else argv)
    cut = words.index("--") if "--" in words else len(words)
    args, points = parser.parse_args(words[:cut]), words[cut + 1:]
    if args.make_tree:
        make_tree(*args.make_tree)
        return 0
    variants = [parse_variant(t) for t in args.variants]
    if not variants or not points:
        parser.error("give at least one variant, then -- and at least one sweep point")
    if len({v.name for v in variants}) != len(variants):
        parser.error("variant names must differ")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    out = pathlib.Path(args.out)
    sweep_args = ["--budget-s", args.budget_s, "--b-layout", args.b_layout]
    if args.a_layout != "packed":
        sweep_args += ["--a-layout", args.a_layout]
    failures = 0
    for name, r, command, env in run_commands(variants, points, args.rounds, out, sweep_args):
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        print(f"== {name}, round {r}: {' '.join(f'{k}={v}' for k, v in sorted(extra.items()))} {' '.join(command)}",
              flush=True)
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            failures += subprocess.run(command, env=env).returncode != 0
    if not args.dry_run:
        print("\n".join(summary(variants, out, args.rounds)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
