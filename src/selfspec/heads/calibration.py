"""Confidence metrics and calibrated thresholds τ_k(ε) (DSSD §3.4.1), as used while decoding.

ROC AUC, ROC curves and the ε sweep of ``selfspec heads calibrate`` are training-side
(:mod:`selfspec.training.calibration`).

Every metric here is a *confidence*: higher means more confident, so one rule serves all of
them — a head's prediction is used when ``confidence >= τ`` (DSSD §3.4.2, ``c_k ≥ τ_k``):

- ``max_prob``: ``max_v p_v`` (probability, in [0, 1]);
- ``entropy``: ``-H(p) = Σ_v p_v log p_v`` in nats (<= 0). DSSD §4.3.1 writes the entropy
  rule as ``H(p_k) < τ_k``; with the confidence ``c = -H`` the same rule reads
  ``c >= -τ``, i.e. ``H <= -τ`` for the ``τ`` returned here;
- ``margin``: ``p_(1) - p_(2)``, the gap between the two largest probabilities ("breaking
  ties"), in [0, 1].

Correctness of a prediction (DSSD eq. 2): ``t = 1{argmax p_head = argmax p_model}``.

Thresholds follow DSSD §3.4.1: sort the calibration confidences ascending,
``c_1 <= ... <= c_M``, with correctness ``t_i`` in the same order; ``ĵ`` is the smallest index
with ``Σ_{i>=ĵ} t_i / (M - ĵ + 1) >= ε`` and ``τ = c_ĵ``. Edge cases, decided here:

- ties: the formula is evaluated only at the first index of each run of equal confidences.
  The paper's prose defines the proportion over "all samples with higher (or equal) metric
  values" — exactly the set ``{i : c_i >= τ}`` that the inference rule ``c >= τ`` accepts —
  while an index inside a run of ties would count only part of the equal values. So the
  proportion we guarantee on the calibration set is the one inference realises.
- all predictions correct: ``ĵ = 1``, ``τ = c_1`` (every token exits).
- no ``ĵ`` satisfies the inequality (e.g. none correct and ``ε > 0``): ``τ = +inf``, the head
  is never used. ``ε = 0`` always gives ``τ = c_1``.
- an empty calibration set is an error (there is nothing to calibrate on).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError

CONFIDENCE_METRICS = ("max_prob", "entropy", "margin")
DEFAULT_METRIC = "entropy"  # DSSD §3.4.1: entropy has the highest AUC on every Pythia model.


def check_metric(metric: str) -> str:
    """Raises InvalidArgumentError unless ``metric`` is one of :data:`CONFIDENCE_METRICS`."""
    if metric not in CONFIDENCE_METRICS:
        raise InvalidArgumentError(
            f"unknown confidence metric {metric!r}; choose one of {', '.join(CONFIDENCE_METRICS)}")
    return metric


def check_epsilon(epsilon: float) -> float:
    """Raises InvalidArgumentError unless ``0 <= epsilon <= 1`` (DSSD §3.1)."""
    if (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float))
            or not 0.0 <= epsilon <= 1.0):
        raise InvalidArgumentError(f"epsilon must be a number in [0, 1], got {epsilon!r}")
    return float(epsilon)


def confidences(logits: torch.Tensor, metrics: Sequence[str] = CONFIDENCE_METRICS
                ) -> dict[str, torch.Tensor]:
    """Confidence scores of the softmax of ``logits`` (computed in float32).

    Args:
        logits: ``[..., V]``.
        metrics: names from :data:`CONFIDENCE_METRICS`.

    Returns:
        ``{metric: [...]}`` float32 tensors (higher = more confident; see the module doc).

    Raises:
        InvalidArgumentError: an unknown metric.
    """
    for m in metrics:
        check_metric(m)
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    out: dict[str, torch.Tensor] = {}
    if "max_prob" in metrics or "margin" in metrics:
        top2 = p.topk(2, dim=-1).values if p.shape[-1] > 1 else torch.cat(
            [p, torch.zeros_like(p)], dim=-1)
        if "max_prob" in metrics:
            out["max_prob"] = top2[..., 0]
        if "margin" in metrics:
            out["margin"] = top2[..., 0] - top2[..., 1]
    if "entropy" in metrics:
        # p log p with the 0·log 0 = 0 convention (log_softmax can give -inf on underflow).
        out["entropy"] = torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
    return out


def confidence(logits: torch.Tensor, metric: str = DEFAULT_METRIC) -> torch.Tensor:
    """One confidence metric of ``logits`` ``[..., V]`` → ``[...]`` (see :func:`confidences`)."""
    return confidences(logits, (metric,))[metric]


def calibration_vectors(scores: torch.Tensor | Sequence[float],
                        correct: torch.Tensor | Sequence[bool]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` as float64 ``[M]`` and ``correct`` as bool ``[M]``, checked.

    Raises:
        InvalidArgumentError: empty input, length mismatch or NaN scores.
    """
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    t = torch.as_tensor(correct).reshape(-1).to(torch.bool)
    if s.shape != t.shape:
        raise InvalidArgumentError(
            f"scores and correctness must have the same length, got {s.numel()} and {t.numel()}")
    if s.numel() == 0:
        raise InvalidArgumentError("the calibration set is empty: nothing to calibrate on")
    if torch.isnan(s).any():
        raise InvalidArgumentError("confidence scores contain NaN")
    return s, t


@dataclass(frozen=True)
class Threshold:
    """A calibrated threshold τ_k(ε) (DSSD §3.4.1) and what it does on the calibration set.

    Attributes:
        epsilon: the accuracy level ε asked for.
        value: ``τ = c_ĵ`` in confidence units (use the prediction when ``confidence >= value``);
            ``+inf`` when no ``ĵ`` exists (the head is never used).
        index: ``ĵ`` as a 1-based index into the ascending order (as in the paper), or
            ``None`` when no ``ĵ`` exists.
        coverage: fraction of calibration tokens with ``confidence >= value``, in [0, 1].
        precision: fraction of those that are correct (``>= epsilon``); NaN when coverage is 0.
    """

    epsilon: float
    value: float
    index: int | None
    coverage: float
    precision: float


def thresholds(scores: torch.Tensor | Sequence[float], correct: torch.Tensor | Sequence[bool],
               epsilons: Sequence[float]) -> list[Threshold]:
    """τ(ε) for several ε from one sort (DSSD §3.4.1; ties etc. as in the module doc).

    Args:
        scores: ``[M]`` calibration confidences ``c_k``.
        correct: ``[M]`` correctness ``t_k`` (DSSD eq. 2).
        epsilons: accuracy levels in [0, 1].

    Returns:
        One :class:`Threshold` per ε, in the order given.

    Raises:
        InvalidArgumentError: empty input, length mismatch, NaN scores or ε outside [0, 1].
    """
    eps = [check_epsilon(e) for e in epsilons]
    s, t = calibration_vectors(scores, correct)
    total = s.numel()
    order = torch.argsort(s, stable=True)
    s, t = s[order], t[order].double()
    # suffix_correct[j] = Σ_{i >= j} t_i (0-based j); the suffix has total - j samples.
    suffix_correct = torch.flip(torch.cumsum(torch.flip(t, (0,)), 0), (0,))
    starts = torch.ones(total, dtype=torch.bool)
    starts[1:] = s[1:] != s[:-1]  # first index of each run of equal confidences
    start_idx = torch.nonzero(starts).reshape(-1)
    count = (total - start_idx).double()
    precision = suffix_correct[start_idx] / count  # correctly rounded division, float64
    out = []
    for e in eps:
        ok = torch.nonzero(precision >= e).reshape(-1)
        if ok.numel() == 0:
            out.append(Threshold(e, math.inf, None, 0.0, math.nan))
            continue
        g = int(ok[0])
        j = int(start_idx[g])
        out.append(Threshold(e, float(s[j]), j + 1, float(count[g]) / total, float(precision[g])))
    return out


def threshold(scores: torch.Tensor | Sequence[float], correct: torch.Tensor | Sequence[bool],
              epsilon: float) -> Threshold:
    """τ(ε) for one ε; see :func:`thresholds`."""
    return thresholds(scores, correct, [epsilon])[0]
