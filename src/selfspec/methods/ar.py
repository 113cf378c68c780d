"""Autoregressive decoding: one full forward per token, the reference every lossless method
reproduces."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.autoregressive import ArStep, BatchArStep
from selfspec.decoding.core.batch import BatchStep
from selfspec.decoding.core.loop import Step
from selfspec.methods.base import MethodContext, MethodSpec


@dataclass(frozen=True)
class Options:
    """Autoregressive decoding takes no options."""


def build(context: MethodContext, options: Options) -> Step:
    return ArStep()


def build_batch(context: MethodContext, options: Options) -> BatchStep:
    """One batched forward per token for all rows."""
    return BatchArStep(context.executor)


SPEC = MethodSpec(name="ar", summary="autoregressive decoding, one full forward per token",
                  lossless=True, paper="(baseline)", options=Options, build=build,
                  build_batch=build_batch)
