"""``mjp reproduce``: its arguments, and the one-line errors and exit codes.

    mjp reproduce --preset smoke --data ../shared/data/cifar10              # seconds: the whole pipeline, for CI
    mjp reproduce --preset cpu --data ../shared/data/cifar10                # about 45 minutes on 2 CPU cores
    mjp reproduce --preset gpu --data ../shared/data/cifar10                # about 8 minutes on one H100/H200
    mjp reproduce --preset cpu --data DIR --seeds 0,1,2 --rows A,G,J epochs=8
    mjp reproduce --preset cpu --data ../shared/data/cifar10 --report docs/reproduction.md   # the committed report
    mjp reproduce --preset cpu --data ../shared/data/cifar10 --cifar10-c /data/CIFAR-10-C   # + each run's CIFAR-10-C

The report goes to the --output folder (runs/reproduce-PRESET/reproduction.md) unless --report names another .md:
a run from the repository never overwrites the committed docs/reproduction.md by default.

Exit codes: 0 done; 2 a bad argument, config value or path; 3 a run's loss became NaN or infinite; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mjp_fast.reproduce.variants import PRESETS, ROWS, SWEEP_RATIOS

EXIT_BAD_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

DESCRIPTION = """\
Trains the paper's variants side by side on an ImageFolder dataset and writes one report: Markdown (default
<output>/reproduction.md, e.g. runs/reproduce-cpu/reproduction.md; --report docs/reproduction.md to replace the
committed one), its JSON beside it, a PNG of the position-embedding similarity per variant and a PNG of the attack's
reconstructions.

Variants, each a plain `mjp train` config (the paper's numbers: DeiT-S, ImageNet-1K):
{variants}
  sweep  J at mask ratios {ratios} (mjp_ratio=R)

Presets:
{presets}

The report judges five claims (MJP keeps accuracy; the naive shuffle costs accuracy; consistency and diff-norm
improve with the ratio; position embeddings still regress to positions; the analytic gradient attack recovers the
input through the plain model, not through the MJP model), each "agrees", "disagrees" or "inside the noise" with
its numbers. Finished runs are kept under --output and reused when the same command runs again (an interrupted
run resumes from its checkpoint).
"""


def _text(value: object) -> str:
    """A config value as it is typed on the command line: true, 0.03."""
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


DESCRIPTION = DESCRIPTION.format(
    variants="\n".join(
        f"  {key}  {variant.title}: {' '.join(f'{name}={_text(value)}' for name, value in variant.overrides.items())}"
        for key, variant in ROWS.items()
    ),
    ratios=", ".join(f"{ratio:g}" for ratio in SWEEP_RATIOS),
    presets="\n".join(f"  {name}: {preset.summary}" for name, preset in PRESETS.items()),
)


def _letters(text: str) -> tuple[str, ...]:
    letters = tuple(part.strip().upper() for part in text.split(",") if part.strip())
    unknown = [letter for letter in letters if letter not in ROWS]
    if not letters or unknown:
        raise argparse.ArgumentTypeError(f"expected row letters among {', '.join(ROWS)}, got {text!r}")
    return letters


def _ratios(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        ratios = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ratios in [0, 1] or none, got {text!r}") from None
    if any(not 0.0 <= ratio <= 1.0 for ratio in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be in [0, 1], got {text!r}")
    return ratios


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer seeds like 0,1, got {text!r}") from None
    if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds >= 0 like 0,1, got {text!r}")
    return seeds


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``reproduce`` to the ``mjp`` command; the parsed arguments carry ``handler`` (returns the exit status)."""
    parser = subparsers.add_parser(
        "reproduce",
        help="train the paper's variants side by side and write a report of its claims (Markdown, JSON, PNGs)",
        description=DESCRIPTION,
        epilog="exit codes: 0 done; 2 bad argument, config value or path; 3 NaN or infinite loss; 130 interrupted.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", required=True, choices=tuple(PRESETS), help="what to run (see above)")
    parser.add_argument(
        "--data", required=True, metavar="DIR", help="ImageFolder root: DIR/train/<class>/*, DIR/test|val/<class>/*"
    )
    parser.add_argument(
        "--output", metavar="DIR", help="folder of the runs' checkpoints and records (default: runs/reproduce-PRESET)"
    )
    parser.add_argument(
        "--report",
        metavar="PATH",
        help="the Markdown report, a .md file; the JSON and PNGs go beside it (default: <output>/reproduction.md; "
        "--report docs/reproduction.md replaces the committed report)",
    )
    parser.add_argument(
        "--seeds",
        type=_seeds,
        metavar="S[,S...]",
        help="seeds of rows A and J, which the claims rest on; every other run uses the first (default: the "
        "preset's: 0,1 for cpu and gpu, 0 for smoke)",
    )
    parser.add_argument("--rows", type=_letters, metavar="A,B,...", help="train these rows instead of the preset's")
    parser.add_argument(
        "--sweep", type=_ratios, metavar="R[,R...]|none", help="sweep J at these ratios instead of the preset's"
    )
    parser.add_argument(
        "--cifar10-c",
        metavar="DIR",
        help="also measure every run on CIFAR-10-C as released (Hendrycks & Dietterich, ICLR 2019; Zenodo): "
        "DIR/<corruption>.npy and DIR/labels.npy; the report gives each variant's mean corruption error and its mCE "
        "relative to row A (95 more passes over the test set's size per run)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="mjp train config overrides applied to every run"
    )
    parser.set_defaults(handler=run)
    return parser


def default_report(runs_dir: Path) -> Path:
    """Where the report goes without --report: ``<runs_dir>/reproduction.md``, beside the runs it was made from."""
    return runs_dir / "reproduction.md"


def _command_line(args: argparse.Namespace) -> str:
    """The command as parsed, for the report: ``mjp reproduce --preset cpu --data DIR ...``."""
    import shlex

    parts = ["mjp", "reproduce", "--preset", args.preset, "--data", args.data]
    for option, value in (("--output", args.output), ("--report", args.report), ("--cifar10-c", args.cifar10_c)):
        if value:
            parts += [option, value]
    if args.seeds is not None:
        parts += ["--seeds", ",".join(map(str, args.seeds))]
    if args.rows is not None:
        parts += ["--rows", ",".join(args.rows)]
    if args.sweep is not None:
        parts += ["--sweep", ",".join(f"{ratio:g}" for ratio in args.sweep) or "none"]
    return shlex.join(parts + list(args.overrides))


def run(args: argparse.Namespace) -> int:
    """Runs ``mjp reproduce``; returns the exit code."""
    from mjp_fast.reproduce.run import parse_override_values, plan_runs, reproduce
    from mjp_fast.reproduce.variants import get_preset
    from mjp_fast.train.config import ConfigError
    from mjp_fast.train.outcome import TrainingDiverged

    try:
        preset = get_preset(args.preset)
        runs_dir = Path(args.output) if args.output else Path("runs") / f"reproduce-{preset.name}"
        # beside the runs: the committed docs/reproduction.md is replaced only when --report names it
        report = Path(args.report) if args.report else default_report(runs_dir)
        if report.suffix.lower() != ".md":
            raise ConfigError(f"--report must name a .md file, got {str(report)!r}")
        overrides = parse_override_values(args.overrides)
        plan = plan_runs(
            preset, data=args.data, runs_dir=runs_dir, overrides=overrides, seeds=args.seeds, rows=args.rows,
            sweep=args.sweep, cifar10_c=args.cifar10_c,
        )  # fmt: skip
        reproduce(plan, report_path=report, command=_command_line(args))
        return 0
    except (ConfigError, ValueError) as error:
        print(f"mjp reproduce: error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except TrainingDiverged as error:
        print(f"mjp reproduce: error: {error}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print(
            "mjp reproduce: interrupted; finished runs are kept: the same command continues where it stopped",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
