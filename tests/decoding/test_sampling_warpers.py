"""logits_to_probs pinned against transformers' own logits warpers (issue 80, Build item 3).

Ours must equal softmax(TopP(TopK(Temperature(logits)))) as transformers composes them, on
random logits, logits with ties, and edge values (one token, top_k >= vocab, top_p = 1).
"""
import pytest
import torch
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
