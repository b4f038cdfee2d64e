"""The robustness part of ``mjp eval``'s printed tables (Markdown): each benchmark's headline numbers for the model
and the baseline beside the paper's DeiT-S and DeiT-S + MJP, then the per-corruption tables of ImageNet-C and
CIFAR-10-C.

Reads the results' ``imagenet_c`` and ``cifar10_c`` (:func:`mjp_fast.evaluate.common_corruptions.corruption_table`)
and, when present, ``imagenet_a`` (``top1``, ``aurra``, ``calibration_rms``), ``imagenet_r`` (``top1``,
``imagenet_200_top1``, ``top1_drop``) and ``imagenet_o`` (``aupr``, ``auroc``, ``fpr95``), all in percent; a
benchmark's baseline numbers are its ``baseline`` dict. A row computed on less than the whole release (a
benchmark's ``partial``) is marked, with what is missing under the table; so is each benchmark's ``precision``.
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
    ("imagenet_c", "relative_mce", "ImageNet-C relative mCE (%, AlexNet = 100, Eq. 2 of Hendrycks & Dietterich) ↓"),
    (
        "imagenet_c",
        "mce_vs_baseline",
        "ImageNet-C mean CE against the baseline (%, baseline = 100; not the relative mCE) ↓",
    ),
    ("imagenet_c", "mean_corruption_error", "ImageNet-C mean error over the 15 corruptions, unnormalized (%) ↓"),
    (
        "imagenet_c",
        "mean_corruption_error_with_extras",
        "ImageNet-C mean error over the 15 + 4 extra corruptions, unnormalized, as the authors' test.py (%) ↓",
    ),
    ("imagenet_a", "top1", "ImageNet-A top-1 (%) ↑"),
    ("imagenet_a", "aurra", "ImageNet-A AURRA (%) ↑"),
    ("imagenet_a", "calibration_rms", "ImageNet-A calibration error, RMS, the authors' calib_err (%) ↓"),
    ("imagenet_o", "aupr", "ImageNet-O AUPR (%) ↑"),
    ("imagenet_o", "auroc", "ImageNet-O AUROC (%) ↑"),
    ("imagenet_o", "fpr95", "ImageNet-O FPR at 95% recall (%) ↓"),
    ("imagenet_r", "top1", "ImageNet-R top-1 (%) ↑"),
    ("imagenet_r", "imagenet_200_top1", "ImageNet-200 top-1, ImageNet-R's classes (%) ↑"),
    ("imagenet_r", "top1_drop", "ImageNet-R drop from ImageNet-200 (points) ↓"),
    ("cifar10_c", "mean_corruption_error", "CIFAR-10-C mean corruption error (%) ↓"),
    (
        "cifar10_c",
        "mean_corruption_error_with_extras",
        "CIFAR-10-C mean corruption error over the 15 + 4 extra corruptions (%) ↓",
    ),
    ("cifar10_c", "mce_vs_baseline", "CIFAR-10-C mean CE against the baseline (%, baseline = 100) ↓"),
)
RELATIVE = "mce_vs_baseline"  # the baseline's own is 100 by definition
STORED = {"imagenet_c": "ImageNet-C", "cifar10_c": "CIFAR-10-C"}
NAMES = {**STORED, "imagenet_a": "ImageNet-A", "imagenet_r": "ImageNet-R", "imagenet_o": "ImageNet-O"}
# the rows whose coverage is not the benchmark's ``partial``, and the key that says theirs
PARTIAL_KEY = {"mean_corruption_error_with_extras": "partial_with_extras", "imagenet_200_top1": "imagenet_200_partial"}
PARTIAL_KEY["top1_drop"] = "imagenet_200_partial"
PARTIAL_MARK = " (partial set†)"


def _number(value: Any, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def _baseline_value(section: dict[str, Any], metric: str) -> Any:
    if metric == RELATIVE:
        return 100.0 if section.get(RELATIVE) is not None else None
    baseline = section.get("baseline")
    return baseline.get(metric) if isinstance(baseline, dict) else None


def _shortfall(key: str, section: dict[str, Any]) -> str:
    """What a benchmark's measurement lacks of its release, in words (empty: nothing)."""
    parts = []
    if section.get("missing"):
        missing = section["missing"]
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        parts.append(f"{len(missing)} of the 15 corruptions missing ({shown})")
    if section.get("missing_extras") and section.get("partial_with_extras"):
        parts.append(f"{len(section['missing_extras'])} of the 4 extra corruptions missing")
    if section.get("missing_classes"):
        parts.append(f"{section['missing_classes']} of its {section['release_classes']} classes missing")
    if section.get("extra_classes"):
        extra = section["extra_classes"]
        parts.append(f"{len(extra)} classes not its own ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")
    measured = section.get("images_out", section.get("images"))
    if isinstance(measured, list):
        measured = min(measured)
    if section.get("release_images") is not None and measured is not None and measured != section["release_images"]:
        per_pass = " a pass" if key in STORED else ""
        parts.append(f"{measured:,} of its {section['release_images']:,} images{per_pass}")
    if section.get("release_images_in") is not None and section.get("images_in") != section["release_images_in"]:
        parts.append(
            f"{section['images_in']:,} in-distribution images, not the authors' {section['release_images_in']:,}"
        )
    if key == "imagenet_r" and section.get("imagenet_200_partial") and not section.get("partial"):
        release_200 = section["release_classes"] * 50
        parts.append(f"ImageNet-200: {section.get('imagenet_200_images', 0):,} validation images, not {release_200:,}")
    return "; ".join(parts)


def robustness_rows(results: dict[str, Any]) -> list[str]:
    """The headline table: a row per metric that the results have, with the model, the baseline (when measured)
    and the paper's DeiT-S and DeiT-S + MJP (where the paper has the metric); none without any benchmark. A row
    measured on a partial set is marked, and the lines under the table say what each such benchmark lacks."""
    rows, partial_keys, precisions = [], [], {}
    for key, metric, label in ROWS:
        section = results.get(key)
        if not isinstance(section, dict) or metric not in section:
            continue
        paper = PAPER_ROBUSTNESS.get((key, metric), (None, None))
        cells = [section[metric], _baseline_value(section, metric), *paper]
        if section.get(PARTIAL_KEY.get(metric, "partial")):
            label += PARTIAL_MARK
            partial_keys += [key] if key not in partial_keys else []
        if section.get("precision"):
            precisions.setdefault(section["precision"], []).append(NAMES[key])
        rows.append(f"| {label} | " + " | ".join(_number(cell) for cell in cells) + " |")
    if not rows:
        return []
    lines = [
        "",
        "| robustness | model | baseline | paper DeiT-S | paper DeiT-S + MJP |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "paper: Ren et al., CVPR 2023, DeiT-S with and without MJP trained on ImageNet-1K (the mCE over the 15 "
        "ImageNet-C corruptions)",
    ]
    for key in partial_keys:
        lines.append(
            f"† {NAMES[key]} is not the whole release ({_shortfall(key, results[key])}): its marked rows are not "
            "comparable with published numbers"
        )
    if precisions:
        shown = "; ".join(f"{dtype}: {', '.join(dict.fromkeys(names))}" for dtype, names in precisions.items())
        lines.append(f"precision: {shown} (the authors evaluate in float32)")
    return lines


def stored_corruption_rows(results: dict[str, Any]) -> list[str]:
    """For ImageNet-C and CIFAR-10-C (when measured): each corruption's error per severity, its mean, its CE and
    relative CE against the reference (AlexNet, ImageNet-C only) and, with a baseline, the baseline's mean and the
    CE against it; then the means with the corruptions they cover."""
    lines: list[str] = []
    for key, name in STORED.items():
        table = results.get(key)
        if not isinstance(table, dict):
            continue
        has_reference = table.get("ce") is not None
        has_relative = table.get("relative_ce") is not None
        baseline = table.get("baseline")
        header = f"| {name} corruption | family | " + " | ".join(f"error s{s}" for s in table["severities"])
        header += " | mean |" + (" CE (AlexNet = 100) |" if has_reference else "")
        header += " relative CE (AlexNet = 100) |" if has_relative else ""
        header += " baseline mean | CE vs baseline |" if baseline else ""
        covered = len(table["corruptions_in_mce"])
        scope = (
            "the means cover the 15 corruptions"
            if not table["missing"]
            else f"the means cover {covered} of the 15 corruptions (missing: {', '.join(table['missing'])}), so the "
            "mCE is not comparable with a published one"
        )
        if table.get("missing_images"):
            scope += (
                f"; {table['release_images'] - table['missing_images']:,} of the release's "
                f"{table['release_images']:,} images a pass, so not the published benchmark"
            )
        lines += ["", f"{name}: {table['dir']}, {table['images']} images a pass; {scope}", "", header]
        lines.append("|---|---|" + "---|" * (header.count("|") - 3))
        for family, names in table["families"].items():
            for corruption in names:
                cells = [*table["error"][corruption], table["mean_error"][corruption]]
                if has_reference:
                    cells.append(table["ce"].get(corruption))
                if has_relative:
                    cells.append(table["relative_ce"].get(corruption))
                if baseline:
                    cells += [baseline["mean_error"][corruption], table["ce_vs_baseline"][corruption]]
                shown = family if family != "extra" else "extra (outside the mCE)"
                lines.append(f"| {corruption} | {shown} | " + " | ".join(_number(cell) for cell in cells) + " |")
        lines.append("")
        if has_reference:
            lines.append(f"{name} mCE (AlexNet = 100): {_number(table['mce'])}")
        if has_relative:
            lines.append(
                f"{name} relative mCE (AlexNet = 100; clean error {_number(table['clean_error'])}% against "
                f"AlexNet's {_number(table.get('reference_clean_error'))}%): "
                f"{_number(table['relative_mce'])}"
            )
        lines.append(
            f"{name} mean corruption error over the 15, unnormalized: {_number(table['mean_corruption_error'])}"
        )
        extras = table.get("mean_corruption_error_with_extras")
        if extras is not None:
            missing_extras = table.get("missing_extras") or []
            over = "the 19" if not missing_extras and not table["missing"] else "the corruptions present"
            lines.append(f"{name} mean corruption error over {over} (15 + 4 extra), unnormalized: {_number(extras)}")
        if baseline:
            checkpoint = f"{table['baseline_checkpoint']}; " if table.get("baseline_checkpoint") else ""
            lines.append(
                f"{name} mean CE against the baseline ({checkpoint}baseline = 100, not the paper's relative mCE): "
                f"{_number(table['mce_vs_baseline'])}"
            )
    return lines
