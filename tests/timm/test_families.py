"""One small model of each timm ViT family through the coverage sweep's checks (bench/timm_coverage.py), then
the README's promise as a user runs it: ``mjp train model=<family's model>`` and ``mjp eval`` on the embedded
default."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import timm
import torch

import mjp_fast.timm as mjp_timm
from bench.timm_coverage import EXAMPLES, check_model, render, small_models
from mjp_fast import jigsaw_images

# What MJP must do in each family (the coverage table's words), and whether the embedding runs fused.
EXPECTED = {
    "ViT, class token": ("UNK on the table", True),
    "ViT, registers, global pool": ("UNK on the table", True),
    "ViT, no_embed_class (DeiT III)": ("UNK on the table", True),
    "ViT at 518 px (DINOv2)": ("UNK on the table", True),
    "ViT, dynamic_img_size": ("UNK on the table", True),
    "ViT, hybrid (ResNet stem)": ("pixel jigsaw + UNK on the table", False),
    "distilled DeiT": ("UNK on the table", True),
    "EVA-02 (table + RoPE)": ("UNK on the table + RoPE identity", True),
    "RoPE ViT": ("RoPE identity + UNK on the tokens", False),
    "RoPE ViT, mixed + table": ("UNK on the table + RoPE identity", True),
    "DINOv3": ("RoPE identity + UNK on the tokens", False),
    "PE core": ("UNK on the table + RoPE identity", True),
    "relative-position ViT": ("pixel jigsaw", False),
    "BEiT": ("pixel jigsaw", False),
}


def test_every_family_has_an_expectation():
    assert EXPECTED.keys() == EXAMPLES.keys()


@pytest.mark.parametrize("family", list(EXAMPLES))
def test_each_family_trains_a_step_and_evaluates(family):
    name, overrides, side = EXAMPLES[family]
    record = check_model(name, overrides, side)
    assert record["ok"], f"{family}: {record['steps']}\n{record.get('traceback', '')}"
    assert (record["mjp"], record["fused"]) == EXPECTED[family]


def test_the_518_pixel_model_samples_on_its_own_grid():
    model = mjp_timm.convert(
        timm.create_model("vit_small_patch14_reg4_dinov2", embed_dim=32, depth=1, num_heads=2), ratio=0.3, prob=1.0
    )
    model.train()
    model(torch.randn(1, 3, 518, 518))
    assert model.mjp.last_jigsaw.mask.shape == (1, 37 * 37)


def test_distilled_deit_takes_both_prefix_tokens_fused_or_not():
    plain = timm.create_model(
        "deit_tiny_distilled_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2
    )
    images = torch.randn(3, 3, 32, 32)
    plain.eval()
    expected = plain.forward_features(images)
    for fused in (True, False):
        model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, fused_patch_embed=fused, min_block=2)
        assert mjp_timm.is_fused(model.patch_embed) == fused
        model.eval()
        torch.testing.assert_close(model.forward_features(images), expected)
        model.train()
        # class and distillation tokens in front, with their own position rows: untouched by the jigsaw
        prefix = torch.cat((plain.cls_token, plain.dist_token), dim=1) + plain.pos_embed[:, :2]
        embedded = model._pos_embed(model.patch_embed(images))
        torch.testing.assert_close(embedded[:, :2], prefix.expand(3, -1, -1))
        assert model.mjp.last_jigsaw.mask.any()  # and the patch tokens were jigsawed
        model.set_distilled_training(True)
        logits, distilled = model(images)  # two heads, both trained
        (logits.sum() + distilled.sum() + model.mjp_aux_loss()).backward()
        assert model.dist_token.grad is not None and model.head_dist.weight.grad is not None
    fast = mjp_timm.fast_patch_embed(copy.deepcopy(plain))
    torch.testing.assert_close(fast.forward_features(images), expected)


def test_a_hybrid_vit_jigsaws_its_images_and_gives_the_masked_tokens_unk():
    # A CNN stem's tokens see across their patches' borders: the images are jigsawed, one block per token (32 px
    # here: 64 px over a 2x2 grid), and the tokens, in jigsaw order from the stem, get unk_embed where masked.
    plain = timm.create_model("vit_small_resnet26d_224", img_size=64, depth=1, num_classes=10)
    model = mjp_timm.convert(copy.deepcopy(plain), ratio=0.5, prob=1.0, min_block=2)
    assert model.mjp.patch_size == 32 and len(model.state_dict()) == len(plain.state_dict()) + 6
    images = torch.randn(2, 3, 64, 64)
    model.train(), plain.train()  # BatchNorm in the stem: batch statistics on both sides
    tokens = model._pos_embed(model.patch_embed(images))
    jigsaw = model.mjp.last_jigsaw
    assert jigsaw.mask.any()
    embedded = plain.patch_embed(jigsaw_images(images, jigsaw, 32))
    rows = torch.where(jigsaw.mask[..., None], model.mjp.unk_embed, plain.pos_embed[:, 1:])
    expected = torch.cat(((plain.cls_token + plain.pos_embed[:, :1]).expand(2, -1, -1), embedded + rows), dim=1)
    torch.testing.assert_close(tokens, expected)
    copied = copy.deepcopy(model)  # the embedding's state is the copy's own
    assert copied.patch_embed.__dict__["_mjp_state"] is copied.mjp
    model.eval(), plain.eval()
    torch.testing.assert_close(model(images), plain(images))


def test_pixel_space_families_warn_once_when_dal_is_asked_for():
    model = timm.create_model(
        "vit_relpos_small_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = mjp_timm.convert(copy.deepcopy(model))  # dal="auto": nothing to say
        assert not caught
        mjp_timm.convert(copy.deepcopy(model), dal="linear")
    assert len(caught) == 1
    assert "vit_relpos_small_patch16_224" in str(caught[0].message) and "pixel-space" in str(caught[0].message)
    assert converted.mjp.dal_regressor is None and isinstance(converted, mjp_timm.MJPVisionTransformerRelPos)


def test_a_model_without_patch_tokens_is_refused_by_name():
    with pytest.raises(TypeError, match="supports timm .*Eva.*; got Linear"):
        mjp_timm.convert(torch.nn.Linear(3, 3))


def test_the_sweep_lists_the_families_and_renders_a_table():
    names = small_models()
    for family_member in ("deit_tiny_distilled_patch16_224", "eva02_tiny_patch14_224", "vit_relpos_small_patch16_224"):
        assert family_member in names
    record = check_model(*EXAMPLES["RoPE ViT"])
    page = render([record], dict(timm="1", torch="2", device="cpu", backend="cpu", depth_note="x", date="today"))
    assert "| `Eva` | RoPE identity + UNK on the tokens | no | `vit_small_patch16_rope_224` |" in page
    assert "1 of 1 models pass" in page


@pytest.mark.parametrize(
    "model_name",
    [
        "deit_tiny_distilled_patch16_224",
        "eva02_tiny_patch14_224",
        "vit_small_patch16_dinov3",
        "vit_relpos_small_patch16_224",
    ],
)
@pytest.mark.slow
def test_mjp_train_and_eval_run_an_epoch_of_the_embedded_default(model_name, tmp_path):
    # As a user types it: the embedded default (digits, 8 px, patch 2) with another family's model, then mjp eval.
    output = tmp_path / "run"
    command = [sys.executable, "-m", "mjp_fast.cli", "train", "--output", str(output), f"model={model_name}"]
    command += ["epochs=1", "warmup_epochs=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Total" in done.stdout
    results = tmp_path / "eval.json"
    evaluate = [sys.executable, "-m", "mjp_fast.cli", "eval", "--checkpoint", str(output / "mjp" / "last.pt")]
    evaluate += ["--baseline", str(output / "baseline" / "last.pt"), "--json", str(results)]
    done = subprocess.run(evaluate, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = json.loads(results.read_text())
    assert 0.0 <= metrics["top1"] <= 100.0 and 0.0 <= metrics["consistency"] <= 100.0
