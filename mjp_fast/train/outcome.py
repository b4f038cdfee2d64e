"""What a run leaves and how it ends: its files' names, :class:`RunResult`, where its ``last.pt`` resumes, and the
errors that stop it (a NaN loss, Ctrl-C), with the message that says how to go on.

The training loop's lowest module: the loop, the comparison, the preflight checks and the CLI all read it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mjp_fast.train.config import TrainConfig

LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
FINAL_KEYS = ("top1", "top5", "consistency", "diff_norm", "val_loss", "pos_mae_1d", "pos_mae_2d")
# the runs of a comparison (compare=true): their folders under the output, and whether each is the MJP one
RUNS = (("baseline", False), ("mjp", True))


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
