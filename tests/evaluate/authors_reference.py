"""The authors' robustness metrics written out again from their definitions, in NumPy and plain Python, for the
tests to check mjp_fast's against: not their code, their formulas.

- ``calib_err(p='2', beta=100)`` and ``fpr_and_fdr_at_recall`` of calibration_tools.py, github.com/hendrycks/
  natural-adv-examples (Hendrycks, Zhao, Basart, Steinhardt, Song, CVPR 2021);
- the corruption errors of Hendrycks and Dietterich, ICLR 2019 (github.com/hendrycks/robustness): the CE against
  AlexNet, the relative CE of their Eq. 2, and the unnormalized mean of ImageNet-C/test.py over its 19 corruptions.
"""

from __future__ import annotations

import numpy as np


def calibration_error_authors(confidence: np.ndarray, correct: np.ndarray, beta: int = 100) -> float:
    """The authors' RMS calibration error, from its definition: sort by confidence, bins of ``beta`` images (the
    last one taking the rest), sum ``|b| / N * gap ** 2`` over every bin but the last, square root."""
    order = np.argsort(confidence, kind="stable")
    confidence, correct = confidence[order], correct[order]
    total = len(confidence)
    edges = [index * beta for index in range(total // beta)] + [total]
    squared = 0.0
    for start, end in list(zip(edges[:-1], edges[1:]))[:-1]:  # the last bin left out
        squared += (end - start) / total * (confidence[start:end].mean() - correct[start:end].mean()) ** 2
    return float(np.sqrt(squared))


def fpr_at_recall_authors(positives: np.ndarray, negatives: np.ndarray, level: float = 0.95) -> float:
    """The authors' FPR at a recall level, from its definition: thresholds at the distinct scores from the
    highest down to the first with full recall, the one whose recall is nearest the level (ties: the lower
    threshold), plus their extra candidate of recall 1 and no false positive after all of them."""
    scores = np.concatenate([positives, negatives])
    anomaly = np.concatenate([np.ones(len(positives), bool), np.zeros(len(negatives), bool)])
    candidates = []  # (recall, false positives), from the lowest threshold kept up to the highest
    for threshold in sorted(set(scores.tolist())):
        flagged = scores >= threshold
        candidates.append((anomaly[flagged].sum() / len(positives), int((flagged & ~anomaly).sum())))
    while len(candidates) > 1 and candidates[1][0] == 1.0:  # only the highest threshold of full recall stays
        candidates.pop(0)
    candidates.append((1.0, 0))
    distances = [abs(recall - level) for recall, _ in candidates]
    return candidates[distances.index(min(distances))][1] / len(negatives)


def relative_mce_authors(
    errors: dict[str, list[float]],
    clean_error: float,
    alexnet_mean_errors: dict[str, float],
    alexnet_clean_error: float,
) -> float:
    """Hendrycks and Dietterich's relative mCE (Eq. 2), all in fractions: for each corruption c,
    ``sum_s (E[s, c] - E_clean) / sum_s (A[s, c] - A_clean)``, AlexNet's ``sum_s A[s, c]`` being five times its
    mean over the severities (the published numbers); then the mean over the corruptions, times 100."""
    relative = []
    for name, by_severity in errors.items():
        model_lost = sum(error - clean_error for error in by_severity)
        alexnet_lost = len(by_severity) * alexnet_mean_errors[name] - len(by_severity) * alexnet_clean_error
        relative.append(model_lost / alexnet_lost)
    return 100 * float(np.mean(relative))


def unnormalized_mean_authors(errors: dict[str, list[float]]) -> float:
    """ImageNet-C/test.py's "mCE (unnormalized by AlexNet errors)": the mean over its corruptions (the 15 and the
    4 extra) of each one's mean error over the five severities."""
    return float(np.mean([np.mean(by_severity) for by_severity in errors.values()]))
