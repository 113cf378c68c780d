"""Stop rules: when the drafter stops drafting and hands the draft to verification.

The drafter calls a rule once per drafted token, so everything here is plain Python floats
and ints (no tensors, no syncs):

    rule.reset()                                  # start of a new draft
    for each drafted token:
        if rule.should_stop(DraftTokenInfo(...)):  # True = this token is the last of the draft
            break
    ... verify ...
    rule.update(StepStats(num_drafted, num_accepted))   # adaptive gamma

The token for which ``should_stop`` returns True is kept in the draft (AdaSPEED Algorithms 1-2
draft ``x_{j+1}`` and then break; Draft & Verify's code does the same).

Rules (pick one by name with :func:`make_stop_rule`):

- ``constant``   — exactly ``draft_len`` tokens (LayerSkip, Elhoushi et al. 2024; AdaSPEED
  "Constant-D").
- ``threshold``  — stop at the first token whose probability is ``< gamma`` (Draft & Verify,
  Zhang et al. 2024, §3.3; AdaSPEED Algorithm 1), with the adaptive gamma of the AdaSPEED
  appendix / Draft & Verify.
- ``product``    — stop when the product of the draft probabilities since the last
  verification is ``< gamma`` (AdaSPEED Algorithm 2, §II.A), same adaptive gamma.
- ``confidence`` — stop when the top-1 probability is ``< tau`` (KnapSpec §3.5, "Dynamic
  Drafting Exit", tau_conf = 0.7).

- ``buffer``     — only ``max_draft_len`` and EOS (DSSD §4.3.1; its drafter stops when no
  exit head is confident).

Every rule also stops after ``max_draft_len`` tokens and after an EOS token (drafting past
EOS is wasted work). The contract (:class:`StopRule`, :class:`DraftTokenInfo`) is declared in
:mod:`selfspec.decoding.core.stop_rule`, where the ``Drafter`` protocol names it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from types import MappingProxyType

from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.stop_rule import DraftTokenInfo, StopRule
from selfspec.errors import InvalidArgumentError

__all__ = [
    "AdaptiveGamma",
    "BufferStopRule",
    "ConfidenceStopRule",
    "ConstantStopRule",
    "DraftTokenInfo",
    "ProductStopRule",
    "STOP_RULES",
    "StepStats",
    "StopRule",
    "ThresholdStopRule",
    "make_stop_rule",
]

# Adaptive gamma keeps gamma in [GAMMA_MIN, GAMMA_MAX], inside the open interval (0, 1):
# at 0.99 the threshold rule stops at almost every token (the safe limit, D ~ 1); at 0.01
# drafts run to max_draft_len. The D&V update has no clamp and can leave (0, 1).
GAMMA_MIN = 0.01
GAMMA_MAX = 0.99


class AdaptiveGamma:
    """The adaptive threshold of Draft & Verify, as written in the AdaSPEED appendix (§VII.A):

        AR  <- beta1 * AR + (1 - beta1) * AR_e        (AR_e = num_accepted / num_drafted)
        g~   = gamma + epsilon   if AR <= alpha
               gamma - epsilon   otherwise
        gamma <- beta2 * gamma + (1 - beta2) * g~

    Low acceptance raises gamma (shorter drafts), high acceptance lowers it (longer drafts).
    Two details follow the official Draft & Verify code (dilab-zju/self-speculative-decoding,
    ``decoding.py``, ``exact_self_speculative_generate``, commit f69f2a7): AR starts at 0
    (``tmp_matchness = 0``), and when acceptance is high but the draft already reached
    ``max_draft_len``, gamma is held (``new_th_stop_draft = th_stop_draft``): the threshold did
    not bind, so lowering it cannot lengthen drafts and would only let it drift.
    ``hold_at_max_draft_len=False`` gives the appendix equations alone. The code compares
    ``AR < alpha``; we follow the appendix's ``AR <= alpha`` (they differ only at equality).
    gamma is clamped to [GAMMA_MIN, GAMMA_MAX].

    Defaults are the official code's ``auto_parameters=[1, 0.5, 0.9, 1e-2, 0.9]`` =
    [update every 1 verification, beta1 = 0.5, alpha = 0.9, epsilon = 0.01, beta2 = 0.9]
    (same values in ``self_speculative_sample``).

    Args:
        gamma: initial threshold, in (0, 1).
        beta1: smoothing of the acceptance rate AR, in [0, 1).
        beta2: smoothing of gamma, in [0, 1).
        epsilon: step of gamma, in (0, 1).
        alpha: target acceptance rate, in (0, 1).
        hold_at_max_draft_len: hold gamma when AR > alpha and the draft hit ``max_draft_len``.

    Raises:
        InvalidArgumentError: a parameter is outside its range.
    """

    def __init__(self, gamma: float = 0.8, *, beta1: float = 0.5, beta2: float = 0.9,
                 epsilon: float = 0.01, alpha: float = 0.9,
                 hold_at_max_draft_len: bool = True) -> None:
        self.gamma = _check_unit_interval("gamma", gamma)
        self.beta1 = _check_unit_interval("beta1", beta1, closed_low=True)
        self.beta2 = _check_unit_interval("beta2", beta2, closed_low=True)
        self.epsilon = _check_unit_interval("epsilon", epsilon)
        self.alpha = _check_unit_interval("alpha", alpha)
        self.hold_at_max_draft_len = bool(hold_at_max_draft_len)
        self.smoothed_acceptance_rate = 0.0  # smoothed AR; 0 as in the official code

    def update(self, stats: StepStats, max_draft_len: int) -> None:
        """Move gamma after one verification; an empty draft carries no signal and is skipped."""
        if stats.num_drafted == 0:
            return
        smoothed = (self.beta1 * self.smoothed_acceptance_rate
                    + (1.0 - self.beta1) * stats.acceptance_rate)
        self.smoothed_acceptance_rate = smoothed
        if smoothed <= self.alpha:
            target = self.gamma + self.epsilon
        elif self.hold_at_max_draft_len and stats.num_drafted >= max_draft_len:
            target = self.gamma
        else:
            target = self.gamma - self.epsilon
        gamma = self.beta2 * self.gamma + (1.0 - self.beta2) * target
        self.gamma = min(max(gamma, GAMMA_MIN), GAMMA_MAX)


class _BaseStopRule:
    """Shared part of every rule: stop at ``max_draft_len`` and at EOS."""

    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = _check_positive_int("max_draft_len", max_draft_len)

    def reset(self) -> None:
        """Start a new draft (stateless rules: nothing to do)."""

    def should_stop(self, token: DraftTokenInfo) -> bool:
        """True when ``token`` is the last one of the draft."""
        if token.index + 1 >= self.max_draft_len or token.is_eos:
            return True
        return self._stop_on(token)

    def update(self, stats: StepStats) -> None:
        """Non-adaptive rules ignore verification outcomes."""

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        raise NotImplementedError


class BufferStopRule(_BaseStopRule):
    """Only the buffer limit and EOS end the draft: DSSD (§4.3.1), whose drafter ends a
    draft itself when no exit head is confident.

    Args:
        max_draft_len: the draft buffer, >= 1.

    Raises:
        InvalidArgumentError: ``max_draft_len < 1``.
    """

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        return False


class ConstantStopRule(_BaseStopRule):
    """Exactly ``draft_len`` draft tokens (fewer only at EOS): LayerSkip's constant-D drafting
    (Elhoushi et al. 2024, §5; AdaSPEED Fig. 1 "Constant-D").

    There is no default ``draft_len``: LayerSkip's code has none either (``num_speculations``
    is required); the method chooses it per model.

    Args:
        draft_len: D, tokens per draft, >= 1.
        max_draft_len: optional extra cap, >= 1; the draft has ``min(draft_len, max_draft_len)``
            tokens. Defaults to ``draft_len``.

    Raises:
        InvalidArgumentError: ``draft_len < 1`` or ``max_draft_len < 1``.
    """

    def __init__(self, draft_len: int, max_draft_len: int | None = None) -> None:
        self.draft_len = _check_positive_int("draft_len", draft_len)
        cap = draft_len if max_draft_len is None else max_draft_len
        super().__init__(min(self.draft_len, _check_positive_int("max_draft_len", cap)))

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        return False  # only the length cap (= draft_len) and EOS stop a constant draft


class ThresholdStopRule(_BaseStopRule):
    """Stop at the first draft token whose probability is ``< gamma``.

    Source: Draft & Verify (Zhang et al. 2024, §3.3 "adaptive draft-exiting"); AdaSPEED
    Algorithm 1 line 5. The compared value is ``token.score`` when set, else ``token.prob``.

    Initial gamma 0.8: the official D&V greedy default (``th_stop_draft=0.8`` in
    ``exact_self_speculative_generate``) and the value the AdaSPEED appendix reports
    choosing after its hyperparameter search ("we choose to initialize gamma = 0.8"; the
    text is cut off there). D&V's sampling entry point (``self_speculative_sample``) starts
    at 0.5; pass ``gamma=0.5`` to match it. ``max_draft_len=8`` is D&V's ``max_step_draft``.

    Args:
        gamma: initial threshold, in (0, 1).
        adaptive: update gamma after each verification (:class:`AdaptiveGamma`); D&V's
            ``auto_th_stop_draft=True`` default.
        max_draft_len: cap on tokens per draft, >= 1.
        beta1, beta2, epsilon, alpha, hold_at_max_draft_len: see :class:`AdaptiveGamma`.

    Raises:
        InvalidArgumentError: a parameter is outside its range.
    """

    def __init__(self, gamma: float = 0.8, *, adaptive: bool = True, max_draft_len: int = 8,
                 beta1: float = 0.5, beta2: float = 0.9, epsilon: float = 0.01,
                 alpha: float = 0.9, hold_at_max_draft_len: bool = True) -> None:
        super().__init__(max_draft_len)
        self.adaptive = bool(adaptive)
        self._gamma = AdaptiveGamma(gamma, beta1=beta1, beta2=beta2, epsilon=epsilon,
                                    alpha=alpha, hold_at_max_draft_len=hold_at_max_draft_len)

    @property
    def gamma(self) -> float:
        """The current threshold."""
        return self._gamma.gamma

    @property
    def smoothed_acceptance_rate(self) -> float:
        """AR, the exponentially smoothed acceptance rate driving the adaptive gamma."""
        return self._gamma.smoothed_acceptance_rate

    def update(self, stats: StepStats) -> None:
        """Adapt gamma to the last verification (no-op when not adaptive)."""
        if self.adaptive:
            self._gamma.update(stats, self.max_draft_len)

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        value = token.prob if token.score is None else token.score
        return value < self._gamma.gamma


class ProductStopRule(ThresholdStopRule):
    """Stop when the product of the draft probabilities since the last verification is
    ``< gamma``: the estimated probability that the whole draft is accepted.

    Source: AdaSPEED (Liu et al.) §II.A and Algorithm 2 line 5,
    ``prod_{k=i}^{j} p(x_{k+1} | l, x_1..x_k) < gamma``. Unlike the threshold rule it always
    stops when probabilities stay bounded away from 1 (AdaSPEED §II.A). Each factor is
    ``token.score`` when set (the probe variant), else ``token.prob``. The product restarts at
    :meth:`reset` and at any token with ``index == 0``.

    Same parameters, defaults and adaptive gamma as :class:`ThresholdStopRule` (the AdaSPEED
    appendix applies the D&V update to both rules and reports the same gamma = 0.8 start).

    Raises:
        InvalidArgumentError: a parameter is outside its range.
    """

    def __init__(self, gamma: float = 0.8, *, adaptive: bool = True, max_draft_len: int = 8,
                 beta1: float = 0.5, beta2: float = 0.9, epsilon: float = 0.01,
                 alpha: float = 0.9, hold_at_max_draft_len: bool = True) -> None:
        super().__init__(gamma, adaptive=adaptive, max_draft_len=max_draft_len, beta1=beta1,
                         beta2=beta2, epsilon=epsilon, alpha=alpha,
                         hold_at_max_draft_len=hold_at_max_draft_len)
        self._product = 1.0

    def reset(self) -> None:
        """Start a new draft: the product restarts at 1."""
        self._product = 1.0

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        if token.index == 0:  # robust to a drafter that forgets reset()
            self._product = 1.0
        self._product *= token.prob if token.score is None else token.score
        return self._product < self._gamma.gamma


class ConfidenceStopRule(_BaseStopRule):
    """Stop when the draft's top-1 probability is ``< tau``.

    Source: KnapSpec §3.5 "Dynamic Drafting Exit" (tau_conf = 0.7, following CLaSp and DEL),
    motivated by acceptance correlating with draft confidence. Uses ``token.top1_prob`` only.

    Args:
        tau: confidence threshold, in (0, 1); default 0.7 (KnapSpec).
        max_draft_len: cap on tokens per draft, >= 1; default 8 (KnapSpec searches draft
            lengths up to 10 and does not state a cap for the dynamic exit).

    Raises:
        InvalidArgumentError: a parameter is outside its range.
    """

    def __init__(self, tau: float = 0.7, *, max_draft_len: int = 8) -> None:
        super().__init__(max_draft_len)
        self.tau = _check_unit_interval("tau", tau)

    def _stop_on(self, token: DraftTokenInfo) -> bool:
        return token.top1_prob < self.tau


STOP_RULES: Mapping[str, type] = MappingProxyType({
    "buffer": BufferStopRule,
    "constant": ConstantStopRule,
    "threshold": ThresholdStopRule,
    "product": ProductStopRule,
    "confidence": ConfidenceStopRule,
})


def make_stop_rule(name: str, **params: object) -> StopRule:
    """Build the stop rule registered under ``name`` with ``params``.

    Example: ``make_stop_rule("product", gamma=0.6, max_draft_len=12)``.

    Raises:
        InvalidArgumentError: unknown ``name`` (the message lists the registered names), an
            unknown or missing parameter (the message lists the rule's parameters), or a
            parameter outside its range.
    """
    try:
        cls = STOP_RULES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown stop rule {name!r}; choose one of: {', '.join(STOP_RULES)}"
        ) from None
    signature = list(inspect.signature(cls).parameters.values())
    names = [p.name for p in signature]
    unknown = sorted(set(params) - set(names))
    missing = [p.name for p in signature if p.default is p.empty and p.name not in params]
    if unknown or missing:
        problem = (f"unknown parameter(s) {unknown}" if unknown
                   else f"missing required parameter(s) {missing}")
        raise InvalidArgumentError(
            f"stop rule {name!r}: {problem}; its parameters are: {', '.join(names)}"
        )
    return cls(**params)


def _check_unit_interval(name: str, value: float, *, closed_low: bool = False) -> float:
    """``value`` as a float in (0, 1), or [0, 1) when ``closed_low``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (0.0 <= value < 1.0 if closed_low else 0.0 < value < 1.0)
    if not ok:
        interval = "[0, 1)" if closed_low else "the open interval (0, 1)"
        raise InvalidArgumentError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def _check_positive_int(name: str, value: int) -> int:
    """``value`` as an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return value
