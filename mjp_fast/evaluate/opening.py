"""Opening a checkpoint for ``mjp eval``, before any pass over the data: the arguments checked, the run's model and
validation data rebuilt through the training package, the baseline loaded, and the robustness benchmarks asked for
(ImageNet-C, CIFAR-10-C, ImageNet-A, -R, -O) opened and checked against the model's classes.

Bad paths and values are found here, before :func:`~mjp_fast.evaluate.run.evaluate_checkpoint` measures anything:
a ConfigError naming the option. The training package is imported inside the functions, when a checkpoint
is opened: evaluation sits below training, which imports it for the validation of every epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast._model_geometry import input_size
from mjp_fast.evaluate.cifar10_c import open_cifar10_c
from mjp_fast.evaluate.common_corruptions import StoredCorruptions
from mjp_fast.evaluate.corruptions import SEVERITIES, resolve_corruptions
from mjp_fast.evaluate.imagenet_c import open_imagenet_c
from mjp_fast.evaluate.metrics import resolve_jigsaw_mode
from mjp_fast.evaluate.natural import NaturalSet, open_natural_sets


@dataclass
class OpenedCheckpoint:
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


def robustness_dtype(amp: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """Autocast's dtype for the robustness benchmarks: float32 (None) unless ``--amp`` names one (bf16, fp16);
    ``auto``, which is bf16 on CUDA for the other passes, keeps them in float32, as their authors evaluate."""
    return None if amp == "auto" else dtype


def open_checkpoint(
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
) -> tuple[OpenedCheckpoint, list[str]]:
    """Checks the arguments, then rebuilds the checkpoint's model and validation data (and the baseline's model)
    with the training package; returns them with the corruptions' names. Raises ConfigError as
    :func:`~mjp_fast.evaluate.run.evaluate_checkpoint` does, naming the option.

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
    opened = OpenedCheckpoint(model, state, config, loader, torch_device, mean, std, dtype, mode, baseline_model)
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
    opened: OpenedCheckpoint, paths: dict[str, str | Path], classes: list[str], num_classes: int
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
