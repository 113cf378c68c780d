"""SpecEE's compiled per-token work (decoding/specee/kernel.py): the per-layer decision and the
drafter candidates agree with the torch path on tiny bf16 models, the method uses them where
they run and falls back (or refuses, with kernel=kernel) where they do not, and verified SpecEE
through them is still exactly autoregressive greedy."""

import math

import pytest
import torch

from selfspec.decoding.specee.kernel import (
    CandidateKernel,
    KernelLayerDecision,
    TorchLayerDecision,
    candidate_kernel,
    kernel_unavailable_reason,
    layer_decision,
)
from selfspec.decoding.specee.step import DrafterCandidates
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, save_heads
from selfspec.heads.card import DrafterCard, PredictorCard
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.files import new_card
from selfspec.heads.modules import make_head, output_layer
from selfspec.heads.predictor import ExitPredictors

from tiny import run_step, tiny_model

pytestmark = pytest.mark.skipif(bool(kernel_unavailable_reason()),
                                reason=f"SpecEE kernel: {kernel_unavailable_reason()}")

K, NUM_LAYERS, FIRST, LENS = 4, 6, 1, 3
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module", params=[("llama", 64), ("qwen2", 72)])
def executor(request):
    arch, hidden = request.param  # 72: every dot product has a tail past its 16-wide chunks
    return LayerExecutor(tiny_model(arch, seed=11, num_layers=NUM_LAYERS, dtype=torch.bfloat16,
                                    hidden_size=hidden))


def _h(executor):
    return executor.config.hidden_size


def _lens_head(executor, seed=0):
    head = make_head("lightweight", LENS, output_layer(executor), init="lm_head")
    torch.manual_seed(seed)
    with torch.no_grad():
        h = head.transform.shape[0]
        head.transform.copy_(torch.eye(h) + 0.5 * torch.randn(h, h) / h ** 0.5)
    return head.to(torch.bfloat16).prepare_inference()


def _predictors(executor, state: bool, fire: float = 0.0, seed=0) -> ExitPredictors:
    """Random predictors (state-reading or SpecEE's 12 features), output bias ``fire``."""
    torch.manual_seed(seed)
    pred = ExitPredictors(list(range(FIRST, NUM_LAYERS)), K, hidden=16,
                          state_dim=_h(executor) if state else 0)
    with torch.no_grad():
        pred.fc2_bias.fill_(fire)
        if state:
            pred.feature_mean.normal_(0, 0.5)
            pred.feature_std.uniform_(0.5, 2.0)
    return pred.eval().requires_grad_(False)


def _drafter(executor, seed=2):
    torch.manual_seed(seed)
    d = FeatureDrafter(_h(executor))
    with torch.no_grad():
        d.fc_weight.normal_(0, 0.05)
        d.fc_bias.normal_(0, 0.05)
    return d.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.mark.parametrize("state", [False, True])
def test_the_kernel_decision_is_the_torch_decision(executor, state):
    """Features, probabilities and predictor outputs agree with the torch path at every layer
    (a lens layer included, with and without the previous layer's probabilities, predictor
    on and off); fp32 order and bf16 first-layer weights are the only differences."""
    pred = _predictors(executor, state)
    head = _lens_head(executor)
    reference = TorchLayerDecision(executor, pred, {LENS: head.transform_normed})
    fused = KernelLayerDecision(executor, pred, {LENS: head.transform})
    gen = torch.Generator().manual_seed(5)
    rows = executor.lm_head.weight[torch.randperm(executor.vocab_size, generator=gen)[:K]]
    previous = None
    for layer in pred.layers:
        hidden = (torch.randn(1, 1, _h(executor), generator=gen) * 3).to(torch.bfloat16)
        for predict in (False, True):
            want = reference(layer, hidden, rows, None, previous, predict)
            got = fused(layer, hidden, rows, None, previous, predict)
            # logits: bf16 values, at most one rounding step apart
            assert torch.allclose(got.scores.logits, want.scores.logits, rtol=1e-2, atol=1e-2)
            assert torch.allclose(got.scores.features, want.scores.features, rtol=1e-2,
                                  atol=1e-2), layer
            if predict:
                assert got.prob == pytest.approx(want.prob, abs=1e-2)
            else:
                assert got.prob is None and want.prob is None
        previous = want.scores.probs.clone()
    # the lens is read: without it the lens layer's logits differ
    plain = KernelLayerDecision(executor, pred, {})
    hidden = (torch.randn(1, 1, _h(executor), generator=gen) * 3).to(torch.bfloat16)
    lensed = fused(LENS, hidden, rows, None, None, False).scores.logits.clone()
    assert not torch.allclose(plain(LENS, hidden, rows, None, None, False).scores.logits, lensed)


def test_the_candidate_kernel_is_the_drafters_top_k(executor):
    drafter = _drafter(executor)
    rows = torch.arange(3, executor.vocab_size, 2)  # a draft vocabulary
    from selfspec.decoding.drafting.draft_vocab import restricted_lm_head

    class Vocab:
        key = "odd"

    Vocab.rows = rows
    output = restricted_lm_head(executor, Vocab)
    fused = CandidateKernel(executor, drafter, rows, K)
    gen = torch.Generator().manual_seed(3)
    for token in (5, 17, 250):
        previous = (torch.randn(1, 1, _h(executor), generator=gen) * 3).to(torch.bfloat16)
        embedding = executor.embed(torch.tensor([[token]]))
        logits = output(drafter(previous, embedding))[0, -1].float()
        top = fused(previous, embedding)
        assert torch.allclose(logits[top], torch.topk(logits, K).values, atol=1e-2)
        assert logits[top].tolist() == sorted(logits[top].tolist(), reverse=True)
    # all V rows
    full = CandidateKernel(executor, drafter, None, K)
    logits = executor.logits(drafter(previous, embedding))[0, -1].float()
    assert torch.allclose(logits[full(previous, embedding)], torch.topk(logits, K).values,
                          atol=1e-2)


def test_auto_falls_back_to_torch_and_kernel_says_why(executor):
    pred = _predictors(executor, True)
    assert isinstance(layer_decision(executor, pred, {}, "auto"), KernelLayerDecision)
    assert isinstance(layer_decision(executor, pred, {}, "torch"), TorchLayerDecision)
    with pytest.raises(InvalidArgumentError, match="kernel must be one of"):
        layer_decision(executor, pred, {}, "fast")
    fp32 = LayerExecutor(tiny_model("llama", seed=11, num_layers=NUM_LAYERS))
    assert isinstance(layer_decision(fp32, pred, {}, "auto"), TorchLayerDecision)
    with pytest.raises(InvalidArgumentError, match="needs a bf16 model.*kernel=torch"):
        layer_decision(fp32, pred, {}, "kernel")
    drafter = _drafter(executor)
    assert candidate_kernel(executor, drafter, executor.logits, None, K, "torch") is None
    assert isinstance(candidate_kernel(executor, drafter, executor.logits, None, K, "auto"),
                      CandidateKernel)


class _OnePlusNorm(torch.nn.Module):
    """A Gemma-style RMSNorm (``x · (1 + w)``): the kernel computes ``x · w``."""

    def __init__(self, norm):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x):
        v = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1 + self.weight.float()) * v).to(x.dtype)


def test_a_norm_the_kernel_does_not_compute_is_caught_by_the_check(executor):
    pred = _predictors(executor, False)
    original = executor.norm
    executor.norm = _OnePlusNorm(original)
    try:
        assert isinstance(layer_decision(executor, pred, {}, "auto"), TorchLayerDecision)
        with pytest.raises(InvalidArgumentError, match="features differ"):
            layer_decision(executor, pred, {}, "kernel")
    finally:
        executor.norm = original


def _head_file(executor, tmp_path):
    """A head file: lens head at LENS, drafter, state-reading predictors that fire often."""
    out = output_layer(executor)
    cand = make_head("lightweight", 2, out, init="lm_head").to(torch.bfloat16).prepare_inference()
    layers, heads = [2, LENS], [cand, _lens_head(executor)]
    card = new_card(executor.model, "lightweight", layers)
    container = ExitHeads(layers, heads, card)
    pred = _predictors(executor, True, fire=2.0)
    container.predictors = pred
    container.drafter = _drafter(executor)
    n = len(pred.layers)
    card.predictors = PredictorCard(
        candidate_layer=FIRST, num_candidates=K, draft_vocab=0, hidden=pred.hidden,
        layers=pred.layers, offline_layers=[2, LENS], exit_frequency=[0.1] * n,
        candidate_recall=0.5, base_rate=[0.2] * n, accuracy=[0.8] * n, precision=[0.9] * n,
        train_tokens=10, eval_tokens=5, epochs=1, seconds=0.1, candidates="drafter",
        lens_layers=[LENS], state_dim=pred.state_dim)
    card.drafter = DrafterCard(draft_vocab=0, exit_mix=0.25, exit_layers=[4], epochs=1,
                               lr=1e-3, seconds=0.1, train_tokens=10, eval_tokens=5, top1=0.3,
                               topk=math.nan)
    return save_heads(container, tmp_path / "heads.safetensors")


def test_verified_specee_through_the_kernels_is_autoregressive_greedy(executor, tmp_path):
    from selfspec.methods.registry import build_step

    path = _head_file(executor, tmp_path)
    ref = run_step(executor, build_step("ar", executor, {}), PROMPT, max_new_tokens=24).tokens
    outputs = {}
    for kernel in ("kernel", "torch"):
        step = build_step("specee", executor, {"heads": str(path), "verify": True,
                                                "threshold": 0.6, "kernel": kernel})
        scanner = step.exits.scanner
        assert isinstance(scanner.candidates, DrafterCandidates)
        assert (scanner.candidates.fused is not None) == (kernel == "kernel")
        assert isinstance(scanner.decision,
                          KernelLayerDecision if kernel == "kernel" else TorchLayerDecision)
        state = run_step(executor, step, PROMPT, max_new_tokens=24)
        assert state.tokens == ref, kernel
        assert state.stats.drafted > 0
        outputs[kernel] = state.stats
    # the same predictors decide alike (rounding could only move a decision at the threshold)
    assert outputs["kernel"].drafted == pytest.approx(outputs["torch"].drafted, abs=2)
