"""The one generation loop (docs/design.md "The loop", "Step").

Every method runs through :func:`run`::

    logits = state.prefill()                 # 1. the prompt through every layer
    state.commit([state.choose_next(logits)])  # 2. the first token, from the full model
    step.start(state)                        # 3. per-generation state of the method
    while not state.done:                    # 4. EOS, max_new_tokens, context, stop strings,
        state.stats.add(step(state))         #    cancellation: all decided by state.commit
    step.finish(state)                       # 5. e.g. remember the text (default: nothing)
    state.finish()                           # 6. timings

A :class:`Step` (the base class every Step inherits; its hooks other than ``__call__``
default to no-ops) commits at least one token per call and returns a :class:`StepStats`.
Autoregressive decoding (:class:`~selfspec.decoding.core.autoregressive.ArStep`), the speculative
step (:class:`~selfspec.decoding.core.speculative.SpeculativeStep`: drafter + stop rule +
verifier) and lossy calibrated early exit
(:class:`~selfspec.decoding.drafting.calibrated_exit.CalibratedExitStep`) are Steps; new methods
add a Step or a drafter, never a loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from selfspec.decoding.core.plan_log import PlanLog
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import GenerationStats, StepStats
from selfspec.errors import InvalidArgumentError
from selfspec.executor.executor import Observer


class Step(ABC):
    """One unit of decoding after the prefill: the base class of every method's Step.

    A Step object is built per generation (its adaptive state, e.g. Draft & Verify's gamma,
    lives for one generation) by a method's ``build``. :func:`run` calls, in this order,
    :meth:`prefill_observer`, :meth:`start`, the Step itself until the state is done, and
    :meth:`finish`, then reads :attr:`plan_log`. Every hook but ``__call__`` has a no-op
    default here; a Step overrides the ones it needs:

    - ``prefill_observer(state) -> Observer``: Steps that plan on the residual stream of
      recent positions (KnapSpec, CLaSp, SpecEE) record the prompt's end during the prefill,
      without a second pass.
    - ``finish(state)``: after the last commit (the n-gram Steps and ``auto`` add the
      finished text to the engine's history there).
    - ``plan_log``: Steps that re-choose their draft during generation (KnapSpec, CLaSp,
      DEL) keep a :class:`~selfspec.decoding.core.plan_log.PlanLog`; :func:`run` copies its
      records into ``GenerationStats.plans``.

    Attributes:
        plan_log: the Step's log of draft decisions, or ``None`` (the default: a Step that
            does not re-plan).
        processes_logits: the Step chooses every token from :meth:`DecodeState.process`'d
            logits and commits them with those logits, so penalties, grammars and log
            probabilities work with it (True for every Step but lossy SpecEE, whose
            predictors pick tokens from a reduced candidate set).
    """

    plan_log: PlanLog | None = None
    processes_logits: bool = True

    def prefill_observer(self, state: DecodeState) -> Observer | None:
        """The observer :func:`run` passes to ``state.prefill`` (it sees every layer's
        residual stream over the prompt, one call per prefill chunk:
        :meth:`~selfspec.executor.LayerExecutor.prefill`), or ``None`` (the default: nothing
        to record)."""
        return None

    def start(self, state: DecodeState) -> None:  # noqa: B027 (a hook, optional)
        """Called once after the prefill committed the first token (cache holds the prompt);
        the default sets nothing up."""

    @abstractmethod
    def __call__(self, state: DecodeState) -> StepStats:
        """Commit ``>= 1`` token to ``state`` (fewer only when ``state`` became done).

        Cache invariant on entry and exit: with ``n`` committed tokens every layer holds KV
        for positions ``[0, n-1)`` unless the Step itself defers layers (it then owns them
        until it catches them up).
        """

    def finish(self, state: DecodeState) -> None:  # noqa: B027 (a hook, optional)
        """Called once after the last commit, before the timings are closed; the default
        does nothing."""


def check_processing(supported: bool, state: DecodeState) -> None:
    """Refuse output processing (penalties, grammar, logprobs) for a Step without it, before
    anything runs.

    Raises:
        InvalidArgumentError: processing is on and ``supported`` is False.
    """
    if state.processor is not None and not supported:
        raise InvalidArgumentError(
            "this method picks tokens from early-exit predictions without verification, so "
            "response_format, penalties and logprobs cannot apply to it; use a lossless "
            "method (auto, ar, ngram, layerskip, ...) or its verified form")


def run(state: DecodeState, step: Step) -> GenerationStats:
    """Generate with ``step`` until ``state`` is done.

    Args:
        state: a fresh :class:`DecodeState` (empty cache).
        step: the method's Step.

    Returns:
        The finished :class:`GenerationStats` (also ``state.stats``).

    Raises:
        RuntimeError: a Step committed nothing while generation was not done (a method bug
            that would otherwise loop forever).
        InvalidArgumentError: output processing is on and ``step`` does not support it.
    """
    check_processing(step.processes_logits, state)
    logits = state.process(state.prefill(step.prefill_observer(state)))  # [1, V]
    state.commit([int(state.choose_next(logits))], logits)
    step.start(state)
    while not state.done:
        before = state.seq_len
        state.stats.add(step(state))
        if state.seq_len == before and not state.done:
            raise RuntimeError(f"{type(step).__name__} committed no token")
    step.finish(state)
    stats = state.finish()
    if step.plan_log is not None:  # Steps that re-choose their draft
        stats.plans = step.plan_log.records()
    return stats
