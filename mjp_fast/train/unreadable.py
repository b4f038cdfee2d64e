"""What happens to an image that cannot be read, once a reader (:mod:`mjp_fast.train.readers`) has passed it over.

A file that Pillow cannot decode (truncated, not an image) is never trained on silently. On a map-style source the
next readable sample takes its place (as in timm's ``ImageDataset``, so batches keep their size and a resumed run
draws the same images), and its name and error come back with the batch to the main process
(:func:`collate_samples`), where :class:`UnreadableImages` names each such file once, counts them at the end of each
epoch, and raises ConfigError once more than ``max_bad_images`` distinct files could not be read. A WebDataset
stream drops an undecodable sample inside timm's reader; its error is counted the same way, but the sample's name is
not known there. :class:`Batches` is the loader the loops read: the batches without their skips.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from mjp_fast.train.config import ConfigError

# What Pillow raises for a file it cannot decode: OSError (truncated data; UnidentifiedImageError for a file that is
# not an image), SyntaxError and ValueError (some broken PNG and TIFF headers), DecompressionBombError (a huge one).
UNREADABLE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)

Skip = tuple[str, str]  # (image name, error): an image that could not be read
UNNAMED = "a sample of "  # how a stream's dropped sample is named: timm's reader does not say which it was


def describe_error(error: BaseException) -> str:
    """The first line of ``error``'s message, without the ``<_io.BufferedReader name=...>`` Pillow adds (the
    message names the file already)."""
    text = re.sub(r" <_io\.[^>]*>", "", str(error)).strip() or type(error).__name__
    return text.splitlines()[0]


def collate_samples(samples: Sequence[tuple[Any, int, tuple[Skip, ...]]]) -> tuple[Any, Any, tuple[Skip, ...]] | None:
    """A loader's batch of ``(image, target, skips)`` samples -> ``(images, targets, skips)``, run in the worker.

    None for a placeholder batch (:class:`~mjp_fast.train.readers.SeededStream`); ``(None, None, skips)`` when a
    sample gave up (its reader met too many unreadable images in a row): the main process then raises.
    """
    if all(image is None and not skips for image, _, skips in samples):
        return None
    skips = tuple(skip for _, _, sample_skips in samples for skip in sample_skips)
    if any(image is None for image, _, _ in samples):
        return None, None, skips
    images, targets = default_collate([(image, target) for image, target, _ in samples])
    return images, targets, skips


class UnreadableImages:
    """The images a loader could not read, in the main process: names each distinct file once (stderr), counts
    the skips of each pass over the data, and raises ConfigError past ``limit``.

    The limit counts distinct files over the run; a stream's dropped samples have no name, so there it counts
    those of the current pass (a stream gives each sample once a pass).

    Args:
        limit: ``max_bad_images``.
        what: the pass's name in the count line (``epoch``, ``evaluation``).
    """

    def __init__(self, limit: int, what: str = "epoch") -> None:
        self.limit, self.what = limit, what
        self.errors: dict[str, str] = {}  # name -> error: the run's distinct unreadable files
        self.unnamed: list[Skip] = []  # this pass's dropped stream samples
        self.in_pass = 0

    def add(self, skips: Sequence[Skip]) -> None:
        """Records the skips of a batch; raises ConfigError past the limit."""
        for name, error in skips:
            self.in_pass += 1
            if name.startswith(UNNAMED):
                self.unnamed.append((name, error))
            elif name in self.errors:
                continue
            else:
                self.errors[name] = error
            print(f"warning: unreadable image skipped: {name} ({error})", file=sys.stderr, flush=True)
        if self.count > self.limit:
            raise ConfigError(self.refusal(f"more than max_bad_images={self.limit}"))

    @property
    def count(self) -> int:
        """The count the limit applies to: distinct files, plus this pass's unnamed samples."""
        return len(self.errors) + len(self.unnamed)

    def refusal(self, why: str) -> str:
        """The error's text: how many, ``why`` that is too many, the first few."""
        entries = [*self.errors.items(), *self.unnamed]
        shown = "; ".join(f"{name} ({error})" for name, error in entries[:3])
        more = f"; and {len(entries) - 3} more" if len(entries) > 3 else ""
        return (
            f"{self.count} images could not be read, {why}: {shown}{more}. Replace or remove them, or raise "
            "max_bad_images"
        )

    def end_pass(self) -> None:
        """Prints the pass's count, if it skipped any, and starts the next pass's."""
        if self.in_pass:
            plural = "s" if self.in_pass > 1 else ""
            print(
                f"warning: this {self.what} skipped {self.in_pass} unreadable image{plural} "
                f"({len(self.errors) + len(self.unnamed)} distinct; max_bad_images={self.limit})",
                file=sys.stderr,
                flush=True,
            )
        self.in_pass = 0
        self.unnamed = []


class Batches:
    """A DataLoader of :func:`collate_samples` batches as the loops read it: ``(images, targets)`` batches; the
    skips go to :class:`UnreadableImages`, placeholder batches are dropped, and the pass's count is printed at its
    end. ``len`` is the loader's; ``dataset`` the dataset it reads."""

    def __init__(self, loader: DataLoader, dataset: Dataset, unreadable: UnreadableImages) -> None:
        self.loader, self.dataset, self.unreadable = loader, dataset, unreadable

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The loader's iterator now, not at the first batch: making it draws its workers' base seed from torch's
        # generator, and the training loop seeds (or restores) the generators after it, as for a bare DataLoader.
        return self._batches(iter(self.loader))

    def _batches(self, batches: Iterator[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in batches:
            if batch is None:
                continue
            images, targets, skips = batch
            if skips:
                self.unreadable.add(skips)
            if images is None:  # a sample gave up within the limit: the dataset is smaller than the limit
                raise ConfigError(self.unreadable.refusal("and no other image to take their place"))
            yield images, targets
        self.unreadable.end_pass()
