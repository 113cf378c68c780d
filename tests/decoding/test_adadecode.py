"""AdaDecode (early predictions by threshold, deferred layers batched with later tokens,
verification) on tiny random models: losslessness with forced early predictions and forced
rejections, the KV invariant, the exact sampling rule, options and ablations."""

import math
from collections import Counter

import pytest
import torch

from selfspec.decoding.adadecode.threshold_exits import ThresholdExits, early_proposal
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.verification import verify_sampling
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.methods.registry import METHODS, build_step

from tiny import VOCAB, PrefillOnce, exact_prefix_distribution, global_rng, run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]
LAYERS = [2, 4, 6]


def _own_head(executor, sharpen=1.0):
    """The model's own final norm + lm_head at an intermediate layer, logits scaled by
    ``sharpen`` (large: always confident, so every head predicts early)."""
    return lambda hidden: executor.logits(hidden) * sharpen


def _constant_head(token):
    """A head that predicts ``token`` with probability ~1 whatever it reads: every early
    prediction it makes is rejected unless the model happens to emit ``token``."""
    def head(hidden):
        logits = torch.full((*hidden.shape[:-1], VOCAB), -30.0)
        logits[..., token] = 30.0
        return logits
    return head


def _step(executor, heads, gamma, max_early=5, layers=LAYERS):
    exits = ThresholdExits(layers, heads, gamma)
    return SpeculativeStep(ExitDrafter(executor, exits, BufferStopRule(max_early)))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=8))


@pytest.fixture(scope="module")
def reference(executor):
    return run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=40).tokens


@pytest.mark.parametrize("gamma,sharpen,max_early", [
    (0.0, 1.0, 5),     # every token predicted early at the first head (forced early predictions)
    (0.75, 40.0, 5),   # sharpened heads: confident at the first head, mostly accepted
    (0.75, 40.0, 1),   # one early prediction at a time
    (0.5, 2.0, 3),     # a mix of heads per token
    (0.999, 1.0, 5),   # no head is ever confident: plain decoding through the same code
])
def test_greedy_equals_autoregressive(executor, reference, gamma, sharpen, max_early):
    heads = [_own_head(executor, sharpen)] * len(LAYERS)
    state = run_step(executor, _step(executor, heads, gamma, max_early), PROMPT,
                     max_new_tokens=40)
    assert state.tokens == reference
    stats = state.stats
    if gamma == 0.0:
        assert stats.drafted > 0 and stats.mean_exit_layer == LAYERS[0]
        assert stats.mean_layer_batch > 1  # deferred layers ran batched with later tokens
    if gamma == 0.999:
        assert stats.drafted == 0


def test_forced_rejections_at_every_head_stay_lossless(executor, reference):
    """Heads that always predict early and are (nearly) always wrong: every cycle rolls
    back the later tokens' KV in every layer and resumes from the corrected token."""
    for layers in ([2], [4], [6], LAYERS):
        heads = [_constant_head(200)] * len(layers)
        state = run_step(executor, _step(executor, heads, 0.75, layers=layers), PROMPT,
                         max_new_tokens=30)
        assert state.tokens == reference[: len(state.tokens)]
        assert state.num_generated == 30
        assert state.stats.drafted > 0 and state.stats.acceptance_rate < 0.5


def test_every_layer_holds_the_committed_kv_whenever_a_token_reads_it(executor):
    """Whenever a position runs layer l, layer l's KV holds exactly the positions before it
    (no gap, no stale entry), and between steps every layer holds the committed prefix."""
    calls = []
    original = executor.run_layers

    def checked(hidden, positions, start, end, cache, *args, **kwargs):
        first = int(positions[0, 0])
        for layer in range(start, end):
            assert cache.length(layer) == first, (layer, cache.length(layer), first)
        calls.append(positions.shape[1])
        return original(hidden, positions, start, end, cache, *args, **kwargs)

    heads = [_own_head(executor, 3.0)] * len(LAYERS)
    step = _step(executor, heads, 0.5)
    from selfspec.decoding.core.state import DecodeOptions, DecodeState

    state = DecodeState(executor, PROMPT, DecodeOptions(max_new_tokens=30))
    executor.run_layers = checked
    try:
        with torch.inference_mode():
            state.commit([int(state.prefill()[0].argmax())])
            step.start(state)
            while not state.done:
                stats = step(state)
                if not state.done:
                    assert state.cache.lengths() == [state.seq_len - 1] * executor.num_layers
                assert stats.committed >= 1
    finally:
        executor.run_layers = original
    assert max(calls) > 1  # some layer calls were batched


def test_early_proposal_is_eq1_as_a_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    low = early_proposal(probs, 0.2)            # two tokens pass
    assert math.isclose(float(low.exit_prob), 0.8, rel_tol=1e-6)
    assert torch.allclose(low.proposal, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    high = early_proposal(probs, 0.5)           # strict: nothing passes
    assert float(high.exit_prob) == 0.0 and float(high.proposal.sum()) == 0.0
    point = early_proposal(torch.tensor([0.1, 0.8, 0.1]), 0.75)
    assert torch.equal(point.proposal, torch.tensor([0.0, 1.0, 0.0]))


def _output_distribution(target, proposal_token, ratio_q):
    """Exact distribution of the committed token when the draft token is always
    ``proposal_token`` and acceptance uses ``min(1, p*/ratio_q)`` with residual
    ``normalize(max(0, p* - ratio_q))``."""
    t = proposal_token
    accept = min(1.0, float(target[t] / ratio_q[t]))
    residual = (target - ratio_q).clamp(min=0)
    residual = residual / residual.sum()
    return accept * torch.nn.functional.one_hot(torch.tensor(t), len(target)).float() + \
        (1 - accept) * residual


def test_verification_must_use_the_exit_proposal_not_the_head_distribution():
    """With γ >= 0.5, eq. 1 drafts the head's argmax whenever it exits: the proposal is a
    point mass. Eq. 2 as printed (ratio p*/p_head) then over-produces that token; the ratio
    with the real proposal gives exactly p*."""
    target = torch.tensor([0.3, 0.5, 0.2])
    head = torch.tensor([0.1, 0.8, 0.1])          # exits with token 1 when p_head(1) > 0.75
    q = early_proposal(head, 0.75).proposal
    assert torch.allclose(_output_distribution(target, 1, q), target)
    assert not torch.allclose(_output_distribution(target, 1, head), target, atol=0.05)
    # and the library's rule with the proposal reproduces it empirically
    logits = target.log().unsqueeze(0).repeat(2, 1)
    counts = Counter()
    gen = torch.Generator().manual_seed(0)
    n = 6000
    for _ in range(n):
        out = verify_sampling(torch.tensor([1]), q.unsqueeze(0), logits,
                              SamplingConfig(temperature=1.0), gen)
        counts[out.committed_tokens[0]] += 1
    for token, p in enumerate(target.tolist()):
        assert abs(counts[token] / n - p) < 0.03


def _sampled_tv(executor, step, exact, n, length):
    """Generate 3 tokens ``n`` times (seeds 0..n-1, T = 1, top-k 3) and compare the first
    ``length`` tokens with ``exact``: ``(total variation, its bound, tokens drafted)``. Bound
    (Bretagnolle–Huber–Carol, as in test_speculative): failure probability 1e-6."""
    counts = Counter()
    drafted = 0
    runs = PrefillOnce(executor, PROMPT)  # each run exactly run_step's, one prefill shared
    for seed in range(n):
        state = runs.run(step, max_new_tokens=3,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(PROMPT):len(PROMPT) + length])] += 1
        drafted += state.stats.drafted
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    return tv, eps, drafted


@pytest.mark.parametrize("gamma,sharpen", [(0.3, 1.5), (0.6, 4.0)])
def test_sampling_reproduces_the_target_distribution(gamma, sharpen):
    """Total variation between the empirical distribution of the first three tokens and the
    exact target distribution (bound as in test_speculative: failure probability 1e-6).
    γ = 0.3 lets several tokens pass (a proper restricted proposal), γ = 0.6 makes it a point
    mass; heads read shallow layers, so their predictions are often wrong."""
    torch.manual_seed(0)
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, PROMPT, config, 3)
    heads = [_own_head(executor, sharpen)] * 2
    step = _step(executor, heads, gamma, max_early=2, layers=[1, 3])
    n = 1500
    tv, eps, drafted = _sampled_tv(executor, step, exact, n, 3)
    assert drafted > n // 3  # early predictions happened
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"


def test_method_options_and_ablations(executor, reference):
    spec = METHODS["adadecode"]
    assert spec.lossless and spec.lossless_for({}) and not spec.lossless_for({"verify": False})
    # heads=none: the model's own lm_head at every L/4 layers (8 layers: 2, 4, 6)
    for options in ({"gamma": 0.2}, {"gamma": 0.0, "layers": "4"}, {"gamma": 0.0, "max_early": 2}):
        state = run_step(executor, build_step("adadecode", executor, {"heads": "none", **options}),
                         PROMPT, max_new_tokens=40)
        assert state.tokens == reference, options
    lossy = run_step(executor, build_step("adadecode", executor,
                                          {"heads": "none", "gamma": 0.0, "verify": False}),
                     PROMPT, max_new_tokens=40)
    assert lossy.num_generated == 40 and lossy.stats.accepted == lossy.stats.drafted > 0
    for bad, match in (({"gamma": 1.0}, "gamma"), ({"gamma": -0.1}, "gamma"),
                       ({"layers": "3"}, r"heads at layers \[2, 4, 6\]"),
                       ({"layers": "x"}, "comma list"),
                       ({"max_early": 0}, "max_early"),
                       ({"draft_vocab": 16}, "token counts")):
        with pytest.raises(InvalidArgumentError, match=match):
            build_step("adadecode", executor, {"heads": "none", **bad})
    assert spec.heads_files(spec.parse({"heads": "none"})) == []
    assert spec.heads_files(spec.parse({})) == ["default"]


def test_threshold_exits_refuse_bad_heads():
    with pytest.raises(InvalidArgumentError, match="one head per layer"):
        ThresholdExits([2, 4], [lambda h: h], 0.5)
    with pytest.raises(InvalidArgumentError, match="increase"):
        ThresholdExits([4, 2], [lambda h: h] * 2, 0.5)


def test_sampling_with_a_point_mass_proposal_is_exact():
    """A head whose distribution is 0.7 / 0.15 / 0.15 whatever it reads, on the target's
    most likely second token: with γ = 0.6 it predicts early with probability 0.7 (eq. 1:
    a draw passes γ), always that token, so the proposal is a point mass. Accepting by the
    head's own probability (eq. 2 as printed) would over-produce it; the distribution of the
    first two tokens must be the target's."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact2 = exact_prefix_distribution(executor, PROMPT, config, 2)
    (first, likely), _ = max(exact2.items(), key=lambda kv: kv[1])
    others = [t for (f, t) in exact2 if f == first and t != likely][:2]
    head_logits = torch.full((VOCAB,), -30.0)
    head_logits[likely] = math.log(0.7)
    head_logits[others] = math.log(0.15)

    def head(hidden):
        return head_logits.expand(*hidden.shape[:-1], VOCAB)

    step = _step(executor, [head], 0.6, max_early=1, layers=[2])
    n = 3000
    tv, eps, drafted = _sampled_tv(executor, step, exact2, n, 2)
    assert 0.6 * n < drafted < 0.8 * n
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
