"""The state of one generation, shared by the loop and every Step.

A Step only drafts, verifies and calls :meth:`DecodeState.commit`; the state owns the
sequence, the KV cache, the stopping conditions (EOS, ``max_new_tokens``, the model's
context, a caller's stop check) and the :class:`GenerationStats` the loop accumulates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from selfspec.decoding.core.prefix_cache import PrefixCache
from selfspec.decoding.core.processors import LogitsProcessing, LogitsProcessor
from selfspec.decoding.core.sampling import KeyedNoise, SamplingConfig, choose_next
from selfspec.decoding.core.stats import GenerationStats
from selfspec.errors import InvalidArgumentError, PromptError
from selfspec.executor import KVCache, LayerExecutor
from selfspec.executor.executor import Observer
from selfspec.executor.sync import device_tensor, position_block
from selfspec.validation import check_int

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
        processing: penalties, a grammar and log probabilities
            (:mod:`selfspec.decoding.core.processors`); the default does nothing.

    Raises:
        InvalidArgumentError: ``max_new_tokens`` not an integer >= 1 (bools and floats are
            refused); ``sampling`` or ``processing`` of the wrong type.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: frozenset[int] = frozenset()
    processing: LogitsProcessing = field(default_factory=LogitsProcessing)

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, low=1)
        if not isinstance(self.sampling, SamplingConfig):
            raise InvalidArgumentError(
                f"sampling must be a SamplingConfig; got {type(self.sampling).__name__}")
        if not isinstance(self.processing, LogitsProcessing):
            raise InvalidArgumentError(
                f"processing must be a LogitsProcessing; got {type(self.processing).__name__}")


class DecodeState:
    """The sequence, KV cache, limits and counters of one generation (batch size 1).

    Args:
        executor: the model's layer executor.
        prompt_ids: the prompt's token ids (non-empty).
        options: limits and sampling.
        sink: optional callback for committed tokens (see :data:`TokenSink`).
        cache_margin: extra cache positions beyond prompt + max_new_tokens (draft overshoot).
        prefix_cache: KV of earlier prompts: :meth:`prefill` copies the longest kept prefix
            of this prompt and runs only the rest, then keeps this prompt's blocks
            (:mod:`selfspec.decoding.core.prefix_cache`); ``None``: prefill it all.

    Raises:
        PromptError: the prompt is empty or fills the model's context.
        InvalidArgumentError: a prefix cache whose blocks are not whole prefill chunks of
            ``executor`` (``executor.prefill_chunk``).
    """

    def __init__(self, executor: LayerExecutor, prompt_ids: list[int], options: DecodeOptions,
                 sink: TokenSink | None = None, cache_margin: int = 16,
                 prefix_cache: PrefixCache | None = None) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty; give at least one token of text")
        if len(prompt_ids) >= executor.max_positions:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{executor.max_positions}; shorten the prompt to leave room for new tokens")
        self.executor = executor
        self.options = options
        self.sink = sink
        if prefix_cache is not None and prefix_cache.block_size % executor.prefill_chunk:
            raise InvalidArgumentError(
                f"the prefix cache's blocks ({prefix_cache.block_size} tokens) must be whole "
                f"prefill chunks ({executor.prefill_chunk} tokens) of this model's executor")
        self.prefix_cache = prefix_cache
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.context_limit = executor.max_positions
        capacity = min(self.prompt_len + options.max_new_tokens, self.context_limit) + cache_margin
        graphs = getattr(executor, "graphs", None)  # CUDA graphs replay on a static cache
        static = None if graphs is None else graphs.decode_cache(capacity, self)
        self.cache: KVCache = static or executor.new_cache(capacity=capacity)
        self.generator = options.sampling.make_generator(executor.device)
        # Seeded sampling: every token from the position-keyed noise (decoding/core/sampling).
        self.noise: KeyedNoise | None = options.sampling.keyed_noise(executor.vocab_size,
                                                                     executor.device)
        # None when nothing is processed: the hot path then passes logits through untouched.
        self.processor: LogitsProcessor | None = (
            LogitsProcessor(options.processing, executor.vocab_size)
            if options.processing.active else None)
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
        """``[1, count]`` int64 positions ``start .. start+count-1`` on the model's device
        (tagged with ``start``: the executor reads it without a sync)."""
        return position_block(start, count, self.executor.device)

    def last_token(self) -> torch.Tensor:
        """``[1, 1]`` int64 tensor of the last committed token on the model's device."""
        return device_tensor([[self.tokens[-1]]], self.executor.device)

    def noise_rows(self, offset: int, count: int) -> torch.Tensor | None:
        """``[count, V]`` position-keyed noise of positions ``seq_len + offset ..`` (seeded
        sampling, :class:`~selfspec.decoding.core.sampling.KeyedNoise`), or ``None`` when
        sampling is greedy or unseeded."""
        return None if self.noise is None else self.noise.rows(self.seq_len + offset, count)

    def choose_next(self, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The tokens of positions ``seq_len + offset ..`` from their ``[N, V]`` logits:
        argmax, the keyed choice (seeded sampling) or a draw with :attr:`generator`
        (:func:`~selfspec.decoding.core.sampling.choose_next`).

        Returns:
            ``[N]`` int64 token ids on the logits' device.
        """
        return choose_next(logits, self.options.sampling, self.generator,
                           self.noise_rows(offset, logits.shape[0]))

    def process(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits after this generation's output processing (penalties, grammar;
        :mod:`selfspec.decoding.core.processors`): every Step chooses or verifies tokens on
        these.

        Args:
            logits: ``[N, V]``; row ``i`` predicts the token after the committed sequence and
                ``draft[:i]``.
            draft: the draft tokens the rows follow (at least ``N - 1``).

        Returns:
            ``[N, V]`` logits: ``logits`` itself when nothing is processed.
        """
        return logits if self.processor is None else self.processor.apply(logits, draft)

    def commit(self, new_tokens: list[int], logits: torch.Tensor | None = None) -> list[int]:
        """Append accepted tokens to the sequence, stopping at EOS or a limit.

        Args:
            new_tokens: token ids in order (e.g. accepted draft tokens + the next token).
            logits: ``[len(new_tokens), V]`` the processed logits (:meth:`process`) each token
                was chosen from; required when output processing is on (log probabilities
                are read from them; penalties and grammar advance with the tokens).

        Returns:
            The tokens actually committed (a prefix of ``new_tokens``).

        Raises:
            RuntimeError: output processing is on and a Step committed without its logits
                (a method that does not support it; see ``Step.processes_logits``).
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
        if self.processor is not None and kept:
            if logits is None:
                raise RuntimeError("output processing is on but a Step committed tokens "
                                   "without the logits they were chosen from")
            self.processor.commit(kept, logits)
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
        stats.tokens_per_s = (stats.new_tokens / (stats.total_ms / 1e3) if stats.total_ms > 0
                              else 0.0)
        stats.finish_reason = self.finish_reason or "length"
        return stats

    def prefill(self, observe: Observer | None = None) -> torch.Tensor:
        """Run the prompt through all layers, filling the cache
        (:meth:`~selfspec.executor.LayerExecutor.prefill`: fixed chunks of positions;
        ``observe``: as its).

        With a :attr:`prefix_cache`, the KV of the longest kept prefix of the prompt (whole
        chunks, at least the last token left to run) is copied in first and only the rest
        runs, bit for bit as in a prefill from 0 (``stats.cached_tokens`` positions reused;
        not with ``observe``, which must see the whole prompt); then the prompt's blocks are
        kept for later prompts.

        Returns:
            ``[1, V]`` logits for the token after the prompt.
        """
        ex = self.executor
        prompt = self.tokens[: self.prompt_len]
        start = 0
        if self.prefix_cache is not None:
            # KV computed in other formats or chunks rounds differently: never mixed.
            namespace = (ex.name, ex.dtype, ex.formats, ex.prefill_chunk)
            if observe is None:
                start = self.prefix_cache.load(prompt, self.cache, namespace,
                                               align=ex.prefill_chunk)
        logits = ex.prefill(device_tensor([prompt], ex.device), self.cache, start, observe)
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt, self.cache, namespace)
        self.stats.cached_tokens = start
        return logits
