"""``mjp train``: its arguments, and the one-line errors and exit codes of a run.

    mjp train                                    # the embedded default: digits, baseline vs MJP, about 75 s on 2 CPUs
    mjp train --config deit_s.yaml --data /data/imagenet --output runs/deit_s_mjp
    mjp train --output runs/deit_s_mjp --resume   # continue a run where its last checkpoint left it
    torchrun --nproc_per_node=8 -m mjp_fast.cli train --config deit_s.yaml --data /data/imagenet

Exit codes: 0 done; 2 a bad argument, config value or path; 3 the loss became NaN or infinite; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mjp_fast.train.config import (
    PRESETS,
    ConfigError,
    TrainConfig,
    build_config,
    bundled_configs,
    help_table,
    load_config,
    parse_overrides,
    read_config_file,
    save_config,
)

EXIT_BAD_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

DESCRIPTION = """\
Trains a timm ViT with Masked Jigsaw Puzzle position embeddings (or the plain baseline) with the DeiT recipe of the
paper's supplementary: AdamW at lr 5e-4 x batch / 512, weight decay 0.05, cosine schedule with warm-up, label
smoothing 0.1, RandAugment rand-m9-mstd0.5-inc1, Mixup 0.8, CutMix 1.0, random erasing 0.25, repeated
augmentation, gradient clipping; MJP ratio 0.1 with per-sample probability 0.5 from the end of warm-up on, applied
after mixup; DAL weight 0.01 cosine-decayed to 0.005.

With no arguments at all it runs the embedded default (the 'digits' preset): scikit-learn's digits, no download, a
small ViT, a baseline and an MJP model trained one after the other, and their top-1, consistency and position
regression printed side by side (about 75 s on 2 CPU cores).

Configuration: the defaults below, then --config (a YAML file of key: value; a bundled recipe by name: deit_s,
deit_ti, vit_s for ImageNet-1K as in the paper, cifar10 for 32-pixel CIFAR-10; or the preset digits; an existing
file wins over a name), then --data/--output, then KEY=VALUE overrides. Without --config and --data, the digits
preset is the base. Every run writes config.yaml (the resolved config), metrics.jsonl (one record per epoch),
last.pt (the latest checkpoint, written atomically) and best.pt to its output folder.

Scale: run it under torchrun, one process per GPU (DDP; bf16 autocast on GPUs by default); batch_size is per process.
"""

EPILOG_HEAD = """\
exit codes: 0 done; 2 bad argument, config value or path; 3 NaN or infinite loss; 130 interrupted.

config keys (KEY=VALUE on the command line, KEY: VALUE in a YAML file; none for an empty value):
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``train`` command to the ``mjp`` parser."""
    parser = subparsers.add_parser(
        "train",
        help="train a ViT with MJP (no arguments: the embedded digits demo, baseline vs MJP)",
        description=DESCRIPTION,
        epilog=EPILOG_HEAD + help_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE|NAME",
        help=f"YAML config file, a bundled recipe ({', '.join(bundled_configs())}; NAME or NAME.yaml) or a preset "
        f"({', '.join(PRESETS)}); its keys override the defaults. An existing file wins over a name",
    )
    parser.add_argument("--data", metavar="DIR", help="dataset root: <DIR>/train/<class>/*, <DIR>/val/<class>/*")
    parser.add_argument("--output", metavar="DIR", help="output folder (default: runs/<dataset>-<date>-<time>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --output from its last checkpoint (same masks, data order and augmentations as "
        "an uninterrupted run); its config.yaml is the base config, KEY=VALUE can still override (e.g. epochs)",
    )
    parser.add_argument(
        "--resume-from", metavar="CHECKPOINT", help="continue from this checkpoint file (its config is the base)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the config that would run, as YAML, and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (keys below)")
    parser.set_defaults(handler=run)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config of the run the arguments ask for. Raises ConfigError."""
    overrides = parse_overrides(args.overrides)
    if args.data is not None:
        overrides["data"] = args.data
    if args.output is not None:
        overrides["output"] = args.output
    if args.resume or args.resume_from:
        if args.resume and args.resume_from:
            raise ConfigError("give either --resume (with --output) or --resume-from CHECKPOINT, not both")
        if args.resume_from:
            from mjp_fast.train.checkpoint import checkpoint_config, load_checkpoint

            base = checkpoint_config(load_checkpoint(args.resume_from))
            overrides.setdefault("output", str(Path(args.resume_from).parent))
        else:
            if args.output is None and "output" not in overrides:
                raise ConfigError("--resume needs --output DIR, the folder of the run to continue")
            saved = Path(overrides["output"]) / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"nothing to resume in {overrides['output']!r}: it has no config.yaml")
            base = build_config(read_config_file(saved))
        if args.config is not None:
            raise ConfigError("--config cannot be combined with --resume: the run's own config is used")
        return build_config(overrides, base)
    source = args.config
    if source is None and "data" not in overrides and "dataset" not in overrides:
        source = "digits"
    return load_config(source, **overrides)


def run(args: argparse.Namespace) -> int:
    """Runs ``mjp train``; returns the exit code."""
    from mjp_fast.train.outcome import TrainingDiverged, TrainingInterrupted
    from mjp_fast.train.preflight import check_run, say_notes, with_folder_problems

    resume = args.resume_from if args.resume_from else bool(args.resume)
    try:
        try:
            config = config_from_args(args)
        except ConfigError as error:
            # Bad values: the data and output folders' problems join them, so that one try shows every mistake.
            raise with_folder_problems(error, resume=resume) from None
        # Every check that needs no training (the values, the folders, the device, each model built on the meta
        # device), before the first step; a comparison checks both of its models in train_compare.
        if args.print_config:
            import tempfile

            config = check_run(config, resume=resume, environment=False)
            say_notes(config)
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "config.yaml"
                save_config(config, path)
                print(path.read_text(), end="")
            return 0
        if config.compare:
            from mjp_fast.train.compare import train_compare

            train_compare(config, resume=bool(resume))
        else:
            from mjp_fast.train.loop import train

            config = check_run(config, resume=resume)
            say_notes(config)
            train(config, resume=resume)
        return 0
    except ConfigError as error:
        print(f"mjp train: error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except TrainingDiverged as error:
        print(f"mjp train: error: {error}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt as interrupt:
        # a run says what its folder keeps and how to go on; before a run chose its folder there is nothing to say
        message = str(interrupt) if isinstance(interrupt, TrainingInterrupted) else "interrupted"
        print(f"mjp train: {message}", file=sys.stderr)
        return EXIT_INTERRUPTED
