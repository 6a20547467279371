#!/usr/bin/env python3
"""Print the SM100 kernel's resource table: every configuration the dispatch can return, each
kernel assembled for sm_100a offline (no GPU), with registers, shared memory (the kernel's real
per-stage and fixed bytes beside the stages=auto formula of ``docs/design/dispatch.md``) and
TMEM columns. One compile per (formats, knobs), about 5 s each.

Usage: .venv/bin/python scripts/sm100_report.py
"""
import functools

from gbs.numba_kernels import sm100_build


def main() -> None:
    assemble = functools.cache(sm100_build.assemble)
    rows = sm100_build.resource_rows(sm100_build.dispatch_outcomes(), assemble)
    print(sm100_build.format_resource_table(rows))
    print("\nper stage: tiles + scale atoms + 16 B of mbarriers (full, empty; 32 B with the scale-store "
          "warps) vs the formula's 32 B.\nfixed: 1 KiB reservation + 2 output buffers + accumulator "
          "barriers (as the formula) + 100 B of scheduler ring and TMEM address vs the formula's 12 + 320 B.")


if __name__ == "__main__":
    main()
