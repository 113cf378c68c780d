"""Calibrated early exit without verification (DSSD §3.4.2) — lossy by design.

Each token is emitted by the first exit head whose confidence passes its threshold τ_k(ε)
(the same :class:`~selfspec.decoding.drafting.exits.CalibratedExits` policy DSSD drafts with), or by
the full model when none does.

Deeper layers a token skipped are not dropped: its hidden state stays pending at its exit
layer, and when a later token needs a deeper layer the pending positions run the layers they
missed in one batched call before it (AdaDecode's deferred computation, §2.2). Later tokens
therefore attend to exactly the keys and values the full model would have computed for the
emitted tokens — no copied or approximated KV — and layers nobody needs never run. (DSSD
leaves the KV of skipped layers open; copying the exit hidden state into deeper layers, as
CALM does, would be cheaper but changes what later tokens see.)
"""

from __future__ import annotations

import time

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.exits import CalibratedExits, Exit
from selfspec.errors import InvalidArgumentError


class CalibratedExitStep(Step):
    """One token per call from the first confident exit head (or the full model).

    Its :class:`StepStats` reports the token as one draft token (``exit_layers`` = the
    layers its prediction ran, L when no head passed) that nothing verified, so a
    generation's ``mean_exit_layer`` is the mean exit layer and ``accepted`` stays 0.

    Args:
        exits: calibrated heads at one ε, over the full vocabulary.

    Raises:
        InvalidArgumentError: ``exits`` score a reduced draft vocabulary (without
            verification a token outside it could never be emitted).
    """

    def __init__(self, exits: CalibratedExits) -> None:
        if exits.vocab is not None:
            raise InvalidArgumentError(
                "lossy early exit emits tokens without verification, so its heads must score "
                "the full vocabulary; drop draft_vocab")
        self.exits = exits
        self._deferred: DeferredLayers | None = None

    def start(self, state: DecodeState) -> None:
        """Begin a generation: no position is pending."""
        self._deferred = DeferredLayers(state.executor, state.cache)

    def __call__(self, state: DecodeState) -> StepStats:
        ex, deferred = state.executor, self._deferred
        assert deferred is not None, "start() was not called"
        t0 = time.perf_counter()
        before = deferred.layer_forwards
        deferred.add(state.tokens[-1], state.seq_len - 1)
        exit = self.exits.choose(deferred, state.options.sampling)
        if exit is None:  # no head confident: the full model predicts this token
            deferred.advance(ex.num_layers)
            exit = Exit(ex.num_layers, ex.logits(deferred.hidden())[0, -1])
        logits = state.process(exit.logits.unsqueeze(0))  # [1, V]
        token = int(state.choose_next(logits))
        kept = state.commit([token], logits)
        deferred.drop_completed()
        return StepStats(num_drafted=1, committed=len(kept), exit_layers=(exit.layer,),
                         sublayers=2 * (deferred.layer_forwards - before),
                         draft_ms=(time.perf_counter() - t0) * 1e3)
