"""The named configs that ``mjp train --config NAME`` and :func:`~mjp_fast.train.config.load_config` take besides
a file: the built-in presets (:data:`PRESETS`: ``digits``, the embedded default that needs no data) and the recipe
files bundled in ``mjp_fast/configs`` (:func:`bundled_configs`: ``deit_s``, ``deit_ti``, ``vit_s``, ``cifar10``).

A preset is a mapping of key values, a bundled recipe a YAML file: :mod:`mjp_fast.train.config` checks both as
it checks a user's file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The embedded default: scikit-learn's digits (they ship inside scikit-learn: no download), upsampled from 8x8 to
# 16x16, a 2-block ViT with 4x4 patches (a 4x4 grid), a baseline and an MJP model side by side, about 75 s
# on 2 CPU cores. One torch thread (faster than two for so small a model, and steadier on a shared machine) and one
# loader process on the other core; the loader gives uint8 images and the step normalizes the batch (per image,
# torchvision's float conversion and normalization took half the loader's time, and with them the loader process
# was slower than the model's step).
# Changed from the recipe, as config values: RandAugment, mixup, cutmix, random erasing, flips and repeated
# augmentation are off (on 8x8 glyphs they cost accuracy in so short a run: a flipped 2 is not a 2); the learning
# rate is set directly; and the MJP ratio is 0.25, since on a 16-patch grid the paper's 0.1 masks one patch, and
# a one-patch jigsaw moves nothing.
PRESETS: dict[str, dict[str, Any]] = {
    "digits": {
        "model": "deit_tiny_patch16_224",
        "img_size": 16,
        "patch_size": 4,
        "embed_dim": 64,
        "depth": 2,
        "num_heads": 4,
        "drop_path": 0.0,
        "mjp_ratio": 0.25,
        "dataset": "digits",
        "batch_size": 32,
        "workers": 1,
        "threads": 1,
        "normalize_on_device": "on",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "auto_augment": None,
        "color_jitter": 0.0,
        "hflip": 0.0,
        "scale": [0.8, 1.0],
        "reprob": 0.0,
        "mixup": 0.0,
        "cutmix": 0.0,
        "repeated_aug": False,
        "lr": 2e-3,
        "epochs": 30,
        "eval_interval": 5,
        "warmup_epochs": 3,
        "min_lr": 1e-5,
        "compare": True,
        # more than an epoch's 44 steps: without a terminal's bar, one progress line per 1.5-second epoch is enough
        "log_interval": 50,
    },
}


# The paper's recipes as YAML files inside the package (setup.py's package_data carries them into wheels), so that
# `--config deit_s` works from any folder, without a checkout.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_SUFFIX = ".yaml"


def bundled_configs() -> dict[str, Path]:
    """The recipe files shipped with mjp_fast: name (the file name without ``.yaml``, e.g. ``deit_s``) -> path,
    sorted by name. ``load_config(name)`` and ``mjp train --config name`` accept these names."""
    if not CONFIG_DIR.is_dir():
        return {}
    return {path.stem: path for path in sorted(CONFIG_DIR.glob(f"*{CONFIG_SUFFIX}")) if path.is_file()}
