"""``mjp eval``: everything the paper measures, on one checkpoint (and optionally a baseline checkpoint).

    results = evaluate_checkpoint("runs/x/mjp/last.pt", corruptions=["all"], baseline="runs/x/baseline/last.pt")

Measures top-1/top-5, consistency and diff-norm (:mod:`mjp_fast.evaluate.metrics`), position regression
(:mod:`mjp_fast.evaluate.position`), plots (:mod:`mjp_fast.evaluate.plots`) and, on request, the error under
common corruptions with each corruption's CE and the mCE relative to the baseline
(:mod:`mjp_fast.evaluate.corruptions`), and the robustness benchmarks (ImageNet-C, CIFAR-10-C, ImageNet-A, -R, -O).

The checkpoint, its data and the benchmarks' sets are opened and checked first (:mod:`mjp_fast.evaluate.opening`);
the results are printed and written by :mod:`mjp_fast.evaluate.report` (``results_table``, ``write_json``, imported
from here as before).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast._model_geometry import input_size
from mjp_fast._seeds import draw_seed
from mjp_fast.evaluate.common_corruptions import StoredCorruptions, corruption_table, measure_errors, stored_coverage
from mjp_fast.evaluate.corruptions import CORRUPTIONS, SEVERITIES, corrupt, corruption_errors
from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.evaluate.natural import evaluate_natural_sets
from mjp_fast.evaluate.opening import OpenedCheckpoint, open_checkpoint, robustness_dtype
from mjp_fast.evaluate.plots import plot_attention_maps, plot_corruption_severity, plot_position_embeddings
from mjp_fast.evaluate.position import model_position_regression, patch_position_embeddings
from mjp_fast.evaluate.releases import NATURAL_RELEASES, class_coverage
from mjp_fast.evaluate.report import results_table, write_json

# results_table, write_json (report.py) and robustness_dtype (opening.py) were defined here: imported from here still
__all__ = [
    "REQUIRED_KEYS",
    "evaluate_checkpoint",
    "precision_name",
    "results_table",
    "robustness_dtype",
    "write_json",
]

REQUIRED_KEYS = ("top1", "top5", "consistency", "diff_norm", "pos_mae_1d", "pos_mae_2d")


def precision_name(dtype: torch.dtype | None) -> str:
    """``float32`` (no autocast), ``bfloat16`` or ``float16``: the results' ``precision`` of a pass."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


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
            # a pass without accuracy (ImageNet-O's, scored by AUPR) has no top-1
            top1 = f"top-1 {result['top1']:.2f}% on " if result.get("top1") is not None else ""
            self.log(f"eval [{self.done}/{self.total}] {label}: {top1}{result['images']} images ({seconds:.1f} s)")


class _Evaluator:
    """One model with its data: the clean pass and the corrupted passes."""

    def __init__(
        self,
        model: nn.Module,
        opened: OpenedCheckpoint,
        mean: torch.Tensor,
        std: torch.Tensor,
        show_progress: bool,
        passes: _PassLog,
        label: str = "",
        dtype: torch.dtype | None | str = "opened",
    ) -> None:
        """``dtype``: autocast's (None: float32); by default the opened checkpoint's (``--amp``)."""
        self.model, self.loader, self.device = model, opened.loader, opened.device
        self.dtype = opened.dtype if dtype == "opened" else dtype
        self.mean, self.std = mean, std
        self.show_progress = show_progress
        self.images = len(opened.loader.dataset)
        self.passes, self.label = passes, label

    def run(self, description: str, loader: DataLoader | None = None, **kwargs: Any) -> dict[str, Any]:
        """One pass over ``loader`` (default: the validation images)."""
        loader = loader if loader is not None else self.loader
        bar = _progress_bar(len(loader.dataset), description, self.show_progress)
        start = time.perf_counter()
        try:
            result = evaluate_model(
                self.model,
                loader,
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
    imagenet_c: str | Path | None = None,
    cifar10_c: str | Path | None = None,
    imagenet_a: str | Path | None = None,
    imagenet_r: str | Path | None = None,
    imagenet_o: str | Path | None = None,
    require_complete: bool = False,
) -> dict[str, Any]:
    """Evaluates a checkpoint of ``mjp train``; returns the results (see ``mjp eval --help``).

    ``imagenet_a``, ``imagenet_r``, ``imagenet_o``: the folders of ImageNet-A, -R, -O as their authors release them
    (:mod:`mjp_fast.evaluate.natural`): the results' ``imagenet_a`` (``top1``, ``aurra``, ``calibration_rms``, in
    %, ``images``, ``classes``), ``imagenet_r`` (``top1``, ``images``, ``classes``, ``imagenet_200_top1``,
    ``top1_drop``, ...) and ``imagenet_o`` (``aupr``, ``auroc``, ``fpr95`` in %, ``images_out``, ``images_in``: the
    validation images of its classes), each with ``dir``, ``precision``, ``partial`` and what the tree lacks of the
    release (:func:`~mjp_fast.evaluate.natural.release_coverage`), and with a baseline its own under ``baseline``
    and its path under ``baseline_checkpoint``.

    ``imagenet_c``, ``cifar10_c``: the benchmarks' folders as released; their tables are the results' ``imagenet_c``
    and ``cifar10_c`` (:func:`_stored_results`), the baseline's inside.

    ``require_complete``: refuse a robustness benchmark short of its release (before any pass where the trees
    tell: :func:`_incomplete_sets`); without it, such a benchmark is measured and its results marked ``partial``.
    The benchmarks run in float32 unless ``amp`` names a dtype (``auto``'s bf16 on CUDA is for the other passes;
    with ``imagenet_c`` the clean pass, whose error enters the relative mCE, is float32 too): see ``precision``.

    ``progress`` shows a tqdm bar per pass over the data; ``log``, if given, is called with one line after each
    pass (the clean one, then each corruption and severity, the baseline's too), numbered out of all of them.

    Raises:
        ConfigError: a bad path or value; with ``require_complete``, a robustness benchmark short of its release.
    """
    from mjp_fast.train.config import ConfigError

    opened, names = open_checkpoint(
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
        imagenet_c=imagenet_c,
        cifar10_c=cifar10_c,
        natural={"imagenet_a": imagenet_a, "imagenet_r": imagenet_r, "imagenet_o": imagenet_o},
    )
    model, loader = opened.model, opened.loader
    if require_complete and (lacking := _incomplete_sets(opened, max_images)):
        raise ConfigError(f"--require-complete: {'; '.join(lacking)}")
    models = 2 if opened.baseline_model is not None else 1
    corrupted = len(names) * len(severities) * models + sum(sets.passes() for sets in opened.stored) * models
    passes = _PassLog(log, 1 + corrupted + sum(natural.passes for natural in opened.natural) * models)
    evaluator = _Evaluator(model, opened, opened.mean, opened.std, progress, passes)
    # ImageNet-C's relative mCE takes the clean error of this pass: then it runs in the benchmarks' precision
    relative_mce = any(sets.reference_clean_error is not None for sets in opened.stored)
    clean_dtype = opened.robustness_dtype if relative_mce else opened.dtype
    clean_evaluator = _Evaluator(model, opened, opened.mean, opened.std, progress, passes, dtype=clean_dtype)
    clean = clean_evaluator.run("clean", ratio=ratio, seed=seed, jigsaw=opened.jigsaw)
    results = _clean_results(checkpoint, opened, clean, model_position_regression(model, folds=folds), ratio, seed)
    results["precision"] = precision_name(clean_dtype)  # of the clean pass; each robustness benchmark has its own
    if names:
        results.update(_corruption_results(evaluator, opened, names, severities, seed, baseline, progress, passes))
    for sets in opened.stored:
        clean_error = 100.0 - clean["top1"]
        results[_STORED_KEYS[sets.benchmark]] = _stored_results(opened, sets, baseline, progress, passes, clean_error)
    if opened.natural:
        results.update(_natural_results(opened, baseline, progress, passes))
    if require_complete and (lacking := _partial_results(results)):
        raise ConfigError(f"--require-complete: {'; '.join(lacking)}: no results written")
    if plots is not None:
        written = _write_plots(model, loader, Path(plots), opened.mean, opened.std, attention_images)
        written += _stored_plots(results, opened.stored, Path(plots))
        results["plots"] = [str(path) for path in written]
    return results


def _corruption_results(
    evaluator: _Evaluator,
    opened: OpenedCheckpoint,
    names: list[str],
    severities: Sequence[int],
    seed: int,
    baseline: str | Path | None,
    progress: bool,
    passes: _PassLog,
) -> dict[str, Any]:
    """The results' ``mce``, ``mean_corruption_error`` and ``corruptions`` (each corruption's error per severity;
    with a baseline, its errors too and each corruption's CE) of the on-the-fly proxy (not ImageNet-C: its
    ``note`` says so)."""
    errors = evaluator.corruption_errors(names, severities, seed)
    corruption: dict[str, Any] = {
        # the keys stay as they were; the note says what they measure (--imagenet-c gives the real benchmark)
        "note": "on-the-fly corruptions: a quick proxy, not ImageNet-C; comparable between models measured here only",
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


_STORED_KEYS = {"ImageNet-C": "imagenet_c", "CIFAR-10-C": "cifar10_c"}  # the results' key of each benchmark
_NATURAL_NAMES = (("imagenet_a", "ImageNet-A"), ("imagenet_r", "ImageNet-R"), ("imagenet_o", "ImageNet-O"))


def _clean_results(
    checkpoint: str | Path,
    opened: OpenedCheckpoint,
    clean: dict[str, Any],
    regression: dict[str, Any] | None,
    ratio: float,
    seed: int,
) -> dict[str, Any]:
    """The results of the clean pass and of the position regression, with what identifies the checkpoint."""
    return {
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


def _partial_results(results: dict[str, Any]) -> list[str]:
    """The robustness benchmarks measured on less than their releases (their ``partial``), one phrase each."""
    return [
        f"{name} is not its whole release (measured on less of it)"
        for key, name in (("imagenet_c", "ImageNet-C"), ("cifar10_c", "CIFAR-10-C"), *_NATURAL_NAMES)
        if isinstance(results.get(key), dict) and results[key].get("partial")
    ]


def _incomplete_sets(opened: OpenedCheckpoint, max_images: int | None) -> list[str]:
    """What the robustness sets asked for lack of their releases, as far as it is known before any pass: the
    stored benchmarks' missing corruptions (of the 15) and a ``--max-images`` below a pass's images; ImageNet-A,
    -R, -O's classes other than the release's and fewer images (in the tree, or kept by ``--max-images``)."""
    lacking = []
    for sets in opened.stored:
        reasons = []
        if sets.missing:
            reasons.append(f"{len(sets.missing)} of the 15 corruptions missing ({', '.join(sets.missing[:3])}, ...)")
        if max_images is not None and sets.release_images is not None and max_images < sets.release_images:
            reasons.append(f"--max-images {max_images} of the {sets.release_images:,} images a pass")
        if reasons:
            lacking.append(f"{sets.option} {str(sets.root)!r}: " + ", ".join(reasons))
    for natural in opened.natural:
        published, release_images = NATURAL_RELEASES[natural.info.key]
        coverage = class_coverage(natural.folder.wnids, published)
        images = len(natural.loader.dataset)
        reasons = []
        if coverage.missing:
            reasons.append(f"{len(coverage.missing)} of its {len(published)} classes missing")
        if coverage.extra:
            reasons.append(f"{len(coverage.extra)} classes not its own ({', '.join(coverage.extra[:3])})")
        if images != release_images:
            reasons.append(f"{images:,} images, not its {release_images:,}")
        if reasons:
            lacking.append(f"{natural.info.option} {str(natural.folder.root)!r}: " + ", ".join(reasons))
    return lacking


def _stored_plots(results: dict[str, Any], stored: list[StoredCorruptions], out_dir: Path) -> list[Path]:
    """``imagenet_c_severity.png`` / ``cifar10_c_severity.png``: error against severity, the baseline beside."""
    labels = ("MJP" if results["mjp"] else "model", "baseline")
    written = []
    for sets in stored:
        key = _STORED_KEYS[sets.benchmark]
        path = out_dir / f"{key}_severity.png"
        written.append(plot_corruption_severity(results[key], path, title=f"{sets.benchmark}:", labels=labels))
    return written


def _stored_results(
    opened: OpenedCheckpoint,
    sets: StoredCorruptions,
    baseline: str | Path | None,
    progress: bool,
    passes: _PassLog,
    clean_error: float,
) -> dict[str, Any]:
    """One stored benchmark's table (:func:`~mjp_fast.evaluate.common_corruptions.corruption_table`): the model's
    error per corruption and severity, CE, mCE and relative mCE (from ``clean_error``, the clean pass's top-1 error
    in %) against the benchmark's reference errors (ImageNet-C: AlexNet's), and with a baseline its table and the
    CE and mCE against it; beside them ``dir``, ``images`` (of each pass; the distinct counts when passes differ),
    how it compares with the release (:func:`~mjp_fast.evaluate.common_corruptions.stored_coverage`), the passes'
    ``precision`` and with a baseline ``baseline_checkpoint``."""
    from mjp_fast.train.data import eval_transform, set_transform

    config = opened.config
    crop_pct = sets.crop_pct if sets.crop_pct is not None else (config.crop_pct or 0.875)
    transform = eval_transform(input_size(opened.model), config.interpolation, crop_pct)
    images: list[int] = []  # of each pass

    def on(runner: _Evaluator) -> Callable[[str, Any], float]:
        def evaluate(description: str, dataset: Any) -> float:
            set_transform(dataset, transform)
            loader = opened.loader_for(dataset)
            result = runner.run(description, loader=loader, ratio=0.0, jigsaw="none")
            images.append(result["images"])
            return result["top1"]

        return evaluate

    dtype = opened.robustness_dtype
    evaluator = _Evaluator(opened.model, opened, opened.mean, opened.std, progress, passes, dtype=dtype)
    errors = measure_errors(sets, on(evaluator))
    baseline_errors = None
    if opened.baseline_model is not None:
        other = _Evaluator(
            opened.baseline_model,
            opened,
            opened.baseline_mean,
            opened.baseline_std,
            progress,
            passes,
            "baseline ",
            dtype=dtype,
        )
        baseline_errors = measure_errors(sets, on(other))
    table = corruption_table(
        errors,
        reference=sets.reference,
        baseline=baseline_errors,
        clean_error=clean_error if sets.reference_clean_error is not None else None,
        reference_clean_error=sets.reference_clean_error,
    )
    counts = sorted(set(images))
    coverage = stored_coverage(table, counts[0], sets.release_images) if sets.release_images is not None else {}
    return {
        "dir": str(sets.root),
        "images": counts[0] if len(counts) == 1 else counts,
        **table,
        **coverage,
        "precision": precision_name(dtype),
        **({"baseline_checkpoint": str(baseline)} if baseline_errors is not None else {}),
    }


def _natural_results(
    opened: OpenedCheckpoint, baseline: str | Path | None, progress: bool, passes: _PassLog
) -> dict[str, dict[str, Any]]:
    """The results' ``imagenet_a``, ``imagenet_r``, ``imagenet_o`` (:func:`~mjp_fast.evaluate.natural.
    evaluate_natural_sets`), each with ``dir``; with a baseline, its results under ``baseline`` and its path under
    ``baseline_checkpoint``."""
    from mjp_fast.train.config import ConfigError

    def measure(model: nn.Module, mean: torch.Tensor, std: torch.Tensor, label: str) -> dict[str, dict[str, Any]]:
        try:
            return evaluate_natural_sets(
                opened.natural,
                model,
                device=opened.device,
                mean=mean,
                std=std,
                amp_dtype=opened.robustness_dtype,
                progress_bar=lambda total, description: _progress_bar(total, description, progress),
                pass_done=lambda description, result, seconds: passes(f"{label}{description}", result, seconds),
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None

    results = measure(opened.model, opened.mean, opened.std, "")
    for natural in opened.natural:
        results[natural.info.key]["dir"] = str(natural.folder.root)
        results[natural.info.key]["precision"] = precision_name(opened.robustness_dtype)
    if opened.baseline_model is not None:
        other = measure(opened.baseline_model, opened.baseline_mean, opened.baseline_std, "baseline ")
        for key, values in other.items():
            results[key].update(baseline=values, baseline_checkpoint=str(baseline))
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
