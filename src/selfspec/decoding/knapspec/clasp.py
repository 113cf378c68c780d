"""CLaSp as a Step (Chen et al. 2025, "CLaSp: In-Context Layer Skip for Self-Speculative
Decoding"; summarised in KnapSpec §2, eq. 3): self-speculative decoding whose draft skips a
fixed number ``M`` of whole layers, re-chosen during generation by a dynamic programme that
maximises the cosine similarity between the draft's and the full model's last hidden state
on the tokens of the last verification.

After every ``reoptimize_every`` steps (CLaSp: after each verification) the step:

1. takes each layer's output on the tokens committed by the last ``history_steps`` steps
   from the verification forwards that computed them (as CLaSp does;
   :class:`~selfspec.decoding.core.history.ResidualRecorder`), or, where those do not cover them
   (the first step, on the prompt's end), runs the full model read-only over them
   (:func:`~selfspec.decoding.core.history.read_history`);
2. solves CLaSp's DP — the same recurrence as KnapSpec's knapsack with every layer an item
   of weight 1 (:func:`~selfspec.decoding.planning.knapsack.solve_knapsack`), budget ``M`` — and
   takes the best set of exactly ``M`` skipped layers (fewer if pruning left no such state);
3. drafts with it (:class:`~selfspec.decoding.drafting.skip_drafter.SkipPlanDrafter`; attention and
   MLP of a skipped layer both skipped) until the draft's top-1 probability falls below 0.7
   (the dynamic draft exit KnapSpec §3.5 attributes to CLaSp).

Unlike KnapSpec, CLaSp has no latency model: it never falls back to plain decoding and its
budget is a layer count, not a time. Verification is the full model: lossless.
Not reproduced: CLaSp's "sparse persistence" and sequence-parallel DP (GPU-side speed-ups
of the re-optimisation); ``reoptimize_every`` > 1 is the CPU lever instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from selfspec.decoding.core.history import (
    CommittedWindow,
    ResidualRecorder,
    read_history,
)
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.plan_log import PlanLog, PlanRecord
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import ConfidenceStopRule
from selfspec.decoding.knapspec.governed import governed_call
from selfspec.decoding.planning.knapsack import solve_knapsack
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Observer, SkipPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerChoice:
    """One CLaSp re-optimisation.

    Attributes:
        step: the Step call it ran before (0-based).
        context_len: committed tokens at that point.
        history_tokens: tokens the DP scored.
        skipped_layers: the chosen layers (0-based), ``M`` of them unless pruned.
        similarity: mean cosine similarity of the draft's last hidden state to the full
            model's on those tokens.
        ms: wall time of the re-optimisation.
    """

    step: int
    context_len: int
    history_tokens: int
    skipped_layers: tuple[int, ...]
    similarity: float
    ms: float


@dataclass
class CLaSpConfig:
    """CLaSp's settings.

    Attributes:
        skip_layers: ``M``, whole layers every draft skips, in ``[1, L-1]``.
        reoptimize_every: steps between re-optimisations (CLaSp: 1).
        history_steps: steps whose committed tokens the DP scores (CLaSp: the last
            verification, 1).
        min_history: fewest tokens to score (early on, the end of the prompt).
        tau: similarity below which the DP prunes a state (-1: never; CLaSp does not prune).
        max_draft_len: the draft cap.
        confidence: stop drafting when the top-1 probability falls below this.
    """

    skip_layers: int
    reoptimize_every: int = 1
    history_steps: int = 1
    min_history: int = 4
    tau: float = -1.0
    max_draft_len: int = 10
    confidence: float = 0.7


class CLaSpStep(Step):
    """CLaSp (see the module docstring).

    Args:
        executor: the model's executor (it verifies).
        config: :class:`CLaSpConfig`.
        draft: the executor drafts run on: ``None`` (the model's), or a
            :meth:`~LayerExecutor.draft_view` of ``executor`` on quantized weights (the DP
            then scores the quantized layers).

    Raises:
        InvalidArgumentError: ``skip_layers`` outside ``[1, L-1]``.
    """

    def __init__(self, executor: LayerExecutor, config: CLaSpConfig,
                 draft: LayerExecutor | None = None) -> None:
        if not 1 <= config.skip_layers <= executor.num_layers - 1:
            raise InvalidArgumentError(
                f"CLaSp skips between 1 and {executor.num_layers - 1} of this model's "
                f"{executor.num_layers} layers; got {config.skip_layers}")
        self.executor = executor
        self.draft_executor = executor if draft is None else draft
        self.config = config
        rule = ConfidenceStopRule(config.confidence, max_draft_len=config.max_draft_len)
        self._recorder = ResidualRecorder.for_window(config.min_history, config.history_steps,
                                                     config.max_draft_len)
        self.drafter = SkipPlanDrafter(self.draft_executor, self._plan(_initial_layers(
            executor.num_layers, config.skip_layers)), rule, verifier=executor,
            recorder=self._recorder)
        self._speculative = SpeculativeStep(self.drafter)
        self.history: list[LayerChoice] = []
        self.plan_log = PlanLog()
        self._committed = CommittedWindow(config.history_steps)
        self._calls = 0

    @staticmethod
    def _plan(layers: frozenset[int]) -> SkipPlan:
        return SkipPlan(skip_attention=layers, skip_mlp=layers)

    def start(self, state: DecodeState) -> None:
        """A new generation: the first step optimises on the end of the prompt."""
        self.history = []
        self.plan_log.clear()
        self._committed.clear()
        self._recorder.attach(state)
        self._calls = 0

    def prefill_observer(self, state: DecodeState) -> Observer:
        """:meth:`ResidualRecorder.prefill_observer` (the first DP scores the prompt's
        end)."""
        return self._recorder.prefill_observer(state)

    def __call__(self, state: DecodeState) -> StepStats:
        plan_ms = 0.0
        if self._calls % self.config.reoptimize_every == 0:
            t0 = time.perf_counter()
            self._reoptimize(state)
            plan_ms = (time.perf_counter() - t0) * 1e3
        self._calls += 1
        return governed_call(self._speculative, state, plan_ms, self.plan_log, self._committed)

    @torch.inference_mode()
    def _reoptimize(self, state: DecodeState) -> None:
        cfg, ex = self.config, self.executor
        t0 = time.perf_counter()
        r = self._committed.tokens(cfg.min_history)
        history = self._recorder.history(ex, state, r)
        if history is None:
            history = read_history(ex, state, r)
        if history is None:
            return

        def layer(i: int, states: torch.Tensor) -> torch.Tensor:
            return history.run(self.draft_executor, state, states, i - 1, i)

        solutions = solve_knapsack(history.layer_states(), layer, [1] * ex.num_layers,
                                   cfg.tau, max_skip=cfg.skip_layers)
        if not solutions or solutions[-1].skipped_weight == 0:
            return  # pruning left no plan that skips anything: keep the current one
        best = solutions[-1]  # the largest budget reached: M unless pruned
        layers = frozenset(i - 1 for i in best.skipped)
        self.drafter.plan = self._plan(layers)
        ms = (time.perf_counter() - t0) * 1e3
        choice = LayerChoice(self._calls, state.seq_len, len(history), tuple(sorted(layers)),
                             best.similarity, ms)
        self.history.append(choice)
        self.plan_log.decide(PlanRecord(
            step=choice.step, context_len=choice.context_len, skipped_attention=len(layers),
            skipped_mlp=len(layers), draft_len=self.config.max_draft_len, planning_ms=ms,
            description=f"skip layers {list(choice.skipped_layers)} (cos {best.similarity:.3f})"))
        logger.info("clasp re-optimised at %d tokens in %.0f ms: skip layers %s (cos %.3f)",
                    state.seq_len, ms, list(choice.skipped_layers), best.similarity)


def _initial_layers(num_layers: int, count: int) -> frozenset[int]:
    """The plan before the first DP has run (or when the prompt is too short for one): the
    ``count`` layers before the last."""
    return frozenset(range(num_layers - 1 - count, num_layers - 1))
