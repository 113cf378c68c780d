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

The stage ``selfspec heads tune-adadecode``: :func:`tune_adadecode_file` →
:class:`TuneOutcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import LatencyModel
from selfspec.heads.card import AdaDecodeCard
from selfspec.heads.files import ExitHeads, find_head_file, load_heads, model_name, save_heads
from selfspec.training.calibration import head_scores
from selfspec.training.corpus import (
    CALIBRATION,
    ONPOLICY,
    SPLIT_NAMES,
    TEST,
    CorpusItem,
    items_by_use,
    source_weight,
)
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet
from selfspec.training.pipeline import (
    PreparedData,
    StageTimes,
    card_request,
    in_feature_order,
    model_eos_ids,
    prepare_features,
)

logger = logging.getLogger(__name__)

# Candidate thresholds per head; None = the head is not used.
DEFAULT_GRID: tuple[float | None, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97,
                                          0.98, 0.99, 0.995, None)
# Relative cost of one more position in a decoder-layer call, used where no latency model
# prices it (:func:`row_cost_from_latency`): a small share of a position, since a layer call
# is bound by reading the weights.
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
    the small calls too high and the tuned thresholds come out slower.

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
    overstate its time by half or more; an output layer priced too
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
                                                  zip(self.layers, self.layers[1:], strict=False))):
            raise InvalidArgumentError(
                f"inconsistent head trace: layers {self.layers}, confidence "
                f"{tuple(self.confidence.shape)}, correct {tuple(self.correct.shape)}, "
                f"{sum(self.lengths)} positions in sequences")
        e = len(self.inner_layers)
        shapes = [None if t is None else tuple(t.shape)
                  for t in (self.inner_confidence, self.inner_correct)]
        if (shapes != ([None, None] if not e else [(e, n, k)] * 2)
                or any(b <= a for a, b in zip(self.inner_layers, self.inner_layers[1:],
                                              strict=False))):
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


# One function over 80 lines: the replay's loops run per position for every threshold the
# tuning tries, and read as one algorithm (Algorithm 1's schedule); helpers would split it.
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
    heads = [(k, layer, g) for k, (layer, g) in enumerate(zip(trace.layers, gammas, strict=False))
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
    return TunedSchedule({layer: g for layer, g in zip(trace.layers, best, strict=False)
                          if g is not None},
                         run(best))


DEFAULT_MAX_EARLY = 5  # AdaDecode's outstanding early predictions (appendix D)
DEFAULT_TUNE_VOCABS = (4096, 8192, 16384, 0)


PAPER_GAMMA = 0.75  # AdaDecode appendix D, the comparison the card records


@dataclass
class TuneOutcome:
    """What ``selfspec heads tune-adadecode`` produced."""

    path: Path
    card: AdaDecodeCard
    seconds: float


def head_trace(heads: ExitHeads, features: FeatureSet, items: Sequence[CorpusItem], split: int,
               sources: Sequence[str], vocab_rows: torch.Tensor | None) -> HeadTrace:
    """Each head's confidence and correctness on the ``split`` positions of ``sources``'
    items, sequence by sequence (the replay's input, :class:`HeadTrace`).

    Raises:
        InvalidArgumentError: no item of ``sources`` in ``split``.
    """
    spans, position = [], 0
    for item in in_feature_order(items):
        if item.split == split and item.source in sources and item.num_scored > 0:
            spans.append((position, item.num_scored))
        position += item.num_scored
    if not spans:
        raise InvalidArgumentError(
            f"no {SPLIT_NAMES[split]} text of {', '.join(sources)} to replay AdaDecode on; "
            f"train the heads with on-policy data (--data onpolicy:DATASET)")
    index = torch.cat([torch.arange(start, start + n) for start, n in spans])
    conf, correct = [], []
    for layer in heads.layers:
        scored = head_scores(heads.head_at(layer), features, index, ["max_prob"],
                             vocab_rows=vocab_rows)
        conf.append(scored.scores["max_prob"].float())
        correct.append(scored.correct)
    return HeadTrace(tuple(heads.layers), torch.stack(conf, 1), torch.stack(correct, 1),
                     tuple(n for _, n in spans))


def _replay_sources(heads: ExitHeads, target: Path, sources: Sequence[str] | None,
                    draft_vocabs: Sequence[int], vocab_size: int) -> list[str]:
    """The on-policy sources to replay (``sources``' names, or every on-policy source the
    heads trained with), after checking ``draft_vocabs``.

    Raises:
        InvalidArgumentError: no training data on the card, a source that is not one of the
            heads' on-policy sources, sizes outside ``[0, vocab_size]``, or a reduced size
            without token counts.
    """
    info = heads.card.training
    if info is None:
        raise InvalidArgumentError(f"{target}: the card records no training data to replay")
    trained = [source_weight(d)[0] for d in info.data]
    onpolicy = [s for s in trained if s.startswith(ONPOLICY)]
    chosen = [source_weight(x)[0] for x in sources] if sources else onpolicy
    bad = [s for s in chosen if s not in onpolicy]
    if not chosen or bad:
        raise InvalidArgumentError(
            f"tune-adadecode replays the model's own greedy text: choose among the heads' "
            f"on-policy sources {onpolicy or '(none: retrain with --data onpolicy:DATASET)'}; "
            f"got {bad or chosen}")
    if any(k < 0 or k > vocab_size for k in draft_vocabs) or not draft_vocabs:
        raise InvalidArgumentError(
            f"draft vocabulary sizes must lie in [0, {vocab_size}] (0 = all); "
            f"got {list(draft_vocabs)}")
    if any(k > 0 for k in draft_vocabs) and heads.token_counts is None:
        raise InvalidArgumentError(
            "a reduced draft vocabulary ranks tokens by the heads' token counts; run "
            "`selfspec heads calibrate` on these heads first")
    return chosen


def _head_costs(engine: Engine, heads: ExitHeads, rows: torch.Tensor | None,
                row_cost: float) -> ScheduleCosts:
    """The replay's costs with heads scoring ``rows`` (``None``: every token): a head check
    reads its draft-vocabulary rows of E* (and T, lightweight heads)."""
    ex = engine.executor
    hidden = heads.card.hidden_size
    element = torch.tensor([], dtype=ex.dtype).element_size()
    scored = ex.vocab_size if rows is None else int(rows.numel())
    extra = hidden * hidden if heads.card.kind == "lightweight" else 0
    return ScheduleCosts.from_sizes(ex.decode_layer_bytes(0), (scored * hidden + extra) * element,
                                    ex.output_decode_bytes, row_cost)


def _best_vocabulary(engine: Engine, heads: ExitHeads, data: PreparedData,
                     chosen: Sequence[str], draft_vocabs: Sequence[int], max_early: int,
                     row_cost: float) -> tuple[tuple, list[float]]:
    """``((size, tuned, costs, rows), speedups)``: the draft vocabulary whose tuned schedule
    replays fastest on the calibration text, and each size's replayed speedup."""
    from selfspec.decoding.drafting.draft_vocab import frequent_rows

    best = None
    speedups = []
    for size in draft_vocabs:
        rows = (None if size == 0 else
                frequent_rows(heads.token_counts, size, model_eos_ids(engine)).rows)
        costs = _head_costs(engine, heads, rows, row_cost)
        calibration = head_trace(heads, data.features, data.items, CALIBRATION, chosen, rows)
        tuned = tune(calibration, engine.executor.num_layers, costs, max_early)
        speedups.append(tuned.prediction.speedup)
        logger.info("draft vocabulary %s: %s, replayed speedup %.3f", size or "all",
                    tuned.gammas, tuned.prediction.speedup)
        if best is None or tuned.prediction.speedup > best[1].prediction.speedup:
            best = (size, tuned, costs, rows)
    return best, speedups


def tune_adadecode_file(engine: Engine, path: str, sources: Sequence[str] | None = None,
                        draft_vocabs: Sequence[int] = DEFAULT_TUNE_VOCABS,
                        max_early: int = DEFAULT_MAX_EARLY,
                        row_cost: float = DEFAULT_ROW_COST,
                        progress: bool = True) -> TuneOutcome:
    """``selfspec heads tune-adadecode``: per-head thresholds, head layers and draft
    vocabulary for AdaDecode by replaying Algorithm 1 on the heads' calibration text
    (:mod:`selfspec.training.adadecode_tuning`), checked on their test text; saved on the
    card (``adadecode:tuned=true`` reads it).

    Args:
        path: head file or directory (``"default"``).
        sources: on-policy data-spec sources to replay (``None`` = every on-policy source the
            heads were trained with); teacher-forced text is not the model's greedy output,
            so the replay would not be exact on it.
        draft_vocabs: sizes K to try (``0`` = the full vocabulary).
        max_early: AdaDecode's outstanding early predictions (appendix D: 5).
        row_cost: :attr:`ScheduleCosts.row`.

    Raises:
        InvalidArgumentError: a source that is not on-policy or not in the heads' training
            data, heads without token counts for a reduced vocabulary, bad sizes.
        HeadsNotFoundError, HeadsModelMismatchError: see :func:`load_heads`.
    """
    t0 = time.perf_counter()
    target = find_head_file(path, model_name(engine))
    heads = load_heads(target, engine)
    ex = engine.executor
    chosen = _replay_sources(heads, target, sources, draft_vocabs, ex.vocab_size)
    data = prepare_features(engine, card_request(heads.card.training), heads.layers,
                            StageTimes(), progress)
    (size, tuned, costs, rows), speedups = _best_vocabulary(
        engine, heads, data, chosen, draft_vocabs, max_early, row_cost)
    test = head_trace(heads, data.features, data.items, TEST, chosen, rows)
    gammas = [tuned.gammas.get(layer) for layer in heads.layers]
    held = simulate(test, gammas, ex.num_layers, costs, max_early)
    paper_trace = head_trace(heads, data.features, data.items, TEST, chosen, None)
    paper = simulate(paper_trace, [PAPER_GAMMA] * len(heads.layers), ex.num_layers,
                     _head_costs(engine, heads, None, row_cost), max_early)
    p = tuned.prediction
    card = AdaDecodeCard(
        layers=sorted(tuned.gammas), gammas=[tuned.gammas[k] for k in sorted(tuned.gammas)],
        draft_vocab=size, max_early=max_early, row_cost=costs.row, head_cost=costs.head,
        output_cost=costs.output, data=chosen, tokens=p.tokens, speedup=p.speedup,
        acceptance=p.acceptance, drafts_per_token=p.drafts_per_token, test_tokens=held.tokens,
        test_speedup=held.speedup, test_acceptance=held.acceptance,
        paper_test_speedup=paper.speedup, draft_vocabs=list(draft_vocabs),
        vocab_speedups=speedups)
    heads.card.adadecode = card
    used = [i for i in data.items if i.source in chosen]
    heads.card.set_prompts(items_by_use(used, {CALIBRATION: "calibration", TEST: "test"}))
    save_heads(heads, target)
    return TuneOutcome(target, card, time.perf_counter() - t0)
