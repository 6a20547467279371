"""What ``python -m gbs ablate`` reads from ``data/ablations.csv`` without a GPU: modelled rows (``--model``), the
model's calibration (``--calibrate``), the dispatch tables (``--tables``) and the heatmaps (``--plot``).

``--model`` writes ``source="model"`` rows for the H200 and the B200 (``gbs.lab.perfmodel``) on the sweep's
grid (``gbs.lab.sweep_grid``); ``--calibrate`` fits the H200 model to the measured rows and prints its error;
``--tables`` prints the upstream, H200-derived and B200-model-derived dispatch tables side by side;
``--plot [DIR]`` writes one heatmap PNG per (GPU, source, format, shape, regime) (``heatmap_figure``).
"""
from __future__ import annotations

import datetime
import os
import sys
import textwrap
from typing import Iterable, Sequence

import numpy as np

from gbs.lab import ablation_data as ab
from gbs.lab.ablation_data import AblationRow, ProblemKey
from gbs.lab.environment import environment_fields
from gbs.lab.perfmodel import B200, H200, HARDWARE, ModelConfig, model_error, tile_label
from gbs.lab.sweep_csv import load_rows, log, merge_parts, row_order, update_csv
from gbs.lab.sweep_grid import (
    FULL_FORMATS,
    SHAPE_TITLES,
    build_grid,
    dispatch_pick,
    h200_kernel_stage_limit,
    parse_formats,
    parse_shapes,
)
from gbs.schedule import TileConfig

DEFAULT_PLOT_DIR = os.path.join("figures", "ablations")
CALIBRATION_MAX_ROWS = 300        # the fit runs on a stratified sample; the error is reported on all rows
MAX_LOAD_PANELS = 5               # heatmap panels per figure besides the regime's geometric mean
HEATMAP_VMAX = 3.0                # colour saturates at 3x the best time
HEATMAP_CMAP = "YlOrRd"
DEEPEST_COLUMN = "deepest"        # heatmap column shared by the knob sets' deepest rings (minimal grid)
TIE_TOLERANCE = 0.01              # a dispatch pick within 1 % of the fastest "ties" it in a title
POINTS_PER_INCH = 72
TITLE_CHAR_PT = 8.0               # average width of a character of the 13-pt bold figure title
DETAIL_CHAR_PT = 5.2              # ... and of the 9-pt caption


# ----------------------------------------------------------------------------------------------
# Modelled rows, calibration, dispatch tables
# ----------------------------------------------------------------------------------------------
def cmd_model(args) -> int:
    """Modelled rows for the H200 (the measured grid's configs) and the B200 (its own stage limits)."""
    formats, shapes = parse_formats(args.formats, args.grid), parse_shapes(args.shapes)
    merge_parts(args.csv, log)
    commit = environment_fields()["commit"]
    date = datetime.date.today().isoformat()
    rows = []
    for hw, limit in ((H200, h200_kernel_stage_limit()), (B200, None)):
        grid = build_grid(args.grid, hw, formats=formats, shapes=shapes, kernel_stage_limit=limit)
        for fmt in grid.formats:
            rows += ab.model_rows(hw, grid.problems[fmt], configs=grid.configs[fmt], date=date, commit=commit)
        log(f"modelled {hw.name}: {grid.num_rows} rows")
    added, replaced, total = update_csv(args.csv, rows, replace=True)
    log(f"{args.csv}: {added} modelled rows added, {replaced} replaced, {total} rows in all")
    return 0


def calibration_sample(rows: Sequence[AblationRow], max_rows: int) -> list[AblationRow]:
    """At most ``max_rows`` rows, spread evenly over each (format, shape, regime) group in proportion
    to its size (deterministic), so the fit sees every group."""
    if len(rows) <= max_rows:
        return list(rows)
    groups: dict[tuple, list[AblationRow]] = {}
    for row in sorted(rows, key=row_order):
        groups.setdefault((row.format, row.n, row.k, row.regime), []).append(row)
    sample = []
    for members in groups.values():
        take = max(1, round(max_rows * len(members) / len(rows)))
        sample += [members[int(i)] for i in np.linspace(0, len(members) - 1, min(take, len(members)))]
    return sample


def cmd_calibrate(args) -> int:
    merge_parts(args.csv, log)
    rows = [r for r in load_rows(args.csv) if r.source == ab.SOURCE_MEASURED and r.gpu == H200.key]
    if not rows:
        print(f"no measured {H200.key} rows in {args.csv}: run the sweep on the H200 first", file=sys.stderr)
        return 1
    sample = calibration_sample(rows, CALIBRATION_MAX_ROWS)
    result = ab.calibrate_rows(sample, H200)
    cases = [(ab.problem_shape(r.key), r.config) for r in rows]
    measured = [r.median_us for r in rows]
    before, after = model_error(cases, measured, H200), model_error(cases, measured, result.hardware)
    log(f"calibrated the H200 model on {len(sample)} of {len(rows)} measured rows "
         f"({result.iterations} iterations, {'converged' if result.converged else 'not converged'})")
    for name in result.free:
        log(f"  {name}: {getattr(result.initial, name):.4g} -> {getattr(result.hardware, name):.4g}"
             + (" (not constrained by these rows)" if name in result.unidentified else ""))
    log(f"\n### Before (all {len(rows)} measured rows)\n\n{before.to_markdown()}")
    log(f"\n### After\n\n{after.to_markdown()}")
    return 0


def cmd_tables(args) -> int:
    merge_parts(args.csv, log)
    rows = load_rows(args.csv)
    printed = 0
    for fmt in FULL_FORMATS:
        mine = [r for r in rows if r.format == fmt and r.gpu == H200.key and r.source == args.h200_source]
        theirs = [r for r in rows if r.format == fmt and r.gpu == B200.key and r.source == ab.SOURCE_MODEL]
        if not mine and not theirs:
            continue
        if not mine or not theirs:
            log(f"{fmt}: skipped: needs {H200.key} {args.h200_source} rows and {B200.key} model rows "
                 f"(has {len(mine)} and {len(theirs)}; run the sweep / --model)")
            continue
        shapes = sorted({r.key.shape for r in mine})
        tokens = sorted({int(r.avg_m) for r in mine if float(r.avg_m).is_integer()})
        try:
            tables = (ab.upstream_table(fmt, shapes=shapes, tokens_per_expert=tokens),
                      ab.derive_dispatch_table(mine, label=f"H200 {args.h200_source}"),
                      ab.derive_dispatch_table(theirs, label="B200 model"))
        except ValueError as err:
            log(f"{fmt}: cannot derive the tables: {err}")
            continue
        log(ab.compare_tables(*tables).markdown + "\n")
        printed += 1
    if not printed:
        print(f"no format of {args.csv} has both H200 and B200 rows", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# Heatmaps
# ----------------------------------------------------------------------------------------------
def _shape_title(n: int, k: int) -> str:
    name = SHAPE_TITLES.get((n, k))
    return f"{name} ({n}, {k})" if name else f"({n}, {k})"


def stage_columns(configs: Iterable[ModelConfig]) -> tuple[list[str], dict[ModelConfig, int]]:
    """Heatmap column labels and each config's column: one column per stage count, except that when
    several knob sets' deepest rings are stage counts no other config uses (the minimal grid's
    ``{2, 4, 6, deepest}``), those share one "deepest" column whose cells name their stage count."""
    configs = set(configs)
    deepest: dict[TileConfig, int] = {}
    for c in configs:
        deepest[c.tile_config] = max(deepest.get(c.tile_config, 0), c.stages)
    inner = {c.stages for c in configs if c.stages != deepest[c.tile_config]}
    lone = {d for d in deepest.values() if d not in inner}
    merged = lone if len(lone) > 1 else set()
    stages = sorted({c.stages for c in configs} - merged)
    labels = [str(s) for s in stages] + ([DEEPEST_COLUMN] if merged else [])
    return labels, {c: (len(stages) if c.stages in merged else stages.index(c.stages)) for c in configs}


def _cell_text(value: float, stages: int | None) -> str:
    if not np.isfinite(value):
        return ""
    text = f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return text if stages is None else f"{text}\nx{stages}"


def heatmap_figure(rows: Sequence[AblationRow]):
    """One figure for the rows of one (GPU, source, format, shape, regime): a panel of the geometric
    mean over the regime's loads of time / the load's best time, then one panel per load (at most
    ``MAX_LOAD_PANELS``, evenly spaced); rows = knob sets, columns = stages. A solid box marks the
    fastest config, a dashed one (in its regime's colour) the dispatch's pick."""
    import matplotlib as mpl
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    from gbs.lab import plotting

    first = rows[0]
    group = {(r.gpu, r.source, r.format, r.n, r.k, r.regime) for r in rows}
    if len(group) != 1:
        raise ValueError(f"heatmap_figure takes the rows of one (gpu, source, format, shape, regime), "
                         f"got {sorted(group)}")
    hw = HARDWARE.get(first.gpu)
    smem = (hw or H200).smem_per_sm
    times: dict[ProblemKey, dict[ModelConfig, float]] = {}
    for row in rows:
        times.setdefault(row.key, {})[row.config] = row.median_us
    keys = sorted(times, key=lambda k: (k.routing != "uniform", k.avg_m, k.num_active_experts))
    ratios = {key: {c: t / min(times[key].values()) for c, t in times[key].items()} for key in keys}
    common = set.intersection(*(set(r) for r in ratios.values()))
    geomean = {c: float(np.exp(np.mean([np.log(ratios[k][c]) for k in keys]))) for c in common}
    configs = {c for r in ratios.values() for c in r}
    tiles = sorted({c.tile_config for c in configs}, key=lambda t: (t.cta_group, t.mma_bn, not t.ab_swapped))
    labels, column = stage_columns(configs)
    deepest_column = len(labels) - 1 if labels[-1] == DEEPEST_COLUMN else None
    row_of = {t: i for i, t in enumerate(tiles)}
    shown = keys if len(keys) <= MAX_LOAD_PANELS else [keys[int(i)] for i in np.linspace(0, len(keys) - 1,
                                                                                            MAX_LOAD_PANELS)]
    picks = {key: dispatch_pick(key, smem) for key in keys}
    regime_pick = picks[keys[0]] if len(set(picks.values())) == 1 else None

    panels = [("geomean of " + (f"{len(keys)} loads" if len(keys) > 1 else "1 load"), geomean, regime_pick)]
    panels += [(f"{k.num_active_experts} x {k.avg_m:g} {k.routing}", ratios[k], picks[k]) for k in shown]
    source = "modelled with gbs.lab.perfmodel" if first.source == ab.SOURCE_MODEL else f"measured on {first.gpu_name}"
    width = 2.0 + len(panels) * (0.55 * len(labels) + 0.3)
    with mpl.rc_context(plotting.STYLE):
        fig = Figure(figsize=(max(width, 8.0), 2.3 + 0.32 * len(tiles)), layout="constrained")
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        image = None
        for ax, (title, values, pick) in zip(axes, panels):
            data = np.full((len(tiles), len(labels)), np.nan)
            text = [[""] * len(labels) for _ in tiles]
            for config, ratio in values.items():
                i, j = row_of[config.tile_config], column[config]
                data[i, j] = ratio
                text[i][j] = _cell_text(ratio, config.stages if j == deepest_column else None)
            image = plotting.annotated_heatmap(
                ax, data, x_labels=labels, y_labels=[tile_label(t) for t in tiles], cmap=HEATMAP_CMAP, vmin=1.0,
                vmax=HEATMAP_VMAX, annotations=text, fontsize=6.5)
            ax.set_title(title, fontsize=9, fontweight="normal", loc="center")
            ax.set_xlabel("stages")
            if values:
                best = min(values, key=values.get)
                ax.add_patch(Rectangle((column[best] - 0.5, row_of[best.tile_config] - 0.5), 1, 1, fill=False,
                                       ec="black", lw=2.2))
            if pick in values:
                ax.add_patch(Rectangle((column[pick] - 0.38, row_of[pick.tile_config] - 0.38), 0.76, 0.76,
                                       fill=False, ls="--", lw=1.8, ec=plotting.config_color(pick)))
        fig.colorbar(image, ax=list(axes), label="time / best time of the load", shrink=0.9)
        handles = [Patch(fill=False, ec="black", lw=2.2, label="fastest")]
        if regime_pick is not None:
            handles.append(Patch(fill=False, ec=plotting.config_color(regime_pick), ls="--", lw=1.8,
                                 label=f"dispatch's pick {regime_pick.label()}"))
        axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.12), fontsize=8, ncols=2)
        detail = (f"{first.format.upper()}, {_shape_title(first.n, first.k)}, "
                  f"{plotting.REGIME_LABELS.get(first.regime, first.regime)}, {source} ({first.date}, commit "
                  f"{first.commit}). Colour = time / the load's fastest config (first panel: geometric mean over the "
                  f"regime's {len(keys)} loads; {len(shown)} shown).")
        width_pt = fig.get_figwidth() * POINTS_PER_INCH
        plotting.finding_title(
            fig, textwrap.fill(_finding(first, keys, geomean, regime_pick), int(width_pt / TITLE_CHAR_PT)),
            textwrap.fill(detail, int(width_pt / DETAIL_CHAR_PT)))
    return fig


def _finding(first: AblationRow, keys, geomean: dict, pick: ModelConfig | None) -> str:
    """The title: what is fastest over the regime's loads and where the dispatch's pick stands."""
    from gbs.lab import plotting

    who = (f"Modelled {first.gpu.upper()}" if first.source == ab.SOURCE_MODEL else f"{first.gpu.upper()} measured")
    where = (f"{first.format.upper()} {_shape_title(first.n, first.k)}, "
             f"{plotting.REGIME_LABELS.get(first.regime, first.regime)}")
    if not geomean:
        return f"{who}, {where}: no config was run on every load"
    best = min(geomean, key=geomean.get)
    text = f"{who}, {where}: {best.label()} is fastest"
    if len(keys) > 1:
        text += f" (x{geomean[best]:.2f} of each load's best)"
    if pick is None:
        return text + "; the dispatch has no single pick here"
    if pick not in geomean:
        return text + f"; the dispatch's {pick.label()} was not run"
    slowdown = geomean[pick] / geomean[best]
    if pick == best:
        return text + "; the dispatch picks it"
    if slowdown < 1 + TIE_TOLERANCE:
        return text + f"; the dispatch's {pick.label()} ties it (within {100 * TIE_TOLERANCE:g} %)"
    return text + f"; the dispatch's {pick.label()} is {slowdown:.2f}x slower"


def plot_heatmaps(rows: Sequence[AblationRow], out_dir: str) -> list[str]:
    """One PNG per (GPU, source, format, shape, regime) of ``rows``; returns the paths."""
    groups: dict[tuple, list[AblationRow]] = {}
    for row in rows:
        groups.setdefault((row.gpu, row.source, row.format, row.n, row.k, row.regime), []).append(row)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for (gpu, source, fmt, n, k, regime), members in sorted(groups.items()):
        path = os.path.join(out_dir, f"{gpu}-{source}-{fmt}-{n}x{k}-{regime}.png")
        heatmap_figure(members).savefig(path)
        paths.append(path)
    return paths


def cmd_plot(args) -> int:
    merge_parts(args.csv, log)
    rows = load_rows(args.csv)
    if args.formats is not None:   # only what was asked for explicitly: the grid's default formats do not filter
        formats = parse_formats(args.formats, args.grid)
        rows = [r for r in rows if r.format in formats]
    if args.shapes is not None:
        shapes = parse_shapes(args.shapes)
        rows = [r for r in rows if r.key.shape in shapes]
    if not rows:
        print(f"no rows to plot in {args.csv}: run the sweep or --model first", file=sys.stderr)
        return 1
    paths = plot_heatmaps(rows, args.plot)
    log(f"wrote {len(paths)} heatmaps to {args.plot}")
    return 0


__all__ = [
    "DEFAULT_PLOT_DIR", "calibration_sample", "cmd_calibrate", "cmd_model", "cmd_plot", "cmd_tables",
    "heatmap_figure", "plot_heatmaps", "stage_columns",
]
