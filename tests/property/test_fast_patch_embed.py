"""Property tests of :func:`mjp_fast.timm.fast_patch_embed` (issue 42): on a random tiny geometry (patch sizes 1 to
5, odd and non-square grids, 1 to 3 channels, widths down to 4 (8 in half precision), class and register tokens or none,
``no_embed_class``; a ViT, a distilled DeiT or an EVA-02), in every float dtype and on every backend that runs on
CPU tensors here (``triton`` interpreted), the fused model is timm's unfused model: its output and the gradients of
the images and of every parameter, within the dtype's tolerance (float32 and float64: those of a sum in another
order; bfloat16 and float16: the house rule, at most twice the error of timm's model run in that dtype, both against
timm's model in float32, plus two epsilons). Integer images (uint8: unnormalised pixels) raise a TypeError naming
``images``. tests/timm/test_patch_embed_dtypes.py holds the fixed sweep of every embedding path.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from hypothesis import given
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import mjp_fast.timm as mjp_timm
from tests.conftest import backends_for
from tests.property.common import vit_prefix_kwargs

BACKENDS = backends_for("cpu")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool)
HALF_DTYPES = (torch.bfloat16, torch.float16)
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


@st.composite
def geometries(draw: st.DrawFn) -> dict:
    family = draw(st.sampled_from(("vit", "deit_distilled", "eva02")))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    patch, rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kwargs = dict(
        img_size=(rows * patch, cols * patch),
        patch_size=patch,
        in_chans=draw(st.integers(1, 3)),
        depth=1,
        num_classes=3,
    )
    # Widths of 4 at least (8 in half precision): behind a LayerNorm of fewer features (of 2, its output is +-1
    # whatever the tokens) the gradients are rounding noise, amplified, in any dtype; tokens that differ in their last
    # bit (the fused op rounds once where timm rounds the convolution, then the sum) then give gradients further from
    # float32 than the house rule allows, wherever they were computed. The op's own property tests
    # (tests/property/test_patch_embed.py) take widths of 1 and 2.
    widths = (8, 12, 16) if dtype in HALF_DTYPES else (4, 6, 8, 12, 16)
    if family == "eva02":  # its rotary embedding wants a head width divisible by 4
        kwargs.update(embed_dim=draw(st.sampled_from((8, 16))), num_heads=2)
    else:
        width = draw(st.sampled_from(widths))
        kwargs.update(embed_dim=width, num_heads=draw(st.sampled_from((1, 2))))
    if family == "vit":
        kwargs.update(vit_prefix_kwargs(draw))
    return dict(
        family=family,
        kwargs=kwargs,
        dtype=dtype,
        batch=draw(st.integers(1, 3)),
        backend=draw(st.sampled_from(BACKENDS)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_plain(case: dict) -> nn.Module:
    torch.manual_seed(case["seed"])
    if case["family"] == "vit":
        return VisionTransformer(**case["kwargs"]).eval()
    name = "deit_tiny_distilled_patch16_224" if case["family"] == "deit_distilled" else "eva02_tiny_patch14_224"
    return timm.create_model(name, pretrained=False, **case["kwargs"]).eval()


def images_for(case: dict, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    shape = (case["batch"], case["kwargs"]["in_chans"], *case["kwargs"]["img_size"])
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 2 if dtype == torch.bool else 128, shape, generator=generator).to(dtype)


def step(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The output, and the gradients of the images and every parameter of a float32 loss (fixed random weights)."""
    images = images.detach().requires_grad_(True)
    out = model(images)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * weights).sum().backward()
    return out.detach(), {"images": images.grad, **{name: p.grad for name, p in model.named_parameters()}}


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (the fused model's) against ``expected`` (timm's in the same dtype) and ``exact`` (timm's in
    float32)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    assert bool(torch.isfinite(got.float()).all()), name
    if got.dtype in HALF_DTYPES:
        error, reference_error = relative_error(got, exact), relative_error(expected, exact)
        floor = 2 * torch.finfo(got.dtype).eps  # a rounding of the tokens, carried through the block
        assert error <= 2 * reference_error + floor, f"{name}: error {error:.3g}, timm's own {reference_error:.3g}"
    else:
        torch.testing.assert_close(got, expected, **TOLERANCES[got.dtype], msg=lambda text: f"{name}: {text}")


@given(geometries())
def test_the_fused_model_is_timms_model_in_every_float_dtype(case):
    dtype = case["dtype"]
    plain = make_plain(case)
    fused = mjp_timm.fast_patch_embed(copy.deepcopy(plain).to(dtype), backend=case["backend"])
    assert mjp_timm.is_fused(fused.patch_embed)
    images = images_for(case, dtype)
    (out, grads), (expected_out, expected_grads) = step(fused, images), step(copy.deepcopy(plain).to(dtype), images)
    exact_out, exact_grads = step(plain, images.float())
    assert_close("output", out, expected_out, exact_out)
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        if expected is None:  # a parameter the output does not use (a distilled head in eval mode)
            assert grads[name] is None or not grads[name].any(), name
            continue
        assert grads[name] is not None, name
        assert_close(f"grad {name}", grads[name], expected, exact_grads[name])


@given(geometries(), st.sampled_from(INTEGER_DTYPES))
def test_integer_images_are_refused_naming_images(case, images_dtype):
    fused = mjp_timm.fast_patch_embed(make_plain(case).to(case["dtype"]), backend=case["backend"])
    with pytest.raises(TypeError, match="images") as caught:
        fused(images_for(case, images_dtype))
    assert str(images_dtype).removeprefix("torch.") in str(caught.value), str(caught.value)
