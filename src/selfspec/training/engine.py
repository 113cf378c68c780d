"""What training needs of a loaded model: the :class:`Engine` protocol.

Training code takes a ``selfspec.SelfSpec`` engine (``selfspec.load(...)``) but depends only
on the members listed here, so it never imports :mod:`selfspec.api` (which sits above
training) and a test can hand it any object with these members. Who uses what:

- ``executor``: backbone passes, logits, ``config`` / ``num_layers`` / ``max_positions`` /
  ``dtype`` / ``model`` (:mod:`~selfspec.training.features`, :mod:`~selfspec.training.pipeline`),
  and the output layer and fingerprint of head files (:func:`selfspec.heads.output_layer`);
- ``generate_batch``: on-policy text, the model's own greedy answers generated as one ragged
  batch (:mod:`~selfspec.training.onpolicy`);
- ``model``: the Hugging Face model behind the executor;
- ``tokenizer``: reference text → ids (:mod:`~selfspec.training.corpus`);
- ``name``: the model name of head files and caches (:func:`selfspec.heads.files.model_name`);
- ``eos_token_ids``: ends chat references and on-policy generations;
- ``encode``: prompt text (optionally through the chat template) → ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from selfspec.executor import LayerExecutor


class Engine(Protocol):
    """A loaded model as training uses it (``selfspec.SelfSpec`` satisfies it).

    Attributes:
        executor: the model's :class:`LayerExecutor`.
        model: the Hugging Face causal LM.
        tokenizer: its Hugging Face tokenizer.
        name: registry name, local directory or hub id of the model.
    """

    executor: LayerExecutor
    model: torch.nn.Module
    tokenizer: Any
    name: str

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation."""
        ...

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` text, through the chat template when ``chat``."""
        ...

    def generate_batch(self, prompts: Sequence[Sequence[int]], method: str = "ar", *,
                       max_new_tokens: int = 128) -> list[Any]:
        """One result per prompt (``token_ids``: the new tokens, ending with EOS when made),
        the prompts decoded together as one ragged batch."""
        ...
