"""Shared pieces of the ImageNet-C and CIFAR-10-C tests: a classifier with known errors, a pass over stored
corruptions with it, and a tiny checkpoint trained on a given ImageFolder tree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from mjp_fast.evaluate.cifar10_c import CIFAR10_CLASSES
from mjp_fast.evaluate.common_corruptions import StoredCorruptions, measure_errors
from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.train.data import eval_loader, eval_transform, set_transform

IMG_SIZE = 16


class ConstantClassifier(nn.Module):
    """Predicts class ``choice`` for every image: its error on a set is the share of images of other classes."""

    def __init__(self, num_classes: int, choice: int) -> None:
        super().__init__()
        self.num_classes, self.choice = num_classes, choice
        self.anchor = nn.Parameter(torch.zeros(1))  # evaluate_model reads the parameters' device

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3)).unsqueeze(1)  # [B, 1]

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if pre_logits:
            return features
        logits = torch.zeros(features.shape[0], self.num_classes)
        logits[:, self.choice] = 1.0
        return logits


def measure(model: nn.Module, sets: StoredCorruptions, crop_pct: float = 1.0) -> dict[str, list[float]]:
    """Each corruption's top-1 error (%) per severity of ``model`` on ``sets``, through the evaluation's own
    transform, loader and pass (:func:`mjp_fast.evaluate.metrics.evaluate_model`)."""
    transform = eval_transform(IMG_SIZE, "bilinear", sets.crop_pct or crop_pct)

    def evaluate(description: str, dataset) -> float:
        set_transform(dataset, transform)
        loader = eval_loader(dataset, 4, 0)
        mean, std = torch.zeros(3), torch.ones(3)
        return evaluate_model(model, loader, device="cpu", mean=mean, std=std, ratio=0.0, jigsaw="none")["top1"]

    return measure_errors(sets, evaluate)


def train_tiny(data: Path, output: Path, *, mjp: bool) -> Path:
    """The checkpoint of one epoch of the tests' tiny ViT on the ImageFolder tree ``data``."""
    from mjp_fast.train.config import load_config
    from mjp_fast.train.loop import train
    from tests.train.helpers import tiny_overrides

    overrides = tiny_overrides(data=str(data), output=str(output), mjp=mjp, epochs=1, warmup_epochs=0)
    return train(load_config(None, overrides)).checkpoint


def link(source: Path, target: Path) -> None:
    """``target`` -> ``source`` (the real images stay in ../shared/data; nothing is copied)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(source)


PER_SEVERITY = 4
# CIFAR-10 labels of the 4 images of each severity (class indices in CIFAR-10's order: 0 airplane, 1 automobile)
LABELS = [[0, 1, 2, 3], [0, 0, 1, 2], [0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]


def cifar_pictures() -> dict[int, list[np.ndarray]]:
    """Real CIFAR-10 test images, uint8 [32, 32, 3], 4 of each class by CIFAR-10 index."""
    from tests.train.helpers import CIFAR10

    found = {}
    for label, name in enumerate(CIFAR10_CLASSES):
        files = sorted((CIFAR10 / "test" / name).iterdir())[:PER_SEVERITY]
        found[label] = [np.asarray(Image.open(path).convert("RGB")) for path in files]
    return found


def write_cifar10_c(
    root: Path, pictures, corruptions=("gaussian_noise", "fog"), labels=LABELS, per_severity_labels=False
) -> Path:
    """CIFAR-10-C's layout in miniature: ``root/<corruption>.npy`` uint8 [5 x 4, 32, 32, 3] (severity s: real
    images of the classes ``labels[s - 1]``, darkened more with s, so every severity differs) and
    ``root/labels.npy`` (all 20 labels, or with ``per_severity_labels`` one severity's 4)."""
    root.mkdir(parents=True, exist_ok=True)
    for offset, corruption in enumerate(corruptions):
        stack = []
        for severity, row in enumerate(labels, start=1):
            for position, label in enumerate(row):
                image = pictures[label][(position + offset) % PER_SEVERITY].astype(np.int16)
                stack.append(np.clip(image - 20 * severity, 0, 255).astype(np.uint8))
        np.save(root / f"{corruption}.npy", np.stack(stack))
    flat = np.asarray(labels[0] if per_severity_labels else [label for row in labels for label in row], np.int64)
    np.save(root / "labels.npy", flat)
    return root
