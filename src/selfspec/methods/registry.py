"""Registry of decoding methods: every method module's :class:`MethodSpec`, by name.

Adding a method: write ``selfspec/methods/<name>.py`` with an ``Options`` dataclass and a
``SPEC`` (see :mod:`selfspec.methods.base`), then list it in :data:`METHODS` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from selfspec.decoding.core.loop import Step
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.methods import (
    adadecode,
    adaspeed,
    adaspeed_probe,
    ar,
    auto,
    clasp,
    dssd,
    dv,
    dynamic_exit,
    early_exit,
    knapspec,
    layerskip,
    ngram,
    qspec,
    specee,
    swift,
)
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.exit_drafting import default_exit_layer

__all__ = ["METHODS", "MethodContext", "MethodSpec", "build_step", "default_exit_layer",
           "get_method", "heads_files"]

METHODS: Mapping[str, MethodSpec] = {
    module.SPEC.name: module.SPEC
    for module in (ar, layerskip, dv, adaspeed, adaspeed_probe, dssd, early_exit, adadecode,
                   knapspec, clasp, dynamic_exit, swift, specee, qspec, ngram, auto)
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
            f"unknown method {name!r}; known methods: {', '.join(METHODS)} "
            "(see `selfspec methods`)") from None


def build_step(name: str, context: MethodContext | LayerExecutor,
               options: Mapping[str, Any]) -> Step:
    """The Step of one generation with method ``name`` and ``options``.

    Args:
        name: a method name.
        context: the model's :class:`MethodContext` (a bare executor gets a fresh one, which
            loads head files again).
        options: option name → value (strings are parsed).

    Raises:
        InvalidArgumentError: unknown method, an option the method does not take, or a value
            out of range.
    """
    if isinstance(context, LayerExecutor):
        context = MethodContext(context)
    return get_method(name).make_step(context, options)


def heads_files(name: str, options: Mapping[str, Any]) -> list[str]:
    """The head files (``"default"``, ``"default-probes"`` or a path) that method ``name``
    reads with ``options``: what a benchmark checks its prompts against (held-out check).

    Raises:
        InvalidArgumentError: unknown method or option.
    """
    spec = get_method(name)
    return spec.heads_files(spec.parse(options))
