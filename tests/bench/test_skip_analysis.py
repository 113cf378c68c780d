"""KnapSpec's analyses (Figures 2-3, latency plot) run end to end on a tiny model with a
hand-made latency model, and produce their points and plots."""

import pytest

from selfspec.bench import skip_analysis as sa
from selfspec.executor.cost_model import LatencyModel

from bench_helpers import tiny_engine

pytest.importorskip("matplotlib")

LATENCY = LatencyModel(6, attn_slope_ms=0.01, attn_base_ms=0.2, mlp_ms=0.3, head_ms=0.2,
                       verify_token_ms=0.1, batched_row_ms=1e-4, key="hand-made")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def test_pearson():
    assert sa.pearson([1, 2, 3], [2, 4, 6.5]) == pytest.approx(0.9986, abs=1e-3)


def test_context_points_follow_the_weights(engine, tmp_path):
    document = [(7 * i) % 250 + 3 for i in range(300)]
    points = sa.context_points(engine, LATENCY, document, lengths=(32, 256))
    assert [p.context_len for p in points] == [32, 256]
    # t_attn(32) = 0.52 ms vs t_mlp 0.3: weights (2, 1); at 256: 2.76 ms → (5 capped, 1)
    assert (points[0].w_attn, points[0].w_mlp) == (2, 1)
    assert (points[1].w_attn, points[1].w_mlp) == (5, 1)
    for p in points:
        assert 0 <= p.skipped_attention <= 6 and 0 <= p.skipped_mlp <= 6 and p.candidates >= 1
    sa.plot_context(points, 6, "test", tmp_path / "ctx.png")
    assert (tmp_path / "ctx.png").stat().st_size > 0


def test_throughput_points_measure_every_config(engine, tmp_path):
    prompt = [5, 17, 42, 99, 3, 250, 7, 64, 12, 200, 31, 8, 77, 150, 9, 41, 2, 19, 88, 120] * 2
    points, ar_tps = sa.throughput_points(engine, LATENCY, prompt, [prompt[:20], prompt[5:30]],
                                          plans=4, draft_lens=(2, 3), max_new_tokens=12)
    assert ar_tps > 0 and len(points) >= 2 and len(points) % 2 == 0
    for p in points:
        assert 0 <= p.acceptance_rate <= 1 and p.tokens_per_s > 0 and p.predicted_tpt > 0
    if len({p.tokens_per_s for p in points}) > 1 and len({p.predicted_tpt for p in points}) > 1:
        out = sa.plot_throughput(points, ar_tps, "test", tmp_path / "tp.png")
        assert -1 <= out["pcc_tpt"] <= 1


def test_latency_points_pair_measured_and_predicted(engine, tmp_path):
    points = sa.latency_points(engine, LATENCY, lengths=(16, 64), repeats=2)
    assert [p.context_len for p in points] == [16, 64]
    assert points[1].attention_predicted == pytest.approx(0.84)
    assert all(p.attention_measured > 0 and p.token_measured > 0 for p in points)
    sa.plot_latency(points, "test", tmp_path / "lat.png")
    assert (tmp_path / "lat.png").stat().st_size > 0
