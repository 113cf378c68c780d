"""SpecEE features read through an exit head (the head lens; heads/predictor.py module doc):
training and decoding compute the same features, files keep the lens, the method refuses a
file whose heads no longer match it."""

import math

import pytest
import torch
import torch.nn.functional as F

from selfspec.decoding.specee.skipped_kv import make_skipped_kv
from selfspec.decoding.specee.step import HeadCandidates, PredictorSchedule, SpecEEStep
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, load_heads, save_heads
from selfspec.heads.card import PredictorCard, _predictor_card
from selfspec.heads.files import new_card
from selfspec.heads.modules import make_head, output_layer
from selfspec.heads.predictor import ExitPredictors, candidate_features
from selfspec.methods.registry import build_step
from selfspec.training.predictors import head_lenses, predictor_data

from tiny import last_position_states, run_step, tiny_model

K, NUM_LAYERS, CAND_LAYER, LENS = 4, 6, 2, 3
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


def _lens_head(executor, layer=LENS, seed=0):
    """A lightweight head at ``layer`` with a random ``T`` (so its lens differs from the
    logit lens)."""
    head = make_head("lightweight", layer, output_layer(executor), init="lm_head")
    torch.manual_seed(seed)
    with torch.no_grad():
        h = head.transform.shape[0]
        head.transform.copy_(torch.eye(h) + 0.5 * torch.randn(h, h) / h ** 0.5)
    return head.prepare_inference()


def test_predictor_data_reads_lens_layers_through_the_head(executor):
    torch.manual_seed(1)
    layers = [2, 3, 4]
    n, h = 7, executor.model.config.hidden_size
    hidden = {x: torch.randn(n, h) for x in layers}
    cands = torch.randint(0, 100, (n, K))
    final = torch.randint(0, 100, (n,))
    head = _lens_head(executor)
    plain = predictor_data(executor, hidden, cands, final, layers, batch_tokens=3)
    data = predictor_data(executor, hidden, cands, final, layers, batch_tokens=3,
                          with_states=True, lenses={LENS: head.transform_normed})
    rows = executor.lm_head.weight[cands]
    bias = None if executor.lm_head.bias is None else executor.lm_head.bias[cands]
    first = candidate_features(executor.final_norm(hidden[2]), rows, bias, None)
    lensed = candidate_features(F.linear(executor.final_norm(hidden[LENS]), head.transform),
                                rows, bias, first.probs)
    after = candidate_features(executor.final_norm(hidden[4]), rows, bias, lensed.probs)
    assert torch.allclose(data.features[0], plain.features[0])
    assert torch.allclose(data.features[1], lensed.features, atol=1e-5)
    assert not torch.allclose(data.features[1], plain.features[1], atol=1e-3)
    # the change at the next layer is taken against the lensed probabilities
    assert torch.allclose(data.features[2], after.features, atol=1e-5)
    pick = cands.gather(1, lensed.probs.argmax(-1, keepdim=True)).squeeze(1)
    assert torch.equal(data.picks[1], pick) and torch.equal(data.labels[1], pick == final)
    # the state-reading input stays the final norm of the state
    assert torch.allclose(data.states[1], executor.final_norm(hidden[LENS]))


class _Recorder(ExitPredictors):
    """Predictors that never fire and record their features."""

    def __init__(self, layers):
        super().__init__(layers, K, hidden=8)
        self.seen = []

    def prob(self, layer, features, state=None):
        self.seen.append((layer, features.clone()))
        return torch.zeros(())


@pytest.mark.parametrize("offline", [None, [4], [2, 5]])
def test_decoding_features_are_the_training_features_of_the_same_states(executor, offline):
    """The features the predictors see while decoding a token equal what
    :func:`predictor_data` computes from that token's states (no-cache forward), head lens
    included, whichever layers the schedule runs (features are skipped where no predictor
    reads them, but never one layer before a predictor: the change is against it)."""
    head = _lens_head(executor)
    own = lambda hidden: executor.logits(hidden)
    pred = _Recorder(list(range(CAND_LAYER, NUM_LAYERS)))
    step = SpecEEStep(HeadCandidates(executor, CAND_LAYER, own, K), pred,
                      PredictorSchedule(pred.layers, offline), 0.5,
                      lambda ex, cache: make_skipped_kv("propagate", ex, cache),
                      lenses={LENS: head.transform_normed})
    state = run_step(executor, step, PROMPT, max_new_tokens=2)
    tokens = state.tokens[:len(PROMPT) + 1]      # the second token was decoded by the step
    hidden = last_position_states(executor, tokens)
    with torch.inference_mode():
        cands = torch.topk(executor.logits(hidden[CAND_LAYER].unsqueeze(0))[0, -1], K).indices
        data = predictor_data(executor, hidden, cands.unsqueeze(0), torch.tensor([0]),
                              pred.layers, lenses={LENS: head.transform_normed})
    # the first token comes from the prefill; the second is the first the predictors see
    assert [x for x, _ in pred.seen] == (pred.layers if offline is None else offline)
    for layer, seen in pred.seen:
        j = pred.layers.index(layer)
        assert torch.allclose(seen, data.features[j, 0], atol=1e-4), layer


def _head_file(executor, tmp_path, lens_layers, fire=True, lens_head=True):
    out = output_layer(executor)
    cand = make_head("lightweight", CAND_LAYER, out, init="lm_head").prepare_inference()
    layers, heads = [CAND_LAYER], [cand]
    if lens_head:
        layers, heads = [CAND_LAYER, LENS], [cand, _lens_head(executor)]
    card = new_card(executor.model, "lightweight", layers)
    container = ExitHeads(layers, heads, card)
    pred = ExitPredictors(list(range(CAND_LAYER, NUM_LAYERS)), K, hidden=8)
    with torch.no_grad():
        pred.fc2_weight.zero_()
        pred.fc2_bias.fill_(30.0 if fire else -30.0)
    container.predictors = pred.eval().requires_grad_(False)
    n = len(pred.layers)
    card.predictors = PredictorCard(
        candidate_layer=CAND_LAYER, num_candidates=K, draft_vocab=0, hidden=pred.hidden,
        layers=pred.layers, offline_layers=[LENS], exit_frequency=[0.1] * n,
        candidate_recall=0.5, base_rate=[0.2] * n, accuracy=[0.8] * n, precision=[0.9] * n,
        train_tokens=10, eval_tokens=5, epochs=1, seconds=0.1, lens_layers=lens_layers)
    return save_heads(container, tmp_path / "heads.safetensors")


def test_the_lens_round_trips_and_the_method_decodes_through_it(executor, tmp_path):
    path = _head_file(executor, tmp_path, [LENS])
    loaded = load_heads(path, executor)
    assert loaded.card.predictors.lens_layers == [LENS]
    ref = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=16).tokens
    # verified, every token exiting (first at the offline lens layer): still autoregressive
    step = build_step("specee", executor, {"heads": str(path), "verify": True,
                                            "threshold": 0.5})
    assert step.exits.scanner.lenses.keys() == {LENS}
    state = run_step(executor, step, PROMPT, max_new_tokens=16)
    assert state.tokens == ref and state.stats.drafted > 0
    # lossy, always exiting at the candidate layer: what the logit lens gives there
    lossy = run_step(executor, build_step("specee", executor, {
        "heads": str(path), "schedule": "all", "threshold": 0.5}), PROMPT, max_new_tokens=4)
    assert lossy.stats.mean_exit_layer == CAND_LAYER


def test_a_lens_layer_without_its_lightweight_head_is_refused(executor, tmp_path):
    path = _head_file(executor, tmp_path, [LENS], lens_head=False)
    with pytest.raises(InvalidArgumentError, match="no head there.*--head-lens"):
        build_step("specee", executor, {"heads": str(path)})


def test_head_lenses_are_the_lightweight_heads_at_predictor_layers(executor):
    out = output_layer(executor)
    light = _lens_head(executor)
    full = make_head("full", 4, out, init="lm_head")
    heads = ExitHeads([LENS, 4], [light, full], new_card(executor.model, "lightweight", [LENS, 4]))
    assert head_lenses(heads, [2, 3, 4, 5], "f").keys() == {LENS}
    with pytest.raises(InvalidArgumentError, match="drop --head-lens"):
        head_lenses(heads, [4, 5], "f")


def test_a_card_without_lens_layers_reads_the_logit_lens():
    pc = _predictor_card({
        "candidate_layer": 2, "num_candidates": 4, "draft_vocab": 0, "hidden": 8,
        "layers": [2, 3], "offline_layers": [3], "exit_frequency": [0.1, 0.1],
        "candidate_recall": 0.5, "base_rate": [0.2, 0.2], "accuracy": [0.8, 0.8],
        "precision": [None, 0.9], "train_tokens": 1, "eval_tokens": 1, "epochs": 1,
        "seconds": 0.1})
    assert pc.lens_layers == [] and math.isnan(pc.precision[0])
