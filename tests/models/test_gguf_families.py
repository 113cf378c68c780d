"""``--dtype gguf`` on the new families' GGUF blocks: tiny random Qwen3 (per-head q/k norms,
unpermuted q/k rows as llama.cpp's Qwen3 converter writes them), GPT-NeoX (one ``attn_qkv``),
Gemma 3 (tied ``token_embd``, the model's own norms) and Phi-3 (``attn_qkv``, ``ffn_up`` =
[gate; up]) models decode on their files' blocks close to the dense model, and lossless
methods keep the gguf model's ``ar`` tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    Phi3Config,
    Qwen3Config,
)

from selfspec.api import SelfSpec
from selfspec.executor import gguf_rows

from tiny import VOCAB, tiny_tokenizer, write_tiny_gguf

PROMPT = "abcabcabcabc the cat the cat the"

pytestmark = pytest.mark.skipif(not gguf_rows.gguf_rows_available(),
                                reason=gguf_rows.gguf_rows_unavailable_reason())


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    torch.manual_seed(0)
    # K-quants take inputs in blocks of 256.
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=256, eos_token_id=VOCAB - 1,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    path = write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "qwen3.gguf")
    return SelfSpec(model, tiny_tokenizer(), "tiny-qwen3", decode_kernel="gguf", gguf=path)


def test_qwen3_decodes_on_its_gguf_blocks(qwen3):
    ex = qwen3.executor
    assert ex.formats.rows == "gguf"
    for lin in [m for w in ex.layer_weights for m in w.matrices]:
        assert isinstance(lin.rows_weight, gguf_rows.GgufMatrix)
        assert torch.equal(lin.rows_weight.dequantize().to(torch.bfloat16), lin.weight)


@pytest.mark.parametrize("method", ["ngram", "layerskip", "knapspec", "auto"])
def test_lossless_methods_keep_the_qwen3_gguf_models_tokens(qwen3, method):
    prompt = "abcabcabcabc the cat the cat the"
    want = qwen3.generate(prompt, method="ar", max_new_tokens=24)
    got = qwen3.generate(prompt, method=method, max_new_tokens=24)
    assert got.token_ids == want.token_ids


# ---------------------------------------------------------------- GPT-NeoX / Pythia
def _write_neox_gguf(model, path):
    """``model``'s matrices as a ``gptneox`` GGUF with llama.cpp's tensor names and layout
    (``attn_qkv`` in q, k, v row blocks, as its ``GPTNeoXModel.modify_tensors`` reorders
    them; a plain MLP), the model's weights set to what the blocks stand for (as
    ``tiny.write_tiny_gguf`` does)."""
    import gguf
    import numpy as np

    from selfspec.executor.gguf_quantize import quantize_blocks
    from selfspec.models.layouts import interleave_blocks, reorder_interleaved

    T = gguf.GGMLQuantizationType
    heads = model.config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "gptneox")
    writer.add_block_count(model.config.num_hidden_layers)

    def put(name, weight, kind, bias=None):
        raw = np.asarray(quantize_blocks(weight.detach().float(), kind))
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(raw), raw_dtype=kind)
        if bias is not None:
            writer.add_tensor(f"{name}.bias", np.ascontiguousarray(bias.detach().float().numpy()))
        deq = np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32)
        return torch.from_numpy(deq.reshape(weight.shape)).to(weight.dtype)

    with torch.no_grad():
        for i, layer in enumerate(model.gpt_neox.layers):
            a, m = layer.attention, layer.mlp
            qkv = a.query_key_value
            blocks = put(f"blk.{i}.attn_qkv", reorder_interleaved(qkv.weight, heads), T.Q4_K,
                         reorder_interleaved(qkv.bias, heads))
            qkv.weight.copy_(interleave_blocks(blocks, heads))  # the checkpoint's rows
            for name, lin, kind in ((f"blk.{i}.attn_output", a.dense, T.Q4_1),
                                    (f"blk.{i}.ffn_up", m.dense_h_to_4h, T.Q5_K),
                                    (f"blk.{i}.ffn_down", m.dense_4h_to_h, T.Q6_K)):
                lin.weight.copy_(put(name, lin.weight, kind, lin.bias))
        model.lm_head.weight.copy_(put("output", model.lm_head.weight, T.Q8_0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=3, num_attention_heads=4, rotary_pct=0.25,
                           max_position_embeddings=256, eos_token_id=VOCAB - 1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
            else:
                p.uniform_(-0.5, 0.5) if name.endswith("bias") else p.mul_(4.0)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    path = _write_neox_gguf(model, tmp_path_factory.mktemp("gguf") / "gptneox.gguf")
    dense = SelfSpec(model, tiny_tokenizer(), "tiny-neox-dense")
    prompt = "abcabcabcabc the cat the cat the"
    want = dense.generate(prompt, method="ar", max_new_tokens=24).token_ids  # before gguf
    return SelfSpec(model, tiny_tokenizer(), "tiny-neox", decode_kernel="gguf", gguf=path), want


def test_gpt_neox_decodes_on_its_gguf_blocks(neox):
    engine, dense = neox
    ex = engine.executor
    assert ex.formats.rows == "gguf"
    for lin in [m for w in ex.layer_weights for m in w.matrices]:
        assert isinstance(lin.rows_weight, gguf_rows.GgufMatrix)
        assert torch.equal(lin.rows_weight.dequantize().to(torch.bfloat16), lin.weight)
    got = engine.generate("abcabcabcabc the cat the cat the", method="ar", max_new_tokens=24)
    # the dense model's tokens up to the kernels' rounding: most of them, from the start
    same = next((i for i, (a, b) in enumerate(zip(got.token_ids, dense)) if a != b), 24)
    assert same >= 8, (got.token_ids, dense)


@pytest.mark.parametrize("method", ["ngram", "layerskip", "knapspec", "auto"])
def test_lossless_methods_keep_the_gpt_neox_gguf_models_tokens(neox, method):
    engine, _ = neox
    prompt = "abcabcabcabc the cat the cat the"
    want = engine.generate(prompt, method="ar", max_new_tokens=24)
    got = engine.generate(prompt, method=method, max_new_tokens=24)
    assert got.token_ids == want.token_ids


# ---------------------------------------------------------------- Gemma 3
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (sliding and full layers, per-head q/k norms, tied embeddings) written
    as a ``gemma3`` GGUF: llama.cpp's tensor names, q/k rows unpermuted, ``lm_head`` as
    ``token_embd`` (its norms, stored as ``1 + w`` by the converter, stay the model's)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=256, eos_token_id=VOCAB - 1,
                              bos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-0.5, 0.5) if "norm" in name else p.mul_(4.0)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    path = write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "gemma3.gguf",
                           arch="gemma3", head="token_embd")
    dense = SelfSpec(model, tiny_tokenizer(), "tiny-gemma3-dense")
    want = dense.generate(PROMPT, method="ar", max_new_tokens=24).token_ids
    return SelfSpec(model, tiny_tokenizer(), "tiny-gemma3", decode_kernel="gguf",
                    gguf=path), want


def test_gemma3_decodes_on_its_gguf_blocks(gemma3):
    engine, dense = gemma3
    ex = engine.executor
    assert ex.formats.rows == "gguf" and ex.gguf_weights.arch == "gemma3"
    for lin in [m for w in ex.layer_weights for m in w.matrices]:
        assert isinstance(lin.rows_weight, gguf_rows.GgufMatrix)
        assert torch.equal(lin.rows_weight.dequantize().to(torch.bfloat16), lin.weight)
    got = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    same = next((i for i, (a, b) in enumerate(zip(got.token_ids, dense)) if a != b), 24)
    assert same >= 8, (got.token_ids, dense)


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_lossless_methods_keep_the_gemma3_gguf_models_tokens(gemma3, method):
    engine, _ = gemma3
    want = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    got = engine.generate(PROMPT, method=method, max_new_tokens=24)
    assert got.token_ids == want.token_ids


# ---------------------------------------------------------------- Phi-3
def _write_phi3_gguf(model, path, up_first=False):
    """``model``'s matrices as a ``phi3`` GGUF with llama.cpp's names: HF's fused
    ``qkv_proj`` as ``attn_qkv`` and ``gate_up_proj`` as ``ffn_up`` (llama.cpp's converter
    keeps their rows), the model's weights set to what the blocks stand for (``up_first``: a
    wrong file, ``ffn_up`` as [up; gate]). Q8_0 blocks: on
    this random model Q4_K-family activations' rounding moves the greedy argmax within a few
    tokens (the mapping itself is checked exactly, block by block)."""
    import gguf
    import numpy as np

    from selfspec.executor.gguf_quantize import quantize_blocks

    T = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(model.config.num_hidden_layers)

    def put(name, lin, kind, swap=False):
        w = lin.weight.detach().float()
        raw = np.asarray(quantize_blocks(w, kind))
        deq = np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32)
        lin.weight.copy_(torch.from_numpy(deq.reshape(lin.weight.shape)))
        if swap:  # a wrong file: [up; gate]
            raw = np.concatenate(np.split(raw, 2)[::-1])
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(raw), raw_dtype=kind)

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            put(f"blk.{i}.attn_qkv", a.qkv_proj, T.Q8_0)
            put(f"blk.{i}.attn_output", a.o_proj, T.Q8_0)
            put(f"blk.{i}.ffn_up", m.gate_up_proj, T.Q8_0, up_first)
            put(f"blk.{i}.ffn_down", m.down_proj, T.Q8_0)
        put("output", model.lm_head, T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_phi3():
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, eos_token_id=VOCAB - 1, bos_token_id=0,
                        pad_token_id=0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(4.0)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    model = _tiny_phi3()
    path = _write_phi3_gguf(model, tmp_path_factory.mktemp("gguf") / "phi3.gguf")
    dense = SelfSpec(model, tiny_tokenizer(), "tiny-phi3-dense")
    want = dense.generate(PROMPT, method="ar", max_new_tokens=24).token_ids
    return SelfSpec(model, tiny_tokenizer(), "tiny-phi3", decode_kernel="gguf", gguf=path), want


def test_phi3_decodes_on_its_gguf_blocks(phi3):
    engine, dense = phi3
    ex = engine.executor
    assert ex.formats.rows == "gguf" and ex.gguf_weights.arch == "phi3"
    for lin in [m for w in ex.layer_weights for m in w.matrices]:
        assert isinstance(lin.rows_weight, gguf_rows.GgufMatrix)
        assert torch.equal(lin.rows_weight.dequantize().to(torch.bfloat16), lin.weight)
    got = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    same = next((i for i, (a, b) in enumerate(zip(got.token_ids, dense)) if a != b), 24)
    assert same >= 8, (got.token_ids, dense)


def test_lossless_ngram_keeps_the_phi3_gguf_models_tokens(phi3):
    engine, _ = phi3
    want = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    got = engine.generate(PROMPT, method="ngram", max_new_tokens=24)
    assert got.token_ids == want.token_ids


def test_a_phi3_gguf_with_up_before_gate_is_refused(tmp_path):
    """The check against the model catches ``ffn_up``'s halves read in the wrong order."""
    from selfspec.errors import UnsupportedArchitectureError

    model = _tiny_phi3()
    path = _write_phi3_gguf(model, tmp_path / "swapped.gguf", up_first=True)
    with pytest.raises(UnsupportedArchitectureError, match=r"ffn_up.*gate_proj"):
        SelfSpec(model, tiny_tokenizer(), "tiny-phi3", decode_kernel="gguf", gguf=path)
