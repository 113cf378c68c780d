"""KnapSpec: training-free drafts made of a subset of attention and MLP sub-layers, chosen by
a knapsack DP on cosine similarity and a Tokens-per-Time search with measured,
context-dependent latencies, re-optimised during generation (KnapSpec §3, Algorithm 1).
With ``draft_vocab=K`` drafts score only the ``K`` most frequent tokens of an offline corpus
(FR-Spec §3), and the plan search prices that reduced head."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
from selfspec.executor.cost_model import output_decode_bytes
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.options import option
from selfspec.methods.qspec import CORPUS_VOCAB_HELP, draft_head


@dataclass(frozen=True)
class Options(DraftWeightsOptions):
    """KnapSpec's options (paper values as defaults; ``draft_weights`` from
    :class:`~selfspec.methods.draft_copy.DraftWeightsOptions`)."""

    reoptimize_every: int = option(64, "steps between re-optimisations of the plan (T)", low=1)
    history_steps: int = option(5, "steps whose tokens the DP scores (m)", low=1)
    tau: float = option(0.5, "similarity below which the DP prunes a state", low=-1, high=1)
    max_draft_len: int = option(10, "largest draft length searched (D)", low=1, high="R-1")
    confidence: float = option(0.7, "stop drafting when the top-1 probability falls below this",
                               low=0, high=1, low_open=True, high_open=True)
    plan_budget: float = option(0.05, "largest share of the decoding time until the next "
                                "re-optimisation that one may cost (predicted); "
                                "1e9 = always (the paper)",
                                low=0)
    max_backoff: int = option(8, "after a re-optimisation finds no paying plan, the interval to "
                              "the next doubles up to this many times T (1 = the paper)", low=1)
    alpha_vocab: int = option(32, "acceptance estimates score candidates over the full model's "
                              "top-k tokens at the history positions (0: the whole vocabulary, "
                              "the paper)", low=0, high=64)
    record_history: bool = option(True, "take the DP's history from the step's own decoding "
                                  "and verification forwards when they cover it (false: a "
                                  "read-only pass every time, the paper)")
    tpt_stop: bool = option(False, "end each draft token by token where the predicted "
                            "tokens/s peak, from each token's calibrated confidence "
                            "(decoding/planning/tpt_stop.py), instead of the paper's rule "
                            "(§3.5: top-1 "
                            "probability < confidence, or max_draft_len)")
    draft_vocab: int | None = option(None, CORPUS_VOCAB_HELP, low=1, high="V",
                                     default_text="none (full vocabulary)")


def build(context: MethodContext, options: Options) -> Step:
    """The KnapSpec Step with this machine's measured latencies (with ``draft_weights``, the
    draft view's own too; with ``draft_vocab``, draft tokens priced with the reduced head's
    share of ``lm_head``'s bytes).

    Raises:
        InvalidArgumentError: a draft weight format without a kernel here; a bad
            ``draft_vocab`` or no tokenizer to rank tokens with.
    """
    config = KnapSpecConfig(reoptimize_every=options.reoptimize_every,
                            history_steps=options.history_steps, tau=options.tau,
                            max_draft_len=options.max_draft_len, confidence=options.confidence,
                            plan_budget=options.plan_budget, max_backoff=options.max_backoff,
                            record_history=options.record_history,
                            alpha_vocab=options.alpha_vocab,
                            draft_stop="tpt" if options.tpt_stop else "confidence")
    draft = context.draft_executor(options)
    draft_latency = context.latency(draft)
    head = draft_head(context, draft, options.draft_vocab)
    if head is not None:
        draft_latency = draft_latency.with_draft_head(
            min(1.0, head.decode_bytes / max(output_decode_bytes(draft), 1)))
    step = KnapSpecStep(context.executor, context.latency(), config, draft, draft_latency)
    if head is not None:
        step.drafter.restrict(head.vocab, head)
    return step


SPEC = MethodSpec(
    name="knapspec",
    summary="draft with the attention/MLP sub-layers a knapsack DP picks for the best "
            "predicted tokens per second; re-optimised as the context grows",
    lossless=True,
    paper="KnapSpec §3, Algorithm 1, eq. 4 and 9",
    options=Options, build=build)
