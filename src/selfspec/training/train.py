"""Training exit heads on a frozen backbone (DSSD §3.3, AdaDecode §2.1 and Appendix D).

Only the heads' parameters get gradients: the backbone's hidden states come from the
feature cache (:mod:`selfspec.training.features`), computed once without gradient. Losses, per
scored token, averaged over the batch (DSSD §3.3):

- ``kl`` (default, DSSD's self-supervised ``L_self``): KL divergence between the final
  layer's distribution ``p`` (recomputed exactly from the cached final hidden state) and the
  head's ``q``. ``kl_direction="forward"`` is ``KL(p || q) = Σ p (log p - log q)``, as
  AdaDecode §2.1 writes it (mass-covering; its gradient ``q - p`` is the distillation
  gradient); ``"reverse"`` is ``KL(q || p)``, as DSSD §3.3's formula ``Σ ŷ log(ŷ / f_θ)``
  literally reads (mode-seeking).
- ``ce`` (DSSD ``L_sup``): cross-entropy with the next token of the text.
- ``hybrid`` (DSSD ``L_hyb``): ``α·CE + (1 - α)·KL``.

``loss_vocab = K > 0`` restricts the KL to the rows ``R`` = the ``K`` tokens the final layer
emits most often on the training split (plus the EOS ids), ranked exactly as the reduced draft
vocabulary ranks them (:func:`selfspec.decoding.drafting.draft_vocab.frequent_rows` on the head
file's ``token_counts``), so a head used with ``draft_vocab=K`` was trained on exactly its rows.
Per token, ``p_R = softmax(z_final[R])`` and ``q_R = softmax(z_head[R])``, each renormalised over
``R``, and the loss is ``KL(p_R || q_R)`` (or ``KL(q_R || p_R)``). This is our departure from
AdaDecode §2.1, whose KL is over the full vocabulary: every step costs ``N·V·H`` multiply-adds
for the teacher and two per head (forward and the input gradient through the frozen
``lm_head``), which for ``V = 151,936`` (Qwen2.5) dominates training on a 2-core CPU; over
``R`` it costs ``K/V`` of that (about 1/9 for ``K = 16384``). Tokens outside ``R`` get no
gradient; held-out agreement and KL on the card stay full-vocabulary.

Heads are independent, so all heads train in one loop: each batch computes the teacher
distribution once and sums the heads' losses (the sum's gradient w.r.t. one head's
parameters is that head's own gradient). Batches are random scored tokens across the
corpus, reshuffled every epoch. Optimiser: Adam with linear warm-up over the first 3% of
steps and cosine decay (AdaDecode Appendix D's schedule). Matmuls run in bfloat16 autocast
by default (``compute_dtype``; faster than float32 on a CPU with native bf16),
softmaxes and losses in float32, parameters in float32.

The stage ``selfspec heads train``: :class:`TrainRequest` → :func:`train` (corpus, features,
:func:`train_heads`, save, calibrate) → :class:`~selfspec.training.pipeline.TrainOutcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from tqdm.auto import tqdm

from selfspec.errors import InvalidArgumentError
from selfspec.executor.cpu import detect_cpu
from selfspec.heads.calibration import CONFIDENCE_METRICS
from selfspec.heads.card import HeadEval, TrainingInfo
from selfspec.heads.files import (
    ExitHeads,
    load_heads,
    model_name,
    new_card,
    resolve_path,
    save_heads,
)
from selfspec.heads.modules import ExitHead, LightweightHead, OutputLayer, make_head, output_layer
from selfspec.training.calibration import DEFAULT_EPSILONS, calibrate
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN, parse_data_spec
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet
from selfspec.training.losses import Teacher, cross_entropy, kl_divergence
from selfspec.training.pipeline import (
    HEAD_USES,
    DataRequest,
    StageTimes,
    TrainOutcome,
    dtype_label,
    model_eos_ids,
    prepare_features,
)
from selfspec.training.placement import check_layers, default_layers

logger = logging.getLogger(__name__)

LOSSES = ("kl", "ce", "hybrid")
KL_DIRECTIONS = ("forward", "reverse")
COMPUTE_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp32": torch.float32})
CONFIDENT = 0.8  # max-probability above which a token counts as "confident" in reports


@dataclass(frozen=True)
class TrainConfig:
    """Head training settings.

    Attributes:
        kind: ``"lightweight"`` or ``"full"``.
        init: full heads: ``"lm_head"`` or ``"random"`` (DSSD §4.1).
        loss: one of :data:`LOSSES`.
        kl_direction: ``"forward"`` ``KL(p_final || q_head)`` or ``"reverse"``.
        alpha: CE weight of the hybrid loss, in (0, 1).
        epochs: passes over the training tokens (>= 1).
        lr: peak Adam learning rate.
        batch_tokens: tokens per optimiser step.
        warmup: fraction of steps with linear warm-up.
        compute_dtype: ``"bf16"`` (autocast) or ``"fp32"``.
        seed: shuffling and random-init seed.
        loss_vocab: ``0`` = KL over the full vocabulary (AdaDecode §2.1); ``K > 0`` = KL over
            the ``K`` most frequent tokens (plus EOS), renormalised (see the module doc; our
            departure from the paper, for speed). Needs ``loss="kl"``.

    Raises:
        InvalidArgumentError: any field out of range, or ``loss_vocab > 0`` with a loss other
            than ``"kl"``.
    """

    kind: str = "lightweight"
    init: str = "lm_head"
    loss: str = "kl"
    kl_direction: str = "forward"
    alpha: float = 0.5
    epochs: int = 3
    lr: float = 2e-3
    batch_tokens: int = 256
    warmup: float = 0.03
    compute_dtype: str = "bf16"
    seed: int = 0
    loss_vocab: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise InvalidArgumentError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.kl_direction not in KL_DIRECTIONS:
            raise InvalidArgumentError(
                f"kl_direction must be one of {KL_DIRECTIONS}, got {self.kl_direction!r}")
        if not 0.0 < self.alpha < 1.0:
            raise InvalidArgumentError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.epochs < 1 or self.batch_tokens < 1 or not self.lr > 0:
            raise InvalidArgumentError(
                f"need epochs >= 1, batch_tokens >= 1, lr > 0; got {self.epochs}, "
                f"{self.batch_tokens}, {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise InvalidArgumentError(f"warmup must be in [0, 1), got {self.warmup}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InvalidArgumentError(
                f"compute_dtype must be one of {tuple(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if isinstance(self.loss_vocab, bool) or not isinstance(self.loss_vocab, int) \
                or self.loss_vocab < 0:
            raise InvalidArgumentError(
                f"loss_vocab must be an integer >= 0 (0 = full vocabulary), "
                f"got {self.loss_vocab!r}")
        if self.loss_vocab and self.loss != "kl":
            # CE needs the label's logit, which may lie outside the kept rows: the full
            # vocabulary would be projected anyway, and nothing saved.
            raise InvalidArgumentError(
                f"loss_vocab restricts the KL loss only; use loss 'kl' (got {self.loss!r}) or "
                "loss_vocab 0")


def head_loss(head_logits: torch.Tensor, teacher: Teacher, labels: torch.Tensor,
              config: TrainConfig) -> torch.Tensor:
    """The training loss of ``config`` for one head: ``[N, V]`` logits → scalar (nats)."""
    if config.loss == "ce":
        return cross_entropy(head_logits, labels)
    kl = kl_divergence(head_logits, teacher, config.kl_direction)
    if config.loss == "kl":
        return kl
    return config.alpha * cross_entropy(head_logits, labels) + (1 - config.alpha) * kl


# ------------------------------------------------------------------------------ helpers
def compute_autocast(dtype: torch.dtype, device: torch.device) -> torch.autocast:
    """bfloat16 autocast on ``device`` when the training compute dtype ``dtype`` is bfloat16,
    else a disabled one (heads and the SpecEE drafter train their matmuls this way)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def training_output_layer(out: OutputLayer, compute_dtype: torch.dtype) -> OutputLayer:
    """The model's output layer with ``E*`` in the dtype the training matmuls use (a cast
    copy only when the model's dtype differs), and no packed kernel (it has no autograd)."""
    weight_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
    weight = out.weight if out.weight.dtype == weight_dtype else out.weight.to(weight_dtype)
    bias = None if out.bias is None else out.bias.to(weight_dtype)
    return OutputLayer(out.norm, weight.detach(), bias, None)


@dataclass(frozen=True)
class LossVocab:
    """The vocabulary the training loss is computed over (``TrainConfig.loss_vocab``).

    Attributes:
        rows: ``[R]`` int64 token ids, ascending, or ``None`` = the full vocabulary.
        out: the training output layer restricted to ``rows`` (``[R, H]`` gathered once, not
            every step), which computes the teacher's logits ``[N, R]``.
    """

    rows: torch.Tensor | None
    out: OutputLayer

    @property
    def size(self) -> int | None:
        """``R``, or ``None`` for the full vocabulary."""
        return None if self.rows is None else int(self.rows.numel())

    def head_logits(self, head: ExitHead, hidden: torch.Tensor) -> torch.Tensor:
        """``head``'s logits over these rows: ``[N, H]`` → ``[N, R]`` (``[N, V]`` if full)."""
        if self.rows is not None and isinstance(head, LightweightHead):
            # E*·T·norm(h) with E*'s rows R gathered once in self.out: gathering them per
            # head and step costs half a forward matmul (Qwen2.5: [16384, 1536] of [151936, 1536]).
            return self.out.project(head.transformed(hidden))
        return head(hidden, self.rows)  # a full head's own rows, gathered in the autograd graph


def loss_rows(features: FeatureSet, size: int, vocab_size: int, eos_ids: Sequence[int] = ()
              ) -> torch.Tensor:
    """The rows of a restricted KL: the ``size`` tokens the final layer emits most often on the
    training split of ``features`` (ties: lower id first), plus ``eos_ids``, as ``[R]`` int64
    ascending. The same counts are stored in the head file as ``token_counts`` by
    :func:`selfspec.training.pipeline.calibrate`, so these are exactly the rows of
    ``draft_vocab=size`` at inference
    (:func:`selfspec.decoding.drafting.draft_vocab.frequent_rows`).

    Raises:
        InvalidArgumentError: ``size`` outside ``[1, vocab_size]``.
    """
    from selfspec.decoding.drafting.draft_vocab import frequent_rows

    if not 1 <= size <= vocab_size:
        raise InvalidArgumentError(
            f"loss_vocab must be in [1, {vocab_size}] (the model's vocabulary size), or 0 for "
            f"the full vocabulary; got {size}")
    train = features.teacher_token[features.indices(TRAIN)].to(torch.int64)
    counts = torch.bincount(train, minlength=vocab_size)
    return frequent_rows(counts, size, eos_ids).rows


def make_loss_vocab(out: OutputLayer, rows: torch.Tensor | None) -> LossVocab:
    """A :class:`LossVocab` over ``rows`` ``[R]`` (``None`` = full) of training output layer
    ``out`` (:func:`training_output_layer`)."""
    if rows is None:
        return LossVocab(None, out)
    rows = rows.to(out.weight.device)
    bias = None if out.bias is None else out.bias[rows]
    return LossVocab(rows, OutputLayer(out.norm, out.weight[rows], bias, None))


def batch_loss(heads: Sequence[ExitHead], hidden: dict[int, torch.Tensor], final: torch.Tensor,
               labels: torch.Tensor, vocab: LossVocab, config: TrainConfig) -> torch.Tensor:
    """One step's loss, summed over heads (nats): the teacher is computed once over
    ``vocab`` from pre-norm final states ``final`` ``[N, H]``, each head reads
    ``hidden[head.layer]`` ``[N, H]``; ``labels`` ``[N]`` are the text's next tokens (CE)."""
    compute = COMPUTE_DTYPES[config.compute_dtype]
    teacher = teacher_for(vocab.out, final, compute)
    loss = torch.zeros(())
    for head in heads:
        h = hidden[head.layer]
        with compute_autocast(compute, h.device):
            logits = vocab.head_logits(head, h)
        loss = loss + head_loss(logits, teacher, labels, config)
    return loss


@torch.no_grad()
def teacher_for(out: OutputLayer, final: torch.Tensor, compute_dtype: torch.dtype) -> Teacher:
    """The final layer's distribution from pre-norm final states ``[N, H]``:
    ``softmax(lm_head(norm(final)))``, the model's own output computation (over the rows of
    ``out``: a restricted output layer gives the distribution renormalised over them)."""
    with compute_autocast(compute_dtype, final.device):
        logits = out.project(out.norm(final).to(out.weight.dtype))
    return Teacher.from_logits(logits)


def _lr_factor(step: int, total: int, warmup: float) -> float:
    """Linear warm-up then cosine decay to 0 (AdaDecode Appendix D)."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- evaluate
@dataclass(frozen=True)
class HeadMetrics:
    """One head on a set of tokens.

    Attributes:
        layer: exit layer.
        tokens: tokens scored.
        agreement: fraction whose argmax equals the final layer's token (DSSD eq. 2).
        kl: mean ``KL(p_final || q_head)``, nats.
        confident_fraction: fraction with max-probability > :data:`CONFIDENT`.
        confident_agreement: agreement among those (NaN if none).
    """

    layer: int
    tokens: int
    agreement: float
    kl: float
    confident_fraction: float
    confident_agreement: float


@torch.no_grad()
def evaluate_heads(heads: Sequence[ExitHead], features: FeatureSet, indices: torch.Tensor,
                   out: OutputLayer, compute_dtype: torch.dtype = torch.bfloat16,
                   batch_tokens: int = 512) -> list[HeadMetrics]:
    """Agreement, KL and confident-token statistics of ``heads`` on ``features[indices]``.

    Raises:
        InvalidArgumentError: ``indices`` is empty.
    """
    if indices.numel() == 0:
        raise InvalidArgumentError("no held-out tokens to evaluate on")
    n = indices.numel()
    sums = {h.layer: torch.zeros(4, dtype=torch.float64) for h in heads}
    for start in range(0, n, batch_tokens):
        idx = indices[start:start + batch_tokens]
        teacher = teacher_for(out, features.final[idx], compute_dtype)
        target = features.teacher_token[idx]
        for head in heads:
            hidden = features.hidden[head.layer][idx]
            with compute_autocast(compute_dtype, hidden.device):
                logits = head(hidden)
            logq = torch.log_softmax(logits.float(), dim=-1)
            agree = logq.argmax(-1) == target
            kl = teacher.neg_entropy - torch.linalg.vecdot(teacher.p, logq)
            confident = logq.max(-1).values.exp() > CONFIDENT
            sums[head.layer] += torch.tensor([agree.sum().item(), kl.sum().item(),
                                              confident.sum().item(),
                                              (agree & confident).sum().item()],
                                             dtype=torch.float64)
    results = []
    for head in heads:
        agree, kl, conf, conf_agree = sums[head.layer].tolist()
        results.append(HeadMetrics(head.layer, n, agree / n, kl / n, conf / n,
                                   conf_agree / conf if conf else math.nan))
    return results


# -------------------------------------------------------------------------------- train
@dataclass
class TrainResult:
    """Trained heads and what training did.

    Attributes:
        heads: trained heads (float32 parameters, bound to the model's output layer).
        before / after: held-out :class:`HeadMetrics` per head (fresh heads vs trained).
        train_tokens / eval_tokens: token counts.
        steps: optimiser steps.
        loss_history: mean training loss (summed over heads) per epoch.
        loss_rows: ``[R]`` token ids the KL was computed over, or ``None`` (full vocabulary).
        seconds: wall time of the optimisation loop (evaluation excluded).
    """

    heads: list[ExitHead]
    before: list[HeadMetrics]
    after: list[HeadMetrics]
    train_tokens: int
    eval_tokens: int
    steps: int
    loss_history: list[float]
    seconds: float
    loss_rows: torch.Tensor | None = None


def train_heads(out: OutputLayer, features: FeatureSet, layers: Sequence[int],
                config: TrainConfig = TrainConfig(), progress: bool = True,
                eval_splits: Sequence[int] = (CALIBRATION, TEST),
                eos_ids: Sequence[int] = ()) -> TrainResult:
    """Train one head per layer on ``features`` (train split), backbone frozen.

    Args:
        out: the model's output layer (:func:`selfspec.heads.modules.output_layer`).
        features: cached hidden states; must hold every layer of ``layers``.
        layers: exit layers (validated by the caller against the model depth).
        config: :class:`TrainConfig`.
        progress: tqdm bar over optimiser steps.
        eval_splits: splits on which before/after metrics are measured (held-out problems).
        eos_ids: EOS ids kept in a restricted loss vocabulary (``config.loss_vocab > 0``), as
            a reduced draft vocabulary keeps them (the model config's).

    Returns:
        :class:`TrainResult`. A KeyboardInterrupt propagates (nothing is written here).

    Raises:
        InvalidArgumentError: a layer missing from ``features``, no training tokens, or
            ``config.loss_vocab`` above the vocabulary size.
    """
    missing = [layer for layer in layers if layer not in features.hidden]
    if missing:
        raise InvalidArgumentError(f"features lack layers {missing}")
    compute = COMPUTE_DTYPES[config.compute_dtype]
    train_out = training_output_layer(out, compute)
    heads = [make_head(config.kind, layer, train_out, init=config.init, dtype=torch.float32,
                       seed=config.seed + layer) for layer in layers]
    train_idx = features.indices(TRAIN)
    eval_idx = features.indices(*eval_splits)
    if train_idx.numel() == 0:
        raise InvalidArgumentError("no training tokens (every problem fell in a held-out split?)")
    rows = (loss_rows(features, config.loss_vocab, train_out.vocab_size, eos_ids)
            if config.loss_vocab else None)
    vocab = make_loss_vocab(train_out, rows)
    if rows is not None:
        logger.info("KL over %d rows (the %d most frequent tokens + EOS) of %d", rows.numel(),
                    config.loss_vocab, train_out.vocab_size)
    before = (evaluate_heads(heads, features, eval_idx, train_out, compute)
              if eval_idx.numel() else [])

    params = [p for h in heads for p in h.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    steps_per_epoch = math.ceil(train_idx.numel() / config.batch_tokens)
    total = steps_per_epoch * config.epochs
    history: list[float] = []
    step = 0
    start_time = time.perf_counter()
    for head in heads:
        head.train()
    with tqdm(total=total, desc="train heads", unit="step", disable=not progress) as bar:
        for epoch in range(config.epochs):
            order = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
            epoch_loss = 0.0
            for b in range(steps_per_epoch):
                idx = order[b * config.batch_tokens:(b + 1) * config.batch_tokens]
                for group in optimizer.param_groups:
                    group["lr"] = config.lr * _lr_factor(step, total, config.warmup)
                optimizer.zero_grad(set_to_none=True)
                hidden = {head.layer: features.hidden[head.layer][idx] for head in heads}
                loss = batch_loss(heads, hidden, features.final[idx], features.labels[idx],
                                  vocab, config)
                loss.backward()
                optimizer.step()
                step += 1
                epoch_loss += loss.item()
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item() / len(heads):.3f}")
            history.append(epoch_loss / steps_per_epoch)
            logger.info("epoch %d: mean loss %.4f (summed over %d heads)", epoch + 1,
                        history[-1], len(heads))
    seconds = time.perf_counter() - start_time
    for head in heads:
        head.eval()
    after = (evaluate_heads(heads, features, eval_idx, train_out, compute)
             if eval_idx.numel() else [])
    for head in heads:
        head.bind(out)  # hand back heads on the model's own lm_head, not the training copy
    return TrainResult(heads, before, after, int(train_idx.numel()), int(eval_idx.numel()),
                       step, history, seconds, rows)


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


def train(engine: Engine, request: TrainRequest, progress: bool = True) -> TrainOutcome:
    """Train heads for ``engine``'s model, save them, calibrate them (see module doc).

    Raises:
        InvalidArgumentError: bad layers or options.
        KeyboardInterrupt: passed on; no head file is written before training completes.
    """
    num_layers = engine.executor.num_layers
    layers = (check_layers(request.layers, num_layers) if request.layers
              else default_layers(num_layers))
    times = StageTimes()
    data = prepare_features(engine, request.data, layers, times, progress)
    features = data.features
    out = output_layer(engine)
    result = train_heads(out, features, layers, request.train, progress=progress,
                         eos_ids=model_eos_ids(engine))
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
                  for b, a in zip(result.before, result.after, strict=False)]
    target = resolve_path(request.out or "default", model_name(engine))
    save_heads(ExitHeads(layers, result.heads, card), target)
    heads = load_heads(target, engine)  # the heads exactly as inference will see them
    if request.calibrate:
        t0 = time.perf_counter()
        calibrate(heads, features, request.metrics, request.epsilons, request.draft_vocabs,
                  model_eos_ids(engine))
        times.calibrate_s = time.perf_counter() - t0
        save_heads(heads, target)
    return TrainOutcome(target, heads, times, result.train_tokens, result.eval_tokens)
