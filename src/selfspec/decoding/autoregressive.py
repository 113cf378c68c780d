"""Autoregressive decoding on the executor: the baseline every method must reproduce."""

from __future__ import annotations

from selfspec.decoding.sampling import choose_next
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stats import StepStats


class ArStep:
    """One full forward per token: feed the last committed token through every layer and
    commit the next one (argmax when greedy, else temperature / top-k / top-p sampling with
    the state's seeded generator)."""

    def start(self, state: DecodeState) -> None:
        """Nothing to set up."""

    def __call__(self, state: DecodeState) -> StepStats:
        ex = state.executor
        token = state.last_token()                                        # [1, 1]
        logits = ex.forward(token, state.positions(state.seq_len - 1, 1), state.cache)[:, -1]
        kept = state.commit([int(choose_next(logits, state.options.sampling, state.generator))])
        return StepStats(committed=len(kept), sublayers=2 * ex.num_layers)
