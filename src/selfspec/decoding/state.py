"""The state of one generation, shared by every decoding method.

A method's loop only drafts, verifies and calls :meth:`DecodeState.commit`; the state owns
the sequence, the KV cache, the stopping conditions (EOS, ``max_new_tokens``, the model's
context, a caller's stop check) and the counters that become :class:`GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.decoding.sampling import SamplingConfig
from selfspec.errors import InvalidArgumentError, PromptError
from selfspec.executor import KVCache, LayerExecutor

# Called with each batch of newly committed token ids; returns True to stop generating
# (stop strings, a user's cancel). Streaming output hangs off this too.
TokenSink = Callable[[list[int]], bool]


@dataclass(frozen=True)
class DecodeOptions:
    """Limits and sampling for one generation.

    Attributes:
        max_new_tokens: at most this many tokens are generated (>= 1).
        sampling: greedy or sampling configuration.
        eos_token_ids: generation ends after committing any of these ids.

    Raises:
        InvalidArgumentError: ``max_new_tokens < 1``.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(
                f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationStats:
    """What one generation did and how long it took.

    Attributes:
        prompt_tokens: prompt length in tokens.
        new_tokens: tokens generated.
        total_ms: wall time from the start of the prefill to the last commit, in ms.
        ttft_ms: time to first token (prefill + first token), in ms.
        tokens_per_s: ``new_tokens / total_ms`` in tokens per second.
        drafted: draft tokens proposed (speculative methods; 0 for autoregressive).
        accepted: draft tokens accepted by verification.
        verifications: verification forwards run.
        draft_ms / verify_ms: wall time spent drafting / verifying, in ms.
        layer_forwards: decoder-layer evaluations of one token each, after the prefill.
        exit_layer_total: sum over draft tokens of the layers their prediction ran.
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens), ``"context"`` or ``"stop"``.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    total_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    layer_forwards: int = 0
    exit_layer_total: int = 0
    finish_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens per verification: accepted draft tokens + the recovered/bonus token
        (0 without verification)."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0

    @property
    def mean_exit_layer(self) -> float:
        """Mean number of layers a draft token's prediction ran (0 without drafts)."""
        return self.exit_layer_total / self.drafted if self.drafted else 0.0

    @property
    def layer_forwards_per_token(self) -> float:
        """Decoder-layer evaluations per generated token (L for autoregressive decoding)."""
        return self.layer_forwards / self.new_tokens if self.new_tokens else 0.0


class DecodeState:
    """The sequence, KV cache, limits and counters of one generation (batch size 1).

    Args:
        executor: the model's layer executor.
        prompt_ids: the prompt's token ids (non-empty).
        options: limits and sampling.
        sink: optional callback for committed tokens (see :data:`TokenSink`).
        cache_margin: extra cache positions beyond prompt + max_new_tokens (draft overshoot).

    Raises:
        PromptError: the prompt is empty or fills the model's context.
    """

    def __init__(self, executor: LayerExecutor, prompt_ids: list[int], options: DecodeOptions,
                 sink: TokenSink | None = None, cache_margin: int = 16) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty; give at least one token of text")
        if len(prompt_ids) >= executor.max_positions:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{executor.max_positions}; shorten the prompt to leave room for new tokens")
        self.executor = executor
        self.options = options
        self.sink = sink
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.context_limit = executor.max_positions
        capacity = min(self.prompt_len + options.max_new_tokens, self.context_limit) + cache_margin
        self.cache: KVCache = executor.new_cache(capacity=capacity)
        self.generator = options.sampling.make_generator(executor.device)
        self.stats = GenerationStats(prompt_tokens=self.prompt_len)
        self.finish_reason: str | None = None
        self._start = time.perf_counter()

    @property
    def seq_len(self) -> int:
        """Committed sequence length (prompt + generated)."""
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """How many more tokens may be committed before a limit is reached."""
        return min(self.options.max_new_tokens - self.num_generated,
                   self.context_limit - self.seq_len)

    @property
    def done(self) -> bool:
        """True once a stopping condition has been met."""
        return self.finish_reason is not None

    def positions(self, start: int, count: int) -> torch.Tensor:
        """``[1, count]`` int64 positions ``start .. start+count-1`` on the model's device."""
        return torch.arange(start, start + count, device=self.executor.device).unsqueeze(0)

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append accepted tokens to the sequence, stopping at EOS or a limit.

        Args:
            new_tokens: token ids in order (e.g. accepted draft tokens + the next token).

        Returns:
            The tokens actually committed (a prefix of ``new_tokens``).
        """
        if self.done:
            return []
        kept = new_tokens[: max(self.remaining, 0)]
        eos = self.options.eos_token_ids
        for i, tok in enumerate(kept):
            if tok in eos:
                kept = kept[: i + 1]
                self.finish_reason = "eos"
                break
        first = self.num_generated == 0
        self.tokens.extend(kept)
        if first and kept:
            self.stats.ttft_ms = (time.perf_counter() - self._start) * 1e3
        if self.sink is not None and kept and self.sink(kept) and self.finish_reason is None:
            self.finish_reason = "stop"
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = ("length" if self.num_generated >= self.options.max_new_tokens
                                  else "context")
        return kept

    def finish(self) -> GenerationStats:
        """Close the timers and return the final statistics."""
        stats = self.stats
        stats.total_ms = (time.perf_counter() - self._start) * 1e3
        stats.new_tokens = self.num_generated
        stats.tokens_per_s = stats.new_tokens / (stats.total_ms / 1e3) if stats.total_ms > 0 else 0.0
        stats.finish_reason = self.finish_reason or "length"
        return stats

    def prefill(self) -> torch.Tensor:
        """Run the prompt through all layers, filling the cache.

        Returns:
            ``[1, V]`` logits for the token after the prompt.
        """
        ids = torch.tensor([self.tokens], device=self.executor.device)
        return self.executor.forward(ids, self.positions(0, self.prompt_len), self.cache,
                                     last_only=True)[:, -1]
