"""The validation inside a run: the metrics of :mod:`mjp_fast.evaluate` on the run's validation loader, as the
epoch record's keys. The one place where training calls evaluation (``train`` imports ``evaluate``, never the
other way at import time)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.evaluate.position import model_position_regression
from mjp_fast.train.config import TrainConfig


def validation_metrics(
    model: nn.Module,
    loader: DataLoader,
    config: TrainConfig,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> dict[str, float | None]:
    """Top-1, top-5 (percent), the validation loss, consistency (percent, at ``eval_ratio`` with ``eval_seed``) and
    diff-norm of ``model`` on ``loader`` (this rank's shard; summed over the ranks), under the record's keys."""
    results = evaluate_model(
        model,
        loader,
        device=device,
        mean=torch.tensor(config.mean),
        std=torch.tensor(config.std),
        ratio=config.eval_ratio,
        seed=config.eval_seed,
        amp_dtype=amp_dtype,
        criterion=nn.CrossEntropyLoss(),
    )
    return {
        "top1": results["top1"],
        "top5": results["top5"],
        "val_loss": results["loss"],
        "consistency": results["consistency"],
        "diff_norm": results["diff_norm"],
    }


def position_metrics(model: nn.Module) -> dict[str, Any]:
    """The position regression's mean absolute errors (1D and 2D, in grid cells) of ``model``'s position
    embeddings; None for a model without them."""
    regression = model_position_regression(model)
    return {
        "pos_mae_1d": regression["mae_1d"] if regression else None,
        "pos_mae_2d": regression["mae_2d"] if regression else None,
    }
