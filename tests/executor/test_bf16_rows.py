"""selfspec's AVX2 bf16-weight kernel for decoding and verification (executor/bf16_rows.py,
executor/kernels/bf16_rows.cpp): rows are bit-identical whatever the block and the thread
count, outputs match fp32 products to bf16 rounding, and every lossless method keeps `ar`'s
greedy tokens in bf16 on it, alone and chained after FBGEMM's fp16 kernel (auto)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.errors import InvalidArgumentError
from selfspec.executor import argmax, bf16_rows, cpu, native
from selfspec.executor.bf16_rows import Bf16Rows, bf16_rows_available
from selfspec.executor.fp16_rows import Fp16Rows, fbgemm_fp16_available
from selfspec.executor.linear import ChainRows, Linear

from tiny import assert_lossless_on_rows_kernel

needs_kernel = pytest.mark.skipif(
    not bf16_rows_available(),
    reason=f"bf16 rows kernel unavailable: {bf16_rows.bf16_rows_unavailable_reason()}")


@pytest.fixture(scope="module")
def kernel():
    return Bf16Rows()


def _weight(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)


def _build(isa):
    lib = bf16_rows._library(isa)
    if lib.call is None:
        pytest.skip(f"the {isa} build is unavailable here: {lib.reason}")
    return lambda x, packed: bf16_rows._product(lib.call, x, packed)


@needs_kernel
@pytest.mark.parametrize("isa", bf16_rows.ISAS)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), k=st.sampled_from([8, 15, 64, 100, 200, 577]),
       n=st.sampled_from([1, 7, 72, 301]), bias=st.booleans(), seed=st.integers(0, 999))
def test_each_row_is_the_same_in_any_block(isa, rows, k, n, bias, seed):
    """Verification's rows equal one-token decoding's, bit for bit, at any block size (groups
    of six (AVX2) or eight (AVX512-BF16) rows, weight rows in pairs for one or two rows and,
    AVX512-BF16, for more than eight (groups of six), odd
    N, K with a scalar or masked tail), and agree with an fp32 product to bf16 rounding; for
    each build (``chosen_isa`` takes one per process)."""
    product = _build(isa)
    weight = _weight(n, k, seed)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = bf16_rows._weight(weight, b)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    together = product(x, packed)
    alone = torch.cat([product(row, packed) for row in x.split(1)])
    assert together.dtype == torch.bfloat16 and together.shape == (rows, n)
    assert torch.equal(together, alone)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert torch.allclose(together.float(), want, rtol=1e-2, atol=1e-2)


@needs_kernel
def test_threads_do_not_change_a_bit(kernel):
    """The split of the outputs between threads leaves every dot product's order unchanged."""
    weight, x = _weight(301, 577), torch.randn(9, 577).bfloat16()
    packed = kernel.prepack(weight, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, packed)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(kernel(x, packed), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_it_reads_the_weights_in_place_and_only_bf16(kernel):
    weight = _weight(16, 32)
    packed = kernel.prepack(weight, None)
    assert packed.weight.data_ptr() == weight.data_ptr()      # no copy of the model's weights
    assert packed.nbytes == 16 * 32 * 2
    assert kernel.prepack(weight.half(), None) is None        # fp16 weights keep their kernel
    big = torch.randn(3 * bf16_rows.BULK_MAX_ROWS, 32).bfloat16()
    assert torch.allclose(kernel.bulk(big, packed).float(),
                          F.linear(big.float(), weight.float()), rtol=1e-2, atol=1e-2)


@needs_kernel
@pytest.mark.skipif(not fbgemm_fp16_available(), reason="FBGEMM's fp16 linear is x86-only")
def test_chain_puts_each_weight_on_the_first_kernel_that_takes_it(kernel):
    fp16 = Fp16Rows(max_rows=16, min_bytes=4096)
    chain = ChainRows(fp16, kernel)
    small, large = Linear(_weight(8, 32), None, rows=chain), Linear(_weight(64, 64), None,
                                                                     rows=chain)
    assert small.rows_weight.kernel is kernel and large.rows_weight.kernel is fp16
    assert small.decode_bytes == 8 * 32 * 2 and large.decode_bytes == 64 * 64 * 2
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(large(x), torch.cat([large(r) for r in x.split(1)]))


def test_choose_rows_prefers_the_bf16_kernel_where_bf16_is_emulated(monkeypatch):
    """auto: every matrix on selfspec's kernel, prefill on FBGEMM's fp16 copies of the larger
    ones; the chain (FBGEMM decoding the larger matrices) only when asked."""
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    monkeypatch.setattr(bf16_rows, "bf16_rows_available", lambda: True)
    monkeypatch.setattr("selfspec.executor.fp16_rows.fbgemm_fp16_available", lambda: True)
    formats = cpu.choose_formats(torch.bfloat16, "cpu", "auto", "auto")
    assert formats.rows == "bf16" and formats.rows_min_bytes == cpu.AUTO_ROWS_MIN_BYTES
    assert "bf16 kernel (prefill on fp16 copies" in formats.describe()
    chain = cpu.choose_formats(torch.bfloat16, "cpu", "auto", "bf16+fp16")
    assert chain.rows == "bf16+fp16" and chain.rows_min_bytes == cpu.AUTO_ROWS_MIN_BYTES
    assert cpu.choose_rows(torch.float16, "cpu", "auto") == "fp16"   # the kernel is bf16-only
    assert cpu.choose_rows(torch.bfloat16, "cpu", "bf16") == "bf16"
    with pytest.raises(InvalidArgumentError, match="need bf16 weights"):
        cpu.choose_rows(torch.float16, "cpu", "bf16")
    monkeypatch.setattr("selfspec.executor.fp16_rows.fbgemm_fp16_available", lambda: False)
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "bf16"
    assert cpu.choose_formats(torch.bfloat16, "cpu", "auto", "auto").rows_min_bytes == 0
    monkeypatch.setattr(bf16_rows, "bf16_rows_available", lambda: False)
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "weights"
    with pytest.raises(InvalidArgumentError, match="AVX2 kernel"):
        cpu.choose_rows(torch.bfloat16, "cpu", "bf16")
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setattr(bf16_rows, "bf16_rows_available", lambda: True)
    monkeypatch.setattr(bf16_rows, "chosen_isa", lambda: "avx512bf16")
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "weights"  # native bf16 wins
    # ... except for models whose matrices are all small (SmolLM2-135M): the fused sub-layers
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto",
                           cpu.NATIVE_BF16_ROWS_MAX_BYTES - 1) == "bf16"
    # and for every model where the kernel's AMX build runs (verification blocks in tiles)
    monkeypatch.setattr(bf16_rows, "chosen_isa", lambda: "amx")
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto", 52 << 20) == "bf16"
    assert cpu.choose_rows(torch.bfloat16, "cpu", "auto") == "bf16"


@needs_kernel
@pytest.mark.parametrize("native", [True, False])
def test_long_bulk_calls_take_native_bf16_where_the_cpu_has_it(native):
    """Bulk calls beyond BULK_MAX_ROWS rows (prefill) without an fp16 copy: torch's bf16 GEMM
    where bf16 is native (the weight as it is), else an fp32 GEMM on an fp32 cast."""
    kernel = Bf16Rows(native_bulk=native)
    weight, bias = _weight(24, 64), torch.randn(24)
    x = torch.randn(bf16_rows.BULK_MAX_ROWS + 5, 64).to(torch.bfloat16)
    got = kernel.bulk(x, kernel.prepack(weight, bias))
    want = (F.linear(x, weight, bias.bfloat16()) if native
            else F.linear(x.float(), weight.float(), bias).bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_kernel
@pytest.mark.skipif(not fbgemm_fp16_available(), reason="FBGEMM's fp16 linear is x86-only")
def test_forced_bf16_prefills_on_fp16_copies_and_decodes_on_the_weights(monkeypatch):
    """``--decode-kernel bf16`` keeps FBGEMM fp16 copies of the larger matrices for bulk calls
    of more than BULK_MAX_ROWS rows (prefill; a per-call fp32 cast before), while decoding
    and verification still read the bf16 weights, row-consistently."""
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    formats = cpu.choose_formats(torch.bfloat16, "cpu", "auto", "bf16")
    assert formats.rows == "bf16" and formats.rows_min_bytes == cpu.AUTO_ROWS_MIN_BYTES
    assert "prefill on fp16 copies of matrices >= 4 MiB" in formats.describe()
    weight, bias = _weight(72, 200), torch.randn(72)
    kernel = Bf16Rows(bulk_min_bytes=0)
    packed = kernel.prepack(weight, bias)
    assert packed.bulk_copy is not None
    assert Bf16Rows(bulk_min_bytes=1 << 30).prepack(weight, bias).bulk_copy is None
    x = torch.randn(bf16_rows.BULK_MAX_ROWS + 8, 200).bfloat16()
    want = F.linear(x.float(), weight.float(), bias)
    got = kernel.bulk(x, packed)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(got, torch.ops.quantized.linear_dynamic_fp16(
        x.float(), packed.bulk_copy).to(torch.bfloat16))   # FBGEMM's, not the kernel's
    rows = kernel(x, packed)   # non-bulk: the bf16 kernel, each row as alone
    assert torch.equal(rows, torch.cat([kernel(r, packed) for r in x.split(1)]))


def test_no_compiler_is_a_clear_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        native.build(bf16_rows.SOURCE)


@needs_kernel
def test_the_build_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    """A second build finds the first one's library (no recompilation) under SELFSPEC_HOME.
    The cache is native.build's, the same for every kernel: shown on the smallest source
    (argmax.cpp compiles in ~1 s of CPU; this file's kernel, which includes ATen headers, in
    ~9 s, and every other test here builds it anyway)."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    first = native.build(argmax.SOURCE)
    assert first.parent == tmp_path / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert native.build(argmax.SOURCE) == first and first.stat().st_mtime_ns == stamp
    assert list((tmp_path / "kernels").iterdir()) == [first]   # no temporary left behind


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("rows", ["bf16", "bf16+fp16"])
def test_lossless_methods_keep_ar_greedy_tokens_on_the_kernel(arch, rows):
    """On the kernel alone, and chained after FBGEMM for the larger matrices."""
    if rows == "bf16+fp16" and not fbgemm_fp16_available():
        pytest.skip("FBGEMM's fp16 linear is x86-only")
    assert_lossless_on_rows_kernel(arch, rows)


def test_the_build_falls_back_where_a_better_one_is_unavailable(monkeypatch):
    """Without AVX-512 (as ATen sees the CPU) neither the AVX512-BF16 nor the AMX build is
    loaded, with the reason; ``chosen_isa`` takes the best build that loads and passes its
    probe (AMX, else AVX512-BF16, else AVX2)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    for isa in ("avx512bf16", "amx"):
        assert "AVX-512" in bf16_rows._library.__wrapped__(isa).reason
    from selfspec.executor import native
    builds = {"amx": native.Kernel(None, "Linux did not grant this process the AMX tile state"),
              "avx512bf16": native.Kernel(lambda *a: None, ""), "avx2": native.Kernel(None, "x")}
    monkeypatch.setattr(bf16_rows, "_library", lambda isa="auto": builds[isa])
    assert bf16_rows.chosen_isa.__wrapped__() == "avx512bf16"
    builds["avx512bf16"] = native.Kernel(None, "needs avx512_bf16")
    assert bf16_rows.chosen_isa.__wrapped__() == "avx2"
    builds["amx"] = native.Kernel(lambda *a: None, "")
    assert bf16_rows.chosen_isa.__wrapped__() == "amx"


@needs_kernel
@pytest.mark.parametrize("isa", bf16_rows.ISAS)
def test_a_call_of_no_rows_is_empty(isa):
    """Zero activation rows (an empty block) give an empty result on every build (the AMX
    build has no tile shape for zero tokens)."""
    product = _build(isa)
    packed = bf16_rows._weight(_weight(37, 75, 0), None)
    assert product(torch.randn(0, 75).bfloat16(), packed).shape == (0, 37)
