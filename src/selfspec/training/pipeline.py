"""The stages behind ``selfspec heads train | calibrate | train-probe | train-drafter |
train-predictors | tune-adadecode``, as functions.

    corpus (real text, on-policy generations) → features (one backbone pass, cached)
      → train heads → save → calibrate (DSSD §3.4.1) → save
      → train probes (AdaSPEED §II.B) → save
      → train SpecEE's next-token drafter (its EAGLE role, §4) → save
      → train SpecEE predictors (SpecEE §4-5) → save
      → tune AdaDecode's thresholds by replay → save

Each stage takes and returns dataclasses; the CLI only parses arguments and prints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import cached_latency
from selfspec.executor.cpu import detect_cpu
from selfspec.heads.calibration import (
    CONFIDENCE_METRICS,
    check_epsilon,
    check_metric,
    confidences,
    thresholds,
)
from selfspec.heads.card import (
    AdaDecodeCard,
    DrafterCard,
    HeadCalibration,
    HeadEval,
    MetricCalibration,
    PredictorCard,
    PredictorTuning,
    ProbeCard,
    PromptUse,
    ThresholdRow,
    TrainingInfo,
)
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.files import (
    DEFAULT_PROBES,
    CalibrationSet,
    ExitHeads,
    find_head_file,
    load_heads,
    model_name,
    new_card,
    resolve_path,
    save_heads,
)
from selfspec.heads.fingerprint import fingerprint
from selfspec.heads.modules import ExitHead, output_layer
from selfspec.heads.predictor import ExitPredictors
from selfspec.heads.probe import LinearProbe
from selfspec.training.adadecode_tuning import (
    DEFAULT_ROW_COST,
    HeadTrace,
    ScheduleCosts,
    output_cost_from_latency,
    row_cost_from_latency,
)
from selfspec.training.adadecode_tuning import simulate as simulate_schedule
from selfspec.training.adadecode_tuning import tune as tune_schedule
from selfspec.training.calibration import DEFAULT_EPSILONS, realised, roc_auc
from selfspec.training.corpus import (
    CALIBRATION,
    ONPOLICY,
    SPLIT_NAMES,
    TEST,
    TRAIN,
    CorpusItem,
    build_corpus,
    dataset_of,
    items_by_use,
    parse_data_spec,
    source_weight,
)
from selfspec.training.drafter import (
    DrafterPositions,
    DrafterTrainConfig,
    drafter_inputs,
    drafter_positions,
    evaluate_drafter,
    fit_drafter,
)
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet, by_source, load_features
from selfspec.training.placement import check_layers, default_layers
from selfspec.training.predictors import (
    PredictorData,
    PredictorEval,
    PredictorTrainConfig,
    exit_figures,
    fit_predictors,
    offline_schedule,
    predictor_data,
    predictor_probs,
)
from selfspec.training.probe import ProbeTrainConfig, fit_probe
from selfspec.training.specee_tuning import (
    DEFAULT_MAX_EARLY as SPECEE_DEFAULT_MAX_EARLY,
)
from selfspec.training.specee_tuning import (
    SpecEECosts,
    predictor_trace,
    tune_thresholds,
)
from selfspec.training.train import TrainConfig, train_heads

logger = logging.getLogger(__name__)

# Held out from every benchmark prompt set by construction: standard-library functions as
# code (teacher-forced bodies and the model's own completions) and ShareGPT chat requests
# that are not in sharegpt-summarize (the model's own answers). No HumanEval, MT-Bench, GSM
# or sharegpt-summarize prompt is used, so none is dropped from a benchmark.
DEFAULT_DATA = "stdlib,onpolicy:stdlib,onpolicy:sharegpt-chat"
DEFAULT_TOKENS = 40_000


def cache_root(engine: Engine) -> Path:
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
        data: data spec (see :mod:`selfspec.training.corpus`).
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
    predictors_s: float = 0.0


@dataclass
class PreparedData:
    """A corpus and its backbone features.

    Attributes:
        items: the corpus (which prompt each sequence came from, and its split).
        features: cached backbone features of ``items`` at the requested layers.
    """

    items: list[CorpusItem]
    features: FeatureSet

    def uses(self, uses: dict[int, str]) -> list[PromptUse]:
        """Prompt records for the card (see :func:`~selfspec.training.corpus.items_by_use`)."""
        return items_by_use(self.items, uses)


HEAD_USES = {TRAIN: "train", CALIBRATION: "calibration", TEST: "test"}
PROBE_USES = {TRAIN: "probe-train", CALIBRATION: "probe-eval", TEST: "probe-eval"}


def prepare_features(engine: Engine, request: DataRequest, layers: Sequence[int],
                     times: StageTimes, progress: bool = True) -> PreparedData:
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
    return PreparedData(items, features)


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
        draft_vocabs: reduced draft-vocabulary sizes to calibrate as well (DSSD ``draft_vocab``).
    """

    layers: tuple[int, ...] | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataRequest = field(default_factory=DataRequest)
    out: str | None = None
    calibrate: bool = True
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS
    metrics: tuple[str, ...] = CONFIDENCE_METRICS
    draft_vocabs: tuple[int, ...] = ()


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


def train(engine: Engine, request: TrainRequest, progress: bool = True) -> TrainOutcome:
    """Train heads for ``engine``'s model, save them, calibrate them (see module doc).

    Raises:
        InvalidArgumentError: bad layers or options.
        KeyboardInterrupt: passed on; no head file is written before training completes.
    """
    num_layers = engine.executor.num_layers
    layers = check_layers(request.layers, num_layers) if request.layers else default_layers(num_layers)
    times = StageTimes()
    data = prepare_features(engine, request.data, layers, times, progress)
    features = data.features
    out = output_layer(engine)
    result = train_heads(out, features, layers, request.train, progress=progress,
                         eos_ids=_eos_ids(engine))
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
        max_new_tokens=request.data.max_new_tokens, max_len=request.data.max_len,
        loss_vocab=cfg.loss_vocab, cpu=detect_cpu().summary())
    card.set_prompts(data.uses(HEAD_USES))
    card.heads = [HeadEval(a.layer, a.tokens, b.agreement, a.agreement, b.kl, a.kl,
                           a.confident_fraction, a.confident_agreement)
                  for b, a in zip(result.before, result.after)]
    target = resolve_path(request.out or "default", model_name(engine))
    save_heads(ExitHeads(layers, result.heads, card), target)
    heads = load_heads(target, engine)  # the heads exactly as inference will see them
    if request.calibrate:
        t0 = time.perf_counter()
        calibrate(heads, features, request.metrics, request.epsilons, request.draft_vocabs,
                  _eos_ids(engine))
        times.calibrate_s = time.perf_counter() - t0
        save_heads(heads, target)
    return TrainOutcome(target, heads, times, result.train_tokens, result.eval_tokens)


# -------------------------------------------------------------------------- calibrate
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
    return CalibrationSet(head.layer, torch.cat(correct), {m: torch.cat(v) for m, v in scores.items()})


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


def _eos_ids(engine: Engine) -> tuple[int, ...]:
    from selfspec.models.eos import eos_token_ids

    return tuple(eos_token_ids(engine.executor.model))


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
        request = _card_request(info) if info else DataRequest()
    times = StageTimes()
    data = prepare_features(engine, request, heads.layers, times, progress)
    features = data.features
    t0 = time.perf_counter()
    calibrate(heads, features, metrics, epsilons, draft_vocabs, _eos_ids(engine))
    # Token counts (the draft-vocabulary ranking) come from this corpus's training split:
    # its prompts join the training record; calibration and test prompts are replaced.
    heads.card.set_prompts(data.uses(HEAD_USES), replace=("calibration", "test"))
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
        sampling: ``None`` = a greedy-decoding probe (label: draft argmax == final argmax);
            a sampling config = a sampled-decoding probe whose label is the expected
            acceptance of speculative sampling under that temperature / top-p.
    """

    exit_layer: int
    heads: str | None = None
    out: str | None = None
    data: DataRequest = field(default_factory=DataRequest)
    config: ProbeTrainConfig = field(default_factory=ProbeTrainConfig)
    sampling: SamplingConfig | None = None


@dataclass(frozen=True)
class Drafts:
    """Draft predictions at an exit layer, ``[N]`` each.

    Attributes:
        tokens: the draft argmax.
        max_prob: its untempered probability.
        expected_acceptance: ``Σ_x min(p(x), q(x))`` under the sampling settings (``None``
            for greedy): the probability that speculative sampling accepts a token drawn
            from the draft ``q`` given the target ``p`` (Leviathan et al. 2023, §3.3).
    """

    tokens: torch.Tensor
    max_prob: torch.Tensor
    expected_acceptance: torch.Tensor | None = None


@torch.inference_mode()
def draft_predictions(engine: Engine, head: ExitHead | None, hidden: torch.Tensor,
                      final: torch.Tensor | None = None, sampling: SamplingConfig | None = None,
                      batch_tokens: int = 512) -> Drafts:
    """What an early-exit drafter predicts from exit-layer states ``[N, H]`` with ``head``
    (``None`` = the model's final norm + ``lm_head``); with ``sampling`` and the last-layer
    states ``final`` ``[N, H]``, also each position's expected acceptance."""
    tokens, top, alpha = [], [], []
    for start in range(0, hidden.shape[0], batch_tokens):
        h = hidden[start:start + batch_tokens].unsqueeze(0)
        logits = engine.executor.logits(h, head)[0].float()
        tokens.append(logits.argmax(-1))
        top.append(torch.softmax(logits, -1).max(-1).values)
        if sampling is not None:
            target = engine.executor.logits(final[start:start + batch_tokens].unsqueeze(0))[0]
            q = logits_to_probs(logits, sampling)
            p = logits_to_probs(target.float(), sampling)
            alpha.append(torch.minimum(p, q).sum(-1).clamp(0.0, 1.0))
    return Drafts(torch.cat(tokens), torch.cat(top), torch.cat(alpha) if alpha else None)


def train_probe(engine: Engine, request: ProbeRequest, progress: bool = True) -> TrainOutcome:
    """Fit an AdaSPEED probe at ``request.exit_layer`` and save it (see :class:`ProbeRequest`).

    Raises:
        InvalidArgumentError: exit layer outside ``[1, L-1]``, a greedy ``sampling`` config,
            or no data.
    """
    layer = check_layers([request.exit_layer], engine.executor.num_layers)[0]
    sampling = request.sampling
    if sampling is not None and sampling.greedy:
        raise InvalidArgumentError("a sampled-decoding probe needs temperature > 0")
    if request.heads is not None:
        target = find_head_file(request.heads, model_name(engine))
        container = load_heads(target, engine)
    else:
        target = resolve_path(request.out or DEFAULT_PROBES, model_name(engine))
        container = (load_heads(target, engine) if target.is_file()
                     else ExitHeads([], [], new_card(engine, None, [])))
    head = container.head_at(layer) if layer in container.layers else None
    times = StageTimes()
    data = prepare_features(engine, request.data, [layer], times, progress)
    features = data.features
    t0 = time.perf_counter()
    hidden = features.hidden[layer]
    drafts = draft_predictions(engine, head, hidden, features.final, sampling)
    accepted = drafts.tokens == features.teacher_token
    labels = accepted if drafts.expected_acceptance is None else drafts.expected_acceptance
    train_idx, eval_idx = features.indices(TRAIN), features.indices(CALIBRATION, TEST)
    if train_idx.numel() == 0 or eval_idx.numel() == 0:
        raise InvalidArgumentError("the probe needs training and held-out tokens; give more data")
    probe = fit_probe(layer, hidden[train_idx], labels[train_idx], request.config)
    seconds = time.perf_counter() - t0
    times.probe_s = seconds
    stats = probe_stats(probe, hidden[eval_idx], labels[eval_idx], drafts.max_prob[eval_idx])
    mode = "greedy" if sampling is None else "sampled"
    (container.probes if sampling is None else container.sampled_probes)[layer] = probe
    container.card.probes = [p for p in container.card.probes
                             if (p.exit_layer, p.mode) != (layer, mode)]
    container.card.probes.append(ProbeCard(
        exit_layer=layer, draft_head="exit_head" if head is not None else "lm_head",
        train_tokens=int(train_idx.numel()), eval_tokens=int(eval_idx.numel()),
        base_rate=stats.base_rate, accuracy=stats.accuracy, auc=stats.auc,
        max_prob_auc=stats.max_prob_auc, bce=stats.bce, seconds=seconds, mode=mode,
        temperature=0.0 if sampling is None else sampling.temperature,
        top_p=1.0 if sampling is None else sampling.top_p))
    container.card.probes.sort(key=lambda p: (p.exit_layer, p.mode))
    container.card.set_prompts(data.uses(PROBE_USES))
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
def probe_stats(probe: LinearProbe, hidden: torch.Tensor, labels: torch.Tensor,
                max_prob: torch.Tensor) -> ProbeStats:
    """Quality of ``probe`` on ``hidden`` ``[N, H]`` against ``labels`` ``[N]``, with the AUC of
    the draft's own max-probability ``[N]`` for comparison.

    Boolean labels (greedy probes): accuracy of ``probe >= 0.5`` and ROC AUC. Expected-
    acceptance labels in [0, 1] (sampled probes): ``accuracy`` is the mean absolute error,
    and the AUCs are taken against ``label >= 0.5``.
    """
    logit = probe.logit(hidden)
    prob = torch.sigmoid(logit)
    y = labels.float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, y).item()
    if labels.dtype == torch.bool:
        accuracy = float(((prob >= 0.5) == labels).float().mean())
    else:
        accuracy = float((prob - y).abs().mean())
    positive = y >= 0.5
    return ProbeStats(float(y.mean()), accuracy, roc_auc(prob, positive),
                      roc_auc(max_prob, positive), bce)


# ------------------------------------------------------------------------- predictors
# The predictors train on the training and calibration splits (minus the heads' training
# prompts, see predictor_splits) and are evaluated on the test split.
PREDICTOR_USES = {TRAIN: "predictor-train", CALIBRATION: "predictor-train", TEST: "predictor-eval"}
DEFAULT_CANDIDATE_VOCAB = 16384
# held-out token accuracy / layers on the card (specee's accuracy= picks from it); the high end
# is where state-reading predictors reach 97-99% token accuracy
THRESHOLD_SWEEP = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.993, 0.995, 0.997, 0.998, 0.999)


@dataclass(frozen=True)
class PredictorRequest:
    """``selfspec heads train-predictors`` (SpecEE §4-5).

    Attributes:
        heads: head file whose head at ``candidate_layer`` drafts the candidates; the
            predictors are saved into it.
        candidate_layer: exit layer of that head (``None`` = :func:`default_candidate_layer`);
            with drafter candidates, the first predictor layer (``None`` =
            :func:`default_first_layer`).
        num_candidates: ``k`` (4 in the paper).
        draft_vocab: candidates are the head's top-``k`` over the ``K`` most frequent tokens
            (``0`` = the full vocabulary; capped at ``V``).
        offline: size of the offline layer set (``None`` = ``round(L/4)``, as SpecEE's 8 of 32).
        candidates: one of :data:`~selfspec.decoding.specee.step.CANDIDATE_SOURCES`: the head's or
            the file's drafter's top-``k``, ``+ngram`` merging prompt lookup's token
            (:func:`~selfspec.decoding.specee.step.merge_ngram`).
        data: :class:`DataRequest`.
        config: :class:`~selfspec.training.predictors.PredictorTrainConfig` (``state``:
            state-reading predictors).
        include_head_train: train on the prompts the heads (and drafter) trained on too
            (:func:`predictor_splits` drops them by default). More data, at the price of
            candidates that are right more often there than on new text; state-reading
            predictors need the data (docs/results/specee/xeon-2026-11-27-state/analysis.txt
            §7). Held-out figures stay on the test split.
        head_lens: at the predictor layers where the file has a lightweight exit head, the
            features read the candidates through that head (the head lens,
            :mod:`selfspec.heads.predictor`; not in the paper).
        row_cost: the tuning replay's cost of one more position in a layer call
            (:attr:`~selfspec.training.adadecode_tuning.ScheduleCosts.row`); ``None``: this
            machine's, from its latency model (``selfspec models latency``, measured once and
            kept; :func:`~selfspec.training.adadecode_tuning.row_cost_from_latency`).
        output_cost: the tuning replay's cost of the output layer in single-position layer
            calls: ``"auto"``: this machine's, from the same latency model
            (:func:`~selfspec.training.adadecode_tuning.output_cost_from_latency`);
            ``"bytes"``: its weight bytes over a decoder layer's (before 2026-11-28); or a
            number.
    """

    heads: str = "default"
    candidate_layer: int | None = None
    num_candidates: int = 4
    draft_vocab: int = DEFAULT_CANDIDATE_VOCAB
    offline: int | None = None
    candidates: str = "head"
    data: DataRequest = field(default_factory=DataRequest)
    config: PredictorTrainConfig = field(default_factory=PredictorTrainConfig)
    include_head_train: bool = False
    head_lens: bool = False
    row_cost: float | None = None
    output_cost: float | str = "auto"


def default_first_layer(num_layers: int) -> int:
    """First predictor layer with drafter candidates: ``max(1, L // 8)``. The candidates exist
    before layer 0, but the first layers' states rarely point at the final token (on
    Qwen2.5-Coder-1.5B a perfect predictor from layer 1 saves 0.2 layers per token more than
    from layer 4, docs/results/specee) and every predictor layer costs features."""
    return max(1, num_layers // 8)


def default_candidate_layer(head_layers: Sequence[int], num_layers: int) -> int:
    """The deepest head at or above no more than half the depth (else the shallowest).

    Predictors rarely fire in the first half (SpecEE's offline layers are 15-28 of 32), and a
    deeper head's top-``k`` holds the final token more often: on Qwen2.5-Coder-0.5B the
    layer-12 head's top-4 held it for 52% of held-out tokens against 42% at layer 6, and gave
    higher token accuracy at equal mean layers.
    """
    layers = sorted(head_layers)
    below = [x for x in layers if x <= num_layers // 2]
    return below[-1] if below else layers[0]


@dataclass
class PredictorOutcome:
    """What :func:`train_predictors` did: the saved file, its heads and the held-out figures."""

    path: Path
    heads: ExitHeads
    times: StageTimes
    evaluation: PredictorEval


@torch.inference_mode()
def head_candidates(engine: Engine, head: ExitHead, hidden: torch.Tensor, k: int,
                    vocab_rows: torch.Tensor | None, batch_tokens: int = 512) -> torch.Tensor:
    """``[N, k]`` top-``k`` token ids of ``head`` on ``hidden`` ``[N, H]`` (over ``vocab_rows``
    when given): the candidates SpecEE decoding drafts."""
    call = head.restricted(vocab_rows) if vocab_rows is not None else (
        lambda h: engine.executor.logits(h, head))
    out = []
    for start in range(0, hidden.shape[0], batch_tokens):
        logits = call(hidden[start:start + batch_tokens].unsqueeze(0))[0]
        top = torch.topk(logits, k, dim=-1).indices
        out.append(top if vocab_rows is None else vocab_rows[top])
    return torch.cat(out)


@torch.inference_mode()
def drafter_candidates(engine: Engine, drafter: FeatureDrafter, features: FeatureSet,
                       positions: DrafterPositions, index: torch.Tensor, k: int,
                       vocab_rows: torch.Tensor | None, batch_tokens: int = 512,
                       exit_layer: int | None = None) -> torch.Tensor:
    """``[n, k]`` the drafter's top-``k`` token ids at the positions ``index`` (previous
    states from the last layer, or leaving layer ``exit_layer - 1`` as after an exit there;
    over ``vocab_rows`` when given), computed in the model's dtype as
    :class:`~selfspec.decoding.specee.step.DrafterCandidates` computes them."""
    ex = engine.executor
    out = []
    for part in index.split(batch_tokens):
        layer_of = (None if exit_layer is None
                    else torch.full((part.numel(),), exit_layer, dtype=torch.long))
        x = drafter_inputs(features, positions, ex.embed_tokens.weight, part, layer_of)
        predicted = drafter(x.previous.to(ex.dtype), x.embedding).to(ex.dtype)
        logits = ex.logits(predicted.unsqueeze(0), vocab_rows=vocab_rows)[0]
        top = torch.topk(logits, k, dim=-1).indices
        out.append(top if vocab_rows is None else vocab_rows[top])
    return torch.cat(out)


def in_feature_order(items: Sequence[CorpusItem]) -> list[CorpusItem]:
    """``items`` in the order :func:`~selfspec.training.features.load_features` lays out their
    scored positions (:func:`~selfspec.training.features.by_source`)."""
    return [i for group in by_source(items).values() for i in group]


def ngram_tokens(items: Sequence[CorpusItem]) -> torch.Tensor:
    """``[N]`` int64 prompt-lookup token at every scored position of ``items``, ``-1`` where
    there is none, in the order of :func:`~selfspec.training.features.load_features` (items
    grouped by source). Position ``t`` looks up ``token_ids[: t + 1]``, as SpecEE decoding does
    before the token at ``t + 1`` (:func:`~selfspec.decoding.specee.step.ngram_token`)."""
    from selfspec.decoding.ngram.lookup import ContextIndex
    from selfspec.decoding.specee.step import NGRAM_MAX, NGRAM_MIN, ngram_token

    out: list[int] = []
    for item in in_feature_order(items):
        index = ContextIndex(NGRAM_MAX, NGRAM_MIN)
        index.extend(list(item.token_ids[:item.score_from + 1]))
        for t in range(item.score_from, len(item.token_ids) - 1):
            out.append(ngram_token(index))
            index.extend([item.token_ids[t + 1]])
    return torch.tensor(out, dtype=torch.long)


def predictor_splits(items: Sequence[CorpusItem], features: FeatureSet,
                     head_train: set[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, eval)`` position indices for the SpecEE predictors.

    The candidates come from an exit head; on text that head was trained on its top-k is
    right more often than on new text, so predictors fitted there learn a confidence that
    held-out text does not have (measured on Qwen2.5-Coder-1.5B: precision 0.88 on the heads'
    training prompts, 0.49 on others, at the same threshold). So the predictors train on the
    prompts the head did not train on (the training and calibration splits, minus
    ``head_train``) and are evaluated on the test split.

    Args:
        items: the corpus (the features' items).
        features: their features.
        head_train: ``(dataset, prompt id)`` pairs the heads trained on (their card's
            ``train`` prompts).
    """
    keep = torch.cat([torch.full((i.num_scored,), (dataset_of(i.source), i.prompt_id)
                                 not in head_train, dtype=torch.bool)
                      for i in in_feature_order(items)])
    split = features.split
    train = torch.nonzero(keep & ((split == TRAIN) | (split == CALIBRATION))).squeeze(1)
    return train, torch.nonzero(split == TEST).squeeze(1)


def _draft_rows(engine: Engine, heads: ExitHeads, target: Path, size: int
                ) -> torch.Tensor | None:
    """``[R]`` rows of the ``size`` most frequent tokens by ``heads``' counts (plus EOS), or
    ``None`` for ``size == 0`` (the full vocabulary).

    Raises:
        InvalidArgumentError: the heads have no token counts.
    """
    from selfspec.decoding.drafting.draft_vocab import frequent_rows
    from selfspec.models.eos import eos_token_ids

    if not size:
        return None
    if heads.token_counts is None:
        raise InvalidArgumentError(
            f"{target} has no token counts to rank a draft vocabulary; run `selfspec heads "
            f"calibrate {target}` once, or pass --draft-vocab 0")
    return frequent_rows(heads.token_counts, size, eos_token_ids(engine.executor.model)).rows


def train_predictors(engine: Engine, request: PredictorRequest,
                     progress: bool = True) -> PredictorOutcome:
    """Fit SpecEE predictors at every layer from the candidate layer on, rank the offline
    schedule on held-out text, and save them into ``request.heads``
    (:mod:`selfspec.training.predictors`).

    Raises:
        InvalidArgumentError: bad ``num_candidates`` / ``draft_vocab`` / ``offline``, no head at
            ``candidate_layer`` (head candidates) or no drafter in the file (drafter
            candidates), heads without token counts for a reduced vocabulary, or no data.
        HeadsNotFoundError, HeadsModelMismatchError, CorruptModelFileError: see
            :func:`~selfspec.heads.load_heads`.
    """
    from selfspec.decoding.specee.step import CANDIDATE_SOURCES, merge_ngram

    ex = engine.executor
    num_layers = ex.num_layers
    if request.candidates not in CANDIDATE_SOURCES:
        raise InvalidArgumentError(f"candidates must be one of {', '.join(CANDIDATE_SOURCES)}, "
                                   f"got {request.candidates!r}")
    if not 2 <= request.num_candidates <= 64:
        raise InvalidArgumentError(f"--k must be in [2, 64], got {request.num_candidates}")
    if request.draft_vocab < 0:
        raise InvalidArgumentError(f"--draft-vocab must be >= 0, got {request.draft_vocab}")
    target = find_head_file(request.heads, model_name(engine))
    container = load_heads(target, engine)
    drafted = request.candidates.startswith("drafter")
    if drafted:
        if container.drafter is None:
            raise InvalidArgumentError(
                f"{target} holds no drafter for --candidates {request.candidates}; train one "
                f"with `selfspec heads train-drafter {request.heads} --model {model_name(engine)}`")
        layer = (default_first_layer(num_layers) if request.candidate_layer is None
                 else request.candidate_layer)
        if not 1 <= layer <= num_layers - 1:
            raise InvalidArgumentError(
                f"--candidate-layer (the first predictor layer with drafter candidates) must be "
                f"in [1, {num_layers - 1}], got {layer}")
        head = None
    else:
        if not container.layers:
            raise InvalidArgumentError(f"{target} holds no exit heads to draft candidates with")
        layer = (default_candidate_layer(container.layers, num_layers)
                 if request.candidate_layer is None else request.candidate_layer)
        head = container.head_at(layer)
    offline = (max(1, round(num_layers / 4)) if request.offline is None else request.offline)
    if not 1 <= offline <= num_layers - layer:
        raise InvalidArgumentError(
            f"--offline must be in [1, {num_layers - layer}] (predictor layers), got {offline}")
    size = min(request.draft_vocab, ex.vocab_size)
    rows = _draft_rows(engine, container, target, size)
    layers = list(range(layer, num_layers))
    lenses = head_lenses(container, layers, target) if request.head_lens else {}
    # Before the long stages, and only where on-policy text lets the tuning run: a first run
    # on this machine measures its latencies (~1 min on Qwen2.5-Coder-0.5B).
    tunable = any(x.startswith(ONPOLICY) for x in parse_data_spec(request.data.data))
    replay_costs = (_replay_costs(engine, request.row_cost, request.output_cost) if tunable
                    else ReplayCosts(DEFAULT_ROW_COST, "given"))
    times = StageTimes()
    prepared = prepare_features(engine, request.data, layers, times, progress)
    features = prepared.features
    head_train = set() if request.include_head_train else {
        (u.dataset, i) for u in container.card.prompts if u.use == "train" for i in u.ids}
    train_idx, eval_idx = predictor_splits(prepared.items, features, head_train)
    positions = drafter_positions(in_feature_order(prepared.items)) if drafted else None
    if positions is not None:  # the drafter needs the previous position's state
        usable = positions.usable()
        train_idx, eval_idx = train_idx[usable[train_idx]], eval_idx[usable[eval_idx]]
    if train_idx.numel() == 0 or eval_idx.numel() == 0:
        raise InvalidArgumentError(
            "the predictors need training tokens from prompts the heads did not train on, and "
            "held-out tokens; give more data (or other --data than the heads saw)")
    t0 = time.perf_counter()

    lookups = ngram_tokens(prepared.items) if request.candidates.endswith("+ngram") else None
    assert lookups is None or lookups.numel() == features.num_tokens, "positions out of step"

    def data_of(idx: torch.Tensor, exit_layer: int | None = None) -> PredictorData:
        """The predictors' data at ``idx``; with ``exit_layer`` (drafter candidates), as the
        positions stand inside a draft after an exit there: drafted by the exit-state drafter
        (the main one if none) from the previous position's state at that layer."""
        if drafted:
            drafter = (container.drafter if exit_layer is None
                       else container.exit_drafter or container.drafter)
            cands = drafter_candidates(engine, drafter, features, positions, idx,
                                       request.num_candidates, rows, exit_layer=exit_layer)
        else:
            cands = head_candidates(engine, head, features.hidden[layer][idx],
                                    request.num_candidates, rows)
        if lookups is not None:
            cands = merge_ngram(cands, lookups[idx])
        return predictor_data(ex, features.hidden, cands, features.teacher_token[idx], layers,
                              with_states=request.config.state, index=idx, lenses=lenses)

    if request.config.state:
        _check_state_memory(train_idx.numel() + eval_idx.numel(), len(layers),
                            features.hidden[layer].shape[-1], features.hidden[layer].element_size())
    train_data, eval_data = data_of(train_idx), data_of(eval_idx)
    predictors = fit_predictors(train_data, request.num_candidates, request.config)
    del train_data  # the largest tensors here (states): the views below need the memory
    prob = predictor_probs(predictors, eval_data)
    inner = None
    if drafted and tunable:
        exits = [e for e in default_exit_state_layers(num_layers) if e in features.hidden]
        inner = inner_outputs(predictors, exits, lambda e: data_of(eval_idx, e),
                              "exit-state" if container.exit_drafter is not None else "main")
    evaluation = exit_figures(prob, eval_data, num_layers)
    sweep = [exit_figures(prob, eval_data, num_layers, t) for t in THRESHOLD_SWEEP]
    tuning = _tune_predictors(engine, prepared.items, eval_idx, predictors, prob, eval_data,
                              lenses, container.drafter if drafted else head, rows,
                              replay_costs, inner=inner)
    seconds = time.perf_counter() - t0
    times.predictors_s = seconds
    container.predictors = predictors.to(ex.device)
    container.card.predictors = PredictorCard(
        candidate_layer=layer, num_candidates=request.num_candidates, draft_vocab=size,
        hidden=request.config.hidden, layers=layers,
        offline_layers=offline_schedule(layers, evaluation.exit_frequency, offline),
        exit_frequency=evaluation.exit_frequency,
        candidate_recall=float(eval_data.recall.float().mean()),
        base_rate=evaluation.base_rate, accuracy=evaluation.accuracy,
        precision=evaluation.precision, train_tokens=int(train_idx.numel()),
        eval_tokens=int(eval_idx.numel()), epochs=request.config.epochs, seconds=seconds,
        thresholds=list(THRESHOLD_SWEEP), token_accuracy=[e.token_accuracy for e in sweep],
        mean_layers=[e.mean_exit_layer for e in sweep], candidates=request.candidates,
        state_dim=predictors.state_dim, lens_layers=sorted(lenses), tuning=tuning)
    container.card.set_prompts(items_by_use(
        [i for i in prepared.items
         if i.split == TEST or (dataset_of(i.source), i.prompt_id) not in head_train],
        PREDICTOR_USES))
    save_heads(container, target)
    return PredictorOutcome(target, container, times, evaluation)


@dataclass(frozen=True)
class InnerOutputs:
    """The predictors on the held-out positions as they stand inside a draft.

    Attributes:
        layers: ``[E]`` exit layers of the previous position, increasing.
        prob: ``[E, P, N]`` predictor outputs with the candidates drafted from the previous
            position's state leaving layer ``layers[e] - 1``.
        labels: ``[E, P, N]`` bool, the top local candidate is the final token.
        drafter: ``"exit-state"`` (the file's exit-state drafter drafted them, as decoding
            does by default) or ``"main"``.
    """

    layers: tuple[int, ...]
    prob: torch.Tensor
    labels: torch.Tensor
    drafter: str


def inner_outputs(predictors: ExitPredictors, exits: Sequence[int],
                  view_after: Callable[[int], PredictorData], drafter: str
                  ) -> InnerOutputs | None:
    """The predictors' outputs and labels on the held-out positions as they stand inside a
    draft, after an exit at each layer of ``exits`` (``view_after(e)``: their
    :class:`PredictorData` with the candidates drafted from the previous position's state
    leaving layer ``e - 1``: :class:`~selfspec.decoding.specee.step.SpecEEExits` drafts from it);
    ``None`` without ``exits``. One view at a time: each holds every predictor layer's
    states."""
    if not exits:
        return None
    outputs, labels = [], []
    for e in exits:
        view = view_after(e)
        outputs.append(predictor_probs(predictors, view))
        labels.append(view.labels)
        del view
    return InnerOutputs(tuple(exits), torch.stack(outputs), torch.stack(labels), drafter)


@dataclass(frozen=True)
class ReplayCosts:
    """The tuning replay's measured or given costs and where each came from (``"given"``,
    ``"measured: <latency key>"``, ``"bytes"``).

    Attributes:
        row / row_source: :attr:`~selfspec.training.adadecode_tuning.ScheduleCosts.row`.
        output / output_source: the output layer in single-position layer calls, or
            ``None``: from its weight bytes.
    """

    row: float
    row_source: str
    output: float | None = None
    output_source: str = "bytes"


def _replay_costs(engine: Engine, row: float | None, output: float | str) -> ReplayCosts:
    """The tuning replay's row and output-layer costs: as given, or this machine's from its
    latency model (measured once and kept), or (``output="bytes"``) from the weights."""
    if row is not None and row < 0:
        raise InvalidArgumentError(f"--row-cost must be >= 0, got {row}")
    if isinstance(output, str) and output not in ("auto", "bytes"):
        raise InvalidArgumentError(f"--output-cost must be auto, bytes or a number > 0, got "
                                   f"{output!r}")
    if not isinstance(output, str) and not output > 0:
        raise InvalidArgumentError(f"--output-cost must be > 0, got {output}")
    latency = None
    if row is None or output == "auto":
        from selfspec.models.provision import selfspec_home

        latency = cached_latency(engine.executor, selfspec_home())
    measured = "" if latency is None else f"measured: {latency.key}"
    if row is None:
        row, row_source = row_cost_from_latency(latency), measured
    else:
        row, row_source = float(row), "given"
    if output == "auto":
        out, out_source = output_cost_from_latency(latency), measured
    elif output == "bytes":
        out, out_source = None, "bytes"
    else:
        out, out_source = float(output), "given"
    logger.info("replay costs: one more position %.3f (%s), output layer %s (%s)", row,
                row_source, "from bytes" if out is None else f"{out:.2f}", out_source)
    return ReplayCosts(row, row_source, out, out_source)


def _tune_predictors(engine: Engine, items: Sequence[CorpusItem], eval_idx: torch.Tensor,
                     model: ExitPredictors, prob: torch.Tensor, data: PredictorData,
                     lenses: dict[int, object], candidates: torch.nn.Module,
                     rows: torch.Tensor | None,
                     costs_in: ReplayCosts = ReplayCosts(DEFAULT_ROW_COST, "given"),
                     max_early: int = SPECEE_DEFAULT_MAX_EARLY,
                     inner: InnerOutputs | None = None) -> PredictorTuning | None:
    """Verified SpecEE's per-layer thresholds by replay on the held-out positions of on-policy
    text (:mod:`selfspec.training.specee_tuning`), or ``None`` (logged) when there are fewer
    than two such sequences (teacher-forced text is not what greedy decoding visits).

    Args:
        items: the corpus; eval_idx: ``[N]`` held-out positions; model: the predictors;
            prob / data: their ``[P, N]`` outputs and the labels there; lenses: ``{ℓ: head}``
            of the head lens; candidates: the drafter, or the exit head drafting the
            candidates; rows: the draft-vocabulary rows (``None``: every token); costs_in:
            the row and output-layer costs and their sources; inner: the positions as they
            stand inside a draft (``None``: replayed as at a draft's start).
    """
    ordered = in_feature_order(items)
    counts = torch.tensor([i.num_scored for i in ordered])
    sequence = torch.repeat_interleave(torch.arange(len(ordered)), counts)
    onpolicy = torch.repeat_interleave(
        torch.tensor([i.source.startswith(ONPOLICY) for i in ordered]), counts)
    keep = onpolicy[eval_idx]
    replayed = sequence[eval_idx][keep]
    seqs = torch.unique(replayed).tolist()
    if len(seqs) < 2:
        logger.info("no per-layer SpecEE thresholds: fewer than two held-out on-policy "
                    "sequences (give --data onpolicy:DATASET)")
        return None
    trace = predictor_trace(prob[:, keep], data.labels[:, keep], data.layers, replayed,
                            None if inner is None else
                            (inner.layers, inner.prob[:, :, keep], inner.labels[:, :, keep]))
    ex = engine.executor
    hidden = ex.model.lm_head.in_features
    element = torch.tensor([], dtype=ex.dtype).element_size()
    predictors = list(data.layers)
    mlp = sum(p.numel() for p in model.parameters()) // len(predictors)  # one layer's MLP
    checks = [(model.num_candidates * hidden + mlp
               + (hidden * hidden if layer in lenses else 0)) * element for layer in predictors]
    scored = ex.vocab_size if rows is None else int(rows.numel())
    scan = (sum(p.numel() for p in candidates.parameters()) + scored * hidden) * element
    costs = SpecEECosts.from_sizes(ex.decode_layer_bytes(0), checks, scan,
                                   ex.output_decode_bytes, costs_in.row, costs_in.output)
    found = tune_thresholds(trace, ex.num_layers, costs, max_early)
    kept = sorted(found.thresholds)
    sources = sorted({ordered[i].source for i in seqs})  # what was replayed
    logger.info("SpecEE per-layer thresholds %s (single %s): replayed speedup %.3f, check "
                "half %.3f (single %.3f, perfect predictors %.3f)", found.thresholds,
                found.single, found.tuned.speedup, found.tuned_check.speedup,
                found.single_check.speedup, found.ceiling_check.speedup)
    return PredictorTuning(
        layers=kept, thresholds=[found.thresholds[x] for x in kept],
        single_threshold=found.single, max_early=max_early, row_cost=costs.schedule.row,
        row_cost_source=costs_in.row_source, output_cost_source=costs_in.output_source,
        inner_layers=[] if inner is None else list(inner.layers),
        inner_drafter="" if inner is None else inner.drafter,
        scan_cost=costs.schedule.scan, output_cost=costs.schedule.output,
        check_costs=[costs.checks[predictors.index(x)] for x in kept], data=sources,
        tokens=found.tuned.tokens, speedup=found.tuned.speedup,
        acceptance=found.tuned.acceptance, drafts_per_token=found.tuned.drafts_per_token,
        check_tokens=found.tuned_check.tokens, check_speedup=found.tuned_check.speedup,
        check_acceptance=found.tuned_check.acceptance,
        single_check_speedup=found.single_check.speedup,
        ceiling_check_speedup=found.ceiling_check.speedup)


def head_lenses(heads: ExitHeads, layers: Sequence[int], path: object
                ) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
    """``{ℓ: head.transform_normed}`` for the lightweight exit heads of ``heads`` at
    ``layers``: the head lens of SpecEE's features (:mod:`selfspec.heads.predictor`).

    Raises:
        InvalidArgumentError: no lightweight head at any of ``layers`` (a full head's logits
            are its own matrix's, not ``lm_head``'s rows, so it has no lens over the candidates'
            rows).
    """
    from selfspec.heads.modules import LightweightHead

    wanted = set(layers)
    lenses = {h.layer: h.transform_normed for h in heads.heads
              if isinstance(h, LightweightHead) and h.layer in wanted}
    if not lenses:
        raise InvalidArgumentError(
            f"--head-lens reads the candidates through the lightweight exit heads at the "
            f"predictor layers {layers[0]}..{layers[-1]}; {path} has none there (heads at "
            f"{heads.layers}, kind {heads.card.kind!r}): drop --head-lens or train lightweight "
            f"heads")
    return lenses


def _check_state_memory(positions: int, layers: int, hidden: int, itemsize: int) -> None:
    """Refuse state-reading predictors whose states (``positions × layers × H``) would not fit
    in the memory left, before minutes of work end in the OOM killer.

    Raises:
        InvalidArgumentError: the states need more than the available memory (with margin).
    """
    from selfspec.executor.cpu import available_memory_bytes

    need = positions * layers * hidden * itemsize
    free = available_memory_bytes()
    # the batches, features and MLP come on top of the states: keep a quarter spare
    if free is not None and need > 0.75 * free:
        raise InvalidArgumentError(
            f"state-reading predictors keep every layer's state: {positions} positions × "
            f"{layers} layers × {hidden} values need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
            f"is available; give fewer --tokens, a later --candidate-layer, or drop "
            f"--include-head-train")


# ------------------------------------------------------------------ SpecEE's drafter
@dataclass(frozen=True)
class DrafterRequest:
    """``selfspec heads train-drafter``: a next-token drafter for SpecEE's candidates
    (:mod:`selfspec.training.drafter`), saved into a head file.

    Attributes:
        heads: the head file (its token counts rank the draft vocabulary; the drafter is saved
            into it).
        draft_vocab: the loss and the card's figures over the ``K`` most frequent tokens
            (``0`` = the full vocabulary).
        data: the corpus; ``None`` = the one the heads were trained on (their card), whose
            training split is then the drafter's too.
        config: :class:`~selfspec.training.drafter.DrafterTrainConfig` (the main drafter's;
            with an exit-state drafter its ``exit_mix`` is usually 0: that drafter reads the
            exit states).
        exit_state_layers: train an exit-state drafter too (:mod:`selfspec.training.drafter`)
            on the states at these layers; ``()``: none (the default: on Qwen2.5-Coder-0.5B
            it raised held-out candidate recall after an exit but not the measured speed,
            docs/results/specee); ``None``: :func:`default_exit_state_layers`.
        exit_state_only: keep the file's main drafter (and the predictors trained on its
            candidates) and train only the exit-state drafter.
    """

    heads: str = "default"
    draft_vocab: int = DEFAULT_CANDIDATE_VOCAB
    data: DataRequest | None = None
    config: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    exit_state_layers: tuple[int, ...] | None = ()
    exit_state_only: bool = False


def default_exit_state_layers(num_layers: int) -> tuple[int, ...]:
    """Every ``max(1, L // 8)``-th layer from :func:`default_first_layer` on (3, 6, ..., 21 for
    24 layers): the predictors' range, where the exit-state drafter's input comes from. On
    Qwen2.5-Coder-0.5B a drafter trained on five such layers read layers 3 and 6 within 1-3 points of
    top-4 of a drafter trained on that layer alone (:mod:`selfspec.training.drafter`)."""
    step = max(1, num_layers // 8)
    return tuple(range(default_first_layer(num_layers), num_layers, step))


@dataclass
class DrafterOutcome:
    """What :func:`train_drafter` did."""

    path: Path
    heads: ExitHeads
    times: StageTimes


def train_drafter(engine: Engine, request: DrafterRequest, progress: bool = True
                  ) -> DrafterOutcome:
    """Train SpecEE's next-token drafter (and, unless ``request.exit_state_layers`` is empty,
    its exit-state drafter) on the training split of the heads' corpus (or ``request.data``),
    evaluate them on the test split and save them into ``request.heads``.

    Raises:
        InvalidArgumentError: a bad ``draft_vocab``, heads without a card's corpus and no
            ``data``, heads without token counts for a reduced vocabulary, no data, or an
            exit-state layer outside ``[1, L-1]``.
        HeadsNotFoundError, HeadsModelMismatchError, CorruptModelFileError: see
            :func:`~selfspec.heads.load_heads`.
    """
    ex = engine.executor
    if request.draft_vocab < 0:
        raise InvalidArgumentError(f"--draft-vocab must be >= 0, got {request.draft_vocab}")
    if request.exit_state_only and request.exit_state_layers == ():
        raise InvalidArgumentError(
            "an exit-state drafter alone needs exit-state layers (--exit-state-layers auto or "
            "a list)")
    target = find_head_file(request.heads, model_name(engine))
    container = load_heads(target, engine)
    if request.exit_state_only and container.drafter is None:
        raise InvalidArgumentError(
            f"{target} holds no drafter to keep; train one first (without --exit-state-only)")
    pc = container.card.predictors
    if not request.exit_state_only and pc is not None and pc.candidates.startswith("drafter"):
        logger.warning("%s holds predictors trained on its drafter's candidates; a new drafter "
                       "gives them candidates they were not trained on: train them again, or "
                       "keep the drafter and add an exit-state drafter (--exit-state-only)",
                       target)
    data = request.data
    if data is None:
        if container.card.training is None:
            raise InvalidArgumentError(
                f"{target} records no training corpus to reuse; pass --data")
        data = _card_request(container.card.training)
    size = min(request.draft_vocab, ex.vocab_size)
    rows = _draft_rows(engine, container, target, size)
    # The main drafter's exit mix reads the heads' upper-half layers (in the feature cache
    # already); the exit-state drafter reads layers across the predictors' range.
    exit_layers = [x for x in container.layers if x >= ex.num_layers // 2]
    state_layers = (default_exit_state_layers(ex.num_layers) if request.exit_state_layers is None
                    else tuple(sorted(set(request.exit_state_layers))))
    bad = [x for x in state_layers if not 1 <= x <= ex.num_layers - 1]
    if bad:
        raise InvalidArgumentError(
            f"exit-state layers {bad} are outside 1..{ex.num_layers - 1} of this "
            f"{ex.num_layers}-layer model")
    times = StageTimes()
    prepared = prepare_features(engine, data, sorted({*exit_layers, *state_layers}), times,
                                progress)
    features = prepared.features
    positions = drafter_positions(in_feature_order(prepared.items))
    usable = positions.usable()
    train_idx = torch.nonzero(usable & (features.split == TRAIN)).squeeze(1)
    eval_idx = torch.nonzero(usable & (features.split == TEST)).squeeze(1)
    if train_idx.numel() == 0:
        raise InvalidArgumentError("no training positions for the drafter; give more data")
    out = output_layer(engine)
    embedding = ex.embed_tokens.weight
    cfg = request.config
    seconds = 0.0
    if request.exit_state_only:
        drafter, card = container.drafter, container.card.drafter
    else:
        t0 = time.perf_counter()
        drafter = fit_drafter(out, features, positions, embedding, train_idx, rows, exit_layers,
                              cfg).to(device=ex.device, dtype=ex.dtype)
        seconds = time.perf_counter() - t0
        evaluation = evaluate_drafter(drafter, out, features, positions, embedding, eval_idx,
                                      rows)
        card = DrafterCard(
            draft_vocab=size, exit_mix=cfg.exit_mix, exit_layers=exit_layers, epochs=cfg.epochs,
            lr=cfg.lr, seconds=seconds, train_tokens=int(train_idx.numel()),
            eval_tokens=evaluation.tokens, top1=evaluation.top1, topk=evaluation.topk)
    exit_drafter, state_topk, state_topk_main, state_seconds = None, math.nan, math.nan, math.nan
    if state_layers:
        t0 = time.perf_counter()
        exit_drafter = fit_drafter(out, features, positions, embedding, train_idx, rows,
                                   state_layers, replace(cfg, exit_mix=1.0))
        state_seconds = time.perf_counter() - t0
        seconds += state_seconds
        exit_drafter = exit_drafter.to(device=ex.device, dtype=ex.dtype)

        def at_states(model: FeatureDrafter) -> float:
            return sum(evaluate_drafter(model, out, features, positions, embedding, eval_idx,
                                        rows, layer=x).topk for x in state_layers) / len(state_layers)
        state_topk, state_topk_main = at_states(exit_drafter), at_states(drafter)
    times.train_s = seconds
    container.drafter, container.exit_drafter = drafter, exit_drafter
    container.card.drafter = replace(card, exit_state_layers=list(state_layers),
                                     exit_state_topk=state_topk,
                                     exit_state_topk_main=state_topk_main,
                                     exit_state_seconds=state_seconds)
    container.card.set_prompts(items_by_use(prepared.items, {TRAIN: "train", TEST: "test"}))
    save_heads(container, target)
    return DrafterOutcome(target, container, times)


# ------------------------------------------------------------------ tune AdaDecode
DEFAULT_TUNE_VOCABS = (4096, 8192, 16384, 0)
PAPER_GAMMA = 0.75  # AdaDecode appendix D, the comparison the card records


def _card_request(info: TrainingInfo) -> DataRequest:
    """The corpus heads were trained on (same held-out problems), from their card."""
    return DataRequest(",".join(info.data), info.requested_tokens or info.train_tokens,
                       info.max_new_tokens, info.max_len, info.seed)


@dataclass
class TuneOutcome:
    """What ``selfspec heads tune-adadecode`` produced."""

    path: Path
    card: AdaDecodeCard
    seconds: float


def head_trace(heads: ExitHeads, features: FeatureSet, items: Sequence[CorpusItem], split: int,
               sources: Sequence[str], vocab_rows: torch.Tensor | None) -> HeadTrace:
    """Each head's confidence and correctness on the ``split`` positions of ``sources``'
    items, sequence by sequence (the replay's input, :class:`HeadTrace`).

    Raises:
        InvalidArgumentError: no item of ``sources`` in ``split``.
    """
    spans, position = [], 0
    for item in in_feature_order(items):
        if item.split == split and item.source in sources and item.num_scored > 0:
            spans.append((position, item.num_scored))
        position += item.num_scored
    if not spans:
        raise InvalidArgumentError(
            f"no {SPLIT_NAMES[split]} text of {', '.join(sources)} to replay AdaDecode on; "
            f"train the heads with on-policy data (--data onpolicy:DATASET)")
    index = torch.cat([torch.arange(start, start + n) for start, n in spans])
    conf, correct = [], []
    for layer in heads.layers:
        scored = head_scores(heads.head_at(layer), features, index, ["max_prob"],
                             vocab_rows=vocab_rows)
        conf.append(scored.scores["max_prob"].float())
        correct.append(scored.correct)
    return HeadTrace(tuple(heads.layers), torch.stack(conf, 1), torch.stack(correct, 1),
                     tuple(n for _, n in spans))


def tune_adadecode_file(engine: Engine, path: str, sources: Sequence[str] | None = None,
                        draft_vocabs: Sequence[int] = DEFAULT_TUNE_VOCABS, max_early: int = 5,
                        row_cost: float = DEFAULT_ROW_COST,
                        progress: bool = True) -> TuneOutcome:
    """``selfspec heads tune-adadecode``: per-head thresholds, head layers and draft
    vocabulary for AdaDecode by replaying Algorithm 1 on the heads' calibration text
    (:mod:`selfspec.training.adadecode_tuning`), checked on their test text; saved on the
    card (``adadecode:tuned=true`` reads it).

    Args:
        path: head file or directory (``"default"``).
        sources: on-policy data-spec sources to replay (``None`` = every on-policy source the
            heads were trained with); teacher-forced text is not the model's greedy output,
            so the replay would not be exact on it.
        draft_vocabs: sizes K to try (``0`` = the full vocabulary).
        max_early: AdaDecode's outstanding early predictions (appendix D: 5).
        row_cost: :attr:`ScheduleCosts.row`.

    Raises:
        InvalidArgumentError: a source that is not on-policy or not in the heads' training
            data, heads without token counts for a reduced vocabulary, bad sizes.
        HeadsNotFoundError, HeadsModelMismatchError: see :func:`load_heads`.
    """
    from selfspec.decoding.drafting.draft_vocab import frequent_rows

    t0 = time.perf_counter()
    target = find_head_file(path, model_name(engine))
    heads = load_heads(target, engine)
    info = heads.card.training
    if info is None:
        raise InvalidArgumentError(f"{target}: the card records no training data to replay")
    trained = [source_weight(d)[0] for d in info.data]
    onpolicy = [s for s in trained if s.startswith(ONPOLICY)]
    chosen = [source_weight(x)[0] for x in sources] if sources else onpolicy
    bad = [s for s in chosen if s not in onpolicy]
    if not chosen or bad:
        raise InvalidArgumentError(
            f"tune-adadecode replays the model's own greedy text: choose among the heads' "
            f"on-policy sources {onpolicy or '(none: retrain with --data onpolicy:DATASET)'}; "
            f"got {bad or chosen}")
    if any(k < 0 or k > engine.executor.vocab_size for k in draft_vocabs) or not draft_vocabs:
        raise InvalidArgumentError(
            f"draft vocabulary sizes must lie in [0, {engine.executor.vocab_size}] (0 = all); "
            f"got {list(draft_vocabs)}")
    if any(k > 0 for k in draft_vocabs) and heads.token_counts is None:
        raise InvalidArgumentError(
            "a reduced draft vocabulary ranks tokens by the heads' token counts; run "
            "`selfspec heads calibrate` on these heads first")
    data = prepare_features(engine, _card_request(info), heads.layers, StageTimes(), progress)
    ex = engine.executor
    hidden = heads.card.hidden_size
    element = torch.tensor([], dtype=ex.dtype).element_size()

    def costs_for(rows: torch.Tensor | None) -> ScheduleCosts:
        """A head check reads its draft-vocabulary rows of E* (and T, lightweight heads)."""
        scored = ex.vocab_size if rows is None else int(rows.numel())
        extra = hidden * hidden if heads.card.kind == "lightweight" else 0
        return ScheduleCosts.from_sizes(ex.decode_layer_bytes(0),
                                        (scored * hidden + extra) * element,
                                        ex.output_decode_bytes, row_cost)

    best = None
    speedups = []
    for size in draft_vocabs:
        rows = (None if size == 0 else
                frequent_rows(heads.token_counts, size, _eos_ids(engine)).rows)
        costs = costs_for(rows)
        calibration = head_trace(heads, data.features, data.items, CALIBRATION, chosen, rows)
        tuned = tune_schedule(calibration, ex.num_layers, costs, max_early)
        speedups.append(tuned.prediction.speedup)
        logger.info("draft vocabulary %s: %s, replayed speedup %.3f", size or "all",
                    tuned.gammas, tuned.prediction.speedup)
        if best is None or tuned.prediction.speedup > best[1].prediction.speedup:
            best = (size, tuned, costs, rows)
    size, tuned, costs, rows = best
    test = head_trace(heads, data.features, data.items, TEST, chosen, rows)
    gammas = [tuned.gammas.get(layer) for layer in heads.layers]
    held = simulate_schedule(test, gammas, ex.num_layers, costs, max_early)
    paper_trace = head_trace(heads, data.features, data.items, TEST, chosen, None)
    paper = simulate_schedule(paper_trace, [PAPER_GAMMA] * len(heads.layers), ex.num_layers,
                              costs_for(None), max_early)
    p = tuned.prediction
    card = AdaDecodeCard(
        layers=sorted(tuned.gammas), gammas=[tuned.gammas[k] for k in sorted(tuned.gammas)],
        draft_vocab=size, max_early=max_early, row_cost=costs.row, head_cost=costs.head,
        output_cost=costs.output, data=chosen, tokens=p.tokens, speedup=p.speedup,
        acceptance=p.acceptance, drafts_per_token=p.drafts_per_token, test_tokens=held.tokens,
        test_speedup=held.speedup, test_acceptance=held.acceptance,
        paper_test_speedup=paper.speedup, draft_vocabs=list(draft_vocabs),
        vocab_speedups=speedups)
    heads.card.adadecode = card
    used = [i for i in data.items if i.source in chosen]
    heads.card.set_prompts(items_by_use(used, {CALIBRATION: "calibration", TEST: "test"}))
    save_heads(heads, target)
    return TuneOutcome(target, card, time.perf_counter() - t0)
