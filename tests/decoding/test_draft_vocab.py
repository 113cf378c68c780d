"""Reduced draft vocabulary (FR-Spec-style): ranking, restricted heads, losslessness."""

import math
from collections import Counter

import pytest
import torch

from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.draft_vocab import (
    DraftVocab,
    check_draft_vocab,
    frequent_rows,
)
from selfspec.decoding.drafting.exit_drafter import DSSDDrafter, EarlyExitDrafter
from selfspec.decoding.drafting.exits import CalibratedExits
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.modules import make_head, output_layer
from selfspec.methods.registry import build_step

from tiny import (
    VOCAB,
    PrefillOnce,
    assert_speculated,
    damp_last_layer,
    exact_prefix_distribution,
    global_rng,
    run_step,
    tiny_model,
)

PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _run(executor, decoder, **options):
    return run_step(executor, decoder, PROMPT, **options)


def test_frequent_rows_rank_by_count_break_ties_by_id_and_keep_eos():
    counts = torch.tensor([5, 0, 9, 5, 1, 0, 0, 2])
    vocab = frequent_rows(counts, 3, always=[6])
    # 9 (id 2), then 5 (ids 0 and 3): ties keep the lower id; EOS id 6 is always kept
    assert vocab.rows.tolist() == [0, 2, 3, 6] and vocab.vocab_size == 8
    assert frequent_rows(counts, 8).rows.tolist() == list(range(8))
    full = vocab.expand(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert full.tolist() == pytest.approx([0.1, 0, 0.2, 0.3, 0, 0, 0.4, 0])


@pytest.mark.parametrize("size", [0, -3, 9, 2.5, True, "8"])
def test_bad_draft_vocab_sizes_are_refused(size):
    with pytest.raises(InvalidArgumentError, match=r"draft_vocab must be an integer in \[1, 8\]"):
        check_draft_vocab(size, 8)


@pytest.mark.parametrize("kind", ["lightweight", "full"])
def test_restricted_heads_score_exactly_the_kept_rows(kind):
    executor = LayerExecutor(tiny_model("llama", seed=2))
    head = make_head(kind, 3, output_layer(executor), init="lm_head").prepare_inference()
    rows = torch.tensor([0, 7, 8, 100, 255])
    hidden = torch.randn(1, 4, 64)
    with torch.inference_mode():
        full = head(hidden)
        assert torch.allclose(head.restricted(rows)(hidden), full[..., rows], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("size", [4, 64, VOCAB])
def test_early_exit_with_a_reduced_vocabulary_is_lossless(arch, size):
    # A damped last layer drafted from the layer before it, and the kept rows ranked by the
    # reference's own token counts: drafts are accepted and rejected (with an exit at layer 3
    # of the plain model and the low ids kept, none of 111 drafts was accepted).
    executor = LayerExecutor(damp_last_layer(tiny_model(arch, seed=21, num_layers=6), 0.2))
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=40).tokens
    counts = torch.bincount(torch.tensor(reference[len(PROMPT):]), minlength=VOCAB)
    vocab = frequent_rows(counts, size, always=[VOCAB - 1])
    drafter = EarlyExitDrafter(executor, 5, make_stop_rule("constant", draft_len=3), vocab=vocab)
    state = _run(executor, SpeculativeStep(drafter), max_new_tokens=40)
    assert state.tokens == reference
    assert_speculated(state.stats)
    drafted = set(state.tokens[len(PROMPT):])
    if size == 4:  # tokens outside the kept rows still appear: verification supplies them
        assert drafted - set(vocab.rows.tolist())


class HeadsWithThresholds:
    def __init__(self, heads, taus):
        self.heads, self.layers, self.taus = heads, [h.layer for h in heads], taus

    def thresholds(self, epsilon, metric, draft_vocab=None):
        return self.taus


def test_dssd_with_a_reduced_vocabulary_is_lossless():
    executor = LayerExecutor(tiny_model("qwen2", seed=22, num_layers=8))
    reference = _run(executor, build_step("ar", executor, {}), max_new_tokens=40).tokens
    out = output_layer(executor)
    heads = [make_head("lightweight", layer, out).prepare_inference() for layer in (2, 4, 6)]
    vocab = frequent_rows(torch.arange(VOCAB).flip(0), 96)
    exits = CalibratedExits(HeadsWithThresholds(heads, [0.5, 0.2, 0.05]), 0.9, "max_prob",
                            vocab, executor, draft_vocab=96)
    state = _run(executor, SpeculativeStep(DSSDDrafter(executor, exits, 6)),
                 max_new_tokens=40)
    assert state.tokens == reference and state.stats.drafted > 0


def test_draft_vocab_needs_heads_with_token_counts():
    executor = LayerExecutor(tiny_model("llama", seed=2))
    with pytest.raises(InvalidArgumentError, match="heads=PATH"):
        build_step("layerskip", executor, {"exit_layer": 3, "draft_vocab": 16})
    with pytest.raises(InvalidArgumentError, match="draft_vocab must be"):
        build_step("layerskip", executor, {"exit_layer": 3, "draft_vocab": VOCAB + 1})


def test_sampling_with_a_reduced_vocabulary_reproduces_the_target_distribution():
    """As test_speculative's TV test, with drafts limited to the even token ids: the target's
    odd tokens can then only come from the residual distribution of a rejection."""
    executor = LayerExecutor(tiny_model("llama", seed=8))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = exact_prefix_distribution(executor, PROMPT, config, 3)
    vocab = DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)
    drafter = EarlyExitDrafter(executor, 1, make_stop_rule("constant", draft_len=2), vocab=vocab)
    decoder = SpeculativeStep(drafter)
    n = 1500
    counts = Counter()
    runs = PrefillOnce(executor, PROMPT)  # each run exactly _run's, one prefill shared
    for seed in range(n):
        state = runs.run(decoder, max_new_tokens=3,
                         sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed)))
        counts[tuple(state.tokens[len(PROMPT):])] += 1
    assert any(t % 2 for c in exact for t in c)  # the target does need odd tokens
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
