"""timm's ``features_only`` wrappers around MJP models."""

from __future__ import annotations

import torch
from timm.models._features import FeatureDictNet, FeatureGetterNet, FeatureHookNet

from mjp_fast.timm.base import MJPModel, MJPNoDALModel
from mjp_fast.timm.state import MJPState


class _MJPFeatureGetterMixin(MJPModel):
    """timm's ``FeatureGetterNet`` (``features_only=True`` for ViTs) around an MJP model: the wrapped model's
    ``forward_intermediates`` applies MJP, and MJP's methods and state are the wrapped model's."""

    @property
    def mjp(self) -> MJPState:
        return self.model.mjp

    def mjp_aux_loss(self) -> torch.Tensor:
        return self.model.mjp_aux_loss()


class _MJPFeatureModulesMixin(MJPNoDALModel):
    """timm's ``FeatureListNet``/``FeatureDictNet`` (``features_only=True`` for most CNNs and Swin) and
    ``FeatureHookNet`` (Xception, NASNet, PNASNet). They are module dicts that run their entries in order, not the
    model's ``forward`` (a hook net's hooks read the outputs of the modules they are on, whatever runs before):
    :func:`convert` puts ``mjp`` first, so the input is jigsawed (pixel-space MJP) before the first layer."""


class MJPFeatureHookBodyMixin(MJPModel):
    """timm's ``FeatureHookNet`` around a whole model (its one entry ``body``, whose own ``forward`` runs while hooks
    on its stages collect the features: PiT's ``features_only``) where that model takes MJP's token path:
    :func:`convert` converts the body, and MJP's methods and state are the body's."""

    @property
    def mjp(self) -> MJPState:
        return self.body.mjp

    def mjp_aux_loss(self) -> torch.Tensor:
        return self.body.mjp_aux_loss()


WRAPPER_MIXINS = {
    FeatureGetterNet: _MJPFeatureGetterMixin,
    FeatureDictNet: _MJPFeatureModulesMixin,
    FeatureHookNet: _MJPFeatureModulesMixin,
}
