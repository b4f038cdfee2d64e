"""The report of ``mjp reproduce``: its data (the JSON), its Markdown, and the similarity figure.

:func:`build_report` turns the plan and the run records into one dict: the runs as measured (seeds, configs,
versions, wall time, device), each variant's numbers beside the paper's with the direction against row A, the
sweep, position regression, the attack, and the five claims with their verdicts (:mod:`mjp_fast.reproduce.claims`
holds the rules). :func:`render_markdown` writes the Markdown from that dict alone, so the JSON is the whole
record: every number in the Markdown is in it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mjp_fast._atomic import write_atomically
from mjp_fast.evaluate.common_corruptions import corruption_table
from mjp_fast.reproduce import claims as rules
from mjp_fast.reproduce.markdown import render_markdown
from mjp_fast.reproduce.records import json_ready, unpack_hits
from mjp_fast.reproduce.variants import (
    BASELINE,
    MJP,
    PAPER_POSITION_MAE,
    ROWS,
    sweep_variant,
)

CLAIM_STATEMENTS = (
    "MJP (J) keeps or improves accuracy against the baseline (A)",
    "The naive shuffle (E) costs accuracy against G",
    "Consistency and diff-norm improve with the mask ratio",
    "Position embeddings still regress to positions",
    "The analytic gradient-inversion attack recovers the input through a plain model but not through an MJP model",
)
# The shared training values the Markdown's setup section states.
TRAINING_KEYS = (
    "model", "img_size", "patch_size", "embed_dim", "depth", "num_heads", "epochs", "warmup_epochs", "batch_size",
    "lr", "weight_decay", "max_train_samples", "max_val_samples", "mjp_ratio", "mjp_prob", "eval_ratio", "amp",
    "device",
)  # fmt: skip
# The similarity sheet: panels this wide (the plots shrink to it: their titles are sized for it, see
# mjp_fast.evaluate.plots), under captions in a font this many pixels high.
PANEL_WIDTH = 360
CAPTION_FONT = 20
CAPTION = CAPTION_FONT + 8


def _hits_by_seed(plan, records: Mapping[str, dict], key: str) -> dict[int, np.ndarray]:
    hits = {}
    for spec in plan.runs_of(key):
        record = records[spec.run_id]
        hits[spec.seed] = unpack_hits(record["hits"], record["test_images"])
    return hits


def _aligned(first: Mapping[int, np.ndarray], second: Mapping[int, np.ndarray]) -> tuple[list, list]:
    """The hits of the seeds both have, in seed order; with none in common, the first seed of each."""
    common = sorted(set(first) & set(second))
    if common:
        return [first[seed] for seed in common], [second[seed] for seed in common]
    if first and second:
        return [first[min(first)]], [second[min(second)]]
    return [], []


def _mean(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return float(np.mean(present)) if present else None


def _variant_summary(plan, records: Mapping[str, dict], key: str, samples: int) -> dict[str, Any]:
    variant = plan.variant(key)
    runs = [records[spec.run_id] for spec in plan.runs_of(key)]
    summary: dict[str, Any] = {
        "key": key,
        "title": variant.title,
        "overrides": dict(variant.overrides),
        "sweep_ratio": variant.sweep_ratio,
        "paper": None if variant.paper is None else variant.paper.__dict__,
        "runs": [run["id"] for run in runs],
        "seeds": [run["seed"] for run in runs],
        "top1": _mean([run["top1"] for run in runs]),
        "top1_per_seed": [run["top1"] for run in runs],
        "consistency": _mean([run["consistency"] for run in runs]),
        "diff_norm": _mean([run["diff_norm"] for run in runs]),
        "images_per_second": _mean([run.get("images_per_second") for run in runs]),
        "test_images": runs[0]["test_images"] if runs else None,
    }
    baseline_runs = plan.runs_of(BASELINE)
    if key == BASELINE or not baseline_runs or variant.sweep_ratio is not None:
        return summary
    baseline = _variant_summary(plan, records, BASELINE, samples)
    first, second = _aligned(_hits_by_seed(plan, records, BASELINE), _hits_by_seed(plan, records, key))
    difference = rules.paired_difference(first, second, samples=samples)
    paper, paper_baseline = variant.paper, ROWS[BASELINE].paper
    paper_top1 = paper.top1 - paper_baseline.top1 if paper else 0.0
    top1 = {
        "difference": difference.mean,
        "interval": list(difference.interval),
        "per_seed": difference.per_seed,
        "paper_difference": paper_top1,
        "verdict": rules.direction_verdict(difference.interval, paper_top1, difference.per_seed),
    }
    summary["vs_baseline"] = {"top1": top1}
    if summary["consistency"] is not None and baseline["consistency"] is not None:
        interval = rules.proportion_difference_interval(
            baseline["consistency"], summary["consistency"], baseline["test_images"], summary["test_images"]
        )
        paper_consistency = paper.consistency - paper_baseline.consistency if paper else 0.0
        summary["vs_baseline"]["consistency"] = {
            "difference": summary["consistency"] - baseline["consistency"],
            "interval": list(interval),
            "paper_difference": paper_consistency,
            "verdict": rules.direction_verdict(interval, paper_consistency),
        }
    return summary


def _mjp_family(plan) -> list[tuple[str, float]]:
    """The variants that are row J at some training mask ratio, ``(key, ratio)`` in ratio order, one per ratio: the
    sweep's runs of J first, then J itself, then any row whose overrides are J's at its ratio (D: J at ratio 0,
    whose run the sweep's ratio 0 shares). Row A is none of them: it has neither UNK nor DAL."""
    candidates = []
    for variant in plan.variants:
        runs = plan.runs_of(variant.key)
        if not runs:
            continue
        ratio = float(runs[0].config.mjp_ratio) if runs[0].config.mjp else 0.0
        if variant.sweep_ratio is not None:
            rank = 0
        elif variant.key == MJP:
            rank = 1
        elif runs[0].config.mjp and dict(variant.overrides) == dict(sweep_variant(ratio).overrides):
            rank = 2
        else:
            continue
        candidates.append((rank, variant.key, ratio))
    chosen: dict[float, str] = {}
    for _, key, ratio in sorted(candidates, key=lambda candidate: candidate[0]):
        chosen.setdefault(ratio, key)  # a ratio's sweep run first: the sweep's table shows the same numbers
    return sorted(((key, ratio) for ratio, key in chosen.items()), key=lambda item: item[1])


def _trend_points(plan, summaries: Mapping[str, dict]) -> tuple[list[rules.TrendPoint], str]:
    """Claim 3's points, the runs of J at each training mask ratio (:func:`_mjp_family`), and where they come from,
    in words (with fewer than two ratios: why the claim is not measured)."""
    family = [
        (key, ratio)
        for key, ratio in _mjp_family(plan)
        if summaries[key]["consistency"] is not None and summaries[key]["diff_norm"] is not None
    ]
    points = [
        rules.TrendPoint(
            key, ratio, summaries[key]["consistency"], summaries[key]["diff_norm"], summaries[key]["test_images"]
        )
        for key, ratio in family
    ]
    if len(family) < 2:
        trained = f"{MJP} only at ratio {family[0][1]:g}" if family else f"no run of {MJP}"
        return points, (
            f"{trained}, and row {BASELINE} is not {MJP} at ratio 0 (it has neither UNK nor DAL); a sweep of two or "
            f"more ratios (--sweep) measures it"
        )
    ratios = ", ".join(f"{ratio:g}" for _, ratio in family)
    aliases = [
        f"{key} is {MJP} at ratio {ratio:g}"
        for key, ratio in family
        if key != MJP and plan.variant(key).sweep_ratio is None
    ]
    return points, f"the runs of {MJP} at training mask ratios {ratios}" + "".join(f"; {alias}" for alias in aliases)


def _regression_rows(plan, records: Mapping[str, dict]) -> list[dict[str, Any]]:
    rows = []
    for variant in plan.variants:
        for spec in plan.runs_of(variant.key):
            record = records[spec.run_id]
            regression, chance = record.get("position_regression"), record.get("position_chance")
            if regression is None or chance is None or spec.run_id in {row["run"] for row in rows}:
                continue
            rows.append(
                {
                    "variant": variant.key,
                    "run": spec.run_id,
                    "seed": spec.seed,
                    "mjp": bool(spec.config.mjp),
                    "mjp_ratio": spec.config.mjp_ratio,
                    "mjp_dal": spec.config.mjp_dal,
                    "mae_1d": regression["mae_1d"],
                    "mae_2d": regression["mae_2d"],
                    "mae_2d_normalized": regression["mae_2d_normalized"],
                    "mae_2d_normalized_std": regression["mae_2d_normalized_std"],
                    "chance_2d_normalized": chance["mae_2d_normalized"],
                    "chance_2d": chance["mae_2d"],
                    "paper": PAPER_POSITION_MAE.get(variant.key),
                }
            )
    return rows


def _regression_claim(rows: list[dict[str, Any]]) -> rules.Claim:
    # The MJP models with a jigsaw and DAL: rows I (linear) and J (nonlinear) of the paper's Table 2.
    chosen = [
        row for row in rows
        if row["mjp"] and row["mjp_ratio"] > 0 and row["mjp_dal"] != "none" and row["variant"] in ROWS
    ]  # fmt: skip
    points = [
        rules.RegressionPoint(
            f"{row['variant']} ({row['mjp_dal']} DAL, seed {row['seed']})",
            row["mae_2d_normalized"],
            row["mae_2d_normalized_std"],
            row["chance_2d_normalized"],
            row["mae_2d"],
            row["mae_1d"],
        )
        for row in chosen
    ]
    baseline = next((row for row in rows if row["variant"] == BASELINE), None)
    references = []
    if baseline is not None:
        references.append(
            f"For reference, {BASELINE} (plain): {baseline['mae_2d_normalized']:.3f} ({baseline['mae_2d']:.2f} cells)"
        )
    references.append("paper, 2D MAE (units not stated): DeiT-S .076, + MJP linear DAL .042, nonlinear DAL .134")
    run_rows = {row["variant"] for row in chosen}
    missing = [f"{key} ({ROWS[key].overrides['mjp_dal']} DAL)" for key in ("I", "J") if key not in run_rows]
    if missing and points:
        references.append(f"not run in this preset: {' and '.join(missing)}")
    return rules.regression_claim(4, CLAIM_STATEMENTS[3], points, "; ".join(references))


def adaptive_psnr(attack: dict[str, Any]) -> list[float] | None:
    """The adaptive attacker's per-image PSNRs (per-sample masks, with UNK) at the attack's first ratio, paired with
    its setting c there (same model, images, labels and jigsaws); None when the comparison did not run it."""
    first = next(iter(attack["ratios"].values()))
    entry = (attack.get("comparison") or {}).get("ratios", {}).get(f"{first['ratio']:g}")
    if entry is None or "per_sample" not in entry["modes"]:
        return None
    return entry["modes"]["per_sample"]["unk"]["adaptive"]["psnr"]


def attack_claim_of(attack: dict[str, Any] | None, samples: int) -> rules.Claim:
    """Claim 5 from the report's privacy section: the paper's claim about APRIL, with the adaptive attacker's
    number beside it where the comparison ran (:func:`adaptive_psnr`)."""
    if attack is None:
        return rules.Claim(5, CLAIM_STATEMENTS[4], rules.NOT_MEASURED, f"Rows {BASELINE} and {MJP} were not both run.")
    first = next(iter(attack["ratios"].values()))
    context = f"Attacked: {attack['description']}."
    return rules.attack_claim(
        5, CLAIM_STATEMENTS[4], first["psnr_a"], first["psnr_c"], ratio=first["ratio"], samples=samples,
        context=context, adaptive_psnr=adaptive_psnr(attack),
    )  # fmt: skip


def _cifar10_c_summary(plan, records: Mapping[str, dict]) -> dict[str, Any] | None:
    """Each variant's CIFAR-10-C numbers (runs measured with ``--cifar10-c``): its mean corruption error (mean over
    its seeds) and its mCE relative to row A (each variant's first seed against A's first seed); None when no run
    was measured."""
    measured = [records[spec.run_id].get("cifar10_c") for spec in plan.runs]
    if not any(measured):
        return None
    baseline_runs = plan.runs_of(BASELINE)
    baseline_errors = (records[baseline_runs[0].run_id].get("cifar10_c") or {}).get("error") if baseline_runs else None
    rows = []
    for variant in plan.variants:
        tables = [
            corruption_table(records[spec.run_id]["cifar10_c"]["error"])
            for spec in plan.runs_of(variant.key)
            if records[spec.run_id].get("cifar10_c")
        ]
        if not tables:
            continue
        first = records[plan.runs_of(variant.key)[0].run_id].get("cifar10_c")
        relative = None
        if first and baseline_errors and variant.key != BASELINE:
            relative = corruption_table(first["error"], baseline=baseline_errors)["mce_vs_baseline"]
        rows.append(
            {
                "key": variant.key,
                "title": variant.title,
                "runs": len(tables),
                "mean_corruption_error": _mean([table["mean_corruption_error"] for table in tables]),
                "mce_vs_baseline": relative,
                "family_error": {
                    family: _mean([float(np.mean([table["mean_error"][name] for name in names])) for table in tables])
                    for family, names in tables[0]["families"].items()
                },
                "corruptions_in_mce": tables[0]["corruptions_in_mce"],
            }
        )
    return {"dir": next(table["dir"] for table in measured if table), "variants": rows}


def build_report(
    plan,
    records: Mapping[str, dict],
    *,
    masks: list[dict],
    attack: dict[str, Any] | None,
    environment: dict[str, Any],
    started: str,
    wall_seconds: float,
    paths: Mapping[str, Path],
    data_sizes: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The report's data: everything the Markdown shows, with the runs it comes from."""
    samples = plan.preset.bootstrap_samples
    summaries = {variant.key: _variant_summary(plan, records, variant.key, samples) for variant in plan.variants}
    claims = []
    for number, (first, second) in ((1, (BASELINE, MJP)), (2, ("E", "G"))):
        first_hits, second_hits = (
            _aligned(_hits_by_seed(plan, records, first), _hits_by_seed(plan, records, second))
            if plan.runs_of(first) and plan.runs_of(second)
            else ([], [])
        )
        claims.append(
            rules.accuracy_claim(
                number, CLAIM_STATEMENTS[number - 1], first, second, first_hits, second_hits, samples=samples
            )
        )
    points, source = _trend_points(plan, summaries)
    claims.append(rules.trend_claim(3, CLAIM_STATEMENTS[2], points, source))
    regression = _regression_rows(plan, records)
    claims.append(_regression_claim(regression))
    claims.append(attack_claim_of(attack, samples))
    runs = [records[spec.run_id] for spec in plan.runs]
    first_config = plan.runs[0].config
    return {
        "schema": 1,
        "title": f"mjp reproduce: the paper's claims on {Path(plan.data).name}, {plan.preset.name} preset",
        "started": started,
        "wall_seconds": wall_seconds,
        "environment": environment,
        "device": runs[0]["device"] if runs else None,
        "data": {"root": plan.data, **dict(data_sizes or {})},
        "preset": {
            "name": plan.preset.name,
            "summary": plan.preset.summary,
            "config": dict(plan.preset.config),
            "rows": [variant.key for variant in plan.variants if variant.sweep_ratio is None],
            "sweep": [variant.sweep_ratio for variant in plan.variants if variant.sweep_ratio is not None],
            "seeds": list(plan.seeds),
            "multi_seed_rows": list(plan.preset.multi_seed_rows),
            "notes": list(plan.preset.notes),
            "bootstrap_samples": samples,
        },
        "overrides": dict(plan.overrides),
        "override_notes": list(plan.notes),
        "epochs_choice": plan.epochs_choice,
        "training": {key: getattr(first_config, key) for key in TRAINING_KEYS},
        "mask_statistics": masks,
        "variants": list(summaries.values()),
        "position_regression": regression,
        "attack": attack,
        "cifar10_c": _cifar10_c_summary(plan, records),
        "claims": [claim.__dict__ for claim in claims],
        "runs": runs,
        "paths": {name: str(path) for name, path in paths.items()},
    }


def write_report(report: dict[str, Any], markdown_path: str | Path, json_path: str | Path) -> None:
    """Writes the JSON and the Markdown (atomically each)."""
    for path, text in (
        (Path(json_path), json.dumps(json_ready(report), indent=1, allow_nan=False) + "\n"),
        (Path(markdown_path), render_markdown(report)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        with write_atomically(path, text=True) as file:
            file.write(text)


def similarity_figure(plan, records: Mapping[str, dict], path: str | Path) -> Path:
    """One PNG: the similarity plot of each variant's first run (rows, then the sweep), captioned; variants that
    share a run share a panel, and a model without position embeddings gets a panel that says so."""
    panels: list[tuple[str, Image.Image | None]] = []
    seen: dict[str, int] = {}
    for variant in plan.variants:
        runs = plan.runs_of(variant.key)
        if not runs:
            continue
        record = records[runs[0].run_id]
        if record["id"] in seen:
            index = seen[record["id"]]
            caption, image = panels[index]
            panels[index] = (f"{caption} = {variant.key}", image)
            continue
        seen[record["id"]] = len(panels)
        image = None
        if record.get("similarity_plot") and Path(record["similarity_plot"]).is_file():
            with Image.open(record["similarity_plot"]) as opened:
                image = opened.convert("RGB")
        panels.append((variant.key, image))
    columns = min(4, max(1, len(panels)))
    rows = math.ceil(len(panels) / columns)
    height = PANEL_WIDTH
    sheet = Image.new("RGB", (columns * (PANEL_WIDTH + 12) + 12, rows * (height + CAPTION + 12) + 12), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=CAPTION_FONT)
    for index, (caption, image) in enumerate(panels):
        left = 12 + (index % columns) * (PANEL_WIDTH + 12)
        top = 12 + (index // columns) * (height + CAPTION + 12)
        draw.text((left, top), caption, fill=(20, 20, 20), font=font)
        if image is None:
            draw.rectangle((left, top + CAPTION, left + PANEL_WIDTH, top + CAPTION + height), outline=(160, 160, 160))
            draw.text((left + 10, top + CAPTION + height // 2), "no position embeddings", fill=(90, 90, 90), font=font)
            continue
        scale = min(PANEL_WIDTH / image.width, height / image.height)
        resized = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))), Image.LANCZOS)
        sheet.paste(resized, (left, top + CAPTION))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
