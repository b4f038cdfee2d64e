"""argparse value types shared by the ``mjp`` subcommands: each refuses a bad value with a message that says what
was expected and what came."""

from __future__ import annotations

import argparse
import math


def fraction(text: str) -> float:
    """A ratio: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a ratio must be a number in [0, 1], got {text!r}") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a ratio must be in [0, 1], got {text}")
    return value


def _integer(text: str, minimum: int, maximum: int | None, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"{expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, None, "expected a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, None, "expected an integer >= 0")


def seed(text: str) -> int:
    """A sampler seed: an integer in [0, 2**64)."""
    return _integer(text, 0, 2**64 - 1, "a seed must be an integer in [0, 2**64)")


def torch_seed(text: str) -> int:
    """A seed that torch.manual_seed also takes: an integer in [0, 2**63)."""
    return _integer(text, 0, 2**63 - 1, "a seed must be an integer in [0, 2**63)")


# torch.compile's modes (``mjp train compile_mode=``, the benchmarks' ``--compile-mode``). reduce-overhead replays
# CUDA graphs: the host launches no kernel of a step, which on a GPU with a slow host is most of an eager step's time.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
