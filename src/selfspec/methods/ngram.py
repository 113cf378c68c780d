"""n-gram drafts: prompt lookup (Saxena 2023) plus a suffix automaton over the engine's
earlier texts (SuffixDecoding, Oliaro et al. 2024; SAM-Decoding, Hu et al. 2024), verified by
the model; the draft length maximises predicted tokens per second (KnapSpec eq. 4 with free
drafts). Training-free and lossless."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.batch import BatchStep
from selfspec.decoding.core.loop import Step
from selfspec.decoding.ngram.batch import BatchNgramStep
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings, NgramStep
from selfspec.decoding.ngram.tree import TreeNgramStep
from selfspec.decoding.ngram.tree_plan import TreeSettings
from selfspec.decoding.planning.tpt import ForwardCosts
from selfspec.errors import InvalidArgumentError
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.options import option


@dataclass(frozen=True)
class Options:
    """The n-gram drafter's options."""

    max_ngram: int = option(4, "longest context suffix prompt lookup matches", low=1, high=32)
    min_ngram: int = option(2, "shortest match that may start a draft", low=1, high=32)
    max_draft_len: int = option(16, "longest draft (D)", low=1, high="R-1")
    min_share: float = option(0.3, "stop a draft at a token that continues less than this "
                              "share of the matched text's occurrences", low=0, high=1)
    history: bool = option(True, "also draft from this engine's earlier prompts and outputs "
                           "(kept for the life of the process or server)")
    tree_branches: int = option(1, "most branches of a token tree: continuations with "
                                "distinct first tokens verified together, the shape chosen "
                                "by predicted tokens per second (1: single chains)",
                                low=1, high=8)
    tree_prior: float = option(0.1, "acceptance assumed for an alternative branch's first "
                               "token before any was verified", low=0, high=1)
    carry_estimates: bool = option(True, "start from the acceptance per kind of match this "
                                   "engine's last generation ended with (false: from a "
                                   "fixed prior every generation)")

    def __post_init__(self) -> None:
        settings(self)  # refuse min_ngram > max_ngram when parsed, before a model loads


def settings(options: Options) -> NgramSettings:
    """The drafter settings of ``options``.

    Raises:
        InvalidArgumentError: ``min_ngram > max_ngram``.
    """
    if options.min_ngram > options.max_ngram:
        raise InvalidArgumentError(
            f"ngram: min_ngram ({options.min_ngram}) must not exceed max_ngram "
            f"({options.max_ngram})")
    return NgramSettings(max_ngram=options.max_ngram, min_ngram=options.min_ngram,
                         max_draft_len=options.max_draft_len, min_share=options.min_share)


def build(context: MethodContext, options: Options) -> Step:
    """n-gram drafter + verification by the full model (token trees with
    ``tree_branches > 1``: :mod:`selfspec.decoding.ngram.tree`)."""
    history = context.history() if options.history else None
    memory = context.memory() if options.carry_estimates else None
    drafter = NgramDrafter(context.executor, ForwardCosts(context.latency()), settings(options),
                           history, memory=memory)
    if options.tree_branches > 1:
        tree = TreeSettings(max_branches=options.tree_branches, alt_prior=options.tree_prior)
        return TreeNgramStep(drafter, history, tree)
    return NgramStep(drafter, history)


def build_batch(context: MethodContext, options: Options) -> BatchStep:
    """Per-row n-gram drafts verified in one batched forward, block width chosen for the
    batch (single chains per row: ``tree_branches`` applies to single generations)."""
    # read as each row joins: a server's rows draft from their own tenant's history
    history = context.history if options.history else None
    return BatchNgramStep(context.executor, context.latency(), settings(options), history)


SPEC = MethodSpec(
    name="ngram",
    summary="drafts copied from the prompt, the output so far and earlier outputs (no model "
            "layer, no training), verified by the model",
    lossless=True,
    paper="Prompt Lookup Decoding (Saxena 2023); SuffixDecoding (Oliaro et al. 2024) and "
          "SAM-Decoding (Hu et al. 2024) for the history; KnapSpec eq. 4 for the length",
    options=Options, build=build, build_batch=build_batch)
