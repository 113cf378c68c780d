"""Where a token's prediction leaves the model: exit policies shared by every early-exit
drafter and by lossy early exit.

A policy advances the last pending position of a :class:`DeferredLayers` to the layer it
exits at and returns that exit's logits:

- :class:`FixedExit` — always layer ``exit_layer`` with one head (LayerSkip, Elhoushi et al.
  2024, §4; Draft & Verify; AdaSPEED, whose linear probe scores the exit, §II.B).
- :class:`CalibratedExits` — the first of several exit heads, shallowest first, whose
  confidence reaches its calibrated threshold τ_k(ε) (DSSD §3.4.1, §4.3.1); ``None`` when no
  head is confident.
- :class:`~selfspec.decoding.adadecode.threshold_exits.ThresholdExits` — the first head whose
  prediction passes γ (AdaDecode eq. 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.drafting.draft_vocab import DraftVocab, restricted_head
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Head

# An acceptance estimator on exit hidden states: [1, 1, H] -> [1, 1] probabilities.
Scorer = Callable[[torch.Tensor], torch.Tensor]
# A head restricted to a draft vocabulary: [B, T, H] -> [B, T, R].
RestrictedHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Exit:
    """Where one position's prediction left the model.

    Attributes:
        layer: its exit layer (layers ``[0, layer)`` ran).
        logits: ``[V]`` the exit's logits for the position (``[R]`` over a reduced draft
            vocabulary's rows).
        score: ``[]`` an acceptance-probability estimate (AdaSPEED's probe), or ``None``.
        proposal: ``[V]`` (``[R]``) the distribution a sampled draft token must be drawn from
            when it is not ``logits``' transformed distribution (AdaDecode eq. 1 restricts it
            to the tokens above γ), or ``None``.
        vocab: the rows ``logits`` range over when they are this exit's own (SpecEE's ``k``
            candidates, ascending), overriding the policy's ``vocab``; ``None``: the
            policy's.
    """

    layer: int
    logits: torch.Tensor
    score: torch.Tensor | None = None
    proposal: torch.Tensor | None = None
    vocab: DraftVocab | None = None


class ExitPolicy(Protocol):
    """Chooses the exit of the last pending position.

    Attributes:
        vocab: the reduced draft vocabulary the logits range over, or ``None`` (all ``V``).
    """

    vocab: DraftVocab | None

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit | None:
        """Advance ``deferred``'s last position to its exit layer; its :class:`Exit`, or
        ``None`` when the policy declines (the full model must predict it). ``generator`` is
        the generation's sampling generator (for policies whose exit decision is random)."""


def check_exit_layer(executor: LayerExecutor, exit_layer: object) -> int:
    """Validate an exit layer (number of layers the draft runs).

    Raises:
        InvalidArgumentError: ``exit_layer`` outside ``[1, L-1]``.
    """
    last = executor.num_layers - 1
    if (isinstance(exit_layer, bool) or not isinstance(exit_layer, int)
            or not 1 <= exit_layer <= last):
        raise InvalidArgumentError(
            f"exit_layer must be an integer in [1, {last}] for this {executor.num_layers}-layer "
            f"model (the draft runs layers [0, exit_layer)); got {exit_layer!r}")
    return exit_layer


class FixedExit:
    """Exit at ``exit_layer`` with one head.

    Args:
        executor: the model's executor.
        exit_layer: layers run, in ``[1, L-1]``.
        head: exit head ``head(hidden [B, T, H]) -> logits``; ``None`` = final norm + ``lm_head``.
        scorer: acceptance estimator ``scorer(hidden [1, 1, H]) -> [1, 1]`` in [0, 1] for
            greedy decoding (AdaSPEED's linear probe, §II.B).
        sampled_scorer: the same for sampled decoding (trained on ``Σ min(p, q)``). With a
            scorer for only one mode, the other mode raises :class:`InvalidArgumentError`:
            greedy acceptance is argmax agreement, sampled acceptance is ``Σ min(p, q)``, and
            one probe's estimates do not carry over.
        vocab: optional reduced draft vocabulary: the head scores only its rows.
        restricted: ``head`` restricted to ``vocab`` if the caller already built it.

    Raises:
        InvalidArgumentError: ``exit_layer`` out of range.
    """

    def __init__(self, executor: LayerExecutor, exit_layer: int, head: Head | None = None,
                 scorer: Scorer | None = None, sampled_scorer: Scorer | None = None,
                 vocab: DraftVocab | None = None, restricted: RestrictedHead | None = None) -> None:
        self.executor = executor
        self._exit_layer = check_exit_layer(executor, exit_layer)
        self.head = head
        self.scorer = scorer
        self.sampled_scorer = sampled_scorer
        self.vocab = vocab
        if vocab is not None and restricted is None:
            restricted = restricted_head(executor, head, vocab)
        self._restricted = restricted

    @property
    def exit_layer(self) -> int:
        """Layers run, in ``[1, L-1]``. Settable between drafts (DEL re-chooses it) when the
        exit uses the model's own final norm + ``lm_head`` and no probe.

        Raises:
            InvalidArgumentError: (setting) out of range, or an exit head or probe is
                attached: those were trained for one layer.
        """
        return self._exit_layer

    @exit_layer.setter
    def exit_layer(self, exit_layer: int) -> None:
        if self.head is not None or self.scorer is not None or self.sampled_scorer is not None:
            raise InvalidArgumentError(
                f"this exit's head or probe was trained for layer {self._exit_layer}; build a "
                "new exit to move it (only the model's own lm_head fits every layer)")
        self._exit_layer = check_exit_layer(self.executor, exit_layer)

    def scorer_for(self, sampling: SamplingConfig) -> Scorer | None:
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

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit:
        """Run the last pending position to ``exit_layer``; its logits and probe score."""
        scorer = self.scorer_for(sampling)
        deferred.advance(self.exit_layer)
        hidden = deferred.hidden()  # [1, 1, H]
        if self._restricted is not None:
            logits = self._restricted(hidden)[0, -1]
        else:
            logits = self.executor.logits(hidden, self.head)[0, -1]
        score = None if scorer is None else scorer(hidden).reshape(())
        return Exit(self.exit_layer, logits, score)


class CalibratedExits:
    """Exit heads with their thresholds at one accuracy level ε (DSSD §3.4).

    Args:
        heads: calibrated :class:`selfspec.heads.ExitHeads`.
        epsilon: DSSD accuracy level ε in [0, 1].
        metric: confidence metric (``entropy``, ``max_prob`` or ``margin``).
        vocab: optional reduced draft vocabulary: heads score only its rows, and confidence
            is computed over those rows, so the thresholds must be those calibrated on the
            same restricted vocabulary (``draft_vocab``) for ε to hold as calibrated
            (lossless either way, since verification uses the full model).
        executor: the model's executor (needed with ``vocab`` to restrict the heads).
        draft_vocab: the size ``K`` that ``vocab`` was built for (required with ``vocab``):
            selects the thresholds calibrated on the K most frequent tokens.
        restricted: the heads already restricted to ``vocab`` (one per head), if the caller
            keeps them across generations.

    Raises:
        InvalidArgumentError: ε outside [0, 1], an unknown metric, ``vocab`` without
            ``executor`` or ``draft_vocab``.
        NotCalibratedError: the heads carry no calibration for ``metric`` (and ``draft_vocab``).
    """

    def __init__(self, heads, epsilon: float, metric: str, vocab: DraftVocab | None = None,
                 executor: LayerExecutor | None = None, draft_vocab: int | None = None,
                 restricted: Sequence[RestrictedHead] | None = None) -> None:
        from selfspec.heads import confidence

        self._confidence = confidence
        self.metric = metric
        self.vocab = vocab
        if vocab is not None and draft_vocab is None:
            raise InvalidArgumentError("a reduced draft vocabulary needs its size draft_vocab")
        taus = heads.thresholds(epsilon, metric, draft_vocab=draft_vocab)
        calls = list(heads.heads)
        if vocab is not None:
            if restricted is None:
                if executor is None:
                    raise InvalidArgumentError("a reduced draft vocabulary needs the executor")
                restricted = [restricted_head(executor, head, vocab) for head in heads.heads]
            calls = list(restricted)
        # A head whose threshold is +inf never passes: skip it instead of evaluating it.
        self.exits = [(layer, head, tau) for layer, head, tau in zip(heads.layers, calls, taus)
                      if math.isfinite(tau)]

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig | None = None,
               generator: torch.Generator | None = None) -> Exit | None:
        """Advance the last pending position head by head; the :class:`Exit` of the first
        head whose confidence reaches its threshold, or ``None`` (no head is confident)."""
        for layer, head, tau in self.exits:
            deferred.advance(layer)
            logits = head(deferred.hidden())[0, -1]
            if float(self._confidence(logits, self.metric)) >= tau:
                return Exit(layer, logits)
        return None
