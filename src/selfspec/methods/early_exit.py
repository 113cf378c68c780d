"""Early-exit drafting with a shared KV cache (LayerSkip, Elhoushi et al. 2024, §4;
the drafter of AdaSPEED and its Draft & Verify baseline).

Draft tokens run layers ``[0, exit_layer)`` and an exit head (default: the model's own final
norm + ``lm_head``); they write KV only into those layers. Verification reuses the drafting
work: the exit-layer hidden states of the drafted positions are kept (LayerSkip's exit-query
cache) and only layers ``[exit_layer, L)`` run on them, plus layers ``[0, exit_layer)`` for the
last draft token, which the draft never fed back.
"""

from __future__ import annotations

import torch

from selfspec.decoding.sampling import logits_to_probs, sample
from selfspec.decoding.speculative import DraftOutput, TargetOutput
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stop_rules import DraftTokenInfo, StepStats, StopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Head


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


class EarlyExitDrafter:
    """Drafts with the first ``exit_layer`` layers; verification runs only the rest.

    Args:
        executor: the model's executor.
        exit_layer: layers the draft runs, in ``[1, L-1]``.
        stop_rule: decides the draft length (see :mod:`selfspec.decoding.stop_rules`).
        head: exit head ``head(hidden [B, T, H]) -> logits``; ``None`` = final norm + ``lm_head``.

    Raises:
        InvalidArgumentError: ``exit_layer`` out of range.
    """

    def __init__(self, executor: LayerExecutor, exit_layer: int, stop_rule: StopRule,
                 head: Head | None = None) -> None:
        self.executor = executor
        self.exit_layer = check_exit_layer(executor, exit_layer)
        self.stop_rule = stop_rule
        self.head = head

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft up to ``min(max_draft_len, remaining - 1)`` tokens, one early-exit forward each.

        Returns:
            :class:`DraftOutput` whose ``extra["hidden"]`` is a list of ``D`` exit-layer hidden
            states ``[1, 1, H]`` (inputs: the last committed token and draft tokens ``0..D-2``).
        """
        ex, exit_layer, rule = self.executor, self.exit_layer, self.stop_rule
        sampling = state.options.sampling
        eos = state.options.eos_token_ids
        rule.reset()
        max_len = min(rule.max_draft_len, state.remaining - 1)
        pos = state.seq_len - 1
        token = torch.tensor([[state.tokens[-1]]], device=ex.device)  # [1, 1]
        hidden_states: list[torch.Tensor] = []
        tokens: list[int] = []
        token_tensors: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for index in range(max_len):
            hidden = ex.run_layers(ex.embed(token), state.positions(pos, 1), 0, exit_layer,
                                   state.cache)  # [1, 1, H]
            hidden_states.append(hidden)
            logits = ex.logits(hidden, self.head)[0, -1].float()  # [V]
            softmax = logits.softmax(dim=-1)  # untempered, as Draft & Verify's rule uses
            if sampling.greedy:
                next_token = softmax.argmax()
            else:
                q = logits_to_probs(logits, sampling)  # [V]
                next_token = sample(q.unsqueeze(0), state.generator)[0]
                probs.append(q)
            # One host sync per draft token: id, its probability, the top-1 probability.
            tok, prob, top1 = torch.stack(
                [next_token.float(), softmax[next_token], softmax.max()]).tolist()
            tok = int(tok)
            tokens.append(tok)
            token_tensors.append(next_token)
            token = next_token.view(1, 1)
            pos += 1
            if rule.should_stop(DraftTokenInfo(index=index, token_id=tok, prob=prob,
                                               top1_prob=top1, is_eos=tok in eos)):
                break
        num = len(tokens)
        token_ids = (torch.stack(token_tensors) if token_tensors
                     else torch.empty(0, dtype=torch.long, device=ex.device))
        if sampling.greedy:
            draft_probs = None
        elif probs:
            draft_probs = torch.stack(probs)  # [D, V]
        else:
            draft_probs = torch.empty(0, ex.vocab_size, device=ex.device)
        return DraftOutput(tokens=tokens, token_ids=token_ids, probs=draft_probs,
                           exit_layers=[exit_layer] * num, layer_forwards=num * exit_layer,
                           extra={"hidden": hidden_states})

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Target logits ``[D+1, V]`` for the draft, running only what the draft did not.

        The last draft token (or, for an empty draft, the last committed token) runs layers
        ``[0, exit_layer)``; then layers ``[exit_layer, L)`` run on all ``D+1`` exit-layer
        hidden states at once.
        """
        ex, exit_layer = self.executor, self.exit_layer
        num = len(draft.tokens)
        first = state.seq_len - 1  # position of the last committed token
        last_token = draft.tokens[-1] if num else state.tokens[-1]
        last = ex.run_layers(ex.embed(torch.tensor([[last_token]], device=ex.device)),
                             state.positions(first + num, 1), 0, exit_layer, state.cache)
        hidden = torch.cat(draft.extra["hidden"] + [last], dim=1)  # [1, D+1, H]
        hidden = ex.run_layers(hidden, state.positions(first, num + 1), exit_layer,
                               ex.num_layers, state.cache)
        logits = ex.logits(hidden)[0]  # [D+1, V]
        forwards = exit_layer + (num + 1) * (ex.num_layers - exit_layer)
        return TargetOutput(logits=logits, layer_forwards=forwards)

    def update(self, stats: StepStats) -> None:
        """Pass the verification result to the stop rule (adaptive gamma)."""
        self.stop_rule.update(stats)
