"""AdaDecode's early predictions (Wei et al. 2025, "AdaDecode: Accelerating LLM Decoding with
Adaptive Layer Parallelism", §2.2, Algorithm 1, eq. 1-2) as an exit policy.

**Schedule (Algorithm 1).** A token climbs the layers; after each layer that has a
lightweight head, the head predicts the next token. If the prediction passes the threshold
γ (eq. 1), the next token enters layer 0 at once and the current token's deeper layers are
deferred. Every layer runs, in one batched call, all tokens pending at it
(:class:`~selfspec.decoding.core.deferred.DeferredLayers` advances the newest token head by head
and picks up, at each layer, the deferred tokens waiting there), so every layer's KV is
complete before any token reads it. When a token finds no confident head, or after
``max_early`` early predictions, it runs to the last layer with every pending token, and the
early predictions are verified against the full model's logits, in order. That is exactly
:class:`~selfspec.decoding.drafting.exit_drafter.ExitDrafter` with :class:`ThresholdExits` as its
exit policy and a buffer stop rule of ``max_early`` (the draft = the early predictions), followed
by :class:`~selfspec.decoding.core.speculative.SpeculativeStep`'s verification and rollback.

**Verification when sampling (our derivation; eq. 2 as printed is biased).** Eq. 1 exits at
head ``i`` with token ``t`` when ``t ~ p_i`` *and* ``p_i(t) > γ``. Given that the head exits,
the token is therefore distributed as the proposal

    q_i(t) = p_i(t) · 1[p_i(t) > γ] / m_i,     m_i = Σ_v p_i(v) · 1[p_i(v) > γ],

and the head exits with probability ``m_i``; if it does not, the token goes on to the next head
(a fresh draw) or to the last layer. For γ >= 0.5 at most one token can pass, so ``q_i`` is a
point mass on the head's argmax. Speculative sampling (Leviathan et al. 2023, §2.3) is exact
for the distribution a draft token was *really* drawn from: accept ``t`` with probability
``min(1, p*(t) / q_i(t))`` and on rejection draw from ``normalize(max(0, p* - q_i))``. Using
``p_i`` in eq. 2's ratio instead (as printed) accepts a point-mass proposal with probability
``min(1, p*(t)/p_i(t))`` instead of ``p*(t)``, which over-produces ``t`` whenever
``p*(t) < 1`` (``tests/decoding/test_adadecode.py`` computes both output distributions exactly).
Because the exit decision and the token are both functions of the head's state, conditioning
on "head ``i`` exits" leaves ``p*`` (a function of the committed prefix only) unchanged, so the
committed token is distributed exactly as ``p*`` whichever head exits, or none.

We draw the exit event as ``u < m_i`` (``u ~ U[0, 1)``) and then ``t ~ q_i``: the same joint
distribution as eq. 1's "draw ``t ~ p_i``, exit if ``p_i(t) > γ``", with no draw wasted on a
token that cannot exit. ``p_i`` is the head's distribution after the sampling transform
(temperature / top-k / top-p), the distribution the paper samples from. Greedy decoding exits
when the head's untempered top-1 probability exceeds γ, with the argmax as the token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.decoding.drafting.draft_vocab import DraftVocab
from selfspec.decoding.drafting.exits import Exit
from selfspec.errors import InvalidArgumentError

# An exit head as AdaDecode uses it: hidden [1, T, H] -> logits [1, T, V] (or [1, T, R]).
HeadCall = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EarlyProposal:
    """What eq. 1 does with one head's distribution when sampling.

    Attributes:
        exit_prob: ``m``, the probability that the head exits (a draw passes γ), in [0, 1].
        proposal: ``[V]`` (or ``[R]``) float32 ``q``, the distribution of the exiting token:
            ``p`` restricted to the tokens above γ and renormalised (all zero when ``m == 0``).
    """

    exit_prob: torch.Tensor
    proposal: torch.Tensor


def early_proposal(probs: torch.Tensor, gamma: float) -> EarlyProposal:
    """AdaDecode eq. 1 as a distribution: exit probability and proposal ``q`` (module doc).

    Args:
        probs: ``[V]`` float head distribution ``p_i`` after the sampling transform.
        gamma: threshold in [0, 1).

    Returns:
        :class:`EarlyProposal` (tensors on ``probs``' device, no host sync).
    """
    passing = torch.where(probs > gamma, probs, torch.zeros_like(probs))
    mass = passing.sum()
    proposal = passing / mass.clamp(min=torch.finfo(torch.float32).tiny)
    return EarlyProposal(exit_prob=mass, proposal=proposal)


def check_gamma(gamma: object) -> float:
    """Validate AdaDecode's threshold γ.

    Raises:
        InvalidArgumentError: not a number in [0, 1).
    """
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma < 1:
        raise InvalidArgumentError(
            f"gamma must be a number in [0, 1) (a head predicts early when its token's "
            f"probability exceeds gamma; AdaDecode uses 0.75), got {gamma!r}")
    return float(gamma)


class ThresholdExits:
    """The first head, shallowest first, whose prediction passes γ (AdaDecode eq. 1).

    Args:
        layers: ``[K]`` head layers, increasing, each in ``[1, L-1]`` (a head at layer ``l``
            reads the hidden state after layers ``[0, l)``).
        heads: ``[K]`` callables ``hidden [1, 1, H] -> logits [1, 1, V]`` (``[1, 1, R]`` over
            ``vocab.rows`` with a reduced draft vocabulary): AdaDecode's lightweight heads,
            full heads, or the model's own final norm + ``lm_head`` (Table 3's "original LM
            head").
        gamma: threshold in [0, 1), or ``[K]`` thresholds, one per head (selfspec's tuned
            per-head thresholds, :mod:`selfspec.training.adadecode_tuning`).
        vocab: the reduced draft vocabulary the heads score, or ``None`` (all ``V``).

    Raises:
        InvalidArgumentError: no head, layers not increasing, lengths differ, or γ out of range.
    """

    def __init__(self, layers: Sequence[int], heads: Sequence[HeadCall],
                 gamma: float | Sequence[float], vocab: DraftVocab | None = None) -> None:
        layers = list(layers)
        if not layers or len(layers) != len(heads):
            raise InvalidArgumentError(
                f"AdaDecode needs one head per layer and at least one; got layers {layers} "
                f"and {len(heads)} heads")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise InvalidArgumentError(f"head layers must increase, got {layers}")
        gammas = list(gamma) if isinstance(gamma, Sequence) else [gamma] * len(layers)
        if len(gammas) != len(layers):
            raise InvalidArgumentError(
                f"give one threshold per head: {len(layers)} heads, {len(gammas)} thresholds")
        self.layers = layers
        self.heads = list(heads)
        self.gammas = [check_gamma(g) for g in gammas]
        self.vocab = vocab

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit | None:
        """Advance the last pending position head by head (batched with the deferred
        positions waiting at each layer); the :class:`Exit` of the first head that predicts
        early, or ``None`` (the position must run to the last layer)."""
        for layer, head, gamma in zip(self.layers, self.heads, self.gammas):
            deferred.advance(layer)
            logits = head(deferred.hidden())[0, -1].float()  # [V] or [R]
            if sampling.greedy:
                if float(logits.softmax(dim=-1).max()) > gamma:
                    return Exit(layer, logits)
                continue
            early = early_proposal(logits_to_probs(logits, sampling), gamma)
            uniform = torch.rand((), generator=generator, device=logits.device)
            if bool(uniform < early.exit_prob):
                return Exit(layer, logits, proposal=early.proposal)
        return None
