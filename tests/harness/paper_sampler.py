"""The baseline sampler: BEiT's masking generator as the paper's code runs it, a plain Python loop per mask.

tests/sampler compares the two samplers' distributions with it; the sampler benchmark (bench/bench_sampler.py) times it
against ``mjp_fast.sample_jigsaw``, and the jigsaw-apply benchmark builds the paper's per-batch mask with it.
"""

from __future__ import annotations

import math
import random

import numpy as np

from mjp_fast._validate import check_grid_size
from mjp_fast.sampler.reference import ATTEMPTS_PER_ROUND, target_count


def block_mask_python(
    grid_size: int | tuple[int, int],
    ratio: float,
    *,
    min_block: int = 8,
    min_aspect: float = 0.3,
    rng: random.Random | None = None,
) -> np.ndarray:
    """One block-wise mask by the plain Python loop, with Python's float ``random``.

    This is the algorithm of BEiT's masking generator as docs/design.md section 1 states it, written here from that
    description: the distributional reference for our integer sampler and the baseline of the sampler
    benchmark.

    Returns:
        bool ``[rows, cols]``.
    """
    rows, cols = check_grid_size(grid_size)
    rng = rng or random.Random()
    target = target_count(ratio, rows * cols)
    log_aspect = (math.log(min_aspect), math.log(1.0 / min_aspect))
    mask = np.zeros((rows, cols), dtype=bool)
    count = 0
    while count < target:
        remaining = target - count
        delta = 0
        for _ in range(ATTEMPTS_PER_ROUND):
            area = rng.uniform(min_block, remaining)
            aspect = math.exp(rng.uniform(*log_aspect))
            height = int(round(math.sqrt(area * aspect)))
            width = int(round(math.sqrt(area / aspect)))
            if width < cols and height < rows:
                top = rng.randint(0, rows - height)
                left = rng.randint(0, cols - width)
                block = mask[top : top + height, left : left + width]
                new = height * width - int(block.sum())
                if 0 < new <= remaining:
                    block[...] = True
                    delta = new
            if delta > 0:
                break
        if delta == 0:
            break
        count += delta
    return mask
