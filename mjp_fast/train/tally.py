"""The epoch's running loss sums and the divergence watch (:class:`StepTally`), read back to the host only at log
intervals, checkpoints and the epoch's end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mjp_fast.train.outcome import TrainingDiverged


@dataclass
class TallyReading:
    """One read back of a :class:`StepTally`: plain Python numbers."""

    sums: dict[str, float]  # this rank's running sums, in the checkpoint's ``running`` format
    diverged: bool  # a loss on this rank was NaN or infinite
    first_bad: tuple[float, float, float, int, int]  # the first such batch: total, classification, DAL, batch, step
    all_sums: dict[str, float] | None = None  # every rank's sums together (read with all_ranks=True)
    diverged_anywhere: bool = False  # on any rank (read with all_ranks=True; else this rank)
    last_loss: float | None = None


class StepTally:
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

    def read(self, *, all_ranks: bool = False, last_loss: torch.Tensor | None = None) -> TallyReading:
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
        reading = TallyReading(
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


def check_divergence(reading: TallyReading, epoch: int, noticed: str, dal_on: bool, last_path: Path, lr: float) -> None:
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
