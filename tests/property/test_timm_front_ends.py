"""Property tests of the Eva front end (mjp_fast/timm/eva.py) and the pixel-space front end (mjp_fast/timm/pixel.py)
of :func:`mjp_fast.timm.convert` (issue 42), on tiny timm models of random geometry, settings and backend:

- with the jigsaw off (eval mode, or training at ``prob=0`` or ``ratio=0``) the converted model is timm's model:
  the same output (exactly in eval mode through timm's convolution; within float tolerance where the fused embedding
  sums in another order, and in training, where timm's own forward does not repeat itself bit for bit), no jigsaw
  recorded;
- with the jigsaw on, the output is finite and of timm's shape, the recorded jigsaw (``model.mjp.last_jigsaw``) is
  a valid one for the input's grid, and it is the one the forward applied: an Eva's ``_pos_embed`` gives the
  module docstring's tokens and rotary table for that jigsaw (the patch tokens moved by ``perm``, ``unk_embed`` in
  place of the table row, or added without a table, at the masked positions; no rotation there), and a pixel-space
  model's output is timm's model run on the images jigsawed by it (``jigsaw_images_ref``).
"""

from __future__ import annotations

import copy

import timm
import torch
from hypothesis import given
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import mjp_fast.timm as mjp_timm
from mjp_fast.ops.jigsaw_images import jigsaw_images_ref
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.eva import MJPEva
from mjp_fast.timm.pixel import MJPPixelModel
from tests.conftest import backends_for

BACKENDS = backends_for("cpu")

# ---- Eva

EVA_MODELS = {
    "eva02": "eva02_tiny_patch14_224",  # absolute table (class token row) + cat rope
    "rope": "vit_small_patch16_rope_224",  # cat rope only
    "rope_ape": "vit_small_patch16_rope_ape_224",  # + table, no_embed_class
    "rope_mixed": "vit_small_patch16_rope_mixed_224",  # learnable per-block rope [depth, H, N, E]
    "rope_mixed_ape": "vit_small_patch16_rope_mixed_ape_224",
    "dinov3": "vit_small_patch16_dinov3",  # dinov3 rope, class + 4 register tokens, dynamic_img_size
    "rope_reg4_gap": "vit_betwixt_patch16_rope_reg4_gap_256",  # register tokens, no class token
}


@st.composite
def evas(draw: st.DrawFn) -> dict:
    patch = draw(st.sampled_from((2, 4)))
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return dict(
        key=draw(st.sampled_from(sorted(EVA_MODELS))),
        patch=patch,
        img_size=(rows * patch, cols * patch),
        dim=draw(st.sampled_from((8, 16))),
        depth=draw(st.integers(1, 2)),
        batch=draw(st.integers(1, 3)),
        backend=draw(st.sampled_from(BACKENDS)),
        fused=draw(st.sampled_from((None, False))),  # None: fused where the embedding is timm's standard one
        seed=draw(st.integers(0, 2**16)),
    )


def make_eva(case: dict) -> nn.Module:
    torch.manual_seed(case["seed"])
    return timm.create_model(
        EVA_MODELS[case["key"]], pretrained=False, img_size=case["img_size"], patch_size=case["patch"],
        embed_dim=case["dim"], depth=case["depth"], num_heads=2, num_classes=3,
    ).eval()  # fmt: skip


def images_for(case: dict, channels: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    return torch.randn(case["batch"], channels, *case["img_size"], generator=generator)


def assert_same(got: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if exact:
        assert torch.equal(got, expected), float((got - expected).abs().max())
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def assert_valid_jigsaw(jigsaw: Jigsaw | None, batch: int, positions: int) -> None:
    """A jigsaw of ``[batch, positions]`` whose ``perm[b]`` moves the masked positions among themselves only."""
    assert jigsaw is not None
    assert jigsaw.mask.shape == jigsaw.perm.shape == (batch, positions)
    assert jigsaw.mask.dtype == torch.bool and jigsaw.perm.dtype == torch.int64
    for mask, perm in zip(jigsaw.mask, jigsaw.perm):
        positions_ = torch.arange(positions)
        assert torch.equal(perm[~mask], positions_[~mask])
        assert torch.equal(perm[mask].sort().values, positions_[mask])


@given(evas(), st.sampled_from(("eval", "prob_0", "ratio_0")), st.booleans(), st.floats(0.0, 1.0))
def test_an_eva_with_the_jigsaw_off_is_timms_eva(case, off, unk, ratio):
    plain = make_eva(case)
    settings_ = dict(ratio=0.0 if off == "ratio_0" else ratio, prob=0.0 if off == "prob_0" else 1.0, unk=unk)
    settings_.update(backend=case["backend"], fused_patch_embed=case["fused"])
    model = mjp_timm.convert(copy.deepcopy(plain), **settings_)
    assert isinstance(model, MJPEva)
    training = off != "eval"
    model.train(training), plain.train(training)
    images = images_for(case)
    out = model(images)
    # Exact where both run timm's convolution in eval mode; timm's own training forward need not repeat itself bit for
    # bit (its relative-position ViT's does not), nor does the fused embedding sum in timm's order.
    assert_same(out, plain(images), exact=not (training or mjp_timm.is_fused(model.patch_embed)))
    assert model.mjp.last_jigsaw is None


def expected_pos_embed(plain: nn.Module, images: torch.Tensor, jigsaw: Jigsaw, unk_embed: torch.Tensor | None):
    """``(tokens, rope)`` of an MJP Eva's ``_pos_embed`` by eva.py's docstring, from timm's own model (eval mode):
    the patch tokens moved by ``perm``; at the masked positions ``unk_embed`` in place of the table row (added to the
    moved token without a table) and a rotary row of no rotation (sin 0, cos 1), one table per sample. Without
    ``unk_embed`` (the naive shuffle) every position keeps its row and its rotation."""
    tokens = plain.patch_embed(images)
    _, rope = plain._pos_embed(tokens)
    tokens = tokens.flatten(1, -2)  # [B, N, D] (a dynamic-size model's patch embedding gives [B, H, W, D])
    batch = tokens.shape[0]
    moved = torch.stack([tokens[b, jigsaw.perm[b]] for b in range(batch)])
    mask = jigsaw.mask[..., None]
    prefix = [token.expand(batch, -1, -1) for token in (plain.cls_token, plain.reg_token) if token is not None]
    prefix = torch.cat(prefix, dim=1) if prefix else moved[:, :0]
    if plain.pos_embed is not None:
        rows = 0 if plain.no_embed_class else plain.num_prefix_tokens
        table = plain.pos_embed[:, rows:]
        moved = moved + (torch.where(mask, unk_embed, table) if unk_embed is not None else table)
        prefix = prefix + plain.pos_embed[:, :rows] if rows else prefix
    elif unk_embed is not None:
        moved = moved + torch.where(mask, unk_embed, torch.zeros_like(unk_embed))
    if rope is not None and unk_embed is not None:
        identity = torch.cat((torch.zeros(rope.shape[-1] // 2), torch.ones(rope.shape[-1] // 2)))
        tables = []
        for b in range(batch):
            table = rope.clone()  # [N, E] or [depth, H, N, E]
            table[..., jigsaw.mask[b], :] = identity
            tables.append(table if rope.dim() == 4 else table[None])
        rope = torch.stack(tables, dim=1 if rope.dim() == 4 else 0)  # [depth, B, H, N, E] or [B, 1, N, E]
    return torch.cat((prefix, moved), dim=1), rope


@given(evas(), st.floats(0.05, 1.0), st.booleans())
def test_an_eva_in_training_applies_the_jigsaw_it_records(case, ratio, unk):
    plain = make_eva(case)
    model = mjp_timm.convert(
        copy.deepcopy(plain), ratio=ratio, prob=1.0, unk=unk, min_block=1, backend=case["backend"],
        fused_patch_embed=case["fused"],
    ).train()  # fmt: skip
    seen = []
    pos_embed = model._pos_embed
    model._pos_embed = lambda x: (lambda out: seen.append(out) or out)(pos_embed(x))  # what the forward got
    images = images_for(case)
    out = model(images)
    assert out.shape == (case["batch"], 3) and bool(torch.isfinite(out).all())
    jigsaw = model.mjp.last_jigsaw
    assert_valid_jigsaw(jigsaw, case["batch"], case["img_size"][0] * case["img_size"][1] // case["patch"] ** 2)
    ((tokens, rope),) = seen
    expected_tokens, expected_rope = expected_pos_embed(plain, images, jigsaw, model.mjp.unk_embed)
    assert_same(tokens, expected_tokens, exact=False)  # unk_embed's add may be fused with the table's
    assert (rope is None) == (expected_rope is None)
    if rope is not None:
        assert rope.shape == expected_rope.shape and torch.equal(rope, expected_rope)


# ---- pixel-space models

# name -> (timm model name, keyword arguments at a tiny size, whether the model takes any image size)
PIXEL_MODELS = {
    "resnet": ("resnet10t", dict(), True),
    "convnext": ("convnext_atto", dict(dims=(8, 8, 8, 8), depths=(1, 1, 1, 1)), True),
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(embed_dim=8, depths=(1, 1), num_heads=(1, 2), window_size=2, drop_path_rate=0.0),  # its default: 0.1
        False,
    ),
    "relpos": ("vit_relpos_small_patch16_224", dict(embed_dim=16, depth=1, num_heads=2), False),
    "beit": ("beit_base_patch16_224", dict(embed_dim=16, depth=1, num_heads=2), False),
    "vit_no_table": (None, dict(embed_dim=16, depth=1, num_heads=2, pos_embed="none"), False),
}


@st.composite
def pixel_models(draw: st.DrawFn) -> dict:
    key = draw(st.sampled_from(sorted(PIXEL_MODELS)))
    name, kwargs, any_size = PIXEL_MODELS[key]
    if any_size:  # a jigsaw patch of the caller's choice; images of at least 32 pixels (ConvNeXt's stride)
        patch = draw(st.sampled_from((2, 4, 8, 16)))
        low = -(-32 // patch)
        img_size = (draw(st.integers(low, 48 // patch)) * patch, draw(st.integers(low, 48 // patch)) * patch)
    elif key == "swin":  # its windows need a 4x4 grid of 4-pixel patches
        patch, img_size = 4, (16, 16)
    else:  # the model's own patch size, any grid
        patch = draw(st.sampled_from((2, 4)))
        img_size = (draw(st.integers(1, 4)) * patch, draw(st.integers(1, 4)) * patch)
        kwargs = dict(kwargs, patch_size=patch)
    if not any_size:
        kwargs = dict(kwargs, img_size=img_size)
    if key == "swin":
        kwargs = dict(kwargs, patch_size=4)
    return dict(
        key=key,
        name=name,
        kwargs=kwargs,
        patch=patch,
        img_size=img_size,
        channels=draw(st.sampled_from((1, 3))),
        batch=draw(st.integers(2 if key == "resnet" else 1, 3)),  # batch norm in training: 2 samples of 1x1 at least
        backend=draw(st.sampled_from(BACKENDS)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_pixel_model(case: dict) -> nn.Module:
    torch.manual_seed(case["seed"])
    kwargs = dict(case["kwargs"], num_classes=3, in_chans=case["channels"])
    if case["name"] is None:
        return VisionTransformer(**kwargs)
    return timm.create_model(case["name"], pretrained=False, **kwargs)


def convert_pixel_model(plain: nn.Module, case: dict, **settings_) -> nn.Module:
    model = mjp_timm.convert(copy.deepcopy(plain), **settings_, patch_size=case["patch"], backend=case["backend"])
    assert isinstance(model, MJPPixelModel) and model.mjp.patch_size == case["patch"]
    return model


@given(pixel_models(), st.sampled_from(("eval", "prob_0", "ratio_0")), st.floats(0.0, 1.0))
def test_a_pixel_model_with_the_jigsaw_off_is_timms_model(case, off, ratio):
    plain = make_pixel_model(case)
    model = convert_pixel_model(
        plain, case, ratio=0.0 if off == "ratio_0" else ratio, prob=0.0 if off == "prob_0" else 1.0
    )
    training = off != "eval"
    model.train(training), plain.train(training)  # batch statistics on both sides in training
    images = images_for(case, case["channels"])
    assert_same(model(images), plain(images), exact=not training)  # as in test_an_eva_with_the_jigsaw_off
    assert model.mjp.last_jigsaw is None
    assert not model.mjp_aux_loss().any()  # nothing to regress


@given(pixel_models(), st.floats(0.05, 1.0), st.booleans(), st.sampled_from(("forward", "forward_intermediates")))
def test_a_pixel_model_in_training_runs_on_the_jigsaw_it_records(case, ratio, shared, entry):
    plain = make_pixel_model(case)
    model = convert_pixel_model(plain, case, ratio=ratio, prob=1.0, min_block=1, shared=shared).train()
    plain.train()
    images = images_for(case, case["channels"])
    if entry == "forward":
        out = model(images)
        assert out.shape == (case["batch"], 3) and bool(torch.isfinite(out).all())
    else:
        final, intermediates = model.forward_intermediates(images, indices=1)
        out = torch.cat([final.flatten(1), *(each.flatten(1) for each in intermediates)], dim=1)
        assert bool(torch.isfinite(out).all())
    rows, cols = case["img_size"][0] // case["patch"], case["img_size"][1] // case["patch"]
    jigsaw = model.mjp.last_jigsaw
    assert_valid_jigsaw(jigsaw, case["batch"], rows * cols)
    if shared:
        assert bool((jigsaw.mask == jigsaw.mask[:1]).all() and (jigsaw.perm == jigsaw.perm[:1]).all())
    jigsawed = jigsaw_images_ref(images, jigsaw, case["patch"])
    if entry == "forward":
        expected = plain(jigsawed)
    else:
        final, intermediates = plain.forward_intermediates(jigsawed, indices=1)
        expected = torch.cat([final.flatten(1), *(each.flatten(1) for each in intermediates)], dim=1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
