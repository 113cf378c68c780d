"""Ragged batches: several generations advanced together, each row at its own length.

The engine every method's batches run through (:func:`selfspec.api.Engine.generate_batch` and
:class:`selfspec.serving.scheduler.Scheduler`). A row is a
:class:`~selfspec.decoding.core.state.DecodeState` (its tokens, its own KV cache, its limits,
EOS and stop strings, its stats); a :class:`BatchStep` advances any set of rows by one step,
and each row commits its own number of tokens (a speculative step accepts a different prefix
per row and rolls each row's cache back on its own). Rows join after their prefill and leave
when done, so the same step serves a fixed batch (:func:`run_batch`) and a continuously
changing one (the scheduler)::

    begin(state)                              # prefill alone + the first token
    step.join(state)                          # the row's per-generation drafter state
    while rows:                               # one call = one step of every row
        for state, stats in zip(rows, step(rows)): state.stats.add(stats)
        step.leave(done_row)                  # e.g. its text joins the n-gram history

Each method's batch step sits beside its method:
:class:`~selfspec.decoding.core.autoregressive.BatchArStep` (one batched forward per token),
:class:`~selfspec.decoding.ngram.batch.BatchNgramStep` (n-gram drafts of different lengths
per row, packed without padding and verified in one forward); here is :class:`SoloRows` (any
other method: each row runs its own single-row Step in turn; correct, not faster) and
:func:`pack_rows`, the packing the batched steps share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from selfspec.decoding.core.loop import Step, check_processing
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import GenerationStats, StepStats

__all__ = ["BatchStep", "SoloRows", "begin", "pack_rows", "run_batch"]


class BatchStep(Protocol):
    """One step of every row of a ragged batch.

    Times in a row's :class:`StepStats` are its share of the batched step (the step's time
    divided by the rows), so they add up over rows to the batch's time.

    Attributes:
        batched: True when rows really share forwards (False: :class:`SoloRows`).
        processes_logits: rows may use output processing (``Step.processes_logits``).
    """

    batched: bool
    processes_logits: bool

    def join(self, state: DecodeState) -> None:
        """A row whose prefill committed its first token enters the batch."""

    def leave(self, state: DecodeState) -> None:
        """A row leaves (done or cancelled); its per-row state is dropped."""

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        """Commit ``>= 1`` token to each of ``states`` (fewer only for a row that became
        done); one :class:`StepStats` per row, in order."""


def begin(state: DecodeState) -> None:
    """Prefill ``state``'s prompt alone (its own cache) and commit the first token."""
    logits = state.process(state.prefill())  # [1, V]
    state.commit([int(state.choose_next(logits))], logits)


def run_batch(states: list[DecodeState], step: BatchStep) -> list[GenerationStats]:
    """Generate every row of ``states`` to its end with ``step``.

    Args:
        states: fresh :class:`DecodeState` rows (empty caches), any prompt lengths.
        step: the method's batch step.

    Returns:
        Each row's finished :class:`GenerationStats`, in order.

    Raises:
        RuntimeError: a step committed nothing to a row that is not done (a method bug).
        InvalidArgumentError: output processing on a method without it (before any prefill).
    """
    if any(state.processor is not None for state in states):
        for state in states:
            check_processing(step.processes_logits, state)
    for state in states:
        begin(state)
        if not state.done:
            step.join(state)
        else:
            step.leave(state)
    active = [s for s in states if not s.done]
    while active:
        before = [s.seq_len for s in active]
        for state, stats in zip(active, step(active), strict=False):
            state.stats.add(stats)
        for state, n in zip(active, before, strict=False):
            if state.seq_len == n and not state.done:
                raise RuntimeError(f"{type(step).__name__} committed no token to a row")
            if state.done:
                step.leave(state)
        active = [s for s in active if not s.done]
    return [s.finish() for s in states]


def pack_rows(states: list[DecodeState], rows: list[list[int]],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Row ``b``'s tokens ``rows[b]`` (its last committed token first) packed row after row,
    as :meth:`LayerExecutor.forward_rows` takes them.

    Args:
        states: the ``B`` rows, each with at least one committed token.
        rows: ``B`` lists of token ids, row ``b``'s first being its last committed token.
        device: where the tensors go.

    Returns:
        ``[N]`` int64 ids, ``[N]`` int64 positions (row ``b``'s from its last committed
        token's, ``seq_len - 1``) and the ``B`` row lengths (``N`` = their sum).
    """
    ids = [t for r in rows for t in r]
    positions = [s.seq_len - 1 + k for s, r in zip(states, rows, strict=False)
                 for k in range(len(r))]
    return (torch.tensor(ids, device=device), torch.tensor(positions, device=device),
            [len(r) for r in rows])


class SoloRows:
    """Any method in a batch: each row runs its own single-row Step, one row after another.

    Correct for every method (each row is exactly a single-prompt generation) but no faster
    than running the prompts in turn; the server uses it for the methods without a batched
    step so that their requests still stream side by side.

    Args:
        make_step: builds a fresh Step for one row.
    """

    batched = False

    def __init__(self, make_step: Callable[[], Step]) -> None:
        self.make_step = make_step
        self._steps: dict[int, Step] = {}
        self._supports: bool | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether the method's Step supports output processing (a Step is built once to
        ask)."""
        if self._supports is None:
            self._supports = self.make_step().processes_logits
        return self._supports

    def join(self, state: DecodeState) -> None:
        """Build and start the row's Step."""
        step = self.make_step()
        step.start(state)
        self._steps[id(state)] = step

    def leave(self, state: DecodeState) -> None:
        """Finish the row's Step (e.g. its text joins the n-gram history) and drop it."""
        step = self._steps.pop(id(state), None)
        if step is not None:
            step.finish(state)

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        return [self._steps[id(s)](s) for s in states]
