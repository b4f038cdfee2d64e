"""curves.png: each run one line on every panel (training loss, top-1, learning rate), epochs on x."""

import io

from PIL import Image

from mjp_fast.train.curves import PANELS, curves_figure, write_curves


def _history(losses, top1s, lrs):
    return [
        {"epoch": epoch, "train_loss": loss, "top1": top1, "lr": lr}
        for epoch, (loss, top1, lr) in enumerate(zip(losses, top1s, lrs), start=1)
    ]


HISTORIES = {
    "baseline": _history([2.3, 2.1, 1.9], [None, 30.0, 41.5], [1e-3, 5e-4, 1e-5]),
    "mjp": _history([2.4, 2.2], [None, 28.0], [1e-3, 5e-4]),  # a run still going: fewer epochs
}


def test_each_run_is_one_line_on_every_panel_with_its_own_color():
    figure = curves_figure(HISTORIES, title="runs/x")
    axes = figure.axes
    assert [axis.get_title() for axis in axes] == [panel for panel, _, _ in PANELS]
    assert figure.get_suptitle() == "runs/x"
    expected = {
        "training loss": {"baseline": ([1, 2, 3], [2.3, 2.1, 1.9]), "mjp": ([1, 2], [2.4, 2.2])},
        # top-1 only where the epoch was evaluated
        "top-1": {"baseline": ([2, 3], [30.0, 41.5]), "mjp": ([2], [28.0])},
        "learning rate": {"baseline": ([1, 2, 3], [1e-3, 5e-4, 1e-5]), "mjp": ([1, 2], [1e-3, 5e-4])},
    }
    colors = {}
    for axis in axes:
        lines = {line.get_label(): line for line in axis.get_lines()}
        assert list(lines) == ["baseline", "mjp"]
        for name, (x, y) in expected[axis.get_title()].items():
            assert list(lines[name].get_xdata()) == x and list(lines[name].get_ydata()) == y
            assert colors.setdefault(name, lines[name].get_color()) == lines[name].get_color()
        assert axis.get_xlim()[0] < 1 and axis.get_xlim()[1] > 3  # every epoch in view on every panel
    assert colors["baseline"] != colors["mjp"]
    assert [text.get_text() for text in axes[0].get_legend().get_texts()] == ["baseline", "mjp"]


def test_a_panel_without_values_says_so():
    figure = curves_figure({"run": _history([2.3], [None], [1e-3])})
    top1 = figure.axes[1]
    assert [text.get_text() for text in top1.texts] == ["not evaluated yet"]
    assert not figure.axes[0].texts  # the loss panel has its point


def test_write_curves_writes_the_same_png_for_the_same_records(tmp_path):
    first = write_curves(HISTORIES, tmp_path / "curves.png", title="runs/x")
    data = first.read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        assert image.format == "PNG" and image.size[0] > image.size[1] > 100
    # no version or date in the file: redrawing unchanged records leaves it unchanged
    assert write_curves(HISTORIES, tmp_path / "again.png", title="runs/x").read_bytes() == data
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporary file left
