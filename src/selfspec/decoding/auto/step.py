"""``auto``: each step, run the drafter predicted to give the most tokens per second.

Candidates per step (KnapSpec eq. 4 for each,
:func:`~selfspec.decoding.planning.tpt.best_draft_len`)::

    ar        1 / t_forward(1)
    ngram     E(γ) / t_forward(γ + 1)                       # free draft, when a match exists
    model d   E_d(γ) / (γ t_draft,d + t_forward(γ + 1))     # qspec, layerskip, dssd, ...

``t_forward(T)`` is the measured latency model corrected online by the forwards this
generation ran (:class:`~selfspec.decoding.planning.tpt.ForwardCosts`); ``t_draft,d`` a moving
average of drafter ``d``'s measured ms per draft token; ``E(γ)`` follows from an online per-token
acceptance estimate per drafter (and, for n-gram drafts, per match length). The best
candidate runs; a model drafter whose stop rule is a
:class:`~selfspec.decoding.planning.tpt_stop.TptStopRule` then ends its draft token by token where
the predicted tokens/s peak, given each token's confidence (up to ``max_draft_len``), any other
with the chosen ``γ`` as the cap of its own stop rule. ``ar`` wins when nothing is predicted
to pay, so ``auto`` falls back to plain decoding by construction. Every drafter is lossless
(its draft is verified by the full model), so ``auto`` is too, whatever it picks.

Each model drafter, and the n-gram drafter per kind of match, starts a generation from where
its estimates ended in the engine's last one (:class:`~selfspec.decoding.memory.EngineMemory`),
else from a prior.

A model drafter that has not run yet, or not for ``explore_every`` steps while predicted to
be within ``explore_margin`` of the best, runs once to refresh its estimates (a drafter whose
estimates only come from running it would otherwise never be tried again).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import Drafter, SpeculativeStep
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.stop_rules import StopRule
from selfspec.decoding.memory import DrafterPrior, EngineMemory
from selfspec.decoding.ngram.drafter import NgramDrafter
from selfspec.decoding.ngram.lookup import SuffixAutomaton
from selfspec.decoding.planning.tpt import (
    AcceptanceEstimate,
    ForwardCosts,
    MovingAverage,
    TptChoice,
    best_draft_len,
)
from selfspec.decoding.planning.tpt_stop import TptStopRule


def predicted_draft_token_ms(draft_ms: MovingAverage, draft_cost: float,
                             costs: ForwardCosts) -> float:
    """Predicted ms of one draft token of a model drafter: its measured average
    ``draft_ms`` once it has run, else ``draft_cost`` times a one-token forward."""
    return draft_ms.value if draft_ms.count else draft_cost * costs.forward_ms(1)


@dataclass
class ModelDrafter:
    """A drafter that runs model layers (qspec, layerskip, dssd, ...) as an ``auto``
    candidate: the method's drafter, composed (built by the method's
    :attr:`~selfspec.methods.base.MethodSpec.drafter` with its stop rule given at
    construction), run in a :class:`SpeculativeStep` of its own.

    Attributes:
        name: the method it comes from.
        drafter: its drafter; its ``stop_rule`` (required) decides where drafts end: a
            :class:`~selfspec.decoding.planning.tpt_stop.TptStopRule` ends drafts itself
            (``auto`` gives it ``max_draft_len``); any other is capped at the chosen ``γ``
            each step.
        acceptance: its per-token acceptance estimate.
        draft_ms: moving average of its ms per draft token (no observation until it has run).
        last_run: the step index it last ran at (-1: never).
        draft_cost: a draft token's time as a share of a one-token forward, assumed until
            it has run (e.g. the share of the model's weight bytes its draft reads).
        memory_key: the name its estimates are kept under in the engine's memory (``name``
            when empty).
        step: the speculative step around ``drafter`` (built from it).

    Raises:
        ValueError: a drafter without a stop rule (``auto`` could not cap its drafts).
    """

    name: str
    drafter: Drafter
    acceptance: AcceptanceEstimate
    draft_ms: MovingAverage = field(default_factory=lambda: MovingAverage(0.0))
    last_run: int = -1
    draft_cost: float = 0.5
    memory_key: str = ""
    step: SpeculativeStep = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.drafter.stop_rule is None:
            raise ValueError(f"auto's model drafter {self.name!r} has no stop rule")
        self.step = SpeculativeStep(self.drafter)

    @property
    def stop_rule(self) -> StopRule:
        """The drafter's stop rule."""
        return self.drafter.stop_rule

    def draft_token_ms(self, costs: ForwardCosts) -> float:
        """:func:`predicted_draft_token_ms` of this drafter."""
        return predicted_draft_token_ms(self.draft_ms, self.draft_cost, costs)


@dataclass(frozen=True)
class Candidate:
    """One drafter's prediction for this step."""

    name: str
    plan: TptChoice
    drafter: ModelDrafter | None = None


class AutoStep(Step):
    """The Step of ``--method auto``.

    Args:
        costs: forward-time predictions (shared with the n-gram drafter).
        ngram: the n-gram drafter, or ``None``.
        models: model drafters to choose among.
        history: where the finished text goes (the engine's suffix automaton), or ``None``.
        max_draft_len: longest draft of any drafter.
        explore_every: steps after which a model drafter predicted to be close to the best
            runs again to refresh its estimates (0: never re-explore).
        explore_margin: "close": predicted tokens/s within this fraction of the best.
        memory: where each model drafter's estimates go at the end of the generation (the
            next one starts from them), or ``None``.
    """

    def __init__(self, costs: ForwardCosts, ngram: NgramDrafter | None,
                 models: list[ModelDrafter], history: SuffixAutomaton | None = None,
                 max_draft_len: int = 16, explore_every: int = 64,
                 explore_margin: float = 0.25, memory: EngineMemory | None = None) -> None:
        self.costs = costs
        self.ngram = ngram
        self.ngram_step = None if ngram is None else SpeculativeStep(ngram)
        self.models = models
        self.history = history
        self.max_draft_len = max_draft_len
        self.explore_every = explore_every
        self.explore_margin = explore_margin
        self.memory = memory
        self._ar = ArStep()
        self._steps = 0

    def candidates(self, state: DecodeState) -> list[Candidate]:
        """Every drafter's predicted best draft length, tokens and time for this step."""
        costs = self.costs
        costs.context_len = state.seq_len
        found = [Candidate("ar", TptChoice(0, 1.0, costs.forward_ms(1)))]
        if self.ngram is not None:
            choice = self.ngram.choose(state)
            if choice.plan.draft_len > 0:
                found.append(Candidate("ngram", choice.plan))
        limit = min(self.max_draft_len, state.remaining - 1)
        if limit >= 1:
            for model in self.models:
                alpha = model.acceptance.rate(model.name)
                ms = model.draft_token_ms(costs)
                found.append(Candidate(model.name, best_draft_len([alpha] * limit, ms,
                                                                  costs.forward_ms, min_len=1),
                                       model))
        return found

    def choose(self, state: DecodeState) -> Candidate:
        """The candidate to run: the best predicted tokens/s, or a model drafter due for
        exploration."""
        found = self.candidates(state)
        best = max(found, key=lambda c: c.plan.tokens_per_s)
        for c in found:
            model = c.drafter
            if model is None or c is best:
                continue
            never = model.last_run < 0
            due = (self.explore_every and self._steps - model.last_run >= self.explore_every
                   and c.plan.tokens_per_s >= (1 - self.explore_margin) * best.plan.tokens_per_s)
            if never or due:
                return c
        return best

    def __call__(self, state: DecodeState) -> StepStats:
        choice = self.choose(state)
        if self.ngram is not None and choice.name != "ngram":
            self.ngram.discard()
        t0 = time.perf_counter()
        if choice.name == "ar":
            stats = self._ar(state)
        elif choice.name == "ngram":
            stats = self.ngram_step(state)
        else:
            model = choice.drafter
            online = isinstance(model.stop_rule, TptStopRule)
            model.stop_rule.max_draft_len = (self.max_draft_len if online
                                             else choice.plan.draft_len)
            stats = model.step(state)
            model.acceptance.update(model.name, stats.num_drafted, stats.num_accepted)
            if stats.num_drafted:
                model.draft_ms.observe(stats.draft_ms / stats.num_drafted)
            model.last_run = self._steps
        ms = (time.perf_counter() - t0) * 1e3
        if choice.name == "ar":
            self.costs.observe(1, ms)
        elif choice.name != "ngram":  # the n-gram drafter records its own forwards
            self.costs.observe(stats.num_drafted + 1, stats.verify_ms)
        self._steps += 1
        return dataclasses.replace(stats, drafter=choice.name, step_ms=ms,
                                   predicted_tokens=choice.plan.tokens,
                                   predicted_ms=choice.plan.ms)

    def finish(self, state: DecodeState) -> None:
        """Add the finished text to the engine's history; keep the estimates of each model
        drafter that ran, and the n-gram drafter's, for the next generation."""
        if self.history is not None:
            self.history.add(state.tokens)
        if self.ngram is not None:
            self.ngram.remember()
        if self.memory is not None:
            forward = max(self.costs.forward_ms(1), 1e-6)
            for model in self.models:
                if model.draft_ms.count:
                    rule = model.stop_rule
                    self.memory.drafters[model.memory_key or model.name] = DrafterPrior(
                        model.acceptance.rate(model.name), model.draft_ms.value / forward,
                        (rule.calibration.observed_rates() if isinstance(rule, TptStopRule)
                         else {}))
