"""AdaSPEED: early-exit drafting until the product of the draft probabilities since the last
verification falls below γ, adaptive γ (AdaSPEED Algorithm 2, §II.A).

The product rule has no draft cap in the paper: it always stops once the product falls below
γ. The default ``max_draft_len`` is therefore the longest draft that verification keeps
bit-exact (``row_attention_max - 1``), not Draft & Verify's 8; ``max_draft_len=8`` restores
the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import ProductStopRule
from selfspec.methods import dv
from selfspec.methods.base import MethodContext, MethodSpec, WrapStopRule, wrapped
from selfspec.methods.exit_drafting import build_exit_drafter, heads_files
from selfspec.methods.options import option


@dataclass(frozen=True)
class Options(dv.Options):
    """AdaSPEED's options: Draft & Verify's, without its draft cap."""

    max_draft_len: int | None = option(None, "longest draft", low=1, high="R-1",
                                       default_text="R-1 (63)")


def product_rule(context: MethodContext, options: Options) -> ProductStopRule:
    """The product stop rule with ``options``' γ and cap."""
    cap = options.max_draft_len
    if cap is None:
        cap = max(1, context.executor.row_attention_max - 1)
    return ProductStopRule(options.gamma, adaptive=options.adaptive, max_draft_len=cap)


def drafter(context: MethodContext, options: Options,
            wrap: WrapStopRule | None = None) -> EarlyExitDrafter:
    """The early-exit drafter with the product stop rule (Π p < γ; ``wrap``-ped if given)."""
    return build_exit_drafter(context, options, wrapped(product_rule(context, options), wrap))


def build(context: MethodContext, options: Options) -> Step:
    """Early-exit drafter + product stop rule (Π p < γ) + verifier."""
    return SpeculativeStep(drafter(context, options))


SPEC = MethodSpec(
    name="adaspeed",
    summary="early-exit drafting until the product of draft probabilities < gamma, adaptive gamma",
    lossless=True,
    paper="AdaSPEED §II.A, Algorithm 2",
    options=Options, build=build, heads_files=heads_files, drafter=drafter)
