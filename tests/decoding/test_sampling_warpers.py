"""logits_to_probs pinned against transformers' own logits warpers (issue 80, Build item 3).

Ours must equal softmax(TopP(TopK(Temperature(logits)))) as transformers composes them, on
random logits, logits with ties, and edge values (one token, top_k >= vocab, top_p = 1), and
over hypothesis-drawn logits and settings: zero exactly where transformers filters a token,
its probability where it keeps one.
"""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``[B, V]`` probabilities from transformers' warpers, applied in its order."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.float().clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.9), (0.6, 10, 0.8),
         (2.0, 1, 1.0), (1.0, 0, 0.3), (1.0, 64, 1.0), (1.0, 100, 0.95)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_random_logits_match_transformers(temperature, top_k, top_p):
    """Random ``[32, 64]`` logits: ours equals transformers' to float32 rounding."""
    logits = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 3
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = logits_to_probs(logits, config)
    torch.testing.assert_close(ours, hf_probs(logits, temperature, top_k, top_p),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k_ties_keep_every_tied_token_like_transformers(top_k):
    """Ties at the k-th logit: both keep every tied token (``logits < kth`` is dropped)."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    config = SamplingConfig(temperature=1.0, top_k=top_k, top_p=1.0)
    torch.testing.assert_close(logits_to_probs(logits, config), hf_probs(logits, 1.0, top_k, 1.0))


def test_single_token_vocab_is_certain():
    """A one-token vocabulary: probability 1, as transformers gives."""
    logits = torch.tensor([[0.5]])
    config = SamplingConfig(temperature=0.5, top_k=0, top_p=0.5)
    torch.testing.assert_close(logits_to_probs(logits, config), hf_probs(logits, 0.5, 0, 0.5))


# Logits from a small grid (ties at the top-k boundary are common) or anywhere in a range.
LOGITS = st.lists(st.one_of(st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0]),
                            st.floats(-8.0, 8.0, allow_nan=False, width=32)),
                  min_size=1, max_size=24)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(logits=LOGITS, temperature=st.floats(0.1, 3.0), top_k=st.integers(0, 26),
       top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
def test_any_logits_and_settings_keep_and_filter_the_tokens_transformers_does(logits,
                                                                              temperature,
                                                                              top_k, top_p):
    # Which of two tied tokens a nucleus keeps at its boundary is arbitrary in both (each
    # keeps one of [x, x] at top_p 0.3: ours the first, transformers' ascending sort the
    # last); ties under top-k are compared (every tied token is kept by both).
    assume(top_p == 1.0 or len(set(logits)) == len(logits))
    row = torch.tensor([logits])
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = logits_to_probs(row, config)
    want = hf_probs(row, temperature, top_k, top_p)
    assert torch.equal(ours > 0, want > 0), (ours, want)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
