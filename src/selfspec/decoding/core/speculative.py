"""The speculative step shared by every self-speculative method (docs/design.md "Step").

One step: draft → verify → rollback → commit → update::

    draft  = drafter.draft(state)                  # DraftOutput
    target = drafter.target_logits(state, draft)   # only the layers the draft did not run
    result = verify(draft, target.logits)          # VerifyOutput: greedy or rejection sampling
    state.cache.truncate(...); state.commit(result.committed_tokens)
    drafter.update(stats)                          # StepStats: adaptive gamma

Cache invariant between steps: with ``n`` committed tokens, every layer holds positions
``[0, n-1)``; the last committed token has not run through any layer yet. A step feeds that
token and the draft, so it writes positions ``n-1 .. n-1+D``; after verification everything
from position ``n + num_accepted`` on is rejected and rolled back in every layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.stop_rule import StopRule
from selfspec.decoding.core.verification import (
    VerifyOutput,
    verify_greedy,
    verify_keyed,
    verify_sampling,
)


@dataclass
class DraftOutput:
    """A draft of ``D >= 0`` tokens following the last committed token.

    Attributes:
        tokens: ``[D]`` draft token ids (host ints).
        token_ids: ``[D]`` int64 tensor of the same ids.
        probs: ``[D, V]`` float32 draft distributions ``q`` the tokens were sampled from
            (unseeded sampling only; ``None`` when greedy or seeded, whose verification is
            an exact match and needs no ``q``).
        exit_layers: ``[D]`` number of layers each draft token's prediction ran
            (``exit_layer``: layers ``[0, exit_layer)``).
        sublayers: attention and MLP sub-layers (one token each) run while drafting.
        deferred: the drafted positions' pending inputs (their hidden states after the
            layers they ran, e.g. the exit-layer states LayerSkip reuses for verification),
            handed to :meth:`Drafter.target_logits`; ``None`` for a drafter without them.
    """

    tokens: list[int]
    token_ids: torch.Tensor
    probs: torch.Tensor | None
    exit_layers: list[int]
    sublayers: int = 0
    deferred: DeferredLayers | None = None


@dataclass
class TargetOutput:
    """The full model's view of a draft.

    Attributes:
        logits: ``[D+1, V]`` target logits: row ``i`` predicts the token after draft token
            ``i-1`` (row 0 after the last committed token); row ``D`` is the bonus position.
        sublayers: attention and MLP sub-layers (one token each) run.
    """

    logits: torch.Tensor
    sublayers: int


class Drafter(Protocol):
    """What a self-speculative method plugs into the step (cf. transformers'
    ``CandidateGenerator``: ``get_candidates`` / ``update_candidate_strategy``).

    Attributes:
        stop_rule: the rule that ends each draft (:class:`StopRule`), given when the drafter
            is built (``auto`` builds its model drafters with a
            :class:`~selfspec.decoding.planning.tpt_stop.TptStopRule` wrapping the method's
            own rule, and caps it per step through ``stop_rule.max_draft_len``); ``None`` for
            a drafter whose draft length is not decided token by token (the n-gram drafter
            picks it before drafting, from predicted tokens per second).
    """

    stop_rule: StopRule | None

    def draft(self, state: DecodeState) -> DraftOutput:
        """Propose draft tokens after ``state.tokens`` (at most ``state.remaining - 1``)."""

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Run the layers the draft skipped and return the target logits."""

    def update(self, stats: StepStats) -> None:
        """Learn from the verification result (e.g. adaptive gamma)."""


def verify(draft: DraftOutput, target: TargetOutput, state: DecodeState) -> VerifyOutput:
    """Greedy verification (longest prefix equal to the target argmax); seeded sampling: the
    longest prefix equal to the target's position-keyed Gumbel-max choice
    (:func:`~selfspec.decoding.core.verification.verify_keyed`: ``ar``'s seeded tokens
    whatever was drafted); unseeded sampling: the Leviathan/Chen rejection rule with residual
    and bonus token (:mod:`selfspec.decoding.core.verification`)."""
    sampling = state.options.sampling
    if sampling.greedy:
        return verify_greedy(draft.token_ids, target.logits)
    noise = state.noise_rows(0, len(draft.tokens) + 1)
    if noise is not None:
        return verify_keyed(draft.token_ids, target.logits, sampling, noise)
    return verify_sampling(draft.token_ids, draft.probs, target.logits, sampling,
                           state.generator)


def accept_all(draft: DraftOutput, target: TargetOutput, state: DecodeState) -> VerifyOutput:
    """No verification (lossy): every draft token is committed, then the target's token at
    the bonus position (argmax, or a draw from its transformed distribution). AdaDecode
    Table 3's "w/o verification" ablation; the draft's KV is still completed in every layer,
    so later tokens see a consistent cache."""
    bonus = state.choose_next(target.logits[-1:], offset=len(draft.tokens))
    next_token = int(bonus[0])
    return VerifyOutput(num_accepted=len(draft.tokens), next_token=next_token,
                        committed_tokens=list(draft.tokens) + [next_token],
                        num_drafted=len(draft.tokens))


Verifier = Callable[[DraftOutput, TargetOutput, DecodeState], VerifyOutput]


class SpeculativeStep(Step):
    """draft → verify → rollback → commit → update (the Step of every lossless
    self-speculative method).

    Args:
        drafter: the method's drafter (its stop rule decides the draft length).
        verifier: the acceptance rule: :func:`verify` (lossless, the default) or
            :func:`accept_all` (an ablation).
    """

    def __init__(self, drafter: Drafter, verifier: Verifier | None = None) -> None:
        self.drafter = drafter
        self.verifier = verify if verifier is None else verifier

    def __call__(self, state: DecodeState) -> StepStats:
        start_len = state.seq_len
        t0 = time.perf_counter()
        # 1. draft
        draft = self.drafter.draft(state)
        t1 = time.perf_counter()
        # 2. verify: the target's logits at the D+1 positions, then the acceptance rule
        target = self.drafter.target_logits(state, draft)
        if state.processor is not None:  # penalties / grammar: row i follows draft[:i]
            target = TargetOutput(state.process(target.logits, draft.tokens), target.sublayers)
        result = self.verifier(draft, target, state)
        t2 = time.perf_counter()
        # 3. rollback the rejected positions in every layer, 4. commit
        state.cache.truncate(start_len + result.num_accepted)
        kept = state.commit(result.committed_tokens, target.logits[: result.num_accepted + 1])
        stats = StepStats(num_drafted=len(draft.tokens), num_accepted=result.num_accepted,
                          committed=len(kept), verified=True,
                          exit_layers=tuple(draft.exit_layers),
                          sublayers=draft.sublayers + target.sublayers,
                          draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3,
                          layer_batches=(() if draft.deferred is None
                                         else tuple(draft.deferred.layer_batches)))
        # 5. update the drafter
        self.drafter.update(stats)
        return stats
