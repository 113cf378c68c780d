"""``--dtype gguf`` on the new families' GGUF blocks: a tiny random Qwen3 (per-head q/k norms,
unpermuted q/k rows as llama.cpp's Qwen3 converter writes them) decodes on the file's blocks
close to the dense model, and lossless methods keep the gguf model's ``ar`` tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from selfspec.api import SelfSpec
from selfspec.executor import gguf_rows

from tiny import VOCAB, tiny_tokenizer, write_tiny_gguf

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
