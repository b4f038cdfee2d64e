"""The image and patch sides of a timm model, read from its patch embedding (or its config): what training builds
its data for and what evaluation jigsaws the images with."""

from __future__ import annotations

from torch import nn


def input_size(model: nn.Module, fallback: int = 224) -> int:
    """The square input side the model expects: its patch embedding's ``img_size``, else its pretrained config's
    ``input_size``, else ``fallback``."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size is not None:
        return int(size[0] if isinstance(size, (tuple, list)) else size)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return int(cfg.get("input_size", (3, fallback, fallback))[-1])


def patch_size_of(model: nn.Module) -> int | None:
    """The side of the model's square patches (an MJP model without a patch embedding: its ``mjp.patch_size``);
    None for a model that has neither."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None:
        mjp = getattr(model, "mjp", None)
        return getattr(mjp, "patch_size", None)
    return int(patch[0] if isinstance(patch, (tuple, list)) else patch)
