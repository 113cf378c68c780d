"""DEL on hand-built acceptance rates and tiny random models: the TPL grid search picks the
argmax of eq. 2 (or plain decoding), the exit layer moves only where it may, and the whole
method gives autoregressive greedy output whatever it chooses, and valid samples."""

import itertools
import math

import pytest
import torch

from selfspec.api import from_pretrained_model
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.drafting.exits import FixedExit
from selfspec.decoding.knapspec.dynamic_exit import (
    DELConfig,
    DELStep,
    ExitChoice,
    candidate_layers,
    choose_exit,
)
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor

from tiny import VOCAB, assert_speculated, damp_last_layer, run_step, tiny_model, tiny_tokenizer

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12, 200, 31, 8, 77, 150, 9, 41, 2, 19, 88, 120]
NEW_TOKENS = 30


def _tpl(alpha, gamma, layer, num_layers):
    """Eq. 2 written out: expected tokens per step over the layers run."""
    expected = sum(alpha ** i for i in range(gamma + 1))
    return expected / (gamma * layer + num_layers)


# ------------------------------------------------------------------ choose_exit
@pytest.mark.parametrize("seed", range(5))
def test_choose_exit_is_the_argmax_of_tpl(seed):
    generator = torch.Generator().manual_seed(seed)
    num_layers = 30
    alphas = {layer: float(a) for layer, a in
              zip(range(1, num_layers), torch.rand(num_layers - 1, generator=generator) ** 0.3)}
    choice = choose_exit(alphas, num_layers, max_draft_len=10)
    brute = max((_tpl(a, g, layer, num_layers), layer, g)
                for (layer, a), g in itertools.product(alphas.items(), range(1, 11)))
    if brute[0] > 1 / num_layers:
        assert (choice.exit_layer, choice.draft_len) == (brute[1], brute[2])
        assert choice.tpl == pytest.approx(brute[0])
        assert choice.alpha == alphas[brute[1]]
    else:
        assert choice.exit_layer is None
    assert choice.ar_tpl == pytest.approx(1 / num_layers)


def test_choose_exit_trades_depth_for_acceptance():
    # A shallow exit that is often wrong loses to a deeper one that is nearly always right.
    # At 0.95, the draft length balances the geometric tail against γ·ℓ: γ = 5, not the cap.
    choice = choose_exit({4: 0.1, 12: 0.95}, 24, max_draft_len=10)
    assert (choice.exit_layer, choice.draft_len) == (12, 5)
    assert choice.tpl == pytest.approx(max(_tpl(0.95, g, 12, 24) for g in range(1, 11)))


def test_choose_exit_falls_back_to_plain_decoding_when_nothing_is_accepted():
    choice = choose_exit({layer: 0.0 for layer in range(1, 12)}, 12, max_draft_len=10)
    assert choice == ExitChoice(None, 0, 0.0, 1 / 12, 1 / 12)
    assert choose_exit({}, 12, 10).exit_layer is None


def test_choose_exit_drafts_longest_at_the_cheapest_exact_layer():
    alphas = {2: 0.1, 5: 1.0, 7: 0.9, 9: 1.0, 11: 1.0}
    choice = choose_exit(alphas, 12, max_draft_len=8)
    assert (choice.exit_layer, choice.draft_len, choice.alpha) == (5, 8, 1.0)
    assert choice.tpl == pytest.approx(9 / (8 * 5 + 12))


def test_choose_exit_refuses_bad_input():
    with pytest.raises(ValueError, match="outside"):
        choose_exit({12: 0.5}, 12, 4)
    with pytest.raises(ValueError, match="alpha"):
        choose_exit({3: 1.5}, 12, 4)
    with pytest.raises(ValueError, match="max_draft_len"):
        choose_exit({3: 0.5}, 12, 0)


def test_candidate_layers_are_spread_over_the_depth():
    layers = candidate_layers(30, 8)
    assert len(layers) == 8 and layers == sorted(set(layers))
    assert layers[-1] == 29 and layers[0] >= 1
    gaps = [b - a for a, b in zip(layers, layers[1:])]
    assert max(gaps) - min(gaps) <= 1
    assert candidate_layers(30, 0) == list(range(1, 30))
    assert candidate_layers(6, 8) == candidate_layers(6, 5) == [1, 2, 3, 4, 5]
    assert candidate_layers(6, 1) == [5]


# ------------------------------------------------------------------ the exit layer setter
def test_fixed_exit_layer_moves_only_within_range_and_without_trained_heads():
    ex = LayerExecutor(tiny_model("llama", seed=4))
    policy = FixedExit(ex, 3)
    policy.exit_layer = 5
    assert policy.exit_layer == 5
    with pytest.raises(InvalidArgumentError, match=r"\[1, 5\]"):
        policy.exit_layer = 6
    with pytest.raises(InvalidArgumentError, match=r"\[1, 5\]"):
        policy.exit_layer = 0
    trained = FixedExit(ex, 3, head=lambda hidden, vocab_rows=None: hidden)
    with pytest.raises(InvalidArgumentError, match="trained for layer 3"):
        trained.exit_layer = 4
    assert trained.exit_layer == 3


def test_del_refuses_bad_settings():
    ex = LayerExecutor(tiny_model("llama", seed=4))
    for bad in (dict(refresh_every=0), dict(history_steps=0), dict(min_history=0),
                dict(num_candidates=-1), dict(smoothing=1.0), dict(confidence=1.0),
                dict(max_draft_len=0)):
        with pytest.raises(InvalidArgumentError):
            DELStep(ex, DELConfig(**bad))
    with pytest.raises(InvalidArgumentError, match="at least 2 layers"):
        DELStep(LayerExecutor(tiny_model("llama", seed=4, num_layers=1)))


# ------------------------------------------------------------------ lossless decoding
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    """A tiny random model with a damped last layer: DEL drafts, accepts and rejects on it
    (on a plain random model it chose plain decoding and the parity below proved nothing)."""
    return LayerExecutor(damp_last_layer(tiny_model(request.param, seed=4).float()))


@pytest.fixture(scope="module")
def ar_tokens(executor):
    return run_step(executor, ArStep(), PROMPT, max_new_tokens=NEW_TOKENS).tokens


@pytest.mark.parametrize("config", [DELConfig(), DELConfig(refresh_every=2, num_candidates=0,
                                                           smoothing=0.0, confidence=0.01)],
                         ids=["defaults", "every-layer-often"])
def test_del_greedy_equals_autoregressive(executor, ar_tokens, config):
    """Whatever DEL chooses, the output is the model's, over drafts both accepted and
    rejected; every refresh is recorded and charged to draft time."""
    step = DELStep(executor, config)
    state = run_step(executor, step, PROMPT, max_new_tokens=NEW_TOKENS)
    assert state.tokens == ar_tokens
    assert_speculated(state.stats)
    assert step.history and step.history[0].step == 0
    assert [d.step for d in step.history] == list(range(0, state.stats.steps,
                                                        config.refresh_every))
    layers = candidate_layers(executor.num_layers, config.num_candidates)
    assert all(sorted(d.alphas) == layers for d in step.history)
    assert state.stats.draft_ms >= sum(d.ms for d in step.history)
    plans = state.stats.plans  # the generic decision records the benchmark reports
    assert [p.step for p in plans] == [d.step for d in step.history]
    assert all(p.exit_layer == d.choice.exit_layer and p.draft_len == d.choice.draft_len
               for p, d in zip(plans, step.history))


def _identity_last_layer(arch, scale=0.0):
    """A tiny model whose last layer adds nothing (``scale`` 0: exiting before it is exact,
    α = 1) or little (its output projections scaled by ``scale``)."""
    return LayerExecutor(damp_last_layer(tiny_model(arch, seed=4).float(), scale))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_del_drafts_when_an_exit_pays(arch):
    # nearly the identity: the first window's exit before it agrees on every token (α = 1),
    # later drafts are sometimes rejected (with the exact identity qwen2 accepted 24 of 24)
    ex = _identity_last_layer(arch, scale=0.05)
    reference = run_step(ex, ArStep(), PROMPT, max_new_tokens=NEW_TOKENS).tokens
    step = DELStep(ex, DELConfig(max_draft_len=6, confidence=0.01))
    state = run_step(ex, step, PROMPT, max_new_tokens=NEW_TOKENS)
    assert state.tokens == reference
    choice = step.history[0].choice
    last = ex.num_layers - 1
    assert step.history[0].alphas[last] == 1.0
    assert choice.exit_layer is not None and choice.tpl > choice.ar_tpl
    assert step.drafter.exit_layer == step.history[-1].choice.exit_layer
    assert state.stats.verifications > 0
    assert_speculated(state.stats)
    assert 1 <= state.stats.mean_exit_layer <= last
    record = state.stats.plans[0]
    assert record.exit_layer == choice.exit_layer
    assert record.skipped_attention == record.skipped_mlp == ex.num_layers - choice.exit_layer
    # Re-running the same step starts afresh (start() resets the history and estimates).
    again = run_step(ex, step, PROMPT, max_new_tokens=NEW_TOKENS)
    assert again.tokens == reference and step.history[0].step == 0


def test_alphas_are_a_moving_average_of_window_accuracies(executor):
    smoothing = 0.5
    step = DELStep(executor, DELConfig(refresh_every=2, smoothing=smoothing))
    run_step(executor, step, PROMPT, max_new_tokens=12)
    assert len(step.history) >= 3
    for before, after in zip(step.history, step.history[1:]):
        r = after.history_tokens
        for layer, alpha in after.alphas.items():
            window = (alpha - smoothing * before.alphas[layer]) / (1 - smoothing)
            hits = window * r  # this refresh's agreements: an integer in [0, r]
            assert -1e-6 <= hits <= r + 1e-6 and math.isclose(hits, round(hits), abs_tol=1e-6)


def test_del_sampling_gives_valid_reproducible_tokens():
    ex = _identity_last_layer("llama")
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, seed=11)
    step = DELStep(ex, DELConfig(max_draft_len=4, confidence=0.01))
    state = run_step(ex, step, PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling)
    new = state.tokens[len(PROMPT):]
    assert len(new) == NEW_TOKENS and all(0 <= t < VOCAB for t in new)
    assert state.stats.verifications > 0
    again = run_step(ex, step, PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling)
    assert again.tokens == state.tokens


def test_del_through_the_engine():
    # a damped last layer: on tiny_engine()'s plain model DEL chose plain decoding throughout
    model = damp_last_layer(tiny_model("llama", seed=4, num_layers=6), 0.2)
    engine = from_pretrained_model(model, tiny_tokenizer(), "tiny-llama")
    reference = engine.generate("def add(a, b):", max_new_tokens=24).token_ids
    result = engine.generate("def add(a, b):", method="del", max_new_tokens=24,
                             refresh_every=2, num_candidates=3)
    assert result.token_ids == reference
    assert_speculated(result.stats)
