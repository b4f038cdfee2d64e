"""MJP's token path for timm's Visformer (mjp_fast/timm/visformer.py, issue 40 item 1): convert, eval equal to timm's,
a training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch
expectation (the stem of the images jigsawed in 8-pixel blocks, or the moved tokens without a stem; ``unk_embed`` at
the masked positions, ``pos_embed1``'s rows elsewhere), DAL on those rows, FX (plain and timm's feature extractor),
``forward_intermediates``, ``features_only``, checkpoints both ways and pickling, the refusals, a Visformer without
tables (the pixel jigsaw), and the coverage sweep's check."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models._features_fx import create_feature_extractor
from timm.models.visformer import Visformer, _create_visformer
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.visformer import MJPVisformer, VisformerPatchEmbed, covers
from tests.timm import front_end_checks as checks

# visformer_tiny's layout at width 16, one block per stage. With the stem (kernel 7, stride 2, padding 3) and
# patch_embed1 (4 at stride 4) a token is a block of 8 pixels: a 6x6 grid on 48 px; on 52 px the blocks cover the
# top-left 48x48 and a 4-px strip stays. Without a stem (init_channels=None: timm's create_model drops None-valued
# keywords, so _create_visformer) patch_embed1 cuts 8-px patches of the images, then its BatchNorm.
TINY = dict(
    img_size=48, embed_dim=16, depth=(1, 1, 1), num_heads=2, mlp_ratio=2.0, group=8, attn_stage="011",
    spatial_conv="100", norm_layer=nn.BatchNorm2d, conv_init=True, embed_norm=nn.BatchNorm2d, num_classes=5,
)  # fmt: skip
MODELS = {
    "stem": dict(TINY, init_channels=8),
    "margin": dict(TINY, init_channels=8, img_size=52),
    "no_stem": dict(TINY, init_channels=None),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions
NEEDS_INTERMEDIATES = pytest.mark.skipif(
    not hasattr(Visformer, "forward_intermediates"),
    reason=f"timm {timm.__version__}'s Visformer has no forward_intermediates nor features_only (timm 1.0.31 has)",
)
NEEDS_FEATURE_INFO = pytest.mark.skipif(
    not hasattr(_create_visformer("visformer_tiny", pretrained=False, **MODELS["stem"]), "feature_info"),
    reason=f"timm {timm.__version__}'s Visformer publishes no feature_info (the pixel jigsaw's stride; 1.0.31 does)",
)


def _plain(kind: str = "stem", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _create_visformer("visformer_tiny", pretrained=False, **{**MODELS[kind], **overrides})
    with torch.no_grad():  # trained-like BatchNorm statistics, so that eval mode is not the identity on them
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    return model


def _side(kind: str) -> int:
    return MODELS[kind]["img_size"]


def _images(kind: str = "stem", batch: int = 2) -> torch.Tensor:
    side = _side(kind)
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPVisformer) and isinstance(model.patch_embed1, VisformerPatchEmbed)
    checks.assert_token_path_state(model, patch_size=8, grid=(6, 6))
    images = _images(kind)
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed1])
    plain.load_state_dict(model.state_dict(), strict=False)  # the BatchNorm statistics of the training forward
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_is_unk_on_the_table_of_the_jigsawed_patches(kind):
    """Inside mjp_eval, the map stage 1 gets is timm's stem and patch_embed1 of the images whose top-left 8-px blocks
    were jigsawed (the margin untouched) or, without a stem, timm's tokens moved; plus ``unk_embed`` at the masked
    positions and ``pos_embed1``'s own row elsewhere (within the rounding of timm's ``+ pos_embed1`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    plain = _plain(kind).eval()
    images = _images(kind)
    stem = model.stem if model.stem is not None else nn.Identity()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.pos_drop(model.patch_embed1(stem(images)) + model.pos_embed1)
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 36) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(36)).any()
    plain_stem = plain.stem if plain.stem is not None else nn.Identity()
    with torch.no_grad():
        if kind == "no_stem":  # each token its own patch's: the tokens themselves moved
            tokens = plain.patch_embed1(images).flatten(2)
            tokens = torch.stack([tokens[b][:, jigsaw.perm[b]] for b in range(2)]).unflatten(2, (6, 6))
        else:
            tokens = plain.patch_embed1(plain_stem(checks.jigsaw_ref(images, jigsaw.perm, 6, 6, 8)))
    mask = jigsaw.mask.reshape(2, 1, 6, 6)
    unk = model.mjp.unk_embed.reshape(1, -1, 1, 1).expand_as(tokens)
    expected = tokens + torch.where(mask, unk, model.pos_embed1.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_margin_outside_the_blocks_is_not_moved():
    """On 52 px the 6x6 blocks of 8 px cover the top-left 48x48: the 4-px strip at the bottom and right reaches the
    stem as it was. With a first convolution that reads only its bottom-right tap (stem pixel (i, j) reads pixel
    (2i + 3, 2j + 3)), the stem's last row and column read only that strip, and are the same inside mjp_eval."""
    model = mjp_timm.convert(_plain("margin"), **SETTINGS).eval()
    conv = model.stem[0]
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 6, 6] = 1.0
    images = _images("margin")
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        jigsawed = model.stem(images)
    with torch.no_grad():
        plain = model.stem(images)
    assert jigsawed.shape[-1] == 26  # stem pixels 24 and 25 read pixels 51 and 53 (padding): the strip only
    torch.testing.assert_close(jigsawed[..., 24:, :], plain[..., 24:, :], rtol=0, atol=0)
    torch.testing.assert_close(jigsawed[..., :, 24:], plain[..., :, 24:], rtol=0, atol=0)
    assert not torch.equal(jigsawed, plain)


def _dal_of_the_tables_rows(model: torch.nn.Module) -> torch.Tensor:
    table_rows = model.pos_embed1.permute(0, 2, 3, 1).reshape(1, 36, -1)  # row-major, [1, N, D]
    return mjp_fast.dal_loss(table_rows, model.mjp.dal_regressor, (6, 6), model.mjp.last_jigsaw.mask, backend="torch")


def test_dal_regresses_the_tables_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain(), **SETTINGS)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_tables_rows)


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _plain, fused=r"Visformer's patch_embed1 writes an NCHW map", model="Visformer"
    )
    overlapping = _plain()
    overlapping.patch_embed1.proj.stride = (2, 2)
    with pytest.raises(ValueError, match=r"patch_embed1's kernel \(4, 4\) and stride \(2, 2\)"):
        mjp_timm.convert(overlapping)
    normed = _plain("no_stem")
    normed.patch_embed1.norm = nn.GroupNorm(1, 8)
    with pytest.raises(ValueError, match=r"patch_embed1's norm is a GroupNorm: without a stem MJP moves"):
        mjp_timm.convert(normed)
    assert isinstance(mjp_timm.convert(_plain(), fused_patch_embed=False), MJPVisformer)


@NEEDS_FEATURE_INFO
def test_a_visformer_without_tables_gets_the_pixel_jigsaw():
    plain = _plain(use_pos_embed=False)
    assert plain.pos_embed1 is None and not covers(plain)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert not isinstance(model, MJPVisformer) and isinstance(model, Visformer)
    assert model.mjp.unk_embed is None and model.mjp.dal_regressor is None and model.mjp.patch_size == 8
    images = _images()
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5, seed=0):
            assert not torch.allclose(model(images), plain(images)) and model.mjp.last_jigsaw.mask.any()


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    images = _images()
    # in training: the images' jigsaw, then the step on the tokens
    checks.assert_fx_graph_is_the_model(model, images, checks.TimmLeafTracer(), mjp_nodes=2, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"stage1": "stage1", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["stage1"].shape == (2, 8, 6, 6) and features["norm"].shape == (2, 32, 1, 1)


@NEEDS_INTERMEDIATES
def test_forward_intermediates():
    plain = _plain()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(6, 6), (3, 3), (1, 1)])


@NEEDS_INTERMEDIATES
def test_features_only():
    torch.manual_seed(0)
    wrapper = _create_visformer("visformer_tiny", pretrained=False, features_only=True, **MODELS["stem"])
    model = checks.assert_features_only(wrapper, _images(), SETTINGS)
    assert isinstance(model.model, MJPVisformer)


@pytest.mark.parametrize("kind", ["stem", "no_stem"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images(kind)
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    _, copied = checks.assert_pickles_and_copies(model, images, _check_clone)
    assert copied.pos_embed1.grad is not None


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.patch_embed1.__dict__["_mjp_model"] is clone  # the clone's embedding reads the clone's table
    # a training forward keeps the table's rows for mjp_aux_loss: copies and pickles drop them
    assert clone.patch_embed1.__dict__["_mjp_kept_rows"].rows is None
    if clone.stem is not None:
        assert clone.stem.__dict__["_mjp_state"] is clone.mjp


def test_the_coverage_sweeps_check_passes():
    overrides = dict(img_size=32, embed_dim=16, depth=(1, 1, 1), num_heads=2, init_channels=8)
    checks.assert_coverage_sweep_passes("visformer_tiny", overrides, 32, patch_size=8)
