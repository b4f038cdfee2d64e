"""The common-corruption benchmarks stored as files (ImageNet-C, CIFAR-10-C): their corruptions, the per-severity
error table with CE and mCE that both share, and the passes over their images.

Hendrycks and Dietterich, "Benchmarking Neural Network Robustness to Common Corruptions and Perturbations", ICLR
2019 (https://github.com/hendrycks/robustness): 15 corruptions in 4 families, each at 5 severities, plus 4 extra
corruptions released beside them for validation (outside the mCE). With ``E[s, c]`` a model's top-1 error (%) on
corruption ``c`` at severity ``s``:

- the corruption error ``CE[c] = 100 * sum_s E[s, c] / sum_s R[s, c]`` against a reference ``R`` (AlexNet's
  errors on ImageNet-C; a baseline's errors for the mCE relative to a baseline);
- ``mCE``: the mean of ``CE[c]`` over the 15 corruptions;
- the relative CE of the paper's Eq. 2, ``100 * sum_s (E[s, c] - E_clean) / sum_s (R[s, c] - R_clean)`` with the
  clean errors of the model and of the reference, and the relative mCE, its mean over the 15 corruptions: how much
  a model loses to the corruptions, whatever its clean error (ImageNet-C only: it needs AlexNet's clean error);
- the unnormalized mean corruption error: the mean of ``E[s, c]`` over severities and the 15 corruptions (the only
  one CIFAR-10-C has: there are no published reference errors for it); and the authors' own unnormalized mean,
  the one their ImageNet-C/test.py prints ("mCE (unnormalized by AlexNet errors)"), over the 15 and the 4 extra
  corruptions, 19 in all.

The mCE "relative to a baseline" that ``mjp eval --baseline`` adds is none of these: the CE with the baseline's
errors in AlexNet's place, 100 for the baseline itself; not the paper's relative mCE.

The on-the-fly corruptions of :mod:`mjp_fast.evaluate.corruptions` (a quick proxy, not these benchmarks) use the
same CE against a baseline (:func:`relative_ce`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEVERITIES = (1, 2, 3, 4, 5)
# The benchmark's 15 corruptions by family, in the order of the paper's tables.
FAMILIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
BENCHMARK = tuple(name for names in FAMILIES.values() for name in names)
# Released with them for validation ("extra.tar" of ImageNet-C, the same four .npy of CIFAR-10-C): outside the mCE.
EXTRAS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
EXTRA_FAMILY = "extra"
ALL_CORRUPTIONS = BENCHMARK + EXTRAS


def family_of(corruption: str) -> str:
    """``noise``, ``blur``, ``weather``, ``digital`` or ``extra``."""
    if corruption in EXTRAS:
        return EXTRA_FAMILY
    for family, names in FAMILIES.items():
        if corruption in names:
            return family
    raise ValueError(f"unknown corruption {corruption!r}; known: {', '.join(ALL_CORRUPTIONS)}")


@dataclass
class StoredCorruptions:
    """A benchmark's corrupted images as found on disk (its layout already checked): for each corruption present,
    one dataset maker per severity 1..5. A maker opens that severity's images when its pass comes (ImageNet-C's
    file lists would take gigabytes at once): a dataset of ``(image, target)``, the target the model's class index,
    whose image transform is set later (its ``transform`` attribute, as :func:`mjp_fast.train.data.set_transform`
    sets it)."""

    benchmark: str  # "ImageNet-C", "CIFAR-10-C"
    option: str  # the command-line option that named it, for messages
    root: Path
    sources: dict[str, list[Callable[[], Any]]]  # corruption -> [severity 1, ..., 5], in ALL_CORRUPTIONS order
    missing: list[str] = field(default_factory=list)  # the benchmark corruptions (of the 15) not found
    reference: dict[str, float] | None = None  # the CE's reference errors (%), per corruption (AlexNet's); None: none
    crop_pct: float | None = None  # the center crop its stored images take; None: the model's own evaluation crop
    reference_clean_error: float | None = None  # the reference's clean top-1 error (%), for the relative mCE
    release_images: int | None = None  # the release's images in each pass (corruption and severity)

    def passes(self) -> int:
        """Passes over the data to measure one model: one per corruption and severity."""
        return sum(len(makers) for makers in self.sources.values())


def measure_errors(sets: StoredCorruptions, evaluate: Callable[[str, Any], float]) -> dict[str, list[float]]:
    """``{corruption: [top-1 error (%) at severity 1, ..., 5]}``; ``evaluate(description, dataset)`` returns the
    top-1 accuracy (%) of one pass over ``dataset``."""
    return {
        name: [
            100.0 - evaluate(f"{sets.benchmark} {name} severity {severity}", make())
            for severity, make in enumerate(makers, start=1)
        ]
        for name, makers in sets.sources.items()
    }


def relative_ce(errors: Sequence[float], reference: Sequence[float]) -> float | None:
    """``100 * sum(errors) / sum(reference)``: the CE of one corruption against a reference's errors at the same
    severities; None when the reference makes no error at all (the ratio is undefined)."""
    total = sum(reference)
    return 100.0 * sum(errors) / total if total > 0 else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def _relative_ce(mean_error: float, clean_error: float, reference: float, reference_clean: float) -> float | None:
    """The paper's relative CE (Eq. 2) from means over the five severities, whose sums it divides (the five clean
    errors cancel in the ratio); None when the reference loses nothing to the corruption."""
    lost = reference - reference_clean
    return 100.0 * (mean_error - clean_error) / lost if lost > 0 else None


def corruption_table(
    errors: Mapping[str, Sequence[float]],
    *,
    reference: Mapping[str, float] | None = None,
    baseline: Mapping[str, Sequence[float]] | None = None,
    clean_error: float | None = None,
    reference_clean_error: float | None = None,
) -> dict[str, Any]:
    """The per-corruption, per-severity table of one model, with CE and mCE.

    Args:
        errors: corruption -> top-1 error (%) at severities 1..5 (all five), for corruptions of
            :data:`ALL_CORRUPTIONS`.
        reference: corruption -> a reference model's error (%) averaged over the five severities (AlexNet's on
            ImageNet-C); gives ``ce`` and ``mce``. Extras have none.
        baseline: the baseline's ``errors``: gives its own table under ``baseline`` and the model's CE and mCE
            against it (``ce_vs_baseline``, ``mce_vs_baseline``: the baseline in the place of the reference).
        clean_error, reference_clean_error: the model's and the reference's top-1 error (%) on the clean images;
            with ``reference``, they give ``relative_ce`` and ``relative_mce`` (the paper's Eq. 2).

    Returns:
        ``severities``, ``families`` (family -> corruptions present), ``error``, ``mean_error`` (per corruption,
        over severities), ``mean_corruption_error`` (the unnormalized mCE, over the benchmark's corruptions present),
        ``mean_corruption_error_with_extras`` (the same over the 15 and the 4 extra corruptions present, as the
        authors' test.py averages), ``corruptions_in_mce`` and ``missing`` (of the 15) with ``missing_corruptions``
        (their count), ``missing_extras`` (of the 4), ``ce``/``mce`` (None without a reference), ``clean_error``
        and ``reference_clean_error``, ``relative_ce``/``relative_mce`` (None without a reference and both clean
        errors), and with a baseline ``baseline``, ``ce_vs_baseline``, ``mce_vs_baseline``. Extras are in
        ``error``, ``mean_error`` and ``ce_vs_baseline`` but in no mean other than
        ``mean_corruption_error_with_extras``.
    """
    unknown = [name for name in errors if name not in ALL_CORRUPTIONS]
    if unknown:
        raise ValueError(f"unknown corruptions {unknown}; known: {', '.join(ALL_CORRUPTIONS)}")
    names = [name for name in ALL_CORRUPTIONS if name in errors]
    short = [name for name in names if len(errors[name]) != len(SEVERITIES)]
    if short:
        raise ValueError(f"each corruption needs its error at the five severities; {short} have not")
    in_mce = [name for name in BENCHMARK if name in errors]
    families: dict[str, list[str]] = {}
    for name in names:
        families.setdefault(family_of(name), []).append(name)
    mean_error = {name: sum(errors[name]) / len(errors[name]) for name in names}
    missing = [name for name in BENCHMARK if name not in errors]
    table: dict[str, Any] = {
        "severities": list(SEVERITIES),
        "families": families,
        "error": {name: [float(value) for value in errors[name]] for name in names},
        "mean_error": mean_error,
        "mean_corruption_error": _mean([mean_error[name] for name in in_mce]),
        "mean_corruption_error_with_extras": _mean([mean_error[name] for name in names]),
        "corruptions_in_mce": in_mce,
        "missing": missing,
        "missing_corruptions": len(missing),
        "missing_extras": [name for name in EXTRAS if name not in errors],
        "ce": None,
        "mce": None,
        "clean_error": clean_error,
        "reference_clean_error": reference_clean_error,
        "relative_ce": None,
        "relative_mce": None,
    }
    if reference is not None:
        ce = {name: relative_ce([mean_error[name]], [reference[name]]) for name in in_mce if name in reference}
        table["ce"] = ce
        table["mce"] = _mean(list(ce.values()))
        if clean_error is not None and reference_clean_error is not None:
            relative = {
                name: _relative_ce(mean_error[name], clean_error, reference[name], reference_clean_error)
                for name in in_mce
                if name in reference
            }
            table["relative_ce"] = relative
            table["relative_mce"] = _mean(list(relative.values()))
    if baseline is not None:
        lacking = [name for name in names if name not in baseline]
        if lacking:
            raise ValueError(f"the baseline's errors lack corruptions of the model's: {lacking}")
        table["baseline"] = corruption_table({name: baseline[name] for name in names}, reference=reference)
        versus = {name: relative_ce(errors[name], baseline[name]) for name in names}
        table["ce_vs_baseline"] = versus
        table["mce_vs_baseline"] = _mean([versus[name] for name in in_mce])
    return table


def stored_coverage(table: Mapping[str, Any], images: int, release_images: int) -> dict[str, Any]:
    """How a measured benchmark compares with its release: ``partial`` (the numbers over the 15 corruptions,
    the mCE's, are not the release's: some of the 15 missing, or fewer images a pass than the release has, such as
    with ``--max-images``), ``partial_with_extras`` (the same for the mean over the 19: also an extra missing),
    ``release_images`` (a pass's) and ``missing_images`` (a pass's images not measured).

    Args:
        table: :func:`corruption_table`'s. images: the images of each pass (the fewest, where passes differ).
        release_images: the release's images in each pass (ImageNet-C 50,000; CIFAR-10-C 10,000).
    """
    short = images != release_images
    partial = bool(table["missing"]) or short
    return {
        "partial": partial,
        "partial_with_extras": partial or bool(table["missing_extras"]),
        "release_images": release_images,
        "missing_images": max(release_images - images, 0),
    }
