"""Token trees of n-gram drafts: several continuations with distinct first tokens from the
prompt lookup and the history, verified in one ragged-batch forward (lossless).

Per step::

    branches = drafter.branches(state)                    # [main proposal, alternatives...]
    d        = plan_tree(alphas, t(N, R))                 # KnapSpec eq. 4 over branches
    rows     = [[last token, *branch_b[:d_b]] for b]      # the root duplicated per branch
    logits   = forward_rows(rows, [own cache, side caches...])
    verdict  = verify_tree(...)                           # greedy / keyed / SpecInfer rule
    the winner's KV → the sequence's cache; every other row's positions dropped

No tree attention mask: each branch is its own row of
:meth:`~selfspec.executor.LayerExecutor.forward_rows`, against its own KV cache holding the
committed prefix, so every row's logits are those of verifying that chain alone, bit for
bit (the matrix kernels are row-consistent, :mod:`selfspec.executor.row_consistency`;
attention runs per row as a chain's verification does). Branch 0 verifies in the
sequence's own cache; branch ``b > 0`` in a side cache (:class:`BranchCaches`) kept equal to
the sequence's committed prefix by copying only the positions committed since its last use.
When a side branch wins, its accepted positions are copied into the sequence's cache. When
the plan is a chain (branch 0 alone), the step is the chain step of
:class:`~selfspec.decoding.ngram.drafter.NgramStep`. Under a grammar or penalties
(``state.processor``) only chains are drafted.
"""

from __future__ import annotations

import time

import torch

from selfspec.decoding.core.batch import pack_rows
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.ngram.drafter import NgramChoice, NgramDrafter, NgramStep, proposal_key
from selfspec.decoding.ngram.lookup import NgramProposal, SuffixAutomaton
from selfspec.decoding.ngram.tree_plan import (
    TreeCosts,
    TreePlan,
    TreeSettings,
    alt_key,
    branch_alphas,
    plan_tree,
)
from selfspec.decoding.ngram.tree_verify import TreeVerdict, verify_tree
from selfspec.decoding.planning.tpt import TptChoice
from selfspec.executor import KVCache, LayerExecutor


class BranchCaches:
    """Side KV caches of one generation's branches ``b > 0``, each a copy of the sequence's
    committed prefix (plus, during a step, its branch's positions).

    Args:
        executor: the model's executor (cache geometry).
    """

    def __init__(self, executor: LayerExecutor) -> None:
        self.executor = executor
        self._caches: list[KVCache] = []
        self._valid: list[int] = []  # positions known equal to the sequence's cache

    def prefix(self, index: int, main: KVCache, length: int) -> KVCache:
        """Side cache ``index`` holding exactly ``main``'s positions ``[0, length)``: only the
        positions past what it last shared with ``main`` are copied."""
        while len(self._caches) <= index:
            self._caches.append(self.executor.new_cache(capacity=main.capacity))
            self._valid.append(0)
        cache = self._caches[index]
        valid = min(self._valid[index], length)
        cache.truncate(valid)
        if valid < length:
            keys, values = main.copy_out(valid, length)
            cache.copy_in(keys, values, valid)
        self._valid[index] = length
        return cache

    def adopt(self, index: int, main: KVCache, start: int, end: int) -> None:
        """Positions ``[start, end)`` of side cache ``index`` (its branch won) replace
        ``main``'s from ``start``; the side cache then shares ``[0, end)`` with ``main``."""
        main.truncate(start)
        if end > start:
            keys, values = self._caches[index].copy_out(start, end)
            main.copy_in(keys, values, start)
        self._valid[index] = end


class TreeNgramStep(NgramStep):
    """The n-gram step with token trees (module docstring); a chain step whenever the cost
    model predicts the chain (or plain decoding) to be faster.

    Args:
        drafter: the n-gram drafter (lookups, acceptance estimates, chain costs).
        history: where finished texts go (``None``: nowhere).
        tree: the tree settings (``max_branches >= 2`` for trees to be drafted).
    """

    def __init__(self, drafter: NgramDrafter, history: SuffixAutomaton | None,
                 tree: TreeSettings) -> None:
        super().__init__(drafter, history)
        self.tree = tree
        self.tree_costs = TreeCosts(drafter.costs, tree.row_ms)
        for rank in range(1, tree.max_branches):
            drafter.acceptance.priors.setdefault(alt_key(rank), tree.alt_prior)
        self._caches: BranchCaches | None = None

    def __call__(self, state: DecodeState) -> StepStats:
        t0 = time.perf_counter()
        plan, branches = self._choose(state)
        if plan is None:  # the drafter's pending chain choice runs
            return super().__call__(state)
        return self._tree_step(state, branches, plan, (time.perf_counter() - t0) * 1e3)

    def _choose(self, state: DecodeState) -> tuple[TreePlan | None, list[NgramProposal]]:
        """The tree to verify, or ``None`` with the chain's choice left pending in the
        drafter (no alternative, a grammar, or a chain predicted at least as fast)."""
        drafter = self.drafter
        limit = min(drafter.settings.max_draft_len, state.remaining - 1)
        branches = (drafter.branches(state, limit, self.tree.max_branches)
                    if limit > 0 and self.tree.max_branches > 1 else [])
        if len(branches) < 2:
            drafter.choose(state)
            return None, branches
        drafter.costs.context_len = state.seq_len
        plan = plan_tree(branch_alphas(drafter, branches), self.tree_costs.forward_ms,
                         self.tree.max_tokens)
        if plan.rows < 2:  # a chain: the drafter's own plan of it
            chain = TptChoice(plan.counts[0], plan.tokens, plan.ms)
            drafter.keep(NgramChoice(branches[0], chain, proposal_key(branches[0])))
            return None, branches
        return plan, branches

    def _tree_step(self, state: DecodeState, branches: list[NgramProposal], plan: TreePlan,
                   draft_ms: float) -> StepStats:
        """Verify the tree ``plan`` of ``branches``, commit the winner, update the
        estimates; ``draft_ms`` is what the lookups and the plan took."""
        ex = self.drafter.executor
        t1 = time.perf_counter()
        start = state.seq_len - 1  # the root's position
        used = [b for b, count in enumerate(plan.counts) if count or b == 0]
        drafts = [branches[b].tokens[:plan.counts[b]] for b in used]
        if self._caches is None:
            self._caches = BranchCaches(ex)
        state.cache.truncate(start)
        caches = [state.cache] + [self._caches.prefix(i, state.cache, start)
                                  for i in range(len(used) - 1)]
        ids, positions, lengths = pack_rows(
            [state] * len(used), [[state.tokens[-1], *d] for d in drafts], ex.device)
        logits = ex.forward_rows(ids, positions, lengths, caches)  # [N, V]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        targets = [logits[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        draft_ids = [torch.tensor(d, dtype=torch.long, device=ex.device) for d in drafts]
        verdict = verify_tree(draft_ids, targets, state)
        accepted = verdict.result.num_accepted
        if verdict.branch == 0:
            state.cache.truncate(start + accepted + 1)
        else:
            self._caches.adopt(verdict.branch - 1, state.cache, start, start + accepted + 1)
        kept = state.commit(verdict.result.committed_tokens,
                            targets[verdict.branch][: accepted + 1])
        verify_ms = (time.perf_counter() - t1) * 1e3
        self.tree_costs.observe(len(ids), len(used), verify_ms)
        self._record(branches, used, drafts, verdict)
        drafted = sum(len(d) for d in drafts)
        return StepStats(num_drafted=drafted, num_accepted=accepted, committed=len(kept),
                         verified=True, exit_layers=(0,) * drafted,
                         sublayers=2 * ex.num_layers * len(ids), draft_ms=draft_ms,
                         verify_ms=verify_ms, drafter="ngram-tree",
                         step_ms=draft_ms + verify_ms, predicted_tokens=plan.tokens,
                         predicted_ms=plan.ms)

    def _record(self, branches: list[NgramProposal], used: list[int],
                drafts: list[list[int]], verdict: TreeVerdict) -> None:
        """Update the acceptance estimates: branch 0 as a chain; an alternative's first
        token under its rank's key, its later tokens (when the first was accepted) under
        their kind of match."""
        drafter = self.drafter
        accepted = verdict.result.num_accepted
        for i, (b, draft) in enumerate(zip(used, drafts, strict=True)):
            won = accepted if i == verdict.branch else 0
            if not draft:
                continue
            if b == 0:
                drafter.record(branches[0], len(draft), won)
                continue
            drafter.acceptance.update(alt_key(b), 1, min(won, 1))
            if won and len(draft) > 1:
                drafter.acceptance.update(proposal_key(branches[b]), len(draft) - 1, won - 1)
