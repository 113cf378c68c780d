"""Drafting with a subset of the model's sub-layers (KnapSpec §3, CLaSp, SWIFT, DEL).

A draft token runs the attention and MLP sub-layers a :class:`SkipPlan` keeps — a skipped
attention writes no KV, a skipped MLP is the identity — then the model's final norm and
``lm_head``. The drafting loop is the shared one (:class:`ExitDrafter`); only the exit
policy and verification differ from early exit. The draft's hidden states differ from the
full model's in every layer after the first skipped sub-layer, so nothing of the draft is
reused: verification drops the KV the draft wrote and runs the full model over the last
committed token and the draft (``D + 1`` positions), filling every layer's KV. For the same
reason the draft may run on other weights than the verifier (a
:meth:`~selfspec.executor.LayerExecutor.draft_view` with int8/int4/w4a8 copies): the plan's
sub-layers on quantized weights, verified by the model's own (QSpec-style, lossless).
"""

from __future__ import annotations

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.history import ResidualRecorder
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import DraftOutput, TargetOutput
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.exits import Exit
from selfspec.decoding.drafting.stop_rules import StopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan
from selfspec.executor.sync import device_tensor


def sublayers_run(executor: LayerExecutor, plan: SkipPlan) -> int:
    """Sub-layers one token runs under ``plan`` (``2L`` minus the skipped ones)."""
    return 2 * executor.num_layers - len(plan.skip_attention) - len(plan.skip_mlp)


class SkipPlanExit:
    """Exit policy: the pending position (its embedding) runs every layer under ``plan``,
    then the model's own final norm and ``lm_head``."""

    vocab = None

    def __init__(self, executor: LayerExecutor, plan: SkipPlan) -> None:
        self.executor = executor
        self.plan = plan

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit:
        ex = self.executor
        position = torch.tensor([[deferred.position()]], device=ex.device)
        hidden = ex.run_layers(deferred.hidden(), position, 0, ex.num_layers, deferred.cache,
                               self.plan)
        # The layers it ran: a layer whose both sub-layers are skipped does not count (an
        # early exit at layer l is the plan that skips all of [l, L)).
        ran = ex.num_layers - len(self.plan.skip_attention & self.plan.skip_mlp)
        return Exit(ran, ex.logits(hidden)[0, -1])


class SkipPlanDrafter(ExitDrafter):
    """Drafts every token through the sub-layers of ``plan`` (a caller may change ``plan``
    between steps: KnapSpec re-optimises it).

    Args:
        executor: the executor drafts run on: the model's, or a
            :meth:`~selfspec.executor.LayerExecutor.draft_view` of it on quantized weights.
        plan: the sub-layers to skip.
        stop_rule: decides the draft length (KnapSpec: top-1 probability < 0.7, §3.5).
        verifier: the full model that verifies (default ``executor``; the model's own
            executor when ``executor`` is a draft view).
        recorder: optional :class:`ResidualRecorder` that keeps each verification's residual
            stream (a re-planning Step's history: KnapSpec, CLaSp).

    Raises:
        InvalidArgumentError: a stop rule whose longest draft exceeds the bit-exact limit.
    """

    def __init__(self, executor: LayerExecutor, plan: SkipPlan, stop_rule: StopRule,
                 verifier: LayerExecutor | None = None,
                 recorder: ResidualRecorder | None = None) -> None:
        super().__init__(executor, SkipPlanExit(executor, plan), stop_rule)
        self.verifier = executor if verifier is None else verifier
        self.recorder = recorder

    @property
    def plan(self) -> SkipPlan:
        """The sub-layers draft tokens skip."""
        return self.policy.plan

    @plan.setter
    def plan(self, plan: SkipPlan) -> None:
        self.policy.plan = plan

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft up to ``min(max_draft_len, remaining - 1)`` tokens with the plan's sub-layers."""
        out = super().draft(state)
        out.sublayers = len(out.tokens) * sublayers_run(self.executor, self.plan)
        return out

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """:func:`recompute_target_logits`: ``[D+1, V]`` from the full model (``verifier``)."""
        return recompute_target_logits(self.verifier, state, draft, self.recorder)


def recompute_target_logits(executor: LayerExecutor, state: DecodeState, draft: DraftOutput,
                            recorder: ResidualRecorder | None = None) -> TargetOutput:
    """Drop the KV the draft wrote, then run ``executor`` (the full model) over the last
    committed token and the draft: ``[D+1, V]`` target logits, every layer's KV filled
    (``recorder``, if given, keeps the forward's residual stream)."""
    start = state.seq_len - 1
    state.cache.truncate(start)
    fed = [state.tokens[-1], *draft.tokens]
    ids = device_tensor([fed], executor.device)  # no sync on CUDA
    observe = None if recorder is None else recorder.observer(fed, start)
    logits = executor.forward(ids, state.positions(start, ids.shape[1]), state.cache,
                              observe=observe)[0]
    return TargetOutput(logits=logits, sublayers=2 * executor.num_layers * ids.shape[1])
