"""The stop rule that ends a draft where its predicted tokens/s peak
(decoding/planning/tpt_stop.py)."""

import pytest

from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.stop_rules import ConstantStopRule, DraftTokenInfo
from selfspec.decoding.planning.tpt import AcceptanceEstimate
from selfspec.decoding.planning.tpt_stop import (
    CONFIDENCE_EDGES,
    ConfidenceCalibration,
    TptStopRule,
)


def token(index, top1, eos=False):
    return DraftTokenInfo(index=index, token_id=7, prob=top1, top1_prob=top1, is_eos=eos)


def calibration(average=0.8, **kwargs):
    return ConfidenceCalibration(AcceptanceEstimate(prior=average, prior_weight=1e9), "d",
                                 **kwargs)


def test_buckets_follow_the_edges():
    assert ConfidenceCalibration.bucket(0.0) == 0
    assert ConfidenceCalibration.bucket(0.999) == len(CONFIDENCE_EDGES)
    assert ConfidenceCalibration.bucket(CONFIDENCE_EDGES[2]) == 3  # an edge opens its bucket


def test_calibration_counts_tokens_up_to_the_first_rejection_only():
    cal = calibration(average=0.5, prior_weight=1.0, decay=1.0)
    # accepted at 0.999 and 0.999, rejected at 0.4; the 0.2 after it was never judged
    cal.update([0.999, 0.999, 0.4, 0.2], accepted=2)
    assert cal.rate(0.995) == pytest.approx((2 + 0.5) / 3)
    assert cal.rate(0.45) == pytest.approx(0.5 / 2)
    assert cal.rate(0.1) == 0.5  # unseen bucket: the drafter's average
    assert set(cal.observed_rates()) == {cal.bucket(0.999), cal.bucket(0.4)}
    cal.update([0.999, 0.999], accepted=2)  # a fully accepted draft: no failure
    assert cal.rate(0.999) == pytest.approx((4 + 0.5) / 5)


def test_calibration_starts_buckets_from_carried_rates():
    cal = calibration(average=0.5, priors={6: 0.99}, priors_weight=4.0)
    assert cal.rate(0.999) == 0.99 and cal.rate(0.6) == 0.5


def flat(ms=200.0):
    return lambda num_tokens: ms


def draft_len(rule, confidences):
    rule.reset()
    for i, p in enumerate(confidences):
        if rule.should_stop(token(i, p)):
            return i + 1
    return len(confidences)


def test_confident_drafts_run_long_and_doubtful_tokens_end_them():
    """Verification costs the same for any block (AMX-like): drafts go on while their
    tokens are confident and stop right after one the calibration says is a coin toss."""
    cal = calibration(average=0.9, priors={6: 0.995, 1: 0.2}, priors_weight=100.0)
    rule = TptStopRule(ConstantStopRule(16), cal, lambda: 50.0, flat())
    assert draft_len(rule, [0.999] * 20) == 16
    assert draft_len(rule, [0.999] * 5 + [0.4] + [0.999] * 10) == 6


def test_expensive_drafts_of_a_poor_drafter_stop_at_once():
    rule = TptStopRule(ConstantStopRule(16), calibration(average=0.3), lambda: 150.0, flat())
    assert draft_len(rule, [0.999] * 8) == 1


def test_the_stop_point_maximises_the_predicted_tokens_per_second():
    """With one acceptance for every token, the rule stops where the TPT of KnapSpec eq. 4
    (per-position form) peaks."""
    from selfspec.decoding.planning.tpt import best_draft_len
    for alpha in (0.6, 0.8, 0.9, 0.95):
        fwd = lambda t: 100.0 + 8.0 * t
        rule = TptStopRule(ConstantStopRule(16), calibration(average=alpha), lambda: 20.0, fwd)
        best = best_draft_len([alpha] * 16, 20.0, fwd, min_len=1)
        assert draft_len(rule, [0.5] * 16) == best.draft_len, alpha


def test_the_inner_rule_keeps_its_say_and_sees_every_verification():
    inner = ConstantStopRule(3)
    cal = calibration(average=0.99, decay=1.0)
    rule = TptStopRule(inner, cal, lambda: 1.0, flat())
    assert draft_len(rule, [0.999] * 10) == 3  # its max_draft_len
    rule.reset()
    assert rule.should_stop(token(0, 0.999, eos=True))  # EOS
    rule.max_draft_len = 7
    assert inner.max_draft_len == 7
    rule.reset()
    draft_len(rule, [0.999, 0.6, 0.2])
    rule.update(StepStats(num_drafted=3, num_accepted=1))
    assert set(cal.observed_rates()) == {cal.bucket(0.999), cal.bucket(0.6)}


def test_one_slow_first_forward_does_not_set_the_forward_costs():
    """The first forward of a generation can take twice the latency model's time (a slow
    first call); it moves the predictions by one smoothing step, not to its own value, and
    steady observations then pull them to the measured times."""
    from selfspec.decoding.planning.tpt import ForwardCosts
    from selfspec.executor.cost_model import LatencyModel
    costs = ForwardCosts(LatencyModel(4, 0.0, 10.0, 10.0, 20.0, verify_token_ms=1.0),
                         smoothing=0.2)
    prior = costs.forward_ms(2)
    costs.observe(2, 2.3 * prior)
    assert costs.forward_ms(2) == pytest.approx(1.2 * prior)  # clipped to 2x, weight 0.2
    assert costs.forward_ms(9) == pytest.approx(1.2 * costs.prior_ms(9))
    for _ in range(40):
        costs.observe(2, 0.9 * prior)
    assert costs.forward_ms(2) == pytest.approx(0.9 * prior, rel=0.01)
