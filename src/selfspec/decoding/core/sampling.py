"""Sampling configuration, the logits → probabilities transform shared by every method, and
the position-keyed noise of seeded sampling.

The same transform (temperature, then top-k, then top-p) is applied to draft and target
logits, which speculative sampling needs for losslessness (Leviathan et al. 2023, §2.3;
Chen et al. 2023, Alg. 2).

**Seeded sampling is position-keyed** (:class:`KeyedNoise`): with ``SamplingConfig.seed``
set, the token at absolute sequence position ``t`` is ``argmax_x p_t(x) / E_t(x)`` with
``E_t`` ``V`` Exp(1) draws from a generator seeded by a hash of ``(seed, t)`` only. This is
the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow & Minka 2014, "A* Sampling"): ``-log E``
is Gumbel(0, 1), so the choice is ``argmax_x log p_t(x) + g_t(x)``, distributed exactly as
``p_t`` over seeds, with independent noise at every position. The sample is then a function
of the seed and the prefix alone: speculative methods verify a draft by exact match against
it (as greedy decoding does) and commit ``ar``'s seeded tokens whatever was drafted;
drafters draft with the same noise on their own ``q`` (Gumbel coupling: Daliri, Musco &
Suresh 2024, "Coupling without Communication and Drafter-Invariant Speculative Decoding"),
so a draft token is accepted whenever both arg-maxes agree. Unseeded sampling keeps the
Leviathan/Chen rejection rule, whose acceptance ``1 - TV(p, q)`` is the best coupling; the
Gumbel coupling accepts somewhat less (at least ``(1 - TV) / (1 + TV)``, ibid.).
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
        seed: makes sampling reproducible: every token is chosen with position-keyed noise
            (:class:`KeyedNoise`), so the output depends only on the seed, the prompt and the
            model, never on what a drafter proposed; ``None`` = non-deterministic (speculative
            methods then use the Leviathan/Chen rejection rule, which accepts more drafts).

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

    @property
    def keyed(self) -> bool:
        """True when tokens are chosen with position-keyed noise (sampling with a seed)."""
        return self.seed is not None and not self.greedy

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` (``None`` when no seed is set); with a seed it
        drives only choices that cannot change the output (e.g. AdaDecode's exit draws)."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen

    def keyed_noise(self, vocab_size: int,
                    device: torch.device | str = "cpu") -> KeyedNoise | None:
        """The position-keyed noise of this configuration (``None`` unless :attr:`keyed`)."""
        return KeyedNoise(self.seed, vocab_size, device) if self.keyed else None


_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One step of SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
    generators"; Vigna's reference code): a bijective 64-bit mix of ``value``."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit generator seed of sequence position ``position`` under ``seed``: a hash of
    the pair only (so any two positions, or seeds, get unrelated streams)."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))


class KeyedNoise:
    """Exp(1) noise keyed by ``(seed, position)``: row ``t`` is ``V`` draws of a
    ``torch.Generator`` on ``device`` seeded with :func:`position_key` ``(seed, t)``, so it
    is the same whoever asks, in whatever order. A token is then chosen as
    :func:`keyed_choice` ``(p_t, row t)`` (the Gumbel-max trick; see the module docstring).

    Rows are kept from the first position asked for on (a draft's rows serve its
    verification; rejected positions' rows serve the next draft), and dropped once a request
    starts past them, so at most the longest draft + 1 rows are held.

    Args:
        seed: the sampling seed (any integer; taken modulo 2**64).
        vocab_size: ``V``, the draws per row.
        device: where the rows live (the executor's device: no host copy).
    """

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, position: int) -> torch.Tensor:
        """``[V]`` float32 Exp(1) draws of sequence position ``position`` (all > 0)."""
        row = self._rows.get(position)
        if row is None:
            self._generator.manual_seed(position_key(self.seed, position))
            # -log u, u ~ U[0, 1) in float64 (53-bit steps: no visible truncation of the
            # tail), is Exp(1) and several times faster than exponential_ on a CPU. It is
            # never 0 (u < 1), so p / E is never 0 / 0; u = 0 gives inf, which never wins.
            uniform = torch.rand(self.vocab_size, generator=self._generator,
                                 dtype=torch.float64, device=self.device)
            row = uniform.log_().neg_().float()
            self._rows[position] = row
        return row

    def rows(self, start: int, count: int) -> torch.Tensor:
        """``[count, V]``: the rows of positions ``start .. start + count - 1``; rows of
        positions before ``start`` are forgotten."""
        for old in [t for t in self._rows if t < start]:
            del self._rows[old]
        if count == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        return torch.stack([self.row(t) for t in range(start, start + count)])


def keyed_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max choice ``argmax_x probs(x) / noise(x)`` (= ``argmax log p + g``,
    ``g = -log noise`` Gumbel(0, 1)) per row.

    Args:
        probs: ``[N, V]`` (or ``[V]``) probabilities, masked tokens exactly 0.
        noise: the same shape: Exp(1) draws (:class:`KeyedNoise` rows), all > 0.

    Returns:
        ``[N]`` (or ``[]``) int64 token ids, on the device of ``probs``; no host sync.
    """
    return (probs / noise).argmax(dim=-1)


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
                generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
    """Pick the next token from ``[N, V]`` logits: argmax when greedy; with ``noise`` (seeded
    sampling: the ``[N, V]`` :class:`KeyedNoise` rows of the ``N`` positions) the keyed
    choice :func:`keyed_choice`; else a sample drawn with ``generator``.

    Returns:
        ``[N]`` int64 token ids.
    """
    if config.greedy:
        return argmax_last(logits)
    if noise is not None:
        return keyed_choice(logits_to_probs(logits, config), noise)
    return sample(logits_to_probs(logits, config), generator)
