"""The training loop of ``mjp train``: timm's optimizer, schedule, Mixup and losses, with MJP and DAL.

One process per GPU under ``torchrun`` (DDP), or one process on a CPU or GPU:

    torchrun --nproc_per_node=8 -m mjp_fast.cli train --config deit_s.yaml --data /data/imagenet

Per step: mixup/cutmix on the batch, then the model's forward (which jigsaws the batch: MJP comes after mixup, as
in the paper's code, and attaches the DAL loss to its tokens at the model's ``mjp_dal_weight``, set to
``dal_weight(step)``), the classification loss, backward (which trains DAL too), gradient clipping and the
optimizer step (all four in :class:`TrainStep`), then the schedule. The jigsaw starts at ``mjp_from_epoch``
(default: the end of warm-up); the DAL weight decays from ``dal_weight`` to ``dal_weight_end`` along a cosine over
the whole run.

Reproducibility and resumption: each epoch seeds the global generators from ``(seed, rank, epoch)`` (mixup,
drop-path), a checkpoint within an epoch saves their states, and each sample seeds its transform (see
:mod:`mjp_fast.train.data`); the jigsaw stream is the model's ``mjp.sampler`` counter, a buffer in the checkpoint.
A run resumed from any checkpoint, at an epoch boundary or within an epoch (``checkpoint_steps``), continues
exactly as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shlex
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
from timm.scheduler.scheduler import Scheduler
from timm.utils import dispatch_clip_grad
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mjp_fast._atomic import write_atomically
from mjp_fast.evaluate.metrics import evaluate_model
from mjp_fast.evaluate.position import model_position_regression
from mjp_fast.timm.schedule import dal_weight_cosine
from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import ConfigError, TrainConfig, save_config
from mjp_fast.train.data import (
    DeviceNormalize,
    SeededEpochSampler,
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


@dataclass(frozen=True)
class SavedPosition:
    """Where a run's ``last.pt`` takes it up again: the checkpoint's ``epoch`` (0-based, the epoch to train),
    ``batch`` (``batch_in_epoch``: that epoch's batches already trained), ``step`` and ``finished``."""

    epoch: int
    batch: int
    step: int
    finished: bool = False

    def describe(self) -> str:
        """In words, for the user: ``resumes at epoch 3, batch 120``."""
        if self.finished:
            return "the finished run"
        if self.batch == 0:
            return f"resumes at the start of epoch {self.epoch + 1}"
        return f"resumes at epoch {self.epoch + 1}, batch {self.batch}"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a run after its output folder was chosen: a :class:`KeyboardInterrupt` that says
    what was kept and how to go on.

    ``str(error)`` is the message for the user (``mjp train`` prints it); ``output`` is the run's folder (a
    comparison's, for ``compare=true``) and ``saved`` where the interrupted run's ``last.pt`` resumes (None: it has
    none yet).
    """

    def __init__(self, message: str, output: Path, saved: SavedPosition | None) -> None:
        super().__init__(message)
        self.output = output
        self.saved = saved


def resume_command(output: Path) -> str:
    """The command that continues the run (or comparison) in ``output``, quoted for a POSIX shell."""
    return f"mjp train --output {shlex.quote(str(output))} --resume"


def interrupted_message(output: Path, saved: SavedPosition | None, where: str) -> str:
    """What an interrupted run kept and how to go on, in one line (``where``: ``in epoch 3/30``, say).

    With a checkpoint: where it resumes and the command that resumes it. Without one, ``--resume`` would fail
    (there is nothing to resume): it says so, that running the command again starts over, and how to checkpoint
    within an epoch.
    """
    if saved is not None:
        return (
            f"interrupted {where}; {output / LAST_CHECKPOINT} is kept ({saved.describe()}): continue with "
            f"{resume_command(output)}"
        )
    return (
        f"interrupted {where}, before the run's first checkpoint: nothing to resume in {output}; running the same "
        "command again starts the run over. Checkpoints are written at the end of each epoch, and with "
        "checkpoint_steps=N also every N optimizer steps within one"
    )


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
    """The DAL weight after ``step`` of ``total_steps`` optimizer steps: cosine from dal_weight to dal_weight_end (the
    cosine of :class:`mjp_fast.timm.DALWeightSchedule`)."""
    return dal_weight_cosine(config.dal_weight, config.dal_weight_end, step, total_steps)


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
    diverged: bool  # a loss on this rank was NaN or infinite
    first_bad: tuple[float, float, float, int, int]  # the first such batch: total, classification, DAL, batch, step
    all_sums: dict[str, float] | None = None  # every rank's sums together (read with all_ranks=True)
    diverged_anywhere: bool = False  # on any rank (read with all_ranks=True; else this rank)
    last_loss: float | None = None


class _StepTally:
    """The epoch's running loss sums and the divergence watch, at no kernel launch per step.

    Reading a device tensor back (``float``, ``.item()``, ``bool``, ``.tolist()``) makes the host wait until the
    GPU has run everything queued, which stalls the launch queue; so the loop reads the tally back only at log
    intervals, before a checkpoint and at the epoch's end (as timm's train script reads its losses only at log
    intervals). Between reads, :meth:`add` only keeps each batch's 0-d losses (a detached reference: no kernel)
    and its host numbers; every :attr:`FOLD_EVERY` batches, at a change of batch size and at a read, the kept losses
    are folded into the device sums with a few launches for all of them, so the per-step cost is a fraction of a
    launch and the memory held is bounded. A NaN or infinite classification or DAL loss (so a non-finite total) is
    recorded on the device with its place, and raised as :class:`TrainingDiverged` at the next read: the loop reads
    before every checkpoint, so no checkpoint is written after the loss went bad.
    """

    FOLD_EVERY = 32
    # device values: loss sum, DAL sum (each batch's mean weighted by its size), a flag set by the first non-finite
    # loss, that batch's classification and DAL losses and its ordinal in the tally (see _places)
    _SIZE = 6

    def __init__(self, device: torch.device, running: dict[str, float] | None = None) -> None:
        # float64 keeps the sums what Python floats would be; MPS has no float64
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        start = [running["loss"], running["dal"]] if running else [0.0, 0.0]
        self.values = torch.tensor(start + [0.0] * (self._SIZE - 2), dtype=self.dtype, device=device)
        self.samples = int(running["samples"]) if running else 0  # a host number: batch sizes are
        self._pending: list[torch.Tensor] = []  # the kept batches' losses, classification then DAL (if on)
        self._pending_batch = 0  # the batch size of every kept batch
        self._pending_first = 0  # the ordinal of the first kept batch
        self._has_dal = False
        self._places: list[tuple[int, int, float]] = []  # per batch added: its index in the epoch, step, DAL weight

    def add(
        self, loss: torch.Tensor, dal: torch.Tensor | None, batch: int, batch_index: int, step: int, dal_weight: float
    ) -> None:
        """Adds one batch (``loss``, ``dal``: 0-d means over ``batch`` samples; the total it trained was ``loss +
        dal_weight * dal``): no device work, except a fold every :attr:`FOLD_EVERY` batches."""
        kept = len(self._places) - self._pending_first
        if self._pending and (batch != self._pending_batch or kept >= self.FOLD_EVERY):
            self._fold()
        if not self._pending:
            self._pending_batch, self._pending_first, self._has_dal = batch, len(self._places), dal is not None
        self._pending.append(loss.detach())
        if self._has_dal:
            self._pending.append(dal.detach())
        self._places.append((batch_index, step, dal_weight if dal is not None else 0.0))
        self.samples += batch

    def _fold(self) -> None:
        """Adds the kept batches to the device sums and records the first non-finite one (about ten launches)."""
        if not self._pending:
            return
        columns = 2 if self._has_dal else 1
        rows = torch.stack(self._pending).to(self.dtype).view(-1, columns)  # [kept, classification (, DAL)]
        self._pending = []
        values = self.values
        # multiply, then add: each batch's mean weighted by its size, as the Python floats the sums once were
        values[0:columns].add_(rows.mul(self._pending_batch).sum(0))
        bad = rows.isfinite().logical_not_().any(1)  # [kept]
        first = torch.argmax(bad.to(torch.uint8)).view(1)  # the first bad kept batch (0 when none); index_select,
        # not rows[first]: indexing with a 0-d tensor may read it back
        new = bad.index_select(0, first).logical_and_(values[2] == 0)  # the tally's first bad batch is in this fold
        ordinal = (first + self._pending_first).to(self.dtype)
        bad_row = torch.cat([rows.index_select(0, first).view(-1), rows.new_zeros(2 - columns), ordinal])
        values[3:6].copy_(torch.where(new, bad_row, values[3:6]))
        values[2:3].masked_fill_(new, 1.0)

    def read(self, *, all_ranks: bool = False, last_loss: torch.Tensor | None = None) -> _TallyReading:
        """Everything in one host read; ``all_ranks`` adds the sums and flag of every rank (a collective)."""
        self._fold()
        parts = [self.values]
        if all_ranks:
            reduced = torch.cat([self.values[:3], self.values.new_tensor([float(self.samples)])])
            dist.all_reduce(reduced)
            parts.append(reduced)
        if last_loss is not None:
            parts.append(last_loss.detach().to(self.dtype).reshape(1))
        numbers = torch.cat(parts).tolist()  # the one host-device synchronization
        sums = {"loss": numbers[0], "dal": numbers[1], "samples": float(self.samples)}
        loss, dal, ordinal = numbers[3], numbers[4], int(numbers[5])
        batch_index, step, weight = self._places[ordinal] if numbers[2] > 0 else (0, 0, 0.0)
        reading = _TallyReading(
            sums=sums,
            diverged=numbers[2] > 0,
            first_bad=(loss + weight * dal, loss, dal, batch_index, step),
            diverged_anywhere=numbers[2] > 0,
        )
        if all_ranks:
            reduced_numbers = numbers[self._SIZE : self._SIZE + 4]
            reading.all_sums = {"loss": reduced_numbers[0], "dal": reduced_numbers[1], "samples": reduced_numbers[3]}
            reading.diverged_anywhere = reduced_numbers[2] > 0
        if last_loss is not None:
            reading.last_loss = numbers[-1]
        return reading


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


@contextlib.contextmanager
def _syncs_allowed() -> Iterator[None]:
    """Lifts ``sync_debug``'s error mode (``torch.cuda.set_sync_debug_mode``) for a host read the step needs."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


@dataclass
class StepLosses:
    """One micro-batch's losses: 0-d float tensors on the training device, not read back (see :class:`_StepTally`)."""

    loss: torch.Tensor  # the classification loss
    dal: torch.Tensor | None  # the unweighted DAL loss (detached where it was attached to the tokens); None without DAL
    dal_weight: float = 0.0  # the DAL loss's weight in the total

    @property
    def total(self) -> torch.Tensor:
        """``loss + dal_weight * dal``: what the backward trained (before the division by ``accum_steps``). Computed
        on access (two launches), not by the step: the step's own backward never needs it where DAL is attached."""
        return self.loss if self.dal is None else self.loss + self.dal_weight * self.dal


@dataclass
class TrainStep:
    """One micro-batch of training: forward, loss plus the weighted DAL loss, backward, and, when the micro-batch
    ends an accumulation, gradient clipping and the optimizer's (and fp16 scaler's) step.

    Built once per run, called once per batch; the loop around it keeps the step count, the schedule and the
    checkpoints. ``forward_model`` runs the forward (the model itself, or it compiled and/or DDP-wrapped);
    ``model`` is the bare model, whose parameters are clipped, whose ``mjp_dal_weight`` is set and whose DAL loss is
    read.

    The DAL loss trains attached to the model's output (the model's forward attaches it at ``mjp_dal_weight``, set
    here to ``dal_weight / accum_steps`` where it changes: the backward runs on the classification loss divided by
    ``accum_steps``), so the backward is of the classification loss alone and the DAL loss is only read for the
    records. With the fp16 scaler, whose loss scale is a device tensor that changes during the run, the loss
    ``loss + dal_weight * model.mjp_aux_loss()`` is scaled and back-propagated instead: that explicit loss's weight
    replaces the attached one, so the scaled backward scales DAL too. Either way the gradients are those of
    ``(loss + dal_weight * dal) / accum_steps``.
    """

    model: nn.Module
    forward_model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    config: TrainConfig  # accum_steps, clip_grad, clip_mode, and whether DAL is on (mjp, mjp_dal)
    amp_dtype: torch.dtype | None = None  # autocast's dtype; None: no autocast
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler; None: plain backward and step
    ddp: bool = False  # forward_model is DDP-wrapped: gradients are all-reduced at updates only
    _attached_weight: float | None = field(default=None, init=False, repr=False)  # the model's mjp_dal_weight, as set

    @property
    def dal_on(self) -> bool:
        """Whether the DAL loss joins the total, as the config says: mjp on and mjp_dal not none."""
        return self.config.mjp and self.config.mjp_dal != "none"

    def __call__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        *,
        dal_weight: float,
        update: bool,
        tally: _StepTally,
        batch_index: int,
        step: int,
    ) -> StepLosses:
        """Trains on one micro-batch; device work only (no read back to the host).

        Args:
            images: float ``[B, C, H, W]`` on the training device (after mixup, if any).
            targets: int64 ``[B]`` class indices, or float ``[B, num_classes]`` soft targets (mixup).
            dal_weight: the DAL loss's weight in the total (unused without DAL); the model's ``mjp_dal_weight``
                follows it (divided by ``accum_steps``).
            update: this micro-batch ends an accumulation: clip the gradients, step the optimizer, zero the
                gradients. Else the gradients only accumulate (and DDP does not all-reduce them).
            tally: the epoch's running sums; this batch is added to them, a non-finite loss recorded.
            batch_index: the batch's index in its epoch, and ``step`` the optimizer steps taken before it: where a
                non-finite loss happened, for the tally.

        Returns:
            The batch's losses (``total`` before the division by ``accum_steps``).
        """
        if self.dal_on:
            self._set_attached_weight(dal_weight / self.config.accum_steps)
        sync = contextlib.nullcontext() if (update or not self.ddp) else self.forward_model.no_sync()
        with sync:
            dtype = self.amp_dtype
            # images are on the training device: their device type is autocast's
            with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
                logits = self.forward_model(images)
                loss = self.criterion(logits, targets)
                objective = loss  # what the backward runs on
                dal = None
                if self.dal_on:
                    # attached to the logits' graph by the forward (read without a graph), unless the scaler needs it
                    # explicit, or the forward attached none
                    dal = self.model.mjp.last_dal_loss if self.scaler is None else None
                    if dal is None:
                        dal = self.model.mjp_aux_loss()
                        objective = loss + dal_weight * dal
            # a non-finite loss is only recorded here; it is raised at the next read (see _StepTally)
            tally.add(loss, dal, images.shape[0], batch_index, step, dal_weight)
            accum_steps = self.config.accum_steps
            scaled = objective / accum_steps if accum_steps > 1 else objective  # no launch for a division by 1
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if update:
            self._update()
        return StepLosses(loss, dal, dal_weight if dal is not None else 0.0)

    def _set_attached_weight(self, weight: float) -> None:
        """Sets the model's ``mjp_dal_weight`` (the weight at which its forward attaches the DAL loss), where it
        changed since the last step: a write to a device buffer, not a read."""
        if weight != self._attached_weight:
            self.model.mjp_dal_weight = weight
            self._attached_weight = weight

    def _update(self) -> None:
        """Clips the accumulated gradients, steps the optimizer (through the scaler), zeros the gradients."""
        config, optimizer, scaler = self.config, self.optimizer, self.scaler
        if config.clip_grad is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            dispatch_clip_grad(self.model.parameters(), config.clip_grad, mode=config.clip_mode)
        if scaler is not None:
            with _syncs_allowed():  # the scaler reads its inf check back to decide: fp16's one sync per step
                scaler.step(optimizer)  # skips the step when the unscaled gradients hold an inf or NaN
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class _Writers:
    """Rank 0's outputs: metrics.jsonl, curves.png (:mod:`mjp_fast.train.curves`) and, optionally, TensorBoard.

    ``history`` is the run's list of records, which the loop appends to: curves.png is drawn from it.
    """

    def __init__(self, config: TrainConfig, output: Path, context: Distributed, history: list[dict]) -> None:
        self.active = context.is_main
        self.output = output
        self.path = output / METRICS_FILE
        self.history = history
        self.board = None
        self._curves_drawn_at = time.perf_counter()  # the run's start: a first refresh comes REFRESH_SECONDS in
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

    def draw_curves(self, *, final: bool) -> None:
        """Draws curves.png from the records so far: at the run's end (``final``), else only when
        :data:`~mjp_fast.train.curves.REFRESH_SECONDS` have passed since the last drawing (a drawing costs about a
        second, every rank waiting)."""
        from mjp_fast.train.curves import CURVES_FILE, REFRESH_SECONDS, write_curves

        if not self.active or not self.history:
            return
        if not final and time.perf_counter() - self._curves_drawn_at < REFRESH_SECONDS:
            return
        name = self.output.resolve().name or "run"
        write_curves({name: self.history}, self.output / CURVES_FILE, title=str(self.output))
        self._curves_drawn_at = time.perf_counter()

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
    if record.get("eval_seconds") is not None:
        parts.append(f"eval {record['eval_seconds']:.1f} s")
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
    from mjp_fast.train.preflight import check_run  # here: preflight imports this module

    # the values and the model, fitted as the CLI fits them (the CLI has checked the folders and device already;
    # _open_output checks the output folder of a library call)
    config = check_run(config, resume=resume, environment=False)
    with distributed_session(config) as context:
        return _train(config, context, resume)


def _train(config: TrainConfig, context: Distributed, resume: bool | str | Path) -> RunResult:
    """Opens the run's output folder, builds the run and trains the epochs it has left (a finished run: none)."""
    config, output, state = _open_output(config, context, resume)
    if state is not None and state.get("finished") and state.get("epoch", 0) >= config.epochs + config.cooldown_epochs:
        _say(context, f"{output}: this run finished already ({plural(config.epochs, 'epoch')}); nothing to do")
        history = list(state.get("metrics", []))
        return RunResult(output, output / LAST_CHECKPOINT, config, history, state.get("final", {}))
    run = None
    try:
        run = _build_run(config, context, output, state)
        return run.fit()
    except KeyboardInterrupt as interrupt:
        # Ctrl-C: name the real folder and say whether it holds a checkpoint (none before the first one is written,
        # and then --resume has nothing to resume)
        if run is not None:
            saved, where = run.saved, f"in epoch {run.epoch + 1}/{run.total_epochs}"
        else:
            saved, where = _saved_position(state), "while the run was being set up"
        raise TrainingInterrupted(interrupted_message(output, saved, where), output, saved) from interrupt


def _saved_position(state: dict[str, Any] | None) -> SavedPosition | None:
    """Where the checkpoint ``state`` (None: none) resumes."""
    if state is None:
        return None
    return SavedPosition(state["epoch"], state.get("batch_in_epoch", 0), state["step"], bool(state.get("finished")))


def _open_output(
    config: TrainConfig, context: Distributed, resume: bool | str | Path
) -> tuple[TrainConfig, Path, dict[str, Any] | None]:
    """Where the run goes, and the checkpoint it continues from.

    Returns:
        The config with its output folder filled in, that folder, and the loaded checkpoint (None: a new run).

    Raises:
        ConfigError: ``resume=True`` with no checkpoint in the folder, or a new run into a folder that holds one.
    """
    # Rank 0 decides where the run goes and whether that folder holds a run: the default folder is named by the
    # clock, and a rank that raised alone would leave the others waiting in a collective.
    chosen = config.output or default_output(config)
    output_name, holds_run = broadcast_from_main((chosen, (Path(chosen) / LAST_CHECKPOINT).exists()), context)
    output = Path(output_name)
    config = config.replace(output=str(output))
    state = None
    if resume:
        resume_path = output / LAST_CHECKPOINT if resume is True else Path(resume)
        if resume is True and not holds_run:
            raise ConfigError(f"nothing to resume: {str(resume_path)!r} does not exist")
        state = checkpoint_io.load_checkpoint(resume_path)
    elif holds_run:
        raise ConfigError(
            f"output folder {str(output)!r} already holds a run ({LAST_CHECKPOINT}); pass --resume to continue it "
            "or choose another --output"
        )
    return config, output, state


def _build_run(config: TrainConfig, context: Distributed, output: Path, state: dict[str, Any] | None) -> _Run:
    """Builds the datasets, model, optimizer, schedule and losses of a run, and restores ``state`` (a checkpoint;
    None: a new run) into them.

    The order is the random streams': the generators are seeded before the datasets and the model (whose
    initialization draws from them); a run resumed within an epoch gets its checkpoint's generator states back when
    its training batches start (:meth:`_Run._set_generators`), after everything that draws.
    """
    device = context.device
    if config.sync_debug and device.type != "cuda":
        raise ConfigError(f"sync_debug=true needs a CUDA device (it is torch.cuda.set_sync_debug_mode), got {device}")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    seed_everything(draw_seed(config.seed, context.rank))
    train_set, val_set, classes = build_datasets(config)
    num_classes = config.num_classes or len(classes)
    model_name, model_kwargs = model_spec(config, num_classes)
    model = create_model(model_name, model_kwargs)
    if config.mjp and not is_mjp_model(model):  # pragma: no cover - model_spec always names an MJP model
        raise ConfigError(f"model {model_name} is not an MJP model")
    data_config = _data_config(config, model)
    global_batch = config.batch_size * context.world_size * config.accum_steps
    lr = config.lr if config.lr is not None else config.lr_base * global_batch / 512
    config = _resolve_config(config, model, data_config, num_classes, lr)
    on_device = normalizes_on_device(config, device)  # the loader's transform and the step's normalization agree
    loader, sampler, val_loader = _build_loaders(config, context, train_set, val_set, input_size(model), on_device)

    model.to(device)
    optimizer = _build_optimizer(config, model)
    batches_per_epoch = len(loader)
    updates_per_epoch = math.ceil(batches_per_epoch / config.accum_steps)
    scheduler, total_epochs = _build_scheduler(config, optimizer, updates_per_epoch)
    dtype = amp_dtype(config, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    mixup, criterion = _build_mixup_and_criterion(config, num_classes)
    start = _restore(state, model_name, model, optimizer, scheduler, scaler, config, batches_per_epoch, context, output)

    ddp = context.world_size > 1
    forward_model = _wrap_for_training(model, config, context)
    header = None
    if state is None:  # a resumed run says where it resumes instead (see _restore)
        parameters = count_parameters(sum(parameter.numel() for parameter in model.parameters()))
        header = (
            f"mjp train: {describe_model(model_name, model_kwargs, model)} ({parameters}, "
            f"{num_classes} classes) on {len(train_set)} training / {len(val_set)} validation images; "
            f"{plural(total_epochs, 'epoch')} x {plural(updates_per_epoch, 'step')}, global batch {global_batch}, "
            f"lr {lr:.2e}, {device}{f' x {context.world_size}' if ddp else ''}; output {output}"
        )
    return _Run(
        config=config,
        context=context,
        output=output,
        model_name=model_name,
        model_kwargs=model_kwargs,
        model=model,
        train_step=TrainStep(model, forward_model, optimizer, criterion, config, dtype, scaler, ddp),
        scheduler=scheduler,
        mixup=mixup,
        normalize=DeviceNormalize(config.mean, config.std, config, device) if on_device else None,
        loader=loader,
        sampler=sampler,
        val_loader=val_loader,
        batches_per_epoch=batches_per_epoch,
        total_epochs=total_epochs,
        total_steps=updates_per_epoch * total_epochs,
        start=start,
        header=header,
        show_progress=_progress_enabled(config, context),
    )


def _data_config(config: TrainConfig, model: nn.Module) -> dict[str, Any]:
    """timm's data config of ``model`` (mean, std, crop_pct, ...), with the values the config sets; a one-channel
    mean and std are repeated for three channels (the images are RGB)."""
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
    return data_config


def _build_loaders(
    config: TrainConfig, context: Distributed, train_set: Dataset, val_set: Dataset, img_size: int, on_device: bool
) -> tuple[DataLoader, SeededEpochSampler, DataLoader]:
    """Sets the datasets' transforms (``on_device``: the training one gives uint8, see :func:`normalizes_on_device`);
    returns the training loader, its sampler and the validation loader (this rank's shards)."""
    mean, std = tuple(config.mean), tuple(config.std)
    set_transform(train_set, train_transform(config, img_size, mean, std, on_device=on_device))
    set_transform(val_set, eval_transform(img_size, config.interpolation, config.crop_pct))
    pin = context.device.type == "cuda"
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
    return loader, sampler, val_loader


def normalizes_on_device(config: TrainConfig, device: torch.device) -> bool:
    """Whether the training loader gives uint8 images that the step normalizes on ``device`` (config
    ``normalize_on_device``; auto: on CUDA, where the loader's bytes cross to the GPU and its host is often slow)."""
    return config.normalize_on_device == "on" or (config.normalize_on_device == "auto" and device.type == "cuda")


def _build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """timm's optimizer ``config.opt`` over ``model`` at the peak ``config.lr``. Raises ConfigError for a bad name
    or setting."""
    optimizer_kwargs: dict[str, Any] = {"momentum": config.momentum}
    if config.opt_eps is not None:
        optimizer_kwargs["eps"] = config.opt_eps
    try:
        return create_optimizer_v2(
            model, opt=config.opt, lr=config.lr, weight_decay=config.weight_decay, **optimizer_kwargs
        )
    except (ValueError, AssertionError, TypeError) as error:
        raise ConfigError(f"opt={config.opt!r}: {str(error).splitlines()[0]}") from None


def _build_scheduler(
    config: TrainConfig, optimizer: torch.optim.Optimizer, updates_per_epoch: int
) -> tuple[Scheduler | None, int]:
    """timm's schedule ``config.sched``, stepped per optimizer step, and the run's epochs (cooldown included).
    ``sched=none``: no schedule. Raises ConfigError for a bad name or setting."""
    try:
        return create_scheduler_v2(
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


def _build_mixup_and_criterion(config: TrainConfig, num_classes: int) -> tuple[Mixup | None, nn.Module]:
    """Mixup/CutMix (None when off) and the classification loss that fits its targets: soft-target cross-entropy
    after mixing (which smooths the labels itself), else label smoothing or plain cross-entropy."""
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
        return mixup, SoftTargetCrossEntropy()
    if config.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(smoothing=config.smoothing)
    return None, nn.CrossEntropyLoss()


def _wrap_for_training(model: nn.Module, config: TrainConfig, context: Distributed) -> nn.Module:
    """What runs the training forward: ``model`` compiled (``compile=true``) and DDP-wrapped (several ranks)."""
    forward_model = model
    if config.compile:
        forward_model = torch.compile(forward_model)
    if context.world_size > 1:
        device = context.device
        forward_model = nn.parallel.DistributedDataParallel(
            forward_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return forward_model


@dataclass
class _Start:
    """Where training starts: a new run at the beginning, a resumed one where its checkpoint left off."""

    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already trained
    step: int = 0  # optimizer steps taken
    history: list[dict[str, Any]] = field(default_factory=list)  # the records of the epochs trained
    running: dict[str, float] | None = None  # the loss sums of ``epoch``'s trained batches (None: none yet)
    rng: dict[str, Any] | None = None  # the global generators' states after batch ``batch`` (checkpoint.rng_states)
    resumed: bool = False  # from a checkpoint (which is then the run's last.pt until the next save)


def _restore(
    state: dict[str, Any] | None,
    model_name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    scaler: torch.amp.GradScaler | None,
    config: TrainConfig,
    batches_per_epoch: int,
    context: Distributed,
    output: Path,
) -> _Start:
    """Loads a checkpoint (``state``; None: a new run) into the model, optimizer, schedule and scaler; returns where
    training resumes, with the global generators' states that :meth:`_Run._train_batches` restores mid-epoch.

    A checkpoint of a schedule other than the config's keeps its weights and optimizer state, and the schedule
    continues as the config says; one written after its epoch's last batch resumes at the next epoch's start.
    Raises ConfigError for a checkpoint of another model.
    """
    if state is None:
        return _Start()
    if state["model_name"] != model_name:
        raise ConfigError(f"the checkpoint holds {state['model_name']}, this config builds {model_name}")
    model.load_state_dict(state["state_dict"])
    optimizer.load_state_dict(state["optimizer"])
    saved_config = state.get("config") or {}
    same_schedule = all(saved_config.get(key) == getattr(config, key) for key in SCHEDULE_KEYS)
    if scheduler is not None and state.get("scheduler") is not None and same_schedule:
        scheduler.load_state_dict(state["scheduler"])
    elif not same_schedule:
        _say(context, f"the schedule changed ({', '.join(SCHEDULE_KEYS)}): it continues as the new config says")
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    start = _Start(
        epoch=state["epoch"],
        batch=state.get("batch_in_epoch", 0),
        step=state["step"],
        history=list(state.get("metrics", [])),
        running=state.get("running"),
        rng=state.get("rng"),
        resumed=True,
    )
    if start.batch >= batches_per_epoch:  # saved after its epoch's last batch
        start = _Start(epoch=start.epoch + 1, step=start.step, history=start.history, resumed=True)
    _say(context, f"resuming {output} at epoch {start.epoch + 1}, batch {start.batch}, step {start.step}")
    return start


@dataclass
class _Run:
    """A built run and its progress: :meth:`fit` trains the epochs it has left.

    Per epoch: the training batches (:meth:`_train_batches`, each a :class:`TrainStep`), the epoch's record
    (:meth:`_end_epoch`), the evaluation (:meth:`_evaluate`), then a checkpoint (:meth:`_save`); checkpoints also
    every ``checkpoint_steps`` optimizer steps within an epoch.
    """

    config: TrainConfig  # resolved: lr, classes, input size, normalization and the jigsaw's start filled in
    context: Distributed
    output: Path
    model_name: str
    model_kwargs: dict[str, Any]
    model: nn.Module  # the bare model (neither compiled nor DDP-wrapped): what checkpoints and evaluation see
    train_step: TrainStep  # also holds the optimizer, the scaler and the AMP dtype
    scheduler: Scheduler | None
    mixup: Mixup | None
    normalize: DeviceNormalize | None  # the uint8 batches' normalization and random erasing on the device, if there
    loader: DataLoader
    sampler: SeededEpochSampler
    val_loader: DataLoader
    batches_per_epoch: int
    total_epochs: int  # the schedule's, cooldown included
    total_steps: int  # optimizer steps of the whole run
    start: _Start
    header: str | None  # the first line a new run prints; None for a resumed run
    show_progress: bool
    step: int = field(init=False)  # optimizer steps taken
    epoch: int = field(init=False)  # the epoch being trained (0-based)
    saved: SavedPosition | None = field(init=False)  # where the run's last.pt resumes (None: there is none yet)
    history: list[dict[str, Any]] = field(init=False)  # a record per epoch trained
    final: dict[str, Any] = field(init=False, default_factory=dict)  # the last epoch's results (FINAL_KEYS)
    _warm: bool = field(init=False, default=False)  # a batch has been trained (compiled, autotuned)

    def __post_init__(self) -> None:
        self.step = self.start.step
        self.epoch = self.start.epoch
        self.history = self.start.history
        start = self.start  # a resumed run's checkpoint is its last.pt until the first save
        self.saved = SavedPosition(start.epoch, start.batch, start.step) if start.resumed else None

    @property
    def last_path(self) -> Path:
        return self.output / LAST_CHECKPOINT

    def fit(self) -> RunResult:
        """Trains the epochs left, writing each epoch's record and checkpoint, and at the end the summary table."""
        context = self.context
        if context.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.output / CONFIG_FILE)
        writers = _Writers(self.config, self.output, context, self.history)
        best_top1 = max((record["top1"] for record in self.history if record.get("top1") is not None), default=-1.0)
        if self.header is not None:
            _say(context, self.header)
        try:
            for epoch in range(self.start.epoch, self.total_epochs):
                self.epoch = epoch
                record = self._train_epoch(epoch)
                last_epoch = epoch + 1 == self.total_epochs
                self._evaluate(epoch, record, last_epoch)
                self.history.append(record)
                writers.write(record)
                _say(context, _format_record(record, self.total_epochs))
                improved = record.get("top1") is not None and record["top1"] > best_top1
                if improved:
                    best_top1 = record["top1"]
                self._save(epoch + 1, 0, None, finished=last_epoch, best=improved)
                writers.draw_curves(final=last_epoch)  # after the checkpoint: a drawing never holds it up
        finally:
            writers.close()
        if context.is_main:
            print(f"\n{summary_table(self.history)}\n\ncheckpoint: {self.last_path}", flush=True)
        return RunResult(self.output, self.last_path, self.config, self.history, self.final)

    def _train_epoch(self, epoch: int) -> dict[str, Any]:
        """Trains one epoch (a resumed run's first from its checkpoint's batch); returns the epoch's record, before
        evaluation."""
        config, model = self.config, self.model
        if is_mjp_model(model):
            model.mjp.sampler.prob = config.mjp_prob if epoch >= config.mjp_from_epoch else 0.0
        first_epoch = epoch == self.start.epoch  # of this process: a resumed run's goes on from its checkpoint
        first_batch = self.start.batch if first_epoch else 0
        self.sampler.set_epoch(epoch, start=first_batch * config.batch_size)
        # the running sums live on the device: reading them every step would sync the host with the GPU
        tally = _StepTally(self.context.device, self.start.running if first_epoch else None)
        self.train_step.forward_model.train()
        started = time.perf_counter()
        bar = self._progress_bar(epoch, first_batch)
        try:
            images = self._train_batches(epoch, first_batch, tally, bar)
        finally:
            if bar is not None:  # also on Ctrl-C or a divergence: their message must not land on the bar's line
                bar.close()
        return self._end_epoch(epoch, tally, images, time.perf_counter() - started)

    def _progress_bar(self, epoch: int, first_batch: int) -> Any:
        """The epoch's tqdm bar, counting images over every rank; None when progress bars are off."""
        if not self.show_progress:
            return None
        from tqdm import tqdm

        return tqdm(
            total=(self.batches_per_epoch - first_batch) * self.config.batch_size * self.context.world_size,
            unit="img",
            unit_scale=True,
            desc=f"epoch {epoch + 1}/{self.total_epochs}",
            leave=False,
            dynamic_ncols=True,
        )

    def _train_batches(self, epoch: int, first_batch: int, tally: _StepTally, bar: Any) -> int:
        """Trains the epoch's batches from ``first_batch`` on; returns the images trained (every rank's).

        Reads the losses back at log intervals and before a checkpoint within the epoch only (see
        :class:`_StepTally`). At a log interval the read updates the progress bar or, without one, rank 0 prints a
        log line (:meth:`_log_line`). Raises TrainingDiverged at the first read after a NaN or infinite loss.
        """
        config, context = self.config, self.context
        log_lines = bar is None and context.is_main  # output sent to a file (or progress=off): no silent epochs
        started = time.perf_counter()
        images_trained = 0
        batches = iter(self.loader)  # before the generators are set: making an iterator draws from them
        self._set_generators(epoch, first_batch)
        for batch_index, (images, targets) in enumerate(batches, start=first_batch):
            update = (batch_index + 1) % config.accum_steps == 0 or batch_index + 1 == self.batches_per_epoch
            with self._strict_syncs():
                losses = self._train_batch(images, targets, batch_index, update, tally)
            batch = images.shape[0] * context.world_size
            images_trained += batch
            if bar is not None:
                bar.update(batch)
            if batch_index % config.log_interval == 0:  # with or without a bar: a diverged run stops soon
                reading = tally.read(last_loss=losses.loss)
                self._stop_if_diverged(reading, epoch, f"at batch {batch_index}")
                lr = self.train_step.optimizer.param_groups[0]["lr"]
                if bar is not None:
                    bar.set_postfix(loss=f"{reading.last_loss:.3f}", lr=f"{lr:.2e}")
                elif log_lines:
                    # timed after the read, which waited for the device: the time of the batches themselves
                    seconds = time.perf_counter() - started
                    line = self._log_line(epoch, batch_index, first_batch, reading, lr, images_trained, seconds)
                    print(line, flush=True)  # a file's block buffer would hold it back for minutes
            done = batch_index + 1
            if update and config.checkpoint_steps and self.step % config.checkpoint_steps == 0:
                if done < self.batches_per_epoch:  # the epoch's end has its own checkpoint
                    # every rank reads (the flag goes round every rank): a checkpoint after a bad loss anywhere
                    # would hold the weights that loss's gradients broke
                    reading = tally.read(all_ranks=context.world_size > 1)
                    self._stop_if_diverged(reading, epoch, f"at batch {batch_index}")
                    self._save(epoch, done, reading.sums)
        return images_trained

    def _log_line(
        self,
        epoch: int,
        batch_index: int,
        first_batch: int,
        reading: _TallyReading,
        lr: float,
        images: int,
        seconds: float,
    ) -> str:
        """One line of progress after batch ``batch_index`` (0-based) of ``epoch``, from a log interval's read:

        ``epoch   1/30  batch  51/390  loss 2.2034 (mean 2.3011)  lr 1.00e-04  512 img/s  ETA 0:10:12``

        ``loss``: the batch's classification loss, and its mean over the epoch's batches so far (this rank's);
        ``img/s``: every rank's images over the ``seconds`` since this process's first batch of the epoch
        (``first_batch``); ``ETA``: the epoch's batches left at that pace (evaluation not included).
        """
        done = batch_index + 1
        mean = reading.sums["loss"] / max(reading.sums["samples"], 1.0)
        remaining = (self.batches_per_epoch - done) * seconds / max(done - first_batch, 1)
        eta = datetime.timedelta(seconds=round(remaining))
        rate = images / max(seconds, 1e-9)
        width = len(str(self.batches_per_epoch))  # aligned, as the epoch lines are
        return (
            f"epoch {epoch + 1:>3}/{self.total_epochs}  batch {done:>{width}}/{self.batches_per_epoch}  loss "
            f"{reading.last_loss:.4f} (mean {mean:.4f})  lr {lr:.2e}  {rate:.0f} img/s  ETA {eta}"
        )

    def _train_batch(
        self, images: torch.Tensor, targets: torch.Tensor, batch_index: int, update: bool, tally: _StepTally
    ) -> StepLosses:
        """One batch from the loader (``images`` ``[B, C, H, W]``, ``targets`` ``[B]``, on the host): to the device,
        mixup, the :class:`TrainStep`, and at an update the step count and the schedule. No host read."""
        device = self.context.device
        images = images.to(device, non_blocking=True)  # from pinned memory on CUDA: the host does not wait
        targets = targets.to(device, non_blocking=True)
        if self.normalize is not None:
            images = self.normalize(images)
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        losses = self.train_step(
            images,
            targets,
            dal_weight=dal_weight_at(self.config, self.step, self.total_steps),
            update=update,
            tally=tally,
            batch_index=batch_index,
            step=self.step,
        )
        if update:
            self.step += 1
            if self.scheduler is not None:
                self.scheduler.step_update(num_updates=self.step)
        return losses

    @contextlib.contextmanager
    def _strict_syncs(self) -> Iterator[None]:
        """With ``sync_debug``, a batch's training runs under ``torch.cuda.set_sync_debug_mode("error")``: a host
        read of a device tensor in it raises. Not the run's first batch (compiling and Triton's autotuning read the
        device), nor the loop's own reads between batches (log intervals, checkpoints)."""
        if not (self.config.sync_debug and self._warm):
            self._warm = True
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def _set_generators(self, epoch: int, first_batch: int) -> None:
        """Seeds the global generators (mixup's, drop-path's) from ``(seed, rank, epoch)`` at an epoch's start, or, in
        the epoch a run resumed within, restores them as its checkpoint saved them after batch ``first_batch``.

        Once per epoch, not per batch: a checkpoint within the epoch saves their states, so a resumed run draws what
        the uninterrupted one drew without the per-step cost of seeding three generators (and CUDA's).
        """
        start = self.start
        if first_batch > 0 and epoch == start.epoch and start.rng is not None:
            checkpoint_io.restore_rng_states(start.rng)
        else:
            seed_everything(draw_seed(self.config.seed, self.context.rank, epoch, 1))

    def _end_epoch(self, epoch: int, tally: _StepTally, images: int, seconds: float) -> dict[str, Any]:
        """Reads the epoch's losses (under DDP every rank's), steps the schedule to the next epoch; returns the
        epoch's training record. Raises TrainingDiverged if a loss of the epoch was NaN or infinite."""
        ddp = self.context.world_size > 1
        reading = tally.read(all_ranks=ddp)  # under DDP, the epoch's loss over every rank's samples
        self._stop_if_diverged(reading, epoch, f"at the end of epoch {epoch + 1}")
        sums = reading.all_sums if ddp else reading.sums
        if self.scheduler is not None:
            self.scheduler.step(epoch + 1)
        samples = max(sums["samples"], 1.0)
        dal_on = self.train_step.dal_on
        return {
            "epoch": epoch + 1,
            "step": self.step,
            "train_loss": sums["loss"] / samples,
            "dal_loss": sums["dal"] / samples if dal_on else None,
            "dal_weight": dal_weight_at(self.config, self.step, self.total_steps) if dal_on else None,
            "lr": self.train_step.optimizer.param_groups[0]["lr"],
            "mjp_prob": self.model.mjp.sampler.prob if is_mjp_model(self.model) else 0.0,
            "train_images_per_second": images / max(seconds, 1e-9),  # the training batches alone
            "epoch_seconds": seconds,  # from the loader's first batch to the last step: no evaluation
        }

    def _evaluate(self, epoch: int, record: dict[str, Any], last_epoch: bool) -> None:
        """Adds the validation metrics to ``record`` every ``eval_interval`` epochs and after the last; after the
        last also the position regression, and keeps the final results. ``eval_seconds``: their time (None when the
        epoch is not evaluated), apart from the training's ``epoch_seconds``, as timm reports them."""
        config = self.config
        started = time.perf_counter()
        record["eval_seconds"] = None
        if (epoch + 1) % config.eval_interval == 0 or last_epoch:
            results = evaluate_model(
                self.model,
                self.val_loader,
                device=self.context.device,
                mean=torch.tensor(config.mean),
                std=torch.tensor(config.std),
                ratio=config.eval_ratio,
                seed=config.eval_seed,
                amp_dtype=self.train_step.amp_dtype,
                criterion=nn.CrossEntropyLoss(),
            )
            record.update(
                top1=results["top1"],
                top5=results["top5"],
                val_loss=results["loss"],
                consistency=results["consistency"],
                diff_norm=results["diff_norm"],
            )
        if last_epoch:
            regression = model_position_regression(self.model)
            record["pos_mae_1d"] = regression["mae_1d"] if regression else None
            record["pos_mae_2d"] = regression["mae_2d"] if regression else None
            self.final = {key: record.get(key) for key in FINAL_KEYS}
        if record.get("top1") is not None or last_epoch:
            record["eval_seconds"] = time.perf_counter() - started

    def _stop_if_diverged(self, reading: _TallyReading, epoch: int, noticed: str) -> None:
        """Raises TrainingDiverged if ``reading`` saw a NaN or infinite loss (``noticed``: where it was read)."""
        _check_divergence(reading, epoch, noticed, self.train_step.dal_on, self.last_path, self.config.lr)

    def _save(
        self,
        epoch: int,
        batch_in_epoch: int,
        running_sums: dict[str, float] | None,
        finished: bool = False,
        best: bool = False,
    ) -> None:
        """Rank 0 writes ``last.pt`` (and ``best.pt`` when ``best``) atomically: a run resumed from it goes on at
        batch ``batch_in_epoch`` of ``epoch`` (0-based), the batches before it summed in ``running_sums``."""
        # every rank knows what rank 0 saved: an interrupted rank says where the run resumes
        position = SavedPosition(epoch, batch_in_epoch, self.step, finished)
        if not self.context.is_main:
            self.saved = position
            return
        optimizer, scaler = self.train_step.optimizer, self.train_step.scaler
        payload = {
            "model_name": self.model_name,
            "model_kwargs": self.model_kwargs,
            "state_dict": self.model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "step": self.step,
            "finished": finished,
            "rng": checkpoint_io.rng_states(),
            "config": self.config.to_dict(),
            "metrics": self.history,
            "running": running_sums,
            "final": self.final,
            "mjp_fast_version": _version(),
        }
        checkpoint_io.save_atomically(payload, self.last_path)
        self.saved = position  # once written: a write interrupted midway leaves the previous last.pt
        if best:
            checkpoint_io.save_atomically(payload, self.output / BEST_CHECKPOINT)


def _version() -> str:
    from mjp_fast import __version__

    return __version__
