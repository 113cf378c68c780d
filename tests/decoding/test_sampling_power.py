"""End-to-end sampling tests with power: every sampling-capable method, with a draft that
differs from the target (``q != p``), several drafted tokens per step, temperature != 1 and a
top-k or top-p transform, reproduces the target's distribution (Leviathan et al. 2023 §2.3,
Algorithm 1; Chen et al. 2023, Algorithm 2). Each test asserts that drafts were both rejected
and accepted whole (so the residual and the bonus token are exercised), that the empirical
marginal of every generated token is within the BHC bound of the exact one, and that the bound
is tight enough to see a sampler that is off (see ``tiny.assert_samples_follow_target``).

The sampling runs with ``seed=None`` and the global RNG seeded per generation: that is the
rejection-sampling rule these tests are about. ``scripts/mutation_check.py`` plants wrong rules
in ``verify_sampling`` and counts which of these tests catch each.
"""

from __future__ import annotations

import pytest

from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.executor import LayerExecutor
from selfspec.methods.registry import build_step

from tiny import PrefillOnce, assert_samples_follow_target, sampling_model, seeded_runs

PROMPT = [3, 7, 1, 9, 4]
N = 1200
TOP_K = SamplingConfig(temperature=0.8, top_k=3)
TOP_K_HOT = SamplingConfig(temperature=1.4, top_k=2)


@pytest.fixture(scope="module")
def executor():
    return LayerExecutor(sampling_model())


CASES = [
    ("layerskip", {"exit_layer": 2, "draft_len": 3}, TOP_K),
    ("layerskip", {"exit_layer": 2, "draft_len": 4}, TOP_K_HOT),
]


@pytest.mark.parametrize("method,options,config", CASES,
                         ids=[f"{m}-T{c.temperature}-k{c.top_k}" for m, _, c in CASES])
def test_method_samples_the_target_distribution(executor, method, options, config):
    step = build_step(method, executor, options)
    runs = PrefillOnce(executor, PROMPT)
    assert_samples_follow_target(executor, PROMPT, config, seeded_runs(runs, step, config), N)
