"""The n-gram drafter: free drafts from prompt lookup and the engine's earlier texts, with
the draft length chosen by predicted tokens per second.

Per step::

    proposal = longest match of the context in (the context itself | earlier texts)
    α_i      = acceptance estimate for (source, match length), online
    γ        = argmax_γ E(γ) / t_forward(γ + 1)            # KnapSpec eq. 4, t_draft = 0
    draft    = proposal.tokens[:γ]                          # γ = 0: a plain decoding step

Under a grammar (structured output) the proposal is cut to what the grammar allows and
extended with the tokens it forces (:mod:`selfspec.decoding.ngram.constrained`).

The draft costs no layer; verification runs the full model over the last committed token
and the draft (``γ + 1`` positions), so the output is exactly the model's: greedy, its argmax
tokens; sampling, the draft is a point mass ``q = δ(x_i)`` (the proposal is a deterministic
function of the context), and the rejection rule with ``q`` one-hot accepts ``x_i`` with
probability ``p_i(x_i)`` and otherwise draws from ``p_i`` without ``x_i`` — exactly ``p_i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decoding.core.speculative import (
    DraftOutput,
    SpeculativeStep,
    TargetOutput,
)
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.stop_rule import StopRule
from selfspec.decoding.drafting.draft_copy import recompute_target_logits
from selfspec.decoding.memory import EngineMemory
from selfspec.decoding.ngram.constrained import FORCED_KEY, FORCED_PRIOR, constrain
from selfspec.decoding.ngram.lookup import (
    ContextIndex,
    HistoryMatcher,
    NgramProposal,
    SuffixAutomaton,
)
from selfspec.decoding.planning.tpt import (
    AcceptanceEstimate,
    ForwardCosts,
    TptChoice,
    best_draft_len,
)
from selfspec.executor import LayerExecutor
from selfspec.executor.sync import device_tensor


@dataclass(frozen=True)
class NgramSettings:
    """How the n-gram drafter looks for and sizes drafts.

    Attributes:
        max_ngram: longest n-gram prompt lookup matches.
        min_ngram: shortest match that may start a draft.
        max_draft_len: longest draft.
        min_share: stop a draft at a token whose frequency share among the matched text's
            continuations is below this.
        prior: acceptance assumed for a (source, match length) never verified yet.
    """

    max_ngram: int = 4
    min_ngram: int = 2
    max_draft_len: int = 16
    min_share: float = 0.3
    prior: float = 0.6


def _match_bucket(match_len: int) -> int:
    """Match lengths 1, 2, 3, 4-7 → themselves / 4; 8+ → 8 (acceptance grows with them)."""
    return match_len if match_len < 4 else (4 if match_len < 8 else 8)


def proposal_key(proposal: NgramProposal) -> tuple[str, int]:
    """The acceptance-estimate key of a proposal's copied tokens: (source, match bucket)."""
    return (proposal.source, _match_bucket(proposal.match_len))


@dataclass
class NgramChoice:
    """What the n-gram drafter would draft now.

    Attributes:
        proposal: the matched continuation (``None``: no match).
        plan: the draft length chosen and its predicted tokens and time.
        key: the acceptance-estimate key of the proposal.
    """

    proposal: NgramProposal | None
    plan: TptChoice
    key: tuple[str, int] | None


class NgramDrafter:
    """Drafts by prompt lookup and, with ``history``, from the engine's earlier texts.

    Args:
        executor: the model's executor (verification runs it).
        costs: predicted forward times (shared with a caller that compares drafters).
        settings: matching and sizing.
        history: the engine's suffix automaton of earlier texts, or ``None``.
        acceptance: per (source, match length) acceptance estimates (a new one by default).
        memory: the engine's memory: the estimates start from the rates the last generation
            ended with (:attr:`EngineMemory.ngram`) and go back there at :meth:`remember`;
            ``None``: from ``settings.prior`` every generation.
    """

    name = "ngram"
    #: No stop rule: the draft length is chosen before drafting (:meth:`choose`).
    stop_rule: StopRule | None = None

    def __init__(self, executor: LayerExecutor, costs: ForwardCosts, settings: NgramSettings,
                 history: SuffixAutomaton | None = None,
                 acceptance: AcceptanceEstimate | None = None,
                 memory: EngineMemory | None = None) -> None:
        self.executor = executor
        self.costs = costs
        self.settings = settings
        self.index = ContextIndex(settings.max_ngram, settings.min_ngram)
        self.matcher = None if history is None else HistoryMatcher(history)
        self.memory = memory
        self.acceptance = acceptance or AcceptanceEstimate(
            prior=settings.prior, priors=None if memory is None else memory.ngram)
        self.acceptance.priors.setdefault(FORCED_KEY, FORCED_PRIOR)
        self._pending: NgramChoice | None = None
        self._last: NgramProposal | None = None  # the proposal of the last draft

    def proposal(self, state: DecodeState, max_len: int) -> NgramProposal | None:
        """The better of the prompt-lookup and history matches after ``state.tokens``
        (longer match first, then the longer proposal), or ``None``; under a grammar, cut to
        its valid prefix and extended with forced tokens, or the forced tokens alone
        (:func:`~selfspec.decoding.ngram.constrained.constrain`)."""
        self.index.extend(state.tokens[len(self.index):])
        s = self.settings
        found = [self.index.propose(max_len, s.min_share)]
        if self.matcher is not None and len(self.matcher.automaton):
            self.matcher.sync(state.tokens)
            found.append(self.matcher.propose(max_len, s.min_ngram, s.min_share))
        found = sorted((p for p in found if p is not None),
                       key=lambda p: (p.match_len, len(p.tokens)), reverse=True)
        return constrain(found, state.processor, max_len)

    def branches(self, state: DecodeState, max_len: int,
                 max_branches: int) -> list[NgramProposal]:
        """The candidates of a token tree (:mod:`selfspec.decoding.ngram.tree`): the
        :meth:`proposal` first, then up to ``max_branches - 1`` continuations with other
        first tokens from prompt lookup and the history (longer match first, then the more
        frequent first token). Only the proposal under a grammar (its forced tokens are one
        chain); ``[]`` without a match."""
        main = self.proposal(state, max_len)
        if main is None or max_branches < 2 or state.processor is not None:
            return [] if main is None else [main]
        s = self.settings
        alts = self.index.branches(max_len, max_branches, s.min_share)
        if self.matcher is not None and len(self.matcher.automaton):
            alts += self.matcher.branches(max_len, s.min_ngram, max_branches, s.min_share)
        alts.sort(key=lambda p: (p.match_len, p.shares[0]), reverse=True)
        out, firsts = [main], {main.tokens[0]}
        for alt in alts:
            if len(out) < max_branches and alt.tokens[0] not in firsts:
                out.append(alt)
                firsts.add(alt.tokens[0])
        return out

    def alphas(self, proposal: NgramProposal) -> list[float]:
        """Each proposed token's estimated acceptance (given the ones before it): the copied
        tokens' by their key, forced tokens' by :data:`FORCED_KEY`."""
        copied = [self.acceptance.rate(proposal_key(proposal))] * proposal.copied
        return copied + [self.acceptance.rate(FORCED_KEY)] * proposal.forced

    def record(self, proposal: NgramProposal, drafted: int, accepted: int) -> None:
        """Update the estimates with a verified draft of ``proposal``'s first ``drafted``
        tokens, ``accepted`` of them accepted: the copied part under its key, the forced
        part under :data:`FORCED_KEY` (only when every copied token was accepted: a forced
        token after a rejected one was never judged)."""
        copied = min(drafted, proposal.copied)
        if copied:
            self.acceptance.update(proposal_key(proposal), copied, min(accepted, copied))
        if drafted > copied and accepted >= copied:
            self.acceptance.update(FORCED_KEY, drafted - copied, accepted - copied)

    def choose(self, state: DecodeState) -> NgramChoice:
        """The proposal and the draft length maximising predicted tokens per second
        (0 when drafting is not predicted to pay). Kept for the next :meth:`draft`."""
        limit = min(self.settings.max_draft_len, state.remaining - 1)
        proposal = self.proposal(state, limit) if limit > 0 else None
        self.costs.context_len = state.seq_len
        if proposal is None:
            choice = NgramChoice(None, TptChoice(0, 1.0, self.costs.forward_ms(1)), None)
        else:
            plan = best_draft_len(self.alphas(proposal), 0.0, self.costs.forward_ms)
            choice = NgramChoice(proposal, plan, proposal_key(proposal))
        self._pending = choice
        return choice

    def keep(self, choice: NgramChoice) -> None:
        """Draft ``choice`` at the next :meth:`draft` (a caller planned it, e.g. the token
        tree step's chain)."""
        self._pending = choice

    def discard(self) -> None:
        """Forget the choice of :meth:`choose` (a caller ran another drafter instead)."""
        self._pending = None

    def draft(self, state: DecodeState) -> DraftOutput:
        """The first ``γ`` tokens of the chosen proposal (:meth:`choose` if not called)."""
        choice = self._pending if self._pending is not None else self.choose(state)
        self._pending = None
        gamma = choice.plan.draft_len
        tokens = [] if choice.proposal is None else choice.proposal.tokens[:gamma]
        self._last = choice.proposal if tokens else None
        ids = device_tensor(tokens, self.executor.device)  # no sync on CUDA
        probs = None
        sampling = state.options.sampling
        if not sampling.greedy and not sampling.keyed:  # q = δ(x_i), [D, V]
            probs = torch.zeros(len(tokens), self.executor.vocab_size, device=self.executor.device)
            probs[torch.arange(len(tokens), device=probs.device), ids] = 1.0
        return DraftOutput(tokens=tokens, token_ids=ids, probs=probs,
                           exit_layers=[0] * len(tokens))

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """The full model over the last committed token and the draft: ``[D+1, V]``."""
        return recompute_target_logits(self.executor, state, draft)

    def update(self, stats: StepStats) -> None:
        """Update the acceptance estimates of the drafted match and the forward costs."""
        if self._last is not None:
            self.record(self._last, stats.num_drafted, stats.num_accepted)
        self.costs.observe(stats.num_drafted + 1, stats.verify_ms)

    def remember(self) -> None:
        """Keep the acceptance of every kind of match drafted in this generation in the
        engine's memory (the next generation's priors); nothing without a memory."""
        if self.memory is not None:
            self.memory.ngram.update(self.acceptance.observed_rates())


class NgramStep(SpeculativeStep):
    """The speculative step with an :class:`NgramDrafter`; at the end of the generation the
    finished text (prompt + output) joins the engine's history, when it keeps one.

    Args:
        drafter: the n-gram drafter.
        history: where finished texts go (``None``: nowhere).
    """

    def __init__(self, drafter: NgramDrafter, history: SuffixAutomaton | None) -> None:
        super().__init__(drafter)
        self.history = history

    def finish(self, state: DecodeState) -> None:
        """Add ``state.tokens`` to the history; keep the drafter's acceptance estimates in
        the engine's memory."""
        if self.history is not None:
            self.history.add(state.tokens)
        self.drafter.remember()
