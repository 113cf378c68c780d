"""SpecEE: per-layer predictors fed with features of ``k`` speculative tokens decide when the
forward pass may stop (Xu et al. 2025, §4-5). Lossy (the paper: < 1% accuracy loss).

A composition: :class:`~selfspec.decoding.specee.HeadCandidates` (the exit head at the
predictors' candidate layer) + :class:`~selfspec.heads.predictor.ExitPredictors` (stored in the
same head file, ``selfspec heads train-predictors``) + :class:`PredictorSchedule` + a policy
for the skipped layers' KV (:mod:`selfspec.decoding.skipped_kv`), in
:class:`~selfspec.decoding.specee.SpecEEStep`.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.loop import Step
from selfspec.decoding.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.decoding.specee import (
    CANDIDATE_SOURCES,
    HeadCandidates,
    PredictorSchedule,
    SpecEEStep,
)
from selfspec.errors import InvalidArgumentError
from selfspec.heads.files import DEFAULT as DEFAULT_HEADS
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.options import option

SCHEDULES = ("two-level", "all")


@dataclass(frozen=True)
class Options:
    """SpecEE's options (defaults: the paper's, §4-5, except ``threshold``: measured)."""

    heads: str = option(DEFAULT_HEADS, "head file holding the candidate head and the SpecEE "
                        "predictors ('default' or a path; `selfspec heads train-predictors`)")
    threshold: float = option(0.9, "exit when a layer's predictor output exceeds this (the "
                              "paper: 0.5; with exit-head candidates 0.5 lost every HumanEval "
                              "problem on Qwen2.5-Coder-0.5B, docs/results/specee)",
                              low=0, high=1, low_open=True, high_open=True)
    kv: str = option("propagate", "KV of the layers an exited token skipped: 'deferred' (run "
                     "later with the next token, exact), 'propagate' (CALM: K/V projections "
                     "of the exit state), 'skip' (none, as the SpecEE code)",
                     choices=KV_POLICIES)
    schedule: str = option("two-level", "'two-level' (offline top layers + neighbours of the "
                           "last 5 exits, §5) or 'all' (every predictor, every token)",
                           choices=SCHEDULES)
    offline_layers: int | None = option(None, "size of the offline layer set (most frequent "
                                        "held-out exit layers first)", low=0, high="L-1",
                                        default_text="as trained (the card's offline_layers)")
    draft_vocab: int | None = option(None, "candidates are the head's top-k over the K most "
                                     "frequent tokens", low=1, high="V",
                                     default_text="as trained (the card's draft_vocab)")
    candidates: str | None = option(None, "'head' (the head's top-k) or 'head+ngram' (the "
                                    "prompt-lookup token replaces the k-th when missing)",
                                    choices=CANDIDATE_SOURCES,
                                    default_text="as trained (the card's candidates)")


def build(context: MethodContext, options: Options) -> Step:
    """SpecEE's Step for the predictors in ``options.heads``.

    Raises:
        InvalidArgumentError: the head file has no predictors, or no head at their
            candidate layer.
        HeadsNotFoundError, HeadsModelMismatchError, CorruptModelFileError: see
            :func:`selfspec.heads.load_heads`.
    """
    ex = context.executor
    trained = context.heads(options.heads)
    pc = trained.card.predictors
    if trained.predictors is None or pc is None:
        raise InvalidArgumentError(
            f"specee: the head file {options.heads!r} holds no SpecEE predictors; train them "
            f"with `selfspec heads train-predictors --model {ex.name}`")
    head = trained.head_at(pc.candidate_layer)
    size = options.draft_vocab if options.draft_vocab is not None else (pc.draft_vocab or None)
    if size is not None:
        vocab = context.draft_vocab(trained, size)
        call = context.restricted(head, vocab)
    else:
        vocab = None
        call = lambda hidden: ex.logits(hidden, head)
    source = options.candidates or pc.candidates
    candidates = HeadCandidates(ex, pc.candidate_layer, call, pc.num_candidates, vocab,
                                ngram=source == "head+ngram")
    if options.schedule == "all":
        offline = None
    else:
        n = len(pc.offline_layers) if options.offline_layers is None else options.offline_layers
        offline = pc.offline_layers[:n]
    schedule = PredictorSchedule(trained.predictors.layers, offline)
    return SpecEEStep(candidates, trained.predictors, schedule, options.threshold,
                      lambda executor, cache: make_skipped_kv(options.kv, executor, cache))


SPEC = MethodSpec(
    name="specee",
    summary="speculative early exit: per-layer predictors on k candidate tokens stop the "
            "forward pass (lossy)",
    lossless=False,
    paper="SpecEE §4-5 (predictor features, two-level scheduling); skipped-layer KV: "
          "decoding/skipped_kv.py",
    options=Options, build=build, heads_files=lambda options: [str(options.heads)])
