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
sub-layers on quantized weights, verified by the model's own (QSpec-style, lossless; the
recompute mode of :class:`~selfspec.decoding.drafting.draft_copy.DraftCopy`). ``qspec`` is
this drafter with an early-exit plan on a draft copy (:func:`quantized_drafter`).
"""

from __future__ import annotations

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.history import ResidualRecorder
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import DraftOutput, TargetOutput
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.drafting.draft_vocab import DraftVocab
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.exits import Exit, RestrictedHead, check_exit_layer
from selfspec.decoding.drafting.stop_rules import StopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan


def sublayers_run(executor: LayerExecutor, plan: SkipPlan) -> int:
    """Sub-layers one token runs under ``plan`` (``2L`` minus the skipped ones)."""
    return 2 * executor.num_layers - len(plan.skip_attention) - len(plan.skip_mlp)


class SkipPlanExit:
    """Exit policy: the pending position (its embedding) runs every layer under ``plan``,
    then the model's own final norm and ``lm_head`` — or, with a draft vocabulary, ``head``:
    the final norm and the kept rows of ``lm_head`` only (``[R]`` logits over
    ``vocab.rows``; FR-Spec §3)."""

    def __init__(self, executor: LayerExecutor, plan: SkipPlan,
                 vocab: DraftVocab | None = None, head: RestrictedHead | None = None) -> None:
        self.executor = executor
        self.plan = plan
        self.restrict(vocab, head)

    def restrict(self, vocab: DraftVocab | None, head: RestrictedHead | None) -> None:
        """Draft over ``vocab``'s rows through ``head`` (both ``None``: the full vocabulary).

        Raises:
            ValueError: one of them without the other.
        """
        if (vocab is None) != (head is None):
            raise ValueError("a draft vocabulary needs its restricted head, and back")
        self.vocab, self.head = vocab, head

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit:
        return self.choose_fed(deferred, 1, sampling, generator)

    def choose_fed(self, deferred: DeferredLayers, fed: int, sampling: SamplingConfig,
                   generator: torch.Generator | None = None) -> Exit:
        """The exit after running the last ``fed`` pending positions (their embeddings)
        under the plan in one call: draft tokens a grammar forced were fed without a draft
        forward of their own (:meth:`ExitDrafter.draft`); the exit is the last one's."""
        ex = self.executor
        first = deferred.position(-fed)
        positions = torch.arange(first, first + fed, device=ex.device).unsqueeze(0)
        hidden = (deferred.hidden() if fed == 1
                  else torch.cat([deferred.hidden(i) for i in range(-fed, 0)], 1))
        hidden = ex.run_layers(hidden, positions, 0, ex.num_layers, deferred.cache, self.plan)
        # The layers it ran: a layer whose both sub-layers are skipped does not count (an
        # early exit at layer l is the plan that skips all of [l, L)).
        ran = ex.num_layers - len(self.plan.skip_attention & self.plan.skip_mlp)
        last = hidden[:, -1:]
        logits = ex.logits(last) if self.head is None else self.head(last)
        return Exit(ran, logits[0, -1])


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
        super().__init__(executor, SkipPlanExit(executor, plan), stop_rule, verifier)
        self.recorder = recorder

    def restrict(self, vocab: DraftVocab | None, head: RestrictedHead | None) -> None:
        """Draft over ``vocab``'s rows only, through ``head`` (:meth:`SkipPlanExit.restrict`);
        verification still scores every token."""
        self.policy.restrict(vocab, head)

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
        """``[D+1, V]`` from the full model (``verifier``): a skip-plan draft has nothing to
        reuse, so :meth:`DraftCopy.target_logits` recomputes every layer, on the model
        itself or on a copy alike."""
        return self.copy.target_logits(state, draft, recorder=self.recorder)


def exit_plan(executor: LayerExecutor, exit_layer: int | None = None) -> SkipPlan:
    """The skip plan of an early exit after layers ``[0, exit_layer)``: both sub-layers of
    every later layer skipped (``None`` or ``L``: nothing skipped).

    Raises:
        InvalidArgumentError: ``exit_layer`` outside ``[1, L]``.
    """
    layers = (executor.num_layers if exit_layer in (None, executor.num_layers)
              else check_exit_layer(executor, exit_layer))
    rest = frozenset(range(layers, executor.num_layers))
    return SkipPlan(rest, rest)


def quantized_drafter(target: LayerExecutor, draft: LayerExecutor, stop_rule: StopRule,
                      exit_layer: int | None = None, vocab: DraftVocab | None = None,
                      head: RestrictedHead | None = None) -> SkipPlanDrafter:
    """``qspec``'s drafter (QSpec, Zhao et al. 2024, §3): layers ``[0, exit_layer)``
    (default all) of the model, then its final norm and ``lm_head``, all on ``draft`` (a
    :meth:`~selfspec.executor.LayerExecutor.draft_view` of ``target``), verified by
    ``target`` with its own weights: the skip-plan drafter with :func:`exit_plan` on a draft
    copy. With ``vocab`` and ``head`` (its rows of ``draft``'s ``lm_head``), drafts score only
    those rows (FR-Spec §3).

    Raises:
        InvalidArgumentError: a bad ``exit_layer``, or a stop rule whose longest draft
            exceeds the bit-exact verification limit.
    """
    drafter = SkipPlanDrafter(draft, exit_plan(target, exit_layer), stop_rule, verifier=target)
    drafter.restrict(vocab, head)
    return drafter
