"""The ``mjp`` command.

    mjp demo [--image astronaut|chelsea|coffee|rocket|PATH] [--ratios 0.1 0.3 0.5 0.9] [--out mjp_demo.png] ...
    mjp backends

This module only parses arguments; the work is in :mod:`mjp_fast.demo` and :mod:`mjp_fast.backend`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Sequence

import torch

from mjp_fast import __version__
from mjp_fast import backend as backend_module

EXTENSION_WARNING = "mjp_fast: the compiled extension"


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a ratio must be a number in [0, 1], got {text!r}") from None
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise argparse.ArgumentTypeError(f"a ratio must be in [0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed must be an integer in [0, 2**64), got {text!r}") from None
    if not (0 <= value < 2**64):
        raise argparse.ArgumentTypeError(f"a seed must be an integer in [0, 2**64), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from mjp_fast.demo import BUILTIN_IMAGES

    parser = argparse.ArgumentParser(
        prog="mjp",
        description="Masked Jigsaw Puzzle position embeddings for ViTs: fast per-sample jigsaws.",
    )
    parser.add_argument("--version", action="version", version=f"mjp_fast {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="write a PNG of a photo beside jigsawed copies of it",
        description="Samples one block-wise jigsaw per ratio, applies it to a photo and writes one PNG: the "
        "original beside the jigsawed copies, masked (shuffled) patches outlined, each captioned with its ratio "
        "and the number of masked patches.",
    )
    demo.add_argument(
        "--image",
        default="astronaut",
        metavar="NAME|PATH",
        help=f"a photo shipped with scikit-image ({', '.join(BUILTIN_IMAGES)}) or an image file "
        "(default: %(default)s); it is center-cropped to a square and resized",
    )
    demo.add_argument(
        "--ratios",
        type=_ratio,
        nargs="+",
        default=[0.1, 0.3, 0.5, 0.9],
        metavar="R",
        help="mask ratios in [0, 1], one panel each (default: %(default)s)",
    )
    demo.add_argument("--patch-size", type=_positive_int, default=16, help="patch side in pixels (default: 16)")
    demo.add_argument(
        "--size",
        type=_positive_int,
        default=224,
        help="image side in pixels, a multiple of --patch-size (default: 224)",
    )
    demo.add_argument("--seed", type=_seed, default=0, help="the sampler's seed (default: 0)")
    demo.add_argument("--out", default="mjp_demo.png", help="the PNG to write (default: %(default)s)")
    demo.add_argument(
        "--backend",
        choices=backend_module.KNOWN_BACKENDS,
        default=None,
        help=f"sampler backend (default: ${backend_module.ENV_VARIABLE}, else the fastest available)",
    )

    commands.add_parser(
        "backends",
        help="list the available backends and whether the compiled extension loaded",
        description="Lists the backends that can run here, fastest first, and whether mjp_fast._C loaded.",
    )
    return parser


def _print_backends() -> int:
    names = backend_module.available_backends()
    module = backend_module.extension()
    print(f"available backends: {', '.join(names)}")
    if module is None:
        print(f"compiled extension mjp_fast._C: not loaded ({backend_module.extension_error()})")
    else:
        print(
            f"compiled extension mjp_fast._C: loaded (built with CUDA kernels: {'yes' if module.has_cuda() else 'no'})"
        )
    print(f"automatic choice for CPU tensors: {backend_module.resolve_backend(None, torch.device('cpu'))}")
    if torch.cuda.is_available():
        print(f"automatic choice for CUDA tensors: {backend_module.resolve_backend(None, torch.device('cuda'))}")
    else:
        print("CUDA: no GPU visible to torch")
    print(f"{backend_module.ENV_VARIABLE}={os.environ.get(backend_module.ENV_VARIABLE, '')!r}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mjp`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, --version and argparse's own errors
        return exit_request.code if isinstance(exit_request.code, int) else 1
    with warnings.catch_warnings():
        # Which backend runs is part of what the commands print; the import warning would only repeat it.
        warnings.filterwarnings("ignore", message=EXTENSION_WARNING, category=RuntimeWarning)
        if args.command == "backends":
            return _print_backends()
        from mjp_fast.demo import run_demo

        try:
            return run_demo(args)
        except ValueError as error:
            print(f"mjp demo: error: {error}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
