"""Number formats by what the processor can do (executor/cpu.py) and their use in the
executor: bulk matrix products in the fast format, decoding and verification in the weights'."""

import pytest
import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor, cpu
from selfspec.executor.executor import BULK_MIN_ROWS
from selfspec.executor.linear import Linear

from tiny import tiny_model

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})


def _never():
    raise AssertionError("the flags should have decided")


def test_x86_flags_decide_without_a_benchmark():
    assert cpu.classify("x86_64", AVX2, "", "AVX2", _never) == (False, "flags")
    assert cpu.classify("x86_64", AVX512_BF16, "", "AVX512", _never) == (True, "flags")
    assert cpu.classify("x86_64", frozenset({"amx_bf16"}), "", "AVX512", _never) == (True, "flags")
    # A restriction cannot make an AVX2 CPU native: still the flags' verdict.
    assert cpu.classify("x86_64", AVX2, "AVX2", "AVX2", _never) == (False, "flags")


@pytest.mark.parametrize("onednn, aten",
                         [("AVX2", "AVX512"), ("", "AVX2"), ("avx512_core", "AVX512")])
def test_an_isa_restriction_on_a_native_cpu_is_measured(onednn, aten):
    calls = []
    native, how = cpu.classify("x86_64", AVX512_BF16, onednn, aten,
                               lambda: calls.append(1) or False)
    assert (native, how, calls) == (False, "micro-benchmark", [1])
    # A restriction that still allows bf16 leaves the flags in charge.
    assert cpu.classify("x86_64", AVX512_BF16, "AVX512_CORE_AMX", "AVX512", _never) == (
        True, "flags")


def test_other_architectures_are_measured():
    assert cpu.classify("aarch64", frozenset({"bf16", "asimd"}), "", "DEFAULT", lambda: True) == (
        True, "micro-benchmark")
    assert cpu.classify("x86_64", frozenset(), "", "AVX2", lambda: False) == (
        False, "micro-benchmark")


def test_detection_runs_once_and_is_reportable():
    info = cpu.detect_cpu()
    assert cpu.detect_cpu() is info
    assert isinstance(info.native_bf16, bool) and info.aten_capability
    assert "bf16 matrix products" in info.summary()
    assert set(info.to_dict()) >= {"arch", "flags", "native_bf16", "decided_by"}
    assert cpu.fast_matmul_dtype() == ("bf16" if info.native_bf16 else "fp32")


def test_formats(monkeypatch):
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    f = cpu.choose_formats(torch.bfloat16)
    assert f.upcast and f.bulk == torch.float32 and "emulated" in f.describe()
    assert not cpu.choose_formats(torch.float32).upcast
    assert not cpu.choose_formats(torch.bfloat16, bulk="weights").upcast
    assert cpu.choose_formats(torch.bfloat16, "meta").bulk == torch.bfloat16  # not a CPU
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    assert not cpu.choose_formats(torch.bfloat16).upcast
    assert cpu.choose_formats(torch.bfloat16, bulk="fp32").upcast  # forced
    with pytest.raises(InvalidArgumentError, match="bulk compute format"):
        cpu.choose_formats(torch.bfloat16, bulk="int8")


def test_bulk_linear_computes_in_fp32_from_bf16_weights():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 32, generator=gen) * 0.1).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(3, 16, 32, generator=gen).bfloat16()
    lin = Linear(w, b, pack=False, bulk_dtype=torch.float32)
    out = lin(x, bulk=True)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 16, 48)
    ref = (torch.nn.functional.linear(x.float(), w.float(), b.float())).bfloat16()
    assert torch.equal(out, ref)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w, b))  # not bulk: weights' format
    assert Linear(w, b, pack=False, bulk_dtype=torch.bfloat16).bulk_dtype is None


def _bulk_executor(arch="llama", row_attention_max=8):
    return LayerExecutor(tiny_model(arch, dtype=torch.bfloat16),
                         row_attention_max=row_attention_max, bulk="fp32")


def test_which_blocks_are_bulk():
    ex = _bulk_executor()
    assert ex.formats.upcast
    assert ex.is_bulk(0, BULK_MIN_ROWS) and not ex.is_bulk(0, BULK_MIN_ROWS - 1)  # prefill
    assert not ex.is_bulk(5, 1) and not ex.is_bulk(5, 8)   # decoding, verification
    assert ex.is_bulk(5, 9)                                 # longer than any verification
    assert not LayerExecutor(tiny_model("llama", dtype=torch.bfloat16),
                             bulk="weights").is_bulk(0, 64)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bulk_prefill_is_close_to_the_weights_format_and_verification_stays_bit_identical(arch):
    """Prefill in fp32 from bf16 weights gives the bf16 model's logits up to rounding; blocks
    after a prefix of up to row_attention_max tokens (verification) equal one-token decoding
    exactly, as without bulk formats."""
    ex = _bulk_executor(arch)
    plain = LayerExecutor(tiny_model(arch, dtype=torch.bfloat16), row_attention_max=8,
                          bulk="weights")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).unsqueeze(0)
    with torch.inference_mode():
        bulk = ex.forward(ids[:, :16], pos[:, :16], ex.new_cache()).float()
        ref = plain.forward(ids[:, :16], pos[:, :16], plain.new_cache()).float()
        assert (bulk - ref).abs().max() < 0.05 * ref.abs().max()
        cache = ex.new_cache()
        ex.forward(ids[:, :16], pos[:, :16], cache)
        alone = torch.cat([ex.forward(ids[:, t:t + 1], pos[:, t:t + 1], cache)
                           for t in range(16, 24)], dim=1)
        cache.truncate(16)
        together = ex.forward(ids[:, 16:], pos[:, 16:], cache)
    assert torch.equal(together, alone)


def test_causal_prefill_equals_the_masked_path():
    """The is_causal prefill path computes what the grouped-mask path computes (fp32)."""
    model = tiny_model("qwen2")
    ex = LayerExecutor(model)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(20).unsqueeze(0)
    with torch.inference_mode():
        whole = ex.forward(ids, pos, ex.new_cache())
        cache = ex.new_cache()
        first = ex.forward(ids[:, :1], pos[:, :1], cache)  # one token: the masked path after it
        rest = torch.cat([ex.forward(ids[:, t:t + 1], pos[:, t:t + 1], cache)
                          for t in range(1, 20)], 1)
    torch.testing.assert_close(whole, torch.cat([first, rest], 1), rtol=1e-5, atol=1e-5)


def test_bench_cpu_measures_before_and_after_under_both_kernel_sets(tmp_path, capsys):
    """`selfspec bench-cpu --isa native,avx2` end to end on a tiny bf16 model: one table with
    both kernel sets, before/after rows and ratios, and a JSON report per kernel set."""
    from selfspec.bench import formats
    from selfspec.cli import main

    from tiny import tiny_tokenizer

    model_dir = tmp_path / "tiny"
    tiny_model("llama", seed=3).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "out"
    code = main(["bench-cpu", "--model", str(model_dir), "--lengths", "16,40",
                 "--decode-tokens", "4", "--train-steps", "1", "--threads", "1",
                 "--isa", "native,avx2", "--out", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    assert "| native | **after / before**" in table and "| avx2 | **after / before**" in table
    assert "prefill 40 tok/s" in table and (out / "report.md").read_text().count("| avx2 |") == 3
    report = formats.load_report(out / "formats-avx2.json")
    assert report.cpu["onednn_max_isa"] == "AVX2" and report.cpu["aten_capability"] == "AVX2"
    assert [r.label for r in report.rows] == ["weights format", "auto"]
    assert all(r.prefill_tok_s[16] > 0 and r.decode_tok_s > 0 and r.train_step_s >= 0
               for r in report.rows)


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "a,b"], "--lengths takes integers"),
    (["--isa", "avx9"], "--isa takes"),
    (["--threads", "0"], "--threads: must be an integer in [1, 4096]"),
])
def test_bench_cpu_refuses_bad_arguments_before_loading(argv, message, capsys):
    from selfspec.cli import main

    assert main(["bench-cpu", "--model", "no-such-model", *argv]) == 2
    assert message in capsys.readouterr().err


def test_info_and_version(capsys):
    from selfspec.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "bf16 matrix products" in out and "--dtype bf16: weights bf16" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("selfspec ")


def test_selfspec_max_isa_caps_the_kernel_builds(monkeypatch):
    """SELFSPEC_MAX_ISA caps the builds the kernels choose (AMX machines measure the AVX-512
    path with it); an unknown value is one clear error."""
    from selfspec.errors import InvalidArgumentError
    from selfspec.executor import bf16_rows, gguf_rows
    from selfspec.executor.isa import isa_allowed

    monkeypatch.setenv("SELFSPEC_MAX_ISA", "avx512")
    assert isa_allowed("avx512bf16") and isa_allowed("avx2") and not isa_allowed("amx")
    monkeypatch.setenv("SELFSPEC_MAX_ISA", "avx2")
    assert not isa_allowed("avx512")
    for chosen in (gguf_rows.chosen_isa, bf16_rows.chosen_isa):
        clear = getattr(chosen, "cache_clear", lambda: None)  # bf16's is cached per process
        clear()
        try:
            assert chosen() == "avx2"
        finally:
            clear()
    monkeypatch.setenv("SELFSPEC_MAX_ISA", "sse2")
    with pytest.raises(InvalidArgumentError, match="SELFSPEC_MAX_ISA"):
        isa_allowed("avx2")
    monkeypatch.delenv("SELFSPEC_MAX_ISA")
    assert isa_allowed("amx")
