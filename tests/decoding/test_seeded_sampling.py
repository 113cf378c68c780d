"""Seeded sampling that does not depend on the drafts (issue 76, fault 4): with a seed, every
token is the position-keyed Gumbel-max choice (decoding/core/sampling.py: KeyedNoise), so
every sampling-capable method gives `ar`'s seeded tokens whatever was drafted, alone and in a
ragged batch, with any n-gram history; over seeds the tokens follow the target's
distribution."""

import math
from collections import Counter

import pytest
import torch
from test_specee_verify import _step as specee_step

import selfspec
from selfspec.decoding.core.sampling import (
    KeyedNoise,
    SamplingConfig,
    choose_next,
    keyed_choice,
    logits_to_probs,
    position_key,
    splitmix64,
)
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.verification import verify_greedy, verify_keyed
from selfspec.decoding.drafting.calibrated_exit import CalibratedExitStep
from selfspec.decoding.drafting.exit_drafter import DSSDDrafter, EarlyExitDrafter
from selfspec.decoding.drafting.exits import CalibratedExits
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import ConfidenceStopRule, ProductStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.plan import SkipPlan
from selfspec.methods.registry import METHODS, build_step

from tiny import (
    PrefillOnce,
    exact_prefix_distribution,
    run_step,
    steady_latency,
    tiny_model,
    tiny_tokenizer,
)

PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat sat on", "x", "0123456789" * 2]
NEW = 32
# Registry methods that run on a tiny model without trained assets (the others are composed
# below from the same drafters with stub heads, probes and skip plans).
OPTIONS = {"adadecode": {"heads": "none", "gamma": 0.0}, "auto": {"drafters": "ngram"},
           "auto-models": {"drafters": "ngram,layerskip,dv,qspec"}}
NEEDS_ASSETS = {"dssd", "adaspeed-probe", "swift", "early-exit", "specee"}
REGISTRY = [name for name, spec in METHODS.items()
            if spec.lossless_for(spec.options()) and name not in NEEDS_ASSETS] + ["auto-models"]
SAMPLING = dict(temperature=1.0, top_k=0, top_p=0.95)


def _method(name):
    return "auto" if name == "auto-models" else name


@pytest.fixture(scope="module")
def engine():
    """Drafts priced by a hand-made latency model (tiny.steady_latency): a measured one can
    keep ngram and auto from drafting on a loaded machine."""
    return steady_latency(selfspec.from_pretrained_model(tiny_model("llama", seed=3),
                                                         tiny_tokenizer(), "tiny-llama"))


@pytest.fixture(scope="module")
def ar_tokens(engine):
    return {(p, seed): engine.generate(p, max_new_tokens=NEW, seed=seed, **SAMPLING).token_ids
            for p in PROMPTS for seed in (1234, 7)}


# --- the primitives -------------------------------------------------------------------------

def test_the_key_of_a_position_depends_on_the_seed_and_the_position_only():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # Vigna's reference output for state 0
    keys = {position_key(seed, t) for seed in (0, 1, 2**63, -1) for t in range(50)}
    assert len(keys) == 200
    assert position_key(5, 9) == position_key(5, 9)


def test_keyed_noise_rows_are_the_same_in_any_order_and_forgotten_behind():
    a, b = KeyedNoise(42, 64), KeyedNoise(42, 64)
    forward = a.rows(10, 4)
    backward = torch.stack([b.row(t) for t in (13, 12, 11, 10)]).flip(0)
    assert torch.equal(forward, backward)
    assert (forward > 0).all() and not torch.equal(forward[0], forward[1])
    assert not torch.equal(KeyedNoise(43, 64).row(10), forward[0])
    a.rows(12, 1)  # positions before 12 are dropped, 12 and 13 are kept
    assert sorted(a._rows) == [12, 13]
    assert a.rows(5, 0).shape == (0, 64)


def test_keyed_choice_is_the_gumbel_max_of_the_probabilities():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    noise = torch.tensor([[2.0, 0.1, 1.0, 1e-30]])
    assert keyed_choice(probs, noise).tolist() == [1]  # 0.3 / 0.1 wins; a masked token never
    gumbel = -torch.log(noise)
    assert int((probs.log() + gumbel).argmax()) == 1
    logits = torch.randn(3, 16)
    config = SamplingConfig(temperature=0.8, seed=1)
    rows = KeyedNoise(1, 16).rows(0, 3)
    assert torch.equal(choose_next(logits, config, None, rows),
                       keyed_choice(logits_to_probs(logits, config), rows))


def test_verify_keyed_accepts_the_prefix_matching_the_keyed_choice():
    config = SamplingConfig(temperature=1.0, seed=3)
    logits = torch.randn(5, 32)
    noise = KeyedNoise(3, 32).rows(100, 5)
    choice = keyed_choice(logits_to_probs(logits, config), noise).tolist()
    for accepted in range(5):
        draft = choice[:accepted] + ([(choice[accepted] + 1) % 32] if accepted < 4 else [])
        out = verify_keyed(torch.tensor(draft), logits[: len(draft) + 1], config,
                           noise[: len(draft) + 1])
        assert out.num_accepted == accepted and out.committed_tokens == choice[:accepted + 1]
    # greedy verification of the same draft judges it against the argmax instead
    greedy = logits.argmax(-1).tolist()
    assert verify_greedy(torch.tensor(greedy[:4]), logits).committed_tokens == greedy
    with pytest.raises(InvalidArgumentError, match="temperature > 0"):
        verify_keyed(torch.tensor([1]), logits[:2], SamplingConfig(), noise[:2])
    with pytest.raises(InvalidArgumentError, match="noise must be"):
        verify_keyed(torch.tensor([1]), logits[:2], config, noise[:3])


# --- every method gives ar's seeded tokens -----------------------------------------------------

@pytest.mark.parametrize("method", REGISTRY)
def test_every_registry_method_gives_ar_seeded_tokens(engine, ar_tokens, method):
    drafted = 0
    for seed in (1234, 7):
        for prompt in PROMPTS:
            r = engine.generate(prompt, method=_method(method), max_new_tokens=NEW, seed=seed,
                                **SAMPLING, **OPTIONS.get(method, {}))
            assert r.token_ids == ar_tokens[prompt, seed], (method, seed, prompt)
            drafted += r.stats.drafted
    assert drafted > 0 or method in ("ar", "knapspec")  # knapspec may plan no draft here


@pytest.mark.parametrize("method", REGISTRY)
def test_every_registry_method_gives_ar_seeded_tokens_in_a_ragged_batch(engine, ar_tokens,
                                                                         method):
    results = engine.generate(PROMPTS, method=_method(method), max_new_tokens=NEW, seed=1234,
                              **SAMPLING, **OPTIONS.get(method, {}))
    assert [r.token_ids for r in results] == [ar_tokens[p, 1234] for p in PROMPTS]


@pytest.mark.parametrize("method", ["ngram", "auto", "auto-models"])
def test_the_seeded_sample_does_not_depend_on_the_history(ar_tokens, method):
    """Two engines whose histories continue the prompt differently (one with ar's own seeded
    continuation, drafts accepted; one with other text, drafts rejected) give ar's tokens."""
    prompt = PROMPTS[1]
    reference = ar_tokens[prompt, 1234]
    tok = tiny_tokenizer()
    others = [tok.decode(reference), "the dog ran to the park; the dog ran to the park!"]
    runs = []
    for other in others:
        engine = steady_latency(selfspec.from_pretrained_model(tiny_model("llama", seed=3), tok,
                                                               "tiny-llama"))
        engine.generate(prompt + other, method="ngram", max_new_tokens=4)  # into the history
        for batch in (False, True):
            if batch:
                r = engine.generate([prompt, "x"], method=_method(method), max_new_tokens=NEW,
                                    seed=1234, **SAMPLING, **OPTIONS.get(method, {}))[0]
            else:
                r = engine.generate(prompt, method=_method(method), max_new_tokens=NEW,
                                    seed=1234, **SAMPLING, **OPTIONS.get(method, {}))
            runs.append((r.token_ids, r.stats.drafted, r.stats.accepted))
    assert all(tokens == reference for tokens, _, _ in runs), method
    assert len({(d, a) for _, d, a in runs}) > 1  # the histories did change the drafts


class StubHeads:
    """Calibrated heads on the model's own norm + lm_head with fixed thresholds (as
    test_dssd)."""

    def __init__(self, executor, layers, taus):
        self.layers = layers
        self.heads = [lambda h, vocab_rows=None: executor.logits(h) for _ in layers]
        self.taus = taus

    def thresholds(self, epsilon, metric, draft_vocab=None):
        return self.taus


def _composed(name, executor):
    """The methods that need trained assets, composed from their drafters with stubs."""
    if name == "dssd":
        exits = CalibratedExits(StubHeads(executor, [2, 4, 6], [0.3, 0.1, 0.0]), 0.9,
                                "max_prob")
        return SpeculativeStep(DSSDDrafter(executor, exits, max_draft_len=6))
    if name == "adaspeed-probe":
        rule = ProductStopRule(0.3, max_draft_len=6)
        probe = lambda hidden: torch.sigmoid(hidden.float().mean())  # noqa: E731
        return SpeculativeStep(EarlyExitDrafter(executor, 3, rule, sampled_scorer=probe))
    if name == "swift":
        plan = SkipPlan(frozenset({2, 5}), frozenset({3, 6}))
        return SpeculativeStep(SkipPlanDrafter(executor, plan,
                                               ConfidenceStopRule(0.5, max_draft_len=6)))
    assert name == "specee-verify"
    return specee_step(executor, "head+ngram", "random", 3)


@pytest.mark.parametrize("name", ["dssd", "adaspeed-probe", "swift", "specee-verify"])
def test_methods_with_trained_assets_give_ar_seeded_tokens(name):
    executor = LayerExecutor(tiny_model("llama", seed=11, num_layers=8))
    prompt = [5, 17, 42, 99, 3, 250, 7, 5, 17, 42]
    drafted = 0
    for seed in (1234, 7, 99):
        sampling = SamplingConfig(seed=seed, **SAMPLING)
        ar = run_step(executor, build_step("ar", executor, {}), prompt,
                      max_new_tokens=NEW, sampling=sampling)
        state = run_step(executor, _composed(name, executor), prompt, max_new_tokens=NEW,
                         sampling=sampling)
        assert state.tokens == ar.tokens, (name, seed)
        drafted += state.stats.drafted
    assert drafted > 0


def test_lossy_methods_are_reproducible_with_a_seed():
    """Lossy early exit emits its heads' tokens, not ar's; with a seed they are the keyed
    choice at each position, the same every time."""
    executor = LayerExecutor(tiny_model("llama", seed=11, num_layers=8))
    exits = CalibratedExits(StubHeads(executor, [2, 4, 6], [0.5, 0.2, 0.05]), 0.9, "max_prob")
    prompt = [5, 17, 42, 99, 3, 250, 7]
    runs = [run_step(executor, CalibratedExitStep(exits), prompt, max_new_tokens=NEW,
                     sampling=SamplingConfig(seed=5, **SAMPLING)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# --- over seeds, the target's distribution ----------------------------------------------------

def _empirical_tv(executor, step_factory, prompt, config, exact, n, length):
    counts = Counter()
    runs = PrefillOnce(executor, prompt)
    for seed in range(n):
        sampling = SamplingConfig(temperature=config.temperature, top_k=config.top_k,
                                  seed=seed)
        state = runs.run(step_factory(), max_new_tokens=length, sampling=sampling)
        counts[tuple(state.tokens[len(prompt):len(prompt) + length])] += 1
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    return tv + 0.5 * sum(v / n for c, v in counts.items() if c not in exact), counts


def test_seeded_tokens_follow_the_target_distribution_over_seeds():
    """The first three tokens over 1500 seeds, with ar and with layerskip (drafts coupled by
    the same noise): total variation from the exact target distribution within the
    Bretagnolle–Huber–Carol bound (failure probability 1e-6, as test_speculative); power: the
    same counts are far from the distribution of another temperature."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    prompt = [5, 17, 42, 99, 3, 250, 7]
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, prompt, config, 3)
    wrong = exact_prefix_distribution(executor, prompt, SamplingConfig(temperature=0.4,
                                                                       top_k=3), 3)
    n = 1500
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    assert 0.5 * sum(abs(exact[c] - wrong.get(c, 0.0)) for c in exact) > 2 * eps
    for name in ("ar", "layerskip"):
        tv, counts = _empirical_tv(executor, lambda name=name: build_step(name, executor, {}),
                                   prompt, config, exact, n, 3)
        assert tv < eps, f"{name}: TV {tv:.3f} >= bound {eps:.3f}"
        tv_wrong = 0.5 * sum(abs(counts[c] / n - p) for c, p in wrong.items())
        assert tv_wrong > eps, f"{name}: the test cannot tell T=0.4 from T=1 ({tv_wrong:.3f})"
