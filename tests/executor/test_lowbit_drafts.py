"""QSpec-style drafts on GGUF's 2- and 3-bit K-quant blocks (``draft_weights="q3_k"`` /
``"q2_k"``, executor/quant.py): the reference quantizers against gguf-py's dequantizer, the
draft copies, and lossless ``qspec`` on them (on the model's own weights and on a GGUF model)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from selfspec.api import SelfSpec
from selfspec.errors import InvalidArgumentError
from selfspec.executor import gguf_rows
from selfspec.executor.gguf_quantize import quantize_blocks
from selfspec.executor.quant import (
    AUTO_DRAFT_FORMATS,
    DRAFT_WEIGHT_FORMATS,
    check_draft_weights,
    draft_formats_on,
    quantize_linear,
)

from tiny import tiny_model, tiny_tokenizer, write_tiny_gguf

pytestmark = pytest.mark.skipif(not gguf_rows.gguf_rows_available(),
                                reason=gguf_rows.gguf_rows_unavailable_reason())

_T = gguf.GGMLQuantizationType
SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=4)
PROMPT = "abcabcabcabc the cat the cat the"
# Bits a weight (GGML_QUANT_SIZES: bytes per 256 inputs * 8 / 256).
BITS = {_T.Q2_K: 2.625, _T.Q3_K: 3.4375}


@pytest.mark.parametrize(("qtype", "levels"), [(_T.Q2_K, 4), (_T.Q3_K, 8)])
def test_k_quant_round_trip_through_gguf_py(qtype, levels):
    """gguf-py dequantizes our Q2_K/Q3_K blocks back to the weights, well within a uniform
    grid's step of that many levels over each 16-weight sub-block's range; and more levels, less
    error."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 1024)).astype(np.float32)
    blocks = quantize_blocks(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == torch.uint8 and blocks.shape == (32, 1024 // block * size)
    assert size * 8 / block == BITS[qtype]
    back = gguf.quants.dequantize(blocks.numpy(), qtype).reshape(w.shape)
    rmse = float(np.sqrt(((back - w) ** 2).mean()))
    sub = w.reshape(-1, 16)
    step = float((sub.max(axis=1) - sub.min(axis=1)).mean()) / (levels - 1)
    assert rmse < 0.5 * step, (rmse, step)
    # The least-squares refinement beats plain min/max (Q2_K: 0.33) and absmax (Q3_K: 0.156)
    # scales on unit Gaussian weights.
    assert rmse < {_T.Q2_K: 0.29, _T.Q3_K: 0.152}[qtype], rmse
    # Scaled weights come back scaled (the fp16 super-scales carry the magnitude).
    small = gguf.quants.dequantize(quantize_blocks(w * 1e-2, qtype).numpy(), qtype)
    assert np.sqrt(((small.reshape(w.shape) - w * 1e-2) ** 2).mean()) < 1e-2 * 0.5 * step


def test_q3_k_is_closer_than_q2_k_and_zeros_stay_zero():
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    err = {t: np.abs(gguf.quants.dequantize(quantize_blocks(w, t).numpy(), t).reshape(w.shape)
                     - w).mean() for t in (_T.Q2_K, _T.Q3_K, _T.Q4_K)}
    assert err[_T.Q4_K] < err[_T.Q3_K] < err[_T.Q2_K]
    for t in (_T.Q2_K, _T.Q3_K):
        zero = gguf.quants.dequantize(quantize_blocks(np.zeros((2, 256), np.float32), t).numpy(), t)
        assert np.all(zero == 0)


@pytest.mark.parametrize(("fmt", "qtype"), [("q3_k", _T.Q3_K), ("q2_k", _T.Q2_K)])
def test_quantize_linear_gives_a_gguf_matrix_of_the_format(fmt, qtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 512), torch.randn(64)
    copy = quantize_linear(weight, bias, fmt)
    assert isinstance(copy, gguf_rows.GgufMatrix) and copy.types == (qtype,)
    assert copy.decode_bytes == copy.nbytes == 64 * 512 * BITS[qtype] / 8 + 64 * 4
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    out = copy(x, bulk=True)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 64)
    want = x.float() @ copy.dequantize().T + bias
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), want.flatten(),
                                                 dim=0) > 0.99
    dense = x.float() @ weight.T + bias
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), dense.flatten(),
                                                 dim=0) > 0.8
    # Row-consistent: a row alone equals it within a block.
    assert torch.equal(copy(x[1:2]), out[1:2])


@pytest.mark.parametrize("fmt", ["q3_k", "q2_k"])
def test_a_size_not_a_multiple_of_256_is_refused_naming_format_and_size(fmt):
    with pytest.raises(InvalidArgumentError, match=rf"{fmt}.*multiple of 256.*input size 576"):
        quantize_linear(torch.randn(8, 576), None, fmt)
    engine = SelfSpec(tiny_model("llama", hidden_size=64, intermediate_size=128, num_layers=2),
                      tiny_tokenizer(), "tiny")
    with pytest.raises(InvalidArgumentError, match=rf"{fmt}.*multiple of 256.*input size 64"):
        engine.generate(PROMPT, method="qspec", max_new_tokens=4, draft_weights=fmt)


def test_the_formats_are_choices_but_not_autos_candidates():
    assert {"q3_k", "q2_k"} <= set(DRAFT_WEIGHT_FORMATS)
    assert not {"q3_k", "q2_k"} & set(AUTO_DRAFT_FORMATS)
    assert {"q3_k", "q2_k"} <= set(draft_formats_on("cpu"))
    assert check_draft_weights("q2_k") == "q2_k"
    with pytest.raises(InvalidArgumentError, match="CPU only"):
        check_draft_weights("q3_k", "meta")


@pytest.mark.parametrize("fmt", ["q3_k", "q2_k"])
def test_qspec_on_low_bit_blocks_keeps_ars_greedy_tokens(fmt):
    model = tiny_model("llama", **SHAPE)
    engine = SelfSpec(model, tiny_tokenizer(), "tiny-llama")
    want = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    got = engine.generate(PROMPT, method="qspec", max_new_tokens=24, draft_weights=fmt)
    assert got.token_ids == want.token_ids
    view = engine.executor.draft_view(fmt)
    assert view.draft_weights == fmt
    assert all(isinstance(m, gguf_rows.GgufMatrix) for w in view.layer_weights
               for m in w.matrices)


@pytest.mark.parametrize("fmt", ["q3_k", "q2_k"])
def test_qspec_on_low_bit_blocks_of_a_gguf_model_keeps_ars_greedy_tokens(tmp_path, fmt):
    """A model decoding on its GGUF file's 4-/6-bit blocks drafts on 3-/2-bit copies, which
    read fewer bytes, and stays exact."""
    model = tiny_model("llama", dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf")
    engine = SelfSpec(model, tiny_tokenizer(), "tiny-llama", decode_kernel="gguf", gguf=path)
    want = engine.generate(PROMPT, method="ar", max_new_tokens=24)
    got = engine.generate(PROMPT, method="qspec", max_new_tokens=24, draft_weights=fmt)
    assert got.token_ids == want.token_ids
    ex = engine.executor
    view = ex.draft_view(fmt)
    own = sum(m.decode_bytes for w in ex.layer_weights for m in w.matrices)
    draft = sum(m.decode_bytes for w in view.layer_weights for m in w.matrices)
    assert draft < own
    assert view.fused_layers() is not None


def test_a_low_bit_views_latency_key_names_the_format_and_the_gguf_kernel(monkeypatch):
    from selfspec.executor import LayerExecutor, cost_model, native

    ex = LayerExecutor(tiny_model("llama", seed=4, **SHAPE))
    keys = {fmt: cost_model.machine_key(ex.draft_view(fmt)) for fmt in ("q3_k", "q2_k")}
    for fmt, key in keys.items():
        assert f"-draft{fmt}-{native.source_digest(gguf_rows.SOURCE)}-" in key
    assert len({*keys.values(), cost_model.machine_key(ex)}) == 3
    monkeypatch.setattr(native, "source_digest", lambda name: "0" * 8)
    assert cost_model.machine_key(ex.draft_view("q3_k")) != keys["q3_k"]
