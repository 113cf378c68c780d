"""Predicted tokens per second of a speculative step, and the online estimates it needs.

KnapSpec eq. 4 gives the Tokens-per-Time of a draft of ``γ`` tokens with per-token
acceptance ``α``::

    TPT(γ) = (1 - α^(γ+1)) / ((1 - α) (γ t_draft + t_verify(γ + 1)))

The numerator is the expected number of committed tokens (accepted draft tokens + the
recovered/bonus token) when each draft token is accepted with probability ``α`` given the
previous ones were; :func:`best_draft_len` uses the general form with a different ``α_i`` per
position, ``E(γ) = 1 + Σ_{k≤γ} Π_{i≤k} α_i``, and ``γ = 0`` is plain decoding. Which ``γ``
and which drafter pay is decided by that ratio (``selfspec.decoding.auto.step``).

- :class:`AcceptanceEstimate`: ``α`` per key (drafter, match length, ...), online, from the
  verification results: the geometric-model estimate ``accepted / (accepted + rejections)``
  with a prior, exponentially forgetting old steps so it follows the context.
- :class:`ForwardCosts`: the time of a full forward of ``T`` tokens at the current context
  length: the measured latency model (:class:`~selfspec.executor.cost_model.LatencyModel`) as
  the prior, corrected online by the times the steps really took.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from selfspec.executor.cost_model import LatencyModel


@dataclass(frozen=True)
class TptChoice:
    """The best draft length for one step and what it is predicted to give.

    Attributes:
        draft_len: ``γ`` (0 = plain decoding).
        tokens: expected committed tokens ``E(γ)`` (>= 1).
        ms: predicted step time, ms.
    """

    draft_len: int
    tokens: float
    ms: float

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens per second of the step."""
        return self.tokens / self.ms * 1e3 if self.ms > 0 else float("inf")


def best_draft_len(alphas: Sequence[float], draft_ms: float,
                   forward_ms: Callable[[int], float], min_len: int = 0) -> TptChoice:
    """The ``γ`` in ``[min_len, len(alphas)]`` that maximises ``E(γ) / (γ t_draft +
    t_forward(γ + 1))`` (KnapSpec eq. 4 with per-position acceptance).

    Args:
        alphas: ``[Γ]`` acceptance probability of draft token ``i`` given tokens ``< i`` were
            accepted, each in ``[0, 1]``.
        draft_ms: time to draft one token, ms (0 for free drafts).
        forward_ms: ``T -> ms`` of a full forward of ``T`` tokens (verification of ``T - 1``).
        min_len: shortest ``γ`` considered (1 when the drafter must draft).
    """
    best: TptChoice | None = None
    tokens, survive = 1.0, 1.0
    for gamma in range(len(alphas) + 1):
        if gamma:
            survive *= min(max(alphas[gamma - 1], 0.0), 1.0)
            tokens += survive
        if gamma < min_len:
            continue
        choice = TptChoice(gamma, tokens, gamma * draft_ms + forward_ms(gamma + 1))
        if best is None or choice.tokens * best.ms > best.tokens * choice.ms:
            best = choice
    assert best is not None, "min_len exceeds the draft"
    return best


class AcceptanceEstimate:
    """Online per-token acceptance ``α`` for each key.

    A step that drafted ``D`` tokens and accepted ``a`` is ``a`` successes and, when
    ``a < D``, one failure (the geometric model of KnapSpec eq. 9 / Leviathan et al. §3.1).
    Counts decay by ``decay`` per update of the key, so the estimate follows the context; a
    key never seen gives ``prior``.

    Args:
        prior: ``α`` before any observation, in ``[0, 1]``.
        prior_weight: pseudo-observations behind the prior (> 0).
        decay: forgetting factor per update, in ``(0, 1]``.
        priors: per-key priors replacing ``prior`` for their keys (e.g. the rates an
            earlier generation ended with, :class:`~selfspec.decoding.memory.EngineMemory`).
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.95, priors: Mapping[Hashable, float] | None = None) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.priors = dict(priors or {})
        self._counts: dict[Hashable, list[float]] = {}

    def rate(self, key: Hashable) -> float:
        """Estimated ``α`` for ``key``."""
        success, trials = self._counts.get(key, (0.0, 0.0))
        prior = self.priors.get(key, self.prior)
        return (success + prior * self.prior_weight) / (trials + self.prior_weight)

    def observed_rates(self) -> dict[Hashable, float]:
        """``rate(key)`` of every key updated at least once."""
        return {key: self.rate(key) for key in self._counts}

    def observations(self, key: Hashable) -> float:
        """Decayed number of trials behind ``rate(key)``."""
        return self._counts.get(key, (0.0, 0.0))[1]

    def update(self, key: Hashable, drafted: int, accepted: int) -> None:
        """Record one verified draft."""
        if drafted <= 0:
            return
        counts = self._counts.setdefault(key, [0.0, 0.0])
        counts[0] = counts[0] * self.decay + accepted
        counts[1] = counts[1] * self.decay + accepted + (1 if accepted < drafted else 0)


class ForwardCosts:
    """Time of a full forward of ``T`` tokens (one-token decoding: ``T = 1``; verifying
    ``D`` draft tokens: ``T = D + 1``) at the current context length, ms.

    The prior is the measured latency model; every observed forward updates a moving
    average of ``measured / prior`` per ``T`` and over all ``T``, so a ``T`` never run is
    predicted from the others' correction. Every average starts from the prior (ratio 1,
    a new ``T`` from the overall correction) and one observation moves it by at most a
    factor of 2 times its weight: a page fault or a slow first call (the first forward of a
    generation took about twice the model's time on Qwen2.5-1.5B, and used to set the whole
    correction by itself) does not derail the choice.

    Args:
        latency: the model's measured latencies on this machine.
        smoothing: weight of a new observation in the moving averages, in ``(0, 1]``.
    """

    def __init__(self, latency: LatencyModel, smoothing: float = 0.2) -> None:
        self.latency = latency
        self.smoothing = smoothing
        self.context_len = 0
        self._ratio: dict[int, float] = {}
        self._overall = 1.0  # no correction before the first observation

    def prior_ms(self, num_tokens: int) -> float:
        """The latency model's time for ``num_tokens`` at the current context length."""
        return self.latency.verify_ms(self.context_len, num_tokens)

    def forward_ms(self, num_tokens: int) -> float:
        """Predicted time of a forward of ``num_tokens`` tokens, ms."""
        return self.prior_ms(num_tokens) * self._ratio.get(num_tokens, self._overall)

    def observe(self, num_tokens: int, ms: float) -> None:
        """Record that a forward of ``num_tokens`` tokens took ``ms``."""
        if ms <= 0 or num_tokens < 1:
            return
        ratio = ms / max(self.prior_ms(num_tokens), 1e-6)
        w = self.smoothing
        self._ratio[num_tokens] = _blend(self._ratio.get(num_tokens, self._overall), ratio, w)
        self._overall = _blend(self._overall, ratio, w)


def _blend(old: float, new: float, weight: float) -> float:
    """Moving average step, with ``new`` clipped to ``[old / 2, 2 old]``."""
    return (1 - weight) * old + weight * min(max(new, old / 2), old * 2)


class MovingAverage:
    """Exponential moving average of a positive quantity (e.g. ms per draft token).

    Args:
        initial: the value before any observation.
        smoothing: weight of a new observation, in ``(0, 1]``.
    """

    def __init__(self, initial: float, smoothing: float = 0.2) -> None:
        self.value = initial
        self.smoothing = smoothing
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation (the first replaces the initial value)."""
        self.value = value if self.count == 0 else (
            (1 - self.smoothing) * self.value + self.smoothing * value)
        self.count += 1
