"""KV cache invariants: per-layer lengths, no gaps, crop/truncate/rollback."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.executor import CacheShape, KVCache
from selfspec.executor.cache import CacheFullError

SHAPE = CacheShape(num_layers=3, batch_size=1, num_kv_heads=2, head_dim=4)


def _kv(start: int, count: int) -> torch.Tensor:
    """Keys whose every entry is the position, so contents can be checked."""
    pos = torch.arange(start, start + count, dtype=torch.float32)
    return pos.view(1, 1, count, 1).expand(1, 2, count, 4).clone()


def test_append_returns_all_positions_and_grows():
    cache = KVCache(SHAPE, torch.float32, "cpu", capacity=2)
    cache.append(0, _kv(0, 3), _kv(0, 3), start=0)
    keys, values = cache.append(0, _kv(3, 2), -_kv(3, 2), start=3)
    assert keys.shape == (1, 2, 5, 4) and cache.capacity >= 5
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert values[0, 0, :, 0].tolist() == [0, 1, 2, -3, -4]
    assert cache.lengths() == [5, 0, 0]


def test_gap_and_overwrite_are_refused():
    cache = KVCache(SHAPE, torch.float32, "cpu")
    cache.append(1, _kv(0, 2), _kv(0, 2), start=0)
    with pytest.raises(AssertionError):
        cache.append(1, _kv(3, 1), _kv(3, 1), start=3)  # gap
    with pytest.raises(AssertionError):
        cache.append(1, _kv(1, 1), _kv(1, 1), start=1)  # overwrite
    with pytest.raises(AssertionError):
        cache.crop(1, 3)  # crops only shrink


def test_rollback_removes_last_tokens_only_where_held():
    cache = KVCache(SHAPE, torch.float32, "cpu")
    for layer, n in enumerate([10, 7, 4]):
        cache.append(layer, _kv(0, n), _kv(0, n), start=0)
    cache.rollback(4)  # sequence length 10 → 6
    assert cache.lengths() == [6, 6, 4]
    cache.truncate(5)
    assert cache.lengths() == [5, 5, 4]
    cache.append(2, _kv(4, 1), _kv(4, 1), start=4)  # refill the deeper layer later
    assert cache.get(2)[0][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    cache.reset()
    assert cache.lengths() == [0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "crop", "rollback"]),
                          st.integers(0, 2), st.integers(0, 6)), max_size=30))
def test_random_operations_keep_positions_contiguous(ops):
    cache = KVCache(SHAPE, torch.float32, "cpu", capacity=1)
    for op, layer, n in ops:
        if op == "append" and n > 0:
            start = cache.length(layer)
            cache.append(layer, _kv(start, n), _kv(start, n), start=start)
        elif op == "crop":
            cache.crop(layer, min(n, cache.length(layer)))
        elif op == "rollback":
            cache.rollback(min(n, cache.max_length()))
        for i in range(SHAPE.num_layers):
            keys, values = cache.get(i)
            assert keys.shape[2] == values.shape[2] == cache.length(i)
            assert keys[0, 0, :, 0].tolist() == list(range(cache.length(i)))


def _filled(n: int, capacity: int = 4) -> KVCache:
    """A cache holding positions ``0 .. n-1`` in every layer (keys = position + layer,
    values = their negation)."""
    cache = KVCache(SHAPE, torch.float32, "cpu", capacity=capacity)
    for layer in range(SHAPE.num_layers):
        cache.append(layer, _kv(0, n) + layer, -_kv(0, n) - layer, start=0)
    return cache


def test_copy_out_and_in_move_a_span_between_caches():
    """The prefix cache's two operations: a span copied out is a copy (later writes to the
    source do not reach it), and copied into a fresh cache it reads back exactly, every layer
    at the span's length, ready for the rest of the prompt to append."""
    source = _filled(6)
    keys, values = source.copy_out(0, 5)
    assert keys.shape == values.shape == (3, 1, 2, 5, 4)
    source.truncate(2)
    source.append(0, _kv(0, 1) + 99, _kv(0, 1), start=2)  # overwrite a copied slot
    target = KVCache(SHAPE, torch.float32, "cpu", capacity=2)  # grows on copy_in
    target.copy_in(keys, values, start=0)
    assert target.lengths() == [5, 5, 5]
    for layer in range(3):
        k, v = target.get(layer)
        assert k[0, 1, :, 0].tolist() == [p + layer for p in range(5)]
        assert torch.equal(v, -k)
    target.append(1, _kv(5, 1), _kv(5, 1), start=5)  # the suffix continues from there
    middle, _ = _filled(6).copy_out(2, 4)
    assert middle[2, 0, 0, :, 0].tolist() == [4.0, 5.0]


def test_copy_out_and_in_refuse_what_would_be_wrong():
    cache = _filled(3)
    with pytest.raises(AssertionError):
        cache.copy_out(0, 4)  # beyond what the layers hold
    cache.append_masked(1, start=3)
    cache.append(0, _kv(3, 1), _kv(3, 1), start=3)
    cache.append(2, _kv(3, 1), _kv(3, 1), start=3)
    with pytest.raises(AssertionError):
        cache.copy_out(2, 4)  # position 3 is masked in layer 1: no keys to copy
    keys, values = cache.copy_out(0, 3)
    with pytest.raises(AssertionError):
        _filled(1).copy_in(keys, values, start=0)  # layers already hold a position
    with pytest.raises(ValueError):
        KVCache(SHAPE, torch.float64, "cpu").copy_in(keys, values, start=0)  # dtype
    with pytest.raises(ValueError):
        KVCache(SHAPE, torch.float32, "cpu").copy_in(keys[:2], values[:2], start=0)  # layers
    fixed = KVCache(SHAPE, torch.float32, "cpu", capacity=2, fixed=True)
    with pytest.raises(CacheFullError):
        fixed.copy_in(keys, values, start=0)
