"""n-gram drafts in a ragged batch: every row's draft verified in one batched forward
(:class:`BatchNgramStep`, a :class:`~selfspec.decoding.core.batch.BatchStep`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from selfspec.decoding.core.batch import pack_rows
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.verification import verify_greedy, verify_keyed, verify_sampling
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings
from selfspec.decoding.ngram.lookup import NgramProposal, SuffixAutomaton
from selfspec.decoding.planning.tpt import ForwardCosts, TptChoice
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel


def _survival(alphas: list[float]) -> list[float]:
    """``[α_1, α_1 α_2, ...]``: the probability that each draft token is accepted (all
    before it accepted), its expected gain."""
    out, survive = [], 1.0
    for alpha in alphas:
        survive *= alpha
        out.append(survive)
    return out


class BatchNgramStep:
    """n-gram drafts for every row, verified in one batched forward (lossless).

    Each row has its own :class:`~selfspec.decoding.ngram.drafter.NgramDrafter` (its prompt
    lookup index, its acceptance estimates) and, with ``history``, matches the engine's
    earlier texts. Rows are packed without padding (:meth:`LayerExecutor.run_rows`), so each
    row drafts its own number of tokens ``d_b``, chosen for the whole batch by KnapSpec eq. 4
    summed over rows::

        E(d) = Σ_b (1 + Σ_{k ≤ d_b} Π_{j ≤ k} α_{b,j}),    N(d) = Σ_b (1 + d_b)
        d*   = argmax_d E(d) / t_forward(N(d))

    where ``α_{b,j}`` is row ``b``'s acceptance estimate for its ``j``-th proposed token (its
    match's; under a grammar, forced tokens have their own) and ``t_forward(n)`` the
    latency model's time of a forward over ``n`` tokens, corrected online by the measured
    step times. For a given ``N`` the best ``d`` takes the ``N - B`` draft tokens of largest
    marginal gain ``Π_{j ≤ k} α_{b,j}`` (gains fall along a row), so one pass over the tokens
    sorted by gain finds ``d*``. At high batch a forward stops being bound by reading the weights,
    ``t_forward`` grows with every token and the step falls back to plain decoding
    (``d = 0``). A step drafts at most ``max_step_draft`` tokens over all rows: the logits of
    a verification are ``[N, V]`` floats (``N = 272`` rows of Qwen2.5's 151,936-token
    vocabulary would be 165 MB per step). Verification per row is :func:`verify_greedy`, or,
    seeded sampling, the exact match with the row's keyed choice (:func:`verify_keyed`), or,
    unseeded sampling, the rejection rule with a one-hot ``q`` (see
    :mod:`selfspec.decoding.ngram.drafter`).

    Args:
        executor: the model's executor.
        latency: the model's measured latencies (prior of the step time).
        settings: n-gram matching and draft limits.
        history: the engine's suffix automaton of earlier texts, or a function returning
            the one a row joining now drafts from (a server's per-tenant history,
            :class:`~selfspec.decoding.memory.TenantMemories`: rows of different tenants
            share the batch, each drafting from its own), or ``None``; a row's text joins
            its history when the row leaves.
        max_step_draft: draft tokens of one step over all rows, at most.
    """

    batched = True
    processes_logits = True

    def __init__(self, executor: LayerExecutor, latency: LatencyModel, settings: NgramSettings,
                 history: SuffixAutomaton | Callable[[], SuffixAutomaton] | None = None,
                 max_step_draft: int = 64) -> None:
        self.max_step_draft = max_step_draft
        self.executor = executor
        self.latency = latency
        self.settings = settings
        self.history = history
        self.costs = ForwardCosts(latency)
        self._drafters: dict[int, NgramDrafter] = {}
        self._histories: dict[int, SuffixAutomaton] = {}

    def join(self, state: DecodeState) -> None:
        """Give the row its own drafter, over the history it drafts from now."""
        history = self.history() if callable(self.history) else self.history
        if history is not None:
            self._histories[id(state)] = history
        self._drafters[id(state)] = NgramDrafter(self.executor, ForwardCosts(self.latency),
                                                 self.settings, history)

    def leave(self, state: DecodeState) -> None:
        """Drop the row's drafter; its text joins the history it drafted from."""
        self._drafters.pop(id(state), None)
        history = self._histories.pop(id(state), None)
        if history is not None:
            history.add(state.tokens)

    def _plan(self, states: list[DecodeState], proposals: list[list[int]],
              alphas: list[list[float]]) -> tuple[list[int], TptChoice]:
        """Each row's draft length ``d_b`` maximising the batch's predicted tokens per second
        (see the class docstring), and the plan's total draft tokens, expected committed
        tokens (all rows) and predicted time."""
        self.costs.context_len = sum(s.seq_len for s in states) // len(states)
        rows = len(states)
        best = TptChoice(0, float(rows), self.costs.forward_ms(rows))
        counts = [0] * rows
        best_counts = list(counts)
        gains = sorted(((gain, b)
                        for b, (prop, alpha) in enumerate(zip(proposals, alphas, strict=False))
                        for gain in _survival(alpha[:len(prop)])), key=lambda g: -g[0])
        gains = gains[: self.max_step_draft]
        tokens = float(rows)
        for drafted, (gain, b) in enumerate(gains, 1):
            counts[b] += 1
            tokens += gain
            choice = TptChoice(drafted, tokens, self.costs.forward_ms(rows + drafted))
            if choice.tokens * best.ms > best.tokens * choice.ms:
                best, best_counts = choice, list(counts)
        return best_counts, best

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        ex = self.executor
        t0 = time.perf_counter()
        proposals, alphas = [], []
        found: list[NgramProposal | None] = []
        for state in states:
            drafter = self._drafters[id(state)]
            limit = min(self.settings.max_draft_len, state.remaining - 1)
            prop = drafter.proposal(state, limit) if limit > 0 else None
            found.append(prop)
            proposals.append([] if prop is None else list(prop.tokens[:limit]))
            alphas.append([] if prop is None else drafter.alphas(prop))
        counts, plan = self._plan(states, proposals, alphas)
        drafts = [p[:n] for p, n in zip(proposals, counts, strict=False)]
        draft_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        ids, positions, lengths = pack_rows(
            states, [[s.tokens[-1], *d] for s, d in zip(states, drafts, strict=False)],
            ex.device)
        logits = ex.forward_rows(ids, positions, lengths, [s.cache for s in states])  # [N, V]
        results = []
        offset = 0
        for b, (state, draft) in enumerate(zip(states, drafts, strict=False)):
            draft_ids = torch.tensor(draft, dtype=torch.long, device=ex.device)  # [D_b]
            target = state.process(logits[offset: offset + len(draft) + 1], draft)  # [D_b+1, V]
            offset += len(draft) + 1
            sampling = state.options.sampling
            if sampling.greedy:
                result = verify_greedy(draft_ids, target)
            elif state.noise is not None:  # seeded: exact match with the keyed choice
                result = verify_keyed(draft_ids, target, sampling,
                                      state.noise_rows(0, len(draft) + 1))
            else:  # q = δ(x_i), [D_b, V]
                probs = torch.zeros(len(draft), ex.vocab_size, device=ex.device)
                probs[torch.arange(len(draft), device=probs.device), draft_ids] = 1.0
                result = verify_sampling(draft_ids, probs, target, sampling, state.generator)
            kept = state.commit(result.committed_tokens, target[: result.num_accepted + 1])
            state.cache.truncate(state.seq_len - 1)  # rejected positions go
            if draft and found[b] is not None:
                self._drafters[id(state)].record(found[b], len(draft), result.num_accepted)
            results.append((len(draft), result.num_accepted, len(kept)))
        verify_ms = (time.perf_counter() - t1) * 1e3
        self.costs.observe(len(ids), verify_ms)
        # Each row's stats carry its share of the step (times and predictions / rows), so
        # summed over rows they are the batch's, and a row's tokens / ms is the aggregate rate.
        rows = len(states)
        share = plan.tokens / rows
        draft_ms, verify_ms, predicted_ms = draft_ms / rows, verify_ms / rows, plan.ms / rows
        return [StepStats(
            num_drafted=drafted, num_accepted=accepted, committed=committed,
            verified=drafted > 0, exit_layers=(0,) * drafted,
            sublayers=2 * ex.num_layers * (drafted + 1), draft_ms=draft_ms,
            verify_ms=verify_ms, drafter="ngram" if plan.draft_len else "ar",
            step_ms=draft_ms + verify_ms, predicted_tokens=share, predicted_ms=predicted_ms)
            for drafted, accepted, committed in results]
