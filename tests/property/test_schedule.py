"""Property tests of :class:`mjp_fast.timm.DALWeightSchedule` (issue 42; mjp_fast/timm/schedule.py): for any finite
``start``, ``end`` >= 0 and ``total_updates`` >= 0, the weight runs monotonically from ``start`` at update 0 to
``end`` at ``total_updates`` and stays ``end`` after it, however far (10**400 too), and ``step_update`` gives the
model that weight over ``accum_steps``. A step is any int >= 0 (Python's, NumPy's, a 0-d integer tensor); a bool, a
float, a string, None or a negative one is refused with a TypeError or ValueError naming ``num_updates``, the model's
weight left as it was; bad constructor arguments are refused by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

from mjp_fast.timm import DALWeightSchedule


class _Model(nn.Module):
    """What the schedule drives: anything with an ``mjp_dal_weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.mjp_dal_weight = -1.0


weights = st.one_of(
    st.sampled_from((0.0, 0.005, 0.01, 1.0)),
    st.floats(0.0, 10.0),
    st.floats(0.0, 1e300),
    st.floats(0.0, 1e-300),
)
totals = st.one_of(st.integers(0, 3), st.integers(0, 10**6), st.just(2**63))
steps = st.one_of(st.integers(0, 10), st.integers(0, 2 * 10**6), st.sampled_from((2**63, 2**64, 10**400)))


def close_to(value: float, expected: float, start: float, end: float) -> bool:
    """``value`` is ``expected`` within a few roundings of the larger of ``start`` and ``end`` (the cosine's sum)."""
    return abs(value - expected) <= 4 * math.ulp(max(start, end))


@given(weights, weights, totals, st.lists(steps, min_size=1, max_size=12))
def test_the_weight_runs_monotonically_from_start_to_end(start, end, total, updates):
    schedule = DALWeightSchedule(_Model(), start, end, total_updates=total)
    low, high = min(start, end), max(start, end)
    assert close_to(schedule.weight_at(0), start, start, end)
    values = [schedule.weight_at(update) for update in sorted({0, *updates})]
    for value in values:
        assert close_to(min(max(value, low), high), value, start, end), (value, low, high)  # within [low, high]
    ordered = values if start <= end else [-value for value in values]
    assert ordered == sorted(ordered), values  # monotone: non-decreasing towards a larger end, else non-increasing
    for update in updates:
        # exactly, however far past the end (total_updates 0: start at update 0 still, as tests/timm/test_schedule.py
        # has it, end from update 1)
        if update >= max(total, 1):
            assert schedule.weight_at(update) == end
    assert schedule.weight_at(10**400) == end


@given(weights, weights, totals)
@example(start=1e-20, end=1.0, total=10)
def test_the_weight_at_update_0_is_start_exactly(start, end, total):
    schedule = DALWeightSchedule(_Model(), start, end, total_updates=total)
    assert schedule.weight_at(0) == start
    assert schedule.model.mjp_dal_weight == start


@given(weights, weights, totals, st.integers(1, 64), st.lists(steps, min_size=1, max_size=6))
def test_step_update_gives_the_model_the_weight_over_accum_steps(start, end, total, accum_steps, updates):
    model = _Model()
    schedule = DALWeightSchedule(model, start, end, total_updates=total, accum_steps=accum_steps)
    assert model.mjp_dal_weight == schedule.weight_at(0) / accum_steps  # set on construction
    for update in updates:
        schedule.step_update(update)
        assert model.mjp_dal_weight == schedule.weight_at(update) / accum_steps


INTEGER_TYPES = (int, np.int64, np.int32, np.uint64, np.uint16, torch.tensor)


@given(weights, weights, totals, st.integers(0, 60_000), st.sampled_from(INTEGER_TYPES))
def test_any_integer_type_is_a_step(start, end, total, update, kind):
    schedule = DALWeightSchedule(_Model(), start, end, total_updates=total)
    step = kind(update)
    assert schedule.weight_at(step) == schedule.weight_at(update)
    schedule.step_update(step)
    assert schedule.model.mjp_dal_weight == schedule.weight_at(update)


NOT_STEPS = st.one_of(
    st.booleans(),
    st.sampled_from((np.bool_(True), np.bool_(False), None, "3", b"3", [3], torch.tensor(True), torch.tensor([3]))),
    st.floats(allow_nan=True, allow_infinity=True),
    st.builds(np.float64, st.floats(0.0, 100.0)),
    st.builds(torch.tensor, st.floats(0.0, 100.0)),
    st.text(max_size=4),
    st.integers(max_value=-1),
    st.sampled_from((-(10**400), np.int64(-1), torch.tensor(-1))),
)


def _negative_integer(step: object) -> bool:
    """Whether ``step`` is an integer of the right kind and the wrong value (a ValueError; the rest: TypeErrors)."""
    if isinstance(step, torch.Tensor):
        return step.dim() == 0 and not step.dtype.is_floating_point and step.dtype != torch.bool and int(step) < 0
    return isinstance(step, (int, np.integer)) and not isinstance(step, bool) and step < 0


@given(weights, weights, totals, NOT_STEPS)
def test_a_step_that_is_not_an_int_ge_0_is_refused_by_name(start, end, total, step):
    model = _Model()
    schedule = DALWeightSchedule(model, start, end, total_updates=total, accum_steps=2)
    before = model.mjp_dal_weight
    for method in (schedule.weight_at, schedule.step_update):
        with pytest.raises((TypeError, ValueError)) as caught:
            method(step)
        assert "num_updates" in str(caught.value), str(caught.value)
        assert isinstance(caught.value, ValueError) == _negative_integer(step), repr(caught.value)
    assert model.mjp_dal_weight == before  # left as it was


BAD_ARGUMENTS = {
    "start": (-0.1, float("nan"), float("inf"), True, "0.01", None, 1e-3j),
    "end": (-1e-9, float("-inf"), float("nan"), False, "0", None),
    "total_updates": (-1, 1.0, 10.5, True, "10", None),
    "accum_steps": (0, -2, 2.0, True, "1", None),
}
MISTAKES = [(name, value) for name, values in BAD_ARGUMENTS.items() for value in values]


@given(weights, weights, totals, st.sampled_from(MISTAKES))
def test_bad_constructor_arguments_are_refused_by_name(start, end, total, mistake):
    name, value = mistake
    arguments = dict(start=start, end=end, total_updates=total, accum_steps=1)
    arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as caught:
        DALWeightSchedule(_Model(), **arguments)
    assert name in str(caught.value), str(caught.value)


@given(st.sampled_from(("start", "end")), st.one_of(st.integers(min_value=2**1024), st.integers(max_value=-(2**1024))))
def test_a_weight_beyond_floats_range_is_refused_by_name(name, value):
    arguments = dict(start=0.01, end=0.005, total_updates=10)
    arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as caught:
        DALWeightSchedule(_Model(), **arguments)
    assert name in str(caught.value), str(caught.value)


@given(st.sampled_from((nn.Linear(2, 2), None, 3, "model")))
def test_a_model_without_a_dal_weight_is_refused(model):
    with pytest.raises(TypeError, match="model"):
        DALWeightSchedule(model, 0.01, 0.005, total_updates=10)
