"""MJP's token path for timm's PiT (mjp_fast/timm/pit.py, issue 40 items 1 and 5): convert, eval equal to timm's,
a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a
pure-torch jigsaw of the images' top-left blocks, DAL on the NCHW table's rows, FX (plain and timm's feature
extractor), ``forward_intermediates``, ``features_only``, checkpoints both ways and pickling, a distilled PiT; and
timm's own model checks on a registered ``mjp_pit_ti_224``."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models import get_graph_node_names
from timm.models._features_fx import create_feature_extractor

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm import register
from mjp_fast.timm.pit import MJPPoolingVisionTransformer, PitConvEmbedding
from tests.timm import front_end_checks as checks

# Width 8 x 2 heads = 16, one block per stage. Kernel 4 at stride 2 on 32 pixels: a 15x15 grid whose blocks of 2
# pixels cover the top-left 30x30 pixels (the last 2 rows and columns are only the far edge of the last kernels).
TINY = dict(img_size=32, patch_size=4, stride=2, base_dims=[8, 8, 8], depth=[1, 1, 1], heads=[2, 2, 2], num_classes=5)
MODELS = {
    "pit": ("pit_ti_224", TINY),
    "distilled": ("pit_ti_distilled_224", TINY),
    "tiled": ("pit_ti_224", {**TINY, "patch_size": 2}),  # kernel == stride: a 16x16 grid that tiles the image
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions


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
    assert isinstance(model, MJPPoolingVisionTransformer) and isinstance(model.patch_embed, PitConvEmbedding)
    checks.assert_token_path_state(model, patch_size=2, grid=model.patch_embed.grid_size)
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed])
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected)


@pytest.mark.parametrize("kind", ["pit", "tiled"])
def test_the_step_is_unk_on_the_table_of_the_jigsawed_images(kind):
    """Inside mjp_eval, the feature map timm's first stage gets is timm's embedding of the images whose top-left
    blocks were jigsawed (the rest untouched), plus ``unk_embed`` at the masked positions and the table's own rows
    elsewhere (within the rounding of timm's ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    images = _images()
    rows, cols = model.patch_embed.grid_size
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.pos_drop(model.patch_embed(images) + model.pos_embed)
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, rows * cols) and jigsaw.mask.any()
    assert (jigsaw.perm != torch.arange(rows * cols)).any()  # something moved
    with torch.no_grad():
        tokens = model.patch_embed.conv(checks.jigsaw_ref(images, jigsaw.perm, rows, cols, 2))
    mask = jigsaw.mask.reshape(2, 1, rows, cols)
    unk = model.mjp.unk_embed.reshape(1, -1, 1, 1).expand_as(tokens)
    expected = tokens + torch.where(mask, unk, model.pos_embed.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if kind == "tiled":  # kernel == stride: each token is its own block's, so the tokens themselves moved
        with torch.no_grad():
            plain_tokens = model.patch_embed(images).flatten(2).transpose(1, 2)  # eval: timm's embedding
        moved = plain_tokens.gather(1, jigsaw.perm.unsqueeze(-1).expand_as(plain_tokens))
        torch.testing.assert_close(tokens.flatten(2).transpose(1, 2), moved, rtol=1e-5, atol=1e-6)


def test_the_margin_outside_the_blocks_is_not_moved():
    """The pixels below and right of the token grid's blocks (the last 2 rows and columns here) reach the embedding
    as they were: with a kernel that reads only its bottom-right 2x2 pixels, the last row and column of tokens read
    only that margin, and are the same inside and outside mjp_eval."""
    model = mjp_timm.convert(_plain("pit"), **SETTINGS).eval()
    with torch.no_grad():
        model.patch_embed.conv.weight.zero_()
        model.patch_embed.conv.weight[:, :, 2:, 2:] = 1.0  # token (i, j) reads block (i + 1, j + 1) only
        model.mjp.unk_embed.zero_()  # no position terms: the tokens are the embedding's
        model.pos_embed.zero_()
    images = _images()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        jigsawed = model.patch_embed(images)
    with torch.no_grad():
        plain = model.patch_embed(images)
    torch.testing.assert_close(jigsawed[..., -1, :], plain[..., -1, :], rtol=0, atol=0)
    torch.testing.assert_close(jigsawed[..., :, -1], plain[..., :, -1], rtol=0, atol=0)
    assert not torch.equal(jigsawed, plain)


def _dal_of_the_tables_rows(model: torch.nn.Module) -> torch.Tensor:
    rows, cols = model.patch_embed.grid_size
    table_rows = model.pos_embed.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)  # row-major, [1, N, D]
    return mjp_fast.dal_loss(
        table_rows, model.mjp.dal_regressor, (rows, cols), model.mjp.last_jigsaw.mask, backend="torch"
    )


def test_dal_regresses_the_tables_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain("pit"), **SETTINGS)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_tables_rows)


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        lambda: _plain("pit"), fused=r"patch_embed is PiT's ConvEmbedding", model="PoolingVisionTransformer"
    )
    padded = _plain("pit")
    padded.patch_embed.conv.padding = (1, 1)
    with pytest.raises(ValueError, match=r"padding \(1, 1\).*does not start at a whole block"):
        mjp_timm.convert(padded)
    assert isinstance(mjp_timm.convert(_plain("pit"), fused_patch_embed=False), MJPPoolingVisionTransformer)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain("pit"), **SETTINGS).train(training)
    images = _images()
    # in training: the images' jigsaw, then the step on the tokens
    checks.assert_fx_graph_is_the_model(model, images, torch.fx.Tracer(), mjp_nodes=2, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"transformers.0": "stage0", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["stage0"].shape == (2, 16, 15, 15) and features["norm"].shape == (2, 1, 16)


def test_forward_intermediates():
    plain = _plain("pit")
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(15, 15), (8, 8), (4, 4)])


def test_features_only():
    name, keywords = MODELS["pit"]
    torch.manual_seed(0)
    wrapper = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1, 2), **keywords)
    checks.assert_features_only(wrapper, _images(), SETTINGS, shape=(2, 16, 15, 15))


@pytest.mark.parametrize("kind", ["pit", "distilled"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    checks.assert_pickles_and_copies(model, images, _check_clone)


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.patch_embed.__dict__["_mjp_model"] is clone  # the clone's embedding reads the clone's table
    # a training forward keeps a view of the table for mjp_aux_loss: copies and pickles drop it
    assert clone.patch_embed.__dict__["_mjp_kept_rows"].rows is None


def test_distilled_heads_both_train():
    model = mjp_timm.convert(_plain("distilled"), **SETTINGS).train()
    model.set_distilled_training(True)
    logits, distilled = model(_images())
    (F.cross_entropy(logits, torch.tensor([0, 1])) + F.cross_entropy(distilled, torch.tensor([2, 3]))).backward()
    assert model.cls_token.shape[1] == 2 and model.cls_token.grad[:, 1].abs().sum() > 0
    checks.assert_every_parameter_has_a_grad(model)


# --- issue 40 item 5: timm's own model checks on a registered mjp_ PiT -------------------------------------------

REGISTERED = "pit_ti_224"
MJP = dict(mjp_ratio=0.5, mjp_prob=1.0)


def _create(**keywords) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(register(REGISTERED), pretrained=False, **{**TINY, **MJP, **keywords})


def test_registered_forward_and_backward_reach_every_parameter():
    model = _create().train()
    assert isinstance(model, MJPPoolingVisionTransformer)
    assert model.pretrained_cfg["architecture"] == f"mjp_{REGISTERED}"
    out = model(_images())
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.mean().backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert not missing, missing
    assert model.mjp.unk_embed.grad.abs().sum() > 0 and model.mjp.last_dal_loss is not None


def test_registered_forward_features_head_and_intermediates():
    model = _create().eval()
    images = _images()
    with torch.no_grad():
        features = model.forward_features(images)
        torch.testing.assert_close(model.forward_head(features), model(images))
        final, intermediates = model.forward_intermediates(images, indices=2)
    assert [tuple(feature.shape) for feature in intermediates] == [(2, 16, 8, 8), (2, 16, 4, 4)]
    torch.testing.assert_close(final, features)


def test_registered_features_only():
    model = _create(features_only=True, out_indices=(0, 1, 2)).train()
    features = model(_images())
    assert [tuple(feature.shape[-2:]) for feature in features] == [(15, 15), (8, 8), (4, 4)]
    sum(feature.mean() for feature in features).backward()
    assert model.mjp.unk_embed.grad is not None


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
def test_registered_fx_feature_extractor_equals_eager():
    model = _create().eval()
    train_nodes, eval_nodes = get_graph_node_names(model)
    assert any("mjp" in node for node in train_nodes) and not any("mjp" in node for node in eval_nodes)
    extractor = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(extractor(images)[eval_nodes[-1]], model(images))
