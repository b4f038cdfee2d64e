"""Dense absolute localization (DAL): regress each unmasked position embedding to its grid coordinates.

``loss = c * sum_n w_n * |g(E_pos[n]) - (row_n, col_n)|_1 / sum_n w_n``, with ``w_n`` the number of samples in the
batch that keep position ``n`` unmasked (1 for every position without a mask). ``c`` is the reduction over the two
coordinates: ``reduction="mean"`` (the default, ``c = 1/2``) is what the paper's code computes (``F.l1_loss(xy,
predxy)`` in its ``ssl/losses.py``: the mean over positions and over the two coordinates); ``reduction="sum"``
(``c = 1``) is the paper's formula, the L1 norm of each position's error, which weighs DAL twice as much at the
same weight (0.01). The paper's code regresses raw integer coordinates; ``normalize=True`` scales them to [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mjp_fast import backend as backend_module
from mjp_fast._eager_cache import eager_cache
from mjp_fast._validate import check_grid_size, check_position_table, check_tensor
from mjp_fast.ops.dal_regressor import fused_layers


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


# The reductions over the two coordinates, as the factor on their sum (module docstring).
DAL_REDUCTIONS: dict[str, float] = {"mean": 0.5, "sum": 1.0}


def dal_scale(reduction: str) -> float:
    """The factor on the per-position L1 sum that gives ``reduction`` (``"mean"`` or ``"sum"``)."""
    if reduction not in DAL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(DAL_REDUCTIONS)}, got {reduction!r}")
    return DAL_REDUCTIONS[reduction]


def dal_loss_ref(
    pos_embed: torch.Tensor,
    regressor: nn.Module,
    grid_size: int | tuple[int, int],
    mask: torch.Tensor | None = None,
    normalize: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """Oracle: the loss of every sample, one by one, averaged over all the batch's unmasked tokens."""
    dal_scale(reduction)  # checks the name
    rows, cols = check_grid_size(grid_size)
    pos = pos_embed.reshape(rows * cols, -1)
    errors = (regressor(pos).float() - grid_coordinates((rows, cols), normalize=normalize, device=pos.device)).abs()
    per_position = errors.mean(-1) if reduction == "mean" else errors.sum(-1)
    if mask is None:
        return per_position.mean()
    kept = [per_position[~sample_mask] for sample_mask in mask]
    total = sum(k.sum() for k in kept)
    count = sum(k.numel() for k in kept)
    return total / max(count, 1)


@eager_cache(maxsize=64)
def cached_grid_coordinates(rows: int, cols: int, normalize: bool, device: str) -> torch.Tensor:
    """:func:`grid_coordinates` float32 ``[rows * cols, 2]``: made once per grid and device in eager mode (the
    per-step path builds nothing); under torch.compile a few arange ops in the graph, which it can fold."""
    return grid_coordinates((rows, cols), normalize=normalize, device=torch.device(device))


# ----------------------------------------------------------------------------------------------------------------
# Fused kernels: the compiled extension (cpu, cuda: its operator carries its own autograd, in C++) and Triton (one
# autograd node here)
# ----------------------------------------------------------------------------------------------------------------

if backend_module.triton_importable():
    from mjp_fast.triton import dal_loss as _triton_kernels


@eager_cache()
def _extension_operator() -> Callable[..., torch.Tensor]:
    """``dal_loss_extension_autograd`` (the extension's fused DAL with its autograd in C++), looked up once: each
    attribute of ``torch.ops`` is a Python lookup, and this runs every step."""
    return torch.ops.mjp_fast.dal_loss_extension_autograd.default


class _FusedDALTriton(torch.autograd.Function):
    """The Triton kernels of the regressor and the weighted L1 as one autograd node: one operation forward, one
    backward.

    pos: the position table, contiguous, its last two dims ``[skip_rows + N, D]`` (the model's whole table: its
    first ``skip_rows`` rows, the prefix tokens', are not regressed, and get zero gradient); the regressor's layers
    ``w1 [H, D]``, ``b1 [H]`` (None for the linear regressor), ``w2 [2, H]`` (``[2, D]``), ``b2 [2]`` or None;
    coords float32 ``[N, 2]``; mask bool ``[B, N]`` or None. Computes in float32. Eager calls launch the kernels
    directly; under torch.compile they go through their operators.
    """

    @staticmethod
    def forward(ctx, pos, skip_rows, w1, b1, w2, b2, coords, mask, scale):  # type: ignore[override]
        arguments = (pos, skip_rows, w1, b1, w2, b2, coords, mask, scale)
        if torch.compiler.is_compiling():
            outputs = torch.ops.mjp_fast.dal_loss_triton(*arguments)
        else:
            outputs = _triton_kernels.dal_forward_launch(*arguments)
        loss, pred, hidden, weights = outputs
        ctx.save_for_backward(pos, w1, w2, coords, pred, hidden, weights)
        ctx.scale, ctx.skip_rows, ctx.has_bias = scale, skip_rows, (b1 is not None, b2 is not None)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        pos, w1, w2, coords, pred, hidden, weights = ctx.saved_tensors
        arguments = (grad, pos, ctx.skip_rows, w1, w2, coords, pred, hidden, weights, ctx.scale, *ctx.has_bias)
        if torch.compiler.is_compiling():
            grads = torch.ops.mjp_fast.dal_loss_triton_backward(*arguments)
        else:
            grads = _triton_kernels.dal_backward_launch(*arguments)
        grad_pos, grad_w1, grad_b1, grad_w2, grad_b2 = grads
        has_b1, has_b2 = ctx.has_bias
        return (
            grad_pos,
            None,
            grad_w1 if w1 is not None else None,
            grad_b1 if has_b1 else None,
            grad_w2,
            grad_b2 if has_b2 else None,
            None,
            None,
            None,
        )


def dal_loss_unchecked(
    pos: torch.Tensor,
    regressor: nn.Module,
    coords: torch.Tensor,
    mask: torch.Tensor | None,
    backend: str,
    skip_rows: int = 0,
    scale: float = DAL_REDUCTIONS["mean"],
) -> torch.Tensor:
    """:func:`dal_loss` for callers that checked the arguments and resolved the backend (the models' per-step
    path): ``pos`` the table, its last two dims ``[skip_rows + N, D]`` (a timm model's whole ``pos_embed``, with
    ``skip_rows`` the prefix tokens' rows), ``coords`` float32 ``[N, 2]`` on its device (see :func:`grid_coordinates`),
    ``mask`` bool ``[B, N]`` on its device or None; ``scale`` the reduction's factor (:func:`dal_scale`: 0.5 for the
    default mean over the two coordinates)."""
    layers = fused_layers(regressor) if backend != "torch" else None
    if layers is not None and backend != "triton":
        return _extension_operator()(pos.contiguous(), skip_rows, *layers, coords, mask, scale)
    if layers is not None and pos.dtype != torch.float64:
        return _FusedDALTriton.apply(pos.contiguous(), skip_rows, *layers, coords, mask, scale)
    num_positions = coords.shape[0]
    prediction = regressor(pos[..., skip_rows:, :].reshape(num_positions, pos.shape[-1]))
    if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != (num_positions, 2):
        shape = list(prediction.shape) if isinstance(prediction, torch.Tensor) else type(prediction).__name__
        raise ValueError(f"regressor must map [N, D] to [N, 2] = [{num_positions}, 2], got {shape}")
    per_position = (prediction.float() - coords).abs().sum(-1) * scale
    if mask is None:
        return per_position.mean()
    # Weight of a position: how many samples keep it unmasked. Stays on the device: no host sync.
    weights = (~mask).sum(0, dtype=torch.float32)
    return (per_position * weights).sum() / weights.sum().clamp_min(1.0)


def dal_loss(
    pos_embed: torch.Tensor,
    regressor: nn.Module,
    grid_size: int | tuple[int, int],
    mask: torch.Tensor | None = None,
    normalize: bool = False,
    *,
    reduction: str = "mean",
    backend: str | None = None,
) -> torch.Tensor:
    """The paper's DAL loss, without a host sync.

    Args:
        pos_embed: ``[N, D]`` or ``[1, N, D]``, the patch positions' embeddings (no class token).
        regressor: maps ``[N, D]`` to ``[N, 2]``. A :class:`mjp_fast.DALRegressor` of kind ``nonlinear`` or
            ``linear`` runs fused (the regressor and the loss in one kernel forward and one backward, in float32);
            any other module runs as itself.
        grid_size: an int or ``(rows, cols)`` with ``rows * cols == N``.
        mask: bool ``[B, N]`` from the batch's jigsaw (True = shuffled, excluded), or None to use every position.
        normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        reduction: over the two coordinates of a position's error: ``"mean"`` (default), as the paper's code
            (``F.l1_loss``), or ``"sum"``, the L1 norm of the paper's formula (twice the mean).
        backend: ``triton`` (its fused kernels), ``cpu`` or ``cuda`` (the compiled extension's fused operator),
            or ``torch`` (the regressor and torch operations); default ``MJP_FAST_BACKEND``, else the fastest for
            the device.

    Returns:
        A float32 scalar: the L1 error ``(|d_row| + |d_col|) / 2`` (``"sum"``: without the 1/2) averaged over the
        batch's unmasked tokens (zero when every token is masked).
    """
    scale = dal_scale(reduction)
    rows, cols = check_grid_size(grid_size)
    num_positions = rows * cols
    pos_embed = check_tensor("pos_embed", pos_embed, ndims=(2, 3))
    # Any D (the regressor checks its own); the table goes on as given, [1, N, D] too.
    check_position_table(pos_embed, num_positions, pos_embed.shape[-1], f"N = {rows}x{cols} = {num_positions}")
    if not isinstance(regressor, nn.Module) and not callable(regressor):
        raise TypeError(f"regressor must be an nn.Module mapping [N, D] to [N, 2], got {type(regressor).__name__}")
    chosen = backend_module.resolve_backend(backend, pos_embed.device)
    if mask is not None:
        mask = check_tensor("mask", mask, ndims=(2,))
        if mask.dtype != torch.bool or mask.shape[1] != num_positions:
            raise ValueError(f"mask must be bool [B, {num_positions}], got {mask.dtype} {list(mask.shape)}")
        if mask.device != pos_embed.device:
            raise ValueError(f"mixed devices: pos_embed on {pos_embed.device}, mask on {mask.device}")
    coords = cached_grid_coordinates(rows, cols, bool(normalize), str(pos_embed.device))
    return dal_loss_unchecked(pos_embed, regressor, coords, mask, chosen, scale=scale)
