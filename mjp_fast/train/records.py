"""What a run writes and prints: ``metrics.jsonl``, ``curves.png`` and TensorBoard (:class:`RunWriters`), the
model in words, the epoch lines and the summary table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from torch import nn

from mjp_fast._atomic import write_atomically
from mjp_fast._model_geometry import input_size, patch_size_of
from mjp_fast.train import curves  # the module: its refresh time and drawing are looked up when used
from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.distributed import Distributed
from mjp_fast.train.outcome import METRICS_FILE


class RunWriters:
    """Rank 0's outputs: metrics.jsonl, curves.png (:mod:`mjp_fast.train.curves`) and, optionally, TensorBoard.

    ``history`` is the run's list of records, which the loop appends to: curves.png is drawn from it.
    """

    def __init__(self, config: TrainConfig, output: Path, context: Distributed, history: list[dict]) -> None:
        self.active = context.is_main
        self.output = output
        self.path = output / METRICS_FILE
        self.history = history
        self.board = None
        self._curves_drawn_at = time.perf_counter()  # the run's start: a first refresh comes REFRESH_SECONDS in
        if not self.active:
            return
        # Rewrite the records the checkpoint knows: a run killed after logging an epoch but before checkpointing
        # it must not keep the orphan record.
        with write_atomically(self.path, text=True) as file:
            file.write("".join(json.dumps(record) + "\n" for record in history))
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard=true needs the tensorboard package (pip install tensorboard)") from None
            self.board = SummaryWriter(str(output / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self.board.add_scalar(key, value, record["epoch"])
            self.board.flush()

    def draw_curves(self, *, final: bool) -> None:
        """Draws curves.png from the records so far: at the run's end (``final``), else only when
        :data:`~mjp_fast.train.curves.REFRESH_SECONDS` have passed since the last drawing (a drawing costs about a
        second, every rank waiting)."""
        if not self.active or not self.history:
            return
        if not final and time.perf_counter() - self._curves_drawn_at < curves.REFRESH_SECONDS:
            return
        name = self.output.resolve().name or "run"
        curves.write_curves({name: self.history}, self.output / curves.CURVES_FILE, title=str(self.output))
        self._curves_drawn_at = time.perf_counter()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def say(context: Distributed, message: str) -> None:
    if context.is_main:
        print(message, flush=True)


def plural(count: int, noun: str) -> str:
    """``1 epoch``, ``30 epochs``: a count with its noun, singular for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def count_parameters(count: int) -> str:
    """``22.05 M parameters``; below a million in thousands, where ``0.00 M`` would say nothing."""
    return f"{count / 1e6:.2f} M parameters" if count >= 1e6 else f"{count / 1e3:.1f} k parameters"


def describe_model(model_name: str, model_kwargs: dict[str, Any], model: nn.Module) -> str:
    """What trains, in words: the timm name, the architecture keys the config overrides, and the patch geometry.

    ``deit_tiny_patch16_224 with embed_dim=64, depth=2, num_heads=4, patch 4 (4x4 grid), 16 px``: the timm name
    alone would promise the base model's width, depth and patch, which a preset (``digits``) replaces.
    """
    overridden = [f"{key}={model_kwargs[key]}" for key in ("embed_dim", "depth", "num_heads") if key in model_kwargs]
    geometry = []
    patch = patch_size_of(model)
    if patch is not None:
        grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        geometry.append(f"patch {patch}" + (f" ({grid[0]}x{grid[1]} grid)" if grid is not None else ""))
    geometry.append(f"{input_size(model)} px")
    details = ", ".join(overridden + geometry)
    return f"{model_name} with {details}" if overridden else f"{model_name}, {details}"


def format_record(record: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {record['epoch']:>3}/{epochs}", f"loss {record['train_loss']:.4f}"]
    if record.get("dal_loss") is not None:
        parts.append(f"dal {record['dal_loss']:.3f}")
    parts.append(f"lr {record['lr']:.2e}")
    if record.get("top1") is not None:
        parts.append(f"top1 {record['top1']:.2f}")
    if record.get("consistency") is not None:
        parts.append(f"consistency {record['consistency']:.2f}")
    parts.append(f"{record['train_images_per_second']:.0f} img/s")
    parts.append(f"{record['epoch_seconds']:.1f} s")
    if record.get("eval_seconds") is not None:
        parts.append(f"eval {record['eval_seconds']:.1f} s")
    return "  ".join(parts)


def summary_table(history: list[dict[str, Any]], max_rows: int = 12) -> str:
    """The per-epoch records as a Markdown table (first and last epochs when there are many)."""
    columns = [
        ("epoch", "epoch", "{}"),
        ("train loss", "train_loss", "{:.4f}"),
        ("lr", "lr", "{:.2e}"),
        ("top-1", "top1", "{:.2f}"),
        ("top-5", "top5", "{:.2f}"),
        ("consistency", "consistency", "{:.2f}"),
        ("diff-norm", "diff_norm", "{:.3f}"),
        ("img/s", "train_images_per_second", "{:.0f}"),
    ]
    rows = history if len(history) <= max_rows else history[: max_rows // 2] + [None] + history[-max_rows // 2 :]
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for record in rows:
        if record is None:
            lines.append("| ... |" + " |" * (len(columns) - 1))
            continue
        cells = []
        for _, key, pattern in columns:
            value = record.get(key)
            cells.append("-" if value is None else pattern.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
