"""The per-layer KV cache owned by selfspec (DESIGN.md "The KV cache").

Each layer keeps its own length: an early-exit draft writes only the layers it ran, and
later methods (DSSD, AdaDecode) fill deeper layers afterwards. Storage is preallocated per
layer as ``[B, H_kv, capacity, head_dim]`` and grows by doubling, so appending a token is one
in-place copy and reading is a view (no ``torch.cat`` on the decode path).

Invariants (asserted): a layer's positions are ``0 .. length-1`` with no gaps, so an append
must start exactly at the layer's current length; crops only shrink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    """Geometry of one model's KV cache.

    Attributes:
        num_layers: number of decoder layers L.
        batch_size: B.
        num_kv_heads: H_kv (grouped-query attention keeps fewer KV heads than query heads).
        head_dim: per-head dimension.
    """

    num_layers: int
    batch_size: int
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Keys and values for every layer, each layer with its own length.

    Args:
        shape: the cache geometry.
        dtype: storage dtype (the model's dtype).
        device: storage device.
        capacity: positions preallocated per layer; grows (doubling) when exceeded.
    """

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self._capacity = capacity
        dims = (shape.batch_size, shape.num_kv_heads, capacity, shape.head_dim)
        self._keys = [torch.empty(dims, dtype=dtype, device=self.device) for _ in range(shape.num_layers)]
        self._values = [torch.empty(dims, dtype=dtype, device=self.device) for _ in range(shape.num_layers)]
        self._lengths = [0] * shape.num_layers

    @property
    def num_layers(self) -> int:
        """Number of layers L."""
        return self.shape.num_layers

    @property
    def capacity(self) -> int:
        """Positions currently allocated per layer."""
        return self._capacity

    def length(self, layer: int) -> int:
        """Number of positions layer ``layer`` holds."""
        return self._lengths[layer]

    def lengths(self) -> list[int]:
        """Per-layer lengths, ``[L]`` ints (a copy)."""
        return list(self._lengths)

    def max_length(self) -> int:
        """The longest layer's length: the sequence length the cache has seen."""
        return max(self._lengths)

    def reserve(self, capacity: int) -> None:
        """Make room for at least ``capacity`` positions per layer (keeps contents)."""
        if capacity <= self._capacity:
            return
        new_cap = max(capacity, 2 * self._capacity)
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                new = torch.empty(old.shape[:2] + (new_cap,) + old.shape[3:], dtype=old.dtype,
                                  device=old.device)
                n = self._lengths[i]
                new[:, :, :n].copy_(old[:, :, :n])
                store[i] = new
        self._capacity = new_cap

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``T`` new positions into ``layer`` and return all its keys and values.

        Args:
            layer: 0-based layer index.
            key: ``[B, H_kv, T, head_dim]`` (after rotary embedding).
            value: ``[B, H_kv, T, head_dim]``.
            start: position of the first new token; must equal ``length(layer)``.

        Returns:
            Views ``[B, H_kv, start + T, head_dim]`` of the layer's keys and values.

        Raises:
            AssertionError: ``start`` leaves a gap or overwrites held positions.
        """
        length = self._lengths[layer]
        assert start == length, (
            f"KV cache layer {layer} holds {length} positions; an append must start there, got {start}")
        end = length + key.shape[2]
        if end > self._capacity:
            self.reserve(end)
        keys, values = self._keys[layer], self._values[layer]
        keys[:, :, length:end].copy_(key)
        values[:, :, length:end].copy_(value)
        self._lengths[layer] = end
        return keys[:, :, :end], values[:, :, :end]

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[B, H_kv, length(layer), head_dim]`` of a layer's keys and values."""
        n = self._lengths[layer]
        return self._keys[layer][:, :, :n], self._values[layer][:, :, :n]

    def crop(self, layer: int, length: int) -> None:
        """Keep only the first ``length`` positions of ``layer``.

        Raises:
            AssertionError: ``length`` is negative or longer than the layer holds.
        """
        assert 0 <= length <= self._lengths[layer], (
            f"cannot crop KV cache layer {layer} of length {self._lengths[layer]} to {length}")
        self._lengths[layer] = length

    def truncate(self, length: int) -> None:
        """Crop every layer to at most ``length`` positions (layers already shorter keep theirs).

        This is the rollback after a rejection: everything at position >= ``length`` goes,
        in every layer that holds it.
        """
        assert length >= 0, f"cannot truncate the KV cache to {length}"
        self._lengths = [min(n, length) for n in self._lengths]

    def rollback(self, n_tokens: int) -> None:
        """Drop the last ``n_tokens`` positions of the sequence from every layer that holds them.

        The sequence length is :meth:`max_length`; layers shorter than the new length keep theirs.
        """
        assert 0 <= n_tokens <= self.max_length(), (
            f"cannot roll back {n_tokens} tokens from a cache of length {self.max_length()}")
        self.truncate(self.max_length() - n_tokens)

    def reset(self) -> None:
        """Empty every layer (storage is kept for reuse)."""
        self._lengths = [0] * self.shape.num_layers
