"""SpecEE: per-layer predictors fed with features of ``k`` speculative tokens decide when the
forward pass may stop (Xu et al. 2025, §4-5). Lossy (the paper: < 1% accuracy loss), or
lossless with ``verify=true``.

A composition: :class:`~selfspec.decoding.specee.step.HeadCandidates` (the exit head at the
predictors' candidate layer) + :class:`~selfspec.heads.predictor.ExitPredictors` (stored in the
same head file, ``selfspec heads train-predictors``) + :class:`PredictorSchedule` + a policy
for the skipped layers' KV (:mod:`selfspec.decoding.specee.skipped_kv`), in
:class:`~selfspec.decoding.specee.step.SpecEEStep`. ``verify=true`` puts the same exit decision
(:class:`~selfspec.decoding.specee.step.SpecEEExits`) into AdaDecode's schedule: exited tokens'
deeper layers run batched with later tokens and verify them
(:class:`~selfspec.decoding.specee.step.VerifiedSpecEEStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.specee.kernel import (
    KERNEL_CHOICES,
    candidate_kernel,
    layer_decision,
)
from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.decoding.specee.step import (
    CANDIDATE_SOURCES,
    DrafterCandidates,
    HeadCandidates,
    PredictorScan,
    PredictorSchedule,
    SpecEEDrafter,
    SpecEEExits,
    SpecEEStep,
    VerifiedSpecEEStep,
    depth_thresholds,
)
from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import PredictorCard
from selfspec.heads.files import DEFAULT as DEFAULT_HEADS
from selfspec.heads.files import ExitHeads
from selfspec.heads.modules import LightweightHead
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.options import HEAD_FILE, changed_options, option

SCHEDULES = ("two-level", "all")
DEFAULT_THRESHOLD = 0.9
# State-reading predictors train where the candidates are right more often than on new text
# (heads/predictor.py), so their outputs are over-confident: 0.9 kept 84% of held-out tokens
# on Qwen2.5-Coder-1.5B. Their default threshold is read off the card's held-out sweep.
STATE_DEFAULT_ACCURACY = 0.97


@dataclass(frozen=True)
class Options:
    """SpecEE's options (defaults: the paper's, §4-5, except ``threshold`` and ``kv``: measured)."""

    heads: str = option(DEFAULT_HEADS, "head file holding the candidate head or drafter and "
                        "the SpecEE predictors ('default' or a path; "
                        "`selfspec heads train-predictors`)",
                        asset=HEAD_FILE)
    threshold: float | None = option(
        None, "exit when a layer's predictor output exceeds this (the paper: 0.5; with "
        "exit-head candidates 0.5 lost every HumanEval problem on Qwen2.5-Coder-0.5B, "
        "docs/results/specee)", low=0, high=1, low_open=True, high_open=True,
        default_text=f"{DEFAULT_THRESHOLD}; state-reading predictors: as accuracy="
                     f"{STATE_DEFAULT_ACCURACY}")
    accuracy: float | None = option(
        None, "instead of threshold: the lowest threshold of the card's held-out sweep whose "
        "token accuracy (share of tokens equal to the final layer's) reaches this",
        low=0, high=1, low_open=True, high_open=True, default_text="none")
    # 'deferred' is the default by the accuracy-speed Pareto plots of both models (the SpecEE
    # results): on Qwen2.5-Coder-0.5B it was both faster and more accurate than
    # the other two, on the 1.5B within one problem of 'propagate'.
    kv: str = option("deferred", "KV of the layers an exited token skipped: 'deferred' (run "
                     "later, batched with the next token, exact), 'propagate' (CALM: K/V "
                     "projections of the exit state), 'skip' (none, as the SpecEE code)",
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
    candidates: str | None = option(None, "'head' (the candidate head's top-k), 'drafter' "
                                    "(the file's next-token drafter's top-k, before layer 0), "
                                    "each with '+ngram' (the prompt-lookup token replaces the "
                                    "k-th when missing); the predictors' drafter only",
                                    choices=CANDIDATE_SOURCES,
                                    default_text="as trained (the card's candidates)")
    verify: bool = option(False, "verify exited tokens: their skipped layers run later, "
                          "batched with the next tokens (as kv=deferred), and the last layer's "
                          "token replaces a wrong one (AdaDecode §2.2's verification; lossless)")
    max_early: int = option(5, "with verify: most exited tokens outstanding before one must "
                            "run every layer", low=1, high="R-1")
    shallow_threshold: float | None = option(
        None, "the threshold at the first predictor layer, rising linearly to threshold at the "
        "last (ours: a shallow exit saves more layers for the same risk)", low=0, high=1,
        low_open=True, high_open=True, default_text="threshold at every layer")
    tuned: bool = option(False, "with verify: the per-layer thresholds (and the layers they "
                         "keep) tuned by replay on the predictors' held-out text, from the "
                         "card (`selfspec heads train-predictors`; ours)")
    kernel: str = option("auto", "each layer's features and predictor: 'auto' (one compiled "
                         "call on bf16 CPU models where it agrees with torch, else torch), "
                         "'kernel' (that call, or an error saying why not), 'torch'",
                         choices=KERNEL_CHOICES)
    exit_drafter: bool = option(True, "drafter candidates after an exited token come from the "
                                "file's exit-state drafter, which reads exit-layer states "
                                "(`selfspec heads train-drafter`), when it has one; false: "
                                "the main drafter reads them")


def _family(source: str) -> str:
    """``"head"`` or ``"drafter"``: the drafter of a candidate source, n-gram merge aside."""
    return source.removesuffix("+ngram")


def exit_threshold(options: Options, card: PredictorCard) -> float:
    """The predictors' exit threshold: ``options.threshold``; with ``options.accuracy`` (or by
    default for state-reading predictors, accuracy :data:`STATE_DEFAULT_ACCURACY`) the lowest
    threshold of the card's held-out sweep (``thresholds`` / ``token_accuracy``) reaching it;
    else :data:`DEFAULT_THRESHOLD`.

    Raises:
        InvalidArgumentError: both ``threshold`` and ``accuracy`` given, or no threshold of
            the sweep reaches the accuracy (the message gives the sweep's best).
    """
    if options.threshold is not None and options.accuracy is not None:
        raise InvalidArgumentError("specee: give threshold or accuracy, not both")
    if options.threshold is not None:
        return options.threshold
    target = options.accuracy
    if target is None and card.state_dim:
        target = STATE_DEFAULT_ACCURACY
    if target is None:
        return DEFAULT_THRESHOLD
    reached = [t for t, a in sorted(zip(card.thresholds, card.token_accuracy)) if a >= target]
    if not reached:
        best = max(card.token_accuracy, default=float("nan"))
        raise InvalidArgumentError(
            f"specee: no threshold on the predictors' held-out sweep reaches token accuracy "
            f"{target} (best {best:.4f} at thresholds {card.thresholds}); give a lower accuracy "
            f"or an explicit threshold")
    return reached[0]


def build(context: MethodContext, options: Options) -> Step:
    """SpecEE's Step for the predictors in ``options.heads``.

    Raises:
        InvalidArgumentError: ``kv`` other than ``deferred`` with ``verify``, ``max_early``
            without it; ``tuned`` without ``verify``, with an option it replaces or on
            predictors without tuning; the head file has no predictors, no head at their candidate
            layer (head candidates) or no drafter (drafter candidates), or ``candidates``
            names another drafter than the predictors were trained with; ``kernel=kernel``
            where the compiled predictors cannot run (the message says why).
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
    source = options.candidates or pc.candidates
    if _family(source) != _family(pc.candidates):
        raise InvalidArgumentError(
            f"specee: the predictors in {options.heads!r} were trained on {pc.candidates!r} "
            f"candidates; candidates={source!r} would feed them features they never saw. Use "
            f"candidates={_family(pc.candidates)} or {_family(pc.candidates)}+ngram, or train "
            f"predictors for {_family(source)!r} candidates (`selfspec heads train-predictors "
            f"--candidates {source}`)")
    size = options.draft_vocab if options.draft_vocab is not None else (pc.draft_vocab or None)
    vocab = context.draft_vocab(trained, size) if size is not None else None
    ngram = source.endswith("+ngram")
    if _family(source) == "drafter":
        if trained.drafter is None:
            raise InvalidArgumentError(
                f"specee: the head file {options.heads!r} holds no drafter; train one with "
                f"`selfspec heads train-drafter {options.heads} --model {ex.name}`")
        output = context.restricted(None, vocab) if vocab is not None else ex.logits
        rows = None if vocab is None else vocab.rows
        key = (None if vocab is None else vocab.key, options.kernel)
        fused = context.derived(
            "specee-candidates", trained, key,
            lambda: candidate_kernel(ex, trained.drafter, output, rows, pc.num_candidates,
                                     options.kernel))
        exit_drafter = trained.exit_drafter if options.exit_drafter else None
        exit_fused = None if exit_drafter is None else context.derived(
            "specee-exit-candidates", trained, key,
            lambda: candidate_kernel(ex, exit_drafter, output, rows, pc.num_candidates,
                                     options.kernel))
        candidates = DrafterCandidates(ex, trained.drafter, pc.candidate_layer, output,
                                       pc.num_candidates, vocab, ngram=ngram, fused=fused,
                                       exit_drafter=exit_drafter, exit_fused=exit_fused)
    else:
        head = trained.head_at(pc.candidate_layer)
        if vocab is not None:
            call = context.restricted(head, vocab)
        else:
            call = lambda hidden: ex.logits(hidden, head)
        candidates = HeadCandidates(ex, pc.candidate_layer, call, pc.num_candidates, vocab,
                                    ngram=ngram)
    if options.tuned:
        schedule, threshold = _tuned(options, pc)
    else:
        if options.schedule == "all":
            offline = None
        else:
            n = (len(pc.offline_layers) if options.offline_layers is None
                 else options.offline_layers)
            offline = pc.offline_layers[:n]
        schedule = PredictorSchedule(trained.predictors.layers, offline)
        threshold = exit_threshold(options, pc)
        if options.shallow_threshold is not None:
            threshold = depth_thresholds(trained.predictors.layers, threshold,
                                         options.shallow_threshold)
    heads = _lens_heads(trained, pc, options.heads)
    lenses = {layer: head.transform_normed for layer, head in heads.items()}
    decision = context.derived(
        "specee-decision", trained, options.kernel,
        lambda: layer_decision(ex, trained.predictors, heads, options.kernel))
    defaults = Options()
    if options.verify and options.kv != "deferred":
        raise InvalidArgumentError(
            f"specee: verify=true runs an exited token's skipped layers later, batched with the "
            f"next tokens (kv=deferred); kv={options.kv!r} does not apply: drop it")
    if not options.verify and options.max_early != defaults.max_early:
        raise InvalidArgumentError(
            "specee: max_early bounds the exited tokens awaiting verification; give verify=true "
            "or drop max_early")
    if options.verify:
        scanner = PredictorScan(candidates, trained.predictors, schedule, threshold, lenses,
                                decision)
        return VerifiedSpecEEStep(SpecEEDrafter(ex, SpecEEExits(scanner, ex), options.max_early))
    return SpecEEStep(candidates, trained.predictors, schedule, threshold,
                      lambda executor, cache: make_skipped_kv(options.kv, executor, cache),
                      lenses, decision)


TUNED_OPTIONS = ("threshold", "accuracy", "shallow_threshold", "schedule", "offline_layers")


def _tuned(options: Options, card: PredictorCard) -> tuple[PredictorSchedule, dict[int, float]]:
    """``tuned=true``: the card's tuned layers, always on (the tuning chose them, in place of
    the two-level schedule), and their thresholds.

    Raises:
        InvalidArgumentError: without ``verify=true`` (the tuning replays verified SpecEE),
            with an option it replaces, or predictors whose card has no tuning.
    """
    if not options.verify:
        raise InvalidArgumentError(
            "specee: tuned=true reads thresholds tuned by replaying verified SpecEE; add "
            "verify=true")
    given = changed_options(options, TUNED_OPTIONS)
    if given:
        raise InvalidArgumentError(
            f"specee: tuned=true takes the layers and thresholds from the predictors' card; "
            f"drop {', '.join(given)} (or drop tuned)")
    if card.tuning is None:
        raise InvalidArgumentError(
            "specee: these predictors have no tuned thresholds (their held-out text had no "
            "on-policy sequences); retrain them with `selfspec heads train-predictors --data "
            "onpolicy:DATASET,...`, or give threshold=")
    tuning = card.tuning
    return (PredictorSchedule(tuning.layers, None),
            dict(zip(tuning.layers, tuning.thresholds)))


def _lens_heads(trained: ExitHeads, card: PredictorCard, name: str
                ) -> dict[int, LightweightHead]:
    """The heads whose lens the predictors were trained with: ``{ℓ: head}`` for the card's
    ``lens_layers`` (the lens is ``head.transform_normed``).

    Raises:
        InvalidArgumentError: a lens layer whose head is missing or not lightweight (the
            file's heads were replaced after the predictors were trained).
    """
    lenses = {}
    for layer in card.lens_layers:
        head = trained.head_at(layer) if layer in trained.layers else None
        if not isinstance(head, LightweightHead):
            raise InvalidArgumentError(
                f"specee: the predictors in {name!r} read layer {layer} through its lightweight "
                f"exit head, and the file has {'no head' if head is None else 'a full head'} "
                f"there (the heads changed after the predictors were trained); retrain them "
                f"with `selfspec heads train-predictors --head-lens`")
        lenses[layer] = head
    return lenses


SPEC = MethodSpec(
    name="specee",
    summary="speculative early exit: per-layer predictors on k candidate tokens stop the "
            "forward pass (lossy; verify=true: lossless)",
    lossless=True,
    paper="SpecEE §4-5 (predictor features, two-level scheduling); skipped-layer KV: "
          "decoding/specee/skipped_kv.py",
    options=Options, build=build, heads_files=lambda options: [str(options.heads)],
    lossy_when=lambda options: not options.verify,
    processes_logits_when=lambda options: options.verify,
    unused_when=lambda options: ({"kv"} if options.verify else {"max_early"})
    | (set(TUNED_OPTIONS) if options.tuned else set()))
