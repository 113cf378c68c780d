"""The memory-bandwidth roofline of batch-1 decoding.

Generating one token with a dense decoder reads every decoder-layer weight and the
``lm_head`` once (the embedding lookup reads one row, negligible), so no method that runs
the full model per token can beat ``bandwidth / weight bytes`` tokens per second. The
bandwidth is measured on this machine (a large tensor sum, best of several) with the
run's thread count, and recorded in the report. Self-speculative methods read fewer
weight bytes per token, so they can exceed a fraction of 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Bandwidth:
    """A measured read bandwidth.

    Attributes:
        bytes_per_s: best observed read bandwidth in bytes per second.
        buffer_bytes: size of the buffer read, in bytes.
        repeats: how many timed reads the best was taken over.
        threads: torch intra-op threads during the measurement.
    """

    bytes_per_s: float
    buffer_bytes: int
    repeats: int
    threads: int

    @property
    def gb_per_s(self) -> float:
        """Bandwidth in GB/s (10^9 bytes per second)."""
        return self.bytes_per_s / 1e9


def measure_bandwidth(buffer_mib: int = 512, repeats: int = 5,
                      clock: Callable[[], float] = time.perf_counter) -> Bandwidth:
    """Measure read bandwidth as the best of ``repeats`` sums of a float32 buffer.

    The buffer should be much larger than the last-level cache (512 MiB by default) so the
    reads come from memory, as the weights do during decoding.

    Args:
        buffer_mib: buffer size in MiB (>= 1).
        repeats: timed sums after one untimed one (>= 1).
        clock: seconds, monotonic.

    Raises:
        ValueError: ``buffer_mib < 1`` or ``repeats < 1``.
    """
    if buffer_mib < 1 or repeats < 1:
        raise ValueError("buffer_mib and repeats must be >= 1")
    buffer = torch.ones(buffer_mib * (1 << 20) // 4, dtype=torch.float32)
    buffer.sum()  # first touch and thread-pool start-up are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        buffer.sum()
        best = min(best, clock() - start)
    nbytes = buffer.numel() * buffer.element_size()
    return Bandwidth(nbytes / max(best, 1e-12), nbytes, repeats, torch.get_num_threads())


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one full forward of one token reads: every decoder layer's
    parameters, the final norm and ``lm_head`` (tied embeddings are counted once, as the
    head). Each tensor is counted once even when several modules share it.

    Args:
        model: a supported ``*ForCausalLM`` (its parts where
            :func:`selfspec.models.architecture.decoder_modules` finds them: GPT-NeoX's
            ``gpt_neox.layers``, the others' ``model.layers``).
    """
    from selfspec.models.architecture import decoder_modules, describe

    seen: set[tuple[int, int]] = set()
    total = 0
    parts = decoder_modules(model, describe(model.config))
    modules = [*parts.layers, parts.norm, parts.lm_head]
    for module in modules:
        for p in module.parameters():
            key = (p.data_ptr(), p.numel())
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class Roofline:
    """The bandwidth bound of one model on one machine.

    Attributes:
        bandwidth: the measured bandwidth.
        weight_bytes: weight bytes read per generated token.
        method_bytes: method label → its own weight bytes per token, for rows that decode on
            another kernel than the run's (``ar:decode_kernel=int4``).
    """

    bandwidth: Bandwidth
    weight_bytes: int
    method_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """The bound, in tokens per second: bandwidth / weight bytes per token."""
        return self.bandwidth.bytes_per_s / self.weight_bytes if self.weight_bytes else 0.0

    def fraction(self, tokens_per_s: float, method: str | None = None) -> float:
        """``tokens_per_s`` as a fraction of the bound (of ``method``'s own weight bytes
        where it has them)."""
        nbytes = self.method_bytes.get(method, self.weight_bytes) if method else self.weight_bytes
        bound = self.bandwidth.bytes_per_s / nbytes if nbytes else 0.0
        return tokens_per_s / bound if bound else 0.0
