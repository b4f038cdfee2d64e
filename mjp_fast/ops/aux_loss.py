"""An auxiliary loss that trains with the model's output: the output's backward also back-propagates ``weight *
aux_loss``.

MJP's DAL loss is computed in the model's forward (from the position table, which the forward reads anyway). A loop
that back-propagates only its criterion of the model's output (timm's ``train.py``) would never reach it, and DDP
would find the DAL regressor's parameters unused. :func:`attach_aux_loss` ties the loss to the output instead: the
forward is the identity on the output (a view of it), and its backward returns the output's gradient unchanged plus
``weight`` as the gradient of the loss, so ``output.backward(g)`` computes the gradients of ``<output, g> + weight *
aux_loss``. Megatron-LM trains its MoE load-balancing loss the same way (``MoEAuxLossAutoScaler``).

``weight`` is a 0-d tensor (a model's buffer, filled in place between steps: no host sync, and compiled or captured
graphs keep reading the same memory). Set it before the forward whose backward should apply it: eager backwards
read it when they run, a compiled graph may read it at its forward. The attached gradient is not scaled with the
output's: a loop that scales its loss before the backward (``loss / accum_steps``, a loss scaler) scales ``weight``
alike, or uses the explicit loss.

A loop may still add the loss itself (``total = criterion + w * aux``): :func:`explicit_aux_loss` returns the attached
loss so that its backward subtracts the attached weight, and a backward that reaches both counts the loss at ``w``
only. The gradients add up over backward calls, so this holds whenever the output and the explicit loss are
back-propagated equally often: one total, the same total again (``retain_graph``), or one backward of each. (A
backward of the explicit loss without the output gives ``grad - weight``: the loss's share comes with the output's.)
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------------
# Oracle. Both backwards are affine in the output's gradient (the loss's gradient is the weight, whatever the
# output's), which no composition of differentiable torch operations is: the oracle is the backward itself, of the
# output and the loss side by side.
# ----------------------------------------------------------------------------------------------------------------


def aux_loss_backward_ref(
    output: torch.Tensor, aux_loss: torch.Tensor, grad: torch.Tensor, weight: float | torch.Tensor
) -> None:
    """Oracle of a backward of :func:`attach_aux_loss`'s output with ``grad`` (``weight``: the attached one) or of
    that output plus :func:`explicit_aux_loss` at ``weight`` (the loop's, which replaces the attached one): the
    gradients of ``<output, grad> + weight * aux_loss``, of the plain ``output`` and ``aux_loss``."""
    weight = torch.as_tensor(weight, dtype=aux_loss.dtype, device=aux_loss.device)
    torch.autograd.backward([output, aux_loss], [grad, weight])


# ----------------------------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------------------------


class _AttachAuxLoss(torch.autograd.Function):
    """output (any shape), aux_loss and weight 0-d. Forward: a view of ``output``. Backward: the output's gradient,
    and ``weight`` for the loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, weight):  # type: ignore[override]
        # Kept on ctx, not saved: unpacking saved tensors doubles the backward's host time (about 11 us more on the
        # CPU), and the weight is no activation (the module's docstring says when it is read).
        ctx.weight = weight
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # The buffer itself, in the loss's place: autograd adds it to the loss's other gradients out of place (it
        # steals only a gradient nobody else holds), and the loss's backward only reads it.
        return grad, ctx.weight if ctx.needs_input_grad[1] else None, None


class _ExplicitAuxLoss(torch.autograd.Function):
    """aux_loss and weight 0-d. Forward: a view of ``aux_loss``. Backward: ``grad - weight``."""

    @staticmethod
    def forward(ctx, aux_loss, weight):  # type: ignore[override]
        ctx.weight = weight
        return aux_loss.view_as(aux_loss)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad - ctx.weight, None


class _KeepInGraph(torch.autograd.Function):
    """output (any shape), unused (a tensor the forward did not use). Forward: a view of ``output``. Backward: the
    output's gradient, and zeros for ``unused``."""

    @staticmethod
    def forward(ctx, output, unused):  # type: ignore[override]
        ctx.unused_like = (unused.shape, unused.dtype, unused.device)  # its gradient's; nothing to save
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shape, dtype, device = ctx.unused_like
        return grad, torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None


# ----------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``output`` (as a view), whose backward also back-propagates ``weight * aux_loss``.

    Args:
        output: the tensor the loop back-propagates through (a model's tokens), any shape and float dtype.
        aux_loss: a 0-d loss computed in the same forward.
        weight: 0-d float tensor (not differentiated); set it before the forward (see the module's docstring).

    Returns:
        ``output``'s values, same shape and dtype.
    """
    return _AttachAuxLoss.apply(output, aux_loss, weight)


def explicit_aux_loss(aux_loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An attached loss (:func:`attach_aux_loss`, at ``weight``) for a loop that adds it to its total itself.

    The value is ``aux_loss``'s; the backward passes ``grad - weight`` on, so that together with the attached
    gradient the loss counts at the weight the loop gave it, not at that plus ``weight``. A backward of this alone
    (without the output) gives ``grad - weight``: use it with the output, as a training loss does.
    """
    return _ExplicitAuxLoss.apply(aux_loss, weight)


def keep_in_graph(output: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    """``output`` (as a view) whose backward gives ``unused`` a zero gradient.

    A parameter that takes no part in a forward (MJP's ``unk_embed`` while the jigsaw is off: ``prob`` 0 during
    warm-up, ratio 0) then still gets a gradient from the output, which is its true gradient (the loss does not
    depend on it), so DDP, which by default requires a gradient for every parameter, needs no
    ``find_unused_parameters``.

    Args:
        output: the tensor the loop back-propagates through, any shape and float dtype.
        unused: a tensor (a parameter) that ``output`` does not depend on.

    Returns:
        ``output``'s values, same shape and dtype.
    """
    return _KeepInGraph.apply(output, unused)
