"""selfspec: faster generation from a Hugging Face causal LM using its own layers."""

__version__ = "0.1.0"
