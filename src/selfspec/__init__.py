"""selfspec: faster generation from a Hugging Face causal LM using its own layers."""

from selfspec.api import GenerationResult, SelfSpec, from_pretrained_model, load
from selfspec.decoding.state import GenerationStats

__version__ = "0.1.0"

__all__ = ["GenerationResult", "GenerationStats", "SelfSpec", "from_pretrained_model", "load"]
