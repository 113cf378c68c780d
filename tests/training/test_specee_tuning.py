"""Verified SpecEE's per-layer thresholds tuned by replay (selfspec.training.specee_tuning):
hand-counted costs of the drafter and per-layer checks, the halves, the tuner, the trace from
predictor outputs, the card round trip, and ``specee:verify=true,tuned=true`` in decoding
(lossless, the card's layers and thresholds, errors that say what to do)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_specee import _head_file
from test_specee_verify import NUM_LAYERS, PROMPT

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel
from selfspec.heads.card import HeadCard, PredictorTuning
from selfspec.heads.files import load_heads, save_heads
from selfspec.methods.registry import build_step
from selfspec.training.adadecode_tuning import (
    HeadTrace,
    ScheduleCosts,
    output_cost_from_latency,
    row_cost_from_latency,
    simulate,
)
from selfspec.training.predictors import inner_outputs
from selfspec.training.specee_tuning import (
    SpecEECosts,
    ceiling,
    halves,
    predictor_trace,
    tune_thresholds,
)

from tiny import run_step, tiny_model


def test_the_drafter_is_paid_once_per_position_that_may_exit_and_each_check_its_own_cost():
    # L = 4, predictors after layers 1 and 2 that never fire; 3 positions of one sequence.
    # Positions 0 and 1 may exit: drafter 0.5 + checks 0.1 + 0.2, then 4 layers and the
    # output (1.0); position 2 (the last) may not: 4 layers + output.
    trace = HeadTrace((1, 2), torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.bool), (3,))
    costs = ScheduleCosts(row=0.0, head=9.0, output=1.0, scan=0.5)
    p = simulate(trace, [0.5, 0.5], 4, costs, check_costs=[0.1, 0.2])
    assert p.cost_per_token == pytest.approx((2 * (0.5 + 0.3 + 5) + 5) / 3)
    assert p.drafts_per_token == 0
    # head cost applies when no per-check costs are given (AdaDecode): 2 * 2 * 9 more
    q = simulate(trace, [0.5, 0.5], 4, ScheduleCosts(row=0.0, head=9.0, output=1.0))
    assert q.cost_per_token == pytest.approx((2 * 23 + 5) / 3)
    with pytest.raises(InvalidArgumentError, match="check cost per head"):
        simulate(trace, [0.5, 0.5], 4, costs, check_costs=[0.1])


def test_costs_are_byte_ratios_against_a_layer():
    c = SpecEECosts.from_sizes(1000, [10, 50], 200, 3000, row=0.1)
    assert c.checks == (0.01, 0.05)
    assert (c.schedule.scan, c.schedule.output, c.schedule.row) == (0.2, 3.0, 0.1)
    with pytest.raises(InvalidArgumentError):
        SpecEECosts.from_sizes(0, [1], 1, 1)
    with pytest.raises(InvalidArgumentError):
        SpecEECosts.from_sizes(10, [-1], 1, 1)


def test_halves_alternate_whole_sequences():
    conf = torch.arange(10, dtype=torch.float32).unsqueeze(1)
    trace = HeadTrace((3,), conf, torch.ones(10, 1, dtype=torch.bool), (2, 3, 1, 4))
    a, b = halves(trace)
    assert a.lengths == (2, 1) and a.confidence[:, 0].tolist() == [0, 1, 5]
    assert b.lengths == (3, 4) and b.confidence[:, 0].tolist() == [2, 3, 4, 6, 7, 8, 9]
    with pytest.raises(InvalidArgumentError, match="two held-out sequences"):
        halves(HeadTrace((3,), conf, torch.ones(10, 1, dtype=torch.bool), (10,)))


def _two_layer_trace(n=800):
    """A shallow predictor (layer 2 of 8) right 85% of the time when it says 0.9, and a deep
    one (layer 6) that says 0.999 and is always wrong."""
    gen = torch.Generator().manual_seed(0)
    shallow = torch.where(torch.arange(n) % 2 == 0, 0.9, 0.2)
    conf = torch.stack([shallow, torch.full((n,), 0.999)], 1)
    correct = torch.stack([torch.rand(n, generator=gen) < 0.85,
                           torch.zeros(n, dtype=torch.bool)], 1)
    return HeadTrace((2, 6), conf, correct, (100,) * (n // 100))


def test_tuner_keeps_a_paying_shallow_layer_and_silences_a_confident_wrong_one():
    trace = _two_layer_trace()
    costs = SpecEECosts.from_sizes(100, [1, 1], 10, 100, row=0.05)
    found = tune_thresholds(trace, 8, costs)
    assert found.thresholds.get(6, 1.0) > 0.999        # off, or above anything it says
    assert found.thresholds[2] < 0.9                    # the shallow layer exits
    # every single threshold of the grid lets the deep layer's wrong 0.999 exits through
    assert found.single_check.acceptance < found.tuned_check.acceptance
    assert found.tuned.speedup > 1 and found.tuned_check.speedup > found.single_check.speedup
    assert found.tuned.tokens + found.tuned_check.tokens == trace.confidence.shape[0]
    with pytest.raises(InvalidArgumentError, match="check costs"):
        tune_thresholds(trace, 8, SpecEECosts.from_sizes(100, [1], 10, 100))
    with pytest.raises(InvalidArgumentError, match="at least one threshold"):
        tune_thresholds(trace, 8, costs, grid=[None])


def test_positions_inside_a_draft_are_replayed_from_the_view_after_the_previous_exit():
    # L = 4, layers 1 and 2, one sequence of 4 positions, free checks and rows. At a draft's
    # start every position exits at layer 1 and is right; inside a draft, after an exit at
    # layer 1, the candidates are worse: position 1 does not exit (the drafter read an
    # exit-layer state), and after an exit at layer 2 (variant 1) it would exit, wrongly.
    conf = torch.full((4, 2), 0.99)
    correct = torch.ones(4, 2, dtype=torch.bool)
    after = torch.stack([torch.full((4, 2), 0.1), torch.full((4, 2), 0.99)])
    wrong = torch.zeros(2, 4, 2, dtype=torch.bool)
    costs = SpecEECosts(ScheduleCosts(row=0.0, head=0.0, output=1.0), (0.0, 0.0))
    start_only = simulate(HeadTrace((1, 2), conf, correct, (4,)), [0.5, 0.5], 4,
                          costs.schedule, check_costs=costs.checks)
    # as at a draft's start: positions 0-2 exit at layer 1 and are accepted, 3 runs every
    # layer: one verification, 4 tokens
    assert (start_only.tokens, start_only.drafts_per_token) == (4, 0.75)
    trace = HeadTrace((1, 2), conf, correct, (4,), (1, 2), after, wrong)
    inner = simulate(trace, [0.5, 0.5], 4, costs.schedule, check_costs=costs.checks)
    # position 0 exits, 1 (inside the draft, after an exit at layer 1) does not: 2 tokens;
    # then 2 exits, 3 is the last: 2 tokens
    assert (inner.tokens, inner.drafts_per_token, inner.acceptance) == (4, 0.5, 1.0)
    assert inner.cost_per_token > start_only.cost_per_token
    # the nearest traced exit layer stands in: layers 1 and 2 only, an exit at 2 -> variant 1
    deep = HeadTrace((1, 2), torch.tensor([[0.1, 0.99]] * 4), correct, (4,), (1, 2), after,
                     wrong)
    found = simulate(deep, [0.5, 0.5], 4, costs.schedule, check_costs=costs.checks)
    # position 1 exits after position 0's exit at 2, wrongly (with variant 0 it would not
    # exit); position 2 starts the next draft, exits at 2 and is right: 2 of 3 accepted
    assert (found.drafts_per_token, found.acceptance) == (0.75, pytest.approx(2 / 3))
    # halves and the perfect-predictor ceiling keep the inner view
    assert ceiling(trace, 4, costs).acceptance == 1.0
    with pytest.raises(InvalidArgumentError, match="inner trace"):
        HeadTrace((1, 2), conf, correct, (4,), (1,), after, wrong)


def test_no_inner_view_without_exit_layers():
    assert inner_outputs(None, [], lambda e: None, "main") is None


def test_ceiling_replays_perfect_predictors_at_every_layer():
    # L = 4, layers 1 and 2, one sequence of 3 positions, no row or check costs. Position 0
    # is right at layer 1 (the predictor says 0.1: a real one misses it), position 1 only at
    # layer 2, position 2 (the last, which may not exit) nowhere.
    conf = torch.tensor([[0.1, 0.1], [0.99, 0.1], [0.0, 0.0]])
    correct = torch.tensor([[True, True], [False, True], [False, False]])
    trace = HeadTrace((1, 2), conf, correct, (3,))
    costs = SpecEECosts(ScheduleCosts(row=0.0, head=0.0, output=1.0), (0.0, 0.0))
    best = ceiling(trace, 4, costs)
    # exits after 1 and 2 layers, accepted; their 3 and 2 deeper layers run with position 2's
    # 4, in one batch of free rows, and one output layer verifies all three
    assert (best.acceptance, best.drafts_per_token) == (1.0, pytest.approx(2 / 3))
    assert best.cost_per_token == pytest.approx((1 + 2 + 4 + 1) / 3)
    real = simulate(trace, [0.5, 0.5], 4, costs.schedule, check_costs=costs.checks)
    assert real.acceptance == 0 and best.speedup > real.speedup  # the 0.99 at layer 1 is wrong
    found = tune_thresholds(_two_layer_trace(), 8, SpecEECosts.from_sizes(100, [1, 1], 10, 100))
    assert found.ceiling_check.acceptance == 1.0
    assert found.ceiling_check.speedup >= found.tuned_check.speedup
    with pytest.raises(InvalidArgumentError, match="check costs"):
        ceiling(trace, 4, SpecEECosts(costs.schedule, (0.0,)))


def _latency(points, head_ms=6.0):
    # L = 2, attention 1 ms, MLP 1 ms, head 6 ms: one token's forward is 10 ms
    return LatencyModel(2, 0.0, 1.0, 1.0, head_ms, verify_points=points)


def test_row_cost_is_the_slope_of_this_machines_forwards_of_a_few_tokens():
    # extra time 2 ms per further token: 0.2 of a token whatever the forwards fitted
    linear = _latency(((1, 0.0), (2, 2.0), (4, 6.0), (8, 14.0)))
    assert row_cost_from_latency(linear) == pytest.approx(0.2)
    assert row_cost_from_latency(linear, 2) == pytest.approx(0.2)
    # T = 2: +1 ms, T = 3: +4 ms -> least squares through the origin: (1·1 + 2·4) / (1 + 4)
    convex = _latency(((1, 0.0), (2, 1.0), (3, 4.0), (6, 40.0)))
    assert row_cost_from_latency(convex, 3) == pytest.approx(1.8 / 10)
    # by default forwards up to 4 tokens (T = 4 interpolated between 3 and 6: +16 ms)
    assert row_cost_from_latency(convex) == pytest.approx((1 + 2 * 4 + 3 * 16) / 14 / 10)
    assert row_cost_from_latency(_latency(((1, 0.0), (2, 50.0))), 2) == 1.0     # clamped
    assert row_cost_from_latency(_latency(((1, 0.0), (2, 0.0))), 2) == 0.0
    with pytest.raises(InvalidArgumentError, match="tokens >= 2"):
        row_cost_from_latency(linear, 1)


def test_output_cost_is_this_machines_output_layer_over_one_layer():
    # L = 2, attention 1 ms, MLP 1 ms: a layer is 2 ms; the head 6 ms is 3 layers
    assert output_cost_from_latency(_latency(())) == pytest.approx(3.0)
    slow_attention = LatencyModel(2, 0.01, 1.0, 1.0, 6.0)  # +0.01 ms per cached position
    assert output_cost_from_latency(slow_attention, 100) == pytest.approx(6.0 / 3.0)
    # the measured cost replaces the bytes' (here 10 layers) in the replay's costs
    assert SpecEECosts.from_sizes(100, [1], 10, 1000).schedule.output == pytest.approx(10.0)
    assert SpecEECosts.from_sizes(100, [1], 10, 1000, output=4.5).schedule.output == 4.5
    with pytest.raises(InvalidArgumentError, match="positive output cost"):
        SpecEECosts.from_sizes(100, [1], 10, 1000, output=0.0)


def test_predictor_trace_from_outputs_and_sequence_ids():
    prob = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    labels = prob > 0.25
    trace = predictor_trace(prob, labels, [4, 5], torch.tensor([7, 7, 9, 9]))
    assert trace.layers == (4, 5) and trace.lengths == (2, 2)
    assert trace.confidence[2].tolist() == pytest.approx([0.3, 0.7])
    assert trace.correct[:, 0].tolist() == [False, False, True, True]
    with pytest.raises(InvalidArgumentError, match="consecutive"):
        predictor_trace(prob, labels, [4, 5], torch.tensor([7, 9, 7, 9]))
    with pytest.raises(InvalidArgumentError, match="predictor trace"):
        predictor_trace(prob, labels, [4], torch.tensor([7, 7, 9, 9]))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


@pytest.fixture(scope="module")
def reference(executor):
    return run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=30).tokens


TUNING = PredictorTuning(
    layers=[4, 6], thresholds=[0.9, 0.98], single_threshold=0.97, max_early=5, row_cost=0.05,
    scan_cost=0.2, output_cost=5.0, check_costs=[0.01, 0.06], data=["onpolicy:humaneval"],
    tokens=100, speedup=1.3, acceptance=0.8, drafts_per_token=0.6, check_tokens=90,
    check_speedup=1.25, check_acceptance=math.nan, single_check_speedup=1.2,
    ceiling_check_speedup=1.8, row_cost_source="given", output_cost_source="bytes",
    inner_layers=[], inner_drafter="")


def _tuned_file(executor, tmp_path, tuning=TUNING):
    path, _ = _head_file(executor, tmp_path, fire=True)
    heads = load_heads(path, executor)
    heads.card.predictors = dataclasses.replace(heads.card.predictors, tuning=tuning)
    return save_heads(heads, path)


def test_card_round_trip_keeps_the_tuning(executor, tmp_path):
    path = _tuned_file(executor, tmp_path)
    back = load_heads(path, executor).card.predictors.tuning
    assert back.layers == [4, 6] and back.thresholds == [0.9, 0.98]
    assert math.isnan(back.check_acceptance)
    assert back.ceiling_check_speedup == 1.8 and back.row_cost_source == "given"
    data = load_heads(path, executor).card.to_dict()
    del data["predictors"]["tuning"]  # predictors that were not tuned
    assert HeadCard.from_dict(data).predictors.tuning is None


def test_tuned_option_uses_the_cards_layers_and_thresholds_losslessly(
        executor, reference, tmp_path):
    path = _tuned_file(executor, tmp_path)
    step = build_step("specee", executor, {"heads": str(path), "verify": True, "tuned": True})
    scanner = step.exits.scanner
    assert scanner.schedule.active() == {4, 6}
    assert scanner._thresholds == {4: 0.9, 6: 0.98}
    state = run_step(executor, step, PROMPT, max_new_tokens=30)
    assert state.tokens == reference and state.stats.drafted > 0
    exits = {layer for layer, n in enumerate(state.stats.exit_counts) if n}
    assert exits <= {4, 6, executor.num_layers}


def test_tuned_option_errors_say_what_to_do(executor, tmp_path):
    path = _tuned_file(executor, tmp_path)
    with pytest.raises(InvalidArgumentError, match="add verify=true"):
        build_step("specee", executor, {"heads": str(path), "tuned": True})
    with pytest.raises(InvalidArgumentError, match="drop threshold, schedule"):
        build_step("specee", executor, {"heads": str(path), "verify": True, "tuned": True,
                                        "threshold": 0.9, "schedule": "all"})
    bare = _tuned_file(executor, tmp_path / "bare", tuning=None)
    with pytest.raises(InvalidArgumentError, match="no tuned thresholds.*onpolicy"):
        build_step("specee", executor, {"heads": str(bare), "verify": True, "tuned": True})
