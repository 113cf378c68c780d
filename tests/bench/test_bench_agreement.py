"""Teacher-forced greedy agreement (selfspec.bench.agreement): what a row's model picks at
each position of ``ar``'s output, given ``ar``'s earlier tokens."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.bench.agreement import forced_greedy
from selfspec.bench.harness import run_bench
from selfspec.bench.metrics import summarize
from selfspec.bench.report import markdown_table
from selfspec.bench.runners import EncodedPrompt, RunSettings, make_runner
from selfspec.bench.spec import parse_methods
from selfspec.executor.quant import quantized_kernels_available

from tiny import tiny_model, tiny_tokenizer

PROMPTS = ("def add(a, b):\n", "x = [1, 2, 3]\nfor i in x:\n", "Hello, world!")


def _engine():
    return selfspec.from_pretrained_model(tiny_model("llama", seed=5, dtype=torch.bfloat16),
                                          tiny_tokenizer(), name="tiny-llama")


def test_forcing_a_models_own_greedy_output_agrees_everywhere():
    """Forced blocks are verification blocks: on its own output a model picks every token
    (a longer output than one block, so several blocks run)."""
    engine = _engine()
    engine.executor.row_attention_max = 8
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        tokens = engine.generate(ids, max_new_tokens=30).token_ids
        assert forced_greedy(engine.executor, ids, tokens) == tokens


def _kernel():
    fmt = next((f for f in ("w4a8", "int8", "int4") if quantized_kernels_available(f)), None)
    if fmt is None:
        pytest.skip("no quantized kernel here")
    return fmt


def test_a_row_on_another_kernel_reports_its_teacher_forced_agreement_with_ar():
    """Each forced choice is the token greedy decoding on that kernel picks after ar's
    prefix (checked position by position with one-token generations); the row's summary pools
    the matches over prompts, and the report shows it."""
    fmt = _kernel()
    engine = _engine()
    labels = f"ar,ar:decode_kernel={fmt},ngram"
    runners = [make_runner(engine, c) for c in parse_methods(labels)]
    prompts = [EncodedPrompt(f"p{i}", engine.encode(p)) for i, p in enumerate(PROMPTS)]
    run = run_bench(runners, prompts, RunSettings(max_new_tokens=16), warmup_prompts=0)
    row = f"ar:decode_kernel={fmt}"
    matches = total = 0
    for prompt in prompts:
        (ar,) = [r for r in run.records if r.method == "ar" and r.prompt_id == prompt.id]
        (rec,) = [r for r in run.records if r.method == row and r.prompt_id == prompt.id]
        expected = 0
        previous = engine.executor.set_decode_kernel(fmt)
        try:
            for i, token in enumerate(ar.output.token_ids):
                pick = engine.generate(prompt.ids + ar.output.token_ids[:i], max_new_tokens=1)
                expected += pick.token_ids == [token]
        finally:
            engine.executor.set_decode_kernel(previous)
        assert (rec.forced_matches, rec.forced_tokens) == (expected, len(ar.output.token_ids))
        matches += expected
        total += len(ar.output.token_ids)
    assert all(r.forced_tokens is None for r in run.records if r.method != row)
    summaries = {s.method: s for s in summarize(run, greedy=True)}
    assert summaries[row].forced_agreement == pytest.approx(matches / total)
    assert summaries["ar"].forced_agreement is None and summaries["ngram"].forced_agreement is None
    assert "forced = ar" in markdown_table(list(summaries.values()))


def test_sampling_runs_force_nothing():
    fmt = _kernel()
    engine = _engine()
    runners = [make_runner(engine, c) for c in parse_methods(f"ar,ar:decode_kernel={fmt}")]
    prompts = [EncodedPrompt("p0", engine.encode(PROMPTS[0]))]
    run = run_bench(runners, prompts, RunSettings(max_new_tokens=8, temperature=1.0, seed=1),
                    warmup_prompts=0)
    assert all(r.forced_tokens is None for r in run.records)
