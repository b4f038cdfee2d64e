"""Dense absolute localization (DAL): regress each unmasked position embedding to its grid coordinates.

``loss = c * sum_n w_n * |g(E_pos[n]) - (row_n, col_n)|_1 / sum_n w_n``, with ``w_n`` the number of samples in the
batch that keep position ``n`` unmasked (1 for every position without a mask). ``c`` is the reduction over the two
coordinates: ``reduction="mean"`` (the default, ``c = 1/2``) is what the paper's code computes (``F.l1_loss(xy,
predxy)`` in its ``ssl/losses.py``: the mean over positions and over the two coordinates); ``reduction="sum"``
(``c = 1``) is the paper's formula, the L1 norm of each position's error, which weighs DAL twice as much at the
same weight (0.01). The paper's code regresses raw integer coordinates; ``normalize=True`` scales them to [0, 1].

Every backend computes in float32, or in float64 for a float64 table (so that gradcheck can verify the backward),
and returns the loss in that dtype. A position that every sample of the batch masks (weight 0) is out of the loss:
for a per-position regressor (:class:`mjp_fast.DALRegressor` ``linear`` or ``nonlinear``) its row of the table,
even inf or NaN, reaches neither the loss nor any gradient, on every backend. A regressor that reads the whole
table at once (``pca``, a user's module) sees every row, as the oracle gives it the table: only its output at such
positions is left out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mjp_fast import backend as backend_module
from mjp_fast._eager_cache import eager_cache
from mjp_fast._validate import (
    SUPPORTED_FLOAT_DTYPES,
    check_float_dtype,
    check_grid_size,
    check_position_table,
    check_tensor,
)
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
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, one of {', '.join(DAL_REDUCTIONS)}, got {type(reduction).__name__}")
    if reduction not in DAL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(DAL_REDUCTIONS)}, got {reduction!r}")
    return DAL_REDUCTIONS[reduction]


def compute_dtype(table: torch.Tensor) -> torch.dtype:
    """The dtype the DAL loss computes and returns in: float64 for a float64 table, float32 otherwise."""
    return torch.float64 if table.dtype == torch.float64 else torch.float32


def dal_loss_ref(
    pos_embed: torch.Tensor,
    regressor: nn.Module,
    grid_size: int | tuple[int, int],
    mask: torch.Tensor | None = None,
    normalize: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """Oracle: the loss of every sample, one by one, averaged over all the batch's unmasked tokens.

    A per-position regressor (one with :func:`fused_layers`) maps only the positions that some sample keeps; any
    other regressor maps the whole table. Returns a 0-d tensor in :func:`compute_dtype` of the table.
    """
    dal_scale(reduction)  # checks the name
    rows, cols = check_grid_size(grid_size)
    pos = pos_embed.reshape(rows * cols, -1)
    dtype = compute_dtype(pos)
    coords = grid_coordinates((rows, cols), normalize=normalize, device=pos.device).to(dtype)

    def per_position_error(table: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        errors = (regressor(table).to(dtype) - targets).abs()
        return errors.mean(-1) if reduction == "mean" else errors.sum(-1)

    if mask is not None and fused_layers(regressor) is not None:
        used = ~mask.all(0)  # the positions some sample keeps: the others are no input of the loss
        per_position = pos.new_zeros(rows * cols, dtype=dtype).index_put(
            (used,), per_position_error(pos[used], coords[used])
        )
    else:
        per_position = per_position_error(pos, coords)
    if mask is None:
        return per_position.mean()
    kept = [per_position[~sample_mask] for sample_mask in mask]
    total = sum((k.sum() for k in kept), per_position.new_zeros(()))  # a 0-d tensor for an empty batch too
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

if backend_module.triton_usable():
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
        loss, saved = outputs
        ctx.save_for_backward(pos, w1, w2, coords, saved)
        ctx.scale, ctx.skip_rows, ctx.has_bias = scale, skip_rows, (b1 is not None, b2 is not None)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        pos, w1, w2, coords, saved = ctx.saved_tensors
        arguments = (grad, pos, ctx.skip_rows, w1, w2, coords, saved, ctx.scale, *ctx.has_bias)
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
    layers = fused_layers(regressor)
    if layers is not None and backend != "torch" and backend != "triton":
        return _extension_operator()(pos.contiguous(), skip_rows, *layers, coords, mask, scale)
    if layers is not None and backend == "triton" and pos.dtype != torch.float64:
        return _FusedDALTriton.apply(pos.contiguous(), skip_rows, *layers, coords, mask, scale)
    num_positions = coords.shape[0]
    dtype = compute_dtype(pos)
    table = pos[..., skip_rows:, :].reshape(num_positions, pos.shape[-1])
    weights = None
    if mask is not None:
        # Weight of a position: how many samples keep it unmasked. Stays on the device: no host sync.
        weights = (~mask).sum(0, dtype=dtype)
        if layers is not None:
            # A per-position regressor: the rows no sample keeps are no input (read as zeros), so that their values,
            # even inf or NaN, reach neither the loss nor the gradients (as in the fused kernels).
            table = torch.where(weights[:, None] > 0, table, 0)
    prediction = regressor(table)
    if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != (num_positions, 2):
        shape = list(prediction.shape) if isinstance(prediction, torch.Tensor) else type(prediction).__name__
        raise ValueError(f"regressor must map [N, D] to [N, 2] = [{num_positions}, 2], got {shape}")
    per_position = (prediction.to(dtype) - coords.to(dtype)).abs().sum(-1) * scale
    if weights is None:
        return per_position.mean()
    if layers is None:  # a module that reads the whole table: its output at the unkept positions is left out
        per_position = torch.where(weights > 0, per_position, 0)
    return (per_position * weights).sum() / weights.sum().clamp_min(1.0)


def _check_fused_regressor(layers: tuple | None, pos_embed: torch.Tensor) -> None:
    """The checks a fused kernel would otherwise make with a RuntimeError: the regressor's layers are floating
    tensors on the table's device, the first one as wide as the table (``D``)."""
    if layers is None:
        return
    dim = pos_embed.shape[-1]
    width = (layers[0] if layers[0] is not None else layers[2]).shape[-1]
    if width != dim:
        raise ValueError(
            f"pos_embed must end in D = {width} (the regressor's input width), got {list(pos_embed.shape)}"
        )
    for layer in layers:
        if layer is None:
            continue
        if layer.dtype not in SUPPORTED_FLOAT_DTYPES:
            raise TypeError(
                f"regressor: its parameters must be float32, float16, bfloat16 or float64, got {layer.dtype}"
            )
        if layer.device != pos_embed.device:
            raise ValueError(f"mixed devices: pos_embed on {pos_embed.device}, the regressor on {layer.device}")


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
        A 0-d tensor, float32 (float64 for a float64 ``pos_embed``; the regressor's dtype may differ from the
        table's on every backend): the L1 error ``(|d_row| + |d_col|) / 2`` (``"sum"``: without the 1/2) averaged
        over the batch's unmasked tokens (zero when every token is masked). A position that every sample masks is
        out of the loss and, for a per-position regressor, out of its gradients (see the module's docstring).
    """
    scale = dal_scale(reduction)
    rows, cols = check_grid_size(grid_size)
    num_positions = rows * cols
    pos_embed = check_tensor("pos_embed", pos_embed, ndims=(2, 3))
    check_float_dtype("pos_embed", pos_embed)
    # Any D (the regressor checks its own); the table goes on as given, [1, N, D] too.
    check_position_table(pos_embed, num_positions, pos_embed.shape[-1], f"N = {rows}x{cols} = {num_positions}")
    if not isinstance(regressor, nn.Module) and not callable(regressor):
        raise TypeError(f"regressor must be an nn.Module mapping [N, D] to [N, 2], got {type(regressor).__name__}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    _check_fused_regressor(fused_layers(regressor), pos_embed)
    chosen = backend_module.resolve_backend(backend, pos_embed.device)
    if mask is not None:
        mask = check_tensor("mask", mask, ndims=(2,))
        if mask.dtype != torch.bool or mask.shape[1] != num_positions:
            raise ValueError(f"mask must be bool [B, {num_positions}], got {mask.dtype} {list(mask.shape)}")
        if mask.device != pos_embed.device:
            raise ValueError(f"mixed devices: pos_embed on {pos_embed.device}, mask on {mask.device}")
    coords = cached_grid_coordinates(rows, cols, bool(normalize), str(pos_embed.device))
    return dal_loss_unchecked(pos_embed, regressor, coords, mask, chosen, scale=scale)
