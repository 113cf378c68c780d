"""KnapSpec's DP (Algorithm 1) and TPT grid search (eq. 4) on hand-built instances."""

import itertools
import math

import pytest
import torch

from selfspec.decoding.planning.knapsack import (
    choose_plan,
    knapsack_candidates,
    mean_cosine,
    tokens_per_time,
)


def _orthogonal_instance(num_layers: int, seed: int, rows: int = 3):
    """Residual sub-layers that each add their own orthogonal direction: skipping a set S
    leaves ``x0 + Σ_{i∉S} v_i``, whose similarity to the full model falls with ``Σ_{i∈S}|v_i|²``.
    On such instances the DP is exact, so it must match brute force."""
    gen = torch.Generator().manual_seed(seed)
    num_sub = 2 * num_layers
    dim = num_sub + 1
    basis = torch.eye(dim)
    scales = torch.rand(num_sub + 1, generator=gen) * 2 + 0.2
    x0 = (basis[0] * 3.0).expand(rows, dim).clone()
    deltas = [basis[i] * scales[i] for i in range(1, num_sub + 1)]

    def sublayer(i, hidden):
        return hidden + deltas[i - 1]

    reference = [x0]
    for i in range(1, num_sub + 1):
        reference.append(sublayer(i, reference[-1]))
    return reference, sublayer, deltas


def _brute_force(reference, deltas, w_attn, w_mlp, max_skip):
    """Best similarity per exact skipped weight over every subset of sub-layers."""
    num_sub = len(deltas)
    best = {}
    for mask in itertools.product([False, True], repeat=num_sub):
        weight = sum((w_attn if (i + 1) % 2 == 1 else w_mlp) for i, s in enumerate(mask) if s)
        if weight > max_skip:
            continue
        h = reference[0] + sum((d for d, s in zip(deltas, mask) if not s), torch.zeros(1))
        sim = float(mean_cosine(h, reference[-1]))
        if sim > best.get(weight, (-2.0,))[0]:
            best[weight] = (sim, mask)
    return best


@pytest.mark.parametrize("num_layers,w_attn,w_mlp,seed", [
    (2, 1, 1, 0), (2, 1, 2, 1), (3, 2, 1, 2), (3, 1, 3, 3), (3, 1, 1, 4)])
def test_dp_equals_brute_force_on_additive_instances(num_layers, w_attn, w_mlp, seed):
    reference, sublayer, deltas = _orthogonal_instance(num_layers, seed)
    max_skip = num_layers * (w_attn + w_mlp) // 2
    found = knapsack_candidates(reference, sublayer, w_attn, w_mlp, tau=-1.0)
    expected = _brute_force(reference, deltas, w_attn, w_mlp, max_skip)
    assert {c.skipped_weight for c in found} == set(expected)
    for cand in found:
        sim, mask = expected[cand.skipped_weight]
        assert cand.similarity == pytest.approx(sim, abs=1e-6)
        # The backtracked plan reproduces the similarity it claims.
        skipped = {2 * layer for layer in cand.skip_attention} | {
            2 * layer + 1 for layer in cand.skip_mlp}
        weight = sum(w_attn if i % 2 == 0 else w_mlp for i in skipped)
        assert weight == cand.skipped_weight
        h = reference[0] + sum((d for k, d in enumerate(deltas) if k not in skipped),
                               torch.zeros(1))
        assert float(mean_cosine(h, reference[-1])) == pytest.approx(cand.similarity, abs=1e-6)
        assert torch.allclose(cand.hidden, h)


def test_pruning_drops_dissimilar_states_and_heavy_skips():
    reference, sublayer, _ = _orthogonal_instance(3, 5)
    everything = knapsack_candidates(reference, sublayer, 1, 1, tau=-1.0, max_skip=6)
    pruned = knapsack_candidates(reference, sublayer, 1, 1, tau=0.5)
    assert max(c.skipped_weight for c in pruned) <= 3  # K/2 = 3 * (1 + 1) / 2
    assert all(c.similarity > 0.5 for c in pruned)
    assert len(everything) >= len(pruned) and everything[0].skipped_weight == 0
    assert everything[0].similarity == pytest.approx(1.0)


def test_tokens_per_time_matches_equation_4():
    assert tokens_per_time(0.0, 3, 1.0, 10.0) == pytest.approx(1 / 13)
    assert tokens_per_time(1.0, 3, 1.0, 10.0) == pytest.approx(4 / 13)
    alpha = 0.8
    assert tokens_per_time(alpha, 4, 2.0, 10.0) == pytest.approx(
        (1 - alpha ** 5) / (1 - alpha) / 18)
    assert math.isclose(tokens_per_time(0.999999, 2, 1.0, 1.0), 1.0, rel_tol=1e-4)


def test_choose_plan_maximises_tpt_and_falls_back_to_plain_decoding():
    reference, sublayer, _ = _orthogonal_instance(2, 0)
    cands = knapsack_candidates(reference, sublayer, 1, 1, tau=-1.0)
    cheap = [1.0 - 0.2 * c.skipped_weight for c in cands]
    good = choose_plan(cands, [0.9] * len(cands), cheap, lambda tokens: 1.0, max_draft_len=10)
    assert good.candidate is not None and good.candidate.skipped_weight == max(
        c.skipped_weight for c in cands)
    brute = max((tokens_per_time(0.9, g, cost, 1.0), g) for cost in cheap[1:]
                for g in range(1, 11))
    assert good.tpt == pytest.approx(brute[0])
    hopeless = choose_plan(cands, [0.0] * len(cands), cheap, lambda tokens: 1.0)
    assert hopeless.candidate is None and hopeless.tpt == hopeless.ar_tpt == 1.0
    # On a CPU every verified token costs: a plan that pays on a GPU may not.
    gpu = choose_plan(cands, [0.8] * len(cands), cheap, lambda tokens: 1.0)
    cpu = choose_plan(cands, [0.8] * len(cands), cheap, lambda tokens: 1.0 + 0.5 * (tokens - 1))
    assert gpu.candidate is not None and cpu.candidate is None


@pytest.mark.parametrize("bin_width", [2, 3])
def test_binned_budgets_keep_one_consistent_plan_per_bin(bin_width):
    """The CPU approximation keeps one state per bin of budgets: fewer candidates, each with
    its true skipped weight and the similarity of its own plan, and the best overall
    similarity at a given weight is never above the exact DP's."""
    reference, sublayer, deltas = _orthogonal_instance(3, 5)
    exact = {c.skipped_weight: c for c in knapsack_candidates(reference, sublayer, 1, 2, tau=-1.0)}
    binned = knapsack_candidates(reference, sublayer, 1, 2, tau=-1.0, bin_width=bin_width)
    assert len({c.skipped_weight // bin_width for c in binned}) == len(binned) < len(exact)
    for c in binned:
        weight = len(c.skip_attention) * 1 + len(c.skip_mlp) * 2
        assert c.skipped_weight == weight
        kept = [d for i, d in enumerate(deltas, start=1)
                if not ((i % 2 == 1 and (i - 1) // 2 in c.skip_attention)
                        or (i % 2 == 0 and (i - 1) // 2 in c.skip_mlp))]
        h = reference[0] + sum(kept, torch.zeros(1))
        assert c.similarity == pytest.approx(float(mean_cosine(h, reference[-1])), abs=1e-5)
        assert c.similarity <= exact[weight].similarity + 1e-6


def test_the_full_plan_pays_only_on_cheaper_draft_weights():
    """A draft that runs every sub-layer costs a whole step on the model's own weights and
    never pays; on quantized copies (KnapSpec with draft_weights) it may be the best plan."""
    reference, sublayer, _ = _orthogonal_instance(2, 0)
    cands = knapsack_candidates(reference, sublayer, 1, 1, tau=-1.0)
    assert cands[0].skipped_weight == 0
    alphas = [1.0] + [0.0] * (len(cands) - 1)
    own = choose_plan(cands, alphas, [1.0] * len(cands), lambda tokens: 1.0 + 0.01 * (tokens - 1))
    assert own.candidate is None
    quantized = choose_plan(cands, alphas, [0.5] * len(cands),
                            lambda tokens: 1.0 + 0.01 * (tokens - 1))
    assert quantized.candidate is cands[0] and quantized.tpt > quantized.ar_tpt
