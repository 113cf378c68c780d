"""Autoregressive decoding on the executor: the baseline every method must reproduce."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from selfspec.decoding.core.batch import pack_rows
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.executor.sync import to_host

if TYPE_CHECKING:
    from selfspec.decoding.core.history import ResidualRecorder
    from selfspec.executor import LayerExecutor


class ArStep(Step):
    """One full forward per token: feed the last committed token through every layer and
    commit the next one (argmax when greedy, else temperature / top-k / top-p sampling: with
    a seed, the position-keyed Gumbel-max choice of :mod:`selfspec.decoding.core.sampling`).

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
        kept = state.commit(to_host(state.choose_next(logits)), logits)
        return StepStats(committed=len(kept), sublayers=2 * ex.num_layers)


class BatchArStep:
    """Autoregressive decoding of a ragged batch: one forward of ``B`` tokens per step (the
    weights are read once for all rows), each row sampled with its own configuration and
    seed (its own position-keyed noise), so each row's output is the one it would have
    alone."""

    batched = True
    processes_logits = True

    def __init__(self, executor: LayerExecutor) -> None:
        self.executor = executor

    def join(self, state: DecodeState) -> None:
        """Nothing per row."""

    def leave(self, state: DecodeState) -> None:
        """Nothing per row."""

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        ex = self.executor
        t0 = time.perf_counter()
        ids, positions, lengths = pack_rows(states, [[s.tokens[-1]] for s in states], ex.device)
        logits = ex.forward_rows(ids, positions, lengths, [s.cache for s in states])  # [B, V]
        ms = (time.perf_counter() - t0) * 1e3 / len(states)  # each row's share of the step
        out = []
        for b, state in enumerate(states):
            row = state.process(logits[b:b + 1])
            token = int(state.choose_next(row))
            kept = state.commit([token], row)
            out.append(StepStats(committed=len(kept), sublayers=2 * ex.num_layers,
                                 step_ms=ms))
        return out
