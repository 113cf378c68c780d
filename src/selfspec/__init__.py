"""selfspec: faster generation from a Hugging Face causal LM using its own layers."""

from selfspec.api import GenerationResult, SelfSpec, from_pretrained_model, load
from selfspec.decoding.core.state import GenerationStats
from selfspec.version import __version__

__all__ = [
    "GenerationResult", "GenerationStats", "SelfSpec", "__version__", "from_pretrained_model",
    "load",
]
