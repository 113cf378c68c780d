"""Calibrated early-exit decoding without verification (DSSD §3.4.2) — lossy by design.

Each token is emitted by the first exit head whose confidence passes its threshold τ_k(ε),
or by the full model when none does.

Deeper layers a token skipped are not dropped: its hidden state stays pending at its exit
layer, and when a later token needs a deeper layer the pending positions run the layers they
missed in one batched call before it (AdaDecode's deferred computation, §2.2). Later tokens
therefore attend to exactly the keys and values the full model would have computed for the
emitted tokens — no copied or approximated KV — and layers nobody needs never run. (DSSD
leaves the KV of skipped layers open; copying the exit hidden state into deeper layers, as
CALM does, would be cheaper but changes what later tokens see.)
"""

from __future__ import annotations

from selfspec.decoding.deferred import DeferredLayers
from selfspec.decoding.sampling import choose_next
from selfspec.decoding.state import DecodeState
from selfspec.methods.dssd import CalibratedExits, Exit


def decode_calibrated_exit(state: DecodeState, exits: CalibratedExits) -> None:
    """Generate until ``state`` is done, each token from the first confident exit head.

    ``state.stats``: ``drafted`` counts the tokens decided after the prefill and
    ``exit_layer_total`` sums the layers each one's prediction ran (L when no head passed),
    so ``mean_exit_layer`` is the mean exit layer; nothing is verified (``accepted`` = 0).
    """
    ex = state.executor
    sampling = state.options.sampling
    logits = state.prefill()
    token = int(choose_next(logits, sampling, state.generator))
    state.commit([token])
    deferred = DeferredLayers(ex, state.cache)
    while not state.done:
        deferred.add(token, state.seq_len - 1)
        passed = exits.first_passing(deferred)
        if passed is None:  # no head confident: the full model predicts this token
            deferred.advance(ex.num_layers)
            passed = Exit(ex.num_layers, ex.logits(deferred.hidden())[0, -1])
        layer, logits = passed.layer, passed.logits
        state.stats.drafted += 1
        state.stats.exit_layer_total += layer
        token = int(choose_next(logits.unsqueeze(0), sampling, state.generator))
        state.commit([token])
        deferred.drop_completed()
    state.stats.layer_forwards = deferred.layer_forwards
