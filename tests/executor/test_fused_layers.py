"""Fused decoder sub-layers (executor/fused_layers.py, kernels/fused_layers.h) on the w4a8 and
bf16 kernels: the same layer as torch's path on the same products up to float rounding, every
row as computed alone (verification == one-token decoding, a ragged batch == each row alone,
bit for bit), the KV cache written where the torch path writes it, and the cases it does not
take (bulk blocks, masked caches) left to torch. Qwen3 (per-head q/k norms) and Gemma 3 (four
(1 + w) norms a layer, q/k norms, GELU-tanh, a binding sliding window, a RoPE base per layer
type, query_pre_attn_scalar) on tiny random models from transformers' config classes."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3Config

import selfspec
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor, SkipPlan
from selfspec.executor.bf16_rows import bf16_rows_available
from selfspec.executor.cpu import detect_cpu
from selfspec.executor.w4a8 import w4a8_available

from tiny import tiny_config, tiny_model, tiny_tokenizer

W4A8 = pytest.mark.skipif(not w4a8_available(), reason="no w4a8 kernel here")
BF16 = pytest.mark.skipif(not bf16_rows_available(), reason="no bf16 kernel here")
# (kernel, the model's dtype)
SETUPS = [pytest.param("w4a8", torch.float32, marks=W4A8),
          pytest.param("w4a8", torch.bfloat16, marks=W4A8),
          pytest.param("bf16", torch.bfloat16, marks=BF16)]


WINDOW = 8  # shorter than the tests' prompts + blocks: it binds on the sliding layers
FAMILY_CONFIGS = {
    "qwen3": lambda common: Qwen3Config(head_dim=16, **common),
    "gemma3_text": lambda common: Gemma3TextConfig(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"] * 2, **common),
}


def _model(arch: str, dtype: torch.dtype = torch.float32):
    """``tiny_model(arch)``, or for Qwen3 / Gemma 3 a 4-layer random one of their config
    classes with norms away from 1 (a norm the kernel left out would show) and Gemma's last
    layer damped (its post-norms' 1 + w = 0.3: early exits agree often, not always, so
    drafts are accepted and rejected)."""
    if arch not in FAMILY_CONFIGS:
        return tiny_model(arch, dtype=dtype)
    common = tiny_config("llama", num_layers=4).to_dict()
    common = {k: common[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings")}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILY_CONFIGS[arch](common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
        if arch == "gemma3_text":
            last = model.model.layers[-1]
            last.post_attention_layernorm.weight.fill_(-0.7)
            last.post_feedforward_layernorm.weight.fill_(-0.7)
    return model.to(dtype).eval().requires_grad_(False)


def _view(arch: str, dtype: torch.dtype = torch.float32, kernel: str = "w4a8") -> LayerExecutor:
    """A tiny model's executor whose projections all decode on ``kernel``: a w4a8 draft view,
    or the bf16 model on the bf16 kernel (``--decode-kernel bf16``)."""
    model = _model(arch, dtype)
    if kernel == "bf16":
        ex = LayerExecutor(model, name=f"tiny-{arch}", rows="bf16")
    else:
        ex = LayerExecutor(model, name=f"tiny-{arch}").draft_view("w4a8")
    assert ex.fused_layers() is not None and ex.fused_layers().kernel == kernel
    return ex


def _prefilled(ex: LayerExecutor, prompt: torch.Tensor):
    cache = ex.new_cache(capacity=8)  # small: the fused path must grow it
    ex.forward(prompt, torch.arange(prompt.shape[1]).unsqueeze(0), cache)
    return cache


@pytest.mark.parametrize(("kernel", "dtype", "tolerance"), [
    # fp32: they differ by float rounding (measured: 3e-7 of the largest logit), which could
    # move an activation across an int8 rounding boundary, not more.
    pytest.param("w4a8", torch.float32, 1e-3, marks=W4A8),
    # bf16: the torch path rounds to bf16 after every operator, the fused one keeps fp32.
    pytest.param("bf16", torch.bfloat16, 5e-2, marks=BF16)])
# qwen2: q/k/v biases; qwen3: q/k norms; gemma3_text: all of Gemma 3's layer, its window
# (8) binding on the 12 positions.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_fused_layers_match_the_torch_path_on_the_same_products(arch, kernel, dtype, tolerance):
    ex = _view(arch, dtype, kernel)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (1, 9), generator=gen)
    block = torch.randint(0, 250, (1, 3), generator=gen)
    pos = torch.arange(9, 12).unsqueeze(0)
    fused_cache = _prefilled(ex, prompt)
    fused = ex.forward(block, pos, fused_cache)
    torch_path = ex.fused_layers
    ex.fused_layers = lambda: None  # the torch operators on the same w4a8 products
    try:
        ref_cache = _prefilled(ex, prompt)
        ref = ex.forward(block, pos, ref_cache)
    finally:
        ex.fused_layers = torch_path
    fused, ref = fused.float(), ref.float()
    assert (fused - ref).abs().max() < tolerance * ref.abs().max()
    assert fused_cache.lengths() == ref_cache.lengths() == [12] * ex.num_layers
    for layer in range(ex.num_layers):
        for got, want in zip(fused_cache.get(layer), ref_cache.get(layer)):
            got, want = got.float(), want.float()
            assert (got - want).abs().max() < tolerance * want.abs().max() + 1e-5


@pytest.mark.parametrize(("kernel", "dtype"), SETUPS)
def test_a_verification_block_equals_one_token_decoding_bit_for_bit(kernel, dtype):
    ex = _view("qwen2", dtype, kernel)
    prompt = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[5, 17, 99, 3, 42, 8]])
    cache = _prefilled(ex, prompt)
    block = ex.forward(tokens, torch.arange(7, 13).unsqueeze(0), cache)[0]
    cache = _prefilled(ex, prompt)
    alone = torch.cat([ex.forward(tokens[:, t:t + 1], torch.tensor([[7 + t]]), cache)[0]
                       for t in range(6)])
    assert torch.equal(block, alone)


@pytest.mark.parametrize(("kernel", "dtype"), SETUPS[1:])
def test_a_ragged_batch_equals_each_row_alone_bit_for_bit(kernel, dtype):
    ex = _view("llama", dtype, kernel)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (1, n), generator=gen) for n in (5, 11, 8)]
    new = [torch.randint(0, 250, (n,), generator=gen) for n in (1, 4, 2)]
    caches = [_prefilled(ex, p) for p in prompts]
    ids = torch.cat(new)
    positions = torch.cat([torch.arange(p.shape[1], p.shape[1] + len(n))
                           for p, n in zip(prompts, new)])
    batched = ex.forward_rows(ids, positions, [len(n) for n in new], caches)
    offset = 0
    for p, n in zip(prompts, new):
        cache = _prefilled(ex, p)
        alone = ex.forward(n[None], torch.arange(p.shape[1], p.shape[1] + len(n))[None], cache)[0]
        assert torch.equal(batched[offset:offset + len(n)], alone)
        offset += len(n)


@W4A8
def test_skip_plans_and_observers_run_on_the_fused_path():
    ex = _view("qwen2")
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = _prefilled(ex, prompt)
    seen = []
    plan = SkipPlan.from_flags(attention=[False, True, False, False, False, False],
                               mlp=[False, False, True, False, False, False])
    hidden = ex.embed(torch.tensor([[7, 9]]))
    out = ex.run_layers(hidden, torch.tensor([[6, 7]]), 0, ex.num_layers, cache, plan,
                        observe=lambda i, part, h: seen.append((i, part, h)))
    assert [(i, part) for i, part, _ in seen] == [
        (i, part) for i in range(ex.num_layers) for part in ("attention", "mlp")]
    assert torch.equal(seen[1][2], seen[2][2])   # layer 1's attention skipped
    assert torch.equal(seen[4][2], seen[5][2])   # layer 2's MLP skipped
    assert torch.equal(seen[-1][2], out)
    lengths = cache.lengths()
    assert lengths[1] == 6 and all(n == 8 for i, n in enumerate(lengths) if i != 1)


@W4A8
def test_bulk_blocks_and_masked_caches_stay_on_the_torch_path(monkeypatch):
    ex = _view("llama")
    calls = []
    fused = ex.fused_layers()
    monkeypatch.setattr(fused, "attention", lambda *a: calls.append(a) or a[1])
    monkeypatch.setattr(fused, "attention_at", lambda *a: calls.append(a) or a[1])
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = _prefilled(ex, prompt)              # prefill: a bulk block
    assert calls == []
    cache.append_masked(0, 12)                  # SpecEE's skipped layer
    for layer in range(1, ex.num_layers):
        keys, values = cache.get(layer)
        cache.append(layer, keys[:, :, :1], values[:, :, :1], 12)
    ex.forward(torch.tensor([[3]]), torch.tensor([[13]]), cache)
    assert calls == []
    hidden = ex.run_layers_at(ex.embed(torch.tensor([[5]])), 14, 0, 1, cache)
    assert calls == []                          # the layer-by-layer entry: the masked layer
    for layer in range(1, ex.num_layers):       # stays on torch, the others need not
        hidden = ex.run_layers_at(hidden, 14, layer, layer + 1, cache)
    assert len(calls) == ex.num_layers - 1 and cache.lengths() == [15] * ex.num_layers


@W4A8
def test_w4a8_models_decode_on_fused_layers_and_methods_keep_ar_tokens():
    engine = selfspec.from_pretrained_model(tiny_model("qwen2", dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-qwen2")
    engine.executor.set_decode_kernel("w4a8")
    assert engine.executor.fused_layers() is not None
    reference = engine.generate("def add(a, b):\n", max_new_tokens=24).token_ids
    for method, options in (("ngram", {}), ("layerskip", {"exit_layer": 3, "draft_len": 4})):
        out = engine.generate("def add(a, b):\n", method, max_new_tokens=24, **options)
        assert out.token_ids == reference, method
    batch = engine.generate_batch(["def add(a, b):\n", "x = 1\n"], max_new_tokens=24)
    assert batch[0].token_ids == reference
    engine.executor.set_decode_kernel("weights")  # another kernel: the fused layers go
    assert engine.executor.fused_layers() is None


@BF16
def test_a_small_bf16_model_decodes_on_fused_bf16_layers_by_default():
    """``auto`` puts matrices under 4 MiB on the bf16 kernel, whether bf16 is emulated or
    native: a model made of them (SmolLM2-135M) decodes on fused bf16 layers with nothing
    asked; its bulk work (prefill) runs in fp32 where bf16 is emulated and in bf16 (oneDNN)
    where it is native, the path this CPU takes."""
    ex = LayerExecutor(tiny_model("llama", dtype=torch.bfloat16), name="tiny-llama")
    assert ex.fused_layers() is not None and ex.fused_layers().kernel == "bf16"
    assert ex.formats.rows == "bf16"
    assert ex.formats.bulk == (torch.bfloat16 if detect_cpu().native_bf16 else torch.float32)
    ex.set_decode_kernel("fp16")  # FBGEMM: not a kernel the fused layers run
    assert ex.fused_layers() is None


@W4A8
def test_a_cache_of_another_dtype_is_not_written_by_the_kernel(monkeypatch):
    """The kernel writes keys in the hidden states' dtype: a cache kept in another one (made
    by hand) goes to the torch path, which refuses it, rather than being filled with bytes
    of the wrong format."""
    from selfspec.executor.cache import KVCache

    ex = _view("qwen2")                          # fp32
    calls = []
    monkeypatch.setattr(ex.fused_layers(), "attention", lambda *a: calls.append(a) or a[1])
    cache = KVCache(ex.new_cache().shape, torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match="dtype"):
        ex.forward(torch.tensor([[5]]), torch.tensor([[0]]), cache)
    assert calls == []


@pytest.mark.parametrize(("kernel", "dtype"), SETUPS)
def test_layer_by_layer_calls_equal_one_call_bit_for_bit_with_the_rope_table_growing(kernel, dtype):
    """SpecEE and AdaDecode run a token one layer per call; the fused path's RoPE rows are
    slices of an fp32 copy of the table, which must follow the table when it grows."""
    ex = _view("qwen2", dtype, kernel)
    prompt = torch.randint(0, 250, (1, 5), generator=torch.Generator().manual_seed(4))
    whole, split = _prefilled(ex, prompt), _prefilled(ex, prompt)
    hidden = ex.embed(torch.tensor([[11, 3]]))
    positions = torch.tensor([[5, 6]])
    want = ex.run_layers(hidden, positions, 0, ex.num_layers, whole)
    got = hidden
    for i in range(ex.num_layers):
        got = ex.run_layers(got, positions, i, i + 1, split)
    assert torch.equal(got, want)
    for pos0, num in [(2, 3), (300, 2), (9, 1), (700, 4)]:   # 300, 700 grow the table
        cos, sin = ex.rope.span(hidden, pos0, num)
        ref_cos, ref_sin = ex.rope.rows(hidden, torch.arange(pos0, pos0 + num)[None])
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        assert cos.dtype == torch.float32 and cos.is_contiguous() and cos.shape[0] == num
    ex.rope.lookup(hidden, torch.tensor([[1500]]))   # grown by the torch path: the copy follows
    cos, _ = ex.rope.span(hidden, 1400, 3)
    assert torch.equal(cos, ex.rope.rows(hidden, torch.arange(1400, 1403)[None])[0])


@pytest.mark.parametrize(("kernel", "dtype"), SETUPS)
def test_run_layers_at_equals_run_layers_bit_for_bit_and_returns_fresh_tensors(kernel, dtype):
    """The layer-by-layer entry (DeferredLayers: SpecEE, AdaDecode, DSSD) takes the position as
    an int and writes each attention output to one scratch buffer: the same hidden states and
    cache as run_layers, and no returned tensor is overwritten by a later call."""
    ex = _view("qwen2", dtype, kernel)
    prompt = torch.randint(0, 250, (1, 5), generator=torch.Generator().manual_seed(6))
    whole, split = _prefilled(ex, prompt), _prefilled(ex, prompt)
    hidden = ex.embed(torch.tensor([[11, 3]]))
    want = ex.run_layers(hidden, torch.tensor([[5, 6]]), 0, ex.num_layers, whole)
    got, kept = hidden, []
    for i in range(ex.num_layers):
        got = ex.run_layers_at(got, 5, i, i + 1, split)
        kept.append((got, got.clone()))
    assert torch.equal(got, want)
    assert all(torch.equal(out, copy) for out, copy in kept)
    assert whole.lengths() == split.lengths() == [7] * ex.num_layers
    for i in range(ex.num_layers):
        assert torch.equal(whole.get(i)[0], split.get(i)[0])
        assert torch.equal(whole.get(i)[1], split.get(i)[1])
    one = ex.embed_token(8)                      # a view of the table's row, then one call
    assert torch.equal(one, ex.embed(torch.tensor([[8]])))
    assert torch.equal(ex.run_layers_at(one, 7, 0, ex.num_layers, split),
                       ex.run_layers(one, torch.tensor([[7]]), 0, ex.num_layers, whole))
    assert torch.equal(one, ex.embed(torch.tensor([[8]])))   # the table is not written
    with pytest.raises(IndexError):
        ex.embed_token(ex.embed_tokens.num_embeddings)
    with pytest.raises(InvalidArgumentError, match="outside"):
        ex.run_layers_at(one, 8, 0, ex.num_layers + 1, split)
    assert split.lengths() == [8] * ex.num_layers    # nothing written


@pytest.mark.parametrize(("kernel", "dtype"), SETUPS)
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_verification_and_ragged_rows_equal_decoding_bit_for_bit_past_the_window(arch, kernel,
                                                                                 dtype):
    """Qwen3's and Gemma 3's fused layers keep every row as computed alone: a verification
    block equals one-token decoding, and a ragged batch each row alone, with Gemma's window
    binding (prompt 9 + 6 tokens > 8) and its two RoPE tables (local, global) in one call."""
    ex = _view(arch, dtype, kernel)
    prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[5, 17, 99, 3, 42, 8]])
    cache = _prefilled(ex, prompt)
    block = ex.forward(tokens, torch.arange(9, 15).unsqueeze(0), cache)[0]
    cache = _prefilled(ex, prompt)
    alone = torch.cat([ex.forward(tokens[:, t:t + 1], torch.tensor([[9 + t]]), cache)[0]
                       for t in range(6)])
    assert torch.equal(block, alone)
    caches = [_prefilled(ex, prompt), _prefilled(ex, prompt[:, :4])]
    rows = ex.forward_rows(torch.tensor([5, 17, 99, 3]), torch.tensor([9, 10, 11, 4]), [3, 1],
                           caches)
    assert torch.equal(rows[:3], block[:3])
    one = ex.forward(torch.tensor([[3]]), torch.tensor([[4]]), _prefilled(ex, prompt[:, :4]))
    assert torch.equal(rows[3], one[0, 0])


PROMPTS = [[116, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116], [97, 98, 99] * 4,
           [100, 101, 102, 32, 102, 40, 120, 41, 58, 10]]


def _greedy(ex: LayerExecutor, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of ``ex`` one at a time after a prefill of ``prompt``."""
    cache = ex.new_cache(capacity=8)
    ids = torch.tensor([prompt])
    token = int(ex.forward(ids, torch.arange(len(prompt))[None], cache)[0, -1].argmax())
    out = [token]
    for pos in range(len(prompt), len(prompt) + steps - 1):
        token = int(ex.forward(torch.tensor([[token]]), torch.tensor([[pos]]), cache)[0, -1]
                    .argmax())
        out.append(token)
    return out


@W4A8
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_greedy_tokens_on_fused_layers_equal_the_torch_paths(arch, monkeypatch):
    """fp32 on w4a8 products: greedy tokens of the fused layers equal the torch path's over
    3 prompts x 32 tokens (Gemma's window binding from position 8 on)."""
    ex = _view(arch)
    fused = [_greedy(ex, p, 32) for p in PROMPTS]
    monkeypatch.setattr(ex, "fused_layers", lambda: None)
    assert [_greedy(ex, p, 32) for p in PROMPTS] == fused


@BF16
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_lossless_methods_keep_ar_tokens_on_fused_qwen3_and_gemma3_layers(arch):
    """bf16 on the bf16 kernel (``auto`` on any CPU for matrices this small): the lossless
    methods draft and keep ``ar``'s tokens on the fused layers (Gemma's window binding)."""
    engine = selfspec.from_pretrained_model(_model(arch, torch.bfloat16), tiny_tokenizer(),
                                            name=f"tiny-{arch}")
    assert engine.executor.fused_layers().kernel == "bf16"
    prompts = ["the cat sat on the mat; the cat sat on", "abcabcabcabc", "def f(x):\n    return"]
    ar = [engine.generate(p, max_new_tokens=32).token_ids for p in prompts]
    options = {"ngram": {}, "layerskip": {"exit_layer": 3, "draft_len": 4},
               "knapspec": {"reoptimize_every": 6, "tau": -1.0, "confidence": 0.01,
                            "plan_budget": 1e9}}
    for method, opts in options.items():
        drafted = 0
        for prompt, want in zip(prompts, ar, strict=True):
            got = engine.generate(prompt, method, max_new_tokens=32, **opts)
            assert got.token_ids == want, (method, prompt)
            drafted += got.stats.drafted
        # knapspec plans no skip on these random 4-layer models in 32 tokens (its drafting
        # on Gemma 3 is tests/models/test_families.py's, on the torch path): equality only.
        assert drafted > 0 or method == "knapspec", method


def test_layers_the_fused_kernels_do_not_compute_are_named():
    """What the kernel does not compute keeps a layer on the torch path, by name; Qwen3's
    and Gemma 3's layers are not among them."""
    from selfspec.executor.backends import fused_layer_reason

    ex = LayerExecutor(_model("gemma3_text", torch.bfloat16), name="tiny-gemma")
    w = ex.layer_weights[0]
    assert fused_layer_reason(w, "gelu_pytorch_tanh") is None
    assert fused_layer_reason(w, "gelu") == "activation gelu"
    assert "no RoPE" in fused_layer_reason(replace(w, rope=False), "silu")
    assert "residual multiplier" in fused_layer_reason(replace(w, residual_scale=0.5), "silu")
    assert fused_layer_reason(replace(w, attn_norm=None), "silu") == (
        "post-norms without pre-norms")
