"""The report's statistics and verdict rules, on constructed numbers whose answers are known."""

import numpy as np
import pytest

from mjp_fast.reproduce import claims as rules
from mjp_fast.reproduce.claims import AGREES, DISAGREES, NOISE


def test_bootstrap_interval_covers_the_mean_and_narrows_with_more_images():
    generator = np.random.default_rng(1)
    small = generator.random(200) < 0.6
    large = generator.random(20000) < 0.6
    low, high = rules.bootstrap_interval(small, samples=500)
    assert low < small.mean() < high
    # the standard error of a 0.6 rate over 200 samples is 0.035: a 95% interval is about 0.14 wide
    assert 0.09 < high - low < 0.19
    wide_low, wide_high = rules.bootstrap_interval(large, samples=500)
    assert wide_high - wide_low < (high - low) / 5
    assert rules.bootstrap_interval(small, samples=500, seed=3) == rules.bootstrap_interval(small, samples=500, seed=3)


def test_bootstrap_interval_refuses_bad_input():
    with pytest.raises(ValueError, match="values must be a non-empty 1-D array"):
        rules.bootstrap_interval(np.zeros(0))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        rules.bootstrap_interval(np.ones(4), samples=0)
    with pytest.raises(ValueError, match="confidence must be in"):
        rules.bootstrap_interval(np.ones(4), confidence=1.0)


def test_paired_difference_sees_what_an_unpaired_view_cannot():
    # the same 1,000 images: the second model gets 30 more right and none wrong that the first got right
    first = np.zeros(1000, dtype=bool)
    first[:600] = True
    second = first.copy()
    second[600:630] = True
    difference = rules.paired_difference([first], [second], samples=1000)
    assert difference.mean == pytest.approx(3.0)
    low, high = difference.interval
    assert 1.5 < low < 3.0 < high < 4.5  # paired: only the 30 changed images vary
    assert difference.images == 1000 and difference.pairs == 1
    assert rules.direction_verdict(difference.interval, +0.7, difference.per_seed) == AGREES
    assert rules.direction_verdict(difference.interval, -0.6, difference.per_seed) == DISAGREES


def test_paired_difference_pairs_seeds_and_checks_lengths():
    a = [np.array([1, 0, 1, 0]), np.array([1, 1, 0, 0])]
    b = [np.array([1, 1, 1, 0]), np.array([1, 1, 0, 0]), np.array([0, 0, 0, 0])]  # a third seed has no pair
    difference = rules.paired_difference(a, b, samples=50)
    assert difference.pairs == 2
    assert difference.per_seed == [pytest.approx(25.0), pytest.approx(0.0)]
    assert difference.mean == pytest.approx(12.5)
    with pytest.raises(ValueError, match="the same images"):
        rules.paired_difference([np.ones(3)], [np.ones(4)])
    with pytest.raises(ValueError, match="at least one"):
        rules.paired_difference([], [np.ones(4)])


@pytest.mark.parametrize(
    ("interval", "expected", "per_seed", "verdict"),
    [
        ((0.2, 1.0), +0.7, (), AGREES),
        ((0.2, 1.0), -0.6, (), DISAGREES),
        ((-1.0, -0.2), -0.6, (), AGREES),
        ((-0.2, 1.0), +0.7, (), NOISE),  # the interval includes zero
        ((0.2, 1.0), +0.7, (0.9, -0.1), NOISE),  # the seeds disagree on the sign
        ((0.2, 1.0), +0.7, (0.9, 0.4), AGREES),
        ((0.2, 1.0), 0.0, (), NOISE),  # the paper gives no direction
    ],
)
def test_direction_verdict(interval, expected, per_seed, verdict):
    assert rules.direction_verdict(interval, expected, per_seed) == verdict


def test_direction_verdict_refuses_a_reversed_interval():
    with pytest.raises(ValueError, match="interval must be"):
        rules.direction_verdict((1.0, 0.0), 1.0)


def test_proportion_interval():
    low, high = rules.proportion_difference_interval(64.0, 82.0, 10000, 10000)
    # sqrt(.64*.36/1e4 + .82*.18/1e4) = 0.0062: +-1.2 points
    assert low == pytest.approx(18.0 - 1.22, abs=0.02) and high == pytest.approx(18.0 + 1.22, abs=0.02)
    low, high = rules.proportion_difference_interval(100.0, 100.0, 40, 40)
    assert low < 0 < high  # no spread from the rates themselves: half a sample keeps it open
    with pytest.raises(ValueError, match="first must be a percentage"):
        rules.proportion_difference_interval(120.0, 50.0, 10, 10)
    with pytest.raises(ValueError, match="counts must be >= 1"):
        rules.proportion_difference_interval(50.0, 50.0, 0, 10)


def test_trend_claim_rules():
    def points(consistencies, diff_norms, images=10000):
        ratios = (0.0, 0.03, 0.27)
        return [
            rules.TrendPoint(f"J@{r}", r, c, d, images)
            for r, c, d in zip(ratios, consistencies, diff_norms, strict=True)
        ]

    rising = rules.trend_claim(3, "trend", points((64.0, 80.0, 93.0), (16.0, 9.0, 4.0)), "the sweep")
    assert rising.verdict == AGREES and rising.numbers["monotone_consistency"]
    assert "64.0% -> 93.0%" in rising.evidence
    falling = rules.trend_claim(3, "trend", points((93.0, 80.0, 64.0), (4.0, 9.0, 16.0)), "the sweep")
    assert falling.verdict == DISAGREES
    # consistency up beyond noise, diff-norm flat within 5%: not both improve
    flat = rules.trend_claim(3, "trend", points((64.0, 70.0, 80.0), (10.0, 10.1, 9.8)), "the sweep")
    assert flat.verdict == NOISE
    # 40 images: +5 points is inside the noise
    small = rules.trend_claim(3, "trend", points((60.0, 62.0, 65.0), (16.0, 9.0, 4.0), images=40), "the sweep")
    assert small.verdict == NOISE
    one = rules.trend_claim(3, "trend", points((64.0, 80.0, 93.0), (16.0, 9.0, 4.0))[:1], "the sweep")
    assert one.verdict == rules.NOT_MEASURED


def test_regression_verdicts():
    assert rules.regression_verdict(0.08, 0.005, 0.27) == AGREES
    assert rules.regression_verdict(0.30, 0.005, 0.27) == DISAGREES
    assert rules.regression_verdict(0.26, 0.01, 0.27) == NOISE
    good = rules.RegressionPoint("J", 0.08, 0.005, 0.27, 1.0, 12.0)
    bad = rules.RegressionPoint("I", 0.30, 0.005, 0.27, 3.9, 50.0)
    assert rules.regression_claim(4, "regress", [good]).verdict == AGREES
    assert rules.regression_claim(4, "regress", [good, bad]).verdict == DISAGREES
    assert rules.regression_claim(4, "regress", []).verdict == rules.NOT_MEASURED


def test_attack_claim_rules():
    plain, defended = [90.0, 88.0, 91.0, 89.0], [8.0, 9.0, 7.5, 8.5]
    assert rules.attack_claim(5, "attack", plain, defended, ratio=0.03, samples=200).verdict == AGREES
    # the plain model does not leak either: the claim's premise fails
    assert rules.attack_claim(5, "attack", [15.0] * 4, defended, ratio=0.03, samples=200).verdict == DISAGREES
    # the MJP model leaks as well
    assert rules.attack_claim(5, "attack", plain, [60.0, 61.0, 59.0, 62.0], ratio=0.5, samples=200).verdict == DISAGREES
    assert rules.attack_claim(5, "attack", plain, [], ratio=0.5, samples=200).verdict == rules.NOT_MEASURED
    # the attacker who knows MJP: said in the evidence, paired against APRIL; the verdict stays APRIL's
    adaptive = [24.0, 26.0, 23.0, 25.0]
    claim = rules.attack_claim(5, "attack", plain, defended, ratio=0.03, samples=200, adaptive_psnr=adaptive)
    assert claim.verdict == AGREES
    assert "gets 24.5 dB on the same images and ratio; adaptive - c = +16.2 dB [95% CI" in claim.evidence
    assert claim.numbers["adaptive_psnr"] == pytest.approx(24.5)


def test_accuracy_claim_line():
    first = [np.r_[np.ones(500), np.zeros(500)].astype(bool)] * 2
    second = [np.r_[np.ones(560), np.zeros(440)].astype(bool)] * 2
    claim = rules.accuracy_claim(1, "J keeps accuracy", "A", "J", first, second, samples=300)
    assert claim.verdict == AGREES
    assert claim.line().startswith("1. **J keeps accuracy**: **agrees**. Top-1 J - A = +6.00 points [95% CI")
    assert "2 seed pairs" in claim.evidence and "A 50.00% (seeds: 50.00, 50.00)" in claim.evidence
    missing = rules.accuracy_claim(2, "E costs", "E", "G", [], second, samples=10)
    assert missing.verdict == rules.NOT_MEASURED and "Row E was not run" in missing.evidence


def test_combine():
    assert rules.combine([AGREES, AGREES]) == AGREES
    assert rules.combine([AGREES, NOISE]) == NOISE
    assert rules.combine([NOISE, DISAGREES]) == DISAGREES
    with pytest.raises(ValueError, match="must not be empty"):
        rules.combine([])
