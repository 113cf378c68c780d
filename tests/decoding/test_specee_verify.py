"""Verified SpecEE (``specee:verify=true``): SpecEE's exit decision (candidates, features,
predictors, schedule) in AdaDecode's schedule — exited tokens' deeper layers run later with
the next tokens and verify them. Lossless: greedy equals autoregressive greedy and sampling
reproduces the target distribution, on tiny random models, with every candidate source."""

import random

import pytest
import torch
from test_adadecode import PROMPT as SAMPLING_PROMPT  # the prompt _sampled_tv runs
from test_adadecode import _sampled_tv
from test_specee import _head_file

from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.specee.step import (
    DrafterCandidates,
    HeadCandidates,
    PredictorScan,
    PredictorSchedule,
    SpecEEDrafter,
    SpecEEExits,
    VerifiedSpecEEStep,
    depth_thresholds,
)
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.predictor import ExitPredictors
from selfspec.methods.registry import METHODS, build_step

from tiny import exact_prefix_distribution, run_step, tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 5, 17, 42]   # repeats: the n-gram lookup finds something
K = 4
NUM_LAYERS = 8
CAND_LAYER = 3
FIRST = 1


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=11, num_layers=NUM_LAYERS))


@pytest.fixture(scope="module")
def reference(executor):
    return run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=30).tokens


class _Predictors(ExitPredictors):
    """Predictors that fire never, always, or at random (seeded, independent of the input)."""

    def __init__(self, layers, fire):
        super().__init__(list(layers), K, hidden=8)
        self.fire = fire
        self.rng = random.Random(0)

    def prob(self, layer, features, state=None):
        if self.fire == "random":
            return torch.tensor(float(self.rng.random() < 0.3))
        return torch.tensor(1.0 if self.fire == "always" else 0.0)


def _drafter(executor, seed=0):
    torch.manual_seed(seed)
    d = FeatureDrafter(executor.config.hidden_size)
    with torch.no_grad():
        d.fc_weight.normal_(0, 0.05)
    return d.eval().requires_grad_(False)


def _candidates(executor, source):
    ngram = source.endswith("+ngram")
    if source.startswith("drafter"):
        # "drafter+exit": a second drafter drafts after an exited token
        exit_drafter = _drafter(executor, seed=5) if "+exit" in source else None
        return DrafterCandidates(executor, _drafter(executor), FIRST, executor.logits, K,
                                 ngram=ngram, exit_drafter=exit_drafter)
    return HeadCandidates(executor, CAND_LAYER, lambda h: executor.logits(h), K, ngram=ngram)


def _step(executor, source, fire, max_early=3, exits_class=SpecEEExits):
    cands = _candidates(executor, source)
    pred = _Predictors(range(cands.layer, NUM_LAYERS), fire)
    scanner = PredictorScan(cands, pred, PredictorSchedule(pred.layers, None), 0.5)
    return VerifiedSpecEEStep(SpecEEDrafter(executor, exits_class(scanner, executor), max_early))


@pytest.mark.parametrize("source", ["head", "head+ngram", "drafter", "drafter+ngram",
                                    "drafter+exit"])
@pytest.mark.parametrize("fire", ["never", "always", "random"])
@pytest.mark.parametrize("max_early", [1, 4])
def test_verified_specee_is_autoregressive_greedy(executor, reference, source, fire, max_early):
    step = _step(executor, source, fire, max_early)
    state = run_step(executor, step, PROMPT, max_new_tokens=30)
    assert state.tokens == reference
    stats = state.stats
    if fire == "never":
        assert stats.drafted == 0
    else:
        assert stats.drafted > 0 and stats.accepted <= stats.drafted
    assert stats.predictor_calls > 0
    lengths = state.cache.lengths()
    assert lengths == [state.seq_len - 1] * NUM_LAYERS   # verification completes every layer


class _Recording(SpecEEExits):
    """Records, per exit decision, the text before the pending token and how many tokens
    were pending; the candidates' spy records the state they were given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.contexts = []

    def choose(self, deferred, sampling, generator=None):
        drafted = [deferred.token(i) for i in range(1, len(deferred))]
        self.contexts.append((list(self._tokens) + drafted, len(deferred)))
        return super().choose(deferred, sampling, generator)


def _hidden_at(executor, tokens, layers):
    """The state leaving ``layers`` layers at the second-to-last of ``tokens`` (no cache)."""
    with torch.inference_mode():
        ids = torch.tensor([tokens[:-1]])
        cache = executor.new_cache(capacity=len(tokens))
        h = executor.run_layers(executor.embed(ids), torch.arange(len(tokens) - 1).unsqueeze(0),
                                0, layers, cache)
    return h[:, -1:]


@pytest.mark.parametrize("source", ["drafter", "drafter+exit"])
def test_the_drafter_reads_verified_states_at_a_drafts_start_and_exit_states_inside(executor,
                                                                                   source):
    """At a draft's start the main drafter reads the previous position's last-layer state
    (from the prefill or from verification); inside a draft, the previous draft position's
    exit-layer state (here always layer 1), as lossy SpecEE does, and the exit-state drafter
    drafts from it when there is one."""
    step = _step(executor, source, "always", max_early=3, exits_class=_Recording)
    seen = []

    class Spied(DrafterCandidates):
        def __call__(self, previous, token_id, ngram=-1, exited=False):
            out = super().__call__(previous, token_id, ngram, exited)
            seen.append((previous.clone(), token_id, exited, out.ids.tolist()))
            return out

    cands = step.exits.scanner.candidates
    cands.__class__ = Spied
    run_step(executor, step, PROMPT, max_new_tokens=12)
    contexts = step.exits.contexts
    assert len(seen) == len(contexts) > 0
    kinds = set()
    for (previous, token, exited, ids), (tokens, pending) in zip(seen, contexts):
        assert token == tokens[-1]
        layers = NUM_LAYERS if pending == 1 else FIRST
        kinds.add(layers)
        assert exited == (pending > 1)
        assert torch.allclose(previous, _hidden_at(executor, tokens, layers), atol=1e-4)
        drafter = cands.exit_drafter if exited and cands.exit_drafter is not None else cands.drafter
        with torch.inference_mode():
            logits = executor.logits(drafter(previous, executor.embed_token(token)))[0, -1]
        assert ids == torch.topk(logits, K).indices.tolist()
    assert kinds == {NUM_LAYERS, FIRST}


@pytest.mark.parametrize("source", ["head", "drafter"])
def test_verified_specee_sampling_reproduces_the_target_distribution(source):
    """Total variation of the first three sampled tokens against the exact target
    distribution (failure probability 1e-6, as test_adadecode)."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, SAMPLING_PROMPT, config, 3)
    cands = _candidates(executor, source)
    pred = _Predictors(range(cands.layer, executor.num_layers), "random")
    scanner = PredictorScan(cands, pred, PredictorSchedule(pred.layers, None), 0.5)
    step = VerifiedSpecEEStep(SpecEEDrafter(executor, SpecEEExits(scanner, executor), 2))
    n = 1500
    tv, eps, drafted = _sampled_tv(executor, step, exact, n, 3)
    assert drafted > n // 3
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"


def test_the_method_with_verify_is_lossless_and_refuses_options_that_do_not_apply(
        executor, reference, tmp_path):
    spec = METHODS["specee"]
    assert spec.lossless_for({"verify": True}) and not spec.lossless_for({})
    path, _ = _head_file(executor, tmp_path, fire=True)
    for options in ({}, {"schedule": "all", "max_early": 2}, {"kv": "deferred"}):
        step = build_step("specee", executor, {"heads": str(path), "verify": True, **options})
        state = run_step(executor, step, PROMPT, max_new_tokens=30)
        assert state.tokens == reference, options
        assert state.stats.drafted > 0 and state.stats.predictor_calls > 0
    with pytest.raises(InvalidArgumentError, match="verify=true.*kv='skip'"):
        build_step("specee", executor, {"heads": str(path), "verify": True, "kv": "skip"})
    with pytest.raises(InvalidArgumentError, match="max_early"):
        build_step("specee", executor, {"heads": str(path), "max_early": 2})


def test_depth_thresholds_fall_linearly_from_the_deepest_predictor_to_the_first():
    got = depth_thresholds([1, 3, 5, 7], deep=0.98, shallow=0.8)
    assert got[7] == pytest.approx(0.98) and got[1] == pytest.approx(0.8)
    assert got[3] == pytest.approx(0.86) and got[5] == pytest.approx(0.92)
    assert depth_thresholds([4], 0.9, 0.5) == {4: pytest.approx(0.5)}


class _Constant(ExitPredictors):
    """Every predictor outputs ``value``."""

    def __init__(self, layers, value):
        super().__init__(list(layers), K, hidden=8)
        self.value = value

    def prob(self, layer, features, state=None):
        return torch.tensor(self.value)


def test_a_per_layer_threshold_exits_where_the_output_clears_that_layers_threshold(
        executor, reference):
    """Outputs of 0.7 everywhere: a flat 0.9 never exits; thresholds rising from 0.6 at the
    first predictor layer to 0.9 at the last exit where theirs is below 0.7, and verified
    decoding stays autoregressive greedy."""
    cands = _candidates(executor, "drafter")
    pred = _Constant(range(FIRST, NUM_LAYERS), 0.7)
    flat = PredictorScan(cands, pred, PredictorSchedule(pred.layers, None), 0.9)
    state = run_step(executor, VerifiedSpecEEStep(SpecEEDrafter(
        executor, SpecEEExits(flat, executor), 3)), PROMPT, max_new_tokens=30)
    assert state.tokens == reference and state.stats.drafted == 0
    rising = depth_thresholds(pred.layers, 0.9, 0.6)
    scan = PredictorScan(cands, pred, PredictorSchedule(pred.layers, None), rising)
    state = run_step(executor, VerifiedSpecEEStep(SpecEEDrafter(
        executor, SpecEEExits(scan, executor), 3)), PROMPT, max_new_tokens=30)
    assert state.tokens == reference and state.stats.drafted > 0
    below = max(x for x, t in rising.items() if t < 0.7)
    exits = {layer for layer, n in enumerate(state.stats.exit_counts) if n}
    assert exits and exits <= set(range(FIRST, below + 1))


def test_the_method_takes_a_shallow_threshold(executor, reference, tmp_path):
    path, _ = _head_file(executor, tmp_path, fire=True)
    step = build_step("specee", executor, {"heads": str(path), "verify": True,
                                            "threshold": 0.9, "shallow_threshold": 0.6})
    thresholds = step.exits.scanner._thresholds
    layers = sorted(thresholds)
    assert thresholds[layers[0]] == pytest.approx(0.6)
    assert thresholds[layers[-1]] == pytest.approx(0.9)
    assert run_step(executor, step, PROMPT, max_new_tokens=30).tokens == reference
    with pytest.raises(InvalidArgumentError, match="shallow_threshold"):
        build_step("specee", executor, {"heads": str(path), "shallow_threshold": 1.5})


def test_a_draft_token_is_picked_among_the_candidates_as_over_the_whole_vocabulary(executor):
    """The exit's logits range over its k candidates (ascending ids): the same token as the
    argmax over [V] with -inf elsewhere, ties to the lowest id, and the same sampling
    distribution once expanded to V."""
    from selfspec.decoding.drafting.exit_drafter import pick_draft_token
    from selfspec.decoding.specee.step import ScanResult

    ids, logits = torch.tensor([9, 7, 3, 5]), torch.tensor([1.0, 2.0, 2.0, 0.5])

    class _Fixed:
        def scan(self, *args):
            return ScanResult(2, ids, logits, torch.zeros(1, 1, 8), 1, 0.0)

    class _Pending:
        def __len__(self):
            return 1

        def token(self, index=-1):
            return 5

    exits = SpecEEExits(_Fixed(), executor)
    exit = exits.choose(_Pending(), SamplingConfig())
    assert exit.layer == 2 and exit.vocab.rows.tolist() == [3, 5, 7, 9]
    assert exit.logits.tolist() == [2.0, 0.5, 2.0, 1.0]
    full = torch.full((executor.vocab_size,), float("-inf"))
    full[ids] = logits
    greedy = SamplingConfig()
    assert pick_draft_token(exit.logits, greedy, None, vocab=exit.vocab).token_id == 3
    assert pick_draft_token(full, greedy, None).token_id == 3
    sampled = SamplingConfig(temperature=0.7, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    q = pick_draft_token(exit.logits, sampled, gen, vocab=exit.vocab).q
    want = pick_draft_token(full, sampled, torch.Generator().manual_seed(0)).q
    assert q.shape == want.shape and torch.allclose(q, want, atol=1e-6)
