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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast._atomic import write_atomically
from mjp_fast._model_geometry import input_size
from mjp_fast._seeds import draw_seed
from mjp_fast.evaluate.cifar10_c import open_cifar10_c
from mjp_fast.evaluate.common_corruptions import StoredCorruptions, corruption_table, measure_errors, stored_coverage
from mjp_fast.evaluate.corruptions import CORRUPTIONS, SEVERITIES, corrupt, corruption_errors, resolve_corruptions
from mjp_fast.evaluate.imagenet_c import open_imagenet_c
from mjp_fast.evaluate.metrics import evaluate_model, resolve_jigsaw_mode
from mjp_fast.evaluate.natural import NaturalSet, evaluate_natural_sets, open_natural_sets
from mjp_fast.evaluate.plots import plot_attention_maps, plot_corruption_severity, plot_position_embeddings
from mjp_fast.evaluate.position import model_position_regression, patch_position_embeddings
from mjp_fast.evaluate.releases import NATURAL_RELEASES, class_coverage
from mjp_fast.evaluate.robustness_table import robustness_rows, stored_corruption_rows

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
    # the stored-corruption benchmarks asked for (ImageNet-C, CIFAR-10-C), their layout checked
    stored: list[StoredCorruptions] = field(default_factory=list)
    # a loader of any dataset as ``loader`` is made (batch size, workers, --max-images subset)
    loader_for: Callable[[Any], DataLoader] | None = None
    # ImageNet-A, -R, -O asked for, their trees checked and their classes mapped to the model's outputs
    natural: list[NaturalSet] = field(default_factory=list)
    # autocast's dtype for the robustness benchmarks (ImageNet-C, CIFAR-10-C, ImageNet-A, -R, -O); None: float32
    robustness_dtype: torch.dtype | None = None


def precision_name(dtype: torch.dtype | None) -> str:
    """``float32`` (no autocast), ``bfloat16`` or ``float16``: the results' ``precision`` of a pass."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def robustness_dtype(amp: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """Autocast's dtype for the robustness benchmarks: float32 (None) unless ``--amp`` names one (bf16, fp16);
    ``auto``, which is bf16 on CUDA for the other passes, keeps them in float32, as their authors evaluate."""
    return None if amp == "auto" else dtype


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
        opened: _Opened,
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
    imagenet_c: str | Path | None = None,
    cifar10_c: str | Path | None = None,
    natural: dict[str, str | Path | None] | None = None,
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
    # the stored benchmarks' layouts are checked now, not after the model's clean pass
    stored = _open_stored(imagenet_c, cifar10_c, list(classes), num_classes, config)
    baseline_model = baseline_state = None
    natural = {key: path for key, path in (natural or {}).items() if path is not None}
    # loaded first: a bad path fails now, not after the evaluation
    if baseline is not None and (names or stored or natural):
        baseline_model, baseline_state = _load_baseline(baseline, torch_device, img_size, num_classes)
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
    opened.robustness_dtype = robustness_dtype(amp, dtype)
    opened.stored = stored
    opened.loader_for = _loader_maker(batch_size, workers, max_images, torch_device)
    if baseline_state is not None:
        baseline_config = checkpoint_config(baseline_state)
        opened.baseline_mean = torch.tensor(baseline_config.mean or mean.tolist())
        opened.baseline_std = torch.tensor(baseline_config.std or std.tolist())
    if natural:
        opened.natural = _open_natural(opened, natural, list(classes), num_classes or len(classes))
    return opened, names


def _loader_maker(
    batch_size: int, workers: int | None, max_images: int | None, device: torch.device
) -> Callable[[Any], DataLoader]:
    """``loader_for(dataset)``: a loader of any dataset as the validation loader is made (its --max-images subset)."""
    from mjp_fast.train.data import default_workers, eval_loader, fixed_subset

    workers = workers if workers is not None else default_workers(1)
    return lambda dataset: eval_loader(
        fixed_subset(dataset, max_images), batch_size, workers, pin_memory=device.type == "cuda"
    )


def _open_stored(
    imagenet_c: str | Path | None,
    cifar10_c: str | Path | None,
    classes: list[str],
    num_classes: int | None,
    config: Any,
) -> list[StoredCorruptions]:
    """The stored-corruption benchmarks asked for, their layouts checked and their classes mapped to the model's.
    Raises ConfigError naming the option (a wrong layout, a model without the benchmark's classes)."""
    from mjp_fast.train.config import ConfigError
    from mjp_fast.train.readers import max_bad_images

    stored = []
    try:
        if imagenet_c is not None:
            stored.append(open_imagenet_c(imagenet_c, classes, num_classes, max_bad=max_bad_images(config)))
        if cifar10_c is not None:
            stored.append(open_cifar10_c(cifar10_c, classes))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return stored


def _load_baseline(
    baseline: str | Path, device: torch.device, img_size: int, num_classes: int | None
) -> tuple[nn.Module, dict]:
    """The baseline checkpoint's model and state, checked against the model's: every comparison with it (the
    proxy's CE, ImageNet-C's and CIFAR-10-C's relative mCE, the natural sets) scores both on the same images and
    the same classes. Raises ConfigError naming ``--baseline``."""
    from mjp_fast.train.checkpoint import load_model
    from mjp_fast.train.config import ConfigError

    model, state = load_model(baseline, device, what="baseline checkpoint")
    if input_size(model) != img_size:
        raise ConfigError(
            f"--baseline: the baseline takes {input_size(model)}px images, the model {img_size}px: "
            "the comparisons need both on the same images"
        )
    classes = getattr(model, "num_classes", num_classes)
    if num_classes is not None and classes != num_classes:
        raise ConfigError(
            f"--baseline: the baseline has {classes} classes, the model {num_classes}: the comparisons score both "
            "on the same classes"
        )
    return model, state


def _open_natural(
    opened: _Opened, paths: dict[str, str | Path], classes: list[str], num_classes: int
) -> list[NaturalSet]:
    """ImageNet-A, -R, -O (:mod:`mjp_fast.evaluate.natural`): their trees checked, their classes found among the
    model's (and the baseline's), their loaders made. Raises ConfigError naming the option."""
    from mjp_fast.train.config import ConfigError
    from mjp_fast.train.readers import max_bad_images

    try:
        return open_natural_sets(
            paths,
            classes=classes,
            num_classes=num_classes,
            val_loader=opened.loader,
            make_loader=opened.loader_for,
            max_bad_images=max_bad_images(opened.config),
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


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
    opened: _Opened,
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
    opened: _Opened,
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


def _incomplete_sets(opened: _Opened, max_images: int | None) -> list[str]:
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
    opened: _Opened,
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
    opened: _Opened, baseline: str | Path | None, progress: bool, passes: _PassLog
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


def _number(value: Any, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def results_table(results: dict[str, Any]) -> str:
    """The headline numbers, the on-the-fly corruption proxy's table, the robustness benchmarks beside the paper's
    numbers and the ImageNet-C / CIFAR-10-C tables (:mod:`mjp_fast.evaluate.robustness_table`), as Markdown."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| top-1 (%) | {_number(results['top1'])} |",
        f"| top-5 (%) | {_number(results['top5'])} |",
        f"| consistency (%), ratio {results['eval_ratio']}, {results['jigsaw']} | {_number(results['consistency'])} |",
        f"| diff-norm | {_number(results['diff_norm'], '{:.3f}')} |",
        f"| position MAE 1D (cells) | {_number(results['pos_mae_1d'], '{:.3f}')} |",
        f"| position MAE 2D (cells) | {_number(results['pos_mae_2d'], '{:.3f}')} |",
        f"| precision of the clean pass | {results.get('precision', '-')} |",
    ]
    corruption = results.get("corruptions")
    if corruption:
        lines += [
            "",
            "| on-the-fly corruption (proxy, not ImageNet-C) | "
            + " | ".join(f"error s{s}" for s in corruption["severities"])
            + " | mean | CE vs baseline |",
        ]
        lines.append("|---|" + "---|" * (len(corruption["severities"]) + 2))
        for name, errors in corruption["error"].items():
            ce = corruption.get("ce", {}).get(name)
            cells = " | ".join(_number(error) for error in errors)
            lines.append(f"| {name} | {cells} | {_number(corruption['mean_error'][name])} | {_number(ce)} |")
        lines.append(f"\nmean corruption error of the on-the-fly proxy: {_number(results['mean_corruption_error'])}")
        if corruption.get("mce") is not None:
            lines.append(f"proxy mCE relative to {corruption['baseline']}: {_number(corruption['mce'])}")
    lines += robustness_rows(results) + stored_corruption_rows(results)
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
