"""Selective prediction, calibration and anomaly detection metrics of Hendrycks et al.'s ImageNet-A and ImageNet-O.

- :func:`aurra`: area under the response rate / accuracy curve, from each image's confidence (ImageNet-A);
- :func:`rms_calibration_error`: their RMS calibration error with adaptive bins of 100 images (ImageNet-A);
- :func:`aupr`, :func:`auroc`: the areas under the precision-recall and ROC curves with the anomalies as positives,
  and :func:`fpr_at_recall`: the false positive rate at 95% recall of them (FPR95) (ImageNet-O).

All take 1D tensors (or anything ``torch.as_tensor`` takes), compute in float64 on the CPU and return fractions in
[0, 1]; ``mjp eval`` reports them in %. The definitions follow the authors' code, ``calibration_tools.py`` of
github.com/hendrycks/natural-adv-examples (Hendrycks, Zhao, Basart, Steinhardt, Song, "Natural Adversarial
Examples", CVPR 2021); each function says where it differs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Values = torch.Tensor | Sequence[float] | Sequence[bool]


def _vector(values: Values, name: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    # a list goes straight to float64 (through torch's default float32 it would lose digits)
    tensor = values.detach().to("cpu", dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1D (one value per image), got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} is empty: the metric needs at least one image")
    return tensor


def _paired(confidence: Values, correct: Values) -> tuple[torch.Tensor, torch.Tensor]:
    confidence, correct = _vector(confidence, "confidence"), _vector(correct, "correct")
    if confidence.shape != correct.shape:
        raise ValueError(
            f"confidence and correct must have one value per image, got {confidence.numel()} and {correct.numel()}"
        )
    return confidence, correct


def aurra(confidence: Values, correct: Values) -> float:
    """Area under the response rate / accuracy curve (AURRA).

    The images are ranked from the most to the least confident; answering only the ``k`` most confident ones
    (response rate ``k / N``) gives an accuracy; AURRA is the mean of these accuracies over ``k = 1 .. N``, as
    ``aurra`` of the authors' ``calibration_tools.py`` computes it. Where they differ: images of equal confidence
    are answered together, their hits spread evenly over their ranks (the curve's expectation over the orders of
    the tied images), where the authors' ``np.argsort`` leaves their order to the sort; without ties the two agree.

    Args:
        confidence: ``[N]``, each image's confidence (max-softmax probability).
        correct: ``[N]``, 1 (or True) where the prediction is right, else 0.

    Returns:
        AURRA in [0, 1].
    """
    confidence, correct = _paired(confidence, correct)
    ranked_confidence, order = torch.sort(confidence, descending=True, stable=True)
    ranked = correct[order]
    total = len(ranked)
    # runs of equal confidence: each run's hits, spread evenly over its ranks
    starts_run = torch.ones(total, dtype=torch.bool)
    starts_run[1:] = ranked_confidence[1:] != ranked_confidence[:-1]
    run = starts_run.cumsum(0) - 1  # [N]: each rank's run
    starts = starts_run.nonzero().squeeze(1)  # [R]
    lengths = torch.diff(starts, append=torch.tensor([total]))  # [R]
    run_hits = torch.zeros(len(starts), dtype=torch.float64).index_add_(0, run, ranked)  # [R]
    hits_before = run_hits.cumsum(0) - run_hits  # [R]
    rank = torch.arange(1, total + 1, dtype=torch.float64)  # [N]
    hits = hits_before[run] + (rank - starts[run]) * (run_hits / lengths)[run]  # expected hits in the top k
    return float((hits / rank).mean())


def rms_calibration_error(
    confidence: Values, correct: Values, bin_size: int = 100, *, include_last_bin: bool = False
) -> float:
    """The root-mean-square calibration error with adaptive bins, as Hendrycks et al. measure it on ImageNet-A.

    The authors' definition (``calib_err(confidence, correct, p='2', beta=100)`` of their ``calibration_tools.py``):
    the images are sorted by confidence and cut into ``B = N // bin_size`` bins of ``bin_size`` consecutive images,
    the last bin taking the remaining ``N % bin_size`` too; their loop (``for i in range(len(bins) - 1)``) then sums
    over every bin but that last one, the most confident images::

        sqrt(sum over bins b = 1 .. B - 1 of |b| / N * (mean confidence of b - accuracy of b) ** 2)

    (``|b| / N`` with ``N`` all the images, the left-out bin's included). That is the default: the numbers it gives
    are the ones their code prints. ``include_last_bin=True`` sums over all ``B`` bins instead, as the formula in
    words (every image in a bin) reads; with fewer than ``bin_size`` images all of them then make one bin.

    By the authors' definition fewer than ``2 * bin_size`` images leave no bin to sum once the last is left out
    (their code prints 0 for 100 to 199 images and fails below 100): the error is then undefined, NaN here.

    Args:
        confidence: ``[N]``, each image's confidence (max-softmax probability).
        correct: ``[N]``, 1 (or True) where the prediction is right, else 0.
        bin_size: images per bin (the authors' ``beta``: 100).
        include_last_bin: sum over every bin, the last (most confident) one too; not the authors' definition.

    Returns:
        The RMS calibration error in [0, 1]; NaN when the authors' definition has no bin to sum.
    """
    if isinstance(bin_size, bool) or not isinstance(bin_size, int) or bin_size < 1:
        raise ValueError(f"bin_size must be a positive integer, got {bin_size!r}")
    confidence, correct = _paired(confidence, correct)
    order = torch.sort(confidence, stable=True).indices
    confidence, correct = confidence[order], correct[order]
    total = len(confidence)
    bins = total // bin_size
    if include_last_bin:
        bins = max(bins, 1)
    elif bins < 2:
        return math.nan
    starts = [index * bin_size for index in range(bins)]
    ends = starts[1:] + [total]  # the last bin runs to the end
    summed = list(zip(starts, ends, strict=True))[: bins if include_last_bin else bins - 1]
    squared = 0.0
    for start, end in summed:
        gap = confidence[start:end].mean() - correct[start:end].mean()
        squared += (end - start) / total * float(gap) ** 2
    return squared**0.5


def _detection(anomaly_scores: Values, normal_scores: Values) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 scores ``[P + M]`` (the anomalies first) and labels ``[P + M]`` (1: an anomaly, the positive class)."""
    positives, negatives = _vector(anomaly_scores, "anomaly_scores"), _vector(normal_scores, "normal_scores")
    scores = torch.cat([positives, negatives])
    if torch.isnan(scores).any():
        raise ValueError("the anomaly scores hold NaN")
    return scores, torch.cat([torch.ones_like(positives), torch.zeros_like(negatives)])


def aupr(anomaly_scores: Values, normal_scores: Values) -> float:
    """Area under the precision-recall curve with the anomalies as the positive class: scikit-learn's
    ``average_precision_score`` (thresholds at each distinct score, tied scores counted together), which the
    authors' ``get_measures`` calls with the out-of-distribution images as positives.

    Args:
        anomaly_scores: ``[P]``, the anomaly score (higher: more anomalous) of each out-of-distribution image (for
            ImageNet-O: the negative max-softmax probability).
        normal_scores: ``[M]``, the same score of each in-distribution image.

    Returns:
        AUPR in [0, 1]; a detector that ranks at random gets about ``P / (P + M)``.
    """
    from sklearn.metrics import average_precision_score  # scikit-learn is a requirement; imported when used

    scores, labels = _detection(anomaly_scores, normal_scores)
    return float(average_precision_score(labels.numpy(), scores.numpy()))


def auroc(anomaly_scores: Values, normal_scores: Values) -> float:
    """Area under the ROC curve with the anomalies as the positive class: scikit-learn's ``roc_auc_score``, as the
    authors' ``get_measures`` computes it; the probability that an anomaly scores above a normal image, ties
    counting one half.

    Args:
        anomaly_scores: ``[P]``, the anomaly score of each out-of-distribution image. normal_scores: ``[M]``.

    Returns:
        AUROC in [0, 1]; 0.5 for a detector that ranks at random.
    """
    from sklearn.metrics import roc_auc_score

    scores, labels = _detection(anomaly_scores, normal_scores)
    return float(roc_auc_score(labels.numpy(), scores.numpy()))


def fpr_at_recall(anomaly_scores: Values, normal_scores: Values, recall_level: float = 0.95) -> float:
    """The false positive rate at ``recall_level`` of the anomalies (FPR95 at 0.95), as the authors'
    ``fpr_and_fdr_at_recall`` computes it.

    Their definition: a threshold at each distinct score (an image is flagged when its score is at least the
    threshold), from the highest down to the first that flags every anomaly; the threshold taken is the one whose
    recall (share of the anomalies flagged) is closest to ``recall_level``, ties going to the lower threshold; the
    result is the share of the normal images it flags. Like their code, the candidates also hold a point of recall
    1 and no false positive after those thresholds: it is taken only when no threshold's recall comes within
    ``1 - recall_level`` of the level, which with a few hundred anomalies or more never happens (their 2,000).

    Args:
        anomaly_scores: ``[P]``, the anomaly score of each out-of-distribution image. normal_scores: ``[M]``.
        recall_level: the recall of the anomalies at which the false positive rate is read (0.95).

    Returns:
        The false positive rate in [0, 1]; lower is better.
    """
    if not 0.0 < recall_level <= 1.0:
        raise ValueError(f"recall_level must be in (0, 1], got {recall_level!r}")
    scores, labels = _detection(anomaly_scores, normal_scores)
    ranked_scores, order = torch.sort(scores, descending=True, stable=True)
    ranked_labels = labels[order]
    # the last rank of each run of equal scores: flagging down to it is one threshold
    last = torch.cat([(ranked_scores[1:] != ranked_scores[:-1]).nonzero().squeeze(1), torch.tensor([len(scores) - 1])])
    true_positives = ranked_labels.cumsum(0)[last]  # [T], float64
    false_positives = (last + 1).double() - true_positives
    recall = true_positives / true_positives[-1]
    # thresholds down to the first that flags every anomaly, from that one up (their order: ties in distance go
    # to the lower threshold), then their extra point of recall 1 and no false positive
    full = int(torch.searchsorted(true_positives, true_positives[-1]))
    recall = torch.cat([recall[: full + 1].flip(0), torch.ones(1, dtype=torch.float64)])
    false_positives = torch.cat([false_positives[: full + 1].flip(0), torch.zeros(1, dtype=torch.float64)])
    chosen = int(torch.argmin((recall - recall_level).abs()))  # the first of equal distances
    return float(false_positives[chosen] / (labels == 0).sum())


__all__ = ["aupr", "auroc", "aurra", "fpr_at_recall", "rms_calibration_error"]
