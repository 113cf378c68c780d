"""The one drafting loop of every self-speculative drafter (LayerSkip, Draft & Verify,
AdaSPEED, DSSD; KnapSpec's sub-layer plans in :mod:`selfspec.decoding.drafting.skip_drafter`).

Per draft position::

    deferred.add(token, position)             # the previous token enters layer 0
    exit = policy.choose(deferred, sampling)  # run to its exit layer (FixedExit / CalibratedExits)
    if exit is None: stop                     # DSSD: no head confident, verification decides
    token = pick_draft_token(exit.logits)     # argmax, a sample from q, or (seeded) the keyed
                                              # choice on q with the target's noise
    if stop_rule.should_stop(...): stop       # constant D, p < γ, Π p < γ, buffer full, EOS

Draft tokens write KV only into the layers they ran; their hidden states stay pending in a
:class:`DeferredLayers`, and verification (:func:`complete_to_last_layer`) runs each
position through exactly the layers it skipped, batched, never repeating one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.sampling import (
    SamplingConfig,
    keyed_choice,
    logits_to_probs,
    sample,
)
from selfspec.decoding.core.speculative import DraftOutput, TargetOutput
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.draft_copy import DraftCopy
from selfspec.decoding.drafting.draft_vocab import DraftVocab
from selfspec.decoding.drafting.exits import (
    CalibratedExits,
    ExitPolicy,
    FixedExit,
    Scorer,
)
from selfspec.decoding.drafting.stop_rules import (
    BufferStopRule,
    DraftTokenInfo,
    StopRule,
)
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Head


@dataclass
class PickedToken:
    """One draft token chosen from draft logits.

    Attributes:
        token: ``[]`` int64 tensor of the token id.
        token_id: the same id as an int.
        prob: untempered softmax probability of the token (Draft & Verify's stop statistic).
        top1_prob: the largest untempered probability.
        score: the scorer's acceptance estimate, or ``None``.
        q: ``[V]`` the transformed distribution the token was sampled from (unseeded
            sampling only: seeded verification needs no ``q``).
    """

    token: torch.Tensor
    token_id: int
    prob: float
    top1_prob: float
    score: float | None
    q: torch.Tensor | None


def pick_draft_token(logits: torch.Tensor, sampling: SamplingConfig,
                     generator: torch.Generator | None,
                     score: torch.Tensor | None = None,
                     vocab: DraftVocab | None = None,
                     proposal: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> PickedToken:
    """Choose a draft token from ``[V]`` draft logits (``[R]`` over ``vocab.rows`` with a
    reduced draft vocabulary): argmax when greedy, else a sample from the transformed
    distribution ``q`` (kept, as ``[V]``, for speculative sampling), or from ``proposal``
    (``[V]`` / ``[R]``) when the exit restricts it (AdaDecode eq. 1). With ``noise`` (seeded
    sampling: the ``[V]`` position-keyed noise of the draft position) the token is the
    keyed choice ``argmax q / noise``, coupled with the target's choice at that position
    (Gumbel coupling, :mod:`selfspec.decoding.core.sampling`), and ``q`` is not kept.

    One host sync brings the id, its probability, the top-1 probability and the score.
    """
    logits = logits.float()
    softmax = logits.softmax(dim=-1)  # [V] or [R], untempered
    q = None
    if sampling.greedy:
        index = softmax.argmax()
    else:
        q = logits_to_probs(logits, sampling) if proposal is None else proposal.float()
        if noise is not None:
            index = keyed_choice(q, noise if vocab is None else noise[vocab.rows])
            q = None
        else:
            index = sample(q.unsqueeze(0), generator)[0]
    token = index if vocab is None else vocab.rows[index]
    if q is not None and vocab is not None:
        q = vocab.expand(q)
    parts = [token.float(), softmax[index], softmax.max()]
    if score is not None:
        parts.append(score.float())
    values = torch.stack(parts).tolist()
    return PickedToken(token=token, token_id=int(values[0]), prob=values[1], top1_prob=values[2],
                       score=values[3] if score is not None else None, q=q)


def forced_pick(token: int, executor: LayerExecutor, sampling: SamplingConfig) -> PickedToken:
    """A draft token the grammar forces: probability 1, and when sampling the one-hot ``q``
    it was "drawn" from (it is a function of the context, so the acceptance rule with this
    ``q`` keeps the target's distribution, as for n-gram drafts)."""
    q = None
    if not sampling.greedy and not sampling.keyed:
        q = torch.zeros(executor.vocab_size, device=executor.device)
        q[token] = 1.0
    return PickedToken(token=torch.tensor(token, device=executor.device), token_id=token,
                       prob=1.0, top1_prob=1.0, score=None, q=q)


@dataclass
class DraftBuilder:
    """Collects draft tokens one by one and assembles the :class:`DraftOutput`.

    Attributes:
        picks: the chosen tokens, in order.
        exit_layers: the exit layer of each.
    """

    picks: list[PickedToken] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)

    def append(self, pick: PickedToken, exit_layer: int) -> None:
        """Add one draft token that exited at ``exit_layer``."""
        self.picks.append(pick)
        self.exit_layers.append(exit_layer)

    def build(self, executor: LayerExecutor, sampling: SamplingConfig,
              deferred: DeferredLayers | None) -> DraftOutput:
        """The :class:`DraftOutput`, its inputs pending in ``deferred`` (if any)."""
        picks = self.picks
        token_ids = (torch.stack([p.token for p in picks]) if picks
                     else torch.empty(0, dtype=torch.long, device=executor.device))
        probs = None
        if not sampling.greedy and not sampling.keyed:
            probs = (torch.stack([p.q for p in picks]) if picks                  # [D, V]
                     else torch.empty(0, executor.vocab_size, device=executor.device))
        return DraftOutput(tokens=[p.token_id for p in picks], token_ids=token_ids, probs=probs,
                           exit_layers=list(self.exit_layers),
                           sublayers=0 if deferred is None else 2 * deferred.layer_forwards,
                           deferred=deferred)


def check_draft_len_limit(executor: LayerExecutor, max_draft_len: object) -> int:
    """Validate a longest draft: verification of ``D + 1`` positions must stay within the
    executor's per-token attention blocks (``row_attention_max``), which keep bf16
    verification bit-identical to one-token decoding.

    Raises:
        InvalidArgumentError: not an integer in ``[1, row_attention_max - 1]``.
    """
    limit = max(1, executor.row_attention_max - 1)
    if isinstance(max_draft_len, bool) or not isinstance(max_draft_len, int) or not (
            1 <= max_draft_len <= limit):
        raise InvalidArgumentError(
            f"max_draft_len must be an integer in [1, {limit}] (longer drafts would verify with "
            f"a different attention kernel and lose bf16 exactness), got {max_draft_len!r}")
    return max_draft_len


def complete_to_last_layer(executor: LayerExecutor, state: DecodeState,
                           draft: DraftOutput) -> TargetOutput:
    """Target logits ``[D+1, V]`` for a draft whose inputs wait in ``draft.deferred``.

    Feeds the last draft token (or, for an empty draft, the last committed token), then runs
    every pending position through the layers it has not run yet — batched, never repeating a
    layer a position already ran — and applies the model's final norm and ``lm_head``.
    """
    deferred = draft.deferred
    assert deferred is not None, "complete_to_last_layer needs a draft with deferred inputs"
    num = len(draft.tokens)
    before = deferred.layer_forwards
    if len(deferred) == num:  # the last draft token has not been fed yet
        deferred.add(draft.tokens[-1] if num else state.tokens[-1], state.seq_len - 1 + num)
    deferred.advance(executor.num_layers)
    logits = executor.logits(deferred.stacked())[0]  # [D+1, V]
    return TargetOutput(logits=logits, sublayers=2 * (deferred.layer_forwards - before))


class ExitDrafter:
    """Drafts token by token, each from the exit its policy chooses, until the stop rule,
    the policy (no confident exit) or the token budget ends the draft; verification runs only
    the layers each position skipped, or, for drafts on a copy of the weights, every layer
    with the model's own (:class:`~selfspec.decoding.drafting.draft_copy.DraftCopy`).

    Args:
        executor: the executor drafts run on: the model's, or a
            :meth:`~selfspec.executor.LayerExecutor.draft_view` of it (quantized copies).
        policy: where each draft token exits (:class:`FixedExit`, :class:`CalibratedExits`).
        stop_rule: decides the draft length (:mod:`selfspec.decoding.drafting.stop_rules`).
        verifier: the model that verifies (default ``executor``; the model's own executor
            when ``executor`` is a draft view).

    Attributes:
        copy: the :class:`~selfspec.decoding.drafting.draft_copy.DraftCopy` (``executor``,
            ``verifier``) that decides how drafts are verified.

    Raises:
        InvalidArgumentError: a stop rule whose longest draft exceeds
            :func:`check_draft_len_limit`.
    """

    def __init__(self, executor: LayerExecutor, policy: ExitPolicy, stop_rule: StopRule,
                 verifier: LayerExecutor | None = None) -> None:
        check_draft_len_limit(executor, stop_rule.max_draft_len)
        self.executor = executor
        self.copy = DraftCopy(executor, executor if verifier is None else verifier)
        self.policy = policy
        self.stop_rule = stop_rule

    @property
    def verifier(self) -> LayerExecutor:
        """The model that verifies (``executor`` unless drafts run on a copy)."""
        return self.copy.target

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft up to ``min(max_draft_len, remaining - 1)`` tokens.

        Returns:
            :class:`DraftOutput` whose ``deferred`` holds the hidden states of its inputs
            (the last committed token and draft tokens ``0..D-2``) at their exit layers.
        """
        sampling, policy, rule = state.options.sampling, self.policy, self.stop_rule
        eos = state.options.eos_token_ids
        rule.reset()
        deferred = DeferredLayers(self.executor, state.cache)
        draft = DraftBuilder()
        token = state.tokens[-1]
        # Under a grammar (structured output), each draft token is chosen among the tokens
        # the grammar allows after the draft so far: a forbidden one could not be accepted.
        guide = None if state.processor is None else state.processor.draft_guide()
        # A policy that can run several pending positions in one call (SkipPlanExit: qspec,
        # KnapSpec, ...) drafts the tokens the grammar forces without a draft forward each;
        # they are run together with the next draft position.
        choose_fed = getattr(policy, "choose_fed", None) if guide is not None else None
        limit = min(rule.max_draft_len, state.remaining - 1)
        index, fed = 0, 1
        while index < limit:
            deferred.add(token, state.seq_len - 1 + index)
            exit = (policy.choose(deferred, sampling, state.generator) if choose_fed is None
                    else choose_fed(deferred, fed, sampling, state.generator))
            if exit is None:  # no confident exit: verification produces this token
                break
            vocab = policy.vocab if exit.vocab is None else exit.vocab
            logits = exit.logits
            if guide is not None and exit.proposal is None:
                logits = guide.mask(logits, None if vocab is None else vocab.rows)
                if logits is None:  # nothing this exit can propose is allowed
                    break
            noise = (None if state.noise is None
                     else state.noise.row(state.seq_len + len(draft.picks)))  # its position
            pick = pick_draft_token(logits, sampling, state.generator, exit.score, vocab,
                                    exit.proposal, noise)
            token = pick.token_id
            draft.append(pick, exit.layer)
            if guide is not None:
                guide.advance(token)
            if rule.should_stop(DraftTokenInfo(index=index, token_id=token, prob=pick.prob,
                                               top1_prob=pick.top1_prob, is_eos=token in eos,
                                               score=pick.score)):
                break
            index, fed = index + 1, 1
            if choose_fed is None:
                continue
            stop = False
            for forced in guide.forced_tokens(limit - index):
                deferred.add(token, state.seq_len - 1 + index)  # run with the next position
                token, fed = forced, fed + 1
                draft.append(forced_pick(forced, self.executor, sampling), 0)
                guide.advance(forced)
                # Certain under the grammar: probability 1 for the stop rule (which keeps
                # its per-token accounting aligned with the draft).
                stop = rule.should_stop(DraftTokenInfo(index=index, token_id=forced, prob=1.0,
                                                       top1_prob=1.0, is_eos=forced in eos))
                index += 1
                if stop:
                    break
            if stop:
                break
        return draft.build(self.executor, sampling, deferred)

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Target logits ``[D+1, V]``: only the layers each position skipped
        (:func:`complete_to_last_layer`), or every layer with the verifier's weights when
        the draft ran on a copy (:meth:`DraftCopy.target_logits`)."""
        return self.copy.target_logits(state, draft, self._completed)

    def _completed(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        return complete_to_last_layer(self.executor, state, draft)

    def update(self, stats: StepStats) -> None:
        """Pass the verification result to the stop rule (adaptive gamma)."""
        self.stop_rule.update(stats)


class EarlyExitDrafter(ExitDrafter):
    """LayerSkip's self-speculative drafter (Elhoushi et al. 2024, §4), also that of Draft &
    Verify and AdaSPEED: every draft token runs layers ``[0, exit_layer)`` and one head.

    Verification reuses the drafting work: the exit-layer hidden states of the drafted
    positions are kept (LayerSkip's exit-query cache) and only layers ``[exit_layer, L)`` run
    on them, plus layers ``[0, exit_layer)`` for the last draft token.

    Args: see :class:`~selfspec.decoding.drafting.exits.FixedExit` (``executor``, ``exit_layer``,
        ``head``, ``scorer``, ``sampled_scorer``, ``vocab``, ``restricted``) and
        :class:`ExitDrafter` (``stop_rule``, ``verifier``: on a draft copy, verification
        recomputes every layer instead).

    Raises:
        InvalidArgumentError: ``exit_layer`` out of range, or a stop rule whose longest draft
            exceeds :func:`check_draft_len_limit`.
    """

    def __init__(self, executor: LayerExecutor, exit_layer: int, stop_rule: StopRule,
                 head: Head | None = None, scorer: Scorer | None = None,
                 vocab: DraftVocab | None = None, sampled_scorer: Scorer | None = None,
                 restricted=None, verifier: LayerExecutor | None = None) -> None:
        super().__init__(executor, FixedExit(executor, exit_layer, head, scorer, sampled_scorer,
                                             vocab, restricted), stop_rule, verifier)

    @property
    def exit_layer(self) -> int:
        """Layers every draft token runs."""
        return self.policy.exit_layer


class DSSDDrafter(ExitDrafter):
    """The DSSD drafter (DSSD §4.3.1): each draft token from the first calibrated exit head
    that is confident at ε; the draft ends when the buffer is full, at EOS, or when no head
    is confident (the fallback to the full model, which verification provides). A position
    that needs a deeper head than its predecessors ran first catches their missing layers up
    in one batched call, so no layer ever runs twice for a position. DSSD has no online
    state: its acceptance mechanism is the adaptive draft length.

    Args:
        executor: the executor drafts run on (the model's, or a draft copy of it).
        exits: calibrated heads at one ε.
        max_draft_len: the draft buffer limit (DSSD uses e.g. 32).
        verifier: the model that verifies (default ``executor``).
        stop_rule: the rule ending each draft (default ``BufferStopRule(max_draft_len)``;
            ``auto`` gives one wrapping it).

    Raises:
        InvalidArgumentError: ``max_draft_len`` outside ``[1, row_attention_max - 1]``.
    """

    def __init__(self, executor: LayerExecutor, exits: CalibratedExits,
                 max_draft_len: int = 32, verifier: LayerExecutor | None = None,
                 stop_rule: StopRule | None = None) -> None:
        check_draft_len_limit(executor, max_draft_len)
        super().__init__(executor, exits,
                         BufferStopRule(max_draft_len) if stop_rule is None else stop_rule,
                         verifier)
