"""The ``mjp`` command.

    mjp demo [--image astronaut|chelsea|coffee|rocket|PATH] [--ratios 0.1 0.3 0.5 0.9] [--png mjp_demo.png] ...
    mjp backends
    mjp bench [--smoke] [--cases sampler,patch_embed,jigsaw_apply,host_cost,train_step,kernels,train_loop]
        [--output DIR] ...

This module only parses arguments; the work is in :mod:`mjp_fast.demo`, :mod:`mjp_fast.backend` and, for
``bench``, the repository checkout's ``bench/run.py`` (the benchmarks, their results and their baselines live in
the repository, not in the installed package).

The subcommands name their outputs alike: ``--output DIR`` the folder a command writes into (train, eval, attack,
reproduce, bench), ``--json PATH`` its JSON results (eval, attack), ``--png PATH`` its picture (demo, attack). The
earlier spellings stay as aliases: ``demo --out``, ``attack --grid``, ``bench --out``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from mjp_fast import __version__
from mjp_fast import backend as backend_module
from mjp_fast._argtypes import COMPILE_MODES, fraction, positive_int, seed

EXTENSION_WARNING = "mjp_fast: the compiled extension"


class CommandParser(argparse.ArgumentParser):
    """The parser of one ``mjp`` subcommand: arguments it does not know are its error, shown with its usage.

    argparse hands a subcommand's unknown arguments back to the top-level parser, whose error would show ``mjp``'s
    usage line (``usage: mjp [-h] [--version] COMMAND ...``) instead of the subcommand's options. Options are taken
    by their whole names only: with argparse's prefix matching, ``mjp attack --out x.png`` (demo's earlier name for
    its picture) would quietly have meant ``--output x.png``, a folder.
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")  # exits with status 2, as argparse does
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    from mjp_fast.evaluate.cli import register as register_eval
    from mjp_fast.privacy.cli import register as register_attack
    from mjp_fast.reproduce.cli import register as register_reproduce
    from mjp_fast.train.cli import register as register_train

    parser = argparse.ArgumentParser(
        prog="mjp",
        description="Masked Jigsaw Puzzle position embeddings for ViTs: fast per-sample jigsaws.",
    )
    parser.add_argument("--version", action="version", version=f"mjp_fast {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)

    _add_demo(commands)
    commands.add_parser(
        "backends",
        help="list the available backends and whether the compiled extension loaded",
        description="Lists the backends that can run here, fastest first, and whether mjp_fast._C loaded.",
    )

    _add_bench(commands)
    register_attack(commands)
    register_train(commands)
    register_eval(commands)
    register_reproduce(commands)
    return parser


def _add_demo(commands: argparse._SubParsersAction) -> None:
    """``mjp demo``: its options."""
    from mjp_fast.demo import BUILTIN_IMAGES

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
        type=fraction,
        nargs="+",
        default=[0.1, 0.3, 0.5, 0.9],
        metavar="R",
        help="mask ratios in [0, 1], one panel each (default: %(default)s)",
    )
    demo.add_argument("--patch-size", type=positive_int, default=16, help="patch side in pixels (default: 16)")
    demo.add_argument(
        "--size",
        type=positive_int,
        default=224,
        help="image side in pixels, a multiple of --patch-size (default: 224)",
    )
    demo.add_argument("--seed", type=seed, default=0, help="the sampler's seed (default: 0)")
    demo.add_argument(
        "--png",
        "--out",  # its earlier name
        dest="png",
        default="mjp_demo.png",
        metavar="PATH",
        help="the PNG to write (default: %(default)s)",
    )
    demo.add_argument(
        "--backend",
        choices=backend_module.KNOWN_BACKENDS,
        default=None,
        help=f"sampler backend (default: ${backend_module.ENV_VARIABLE}, else the fastest available)",
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """``mjp bench``: the options of ``bench/run.py``, which it runs."""
    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite of a repository checkout; print tables, write JSON",
        description="Runs the benchmarks in the checkout's bench/ folder (run it from the repository root): "
        "sampler, patch embedding, applying the jigsaw, and whole training steps, each against baselines "
        "measured in the same run. Prints the tables and the pass/fail lines of the aims, and writes one JSON "
        "file <out>/<device>-<YYYY-MM-DD>.json; `python bench/render.py` turns the results into "
        "docs/benchmarks.md.",
    )
    bench.add_argument("--smoke", action="store_true", help="tiny sizes and 1-2 repeats: checks that it all runs")
    bench.add_argument(
        "--cases",
        default=None,
        metavar="CASE[,CASE...]",
        help="a comma-separated subset of sampler,patch_embed,jigsaw_apply,host_cost,train_step,kernels,train_loop "
        "(default: all)",
    )
    bench.add_argument(
        "--output",
        "--out",  # its earlier name, and the bench scripts' own
        dest="out",  # as bench/run.py's parser names it
        default=None,
        metavar="DIR",
        help="folder of the JSON results (default: <checkout>/bench/results; with --smoke: "
        "<system temp dir>/mjp_fast-bench-smoke-<uid>, so smoke runs leave the checkout alone)",
    )
    bench.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    bench.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: all cores)")
    bench.add_argument("--repeats", type=positive_int, default=None, help="override every case's repeat count")
    bench.add_argument(
        "--compile", dest="compile_model", action="store_true", help="torch.compile the training-step models"
    )
    bench.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile's mode with --compile (default: its own; reduce-overhead: CUDA graphs)",
    )


def bench_runner(roots: Sequence[Path] | None = None) -> ModuleType:
    """The checkout's ``bench.run`` module, found in the current directory or beside the installed package.

    The benchmarks stay in the repository (they compare against timm and the paper's pipeline, and write
    ``bench/results``); an editable install finds them beside the package, any install from the checkout's root.

    Raises:
        FileNotFoundError: no checkout with a ``bench/run.py`` in ``roots``.
    """
    if roots is None:
        roots = [Path.cwd(), Path(__file__).resolve().parent.parent]
    for root in roots:
        root = Path(root).resolve()
        if not ((root / "bench" / "run.py").is_file() and (root / "mjp_fast").is_dir()):
            continue
        loaded = sys.modules.get("bench")
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().parent.parent != root:
            continue  # another `bench` package is imported already: not ours
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        return importlib.import_module("bench.run")
    searched = ", ".join(str(Path(root)) for root in roots)
    raise FileNotFoundError(
        "mjp bench runs the benchmarks of a repository checkout (its bench/run.py), and found none in "
        f"{searched}: run it from the root of a mjp_fast checkout"
    )


def _run_bench(args: argparse.Namespace) -> int:
    try:
        runner = bench_runner()
    except FileNotFoundError as error:
        print(f"mjp bench: error: {error}", file=sys.stderr)
        return 2
    try:
        runner.run_suite(
            cases=args.cases,
            smoke=args.smoke,
            out_dir=args.out,  # None: bench/results, or for --smoke a folder in the temp directory
            device=args.device,
            threads=args.threads,
            repeats=args.repeats,
            compile_model=args.compile_model,
            compile_mode=args.compile_mode,
        )
    except ValueError as error:
        print(f"mjp bench: error: {error}", file=sys.stderr)
        return 2
    return 0


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
        if getattr(args, "handler", None) is not None:
            return args.handler(args)
        if args.command == "backends":
            return _print_backends()
        if args.command == "bench":
            return _run_bench(args)
        from mjp_fast.demo import run_demo

        try:
            return run_demo(args)
        except ValueError as error:
            print(f"mjp demo: error: {error}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
