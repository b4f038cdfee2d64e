"""``compare=true``: a baseline and an MJP model trained with one config, measured side by side.

The two runs live in ``<output>/baseline`` and ``<output>/mjp``; ``<output>/summary.json`` holds both final
results, ``<output>/curves.png`` both runs' curves on the same axes (:mod:`mjp_fast.train.curves`) and
``<output>/config.yaml`` the shared config. The baseline is the plain timm model (``mjp=false``); its
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
from mjp_fast.train.curves import CURVES_FILE, write_curves
from mjp_fast.train.distributed import broadcast_from_main, distributed_session
from mjp_fast.train.loop import train
from mjp_fast.train.outcome import (
    FINAL_KEYS,
    LAST_CHECKPOINT,
    RUNS,
    RunResult,
    TrainingInterrupted,
    resume_command,
)
from mjp_fast.train.preflight import check_run, say_notes
from mjp_fast.train.records import plural
from mjp_fast.train.resume import default_output


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
    :func:`mjp_fast.train.distributed.distributed_session`), and rank 0 alone writes and prints.

    Raises:
        ConfigError: every problem of the config, its folders, its device and both models, one a line (see
        :func:`mjp_fast.train.preflight.check_run`), before anything is written or trained.
    """
    # Both runs' models are built (on the meta device) and every other check that needs no training is made before
    # the comparison writes its folder and the baseline trains: a mistake that only the MJP model's build meets
    # would otherwise surface after the baseline's training.
    config = check_run(config, resume=resume)
    say_notes(config)
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
            try:
                runs[name] = train(run_config, resume=resume_run)
            except KeyboardInterrupt as interrupt:
                raise _interrupted(output, name, runs, interrupt) from interrupt
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
            histories = {name: run.history for name, run in runs.items()}
            write_curves(histories, output / CURVES_FILE, title=f"{output}: baseline and MJP")
    return results


def _interrupted(
    output: Path, interrupted_run: str, finished: dict[str, RunResult], interrupt: KeyboardInterrupt
) -> TrainingInterrupted:
    """Ctrl-C during the comparison's run ``interrupted_run``, the runs in ``finished`` done: what each run's folder
    keeps, and the command that goes on. ``--resume`` takes each run up from its checkpoint and starts the runs
    without one, so it is the way on even when nothing was saved yet (then it starts the comparison over)."""
    saved = interrupt.saved if isinstance(interrupt, TrainingInterrupted) else None
    kept = []
    for name, _ in RUNS:
        if name in finished:
            kept.append(f"{name}: {LAST_CHECKPOINT}, the finished run")
        elif name == interrupted_run and saved is not None:
            kept.append(f"{name}: {LAST_CHECKPOINT}, {saved.describe()}")
        elif name == interrupted_run:
            kept.append(f"{name}: no checkpoint yet")
        else:
            kept.append(f"{name}: not started")
    if finished or saved is not None:
        advice = f"continue with {resume_command(output)}"
    else:
        advice = (
            f"nothing to resume yet: {resume_command(output)} starts the comparison over (checkpoints are written at "
            "the end of each epoch, and with checkpoint_steps=N also every N optimizer steps within one)"
        )
    message = f"interrupted in the {interrupted_run} run of the comparison in {output} ({'; '.join(kept)}); {advice}"
    return TrainingInterrupted(message, output, saved)


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
