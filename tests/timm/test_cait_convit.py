"""MJP's token path for timm's CaiT and ConViT (mjp_fast/timm/inline_table.py, issue 40 item 1): convert, eval equal to
timm's, a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the fused patch
embedding against timm's, FX (plain and timm's feature extractor), ``features_only``, checkpoints both ways and
pickling; a ConViT without a table gets the pixel-space jigsaw."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers import create_feature_extractor

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.timm.inline_table import InlineTablePatchEmbed, MJPCait, MJPConVit
from tests.timm import front_end_checks as checks

TINY = dict(img_size=32, patch_size=4, num_heads=2, depth=2, num_classes=5)
MODELS = {
    "cait": ("cait_xxs24_224", dict(embed_dim=32, depth_token_only=1, **TINY)),
    # ConViT multiplies embed_dim by num_heads: width 32. One GPSA block, then the class token and one plain block.
    "convit": ("convit_tiny", dict(embed_dim=16, local_up_to_layer=1, **TINY)),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # a 8x8 grid: min_block 1 so that the sampler masks positions


def _plain(kind: str, **overrides) -> torch.nn.Module:
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**keywords, **overrides})


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, (MJPCait, MJPConVit)) and isinstance(model.patch_embed, InlineTablePatchEmbed)
    checks.assert_token_path_state(model, patch_size=4, grid=(8, 8), fused=True)  # timm's PatchEmbed: fused
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed])
    assert torch.isfinite(model.mjp_aux_loss())
    # at initialization (CaiT's layer scale 1e-4) the logits move little (min_change 0: not equal); the tokens do
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=0.0)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed_features = model.forward_features(images)
    with torch.no_grad():
        assert (jigsawed_features - plain.forward_features(images)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_is_unk_on_the_table_of_the_jigsawed_tokens(kind):
    """Inside mjp_eval, the tokens timm's blocks get are the jigsawed patch tokens plus ``unk_embed`` at the masked
    positions and the table's rows elsewhere (within the rounding of timm's ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.pos_drop(model.patch_embed(images) + model.pos_embed)
        jigsaw = model.mjp.last_jigsaw
    with torch.no_grad():
        tokens = model.patch_embed(jigsaw_images(images, jigsaw, 4))  # eval: timm's embedding
    mask = jigsaw.mask.unsqueeze(-1)
    expected = tokens + torch.where(mask, model.mjp.unk_embed.expand_as(tokens), model.pos_embed.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(MODELS))
def test_fused_and_unfused_patch_embeddings_agree(kind):
    plain = _plain(kind)
    fused = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    unfused = mjp_timm.convert(copy.deepcopy(plain), fused_patch_embed=False, **SETTINGS)
    assert fused.patch_embed.__dict__["_mjp_fused"] and not unfused.patch_embed.__dict__["_mjp_fused"]
    unfused.mjp.load_state_dict(fused.mjp.state_dict())  # the same unk_embed and DAL regressor
    images = _images()
    fused.eval(), unfused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(images), unfused(images), rtol=0, atol=0)  # eval: timm's embedding, both
        with fused.mjp_eval(ratio=0.5, seed=4), unfused.mjp_eval(ratio=0.5, seed=4):
            got, expected = fused.forward_features(images), unfused.forward_features(images)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert fused.mjp.last_jigsaw.mask.any()
    fused.train(), unfused.train()  # the same sampler seed: the same jigsaw, the same step
    torch.testing.assert_close(fused(images), unfused(images), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused.mjp.last_dal_loss, unfused.mjp.last_dal_loss)


def test_fused_true_names_why_it_cannot_fuse():
    plain = _plain("cait")
    plain.patch_embed.norm = torch.nn.LayerNorm(32)
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: patch_embed has a norm layer \(LayerNorm\)"):
        mjp_timm.convert(plain, fused_patch_embed=True)
    assert not mjp_timm.convert(plain).patch_embed.__dict__["_mjp_fused"]  # automatic: timm's embedding, moved


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(kind, training):
    model = mjp_timm.convert(_plain(kind), **SETTINGS).train(training)
    images = _images()
    # ConViT's GPSA kept as a call; MJP is one node of a graph traced in training
    checks.assert_fx_graph_is_the_model(model, images, checks.TimmLeafTracer(), mjp_nodes=1, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"blocks.1": "features", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["features"].shape[-1] == 32 and features["norm"].shape[0] == 2


@pytest.mark.parametrize("kind", list(MODELS))
def test_features_only(kind):
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    try:
        wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1), **keywords)
    except RuntimeError as error:  # timm 1.0.29's ConVit: "features_only not implemented"
        pytest.skip(f"timm {timm.__version__} builds no features_only {name}: {error}")
    model = checks.assert_features_only(wrapper, _images(), SETTINGS, shape=(2, 32, 8, 8))
    assert isinstance(model.model.patch_embed, InlineTablePatchEmbed)


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    checks.assert_pickles_and_copies(model, images, _check_clone)


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.patch_embed.__dict__["_mjp_model"] is clone  # the clone's embedding reads the clone's table


def test_a_convit_without_a_table_gets_the_pixel_jigsaw():
    plain = _plain("convit", use_pos_embed=False).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, mjp_timm.MJPPixelModel) and model.mjp.unk_embed is None and model.mjp.patch_size == 4
    images = _images()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)
    model.train()
    out = model(images)
    torch.testing.assert_close(out, plain.train()(jigsaw_images(images, model.mjp.last_jigsaw, 4)))
    out.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.warns(UserWarning, match="has no absolute position table"):
        mjp_timm.convert(copy.deepcopy(plain), dal="linear")


def test_pixel_jigsaw_is_refused_for_the_token_path():
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*Cait.* token path covers"):
        mjp_timm.convert(_plain("cait"), pixel_jigsaw=True)
