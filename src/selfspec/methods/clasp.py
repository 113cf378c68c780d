"""CLaSp: training-free drafts that skip a fixed number of whole layers, re-chosen after every
verification by a dynamic programme on the cosine similarity of the last hidden states
(Chen et al. 2025; KnapSpec §2, eq. 3)."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.knapspec.clasp import CLaSpConfig, CLaSpStep
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.options import option


@dataclass(frozen=True)
class Options(DraftWeightsOptions):
    """CLaSp's options (the paper's schedule as defaults; ``draft_weights`` from
    :class:`~selfspec.methods.draft_copy.DraftWeightsOptions`)."""

    skip_ratio: float = option(0.45, "share of the layers every draft skips (M = round(ratio × L), "
                               "at least 1)", low=0, high=1, low_open=True, high_open=True)
    reoptimize_every: int = option(1, "steps between re-optimisations of the skipped layers "
                                   "(CLaSp: after every verification)", low=1)
    history_steps: int = option(1, "steps whose committed tokens the DP scores", low=1)
    max_draft_len: int = option(10, "the draft cap", low=1, high="R-1")
    confidence: float = option(0.7, "stop drafting when the top-1 probability falls below this",
                               low=0, high=1, low_open=True, high_open=True)


def skip_layers(num_layers: int, ratio: float) -> int:
    """``M``: ``round(ratio × L)`` clipped to ``[1, L-1]``."""
    return min(num_layers - 1, max(1, round(ratio * num_layers)))


def build(context: MethodContext, options: Options) -> Step:
    """The CLaSp Step."""
    ex = context.executor
    config = CLaSpConfig(skip_layers=skip_layers(ex.num_layers, options.skip_ratio),
                         reoptimize_every=options.reoptimize_every,
                         history_steps=options.history_steps,
                         max_draft_len=options.max_draft_len, confidence=options.confidence)
    return CLaSpStep(ex, config, context.draft_executor(options))


SPEC = MethodSpec(
    name="clasp",
    summary="draft skipping a fixed share of whole layers, re-chosen after each verification "
            "by a DP on hidden-state cosine similarity",
    lossless=True,
    paper="CLaSp (Chen et al. 2025) as summarised in KnapSpec §2, eq. 3",
    options=Options, build=build)
