"""State-reading SpecEE predictors (ours; heads/predictor.py module doc): the MLP also reads
the layer's state after the final norm."""

import math

import pytest
import torch
import torch.nn.functional as F

from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.decoding.specee.step import HeadCandidates, PredictorSchedule, SpecEEStep
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, load_heads, save_heads
from selfspec.heads.card import PredictorCard
from selfspec.heads.files import new_card
from selfspec.heads.modules import make_head, output_layer
from selfspec.heads.predictor import STATE_SCALE, ExitPredictors
from selfspec.methods.registry import build_step
from selfspec.training.predictors import (
    PredictorData,
    PredictorTrainConfig,
    evaluate_predictors,
    fit_predictors,
    predictor_data,
)

from tiny import last_position_states, run_step, tiny_model

K, NUM_LAYERS, CAND_LAYER = 4, 6, 2
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def test_state_predictor_by_hand_and_batched():
    torch.manual_seed(0)
    pred = ExitPredictors([3, 4, 5], K, hidden=16, state_dim=8)
    with torch.no_grad():
        pred.feature_mean.normal_()
        pred.feature_std.uniform_(0.5, 2.0)
    x, s = torch.randn(7, 3 * K), torch.randn(7, 8)
    i = pred.index(4)
    inp = torch.cat([(x - pred.feature_mean[i]) / pred.feature_std[i],
                     s / s.norm(dim=-1, keepdim=True) * STATE_SCALE], -1)
    manual = torch.sigmoid(torch.relu(inp @ pred.fc1_weight[i].T + pred.fc1_bias[i])
                           @ pred.fc2_weight[i] + pred.fc2_bias[i])
    assert pred.fc1_weight.shape == (3, 16, 3 * K + 8)
    assert torch.allclose(pred.prob(4, x, s), manual, atol=1e-5)
    batched = pred.logits_all(x.expand(3, 7, 3 * K), s.expand(3, 7, 8))
    assert torch.allclose(torch.sigmoid(batched[1]), manual, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="read the layer's state"):
        pred.prob(4, x)
    with pytest.raises(InvalidArgumentError, match="state_dim"):
        ExitPredictors([3], K, state_dim=-1)
    assert set(pred.tensors()) >= {"feature_mean", "feature_std"}
    assert "feature_mean" not in ExitPredictors([3], K).tensors()   # SpecEE's files unchanged


def test_state_predictors_learn_what_only_the_state_says():
    """Labels set by the state's direction, features pure noise: SpecEE's 12-feature MLP is
    near chance, the state-reading one learns the rule (and fit refuses to train one without
    states)."""
    torch.manual_seed(0)
    n, layers, h = 800, [2, 3], 16
    feats = torch.randn(len(layers), n, 3 * K)
    states = torch.randn(len(layers), n, h)
    labels = states[..., 0] > 0
    data = PredictorData(layers, feats, labels, torch.zeros(len(layers), n, dtype=torch.long),
                         torch.ones(n, dtype=torch.bool), states)
    config = PredictorTrainConfig(epochs=40, hidden=32, batch=64)
    plain = evaluate_predictors(fit_predictors(data, K, config), data, num_layers=4)
    state_cfg = PredictorTrainConfig(epochs=40, hidden=32, batch=64, state=True)
    model = fit_predictors(data, K, state_cfg)
    assert model.state_dim == h
    # standardisation comes from the training features
    assert torch.allclose(model.feature_mean, feats.mean(1)) and torch.allclose(
        model.feature_std, feats.std(1))
    with_state = evaluate_predictors(model, data, num_layers=4)
    assert min(with_state.accuracy) > 0.9 > max(plain.accuracy) - 0.1
    assert max(plain.accuracy) < 0.75
    no_states = PredictorData(layers, feats, labels, data.picks, data.recall)
    with pytest.raises(InvalidArgumentError, match="need the layers' states"):
        fit_predictors(no_states, K, state_cfg)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


def test_predictor_data_keeps_each_layers_normed_state(executor):
    torch.manual_seed(0)
    layers = [2, 3, 4]
    n, h = 9, executor.model.config.hidden_size
    hidden = {x: torch.randn(n, h) for x in layers}
    cands = torch.randint(0, 100, (n, K))
    final = torch.randint(0, 100, (n,))
    plain = predictor_data(executor, hidden, cands, final, layers, batch_tokens=4)
    data = predictor_data(executor, hidden, cands, final, layers, batch_tokens=4,
                          with_states=True)
    assert plain.states is None and data.states.shape == (3, n, h)
    for j, x in enumerate(layers):
        assert torch.allclose(data.states[j], executor.final_norm(hidden[x]))
    assert torch.equal(data.features, plain.features) and torch.equal(data.labels, plain.labels)
    # index: rows of a larger set, sliced chunk by chunk, as if gathered first
    index = torch.tensor([8, 0, 3, 3, 5])
    sub = predictor_data(executor, hidden, cands[index], final[index], layers, batch_tokens=2,
                         with_states=True, index=index)
    gathered = predictor_data(executor, {x: hidden[x][index] for x in layers}, cands[index],
                              final[index], layers, with_states=True)
    assert torch.equal(sub.features, gathered.features) and torch.equal(sub.states, gathered.states)
    with pytest.raises(InvalidArgumentError, match="positions in index"):
        predictor_data(executor, hidden, cands, final, layers, index=index)


class _Recorder(ExitPredictors):
    """State-reading predictors that never fire and record what they were given."""

    def __init__(self, layers):
        super().__init__(layers, K, hidden=8, state_dim=0)
        self.seen = []

    def prob(self, layer, features, state=None):
        self.seen.append((layer, None if state is None else state.clone()))
        return torch.zeros(())


def test_decoding_hands_the_predictor_the_layers_normed_state(executor):
    """The state a predictor reads while decoding is the final norm of the hidden state after
    ``layer`` layers of the token being decoded (checked against a no-cache forward)."""
    own = lambda hidden: executor.logits(hidden)
    pred = _Recorder(list(range(CAND_LAYER, NUM_LAYERS)))
    step = SpecEEStep(HeadCandidates(executor, CAND_LAYER, own, K), pred,
                      PredictorSchedule(pred.layers, None), 0.5,
                      lambda ex, cache: make_skipped_kv("propagate", ex, cache))
    state = run_step(executor, step, PROMPT, max_new_tokens=2)
    tokens = state.tokens[:len(PROMPT) + 1]      # the second token was decoded by the step
    states = last_position_states(executor, tokens)
    with torch.inference_mode():
        expected = {x: executor.final_norm(h)[-1] for x, h in states.items()}
    assert [x for x, _ in pred.seen] == pred.layers
    for layer, seen in pred.seen:
        assert torch.allclose(seen.float(), expected[layer].float(), atol=1e-4), layer


def _state_predictors(fire: bool, h: int) -> ExitPredictors:
    pred = ExitPredictors(list(range(CAND_LAYER, NUM_LAYERS)), K, hidden=8, state_dim=h)
    with torch.no_grad():
        pred.fc2_weight.zero_()
        pred.fc2_bias.fill_(30.0 if fire else -30.0)
    return pred.eval().requires_grad_(False)


def _head_file(executor, tmp_path, fire):
    out = output_layer(executor)
    head = make_head("lightweight", CAND_LAYER, out, init="lm_head").prepare_inference()
    card = new_card(executor.model, "lightweight", [CAND_LAYER])
    heads = ExitHeads([CAND_LAYER], [head], card)
    pred = _state_predictors(fire, executor.model.config.hidden_size)
    with torch.no_grad():
        pred.feature_mean.normal_()
    heads.predictors = pred
    n = len(pred.layers)
    card.predictors = PredictorCard(
        candidate_layer=CAND_LAYER, num_candidates=K, draft_vocab=0, hidden=pred.hidden,
        layers=pred.layers, offline_layers=[4, 5], exit_frequency=[0.1] * n,
        candidate_recall=0.5, base_rate=[0.2] * n, accuracy=[0.8] * n,
        precision=[0.9] * n, train_tokens=10, eval_tokens=5, epochs=1, seconds=0.1,
        state_dim=pred.state_dim)
    return save_heads(heads, tmp_path / "heads.safetensors"), pred


def test_state_predictors_round_trip_and_decode_under_each_kv_policy(executor, tmp_path):
    path, saved = _head_file(executor, tmp_path, fire=False)
    loaded = load_heads(path, executor)
    assert loaded.card.predictors.state_dim == executor.model.config.hidden_size
    for name, t in saved.tensors().items():
        assert torch.equal(loaded.predictors.tensors()[name], t), name
    ref = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=12).tokens
    for policy in KV_POLICIES:
        step = build_step("specee", executor, {"heads": str(path), "kv": policy,
                                                "threshold": 0.5})
        state = run_step(executor, step, PROMPT, max_new_tokens=12)
        assert state.tokens == ref and state.stats.mean_exit_layer == NUM_LAYERS
    path, _ = _head_file(executor, tmp_path, fire=True)
    state = run_step(executor, build_step("specee", executor, {"heads": str(path),
                                                               "threshold": 0.5}),
                     PROMPT, max_new_tokens=6)
    assert state.stats.mean_exit_layer < NUM_LAYERS
    # the default threshold of state-reading predictors comes from the card's held-out sweep
    with pytest.raises(InvalidArgumentError, match="reaches token accuracy 0.97"):
        build_step("specee", executor, {"heads": str(path)})


def test_a_card_without_state_dim_is_specee_12_features():
    """Files written before state-reading predictors keep loading as SpecEE's."""
    from selfspec.heads.card import _predictor_card

    pc = _predictor_card({
        "candidate_layer": 2, "num_candidates": 4, "draft_vocab": 0, "hidden": 8,
        "layers": [2, 3], "offline_layers": [3], "exit_frequency": [0.1, 0.1],
        "candidate_recall": 0.5, "base_rate": [0.2, 0.2], "accuracy": [0.8, 0.8],
        "precision": [None, 0.9], "train_tokens": 1, "eval_tokens": 1, "epochs": 1,
        "seconds": 0.1})
    assert pc.state_dim == 0 and math.isnan(pc.precision[0])


def test_state_predictor_input_is_scale_free_in_the_state():
    torch.manual_seed(0)
    pred = ExitPredictors([3], K, hidden=8, state_dim=6)
    x, s = torch.randn(2, 3 * K), torch.randn(2, 6)
    assert torch.allclose(pred.prob(3, x, s), pred.prob(3, x, 5 * s), atol=1e-6)
    assert torch.allclose(F.normalize(s, dim=-1), s / s.norm(dim=-1, keepdim=True))


def _sweep_card(state_dim):
    return PredictorCard(
        candidate_layer=2, num_candidates=K, draft_vocab=0, hidden=8, layers=[2, 3],
        offline_layers=[3], exit_frequency=[0.1, 0.1], candidate_recall=0.5,
        base_rate=[0.2, 0.2], accuracy=[0.8, 0.8], precision=[0.9, 0.9], train_tokens=1,
        eval_tokens=1, epochs=1, seconds=0.1, thresholds=[0.5, 0.9, 0.99, 0.999],
        token_accuracy=[0.6, 0.84, 0.975, 0.997], mean_layers=[10, 19, 24.6, 26.7],
        state_dim=state_dim)


def test_exit_threshold_from_options_or_the_cards_held_out_sweep():
    from selfspec.methods.specee import DEFAULT_THRESHOLD, Options, exit_threshold

    plain, state = _sweep_card(0), _sweep_card(64)
    assert exit_threshold(Options(), plain) == DEFAULT_THRESHOLD
    # state-reading predictors are over-confident: by default the lowest threshold reaching
    # 97% held-out token accuracy
    assert exit_threshold(Options(), state) == 0.99
    assert exit_threshold(Options(threshold=0.7), state) == 0.7
    assert exit_threshold(Options(accuracy=0.8), plain) == 0.9
    assert exit_threshold(Options(accuracy=0.99), state) == 0.999
    with pytest.raises(InvalidArgumentError, match="not both"):
        exit_threshold(Options(threshold=0.7, accuracy=0.9), state)
    with pytest.raises(InvalidArgumentError, match="best 0.9970"):
        exit_threshold(Options(accuracy=0.999), state)


def test_state_predictor_training_refuses_what_memory_cannot_hold(monkeypatch):
    """Checked before the states are built, with the figures and what to change."""
    from selfspec.executor import cpu
    from selfspec.training.predictors import _check_state_memory

    monkeypatch.setattr(cpu, "available_memory_bytes", lambda: 8 * 10 ** 9)
    _check_state_memory(10_000, 25, 1536, 2)                  # 0.8 GB: fine
    with pytest.raises(InvalidArgumentError, match=r"need 9.2 GB, 8.0 GB is available; give "
                                                   r"fewer --tokens"):
        _check_state_memory(120_000, 25, 1536, 2)
    monkeypatch.setattr(cpu, "available_memory_bytes", lambda: None)
    _check_state_memory(10 ** 9, 25, 1536, 2)                 # unknown: not refused


def test_state_reading_training_settings_and_one_probability_pass_per_sweep():
    """The CLI and library users get the same measured settings; a sweep's figures from
    probabilities computed once equal evaluating at each threshold."""
    from selfspec.heads.predictor import STATE_PREDICTOR_HIDDEN
    from selfspec.training.predictors import exit_figures, predictor_probs

    cfg = PredictorTrainConfig.state_reading()
    assert (cfg.state, cfg.hidden, cfg.epochs, cfg.lr) == (True, STATE_PREDICTOR_HIDDEN, 8, 2e-3)
    assert PredictorTrainConfig.state_reading(3).epochs == 3
    torch.manual_seed(0)
    layers, n, h = [2, 3], 50, 16
    data = PredictorData(layers, torch.randn(2, n, 3 * K), torch.rand(2, n) > 0.5,
                         torch.zeros(2, n, dtype=torch.long), torch.ones(n, dtype=torch.bool),
                         torch.randn(2, n, h))
    model = ExitPredictors(layers, K, hidden=8, state_dim=h)
    prob = predictor_probs(model, data)
    for t in (0.3, 0.5, 0.9):
        # (repr: NaN precision where a layer never fires compares unequal to itself)
        assert repr(exit_figures(prob, data, 4, t)) == repr(evaluate_predictors(model, data, 4, t))
