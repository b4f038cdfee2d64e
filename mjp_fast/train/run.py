"""A built run (:class:`Run`) and its epochs: the training batches, each a :class:`~mjp_fast.train.step.TrainStep`,
the epoch's record, the validation (:mod:`mjp_fast.train.validation`) and the checkpoints."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from timm.data import Mixup
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torch.utils.data import DataLoader

from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import TrainConfig, save_config
from mjp_fast.train.data import DeviceNormalize, SeededEpochSampler, draw_seed, seed_everything
from mjp_fast.train.distributed import Distributed
from mjp_fast.train.models import is_mjp_model
from mjp_fast.train.outcome import (
    BEST_CHECKPOINT,
    CONFIG_FILE,
    FINAL_KEYS,
    LAST_CHECKPOINT,
    RunResult,
    SavedPosition,
)
from mjp_fast.train.records import RunWriters, format_record, say, summary_table
from mjp_fast.train.resume import Start
from mjp_fast.train.step import StepLosses, TrainStep, dal_weight_at, syncs_allowed_while_compiling
from mjp_fast.train.tally import StepTally, TallyReading, check_divergence
from mjp_fast.train.validation import position_metrics, validation_metrics


@dataclass
class Run:
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
    start: Start
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
        writers = RunWriters(self.config, self.output, context, self.history)
        best_top1 = max((record["top1"] for record in self.history if record.get("top1") is not None), default=-1.0)
        if self.header is not None:
            say(context, self.header)
        try:
            for epoch in range(self.start.epoch, self.total_epochs):
                self.epoch = epoch
                record = self._train_epoch(epoch)
                last_epoch = epoch + 1 == self.total_epochs
                self._evaluate(epoch, record, last_epoch)
                self.history.append(record)
                writers.write(record)
                say(context, format_record(record, self.total_epochs))
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
        tally = StepTally(self.context.device, self.start.running if first_epoch else None)
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

    def _train_batches(self, epoch: int, first_batch: int, tally: StepTally, bar: Any) -> int:
        """Trains the epoch's batches from ``first_batch`` on; returns the images trained (every rank's).

        Reads the losses back at log intervals and before a checkpoint within the epoch only (see
        :class:`StepTally`). At a log interval the read updates the progress bar or, without one, rank 0 prints a
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
        reading: TallyReading,
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
        self, images: torch.Tensor, targets: torch.Tensor, batch_index: int, update: bool, tally: StepTally
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
        device), not while torch.compile compiles (a recompilation at a later batch), nor the loop's own reads
        between batches (log intervals, checkpoints)."""
        if not (self.config.sync_debug and self._warm):
            self._warm = True
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            with syncs_allowed_while_compiling():
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

    def _end_epoch(self, epoch: int, tally: StepTally, images: int, seconds: float) -> dict[str, Any]:
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
            record.update(
                validation_metrics(self.model, self.val_loader, config, self.context.device, self.train_step.amp_dtype)
            )
        if last_epoch:
            record.update(position_metrics(self.model))
            self.final = {key: record.get(key) for key in FINAL_KEYS}
        if record.get("top1") is not None or last_epoch:
            record["eval_seconds"] = time.perf_counter() - started

    def _stop_if_diverged(self, reading: TallyReading, epoch: int, noticed: str) -> None:
        """Raises TrainingDiverged if ``reading`` saw a NaN or infinite loss (``noticed``: where it was read)."""
        check_divergence(reading, epoch, noticed, self.train_step.dal_on, self.last_path, self.config.lr)

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
