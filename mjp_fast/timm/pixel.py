"""Pixel-space MJP for timm models without an absolute position table (ResNet, Swin, ConvNeXt, ViTs without
``pos_embed``, the relative-position ViTs ``VisionTransformerRelPos`` and BEiT): the input images are jigsawed in
training, as the paper's ResNet-50 + MJP and Swin-T + MJP rows.

A model whose positions live in relative biases (or in its convolutions) has no row to swap for an unknown
embedding: the jigsaw of the input is what MJP can do there. A shuffled patch keeps the relative bias of where it
lands, as a shuffled patch of a ViT keeps ``pos_embed`` of where it lands in the paper's naive-shuffle row."""

from __future__ import annotations

import torch
from timm.models.beit import Beit
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos

from mjp_fast.timm.base import MJPNoDALModel


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


# timm class -> its MJP class
class MJPVisionTransformerRelPos(_MJPPixelModelMixin, VisionTransformerRelPos):
    """A timm ``VisionTransformerRelPos`` (relative position biases, no table) trained on jigsawed inputs."""


class MJPBeit(_MJPPixelModelMixin, Beit):
    """A timm ``Beit`` (relative position biases) trained on jigsawed inputs."""


PIXEL_CLASSES = {
    ResNet: MJPResNet,
    SwinTransformer: MJPSwinTransformer,
    ConvNeXt: MJPConvNeXt,
    VisionTransformer: MJPPixelVisionTransformer,
    VisionTransformerRelPos: MJPVisionTransformerRelPos,
    Beit: MJPBeit,
}
