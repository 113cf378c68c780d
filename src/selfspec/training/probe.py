"""Fitting AdaSPEED's linear acceptance probe (AdaSPEED §II.B).

The probe (:class:`selfspec.heads.probe.LinearProbe`) estimates ``P(accept) = σ(v·h + b)``
from the exit layer's hidden state ``h``. It is trained with the binary cross-entropy of §II.B,

    L_probe = 1/N Σ_n -log( σ(v·h_n + b)      if y_n = x_n
                            1 - σ(v·h_n + b)  otherwise ),

where ``x_n`` is the draft token at layer ℓ and ``y_n`` the final layer's token.

For sampled decoding (AdaSPEED Table I's top-p rows) the event "the token is accepted" is
random; its probability given the exit state is ``Σ_x min(p(x), q(x))`` for draft ``q`` and
target ``p`` under the same temperature / top-p. A sampled-decoding probe is fitted with that
value as a soft label, so ``σ(v·h + b)`` estimates the acceptance probability the product rule
multiplies.

Raw hidden states have a few channels with very large, token-independent magnitudes, which
makes plain gradient descent on ``(v, b)`` badly conditioned. Training therefore fits the probe
on standardised features ``(h - μ)/σ`` and folds the standardisation back into ``(v, b)``
afterwards (``v = w/σ``, ``b = b' - Σ w μ/σ``): the stored probe is still exactly the linear
probe of §II.B on the raw hidden state.

The stage ``selfspec heads train-probe``: :class:`ProbeRequest` → :func:`train_probe` →
:class:`~selfspec.training.pipeline.TrainOutcome`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import ProbeCard
from selfspec.heads.files import (
    DEFAULT_PROBES,
    ExitHeads,
    find_head_file,
    load_heads,
    model_name,
    new_card,
    resolve_path,
    save_heads,
)
from selfspec.heads.modules import ExitHead
from selfspec.heads.probe import LinearProbe
from selfspec.training.calibration import roc_auc
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN
from selfspec.training.engine import Engine
from selfspec.training.pipeline import DataRequest, StageTimes, TrainOutcome, prepare_features
from selfspec.training.placement import check_layers


@dataclass(frozen=True)
class ProbeTrainConfig:
    """Optimisation settings of :func:`fit_probe`.

    Attributes:
        steps: full-batch L-BFGS iterations (the problem is convex and small).
        weight_decay: L2 penalty on the standardised weights (keeps separable data finite).
    """

    steps: int = 200
    weight_decay: float = 1e-4


def fit_probe(layer: int, hidden: torch.Tensor, accepted: torch.Tensor,
              config: ProbeTrainConfig = ProbeTrainConfig()) -> LinearProbe:
    """Fit a :class:`LinearProbe` by minimising ``L_probe`` (AdaSPEED §II.B).

    Args:
        layer: exit layer (recorded in the probe).
        hidden: ``[N, H]`` exit-layer hidden states (any float dtype).
        accepted: ``[N]`` booleans, draft token == final-layer token (greedy decoding), or
            soft labels in [0, 1]: the expected acceptance of speculative sampling (a probe
            for sampled decoding; the same cross-entropy with soft targets).
        config: optimisation settings.

    Returns:
        The probe, in float32, in eval mode.

    Raises:
        InvalidArgumentError: shapes disagree or ``N == 0``.
    """
    if hidden.dim() != 2 or accepted.shape != hidden.shape[:1] or hidden.shape[0] == 0:
        raise InvalidArgumentError(
            f"fit_probe needs hidden [N, H] and accepted [N] with N > 0, got "
            f"{tuple(hidden.shape)} and {tuple(accepted.shape)}")
    x = hidden.float()
    y = accepted.float()
    mean = x.mean(0)
    std = x.std(0, unbiased=False).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    rate = y.mean().clamp(1e-4, 1 - 1e-4)
    b = torch.log(rate / (1 - rate)).reshape(1).clone().requires_grad_(True)  # start at base rate
    optimizer = torch.optim.LBFGS([w, b], lr=1.0, max_iter=config.steps,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(z @ w + b, y)
        loss = loss + config.weight_decay * w.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    probe = LinearProbe(layer, x.shape[1])
    with torch.no_grad():
        probe.weight.copy_(w / std)
        probe.bias.copy_(b - (w * mean / std).sum())
    return probe.eval().requires_grad_(False)


PROBE_USES = {TRAIN: "probe-train", CALIBRATION: "probe-eval", TEST: "probe-eval"}


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
