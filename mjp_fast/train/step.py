"""One training step (:class:`TrainStep`): forward, the classification loss with the weighted DAL loss, backward,
and at the end of an accumulation gradient clipping and the optimizer's step; and the DAL weight of a step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from timm.utils import dispatch_clip_grad
from torch import nn

from mjp_fast.timm.schedule import dal_weight_cosine
from mjp_fast.train.config import TrainConfig
from mjp_fast.train.tally import StepTally


def dal_weight_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """The DAL weight after ``step`` of ``total_steps`` optimizer steps: cosine from dal_weight to dal_weight_end (the
    cosine of :class:`mjp_fast.timm.DALWeightSchedule`)."""
    return dal_weight_cosine(config.dal_weight, config.dal_weight_end, step, total_steps)


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


@contextlib.contextmanager
def syncs_allowed_while_compiling() -> Iterator[None]:
    """Lifts ``sync_debug``'s error mode while torch.compile compiles (Dynamo tracing a frame, AOTAutograd's lazy
    backward, the recording of CUDA graphs), and sets it back when the compilation ends.

    A compile is not a step: Inductor reads device values while it compiles (its constant folding calls ``.item()``;
    the H200 stopped ``mjp train compile=true sync_debug=true`` on it, 2026-11-28), and a recompilation can come at any
    batch, not only the first. torch's compilation callbacks (``torch._dynamo.callback_handler``) mark where a
    compile starts and ends; a torch without them leaves the mode as it is.
    """
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None:
        yield
        return
    modes: list[int | str] = []

    def start(*_: object) -> None:
        modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode(0)

    def end(*_: object) -> None:
        torch.cuda.set_sync_debug_mode(modes.pop() if modes else 0)

    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        yield
    finally:
        handler.remove_start_callback(start)
        handler.remove_end_callback(end)


@dataclass
class StepLosses:
    """One micro-batch's losses: 0-d float tensors on the training device, not read back (see :class:`StepTally`)."""

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
        tally: StepTally,
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
            # a non-finite loss is only recorded here; it is raised at the next read (see StepTally)
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
