"""Running ``mjp reproduce``: the plan of runs, each run's training and measurements, and the collected report.

    plan = plan_runs(get_preset("cpu"), data="../shared/data/cifar10", runs_dir="runs/reproduce-cpu")
    report = reproduce(plan, report_path="docs/reproduction.md")

A run is one ``mjp train`` config: the preset's values, then the user's ``KEY=VALUE`` overrides, then the variant's
own overrides, then its seed. Variants whose configs come out equal share one run (row J and the sweep's J at the
preset's ratio; row D and the sweep's ratio 0). Each run trains with :func:`mjp_fast.train.train` (its
timing, evaluation and position regression), then the report measures what the training loop does not keep:

- every test image's top-1 hit (one more pass of :func:`mjp_fast.evaluate.metrics.evaluate_model`, whose loss
  criterion records them), for the paired bootstrap of accuracy differences;
- the position regression with its fold spread, and the same regression of a constant (the error of predicting
  the centre: chance);
- the plots of :func:`mjp_fast.evaluate.plots.plot_position_embeddings`;
- with ``--cifar10-c DIR``, its top-1 error on each CIFAR-10-C corruption and severity
  (:mod:`mjp_fast.evaluate.cifar10_c`), through the run's evaluation transform (a run measured before without it
  is measured then, its training reused).

A finished run writes ``reproduce-run.json`` beside its checkpoint; running the same command again reuses every run
whose config is unchanged (and resumes an interrupted one from its checkpoint), so a report can be rebuilt, or a
run cut short by a time limit continued, without training again.

Epochs from a budget (the gpu preset): two short epochs of the MJP config measure the training throughput, and
every run gets the number of epochs that fits the preset's training budget (recorded in the report).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mjp_fast.evaluate.cifar10_c import open_cifar10_c
from mjp_fast.evaluate.common_corruptions import measure_errors
from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.evaluate.plots import plot_position_embeddings
from mjp_fast.evaluate.position import model_position_regression, patch_position_embeddings, position_regression
from mjp_fast.reproduce.records import json_ready, pack_hits, read_json, unpack_hits, write_json
from mjp_fast.reproduce.report import build_report, similarity_figure, write_report
from mjp_fast.reproduce.variants import BASELINE, MJP, Preset, Variant, preset_variants
from mjp_fast.train.checkpoint import checkpoint_config, load_checkpoint, load_model
from mjp_fast.train.config import ConfigError, TrainConfig, build_config, parse_overrides
from mjp_fast.train.data import (
    build_datasets,
    default_workers,
    eval_loader,
    eval_transform,
    fixed_subset,
    resolve_split,
    set_transform,
)
from mjp_fast.train.device import amp_dtype, resolve_device
from mjp_fast.train.loop import train
from mjp_fast.train.outcome import LAST_CHECKPOINT

RUN_RECORD = "reproduce-run.json"
THROUGHPUT_RECORD = "throughput.json"
SIMILARITY_PLOT = "position_similarity.png"
# Keys a run's identity owns: the command's own options set them.
RESERVED_KEYS = {"data": "--data", "output": "--output", "seed": "--seeds", "compare": None, "dataset": None}
PROBE_IMAGES = 8192


@dataclass
class RunSpec:
    """One training run of the plan: the variants it serves, its seed and its config."""

    run_id: str
    variants: list[str]
    seed: int
    config: TrainConfig

    @property
    def output(self) -> Path:
        return Path(str(self.config.output))


@dataclass
class Plan:
    """Everything ``mjp reproduce`` will train, and with what."""

    preset: Preset
    variants: list[Variant]
    runs: list[RunSpec]
    runs_dir: Path
    data: str
    overrides: dict[str, Any]
    seeds: tuple[int, ...]
    notes: list[str] = field(default_factory=list)
    epochs_choice: dict[str, Any] | None = None
    cifar10_c: str | None = None  # CIFAR-10-C's folder: every run is measured on it too

    def runs_of(self, key: str) -> list[RunSpec]:
        """The runs of variant ``key``, by seed."""
        return sorted((run for run in self.runs if key in run.variants), key=lambda run: run.seed)

    def variant(self, key: str) -> Variant:
        return next(variant for variant in self.variants if variant.key == key)


def _run_id(key: str, seed: int) -> str:
    return f"{key.replace('@', '-ratio')}-seed{seed}"


def parse_override_values(overrides: Iterable[str]) -> dict[str, Any]:
    """``["epochs=3"]`` -> ``{"epochs": 3}``, type-checked against TrainConfig; the keys the command's options own
    (data, output, seed, compare, dataset) are refused. Raises ConfigError naming the key."""
    values = parse_overrides(overrides)
    for key in values:
        if key in RESERVED_KEYS:
            option = RESERVED_KEYS[key]
            how = f"use {option}" if option else "mjp reproduce sets it for every run"
            raise ConfigError(f"override {key}= is not allowed here: {how}")
    return values


def plan_runs(
    preset: Preset,
    *,
    data: str | Path,
    runs_dir: str | Path,
    overrides: Mapping[str, Any] | None = None,
    seeds: tuple[int, ...] | None = None,
    rows: tuple[str, ...] | None = None,
    sweep: tuple[float, ...] | None = None,
    cifar10_c: str | Path | None = None,
) -> Plan:
    """The runs of ``preset`` on ``data``: one per variant and seed, equal configs merged.

    Args:
        overrides: TrainConfig values applied to every run (after the preset's, before the variants' own).
        seeds: the seeds of the preset's multi-seed rows (A and J); every other run uses the first.
        rows, sweep: replace the preset's rows and sweep ratios.
        cifar10_c: CIFAR-10-C's folder (its layout is checked now, against the data's classes).

    Raises:
        ConfigError: a missing data folder or split, a bad override (naming the key), a bad seed, row or ratio,
            or a CIFAR-10-C folder that is not in the published layout (naming --cifar10-c).
    """
    overrides = dict(overrides or {})
    for key in overrides:
        if key in RESERVED_KEYS:
            raise ConfigError(f"override {key}= is not allowed here: use {RESERVED_KEYS[key] or 'the presets'}")
    data_dir = Path(data)
    if not data_dir.is_dir():
        raise ConfigError(f"--data: folder {str(data)!r} does not exist")
    train_split = overrides.get("train_split", preset.config.get("train_split", "train"))
    val_split = overrides.get("val_split", preset.config.get("val_split", "auto"))
    train_dir = resolve_split(data_dir, train_split)
    resolve_split(data_dir, val_split, validation=True)
    if cifar10_c is not None:
        classes = sorted(entry.name for entry in train_dir.iterdir() if entry.is_dir() and entry.name[0] != ".")
        try:
            open_cifar10_c(cifar10_c, classes)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    seeds = tuple(preset.seeds if seeds is None else seeds)
    if not seeds:
        raise ConfigError("--seeds must name at least one seed")
    if len(set(seeds)) != len(seeds) or any(seed < 0 for seed in seeds):
        raise ConfigError(f"--seeds must be distinct integers >= 0, got {list(seeds)}")
    try:
        variants = preset_variants(preset, rows, sweep)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not variants:
        raise ConfigError("nothing to run: --rows and --sweep leave no variant")
    notes = []
    for variant in variants:
        own = variant.overrides
        replaced = sorted(key for key in overrides if key in own and overrides[key] != own[key])
        if replaced:
            notes.append(
                f"{variant.key} keeps its own {', '.join(f'{key}={variant.overrides[key]}' for key in replaced)} "
                "over the command line's"
            )
    runs_dir = Path(runs_dir)
    by_config: dict[str, RunSpec] = {}
    runs: list[RunSpec] = []
    for variant in variants:
        variant_seeds = seeds if variant.key in preset.multi_seed_rows else seeds[:1]
        for seed in variant_seeds:
            values = {**preset.config, **overrides, **variant.overrides, "seed": seed, "data": str(data_dir)}
            # one evaluation, after the last epoch (a budget's epochs reset it: choose_epochs)
            values.setdefault("eval_interval", values.get("epochs", TrainConfig().epochs))
            try:
                config = build_config(values)
            except ConfigError as error:
                raise ConfigError(f"variant {variant.key}: {error}") from None
            identity = json.dumps(config.to_dict(), sort_keys=True)
            if identity in by_config:
                by_config[identity].variants.append(variant.key)
                continue
            run_id = _run_id(variant.key, seed)
            spec = RunSpec(run_id, [variant.key], seed, config.replace(output=str(runs_dir / run_id)))
            by_config[identity] = spec
            runs.append(spec)
    plan = Plan(preset, variants, runs, runs_dir, str(data_dir), overrides, seeds, notes)
    plan.cifar10_c = str(cifar10_c) if cifar10_c is not None else None
    return plan


def _say(message: str) -> None:
    print(f"mjp reproduce: {message}", flush=True)


def choose_epochs(plan: Plan) -> dict[str, Any] | None:
    """For a preset with a training budget and no ``epochs=`` override: measures the throughput of the MJP config
    (two epochs on up to 8,192 images; the second, warm, counts) and gives every run the most epochs that fit the
    budget, less each run's overhead outside its epochs (the preset's ``run_overhead_s``). Updates the plan's
    configs; returns what it measured and chose (None when the epochs are fixed)."""
    preset = plan.preset
    if preset.training_budget_s is None or "epochs" in plan.overrides or "epochs" in preset.config:
        return None
    probe_spec = (plan.runs_of(MJP) or plan.runs)[0]
    probe_dir = plan.runs_dir / "throughput-probe"
    probe_config = probe_spec.config.replace(
        max_train_samples=PROBE_IMAGES, max_val_samples=1000, epochs=2, warmup_epochs=0, eval_interval=2,
        output=str(probe_dir),
    )  # fmt: skip
    record_path = plan.runs_dir / THROUGHPUT_RECORD
    record = read_json(record_path)
    if record is None or record.get("config") != json.loads(json.dumps(json_ready(probe_config.to_dict()))):
        shutil.rmtree(probe_dir, ignore_errors=True)  # an interrupted probe: measure again from the start
        _say(f"measuring the training throughput ({probe_spec.run_id}'s config, 2 epochs on {PROBE_IMAGES:,} images)")
        history = train(probe_config).history
        record = {"config": probe_config.to_dict(), "images_per_second": history[-1]["train_images_per_second"]}
        write_json(record, record_path)
    images_per_second = float(record["images_per_second"])
    train_set, _, _ = build_datasets(probe_spec.config)
    train_images = len(train_set)
    low, high = preset.epoch_bounds
    budget = preset.training_budget_s
    # what each run spends besides its epochs comes out of the budget first: the epochs get the rest
    overhead = preset.run_overhead_s * len(plan.runs)
    epochs = int(max(budget - overhead, 0.0) * images_per_second // (len(plan.runs) * train_images))
    epochs = min(max(epochs, low), high)
    warmup = min(int(plan.overrides.get("warmup_epochs", preset.config.get("warmup_epochs", 0))), epochs - 1)
    for run in plan.runs:
        changes = {"epochs": epochs, "warmup_epochs": max(warmup, 0)}
        if "eval_interval" not in plan.overrides:
            changes["eval_interval"] = epochs
        run.config = build_config(changes, run.config)
    choice = {
        "images_per_second": images_per_second,
        "budget_seconds": budget,
        "run_overhead_seconds": preset.run_overhead_s,
        "runs": len(plan.runs),
        "train_images": train_images,
        "epochs": epochs,
        "bounds": [low, high],
        "expected_training_seconds": epochs * len(plan.runs) * train_images / images_per_second,
    }
    _say(
        f"{images_per_second:,.0f} training images/s: {epochs} epochs per run "
        f"({choice['expected_training_seconds'] / 60:.1f} min of training for {len(plan.runs)} runs)"
    )
    plan.epochs_choice = choice
    return choice


class _HitRecorder(nn.Module):
    """A loss criterion for :func:`evaluate_model` that also keeps each image's top-1 hit, in evaluation order."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.batches: list[torch.Tensor] = []

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.batches.append(logits.argmax(dim=-1).eq(targets).cpu())
        return self.loss(logits, targets)

    def hits(self) -> np.ndarray:
        return torch.cat(self.batches).numpy() if self.batches else np.zeros(0, dtype=bool)


def _clean_pass(
    model: nn.Module, config: TrainConfig, device: torch.device, dataset: Any, criterion: nn.Module | None = None
) -> dict[str, Any]:
    """One pass over ``dataset`` (its transform set) with no jigsaw: the run's evaluation batch size, loader
    workers, normalization and autocast. Returns :func:`evaluate_model`'s metrics."""
    workers = config.workers if config.workers is not None else default_workers(1)
    batch_size = config.eval_batch_size or 2 * config.batch_size
    loader = eval_loader(dataset, batch_size, workers, pin_memory=device.type == "cuda")
    return evaluate_model(
        model,
        loader,
        device=device,
        mean=torch.tensor(config.mean),
        std=torch.tensor(config.std),
        ratio=0.0,
        jigsaw="none",
        amp_dtype=amp_dtype(config, device),
        criterion=criterion,
    )


def per_image_hits(model: nn.Module, config: TrainConfig, device: torch.device) -> tuple[np.ndarray, dict[str, Any]]:
    """Each test image's top-1 hit (bool ``[n]``, in the test set's order) and the pass's metrics."""
    _, val_set, _ = build_datasets(config, need_train=False)
    set_transform(val_set, eval_transform(int(config.img_size), config.interpolation, float(config.crop_pct)))
    recorder = _HitRecorder()
    result = _clean_pass(model, config, device, val_set, criterion=recorder)
    return recorder.hits(), result


def cifar10_c_errors(model: nn.Module, config: TrainConfig, device: torch.device, root: str) -> dict[str, Any]:
    """The model's top-1 error (%) on each CIFAR-10-C corruption and severity at ``root``, through the run's
    evaluation transform, on the run's test-set size (``max_val_samples`` images of each severity, when set):
    ``{"dir": root, "error": {corruption: [severity 1..5]}}``."""
    _, _, classes = build_datasets(config, need_train=False)
    sets = open_cifar10_c(root, classes)
    transform = eval_transform(int(config.img_size), config.interpolation, float(config.crop_pct))

    def evaluate(description: str, dataset: Any) -> float:
        set_transform(dataset, transform)
        return _clean_pass(model, config, device, fixed_subset(dataset, config.max_val_samples))["top1"]

    return {"dir": str(root), "error": measure_errors(sets, evaluate)}


def describe_device(device: torch.device) -> str:
    """The GPU's name, or the CPU's model with its core and thread counts."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    return f"{name}, {_count(cores, 'core')}, {_count(threads, 'torch thread')}"


def _count(count: int, noun: str) -> str:
    """``1 core``, ``2 cores``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def environment(command: str | None = None) -> dict[str, Any]:
    """Package, torch, timm, NumPy and Python versions, the platform, and the command (default: this process's)."""
    import timm

    from mjp_fast import __version__

    versions = {
        "mjp_fast": __version__,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    command = command if command is not None else " ".join(["mjp", *sys.argv[1:]])
    return {"versions": versions, "platform": platform.platform(), "command": command}


def _images_per_second(history: list[dict[str, Any]]) -> float | None:
    seconds = sum(record.get("epoch_seconds") or 0.0 for record in history)
    images = sum(
        (record.get("train_images_per_second") or 0.0) * (record.get("epoch_seconds") or 0.0) for record in history
    )
    return images / seconds if seconds > 0 else None


def execute_run(spec: RunSpec, title: str, cifar10_c: str | None = None) -> dict[str, Any]:
    """Trains (or reuses, or resumes) one run and measures it; returns its record (also written beside it).
    ``cifar10_c``: CIFAR-10-C's folder, measured into the record's ``cifar10_c`` (a reused run measured without
    it, or on another folder, is measured now)."""
    record_path = spec.output / RUN_RECORD
    requested = json.loads(json.dumps(json_ready(spec.config.to_dict())))
    record = read_json(record_path)
    if record is not None and record.get("requested_config") == requested:
        if cifar10_c is not None and (record.get("cifar10_c") or {}).get("dir") != str(cifar10_c):
            device = resolve_device(spec.config.device)
            model, checkpoint = load_model(record["checkpoint"], device)
            record["cifar10_c"] = cifar10_c_errors(model, checkpoint_config(checkpoint), device, cifar10_c)
            write_json(record, record_path)
        record["reused"] = True
        return record
    resume = (spec.output / LAST_CHECKPOINT).exists()
    if record is not None or (resume and not _same_config(spec)):
        earlier = (record or {}).get("requested_config") or {}
        changed = sorted(key for key in requested if key in earlier and earlier[key] != requested[key])
        which = f" (it differs in {', '.join(changed[:6])})" if changed else ""
        raise ConfigError(
            f"--output: {str(spec.output)!r} holds a run of another config{which}; choose another --output or "
            "remove that folder"
        )
    started = time.perf_counter()
    result = train(spec.config, resume=resume)
    device = resolve_device(spec.config.device)
    model, checkpoint = load_model(result.checkpoint, device)
    config = checkpoint_config(checkpoint)
    hits, measured = per_image_hits(model, config, device)
    final = dict(checkpoint.get("final") or result.final)
    regression = model_position_regression(model)
    chance = None
    similarity = None
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    found = patch_position_embeddings(model)
    if found is not None:
        embeddings, grid = found
        if regression is not None:
            # Regressing a constant predicts the training folds' mean position: the error of guessing the centre.
            chance = position_regression(np.zeros((embeddings.shape[0], 1)), grid)
        written = plot_position_embeddings(embeddings, grid, spec.output / "plots", title=f"{spec.run_id}:")
        similarity = next((str(path) for path in written if path.name == SIMILARITY_PLOT), None)
    history = result.history or list(checkpoint.get("metrics") or [])
    record = {
        "id": spec.run_id,
        "variants": list(spec.variants),
        "title": title,
        "seed": spec.seed,
        "requested_config": requested,
        "config": config.to_dict(),
        "model_name": checkpoint.get("model_name"),
        "output": str(spec.output),
        "checkpoint": str(result.checkpoint),
        "device": describe_device(device),
        "wall_seconds": time.perf_counter() - started,
        "train_seconds": sum(record.get("epoch_seconds") or 0.0 for record in history),
        "epochs": len(history),
        "images_per_second": _images_per_second(history),
        "grid": [int(size) for size in grid] if grid is not None else None,
        "top1": final.get("top1"),
        "top5": final.get("top5"),
        "consistency": final.get("consistency"),
        "diff_norm": final.get("diff_norm"),
        "val_loss": final.get("val_loss"),
        "test_images": int(measured["images"]),
        "hits": pack_hits(hits),
        "hits_top1": 100.0 * float(hits.mean()) if hits.size else None,
        "position_regression": regression,
        "position_chance": chance,
        "similarity_plot": similarity,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "history": history,
    }
    if cifar10_c is not None:
        record["cifar10_c"] = cifar10_c_errors(model, config, device, cifar10_c)
    write_json(record, record_path)
    record["reused"] = False
    return record


def _same_config(spec: RunSpec) -> bool:
    """Whether the checkpoint in the run's folder was started with this config (resumable)."""
    saved = load_checkpoint(spec.output / LAST_CHECKPOINT).get("config") or {}
    wanted = spec.config.to_dict()
    # the loop writes its resolved values (lr, img_size, mjp_seed...): compare only what the plan set
    return all(saved.get(key) == value for key, value in wanted.items() if value is not None and key != "output")


def mask_statistics(grid: tuple[int, int], ratios: Iterable[float], samples: int = 4096, seed: int = 0) -> list[dict]:
    """The masks :func:`mjp_fast.sample_jigsaw` draws on ``grid`` at each ratio: masked cells and fraction per image
    (mean, standard deviation, min, max over ``samples`` masks, every sample jigsawed)."""
    from mjp_fast import sample_jigsaw

    rows, cols = grid
    cells = rows * cols
    statistics = []
    for ratio in sorted(set(ratios)):
        mask = sample_jigsaw(samples, (rows, cols), ratio, seed=seed, prob=1.0).mask
        counts = mask.sum(dim=1).double()
        statistics.append(
            {
                "ratio": ratio,
                "grid": [rows, cols],
                "cells_asked": ratio * cells,
                "mean_cells": float(counts.mean()),
                "mean_fraction": float(counts.mean() / cells),
                "std_fraction": float(counts.std() / cells) if samples > 1 else 0.0,
                "min_cells": int(counts.min()),
                "max_cells": int(counts.max()),
                "samples": samples,
            }
        )
    return statistics


def reproduce(
    plan: Plan,
    *,
    report_path: str | Path,
    json_path: str | Path | None = None,
    similarity_path: str | Path | None = None,
    attack_path: str | Path | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Runs the plan (reusing finished runs), measures, judges the claims and writes the report: Markdown at
    ``report_path``, JSON (default: beside it, ``.json``), the similarity PNG (``-similarity.png``) and the
    attack's reconstructions (``-attack.png``). ``command``: how the report says it was made (default: this
    process's command line). Returns the report's data (the JSON's content)."""
    from mjp_fast.reproduce.attack import run_attack

    report_path = Path(report_path)
    json_path = Path(json_path) if json_path else report_path.with_suffix(".json")
    beside = report_path.with_name
    similarity_path = Path(similarity_path) if similarity_path else beside(report_path.stem + "-similarity.png")
    attack_path = Path(attack_path) if attack_path else beside(report_path.stem + "-attack.png")
    started = time.perf_counter()
    started_at = datetime.datetime.now().isoformat(timespec="seconds")
    for note in plan.notes:
        _say(note)
    choose_epochs(plan)
    records: dict[str, dict[str, Any]] = {}
    for index, spec in enumerate(plan.runs, start=1):
        title = " = ".join(f"{key} ({plan.variant(key).title})" for key in spec.variants)
        _say(f"[{index}/{len(plan.runs)}] {spec.run_id}: {title}")
        record = execute_run(spec, title, plan.cifar10_c)
        records[spec.run_id] = record
        how = "reused" if record["reused"] else f"{record['wall_seconds'] / 60:.1f} min"
        speed = record.get("images_per_second")
        _say(
            f"[{index}/{len(plan.runs)}] {spec.run_id}: top-1 {record['top1']:.2f}, consistency "
            f"{_number(record['consistency'])}, diff-norm {_number(record['diff_norm'], '{:.3f}')}, "
            f"{_number(speed, '{:.0f}')} img/s ({how})"
        )
    runs = [records[spec.run_id] for spec in plan.runs]
    grid = next((tuple(record["grid"]) for record in runs if record.get("grid")), None)
    ratios = {run.config.mjp_ratio for run in plan.runs if run.config.mjp} | {plan.runs[0].config.eval_ratio}
    masks = mask_statistics(grid, ratios) if grid else []

    attack = None
    plain_runs, mjp_runs = plan.runs_of(BASELINE), plan.runs_of(MJP)
    if plain_runs and mjp_runs:
        _say("attacking the gradients of the plain (A) and MJP (J) models")
        device = torch.device("cpu")  # float64 and LAPACK: the attack runs on the CPU
        plain_model, _ = load_model(records[plain_runs[0].run_id]["checkpoint"], device)
        mjp_model, _ = load_model(records[mjp_runs[0].run_id]["checkpoint"], device)
        mjp_config = mjp_runs[0].config
        attack_ratios = list(dict.fromkeys([mjp_config.mjp_ratio, mjp_config.eval_ratio]))
        attack = run_attack(
            plain_model,
            mjp_model,
            data=plan.data,
            split=mjp_config.val_split,
            images=plan.preset.attack_images,
            ratios=attack_ratios,
            seed=plan.seeds[0],
            fallback_depth=plan.preset.attack_depth,
            patch_size=int(mjp_config.patch_size or 16),
            grid_path=attack_path,
        )
    similarity_figure(plan, records, similarity_path)
    train_set, val_set, _ = build_datasets(plan.runs[0].config)  # in memory already with cache_images
    report = build_report(
        plan,
        records,
        masks=masks,
        attack=attack,
        environment=environment(command),
        started=started_at,
        wall_seconds=time.perf_counter() - started,
        paths={"markdown": report_path, "json": json_path, "similarity": similarity_path, "attack": attack_path},
        data_sizes={"train_images": len(train_set), "test_images": len(val_set)},
    )
    write_report(report, report_path, json_path)
    _say(f"wrote {report_path}, {json_path}, {similarity_path}" + (f", {attack_path}" if attack else ""))
    return report


def _number(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


__all__ = [
    "Plan",
    "RunSpec",
    "choose_epochs",
    "cifar10_c_errors",
    "describe_device",
    "environment",
    "execute_run",
    "mask_statistics",
    "pack_hits",
    "parse_override_values",
    "per_image_hits",
    "plan_runs",
    "reproduce",
    "unpack_hits",
]
