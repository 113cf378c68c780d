"""The speculative step shared by every self-speculative method (DESIGN.md "The speculative step").

One step: draft → verify → commit → rollback → update::

    draft  = drafter.draft(state)                  # DraftOutput
    logits = drafter.target_logits(state, draft)   # only the layers the draft did not run
    result = verify(draft, logits, sampling)       # VerifyOutput
    state.cache.truncate(...); state.commit(result.committed_tokens)
    drafter.update(StepStats(...))

Cache invariant between steps: with ``n`` committed tokens, every layer holds positions
``[0, n-1)``; the last committed token has not run through any layer yet. A step feeds that
token and the draft, so it writes positions ``n-1 .. n-1+D``; after verification everything
from position ``n + num_accepted`` on is rejected and rolled back in every layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from selfspec.decoding.deferred import DeferredLayers
from selfspec.decoding.sampling import choose_next
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stop_rules import StepStats
from selfspec.decoding.verification import VerifyOutput, verify_greedy, verify_sampling


@dataclass
class DraftOutput:
    """A draft of ``D >= 0`` tokens following the last committed token.

    Attributes:
        tokens: ``[D]`` draft token ids (host ints).
        token_ids: ``[D]`` int64 tensor of the same ids.
        probs: ``[D, V]`` float32 draft distributions ``q`` the tokens were sampled from
            (sampling only; ``None`` when greedy).
        exit_layers: ``[D]`` number of layers each draft token's prediction ran
            (``exit_layer``: layers ``[0, exit_layer)``).
        layer_forwards: decoder-layer evaluations (one token through one layer) spent drafting.
        deferred: the drafted positions' pending inputs (their hidden states after the
            layers they ran, e.g. the exit-layer states LayerSkip reuses for verification),
            handed to :meth:`Drafter.target_logits`; ``None`` for a drafter without them.
    """

    tokens: list[int]
    token_ids: torch.Tensor
    probs: torch.Tensor | None
    exit_layers: list[int]
    layer_forwards: int = 0
    deferred: DeferredLayers | None = None


@dataclass
class TargetOutput:
    """The full model's view of a draft.

    Attributes:
        logits: ``[D+1, V]`` target logits: row ``i`` predicts the token after draft token
            ``i-1`` (row 0 after the last committed token); row ``D`` is the bonus position.
        layer_forwards: decoder-layer evaluations spent.
    """

    logits: torch.Tensor
    layer_forwards: int


class Drafter(Protocol):
    """What a self-speculative method plugs into the step (cf. transformers'
    ``CandidateGenerator``: ``get_candidates`` / ``update_candidate_strategy``)."""

    def draft(self, state: DecodeState) -> DraftOutput:
        """Propose draft tokens after ``state.tokens`` (at most ``state.remaining - 1``)."""

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Run the layers the draft skipped and return the target logits."""

    def update(self, stats: StepStats) -> None:
        """Learn from the verification result (e.g. adaptive gamma)."""


def speculative_step(state: DecodeState, drafter: Drafter) -> VerifyOutput:
    """Run one draft → verify → commit → rollback → update step on ``state``.

    Returns:
        The verification result (``committed_tokens`` were committed to ``state``).
    """
    sampling = state.options.sampling
    start_len = state.seq_len
    t0 = time.perf_counter()
    # 1. draft
    draft = drafter.draft(state)
    t1 = time.perf_counter()
    # 2. verify: the target's logits at the D+1 positions, then the acceptance rule
    target = drafter.target_logits(state, draft)
    if sampling.greedy:
        result = verify_greedy(draft.token_ids, target.logits)
    else:
        result = verify_sampling(draft.token_ids, draft.probs, target.logits, sampling,
                                 state.generator)
    t2 = time.perf_counter()
    # 3. rollback the rejected positions in every layer, 4. commit
    state.cache.truncate(start_len + result.num_accepted)
    state.commit(result.committed_tokens)
    # 5. update the drafter
    drafter.update(StepStats(num_drafted=len(draft.tokens), num_accepted=result.num_accepted))
    stats = state.stats
    stats.drafted += len(draft.tokens)
    stats.accepted += result.num_accepted
    stats.verifications += 1
    stats.draft_ms += (t1 - t0) * 1e3
    stats.verify_ms += (t2 - t1) * 1e3
    stats.layer_forwards += draft.layer_forwards + target.layer_forwards
    stats.exit_layer_total += sum(draft.exit_layers)
    return result


def decode_speculative(state: DecodeState, drafter: Drafter) -> None:
    """Generate until ``state`` is done: prefill, first token from the full model, then
    speculative steps.

    Args:
        state: a fresh :class:`DecodeState`.
        drafter: the method's drafter.
    """
    logits = state.prefill()  # [1, V]
    state.commit([int(choose_next(logits, state.options.sampling, state.generator))])
    while not state.done:
        speculative_step(state, drafter)
