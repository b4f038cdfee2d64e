"""``permute_rows``: ``out[b, n] = x[b, perm[b, n]]``, the move of a jigsaw, with the gather's exact gradient.

An entry of ``perm`` outside ``[0, N)`` (possible only with ``validate=False``; see :mod:`mjp_fast._validate`)
moves a zero row and sends no gradient back: the index is clamped into the sample's own rows before the move and
the row zeroed after it, so no entry ever reaches another sample's rows or memory outside ``x``, and nothing waits
for the device. The backward adds each row's gradient where it came from (``index_add_``): the exact gradient of the
gather for any ``perm``, a permutation or not.
"""

from __future__ import annotations

import torch


def _source_rows(perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, valid)``: the flat rows of ``[B * N]`` that ``perm`` ``[B, N]`` reads (an out-of-range entry reads
    its sample's row 0) and where its entries are in ``[0, N)``."""
    batch, num_positions = perm.shape
    valid = (perm >= 0) & (perm < num_positions)
    rows = torch.where(valid, perm, 0) + torch.arange(batch, device=perm.device)[:, None] * num_positions
    return rows, valid


def move_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[b, n, ...] = x[b, perm[b, n], ...]`` (``x`` ``[B, N, ...]``, ``perm`` int64 ``[B, N]``; zeros where the
    entry is outside ``[0, N)``) as one ``index_select``, without an autograd node of its own: for the autograd nodes
    that move rows both ways."""
    batch, num_positions = perm.shape
    rows, valid = _source_rows(perm)
    moved = x.reshape(batch * num_positions, *x.shape[2:]).index_select(0, rows.reshape(-1))  # no -1: B may be 0
    invalid = ~valid.reshape(batch, num_positions, *([1] * (x.dim() - 2)))
    return moved.reshape(x.shape).masked_fill_(invalid, 0)


def move_rows_back(grad: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`move_rows`: ``out[b, m] = sum of grad[b, n] over the n with perm[b, n] = m`` (zeros where
    no entry names ``m``; an out-of-range entry adds nothing). ``grad`` ``[B, N, ...]``; returns a fresh tensor."""
    batch, num_positions = perm.shape
    rows, valid = _source_rows(perm)
    total = batch * num_positions
    # An out-of-range entry adds its row to one spare row past the end, dropped after.
    targets = torch.where(valid, rows, total).reshape(-1)
    flat = grad.reshape(total, *grad.shape[2:])
    out = flat.new_zeros((total + 1, *grad.shape[2:])).index_add_(0, targets, flat)
    return out[:total].reshape(grad.shape)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(perm)
        return move_rows(x, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (perm,) = ctx.saved_tensors
        return move_rows_back(grad.contiguous(), perm), None


def permute_rows_ref(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Oracle: ``torch.gather`` along dim 1 (``perm`` in range)."""
    index = perm.reshape(*perm.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, index)


def permute_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[b, n, ...] = x[b, perm[b, n], ...]`` for ``x`` ``[B, N, ...]`` and ``perm`` int64 ``[B, N]``.

    A jigsaw's perm permutes each sample's positions; any other ``perm`` gets the defined result of
    :mod:`mjp_fast._validate` (zero rows for out-of-range entries, the gather's exact gradient).
    """
    return _PermuteRows.apply(x, perm)
