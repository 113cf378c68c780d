"""``--dtype gguf``: a model decoding on its GGUF file's own blocks (models/gguf_weights.py,
executor/gguf_backend.py), on tiny random models written as GGUF files of mixed block types."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from selfspec.api import SelfSpec
from selfspec.errors import (
    CorruptModelFileError,
    InvalidArgumentError,
    UnsupportedArchitectureError,
    UnsupportedGgufTypeError,
)
from selfspec.executor import gguf_rows
from selfspec.models.gguf_weights import read_gguf_weights
from selfspec.models.resolve import resolve

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

# K-quants take inputs in blocks of 256.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=4)


def _engine(tmp_path, arch="llama", seed=0, damp=None, **types):
    model = tiny_model(arch, seed=seed, dtype=torch.bfloat16, **SHAPE)
    if damp is not None:
        damp_last_layer(model, damp)
    path = write_tiny_gguf(model, tmp_path / f"{arch}-{seed}.gguf", types or None)
    return SelfSpec(model, tiny_tokenizer(), f"tiny-{arch}", decode_kernel="gguf",
                    gguf=path), path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_matrix_runs_on_the_files_blocks(tmp_path, arch):
    """Each matrix's kernel copy is the file's blocks in the model's row order (llama's q/k
    rows un-permuted, qwen2's biases from the file), and a forward stays close to the dense
    model's (activations are 8-bit per block)."""
    engine, path = _engine(tmp_path, arch)
    ex = engine.executor
    assert ex.formats.rows == "gguf" and ex.gguf_weights.path == path
    for lin in [m for w in ex.layer_weights for m in w.matrices] + [ex.output_weights]:
        copy = lin.rows_weight
        assert isinstance(copy, gguf_rows.GgufMatrix)
        assert torch.equal(copy.dequantize().to(torch.bfloat16), lin.weight)
    qkv = ex.layer_weights[0].qkv.rows_weight
    assert [t.name for t in qkv.types] == ["Q4_K", "Q4_K", "Q6_K"]
    ids = [1, 40, 41, 42, 43, 44, 45, 46]
    with torch.inference_mode():
        dense = engine.model(torch.tensor([ids])).logits[0, -1].float()
        blocks = _prefill_logits(engine, ids)
    assert torch.nn.functional.cosine_similarity(blocks, dense, dim=0) > 0.98


def _prefill_logits(engine, ids):
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=1))
    return state.prefill().float().reshape(-1)


# knapspec plans from the first steps (with its defaults it drafts nothing in 32 tokens here)
KNAPSPEC_NOW = {"reoptimize_every": 6, "tau": -1.0, "confidence": 0.01, "plan_budget": 1e9}


def _speculating_engine(tmp_path):
    """Seed 4 with a damped last layer: its greedy text repeats (n-gram drafts are accepted)
    and an exit before the last layer agrees often but not always (on seed 0's model n-gram,
    knapspec and auto drafted nothing), with a hand-made latency model (drafting decisions
    independent of the machine's load)."""
    engine, path = _engine(tmp_path, seed=4, damp=0.1)
    return steady_latency(engine), path


def _assert_parity_with_drafts(engine, method, options, rejects=True):
    prompt = "abcabcabcabc the cat the cat the"
    want = engine.generate(prompt, method="ar", max_new_tokens=32)
    got = engine.generate(prompt, method=method, max_new_tokens=32, **options)
    assert got.token_ids == want.token_ids
    assert len(want.token_ids) == 32
    assert_speculated(got.stats, accepts=True, rejects=rejects)


@pytest.mark.parametrize(("method", "options"), [
    ("ngram", {}), ("layerskip", {"exit_layer": 3}), ("knapspec", KNAPSPEC_NOW), ("clasp", {}),
    ("dv", {}), ("qspec", {"draft_weights": "w4a8"}), ("auto", {})])
def test_lossless_methods_keep_the_gguf_models_greedy_tokens(tmp_path, method, options):
    """Verification on the blocks equals one-token decoding on them bit for bit (each row of a
    call is computed as if alone), so a lossless method gives ``ar``'s tokens on the GGUF
    model exactly (and each drafted, accepted and rejected: auto's drafts are all accepted)."""
    engine, _ = _speculating_engine(tmp_path)
    _assert_parity_with_drafts(engine, method, options, rejects=method != "auto")


def test_a_gguf_of_another_model_is_refused_naming_the_tensor(tmp_path):
    other = tiny_model("llama", seed=1, dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(other, tmp_path / "other.gguf")
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    with pytest.raises(UnsupportedArchitectureError, match=r"blk\.0\.attn_q\.weight .*differs"):
        SelfSpec(model, tiny_tokenizer(), "tiny", decode_kernel="gguf", gguf=path)


def test_unpermuted_llama_rows_are_caught(tmp_path):
    """A llama GGUF whose q/k rows were stored in HF order (not as llama.cpp's converter
    stores them) maps wrongly: the check against the model catches it."""
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(model, tmp_path / "flat.gguf", qk_permuted=False)
    with pytest.raises(UnsupportedArchitectureError, match="attn_q"):
        SelfSpec(model, tiny_tokenizer(), "tiny", decode_kernel="gguf", gguf=path)


def test_a_truncated_gguf_names_the_tensor_cut_off(tmp_path):
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(model, tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CorruptModelFileError, match=r"truncated: tensor output\.weight"):
        read_gguf_weights(path, model.config)
    path.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(CorruptModelFileError, match="not a readable GGUF"):
        read_gguf_weights(path, model.config)


def test_an_unsupported_block_type_names_the_tensor_and_its_type(tmp_path, monkeypatch):
    """An IQ4_NL tensor (no kernel) is one error naming it, never a fallback to dense
    weights."""
    T = gguf.GGMLQuantizationType
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    layer = model.model.layers[0].mlp.down_proj
    n, k = layer.weight.shape
    block, size = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    raw[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # d
    raw = raw.reshape(n, -1)
    from selfspec.executor import gguf_quantize

    original = gguf_quantize.quantize_blocks
    monkeypatch.setattr(gguf_quantize, "quantize_blocks",  # no IQ4_NL quantizer here
                        lambda w, qtype: raw if qtype == T.IQ4_NL else original(w, qtype))
    path = write_tiny_gguf(model, tmp_path / "iq4.gguf", {"down": T.IQ4_NL})
    with pytest.raises(UnsupportedGgufTypeError, match=r"blk\.0\.ffn_down\.weight \(IQ4_NL\)"):
        SelfSpec(model, tiny_tokenizer(), "tiny", decode_kernel="gguf", gguf=path)


def test_the_gguf_kernel_needs_a_gguf_file():
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    with pytest.raises(InvalidArgumentError, match="--dtype gguf"):
        SelfSpec(model, tiny_tokenizer(), "tiny", decode_kernel="gguf")


def test_a_local_gguf_file_is_a_model_source(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    source = resolve(str(path))
    assert source.kind == "gguf" and source.path == path
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(Exception, match=r"\.gguf file"):
        resolve(str(tmp_path / "m.bin"))


def test_a_wrapped_model_takes_its_gguf_file(tmp_path):
    """``from_pretrained_model(..., gguf=)``: the kernel is switched to the blocks on request,
    and back."""
    from selfspec.api import from_pretrained_model

    model = tiny_model("qwen2", seed=0, dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(model, tmp_path / "w.gguf")
    engine = from_pretrained_model(model, tiny_tokenizer(), "tiny", device="cpu", gguf=path)
    dense = engine.generate("the cat the cat", max_new_tokens=8).token_ids
    previous = engine.executor.set_decode_kernel("gguf")
    assert engine.executor.gguf_weights.path == path
    engine.generate("the cat the cat", max_new_tokens=8)
    engine.executor.set_decode_kernel(previous)
    assert engine.generate("the cat the cat", max_new_tokens=8).token_ids == dense


def _prefill_kv(engine, ids, kernel):
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    engine.executor.set_decode_kernel(kernel)
    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=1))
    state.prefill()
    return state.cache.get(0)[0][..., :len(ids), :].clone()


def test_dense_prefill_fills_the_prompt_on_the_dense_weights_and_decodes_on_the_blocks(tmp_path):
    """``gguf+dense``: the prompt's KV is the dense weights' (as with kernel ``weights``), not
    the blocks' (``gguf``), while decoding and verification stay on the blocks."""
    engine, _ = _engine(tmp_path)
    ids = [1, *range(40, 60)]  # long enough to be a bulk prefill
    dense = _prefill_kv(engine, ids, "weights")
    blocks = _prefill_kv(engine, ids, "gguf")
    mixed = _prefill_kv(engine, ids, "gguf+dense")
    assert torch.equal(mixed, dense) and not torch.equal(mixed, blocks)
    ex = engine.executor
    assert ex.formats.rows == "gguf+dense"
    assert all(isinstance(lin.rows_weight, gguf_rows.GgufMatrix)
               for w in ex.layer_weights for lin in w.matrices)
    # one GgufMatrix per matrix, shared by both kernels
    gguf_copy = ex.layer_weights[0].qkv.rows_weight
    ex.set_decode_kernel("gguf")
    assert ex.layer_weights[0].qkv.rows_weight is gguf_copy


@pytest.mark.parametrize(("method", "options"), [
    ("knapspec", KNAPSPEC_NOW), ("dv", {}), ("auto", {})])
def test_lossless_methods_keep_greedy_tokens_with_dense_prefill(tmp_path, method, options):
    """All methods share one prefill, and verification stays on the blocks: parity holds on
    ``gguf+dense`` as on ``gguf`` (each drafted and accepted; knapspec also rejected: dv's and
    auto's drafts are all accepted here)."""
    engine, _ = _speculating_engine(tmp_path)
    engine.executor.set_decode_kernel("gguf+dense")
    steady_latency(engine)  # the latency model is keyed by the kernel: set for this one too
    _assert_parity_with_drafts(engine, method, options, rejects=method == "knapspec")


def test_dtype_gguf_takes_its_dense_prefill_kernel_and_refuses_others(monkeypatch):
    """``load(dtype="gguf", decode_kernel=...)``: ``gguf+dense`` is accepted (checked before
    anything loads), another kernel is refused naming the ones it takes."""
    import selfspec.api as api

    seen = {}

    def fake_load(model, dtype, show_progress=True):
        seen["dtype"] = dtype
        raise RuntimeError("stop here")

    monkeypatch.setattr("selfspec.models.loading.load_model", fake_load)
    with pytest.raises(RuntimeError, match="stop here"):
        api.load("smollm2-135m-instruct", dtype="gguf", decode_kernel="gguf+dense")
    assert seen["dtype"] == "bf16"
    with pytest.raises(InvalidArgumentError, match="gguf\\+dense.*not 'w4a8'"):
        api.load("smollm2-135m-instruct", dtype="gguf", decode_kernel="w4a8")


def test_a_gguf_only_engine_keeps_no_packed_dense_copy_until_one_is_needed(tmp_path):
    """``keep_packed=False`` (``load(dtype="gguf")``): no oneDNN copy of the dense weights
    while the blocks serve decoding, under ``gguf`` and under ``gguf+dense`` (whose prefill
    takes ``F.linear``), the tokens those of an engine that kept them; kernel ``weights``
    (decoding on the dense product) packs them and ``gguf`` frees them again."""
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    path = write_tiny_gguf(model, tmp_path / "lean.gguf")
    lean = SelfSpec(model, tiny_tokenizer(), "tiny", decode_kernel="gguf", gguf=path,
                    keep_packed=False)
    twin = tiny_model("llama", seed=0, dtype=torch.bfloat16, **SHAPE)
    full = SelfSpec(twin, tiny_tokenizer(), "tiny", decode_kernel="gguf",
                    gguf=write_tiny_gguf(twin, tmp_path / "full.gguf"))
    ex = lean.executor

    def packed():
        return [lin.packed is not None
                for w in ex.layer_weights for lin in w.matrices] + [ex.output_weights.packed
                                                                    is not None]

    prompt = "the cat the cat the cat sat on"
    assert not any(packed())
    assert (lean.generate(prompt, max_new_tokens=12).token_ids
            == full.generate(prompt, max_new_tokens=12).token_ids)
    ex.set_decode_kernel("gguf+dense")
    assert not any(packed())
    ar = lean.generate(prompt, max_new_tokens=12).token_ids
    assert lean.generate(prompt, method="auto", max_new_tokens=12).token_ids == ar
    if full.executor.output_weights.packed is None:
        pytest.skip("no oneDNN packed kernel in this torch build")
    ex.set_decode_kernel("weights")
    assert all(packed())
    ex.set_decode_kernel("gguf")
    assert not any(packed())
