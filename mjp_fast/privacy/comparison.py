"""APRIL beside the MJP-aware attack (:mod:`~mjp_fast.privacy.adaptive`): the measurements and their report.

One batch-1 client update per image, float64 gradients, on an MJP model; every reconstruction is compared with the
original image ``x`` (the paper's setting c, and ``no_unk_c`` for the ablation without UNK):

- per jigsaw ratio (:data:`COMPARISON_RATIOS`) and per mask mode: ``per_sample`` (every image its own jigsaw, as
  :func:`mjp_fast.sample_jigsaw` draws them) and ``shared`` (one jigsaw for all the images, as the paper's code
  jigsaws a whole batch);
- the update with UNK (``unk``) and without (``no_unk``: the shuffled image embedded with ``pos_embed`` everywhere);
- per attacker (:data:`ATTACKERS`): ``april`` as published, ``adaptive`` with the training set's patch prior (and,
  without UNK, the jigsaw solver told the ratio);
- MSE, PSNR, SSIM, FFT2D, LPIPS over the whole image, and the PSNR over the visible patches and over the masked
  positions' content apart;
- and the plain update (setting a) for both attackers, and batches above one (:func:`batch_comparison`).

Means come with 95% t intervals over the images (:func:`mean_interval`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mjp_fast.privacy.adaptive import PatchPrior, adaptive_attack
from mjp_fast.privacy.april import april_attack
from mjp_fast.privacy.jigsaw_solver import image_patches
from mjp_fast.privacy.metrics import METRICS, PSNR_MSE_FLOOR, reconstruction_metrics
from mjp_fast.privacy.model import PrivacyViT, client_gradients
from mjp_fast.sampler import Jigsaw, sample_jigsaw

COMPARISON_RATIOS = (0.03, 0.1, 0.27, 0.5, 0.75)
ATTACKERS = ("april", "adaptive")
MASK_MODES = ("per_sample", "shared")
UPDATES = ("unk", "no_unk")
BATCH_SIZES = (1, 2, 4)
ATTACKER_TITLES = {"april": "APRIL (as published)", "adaptive": "adaptive (knows MJP)"}
MODE_TITLES = {"per_sample": "per-sample masks", "shared": "batch-shared mask"}
UPDATE_TITLES = {"unk": "with UNK", "no_unk": "without UNK"}


def region_psnr(
    recovered: torch.Tensor, references: torch.Tensor, mask: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PSNR (dB, data range 1) over the visible patches and over the masked positions, per image.

    Args:
        recovered: ``[B, C, H, W]``, clipped to [0, 1] here.
        references: ``[B, C, H, W]`` in [0, 1].
        mask: bool ``[B, N]``, the masked positions.
        patch_size: P.

    Returns:
        ``(visible [B], masked [B])`` float64; NaN where an image has no position of that kind.
    """
    if recovered.shape != references.shape or recovered.dim() != 4:
        raise ValueError(
            f"recovered and references must be [B, C, H, W] alike, got {recovered.shape}, {references.shape}"
        )
    if mask.shape[0] != recovered.shape[0]:
        raise ValueError(f"mask must be [B, N] with B = {recovered.shape[0]}, got {list(mask.shape)}")
    visible, masked = [], []
    for image, reference, positions in zip(recovered.double().clamp(0, 1), references.double(), mask, strict=True):
        error = (image_patches(image, patch_size) - image_patches(reference, patch_size)).square().flatten(1)
        for selected, out in ((~positions, visible), (positions, masked)):
            if bool(selected.any()):
                out.append(-10 * math.log10(max(float(error[selected].mean()), PSNR_MSE_FLOOR)))
            else:
                out.append(math.nan)
    return torch.tensor(visible, dtype=torch.float64), torch.tensor(masked, dtype=torch.float64)


def mean_interval(values: Sequence[float | None], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of the finite ``values`` and its t interval (NaNs when none are finite)."""
    from scipy import stats

    # None: a NaN that went through JSON (an image with no masked position has no masked-content PSNR)
    finite = np.asarray([value for value in values if value is not None and math.isfinite(value)], dtype=np.float64)
    if finite.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(finite.mean())
    if finite.size == 1:
        return mean, mean, mean
    half = float(stats.t.ppf((1 + confidence) / 2, finite.size - 1) * finite.std(ddof=1) / math.sqrt(finite.size))
    return mean, mean - half, mean + half


def batch_gradients(
    model: PrivacyViT,
    images: torch.Tensor,
    labels: Sequence[int],
    jigsaw: Jigsaw | None = None,
    *,
    use_unk: bool = True,
) -> dict[str, torch.Tensor]:
    """The gradients of the mean cross-entropy over a batch ``[B, C, H, W]`` (a FedSGD client's update)."""
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    first = next(iter(parameters.values()))
    images = images.to(device=first.device, dtype=first.dtype)
    target = torch.as_tensor(list(labels), device=first.device).long()
    logits = model(images) if jigsaw is None else model(images, jigsaw, use_unk=use_unk)
    grads = torch.autograd.grad(F.cross_entropy(logits, target), list(parameters.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(parameters.items(), grads, strict=True)}


def _attackers(prior: PatchPrior | None, unshuffle_ratio: float | None) -> dict[str, Callable]:
    return {"april": april_attack, "adaptive": partial(adaptive_attack, prior=prior, unshuffle_ratio=unshuffle_ratio)}


def _measure(
    recovered: torch.Tensor, originals: torch.Tensor, mask: torch.Tensor, patch: int, metrics: tuple[str, ...]
) -> dict[str, list[float]]:
    values = {name: tensor.tolist() for name, tensor in reconstruction_metrics(recovered, originals, metrics).items()}
    visible, masked = region_psnr(recovered, originals, mask, patch)
    values.update(psnr_visible=visible.tolist(), psnr_masked=masked.tolist())
    return values


def compare_attacks(
    model: PrivacyViT,
    images: torch.Tensor,
    labels: Sequence[int],
    *,
    prior: PatchPrior | None,
    ratios: Sequence[float] = COMPARISON_RATIOS,
    modes: Sequence[str] = MASK_MODES,
    seed: int = 0,
    metrics: tuple[str, ...] = METRICS,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both attackers on every image's update at every ratio, mask mode, with and without UNK (module docstring).

    Args:
        model: the client's MJP model (float64 for the analytic attacks).
        images: ``[B, C, H, W]`` in [0, 1]; labels: one class per image.
        prior: the adaptive attacker's patch prior (:func:`~mjp_fast.privacy.adaptive.fit_patch_prior`).
        ratios, modes: what to sweep.
        seed: the jigsaws' seed (image ``i`` uses stream ``i``; ``shared``: stream 0 for all).

    Returns:
        ``{"plain": {attacker: {metric: [B]}}, "ratios": {"0.03": {"ratio", "modes": {mode: {"masked_patches",
        "unk" | "no_unk": {attacker: {metric: [B]}}}}}}, "seconds"}``; metrics include ``psnr_visible`` and
        ``psnr_masked``. With a prior, ``"blind": {metric: [B]}``: its mean patch everywhere, the guess of an
        attacker who reads no gradient.
    """
    unknown = [mode for mode in modes if mode not in MASK_MODES]
    if unknown:
        raise ValueError(f"modes must be among {list(MASK_MODES)}, got {unknown}")
    start = time.perf_counter()
    count, patch = images.shape[0], model.patch_size
    labels = list(labels)
    if len(labels) != count:
        raise ValueError(f"labels must have one entry per image ({count}), got {len(labels)}")
    images = images.to(next(model.parameters()).dtype)
    originals = images.double().cpu()
    no_mask = torch.zeros(count, model.num_patches, dtype=torch.bool)
    plain = {name: [] for name in ATTACKERS}
    for index in range(count):
        gradients = client_gradients(model, images[index : index + 1], labels[index])
        for name, attack in _attackers(prior, None).items():
            plain[name].append(attack(model, gradients).detach().double().cpu()[0])
    result: dict[str, Any] = {
        "plain": {
            name: _measure(torch.stack(recs), originals, no_mask, patch, metrics) for name, recs in plain.items()
        },
        "ratios": {},
    }
    if prior is not None:
        # what the prior alone gives, without any gradient: its mean patch at every position
        channels = images.shape[1]
        guess = prior.mean.double().reshape(channels, patch, patch).repeat(1, model.grid_size, model.grid_size)
        result["blind"] = _measure(guess.expand_as(originals).contiguous(), originals, no_mask, patch, metrics)
    for ratio in ratios:
        entry: dict[str, Any] = {"ratio": float(ratio), "modes": {}}
        for mode in modes:
            jigsaw = sample_jigsaw(count, model.grid_size, ratio, seed=seed, shared=mode == "shared")
            by_update: dict[str, Any] = {"masked_patches": float(jigsaw.mask.sum(1).double().mean())}
            for update in UPDATES:
                attackers = _attackers(prior, ratio if update == "no_unk" else None)
                recovered: dict[str, list[torch.Tensor]] = {name: [] for name in attackers}
                for index in range(count):
                    single = Jigsaw(jigsaw.mask[index : index + 1], jigsaw.perm[index : index + 1])
                    image = images[index : index + 1]
                    gradients = client_gradients(model, image, labels[index], single, use_unk=update == "unk")
                    for name, attack in attackers.items():
                        recovered[name].append(attack(model, gradients).detach().double().cpu()[0])
                by_update[update] = {
                    name: _measure(torch.stack(recs), originals, jigsaw.mask.cpu(), patch, metrics)
                    for name, recs in recovered.items()
                }
            entry["modes"][mode] = by_update
            if say is not None:
                psnr = {n: mean_interval(by_update["unk"][n]["psnr"])[0] for n in ATTACKERS}
                say(
                    f"ratio {ratio:g}, {MODE_TITLES[mode]}: PSNR with UNK, APRIL {psnr['april']:.2f} dB, adaptive "
                    f"{psnr['adaptive']:.2f} dB"
                )
        result["ratios"][f"{ratio:g}"] = entry
    result["seconds"] = time.perf_counter() - start
    return result


def batch_comparison(
    model: PrivacyViT,
    images: torch.Tensor,
    labels: Sequence[int],
    *,
    prior: PatchPrior | None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    ratio: float = 0.03,
    seed: int = 0,
) -> dict[str, Any]:
    """Both attackers on FedSGD updates of ``b`` images at once (the images in consecutive groups of ``b``).

    The attacks assume one image: each returns one reconstruction per update, scored by its PSNR against the
    batch image it matches best (the attacker's most favourable reading). Per batch size: the plain model's update
    and the MJP update with UNK under per-sample and batch-shared masks.

    Returns:
        ``{"ratio", "sizes": {"2": {"plain" | "per_sample" | "shared": {attacker: [best PSNR per group]}}}}``.
    """
    images = images.to(next(model.parameters()).dtype)
    labels = list(labels)
    out: dict[str, Any] = {"ratio": float(ratio), "sizes": {}}
    for size in batch_sizes:
        if size < 1:
            raise ValueError(f"batch_sizes must be >= 1, got {size}")
        groups = [range(start, start + size) for start in range(0, images.shape[0] - size + 1, size)]
        by_kind: dict[str, dict[str, list[float]]] = {}
        for kind in ("plain", *MASK_MODES):
            scores: dict[str, list[float]] = {name: [] for name in ATTACKERS}
            for group in groups:
                batch = images[group.start : group.stop]
                jigsaw = None
                if kind != "plain":
                    # a fresh stream per group: offset = the group's first image
                    jigsaw = sample_jigsaw(
                        size, model.grid_size, ratio, seed=seed, offset=group.start, shared=kind == "shared"
                    )
                gradients = batch_gradients(model, batch, [labels[i] for i in group], jigsaw)
                for name, attack in _attackers(prior, None).items():
                    recovered = attack(model, gradients).detach().double().cpu().clamp(0, 1)
                    errors = (batch.double().cpu() - recovered).square().flatten(1).mean(1)
                    scores[name].append(-10 * math.log10(max(float(errors.min()), PSNR_MSE_FLOOR)))
            by_kind[kind] = scores
        out["sizes"][str(size)] = by_kind
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_comparison_json(data: Mapping[str, Any], path: str | Path) -> Path:
    """Writes the comparison's data as JSON, NaN as null (an image with no masked position has no masked PSNR)."""
    path = Path(path)
    path.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")
    return path


def _cell(values: Sequence[float], digits: int = 2) -> str:
    mean, low, high = mean_interval(values)
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def comparison_markdown(result: Mapping[str, Any], batches: Mapping[str, Any] | None = None) -> str:
    """The side-by-side tables: PSNR (whole, visible, masked) with 95% intervals, and the other metrics' means."""
    lines = [
        "PSNR in dB against the original image x, mean [95% t interval] over the images; higher means the attack "
        "recovers more (less privacy).",
        "",
        "| ratio | masks | update | attacker | masked patches | PSNR | PSNR visible | PSNR masked | MSE | SSIM | FFT2D "
        "| LPIPS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ATTACKERS:
        values = result["plain"][name]
        lines.append(
            f"| 0 | - | plain model | {ATTACKER_TITLES[name]} | 0 | {_cell(values['psnr'])} | "
            f"{_cell(values['psnr_visible'])} | - | "
            + " | ".join(_mean(values, m) for m in METRICS if m != "psnr")
            + " |"
        )
    if result.get("blind"):
        values = result["blind"]
        lines.append(
            f"| - | - | no gradient | the prior's mean patch everywhere | - | {_cell(values['psnr'])} | - | - | "
            + " | ".join(_mean(values, m) for m in METRICS if m != "psnr")
            + " |"
        )
    for entry in result["ratios"].values():
        for mode, by_update in entry["modes"].items():
            for update in UPDATES:
                for name in ATTACKERS:
                    values = by_update[update][name]
                    cells = [
                        f"{entry['ratio']:g}",
                        MODE_TITLES[mode],
                        UPDATE_TITLES[update],
                        ATTACKER_TITLES[name],
                        f"{by_update['masked_patches']:.1f}",
                        *(_cell(values[key]) for key in ("psnr", "psnr_visible", "psnr_masked")),
                        *(_mean(values, m) for m in METRICS if m != "psnr"),
                    ]
                    lines.append("| " + " | ".join(cells) + " |")
    if batches:
        lines += [
            "",
            f"Batches (FedSGD, mean loss over b images; MJP updates with UNK at ratio {batches['ratio']:g}): PSNR of "
            "the one reconstruction against the batch image it matches best, mean [95% t interval] over the batches.",
            "",
            "| b | update | " + " | ".join(ATTACKER_TITLES[name] for name in ATTACKERS) + " |",
            "|---|---|" + "---|" * len(ATTACKERS),
        ]
        for size, by_kind in batches["sizes"].items():
            for kind, scores in by_kind.items():
                title = "plain model" if kind == "plain" else MODE_TITLES[kind]
                lines.append(f"| {size} | {title} | " + " | ".join(_cell(scores[name]) for name in ATTACKERS) + " |")
    return "\n".join(lines) + "\n"


def _mean(values: Mapping[str, Sequence[float]], metric: str) -> str:
    if metric not in values:
        return "-"
    mean = mean_interval(values[metric])[0]
    return "-" if math.isnan(mean) else f"{mean:.4f}"


def psnr_curve(result: Mapping[str, Any], path: str | Path, *, title: str = "") -> Path:
    """A PNG of the PSNR against the jigsaw ratio: one line per attacker and mask mode, with UNK (solid) and without
    (dashed), the 95% intervals shaded, and the plain model's PSNR as a dotted line per attacker."""
    from mjp_fast.evaluate.plots import _pyplot

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(10, 4.8), dpi=100)
    colors = {"april": "tab:red", "adaptive": "tab:blue"}
    markers = {"per_sample": "o", "shared": "s"}
    entries = list(result["ratios"].values())
    ratios = [entry["ratio"] for entry in entries]
    top = 0.0
    for name in ATTACKERS:
        for mode in MASK_MODES:
            if not all(mode in entry["modes"] for entry in entries):
                continue
            for update, style in (("unk", "-"), ("no_unk", "--")):
                stats = np.array([mean_interval(entry["modes"][mode][update][name]["psnr"]) for entry in entries])
                label = f"{ATTACKER_TITLES[name]}, {MODE_TITLES[mode]}, {UPDATE_TITLES[update]}"
                axis.plot(ratios, stats[:, 0], style, marker=markers[mode], color=colors[name], label=label, lw=1.2)
                axis.fill_between(ratios, stats[:, 1], stats[:, 2], color=colors[name], alpha=0.08)
                top = max(top, float(np.nanmax(stats[:, 2])))
    if result.get("blind"):
        blind = mean_interval(result["blind"]["psnr"])[0]
        axis.axhline(blind, color="gray", ls="-.", lw=1, label=f"no gradient: the prior's mean patch ({blind:.1f} dB)")
    # the plain update's exact recovery (80-140 dB) would flatten the curves: said in the legend, off the chart
    for name in ATTACKERS:
        plain = mean_interval(result["plain"][name]["psnr"])[0]
        axis.plot([], [], ":", color=colors[name], label=f"{ATTACKER_TITLES[name]}, plain model: {plain:.0f} dB")
    axis.set_ylim(0, top + 5)
    axis.set_xlabel("jigsaw ratio")
    axis.set_ylabel("PSNR vs x (dB), higher = more leaked")
    axis.set_xscale("log")
    axis.minorticks_off()
    axis.set_xticks(ratios, [f"{ratio:g}" for ratio in ratios])
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if title:
        axis.set_title(title, fontsize=9)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    plt.close(figure)
    return path
