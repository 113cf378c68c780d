"""Draft & Verify: early-exit drafting until a draft token's probability falls below γ, with
the adaptive γ of its code (Zhang et al. 2024, §3.3; AdaSPEED Algorithm 1 and appendix)."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import ThresholdStopRule
from selfspec.methods.base import MethodContext, MethodSpec, WrapStopRule, wrapped
from selfspec.methods.exit_drafting import ExitOptions, build_exit_drafter, heads_files
from selfspec.methods.options import option

GAMMA_HELP = "stop threshold (the initial value when adaptive)"
ADAPTIVE_HELP = "adapt gamma to the acceptance rate after each verification"


@dataclass(frozen=True)
class Options(ExitOptions):
    """Draft & Verify's options."""

    gamma: float = option(0.8, GAMMA_HELP, low=0, high=1, low_open=True, high_open=True)
    adaptive: bool = option(True, ADAPTIVE_HELP)
    max_draft_len: int = option(8, "longest draft", low=1, high="R-1")


def drafter(context: MethodContext, options: Options,
            wrap: WrapStopRule | None = None) -> EarlyExitDrafter:
    """The early-exit drafter with the threshold stop rule (p < γ; ``wrap``-ped if given)."""
    rule = ThresholdStopRule(options.gamma, adaptive=options.adaptive,
                             max_draft_len=options.max_draft_len)
    return build_exit_drafter(context, options, wrapped(rule, wrap))


def build(context: MethodContext, options: Options) -> Step:
    """Early-exit drafter + threshold stop rule (p < γ) + verifier."""
    return SpeculativeStep(drafter(context, options))


SPEC = MethodSpec(
    name="dv",
    summary="early-exit drafting until a draft probability < gamma, adaptive gamma",
    lossless=True,
    paper="Draft & Verify (Zhang et al. 2024) §3.3; AdaSPEED Algorithm 1, §VII.A",
    options=Options, build=build, heads_files=heads_files, drafter=drafter)
