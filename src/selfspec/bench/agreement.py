"""Teacher-forced greedy agreement: how often a row's model picks a reference's next token.

A row that runs other weights or other numbers than ``ar`` (``ar:decode_kernel=gguf``, a
llama.cpp baseline) is compared with ``ar``'s greedy output in two ways. Parity and the shared
prefix (:mod:`selfspec.bench.metrics`) follow free-running generations, which part for good
at their first differing token: one near-tie flipped by rounding early in an answer makes the
rest of the two texts unrelated, so those figures say little about how close two models are.
Teacher forcing asks the question position by position: given the prompt and ``ar``'s first
``i`` tokens, does the row's model choose ``ar``'s token ``i``? (The "top-1 agreement" of
quantization evaluations, e.g. llama.cpp's ``perplexity --kl-divergence`` "same top p".)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.executor import LayerExecutor
from selfspec.executor.sync import position_block


@torch.inference_mode()
def forced_greedy(executor: LayerExecutor, prompt_ids: Sequence[int],
                  tokens: Sequence[int]) -> list[int]:
    """The greedy token the model chooses at each position of ``tokens``, given the prompt and
    the tokens of ``tokens`` before it.

    The prompt goes through :meth:`LayerExecutor.prefill` as a generation's does, and
    ``tokens`` in verification-sized blocks (``row_attention_max`` tokens), which every
    decoding kernel computes bit for bit as one-token decoding: choice ``i`` is exactly the
    token greedy decoding would pick after that prefix.

    Args:
        executor: the model, on the decoding kernel to measure.
        prompt_ids: the prompt's ``N >= 1`` token ids.
        tokens: the reference continuation (``T`` ids).

    Returns:
        ``T`` token ids: choice ``i`` follows ``prompt_ids + tokens[:i]``.
    """
    if not tokens:
        return []
    device = executor.device
    cache = executor.new_cache(1, capacity=len(prompt_ids) + len(tokens))
    logits = executor.prefill(torch.tensor([list(prompt_ids)], device=device), cache)
    choices = [int(logits[0].argmax())]
    pos = len(prompt_ids)
    rest = list(tokens[:-1])
    step = max(1, executor.row_attention_max)
    for first in range(0, len(rest), step):
        block = rest[first:first + step]
        out = executor.forward(torch.tensor([block], device=device),
                               position_block(pos, len(block), device), cache)
        choices += out[0].argmax(-1).tolist()
        pos += len(block)
    return choices

