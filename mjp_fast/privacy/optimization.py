"""The optimization attack for standard models: gradient matching on a dummy image.

For any model (pre-norm blocks included, where the analytic attack does not apply), it optimises a dummy image
``x'`` in [0, 1] with Adam so that its gradients match the client's ``g*``::

    J(x') = (1 - cos(g(x'), g*))  +  pos_weight * (1 - cos(g_pos(x'), g*_pos))  +  tv_weight * TV(x')

- ``cos(g, g*)``: cosine similarity of all parameter gradients, flattened and concatenated (Geiping et al.,
  "Inverting gradients", 2020);
- the position-embedding term: the same cosine on the gradient of the position embedding alone, which APRIL
  shows carries the most information about the patches (its optimization variant);
- ``TV``: anisotropic total variation, the mean absolute difference of neighbouring pixels.

The label is read from the head's bias gradient (:func:`~mjp_fast.privacy.model.infer_label`) unless given.
After each step the image is projected back onto [0, 1]; the learning rate follows a cosine schedule. The
attacker runs the model plainly (no jigsaw): it does not know the client's mask or permutation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from mjp_fast.privacy.model import client_gradients, infer_label


@dataclass(frozen=True)
class OptimizationResult:
    """``images [1, C, H, W]`` the reconstruction in [0, 1]; ``objective`` the value of J at every step."""

    images: torch.Tensor
    label: int
    objective: list[float] = field(default_factory=list)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of vertically and horizontally neighbouring pixels (a scalar)."""
    vertical = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    horizontal = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return vertical + horizontal


def _cosine_distance(first: list[torch.Tensor], second: list[torch.Tensor]) -> torch.Tensor:
    dot = sum((a * b).sum() for a, b in zip(first, second, strict=True))
    norm_a = torch.sqrt(sum(a.square().sum() for a in first))
    norm_b = torch.sqrt(sum(b.square().sum() for b in second))
    return 1 - dot / (norm_a * norm_b).clamp_min(1e-30)


def gradient_matching_objective(
    dummy_gradients: Mapping[str, torch.Tensor],
    target_gradients: Mapping[str, torch.Tensor],
    images: torch.Tensor,
    *,
    pos_embed: str | None = "pos_embed",
    pos_weight: float = 1.0,
    tv_weight: float = 0.01,
) -> torch.Tensor:
    """J for one dummy: cosine distance of all gradients, plus that of ``pos_embed``'s, plus total variation."""
    names = [name for name in target_gradients if name in dummy_gradients]
    if not names:
        raise ValueError("the dummy's and the client's gradients share no parameter name")
    objective = _cosine_distance([dummy_gradients[n] for n in names], [target_gradients[n] for n in names])
    if pos_embed is not None and pos_weight:
        if pos_embed not in target_gradients:
            raise KeyError(f"gradients lack {pos_embed!r}; pass pos_embed=None for a model without one")
        objective = objective + pos_weight * _cosine_distance(
            [dummy_gradients[pos_embed]], [target_gradients[pos_embed]]
        )
    if tv_weight:
        objective = objective + tv_weight * total_variation(images)
    return objective


def optimization_attack(
    model: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    image_shape: tuple[int, int, int],
    *,
    label: int | None = None,
    steps: int = 300,
    lr: float = 0.1,
    pos_embed: str | None = "pos_embed",
    pos_weight: float = 1.0,
    tv_weight: float = 0.01,
    head_bias: str = "head.bias",
    seed: int = 0,
    callback: Callable[[int, float], None] | None = None,
) -> OptimizationResult:
    """Reconstructs one client image by gradient matching.

    Args:
        model: the model the client used, with the parameters it had (``forward(images)`` gives logits).
        gradients: the client's ``{parameter name: gradient}``.
        image_shape: ``(C, H, W)``.
        label: the client's class; default: inferred from ``gradients[head_bias]``.
        steps: Adam steps (a few hundred to a few thousand for a good reconstruction).
        lr: Adam's initial learning rate, on pixel values in [0, 1].
        pos_embed: the name of the position-embedding parameter, or None to drop that term.
        pos_weight: weight of the position-embedding term.
        tv_weight: weight of the total variation.
        head_bias: the classifier's bias, for the label.
        seed: the dummy's initialisation.
        callback: called as ``callback(step, objective)`` after every step.

    Returns:
        An :class:`OptimizationResult`.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    parameter = next(model.parameters())
    dtype, device = parameter.dtype, parameter.device
    target = {name: g.detach().to(device=device, dtype=dtype) for name, g in gradients.items()}
    if label is None:
        label = infer_label(target, head_bias)
    generator = torch.Generator().manual_seed(seed)
    start = (0.5 + 0.1 * torch.randn((1, *image_shape), generator=generator, dtype=torch.float64)).clamp(0, 1)
    dummy = start.to(device=device, dtype=dtype).requires_grad_(True)
    optimizer = torch.optim.Adam([dummy], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    history: list[float] = []
    was_training = model.training
    model.eval()
    try:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            dummy_gradients = client_gradients(model, dummy, label, create_graph=True)
            objective = gradient_matching_objective(
                dummy_gradients, target, dummy, pos_embed=pos_embed, pos_weight=pos_weight, tv_weight=tv_weight
            )
            (pixel_gradient,) = torch.autograd.grad(objective, dummy)
            dummy.grad = pixel_gradient
            optimizer.step()
            schedule.step()
            with torch.no_grad():
                dummy.clamp_(0, 1)
            history.append(float(objective.detach()))
            if callback is not None:
                callback(step, history[-1])
    finally:
        model.train(was_training)
    return OptimizationResult(dummy.detach(), label, history)
