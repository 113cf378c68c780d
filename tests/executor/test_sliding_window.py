"""Sliding-window attention in the executor (issue 75): the mask is transformers' own
(masking_utils ``sliding_window_causal``: a query at ``p`` sees keys ``p - W < k <= p``), and
every way of running layers gives what one prefill or one-token decoding gives under it:
chunked prefill, verification blocks, read-only scoring, deferred layer fills, ragged rows
and rollback. A tiny Mistral with a 4-position window on a 20-token prompt (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig
from transformers.masking_utils import sliding_window_causal_mask_function

from selfspec.executor import LayerExecutor
from selfspec.executor.attention import window_mask
from selfspec.executor.sync import position_block

from tiny import VOCAB

WINDOW = 4
PROMPT = 20


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, sliding_window=WINDOW,
                           tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (1, PROMPT + 6), generator=torch.Generator().manual_seed(1))


def _executor(model, **kw) -> LayerExecutor:
    return LayerExecutor(model, pack_weights=False, **kw)


def test_the_mask_is_transformers_sliding_window_causal():
    inside = sliding_window_causal_mask_function(WINDOW)
    num_new, total = 5, 12
    got = window_mask(num_new, total, 1, WINDOW, torch.device("cpu"))
    t_ = torch.tensor
    want = torch.tensor([[bool(inside(t_(0), t_(0), t_(total - num_new + t), t_(k)))
                          for k in range(total)]
                         for t in range(num_new)])
    assert torch.equal(got, want)


def test_prefill_chunks_and_decoding_equal_transformers(model, ids):
    ex = _executor(model, prefill_chunk=8)  # chunks of 8 > WINDOW: windows span chunks
    cache = ex.new_cache()
    logits = [ex.prefill(ids[:, :PROMPT], cache)]
    for p in range(PROMPT, ids.shape[1]):
        logits.append(ex.forward(ids[:, p:p + 1], position_block(p, 1, ids.device), cache)[:, -1])
    with torch.no_grad():
        want = model(ids).logits[0, PROMPT - 1:]
    torch.testing.assert_close(torch.cat(logits), want, atol=1e-4, rtol=1e-4)
    # The window binds: full attention gives other logits.
    with torch.no_grad():
        full = AutoModelForCausalLM.from_config(
            MistralConfig(**{**model.config.to_dict(), "sliding_window": None}),
            attn_implementation="sdpa")
        full.load_state_dict(model.state_dict())
        assert not torch.allclose(full(ids).logits[0, -1], want[-1], atol=1e-2)


def test_blocks_rows_scoring_and_rollback_equal_one_token_decoding(model, ids):
    ex = _executor(model)
    block = ids[:, PROMPT:]
    num = block.shape[1]
    decode = ex.new_cache()
    ex.prefill(ids[:, :PROMPT], decode)
    one = torch.cat([ex.forward(block[:, t:t + 1], position_block(PROMPT + t, 1, ids.device),
                                decode) for t in range(num)], dim=1)
    cache = ex.new_cache()
    ex.prefill(ids[:, :PROMPT], cache)
    positions = position_block(PROMPT, num, ids.device)
    # Read-only scoring first (the cache is left as it was), then a verification block.
    hidden = ex.score_layers(ex.embed(block), positions, 0, ex.num_layers, cache)
    assert cache.lengths() == [PROMPT] * ex.num_layers
    torch.testing.assert_close(ex.logits(hidden), one, atol=1e-5, rtol=1e-5)
    close = {"atol": 1e-5, "rtol": 1e-5}  # fp32 products of other row counts round apart
    torch.testing.assert_close(ex.forward(block, positions, cache), one, **close)
    # Rollback under the window, then the same tokens again.
    cache.truncate(PROMPT + 2)
    again = ex.forward(block[:, 2:], position_block(PROMPT + 2, num - 2, ids.device), cache)
    torch.testing.assert_close(again, one[:, 2:], **close)
    # Deferred layer fills: layer by layer, each layer's whole block at once.
    deferred = ex.new_cache()
    ex.prefill(ids[:, :PROMPT], deferred)
    h = ex.embed(block)
    for i in range(ex.num_layers):
        h = ex.run_layers_at(h, PROMPT, i, i + 1, deferred)
    torch.testing.assert_close(ex.logits(h), one, **close)
    # A ragged batch: row 0 three prompt tokens from PROMPT - 3, row 1 two block tokens.
    short = ex.new_cache()
    ex.prefill(ids[:, :PROMPT - 3], short)
    rows = ex.forward_rows(torch.cat([ids[0, PROMPT - 3:PROMPT], block[0, :2]]),
                           torch.tensor([*range(PROMPT - 3, PROMPT), PROMPT, PROMPT + 1]),
                           [3, 2], [short, _prefilled(ex, ids)])
    torch.testing.assert_close(rows[3:], one[0, :2], **close)


def _prefilled(ex: LayerExecutor, ids: torch.Tensor):
    cache = ex.new_cache()
    ex.prefill(ids[:, :PROMPT], cache)
    return cache


@torch.inference_mode()
def test_the_cuda_graphs_static_forward_masks_the_window(model, ids):
    """The graphs' static forward (run eagerly here, as on the CPU in tests/executor/test_gpu)
    attends over the whole capacity: its mask must carry each layer's window too."""
    from selfspec.executor.cuda_graphs import CudaGraphRunner, static_forward

    ex = _executor(model)
    runner = CudaGraphRunner(ex, capacity=64, max_tokens=4, replay="eager")
    cache = ex.new_cache(capacity=64)
    ex.prefill(ids[:, :PROMPT], cache)
    want = ex.forward(ids[:, PROMPT:PROMPT + 3], position_block(PROMPT, 3, "cpu"), cache)
    static = runner.cache
    ex.prefill(ids[:, :PROMPT], static)
    keys, values = static.storage()
    got = static_forward(ex, ids[:, PROMPT:PROMPT + 3], position_block(PROMPT, 3, "cpu"), keys,
                         values, torch.arange(64), ex.rope.cos, ex.rope.sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
