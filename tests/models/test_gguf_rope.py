"""A Llama 3.x GGUF's RoPE scaling (llama.cpp's ``rope_freqs`` tensor, which transformers'
GGUF loader drops) survives the conversion (models/gguf_rope.py): a tiny Llama with llama3
``rope_parameters``, written as a GGUF with llama.cpp's tensor names and its frequency
factors as ``rope_freqs``, converts to a model with the same RoPE and the same greedy tokens
as the dense model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import selfspec
from selfspec.errors import UnsupportedArchitectureError
from selfspec.models import provision
from selfspec.models.gguf_rope import rope_parameters_from_freqs

VOCAB, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 128, 4, 2, 16, 2
THETA = 10000.0
LLAMA3 = {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 40, 41, 40, 41, 40], [1, 99, 3, 17, 64, 2 + 80]]


def _config(rope: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters=rope)


def _dense(rope: dict = LLAMA3):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(rope)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)  # peaked logits: a stable argmax
    return model


def _factors(model) -> np.ndarray:
    """llama.cpp's rope_freqs: plain RoPE frequency over the model's, per rotary pair."""
    plain = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM))
    return (plain / model.model.rotary_emb.inv_freq.double()).numpy()


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of q/k rows."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(
        x.shape)


def _write_gguf(model, path, rope_freqs: np.ndarray | None) -> None:
    """``model`` as an F32 llama GGUF with llama.cpp's names, metadata and a tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(4096)
    w.add_embedding_length(HEADS * HEAD_DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(32 + i) for i in range(95)]
    tokens += [f"<x{i}>" for i in range(VOCAB - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight",
                     _permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _convert(tmp_path, model, rope_freqs):
    path = tmp_path / "tiny-llama3.gguf"
    _write_gguf(model, path, rope_freqs)
    out = tmp_path / "converted"
    provision.convert_gguf(path, out, torch.float32, source="tiny", show_progress=False)
    return out


def test_rope_freqs_become_the_converted_models_llama3_scaling(tmp_path):
    dense = _dense()
    factors = _factors(dense)
    assert factors.max() == pytest.approx(8.0) and factors.min() == pytest.approx(1.0)
    engine = selfspec.load(str(_convert(tmp_path, dense, factors)), dtype="fp32",
                           show_progress=False)
    converted = engine.model
    assert converted.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(converted.model.rotary_emb.inv_freq,
                               dense.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    for ids in PROMPTS:
        with torch.no_grad():
            want = dense.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                  min_new_tokens=32)[0, len(ids):].tolist()
        assert engine.generate(ids, max_new_tokens=32).token_ids == want, ids


def test_a_gguf_without_rope_freqs_keeps_plain_rope(tmp_path):
    plain = _dense({"rope_type": "default", "rope_theta": THETA})
    out = _convert(tmp_path, plain, None)
    engine = selfspec.load(str(out), dtype="fp32", show_progress=False)
    assert engine.model.config.rope_parameters["rope_type"] == "default"


def test_factors_of_no_llama3_scaling_are_one_clear_error():
    config = _config({"rope_type": "default", "rope_theta": THETA})
    assert rope_parameters_from_freqs(config, np.ones(HEAD_DIM // 2)) is None
    odd = np.linspace(1.0, 3.0, HEAD_DIM // 2)[::-1].copy()  # decreasing: no Llama 3 shape
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        rope_parameters_from_freqs(config, odd)
