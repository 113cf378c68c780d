"""The 4-bit decoding kernels (``--decode-kernel int4`` / ``--dtype int4``: torch's int4
kernel; ``w4a8``: selfspec's 4-bit-weight 8-bit-activation kernel): the model decodes on 4-bit
copies of its weights, prefill keeps the weights, and every lossless method stays exact
relative to that 4-bit model."""

import pytest
import torch

import selfspec
from selfspec.errors import InvalidArgumentError
from selfspec.executor import cpu
from selfspec.executor.int4_rows import Int4Rows, int4_available
from selfspec.executor.linear import Linear
from selfspec.executor.w4a8 import W4A8Rows, w4a8_available

from tiny import tiny_model, tiny_tokenizer

INT4 = pytest.param("int4", marks=pytest.mark.skipif(not int4_available(),
                                                     reason="no CPU int4 kernel in this torch"))
W4A8 = pytest.param("w4a8", marks=pytest.mark.skipif(not w4a8_available(),
                                                     reason="no w4a8 kernel here"))
KERNELS = [INT4, W4A8]
ROWS = {"int4": lambda: Int4Rows(max_rows=16), "w4a8": W4A8Rows}


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_are_the_same_in_any_block_and_prefill_takes_the_kernels_bulk_path(kernel):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 64, generator=gen) * 0.1).bfloat16()
    lin = Linear(weight, None, rows=ROWS[kernel]())
    assert lin.rows is not None and lin.rows_weight is not None
    x = torch.randn(20, 64, generator=gen).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(20)])
    for rows in (2, 5, 16, 20):
        assert torch.equal(lin(x[:rows]), alone[:rows])
    # int4 is lossy (16 levels per group of 32 weights) but close.
    exact = torch.nn.functional.linear(x.float(), weight.float())
    assert (alone.float() - exact).abs().max() < 0.25 * exact.abs().max()
    bulk = lin(x, bulk=True).float()
    if kernel == "int4":
        # torch's int4 kernel slows with the rows: prefill uses the bf16 weights.
        assert (bulk - exact).abs().max() < (alone.float() - exact).abs().max()
    else:
        # w4a8 gets faster per row with the rows: prefill runs on the 4-bit model too.
        assert torch.equal(bulk, alone.float())


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_weight_whose_inputs_are_not_groups_of_32_keeps_its_kernel(kernel):
    lin = Linear(torch.randn(8, 40).bfloat16(), None, rows=ROWS[kernel]())
    assert lin.rows is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_choose_rows_4bit(kernel):
    assert cpu.choose_rows(torch.bfloat16, "cpu", kernel) == kernel
    assert kernel in cpu.choose_formats(torch.bfloat16, "cpu", "auto", kernel).describe()
    with pytest.raises(InvalidArgumentError, match="bf16"):
        cpu.choose_rows(torch.float32, "cpu", kernel)


def test_w4a8_rows_where_the_kernel_is_missing_says_why(monkeypatch):
    from selfspec.executor import w4a8

    monkeypatch.setattr(w4a8, "w4a8_available", lambda: False)
    monkeypatch.setattr(w4a8, "w4a8_unavailable_reason", lambda: "no C++ compiler (g++)")
    with pytest.raises(InvalidArgumentError, match="no C\\+\\+ compiler"):
        cpu.choose_rows(torch.bfloat16, "cpu", "w4a8")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_lossless_methods_keep_ar_greedy_tokens_on_4bit_rows(arch, kernel):
    engine = selfspec.from_pretrained_model(tiny_model(arch, dtype=torch.bfloat16),
                                            tiny_tokenizer(), name=f"tiny-{arch}")
    prompt = "def add(a, b):\n"
    engine.executor.set_bulk("auto", kernel)
    assert all(w.gate_up.rows is not None for w in engine.executor.layer_weights)
    reference = engine.generate(prompt, max_new_tokens=24).token_ids  # lossy vs bf16
    drafted = 0
    for method, options in (("layerskip", {"exit_layer": 3, "draft_len": 4}),
                            ("knapspec", {}), ("ngram", {}),
                            ("adadecode", {"heads": "none"})):
        result = engine.generate(prompt, method=method, max_new_tokens=24, **options)
        assert result.token_ids == reference, method
        drafted += result.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_dtype_4bit_is_bf16_weights_with_the_4bit_kernel(monkeypatch, kernel):
    loaded = {}

    def fake_load_model(name, dtype, show_progress=True):
        loaded["dtype"] = dtype
        from types import SimpleNamespace
        return SimpleNamespace(model=tiny_model("llama", dtype=torch.bfloat16),
                               tokenizer=tiny_tokenizer(), name="tiny", gguf=None)

    monkeypatch.setattr("selfspec.models.loading.load_model", fake_load_model)
    engine = selfspec.load("tiny", dtype=kernel, show_progress=False)
    assert loaded["dtype"] == "bf16" and engine.executor.formats.rows == kernel
    with pytest.raises(InvalidArgumentError, match=kernel):
        selfspec.load("tiny", dtype=kernel, decode_kernel="fp16")


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_roofline_counts_the_4bit_bytes_that_decoding_reads(kernel):
    engine = selfspec.from_pretrained_model(tiny_model("qwen2", dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-qwen2")
    engine.executor.set_bulk("auto", "weights")
    bf16 = engine.executor.decode_weight_bytes()
    engine.executor.set_bulk("auto", kernel)
    int4 = engine.executor.decode_weight_bytes()
    # 4 bits a weight + a 16-bit scale and offset per 32 weights = 0.625 bytes vs bf16's 2.
    assert 0.25 * bf16 < int4 < 0.4 * bf16


@pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this torch")
def test_bench_runs_bf16_and_int4_rows_in_one_run(tmp_path):
    from selfspec.bench.pipeline import BenchOptions, run_benchmark
    from selfspec.bench.spec import parse_methods
    from selfspec.data import Prompt

    engine = selfspec.from_pretrained_model(tiny_model("qwen2", dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-qwen2")
    bf16_bytes = engine.executor.decode_weight_bytes()
    methods = parse_methods("ar,ar:decode_kernel=int4,ngram:decode_kernel=int4")
    prompts = [Prompt(f"p{i}", f"def f{i}(x):\n    return x + x + x + x", chat=False)
               for i in range(2)]
    options = BenchOptions(dataset="humaneval", max_new_tokens=12, out_dir=tmp_path / "out",
                           bandwidth_mib=1, warmup_prompts=0, plots=False, score=False)
    report = run_benchmark(engine, methods, prompts, options)
    by = {label: [r.output.token_ids for r in report.run.records if r.method == label]
          for label in report.run.methods}
    # ngram on int4 is lossless against ar on int4 (not against bf16's ar), and the run has
    # that row, so its parity is checked against it.
    assert by["ngram:decode_kernel=int4"] == by["ar:decode_kernel=int4"]
    assert engine.executor.formats.rows != "int4"  # switched back after each row
    assert report.run.lossless == {"ar": True, "ar:decode_kernel=int4": False,
                                   "ngram:decode_kernel=int4": True}
    assert all(s.parity == 1.0 for s in report.summaries
               if s.method == "ngram:decode_kernel=int4")
    int4_bytes = report.info.roofline.method_bytes["ar:decode_kernel=int4"]
    assert int4_bytes < 0.4 * bf16_bytes == 0.4 * report.info.roofline.weight_bytes


def test_decode_kernel_option_is_checked():
    from selfspec.bench.spec import parse_method

    with pytest.raises(InvalidArgumentError, match="decode_kernel"):
        parse_method("ar:decode_kernel=int3")
    assert parse_method("qspec:decode_kernel=int4").options == {"decode_kernel": "int4"}
