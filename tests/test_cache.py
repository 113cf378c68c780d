"""KV cache invariants: per-layer lengths, no gaps, crop/truncate/rollback."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.executor import CacheShape, KVCache

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
