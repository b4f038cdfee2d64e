"""Position regression (supplementary section 3.1): how well a linear map recovers each patch's position from its
learned position embedding.

Linear regression (scikit-learn's ``LinearRegression``) from the embedding of each patch position to

- its 1D index ``n`` in ``0 .. N-1`` (row-major), and
- its 2D grid coordinates ``(row, col)``,

evaluated by 5-fold cross-validation (``KFold``, shuffled with a fixed seed): the mean absolute error on each
held-out fold, then the mean and standard deviation over the folds. Units are grid cells: ``mae_1d`` counts
positions along the row-major order, ``mae_2d`` is the error per coordinate (the mean over rows and columns);
``mae_2d_normalized`` divides each coordinate by its range (``rows - 1``, ``cols - 1``), so it is in [0, 1]
units and comparable across grid sizes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def patch_position_embeddings(model: nn.Module) -> tuple[np.ndarray, tuple[int, int]] | None:
    """The learned position embeddings of the patch positions ``[N, D]`` (class/register positions removed) and
    the grid ``(rows, cols)``; None for a model without absolute position embeddings."""
    pos_embed = getattr(model, "pos_embed", None)
    embed = getattr(model, "patch_embed", None)
    if not isinstance(pos_embed, torch.Tensor) or embed is None:
        return None
    grid = tuple(int(size) for size in embed.grid_size)
    count = grid[0] * grid[1]
    table = pos_embed.detach().float().cpu().reshape(-1, pos_embed.shape[-1])
    prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 0))
    table = table[prefix:]
    if table.shape[0] != count:  # a layout this function does not know: take the last N rows
        table = table[-count:]
    return table.numpy(), grid


def grid_targets(grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(1D indices ``[N]``, 2D coordinates ``[N, 2]`` as (row, col)), row-major."""
    rows, cols = grid
    index = np.arange(rows * cols)
    return index.astype(np.float64), np.stack((index // cols, index % cols), axis=1).astype(np.float64)


def _cross_validated_mae(features: np.ndarray, targets: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Per-fold mean absolute error (over samples and target dimensions) of held-out predictions."""
    from sklearn.linear_model import LinearRegression
    from sklearn.model_selection import KFold

    errors = []
    for train_index, test_index in KFold(n_splits=folds, shuffle=True, random_state=seed).split(features):
        regression = LinearRegression().fit(features[train_index], targets[train_index])
        predicted = regression.predict(features[test_index])
        errors.append(np.abs(predicted - targets[test_index]).mean())
    return np.asarray(errors)


def position_regression(
    embeddings: np.ndarray, grid: tuple[int, int], *, folds: int = 5, seed: int = 0
) -> dict[str, float]:
    """Cross-validated MAE of linear regression from ``embeddings`` ``[N, D]`` to 1D and 2D positions.

    Returns:
        ``mae_1d``, ``mae_1d_std``, ``mae_2d``, ``mae_2d_std``, ``mae_2d_normalized``, ``mae_2d_normalized_std``
        (means and standard deviations over the folds).
    """
    embeddings = np.asarray(embeddings, dtype=np.float64)
    rows, cols = grid
    if embeddings.ndim != 2 or embeddings.shape[0] != rows * cols:
        raise ValueError(f"embeddings must be [rows*cols, D] = [{rows * cols}, D], got {list(embeddings.shape)}")
    if not 2 <= folds <= embeddings.shape[0]:
        raise ValueError(
            f"folds must be in [2, {embeddings.shape[0]}] for {embeddings.shape[0]} positions, got {folds}"
        )
    index, coordinates = grid_targets(grid)
    mae_1d = _cross_validated_mae(embeddings, index, folds, seed)
    mae_2d = _cross_validated_mae(embeddings, coordinates, folds, seed)
    scale = np.array([max(rows - 1, 1), max(cols - 1, 1)], dtype=np.float64)
    mae_2d_normalized = _cross_validated_mae(embeddings, coordinates / scale, folds, seed)
    return {
        "mae_1d": float(mae_1d.mean()),
        "mae_1d_std": float(mae_1d.std()),
        "mae_2d": float(mae_2d.mean()),
        "mae_2d_std": float(mae_2d.std()),
        "mae_2d_normalized": float(mae_2d_normalized.mean()),
        "mae_2d_normalized_std": float(mae_2d_normalized.std()),
    }


def model_position_regression(model: nn.Module, *, folds: int = 5, seed: int = 0) -> dict[str, float] | None:
    """:func:`position_regression` of a model's learned position embeddings; None when it has none."""
    found = patch_position_embeddings(model)
    if found is None:
        return None
    embeddings, grid = found
    if embeddings.shape[0] < folds:
        return None
    return position_regression(embeddings, grid, folds=folds, seed=seed)
