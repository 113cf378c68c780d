"""Training SpecEE's exit predictors and their offline schedule (SpecEE §4-5).

From one backbone pass over held-out text (teacher forcing; :mod:`selfspec.training.features`):

1. candidates: the top-``k`` of the exit head at the candidate layer ``c`` (over the draft
   vocabulary when one is given), per position — what decoding will draft;
2. features at every layer ``ℓ ∈ [c, L)``: :func:`~selfspec.heads.predictor.candidate_features`
   with the change taken against layer ``ℓ - 1`` (decoding computes them the same way), read
   through the exit head at the layers of the head lens when one is asked for;
3. label at ``ℓ``: the candidate with the highest local probability equals the final layer's
   greedy token (SpecEE §4);
4. one MLP per layer, trained jointly (stacked weights) with the binary cross-entropy, Adam
   (state-reading predictors also get each layer's state after the final norm, and the
   features are standardised on the training set first);
5. held-out figures per layer, and the offline schedule: every predictor active, the first
   one above 0.5 is where a held-out token would exit; layers ranked by how often that
   happens, the most frequent ``offline`` kept (§5).

The stage ``selfspec heads train-predictors``: :class:`PredictorRequest` →
:func:`train_predictors` → :class:`PredictorOutcome` (its thresholds tuned by replay in
:mod:`selfspec.training.specee_tuning`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import PredictorCard, PredictorTuning
from selfspec.heads.files import ExitHeads, find_head_file, load_heads, model_name, save_heads
from selfspec.heads.modules import ExitHead
from selfspec.heads.predictor import (
    PREDICTOR_HIDDEN,
    STATE_PREDICTOR_HIDDEN,
    ExitPredictors,
    candidate_features,
)
from selfspec.training.adadecode_tuning import DEFAULT_ROW_COST
from selfspec.training.corpus import (
    CALIBRATION,
    ONPOLICY,
    TEST,
    TRAIN,
    CorpusItem,
    dataset_of,
    items_by_use,
    parse_data_spec,
)
from selfspec.training.drafter import (
    DrafterPositions,
    default_exit_state_layers,
    drafter_candidates,
    drafter_positions,
)
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet
from selfspec.training.pipeline import (
    DEFAULT_CANDIDATE_VOCAB,
    DataRequest,
    PreparedData,
    StageTimes,
    default_first_layer,
    draft_rows,
    in_feature_order,
    prepare_features,
)
from selfspec.training.specee_tuning import InnerOutputs, ReplayCosts, replay_costs, tune_predictors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictorTrainConfig:
    """Optimisation settings of :func:`fit_predictors`.

    Attributes:
        epochs: passes over the training tokens.
        lr: Adam learning rate.
        batch: tokens per step (every layer at once).
        hidden: MLP width (512 in the paper).
        seed: initialisation and shuffling.
        state: train state-reading predictors
            (:class:`~selfspec.heads.predictor.ExitPredictors` with ``state_dim = H``); the
            data must carry ``states``.
    """

    epochs: int = 30
    lr: float = 3e-3
    batch: int = 512
    hidden: int = PREDICTOR_HIDDEN
    seed: int = 0
    state: bool = False

    @classmethod
    def state_reading(cls, epochs: int = 8) -> PredictorTrainConfig:
        """The settings measured for state-reading predictors (3k + H inputs: a narrower MLP,
        fewer epochs over tens of thousands of positions)."""
        return cls(epochs=epochs, lr=2e-3, hidden=STATE_PREDICTOR_HIDDEN, state=True)


@dataclass(frozen=True)
class PredictorData:
    """Features and labels of every predictor layer.

    Attributes:
        layers: ``[P]`` exit layers.
        features: ``[P, N, 3k]`` float32.
        labels: ``[P, N]`` bool: the top local candidate at that layer is the final token.
        picks: ``[P, N]`` int64: the token each layer would emit (top local candidate).
        recall: ``[N]`` bool: the final token is among the candidates.
        states: ``[P, N, H]`` each layer's state after the final norm (model dtype), for
            state-reading predictors; ``None`` otherwise.
    """

    layers: list[int]
    features: torch.Tensor
    labels: torch.Tensor
    picks: torch.Tensor
    recall: torch.Tensor
    states: torch.Tensor | None = None


@torch.inference_mode()
def predictor_data(executor: object, hidden: dict[int, torch.Tensor], candidates: torch.Tensor,
                   final_tokens: torch.Tensor, layers: list[int],
                   batch_tokens: int = 2048, with_states: bool = False,
                   index: torch.Tensor | None = None,
                   lenses: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None
                   ) -> PredictorData:
    """Features and labels (module doc, steps 2-3).

    Args:
        executor: the model's :class:`~selfspec.executor.LayerExecutor`.
        hidden: ``{ℓ: [N, H]}`` hidden states leaving ``ℓ`` layers, for every ``ℓ`` in
            ``layers`` (``{ℓ: [M, H]}`` with ``index``).
        candidates: ``[N, k]`` int64 candidate ids per position.
        final_tokens: ``[N]`` the final layer's greedy tokens.
        layers: consecutive exit layers ``[c, c+1, ...]``.
        with_states: also keep each layer's normed state (``states``; ``P·N·H`` values in the
            model's dtype).
        index: ``[N]`` int64 rows of ``hidden`` to use (sliced chunk by chunk, so the
            positions' states are never copied whole; ``None`` = all ``N`` rows).
        lenses: ``{ℓ: lens}`` with ``lens(normed [1, n, H]) -> [1, n, H]`` (an exit head's
            ``T``, applied to the final norm of the state): the features at ``ℓ`` read the
            candidates through it (the head lens, :mod:`selfspec.heads.predictor`); other
            layers read the final norm itself.

    Raises:
        InvalidArgumentError: non-consecutive layers or a missing hidden state.
    """
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise InvalidArgumentError(f"predictor layers must be consecutive, got {layers}")
    missing = [x for x in layers if x not in hidden]
    if missing:
        raise InvalidArgumentError(f"no hidden states for layers {missing}")
    weight, bias = executor.lm_head.weight, executor.lm_head.bias
    n = candidates.shape[0]
    if index is not None and index.numel() != n:
        raise InvalidArgumentError(f"{index.numel()} positions in index, {n} candidate rows")
    states = None
    if with_states:
        first = hidden[layers[0]]
        states = torch.empty(len(layers), n, first.shape[-1], dtype=first.dtype)
    features, labels, picks = [], [], []
    for start in range(0, n, batch_tokens):
        cand = candidates[start:start + batch_tokens]
        rows = weight[cand]                                     # [n, k, H]
        b = None if bias is None else bias[cand]
        final = final_tokens[start:start + batch_tokens]
        previous = None
        f_chunk, l_chunk, p_chunk = [], [], []
        rows_of = (slice(start, start + batch_tokens) if index is None
                   else index[start:start + batch_tokens])
        for j, layer in enumerate(layers):
            normed = executor.final_norm(hidden[layer][rows_of])
            if states is not None:
                states[j, start:start + normed.shape[0]] = normed
            if lenses and layer in lenses:
                normed = lenses[layer](normed.unsqueeze(0))[0]
            scores = candidate_features(normed, rows, b, previous)
            previous = scores.probs
            pick = cand.gather(1, scores.probs.argmax(-1, keepdim=True)).squeeze(1)
            f_chunk.append(scores.features)
            p_chunk.append(pick)
            l_chunk.append(pick == final)
        features.append(torch.stack(f_chunk))
        labels.append(torch.stack(l_chunk))
        picks.append(torch.stack(p_chunk))
    recall = (candidates == final_tokens.unsqueeze(1)).any(1)
    return PredictorData(list(layers), torch.cat(features, 1), torch.cat(labels, 1),
                         torch.cat(picks, 1), recall, states)


def fit_predictors(data: PredictorData, num_candidates: int,
                   config: PredictorTrainConfig = PredictorTrainConfig()) -> ExitPredictors:
    """Train one MLP per layer on ``data`` (binary cross-entropy, Adam; module doc step 4).

    Raises:
        InvalidArgumentError: no training tokens; ``config.state`` without ``data.states``.
    """
    n = data.features.shape[1]
    if n == 0:
        raise InvalidArgumentError("no training tokens for the predictors; give more data")
    states = data.states if config.state else None
    if config.state and states is None:
        raise InvalidArgumentError("state-reading predictors need the layers' states "
                                   "(predictor_data(..., with_states=True))")
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    model = ExitPredictors(data.layers, num_candidates, config.hidden,
                           0 if states is None else states.shape[-1])
    if states is not None:
        model.feature_mean.data.copy_(data.features.mean(1))
        model.feature_std.data.copy_(data.features.std(1).clamp_min(1e-6) if n > 1
                                     else torch.ones_like(model.feature_std))
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    y = data.labels.float()
    steps_per_epoch = math.ceil(n / config.batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                          config.epochs * steps_per_epoch)
    with torch.enable_grad():
        for _ in range(config.epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, config.batch):
                idx = order[start:start + config.batch]
                logits = model.logits_all(data.features[:, idx],
                                          None if states is None else states[:, idx])
                loss = F.binary_cross_entropy_with_logits(logits, y[:, idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class PredictorEval:
    """Held-out quality of the predictors (module doc step 5).

    Attributes:
        base_rate / accuracy / precision: ``[P]`` per layer (see
            :class:`~selfspec.heads.card.PredictorCard`).
        exit_frequency: ``[P]`` share of tokens whose first predictor above ``threshold`` is
            at that layer (every predictor active).
        token_accuracy: share of tokens whose emitted token (exit candidate or final token)
            is the final token, every predictor active.
        mean_exit_layer: mean layers run per token, every predictor active (``L`` when none
            fires).
    """

    base_rate: list[float]
    accuracy: list[float]
    precision: list[float]
    exit_frequency: list[float]
    token_accuracy: float
    mean_exit_layer: float


@torch.inference_mode()
def evaluate_predictors(model: ExitPredictors, data: PredictorData, num_layers: int,
                        threshold: float = 0.5) -> PredictorEval:
    """Per-layer figures and the sequential-exit simulation on held-out ``data`` (with
    ``states`` for state-reading predictors)."""
    return exit_figures(predictor_probs(model, data), data, num_layers, threshold)


def exit_figures(prob: torch.Tensor, data: PredictorData, num_layers: int,
                 threshold: float = 0.5) -> PredictorEval:
    """:func:`evaluate_predictors` from the predictors' ``[P, N]`` exit probabilities on
    ``data`` (:func:`predictor_probs`), so a threshold sweep computes them once."""
    fire = prob > threshold
    labels = data.labels
    n = labels.shape[1]
    base = labels.float().mean(1)
    acc = (fire == labels).float().mean(1)
    hits = (fire & labels).float().sum(1)
    shots = fire.float().sum(1)
    precision = torch.where(shots > 0, hits / shots.clamp_min(1), torch.full_like(shots, math.nan))
    fired_any = fire.any(0)
    first = torch.where(fired_any, fire.float().argmax(0), torch.full((n,), -1))
    freq = torch.stack([(first == i).float().mean() for i in range(len(data.layers))]) \
        if n else torch.zeros(len(data.layers))
    layer_of = torch.tensor(data.layers)
    exit_layer = torch.where(fired_any, layer_of[first.clamp_min(0)], torch.full((n,), num_layers))
    correct = torch.where(fired_any, labels.gather(0, first.clamp_min(0).unsqueeze(0)).squeeze(0),
                          torch.ones(n, dtype=torch.bool))
    return PredictorEval(base.tolist(), acc.tolist(), precision.tolist(), freq.tolist(),
                         float(correct.float().mean()) if n else math.nan,
                         float(exit_layer.float().mean()) if n else math.nan)


@torch.inference_mode()
def predictor_probs(model: ExitPredictors, data: PredictorData,
                    batch_tokens: int = 4096) -> torch.Tensor:
    """``[P, N]`` every layer's exit probability on ``data`` (in chunks of positions: the
    state-reading predictors' inputs are ``P·N·(3k + H)`` floats)."""
    n = data.features.shape[1]
    states = data.states if model.state_dim else None
    parts = [torch.sigmoid(model.logits_all(
        data.features[:, i:i + batch_tokens],
        None if states is None else states[:, i:i + batch_tokens]))
        for i in range(0, n, batch_tokens)]
    return torch.cat(parts, 1) if parts else torch.zeros(len(data.layers), 0)


def offline_schedule(layers: list[int], exit_frequency: list[float], size: int) -> list[int]:
    """SpecEE's offline layer set: the ``size`` layers with the highest held-out exit
    frequency, most frequent first (ties: shallower first)."""
    ranked = sorted(range(len(layers)), key=lambda i: (-exit_frequency[i], layers[i]))
    return [layers[i] for i in ranked[:size]]


# The predictors train on the training and calibration splits (minus the heads' training
# prompts, see predictor_splits) and are evaluated on the test split.
PREDICTOR_USES = {TRAIN: "predictor-train", CALIBRATION: "predictor-train", TEST: "predictor-eval"}


# held-out token accuracy / layers on the card (specee's accuracy= picks from it); the high end
# is where state-reading predictors reach 97-99% token accuracy
THRESHOLD_SWEEP = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.993, 0.995, 0.997, 0.998, 0.999)


# Code and math text, teacher-forced (held out from HumanEval's and GSM-Symbolic's benchmark
# prompts by the card's prompt records).
DEFAULT_PREDICTOR_DATA = DataRequest(data="stdlib,gsm", tokens=12_000)


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
        data: :class:`DataRequest` (default :data:`DEFAULT_PREDICTOR_DATA`).
        config: :class:`~selfspec.training.predictors.PredictorTrainConfig` (``state``:
            state-reading predictors).
        include_head_train: train on the prompts the heads (and drafter) trained on too
            (:func:`predictor_splits` drops them by default). More data, at the price of
            candidates that are right more often there than on new text; state-reading
            predictors need the data. Held-out figures stay on the test split.
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
            ``"bytes"``: its weight bytes over a decoder layer's (the earlier default); or
            a number.
    """

    heads: str = "default"
    candidate_layer: int | None = None
    num_candidates: int = 4
    draft_vocab: int = DEFAULT_CANDIDATE_VOCAB
    offline: int | None = None
    candidates: str = "head"
    data: DataRequest = field(default_factory=lambda: DEFAULT_PREDICTOR_DATA)
    config: PredictorTrainConfig = field(default_factory=PredictorTrainConfig)
    include_head_train: bool = False
    head_lens: bool = False
    row_cost: float | None = None
    output_cost: float | str = "auto"


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


def _check_predictor_request(request: PredictorRequest) -> None:
    """Refuse bad options of ``request`` before loading anything.

    Raises:
        InvalidArgumentError: unknown ``candidates``, ``num_candidates`` outside [2, 64] or a
            negative ``draft_vocab``.
    """
    from selfspec.decoding.specee.step import CANDIDATE_SOURCES

    if request.candidates not in CANDIDATE_SOURCES:
        raise InvalidArgumentError(f"candidates must be one of {', '.join(CANDIDATE_SOURCES)}, "
                                   f"got {request.candidates!r}")
    if not 2 <= request.num_candidates <= 64:
        raise InvalidArgumentError(f"--k must be in [2, 64], got {request.num_candidates}")
    if request.draft_vocab < 0:
        raise InvalidArgumentError(f"--draft-vocab must be >= 0, got {request.draft_vocab}")


def _candidate_layer(engine: Engine, request: PredictorRequest, container: ExitHeads,
                     target: Path) -> tuple[int, ExitHead | None]:
    """``(first predictor layer, candidate head)``: the head at the candidate layer, or
    ``None`` with drafter candidates (the file's drafter drafts them before layer 0).

    Raises:
        InvalidArgumentError: no drafter in the file (drafter candidates), a first layer
            outside ``[1, L-1]``, no exit heads (head candidates), no head at the layer.
    """
    num_layers = engine.executor.num_layers
    if not request.candidates.startswith("drafter"):
        if not container.layers:
            raise InvalidArgumentError(f"{target} holds no exit heads to draft candidates with")
        layer = (default_candidate_layer(container.layers, num_layers)
                 if request.candidate_layer is None else request.candidate_layer)
        return layer, container.head_at(layer)
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
    return layer, None


@dataclass(frozen=True)
class _Candidates:
    """How the predictors' candidates are drafted at held-out and training positions.

    Attributes:
        container: the head file (its drafter and exit-state drafter).
        head: the candidate head, or ``None``: the file's drafter drafts them.
        layer: the first predictor layer (the candidate head's).
        layers: every predictor layer, ``layer .. L-1``.
        rows: ``[R]`` draft-vocabulary rows, or ``None`` (every token).
        positions: the drafter's previous positions (``None`` with head candidates).
        lookups: ``[N]`` prompt-lookup tokens (``+ngram``), or ``None``.
        lenses: ``{ℓ: head lens}`` of the features.
    """

    container: ExitHeads
    head: ExitHead | None
    layer: int
    layers: list[int]
    rows: torch.Tensor | None
    positions: DrafterPositions | None
    lookups: torch.Tensor | None
    lenses: dict

    def data(self, engine: Engine, request: PredictorRequest, features: FeatureSet,
             idx: torch.Tensor, exit_layer: int | None = None) -> PredictorData:
        """The predictors' data at ``idx``; with ``exit_layer`` (drafter candidates), as the
        positions stand inside a draft after an exit there: drafted by the exit-state drafter
        (the main one if none) from the previous position's state at that layer."""
        from selfspec.decoding.specee.step import merge_ngram

        if self.head is None:
            drafter = (self.container.drafter if exit_layer is None
                       else self.container.exit_drafter or self.container.drafter)
            cands = drafter_candidates(engine, drafter, features, self.positions, idx,
                                       request.num_candidates, self.rows, exit_layer=exit_layer)
        else:
            cands = head_candidates(engine, self.head, features.hidden[self.layer][idx],
                                    request.num_candidates, self.rows)
        if self.lookups is not None:
            cands = merge_ngram(cands, self.lookups[idx])
        return predictor_data(engine.executor, features.hidden, cands,
                              features.teacher_token[idx], self.layers,
                              with_states=request.config.state, index=idx, lenses=self.lenses)


def _positions(request: PredictorRequest, container: ExitHeads, prepared: PreparedData,
               drafted: bool) -> tuple[torch.Tensor, torch.Tensor, set, DrafterPositions | None]:
    """``(train, eval, head_train, drafter positions)``: the predictors' training and held-out
    positions (:func:`predictor_splits`; with drafter candidates, only where the previous
    position's state exists), the ``(dataset, prompt id)`` pairs left out as the heads'.

    Raises:
        InvalidArgumentError: no training or no held-out position.
    """
    head_train = set() if request.include_head_train else {
        (u.dataset, i) for u in container.card.prompts if u.use == "train" for i in u.ids}
    train_idx, eval_idx = predictor_splits(prepared.items, prepared.features, head_train)
    positions = drafter_positions(in_feature_order(prepared.items)) if drafted else None
    if positions is not None:  # the drafter needs the previous position's state
        usable = positions.usable()
        train_idx, eval_idx = train_idx[usable[train_idx]], eval_idx[usable[eval_idx]]
    if train_idx.numel() == 0 or eval_idx.numel() == 0:
        raise InvalidArgumentError(
            "the predictors need training tokens from prompts the heads did not train on, and "
            "held-out tokens; give more data (or other --data than the heads saw)")
    return train_idx, eval_idx, head_train, positions


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
    ex = engine.executor
    num_layers = ex.num_layers
    _check_predictor_request(request)
    target = find_head_file(request.heads, model_name(engine))
    container = load_heads(target, engine)
    drafted = request.candidates.startswith("drafter")
    layer, head = _candidate_layer(engine, request, container, target)
    offline = (max(1, round(num_layers / 4)) if request.offline is None else request.offline)
    if not 1 <= offline <= num_layers - layer:
        raise InvalidArgumentError(
            f"--offline must be in [1, {num_layers - layer}] (predictor layers), got {offline}")
    size = min(request.draft_vocab, ex.vocab_size)
    rows = draft_rows(engine, container, target, size)
    layers = list(range(layer, num_layers))
    lenses = head_lenses(container, layers, target) if request.head_lens else {}
    # Before the long stages, and only where on-policy text lets the tuning run: a first run
    # on this machine measures its latencies.
    tunable = any(x.startswith(ONPOLICY) for x in parse_data_spec(request.data.data))
    costs = (replay_costs(engine, request.row_cost, request.output_cost) if tunable
             else ReplayCosts(DEFAULT_ROW_COST, "given"))
    times = StageTimes()
    prepared = prepare_features(engine, request.data, layers, times, progress)
    features = prepared.features
    train_idx, eval_idx, head_train, positions = _positions(request, container, prepared,
                                                            drafted)
    t0 = time.perf_counter()
    lookups = ngram_tokens(prepared.items) if request.candidates.endswith("+ngram") else None
    assert lookups is None or lookups.numel() == features.num_tokens, "positions out of step"
    candidates = _Candidates(container, head, layer, layers, rows, positions, lookups, lenses)
    if request.config.state:
        _check_state_memory(train_idx.numel() + eval_idx.numel(), len(layers),
                            features.hidden[layer].shape[-1], features.hidden[layer].element_size())
    train_data = candidates.data(engine, request, features, train_idx)
    eval_data = candidates.data(engine, request, features, eval_idx)
    predictors = fit_predictors(train_data, request.num_candidates, request.config)
    del train_data  # the largest tensors here (states): the views below need the memory
    prob = predictor_probs(predictors, eval_data)
    inner = None
    if drafted and tunable:
        exits = [e for e in default_exit_state_layers(num_layers) if e in features.hidden]
        inner = inner_outputs(predictors, exits,
                              lambda e: candidates.data(engine, request, features, eval_idx, e),
                              "exit-state" if container.exit_drafter is not None else "main")
    evaluation = exit_figures(prob, eval_data, num_layers)
    sweep = [exit_figures(prob, eval_data, num_layers, t) for t in THRESHOLD_SWEEP]
    tuning = tune_predictors(engine, prepared.items, eval_idx, predictors, prob,
                             eval_data.labels, eval_data.layers, lenses,
                             container.drafter if drafted else head, rows, costs, inner=inner)
    times.predictors_s = seconds = time.perf_counter() - t0
    container.predictors = predictors.to(ex.device)
    container.card.predictors = _card(
        request, candidates, predictors, eval_data, evaluation, sweep, offline, size, seconds,
        tuning, (int(train_idx.numel()), int(eval_idx.numel())))
    container.card.set_prompts(items_by_use(
        [i for i in prepared.items
         if i.split == TEST or (dataset_of(i.source), i.prompt_id) not in head_train],
        PREDICTOR_USES))
    save_heads(container, target)
    return PredictorOutcome(target, container, times, evaluation)


def _card(request: PredictorRequest, candidates: _Candidates, predictors: ExitPredictors,
          eval_data: PredictorData, evaluation: PredictorEval, sweep: Sequence[PredictorEval],
          offline: int, size: int, seconds: float, tuning: PredictorTuning | None,
          tokens: tuple[int, int]) -> PredictorCard:
    """The card's record of trained predictors: held-out figures at the default threshold
    (``evaluation``) and at each of :data:`THRESHOLD_SWEEP` (``sweep``), the offline schedule
    of ``offline`` layers, the tuning, and ``tokens`` (training, held-out positions)."""
    layers = candidates.layers
    return PredictorCard(
        candidate_layer=candidates.layer, num_candidates=request.num_candidates,
        draft_vocab=size, hidden=request.config.hidden, layers=layers,
        offline_layers=offline_schedule(layers, evaluation.exit_frequency, offline),
        exit_frequency=evaluation.exit_frequency,
        candidate_recall=float(eval_data.recall.float().mean()),
        base_rate=evaluation.base_rate, accuracy=evaluation.accuracy,
        precision=evaluation.precision, train_tokens=tokens[0],
        eval_tokens=tokens[1], epochs=request.config.epochs,
        seconds=seconds, thresholds=list(THRESHOLD_SWEEP),
        token_accuracy=[e.token_accuracy for e in sweep],
        mean_layers=[e.mean_exit_layer for e in sweep], candidates=request.candidates,
        state_dim=predictors.state_dim, lens_layers=sorted(candidates.lenses), tuning=tuning)


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
