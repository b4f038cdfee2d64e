import functools

import pytest
import torch

import mjp_fast
from mjp_fast.ops.jigsaw_images import jigsaw_images_ref
from mjp_fast.ops.patch_embed import mjp_patch_embed_ref
from tests.conftest import DEVICES


# One implementation on every device (no backend to choose): each device once.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 4, 3, 5), (1, 1, 1, 1, 1), (3, 2, 3, 4, 2)])  # B, C, P, rows, cols
def test_matches_the_oracle_and_moves_whole_patches(shape, device):
    batch, channels, patch, rows, cols = shape
    images = torch.randn(batch, channels, rows * patch, cols * patch, device=device)
    jigsaw = mjp_fast.sample_jigsaw(batch, (rows, cols), 0.6, seed=4, min_block=1, device=device)
    got = mjp_fast.jigsaw_images(images, jigsaw, patch)
    assert torch.equal(got, jigsaw_images_ref(images, jigsaw, patch))
    for b in range(batch):
        for n in range(rows * cols):
            r, c = divmod(n, cols)
            sr, sc = divmod(int(jigsaw.perm[b, n]), cols)
            window = (slice(r * patch, (r + 1) * patch), slice(c * patch, (c + 1) * patch))
            source = (slice(sr * patch, (sr + 1) * patch), slice(sc * patch, (sc + 1) * patch))
            assert torch.equal(got[b, :, window[0], window[1]], images[b, :, source[0], source[1]])


def test_pixel_jigsaw_then_embed_equals_fused_embedding():
    images = torch.randn(2, 3, 12, 20)
    weight, bias = torch.randn(6, 3, 4, 4), torch.randn(6)
    pos, unk = torch.randn(15, 6), torch.randn(6)
    jigsaw = mjp_fast.sample_jigsaw(2, (3, 5), 0.5, seed=1, min_block=1)
    shuffled = mjp_fast.jigsaw_images(images, jigsaw, 4)
    position_term = torch.where(jigsaw.mask[..., None], unk, pos)
    expected = mjp_patch_embed_ref(shuffled, weight, bias, torch.zeros_like(pos), None) + position_term
    fused = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, jigsaw)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_uint8_pictures_and_gradients():
    pictures = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    jigsaw = mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, min_block=1)
    out = mjp_fast.jigsaw_images(pictures, jigsaw, 4)
    assert out.dtype == torch.uint8 and torch.equal(out.sort(-1).values.sum(), pictures.sort(-1).values.sum())
    images = torch.randn(2, 3, 16, 16, requires_grad=True)
    weights = torch.randn(2, 3, 16, 16)
    (mjp_fast.jigsaw_images(images, jigsaw, 4) * weights).sum().backward()
    # the gradient is the weights moved back by the inverse permutation
    inverse = mjp_fast.Jigsaw(jigsaw.mask, torch.argsort(jigsaw.perm, dim=1))
    torch.testing.assert_close(images.grad, mjp_fast.jigsaw_images(weights, inverse, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", [4 * 3, -1, 10**9, -(10**9)])
def test_the_oracle_gives_the_ops_zero_patch_for_an_out_of_range_entry(device, entry):
    """Issue 42 item 10: jigsaw_images_ref raised on a perm entry outside [0, N), where the op (validate=False) gives
    the documented zero patch and no gradient. Now both do, values and gradients alike."""
    torch.manual_seed(0)
    images = torch.randn(2, 3, 6, 8, device=device) + 5  # no zero pixel: a zero patch is the entry's
    perm = torch.arange(12, device=device).repeat(2, 1)
    perm[0, 3], perm[1, 0] = entry, 5  # sample 1: patch 5 shown twice, patch 0 never (in range, not a permutation)
    jigsaw = mjp_fast.Jigsaw(torch.ones(2, 12, dtype=torch.bool, device=device), perm)
    weights = torch.randn(2, 3, 6, 8, device=device)
    results = []
    for function in (jigsaw_images_ref, functools.partial(mjp_fast.jigsaw_images, validate=False)):
        leaf = images.clone().requires_grad_()
        out = function(leaf, jigsaw, 2)
        (out * weights).sum().backward()
        results.append((out.detach(), leaf.grad))
    (out, grad), (op_out, op_grad) = results
    assert torch.equal(out, op_out) and torch.equal(grad, op_grad)
    assert not out[0, :, 0:2, 6:8].any()  # token 3 of sample 0 (row 0, col 3): a zero patch
    assert torch.equal(out[1, :, 0:2, 0:2], images[1, :, 2:4, 2:4])  # token 0 of sample 1 shows patch 5
    assert not grad[0, :, 0:2, 6:8].any() and not grad[1, :, 0:2, 0:2].any()  # patches that no token shows
    pictures = (images * 10).to(torch.uint8)
    assert torch.equal(
        jigsaw_images_ref(pictures, jigsaw, 2), mjp_fast.jigsaw_images(pictures, jigsaw, 2, validate=False)
    )


@pytest.mark.parametrize(
    "images, jigsaw, patch_size, error, words",
    [
        (torch.randn(2, 3, 15, 16), "ok", 4, ValueError, "multiples"),
        (torch.randn(2, 3, 16, 16), None, 4, TypeError, "jigsaw"),
        (torch.randn(2, 3, 16, 16), "ok", 0, ValueError, "patch_size"),
        (torch.randn(2, 3, 16, 16), "ok", 8, ValueError, "jigsaw"),
        (torch.randn(3, 16, 16), "ok", 4, ValueError, "images"),
    ],
)
def test_bad_arguments_are_named(images, jigsaw, patch_size, error, words):
    if jigsaw == "ok":
        jigsaw = mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0)
    with pytest.raises(error, match=words):
        mjp_fast.jigsaw_images(images, jigsaw, patch_size)
