"""rope_identity: the identity rotation at the shuffled positions, one table per sample, against its oracle."""

import pytest
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

from mjp_fast.ops.rope_identity import rope_identity, rope_identity_ref


def identity_row(width, dtype=torch.float32):
    return torch.cat((torch.zeros(width // 2, dtype=dtype), torch.ones(width // 2, dtype=dtype)))


ROPE_SHAPES = {
    "one_position": (1, 2),  # N = 1, E = 2
    "odd_positions": (7, 6),
    "heads": (3, 5, 8),  # [H, N, E]
    "mixed": (2, 3, 5, 8),  # [depth, H, N, E]
    "mixed_one_position": (3, 1, 1, 4),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rope_identity_equals_the_oracle_with_gradients(shape, batch, dtype):
    torch.manual_seed(0)
    rope = torch.randn(*shape, dtype=dtype, requires_grad=True)
    mask = torch.rand(batch, shape[-2]) < 0.5
    mask[0, 0] = True
    got, expected = rope_identity(rope, mask), rope_identity_ref(rope, mask)
    batched = {2: (batch, 1, *shape), 3: (batch, *shape), 4: (shape[0], batch, *shape[1:])}[len(shape)]
    assert got.shape == batched and got.dtype == dtype
    assert torch.equal(got, expected)  # data movement: exact
    grad = torch.randn_like(got)
    got_grad, expected_grad = (torch.autograd.grad(out, rope, grad)[0] for out in (got, expected))
    if dtype == torch.float64:
        assert torch.equal(got_grad, expected_grad)
        return
    # The sum over the batch in another order: at most twice the oracle's error (against float64), or one rounding.
    wide = rope.detach().double().requires_grad_()
    truth = torch.autograd.grad(rope_identity_ref(wide, mask), wide, grad.double())[0]
    error = lambda gradient: float((gradient.double() - truth).abs().max())  # noqa: E731
    rounding = torch.finfo(dtype).eps * float(truth.abs().max())
    assert error(got_grad) <= 2 * max(error(expected_grad), rounding)


def test_rope_identity_of_a_non_contiguous_table_and_an_empty_batch():
    rope = torch.randn(6, 5).t()  # [5, 6], not contiguous
    mask = torch.tensor([[True, False, False, True, False]])
    assert torch.equal(rope_identity(rope, mask), rope_identity_ref(rope, mask))
    empty = torch.zeros(0, 5, dtype=torch.bool)
    assert rope_identity(rope, empty).shape == rope_identity_ref(rope, empty).shape == (0, 1, 5, 6)


def test_rope_identity_gradcheck():
    rope = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 4) < 0.5
    assert torch.autograd.gradcheck(lambda table: rope_identity(table, mask), (rope,))


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
def test_the_identity_rows_do_not_rotate(half):
    torch.manual_seed(0)
    rope = torch.randn(5, 8)
    mask = torch.tensor([[True, False, True, False, False]])
    x = torch.randn(1, 2, 5, 4)  # [B, heads, N, head_dim]
    rotated = apply_rot_embed_cat(x, rope_identity(rope, mask), half=half)
    assert torch.equal(rotated[:, :, mask[0]], x[:, :, mask[0]])
    assert torch.equal(rotated[:, :, ~mask[0]], apply_rot_embed_cat(x, rope, half=half)[:, :, ~mask[0]])


BAD_INPUTS = {
    "rope_not_a_tensor": (lambda rope, mask: ([[0.0, 1.0]], mask), TypeError, "rope"),
    "rope_integer": (lambda rope, mask: (rope.long(), mask), TypeError, "rope"),
    "rope_1d": (lambda rope, mask: (rope[0], mask), ValueError, "rope"),
    "rope_5d": (lambda rope, mask: (rope[None, None, None], mask), ValueError, "rope"),
    "rope_odd_width": (lambda rope, mask: (rope[:, :3], mask), ValueError, "even"),
    "mask_not_bool": (lambda rope, mask: (rope, mask.float()), TypeError, "mask"),
    "mask_1d": (lambda rope, mask: (rope, mask[0]), ValueError, "mask"),
    "mask_positions": (lambda rope, mask: (rope, mask[:, :2]), ValueError, "mask"),
}


@pytest.mark.parametrize("change, error, words", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_rope_identity_names_bad_inputs(change, error, words):
    rope, mask = change(torch.randn(3, 4), torch.zeros(2, 3, dtype=torch.bool))
    for function in (rope_identity, rope_identity_ref):
        with pytest.raises(error, match=words):
            function(rope, mask)
