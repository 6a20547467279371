"""Every notebook under ``notebooks/`` runs top to bottom, as CI runs it, and is stored stripped.

* Each ``notebooks/*.ipynb`` (globbed at collection, so new notebooks are picked up) executes in a
  fresh kernel of this interpreter (the ``python3`` kernelspec; jupyter_client starts
  ``sys.executable`` for it) with ``MPLBACKEND=Agg``. A cell error fails the test; so does running
  past ``NOTEBOOK_BUDGET_S`` for the whole notebook (the notebooks promise < 60 s on 2 cores,
  enforced while running through nbclient's per-cell ``timeout_func``), anything written to stderr
  (warnings included), or a warning while the figures are drawn (Agg renders nothing unless asked,
  so the harness draws every open figure at the end: bad labels and missing glyphs show up there).
* Stored notebooks have no outputs and no execution counts, and are valid nbformat.
* ``notebooks/README.md`` has one line per notebook.

The harness adds two cells to the copy it executes (never to the stored file): a first one that
silences matplotlib's "more than 20 figures open" warning (under Agg nothing closes figures, unlike
the inline backend), and the final drawing cell.
"""
from __future__ import annotations

import time
from pathlib import Path

import nbclient   # test extras (pyproject): a missing harness must fail CI, not skip it
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "python3"
NOTEBOOK_BUDGET_S = 60.0      # wall clock for one notebook, kernel start included
MIN_CELL_TIMEOUT_S = 1.0      # nbclient needs a positive timeout even when the budget is spent

SETUP_CELL = "import matplotlib\nmatplotlib.rcParams['figure.max_open_warning'] = 0"
DRAW_ALL_FIGURES_CELL = """\
import warnings
import matplotlib.pyplot as plt
with warnings.catch_warnings():
    warnings.simplefilter("error")
    for number in plt.get_fignums():
        plt.figure(number).canvas.draw()
"""


def _read(path: Path):
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


def test_notebooks_are_found():
    assert len(NOTEBOOKS) >= 2, f"expected the teaching notebooks under {NOTEBOOK_DIR}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_stripped(path):
    notebook = _read(path)
    nbformat.validate(notebook)
    assert notebook.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME
    dirty = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: code cells {dirty} hold outputs or execution counts; store notebooks stripped"


@pytest.mark.slow   # nbclient runs each notebook in a kernel: 5-30 s each on a 2-core CPU
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = _read(path)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(SETUP_CELL))
    notebook.cells.append(nbformat.v4.new_code_cell(DRAW_ALL_FIGURES_CELL))
    deadline = time.monotonic() + NOTEBOOK_BUDGET_S
    client = nbclient.NotebookClient(
        notebook, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        timeout_func=lambda cell: max(MIN_CELL_TIMEOUT_S, deadline - time.monotonic()))
    start = time.monotonic()
    client.execute()   # raises CellExecutionError (with the cell and traceback) or CellTimeoutError
    elapsed = time.monotonic() - start
    assert elapsed <= NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.1f} s, budget {NOTEBOOK_BUDGET_S} s"
    stderr = [(i, out["text"]) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
              for out in cell.outputs if out.get("name") == "stderr"]
    assert not stderr, f"{path.name}: cells wrote to stderr (cell numbers count the harness's setup cell): {stderr}"


def test_readme_lists_every_notebook():
    readme = (NOTEBOOK_DIR / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("- ")]
    for path in NOTEBOOKS:
        mentions = [line for line in lines if f"`{path.name}`" in line]
        assert len(mentions) == 1, f"notebooks/README.md needs exactly one '- `{path.name}`: ...' line"
    assert len(lines) == len(NOTEBOOKS), "notebooks/README.md lists a notebook that does not exist"


# ---------------------------------------------------------------------------------------------
# The shared plot helpers the notebooks draw with (gbs.lab.plotting): pictures must match the library.
def _agg_axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6))
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def test_scale_layout_picture_labels_every_byte_with_the_row_swizzle_scales_puts_there():
    import numpy as np

    from gbs.lab.plotting import scale_layout_picture
    from gbs.formats import swizzle_scales

    figure, ax = _agg_axes()
    scale_layout_picture(ax, 128, 4, view="bytes")
    figure.canvas.draw()
    rows_by_row_byte = np.tile(np.arange(128, dtype=np.uint8)[:, None], (1, 4))
    atom = swizzle_scales(rows_by_row_byte).reshape(32, 16)   # one atom: 32 lines of 16 bytes
    labels = {(round(t.get_position()[1]), round(t.get_position()[0])): int(t.get_text()) for t in ax.texts}
    assert len(labels) == 512
    assert all(atom[line, byte] == row for (line, byte), row in labels.items())


def test_config_colours_follow_the_regime_whose_knobs_a_config_uses():
    from gbs import dispatch as dsp
    from gbs.lab.plotting import REGIME_COLORS, config_color

    kimi_decode = dsp.grouped_matmul_nvfp4_dispatch(n=512, k=7168, num_active_experts=8, estimated_total_m=8)
    default = dsp.grouped_matmul_block_scaled_sm100_dispatch(a_format="mxfp8", b_format="mxfp8", n=4096, k=7168,
                                                            num_active_experts=8, estimated_total_m=8)
    assert config_color(kimi_decode) == REGIME_COLORS[dsp.REGIME_SMALL_PREFILL]
    assert config_color(default) == REGIME_COLORS[dsp.REGIME_DEFAULT]
    with pytest.raises(TypeError, match="mma_bn"):
        config_color(object())


def test_plot_helpers_reject_bad_input_with_a_clear_message():
    from gbs.lab.plotting import finding_title, regime_map, scale_layout_picture

    _, ax = _agg_axes()
    with pytest.raises(ValueError, match="without a colour"):
        regime_map(ax, [1, 2, 4], [["a", "b", "c"]], row_labels=["row"], colors={"a": "red", "b": "blue"})
    with pytest.raises(ValueError, match="1 rows of 3 entries"):
        regime_map(ax, [1, 2, 4], [["a", "a"]], row_labels=["row"], colors={"a": "red"})
    with pytest.raises(ValueError, match="strictly increasing"):
        regime_map(ax, [4, 2, 1], [["a"] * 3], row_labels=["row"], colors={"a": "red"})
    with pytest.raises(ValueError, match="view"):
        scale_layout_picture(ax, 128, 4, view="linear")
    with pytest.raises(ValueError, match="finding"):
        finding_title(ax, "")
    with pytest.raises(TypeError, match="Axes or Figure"):
        finding_title("not an axes", "a finding")
