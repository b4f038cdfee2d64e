"""Pixel-space MJP for timm models without an absolute position table (ResNet, Swin, ConvNeXt, ViTs without
``pos_embed``): the input images are jigsawed in training, as the paper's ResNet-50 + MJP and Swin-T + MJP rows."""

from __future__ import annotations

import torch
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer

from mjp_fast.timm.base import _MJPNoDALMixin


class _MJPPixelMixin(_MJPNoDALMixin):
    """Pixel-space MJP for models without absolute position embeddings: the input is jigsawed in training."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return super().forward(self.mjp(x), *args, **kwargs)


class _MJPPixelModelMixin(_MJPPixelMixin):
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
_PIXEL_CLASSES = {
    ResNet: MJPResNet,
    SwinTransformer: MJPSwinTransformer,
    ConvNeXt: MJPConvNeXt,
    VisionTransformer: MJPPixelVisionTransformer,
}
