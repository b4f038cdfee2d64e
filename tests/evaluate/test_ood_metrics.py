"""AURRA, the RMS calibration error, AUPR, AUROC and FPR95 (mjp_fast/evaluate/ood_metrics.py) against independent
computations: a direct sum over the sorted confidences, hand arithmetic, scikit-learn, and the authors' definitions
(calib_err and fpr_and_fdr_at_recall of hendrycks/natural-adv-examples' calibration_tools.py) written out again here
in NumPy, from their formulas."""

import math

import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from mjp_fast.evaluate.ood_metrics import aupr, auroc, aurra, fpr_at_recall, rms_calibration_error
from tests.evaluate.authors_reference import calibration_error_authors, fpr_at_recall_authors


def _aurra_by_hand(confidence: list[float], correct: list[int]) -> float:
    """The accuracy of the k most confident answers, summed over k = 1..N, over N (distinct confidences)."""
    ranked = [hit for _, hit in sorted(zip(confidence, correct, strict=True), reverse=True)]
    total = 0.0
    for k in range(1, len(ranked) + 1):
        total += sum(ranked[:k]) / k
    return total / len(ranked)


@pytest.mark.parametrize("size", [1, 2, 7, 100, 257])
def test_aurra_is_the_mean_accuracy_over_response_rates(size):
    generator = torch.Generator().manual_seed(size)
    confidence = torch.rand(size, generator=generator)
    correct = (torch.rand(size, generator=generator) < confidence).int()
    expected = _aurra_by_hand(confidence.tolist(), correct.tolist())
    assert aurra(confidence, correct) == pytest.approx(expected, rel=1e-12)
    assert aurra(confidence.tolist(), correct.bool()) == pytest.approx(expected, rel=1e-12)


def test_aurra_rewards_confidence_that_ranks_the_right_answers_first():
    correct = [1, 1, 0, 0]
    assert aurra([0.9, 0.8, 0.2, 0.1], correct) == pytest.approx((1 + 1 + 2 / 3 + 2 / 4) / 4)
    assert aurra([0.1, 0.2, 0.8, 0.9], correct) == pytest.approx((0 + 0 + 1 / 3 + 2 / 4) / 4)


def test_aurra_answers_tied_confidences_together():
    # all tied: whatever the order, the expected accuracy at every response rate is the accuracy
    assert aurra([0.7] * 9, [0, 0, 1, 1, 1, 0, 0, 0, 0]) == pytest.approx(3 / 9)
    # a tied pair (0.8) after a sure hit: ranks 2 and 3 expect half a hit each
    assert aurra([0.9, 0.8, 0.8, 0.1], [1, 0, 1, 0]) == pytest.approx((1 + 1.5 / 2 + 2 / 3 + 2 / 4) / 4)


def test_rms_calibration_error_by_hand():
    # sorted by confidence: 0.3 0.55 | 0.6 0.8 0.9 (bins of 2, the last one taking the fifth image)
    confidence = [0.9, 0.8, 0.6, 0.3, 0.55]
    correct = [1, 0, 1, 0, 1]
    first_gap = (0.3 + 0.55) / 2 - (0 + 1) / 2
    last_gap = (0.6 + 0.8 + 0.9) / 3 - (1 + 0 + 1) / 3
    # the authors' definition, the default: the last bin is left out of the sum, not out of N
    assert rms_calibration_error(confidence, correct, bin_size=2) == pytest.approx(
        math.sqrt(2 / 5 * first_gap**2), rel=1e-12
    )
    every_bin = rms_calibration_error(confidence, correct, bin_size=2, include_last_bin=True)
    assert every_bin == pytest.approx(math.sqrt(2 / 5 * first_gap**2 + 3 / 5 * last_gap**2), rel=1e-12)
    # every bin: fewer images than a bin make one bin of all of them
    assert rms_calibration_error([0.9, 0.7], [1, 0], include_last_bin=True) == pytest.approx(abs(0.8 - 0.5))


@pytest.mark.parametrize("size", [1, 99, 100, 199])
def test_rms_calibration_error_is_undefined_with_fewer_than_two_bins(size):
    # the authors' loop sums nothing with one bin (their code prints 0) and fails with none: NaN, not a number
    confidence = torch.linspace(0.5, 1.0, size)
    assert math.isnan(rms_calibration_error(confidence, torch.ones(size)))
    assert not math.isnan(rms_calibration_error(confidence, torch.ones(size), include_last_bin=True))


def test_rms_calibration_error_with_the_default_bins_of_100():
    # 250 images: bins of 100 and 150; each bin's confidence and accuracy chosen, so the error is known
    confidence = torch.cat([torch.full((100,), 0.2, dtype=torch.float64), torch.full((150,), 0.9, dtype=torch.float64)])
    correct = torch.cat([torch.zeros(100), torch.ones(120), torch.zeros(30)])
    assert rms_calibration_error(confidence, correct) == pytest.approx(math.sqrt(100 / 250 * 0.2**2), rel=1e-12)
    expected = math.sqrt(100 / 250 * 0.2**2 + 150 / 250 * (0.9 - 120 / 150) ** 2)
    assert rms_calibration_error(confidence, correct, include_last_bin=True) == pytest.approx(expected, rel=1e-12)
    calibrated = torch.cat([torch.full((100,), 0.25), torch.full((100,), 0.75)])
    hits = torch.cat([torch.tensor([1.0] * 25 + [0.0] * 75), torch.tensor([1.0] * 75 + [0.0] * 25)])
    assert rms_calibration_error(calibrated, hits) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("size", [200, 257, 999, 7500])
def test_rms_calibration_error_is_the_authors(size):
    # ImageNet-A's 7,500 images among the sizes: the default is their number, the last bin summed too is not
    generator = torch.Generator().manual_seed(size)
    confidence = torch.rand(size, generator=generator, dtype=torch.float64)
    correct = (torch.rand(size, generator=generator, dtype=torch.float64) < confidence**2).double()
    expected = calibration_error_authors(confidence.numpy(), correct.numpy())
    assert rms_calibration_error(confidence, correct) == pytest.approx(expected, rel=1e-12)
    assert rms_calibration_error(confidence, correct, include_last_bin=True) != pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("positives, negatives", [(1, 1), (3, 17), (50, 200), (200, 31)])
def test_aupr_matches_scikit_learn(positives, negatives):
    generator = torch.Generator().manual_seed(positives * 1000 + negatives)
    anomaly = torch.randn(positives, generator=generator) + 0.5
    normal = torch.randn(negatives, generator=generator)
    labels = [1] * positives + [0] * negatives
    scores = torch.cat([anomaly, normal]).tolist()
    assert aupr(anomaly, normal) == pytest.approx(average_precision_score(labels, scores), rel=1e-12)
    # ties (rounded scores): thresholds at distinct scores only, as scikit-learn
    anomaly, normal = anomaly.mul(2).round(), normal.mul(2).round()
    scores = torch.cat([anomaly, normal]).tolist()
    assert aupr(anomaly, normal) == pytest.approx(average_precision_score(labels, scores), rel=1e-12)


def test_aupr_extremes():
    assert aupr([3.0, 2.0], [1.0, 0.0, -1.0]) == pytest.approx(1.0)
    assert aupr([0.5, 0.5], [0.5, 0.5, 0.5]) == pytest.approx(2 / 5)  # all tied: the positives' share


@pytest.mark.parametrize("positives, negatives", [(1, 1), (3, 17), (50, 200), (200, 31), (2000, 500)])
def test_auroc_and_fpr95_are_the_authors(positives, negatives):
    generator = torch.Generator().manual_seed(positives * 7 + negatives)
    anomaly = torch.randn(positives, generator=generator, dtype=torch.float64) + 1.0
    normal = torch.randn(negatives, generator=generator, dtype=torch.float64)
    for out_scores, in_scores in ((anomaly, normal), (anomaly.mul(2).round(), normal.mul(2).round())):  # ties too
        labels = [1] * positives + [0] * negatives
        scores = torch.cat([out_scores, in_scores]).numpy()
        assert auroc(out_scores, in_scores) == pytest.approx(roc_auc_score(labels, scores), rel=1e-12)
        expected = fpr_at_recall_authors(out_scores.numpy(), in_scores.numpy())
        assert fpr_at_recall(out_scores, in_scores) == pytest.approx(expected, abs=1e-15)


def test_fpr95_by_hand():
    # 20 anomalies scored 1..20, 4 normal images 0.5, 2.5, 10.5, 30. Recall 19/20 = 0.95 at threshold 2, which
    # flags 2.5, 10.5 and 30 too. Recall 0.5 at thresholds 11 (flags 30) and 10.5 (flags 10.5 and 30): a tie,
    # which goes to the lower threshold.
    anomaly, normal = [float(k) for k in range(1, 21)], [0.5, 2.5, 10.5, 30.0]
    assert fpr_at_recall(anomaly, normal) == pytest.approx(3 / 4)
    assert fpr_at_recall(anomaly, normal, recall_level=0.5) == pytest.approx(2 / 4)
    assert auroc([3.0, 2.0], [1.0, 0.0]) == 1.0 and auroc([0.5], [0.5]) == 0.5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: aurra([0.5, 0.6], [1]), "one value per image, got 2 and 1"),
        (lambda: aurra([], []), "confidence is empty"),
        (lambda: rms_calibration_error([[0.5]], [[1]]), "confidence must be 1D"),
        (lambda: rms_calibration_error([0.5], [1], bin_size=0), "bin_size must be a positive integer, got 0"),
        (lambda: aupr([], [0.1]), "anomaly_scores is empty"),
        (lambda: aupr([float("nan")], [0.1]), "the anomaly scores hold NaN"),
        (lambda: auroc([0.5], []), "normal_scores is empty"),
        (lambda: fpr_at_recall([0.5], [0.1], recall_level=0.0), "recall_level must be in"),
    ],
)
def test_bad_inputs_are_value_errors(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        call()
