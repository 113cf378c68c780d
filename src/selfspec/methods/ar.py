"""Autoregressive decoding: one full forward per token, the reference every lossless method
reproduces."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.autoregressive import ArStep
from selfspec.decoding.loop import Step
from selfspec.methods.base import MethodContext, MethodSpec


@dataclass(frozen=True)
class Options:
    """Autoregressive decoding takes no options."""


def build(context: MethodContext, options: Options) -> Step:
    return ArStep()


SPEC = MethodSpec(name="ar", summary="autoregressive decoding, one full forward per token",
                  lossless=True, paper="(baseline)", options=Options, build=build)
