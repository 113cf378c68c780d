"""n-gram drafts (decoding/ngram/lookup.py, ngram_drafter.py, tpt.py, methods/ngram.py): the
lookups equal brute force, the draft length follows predicted tokens per second, and the
method keeps the model's greedy tokens and sampling distribution."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfspec
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings, NgramStep
from selfspec.decoding.ngram.lookup import ContextIndex, HistoryMatcher, SuffixAutomaton
from selfspec.decoding.planning.tpt import (
    AcceptanceEstimate,
    ForwardCosts,
    best_draft_len,
)
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel
from selfspec.methods.registry import METHODS

from tiny import (
    VOCAB,
    PrefillOnce,
    exact_prefix_distribution,
    global_rng,
    run_step,
    tiny_model,
    tiny_tokenizer,
)

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def brute_next(seq, tail, max_n, min_n):
    """Longest suffix of ``tail`` (n in [min_n, max_n]) seen in ``seq`` followed by a token:
    its most frequent follower (ties: the most recent), share, n."""
    for n in range(min(max_n, len(tail)), min_n - 1, -1):
        key = tail[len(tail) - n:]
        follow = {}
        for i in range(len(seq) - n):
            if seq[i:i + n] == key:
                count, _ = follow.get(seq[i + n], (0, 0))
                follow[seq[i + n]] = (count + 1, i + n)
        if follow:
            token, (count, _) = max(follow.items(), key=lambda kv: kv[1])
            return token, count / sum(c for c, _ in follow.values()), n
    return None


@settings(max_examples=150, deadline=None)
@given(tokens, tokens, st.integers(1, 5), st.integers(1, 5))
def test_context_index_equals_brute_force(seq, tail, max_n, min_n):
    min_n = min(min_n, max_n)
    index = ContextIndex(max_n, min_n)
    index.extend(seq[:len(seq) // 2])
    index.extend(seq[len(seq) // 2:])  # incremental == all at once
    assert index.next_token(tail, min_n) == brute_next(seq, tail, max_n, min_n)


def test_context_index_copies_a_repeated_span():
    index = ContextIndex(max_ngram=3, min_ngram=2)
    index.extend([5, 6, 7, 8, 9, 1, 2, 5, 6])
    proposal = index.propose(max_len=4)
    assert proposal.tokens == [7, 8, 9, 1] and proposal.match_len == 2
    assert proposal.source == "context" and proposal.shares == [1.0] * 4
    assert ContextIndex(3, 3).propose(4) is None
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        ContextIndex(max_ngram=2, min_ngram=3)


def occurrences(texts, sub):
    return sum(1 for t in texts for i in range(len(t) - len(sub) + 1) if t[i:i + len(sub)] == sub)


@settings(max_examples=100, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=4), tokens)
def test_suffix_automaton_matches_and_counts_like_brute_force(texts, query):
    sam = SuffixAutomaton()
    for text in texts:
        sam.add(text)
    state, length = sam.match(query)
    best = max((n for n in range(len(query) + 1)
                if occurrences(texts, query[len(query) - n:]) > 0), default=0)
    assert length == best
    proposal = sam.propose(state, length, max_len=1)
    if proposal is None:  # nothing matched, or the match only ends texts
        assert length == 0 or all(occurrences(texts, query[len(query) - length:] + [t]) == 0
                                  for t in range(4))
        return
    matched = query[len(query) - length:]
    counts = {t: occurrences(texts, matched + [t]) for t in range(4)}
    assert counts[proposal.tokens[0]] == max(counts.values())
    assert proposal.shares[0] == pytest.approx(counts[proposal.tokens[0]]
                                               / occurrences(texts, matched))


def test_suffix_automaton_drafts_from_earlier_texts_and_keeps_its_capacity():
    sam = SuffixAutomaton(max_tokens=12)
    sam.add([1, 2, 3, 4, 5, 6])
    matcher = HistoryMatcher(sam)
    matcher.sync([9, 9, 2, 3])
    assert matcher.propose(max_len=8, min_len=2).tokens == [4, 5, 6]
    assert matcher.propose(max_len=8, min_len=3) is None
    sam.add([7, 7, 7, 7, 7, 7, 7, 7])  # 6 + 8 > 12: the first text is dropped
    assert sam.texts == [[7] * 8] and len(sam) == 8
    matcher.sync([9, 9, 2, 3])  # rebuilt automaton: the matcher starts again
    assert matcher.propose(max_len=8, min_len=1) is None


def test_best_draft_len_follows_eq4():
    flat = lambda t: 10.0
    assert best_draft_len([0.9] * 8, 0.0, flat).draft_len == 8
    assert best_draft_len([0.0] * 8, 0.0, flat).draft_len == 0
    steep = lambda t: 10.0 * t
    assert best_draft_len([0.99] * 8, 0.0, steep).draft_len == 0
    choice = best_draft_len([0.5] * 4, 2.0, lambda t: 10.0 + t)
    expected = max(range(5), key=lambda g: (2 - 0.5 ** g) / (2.0 * g + 10 + g + 1))
    assert choice.draft_len == expected
    assert choice.tokens == pytest.approx(2 - 0.5 ** expected)
    assert best_draft_len([0.0] * 3, 0.0, flat, min_len=1).draft_len == 1


def test_acceptance_estimate_is_the_geometric_rate_with_a_prior():
    est = AcceptanceEstimate(prior=0.5, prior_weight=2, decay=1.0)
    assert est.rate("a") == 0.5
    est.update("a", drafted=4, accepted=4)  # 4 successes, no failure
    est.update("a", drafted=4, accepted=1)  # 1 success, 1 failure
    assert est.rate("a") == pytest.approx((5 + 1) / (6 + 2))
    est.update("a", drafted=0, accepted=0)
    assert est.observations("a") == 6


def test_acceptance_estimate_starts_a_key_from_its_own_prior():
    est = AcceptanceEstimate(prior=0.6, prior_weight=2, decay=1.0, priors={("prompt", 2): 0.2})
    assert est.rate(("prompt", 2)) == 0.2 and est.rate(("prompt", 3)) == 0.6
    est.update(("prompt", 2), drafted=3, accepted=3)
    assert est.rate(("prompt", 2)) == pytest.approx((3 + 0.4) / (3 + 2))
    assert est.observed_rates() == {("prompt", 2): est.rate(("prompt", 2))}


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_ngram_acceptance_per_kind_of_match_carries_to_the_next_generation(method):
    """The n-gram drafter's acceptance per (source, match length) at the end of a generation
    is the next generation's prior (a kind of match that keeps failing is not retried at the
    fixed prior every time), unless carry_estimates=false; outputs stay the model's."""
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=5), tiny_tokenizer(),
                                            name="tiny-llama")
    options = {"drafters": "ngram"} if method == "auto" else {}
    prompt = "abcabcabcabcabcabcab"
    reference = engine.generate(prompt, max_new_tokens=24).token_ids
    first = engine.generate(prompt, method=method, max_new_tokens=24, **options)
    assert first.stats.drafted > 0
    remembered = dict(engine.methods.memory().ngram)
    assert remembered and all(0 <= rate <= 1 for rate in remembered.values())
    step = METHODS[method].make_step(engine.methods, options)
    drafter = step.ngram if method == "auto" else step.drafter
    assert all(drafter.acceptance.rate(key) == rate for key, rate in remembered.items())
    fresh = METHODS[method].make_step(engine.methods, {**options, "carry_estimates": False})
    fresh = fresh.ngram if method == "auto" else fresh.drafter
    assert all(fresh.acceptance.rate(key) == NgramSettings().prior for key in remembered)
    second = engine.generate(prompt, method=method, max_new_tokens=24, **options)
    assert first.token_ids == second.token_ids == reference


LATENCY = LatencyModel(6, 0.0, 1.0, 1.0, 1.0, verify_token_ms=0.05)
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]


def repeating_executor(dtype=torch.float32, seed=3):
    return LayerExecutor(tiny_model("llama", seed=seed, dtype=dtype))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ngram_keeps_the_greedy_tokens_and_drafts_from_history(arch, dtype, monkeypatch):
    engine = selfspec.from_pretrained_model(tiny_model(arch, seed=5, dtype=dtype),
                                            tiny_tokenizer(), name=f"tiny-{arch}")
    # Whether a draft pays is a cost decision on measured times (the latency model and the
    # verifications observed): in the full suite on an AMX Xeon no draft was predicted to
    # pay, though the test passed alone. Fixed costs, with extra tokens cheap, keep this test
    # on what it checks: the greedy tokens, and drafts from history.
    monkeypatch.setattr(engine.methods, "latency", lambda executor=None: LATENCY)
    monkeypatch.setattr(ForwardCosts, "observe", lambda self, num_tokens, ms: None)
    prompts = ["abcabcabcab", "def f(x):\n    return x\ndef g(x):\n    return"]
    for prompt in prompts:
        reference = engine.generate(prompt, max_new_tokens=40).token_ids
        first = engine.generate(prompt, method="ngram", max_new_tokens=40)
        again = engine.generate(prompt, method="ngram", max_new_tokens=40)  # from history
        off = engine.generate(prompt, method="ngram", max_new_tokens=40, history=False,
                              max_ngram=2, min_ngram=1)
        assert first.token_ids == reference and again.token_ids == reference
        assert off.token_ids == reference
        assert again.stats.accepted >= first.stats.accepted
    assert again.stats.drafted > 0


def test_ngram_drafts_stop_at_the_token_budget_and_eos():
    executor = repeating_executor()
    drafter = NgramDrafter(executor, ForwardCosts(LATENCY), NgramSettings(max_draft_len=8))
    for budget in (1, 2, 5):
        state = run_step(executor, NgramStep(drafter, None), PROMPT, max_new_tokens=budget)
        assert state.num_generated == budget


def test_ngram_options_are_checked():
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        engine.generate("a", method="ngram", max_new_tokens=2, min_ngram=5, max_ngram=3)
    with pytest.raises(InvalidArgumentError, match="max_draft_len"):
        engine.generate("a", method="ngram", max_new_tokens=2, max_draft_len=0)


def test_ngram_sampling_reproduces_the_target_distribution():
    """The draft is a point mass, so the rejection rule must recover p exactly: TV between
    sampled 3-token continuations and the exact distribution within a Hoeffding bound."""
    executor = repeating_executor(seed=8)
    # the model's own greedy text, which loops, so sampled tokens often continue a match
    prompt = run_step(executor, ArStep(), [3, 4], max_new_tokens=14).tokens
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, prompt, config, 3)
    n, drafted = 1200, 0
    counts = Counter()
    runs = PrefillOnce(executor, prompt)  # each run exactly run_step's, one prefill shared
    for seed in range(n):
        drafter = NgramDrafter(executor, ForwardCosts(LATENCY),
                               NgramSettings(min_ngram=1, min_share=0.0, prior=0.9))
        state = runs.run(NgramStep(drafter, None), max_new_tokens=3,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(prompt):])] += 1
        drafted += state.stats.drafted
    assert drafted > n // 2  # many generations drafted
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
    assert VOCAB == 256
