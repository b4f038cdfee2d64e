"""Property tests of ``jigsaw_images``: the oracle's result for valid jigsaws, the defined result of
mjp_fast/_validate.py for broken ones with ``validate=False`` (zero patches, only the sample's own pixels, the
gather's gradient), or a ValueError/TypeError naming an argument."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from mjp_fast import jigsaw_images
from mjp_fast.ops.jigsaw_images import jigsaw_images_ref
from mjp_fast.sampler.jigsaw import Jigsaw
from tests.property.common import (
    assert_refusal_names_an_argument,
    in_child_only,
    is_broken,
    jigsaws,
    random_tensor,
    run_module_isolated,
)

NAMES = ("images", "jigsaw", "patch_size")


@st.composite
def calls(draw):
    batch, channels = draw(st.sampled_from((0, 1, 2))), draw(st.sampled_from((0, 1, 3)))
    patch, rows, cols = (
        draw(st.sampled_from((1, 2, 3))),
        draw(st.sampled_from((1, 2, 3))),
        draw(st.sampled_from((1, 2))),
    )
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.float16, torch.bfloat16)))
    kind = draw(st.sampled_from(("valid", "out_of_range", "repeated")))
    jigsaw = draw(jigsaws(batch, rows * cols, kind))
    images = random_tensor((batch, channels, rows * patch, cols * patch), dtype, draw(st.integers(0, 99)))
    if not draw(st.booleans()):
        images = images.transpose(2, 3).contiguous().transpose(2, 3)  # not contiguous
    patch_size = patch
    mistake = draw(st.sampled_from((None, "patch_size", "patch_size type", "perm shape", "jigsaw None")))
    if mistake == "patch_size":
        patch_size = draw(st.sampled_from((0, -1, patch * 2 + 5)))
    elif mistake == "patch_size type":
        patch_size = float(patch)
    elif mistake == "perm shape":
        jigsaw = Jigsaw(jigsaw.mask, jigsaw.perm[:, :1].repeat(1, 2))
    elif mistake == "jigsaw None":
        jigsaw = None
    return images, jigsaw, patch_size, draw(st.booleans())


def expected(images: torch.Tensor, jigsaw: Jigsaw, patch: int) -> torch.Tensor:
    """The defined result, patch by patch: the patch perm names, zeros for an out-of-range entry."""
    out = torch.zeros_like(images)
    cols = images.shape[3] // patch
    for b, row in enumerate(jigsaw.perm):
        for n, m in enumerate(row.tolist()):
            if 0 <= m < len(row):
                target = (slice(None), slice(n // cols * patch, (n // cols + 1) * patch))
                source = (slice(None), slice(m // cols * patch, (m // cols + 1) * patch))
                out[b][target[0], target[1], n % cols * patch : (n % cols + 1) * patch] = images[b][
                    source[0], source[1], m % cols * patch : (m % cols + 1) * patch
                ]
    return out


@in_child_only
@given(calls())
def test_the_defined_result_or_a_named_refusal(case):
    images, jigsaw, patch_size, validate = case
    leaf = images.detach().clone().requires_grad_(True)
    try:
        out = jigsaw_images(leaf, jigsaw, patch_size, validate=validate)
    except (ValueError, TypeError) as error:
        assert_refusal_names_an_argument(error, NAMES)
        return
    assert not (validate and is_broken(jigsaw)), "validate=True accepted a broken jigsaw"
    assert torch.equal(out, expected(images, jigsaw, patch_size))
    if not is_broken(jigsaw):
        assert torch.equal(out, jigsaw_images_ref(images, jigsaw, patch_size))
    # The gather's gradient: the backward of <out, weights> is the defined result's adjoint.
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
    (grad,) = torch.autograd.grad(out, leaf, weights) if out.requires_grad else (torch.zeros_like(images),)
    probe = images.detach().clone().double().requires_grad_(True)
    (reference,) = torch.autograd.grad(expected(probe, jigsaw, patch_size), probe, weights.double(), allow_unused=True)
    reference = torch.zeros_like(probe) if reference is None else reference
    torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=2e-2)


def test_property_tests_in_a_child_process():
    run_module_isolated(__file__)
