"""A run's place in a ``torchrun`` job: rank, world size and device, the process group's life, and decisions that
rank 0 makes for every rank.

Code that only needs the rank and world size of an existing group (the sampler, evaluation) reads them with
:func:`mjp_fast._distributed.rank_and_world`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mjp_fast.train.config import TrainConfig
from mjp_fast.train.device import resolve_device


@dataclass
class Distributed:
    """The process's place in the job: rank, world size, device, and whether it set up the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(config: TrainConfig) -> Distributed:
    """Joins the ``torchrun`` job when ``WORLD_SIZE > 1`` (NCCL on GPUs, gloo on CPUs); else one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size <= 1:
        return Distributed(device=device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


@contextlib.contextmanager
def distributed_session(config: TrainConfig) -> Iterator[Distributed]:
    """The process group of a whole command: joined on entry, destroyed on exit only if this call created it.

    Everything that trains more than one model in one ``torchrun`` job (``compare=true``) must run inside one
    session: a default group destroyed and created again gets the same name, hence the same keys in torchrun's
    store, and the new group's gloo/NCCL handshake reads the old group's stale addresses (connection refused or
    reset, or a hang). Nested sessions, and a caller's own group, are reused and left alone.
    """
    context = setup_distributed(config)
    try:
        yield context
    finally:
        if context.owns_group:
            dist.destroy_process_group()


def broadcast_from_main(value: Any, context: Distributed) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object): decisions that every rank must make alike."""
    if context.world_size == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
