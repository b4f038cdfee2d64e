"""``curves.png``: a run's training loss, top-1 and learning rate against the epoch, drawn from its records.

``mjp train`` draws it in each run's output folder at the end of the run (and after an epoch when a while has
passed since the last drawing: see :data:`REFRESH_SECONDS`); a ``compare=true`` run also draws both of its runs on
the same axes in the comparison's folder. The records are those of ``metrics.jsonl``, one per epoch.

matplotlib draws off-screen: a bare :class:`matplotlib.figure.Figure` renders with Agg when saved, and pyplot (with
its global state and its choice of a window backend) is never imported. matplotlib is imported on the first drawing
only: importing it takes about a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mjp_fast._atomic import write_atomically

CURVES_FILE = "curves.png"
# A drawing takes about a second on a busy CPU (the first also imports matplotlib): during a run, curves.png is
# redrawn after an epoch only when this long has passed since it was last drawn, so runs of short epochs (the
# digits demo: a second each) do not pay for it every epoch; the run's end always draws it.
REFRESH_SECONDS = 120.0
# (panel title, record key, y-axis label)
PANELS = (
    ("training loss", "train_loss", "loss (mean over the epoch)"),
    ("top-1", "top1", "validation top-1 (%)"),
    ("learning rate", "lr", "learning rate (at the epoch's end)"),
)


def _points(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The epochs whose record has a value for ``key`` (top-1 exists only for evaluated epochs), and the values."""
    epochs, values = [], []
    for record in history:
        value = record.get(key)
        if value is not None:
            epochs.append(int(record["epoch"]))
            values.append(float(value))
    return epochs, values


def curves_figure(histories: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> Any:
    """A figure of three panels (training loss, top-1, learning rate), each run one line on every panel.

    Args:
        histories: run name (the legend's label) -> its per-epoch records (``metrics.jsonl``'s: ``epoch``,
            ``train_loss``, ``top1`` (None for an epoch not evaluated), ``lr``).
        title: the figure's title (the run's folder, say).

    Returns:
        A :class:`matplotlib.figure.Figure`; its axes, in :data:`PANELS`' order, hold one line per run, in the order
        of ``histories``, with the epochs as x and the values as y.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(13, 3.8), layout="constrained")
    axes = figure.subplots(1, len(PANELS), sharex=True)  # top-1 may have fewer epochs: the same x all the same
    epochs = [int(record["epoch"]) for history in histories.values() for record in history]
    if epochs:
        # at least half an epoch either side: matplotlib's own margin around one epoch would tick 0.9, 0.95, ...
        margin = max(0.5, 0.03 * (max(epochs) - min(epochs)))
        axes[0].set_xlim(min(epochs) - margin, max(epochs) + margin)
    for axis, (panel, key, label) in zip(axes, PANELS):
        drawn = False
        for index, (name, history) in enumerate(histories.items()):
            epochs, values = _points(history, key)
            # the same color for a run on every panel, even where it has no points yet
            axis.plot(epochs, values, color=f"C{index}", marker="o", markersize=3, linewidth=1.5, label=name)
            drawn = drawn or bool(epochs)
        if not drawn:  # top-1 before the first evaluation
            axis.text(0.5, 0.5, "not evaluated yet", transform=axis.transAxes, ha="center", va="center")
        axis.set_title(panel)
        axis.set_xlabel("epoch")
        axis.set_ylabel(label)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole epochs, even one alone
        axis.grid(alpha=0.3)
        if key == "lr":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        else:  # the values themselves: no "+2.31" offset above the axis when the curves are flat
            axis.ticklabel_format(axis="y", useOffset=False)
    axes[0].legend()
    if title:
        figure.suptitle(title)
    return figure


def write_curves(histories: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Draws :func:`curves_figure` into the PNG file ``path``, atomically (a reader never sees half a file).

    Returns ``path``.
    """
    path = Path(path)
    figure = curves_figure(histories, title)
    # "Software" would name matplotlib's version; without it (Agg writes no date) the same records give the same bytes
    with write_atomically(path) as stream:
        figure.savefig(stream, format="png", dpi=100, metadata={"Software": None})
    return path
