"""DALWeightSchedule's step argument (issue 42 item 6): an int >= 0 (NumPy and 0-dim torch integers too), refused
by name otherwise; a step however far past the schedule's end gives its end value, without overflow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mjp_fast.timm import DALWeightSchedule
from mjp_fast.timm.schedule import dal_weight_cosine


class _Model(nn.Module):
    """What the schedule drives: anything with an ``mjp_dal_weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.mjp_dal_weight = 0.0


@pytest.fixture
def schedule() -> DALWeightSchedule:
    return DALWeightSchedule(_Model(), 0.01, 0.005, total_updates=100, accum_steps=2)


@pytest.mark.parametrize("step", [100, 101, 2**63, 10**400], ids=["end", "past", "2**63", "10**400"])
def test_a_step_past_the_end_gives_the_end_value(schedule, step):
    schedule.step_update(step)
    assert schedule.model.mjp_dal_weight == 0.005 / 2
    assert schedule.weight_at(step) == 0.005


@pytest.mark.parametrize("step", [np.int64(50), np.int32(50), np.uint16(50), torch.tensor(50)], ids=repr)
def test_numpy_and_torch_integer_steps_are_ints(schedule, step):
    schedule.step_update(step)
    assert schedule.model.mjp_dal_weight == dal_weight_cosine(0.01, 0.005, 50, 100) / 2
    assert schedule.weight_at(step) == schedule.weight_at(50) == pytest.approx(0.0075)


@pytest.mark.parametrize(
    "step, error, words",
    [
        ("x", TypeError, "got str 'x'"),
        (None, TypeError, "got NoneType None"),
        (True, TypeError, "got bool True"),
        (np.bool_(False), TypeError, "got bool"),
        (3.0, TypeError, "got float 3.0"),
        (torch.tensor(3.0), TypeError, "torch.float32 tensor"),
        (torch.tensor([3]), TypeError, r"shape \[1\]"),
        (-1, ValueError, ">= 0, got -1"),
        (-(10**400), ValueError, ">= 0, got -1000"),
    ],
    ids=["str", "None", "True", "numpy_bool", "float", "float_tensor", "1d_tensor", "-1", "-10**400"],
)
def test_a_bad_step_is_refused_by_name(schedule, step, error, words):
    for method in (schedule.step_update, schedule.weight_at):
        with pytest.raises(error, match=f"^num_updates must be .*{words}"):
            method(step)
    assert schedule.model.mjp_dal_weight == 0.01 / 2  # left as it was


def test_the_cosine_clamps_before_dividing():
    assert dal_weight_cosine(0.01, 0.005, 10**400, 100) == 0.005
    assert dal_weight_cosine(0.01, 0.005, -(10**400), 100) == 0.01
    assert dal_weight_cosine(0.01, 0.005, 0, 0) == 0.01 and dal_weight_cosine(0.01, 0.005, 1, 0) == 0.005
