"""The executor reproduces the HF model's own forward pass."""

import pytest
import torch

from selfspec.errors import InvalidArgumentError, UnsupportedArchitectureError
from selfspec.executor import LayerExecutor, SkipPlan

from tiny import tiny_model

ARCHS = ["llama", "qwen2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_matches_hf_in_chunks(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    ex = LayerExecutor(model)
    cache = ex.new_cache(capacity=4)  # forces growth
    pos = torch.arange(24).unsqueeze(0)
    out = []
    for lo, hi in [(0, 9), (9, 10), (10, 11), (11, 24)]:
        out.append(ex.forward(ids[:, lo:hi], pos[:, lo:hi], cache))
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=1e-5, atol=1e-5)
    assert cache.lengths() == [24] * 6


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_forward_close_to_hf(arch):
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits.float()
    ex = LayerExecutor(model)
    out = ex.forward(ids, torch.arange(16).unsqueeze(0), ex.new_cache()).float()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_batch_of_two_matches_hf():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    ex = LayerExecutor(model)
    out = ex.forward(ids, torch.arange(12).expand(2, 12), ex.new_cache(batch_size=2))
    torch.testing.assert_close(out, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_layer_ranges_compose_and_fill_only_their_layers():
    model = tiny_model("qwen2")
    ex = LayerExecutor(model)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(8).unsqueeze(0)
    cache = ex.new_cache()
    h = ex.run_layers(ex.embed(ids), pos, 0, 2, cache)
    assert cache.lengths() == [8, 8, 0, 0, 0, 0]
    h = ex.run_layers(h, pos, 2, 6, cache)
    torch.testing.assert_close(ex.logits(h), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_vocab_rows_select_logit_columns():
    model = tiny_model("llama")
    ex = LayerExecutor(model)
    ids = torch.tensor([[1, 2, 3]])
    h = ex.run_layers(ex.embed(ids), torch.arange(3).unsqueeze(0), 0, 6, ex.new_cache())
    rows = torch.tensor([5, 17, 200])
    torch.testing.assert_close(ex.logits(h, vocab_rows=rows), ex.logits(h)[..., rows])


def test_skip_plan_skips_sublayers_and_writes_no_kv():
    model = tiny_model("llama")
    ex = LayerExecutor(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    pos = torch.arange(4).unsqueeze(0)
    cache = ex.new_cache()
    plan = SkipPlan(skip_attention=frozenset({1, 3}), skip_mlp=frozenset({2}))
    h = ex.run_layers(ex.embed(ids), pos, 0, 6, cache, skip=plan)
    assert cache.lengths() == [4, 0, 4, 0, 4, 4]
    # Reference: the same sub-layers by hand through HF modules.
    ref = ex.embed(ids)
    cos, sin = model.model.rotary_emb(ref, pos)
    for i, layer in enumerate(model.model.layers):
        if i not in plan.skip_attention:
            ref = ref + layer.self_attn(layer.input_layernorm(ref), (cos, sin), None)[0]
        if i not in plan.skip_mlp:
            ref = ref + layer.mlp(layer.post_attention_layernorm(ref))
    # HF's attention without a mask is not causal; compare the last token, which sees all.
    torch.testing.assert_close(h[:, -1], ref[:, -1], rtol=1e-5, atol=1e-5)
    assert SkipPlan.from_flags([False, True], [True, False]) == SkipPlan(
        frozenset({1}), frozenset({0}))


def test_observe_sees_every_sublayer_and_costs_nothing_when_unused():
    ex = LayerExecutor(tiny_model("llama"))
    ids, pos = torch.tensor([[5, 6, 7]]), torch.arange(3).unsqueeze(0)
    plan = SkipPlan(skip_attention=frozenset({1}), skip_mlp=frozenset({2}))
    seen = []
    h = ex.run_layers(ex.embed(ids), pos, 0, 6, ex.new_cache(), skip=plan,
                      observe=lambda i, sub, x: seen.append((i, sub, x.clone())))
    assert [(i, sub) for i, sub, _ in seen] == [(i, s) for i in range(6)
                                                for s in ("attention", "mlp")]
    torch.testing.assert_close(seen[-1][2], h, rtol=0, atol=0)
    # a skipped sub-layer passes the residual stream unchanged
    assert torch.equal(seen[2][2], seen[1][2]) and torch.equal(seen[5][2], seen[4][2])
    # each observed state is what running the layers up to there gives
    part = ex.run_layers(ex.embed(ids), pos, 0, 3, ex.new_cache(), skip=plan)
    torch.testing.assert_close(seen[5][2], part, rtol=0, atol=0)
    unobserved = ex.run_layers(ex.embed(ids), pos, 0, 6, ex.new_cache(), skip=plan)
    torch.testing.assert_close(unobserved, h, rtol=0, atol=0)


@pytest.mark.parametrize("num_new", [1, 3])
def test_read_only_attention_equals_appending_and_leaves_the_cache_alone(num_new):
    ex = LayerExecutor(tiny_model("qwen2"))
    ids = torch.randint(0, 256, (1, 10 + num_new), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(10 + num_new).unsqueeze(0)
    cache = ex.new_cache()
    ex.run_layers(ex.embed(ids[:, :10]), pos[:, :10], 0, 6, cache)
    keys_before = [k.clone() for k, _ in (cache.get(i) for i in range(6))]
    new, new_pos = ex.embed(ids[:, 10:]), pos[:, 10:]
    read_only = ex.score_layers(new, new_pos, 0, 6, cache)
    assert cache.lengths() == [10] * 6
    assert all(torch.equal(cache.get(i)[0], keys_before[i]) for i in range(6))
    appended = ex.run_layers(new, new_pos, 0, 6, cache)
    assert cache.lengths() == [10 + num_new] * 6
    torch.testing.assert_close(read_only, appended, rtol=1e-6, atol=1e-6)


def test_bad_layer_range_and_gap_are_errors():
    ex = LayerExecutor(tiny_model("llama"))
    h = ex.embed(torch.tensor([[1]]))
    with pytest.raises(InvalidArgumentError, match="outside"):
        ex.run_layers(h, torch.tensor([[0]]), 0, 7, ex.new_cache())
    with pytest.raises(AssertionError, match="must start"):
        ex.run_layers(h, torch.tensor([[3]]), 0, 1, ex.new_cache())


def test_unsupported_architecture_names_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="llama, qwen2"):
        LayerExecutor(model)
