"""The privacy part of the report: the analytic gradient-inversion attack (``mjp attack``'s machinery, APRIL) on
CIFAR test images, through the trained baseline (row A) and MJP (row J) models.

The analytic attack solves a linear system in the first-layer tokens (see :mod:`mjp_fast.privacy.april`). It
needs a first block whose qkv projection is the only consumer of the tokens (no pre-norm, no residual around
attention: :class:`~mjp_fast.privacy.model.PrivacyViT` with ``attack_layout=True``), and a token width of at least
the number of tokens (``D >= N + 1``) and of a patch's values (``D >= 3 P^2``).

- When the trained ViTs meet the width conditions, their weights are loaded into a ``PrivacyViT`` of the same
  shape whose first block is rewired to that layout (the attacker's condition; every weight is the trained one),
  and the attack runs on the CIFAR test images at the models' input size.
- Otherwise (the small models of the cpu and smoke presets) it runs, as ``mjp attack`` does, on a freshly
  initialised ``PrivacyViT`` wide enough for the tokens, at CIFAR's own 32 px with the trained models' patch size;
  the report says so and why.

Either way the client's gradients are float64, and each image is attacked through the plain update (setting a)
and the jigsawed updates with and without the UNK embedding (settings b, c, no_unk_b, no_unk_c).

Beside APRIL, the attacker who knows MJP (:mod:`mjp_fast.privacy.adaptive`, its patch prior fitted on training
images) is measured on the MJP model at the ratios of :data:`~mjp_fast.privacy.comparison.COMPARISON_RATIOS`, with
per-sample and batch-shared masks, with and without UNK, and on FedSGD batches of 1, 2 and 4 images
(:mod:`mjp_fast.privacy.comparison`); a PNG draws the PSNR against the ratio for both attackers.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from mjp_fast.privacy.adaptive import fit_patch_prior
from mjp_fast.privacy.april import april_attack
from mjp_fast.privacy.comparison import COMPARISON_RATIOS, batch_comparison, compare_attacks, psnr_curve
from mjp_fast.privacy.lpips import LPIPSWeightsError, load_lpips_weights
from mjp_fast.privacy.metrics import METRICS, reconstruction_metrics
from mjp_fast.privacy.model import PrivacyViT, client_gradients
from mjp_fast.privacy.report import save_grid
from mjp_fast.privacy.settings import run_settings, setting_metrics, square_picture, summarize
from mjp_fast.train.data import IMAGE_EXTENSIONS, resolve_split

ATTACK_HEADS = 4
PRIOR_IMAGES = 1000  # training images whose patches make the adaptive attacker's prior (100 per CIFAR class)
LPIPS_MIN_SIZE = 32  # AlexNet's pooling needs at least 32 pixels a side


def _image_files(data: str | Path, split: str) -> tuple[list[str], dict[str, list[Path]]]:
    split_dir = resolve_split(data, split, validation=True)
    classes = sorted(entry.name for entry in split_dir.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    files = {
        name: sorted(path for path in (split_dir / name).iterdir() if path.suffix.lower() in IMAGE_EXTENSIONS)
        for name in classes
    }
    if not any(files.values()):
        raise ValueError(f"data: no images in {str(split_dir)!r} to attack")
    return classes, files


def attack_images(data: str | Path, split: str, count: int, size: int) -> tuple[list[str], torch.Tensor, list[int]]:
    """``count`` images of the validation split, class by class in turn (image ``k`` is the ``k // C``-th file of
    class ``k mod C``, in sorted order), resized to ``size`` (a no-op at their own size).

    Returns:
        names (``class/file``), float64 ``[count, 3, size, size]`` in [0, 1], class indices.
    """
    classes, files = _image_files(data, split)
    names, pictures, labels = [], [], []
    for index in range(count * len(classes)):
        if len(names) == count:
            break
        label, within = index % len(classes), index // len(classes)
        if within >= len(files[classes[label]]):
            continue
        path = files[classes[label]][within]
        with Image.open(path) as picture:
            pictures.append(square_picture(picture, size))
        names.append(f"{classes[label]}/{path.name}")
        labels.append(label)
    return names, torch.stack(pictures), labels


def native_size(data: str | Path, split: str) -> int:
    """The shorter side of the first validation image (CIFAR: 32): the attack's image size when it cannot use the
    trained models' own."""
    _, files = _image_files(data, split)
    first = next(paths[0] for paths in files.values() if paths)
    with Image.open(first) as picture:
        return min(picture.size)


def trained_attack_model(model: nn.Module) -> tuple[PrivacyViT | None, str]:
    """A ``PrivacyViT`` in the attack layout holding a trained timm ViT's weights, or (None, why not).

    The first block's ``norm1`` is dropped and its attention loses its residual (the analytic attack's layout);
    the class token absorbs its position embedding (``PrivacyViT`` gives the class token no separate one);
    ``unk_embed`` is the model's own (an MJP model) or zeros (a plain one: only the jigsawed settings read it).
    """
    pos_embed = getattr(model, "pos_embed", None)
    embed = getattr(model, "patch_embed", None)
    proj = getattr(embed, "proj", None)
    blocks = getattr(model, "blocks", None)
    if not isinstance(pos_embed, torch.Tensor) or not isinstance(proj, nn.Conv2d) or blocks is None:
        return None, "the model is not a ViT with learned position embeddings and a Conv2d patch embedding"
    if getattr(model, "cls_token", None) is None or model.num_prefix_tokens != 1 or model.no_embed_class:
        return None, "the model's prefix tokens are not one class token with its own position embedding"
    if proj.kernel_size[0] != proj.kernel_size[1] or proj.stride != proj.kernel_size:
        return None, "the patch embedding is not square patches"
    rows, cols = (int(size) for size in embed.grid_size)
    if rows != cols:
        return None, f"the grid {rows}x{cols} is not square"
    dim, channels, patch = proj.out_channels, proj.in_channels, proj.kernel_size[0]
    tokens = rows * cols + 1
    if dim < tokens or dim < channels * patch * patch:
        return None, (
            f"the analytic attack needs a token width of at least the number of tokens and of a patch's values, and "
            f"the trained models, at {rows * patch} px in {patch}-pixel patches ({tokens} tokens: a {rows}x{cols} "
            f"grid and the class token; {channels * patch * patch} values a patch), are {dim} wide"
        )
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        parts = (getattr(block, "attn", None), getattr(mlp, "fc1", None), getattr(mlp, "fc2", None))
        if any(part is None for part in parts) or not isinstance(getattr(mlp, "act", None), nn.GELU):
            return None, "the blocks are not standard pre-norm ViT blocks (attention, GELU MLP)"
        if not all(isinstance(getattr(block, name, nn.Identity()), nn.Identity) for name in ("ls1", "ls2")):
            return None, "the blocks use layer scale, which PrivacyViT does not have"
    if getattr(model, "global_pool", "token") != "token" or not isinstance(
        getattr(model, "fc_norm", None), nn.Identity
    ):
        return None, "the head does not read the class token after the final norm"
    hidden = blocks[0].mlp.fc1.out_features
    victim = PrivacyViT(
        img_size=rows * patch,
        patch_size=patch,
        in_chans=channels,
        embed_dim=dim,
        depth=len(blocks),
        num_heads=blocks[0].attn.num_heads,
        mlp_ratio=hidden / dim,
        num_classes=model.head.out_features,
        attack_layout=True,
    )
    state = {
        "patch_embed.weight": proj.weight,
        "patch_embed.bias": proj.bias if proj.bias is not None else torch.zeros(dim),
        "cls_token": model.cls_token + pos_embed[:, :1],
        "pos_embed": pos_embed[:, 1:],
        "norm.weight": model.norm.weight,
        "norm.bias": model.norm.bias,
        "head.weight": model.head.weight,
        "head.bias": model.head.bias,
    }
    unk = getattr(getattr(model, "mjp", None), "unk_embed", None)
    state["unk_embed"] = unk.reshape(dim) if isinstance(unk, torch.Tensor) else torch.zeros(dim)
    for index, block in enumerate(blocks):
        prefix = f"blocks.{index}."
        names = {"attn.qkv": block.attn.qkv, "attn.proj": block.attn.proj, "norm2": block.norm2}
        names.update({"mlp.0": block.mlp.fc1, "mlp.2": block.mlp.fc2})
        if index > 0:
            names["norm1"] = block.norm1
        for name, module in names.items():
            state[prefix + name + ".weight"] = module.weight
            bias = module.bias if module.bias is not None else torch.zeros_like(module.weight[..., 0])
            state[prefix + name + ".bias"] = bias
    victim.load_state_dict({name: value.detach().cpu().float() for name, value in state.items()})
    return victim.double().eval(), ""


def fresh_attack_model(size: int, patch: int, num_classes: int, depth: int, seed: int) -> PrivacyViT:
    """A freshly initialised ``PrivacyViT`` (float64, attack layout) whose width fits the tokens: the smallest
    multiple of 16 that is at least ``N + 1`` and ``3 P^2``."""
    tokens = (size // patch) ** 2 + 1
    width = max(tokens, 3 * patch * patch)
    width = int(math.ceil(width / 16) * 16)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = PrivacyViT(
            img_size=size,
            patch_size=patch,
            embed_dim=width,
            depth=depth,
            num_heads=ATTACK_HEADS,
            num_classes=num_classes,
            attack_layout=True,
        )
    return model.double().eval()


def _blocks(count: int) -> str:
    return f"{count} block" if count == 1 else f"{count} blocks"


def _metrics_for(size: int) -> tuple[tuple[str, ...], str]:
    if size < LPIPS_MIN_SIZE:
        return tuple(m for m in METRICS if m != "lpips"), f"LPIPS left out: it needs {LPIPS_MIN_SIZE} px or more"
    try:
        load_lpips_weights()
    except LPIPSWeightsError as error:
        return tuple(m for m in METRICS if m != "lpips"), f"LPIPS left out: {str(error).splitlines()[0]}"
    return METRICS, ""


def run_attack(
    plain: nn.Module,
    mjp: nn.Module,
    *,
    data: str | Path,
    split: str,
    images: int,
    ratios: list[float],
    seed: int,
    fallback_depth: int,
    patch_size: int,
    grid_path: Path | None = None,
    comparison_ratios: tuple[float, ...] = COMPARISON_RATIOS,
    prior_split: str = "train",
    prior_images: int = PRIOR_IMAGES,
    curve_path: Path | None = None,
) -> dict[str, Any]:
    """Attacks ``images`` test images through ``plain`` (setting a) and ``mjp`` (settings b, c and the no-UNK
    ablation) at each jigsaw ratio of ``ratios``; returns the means, the per-image PSNRs and how it was set up.
    Then APRIL beside the attacker who knows MJP on the MJP model (``comparison``, ``batches``) at
    ``comparison_ratios`` (none: skipped), its patch prior fitted on ``prior_images`` images of ``prior_split``.

    ``grid_path``: where to write the PNG of the reconstructions of the MJP model at the first ratio.
    ``curve_path``: the PNG of the PSNR against the ratio (default: beside ``grid_path``, ``-psnr.png``).
    """
    start = time.perf_counter()
    plain_victim, reason_plain = trained_attack_model(plain)
    mjp_victim, reason_mjp = trained_attack_model(mjp)
    if plain_victim is not None and mjp_victim is not None and plain_victim.img_size == mjp_victim.img_size:
        mode, size = "trained", plain_victim.img_size
        description = (
            f"the trained A and J models ({plain_victim.pos_embed.shape[-1]} wide, {_blocks(len(plain_victim.blocks))}"
            f"), first block rewired to the attack layout, at their input size {size} px"
        )
    else:
        mode = "fresh"
        size = native_size(data, split)
        num_classes = plain.head.out_features if hasattr(plain, "head") else 10
        plain_victim = mjp_victim = fresh_attack_model(size, patch_size, num_classes, fallback_depth, seed)
        reason = reason_plain or reason_mjp or "the two models take different image sizes"
        description = (
            f"a freshly initialised PrivacyViT ({plain_victim.pos_embed.shape[-1]} wide for its "
            f"{plain_victim.num_patches + 1} tokens, {_blocks(fallback_depth)}, patch {patch_size}) at CIFAR's own "
            f"{size} px, not the trained models: {reason}"
        )
    return _run_on(
        plain_victim,
        mjp_victim,
        mode,
        description,
        data=data,
        split=split,
        images=images,
        ratios=ratios,
        seed=seed,
        grid_path=grid_path,
        comparison_ratios=comparison_ratios,
        prior_split=prior_split,
        prior_images=prior_images,
        curve_path=curve_path,
        start=start,
    )


def _run_on(
    plain_victim: PrivacyViT,
    mjp_victim: PrivacyViT,
    mode: str,
    description: str,
    *,
    data: str | Path,
    split: str,
    images: int,
    ratios: list[float],
    seed: int,
    grid_path: Path | None,
    comparison_ratios: tuple[float, ...],
    prior_split: str,
    prior_images: int,
    curve_path: Path | None,
    start: float,
) -> dict[str, Any]:
    """:func:`run_attack` once its attacked models are chosen."""
    size = mjp_victim.img_size
    names, pictures, labels = attack_images(data, split, images, size)
    metrics, metrics_note = _metrics_for(size)
    # One torch thread per two cores: the matrices are small, and on a busy 2-core machine two threads that
    # spin-wait for each other are many times slower than one (as `mjp attack`'s --threads 1 default).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, cores // 2)))
    try:
        results = _attack(plain_victim, mjp_victim, mode, pictures, labels, ratios, seed, metrics, grid_path)
        if comparison_ratios:
            if curve_path is None and grid_path is not None:
                curve_path = grid_path.with_name(grid_path.stem + "-psnr.png")
            results.update(
                _compare(
                    mjp_victim, pictures, labels, data, prior_split, prior_images, comparison_ratios, seed, metrics
                )
            )
            if curve_path is not None:
                psnr_curve(results["comparison"], curve_path, title=f"{len(names)} CIFAR test images, {size} px")
                results["curve"] = str(curve_path)
    finally:
        torch.set_num_threads(threads)
    results.update(
        mode=mode,
        description=description,
        image_size=size,
        patch_size=plain_victim.patch_size,
        width=int(plain_victim.pos_embed.shape[-1]),
        images=names,
        labels=labels,
        metrics=list(metrics),
        metrics_note=metrics_note,
        seconds=time.perf_counter() - start,
    )
    return results


def refresh_report(
    report_path: str | Path, *, data: str | Path | None = None, command: str | None = None
) -> dict[str, Any]:
    """Recomputes the privacy section of a written ``mjp reproduce`` report (and claim 5), keeping the rest.

    Only for a report whose attack ran on the freshly initialised model (the ``cpu`` and ``smoke`` presets): that
    model is rebuilt from the report's own record (image size, patch, width, depth, seed), so no trained checkpoint
    is needed. The JSON beside the report (``.json``) is read and both are rewritten.

    Args:
        report_path: the report's Markdown, e.g. ``docs/reproduction.md``.
        data: the dataset root (default: the one the report records).
        command: how the section says it was regenerated (default: this process's command line).

    Takes about 4 minutes for the ``cpu`` preset's 16 images on 2 shared CPU cores.

    Raises:
        ValueError: no attack section, or one that attacked the trained models.
    """
    import json
    import shlex
    import sys

    from mjp_fast.reproduce.report import attack_claim_of, write_report
    from mjp_fast.reproduce.variants import PRESETS

    report_path = Path(report_path)
    json_path = report_path.with_suffix(".json")
    report = json.loads(json_path.read_text())
    old = report.get("attack")
    if not old:
        raise ValueError(f"report_path: {str(json_path)!r} has no attack section to regenerate")
    if old["mode"] != "fresh":
        raise ValueError(
            "report_path: its attack ran on the trained models, whose checkpoints this cannot rebuild; run the "
            "report's own command again (mjp reproduce reuses its finished runs)"
        )
    start = time.perf_counter()
    preset = PRESETS[report["preset"]["name"]]
    data = data if data is not None else report["data"]["root"]
    split = report["preset"]["config"].get("val_split", "auto")
    seed = int(report["preset"]["seeds"][0])
    classes, _ = _image_files(data, split)
    victim = fresh_attack_model(old["image_size"], old["patch_size"], len(classes), preset.attack_depth, seed)
    if int(victim.pos_embed.shape[-1]) != old["width"]:
        raise ValueError(
            f"report_path: the rebuilt model is {victim.pos_embed.shape[-1]} wide, the report's {old['width']}"
        )
    grid_path = Path(report["paths"]["attack"]) if report["paths"].get("attack") else None
    attack = _run_on(
        victim,
        victim,
        "fresh",
        old["description"],
        data=data,
        split=split,
        images=len(old["images"]),
        ratios=[entry["ratio"] for entry in old["ratios"].values()],
        seed=seed,
        grid_path=grid_path,
        comparison_ratios=COMPARISON_RATIOS,
        prior_split=report["preset"]["config"].get("train_split", "train"),
        prior_images=PRIOR_IMAGES,
        curve_path=None,
        start=start,
    )
    attack["regenerated_by"] = command or shlex.join([Path(sys.executable).name, *sys.argv])
    report["attack"] = attack
    claim = attack_claim_of(attack, preset.bootstrap_samples)
    report["claims"] = [claim.__dict__ if entry["number"] == 5 else entry for entry in report["claims"]]
    write_report(report, report_path, json_path)
    return report


def _compare(victim, pictures, labels, data, prior_split, prior_images, ratios, seed, metrics) -> dict[str, Any]:
    """APRIL beside the attacker who knows MJP (:mod:`mjp_fast.privacy.comparison`) on ``victim``."""
    start = time.perf_counter()
    prior_names, prior_pictures, _ = attack_images(data, prior_split, prior_images, victim.img_size)
    prior = fit_patch_prior(prior_pictures, victim.patch_size)
    comparison = compare_attacks(victim, pictures, labels, prior=prior, ratios=ratios, seed=seed, metrics=metrics)
    batches = batch_comparison(victim, pictures, labels, prior=prior, ratio=ratios[0], seed=seed)
    return {
        "comparison": comparison,
        "batches": batches,
        "prior": {"split": prior_split, "images": len(prior_names)},
        "comparison_seconds": time.perf_counter() - start,
    }


def plain_attack(victim: PrivacyViT, pictures: torch.Tensor, labels: list[int], metrics: tuple[str, ...]):
    """Setting a alone (the plain update of each image, attacked and compared with the image): per-image metrics."""
    recovered = []
    for index in range(pictures.shape[0]):
        gradients = client_gradients(victim, pictures[index : index + 1], labels[index])
        recovered.append(april_attack(victim, gradients).detach().reshape(pictures.shape[1:]).double().cpu())
    return reconstruction_metrics(torch.stack(recovered), pictures.double(), metrics)


def _attack(plain_victim, mjp_victim, mode, pictures, labels, ratios, seed, metrics, grid_path) -> dict[str, Any]:
    results: dict[str, Any] = {"ratios": {}}
    plain_table = None
    for index, ratio in enumerate(ratios):
        attacks = run_settings(mjp_victim, pictures, april_attack, ratio=ratio, seed=seed, labels=labels)
        table = setting_metrics(attacks, metrics)
        if plain_table is None:
            # one model: its plain update came with the jigsawed ones; two: the plain model's own
            plain_table = table["a"] if mode == "fresh" else plain_attack(plain_victim, pictures, labels, metrics)
        summary = summarize(table)
        summary["a"] = summarize({"a": plain_table})["a"]
        masked = sum(int(attack.mask.sum()) for attack in attacks) / len(attacks)
        results["ratios"][f"{ratio:g}"] = {
            "ratio": ratio,
            "masked_patches": masked,
            "patches": mjp_victim.num_patches,
            "summary": summary,
            "psnr_a": plain_table["psnr"].tolist(),
            "psnr_c": table["c"]["psnr"].tolist(),
        }
        if index == 0 and grid_path is not None:
            save_grid(attacks, grid_path, patch_size=mjp_victim.patch_size)
            results["grid"] = str(grid_path)
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m mjp_fast.reproduce.attack --report docs/reproduction.md [--data DIR]``: :func:`refresh_report`."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(
        prog="python -m mjp_fast.reproduce.attack",
        description="Recomputes the privacy section (APRIL and the attacker who knows MJP) and claim 5 of a written "
        "mjp reproduce report whose attack ran on the freshly initialised model; the rest of the report is kept.",
    )
    parser.add_argument("--report", required=True, metavar="PATH", help="the report's Markdown (its JSON beside it)")
    parser.add_argument("--data", default=None, metavar="DIR", help="the dataset root (default: the report's own)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "mjp_fast.reproduce.attack", *argv])
    try:
        report = refresh_report(args.report, data=args.data, command=command)
    except (OSError, ValueError, KeyError) as error:
        print(f"python -m mjp_fast.reproduce.attack: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.report} and its JSON ({report['attack']['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
