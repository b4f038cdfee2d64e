"""Every path that embeds images inside a model, on every backend the CPU runs, in every dtype a model or its images
come in: the result is the oracle's (forward, and gradients for the float dtypes, within the dtype's tolerance), or
the call raises a TypeError naming the dtype. Never a silent wrong result.

Issue 42: a float64 model on the fused ``triton`` path (``fast_patch_embed``, and ``convert``, which fuses by
default) got tokens off by more than their size: the per-step function of the fused embedding, which skips the
public op's checks, handed float64 tiles to Triton kernels that accumulate in float32; uint8 images reached those
kernels too (uint8 tokens), and the other backends' kernels or convolution as a RuntimeError. The paths:

- ``fast_patch_embed``: a plain timm model with the fused embedding; oracle the plain model itself.
- ``convert`` in training (jigsaw and the attached DAL loss) and in eval mode, fused; oracle the unfused MJP
  model (timm's Conv2d, then the tokens moved) on the ``torch`` backend, with the same MJP state (same jigsaws).
- :class:`mjp_fast.MJPPatchEmbed`; oracle the same module on the ``torch`` backend.

Each for a ViT (class and register tokens: prefix rows) and an EVA-02 (its own fused front end). Tolerances:
float32 and float64 those of a sum in another order; bfloat16 and float16 the house rule, at most twice the error
of the oracle run in that dtype, both against the oracle run in float32, plus one epsilon of the dtype.

Refused, with a TypeError naming the dtype: uint8 images everywhere (unnormalised images; timm's own path fails on
them too), and float64 on ``MJPPatchEmbed(backend="triton")``, whose public op refuses float64 on the
Triton kernels. The timm models' fused step runs float64 on the ``torch`` backend's computation instead (as their
token path does): a float64 timm model works whatever its backend.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

import mjp_fast
import mjp_fast.timm as mjp_timm
from tests.conftest import backends_for

BACKENDS = backends_for("cpu")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8]
HALF_DTYPES = (torch.bfloat16, torch.float16)
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}

TINY = dict(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3)
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(reg_tokens=1)),
    "eva02": ("eva02_tiny_patch14_224", dict()),
}
MJP_SETTINGS = dict(ratio=0.5, prob=1.0, dal="nonlinear", min_block=1)
TIMM_PATHS = ["fast_patch_embed", "convert_train", "convert_eval"]
CASES = [(path, family) for path in TIMM_PATHS for family in FAMILIES] + [("MJPPatchEmbed", None)]


def _refused(path: str, backend: str, dtype: torch.dtype) -> bool:
    """Whether the path refuses this dtype (see the module's docstring) instead of computing it."""
    return not dtype.is_floating_point or (path == "MJPPatchEmbed" and backend == "triton" and dtype == torch.float64)


def _models(path: str, family: str | None, backend: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(model, oracle, exact)``: the path under test on ``backend`` with parameters in ``dtype`` (float32 for
    uint8 images: a module has no integer parameters), its oracle in the same dtype, and the oracle in float32. All
    three hold the same weights and MJP state, so they draw the same jigsaws."""
    dtype = dtype if dtype.is_floating_point else torch.float32
    torch.manual_seed(0)
    if path == "MJPPatchEmbed":
        exact = mjp_fast.MJPPatchEmbed(16, 8, 3, 16, **MJP_SETTINGS, backend="torch")
        model = copy.deepcopy(exact)
        model.backend = backend
        return model.to(dtype), copy.deepcopy(exact).to(dtype), exact
    name, overrides = FAMILIES[family]
    plain = timm.create_model(name, pretrained=False, **TINY, **overrides)
    if path == "fast_patch_embed":
        model = mjp_timm.fast_patch_embed(copy.deepcopy(plain).to(dtype), backend=backend)
        return model, copy.deepcopy(plain).to(dtype), plain
    model = mjp_timm.convert(copy.deepcopy(plain).to(dtype), backend=backend, **MJP_SETTINGS)
    assert mjp_timm.is_fused(model.patch_embed)
    references = []
    for reference_dtype in (dtype, torch.float32):
        reference = copy.deepcopy(plain).to(reference_dtype)
        reference = mjp_timm.convert(reference, backend="torch", fused_patch_embed=False, **MJP_SETTINGS)
        reference.load_state_dict(model.state_dict())  # copied into each one's own dtype
        references.append(reference)
    models = (model, *references)
    if path == "convert_eval":
        for each in models:
            each.eval()
    return models


def _step(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One forward and a backward of a float32 loss (the same random weights of the output for each model); returns
    the output and the gradients of the images and of every parameter (None where one has none)."""
    model.zero_grad(set_to_none=True)
    images = images.detach().requires_grad_()
    out = model(images)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * weights).sum().backward()
    grads = {name: parameter.grad for name, parameter in model.named_parameters()}
    return out, {"images": images.grad, **grads}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


def _assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (the path's) against ``expected`` (the oracle's in the same dtype) and ``exact`` (in float32)."""
    assert got.dtype == expected.dtype, name
    assert got.shape == expected.shape, name
    assert torch.isfinite(got.float()).all(), name
    if got.dtype in HALF_DTYPES:
        # One epsilon more: past the embedding, the half-precision blocks round tokens that differ in their last bit
        # from the oracle's, and a downstream gradient (a norm's weight) compounds that its own way.
        floor = torch.finfo(got.dtype).eps
        error, reference_error = _relative_error(got, exact), _relative_error(expected, exact)
        assert error <= 2 * reference_error + floor, f"{name}: error {error:.3g}, oracle's {reference_error:.3g}"
    else:
        tolerance = TOLERANCES[got.dtype]
        torch.testing.assert_close(got, expected, **tolerance, msg=lambda message: f"{name}: {message}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path, family", CASES, ids=[f"{path}-{family}" if family else path for path, family in CASES])
def test_each_dtype_matches_the_oracle_or_is_refused(path, family, backend, dtype):
    model, oracle, exact = _models(path, family, backend, dtype)
    generator = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        images = torch.randn(2, 3, 16, 16, generator=generator).to(dtype)
    else:  # unnormalised images: no backend's arithmetic on them is timm's
        images = torch.randint(0, 256, (2, 3, 16, 16), generator=generator, dtype=dtype)
    if _refused(path, backend, dtype):
        with pytest.raises(TypeError, match=str(dtype).removeprefix("torch.")):
            model(images)
        return
    results = [_step(model, images), _step(oracle, images), _step(exact, images.float())]
    (out, grads), (expected_out, expected_grads), (exact_out, exact_grads) = results
    _assert_close("output", out, expected_out, exact_out)
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        if expected is None:
            assert grads[name] is None or not grads[name].any(), name
            continue
        assert grads[name] is not None, name
        _assert_close(f"grad {name}", grads[name], expected, exact_grads[name])
