"""AdaSPEED's linear acceptance probe (AdaSPEED §II.B), as used while decoding.

A probe ``(v, b)`` reads the hidden state ``h`` leaving the exit layer (before any norm) and
estimates the probability that the draft token predicted there equals the full model's token:
``P(accept) = σ(v·h + b)``. Its output goes into ``DraftTokenInfo.score`` (the
``threshold``/``product`` stop rules use it instead of the draft probability).

A probe for greedy decoding estimates the probability of the event "draft argmax == final
argmax"; a probe for sampled decoding (AdaSPEED Table I's top-p rows) estimates the expected
acceptance of speculative sampling under the same temperature / top-p. Probes are fitted by
:func:`selfspec.training.probe.fit_probe` and stored in head files
(:mod:`selfspec.heads.files`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class LinearProbe(nn.Module):
    """``probe(hidden [B, T, H]) -> acceptance probability [B, T]`` (AdaSPEED §II.B).

    Args:
        layer: the exit layer whose hidden state it reads.
        hidden_size: ``H``.

    Attributes:
        weight: ``v`` ``[H]`` (float32).
        bias: ``b`` ``[1]`` (float32).
    """

    def __init__(self, layer: int, hidden_size: int) -> None:
        super().__init__()
        self.layer = int(layer)
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(1))

    def logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """``v·h + b``: ``[..., H]`` → ``[...]`` in float32."""
        return hidden.float() @ self.weight + self.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Acceptance probability ``σ(v·h + b)``: ``[B, T, H]`` → ``[B, T]`` in [0, 1]."""
        return torch.sigmoid(self.logit(hidden))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias}
