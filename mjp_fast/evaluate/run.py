"""``mjp eval``: everything the paper measures, on one checkpoint (and optionally a baseline checkpoint).

    results = evaluate_checkpoint("runs/x/mjp/last.pt", corruptions=["all"], baseline="runs/x/baseline/last.pt")

Measures top-1/top-5, consistency and diff-norm (:mod:`mjp_fast.evaluate.metrics`), position regression
(:mod:`mjp_fast.evaluate.position`), plots (:mod:`mjp_fast.evaluate.plots`) and, on request, the error under
common corruptions with each corruption's CE and the mCE relative to the baseline
(:mod:`mjp_fast.evaluate.corruptions`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast._atomic import write_atomically
from mjp_fast._model_geometry import input_size
from mjp_fast._seeds import draw_seed
from mjp_fast.evaluate.corruptions import CORRUPTIONS, SEVERITIES, corrupt, corruption_errors, resolve_corruptions
from mjp_fast.evaluate.metrics import evaluate_model, resolve_jigsaw_mode
from mjp_fast.evaluate.plots import plot_attention_maps, plot_position_embeddings
from mjp_fast.evaluate.position import model_position_regression, patch_position_embeddings

REQUIRED_KEYS = ("top1", "top5", "consistency", "diff_norm", "pos_mae_1d", "pos_mae_2d")


@dataclass
class _Opened:
    """A checkpoint opened for evaluation: its model and data, as its run trained them."""

    model: nn.Module  # in eval mode, on ``device``
    state: dict[str, Any]  # the checkpoint
    config: Any  # the run's TrainConfig, with the data, split and image limit asked for
    loader: DataLoader  # the validation images, uint8 [B, 3, H, W] at the model's input size
    device: torch.device
    mean: torch.Tensor  # [3]
    std: torch.Tensor  # [3]
    dtype: torch.dtype | None  # autocast's; None: none
    jigsaw: str  # the consistency protocol's jigsaw, resolved ("unk", "pixel" or "none")
    baseline_model: nn.Module | None = None  # for the mCE; loaded only with corruptions asked for
    baseline_mean: torch.Tensor | None = None
    baseline_std: torch.Tensor | None = None


def _progress_bar(total: int, description: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="img", unit_scale=True, desc=description, leave=False, dynamic_ncols=True)


class _PassLog:
    """One line per finished pass over the data (``log``), numbered out of the ``total`` passes the evaluation
    makes: what a user sees without a terminal's progress bar, where a corruption sweep runs for minutes."""

    def __init__(self, log: Callable[[str], None] | None, total: int) -> None:
        self.log, self.total, self.done = log, total, 0

    def __call__(self, label: str, result: dict[str, Any], seconds: float) -> None:
        self.done += 1
        if self.log is not None:
            self.log(
                f"eval [{self.done}/{self.total}] {label}: top-1 {result['top1']:.2f}% on {result['images']} images "
                f"({seconds:.1f} s)"
            )


class _Evaluator:
    """One model with its data: the clean pass and the corrupted passes."""

    def __init__(
        self,
        model: nn.Module,
        opened: _Opened,
        mean: torch.Tensor,
        std: torch.Tensor,
        show_progress: bool,
        passes: _PassLog,
        label: str = "",
    ) -> None:
        self.model, self.loader, self.device, self.dtype = model, opened.loader, opened.device, opened.dtype
        self.mean, self.std = mean, std
        self.show_progress = show_progress
        self.images = len(opened.loader.dataset)
        self.passes, self.label = passes, label

    def run(self, description: str, **kwargs: Any) -> dict[str, Any]:
        bar = _progress_bar(self.images, description, self.show_progress)
        start = time.perf_counter()
        try:
            result = evaluate_model(
                self.model,
                self.loader,
                device=self.device,
                mean=self.mean,
                std=self.std,
                amp_dtype=self.dtype,
                criterion=nn.CrossEntropyLoss(),
                progress=bar.update if bar is not None else None,
                **kwargs,
            )
        finally:
            if bar is not None:
                bar.close()
        self.passes(f"{self.label}{description}", result, time.perf_counter() - start)
        return result

    def corruption_errors(self, names: list[str], severities: Sequence[int], seed: int) -> dict[str, list[float]]:
        errors: dict[str, list[float]] = {}
        generator_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        for name in names:
            errors[name] = []
            for severity in severities:
                corrupt_batch = _BatchCorruption(name, severity, seed, generator_device)

                result = self.run(f"{name} severity {severity}", ratio=0.0, jigsaw="none", corrupt=corrupt_batch)
                errors[name].append(100.0 - result["top1"])
        return errors


class _BatchCorruption:
    """``corrupt(images, batch_index)`` for one corruption and severity, seeded by (seed, corruption, severity,
    batch): every model sees the same corrupted images."""

    def __init__(self, name: str, severity: int, seed: int, device: torch.device) -> None:
        self.name, self.severity, self.seed, self.device = name, severity, seed, device

    def __call__(self, images: torch.Tensor, batch_index: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        corruption_index = list(CORRUPTIONS).index(self.name)
        generator.manual_seed(draw_seed(self.seed, corruption_index, self.severity, batch_index))
        return corrupt(images, self.name, self.severity, generator)


def _open_checkpoint(
    checkpoint: str | Path,
    *,
    data: str | None,
    split: str,
    baseline: str | Path | None,
    ratio: float,
    jigsaw: str,
    batch_size: int,
    workers: int | None,
    device: str,
    amp: str,
    max_images: int | None,
    corruptions: Sequence[str],
    severities: Sequence[int],
) -> tuple[_Opened, list[str]]:
    """Checks the arguments, then rebuilds the checkpoint's model and validation data (and the baseline's model)
    with the training package; returns them with the corruptions' names. Raises ConfigError as
    :func:`evaluate_checkpoint` does, naming the option.

    The training package is imported here, when a checkpoint is evaluated: evaluation sits below training, which
    imports it for the validation of every epoch.
    """
    from mjp_fast.train.checkpoint import checkpoint_config, load_model
    from mjp_fast.train.config import ConfigError
    from mjp_fast.train.data import build_datasets, default_workers, eval_loader, eval_transform, set_transform
    from mjp_fast.train.device import amp_dtype, resolve_device

    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"--ratio must be in [0, 1], got {ratio}")
    if any(severity not in SEVERITIES for severity in severities):
        raise ConfigError(f"severities must be in 1..5, got {list(severities)}")
    try:
        names = resolve_corruptions(list(corruptions))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    torch_device = resolve_device(device)
    model, state = load_model(checkpoint, torch_device)
    config = checkpoint_config(state)
    if data is not None:
        config = config.replace(data=str(data), dataset="folder")
    config = config.replace(val_split=split, max_val_samples=max_images)
    _, val_set, classes = build_datasets(config, need_train=False)
    num_classes = getattr(model, "num_classes", None)
    if num_classes is not None and num_classes != len(classes):
        raise ConfigError(
            f"the model has {num_classes} classes but the data has {len(classes)} ({config.data or 'digits'})"
        )
    img_size = input_size(model)
    baseline_model = baseline_state = None
    if baseline is not None and names:  # loaded first: a bad path fails now, not after the model's evaluation
        baseline_model, baseline_state = load_model(baseline, torch_device, what="baseline checkpoint")
        if input_size(baseline_model) != img_size:
            raise ConfigError(
                f"the baseline takes {input_size(baseline_model)}px images, the model {img_size}px: "
                "mCE needs both on the same images"
            )
    crop_pct = config.crop_pct if config.crop_pct is not None else 0.875
    set_transform(val_set, eval_transform(img_size, config.interpolation, crop_pct))
    loader = eval_loader(
        val_set,
        batch_size,
        workers if workers is not None else default_workers(1),
        pin_memory=torch_device.type == "cuda",
    )
    mean = torch.tensor(config.mean if config.mean is not None else (0.485, 0.456, 0.406))
    std = torch.tensor(config.std if config.std is not None else (0.229, 0.224, 0.225))
    dtype = amp_dtype(config.replace(amp=amp), torch_device)
    try:
        mode = resolve_jigsaw_mode(model, jigsaw)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    opened = _Opened(model, state, config, loader, torch_device, mean, std, dtype, mode, baseline_model)
    if baseline_state is not None:
        baseline_config = checkpoint_config(baseline_state)
        opened.baseline_mean = torch.tensor(baseline_config.mean or mean.tolist())
        opened.baseline_std = torch.tensor(baseline_config.std or std.tolist())
    return opened, names


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    data: str | None = None,
    split: str = "auto",
    baseline: str | Path | None = None,
    ratio: float = 0.5,
    seed: int = 0,
    jigsaw: str = "auto",
    batch_size: int = 128,
    workers: int | None = None,
    device: str = "auto",
    amp: str = "auto",
    max_images: int | None = None,
    corruptions: Sequence[str] = (),
    severities: Sequence[int] = SEVERITIES,
    plots: str | Path | None = None,
    attention_images: int = 4,
    folds: int = 5,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluates a checkpoint of ``mjp train``; returns the results (see ``mjp eval --help``).

    ``progress`` shows a tqdm bar per pass over the data; ``log``, if given, is called with one line after each
    pass (the clean one, then each corruption and severity, the baseline's too), numbered out of all of them.

    Raises:
        ConfigError: a bad path or value.
    """
    opened, names = _open_checkpoint(
        checkpoint,
        data=data,
        split=split,
        baseline=baseline,
        ratio=ratio,
        jigsaw=jigsaw,
        batch_size=batch_size,
        workers=workers,
        device=device,
        amp=amp,
        max_images=max_images,
        corruptions=corruptions,
        severities=severities,
    )
    model, loader = opened.model, opened.loader
    corrupted = len(names) * len(severities) * (2 if opened.baseline_model is not None else 1)
    passes = _PassLog(log, 1 + corrupted)
    evaluator = _Evaluator(model, opened, opened.mean, opened.std, progress, passes)
    clean = evaluator.run("clean", ratio=ratio, seed=seed, jigsaw=opened.jigsaw)
    regression = model_position_regression(model, folds=folds)
    results: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "model_name": opened.state["model_name"],
        "mjp": bool(opened.config.mjp),
        "data": opened.config.data or "digits",
        "images": clean["images"],
        "top1": clean["top1"],
        "top5": clean["top5"],
        "loss": clean["loss"],
        "consistency": clean["consistency"],
        "diff_norm": clean["diff_norm"],
        "eval_ratio": ratio,
        "eval_seed": seed,
        "jigsaw": opened.jigsaw if ratio > 0 else "none",
        "pos_mae_1d": regression["mae_1d"] if regression else None,
        "pos_mae_2d": regression["mae_2d"] if regression else None,
        "position_regression": regression,
        "epoch": opened.state.get("epoch"),
    }
    if names:
        results.update(_corruption_results(evaluator, opened, names, severities, seed, baseline, progress, passes))
    if plots is not None:
        written = _write_plots(model, loader, Path(plots), opened.mean, opened.std, attention_images)
        results["plots"] = [str(path) for path in written]
    return results


def _corruption_results(
    evaluator: _Evaluator,
    opened: _Opened,
    names: list[str],
    severities: Sequence[int],
    seed: int,
    baseline: str | Path | None,
    progress: bool,
    passes: _PassLog,
) -> dict[str, Any]:
    """The results' ``mce``, ``mean_corruption_error`` and ``corruptions`` (each corruption's error per severity;
    with a baseline, its errors too and each corruption's CE)."""
    errors = evaluator.corruption_errors(names, severities, seed)
    corruption: dict[str, Any] = {
        "severities": list(severities),
        "error": errors,
        "mean_error": {name: sum(values) / len(values) for name, values in errors.items()},
    }
    results: dict[str, Any] = {}
    if opened.baseline_model is not None:
        other = _Evaluator(
            opened.baseline_model, opened, opened.baseline_mean, opened.baseline_std, progress, passes, "baseline "
        )
        baseline_errors = other.corruption_errors(names, severities, seed)
        relative = corruption_errors(errors, baseline_errors)
        corruption.update(
            baseline=str(baseline), baseline_error=baseline_errors, ce=relative["ce"], mce=relative["mce"]
        )
        results["mce"] = relative["mce"]
    else:
        # Without a baseline, the mean corruption error itself (the unnormalized mCE).
        corruption["mce"] = None
        results["mce"] = None
    results["mean_corruption_error"] = sum(corruption["mean_error"].values()) / len(names)
    results["corruptions"] = corruption
    return results


def _write_plots(model, loader, out_dir: Path, mean, std, attention_images: int) -> list[Path]:
    written: list[Path] = []
    found = patch_position_embeddings(model)
    if found is not None:
        embeddings, grid = found
        written += plot_position_embeddings(embeddings, grid, out_dir)
    if attention_images > 0 and hasattr(model, "blocks"):
        device = next(model.parameters()).device
        pictures = []
        for images, _ in loader:
            pictures.append(images)
            if sum(len(batch) for batch in pictures) >= attention_images:
                break
        pictures = torch.cat(pictures)[:attention_images].to(device)
        pictures = pictures.float() / 255.0 if pictures.dtype == torch.uint8 else pictures.float()
        normalized = (pictures - mean.to(device).view(1, -1, 1, 1)) / std.to(device).view(1, -1, 1, 1)
        try:
            written.append(plot_attention_maps(model, normalized, pictures, out_dir / "attention.png"))
        except ValueError as error:
            print(f"mjp eval: no attention plot: {error}", file=sys.stderr)
    return written


def _number(value: Any, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def results_table(results: dict[str, Any]) -> str:
    """The headline numbers, then the corruption table, as Markdown."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| top-1 (%) | {_number(results['top1'])} |",
        f"| top-5 (%) | {_number(results['top5'])} |",
        f"| consistency (%), ratio {results['eval_ratio']}, {results['jigsaw']} | {_number(results['consistency'])} |",
        f"| diff-norm | {_number(results['diff_norm'], '{:.3f}')} |",
        f"| position MAE 1D (cells) | {_number(results['pos_mae_1d'], '{:.3f}')} |",
        f"| position MAE 2D (cells) | {_number(results['pos_mae_2d'], '{:.3f}')} |",
    ]
    corruption = results.get("corruptions")
    if corruption:
        lines += [
            "",
            "| corruption | " + " | ".join(f"error s{s}" for s in corruption["severities"]) + " | mean | CE |",
        ]
        lines.append("|---|" + "---|" * (len(corruption["severities"]) + 2))
        for name, errors in corruption["error"].items():
            ce = corruption.get("ce", {}).get(name)
            cells = " | ".join(_number(error) for error in errors)
            lines.append(f"| {name} | {cells} | {_number(corruption['mean_error'][name])} | {_number(ce)} |")
        lines.append(f"\nmean corruption error: {_number(results['mean_corruption_error'])}")
        if corruption.get("mce") is not None:
            lines.append(f"mCE relative to {corruption['baseline']}: {_number(corruption['mce'])}")
    if results.get("plots"):
        lines.append("\nplots: " + ", ".join(results["plots"]))
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    with write_atomically(path, text=True) as file:
        file.write(json.dumps(_finite(results), indent=2, allow_nan=False, default=_json_default) + "\n")
    return path


def _finite(value: Any) -> Any:
    """NaN and infinities become None (null): JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
