"""AdaDecode's schedule replay and threshold tuning (selfspec.training.adadecode_tuning):
hand-counted costs, agreement with real decoding on a tiny model, the tuner, per-head
thresholds in decoding, the card round trip and the `tuned` option's errors."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.decoding.adadecode.threshold_exits import ThresholdExits
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.card import AdaDecodeCard, HeadCard
from selfspec.methods.registry import build_step
from selfspec.training.adadecode_tuning import (
    HeadTrace,
    ScheduleCosts,
    simulate,
    tune,
)

from tiny import run_step, tiny_model

FREE = ScheduleCosts(row=0.0, head=0.0, output=0.0)


def _trace(layers, conf, correct, lengths):
    return HeadTrace(tuple(layers), torch.tensor(conf, dtype=torch.float32),
                     torch.tensor(correct), tuple(lengths))


def test_replay_counts_layer_calls_as_algorithm_1_runs_them():
    # L = 4, one head after layer 2, always confident and right; 3 positions:
    # positions 0 and 1 predict early after 2 layers each, position 2 (the last one) runs all
    # 4 layers carrying the deferred ones from layer 2: 2 + 2 + 4 = 8 calls for 3 tokens.
    trace = _trace([2], [[0.9]] * 3, [[True]] * 3, [3])
    p = simulate(trace, [0.5], 4, FREE)
    assert p.tokens == 3 and p.cost_per_token == pytest.approx(8 / 3)
    assert p.speedup == pytest.approx(4 / (8 / 3)) and p.acceptance == 1.0
    assert p.drafts_per_token == pytest.approx(2 / 3)
    # Extra positions per call, head checks and the output layer as the cost model says:
    # layers 2-3 carry 2 deferred positions (row 0.5 each), two head checks, one output
    # call over 3 positions.
    p = simulate(trace, [0.5], 4, ScheduleCosts(row=0.5, head=0.25, output=2.0))
    assert p.cost_per_token * 3 == pytest.approx(2 + 2 + 2 + 2 * 2.0 + 0.5 + 2.0 * 2.0)


def test_a_rejection_commits_the_verifier_token_and_replays_from_there():
    # Position 0's early prediction is wrong: the round commits 1 token (the correction) and
    # the next round starts at position 1, which is confident and right.
    trace = _trace([2], [[0.9], [0.9], [0.1]], [[False], [True], [True]], [3])
    p = simulate(trace, [0.5], 4, FREE)
    # round 1: pos 0 exits (2), pos 1 exits (2), pos 2 runs all 4 → 8 calls, 1 token;
    # round 2 from pos 1: exits (2), pos 2 runs 4 → 6 calls, 2 tokens.
    assert p.tokens == 3 and p.cost_per_token == pytest.approx(14 / 3)
    assert p.acceptance == pytest.approx(1 / 3)  # 3 early predictions, 1 accepted
    with pytest.raises(InvalidArgumentError):
        simulate(trace, [None], 4, FREE)


def test_tuner_lowers_a_shallow_heads_threshold_and_drops_a_useless_deep_head():
    """A shallow head that is right 80% of the time pays (break-even ~ e/L); a deep head that
    is confident but always wrong only loses: the tuner keeps the first, drops the second."""
    gen = torch.Generator().manual_seed(0)
    n = 400
    shallow = torch.where(torch.arange(n) % 2 == 0, 0.6, 0.3)  # confident every other token
    conf = torch.stack([shallow, torch.full((n,), 0.99)], 1)
    correct = torch.stack([torch.rand(n, generator=gen) < 0.8, torch.zeros(n, dtype=torch.bool)], 1)
    trace = HeadTrace((2, 7), conf, correct, (100,) * 4)
    costs = ScheduleCosts(row=0.05, head=0.1, output=1.0)
    tuned = tune(trace, 8, costs)
    assert tuned.gammas[2] < 0.6 and tuned.gammas.get(7, 1.0) > 0.99
    assert tuned.prediction.speedup > simulate(trace, [0.97, 0.97], 8, costs).speedup
    assert tuned.prediction.speedup > 1
    with pytest.raises(InvalidArgumentError):
        tune(trace, 8, costs, grid=[1.5])


def test_trace_must_be_consistent():
    with pytest.raises(InvalidArgumentError):
        _trace([2, 4], [[0.5, 0.5]], [[True, True]], [2])
    with pytest.raises(InvalidArgumentError):
        _trace([4, 2], [[0.5, 0.5]], [[True, True]], [1])
    with pytest.raises(InvalidArgumentError):
        ScheduleCosts.from_sizes(0, 1, 1)


# ----------------------------------------------------------- replay == real decoding
PROMPT = [5, 17, 42, 99, 3, 250, 7]
LAYERS = [2, 4, 6]
SHARPEN = 10.0


@pytest.fixture(scope="module")
def executor():
    """Layers 2-7 write little into the residual stream, so the heads (the model's own output
    at layers 2, 4, 6, sharpened) agree with the last layer 70-85% of the time: both
    accepted and rejected early predictions occur."""
    model = tiny_model("llama", seed=11, num_layers=8)
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return LayerExecutor(model)


def _head(executor):
    return lambda hidden: executor.logits(hidden) * SHARPEN


@torch.inference_mode()
def _greedy_trace(executor, tokens, start):
    """Each head's confidence / correctness at positions ``start ..`` of ``tokens`` (the
    greedy sequence), from one full forward with every layer's hidden state."""
    out = executor.model(torch.tensor([tokens]), output_hidden_states=True)
    final = out.logits[0].argmax(-1)
    conf, correct = [], []
    for layer in LAYERS:
        probs = _head(executor)(out.hidden_states[layer])[0].float().softmax(-1)
        c, top = probs.max(-1)
        conf.append(c)
        correct.append(top == final)
    n = len(tokens) - 1 - start  # positions that predict a following token
    return HeadTrace(tuple(LAYERS), torch.stack(conf, 1)[start:start + n],
                     torch.stack(correct, 1)[start:start + n], (n,))


@pytest.mark.parametrize("gammas,max_early", [
    ([0.5, 0.7, 0.9], 5), ([0.8, 0.8, 0.8], 2), ([0.6, 0.99, 0.5], 3)])
def test_the_replay_predicts_what_decoding_does(executor, gammas, max_early):
    """Drafts and accepted early predictions of a real greedy AdaDecode run equal the
    replay's on that run's own output (the premise of tuning by replay)."""
    heads = [_head(executor)] * len(LAYERS)
    exits = ThresholdExits(LAYERS, heads, gammas)
    step = SpeculativeStep(ExitDrafter(executor, exits, BufferStopRule(max_early)))
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    reference = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=40)
    assert state.tokens == reference.tokens
    # The first new token comes from the prefill; drafting starts at its position.
    trace = _greedy_trace(executor, state.tokens, len(PROMPT))
    p = simulate(trace, gammas, executor.num_layers, FREE, max_early)
    assert state.stats.drafted > state.stats.accepted > 0
    assert round(p.drafts_per_token * p.tokens) == state.stats.drafted
    assert round(p.acceptance * p.drafts_per_token * p.tokens) == state.stats.accepted


def test_per_head_thresholds_in_decoding(executor):
    heads = [_head(executor)] * len(LAYERS)
    assert ThresholdExits(LAYERS, heads, [0.1, 0.5, 0.9]).gammas == [0.1, 0.5, 0.9]
    assert ThresholdExits(LAYERS, heads, 0.75).gammas == [0.75] * 3
    with pytest.raises(InvalidArgumentError, match="one threshold per head"):
        ThresholdExits(LAYERS, heads, [0.5, 0.5])
    with pytest.raises(InvalidArgumentError, match="gamma"):
        ThresholdExits(LAYERS, heads, [0.5, 1.5, 0.5])


def test_tuned_option_without_tuned_thresholds_says_what_to_run(executor):
    with pytest.raises(InvalidArgumentError, match="tuned"):
        build_step("adadecode", executor, {"heads": "none", "tuned": True})
    with pytest.raises(InvalidArgumentError, match="drop gamma, draft_vocab"):
        build_step("adadecode", executor, {"heads": "none", "tuned": True, "gamma": 0.9,
                                           "draft_vocab": 64})


def test_card_round_trip_keeps_the_tuned_schedule():
    from selfspec.heads.fingerprint import ModelFingerprint

    ac = AdaDecodeCard(layers=[7, 21], gammas=[0.9, 0.99], draft_vocab=4096, max_early=5,
                       row_cost=0.05, head_cost=0.19, output_cost=5.0, data=["onpolicy:humaneval"],
                       tokens=100, speedup=1.3, acceptance=0.8, drafts_per_token=0.6,
                       test_tokens=90, test_speedup=1.25, test_acceptance=math.nan,
                       paper_test_speedup=1.0, draft_vocabs=[4096, 0], vocab_speedups=[1.3, 1.2])
    fp = ModelFingerprint("a" * 64, "b" * 64, [1.0])
    card = HeadCard("m", fp, "lightweight", [7, 21], 28, 16, 100, adadecode=ac)
    back = HeadCard.from_dict(card.to_dict())
    assert back.adadecode.gammas == [0.9, 0.99] and back.adadecode.draft_vocab == 4096
    assert math.isnan(back.adadecode.test_acceptance)
    assert HeadCard.from_dict({k: v for k, v in card.to_dict().items()
                               if k != "adadecode"}).adadecode is None
