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

Heads are independent, so all heads train in one loop: each batch computes the teacher
distribution once and sums the heads' losses (the sum's gradient w.r.t. one head's
parameters is that head's own gradient). Batches are random scored tokens across the
corpus, reshuffled every epoch. Optimiser: Adam with linear warm-up over the first 3% of
steps and cosine decay (AdaDecode Appendix D's schedule). Matmuls run in bfloat16 autocast
by default (``compute_dtype``; about 3-4× faster than float32 on a CPU with AVX-512 BF16),
softmaxes and losses in float32, parameters in float32.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from tqdm.auto import tqdm

from selfspec.errors import InvalidArgumentError
from selfspec.heads.modules import ExitHead, OutputLayer, make_head
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN
from selfspec.training.features import FeatureSet
from selfspec.training.losses import Teacher, cross_entropy, kl_divergence

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

    Raises:
        InvalidArgumentError: any field out of range.
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
def _autocast(dtype: torch.dtype, device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def training_output_layer(out: OutputLayer, compute_dtype: torch.dtype) -> OutputLayer:
    """The model's output layer with ``E*`` in the dtype the training matmuls use (a cast
    copy only when the model's dtype differs), and no packed kernel (it has no autograd)."""
    weight_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
    weight = out.weight if out.weight.dtype == weight_dtype else out.weight.to(weight_dtype)
    bias = None if out.bias is None else out.bias.to(weight_dtype)
    return OutputLayer(out.norm, weight.detach(), bias, None)


@torch.no_grad()
def teacher_for(out: OutputLayer, final: torch.Tensor, compute_dtype: torch.dtype) -> Teacher:
    """The final layer's distribution from pre-norm final states ``[N, H]``:
    ``softmax(lm_head(norm(final)))``, the model's own output computation."""
    with _autocast(compute_dtype, final.device):
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
            with _autocast(compute_dtype, hidden.device):
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


def train_heads(out: OutputLayer, features: FeatureSet, layers: Sequence[int],
                config: TrainConfig = TrainConfig(), progress: bool = True,
                eval_splits: Sequence[int] = (CALIBRATION, TEST)) -> TrainResult:
    """Train one head per layer on ``features`` (train split), backbone frozen.

    Args:
        out: the model's output layer (:func:`selfspec.heads.modules.output_layer`).
        features: cached hidden states; must hold every layer of ``layers``.
        layers: exit layers (validated by the caller against the model depth).
        config: :class:`TrainConfig`.
        progress: tqdm bar over optimiser steps.
        eval_splits: splits on which before/after metrics are measured (held-out problems).

    Returns:
        :class:`TrainResult`. A KeyboardInterrupt propagates (nothing is written here).

    Raises:
        InvalidArgumentError: a layer missing from ``features``, or no training tokens.
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
    before = evaluate_heads(heads, features, eval_idx, train_out, compute) if eval_idx.numel() else []

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
                teacher = teacher_for(train_out, features.final[idx], compute)
                labels = features.labels[idx]
                for group in optimizer.param_groups:
                    group["lr"] = config.lr * _lr_factor(step, total, config.warmup)
                optimizer.zero_grad(set_to_none=True)
                loss = torch.zeros(())
                for head in heads:
                    hidden = features.hidden[head.layer][idx]
                    with _autocast(compute, hidden.device):
                        logits = head(hidden)
                    loss = loss + head_loss(logits, teacher, labels, config)
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
    after = evaluate_heads(heads, features, eval_idx, train_out, compute) if eval_idx.numel() else []
    for head in heads:
        head.bind(out)  # hand back heads on the model's own lm_head, not the training copy
    return TrainResult(heads, before, after, int(train_idx.numel()), int(eval_idx.numel()),
                       step, history, seconds)
