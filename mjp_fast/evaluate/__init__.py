"""``mjp eval``: the paper's measurements (accuracy, consistency, diff-norm, position regression, plots, corruptions).

from mjp_fast.evaluate import evaluate_checkpoint
results = evaluate_checkpoint("runs/x/mjp/last.pt")
"""

from typing import Any

from mjp_fast.evaluate.metrics import accuracy, consistency, diff_norm, evaluate_model
from mjp_fast.evaluate.ood_metrics import aupr, auroc, aurra, fpr_at_recall, rms_calibration_error
from mjp_fast.evaluate.position import position_regression

__all__ = [
    "accuracy",
    "aupr",
    "auroc",
    "aurra",
    "consistency",
    "diff_norm",
    "evaluate_checkpoint",
    "evaluate_model",
    "fpr_at_recall",
    "position_regression",
    "rms_calibration_error",
]


def __getattr__(name: str) -> Any:
    # evaluate_checkpoint builds on the training package, which imports this one: load it on first use.
    if name == "evaluate_checkpoint":
        from mjp_fast.evaluate.run import evaluate_checkpoint

        return evaluate_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
