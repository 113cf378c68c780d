"""Self-speculative methods are lossless: greedy output == autoregressive greedy output;
sampling reproduces the target distribution; verification reuses the drafting work."""

import math
from collections import Counter

import pytest
import torch

from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.methods.registry import build_step

from tiny import PrefillOnce, exact_prefix_distribution, global_rng, run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _generate(executor, decoder, prompt=PROMPT, **options):
    return run_step(executor, decoder, prompt, **options)


def _ar_tokens(executor, **options):
    return _generate(executor, build_step("ar", executor, {}), **options).tokens


def _identity_last_layer(model):
    """Zero the last layer's output projections: it becomes the identity, so an exit at
    L-1 predicts exactly what the full model does and every draft token is accepted."""
    layer = model.model.layers[-1]
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    return model


CASES = [
    ("layerskip", {"exit_layer": 1, "draft_len": 1}),
    ("layerskip", {"exit_layer": 3, "draft_len": 4}),
    ("layerskip", {"exit_layer": 5, "draft_len": 7}),
    ("dv", {"exit_layer": 2}),
    ("dv", {"exit_layer": 4, "gamma": 0.3, "adaptive": False}),
    ("adaspeed", {"exit_layer": 3, "gamma": 0.5}),
    ("adaspeed", {"exit_layer": 5, "gamma": 0.05, "max_draft_len": 12}),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,options", CASES)
def test_greedy_equals_autoregressive(arch, method, options):
    executor = LayerExecutor(tiny_model(arch, seed=3))
    reference = _ar_tokens(executor, max_new_tokens=48)
    state = _generate(executor, build_step(method, executor, options), max_new_tokens=48)
    assert state.tokens == reference
    assert state.stats.verifications > 0 and state.stats.drafted > 0


def test_fully_accepted_drafts_with_bonus_tokens():
    executor = LayerExecutor(_identity_last_layer(tiny_model("llama", seed=4)))
    reference = _ar_tokens(executor, max_new_tokens=40)
    decoder = build_step("layerskip", executor, {"exit_layer": 5, "draft_len": 4})
    state = _generate(executor, decoder, max_new_tokens=40)
    assert state.tokens == reference
    assert state.stats.acceptance_rate == 1.0
    assert state.stats.mean_accepted > 4.5  # 4 accepted + the bonus token per verification


def test_drafts_rejected_at_the_first_token_still_progress():
    executor = LayerExecutor(tiny_model("qwen2", seed=5))
    reference = _ar_tokens(executor, max_new_tokens=30)
    # A head that ranks tokens in reverse: its argmax is never the target's.
    anti_head = lambda hidden, vocab_rows=None: -executor.logits(hidden)  # noqa: E731
    drafter = EarlyExitDrafter(executor, 3, make_stop_rule("constant", draft_len=3), anti_head)
    state = _generate(executor, SpeculativeStep(drafter), max_new_tokens=30)
    assert state.tokens == reference
    assert state.stats.accepted == 0 and state.stats.mean_accepted == 1.0


@pytest.mark.parametrize("eos_index", [0, 5, 9])
def test_generation_ends_on_eos_inside_a_draft(eos_index):
    executor = LayerExecutor(_identity_last_layer(tiny_model("llama", seed=6)))
    free = _ar_tokens(executor, max_new_tokens=20)[len(PROMPT):]
    eos = frozenset({free[eos_index]})
    reference = _ar_tokens(executor, max_new_tokens=20, eos_token_ids=eos)
    decoder = build_step("layerskip", executor, {"exit_layer": 5, "draft_len": 6})
    state = _generate(executor, decoder, max_new_tokens=20, eos_token_ids=eos)
    assert state.tokens == reference
    assert state.stats.finish_reason == "eos"


def test_max_new_tokens_is_exact_with_long_drafts():
    executor = LayerExecutor(_identity_last_layer(tiny_model("llama", seed=6)))
    decoder = build_step("layerskip", executor, {"exit_layer": 5, "draft_len": 8})
    for n in (1, 2, 7, 10):
        state = _generate(executor, decoder, max_new_tokens=n)
        assert state.num_generated == n
        assert state.tokens == _ar_tokens(executor, max_new_tokens=n)


def test_verification_never_recomputes_the_draft_layers():
    exit_layer, num_layers = 4, 6
    executor = LayerExecutor(tiny_model("llama", seed=7))
    calls = []
    run_layers = executor.run_layers

    def counting(hidden, positions, start, end, cache, skip=None, **kwargs):
        calls.append((start, end, hidden.shape[1], int(positions[0, 0])))
        return run_layers(hidden, positions, start, end, cache, skip, **kwargs)

    executor.run_layers = counting
    decoder = build_step("layerskip", executor, {"exit_layer": exit_layer, "draft_len": 3})
    state = _generate(executor, decoder, max_new_tokens=30)
    decode_calls = calls[1:]  # the first call is the prefill
    # The first exit_layer layers only ever see one new token at a time...
    assert all(t == 1 for s, e, t, p in decode_calls if s == 0)
    # (an empty draft, when one token is left to generate, runs [0, L) at once)
    assert all((s, e) in {(0, exit_layer), (exit_layer, num_layers), (0, num_layers)}
               for s, e, t, p in decode_calls)
    # ...and each position runs through them once per step that feeds it (no recomputation:
    # a position reaches layers [0, E) again only after a rejection rolled it back).
    per_step = Counter(p for s, e, t, p in decode_calls if s == 0)
    assert max(per_step.values()) <= state.stats.verifications
    assert sum(t * (e - s) for s, e, t, p in decode_calls) == state.stats.layer_forwards
    # Verification batches D+1 positions through the deep layers in one call.
    assert max(t for s, e, t, p in decode_calls if s == exit_layer) == 4


def test_bad_configuration_is_refused_clearly():
    executor = LayerExecutor(tiny_model("llama"))
    for layer in (0, 6, -1, 2.5):
        with pytest.raises(InvalidArgumentError,
                           match=r"exit_layer must be an integer in \[1, 5\]"):
            build_step("layerskip", executor, {"exit_layer": layer})
    with pytest.raises(InvalidArgumentError, match="draft_len"):
        build_step("layerskip", executor, {"exit_layer": 2, "draft_len": 0})
    for gamma in (0.0, 1.0, 1.5):
        with pytest.raises(InvalidArgumentError, match="gamma"):
            build_step("adaspeed", executor, {"exit_layer": 2, "gamma": gamma})
    with pytest.raises(InvalidArgumentError, match="does not take option.*gamma"):
        build_step("layerskip", executor, {"gamma": 0.5})
    with pytest.raises(InvalidArgumentError, match="known methods"):
        build_step("medusa", executor, {})
    with pytest.raises(InvalidArgumentError, match="does not take"):
        build_step("ar", executor, {"exit_layer": 3})


# ----------------------------------------------------------------------- sampling
def test_speculative_sampling_reproduces_the_target_distribution():
    """Total variation between the empirical distribution of the first three tokens and the
    exact target distribution. Bound (Bretagnolle–Huber–Carol): with k cells and N samples,
    P(TV >= eps) <= 2^k exp(-2 N eps^2); eps is set for a failure probability of 1e-6."""
    torch.manual_seed(0)
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, PROMPT, config, 3)
    # A shallow exit drafts from a distribution far from the target's, so a wrong
    # acceptance rule would show.
    decoder = build_step("layerskip", executor, {"exit_layer": 1, "draft_len": 2})
    n = 1500
    counts = Counter()
    runs = PrefillOnce(executor, PROMPT)  # each run exactly _generate's, one prefill shared
    for seed in range(n):
        sampling = SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed))
        state = runs.run(decoder, max_new_tokens=3, sampling=sampling)
        counts[tuple(state.tokens[len(PROMPT):])] += 1
    cells = len(exact)
    eps = math.sqrt((cells * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"


def test_speculative_sampling_is_reproducible_with_a_seed():
    executor = LayerExecutor(tiny_model("qwen2", seed=9))
    decoder = build_step("adaspeed", executor, {"exit_layer": 2, "gamma": 0.2})
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=11)
    a = _generate(executor, decoder, max_new_tokens=30, sampling=sampling).tokens
    b = _generate(executor, decoder, max_new_tokens=30, sampling=sampling).tokens
    assert a == b
