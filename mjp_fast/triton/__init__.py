"""Triton kernels of the MJP operations (GPU; on the CPU through ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mjp_fast.backend import triton_interpreting as interpreting  # one reading of TRITON_INTERPRET


def launcher(kernel, grid, traced: bool):
    """``kernel[grid]``, through ``torch.library.wrap_triton`` only when a ``triton_op`` traces the launch (so
    torch.compile sees the kernel itself). In eager mode that wrapper is host time for nothing, and under the
    interpreter the operators are plain custom ops (see :func:`operator`), whose kernels torch 2.11's
    ``wrap_triton`` refuses."""
    if traced and not interpreting():
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def operator(name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Registers a function that launches Triton kernels as a torch operator.

    On a GPU: ``torch.library.triton_op``, so torch.compile sees the kernels themselves (with ``wrap_triton``).
    Under the CPU interpreter (``TRITON_INTERPRET=1``): an opaque ``custom_op``, since compiled graphs cannot
    run interpreted kernels; forward, backward and torch.compile tracing behave the same.
    """
    if interpreting():
        return torch.library.custom_op(name, mutates_args=mutates_args)
    return torch.library.triton_op(name, mutates_args=mutates_args)
