"""Dense absolute localization (DAL): regress each unmasked position embedding to its grid coordinates.

``loss = sum_n w_n * |g(E_pos[n]) - (row_n, col_n)|_1 / sum_n w_n``, with ``w_n`` the number of samples in the
batch that keep position ``n`` unmasked (1 for every position without a mask). The paper's code regresses raw
integer coordinates; ``normalize=True`` scales them to [0, 1] instead.
"""

from __future__ import annotations

import torch
from torch import nn

from mjp_fast import backend as backend_module
from mjp_fast._validate import check_grid_size, check_tensor


def grid_coordinates(
    grid_size: int | tuple[int, int], *, normalize: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """float32 ``[N, 2]``: ``(row, col)`` of every position ``n = row * cols + col``, optionally scaled to [0, 1]."""
    rows, cols = check_grid_size(grid_size)
    row = torch.arange(rows, device=device, dtype=torch.float32).repeat_interleave(cols)
    col = torch.arange(cols, device=device, dtype=torch.float32).repeat(rows)
    if normalize:
        row, col = row / max(rows - 1, 1), col / max(cols - 1, 1)
    return torch.stack((row, col), dim=1)


def dal_loss_ref(
    pos_embed: torch.Tensor,
    regressor: nn.Module,
    grid_size: int | tuple[int, int],
    mask: torch.Tensor | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """Oracle: the loss of every sample, one by one, averaged over all the batch's unmasked tokens."""
    rows, cols = check_grid_size(grid_size)
    pos = pos_embed.reshape(rows * cols, -1)
    errors = (regressor(pos).float() - grid_coordinates((rows, cols), normalize=normalize, device=pos.device)).abs()
    per_position = errors.sum(-1)
    if mask is None:
        return per_position.mean()
    kept = [per_position[~sample_mask] for sample_mask in mask]
    total = sum(k.sum() for k in kept)
    count = sum(k.numel() for k in kept)
    return total / max(count, 1)


def dal_loss(
    pos_embed: torch.Tensor,
    regressor: nn.Module,
    grid_size: int | tuple[int, int],
    mask: torch.Tensor | None = None,
    normalize: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The DAL loss of DESIGN.md section 4, without a host sync.

    Args:
        pos_embed: ``[N, D]`` or ``[1, N, D]``, the patch positions' embeddings (no class token).
        regressor: maps ``[N, D]`` to ``[N, 2]`` (a :class:`mjp_fast.DALRegressor`).
        grid_size: an int or ``(rows, cols)`` with ``rows * cols == N``.
        mask: bool ``[B, N]`` from the batch's jigsaw (True = shuffled, excluded), or None to use every position.
        normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        backend: checked as for every operation; the loss is a few thousand flops, so every backend computes it
            with the same torch operations.

    Returns:
        A float32 scalar: the L1 error ``|d_row| + |d_col|`` averaged over the batch's unmasked tokens (zero
        when every token is masked).
    """
    pos_embed = check_tensor("pos_embed", pos_embed, ndims=(2, 3))
    rows, cols = check_grid_size(grid_size)
    num_positions = rows * cols
    if pos_embed.shape[-2] != num_positions or (pos_embed.dim() == 3 and pos_embed.shape[0] != 1):
        raise ValueError(
            f"pos_embed must be [N, D] or [1, N, D] with N = {rows}x{cols} = {num_positions}, "
            f"got shape {list(pos_embed.shape)}"
        )
    if not isinstance(regressor, nn.Module) and not callable(regressor):
        raise TypeError(f"regressor must be an nn.Module mapping [N, D] to [N, 2], got {type(regressor).__name__}")
    backend_module.resolve_backend(backend, pos_embed.device)
    pos = pos_embed.reshape(num_positions, pos_embed.shape[-1])
    prediction = regressor(pos)
    if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != (num_positions, 2):
        shape = list(prediction.shape) if isinstance(prediction, torch.Tensor) else type(prediction).__name__
        raise ValueError(f"regressor must map [N, D] to [N, 2] = [{num_positions}, 2], got {shape}")
    target = grid_coordinates((rows, cols), normalize=normalize, device=pos.device)
    per_position = (prediction.float() - target).abs().sum(-1)
    if mask is None:
        return per_position.mean()
    mask = check_tensor("mask", mask, ndims=(2,))
    if mask.dtype != torch.bool or mask.shape[1] != num_positions:
        raise ValueError(f"mask must be bool [B, {num_positions}], got {mask.dtype} {list(mask.shape)}")
    if mask.device != pos.device:
        raise ValueError(f"mixed devices: pos_embed on {pos.device}, mask on {mask.device}")
    # Weight of a position: how many samples keep it unmasked. Stays on the device: no host sync.
    weights = (~mask).sum(0, dtype=torch.float32)
    return (per_position * weights).sum() / weights.sum().clamp_min(1.0)
