"""Shared pieces of the training and evaluation tests: a tiny CIFAR-10 tree and a tiny ViT config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CIFAR10 = REPO_ROOT.parent / "shared" / "data" / "cifar10"
CLASSES = ("airplane", "automobile", "cat")

# A 16x16 ViT with one block on a 4x4 grid: each training step takes milliseconds on one CPU core.
TINY = {
    "model": "vit_tiny_patch16_224",
    "img_size": 16,
    "patch_size": 4,
    "embed_dim": 32,
    "depth": 1,
    "num_heads": 2,
    "drop_path": 0.1,
    "batch_size": 8,
    "eval_batch_size": 16,
    "workers": 0,
    "epochs": 2,
    "warmup_epochs": 1,
    "lr": 1e-3,
    "crop_pct": 1.0,
    "mjp_ratio": 0.25,
    "progress": "off",
    "threads": 1,
}


def tiny_overrides(**changes) -> list[str]:
    values = {**TINY, **changes}
    return [f"{key}={'none' if value is None else value}" for key, value in values.items()]


def make_cifar_tree(root: Path, train_per_class: int = 16, test_per_class: int = 8) -> Path:
    """A small ImageFolder tree of links to real CIFAR-10 images (the images stay in ../shared/data)."""
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10}")
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for name in CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for image in sorted((CIFAR10 / split / name).iterdir())[:count]:
                target = folder / image.name
                if not target.exists():
                    os.symlink(image, target)
    return root
