"""Pixel-space MJP for every timm image model without an absolute position table: the input images are jigsawed
in training, as the paper's ResNet-50 + MJP and Swin-T + MJP rows.

A model whose positions live in relative biases, in its convolutions (CNNs, conditional position encodings), in a
computed encoding (XCiT's Fourier features) or nowhere (MLP mixers, LSTMs) has no row to swap for an unknown
embedding: the jigsaw of the input is what MJP can do there. A shuffled patch keeps the relative bias of where it
lands, as a shuffled patch of a ViT keeps ``pos_embed`` of where it lands in the paper's naive-shuffle row.

Two kinds of pixel-space classes:

- the named ones of :data:`PIXEL_CLASSES` (ResNet, Swin, ConvNeXt, a ViT without ``pos_embed``,
  ``VisionTransformerRelPos``, BEiT), the classes MJP had before it covered every family: their names are in pickles
  and their jigsaw patch is the patch embedding's, else 16 pixels, as it always was;
- every other timm image model: an MJP subclass made for its class (:func:`pixel_class`), jigsawed at its first
  downsampling stage's stride (:func:`first_downsampling_stride`).

A model that has a learned absolute position table is MJP's token path's (the ViT and Eva front ends, and those of
``convert.TOKEN_FRONT_ENDS``); one that no front end covers yet is refused (:func:`absolute_position_tables`) unless
``convert(..., pixel_jigsaw=True)`` asks for the pixel jigsaw.
"""

from __future__ import annotations

import re

import timm
import torch
from timm.models.beit import Beit
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos
from torch import nn

from mjp_fast.timm.base import MJPNoDALModel, mjp_class_of


class MJPPixelModel(MJPNoDALModel):
    """Pixel-space MJP for models without absolute position embeddings: the input is jigsawed in training."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return super().forward(self.mjp(x), *args, **kwargs)


class _MJPPixelModelMixin(MJPPixelModel):
    """Pixel-space MJP for a timm model: ``forward_intermediates`` (what timm's ``FeatureGetterNet`` calls) jigsaws
    its input too. Neither entry calls the other in timm's models, so an input is jigsawed once."""

    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs):
        return super().forward_intermediates(self.mjp(x), *args, **kwargs)


class MJPResNet(_MJPPixelModelMixin, ResNet):
    """A timm ``ResNet`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPSwinTransformer(_MJPPixelModelMixin, SwinTransformer):
    """A timm ``SwinTransformer`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPConvNeXt(_MJPPixelModelMixin, ConvNeXt):
    """A timm ``ConvNeXt`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPPixelVisionTransformer(_MJPPixelModelMixin, VisionTransformer):
    """A timm ``VisionTransformer`` without absolute position embeddings, trained on jigsawed inputs."""


class MJPVisionTransformerRelPos(_MJPPixelModelMixin, VisionTransformerRelPos):
    """A timm ``VisionTransformerRelPos`` (relative position biases, no table) trained on jigsawed inputs."""


class MJPBeit(_MJPPixelModelMixin, Beit):
    """A timm ``Beit`` (relative position biases) trained on jigsawed inputs."""


# timm class -> its named MJP class. These keep the jigsaw patch they always had (the patch embedding's, else 16).
PIXEL_CLASSES = {
    ResNet: MJPResNet,
    SwinTransformer: MJPSwinTransformer,
    ConvNeXt: MJPConvNeXt,
    VisionTransformer: MJPPixelVisionTransformer,
    VisionTransformerRelPos: MJPVisionTransformerRelPos,
    Beit: MJPBeit,
}

LEGACY_PATCH_SIZE = 16
"""The jigsaw patch of the :data:`PIXEL_CLASSES` models without a patch embedding (ResNet, ConvNeXt)."""

# The last name of a learned absolute position table among timm's parameters (after any ParameterList index):
# pos_embed (CaiT, PiT, ConViT, Hiera, VOLO, Nest's levels, SAM ViTs with use_abs_pos, MViTv2 with use_abs_pos),
# pos_embed_0/1 (CrossViT), pos_embed1..3 (Visformer), pos_embed_window (Hiera in SAM2), pos_embed_x/_y (NaFlexViT's
# factorized table), absolute_pos_embed (Swin with ape), patch_pos/pixel_pos (TNT), position_embedding_table
# (Gemma 4's encoder). Relative tables (relative_position_bias_table, rel_pos_h/_w) are not absolute: excluded.
_ABSOLUTE_TABLE = re.compile(r"^(?!rel)(\w*pos_embed\w*|position_embedding\w*|patch_pos|pixel_pos)$")


def absolute_position_tables(model: nn.Module) -> list[str]:
    """The names of ``model``'s learned absolute position tables (parameters of at least two dimensions whose name
    says so), in ``named_parameters`` order; empty for a model whose positions are relative, computed or
    convolutional."""
    found = []
    for name, parameter in model.named_parameters():
        last = next((part for part in reversed(name.split(".")) if not part.isdigit()), name)
        if parameter.dim() >= 2 and _ABSOLUTE_TABLE.match(last):
            found.append(name)
    return found


def first_stage_stride(model: nn.Module) -> int | None:
    """The stride of ``model``'s first feature stage in pixels: ``model.feature_info[0]['reduction']``; None where
    timm publishes no ``feature_info`` (not a timm image model).

    Why this source: every timm image model publishes ``feature_info`` (``features_only`` is built from it), in
    one format, as a list of dicts or (feature wrappers, ``EfficientNetFeatures``) a ``FeatureInfo`` whose items
    are the whole model's stages; timm asserts the reductions never decrease, so the first is the finest grid the
    model has, its stem's or patch embedding's stride: the patch size where there are patch tokens (XCiT, LeViT's
    16-pixel stem, Twins' 4, MobileViT's 2). Patch embedding attributes are not uniform across timm
    (``patch_size``, ``patch_stride``, a stem's convolutions, none at all in CNNs), so they are not read here.
    """
    info = getattr(model, "feature_info", None)
    try:
        reduction = info[0]["reduction"]
    except (TypeError, KeyError, IndexError):
        return None
    if not isinstance(reduction, int) or isinstance(reduction, bool):
        return None
    if reduction < 1:  # a placeholder, not a stride (timm 1.0.29's ConViT publishes 0): the patch embedding's patch
        patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
        patch = patch[0] if isinstance(patch, (tuple, list)) else patch
        return int(patch) if isinstance(patch, int) and patch >= 1 else int(reduction)
    return int(reduction)


def first_downsampling_stride(model: nn.Module) -> int | None:
    """The stride of ``model``'s first feature stage that downsamples (a stride of at least 2): the first stage's
    (:func:`first_stage_stride`), or where that stage keeps the input's resolution (VGG's and DLA's first
    convolutions, stride 1) the next stage's that does; None where timm publishes no ``feature_info``, 1 where no
    stage downsamples."""
    first = first_stage_stride(model)
    if first is None or first >= 2:
        return first
    info = model.feature_info
    try:
        reductions = info.reduction() if hasattr(info, "reduction") else [stage["reduction"] for stage in info]
    except (TypeError, KeyError):
        return first
    return next((int(r) for r in reductions if isinstance(r, int) and not isinstance(r, bool) and r >= 2), first)


def model_input_size(model: nn.Module) -> tuple[int, int] | None:
    """The (height, width) ``model`` was built for: timm's traits (``img_size`` given to ``create_model``), else its
    patch embedding's ``img_size``, else its pretrained config's ``input_size``; None where none says."""
    traits = getattr(model, "_traits", None)
    size = traits.get("img_size") if isinstance(traits, dict) else None
    if size is None:
        size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        config = getattr(model, "pretrained_cfg", None)
        size = config.get("input_size") if isinstance(config, dict) else None
        size = size[-2:] if isinstance(size, (tuple, list)) and len(size) == 3 else None
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(side, int) for side in size):
        return int(size[0]), int(size[1])
    return None


def legacy_patch_size(model: nn.Module) -> int:
    """The jigsaw patch of a :data:`PIXEL_CLASSES` model (or of timm's feature wrapper of one): its patch
    embedding's patch size, else 16."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", LEGACY_PATCH_SIZE) if embed is not None else LEGACY_PATCH_SIZE
    return int(patch[0] if isinstance(patch, (tuple, list)) else patch)


def wraps_a_legacy_class(wrapper: nn.Module) -> bool | None:
    """Whether a ``FeatureListNet``/``FeatureDictNet``/``FeatureHookNet`` wraps a :data:`PIXEL_CLASSES` model; None
    where that cannot be told. The wrapper keeps the model's layers, not its class: the class is told by the module
    of timm's entry point for the wrapper's architecture name (``pretrained_cfg['architecture']``), each of those
    classes' modules building that class alone. Nothing is built (timm 1.0.29's RegNet cannot be, on the meta
    device)."""
    config = getattr(wrapper, "pretrained_cfg", None)
    architecture = config.get("architecture") if isinstance(config, dict) else None
    if not isinstance(architecture, str) or not timm.is_model(architecture):
        return None
    module = timm.models.model_entrypoint(architecture).__module__
    return module in {timm_class.__module__ for timm_class in PIXEL_CLASSES}


def pixel_class(model_class: type) -> type:
    """The MJP class of a timm image model class that is not in :data:`PIXEL_CLASSES`: a subclass of both (made
    once per class; picklable by name, see :func:`mjp_fast.timm.base.mjp_class_of`) whose ``forward``, and
    ``forward_intermediates`` where the class has one, jigsaw their input."""
    mixin = _MJPPixelModelMixin if hasattr(model_class, "forward_intermediates") else MJPPixelModel
    return mjp_class_of(model_class, None, mixin)
