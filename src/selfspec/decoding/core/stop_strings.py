"""Stop strings and streaming: the sink the loop's state calls at every commit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Streamer(Protocol):
    """Anything with transformers' streamer interface (e.g. ``transformers.TextStreamer``)."""

    def put(self, value: torch.Tensor) -> None: ...
    def end(self) -> None: ...


class StopStringSink:
    """Streams committed tokens and stops at the first stop string
    (a :data:`~selfspec.decoding.core.state.TokenSink`).

    Only the tail of the generated tokens is decoded at each commit (a stop string of n
    characters spans at most n tokens), so checking costs O(1) per token.

    Args:
        tokenizer: the model's tokenizer (``decode``).
        stop: stop strings (empty ones are ignored).
        streamer: optional streamer that receives every committed token.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], streamer: Streamer | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.window = max((len(s) for s in self.stop), default=0)
        self.streamer = streamer
        self.generated: list[int] = []

    def __call__(self, tokens: list[int]) -> bool:
        self.generated.extend(tokens)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(tokens))
        if not self.stop:
            return False
        tail = self.tokenizer.decode(self.generated[-(self.window + len(tokens)):],
                                     skip_special_tokens=True)
        return any(s in tail for s in self.stop)

    def cut(self, text: str) -> str:
        """``text`` cut before the first stop string it contains."""
        for s in self.stop:
            if s in text:
                text = text[: text.index(s)]
        return text
