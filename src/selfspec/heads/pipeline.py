"""The stages behind ``selfspec heads train | calibrate | train-probe``, as functions.

    corpus (real text, on-policy generations) → features (one backbone pass, cached)
      → train heads → save → calibrate (DSSD §3.4.1) → save
      → train probes (AdaSPEED §II.B) → save

Each stage takes and returns dataclasses; the CLI only parses arguments and prints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.heads.calibration import (
    CONFIDENCE_METRICS,
    DEFAULT_EPSILONS,
    check_epsilon,
    check_metric,
    confidences,
    realised,
    roc_auc,
    thresholds,
)
from selfspec.heads.card import (
    HeadCalibration,
    HeadEval,
    MetricCalibration,
    ProbeCard,
    ThresholdRow,
    TrainingInfo,
)
from selfspec.heads.corpus import CALIBRATION, TEST, TRAIN, build_corpus, parse_data_spec
from selfspec.heads.features import FeatureSet, load_features
from selfspec.heads.files import (
    DEFAULT_PROBES,
    CalibrationSet,
    ExitHeads,
    load_heads,
    model_name,
    new_card,
    resolve_path,
    save_heads,
)
from selfspec.heads.fingerprint import fingerprint
from selfspec.heads.modules import ExitHead, output_layer
from selfspec.heads.placement import check_layers, default_layers
from selfspec.heads.probe import LinearProbe, ProbeTrainConfig, fit_probe
from selfspec.heads.train import TrainConfig, train_heads

logger = logging.getLogger(__name__)

DEFAULT_DATA = "humaneval,gsm,onpolicy:humaneval,onpolicy:mtbench"
DEFAULT_TOKENS = 40_000


def cache_root(engine: Any) -> Path:
    """``$SELFSPEC_HOME/heads-cache/<model>/<fingerprint>/``: on-policy generations and
    feature caches of one model (the dtype is part of each entry's key)."""
    from selfspec.heads.files import _safe_name
    from selfspec.models.provision import selfspec_home

    fp = fingerprint(engine.executor.config, output_layer(engine))
    return selfspec_home() / "heads-cache" / _safe_name(model_name(engine)) / fp.short()


@dataclass(frozen=True)
class DataRequest:
    """Which text to use.

    Attributes:
        data: data spec (see :mod:`selfspec.heads.corpus`).
        tokens: scored training tokens over all sources.
        max_new_tokens: length cap of on-policy generations.
        max_len: sequence length cap.
        seed: problem order.
    """

    data: str = DEFAULT_DATA
    tokens: int = DEFAULT_TOKENS
    max_new_tokens: int = 256
    max_len: int = 1024
    seed: int = 0


@dataclass
class StageTimes:
    """Wall time of each stage, in seconds (``None`` = not run)."""

    corpus_s: float = 0.0
    features_s: float = 0.0
    train_s: float = 0.0
    calibrate_s: float = 0.0
    probe_s: float = 0.0


def prepare_features(engine: Any, request: DataRequest, layers: Sequence[int],
                     times: StageTimes, progress: bool = True) -> FeatureSet:
    """Corpus + cached backbone features at ``layers`` (on-policy text generated if needed)."""
    data = parse_data_spec(request.data)
    root = cache_root(engine)
    t0 = time.perf_counter()
    max_len = min(request.max_len, engine.executor.max_positions)
    items = build_corpus(engine, data, request.tokens, root, max_new_tokens=request.max_new_tokens,
                         max_len=max_len, seed=request.seed, progress=progress)
    t1 = time.perf_counter()
    features = load_features(engine.executor, items, layers, root, progress=progress)
    t2 = time.perf_counter()
    times.corpus_s += t1 - t0
    times.features_s += t2 - t1
    return features


# ------------------------------------------------------------------------------ train
@dataclass(frozen=True)
class TrainRequest:
    """``selfspec heads train``.

    Attributes:
        layers: exit layers, or ``None`` for DSSD eq. (1) with ``K = 4``.
        train: :class:`TrainConfig`.
        data: :class:`DataRequest`.
        out: where to save (``None`` = the model's default heads directory).
        calibrate: calibrate after training.
        epsilons / metrics: calibration sweep.
    """

    layers: tuple[int, ...] | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataRequest = field(default_factory=DataRequest)
    out: str | None = None
    calibrate: bool = True
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS
    metrics: tuple[str, ...] = CONFIDENCE_METRICS


@dataclass
class TrainOutcome:
    """What ``selfspec heads train`` produced."""

    path: Path
    heads: ExitHeads
    times: StageTimes
    train_tokens: int
    eval_tokens: int


def dtype_label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def train(engine: Any, request: TrainRequest, progress: bool = True) -> TrainOutcome:
    """Train heads for ``engine``'s model, save them, calibrate them (see module doc).

    Raises:
        InvalidArgumentError: bad layers or options.
        KeyboardInterrupt: passed on; no head file is written before training completes.
    """
    num_layers = engine.executor.num_layers
    layers = check_layers(request.layers, num_layers) if request.layers else default_layers(num_layers)
    times = StageTimes()
    features = prepare_features(engine, request.data, layers, times, progress)
    out = output_layer(engine)
    result = train_heads(out, features, layers, request.train, progress=progress)
    times.train_s = result.seconds
    cfg = request.train
    card = new_card(engine, cfg.kind, layers)
    card.training = TrainingInfo(
        loss=cfg.loss, kl_direction=cfg.kl_direction, alpha=cfg.alpha,
        data=parse_data_spec(request.data.data), train_tokens=result.train_tokens,
        eval_tokens=result.eval_tokens, epochs=cfg.epochs, lr=cfg.lr,
        batch_tokens=cfg.batch_tokens, compute_dtype=cfg.compute_dtype,
        feature_dtype=dtype_label(engine.executor.dtype), init=cfg.init, seed=request.data.seed,
        seconds=result.seconds, requested_tokens=request.data.tokens,
        max_new_tokens=request.data.max_new_tokens, max_len=request.data.max_len)
    card.heads = [HeadEval(a.layer, a.tokens, b.agreement, a.agreement, b.kl, a.kl,
                           a.confident_fraction, a.confident_agreement)
                  for b, a in zip(result.before, result.after)]
    target = resolve_path(request.out or "default", model_name(engine))
    save_heads(ExitHeads(layers, result.heads, card), target)
    heads = load_heads(target, engine)  # the heads exactly as inference will see them
    if request.calibrate:
        t0 = time.perf_counter()
        calibrate(heads, features, request.metrics, request.epsilons)
        times.calibrate_s = time.perf_counter() - t0
        save_heads(heads, target)
    return TrainOutcome(target, heads, times, result.train_tokens, result.eval_tokens)


# -------------------------------------------------------------------------- calibrate
@torch.inference_mode()
def head_scores(head: ExitHead, features: FeatureSet, indices: torch.Tensor,
                metrics: Sequence[str], batch_tokens: int = 512) -> CalibrationSet:
    """Confidences and correctness (DSSD eq. 2) of ``head`` on ``features[indices]``."""
    correct, scores = [], {m: [] for m in metrics}
    for start in range(0, indices.numel(), batch_tokens):
        idx = indices[start:start + batch_tokens]
        logits = head(features.hidden[head.layer][idx].unsqueeze(0))[0]  # [n, V]
        correct.append(logits.argmax(-1) == features.teacher_token[idx])
        for m, v in confidences(logits, metrics).items():
            scores[m].append(v)
    return CalibrationSet(head.layer, torch.cat(correct), {m: torch.cat(v) for m, v in scores.items()})


def calibrate(heads: ExitHeads, features: FeatureSet, metrics: Sequence[str] = CONFIDENCE_METRICS,
              epsilons: Sequence[float] = DEFAULT_EPSILONS) -> None:
    """DSSD §3.4.1 on the calibration split, checked on the test split; fills
    ``heads.calibration`` and the card's calibration section in place, and
    ``heads.token_counts`` (the final layer's greedy tokens on the training split, which rank
    the reduced draft vocabulary of ``draft_vocab``).

    Raises:
        InvalidArgumentError: no calibration tokens, bad metric or ε.
    """
    metrics = [check_metric(m) for m in metrics]
    epsilons = sorted(check_epsilon(e) for e in epsilons)
    cal_idx, test_idx = features.indices(CALIBRATION), features.indices(TEST)
    if cal_idx.numel() == 0:
        raise InvalidArgumentError("no calibration tokens: give more data (--tokens, --data)")
    reports = []
    for head in heads.heads:
        cal = head_scores(head, features, cal_idx, metrics)
        test = head_scores(head, features, test_idx, metrics) if test_idx.numel() else None
        heads.calibration[head.layer] = cal
        per_metric = []
        for m in metrics:
            rows = []
            for t in thresholds(cal.scores[m], cal.correct, epsilons):
                r = realised(test.scores[m], test.correct, t.value) if test else None
                rows.append(ThresholdRow(t.epsilon, t.value, t.coverage, t.precision,
                                         r.coverage if r else math.nan,
                                         r.precision if r else math.nan))
            per_metric.append(MetricCalibration(
                m, roc_auc(cal.scores[m], cal.correct),
                roc_auc(test.scores[m], test.correct) if test else math.nan, rows))
        reports.append(HeadCalibration(
            head.layer, cal.correct.numel(), float(cal.correct.float().mean()),
            0 if test is None else test.correct.numel(),
            math.nan if test is None else float(test.correct.float().mean()), per_metric))
    heads.card.calibration = reports
    train_idx = features.indices(TRAIN)
    heads.token_counts = torch.bincount(features.teacher_token[train_idx].to(torch.int64),
                                        minlength=heads.card.vocab_size)
    heads.card.calibration_metrics = list(metrics)
    heads.card.calibration_epsilons = list(epsilons)


def calibrate_file(engine: Any, path: str, request: DataRequest | None = None,
                   metrics: Sequence[str] = CONFIDENCE_METRICS,
                   epsilons: Sequence[float] = DEFAULT_EPSILONS, progress: bool = True
                   ) -> TrainOutcome:
    """``selfspec heads calibrate``: load heads, calibrate on held-out text, save in place.

    The text defaults to what the heads were trained on (the card's data and token count),
    whose held-out problems are then the same as at training time.
    """
    target = resolve_path(path, model_name(engine))
    heads = load_heads(target, engine)
    if request is None:
        info = heads.card.training
        request = (DataRequest(",".join(info.data), info.requested_tokens or info.train_tokens,
                               info.max_new_tokens, info.max_len, info.seed)
                   if info else DataRequest())
    times = StageTimes()
    features = prepare_features(engine, request, heads.layers, times, progress)
    t0 = time.perf_counter()
    calibrate(heads, features, metrics, epsilons)
    times.calibrate_s = time.perf_counter() - t0
    save_heads(heads, target)
    return TrainOutcome(target, heads, times, features.count(TRAIN),
                        features.count(CALIBRATION) + features.count(TEST))


# ------------------------------------------------------------------------------ probe
@dataclass(frozen=True)
class ProbeRequest:
    """``selfspec heads train-probe``.

    Attributes:
        exit_layer: the layer the draft exits at.
        heads: head file whose head at ``exit_layer`` drafts (``None`` = the model's own final
            norm + ``lm_head``, as LayerSkip/AdaSPEED draft); the probe is saved into it.
        out: where to save an ``lm_head`` probe (``None`` = ``<model>/probes/`` next to the
            default heads).
        data: :class:`DataRequest`.
        config: :class:`ProbeTrainConfig`.
    """

    exit_layer: int
    heads: str | None = None
    out: str | None = None
    data: DataRequest = field(default_factory=DataRequest)
    config: ProbeTrainConfig = field(default_factory=ProbeTrainConfig)


@dataclass(frozen=True)
class Drafts:
    """Draft predictions at an exit layer: ``tokens`` ``[N]`` (argmax) and ``max_prob`` ``[N]``."""

    tokens: torch.Tensor
    max_prob: torch.Tensor


@torch.inference_mode()
def draft_predictions(engine: Any, head: ExitHead | None, hidden: torch.Tensor,
                      batch_tokens: int = 512) -> Drafts:
    """What an early-exit drafter predicts from exit-layer states ``[N, H]`` with ``head``
    (``None`` = the model's final norm + ``lm_head``)."""
    tokens, top = [], []
    for start in range(0, hidden.shape[0], batch_tokens):
        h = hidden[start:start + batch_tokens].unsqueeze(0)
        logits = engine.executor.logits(h, head)[0].float()
        tokens.append(logits.argmax(-1))
        top.append(torch.softmax(logits, -1).max(-1).values)
    return Drafts(torch.cat(tokens), torch.cat(top))


def train_probe(engine: Any, request: ProbeRequest, progress: bool = True) -> TrainOutcome:
    """Fit an AdaSPEED probe at ``request.exit_layer`` and save it (see :class:`ProbeRequest`).

    Raises:
        InvalidArgumentError: exit layer outside ``[1, L-1]`` or no data.
    """
    layer = check_layers([request.exit_layer], engine.executor.num_layers)[0]
    if request.heads is not None:
        target = resolve_path(request.heads, model_name(engine))
        container = load_heads(target, engine)
    else:
        target = resolve_path(request.out or DEFAULT_PROBES, model_name(engine))
        container = (load_heads(target, engine) if target.is_file()
                     else ExitHeads([], [], new_card(engine, None, [])))
    head = container.head_at(layer) if layer in container.layers else None
    times = StageTimes()
    features = prepare_features(engine, request.data, [layer], times, progress)
    t0 = time.perf_counter()
    hidden = features.hidden[layer]
    drafts = draft_predictions(engine, head, hidden)
    accepted = drafts.tokens == features.teacher_token
    train_idx, eval_idx = features.indices(TRAIN), features.indices(CALIBRATION, TEST)
    if train_idx.numel() == 0 or eval_idx.numel() == 0:
        raise InvalidArgumentError("the probe needs training and held-out tokens; give more data")
    probe = fit_probe(layer, hidden[train_idx], accepted[train_idx], request.config)
    seconds = time.perf_counter() - t0
    times.probe_s = seconds
    stats = probe_stats(probe, hidden[eval_idx], accepted[eval_idx], drafts.max_prob[eval_idx])
    container.probes[layer] = probe
    container.card.probes = [p for p in container.card.probes if p.exit_layer != layer]
    container.card.probes.append(ProbeCard(
        exit_layer=layer, draft_head="exit_head" if head is not None else "lm_head",
        train_tokens=int(train_idx.numel()), eval_tokens=int(eval_idx.numel()),
        base_rate=stats.base_rate, accuracy=stats.accuracy, auc=stats.auc,
        max_prob_auc=stats.max_prob_auc, bce=stats.bce, seconds=seconds))
    container.card.probes.sort(key=lambda p: p.exit_layer)
    save_heads(container, target)
    return TrainOutcome(target, container, times, int(train_idx.numel()), int(eval_idx.numel()))


@dataclass(frozen=True)
class ProbeStats:
    """Held-out quality of a probe (see :class:`~selfspec.heads.card.ProbeCard`)."""

    base_rate: float
    accuracy: float
    auc: float
    max_prob_auc: float
    bce: float


@torch.inference_mode()
def probe_stats(probe: LinearProbe, hidden: torch.Tensor, accepted: torch.Tensor,
                max_prob: torch.Tensor) -> ProbeStats:
    """Accuracy, AUC and BCE of ``probe`` on ``hidden`` ``[N, H]`` against ``accepted`` ``[N]``,
    with the AUC of the draft's own max-probability ``[N]`` for comparison."""
    logit = probe.logit(hidden)
    prob = torch.sigmoid(logit)
    y = accepted.float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, y).item()
    return ProbeStats(float(y.mean()), float(((prob >= 0.5) == accepted).float().mean()),
                      roc_auc(prob, accepted), roc_auc(max_prob, accepted), bce)
