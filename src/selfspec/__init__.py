"""selfspec: faster generation from a Hugging Face causal LM using its own layers.

The public names are imported on first use (PEP 562), so that a process needing only a light
part of the package (``selfspec --version``, the Ray Serve ingress and metrics hub, which hold
no model) does not pay torch's and transformers' import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from selfspec.version import __version__

if TYPE_CHECKING:
    from selfspec.api import GenerationResult, SelfSpec, from_pretrained_model, load
    from selfspec.decoding.core.state import GenerationStats

_PUBLIC = {
    "GenerationResult": "selfspec.api", "SelfSpec": "selfspec.api",
    "from_pretrained_model": "selfspec.api", "load": "selfspec.api",
    "GenerationStats": "selfspec.decoding.core.state",
}

__all__ = [
    "GenerationResult", "GenerationStats", "SelfSpec", "__version__", "from_pretrained_model",
    "load",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'selfspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
