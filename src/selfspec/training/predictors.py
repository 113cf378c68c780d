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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.errors import InvalidArgumentError
from selfspec.heads.predictor import (
    PREDICTOR_HIDDEN,
    STATE_PREDICTOR_HIDDEN,
    ExitPredictors,
    candidate_features,
)


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
        fewer epochs over tens of thousands of positions; docs/results/specee
        xeon-2026-11-27-state)."""
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
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.epochs * steps_per_epoch)
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
