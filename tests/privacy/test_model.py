"""PrivacyViT: the attack layout makes qkv the only consumer of the tokens; client gradients; the label."""

import pytest
import torch

import mjp_fast
from mjp_fast.privacy import PrivacyViT, client_gradients, infer_label


def _tokens_and_qkv_gradients(model, image, label, jigsaw=None):
    """dL/dz0 and dL/dqkv of the first block, captured with hooks, and the parameter gradients."""
    captured = {}
    original_tokens = model.tokens

    def tokens_hook(*args, **kwargs):
        tokens = original_tokens(*args, **kwargs)
        tokens.retain_grad()
        captured["z0"] = tokens
        return tokens

    def qkv_hook(module, inputs, output):
        output.retain_grad()
        captured["qkv"] = output

    model.tokens = tokens_hook
    handle = model.blocks[0].attn.qkv.register_forward_hook(qkv_hook)
    try:
        logits = model(image, jigsaw)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([label]))
        parameters = dict(model.named_parameters())
        grads = torch.autograd.grad(loss, [*parameters.values(), captured["z0"], captured["qkv"]], allow_unused=True)
    finally:
        handle.remove()
        del model.tokens
    named = dict(zip(parameters, grads[: len(parameters)], strict=True))
    return captured["z0"].detach()[0], grads[-2][0], grads[-1][0], named


def test_attack_layout_position_gradient_is_the_token_gradient(attack_model, photos):
    _, images = photos
    z0, grad_z0, grad_qkv, grads = _tokens_and_qkv_gradients(attack_model, images[:1], 3)
    # pos_embed[n] is added to token 1 + n and used nowhere else; cls_token is token 0.
    torch.testing.assert_close(grads["pos_embed"][0], grad_z0[1:], rtol=1e-12, atol=0)
    torch.testing.assert_close(grads["cls_token"][0, 0], grad_z0[0], rtol=1e-12, atol=0)
    # qkv is z0's only consumer: dL/dz0 = dL/dqkv W, and dL/dW = (dL/dqkv)^T z0.
    weight = attack_model.blocks[0].attn.qkv.weight
    torch.testing.assert_close(grad_z0, grad_qkv @ weight, rtol=1e-10, atol=1e-18)
    torch.testing.assert_close(grads["blocks.0.attn.qkv.weight"], grad_qkv.t() @ z0, rtol=1e-10, atol=1e-18)


def test_standard_layout_has_a_residual_around_attention(photos):
    torch.manual_seed(0)
    model = PrivacyViT(img_size=64, patch_size=8, embed_dim=64, depth=2, attack_layout=False).double()
    _, images = photos
    _, grad_z0, grad_qkv, _ = _tokens_and_qkv_gradients(model, images[:1], 1)
    weight = model.blocks[0].attn.qkv.weight
    assert not torch.allclose(grad_z0, grad_qkv @ weight, rtol=1e-6, atol=0)


def test_model_matches_the_mjp_patch_embedding(attack_model, photos):
    _, images = photos
    jigsaw = mjp_fast.sample_jigsaw(2, 8, 0.5, seed=1)
    tokens = attack_model.tokens(images[:2], jigsaw)
    expected = mjp_fast.ops.mjp_patch_embed_ref(
        images[:2],
        attack_model.patch_embed.weight,
        attack_model.patch_embed.bias,
        attack_model.pos_embed,
        attack_model.unk_embed,
        jigsaw,
    )
    torch.testing.assert_close(tokens[:, 1:], expected, rtol=1e-12, atol=1e-14)
    # Without UNK: the jigsawed picture with pos_embed everywhere.
    shuffled = mjp_fast.jigsaw_images(images[:2], jigsaw, 8)
    plain = attack_model.tokens(shuffled)
    torch.testing.assert_close(attack_model.tokens(images[:2], jigsaw, use_unk=False), plain, rtol=0, atol=0)


def test_client_gradients_cover_every_parameter_and_give_the_label(attack_model, photos):
    _, images = photos
    grads = client_gradients(attack_model, images[0], 7)
    assert set(grads) == {name for name, _ in attack_model.named_parameters()}
    assert all(g.dtype == torch.float64 for g in grads.values())
    assert not grads["unk_embed"].any()  # unused without a jigsaw
    assert infer_label(grads) == 7
    with pytest.raises(ValueError, match="one client image"):
        client_gradients(attack_model, images[:2], 0)
    with pytest.raises(KeyError, match="head_bias"):
        infer_label(grads, head_bias="classifier.bias")


def test_model_rejects_bad_geometry():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        PrivacyViT(img_size=60, patch_size=8)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        PrivacyViT(embed_dim=30, num_heads=4)
