"""Drafting with a subset of the model's sub-layers (KnapSpec §3, CLaSp, SWIFT, DEL).

A draft token runs the attention and MLP sub-layers a :class:`SkipPlan` keeps — a skipped
attention writes no KV, a skipped MLP is the identity — then the model's final norm and
``lm_head``. Unlike early exit, the draft's hidden states differ from the full model's in
every layer after the first skipped sub-layer, so nothing of the draft is reused:
verification drops the KV the draft wrote and runs the full model over the last committed
token and the draft (``D + 1`` positions), filling every layer's KV.
"""

from __future__ import annotations

import torch

from selfspec.decoding.drafting import DraftBuilder, check_draft_len_limit, pick_draft_token
from selfspec.decoding.speculative import DraftOutput, TargetOutput
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stats import StepStats
from selfspec.decoding.stop_rules import DraftTokenInfo, StopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan


def sublayers_run(executor: LayerExecutor, plan: SkipPlan) -> int:
    """Sub-layers one token runs under ``plan`` (``2L`` minus the skipped ones)."""
    return 2 * executor.num_layers - len(plan.skip_attention) - len(plan.skip_mlp)


class SkipPlanDrafter:
    """Drafts every token through the sub-layers of ``plan`` (a caller may change ``plan``
    between steps: KnapSpec re-optimises it).

    Args:
        executor: the model's executor.
        plan: the sub-layers to skip.
        stop_rule: decides the draft length (KnapSpec: top-1 probability < 0.7, §3.5).

    Raises:
        InvalidArgumentError: a stop rule whose longest draft exceeds the bit-exact limit.
    """

    def __init__(self, executor: LayerExecutor, plan: SkipPlan, stop_rule: StopRule) -> None:
        check_draft_len_limit(executor, stop_rule.max_draft_len)
        self.executor = executor
        self.plan = plan
        self.stop_rule = stop_rule

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft up to ``min(max_draft_len, remaining - 1)`` tokens with the plan's sub-layers."""
        ex, plan, rule = self.executor, self.plan, self.stop_rule
        sampling, eos = state.options.sampling, state.options.eos_token_ids
        rule.reset()
        draft = DraftBuilder()
        token = state.last_token()                                         # [1, 1]
        for index in range(min(rule.max_draft_len, state.remaining - 1)):
            hidden = ex.run_layers(ex.embed(token), state.positions(state.seq_len - 1 + index, 1),
                                   0, ex.num_layers, state.cache, plan)
            pick = pick_draft_token(ex.logits(hidden)[0, -1], sampling, state.generator)
            draft.append(pick, ex.num_layers)
            token = pick.token.view(1, 1)
            if rule.should_stop(DraftTokenInfo(index=index, token_id=pick.token_id,
                                               prob=pick.prob, top1_prob=pick.top1_prob,
                                               is_eos=pick.token_id in eos)):
                break
        out = draft.build(ex, sampling, None)
        out.sublayers = len(out.tokens) * sublayers_run(ex, plan)
        return out

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Drop the draft's KV, then run the full model over the last committed token and
        the draft: ``[D+1, V]`` target logits."""
        ex = self.executor
        start = state.seq_len - 1
        state.cache.truncate(start)
        ids = torch.tensor([[state.tokens[-1], *draft.tokens]], device=ex.device)
        logits = ex.forward(ids, state.positions(start, ids.shape[1]), state.cache)[0]
        return TargetOutput(logits=logits, sublayers=2 * ex.num_layers * ids.shape[1])

    def update(self, stats: StepStats) -> None:
        """Pass the verification result to the stop rule."""
        self.stop_rule.update(stats)
