"""Tests of selfspec.decoding.core.verification on hand-built tensors.

Statistical tests use the Bretagnolle-Huber-Carol inequality: for N i.i.d. draws over k cells,
P(||p_hat - p||_1 >= eps) <= 2^k exp(-N eps^2 / 2). With delta = 1e-6 this gives the total
variation bound TV(p_hat, p) < eps / 2, eps = sqrt(2 (k ln 2 + ln(1/delta)) / N), which a
correct sampler violates with probability < 1e-6 (so the fixed seeds are not tuned). Each test
also asserts the bound is small enough to catch a wrong sampler (one emitting q instead of p).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.decoding.core.verification import (
    VerifyOutput,
    verify_greedy,
    verify_sampling,
)
from selfspec.errors import InvalidArgumentError

DELTA = 1e-6


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors: intra-op threads only add synchronisation (10x slower on a busy host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tv_bound(num_cells: int, num_samples: int, delta: float = DELTA) -> float:
    """TV distance an empirical distribution stays under with probability >= 1 - delta."""
    eps_l1 = math.sqrt(2.0 * (num_cells * math.log(2.0) + math.log(1.0 / delta)) / num_samples)
    return eps_l1 / 2.0


def total_variation(counts: Counter, probs: dict, num_samples: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / num_samples - probs.get(k, 0.0)) for k in keys)


def logits_with_argmax(argmax: list[int], vocab: int = 6) -> torch.Tensor:
    """[len(argmax), vocab] logits whose row i has its maximum at argmax[i]."""
    logits = torch.linspace(-1.0, 0.0, vocab).repeat(len(argmax), 1)
    for row, token in enumerate(argmax):
        logits[row, token] = 3.0
    return logits


# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_gets_bonus():
    target_logits = logits_with_argmax([3, 1, 4, 2])
    out = verify_greedy(torch.tensor([3, 1, 4]), target_logits)
    assert out == VerifyOutput(num_accepted=3, next_token=2, committed_tokens=[3, 1, 4, 2],
                               num_drafted=3)
    assert out.all_accepted and out.acceptance_rate == 1.0


def test_greedy_first_token_rejected():
    out = verify_greedy(torch.tensor([0, 1, 4]), logits_with_argmax([3, 1, 4, 2]))
    assert (out.num_accepted, out.next_token, out.committed_tokens) == (0, 3, [3])
    assert not out.all_accepted


def test_greedy_mismatch_in_the_middle():
    # Draft token 2 (index 2) also matches, but nothing after the first mismatch counts.
    out = verify_greedy(torch.tensor([3, 0, 4]), logits_with_argmax([3, 1, 4, 2]))
    assert (out.num_accepted, out.next_token, out.committed_tokens) == (1, 1, [3, 1])


@pytest.mark.parametrize("draft, expected", [([5], (1, 2, [5, 2])), ([0], (0, 5, [5]))])
def test_greedy_single_token_draft(draft, expected):
    out = verify_greedy(torch.tensor(draft), logits_with_argmax([5, 2]))
    assert (out.num_accepted, out.next_token, out.committed_tokens) == expected


def test_greedy_empty_draft_returns_target_token():
    out = verify_greedy(torch.empty(0, dtype=torch.long), logits_with_argmax([4]))
    assert (out.num_accepted, out.next_token, out.committed_tokens) == (0, 4, [4])


def test_greedy_accepts_batch_of_one_and_low_precision_logits():
    target_logits = logits_with_argmax([3, 1, 4]).to(torch.bfloat16)
    out = verify_greedy(torch.tensor([[3, 1]]), target_logits.unsqueeze(0))
    assert out.committed_tokens == [3, 1, 4]


@pytest.mark.parametrize("tokens_shape, logits_shape", [
    ((3,), (3, 6)),        # D rows instead of D+1
    ((2, 3), (2, 4, 6)),   # batch of 2
    ((3,), (4,)),          # logits without a vocab dim
])
def test_greedy_rejects_bad_shapes(tokens_shape, logits_shape):
    with pytest.raises(InvalidArgumentError):
        verify_greedy(torch.zeros(tokens_shape, dtype=torch.long), torch.zeros(logits_shape))


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(2, 6), num_drafted=st.integers(0, 5), seed=st.integers(0, 2**31))
def test_greedy_matches_reference_loop(vocab, num_drafted, seed):
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values so ties and matches are common; argmax takes the first maximum.
    target_logits = torch.randint(0, 3, (num_drafted + 1, vocab), generator=gen).float()
    draft_tokens = torch.randint(0, vocab, (num_drafted,), generator=gen)
    target = target_logits.argmax(-1).tolist()
    expected = 0
    while expected < num_drafted and draft_tokens[expected].item() == target[expected]:
        expected += 1
    out = verify_greedy(draft_tokens, target_logits)
    assert out.num_accepted == expected
    assert out.next_token == target[expected]
    assert out.committed_tokens == draft_tokens[:expected].tolist() + [target[expected]]


# ---------------------------------------------------------------- sampling: exact cases


def test_sampling_rejects_greedy_config_and_missing_draft_probs():
    draft_tokens, target_logits = torch.tensor([1]), torch.zeros(2, 4)
    with pytest.raises(InvalidArgumentError, match="verify_greedy"):
        verify_sampling(draft_tokens, torch.full((1, 4), 0.25), target_logits, SamplingConfig())
    with pytest.raises(InvalidArgumentError, match="draft_probs"):
        verify_sampling(draft_tokens, None, target_logits, SamplingConfig(temperature=1.0))
    with pytest.raises(InvalidArgumentError, match=r"\[D, V\]"):
        verify_sampling(draft_tokens, torch.full((1, 5), 0.2), target_logits,
                        SamplingConfig(temperature=1.0))


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(2, 8), num_drafted=st.integers(0, 4), seed=st.integers(0, 2**31),
       temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_top_k_1_sampling_equals_greedy(vocab, num_drafted, seed, temperature):
    # top-k = 1 makes p one-hot at the argmax: whatever q is, sampling must act as greedy.
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_drafted + 1, vocab, generator=gen)
    draft_probs = torch.rand(num_drafted, vocab, generator=gen).softmax(-1)
    draft_tokens = torch.randint(0, vocab, (num_drafted,), generator=gen)
    config = SamplingConfig(temperature=temperature, top_k=1)
    out = verify_sampling(draft_tokens, draft_probs, target_logits, config, gen)
    assert out == verify_greedy(draft_tokens, target_logits)


def test_token_outside_target_top_p_is_always_rejected():
    # Target mass 0.6 / 0.3 / 0.05 / 0.05: top_p = 0.8 keeps tokens {0, 1}.
    target_logits = torch.tensor([[0.6, 0.3, 0.05, 0.05]]).log().repeat(2, 1)
    config = SamplingConfig(temperature=1.0, top_p=0.8)
    draft_probs = torch.tensor([[0.05, 0.05, 0.1, 0.8]])  # the draft loves token 3
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        out = verify_sampling(torch.tensor([3]), draft_probs, target_logits, config, gen)
        assert out.num_accepted == 0
        assert out.next_token in (0, 1)


def test_zero_draft_probability_is_safe():
    # q(x) = 0 cannot happen when x ~ q, but must not give NaN: accept iff p(x) > 0.
    config = SamplingConfig(temperature=1.0)
    target_logits = torch.tensor([[0.5, 0.5, 0.0]]).log().repeat(2, 1)
    draft_probs = torch.tensor([[1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert verify_sampling(torch.tensor([1]), draft_probs, target_logits, config,
                               gen).num_accepted == 1
        out = verify_sampling(torch.tensor([2]), draft_probs, target_logits, config, gen)
        assert out.num_accepted == 0 and out.next_token == 1  # residual max(0, p - q) = {1}


def test_all_zero_residual_falls_back_to_target():
    # p == q and the drafted token has q = p = 0 (masked by top-k for both): rejected, and the
    # residual max(0, p - q) is all zero, so the recovered token is drawn from p itself.
    config = SamplingConfig(temperature=1.0, top_k=2)
    target_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2, 1)
    draft_probs = logits_to_probs(target_logits[:1], config)
    gen = torch.Generator().manual_seed(0)
    seen = Counter(verify_sampling(torch.tensor([3]), draft_probs, target_logits, config,
                                   gen).next_token for _ in range(400))
    assert set(seen) == {0, 1}


def test_sampling_is_reproducible_with_a_seed():
    gen_data = torch.Generator().manual_seed(1)
    target_logits = torch.randn(5, 7, generator=gen_data)
    draft_probs = torch.randn(4, 7, generator=gen_data).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs, 1, generator=gen_data).squeeze(-1)
    config = SamplingConfig(temperature=0.9, top_p=0.95, seed=123)

    def run() -> list[VerifyOutput]:
        gen = config.make_generator()
        return [verify_sampling(draft_tokens, draft_probs, target_logits, config, gen)
                for _ in range(30)]

    first = run()
    assert first == run()
    assert len({tuple(o.committed_tokens) for o in first}) > 1  # the seed does drive randomness


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(2, 8), num_drafted=st.integers(0, 4), seed=st.integers(0, 2**31),
       top_k=st.integers(0, 4), top_p=st.sampled_from([0.5, 0.9, 1.0]))
def test_sampling_output_invariants(vocab, num_drafted, seed, top_k, top_p):
    gen = torch.Generator().manual_seed(seed)
    config = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    target_logits = 3 * torch.randn(num_drafted + 1, vocab, generator=gen)
    draft_probs = logits_to_probs(3 * torch.randn(num_drafted, vocab, generator=gen), config)
    draft_tokens = (torch.multinomial(draft_probs, 1, generator=gen).squeeze(-1) if num_drafted
                    else torch.empty(0, dtype=torch.long))
    out = verify_sampling(draft_tokens, draft_probs, target_logits, config, gen)
    assert 0 <= out.num_accepted <= num_drafted
    assert out.committed_tokens[:-1] == draft_tokens[:out.num_accepted].tolist()
    assert out.committed_tokens[-1] == out.next_token
    # The target never emits a token its own transform masks out.
    target_probs = logits_to_probs(target_logits, config)
    for pos, token in enumerate(out.committed_tokens):
        assert target_probs[pos, token] > 0


# ---------------------------------------------------------------- sampling: losslessness


@pytest.mark.parametrize("config", [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=4),
    SamplingConfig(temperature=1.3, top_p=0.85),
], ids=["plain", "top_k", "top_p"])
def test_first_token_follows_target_distribution(config):
    vocab, num_samples = 5, 6_000
    target_logits = torch.tensor([[1.5, 0.2, -0.5, 0.9, -1.0],
                                  [0.0, 0.0, 0.0, 0.0, 0.0]])
    draft_logits = torch.tensor([[-0.5, 1.2, 0.8, -1.0, 0.3]])
    draft_probs = logits_to_probs(draft_logits, config)  # q: transformed like p
    target = logits_to_probs(target_logits[0], config)
    p = {k: target[k].item() for k in range(vocab)}
    bound = tv_bound(vocab, num_samples)
    # Power: the bound must catch emitting q, and the classic bug of recovering from p instead
    # of the residual (output min(p, q) + (1 - sum min(p, q)) p).
    overlap = torch.minimum(target, draft_probs[0])
    resample_from_p = overlap + (1 - overlap.sum()) * target
    for wrong in (draft_probs[0], resample_from_p):
        assert 0.5 * (target - wrong).abs().sum().item() > 2 * bound, "test has no power"

    gen = torch.Generator().manual_seed(0)
    draft_tokens = torch.multinomial(draft_probs.expand(num_samples, vocab), 1, replacement=True,
                                     generator=gen)
    counts = Counter(
        verify_sampling(draft_tokens[i], draft_probs, target_logits, config,
                        gen).committed_tokens[0]
        for i in range(num_samples)
    )
    assert total_variation(counts, p, num_samples) < bound


def test_token_chain_follows_target_distribution():
    """A draft-2 speculative loop over a Markov chain emits 3-token prefixes with the target's
    joint law p(a) p(b|a) p(c|b): covers accepted, recovered and bonus tokens together."""
    vocab, draft_len, length, num_samples = 3, 2, 3, 6_000
    start = vocab  # row index of the start context
    # [V+1, V]: next-token tables; row V is the start context. Q has zeros to hit q = 0.
    target_table = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.7, 0.2],
                                 [0.5, 0.1, 0.4]])
    draft_table = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.1, 0.4], [0.3, 0.3, 0.4],
                                [0.1, 0.6, 0.3]])
    config = SamplingConfig(temperature=1.0)  # softmax(log p) == p
    target_log = target_table.log()

    def joint(table: torch.Tensor) -> dict:
        return {(a, b, c): (table[start, a] * table[a, b] * table[b, c]).item()
                for a in range(vocab) for b in range(vocab) for c in range(vocab)}

    p_joint = joint(target_table)
    bound = tv_bound(vocab**length, num_samples)
    wrong = 0.5 * sum(abs(p_joint[k] - v) for k, v in joint(draft_table).items())
    assert wrong > 2 * bound, "test has no power: p and q are too close"

    gen = torch.Generator().manual_seed(0)
    draft_rng = random.Random(0)  # drafting in plain Python keeps the loop fast
    draft_weights = draft_table.tolist()
    counts: Counter = Counter()
    for _ in range(num_samples):
        emitted, context = [], start
        while len(emitted) < length:
            contexts = [context]
            for _ in range(draft_len):
                contexts += draft_rng.choices(range(vocab), weights=draft_weights[contexts[-1]])
            out = verify_sampling(torch.tensor(contexts[1:]), draft_table[contexts[:-1]],
                                  target_log[contexts], config, gen)
            emitted += out.committed_tokens
            context = emitted[-1]
        counts[tuple(emitted[:length])] += 1
    assert total_variation(counts, p_joint, num_samples) < bound
