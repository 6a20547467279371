"""The shared plot helpers (gbs.lab.plotting) keep the promises their docstrings make.

Every test draws with matplotlib's headless Agg backend and reads the artists back (patches,
texts, lines, images, tick labels) instead of comparing images, which would break on any font or
version change. Pictures of a library fact take the expected answer from the module that owns it:
the 128x4 layout from ``gbs.formats.scale_byte_offset``, the per-group scale padding from
``gbs.formats.pad_group_scales``, the tile walk from ``gbs.schedule.assign_tiles``, knob legality
from ``gbs.dispatch.check_mma_tile``. Layout-dependent results (title placement) are checked as
relations (above, inside), never as pixel values.
"""
import itertools
from collections import namedtuple

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib import colors as mcolors
from matplotlib.patches import Rectangle
from matplotlib.table import Table
from matplotlib.text import Text

from gbs import dispatch as dsp
from gbs.lab import plotting as gp
from gbs.formats import (SF_ATOM_BYTES, SF_ATOM_ROWS, ScaleLayout128x4, decode_elements, pad_group_scales, scale_byte_offset, unswizzle_scales)
from gbs.schedule import TileConfig, TileShape, assign_tiles, total_tiles

plt.switch_backend("Agg")     # headless: CI has no display, and nothing here is shown

# Anything with the three knobs (hashable, unlike a SimpleNamespace), and not a TileConfig: so it
# can also hold illegal knobs.
Knobs = namedtuple("Knobs", "ab_swapped mma_bn cta_group")

BYTES_PER_LAYOUT_LINE = 16    # scale_layout_picture draws an atom as 32 lines of 16 bytes


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _hex(color) -> str:
    return mcolors.to_hex(color, keep_alpha=False)


def _luminance(color) -> float:
    r, g, b = mcolors.to_rgb(color)
    return 0.299 * r + 0.587 * g + 0.114 * b


def _bars_at(ax, y):
    """(left, width, colour hex, hatch) of each non-empty rectangle centred on ``y``, left to right."""
    return sorted((p.get_x(), p.get_width(), _hex(p.get_facecolor()), p.get_hatch()) for p in ax.patches
                  if isinstance(p, Rectangle) and np.isclose(p.get_y() + p.get_height() / 2, y)
                  and p.get_width() > 0)


def _text_at(ax) -> dict:
    """{(x, y) rounded to ints: text} of the axes' texts."""
    return {tuple(int(round(v)) for v in t.get_position()): t.get_text() for t in ax.texts}


def _left_title(ax) -> Text:
    return next(c for c in ax.get_children() if isinstance(c, Text) and c.get_text() == ax.get_title(loc="left"))


def _all_legal_knobs():
    """Every (ab_swapped, mma_bn, cta_group) gbs.dispatch accepts, and the illegal rest of the grid."""
    mma_bns = sorted(set(itertools.chain(*dsp.LEGAL_MMA_BN.values())))
    legal, illegal = [], []
    for knobs in itertools.product((True, False), mma_bns, dsp.CTA_GROUPS):
        try:
            dsp.check_mma_tile(*knobs)
        except ValueError:
            illegal.append(Knobs(*knobs))
        else:
            legal.append(TileConfig(*knobs))
    return legal, illegal


# ----------------------------------------------------------------------------------------------
# Style and colours
# ----------------------------------------------------------------------------------------------
def test_apply_style_sets_every_style_entry():
    with mpl.rc_context():
        gp.apply_style()
        wrong = {key: mpl.rcParams[key] for key, value in gp.STYLE.items()
                 if mpl.rcParams[key] != (list(value) if isinstance(value, tuple) else value)}
    assert not wrong


def test_every_dispatch_regime_has_a_colour_and_a_label():
    assert set(gp.REGIME_COLORS) == set(gp.REGIME_LABELS) == set(dsp.REGIMES)


def test_regime_colours_are_distinct():
    assert len({_hex(c) for c in gp.REGIME_COLORS.values()}) == len(gp.REGIME_COLORS)


@pytest.mark.parametrize("color_of, cmap_name", [(gp.slot_color, gp.SLOT_CMAP), (gp.cta_color, gp.CTA_CMAP)])
def test_indexed_colours_are_distinct_over_one_cycle_of_their_colormap(color_of, cmap_name):
    cycle = mpl.colormaps[cmap_name].N
    assert len({color_of(i) for i in range(cycle)}) == cycle


@pytest.mark.parametrize("color_of, cmap_name", [(gp.slot_color, gp.SLOT_CMAP), (gp.cta_color, gp.CTA_CMAP)])
def test_indexed_colours_repeat_after_one_cycle_and_take_numpy_ints(color_of, cmap_name):
    cycle = mpl.colormaps[cmap_name].N
    assert [color_of(np.int64(i + cycle)) for i in range(cycle)] == [color_of(i) for i in range(cycle)]


def test_tile_shades_are_a_darker_and_a_lighter_shade_per_tile():
    pairs = mpl.colormaps[gp.TILE_PAIR_CMAP].N // 2
    assert all(_luminance(dark) < _luminance(light) for dark, light in map(gp.tile_shades, range(pairs)))


def test_tile_shades_are_distinct_per_tile_and_cycle():
    pairs = mpl.colormaps[gp.TILE_PAIR_CMAP].N // 2
    shades = [gp.tile_shades(t) for t in range(2 * pairs)]
    assert len(set(itertools.chain(*shades[:pairs]))) == 2 * pairs and shades[pairs:] == shades[:pairs]


@pytest.mark.parametrize("regime", sorted(dsp.REGIME_CONFIGS))
def test_a_config_with_a_regimes_knobs_wears_that_regimes_colour(regime):
    assert gp.config_color(TileConfig(*dsp.REGIME_CONFIGS[regime])) == gp.REGIME_COLORS[regime]


@pytest.mark.parametrize("knobs, regime", [(dsp.DEFAULT_CONFIG, dsp.REGIME_DEFAULT),
                                           ((False, 64, 1), dsp.REGIME_OVERRIDE),
                                           ((True, 256, 2), dsp.REGIME_OVERRIDE)])
def test_the_default_config_is_grey_and_other_knobs_purple(knobs, regime):
    assert gp.config_color(Knobs(*knobs)) == gp.REGIME_COLORS[regime]


@pytest.mark.parametrize("knobs, label", [((True, 64, 2), "mma_bn 64, CTA pair, swapped"),
                                          ((False, 128, 1), "mma_bn 128, 1 CTA, not swapped"),
                                          ((True, 8, 1), "mma_bn 8, 1 CTA, swapped")])
def test_config_label_spells_out_the_knobs(knobs, label):
    assert gp.config_label(Knobs(*knobs)) == label


@pytest.mark.parametrize("helper", [gp.config_color, gp.config_label])
def test_config_helpers_reject_objects_without_the_knobs(helper):
    with pytest.raises(TypeError, match="lacks"):
        helper(object())


@pytest.mark.parametrize("color, factor, want", [("#336699", 1.0, "#336699"), ("#336699", 0.0, "#000000"),
                                                 ("white", 0.5, "#808080"), ((0.2, 0.4, 0.8), 0.5, "#1a3366")])
def test_darken_scales_rgb_by_the_factor(color, factor, want):
    assert gp.darken(color, factor) == want


@pytest.mark.parametrize("factor", [-0.1, 1.5])
def test_darken_rejects_a_factor_outside_0_1(factor):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gp.darken("red", factor)


# ----------------------------------------------------------------------------------------------
# Knob-set colours of the ablation sweep
# ----------------------------------------------------------------------------------------------
def test_every_legal_knob_set_gets_a_colour_of_its_own():
    legal, _ = _all_legal_knobs()
    colors = gp.knob_set_colors(legal)
    assert len({_hex(c) for c in colors.values()}) == len(legal)


@pytest.mark.parametrize("knobs", _all_legal_knobs()[1])
def test_knob_set_colors_rejects_knobs_the_dispatch_calls_illegal(knobs):
    with pytest.raises(ValueError, match="not a legal"):
        gp.knob_set_colors([knobs])


def test_knob_set_colors_rejects_objects_without_the_knobs():
    with pytest.raises(TypeError, match="lacks"):
        gp.knob_set_colors([(True, 64, 2)])


def test_regime_and_default_knob_sets_wear_the_config_colour():
    reserved = [TileConfig(*k) for k in (*dsp.REGIME_CONFIGS.values(), dsp.DEFAULT_CONFIG)]
    colors = gp.knob_set_colors(reserved)
    assert all(colors[k] == gp.config_color(k) for k in reserved)


def test_the_other_knob_sets_use_each_palette_colour_once():
    legal, _ = _all_legal_knobs()
    others = [k for k in legal if gp.config_color(k) == gp.REGIME_COLORS[dsp.REGIME_OVERRIDE]]
    colors = gp.knob_set_colors(others)
    assert sorted(colors.values()) == sorted(gp.KNOB_SET_PALETTE)


def test_a_knob_sets_colour_does_not_depend_on_what_is_drawn_beside_it():
    legal, _ = _all_legal_knobs()
    together = gp.knob_set_colors(legal)
    assert {k: gp.knob_set_colors(reversed(legal[i:]))[k] for i, k in enumerate(legal)} == together


def test_knob_set_colors_are_keyed_by_the_objects_passed_and_equal_for_equal_knobs():
    tile_config, knobs = TileConfig(False, 32, 1), Knobs(False, 32, 1)
    colors = gp.knob_set_colors([tile_config, knobs])
    assert set(colors) == {tile_config, knobs} and colors[tile_config] == colors[knobs]


# ----------------------------------------------------------------------------------------------
# Titles and provenance
# ----------------------------------------------------------------------------------------------
def test_finding_title_on_axes_keeps_the_computed_numbers_whole():
    tiles, sms, busy = 4, 132, 48
    _, ax = plt.subplots(figsize=(3.5, 3))     # narrow: the title wraps
    gp.finding_title(ax, f"Kimi's {tiles} weight tiles per expert starve the grid: {busy} of {sms} SMs "
                         f"get a tile, {busy / sms:.1%} busy")
    title = ax.get_title(loc="left")
    assert "\n" in title and all(str(v) in title.replace("\n", " ") for v in (tiles, sms, busy, "36.4%"))


def test_finding_title_on_axes_is_bold():
    _, ax = plt.subplots()
    gp.finding_title(ax, "A finding")
    assert _left_title(ax).get_fontweight() in ("bold", 700)


def test_finding_title_wrapping_loses_no_word():
    finding = " ".join(f"word{i}" for i in range(40))
    _, ax = plt.subplots(figsize=(3, 3))
    gp.finding_title(ax, finding, finding)
    assert (ax.get_title(loc="left").replace("\n", " "), ax.texts[0].get_text().replace("\n", " ")) == (finding,) * 2


def test_finding_title_wraps_to_the_panels_width():
    finding = " ".join(f"word{i}" for i in range(40))
    lines = {}
    for columns in (1, 3):
        _, axes = plt.subplots(1, columns, figsize=(12, 3), squeeze=False)
        gp.finding_title(axes[0, 0], finding)
        lines[columns] = axes[0, 0].get_title(loc="left").count("\n") + 1
    assert lines[3] > lines[1]


def test_finding_title_detail_is_a_small_grey_line_on_the_axes():
    _, ax = plt.subplots()
    gp.finding_title(ax, "A finding", "n=512, k=7168, NVFP4")
    (detail,) = ax.texts
    assert (detail.get_text(), _hex(detail.get_color()), detail.get_fontsize() < _left_title(ax).get_fontsize()) == \
        ("n=512, k=7168, NVFP4", _hex(gp.NOTE_COLOR), True)


@pytest.mark.parametrize("detail_words", [4, 60])
def test_finding_title_detail_sits_between_the_axes_and_the_title(detail_words):
    with mpl.rc_context(gp.STYLE):
        figure, ax = plt.subplots(figsize=(6, 3))
        gp.finding_title(ax, "The finding, in a few words", " ".join(["detail"] * detail_words))
        figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    title, detail = _left_title(ax).get_window_extent(renderer), ax.texts[0].get_window_extent(renderer)
    assert ax.get_window_extent(renderer).y1 <= detail.y0 < detail.y1 < (title.y0 + title.y1) / 2


def test_finding_title_without_detail_adds_no_detail_text():
    _, ax = plt.subplots()
    gp.finding_title(ax, "A finding")
    assert list(ax.texts) == []


def test_finding_title_on_a_figure_is_the_suptitle_with_the_detail_as_caption():
    figure, _ = plt.subplots(1, 2)
    gp.finding_title(figure, "Both panels agree: 7 of 8", "gbs.dispatch, 8 experts")
    assert (figure.get_suptitle(), figure.get_supxlabel()) == ("Both panels agree: 7 of 8", "gbs.dispatch, 8 experts")


@pytest.mark.parametrize("target, finding, error, match", [
    ("axes", "", ValueError, "non-empty string"),
    ("axes", 42, ValueError, "non-empty string"),
    ("not an axes", "a finding", TypeError, "Axes or Figure"),
])
def test_finding_title_rejects_bad_input(target, finding, error, match):
    _, ax = plt.subplots()
    with pytest.raises(error, match=match):
        gp.finding_title(ax if target == "axes" else target, finding)


@pytest.mark.parametrize("loc", ["lower right", "upper right", "lower left", "upper left"])
def test_source_note_sits_inside_the_named_corner(loc):
    figure, ax = plt.subplots()
    gp.source_note(ax, "B200 datasheet", loc=loc)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    note, axes_box = ax.texts[0].get_window_extent(renderer), ax.get_window_extent(renderer)
    vertical, horizontal = loc.split()
    corner = ((note.y1 < axes_box.y0 + axes_box.height / 2) == (vertical == "lower"),
              (note.x0 > axes_box.x0 + axes_box.width / 2) == (horizontal == "right"))
    inside = axes_box.x0 <= note.x0 and note.x1 <= axes_box.x1 and axes_box.y0 <= note.y0 and note.y1 <= axes_box.y1
    assert corner == (True, True) and inside and ax.texts[0].get_text() == "B200 datasheet"


def test_source_note_rejects_an_unknown_corner():
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="lower right"):
        gp.source_note(ax, "modelled", loc="middle")


@pytest.mark.parametrize("lo, hi, ticks", [(3, 100, [4, 8, 16, 32, 64]), (1, 1, [1]), (0.25, 4, [0.25, 0.5, 1, 2, 4])])
def test_power_of_two_axis_ticks_every_power_of_two_in_range(lo, hi, ticks):
    _, ax = plt.subplots()
    gp.power_of_two_axis(ax, lo, hi)
    assert list(ax.get_xticks()) == ticks


def test_power_of_two_axis_labels_integers_plainly_and_fractions_as_one_over():
    _, ax = plt.subplots()
    gp.power_of_two_axis(ax, 0.25, 4096)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1/4", "1/2"] + [str(2 ** e) for e in range(13)]


def test_power_of_two_axis_labels_a_million_tokens_as_a_plain_integer():
    _, ax = plt.subplots()
    gp.power_of_two_axis(ax, 2 ** 19, 2 ** 20)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["524288", "1048576"]


@pytest.mark.parametrize("axis", ["x", "y"])
def test_power_of_two_axis_sets_a_base_2_log_scale_without_minor_ticks(axis):
    _, ax = plt.subplots()
    gp.power_of_two_axis(ax, 1, 64, axis=axis)
    scaled = ax.xaxis if axis == "x" else ax.yaxis
    assert (scaled.get_scale(), scaled.get_transform().base, len(scaled.get_minorticklocs())) == ("log", 2, 0)


@pytest.mark.parametrize("lo, hi, axis, match", [(0, 4, "x", "0 < lo <= hi"), (8, 4, "x", "0 < lo <= hi"),
                                                 (1, 4, "z", "'x' or 'y'")])
def test_power_of_two_axis_rejects_bad_input(lo, hi, axis, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.power_of_two_axis(ax, lo, hi, axis=axis)


# ----------------------------------------------------------------------------------------------
# Tables and heatmaps
# ----------------------------------------------------------------------------------------------
TABLE_TEXT = [["128", "7.0"], ["64", "12.5"], ["8", "n/a"]]
TABLE_COLUMNS = ["mma_bn", "KiB"]
TABLE_ROWS = ["large prefill", "small prefill", "decode"]


def _cell_texts(table: Table) -> dict:
    return {key: cell.get_text().get_text() for key, cell in table.get_celld().items()}


def test_value_table_draws_the_given_strings_under_their_labels():
    _, ax = plt.subplots()
    table = gp.value_table(ax, TABLE_TEXT, col_labels=TABLE_COLUMNS, row_labels=TABLE_ROWS)
    want = {(0, c): label for c, label in enumerate(TABLE_COLUMNS)}
    want |= {(r + 1, -1): label for r, label in enumerate(TABLE_ROWS)}
    want |= {(r + 1, c): text for r, row in enumerate(TABLE_TEXT) for c, text in enumerate(row)}
    assert _cell_texts(table) == want


def test_value_table_is_the_axes_only_table_and_hides_the_axes():
    _, ax = plt.subplots()
    table = gp.value_table(ax, TABLE_TEXT, col_labels=TABLE_COLUMNS)
    assert list(ax.tables) == [table] and not ax.axison


def test_value_table_labels_are_bold():
    _, ax = plt.subplots()
    table = gp.value_table(ax, TABLE_TEXT, col_labels=TABLE_COLUMNS, row_labels=TABLE_ROWS)
    weights = {key: cell.get_text().get_fontweight() for key, cell in table.get_celld().items()
               if key[0] == 0 or key[1] == -1}
    assert set(weights.values()) <= {"bold", 700} and len(weights) == len(TABLE_COLUMNS) + len(TABLE_ROWS)


def test_value_table_colours_cells_and_leaves_none_white():
    _, ax = plt.subplots()
    cell_colors = [["#ff000040", None], [None, "lightblue"], [None, None]]
    table = gp.value_table(ax, TABLE_TEXT, col_labels=TABLE_COLUMNS, cell_colors=cell_colors)
    got = [[mcolors.to_rgba(table[r + 1, c].get_facecolor()) for c in range(2)] for r in range(3)]
    assert got == [[mcolors.to_rgba("white" if c is None else c) for c in row] for row in cell_colors]


def test_value_table_takes_rgba_tuples_beside_none():
    _, ax = plt.subplots()
    table = gp.value_table(ax, [["a", "b"]], col_labels=["x", "y"], cell_colors=[[gp.slot_color(0), None]])
    assert mcolors.to_rgba(table[1, 0].get_facecolor()) == gp.slot_color(0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cell_text=[]), "non-empty"),
    (dict(cell_text=[["1", "2"], ["3"]]), "2 entries"),
    (dict(cell_text=TABLE_TEXT, row_labels=["only one"]), "row_labels has 1 entries for 3 rows"),
    (dict(cell_text=TABLE_TEXT, cell_colors=[[None, None]]), "shape of cell_text"),
])
def test_value_table_rejects_bad_input(kwargs, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.value_table(ax, col_labels=TABLE_COLUMNS, **kwargs)


HEAT = np.array([[0.1, 0.5, np.nan], [0.95, 0.0, 1.0]])


def test_annotated_heatmap_writes_each_formatted_value_on_its_cell_and_skips_nan():
    _, ax = plt.subplots()
    gp.annotated_heatmap(ax, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"], fmt="{:.0%}")
    want = {(x, y): f"{v:.0%}" for (y, x), v in np.ndenumerate(HEAT) if np.isfinite(v)}
    assert _text_at(ax) == want


def test_annotated_heatmap_annotations_replace_the_values():
    _, ax = plt.subplots()
    notes = [["a", "b", "c"], ["d", "e", "f"]]
    gp.annotated_heatmap(ax, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"], annotations=notes)
    assert sorted(_text_at(ax).values()) == ["a", "b", "d", "e", "f"]


def test_annotated_heatmap_ticks_carry_the_labels_at_the_cells():
    _, ax = plt.subplots()
    gp.annotated_heatmap(ax, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"])
    assert ([(t.get_position()[0], t.get_text()) for t in ax.get_xticklabels()],
            [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels()]) == \
        ([(0, "8"), (1, "64"), (2, "256")], [(0, "mxfp8"), (1, "nvfp4")])


def test_annotated_heatmap_image_holds_the_data():
    _, ax = plt.subplots()
    image = gp.annotated_heatmap(ax, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"])
    np.testing.assert_array_equal(np.ma.filled(image.get_array(), np.nan), HEAT)


def test_annotated_heatmap_text_contrasts_with_its_cell():
    _, ax = plt.subplots()
    gp.annotated_heatmap(ax, [[0.0, 1.0]], x_labels=["light", "dark"], y_labels=["row"], cmap="Greys", vmin=0, vmax=1)
    assert [t.get_color() for t in sorted(ax.texts, key=lambda t: t.get_position()[0])] == ["black", "white"]


def test_annotated_heatmap_adds_a_colorbar_only_when_labelled():
    figure, (bare, labelled) = plt.subplots(1, 2)
    gp.annotated_heatmap(bare, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"], annotate=False)
    gp.annotated_heatmap(labelled, HEAT, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"],
                         colorbar_label="share of peak")
    colorbars = [a for a in figure.axes if a not in (bare, labelled)]
    assert [c.get_ylabel() for c in colorbars] == ["share of peak"] and list(bare.texts) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(data=HEAT.T), r"got shape \(3, 2\)"),
    (dict(data=HEAT, annotations=[["a"]]), "annotations must have the shape"),
])
def test_annotated_heatmap_rejects_mismatched_shapes(kwargs, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.annotated_heatmap(ax, x_labels=[8, 64, 256], y_labels=["mxfp8", "nvfp4"], **kwargs)


# ----------------------------------------------------------------------------------------------
# Segmented bars and timelines
# ----------------------------------------------------------------------------------------------
SEGMENTS = [gp.Segment(0, 60, "#2f7fc1", "A tiles"), gp.Segment(60, 30, "#f0a13a", "B tiles", "//"),
            gp.Segment(90, 1, "#c0392b", "tiny")]


def test_segmented_bar_draws_each_segment_at_its_place_and_colour():
    _, ax = plt.subplots()
    bars = gp.segmented_bar(ax, 2.0, SEGMENTS)
    assert len(bars) == len(SEGMENTS) and _bars_at(ax, 2.0) == [(s.start, s.length, s.color, s.hatch) for s in SEGMENTS]


def test_segmented_bar_labels_only_segments_wide_enough():
    _, ax = plt.subplots()
    gp.segmented_bar(ax, 2.0, SEGMENTS, min_label_fraction=0.05)
    assert _text_at(ax) == {(30, 2): "A tiles", (75, 2): "B tiles"}


def test_segmented_bar_of_nothing_draws_nothing():
    _, ax = plt.subplots()
    assert gp.segmented_bar(ax, 0.0, []) == [] and list(ax.patches) == []


def test_segmented_bar_rejects_a_negative_length():
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="negative length"):
        gp.segmented_bar(ax, 0.0, [gp.Segment(0, 5, "red"), gp.Segment(5, -1, "blue", "late")])


TIMELINE_ROWS = [("scheduler", [gp.Segment(0, 2, "#393b79", "tile 0")]),
                 ("TMA", [gp.Segment(2, 10, "#2ca02c", "load"), gp.Segment(12, 10, "#2ca02c")]),
                 ("MMA", [])]


def test_timeline_puts_the_first_row_on_top_and_labels_each_row():
    _, ax = plt.subplots()
    row_y = gp.timeline(ax, TIMELINE_ROWS)
    ticks = {t.get_text(): t.get_position()[1] for t in ax.get_yticklabels()}
    assert row_y == {"scheduler": 2, "TMA": 1, "MMA": 0} and ticks == row_y


def test_timeline_draws_every_segment_on_its_row():
    _, ax = plt.subplots()
    row_y = gp.timeline(ax, TIMELINE_ROWS)
    drawn = sorted(b for y in row_y.values() for b in _bars_at(ax, y))
    assert drawn == sorted((s.start, s.length, s.color, s.hatch) for _, row in TIMELINE_ROWS for s in row)


def test_timeline_labels_only_segments_wide_enough():
    _, ax = plt.subplots()
    gp.timeline(ax, TIMELINE_ROWS, min_label_fraction=0.2)
    assert _text_at(ax) == {(7, 1): "load"}


def test_timeline_x_range_covers_every_segment():
    _, ax = plt.subplots()
    gp.timeline(ax, TIMELINE_ROWS)
    lo, hi = ax.get_xlim()
    assert lo < 0 and hi > 22


@pytest.mark.parametrize("rows, match", [
    ([], "at least one"),
    ([("TMA", []), ("TMA", [])], "distinct"),
    ([("TMA", [gp.Segment(0, -1, "red")])], "non-negative"),
])
def test_timeline_rejects_bad_rows(rows, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.timeline(ax, rows)


# ----------------------------------------------------------------------------------------------
# Per-group padding of the token scales (group_rows_picture)
# ----------------------------------------------------------------------------------------------
# Slot 1 is empty, slot 2 skipped (expert -1); sizes on and off the 128-row bands.
GROUP_A_OFFSETS = np.array([0, 5, 5, 300, 428, 700])
GROUP_EXPERT_IDS = np.array([3, 7, -1, 0, 2])
TOKEN_BAR_Y, SCALE_BAR_Y = 1.0, 0.0    # where group_rows_picture draws its two bars


def _group_picture(**kwargs):
    _, ax = plt.subplots(figsize=(12, 3.6))
    scales = (np.repeat(np.arange(1, GROUP_EXPERT_IDS.size + 1), np.diff(GROUP_A_OFFSETS))[:, None]
              .astype(np.uint8))                                 # each token's scale byte = its slot + 1
    a_scales, a_scale_offsets = pad_group_scales(scales, GROUP_A_OFFSETS)
    gp.group_rows_picture(ax, GROUP_A_OFFSETS, GROUP_EXPERT_IDS, a_scale_offsets, **kwargs)
    return ax, unswizzle_scales(a_scales, cols=1)[:, 0]


def _group_slot_color(g):
    return _hex(gp.SKIPPED_COLOR if GROUP_EXPERT_IDS[g] < 0 else gp.slot_color(g))


def test_group_rows_token_bar_shows_each_slots_rows_unpadded():
    ax, _ = _group_picture()
    slots = enumerate(zip(GROUP_A_OFFSETS, GROUP_A_OFFSETS[1:]))
    want = [(lo, hi - lo, _group_slot_color(g)) for g, (lo, hi) in slots if hi > lo]
    assert [bar[:3] for bar in _bars_at(ax, TOKEN_BAR_Y)] == want


def test_group_rows_skipped_slots_are_hatched_grey():
    ax, _ = _group_picture()
    skipped = [bar for bar in _bars_at(ax, TOKEN_BAR_Y) if bar[2] == _hex(gp.SKIPPED_COLOR)]
    assert [(bar[0], bar[3]) for bar in skipped] == [(5, "//")]


def test_group_rows_empty_slots_are_marked_with_a_triangle():
    ax, _ = _group_picture()
    marked = [line.get_xdata()[0] for line in ax.lines if line.get_marker() == "v"]
    assert marked == [GROUP_A_OFFSETS[g] for g in np.flatnonzero(np.diff(GROUP_A_OFFSETS) == 0)]


def test_group_rows_scale_bar_puts_each_slot_where_pad_group_scales_does():
    ax, padded_slots = _group_picture()
    drawn = {}
    for left, width, color, _ in _bars_at(ax, SCALE_BAR_Y):
        if color != _hex(gp.PADDING_COLOR):
            drawn[color] = (left, left + width)
    want = {_group_slot_color(g): (rows.min(), rows.max() + 1)
            for g in range(GROUP_EXPERT_IDS.size) if (rows := np.flatnonzero(padded_slots == g + 1)).size}
    assert drawn == want


def test_group_rows_scale_bar_pads_each_slot_to_its_band_end_and_fills_the_padded_array():
    ax, padded_slots = _group_picture()
    extents = [(left, left + width) for left, width, _, _ in _bars_at(ax, SCALE_BAR_Y)]
    contiguous = all(a[1] == b[0] for a, b in zip(extents, extents[1:]))
    band_ends = [hi for _, hi in extents if hi % SF_ATOM_ROWS == 0]
    assert contiguous and (extents[0][0], extents[-1][1]) == (0, padded_slots.size) and \
        len(band_ends) == np.count_nonzero(np.diff(GROUP_A_OFFSETS))


def test_group_rows_padding_is_where_pad_group_scales_leaves_zeros():
    ax, padded_slots = _group_picture()
    padding = np.zeros(padded_slots.size, bool)
    for left, width, color, _ in _bars_at(ax, SCALE_BAR_Y):
        if color == _hex(gp.PADDING_COLOR):
            padding[int(left):int(left + width)] = True
    np.testing.assert_array_equal(padding, padded_slots == 0)


def test_group_rows_marks_every_128_row_band_edge():
    ax, padded_slots = _group_picture()
    edges = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":")
    assert edges == list(range(0, padded_slots.size + 1, SF_ATOM_ROWS))


def test_group_rows_labels_wide_slots_inside_and_narrow_or_empty_ones_above():
    ax, _ = _group_picture()
    assert {t.get_text() for t in ax.texts} == {"g0", "g1\nempty", "g2: skip\n295 tok", "g3: e0\n128 tok",
                                               "g4: e2\n272 tok"}   # g0 (5 tokens) is too narrow: label above


def test_group_rows_without_scale_offsets_draws_only_the_token_bar():
    _, ax = plt.subplots()
    gp.group_rows_picture(ax, GROUP_A_OFFSETS, GROUP_EXPERT_IDS)
    assert _bars_at(ax, SCALE_BAR_Y) == [] and [t.get_position()[1] for t in ax.get_yticklabels()] == [TOKEN_BAR_Y]


@pytest.mark.parametrize("a_offsets, expert_ids, a_scale_offsets, match", [
    ([0, 5], [1, 2], None, "len\\(expert_ids\\) \\+ 1"),
    ([0, 5, 3], [1, 2], None, "non-decreasing"),
    ([0, 5, 9], [1, 2], [0], "one entry per slot"),
])
def test_group_rows_picture_rejects_bad_offsets(a_offsets, expert_ids, a_scale_offsets, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.group_rows_picture(ax, a_offsets, expert_ids, a_scale_offsets)


# ----------------------------------------------------------------------------------------------
# Regime maps
# ----------------------------------------------------------------------------------------------
REGIME_X = [1, 2, 4, 8, 16, 32]
REGIME_CATEGORIES = [["b", "b", "a", "a", "a", "c"], ["c"] * 6]    # first seen: b, a, c (not sorted)
REGIME_RUN_LABELS = [["x", "x", "y", "y", "z", "z"], [""] * 6]
REGIME_COLORS_BY_CATEGORY = {"a": "#2f7fc1", "b": "#f0a13a", "c": "#c0392b"}
ROOT_2 = 2 ** 0.5     # REGIME_X doubles, so cell edges sit a factor sqrt(2) either side of each x


def _regime_map(**kwargs):
    _, ax = plt.subplots(figsize=(10, 3))
    kwargs = dict(row_labels=["top row", "bottom row"], colors=REGIME_COLORS_BY_CATEGORY,
                  run_labels=REGIME_RUN_LABELS) | kwargs
    row_y = gp.regime_map(ax, REGIME_X, REGIME_CATEGORIES, **kwargs)
    return ax, row_y


def test_regime_map_draws_the_first_row_on_top_and_ticks_each_row():
    ax, row_y = _regime_map()
    ticks = {t.get_text(): t.get_position()[1] for t in ax.get_yticklabels()}
    assert row_y == {"top row": 1, "bottom row": 0} and ticks == row_y


def test_regime_map_draws_one_box_per_run_between_geometric_cell_edges():
    ax, row_y = _regime_map()
    boxes = {y: [(round(left, 9), round(left + width, 9), color) for left, width, color, _ in _bars_at(ax, y)]
             for y in row_y.values()}

    def run(lo, hi, category):   # cells lo..hi (inclusive)
        return (round(REGIME_X[lo] / ROOT_2, 9), round(REGIME_X[hi] * ROOT_2, 9), REGIME_COLORS_BY_CATEGORY[category])

    assert boxes == {1: [run(0, 1, "b"), run(2, 3, "a"), run(4, 4, "a"), run(5, 5, "c")], 0: [run(0, 5, "c")]}


def test_regime_map_x_axis_is_log_and_spans_the_outer_cell_edges():
    ax, _ = _regime_map()
    assert ax.get_xscale() == "log" and np.allclose(ax.get_xlim(), (REGIME_X[0] / ROOT_2, REGIME_X[-1] * ROOT_2))


def test_regime_map_writes_run_labels_that_fit_inside_their_run():
    ax, _ = _regime_map()
    written = sorted((t.get_text(), round(t.get_position()[0], 6), t.get_position()[1]) for t in ax.texts)
    assert written == [("x", round(2 ** 0.5, 6), 1), ("y", round(32 ** 0.5, 6), 1), ("z", 16.0, 1), ("z", 32.0, 1)]


def test_regime_map_leaves_out_run_labels_too_long_for_their_run():
    long_label = "a label far too long for one narrow cell"
    ax, _ = _regime_map(run_labels=[["x", "x", "y", "y", long_label, "z"], [""] * 6])
    assert long_label not in {t.get_text() for t in ax.texts}


def test_regime_map_threshold_is_a_dashed_line_between_the_value_and_the_next_x():
    ax, _ = _regime_map(thresholds={8: "avg_m = 8"})
    (line,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    (label,) = [t for t in ax.texts if t.get_text() == "avg_m = 8"]
    assert np.isclose(line.get_xdata()[0], (8 * 16) ** 0.5) and np.isclose(label.get_position()[0], (8 * 16) ** 0.5)


def test_regime_map_legend_lists_categories_in_first_seen_order_with_their_names():
    ax, _ = _regime_map(category_labels={"a": "decode knobs", "c": "large prefill knobs"})
    legend = ax.get_legend()
    assert [(t.get_text(), _hex(h.get_facecolor())) for t, h in zip(legend.get_texts(), legend.legend_handles)] == \
        [("b", "#f0a13a"), ("decode knobs", "#2f7fc1"), ("large prefill knobs", "#c0392b")]


def test_regime_map_takes_tuple_categories_such_as_knob_sets():
    knob_sets = [[dsp.REGIME_CONFIGS[dsp.REGIME_DECODE]] * 3 + [dsp.DEFAULT_CONFIG] * 3]
    _, ax = plt.subplots()
    gp.regime_map(ax, REGIME_X, knob_sets, row_labels=["knobs"],
                  colors={k: gp.config_color(Knobs(*k)) for k in set(knob_sets[0])})
    assert [bar[2] for bar in _bars_at(ax, 0)] == [gp.REGIME_COLORS[dsp.REGIME_DECODE],
                                                   gp.REGIME_COLORS[dsp.REGIME_DEFAULT]]


@pytest.mark.parametrize("x, categories, run_labels, match", [
    ([1, 2, 4], [["a", "b", "d"]], None, "without a colour: \\['d'\\]"),
    ([1, 2, 4], [["a", "a"]], None, "1 rows of 3 entries"),
    ([0, 2, 4], [["a"] * 3], None, "positive"),
    ([1, 1, 4], [["a"] * 3], None, "strictly increasing"),
    ([], [[]], None, "non-empty"),
    ([1, 2, 4], [["a"] * 3], [["x"] * 2], "run_labels must be 1 rows of 3"),
])
def test_regime_map_rejects_bad_input(x, categories, run_labels, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.regime_map(ax, x, categories, row_labels=["row"], colors=REGIME_COLORS_BY_CATEGORY, run_labels=run_labels)


# ----------------------------------------------------------------------------------------------
# Bits and bytes
# ----------------------------------------------------------------------------------------------
FP4_BIT_ROW_Y = 0.5    # fp4_byte_picture writes each bit's digit at y = 0.5, bit 7 leftmost


@pytest.mark.parametrize("byte", [0x00, 0xD3, 0x7A, 0xFF])
def test_fp4_byte_picture_writes_the_bits_msb_first(byte):
    _, ax = plt.subplots()
    gp.fp4_byte_picture(ax, byte)
    digits = sorted((t.get_position()[0], t.get_text()) for t in ax.texts
                    if t.get_position()[1] == FP4_BIT_ROW_Y and t.get_text() in ("0", "1"))
    assert "".join(d for _, d in digits) == f"{byte:08b}"


@pytest.mark.parametrize("byte, element_index", [(0xD3, 0), (0x7A, 6), (np.uint8(0x91), 2)])
def test_fp4_byte_picture_names_each_nibbles_element_and_decoded_value(byte, element_index):
    _, ax = plt.subplots()
    gp.fp4_byte_picture(ax, byte, element_index=element_index)
    low, high = decode_elements(np.array([int(byte) & 0xF, int(byte) >> 4], np.uint8), "e2m1")
    captions = {t.get_text().split("\n")[0]: t.get_text() for t in ax.texts if "nibble" in t.get_text()}
    assert (f"{low:+g}" in captions[f"low nibble = element {element_index}"],
            f"{high:+g}" in captions[f"high nibble = element {element_index + 1}"]) == (True, True)


def test_fp4_byte_picture_writes_the_byte_in_hex():
    _, ax = plt.subplots()
    gp.fp4_byte_picture(ax, 0xD3)
    assert "= 0xD3" in {t.get_text() for t in ax.texts}


@pytest.mark.parametrize("byte, element_index, match", [(256, 0, "0..255"), (-1, 0, "0..255"), (1.5, 0, "int"),
                                                        ("0x12", 0, "int"), (0x12, 1, "even")])
def test_fp4_byte_picture_rejects_bad_input(byte, element_index, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.fp4_byte_picture(ax, byte, element_index=element_index)


# ----------------------------------------------------------------------------------------------
# The 128x4 scale layout (scale_layout_picture)
# ----------------------------------------------------------------------------------------------
LAYOUT_SHAPES = [(128, 4), (200, 6), (40, 1), (129, 5)]


def _layout_position(row, col, cols):
    """(x, y) of scale (row, col) in the bytes view: atoms side by side, 32 lines of 16 bytes each."""
    offset = scale_byte_offset(row, col, ScaleLayout128x4(0, cols).col_groups)
    atom, within = divmod(offset, SF_ATOM_BYTES)
    line, byte = divmod(within, BYTES_PER_LAYOUT_LINE)
    return atom * BYTES_PER_LAYOUT_LINE + byte, line


@pytest.mark.parametrize("rows, cols", LAYOUT_SHAPES)
def test_scale_layout_bytes_view_writes_each_scale_where_scale_byte_offset_puts_it(rows, cols):
    _, ax = plt.subplots()
    gp.scale_layout_picture(ax, rows, cols)
    want = {_layout_position(r, c, cols): (f"{r}" if cols <= 4 else f"{r},{c}")
            for r, c in itertools.product(range(rows), range(cols))}
    assert _text_at(ax) == want


@pytest.mark.parametrize("rows, cols", LAYOUT_SHAPES)
def test_scale_layout_bytes_view_has_one_column_per_byte_of_the_layout(rows, cols):
    _, ax = plt.subplots()
    image = gp.scale_layout_picture(ax, rows, cols, annotate=False)
    lines = SF_ATOM_BYTES // BYTES_PER_LAYOUT_LINE
    assert image.get_array().shape[:2] == (lines, ScaleLayout128x4(rows, cols).nbytes // lines)


def test_scale_layout_bytes_view_colours_by_32_row_slice_and_leaves_padding_white():
    rows, cols = 256, 1      # one k-block: every scale byte takes its slice's base colour
    _, ax = plt.subplots()
    rgba = np.asarray(gp.scale_layout_picture(ax, rows, cols, annotate=False).get_array())
    want = np.ones_like(rgba)
    slice_cmap = mpl.colormaps[gp.ATOM_SLICE_CMAP]
    for r in range(rows):
        x, line = _layout_position(r, 0, cols)
        want[line, x] = slice_cmap((r % SF_ATOM_ROWS) // 32)
    np.testing.assert_allclose(rgba, want)


@pytest.mark.parametrize("rows, cols", LAYOUT_SHAPES)
def test_scale_layout_bytes_view_separates_atoms_with_black_lines(rows, cols):
    _, ax = plt.subplots()
    gp.scale_layout_picture(ax, rows, cols, annotate=False)
    atoms = ScaleLayout128x4(rows, cols).nbytes // SF_ATOM_BYTES
    separators = sorted(line.get_xdata()[0] for line in ax.lines if _hex(line.get_color()) == "#000000")
    assert separators == [a * BYTES_PER_LAYOUT_LINE - 0.5 for a in range(1, atoms)]


def test_scale_layout_bytes_view_annotate_false_writes_nothing():
    _, ax = plt.subplots()
    gp.scale_layout_picture(ax, 128, 4, annotate=False)
    assert list(ax.texts) == []


@pytest.mark.parametrize("rows, cols", LAYOUT_SHAPES)
def test_scale_layout_matrix_view_colours_each_scale_by_its_byte_offset(rows, cols):
    _, ax = plt.subplots()
    image = gp.scale_layout_picture(ax, rows, cols, view="matrix")
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    want = scale_byte_offset(r, c, ScaleLayout128x4(rows, cols).col_groups).T    # k-blocks along y
    np.testing.assert_array_equal(image.get_array(), want)


def test_scale_layout_matrix_view_ticks_every_k_block_and_has_a_colorbar():
    figure, ax = plt.subplots()
    gp.scale_layout_picture(ax, 200, 6, view="matrix")
    assert list(ax.get_yticks()) == list(range(6)) and len(figure.axes) == 2


@pytest.mark.parametrize("rows, cols, view, match", [(128, 4, "linear", "view"), (0, 4, "bytes", "rows and cols"),
                                                     (128, 0, "matrix", "rows and cols")])
def test_scale_layout_picture_rejects_bad_input(rows, cols, view, match):
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        gp.scale_layout_picture(ax, rows, cols, view=view)


# ----------------------------------------------------------------------------------------------
# Tile walks (tile_walk_picture)
# ----------------------------------------------------------------------------------------------
# Slot 1 is empty, slot 2 skipped; n is not a multiple of any tile's weight rows.
WALK_A_OFFSETS = np.array([0, 20, 20, 37, 60])
WALK_EXPERT_IDS = np.array([4, 1, -1, 0])
WALK_N = 300
WALK_CTAS = 4
WALK_CONFIGS = [TileConfig(True, 8, 1), TileConfig(False, 128, 1), TileConfig(True, 64, 2)]


def _config_id(config) -> str:
    return f"{'swapped' if config.ab_swapped else 'unswapped'}-bn{config.mma_bn}-cg{config.cta_group}"


def _walk(config):
    shape = config.tile_shape
    works = assign_tiles(WALK_CTAS, WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, shape)
    _, ax = plt.subplots(figsize=(10, 6))
    gp.tile_walk_picture(ax, works, WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, shape)
    return ax, works, shape


def _filled(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill() and p.get_zorder() == 2]


def _hatched(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch() == gp.MASKED_HATCH]


def _box(p):
    return (p.get_x(), p.get_y(), p.get_x() + p.get_width(), p.get_y() + p.get_height())


@pytest.mark.parametrize("config", WALK_CONFIGS, ids=_config_id)
def test_tile_walk_fills_exactly_the_part_of_c_each_cta_writes(config):
    ax, works, _ = _walk(config)
    want = sorted((w.row_start, w.token_start, w.row_end, w.token_end) for cta in works for w in cta
                  if w.row_end > w.row_start)
    assert sorted(_box(p) for p in _filled(ax)) == want


@pytest.mark.parametrize("config", WALK_CONFIGS, ids=_config_id)
def test_tile_walk_colours_each_ctas_or_pairs_part_with_its_colour(config):
    ax, works, shape = _walk(config)
    by_box = {_box(p): _hex(p.get_facecolor()) for p in _filled(ax)}
    drawn = [(by_box[(w.row_start, w.token_start, w.row_end, w.token_end)], _hex(gp.cta_color(cta // shape.cta_group)))
             for cta, cta_works in enumerate(works) for w in cta_works if w.rank == 0]
    assert drawn and all(got == want for got, want in drawn)


def test_tile_walk_draws_rank_1_of_a_pair_a_shade_darker():
    ax, works, shape = _walk(WALK_CONFIGS[2])
    by_box = {_box(p): p.get_facecolor() for p in _filled(ax)}
    drawn = [(by_box[(w.row_start, w.token_start, w.row_end, w.token_end)], gp.cta_color(cta // shape.cta_group))
             for cta, cta_works in enumerate(works) for w in cta_works if w.rank == 1 and w.row_end > w.row_start]
    assert drawn and all(_luminance(got) < _luminance(owner) for got, owner in drawn)


@pytest.mark.parametrize("config", WALK_CONFIGS, ids=_config_id)
def test_tile_walk_written_and_masked_areas_make_up_every_mma(config):
    ax, works, shape = _walk(config)
    area = sum(p.get_width() * p.get_height() for p in _filled(ax) + _hatched(ax))
    assert area == sum(len(cta) for cta in works) * shape.cta_weight_rows * shape.tokens


@pytest.mark.parametrize("config", WALK_CONFIGS, ids=_config_id)
def test_tile_walk_masked_areas_lie_past_n_or_past_the_group(config):
    ax, _, _ = _walk(config)
    group_ends = set(WALK_A_OFFSETS[1:].tolist())
    assert all(x0 >= WALK_N or y0 in group_ends for x0, y0, _, _ in map(_box, _hatched(ax)))


@pytest.mark.parametrize("config", WALK_CONFIGS, ids=_config_id)
def test_tile_walk_labels_every_tile_once_with_its_walk_position(config):
    ax, _, shape = _walk(config)
    labels = sorted(int(t.get_text()) for t in ax.texts if t.get_text().isdigit())
    assert labels == list(range(total_tiles(WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, shape)))


def test_tile_walk_shows_the_skipped_slot_as_a_grey_band():
    ax, _, _ = _walk(WALK_CONFIGS[0])
    bands = [_box(p) for p in ax.patches if isinstance(p, Rectangle) and _hex(p.get_facecolor()) == gp.PADDING_COLOR]
    assert bands == [(0, 20, 384, 37)]     # 300 rounded up to 128-row blocks


def test_tile_walk_labels_each_slot_with_its_expert_and_tokens():
    ax, _, _ = _walk(WALK_CONFIGS[0])
    slot_texts = sorted(t.get_text() for t in ax.texts if t.get_text().startswith("slot"))
    assert slot_texts == ["slot 0: e4, 20 tok", "slot 1: empty", "slot 2: expert -1, no tiles, rows not written",
                          "slot 2: skip, 17 tok", "slot 3: e0, 23 tok"]


@pytest.mark.parametrize("config, owner", [(WALK_CONFIGS[0], "CTA"), (WALK_CONFIGS[2], "pair")])
def test_tile_walk_legend_has_one_entry_per_cta_or_pair(config, owner):
    ax, _, shape = _walk(config)
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    owners = WALK_CTAS // shape.cta_group
    assert names == [f"{owner} {i}" for i in range(owners)] + ["masked at the store", "skipped slot"]


def test_tile_walk_picture_rejects_a_shape_that_is_not_a_tile_shape():
    _, ax = plt.subplots()
    with pytest.raises(TypeError, match="TileShape"):
        gp.tile_walk_picture(ax, [], WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, (8, 128, 1))


def test_tile_walk_picture_rejects_offsets_not_one_longer_than_expert_ids():
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="len\\(expert_ids\\) \\+ 1"):
        gp.tile_walk_picture(ax, [], WALK_A_OFFSETS[:-1], WALK_EXPERT_IDS, WALK_N, TileShape(8, 128))


def test_tile_walk_picture_rejects_a_grid_of_half_pairs():
    shape = WALK_CONFIGS[2].tile_shape
    works = assign_tiles(WALK_CTAS, WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, shape)
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="whole groups of 2"):
        gp.tile_walk_picture(ax, works[:3], WALK_A_OFFSETS, WALK_EXPERT_IDS, WALK_N, shape)
