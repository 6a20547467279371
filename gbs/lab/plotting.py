"""Shared plot helpers: one style, one colour vocabulary, and the pictures the project draws often.

Used by the notebooks (``notebooks/*.ipynb``) and by the plots of the ablation command. Every
helper draws on an ``Axes`` (or ``Figure``) the caller made, so figures compose; nothing here
calls ``plt.show()`` or writes files. Needs only matplotlib and numpy, no display (run headless
with ``MPLBACKEND=Agg``).

Conventions the helpers encode:

* A title states the finding, not the axes (``finding_title``): "Kimi's 4 weight tiles per expert
  starve the grid", not "SM occupancy vs experts". The how (shape, format, source) goes in the
  smaller detail line. Build findings from the computed numbers so they cannot go stale.
* Anything not computed with ``gbs`` or measured says where it comes from (``source_note``
  with e.g. ``"B200 datasheet"`` or ``"modelled"``).
* Regimes always wear ``REGIME_COLORS``; a dispatch config wears the colour of the regime whose
  knobs it uses (``config_color``), so the Kimi rule's decode config shows up in the small-prefill
  colour it borrows. Group slots get ``slot_color``; padding and skipped (-1) slots are grey.
"""
from __future__ import annotations

import textwrap
from typing import Mapping, NamedTuple, Sequence

import matplotlib as mpl
import numpy as np
from matplotlib import colors as mcolors
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from ..dispatch import (
    DEFAULT_CONFIG,
    REGIME_CONFIGS,
    REGIME_DECODE,
    REGIME_DEFAULT,
    REGIME_LARGE_PREFILL,
    REGIME_OVERRIDE,
    REGIME_SMALL_PREFILL,
)
from ..formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, ScaleLayout128x4, decode_elements, padded_scale_rows

# ----------------------------------------------------------------------------------------------
# Style and colours
# ----------------------------------------------------------------------------------------------
STYLE = {
    "figure.dpi": 110,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "figure.figsize": (9.0, 4.5),
    "figure.constrained_layout.use": True,
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.labelsize": 10.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
    "legend.fontsize": 9,
    "image.cmap": "viridis",
}

REGIME_COLORS = {
    REGIME_DECODE: "#2f7fc1",          # blue: few tokens, weight streaming
    REGIME_SMALL_PREFILL: "#f0a13a",   # orange: tens of tokens, the CTA pair
    REGIME_LARGE_PREFILL: "#c0392b",   # red: compute starts to matter
    REGIME_DEFAULT: "#9a9a9a",         # grey: the dtype routing's default config
    REGIME_OVERRIDE: "#7b4fa0",        # purple: caller's knobs
}
REGIME_LABELS = {
    REGIME_DECODE: "decode",
    REGIME_SMALL_PREFILL: "small prefill",
    REGIME_LARGE_PREFILL: "large prefill",
    REGIME_DEFAULT: "default config",
    REGIME_OVERRIDE: "override",
}
PADDING_COLOR = "#e3e3e3"
SKIPPED_COLOR = "#8c8c8c"
NOTE_COLOR = "0.35"
SLOT_CMAP = "tab20"            # qualitative: neighbouring slots stay distinguishable
ATOM_SLICE_CMAP = "tab10"      # the four 32-row slices of a 128x4 scale atom
FAINT_TEXT_SIZE = 8.5
AXIS_LABEL_ROOM_IN = 0.8       # inches a panel loses to its y tick labels and label


def apply_style() -> None:
    """Set the project's matplotlib style (``STYLE``) for the rest of the session."""
    mpl.rcParams.update(STYLE)


def slot_color(slot: int):
    """Colour of group slot ``slot`` (cycles through ``SLOT_CMAP``)."""
    cmap = mpl.colormaps[SLOT_CMAP]
    return cmap(int(slot) % cmap.N)


def config_color(config) -> str:
    """Colour of a dispatch config (anything with ``ab_swapped``, ``mma_bn``, ``cta_group``): the
    colour of the regime whose knobs it uses, grey for the default config, purple otherwise."""
    knobs = _config_knobs(config)
    for regime, regime_knobs in REGIME_CONFIGS.items():
        if knobs == regime_knobs:
            return REGIME_COLORS[regime]
    return REGIME_COLORS[REGIME_DEFAULT if knobs == DEFAULT_CONFIG else REGIME_OVERRIDE]


def config_label(config) -> str:
    """Short legend text of a config's knobs, e.g. ``"mma_bn 64, CTA pair, swapped"``."""
    ab_swapped, mma_bn, cta_group = _config_knobs(config)
    ctas = "CTA pair" if cta_group == 2 else "1 CTA"
    return f"mma_bn {mma_bn}, {ctas}" + (", swapped" if ab_swapped else ", not swapped")


def darken(color, factor: float = 0.75) -> str:
    """``color`` with its RGB scaled by ``factor`` (< 1 darker), as a hex string."""
    if not 0 <= factor <= 1:
        raise ValueError(f"factor must be in [0, 1], got {factor}")
    return mcolors.to_hex(np.array(mcolors.to_rgb(color)) * factor)


def _config_knobs(config) -> tuple[bool, int, int]:
    missing = [a for a in ("ab_swapped", "mma_bn", "cta_group") if not hasattr(config, a)]
    if missing:
        raise TypeError(f"config must have ab_swapped, mma_bn and cta_group (a KernelConfig); "
                        f"{type(config).__name__} lacks {missing}")
    return (bool(config.ab_swapped), int(config.mma_bn), int(config.cta_group))


# ----------------------------------------------------------------------------------------------
# Titles and provenance
# ----------------------------------------------------------------------------------------------
def _wrap_to_axes(text: str, ax: Axes, fontsize: float, em_per_char: float) -> str:
    """``text`` wrapped to roughly the width ``ax`` will get: its share of the figure's grid
    (constrained layout resizes axes only when the figure is drawn), less room for tick labels."""
    spec = ax.get_subplotspec()
    if spec is None:
        width_in = ax.get_position().width * ax.figure.get_figwidth()
    else:
        grid = spec.get_gridspec()
        ratios = grid.get_width_ratios() or [1] * grid.ncols
        share = sum(ratios[c] for c in spec.colspan) / sum(ratios)
        width_in = ax.figure.get_figwidth() * share - AXIS_LABEL_ROOM_IN
    width_pt = max(width_in, 1.0) * 72
    chars = max(24, int(width_pt / (fontsize * em_per_char)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def finding_title(target: Axes | Figure, finding: str, detail: str | None = None) -> None:
    """Title that states the finding, in bold; ``detail`` (shape, format, units) in small grey.

    On an ``Axes`` the detail is a line under the title and both wrap to the axes' width; on a
    ``Figure`` the finding is the suptitle and the detail a caption under the panels.
    """
    if not isinstance(finding, str) or not finding:
        raise ValueError("finding must be a non-empty string stating what the plot shows")
    detail_size = FAINT_TEXT_SIZE + 0.5
    if isinstance(target, Figure):
        target.suptitle(finding, fontweight="bold", fontsize=13, x=0.01, ha="left")
        if detail:
            target.supxlabel(detail, fontsize=detail_size, color=NOTE_COLOR, x=0.01, ha="left")
    elif isinstance(target, Axes):
        title_size = mpl.rcParams["axes.titlesize"]
        title_size = title_size if isinstance(title_size, (int, float)) else 12
        detail_text = _wrap_to_axes(detail, target, detail_size, 0.5) if detail else ""
        detail_lines = detail_text.count("\n") + 1 if detail else 0
        target.set_title(_wrap_to_axes(finding, target, title_size, 0.6), loc="left", fontweight="bold",
                         pad=6 + 1.3 * detail_size * detail_lines)
        if detail:
            target.annotate(detail_text, xy=(0, 1), xycoords="axes fraction", xytext=(0, 5),
                            textcoords="offset points", va="bottom", ha="left",
                            fontsize=detail_size, color=NOTE_COLOR)
    else:
        raise TypeError(f"target must be a matplotlib Axes or Figure, got {type(target).__name__}")


def source_note(ax: Axes, text: str, *, loc: str = "lower right") -> None:
    """A small boxed label inside ``ax`` saying where the plotted figures come from
    (e.g. "computed with gbs.dispatch", "measured on the H200", "B200 datasheet", "modelled")."""
    places = {"lower right": (0.99, 0.02, "right", "bottom"), "upper right": (0.99, 0.98, "right", "top"),
              "lower left": (0.01, 0.02, "left", "bottom"), "upper left": (0.01, 0.98, "left", "top")}
    if loc not in places:
        raise ValueError(f"loc must be one of {sorted(places)}, got {loc!r}")
    x, y, ha, va = places[loc]
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, fontsize=FAINT_TEXT_SIZE, style="italic",
            color=NOTE_COLOR, bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="0.8", alpha=0.9), zorder=10)


def power_of_two_axis(ax: Axes, lo: int, hi: int, *, axis: str = "x") -> None:
    """Log-2 scale with a tick at every power of two in ``[lo, hi]`` written as a plain integer."""
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', got {axis!r}")
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo}, hi={hi}")
    ticks = [2.0 ** e for e in range(int(np.ceil(np.log2(lo))), int(np.floor(np.log2(hi))) + 1)]
    labels = [f"{round(t)}" if t >= 1 else f"1/{round(1 / t)}" for t in ticks]   # plain integers, any size
    if axis == "x":
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels)
        ax.minorticks_off()
    else:
        ax.set_yscale("log", base=2)
        ax.set_yticks(ticks, labels)
        ax.minorticks_off()


def _text_color_on(color) -> str:
    """Black or white, whichever reads better on ``color``."""
    r, g, b = mcolors.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


# ----------------------------------------------------------------------------------------------
# Tables and heatmaps
# ----------------------------------------------------------------------------------------------
def value_table(ax: Axes, cell_text: Sequence[Sequence[str]], *, col_labels: Sequence[str],
                row_labels: Sequence[str] | None = None, cell_colors=None, fontsize: float = 9.0,
                scale_y: float = 1.4):
    """Draw a table of strings filling ``ax`` (axes hidden); returns the matplotlib ``Table``.

    ``cell_colors``: same shape as ``cell_text`` (colours, or None for white).
    """
    rows = [list(r) for r in cell_text]
    if not rows or any(len(r) != len(col_labels) for r in rows):
        raise ValueError(f"cell_text must be a non-empty list of rows with {len(col_labels)} entries "
                         "each (one per column label)")
    if row_labels is not None and len(row_labels) != len(rows):
        raise ValueError(f"row_labels has {len(row_labels)} entries for {len(rows)} rows")
    if cell_colors is not None:
        # row by row: a row may mix RGBA tuples, colour names and None (np.shape would not)
        if len(cell_colors) != len(rows) or any(len(row) != len(col_labels) for row in cell_colors):
            raise ValueError("cell_colors must have the shape of cell_text")
        cell_colors = [["white" if c is None else c for c in row] for row in cell_colors]
    ax.axis("off")
    table = ax.table(cellText=rows, colLabels=list(col_labels), rowLabels=row_labels,
                     cellColours=cell_colors, cellLoc="center", loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(fontsize)
    table.scale(1.0, scale_y)
    for (r, c), cell in table.get_celld().items():
        cell.set_edgecolor("0.75")
        if r == 0 or c == -1:
            cell.set_text_props(fontweight="bold")
            cell.set_facecolor("#f0f0f0")
    return table


def annotated_heatmap(ax: Axes, data, *, x_labels: Sequence, y_labels: Sequence, cmap="viridis",
                      vmin=None, vmax=None, fmt: str = "{:.0%}", annotations=None,
                      colorbar_label: str | None = None, annotate: bool = True, fontsize: float = 7.5):
    """``data[y, x]`` as coloured cells with their values written in; returns the image.

    ``fmt`` formats each value (``str.format``); ``annotations`` (same shape as ``data``, strings)
    replaces the formatted values. NaN cells are left blank.
    """
    data = np.asarray(data, dtype=float)
    if data.ndim != 2 or data.shape != (len(y_labels), len(x_labels)):
        raise ValueError(f"data must be 2-D (len(y_labels), len(x_labels)) = "
                         f"({len(y_labels)}, {len(x_labels)}), got shape {data.shape}")
    if annotations is not None and np.shape(annotations) != data.shape:
        raise ValueError(f"annotations must have the shape of data {data.shape}, got {np.shape(annotations)}")
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(x_labels)), [str(x) for x in x_labels])
    ax.set_yticks(range(len(y_labels)), [str(y) for y in y_labels])
    ax.grid(False)
    if annotate:
        for (y, x), value in np.ndenumerate(data):
            if np.isfinite(value):
                text = fmt.format(value) if annotations is None else str(annotations[y][x])
                ax.text(x, y, text, ha="center", va="center", fontsize=fontsize,
                        color=_text_color_on(image.cmap(image.norm(value))))
    if colorbar_label is not None:
        ax.figure.colorbar(image, ax=ax, label=colorbar_label, shrink=0.9)
    return image


# ----------------------------------------------------------------------------------------------
# Segmented bars (batches, budgets)
# ----------------------------------------------------------------------------------------------
class Segment(NamedTuple):
    """One piece of a horizontal bar: ``[start, start + length)`` in data units."""

    start: float
    length: float
    color: object
    label: str = ""
    hatch: str | None = None


def segmented_bar(ax: Axes, y: float, segments: Sequence[Segment], *, height: float = 0.6,
                  label_fontsize: float = 8.0, min_label_fraction: float = 0.0) -> list:
    """Draw ``segments`` as one horizontal bar at ``y``; a segment's label is written inside it
    when the segment is at least ``min_label_fraction`` of the x-range drawn. Returns the bars."""
    if not segments:
        return []
    x_lo = min(s.start for s in segments)
    x_hi = max(s.start + s.length for s in segments)
    span = max(x_hi - x_lo, 1e-12)
    bars = []
    for s in segments:
        if s.length < 0:
            raise ValueError(f"segment {s.label!r} has negative length {s.length}")
        bar = ax.barh(y, s.length, left=s.start, height=height, color=s.color, edgecolor="white",
                      linewidth=0.8, hatch=s.hatch)
        bars.append(bar)
        if s.label and s.length / span >= min_label_fraction:
            ax.text(s.start + s.length / 2, y, s.label, ha="center", va="center", fontsize=label_fontsize,
                    color=_text_color_on(s.color))
    return bars


def group_rows_picture(ax: Axes, a_offsets, expert_ids, a_scale_offsets=None, *,
                       label_slots: bool = True) -> None:
    """A grouped batch's token rows, slot by slot, and (with ``a_scale_offsets``) where each slot's
    scale rows land in the per-group padded scale array (every slot starts a fresh 128-row band).

    Top bar: rows of ``a`` (tokens concatenated, no padding). Bottom bar: rows of the padded scale
    array (``gbs.formats.padded_scale_rows``), each slot's padding up to its band's end hatched. Skipped slots (expert id -1) are grey; empty slots are marked with a triangle.
    """
    a_offsets = np.asarray(a_offsets, dtype=np.int64)
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    if a_offsets.ndim != 1 or expert_ids.ndim != 1 or a_offsets.size != expert_ids.size + 1:
        raise ValueError(f"need a_offsets of length len(expert_ids) + 1, got {a_offsets.shape} and "
                         f"{expert_ids.shape}")
    counts = np.diff(a_offsets)
    if np.any(counts < 0):
        raise ValueError("a_offsets must be non-decreasing")
    token_y, scale_y = 1.0, 0.0

    def slot_style(g):
        skipped = expert_ids[g] < 0
        name = f"g{g}: skip" if skipped else f"g{g}: e{expert_ids[g]}"
        return (SKIPPED_COLOR if skipped else slot_color(g)), ("//" if skipped else None), name

    total_rows = int(a_offsets[-1])
    x_hi = total_rows
    label_inside_fraction = 0.06   # narrower slots get a short label above the bar
    token_segments = []
    labels_above = 0
    for g in range(expert_ids.size):
        color, hatch, name = slot_style(g)
        if counts[g] == 0:
            ax.plot(a_offsets[g], token_y + 0.42, marker="v", color=color, markersize=7, zorder=5)
        label_above = counts[g] == 0 or counts[g] < label_inside_fraction * max(total_rows, 1)
        if label_slots and label_above:
            text = f"g{g}\nempty" if counts[g] == 0 else (f"g{g}\nskip" if expert_ids[g] < 0 else f"g{g}")
            # stagger neighbouring labels over two heights so they do not overlap
            ax.annotate(text, (a_offsets[g] + counts[g] / 2, token_y + 0.42), xytext=(0, 6 + 16 * (labels_above % 2)),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7, color=NOTE_COLOR)
            labels_above += 1
        if counts[g]:
            token_segments.append(Segment(a_offsets[g], counts[g], color,
                                          f"{name}\n{counts[g]} tok" if label_slots and not label_above else "",
                                          hatch))
    segmented_bar(ax, token_y, token_segments, height=0.55)

    labels = {token_y: "a rows\n(tokens, unpadded)"}
    if a_scale_offsets is not None:
        a_scale_offsets = np.asarray(a_scale_offsets, dtype=np.int64)
        if a_scale_offsets.shape != expert_ids.shape:
            raise ValueError(f"a_scale_offsets must have one entry per slot ({expert_ids.size}), "
                             f"got {a_scale_offsets.shape}")
        scale_rows = padded_scale_rows(a_offsets, a_scale_offsets)
        scale_segments = []
        for g in range(expert_ids.size):
            if counts[g] == 0:
                continue
            color, hatch, _ = slot_style(g)
            first = int(scale_rows[a_offsets[g]])
            padded = -(-counts[g] // SF_ATOM_ROWS) * SF_ATOM_ROWS   # whole 128-row bands
            scale_segments.append(Segment(first, counts[g], color, "", hatch))
            scale_segments.append(Segment(first + counts[g], padded - counts[g], PADDING_COLOR, "", "..."))
            # connect the slot's token rows to its scale rows
            ax.add_patch(Polygon([(a_offsets[g], token_y - 0.28), (a_offsets[g + 1], token_y - 0.28),
                                  (first + counts[g], scale_y + 0.28), (first, scale_y + 0.28)],
                                 closed=True, color=color, alpha=0.25, lw=0))
            x_hi = max(x_hi, first + padded)
        segmented_bar(ax, scale_y, scale_segments, height=0.55)
        for band_edge in range(0, x_hi + 1, SF_ATOM_ROWS):
            ax.axvline(band_edge, ymin=0.0, ymax=0.45, color="0.3", lw=0.8, ls=":")
        labels[scale_y] = f"a_scales rows\n(padded to {SF_ATOM_ROWS}-row bands)"
    ax.set_yticks(list(labels), list(labels.values()))
    ax.set_ylim(-0.6 if a_scale_offsets is not None else 0.55, 2.0)
    ax.set_xlim(-0.01 * x_hi, 1.01 * x_hi)
    ax.set_xlabel("row index")
    ax.grid(False)


# ----------------------------------------------------------------------------------------------
# Regime maps
# ----------------------------------------------------------------------------------------------
def _log_cell_edges(x: np.ndarray) -> np.ndarray:
    """Edges around increasing positive ``x`` at geometric midpoints (for a log x-axis)."""
    mids = np.sqrt(x[1:] * x[:-1])
    first = x[0] ** 2 / mids[0] if x.size > 1 else x[0] / 1.5
    last = x[-1] ** 2 / mids[-1] if x.size > 1 else x[-1] * 1.5
    return np.concatenate([[first], mids, [last]])


def _object_grid(name: str, rows, shape: tuple[int, int]) -> np.ndarray:
    """Nested sequences -> a 2-D object array of ``shape`` (entries such as tuples stay whole)."""
    rows = list(rows)
    if len(rows) != shape[0] or any(len(row) != shape[1] for row in rows):
        raise ValueError(f"{name} must be {shape[0]} rows of {shape[1]} entries (rows x len(x))")
    grid = np.empty(shape, dtype=object)
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            grid[i, j] = value
    return grid


def regime_map(ax: Axes, x, categories, *, row_labels: Sequence[str], colors: Mapping,
               category_labels: Mapping | None = None, run_labels=None,
               thresholds: Mapping[float, str] | None = None, xlabel: str = "",
               legend: bool = True, run_label_fontsize: float = 7.5) -> dict[str, int]:
    """Rows of coloured runs along a log-scaled x: which category (regime, config) holds where.

    ``x``: increasing positive values (e.g. avg tokens per expert). ``categories``: (rows, len(x))
    of hashable keys of ``colors``. ``run_labels``: optional (rows, len(x)) strings; a run is a
    stretch of equal (category, label) and shows its first label inside when it fits.
    ``thresholds``: {value: text}: a dashed line between ``value`` and the next x, labelled on top.
    Returns the y coordinate of each row, by row label (the first row is drawn on top).
    """
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.size == 0 or np.any(x <= 0) or np.any(np.diff(x) <= 0):
        raise ValueError("x must be a non-empty, strictly increasing 1-D array of positive values")
    cats = _object_grid("categories", categories, (len(row_labels), x.size))
    missing = {c for c in cats.ravel() if c not in colors}
    if missing:
        raise ValueError(f"categories without a colour: {sorted(map(str, missing))}")
    labels = (np.full(cats.shape, "", dtype=object) if run_labels is None
              else _object_grid("run_labels", run_labels, cats.shape))
    edges = _log_cell_edges(x)
    log_span = np.log(edges[-1] / edges[0])
    axes_width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72

    for row in range(cats.shape[0]):
        y = cats.shape[0] - 1 - row
        start = 0
        for i in range(1, x.size + 1):
            if i < x.size and cats[row, i] == cats[row, start] and labels[row, i] == labels[row, start]:
                continue
            lo, hi = edges[start], edges[i]
            color = colors[cats[row, start]]
            ax.add_patch(Rectangle((lo, y - 0.4), hi - lo, 0.8, color=color, lw=0, zorder=1))
            text = str(labels[row, start])
            width_pt = np.log(hi / lo) / log_span * axes_width_pt
            longest_line = max((len(t) for t in text.split("\n")), default=0)
            if text and width_pt > 0.6 * run_label_fontsize * longest_line:
                ax.text(np.sqrt(lo * hi), y, text, ha="center", va="center", fontsize=run_label_fontsize,
                        color=_text_color_on(color), zorder=3)
            start = i
    for value, text in (thresholds or {}).items():
        i = int(np.searchsorted(x, value, side="right"))
        edge = edges[i] if i < edges.size else edges[-1]
        ax.axvline(edge, color="black", ls="--", lw=1.1, zorder=2)
        ax.text(edge, cats.shape[0] - 0.45, text, ha="center", va="bottom", fontsize=8.5,
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.6"))
    ax.set_xscale("log")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(-0.6, cats.shape[0] - 0.4 + 0.5)
    ax.set_yticks(range(cats.shape[0]), list(reversed(row_labels)))
    ax.grid(False)
    ax.set_xlabel(xlabel)
    if legend:
        seen = list(dict.fromkeys(cats.ravel()))
        names = category_labels or {}
        handles = [Patch(color=colors[c], label=str(names.get(c, c))) for c in seen]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return {label: cats.shape[0] - 1 - row for row, label in enumerate(row_labels)}


# ----------------------------------------------------------------------------------------------
# Bits and bytes
# ----------------------------------------------------------------------------------------------
FP4_FIELD_NAMES = ("S", "E", "E", "M")   # E2M1, from bit 3 down to bit 0


def fp4_byte_picture(ax: Axes, byte: int, *, element_index: int = 0) -> None:
    """One packed FP4 byte drawn bit by bit: the low nibble (bits 3..0) holds element
    ``element_index`` (even), the high nibble (bits 7..4) element ``element_index + 1``."""
    if not isinstance(byte, (int, np.integer)) or not 0 <= int(byte) <= 0xFF:
        raise ValueError(f"byte must be an int in 0..255, got {byte!r}")
    if element_index % 2:
        raise ValueError(f"element_index must be even (the low nibble's element), got {element_index}")
    byte = int(byte)
    nibbles = {"high": byte >> 4, "low": byte & 0x0F}
    colors = {"high": slot_color(2), "low": slot_color(0)}
    for bit in range(8):
        x = 7 - bit                                  # bit 7 on the left, as the byte is written
        half = "high" if bit >= 4 else "low"
        color = colors[half]
        ax.add_patch(Rectangle((x, 0), 1, 1, facecolor=mcolors.to_rgba(color, 0.35), edgecolor="black", lw=1.2))
        ax.text(x + 0.5, 0.5, str((byte >> bit) & 1), ha="center", va="center", fontsize=16, fontweight="bold")
        ax.text(x + 0.5, 1.12, f"bit {bit}", ha="center", va="bottom", fontsize=8, color=NOTE_COLOR)
        ax.text(x + 0.5, -0.12, FP4_FIELD_NAMES[3 - bit % 4], ha="center", va="top", fontsize=9)
    for half, x0, index in (("high", 0, element_index + 1), ("low", 4, element_index)):
        code = nibbles[half]
        value = float(decode_elements(np.array([code], np.uint8), "e2m1")[0])
        ax.add_patch(Rectangle((x0, 0), 4, 1, fill=False, edgecolor=colors[half], lw=3.5))
        ax.text(x0 + 2, -0.55, f"{half} nibble = element {index}\ncode {code:#06b} = {value:+g}",
                ha="center", va="top", fontsize=10, color="black")
    ax.text(8.3, 0.5, f"= 0x{byte:02X}", ha="left", va="center", fontsize=14, fontweight="bold")
    ax.set_xlim(-0.3, 10.3)
    ax.set_ylim(-1.6, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")


def scale_layout_picture(ax: Axes, rows: int = SF_ATOM_ROWS, cols: int = SF_ATOM_COLS, *,
                         view: str = "bytes", annotate: bool = True):
    """The 128x4 scale layout of an ``rows x cols`` scale matrix (``ScaleLayout128x4``).

    ``view="bytes"``: the layout's bytes as 32 lines of 16 per 512-byte atom (atoms side by side);
    each byte is coloured by the 32-row slice of its scale row and written with that row (and the
    k-block when ``cols > 4``); padding bytes are blank. ``view="matrix"``: the scale matrix,
    rows along x and k-blocks along y, coloured by each scale's byte offset. Returns the image.
    """
    if view not in ("bytes", "matrix"):
        raise ValueError(f"view must be 'bytes' or 'matrix', got {view!r}")
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got rows={rows}, cols={cols}")
    layout = ScaleLayout128x4(rows, cols)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    offsets = layout.offset(r, c)
    ax.grid(False)
    if view == "matrix":
        image = ax.imshow(offsets.T, aspect="auto", interpolation="nearest", origin="lower",
                          extent=(-0.5, rows - 0.5, -0.5, cols - 0.5))
        ax.set_xlabel("scale row r (token or weight row)")
        ax.set_ylabel("k-block c")
        ax.set_yticks(range(cols))
        ax.figure.colorbar(image, ax=ax, label="byte offset in the layout", shrink=0.9)
        return image

    bytes_per_line = 16
    lines = SF_ATOM_BYTES // bytes_per_line          # 32 lanes per atom
    atoms = layout.nbytes // SF_ATOM_BYTES
    grid_rows = np.full((lines, atoms * bytes_per_line), -1)
    grid_cols = np.full_like(grid_rows, -1)
    atom, within = np.divmod(offsets, SF_ATOM_BYTES)
    line, position = np.divmod(within, bytes_per_line)
    grid_rows[line, atom * bytes_per_line + position] = r
    grid_cols[line, atom * bytes_per_line + position] = c

    slice_cmap = mpl.colormaps[ATOM_SLICE_CMAP]
    rgba = np.ones(grid_rows.shape + (4,))
    filled = grid_rows >= 0
    slices = (grid_rows % SF_ATOM_ROWS) // 32
    for s in range(4):
        base = np.array(mcolors.to_rgba(slice_cmap(s)))
        for kc in range(SF_ATOM_COLS):   # lighter for later k-blocks of the same 4-byte word
            mask = filled & (slices == s) & (grid_cols % SF_ATOM_COLS == kc)
            rgba[mask] = base * (1 - 0.16 * kc) + np.array([1, 1, 1, 1]) * 0.16 * kc
    image = ax.imshow(rgba, aspect="auto", interpolation="nearest",
                      extent=(-0.5, atoms * bytes_per_line - 0.5, lines - 0.5, -0.5))
    for a in range(1, atoms):
        ax.axvline(a * bytes_per_line - 0.5, color="black", lw=2)
    for w in range(1, atoms * 4):
        ax.axvline(w * 4 - 0.5, color="white", lw=1.2)
    if annotate:
        for (ln, x), row in np.ndenumerate(grid_rows):
            if row >= 0:
                text = str(row) if cols <= SF_ATOM_COLS else f"{row},{grid_cols[ln, x]}"
                ax.text(x, ln, text, ha="center", va="center", fontsize=6.5,
                        color=_text_color_on(rgba[ln, x, :3]))
    header = [f"s{(p // 4)}\nk{p % 4}" for p in range(bytes_per_line)] * atoms
    ax.set_xticks(range(atoms * bytes_per_line), header, fontsize=7)
    ax.set_xlabel("byte of the 16-byte line: 4-byte word = 32-row slice s, byte in the word = k-block k")
    ax.set_yticks(range(0, lines, 4))
    ax.set_ylabel("16-byte line = TMEM lane (byte offset // 16)")
    return image


# ----------------------------------------------------------------------------------------------
# Timelines (Gantt charts) and tile walks
# ----------------------------------------------------------------------------------------------
CTA_CMAP = "tab10"             # qualitative: one colour per CTA (or CTA pair) of a tile walk
TILE_PAIR_CMAP = "tab20"       # pairs of (dark, light) shades: one pair per tile of a timeline
MASKED_HATCH = "////"          # tile area the MMA computes but the store masks
MASKED_EDGE_ALPHA = 0.8


def cta_color(index: int):
    """Colour of CTA (or CTA pair) ``index`` of a tile walk (cycles through ``CTA_CMAP``)."""
    cmap = mpl.colormaps[CTA_CMAP]
    return cmap(int(index) % cmap.N)


def tile_shades(tile: int) -> tuple:
    """(dark, light) shades of one hue for tile ``tile`` of a timeline: dark for work on the
    tile's data (MMA, epilogue), light for its data in flight or waiting."""
    cmap = mpl.colormaps[TILE_PAIR_CMAP]
    pairs = cmap.N // 2
    first = 2 * (int(tile) % pairs)
    return cmap(first), cmap(first + 1)


def timeline(ax: Axes, rows: Sequence[tuple[str, Sequence[Segment]]], *, height: float = 0.7,
             label_fontsize: float = 7.0, min_label_fraction: float = 0.02) -> dict[str, int]:
    """A Gantt chart: one row per ``(label, segments)``, the first row on top; each ``Segment``
    is one busy interval ``[start, start + length)`` drawn as a bar. A segment's label is written
    inside it when the segment spans at least ``min_label_fraction`` of the whole time range.
    Returns the y coordinate of each row, by row label."""
    if not rows:
        raise ValueError("rows must hold at least one (label, segments) row")
    labels = [label for label, _ in rows]
    if len(set(labels)) != len(labels):
        raise ValueError(f"row labels must be distinct, got {labels}")
    segments = [s for _, row in rows for s in row]
    if any(s.length < 0 for s in segments):
        raise ValueError("segments must have non-negative lengths")
    x_lo = min((s.start for s in segments), default=0.0)
    x_hi = max((s.start + s.length for s in segments), default=1.0)
    span = max(x_hi - x_lo, 1e-12)
    y_of = {}
    for i, (label, row) in enumerate(rows):
        y = len(rows) - 1 - i
        y_of[label] = y
        for s in row:
            ax.barh(y, s.length, left=s.start, height=height, color=s.color, edgecolor="white", linewidth=0.5,
                    hatch=s.hatch)
            if s.label and s.length / span >= min_label_fraction:
                ax.text(s.start + s.length / 2, y, s.label, ha="center", va="center", fontsize=label_fontsize,
                        color=_text_color_on(s.color), clip_on=True)
    ax.set_yticks(list(y_of.values()), labels)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(x_lo - 0.01 * span, x_hi + 0.01 * span)
    ax.grid(axis="y", visible=False)
    return y_of


def tile_walk_picture(ax: Axes, cta_works, a_offsets, expert_ids, n: int, shape, *,
                      annotate: bool = True, legend: bool = True, slot_label_size: float = 7.5) -> None:
    """The output ``C`` (x: weight rows = output columns n, y: tokens, token 0 on top) covered tile
    by tile as a persistent grid walks it.

    ``cta_works``: ``gbs.schedule.assign_tiles(...)``'s list of each CTA's ``CtaWork``; ``shape``:
    the walk's ``TileShape``. Each CTA's part of a tile is filled with the colour of its CTA (one
    CTA per tile) or of its pair (``cta_group = 2``: rank 1's half a shade darker, a white line
    between the halves) and labelled with the tile's position in the walk (tiles only a few tokens
    tall alternate their labels left and right of centre). What a tile's MMA covers past the
    group's last token or past N (masked at the store) is hatched in the same colour. Skipped
    slots (expert id -1) are a grey band; empty slots a dashed line. Slot labels sit to the right
    of the axes; ``legend`` puts the CTA colours under it.
    """
    from ..schedule import TileShape

    if not isinstance(shape, TileShape):
        raise TypeError(f"shape must be a gbs.schedule.TileShape, got {type(shape).__name__}")
    a_offsets = np.asarray(a_offsets, dtype=np.int64)
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    if a_offsets.ndim != 1 or a_offsets.size != expert_ids.size + 1:
        raise ValueError(f"need a_offsets of length len(expert_ids) + 1, got {a_offsets.shape} and "
                         f"{expert_ids.shape}")
    if len(cta_works) % shape.cta_group:
        raise ValueError(f"cta_works lists {len(cta_works)} CTAs, not whole groups of {shape.cta_group}")
    total_tokens = int(a_offsets[-1])
    y_span = total_tokens + 0.5 * shape.tokens
    thin = 0.06 * y_span            # tiles thinner than this get a label off centre
    group = shape.cta_group
    cta_rows = shape.cta_weight_rows
    row_hi = -(-n // shape.weight_rows) * shape.weight_rows   # nominal extent of the last row block
    for g, expert in enumerate(expert_ids):
        lo, hi = int(a_offsets[g]), int(a_offsets[g + 1])
        if expert < 0 and hi > lo:
            ax.add_patch(Rectangle((0, lo), row_hi, hi - lo, facecolor=PADDING_COLOR, edgecolor="none", zorder=1))
            ax.text(n / 2, (lo + hi) / 2, f"slot {g}: expert -1, no tiles, rows not written", ha="center",
                    va="center", fontsize=8, color="black", zorder=6,
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.7", alpha=0.9))
    slot_of_token = np.searchsorted(a_offsets, np.arange(max(total_tokens, 1)), side="right") - 1
    for cta, works in enumerate(cta_works):
        for w in works:
            owner = cta // group
            color = cta_color(owner) if w.rank == 0 else darken(cta_color(owner), 0.8)
            nominal_lo = w.tile.row_start + w.rank * cta_rows
            nominal_tokens_end = w.token_start + shape.tokens
            if w.row_end > w.row_start:
                ax.add_patch(Rectangle((w.row_start, w.token_start), w.row_end - w.row_start,
                                       w.token_end - w.token_start, facecolor=color, edgecolor="white",
                                       lw=1.5 if group > 1 else 1.0, zorder=2))
            masked = [(nominal_lo, w.token_end, cta_rows, nominal_tokens_end - w.token_end),   # past the group
                      (max(n, nominal_lo), w.token_start, nominal_lo + cta_rows - max(n, nominal_lo),
                       w.token_end - w.token_start)]                                           # past N
            for x0, y0, width, height in masked:
                if width > 0 and height > 0:
                    ax.add_patch(Rectangle((x0, y0), width, height, fill=False, hatch=MASKED_HATCH,
                                           edgecolor=mcolors.to_rgba(color, MASKED_EDGE_ALPHA), lw=0.0, zorder=3))
            if annotate and w.rank == 0:
                left, right = w.tile.row_start, min(w.tile.row_end, w.tile.row_start + shape.weight_rows)
                x_mid = (left + right) / 2
                if w.token_end - w.token_start < thin:
                    side = 1 if slot_of_token[w.token_start] % 2 else -1
                    x_mid += side * (right - left) / 4
                ax.text(x_mid, (w.token_start + w.token_end) / 2, str(w.tile.index), ha="center", va="center",
                        fontsize=7.5, fontweight="bold", color=_text_color_on(color), zorder=5,
                        bbox=dict(boxstyle="round,pad=0.12", fc=color, ec="white", lw=0.5))
    # slot boundaries, and the slots' labels right of the axes, pushed apart where slots are thin
    min_gap = 0.045 * y_span
    label_y = -np.inf
    for g, expert in enumerate(expert_ids):
        lo, hi = int(a_offsets[g]), int(a_offsets[g + 1])
        ax.axhline(lo, color="black", lw=1.6 if hi == lo else 0.9, ls="--" if hi == lo else "-", zorder=4)
        label_y = max((lo + hi) / 2, label_y + min_gap)
        text = (f"slot {g}: empty" if hi == lo else
                f"slot {g}: skip, {hi - lo} tok" if expert < 0 else f"slot {g}: e{expert}, {hi - lo} tok")
        ax.annotate(text, xy=(1.0, (lo + hi) / 2), xycoords=("axes fraction", "data"),
                    xytext=(1.02, label_y), textcoords=("axes fraction", "data"), ha="left", va="center",
                    fontsize=slot_label_size, color=NOTE_COLOR if hi == lo or expert < 0 else "black",
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=0))
    ax.axhline(total_tokens, color="black", lw=0.9, zorder=4)
    ax.axvline(n, color="black", lw=1.2, zorder=4)
    for edge in range(shape.weight_rows, row_hi, shape.weight_rows):
        ax.axvline(edge, color="0.5", lw=0.6, ls=":", zorder=4)
    ax.set_xlim(0, row_hi)
    ax.set_ylim(y_span, 0)
    ax.set_xlabel("weight row = output column n of C")
    ax.set_ylabel("token = row of a and of C")
    ax.grid(False)
    if legend:
        owners = len(cta_works) // group
        name = "pair" if group > 1 else "CTA"
        handles = [Patch(color=cta_color(i), label=f"{name} {i}") for i in range(owners)]
        handles.append(Patch(facecolor="white", edgecolor="0.3", hatch=MASKED_HATCH, label="masked at the store"))
        if np.any(expert_ids < 0):
            handles.append(Patch(color=PADDING_COLOR, label="skipped slot"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=min(len(handles), 6),
                  fontsize=8, handlelength=1.5, columnspacing=1.0)


# ----------------------------------------------------------------------------------------------
# Knob sets of the ablation sweep
# ----------------------------------------------------------------------------------------------
# Colours of the knob sets no regime (nor the default config) uses, in the order of ``_legal_knob_sets``;
# none near the regime colours (blue, orange, red), the default grey or the override purple.
KNOB_SET_PALETTE = ("#393b79", "#2ca02c", "#98df8a", "#8c564b", "#c49c94", "#17becf", "#9edae5", "#bcbd22",
                    "#e377c2", "#a55194", "#5254a3")


def _legal_knob_sets() -> list[tuple[bool, int, int]]:
    """Every legal (ab_swapped, mma_bn, cta_group) in a fixed order: CTA group, mma_bn, swapped first."""
    from ..dispatch import CTA_GROUPS, LEGAL_MMA_BN

    return [(swapped, mma_bn, cta_group) for cta_group in CTA_GROUPS for mma_bn in LEGAL_MMA_BN[cta_group]
            for swapped in (True, False) if cta_group == 1 or swapped]


def knob_set_colors(knob_sets) -> dict:
    """A colour for each knob set (anything with ``ab_swapped``, ``mma_bn`` and ``cta_group``, such
    as ``gbs.schedule.TileConfig``), keyed by the objects passed. A regime's knob set wears its
    ``REGIME_COLORS`` entry and the default config grey (as ``config_color``); every other legal
    knob set has a colour of its own from ``KNOB_SET_PALETTE``, fixed by its place among all legal
    knob sets, so it keeps that colour in every figure whatever else is drawn beside it."""
    reserved = set(REGIME_CONFIGS.values()) | {DEFAULT_CONFIG}
    others = [knobs for knobs in _legal_knob_sets() if knobs not in reserved]
    if len(others) > len(KNOB_SET_PALETTE):
        raise ValueError(f"KNOB_SET_PALETTE has {len(KNOB_SET_PALETTE)} colours for {len(others)} knob sets")
    colors = {}
    for knob_set in knob_sets:
        knobs = _config_knobs(knob_set)
        if knobs in reserved:
            colors[knob_set] = config_color(knob_set)
        elif knobs in others:
            colors[knob_set] = KNOB_SET_PALETTE[others.index(knobs)]
        else:
            raise ValueError(f"{knobs} is not a legal (ab_swapped, mma_bn, cta_group); legal: {_legal_knob_sets()}")
    return colors
