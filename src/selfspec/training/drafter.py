"""Training SpecEE's next-token drafter (:class:`~selfspec.heads.drafter.FeatureDrafter`).

Data: the cached features of the heads' corpus (:mod:`selfspec.training.features`). At a
scored position ``t`` the drafter reads the previous position's last hidden state
``final[t - 1]`` and the embedding of the token at ``t`` and must predict the final layer's
distribution at ``t`` (the same target as the exit heads: forward KL to
``softmax(lm_head(norm(final[t])))``, over the draft vocabulary's rows when ``draft_vocab``
is set; :mod:`selfspec.training.train`). Positions whose previous position is not scored (the
first of each sequence) are skipped.

After an early exit, decoding hands the drafter the exit layer's state instead of the last
layer's. So for a share ``exit_mix`` of the training positions, drawn afresh each step, the
previous state is taken at one of ``exit_layers`` — the drafter learns to read both.

One drafter reads both poorly: on Qwen2.5-Coder-0.5B (49k tokens, held out) a drafter trained
on last-layer states (25% from layers 12 and 18) holds the final token in its top-4 for 66% of
positions from a last-layer state but 38% and 45% from the states of tokens that exited at
layers 3 and 6, where most exits happen. The *exit-state drafter* (``exit_mix = 1`` over layers spread across
the predictors' range) reaches 50% and 54% there, close to a drafter trained on one layer alone
(53%, 55%), so a head file may hold two: the main drafter for a draft's first token, whose
previous position ran every layer, and the exit-state drafter for the tokens after an exit
(``docs/results/specee``; :class:`~selfspec.decoding.specee.step.DrafterCandidates`). Measured end
to end on 20 held-out GSM-Symbolic problems it lengthened the accepted runs (2.30 → 2.43 tokens
a verification) but the exits came later and the speed did not move (1.30× → 1.28× ``ar``,
within the noise), while the thresholds were tuned by a replay that drafted every position from
a last-layer state. Tuned by the replay that drafts inside a draft as decoding does
(:mod:`selfspec.training.specee_tuning`; train the predictors after it), it pays: 1.30× against
1.26× ``ar`` on 40 held-out HumanEval problems, 1.31× against 1.30× on GSM. It stays opt-in
(``selfspec heads train-drafter --exit-state-layers``).

Trained on the heads' training split only; the card's figures are on their test split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.modules import OutputLayer
from selfspec.training.corpus import CorpusItem
from selfspec.training.features import FeatureSet
from selfspec.training.losses import forward_kl
from selfspec.training.train import (
    COMPUTE_DTYPES,
    compute_autocast,
    make_loss_vocab,
    teacher_for,
    training_output_layer,
)

TOP_K = 4  # SpecEE's speculative tokens per step: the card's top-k figure


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Optimisation settings of :func:`fit_drafter`.

    Attributes:
        epochs: passes over the training positions.
        lr: AdamW learning rate (cosine decay to 0).
        weight_decay: AdamW weight decay.
        batch: positions per step.
        exit_mix: share of positions whose previous state comes from an intermediate layer.
        compute_dtype: ``"bf16"`` (autocast) or ``"fp32"``.
        seed: shuffling, mixing and initialisation.
    """

    epochs: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch: int = 256
    exit_mix: float = 0.25
    compute_dtype: str = "bf16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch < 1:
            raise InvalidArgumentError("epochs and batch must be >= 1")
        if not 0.0 <= self.exit_mix <= 1.0:
            raise InvalidArgumentError(f"exit_mix must be in [0, 1], got {self.exit_mix}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InvalidArgumentError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}")


@dataclass(frozen=True)
class DrafterPositions:
    """Where each scored position's drafter input comes from, in feature order.

    Attributes:
        previous: ``[N]`` int64 index of the previous scored position, ``-1`` where the
            previous position is not scored (the first of a sequence).
        token: ``[N]`` int64 the token at each position (the drafter's input token).
    """

    previous: torch.Tensor
    token: torch.Tensor

    def usable(self) -> torch.Tensor:
        """``[N]`` bool: positions with a previous scored position."""
        return self.previous >= 0


def drafter_positions(items: Sequence[CorpusItem]) -> DrafterPositions:
    """:class:`DrafterPositions` of ``items``, which must be in the order
    :func:`~selfspec.training.features.load_features` lays out their positions
    (:func:`selfspec.training.pipeline.in_feature_order`)."""
    previous: list[int] = []
    token: list[int] = []
    position = 0
    for item in items:
        for t in range(item.score_from, len(item.token_ids) - 1):
            previous.append(position - 1 if t > item.score_from else -1)
            token.append(item.token_ids[t])
            position += 1
    return DrafterPositions(torch.tensor(previous, dtype=torch.long),
                            torch.tensor(token, dtype=torch.long))


@dataclass(frozen=True)
class DrafterInput:
    """What the drafter reads at a batch of positions.

    Attributes:
        previous: ``[n, H]`` the previous position's state (last layer, or an exit layer).
        embedding: ``[n, H]`` the current token's input embedding.
    """

    previous: torch.Tensor
    embedding: torch.Tensor


def drafter_inputs(features: FeatureSet, positions: DrafterPositions, embedding: torch.Tensor,
                   index: torch.Tensor, layer_of: torch.Tensor | None = None) -> DrafterInput:
    """The :class:`DrafterInput` of the positions ``index``.

    Args:
        features: the corpus' features.
        positions: :func:`drafter_positions` of its items.
        embedding: ``[V, H]`` the model's input embedding matrix.
        index: ``[n]`` positions, each with a previous scored position.
        layer_of: ``[n]`` int64 layer to take each previous state from (``-1`` or ``None`` =
            the last layer, ``features.final``); every other layer must be in
            ``features.hidden``.
    """
    prev = positions.previous[index]
    state = features.final[prev]
    if layer_of is not None:
        state = state.clone()
        for layer in layer_of.unique().tolist():
            if layer >= 0:
                rows = layer_of == layer
                state[rows] = features.hidden[layer][prev[rows]]
    return DrafterInput(state, embedding[positions.token[index]])


@dataclass(frozen=True)
class DrafterEval:
    """Held-out figures: share of positions whose final-layer token is the drafter's first
    candidate (``top1``) / among its top ``k`` (``topk``), over ``rows`` when given."""

    top1: float
    topk: float
    tokens: int


@torch.inference_mode()
def evaluate_drafter(drafter: FeatureDrafter, out: OutputLayer, features: FeatureSet,
                     positions: DrafterPositions, embedding: torch.Tensor, index: torch.Tensor,
                     rows: torch.Tensor | None, k: int = TOP_K, batch: int = 1024,
                     layer: int | None = None) -> DrafterEval:
    """:class:`DrafterEval` on ``index``, previous states from the last layer (``layer``
    ``None``) or leaving layer ``layer - 1`` (an exit at ``layer``; in ``features.hidden``)."""
    hit1 = hitk = 0
    for part in index.split(batch):
        layer_of = None if layer is None else torch.full_like(part, layer)
        x = drafter_inputs(features, positions, embedding, part, layer_of)
        logits = out.project(out.norm(drafter(x.previous, x.embedding)).to(out.weight.dtype), rows)
        top = logits.topk(k, dim=-1).indices
        if rows is not None:
            top = rows[top]
        target = features.teacher_token[part].unsqueeze(1)
        hit1 += int((top[:, :1] == target).sum())
        hitk += int((top == target).any(1).sum())
    n = int(index.numel())
    return DrafterEval(hit1 / n if n else math.nan, hitk / n if n else math.nan, n)


def fit_drafter(out: OutputLayer, features: FeatureSet, positions: DrafterPositions,
                embedding: torch.Tensor, train_idx: torch.Tensor, rows: torch.Tensor | None,
                exit_layers: Sequence[int], config: DrafterTrainConfig = DrafterTrainConfig()
                ) -> FeatureDrafter:
    """Train a drafter (module doc).

    Args:
        out: the model's output layer.
        features: cached features holding every layer of ``exit_layers``.
        positions: :func:`drafter_positions` of the features' items.
        embedding: ``[V, H]`` the model's input embedding matrix.
        train_idx: ``[n]`` positions to train on (with a previous scored position).
        rows: ``[R]`` draft-vocabulary rows of the loss, or ``None`` (full vocabulary).
        exit_layers: intermediate layers mixed in for ``config.exit_mix`` of the inputs.

    Returns:
        The trained :class:`FeatureDrafter` (float32, eval mode).

    Raises:
        InvalidArgumentError: no training positions, or an exit layer missing from
            ``features``.
    """
    if train_idx.numel() == 0:
        raise InvalidArgumentError("no positions to train the drafter on; give more data")
    missing = [x for x in exit_layers if x not in features.hidden]
    if missing:
        raise InvalidArgumentError(f"features lack the exit layers {missing}")
    compute = COMPUTE_DTYPES[config.compute_dtype]
    train_out = training_output_layer(out, compute)
    vocab = make_loss_vocab(train_out, rows)
    generator = torch.Generator().manual_seed(config.seed)
    drafter = FeatureDrafter(out.hidden_size)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    steps = config.epochs * math.ceil(train_idx.numel() / config.batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    choices = torch.tensor(list(exit_layers), dtype=torch.long)
    drafter.train()
    with torch.enable_grad():
        for _ in range(config.epochs):
            order = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
            for part in order.split(config.batch):
                layer_of = None
                if config.exit_mix > 0 and choices.numel():
                    mixed = torch.rand(part.numel(), generator=generator) < config.exit_mix
                    pick = choices[torch.randint(choices.numel(), (part.numel(),),
                                                 generator=generator)]
                    layer_of = torch.where(mixed, pick, torch.full_like(pick, -1))
                x = drafter_inputs(features, positions, embedding, part, layer_of)
                teacher = teacher_for(vocab.out, features.final[part], compute)
                with compute_autocast(compute, x.previous.device):
                    predicted = drafter(x.previous.float(), x.embedding.float())
                    logits = vocab.out.project(vocab.out.norm(predicted))
                loss = forward_kl(logits, teacher)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    return drafter.eval().requires_grad_(False)

