"""ImageNet-A, ImageNet-R and ImageNet-O, read from their authors' releases, as ``mjp eval`` measures them.

- **ImageNet-A** (Hendrycks, Zhao, Basart, Steinhardt, Song, "Natural Adversarial Examples", CVPR 2021; GitHub
  hendrycks/natural-adv-examples): 7,500 natural images of 200 ImageNet-1k classes that fool ResNet-50s.
  Accuracy, AURRA and the RMS calibration error from the max-softmax confidence.
- **ImageNet-R** (Hendrycks et al., "The Many Faces of Robustness", ICCV 2021; GitHub hendrycks/imagenet-r):
  30,000 renditions (art, cartoons, sculptures, ...) of 200 ImageNet-1k classes. Accuracy; and, as the authors'
  ``eval.py`` reports beside it, the accuracy on the ImageNet validation images of the same 200 classes (their
  "ImageNet-200") and the drop from it to ImageNet-R.
- **ImageNet-O** (the ImageNet-A paper): 2,000 images of classes outside ImageNet-1k that ResNet-50s take
  confidently for one of 200 ImageNet-1k classes. AUPR, AUROC and FPR95 of detecting them among the
  in-distribution validation images, anomaly score the negative max-softmax probability.

Each release unpacks to ``DIR/<wnid>/<image>.jpg`` (and a README.txt), one folder per class named by its WordNet id:
the folder of an ImageNet-O image names the class the ResNet-50 mistook it for. As the authors' code
(``eval.py``, ``eval_many_models.py`` of hendrycks/natural-adv-examples; ``eval.py`` of hendrycks/imagenet-r) does,
the model's logits are restricted to the classes of the folders before the softmax and the argmax: a 1000-class
model is scored as a 200-class one. The model's classes are named by its data's class folders when those are
WordNet ids, and for a 1000-class model otherwise by the ImageNet-1k order (timm's ``ImageNetInfo``: the wnids
sorted, as an ImageNet folder lists them).

A tree that is not the whole release (other classes than the published 200, or fewer images: a partial download,
``--max-images``) is measured over what it holds, and its results say so (:func:`release_coverage`): restricted to
10 classes, the accuracy is a 10-way one, not comparable with a published number.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from mjp_fast.evaluate.ood_metrics import aupr, auroc, aurra, fpr_at_recall, rms_calibration_error
from mjp_fast.evaluate.releases import IMAGENET_VAL_IMAGES_PER_CLASS, NATURAL_RELEASES, class_coverage

WNID = re.compile(r"n\d{8}")


@dataclass(frozen=True)
class NaturalSetInfo:
    """What ``mjp eval`` says about one of the sets."""

    key: str  # the results' key and evaluate_checkpoint's argument
    option: str  # the command-line option
    name: str
    source: str  # where it comes from


NATURAL_SETS = {
    info.key: info
    for info in (
        NaturalSetInfo(
            "imagenet_a",
            "--imagenet-a",
            "ImageNet-A",
            'Hendrycks et al., "Natural Adversarial Examples" (CVPR 2021), github.com/hendrycks/natural-adv-examples',
        ),
        NaturalSetInfo(
            "imagenet_r",
            "--imagenet-r",
            "ImageNet-R",
            'Hendrycks et al., "The Many Faces of Robustness" (ICCV 2021), github.com/hendrycks/imagenet-r',
        ),
        NaturalSetInfo(
            "imagenet_o",
            "--imagenet-o",
            "ImageNet-O",
            'Hendrycks et al., "Natural Adversarial Examples" (CVPR 2021), github.com/hendrycks/natural-adv-examples',
        ),
    )
}


def imagenet_1k_wnids() -> list[str]:
    """The 1000 WordNet ids of ImageNet-1k in the standard class order (sorted), from timm."""
    from timm.data import ImageNetInfo

    return list(ImageNetInfo("imagenet-1k").label_names())


def _listing(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def model_class_wnids(classes: Sequence[str] | None, num_classes: int, option: str, name: str) -> list[str]:
    """The WordNet id of each of the model's ``num_classes`` outputs.

    ``classes``: the class names of the data the model is evaluated on (its class folders, in the model's order):
    used when they are WordNet ids; otherwise a 1000-class model is taken to be an ImageNet-1k one, in the
    standard order. Raises ValueError naming ``option`` for any other model (a CIFAR model, digits, ...).
    """
    if classes is not None and len(classes) == num_classes and all(WNID.fullmatch(str(c)) for c in classes):
        return [str(c) for c in classes]
    if num_classes == 1000:
        return imagenet_1k_wnids()
    named = f" ({_listing([str(c) for c in classes])})" if classes else ""
    raise ValueError(
        f"{option}: the model's {num_classes} classes{named} are not ImageNet-1k classes: {name}'s classes are "
        "ImageNet-1k classes named by WordNet id, so it needs a 1000-class ImageNet model or one trained on "
        "class folders named by WordNet id"
    )


@dataclass
class SubsetFolder:
    """A release's tree, checked: ``root/<wnid>/<image>``."""

    root: Path
    wnids: list[str]  # the class folders, sorted: the class index of each image is its folder's index here
    images: int


def read_subset_folder(root: str | Path, option: str, name: str) -> SubsetFolder:
    """Checks that ``root`` holds a release in its published layout, ``root/<wnid>/<image>``, every folder named
    by an ImageNet-1k WordNet id and holding images (files beside the folders, such as README.txt, are ignored).
    Raises ValueError naming ``option``, one line, for anything else."""
    from timm.data.readers.img_extensions import get_img_extensions

    root = Path(root)
    expected = f"expected the {name} release unpacked: {root}/<WordNet id>/<image>"
    if not root.exists():
        raise ValueError(f"{option}: folder {str(root)!r} does not exist")
    if not root.is_dir():
        hint = " (unpack it first: tar -xf)" if root.name.endswith((".tar", ".tar.gz", ".tgz")) else ""
        raise ValueError(f"{option}: {str(root)!r} is a file, not a folder{hint}; {expected}")
    folders = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    if not folders:
        raise ValueError(f"{option}: folder {str(root)!r} has no class folders; {expected}")
    others = [folder for folder in folders if not WNID.fullmatch(folder)]
    if others:
        inner = root / others[0]
        nested = len(folders) == 1 and any(WNID.fullmatch(entry.name) for entry in os.scandir(inner) if entry.is_dir())
        hint = f"; did you mean {str(inner)!r}?" if nested else ""
        raise ValueError(
            f"{option}: folder {str(root)!r} holds folders not named by a WordNet id ({_listing(others)}); "
            f"{expected}{hint}"
        )
    known = set(imagenet_1k_wnids())
    unknown = [folder for folder in folders if folder not in known]
    if unknown:
        raise ValueError(
            f"{option}: folder {str(root)!r} holds folders whose names are not ImageNet-1k WordNet ids: "
            f"{_listing(unknown)}"
        )
    extensions = get_img_extensions(as_set=True)
    images = 0
    for folder in folders:
        # files only (links to files too): a folder named like an image is not one, and timm's reader skips it
        count = sum(
            1
            for entry in os.scandir(root / folder)
            if os.path.splitext(entry.name)[1].lower() in extensions and entry.is_file()
        )
        if count == 0:
            raise ValueError(
                f"{option}: folder {str(root / folder)!r} holds no images ({', '.join(sorted(extensions))} files)"
            )
        images += count
    return SubsetFolder(root, folders, images)


def subset_columns(folder_wnids: Sequence[str], class_wnids: Sequence[str], option: str, name: str) -> torch.Tensor:
    """int64 ``[K]``: the model output of each of the set's ``K`` classes (``folder_wnids``, in order), found by
    WordNet id among the model's ``class_wnids``. Raises ValueError naming ``option`` when the model lacks any."""
    index = {wnid: position for position, wnid in enumerate(class_wnids)}
    missing = [wnid for wnid in folder_wnids if wnid not in index]
    if missing:
        raise ValueError(
            f"{option}: the model has no output for {len(missing)} of the {len(folder_wnids)} {name} classes "
            f"({_listing(missing)}): its {len(class_wnids)} classes do not include them"
        )
    return torch.tensor([index[wnid] for wnid in folder_wnids], dtype=torch.long)


@torch.no_grad()
def subset_logits(
    model: nn.Module,
    loader: Any,
    columns: torch.Tensor,
    *,
    device: torch.device | str,
    mean: torch.Tensor,
    std: torch.Tensor,
    amp_dtype: torch.dtype | None = None,
    target_map: torch.Tensor | None = None,
    progress: Callable[[int], Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits restricted to ``columns``, with the targets, over one pass of ``loader``.

    Args:
        loader: batches ``(images, targets)``; images uint8 ``[B, 3, H, W]`` (or float in [0, 1]).
        columns: int64 ``[K]``, the model outputs kept, in the set's class order.
        mean, std: normalization, ``[3]``.
        target_map: int64 ``[C]``, optional: maps each target (a model class) to the set's class index, -1 to
            leave the image out (the in-distribution images of ImageNet-O's classes).
        progress: called with the number of images after each batch.

    Returns:
        float32 logits ``[N, K]`` and int64 targets ``[N]``, on the CPU.
    """
    device = torch.device(device)
    mean, std = mean.to(device).view(1, -1, 1, 1), std.to(device).view(1, -1, 1, 1)
    columns = columns.to(device)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    all_logits, all_targets = [], []
    was_training = model.training
    model.eval()
    try:
        for images, targets in loader:
            batch = len(targets)
            if target_map is not None:
                targets = target_map[targets]
                kept = targets >= 0
                images, targets = images[kept], targets[kept]
            if len(targets):
                images = images.to(device, non_blocking=True)
                images = images.float().div_(255.0) if images.dtype == torch.uint8 else images.float()
                with autocast:
                    logits = model((images - mean) / std)
                all_logits.append(logits.float().index_select(1, columns).cpu())
                all_targets.append(targets.cpu().long())
            if progress is not None:
                progress(batch)
    finally:
        model.train(was_training)
    if not all_logits:
        return torch.empty(0, len(columns)), torch.empty(0, dtype=torch.long)
    return torch.cat(all_logits), torch.cat(all_targets)


def confidence_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-softmax probability ``[N]`` (float64) and whether the argmax is the target ``[N]`` (bool), of
    restricted logits ``[N, K]`` and targets ``[N]`` (set class indices)."""
    probabilities = logits.double().softmax(dim=1)
    confidence, predictions = probabilities.max(dim=1)
    return confidence, predictions.eq(targets)


def imagenet_a_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float | int | None]:
    """``top1``, ``aurra``, ``calibration_rms`` (%), ``images``, ``classes`` of restricted logits ``[N, K]``.

    ``calibration_rms`` is the authors' RMS calibration error (:func:`~mjp_fast.evaluate.ood_metrics.
    rms_calibration_error`: bins of 100 images, the last one left out of the sum), None with fewer than 200 images,
    where that definition has no bin to sum."""
    confidence, correct = confidence_and_correct(logits, targets)
    calibration = rms_calibration_error(confidence, correct)
    return {
        "top1": 100.0 * float(correct.double().mean()),
        "aurra": 100.0 * aurra(confidence, correct),
        "calibration_rms": None if math.isnan(calibration) else 100.0 * calibration,
        "images": len(targets),
        "classes": logits.shape[1],
    }


def imagenet_r_metrics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logits_200: torch.Tensor | None = None,
    targets_200: torch.Tensor | None = None,
) -> dict[str, float | int | None]:
    """``top1`` (%), ``images``, ``classes`` of restricted logits ``[N, K]``; with the in-distribution validation
    images of the same classes (``logits_200`` ``[M, K]``, ``targets_200`` ``[M]``: the authors' "ImageNet-200"
    of hendrycks/imagenet-r's eval.py), their ``imagenet_200_top1`` (%) and ``imagenet_200_images``, and
    ``top1_drop``, ImageNet-200's top-1 minus ImageNet-R's (their "Delta Acc"); these three None without them."""
    _, correct = confidence_and_correct(logits, targets)
    top1 = 100.0 * float(correct.double().mean())
    results: dict[str, float | int | None] = {"top1": top1, "images": len(targets), "classes": logits.shape[1]}
    top1_200 = None
    if logits_200 is not None and targets_200 is not None and len(targets_200):
        top1_200 = 100.0 * float(confidence_and_correct(logits_200, targets_200)[1].double().mean())
    results["imagenet_200_top1"] = top1_200
    results["imagenet_200_images"] = len(targets_200) if top1_200 is not None else 0
    results["top1_drop"] = top1_200 - top1 if top1_200 is not None else None
    return results


def imagenet_o_metrics(logits_out: torch.Tensor, logits_in: torch.Tensor) -> dict[str, float | int]:
    """``aupr``, ``auroc``, ``fpr95`` (%), ``images_out``, ``images_in``: ImageNet-O's images ``[P, K]`` as the
    positives, the in-distribution images ``[M, K]`` as the negatives, anomaly score the negative max-softmax
    probability of the logits restricted to ImageNet-O's classes (``get_imagenet_o_results`` of the authors'
    eval_many_models.py, which prints the same three: :func:`~mjp_fast.evaluate.ood_metrics.aupr`,
    :func:`~mjp_fast.evaluate.ood_metrics.auroc`, :func:`~mjp_fast.evaluate.ood_metrics.fpr_at_recall` at 95%)."""
    anomaly_out = -logits_out.double().softmax(dim=1).max(dim=1).values
    anomaly_in = -logits_in.double().softmax(dim=1).max(dim=1).values
    return {
        "aupr": 100.0 * aupr(anomaly_out, anomaly_in),
        "auroc": 100.0 * auroc(anomaly_out, anomaly_in),
        "fpr95": 100.0 * fpr_at_recall(anomaly_out, anomaly_in, 0.95),
        "images_out": len(logits_out),
        "images_in": len(logits_in),
    }


def release_coverage(key: str, wnids: Sequence[str], images: int, images_in: int | None = None) -> dict[str, Any]:
    """How the measured set compares with the authors' release (:mod:`mjp_fast.evaluate.releases`): ``partial``
    (True unless the tree has exactly the release's classes and the pass as many images as the release, and for
    ImageNet-O as many in-distribution images as the authors' 50 per class), ``release_classes``,
    ``missing_classes`` (a count), ``extra_classes`` (the WordNet ids outside the release), ``release_images`` and
    ``missing_images`` (the release's images not measured: a partial tree, or ``--max-images``)."""
    published, release_images = NATURAL_RELEASES[key]
    coverage = class_coverage(wnids, published)
    partial = coverage.partial or images != release_images
    found: dict[str, Any] = {}
    if images_in is not None:  # ImageNet-O: the negatives weigh in its AUPR as much as the positives
        release_in = len(published) * IMAGENET_VAL_IMAGES_PER_CLASS
        partial = partial or images_in != release_in
        found["release_images_in"] = release_in
    return {
        "partial": partial,
        "release_classes": len(published),
        "missing_classes": len(coverage.missing),
        "extra_classes": list(coverage.extra),
        "release_images": release_images,
        "missing_images": max(release_images - images, 0),
        **found,
    }


def _targets(dataset: Dataset) -> list[int] | None:
    """Each sample's target without reading the images, where the dataset keeps them (None: it does not)."""
    if isinstance(dataset, Subset):
        inner = _targets(dataset.dataset)
        return None if inner is None else [inner[index] for index in dataset.indices]
    if hasattr(dataset, "targets"):
        return [int(target) for target in dataset.targets]
    samples = getattr(getattr(dataset, "reader", None), "samples", None)  # timm's folder reader
    if isinstance(samples, list):
        return [int(target) for _, target in samples]
    return None


def _subset(dataset: Dataset, indices: list[int]) -> Subset:
    """``Subset(dataset, indices)``, one level deep (a subset of a subset indexes the dataset under it)."""
    if isinstance(dataset, Subset):
        return Subset(dataset.dataset, [dataset.indices[index] for index in indices])
    return Subset(dataset, indices)


@dataclass
class NaturalSet:
    """One set opened for evaluation."""

    info: NaturalSetInfo
    folder: SubsetFolder
    columns: torch.Tensor  # int64 [K]: the model outputs of its classes
    loader: Any  # its images, through the validation transform
    # ImageNet-O (its negatives) and ImageNet-R (its ImageNet-200): the validation images of the set's classes
    in_loader: Any = None
    target_map: torch.Tensor | None = None  # model class -> set class, -1: not one of them (left out)

    @property
    def passes(self) -> int:
        return 2 if self.in_loader is not None else 1


def _in_distribution(
    val_loader: Any, columns: torch.Tensor, num_classes: int, make_loader: Callable[[Dataset], Any]
) -> tuple[Any, torch.Tensor | None]:
    """(loader, target map) of the validation images of the classes ``columns``: a subset of the validation
    split, or the whole split filtered in the pass when it is a stream; (None, None) when the split has none of
    them. The target map (int64 ``[num_classes]``) maps each model class to its index among ``columns``, -1
    elsewhere: the pass turns the split's targets into the set's."""
    target_map = torch.full((num_classes,), -1, dtype=torch.long)
    target_map[columns] = torch.arange(len(columns))
    val_set = val_loader.dataset
    targets = _targets(val_set)
    if targets is None:  # a stream: its images are filtered in the pass
        return val_loader, target_map
    chosen = [index for index, target in enumerate(targets) if target_map[target] >= 0]
    return (make_loader(_subset(val_set, chosen)), target_map) if chosen else (None, None)


def open_natural_sets(
    paths: Mapping[str, str | Path | None],
    *,
    classes: Sequence[str] | None,
    num_classes: int,
    val_loader: Any,
    make_loader: Callable[[Dataset], Any],
    max_images: int | None = None,
    max_bad_images: int | None = None,
) -> list[NaturalSet]:
    """Checks each set's tree and the model's classes, and opens their loaders: before any pass over the data, so
    that a bad path or a model without the classes fails at once. Raises ValueError naming the option.

    Args:
        paths: ``imagenet_a``, ``imagenet_r``, ``imagenet_o`` -> the release's folder (None: not measured).
        classes: the class names of the evaluation data, in the model's order (None: unknown).
        num_classes: the model's outputs.
        val_loader: the validation images (``val_loader.dataset`` the dataset, its transform set): ImageNet-O's
            negatives and ImageNet-R's ImageNet-200 are those of the set's classes; the sets' images get the same
            transform.
        make_loader: ``make_loader(dataset) -> loader`` of batches ``(uint8 images, targets)``.
        max_images: a fixed subset of this many images of each set (``--max-images``).
        max_bad_images: unreadable images tolerated per pass (default: the training package's).
    """
    from mjp_fast.train.data import fixed_subset, set_transform
    from mjp_fast.train.readers import DEFAULT_MAX_BAD_IMAGES, folder_images

    opened: list[NaturalSet] = []
    val_set = val_loader.dataset
    base = val_set.dataset if isinstance(val_set, Subset) else val_set
    transform = getattr(base, "transform", None)
    for key, path in paths.items():
        if path is None:
            continue
        if key not in NATURAL_SETS:
            raise ValueError(f"unknown set {key!r}: expected one of {', '.join(NATURAL_SETS)}")
        info = NATURAL_SETS[key]
        folder = read_subset_folder(path, info.option, info.name)
        class_wnids = model_class_wnids(classes, num_classes, info.option, info.name)
        columns = subset_columns(folder.wnids, class_wnids, info.option, info.name)
        class_map = {wnid: index for index, wnid in enumerate(folder.wnids)}
        try:
            dataset = folder_images(
                folder.root, class_map, DEFAULT_MAX_BAD_IMAGES if max_bad_images is None else max_bad_images
            )
        except RuntimeError:  # timm's folder reader: no file with an image extension (as ImageNet-C's loader)
            raise ValueError(f"{info.option}: {str(folder.root)!r} holds no images") from None
        set_transform(dataset, transform)
        natural = NaturalSet(info, folder, columns, make_loader(fixed_subset(dataset, max_images)))
        if key in ("imagenet_o", "imagenet_r"):
            # The authors' in-distribution images (eval_many_models.py's ImageNet-O negatives, imagenet-r's eval.py
            # ImageNet-200): the ImageNet validation images of the set's 200 classes, scored, like the set's own,
            # over those 200 classes' logits only; not all 1000 classes.
            natural.in_loader, natural.target_map = _in_distribution(val_loader, columns, num_classes, make_loader)
            if key == "imagenet_o" and natural.in_loader is None:
                raise ValueError(
                    f"{info.option}: the validation split has no images of ImageNet-O's {len(columns)} classes "
                    f"({_listing(folder.wnids)}): its in-distribution images (the negatives) are those"
                )
        opened.append(natural)
    return opened


def evaluate_natural_sets(
    sets: Sequence[NaturalSet],
    model: nn.Module,
    *,
    device: torch.device | str,
    mean: torch.Tensor,
    std: torch.Tensor,
    amp_dtype: torch.dtype | None = None,
    progress_bar: Callable[[int, str], Any] | None = None,
    pass_done: Callable[[str, dict[str, Any], float], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each set's results (:func:`imagenet_a_metrics`, :func:`imagenet_r_metrics`, :func:`imagenet_o_metrics`)
    with how its tree compares with the authors' release (:func:`release_coverage`), by key.

    Args:
        amp_dtype: autocast's dtype; None: float32, as the authors evaluate.
        progress_bar: ``progress_bar(total_images, description)`` -> a tqdm-like bar (or None) for each pass.
        pass_done: called after each pass with its description, ``{"top1": % or None, "images": N}`` and seconds.
    """

    def run(
        loader: Any,
        columns: torch.Tensor,
        description: str,
        target_map: torch.Tensor | None = None,
        scored_by_accuracy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bar = progress_bar(len(loader.dataset), description) if progress_bar is not None else None
        start = time.perf_counter()
        try:
            logits, targets = subset_logits(
                model,
                loader,
                columns,
                device=device,
                mean=mean,
                std=std,
                amp_dtype=amp_dtype,
                target_map=target_map,
                progress=bar.update if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
        if pass_done is not None:  # ImageNet-O's passes have no accuracy (scored by AUPR)
            top1 = None
            if scored_by_accuracy and len(targets):
                top1 = 100.0 * float(confidence_and_correct(logits, targets)[1].double().mean())
            pass_done(description, {"top1": top1, "images": len(targets)}, time.perf_counter() - start)
        return logits, targets

    results: dict[str, dict[str, Any]] = {}
    for natural in sets:
        key, name = natural.info.key, natural.info.name
        logits, targets = run(natural.loader, natural.columns, name, scored_by_accuracy=key != "imagenet_o")
        if key == "imagenet_o":
            description = f"{name} in-distribution"
            logits_in, _ = run(natural.in_loader, natural.columns, description, natural.target_map, False)
            if len(logits_in) == 0:
                raise ValueError(
                    f"{natural.info.option}: the validation split has no images of ImageNet-O's "
                    f"{len(natural.columns)} classes: its in-distribution images (the negatives) are those"
                )
            results[key] = imagenet_o_metrics(logits, logits_in)
            results[key].update(release_coverage(key, natural.folder.wnids, len(logits), len(logits_in)))
        elif key == "imagenet_r":
            logits_200 = targets_200 = None
            if natural.in_loader is not None:
                description = f"{name} {IMAGENET_200}"
                logits_200, targets_200 = run(natural.in_loader, natural.columns, description, natural.target_map)
            results[key] = imagenet_r_metrics(logits, targets, logits_200, targets_200)
            results[key].update(release_coverage(key, natural.folder.wnids, len(targets)))
            # the ImageNet-200 is whole with the release's 200 classes and their 50 validation images each
            classes_200 = len(set(targets_200.tolist())) if targets_200 is not None else 0
            results[key]["imagenet_200_classes"] = classes_200
            results[key]["imagenet_200_partial"] = results[key]["partial"] or (
                results[key]["imagenet_200_images"] != results[key]["release_classes"] * IMAGENET_VAL_IMAGES_PER_CLASS
            )
        else:
            results[key] = imagenet_a_metrics(logits, targets)
            results[key].update(release_coverage(key, natural.folder.wnids, len(targets)))
    return results


IMAGENET_200 = "ImageNet-200"  # ImageNet-R's in-distribution pass: the validation images of its 200 classes


__all__ = [
    "NATURAL_SETS",
    "NaturalSet",
    "SubsetFolder",
    "evaluate_natural_sets",
    "imagenet_1k_wnids",
    "imagenet_a_metrics",
    "imagenet_o_metrics",
    "imagenet_r_metrics",
    "model_class_wnids",
    "open_natural_sets",
    "read_subset_folder",
    "release_coverage",
    "subset_columns",
    "subset_logits",
]
