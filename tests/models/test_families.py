"""Every supported family (``SUPPORTED_MODEL_TYPES``) on a tiny random model built from
transformers' own config class and saved with ``save_pretrained`` (fp32): selfspec's greedy
``ar`` equals transformers' ``generate``, and every lossless method that runs without trained
assets equals ``ar``, single prompts and a ragged batch. A supported ``model_type`` without a
config here fails :func:`test_every_supported_family_has_a_parity_test`."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

import selfspec
from selfspec.errors import UnsupportedArchitectureError
from selfspec.methods.registry import METHODS
from selfspec.models import SUPPORTED_MODEL_TYPES
from selfspec.models.architecture import describe

from tiny import VOCAB, steady_latency, tiny_tokenizer

PROMPTS = ["the cat sat on the mat; the cat sat on", "abcabcabcabc", "def f(x):\n    return"]
NEW_TOKENS = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
#: GPT-NeoX has no grouped-query attention (no num_key_value_heads).
NEOX_COMMON = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}

WINDOW = 8
#: Gemma 3 text: sliding layers (local RoPE base, window) and full ones, q/k head norms,
#: query_pre_attn_scalar other than head_dim, GELU-tanh, four (1 + w) norms a layer.
GEMMA = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention"] * 2, **COMMON)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=14)

#: One tiny config per family, each exercising the family's own features.
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(use_sliding_window=False, **COMMON),
    "qwen3": lambda: Qwen3Config(head_dim=16, **COMMON),
    # A window as long as the context never binds: it runs (a shorter one is refused below).
    "mistral": lambda: MistralConfig(sliding_window=256, **COMMON),
    "granite": lambda: GraniteConfig(embedding_multiplier=6.0, residual_multiplier=0.5,
                                     attention_multiplier=0.1, logits_scaling=4.0, **COMMON),
    "olmo2": lambda: Olmo2Config(**COMMON),
    "smollm3": lambda: SmolLM3Config(no_rope_layers=[1, 0, 1, 0], **COMMON),
    # Checkpoint-fused qkv_proj / gate_up_proj; Phi-4-mini's RoPE on 3/4 of each head.
    "phi3": lambda: Phi3Config(**COMMON),
    "phi3-partial-rotary": lambda: Phi3Config(partial_rotary_factor=0.75, **COMMON),
    # Windows shorter than every prompt (WINDOW < 12 tokens): they bind (the torch path).
    "mistral-window": lambda: MistralConfig(sliding_window=WINDOW, **COMMON),
    "qwen2-window": lambda: Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=2, **COMMON),
    "gemma3_text": lambda: Gemma3TextConfig(**GEMMA),
    # Gemma3ForConditionalGeneration: its language model runs, on text.
    "gemma3": lambda: Gemma3Config(text_config=GEMMA, vision_config=TINY_VISION,
                                   image_token_index=VOCAB - 2, boi_token_index=VOCAB - 3,
                                   eoi_token_index=VOCAB - 4, mm_tokens_per_image=4,
                                   eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0,
                                   tie_word_embeddings=False),
}
#: Families whose lossless methods must also have drafted (a binding window, Gemma 3), and
#: the options that make knapspec plan from the first steps (with its defaults it drafted
#: nothing in 32 tokens).
DRAFTING = {"qwen2-window", "gemma3_text"}
DRAFT_OPTIONS = {"knapspec": {"reoptimize_every": 6, "tau": -1.0, "confidence": 0.01,
                              "plan_budget": 1e9}}
# Lossless with defaults or the options below; dssd, adaspeed-probe and swift need trained
# heads or a searched skip set, qspec a quantized draft kernel, clasp is knapspec's plan
# search re-run (all covered on llama and qwen2 in tests/decoding).
NO_HEADS = {"adadecode": {"heads": "none", "gamma": 0.0}, "auto": {"drafters": "ngram"}}
SKIPPED = {"ar", "dssd", "adaspeed-probe", "swift", "qspec", "clasp"}
LOSSLESS = [name for name, spec in METHODS.items()
            if spec.lossless_for(spec.options()) and name not in SKIPPED]
#: Families whose methods tests/decoding already runs (test_batch, test_processing, ...);
#: plain phi3 is Llama's layer once split, and phi3-partial-rotary runs its split with them.
COVERED = {"llama", "qwen2", "phi3",
           # gemma3 runs gemma3_text's layers; mistral-window the windowed torch path of
           # qwen2-window (whose full and windowed layers mix): ar parity covers each.
           "gemma3", "mistral-window"}
NEW = sorted(set(CONFIGS) - COVERED)


def test_every_supported_family_has_a_parity_test():
    makers = [*CONFIGS.values(), *NEOX_CONFIGS.values()]  # GPT-NeoX: its tests at the end
    assert sorted({make().model_type for make in makers}) == sorted(SUPPORTED_MODEL_TYPES)


def _random_model(model_type: str):
    """A random model of ``model_type``: peaked logits (a stable argmax), norms away from 1
    (so that a norm left out changes the output)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[model_type]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
        if model_type == "gemma3_text":
            # The last layer's sub-layers damped (its post-norms' 1 + w = 0.3): an early exit
            # agrees often but not always, so DEL and knapspec draft, accept and reject.
            last = model.model.layers[-1]
            last.post_attention_layernorm.weight.fill_(-0.7)
            last.post_feedforward_layernorm.weight.fill_(-0.7)
    return model.eval().requires_grad_(False)


def _family(model_type: str, tmp_path_factory):
    """(HF model, selfspec engine, ar tokens per prompt) of one family, saved with
    save_pretrained (fp32) and loaded by both from that directory."""
    path = tmp_path_factory.mktemp(model_type)
    _random_model(model_type).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = steady_latency(selfspec.load(str(path), dtype="fp32", show_progress=False))
    ar = [engine.generate(p, method="ar", max_new_tokens=NEW_TOKENS).token_ids
          for p in PROMPTS]
    return reference, engine, ar


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def any_family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=NEW)
def family(request, tmp_path_factory):
    return (*_family(request.param, tmp_path_factory), request.param)


def test_ar_equals_transformers_generate(any_family):
    reference, engine, ar = any_family
    for prompt, ours in zip(PROMPTS, ar, strict=True):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert ours == out[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("method", LOSSLESS)
def test_lossless_methods_equal_ar(family, method):
    _, engine, ar, name = family
    options = NO_HEADS.get(method, {})
    if name in DRAFTING:
        options = {**options, **DRAFT_OPTIONS.get(method, {})}
    drafted = 0
    for prompt, ref in zip(PROMPTS, ar, strict=True):
        got = engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS, **options)
        assert got.token_ids == ref, (method, prompt)
        drafted += got.stats.drafted
    if name in DRAFTING:
        assert drafted > 0, (method, "drafted nothing: the parity says nothing")


def test_a_ragged_batch_equals_single_prompts(family):
    _, engine, ar, _ = family
    results = engine.generate(PROMPTS, method="ngram", max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == ar


def test_a_window_shorter_than_the_context_binds_on_its_layers():
    """A window shorter than the context is described per layer as transformers' masks
    apply it (Mistral and Phi-3: every layer; Qwen2: from max_window_layers; layer_types)
    and the fused sub-layer kernels apply it per layer as the torch path does; a longer one
    never binds."""
    assert describe(MistralConfig(sliding_window=64, **COMMON)).sliding_window == (64,) * 4
    assert describe(Phi3Config(sliding_window=64, **COMMON)).sliding_window == (64,) * 4
    assert describe(MistralConfig(sliding_window=None, **COMMON)).sliding_window == (None,) * 4
    assert describe(MistralConfig(sliding_window=256, **COMMON)).sliding_window == (None,) * 4
    qwen2 = describe(CONFIGS["qwen2-window"]())
    assert qwen2.sliding_window == (None, None, WINDOW, WINDOW)
    assert qwen2.fused_reason() is None
    gemma = describe(CONFIGS["gemma3"]())
    assert gemma.sliding_window == (WINDOW, None, WINDOW, None)
    assert gemma.rope_kinds == ("sliding_attention", "full_attention") * 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_is_refused_with_what_to_use(model_type):
    config = type("Config", (), {"model_type": model_type})()
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts.*use"):
        describe(config)


def test_the_description_names_each_familys_features():
    arch = {name: describe(make()) for name, make in CONFIGS.items()}
    assert arch["llama"].plain and arch["qwen2"].plain and arch["mistral"].plain
    assert arch["qwen3"].qk_norm == "head" and not arch["qwen3"].plain
    assert arch["olmo2"].qk_norm == "projection" and arch["olmo2"].norm_placement == "post"
    assert arch["smollm3"].rope_layers == (True, False, True, False)
    granite = arch["granite"]
    assert (granite.embedding_multiplier, granite.residual_multiplier,
            granite.attention_scale, granite.logits_divisor) == (6.0, 0.5, 0.1, 4.0)
    assert arch["llama"].fused_reason() is None
    # The fused kernels compute Qwen3's and Gemma 3's layers; what is left is named.
    assert arch["qwen3"].fused_reason() is None and arch["gemma3_text"].fused_reason() is None
    assert "q/k norms over each projection" in arch["olmo2"].fused_reason()
    assert "post-norms without pre-norms" in arch["olmo2"].fused_reason()
    assert "layers without RoPE" in arch["smollm3"].fused_reason()
    assert "a residual multiplier" in arch["granite"].fused_reason()
    assert arch["phi3"].checkpoint_fused and arch["phi3"].plain
    assert arch["phi3-partial-rotary"].rotary_fraction == 0.75
    assert "partial rotary" in arch["phi3-partial-rotary"].fused_reason()
    gemma = arch["gemma3_text"]
    assert (gemma.norm_kind, gemma.norm_placement, gemma.qk_norm) == ("rms_offset", "both",
                                                                       "head")
    assert (gemma.embedding_scale, gemma.attention_scale) == (8.0, 24 ** -0.5)
    assert gemma.activation == "gelu_pytorch_tanh" and gemma.final_softcap is None
    gelu = describe(Gemma3TextConfig(hidden_activation="gelu", **GEMMA))
    assert "activation gelu" in gelu.fused_reason()


def test_gemma_attention_softcap_is_one_clear_error():
    with pytest.raises(UnsupportedArchitectureError, match="attn_logit_softcapping"):
        describe(Gemma3TextConfig(attn_logit_softcapping=50.0, **GEMMA))


def test_longrope_is_one_clear_error():
    config = Phi3Config(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                      "long_factor": [2.0] * 8,
                                      "original_max_position_embeddings": 128}, **COMMON)
    with pytest.raises(UnsupportedArchitectureError, match="RoPE scaling 'longrope'"):
        describe(config)


#: Families whose bf16 layers the fused sub-layer kernels compute (Architecture.fused_reason).
FUSED = {"mistral", "phi3", "qwen3", "gemma3_text"}


# qwen2-window left out: gemma3_text's sliding layers run the same windowed bf16 path.
@pytest.mark.parametrize("model_type", [*sorted(set(NEW) - {"qwen2-window"}), "phi3"])
def test_bf16_lossless_methods_equal_bf16_ar(model_type):
    """In bf16 every family decodes either on the fused sub-layer kernels (Llama's layer and
    Qwen3's and Gemma 3's additions: :data:`FUSED`) or on the torch path (the rest:
    Architecture.fused_reason); both make verification blocks bit-consistent with one-token
    decoding, so drafts keep ar's tokens exactly."""
    model = _random_model(model_type).to(torch.bfloat16)
    engine = selfspec.from_pretrained_model(model, tiny_tokenizer(), f"tiny-{model_type}")
    arch = engine.executor.architecture
    assert (arch.fused_reason() is None) == (model_type in FUSED)
    # Small matrices go to the bf16 kernel on every CPU (auto): the fused layers take them.
    assert (engine.executor.fused_layers() is None) == (arch.fused_reason() is not None)
    for prompt in PROMPTS:
        ar = engine.generate(prompt, method="ar", max_new_tokens=NEW_TOKENS).token_ids
        for method in ("ngram", "layerskip", "knapspec", "auto"):
            got = engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS,
                                  **NO_HEADS.get(method, {}))
            assert got.token_ids == ar, (method, prompt)


def test_info_says_which_path_each_family_takes():
    from selfspec.models.architecture import family_paths

    line = family_paths()
    assert all(name in line for name in SUPPORTED_MODEL_TYPES)
    fused, torch_path = line.split("; torch path: ")
    assert "qwen3" in fused and "gemma3_text" in fused and "qwen3" not in torch_path
    assert ("olmo2 (q/k norms over each projection, post-norms without pre-norms)"
            in torch_path)
    assert "phi3's qkv_proj / gate_up_proj split at load" in line


# ---------------------------------------------------------------- GPT-NeoX / Pythia
# Its own tiny model (shared by the module): random LayerNorm weights and biases and linear
# biases (zero at init, so that leaving one out would go unseen), Pythia's rotary_pct 0.25.
NEOX_CONFIGS = {
    "gpt_neox": lambda: GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.25,
                                      **NEOX_COMMON),
    "gpt_neox-sequential": lambda: GPTNeoXConfig(use_parallel_residual=False, rotary_pct=0.25,
                                                 **NEOX_COMMON),
}


def _random_neox(name: str, damp: float = 1.0):
    """A random GPT-NeoX model (see :data:`NEOX_CONFIGS`); ``damp`` scales the last layer's
    output projections (``tiny.damp_last_layer`` for GPT-NeoX's names) so early exits agree
    with the full model often but not always, and lossless methods draft."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(NEOX_CONFIGS[name]())
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5) if pname.endswith("weight") else p.uniform_(-0.5, 0.5)
            elif pname.endswith("bias"):
                p.uniform_(-0.5, 0.5)
            else:
                p.mul_(4.0)
        last = model.gpt_neox.layers[-1]
        last.attention.dense.weight.mul_(damp)
        last.mlp.dense_4h_to_h.weight.mul_(damp)
    return model.eval().requires_grad_(False)


def _hf_tokens(reference, engine, prompt: str) -> list[int]:
    ids = torch.tensor([engine.encode(prompt)])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """(HF reference, selfspec engine, ar tokens) of the parallel-residual model (Pythia's
    layer), saved with save_pretrained (fp32) and loaded by both."""
    path = tmp_path_factory.mktemp("gpt_neox")
    _random_neox("gpt_neox", damp=0.3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = steady_latency(selfspec.load(str(path), dtype="fp32", show_progress=False))
    ar = [engine.generate(p, method="ar", max_new_tokens=NEW_TOKENS).token_ids
          for p in PROMPTS]
    return reference, engine, ar


def test_gpt_neox_ar_equals_transformers_generate(neox):
    reference, engine, ar = neox
    assert [_hf_tokens(reference, engine, p) for p in PROMPTS] == ar
    assert len({t for row in ar for t in row}) > 4  # not one token repeated


def test_gpt_neox_sequential_residual_equals_transformers_generate():
    model = _random_neox("gpt_neox-sequential")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    # the engine's InterleavedQKV serves transformers' modules too: both read one model
    engine = selfspec.from_pretrained_model(model, tiny_tokenizer(), "tiny-neox-seq")
    assert not engine.executor.architecture.parallel_residual
    for prompt in PROMPTS:
        ours = engine.generate(prompt, method="ar", max_new_tokens=NEW_TOKENS).token_ids
        assert ours == _hf_tokens(model, engine, prompt), prompt
    # InterleavedQKV saves the checkpoint's per-head rows: save_pretrained writes the same
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


#: Options that make each method draft on the damped model: AdaDecode's exit at layer 3 (at
#: layer 2, with gamma 0, every draft was rejected), KnapSpec's as tests/decoding's (it drafts
#: but on 4 layers no plan's draft was accepted; its acceptances are tested there).
NEOX_OPTIONS = {**NO_HEADS, "adadecode": {"heads": "none", "gamma": 0.0, "layers": "3"},
                "knapspec": {"confidence": 0.01, "plan_budget": 1e9, "tau": -1.0,
                             "reoptimize_every": 6}}


def test_gpt_neox_lossless_methods_equal_ar_and_draft(neox):
    _, engine, ar = neox
    for method in LOSSLESS:
        drafted = accepted = 0
        for prompt, ref in zip(PROMPTS, ar, strict=True):
            got = engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS,
                                  **NEOX_OPTIONS.get(method, {}))
            assert got.token_ids == ref, (method, prompt)
            drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        assert drafted > 0, method
        assert accepted > 0 or method == "knapspec", (method, drafted)


def test_gpt_neox_is_described_by_its_features():
    arch = describe(NEOX_CONFIGS["gpt_neox"]())
    assert (arch.norm_kind, arch.gated_mlp, arch.qkv_interleaved, arch.parallel_residual,
            arch.rotary_fraction, arch.activation) == ("layer", False, True, True, 0.25, "gelu")
    reason = arch.fused_reason()
    assert all(f in reason for f in ("norm kind layer", "partial rotary", "non-gated",
                                     "parallel", "activation gelu"))
    assert not describe(NEOX_CONFIGS["gpt_neox-sequential"]()).parallel_residual
    with pytest.raises(UnsupportedArchitectureError, match="partial rotary over 3 of 16"):
        describe(GPTNeoXConfig(rotary_pct=3 / 16, **NEOX_COMMON))
    from selfspec.models.architecture import family_paths

    assert "gpt_neox (LayerNorm, plain GELU MLP)" in family_paths()


def test_gpt_neox_ragged_batch_and_static_forward_equal_single_runs(neox):
    """The parallel residual on the other two loops: a ragged batch (run_rows) equals single
    prompts, and the CUDA graphs' static forward (run eagerly here) equals the executor's."""
    from selfspec.executor.cuda_graphs import CudaGraphRunner, static_forward
    from selfspec.executor.sync import position_block

    _, engine, ar = neox
    results = engine.generate(PROMPTS, method="ngram", max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == ar
    ex = engine.executor
    runner = CudaGraphRunner(ex, capacity=64, max_tokens=4, replay="eager")
    ids = torch.tensor([engine.encode(PROMPTS[0])[:12]])
    with torch.inference_mode():
        cache = ex.new_cache(capacity=64)
        ex.forward(ids[:, :9], position_block(0, 9, "cpu"), cache)
        want = ex.forward(ids[:, 9:], position_block(9, 3, "cpu"), cache)
        ex.forward(ids[:, :9], position_block(0, 9, "cpu"), runner.cache)
        keys, values = runner.cache.storage()
        got = static_forward(ex, ids[:, 9:], position_block(9, 3, "cpu"), keys, values,
                             torch.arange(64), ex.rope.cos, ex.rope.sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
