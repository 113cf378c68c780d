"""Verified SpecEE's per-layer exit thresholds, chosen by replaying its schedule on held-out
greedy text (selfspec's addition; SpecEE §4 exits at 0.5 at every layer, and selfspec's
``specee`` option takes one threshold for all layers).

**Why the replay applies.** Verified SpecEE (``specee:verify=true``,
:class:`~selfspec.decoding.specee.step.VerifiedSpecEEStep`) puts the predictors' exit decision into
AdaDecode's schedule: an exited token's deeper layers run later, batched with the next tokens,
and verify it. So :func:`~selfspec.training.adadecode_tuning.simulate` replays it with the
predictor layers in place of the heads: per position and predictor layer, the predictor's
output (the confidence) and whether the candidate with the highest local probability there is
the final layer's token (correct; the label the predictors train on). The predictors' features
at a layer are taken against the layer before it whichever predictors run
(:class:`~selfspec.decoding.specee.step.PredictorScan`), so a layer's output does not depend on
which others are switched on.

**Inside a draft.** The drafter of the candidates reads the previous position's last-layer
state at a draft's start and its exit-layer state inside a draft
(:class:`~selfspec.decoding.specee.step.SpecEEExits`), where its candidates are right far less often
(on Qwen2.5-Coder-0.5B the final token is among the top 4 for 57% of positions from a
last-layer state, 32-50% from exit layers 3-18). So the trace holds each position twice more
over: at a draft's start, and inside a draft after an exit at each of a few layers
(:attr:`~selfspec.training.adadecode_tuning.HeadTrace.inner_layers`, the nearest standing in
for the others), with the candidates the file's exit-state drafter (or its main drafter)
drafts there. Replaying every position as at a draft's start overestimated acceptance (82%
against 78% measured).

**Why per-layer thresholds.** As for AdaDecode (:mod:`selfspec.training.adadecode_tuning`): an
accepted exit at layer ``ℓ`` saves about ``L - ℓ`` layer calls and a rejected one wastes the
pending tokens' work wherever it happened, so a shallow layer may exit at a lower confidence
than a deep one, and a layer whose predictor rarely earns its check may be switched off.

**Cost model** (:class:`SpecEECosts`, in single-position decoder-layer calls): the output
layer's cost and a layer call's per-position cost are this machine's, measured
(:func:`~selfspec.training.adadecode_tuning.output_cost_from_latency`,
:func:`~selfspec.training.adadecode_tuning.row_cost_from_latency`); the small parts are priced
by the bytes they read (decoding is bandwidth bound): a predictor check reads the candidates'
``k`` ``lm_head`` rows, the predictor MLP, and at head-lens layers the lens ``T`` (``H×H``);
each position that may exit first runs the drafter (its weights and the draft-vocabulary
rows).

Run by ``selfspec heads train-predictors``: :func:`tune_predictors` (costs from
:func:`replay_costs`) on the predictors' held-out outputs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import cached_latency
from selfspec.heads.card import PredictorTuning
from selfspec.heads.predictor import ExitPredictors
from selfspec.training.adadecode_tuning import (
    DEFAULT_ROW_COST,
    HeadTrace,
    ScheduleCosts,
    SchedulePrediction,
    output_cost_from_latency,
    row_cost_from_latency,
    simulate,
    tune,
)
from selfspec.training.corpus import ONPOLICY, CorpusItem
from selfspec.training.engine import Engine
from selfspec.training.pipeline import in_feature_order

logger = logging.getLogger(__name__)

# Thresholds tried per layer (None = that layer's predictor off). State-reading predictors
# are over-confident on new text (decoding.specee.step.STATE_DEFAULT_ACCURACY), so the grid is
# dense near 1.
# specee's max_early default (selfspec.methods.specee): the schedule the tuning replays.
DEFAULT_MAX_EARLY = 5

DEFAULT_GRID: tuple[float | None, ...] = (0.5, 0.7, 0.8, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99,
                                          0.993, 0.995, 0.998, None)


@dataclass(frozen=True)
class SpecEECosts:
    """Verified SpecEE's cost model (module doc).

    Attributes:
        schedule: row, drafter (``scan``) and output-layer costs
            (:class:`~selfspec.training.adadecode_tuning.ScheduleCosts`; ``head`` unused).
        checks: ``[P]`` cost of each predictor layer's check.
    """

    schedule: ScheduleCosts
    checks: tuple[float, ...]

    @staticmethod
    def from_sizes(layer_bytes: int, check_bytes: Sequence[int], scan_bytes: int,
                   output_bytes: int, row: float = DEFAULT_ROW_COST,
                   output: float | None = None) -> SpecEECosts:
        """Costs proportional to the bytes each part reads.

        Args:
            layer_bytes: one decoder-layer call.
            check_bytes: ``[P]`` one predictor check at each predictor layer.
            scan_bytes: the candidates of one position (the drafter; ``0`` when the candidates
                come from an exit head, whose check is in the first layer's).
            output_bytes: the output layer (``V·H`` weights).
            row: :attr:`ScheduleCosts.row`.
            output: the output layer's cost measured in layer calls
                (:func:`~selfspec.training.adadecode_tuning.output_cost_from_latency`),
                replacing ``output_bytes / layer_bytes``; ``None``: from the bytes.

        Raises:
            InvalidArgumentError: ``layer_bytes < 1``, a negative size, ``row < 0`` or
                ``output <= 0``.
        """
        if (layer_bytes < 1 or min([scan_bytes, output_bytes, *check_bytes]) < 0 or row < 0
                or (output is not None and not output > 0)):
            raise InvalidArgumentError(
                f"SpecEE costs need a positive layer size and sizes, row >= 0, a positive "
                f"output cost; got layer {layer_bytes}, checks {list(check_bytes)}, drafter "
                f"{scan_bytes}, output {output_bytes} bytes / {output}, row {row}")
        out = output_bytes / layer_bytes if output is None else float(output)
        return SpecEECosts(
            ScheduleCosts(row, 0.0, out, scan_bytes / layer_bytes),
            tuple(b / layer_bytes for b in check_bytes))


@dataclass(frozen=True)
class ThresholdTuning:
    """What :func:`tune_thresholds` chose and how it replays.

    Attributes:
        thresholds: ``{ℓ: threshold}`` of the predictor layers left on.
        single: the best single threshold of the grid (every layer on) on the tuning half.
        tuned / tuned_check: the per-layer setting replayed on the tuning half / check half.
        single_check: the single threshold replayed on the check half.
        ceiling_check: :func:`ceiling` on the check half: perfect predictors at every trace
            layer, what better predictors could reach with these candidates and costs.
    """

    thresholds: dict[int, float]
    single: float
    tuned: SchedulePrediction
    tuned_check: SchedulePrediction
    single_check: SchedulePrediction
    ceiling_check: SchedulePrediction


def halves(trace: HeadTrace) -> tuple[HeadTrace, HeadTrace]:
    """The trace's sequences split alternately (even-numbered, odd-numbered) into a tuning and
    a check half, so both see every source.

    Raises:
        InvalidArgumentError: fewer than two sequences.
    """
    if len(trace.lengths) < 2:
        raise InvalidArgumentError(
            f"tuning thresholds needs at least two held-out sequences, got {len(trace.lengths)}")
    starts = [0]
    for n in trace.lengths[:-1]:
        starts.append(starts[-1] + n)
    parts = []
    for parity in (0, 1):
        picked = [(s, n) for i, (s, n) in enumerate(zip(starts, trace.lengths, strict=False))
                  if i % 2 == parity]
        index = torch.cat([torch.arange(s, s + n) for s, n in picked])
        parts.append(trace.select(index, tuple(n for _, n in picked)))
    return parts[0], parts[1]


def tune_thresholds(trace: HeadTrace, num_layers: int, costs: SpecEECosts, max_early: int = 5,
                    grid: Sequence[float | None] = DEFAULT_GRID, rounds: int = 2
                    ) -> ThresholdTuning:
    """Per-layer exit thresholds for verified SpecEE (module doc): on the tuning half of
    ``trace`` (:func:`halves`), the best single threshold of ``grid``, then coordinate ascent
    per layer from it (a layer may be switched off); both replayed on the check half.

    Args:
        trace: ``confidence [N, P]`` predictor outputs, ``correct [N, P]`` labels, over
            held-out on-policy sequences.
        num_layers: ``L``.
        costs: :class:`SpecEECosts` with one check cost per trace layer.
        max_early: exited tokens outstanding before one must run every layer.
        grid: thresholds tried, ``None`` = off.
        rounds: coordinate-ascent sweeps.

    Raises:
        InvalidArgumentError: check costs of the wrong length, fewer than two sequences, or
            an empty grid / a threshold outside [0, 1).
    """
    if len(costs.checks) != len(trace.layers):
        raise InvalidArgumentError(
            f"{len(costs.checks)} check costs for {len(trace.layers)} predictor layers")
    singles = [g for g in grid if g is not None]
    if not singles:
        raise InvalidArgumentError(f"the grid needs at least one threshold, got {list(grid)}")
    tuning, check = halves(trace)

    def run(text: HeadTrace, gammas: Sequence[float | None]) -> SchedulePrediction:
        return simulate(text, gammas, num_layers, costs.schedule, max_early, costs.checks)

    width = len(trace.layers)
    single = max(singles, key=lambda g: _score(run(tuning, [g] * width)))
    found = tune(tuning, num_layers, costs.schedule, max_early, grid, [single] * width, rounds,
                 costs.checks)
    gammas = [found.gammas.get(layer) for layer in trace.layers]
    return ThresholdTuning(found.gammas, single, found.prediction, run(check, gammas),
                           run(check, [single] * width),
                           ceiling(check, num_layers, costs, max_early))


def ceiling(trace: HeadTrace, num_layers: int, costs: SpecEECosts,
            max_early: int = DEFAULT_MAX_EARLY) -> SchedulePrediction:
    """The replay with perfect predictors: every trace layer on, each firing exactly where its
    top local candidate is the final token (confidence = label), so every exit is accepted
    and each token exits at its first such layer. It is about the most better predictors could
    give with the same candidates, layers and costs (a later exit than the first correct
    layer, or a rejected one, costs more; switching a layer off would save only its check), and
    separates the predictors' share of a shortfall from the candidates' and the schedule's.

    Args:
        trace: ``correct [N, P]`` labels over held-out sequences (the confidence is ignored).
        num_layers / costs / max_early: as :func:`tune_thresholds`.

    Raises:
        InvalidArgumentError: check costs of the wrong length.
    """
    if len(costs.checks) != len(trace.layers):
        raise InvalidArgumentError(
            f"{len(costs.checks)} check costs for {len(trace.layers)} predictor layers")
    return simulate(trace.perfect(), [0.5] * len(trace.layers), num_layers, costs.schedule,
                    max_early,
                    costs.checks)


def _score(p: SchedulePrediction) -> float:
    return -math.inf if math.isnan(p.speedup) else p.speedup


def predictor_trace(prob: torch.Tensor, labels: torch.Tensor, layers: Sequence[int],
                    sequence: torch.Tensor,
                    inner: tuple[Sequence[int], torch.Tensor, torch.Tensor] | None = None
                    ) -> HeadTrace:
    """The replay's input from the predictors' held-out outputs.

    Args:
        prob: ``[P, N]`` predictor outputs (:func:`~selfspec.training.predictors.predictor_probs`).
        labels: ``[P, N]`` bool, the top local candidate is the final token.
        layers: ``[P]`` predictor layers.
        sequence: ``[N]`` int, which sequence each position belongs to; positions of one
            sequence are consecutive and in text order.
        inner: ``(exit layers [E], prob [E, P, N], labels [E, P, N])``: the same positions
            inside a draft, candidates drafted from the previous position's state at each
            exit layer (:attr:`HeadTrace.inner_layers`); ``None``: none.

    Raises:
        InvalidArgumentError: shapes that disagree, or a sequence split in two.
    """
    if prob.shape != labels.shape or prob.shape[0] != len(layers) or \
            sequence.shape != (prob.shape[1],):
        raise InvalidArgumentError(
            f"predictor trace: prob {tuple(prob.shape)}, labels {tuple(labels.shape)}, "
            f"{len(layers)} layers, sequence ids {tuple(sequence.shape)}")
    ids, counts = torch.unique_consecutive(sequence, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        raise InvalidArgumentError("predictor trace: a sequence's positions are not consecutive")
    if inner is None:
        extra = ((), None, None)
    else:
        exits, inner_prob, inner_labels = inner
        extra = (tuple(int(x) for x in exits),
                 inner_prob.transpose(1, 2).float().contiguous(),
                 inner_labels.transpose(1, 2).contiguous())
    return HeadTrace(tuple(int(x) for x in layers), prob.t().float().contiguous(),
                     labels.t().contiguous(), tuple(int(c) for c in counts), *extra)


@dataclass(frozen=True)
class InnerOutputs:
    """The predictors on the held-out positions as they stand inside a draft.

    Attributes:
        layers: ``[E]`` exit layers of the previous position, increasing.
        prob: ``[E, P, N]`` predictor outputs with the candidates drafted from the previous
            position's state leaving layer ``layers[e] - 1``.
        labels: ``[E, P, N]`` bool, the top local candidate is the final token.
        drafter: ``"exit-state"`` (the file's exit-state drafter drafted them, as decoding
            does by default) or ``"main"``.
    """

    layers: tuple[int, ...]
    prob: torch.Tensor
    labels: torch.Tensor
    drafter: str


@dataclass(frozen=True)
class ReplayCosts:
    """The tuning replay's measured or given costs and where each came from (``"given"``,
    ``"measured: <latency key>"``, ``"bytes"``).

    Attributes:
        row / row_source: :attr:`~selfspec.training.adadecode_tuning.ScheduleCosts.row`.
        output / output_source: the output layer in single-position layer calls, or
            ``None``: from its weight bytes.
    """

    row: float
    row_source: str
    output: float | None = None
    output_source: str = "bytes"


def replay_costs(engine: Engine, row: float | None, output: float | str) -> ReplayCosts:
    """The tuning replay's row and output-layer costs: as given, or this machine's from its
    latency model (measured once and kept), or (``output="bytes"``) from the weights."""
    if row is not None and row < 0:
        raise InvalidArgumentError(f"--row-cost must be >= 0, got {row}")
    if isinstance(output, str) and output not in ("auto", "bytes"):
        raise InvalidArgumentError(f"--output-cost must be auto, bytes or a number > 0, got "
                                   f"{output!r}")
    if not isinstance(output, str) and not output > 0:
        raise InvalidArgumentError(f"--output-cost must be > 0, got {output}")
    latency = None
    if row is None or output == "auto":
        from selfspec.models.provision import selfspec_home

        latency = cached_latency(engine.executor, selfspec_home())
    measured = "" if latency is None else f"measured: {latency.key}"
    if row is None:
        row, row_source = row_cost_from_latency(latency), measured
    else:
        row, row_source = float(row), "given"
    if output == "auto":
        out, out_source = output_cost_from_latency(latency), measured
    elif output == "bytes":
        out, out_source = None, "bytes"
    else:
        out, out_source = float(output), "given"
    logger.info("replay costs: one more position %.3f (%s), output layer %s (%s)", row,
                row_source, "from bytes" if out is None else f"{out:.2f}", out_source)
    return ReplayCosts(row, row_source, out, out_source)


def tune_predictors(engine: Engine, items: Sequence[CorpusItem], eval_idx: torch.Tensor,
                    model: ExitPredictors, prob: torch.Tensor, labels: torch.Tensor,
                    layers: Sequence[int], lenses: dict[int, object], candidates: torch.nn.Module,
                    rows: torch.Tensor | None,
                    costs_in: ReplayCosts = ReplayCosts(DEFAULT_ROW_COST, "given"),
                    max_early: int = DEFAULT_MAX_EARLY,
                    inner: InnerOutputs | None = None) -> PredictorTuning | None:
    """Verified SpecEE's per-layer thresholds by replay on the held-out positions of on-policy
    text (:mod:`selfspec.training.specee_tuning`), or ``None`` (logged) when there are fewer
    than two such sequences (teacher-forced text is not what greedy decoding visits).

    Args:
        items: the corpus; eval_idx: ``[N]`` held-out positions; model: the predictors;
            prob / labels: their ``[P, N]`` outputs and the labels there; layers: ``[P]``
            their layers; lenses: ``{ℓ: head}``
            of the head lens; candidates: the drafter, or the exit head drafting the
            candidates; rows: the draft-vocabulary rows (``None``: every token); costs_in:
            the row and output-layer costs and their sources; inner: the positions as they
            stand inside a draft (``None``: replayed as at a draft's start).
    """
    ordered = in_feature_order(items)
    counts = torch.tensor([i.num_scored for i in ordered])
    sequence = torch.repeat_interleave(torch.arange(len(ordered)), counts)
    onpolicy = torch.repeat_interleave(
        torch.tensor([i.source.startswith(ONPOLICY) for i in ordered]), counts)
    keep = onpolicy[eval_idx]
    replayed = sequence[eval_idx][keep]
    seqs = torch.unique(replayed).tolist()
    if len(seqs) < 2:
        logger.info("no per-layer SpecEE thresholds: fewer than two held-out on-policy "
                    "sequences (give --data onpolicy:DATASET)")
        return None
    trace = predictor_trace(prob[:, keep], labels[:, keep], layers, replayed,
                            None if inner is None else
                            (inner.layers, inner.prob[:, :, keep], inner.labels[:, :, keep]))
    ex = engine.executor
    hidden = ex.model.lm_head.in_features
    element = torch.tensor([], dtype=ex.dtype).element_size()
    predictors = list(layers)
    mlp = sum(p.numel() for p in model.parameters()) // len(predictors)  # one layer's MLP
    checks = [(model.num_candidates * hidden + mlp
               + (hidden * hidden if layer in lenses else 0)) * element for layer in predictors]
    scored = ex.vocab_size if rows is None else int(rows.numel())
    scan = (sum(p.numel() for p in candidates.parameters()) + scored * hidden) * element
    costs = SpecEECosts.from_sizes(ex.decode_layer_bytes(0), checks, scan,
                                   ex.output_decode_bytes, costs_in.row, costs_in.output)
    found = tune_thresholds(trace, ex.num_layers, costs, max_early)
    kept = sorted(found.thresholds)
    sources = sorted({ordered[i].source for i in seqs})  # what was replayed
    logger.info("SpecEE per-layer thresholds %s (single %s): replayed speedup %.3f, check "
                "half %.3f (single %.3f, perfect predictors %.3f)", found.thresholds,
                found.single, found.tuned.speedup, found.tuned_check.speedup,
                found.single_check.speedup, found.ceiling_check.speedup)
    return PredictorTuning(
        layers=kept, thresholds=[found.thresholds[x] for x in kept],
        single_threshold=found.single, max_early=max_early, row_cost=costs.schedule.row,
        row_cost_source=costs_in.row_source, output_cost_source=costs_in.output_source,
        inner_layers=[] if inner is None else list(inner.layers),
        inner_drafter="" if inner is None else inner.drafter,
        scan_cost=costs.schedule.scan, output_cost=costs.schedule.output,
        check_costs=[costs.checks[predictors.index(x)] for x in kept], data=sources,
        tokens=found.tuned.tokens, speedup=found.tuned.speedup,
        acceptance=found.tuned.acceptance, drafts_per_token=found.tuned.drafts_per_token,
        check_tokens=found.tuned_check.tokens, check_speedup=found.tuned_check.speedup,
        check_acceptance=found.tuned_check.acceptance,
        single_check_speedup=found.single_check.speedup,
        ceiling_check_speedup=found.ceiling_check.speedup)
