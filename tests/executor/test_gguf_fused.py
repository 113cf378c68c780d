"""The gguf kernel's fused sub-layers (``selfspec_gguf_attention`` / ``_mlp``: GgufProduct in
kernels/gguf_rows.cpp, both ISA builds): a GGUF model takes them, a verification block equals
one-token decoding bit for bit (so lossless methods keep ``ar``'s tokens), and they stay close
to the unfused gguf path (which rounds to bf16 between operators)."""

from __future__ import annotations

import pytest
import torch

from selfspec.api import SelfSpec
from selfspec.executor import fused_layers, gguf_rows

from tiny import (
    assert_speculated,
    damp_last_layer,
    steady_latency,
    tiny_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

pytestmark = pytest.mark.skipif(not gguf_rows.gguf_rows_available(),
                                reason=gguf_rows.gguf_rows_unavailable_reason())

SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=4)
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not gguf_rows.gguf_rows_available(isa), reason=gguf_rows.gguf_rows_unavailable_reason(isa)))
    for isa in gguf_rows.ISAS]


def _engine(tmp_path, arch="llama", isa="auto", monkeypatch=None, dtype=torch.bfloat16,
            seed=0, damp=None):
    model = tiny_model(arch, seed=seed, dtype=dtype, **SHAPE)
    if damp is not None:
        damp_last_layer(model, damp)
    path = write_tiny_gguf(model, tmp_path / f"{arch}.gguf")
    if isa != "auto":  # every GgufMatrix of the model on that build
        monkeypatch.setattr(gguf_rows, "chosen_isa", lambda: isa)
    engine = SelfSpec(model, tiny_tokenizer(), f"tiny-{arch}", decode_kernel="gguf", gguf=path)
    fused = engine.executor.fused_layers()
    assert fused is not None and fused.kernel == "gguf"
    assert {m.isa for w in engine.executor.layer_weights
            for m in (x.rows_weight for x in w.matrices)} == {gguf_rows._resolve(isa)}
    return engine


def _prefilled(ex, prompt):
    cache = ex.new_cache(capacity=8)  # small: the fused path must grow it
    ex.forward(prompt, torch.arange(prompt.shape[1]).unsqueeze(0), cache)
    return cache


@pytest.mark.parametrize(("dtype", "tolerance"), [
    # fp32: every product quantizes its inputs, so the paths differ only where float rounding
    # (the fused path's own norms and RoPE, equal to torch's within ulps) moves an input across
    # an int8 rounding boundary. One such input moves its whole row by ~0.5-1% of the largest
    # output, and the flips add up over four layers, so the bound is on the relative norm of
    # the difference (a few flips stay far below it; a wrong product moves it to ~1).
    (torch.float32, 1e-2),
    # bf16: the unfused path rounds to bf16 after every operator (its products quantize bf16
    # inputs), the fused one keeps fp32 in between.
    (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_layers_stay_close_to_the_unfused_gguf_path(tmp_path, monkeypatch, arch, isa, dtype,
                                                          tolerance):
    ex = _engine(tmp_path, arch, isa, monkeypatch, dtype).executor
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (1, 9), generator=gen)
    block = torch.randint(0, 250, (1, 3), generator=gen)
    pos = torch.arange(9, 12).unsqueeze(0)
    fused_cache = _prefilled(ex, prompt)
    fused = ex.forward(block, pos, fused_cache)
    monkeypatch.setattr(ex, "fused_layers", lambda: None)  # torch operators, same products
    ref_cache = _prefilled(ex, prompt)
    ref = ex.forward(block, pos, ref_cache)
    assert _relative_error(fused, ref) < tolerance
    assert fused_cache.lengths() == ref_cache.lengths() == [12] * ex.num_layers
    for layer in range(ex.num_layers):
        for got, want in zip(fused_cache.get(layer), ref_cache.get(layer)):
            assert _relative_error(got, want) < tolerance


def _relative_error(got, want):
    """||got - want|| / ||want|| over the whole tensor (Frobenius norms, fp32)."""
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verification_block_equals_one_token_decoding_bit_for_bit(tmp_path, monkeypatch, arch,
                                                                     isa, dtype):
    ex = _engine(tmp_path, arch, isa, monkeypatch, dtype).executor
    prompt = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[5, 17, 99, 3, 42, 8, 11, 64, 200, 7]])  # more than a tile of 8
    cache = _prefilled(ex, prompt)
    block = ex.forward(tokens, torch.arange(7, 17).unsqueeze(0), cache)[0]
    cache = _prefilled(ex, prompt)
    alone = torch.cat([ex.forward(tokens[:, t:t + 1], torch.tensor([[7 + t]]), cache)[0]
                       for t in range(10)])
    assert torch.equal(block, alone)


# knapspec plans from the first steps (with its defaults it drafts nothing in 32 tokens here)
KNAPSPEC_NOW = {"reoptimize_every": 6, "tau": -1.0, "confidence": 0.01, "plan_budget": 1e9}


@pytest.mark.parametrize(("method", "options", "rejects"), [
    ("ngram", {}, True), ("layerskip", {"exit_layer": 3}, True),
    ("knapspec", KNAPSPEC_NOW, True),
    ("auto", {}, False)],  # auto's drafts here are all accepted (28/28)
    ids=["ngram", "layerskip", "knapspec", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lossless_methods_keep_ar_tokens_on_the_fused_path(tmp_path, arch, method, options,
                                                           rejects):
    # seed 4 with a damped last layer: its greedy text repeats (n-gram drafts are accepted)
    # and an exit before the last layer agrees often but not always (seed 0's qwen2 emits
    # EOS at once, and every case drafted nothing or accepted nothing)
    engine = steady_latency(_engine(tmp_path, arch, seed=4, damp=0.1))
    prompt = "abcabcabcabc the cat the cat the"
    want = engine.generate(prompt, method="ar", max_new_tokens=32)
    got = engine.generate(prompt, method=method, max_new_tokens=32, **options)
    assert got.token_ids == want.token_ids
    assert len(want.token_ids) == 32
    assert_speculated(got.stats, accepts=True, rejects=rejects)


def test_matrices_of_two_builds_or_kernels_are_not_one_fused_kernel(tmp_path, monkeypatch):
    if not all(gguf_rows.gguf_rows_available(isa) for isa in ("avx2", "avx512")):
        pytest.skip("needs two builds")
    seg = gguf_rows.GgufSegment(gguf_rows._T.Q8_0, torch.zeros(4, 34, dtype=torch.uint8))
    a, b = (gguf_rows.GgufMatrix([seg], 32, isa=isa) for isa in ("avx2", "avx512"))
    assert fused_layers.kernel_of([a, a]) == "gguf"
    assert fused_layers.kernel_of([a, b]) is None
    assert fused_layers.kernel_of([a, object()]) is None
