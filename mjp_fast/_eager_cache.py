"""A cache for the per-step lookups of the ops that torch.compile can trace through.

Dynamo traces through a ``functools.lru_cache``-wrapped function without consulting the cache, and warns that
silent incorrectness is possible. :func:`eager_cache` keeps the cache for eager steps (where it saves the work
every step) and calls the function itself while compiling (where the graph holds its result once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def eager_cache(maxsize: int | None = None) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """``functools.lru_cache(maxsize)`` in eager mode; under torch.compile, the undecorated function."""

    def decorate(function: Callable[..., Result]) -> Callable[..., Result]:
        cached = functools.lru_cache(maxsize=maxsize)(function)

        @functools.wraps(function)
        def lookup(*args):
            return function(*args) if torch.compiler.is_compiling() else cached(*args)

        return lookup

    return decorate
