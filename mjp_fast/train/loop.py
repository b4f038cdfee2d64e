"""The training loop of ``mjp train``: timm's optimizer, schedule, Mixup and losses, with MJP and DAL.

One process per GPU under ``torchrun`` (DDP), or one process on a CPU or GPU:

    torchrun --nproc_per_node=8 -m mjp_fast.cli train --config deit_s.yaml --data /data/imagenet

Per step: mixup/cutmix on the batch, then the model's forward (which jigsaws the batch: MJP comes after mixup, as
in the paper's code), the classification loss plus ``dal_weight(step) * model.mjp_aux_loss()``, backward, gradient
clipping, the optimizer step and the schedule. The jigsaw starts at ``mjp_from_epoch`` (default: the end of
warm-up); the DAL weight decays from ``dal_weight`` to ``dal_weight_end`` along a cosine over the whole run.

Reproducibility and resumption: each step seeds the global generators from ``(seed, rank, epoch, batch)`` (mixup,
drop-path) and each sample its transform (see :mod:`mjp_fast.train.data`); the jigsaw stream is the model's
``mjp.sampler`` counter, a buffer in the checkpoint. A run resumed from any checkpoint, at an epoch boundary or
within an epoch (``checkpoint_steps``), continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from timm.data import Mixup, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import dispatch_clip_grad
from torch import nn

from mjp_fast._atomic import write_atomically
from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.evaluate.position import model_position_regression
from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import ConfigError, TrainConfig, save_config
from mjp_fast.train.data import (
    build_datasets,
    default_workers,
    draw_seed,
    eval_loader,
    eval_transform,
    seed_everything,
    set_transform,
    train_loader,
    train_transform,
)
from mjp_fast.train.models import create_model, input_size, is_mjp_model, model_spec, patch_size_of

LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SCHEDULE_KEYS = ("epochs", "sched", "warmup_epochs", "warmup_lr", "min_lr", "cooldown_epochs", "lr")
FINAL_KEYS = ("top1", "top5", "consistency", "diff_norm", "val_loss", "pos_mae_1d", "pos_mae_2d")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: the run stops (its last checkpoint is the last good state)."""


@dataclass
class RunResult:
    """What a finished (or already finished) run produced."""

    output: Path
    checkpoint: Path
    config: TrainConfig
    history: list[dict[str, Any]]
    final: dict[str, Any] = field(default_factory=dict)


@dataclass
class Distributed:
    """The process's place in the job: rank, world size, device, and whether it set up the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but torch sees no CUDA GPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def setup_distributed(config: TrainConfig) -> Distributed:
    """Joins the ``torchrun`` job when ``WORLD_SIZE > 1`` (NCCL on GPUs, gloo on CPUs); else one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size <= 1:
        return Distributed(device=device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


@contextlib.contextmanager
def distributed_session(config: TrainConfig) -> Iterator[Distributed]:
    """The process group of a whole command: joined on entry, destroyed on exit only if this call created it.

    Everything that trains more than one model in one ``torchrun`` job (``compare=true``) must run inside one
    session: a default group destroyed and created again gets the same name, hence the same keys in torchrun's
    store, and the new group's gloo/NCCL handshake reads the old group's stale addresses (connection refused or
    reset, or a hang). Nested sessions, and a caller's own group, are reused and left alone.
    """
    context = setup_distributed(config)
    try:
        yield context
    finally:
        if context.owns_group:
            dist.destroy_process_group()


def broadcast_from_main(value: Any, context: Distributed) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object): decisions that every rank must make alike."""
    if context.world_size == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def default_output(config: TrainConfig) -> str:
    name = "digits" if config.dataset_kind == "digits" else Path(str(config.data)).resolve().name or "data"
    return str(Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")


def dal_weight_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """The DAL weight after ``step`` of ``total_steps`` optimizer steps: cosine from dal_weight to dal_weight_end."""
    progress = min(max(step / max(total_steps, 1), 0.0), 1.0)
    return config.dal_weight_end + (config.dal_weight - config.dal_weight_end) * 0.5 * (
        1 + math.cos(math.pi * progress)
    )


def amp_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    choice = config.amp
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "none"
    if choice == "fp16" and device.type != "cuda":
        raise ConfigError("amp=fp16 needs a CUDA device; use amp=bf16 or amp=none on the CPU")
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]


def _progress_enabled(config: TrainConfig, context: Distributed) -> bool:
    if not context.is_main or config.progress == "off":
        return False
    return config.progress == "on" or sys.stderr.isatty()


@dataclass
class _TallyReading:
    """One read back of a :class:`_StepTally`: plain Python numbers."""

    sums: dict[str, float]  # this rank's running sums, in the checkpoint's ``running`` format
    diverged: bool  # a total loss on this rank was NaN or infinite
    first_bad: tuple[float, float, float, int, int]  # the first such batch: total, classification, DAL, batch, step
    all_sums: dict[str, float] | None = None  # every rank's sums together (read with all_ranks=True)
    diverged_anywhere: bool = False  # on any rank (read with all_ranks=True; else this rank)
    last_loss: float | None = None


class _StepTally:
    """The epoch's running loss sums and the divergence watch, kept on the training device.

    Reading a device tensor back (``float``, ``.item()``, ``bool``, ``.tolist()``) makes the host wait until the
    GPU has run everything queued, which stalls the launch queue; so each step only adds to these tensors, and the
    loop reads them back at log intervals, before a checkpoint and at the epoch's end (as timm's train script reads
    its losses only at log intervals). A NaN or infinite total loss is recorded on the device with its batch and
    step, and raised as :class:`TrainingDiverged` at the next read: the loop reads before every checkpoint, so no
    checkpoint is written after the loss went bad.
    """

    # values: loss sum, DAL sum, samples (the sums weight each batch's mean by its size), then a flag set by the
    # first non-finite total loss and that batch's total, classification and DAL losses, batch index and step.
    _SIZE = 9

    def __init__(self, device: torch.device, running: dict[str, float] | None = None) -> None:
        # float64 keeps the sums what the Python floats they replace were; MPS has no float64
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        start = [running["loss"], running["dal"], running["samples"]] if running else [0.0, 0.0, 0.0]
        self.values = torch.tensor(start + [0.0] * (self._SIZE - 3), dtype=self.dtype, device=device)
        self.no_dal = torch.zeros((), dtype=self.dtype, device=device)

    def add(
        self, total: torch.Tensor, loss: torch.Tensor, dal: torch.Tensor | None, batch: int, batch_index: int, step: int
    ) -> None:
        """Adds one batch (``total``, ``loss``, ``dal``: 0-d means over ``batch`` samples): device ops only."""
        values = self.values
        losses = torch.stack(
            [loss.detach().to(self.dtype), self.no_dal if dal is None else dal.detach().to(self.dtype)]
        )
        # multiply, then add: the same two roundings as the Python floats of before, so the records do not move
        values[0:2].add_(losses * batch)
        values[2].add_(batch)
        total = total.detach().to(self.dtype)
        first = torch.isfinite(total).logical_not_().logical_and_(values[3] == 0)
        values[4:7].copy_(torch.where(first, torch.cat([total.reshape(1), losses]), values[4:7]))
        values[7].masked_fill_(first, batch_index)
        values[8].masked_fill_(first, step)
        values[3].masked_fill_(first, 1.0)

    def read(self, *, all_ranks: bool = False, last_loss: torch.Tensor | None = None) -> _TallyReading:
        """Everything in one host read; ``all_ranks`` adds the sums and flag of every rank (a collective)."""
        parts = [self.values]
        if all_ranks:
            reduced = self.values[:4].clone()
            dist.all_reduce(reduced)
            parts.append(reduced)
        if last_loss is not None:
            parts.append(last_loss.detach().to(self.dtype).reshape(1))
        numbers = torch.cat(parts).tolist()  # the one host-device synchronization
        reading = _TallyReading(
            sums=_sums_dict(numbers[0:3]),
            diverged=numbers[3] > 0,
            first_bad=(numbers[4], numbers[5], numbers[6], int(numbers[7]), int(numbers[8])),
            diverged_anywhere=numbers[3] > 0,
        )
        if all_ranks:
            reading.all_sums = _sums_dict(numbers[self._SIZE : self._SIZE + 3])
            reading.diverged_anywhere = numbers[self._SIZE + 3] > 0
        if last_loss is not None:
            reading.last_loss = numbers[-1]
        return reading


def _sums_dict(numbers: list[float]) -> dict[str, float]:
    return dict(zip(("loss", "dal", "samples"), numbers, strict=True))


def _check_divergence(
    reading: _TallyReading, epoch: int, noticed: str, dal_on: bool, last_path: Path, lr: float
) -> None:
    """Raises :class:`TrainingDiverged` if ``reading`` saw a NaN or infinite total loss (``noticed``: where)."""
    if not reading.diverged_anywhere:
        return
    advice = (
        f"stopping. The last good checkpoint is {last_path if last_path.exists() else 'none yet'}; lower lr "
        f"(now {lr:.2e}), set clip_grad, or check the data"
    )
    if not reading.diverged:
        raise TrainingDiverged(f"the loss became NaN or infinite on another rank, noticed {noticed}; {advice}")
    total, loss, dal, batch, step = reading.first_bad
    dal_text = f", DAL {dal:.4g}" if dal_on else ""
    # Losses are read back only at log intervals, checkpoints and epoch ends: the run may have gone on a few steps.
    raise TrainingDiverged(
        f"the loss became {total} at epoch {epoch + 1}, batch {batch}, step {step} (classification {loss:.4g}"
        f"{dal_text}; the first non-finite loss, noticed {noticed}); {advice}"
    )


class _Writers:
    """Rank 0's outputs: metrics.jsonl and, optionally, TensorBoard."""

    def __init__(self, config: TrainConfig, output: Path, context: Distributed, history: list[dict]) -> None:
        self.active = context.is_main
        self.path = output / METRICS_FILE
        self.board = None
        if not self.active:
            return
        # Rewrite the records the checkpoint knows: a run killed after logging an epoch but before checkpointing
        # it must not keep the orphan record.
        with write_atomically(self.path, text=True) as file:
            file.write("".join(json.dumps(record) + "\n" for record in history))
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard=true needs the tensorboard package (pip install tensorboard)") from None
            self.board = SummaryWriter(str(output / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self.board.add_scalar(key, value, record["epoch"])
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def _say(context: Distributed, message: str) -> None:
    if context.is_main:
        print(message, flush=True)


def plural(count: int, noun: str) -> str:
    """``1 epoch``, ``30 epochs``: a count with its noun, singular for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def count_parameters(count: int) -> str:
    """``22.05 M parameters``; below a million in thousands, where ``0.00 M`` would say nothing."""
    return f"{count / 1e6:.2f} M parameters" if count >= 1e6 else f"{count / 1e3:.1f} k parameters"


def describe_model(model_name: str, model_kwargs: dict[str, Any], model: nn.Module) -> str:
    """What trains, in words: the timm name, the architecture keys the config overrides, and the patch geometry.

    ``deit_tiny_patch16_224 with embed_dim=64, depth=2, num_heads=4, patch 4 (4x4 grid), 16 px``: the timm name
    alone would promise the base model's width, depth and patch, which a preset (``digits``) replaces.
    """
    overridden = [f"{key}={model_kwargs[key]}" for key in ("embed_dim", "depth", "num_heads") if key in model_kwargs]
    geometry = []
    patch = patch_size_of(model)
    if patch is not None:
        grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        geometry.append(f"patch {patch}" + (f" ({grid[0]}x{grid[1]} grid)" if grid is not None else ""))
    geometry.append(f"{input_size(model)} px")
    details = ", ".join(overridden + geometry)
    return f"{model_name} with {details}" if overridden else f"{model_name}, {details}"


def _format_record(record: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {record['epoch']:>3}/{epochs}", f"loss {record['train_loss']:.4f}"]
    if record.get("dal_loss") is not None:
        parts.append(f"dal {record['dal_loss']:.3f}")
    parts.append(f"lr {record['lr']:.2e}")
    if record.get("top1") is not None:
        parts.append(f"top1 {record['top1']:.2f}")
    if record.get("consistency") is not None:
        parts.append(f"consistency {record['consistency']:.2f}")
    parts.append(f"{record['train_images_per_second']:.0f} img/s")
    parts.append(f"{record['epoch_seconds']:.1f} s")
    return "  ".join(parts)


def summary_table(history: list[dict[str, Any]], max_rows: int = 12) -> str:
    """The per-epoch records as a Markdown table (first and last epochs when there are many)."""
    columns = [
        ("epoch", "epoch", "{}"),
        ("train loss", "train_loss", "{:.4f}"),
        ("lr", "lr", "{:.2e}"),
        ("top-1", "top1", "{:.2f}"),
        ("top-5", "top5", "{:.2f}"),
        ("consistency", "consistency", "{:.2f}"),
        ("diff-norm", "diff_norm", "{:.3f}"),
        ("img/s", "train_images_per_second", "{:.0f}"),
    ]
    rows = history if len(history) <= max_rows else history[: max_rows // 2] + [None] + history[-max_rows // 2 :]
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for record in rows:
        if record is None:
            lines.append("| ... |" + " |" * (len(columns) - 1))
            continue
        cells = []
        for _, key, pattern in columns:
            value = record.get(key)
            cells.append("-" if value is None else pattern.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _resolve_config(
    config: TrainConfig, model: nn.Module, data_config: dict, num_classes: int, lr: float
) -> TrainConfig:
    return config.replace(
        num_classes=num_classes,
        img_size=input_size(model),
        lr=lr,
        mean=[float(value) for value in data_config["mean"]],
        std=[float(value) for value in data_config["std"]],
        crop_pct=float(data_config["crop_pct"]),
        mjp_seed=config.seed if config.mjp_seed is None else config.mjp_seed,
        mjp_from_epoch=config.warmup_epochs if config.mjp_from_epoch is None else config.mjp_from_epoch,
    )


def train(config: TrainConfig, *, resume: bool | str | Path = False) -> RunResult:
    """Trains one model as ``config`` says; returns its result. See the module docstring.

    Under ``torchrun`` it joins the process group already set up (by the caller, or by a comparison around it) and
    leaves it alive; only a group it created itself is destroyed when it returns (see :func:`distributed_session`).

    Args:
        resume: False (a new run: its output folder must not hold a run already), True (continue from
            ``<output>/last.pt``) or a checkpoint path.

    Raises:
        ConfigError: a bad config value or path. TrainingDiverged: a NaN or infinite loss.
    """
    config.validate()
    with distributed_session(config) as context:
        return _train(config, context, resume)


def _train(config: TrainConfig, context: Distributed, resume: bool | str | Path) -> RunResult:
    # Rank 0 decides where the run goes and whether that folder holds a run: the default folder is named by the
    # clock, and a rank that raised alone would leave the others waiting in a collective.
    chosen = config.output or default_output(config)
    output_name, holds_run = broadcast_from_main((chosen, (Path(chosen) / LAST_CHECKPOINT).exists()), context)
    output = Path(output_name)
    config = config.replace(output=str(output))
    last_path = output / LAST_CHECKPOINT
    state = None
    if resume:
        resume_path = last_path if resume is True else Path(resume)
        if resume is True and not holds_run:
            raise ConfigError(f"nothing to resume: {str(resume_path)!r} does not exist")
        state = checkpoint_io.load_checkpoint(resume_path)
    elif holds_run:
        raise ConfigError(
            f"output folder {str(output)!r} already holds a run ({LAST_CHECKPOINT}); pass --resume to continue it "
            "or choose another --output"
        )
    if state is not None and state.get("finished") and state.get("epoch", 0) >= config.epochs + config.cooldown_epochs:
        _say(context, f"{output}: this run finished already ({plural(config.epochs, 'epoch')}); nothing to do")
        history = list(state.get("metrics", []))
        return RunResult(output, last_path, config, history, state.get("final", {}))

    device = context.device
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    seed_everything(draw_seed(config.seed, context.rank))
    train_set, val_set, classes = build_datasets(config)
    num_classes = config.num_classes or len(classes)
    model_name, model_kwargs = model_spec(config, num_classes)
    model = create_model(model_name, model_kwargs)
    if config.mjp and not is_mjp_model(model):  # pragma: no cover - model_spec always names an MJP model
        raise ConfigError(f"model {model_name} is not an MJP model")
    data_config = resolve_data_config(
        {
            key: value
            for key, value in {"mean": config.mean, "std": config.std, "crop_pct": config.crop_pct}.items()
            if value is not None
        },
        model=model,
    )
    if len(data_config["mean"]) == 1:
        data_config["mean"], data_config["std"] = data_config["mean"] * 3, data_config["std"] * 3
    img_size = input_size(model)
    global_batch = config.batch_size * context.world_size * config.accum_steps
    lr = config.lr if config.lr is not None else config.lr_base * global_batch / 512
    config = _resolve_config(config, model, data_config, num_classes, lr)

    set_transform(train_set, train_transform(config, img_size, tuple(config.mean), tuple(config.std)))
    set_transform(val_set, eval_transform(img_size, config.interpolation, config.crop_pct))
    pin = device.type == "cuda"
    loader, sampler = train_loader(config, train_set, rank=context.rank, world_size=context.world_size, pin_memory=pin)
    workers = config.workers if config.workers is not None else default_workers(context.world_size)
    val_loader = eval_loader(
        val_set,
        config.eval_batch_size or 2 * config.batch_size,
        workers,
        rank=context.rank,
        world_size=context.world_size,
        pin_memory=pin,
    )

    model.to(device)
    bare = model
    optimizer_kwargs: dict[str, Any] = {"momentum": config.momentum}
    if config.opt_eps is not None:
        optimizer_kwargs["eps"] = config.opt_eps
    try:
        optimizer = create_optimizer_v2(
            bare, opt=config.opt, lr=lr, weight_decay=config.weight_decay, **optimizer_kwargs
        )
    except (ValueError, AssertionError, TypeError) as error:
        raise ConfigError(f"opt={config.opt!r}: {str(error).splitlines()[0]}") from None
    batches_per_epoch = len(loader)
    updates_per_epoch = math.ceil(batches_per_epoch / config.accum_steps)
    try:
        scheduler, total_epochs = create_scheduler_v2(
            optimizer,
            sched=config.sched,
            num_epochs=config.epochs,
            warmup_epochs=config.warmup_epochs,
            warmup_lr=config.warmup_lr,
            min_lr=config.min_lr,
            cooldown_epochs=config.cooldown_epochs,
            step_on_epochs=False,
            updates_per_epoch=updates_per_epoch,
        )
    except (ValueError, AssertionError) as error:
        raise ConfigError(f"sched={config.sched!r}: {str(error).splitlines()[0]}") from None
    total_steps = updates_per_epoch * total_epochs
    dtype = amp_dtype(config, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

    mixup = None
    if config.mixing:
        mixup = Mixup(
            mixup_alpha=config.mixup,
            cutmix_alpha=config.cutmix,
            prob=config.mixup_prob,
            switch_prob=config.mixup_switch_prob,
            mode=config.mixup_mode,
            label_smoothing=config.smoothing,
            num_classes=num_classes,
        )
        criterion: nn.Module = SoftTargetCrossEntropy()
    elif config.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=config.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    eval_criterion = nn.CrossEntropyLoss()

    start_epoch, start_batch, step = 0, 0, 0
    history: list[dict[str, Any]] = []
    running: dict[str, float] | None = None
    if state is not None:
        if state["model_name"] != model_name:
            raise ConfigError(f"the checkpoint holds {state['model_name']}, this config builds {model_name}")
        bare.load_state_dict(state["state_dict"])
        optimizer.load_state_dict(state["optimizer"])
        saved_config = state.get("config") or {}
        same_schedule = all(saved_config.get(key) == getattr(config, key) for key in SCHEDULE_KEYS)
        if scheduler is not None and state.get("scheduler") is not None and same_schedule:
            scheduler.load_state_dict(state["scheduler"])
        elif not same_schedule:
            _say(context, f"the schedule changed ({', '.join(SCHEDULE_KEYS)}): it continues as the new config says")
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        start_epoch, start_batch, step = state["epoch"], state.get("batch_in_epoch", 0), state["step"]
        history = list(state.get("metrics", []))
        running = state.get("running")
        if state.get("rng") is not None:
            checkpoint_io.restore_rng_states(state["rng"])
        if start_batch >= batches_per_epoch:
            start_epoch, start_batch, running = start_epoch + 1, 0, None
        _say(context, f"resuming {output} at epoch {start_epoch + 1}, batch {start_batch}, step {step}")

    forward_model: nn.Module = bare
    if config.compile:
        forward_model = torch.compile(forward_model)
    ddp = context.world_size > 1
    if ddp:
        forward_model = nn.parallel.DistributedDataParallel(
            forward_model, device_ids=[device.index] if device.type == "cuda" else None
        )

    if context.is_main:
        output.mkdir(parents=True, exist_ok=True)
        save_config(config, output / CONFIG_FILE)
    writers = _Writers(config, output, context, history)
    dal_on = config.mjp and config.mjp_dal != "none"
    unk = getattr(getattr(bare, "mjp", None), "unk_embed", None)
    best_top1 = max((record["top1"] for record in history if record.get("top1") is not None), default=-1.0)
    show_progress = _progress_enabled(config, context)
    if state is None:
        params = sum(parameter.numel() for parameter in bare.parameters())
        _say(
            context,
            f"mjp train: {describe_model(model_name, model_kwargs, bare)} ({count_parameters(params)}, "
            f"{num_classes} classes) on {len(train_set)} training / {len(val_set)} validation images; "
            f"{plural(total_epochs, 'epoch')} x {plural(updates_per_epoch, 'step')}, global batch {global_batch}, "
            f"lr {lr:.2e}, {device}{f' x {context.world_size}' if ddp else ''}; output {output}",
        )

    def save(
        epoch: int,
        batch_in_epoch: int,
        running_sums: dict[str, float] | None,
        finished: bool = False,
        best: bool = False,
    ) -> None:
        if not context.is_main:
            return
        payload = {
            "model_name": model_name,
            "model_kwargs": model_kwargs,
            "state_dict": bare.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "step": step,
            "finished": finished,
            "rng": checkpoint_io.rng_states(),
            "config": config.to_dict(),
            "metrics": history,
            "running": running_sums,
            "final": final,
            "mjp_fast_version": _version(),
        }
        checkpoint_io.save_atomically(payload, last_path)
        if best:
            checkpoint_io.save_atomically(payload, output / BEST_CHECKPOINT)

    final: dict[str, Any] = {}
    try:
        for epoch in range(start_epoch, total_epochs):
            if is_mjp_model(bare):
                bare.mjp.sampler.prob = config.mjp_prob if epoch >= config.mjp_from_epoch else 0.0
            first_batch = start_batch if epoch == start_epoch else 0
            sampler.set_epoch(epoch, start=first_batch * config.batch_size)
            # the running sums live on the device: reading them every step would sync the host with the GPU
            tally = _StepTally(device, running if epoch == start_epoch else None)
            running = None
            forward_model.train()
            started = time.perf_counter()
            epoch_images = 0
            bar = None
            if show_progress:
                from tqdm import tqdm

                bar = tqdm(
                    total=(batches_per_epoch - first_batch) * config.batch_size * context.world_size,
                    unit="img",
                    unit_scale=True,
                    desc=f"epoch {epoch + 1}/{total_epochs}",
                    leave=False,
                    dynamic_ncols=True,
                )
            for batch_index, (images, targets) in enumerate(loader, start=first_batch):
                seed_everything(draw_seed(config.seed, context.rank, epoch, batch_index, 1))
                images = images.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                if mixup is not None:
                    images, targets = mixup(images, targets)
                boundary = (batch_index + 1) % config.accum_steps == 0 or batch_index + 1 == batches_per_epoch
                weight = dal_weight_at(config, step, total_steps)
                sync = contextlib.nullcontext() if (boundary or not ddp) else forward_model.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                        logits = forward_model(images)
                        loss = criterion(logits, targets)
                        total = loss
                        dal = None
                        if dal_on:
                            dal = bare.mjp_aux_loss()
                            total = total + weight * dal
                        if ddp and unk is not None:
                            total = total + 0.0 * unk.sum()  # keeps unk_embed in the graph while the jigsaw is off
                    batch = images.shape[0]
                    # a non-finite total is only recorded here; it is raised at the next read (see _StepTally)
                    tally.add(total, loss, dal, batch, batch_index, step)
                    scaled = total / config.accum_steps
                    if scaler is not None:
                        scaler.scale(scaled).backward()
                    else:
                        scaled.backward()
                if boundary:
                    if scaler is not None:
                        if config.clip_grad is not None:
                            scaler.unscale_(optimizer)
                            dispatch_clip_grad(bare.parameters(), config.clip_grad, mode=config.clip_mode)
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        if config.clip_grad is not None:
                            dispatch_clip_grad(bare.parameters(), config.clip_grad, mode=config.clip_mode)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    if scheduler is not None:
                        scheduler.step_update(num_updates=step)
                epoch_images += batch * context.world_size
                if bar is not None:
                    bar.update(batch * context.world_size)
                if batch_index % config.log_interval == 0:  # with or without a bar: a diverged run stops soon
                    reading = tally.read(last_loss=loss)
                    _check_divergence(reading, epoch, f"at batch {batch_index}", dal_on, last_path, lr)
                    if bar is not None:
                        bar.set_postfix(loss=f"{reading.last_loss:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
                if boundary:
                    done = batch_index + 1
                    if config.checkpoint_steps and step % config.checkpoint_steps == 0 and done < batches_per_epoch:
                        # every rank reads (the flag goes round every rank): a checkpoint after a bad loss anywhere
                        # would hold the weights that loss's gradients broke
                        reading = tally.read(all_ranks=ddp)
                        _check_divergence(reading, epoch, f"at batch {batch_index}", dal_on, last_path, lr)
                        save(epoch, done, reading.sums)
            if bar is not None:
                bar.close()
            seconds = time.perf_counter() - started
            reading = tally.read(all_ranks=ddp)  # under DDP, the epoch's loss over every rank's samples
            _check_divergence(reading, epoch, f"at the end of epoch {epoch + 1}", dal_on, last_path, lr)
            sums = reading.all_sums if ddp else reading.sums
            if scheduler is not None:
                scheduler.step(epoch + 1)
            samples = max(sums["samples"], 1.0)
            record: dict[str, Any] = {
                "epoch": epoch + 1,
                "step": step,
                "train_loss": sums["loss"] / samples,
                "dal_loss": sums["dal"] / samples if dal_on else None,
                "dal_weight": dal_weight_at(config, step, total_steps) if dal_on else None,
                "lr": optimizer.param_groups[0]["lr"],
                "mjp_prob": bare.mjp.sampler.prob if is_mjp_model(bare) else 0.0,
                "train_images_per_second": epoch_images / max(seconds, 1e-9),
                "epoch_seconds": seconds,
            }
            last_epoch = epoch + 1 == total_epochs
            if (epoch + 1) % config.eval_interval == 0 or last_epoch:
                results = evaluate_model(
                    bare,
                    val_loader,
                    device=device,
                    mean=torch.tensor(config.mean),
                    std=torch.tensor(config.std),
                    ratio=config.eval_ratio,
                    seed=config.eval_seed,
                    amp_dtype=dtype,
                    criterion=eval_criterion,
                )
                record.update(
                    top1=results["top1"],
                    top5=results["top5"],
                    val_loss=results["loss"],
                    consistency=results["consistency"],
                    diff_norm=results["diff_norm"],
                )
            if last_epoch:
                regression = model_position_regression(bare)
                record["pos_mae_1d"] = regression["mae_1d"] if regression else None
                record["pos_mae_2d"] = regression["mae_2d"] if regression else None
                final = {key: record.get(key) for key in FINAL_KEYS}
            history.append(record)
            writers.write(record)
            _say(context, _format_record(record, total_epochs))
            improved = record.get("top1") is not None and record["top1"] > best_top1
            if improved:
                best_top1 = record["top1"]
            save(epoch + 1, 0, None, finished=last_epoch, best=improved)
    finally:
        writers.close()
    if context.is_main:
        print(f"\n{summary_table(history)}\n\ncheckpoint: {last_path}", flush=True)
    return RunResult(output, last_path, config, history, final)


def _version() -> str:
    from mjp_fast import __version__

    return __version__
