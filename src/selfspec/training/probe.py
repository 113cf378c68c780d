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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.errors import InvalidArgumentError
from selfspec.heads.probe import LinearProbe


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
