"""timm's own model checks (the style of timm's tests/test_models.py: forward, backward with every parameter's
gradient, forward_features and forward_head, forward_intermediates, features_only, FX) on ``mjp_<base>`` models
registered with :func:`mjp_fast.timm.register` (issue 40 item 5), tiny, in training mode with MJP on: a DeiT (the
ViT front end), a CaiT and a ConViT (the inline-table front end, mjp_fast/timm/inline_table.py).
"""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor

from mjp_fast.timm import register

TINY = dict(img_size=32, patch_size=4, num_heads=2, depth=2, num_classes=5)
MODELS = {
    "deit_tiny_patch16_224": dict(embed_dim=32, **TINY),
    "cait_xxs24_224": dict(embed_dim=32, depth_token_only=1, **TINY),
    "convit_tiny": dict(embed_dim=16, local_up_to_layer=1, **TINY),  # width 16 x 2 heads
}
MJP = dict(mjp_ratio=0.5, mjp_prob=1.0)  # every sample jigsawed in training


def _create(base: str, **keywords) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(register(base), pretrained=False, **{**MODELS[base], **MJP, **keywords})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("base", list(MODELS))
def test_forward_and_backward_reach_every_parameter(base):
    model = _create(base).train()
    assert model.pretrained_cfg["architecture"] == f"mjp_{base}"
    out = model(_images())
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.mean().backward()  # the output alone: the DAL loss rides on it
    named = dict(model.named_parameters())
    missing = [name for name, parameter in named.items() if parameter.grad is None]
    assert not missing, missing
    assert model.mjp.unk_embed.grad.abs().sum() > 0  # the shuffled positions used it
    assert model.mjp.last_dal_loss is not None


@pytest.mark.parametrize("base", list(MODELS))
def test_forward_features_head_and_intermediates(base):
    model = _create(base).eval()
    if not hasattr(model, "forward_intermediates"):  # timm 1.0.29's ConVit has none
        pytest.skip(f"timm {timm.__version__}'s {type(model).__name__} has no forward_intermediates")
    images = _images()
    with torch.no_grad():
        features = model.forward_features(images)
        torch.testing.assert_close(model.forward_head(features), model(images))
        final, intermediates = model.forward_intermediates(images, indices=2)
    assert len(intermediates) == 2
    for feature in intermediates:  # NCHW maps of the token grid
        assert feature.shape[0] == 2 and feature.shape[-2:] == (8, 8)
    torch.testing.assert_close(final, features)


@pytest.mark.parametrize("base", list(MODELS))
def test_features_only(base):
    try:
        model = _create(base, features_only=True, out_indices=(0, 1)).train()
    except RuntimeError as error:  # timm 1.0.29's ConVit: "features_only not implemented"
        pytest.skip(f"timm {timm.__version__} builds no features_only {base}: {error}")
    features = model(_images())
    assert len(features) == len(model.feature_info.channels()) == 2
    for feature, channels, reduction in zip(features, model.feature_info.channels(), model.feature_info.reduction()):
        assert feature.shape == (2, channels, 32 // reduction, 32 // reduction)
    sum(feature.mean() for feature in features).backward()
    assert model.model.mjp.unk_embed.grad is not None  # the wrapped model's MJP ran


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("base", list(MODELS))
def test_fx_feature_extractor_equals_eager(base):
    model = _create(base).eval()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert any("mjp" in node for node in train_nodes)  # MJP is one node of the training graph
    extractor = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(extractor(images)[eval_nodes[-1]], model(images))
