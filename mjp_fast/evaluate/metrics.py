"""Classification metrics and the paper's consistency protocol.

- **top-1 / top-5**: percent of samples whose label is among the k largest logits (k is capped at the number of
  classes).
- **consistency**: percent of samples with ``argmax F(x) == argmax F(x~)``, where ``x~`` is ``x`` jigsawed at
  ratio 0.5 (the paper's section on consistency).
- **diff-norm**: mean over samples of ``|| f(x) - f(x~) ||_2``, where ``f`` is the model's final pre-logits
  feature (for DeiT: the class token after the last norm).

How ``x~`` is fed (``jigsaw=``):

- ``"unk"``: the MJP model's own protocol, ``model.mjp_eval(ratio, seed)``: the patch tokens of the masked
  positions are permuted among themselves and get the learned unknown position embedding.
- ``"pixel"``: the image itself is jigsawed (:func:`mjp_fast.jigsaw_images`) and fed to the unchanged model, with
  its usual position embeddings: the measure for a baseline, which has no unknown embedding.
- ``"auto"``: ``"unk"`` for MJP ViTs, ``"pixel"`` for everything else.

Both draw the same jigsaws for the same seed and batch order (sample ``i`` of the pass gets the jigsaw of global
index ``i``), so a baseline and an MJP model are measured on the same shuffles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mjp_fast._distributed import rank_and_world
from mjp_fast._model_geometry import patch_size_of
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.sampler import sample_jigsaw

JIGSAW_MODES = ("auto", "unk", "pixel", "none")


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: Iterable[int] = (1, 5)) -> dict[int, int]:
    """How many samples have their target among the k largest logits, for each k (capped at the class count).

    Args:
        logits: ``[B, C]``. targets: int64 ``[B]``.
    """
    ks = tuple(ks)
    largest = min(max(ks), logits.shape[-1])
    top = logits.topk(largest, dim=-1).indices  # [B, largest]
    hits = top.eq(targets.view(-1, 1))
    return {k: int(hits[:, : min(k, largest)].any(dim=1).sum()) for k in ks}


def accuracy(logits: torch.Tensor, targets: torch.Tensor, ks: Iterable[int] = (1, 5)) -> dict[int, float]:
    """Top-k accuracy in percent for each k."""
    counts = topk_correct(logits, targets, ks)
    return {k: 100.0 * count / max(len(targets), 1) for k, count in counts.items()}


def prediction_agreement(logits: torch.Tensor, logits_jigsawed: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: whether the two predictions (argmax) agree."""
    return logits.argmax(dim=-1).eq(logits_jigsawed.argmax(dim=-1))


def consistency(logits: torch.Tensor, logits_jigsawed: torch.Tensor) -> float:
    """Percent of samples whose prediction is the same on ``x`` and on ``x~``."""
    return 100.0 * prediction_agreement(logits, logits_jigsawed).float().mean().item()


def feature_distances(features: torch.Tensor, features_jigsawed: torch.Tensor) -> torch.Tensor:
    """``[B]``: the L2 norm of the difference of each sample's features ``[B, D]`` (float32)."""
    return (features.float() - features_jigsawed.float()).flatten(1).norm(dim=1)


def diff_norm(features: torch.Tensor, features_jigsawed: torch.Tensor) -> float:
    """The mean over samples of ``|| f(x) - f(x~) ||_2``."""
    return feature_distances(features, features_jigsawed).mean().item()


class ClassificationMeter:
    """Sums over batches (and ranks) of the counts behind top-1, top-5, loss, consistency and diff-norm."""

    KEYS = ("count", "top1", "top5", "loss", "agree", "distance", "jigsawed")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def update(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        loss_sum: float | None = None,
        logits_jigsawed: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        features_jigsawed: torch.Tensor | None = None,
    ) -> None:
        counts = topk_correct(logits, targets, (1, 5))
        self.sums["count"] += len(targets)
        self.sums["top1"] += counts[1]
        self.sums["top5"] += counts[5]
        if loss_sum is not None:
            self.sums["loss"] += float(loss_sum)
        if logits_jigsawed is not None:
            self.sums["jigsawed"] += len(targets)
            self.sums["agree"] += int(prediction_agreement(logits, logits_jigsawed).sum())
            if features is not None and features_jigsawed is not None:
                self.sums["distance"] += float(feature_distances(features, features_jigsawed).sum())

    def all_reduce(self) -> None:
        """Sums the counts over the ranks of the default process group (no-op without one)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            backend = dist.get_backend()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            values = torch.tensor([self.sums[key] for key in self.KEYS], dtype=torch.float64, device=device)
            dist.all_reduce(values)
            self.sums = dict(zip(self.KEYS, values.tolist(), strict=True))

    def result(self) -> dict[str, float | None]:
        count = max(self.sums["count"], 1.0)
        jigsawed = self.sums["jigsawed"]
        return {
            "top1": 100.0 * self.sums["top1"] / count,
            "top5": 100.0 * self.sums["top5"] / count,
            "loss": self.sums["loss"] / count,
            "consistency": 100.0 * self.sums["agree"] / jigsawed if jigsawed else None,
            "diff_norm": self.sums["distance"] / jigsawed if jigsawed else None,
            "images": int(self.sums["count"]),
        }


def resolve_jigsaw_mode(model: nn.Module, mode: str) -> str:
    """``auto`` -> ``unk`` for an MJP ViT (it has an unknown position embedding), else ``pixel``."""
    if mode not in JIGSAW_MODES:
        raise ValueError(f"jigsaw must be one of {', '.join(JIGSAW_MODES)}, got {mode!r}")
    has_unk = getattr(getattr(model, "mjp", None), "unk_embed", None) is not None
    if mode == "auto":
        return "unk" if has_unk else "pixel"
    if mode == "unk" and not has_unk:
        raise ValueError("jigsaw='unk' needs an MJP ViT (a model with mjp.unk_embed); use 'pixel' for this model")
    return mode


def features_and_logits(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre-logits features ``[B, D]``, logits ``[B, C]``) of a timm model, in one pass through the trunk."""
    tokens = model.forward_features(images)
    features = model.forward_head(tokens, pre_logits=True)
    return features, model.forward_head(tokens)


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    loader: Iterable,
    *,
    device: torch.device | str,
    mean: torch.Tensor,
    std: torch.Tensor,
    ratio: float = 0.5,
    seed: int = 0,
    jigsaw: str = "auto",
    patch_size: int | None = None,
    amp_dtype: torch.dtype | None = None,
    corrupt: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    criterion: nn.Module | None = None,
    progress: Callable[[int], Any] | None = None,
) -> dict[str, float | None]:
    """Top-1, top-5, loss, consistency and diff-norm of ``model`` on ``loader``, summed over ranks.

    Args:
        loader: batches ``(images, targets)``; images uint8 ``[B, 3, H, W]`` (or float in [0, 1]).
        mean, std: normalization, ``[3]``.
        ratio, seed: the jigsaw of the consistency protocol (ratio 0 or jigsaw ``"none"``: no consistency).
        jigsaw: ``"auto"``, ``"unk"``, ``"pixel"`` or ``"none"`` (module docstring).
        patch_size: the pixel jigsaw's patch side (default: the model's patch size).
        corrupt: ``corrupt(images01, batch_index) -> images01``, applied before normalization (robustness).
        criterion: a loss on (logits, targets) averaged over the batch; the result's ``loss`` is its mean.
        progress: called with the number of images after each batch.

    Returns:
        ``top1``, ``top5`` (percent), ``loss``, ``consistency`` (percent), ``diff_norm``, ``images``.
    """
    device = torch.device(device)
    mode = resolve_jigsaw_mode(model, jigsaw) if ratio > 0 else "none"
    if mode == "pixel":
        patch_size = patch_size or patch_size_of(model) or 16
    rank, world = rank_and_world()
    mean, std = mean.to(device).view(1, -1, 1, 1), std.to(device).view(1, -1, 1, 1)
    was_training = model.training
    model.eval()
    meter = ClassificationMeter()
    seen = 0
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    try:
        for batch_index, (images, targets) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            images = images.float().div_(255.0) if images.dtype == torch.uint8 else images.float()
            if corrupt is not None:
                images = corrupt(images, batch_index)
            images = (images - mean) / std
            batch = images.shape[0]
            with autocast:
                features, logits = features_and_logits(model, images)
                logits_jigsawed = features_jigsawed = None
                if mode == "pixel":
                    grid = (images.shape[-2] // patch_size, images.shape[-1] // patch_size)
                    offset = seen * world + rank * batch
                    shuffle = sample_jigsaw(batch, grid, ratio, seed=seed, offset=offset, prob=1.0, device=device)
                    shuffled = jigsaw_images(images, shuffle, patch_size)
                    features_jigsawed, logits_jigsawed = features_and_logits(model, shuffled)
                elif mode == "unk":
                    # One stream over the pass, entered per batch (the plain forward runs outside it).
                    with model.mjp_eval(ratio=ratio, seed=seed, start=seen):
                        features_jigsawed, logits_jigsawed = features_and_logits(model, images)
            loss_sum = None
            if criterion is not None:
                loss_sum = float(criterion(logits.float(), targets)) * batch
            meter.update(logits.float(), targets, loss_sum, logits_jigsawed, features, features_jigsawed)
            seen += batch
            if progress is not None:
                progress(batch * world)
    finally:
        model.train(was_training)
    meter.all_reduce()
    return meter.result()
