"""The per-layer KV cache owned by selfspec (docs/design.md "Glossary": KV cache).

Each layer keeps its own length: an early-exit draft writes only the layers it ran, and
later methods (DSSD, AdaDecode) fill deeper layers afterwards. Storage is preallocated per
layer as ``[B, H_kv, capacity, head_dim]`` and grows by doubling, so appending a token is one
in-place copy and reading is a view (no ``torch.cat`` on the decode path).

A *fixed* cache (``fixed=True``: CUDA graphs, :mod:`selfspec.executor.cuda_graphs`) never
reallocates: a captured graph reads and writes its storage by address, so it is allocated
once at its full capacity (zeroed: a graph's attention reads every slot, masked) and an
append beyond it raises :class:`CacheFullError` instead of growing.

Invariants (asserted): a layer's positions are ``0 .. length-1`` with no gaps, so an append
must start exactly at the layer's current length; crops only shrink.

A position may be held *masked* in a layer (:meth:`KVCache.append_masked`): it keeps its slot,
so the no-gap rule holds, but attention never reads it. That is SpecEE's treatment of the
layers an early-exited token skipped (no KV at all: later tokens attend to the tokens that did
reach the layer). Layers without masked positions carry no mask and cost nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """An append beyond a fixed cache's capacity (a fixed cache never reallocates)."""


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
        fixed: never grow (storage allocated once, zeroed; :class:`CacheFullError` beyond
            ``capacity``): the static cache CUDA graphs replay on.
    """

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 256, fixed: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self._capacity = capacity
        self.fixed = fixed
        dims = (shape.batch_size, shape.num_kv_heads, capacity, shape.head_dim)
        alloc = torch.zeros if fixed else torch.empty
        self._keys = [alloc(dims, dtype=dtype, device=self.device) for _ in range(shape.num_layers)]
        self._values = [alloc(dims, dtype=dtype, device=self.device)
                        for _ in range(shape.num_layers)]
        self._lengths = [0] * shape.num_layers
        # Per layer: None (every held position is visible) or [capacity] bool, False = masked.
        self._visible: list[torch.Tensor | None] = [None] * shape.num_layers

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
        """Make room for at least ``capacity`` positions per layer (keeps contents).

        Raises:
            CacheFullError: a fixed cache asked for more than its capacity.
        """
        if capacity <= self._capacity:
            return
        if self.fixed:
            raise CacheFullError(
                f"a fixed KV cache holds {self._capacity} positions; {capacity} were asked")
        new_cap = max(capacity, 2 * self._capacity)
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                new = torch.empty(old.shape[:2] + (new_cap,) + old.shape[3:], dtype=old.dtype,
                                  device=old.device)
                n = self._lengths[i]
                new[:, :, :n].copy_(old[:, :, :n])
                store[i] = new
        for i, old in enumerate(self._visible):
            if old is not None:
                grown = torch.ones(new_cap, dtype=torch.bool, device=old.device)
                grown[: old.shape[0]] = old
                self._visible[i] = grown
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
        end = start + key.shape[2]
        keys, values = self.claim(layer, start, key.shape[2])
        keys[:, :, start:end].copy_(key)
        values[:, :, start:end].copy_(value)
        return keys[:, :, :end], values[:, :, :end]

    def claim(self, layer: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold ``count`` new visible positions from ``start`` in ``layer`` and return the
        layer's whole storage ``[B, H_kv, capacity, head_dim]`` (keys, values) for the caller
        to write them in before anything reads them (the fused sub-layers write their
        keys in the kernel: :mod:`selfspec.executor.fused_layers`).

        Raises:
            AssertionError: ``start`` leaves a gap or overwrites held positions.
        """
        length = self._lengths[layer]
        assert start == length, (
            f"KV cache layer {layer} holds {length} positions; an append must start there, "
            f"got {start}")
        end = length + count
        if end > self._capacity:
            self.reserve(end)
        if self._visible[layer] is not None:
            self._visible[layer][length:end] = True
        self._lengths[layer] = end
        return self._keys[layer], self._values[layer]

    def hold(self, start: int, count: int) -> None:
        """Every layer, each holding exactly ``start`` positions, now holds ``start + count``
        whose keys and values were already written into its storage (a CUDA graph's replay
        writes them by address, :mod:`selfspec.executor.cuda_graphs`).

        Raises:
            AssertionError: a layer does not hold exactly ``start`` positions, or a layer
                holds masked positions.
            CacheFullError: a fixed cache would pass its capacity.
        """
        assert all(n == start for n in self._lengths), (
            f"hold({start}, {count}) needs every layer at {start}; lengths {self._lengths}")
        assert all(v is None for v in self._visible), "hold() on a cache with masked positions"
        self.reserve(start + count)
        self._lengths = [start + count] * self.shape.num_layers

    def storage(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's whole key and value storage ``[B, H_kv, capacity, head_dim]`` (the
        lists themselves: a fixed cache's never change)."""
        return self._keys, self._values

    def any_masked(self, start: int, end: int) -> bool:
        """Whether a layer in ``[start, end)`` holds a masked position."""
        return any(self._visible[i] is not None and self.visible(i) is not None
                   for i in range(start, end))

    def append_masked(self, layer: int, start: int, count: int = 1) -> None:
        """Hold ``count`` positions from ``start`` in ``layer`` without keys or values:
        attention skips them (SpecEE's skipped layers; see the module doc).

        Raises:
            AssertionError: ``start`` leaves a gap or overwrites held positions.
        """
        length = self._lengths[layer]
        assert start == length, (
            f"KV cache layer {layer} holds {length} positions; an append must start there, "
            f"got {start}")
        end = length + count
        if end > self._capacity:
            self.reserve(end)
        if self._visible[layer] is None:
            self._visible[layer] = torch.ones(self._capacity, dtype=torch.bool, device=self.device)
        self._keys[layer][:, :, length:end].zero_()
        self._values[layer][:, :, length:end].zero_()
        self._visible[layer][length:end] = False
        self._lengths[layer] = end

    def copy_out(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions ``[start, end)`` of every layer: what a prefix cache keeps of a
        prompt (:mod:`selfspec.decoding.core.prefix_cache`).

        Returns:
            Keys and values, ``[L, B, H_kv, end - start, head_dim]`` each, in new storage
            (later writes to this cache never reach them).

        Raises:
            AssertionError: ``0 <= start <= end`` does not hold, a layer holds fewer than
                ``end`` positions, or holds a masked position in the range (its slot has no
                keys or values to copy).
        """
        assert 0 <= start <= end, f"cannot copy positions [{start}, {end}) out of a KV cache"
        for i, n in enumerate(self._lengths):
            assert n >= end, (
                f"KV cache layer {i} holds {n} positions; cannot copy positions up to {end}")
            mask = self._visible[i]
            assert mask is None or bool(mask[start:end].all()), (
                f"KV cache layer {i} holds masked positions in [{start}, {end})")
        # One stack per kind: a single allocation and one pass over the span.
        keys = torch.stack([k[:, :, start:end] for k in self._keys])
        values = torch.stack([v[:, :, start:end] for v in self._values])
        return keys, values

    def copy_in(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Append ``T`` positions from ``start`` to every layer, copied from ``keys`` and
        ``values`` ``[L, B, H_kv, T, head_dim]`` (as :meth:`copy_out` returns them): a prefix
        cache's hit written into a row's own cache before the rest of its prompt runs.

        Raises:
            ValueError: ``keys`` or ``values`` not of this cache's geometry and dtype (a copy
                would silently round to the cache's dtype).
            AssertionError: a layer does not hold exactly ``start`` positions.
            CacheFullError: a fixed cache would pass its capacity.
        """
        shape = self.shape
        want = (shape.num_layers, shape.batch_size, shape.num_kv_heads)
        for name, t in (("keys", keys), ("values", values)):
            if (t.dim() != 5 or tuple(t.shape[:3]) != want or t.shape[4] != shape.head_dim
                    or t.dtype != self.dtype):
                raise ValueError(
                    f"{name} must be [L, B, H_kv, T, head_dim] = [{', '.join(map(str, want))}, "
                    f"T, {shape.head_dim}] in {self.dtype}; got {list(t.shape)} in {t.dtype}")
        if keys.shape != values.shape:
            raise ValueError(f"keys {list(keys.shape)} and values {list(values.shape)} differ")
        count = keys.shape[3]
        for i in range(shape.num_layers):
            stored_k, stored_v = self.claim(i, start, count)
            stored_k[:, :, start:start + count].copy_(keys[i])
            stored_v[:, :, start:start + count].copy_(values[i])

    def visible(self, layer: int) -> torch.Tensor | None:
        """``[length(layer)]`` bool, False at masked positions; ``None`` when the layer holds
        no masked position (the common case: attend to everything)."""
        mask = self._visible[layer]
        if mask is None:
            return None
        mask = mask[: self._lengths[layer]]
        if bool(mask.all()):
            return None
        return mask

    def masked_count(self, layer: int) -> int:
        """Masked positions ``layer`` holds."""
        mask = self.visible(layer)
        return 0 if mask is None else int((~mask).sum())

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
        self._visible = [None] * self.shape.num_layers
