"""Regression tests of issue 25's token-side cases, each the issue's exact call: zero channels (item 1), perm entries
out of range with ``validate=False`` (items 2, 3), a perm that is not a permutation (item 4), ``unk_embed``'s gradient
without a jigsaw (item 8), a 0-d ``unk_embed`` and D = 0 (item 10), and the Triton backward of an empty batch (item
15). What ``validate=False`` promises is written in mjp_fast/_validate.py. The calls that crashed a process run in a
child process."""

from __future__ import annotations

import pytest
import torch

import mjp_fast
from mjp_fast import jigsaw_images, mjp_patch_embed, mjp_pos_embed
from mjp_fast.sampler.jigsaw import Jigsaw
from tests.harness.isolated import run_isolated

# the tests run on CPU tensors: triton only in the interpreter (on a GPU machine it runs on CUDA tensors alone)
BACKENDS = [
    name
    for name in ("torch", "cpu", "triton")
    if name in mjp_fast.available_backends() and mjp_fast.backend.runs_on(name, torch.device("cpu"))
]


def identity_jigsaw(batch: int, num_positions: int) -> Jigsaw:
    return Jigsaw(torch.ones(batch, num_positions, dtype=torch.bool), torch.arange(num_positions).repeat(batch, 1))


# One child process per backend for all of a test's cases: a child's start (torch, timm, the package) is most of
# its time. A crash names no case, but fails the backend's test.


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_channels(backend):
    """Item 1: C = 0 crashed the cpu backend (SIGFPE) and the torch backend raised (or gave [2, 6, 0] at D = 1)."""
    done = run_isolated(f"""
        import torch
        from mjp_fast import mjp_patch_embed
        for dim in (5, 1):
            bias = torch.randn(dim)
            out = mjp_patch_embed(torch.randn(2, 0, 4, 6), torch.randn(dim, 0, 2, 2), bias, torch.randn(6, dim), None,
                                  backend="{backend}")
            assert out.shape == (2, 6, dim), (dim, out.shape)
            print(dim, float((out - bias).abs().max()))
    """)
    assert done.returncode == 0, done.explain()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_entries_move_nothing(backend):
    """Items 2 and 3: with validate=False an entry outside [0, N) read (and wrote) out of bounds on triton, and another
    sample's token on torch. Now: a zero patch (the bias and the position term alone), no gradient, no crash."""
    done = run_isolated(f"""
        import torch
        from mjp_fast import mjp_patch_embed, mjp_pos_embed
        from mjp_fast.sampler.jigsaw import Jigsaw
        for entry in (10**9, -(10**9), 4, -1):
            print("entry", entry, flush=True)  # the case a crash stopped at
            torch.manual_seed(0)
            mask = torch.ones(2, 4, dtype=torch.bool)
            perm = torch.arange(4).repeat(2, 1)
            perm[0, 1] = entry
            images = torch.randn(2, 3, 4, 4, requires_grad=True)
            weight, bias = torch.randn(5, 3, 2, 2), torch.randn(5)
            pos, unk = torch.randn(4, 5), torch.randn(5)
            out = mjp_patch_embed(images, weight, bias, pos, unk, Jigsaw(mask, perm), backend="{backend}",
                                  validate=False)
            out.backward(torch.ones_like(out))
            torch.testing.assert_close(out[0, 1], bias + unk)
            assert torch.isfinite(out).all() and torch.isfinite(images.grad).all()
            assert not images.grad[0, :, :2, 2:].any(), "the patch no token shows gets a gradient"
            tokens = torch.randn(2, 4, 5, requires_grad=True)
            moved = mjp_pos_embed(tokens, pos, unk, Jigsaw(mask, perm), backend="{backend}", validate=False)
            moved.backward(torch.ones_like(moved))
            torch.testing.assert_close(moved[0, 1], unk)
            assert not tokens.grad[0, 1].any() and bool((tokens.grad[1] == 1).all())
    """)
    assert done.returncode == 0, done.explain()


@pytest.mark.parametrize("entry", [4, -1])
def test_jigsaw_images_never_reads_another_sample(entry):
    """Item 3: jigsaw_images with validate=False copied the neighbouring sample's patch."""
    images = torch.randn(2, 3, 4, 4)
    perm = torch.arange(4).repeat(2, 1)
    perm[0 if entry == 4 else 1, 1] = entry
    out = jigsaw_images(images, Jigsaw(torch.ones(2, 4, dtype=torch.bool), perm), 2, validate=False)
    sample = 0 if entry == 4 else 1
    assert not out[sample, :, :2, 2:].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_perm_that_is_not_a_permutation(backend):
    """Item 4: the cpu weight gradient came from an uninitialised buffer (two calls differed), the torch gradients
    were off. Now the weight gradient is the formula's on every backend, and the same on every call."""
    torch.manual_seed(0)
    images = torch.randn(2, 3, 8, 8)
    weight = torch.randn(64, 3, 4, 4, requires_grad=True)  # above the cpu backend's convolution threshold
    pos, unk = torch.randn(4, 64), torch.randn(64)
    jigsaw = Jigsaw(torch.ones(2, 4, dtype=torch.bool), torch.tensor([[0, 0, 0, 3], [1, 1, 2, 2]]))
    reference = weight.detach().clone().requires_grad_(True)
    expected = mjp_fast.ops.patch_embed.mjp_patch_embed_ref(images, reference, None, pos, unk, jigsaw)
    expected.backward(torch.ones_like(expected))
    grads = []
    for _ in range(2):
        weight.grad = None
        out = mjp_patch_embed(images, weight, None, pos, unk, jigsaw, backend=backend, validate=False)
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(out, expected.detach(), atol=1e-4, rtol=1e-4)
        grads.append(weight.grad.clone())
    torch.testing.assert_close(grads[0], reference.grad, atol=1e-3, rtol=1e-4)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", [name for name in BACKENDS if name != "triton"])
def test_tokens_gradient_of_a_repeated_entry_is_the_gather_s(backend):
    """Item 4, mjp_pos_embed: on torch and cpu the tokens' gradient is the gather's (the oracle's)."""
    tokens = torch.randn(2, 4, 3, requires_grad=True)
    jigsaw = Jigsaw(torch.ones(2, 4, dtype=torch.bool), torch.tensor([[0, 0, 0, 3], [1, 1, 2, 2]]))
    out = mjp_pos_embed(tokens, torch.randn(4, 3), torch.randn(3), jigsaw, backend=backend, validate=False)
    out.backward(torch.ones_like(out))
    assert tokens.grad[:, :, 0].tolist() == [[3.0, 0.0, 0.0, 1.0], [0.0, 2.0, 2.0, 0.0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unk_embed_gradient_without_a_jigsaw_is_zeros(backend):
    """Item 8: zeros on cpu and triton, None on torch. Zeros everywhere now (see plain_positions)."""
    unk = torch.randn(5, requires_grad=True)
    out = mjp_patch_embed(
        torch.randn(2, 3, 4, 4), torch.randn(5, 3, 2, 2), None, torch.randn(4, 5), unk, backend=backend
    )
    out.sum().backward()
    assert unk.grad is not None and not unk.grad.any()
    unk.grad = None
    out = mjp_pos_embed(torch.randn(2, 4, 5), torch.randn(4, 5), unk, backend=backend)
    out.sum().backward()
    assert unk.grad is not None and not unk.grad.any()


def test_the_module_gives_unk_embed_zeros_in_eval():
    module = mjp_fast.MJPPatchEmbed(img_size=8, patch_size=4, in_chans=3, embed_dim=4, prob=0.0).eval()
    module(torch.randn(2, 3, 8, 8)).sum().backward()
    assert module.unk_embed.grad is not None and not module.unk_embed.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unk_embed_zero_dims_and_zero_width(backend):
    """Item 10: a 0-d unk_embed with D = 1 raised IndexError; D = 0 raised RuntimeError on torch."""
    jigsaw = identity_jigsaw(2, 3)
    with pytest.raises(ValueError, match="unk_embed"):
        mjp_pos_embed(torch.randn(2, 3, 1), torch.randn(3, 1), torch.randn(()), jigsaw, backend=backend)
    tokens = torch.randn(2, 3, 0, requires_grad=True)
    out = mjp_pos_embed(tokens, torch.randn(3, 0), torch.randn(0), jigsaw, backend=backend)
    assert out.shape == (2, 3, 0)
    out.sum().backward()
    assert tokens.grad.shape == (2, 3, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_backward(backend):
    """Item 15: the Triton backward of B = 0 with a weight that needs a gradient: ZeroDivisionError."""
    weight = torch.randn(4, 3, 2, 2, requires_grad=True)
    out = mjp_patch_embed(torch.randn(0, 3, 4, 4), weight, None, torch.randn(4, 4), None, backend=backend)
    out.sum().backward()
    assert weight.grad is not None and not weight.grad.any()
