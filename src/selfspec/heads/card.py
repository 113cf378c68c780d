"""The head card: what a head file says about itself (stored as JSON inside the file's
safetensors metadata, and copied to ``card.json`` beside it for people).

Non-finite floats are written as JSON ``null``: an AUC that is undefined (all predictions
correct or all wrong) and a threshold that no ε can meet (``+inf``, the head is never used).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from selfspec.heads.fingerprint import ModelFingerprint

CARD_FORMAT_VERSION = 2  # 2: ``prompts`` records which prompts each stage saw

# Uses of a prompt that shape what decoding does (head weights, the draft-vocabulary ranking,
# thresholds τ_k(ε), probe weights): a benchmark on such a prompt is in-sample. "test" and
# "probe-eval" prompts are only scored for the card. SpecEE's "predictor-eval" prompts rank the
# layers of its offline schedule, so they are in-sample too.
IN_SAMPLE_USES = ("train", "calibration", "probe-train", "predictor-train", "predictor-eval")
PROMPT_USES = ("train", "calibration", "test", "probe-train", "probe-eval", "predictor-train",
               "predictor-eval")


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


@dataclass
class HeadEval:
    """Agreement of one head with the final layer on held-out tokens (DSSD eq. 2 averaged).

    Attributes:
        layer: the head's exit layer.
        eval_tokens: held-out tokens scored.
        agreement_before: top-1 agreement with the final layer before training (a fresh head:
            for lightweight and copied full heads, the model's own final norm + ``lm_head``).
        agreement_after: the same after training.
        kl_before / kl_after: mean ``KL(p_final || p_head)`` in nats per token.
        confident_fraction: fraction of tokens with max-probability > 0.8 after training.
        confident_agreement: agreement on those tokens.
    """

    layer: int
    eval_tokens: int
    agreement_before: float
    agreement_after: float
    kl_before: float
    kl_after: float
    confident_fraction: float = math.nan
    confident_agreement: float = math.nan


@dataclass
class ThresholdRow:
    """τ(ε) of one head and metric, with what it does on calibration and test tokens.

    Attributes:
        epsilon: accuracy level.
        value: τ in confidence units (``None`` in JSON = ``+inf``, never used).
        coverage / precision: on the calibration tokens (precision >= ε by construction).
        test_coverage / test_precision: the same rule on the held-out test tokens.
    """

    epsilon: float
    value: float
    coverage: float
    precision: float
    test_coverage: float = math.nan
    test_precision: float = math.nan


@dataclass
class MetricCalibration:
    """One confidence metric of one head: ROC AUC and the ε sweep."""

    metric: str
    auc: float
    test_auc: float
    thresholds: list[ThresholdRow] = field(default_factory=list)


@dataclass
class HeadCalibration:
    """Calibration of one head (DSSD §3.4.1).

    Attributes:
        layer: exit layer.
        tokens: calibration tokens ``M_cal``.
        accuracy: fraction of them where the head agrees with the final layer.
        test_tokens: held-out test tokens.
        test_accuracy: agreement on those.
        metrics: per-metric AUC and thresholds.
    """

    layer: int
    tokens: int
    accuracy: float
    test_tokens: int
    test_accuracy: float
    metrics: list[MetricCalibration] = field(default_factory=list)

    def metric(self, name: str) -> MetricCalibration | None:
        return next((m for m in self.metrics if m.metric == name), None)


@dataclass
class ProbeCard:
    """An AdaSPEED linear probe (§II.B) at one exit layer.

    Attributes:
        exit_layer: the layer whose hidden state the probe reads.
        draft_head: which head produced the draft token it scores: ``"exit_head"`` (this
            file's head at that layer) or ``"lm_head"`` (the model's final norm + ``lm_head``).
        train_tokens / eval_tokens: tokens used.
        base_rate: fraction of held-out draft tokens equal to the full model's token.
        accuracy: held-out accuracy of ``probe >= 0.5`` (chance = max(base_rate, 1 - base_rate)).
        auc: held-out ROC AUC of the probe; ``max_prob_auc``: that of the draft's max-probability.
        bce: held-out binary cross-entropy, nats.
        seconds: training wall time.
        mode: ``"greedy"`` (label: draft argmax == final argmax) or ``"sampled"`` (label: the
            expected acceptance ``Σ_x min(p(x), q(x))`` of speculative sampling with draft
            ``q`` and target ``p``, both under ``temperature`` / ``top_p``; AdaSPEED Table I's
            top-p rows). For a sampled probe ``base_rate`` is the mean label and ``accuracy``
            the mean absolute error.
        temperature / top_p: the sampling settings of a ``"sampled"`` probe's labels.
    """

    exit_layer: int
    draft_head: str
    train_tokens: int
    eval_tokens: int
    base_rate: float
    accuracy: float
    auc: float
    max_prob_auc: float
    bce: float
    seconds: float
    mode: str = "greedy"
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class AdaDecodeCard:
    """AdaDecode thresholds tuned by replaying Algorithm 1 on held-out greedy text
    (:mod:`selfspec.training.adadecode_tuning`; ``selfspec heads tune-adadecode``).

    Attributes:
        layers: head layers used (the others are off), increasing.
        gammas: ``[len(layers)]`` threshold of each.
        draft_vocab: the heads score the ``K`` most frequent tokens (``0`` = every token).
        max_early: early predictions outstanding before a token runs every layer.
        row_cost / head_cost / output_cost: the cost model (one more position in a layer
            call, one head check, the output layer), in single-position layer calls.
        data: on-policy sources replayed.
        tokens / speedup / acceptance / drafts_per_token: the replay on the calibration split
            (what was tuned on).
        test_tokens / test_speedup / test_acceptance: the same setting on the test split.
        paper_test_speedup: the paper's setting (γ = 0.75 at every head, full vocabulary)
            replayed on the test split, for comparison.
        draft_vocabs / vocab_speedups: each vocabulary size tried and its best calibration
            speedup.
    """

    layers: list[int]
    gammas: list[float]
    draft_vocab: int
    max_early: int
    row_cost: float
    head_cost: float
    output_cost: float
    data: list[str]
    tokens: int
    speedup: float
    acceptance: float
    drafts_per_token: float
    test_tokens: int
    test_speedup: float
    test_acceptance: float
    paper_test_speedup: float
    draft_vocabs: list[int] = field(default_factory=list)
    vocab_speedups: list[float] = field(default_factory=list)


@dataclass
class PredictorTuning:
    """Verified SpecEE's per-layer exit thresholds, tuned by replaying its schedule on held-out
    on-policy text (:mod:`selfspec.training.specee_tuning`; read by ``specee:tuned=true``).

    Attributes:
        layers / thresholds: the predictor layers left on, increasing, and their thresholds.
        single_threshold: the best single threshold of the grid (every layer on) on the
            tuning half.
        max_early: exited tokens outstanding before one runs every layer.
        row_cost / scan_cost / output_cost / check_costs: the cost model in single-position
            layer calls (one more position in a layer call, the drafter, the output layer,
            ``[len(layers)]`` each kept layer's check).
        row_cost_source: ``"given"`` (``--row-cost``) or ``"measured: <latency key>"`` (this
            machine's latency model).
        output_cost_source: ``"measured: <latency key>"``, ``"given"`` (``--output-cost``) or
            ``"bytes"`` (the weights' bytes over a decoder layer's).
        inner_layers / inner_drafter: positions inside a draft were replayed with the
            candidates drafted from the previous position's state at these exit layers, by
            the ``"exit-state"`` or ``"main"`` drafter; ``[]`` and ``""``: as at a draft's
            start.
        data: on-policy sources replayed.
        tokens / speedup / acceptance / drafts_per_token: the replay on the tuning half of the
            held-out sequences (what was tuned on).
        check_tokens / check_speedup / check_acceptance: the same setting on the other half;
        single_check_speedup: the single threshold there.
        ceiling_check_speedup: perfect predictors there (every layer on, firing exactly where
            the top local candidate is the final token:
            :func:`~selfspec.training.specee_tuning.ceiling`).
    """

    layers: list[int]
    thresholds: list[float]
    single_threshold: float
    max_early: int
    row_cost: float
    scan_cost: float
    output_cost: float
    check_costs: list[float]
    data: list[str]
    tokens: int
    speedup: float
    acceptance: float
    drafts_per_token: float
    check_tokens: int
    check_speedup: float
    check_acceptance: float
    single_check_speedup: float
    ceiling_check_speedup: float
    row_cost_source: str
    output_cost_source: str
    inner_layers: list[int]
    inner_drafter: str


@dataclass
class PredictorCard:
    """SpecEE exit predictors (SpecEE §4-5) stored with the head that drafts their candidates.

    Attributes:
        candidate_layer: the first layer whose features the predictors see: the exit layer of
            the head whose top-``k`` tokens are the candidates, or with ``drafter``
            candidates (drafted before layer 0) the first predictor layer.
        num_candidates: ``k``.
        draft_vocab: the candidates were the top-``k`` over the ``K`` most frequent tokens (``0``
            = the full vocabulary).
        hidden: MLP width.
        layers: exit layers with a predictor (sorted).
        offline_layers: SpecEE's offline schedule: the layers where predictors exited held-out
            tokens most often, most frequent first.
        exit_frequency: ``[len(layers)]`` share of held-out tokens whose first predictor above
            0.5 (every predictor active) was at that layer.
        candidate_recall: share of held-out tokens whose final-layer token was a candidate
            (no token can exit early otherwise).
        base_rate / accuracy / precision: ``[len(layers)]`` held-out share of positive labels,
            accuracy of ``predictor > 0.5``, and the share of its exits whose emitted candidate
            was the final token.
        train_tokens / eval_tokens: tokens per layer used.
        epochs: training epochs; seconds: wall time.
        thresholds / token_accuracy / mean_layers: the held-out simulation at each threshold
            (every predictor active): share of emitted tokens equal to the final layer's, and
            mean layers run per token (``L`` for a token no predictor lets exit).
        candidates: ``"head"`` (the head's top-``k``), ``"drafter"`` (the file's
            :class:`~selfspec.heads.drafter.FeatureDrafter`'s top-``k``), each with
            ``"+ngram"`` (the prompt-lookup token replaces the ``k``-th when it is not among
            them: :func:`~selfspec.decoding.specee.step.merge_ngram`).
        state_dim: ``H`` when the predictors also read the layer's state
            (:class:`~selfspec.heads.predictor.ExitPredictors`), ``0`` for SpecEE's 12 features.
        lens_layers: layers whose features read the candidates through the file's exit head
            there (``T · final_norm(h)`` before the candidates' ``lm_head`` rows: the head's
            tuned lens) instead of ``final_norm(h)`` (the logit lens; SpecEE's features). Empty
            for SpecEE's own features (:mod:`selfspec.heads.predictor`, "head lens").
        tuning: verified SpecEE's per-layer thresholds (:class:`PredictorTuning`), or
            ``None`` (no on-policy held-out text to replay).
    """

    candidate_layer: int
    num_candidates: int
    draft_vocab: int
    hidden: int
    layers: list[int]
    offline_layers: list[int]
    exit_frequency: list[float]
    candidate_recall: float
    base_rate: list[float]
    accuracy: list[float]
    precision: list[float]
    train_tokens: int
    eval_tokens: int
    epochs: int
    seconds: float
    thresholds: list[float] = field(default_factory=list)
    token_accuracy: list[float] = field(default_factory=list)
    mean_layers: list[float] = field(default_factory=list)
    candidates: str = "head"
    state_dim: int = 0
    lens_layers: list[int] = field(default_factory=list)
    tuning: PredictorTuning | None = None


@dataclass
class DrafterCard:
    """The next-token drafter of SpecEE's candidates
    (:class:`~selfspec.heads.drafter.FeatureDrafter`).

    Attributes:
        draft_vocab: the loss and the held-out figures used the ``K`` most frequent tokens'
            rows (``0`` = the full vocabulary).
        exit_mix: share of training inputs whose previous state was taken at an intermediate
            layer (``exit_layers``) instead of the last one, as decoding sees after an exit.
        exit_layers: the layers those states came from.
        epochs / lr: optimisation; seconds: wall time.
        train_tokens / eval_tokens: positions trained on (the heads' training split) and
            evaluated on (their test split).
        top1 / topk: held-out share of positions whose final-layer token is the drafter's
            first candidate / among its top ``k``.
        k: the ``k`` of ``topk`` (SpecEE's 4).
        exit_state_layers: the layers whose states the exit-state drafter (a second drafter
            that drafts after an exited token, from its exit-layer state) was trained on, one
            drawn per position; empty: no exit-state drafter.
        exit_state_topk: held-out top-``k`` of the exit-state drafter with the previous state
            at each of ``exit_state_layers`` (mean over them).
        exit_state_topk_main: the main drafter's on the same inputs (what decoding had
            before the exit-state drafter).
        exit_state_seconds: the exit-state drafter's training wall time (``seconds`` is the
            main drafter's).
    """

    draft_vocab: int
    exit_mix: float
    exit_layers: list[int]
    epochs: int
    lr: float
    seconds: float
    train_tokens: int
    eval_tokens: int
    top1: float
    topk: float
    k: int = 4
    exit_state_layers: list[int] = field(default_factory=list)
    exit_state_topk: float = math.nan
    exit_state_topk_main: float = math.nan
    exit_state_seconds: float = math.nan


@dataclass
class TrainingInfo:
    """How the heads were trained (see :mod:`selfspec.training.train`).

    ``data``, ``requested_tokens``, ``max_new_tokens``, ``max_len`` and ``seed`` reproduce the
    exact corpus (and so the held-out problems) for a later ``selfspec heads calibrate``;
    ``train_tokens`` / ``eval_tokens`` are what that corpus actually held. ``loss_vocab``:
    ``0`` = the KL was over the full vocabulary (AdaDecode §2.1); ``K > 0`` = over the ``K``
    most frequent tokens plus EOS (the rows of ``draft_vocab=K``), renormalised over them
    (our departure, for speed with large vocabularies).
    ``cpu``: the CPU's number-format abilities where training ran (:meth:`CpuInfo.summary`),
    which explain ``compute_dtype`` and ``seconds``.
    """

    loss: str
    kl_direction: str
    alpha: float
    data: list[str]
    train_tokens: int
    eval_tokens: int
    epochs: int
    lr: float
    batch_tokens: int
    compute_dtype: str
    feature_dtype: str
    init: str
    seed: int
    seconds: float
    requested_tokens: int = 0
    max_new_tokens: int = 256
    max_len: int = 1024
    loss_vocab: int = 0
    cpu: str = ""

    def loss_vocabulary(self) -> str:
        """How the KL was computed, in words (for ``selfspec heads show``)."""
        if self.loss_vocab:
            return f"KL over the {self.loss_vocab} most frequent tokens (+ EOS), renormalised"
        return "KL over the full vocabulary"


@dataclass
class PromptUse:
    """The prompts of one dataset that one stage used (held-out bookkeeping,
    docs/design.md "Held-out evaluation").

    Attributes:
        use: one of :data:`PROMPT_USES`: ``train`` (head training and the token counts that
            rank a reduced draft vocabulary), ``calibration`` (τ_k(ε)), ``test`` (card
            figures only), ``probe-train`` / ``probe-eval`` (AdaSPEED probes),
            ``predictor-train`` / ``predictor-eval`` (SpecEE predictors and their schedule).
        dataset: the dataset name (``selfspec.data.DATASETS``; ``"stdlib"``, ``"humaneval"``).
        ids: the prompt ids, sorted.
    """

    use: str
    dataset: str
    ids: list[str]


def prompt_uses(pairs: Iterable[tuple[str, str, str]]) -> list[PromptUse]:
    """``(use, dataset, prompt_id)`` triples → one sorted :class:`PromptUse` per use and
    dataset."""
    grouped: dict[tuple[str, str], set[str]] = {}
    for use, dataset, pid in pairs:
        grouped.setdefault((use, dataset), set()).add(pid)
    return [PromptUse(use, dataset, sorted(ids)) for (use, dataset), ids in sorted(grouped.items())]


@dataclass
class HeadCard:
    """Everything a head file records besides its tensors.

    Attributes:
        model: name of the model the heads were trained for.
        fingerprint: :class:`ModelFingerprint` of that model.
        kind: ``"lightweight"``, ``"full"``, or ``None`` for a file holding only probes.
        layers: exit layers of the heads (sorted).
        num_layers / hidden_size / vocab_size: the model's shape.
        training: :class:`TrainingInfo` or ``None``.
        heads: per-head :class:`HeadEval`.
        calibration_metrics / calibration_epsilons: what was calibrated.
        calibration_draft_vocabs: reduced draft-vocabulary sizes K with their own calibration
            (DSSD with ``draft_vocab=K`` uses those thresholds).
        calibration: per-head :class:`HeadCalibration` (empty until calibrated).
        probes: per-exit-layer :class:`ProbeCard`.
        predictors: SpecEE's exit predictors (:class:`PredictorCard`), or ``None``.
        drafter: SpecEE's next-token drafter (:class:`DrafterCard`), or ``None``.
        adadecode: AdaDecode's tuned thresholds (:class:`AdaDecodeCard`), or ``None``.
        prompts: every prompt each stage used (:class:`PromptUse`).
        created: ISO-8601 time of the last write.
        selfspec_version: package version that wrote the file.
        format_version: :data:`CARD_FORMAT_VERSION` (a card of another format does not load).
    """

    model: str
    fingerprint: ModelFingerprint
    kind: str | None
    layers: list[int]
    num_layers: int
    hidden_size: int
    vocab_size: int
    training: TrainingInfo | None = None
    heads: list[HeadEval] = field(default_factory=list)
    calibration_metrics: list[str] = field(default_factory=list)
    calibration_epsilons: list[float] = field(default_factory=list)
    calibration_draft_vocabs: list[int] = field(default_factory=list)
    calibration: list[HeadCalibration] = field(default_factory=list)
    probes: list[ProbeCard] = field(default_factory=list)
    predictors: PredictorCard | None = None
    adadecode: AdaDecodeCard | None = None
    drafter: DrafterCard | None = None
    prompts: list[PromptUse] = field(default_factory=list)
    created: str = ""
    selfspec_version: str = ""
    format_version: int = CARD_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite floats become ``None``)."""
        data = asdict(self)
        data["fingerprint"] = self.fingerprint.to_dict()
        return _jsonable(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadCard:
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError: malformed card, or one of another format
                (callers turn these into :class:`~selfspec.errors.CorruptModelFileError`).
        """
        version = int(data["format_version"])
        if version != CARD_FORMAT_VERSION:
            raise ValueError(f"card format {version}, but this selfspec reads format "
                             f"{CARD_FORMAT_VERSION}: train the heads again")
        training = data.get("training")
        return cls(
            model=str(data["model"]),
            fingerprint=ModelFingerprint.from_dict(data["fingerprint"]),
            kind=data.get("kind"),
            layers=[int(x) for x in data["layers"]],
            num_layers=int(data["num_layers"]),
            hidden_size=int(data["hidden_size"]),
            vocab_size=int(data["vocab_size"]),
            training=None if training is None else TrainingInfo(**_floats(training)),
            heads=[HeadEval(**_floats(h)) for h in data.get("heads", [])],
            calibration_metrics=list(data.get("calibration_metrics", [])),
            calibration_epsilons=[float(e) for e in data.get("calibration_epsilons", [])],
            calibration_draft_vocabs=[int(k) for k in data.get("calibration_draft_vocabs", [])],
            calibration=[_head_calibration(c) for c in data.get("calibration", [])],
            probes=[ProbeCard(**_floats(p)) for p in data.get("probes", [])],
            predictors=(None if data.get("predictors") is None
                        else _predictor_card(data["predictors"])),
            adadecode=(None if data.get("adadecode") is None
                       else AdaDecodeCard(**_floats(data["adadecode"]))),
            drafter=(None if data.get("drafter") is None
                     else DrafterCard(**_floats(data["drafter"]))),
            prompts=[PromptUse(str(u["use"]), str(u["dataset"]), [str(i) for i in u["ids"]])
                     for u in data.get("prompts", [])],
            created=str(data.get("created", "")),
            selfspec_version=str(data.get("selfspec_version", "")),
            format_version=version,
        )

    def seen_prompts(self) -> dict[str, set[str]]:
        """Dataset → ids of the prompts that shaped these heads, thresholds or probes
        (:data:`IN_SAMPLE_USES`)."""
        seen: dict[str, set[str]] = {}
        for u in self.prompts:
            if u.use in IN_SAMPLE_USES:
                seen.setdefault(u.dataset, set()).update(u.ids)
        return seen

    def set_prompts(self, uses: Iterable[PromptUse], replace: Iterable[str] = ()) -> None:
        """Add ``uses``; records of the uses named in ``replace`` are dropped first (a
        re-calibration replaces the calibration prompts; training prompts only accumulate)."""
        dropped = set(replace)
        kept = [(u.use, u.dataset, i) for u in self.prompts if u.use not in dropped
                for i in u.ids]
        new = [(u.use, u.dataset, i) for u in uses for i in u.ids]
        self.prompts = prompt_uses(kept + new)

    def head_eval(self, layer: int) -> HeadEval | None:
        return next((h for h in self.heads if h.layer == layer), None)

    def head_calibration(self, layer: int) -> HeadCalibration | None:
        return next((c for c in self.calibration if c.layer == layer), None)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return _finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _floats(data: dict[str, Any]) -> dict[str, Any]:
    """JSON ``null`` back to NaN for the float fields of the small cards."""
    return {k: (math.nan if v is None else v) for k, v in data.items()}


def _predictor_card(data: dict[str, Any]) -> PredictorCard:
    """A :class:`PredictorCard` from JSON (``null`` back to NaN, in lists too)."""
    data = dict(data)
    tuning = data.pop("tuning", None)
    fixed = {k: [math.nan if x is None else x for x in v] if isinstance(v, list) else v
             for k, v in _floats(data).items()}
    return PredictorCard(**fixed, tuning=None if tuning is None else
                         PredictorTuning(**_floats(tuning)))


def _head_calibration(data: dict[str, Any]) -> HeadCalibration:
    metrics = []
    for m in data.get("metrics", []):
        rows = []
        for r in m.get("thresholds", []):
            r = dict(r)
            value = r.pop("value")
            rows.append(ThresholdRow(value=math.inf if value is None else float(value),
                                     **_floats(r)))
        metrics.append(MetricCalibration(m["metric"], _nan(m.get("auc")), _nan(m.get("test_auc")),
                                         rows))
    return HeadCalibration(int(data["layer"]), int(data["tokens"]),
                           _nan(data.get("accuracy")),
                           int(data.get("test_tokens", 0)), _nan(data.get("test_accuracy")),
                           metrics)
