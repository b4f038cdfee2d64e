"""The analytic attack: exact without MJP or without UNK, defeated by MJP's UNK embedding.

On real photos (scikit-image's, and ImageNet samples when ../shared/data is there) with the small model of
``mjp attack``: 64x64, patch 8, width 256, first block in the attack layout, gradients in float64.
"""

import pytest
import torch

import mjp_fast
from mjp_fast.privacy import (
    PrivacyViT,
    april_attack,
    client_gradients,
    invert_patch_embed,
    run_settings,
    setting_metrics,
    solve_tokens,
)


@pytest.fixture(scope="module")
def settings_at(attack_model, photos):
    cache = {}

    def run(ratio):
        if ratio not in cache:
            names, images = photos
            attacks = run_settings(attack_model, images, april_attack, ratio=ratio, seed=0, names=names)
            cache[ratio] = (attacks, setting_metrics(attacks))
        return cache[ratio]

    return run


def test_eq1_holds_for_the_client_gradients(attack_model, photos):
    _, images = photos
    z0 = attack_model.tokens(images[:1])[0].detach()
    grads = client_gradients(attack_model, images[0], 2)
    grad_tokens = torch.cat([grads["cls_token"][0], grads["pos_embed"][0]])
    weight = attack_model.blocks[0].attn.qkv.weight.detach()
    lhs = grad_tokens.t() @ z0
    rhs = weight.t() @ grads["blocks.0.attn.qkv.weight"]
    assert float((lhs - rhs).norm() / rhs.norm()) < 1e-12
    recovered = solve_tokens(grad_tokens, weight, grads["blocks.0.attn.qkv.weight"])
    assert float((recovered - z0).norm() / z0.norm()) < 1e-5


def test_patch_embedding_inverts_exactly(attack_model, photos):
    _, images = photos
    tokens = attack_model.tokens(images[:1])[0, 1:].detach()
    model = attack_model
    image = invert_patch_embed(tokens, model.patch_embed.weight, model.patch_embed.bias, model.pos_embed, (8, 8))
    torch.testing.assert_close(image, images[:1], rtol=0, atol=1e-10)


def test_setting_a_recovers_the_image(settings_at):
    _, metrics = settings_at(0.5)
    assert bool((metrics["a"]["psnr"] > 60).all()), metrics["a"]["psnr"]
    assert bool((metrics["a"]["lpips"] < 1e-3).all())


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_mjp_with_unk_defeats_the_attack(settings_at, ratio):
    _, metrics = settings_at(ratio)
    for setting in ("b", "c"):
        assert bool((metrics[setting]["psnr"] < 15).all()), (setting, metrics[setting]["psnr"])
        assert float(metrics[setting]["lpips"].mean()) > 0.4, (setting, metrics[setting]["lpips"])


def test_shuffled_without_unk_is_recovered(settings_at):
    _, metrics = settings_at(0.5)
    assert bool((metrics["no_unk_b"]["psnr"] > 60).all()), metrics["no_unk_b"]["psnr"]
    # ... and it is the jigsawed image that is recovered, not the original.
    assert bool((metrics["no_unk_c"]["psnr"] < metrics["no_unk_b"]["psnr"] - 40).all())


def test_unk_zeroes_the_masked_rows_of_the_position_gradient(attack_model, photos):
    _, images = photos
    jigsaw = mjp_fast.sample_jigsaw(1, 8, 0.5, seed=3)
    mask = jigsaw.mask[0]
    with_unk = client_gradients(attack_model, images[0], 1, jigsaw)["pos_embed"][0]
    without_unk = client_gradients(attack_model, images[0], 1, jigsaw, use_unk=False)["pos_embed"][0]
    assert int(mask.sum()) > 10
    assert not with_unk[mask].any()
    assert bool((with_unk[~mask].abs().sum(1) > 0).all())
    assert bool((without_unk.abs().sum(1) > 0).all())


def _other_permutation(jigsaw: mjp_fast.Jigsaw, seed: int) -> mjp_fast.Jigsaw:
    """The same mask with another permutation of the masked positions."""
    masked = torch.nonzero(jigsaw.mask[0]).flatten()
    generator = torch.Generator().manual_seed(seed)
    perm = torch.arange(jigsaw.perm.shape[1])
    perm[masked] = masked[torch.randperm(len(masked), generator=generator)]
    assert not torch.equal(perm, jigsaw.perm[0])
    return mjp_fast.Jigsaw(jigsaw.mask, perm[None])


def test_with_unk_the_gradients_do_not_depend_on_the_permutation(attack_model, photos):
    _, images = photos
    jigsaw = mjp_fast.sample_jigsaw(1, 8, 0.5, seed=5)
    other = _other_permutation(jigsaw, seed=1)

    def largest_relative_difference(use_unk: bool) -> float:
        first = client_gradients(attack_model, images[1], 4, jigsaw, use_unk=use_unk)
        second = client_gradients(attack_model, images[1], 4, other, use_unk=use_unk)
        return max(float((first[n] - second[n]).norm() / first[n].norm()) for n in first if first[n].any())

    assert largest_relative_difference(use_unk=True) < 1e-10
    assert largest_relative_difference(use_unk=False) > 1e-3  # without UNK the positions tell the permutation


def test_april_needs_the_attack_layout(photos):
    model = PrivacyViT(img_size=64, patch_size=8, embed_dim=256, depth=1, attack_layout=False).double()
    grads = client_gradients(model, photos[1][0], 0)
    with pytest.raises(ValueError, match="attack_layout=True"):
        april_attack(model, grads)


def test_solve_tokens_checks_shapes():
    with pytest.raises(ValueError, match="grad_qkv_weight"):
        solve_tokens(torch.zeros(5, 8), torch.zeros(24, 8), torch.zeros(24, 7))
    with pytest.raises(ValueError, match="2-D"):
        solve_tokens(torch.zeros(5), torch.zeros(24, 8), torch.zeros(24, 8))
