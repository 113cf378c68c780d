"""Calibrated early exit without verification (DSSD §3.4.2): each token from the first exit
head that is confident at accuracy ε, or from the full model. Lossy by design."""

from __future__ import annotations

from selfspec.decoding.core.loop import Step
from selfspec.decoding.drafting.calibrated_exit import CalibratedExitStep
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.dssd import CalibratedOptions, calibrated_exits

Options = CalibratedOptions


def build(context: MethodContext, options: Options) -> Step:
    """The lossy early-exit Step on the calibrated heads."""
    return CalibratedExitStep(calibrated_exits(context, options))


SPEC = MethodSpec(
    name="early-exit",
    summary="calibrated early exit without verification (lossy)",
    lossless=False,
    paper="DSSD §3.4.2",
    options=Options, build=build, heads_files=lambda options: [str(options.heads)])
