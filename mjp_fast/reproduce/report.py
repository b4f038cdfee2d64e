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
from mjp_fast.reproduce import claims as rules
from mjp_fast.reproduce.variants import (
    BASELINE,
    MJP,
    PAPER_ATTACK_PSNR,
    PAPER_POSITION_MAE,
    PAPER_SWEEP_DIFF_NORM_AS_GIVEN,
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
SETTING_ORDER = ("a", "b", "c", "no_unk_b", "no_unk_c")
SETTING_WHAT = {
    "a": "plain model: gradients of x, vs x",
    "b": "MJP model: gradients of jigsawed x~ with UNK, vs x~",
    "c": "MJP model: gradients of jigsawed x~ with UNK, vs x",
    "no_unk_b": "MJP model: gradients of x~ shuffled without UNK, vs x~",
    "no_unk_c": "MJP model: gradients of x~ shuffled without UNK, vs x",
}
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
    from mjp_fast.reproduce.run import unpack_hits

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


def _attack_claim(attack: dict[str, Any] | None, samples: int) -> rules.Claim:
    if attack is None:
        return rules.Claim(5, CLAIM_STATEMENTS[4], rules.NOT_MEASURED, f"Rows {BASELINE} and {MJP} were not both run.")
    first = next(iter(attack["ratios"].values()))
    context = f"Attacked: {attack['description']}."
    return rules.attack_claim(
        5, CLAIM_STATEMENTS[4], first["psnr_a"], first["psnr_c"], ratio=first["ratio"], samples=samples, context=context
    )


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
    claims.append(_attack_claim(attack, samples))
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
        "claims": [claim.__dict__ for claim in claims],
        "runs": runs,
        "paths": {name: str(path) for name, path in paths.items()},
    }


def write_report(report: dict[str, Any], markdown_path: str | Path, json_path: str | Path) -> None:
    """Writes the JSON and the Markdown (atomically each)."""
    from mjp_fast.reproduce.run import _finite

    for path, text in (
        (Path(json_path), json.dumps(_finite(report), indent=1, allow_nan=False) + "\n"),
        (Path(markdown_path), render_markdown(report)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        with write_atomically(path, text=True) as file:
            file.write(text)


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def _relative(path: str | None, markdown: str) -> str:
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path(markdown).resolve().parent))
    except ValueError:
        return str(Path(path).resolve())


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown, from its data alone."""
    lines: list[str] = []
    add = lines.append
    preset = report["preset"]
    training = report["training"]
    markdown = report["paths"]["markdown"]
    versions = report["environment"]["versions"]
    add(f"# {report['title']}")
    add("")
    add(
        f"Generated by `{report['environment']['command']}` (started {report['started']}) on {report['device']}, "
        f"in {_minutes(report['wall_seconds'])}; mjp_fast {versions['mjp_fast']}, torch {versions['torch']}, timm "
        f"{versions['timm']}. Every number here comes from a run recorded in "
        f"[{Path(report['paths']['json']).name}]({_relative(report['paths']['json'], markdown)}), with its seed, "
        "config, versions, wall time and device."
    )
    add("")
    add(
        "The paper's numbers are DeiT-S on ImageNet-1K (224 px, 300 epochs); these runs train a small ViT briefly on "
        f"{Path(report['data']['root']).name}, so only directions can agree, never values. Each row's direction is "
        f"taken against row {BASELINE}, as the paper's table does; a difference whose 95% interval includes zero "
        "is inside the noise."
    )
    add("")
    add("## Claims")
    add("")
    for claim in report["claims"]:
        add(f"{claim['number']}. **{claim['statement']}**: **{claim['verdict']}**. {claim['evidence']}")
    add("")

    add("## Setup")
    add("")
    data = report["data"]
    sizes = []
    if data.get("train_images") is not None:
        subset = training["max_train_samples"]
        sizes.append(
            f"{data['train_images']:,} training images"
            + (f" (a fixed subset: max_train_samples={subset:,})" if subset else " (all)")
        )
    if data.get("test_images") is not None:
        sizes.append(f"{data['test_images']:,} test images")
    add(f"- Data: `{data['root']}`" + (f": {', '.join(sizes)}." if sizes else "."))
    grid = report["mask_statistics"][0]["grid"] if report["mask_statistics"] else None
    add(
        f"- Model: `{training['model']}` with embed_dim={training['embed_dim']}, depth={training['depth']}, "
        f"num_heads={training['num_heads']}, {training['img_size']} px in {training['patch_size']}-pixel patches"
        + (f" ({grid[0]}x{grid[1]} grid)" if grid else "")
        + "."
    )
    add(
        f"- Training (every run): {_plural(training['epochs'], 'epoch')} ({training['warmup_epochs']} warm-up), batch "
        f"{training['batch_size']}, AdamW lr {_fmt(training['lr'], '{:.1e}')}, weight decay "
        f"{training['weight_decay']}; MJP ratio {training['mjp_ratio']:g} with probability {training['mjp_prob']:g}; "
        f"consistency and diff-norm at jigsaw ratio {training['eval_ratio']:g}. Preset `{preset['name']}`: "
        f"{preset['summary']}."
    )
    choice = report.get("epochs_choice")
    if choice:
        add(
            f"- Epochs chosen from the measured throughput: {choice['images_per_second']:,.0f} training images/s, "
            f"{choice['runs']} runs of {choice['train_images']:,} images in a {choice['budget_seconds']:.0f} s "
            f"training budget: {choice['epochs']} epochs (expected {_minutes(choice['expected_training_seconds'])} "
            "of training)."
        )
    for note in preset["notes"]:
        add(f"- {note}")
    if report["overrides"]:
        add(f"- Command-line overrides: {', '.join(f'`{k}={v}`' for k, v in report['overrides'].items())}.")
    for note in report["override_notes"]:
        add(f"- {note}.")
    seeds = preset["seeds"]
    seeds_text = (
        f"every run with seed {seeds[0]}"
        if len(seeds) == 1
        else f"rows {', '.join(preset['multi_seed_rows'])} with seeds {', '.join(map(str, seeds))}, every other run "
        f"with seed {seeds[0]}"
    )
    add(
        f"- Seeds: {seeds_text}. Intervals: {preset['bootstrap_samples']:,} bootstrap resamples of the test images "
        "(accuracy, paired by image and seed), normal intervals for consistency (two proportions)."
    )
    add("")
    if report["mask_statistics"]:
        add(
            "Masks as `mjp_fast.sample_jigsaw` draws them on this grid (BEiT block masking, min_block 8; "
            f"{report['mask_statistics'][0]['samples']:,} masks per ratio, every one jigsawed):"
        )
        add("")
        add(
            "| ratio | grid | cells asked (ratio x N) | masked cells per image: mean (min-max) "
            "| masked fraction: mean ± sd |"
        )
        add("|---|---|---|---|---|")
        for row in report["mask_statistics"]:
            add(
                f"| {row['ratio']:g} | {row['grid'][0]}x{row['grid'][1]} | {row['cells_asked']:.1f} | "
                f"{row['mean_cells']:.2f} ({row['min_cells']}-{row['max_cells']}) | "
                f"{row['mean_fraction']:.4f} ± {row['std_fraction']:.4f} |"
            )
        add("")

    add("## Variants (the paper's ablation rows)")
    add("")
    add(
        f"Δ: the row minus {BASELINE}. Top-1 seed by seed (a row trained with one seed is compared with "
        f"{BASELINE}'s run of that seed, not with {BASELINE}'s mean over seeds), its interval from the paired "
        f"bootstrap over test images; consistency: the row's mean minus {BASELINE}'s mean over their seeds, its "
        "interval normal (two proportions). Direction: whether our Δ has the paper's sign."
    )
    add("")
    add(
        "| row | variant | overrides | runs | top-1 % | Δ top-1 [95% CI] | paper top-1 (Δ) | direction "
        "| consistency % | Δ consistency [95% CI] | paper consistency (Δ) | direction | diff-norm | img/s |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for summary in report["variants"]:
        if summary["sweep_ratio"] is not None:
            continue
        paper = summary["paper"]
        versus = summary.get("vs_baseline", {})
        cells = [
            summary["key"],
            summary["title"],
            " ".join(f"`{key}={_plain(value)}`" for key, value in summary["overrides"].items()),
            ", ".join(summary["runs"]),
            _seeds_text(summary["top1_per_seed"]),
        ]
        for metric in ("top1", "consistency"):
            if metric == "consistency":
                cells.append(_fmt(summary["consistency"], "{:.1f}"))
            measured = versus.get(metric)
            paper_value = paper[metric] if paper else None
            if measured is None:
                cells += ["(baseline)" if summary["key"] == BASELINE else "-", _fmt(paper_value, "{:.1f}"), ""]
            else:
                low, high = measured["interval"]
                cells += [
                    f"{measured['difference']:+.2f} [{low:+.2f}, {high:+.2f}]",
                    f"{paper_value:.1f} ({measured['paper_difference']:+.1f})",
                    measured["verdict"],
                ]
        cells += [_fmt(summary["diff_norm"], "{:.3f}"), _fmt(summary["images_per_second"], "{:,.0f}")]
        add("| " + " | ".join(str(cell) for cell in cells) + " |")
    add("")

    sweep = [summary for summary in report["variants"] if summary["sweep_ratio"] is not None]
    if sweep:
        add(f"## Mask-ratio sweep of {MJP}")
        add("")
        add(
            "| ratio | runs | top-1 % | paper top-1 | consistency % | paper consistency | diff-norm | paper diff-norm "
            "| img/s |"
        )
        add("|---|---|---|---|---|---|---|---|---|")
        for summary in sorted(sweep, key=lambda item: item["sweep_ratio"]):
            paper = summary["paper"] or {}
            add(
                f"| {summary['sweep_ratio']:g} | {', '.join(summary['runs'])} "
                f"| {_seeds_text(summary['top1_per_seed'])} | {_fmt(paper.get('top1'), '{:.1f}')} "
                f"| {_fmt(summary['consistency'], '{:.1f}')} | "
                f"{_fmt(paper.get('consistency'), '{:.1f}')} | {_fmt(summary['diff_norm'], '{:.3f}')} | "
                f"{_fmt(paper.get('diff_norm'), '{:.2f}')} | {_fmt(summary['images_per_second'], '{:,.0f}')} |"
            )
        add("")
        add(
            f"The paper's diff-norm row, as given: {PAPER_SWEEP_DIFF_NORM_AS_GIVEN}. It has one more entry than the "
            "five ratios of this sweep: the paper also trained ratio 0.21 (4.39), which this sweep does not run; the "
            "table pairs each value with its own ratio."
        )
        add("")

    if report["position_regression"]:
        add("## Position regression (supplementary Table 2)")
        add("")
        add(
            "5-fold linear regression from each patch's position embedding to its 1D index and to its (row, col); "
            "mean absolute error on the held-out folds (`mjp_fast.evaluate.position`). Chance: the same regression "
            "of a constant, which predicts the training folds' mean position."
        )
        add("")
        add(
            "| row | run | 1D MAE (positions) | 2D MAE (cells) | 2D MAE (grid units) ± fold sd | chance (grid units) "
            "| paper 1D / 2D |"
        )
        add("|---|---|---|---|---|---|---|")
        for row in report["position_regression"]:
            paper = " / ".join(row["paper"]) if row["paper"] else "-"
            add(
                f"| {row['variant']} | {row['run']} | {row['mae_1d']:.2f} | {row['mae_2d']:.2f} | "
                f"{row['mae_2d_normalized']:.3f} ± {row['mae_2d_normalized_std']:.3f} | "
                f"{row['chance_2d_normalized']:.3f} | {paper} |"
            )
        add("")

    attack = report.get("attack")
    if attack:
        add("## Privacy: the analytic gradient-inversion attack (APRIL)")
        add("")
        add(
            f"Attacked: {attack['description']}; {len(attack['images'])} CIFAR test images ({attack['image_size']} px, "
            f"patch {attack['patch_size']}), one client update each, float64 gradients "
            f"({_minutes(attack['seconds'])}). {attack['metrics_note']}".rstrip()
        )
        add("")
        metrics = attack["metrics"]
        titles = {"mse": "MSE ↑", "psnr": "PSNR dB ↓", "ssim": "SSIM ↓", "fft2d": "FFT2D ↑", "lpips": "LPIPS ↑"}
        for entry in attack["ratios"].values():
            add(
                f"Jigsaw ratio {entry['ratio']:g} ({entry['masked_patches']:.1f} of {entry['patches']} patches "
                "masked on average):"
            )
            add("")
            add("| setting | model and comparison | " + " | ".join(titles[m] for m in metrics) + " |")
            add("|---|---|" + "---|" * len(metrics))
            for setting in SETTING_ORDER:
                values = entry["summary"].get(setting)
                if values is None:
                    continue
                cells = [_fmt(values.get(m), "{:.2f}" if m == "psnr" else "{:.4f}") for m in metrics]
                add(f"| `{setting}` | {SETTING_WHAT[setting]} | " + " | ".join(cells) + " |")
            add("")
        add(
            f"Arrows point to more privacy. Paper (DeiT-S, ImageNet, 224 px): PSNR {PAPER_ATTACK_PSNR['a']} dB in "
            f"setting a on DeiT-S, {PAPER_ATTACK_PSNR['c']} dB in setting c on DeiT-S + MJP."
        )
        if attack.get("grid"):
            add("")
            add(f"![reconstructions]({_relative(attack['grid'], markdown)})")
        add("")

    similarity = report["paths"].get("similarity")
    if similarity:
        add("## Position-embedding similarity")
        add("")
        add(
            "Per variant (first seed): for each patch position, the cosine similarity of its position embedding "
            "with every other position's (`mjp_fast.evaluate.plots`)."
        )
        add("")
        add(f"![position-embedding similarity]({_relative(similarity, markdown)})")
        add("")

    add("## Runs")
    add("")
    add("| run | variants | seed | epochs | wall time | training time | train img/s | top-1 % | device |")
    add("|---|---|---|---|---|---|---|---|---|")
    for run in report["runs"]:
        add(
            f"| {run['id']} | {', '.join(run['variants'])} | {run['seed']} | {run['epochs']} | "
            f"{_minutes(run['wall_seconds'])} | {_minutes(run['train_seconds'])} | "
            f"{_fmt(run.get('images_per_second'), '{:,.0f}')} | {_fmt(run['top1'])} | {run['device']} |"
        )
    add("")
    add(
        "Wall time: training, evaluation and the report's own measurements of the run; img/s: training images per "
        "second of the training loop (all epochs). A run marked as reused in the JSON was measured by an earlier "
        "invocation of the same command."
    )
    add("")
    return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _seeds_text(values: list[float | None]) -> str:
    present = [value for value in values if value is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return f"{present[0]:.2f}"
    return f"{np.mean(present):.2f} ({', '.join(f'{value:.2f}' for value in present)})"


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
