"""Registry of decoding methods: a name → how to build the decoder for a model.

A method is a composition (DESIGN.md): drafter + stop rule + verifier wired into the shared
loop. New methods add a module in ``selfspec.methods`` and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from selfspec.decoding.autoregressive import decode_autoregressive
from selfspec.decoding.state import DecodeState
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor

# A decoder runs one generation to completion on a fresh DecodeState.
Decoder = Callable[[DecodeState], None]


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: the name used by ``--method`` and ``generate(method=...)``.
        description: one line for ``--help`` and reports.
        lossless: True when greedy output equals autoregressive greedy output.
        build: ``build(executor, **options) -> Decoder``; raises InvalidArgumentError on bad options.
        options: option names the method accepts.
    """

    name: str
    description: str
    lossless: bool
    build: Callable[..., Decoder]
    options: tuple[str, ...] = ()


def _build_autoregressive(executor: LayerExecutor) -> Decoder:
    return decode_autoregressive


METHODS: Mapping[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("ar", "autoregressive decoding, one full forward per token", True,
                   _build_autoregressive),
    )
}


def get_method(name: str) -> MethodSpec:
    """Look up a method by name.

    Raises:
        InvalidArgumentError: unknown name (the message lists the known ones).
    """
    try:
        return METHODS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown method {name!r}; known methods: {', '.join(METHODS)}") from None


def build_decoder(name: str, executor: LayerExecutor, options: Mapping[str, Any]) -> Decoder:
    """Build method ``name``'s decoder with ``options``.

    Raises:
        InvalidArgumentError: unknown method, or an option the method does not take.
    """
    spec = get_method(name)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        accepted = ", ".join(spec.options) or "none"
        raise InvalidArgumentError(
            f"method {name!r} does not take option(s) {', '.join(unknown)}; it accepts: {accepted}")
    return spec.build(executor, **options)
