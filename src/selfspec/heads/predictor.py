"""SpecEE's exit predictors and their features (SpecEE §4, "speculation-based lightweight
predictor"; Xu et al. 2025), as used while decoding.

A few *speculative tokens* (``k`` candidates for the next token, from a cheap drafter) shrink
the question "may the forward pass stop at layer ℓ?" from the whole vocabulary to ``k`` rows
of ``lm_head``. At layer ℓ, with ``n = final_norm(h_ℓ)`` and ``W_c`` the candidates' rows:

- ``logits_ℓ = W_c · n`` (``[k]``, one small product instead of ``V`` rows);
- ``probs_ℓ = softmax(logits_ℓ)`` over the ``k`` candidates only ("local probabilities");
- ``change_ℓ = probs_ℓ - probs_{ℓ-1}`` (``probs_ℓ`` itself at the first feature layer).

The ``3k`` features (12 for ``k = 4``) feed a per-layer two-layer MLP ``3k → 512 → 1`` with a
sigmoid (the paper's predictor, as in the public SpecEE code). Its label is "the final layer's
token equals the candidate with the highest local probability at ℓ"; at decoding time the
token exits at ℓ when the predictor's output passes a threshold (0.5), emitting that
candidate. The change is always taken against the previous *layer* (features are computed at
every layer from the candidates' layer on; they cost one ``[k, H]`` product), so decoding sees
exactly the features training saw, whichever layers the scheduler lets the MLP run at.

Predictors are fitted by :mod:`selfspec.training.predictors` and stored in head files beside
the head that drafts the candidates (:mod:`selfspec.heads.files`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import InvalidArgumentError

FEATURES_PER_CANDIDATE = 3  # logit, local probability, change of the local probability
PREDICTOR_HIDDEN = 512      # SpecEE's MLP width


@dataclass(frozen=True)
class CandidateScores:
    """The candidates seen from one layer (SpecEE §4).

    Attributes:
        logits: ``[..., k]`` float32 candidate logits ``W_c · final_norm(h)``.
        probs: ``[..., k]`` local probabilities (softmax over the ``k`` candidates).
        features: ``[..., 3k]`` float32 ``[logits, probs, probs - previous probs]``.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    features: torch.Tensor


def candidate_features(normed: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None,
                       previous: torch.Tensor | None) -> CandidateScores:
    """SpecEE's predictor features at one layer (module doc).

    Args:
        normed: ``[..., H]`` the layer's hidden state after the model's final norm.
        rows: ``[..., k, H]`` (per token) or ``[k, H]`` (shared) ``lm_head`` rows of the
            candidates.
        bias: ``[..., k]`` / ``[k]`` their ``lm_head`` bias, or ``None``.
        previous: ``[..., k]`` local probabilities at the previous layer, or ``None`` at the
            first feature layer (the change is then the probabilities themselves).

    Returns:
        :class:`CandidateScores`.
    """
    if rows.dim() == 2:
        logits = F.linear(normed, rows)
    else:
        logits = (rows @ normed.unsqueeze(-1)).squeeze(-1)
    logits = logits.float()
    if bias is not None:
        logits = logits + bias.float()
    probs = torch.softmax(logits, dim=-1)
    change = probs if previous is None else probs - previous
    return CandidateScores(logits, probs, torch.cat([logits, probs, change], dim=-1))


class ExitPredictors(nn.Module):
    """One SpecEE predictor MLP per layer, ``3k → hidden → 1`` with ReLU and a sigmoid.

    The weights of all layers are stacked so that training runs every layer in one batched
    product; decoding calls :meth:`prob` on one layer's slice.

    Args:
        layers: exit layers with a predictor (``ℓ`` = the state after layers ``[0, ℓ)``),
            sorted, distinct.
        num_candidates: ``k``.
        hidden: MLP width (512 in the paper).

    Attributes:
        fc1_weight: ``[P, hidden, 3k]``; fc1_bias: ``[P, hidden]``;
        fc2_weight: ``[P, hidden]``; fc2_bias: ``[P]`` (float32; ``P = len(layers)``).
    """

    def __init__(self, layers: list[int], num_candidates: int,
                 hidden: int = PREDICTOR_HIDDEN) -> None:
        super().__init__()
        if list(layers) != sorted(set(layers)) or not layers:
            raise InvalidArgumentError(f"predictor layers must be sorted and distinct, got {layers}")
        if num_candidates < 2:
            raise InvalidArgumentError(f"SpecEE needs at least 2 candidates, got {num_candidates}")
        self.layers = [int(x) for x in layers]
        self.num_candidates = int(num_candidates)
        self.hidden = int(hidden)
        n, f = len(layers), FEATURES_PER_CANDIDATE * num_candidates
        self.fc1_weight = nn.Parameter(torch.randn(n, hidden, f) / f ** 0.5)
        self.fc1_bias = nn.Parameter(torch.zeros(n, hidden))
        self.fc2_weight = nn.Parameter(torch.randn(n, hidden) / hidden ** 0.5)
        self.fc2_bias = nn.Parameter(torch.zeros(n))
        self._index = {layer: i for i, layer in enumerate(self.layers)}

    @property
    def num_features(self) -> int:
        """``3k``."""
        return FEATURES_PER_CANDIDATE * self.num_candidates

    def index(self, layer: int) -> int:
        """Position of ``layer`` in :attr:`layers`.

        Raises:
            InvalidArgumentError: no predictor at ``layer``.
        """
        try:
            return self._index[layer]
        except KeyError:
            raise InvalidArgumentError(
                f"no SpecEE predictor at layer {layer}; predictors are at {self.layers}") from None

    def logit(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid output of ``layer``'s predictor: ``[..., 3k]`` → ``[...]`` float32."""
        i = self.index(layer)
        x = torch.relu(F.linear(features.float(), self.fc1_weight[i], self.fc1_bias[i]))
        return x @ self.fc2_weight[i] + self.fc2_bias[i]

    def prob(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """Exit probability of ``layer``'s predictor: ``[..., 3k]`` → ``[...]`` in [0, 1]."""
        return torch.sigmoid(self.logit(layer, features))

    def logits_all(self, features: torch.Tensor) -> torch.Tensor:
        """Every layer's predictor on its own features: ``[P, N, 3k]`` → ``[P, N]`` (training)."""
        x = torch.relu(torch.baddbmm(self.fc1_bias.unsqueeze(1), features.float(),
                                     self.fc1_weight.transpose(1, 2)))          # [P, N, hidden]
        return (x @ self.fc2_weight.unsqueeze(-1)).squeeze(-1) + self.fc2_bias.unsqueeze(1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Stacked parameters by name (what head files store)."""
        return {"fc1_weight": self.fc1_weight, "fc1_bias": self.fc1_bias,
                "fc2_weight": self.fc2_weight, "fc2_bias": self.fc2_bias}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy stored parameters in (shapes must match)."""
        for name, param in self.tensors().items():
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise InvalidArgumentError(
                    f"predictor tensor {name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(param.shape)}")
            param.data.copy_(value)
