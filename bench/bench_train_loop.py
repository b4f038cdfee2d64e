"""``mjp train`` against timm's own ``train.py``: training images per second of the loop a user would pick instead.

Three tools train the same model with the same recipe on the same images, each as its own process for one epoch
of a fixed number of steps, in alternating order over the repeats (timm, mjp=false, mjp=true, then mjp=true,
mjp=false, timm, ...), so that the machine's drifts hit them alike:

- ``timm train.py``: timm's training script, run as an external program. It is not in timm's wheel or sdist:
  take it from the git tag of the installed timm release (``git show v<version>:train.py`` in
  huggingface/pytorch-image-models) and pass ``--timm-train-py PATH`` or set ``TIMM_TRAIN_PY``. Without it the
  timm rows are NOT RUN (and the aim against timm with them); the mjp rows still run.
- ``mjp train mjp=false``: the plain timm model in mjp's loop.
- ``mjp train mjp=true``: the MJP model (jigsaw, unknown position embedding, DAL) in mjp's loop.

Data (``--datasets``):

- ``embedded``: ``mjp train``'s embedded default, scikit-learn's digits (``dataset=digits``), with the ``digits``
  preset's model and recipe (16 px, patch 4, width 64, 2 blocks, batch 32): a small, host-bound model. mjp reads
  the digits from memory; timm reads the same images (the same fixed training subset, all 360 validation images)
  written as PNG files into an ImageFolder under a temporary folder.
- ``cifar10``: the CIFAR-10 folders (``--cifar10 DIR``, ``MJP_BENCH_CIFAR10``, default ``../shared/data/cifar10``
  next to the checkout) with ``mjp reproduce``'s cpu-preset model (``deit_tiny_patch16_224`` with width 64,
  3 blocks, 2 heads, 28 px, patch 2: a 14x14 grid; batch 128) on the CPU, its gpu-preset model (width 288,
  6 blocks, 4 heads, 32 px, patch 2; batch 256, bf16) on a GPU. timm's script has no subset option, so both
  tools read one temporary ImageFolder of symbolic links: a fixed class-balanced subset of ``steps x batch``
  training images and ``--val-images`` test images (seed 0). The files are read once before the first run.

Recipe (both tools, every value passed explicitly on both command lines): crop and flip only (random-resized crop
at the preset's scale, horizontal flip at its probability; no RandAugment, colour jitter, random erasing, mixup,
cutmix or repeated augmentation), label smoothing 0.1, gradient clipping 5.0 (norm), AdamW at the preset's
learning rate with weight decay 0.05, a cosine schedule stepped per update with no warm-up (so mjp=true jigsaws
from the first step), one epoch, ``--workers`` loader processes (default 1 on the CPU, 8 on a GPU), the same
torch thread count (``OMP_NUM_THREADS`` for both, ``threads=`` for mjp), seed 0, a class map that gives both the
same labels. On the CPU: float32, timm with ``--no-prefetcher --device cpu``. On a GPU: bf16 autocast, timm with
its prefetcher (its default) and ``--pin-mem``, mjp pinning its loader's memory (its default on CUDA).

What is measured, per run:

- training images per second: the epoch's images divided by the seconds from just before the loop asks its
  loader for the first batch to the end of the last optimizer step. This includes the loader's start (its worker
  process and the first batch) and every step; it excludes process start-up, model building, evaluation and
  checkpoints. timm: the ``(mean s, img/s)`` its log prints at the epoch's last batch (its meter of update times
  starts before ``enumerate(loader)``; all batches are full, so batch / mean update time = images / total time).
  mjp: ``train_images_per_second`` of ``metrics.jsonl`` (``_train_epoch`` starts its clock before the loader and
  reads it after the last step; evaluation comes after, outside it: checked by running a 100- and a 3,000-image
  validation set on the same training set).
- evaluation seconds, beside it: timm: its ``validate`` pass (mean batch time at the last ``Test:`` line x
  batches): clean top-1/top-5. mjp: ``eval_seconds`` of ``metrics.jsonl`` when the loop records it, else from the
  arrival times of its output lines (epoch record line minus header line, minus ``epoch_seconds``): the clean and
  jigsawed passes and, after the last epoch, the position regression.
- wall seconds: the process from start to exit (start-up, training, evaluation, checkpoints).

Per tool we report the median over the repeats and the 20th/80th percentiles; ratios: the ratio of the median
training images per second (mjp=false / timm, mjp=true / mjp=false) and the per-repeat ratios of the runs of the
same round. Aims (judged on the ``cifar10`` rows): ``mjp train mjp=false`` at least 0.98x timm's ``train.py``, and
``mjp=true`` at least 0.98x ``mjp=false``, on the CPU and on an H100/H200. The 1-minute load average is recorded
before and after each run: other processes share this machine.

    python bench/bench_train_loop.py [--timm-train-py PATH] [--datasets embedded,cifar10] [--steps N]
        [--val-images N] [--cifar10 DIR] [--workers N] [--repeats N] [--smoke] [--out DIR] [--device cpu|cuda]
        [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `mjp_fast` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import REPO_ROOT, aim_line, aim_verdict, markdown_table, run_standalone, where_measured

NAME = "train_loop"
TIMM = "timm train.py"
MJP_FALSE = "mjp train mjp=false"
MJP_TRUE = "mjp train mjp=true"
TOOLS = (TIMM, MJP_FALSE, MJP_TRUE)
DATASETS = ("embedded", "cifar10")
TIMM_TRAIN_PY_ENV = "TIMM_TRAIN_PY"
CIFAR10_ENV = "MJP_BENCH_CIFAR10"
DEFAULT_CIFAR10 = REPO_ROOT.parent / "shared" / "data" / "cifar10"
TAKE_TIMM_TRAIN_PY = (
    "take it from the git tag of the installed timm release (git show v<version>:train.py in "
    "github.com/huggingface/pytorch-image-models)"
)
WHERE_TIMM_TRAIN_PY = (
    f"timm's train.py is not in timm's wheel or sdist: {TAKE_TIMM_TRAIN_PY} and pass --timm-train-py PATH or set "
    f"{TIMM_TRAIN_PY_ENV}"
)

STEPS = {"embedded": 40, "cifar10": 100}
SMOKE_STEPS = 2
VAL_IMAGES = 1000  # cifar10's validation images (embedded: all 360 digits)
REPEATS, SMOKE_REPEATS = 3, 1
CPU_WORKERS, GPU_WORKERS = 1, 8
SEED = 0
RUN_TIMEOUT_S = 3600.0  # one process; a loaded 2-core machine can be 10x slower than a quiet one
AIM_RATIO = 0.98
AIMS = (  # device kind, numerator, denominator, threshold
    ("cpu", MJP_FALSE, TIMM, AIM_RATIO),
    ("cpu", MJP_TRUE, MJP_FALSE, AIM_RATIO),
    ("H100", MJP_FALSE, TIMM, AIM_RATIO),
    ("H100", MJP_TRUE, MJP_FALSE, AIM_RATIO),
)
GPU_KINDS = ("H100", "H200")  # the aims' GPU: either of the machines the project is lent
AIM_DATA = "cifar10"

# Config keys the timm command line below cannot express: they must be off (or at these values) in a recipe.
UNTRANSLATED = {
    "auto_augment": None,
    "reprob": 0.0,
    "mixup": 0.0,
    "cutmix": 0.0,
    "repeated_aug": False,
    "accum_steps": 1,
    "compile": False,
    "pos_embed": "learned",
    "cache_images": False,
}


# ---------------------------------------------------------------------------------------------------------------
# The setups: model, recipe and data of each data set, as mjp train config values
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """One data set's runs: the mjp train config (the recipe both tools get) and the data sizes."""

    data: str  # "embedded" or "cifar10"
    title: str  # the model and data in words
    config: Any  # mjp_fast.train.config.TrainConfig (data, output, mjp and device are set per run)
    steps: int
    val_images: int | None  # None: the whole validation split


def _recipe_values(base: dict[str, Any], *, device: str, workers: int, threads: int) -> dict[str, Any]:
    """A preset's config values made into one epoch of the bench recipe."""
    values = dict(base)
    values.update(
        epochs=1,
        warmup_epochs=0,  # no warm-up: mjp=true jigsaws from the first step (mjp_from_epoch defaults to it)
        eval_interval=1,
        workers=workers,
        threads=threads,
        compare=False,
        cache_images=False,  # both tools decode the files every epoch
        progress="off",
        device=device,
        amp="bf16" if device == "cuda" else "none",
        seed=SEED,
        num_classes=10,
        max_train_samples=None,
        max_val_samples=None,
    )
    return values


def setups(
    datasets: Sequence[str],
    *,
    device: str,
    steps: int | None,
    val_images: int,
    workers: int,
    threads: int,
    cifar10: Path = DEFAULT_CIFAR10,
) -> list[Setup]:
    """The setups of ``datasets``; ``steps`` None: each data set's default (the embedded one clipped to its size).

    ``cifar10``: the source folder, as the config's ``data`` (the runs read a subset of it: see ``mjp_command``).
    """
    from mjp_fast.reproduce.variants import get_preset
    from mjp_fast.train.config import PRESETS, build_config

    chosen = []
    for data in datasets:
        if data == "embedded":
            values = _recipe_values(PRESETS["digits"], device=device, workers=workers, threads=threads)
            values["dataset"] = "digits"
            most = _digits_train_size() // values["batch_size"]
            wanted = min(steps or STEPS[data], most)
            values["max_train_samples"] = wanted * values["batch_size"]
            config = build_config(values)
            title = "digits preset model (16 px, patch 4, width 64, 2 blocks), scikit-learn's digits"
            chosen.append(Setup(data, title, config, wanted, None))
        elif data == "cifar10":
            preset = get_preset("gpu" if device == "cuda" else "cpu")
            values = _recipe_values(preset.config, device=device, workers=workers, threads=threads)
            values.update(dataset="folder", val_split="test", data=str(cifar10))
            config = build_config(values)
            title = (
                f"{preset.name}-preset model ({config.img_size} px, patch {config.patch_size}, width "
                f"{config.embed_dim}, {config.depth} blocks), CIFAR-10"
            )
            chosen.append(Setup(data, title, config, steps or STEPS[data], val_images))
        else:
            raise ValueError(f"datasets must be among {', '.join(DATASETS)}, got {data!r}")
    for setup in chosen:
        check_translatable(setup.config)
    return chosen


def _digits_train_size() -> int:
    from mjp_fast.train.data import DigitsDataset

    return len(DigitsDataset("train"))


def check_translatable(config: Any) -> None:
    """Raises ValueError when the recipe uses a feature that the timm command line below does not pass on."""
    wrong = {key: getattr(config, key) for key, value in UNTRANSLATED.items() if getattr(config, key) != value}
    if wrong:
        raise ValueError(f"the bench recipe must keep these keys at {UNTRANSLATED}, got {wrong}")


# ---------------------------------------------------------------------------------------------------------------
# The two command lines
# ---------------------------------------------------------------------------------------------------------------


def _value_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value_text(item) for item in value) + "]"
    return str(value)


def mjp_command(config: Any, *, mjp: bool, data_dir: Path | None, output: Path) -> list[str]:
    """``mjp train`` with every config key spelled out (so a change of mjp's defaults cannot desync the tools)."""
    values = config.replace(mjp=mjp, data=str(data_dir) if data_dir is not None else None, output=None).to_dict()
    del values["output"]
    overrides = [f"{key}={_value_text(value)}" for key, value in values.items()]
    return [sys.executable, "-m", "mjp_fast.cli", "train", "--output", str(output), *overrides]


def timm_command(
    train_py: Path,
    config: Any,
    *,
    data_dir: Path,
    val_split: str,
    class_map: Path,
    output: Path,
    experiment: str,
) -> list[str]:
    """timm's ``train.py`` with the recipe of ``config`` (an mjp train config): the same model and values."""
    from mjp_fast.train.models import base_name

    model_kwargs = [
        f"{key}={getattr(config, key)}"
        for key in ("img_size", "patch_size", "embed_dim", "depth", "num_heads")
        if getattr(config, key) is not None
    ]
    arguments = [
        sys.executable, str(train_py),
        "--data-dir", str(data_dir), "--train-split", "train", "--val-split", val_split,
        "--class-map", str(class_map),
        "--model", base_name(config.model), "--num-classes", str(config.num_classes),
        "--drop-path", str(config.drop_path), "--model-kwargs", *model_kwargs,
        "--crop-pct", str(config.crop_pct),
        "--interpolation", config.interpolation, "--train-interpolation", config.interpolation,
        "--scale", *(str(value) for value in config.scale), "--hflip", str(config.hflip),
        "--color-jitter", str(config.color_jitter), "--reprob", str(config.reprob),
        "--mixup", str(config.mixup), "--cutmix", str(config.cutmix), "--smoothing", str(config.smoothing),
        "--opt", config.opt, "--lr", str(config.lr), "--weight-decay", str(config.weight_decay),
        "--momentum", str(config.momentum),
        "--sched", config.sched, "--sched-on-updates", "--epochs", str(config.epochs),
        "--warmup-epochs", str(config.warmup_epochs), "--warmup-lr", str(config.warmup_lr),
        "--min-lr", str(config.min_lr), "--cooldown-epochs", str(config.cooldown_epochs),
        "-b", str(config.batch_size), "--validation-batch-size", str(config.eval_batch_size or 2 * config.batch_size),
        "-j", str(config.workers), "--seed", str(config.seed), "--log-interval", str(config.log_interval),
        "--output", str(output), "--experiment", experiment, "--device", config.device,
    ]  # fmt: skip
    if config.img_size is not None:
        arguments += ["--img-size", str(config.img_size)]
    for key, flag in (("mean", "--mean"), ("std", "--std")):
        if getattr(config, key) is not None:
            arguments += [flag, *(str(value) for value in getattr(config, key))]
    if config.opt_eps is not None:
        arguments += ["--opt-eps", str(config.opt_eps)]
    if config.clip_grad is not None:
        arguments += ["--clip-grad", str(config.clip_grad), "--clip-mode", config.clip_mode]
    if config.device == "cpu":
        arguments.append("--no-prefetcher")  # timm's prefetcher needs CUDA
    else:
        arguments.append("--pin-mem")  # timm's prefetcher stays on (its default), as a GPU user runs it
    if config.amp in ("bf16", "fp16"):
        arguments += ["--amp", "--amp-dtype", "bfloat16" if config.amp == "bf16" else "float16"]
    return arguments


# ---------------------------------------------------------------------------------------------------------------
# The data: identical files for both tools
# ---------------------------------------------------------------------------------------------------------------


def _class_folders(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in split_dir.iterdir() if entry.is_dir() and not entry.name.startswith("."))


def balanced_pick(files_by_class: dict[str, list[str]], count: int, seed: int) -> dict[str, list[str]]:
    """``count`` files spread over the classes as evenly as they go (the first ``count % classes`` classes get one
    more), each class's files drawn from a fixed shuffle (``seed``), returned sorted."""
    classes = sorted(files_by_class)
    rng = np.random.default_rng(seed)
    picked = {}
    for position, name in enumerate(classes):
        wanted = count // len(classes) + (1 if position < count % len(classes) else 0)
        files = sorted(files_by_class[name])
        if wanted > len(files):
            raise ValueError(f"class {name!r} has {len(files)} images, {wanted} wanted")
        order = rng.permutation(len(files))[:wanted]
        picked[name] = sorted(files[index] for index in order)
    return picked


def image_folder_subset(source: Path, dest: Path, train_images: int, val_images: int, seed: int = SEED) -> dict:
    """A class-balanced subset of an ImageFolder tree ``source/{train,<val>}/<class>/<image>`` as symbolic links
    under ``dest`` (same split, class and file names); returns the split names, classes and counts."""
    from mjp_fast.train.data import IMAGE_EXTENSIONS, resolve_split

    train_dir = resolve_split(source, "train")
    val_dir = resolve_split(source, "auto", validation=True)
    classes = _class_folders(train_dir)
    if not classes:
        raise ValueError(f"{train_dir} has no class folders")
    counts = {}
    for split_dir, count in ((train_dir, train_images), (val_dir, val_images)):
        files = {}
        for name in classes:
            entries = (split_dir / name).iterdir()
            files[name] = [entry.name for entry in entries if entry.name.lower().endswith(IMAGE_EXTENSIONS)]
        picked = balanced_pick(files, count, seed)
        for name, chosen in picked.items():
            folder = dest / split_dir.name / name
            folder.mkdir(parents=True, exist_ok=True)
            for file in chosen:
                (folder / file).symlink_to((split_dir / name / file).resolve())
        counts[split_dir.name] = sum(len(chosen) for chosen in picked.values())
    return {"train_split": "train", "val_split": val_dir.name, "classes": classes, "images": counts}


def digits_folder(dest: Path, train_images: int | None, val_images: int | None) -> dict:
    """mjp train's embedded data set written as PNG files, ``dest/{train,val}/<digit>/<n>.png``: exactly the images
    that ``dataset=digits`` with ``max_train_samples``/``max_val_samples`` trains and validates on."""
    from mjp_fast.train.data import DigitsDataset, fixed_subset

    counts = {}
    classes = DigitsDataset("val").classes
    for split, size in (("train", train_images), ("val", val_images)):
        dataset = fixed_subset(DigitsDataset(split), size)
        for name in classes:
            (dest / split / name).mkdir(parents=True, exist_ok=True)
        for position in range(len(dataset)):
            image, target = dataset[position]
            image.save(dest / split / classes[target] / f"{position:05d}.png")
        counts[split] = len(dataset)
    return {"train_split": "train", "val_split": "val", "classes": classes, "images": counts}


def read_once(folder: Path) -> int:
    """Reads every file under ``folder`` (through its links): the first run must not pay for cold disk reads."""
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            total += len(path.read_bytes())
    return total


# ---------------------------------------------------------------------------------------------------------------
# Running a tool and reading what it measured
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProcessRun:
    """A finished process: its output lines with their arrival times (seconds after the start) and its wall time."""

    lines: list[tuple[float, str]]
    wall_s: float
    returncode: int

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def run_process(command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> ProcessRun:
    """Runs ``command`` with stdout and stderr merged, timestamping each line as it arrives; kills it after
    ``timeout_s``."""
    begin = time.perf_counter()
    process = subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    killer = threading.Timer(timeout_s, process.kill)
    killer.start()
    lines = []
    try:
        for line in iter(process.stdout.readline, ""):
            lines.append((time.perf_counter() - begin, line.rstrip("\n")))
        returncode = process.wait()
    finally:
        killer.cancel()
        process.stdout.close()
    return ProcessRun(lines, time.perf_counter() - begin, returncode)


TIMM_TRAIN_LINE = re.compile(
    r"^Train: (?P<epoch>\d+) \[\s*(?P<index>\d+)/(?P<updates>\d+) .*?"
    r"Time: (?P<step_s>[\d.]+)s,\s*(?P<rate>[\d.]+)/s\s+\((?P<mean_step_s>[\d.]+)s,\s*(?P<mean_rate>[\d.]+)/s\)"
)
TIMM_TEST_LINE = re.compile(r"^Test: \[\s*(?P<index>\d+)/(?P<last>\d+)\]\s+Time: (?P<s>[\d.]+) \((?P<mean_s>[\d.]+)\)")


def parse_timm_log(lines: Sequence[tuple[float, str]] | str) -> dict[str, Any]:
    """What timm's ``train.py`` measured in its first epoch, from its log (lines, or ``(arrival s, line)`` pairs).

    Returns ``train_images_per_s`` (the mean rate printed at the epoch's last batch), ``train_step_s`` (the mean
    update time), ``updates``, ``eval_s`` (mean batch time x batches at the last ``Test:`` line; None without one),
    ``eval_batches``, and ``eval_s_from_lines`` (arrival of that ``Test:`` line minus that of the last ``Train:``
    line; None for plain text). Raises ValueError when the log has no last-batch ``Train:`` line.
    """
    if isinstance(lines, str):
        lines = [(math.nan, line) for line in lines.splitlines()]
    last_train = last_test = None
    for arrival, line in lines:
        match = TIMM_TRAIN_LINE.search(line)
        if match and match["epoch"] == "0" and int(match["index"]) + 1 == int(match["updates"]):
            last_train = (arrival, match)
            continue
        match = TIMM_TEST_LINE.search(line)
        if match and last_train is not None and last_test is None and match["index"] == match["last"]:
            last_test = (arrival, match)
    if last_train is None:
        raise ValueError("timm's log has no line for the first epoch's last batch ('Train: 0 [ N-1/N ...')")
    train = last_train[1]
    result = {
        "train_images_per_s": float(train["mean_rate"]),
        "train_step_s": float(train["mean_step_s"]),
        "updates": int(train["updates"]),
        "eval_s": None,
        "eval_batches": None,
        "eval_s_from_lines": None,
    }
    if last_test is not None:
        test = last_test[1]
        batches = int(test["last"]) + 1
        result.update(eval_s=float(test["mean_s"]) * batches, eval_batches=batches)
        if not math.isnan(last_test[0]):
            result["eval_s_from_lines"] = last_test[0] - last_train[0]
    return result


MJP_RECORD_LINE = re.compile(r"^epoch\s+1/\d+\s+loss ")  # the epoch record, not a log line ("epoch 1/N  batch ...")
MJP_HEADER_PREFIX = "mjp train: "


def parse_mjp_run(output: Path, lines: Sequence[tuple[float, str]]) -> dict[str, Any]:
    """What ``mjp train`` measured in its first epoch: ``metrics.jsonl``'s record, and its evaluation time
    (``eval_seconds`` when recorded, else from the arrival times of its header and epoch lines)."""
    path = output / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no epoch record")
    record = records[0]
    header = next((arrival for arrival, line in lines if line.startswith(MJP_HEADER_PREFIX)), None)
    printed = next((arrival for arrival, line in lines if MJP_RECORD_LINE.search(line)), None)
    from_lines = None
    if header is not None and printed is not None:
        from_lines = printed - header - record["epoch_seconds"]
    eval_s = record.get("eval_seconds")
    return {
        "train_images_per_s": record["train_images_per_second"],
        "train_step_s": record["epoch_seconds"] / max(record["step"], 1),
        "updates": record["step"],
        "eval_s": eval_s if eval_s is not None else from_lines,
        "eval_source": "metrics.jsonl eval_seconds" if eval_s is not None else "output line times",
        "eval_s_from_lines": from_lines,
    }


def _environment(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",  # lines arrive when printed: their arrival times time the evaluation
        HF_HUB_OFFLINE="1",
    )
    # the checkout's mjp_fast, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _tail(run: ProcessRun, count: int = 15) -> str:
    return "\n".join(line for _, line in run.lines[-count:])


def run_tool(
    tool: str,
    setup: Setup,
    *,
    data: dict,
    data_dir: Path | None,
    work: Path,
    train_py: Path | None,
    threads: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One run of ``tool``: its measurements, wall time, load averages and command line."""
    output = work / "output"
    output.mkdir(parents=True)
    if tool == TIMM:
        command = timm_command(
            train_py,
            setup.config,
            data_dir=data["folder"],
            val_split=data["val_split"],
            class_map=data["class_map"],
            output=output,
            experiment="run",
        )
    else:
        command = mjp_command(setup.config, mjp=tool == MJP_TRUE, data_dir=data_dir, output=output)
    load_before = _load()
    run = run_process(command, cwd=work, env=_environment(threads), timeout_s=timeout_s)
    if run.returncode != 0:
        raise RuntimeError(f"{tool} exited with {run.returncode}; its last lines:\n{_tail(run)}")
    measured = parse_timm_log(run.lines) if tool == TIMM else parse_mjp_run(output, run.lines)
    if measured["updates"] != setup.steps:
        raise RuntimeError(f"{tool} trained {measured['updates']} steps, {setup.steps} expected:\n{_tail(run)}")
    return {**measured, "wall_s": run.wall_s, "load_before": load_before, "load_after": _load(), "command": command}


# ---------------------------------------------------------------------------------------------------------------
# The case
# ---------------------------------------------------------------------------------------------------------------


def _prepare_data(setup: Setup, root: Path, cifar10: Path) -> tuple[dict, Path | None]:
    """The files of ``setup``'s runs; returns their description and the ``data=`` folder of mjp (None: digits)."""
    folder = root / f"data-{setup.data}"
    batch = setup.config.batch_size
    if setup.data == "embedded":
        info = digits_folder(folder, setup.steps * batch, setup.val_images)
        mjp_dir = None
    else:
        info = image_folder_subset(cifar10, folder, setup.steps * batch, setup.val_images)
        mjp_dir = folder
    info["folder"] = folder
    info["class_map"] = root / f"classes-{setup.data}.txt"
    info["class_map"].write_text("".join(f"{name}\n" for name in info["classes"]))
    info["bytes_read"] = read_once(folder)
    return info, mjp_dir


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _row(setup: Setup, tool: str, runs: list[dict], data: dict) -> dict[str, Any]:
    rates = [run["train_images_per_s"] for run in runs]
    batch = setup.config.batch_size
    step_times = [batch / rate for rate in rates]
    evals = [run["eval_s"] for run in runs if run["eval_s"] is not None]
    return {
        "data": setup.data,
        "model": setup.title,
        "implementation": tool,
        "batch": batch,
        "steps": setup.steps,
        "train_images": data["images"][data["train_split"]],
        "val_images": data["images"][data["val_split"]],
        # seconds per training step (batch / images per second): the suite's timing fields
        "median_s": float(np.median(step_times)),
        "p20_s": _percentile(step_times, 20),
        "p80_s": _percentile(step_times, 80),
        "min_s": float(min(step_times)),
        "samples": len(runs),
        "calls_per_sample": setup.steps,
        "images_per_s": float(np.median(rates)),
        "images_per_s_p20": _percentile(rates, 20),
        "images_per_s_p80": _percentile(rates, 80),
        "images_per_s_runs": rates,
        "eval_s": float(np.median(evals)) if evals else None,
        "eval_s_runs": [run["eval_s"] for run in runs],
        "eval_measures": (
            "timm validate(): clean top-1/top-5"
            if tool == TIMM
            else "clean + jigsawed passes and the position regression (" + runs[0]["eval_source"] + ")"
        ),
        "wall_s": float(np.median([run["wall_s"] for run in runs])),
        "wall_s_runs": [run["wall_s"] for run in runs],
        "load_runs": [[run["load_before"], run["load_after"]] for run in runs],
        "ratio_vs_timm": None,
        "ratio_vs_timm_runs": None,
        "ratio_vs_mjp_false": None,
        "ratio_vs_mjp_false_runs": None,
    }


def _add_ratios(rows: list[dict]) -> None:
    """Ratios of median training images/s, and per-round ratios (the runs of one round ran back to back)."""
    by_key = {(row["data"], row["implementation"]): row for row in rows}
    wanted = {"ratio_vs_timm": (TIMM, (MJP_FALSE, MJP_TRUE)), "ratio_vs_mjp_false": (MJP_FALSE, (MJP_TRUE,))}
    for row in rows:
        for field, (denominator, numerators) in wanted.items():
            base = by_key.get((row["data"], denominator))
            if base is None or row["implementation"] not in numerators:
                continue
            row[field] = row["images_per_s"] / base["images_per_s"]
            row[field + "_runs"] = [
                mine / theirs for mine, theirs in zip(row["images_per_s_runs"], base["images_per_s_runs"], strict=True)
            ]


def _aims(rows: list[dict], not_run: dict[str, str], *, smoke: bool, device: str, gpu: str | None) -> list[dict]:
    aims = []
    for kind, numerator, denominator, threshold in AIMS:
        where = "on the CPU" if kind == "cpu" else "on an H100/H200"
        aim = {
            "aim": f"{where}, {AIM_DATA}: {numerator} at least {threshold:g}x the training images/s of {denominator}",
            "threshold": threshold,
            "measured": None,
            "unit": "x",
            "verdict": "NOT RUN",
        }
        on_gpu = device == "cuda" and any(name in (gpu or "") for name in GPU_KINDS)
        on_device = device == "cpu" if kind == "cpu" else on_gpu
        row = next((r for r in rows if r["data"] == AIM_DATA and r["implementation"] == numerator), None)
        field = "ratio_vs_timm" if denominator == TIMM else "ratio_vs_mjp_false"
        if not on_device:
            aim["note"] = f"needs {'the CPU' if kind == 'cpu' else 'an ' + kind}; measured on {gpu or device}"
        elif row is None or row[field] is None:
            missing = [tool for tool in (numerator, denominator) if f"{AIM_DATA}: {tool}" in not_run]
            reasons = "; ".join(not_run[f"{AIM_DATA}: {tool}"] for tool in missing)
            aim["note"] = f"not measured: {reasons}" if reasons else f"{AIM_DATA} was not run"
        else:
            aim["measured"] = row[field]
            aim["verdict"] = aim_verdict(aim["measured"], threshold, higher_is_better=True)
            per_round = ", ".join(f"{value:.3f}" for value in row[field + "_runs"])
            aim["note"] = f"ratio of medians over {row['samples']} alternating runs; per round: {per_round}"
        if smoke:
            aim.update(verdict="NOT JUDGED", note="smoke run: tiny sizes")
        aims.append(aim)
    return aims


def collect(
    *,
    smoke: bool,
    device: str,
    repeats: int | None = None,
    timm_train_py: str | None = None,
    datasets: str | Sequence[str] | None = None,
    steps: int | None = None,
    val_images: int | None = None,
    cifar10: str | None = None,
    workers: int | None = None,
) -> dict:
    """Measures the case; returns its section of the results: ``config``, ``backends``, ``results``, ``aims``.

    ``timm_train_py`` defaults to ``$TIMM_TRAIN_PY``; ``cifar10`` to ``$MJP_BENCH_CIFAR10``, else
    ``../shared/data/cifar10``. A smoke run: the embedded data only, 2 steps, one round.
    """
    from mjp_fast.backend import resolve_backend

    train_py = timm_train_py or os.environ.get(TIMM_TRAIN_PY_ENV) or None
    train_py = Path(train_py).resolve() if train_py else None
    if train_py is not None and not train_py.is_file():
        raise ValueError(f"--timm-train-py / {TIMM_TRAIN_PY_ENV}: {train_py} is not a file")
    cifar_dir = Path(cifar10 or os.environ.get(CIFAR10_ENV) or DEFAULT_CIFAR10)
    if isinstance(datasets, str):
        datasets = [part.strip() for part in datasets.split(",") if part.strip()]
    datasets = list(datasets or (("embedded",) if smoke else DATASETS))
    repeats = repeats or (SMOKE_REPEATS if smoke else REPEATS)
    threads = torch.get_num_threads()
    workers = workers if workers is not None else (GPU_WORKERS if device == "cuda" else CPU_WORKERS)
    not_run: dict[str, str] = {}
    if "cifar10" in datasets and not (cifar_dir / "train").is_dir():
        datasets.remove("cifar10")
        for tool in TOOLS:
            not_run[f"cifar10: {tool}"] = (
                f"no CIFAR-10 ImageFolder at {cifar_dir} (give --cifar10 DIR or set {CIFAR10_ENV})"
            )
    chosen = setups(
        datasets,
        device=device,
        steps=SMOKE_STEPS if smoke and steps is None else steps,
        val_images=val_images or VAL_IMAGES,
        workers=workers,
        threads=threads,
        cifar10=cifar_dir,
    )
    tools = [tool for tool in TOOLS if tool != TIMM or train_py is not None]
    if train_py is None:
        for setup in chosen:
            not_run[f"{setup.data}: {TIMM}"] = WHERE_TIMM_TRAIN_PY

    rows, runs_config = [], []
    root = Path(tempfile.mkdtemp(prefix="mjp-bench-train-loop-"))
    try:
        for setup in chosen:
            data, mjp_dir = _prepare_data(setup, root, cifar_dir)
            runs: dict[str, list[dict]] = {tool: [] for tool in tools}
            for round_index in range(repeats):
                for tool in tools if round_index % 2 == 0 else reversed(tools):
                    slug = re.sub(r"[^a-z0-9]+", "-", tool)
                    work = root / f"{setup.data}-{slug}-{round_index}"
                    work.mkdir()
                    runs[tool].append(
                        run_tool(
                            tool,
                            setup,
                            data=data,
                            data_dir=mjp_dir,
                            work=work,
                            train_py=train_py,
                            threads=threads,
                            timeout_s=RUN_TIMEOUT_S,
                        )
                    )
                    shutil.rmtree(work, ignore_errors=True)  # checkpoints: not needed, and the disk is shared
            rows += [_row(setup, tool, runs[tool], data) for tool in tools]
            runs_config.append(
                {
                    "data": setup.data,
                    "model": setup.title,
                    "steps": setup.steps,
                    "batch": setup.config.batch_size,
                    "images": data["images"],
                    "source": "mjp_fast.train.data.DigitsDataset" if setup.data == "embedded" else str(cifar_dir),
                    "recipe": _recipe_summary(setup.config),
                    "commands": {
                        tool: [str(part).replace(str(root), "$TMP") for part in runs[tool][0]["command"]]
                        for tool in tools
                    },
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _add_ratios(rows)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {
        "config": {
            "runs": runs_config,
            "repeats": repeats,
            "order": "alternating rounds: " + ", ".join(tools) + ", then reversed, ...",
            "threads": threads,
            "workers": workers,
            "timm_train_py": _describe_train_py(train_py),
            "timm": _timm_version(),
            "measures": {
                "train_images_per_s": "images / seconds from before the loader's first batch to the end of the last "
                "step (timm: mean rate at the epoch's last 'Train:' line; mjp: metrics.jsonl "
                "train_images_per_second); excludes start-up, evaluation and checkpoints",
                "eval_s": "timm: validate() (mean batch time x batches at its last 'Test:' line); mjp: "
                "metrics.jsonl eval_seconds, else (epoch line - header line arrival) - epoch_seconds",
                "wall_s": "the process from start to exit",
            },
        },
        "backends": [resolve_backend(None, torch.device(device))],
        "not_run": not_run,
        "results": rows,
        "aims": _aims(rows, not_run, smoke=smoke, device=device, gpu=gpu),
    }


def _recipe_summary(config: Any) -> dict[str, Any]:
    keys = (
        "model", "img_size", "patch_size", "embed_dim", "depth", "num_heads", "drop_path", "num_classes",
        "mjp_ratio", "mjp_prob", "mjp_dal", "batch_size", "eval_batch_size", "workers", "threads", "mean", "std",
        "crop_pct", "interpolation", "scale", "hflip", "color_jitter", "smoothing", "opt", "lr", "weight_decay",
        "opt_eps", "clip_grad", "clip_mode", "sched", "epochs", "warmup_epochs", "warmup_lr", "min_lr", "amp",
        "device", "log_interval",
    )  # fmt: skip
    return {key: getattr(config, key) for key in keys}


def _describe_train_py(path: Path | None) -> dict[str, Any] | None:
    """The script that ran: path, SHA-256, and git's blob id (``git rev-parse <tag>:train.py`` gives the same)."""
    if path is None:
        return None
    content = path.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    return {"path": str(path), "sha256": hashlib.sha256(content).hexdigest(), "git_blob": blob}


def _timm_version() -> str:
    import timm

    return timm.__version__


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def _ratio_text(value: float | None, runs: list[float] | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f}x [" + ", ".join(f"{item:.3f}" for item in runs) + "]"


def table(rows: list[dict]) -> str:
    headers = [
        "data",
        "tool",
        "batch x steps",
        "train img/s: median [p20, p80]",
        "step",
        "vs timm train.py [per round]",
        "vs mjp=false [per round]",
        "evaluation s",
        "wall s",
    ]
    body = []
    for row in rows:
        body.append(
            [
                row["data"],
                row["implementation"],
                f"{row['batch']} x {row['steps']}",
                f"{row['images_per_s']:.1f} [{row['images_per_s_p20']:.1f}, {row['images_per_s_p80']:.1f}]",
                f"{1e3 * row['median_s']:.1f} ms",
                _ratio_text(row["ratio_vs_timm"], row["ratio_vs_timm_runs"]),
                _ratio_text(row["ratio_vs_mjp_false"], row["ratio_vs_mjp_false_runs"]),
                "" if row["eval_s"] is None else f"{row['eval_s']:.1f}",
                f"{row['wall_s']:.1f}",
            ]
        )
    return markdown_table(headers, body)


def report(section: dict, info: dict) -> str:
    """The printed Markdown of a section: title, the table, what each number measures, NOT RUN lines, aims."""
    config = section["config"]
    train_py = config.get("timm_train_py")
    script = f"{train_py['path']} (git blob {train_py['git_blob'][:12]})" if train_py else "not given"
    threads = "" if not info.get("gpu") else f", {config['threads']} torch threads"
    workers = config["workers"]
    lines = [
        f"## Training loop: mjp train against timm's train.py ({where_measured(info)}{threads}, {workers} loader "
        f"worker{'' if workers == 1 else 's'}, timm {config['timm']})",
        "",
    ]
    for run in config["runs"]:
        images = run["images"]
        counts = " / ".join(f"{count} {split}" for split, count in images.items())
        lines.append(f"- {run['data']}: {run['model']}; {counts} images; batch {run['batch']} x {run['steps']} steps")
    lines += [
        f"- timm's train.py: {script}",
        "",
        table(section["results"]),
        "",
        "train img/s: images / seconds from before the loader's first batch to the end of the last step (start-up, "
        "evaluation and checkpoints excluded; the loader's start included, for both): timm's mean rate at the "
        "epoch's last batch, mjp's metrics.jsonl train_images_per_second; median and 20th/80th percentiles over "
        f"{config['repeats']} alternating rounds. Ratios: of the medians, and [per round]. Evaluation s: timm's "
        "validate() (clean); mjp's clean and jigsawed passes and the position regression. Wall s: the whole "
        "process.",
        "",
    ]
    lines += [f"NOT RUN: {what}: {why}" for what, why in section.get("not_run", {}).items()]
    loads = [load for row in section["results"] for pair in row["load_runs"] for load in pair if load is not None]
    if loads:
        lines.append(f"load average (1 min) around the runs: {min(loads):.2f} to {max(loads):.2f}")
    lines += [aim_line(aim) for aim in section["aims"]]
    return "\n".join(lines)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timm-train-py",
        default=None,
        metavar="PATH",
        help=f"timm's train.py (default: ${TIMM_TRAIN_PY_ENV}; without it the timm rows are NOT RUN): "
        f"{TAKE_TIMM_TRAIN_PY}",
    )
    parser.add_argument(
        "--datasets",
        default=None,
        metavar="DATA[,DATA]",
        help=f"a comma-separated subset of {','.join(DATASETS)} (default: both; smoke: embedded)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"training steps per run (default: {STEPS}; embedded at most 44)"
    )
    parser.add_argument(
        "--val-images", type=int, default=None, help=f"cifar10 validation images (default {VAL_IMAGES})"
    )
    parser.add_argument(
        "--cifar10",
        default=None,
        metavar="DIR",
        help=f"CIFAR-10 ImageFolder (default: ${CIFAR10_ENV}, else {DEFAULT_CIFAR10})",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"loader processes (default {CPU_WORKERS} on the CPU, {GPU_WORKERS} on a GPU)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(NAME, __doc__.split("\n\n")[0], collect, report, argv, _add_arguments)


if __name__ == "__main__":
    sys.exit(main())
