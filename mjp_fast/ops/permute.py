"""``permute_rows``: ``out[b, n] = x[b, perm[b, n]]`` where each ``perm[b]`` is a permutation.

Because each row of ``perm`` is a permutation, the backward is the same move with the inverse permutation: a
gather, not the scatter-add that ``torch.gather``/``index_select`` backpropagate through (on the CPU,
``index_add_`` over token rows costs ten times the forward).
"""

from __future__ import annotations

import torch


def _flat_rows(perm: torch.Tensor) -> torch.Tensor:
    batch, num_positions = perm.shape
    return (perm + torch.arange(batch, device=perm.device)[:, None] * num_positions).reshape(-1)


def move_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[b, n, ...] = x[b, perm[b, n], ...]`` (``x`` ``[B, N, ...]``, ``perm`` int64 ``[B, N]``) as one
    ``index_select``, without an autograd node of its own: for the autograd nodes that move rows both ways."""
    batch, num_positions = perm.shape
    moved = x.reshape(batch * num_positions, *x.shape[2:]).index_select(0, _flat_rows(perm))  # no -1: B may be 0
    return moved.reshape(x.shape)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(perm)
        return move_rows(x, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (perm,) = ctx.saved_tensors
        inverse = torch.argsort(perm, dim=1)  # perm[b] is a permutation: its inverse undoes the move
        return move_rows(grad.contiguous(), inverse), None


def permute_rows_ref(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Oracle: ``torch.gather`` along dim 1."""
    index = perm.reshape(*perm.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, index)


def permute_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[b, n, ...] = x[b, perm[b, n], ...]`` for ``x`` ``[B, N, ...]`` and ``perm`` int64 ``[B, N]``.

    Every ``perm[b]`` must be a permutation of ``range(N)`` (a jigsaw's perm is); the backward relies on it.
    """
    return _PermuteRows.apply(x, perm)
