"""MJP's token path for timm's TNT (mjp_fast/timm/tnt.py, issue 40 item 1): convert, eval equal to timm's, a training
step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch jigsaw
(inner and outer tokens move with their patch, ``unk_embed`` in place of the masked positions' ``patch_pos`` rows,
``pixel_pos`` kept), DAL on the patch rows, FX (plain and timm's feature extractor), ``forward_intermediates``,
``features_only``, checkpoints both ways and pickling; the legacy pixel embedding too."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.tnt import MJPTNT, TntOuterTokensLayerNorm, TntPixelEmbed
from tests.timm import front_end_checks as checks

# 32 pixels in 8-pixel patches: a 4x4 grid; inside each patch a stride-4 convolution gives 2x2 inner tokens of width 8.
TINY = dict(
    img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_inner=2, num_heads_outer=2, num_classes=5
)
KINDS = {"tnt": dict(legacy=False), "legacy": dict(legacy=True)}  # legacy: the convolution over the whole image
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # a 4x4 grid: min_block 1 so that the sampler masks positions


def _plain(kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("tnt_s_patch16_224", pretrained=False, **{**TINY, **KINDS[kind], **overrides})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _tokens(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's first lines of ``TNT.forward_features``: the inner tokens ``[B * N, p * p, C]`` and the outer tokens
    plus ``patch_pos`` ``[B, 1 + N, D]`` that the blocks get."""
    batch = images.shape[0]
    pixel = model.pixel_embed(images, model.pixel_pos)
    outer = model.norm2_proj(model.proj(model.norm1_proj(pixel.reshape(batch, model.num_patches, -1))))
    outer = torch.cat((model.cls_token.expand(batch, -1, -1), outer), dim=1)
    return pixel, model.pos_drop(outer + model.patch_pos)


@pytest.mark.parametrize("kind", list(KINDS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPTNT) and isinstance(model.pixel_embed, TntPixelEmbed)
    assert isinstance(model.norm2_proj, TntOuterTokensLayerNorm)
    checks.assert_token_path_state(model, patch_size=8, grid=(4, 4))
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.patch_pos])
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected)


@pytest.mark.parametrize("kind", list(KINDS))
def test_patches_move_whole_and_masked_ones_get_unk(kind):
    """Inside mjp_eval: the inner tokens are timm's of the jigsawed images (``pixel_pos`` as it is), the outer
    tokens timm's of the jigsawed images plus ``unk_embed`` at the masked positions and their own ``patch_pos`` row
    elsewhere, the class token timm's. TNT's embedding is patch-local: moving the images' patches moved its tokens,
    inner and outer together (the legacy one's convolution also sees the neighbours' border pixels)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        pixel, outer = _tokens(model, images)
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(16)).any()
    with torch.no_grad():  # eval: timm's embedding
        expected_pixel, plain_outer = _tokens(model, checks.jigsaw_ref(images, jigsaw.perm, 4, 4, 8))
        plain_outer = plain_outer - model.patch_pos
    torch.testing.assert_close(pixel, expected_pixel, rtol=0, atol=0)
    mask = jigsaw.mask.unsqueeze(-1)
    patch_rows = model.patch_pos[:, 1:].expand(2, -1, -1)
    expected = plain_outer[:, 1:] + torch.where(mask, model.mjp.unk_embed.expand_as(patch_rows), patch_rows)
    torch.testing.assert_close(outer[:, 1:], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outer[:, 0], (model.cls_token + model.patch_pos[:, :1])[:, 0].expand(2, -1))
    if kind == "tnt":  # the tokens of the unjigsawed images, moved as the jigsaw says
        with torch.no_grad():
            unmoved_pixel, unmoved_outer = _tokens(model, images)
        index = jigsaw.perm.reshape(2, 16, 1, 1).expand(-1, -1, 4, 8)
        moved = unmoved_pixel.reshape(2, 16, 4, 8).gather(1, index)
        torch.testing.assert_close(expected_pixel.reshape(2, 16, 4, 8), moved, rtol=1e-5, atol=1e-6)
        unmoved = (unmoved_outer - model.patch_pos)[:, 1:]
        moved = unmoved.gather(1, jigsaw.perm.unsqueeze(-1).expand_as(unmoved))
        torch.testing.assert_close(plain_outer[:, 1:], moved, rtol=1e-5, atol=1e-5)


def _dal_of_the_patch_rows(model: torch.nn.Module) -> torch.Tensor:
    return mjp_fast.dal_loss(
        model.patch_pos[:, 1:], model.mjp.dal_regressor, (4, 4), model.mjp.last_jigsaw.mask, backend="torch"
    )


def test_dal_regresses_the_patch_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain("tnt"), **SETTINGS)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_patch_rows)


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        lambda: _plain("tnt"), fused=r"TNT's pixel_embed .* not timm's PatchEmbed", model="TNT"
    )
    odd = _plain("legacy", img_size=36, patch_size=6)  # a stride-4 convolution does not step evenly over 6 pixels
    with pytest.raises(ValueError, match=r"legacy pixel embedding: the patch size \(6, 6\) is not a multiple"):
        mjp_timm.convert(odd)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain("tnt"), **SETTINGS).train(training)
    images = _images()
    # in training: the images' jigsaw, then the step on the outer tokens
    checks.assert_fx_graph_is_the_model(model, images, torch.fx.Tracer(), mjp_nodes=2, out_shape=(2, 5))
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert any("mjp" in node for node in train_nodes) and not any("mjp" in node for node in eval_nodes)
    extractor = create_feature_extractor(model, return_nodes={eval_nodes[-1]: "out", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
        assert features["norm"].shape == (2, 17, 32)
        if not training:
            torch.testing.assert_close(features["out"], model(images), rtol=0, atol=0)


def test_forward_intermediates():
    plain = _plain("tnt")
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(2, 32, 4, 4)] * 2)


def test_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("tnt_s_patch16_224", pretrained=False, features_only=True, out_indices=(0, 1), **TINY)
    model = checks.assert_features_only(wrapper, _images(), SETTINGS, shape=(2, 32, 4, 4))
    assert isinstance(model.model.pixel_embed, TntPixelEmbed)


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    checks.assert_pickles_and_copies(model, images, _check_clone)


def _check_clone(clone: torch.nn.Module) -> None:
    # the clone's swapped modules read the clone's tables and state
    assert clone.pixel_embed.__dict__["_mjp_model"] is clone and clone.norm2_proj.__dict__["_mjp_model"] is clone
