"""``attach_aux_loss`` and ``explicit_aux_loss`` (mjp_fast/ops/aux_loss.py) against their oracle: the backward of
the plain output and the loss side by side, at the attached weight or at the loop's, which replaces it."""

import pytest
import torch

from mjp_fast.ops.aux_loss import attach_aux_loss, aux_loss_backward_ref, explicit_aux_loss, keep_in_graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_functions_match_their_oracle(dtype):
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(2, 5, 3, generator=generator, requires_grad=True)
    scale = torch.randn(3, generator=generator, requires_grad=True)
    weight = torch.tensor(0.3)
    grad = torch.randn(2, 5, 3, generator=generator).to(dtype)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        source.grad = scale.grad = None
        return source.to(dtype) * 2, (scale.square().sum() - 1).abs()  # the loss in float32, as DAL

    for loop_weight in (None, 0.7, 0.0):
        output, loss = inputs()
        out = attach_aux_loss(output, loss, weight)
        assert out.dtype == dtype and torch.equal(out, output) and out._base is output  # a view, the same values
        if loop_weight is None:
            out.backward(grad)
        else:
            explicit = explicit_aux_loss(loss, weight)
            assert torch.equal(explicit, loss)
            torch.autograd.backward([out, explicit], [grad, torch.tensor(loop_weight)])
        ours = source.grad.clone(), scale.grad.clone()
        aux_loss_backward_ref(*inputs(), grad, weight if loop_weight is None else loop_weight)
        torch.testing.assert_close(ours, (source.grad, scale.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keep_in_graph_gives_the_unused_tensor_a_zero_gradient_and_the_output_its_own(dtype):
    output = torch.randn(2, 3, 4, dtype=dtype, requires_grad=True)
    unused = torch.randn(4, dtype=torch.float32, requires_grad=True)
    kept = keep_in_graph(output * 2, unused)
    assert torch.equal(kept, output * 2) and kept.dtype == dtype
    grad = torch.randn_like(output)
    kept.backward(grad)
    torch.testing.assert_close(output.grad, 2 * grad)
    assert unused.grad is not None and unused.grad.dtype == torch.float32 and not unused.grad.any()
    frozen = torch.randn(4)  # no gradient asked for: none given
    keep_in_graph(output, frozen).sum().backward()
    assert frozen.grad is None
