"""CIFAR-10-C as its authors release it: ``mjp eval --cifar10-c DIR`` and ``mjp reproduce --cifar10-c DIR``.

Hendrycks and Dietterich, ICLR 2019 (https://github.com/hendrycks/robustness; Zenodo record 2535967,
``CIFAR-10-C.tar``). The 10,000 CIFAR-10 test images under the same 15 + 4 corruptions as ImageNet-C, one NumPy
file per corruption::

    DIR/<corruption>.npy   uint8 [50000, 32, 32, 3]: severity 1's 10,000 images, then severity 2's, ... 5's
    DIR/labels.npy         [50000] class indices 0..9 in CIFAR-10's order (the test labels, once per severity)

A ``labels.npy`` of one severity's length (the 10,000 labels once) is read too, and so is a smaller set of the same
layout (``5 x N`` images). The labels are CIFAR-10's (airplane, automobile, bird, cat, deer, dog, frog, horse,
ship, truck), matched to the model's classes by name: the model must have all ten.

There are no published reference errors for CIFAR-10-C: its table has the unnormalized mean corruption error, and
with a baseline the CE and mCE relative to the baseline (:func:`mjp_fast.evaluate.common_corruptions.
corruption_table`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from mjp_fast.evaluate.common_corruptions import ALL_CORRUPTIONS, BENCHMARK, SEVERITIES, StoredCorruptions
from mjp_fast.evaluate.releases import CIFAR10_C_IMAGES

OPTION = "--cifar10-c"
BENCHMARK_NAME = "CIFAR-10-C"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (32, 32, 3)
LABELS_FILE = "labels.npy"


class SeverityImages(Dataset):
    """One severity of one corruption: ``(transform(PIL image), target)``, the target the model's class index.

    Args:
        images: uint8 ``[N, 32, 32, 3]`` (a slice of a memory-mapped array: read as the loader asks).
        labels: ``[N]`` CIFAR-10 class indices. targets: the model's index of each CIFAR-10 class.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, targets: Sequence[int]) -> None:
        self.images, self.labels, self.targets = images, labels, list(targets)
        self.transform: Callable[[Image.Image], Any] | None = None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = Image.fromarray(np.ascontiguousarray(self.images[index]))
        target = self.targets[int(self.labels[index])]
        return (self.transform(image) if self.transform is not None else image), target


def cifar10_targets(classes: Sequence[str]) -> list[int]:
    """The model's output index of each CIFAR-10 class, by name. Raises ValueError naming ``--cifar10-c`` when the
    model lacks some of them."""
    position = {str(name).lower(): index for index, name in enumerate(classes)}
    lacking = [name for name in CIFAR10_CLASSES if name not in position]
    if lacking:
        shown = ", ".join(map(str, classes[:10])) + (", ..." if len(classes) > 10 else "")
        raise ValueError(
            f"{OPTION}: the model's {len(classes)} classes ({shown}) lack CIFAR-10's {', '.join(lacking)}: "
            "CIFAR-10-C needs a model trained on CIFAR-10's ten classes"
        )
    return [position[name] for name in CIFAR10_CLASSES]


def _load(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    # Any exception of NumPy's reader is a damaged file: EOFError (empty), OverflowError (a negative or huge
    # dimension the memory map refuses), ValueError, tokenize.TokenError (a header length that cuts the header
    # dict), zipfile.BadZipFile (zip magic bytes: np.load takes the file for a .npz), ...
    except Exception as error:  # noqa: BLE001 - the kinds above and more; each is the file's fault, said in one line
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{OPTION}: cannot read {str(path)!r} as a NumPy array ({reason})") from None
    if not isinstance(array, np.ndarray):  # a .npz archive under the .npy name: np.load hands back its NpzFile
        array.close()
        raise ValueError(f"{OPTION}: {str(path)!r} is a .npz archive, not a .npy array")
    return array


def _severity_maker(images: np.ndarray, labels: np.ndarray, targets: list[int]) -> Callable[[], SeverityImages]:
    return lambda: SeverityImages(images, labels, targets)


def open_cifar10_c(root: str | Path, classes: Sequence[str]) -> StoredCorruptions:
    """Checks the CIFAR-10-C files at ``root`` (memory-mapped, not read) and maps its labels to the model's classes.

    Raises:
        ValueError: one line naming ``--cifar10-c``: a missing folder or ``labels.npy``, no corruption file, an
            array of the wrong shape or type, labels that do not match the images, or a model without CIFAR-10's
            ten classes.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{OPTION}: folder {str(root)!r} does not exist")
    paths = {name: root / f"{name}.npy" for name in ALL_CORRUPTIONS if (root / f"{name}.npy").is_file()}
    if not paths:
        raise ValueError(
            f"{OPTION}: {str(root)!r} holds none of CIFAR-10-C's corruption files ({BENCHMARK[0]}.npy, "
            f"{BENCHMARK[1]}.npy, ...): expected {OPTION} DIR/<corruption>.npy and DIR/{LABELS_FILE}"
        )
    if not (root / LABELS_FILE).is_file():
        raise ValueError(
            f"{OPTION}: {str(root / LABELS_FILE)!r} is missing: CIFAR-10-C's labels come in it, beside the "
            "corruption files"
        )
    targets = cifar10_targets(classes)
    labels = _load(root / LABELS_FILE)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{OPTION}: {str(root / LABELS_FILE)!r} holds {labels.dtype} {list(labels.shape)}: expected integer "
            "class indices [N]"
        )
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= len(CIFAR10_CLASSES)):
        raise ValueError(
            f"{OPTION}: {str(root / LABELS_FILE)!r} holds labels outside 0..9 (from {int(labels.min())} to "
            f"{int(labels.max())}): CIFAR-10 has ten classes"
        )
    sources: dict[str, list[Callable[[], SeverityImages]]] = {}
    for name, path in paths.items():
        images = _load(path)
        count = images.shape[0] // len(SEVERITIES) if images.ndim == 4 else 0
        if (
            images.dtype != np.uint8
            or images.ndim != 4
            or tuple(images.shape[1:]) != IMAGE_SHAPE
            or count == 0
            or images.shape[0] != count * len(SEVERITIES)
        ):
            raise ValueError(
                f"{OPTION}: {str(path)!r} holds {images.dtype} {list(images.shape)}: CIFAR-10-C's arrays are uint8 "
                "[5 x N, 32, 32, 3] (5 severities of N images, stacked; N = 10,000 in the release)"
            )
        if len(labels) not in (count, images.shape[0]):
            raise ValueError(
                f"{OPTION}: {str(root / LABELS_FILE)!r} has {len(labels)} labels for the {images.shape[0]} images of "
                f"{str(path)!r}: expected one per image ({images.shape[0]}) or one per image of a severity ({count})"
            )
        sources[name] = [
            _severity_maker(
                images[offset : offset + count],
                labels if len(labels) == count else labels[offset : offset + count],
                targets,
            )
            for offset in range(0, count * len(SEVERITIES), count)
        ]
    missing = [name for name in BENCHMARK if name not in paths]
    return StoredCorruptions(BENCHMARK_NAME, OPTION, root, sources, missing, release_images=CIFAR10_C_IMAGES)
