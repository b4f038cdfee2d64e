"""MJP's token path for timm's Hiera (mjp_fast/timm/hiera.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step itself (the images
jigsawed before the overlapping stem, ``unk_embed`` at the masked positions), the abswin table, FX, ``features_only``,
checkpoints both ways and pickling, and the refusals."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
from timm.layers import is_notrace_module

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.timm.hiera import MJPHiera

# A 16x16 grid of 4-pixel blocks (64 px), 8x8 mask units, one block per stage.
TINY = dict(embed_dim=16, num_heads=1, stages=(1, 1, 1, 1), img_size=(64, 64), num_classes=5)
MODELS = {
    "table": ("hiera_tiny_224", TINY),
    "abswin": ("hiera_small_abswin_256", dict(global_pos_size=(8, 8), **TINY)),
}
SETTINGS = dict(ratio=0.3, prob=1.0, min_block=2)


def _plain(kind: str, **overrides) -> torch.nn.Module:
    name, keywords = MODELS[kind]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **{**keywords, **overrides})
    with torch.no_grad():  # timm scales the head to 1e-3 of its init: the logits would hardly tell inputs apart
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.abs().max() < 1e-2:
                parameter.normal_(0, 0.2)
    return model


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPHiera) and model.mjp.patch_size == 4
    assert model.mjp.unk_embed is not None and model.mjp.unk_embed.shape[-1] == 16
    assert model.mjp.dal_regressor is not None and "mjp.unk_embed" in model.no_weight_decay()
    assert not mjp_timm.convert.__globals__["runs_fused"](model)
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
    assert any(p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
    assert model.pos_embed.grad.abs().sum() > 0 and model.mjp.unk_embed.grad.abs().sum() > 0
    if kind == "abswin":  # DAL regresses the sum timm adds: both of its parameters learn from it
        assert model.pos_embed_win.grad.abs().sum() > 0
    # the loss the forward attached, handed out once, for the table it was computed on
    claimed = model.mjp_aux_loss()
    assert torch.equal(claimed, model.mjp.last_dal_loss) and torch.isfinite(model.mjp_aux_loss())
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any() and (jigsawed - expected).abs().max() > 1e-3
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_is_the_stem_of_the_jigsawed_images_with_unk_at_the_masked_positions(kind):
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model._pos_embed(model.patch_embed(images))
        jigsaw = model.mjp.last_jigsaw
    plain = _plain(kind).eval()
    with torch.no_grad():
        tokens = plain.patch_embed(jigsaw_images(images, jigsaw, 4))  # the stem sees the jigsawed images
        table = plain._pos_embed(torch.zeros_like(tokens[:1]))  # timm's position term, abswin resampling included
    mask = jigsaw.mask.unsqueeze(-1)
    expected = tokens + torch.where(mask, model.mjp.unk_embed.expand_as(tokens), table.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert 0 < int(jigsaw.mask.sum()) < jigsaw.mask.numel()


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer with the modules timm marks as not traceable kept as calls, as timm's feature extractor."""

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return is_notrace_module(type(module)) or super().is_leaf_module(module, qualified_name)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    """timm's Hiera traces only with its mask-unit mask given as None (its ``mask=None`` branch: timm's own feature
    extractor, which takes no concrete arguments, cannot trace it); so traced, MJP is two ``mjp`` nodes in training."""
    model = mjp_timm.convert(_plain("table"), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, _LeafTracer().trace(model, concrete_args={"mask": None}))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (2 if training else 0)  # the images' jigsaw, then the step on the stem's tokens
    with torch.no_grad():
        out = graph(images)
        if training:
            assert out.shape == (2, 5) and model.mjp.last_jigsaw.mask.any()
        else:
            torch.testing.assert_close(out, _plain("table").eval()(images), rtol=0, atol=0)


def test_forward_intermediates_and_features_only():
    name, keywords = MODELS["table"]
    torch.manual_seed(0)
    wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1), **keywords)
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert model.mjp is model.model.mjp and isinstance(model.model, MJPHiera)
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert jigsawed[0].shape == (2, 16, 16, 16) and not torch.allclose(jigsawed[0], plain(images)[0])
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.model.mjp.unk_embed.grad is not None and model.model.mjp.last_dal_loss is not None
    converted = mjp_timm.convert(_plain("table"), **SETTINGS).eval()
    with torch.no_grad(), converted.mjp_eval(ratio=0.5, seed=1):
        final, intermediates = converted.forward_intermediates(images, indices=2)
    assert len(intermediates) == 2 and converted.mjp.last_jigsaw.mask.any()


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    with torch.no_grad():
        model.mjp.unk_embed.normal_()
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(key.startswith("mjp.") for key in missing) and not unexpected
    other = _plain(kind).eval()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert unexpected and all(key.startswith("mjp.") for key in unexpected) and not missing
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(other(images), model(images), rtol=0, atol=0)
    model.train()
    model(images)  # a training forward keeps its table for mjp_aux_loss: not pickled, not deep-copied
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.patch_embed.__dict__["_mjp_state"] is loaded.mjp
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    assert copied.patch_embed.__dict__["_mjp_state"] is copied.mjp


def test_refusals():
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: Hiera's stem .* overlap"):
        mjp_timm.convert(_plain("table"), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*Hiera.* token path covers"):
        mjp_timm.convert(_plain("table"), pixel_jigsaw=True)
    model = mjp_timm.convert(_plain("table"), **SETTINGS)
    with pytest.raises(ValueError, match="multiples of the jigsaw patch size 4"):
        model(torch.randn(1, 3, 62, 62))
