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
from mjp_fast.evaluate.natural import NATURAL_SETS

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
  corruptions       a quick proxy, not ImageNet-C: top-1 error under nine ImageNet-C-style corruptions made on the
                    fly (--corruptions), per corruption and severity; with --baseline, each corruption's CE and the
                    mCE relative to the baseline; comparable between models measured here only
  ImageNet-C        --imagenet-c DIR: the benchmark itself, as released by Hendrycks & Dietterich (ICLR 2019;
                    Zenodo record 2235448, github.com/hendrycks/robustness): DIR/<corruption>/<severity 1-5>/
                    <wnid>/*.JPEG, 15 corruptions in 4 families (+ the 4 extra ones where present); top-1 error per
                    corruption and severity, CE normalized by AlexNet's errors and the mCE over the 15, the relative
                    mCE (the paper's Eq. 2, from the clean error), the unnormalized mean error over the 15 and over
                    the 15 + 4 extra (as the authors' test.py); with --baseline, the mean CE against the baseline
                    (baseline = 100: not the paper's relative mCE)
  CIFAR-10-C        --cifar10-c DIR: the same authors' CIFAR-10 release (Zenodo record 2535967): DIR/<corruption>.npy
                    (uint8 [50000, 32, 32, 3]: 5 severities x 10,000 test images) and DIR/labels.npy; the same table
                    for CIFAR-10 models, with the unnormalized mean corruption error over the 15 and over the 15 + 4
                    extra (no AlexNet reference for it) and with --baseline the mean CE against the baseline
  ImageNet-A        --imagenet-a DIR: Hendrycks, Zhao, Basart, Steinhardt, Song, "Natural Adversarial Examples"
                    (CVPR 2021; github.com/hendrycks/natural-adv-examples): DIR/<wnid>/*.jpg, 200 classes; top-1,
                    AURRA and the authors' RMS calibration error (calib_err: bins of 100 images, the last one left
                    out of the sum) from the max-softmax confidence
  ImageNet-R        --imagenet-r DIR: Hendrycks et al., "The Many Faces of Robustness" (ICCV 2021;
                    github.com/hendrycks/imagenet-r): DIR/<wnid>/*.jpg, 200 classes; top-1, and as the authors'
                    eval.py the top-1 on the --data validation images of the same classes (ImageNet-200) and the
                    drop from it
  ImageNet-O        --imagenet-o DIR: from "Natural Adversarial Examples" too (github.com/hendrycks/natural-adv-
                    examples): DIR/<wnid>/*.jpg, 2,000 images of classes outside ImageNet-1k, foldered by the
                    ImageNet-1k class a ResNet-50 mistook them for; AUPR, AUROC and FPR95 with them as positives,
                    the --data validation images of those 200 classes as negatives, anomaly score the negative
                    max-softmax (as the authors' eval_many_models.py computes them)
                    For all three the logits are restricted to the set's classes, mapped by WordNet id from the
                    folder names, as the authors' code does; the model needs those ImageNet-1k classes (a
                    1000-class model, or one trained on class folders named by WordNet id)
  partial sets      a benchmark that is not its whole release (ImageNet-C or CIFAR-10-C without some of the 15
                    corruptions, ImageNet-A/-R/-O with other classes than the published 200, fewer images than
                    released, --max-images) is measured and its rows marked "partial set" with what it lacks (JSON:
                    partial, missing_classes, missing_images, ...); --require-complete refuses it instead
  precision         the robustness benchmarks run in float32, as their authors evaluate, unless --amp names bf16
                    or fp16 (--amp auto's bf16 on CUDA is for the other passes; with --imagenet-c the clean pass is
                    float32 too: its error enters the relative mCE); the JSON's precision keys say which

Prints the results as tables (the robustness rows beside the paper's DeiT-S and DeiT-S + MJP) and writes them as
JSON (keys: top1, top5, consistency, diff_norm, pos_mae_1d, pos_mae_2d, position_regression, corruptions, mce,
mean_corruption_error (these three: the on-the-fly proxy), imagenet_c, cifar10_c, plots, ...).
"""

# what mjp eval measures on each of ImageNet-A, -R, -O (mjp_fast/evaluate/natural.py)
NATURAL_MEASURES = {
    "imagenet_a": "top-1, AURRA and the authors' RMS calibration error (%) over its 200 classes' logits",
    "imagenet_r": "top-1 (%) over its 200 classes' logits, and on the --data validation images of those classes "
    "(ImageNet-200) with the drop between them",
    "imagenet_o": "AUPR, AUROC and FPR95 (%) of its images among the --data validation images of its 200 classes, "
    "anomaly score the negative max-softmax over those classes' logits",
}


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
        help=f"on-the-fly corruptions to measure, a quick proxy (not ImageNet-C): all, a family "
        f"({', '.join(FAMILIES)}) or names ({', '.join(CORRUPTIONS)}) (default: none)",
    )
    parser.add_argument(
        "--severities",
        nargs="+",
        type=int,
        default=list(SEVERITIES),
        choices=SEVERITIES,
        metavar="S",
        help="severities of the on-the-fly corruptions, 1..5 (default: all five; --imagenet-c and --cifar10-c "
        "always measure all five)",
    )
    _add_robustness_arguments(parser)
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
        "--amp",
        choices=("auto", "none", "bf16", "fp16"),
        default="auto",
        help="autocast (default auto: bf16 on CUDA, except the robustness benchmarks, which run in float32 unless "
        "bf16 or fp16 is named)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bars (default: on a terminal; elsewhere one line per pass over the data; off: neither)",
    )
    parser.set_defaults(handler=run)
    return parser


def _add_robustness_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmarks as released (--imagenet-c, --cifar10-c, --imagenet-a/-r/-o), --baseline, --require-complete."""
    parser.add_argument(
        "--imagenet-c",
        metavar="DIR",
        help="ImageNet-C as released (Hendrycks & Dietterich, ICLR 2019; Zenodo): DIR/<corruption>/<severity 1-5>/"
        "<wnid>/*.JPEG; needs an ImageNet model",
    )
    parser.add_argument(
        "--cifar10-c",
        metavar="DIR",
        help="CIFAR-10-C as released (Hendrycks & Dietterich, ICLR 2019; Zenodo): DIR/<corruption>.npy and "
        "DIR/labels.npy; needs a model of CIFAR-10's ten classes",
    )
    parser.add_argument(
        "--baseline", metavar="PATH", help="baseline checkpoint: corruption errors relative to it give CE and mCE"
    )
    for info in NATURAL_SETS.values():
        parser.add_argument(
            info.option,
            metavar="DIR",
            help=f"{info.name} as its authors release it, unpacked: DIR/<WordNet id>/<image> ({info.source}); "
            f"{NATURAL_MEASURES[info.key]}".replace("%", "%%"),  # argparse formats help with %
        )
    parser.add_argument(
        "--require-complete",
        action="store_true",
        help="refuse (exit 2) a robustness set that is not its whole release: some of the 15 corruptions of "
        "--imagenet-c or --cifar10-c missing, other classes than the published 200 of --imagenet-a/-r/-o, fewer "
        "images than released (--max-images included); checked before any pass where the trees tell (default: "
        "measure it and mark its rows partial)",
    )


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
            imagenet_c=args.imagenet_c,
            cifar10_c=args.cifar10_c,
            # without a terminal's bar (a log file, CI), one line per pass: a corruption sweep runs for minutes
            log=None if progress or args.progress == "off" else _say,
            imagenet_a=args.imagenet_a,
            imagenet_r=args.imagenet_r,
            imagenet_o=args.imagenet_o,
            require_complete=args.require_complete,
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
