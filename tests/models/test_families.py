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
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

import selfspec
from selfspec.errors import UnsupportedArchitectureError
from selfspec.executor import LayerExecutor
from selfspec.methods.registry import METHODS
from selfspec.models import SUPPORTED_MODEL_TYPES
from selfspec.models.architecture import describe

from tiny import VOCAB, tiny_tokenizer

PROMPTS = ["the cat sat on the mat; the cat sat on", "abcabcabcabc", "def f(x):\n    return"]
NEW_TOKENS = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)

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
}
# Lossless with defaults or the options below; dssd, adaspeed-probe and swift need trained
# heads or a searched skip set, qspec a quantized draft kernel (covered on llama elsewhere).
NO_HEADS = {"adadecode": {"heads": "none", "gamma": 0.0}, "auto": {"drafters": "ngram"}}
SKIPPED = {"ar", "dssd", "adaspeed-probe", "swift", "qspec"}
LOSSLESS = [name for name, spec in METHODS.items()
            if spec.lossless_for(spec.options()) and name not in SKIPPED]


def test_every_supported_family_has_a_parity_test():
    assert sorted(CONFIGS) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """(directory, HF model, selfspec engine, ar tokens per prompt) of one family."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # peaked logits (stable argmax); norms away from 1 so each counts
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = selfspec.load(str(path), dtype="fp32", show_progress=False)
    ar = [engine.generate(p, method="ar", max_new_tokens=NEW_TOKENS).token_ids
          for p in PROMPTS]
    return path, reference, engine, ar


def test_ar_equals_transformers_generate(family):
    _, reference, engine, ar = family
    for prompt, ours in zip(PROMPTS, ar, strict=True):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert ours == out[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("method", LOSSLESS)
def test_lossless_methods_equal_ar(family, method):
    _, _, engine, ar = family
    options = NO_HEADS.get(method, {})
    for prompt, ref in zip(PROMPTS, ar, strict=True):
        got = engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS, **options)
        assert got.token_ids == ref, (method, prompt)


def test_a_ragged_batch_equals_single_prompts(family):
    _, _, engine, ar = family
    results = engine.generate(PROMPTS, method="ngram", max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == ar


def test_a_window_shorter_than_the_context_is_one_clear_error():
    config = MistralConfig(sliding_window=64, **COMMON)
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"sliding window 64 < max_position_embeddings 256 on layers "
                             r"\[0, 1, 2, 3\]: not supported yet"):
        describe(config)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedArchitectureError, match="sliding window 64"):
        LayerExecutor(model)
    assert describe(MistralConfig(sliding_window=None, **COMMON)).sliding_window == (None,) * 4


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
    assert "q/k norms" in arch["qwen3"].fused_reason()
