"""The robustness part of ``mjp eval``'s printed tables (Markdown): each benchmark's headline numbers for the model
and the baseline beside the paper's DeiT-S and DeiT-S + MJP, then the per-corruption tables of ImageNet-C and
CIFAR-10-C.

Reads the results' ``imagenet_c`` and ``cifar10_c`` (:func:`mjp_fast.evaluate.common_corruptions.corruption_table`)
and, when present, ``imagenet_a`` (``top1``, ``aurra``, ``calibration_rms``), ``imagenet_r`` (``top1``) and
``imagenet_o`` (``aupr``), all in percent; a benchmark's baseline numbers are its ``baseline`` dict.
"""

from __future__ import annotations

import math
from typing import Any

# The paper's robustness table (Ren et al., "Masked Jigsaw Puzzle", CVPR 2023, "Robustness to common corruptions and
# adversarial examples"): DeiT-S and DeiT-S + MJP trained on ImageNet-1K. The supplementary's Table 4 gives
# per-corruption numbers for 10 of the 15 corruptions with another mean (44.0 -> 41.5); the main table's are these.
PAPER_ROBUSTNESS: dict[tuple[str, str], tuple[float, float]] = {
    ("imagenet_c", "mce"): (54.6, 51.6),
    ("imagenet_a", "top1"): (19.2, 21.6),
    ("imagenet_a", "aurra"): (25.1, 29.8),
    ("imagenet_o", "aupr"): (20.9, 22.6),
}
# (results key, metric, row label): the headline rows, in the paper's order, then the rest.
ROWS = (
    ("imagenet_c", "mce", "ImageNet-C mCE (%, AlexNet = 100) ↓"),
    ("imagenet_c", "mce_vs_baseline", "ImageNet-C mCE relative to the baseline (%) ↓"),
    ("imagenet_c", "mean_corruption_error", "ImageNet-C mean error, unnormalized (%) ↓"),
    ("imagenet_a", "top1", "ImageNet-A top-1 (%) ↑"),
    ("imagenet_a", "aurra", "ImageNet-A AURRA (%) ↑"),
    ("imagenet_a", "calibration_rms", "ImageNet-A calibration error, RMS (%) ↓"),
    ("imagenet_o", "aupr", "ImageNet-O AUPR (%) ↑"),
    ("imagenet_r", "top1", "ImageNet-R top-1 (%) ↑"),
    ("cifar10_c", "mean_corruption_error", "CIFAR-10-C mean corruption error (%) ↓"),
    ("cifar10_c", "mce_vs_baseline", "CIFAR-10-C mCE relative to the baseline (%) ↓"),
)
RELATIVE = "mce_vs_baseline"  # the baseline's own is 100 by definition
STORED = {"imagenet_c": "ImageNet-C", "cifar10_c": "CIFAR-10-C"}


def _number(value: Any, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def _baseline_value(section: dict[str, Any], metric: str) -> Any:
    if metric == RELATIVE:
        return 100.0 if section.get(RELATIVE) is not None else None
    baseline = section.get("baseline")
    return baseline.get(metric) if isinstance(baseline, dict) else None


def robustness_rows(results: dict[str, Any]) -> list[str]:
    """The headline table: a row per metric that the results have, with the model, the baseline (when measured)
    and the paper's DeiT-S and DeiT-S + MJP (where the paper has the metric); none without any benchmark."""
    rows = []
    for key, metric, label in ROWS:
        section = results.get(key)
        if not isinstance(section, dict) or metric not in section:
            continue
        paper = PAPER_ROBUSTNESS.get((key, metric), (None, None))
        cells = [section[metric], _baseline_value(section, metric), *paper]
        rows.append(f"| {label} | " + " | ".join(_number(cell) for cell in cells) + " |")
    if not rows:
        return []
    return [
        "",
        "| robustness | model | baseline | paper DeiT-S | paper DeiT-S + MJP |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "paper: Ren et al., CVPR 2023, DeiT-S with and without MJP trained on ImageNet-1K (the mCE over the 15 "
        "ImageNet-C corruptions)",
    ]


def stored_corruption_rows(results: dict[str, Any]) -> list[str]:
    """For ImageNet-C and CIFAR-10-C (when measured): each corruption's error per severity, its mean, its CE
    against the reference (AlexNet, ImageNet-C only) and, with a baseline, the baseline's mean and the CE against
    it; then the mCE with the corruptions it covers."""
    lines: list[str] = []
    for key, name in STORED.items():
        table = results.get(key)
        if not isinstance(table, dict):
            continue
        has_reference = table.get("ce") is not None
        baseline = table.get("baseline")
        header = f"| {name} corruption | family | " + " | ".join(f"error s{s}" for s in table["severities"])
        header += " | mean |" + (" CE (AlexNet = 100) |" if has_reference else "")
        header += " baseline mean | CE vs baseline |" if baseline else ""
        covered = len(table["corruptions_in_mce"])
        scope = (
            "the means cover the 15 corruptions"
            if not table["missing"]
            else f"the means cover {covered} of the 15 corruptions (missing: {', '.join(table['missing'])}), so the "
            "mCE is not comparable with a published one"
        )
        lines += ["", f"{name}: {table['dir']}, {table['images']} images a pass; {scope}", "", header]
        lines.append("|---|---|" + "---|" * (header.count("|") - 3))
        for family, names in table["families"].items():
            for corruption in names:
                cells = [*table["error"][corruption], table["mean_error"][corruption]]
                if has_reference:
                    cells.append(table["ce"].get(corruption))
                if baseline:
                    cells += [baseline["mean_error"][corruption], table["ce_vs_baseline"][corruption]]
                shown = family if family != "extra" else "extra (outside the mCE)"
                lines.append(f"| {corruption} | {shown} | " + " | ".join(_number(cell) for cell in cells) + " |")
        lines.append("")
        if has_reference:
            lines.append(f"{name} mCE (AlexNet = 100): {_number(table['mce'])}")
        lines.append(f"{name} mean corruption error, unnormalized: {_number(table['mean_corruption_error'])}")
        if baseline:
            lines.append(
                f"{name} mCE relative to the baseline ({table.get('baseline_checkpoint', '')}): "
                f"{_number(table['mce_vs_baseline'])}"
            )
    return lines
