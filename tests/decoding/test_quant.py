"""Quantized draft weights (executor/quant.py) and QSpec-style drafting on them
(decoding/drafting/skip_drafter.py, methods/qspec.py): the kernels compute what the quantized
weights
stand for, the draft view leaves the model alone, and drafting on int8/int4 copies keeps the
model's own greedy tokens and sampling distribution."""

import math
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import selfspec
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.skip_drafter import quantized_drafter
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor, quant
from selfspec.executor.quant import (
    Int4Linear,
    Int8DynamicLinear,
    check_draft_weights,
    dequantize_int4,
    fastest_format,
    quantize_int4,
    quantized_kernels_available,
)

from tiny import (
    VOCAB,
    PrefillOnce,
    exact_prefix_distribution,
    global_rng,
    tiny_model,
    tiny_tokenizer,
)

needs_int8 = pytest.mark.skipif(not quantized_kernels_available("int8"),
                                reason="FBGEMM (x86 torch builds) is needed for int8")
needs_int4 = pytest.mark.skipif(not quantized_kernels_available("int4"),
                                reason="no int4 CPU kernel in this torch build")
needs_w4a8 = pytest.mark.skipif(not quantized_kernels_available("w4a8"),
                                reason="selfspec's AVX2 w4a8 kernel cannot be built here")
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _weight(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_quantization_error_is_at_most_half_a_step():
    w = _weight()
    codes, scale, low = quantize_int4(w, 32)
    assert codes.min() >= 0 and codes.max() <= 15 and codes.dtype == torch.int32
    err = (dequantize_int4(codes, scale, low) - w).abs().reshape(96, 4, 32)
    assert bool((err <= scale[..., None] / 2 + 1e-7).all())


@needs_int4
def test_int4_kernel_equals_the_dequantized_product():
    w, bias = _weight(), torch.randn(96) * 0.1
    lin = Int4Linear(w, bias, group=32)
    x = torch.randn(5, 128).to(torch.bfloat16)
    want = F.linear(x.float(), dequantize_int4(*quantize_int4(w, 32)), bias)
    assert torch.allclose(lin(x).float(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(InvalidArgumentError, match="multiple of the group"):
        Int4Linear(_weight(8, 40), None, group=32)


@needs_int8
def test_int8_kernel_is_close_to_the_float_product():
    w, bias = _weight(), torch.randn(96) * 0.1
    x = torch.randn(3, 128)
    got, want = Int8DynamicLinear(w, bias)(x), F.linear(x, w, bias)
    assert got.dtype == x.dtype
    assert (got - want).norm() / want.norm() < 0.05


def test_unknown_draft_weight_formats_are_refused():
    with pytest.raises(InvalidArgumentError, match="int8, int4"):
        check_draft_weights("int3")


@needs_int8
def test_draft_view_shares_the_model_and_quantizes_only_the_view():
    ex = LayerExecutor(tiny_model("llama"))
    view = ex.draft_view("int8")
    assert view is ex.draft_view("int8") and view.draft_weights == "int8"
    assert isinstance(view.layer_weights[0].qkv, Int8DynamicLinear)
    assert not isinstance(ex.layer_weights[0].qkv, Int8DynamicLinear) and ex.draft_weights is None
    assert view.embed_tokens is ex.embed_tokens and view.num_layers == ex.num_layers
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        full = ex.forward(ids, torch.arange(len(PROMPT))[None], ex.new_cache())
        draft = view.forward(ids, torch.arange(len(PROMPT))[None], view.new_cache())
    assert not torch.equal(full, draft)
    assert (full.argmax(-1) == draft.argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=needs_int8),
                                 pytest.param("int4", marks=needs_int4),
                                 pytest.param("w4a8", marks=needs_w4a8)])
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16)])
def test_drafting_on_quantized_weights_keeps_the_greedy_tokens(fmt, arch, dtype):
    engine = selfspec.from_pretrained_model(tiny_model(arch, dtype=dtype), tiny_tokenizer(),
                                            name=f"tiny-{arch}")
    prompt = "def add(a, b):\n"
    reference = engine.generate(prompt, max_new_tokens=24).token_ids
    drafted = 0
    for method, options in (("qspec", {"draft_weights": fmt}),
                            ("qspec", {"draft_weights": fmt, "exit_layer": 4, "confidence": 0}),
                            ("layerskip", {"draft_weights": fmt, "exit_layer": 4}),
                            ("dv", {"draft_weights": fmt, "exit_layer": 5}),
                            ("knapspec", {"draft_weights": fmt, "plan_budget": 1e9}),
                            ("clasp", {"draft_weights": fmt, "skip_ratio": 0.25})):
        result = engine.generate(prompt, method=method, max_new_tokens=24, **options)
        assert result.token_ids == reference, (method, options)
        drafted += result.stats.drafted
        if result.stats.drafted and ("exit_layer" in options or method == "qspec"):
            # the report's exit layer is the layers drafts really ran
            layers = options.get("exit_layer", engine.executor.num_layers)
            assert result.stats.mean_exit_layer == layers, (method, options)
    assert drafted > 0


class _SlowCopy:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        deadline = time.perf_counter() + self.seconds
        while time.perf_counter() < deadline:
            pass
        return x


@pytest.mark.parametrize("slower", ["int8", "int4", "w4a8"])
def test_auto_draft_weights_take_the_format_measured_faster(monkeypatch, slower):
    """Which kernel wins depends on the CPU: ``auto`` times every format and takes the
    fastest, whichever it is; with one kernel it takes that one untimed; with none it
    says to draft on the model's own weights."""
    monkeypatch.setattr(quant, "quantized_kernels_available", lambda fmt: True)
    monkeypatch.setattr(quant, "quantize_linear",
                        lambda w, b, fmt: _SlowCopy(0.004 if fmt == slower else 0.0005))
    weights = [(torch.zeros(4, 8), None)] * 2
    timing = fastest_format(weights, torch.float32, passes=2)
    assert timing.fastest != slower and timing.ms[slower] > timing.ms[timing.fastest]
    # auto times the 8- and 4-bit formats only: q3_k/q2_k are chosen by name.
    assert set(timing.ms) == set(quant.AUTO_DRAFT_FORMATS)
    monkeypatch.setattr(quant, "quantized_kernels_available", lambda fmt: fmt == slower)
    assert fastest_format(weights, torch.float32) == quant.FormatTiming(slower)
    monkeypatch.setattr(quant, "quantized_kernels_available", lambda fmt: False)
    with pytest.raises(InvalidArgumentError, match="model's own weights"):
        fastest_format(weights, torch.float32)


@pytest.mark.skipif(not any(map(quantized_kernels_available, ("int8", "int4"))),
                    reason="no quantized CPU kernel in this torch build")
def test_qspec_drafts_by_default_on_the_format_measured_here():
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    reference = engine.generate("def add(a, b):\n", max_new_tokens=16).token_ids
    result = engine.generate("def add(a, b):\n", method="qspec", max_new_tokens=16)
    assert result.token_ids == reference and result.stats.drafted > 0
    ex = engine.executor
    timing = ex.fastest_draft_format()
    assert ex.fastest_draft_format() is timing  # measured once
    assert ex.draft_view("auto") is ex.draft_view(timing.fastest)
    assert ex.draft_view("auto").draft_weights == timing.fastest


@needs_int8
def test_qspec_options_are_checked():
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    with pytest.raises(InvalidArgumentError, match="draft_weights"):
        engine.generate("a", method="qspec", max_new_tokens=2, draft_weights="int2")
    with pytest.raises(InvalidArgumentError, match="exit_layer"):
        engine.generate("a", method="qspec", max_new_tokens=2, exit_layer=7)


@needs_int8
def test_qspec_sampling_reproduces_the_target_distribution():
    """Total variation between sampled 3-token continuations and the exact distribution of
    the full model stays within a Hoeffding bound (as test_speculative's TV test)."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, PROMPT, config, 3)
    decoder = SpeculativeStep(quantized_drafter(executor, executor.draft_view("int8"),
                                                make_stop_rule("constant", draft_len=2)))
    n = 1200
    counts = Counter()
    runs = PrefillOnce(executor, PROMPT)  # each run exactly run_step's, one prefill shared
    for seed in range(n):
        state = runs.run(decoder, max_new_tokens=3,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(PROMPT):])] += 1
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
    assert VOCAB == 256


@pytest.mark.skipif(not any(map(quantized_kernels_available, ("int8", "int4"))),
                    reason="no quantized CPU kernel in this torch build")
def test_the_bench_header_names_the_draft_format_auto_measured(tmp_path):
    from selfspec.bench.pipeline import (
        BenchOptions,
        describe_draft_format,
        run_benchmark,
    )
    from selfspec.bench.spec import parse_methods
    from selfspec.data import Prompt
    from selfspec.executor.quant import FormatTiming

    assert describe_draft_format(None) == ""
    line = describe_draft_format(FormatTiming("int4", {"int8": 3.0, "int4": 2.0}))
    assert "measured int4 fastest" in line and "int8 3.00 ms, int4 2.00 ms" in line
    assert "only quantized kernel" in describe_draft_format(FormatTiming("int8"))
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    prompts = [Prompt("p0", "def f(x):\n    return x + x", chat=False)]
    report = run_benchmark(engine, parse_methods("ar,qspec"), prompts, BenchOptions(
        dataset="humaneval", max_new_tokens=6, out_dir=tmp_path / "out", bandwidth_mib=1,
        warmup_prompts=0, plots=False, score=False))
    fastest = engine.executor.measured_draft_format.fastest
    text = (tmp_path / "out" / "report.md").read_text()
    assert f"draft_weights=auto measured {fastest} fastest" in text
    assert report.info.draft_format in text
