"""FBGEMM's fp16-weight kernel for decoding and verification (executor/fp16_rows.py): rows
are bit-identical whatever the block, outputs match bf16 products to fp32 rounding, and every
lossless method keeps `ar`'s greedy tokens in bf16 when the executor uses it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor, cpu
from selfspec.executor.fp16_rows import Fp16Rows, _probe_pads, fbgemm_fp16_available
from selfspec.executor.linear import Linear

from tiny import (
    assert_block_equals_one_token_decoding,
    assert_lossless_on_rows_kernel,
    tiny_model,
)

pytestmark = pytest.mark.skipif(not fbgemm_fp16_available(),
                                reason="FBGEMM's fp16 linear is x86-only")


@pytest.fixture(scope="module")
def kernel():
    return Fp16Rows(max_rows=16)


def _weight(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), k=st.sampled_from([64, 200, 576]),
       n=st.sampled_from([8, 72, 300]), seed=st.integers(0, 2**31 - 1))
def test_each_row_is_the_same_in_any_block(kernel, rows, k, n, seed):
    """Verification's rows equal one-token decoding's, bit for bit, at any block size
    (including sizes above max_rows, which are chunked)."""
    weight = _weight(n, k, seed % 1000)
    bias = torch.randn(n).to(torch.bfloat16)
    packed = kernel.prepack(weight, bias)
    assert packed is not None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    block = kernel(x[None], packed)[0]
    alone = torch.cat([kernel(x[i:i + 1], packed) for i in range(rows)])
    assert torch.equal(block, alone)


def test_padding_table_covers_every_row_count(kernel):
    size, table = kernel._pad_table()
    assert table[0] == 0
    for m in range(1, kernel.max_rows + 1):
        assert table[m] >= max(m, size)


def test_fp32_inputs_need_padding_and_get_it():
    """On fp32 activations FBGEMM's 1- and 2-row kernels round differently from the others
    (AVX2), so the probe falls back to groups of three with padded blocks; the rows are then
    consistent all the same."""
    size, table = _probe_pads(16, torch.float32)
    kernel = Fp16Rows(max_rows=16, dtype=torch.float32)
    packed = kernel.prepack(_weight(72, 600).float(), None)
    assert packed is not None
    x = torch.randn(13, 600)
    assert torch.equal(kernel(x, packed), torch.cat([kernel(r[None], packed) for r in x]))
    assert all(table[1:]) and size in (1, 3)


def test_matches_the_bf16_product_to_fp32_rounding(kernel):
    weight, x = _weight(96, 300), torch.randn(5, 300).to(torch.bfloat16)
    got = kernel(x, kernel.prepack(weight, None)).float()
    want = F.linear(x.double(), weight.double()).float()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-3)
    assert got.dtype == torch.float32 and kernel(x, kernel.prepack(weight, None)).dtype == x.dtype


def test_weights_it_cannot_take_keep_their_own_kernel():
    kernel = Fp16Rows(max_rows=8)
    big = _weight(16, 32)
    big[0, 0] = 1e6  # beyond fp16's range
    assert kernel.prepack(big, None) is None
    lin = Linear(big, None, rows=kernel)
    assert lin.rows is None
    x = torch.randn(1, 32).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, big))
    small = Fp16Rows(max_rows=8, min_bytes=1 << 20)
    assert small.prepack(_weight(16, 32), None) is None


def test_choose_rows(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="decoding kernel"):
        cpu.choose_rows(torch.bfloat16, "cpu", "int3")
    with pytest.raises(InvalidArgumentError, match="16-bit|bf16/fp16"):
        cpu.choose_rows(torch.float32, "cpu", "fp16")
    assert cpu.choose_rows(torch.float32, "cpu", "auto") == "weights"
    assert cpu.choose_rows(torch.bfloat16, "cpu", "weights") == "weights"
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    # (the kernel's AMX build takes every size: test_bf16_rows)
    monkeypatch.setattr("selfspec.executor.bf16_rows.chosen_isa", lambda: "avx512bf16")
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "weights"
    # Native bf16: selfspec's bf16 kernel (fused sub-layers) for models of small matrices only,
    # prefill staying on oneDNN (no FBGEMM copies).
    small, large = cpu.NATIVE_BF16_ROWS_MAX_BYTES - 1, cpu.NATIVE_BF16_ROWS_MAX_BYTES
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto", large) == "weights"
    assert cpu.choose_rows(torch.float16, "cpu", "auto", small) == "weights"
    assert cpu.choose_rows(torch.bfloat16, "meta", "auto", small) == "weights"
    monkeypatch.setattr("selfspec.executor.bf16_rows.bf16_rows_available", lambda: True)
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto", small) == "bf16"
    assert cpu.choose_formats(torch.bfloat16, "cpu", "auto", "auto", small).rows_min_bytes == 0
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    # Without selfspec's bf16 kernel (no compiler), auto takes FBGEMM for the large matrices.
    monkeypatch.setattr("selfspec.executor.bf16_rows.bf16_rows_available", lambda: False)
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "fp16"
    formats = cpu.choose_formats(torch.bfloat16, "cpu", "auto", "auto")
    assert formats.rows == "fp16" and formats.rows_min_bytes == cpu.AUTO_ROWS_MIN_BYTES
    assert "FBGEMM" in formats.describe()
    assert cpu.choose_formats(torch.bfloat16, "cpu", "auto", "fp16").rows_min_bytes == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_executor_switches_kernels_and_verification_stays_exact(arch):
    ex = LayerExecutor(tiny_model(arch, dtype=torch.bfloat16), rows="fp16")
    assert ex.formats.rows == "fp16" and ex.fp16_rows is not None
    assert all(w.qkv.rows is ex.fp16_rows for w in ex.layer_weights)
    assert_block_equals_one_token_decoding(ex, [5, 9, 17, 33, 2, 8])
    ex.set_bulk("auto", "weights")
    assert ex.fp16_rows is None and all(w.qkv.rows is None for w in ex.layer_weights)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lossless_methods_keep_ar_greedy_tokens_on_fp16_rows(arch):
    assert_lossless_on_rows_kernel(arch, "fp16")
