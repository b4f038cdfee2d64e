"""The attack of the report: a trained timm ViT's weights in the analytic attack's layout, and the fallback."""

import timm
import torch

import mjp_fast.timm  # noqa: F401  (registers the mjp_* models)
from mjp_fast.privacy.april import april_attack
from mjp_fast.privacy.metrics import psnr
from mjp_fast.privacy.model import client_gradients
from mjp_fast.privacy.settings import run_settings, setting_metrics
from mjp_fast.reproduce.attack import fresh_attack_model, trained_attack_model

# 8 px in 2-pixel patches: 16 patches, 17 tokens; width 32 covers them and a patch's 12 values
SMALL = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 3}


def _trained(name: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, **{**SMALL, **changes}).eval()
    with torch.no_grad():  # as if trained: position embeddings, class token and norms away from their init
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def test_trained_weights_in_the_attack_layout_give_the_same_tokens_and_leak_the_input():
    model = _trained("mjp_deit_tiny_patch16_224", mjp_ratio=0.5, mjp_dal="nonlinear")
    victim, reason = trained_attack_model(model)
    assert reason == "" and victim is not None and victim.blocks[0].attack_layout
    images = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        expected = model._pos_embed(model.patch_embed(images))  # timm's first-layer tokens
        tokens = victim.tokens(images.double())
    torch.testing.assert_close(tokens.float(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(victim.unk_embed.float(), model.mjp.unk_embed.detach())
    # the plain update gives the image back; with UNK at ratio 0.5 it does not
    gradients = client_gradients(victim, images[:1].double(), 1)
    assert psnr(april_attack(victim, gradients).clamp(0, 1), images[:1].double()).item() > 40
    attacks = run_settings(victim, images.double(), april_attack, ratio=0.5, seed=0, labels=[0, 1])
    jigsawed = [attack.mask.sum() >= 2 for attack in attacks]  # block masks on a 4x4 grid can come out empty
    assert any(jigsawed)
    for moved, value in zip(jigsawed, setting_metrics(attacks, ("psnr",))["c"]["psnr"], strict=True):
        assert value < 25 or not moved


def test_models_the_analytic_attack_cannot_take_say_why():
    narrow = _trained("deit_tiny_patch16_224", embed_dim=16)
    victim, reason = trained_attack_model(narrow)
    # the numbers are the trained models' own (8 px in 2-pixel patches), not those of the attack's fallback model
    assert victim is None and "at 8 px in 2-pixel patches (17 tokens: a 4x4 grid" in reason
    assert "12 values a patch), are 16 wide" in reason
    no_positions = _trained("deit_tiny_patch16_224", pos_embed="none")
    assert trained_attack_model(no_positions)[0] is None
    fresh = fresh_attack_model(32, 2, 10, depth=1, seed=0)
    assert fresh.pos_embed.shape[-1] == 272 and fresh.img_size == 32 and fresh.pos_embed.dtype == torch.float64


def test_the_fallback_says_its_own_tokens_and_the_trained_models(cifar_sample):
    # The fallback model takes CIFAR's 32 px (257 tokens); the trained models' numbers (8 px: 17 tokens) are theirs.
    from mjp_fast.reproduce.attack import run_attack

    narrow = _trained("deit_tiny_patch16_224", embed_dim=16)
    attack = run_attack(
        narrow, narrow, data=cifar_sample, split="test", images=1, ratios=[0.5], seed=0, fallback_depth=1,
        patch_size=2,
    )  # fmt: skip
    assert attack["mode"] == "fresh" and attack["image_size"] == 32
    description = attack["description"]
    assert description.startswith("a freshly initialised PrivacyViT (272 wide for its 257 tokens, 1 block, patch 2)")
    assert "the trained models, at 8 px in 2-pixel patches (17 tokens: a 4x4 grid" in description
    # APRIL beside the attacker who knows MJP, on the same model and image, the prior from the training split
    comparison = attack["comparison"]
    assert set(comparison["ratios"]) == {"0.03", "0.1", "0.27", "0.5", "0.75"}
    assert attack["prior"] == {"split": "train", "images": 50}
    # one block: the gradient rows are nearly parallel and neither attack is exact (about 27 dB); they agree
    plain = comparison["plain"]
    assert abs(plain["adaptive"]["psnr"][0] - plain["april"]["psnr"][0]) < 3
    assert set(attack["batches"]["sizes"]) == {"1", "2", "4"}


def test_refresh_report_refuses_what_it_cannot_rebuild(tmp_path):
    import json

    import pytest

    from mjp_fast.reproduce.attack import refresh_report
    from mjp_fast.reproduce.report import adaptive_psnr

    report = tmp_path / "reproduction.md"
    (tmp_path / "reproduction.json").write_text(json.dumps({"attack": None}))
    with pytest.raises(ValueError, match="no attack section"):
        refresh_report(report)
    (tmp_path / "reproduction.json").write_text(json.dumps({"attack": {"mode": "trained"}}))
    with pytest.raises(ValueError, match="trained models"):
        refresh_report(report)
    attack = {"ratios": {"0.03": {"ratio": 0.03}}}
    assert adaptive_psnr(attack) is None
    attack["comparison"] = {"ratios": {"0.03": {"modes": {"per_sample": {"unk": {"adaptive": {"psnr": [20.0]}}}}}}}
    assert adaptive_psnr(attack) == [20.0]
