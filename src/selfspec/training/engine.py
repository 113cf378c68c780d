"""What training needs of a loaded model: the :class:`Engine` protocol.

Training code takes a ``selfspec.SelfSpec`` engine (``selfspec.load(...)``) but depends only
on the members listed here, so it never imports :mod:`selfspec.api` (which sits above
training) and a test can hand it any object with these members. Who uses what:

- ``executor``: backbone passes, logits, ``config`` / ``num_layers`` / ``max_positions`` /
  ``dtype`` / ``model`` (:mod:`~selfspec.training.features`, :mod:`~selfspec.training.pipeline`),
  and the output layer and fingerprint of head files (:func:`selfspec.heads.output_layer`);
- ``model``: batched ``generate`` of on-policy text (:mod:`~selfspec.training.onpolicy`);
- ``tokenizer``: reference text → ids, the pad id (:mod:`~selfspec.training.corpus`,
  :mod:`~selfspec.training.onpolicy`);
- ``name``: the model name of head files and caches (:func:`selfspec.heads.files.model_name`);
- ``eos_token_ids``: ends chat references and on-policy generations;
- ``encode``: prompt text (optionally through the chat template) → ids.
"""

from __future__ import annotations

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
