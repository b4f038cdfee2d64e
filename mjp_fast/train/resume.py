"""Where a run starts: its output folder, the checkpoint it continues from, and that checkpoint restored into the
model, optimizer, schedule and scaler (:func:`restore_checkpoint`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from timm.scheduler.scheduler import Scheduler
from torch import nn

from mjp_fast.train import checkpoint as checkpoint_io
from mjp_fast.train.config import ConfigError, TrainConfig
from mjp_fast.train.distributed import Distributed, broadcast_from_main
from mjp_fast.train.outcome import LAST_CHECKPOINT, SavedPosition
from mjp_fast.train.records import say

SCHEDULE_KEYS = ("epochs", "sched", "warmup_epochs", "warmup_lr", "min_lr", "cooldown_epochs", "lr")


def default_output(config: TrainConfig) -> str:
    name = "digits" if config.dataset_kind == "digits" else Path(str(config.data)).resolve().name or "data"
    return str(Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")


def open_output(
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


def saved_position(state: dict[str, Any] | None) -> SavedPosition | None:
    """Where the checkpoint ``state`` (None: none) resumes."""
    if state is None:
        return None
    return SavedPosition(state["epoch"], state.get("batch_in_epoch", 0), state["step"], bool(state.get("finished")))


@dataclass
class Start:
    """Where training starts: a new run at the beginning, a resumed one where its checkpoint left off."""

    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already trained
    step: int = 0  # optimizer steps taken
    history: list[dict[str, Any]] = field(default_factory=list)  # the records of the epochs trained
    running: dict[str, float] | None = None  # the loss sums of ``epoch``'s trained batches (None: none yet)
    rng: dict[str, Any] | None = None  # the global generators' states after batch ``batch`` (checkpoint.rng_states)
    resumed: bool = False  # from a checkpoint (which is then the run's last.pt until the next save)


def restore_checkpoint(
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
) -> Start:
    """Loads a checkpoint (``state``; None: a new run) into the model, optimizer, schedule and scaler; returns where
    training resumes, with the global generators' states that :meth:`Run._train_batches` restores mid-epoch.

    A checkpoint of a schedule other than the config's keeps its weights and optimizer state, and the schedule
    continues as the config says; one written after its epoch's last batch resumes at the next epoch's start.
    Raises ConfigError for a checkpoint of another model.
    """
    if state is None:
        return Start()
    if state["model_name"] != model_name:
        raise ConfigError(f"the checkpoint holds {state['model_name']}, this config builds {model_name}")
    model.load_state_dict(state["state_dict"])
    optimizer.load_state_dict(state["optimizer"])
    saved_config = state.get("config") or {}
    same_schedule = all(saved_config.get(key) == getattr(config, key) for key in SCHEDULE_KEYS)
    if scheduler is not None and state.get("scheduler") is not None and same_schedule:
        scheduler.load_state_dict(state["scheduler"])
    elif not same_schedule:
        say(context, f"the schedule changed ({', '.join(SCHEDULE_KEYS)}): it continues as the new config says")
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    start = Start(
        epoch=state["epoch"],
        batch=state.get("batch_in_epoch", 0),
        step=state["step"],
        history=list(state.get("metrics", [])),
        running=state.get("running"),
        rng=state.get("rng"),
        resumed=True,
    )
    if start.batch >= batches_per_epoch:  # saved after its epoch's last batch
        start = Start(epoch=start.epoch + 1, step=start.step, history=start.history, resumed=True)
    say(context, f"resuming {output} at epoch {start.epoch + 1}, batch {start.batch}, step {start.step}")
    return start
