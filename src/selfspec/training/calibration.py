"""Calibration analysis of exit heads: ROC AUC, ROC curves and the realised precision of a
threshold on held-out tokens (DSSD §3.4.1, §4.2).

The confidence metrics and the threshold rule τ_k(ε) themselves are decode-time code
(:mod:`selfspec.heads.calibration`); this module measures how well a metric separates
correct from wrong head predictions and checks that a threshold keeps its precision on a
test split. :data:`DEFAULT_EPSILONS` is the ε sweep ``selfspec heads train | calibrate``
stores in head files.

The stage ``selfspec heads calibrate``: :func:`calibrate` (τ_k(ε) from the calibration split,
checked on the test split) and :func:`calibrate_file` (load, calibrate, save).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.heads.calibration import (
    CONFIDENCE_METRICS,
    calibration_vectors,
    check_epsilon,
    check_metric,
    confidences,
    thresholds,
)
from selfspec.heads.card import HeadCalibration, MetricCalibration, ThresholdRow
from selfspec.heads.files import (
    CalibrationSet,
    ExitHeads,
    find_head_file,
    load_heads,
    model_name,
    save_heads,
)
from selfspec.heads.modules import ExitHead
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet
from selfspec.training.pipeline import (
    HEAD_USES,
    DataRequest,
    StageTimes,
    TrainOutcome,
    card_request,
    model_eos_ids,
    prepare_features,
)

DEFAULT_EPSILONS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)  # DSSD §4.2 sweep


def roc_auc(scores: torch.Tensor | Sequence[float],
            correct: torch.Tensor | Sequence[bool]) -> float:
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


@torch.inference_mode()
def head_scores(head: ExitHead, features: FeatureSet, indices: torch.Tensor,
                metrics: Sequence[str], batch_tokens: int = 512,
                vocab_rows: torch.Tensor | None = None) -> CalibrationSet:
    """Confidences and correctness (DSSD eq. 2) of ``head`` on ``features[indices]``; with
    ``vocab_rows`` ``[R]``, of the head restricted to those tokens (confidence over the R
    logits, correct when its argmax row is the final layer's token)."""
    correct, scores = [], {m: [] for m in metrics}
    for start in range(0, indices.numel(), batch_tokens):
        idx = indices[start:start + batch_tokens]
        logits = head(features.hidden[head.layer][idx].unsqueeze(0), vocab_rows)[0]  # [n, V|R]
        top = logits.argmax(-1)
        correct.append((top if vocab_rows is None else vocab_rows[top])
                       == features.teacher_token[idx])
        for m, v in confidences(logits, metrics).items():
            scores[m].append(v)
    return CalibrationSet(head.layer, torch.cat(correct),
                          {m: torch.cat(v) for m, v in scores.items()})


def _metric_report(cal: CalibrationSet, test: CalibrationSet | None, metric: str,
                   epsilons: Sequence[float]) -> MetricCalibration:
    """AUC and the ε sweep of one metric, realised on the test tokens."""
    rows = []
    for t in thresholds(cal.scores[metric], cal.correct, epsilons):
        r = realised(test.scores[metric], test.correct, t.value) if test else None
        rows.append(ThresholdRow(t.epsilon, t.value, t.coverage, t.precision,
                                 r.coverage if r else math.nan, r.precision if r else math.nan))
    return MetricCalibration(metric, roc_auc(cal.scores[metric], cal.correct),
                             roc_auc(test.scores[metric], test.correct) if test else math.nan, rows)


def calibrate(heads: ExitHeads, features: FeatureSet, metrics: Sequence[str] = CONFIDENCE_METRICS,
              epsilons: Sequence[float] = DEFAULT_EPSILONS,
              draft_vocabs: Sequence[int] | None = None,
              eos_ids: Sequence[int] = ()) -> None:
    """DSSD §3.4.1 on the calibration split, checked on the test split; fills
    ``heads.calibration`` and the card's calibration section in place, and
    ``heads.token_counts`` (the final layer's greedy tokens on the training split, which rank
    the reduced draft vocabulary of ``draft_vocab``).

    Args:
        draft_vocabs: sizes K to calibrate on the K most frequent tokens as well (plus
            ``eos_ids``, as decoding keeps them), for DSSD with ``draft_vocab=K``; ``None`` =
            the sizes the heads were calibrated for before (their token ranking changes with
            the counts, so they are redone).
        eos_ids: EOS ids a reduced draft vocabulary always keeps (the model config's).

    Raises:
        InvalidArgumentError: no calibration tokens, bad metric, ε or draft vocabulary size.
    """
    from selfspec.decoding.drafting.draft_vocab import check_draft_vocab, frequent_rows

    metrics = [check_metric(m) for m in metrics]
    epsilons = sorted(check_epsilon(e) for e in epsilons)
    vocab_size = heads.card.vocab_size
    sizes = sorted({check_draft_vocab(k, vocab_size) for k in (
        heads.vocab_calibration if draft_vocabs is None else draft_vocabs)})
    cal_idx, test_idx = features.indices(CALIBRATION), features.indices(TEST)
    if cal_idx.numel() == 0:
        raise InvalidArgumentError("no calibration tokens: give more data (--tokens, --data)")
    train_idx = features.indices(TRAIN)
    heads.token_counts = torch.bincount(features.teacher_token[train_idx].to(torch.int64),
                                        minlength=vocab_size)
    reports = []
    for head in heads.heads:
        cal = head_scores(head, features, cal_idx, metrics)
        test = head_scores(head, features, test_idx, metrics) if test_idx.numel() else None
        heads.calibration[head.layer] = cal
        reports.append(HeadCalibration(
            head.layer, cal.correct.numel(), float(cal.correct.float().mean()),
            0 if test is None else test.correct.numel(),
            math.nan if test is None else float(test.correct.float().mean()),
            [_metric_report(cal, test, m, epsilons) for m in metrics]))
    heads.vocab_calibration = {}
    for k in sizes:
        rows = frequent_rows(heads.token_counts, k, eos_ids).rows
        rows = rows.to(features.teacher_token.device)
        heads.vocab_calibration[k] = {
            head.layer: head_scores(head, features, cal_idx, metrics, vocab_rows=rows)
            for head in heads.heads}
    heads.card.calibration = reports
    heads.card.calibration_metrics = list(metrics)
    heads.card.calibration_epsilons = list(epsilons)
    heads.card.calibration_draft_vocabs = sizes


def calibrate_file(engine: Engine, path: str, request: DataRequest | None = None,
                   metrics: Sequence[str] = CONFIDENCE_METRICS,
                   epsilons: Sequence[float] = DEFAULT_EPSILONS, progress: bool = True,
                   draft_vocabs: Sequence[int] | None = None) -> TrainOutcome:
    """``selfspec heads calibrate``: load heads, calibrate on held-out text, save in place.

    The text defaults to what the heads were trained on (the card's data and token count),
    whose held-out problems are then the same as at training time. ``draft_vocabs``: sizes K
    to calibrate on the K most frequent tokens too (``None`` = those calibrated before).
    """
    target = find_head_file(path, model_name(engine))
    heads = load_heads(target, engine)
    if request is None:
        info = heads.card.training
        request = card_request(info) if info else DataRequest()
    times = StageTimes()
    data = prepare_features(engine, request, heads.layers, times, progress)
    features = data.features
    t0 = time.perf_counter()
    calibrate(heads, features, metrics, epsilons, draft_vocabs, model_eos_ids(engine))
    # Token counts (the draft-vocabulary ranking) come from this corpus's training split:
    # its prompts join the training record; calibration and test prompts are replaced.
    heads.card.set_prompts(data.uses(HEAD_USES), replace=("calibration", "test"))
    times.calibrate_s = time.perf_counter() - t0
    save_heads(heads, target)
    return TrainOutcome(target, heads, times, features.count(TRAIN),
                        features.count(CALIBRATION) + features.count(TEST))
