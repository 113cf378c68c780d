"""AdaDecode's head layers and per-head thresholds, chosen by replaying Algorithm 1 on
held-out greedy text (selfspec's addition; the paper uses one γ for every head, §2.2 eq. 1).

**Why a replay is exact.** In greedy decoding every layer's KV is complete before a token
reads it (Algorithm 1), so a head's confidence at a position, and whether its argmax equals
the final layer's token, depend on the committed prefix only. On text that *is* the model's
greedy output (on-policy answers, :mod:`selfspec.training.corpus`) the positions decoding
visits are the text's positions, and the whole schedule (which head exits, which early
predictions verification accepts, how many positions each layer call carries) follows from
two numbers per position and head. Positions after a rejected early prediction are replayed
from the text as well (their confidences on the wrong token are not recorded); they only
decide how much work is thrown away.

**Cost model** (:class:`ScheduleCosts`), in units of one decoder-layer call on one position:
a layer call on ``r`` positions costs ``1 + row·(r - 1)`` (decoding reads weights, so extra
positions are cheap on a CPU); a head check costs ``head``; the output layer (final norm +
``lm_head``) over ``r`` positions costs ``output·(1 + row·(r - 1))``. Autoregressive
decoding costs ``L + output`` per token.

**Why per-head thresholds.** An early prediction at layer ``e`` that is accepted saves about
``L - e`` layer calls; one that is rejected wastes the ``e`` layers the next token ran on its
own, and everything drafted after it. The break-even precision is therefore about ``e/L``:
a shallow head can predict early at a lower threshold than a deep one, which a single γ
cannot express. :func:`tune` searches per-head thresholds (a head may be switched off) by
coordinate ascent on the replayed speedup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import LatencyModel

# Candidate thresholds per head; None = the head is not used.
DEFAULT_GRID: tuple[float | None, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97,
                                          0.98, 0.99, 0.995, None)
# Relative cost of one more position in a decoder-layer call, used where no latency model
# prices it (:func:`row_cost_from_latency`): a small share of a position, since a layer call
# is bound by reading the weights (measured figures: docs/results/timings.md).
DEFAULT_ROW_COST = 0.05


@dataclass(frozen=True)
class ScheduleCosts:
    """Costs of one decoding step's parts, in single-position decoder-layer calls.

    Attributes:
        row: extra cost of each further position in one layer call (``>= 0``).
        head: one exit-head check on one position.
        output: the output layer (final norm + ``lm_head``) on one position.
        scan: once per position that may exit, before its first check (SpecEE's drafter of
            candidate tokens; ``0`` for AdaDecode, whose heads draft at the check).
    """

    row: float
    head: float
    output: float
    scan: float = 0.0

    @staticmethod
    def from_sizes(layer_bytes: int, head_bytes: int, output_bytes: int,
                   row: float = DEFAULT_ROW_COST) -> ScheduleCosts:
        """Costs proportional to the weight bytes each part reads (decoding is bandwidth
        bound).

        Args:
            layer_bytes: bytes one decoder-layer call reads.
            head_bytes: bytes one head check reads (``T`` plus the draft-vocabulary rows of
                ``E*`` for a lightweight head).
            output_bytes: bytes the output layer reads (``V·H`` weights).
            row: see :attr:`row`.

        Raises:
            InvalidArgumentError: a size ``< 1`` or ``row < 0``.
        """
        if min(layer_bytes, head_bytes, output_bytes) < 1 or row < 0:
            raise InvalidArgumentError(
                f"schedule costs need positive sizes and row >= 0, got layer {layer_bytes}, "
                f"head {head_bytes}, output {output_bytes}, row {row}")
        return ScheduleCosts(row, head_bytes / layer_bytes, output_bytes / layer_bytes)


# Forwards of 2 .. ROW_COST_TOKENS tokens set a machine's row cost: the calls these schedules
# make (1.4-1.5 positions per layer call, 2.3-2.6 tokens per verification, measured).
ROW_COST_TOKENS = 4


def row_cost_from_latency(latency: LatencyModel, tokens: int = ROW_COST_TOKENS,
                          context_len: int = 256) -> float:
    """:attr:`ScheduleCosts.row` of this machine, from its measured latency model: the
    least-squares slope through the origin of the extra time of a full forward of ``T``
    tokens over one (``latency.extra_tokens_ms``) against ``T - 1``, for ``T = 2 .. tokens``,
    over one token's forward (``latency.target_ms(context_len)``), clamped to ``[0, 1]``. The
    extra rows of the output layer count as the layers' do (a verification runs both on the
    same rows).

    Why up to 4 tokens: the calls are that small (:data:`ROW_COST_TOKENS`), and larger ones
    cost more per row on CPUs whose kernels run out of registers or L1, so fitting them prices
    the small calls too high and the tuned thresholds come out slower (measured:
    docs/results/timings.md).

    Args:
        latency: :class:`~selfspec.executor.cost_model.LatencyModel` of the model on this
            machine (:func:`~selfspec.executor.cost_model.cached_latency`).
        tokens: the largest forward fitted (``>= 2``).
        context_len: cached positions of the reference token.

    Raises:
        InvalidArgumentError: ``tokens < 2``.
    """
    if tokens < 2:
        raise InvalidArgumentError(f"the row cost fit needs tokens >= 2, got {tokens}")
    extra = range(1, tokens)
    slope = (sum(x * latency.extra_tokens_ms(x + 1) for x in extra)
             / sum(x * x for x in extra))
    return min(1.0, max(0.0, slope / latency.target_ms(context_len)))


def output_cost_from_latency(latency: LatencyModel, context_len: int = 256) -> float:
    """:attr:`ScheduleCosts.output` of this machine, from its measured latency model: the
    output layer's time (final norm + ``lm_head``, ``latency.head_ms``) over one decoder
    layer's on one token (``t_attn(context_len) + mlp_ms``).

    Why measured, not from the weights' bytes: the output layer streams its one large matrix
    faster per byte than a decoder layer streams its seven small ones, so its bytes can
    overstate its time by half or more (docs/results/timings.md); an output layer priced too
    high makes every exit look worth more than it is, and the tuned thresholds exit too
    eagerly.

    Args:
        latency: :class:`~selfspec.executor.cost_model.LatencyModel` of the model on this
            machine.
        context_len: cached positions of the reference layer call.
    """
    layer = latency.t_attn(context_len) + latency.mlp_ms
    return latency.head_ms / max(layer, 1e-6)


@dataclass(frozen=True)
class HeadTrace:
    """Each head's view of held-out greedy text, position by position.

    Attributes:
        layers: ``[K]`` head layers, increasing.
        confidence: ``[N, K]`` float, the head's top-1 probability at each position (over the
            draft vocabulary decoding will use).
        correct: ``[N, K]`` bool, the head's argmax equals the final layer's token.
        lengths: positions of each sequence, in order (``sum(lengths) == N``).
        inner_layers: ``[E]`` exit layers, increasing, for which the positions were also
            traced as they stand *inside* a draft, after a position that exited at that layer
            (SpecEE's drafter then reads the previous position's exit-layer state, not its
            last-layer one); ``()``: every position is replayed from ``confidence`` and
            ``correct`` (AdaDecode, whose heads read only the position's own state).
        inner_confidence / inner_correct: ``[E, N, K]`` the same two numbers inside a draft,
            after an exit at ``inner_layers[e]``; ``None`` without ``inner_layers``.
    """

    layers: tuple[int, ...]
    confidence: torch.Tensor
    correct: torch.Tensor
    lengths: tuple[int, ...]
    inner_layers: tuple[int, ...] = ()
    inner_confidence: torch.Tensor | None = None
    inner_correct: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.confidence.shape
        if (k != len(self.layers) or tuple(self.correct.shape) != (n, k)
                or sum(self.lengths) != n or any(b <= a for a, b in
                                                  zip(self.layers, self.layers[1:]))):
            raise InvalidArgumentError(
                f"inconsistent head trace: layers {self.layers}, confidence "
                f"{tuple(self.confidence.shape)}, correct {tuple(self.correct.shape)}, "
                f"{sum(self.lengths)} positions in sequences")
        e = len(self.inner_layers)
        shapes = [None if t is None else tuple(t.shape)
                  for t in (self.inner_confidence, self.inner_correct)]
        if (shapes != ([None, None] if not e else [(e, n, k)] * 2)
                or any(b <= a for a, b in zip(self.inner_layers, self.inner_layers[1:]))):
            raise InvalidArgumentError(
                f"inconsistent inner trace: exit layers {self.inner_layers}, confidence and "
                f"correct {shapes}, expected {(e, n, k)}")

    def select(self, index: torch.Tensor, lengths: tuple[int, ...]) -> HeadTrace:
        """The trace of the positions ``index`` (whole sequences of ``lengths``, in order)."""
        inner = self.inner_confidence is not None
        return HeadTrace(self.layers, self.confidence[index], self.correct[index], lengths,
                         self.inner_layers,
                         self.inner_confidence[:, index] if inner else None,
                         self.inner_correct[:, index] if inner else None)

    def perfect(self) -> HeadTrace:
        """The same trace with each confidence replaced by its label (perfect predictors)."""
        inner = self.inner_correct is not None
        return HeadTrace(self.layers, self.correct.float(), self.correct, self.lengths,
                         self.inner_layers, self.inner_correct.float() if inner else None,
                         self.inner_correct)


@dataclass(frozen=True)
class SchedulePrediction:
    """What a replay predicts for one setting.

    Attributes:
        speedup: autoregressive cost per token / AdaDecode's (both in the cost model).
        cost_per_token: AdaDecode's cost per committed token (layer-call units).
        drafts_per_token: early predictions per committed token.
        acceptance: accepted / early predictions (``nan`` with none).
        tokens: committed tokens replayed.
    """

    speedup: float
    cost_per_token: float
    drafts_per_token: float
    acceptance: float
    tokens: int


@dataclass(frozen=True)
class TunedSchedule:
    """The best setting :func:`tune` found.

    Attributes:
        gammas: ``{layer: γ}`` of the heads used (the others are off).
        prediction: its replay on the tuning text.
    """

    gammas: dict[int, float]
    prediction: SchedulePrediction


def _layer_calls(first: int, last: int, groups: list[list[int]], row: float) -> float:
    """Cost of layers ``[first, last)`` for the newest position, carrying the deferred
    groups (``[wait_layer, positions]``) that wait at or below each layer."""
    cost = float(max(last - first, 0))
    for wait, size in groups:  # a group rides along in layers [max(first, wait), last)
        cost += row * size * max(last - max(first, wait), 0)
    return cost


def simulate(trace: HeadTrace, gammas: Sequence[float | None], num_layers: int,
             costs: ScheduleCosts, max_early: int = 5,
             check_costs: Sequence[float] | None = None) -> SchedulePrediction:
    """Replay Algorithm 1 (greedy) on ``trace`` with per-head thresholds (module doc).

    Args:
        trace: :class:`HeadTrace`.
        gammas: ``[K]`` threshold of each head, ``None`` = head off (never checked).
        num_layers: ``L``.
        costs: :class:`ScheduleCosts`.
        max_early: early predictions outstanding before a token must run every layer.
        check_costs: ``[K]`` cost of each head's check (``None``: ``costs.head`` each;
            SpecEE's predictors differ by layer, :mod:`selfspec.training.specee_tuning`).

    Returns:
        :class:`SchedulePrediction`.

    Raises:
        InvalidArgumentError: ``gammas`` of the wrong length, or every head off.
    """
    if len(gammas) != len(trace.layers) or all(g is None for g in gammas):
        raise InvalidArgumentError(
            f"give one threshold per head ({len(trace.layers)}), not all None; got {gammas}")
    if check_costs is not None and len(check_costs) != len(trace.layers):
        raise InvalidArgumentError(
            f"give one check cost per head ({len(trace.layers)}), got {len(check_costs)}")
    check = [costs.head] * len(trace.layers) if check_costs is None else list(check_costs)
    heads = [(k, layer, g) for k, (layer, g) in enumerate(zip(trace.layers, gammas))
             if g is not None]
    conf = trace.confidence.tolist()
    correct = trace.correct.tolist()
    # Inside a draft (SpecEE): the variant traced after an exit at the nearest traced layer.
    inner = trace.inner_layers
    if inner:
        inner_conf = trace.inner_confidence.tolist()
        inner_correct = trace.inner_correct.tolist()
        variant = [min(range(len(inner)), key=lambda v: (abs(inner[v] - x), inner[v]))
                   for x in range(num_layers + 1)]
    total_cost, tokens, drafts, accepted = 0.0, 0, 0, 0
    start = 0
    for length in trace.lengths:
        t = 0
        while t < length:
            groups: list[list[int]] = []  # deferred positions, oldest (deepest wait) first
            outcomes: list[bool] = []
            cost, pos = 0.0, t
            pconf, pcorrect = conf, correct
            while True:
                may_exit = len(outcomes) < max_early and pos < length - 1
                reached, exit_at = 0, None
                cost += costs.scan if may_exit else 0.0
                for k, layer, gamma in heads:
                    cost += _layer_calls(reached, layer, groups, costs.row)
                    reached = layer
                    if not may_exit:
                        continue
                    cost += check[k]
                    if pconf[start + pos][k] > gamma:
                        exit_at = (k, layer)
                        break
                if exit_at is None:
                    cost += _layer_calls(reached, num_layers, groups, costs.row)
                    riders = sum(size for _, size in groups)
                    cost += costs.output * (1.0 + costs.row * riders)
                    break
                k, layer = exit_at
                joined = sum(size for wait, size in groups if wait <= layer)
                groups = [g for g in groups if g[0] > layer] + [[layer, joined + 1]]
                outcomes.append(bool(pcorrect[start + pos][k]))
                pos += 1
                if inner:  # the next position's candidates read this exit's state
                    v = variant[layer]
                    pconf, pcorrect = inner_conf[v], inner_correct[v]
            good = next((i for i, ok in enumerate(outcomes) if not ok), len(outcomes))
            drafts += len(outcomes)
            accepted += good
            committed = min(good + 1, length - t)  # accepted + the verifier's token
            total_cost += cost
            tokens += committed
            t += committed
        start += length
    per_token = total_cost / max(tokens, 1)
    return SchedulePrediction(
        speedup=(num_layers + costs.output) / per_token if tokens else math.nan,
        cost_per_token=per_token, drafts_per_token=drafts / max(tokens, 1),
        acceptance=accepted / drafts if drafts else math.nan, tokens=tokens)


def tune(trace: HeadTrace, num_layers: int, costs: ScheduleCosts, max_early: int = 5,
         grid: Sequence[float | None] = DEFAULT_GRID, start: float | Sequence[float | None] = 0.97,
         rounds: int = 2, check_costs: Sequence[float] | None = None) -> TunedSchedule:
    """Per-head thresholds that maximise the replayed speedup (coordinate ascent over
    ``grid`` per head, from ``start`` at every head (or ``[K]`` starting thresholds),
    ``rounds`` sweeps; ``check_costs`` as in :func:`simulate`).

    Raises:
        InvalidArgumentError: an empty grid or a threshold outside [0, 1).
    """
    if not grid or any(g is not None and not 0 <= g < 1 for g in grid):
        raise InvalidArgumentError(f"thresholds must lie in [0, 1) (None = head off), got {grid}")

    def run(gammas: Sequence[float | None]) -> SchedulePrediction:
        return simulate(trace, gammas, num_layers, costs, max_early, check_costs)

    best = ([start] * len(trace.layers) if isinstance(start, (int, float))
            else list(start))
    score = run(best).speedup
    for _ in range(rounds):
        changed = False
        for k in range(len(best)):
            for g in grid:
                trial = best[:k] + [g] + best[k + 1:]
                if all(x is None for x in trial) or trial == best:
                    continue
                s = run(trial).speedup
                if s > score + 1e-6:
                    best, score, changed = trial, s, True
        if not changed:
            break
    return TunedSchedule({layer: g for layer, g in zip(trace.layers, best) if g is not None},
                         run(best))
