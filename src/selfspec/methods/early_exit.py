"""Early-exit drafting with a shared KV cache (LayerSkip, Elhoushi et al. 2024, §4;
the drafter of AdaSPEED and its Draft & Verify baseline).

Draft tokens run layers ``[0, exit_layer)`` and an exit head (default: the model's own final
norm + ``lm_head``); they write KV only into those layers. Verification reuses the drafting
work: the exit-layer hidden states of the drafted positions are kept (LayerSkip's exit-query
cache) and only layers ``[exit_layer, L)`` run on them, plus layers ``[0, exit_layer)`` for the
last draft token, which the draft never fed back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfspec.decoding.deferred import DeferredLayers
from selfspec.decoding.sampling import SamplingConfig, logits_to_probs, sample
from selfspec.decoding.speculative import DraftOutput, TargetOutput
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stop_rules import DraftTokenInfo, StepStats, StopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Head
from selfspec.methods.draft_vocab import DraftVocab, restricted_head


# An acceptance estimator on exit hidden states: [1, 1, H] -> [1, 1] probabilities.
Scorer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PickedToken:
    """One draft token chosen from draft logits.

    Attributes:
        token: ``[]`` int64 tensor of the token id.
        token_id: the same id as an int.
        prob: untempered softmax probability of the token (Draft & Verify's stop statistic).
        top1_prob: the largest untempered probability.
        score: the scorer's acceptance estimate, or ``None``.
        q: ``[V]`` the transformed distribution the token was sampled from (sampling only).
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
                     vocab: DraftVocab | None = None) -> PickedToken:
    """Choose a draft token from ``[V]`` draft logits (``[R]`` over ``vocab.rows`` with a
    reduced draft vocabulary): argmax when greedy, else a sample from the transformed
    distribution ``q`` (kept, as ``[V]``, for speculative sampling).

    One host sync brings the id, its probability, the top-1 probability and the score.
    """
    logits = logits.float()
    softmax = logits.softmax(dim=-1)  # [V] or [R], untempered
    q = None
    if sampling.greedy:
        index = softmax.argmax()
    else:
        q = logits_to_probs(logits, sampling)
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


def make_draft(executor: LayerExecutor, sampling: SamplingConfig, tokens: list[int],
               token_tensors: list[torch.Tensor], probs: list[torch.Tensor],
               exit_layers: list[int], deferred: DeferredLayers) -> DraftOutput:
    """Assemble a :class:`DraftOutput` whose inputs wait in ``deferred``."""
    token_ids = (torch.stack(token_tensors) if token_tensors
                 else torch.empty(0, dtype=torch.long, device=executor.device))
    if sampling.greedy:
        draft_probs = None
    elif probs:
        draft_probs = torch.stack(probs)  # [D, V]
    else:
        draft_probs = torch.empty(0, executor.vocab_size, device=executor.device)
    return DraftOutput(tokens=tokens, token_ids=token_ids, probs=draft_probs,
                       exit_layers=exit_layers, layer_forwards=deferred.layer_forwards,
                       deferred=deferred)


def check_exit_layer(executor: LayerExecutor, exit_layer: int) -> int:
    """Validate an exit layer (number of layers the draft runs).

    Raises:
        InvalidArgumentError: ``exit_layer`` outside ``[1, L-1]``.
    """
    last = executor.num_layers - 1
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= last:
        raise InvalidArgumentError(
            f"exit_layer must be an integer in [1, {last}] for this {executor.num_layers}-layer "
            f"model (the draft runs layers [0, exit_layer)); got {exit_layer!r}")
    return exit_layer


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
    return TargetOutput(logits=logits, layer_forwards=deferred.layer_forwards - before)


class EarlyExitDrafter:
    """Drafts with the first ``exit_layer`` layers; verification runs only the rest.

    Args:
        executor: the model's executor.
        exit_layer: layers the draft runs, in ``[1, L-1]``.
        stop_rule: decides the draft length (see :mod:`selfspec.decoding.stop_rules`).
        head: exit head ``head(hidden [B, T, H]) -> logits``; ``None`` = final norm + ``lm_head``.
        scorer: optional acceptance estimator ``scorer(hidden [1, 1, H]) -> [1, 1]`` in [0, 1]
            (AdaSPEED's linear probe, §II.B) for greedy decoding; its value goes to the stop
            rule as ``score``.
        sampled_scorer: the same for sampled decoding (a probe trained on the expected
            acceptance of speculative sampling). With a scorer for only one mode, decoding
            in the other mode raises :class:`InvalidArgumentError` (one probe's estimates do
            not carry over: greedy acceptance is argmax agreement, sampled acceptance is
            ``Σ min(p, q)``).
        vocab: optional reduced draft vocabulary (:mod:`selfspec.methods.draft_vocab`): the
            head scores only its rows.

    Raises:
        InvalidArgumentError: ``exit_layer`` out of range, or a stop rule whose longest draft
            exceeds :func:`check_draft_len_limit`.
    """

    def __init__(self, executor: LayerExecutor, exit_layer: int, stop_rule: StopRule,
                 head: Head | None = None, scorer: Scorer | None = None,
                 vocab: DraftVocab | None = None, sampled_scorer: Scorer | None = None) -> None:
        self.executor = executor
        self.exit_layer = check_exit_layer(executor, exit_layer)
        check_draft_len_limit(executor, stop_rule.max_draft_len)
        self.stop_rule = stop_rule
        self.head = head
        self.scorer = scorer
        self.sampled_scorer = sampled_scorer
        self.vocab = vocab
        self._restricted = None if vocab is None else restricted_head(executor, head, vocab)

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[V]`` (or ``[R]``) draft logits of the last position of ``hidden`` ``[1, T, H]``."""
        if self._restricted is not None:
            return self._restricted(hidden[:, -1:])[0, -1]
        return self.executor.logits(hidden, self.head)[0, -1]

    def _scorer(self, sampling: SamplingConfig) -> Scorer | None:
        """The acceptance estimator for this decoding mode (``None`` when unscored).

        Raises:
            InvalidArgumentError: scorers exist, but none for this mode.
        """
        if self.scorer is None and self.sampled_scorer is None:
            return None
        scorer = self.scorer if sampling.greedy else self.sampled_scorer
        if scorer is None:
            mode, flags = (("greedy", "") if sampling.greedy
                           else ("sampled", " --temperature T --top-p P"))
            raise InvalidArgumentError(
                f"this drafter has no acceptance probe for {mode} decoding at exit layer "
                f"{self.exit_layer}; train one with `selfspec heads train-probe --exit-layer "
                f"{self.exit_layer}{flags}` (with the method's --heads, if any)")
        return scorer

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft up to ``min(max_draft_len, remaining - 1)`` tokens, one early-exit forward each.

        Returns:
            :class:`DraftOutput` whose ``deferred`` holds the exit-layer hidden states
            of the inputs (the last committed token and draft tokens ``0..D-2``).
        """
        ex, exit_layer, rule = self.executor, self.exit_layer, self.stop_rule
        sampling = state.options.sampling
        scorer = self._scorer(sampling)
        eos = state.options.eos_token_ids
        rule.reset()
        max_len = min(rule.max_draft_len, state.remaining - 1)
        deferred = DeferredLayers(ex, state.cache)
        token = state.tokens[-1]
        tokens: list[int] = []
        token_tensors: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for index in range(max_len):
            deferred.add(token, state.seq_len - 1 + index)
            deferred.advance(exit_layer)
            hidden = deferred.hidden()  # [1, 1, H]
            score = None if scorer is None else scorer(hidden).reshape(())
            pick = pick_draft_token(self._draft_logits(hidden), sampling, state.generator,
                                    score, self.vocab)
            token = pick.token_id
            tokens.append(token)
            token_tensors.append(pick.token)
            if pick.q is not None:
                probs.append(pick.q)
            if rule.should_stop(DraftTokenInfo(index=index, token_id=token, prob=pick.prob,
                                               top1_prob=pick.top1_prob, is_eos=token in eos,
                                               score=pick.score)):
                break
        return make_draft(ex, sampling, tokens, token_tensors, probs,
                          [exit_layer] * len(tokens), deferred)

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Target logits ``[D+1, V]`` for the draft, running only what the draft did not.

        The last draft token (or, for an empty draft, the last committed token) runs layers
        ``[0, exit_layer)``; then layers ``[exit_layer, L)`` run on all ``D+1`` exit-layer
        hidden states at once.
        """
        return complete_to_last_layer(self.executor, state, draft)

    def update(self, stats: StepStats) -> None:
        """Pass the verification result to the stop rule (adaptive gamma)."""
        self.stop_rule.update(stats)
