"""The statistics and the verdict rules of the report: bootstrap intervals, directions, and the five claims.

Every verdict is one of :data:`VERDICTS`: ``"agrees"`` (the measured direction is the paper's and the interval
excludes zero), ``"disagrees"`` (the opposite direction, interval excluding zero) or ``"inside the noise"`` (the
interval includes zero, or seeds disagree on the sign). The rules, in one place:

- Accuracy differences between two variants: a paired bootstrap over the test images. Both variants are
  measured on the same images; with several seeds, seed ``s`` of one is paired with seed ``s`` of the other and
  the per-image differences are averaged over the pairs before resampling images. The interval is the percentile
  interval of the mean difference (95 %). A difference whose interval excludes zero is still "inside the noise"
  when the seeds' own differences disagree in sign (seed-to-seed variation the image bootstrap cannot see).
- Consistency differences: the normal interval of a difference of two proportions over the test images,
  ``1.96 sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2)``. The evaluation returns consistency as a rate, not per image,
  so this unpaired interval is used; for the same images it is conservative (wider than the paired one).
- Diff-norm has no interval (the evaluation returns its mean only): a change of less than
  :data:`DIFF_NORM_NOISE` of its larger value counts as inside the noise, a stated convention, not a measurement.
- Position regression: a model's position embeddings "regress to positions" when the 5-fold mean absolute error
  plus two fold standard deviations is below the error of predicting the centre (the training folds' mean
  position, the same folds); "disagrees" when the error minus two standard deviations is above it.
- The attack: PSNR (dB) per attacked image, paired over images between the plain model's setting (a) and the
  MJP model's setting (c); the input counts as recovered at :data:`RECOVERED_PSNR` dB or more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

AGREES, DISAGREES, NOISE = "agrees", "disagrees", "inside the noise"
VERDICTS = (AGREES, DISAGREES, NOISE)
NOT_MEASURED = "not measured"  # only when the chosen --rows leave out what a claim compares
CONFIDENCE = 0.95
Z_95 = 1.959963984540054
DIFF_NORM_NOISE = 0.05
RECOVERED_PSNR = 30.0


def bootstrap_interval(
    values: np.ndarray, *, samples: int = 2000, confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` ``[n]`` (resampling its entries with replacement).

    Raises:
        ValueError: ``values`` is empty or not 1-D, ``samples`` < 1, ``confidence`` not in (0, 1).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {values.shape}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    generator = np.random.default_rng(seed)
    means = np.empty(samples, dtype=np.float64)
    # in chunks: samples x n indices at once would be 160 MB for 2,000 resamples of 10,000 images
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, samples, chunk):
        count = min(chunk, samples - start)
        indices = generator.integers(0, values.size, size=(count, values.size))
        means[start : start + count] = values[indices].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass
class Difference:
    """``second - first`` of a per-image quantity, in the quantity's units (percentage points for hits)."""

    mean: float
    interval: tuple[float, float]
    per_seed: list[float]
    images: int
    pairs: int

    def describe(self, unit: str = " points", digits: int = 2) -> str:
        low, high = self.interval
        text = f"{self.mean:+.{digits}f}{unit} [95% CI {low:+.{digits}f}, {high:+.{digits}f}]"
        if len(self.per_seed) > 1:
            text += "; per seed " + ", ".join(f"{value:+.{digits}f}" for value in self.per_seed)
        return text


def paired_difference(
    first: Sequence[np.ndarray],
    second: Sequence[np.ndarray],
    *,
    scale: float = 100.0,
    samples: int = 2000,
    seed: int = 0,
) -> Difference:
    """The mean of ``second - first`` over the same images, with its paired bootstrap interval.

    Args:
        first, second: per-image values (e.g. top-1 hits as 0/1) of the paired seeds, ``[n]`` each; entry ``s``
            of one is paired with entry ``s`` of the other (extra entries of the longer one are left out).
        scale: multiplies the result (100: hits -> percentage points).

    Raises:
        ValueError: no pairs, or arrays of different lengths.
    """
    pairs = min(len(first), len(second))
    if pairs == 0:
        raise ValueError("first and second must each hold at least one per-image array")
    stacked_first = np.stack([np.asarray(values, dtype=np.float64) for values in first[:pairs]])
    stacked_second = np.stack([np.asarray(values, dtype=np.float64) for values in second[:pairs]])
    if stacked_first.shape != stacked_second.shape:
        raise ValueError(
            f"first and second must hold values for the same images, got {stacked_first.shape[1]} and "
            f"{stacked_second.shape[1]}"
        )
    differences = (stacked_second - stacked_first) * scale  # [pairs, n]
    per_image = differences.mean(axis=0)
    interval = bootstrap_interval(per_image, samples=samples, seed=seed)
    return Difference(
        mean=float(per_image.mean()),
        interval=interval,
        per_seed=[float(row.mean()) for row in differences],
        images=int(per_image.size),
        pairs=pairs,
    )


def direction_verdict(interval: tuple[float, float], expected: float, per_seed: Sequence[float] = ()) -> str:
    """``agrees`` / ``disagrees`` / ``inside the noise`` for a measured difference against an expected direction.

    Args:
        interval: the difference's confidence interval (low, high).
        expected: the paper's difference (only its sign counts; 0 has no direction).
        per_seed: the difference of each seed pair; with two or more, any whose sign is not the interval's makes
            the result inside the noise.

    Raises:
        ValueError: ``interval`` with low > high.
    """
    low, high = interval
    if low > high:
        raise ValueError(f"interval must be (low, high) with low <= high, got {interval}")
    if low <= 0.0 <= high or expected == 0:
        return NOISE
    measured = 1.0 if low > 0 else -1.0
    if len(per_seed) > 1 and any(math.copysign(1.0, value) != measured or value == 0 for value in per_seed):
        return NOISE
    return AGREES if measured == math.copysign(1.0, expected) else DISAGREES


def proportion_difference_interval(
    first: float, second: float, first_count: int, second_count: int
) -> tuple[float, float]:
    """95 % normal interval of ``second - first`` for two rates in percent measured on ``*_count`` samples.

    Raises:
        ValueError: a rate outside [0, 100] or a count < 1.
    """
    for name, value in (("first", first), ("second", second)):
        if not 0.0 <= value <= 100.0:
            raise ValueError(f"{name} must be a percentage in [0, 100], got {value}")
    if first_count < 1 or second_count < 1:
        raise ValueError(f"counts must be >= 1, got {first_count} and {second_count}")
    p1, p2 = first / 100.0, second / 100.0
    spread = Z_95 * math.sqrt(p1 * (1 - p1) / first_count + p2 * (1 - p2) / second_count) * 100.0
    # a rate of exactly 0 or 100 on both sides has zero spread; half a sample keeps the interval honest
    spread = max(spread, 50.0 / min(first_count, second_count))
    return second - first - spread, second - first + spread


def relative_change_verdict(before: float, after: float, expected: float, tolerance: float = DIFF_NORM_NOISE) -> str:
    """The verdict for a quantity without an interval (diff-norm): a change of less than ``tolerance`` of the
    larger magnitude is inside the noise; otherwise its sign against ``expected``'s."""
    scale = max(abs(before), abs(after))
    change = after - before
    if scale == 0 or abs(change) < tolerance * scale or expected == 0:
        return NOISE
    return AGREES if math.copysign(1.0, change) == math.copysign(1.0, expected) else DISAGREES


def combine(verdicts: Sequence[str]) -> str:
    """All agree: agrees; any disagrees: disagrees; else inside the noise."""
    if not verdicts:
        raise ValueError("verdicts must not be empty")
    if any(verdict == DISAGREES for verdict in verdicts):
        return DISAGREES
    return AGREES if all(verdict == AGREES for verdict in verdicts) else NOISE


def regression_verdict(mae: float, std: float, chance: float) -> str:
    """Position regression: agrees when ``mae + 2 std < chance``, disagrees when ``mae - 2 std > chance``."""
    if mae + 2 * std < chance:
        return AGREES
    if mae - 2 * std > chance:
        return DISAGREES
    return NOISE


@dataclass
class Claim:
    """One line of the report: the claim, its verdict and the evidence with its numbers."""

    number: int
    statement: str
    verdict: str
    evidence: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.number}. **{self.statement}**: **{self.verdict}**. {self.evidence}"


def accuracy_claim(
    number: int,
    statement: str,
    first: str,
    second: str,
    first_hits: Sequence[np.ndarray],
    second_hits: Sequence[np.ndarray],
    *,
    samples: int,
) -> Claim:
    """``second`` keeps or beats ``first`` in top-1 (e.g. J against A): the paired difference ``second - first``
    over the same test images, the hits of seed pairs aligned (entry ``s`` of each: the same seed). "not
    measured" when either has no run."""
    if not first_hits or not second_hits:
        missing = [label for label, hits in ((first, first_hits), (second, second_hits)) if not hits]
        which = f"Row {missing[0]} was" if len(missing) == 1 else f"Rows {' and '.join(missing)} were"
        return Claim(number, statement, NOT_MEASURED, f"{which} not run.")
    difference = paired_difference(first_hits, second_hits, samples=samples)
    verdict = direction_verdict(difference.interval, +1.0, difference.per_seed)
    top_first = [100.0 * float(np.mean(values)) for values in first_hits]
    top_second = [100.0 * float(np.mean(values)) for values in second_hits]
    evidence = (
        f"Top-1 {second} - {first} = {difference.describe()} (paired bootstrap over {difference.images:,} test "
        f"images, {difference.pairs} seed pair{'s' if difference.pairs > 1 else ''}); {first} "
        f"{_mean_text(top_first)}, {second} {_mean_text(top_second)}."
    )
    numbers = {
        "difference": difference.mean,
        "interval": list(difference.interval),
        "per_seed": difference.per_seed,
        f"top1_{first}": top_first,
        f"top1_{second}": top_second,
    }
    return Claim(number, statement, verdict, evidence, numbers)


def _mean_text(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}%"
    return f"{np.mean(values):.2f}% (seeds: {', '.join(f'{value:.2f}' for value in values)})"


@dataclass
class TrendPoint:
    """One model of the ratio trend: its training mask ratio and its consistency and diff-norm."""

    label: str
    ratio: float
    consistency: float
    diff_norm: float
    images: int


def trend_claim(number: int, statement: str, points: Sequence[TrendPoint], source: str) -> Claim:
    """Consistency rises and diff-norm falls from the smallest to the largest ratio of ``points`` (the runs of one
    model at several training mask ratios; ``source`` says which, in words). Fewer than two distinct ratios: "not
    measured", with ``source`` as the evidence."""
    ordered = sorted(points, key=lambda point: point.ratio)
    if len(ordered) < 2 or ordered[0].ratio == ordered[-1].ratio:
        return Claim(number, statement, NOT_MEASURED, f"Fewer than two mask ratios were trained: {source}.")
    first, last = ordered[0], ordered[-1]
    interval = proportion_difference_interval(first.consistency, last.consistency, first.images, last.images)
    consistency_verdict = direction_verdict(interval, +1.0)
    diff_verdict = relative_change_verdict(first.diff_norm, last.diff_norm, -1.0)
    verdict = combine([consistency_verdict, diff_verdict])
    consistencies = [point.consistency for point in ordered]
    diff_norms = [point.diff_norm for point in ordered]
    monotone_consistency = all(b >= a for a, b in zip(consistencies, consistencies[1:]))
    monotone_diff = all(b <= a for a, b in zip(diff_norms, diff_norms[1:]))
    series = "; ".join(
        f"{point.label} (ratio {point.ratio:g}): {point.consistency:.1f}%, {point.diff_norm:.3f}" for point in ordered
    )
    evidence = (
        f"From {source}. Consistency {first.consistency:.1f}% -> {last.consistency:.1f}% "
        f"({last.consistency - first.consistency:+.1f} points, 95% CI {interval[0]:+.1f}, {interval[1]:+.1f}: "
        f"{consistency_verdict}), diff-norm {first.diff_norm:.3f} -> {last.diff_norm:.3f} "
        f"({diff_verdict}; no interval, changes under {DIFF_NORM_NOISE:.0%} count as noise); monotone over the "
        f"{len(ordered)} ratios: consistency {'yes' if monotone_consistency else 'no'}, diff-norm "
        f"{'yes' if monotone_diff else 'no'}. Series: {series}."
    )
    numbers = {
        "source": source,
        "points": [point.__dict__ for point in ordered],
        "consistency_interval": list(interval),
        "consistency_verdict": consistency_verdict,
        "diff_norm_verdict": diff_verdict,
        "monotone_consistency": monotone_consistency,
        "monotone_diff_norm": monotone_diff,
    }
    return Claim(number, statement, verdict, evidence, numbers)


@dataclass
class RegressionPoint:
    """One model's position regression: 2D MAE in [0, 1] units of the grid, its fold spread, and chance."""

    label: str
    mae: float
    std: float
    chance: float
    mae_cells: float
    mae_1d: float


def regression_claim(number: int, statement: str, points: Sequence[RegressionPoint], reference: str = "") -> Claim:
    """Every model of ``points`` regresses to positions better than chance (see :func:`regression_verdict`)."""
    if not points:
        return Claim(number, statement, NOT_MEASURED, "No MJP model with learned position embeddings was run.")
    verdicts = [regression_verdict(point.mae, point.std, point.chance) for point in points]
    parts = [
        f"{point.label}: 2D MAE {point.mae:.3f} ± {point.std:.3f} of the grid ({point.mae_cells:.2f} cells; 1D "
        f"{point.mae_1d:.2f} positions) against {point.chance:.3f} for predicting the centre: {verdict}"
        for point, verdict in zip(points, verdicts, strict=True)
    ]
    evidence = "5-fold linear regression of the position embeddings (supplementary Table 2). " + "; ".join(parts)
    evidence += f". {reference}" if reference else "."
    numbers = {"points": [point.__dict__ for point in points], "verdicts": verdicts}
    return Claim(number, statement, combine(verdicts), evidence, numbers)


def attack_claim(
    number: int,
    statement: str,
    plain_psnr: Sequence[float],
    mjp_psnr: Sequence[float],
    *,
    ratio: float,
    samples: int,
    context: str = "",
    adaptive_psnr: Sequence[float] | None = None,
) -> Claim:
    """The attack recovers the input through the plain model (setting a, PSNR >= :data:`RECOVERED_PSNR`) but
    not through the MJP model (setting c, paired PSNR difference above zero and below the recovery level).

    The verdict is the paper's claim, about APRIL as published. ``adaptive_psnr``: per-image PSNRs of the attacker
    who knows MJP on the same images and ratio (:mod:`mjp_fast.privacy.adaptive`); the evidence then says how far it
    gets, paired against APRIL, so that the verdict is not read as "MJP defeats gradient inversion"."""
    if len(plain_psnr) == 0 or len(plain_psnr) != len(mjp_psnr):
        return Claim(number, statement, NOT_MEASURED, "The attack was not run on the same images for both models.")
    plain, mjp = np.asarray(plain_psnr, dtype=np.float64), np.asarray(mjp_psnr, dtype=np.float64)
    difference = paired_difference([mjp], [plain], scale=1.0, samples=samples)
    plain_mean, mjp_mean = float(plain.mean()), float(mjp.mean())
    if plain_mean < RECOVERED_PSNR:
        verdict = DISAGREES  # the premise fails: the plain model does not leak the input either
    elif mjp_mean >= RECOVERED_PSNR:
        verdict = DISAGREES
    else:
        verdict = direction_verdict(difference.interval, +1.0)
    evidence = (
        f"Mean PSNR of the reconstruction: {plain_mean:.1f} dB through the plain model (a: gradients of x vs x), "
        f"{mjp_mean:.1f} dB through the MJP model (c: gradients of the jigsawed x~ at ratio {ratio:g} with UNK, vs "
        f"x); a - c = {difference.describe(unit=' dB', digits=1)} over {len(plain)} CIFAR test images "
        f"(recovered: >= {RECOVERED_PSNR:.0f} dB). {context}"
    ).strip()
    numbers = {
        "plain_psnr": plain_mean,
        "mjp_psnr": mjp_mean,
        "difference": difference.mean,
        "interval": list(difference.interval),
        "ratio": ratio,
        "images": len(plain),
    }
    if adaptive_psnr is not None and len(adaptive_psnr) == len(mjp):
        adaptive = np.asarray(adaptive_psnr, dtype=np.float64)
        gain = paired_difference([mjp], [adaptive], scale=1.0, samples=samples)
        evidence += (
            f" An attacker who knows MJP (the adaptive attack: mask from the zero rows, eq. (1) solved as far as it "
            f"is determined, a patch prior) gets {float(adaptive.mean()):.1f} dB on the same images and ratio; "
            f"adaptive - c = {gain.describe(unit=' dB', digits=1)}: the verdict is about APRIL as published."
        )
        numbers.update(
            adaptive_psnr=float(adaptive.mean()), adaptive_gain=gain.mean, adaptive_interval=list(gain.interval)
        )
    return Claim(number, statement, verdict, evidence, numbers)
