"""Deferred layers: positions left at different layers catch up in batches, exactly."""

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.executor import LayerExecutor

from tiny import tiny_model


def test_positions_exiting_at_different_layers_catch_up_exactly():
    model = tiny_model("qwen2", seed=2, num_layers=8)
    ex = LayerExecutor(model)
    ids = [3, 9, 27, 81, 243 % 256, 17, 5, 101, 44]
    prompt, drafted = ids[:4], ids[4:]
    cache = ex.new_cache()
    ex.forward(torch.tensor([prompt]), torch.arange(4).unsqueeze(0), cache)
    deferred = DeferredLayers(ex, cache)
    # Each drafted token stops at its own layer, shallower or deeper than the one before.
    for i, (token, layer) in enumerate(zip(drafted, [6, 2, 4, 1, 7])):
        deferred.add(token, 4 + i)
        deferred.advance(layer)
        assert deferred.reached() == layer
        assert cache.length(layer - 1) == 5 + i  # predecessors were filled on the way
    deferred.advance(8)
    logits = ex.logits(deferred.stacked())
    reference = model(torch.tensor([ids])).logits[:, 4:]
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert cache.lengths() == [len(ids)] * 8
    # Each position ran each layer exactly once.
    assert deferred.layer_forwards == len(drafted) * 8
