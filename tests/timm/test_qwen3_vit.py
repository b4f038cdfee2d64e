"""MJP's token path for timm's Qwen3 vision models (mjp_fast/timm/qwen3_vit.py, issue 40 item 1): convert (the
classifier, with and without the merge pool, and the encoder), eval equal to timm's, a training step whose output
alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch expectation at the table's
grid and at another (the table resampled), DAL on the stored table, FX, ``forward_intermediates`` and
``features_only``, checkpoints both ways and pickling, the refusals, and the coverage sweep's check."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

pytest.importorskip("timm.models.qwen3_vit", reason="this timm has no Qwen3 ViT (timm.models.qwen3_vit: 1.0.30+)")

from timm.models import create_feature_extractor  # noqa: E402

import mjp_fast.timm as mjp_timm  # noqa: E402
from mjp_fast.timm.qwen3_vit import MJPQwen3Encoder, MJPQwen3Model  # noqa: E402
from tests.timm import front_end_checks as checks  # noqa: E402

# Patches of 8 pixels and a 4x4 table: 32 px images are the table's grid, 48 px another (6x6, resampled).
TINY = dict(embed_dim=16, depth=2, num_heads=2, pos_embed_grid_size=4, patch_size=8, img_size=32)
MODELS = {"classifier": "qwen3_vit_88m", "merge": "qwen3_vit_88m_merge", "encoder": "qwen3_vit_88m_enc"}
SETTINGS = dict(ratio=0.3, prob=1.0, min_block=2)


def _plain(kind: str = "classifier", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = dict(out_features=24) if kind != "classifier" else {}
    if kind != "encoder":
        extra["num_classes"] = 5
    return timm.create_model(MODELS[kind], pretrained=False, **{**TINY, **extra, **overrides})


def _images(batch: int = 2, side: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MODELS))
def test_convert_eval_train_and_mjp_eval(kind):
    plain = _plain(kind)
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS)
    encoder = model if kind == "encoder" else model.encoder
    assert isinstance(model, MJPQwen3Model) and isinstance(encoder, MJPQwen3Encoder) and isinstance(model, type(plain))
    checks.assert_token_path_state(model, patch_size=8, grid=(4, 4), dim=16)  # the table's grid
    images = _images()
    expected = checks.assert_eval_equals_timm(model, plain, images)
    checks.assert_training_step_reaches_every_parameter(
        model, images, loss=lambda out: out.square().mean(), tables=[encoder.pos_embed]
    )
    assert model.mjp.last_jigsaw.mask.shape == (2, 16)
    checks.assert_aux_loss_handed_out_once(model)  # then computed again: the same table and mask
    checks.assert_mjp_eval_jigsaws(model, plain, images, expected, min_change=1e-4)


def _table_ref(plain: torch.nn.Module, rows: int, cols: int) -> torch.Tensor:
    """Qwen3's table resampled to a ``rows x cols`` grid in plain torch: bilinear, corners aligned. ``[1, N, D]``."""
    table = plain.encoder.pos_embed.reshape(1, 4, 4, 16).permute(0, 3, 1, 2)
    resampled = torch.nn.functional.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=True)
    return resampled.flatten(2).transpose(1, 2)


@pytest.mark.parametrize("side", [32, 48])  # the table's grid, and another: resampled
def test_the_step_moves_the_tokens_with_unk_at_the_masked_positions(side):
    model = mjp_timm.convert(_plain(), **SETTINGS).eval()
    images = _images(side=side)
    encoder = model.encoder
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=3):
        got, rope = encoder._pos_embed(encoder.patch_embed(images))
        jigsaw = model.mjp.last_jigsaw
    grid = side // 8
    assert got.shape == (2, grid * grid, 16) and 0 < int(jigsaw.mask.sum()) < jigsaw.mask.numel()
    plain = _plain().eval()
    with torch.no_grad():
        conv = plain.encoder.patch_embed.proj
        tokens = torch.nn.functional.conv2d(images, conv.weight, conv.bias, stride=8).flatten(2).transpose(1, 2)
        tokens = tokens.gather(1, jigsaw.perm.unsqueeze(-1).expand(-1, -1, 16))
        table = _table_ref(plain, grid, grid).expand_as(tokens)
        _, expected_rope = plain.encoder._pos_embed(plain.encoder.patch_embed(images))
    expected = tokens + torch.where(jigsaw.mask.unsqueeze(-1), model.mjp.unk_embed.expand_as(tokens), table)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope, expected_rope, rtol=0, atol=0)  # the slots' rotations: timm's


@pytest.mark.parametrize(("side", "masked_rows_left_out"), [(32, True), (48, False)])
def test_dal_regresses_the_stored_table(side, masked_rows_left_out):
    model = mjp_timm.convert(_plain(), **SETTINGS).train()
    model(_images(side=side))
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.any()
    with torch.no_grad():
        coords = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(16, 2)
        per_position = (model.mjp.dal_regressor(model.encoder.pos_embed[0]) - coords).abs().mean(-1)
        if masked_rows_left_out:  # the input's grid is the table's: the masked rows are left out
            kept = (~jigsaw.mask).sum(0).float()
            expected = (per_position * kept).sum() / kept.sum()
        else:  # another grid: its masked positions are no row of the table, every row counts
            expected = per_position.mean()
    torch.testing.assert_close(model.mjp.last_dal_loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("training", [False, True])
def test_timm_feature_extractor_graphs(training):
    model = mjp_timm.convert(_plain(), **SETTINGS).train(training)
    graph = create_feature_extractor(model, return_nodes={"encoder.blocks.0": "block", "head": "logits"})
    targets = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert targets.count("mjp") == (1 if training else 0)
    for side in (32, 48):  # the graph resamples the table per input, as timm's
        images = _images(side=side)
        with torch.no_grad():
            out = graph(images)
        assert out["logits"].shape == (2, 5) and out["block"].shape == (2, (side // 8) ** 2, 16)
        if training:
            assert model.mjp.last_jigsaw.mask.any()
        else:
            torch.testing.assert_close(out["logits"], _plain().eval()(images), rtol=0, atol=0)


def test_forward_intermediates_and_features_only():
    torch.manual_seed(0)
    wrapper = timm.create_model("qwen3_vit_88m", features_only=True, out_indices=(0, 1), num_classes=5, **TINY)
    images = _images()
    model = checks.assert_features_only(wrapper, images, SETTINGS, shape=(2, 16, 4, 4))
    assert isinstance(model.model, MJPQwen3Model)
    converted = mjp_timm.convert(_plain(), **SETTINGS)
    checks.assert_forward_intermediates(_plain(), converted, images, shapes=[(4, 4), (4, 4)], seed=1, indices=2)


@pytest.mark.parametrize("kind", ["classifier", "encoder"])
def test_checkpoints_both_ways_and_pickling(kind):
    plain = _plain(kind).eval()
    model = mjp_timm.convert(copy.deepcopy(plain), **SETTINGS).eval()
    images = _images()
    checks.assert_checkpoints_both_ways(plain, model, lambda: _plain(kind), images)
    checks.assert_pickles_and_copies(model, images, lambda clone: _check_clone(clone, kind))


def _check_clone(clone: torch.nn.Module, kind: str) -> None:
    encoder = clone if kind == "encoder" else clone.encoder
    assert isinstance(encoder, MJPQwen3Encoder) and encoder.__dict__["_mjp_state"] is clone.mjp


def test_refusals():
    checks.assert_refuses_fused_and_pixel_jigsaw(
        _plain, fused=r"Qwen3's patch embedding returns channels-last", model="Qwen3VitClassifier"
    )


def test_the_coverage_sweep_check_passes():
    checks.assert_coverage_sweep_passes("qwen3_vit_88m", TINY, 32, patch_size=8)
