"""MJP's token path for timm's Qwen3 vision models (mjp_fast/timm/qwen3_vit.py, issue 40 item 1): convert (the
classifier, with and without the merge pool, and the encoder), eval equal to timm's, a training step whose output
alone reaches every parameter (DAL attached), ``mjp_eval``, the step against a pure-torch expectation at the table's
grid and at another (the table resampled), DAL on the stored table, FX, ``forward_intermediates`` and
``features_only``, checkpoints both ways and pickling, the refusals, and the coverage sweep's check."""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch

pytest.importorskip("timm.models.qwen3_vit", reason="this timm has no Qwen3 ViT (timm.models.qwen3_vit: 1.0.30+)")

from timm.models import create_feature_extractor  # noqa: E402

import mjp_fast.timm as mjp_timm  # noqa: E402
from bench.timm_coverage import check_model  # noqa: E402
from mjp_fast.timm.qwen3_vit import MJPQwen3Encoder, MJPQwen3Model  # noqa: E402

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
    assert model.mjp.patch_size == 8 and model.mjp.sampler.grid_size == (4, 4)  # the table's grid
    assert model.mjp.unk_embed is not None and model.mjp.unk_embed.shape[-1] == 16
    assert model.mjp.dal_regressor is not None and "mjp.unk_embed" in model.no_weight_decay()
    assert not mjp_timm.convert.__globals__["runs_fused"](model)
    images = _images()
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(images)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=0)
    model.train()
    model(images).square().mean().backward()  # the output alone: DAL rides on it
    missing = [key for key, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert model.mjp.last_dal_loss is not None and model.mjp.last_jigsaw.mask.shape == (2, 16)
    assert model.mjp.last_jigsaw.mask.any() and model.mjp.unk_embed.grad.abs().sum() > 0
    assert any(p.grad.abs().sum() > 0 for p in model.mjp.dal_regressor.parameters())
    claimed = model.mjp_aux_loss()  # the loss the forward attached, handed out once
    assert torch.equal(claimed, model.mjp.last_dal_loss)
    torch.testing.assert_close(model.mjp_aux_loss(), claimed)  # then computed again: the same table and mask
    model.eval()
    with torch.no_grad(), model.mjp_eval(ratio=0.5, seed=0):
        jigsawed = model(images)
    assert model.mjp.last_jigsaw.mask.any() and (jigsawed - expected).abs().max() > 1e-4
    with torch.no_grad():  # outside mjp_eval: timm's again
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)


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
    plain = copy.deepcopy(wrapper).eval()
    model = mjp_timm.convert(wrapper, **SETTINGS).eval()
    assert model.mjp is model.model.mjp and isinstance(model.model, MJPQwen3Model)
    images = _images()
    with torch.no_grad():
        for got, expected in zip(model(images), plain(images), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with model.mjp_eval(ratio=0.5):
            jigsawed = model(images)
    assert jigsawed[0].shape == (2, 16, 4, 4) and not torch.allclose(jigsawed[0], plain(images)[0])
    model.train()
    sum(feature.square().mean() for feature in model(images)).backward()
    assert model.model.mjp.unk_embed.grad is not None and model.model.mjp.last_dal_loss is not None
    converted = mjp_timm.convert(_plain(), **SETTINGS).eval()
    with torch.no_grad():
        final, intermediates = converted.forward_intermediates(images, indices=2)
        expected_final, expected = _plain().eval().forward_intermediates(images, indices=2)
        torch.testing.assert_close(final, expected_final, rtol=0, atol=0)
        with converted.mjp_eval(ratio=0.5, seed=1):
            _, jigsawed = converted.forward_intermediates(images, indices=2)
    assert len(intermediates) == 2 and converted.mjp.last_jigsaw.mask.any()
    assert not torch.allclose(jigsawed[0], expected[0])


@pytest.mark.parametrize("kind", ["classifier", "encoder"])
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
    model(images)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    encoder = loaded if kind == "encoder" else loaded.encoder
    assert isinstance(encoder, MJPQwen3Encoder) and encoder.__dict__["_mjp_state"] is loaded.mjp
    with torch.no_grad(), model.mjp_eval(seed=2), loaded.mjp_eval(seed=2):
        assert torch.equal(loaded(images), model(images))
    copied = copy.deepcopy(model)
    encoder = copied if kind == "encoder" else copied.encoder
    assert encoder.__dict__["_mjp_state"] is copied.mjp


def test_refusals():
    with pytest.raises(ValueError, match=r"fused_patch_embed=True: Qwen3's patch embedding returns channels-last"):
        mjp_timm.convert(_plain(), fused_patch_embed=True)
    with pytest.raises(ValueError, match=r"pixel_jigsaw=True: model .*Qwen3VitClassifier.* token path covers"):
        mjp_timm.convert(_plain(), pixel_jigsaw=True)


def test_the_coverage_sweep_check_passes():
    record = check_model("qwen3_vit_88m", TINY, 32)
    assert record["ok"], f"{record['steps']}\n{record.get('traceback', '')}"
    assert (record["path"], record["patch_size"], record["fused"]) == ("token", 8, False)
    assert record["mjp"].startswith("UNK on the table") and record["mjp_eval_jigsawed"] is True
