"""``compare=true``: a baseline and an MJP model trained with one config, measured side by side.

The two runs live in ``<output>/baseline`` and ``<output>/mjp``; ``<output>/summary.json`` holds both final
results and ``<output>/config.yaml`` the shared config. The baseline is the plain timm model (``mjp=false``); its
consistency is measured on pixel-jigsawed images, the MJP model's with its unknown position embedding, both on the
same jigsaws (see :mod:`mjp_fast.evaluate.metrics`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mjp_fast.train.config import TrainConfig, save_config
from mjp_fast.train.loop import FINAL_KEYS, LAST_CHECKPOINT, RunResult, default_output, train

RUNS = (("baseline", False), ("mjp", True))


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per metric, one column per run."""
    rows = [
        ("top-1 (%)", "top1", "{:.2f}"),
        ("top-5 (%)", "top5", "{:.2f}"),
        ("consistency (%)", "consistency", "{:.2f}"),
        ("diff-norm", "diff_norm", "{:.3f}"),
        ("position MAE 1D", "pos_mae_1d", "{:.3f}"),
        ("position MAE 2D", "pos_mae_2d", "{:.3f}"),
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
    """Trains the baseline, then the MJP model; prints and returns their final results."""
    output = Path(config.output or default_output(config))
    config = config.replace(output=str(output))
    if _is_main():
        output.mkdir(parents=True, exist_ok=True)
        save_config(config, output / "config.yaml")
    started = time.perf_counter()
    runs: dict[str, RunResult] = {}
    for name, use_mjp in RUNS:
        folder = output / name
        if _is_main():
            print(f"\n== {name} ==", flush=True)
        run_config = config.replace(compare=False, mjp=use_mjp, output=str(folder))
        runs[name] = train(run_config, resume=resume and (folder / LAST_CHECKPOINT).exists())
    results = {}
    for name, run in runs.items():
        results[name] = {key: run.final.get(key) for key in FINAL_KEYS}
        results[name]["train_seconds"] = sum(record.get("epoch_seconds", 0.0) for record in run.history)
        results[name]["checkpoint"] = str(run.checkpoint)
    if _is_main():
        eval_ratio = config.eval_ratio
        print(
            f"\n{comparison_table(results)}\n\nconsistency and diff-norm at jigsaw ratio {eval_ratio}: baseline on "
            "jigsawed pixels, MJP with its unknown position embedding; position MAE: 5-fold linear regression of the "
            "position embeddings to the 1D index and to (row, col), in grid cells. "
            f"Total {time.perf_counter() - started:.0f} s."
            f"\nmjp eval --checkpoint {output / 'mjp' / LAST_CHECKPOINT} measures more (plots, corruptions).",
            flush=True,
        )
        temporary = output / ".summary.json.tmp"
        temporary.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(temporary, output / "summary.json")
    return results
