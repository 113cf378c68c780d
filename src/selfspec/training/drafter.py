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
layers 3 and 6, where most exits happen. The *exit-state drafter* (``exit_mix = 1`` over layers
spread across
the predictors' range) reaches 50% and 54% there, close to a drafter trained on one layer alone
(53%, 55%), so a head file may hold two: the main drafter for a draft's first token, whose
previous position ran every layer, and the exit-state drafter for the tokens after an exit
(:class:`~selfspec.decoding.specee.step.DrafterCandidates`). Measured end
to end on 20 held-out GSM-Symbolic problems it lengthened the accepted runs (2.30 → 2.43 tokens
a verification) but the exits came later and the speed did not move (1.30× → 1.28× ``ar``,
within the noise), while the thresholds were tuned by a replay that drafted every position from
a last-layer state. Tuned by the replay that drafts inside a draft as decoding does
(:mod:`selfspec.training.specee_tuning`; train the predictors after it), it pays: 1.30× against
1.26× ``ar`` on 40 held-out HumanEval problems, 1.31× against 1.30× on GSM. It stays opt-in
(``selfspec heads train-drafter --exit-state-layers``).

Trained on the heads' training split only; the card's figures are on their test split.

The stage ``selfspec heads train-drafter``: :class:`DrafterRequest` → :func:`train_drafter` →
:class:`DrafterOutcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import DrafterCard
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.files import ExitHeads, find_head_file, load_heads, model_name, save_heads
from selfspec.heads.modules import OutputLayer, output_layer
from selfspec.training.corpus import TEST, TRAIN, CorpusItem, items_by_use
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet
from selfspec.training.losses import forward_kl
from selfspec.training.pipeline import (
    DEFAULT_CANDIDATE_VOCAB,
    DataRequest,
    StageTimes,
    card_request,
    default_first_layer,
    draft_rows,
    in_feature_order,
    prepare_features,
)
from selfspec.training.train import (
    COMPUTE_DTYPES,
    compute_autocast,
    make_loss_vocab,
    teacher_for,
    training_output_layer,
)

logger = logging.getLogger(__name__)

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
            it raised held-out candidate recall after an exit but not the measured speed);
            ``None``: :func:`default_exit_state_layers`.
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
    Qwen2.5-Coder-0.5B a drafter trained on five such layers read layers 3 and 6 within 1-3 points
    of top-4 of a drafter trained on that layer alone (:mod:`selfspec.training.drafter`)."""
    step = max(1, num_layers // 8)
    return tuple(range(default_first_layer(num_layers), num_layers, step))


@dataclass
class DrafterOutcome:
    """What :func:`train_drafter` did."""

    path: Path
    heads: ExitHeads
    times: StageTimes


def _drafter_file(engine: Engine, request: DrafterRequest) -> tuple[Path, ExitHeads]:
    """The head file the drafter is saved into, loaded; warns when a new main drafter leaves
    predictors trained on the old one's candidates.

    Raises:
        InvalidArgumentError: a bad ``draft_vocab``, ``exit_state_only`` without exit-state
            layers or without a drafter in the file to keep.
    """
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
    return target, container


def _exit_state_layers(request: DrafterRequest, num_layers: int) -> tuple[int, ...]:
    """The exit-state drafter's layers: ``request``'s, sorted, or the default ones.

    Raises:
        InvalidArgumentError: a layer outside ``[1, L-1]``.
    """
    state_layers = (default_exit_state_layers(num_layers) if request.exit_state_layers is None
                    else tuple(sorted(set(request.exit_state_layers))))
    bad = [x for x in state_layers if not 1 <= x <= num_layers - 1]
    if bad:
        raise InvalidArgumentError(
            f"exit-state layers {bad} are outside 1..{num_layers - 1} of this "
            f"{num_layers}-layer model")
    return state_layers


@dataclass(frozen=True)
class _DrafterData:
    """What fitting and evaluating a drafter reads: the features and the drafter's previous
    positions, the output layer, the embedding, the positions to train and evaluate on and
    the draft-vocabulary rows (``None``: every token)."""

    features: FeatureSet
    positions: DrafterPositions
    out: OutputLayer
    embedding: torch.Tensor
    train_idx: torch.Tensor
    eval_idx: torch.Tensor
    rows: torch.Tensor | None

    def fit(self, layers: Sequence[int], config: DrafterTrainConfig) -> FeatureDrafter:
        """:func:`fit_drafter` on the training positions, with exit inputs from ``layers``."""
        return fit_drafter(self.out, self.features, self.positions, self.embedding,
                           self.train_idx, self.rows, layers, config)

    def evaluate(self, drafter: FeatureDrafter, layer: int | None = None) -> DrafterEval:
        """:func:`evaluate_drafter` on the held-out positions (from ``layer``'s states)."""
        return evaluate_drafter(drafter, self.out, self.features, self.positions,
                                self.embedding, self.eval_idx, self.rows, layer=layer)


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
    target, container = _drafter_file(engine, request)
    data = request.data
    if data is None:
        if container.card.training is None:
            raise InvalidArgumentError(
                f"{target} records no training corpus to reuse; pass --data")
        data = card_request(container.card.training)
    size = min(request.draft_vocab, ex.vocab_size)
    rows = draft_rows(engine, container, target, size)
    # The main drafter's exit mix reads the heads' upper-half layers (in the feature cache
    # already); the exit-state drafter reads layers across the predictors' range.
    exit_layers = [x for x in container.layers if x >= ex.num_layers // 2]
    state_layers = _exit_state_layers(request, ex.num_layers)
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
    on = _DrafterData(features, positions, output_layer(engine), ex.embed_tokens.weight,
                      train_idx, eval_idx, rows)
    cfg = request.config
    seconds = 0.0
    if request.exit_state_only:
        drafter, card = container.drafter, container.card.drafter
    else:
        t0 = time.perf_counter()
        drafter = on.fit(exit_layers, cfg).to(device=ex.device, dtype=ex.dtype)
        seconds = time.perf_counter() - t0
        evaluation = on.evaluate(drafter)
        card = DrafterCard(
            draft_vocab=size, exit_mix=cfg.exit_mix, exit_layers=exit_layers, epochs=cfg.epochs,
            lr=cfg.lr, seconds=seconds, train_tokens=int(train_idx.numel()),
            eval_tokens=evaluation.tokens, top1=evaluation.top1, topk=evaluation.topk)
    exit_drafter, state_topk, state_topk_main, state_seconds = None, math.nan, math.nan, math.nan
    if state_layers:
        t0 = time.perf_counter()
        exit_drafter = on.fit(state_layers, replace(cfg, exit_mix=1.0))
        state_seconds = time.perf_counter() - t0
        seconds += state_seconds
        exit_drafter = exit_drafter.to(device=ex.device, dtype=ex.dtype)

        def at_states(model: FeatureDrafter) -> float:
            return sum(on.evaluate(model, x).topk for x in state_layers) / len(state_layers)
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
