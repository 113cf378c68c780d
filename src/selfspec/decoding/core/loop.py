"""The one generation loop (docs/design.md "The loop", "Step").

Every method runs through :func:`run`::

    logits = state.prefill()                 # 1. the prompt through every layer
    state.commit([choose_next(logits)])      # 2. the first token, from the full model
    step.start(state)                        # 3. per-generation state of the method
    while not state.done:                    # 4. EOS, max_new_tokens, context, stop strings,
        state.stats.add(step(state))         #    cancellation: all decided by state.commit
    step.finish(state)                       # 5. optional: e.g. remember the text
    state.finish()                           # 6. timings

A :class:`Step` commits at least one token per call and returns a :class:`StepStats`.
Autoregressive decoding (:class:`~selfspec.decoding.core.autoregressive.ArStep`), the speculative
step (:class:`~selfspec.decoding.core.speculative.SpeculativeStep`: drafter + stop rule +
verifier) and lossy calibrated early exit
(:class:`~selfspec.decoding.drafting.calibrated_exit.CalibratedExitStep`) are Steps; new methods
add a Step or a drafter, never a loop.
"""

from __future__ import annotations

from typing import Protocol

from selfspec.decoding.core.sampling import choose_next
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import GenerationStats, StepStats


class Step(Protocol):
    """One unit of decoding after the prefill.

    A Step object is built per generation (its adaptive state, e.g. Draft & Verify's gamma,
    lives for one generation) by a method's ``build``. A Step that re-chooses its draft during
    generation (KnapSpec, CLaSp, DEL) also has a ``plan_log``
    (:class:`~selfspec.decoding.core.plan_log.PlanLog`); :func:`run` copies its records into
    ``GenerationStats.plans``. A Step that plans on the residual stream of recent positions
    (KnapSpec, CLaSp) may have ``prefill_observer(state) -> Observer`` too: :func:`run`
    passes it to the prefill, so the prompt's end is recorded without a second pass.
    """

    def start(self, state: DecodeState) -> None:
        """Called once after the prefill committed the first token (cache holds the prompt)."""

    def __call__(self, state: DecodeState) -> StepStats:
        """Commit ``>= 1`` token to ``state`` (fewer only when ``state`` became done).

        Cache invariant on entry and exit: with ``n`` committed tokens every layer holds KV
        for positions ``[0, n-1)`` unless the Step itself defers layers (it then owns them
        until it catches them up).
        """


def _finish(step: Step, state: DecodeState) -> None:
    """Call the Step's optional ``finish(state)`` (after the last commit; the n-gram drafters
    add the finished text to the engine's history there)."""
    finish = getattr(step, "finish", None)
    if finish is not None:
        finish(state)


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
    """
    prefill_observer = getattr(step, "prefill_observer", None)
    logits = state.prefill(None if prefill_observer is None else prefill_observer(state))  # [1, V]
    state.commit([int(choose_next(logits, state.options.sampling, state.generator))])
    step.start(state)
    while not state.done:
        before = state.seq_len
        state.stats.add(step(state))
        if state.seq_len == before and not state.done:
            raise RuntimeError(f"{type(step).__name__} committed no token")
    _finish(step, state)
    stats = state.finish()
    plan_log = getattr(step, "plan_log", None)  # methods that re-choose their draft
    if plan_log is not None:
        stats.plans = plan_log.records()
    return stats
