"""MJP's token path for timm's Hiera (mjp_fast/timm/hiera.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step itself (the images
jigsawed before the overlapping stem, ``unk_embed`` at the masked positions), the abswin table, FX, ``features_only``,
checkpoints both ways and pickling, and the refusals."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

import mjp_fast.timm as mjp_timm
from mjp_fast import jigsaw_images
from mjp_fast.timm.hiera import MJPHiera
from tests.timm import front_end_checks as checks

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
    assert isinstance(model, MJPHiera)
    checks.assert_token_path_state(model, patch_size=4, dim=16)
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    # abswin: DAL regresses the sum timm adds: both of its parameters learn from it
    tables = [model.pos_embed] + ([model.pos_embed_win] if kind == "abswin" else [])
    checks.assert_training_step_reaches_every_parameter(model, images, tables=tables)
    checks.assert_aux_loss_handed_out_once(model)  # for the table it was computed on
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=1e-3)


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


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    """timm's Hiera traces only with its mask-unit mask given as None (its ``mask=None`` branch: timm's own feature
    extractor, which takes no concrete arguments, cannot trace it); so traced, MJP is two ``mjp`` nodes in training."""
    model = mjp_timm.convert(_plain("table"), **SETTINGS).train(training)
    images = _images()
    graph = torch.fx.GraphModule(model, checks.TimmLeafTracer().trace(model, concrete_args={"mask": None}))
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
    images = _images()
    model = checks.assert_features_only(wrapper, images, SETTINGS, shape=(2, 16, 16, 16))
    assert isinstance(model.model, MJPHiera)
    converted = mjp_timm.convert(_plain("table"), **SETTINGS)
    checks.assert_forward_intermediates(_plain("table"), converted, images, shapes=[(4, 4), (2, 2)], seed=1, indices=2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    # a training forward keeps its table for mjp_aux_loss: not pickled, not deep-copied
    checks.assert_pickles_and_copies(model, images, _check_clone)


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.patch_embed.__dict__["_mjp_state"] is clone.mjp


def test_refusals():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        lambda: _plain("table"), fused=r"Hiera's stem .* overlap", model="Hiera"
    )
    model = mjp_timm.convert(_plain("table"), **SETTINGS)
    with pytest.raises(ValueError, match="multiples of the jigsaw patch size 4"):
        model(torch.randn(1, 3, 62, 62))
