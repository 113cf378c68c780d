"""SpecEE's next-token drafter (EAGLE-style candidates before layer 0): the module, its
storage, the candidates decoding drafts (and that training drafts the same), the state it
reads after the prefill and after an exit, and its training, on tiny random models."""

import math

import pytest
import torch

from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.decoding.specee.step import (
    DrafterCandidates,
    PredictorSchedule,
    SpecEEStep,
)
from selfspec.errors import CorruptModelFileError, InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, load_heads, save_heads
from selfspec.heads.card import DrafterCard, PredictorCard
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.files import new_card
from selfspec.heads.modules import make_head, output_layer
from selfspec.heads.predictor import ExitPredictors
from selfspec.methods.registry import build_step
from selfspec.training.corpus import TEST, TRAIN, CorpusItem
from selfspec.training.drafter import (
    DrafterTrainConfig,
    drafter_inputs,
    drafter_positions,
    fit_drafter,
)
from selfspec.training.features import FeatureSet

from tiny import run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7]
K = 4
NUM_LAYERS = 8
FIRST = 1  # drafter candidates exist before layer 0: predictors may start at layer 1


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


def _h(executor):
    return executor.config.hidden_size


def _drafter(hidden_size, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    d = FeatureDrafter(hidden_size)
    with torch.no_grad():
        d.fc_weight.normal_(0, 0.05)
        d.fc_bias.normal_(0, 0.05)
    return d.to(dtype).eval().requires_grad_(False)


def _predictors(fire: bool, layers=range(FIRST, NUM_LAYERS)) -> ExitPredictors:
    pred = ExitPredictors(list(layers), K, hidden=8)
    with torch.no_grad():
        pred.fc2_weight.zero_()
        pred.fc2_bias.fill_(30.0 if fire else -30.0)
    return pred.eval().requires_grad_(False)


class Spy(DrafterCandidates):
    """Records the state, token and candidates of every call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def __call__(self, previous, token_id, ngram=-1, exited=False):
        out = super().__call__(previous, token_id, ngram, exited)
        self.calls.append((previous.clone(), token_id, out.ids.tolist(), exited))
        return out


def _step(executor, fire, policy="propagate", schedule=None, drafter=None, exit_drafter=None):
    drafter = drafter or _drafter(_h(executor))
    cands = Spy(executor, drafter, FIRST, executor.logits, K, exit_drafter=exit_drafter)
    pred = _predictors(fire)
    return SpecEEStep(cands, pred, schedule or PredictorSchedule(pred.layers, None), 0.5,
                      lambda ex, cache: make_skipped_kv(policy, ex, cache))


def _last_hidden(executor, tokens, layers=NUM_LAYERS):
    """The hidden state leaving ``layers`` layers at the last of ``tokens`` (no cache reuse)."""
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        cache = executor.new_cache(capacity=len(tokens))
        h = executor.run_layers(executor.embed(ids), torch.arange(len(tokens)).unsqueeze(0), 0,
                                layers, cache)
    return h[:, -1:]


# --------------------------------------------------------------------------- the module
def test_drafter_is_a_residual_on_the_previous_state_by_hand():
    d = _drafter(6, seed=3)
    prev, emb = torch.randn(2, 6), torch.randn(2, 6)
    rms = lambda x: x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    expected = prev + torch.cat([rms(prev), rms(emb)], -1) @ d.fc_weight.T + d.fc_bias
    assert torch.allclose(d(prev, emb), expected, atol=1e-4)
    assert torch.equal(FeatureDrafter(6)(prev, emb), prev)   # zero init: the state itself


def test_drafter_load_tensors_refuses_a_wrong_shape_or_a_missing_tensor():
    d = FeatureDrafter(6)
    with pytest.raises(InvalidArgumentError, match="shape"):
        d.load_tensors({"fc_weight": torch.zeros(6, 6), "fc_bias": torch.zeros(6)})
    with pytest.raises(InvalidArgumentError, match="missing"):
        d.load_tensors({"fc_weight": torch.zeros(6, 12)})


# ----------------------------------------------------------------------- the candidates
def test_candidates_are_the_top_k_of_lm_head_on_the_drafted_state(executor):
    d = _drafter(_h(executor), seed=1)
    cands = DrafterCandidates(executor, d, FIRST, executor.logits, K)
    prev = torch.randn(1, 1, _h(executor))
    with torch.inference_mode():
        got = cands(prev, 42)
        state = d(prev, executor.embed(torch.tensor([[42]])))
        expected = executor.logits(state)[0, -1].topk(K).indices
    assert got.ids.tolist() == expected.tolist()
    assert torch.equal(got.rows, executor.lm_head.weight[expected])
    merged = DrafterCandidates(executor, d, FIRST, executor.logits, K, ngram=True)(prev, 42, 7)
    assert 7 in merged.ids.tolist() and merged.ids.tolist()[:K - 1] == expected.tolist()[:K - 1] \
        or merged.ids.tolist() == expected.tolist()


def test_the_first_draft_reads_the_prompts_last_state_and_never_firing_gives_ar(executor):
    ref = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=10).tokens
    step = _step(executor, False)
    state = run_step(executor, step, PROMPT, max_new_tokens=10)
    assert state.tokens == ref
    calls = step.candidates.calls
    assert len(calls) == 9                          # the first token comes from the prefill
    # step t drafts from the previous position's last-layer state and the current token
    for t, (previous, token, _, _) in enumerate(calls):
        seq = ref[:len(PROMPT) + t + 1]
        assert token == seq[-1]
        assert torch.allclose(previous, _last_hidden(executor, seq[:-1]), atol=1e-4)


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_after_an_exit_the_drafter_reads_the_exit_layers_state(executor, policy):
    """Always firing at layer 1 (below any exit head): every token after the prefill's exits
    there, the next draft reads that layer-1 state, and the cache keeps its invariants."""
    step = _step(executor, True, policy)
    state = run_step(executor, step, PROMPT, max_new_tokens=8)
    assert state.stats.exit_counts[FIRST] == 7 and state.stats.mean_exit_layer == FIRST
    calls = step.candidates.calls
    for t in range(1, len(calls)):
        seq = state.tokens[:len(PROMPT) + t]
        # layers below the exit hold exact KV under every policy: the state leaving layer 1
        assert torch.allclose(calls[t][0], _last_hidden(executor, seq, FIRST), atol=1e-4)
    lengths = state.cache.lengths()
    n = state.seq_len - 1
    assert lengths[:FIRST] == [n] * FIRST
    if policy == "deferred":
        assert lengths == sorted(lengths, reverse=True)
    else:
        assert lengths == [n] * NUM_LAYERS


def test_after_an_exit_the_exit_state_drafter_drafts(executor):
    """With an exit-state drafter, the first token after the prefill is drafted by the main
    drafter from the prompt's last-layer state, every later one (each follows an exit) by
    the exit-state drafter from the exit-layer state; a token that ran every layer hands the
    main drafter its last-layer state again."""
    main, after_exit = _drafter(_h(executor), seed=1), _drafter(_h(executor), seed=7)
    step = _step(executor, True, exit_drafter=after_exit)
    run_step(executor, step, PROMPT, max_new_tokens=6)
    calls = step.candidates.calls
    assert [c[3] for c in calls] == [False] + [True] * (len(calls) - 1)
    for previous, token, ids, _exited in calls[1:]:
        with torch.inference_mode():
            logits = executor.logits(after_exit(previous, executor.embed_token(token)))[0, -1]
        assert ids == torch.topk(logits, K).indices.tolist()
    never = _step(executor, False, drafter=main, exit_drafter=after_exit)
    run_step(executor, never, PROMPT, max_new_tokens=4)
    assert [c[3] for c in never.candidates.calls] == [False] * 3  # the first from the prefill


# --------------------------------------------------------------- files and the method
def _head_file(executor, tmp_path, with_drafter=True, candidates="drafter", exit_drafter=False):
    out = output_layer(executor)
    head = make_head("lightweight", 3, out, init="lm_head").prepare_inference()
    card = new_card(executor.model, "lightweight", [3])
    heads = ExitHeads([3], [head], card)
    pred = _predictors(True)
    heads.predictors = pred
    n = len(pred.layers)
    card.predictors = PredictorCard(
        candidate_layer=FIRST, num_candidates=K, draft_vocab=0, hidden=pred.hidden,
        layers=pred.layers, offline_layers=[2, 3], exit_frequency=[0.1] * n,
        candidate_recall=0.5, base_rate=[0.2] * n, accuracy=[0.8] * n, precision=[0.9] * n,
        train_tokens=10, eval_tokens=5, epochs=1, seconds=0.1, candidates=candidates)
    if with_drafter:
        heads.drafter = _drafter(_h(executor), seed=2)
        card.drafter = DrafterCard(draft_vocab=0, exit_mix=0.25, exit_layers=[4], epochs=1,
                                   lr=1e-3, seconds=0.1, train_tokens=10, eval_tokens=5,
                                   top1=0.3, topk=math.nan)
        if exit_drafter:
            heads.exit_drafter = _drafter(_h(executor), seed=9)
            card.drafter.exit_state_layers = [1, 3]
            card.drafter.exit_state_topk = 0.5
    tmp_path.mkdir(parents=True, exist_ok=True)
    return save_heads(heads, tmp_path / "heads.safetensors"), heads


def test_drafter_round_trips_through_head_files(executor, tmp_path):
    path, saved = _head_file(executor, tmp_path)
    loaded = load_heads(path, executor)
    for name, t in saved.drafter.tensors().items():
        assert torch.equal(loaded.drafter.tensors()[name].float(), t.float())
    dc = loaded.card.drafter
    assert dc.exit_layers == [4] and math.isnan(dc.topk) and dc.k == 4
    assert loaded.exit_drafter is None and dc.exit_state_layers == []
    assert math.isnan(dc.exit_state_topk)


def test_an_exit_state_drafter_round_trips_and_the_method_drafts_with_it(executor, tmp_path):
    path, saved = _head_file(executor, tmp_path / "a", exit_drafter=True)
    loaded = load_heads(path, executor)
    for name, t in saved.exit_drafter.tensors().items():
        assert torch.equal(loaded.exit_drafter.tensors()[name].float(), t.float())
        assert not torch.equal(loaded.drafter.tensors()[name].float(), t.float())
    dc = loaded.card.drafter
    assert dc.exit_state_layers == [1, 3] and dc.exit_state_topk == 0.5
    step = build_step("specee", executor, {"heads": str(path), "schedule": "all"})
    assert step.candidates.exit_drafter is not None
    off = build_step("specee", executor, {"heads": str(path), "exit_drafter": False})
    assert off.candidates.exit_drafter is None
    state = run_step(executor, step, PROMPT, max_new_tokens=6)
    assert state.num_generated == 6 and state.stats.exit_counts[FIRST] == 5
    # the card names it, its tensors are gone: corrupt, not silently the main drafter
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                   if not k.startswith("exit_drafter.")}
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptModelFileError, match="drafter"):
        load_heads(path, executor)


def test_a_card_naming_a_drafter_without_its_tensors_is_corrupt(executor, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, _ = _head_file(executor, tmp_path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("drafter.")}  # noqa: SIM118 (safe_open is not iterable)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptModelFileError, match="drafter"):
        load_heads(path, executor)


def test_specee_method_runs_with_drafter_candidates_and_refuses_the_other_family(executor,
                                                                                  tmp_path):
    path, _ = _head_file(executor, tmp_path)
    for policy in KV_POLICIES:
        step = build_step("specee", executor, {"heads": str(path), "kv": policy,
                                                "schedule": "all"})
        state = run_step(executor, step, PROMPT, max_new_tokens=6)
        assert state.num_generated == 6 and state.stats.exit_counts[FIRST] == 5
    step = build_step("specee", executor, {"heads": str(path), "candidates": "drafter+ngram"})
    assert run_step(executor, step, PROMPT * 2, max_new_tokens=6).num_generated == 6
    with pytest.raises(InvalidArgumentError, match="trained on 'drafter' candidates"):
        build_step("specee", executor, {"heads": str(path), "candidates": "head"})


def test_drafter_candidates_without_a_drafter_say_how_to_train_one(executor, tmp_path):
    path, _ = _head_file(executor, tmp_path, with_drafter=False)
    with pytest.raises(InvalidArgumentError, match="heads train-drafter"):
        build_step("specee", executor, {"heads": str(path)})


# ----------------------------------------------------------------------------- training
def _items():
    return [CorpusItem("stdlib", "a.py", (1, 2, 3, 4), 0, TRAIN),       # positions 0, 1, 2
            CorpusItem("stdlib", "b.py", (5, 6, 7, 8, 9), 2, TEST)]      # positions 3, 4


def test_drafter_positions_point_at_the_previous_scored_position():
    pos = drafter_positions(_items())
    assert pos.previous.tolist() == [-1, 0, 1, -1, 3]
    assert pos.token.tolist() == [1, 2, 3, 7, 8]
    assert pos.usable().tolist() == [False, True, True, False, True]


def _features(executor, items):
    """Real features of ``items`` on ``executor`` (last layer and layer 4), no cache."""
    from selfspec.training.features import load_features

    return load_features(executor, items, [4], None, progress=False)


def test_training_drafts_the_candidates_decoding_drafts(executor):
    """The predictors' training candidates equal what DrafterCandidates drafts at each
    position from the same state and token (so predictors see decoding's candidates)."""
    from selfspec.training.drafter import drafter_candidates

    items = [CorpusItem("stdlib", "a.py", tuple(PROMPT + [11, 12, 13]), 0, TRAIN)]
    features = _features(executor, items)
    pos = drafter_positions(items)
    index = torch.nonzero(pos.usable()).squeeze(1)
    d = _drafter(_h(executor), seed=4)

    class Engine:
        pass

    engine = Engine()
    engine.executor = executor
    got = drafter_candidates(engine, d, features, pos, index, K, None)
    cands = DrafterCandidates(executor, d, FIRST, executor.logits, K)
    with torch.inference_mode():
        for row, i in enumerate(index.tolist()):
            x = drafter_inputs(features, pos, executor.embed_tokens.weight, index[row:row + 1])
            expected = cands(x.previous.unsqueeze(0), int(pos.token[i])).ids
            assert got[row].tolist() == expected.tolist()


def test_fit_drafter_lowers_the_kl_to_the_final_layer_and_mixes_exit_states(executor):
    from selfspec.training.drafter import evaluate_drafter

    torch.manual_seed(0)
    tokens = tuple(int(x) for x in torch.randint(0, 200, (60,)))
    items = [CorpusItem("stdlib", "a.py", tokens, 0, TRAIN)]
    features = _features(executor, items)
    pos = drafter_positions(items)
    idx = torch.nonzero(pos.usable()).squeeze(1)
    out = output_layer(executor)
    emb = executor.embed_tokens.weight

    def kl(drafter):
        with torch.inference_mode():
            x = drafter_inputs(features, pos, emb, idx)
            logq = torch.log_softmax(
                out.project(out.norm(drafter(x.previous, x.embedding))).float(), -1)
            logp = torch.log_softmax(out.project(out.norm(features.final[idx])).float(), -1)
            return float((logp.exp() * (logp - logq)).sum(-1).mean())

    before = kl(FeatureDrafter(_h(executor)))
    config = DrafterTrainConfig(epochs=30, lr=1e-2, batch=16, exit_mix=0.5, compute_dtype="fp32")
    trained = fit_drafter(out, features, pos, emb, idx, None, [4], config)
    assert kl(trained) < 0.8 * before
    ev = evaluate_drafter(trained, out, features, pos, emb, idx, None)
    assert ev.tokens == idx.numel() and 0 <= ev.top1 <= ev.topk <= 1
    with pytest.raises(InvalidArgumentError, match="lack the exit layers"):
        fit_drafter(out, features, pos, emb, idx, None, [5], config)
    with pytest.raises(InvalidArgumentError, match="exit_mix"):
        DrafterTrainConfig(exit_mix=1.5)
    # an exit-state drafter: every input from layer 4's state, and evaluated there
    exit_only = fit_drafter(out, features, pos, emb, idx, None, [4],
                            DrafterTrainConfig(epochs=30, lr=1e-2, batch=16, exit_mix=1.0,
                                               compute_dtype="fp32"))
    at4 = evaluate_drafter(exit_only, out, features, pos, emb, idx, None, layer=4)
    assert at4.tokens == idx.numel() and 0 <= at4.top1 <= at4.topk <= 1


def test_features_type_is_what_training_reads():
    assert {"final", "hidden", "teacher_token", "split"} <= set(FeatureSet.__dataclass_fields__)
