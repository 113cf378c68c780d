"""The full model's residual stream on recently committed tokens, read without touching the
KV cache: what the in-context layer-selection methods score drafts against (KnapSpec §3.4
"recent history X", CLaSp's hidden states of the last verification, DEL's shadow tokens).

A :class:`History` is one read-only forward of the last ``r`` committed positions through
every layer (``write_cache=False``: each position attends to the cache prefix and to the
earlier history positions), recording the residual stream after every sub-layer.
:class:`CommittedWindow` remembers how many tokens the last few steps committed, so a Step
can ask for "the tokens of the last m verification steps".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from selfspec.decoding.state import DecodeState
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan


@dataclass
class History:
    """The full model on ``r`` committed positions.

    Attributes:
        tokens: ``[1, r]`` their token ids.
        positions: ``[1, r]`` their positions.
        states: ``2L + 1`` tensors ``[r, d]``: ``states[0]`` the embeddings, ``states[2l+1]``
            the residual stream after layer ``l``'s attention, ``states[2l+2]`` after its MLP
            (KnapSpec's ``X[0..2L]``; layer boundaries are ``states[0::2]``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    states: list[torch.Tensor]
    _labels: torch.Tensor | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.tokens.shape[1]

    def layer_states(self) -> list[torch.Tensor]:
        """``L + 1`` tensors ``[r, d]``: the embeddings and the output of every layer."""
        return self.states[0::2]

    def run(self, executor: LayerExecutor, state: DecodeState, hidden: torch.Tensor,
            start: int, end: int, plan: SkipPlan | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` (sub-layers per ``plan``) on ``B`` candidate states of the
        history positions at once, read-only: ``hidden`` ``[B, r, d]`` -> ``[B, r, d]``."""
        positions = self.positions.expand(hidden.shape[0], len(self))
        return executor.run_layers(hidden, positions, start, end, state.cache, plan,
                                   write_cache=False, free=True)

    def labels(self, executor: LayerExecutor) -> torch.Tensor:
        """``[r]`` the full model's own greedy next token at each position (KnapSpec eq. 9's
        ``y``: the committed token after a generated position, the model's prediction inside
        the prompt), computed once."""
        if self._labels is None:
            self._labels = executor.logits(self.states[-1].unsqueeze(0))[0].argmax(-1)
        return self._labels


@torch.inference_mode()
def read_history(executor: LayerExecutor, state: DecodeState, num_tokens: int) -> History | None:
    """Run the full model read-only over the last ``num_tokens`` positions whose KV is in
    every layer (all committed tokens but the last), recording every sub-layer's output.

    Args:
        executor: the model's executor.
        state: the generation (its cache is read, never written).
        num_tokens: ``r``; clipped to the positions available.

    Returns:
        The :class:`History`, or ``None`` when fewer than one position is available.
    """
    available = state.seq_len - 1  # the last token's KV is written by the next step
    r = min(num_tokens, available)
    if r < 1:
        return None
    start = available - r
    tokens = torch.tensor([state.tokens[start:available]], device=executor.device)   # [1, r]
    positions = state.positions(start, r)
    hidden = executor.embed(tokens)
    states = [hidden[0]]

    def record(layer_idx: int, sublayer: str, out: torch.Tensor) -> None:
        states.append(out[0])

    executor.run_layers(hidden, positions, 0, executor.num_layers, state.cache,
                        observe=record, write_cache=False)
    return History(tokens, positions, states)


class CommittedWindow:
    """Tokens committed by each of the last ``steps`` Step calls.

    Args:
        steps: m, the window length in steps.
    """

    def __init__(self, steps: int) -> None:
        self._committed: deque[int] = deque(maxlen=steps)

    def clear(self) -> None:
        """Forget every step (a new generation)."""
        self._committed.clear()

    def add(self, committed: int) -> None:
        """Record one step's committed token count."""
        self._committed.append(committed)

    def tokens(self, minimum: int = 1) -> int:
        """Tokens the window's steps committed, at least ``minimum`` (early on the history
        reaches back into the prompt)."""
        return max(sum(self._committed), minimum)
