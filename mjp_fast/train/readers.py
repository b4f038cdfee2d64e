"""Where ``mjp train`` and ``mjp eval`` read their images from: timm's dataset readers behind one ``data=`` value.

``data`` names the source; a prefix picks timm's reader (as timm's ``--dataset`` does):

- ``DIR``: an ImageFolder tree ``DIR/<split>/<class>/<image>`` (timm's folder reader).
- ``hfds/NAME``: a Hugging Face dataset with random access (timm's ``hfds`` reader, ``datasets.load_dataset``):
  a hub name such as ``hfds/uoft-cs/cifar10``, or a local folder, ``hfds//data/my_set`` (the output of
  ``save_to_disk``, or a folder of Parquet or Arrow files). Splits are the dataset's own (train, test...).
- ``wds/DIR``: WebDataset shards in ``DIR`` (timm's ``wds`` reader), read as a stream. A split is a name from
  ``DIR/_info.json`` (timm's layout: ``{"splits": {"train": {"num_samples", "filenames", "shard_lengths",
  "name"}}}``), or the shards themselves in timm's brace notation, ``train-{0000..0099}.tar|N`` for N samples.
  Samples hold an image (``.jpg``, ``.png`` or ``.webp``) and a ``.cls`` class index; the number of classes
  comes from the config's ``num_classes`` (a WebDataset does not list its classes).

Map-style sources (folders, ``hfds/``) can be indexed: everything works on them (``cache_images``, fixed subsets,
repeated augmentation, exact resume). A stream (``wds/``) cannot be indexed, so on it:

- an epoch is the reader's: its shards shuffled by (seed, epoch), split between the ranks and loader processes,
  its samples through a shuffle buffer seeded by (seed, rank, epoch, loader process) (by the seed alone without
  loader processes); an epoch's stream, and so a resumed run, is exact for a given number of loader processes
  (:class:`SeededStream`), but changes with that number;
- ``max_train_samples`` sets the samples per epoch (drawn from every shard), not a fixed subset;
  ``max_val_samples`` keeps the first N samples read;
- ``cache_images`` and ``repeated_aug`` are refused (both need random access), as are more loader processes
  (over all ranks) than training shards.

An image that cannot be read is passed over here (:class:`ImageFiles` takes the next readable sample in its place;
timm's stream reader drops it) and named with its batch; what happens next is :mod:`mjp_fast.train.unreadable`'s.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import ImageDataset
from timm.data.readers import create_reader
from torch.utils.data import Dataset, IterableDataset, Subset, get_worker_info

from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.unreadable import UNNAMED, UNREADABLE_ERRORS, Skip, UnreadableImages, describe_error

DEFAULT_MAX_BAD_IMAGES = TrainConfig.max_bad_images  # for datasets built without a config
MAP_SCHEMES = ("hfds",)  # data=<scheme>/<name>: timm readers with random access
STREAM_SCHEMES = ("wds",)  # timm readers that stream
SCHEMES = MAP_SCHEMES + STREAM_SCHEMES
# timm's other prefixes, not read by mjp: say so rather than read hfids/x as a folder called hfids
OTHER_TIMM_SCHEMES = ("hfids", "tfds", "torch")
WDS_SPLIT_NAMES = ("validation", "val", "test")


def max_bad_images(config: Any) -> int:
    """The config's ``max_bad_images``."""
    return int(config.max_bad_images)


@dataclass(frozen=True)
class DataSource:
    """A parsed ``data`` value: ``scheme`` ``""`` (an ImageFolder tree), ``hfds`` or ``wds``; ``location`` the
    folder, the Hugging Face name or path, or the shard folder."""

    scheme: str
    location: str

    @property
    def streams(self) -> bool:
        """Whether the source is read as a stream (no random access)."""
        return self.scheme in STREAM_SCHEMES

    def __str__(self) -> str:
        return f"{self.scheme}/{self.location}" if self.scheme else self.location


def parse_source(data: str) -> DataSource:
    """``data`` -> :class:`DataSource`. The prefix is case-insensitive, as timm's; ``./wds/x`` is a folder.
    Raises ConfigError for timm's prefixes that mjp does not read, or a prefix with nothing after it."""
    prefix, separator, rest = str(data).partition("/")
    scheme = prefix.lower() if separator else ""
    if scheme in OTHER_TIMM_SCHEMES:
        raise ConfigError(
            f"data={data!r}: timm's {scheme}/ datasets are not read by mjp (it reads ImageFolder trees, "
            f"{', '.join(f'{name}/' for name in SCHEMES)})"
        )
    if scheme not in SCHEMES:
        return DataSource("", str(data))
    if not rest:
        raise ConfigError(f"data={data!r} names no dataset after {prefix}/")
    return DataSource(scheme, rest)


def _need(module: str, scheme: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(
            f"{scheme}/ data needs the {module} package: pip install 'mjp_fast[data]' (or pip install {module})"
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# map-style sources: timm's readers, read by ImageFiles


class ImageFiles(ImageDataset):
    """timm's ``ImageDataset`` over any map-style reader (folder, ``hfds``), whose unreadable images are named.

    :meth:`read_sample` gives ``(image through transform, target, skips)``: an image that cannot be decoded is
    replaced by the next readable one (index + 1, wrapping around), and ``skips`` names those passed over. It
    gives up after ``max_bad_images + 1`` in a row (image None): more than the run tolerates anyway.

    Args:
        reader: a timm reader (``timm.data.readers.create_reader``).
        classes: the class names, by index.
        source: what the reader reads (for messages).
        max_bad_images: the distinct unreadable images a run tolerates.
    """

    def __init__(self, reader: Any, classes: list[str], source: str, max_bad_images: int) -> None:
        super().__init__(source, reader=reader)
        self.classes = list(classes)
        self.source = source
        self.max_bad_images = max_bad_images

    def image_name(self, index: int) -> str:
        """The name of sample ``index`` for messages: a folder's file as its absolute path; another source's sample
        as its index in the source, with the file name the source keeps, if any."""
        try:
            name = self.reader.filename(index, absolute=True)
        except (AssertionError, AttributeError, KeyError, IndexError, TypeError, OSError):
            name = None
        if name and Path(str(name)).is_absolute():
            return str(name)
        return f"sample {index} of {self.source}" + (f" ({name})" if name else "")

    def load(self, index: int) -> tuple[Image.Image, int]:
        """The decoded RGB image of ``index`` and its target, without transform. Raises what Pillow raises."""
        source, target = self.reader[index][:2]
        try:
            with Image.open(source) as image:
                rgb = image.convert("RGB")  # decodes every pixel: a truncated file fails here, not in a transform
        finally:
            if hasattr(source, "close"):
                source.close()
        return rgb, -1 if target is None else int(target)

    def read_sample(self, index: int) -> tuple[Any, int, tuple[Skip, ...]]:
        skips: list[Skip] = []
        for _ in range(min(len(self), self.max_bad_images + 1)):
            try:
                image, target = self.load(index)
            except UNREADABLE_ERRORS as error:
                skips.append((self.image_name(index), describe_error(error)))
                index = (index + 1) % len(self)
                continue
            if self.transform is not None:
                image = self.transform(image)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return image, target, tuple(skips)
        return None, -1, tuple(skips)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        """``(image, target)``; an unreadable image's replacement, with a warning that names it."""
        image, target, skips = self.read_sample(index)
        for name, error in skips:
            print(f"warning: unreadable image skipped: {name} ({error})", file=sys.stderr, flush=True)
        if image is None:
            raise ConfigError(f"{len(skips)} images in a row could not be read in {self.source}, from {skips[0][0]}")
        return image, target


def folder_images(split_dir: Path, class_map: dict[str, int], max_bad: int) -> ImageFiles:
    """:class:`ImageFiles` over an ImageFolder split (timm's folder reader), classes as ``class_map`` orders them."""
    reader = create_reader("", root=str(split_dir), class_map=class_map)
    return ImageFiles(reader, list(class_map), str(split_dir), max_bad)


def hf_split_names(name: str) -> list[str]:
    """The splits of a Hugging Face dataset (hub name or local folder). Raises ConfigError."""
    _need("datasets", "hfds")
    import datasets

    try:
        if Path(name).is_dir() and (Path(name) / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict
            return list(json.loads((Path(name) / "dataset_dict.json").read_text())["splits"])
        return list(datasets.get_dataset_split_names(name))
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as error:
        raise ConfigError(f"cannot read the Hugging Face dataset {name!r}: {describe_error(error)}") from None


def hf_images(name: str, split: str, classes: list[str] | None, max_bad: int) -> ImageFiles:
    """:class:`ImageFiles` over split ``split`` of the Hugging Face dataset ``name`` (timm's ``hfds`` reader:
    ``image`` and ``label`` columns, class names from the label's ClassLabel feature). Raises ConfigError."""
    _need("datasets", "hfds")
    try:
        reader = create_reader(f"hfds/{name}", root=None, split=split)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(
            f"cannot read split {split!r} of the Hugging Face dataset {name!r}: {describe_error(error)}"
        ) from None
    found = [label for label, _ in sorted(reader.class_to_idx.items(), key=lambda item: item[1])]
    if not found:
        raise ConfigError(f"hfds/{name} split {split!r}: its label column has no class names (a ClassLabel feature)")
    if classes is not None and found != classes:
        raise ConfigError(f"hfds/{name} split {split!r} has other classes than the training split: {found[:5]}...")
    if len(reader) == 0:
        raise ConfigError(f"hfds/{name} split {split!r} holds no images")
    return ImageFiles(reader, found, f"hfds/{name}[{split}]", max_bad)


def resolve_hf_split(name: str, split: str, *, validation: bool = False) -> str:
    """``split`` if the dataset has it; ``auto`` (validation only) is the first of validation, val, test."""
    names = hf_split_names(name)
    candidates = WDS_SPLIT_NAMES if (validation and split == "auto") else (split,)
    for candidate in candidates:
        if candidate in names:
            return candidate
    raise ConfigError(f"hfds/{name} has no split {' or '.join(candidates)} (its splits: {', '.join(names)})")


# ---------------------------------------------------------------------------------------------------------------
# streams: timm's wds reader


def _wds_info(root: str) -> dict[str, Any]:
    for name in ("_info.json", "info.json"):
        path = Path(root) / name
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError) as error:
                raise ConfigError(f"cannot read the WebDataset description {str(path)!r}: {error}") from None
    return {}


def resolve_wds_split(root: str, split: str, *, validation: bool = False) -> str:
    """A split timm's wds reader takes: a name in ``root/_info.json`` (``auto``: validation, val or test), or shards
    in brace notation (``train-{0000..0009}.tar|N``). Raises ConfigError."""
    if not Path(root).is_dir():
        raise ConfigError(f"WebDataset folder {root!r} does not exist")
    if ".tar" in split or ".." in split:
        return split
    names = list(_wds_info(root).get("splits", {}))
    candidates = WDS_SPLIT_NAMES if (validation and split == "auto") else (split,)
    for candidate in candidates:
        if candidate in names:
            return candidate
    described = f"its splits: {', '.join(names)}" if names else "it has no _info.json listing splits"
    raise ConfigError(
        f"WebDataset folder {root!r} has no split {' or '.join(candidates)} ({described}); name the shards instead, "
        "e.g. train_split='train-{0000..0009}.tar|N' for N samples"
    )


def wds_stream(
    root: str, split: str, *, training: bool, batch_size: int, seed: int, num_samples: int | None
) -> IterableDataset:
    """timm's WebDataset stream (``create_dataset('wds/', ...)``) of ``split`` in ``root``. In training (shards
    shuffled by ``seed`` and the epoch, samples through a shuffle buffer) each loader worker gives a whole number of
    batches. Raises ConfigError."""
    _need("webdataset", "wds")
    from timm.data import create_dataset

    try:
        dataset = create_dataset(
            "wds/",
            root=root,
            split=split,
            is_training=training,
            batch_size=batch_size,
            seed=seed,
            num_samples=num_samples,
        )
    except (RuntimeError, OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot read WebDataset split {split!r} in {root!r}: {describe_error(error)}") from None
    shards = len(dataset.reader.split_info.filenames)
    if shards == 0:
        raise ConfigError(f"WebDataset split {split!r} in {root!r} names no shard")
    if training and not dataset.reader.num_samples:
        raise ConfigError(
            f"WebDataset split {split!r} in {root!r} does not say how many samples it holds: list it in "
            "_info.json or name it as 'shards-{0000..0009}.tar|N'"
        )
    if not training and num_samples is not None:
        dataset.first_samples = num_samples  # the reader reads every sample in evaluation: cut in SampleStream
    return dataset


class _ErrorLog(logging.Handler):
    """Keeps the errors timm's wds reader logs for the samples it drops (undecodable images)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage())

    def take(self, source: str) -> tuple[Skip, ...]:
        taken = tuple((f"{UNNAMED}{source}", error) for error in self.errors)
        self.errors.clear()
        return taken


class SeededStream(IterableDataset):
    """A timm stream (``wds/``) as :func:`mjp_fast.train.data.train_loader` reads it: each sample's transform runs
    after seeding by ``(seed, rank, epoch, position)`` as :class:`mjp_fast.train.data.SeededDataset` does, and an
    epoch can start at a batch (a resumed run).

    The loader's worker ``w`` of ``W`` makes the epoch's batches ``w, w + W, w + 2W...`` (timm splits the shards
    between the workers and the loader takes their batches in turn), and the reader's sample shuffle is seeded
    from the loader's generator, which :meth:`set_epoch` seeds by ``(seed, rank, epoch)``: an epoch's stream is a
    function of those and ``W``. To start at batch ``b``, each worker passes over its batches before ``b``; the
    workers before ``b``'s first hand in one placeholder batch (samples with image None and no skip), which
    the main process drops, so that the loader's turns begin with ``b``'s worker.

    Each sample is ``(image, target, skips)``: the errors of the samples timm dropped since the last one.

    Args:
        dataset: timm's ``IterableImageDataset`` (its ``transform`` applies here).
        seed, rank: the run's seed and this process's rank.
        batch_size: the loader's.
    """

    def __init__(self, dataset: IterableDataset, seed: int, rank: int, batch_size: int) -> None:
        self.dataset, self.seed, self.rank, self.batch_size = dataset, seed, rank, batch_size
        self.epoch, self.start = 0, 0
        self.generator = torch.Generator()  # the loader's: its draws seed the workers (and their shuffle buffers)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to stream, from sample ``start`` (a multiple of the batch size) on; call before iterating."""
        if start % self.batch_size:
            raise ValueError(f"start must be a multiple of batch_size {self.batch_size}, got {start}")
        self.epoch, self.start = epoch, start
        self.dataset.set_epoch(epoch)
        self.generator.manual_seed(_mix(self.seed, self.rank, epoch))

    def __len__(self) -> int:
        return max(len(self.dataset) - self.start, 0)

    def __iter__(self) -> Iterator[tuple[Any, int, tuple[Skip, ...]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = self.dataset.reader
        # timm builds the reader's pipeline on first use (its shuffle buffer seeded from this worker's seed) and
        # keeps it: a new one each epoch makes the epoch's stream independent of the epochs this process ran.
        reader.ds = None
        batch, first = self.batch_size, self.start // self.batch_size
        if worker < first % workers:
            yield from [(None, -1, ())] * batch  # a placeholder batch: the loader's turn passes to the next worker
        errors = _ErrorLog()
        logger = logging.getLogger(type(reader).__module__)
        logger.addHandler(errors)
        try:
            for count, (image, target) in enumerate(reader):
                number = (count // batch) * workers + worker  # the epoch's batch this sample goes into
                if number < first:
                    continue
                position = number * batch + count % batch
                sample_seed = _mix(self.seed, self.rank, self.epoch, position)
                random.seed(sample_seed)
                np.random.seed(sample_seed)
                torch.default_generator.manual_seed(sample_seed)
                if self.dataset.transform is not None:
                    image = self.dataset.transform(image)
                yield image, int(target), errors.take(str(getattr(reader, "root", "the stream")))
        finally:
            logger.removeHandler(errors)


class SampleStream(IterableDataset):
    """A timm stream for evaluation: ``(image, target, skips)`` in the reader's order, cut to the dataset's
    ``first_samples`` (set by :func:`wds_stream` for ``max_val_samples``) over all of this loader's workers."""

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return stream_length(self.dataset)

    def __iter__(self) -> Iterator[tuple[Any, int, tuple[Skip, ...]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        limit = getattr(self.dataset, "first_samples", None)
        share = None if limit is None else (limit // workers + (1 if worker < limit % workers else 0))
        reader = self.dataset.reader
        errors = _ErrorLog()
        logger = logging.getLogger(type(reader).__module__)
        logger.addHandler(errors)
        try:
            for count, (image, target) in enumerate(reader):
                if share is not None and count >= share:
                    break
                if self.dataset.transform is not None:
                    image = self.dataset.transform(image)
                yield image, int(target), errors.take(str(getattr(reader, "root", "the stream")))
        finally:
            logger.removeHandler(errors)


def _mix(*numbers: int) -> int:
    return int(np.random.SeedSequence([int(number) for number in numbers]).generate_state(1)[0])


def stream_length(dataset: Any) -> int:
    """The samples a stream gives (``first_samples`` when cut)."""
    limit = getattr(dataset, "first_samples", None)
    return len(dataset) if limit is None else min(limit, len(dataset))


# ---------------------------------------------------------------------------------------------------------------
# map-style samples with their skips, and decoding ahead (cache_images)


def read_sample(dataset: Dataset, index: int) -> tuple[Any, int, tuple[Skip, ...]]:
    """``(image, target, skips)`` of ``dataset[index]``, through a ``Subset`` to an :class:`ImageFiles`; other
    datasets never skip."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    if isinstance(dataset, ImageFiles):
        return dataset.read_sample(index)
    image, target = dataset[index][:2]
    return image, target, ()


class SkipReportingDataset(Dataset):
    """``dataset``'s samples as ``(image, target, skips)`` (:func:`read_sample`): the evaluation loader's."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int, tuple[Skip, ...]]:
        return read_sample(self.dataset, index)


def decode_all(dataset: ImageFiles, indices: Sequence[int], workers: int) -> tuple[list[np.ndarray], list[int]]:
    """Decodes ``dataset``'s images at ``indices`` (threads: Pillow's decoders release the GIL); an unreadable
    image is replaced as :meth:`ImageFiles.read_sample` replaces it, so a run draws the same pixels as without
    decoding ahead. Names the unreadable files; raises ConfigError past ``dataset.max_bad_images`` of them.

    Returns: uint8 ``[H, W, 3]`` arrays and targets, one per index.
    """
    from concurrent.futures import ThreadPoolExecutor

    def decode(index: int) -> tuple[np.ndarray, int] | Skip:
        try:
            image, target = dataset.load(index)
        except UNREADABLE_ERRORS as error:
            return dataset.image_name(index), describe_error(error)
        return np.asarray(image), target

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        decoded = dict(zip(indices, pool.map(decode, indices, chunksize=256)))
    unreadable = UnreadableImages(dataset.max_bad_images, what="decoding")
    unreadable.add([result for result in decoded.values() if isinstance(result[0], str)])
    pixels, targets = [], []
    for index in indices:
        current = index
        for _ in range(len(dataset)):
            if current not in decoded:  # a replacement outside ``indices`` (a subset)
                decoded[current] = decode(current)
                if isinstance(decoded[current][0], str):
                    unreadable.add([decoded[current]])
            if not isinstance(decoded[current][0], str):
                break
            current = (current + 1) % len(dataset)
        else:
            raise ConfigError(unreadable.refusal(f"every image of {dataset.source}"))
        pixels.append(decoded[current][0])
        targets.append(decoded[current][1])
    unreadable.end_pass()
    return pixels, targets
