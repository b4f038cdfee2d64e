"""``dynamic_img_size=True`` on the fused path (issue 40, item 3): timm's ViT and Eva models that take any image size
run their patch embedding, position table and jigsaw as one fused op, the table resampled for each call's grid as
timm resamples it (``dynamic_img_pad``: the images padded as timm pads them), and DAL regressing the stored table.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models import create_feature_extractor

import mjp_fast.timm as mjp_timm
from mjp_fast.timm.fused import is_fused, prefix_positions_of, unfusable_reason

from ..conftest import backends_for

BACKENDS = [backend for backend in ("cpu", "triton", "torch") if backend in backends_for("cpu")]

# (timm name, keyword arguments): a class token with its table row, a distilled DeiT (two prefix tokens), register
# tokens with no_embed_class (the table has no prefix rows), EVA-02 (rotary and absolute), padding to the patch
MODELS = [
    ("vit_tiny_patch16_224", {}),
    ("deit_tiny_distilled_patch16_224", {}),
    ("vit_tiny_patch16_224", {"reg_tokens": 2, "no_embed_class": True, "class_token": False, "global_pool": "avg"}),
    ("eva02_tiny_patch14_224", {}),
    ("vit_tiny_patch16_224", {"dynamic_img_pad": True}),
]
TINY = {"depth": 1, "embed_dim": 32, "num_heads": 2}


def _model_id(model):
    name, keywords = model
    return name + "".join(f"-{key}" for key in keywords)


def _base(name: str, keywords: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    patch = 14 if "patch14" in name else 16
    model = timm.create_model(name, pretrained=False, img_size=4 * patch, dynamic_img_size=True, **TINY, **keywords)
    with torch.no_grad():  # timm zero-initialises some heads: outputs must depend on the input
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return model.eval()


def _sizes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The table's own size, a wider and a smaller non-square one; with padding, sides that are not multiples."""
    patch = model.patch_embed.patch_size[0]
    sizes = [(4 * patch, 4 * patch), (4 * patch, 6 * patch), (3 * patch, 5 * patch)]
    if model.patch_embed.dynamic_img_pad:
        sizes.append((3 * patch + 5, 5 * patch + 1))
    return sizes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS, ids=_model_id)
def test_an_mjp_model_of_any_image_size_runs_fused_and_equals_timm_in_eval(model, backend):
    base = _base(*model)
    mjp = mjp_timm.convert(copy.deepcopy(base), ratio=0.3, prob=1.0, min_block=1, backend=backend)
    assert is_fused(mjp.patch_embed)  # fused by default now that dynamic_img_size is no reason not to
    mjp.eval()
    generator = torch.Generator().manual_seed(1)
    for size in _sizes(base):
        images = torch.randn(2, 3, *size, generator=generator)
        with torch.no_grad():
            torch.testing.assert_close(mjp(images), base(images), atol=2e-5, rtol=2e-5, msg=str(size))
            # the jigsaw at this grid changes the output, the same for the same seed
            with mjp.mjp_eval(ratio=0.5):
                jigsawed = mjp(images)
            assert not torch.allclose(jigsawed, base(images), atol=1e-4), size
            grid = mjp.patch_embed.dynamic_feat_size(size)
            assert mjp.mjp.last_jigsaw.mask.shape == (2, grid[0] * grid[1])


@pytest.mark.parametrize("model", MODELS, ids=_model_id)
def test_a_training_step_at_another_size_gives_every_parameter_a_gradient(model):
    base = _base(*model)
    mjp = mjp_timm.convert(copy.deepcopy(base), ratio=0.3, prob=1.0, min_block=1, backend=BACKENDS[0]).train()
    patch = base.patch_embed.patch_size[0]
    images = torch.randn(2, 3, 3 * patch, 6 * patch, generator=torch.Generator().manual_seed(2))
    out = mjp(images)
    out.square().mean().backward()  # the output alone: the DAL loss rides on it
    missing = [name for name, parameter in mjp.named_parameters() if parameter.requires_grad and parameter.grad is None]
    assert not missing
    assert mjp.mjp.unk_embed.grad.abs().sum() > 0 and mjp.mjp.dal_regressor is not None
    # DAL regresses the stored table at its own grid, not the table resampled for these images
    stored = mjp.mjp.dal_loss_of(mjp.pos_embed, None, None, prefix_positions_of(mjp)).detach()
    torch.testing.assert_close(mjp.mjp.last_dal_loss, stored)


@pytest.mark.parametrize("fused", [True, False])
def test_an_input_grid_with_as_many_positions_as_the_table_leaves_no_table_row_out_of_dal(fused):
    """A 2x8 input of a 4x4 table: the jigsaw's mask has 16 positions too, but they are not the table's; DAL regresses
    every stored row (the mask of another grid must not pick table rows by number)."""
    base = _base(*MODELS[0])
    mjp = mjp_timm.convert(copy.deepcopy(base), ratio=0.5, prob=1.0, min_block=1, fused_patch_embed=fused).train()
    patch = base.patch_embed.patch_size[0]
    mjp(torch.randn(2, 3, 2 * patch, 8 * patch, generator=torch.Generator().manual_seed(3)))
    assert mjp.mjp.last_jigsaw.mask.shape == (2, 16) and bool(mjp.mjp.last_jigsaw.mask.any())
    stored = mjp.mjp.dal_loss_of(mjp.pos_embed, None, None, prefix_positions_of(mjp)).detach()
    torch.testing.assert_close(mjp.mjp.last_dal_loss, stored)
    mjp.mjp_aux_loss()  # the attached loss, handed out once; then computed again from the last jigsaw
    torch.testing.assert_close(mjp.mjp_aux_loss().detach(), stored)
    # at the table's own grid the mask counts: the masked rows are left out
    mjp(torch.randn(2, 3, 4 * patch, 4 * patch, generator=torch.Generator().manual_seed(4)))
    masked = mjp.mjp.dal_loss_of(mjp.pos_embed, None, mjp.mjp.last_jigsaw, prefix_positions_of(mjp)).detach()
    torch.testing.assert_close(mjp.mjp.last_dal_loss, masked)
    assert not torch.allclose(masked, mjp.mjp.dal_loss_of(mjp.pos_embed, None, None, prefix_positions_of(mjp)))


@pytest.mark.parametrize("model", MODELS, ids=_model_id)
def test_fast_patch_embed_of_a_dynamic_model_has_timms_outputs_and_gradients(model):
    base = _base(*model).train()
    fast = mjp_timm.fast_patch_embed(copy.deepcopy(base), backend=BACKENDS[0])
    assert is_fused(fast.patch_embed)
    for size in _sizes(base)[1:]:
        images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(sum(size)))
        for module in (base, fast):
            module.zero_grad()
            module(images).square().sum().backward()
        for (name, want), got in zip(base.named_parameters(), fast.parameters(), strict=True):
            # the table's gradient flows back through timm's bicubic resampling, as in timm's own model
            torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4, msg=f"{name} at {size}")


def test_a_dynamic_model_refuses_a_size_that_is_not_a_multiple_of_the_patch_as_timm_does():
    base = _base("vit_tiny_patch16_224", {})
    mjp = mjp_timm.convert(copy.deepcopy(base), backend=BACKENDS[0]).eval()
    images = torch.randn(1, 3, 64, 70)
    with pytest.raises(AssertionError, match=r"Input width \(70\) should be divisible by patch size \(16\)"):
        base(images)
    with pytest.raises(AssertionError, match=r"Input width \(70\) should be divisible by patch size \(16\)"):
        mjp(images)


@pytest.mark.parametrize(
    "keywords, words",
    [
        ({"dynamic_img_pad": True}, "dynamic_img_pad=True without dynamic_img_size"),
        ({"strict_img_size": False}, "strict_img_size=False without dynamic_img_size"),
    ],
)
def test_a_variable_size_without_dynamic_img_size_stays_unfused(keywords, words):
    # Without dynamic_img_size, timm adds the table as it is: an image of another grid has no table to add.
    if "strict_img_size" in keywords:
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, **TINY)
        model.patch_embed.strict_img_size = False
    else:
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, **TINY, **keywords)
    assert words in unfusable_reason(model)
    with pytest.raises(ValueError, match=words):
        mjp_timm.convert(model, fused_patch_embed=True)


def test_fx_feature_extraction_of_a_dynamic_fused_model():
    base = _base("vit_tiny_patch16_224", {})
    mjp = mjp_timm.convert(copy.deepcopy(base), backend=BACKENDS[0]).eval()
    extractor = create_feature_extractor(mjp, return_nodes=["blocks.0"])
    reference = create_feature_extractor(base, return_nodes=["blocks.0"])
    images = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        torch.testing.assert_close(extractor(images)["blocks.0"], reference(images)["blocks.0"], atol=2e-5, rtol=2e-5)
