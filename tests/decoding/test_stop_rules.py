"""Tests of selfspec.decoding.drafting.stop_rules on scripted probability sequences."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.decoding.drafting.stop_rules import (
    GAMMA_MAX,
    GAMMA_MIN,
    STOP_RULES,
    AdaptiveGamma,
    ConfidenceStopRule,
    ConstantStopRule,
    DraftTokenInfo,
    ProductStopRule,
    StepStats,
    StopRule,
    ThresholdStopRule,
    make_stop_rule,
)
from selfspec.errors import InvalidArgumentError


def stop_index(rule: StopRule, probs: list[float], *, top1: list[float] | None = None,
               scores: list[float | None] | None = None, eos_at: int | None = None) -> int | None:
    """Drive ``rule`` like a drafter over scripted tokens; index of the last drafted token,
    or None if the script ran out first."""
    rule.reset()
    for i, prob in enumerate(probs):
        token = DraftTokenInfo(
            index=i, token_id=i, prob=prob,
            top1_prob=prob if top1 is None else top1[i],
            is_eos=i == eos_at,
            score=None if scores is None else scores[i],
        )
        if rule.should_stop(token):
            return i
    return None


ALL_RULES = [
    ConstantStopRule(draft_len=5),
    ThresholdStopRule(adaptive=False),
    ProductStopRule(adaptive=False),
    ConfidenceStopRule(),
]


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: type(r).__name__)
def test_rules_satisfy_the_protocol(rule):
    assert isinstance(rule, StopRule)


# ---------------------------------------------------------------- stop positions


@pytest.mark.parametrize("draft_len", [1, 3, 8])
def test_constant_stops_after_exactly_draft_len_tokens(draft_len):
    rule = ConstantStopRule(draft_len)
    assert rule.max_draft_len == draft_len
    for _ in range(2):  # and again after a reset
        assert stop_index(rule, [0.01] * 20) == draft_len - 1


def test_constant_respects_a_smaller_max_draft_len():
    assert stop_index(ConstantStopRule(6, max_draft_len=4), [1.0] * 10) == 3


def test_threshold_stops_at_first_probability_below_gamma():
    rule = ThresholdStopRule(gamma=0.8, adaptive=False)
    assert stop_index(rule, [0.9, 0.85, 0.7, 0.95, 0.1]) == 2
    assert stop_index(rule, [0.8, 0.8, 0.79]) == 2  # == gamma continues; < gamma stops
    assert stop_index(rule, [0.3]) == 0


def test_threshold_and_product_use_the_score_when_given():
    probs = [0.99, 0.99, 0.99, 0.99]
    scores = [0.9, 0.5, 0.9, 0.9]
    assert stop_index(ThresholdStopRule(gamma=0.8, adaptive=False), probs, scores=scores) == 1
    # product of scores: 0.9, 0.45 < 0.6
    assert stop_index(ProductStopRule(gamma=0.6, adaptive=False), probs, scores=scores) == 1
    # None scores fall back to prob: 0.99^k stays above 0.6 for 4 tokens
    assert stop_index(ProductStopRule(gamma=0.6, adaptive=False), probs,
                      scores=[None] * 4) is None


def test_product_stops_where_threshold_does_not():
    probs = [0.95, 0.9, 0.9, 0.9, 0.9]  # products 0.95, 0.855, 0.7695, 0.69255
    assert stop_index(ProductStopRule(gamma=0.7, adaptive=False), probs) == 3
    assert stop_index(ThresholdStopRule(gamma=0.7, adaptive=False), probs) is None


def test_product_restarts_at_each_draft():
    rule = ProductStopRule(gamma=0.7, adaptive=False)
    assert stop_index(rule, [0.8, 0.8]) == 1  # 0.64 < 0.7
    assert stop_index(rule, [0.8, 0.9]) is None  # 0.72: the old product is gone
    # Also without reset(): a token with index 0 starts a new product.
    rule.should_stop(DraftTokenInfo(index=0, token_id=0, prob=0.75, top1_prob=0.75))
    assert not rule.should_stop(DraftTokenInfo(index=0, token_id=0, prob=0.75, top1_prob=0.75))


@settings(max_examples=100, deadline=None)
@given(probs=st.lists(st.floats(0.0, 0.95), min_size=90, max_size=90),
       gamma=st.floats(0.011, 0.989))
def test_product_stops_when_probabilities_are_bounded_away_from_one(probs, gamma):
    # AdaSPEED §II.A: with p <= 0.95 the product is < gamma within ceil(log gamma / log 0.95)
    # tokens (<= 88 for gamma >= 0.011, so 90 scripted tokens suffice).
    rule = ProductStopRule(gamma=gamma, adaptive=False, max_draft_len=10_000)
    bound = math.ceil(math.log(gamma) / math.log(0.95))
    index = stop_index(rule, probs)
    assert index is not None and index <= bound


def test_confidence_stops_at_first_low_top1_probability():
    rule = ConfidenceStopRule()  # tau = 0.7
    top1 = [0.9, 0.75, 0.69, 0.99]
    assert stop_index(rule, [0.1, 0.1, 0.1, 0.1], top1=top1) == 2  # uses top1, not prob
    assert stop_index(ConfidenceStopRule(tau=0.5), [0.6] * 3, top1=[0.6] * 3) is None


@pytest.mark.parametrize("rule", [
    ThresholdStopRule(adaptive=False, max_draft_len=5),
    ProductStopRule(adaptive=False, max_draft_len=5),
    ConfidenceStopRule(max_draft_len=5),
    ConstantStopRule(draft_len=5),
], ids=lambda r: type(r).__name__)
def test_every_rule_stops_at_max_draft_len_and_at_eos(rule):
    assert stop_index(rule, [1.0] * 20) == 4
    assert stop_index(rule, [1.0] * 20, eos_at=2) == 2
    assert stop_index(rule, [1.0] * 20, eos_at=0) == 0


def test_default_max_draft_len_is_eight():
    # Draft & Verify's max_step_draft = 8.
    for rule in (ThresholdStopRule(), ProductStopRule(), ConfidenceStopRule()):
        assert rule.max_draft_len == 8


# ---------------------------------------------------------------- adaptive gamma


def test_adaptive_gamma_follows_the_appendix_equations():
    # beta1 = 0.5, beta2 = 0.9, epsilon = 0.01, alpha = 0.9, AR starts at 0.
    rule = ThresholdStopRule(gamma=0.8)
    rule.update(StepStats(num_drafted=4, num_accepted=4))   # AR = 0.5 <= 0.9: up
    assert rule.gamma == pytest.approx(0.9 * 0.8 + 0.1 * 0.81)
    assert rule.smoothed_acceptance_rate == pytest.approx(0.5)
    for _ in range(2):                                         # AR = 0.75, 0.875: up
        rule.update(StepStats(num_drafted=4, num_accepted=4))
    assert rule.gamma == pytest.approx(0.803)
    rule.update(StepStats(num_drafted=4, num_accepted=4))     # AR = 0.9375 > 0.9: down
    assert rule.gamma == pytest.approx(0.802)


@pytest.mark.parametrize("name", ["threshold", "product"])
def test_adaptive_gamma_rises_with_low_acceptance_and_falls_with_high(name):
    low = make_stop_rule(name, gamma=0.5)
    for _ in range(50):
        low.update(StepStats(num_drafted=5, num_accepted=1))
    assert low.gamma > 0.5

    high = make_stop_rule(name, gamma=0.5)
    for _ in range(50):
        high.update(StepStats(num_drafted=5, num_accepted=5))
    assert high.gamma < 0.5


def test_adaptive_gamma_holds_when_drafts_hit_max_draft_len():
    # Official D&V code: high acceptance on a full-length draft leaves gamma unchanged.
    held = ThresholdStopRule(gamma=0.5, max_draft_len=4)
    free = ThresholdStopRule(gamma=0.5, max_draft_len=4, hold_at_max_draft_len=False)
    for rule in (held, free):
        for _ in range(5):  # AR climbs above alpha = 0.9 (gamma goes up meanwhile)
            rule.update(StepStats(num_drafted=4, num_accepted=4))
    before = held.gamma
    held.update(StepStats(num_drafted=4, num_accepted=4))
    assert held.gamma == before
    before = free.gamma
    free.update(StepStats(num_drafted=4, num_accepted=4))
    assert free.gamma < before


def test_adaptive_gamma_stays_inside_the_open_unit_interval():
    up = AdaptiveGamma(0.9, beta2=0.0, epsilon=0.5)
    up.update(StepStats(num_drafted=4, num_accepted=0), max_draft_len=8)
    assert up.gamma == GAMMA_MAX
    down = AdaptiveGamma(0.1, beta1=0.0, beta2=0.0, epsilon=0.5)
    down.update(StepStats(num_drafted=4, num_accepted=4), max_draft_len=8)
    assert down.gamma == GAMMA_MIN


def test_non_adaptive_and_empty_drafts_leave_gamma_unchanged():
    fixed = ThresholdStopRule(gamma=0.6, adaptive=False)
    fixed.update(StepStats(num_drafted=4, num_accepted=0))
    assert fixed.gamma == 0.6
    adaptive = ProductStopRule(gamma=0.6)
    adaptive.update(StepStats(num_drafted=0, num_accepted=0))
    assert adaptive.gamma == 0.6


def test_adapted_gamma_changes_the_stop_position():
    rule = ThresholdStopRule(gamma=0.8, beta2=0.0, epsilon=0.05)  # big steps for the test
    probs = [0.9, 0.83, 0.5]
    assert stop_index(rule, probs) == 2
    rule.update(StepStats(num_drafted=3, num_accepted=0))  # gamma -> 0.85
    assert stop_index(rule, probs) == 1


# ---------------------------------------------------------------- validation and registry


@pytest.mark.parametrize("name, params, message", [
    ("threshold", {"gamma": 0.0}, r"gamma must be in the open interval \(0, 1\)"),
    ("threshold", {"gamma": 1.0}, r"gamma must be in the open interval \(0, 1\)"),
    ("product", {"gamma": 1.5}, r"gamma must be in the open interval \(0, 1\)"),
    ("product", {"gamma": float("nan")}, r"gamma must be in the open interval \(0, 1\)"),
    ("threshold", {"gamma": -0.2}, r"gamma must be in the open interval \(0, 1\)"),
    ("confidence", {"tau": 0.0}, r"tau must be in the open interval \(0, 1\)"),
    ("confidence", {"tau": 1.0}, r"tau must be in the open interval \(0, 1\)"),
    ("constant", {"draft_len": 0}, r"draft_len must be an integer >= 1"),
    ("constant", {"draft_len": 2.5}, r"draft_len must be an integer >= 1"),
    ("constant", {"draft_len": 3, "max_draft_len": 0}, r"max_draft_len must be an integer >= 1"),
    ("threshold", {"max_draft_len": 0}, r"max_draft_len must be an integer >= 1"),
    ("threshold", {"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
    ("product", {"beta2": -0.1}, r"beta2 must be in \[0, 1\)"),
    ("product", {"epsilon": 0.0}, r"epsilon must be in the open interval"),
    ("threshold", {"alpha": 1.0}, r"alpha must be in the open interval"),
])
def test_invalid_parameters_raise_with_the_valid_range(name, params, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_stop_rule(name, **params)


def test_unknown_rule_lists_the_registered_names():
    with pytest.raises(InvalidArgumentError, match="constant, threshold, product, confidence"):
        make_stop_rule("entropy")


def test_unknown_or_missing_parameters_are_reported():
    with pytest.raises(InvalidArgumentError, match=r"unknown parameter.*'gama'.*gamma"):
        make_stop_rule("threshold", gama=0.5)
    with pytest.raises(InvalidArgumentError, match=r"missing required parameter.*draft_len"):
        make_stop_rule("constant")


def test_registry_builds_each_rule_and_is_read_only():
    assert isinstance(make_stop_rule("constant", draft_len=4), ConstantStopRule)
    assert isinstance(make_stop_rule("threshold"), ThresholdStopRule)
    assert isinstance(make_stop_rule("product", gamma=0.6), ProductStopRule)
    assert isinstance(make_stop_rule("confidence", tau=0.5), ConfidenceStopRule)
    with pytest.raises(TypeError):
        STOP_RULES["mine"] = ConstantStopRule  # type: ignore[index]


@pytest.mark.parametrize("drafted, accepted", [(3, 4), (-1, 0), (2, -1)])
def test_step_stats_validates_counts(drafted, accepted):
    with pytest.raises(InvalidArgumentError, match="num_accepted"):
        StepStats(num_drafted=drafted, num_accepted=accepted)


def test_step_stats_acceptance_rate():
    assert StepStats(num_drafted=4, num_accepted=3).acceptance_rate == 0.75
    assert StepStats(num_drafted=0, num_accepted=0).acceptance_rate == 0.0
