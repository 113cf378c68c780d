"""Calibration analysis of exit heads: ROC AUC, ROC curves and the realised precision of a
threshold on held-out tokens (DSSD §3.4.1, §4.2).

The confidence metrics and the threshold rule τ_k(ε) themselves are decode-time code
(:mod:`selfspec.heads.calibration`); this module measures how well a metric separates
correct from wrong head predictions and checks that a threshold keeps its precision on a
test split. :data:`DEFAULT_EPSILONS` is the ε sweep ``selfspec heads train | calibrate``
stores in head files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.heads.calibration import calibration_vectors

DEFAULT_EPSILONS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)  # DSSD §4.2 sweep


def roc_auc(scores: torch.Tensor | Sequence[float], correct: torch.Tensor | Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` as a detector of ``correct`` (DSSD §3.4.1).

    Exact Mann–Whitney form: the probability that a random correct prediction scores higher
    than a random wrong one, ties counting 1/2 (average ranks), which is the trapezoidal
    area under the ROC curve through every distinct threshold.

    Args:
        scores: ``[M]`` confidences.
        correct: ``[M]`` booleans.

    Returns:
        AUC in [0, 1]; NaN when all predictions are correct or all are wrong (undefined).

    Raises:
        InvalidArgumentError: empty input, length mismatch or NaN scores.
    """
    s, t = calibration_vectors(scores, correct)
    num_pos = int(t.sum())
    num_neg = t.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    order = torch.argsort(s, stable=True)
    sorted_s = s[order]
    # Average rank (1-based) of each tie group.
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2
    ranks = avg_rank[inverse]
    rank_sum_pos = ranks[t[order]].sum().item()
    return (rank_sum_pos - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


@dataclass(frozen=True)
class RocCurve:
    """ROC points, one per distinct threshold, from (0, 0) to (1, 1).

    Attributes:
        fpr: false-positive rates ``[P]`` (wrong predictions with ``score >= threshold``).
        tpr: true-positive rates ``[P]``.
        thresholds: ``[P]``; the first is ``+inf`` (nothing accepted).
    """

    fpr: list[float]
    tpr: list[float]
    thresholds: list[float]


def roc_curve(scores: torch.Tensor | Sequence[float], correct: torch.Tensor | Sequence[bool]
              ) -> RocCurve:
    """ROC curve of ``scores`` against ``correct`` (thresholds at every distinct score).

    Raises:
        InvalidArgumentError: empty input, length mismatch or NaN scores.
    """
    s, t = calibration_vectors(scores, correct)
    order = torch.argsort(s, descending=True, stable=True)
    s, t = s[order], t[order].double()
    values, counts = torch.unique_consecutive(s, return_counts=True)
    ends = torch.cumsum(counts, 0) - 1
    tp = torch.cumsum(t, 0)[ends]
    fp = (ends + 1).double() - tp
    num_pos, num_neg = float(t.sum()), float(t.numel() - t.sum())
    tpr = (tp / num_pos).tolist() if num_pos else [0.0] * len(values)
    fpr = (fp / num_neg).tolist() if num_neg else [0.0] * len(values)
    return RocCurve([0.0] + fpr, [0.0] + tpr, [math.inf] + values.tolist())


@dataclass(frozen=True)
class Realised:
    """What the rule ``confidence >= τ`` does on a set of tokens.

    Attributes:
        coverage: fraction of tokens accepted, in [0, 1].
        precision: fraction of the accepted tokens that are correct; NaN if none accepted.
    """

    coverage: float
    precision: float


def realised(scores: torch.Tensor, correct: torch.Tensor, value: float) -> Realised:
    """Apply a threshold ``value`` to held-out ``scores`` ``[M]`` with ``correct`` ``[M]``
    (e.g. a test split, to check that the calibrated precision carries over)."""
    if scores.numel() == 0:
        return Realised(0.0, math.nan)
    accepted = scores.double() >= value
    n = int(accepted.sum())
    precision = float(correct.bool()[accepted].double().mean()) if n else math.nan
    return Realised(n / scores.numel(), precision)
