"""Datasets, transforms and loaders of ``mjp train`` and ``mjp eval``.

Datasets: an ImageFolder tree ``<root>/<split>/<class>/<image>`` (ImageNet's layout, and the CIFAR-10/100 folders),
a Hugging Face dataset (``data=hfds/NAME``), WebDataset shards (``data=wds/DIR``), all through timm's readers
(:mod:`mjp_fast.train.readers`, which also says what a stream such as ``wds/`` cannot do), or scikit-learn's digits
(1,797 8x8 glyphs that ship inside scikit-learn: the embedded default needs no download).

Transforms are timm's (``create_transform``): the training one with RandAugment, random erasing and the rest of the
recipe; the evaluation one resizes and center-crops and returns uint8 tensors, so corruptions can be applied to
the pixels before the loop normalizes them on the device.

``cache_images=true`` decodes a folder or ``hfds/`` dataset once into memory (:class:`InMemoryImageDataset`: uint8
pixels in one NumPy array when the images share a size): the loader workers then read pixels instead of files
(fork shares the array), and every later run of the same process on the same split reuses the decoded pixels
(``mjp reproduce`` trains many variants on one dataset). :func:`clear_image_cache` frees them.

Unreadable images (a truncated file, a text file named ``.jpg``): the next readable image takes the place of one,
the loader names it, counts the skips at the end of each epoch, and refuses (ConfigError) past ``max_bad_images``
distinct files, with or without ``cache_images`` (:mod:`mjp_fast.train.readers`).

Reproducibility: every sample a training epoch draws gets its own seed from ``(seed, rank, epoch, position in the
epoch)``, set before its transform runs. Augmentations are then a pure function of those four numbers, whatever
the number of loader workers, and a run resumed in the middle of an epoch draws exactly what it would have drawn.
(A stream's order depends on the number of loader workers, see :class:`mjp_fast.train.readers.SeededStream`.)
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from timm.data.distributed_sampler import OrderedDistributedSampler, RepeatAugSampler
from timm.data.random_erasing import RandomErasing
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, Subset

from mjp_fast._seeds import draw_seed
from mjp_fast.train.augment import pillow_safe
from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.readers import (
    DEFAULT_MAX_BAD_IMAGES,
    DataSource,
    ImageFiles,
    SampleStream,
    SeededStream,
    SkipReportingDataset,
    decode_all,
    folder_images,
    hf_images,
    max_bad_images,
    parse_source,
    read_sample,
    resolve_hf_split,
    resolve_wds_split,
    wds_stream,
)
from mjp_fast.train.unreadable import Batches, UnreadableImages, collate_samples

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
VAL_SPLIT_NAMES = ("val", "validation", "test")
DIGITS_VAL_FRACTION = 0.2


def epoch_seeds(seed: int, rank: int, epoch: int, count: int) -> np.ndarray:
    """uint32 ``[count]``: the seeds of an epoch's sample positions on ``rank``, unrelated across seeds, ranks and
    epochs (one :class:`numpy.random.SeedSequence` for the epoch)."""
    return np.random.SeedSequence([int(seed), int(rank), int(epoch)]).generate_state(max(count, 1))[:count]


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global generators (CUDA's too, when initialized)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class DigitsDataset(Dataset):
    """scikit-learn's handwritten digits (8x8 glyphs, 10 classes) as RGB PIL images; a fixed stratified split.

    Args:
        split: ``"train"`` (80 %, 1,437 images) or ``"val"`` (20 %, 360 images).
    """

    def __init__(self, split: str = "train", transform: Any = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        if split not in ("train", "val"):
            raise ValueError(f"split must be train or val, got {split!r}")
        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
        indices = np.arange(len(images))
        train_index, val_index = train_test_split(
            indices, test_size=DIGITS_VAL_FRACTION, random_state=0, stratify=digits.target
        )
        chosen = np.sort(train_index if split == "train" else val_index)
        self.images = images[chosen]
        self.targets = [int(target) for target in digits.target[chosen]]
        self.classes = [str(digit) for digit in range(10)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = Image.fromarray(self.images[index], mode="L").convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def _class_folders(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in split_dir.iterdir() if entry.is_dir() and not entry.name.startswith("."))


def resolve_split(root: str | Path, split: str, *, validation: bool = False) -> Path:
    """The folder of ``split`` under ``root``; ``auto`` (validation only) tries val, validation, test."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"data folder {str(root)!r} does not exist")
    candidates = VAL_SPLIT_NAMES if (validation and split == "auto") else (split,)
    for name in candidates:
        if (root / name).is_dir():
            return root / name
    expected = " or ".join(f"{root}/{name}" for name in candidates)
    raise ConfigError(f"data folder {str(root)!r} has no {expected} folder (expected <data>/<split>/<class>/<image>)")


def folder_dataset(
    split_dir: Path, classes: list[str] | None = None, *, max_bad: int = DEFAULT_MAX_BAD_IMAGES
) -> ImageFiles:
    """An ImageFolder dataset (timm's folder reader); refuses an empty split or one whose classes differ from
    ``classes``. ``max_bad``: the unreadable images a run tolerates (:class:`~mjp_fast.train.readers.ImageFiles`)."""
    found = _class_folders(split_dir)
    if not found:
        raise ConfigError(f"data folder {str(split_dir)!r} has no class folders (expected <split>/<class>/<image>)")
    if classes is not None and found != classes:
        missing = sorted(set(classes) - set(found))
        extra = sorted(set(found) - set(classes))
        raise ConfigError(
            f"data folder {str(split_dir)!r} has other classes than the training split "
            f"(missing: {missing[:5]}, extra: {extra[:5]})"
        )
    class_map = {name: index for index, name in enumerate(classes or found)}
    try:
        return folder_images(split_dir, class_map, max_bad)
    except RuntimeError:  # timm's folder reader: no file with an image extension
        raise ConfigError(f"data folder {str(split_dir)!r} holds no images ({', '.join(IMAGE_EXTENSIONS)})") from None


def fixed_subset(dataset: Dataset, size: int | None) -> Dataset:
    """The first ``size`` samples of a fixed shuffle of ``dataset`` (so a subset of a class-sorted folder still
    holds every class); the whole dataset when ``size`` is None or not smaller."""
    if size is None or size >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:size]
    subset = Subset(dataset, sorted(order.tolist()))
    subset.classes = dataset.classes
    return subset


class InMemoryImageDataset(Dataset):
    """Decoded images held in memory: ``(PIL RGB image through transform, target)`` per sample, as the dataset
    it was decoded from gives them, without reading files.

    Args:
        pixels: uint8 ``[N, H, W, 3]`` (one array: images of one size) or a sequence of ``[H, W, 3]`` arrays.
        targets: ``N`` class indices.
        classes: the class names.
        transform: applied to each PIL image (set later by the training loop).
    """

    def __init__(
        self,
        pixels: np.ndarray | Sequence[np.ndarray],
        targets: Sequence[int],
        classes: list[str],
        transform: Any = None,
    ) -> None:
        if len(pixels) != len(targets):
            raise ValueError(f"pixels and targets must have one entry per image, got {len(pixels)} and {len(targets)}")
        self.pixels = pixels
        self.targets = list(targets)
        self.classes = list(classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = Image.fromarray(self.pixels[index])  # uint8 [H, W, 3]: an RGB image
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]

    def view(self) -> InMemoryImageDataset:
        """Another dataset over the same pixels, with its own transform (no copy)."""
        return InMemoryImageDataset(self.pixels, self.targets, self.classes)


def decode_in_memory(dataset: Dataset) -> InMemoryImageDataset:
    """Decodes every image of a map-style dataset (an :class:`~mjp_fast.train.readers.ImageFiles`: a folder or
    ``hfds/``, or a ``Subset`` of one) into memory, in threads. An unreadable image gets the pixels of the one that
    replaces it in the dataset; ConfigError past the dataset's ``max_bad_images`` of them."""
    base, indices = (dataset.dataset, dataset.indices) if isinstance(dataset, Subset) else (dataset, None)
    chosen = list(indices) if indices is not None else list(range(len(base)))
    workers = max(1, min(16, default_workers(1)))
    decoded, targets = decode_all(base, chosen, workers)
    shapes = {array.shape for array in decoded}
    pixels = np.stack(decoded) if len(shapes) == 1 else decoded  # one array shares best across forked workers
    return InMemoryImageDataset(pixels, targets, base.classes)


# (source, split, classes, subset size) -> decoded images: one decode per process, whatever the number of runs.
_IMAGE_CACHE: dict[tuple[str, str, tuple[str, ...] | None, int | None], InMemoryImageDataset] = {}


def cached_dataset(
    source: DataSource, split: str, classes: list[str] | None, size: int | None, max_bad: int
) -> InMemoryImageDataset:
    """The split ``split`` of ``source`` (a folder: the split folder's path), cut to :func:`fixed_subset` ``size``,
    decoded into memory once per process: later calls with the same arguments reuse the pixels."""
    if source.scheme:
        key = (str(source), split, tuple(classes) if classes is not None else None, size)
    else:
        key = (str(Path(split).resolve()), "", tuple(classes) if classes is not None else None, size)
    if key not in _IMAGE_CACHE:
        _IMAGE_CACHE[key] = decode_in_memory(fixed_subset(_map_dataset(source, split, classes, max_bad), size))
    return _IMAGE_CACHE[key].view()


def cached_folder_dataset(
    split_dir: Path, classes: list[str] | None, size: int | None, *, max_bad: int = DEFAULT_MAX_BAD_IMAGES
) -> InMemoryImageDataset:
    """:func:`folder_dataset` of ``split_dir`` cut to :func:`fixed_subset` ``size``, decoded into memory once per
    process: later calls with the same arguments reuse the pixels (the folder is not listed again)."""
    return cached_dataset(DataSource("", str(split_dir)), str(split_dir), classes, size, max_bad)


def clear_image_cache() -> None:
    """Frees the images that ``cache_images=true`` decoded."""
    _IMAGE_CACHE.clear()


def _map_dataset(source: DataSource, split: str, classes: list[str] | None, max_bad: int) -> ImageFiles:
    """A folder's split (``split``: its path) or a ``hfds/`` split, as :class:`ImageFiles`."""
    if source.scheme == "hfds":
        return hf_images(source.location, split, classes, max_bad)
    return folder_dataset(Path(split), classes, max_bad=max_bad)


def _stream_datasets(
    config: TrainConfig, source: DataSource, need_train: bool, max_bad: int
) -> tuple[Dataset | None, Dataset, list[str]]:
    """A ``wds/`` source's training and validation streams (timm's IterableImageDataset) and class names."""
    if config.cache_images:
        raise ConfigError(
            f"cache_images=true decodes a dataset by index, and {source} is a stream: set cache_images=false "
            "(or use a folder or hfds/ dataset)"
        )
    if config.num_classes is None:
        raise ConfigError(f"{source}: a WebDataset does not list its classes; set num_classes=N")
    root = source.location
    train = None
    if need_train:
        train = wds_stream(
            root,
            resolve_wds_split(root, config.train_split),
            training=True,
            batch_size=config.batch_size,
            seed=config.seed,
            num_samples=config.max_train_samples,
        )
        train.max_bad_images = max_bad
    val = wds_stream(
        root,
        resolve_wds_split(root, config.val_split, validation=True),
        training=False,
        batch_size=config.eval_batch_size or 2 * config.batch_size,
        seed=config.seed,
        num_samples=config.max_val_samples,
    )
    val.max_bad_images = max_bad
    classes = [str(index) for index in range(config.num_classes)]
    return train, val, classes


def build_datasets(config: TrainConfig, *, need_train: bool = True) -> tuple[Dataset | None, Dataset, list[str]]:
    """(training set or None, validation set, class names), without transforms. Raises ConfigError.

    A ``wds/`` source gives timm's streams (``IterableDataset``), the others map-style datasets.
    """
    if config.dataset_kind == "digits":
        train = fixed_subset(DigitsDataset("train"), config.max_train_samples) if need_train else None
        val = fixed_subset(DigitsDataset("val"), config.max_val_samples)
        return train, val, val.classes
    source = parse_source(str(config.data))
    max_bad = max_bad_images(config)
    if source.streams:
        return _stream_datasets(config, source, need_train, max_bad)
    if source.scheme == "hfds":
        train_split = resolve_hf_split(source.location, config.train_split) if need_train else None
        val_split = resolve_hf_split(source.location, config.val_split, validation=True)
    else:
        root = Path(source.location)
        train_split = str(resolve_split(root, config.train_split)) if need_train else None
        val_split = str(resolve_split(root, config.val_split, validation=True))
    train, classes = None, None
    if config.cache_images:
        if train_split is not None:
            train = cached_dataset(source, train_split, None, config.max_train_samples, max_bad)
            classes = train.classes
        val = cached_dataset(source, val_split, classes, config.max_val_samples, max_bad)
        return train, val, val.classes
    if train_split is not None:
        train = fixed_subset(_map_dataset(source, train_split, None, max_bad), config.max_train_samples)
        classes = train.classes
    val = fixed_subset(_map_dataset(source, val_split, classes, max_bad), config.max_val_samples)
    return train, val, val.classes


def set_transform(dataset: Dataset, transform: Any) -> None:
    """Gives ``dataset`` (or the dataset under a ``Subset``) the transform its samples go through."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    base.transform = transform


def train_transform(config: TrainConfig, img_size: int, mean: tuple, std: tuple, *, on_device: bool = False) -> Any:
    """timm's training transform with the config's augmentations: normalized float ``[3, H, W]`` output, or with
    ``on_device`` uint8 ``[3, H, W]`` that :class:`DeviceNormalize` normalizes and randomly erases on the device.

    Its auto-augment operations posterize through :func:`mjp_fast.train.augment.posterize`, which takes the 0 bits
    that the recipe's RandAugment draws at full magnitude on any Pillow (Pillow 13 refuses them).
    """
    transform = create_transform(
        img_size,
        is_training=True,
        scale=tuple(config.scale),
        hflip=config.hflip,
        # a zero jitter is no jitter: timm would still add a ColorJitter that changes nothing, yet draws from torch's
        # generator and took about 30% of the digits preset's per-image time
        color_jitter=config.color_jitter or None,
        auto_augment=config.auto_augment,
        interpolation=config.interpolation,
        mean=mean,
        std=std,
        re_prob=config.reprob,
        re_mode=config.remode,
        re_count=config.recount,
        use_prefetcher=on_device,  # timm's name: uint8 out, no normalization and no random erasing here
    )
    return pillow_safe(transform)


class DeviceNormalize:
    """A uint8 batch to the normalized float32 one the model trains on, then random erasing: on the batch's device.

    timm's prefetcher does the same on a GPU (``timm.data.PrefetchLoader``) but one batch ahead, on a side stream;
    here it runs in the step, in order, so its random draws come after the previous step's (and a resumed run draws
    what the uninterrupted one drew). Erasing fills with normal noise in the normalized space, as on the CPU.

    Args:
        mean, std: per channel, in [0, 1] units (the model's).
        config: its ``reprob``, ``remode``, ``recount``.
        device: where the batches are.
    """

    def __init__(self, mean: tuple, std: tuple, config: TrainConfig, device: torch.device) -> None:
        self.mean = torch.tensor([255.0 * value for value in mean], device=device).view(1, -1, 1, 1)
        self.std = torch.tensor([255.0 * value for value in std], device=device).view(1, -1, 1, 1)
        self.erase = (
            RandomErasing(config.reprob, mode=config.remode, max_count=config.recount, device=device)
            if config.reprob > 0
            else None
        )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, C, H, W]`` -> float32 ``[B, C, H, W]``, normalized, some samples erased."""
        images = images.float().sub_(self.mean).div_(self.std)
        return self.erase(images) if self.erase is not None else images


def eval_transform(img_size: int, interpolation: str, crop_pct: float) -> Any:
    """timm's evaluation transform (resize, center crop) returning uint8 ``[3, H, W]`` tensors, not normalized."""
    return create_transform(
        img_size, is_training=False, interpolation=interpolation, crop_pct=crop_pct, normalize=False
    )


class SeededDataset(Dataset):
    """Wraps a dataset whose indices come as ``(index, seed)``: the seed is set before the sample's transform.
    Samples are ``(image, target, skips)`` (:func:`~mjp_fast.train.readers.read_sample`: the unreadable images
    passed over), for :func:`~mjp_fast.train.unreadable.collate_samples`."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        index, seed = item
        random.seed(seed)
        np.random.seed(seed)
        torch.default_generator.manual_seed(seed)  # the CPU generator only: transforms run on the CPU
        return read_sample(self.dataset, index)


class SeededEpochSampler(Sampler):
    """Yields ``(index, seed)`` for the indices of ``inner`` (a distributed or repeated-augmentation sampler) in
    the current epoch, skipping the first ``start`` (to resume within an epoch)."""

    def __init__(self, inner: Sampler, seed: int, rank: int) -> None:
        self.inner, self.seed, self.rank = inner, seed, rank
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        # RepeatAugSampler shuffles with the epoch alone: fold the run's seed in, so seeds give different orders.
        offset = self.seed * 1_000_003 if isinstance(self.inner, RepeatAugSampler) else 0
        self.inner.set_epoch(epoch + offset)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # The epoch's seeds in one call, a 32-bit seed per position: the loader draws indices in the main process,
        # between training steps, where a SeedSequence per sample cost about 15 us (2 ms a batch of 128).
        seeds = epoch_seeds(self.seed, self.rank, self.epoch, len(self.inner)).tolist()
        for position, index in enumerate(self.inner):
            if position >= self.start:
                yield index, seeds[position]

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


def default_workers(world_size: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, cpus // max(world_size, 1)))


def train_loader(
    config: TrainConfig, dataset: Dataset, *, rank: int, world_size: int, pin_memory: bool
) -> tuple[Batches, SeededEpochSampler | SeededStream]:
    """The training loader (drop_last, so every step has the same batch) and its sampler (``set_epoch(epoch,
    start)``); the loader gives ``(images, targets)`` batches and reports unreadable images
    (:class:`~mjp_fast.train.unreadable.Batches`). A stream (``wds/``) gets :class:`SeededStream` as its sampler."""
    workers = config.workers if config.workers is not None else default_workers(world_size)
    unreadable = UnreadableImages(max_bad_images(config))
    if isinstance(dataset, IterableDataset):
        stream = _training_stream(config, dataset, rank=rank, world_size=world_size, workers=workers)
        loader = DataLoader(
            stream,
            batch_size=config.batch_size,
            num_workers=workers,
            collate_fn=collate_samples,
            pin_memory=pin_memory,
            drop_last=True,
            generator=stream.generator,
            # new workers each epoch: they take the epoch and start set in the main process, and a fresh pipeline
            persistent_workers=False,
        )
        return Batches(loader, dataset, unreadable), stream
    if config.repeated_aug:
        # timm rounds an epoch down to a multiple of 256 images (the original RASampler); before timm 1.0.31 that
        # left a set of fewer than 256 images with no batch at all, so smaller sets are not rounded (as 1.0.31).
        selected_round = 256 if len(dataset) >= 256 else 0
        inner = RepeatAugSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            num_repeats=config.aug_repeats,
            selected_round=selected_round,
        )
    else:
        inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed)
    if len(inner) < config.batch_size:
        raise ConfigError(
            f"the training set gives {len(inner)} samples per rank and epoch, fewer than batch_size "
            f"{config.batch_size}: lower batch_size or use more data"
        )
    sampler = SeededEpochSampler(inner, config.seed, rank)
    loader = DataLoader(
        SeededDataset(dataset),
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_samples,
        pin_memory=pin_memory,
        drop_last=True,
        persistent_workers=workers > 0,
    )
    return Batches(loader, dataset, unreadable), sampler


def _training_stream(
    config: TrainConfig, dataset: IterableDataset, *, rank: int, world_size: int, workers: int
) -> SeededStream:
    """:class:`SeededStream` over timm's training stream ``dataset``; refuses what a stream cannot do."""
    if config.repeated_aug:
        raise ConfigError(
            "repeated_aug=true draws each image several times by index, and a WebDataset is a stream: set "
            "repeated_aug=false (or use a folder or hfds/ dataset)"
        )
    shards = len(dataset.reader.split_info.filenames)
    readers = max(workers, 1) * world_size
    if shards < readers:
        # timm gives each loader process of each rank its own shards: one without a shard would end its epoch early
        raise ConfigError(
            f"the WebDataset training split has {shards} shard{'s' if shards > 1 else ''} for {readers} loader "
            f"processes ({max(workers, 1)} per rank x {world_size} rank{'s' if world_size > 1 else ''}), and each "
            "needs a shard of its own: lower workers, or write more shards"
        )
    dataset.set_loader_cfg(num_workers=workers)  # the epoch's length counts whole batches per worker
    return SeededStream(dataset, config.seed, rank, config.batch_size)


def eval_loader(
    dataset: Dataset, batch_size: int, workers: int, *, rank: int = 0, world_size: int = 1, pin_memory: bool = False
) -> Batches:
    """A sequential loader; with several ranks each gets its own shard (timm's OrderedDistributedSampler; a
    stream's reader shards itself). Unreadable images are named and counted per pass, up to the dataset's
    ``max_bad_images`` (:class:`~mjp_fast.train.unreadable.Batches`); ``len(loader.dataset)``: the images a pass
    reads."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    unreadable = UnreadableImages(getattr(base, "max_bad_images", DEFAULT_MAX_BAD_IMAGES), what="evaluation")
    if isinstance(dataset, IterableDataset):
        stream = SampleStream(dataset)
        loader = DataLoader(
            stream,
            batch_size=batch_size,
            num_workers=workers,
            collate_fn=collate_samples,
            pin_memory=pin_memory,
            persistent_workers=False,  # timm's reader keeps its pipeline in a persistent worker: fresh ones read anew
        )
        return Batches(loader, stream, unreadable)
    sampler = OrderedDistributedSampler(dataset, num_replicas=world_size, rank=rank) if world_size > 1 else None
    loader = DataLoader(
        SkipReportingDataset(dataset),
        batch_size=batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=workers,
        collate_fn=collate_samples,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,  # evaluation passes over it many times (corruptions)
    )
    return Batches(loader, dataset, unreadable)


__all__ = [
    "DeviceNormalize",
    "DigitsDataset",
    "InMemoryImageDataset",
    "SeededDataset",
    "SeededEpochSampler",
    "build_datasets",
    "cached_dataset",
    "cached_folder_dataset",
    "clear_image_cache",
    "decode_in_memory",
    "draw_seed",
    "epoch_seeds",
    "eval_loader",
    "eval_transform",
    "fixed_subset",
    "folder_dataset",
    "resolve_split",
    "seed_everything",
    "set_transform",
    "train_loader",
    "train_transform",
]
