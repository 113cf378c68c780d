"""SpecEE (speculative early exit, per-layer predictors on k candidates) on hand-built tensors
and tiny random models: features, predictors, the two-level schedule, the three policies for
the skipped layers' KV (cache invariants, masked attention), the Step and the method."""

import math

import pytest
import torch

from selfspec.decoding.ngram.lookup import ContextIndex
from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.decoding.specee.step import (
    HeadCandidates,
    PredictorSchedule,
    SpecEEStep,
    merge_ngram,
    ngram_token,
)
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, load_heads, save_heads
from selfspec.heads.card import PredictorCard
from selfspec.heads.files import new_card
from selfspec.heads.modules import make_head, output_layer
from selfspec.heads.predictor import ExitPredictors, candidate_features
from selfspec.methods.registry import build_step
from selfspec.training.predictors import (
    PredictorData,
    PredictorTrainConfig,
    evaluate_predictors,
    fit_predictors,
    offline_schedule,
)

from tiny import run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]
K = 4


# ------------------------------------------------------------------------- features
def test_candidate_features_by_hand():
    normed = torch.tensor([1.0, 2.0])
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    first = candidate_features(normed, rows, None, None)
    assert torch.allclose(first.logits, torch.tensor([1.0, 2.0, 3.0, 0.0]))
    assert torch.allclose(first.probs, torch.softmax(torch.tensor([1.0, 2.0, 3.0, 0.0]), -1))
    # the first feature layer's change is the probabilities themselves
    assert torch.allclose(first.features, torch.cat([first.logits, first.probs, first.probs]))
    bias = torch.tensor([0.0, 0.0, -3.0, 0.0])
    second = candidate_features(normed, rows, bias, first.probs)
    assert torch.allclose(second.logits, torch.tensor([1.0, 2.0, 0.0, 0.0]))
    assert torch.allclose(second.features[8:], second.probs - first.probs)
    assert second.features.shape == (12,)


def test_candidate_features_per_token_rows_match_shared_rows():
    torch.manual_seed(0)
    normed = torch.randn(5, 8)
    rows = torch.randn(K, 8)
    shared = candidate_features(normed, rows, None, None)
    per_token = candidate_features(normed, rows.expand(5, K, 8), None, None)
    assert torch.allclose(shared.features, per_token.features, atol=1e-5)


def test_predictor_mlp_by_hand_and_batched():
    torch.manual_seed(0)
    pred = ExitPredictors([3, 4, 5], K, hidden=16)
    x = torch.randn(7, 3 * K)
    i = pred.index(4)
    manual = torch.sigmoid(torch.relu(x @ pred.fc1_weight[i].T + pred.fc1_bias[i])
                           @ pred.fc2_weight[i] + pred.fc2_bias[i])
    assert torch.allclose(pred.prob(4, x), manual, atol=1e-6)
    batched = pred.logits_all(x.expand(3, 7, 3 * K))
    assert torch.allclose(torch.sigmoid(batched[1]), manual, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="no SpecEE predictor at layer 2"):
        pred.prob(2, x)
    with pytest.raises(InvalidArgumentError):
        ExitPredictors([4, 3], K)


# ------------------------------------------------------------------------- schedule
def test_schedule_all_runs_every_predictor():
    s = PredictorSchedule(range(2, 8), None)
    assert s.active() == frozenset(range(2, 8))
    s.record(3)
    assert s.active() == frozenset(range(2, 8))


def test_two_level_schedule_is_offline_union_neighbours_of_last_five_exits():
    s = PredictorSchedule(range(4, 24), offline=[20, 15])
    assert s.active() == {15, 20}
    s.record(10)
    assert s.active() == {15, 20, 8, 9, 10, 11, 12}
    s.record(24)  # a token that ran every layer (L = 24): neighbours 22, 23 have predictors
    assert s.active() == {15, 20, 8, 9, 10, 11, 12, 22, 23}
    for e in (5, 5, 5, 5):  # the queue keeps 5 exits: 10 falls out
        s.record(e)
    assert s.active() == {15, 20, 4, 5, 6, 7, 22, 23}
    s.reset()
    assert s.active() == {15, 20}
    with pytest.raises(InvalidArgumentError, match="no predictor"):
        PredictorSchedule(range(4, 24), offline=[2])


# ------------------------------------------------------------------------- training
def test_fit_predictors_learns_a_separable_rule_and_evaluation_counts_exits():
    torch.manual_seed(0)
    n, layers = 600, [2, 3, 4]
    feats = torch.randn(len(layers), n, 3 * K)
    labels = feats[..., 4] > 0.3   # "top local probability high" stands for the rule
    data = PredictorData(layers, feats, labels, torch.zeros(len(layers), n, dtype=torch.long),
                         torch.ones(n, dtype=torch.bool))
    model = fit_predictors(data, K, PredictorTrainConfig(epochs=60, hidden=32, batch=64))
    ev = evaluate_predictors(model, data, num_layers=6)
    assert min(ev.accuracy) > 0.9
    assert min(ev.precision) > 0.85
    # sequential exits: the first firing layer takes the token; shares sum to the exit rate
    fired = (torch.sigmoid(model.logits_all(feats)) > 0.5).any(0).float().mean()
    assert math.isclose(sum(ev.exit_frequency), float(fired), abs_tol=1e-6)
    assert 2 <= ev.mean_exit_layer <= 6
    assert ev.exit_frequency[0] >= ev.exit_frequency[1]  # most tokens go at the first layer
    assert offline_schedule(layers, [0.1, 0.5, 0.5], 2) == [3, 4]


def test_evaluate_predictors_by_hand():
    pred = ExitPredictors([1, 2], 2, hidden=1)
    with torch.no_grad():   # output = feature 0 (logit) through relu: fires iff f0 > 0
        pred.fc1_weight.zero_()
        pred.fc1_weight[:, 0, 0] = 1.0
        pred.fc1_bias.zero_()
        pred.fc2_weight.fill_(10.0)
        pred.fc2_bias.fill_(-5.0)
    f = torch.zeros(2, 3, 6)
    f[0, 0, 0] = 1.0            # token 0 fires at layer 1
    f[1, 1, 0] = 1.0            # token 1 fires at layer 2; token 2 never
    labels = torch.tensor([[True, False, False], [False, False, True]])
    data = PredictorData([1, 2], f, labels, torch.zeros(2, 3, dtype=torch.long),
                         torch.ones(3, dtype=torch.bool))
    ev = evaluate_predictors(pred, data, num_layers=3)
    assert ev.exit_frequency == pytest.approx([1 / 3, 1 / 3])
    assert ev.mean_exit_layer == pytest.approx((1 + 2 + 3) / 3)
    # token 0 right, token 1 exits wrongly (label False at layer 2), token 2 runs all layers
    assert ev.token_accuracy == pytest.approx(2 / 3)
    assert ev.precision == pytest.approx([1.0, 0.0])


# ---------------------------------------------------------------- masked attention
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("block", [True, False])
def test_masked_kv_positions_are_not_attended(arch, block):
    """A masked slot (SpecEE's skipped layer) = the HF model with that key masked out."""
    model = tiny_model(arch, seed=3, num_layers=1)
    ex = LayerExecutor(model)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    cache = ex.new_cache()
    with torch.inference_mode():
        ex.run_layers(ex.embed(ids[:, :2]), torch.arange(2).unsqueeze(0), 0, 1, cache)
        cache.append_masked(0, 2)
        assert cache.masked_count(0) == 1
        if block:
            out = ex.run_layers(ex.embed(ids[:, 3:]), torch.arange(3, 6).unsqueeze(0), 0, 1, cache)
            last = out[:, -1:]
        else:
            for p in range(3, 6):
                last = ex.run_layers(ex.embed(ids[:, p:p + 1]), torch.tensor([[p]]), 0, 1, cache)
        ours = ex.logits(last)[0, -1]
        mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
        ref = model(ids, attention_mask=mask,
                    position_ids=torch.arange(6).unsqueeze(0)).logits[0, -1]
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_masked_slots_are_reset_by_a_later_append():
    ex = LayerExecutor(tiny_model("llama", seed=3, num_layers=2))
    cache = ex.new_cache(capacity=2)
    k = torch.ones(1, 2, 1, ex.head_dim)
    cache.append(0, k, k, 0)
    cache.append_masked(0, 1)
    cache.append_masked(0, 2)          # grows the storage past its capacity
    assert cache.masked_count(0) == 2 and cache.visible(1) is None
    cache.truncate(1)
    assert cache.visible(0) is None    # the masked slots are gone
    cache.append(0, k, k, 1)
    assert cache.visible(0) is None and cache.length(0) == 2


# ----------------------------------------------------------------- the Step on tiny models
NUM_LAYERS = 8
CAND_LAYER = 3


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


def _predictors(fire: bool, layers=range(CAND_LAYER, NUM_LAYERS)) -> ExitPredictors:
    """Predictors whose output is ~1 (``fire``) or ~0 whatever they read."""
    pred = ExitPredictors(list(layers), K, hidden=8)
    with torch.no_grad():
        pred.fc2_weight.zero_()
        pred.fc2_bias.fill_(30.0 if fire else -30.0)
    return pred.eval().requires_grad_(False)


def _step(executor, fire, policy, schedule=None):
    own = lambda hidden: executor.logits(hidden)
    cands = HeadCandidates(executor, CAND_LAYER, own, K)
    pred = _predictors(fire)
    return SpecEEStep(cands, pred, schedule or PredictorSchedule(pred.layers, None), 0.5,
                      lambda ex, cache: make_skipped_kv(policy, ex, cache))


def _truncated_greedy(executor, prompt, layers, n):
    """Greedy decoding of the model cut after ``layers`` layers (final norm + lm_head), no
    cache: what always exiting at ``layers`` must give, whatever happens to deeper KV."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([tokens])
            cache = executor.new_cache(capacity=len(tokens))
            h = executor.run_layers(executor.embed(ids), torch.arange(len(tokens)).unsqueeze(0),
                                    0, layers, cache)
            tokens.append(int(executor.logits(h)[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_predictors_that_never_fire_give_autoregressive_greedy(executor, policy):
    ref = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=24).tokens
    state = run_step(executor, _step(executor, False, policy), PROMPT, max_new_tokens=24)
    assert state.tokens == ref
    assert state.stats.mean_exit_layer == NUM_LAYERS
    assert state.stats.exit_counts[NUM_LAYERS] == 23   # the first token comes from the prefill
    assert state.stats.predictor_calls == 23 * (NUM_LAYERS - CAND_LAYER)


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_predictors_that_always_fire_decode_the_truncated_model(executor, policy):
    """Exit at the candidate layer every time: the emitted token is the top local candidate,
    i.e. the argmax of the model's head at that layer, and layers below it hold exact KV."""
    state = run_step(executor, _step(executor, True, policy), PROMPT, max_new_tokens=16)
    first = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=1).tokens
    # the first token comes from the prefill (every layer); the others exit at layer c
    assert state.tokens == _truncated_greedy(executor, first, CAND_LAYER, 15)
    assert state.stats.mean_exit_layer == CAND_LAYER
    assert state.stats.layer_forwards_per_token <= CAND_LAYER


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_cache_invariants_under_each_kv_policy(executor, policy):
    """Exits at two layers (the offline layer 5 first, then layer 3 once the queue's
    neighbourhood of 5 activates it): the cache keeps per-layer lengths without gaps; what
    fills the deep layers depends on the policy."""
    pred_layers = list(range(CAND_LAYER, NUM_LAYERS))
    step = _step(executor, True, policy, PredictorSchedule(pred_layers, offline=[5]))
    state = run_step(executor, step, PROMPT, max_new_tokens=12)
    cache = state.cache
    n = state.seq_len - 1          # the last committed token has not run yet
    lengths = cache.lengths()
    exits = state.stats.exit_counts
    assert sum(exits) == 11 and exits[5] == 1 and exits[CAND_LAYER] == 10
    if policy == "deferred":
        assert lengths[:CAND_LAYER] == [n] * CAND_LAYER
        assert lengths == sorted(lengths, reverse=True)   # deeper layers lag, never lead
        assert lengths[-1] == len(PROMPT)                 # no token ran the last layer
    else:
        assert lengths == [n] * NUM_LAYERS
        masked = [cache.masked_count(layer) for layer in range(NUM_LAYERS)]
        if policy == "skip":
            assert masked[:3] == [0, 0, 0] and masked[-1] == 11
        else:
            assert masked == [0] * NUM_LAYERS


def test_propagated_kv_is_each_layers_kv_projection_of_the_exit_state():
    ex = LayerExecutor(tiny_model("qwen2", seed=5, num_layers=4))
    cache = ex.new_cache()
    hidden = torch.randn(1, 1, 64)
    with torch.inference_mode():
        ex.propagate_kv(hidden, torch.tensor([[0]]), 1, 4, cache)
    assert cache.lengths() == [0, 1, 1, 1]
    attn = ex.layers[2].self_attn
    x = ex.layers[2].input_layernorm(hidden)
    v = attn.v_proj(x).view(1, 1, ex.num_kv_heads, ex.head_dim).transpose(1, 2)
    assert torch.allclose(cache.get(2)[1], v, atol=1e-5)
    k = attn.k_proj(x).view(1, 1, ex.num_kv_heads, ex.head_dim).transpose(1, 2)
    assert torch.allclose(cache.get(2)[0], k, atol=1e-5)   # position 0: rotary is identity


def test_step_rejects_mismatched_k_and_low_layers(executor):
    own = lambda hidden: executor.logits(hidden)
    pred = _predictors(True)
    make = lambda ex, cache: make_skipped_kv("skip", ex, cache)
    with pytest.raises(InvalidArgumentError, match="trained on 4 candidates"):
        SpecEEStep(HeadCandidates(executor, CAND_LAYER, own, 3), pred,
                   PredictorSchedule(pred.layers, None), 0.5, make)
    with pytest.raises(InvalidArgumentError, match="below the candidate layer"):
        SpecEEStep(HeadCandidates(executor, CAND_LAYER + 1, own, K), pred,
                   PredictorSchedule(pred.layers, None), 0.5, make)


# ------------------------------------------------------------------- files and the method
def _head_file(executor, tmp_path, fire=True, with_predictors=True):
    out = output_layer(executor)
    head = make_head("lightweight", CAND_LAYER, out, init="lm_head").prepare_inference()
    card = new_card(executor.model, "lightweight", [CAND_LAYER])
    heads = ExitHeads([CAND_LAYER], [head], card)
    if with_predictors:
        pred = _predictors(fire)
        heads.predictors = pred
        n = len(pred.layers)
        card.predictors = PredictorCard(
            candidate_layer=CAND_LAYER, num_candidates=K, draft_vocab=0, hidden=pred.hidden,
            layers=pred.layers, offline_layers=[5, 6], exit_frequency=[0.1] * n,
            candidate_recall=0.5, base_rate=[0.2] * n, accuracy=[0.8] * n,
            precision=[math.nan] + [0.9] * (n - 1), train_tokens=10, eval_tokens=5,
            epochs=1, seconds=0.1)
    return save_heads(heads, tmp_path / "heads.safetensors"), heads.predictors


def test_predictors_round_trip_through_head_files(executor, tmp_path):
    path, saved = _head_file(executor, tmp_path)
    loaded = load_heads(path, executor)
    assert loaded.predictors is not None
    assert loaded.predictors.layers == list(range(CAND_LAYER, NUM_LAYERS))
    for name, t in saved.tensors().items():
        assert torch.equal(loaded.predictors.tensors()[name], t)
    pc = loaded.card.predictors
    assert pc.offline_layers == [5, 6] and math.isnan(pc.precision[0])


def test_specee_method_builds_from_a_head_file_and_runs(executor, tmp_path):
    path, _ = _head_file(executor, tmp_path, fire=True)
    for policy in KV_POLICIES:
        for schedule in ("two-level", "all"):
            step = build_step("specee", executor, {"heads": str(path), "kv": policy,
                                                    "schedule": schedule})
            state = run_step(executor, step, PROMPT, max_new_tokens=6)
            assert state.num_generated == 6
            # two-level: offline layers 5, 6 fire first; all: the candidate layer
            expected = 5 if schedule == "two-level" else CAND_LAYER
            assert state.stats.exit_counts[expected] >= 1


def test_lossy_kv_default_is_deferred(executor, tmp_path):
    """Picked by the accuracy-speed Pareto plots (docs/results/specee): the default runs an
    exited token's skipped layers later (exact KV), as kv=deferred does, not CALM's K/V."""
    path, _ = _head_file(executor, tmp_path, fire=True)

    def run(**options):
        step = build_step("specee", executor, {"heads": str(path), **options})
        return run_step(executor, step, PROMPT, max_new_tokens=6)

    default, deferred, propagate = run(), run(kv="deferred"), run(kv="propagate")
    assert sum(default.stats.exit_counts) > 0
    assert default.tokens == deferred.tokens
    assert default.stats.layer_batches == deferred.stats.layer_batches
    # the skipped layers run later, batched: no K/V is written from an exit state
    assert default.stats.kv_ms == 0 and propagate.stats.kv_ms > 0


def test_specee_without_predictors_says_how_to_train_them(executor, tmp_path):
    path, _ = _head_file(executor, tmp_path, with_predictors=False)
    with pytest.raises(InvalidArgumentError, match="heads train-predictors"):
        build_step("specee", executor, {"heads": str(path)})


@pytest.mark.parametrize("values,match", [
    ({"kv": "copy"}, "kv"), ({"threshold": 1.0}, "threshold"), ({"schedule": "x"}, "schedule"),
    ({"threshold": 0}, "threshold")])
def test_specee_options_are_validated(executor, values, match):
    with pytest.raises(InvalidArgumentError, match=match):
        build_step("specee", executor, values)


def test_pareto_front_keeps_points_nothing_beats_on_both():
    from selfspec.bench.plots import pareto_front

    points = [(1.0, 0.5), (1.2, 0.45), (0.9, 0.4), (1.5, 0.3), (1.2, 0.3)]
    assert pareto_front(points) == [(1.0, 0.5), (1.2, 0.45), (1.5, 0.3)]


def test_exit_histograms_in_the_bench_report():
    from selfspec.bench.metrics import MethodSummary
    from selfspec.bench.report import exit_histograms

    lossy = MethodSummary(method="specee", lossless=False, exit_histogram=[0, 0, 1, 0, 3])
    fixed = MethodSummary(method="layerskip", lossless=True, exit_histogram=[0, 0, 5])
    text = exit_histograms([lossy, fixed])
    assert "| `specee` | 4 | 2: 25%, 4: 75% |" in text and "layerskip" not in text
    assert exit_histograms([fixed]) == ""


def test_default_candidate_layer_is_the_deepest_head_in_the_first_half():
    from selfspec.training.predictors import default_candidate_layer

    assert default_candidate_layer([6, 12, 18], 24) == 12
    assert default_candidate_layer([7, 14, 21], 28) == 14
    assert default_candidate_layer([20, 22], 24) == 20


# ------------------------------------------------------------------------- n-gram candidates
def test_merge_ngram_fills_the_last_slot_only_when_the_lookup_token_is_missing():
    ids = torch.tensor([[7, 3, 9, 1], [7, 3, 9, 1], [7, 3, 9, 1]])
    lookup = torch.tensor([5, 9, -1])
    assert merge_ngram(ids, lookup).tolist() == [[7, 3, 9, 5], [7, 3, 9, 1], [7, 3, 9, 1]]
    assert merge_ngram(torch.tensor([4, 2]), torch.tensor(8)).tolist() == [4, 8]


def test_ngram_token_is_prompt_lookups_next_token():
    index = ContextIndex(4, 2)
    index.extend([1, 2, 3, 4, 9, 1, 2])
    assert ngram_token(index) == 3           # "1 2" was followed by 3
    index.extend([8])
    assert ngram_token(index) == -1          # "2 8" never occurred


def test_training_lookups_line_up_with_the_feature_positions():
    """One lookup per scored position, in load_features' order (items grouped by source),
    each made from the tokens up to that position, as decoding does."""
    from selfspec.training.corpus import CorpusItem
    from selfspec.training.predictors import ngram_tokens

    a = CorpusItem("x", "a", (1, 2, 3, 1, 2, 3, 1), 2, 0)     # positions 2..5
    b = CorpusItem("y", "b", (4, 5, 6, 4, 5), 0, 0)           # positions 0..3
    c = CorpusItem("x", "c", (7, 8, 7, 8), 1, 0)              # positions 1..2
    got = ngram_tokens([a, b, c]).tolist()
    expected = []
    for item in (a, c, b):                                   # grouped by source
        for t in range(item.score_from, len(item.token_ids) - 1):
            index = ContextIndex(4, 2)
            index.extend(list(item.token_ids[:t + 1]))
            expected.append(ngram_token(index))
    assert got == expected and len(got) == 4 + 2 + 4
    assert got[:4] == [-1, -1, 3, 1]                         # "1 2" → 3, "2 3" → 1


def test_ngram_candidates_put_the_lookup_token_in_the_last_slot(executor):
    """Always-firing predictors with n-gram candidates: decoding runs, and whenever prompt
    lookup has a token it is among the step's candidates."""
    own = lambda hidden: executor.logits(hidden)
    cands = HeadCandidates(executor, CAND_LAYER, own, K, ngram=True)
    seen = []
    original = cands.__call__

    class Spy(HeadCandidates):
        def __call__(self, hidden, ngram=-1):
            out = original(hidden, ngram)
            seen.append((ngram, out.ids.tolist()))
            return out

    spy = Spy(executor, CAND_LAYER, own, K, ngram=True)
    pred = _predictors(True)
    step = SpecEEStep(spy, pred, PredictorSchedule(pred.layers, None), 0.5,
                      lambda ex, cache: make_skipped_kv("propagate", ex, cache))
    prompt = PROMPT * 3                                      # repeats: lookups have matches
    state = run_step(executor, step, prompt, max_new_tokens=12)
    assert state.num_generated == 12
    assert any(n >= 0 for n, _ in seen)
    assert all(n in ids for n, ids in seen if n >= 0)
    # the lookups were made over the whole committed sequence
    index = ContextIndex(4, 2)
    index.extend(state.tokens[:-1])
    assert seen[-1][0] == ngram_token(index)


def test_predictors_train_only_on_prompts_the_candidate_head_did_not_train_on():
    """The head's top-k is right more often on its own training text: predictors fitted there
    would be over-confident on new text, so those prompts are left out of their training."""
    from selfspec.training.corpus import CALIBRATION, TEST, TRAIN, CorpusItem
    from selfspec.training.predictors import predictor_splits

    items = [CorpusItem("onpolicy:humaneval", "HumanEval/1", (1, 2, 3), 0, TRAIN),  # 2 positions
             CorpusItem("stdlib", "a.py", (1, 2, 3, 4), 0, TRAIN),                   # 3
             CorpusItem("onpolicy:humaneval", "HumanEval/2", (5, 6), 0, CALIBRATION),  # 1
             CorpusItem("onpolicy:humaneval", "HumanEval/3", (5, 6, 7), 0, TEST)]      # 2
    # load_features' order: onpolicy:humaneval items (1, 2, 3), then stdlib
    split = torch.tensor([TRAIN, TRAIN, CALIBRATION, TEST, TEST, TRAIN, TRAIN, TRAIN],
                         dtype=torch.int8)

    class Features:
        pass

    features = Features()
    features.split = split
    train, held_out = predictor_splits(items, features, {("humaneval", "HumanEval/1")})
    assert train.tolist() == [2, 5, 6, 7]        # HumanEval/2 (calibration split) + stdlib
    assert held_out.tolist() == [3, 4]
