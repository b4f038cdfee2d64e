"""``mjp attack``: gradient-inversion attacks on a small ViT under the paper's privacy settings.

    mjp attack [--images DIR] [--ratio 0.5] [--output DIR] [--json PATH] [--markdown PATH] [--png PATH]
               [--attack april|optimization] [--steps 300] [--max-images N] [--seed 0] [--threads 1]
               [--compare] [--compare-ratios 0.03,0.1,0.27,0.5,0.75] [--prior-images DIR]

Attacks :class:`~mjp_fast.privacy.model.PrivacyViT` (64x64 input, patch 8, width 256, depth 4, 4 heads, 10
classes, freshly initialised from ``--seed``): with ``--attack april`` (default) its first block is in the attack
layout and the client's gradients are float64; with ``--attack optimization`` all blocks are standard pre-norm
blocks and the gradients float32. Prints the Markdown table and writes, into ``--output`` (default
``runs/attack-<date>-<time>``, as ``mjp train`` names its runs), ``attack.json`` (``{setting: {metric: mean}}``),
``attack.md`` (the table) and ``attack.png`` (the reconstructions); ``--json``, ``--markdown`` and ``--png`` put
one of them elsewhere (``--grid`` is ``--png``'s earlier name).

``--compare`` (analytic attack only) then measures APRIL beside the attacker who knows MJP
(:mod:`mjp_fast.privacy.comparison`) on the same model and images: every ratio of ``--compare-ratios``, per-sample
and batch-shared masks, with and without UNK, and FedSGD batches of 1, 2 and 4 images; it writes ``compare.md``,
``compare.json`` and ``compare.png`` (PSNR against the ratio) into ``--output``. The adaptive attacker's patch prior
is fitted on ``--prior-images`` (without it the attacker runs without a prior).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from mjp_fast._argtypes import fraction, positive_int, torch_seed

MODEL_CONFIG = {"img_size": 64, "patch_size": 8, "embed_dim": 256, "depth": 4, "num_heads": 4, "num_classes": 10}
OUTPUT_NAMES = {"json": "attack.json", "markdown": "attack.md", "png": "attack.png"}


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``attack`` to the ``mjp`` command; the parsed arguments carry ``handler`` (returns the exit status)."""
    parser = subparsers.add_parser(
        "attack",
        help="gradient-inversion attacks under the paper's privacy settings; table, JSON and image grid",
        description="Computes one client update per image and setting on a small ViT (64x64, patch 8, width "
        "256), attacks it, and reports MSE, PSNR, SSIM, FFT2D and LPIPS for the settings a (gradients of x vs x), "
        "b (gradients of jigsawed x~ with UNK vs x~), c (same gradients vs x) and the ablation shuffled without "
        "UNK (no_unk_b, no_unk_c).",
    )
    parser.add_argument(
        "--images", metavar="DIR", default=None, help="a folder of image files (default: scikit-image's sample photos)"
    )
    parser.add_argument("--ratio", type=fraction, default=0.5, help="the jigsaw ratio in [0, 1] (default: 0.5)")
    parser.add_argument(
        "--output",
        metavar="DIR",
        default=None,
        help="folder of attack.json, attack.md and attack.png (default: runs/attack-<date>-<time>)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="the JSON, {setting: {metric: mean}} (default: <output>/attack.json)",
    )
    parser.add_argument(
        "--markdown", metavar="PATH", default=None, help="the Markdown table (default: <output>/attack.md)"
    )
    parser.add_argument(
        "--png",
        "--grid",  # its earlier name
        dest="png",
        metavar="PATH",
        default=None,
        help="the PNG of the reconstructions (default: <output>/attack.png)",
    )
    parser.add_argument(
        "--attack",
        choices=("april", "optimization"),
        default="april",
        help="april: analytic, first block in attack layout (default); optimization: gradient matching on a "
        "standard ViT (slow: about 0.2 s per step per update on 2 CPU cores)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=300, help="Adam steps of the optimization attack (default: 300)"
    )
    parser.add_argument("--max-images", type=positive_int, default=None, help="attack at most this many images")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads while attacking (default: 1; the matrices are small, and on a busy machine more "
        "threads are much slower)",
    )
    parser.add_argument(
        "--seed", type=torch_seed, default=0, help="seed of the model's weights and the jigsaws (default: 0)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also measure APRIL beside the attacker who knows MJP over --compare-ratios, per-sample and shared "
        "masks, with and without UNK, and batches of 1, 2, 4 (writes compare.md, compare.json, compare.png)",
    )
    parser.add_argument(
        "--compare-ratios",
        type=_ratios,
        default=None,
        metavar="R,R,...",
        help="jigsaw ratios of --compare (default: 0.03,0.1,0.27,0.5,0.75)",
    )
    parser.add_argument(
        "--prior-images",
        metavar="DIR",
        default=None,
        help="a folder of images (not the attacked ones) whose patch statistics make the adaptive attacker's prior",
    )
    parser.set_defaults(handler=run_attack_command)
    return parser


def _ratios(text: str) -> tuple[float, ...]:
    values = tuple(fraction(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected ratios in [0, 1] separated by commas, got {text!r}")
    return values


def output_paths(args: argparse.Namespace) -> dict[str, Path]:
    """``{"json": ..., "markdown": ..., "png": ...}``: each file's own option, else its name in ``--output``
    (default ``runs/attack-<YYYYmmdd-HHMMSS>``, relative to the working folder, as ``mjp train``'s runs)."""
    output = args.output or str(Path("runs") / f"attack-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return {key: Path(getattr(args, key) or Path(output) / name) for key, name in OUTPUT_NAMES.items()}


def run_attack_command(args: argparse.Namespace) -> int:
    """Runs ``mjp attack`` with parsed arguments; returns the exit status (2: a bad argument or path)."""
    import torch

    from mjp_fast.privacy.april import april_attack
    from mjp_fast.privacy.lpips import LPIPSWeightsError, load_lpips_weights
    from mjp_fast.privacy.model import PrivacyViT
    from mjp_fast.privacy.optimization import optimization_attack
    from mjp_fast.privacy.report import markdown_table, save_grid, write_json
    from mjp_fast.privacy.settings import load_images, run_settings, setting_metrics, summarize

    if args.compare and args.attack != "april":
        print("mjp attack: error: --compare needs the analytic attack (--attack april)", file=sys.stderr)
        return 2
    try:
        names, images = load_images(args.images, MODEL_CONFIG["img_size"], args.max_images)
    except ValueError as error:
        print(f"mjp attack: error: {error}", file=sys.stderr)
        return 2
    paths = output_paths(args)
    if paths["png"].suffix.lower() != ".png":
        print(f"mjp attack: error: --png must be a .png path, got {str(paths['png'])!r}", file=sys.stderr)
        return 2
    try:
        load_lpips_weights()  # before the attacks: fail fast when the weights are missing
    except LPIPSWeightsError as error:
        print(f"mjp attack: error: {error}", file=sys.stderr)
        return 1
    try:
        for path in paths.values():  # before the attacks: a path that cannot be written fails at once
            path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(
            f"mjp attack: error: cannot make the folder {error.filename!r}: {error.strerror or error}", file=sys.stderr
        )
        return 2
    analytic = args.attack == "april"
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        model = PrivacyViT(**MODEL_CONFIG, attack_layout=analytic)
    if analytic:
        model = model.double()
        attack = april_attack
    else:

        def attack(victim, gradients):
            return optimization_attack(victim, gradients, tuple(images.shape[1:]), steps=args.steps).images

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        start = time.perf_counter()
        images = images.to(next(model.parameters()).dtype)
        attacks = run_settings(model, images, attack, ratio=args.ratio, seed=args.seed, names=names)
        attack_seconds = time.perf_counter() - start
        summary = summarize(setting_metrics(attacks))
    finally:
        torch.set_num_threads(threads)
    masked = sum(int(attack.mask.sum()) for attack in attacks) / len(attacks)
    title = (
        f"{args.attack} attack on {len(attacks)} images ({args.images or 'scikit-image sample photos'}), "
        f"64x64, patch 8, width 256; jigsaw ratio {args.ratio:g} ({masked:.1f} of {model.num_patches} patches "
        f"masked on average); seed {args.seed}"
    )
    table = markdown_table(summary, title=title)
    print(table, end="")
    print(
        f"attacks: {attack_seconds:.2f} s for {3 * len(attacks)} client updates (gradients and attack, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''})"
    )
    try:
        paths["markdown"].write_text(table)
        write_json(summary, paths["json"])
        save_grid(attacks, paths["png"], patch_size=model.patch_size)
    except OSError as error:
        print(f"mjp attack: error: cannot write {error.filename!r}: {error.strerror or error}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(f"wrote {path}")
    if args.compare:
        return _compare(args, model, images, names, paths["markdown"].parent)
    return 0


def _compare(args: argparse.Namespace, model, images, names, folder: Path) -> int:
    """``--compare``: APRIL beside the attacker who knows MJP; writes compare.md, compare.json, compare.png."""
    import torch

    from mjp_fast.privacy.adaptive import fit_patch_prior
    from mjp_fast.privacy.comparison import (
        COMPARISON_RATIOS,
        batch_comparison,
        compare_attacks,
        comparison_markdown,
        psnr_curve,
        write_comparison_json,
    )
    from mjp_fast.privacy.settings import load_images

    prior = None
    if args.prior_images is not None:
        try:
            _, prior_pictures = load_images(args.prior_images, MODEL_CONFIG["img_size"])
        except ValueError as error:
            print(f"mjp attack: error: --prior-images: {error}", file=sys.stderr)
            return 2
        prior = fit_patch_prior(prior_pictures, model.patch_size)
    labels = [index % MODEL_CONFIG["num_classes"] for index in range(images.shape[0])]
    ratios = args.compare_ratios or COMPARISON_RATIOS
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = compare_attacks(model, images, labels, prior=prior, ratios=ratios, seed=args.seed, say=print)
        batches = batch_comparison(model, images, labels, prior=prior, ratio=ratios[0], seed=args.seed)
    finally:
        torch.set_num_threads(threads)
    source = args.images or "scikit-image sample photos"
    prior_text = f"patch prior from {args.prior_images}" if prior is not None else "no patch prior"
    title = f"APRIL beside the attacker who knows MJP: {len(names)} images ({source}), 64x64, patch 8; {prior_text}"
    table = f"{title}\n\n" + comparison_markdown(result, batches)
    print(table, end="")
    outputs = {"markdown": folder / "compare.md", "json": folder / "compare.json", "png": folder / "compare.png"}
    try:
        outputs["markdown"].write_text(table)
        write_comparison_json({"comparison": result, "batches": batches}, outputs["json"])
        psnr_curve(result, outputs["png"], title=title)
    except OSError as error:
        print(f"mjp attack: error: cannot write {error.filename!r}: {error.strerror or error}", file=sys.stderr)
        return 2
    for path in outputs.values():
        print(f"wrote {path}")
    return 0
