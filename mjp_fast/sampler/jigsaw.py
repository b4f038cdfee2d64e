"""The ``Jigsaw`` type: what the sampler makes and every operation that applies a jigsaw consumes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mjp_fast._validate import check_bool, check_same_device, check_tensor, holds_values


class Jigsaw(NamedTuple):
    """A batch of jigsaws.

    Attributes:
        mask: bool ``[B, N]``; True where the position is shuffled and gets the unknown position embedding.
        perm: int64 ``[B, N]``; token ``n`` of sample ``b`` shows patch ``perm[b, n]``. ``perm[b, n] == n`` where
            ``mask[b, n]`` is False; over the masked positions it is a permutation of them.
    """

    mask: torch.Tensor
    perm: torch.Tensor


def empty_jigsaw(batch_size: int, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised mask (bool ``[B, N]``) and perm (int64 ``[B, N]``): what a sampler kernel writes, and the
    operators' fake outputs."""
    return (
        torch.empty(batch_size, num_positions, dtype=torch.bool, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.int64, device=device),
    )


def check_jigsaw(
    jigsaw: object, batch: int, num_positions: int, device: torch.device, *, validate: bool
) -> Jigsaw | None:
    """Checks a ``Jigsaw(mask [B, N] bool, perm [B, N] integer)`` against the batch; returns it with int64 perm.

    With ``validate`` (a bool, the public operations' argument of that name), also checks that ``perm`` permutes
    exactly the masked positions (a host sync on a GPU), except on the meta device, where there are no values to read.
    """
    check_bool("validate", validate)
    if jigsaw is None:
        return None
    if not isinstance(jigsaw, tuple) or len(jigsaw) != 2:
        raise TypeError(f"jigsaw must be a Jigsaw(mask, perm) or None, got {type(jigsaw).__name__}")
    mask = check_tensor("jigsaw.mask", jigsaw[0], ndims=(2,))
    perm = check_tensor("jigsaw.perm", jigsaw[1], ndims=(2,))
    if mask.dtype != torch.bool:
        raise TypeError(f"jigsaw.mask must be a bool tensor, got {mask.dtype}")
    if perm.dtype.is_floating_point or perm.dtype.is_complex or perm.dtype == torch.bool:
        raise TypeError(f"jigsaw.perm must be an integer tensor, got {perm.dtype}")
    expected = (batch, num_positions)
    for name, tensor in (("jigsaw.mask", mask), ("jigsaw.perm", perm)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape [batch, N] = {list(expected)}, got {list(tensor.shape)}")
    check_same_device(inputs=torch.empty(0, device=device), mask=mask, perm=perm)
    perm = perm.to(torch.int64)
    if validate and perm.numel() > 0 and holds_values(perm):
        positions = torch.arange(num_positions, device=device)
        if bool(((perm < 0) | (perm >= num_positions)).any()):
            raise ValueError(f"jigsaw.perm has values outside [0, {num_positions})")
        if not bool(((perm == positions) | mask).all()):
            raise ValueError("jigsaw.perm must be the identity where jigsaw.mask is False")
        hits = torch.zeros_like(perm).scatter_add_(1, perm, torch.ones_like(perm))
        if not bool((hits == 1).all()):
            raise ValueError("jigsaw.perm is not a permutation of the masked positions (a position repeats)")
    return Jigsaw(mask, perm)
