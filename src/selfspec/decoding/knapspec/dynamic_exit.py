"""DEL, the context-aware dynamic exit layer (Zarch et al. 2025, as summarised in KnapSpec §2,
eq. 2 and §5): LayerSkip-style early-exit self-speculative decoding whose exit layer ℓ and
speculation length γ are re-chosen during generation by maximising Tokens-per-Layer

    TPL(ℓ, γ) = (1 − α_ℓ^{γ+1}) / (1 − α_ℓ) · 1 / (γ·ℓ + L)    ((γ+1)/(γℓ+L) at α_ℓ = 1)

the expected tokens per verification (eq. 1) over the layers run for them: γ drafts of ℓ
layers and one verification of ``L``. Plain decoding scores ``1 / L``. As in the paper, TPL
counts decoder layers loaded (one pass verifies all γ + 1 positions), and a draft token's
``lm_head`` is free to it: on small models with large vocabularies the head costs several
layers, so shallow exits look cheaper than they are.

The draft is the first ℓ layers and the model's own final norm + ``lm_head``
(:class:`~selfspec.decoding.drafting.exit_drafter.EarlyExitDrafter`, ``head=None``); verification
reuses the drafted layers and is the full model: lossless. Drafting also stops when the draft's
top-1 probability falls below 0.7 (DEL's dynamic draft exit,
:class:`~selfspec.decoding.drafting.stop_rules.ConfidenceStopRule`).

α_ℓ comes from *shadow tokens*: for recently committed positions, the token the model's own
``lm_head`` predicts from the layer-ℓ hidden state, compared with the full model's greedy
token there. Every ``refresh_every`` steps the step scores the tokens committed by the last
``history_steps`` steps (at least ``min_history``; early on the end of the prompt), blends
each α_ℓ with its previous estimate (``smoothing``), and picks the best (ℓ, γ) over
``num_candidates`` exit layers spread over ``[1, L-1]`` and ``γ in [1, max_draft_len]``;
when nothing beats ``1 / L`` it decodes plainly until the next refresh.

Departure from the paper: DEL caches the hidden states that drafting and verification compute
anyway. Here the shadow tokens come from one read-only forward over the last steps'
committed tokens every ``refresh_every`` steps
(:func:`~selfspec.decoding.core.history.read_history`), because the executor's deferred-layer
batching does not expose every layer's state of every position. Its cost, an extra forward of
~``r`` tokens per refresh, is charged to the step's ``draft_ms``. α_ℓ measures greedy
agreement also when sampling (the acceptance rule then differs, losslessness does not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.history import CommittedWindow, read_history
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.plan_log import PlanLog, PlanRecord
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import ConfidenceStopRule
from selfspec.decoding.knapspec.governed import governed_call
from selfspec.decoding.planning.knapsack import tokens_per_time
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor

logger = logging.getLogger(__name__)


@dataclass
class DELConfig:
    """DEL's settings.

    Attributes:
        refresh_every: steps between re-estimates of α_ℓ and re-choices of (ℓ, γ), >= 1.
        history_steps: steps whose committed tokens are scored, >= 1.
        min_history: fewest tokens scored (early steps commit few; at the first step the
            history is the end of the prompt); a refresh with fewer available is skipped.
        num_candidates: candidate exit layers, spread evenly over ``[1, L-1]``; 0 or
            ``>= L-1``: every layer.
        max_draft_len: the largest γ searched (and the draft cap).
        confidence: stop drafting when the draft's top-1 probability falls below this.
        smoothing: weight of the previous estimate in an exponential moving average of α_ℓ
            across refreshes, in ``[0, 1)``; 0 = only the latest window.
    """

    refresh_every: int = 4
    history_steps: int = 4
    min_history: int = 8
    num_candidates: int = 8
    max_draft_len: int = 10
    confidence: float = 0.7
    smoothing: float = 0.5


@dataclass(frozen=True)
class ExitChoice:
    """The (exit layer, draft length) of highest TPL, with its prediction.

    Attributes:
        exit_layer: ℓ, layers the draft runs; ``None``: plain decoding beats every draft.
        draft_len: γ (0 with plain decoding).
        alpha: α_ℓ at the chosen layer (0 with plain decoding).
        tpl: the predicted tokens per layer run.
        ar_tpl: plain decoding's ``1 / L``.
    """

    exit_layer: int | None
    draft_len: int
    alpha: float
    tpl: float
    ar_tpl: float


@dataclass(frozen=True)
class ExitDecision:
    """One refresh of DEL's choice.

    Attributes:
        step: the Step call it ran before (0-based).
        context_len: committed tokens at that point.
        history_tokens: ``r``, the positions whose shadow tokens were scored.
        alphas: exit layer → smoothed α_ℓ.
        choice: the :class:`ExitChoice` made.
        ms: wall time of the refresh (the history forward included).
    """

    step: int
    context_len: int
    history_tokens: int
    alphas: dict[int, float]
    choice: ExitChoice
    ms: float


def tokens_per_layer(alpha: float, draft_len: int, exit_layer: int, num_layers: int) -> float:
    """DEL's TPL (KnapSpec eq. 2): expected tokens per verification over the layers run,
    ``(1 - α^{γ+1}) / ((1 - α)(γ ℓ + L))`` (``(γ + 1) / (γ ℓ + L)`` at α = 1): KnapSpec's
    tokens-per-time with layer counts as costs."""
    return tokens_per_time(alpha, draft_len, float(exit_layer), float(num_layers))


def choose_exit(alphas: Mapping[int, float], num_layers: int, max_draft_len: int) -> ExitChoice:
    """Grid search of TPL over exit layers × ``γ in [1, max_draft_len]`` (KnapSpec §2 eq. 2,
    DEL).

    Args:
        alphas: exit layer ℓ (in ``[1, L-1]``) → estimated acceptance rate α_ℓ in ``[0, 1]``.
        num_layers: L.
        max_draft_len: the largest γ, >= 1.

    Returns:
        The best :class:`ExitChoice`; ties go to the shallower layer, then the shorter draft.
        ``exit_layer`` is ``None`` when no (ℓ, γ) strictly beats plain decoding's ``1 / L``.

    Raises:
        ValueError: a layer outside ``[1, L-1]``, an α outside ``[0, 1]``, or
            ``max_draft_len < 1``.
    """
    if max_draft_len < 1:
        raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
    ar_tpl = 1.0 / num_layers
    best = ExitChoice(None, 0, 0.0, ar_tpl, ar_tpl)
    for layer in sorted(alphas):
        alpha = alphas[layer]
        if not 1 <= layer < num_layers:
            raise ValueError(f"exit layer {layer} outside [1, {num_layers - 1}]")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha at layer {layer} must be in [0, 1], got {alpha}")
        for gamma in range(1, max_draft_len + 1):
            tpl = tokens_per_layer(alpha, gamma, layer, num_layers)
            if tpl > best.tpl:
                best = ExitChoice(layer, gamma, alpha, tpl, ar_tpl)
    return best


def candidate_layers(num_layers: int, num_candidates: int) -> list[int]:
    """``num_candidates`` exit layers spread evenly over ``[1, L-1]``, the deepest (``L-1``)
    included; 0 or ``>= L-1``: every layer ``1 .. L-1``."""
    last = num_layers - 1
    if num_candidates <= 0 or num_candidates >= last:
        return list(range(1, last + 1))
    return sorted({max(1, round((k + 1) * last / num_candidates)) for k in range(num_candidates)})


class DELStep(Step):
    """DEL as a Step (see the module docstring).

    Args:
        executor: the model's executor (at least 2 layers).
        config: :class:`DELConfig`.

    Raises:
        InvalidArgumentError: a setting out of range, or a 1-layer model (no exit layer).
    """

    def __init__(self, executor: LayerExecutor, config: DELConfig | None = None) -> None:
        self.executor = executor
        self.config = config or DELConfig()
        _check_config(self.config)
        if executor.num_layers < 2:
            raise InvalidArgumentError("DEL drafts with the first layers of the model and "
                                       "needs at least 2 layers")
        self.layers = candidate_layers(executor.num_layers, self.config.num_candidates)
        rule = ConfidenceStopRule(self.config.confidence, max_draft_len=self.config.max_draft_len)
        self.drafter = EarlyExitDrafter(executor, self.layers[-1], rule, head=None)
        self._speculative = SpeculativeStep(self.drafter)
        self._ar = ArStep()
        self.history: list[ExitDecision] = []
        self.plan_log = PlanLog()
        self._committed = CommittedWindow(self.config.history_steps)
        self._alphas: dict[int, float] = {}
        self._calls = 0
        self._speculate = False

    def start(self, state: DecodeState) -> None:
        """A new generation: forget every estimate; the first step chooses from the end of
        the prompt (plain decoding until a refresh has scored enough tokens)."""
        self.history = []
        self.plan_log.clear()
        self._committed.clear()
        self._alphas = {}
        self._calls = 0
        self._speculate = False

    def __call__(self, state: DecodeState) -> StepStats:
        refresh_ms = 0.0
        if self._calls % self.config.refresh_every == 0:
            t0 = time.perf_counter()
            self._refresh(state)
            refresh_ms = (time.perf_counter() - t0) * 1e3
        self._calls += 1
        step = self._speculative if self._speculate else self._ar
        return governed_call(step, state, refresh_ms, self.plan_log, self._committed)

    @torch.inference_mode()
    def _refresh(self, state: DecodeState) -> None:
        cfg, ex = self.config, self.executor
        t0 = time.perf_counter()
        history = read_history(ex, state, self._committed.tokens(cfg.min_history))
        if history is None or len(history) < cfg.min_history:
            logger.debug("del skips a refresh at %d tokens: too little history", state.seq_len)
            return
        layer_states = history.layer_states()
        hidden = torch.stack([layer_states[layer] for layer in self.layers])     # [C, r, d]
        shadow = ex.logits(hidden).argmax(-1)                                      # [C, r]
        window = (shadow == history.labels(ex)).float().mean(-1).tolist()          # [C]
        for layer, alpha in zip(self.layers, window):
            previous = self._alphas.get(layer)
            self._alphas[layer] = (alpha if previous is None
                                   else cfg.smoothing * previous + (1.0 - cfg.smoothing) * alpha)
        choice = choose_exit(self._alphas, ex.num_layers, cfg.max_draft_len)
        self._speculate = choice.exit_layer is not None
        if choice.exit_layer is not None:
            self.drafter.policy.exit_layer = choice.exit_layer
            self.drafter.stop_rule.max_draft_len = choice.draft_len
        ms = (time.perf_counter() - t0) * 1e3
        self.history.append(ExitDecision(self._calls, state.seq_len, len(history),
                                         dict(self._alphas), choice, ms))
        # A draft token skips layers [ℓ, L): both sub-layers of each.
        skipped = 0 if choice.exit_layer is None else ex.num_layers - choice.exit_layer
        self.plan_log.decide(PlanRecord(
            step=self._calls, context_len=state.seq_len, skipped_attention=skipped,
            skipped_mlp=skipped, draft_len=choice.draft_len, exit_layer=choice.exit_layer,
            planning_ms=ms, description=_describe(choice)))
        logger.info("del refreshed at %d tokens from %d shadow tokens in %.0f ms: %s",
                    state.seq_len, len(history), ms, _describe(choice))


def _check_config(cfg: DELConfig) -> None:
    """Raise :class:`InvalidArgumentError` for settings out of range (the stop rule and the
    drafter check ``confidence`` and ``max_draft_len``)."""
    for name in ("refresh_every", "history_steps", "min_history"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"DEL's {name} must be an integer >= 1, got {value!r}")
    if isinstance(cfg.num_candidates, bool) or not isinstance(cfg.num_candidates, int) or (
            cfg.num_candidates < 0):
        raise InvalidArgumentError("DEL's num_candidates must be an integer >= 0 (0 = every "
                                   f"layer), got {cfg.num_candidates!r}")
    if not 0.0 <= cfg.smoothing < 1.0:
        raise InvalidArgumentError(f"DEL's smoothing must be in [0, 1), got {cfg.smoothing!r}")


def _describe(choice: ExitChoice) -> str:
    if choice.exit_layer is None:
        return f"plain decoding (no exit beats TPL {choice.ar_tpl:.4f})"
    return (f"exit layer {choice.exit_layer}, γ={choice.draft_len}, α={choice.alpha:.2f}, "
            f"TPL {choice.tpl:.4f} vs plain {choice.ar_tpl:.4f}")
