"""The common-corruption benchmarks stored as files (ImageNet-C, CIFAR-10-C): their corruptions, the per-severity
error table with CE and mCE that both share, and the passes over their images.

Hendrycks and Dietterich, "Benchmarking Neural Network Robustness to Common Corruptions and Perturbations", ICLR
2019 (https://github.com/hendrycks/robustness): 15 corruptions in 4 families, each at 5 severities, plus 4 extra
corruptions released beside them for validation (outside the mCE). With ``E[s, c]`` a model's top-1 error (%) on
corruption ``c`` at severity ``s``:

- the corruption error ``CE[c] = 100 * sum_s E[s, c] / sum_s R[s, c]`` against a reference ``R`` (AlexNet's
  errors on ImageNet-C; a baseline's errors for the mCE relative to a baseline);
- ``mCE``: the mean of ``CE[c]`` over the 15 corruptions;
- the unnormalized mean corruption error: the mean of ``E[s, c]`` over severities and the 15 corruptions (the only
  one CIFAR-10-C has: there are no published reference errors for it).

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


def corruption_table(
    errors: Mapping[str, Sequence[float]],
    *,
    reference: Mapping[str, float] | None = None,
    baseline: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The per-corruption, per-severity table of one model, with CE and mCE.

    Args:
        errors: corruption -> top-1 error (%) at severities 1..5 (all five), for corruptions of
            :data:`ALL_CORRUPTIONS`.
        reference: corruption -> a reference model's error (%) averaged over the five severities (AlexNet's on
            ImageNet-C); gives ``ce`` and ``mce``. Extras have none.
        baseline: the baseline's ``errors``: gives its own table under ``baseline`` and the model's CE and mCE
            against it (``ce_vs_baseline``, ``mce_vs_baseline``: the baseline in the place of the reference).

    Returns:
        ``severities``, ``families`` (family -> corruptions present), ``error``, ``mean_error`` (per corruption,
        over severities), ``mean_corruption_error`` (the unnormalized mCE, over the benchmark's corruptions present),
        ``corruptions_in_mce`` and ``missing`` (of the 15), ``ce``/``mce`` (None without a reference), and with a
        baseline ``baseline``, ``ce_vs_baseline``, ``mce_vs_baseline``. Extras are in ``error``, ``mean_error`` and
        ``ce_vs_baseline`` but in no mean.
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
    table: dict[str, Any] = {
        "severities": list(SEVERITIES),
        "families": families,
        "error": {name: [float(value) for value in errors[name]] for name in names},
        "mean_error": mean_error,
        "mean_corruption_error": _mean([mean_error[name] for name in in_mce]),
        "corruptions_in_mce": in_mce,
        "missing": [name for name in BENCHMARK if name not in errors],
        "ce": None,
        "mce": None,
    }
    if reference is not None:
        ce = {name: relative_ce([mean_error[name]], [reference[name]]) for name in in_mce if name in reference}
        table["ce"] = ce
        table["mce"] = _mean(list(ce.values()))
    if baseline is not None:
        lacking = [name for name in names if name not in baseline]
        if lacking:
            raise ValueError(f"the baseline's errors lack corruptions of the model's: {lacking}")
        table["baseline"] = corruption_table({name: baseline[name] for name in names}, reference=reference)
        versus = {name: relative_ce(errors[name], baseline[name]) for name in names}
        table["ce_vs_baseline"] = versus
        table["mce_vs_baseline"] = _mean([versus[name] for name in in_mce])
    return table
