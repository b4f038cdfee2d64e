"""MJP's token path for timm's VOLO (mjp_fast/timm/volo.py, issue 40 item 1): convert, eval equal to timm's, a
training step whose output alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch
expectation (timm's stem, outlooker and Downsample on the images jigsawed in 16-pixel blocks, ``unk_embed`` at the
masked positions, the table's rows elsewhere), DAL on those rows, FX (plain and timm's feature extractor),
``forward_intermediates``, ``features_only``, checkpoints both ways and pickling, the refusals, and the coverage
sweep's check."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from packaging.version import Version
from timm.models._features_fx import create_feature_extractor
from timm.models.volo import _create_volo

import mjp_fast
import mjp_fast.timm as mjp_timm
from mjp_fast.timm.volo import MJPVOLO
from tests.timm import front_end_checks as checks

# volo_d1's layout at width 16, one block per stage. The stem works at 1/8, the table's grid at 1/16: a 4x4 grid of
# 16-px blocks on 64 px; on 72 px the blocks cover the top-left 64x64 and an 8-px strip stays.
TINY = dict(layers=(1, 1, 1, 1), embed_dims=(16, 16, 16, 16), num_heads=(2, 2, 2, 2), stem_hidden_dim=8, num_classes=5)
MODELS = {
    "volo": dict(TINY, img_size=64),
    "margin": dict(TINY, img_size=72),
    "no_class_token": dict(TINY, img_size=64, post_layers=None, global_pool="avg"),
}
SETTINGS = dict(ratio=0.5, prob=1.0, min_block=1)  # small grids: min_block 1 so that the sampler masks positions


def _plain(kind: str = "volo", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _create_volo("volo_d1_224", pretrained=False, **{**MODELS[kind], **overrides})
    with torch.no_grad():  # timm's init leaves the outputs nearly blind to their input: scaled so that a jigsaw shows
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(5.0)
    return model


def _images(kind: str = "volo", batch: int = 2) -> torch.Tensor:
    side = MODELS[kind]["img_size"]
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    assert isinstance(model, MJPVOLO)
    checks.assert_token_path_state(model, patch_size=16, grid=(4, 4))
    images = _images(kind)
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(model, images, tables=[model.pos_embed])
    plain.load_state_dict(model.state_dict(), strict=False)  # the BatchNorm statistics of the training forward
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=1e-3)


@pytest.mark.parametrize("kind", ["volo", "margin"])
def test_the_step_is_unk_on_the_table_of_the_jigsawed_images(kind):
    """Inside mjp_eval, the tokens timm adds ``pos_embed`` to are timm's stem, outlooker stage and Downsample of the
    images whose top-left 16-px blocks were jigsawed (the strip past them untouched); the sum is those tokens plus
    ``unk_embed`` at the masked positions and the table's own row elsewhere (within the rounding of timm's
    ``+ pos_embed`` after the hook)."""
    model = mjp_timm.convert(_plain(kind), **SETTINGS).eval()
    plain = _plain(kind).eval()
    images = _images(kind)
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got = model.network[1](model.network[0](model.patch_embed(images).permute(0, 2, 3, 1))) + model.pos_embed
        jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.shape == (2, 16) and jigsaw.mask.any() and (jigsaw.perm != torch.arange(16)).any()
    with torch.no_grad():
        stem = plain.patch_embed(checks.jigsaw_ref(images, jigsaw.perm, 4, 4, 16)).permute(0, 2, 3, 1)
        tokens = plain.network[1](plain.network[0](stem))  # [B, 4, 4, D]
    mask = jigsaw.mask.reshape(2, 4, 4, 1)
    unk = model.mjp.unk_embed.reshape(1, 1, 1, -1).expand_as(tokens)
    expected = tokens + torch.where(mask, unk, model.pos_embed.expand_as(tokens))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _dal_of_the_tables_rows(model: torch.nn.Module) -> torch.Tensor:
    table_rows = torch.stack([model.pos_embed[0, i, j] for i in range(4) for j in range(4)]).unsqueeze(0)
    return mjp_fast.dal_loss(table_rows, model.mjp.dal_regressor, (4, 4), model.mjp.last_jigsaw.mask, backend="torch")


def test_dal_regresses_the_tables_rows_and_mjp_aux_loss_replaces_the_attached_weight():
    model = mjp_timm.convert(_plain(), **SETTINGS)
    checks.assert_aux_loss_at_a_weight_replaces_the_attached_one(model, _images(), _dal_of_the_tables_rows)


def test_refusals_name_the_reason():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _plain, fused=r"VOLO's stem is three overlapping convolutions", model="VOLO"
    )
    other = _plain()
    other.network[1] = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"network\[1\] is a Identity, not timm's VOLO Downsample"):
        mjp_timm.convert(other)
    assert isinstance(mjp_timm.convert(_plain(), fused_patch_embed=False), MJPVOLO)


@pytest.mark.filterwarnings("ignore:.*The nodes obtained by tracing the model in")
@pytest.mark.parametrize("training", [False, True])
def test_fx_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    images = _images()
    # in training: the images' jigsaw, then the step on the tokens
    checks.assert_fx_graph_is_the_model(model, images, checks.TimmLeafTracer(), mjp_nodes=2, out_shape=(2, 5))
    extractor = create_feature_extractor(model, return_nodes={"network.2": "stage1", "norm": "norm"})
    with torch.no_grad():
        features = extractor(images)
    assert features["stage1"].shape == (2, 4, 4, 16) and features["norm"].shape == (2, 17, 16)


def test_forward_intermediates():
    plain = _plain()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    checks.assert_forward_intermediates(plain, model, _images(), shapes=[(8, 8), (4, 4), (4, 4), (4, 4)], differs_at=1)


def test_features_only():
    torch.manual_seed(0)
    wrapper = _create_volo("volo_d1_224", pretrained=False, features_only=True, out_indices=(0, 1, 3), **MODELS["volo"])
    model = checks.assert_features_only(wrapper, _images(), SETTINGS, differs_at=1)
    assert isinstance(model.model, MJPVOLO)


@pytest.mark.skipif(
    Version(timm.__version__) < Version("1.0.30"),
    reason=f"timm {timm.__version__} keeps the table of a VOLO pruned before it is added (unused; 1.0.31 drops it)",
)
def test_a_volo_cut_before_its_table_gets_the_pixel_jigsaw():
    torch.manual_seed(0)
    wrapper = _create_volo("volo_d1_224", pretrained=False, features_only=True, out_indices=(0,), **MODELS["volo"])
    assert wrapper.model.pos_embed is None
    model = mjp_timm.convert(wrapper, **SETTINGS)
    assert not isinstance(model.model, MJPVOLO) and model.mjp.unk_embed is None and model.mjp.patch_size == 8


def test_checkpoints_both_ways_and_pickling():
    plain = _plain().eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, _plain, images)
    _, copied = checks.assert_pickles_and_copies(model, images, _check_clone)
    assert copied.pos_embed.grad is not None


def _check_clone(clone: torch.nn.Module) -> None:
    assert clone.network[1].__dict__["_mjp_model"] is clone  # the clone's step reads the clone's table
    assert clone.patch_embed.__dict__["_mjp_state"] is clone.mjp
    # a training forward keeps the table's rows for mjp_aux_loss: copies and pickles drop them
    assert clone.network[1].__dict__["_mjp_kept_rows"].rows is None


def test_the_coverage_sweeps_check_passes():
    checks.assert_coverage_sweep_passes("volo_d1_224", dict(img_size=64), 64, patch_size=16)
