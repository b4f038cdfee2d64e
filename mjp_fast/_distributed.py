"""The process's rank and the world size of the default process group, for code that runs with or without one."""

from __future__ import annotations

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when there is none (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
