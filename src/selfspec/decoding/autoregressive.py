"""Autoregressive decoding on the layer executor: the baseline every method must reproduce."""

from __future__ import annotations

import torch

from selfspec.decoding.sampling import choose_next
from selfspec.decoding.state import DecodeState


def decode_autoregressive(state: DecodeState) -> None:
    """Generate one token per full forward until ``state`` is done.

    Greedy decoding takes the argmax; otherwise temperature / top-k / top-p sampling with the
    state's seeded generator. Tokens are committed to ``state`` one at a time.

    Args:
        state: a fresh :class:`DecodeState` (its cache is filled by the prefill here).
    """
    executor = state.executor
    sampling = state.options.sampling
    num_layers = executor.num_layers
    logits = state.prefill()  # [1, V]
    while True:
        token = choose_next(logits, sampling, state.generator)  # [1]
        state.commit([int(token)])
        if state.done:
            return
        pos = state.seq_len - 1
        positions = torch.tensor([[pos]], device=executor.device)
        logits = executor.forward(token.view(1, 1), positions, state.cache)[:, -1]
        state.stats.layer_forwards += num_layers
