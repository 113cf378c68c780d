"""KnapSpec's parts on tiny random models: sub-layer skip drafts are lossless for every kind
of plan, the DP's read-only history pass reproduces the model, the latency model is measured
and cached, and the whole method gives autoregressive greedy output."""

import dataclasses

import pytest
import torch

from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import ConstantStopRule
from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import (
    VERIFY_TOKENS,
    LatencyModel,
    cached_latency,
    measure_latency,
)
from selfspec.executor.executor import SkipPlan
from selfspec.executor.quant import quantized_kernels_available

from tiny import (
    PrefillOnce,
    assert_speculated,
    damp_last_layer,
    global_rng,
    run_step,
    tiny_model,
)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12, 200, 31, 8, 77, 150, 9, 41, 2, 19, 88, 120]

PLANS = {
    "attention-only": SkipPlan(skip_attention=frozenset({1, 3, 4})),
    "mlp-only": SkipPlan(skip_mlp=frozenset({0, 2, 5})),
    "mixed": SkipPlan(skip_attention=frozenset({2, 5}), skip_mlp=frozenset({1, 2, 4})),
    "everything-but-one": SkipPlan(skip_attention=frozenset(range(1, 6)),
                                   skip_mlp=frozenset(range(6))),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=4).float())


@pytest.fixture(scope="module")
def ar_tokens(executor):
    return run_step(executor, ArStep(), PROMPT, max_new_tokens=40).tokens


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
def test_skip_plan_drafts_are_lossless(executor, ar_tokens, plan):
    drafter = SkipPlanDrafter(executor, PLANS[plan], ConstantStopRule(3))
    state = run_step(executor, SpeculativeStep(drafter), PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert state.stats.verifications > 0 and state.stats.drafted > 0
    skipped = len(PLANS[plan].skip_attention) + len(PLANS[plan].skip_mlp)
    # Draft tokens run 2L - skipped sub-layers; verification runs D + 1 full tokens.
    assert state.stats.sublayers == (state.stats.drafted * (12 - skipped)
                                     + 12 * (state.stats.drafted + state.stats.verifications))


@pytest.mark.parametrize("free", [False, True])
def test_read_only_history_pass_reproduces_the_model(executor, free):
    """The DP scores plans on committed tokens with read-only attention over a cache prefix,
    batched over budgets: the same hidden states as a fresh forward, and the cache untouched
    (also as a ``free`` block: bulk products and one attention call, as the DP runs them)."""
    ex = executor
    ids = torch.tensor([PROMPT])
    cache = ex.new_cache(capacity=64)
    positions = torch.arange(len(PROMPT)).unsqueeze(0)
    with torch.inference_mode():
        full = ex.run_layers(ex.embed(ids), positions, 0, ex.num_layers, cache)
        lengths = cache.lengths()
        start = 12
        seen = []
        score = ex.score_layers_free if free else ex.score_layers
        out = score(ex.embed(ids[:, start:]).expand(3, -1, -1),
                    positions[:, start:].expand(3, -1), 0, ex.num_layers, cache,
                    observe=lambda i, s, h: seen.append(h))
    assert cache.lengths() == lengths
    assert len(seen) == 2 * ex.num_layers
    for b in range(3):
        assert torch.allclose(out[b], full[0, start:], atol=1e-5)


def test_verification_time_follows_the_measured_table_between_its_points():
    """A forward of 1-16 tokens costing the same and 17 costing a second tile (AMX) is
    predicted so: linear between the measured sizes, ``verify_token_ms`` per token beyond
    them; the table survives the JSON file."""
    model = LatencyModel(2, 0.0, 1.0, 1.0, 1.0, verify_token_ms=0.5,
                         verify_points=((1, 0.0), (16, 1.5), (17, 6.0), (24, 6.5)))
    target = model.target_ms(10)
    assert model.verify_ms(10, 1) == target
    assert model.verify_ms(10, 11) == pytest.approx(target + 1.0)
    assert model.verify_ms(10, 17) - model.verify_ms(10, 16) == pytest.approx(4.5)
    assert model.verify_ms(10, 30) == pytest.approx(target + 6.5 + 6 * 0.5)
    assert LatencyModel.from_json(model.to_json()) == model
    linear = LatencyModel(2, 0.0, 1.0, 1.0, 1.0, verify_token_ms=0.5)  # no table: linear
    assert linear.verify_ms(10, 5) == pytest.approx(linear.target_ms(10) + 2.0)


def test_a_short_context_model_measures_its_latency_and_speculates():
    """A model of 64 positions cut every default context length to 63: the attention fit
    divided by zero, so knapspec, ngram and auto raised ZeroDivisionError on it."""
    import selfspec

    from tiny import tiny_tokenizer

    model = tiny_model("llama", max_position_embeddings=64)
    latency = measure_latency(LayerExecutor(model), repeats=2, verify_tokens=(1, 2, 4))
    assert latency.attn_base_ms > 0 and latency.attn_slope_ms >= 0
    engine = selfspec.from_pretrained_model(model, tiny_tokenizer(), name="tiny-short")
    reference = engine.generate([1, 2, 3, 1, 2, 3], "ar", max_new_tokens=8).token_ids
    for method in ("knapspec", "ngram", "auto"):
        assert engine.generate([1, 2, 3, 1, 2, 3], method, max_new_tokens=8).token_ids == reference


def test_latency_model_is_measured_and_cached(executor, tmp_path):
    model = measure_latency(executor, lengths=(8, 32, 64), repeats=3)
    assert model.mlp_ms > 0 and model.attn_base_ms > 0 and model.attn_slope_ms >= 0
    w_attn, w_mlp = model.weights(64)
    assert 1 <= w_attn <= 5 and 1 <= w_mlp <= 5 and min(w_attn, w_mlp) == 1
    plan = PLANS["mixed"]
    assert model.draft_ms(plan, 64) < model.draft_ms(SkipPlan(), 64)
    assert model.predict(plan, 64, 3) == pytest.approx(
        3 * model.draft_ms(plan, 64) + model.verify_ms(64, 4))
    assert model.verify_ms(64, 4) == pytest.approx(model.target_ms(64) + model.extra_tokens_ms(4))
    sizes = [t for t, _ in model.verify_points]
    extra = [ms for _, ms in model.verify_points]
    assert sizes[0] == 1 and extra[0] == 0 and extra == sorted(extra) and len(sizes) > 4
    assert sizes == list(VERIFY_TOKENS)  # the full table by default
    short = measure_latency(executor, lengths=(8, 32), repeats=3, verify_tokens=(1, 4, 16))
    assert [t for t, _ in short.verify_points] == [1, 4, 16]  # the suite's lighter ones
    for bad in ((), (2, 4), (1, 4, 4), (1, 8, 4)):
        with pytest.raises(ValueError, match="verify_tokens"):
            measure_latency(executor, lengths=(8, 32), verify_tokens=bad)
    assert model.verify_token_ms >= 0 and model.batched_row_ms > 0
    assert model.batched_call_ms >= 0 and model.batched_ms(256) > model.batched_ms(16)
    first = cached_latency(executor, tmp_path)
    assert cached_latency(executor, tmp_path) == first  # read back, not re-measured
    (path,) = (tmp_path / "latency").iterdir()
    path.write_text("{not json")
    assert cached_latency(executor, tmp_path).num_layers == executor.num_layers
    stale = dataclasses.replace(first, verify_token_ms=1e6)  # e.g. measured on a busy machine
    path.write_text(stale.to_json())
    assert cached_latency(executor, tmp_path) == stale
    assert cached_latency(executor, tmp_path, remeasure=True).verify_token_ms < 1e6
    assert LatencyModel.from_json(path.read_text()).verify_token_ms < 1e6  # replaced


def _latency(executor, attn=1.0, mlp=1.0):
    return LatencyModel(executor.num_layers, 0.0, attn, mlp, 0.5, key="hand-made")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def damped(request):
    """A tiny model with a damped last layer (plans pay and drafts are both accepted and
    rejected: on the plain random qwen2 model KnapSpec drafted nothing) and its ar tokens."""
    executor = LayerExecutor(damp_last_layer(tiny_model(request.param, seed=4).float(), 0.2))
    return executor, run_step(executor, ArStep(), PROMPT, max_new_tokens=40).tokens


@pytest.mark.parametrize("attn,mlp", [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0)])
def test_knapspec_greedy_equals_autoregressive(damped, attn, mlp):
    executor, ar_tokens = damped
    step = KnapSpecStep(executor, _latency(executor, attn, mlp),
                        KnapSpecConfig(reoptimize_every=6, min_history=8, tau=-1.0,
                                       confidence=0.01, plan_budget=1e9))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert_speculated(state.stats)
    assert step.history and step.history[0].step == 0
    unit = min(attn, mlp)
    assert all(r.weights == (round(attn / unit), round(mlp / unit)) for r in step.history)


def _identity_last_layer():
    """A tiny model whose last layer is the identity (skipping it is free and exact), and
    its greedy tokens."""
    model = tiny_model("llama", seed=4).float()
    layer = model.model.layers[-1]
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    ex = LayerExecutor(model)
    return ex, run_step(ex, ArStep(), PROMPT, max_new_tokens=30).tokens


def test_knapspec_drafts_when_a_plan_pays():
    """An identity last layer: skipping it is free and exact, so a plan pays."""
    ex, reference = _identity_last_layer()
    step = KnapSpecStep(ex, _latency(ex), KnapSpecConfig(reoptimize_every=8, confidence=0.01,
                                                          plan_budget=1e9))
    state = run_step(ex, step, PROMPT, max_new_tokens=30)
    assert state.tokens == reference
    choice = step.history[0].choice
    assert choice.candidate is not None and choice.alpha == 1.0 and choice.tpt > choice.ar_tpt
    assert state.stats.verifications > 0


def test_knapspec_falls_back_to_plain_decoding_when_no_plan_pays(executor, ar_tokens):
    # tau ~ 1 prunes every plan that changes the hidden states: only the full model is left.
    step = KnapSpecStep(executor, _latency(executor), KnapSpecConfig(reoptimize_every=8,
                                                                      tau=0.99999, plan_budget=1e9))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert all(r.choice.candidate is None for r in step.history)
    assert state.stats.verifications == 0


def test_knapspec_skips_planning_that_costs_more_than_its_budget(executor, ar_tokens):
    dear = LatencyModel(executor.num_layers, 0.0, 1.0, 1.0, 0.5, batched_row_ms=1.0, key="dear")
    step = KnapSpecStep(executor, dear, KnapSpecConfig(reoptimize_every=8))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens and state.stats.verifications == 0
    assert step.history and all(r.choice is None and r.predicted_ms > 0 for r in step.history)
    paper = KnapSpecStep(executor, dear, KnapSpecConfig(reoptimize_every=8, plan_budget=1e9))
    run_step(executor, paper, PROMPT, max_new_tokens=40)
    assert all(r.choice is not None for r in paper.history)


def test_the_dps_predicted_cost_counts_a_fixed_cost_per_sub_layer_call(executor):
    """On CPUs that emulate bf16 a DP call costs ~10 rows' time whatever its rows (the weights
    are cast each call): a DP of few rows is priced by its 2L calls, not its rows alone."""
    rows_only = LatencyModel(executor.num_layers, 0.0, 1.0, 1.0, 0.5, batched_row_ms=0.01,
                             key="rows")
    with_calls = dataclasses.replace(rows_only, batched_call_ms=2.0, key="calls")
    steps = [KnapSpecStep(executor, lat, KnapSpecConfig()) for lat in (rows_only, with_calls)]
    for step in steps:
        step._context_len = 64
    cheap, dear = (s._planning_ms(4, 1, 1, 16, recorded=True) for s in steps)
    assert dear == pytest.approx(cheap + 2 * executor.num_layers * 2.0)


def test_knapspec_cheapens_a_dp_that_does_not_fit_its_budget(executor, ar_tokens):
    """Between the exact DP and no planning: wider budget bins (then fewer history tokens)
    until the predicted cost fits plan_budget; the output stays the model's own."""
    costly = LatencyModel(executor.num_layers, 0.0, 1.0, 1.0, 0.5, batched_row_ms=0.07,
                          key="costly")
    step = KnapSpecStep(executor, costly, KnapSpecConfig(reoptimize_every=8, tau=-1.0,
                                                         confidence=0.01, plan_budget=0.5,
                                                         max_backoff=1))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert step.history and all(r.choice is not None for r in step.history)
    assert all(r.bin_width > 1 for r in step.history)
    allowed = 0.5 * 8 * costly.verify_ms(len(PROMPT), 1)
    assert all(r.predicted_ms <= allowed for r in step.history)


def test_knapspec_backs_off_while_no_plan_pays(executor, ar_tokens):
    """Re-optimisations that find nothing double the interval to the next (up to
    max_backoff × T); max_backoff=1 keeps the paper's fixed T."""
    backing = KnapSpecStep(executor, _latency(executor), KnapSpecConfig(
        reoptimize_every=2, tau=0.99999, max_backoff=8, plan_budget=1e9))
    state = run_step(executor, backing, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert [r.step for r in backing.history] == [0, 4, 12, 28]  # intervals 2T, 4T, 8T
    fixed = KnapSpecStep(executor, _latency(executor), KnapSpecConfig(
        reoptimize_every=8, tau=0.99999, max_backoff=1, plan_budget=1e9))
    run_step(executor, fixed, PROMPT, max_new_tokens=40)
    assert [r.step for r in fixed.history] == [0, 8, 16, 24, 32]


def test_plain_steps_out_of_the_next_histories_reach_are_not_recorded(executor, ar_tokens):
    """While no plan pays, only the plain steps within the recorder's reach of the next
    re-optimisation record their residual stream (the rest would never be read); that
    re-optimisation still plans on recorded history, and the tokens stay the model's."""
    config = KnapSpecConfig(reoptimize_every=32, tau=0.99999, max_backoff=1, min_history=4,
                            max_draft_len=1, plan_budget=1e9)
    step = KnapSpecStep(executor, _latency(executor), config)
    assert step._recorder.capacity == 10
    state = run_step(executor, step, PROMPT, max_new_tokens=20)
    assert state.tokens == ar_tokens[:len(state.tokens)]
    assert len(step._recorder._forwards) == 1  # the prefill only: steps 0-19 are > 10 ahead
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert [r.step for r in step.history] == [0, 32]
    assert all(r.recorded for r in step.history)


def test_a_latency_measurement_is_kept_per_cpu_kernel_level(monkeypatch):
    # Cloud VMs call an AVX2-only CPU and one with native bf16 both "AMD EPYC"; a measurement
    # from one made `auto` mispredict `ar` by 30% on the other (0.76x ar instead of ~1.0x).
    import dataclasses

    from selfspec.executor import cost_model
    from selfspec.executor.cpu import detect_cpu

    ex = LayerExecutor(tiny_model("llama", seed=4).float())
    here = detect_cpu()
    keys = set()
    for aten, native, onednn in (("AVX2", False, ""), ("AVX512", True, ""),
                                 ("AVX2", False, "AVX2")):
        info = dataclasses.replace(here, aten_capability=aten, native_bf16=native,
                                   onednn_max_isa=onednn)
        monkeypatch.setattr(cost_model, "detect_cpu", lambda info=info: info)
        keys.add(cost_model.machine_key(ex))
    assert len(keys) == 3


def test_models_of_other_shapes_under_one_name_get_their_own_latency_key():
    """Two models loaded under one name read each other's timings when the key held the name
    only (in the test suite, tiny models of 6 and 8 layers are all named ``model``)."""
    from selfspec.executor import cost_model

    six = LayerExecutor(tiny_model("qwen2", seed=5))
    eight = LayerExecutor(tiny_model("qwen2", seed=5, num_layers=8))
    other_seed = LayerExecutor(tiny_model("qwen2", seed=6))
    assert six.name == eight.name
    assert cost_model.machine_key(six) != cost_model.machine_key(eight)
    assert cost_model.machine_key(six) == cost_model.machine_key(other_seed)  # weights: same cost


@pytest.mark.skipif(not quantized_kernels_available("int4"), reason="no CPU int4 kernel here")
def test_knapspec_on_int4_draft_weights_drafts_on_them_and_stays_lossless(executor, ar_tokens):
    """draft_weights: drafts run on the int4 copies and cost what the view's latency model
    says (it sets KnapSpec's integer weights); the model's own weights verify."""
    view = executor.draft_view("int4")
    calls = []
    run_layers = view.run_layers

    def count_run_layers(*args, **kwargs):
        calls.append(kwargs.get("write_cache", True))
        return run_layers(*args, **kwargs)

    cheap = LatencyModel(executor.num_layers, 0.0, 0.1, 0.1, 0.05, key="cheap-int4")
    step = KnapSpecStep(executor, _latency(executor, 3.0, 1.0), KnapSpecConfig(
        reoptimize_every=8, tau=-1.0, confidence=0.01, plan_budget=1e9), view, cheap)
    view.run_layers = count_run_layers
    try:
        state = run_step(executor, step, PROMPT, max_new_tokens=40)
    finally:
        del view.run_layers
    assert state.tokens == ar_tokens
    assert step.drafter.executor is view and step.drafter.verifier is executor
    assert any(r.choice.candidate is not None for r in step.history)
    assert state.stats.drafted > 0 and len(calls) >= state.stats.drafted
    # The view's latencies give the integer weights (the model's would give (3, 1)), and a
    # cheap draft makes a plan pay.
    assert all(r.weights == (1, 1) for r in step.history)
    with pytest.raises(ValueError, match="latency"):
        KnapSpecStep(executor, _latency(executor), draft=view)


def test_a_draft_view_has_its_own_latency_key():
    from selfspec.executor import cost_model

    ex = LayerExecutor(tiny_model("llama", seed=4).float())
    if not quantized_kernels_available("int8"):
        pytest.skip("no int8 kernel here")
    assert cost_model.machine_key(ex.draft_view("int8")) != cost_model.machine_key(ex)
    assert "-draftint8-" in cost_model.machine_key(ex.draft_view("int8"))


def _recorded_vs_read(ex, step, recorder, r):
    """After a generation with ``step`` (recording into ``recorder``), the recorded history of
    the last ``r`` positions against the read-only pass's."""
    from selfspec.decoding.core import loop
    from selfspec.decoding.core.history import read_history
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    state = DecodeState(ex, PROMPT, DecodeOptions(max_new_tokens=30))
    with torch.inference_mode():
        loop.run(state, step)
        recorded = recorder.history(ex, state, r)
        read = read_history(ex, state, r)
    return state, recorded, read


@pytest.mark.parametrize("kind", ["ar", "verification"])
def test_recorded_history_equals_the_read_only_pass(executor, ar_tokens, kind):
    """The residual stream kept from the step's own forwards (one-token steps, or
    verifications whose rejected positions are overwritten) is the read-only pass's."""
    from selfspec.decoding.core.history import ResidualRecorder

    recorder = ResidualRecorder(64)
    if kind == "ar":
        step = ArStep(recorder)
    else:  # a poor draft: many rejected positions must not leak into the history
        drafter = SkipPlanDrafter(executor, PLANS["everything-but-one"], ConstantStopRule(4),
                                  recorder=recorder)
        step = SpeculativeStep(drafter)
    state, recorded, read = _recorded_vs_read(executor, step, recorder, 24)
    assert state.tokens[:len(ar_tokens)] == ar_tokens[:state.seq_len]
    if kind == "verification":
        assert state.stats.drafted > state.stats.accepted  # rejections happened
    assert recorded is not None and len(recorded) == 24
    assert recorder.covered(state, executor.num_layers) >= 24
    assert torch.equal(recorded.tokens, read.tokens)
    assert torch.equal(recorded.positions, read.positions)
    assert len(recorded.states) == len(read.states) == 2 * executor.num_layers + 1
    for a, b in zip(recorded.states, read.states):
        assert torch.allclose(a, b, atol=1e-5)
    # Beyond what was generated the recording stops: the prompt was never recorded.
    assert recorder.history(executor, state, state.seq_len - 1) is None


def test_a_recorder_keeps_only_its_capacity(executor):
    from selfspec.decoding.core.history import ResidualRecorder

    recorder = ResidualRecorder(8)
    state, recorded, _ = _recorded_vs_read(executor, ArStep(recorder), recorder, 8)
    # The newest forward and the 8 positions before it.
    assert recorded is not None and recorder.covered(state, executor.num_layers) == 9
    assert recorder.history(executor, state, 10) is None


def test_knapspec_plans_on_recorded_history_and_waits_for_it_when_only_the_pass_is_too_dear(
        executor, ar_tokens):
    """A read-only pass over the history that alone breaks the planning budget: the prefill's
    recording makes the first re-optimisation (on the prompt's end) pass-free; without it the
    step decodes on, recording, and re-optimises once its own forwards cover the tokens
    (record_history=False: never plans)."""
    pass_dear = LatencyModel(executor.num_layers, 0.0, 1.0, 1.0, 1e-3, batched_row_ms=1e-5,
                             verify_token_ms=1e3, key="pass-dear")
    config = KnapSpecConfig(reoptimize_every=8, min_history=8, tau=-1.0, max_backoff=1)
    step = KnapSpecStep(executor, pass_dear, config)
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert step.history and step.history[0].step == 0
    assert all(r.recorded and r.choice is not None for r in step.history)
    assert all(r.predicted_ms < 1e3 for r in step.history)
    unrecorded_prompt = KnapSpecStep(executor, pass_dear, config)
    unrecorded_prompt.prefill_observer = lambda state: None  # e.g. a batched server's prefill
    assert run_step(executor, unrecorded_prompt, PROMPT, max_new_tokens=40).tokens == ar_tokens
    assert unrecorded_prompt.history[0].step == 8  # waited 8 one-token steps
    assert all(r.recorded and r.choice is not None for r in unrecorded_prompt.history)
    never = KnapSpecStep(executor, pass_dear, dataclasses.replace(config, record_history=False))
    assert run_step(executor, never, PROMPT, max_new_tokens=40).tokens == ar_tokens
    assert all(r.choice is None and not r.recorded for r in never.history)


def test_a_recorded_prefill_keeps_the_prompts_end(executor):
    """The prefill's residual stream, cut to what the recorder reaches, is the read-only
    pass's on the prompt's end; a recorder attached to a new generation forgets the old."""
    from selfspec.decoding.core.history import ResidualRecorder, read_history
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    recorder = ResidualRecorder(8)
    state = DecodeState(executor, PROMPT, DecodeOptions(max_new_tokens=4))
    with torch.inference_mode():
        recorder.attach(state)
        state.prefill(recorder.observer(state.tokens, 0))
        state.commit([1])
        recorded = recorder.history(executor, state, 9)
        read = read_history(executor, state, 9)
    assert recorder.covered(state, executor.num_layers) == 9  # positions 11..19 of 20
    assert torch.equal(recorded.tokens, read.tokens)
    for a, b in zip(recorded.states, read.states):
        assert torch.allclose(a, b, atol=1e-5)
        assert a.untyped_storage().nbytes() < 20 * a.shape[-1] * a.element_size()  # not kept whole
    recorder.attach(state)  # the same generation: kept
    assert recorder.covered(state, executor.num_layers) == 9
    recorder.attach(DecodeState(executor, PROMPT, DecodeOptions(max_new_tokens=4)))
    assert recorder.covered(state, executor.num_layers) == 0


def test_alpha_over_a_shortlist_never_under_estimates_and_is_exact_over_the_vocabulary(executor):
    """α̂ (eq. 9) scored over the union of the full model's top-k tokens: a candidate whose
    prediction is right over the whole vocabulary is right over the shortlist (the label is
    in it), so the estimate can only rise; with every token listed it is exact."""
    from selfspec.decoding.core.history import read_history
    from selfspec.decoding.core.state import DecodeOptions, DecodeState
    from selfspec.decoding.planning.knapsack import Candidate

    state = DecodeState(executor, PROMPT, DecodeOptions(max_new_tokens=8))
    torch.manual_seed(0)
    with torch.inference_mode():
        state.prefill()
        history = read_history(executor, state, 12)
        final = history.states[-1]
        candidates = [Candidate(0, frozenset(), frozenset(), 1.0, final)] + [
            Candidate(j, frozenset(), frozenset(), 0.5, final + s * torch.randn_like(final))
            for j, s in enumerate((0.5, 1.0, 2.0, 4.0), 1)]

        def alphas(k):
            step = KnapSpecStep(executor, _latency(executor), KnapSpecConfig(alpha_vocab=k))
            return step._alphas(candidates, history)
        exact = alphas(0)
        assert exact[0] == 1.0  # the full model predicts its own labels
        for k in (1, 4, 64):
            estimate = alphas(k)
            assert all(e >= x for e, x in zip(estimate, exact))
        everything = torch.arange(executor.vocab_size)
        history.shortlist = lambda ex, k: everything
        assert alphas(16) == exact
    with pytest.raises(ValueError, match="alpha_vocab"):
        KnapSpecStep(executor, _latency(executor), KnapSpecConfig(alpha_vocab=65))


def test_knapspec_sampling_reproduces_the_target_distribution(draft_stop="confidence"):
    """Sampling through KnapSpec (planning on recorded history, a plan that drafts) commits
    the target's distribution: total variation of the first three tokens against the exact
    distribution under the Bretagnolle–Huber–Carol bound (failure probability 1e-6). The
    drafts here are close to the target (98-100% accepted), so this checks that planning and
    recording leave sampling intact; the acceptance rule itself is tested on arbitrary
    proposals in test_verification and test_speculative. (A second case with
    ``draft_stop="tpt"`` gave the very same counts: it tested nothing more.)"""
    import math
    from collections import Counter

    from selfspec.decoding.core.sampling import SamplingConfig

    from tiny import exact_prefix_distribution

    torch.manual_seed(0)
    model = tiny_model("llama", seed=8).float()
    with torch.no_grad():  # a near-identity last layer: skipping it drafts well, not exactly
        model.model.layers[-1].self_attn.o_proj.weight.mul_(0.05)
        model.model.layers[-1].mlp.down_proj.weight.mul_(0.05)
    ex = LayerExecutor(model)
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(ex, PROMPT, config, 3)
    step = KnapSpecStep(ex, _latency(ex), KnapSpecConfig(min_history=8, confidence=0.01,
                                                          plan_budget=1e9, max_draft_len=3,
                                                          draft_stop=draft_stop))
    n, counts, drafted = 1000, Counter(), 0
    runs = PrefillOnce(ex, PROMPT)  # each run exactly run_step's, one prefill shared
    for seed in range(n):
        state = runs.run(step, max_new_tokens=3,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(PROMPT):])] += 1
        drafted += state.stats.drafted
    assert step.history[0].recorded and drafted > n // 2
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"


def test_knapspec_tpt_draft_stop_keeps_the_greedy_tokens_and_calibrates_the_plan(damped):
    """draft_stop="tpt": drafts end where the predicted tokens/s peak; outputs stay the
    autoregressive ones, and the calibration starts from the chosen plan's α̂ (on the damped
    model a plan is chosen: on the plain one none was, and the check never ran)."""
    from selfspec.decoding.planning.tpt_stop import TptStopRule

    executor, ar_tokens = damped
    step = KnapSpecStep(executor, _latency(executor),
                        KnapSpecConfig(reoptimize_every=6, min_history=8, tau=-1.0,
                                       plan_budget=1e9, draft_stop="tpt"))
    assert isinstance(step.drafter.stop_rule, TptStopRule)
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    chosen = [r.choice for r in step.history if r.choice and r.choice.candidate is not None]
    assert chosen
    assert_speculated(state.stats)
    # the calibration's prior is the last new plan's α̂ (updated by its drafts)
    assert step._acceptance is not None and step._acceptance.prior in {c.alpha for c in chosen}


def test_knapspec_tpt_draft_stop_drafts_long_when_the_plan_is_exact():
    """An identity last layer (a free, exact plan): the calibrated stop lets drafts run to
    max_draft_len, where the paper's 0.7 rule stops at the tiny model's low confidences."""
    ex, reference = _identity_last_layer()
    drafted = {}
    for stop in ("confidence", "tpt"):
        step = KnapSpecStep(ex, _latency(ex), KnapSpecConfig(reoptimize_every=8, plan_budget=1e9,
                                                              max_draft_len=6, draft_stop=stop))
        state = run_step(ex, step, PROMPT, max_new_tokens=30)
        assert state.tokens == reference
        drafted[stop] = state.stats.drafted / max(state.stats.verifications, 1)
    assert drafted["tpt"] > drafted["confidence"]
    assert drafted["tpt"] >= 4


def test_knapspec_rejects_an_unknown_draft_stop(executor):
    with pytest.raises(ValueError, match="draft_stop"):
        KnapSpecStep(executor, _latency(executor), KnapSpecConfig(draft_stop="never"))
