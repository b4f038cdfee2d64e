"""The position-embedding plots: what they show, and that their titles stay legible where they are shown shrunk
(the panels of the report's similarity sheet)."""

import numpy as np
import pytest
from PIL import Image

from mjp_fast.evaluate.plots import SIMILARITY_DPI, plot_position_embeddings, position_similarity_figure
from mjp_fast.reproduce.report import PANEL_WIDTH

LEGIBLE_PIXELS = 10  # a title's font height, in pixels, below which it cannot be read


def _title(figure):
    return next(text for text in figure.texts if text.get_text() == figure.get_suptitle())


@pytest.mark.parametrize("grid", [(3, 4), (6, 8)])
def test_similarity_title_is_legible_in_a_report_panel(grid, tmp_path):
    # The report shrinks the saved plot into a square panel PANEL_WIDTH wide: the title's font shrinks with it.
    rows, cols = grid
    embeddings = np.random.default_rng(0).standard_normal((rows * cols, 8))
    figure = position_similarity_figure(embeddings, grid, title="J-ratio0.27-seed0:")
    path = tmp_path / "similarity.png"
    figure.savefig(path, dpi=SIMILARITY_DPI, bbox_inches="tight")
    title = _title(figure)
    assert title.get_text() == "J-ratio0.27-seed0:\ncosine similarity of position embeddings"
    assert title.get_fontsize() >= 12
    with Image.open(path) as saved:
        width, height = saved.size
    shrink = min(PANEL_WIDTH / width, PANEL_WIDTH / height, 1.0)
    assert title.get_fontsize() * SIMILARITY_DPI / 72 * shrink >= LEGIBLE_PIXELS


def test_similarity_of_a_position_with_itself_is_one(tmp_path):
    embeddings = np.random.default_rng(1).standard_normal((6, 4))
    figure = position_similarity_figure(embeddings, (2, 3))
    axes = figure.axes
    assert len(axes) == 6 and figure.get_suptitle() == "cosine similarity of position embeddings"
    for index, axis in enumerate(axes):
        shown = axis.images[0].get_array()
        assert shown.shape == (2, 3)
        assert shown[index // 3, index % 3] == pytest.approx(1.0)
    written = plot_position_embeddings(embeddings, (2, 3), tmp_path)
    assert {path.name for path in written} >= {"position_pca_2d.png", "position_pca_3d.png", "position_similarity.png"}


def test_corruption_severity_figure_draws_each_family_with_the_baseline_dashed(tmp_path):
    from mjp_fast.evaluate.common_corruptions import corruption_table
    from mjp_fast.evaluate.plots import corruption_severity_figure, plot_corruption_severity

    errors = {"gaussian_noise": [10, 20, 30, 40, 50], "fog": [5, 6, 7, 8, 9], "spatter": [1, 2, 3, 4, 5]}
    baseline = {name: [value + 10 for value in values] for name, values in errors.items()}
    table = corruption_table(errors, baseline=baseline)
    figure = corruption_severity_figure(table, title="ImageNet-C:", labels=("MJP", "baseline"))
    assert [axis.get_title() for axis in figure.axes] == ["noise", "weather", "extra"]
    assert figure.get_suptitle() == "ImageNet-C: error against severity (solid: MJP, dashed: baseline)"
    model_line, baseline_line = figure.axes[0].get_lines()
    assert list(model_line.get_xdata()) == [1, 2, 3, 4, 5] and list(model_line.get_ydata()) == [10, 20, 30, 40, 50]
    assert list(baseline_line.get_ydata()) == [20, 30, 40, 50, 60] and baseline_line.get_linestyle() == "--"
    assert model_line.get_color() == baseline_line.get_color() and model_line.get_linestyle() == "-"
    alone = corruption_severity_figure(corruption_table({"fog": [5, 6, 7, 8, 9]}))
    assert len(alone.axes[0].get_lines()) == 1 and "dashed" not in alone.get_suptitle()
    path = plot_corruption_severity(table, tmp_path / "sub" / "severity.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
