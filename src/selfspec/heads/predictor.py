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
candidate. The change is always taken against the previous *layer* (decoding computes the
features at every layer whose predictor runs and at the layer before it; each costs one
``[k, H]`` product), so decoding sees exactly the features training saw, whichever layers the
scheduler lets the MLP run at.

*Head lens* (``lens_layers`` on the card; ours, not in the paper): at a layer where the head
file has a lightweight exit head ``E*·T`` (AdaDecode §2.1), ``n`` is replaced by
``T · final_norm(h_ℓ)``, so the candidates' logits are the exit head's own (its tuned lens)
instead of the final ``lm_head``'s reading of a middle layer (the logit lens), which rarely
points at the final token before the last third of the layers. The cost is the head's one
``H×H`` product at those few layers. The emitted token is then the candidate the exit head
ranks first there. The state-reading predictors' state input stays ``final_norm(h_ℓ)``.

Predictors are fitted by :mod:`selfspec.training.predictors` and stored in head files beside
the head that drafts the candidates (:mod:`selfspec.heads.files`).

*State-reading predictors* (``state_dim > 0``; ours, not in the paper) also read the layer's
state itself: the MLP's input is ``[(features - mean) / std; STATE_SCALE · n / ||n||]``
(``3k + H`` values). The 12 features say how the candidates compare; the state can also say
whether the layer is still changing the prediction. Measured on Qwen2.5-Coder-1.5B (drafter
candidates; docs/results/specee/xeon-2026-11-27-state/analysis.txt §7-8) they gain nothing on
8k training positions and run ~1.5 layers per token fewer at equal held-out token accuracy
on 61k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import InvalidArgumentError

FEATURES_PER_CANDIDATE = 3  # logit, local probability, change of the local probability
PREDICTOR_HIDDEN = 512      # SpecEE's MLP width
STATE_PREDICTOR_HIDDEN = 128  # state-reading predictors: 3k + H inputs, so a narrower MLP
# The normalised state is scaled so its entries (~1/sqrt(H)) are of the order of the
# standardised features'; 8 for H ~ 1-2k (what analysis §7 used).
STATE_SCALE = 8.0


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
        state_dim: ``H`` for state-reading predictors (module doc), ``0`` for SpecEE's.

    Attributes:
        fc1_weight: ``[P, hidden, 3k + state_dim]``; fc1_bias: ``[P, hidden]``;
        fc2_weight: ``[P, hidden]``; fc2_bias: ``[P]`` (float32; ``P = len(layers)``).
        feature_mean / feature_std: ``[P, 3k]`` standardisation of the features (state-reading
            predictors only; set by training).

    Raises:
        InvalidArgumentError: unsorted or repeated layers, ``k < 2`` or ``state_dim < 0``.
    """

    def __init__(self, layers: list[int], num_candidates: int,
                 hidden: int = PREDICTOR_HIDDEN, state_dim: int = 0) -> None:
        super().__init__()
        if list(layers) != sorted(set(layers)) or not layers:
            raise InvalidArgumentError(
                f"predictor layers must be sorted and distinct, got {layers}")
        if num_candidates < 2:
            raise InvalidArgumentError(f"SpecEE needs at least 2 candidates, got {num_candidates}")
        if state_dim < 0:
            raise InvalidArgumentError(f"state_dim must be >= 0, got {state_dim}")
        self.layers = [int(x) for x in layers]
        self.num_candidates = int(num_candidates)
        self.hidden = int(hidden)
        self.state_dim = int(state_dim)
        n, f = len(layers), FEATURES_PER_CANDIDATE * num_candidates
        if state_dim:
            self.feature_mean = nn.Parameter(torch.zeros(n, f), requires_grad=False)
            self.feature_std = nn.Parameter(torch.ones(n, f), requires_grad=False)
        f += state_dim
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

    def _inputs(self, features: torch.Tensor, state: torch.Tensor | None,
                mean: torch.Tensor | None, std: torch.Tensor | None) -> torch.Tensor:
        if not self.state_dim:
            return features.float()
        if state is None:
            raise InvalidArgumentError("these SpecEE predictors read the layer's state; pass it")
        state = F.normalize(state.float(), dim=-1) * STATE_SCALE
        return torch.cat([(features.float() - mean) / std, state], dim=-1)

    def logit(self, layer: int, features: torch.Tensor,
              state: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-sigmoid output of ``layer``'s predictor: ``[..., 3k]`` features (and, for
        state-reading predictors, ``[..., H]`` the layer's state after the final norm) →
        ``[...]`` float32.

        Raises:
            InvalidArgumentError: no predictor at ``layer``; no ``state`` for state-reading
                predictors.
        """
        i = self.index(layer)
        stats = (self.feature_mean[i], self.feature_std[i]) if self.state_dim else (None, None)
        x = torch.relu(F.linear(self._inputs(features, state, *stats),
                                self.fc1_weight[i], self.fc1_bias[i]))
        return x @ self.fc2_weight[i] + self.fc2_bias[i]

    def prob(self, layer: int, features: torch.Tensor,
             state: torch.Tensor | None = None) -> torch.Tensor:
        """Exit probability of ``layer``'s predictor (arguments as :meth:`logit`), in [0, 1]."""
        return torch.sigmoid(self.logit(layer, features, state))

    def logits_all(self, features: torch.Tensor, states: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Every layer's predictor on its own features: ``[P, N, 3k]`` (and ``[P, N, H]``
        states for state-reading predictors) → ``[P, N]`` (training)."""
        stats = ((self.feature_mean.unsqueeze(1), self.feature_std.unsqueeze(1))
                 if self.state_dim else (None, None))
        x = torch.relu(torch.baddbmm(self.fc1_bias.unsqueeze(1),
                                     self._inputs(features, states, *stats),
                                     self.fc1_weight.transpose(1, 2)))          # [P, N, hidden]
        return (x @ self.fc2_weight.unsqueeze(-1)).squeeze(-1) + self.fc2_bias.unsqueeze(1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Stacked parameters by name (what head files store)."""
        out = {"fc1_weight": self.fc1_weight, "fc1_bias": self.fc1_bias,
               "fc2_weight": self.fc2_weight, "fc2_bias": self.fc2_bias}
        if self.state_dim:
            out.update(feature_mean=self.feature_mean, feature_std=self.feature_std)
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy stored parameters in (shapes must match)."""
        for name, param in self.tensors().items():
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise InvalidArgumentError(
                    f"predictor tensor {name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(param.shape)}")
            param.data.copy_(value)
