"""``auto``: per step, the drafter predicted to give the most tokens per second (n-gram
match, a model drafter such as qspec or DSSD, or plain decoding), from the measured latency
model and online acceptance estimates (KnapSpec eq. 4 as the objective). Lossless: every
candidate is verified by the full model.

Where ``lm_head`` is at least :data:`HEAD_SHARE_FOR_VOCAB` of the weight bytes a token reads
(Gemma 3 270M: 63%), every draft token through the full head costs most of a forward, so the
qspec and early-exit drafters draft through a reduced vocabulary of ``draft_vocab`` rows
(FR-Spec §3; the qspec copy's rows ranked by an offline corpus, the head drafters' by their
heads' token counts) and are priced with that head (named ``qspec[vK]`` in the stats and
``--explain``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from selfspec.decoding.auto.step import AutoStep, ModelDrafter, predicted_draft_token_ms
from selfspec.decoding.core.autoregressive import BatchArStep
from selfspec.decoding.core.batch import BatchStep
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.stop_rule import StopRule
from selfspec.decoding.drafting.corpus_vocab import (
    DEFAULT_DRAFT_VOCAB,
    DraftHead,
    head_share,
    reduced_draft_bytes,
)
from selfspec.decoding.memory import EngineMemory
from selfspec.decoding.ngram.batch import BatchNgramStep
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings
from selfspec.decoding.planning.tpt import (
    AcceptanceEstimate,
    ForwardCosts,
    MovingAverage,
)
from selfspec.decoding.planning.tpt_stop import ConfidenceCalibration, TptStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cpu import GGUF_ROWS, QUANTIZED_ROWS
from selfspec.executor.quant import (
    DRAFT_WEIGHT_FORMATS,
    draft_formats_on,
    quantized_kernels_available,
)
from selfspec.methods import adaspeed, dssd, dv, layerskip, qspec
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.draft_copy import DraftWeightsOptions, draft_weights_option
from selfspec.methods.options import HEAD_FILE, option
from selfspec.methods.qspec import draft_head

#: Model drafters ``auto`` can choose among: methods with a drafter builder
#: (:attr:`MethodSpec.drafter`), their drafters composed with default options.
MODEL_DRAFTERS: dict[str, MethodSpec] = {
    m.SPEC.name: m.SPEC for m in (qspec, layerskip, dv, adaspeed, dssd)}
HEADS_METHODS = ("layerskip", "dv", "adaspeed", "dssd")
#: Per-token acceptance a model drafter starts each generation with (2 pseudo-observations),
#: before its own verifications correct it. A quantized copy of the model itself agrees with
#: it on 95-96% of top-1 tokens (int8 / int4 / w4a8 on Qwen2.5-Coder-1.5B, the
#: executor-profile results), and its drafts under ``auto`` were accepted 93-99% of the time
#: on held-out prompts (the auto results); early-exit
#: heads agree far less (0.3-0.7 at their layers). A lower prior capped qspec's first drafts
#: at a few tokens for the first steps of a generation.
DRAFTER_PRIORS: dict[str, float] = {"qspec": 0.95}
DEFAULT_PRIOR = 0.7
#: Pseudo-observations behind an acceptance carried from the engine's last generation (a
#: fixed prior has 2): about one long draft's worth, so that the hard first tokens of a reply
#: (three rejected qspec drafts in a row opening a ShareGPT summary on Qwen2.5-1.5B) do not
#: drop the estimate from 0.93 to 0.38 (0.69 with this weight) and hold the drafts at 1-3
#: tokens for the rest of the generation, while a context that really differs still moves it
#: within a few steps.
CARRIED_PRIOR_WEIGHT = 8.0
#: ``lm_head``'s share of a decoding token's weight bytes from which ``auto``'s drafters
#: draft through the reduced vocabulary: well above SmolLM2-135M's 0.2 and Qwen2.5-1.5B's
#: 0.15, where the full head is cheap next to the layers; below Gemma 3 270M's 0.63.
HEAD_SHARE_FOR_VOCAB = 0.4
#: Early-exit drafters whose ``draft_vocab`` ranks by their heads' token counts (DSSD's needs
#: a calibration per size, so it keeps the full vocabulary).
VOCAB_HEAD_DRAFTERS = ("layerskip", "dv", "adaspeed")


@dataclass(frozen=True)
class Options(DraftWeightsOptions):
    """``auto``'s options. ``draft_weights`` (the shared option group) is the qspec
    drafter's copy, so it defaults to ``auto`` as qspec's does; the other model drafters
    draft on the model itself."""

    drafters: str | None = option(
        None, "comma-separated drafters to choose among besides ar: ngram, "
        + ", ".join(MODEL_DRAFTERS), default_text="ngram,qspec (+dssd with heads)")
    heads: str | None = option(None, "exit heads for the head drafters (dssd, layerskip, dv, "
                               "adaspeed): 'default' or a head file/directory",
                               default_text="none", asset=HEAD_FILE)
    max_draft_len: int = option(16, "longest draft of any drafter", low=1, high="R-1")
    carry_estimates: bool = option(True, "each model drafter starts from the acceptance and "
                                   "draft time it ended this engine's last generation with, "
                                   "the n-gram drafter from its acceptance per kind of match "
                                   "(false: from fixed priors every generation)")
    draft_weights: str = draft_weights_option(
        "auto", "weight format of the qspec drafter's copy (int8, int4, w4a8, q3_k, q2_k; "
        "auto: the fastest of int8/int4/w4a8 here, measured at load)")
    history: bool = option(True, "n-gram drafts also from this engine's earlier prompts and "
                           "outputs")
    draft_stop: str = option("tpt", "where a model drafter's draft ends: tpt (token by token, "
                             "where the predicted tokens/s peak given each token's confidence, "
                             "acceptance calibrated online per confidence bucket) or plan (at "
                             "the draft length chosen before drafting from the average "
                             "acceptance, or earlier by the drafter's own rule)",
                             choices=("tpt", "plan"))
    draft_vocab: int = option(
        DEFAULT_DRAFT_VOCAB, "rows of the reduced draft head the qspec and early-exit drafters "
        f"use where lm_head is >= {HEAD_SHARE_FOR_VOCAB:.0%} of a token's weight bytes "
        "(FR-Spec §3; 0 = always the full head)", low=0)
    explore_every: int = option(64, "steps after which a model drafter predicted close to "
                                "the best runs again to refresh its estimates (0 = never)",
                                low=0, high=1 << 20)

    def __post_init__(self) -> None:
        drafter_names(self)  # refuse bad drafter lists when parsed, before a model loads


def drafter_names(options: Options) -> list[str]:
    """The drafters ``auto`` chooses among with ``options`` (besides ``ar``).

    Raises:
        InvalidArgumentError: an unknown or repeated name, or a head drafter without heads.
    """
    if options.drafters is None:
        quantized = any(quantized_kernels_available(f) for f in DRAFT_WEIGHT_FORMATS)
        names = ["ngram"] + (["qspec"] if quantized else [])
        return names + (["dssd"] if options.heads is not None else [])
    names = [n.strip() for n in options.drafters.split(",") if n.strip()]
    known = ["ngram", *MODEL_DRAFTERS]
    for name in names:
        if name not in known:
            raise InvalidArgumentError(
                f"auto: unknown drafter {name!r} in drafters={options.drafters!r}; choose "
                f"among {', '.join(known)}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"auto: drafters={options.drafters!r} repeats a name")
    if "dssd" in names and options.heads is None:
        raise InvalidArgumentError("auto: the dssd drafter needs calibrated heads: give "
                                   "heads=default (--heads default) or a head file")
    return names


def build(context: MethodContext, options: Options) -> Step:
    """n-gram drafter, model drafters composed from their methods' drafters, and the
    chooser."""
    names = drafter_names(options)
    if options.drafters is None and context.executor.formats.rows in (*QUANTIZED_ROWS, *GGUF_ROWS):
        # The model already decodes on 4-bit weights: its quantized self-draft would be the
        # model again (another copy in memory, no step saved).
        names = [n for n in names if n != "qspec"]
    if options.drafters is None and not draft_formats_on(context.executor.device):
        # Quantized draft copies are CPU kernels: on a GPU auto has no qspec candidate.
        names = [n for n in names if n != "qspec"]
    costs = ForwardCosts(context.latency())
    history = context.history() if options.history else None
    memory = context.memory() if options.carry_estimates else None
    ngram = None
    if "ngram" in names:
        ngram = NgramDrafter(context.executor, costs,
                             NgramSettings(max_draft_len=options.max_draft_len), history,
                             memory=memory)
    models = [model_drafter(context, name, options, costs, memory)
              for name in names if name != "ngram"]
    return AutoStep(costs, ngram, models, history if ngram is not None else None,
                    max_draft_len=options.max_draft_len, explore_every=options.explore_every,
                    memory=memory)


def reduced_vocab(context: MethodContext, options: Options) -> int | None:
    """The draft vocabulary size ``auto``'s drafters take on this model: ``draft_vocab``
    where ``lm_head`` is at least :data:`HEAD_SHARE_FOR_VOCAB` of a token's weight bytes and
    the size is below the vocabulary's; else ``None`` (the full head)."""
    size = options.draft_vocab
    ex = context.executor
    if not size or size >= ex.vocab_size or head_share(ex) < HEAD_SHARE_FOR_VOCAB:
        return None
    return size


def drafter_options(context: MethodContext, name: str, options: Options) -> Any:
    """The ``Options`` of model drafter ``name`` under ``auto``: its method's defaults, with
    ``auto``'s heads for the head drafters, :func:`reduced_vocab`'s ``draft_vocab`` for qspec
    and for the head drafters whose heads carry token counts, and for qspec ``auto``'s
    ``draft_weights`` (and, with ``draft_stop=tpt``, no confidence stop: the calibrated rule
    decides alone).

    Raises:
        InvalidArgumentError: a value outside its range for this model.
    """
    values: dict[str, Any] = ({"heads": options.heads}
                              if name in HEADS_METHODS and options.heads else {})
    size = reduced_vocab(context, options)
    if size is not None and (name == "qspec" or name in VOCAB_HEAD_DRAFTERS
                             and options.heads is not None
                             and context.heads(options.heads).token_counts is not None):
        values["draft_vocab"] = size
    if name == "qspec":
        values["draft_weights"] = options.draft_weights
        if options.draft_stop == "tpt":
            # The copy's confidence does not mark its errors (tokens it drafted at top-1
            # < 0.3 were accepted 79-100% of the time): the calibrated rule decides alone.
            values["confidence"] = 0.0
    return MODEL_DRAFTERS[name].parse(values, context.executor)


def model_drafter(context: MethodContext, name: str, options: Options, costs: ForwardCosts,
                  memory: EngineMemory | None) -> ModelDrafter:
    """Model drafter ``name`` as an ``auto`` candidate: its estimates (carried from the
    engine's last generation, else priors) and its method's drafter, built with its stop rule
    (with ``draft_stop=tpt``, a :class:`TptStopRule` around the method's own).

    Raises:
        InvalidArgumentError, HeadsNotFoundError: see the method's drafter builder.
    """
    spec = MODEL_DRAFTERS[name]
    method_options = drafter_options(context, name, options)
    size = getattr(method_options, "draft_vocab", None)
    label = name if size is None else f"{name}[v{size}]"
    key = memory_key(label, options, context.executor)
    known = None if memory is None else memory.drafters.get(key)
    acceptance = (AcceptanceEstimate(known.acceptance, prior_weight=CARRIED_PRIOR_WEIGHT)
                  if known else AcceptanceEstimate(DRAFTER_PRIORS.get(name, DEFAULT_PRIOR)))
    draft = context.draft_executor(method_options)
    head = draft_head(context, draft, size) if name == "qspec" else None
    cost = known.draft_cost if known else draft_cost(context.executor, draft, head)
    draft_ms = MovingAverage(0.0)
    wrap = None
    if options.draft_stop == "tpt":
        calibration = ConfidenceCalibration(acceptance, label,
                                            priors=known.by_confidence if known else None)

        def wrap(rule: StopRule) -> StopRule:
            return TptStopRule(rule, calibration,
                               partial(predicted_draft_token_ms, draft_ms, cost, costs),
                               costs.forward_ms)

    return ModelDrafter(label, spec.make_drafter(context, method_options, wrap), acceptance,
                        draft_ms=draft_ms, draft_cost=cost, memory_key=key)


def memory_key(name: str, options: Options, executor: LayerExecutor) -> str:
    """The name a model drafter's estimates are kept under in the engine's memory: its
    method, the qspec copy's format and the model's decoding kernel (another kernel or copy
    is another speed and acceptance)."""
    fmt = f"[{options.draft_weights}]" if name.startswith("qspec") else ""
    return f"{name}{fmt}@{executor.formats.rows}"


def draft_cost(executor: LayerExecutor, draft: LayerExecutor,
               head: DraftHead | None = None) -> float:
    """A draft token's time as a share of one token of ``executor``, before the drafter
    has run: the share of the weight bytes a token reads when ``draft`` (the executor the
    drafter drafts on) is another copy of the weights (a
    :meth:`~LayerExecutor.draft_view`; decoding is bound by memory bandwidth), with ``head``
    (a reduced draft vocabulary's rows) in place of the copy's full ``lm_head``; else 0.5."""
    if draft is executor:
        return 0.5
    return reduced_draft_bytes(draft, head) / max(executor.decode_weight_bytes(), 1)


def build_batch(context: MethodContext, options: Options) -> BatchStep:
    """In a batch, ``auto`` chooses per step between plain decoding and n-gram drafts (the
    model drafters have no batched step yet): the block width that maximises the whole
    batch's predicted tokens per second, so it falls back to plain decoding where drafting
    stops paying at high batch."""
    if "ngram" not in drafter_names(options):
        return BatchArStep(context.executor)
    # read as each row joins: a server's rows draft from their own tenant's history
    history = context.history if options.history else None
    return BatchNgramStep(context.executor, context.latency(),
                          NgramSettings(max_draft_len=options.max_draft_len), history)


def heads_files(options: Options) -> list[str]:
    """The head file the head drafters read."""
    return [] if options.heads is None else [str(options.heads)]


SPEC = MethodSpec(
    name="auto",
    summary="each step, the drafter predicted to give the most tokens/s (n-gram match, "
            "quantized self-draft, trained heads) or plain decoding; never drafts at a loss "
            "predicted by the measured latency model",
    lossless=True,
    paper="KnapSpec eq. 4 (Tokens-per-Time) as the per-step objective over drafters",
    options=Options, build=build, heads_files=heads_files, build_batch=build_batch)
