"""The Triton weight gradient through the inverse permutation (issue 39).

``dW = sum_t dY[t]^T A[perm[t]]`` is a sum over the tokens, in any order. With a perm known to be a permutation
(``permutation=True``: a validated jigsaw, or a sampler's), the weight gradient reads the patches in their natural
order and gathers the gradient's rows by ``inverse[b, perm[b, n]] = n``, which the position gradient's partials
kernel writes in the pass it makes anyway. Checked here in the interpreter against the float64 reference (a Conv2d
and a gather), against the patch-gathering path, and for which launches carry which flags.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import mjp_fast  # noqa: E402
from mjp_fast.triton import common  # noqa: E402
from mjp_fast.triton import patch_embed as patch_kernels  # noqa: E402
from tests.triton.helpers import PREFIXES, patch_embed_reference, random_jigsaw  # noqa: E402

# Awkward sizes: a 3 x 5 grid (N = 15, odd), patches of 3 (K = 2 * 9 = 18: two K tiles of 16), D = 19 (two channel
# blocks), batch 3 (45 tokens: three M tiles, the last partial).
GRID, PATCH, CHANNELS, DIM, BATCH = (3, 5), 3, 2, 19, 3
NUM_POSITIONS = GRID[0] * GRID[1]


def _inputs(dtype: torch.dtype, masked: str, prefix: tuple[int, int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    prefix_count, prefix_positions = prefix
    images = torch.randn(BATCH, CHANNELS, GRID[0] * PATCH, GRID[1] * PATCH, generator=generator).to(dtype)
    weight = (torch.randn(DIM, CHANNELS, PATCH, PATCH, generator=generator) / 3).to(dtype)
    bias = torch.randn(DIM, generator=generator).to(dtype)
    unk = torch.randn(DIM, generator=generator).to(dtype)
    pos = torch.randn(1, prefix_positions + NUM_POSITIONS, DIM, generator=generator).to(dtype)
    prefix_tokens = torch.randn(1, prefix_count, DIM, generator=generator).to(dtype) if prefix_count else None
    mask, perm = random_jigsaw(BATCH, NUM_POSITIONS, masked, generator)
    grad = torch.randn(BATCH, prefix_count + NUM_POSITIONS, DIM, generator=generator).to(dtype)
    return images, weight, bias, unk, pos, prefix_tokens, mask, perm, grad


def _backward(images, weight, perm, mask, grad, prefix, pos, prefix_tokens, needs, permutation):
    prefix_count, prefix_positions = prefix
    prefix_shape = list(prefix_tokens.shape) if prefix_tokens is not None else [0]
    return patch_kernels.patch_embed_backward_launch(
        grad, images, weight, perm, mask, *needs, prefix_count, prefix_positions, list(pos.shape), prefix_shape,
        None, None, None, None, permutation,
    )  # fmt: skip


@pytest.mark.parametrize("masked", ["some", "all", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("prefix", PREFIXES, ids=lambda prefix: f"P{prefix[0]}Q{prefix[1]}")
def test_the_inverse_path_gives_the_weight_gradient_of_the_formula(prefix, dtype, masked):
    images, weight, bias, unk, pos, prefix_tokens, mask, perm, grad = _inputs(dtype, masked, prefix, seed=len(masked))
    needs = [False, True, True, True, True, prefix[0] > 0]
    inverse = _backward(images, weight, perm, mask, grad, prefix, pos, prefix_tokens, needs, permutation=True)
    gathered = _backward(images, weight, perm, mask, grad, prefix, pos, prefix_tokens, needs, permutation=False)

    leaf = weight.double().requires_grad_()
    tables = [tensor.double() if tensor is not None else None for tensor in (bias, pos, unk, prefix_tokens)]
    truth = patch_embed_reference(images.double(), leaf, *tables[:3], perm, mask, tables[3], prefix[1])
    (want,) = torch.autograd.grad(truth, leaf, grad.double())
    eps = max(torch.finfo(dtype).eps, 1e-6)
    scale = max(want.abs().max().item(), 1.0)
    got = inverse[1]
    assert got.dtype == dtype and got.shape == weight.shape
    torch.testing.assert_close(got.double(), want, atol=4 * eps * scale, rtol=2 * eps)
    # the same sum in another order: the gathering path agrees within the float32 sums' rounding
    torch.testing.assert_close(got.double(), gathered[1].double(), atol=4 * eps * scale, rtol=2 * eps)
    # the position pass that wrote the inverse gives the same bits as without it
    for index in range(2, 6):
        if needs[index]:
            assert torch.equal(inverse[index], gathered[index]), index


def _record_flags(monkeypatch) -> list[tuple[str, dict]]:
    """The name and constexpr flags of every kernel the two modules launch (the launches still run)."""
    recorded = []
    for module in (patch_kernels, common):
        original = module.launcher

        def recording(kernel, grid, traced, original=original):
            launch = original(kernel, grid, traced)

            def run(*args, **kwargs):
                name = getattr(kernel, "__name__", None) or kernel.fn.__name__
                recorded.append((name, {key: value for key, value in kwargs.items() if key.isupper()}))
                return launch(*args, **kwargs)

            return run

        monkeypatch.setattr(module, "launcher", recording)
    return recorded


@pytest.mark.parametrize("permutation", [True, False])
def test_the_position_pass_writes_the_inverse_before_the_weight_gradient_reads_it(monkeypatch, permutation):
    images, weight, _, _, pos, prefix_tokens, mask, perm, grad = _inputs(torch.float32, "some", (1, 1), seed=7)
    recorded = _record_flags(monkeypatch)
    _backward(images, weight, perm, mask, grad, (1, 1), pos, prefix_tokens, [False, True, True, True, True, True],
              permutation)  # fmt: skip
    names = [name for name, _ in recorded]
    flags = dict(recorded)
    if permutation:
        # no launch more than the gathering path: the partials kernel writes the inverse in its own pass
        assert names == ["_position_partials_kernel", "_position_reduce_kernel", "_grad_weight_kernel"]
        assert flags["_position_partials_kernel"]["INVERSE"] is True
        assert flags["_grad_weight_kernel"]["INVERSE"] is True and flags["_grad_weight_kernel"]["HAS_PERM"] is False
    else:
        assert flags["_position_partials_kernel"]["INVERSE"] is False
        assert flags["_grad_weight_kernel"]["INVERSE"] is False and flags["_grad_weight_kernel"]["HAS_PERM"] is True


@pytest.mark.parametrize(
    "needs",
    [
        [False, True, False, False, False, False],  # the weight alone: no position pass to write the inverse
        [True, True, False, False, False, False],  # and the images' gradient
    ],
    ids=["weight", "weight+images"],
)
def test_without_a_position_pass_the_weight_gradient_gathers_the_patches(monkeypatch, needs):
    images, weight, bias, unk, pos, _, mask, perm, grad = _inputs(torch.float32, "some", (0, 0), seed=11)
    recorded = _record_flags(monkeypatch)
    grads = _backward(images, weight, perm, mask, grad, (0, 0), pos, None, needs, permutation=True)
    flags = dict(recorded)
    assert "_position_partials_kernel" not in flags
    assert flags["_grad_weight_kernel"]["HAS_PERM"] is True and flags["_grad_weight_kernel"]["INVERSE"] is False
    leaf = weight.double().requires_grad_()
    truth = patch_embed_reference(images.double(), leaf, bias.double(), pos.double(), unk.double(), perm, mask)
    (want,) = torch.autograd.grad(truth, leaf, grad.double())
    torch.testing.assert_close(grads[1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("prefix_count", [0, 2])
def test_the_partials_kernel_writes_the_inverse_of_each_sample(monkeypatch, chunks, prefix_count):
    # Several batch chunks (forced, as on a GPU) and prefix rows: every sample's inverse, from its own perm rows.
    batch, num_positions, dim = 5, 11, 6
    generator = torch.Generator().manual_seed(chunks)
    mask, perm = random_jigsaw(batch, num_positions, "some", generator)
    grad = torch.randn(batch, prefix_count + num_positions, dim, generator=generator)
    planned = common._position_plan
    monkeypatch.setattr(common, "_position_plan", lambda grad, **flags: planned(grad, **flags, chunks=chunks))
    inverse = torch.full((batch, num_positions), -1, dtype=torch.int32)
    with_inverse = common.launch_position_gradient(
        grad, mask, perm, tokens_dtype=None, pos_dtype=torch.float32, unk_dtype=torch.float32,
        prefix_count=prefix_count, prefix_positions=prefix_count, inverse=inverse,
    )  # fmt: skip
    assert torch.equal(inverse.long(), perm.argsort(dim=1))
    without = common.launch_position_gradient(
        grad, mask, None, tokens_dtype=None, pos_dtype=torch.float32, unk_dtype=torch.float32,
        prefix_count=prefix_count, prefix_positions=prefix_count,
    )  # fmt: skip
    for got, want in zip(with_inverse[1:3], without[1:3]):
        assert torch.equal(got, want)


def test_an_inverse_of_the_wrong_kind_is_refused():
    grad, mask = torch.randn(2, 4, 3), torch.zeros(2, 4, dtype=torch.bool)
    perm = torch.arange(4).repeat(2, 1)
    dtypes = dict(tokens_dtype=None, pos_dtype=torch.float32, unk_dtype=torch.float32)
    for inverse, words in (
        (torch.empty(2, 4, dtype=torch.int64), "inverse must be a contiguous int32 tensor"),
        (torch.empty(2, 3, dtype=torch.int32), "inverse must be a contiguous int32 tensor of perm's shape"),
        (torch.empty(4, 2, dtype=torch.int32).t(), "inverse must be a contiguous int32 tensor"),
    ):
        with pytest.raises(ValueError, match=words):
            common.launch_position_gradient(grad, mask, perm, **dtypes, inverse=inverse)
    with pytest.raises(ValueError, match="inverse: written from perm, which is None"):
        common.launch_position_gradient(grad, mask, None, **dtypes, inverse=torch.empty(2, 4, dtype=torch.int32))


def test_the_public_paths_take_the_inverse_only_for_a_known_permutation(monkeypatch):
    # mjp_patch_embed with validate=True (the jigsaw is checked: a permutation), MJPPatchEmbed (its own sampler's
    # jigsaw); validate=False gathers the patches, since the perm may be any (mjp_fast/_validate.py).
    jigsaw = mjp_fast.sample_jigsaw(2, (2, 3), 0.5, seed=3, prob=1.0, min_block=1, backend="triton")
    images = torch.randn(2, 3, 8, 12)
    weight, bias = torch.randn(5, 3, 4, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    pos, unk = torch.randn(6, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    recorded = _record_flags(monkeypatch)
    gradients = {}
    for validate in (True, False):
        recorded.clear()
        out = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, jigsaw, backend="triton", validate=validate)
        (gradients[validate],) = torch.autograd.grad(out.square().sum(), weight)
        assert dict(recorded)["_grad_weight_kernel"]["INVERSE"] is validate
    torch.testing.assert_close(gradients[True], gradients[False], atol=1e-5, rtol=1e-5)

    module = mjp_fast.MJPPatchEmbed(
        img_size=(8, 12), patch_size=4, in_chans=3, embed_dim=5, ratio=0.5, prob=1.0, min_block=1, backend="triton"
    )
    recorded.clear()
    module(images).square().sum().backward()
    assert dict(recorded)["_grad_weight_kernel"]["INVERSE"] is True
