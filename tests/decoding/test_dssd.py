"""DSSD drafting, AdaSPEED with a probe, and calibrated early exit on tiny models."""


import pytest
import torch

from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.calibrated_exit import CalibratedExitStep
from selfspec.decoding.drafting.exit_drafter import DSSDDrafter, EarlyExitDrafter
from selfspec.decoding.drafting.exits import CalibratedExits
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.executor import LayerExecutor
from selfspec.methods.registry import build_step

from tiny import run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]


class StubHeads:
    """Heads at ``layers`` that reuse the model's own norm + lm_head, with fixed thresholds
    on max-probability (the calibration itself is tested with the heads package)."""

    def __init__(self, executor, layers, taus):
        self.layers = layers
        self.heads = [lambda h, vocab_rows=None: executor.logits(h) for _ in layers]
        self.taus = taus

    def thresholds(self, epsilon, metric, draft_vocab=None):
        return self.taus


def _run(executor, decoder, **options):
    return run_step(executor, decoder, PROMPT, **options)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("taus", [
    [0.0, 0.0, 0.0],                # the shallowest head always passes
    [0.5, 0.2, 0.05],               # a mix of heads per token
    [2.0, 2.0, 2.0],                # no head ever passes: every step falls back to the model
    [float("inf"), 0.3, 0.0],       # a head that can never pass is skipped
])
def test_dssd_greedy_equals_autoregressive(arch, taus):
    executor = LayerExecutor(tiny_model(arch, seed=11, num_layers=8))
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=40).tokens
    exits = CalibratedExits(StubHeads(executor, [2, 4, 6], taus), 0.9, "max_prob")
    drafter = DSSDDrafter(executor, exits, max_draft_len=6)
    state = _run(executor, SpeculativeStep(drafter), max_new_tokens=40)
    assert state.tokens == reference
    if taus[0] == 0.0:
        assert state.stats.mean_exit_layer == 2.0 and state.stats.drafted > 0
    if taus[0] == 2.0:
        assert state.stats.drafted == 0
    # Every position ran every layer exactly once: prefill aside, L per committed token
    # plus the rejected positions' partial work.
    assert state.stats.layer_forwards >= 8 * (state.num_generated - 1)


def test_dssd_mixes_exit_layers_and_stays_lossless_with_full_acceptance():
    model = tiny_model("llama", seed=12, num_layers=8)
    for layer in model.model.layers[2:]:  # layers 2..7 become the identity
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    executor = LayerExecutor(model)
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=30).tokens
    exits = CalibratedExits(StubHeads(executor, [2, 4, 6], [0.6, 0.3, 0.0]), 0.9, "max_prob")
    state = _run(executor, SpeculativeStep(DSSDDrafter(executor, exits, 8)),
                 max_new_tokens=30)
    assert state.tokens == reference
    assert state.stats.acceptance_rate == 1.0
    assert 2.0 <= state.stats.mean_exit_layer <= 6.0


def test_probe_scores_reach_the_product_rule():
    executor = LayerExecutor(tiny_model("qwen2", seed=13))
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=30).tokens
    seen = []

    def probe(hidden):
        seen.append(hidden.shape)
        return torch.full((1, 1), 0.6)  # product 0.6, 0.36 < 0.4: two-token drafts

    rule = make_stop_rule("product", gamma=0.4, adaptive=False)
    drafter = EarlyExitDrafter(executor, 3, rule, scorer=probe)
    state = _run(executor, SpeculativeStep(drafter), max_new_tokens=30)
    assert state.tokens == reference
    assert seen and all(s == (1, 1, 64) for s in seen)
    assert state.stats.drafted <= 2 * state.stats.verifications


def test_calibrated_early_exit_uses_heads_and_defers_deep_layers():
    executor = LayerExecutor(tiny_model("llama", seed=14, num_layers=8))
    # Thresholds that never pass: the lossy mode is then exactly autoregressive decoding.
    never = CalibratedExits(StubHeads(executor, [2, 4, 6], [2.0, 2.0, 2.0]), 0.9, "max_prob")
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=25).tokens
    state = _run(executor, CalibratedExitStep(never), max_new_tokens=25)
    assert state.tokens == reference and state.stats.mean_exit_layer == 8.0
    # Always the first head: tokens come from layer 2 and the deep layers never run.
    always = CalibratedExits(StubHeads(executor, [2, 4, 6], [0.0, 0.0, 0.0]), 0.9, "max_prob")
    state = _run(executor, CalibratedExitStep(always), max_new_tokens=25)
    assert state.stats.mean_exit_layer == 2.0
    assert state.stats.layer_forwards == 2 * 24
    assert state.cache.length(1) == state.seq_len - 1 and state.cache.length(7) == len(PROMPT)
