"""LayerSkip: early-exit drafting of a constant number of tokens with a shared KV cache
(Elhoushi et al. 2024, §4 self-speculative decoding; AdaSPEED's "Constant-D" baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import ConstantStopRule
from selfspec.methods.base import MethodContext, MethodSpec, WrapStopRule, wrapped
from selfspec.methods.exit_drafting import ExitOptions, build_exit_drafter, heads_files
from selfspec.methods.options import option


@dataclass(frozen=True)
class Options(ExitOptions):
    """LayerSkip's options."""

    draft_len: int = option(4, "draft tokens per step (D)", low=1, high="R-1")
    max_draft_len: int | None = option(None, "cap on draft tokens per step", low=1, high="R-1",
                                       default_text="draft_len")


def drafter(context: MethodContext, options: Options,
            wrap: WrapStopRule | None = None) -> EarlyExitDrafter:
    """The early-exit drafter with the constant-D stop rule (``wrap``-ped if given)."""
    rule = ConstantStopRule(options.draft_len, options.max_draft_len)
    return build_exit_drafter(context, options, wrapped(rule, wrap))


def build(context: MethodContext, options: Options) -> Step:
    """Early-exit drafter + constant-D stop rule + greedy/sampling verifier."""
    return SpeculativeStep(drafter(context, options))


SPEC = MethodSpec(
    name="layerskip",
    summary="early-exit drafting of a constant draft_len tokens with shared KV",
    lossless=True,
    paper="LayerSkip (Elhoushi et al. 2024) §4; AdaSPEED Fig. 1 Constant-D",
    options=Options, build=build, heads_files=heads_files, drafter=drafter)
