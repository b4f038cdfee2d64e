"""Selective prediction, calibration and anomaly detection metrics of Hendrycks et al.'s ImageNet-A and ImageNet-O.

- :func:`aurra`: area under the response rate / accuracy curve, from each image's confidence (ImageNet-A);
- :func:`rms_calibration_error`: their RMS calibration error with adaptive bins of 100 images (ImageNet-A);
- :func:`aupr`: area under the precision-recall curve with the anomalies as positives (ImageNet-O).

All take 1D tensors (or anything ``torch.as_tensor`` takes), compute in float64 on the CPU and return fractions in
[0, 1]; ``mjp eval`` reports them in %. The definitions follow the authors' code, ``calibration_tools.py`` of
github.com/hendrycks/natural-adv-examples (Hendrycks, Zhao, Basart, Steinhardt, Song, "Natural Adversarial
Examples", CVPR 2021); each function says where it differs.
"""

from __future__ import annotations

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
    confidence: Values, correct: Values, bin_size: int = 100, *, drop_last_bin: bool = False
) -> float:
    """The root-mean-square calibration error with adaptive bins, as Hendrycks et al. measure it on ImageNet-A.

    Binning (``calib_err(confidence, correct, p='2', beta=100)`` of the authors' ``calibration_tools.py``): the
    images are sorted by confidence and cut into ``N // bin_size`` bins of ``bin_size`` consecutive images, the
    last bin taking the remaining ``N % bin_size`` too (so every bin holds ``bin_size`` to ``2 * bin_size - 1``
    images); then ``sqrt(sum over bins b of |b| / N * (mean confidence of b - accuracy of b) ** 2)``.

    Where this differs from their code: with fewer than ``bin_size`` images their code fails (no bin), here all
    the images make one bin; and their loop (``for i in range(len(bins) - 1)``) leaves out the last bin, the most
    confident images, while this sums over every bin, as the definition does. ``drop_last_bin=True`` leaves it out
    as their loop does, to compare with numbers their code printed.

    Args:
        confidence: ``[N]``, each image's confidence (max-softmax probability).
        correct: ``[N]``, 1 (or True) where the prediction is right, else 0.
        bin_size: images per bin (the authors' ``beta``: 100).
        drop_last_bin: leave out the last bin, as the authors' loop does.

    Returns:
        The RMS calibration error in [0, 1].
    """
    if isinstance(bin_size, bool) or not isinstance(bin_size, int) or bin_size < 1:
        raise ValueError(f"bin_size must be a positive integer, got {bin_size!r}")
    confidence, correct = _paired(confidence, correct)
    order = torch.sort(confidence, stable=True).indices
    confidence, correct = confidence[order], correct[order]
    total = len(confidence)
    bins = max(total // bin_size, 1)
    starts = [index * bin_size for index in range(bins)]
    ends = starts[1:] + [total]  # the last bin runs to the end
    squared = 0.0
    for start, end in list(zip(starts, ends, strict=True))[: bins - 1 if drop_last_bin else bins]:
        gap = confidence[start:end].mean() - correct[start:end].mean()
        squared += (end - start) / total * float(gap) ** 2
    return squared**0.5


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

    positives, negatives = _vector(anomaly_scores, "anomaly_scores"), _vector(normal_scores, "normal_scores")
    scores = torch.cat([positives, negatives])
    if torch.isnan(scores).any():
        raise ValueError("the anomaly scores hold NaN")
    labels = torch.cat([torch.ones_like(positives), torch.zeros_like(negatives)])
    return float(average_precision_score(labels.numpy(), scores.numpy()))


__all__ = ["aupr", "aurra", "rms_calibration_error"]
