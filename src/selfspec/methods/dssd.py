"""DSSD drafting: per-token choice of the exit head by calibrated confidence (DSSD §4.3.1).

For each draft position the heads are tried from the shallowest to the deepest; the token is
drafted by the first head whose confidence passes its calibrated threshold τ_k(ε) (§3.4.1).
Drafting stops at the buffer limit, at EOS, or when no head passes — the fallback to the full
model, which verification provides. A position that needs a deeper head than its
predecessors ran first catches their missing layers up in one batched call
(:class:`~selfspec.decoding.deferred.DeferredLayers`), so no layer ever runs twice for a
position. Verification runs the full model over the draft (only the layers each position
has not run) and keeps the longest agreeing prefix: lossless under greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfspec.decoding.deferred import DeferredLayers
from selfspec.decoding.speculative import DraftOutput, TargetOutput
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stop_rules import StepStats
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.methods.draft_vocab import DraftVocab, restricted_head
from selfspec.methods.early_exit import (
    check_draft_len_limit,
    complete_to_last_layer,
    make_draft,
    pick_draft_token,
)


@dataclass(frozen=True)
class Exit:
    """The first head whose calibrated confidence passed its threshold.

    Attributes:
        layer: its exit layer (layers ``[0, layer)`` ran).
        logits: ``[V]`` its logits for the position (``[R]`` over a reduced vocabulary's rows).
    """

    layer: int
    logits: torch.Tensor


class CalibratedExits:
    """Exit heads with their thresholds at one accuracy level ε.

    Args:
        heads: :class:`selfspec.heads.ExitHeads` (calibrated).
        epsilon: DSSD accuracy level ε in [0, 1].
        metric: confidence metric (``entropy``, ``max_prob`` or ``margin``).
        vocab: optional reduced draft vocabulary: heads score only its rows, and confidence
            is computed over those rows, so the thresholds must be those calibrated on the
            same restricted vocabulary (``draft_vocab``) for ε to hold as calibrated
            (lossless either way, since verification uses the full model).
        executor: the model's executor (needed with ``vocab``, to cache the reduced heads).
        draft_vocab: the size ``K`` that ``vocab`` was built for (required with ``vocab``):
            selects the thresholds calibrated on the K most frequent tokens.

    Raises:
        InvalidArgumentError: ε outside [0, 1], an unknown metric, ``vocab`` without
            ``executor`` or ``draft_vocab``.
        NotCalibratedError: the heads carry no calibration for ``metric`` (and ``draft_vocab``).
    """

    def __init__(self, heads, epsilon: float, metric: str, vocab: DraftVocab | None = None,
                 executor: LayerExecutor | None = None, draft_vocab: int | None = None) -> None:
        from selfspec.heads import confidence

        self._confidence = confidence
        self.metric = metric
        self.vocab = vocab
        if vocab is not None and draft_vocab is None:
            raise InvalidArgumentError("a reduced draft vocabulary needs its size draft_vocab")
        taus = heads.thresholds(epsilon, metric, draft_vocab=draft_vocab)
        calls = list(heads.heads)
        if vocab is not None:
            if executor is None:
                raise InvalidArgumentError("a reduced draft vocabulary needs the executor")
            calls = [restricted_head(executor, head, vocab) for head in heads.heads]
        # A head whose threshold is +inf never passes: skip it instead of evaluating it.
        self.exits = [(layer, head, tau) for layer, head, tau in zip(heads.layers, calls, taus)
                      if math.isfinite(tau)]

    def first_passing(self, deferred: DeferredLayers) -> Exit | None:
        """Advance the last pending position head by head; the :class:`Exit` of the first
        head whose confidence reaches its threshold, or ``None`` (no head is confident)."""
        for layer, head, tau in self.exits:
            deferred.advance(layer)
            logits = head(deferred.hidden())[0, -1]
            if float(self._confidence(logits, self.metric)) >= tau:
                return Exit(layer, logits)
        return None


class DSSDDrafter:
    """The DSSD drafter.

    Args:
        executor: the model's executor.
        exits: calibrated heads at one ε.
        max_draft_len: the draft buffer limit (DSSD uses e.g. 32).

    Raises:
        InvalidArgumentError: ``max_draft_len`` outside ``[1, row_attention_max - 1]``.
    """

    def __init__(self, executor: LayerExecutor, exits: CalibratedExits, max_draft_len: int = 32) -> None:
        check_draft_len_limit(executor, max_draft_len)
        self.executor = executor
        self.exits = exits
        self.max_draft_len = max_draft_len

    def draft(self, state: DecodeState) -> DraftOutput:
        """Draft until the buffer is full, EOS, or no head is confident enough."""
        ex = self.executor
        sampling = state.options.sampling
        eos = state.options.eos_token_ids
        deferred = DeferredLayers(ex, state.cache)
        token = state.tokens[-1]
        tokens: list[int] = []
        token_tensors: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        layers: list[int] = []
        for index in range(min(self.max_draft_len, state.remaining - 1)):
            deferred.add(token, state.seq_len - 1 + index)
            passed = self.exits.first_passing(deferred)
            if passed is None:  # fallback to the full model: verification produces this token
                break
            layer = passed.layer
            pick = pick_draft_token(passed.logits, sampling, state.generator, vocab=self.exits.vocab)
            token = pick.token_id
            tokens.append(token)
            token_tensors.append(pick.token)
            layers.append(layer)
            if pick.q is not None:
                probs.append(pick.q)
            if token in eos:
                break
        return make_draft(ex, sampling, tokens, token_tensors, probs, layers, deferred)

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        """Full-model logits ``[D+1, V]``, running only the layers each position skipped."""
        return complete_to_last_layer(self.executor, state, draft)

    def update(self, stats: StepStats) -> None:
        """DSSD has no online state: the acceptance mechanism is its adaptive budget (§4.3.1)."""
