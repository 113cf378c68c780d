"""Autoregressive decoding on the executor: the baseline every method must reproduce."""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.sampling import choose_next
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.executor.sync import to_host

if TYPE_CHECKING:
    from selfspec.decoding.core.history import ResidualRecorder


class ArStep(Step):
    """One full forward per token: feed the last committed token through every layer and
    commit the next one (argmax when greedy, else temperature / top-k / top-p sampling with
    the state's seeded generator).

    Args:
        recorder: optional :class:`~selfspec.decoding.core.history.ResidualRecorder` that keeps
            each step's residual stream (a re-planning Step's history, KnapSpec).
    """

    def __init__(self, recorder: ResidualRecorder | None = None) -> None:
        self.recorder = recorder

    def __call__(self, state: DecodeState) -> StepStats:
        ex = state.executor
        token = state.last_token()                                        # [1, 1]
        pos = state.seq_len - 1
        observe = (None if self.recorder is None
                   else self.recorder.observer([state.tokens[-1]], pos))
        logits = ex.forward(token, state.positions(pos, 1), state.cache, observe=observe)[:, -1]
        logits = state.process(logits)
        # The step's one device -> host copy: the chosen token.
        kept = state.commit(to_host(choose_next(logits, state.options.sampling, state.generator)),
                            logits)
        return StepStats(committed=len(kept), sublayers=2 * ex.num_layers)
