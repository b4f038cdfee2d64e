"""The training loop of ``mjp train``: timm's optimizer, schedule, Mixup and losses, with MJP and DAL.

One process per GPU under ``torchrun`` (DDP), or one process on a CPU or GPU:

    torchrun --nproc_per_node=8 -m mjp_fast.cli train --config deit_s.yaml --data /data/imagenet

Per step: mixup/cutmix on the batch, then the model's forward (which jigsaws the batch: MJP comes after mixup, as
in the paper's code, and attaches the DAL loss to its tokens at the model's ``mjp_dal_weight``, set to
``dal_weight(step)``), the classification loss, backward (which trains DAL too), gradient clipping and the
optimizer step (all four in :class:`~mjp_fast.train.step.TrainStep`), then the schedule. The jigsaw starts at
``mjp_from_epoch`` (default: the end of warm-up); the DAL weight decays from ``dal_weight`` to ``dal_weight_end``
along a cosine over the whole run.

Reproducibility and resumption: each epoch seeds the global generators from ``(seed, rank, epoch)`` (mixup,
drop-path), a checkpoint within an epoch saves their states, and each sample seeds its transform (see
:mod:`mjp_fast.train.data`); the jigsaw stream is the model's ``mjp.sampler`` counter, a buffer in the checkpoint.
A run resumed from any checkpoint, at an epoch boundary or within an epoch (``checkpoint_steps``), continues
exactly as the uninterrupted run.

This file holds the entry point, :func:`train`; the loop's parts live one concern a file beside it:

- :mod:`~mjp_fast.train.outcome`: the run's files, :class:`RunResult`, the errors that stop a run;
- :mod:`~mjp_fast.train.device`, :mod:`~mjp_fast.train.distributed`: the device, autocast and the ``torchrun`` job;
- :mod:`~mjp_fast.train.build`: a run built from its config (data, model, optimizer, schedule, losses);
- :mod:`~mjp_fast.train.resume`: the output folder and the checkpoint a run continues from;
- :mod:`~mjp_fast.train.run`: the epochs and batches, the checkpoints; :mod:`~mjp_fast.train.step`: one step;
- :mod:`~mjp_fast.train.tally`: the running losses and the divergence watch;
- :mod:`~mjp_fast.train.validation`: the evaluation after an epoch; :mod:`~mjp_fast.train.records`: what a run
  writes and prints.

The names this module held before the split are imported here, so ``from mjp_fast.train.loop import ...`` keeps
working.
"""

from __future__ import annotations

from pathlib import Path

from mjp_fast.train.build import build_run, normalizes_on_device
from mjp_fast.train.config import TrainConfig
from mjp_fast.train.device import amp_dtype, resolve_device
from mjp_fast.train.distributed import Distributed, broadcast_from_main, distributed_session, setup_distributed
from mjp_fast.train.outcome import (
    BEST_CHECKPOINT,
    CONFIG_FILE,
    FINAL_KEYS,
    LAST_CHECKPOINT,
    METRICS_FILE,
    RunResult,
    SavedPosition,
    TrainingDiverged,
    TrainingInterrupted,
    interrupted_message,
    resume_command,
)
from mjp_fast.train.preflight import check_run
from mjp_fast.train.records import count_parameters, describe_model, plural, say, summary_table
from mjp_fast.train.resume import SCHEDULE_KEYS, default_output, open_output, saved_position
from mjp_fast.train.step import StepLosses, TrainStep, dal_weight_at
from mjp_fast.train.tally import StepTally, check_divergence

# the private names of the loop before its split, which tests reach for
_StepTally = StepTally
_check_divergence = check_divergence
_build_run = build_run

__all__ = [
    "BEST_CHECKPOINT",
    "CONFIG_FILE",
    "FINAL_KEYS",
    "LAST_CHECKPOINT",
    "METRICS_FILE",
    "SCHEDULE_KEYS",
    "Distributed",
    "RunResult",
    "SavedPosition",
    "StepLosses",
    "TrainStep",
    "TrainingDiverged",
    "TrainingInterrupted",
    "amp_dtype",
    "broadcast_from_main",
    "count_parameters",
    "dal_weight_at",
    "default_output",
    "describe_model",
    "distributed_session",
    "interrupted_message",
    "normalizes_on_device",
    "plural",
    "resolve_device",
    "resume_command",
    "setup_distributed",
    "summary_table",
    "train",
]


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
    # the values and the model, fitted as the CLI fits them (the CLI has checked the folders and device already;
    # open_output checks the output folder of a library call)
    config = check_run(config, resume=resume, environment=False)
    with distributed_session(config) as context:
        return _train(config, context, resume)


def _train(config: TrainConfig, context: Distributed, resume: bool | str | Path) -> RunResult:
    """Opens the run's output folder, builds the run and trains the epochs it has left (a finished run: none)."""
    config, output, state = open_output(config, context, resume)
    if state is not None and state.get("finished") and state.get("epoch", 0) >= config.epochs + config.cooldown_epochs:
        say(context, f"{output}: this run finished already ({plural(config.epochs, 'epoch')}); nothing to do")
        history = list(state.get("metrics", []))
        return RunResult(output, output / LAST_CHECKPOINT, config, history, state.get("final", {}))
    run = None
    try:
        run = build_run(config, context, output, state)
        return run.fit()
    except KeyboardInterrupt as interrupt:
        # Ctrl-C: name the real folder and say whether it holds a checkpoint (none before the first one is written,
        # and then --resume has nothing to resume)
        if run is not None:
            saved, where = run.saved, f"in epoch {run.epoch + 1}/{run.total_epochs}"
        else:
            saved, where = saved_position(state), "while the run was being set up"
        raise TrainingInterrupted(interrupted_message(output, saved, where), output, saved) from interrupt
