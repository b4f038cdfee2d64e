"""Seeds mixed from several integers, shared by training (per rank, epoch and sample) and evaluation (per
corruption and batch)."""

from __future__ import annotations

import numpy as np


def draw_seed(*numbers: int) -> int:
    """A 32-bit seed that mixes ``numbers`` (seed, rank, epoch, position...); distinct inputs give unrelated seeds."""
    return int(np.random.SeedSequence([int(number) for number in numbers]).generate_state(1)[0])
