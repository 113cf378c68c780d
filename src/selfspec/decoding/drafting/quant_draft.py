"""Drafting on quantized copies of the model's own weights (QSpec-style self-speculation,
Zhao et al. 2024, "QSpec: Speculative Decoding with Complementary Quantization Schemes":
the draft is the same network at lower precision; no second model).

The draft runs on :meth:`LayerExecutor.draft_view` (int8, int4 or w4a8 copies of every linear), so
its hidden states and the KV it writes are not the model's: verification drops that KV and
runs the full-precision model over the last committed token and the draft (``D + 1``
positions), as for sub-layer skip drafts. The output is exactly the full model's (greedy:
its argmax tokens; sampling: its distribution, by the usual acceptance rule).
"""

from __future__ import annotations

from selfspec.decoding.core.speculative import DraftOutput, TargetOutput
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.skip_drafter import (
    SkipPlanDrafter,
    recompute_target_logits,
)
from selfspec.decoding.drafting.stop_rules import StopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan


class RecomputedVerification:
    """Wraps a drafter whose drafts ran on other weights (a :meth:`~LayerExecutor.draft_view`)
    so that verification recomputes every layer with the model's own weights.

    Args:
        drafter: any :class:`~selfspec.decoding.drafting.exit_drafter.ExitDrafter` built on the
        view.
        target: the full-precision executor.
    """

    def __init__(self, drafter: ExitDrafter, target: LayerExecutor) -> None:
        self.drafter = drafter
        self.target = target

    @property
    def stop_rule(self) -> StopRule:
        """The wrapped drafter's stop rule."""
        return self.drafter.stop_rule

    @stop_rule.setter
    def stop_rule(self, rule: StopRule) -> None:
        self.drafter.stop_rule = rule

    def draft(self, state: DecodeState) -> DraftOutput:
        """The wrapped drafter's draft (on the quantized weights)."""
        return self.drafter.draft(state)

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """:func:`recompute_target_logits` on the full model."""
        return recompute_target_logits(self.target, state, draft)

    def update(self, stats: StepStats) -> None:
        """Pass the verification result on (adaptive stop rules)."""
        self.drafter.update(stats)


def quantized_drafter(target: LayerExecutor, fmt: str, stop_rule: StopRule,
                      exit_layer: int | None = None) -> SkipPlanDrafter:
    """Draft with layers ``[0, exit_layer)`` (default all) of the model on ``fmt`` weights
    (``"int8"`` / ``"int4"``), then the final norm and ``lm_head`` on them too.

    Raises:
        InvalidArgumentError: an unknown or unavailable format, a bad ``exit_layer``, or a stop
            rule whose longest draft exceeds the bit-exact verification limit.
    """
    from selfspec.decoding.drafting.exits import check_exit_layer

    view = target.draft_view(fmt)
    layers = (target.num_layers if exit_layer in (None, target.num_layers)
              else check_exit_layer(target, exit_layer))
    rest = frozenset(range(layers, target.num_layers))
    # A skip-plan draft on the view, verified by the target: the draft's sub-layers count.
    return SkipPlanDrafter(view, SkipPlan(rest, rest), stop_rule, verifier=target)
