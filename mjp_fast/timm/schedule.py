"""The DAL weight: its check, the paper's cosine schedule, and a helper that drives a model's ``mjp_dal_weight``.

An MJP model holds its DAL weight (``model.mjp_dal_weight``, a buffer of ``model.mjp``): the training forward
attaches the DAL loss to the tokens at that weight (see :mod:`mjp_fast.ops.aux_loss`), so any loop trains DAL. The
paper's code decays it along a cosine from 0.01 to 0.005 over the run; :class:`DALWeightSchedule` does that for a
loop, stepped as timm's schedulers are (``step_update(num_updates)`` after each optimizer step).
"""

from __future__ import annotations

import math
import numbers

from torch import nn

from mjp_fast._validate import check_int, check_int_like

# The paper's DAL weight at the start of training (its code: 0.01, decayed along a cosine to 0.005).
DEFAULT_DAL_WEIGHT = 0.01
DEFAULT_DAL_WEIGHT_END = 0.005


def check_dal_weight(name: str, value: object) -> float:
    """``value`` as a float: a finite real number >= 0 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite float >= 0, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (10**400): not a weight, and float() names no argument
        raise ValueError(f"{name} must be a finite float >= 0, got a number beyond float's range") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite float >= 0, got {value}")
    return value


def dal_weight_cosine(start: float, end: float, num_updates: int, total_updates: int) -> float:
    """The DAL weight after ``num_updates`` of ``total_updates`` optimizer steps: a cosine from ``start`` to ``end``
    (``end`` from ``total_updates`` on, ``start`` before update 0)."""
    if num_updates <= 0:
        # exactly start: the cosine's sum below rounds start away where end dwarfs it (1e-20 against 1.0 gave 0.0)
        return start
    span = max(total_updates, 1)
    # Clamped before the division: an int past float's range (10**400) would overflow it.
    progress = min(num_updates, span) / span
    weight = end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    return min(max(weight, min(start, end)), max(start, end))  # within [start, end] whatever the rounding


class DALWeightSchedule:
    """Sets an MJP model's ``mjp_dal_weight`` along the paper's cosine, as a loop steps it.

    ::

        schedule = DALWeightSchedule(model, 0.01, 0.005, total_updates=epochs * updates_per_epoch)
        for ...:
            criterion(model(images), targets).backward()  # DAL trains attached to the output
            optimizer.step(); num_updates += 1
            schedule.step_update(num_updates)

    Args:
        model: an MJP model (anything with an ``mjp_dal_weight`` attribute: :func:`mjp_fast.timm.convert`'s models,
            their ``features_only`` wrappers).
        start, end: the weights at update 0 and from ``total_updates`` on (finite, >= 0).
        total_updates: the optimizer steps of the whole run.
        accum_steps: a loop that divides its loss by ``accum_steps`` before each backward (gradient accumulation,
            as timm's ``train.py``) passes it here: the attached weight is divided alike, so DAL keeps its weight
            relative to the loss. (A loss scaler's scale is not known here: with fp16 and a scaler, scale the weight
            yourself or add ``w * model.mjp_aux_loss()`` to the loss before scaling it.)

    The model's weight is set on construction (update 0) and by :meth:`step_update` where it changes.
    """

    def __init__(self, model: nn.Module, start: float, end: float, total_updates: int, *, accum_steps: int = 1) -> None:
        if not hasattr(model, "mjp_dal_weight"):
            raise TypeError(f"model must be an MJP model (with mjp_dal_weight), got {type(model).__name__}")
        self.model = model
        self.start = check_dal_weight("start", start)
        self.end = check_dal_weight("end", end)
        self.total_updates = check_int("total_updates", total_updates, minimum=0)
        self.accum_steps = check_int("accum_steps", accum_steps, minimum=1)
        self._applied: float | None = None  # the model's weight as last set here
        self.step_update(0)

    def weight_at(self, num_updates: int) -> float:
        """The DAL weight after ``num_updates`` optimizer steps (before the division by ``accum_steps``).

        ``num_updates``: an int >= 0 (a NumPy integer or a 0-dim integer tensor too; bools refused); from
        ``total_updates`` on, however far past it, the weight is ``end``.
        """
        num_updates = check_int_like("num_updates", num_updates, minimum=0)
        return dal_weight_cosine(self.start, self.end, num_updates, self.total_updates)

    def step_update(self, num_updates: int) -> None:
        """Sets the model's weight for the steps after ``num_updates`` optimizer steps (where it changes);
        ``num_updates`` as :meth:`weight_at`'s."""
        weight = self.weight_at(num_updates) / self.accum_steps
        if weight != self._applied:
            self.model.mjp_dal_weight = weight
            self._applied = weight
