"""What ``mjp eval`` writes of its results: the Markdown table it prints and the JSON file (``eval.json``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mjp_fast._atomic import write_atomically
from mjp_fast.evaluate.robustness_table import robustness_rows, stored_corruption_rows


def _number(value: Any, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def results_table(results: dict[str, Any]) -> str:
    """The headline numbers, the on-the-fly corruption proxy's table, the robustness benchmarks beside the paper's
    numbers and the ImageNet-C / CIFAR-10-C tables (:mod:`mjp_fast.evaluate.robustness_table`), as Markdown."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| top-1 (%) | {_number(results['top1'])} |",
        f"| top-5 (%) | {_number(results['top5'])} |",
        f"| consistency (%), ratio {results['eval_ratio']}, {results['jigsaw']} | {_number(results['consistency'])} |",
        f"| diff-norm | {_number(results['diff_norm'], '{:.3f}')} |",
        f"| position MAE 1D (cells) | {_number(results['pos_mae_1d'], '{:.3f}')} |",
        f"| position MAE 2D (cells) | {_number(results['pos_mae_2d'], '{:.3f}')} |",
        f"| precision of the clean pass | {results.get('precision', '-')} |",
    ]
    corruption = results.get("corruptions")
    if corruption:
        lines += [
            "",
            "| on-the-fly corruption (proxy, not ImageNet-C) | "
            + " | ".join(f"error s{s}" for s in corruption["severities"])
            + " | mean | CE vs baseline |",
        ]
        lines.append("|---|" + "---|" * (len(corruption["severities"]) + 2))
        for name, errors in corruption["error"].items():
            ce = corruption.get("ce", {}).get(name)
            cells = " | ".join(_number(error) for error in errors)
            lines.append(f"| {name} | {cells} | {_number(corruption['mean_error'][name])} | {_number(ce)} |")
        lines.append(f"\nmean corruption error of the on-the-fly proxy: {_number(results['mean_corruption_error'])}")
        if corruption.get("mce") is not None:
            lines.append(f"proxy mCE relative to {corruption['baseline']}: {_number(corruption['mce'])}")
    lines += robustness_rows(results) + stored_corruption_rows(results)
    if results.get("plots"):
        lines.append("\nplots: " + ", ".join(results["plots"]))
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    """Writes ``results`` to ``path`` as indented JSON, atomically, NaN and infinities as null; returns the path."""
    path = Path(path)
    with write_atomically(path, text=True) as file:
        file.write(json.dumps(_finite(results), indent=2, allow_nan=False, default=_json_default) + "\n")
    return path


def _finite(value: Any) -> Any:
    """NaN and infinities become None (null): JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
