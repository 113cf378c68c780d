"""QSpec-style self-speculation: draft with the model's own layers on int8 (or int4) weight
copies, verify with the model itself (Zhao et al. 2024, QSpec §3; here the draft is W8A8
or W4A16 and the verifier the bf16/fp32 model, so the output is exactly the model's).

A configuration of the shared drafters: the skip-plan drafter with the plan of an early exit
at ``exit_layer`` (default: every layer) on the ``draft_weights`` copy
(:func:`~selfspec.decoding.drafting.skip_drafter.quantized_drafter`), verified in the
recompute mode of :class:`~selfspec.decoding.drafting.draft_copy.DraftCopy`. With
``draft_vocab=K`` drafts score only the ``K`` most frequent tokens of an offline corpus
(FR-Spec §3, :mod:`~selfspec.decoding.drafting.corpus_vocab`): a model whose ``lm_head`` is
most of a token's bytes (Gemma 3's 262k rows) then drafts at a fraction of its cost."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.corpus_vocab import DraftHead
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter, quantized_drafter
from selfspec.decoding.drafting.stop_rules import ConfidenceStopRule, ConstantStopRule
from selfspec.executor import LayerExecutor
from selfspec.methods.base import MethodContext, MethodSpec, WrapStopRule, wrapped
from selfspec.methods.draft_copy import DraftWeightsOptions, draft_weights_option
from selfspec.methods.options import option

#: The help of ``draft_vocab`` wherever a method drafts through a corpus-ranked head.
CORPUS_VOCAB_HELP = ("drafts score only the K most frequent tokens of the tokenizer over an "
                     "offline corpus (Python library files no benchmark uses; FR-Spec §3); "
                     "verification scores every token")


@dataclass(frozen=True)
class Options(DraftWeightsOptions):
    """QSpec's options. ``draft_weights`` (the shared option group) defaults to ``auto``
    here, not to the model's own weights: drafting on a copy is the method."""

    draft_weights: str = draft_weights_option(
        "auto", "format of the draft's weight copy: int8 (W8A8, FBGEMM), int4 (weight-only, "
        "groups of 32, torch's kernel), w4a8 (4-bit weights and 8-bit activations, groups of "
        "32, selfspec's AVX2 kernel) or auto (the fastest of them on this machine, measured "
        "at load)")
    max_draft_len: int = option(12, "longest draft (D)", low=1, high="R-1")
    confidence: float = option(0.3, "stop drafting when the draft's top-1 probability falls "
                               "below this (0 = always draft max_draft_len)", low=0, high=1,
                               high_open=True)
    exit_layer: int | None = option(None, "layers the draft runs: [0, exit_layer)", low=1,
                                    high="L", default_text="all")
    draft_vocab: int | None = option(None, CORPUS_VOCAB_HELP, low=1, high="V",
                                     default_text="none (full vocabulary)")


def draft_head(context: MethodContext, draft: LayerExecutor, size: int | None
               ) -> DraftHead | None:
    """The head a draft on ``draft`` projects through: ``None`` (the full ``lm_head``) without
    a ``size``, else :meth:`MethodContext.corpus_vocab`'s ``size`` rows of ``draft``'s
    ``lm_head`` (built once per context, draft executor and vocabulary).

    Raises:
        InvalidArgumentError: a bad size, or no tokenizer to rank tokens with.
    """
    if size is None:
        return None
    vocab = context.corpus_vocab(size)
    return context.derived("draft-head", draft, vocab.key, lambda: DraftHead(draft, vocab))


def drafter(context: MethodContext, options: Options,
            wrap: WrapStopRule | None = None) -> SkipPlanDrafter:
    """Layers ``[0, exit_layer)`` on the quantized copy (through the ``draft_vocab`` head if
    given) with the confidence stop rule (``wrap``-ped if given), verified by the full
    model."""
    rule = (ConfidenceStopRule(options.confidence, max_draft_len=options.max_draft_len)
            if options.confidence > 0 else ConstantStopRule(options.max_draft_len))
    draft = context.draft_executor(options)
    head = draft_head(context, draft, options.draft_vocab)
    return quantized_drafter(context.executor, draft, wrapped(rule, wrap), options.exit_layer,
                             None if head is None else head.vocab, head)


def build(context: MethodContext, options: Options) -> Step:
    """Quantized-weights drafter + confidence stop rule + verification by the full model."""
    return SpeculativeStep(drafter(context, options))


SPEC = MethodSpec(
    name="qspec",
    summary="draft with the model's own layers on int8/int4/w4a8 weight copies, verify with the "
            "model (no second model, no training)",
    lossless=True,
    paper="QSpec (Zhao et al. 2024) §3, self-speculation across quantization schemes",
    options=Options, build=build, drafter=drafter)
