"""Sampling configuration and the logits → probabilities transform shared by every method.

The same transform (temperature, then top-k, then top-p) is applied to draft and target
logits, which speculative sampling needs for losslessness (Leviathan et al. 2023, §2.3;
Chen et al. 2023, Alg. 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor.argmax import argmax_last
from selfspec.validation import check_float, check_int, check_seed


@dataclass(frozen=True)
class SamplingConfig:
    """How next tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 divides the logits before softmax.
        top_k: keep only the k most likely tokens (0 = no limit).
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p``
            (nucleus sampling, Holtzman et al. 2020); 1.0 = no limit.
        seed: seed of the ``torch.Generator`` used for sampling; ``None`` = non-deterministic.

    Raises:
        InvalidArgumentError: temperature negative or not finite, top_k not an integer >= 0,
            top_p outside (0, 1], seed not an integer that fits in 64 bits (bools and
            strings are refused, not converted).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Shared by the CLI and the API (selfspec.validation): types and ranges, so that a
        # string, a bool, NaN or an infinity never reaches torch.
        object.__setattr__(self, "temperature", check_float(
            "temperature", self.temperature, low=0.0, hint="0 = greedy, > 0 = sampling"))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, low=0,
                                                    hint="0 = no limit"))
        object.__setattr__(self, "top_p", check_float(
            "top_p", self.top_p, low=0.0, low_open=True, high=1.0, hint="1 = no limit"))
        object.__setattr__(self, "seed", check_seed(self.seed))

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (``None`` when no seed is set)."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Turn raw logits into the sampling distribution defined by ``config``.

    Args:
        logits: ``[..., V]`` raw logits (any float dtype).
        config: a non-greedy sampling configuration (``temperature > 0``).

    Returns:
        ``[..., V]`` float32 probabilities; masked tokens have probability exactly 0.

    Raises:
        InvalidArgumentError: ``config`` is greedy (temperature 0 has no distribution).
    """
    if config.greedy:
        raise InvalidArgumentError("greedy decoding (temperature 0) has no sampling "
                                   "distribution; use argmax or set temperature > 0")
    logits = logits.float()
    # Shift so the largest logit is 0 before dividing: softmax is unchanged, and a tiny
    # temperature (1e-45) sends the others to -inf instead of overflowing to inf - inf = NaN.
    # A temperature below float32's smallest value (5e-324) would divide by 0 (0 / 0 = NaN
    # at the top token): the smallest normal float32 gives the same greedy-like distribution.
    temperature = max(config.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= config.top_p
        # Said, not left to arithmetic: a top_p below float32's smallest value (5e-324, an
        # OpenAI client may send it) compares as 0, and would drop every token (NaN).
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row.

    Args:
        probs: ``[N, V]`` probabilities (rows sum to 1).
        generator: seeded generator for reproducibility, or ``None``.

    Returns:
        ``[N]`` int64 token ids.
    """
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def choose_next(logits: torch.Tensor, config: SamplingConfig,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from ``[N, V]`` logits: argmax when greedy, else a sample.

    Returns:
        ``[N]`` int64 token ids.
    """
    if config.greedy:
        return argmax_last(logits)
    return sample(logits_to_probs(logits, config), generator)
