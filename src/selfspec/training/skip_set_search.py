"""Offline search for a fixed sub-layer skip set (SWIFT, Xia et al. 2024, §3 "layer set
optimization"; summarised in KnapSpec §1.1, §2.2 and §5).

SWIFT drafts with the attention and MLP sub-layers a fixed skip set keeps. The set skips a
fixed share of the sub-layers (skip ratio r = 0.45 in SWIFT's code, ``--skip-ratio``) and is
chosen to maximise the *matchness* of the drafts: the fraction of positions where the
skip-set model's greedy token equals the full model's greedy token.

Scoring (:class:`MatchnessScorer`): each calibration sequence (token ids: a prompt and the
model's own greedy continuation) is run once through the full model, which fills a KV cache
and gives the full model's greedy label at every position. A plan is then scored in windows
of ``window`` positions: positions ``p .. p+window-1`` run through the plan read-only
(``score_layers(..., skip=plan)``), attending to the full model's KV of the
positions before ``p`` and to each other. This mirrors drafting, where a draft token attends
to the committed (full-model) KV and to the earlier draft tokens; SWIFT's code scores one
window of 32 generated tokens the same way (``swift_optimization``, ``context_window=32``).

Search (:func:`search_skip_set`): ``trials`` random skip sets of exactly the skip count,
then a local search from the best: swap one skipped sub-layer with one kept one, keep the
swap when it raises the matchness, stop after ``refine_steps`` evaluations in a row without a
gain, when every swap of the current best has been tried (a local optimum), or at
``max_evaluations``. SWIFT proper alternates random search with Bayesian optimisation (a
Gaussian process with a UCB acquisition every 25 iterations); this module does random search
followed by local search, which needs no GP package and uses every evaluation to improve the
current best. The scoring function is a parameter, so the search is testable without a model.

Sub-layers are numbered ``2 * layer`` (attention) and ``2 * layer + 1`` (MLP), 0-based.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan

logger = logging.getLogger(__name__)

Scorer = Callable[[SkipPlan], float]


# ------------------------------------------------------------------------------ masks
def plan_of(skipped: Sequence[int] | frozenset[int]) -> SkipPlan:
    """The :class:`SkipPlan` of sub-layer indices (``2l`` = attention of layer ``l``,
    ``2l+1`` = its MLP)."""
    return SkipPlan(frozenset(k // 2 for k in skipped if k % 2 == 0),
                    frozenset(k // 2 for k in skipped if k % 2 == 1))


def sublayers_of(plan: SkipPlan) -> frozenset[int]:
    """Inverse of :func:`plan_of`: the skipped sub-layer indices of ``plan``."""
    return frozenset([2 * i for i in plan.skip_attention] + [2 * i + 1 for i in plan.skip_mlp])


def searchable_sublayers(num_layers: int, keep_ends: bool = True) -> list[int]:
    """Sub-layers a skip set may contain: all ``2L``, or (``keep_ends``, SWIFT's code) all
    but those of the first and the last layer."""
    first, last = (1, num_layers - 1) if keep_ends and num_layers > 2 else (0, num_layers)
    return list(range(2 * first, 2 * last))


def skip_count(num_candidates: int, skip_ratio: float) -> int:
    """Sub-layers skipped: ``round(skip_ratio * num_candidates)`` (SWIFT: 45% of the
    searchable sub-layers)."""
    return int(round(skip_ratio * num_candidates))


# ---------------------------------------------------------------------------- scoring
@dataclass(frozen=True)
class CalibrationSequence:
    """One calibration text.

    Attributes:
        token_ids: the whole sequence (prompt + the model's greedy continuation).
        score_from: first position whose next-token prediction is scored (the prompt's last
            token: drafting only ever happens inside a response).
    """

    token_ids: tuple[int, ...]
    score_from: int

    @property
    def num_scored(self) -> int:
        """Positions ``t`` in ``[score_from, len - 1)`` (each has a next token)."""
        return max(0, len(self.token_ids) - 1 - self.score_from)


@dataclass
class _Prepared:
    """A calibration sequence after the full model's pass (KV cache and labels kept)."""

    embeds: torch.Tensor      # [1, n, H] token embeddings
    cache: object             # KVCache filled with the full model's KV of all n positions
    labels: torch.Tensor      # [m] full model's greedy token at the scored positions
    score_from: int
    end: int                  # one past the last scored position (n - 1)


class MatchnessScorer:
    """Matchness of skip plans on calibration sequences (see the module doc).

    The full model runs once per sequence at construction; each call then costs one
    read-only pass of the plan over the scored positions plus ``lm_head``.

    Args:
        executor: the model's executor.
        sequences: calibration sequences; those with no scored position are ignored.
        window: positions per read-only window (>= 1): the draft length being mirrored.

    Raises:
        InvalidArgumentError: ``window < 1`` or no scored position at all.
    """

    def __init__(self, executor: LayerExecutor, sequences: Sequence[CalibrationSequence],
                 window: int = 8) -> None:
        if window < 1:
            raise InvalidArgumentError(f"window must be >= 1, got {window}")
        self.executor = executor
        self.window = window
        self._prepared = [self._prepare(s) for s in sequences if s.num_scored > 0]
        self.num_positions = sum(p.labels.numel() for p in self._prepared)
        if self.num_positions == 0:
            raise InvalidArgumentError(
                "no calibration positions to score: give prompts with a continuation")

    @torch.inference_mode()
    def _prepare(self, seq: CalibrationSequence) -> _Prepared:
        ex = self.executor
        n = len(seq.token_ids)
        ids = torch.tensor([seq.token_ids], device=ex.device)                   # [1, n]
        cache = ex.new_cache(capacity=n)
        embeds = ex.embed(ids)                                                  # [1, n, H]
        hidden = ex.run_layers(embeds, torch.arange(n, device=ex.device)[None], 0,
                               ex.num_layers, cache)
        end = n - 1
        labels = ex.logits(hidden[:, seq.score_from:end])[0].argmax(-1)         # [m]
        return _Prepared(embeds, cache, labels, seq.score_from, end)

    @torch.inference_mode()
    def matches(self, plan: SkipPlan) -> int:
        """Scored positions where ``plan``'s greedy token equals the full model's."""
        ex = self.executor
        total = 0
        for prep in self._prepared:
            outs = []
            for p in range(prep.score_from, prep.end, self.window):
                e = min(p + self.window, prep.end)
                positions = torch.arange(p, e, device=ex.device)[None]          # [1, w]
                outs.append(ex.score_layers(prep.embeds[:, p:e], positions, 0, ex.num_layers,
                                            prep.cache, plan))  # [1, w, H]
            # one lm_head call per sequence: larger matmuls than one per window
            tokens = ex.logits(torch.cat(outs, dim=1))[0].argmax(-1)            # [m]
            total += int((tokens == prep.labels).sum())
        return total

    def __call__(self, plan: SkipPlan) -> float:
        """Matchness of ``plan`` in [0, 1]."""
        return self.matches(plan) / self.num_positions


# ----------------------------------------------------------------------------- search
@dataclass(frozen=True)
class SearchSettings:
    """Settings of :func:`search_skip_set`.

    Attributes:
        skip_ratio: share of the searchable sub-layers skipped, in (0, 1) (SWIFT: 0.45).
        trials: random skip sets scored first (>= 1).
        refine_steps: the local search stops after this many evaluations in a row without
            a gain (>= 0; 0 = random search only). SWIFT's ``max_tolerance_iter`` is 300.
        max_evaluations: total evaluations, random and local (>= ``trials``). SWIFT's
            ``max_opt_iter`` is 1000, with evaluations on 32 tokens each.
        keep_ends: never skip the first and the last layer (SWIFT's code).
        seed: seed of the random sets and of the order swaps are tried in.
    """

    skip_ratio: float = 0.45
    trials: int = 16
    refine_steps: int = 32
    max_evaluations: int = 100
    keep_ends: bool = True
    seed: int = 0

    def check(self) -> None:
        """Raises InvalidArgumentError for a value outside its range."""
        if not 0 < self.skip_ratio < 1:
            raise InvalidArgumentError(f"skip_ratio must be in (0, 1), got {self.skip_ratio}")
        if self.trials < 1:
            raise InvalidArgumentError(f"trials must be >= 1, got {self.trials}")
        if self.refine_steps < 0:
            raise InvalidArgumentError(f"refine_steps must be >= 0, got {self.refine_steps}")
        if self.max_evaluations < self.trials:
            raise InvalidArgumentError(
                f"max_evaluations ({self.max_evaluations}) must be >= trials ({self.trials})")


@dataclass(frozen=True)
class Evaluation:
    """One scored skip set.

    Attributes:
        plan: the skip set.
        score: its matchness.
        phase: ``"random"`` or ``"local"``.
        best: the best score so far, this one included.
    """

    plan: SkipPlan
    score: float
    phase: str
    best: float


@dataclass
class SkipSearchResult:
    """What :func:`search_skip_set` found.

    Attributes:
        plan: the best skip set.
        score: its matchness.
        num_skipped: sub-layers it skips.
        candidates: sub-layers the search could skip.
        evaluations: every evaluation in order (``best`` gives the best-so-far curve).
        seconds: wall time of the search (scoring included).
        local_optimum: the local search tried every swap of the best set without a gain.
    """

    plan: SkipPlan
    score: float
    num_skipped: int
    candidates: list[int]
    evaluations: list[Evaluation] = field(default_factory=list)
    seconds: float = 0.0
    local_optimum: bool = False


def search_skip_set(score: Scorer, num_layers: int, settings: SearchSettings | None = None,
                    on_evaluation: Callable[[Evaluation], None] | None = None) -> SkipSearchResult:
    """Random search, then swap local search, for the skip set of highest ``score``
    (SWIFT's layer set optimisation, without its Bayesian-optimisation steps; see the
    module doc).

    Args:
        score: ``score(plan) -> float`` to maximise (a :class:`MatchnessScorer`).
        num_layers: ``L``.
        settings: :class:`SearchSettings` (defaults if ``None``).
        on_evaluation: called after every evaluation (progress bars).

    Returns:
        :class:`SkipSearchResult`; every evaluated set skips exactly
        ``skip_count(len(candidates), skip_ratio)`` sub-layers.

    Raises:
        InvalidArgumentError: a setting outside its range, or a skip count of 0 or of every
            searchable sub-layer.
    """
    settings = settings or SearchSettings()
    settings.check()
    candidates = searchable_sublayers(num_layers, settings.keep_ends)
    count = skip_count(len(candidates), settings.skip_ratio)
    if not 0 < count < len(candidates):
        raise InvalidArgumentError(
            f"skip ratio {settings.skip_ratio} skips {count} of the {len(candidates)} "
            f"searchable sub-layers of a {num_layers}-layer model; choose a ratio that skips "
            "at least one and keeps at least one")
    rng = random.Random(settings.seed)
    t0 = time.perf_counter()
    seen: dict[frozenset[int], float] = {}
    evaluations: list[Evaluation] = []
    best_mask: frozenset[int] | None = None
    best = -math.inf

    def evaluate(mask: frozenset[int], phase: str) -> float:
        nonlocal best, best_mask
        value = float(score(plan_of(mask)))
        seen[mask] = value
        if value > best:
            best, best_mask = value, mask
        record = Evaluation(plan_of(mask), value, phase, best)
        evaluations.append(record)
        if on_evaluation is not None:
            on_evaluation(record)
        return value

    # 1. random search: distinct random sets (fewer if the space is smaller than ``trials``)
    space = math.comb(len(candidates), count)
    for _ in range(min(settings.trials, space)):
        mask = frozenset(rng.sample(candidates, count))
        while mask in seen:
            mask = frozenset(rng.sample(candidates, count))
        evaluate(mask, "random")
    logger.info("random search: best matchness %.4f of %d sets", best, len(evaluations))

    # 2. local search: swap one skipped and one kept sub-layer of the best set
    stale = 0
    local_optimum = False
    while stale < settings.refine_steps and len(evaluations) < settings.max_evaluations:
        assert best_mask is not None
        kept = [k for k in candidates if k not in best_mask]
        swaps = [best_mask - {s} | {k} for s in sorted(best_mask) for k in kept]
        untried = [m for m in swaps if m not in seen]
        if not untried:
            local_optimum = True
            break
        before = best
        evaluate(untried[rng.randrange(len(untried))], "local")
        stale = 0 if best > before else stale + 1
    assert best_mask is not None
    result = SkipSearchResult(plan_of(best_mask), best, count, candidates, evaluations,
                              time.perf_counter() - t0, local_optimum)
    logger.info("skip-set search: matchness %.4f after %d evaluations (%.1f s)%s", best,
                len(evaluations), result.seconds, ", a local optimum" if local_optimum else "")
    return result
