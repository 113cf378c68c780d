"""The stop-rule contract a drafter holds (declared here so that
:class:`~selfspec.decoding.core.speculative.Drafter` can name it); the rules themselves are in
:mod:`selfspec.decoding.drafting.stop_rules`, which re-exports both names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from selfspec.decoding.core.stats import StepStats


@dataclass(frozen=True)
class DraftTokenInfo:
    """What a stop rule sees about one drafted token.

    Attributes:
        index: 0-based position of the token within the current draft.
        token_id: the drafted token id.
        prob: draft probability of the drafted token, in [0, 1]. Draft & Verify's code uses
            the untempered softmax probability of the chosen token, also when sampling.
        top1_prob: the largest draft probability at this position, in [0, 1].
        is_eos: the token is an end-of-sequence token.
        score: an acceptance-probability estimate in [0, 1] (e.g. AdaSPEED's linear probe,
            §II.B) or ``None``; when set, the ``threshold`` and ``product`` rules use it
            instead of ``prob``.
    """

    index: int
    token_id: int
    prob: float
    top1_prob: float
    is_eos: bool = False
    score: float | None = None


@runtime_checkable
class StopRule(Protocol):
    """When to stop drafting. One instance per generation (adaptive state persists across
    drafts of that generation).

    Attributes:
        max_draft_len: upper bound on tokens per draft (for the drafter's buffers).
    """

    max_draft_len: int

    def reset(self) -> None:
        """Start a new draft."""

    def should_stop(self, token: DraftTokenInfo) -> bool:
        """Called after each drafted token; True = stop drafting after this token."""

    def update(self, stats: StepStats) -> None:
        """Called after each verification with its outcome."""
