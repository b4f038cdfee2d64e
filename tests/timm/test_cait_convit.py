"""MJP's token path for timm's CaiT and ConViT (mjp_fast/timm/inline_table.py, issue 40 item 1): convert, eval equal to
timm's, a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the fused patch
embedding against timm's, FX (plain and timm's feature extractor), ``features_only``, checkpoints both ways and
pickling; a ConViT without a table gets the pixel-space jigsaw."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
from timm.layers import create_feature_extractor, is_notrace_module

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.timm.inline_table import InlineTablePatchEmbed, MJPCait, MJPConVit

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


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer, with the modules timm marks as not traceable (ConViT's GPSA) kept as calls, as timm's
    feature extractor keeps them."""

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return is_notrace_module(type(module)) or super().is_leaf_module(module, qualified_name)


def _trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    return torch.fx.GraphModule(model, _LeafTracer().trace(model))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, (MJPCait, MJPConVit)) and isinstance(model.patch_embed, InlineTablePatchEmbed)
    assert model.mjp.unk_embed is not None and model.mjp.dal_regressor is not None and model.mjp.patch_size == 4
    assert "mjp.unk_embed" in model.no_weight_decay()
    images = _images()
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(images)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=0)
    model.train()
    model(images).logsumexp(-1).mean().backward()  # the output alone: DAL rides on it
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert model.mjp.last_dal_loss is not None and model.mjp.last_jigsaw.mask.any()
    # DAL's gradient, not a zero kept in the graph
    assert any(p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
    assert model.pos_embed.grad.abs().sum() > 0 and model.mjp.unk_embed.grad.abs().sum() > 0
    assert torch.isfinite(model.mjp_aux_loss())
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed, jigsawed_features = model(images), model.forward_features(images)
    assert model.mjp.last_jigsaw.mask.any() and not torch.equal(jigsawed, expected)
    with torch.no_grad():  # at initialization (CaiT's layer scale 1e-4) the logits move little; the tokens do
        assert (jigsawed_features - plain.forward_features(images)).abs().max() > 1e-2
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


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
    graph = _trace(model)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert ("mjp" in targets) == training  # MJP is one node of a graph traced in training
    with torch.no_grad():
        if training:
            out = graph(images)
            assert out.shape == (2, 5) and model.mjp.last_jigsaw.mask.any()
        else:
            torch.testing.assert_close(graph(images), model(images), rtol=0, atol=0)
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
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert model.mjp is model.model.mjp and isinstance(model.model.patch_embed, InlineTablePatchEmbed)
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert jigsawed[0].shape == (2, 32, 8, 8) and not torch.allclose(jigsawed[0], plain(images)[0])
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.model.mjp.unk_embed.grad is not None and model.model.mjp.last_dal_loss is not None


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    with torch.no_grad():
        model.mjp.unk_embed.normal_()
    # plain timm -> MJP: only mjp.* missing; MJP -> plain timm: only mjp.* unexpected
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(key.startswith("mjp.") for key in missing) and not unexpected
    other = _plain(kind).eval()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.patch_embed.__dict__["_mjp_model"] is loaded  # the copy's embedding reads the copy's table
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.patch_embed.__dict__["_mjp_model"] is copied


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
