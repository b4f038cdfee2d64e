"""``compare=true``: a baseline and an MJP model trained with one config, measured side by side.

The two runs live in ``<output>/baseline`` and ``<output>/mjp``; ``<output>/summary.json`` holds both final
results and ``<output>/config.yaml`` the shared config. The baseline is the plain timm model (``mjp=false``); its
consistency is measured on pixel-jigsawed images, the MJP model's with its unknown position embedding, both on the
same jigsaws (see :mod:`mjp_fast.evaluate.metrics`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mjp_fast._atomic import write_atomically
from mjp_fast.train.config import TrainConfig, save_config
from mjp_fast.train.loop import (
    FINAL_KEYS,
    LAST_CHECKPOINT,
    RunResult,
    broadcast_from_main,
    default_output,
    distributed_session,
    plural,
    train,
)
from mjp_fast.train.models import base_name, ensure_registered

RUNS = (("baseline", False), ("mjp", True))


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per metric, one column per run; each metric's title says which way is better."""
    rows = [
        ("top-1 (%, higher is better)", "top1", "{:.2f}"),
        ("top-5 (%, higher is better)", "top5", "{:.2f}"),
        ("consistency (%, higher is better)", "consistency", "{:.2f}"),
        ("diff-norm (lower is better)", "diff_norm", "{:.3f}"),
        ("position MAE 1D (cells, lower: more position kept)", "pos_mae_1d", "{:.3f}"),
        ("position MAE 2D (cells, lower: more position kept)", "pos_mae_2d", "{:.3f}"),
        ("training time (s)", "train_seconds", "{:.0f}"),
    ]
    names = list(results)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for title, key, pattern in rows:
        cells = []
        for name in names:
            value = results[name].get(key)
            cells.append("-" if value is None else pattern.format(value))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_compare(config: TrainConfig, *, resume: bool = False) -> dict[str, dict[str, Any]]:
    """Trains the baseline, then the MJP model; prints and returns their final results.

    Under ``torchrun`` both runs share one process group, created here unless the caller made one (see
    :func:`mjp_fast.train.loop.distributed_session`), and rank 0 alone writes and prints.

    Raises:
        ConfigError: a bad config value, path or model name, before anything is written or printed.
    """
    config.validate()
    # Both runs build the model only after the comparison has written its folder and printed a header; a wrong
    # name must fail before that.
    ensure_registered(base_name(config.model))
    with distributed_session(config) as context:
        # Rank 0 names the folder: the default one is named by the clock, which the ranks may read a second apart.
        output = Path(broadcast_from_main(config.output or default_output(config), context))
        config = config.replace(output=str(output))
        if context.is_main:
            output.mkdir(parents=True, exist_ok=True)
            save_config(config, output / "config.yaml")
        started = time.perf_counter()
        runs: dict[str, RunResult] = {}
        for name, use_mjp in RUNS:
            folder = output / name
            if context.is_main:
                print(f"\n== {name} ==", flush=True)
            run_config = config.replace(compare=False, mjp=use_mjp, output=str(folder))
            resume_run = broadcast_from_main(resume and (folder / LAST_CHECKPOINT).exists(), context)
            runs[name] = train(run_config, resume=resume_run)
        results = {}
        for name, run in runs.items():
            results[name] = {key: run.final.get(key) for key in FINAL_KEYS}
            results[name]["train_seconds"] = sum(record.get("epoch_seconds", 0.0) for record in run.history)
            results[name]["checkpoint"] = str(run.checkpoint)
        if context.is_main:
            print(
                f"\n{comparison_table(results)}\n\n{_footnote(config, output, time.perf_counter() - started)}",
                flush=True,
            )
            with write_atomically(output / "summary.json", text=True) as file:
                file.write(json.dumps(results, indent=2) + "\n")
    return results


def _footnote(config: TrainConfig, output: Path, seconds: float) -> str:
    """What the table's metrics measure, and where to measure more."""
    return (
        f"{plural(config.epochs, 'epoch')} each. Consistency and diff-norm at jigsaw ratio {config.eval_ratio}: "
        "baseline on jigsawed pixels, MJP with its unknown position embedding; diff-norm is the distance between the "
        "features of an image and of its jigsawed copy. Position MAE: 5-fold linear regression of the position "
        "embeddings to the 1D index and to (row, col), in grid cells; low means the embeddings still encode where "
        f"each patch is. Total {seconds:.0f} s."
        f"\nmjp eval --checkpoint {output / 'mjp' / LAST_CHECKPOINT} measures more (plots, corruptions)."
    )
