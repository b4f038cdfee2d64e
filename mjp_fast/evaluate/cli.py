"""``mjp eval``: its arguments, the printed tables and the JSON file.

    mjp eval --checkpoint runs/x/mjp/last.pt     # writes runs/x/mjp/eval/eval.json and the plots beside it
    mjp eval --checkpoint runs/x/mjp/last.pt --data ../shared/data/cifar10 --output runs/x/mjp/eval-cifar \\
        --corruptions all --baseline runs/x/baseline/last.pt --json runs/x/mjp.json

Its outputs go into ``--output`` (default: ``eval/`` beside the checkpoint), ``--json`` puts the JSON elsewhere:
the same names as ``mjp attack``'s. Exit codes: 0 done; 2 a bad argument or path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mjp_fast._argtypes import fraction, non_negative_int, positive_int
from mjp_fast.evaluate.corruptions import CORRUPTIONS, FAMILIES, SEVERITIES

DESCRIPTION = """\
Evaluates a checkpoint of `mjp train` on a dataset and measures what the paper measures:

  top-1, top-5      accuracy (%) on the validation split
  consistency       % of images whose prediction is unchanged when the image is jigsawed at --ratio (paper: 0.5);
                    MJP models get the jigsaw with their unknown position embedding (their own protocol), plain
                    models the jigsawed image with their usual position embeddings; both see the same jigsaws
  diff-norm         mean L2 distance between the final features (class token after the last norm) of the image
                    and of its jigsawed copy
  position MAE      linear regression from each learned position embedding to its 1D index and to its (row, col),
                    5-fold cross-validation, mean absolute error in grid cells (supplementary Table 2)
  plots             PNGs of the position embeddings (PCA 2D and 3D, cosine similarity; UMAP with umap-learn) and
                    of the last layer's class-token attention
  corruptions       top-1 error under ImageNet-C-style corruptions made on the fly, per corruption and severity;
                    with --baseline, each corruption's CE and the mCE relative to the baseline checkpoint

Prints the results as tables and writes them as JSON (keys: top1, top5, consistency, diff_norm, pos_mae_1d,
pos_mae_2d, position_regression, corruptions, mce, mean_corruption_error, plots, ...).
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``eval`` command to the ``mjp`` parser."""
    parser = subparsers.add_parser(
        "eval",
        help="measure a checkpoint: top-1/5, consistency, diff-norm, position regression, plots, corruptions",
        description=DESCRIPTION,
        epilog="exit codes: 0 done; 2 bad argument or path.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help="a checkpoint of mjp train (last.pt)")
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="dataset root with a validation split <DIR>/<split>/<class>/* (default: the checkpoint's own data)",
    )
    parser.add_argument(
        "--split", default="auto", help="validation split folder under --data (default: auto = val, validation, test)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON (default: <output>/eval.json)")
    parser.add_argument(
        "--output",
        metavar="DIR",
        help="folder for eval.json and the plots (default: an eval/ folder beside the checkpoint)",
    )
    parser.add_argument(
        "--ratio", type=fraction, default=0.5, help="jigsaw ratio of consistency and diff-norm (default: 0.5)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the jigsaws and corruptions")
    parser.add_argument(
        "--jigsaw",
        choices=("auto", "unk", "pixel", "none"),
        default="auto",
        help="how the jigsawed image is fed: unk (MJP's unknown position embedding), pixel (the jigsawed image, "
        "usual position embeddings), auto (unk for MJP models, pixel otherwise), none (skip) (default: auto)",
    )
    parser.add_argument(
        "--corruptions",
        nargs="+",
        default=[],
        metavar="NAME",
        help=f"corruptions to measure: all, a family ({', '.join(FAMILIES)}) or names ({', '.join(CORRUPTIONS)}) "
        "(default: none)",
    )
    parser.add_argument(
        "--severities",
        nargs="+",
        type=int,
        default=list(SEVERITIES),
        choices=SEVERITIES,
        metavar="S",
        help="corruption severities, 1..5 (default: all five)",
    )
    parser.add_argument(
        "--baseline", metavar="PATH", help="baseline checkpoint: corruption errors relative to it give CE and mCE"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--attention-images", type=non_negative_int, default=4, help="images in the attention plot (default: 4)"
    )
    parser.add_argument("--folds", type=positive_int, default=5, help="cross-validation folds of position regression")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="images per batch (default: 128)")
    parser.add_argument("--workers", type=non_negative_int, default=None, help="data loader processes (default: auto)")
    parser.add_argument("--max-images", type=positive_int, default=None, help="evaluate a fixed subset of N images")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument(
        "--amp", choices=("auto", "none", "bf16", "fp16"), default="auto", help="autocast (default: bf16 on CUDA)"
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bars (default: on a terminal; elsewhere one line per pass over the data; off: neither)",
    )
    parser.set_defaults(handler=run)
    return parser


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from mjp_fast.evaluate.run import evaluate_checkpoint, results_table, write_json
    from mjp_fast.train.config import ConfigError

    output = Path(args.output) if args.output else Path(args.checkpoint).resolve().parent / "eval"
    progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    if args.folds < 2:
        print("mjp eval: error: --folds must be >= 2", file=sys.stderr)
        return 2
    try:
        results = evaluate_checkpoint(
            args.checkpoint,
            data=args.data,
            split=args.split,
            baseline=args.baseline,
            ratio=args.ratio,
            seed=args.seed,
            jigsaw=args.jigsaw,
            batch_size=args.batch_size,
            workers=args.workers,
            device=args.device,
            amp=args.amp,
            max_images=args.max_images,
            corruptions=args.corruptions,
            severities=args.severities,
            plots=None if args.no_plots else output,
            attention_images=args.attention_images,
            folds=args.folds,
            progress=progress,
            # without a terminal's bar (a log file, CI), one line per pass: a corruption sweep runs for minutes
            log=None if progress or args.progress == "off" else _say,
        )
        path = write_json(results, args.json or output / "eval.json")
    except ConfigError as error:
        print(f"mjp eval: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"mjp eval: error: {error.strerror or error}: {error.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    print(f"{args.checkpoint} ({results['model_name']}, {results['images']} images of {results['data']})\n")
    print(results_table(results))
    print(f"\nresults: {path}")
    return 0
