"""Batched greedy generation of on-policy training text (AdaDecode Appendix D).

On-policy text is the model's own greedy answer to real prompts. A decode step of a small
model is bound by reading the weights, so 16 sequences per step cost little more than one:
the prompts run together as one ragged batch of selfspec's own ``ar``
(:meth:`selfspec.SelfSpec.generate_batch`), each row with its own KV cache and positions.

Why not transformers' batched ``generate``: its rows are not each prompt's greedy answer (in
bf16 a row's rounding follows the batch's shape and padding: on SmolLM2, 6 of 8 rows of a
left-padded batch parted from the same prompt generated alone within 32 tokens, the unpadded
row too), and it is slower where bf16 matrix products are emulated, where it needed an fp32
copy of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from selfspec.training.engine import Engine

logger = logging.getLogger(__name__)

DEFAULT_BATCH = 16


@torch.inference_mode()
def generate_greedy_batch(engine: Engine, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int, method: str = "ar") -> list[list[int]]:
    """Greedy continuations of ``prompts`` generated together, each exactly the tokens the
    prompt would get alone.

    Args:
        engine: the model (:class:`~selfspec.training.engine.Engine`: ``generate_batch``).
        prompts: token ids per prompt (each non-empty, each fitting the context with
            ``max_new_tokens`` more).
        max_new_tokens: length cap per continuation (>= 1).
        method: a lossless method with a batched step (``ar``, ``ngram``; ``auto`` once
            heads exist); every one gives the same tokens.

    Returns:
        One list of new token ids per prompt, ending with the EOS token when the model
        produced one (nothing after it).

    Raises:
        PromptError: a prompt is empty or does not fit the context.
    """
    if not prompts:
        return []
    results = engine.generate_batch([list(p) for p in prompts], method,
                                    max_new_tokens=max_new_tokens)
    return [list(r.token_ids) for r in results]
