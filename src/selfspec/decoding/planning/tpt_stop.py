"""Ending a draft where its predicted tokens per second peak, token by token.

A drafter's acceptance is not one number: a quantized self-draft whose top-1 probability is
0.999 is almost always right, one at 0.6 often wrong. A draft length chosen before drafting
from the average acceptance (KnapSpec eq. 4 with one ``α``) therefore cuts confident drafts
short and lets doubtful ones run. :class:`TptStopRule` decides after each drafted token
instead, from what that token's confidence says:

    S_k   = Π_{j≤k} a(p_j)                     # chance tokens 1..k are all accepted
    E_k   = 1 + Σ_{j≤k} S_j                    # expected committed tokens if we stop at k
    stop at k  unless  max_{m≥1} (E_k + S_k Σ_{i≤m} ā^i) / ((k+m) t_draft + t_fwd(k+m+1))
                       > E_k / (k t_draft + t_fwd(k+1))

``a(p)`` is the drafter's acceptance calibrated online per bucket of the draft's top-1
probability ``p`` (:class:`ConfidenceCalibration`), ``ā`` its average (the next token's
confidence is unknown until it is drafted), ``t_draft`` the drafter's measured ms per token
and ``t_fwd`` the measured forward times (:class:`~selfspec.decoding.planning.tpt.ForwardCosts`).
The objective is KnapSpec's Tokens-per-Time (eq. 4) with per-position acceptance; deciding it per
token from the draft's own confidence is the idea of SpecDec++ (Huang et al. 2024, §3:
stop when the predicted chance of a rejection outweighs the cost of a verification).

Outputs never depend on it: it only changes where drafts end, and every draft is verified.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.stop_rules import DraftTokenInfo, StopRule
from selfspec.decoding.planning.tpt import AcceptanceEstimate

#: Upper edges of the confidence buckets (top-1 probability); the last bucket is [0.99, 1].
#: Finer at the top, where a quantized self-draft's tokens are, and where 0.95 against 0.995
#: acceptance moves the best draft length from ~8 to 16 tokens.
CONFIDENCE_EDGES: tuple[float, ...] = (0.3, 0.5, 0.7, 0.85, 0.95, 0.99)


class ConfidenceCalibration:
    """A drafter's per-token acceptance as a function of its top-1 probability, online.

    Each bucket of top-1 probability (:data:`CONFIDENCE_EDGES`) keeps decayed counts of its
    draft tokens that verification accepted and rejected (the tokens after the first
    rejection were never judged and are not counted), shrunk towards the drafter's average
    acceptance with ``prior_weight`` pseudo-observations, so a bucket seen rarely predicts
    what the drafter as a whole does.

    Args:
        overall: the drafter's average per-token acceptance (shared with its owner).
        key: ``overall``'s key for this drafter.
        prior_weight: pseudo-observations of the average behind each bucket (> 0).
        decay: forgetting factor per counted token of a bucket, in ``(0, 1]``.
        priors: per-bucket acceptance replacing the average as that bucket's prior (e.g.
            the rates an earlier generation ended with), with ``priors_weight``
            pseudo-observations.
        priors_weight: weight of ``priors`` (> 0).
    """

    def __init__(self, overall: AcceptanceEstimate, key: object, prior_weight: float = 2.0,
                 decay: float = 0.98, priors: Mapping[int, float] | None = None,
                 priors_weight: float = 4.0) -> None:
        self.overall = overall
        self.key = key
        self.prior_weight = prior_weight
        self.decay = decay
        self.priors = dict(priors or {})
        self.priors_weight = priors_weight
        self._counts = [[0.0, 0.0] for _ in range(len(CONFIDENCE_EDGES) + 1)]

    @staticmethod
    def bucket(top1_prob: float) -> int:
        """The bucket index of a top-1 probability in ``[0, 1]``."""
        return bisect.bisect_right(CONFIDENCE_EDGES, top1_prob)

    def average(self) -> float:
        """The drafter's average per-token acceptance."""
        return self.overall.rate(self.key)

    def rate(self, top1_prob: float) -> float:
        """Predicted acceptance of a draft token whose top-1 probability is ``top1_prob``."""
        return self._bucket_rate(self.bucket(top1_prob))

    def _bucket_rate(self, b: int) -> float:
        success, trials = self._counts[b]
        if b in self.priors:
            prior, weight = self.priors[b], self.priors_weight
        else:
            prior, weight = self.average(), self.prior_weight
        return (success + prior * weight) / (trials + weight)

    def update(self, top1_probs: list[float], accepted: int) -> None:
        """Record one verified draft: tokens ``< accepted`` accepted, token ``accepted``
        rejected (when it exists)."""
        for index, p in enumerate(top1_probs[:accepted + 1]):
            counts = self._counts[self.bucket(p)]
            counts[0] = counts[0] * self.decay + (1.0 if index < accepted else 0.0)
            counts[1] = counts[1] * self.decay + 1.0

    def observed_rates(self) -> dict[int, float]:
        """``rate`` of every bucket that has seen a verified token, by bucket index."""
        return {b: self._bucket_rate(b) for b, (_, trials) in enumerate(self._counts)
                if trials > 0}


class TptStopRule:
    """Wraps a drafter's own stop rule and also stops where the predicted tokens per second
    of the draft peak (module docstring; KnapSpec eq. 4 per token, SpecDec++ §3).

    The inner rule keeps its say (its limits, EOS, DSSD's own ends) and its adaptive state;
    ``max_draft_len`` is the inner rule's.

    Args:
        inner: the drafter's stop rule.
        calibration: the drafter's acceptance by confidence.
        draft_ms: ``() -> ms`` of one draft token (the drafter's measured average).
        forward_ms: ``T -> ms`` of a full forward of ``T`` tokens.
    """

    def __init__(self, inner: StopRule, calibration: ConfidenceCalibration,
                 draft_ms: Callable[[], float], forward_ms: Callable[[int], float]) -> None:
        self.inner = inner
        self.calibration = calibration
        self.draft_ms = draft_ms
        self.forward_ms = forward_ms
        self._top1: list[float] = []
        self._survive = 1.0
        self._tokens = 1.0

    @property
    def max_draft_len(self) -> int:
        """The inner rule's longest draft (setting it sets the inner rule's)."""
        return self.inner.max_draft_len

    @max_draft_len.setter
    def max_draft_len(self, value: int) -> None:
        self.inner.max_draft_len = value

    def reset(self) -> None:
        """Start a new draft."""
        self.inner.reset()
        self._top1 = []
        self._survive, self._tokens = 1.0, 1.0

    def should_stop(self, token: DraftTokenInfo) -> bool:
        """True when the inner rule stops or no longer draft is predicted to pay."""
        self._top1.append(token.top1_prob)
        if self.inner.should_stop(token):
            return True
        self._survive *= self.calibration.rate(token.top1_prob)
        self._tokens += self._survive
        return not self._longer_pays(token.index + 1)

    def _longer_pays(self, drafted: int) -> bool:
        """Whether some draft longer than ``drafted`` tokens has a higher predicted
        tokens/s than stopping now (future tokens at the average acceptance)."""
        d, fwd = max(self.draft_ms(), 0.0), self.forward_ms
        now_tokens, now_ms = self._tokens, drafted * d + fwd(drafted + 1)
        average = self.calibration.average()
        survive, tokens = self._survive, self._tokens
        for length in range(drafted + 1, self.inner.max_draft_len + 1):
            survive *= average
            tokens += survive
            ms = length * d + fwd(length + 1)
            if tokens * now_ms > now_tokens * ms:
                return True
        return False

    def update(self, stats: StepStats) -> None:
        """Pass the verification on and calibrate on its outcome."""
        self.inner.update(stats)
        self.calibration.update(self._top1[:stats.num_drafted], stats.num_accepted)

