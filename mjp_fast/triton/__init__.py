"""Triton kernels of the MJP operations (GPU; on the CPU through ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def operator(name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Registers a function that launches Triton kernels as a torch operator.

    On a GPU: ``torch.library.triton_op``, so torch.compile sees the kernels themselves (with ``wrap_triton``).
    Under the CPU interpreter (``TRITON_INTERPRET=1``): an opaque ``custom_op``, since compiled graphs cannot
    run interpreted kernels; forward, backward and torch.compile tracing behave the same.
    """
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return torch.library.custom_op(name, mutates_args=mutates_args)
    return torch.library.triton_op(name, mutates_args=mutates_args)
