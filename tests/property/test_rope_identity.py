"""Property tests of :func:`mjp_fast.ops.rope_identity.rope_identity` (issue 42): on random tables (``[N, E]``,
``[H, N, E]``, a mixed rope's ``[depth, H, N, E]``; every float dtype; contiguous or not), random masks (batch 0
included) and either ``validate``, the output is its docstring's formula, ``out[..., b, ..., n, :] = identity if
mask[b, n] else rope[..., n, :]`` in the documented batched shape and ``rope``'s dtype, equal to the oracle
``rope_identity_ref``; its gradient is the formula's (the sum over the samples that keep the row). ``validate``
must be a bool, and bad tables and masks are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mjp_fast.ops.rope_identity import rope_identity, rope_identity_ref
from tests.property.common import random_tensor

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def tables_and_masks(draw: st.DrawFn) -> dict:
    """A rotary table of 2, 3 or 4 dims (positions on dim -2, [sin, cos] on dim -1) and a bool mask ``[B, N]``."""
    positions, half = draw(st.integers(1, 7)), draw(st.integers(1, 4))
    depth, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    leading = draw(st.sampled_from(((), (heads,), (depth, heads))))  # [N, E], [H, N, E], [depth, H, N, E]
    batch = draw(st.integers(0, 3))
    bits = draw(st.lists(st.booleans(), min_size=batch * positions, max_size=batch * positions))
    seed = draw(st.integers(0, 2**16))
    shape = (*leading, positions, 2 * half)
    return dict(
        rope=random_tensor(shape, draw(st.sampled_from(DTYPES)), seed, contiguous=draw(st.booleans())),
        mask=torch.tensor(bits, dtype=torch.bool).reshape(batch, positions),
        validate=draw(st.booleans()),
    )


def batched_shape(rope: torch.Tensor, batch: int) -> tuple[int, ...]:
    """The docstring's shapes: ``[N, E] -> [B, 1, N, E]``, ``[H, N, E] -> [B, H, N, E]``, ``[depth, H, N, E] ->
    [depth, B, H, N, E]``."""
    if rope.dim() == 2:
        return (batch, 1, *rope.shape)
    if rope.dim() == 3:
        return (batch, *rope.shape)
    return (rope.shape[0], batch, *rope.shape[1:])


def by_sample(out: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """``out`` as ``[B, ..., N, E]`` (a mixed rope's depth moved behind the batch)."""
    return out.transpose(0, 1) if rope_dims == 4 else out


@given(tables_and_masks())
def test_rope_identity_is_the_documented_formula_and_the_oracle(case):
    rope, mask = case["rope"], case["mask"]
    out = rope_identity(rope, mask, validate=case["validate"])
    batch, (positions, width) = mask.shape[0], rope.shape[-2:]
    assert out.shape == batched_shape(rope, batch) and out.dtype == rope.dtype and out.device == rope.device
    identity = torch.cat((torch.zeros(width // 2), torch.ones(width // 2))).to(rope.dtype)
    samples = by_sample(out, rope.dim())  # [B, (1 | H | depth, H), N, E]
    table = rope if rope.dim() != 2 else rope[None]
    for b in range(batch):
        for n in range(positions):
            expected = identity.expand_as(table[..., n, :]) if mask[b, n] else table[..., n, :]
            assert torch.equal(samples[b][..., n, :], expected), (b, n)
    assert torch.equal(out, rope_identity_ref(rope, mask))  # data movement: exact


@given(tables_and_masks(), st.integers(0, 2**16))
def test_rope_identity_gradient_is_the_sum_over_the_samples_that_keep_the_row(case, seed):
    rope, mask = case["rope"].detach().requires_grad_(True), case["mask"]
    out = rope_identity(rope, mask, validate=case["validate"])
    grad = random_tensor(tuple(out.shape), rope.dtype, seed)
    (got,) = torch.autograd.grad(out, rope, grad)
    # [B, ..., N, E] with the masked rows zeroed, summed over the samples in float64: the formula's gradient
    samples = by_sample(grad, rope.dim()).double()
    kept = (~mask).double().reshape(mask.shape[0], *[1] * (samples.dim() - 3), mask.shape[1], 1)
    expected = (samples * kept).sum(0).reshape(rope.shape)
    assert got.shape == rope.shape and got.dtype == rope.dtype
    if mask.shape[0] <= 1:
        assert torch.equal(got.double(), expected.to(rope.dtype).double())  # one term per entry: no rounding
    else:  # a sum of B terms in the dtype: within B - 1 roundings of the sum of their sizes
        bound = (mask.shape[0] - 1) * torch.finfo(rope.dtype).eps * samples.abs().sum(0).reshape(rope.shape)
        assert bool(((got.double() - expected).abs() <= bound).all())


@given(tables_and_masks())
def test_validate_false_gives_what_validate_true_gives(case):
    rope, mask = case["rope"], case["mask"]
    assert torch.equal(rope_identity(rope, mask, validate=False), rope_identity(rope, mask, validate=True))


@given(tables_and_masks())
def test_meta_tensors_give_a_meta_output_of_the_documented_shape(case):
    rope, mask = case["rope"].to("meta"), case["mask"].to("meta")
    out = rope_identity(rope, mask, validate=case["validate"])
    assert out.device.type == "meta" and out.shape == batched_shape(rope, mask.shape[0]) and out.dtype == rope.dtype


NOT_BOOLS = (None, "yes", "", 1, 0, 1.0, 0.0, torch.tensor(True), [True])


@given(tables_and_masks(), st.sampled_from(NOT_BOOLS))
def test_validate_must_be_a_bool(case, validate):
    with pytest.raises(TypeError, match="validate") as caught:
        rope_identity(case["rope"], case["mask"], validate=validate)
    assert "bool" in str(caught.value), str(caught.value)


MISTAKES = {
    "rope a list": (lambda rope, mask: (rope.tolist(), mask), TypeError, "rope"),
    "rope integer": (lambda rope, mask: (rope.long(), mask), TypeError, "rope"),
    "rope 1 dim": (lambda rope, mask: (rope.flatten(), mask), ValueError, "rope"),
    "rope 5 dims": (lambda rope, mask: (rope[None, None, None], mask), ValueError, "rope"),
    "rope odd width": (lambda rope, mask: (rope[..., :-1], mask), ValueError, "rope"),
    "rope no width": (lambda rope, mask: (rope[..., :0], mask), ValueError, "rope"),
    "mask float": (lambda rope, mask: (rope, mask.float()), TypeError, "mask"),
    "mask int": (lambda rope, mask: (rope, mask.long()), TypeError, "mask"),
    "mask 1 dim": (lambda rope, mask: (rope, mask.flatten()), ValueError, "mask"),
    "mask 3 dims": (lambda rope, mask: (rope, mask[None]), ValueError, "mask"),
    "mask positions": (lambda rope, mask: (rope, torch.cat((mask, mask[:, :1]), dim=1)), ValueError, "mask"),
    "mask a list": (lambda rope, mask: (rope, mask.tolist()), TypeError, "mask"),
}


@given(tables_and_masks(), st.sampled_from(sorted(MISTAKES)))
def test_bad_tables_and_masks_are_refused_by_name(case, mistake):
    change, error, name = MISTAKES[mistake]
    rope, mask = change(case["rope"], case["mask"])
    for function in (rope_identity, rope_identity_ref):
        with pytest.raises(error, match=name):
            function(rope, mask)
