"""CLaSp on tiny random models: the layer-level DP equals brute force on additive instances,
the step re-optimises from the read-only history and gives autoregressive greedy output."""

import itertools

import pytest
import torch

from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.knapspec.clasp import CLaSpConfig, CLaSpStep
from selfspec.decoding.planning.knapsack import solve_knapsack
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.methods.clasp import skip_layers

from tiny import assert_speculated, run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12, 200, 31, 8, 77, 150, 9, 41, 2, 19, 88, 120]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=4).float())


def _additive_instance(num_items: int, seed: int):
    """Items add fixed orthogonal-ish vectors: similarity depends only on which are run."""
    gen = torch.Generator().manual_seed(seed)
    deltas = torch.randn(num_items, 1, 16, generator=gen)
    start = torch.randn(1, 16, generator=gen)
    reference = [start]
    for d in deltas:
        reference.append(reference[-1] + d)

    def apply(i, states):
        return states + deltas[i - 1]

    return reference, apply, deltas, start


@pytest.mark.parametrize("seed", range(4))
def test_unit_weight_dp_matches_brute_force_for_a_fixed_layer_count(seed):
    """CLaSp's DP keeps, per budget, the state most similar to the reference; on additive
    items with a monotone prefix structure it finds the brute-force best set of M skips."""
    num_items, budget = 6, 2
    reference, apply, deltas, start = _additive_instance(num_items, seed)
    solutions = solve_knapsack(reference, apply, [1] * num_items, tau=-1.0, max_skip=budget)
    assert [s.skipped_weight for s in solutions] == [0, 1, 2]
    best = solutions[-1]
    assert len(best.skipped) == budget

    def similarity(skipped):
        final = start + sum(deltas[i - 1] for i in range(1, num_items + 1) if i not in skipped)
        return torch.nn.functional.cosine_similarity(final, reference[-1], dim=-1).mean().item()

    brute = max(similarity(set(c)) for c in itertools.combinations(range(1, num_items + 1), budget))
    # The DP is greedy per prefix (CLaSp calls it approximate); it must never claim more than
    # the optimum and its reported similarity must be that of its own set.
    assert best.similarity == pytest.approx(similarity(best.skipped), abs=1e-5)
    assert best.similarity <= brute + 1e-6


def test_solve_knapsack_rejects_mismatched_reference():
    with pytest.raises(ValueError, match="states"):
        solve_knapsack([torch.zeros(1, 4)] * 3, lambda i, s: s, [1] * 3)


def test_clasp_is_lossless_and_reoptimises(executor):
    ar_tokens = run_step(executor, ArStep(), PROMPT, max_new_tokens=40).tokens
    step = CLaSpStep(executor, CLaSpConfig(skip_layers=2, max_draft_len=4, confidence=0.01))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert state.stats.verifications > 0 and state.stats.drafted > 0
    assert len(step.history) == state.stats.steps
    assert all(len(c.skipped_layers) == 2 for c in step.history)
    assert step.history[0].context_len == len(PROMPT) + 1


def test_clasp_scores_on_the_last_verifications_own_hidden_states(executor, monkeypatch):
    """As in CLaSp, the DP's history comes from the forwards that computed it (the prefill
    for the first steps, then verifications): no read-only pass at all; without the
    prefill's recording only the first steps (history in the prompt) pay one."""
    from selfspec.decoding.knapspec import clasp

    passes = []
    read = clasp.read_history
    monkeypatch.setattr(clasp, "read_history", lambda *a: passes.append(1) or read(*a))
    ar_tokens = run_step(executor, ArStep(), PROMPT, max_new_tokens=40).tokens
    step = CLaSpStep(executor, CLaSpConfig(skip_layers=2, max_draft_len=4, confidence=0.01))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert state.stats.steps >= 8 and passes == []
    step.prefill_observer = lambda state: None
    assert run_step(executor, step, PROMPT, max_new_tokens=40).tokens == ar_tokens
    assert 1 <= len(passes) <= 4  # min_history 4: 4 steps at most


def test_clasp_reoptimise_interval(executor):
    step = CLaSpStep(executor, CLaSpConfig(skip_layers=3, reoptimize_every=4, confidence=0.01))
    state = run_step(executor, step, PROMPT, max_new_tokens=30)
    assert len(step.history) == -(-state.stats.steps // 4)


def test_clasp_seeded_sampling_gives_ars_seeded_tokens_over_its_drafts(executor):
    """Seeded sampling is the position-keyed choice (decoding/core/sampling.py), so CLaSp's
    tokens equal plain decoding's with the same seed whatever it drafted; it did draft (and
    kept and threw away drafts). The unseeded rule's distribution is tested in
    test_sampling_power (clasp case)."""
    sampling = SamplingConfig(temperature=0.8, seed=3)
    reference = run_step(executor, ArStep(), PROMPT, max_new_tokens=20, sampling=sampling)
    step = CLaSpStep(executor, CLaSpConfig(skip_layers=2, confidence=0.01))
    state = run_step(executor, step, PROMPT, max_new_tokens=20, sampling=sampling)
    assert state.tokens == reference.tokens
    assert_speculated(state.stats)


def test_clasp_refuses_a_skip_count_out_of_range(executor):
    with pytest.raises(InvalidArgumentError, match="skips between 1 and 5"):
        CLaSpStep(executor, CLaSpConfig(skip_layers=6))


def test_skip_ratio_maps_to_a_layer_count():
    assert skip_layers(30, 0.45) == 14
    assert skip_layers(6, 0.01) == 1
    assert skip_layers(6, 0.99) == 5
