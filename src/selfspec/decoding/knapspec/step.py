"""The KnapSpec Step (KnapSpec §3, Algorithm 1): self-speculative decoding whose draft is a
subset of attention and MLP sub-layers, re-chosen during generation by a knapsack DP over
the recent tokens and a Tokens-per-Time grid search with measured, context-dependent
latencies.

Every ``reoptimize_every`` steps (paper: T = 64) the step:

1. takes the ``r`` tokens committed by the last ``history_steps`` steps (paper: m = 5) and
   the full model's residual stream after every sub-layer on them, ``X[0..2L]``: recorded
   from the step's own plain decoding and verification forwards (``observe``,
   :class:`~selfspec.decoding.core.history.ResidualRecorder`), or, where those do not cover the
   tokens (the first re-optimisation, on the prompt's end), from a read-only pass of the full
   model over them (the cache is not touched);
2. solves the knapsack DP with integer weights from the latency model at the current context
   length (:func:`~selfspec.decoding.planning.knapsack.knapsack_candidates`; τ = 0.5, skipped weight
   ≤ K/2), each sub-layer applied to all live budgets in one batched read-only call;
3. estimates each candidate's acceptance rate α̂ as its next-token accuracy on the history
   (eq. 9) and picks the (plan, γ) of highest predicted TPT (eq. 4); when no plan beats plain
   decoding it decodes autoregressively until the next re-optimisation.

Drafting then stops at γ_max or when the draft's top-1 probability falls below 0.7 (§3.5,
"Dynamic Drafting Exit"). With ``draft_stop="tpt"`` the 0.7 rule is replaced by
:class:`~selfspec.decoding.planning.tpt_stop.TptStopRule`: each draft ends token by token where the
predicted tokens/s peak, from that token's confidence (acceptance calibrated online per
confidence bucket, starting from the chosen plan's α̂) and the measured draft and
verification costs. Verification is the full model: lossless.

Two departures for CPUs, where the paper's GPU assumptions fail: the TPT search charges a
verification of ``γ + 1`` tokens its measured cost (not one token's), and a re-optimisation
may cost (predicted: the DP's rows × sub-layers at the measured batched cost) at most
``plan_budget`` of the decoding time until the next one. When the exact DP does not fit, it
is cheapened — budgets grouped into bins that keep one state each (``bin_width``), then
fewer history tokens — and when even the cheapest form does not fit the step keeps its
current mode (plain decoding at first). So KnapSpec never pays more for planning than it
can win, and falls back to plain decoding when planning is too dear. The predicted cost
counts the full model's pass over the history tokens when they are not recorded; when only
that pass makes planning too dear, the step decodes on (recording) and re-optimises as
soon as the recorded tokens suffice. While re-optimisations find no
paying plan, the interval to the next one doubles (up to ``max_backoff × T``).

Beyond the paper, the draft may run on quantized copies of the model's own weights (a
:meth:`~selfspec.executor.LayerExecutor.draft_view`, int8, int4 or w4a8; QSpec-style). The search
space is then "which sub-layers of the quantized model to skip", which includes "none"
(plain QSpec) and plain decoding. Draft costs and the integer weights come from the view's
own measured latency model, verification costs from the model's, and the model's own
weights verify (lossless). The DP and α̂ score the candidates with the model's own
sub-layers and ``lm_head``, as a proxy for the quantized ones: on CPUs the quantized kernels
are compute-bound on the DP's many rows (several times the bf16 cost per row and
sub-layer), so scoring them would price every re-optimisation out of
``plan_budget``; the proxy over-estimates α̂ by the quantization's own disagreement (~2% of
tokens for int4 on Qwen2.5-1.5B), which the confidence stop rule bounds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.history import (
    MAX_SHORTLIST,
    CommittedWindow,
    History,
    ResidualRecorder,
    read_history,
)
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.plan_log import PlanLog, PlanRecord
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import (
    ConfidenceStopRule,
    ConstantStopRule,
    StopRule,
)
from selfspec.decoding.knapspec.governed import governed_call
from selfspec.decoding.planning.knapsack import (
    Candidate,
    PlanChoice,
    choose_plan,
    knapsack_candidates,
)
from selfspec.decoding.planning.tpt import AcceptanceEstimate
from selfspec.decoding.planning.tpt_stop import ConfidenceCalibration, TptStopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel
from selfspec.executor.executor import Observer, SkipPlan

logger = logging.getLogger(__name__)

_MIN_TOKENS = 4  # fewest history tokens a cheapened re-optimisation scores
_MAX_BIN = 16  # widest budget bin a cheapened re-optimisation uses
DRAFT_STOPS = ("confidence", "tpt")
_DRAFT_KEY = "draft"
_TPT_DECAY = 0.95  # per verified draft, as auto's acceptance estimates


@dataclass(frozen=True)
class Reoptimization:
    """One re-optimisation of the plan.

    Attributes:
        step: the Step call it ran before (0-based).
        context_len: committed tokens at that point.
        history_tokens: ``r``, the tokens the DP scored.
        weights: ``(w_attn, w_mlp)``.
        candidates: plans the DP returned.
        choice: the chosen plan and γ with predicted α̂ and TPT (``candidate`` ``None``:
            plain decoding); ``None`` when the re-optimisation was skipped as too dear.
        ms: wall time of the re-optimisation.
        predicted_ms: its predicted cost.
        bin_width: budget bin width of the DP (1 = the paper's exact DP; wider when the
            exact DP would cost more than ``plan_budget`` allows).
        recorded: the history came from recorded forwards (no read-only pass).
    """

    step: int
    context_len: int
    history_tokens: int
    weights: tuple[int, int]
    candidates: int
    choice: PlanChoice | None
    ms: float
    predicted_ms: float = 0.0
    bin_width: int = 1
    recorded: bool = False


@dataclass
class KnapSpecConfig:
    """KnapSpec's settings (paper values as defaults).

    Attributes:
        reoptimize_every: T, steps between re-optimisations.
        history_steps: m, steps whose committed tokens the DP scores.
        min_history: fewest tokens to score (early steps commit few; at the first step the
            history is the end of the prompt).
        tau: similarity pruning threshold τ.
        max_draft_len: D, the largest γ searched and the draft cap.
        confidence: stop drafting when the top-1 probability falls below this.
        max_alpha_candidates: candidates whose α̂ is measured (spread over the budgets; the
            ``lm_head`` over every candidate's history is the costly part on a CPU).
        alpha_vocab: α̂ scores each candidate's prediction over the union of the full
            model's ``alpha_vocab`` most likely tokens at the history positions, not the
            whole vocabulary (``0``: the whole vocabulary, the paper's eq. 9; at most
            :data:`~selfspec.decoding.core.history.MAX_SHORTLIST`). It over-estimates α̂ only
            where a candidate's own top token lies outside that union; the ``lm_head`` over
            ``max_alpha_candidates × r`` rows otherwise costs a CPU hundreds of ms.
        weight_cap: cap of the integer weights.
        plan_budget: largest share of the decoding time until the next re-optimisation that
            a re-optimisation may cost (predicted); a huge value always plans (the paper).
        max_backoff: after a re-optimisation that found no paying plan (or was too dear),
            the interval to the next one doubles, up to ``max_backoff × T``; it returns to
            ``T`` when a plan is chosen (1 = every ``T`` steps, the paper).
        record_history: take the history from the residual stream of the step's own
            forwards when they cover it (``False``: a read-only pass every time, the paper).
        draft_stop: ``"confidence"`` (the paper's §3.5 rule: top-1 probability <
            ``confidence``, at most ``max_draft_len``) or ``"tpt"`` (a
            :class:`~selfspec.decoding.planning.tpt_stop.TptStopRule` up to ``max_draft_len``).
    """

    reoptimize_every: int = 64
    history_steps: int = 5
    min_history: int = 16
    tau: float = 0.5
    max_draft_len: int = 10
    confidence: float = 0.7
    max_alpha_candidates: int = 16
    alpha_vocab: int = 32
    weight_cap: int = 5
    plan_budget: float = 0.05
    max_backoff: int = 8
    record_history: bool = True
    draft_stop: str = "confidence"


class KnapSpecStep(Step):
    """KnapSpec as a Step (see the module docstring).

    Args:
        executor: the model's executor (it verifies).
        latency: its measured :class:`LatencyModel`.
        config: :class:`KnapSpecConfig`.
        draft: the executor drafts run on: ``None`` (the model's), or a
            :meth:`~LayerExecutor.draft_view` of ``executor`` on quantized weights.
        draft_latency: ``draft``'s measured :class:`LatencyModel` (required with ``draft``).

    Raises:
        InvalidArgumentError: a stop rule whose longest draft exceeds the bit-exact limit.
        ValueError: ``draft`` without ``draft_latency``; ``alpha_vocab`` or ``draft_stop``
            out of range.
    """

    def __init__(self, executor: LayerExecutor, latency: LatencyModel,
                 config: KnapSpecConfig | None = None, draft: LayerExecutor | None = None,
                 draft_latency: LatencyModel | None = None) -> None:
        if draft is not None and draft_latency is None:
            raise ValueError("a draft executor needs its own latency model (draft_latency)")
        if config is not None and not 0 <= config.alpha_vocab <= MAX_SHORTLIST:
            raise ValueError(f"alpha_vocab must lie in [0, {MAX_SHORTLIST}], got "
                             f"{config.alpha_vocab}")
        if config is not None and config.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft_stop must be one of {DRAFT_STOPS}, got {config.draft_stop!r}")
        self.executor = executor
        self.latency = latency
        self.draft_executor = executor if draft is None else draft
        self.draft_latency = latency if draft is None else draft_latency
        self.config = config or KnapSpecConfig()
        cfg = self.config
        rule: StopRule = ConfidenceStopRule(cfg.confidence, max_draft_len=cfg.max_draft_len)
        # With draft_stop="tpt": the acceptance of the current plan's drafts (prior: its α̂).
        self._acceptance: AcceptanceEstimate | None = None
        if cfg.draft_stop == "tpt":
            self._acceptance = AcceptanceEstimate(decay=_TPT_DECAY)
            rule = TptStopRule(ConstantStopRule(cfg.max_draft_len),
                               ConfidenceCalibration(self._acceptance, _DRAFT_KEY),
                               self._draft_token_ms, self._forward_ms)
        self._recorder = (ResidualRecorder.for_window(cfg.min_history, cfg.history_steps,
                                                      cfg.max_draft_len)
                          if cfg.record_history else None)
        self.drafter = SkipPlanDrafter(self.draft_executor, SkipPlan(), rule, verifier=executor,
                                       recorder=self._recorder)
        self._speculative = SpeculativeStep(self.drafter)
        self._ar = ArStep(self._recorder)
        # Plain steps more than the recorder's reach before the next re-optimisation are not
        # in its history: they run unrecorded (while no plan pays that is most of them).
        self._ar_unrecorded = ArStep()
        self.history: list[Reoptimization] = []
        self.plan_log = PlanLog()
        self.last_candidates: list[Candidate] = []  # scored by the latest re-optimisation
        self.last_alphas: list[float] = []  # their α̂
        self._committed = CommittedWindow(self.config.history_steps)
        self._calls = 0
        self._next_plan = 0
        self._interval = self.config.reoptimize_every
        self._context_len = 0
        self._speculate = False
        self._retry_in: int | None = None  # steps until recorded history makes planning fit

    def start(self, state: DecodeState) -> None:
        """A new generation: the first step optimises on the end of the prompt."""
        self.history = []
        self.plan_log.clear()
        self._committed.clear()
        self._calls = 0
        self._next_plan = 0
        self._interval = self.config.reoptimize_every
        self._speculate = False
        if self._recorder is not None:
            self._recorder.attach(state)

    def prefill_observer(self, state: DecodeState) -> Observer | None:
        """:meth:`ResidualRecorder.prefill_observer`, or ``None`` with
        ``record_history=False``."""
        return None if self._recorder is None else self._recorder.prefill_observer(state)

    def __call__(self, state: DecodeState) -> StepStats:
        cfg = self.config
        plan_ms = 0.0
        if self._calls >= self._next_plan:
            t0 = time.perf_counter()
            self._retry_in = None
            self._reoptimize(state)
            plan_ms = (time.perf_counter() - t0) * 1e3
            if self._retry_in is not None:  # only the history pass priced it out: record
                self._next_plan = self._calls + self._retry_in
            else:
                # Back off while no plan pays: planning that keeps finding nothing is pure cost.
                self._interval = (cfg.reoptimize_every if self._speculate else
                                  min(2 * self._interval, cfg.max_backoff * cfg.reoptimize_every))
                self._next_plan = self._calls + self._interval
        ahead = self._next_plan - self._calls  # steps until the next re-optimisation
        self._calls += 1
        if self._speculate:
            stats = governed_call(self._speculative, state, plan_ms, self.plan_log,
                                  self._committed)
            if self._acceptance is not None:
                self._acceptance.update(_DRAFT_KEY, stats.num_drafted, stats.num_accepted)
            return stats
        if self._recorder is not None and ahead > self._recorder.capacity:
            step = self._ar_unrecorded
        else:
            step = self._ar
        return governed_call(step, state, plan_ms, self.plan_log, self._committed)

    # ------------------------------------------------------------------ draft_stop="tpt"
    def _start_calibration(self, alpha: float) -> None:
        """A new plan: its acceptance starts from the DP's α̂, its confidence buckets
        afresh (another plan drafts other tokens with other confidences)."""
        rule = self.drafter.stop_rule
        assert isinstance(rule, TptStopRule)
        self._acceptance = AcceptanceEstimate(prior=alpha, decay=_TPT_DECAY)
        rule.calibration = ConfidenceCalibration(self._acceptance, _DRAFT_KEY)

    def _draft_token_ms(self) -> float:
        return self.draft_latency.draft_ms(self.drafter.plan, self._context_len)

    def _forward_ms(self, num_tokens: int) -> float:
        return self.latency.verify_ms(self._context_len, num_tokens)

    # ------------------------------------------------------------------ planning
    @torch.inference_mode()
    def _reoptimize(self, state: DecodeState) -> None:
        cfg, ex = self.config, self.executor
        t0 = time.perf_counter()
        available = state.seq_len - 1  # positions whose KV is in every layer
        r = min(self._committed.tokens(cfg.min_history), available - 1)
        if r < 2:
            return
        n = self._context_len = state.seq_len
        w_attn, w_mlp = self.draft_latency.weights(n, cfg.weight_cap)
        horizon = min(state.remaining, self._interval) * self.latency.verify_ms(n, 1)
        allowed = cfg.plan_budget * horizon
        covered = (0 if self._recorder is None
                   else self._recorder.covered(state, self.executor.num_layers))
        affordable = self._affordable(r, w_attn, w_mlp, allowed, covered)
        if affordable is None and self._recorder is not None and covered < r and \
                self._affordable(r, w_attn, w_mlp, allowed, r) is not None:
            # Fits once the step's own forwards have recorded the r tokens (>= 1 per step).
            self._retry_in = r - covered
            logger.info("knapspec waits %d steps for recorded history at %d tokens",
                        self._retry_in, n)
            return
        if affordable is None:
            cheapest = min(r, _MIN_TOKENS)
            predicted = self._planning_ms(cheapest, w_attn, w_mlp, _MAX_BIN, cheapest <= covered)
            self.history.append(Reoptimization(self._calls, n, r, (w_attn, w_mlp), 0, None,
                                               0.0, predicted))
            logger.info("knapspec skips re-optimising at %d tokens: even its cheapest form "
                        "costs %.0f ms > %.0f%% of %.0f ms", n, predicted,
                        100 * cfg.plan_budget, horizon)
            return
        r, bin_width = affordable
        predicted = self._planning_ms(r, w_attn, w_mlp, bin_width, recorded=r <= covered)
        history = (self._recorder.history(ex, state, r) if r <= covered else None)
        recorded = history is not None
        if history is None:
            history = read_history(ex, state, r)

        def sublayer(i: int, states: torch.Tensor) -> torch.Tensor:
            layer = (i - 1) // 2
            plan = (SkipPlan(skip_mlp=frozenset({layer})) if i % 2 == 1
                    else SkipPlan(skip_attention=frozenset({layer})))
            return history.run(ex, state, states, layer, layer + 1, plan)

        candidates = knapsack_candidates(history.states, sublayer, w_attn, w_mlp, cfg.tau,
                                         bin_width=bin_width)
        chosen = _spread(candidates, cfg.max_alpha_candidates)
        self.last_candidates = chosen
        alphas = self.last_alphas = self._alphas(chosen, history)
        plans = [SkipPlan(c.skip_attention, c.skip_mlp) for c in chosen]
        costs = [self.draft_latency.draft_ms(p, n) for p in plans]
        choice = choose_plan(chosen, alphas, costs, lambda t: self.latency.verify_ms(n, t),
                             cfg.max_draft_len)
        self._speculate = choice.candidate is not None
        if choice.candidate is not None:
            plan = SkipPlan(choice.candidate.skip_attention, choice.candidate.skip_mlp)
            if self._acceptance is not None and plan != self.drafter.plan:
                self._start_calibration(choice.alpha)
            self.drafter.plan = plan
        ms = (time.perf_counter() - t0) * 1e3
        record_ = Reoptimization(self._calls, n, r, (w_attn, w_mlp), len(candidates), choice, ms,
                                 predicted, bin_width, recorded)
        self.history.append(record_)
        self.plan_log.decide(_plan_record(record_, choice))
        logger.info("knapspec re-optimised at %d tokens in %.0f ms: %s", n, ms, _describe(choice))

    def _planning_ms(self, r: int, w_attn: int, w_mlp: int, bin_width: int = 1,
                     recorded: bool = False) -> float:
        """Predicted cost of one re-optimisation: the full model's read-only pass over the
        ``r`` history tokens (none when ``recorded``); at the measured batched cost of a
        call, the ``2L`` sub-layer calls, each on ``r`` rows for every budget bin reachable
        before it (at most ``K/2 / bin_width + 1``); the output head on the ``r`` history
        tokens (the labels; it grows with ``r`` as a verification does); and α̂'s
        ``max_alpha_candidates × r`` head rows, each
        ``head_ms / mlp_ms`` sub-layer rows (both weight-bound on one token) times the
        scored share of the vocabulary."""
        cfg, num_layers, lat, n = self.config, self.executor.num_layers, self.latency, \
            self._context_len
        limit = num_layers * (w_attn + w_mlp) // 2
        # Sub-layer i runs every budget bin reachable before it (pruning can only remove).
        dp, reach = 0.0, 0
        for w in [w_attn, w_mlp] * num_layers:
            dp += lat.batched_ms((min(reach, limit) // bin_width + 1) * r)
            reach += w
        vocab = self.executor.vocab_size
        scored = 1.0 if cfg.alpha_vocab <= 0 else min(r * cfg.alpha_vocab, vocab) / vocab
        alpha_rows = cfg.max_alpha_candidates * r * scored * lat.head_ms / max(lat.mlp_ms, 1e-6)
        labels = lat.head_ms * lat.verify_ms(n, r) / lat.verify_ms(n, 1)
        # The full model's pass over the r tokens, unless the step's forwards recorded them.
        history = 0.0 if recorded else lat.verify_ms(n, r)
        return history + labels + dp + alpha_rows * lat.batched_row_ms

    def _affordable(self, r: int, w_attn: int, w_mlp: int, allowed_ms: float,
                    covered: int = 0) -> tuple[int, int] | None:
        """The most faithful ``(history tokens, budget bin width)`` whose predicted cost fits
        ``allowed_ms``: the paper's exact DP on ``r`` tokens if it fits, else wider budget
        bins (up to 16), then fewer tokens (down to 4); ``None`` when nothing fits (CPU-side
        cheapening; on a GPU the first option always fits). The last ``covered`` tokens are
        recorded: a history of at most that many needs no pass."""
        tokens = [r] + [t for t in (r // 2, r // 4) if t >= _MIN_TOKENS] + (
            [_MIN_TOKENS] if r > _MIN_TOKENS else [])
        for t in dict.fromkeys(tokens):
            for bin_width in (1, 2, 4, 8, _MAX_BIN):
                if self._planning_ms(t, w_attn, w_mlp, bin_width, t <= covered) <= allowed_ms:
                    return t, bin_width
        return None

    def _alphas(self, candidates: list[Candidate], history: History) -> list[float]:
        """α̂ of each candidate: next-token accuracy of its final hidden state (eq. 9), over
        the ``alpha_vocab`` shortlist (or the whole vocabulary)."""
        if not candidates:
            return []
        ex, k = self.executor, self.config.alpha_vocab
        labels = history.labels(ex)                                               # [r]
        hidden = torch.stack([c.hidden for c in candidates])                      # [C, r, d]
        if k <= 0:
            predicted = ex.logits(hidden).argmax(-1)                              # [C, r]
        else:
            rows = history.shortlist(ex, k)                                       # [R]
            predicted = rows[ex.logits(hidden, vocab_rows=rows).argmax(-1)]       # [C, r]
        return (predicted == labels).float().mean(-1).tolist()


def _spread(candidates: list[Candidate], limit: int) -> list[Candidate]:
    """At most ``limit`` candidates spread evenly over the budgets (the heaviest kept)."""
    if len(candidates) <= limit:
        return list(candidates)
    step = (len(candidates) - 1) / (limit - 1)
    return [candidates[round(k * step)] for k in range(limit)]


def _plan_record(reopt: Reoptimization, choice: PlanChoice) -> PlanRecord:
    """The generic record of one re-optimisation (TPT per ms → tokens per second)."""
    c = choice.candidate
    return PlanRecord(step=reopt.step, context_len=reopt.context_len,
                      skipped_attention=len(c.skip_attention) if c else 0,
                      skipped_mlp=len(c.skip_mlp) if c else 0,
                      draft_len=choice.draft_len if c else 0,
                      predicted_tps=choice.tpt * 1e3, planning_ms=reopt.ms,
                      description=_describe(choice))


def _describe(choice: PlanChoice) -> str:
    if choice.candidate is None:
        return f"plain decoding (no plan beats it; predicted {choice.ar_tpt * 1e3:.1f} tok/s)"
    c = choice.candidate
    return (f"skip {len(c.skip_attention)} attention + {len(c.skip_mlp)} MLP, "
            f"γ={choice.draft_len}, "
            f"α̂={choice.alpha:.2f}, predicted {choice.tpt * 1e3:.1f} vs plain "
            f"{choice.ar_tpt * 1e3:.1f} tok/s")
