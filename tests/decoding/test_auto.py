"""``auto`` (decoding/auto/step.py, methods/auto.py): whatever drafter it picks, the output is
the model's; it picks by predicted tokens per second and falls back to plain decoding."""

import math
from collections import Counter
from typing import ClassVar

import pytest
import torch

import selfspec
from selfspec.decoding.auto.step import AutoStep, ModelDrafter
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.drafting.skip_drafter import quantized_drafter
from selfspec.decoding.drafting.stop_rules import ConstantStopRule
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings
from selfspec.decoding.planning.tpt import AcceptanceEstimate, ForwardCosts
from selfspec.decoding.planning.tpt_stop import ConfidenceCalibration, TptStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel
from selfspec.executor.quant import quantized_kernels_available
from selfspec.methods.auto import CARRIED_PRIOR_WEIGHT, DRAFTER_PRIORS
from selfspec.methods.registry import METHODS

from tiny import (
    PrefillOnce,
    exact_prefix_distribution,
    global_rng,
    run_step,
    tiny_model,
    tiny_tokenizer,
)

needs_int8 = pytest.mark.skipif(not quantized_kernels_available("int8"),
                                reason="torch built without FBGEMM")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_keeps_the_greedy_tokens_with_every_drafter(arch, dtype):
    engine = selfspec.from_pretrained_model(tiny_model(arch, seed=5, dtype=dtype),
                                            tiny_tokenizer(), name=f"tiny-{arch}")
    drafters = "ngram,layerskip,dv" + (",qspec" if quantized_kernels_available("int8") else "")
    used = Counter()
    for prompt in ["abcabcabcab", "def f(x):\n    return x\ndef g(x):\n    return"]:
        reference = engine.generate(prompt, max_new_tokens=40).token_ids
        extra = ([{"drafters": "qspec", "draft_weights": "w4a8", "explore_every": 2}]
                 if quantized_kernels_available("w4a8") else [])
        for options in ({}, {"drafters": drafters, "explore_every": 2},
                        {"drafters": drafters, "explore_every": 2, "draft_stop": "plan"},
                        {"drafters": "ngram", "history": False}, *extra):
            result = engine.generate(prompt, method="auto", max_new_tokens=40, **options)
            assert result.token_ids == reference, options
            used.update({k: v.steps for k, v in result.stats.drafters.items()})
            assert sum(u.steps for u in result.stats.drafters.values()) == result.stats.steps
    # Model drafters are explored whatever they cost; the n-gram drafter runs only when the
    # latency model (measured on this machine, under whatever load) predicts it pays.
    assert {"layerskip", "dv"} <= set(used)


LATENCY = LatencyModel(6, 0.0, 1.0, 1.0, 1.0, verify_token_ms=0.05)


class FixedCosts(ForwardCosts):
    """Forward times from the latency model only (no wall-clock: deterministic choices)."""

    def observe(self, num_tokens, ms):
        pass


def test_auto_falls_back_to_ar_when_drafts_do_not_pay():
    """Verification of T tokens costing T forwards: no draft can pay, so every step after
    the first exploration is plain decoding."""
    executor = LayerExecutor(tiny_model("llama", seed=3))
    steep = LatencyModel(6, 0.0, 1.0, 1.0, 1.0, verify_token_ms=13.0)
    costs = FixedCosts(steep)
    ngram = NgramDrafter(executor, costs, NgramSettings(min_ngram=1))
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    state = run_step(executor, AutoStep(costs, ngram, []), prompt, max_new_tokens=20)
    assert set(state.stats.drafters) == {"ar"} and state.stats.drafted == 0
    reference = run_step(executor, ArStep(), prompt, max_new_tokens=20)
    assert state.tokens == reference.tokens


@needs_int8
def test_auto_explores_each_model_drafter_then_follows_the_prediction():
    executor = LayerExecutor(tiny_model("llama", seed=3))
    costs = FixedCosts(LATENCY)
    rule = ConstantStopRule(4)
    model = ModelDrafter("qspec", quantized_drafter(executor, executor.draft_view("int8"), rule),
                         AcceptanceEstimate(prior=0.7))
    step = AutoStep(costs, None, [model], explore_every=0)
    state = run_step(executor, step, [3, 4, 5], max_new_tokens=12)
    usage = state.stats.drafters
    assert usage["qspec"].steps >= 1  # explored at the first step
    for name, u in usage.items():  # predictions are recorded for every step
        assert u.predicted_ms > 0 and u.predicted_tokens >= u.steps, name


def test_auto_options_are_checked():
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    with pytest.raises(InvalidArgumentError, match="unknown drafter 'eagle'"):
        engine.generate("a", method="auto", max_new_tokens=2, drafters="ngram,eagle")
    with pytest.raises(InvalidArgumentError, match="repeats"):
        engine.generate("a", method="auto", max_new_tokens=2, drafters="ngram,ngram")
    with pytest.raises(InvalidArgumentError, match="dssd drafter needs calibrated heads"):
        engine.generate("a", method="auto", max_new_tokens=2, drafters="dssd")


class SharpCalibration(ConfidenceCalibration):
    """The tiny model's top-1 probabilities are all ~0.015: split them at their median, so
    that the stop point depends on the drafted token."""

    seen: ClassVar[Counter] = Counter()

    def rate(self, top1_prob):
        confident = top1_prob > 0.016
        self.seen[confident] += 1
        return 0.99 if confident else 0.3


@pytest.mark.parametrize("draft_stop", ["plan", "tpt"])
def test_auto_sampling_reproduces_the_target_distribution(draft_stop):
    """auto mixes drafters step by step; each is exact, so the mixture is: TV within a
    Hoeffding bound of the exact 3-token distribution. With ``tpt`` the draft length depends
    on the drafted tokens' confidence (a stopping time of the draft), which keeps it exact."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    prompt = run_step(executor, ArStep(), [3, 4], max_new_tokens=14).tokens
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, prompt, config, 3)
    n, steps = 1200, Counter()
    counts = Counter()
    runs = PrefillOnce(executor, prompt)  # each run exactly run_step's, one prefill shared
    for seed in range(n):
        costs = FixedCosts(LATENCY)
        models = []
        if quantized_kernels_available("int8"):
            rule = ConstantStopRule(2)
            acceptance = AcceptanceEstimate(prior=0.7)
            if draft_stop == "tpt":  # the second token is drafted only after a confident one
                rule = TptStopRule(rule, SharpCalibration(acceptance, "qspec"),
                                   lambda: 6.0, costs.forward_ms)
            models.append(ModelDrafter("qspec", quantized_drafter(
                executor, executor.draft_view("int8"), rule), acceptance,
                last_run=0))  # no forced exploration: the choice follows the prediction
        ngram = NgramDrafter(executor, costs, NgramSettings(min_ngram=1, min_share=0.0,
                                                            prior=0.9))
        state = runs.run(AutoStep(costs, ngram, models, explore_every=0),
                         max_new_tokens=3 if draft_stop == "plan" else 4,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(prompt):len(prompt) + 3])] += 1  # exact marginal
        steps.update({k: v.steps for k, v in state.stats.drafters.items()})
    assert steps["ngram"] > 0 and (steps["qspec"] > 0 or not models)
    if draft_stop == "tpt" and models:
        assert SharpCalibration.seen[True] and SharpCalibration.seen[False]
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"


def test_bench_gives_each_method_its_own_history_emptied_after_the_warmup():
    """ngram and auto must not draft from each other's output of the same prompt, nor from
    the warm-up's, so their timings measure one request each as a server would see it."""
    from selfspec.bench.harness import run_bench
    from selfspec.bench.runners import EncodedPrompt, RunSettings, make_runner
    from selfspec.bench.spec import parse_method

    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=5), tiny_tokenizer(),
                                            name="tiny")
    prompts = [EncodedPrompt("p0", [3, 4, 5, 3, 4]), EncodedPrompt("p1", [7, 8, 7, 8])]
    runners = [make_runner(engine, parse_method(m)) for m in ("ngram", "auto")]
    run = run_bench(runners, prompts, RunSettings(max_new_tokens=12), warmup_prompts=1,
                    warmup_tokens=4)
    assert not run.failures
    for runner in runners:
        texts = runner.memory.history.texts
        assert len(texts) == 2  # the two timed prompts, not the warm-up, not the other method
        assert [t[:len(p.ids)] for t, p in zip(texts, prompts, strict=True)] == [
            p.ids for p in prompts]
    assert len(engine.methods.history()) == 0
    assert {r.method: r.output.drafter_steps != {} for r in run.records} == {
        "ngram": False, "auto": True}


def test_generate_compare_ar_and_explain_print_the_speedup_and_the_drafters(tmp_path, capsys):
    from selfspec.cli import main

    from tiny import save_tiny

    model = save_tiny(tmp_path / "tiny", seed=5)
    code = main(["generate", "--model", str(model), "--dtype", "fp32", "--method", "auto",
                 "--compare-ar", "--explain", "--max-new-tokens", "24", "abcabcabcab"])
    err = capsys.readouterr().err
    assert code == 0
    assert "x ar (measured in this run); outputs identical" in err
    assert "tok/s predicted" in err and "steps:" in err


def test_report_shows_the_share_of_steps_each_drafter_ran():
    from selfspec.bench.metrics import MethodSummary
    from selfspec.bench.report import drafter_mix

    assert drafter_mix([MethodSummary("ar", True)]) == ""
    text = drafter_mix([MethodSummary("auto", True, drafter_steps={"ar": 30, "ngram": 10})])
    assert "| `auto` | 40 | ar: 75%, ngram: 25% |" in text


def test_bad_drafter_lists_are_refused_before_a_model_loads(capsys):
    from selfspec.cli import main

    assert main(["generate", "--model", "no-such-model", "--method", "auto", "--drafters",
                 "ngram,foo", "x"]) != 0
    assert "unknown drafter 'foo'" in capsys.readouterr().err  # not "no-such-model"
    assert main(["generate", "--method", "ngram", "--min-ngram", "5", "--max-ngram", "2",
                 "x"]) != 0
    assert "must not exceed max_ngram" in capsys.readouterr().err


@pytest.mark.skipif(not quantized_kernels_available("w4a8"), reason="no w4a8 kernel here")
def test_auto_on_a_4bit_model_drafts_no_quantized_copy_of_it():
    """On ``--dtype w4a8`` the quantized self-draft would be the model itself."""
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=5, dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-llama")
    engine.executor.set_bulk("auto", "w4a8")
    reference = engine.generate("abcabcabcab", max_new_tokens=24).token_ids
    result = engine.generate("abcabcabcab", method="auto", max_new_tokens=24, explore_every=2)
    assert result.token_ids == reference
    assert "qspec" not in result.stats.drafters
    assert engine.executor._weight_formats.draft_views == {}


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_auto_starts_a_quantized_drafter_at_its_share_of_the_weight_bytes(fmt):
    """Before qspec has run, its draft token is priced at the share of the weight bytes its
    copy reads (4-bit: about a quarter of bf16), not at half a token; its acceptance starts
    at the quantized copy's prior."""
    if not quantized_kernels_available(fmt):
        pytest.skip(f"{fmt} kernel unavailable")
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=5, dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-llama")
    step = METHODS["auto"].make_step(engine.methods, {"drafters": "qspec", "draft_weights": fmt})
    (model,) = step.models
    view = engine.executor.draft_view(fmt)
    expected = view.decode_weight_bytes() / engine.executor.decode_weight_bytes()
    assert model.draft_cost == pytest.approx(expected) and 0.1 < expected < 0.5
    assert model.acceptance.rate("qspec") == DRAFTER_PRIORS["qspec"]


def test_auto_starts_each_drafter_from_where_the_last_generation_left_it():
    """The engine keeps each model drafter's acceptance and draft cost at the end of a
    generation; the next generation starts from them (unless carry_estimates=false), and a
    bench runner's warm-up leaves nothing behind."""
    fmt = next((f for f in ("w4a8", "int8", "int4") if quantized_kernels_available(f)), None)
    if fmt is None:
        pytest.skip("no quantized kernel here")
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=5, dtype=torch.bfloat16),
                                            tiny_tokenizer(), name="tiny-llama")
    options = {"drafters": "qspec", "draft_weights": fmt}
    reference = engine.generate("abcabcabcab", max_new_tokens=24).token_ids
    first = engine.generate("abcabcabcab", method="auto", max_new_tokens=24, **options)
    (key, prior), = engine.methods.memory().drafters.items()
    assert key.startswith(f"qspec[{fmt}]@") and prior.draft_cost > 0
    (model,) = METHODS["auto"].make_step(engine.methods, options).models
    assert model.acceptance.rate("qspec") == prior.acceptance
    assert model.draft_cost == prior.draft_cost
    # ... and its acceptance per draft confidence, from which its drafts end
    assert isinstance(model.stop_rule, TptStopRule) and prior.by_confidence
    assert model.stop_rule.calibration.priors == dict(prior.by_confidence)
    # A carried estimate stands for a generation's observations: three rejected drafts in a
    # row do not collapse it as they do a fixed prior's two pseudo-observations.
    assert model.acceptance.prior_weight == CARRIED_PRIOR_WEIGHT > 2
    for _ in range(3):
        model.acceptance.update("qspec", drafted=12, accepted=0)
    assert model.acceptance.rate("qspec") > 0.6 * prior.acceptance
    (fresh,) = METHODS["auto"].make_step(engine.methods,
                                         {**options, "carry_estimates": False}).models
    assert fresh.acceptance.rate("qspec") == DRAFTER_PRIORS["qspec"]
    assert not fresh.stop_rule.calibration.priors
    (planned,) = METHODS["auto"].make_step(engine.methods,
                                           {**options, "draft_stop": "plan"}).models
    assert not isinstance(planned.stop_rule, TptStopRule)
    second = engine.generate("abcabcabcab", method="auto", max_new_tokens=24, **options)
    assert first.token_ids == second.token_ids == reference
