"""Corpus-ranked draft vocabulary (decoding/drafting/corpus_vocab.py, data/vocab_corpus.py):
deterministic and cached counts on held-out text, EOS kept; qspec / knapspec drafting through
the reduced head stays lossless and exact; ``auto`` reduces the head where ``lm_head`` is a
large share of a token's bytes, and prices it."""

import os

import pytest
import torch

import selfspec
from selfspec.data import stdlib
from selfspec.data.vocab_corpus import corpus_files, corpus_pieces
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting import corpus_vocab as cv
from selfspec.decoding.drafting.corpus_vocab import (
    DraftHead,
    corpus_counts,
    corpus_vocab,
    head_share,
)
from selfspec.decoding.drafting.skip_drafter import quantized_drafter
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel
from selfspec.executor.quant import quantized_kernels_available
from selfspec.methods.base import MethodContext
from selfspec.methods.registry import build_step

from tiny import (
    VOCAB,
    PrefillOnce,
    assert_samples_follow_target,
    assert_speculated,
    damp_last_layer,
    run_step,
    sampling_model,
    seeded_runs,
    tiny_model,
    tiny_tokenizer,
)

needs_int8 = pytest.mark.skipif(not quantized_kernels_available("int8"),
                                reason="no int8 kernel in this torch build")
powered = pytest.mark.skipif(not os.environ.get("SELFSPEC_SAMPLING_POWER"),
                             reason="powered sampling test: set SELFSPEC_SAMPLING_POWER=1")
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    """Counts go to a temporary home (once per module: one corpus file of ~0.7 MiB)."""
    monkeypatch.setenv("SELFSPEC_HOME", str(_shared_home(tmp_path_factory)))
    monkeypatch.setattr(cv, "VOCAB_CORPUS_BYTES", 1 << 10)  # the first file only


_HOMES = {}


def _shared_home(factory):
    if "home" not in _HOMES:
        _HOMES["home"] = factory.mktemp("vocab-home")
    return _HOMES["home"]


def test_corpus_counts_are_deterministic_cached_and_held_out(tmp_path, monkeypatch):
    tokenizer = tiny_tokenizer()
    first = corpus_counts(tokenizer, VOCAB, tmp_path, max_bytes=1 << 10)
    assert first.tokens > 0 and int(first.counts.sum()) == first.tokens
    assert first.counts[ord("e") - 32] > first.counts[ord("Z") - 32]  # English-like text
    files = list((tmp_path / "draft_vocab").iterdir())
    assert len(files) == 1 and first.corpus.name in first.describe()

    def no_count(*args):
        raise AssertionError("counted again: the cache was not read")

    monkeypatch.setattr(cv, "count_tokens", no_count)
    again = corpus_counts(tokenizer, VOCAB, tmp_path, max_bytes=1 << 10)
    assert torch.equal(again.counts, first.counts) and again.corpus == first.corpus
    assert again.tokenizer == first.tokenizer
    # the corpus: files the stdlib dataset takes no prompt from, in a fixed order
    root, info = corpus_files(1 << 21)
    assert info == corpus_files(1 << 21)[1] and len(info.files) > 1
    for name in info.files:
        text = (root / name).read_text(encoding="utf-8")
        assert stdlib.skipped(tuple(name.split("/"))) or not stdlib.prompts_of_file(name, text)
    assert sum(map(len, corpus_pieces(root, info))) > 0


def test_another_tokenizer_counts_anew_and_eos_is_always_kept(tmp_path):
    tokenizer = tiny_tokenizer()
    counts = corpus_counts(tokenizer, VOCAB, tmp_path, max_bytes=1 << 10)
    other = tiny_tokenizer()
    other.backend_tokenizer.pre_tokenizer = None  # another tokenization: another file
    corpus_counts(other, VOCAB, tmp_path, max_bytes=1 << 10)
    assert len(list((tmp_path / "draft_vocab").iterdir())) == 2
    assert counts.counts[VOCAB - 1] == 0  # "</s>" never occurs in the corpus
    vocab = corpus_vocab(counts, 8, {VOCAB - 1})
    assert vocab.size == 9 and VOCAB - 1 in vocab.rows.tolist()
    top = torch.sort(-counts.counts, stable=True).indices[:8]
    assert set(top.tolist()) < set(vocab.rows.tolist())
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        corpus_counts(None, VOCAB, tmp_path)


def test_a_draft_head_scores_exactly_the_kept_rows():
    executor = LayerExecutor(tiny_model("llama"))
    context = MethodContext(executor, tiny_tokenizer())
    vocab = context.corpus_vocab(40)
    head = DraftHead(executor, vocab)
    hidden = torch.randn(1, 3, executor.config.hidden_size)
    torch.testing.assert_close(head(hidden), executor.logits(hidden)[..., vocab.rows])
    assert head.decode_bytes < executor.output_weights.decode_bytes
    assert context.corpus_vocab(40) is vocab  # built once per context


@needs_int8
@pytest.mark.parametrize("options", [
    {"draft_weights": "int8", "draft_vocab": 200},
    {"draft_weights": "int8", "draft_vocab": 200, "exit_layer": 5, "confidence": 0}])
def test_qspec_through_a_corpus_vocabulary_keeps_the_greedy_tokens(options):
    engine = selfspec.from_pretrained_model(damp_last_layer(tiny_model("llama")),
                                            tiny_tokenizer(), name="tiny")
    reference = engine.generate(PROMPT, max_new_tokens=32).token_ids
    result = engine.generate(PROMPT, method="qspec", max_new_tokens=32, **options)
    assert result.token_ids == reference
    assert_speculated(result.stats)
    drafter = build_step("qspec", engine.methods, options).drafter
    assert drafter.policy.vocab.size == 201  # + EOS (255), never in the corpus


@pytest.mark.parametrize("draft_weights", [None, pytest.param("int8", marks=needs_int8)])
def test_knapspec_through_a_corpus_vocabulary_keeps_the_greedy_tokens(monkeypatch,
                                                                       draft_weights):
    executor = LayerExecutor(damp_last_layer(tiny_model("llama", seed=4), 0.2))
    context = MethodContext(executor, tiny_tokenizer())
    # a hand-made latency model under which skipping layers pays (test_knapspec's)
    monkeypatch.setattr(context, "latency", lambda ex=None: LatencyModel(
        executor.num_layers, 0.0, 1.0, 1.0, 0.5, key="hand-made"))
    ids = [5, 17, 42, 99, 3, 250, 7]
    reference = run_step(executor, ArStep(), ids, max_new_tokens=40).tokens
    options = {"draft_vocab": 200, "draft_weights": draft_weights, "reoptimize_every": 6,
               "tau": -1.0, "confidence": 0.01, "plan_budget": 1e9}
    step = build_step("knapspec", context, options)
    state = run_step(executor, step, ids, max_new_tokens=40)
    assert state.tokens == reference
    assert_speculated(state.stats)
    assert step.drafter.policy.vocab.size == 201  # + EOS
    # the plan search prices the reduced head: its share of lm_head's bytes
    assert step.draft_latency.draft_head_ms < 0.9 * step.draft_latency.head_ms


def test_a_corpus_vocabulary_needs_the_tokenizer():
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        build_step("knapspec", LayerExecutor(tiny_model("llama")), {"draft_vocab": 16})


@needs_int8
@pytest.mark.parametrize("new_tokens,num_samples", [
    (4, 500), pytest.param(6, 1500, marks=powered)])
def test_sampling_through_a_corpus_vocabulary_reproduces_the_target_distribution(
        new_tokens, num_samples):
    """Drafts restricted to 8 of the 32 tokens (q zero elsewhere) on the int8 copy: the
    target's other tokens come only from rejections' residual distribution, and the samples
    still follow the target, with power against a sampler one top-k token off (the short
    case by default; the 6-token one, as test_sampling_power's, where that is set)."""
    executor = LayerExecutor(sampling_model(vocab=32))
    context = MethodContext(executor, tiny_tokenizer())
    draft = executor.draft_view("int8")
    head = DraftHead(draft, context.corpus_vocab(8))  # the model has no EOS: 8 rows
    assert head.vocab.size == 8
    drafter = quantized_drafter(executor, draft, make_stop_rule("constant", draft_len=3),
                                exit_layer=2, vocab=head.vocab, head=head)
    prompt = [5, 17, 3, 9]
    config = SamplingConfig(temperature=1.0, top_k=4)
    runs = PrefillOnce(executor, prompt)
    generate = seeded_runs(runs, SpeculativeStep(drafter), config, new_tokens)
    assert_samples_follow_target(executor, prompt, config, generate, num_samples, new_tokens)


def _auto_step(vocab_size, **options):
    engine = selfspec.from_pretrained_model(damp_last_layer(tiny_model(
        "llama", vocab_size=vocab_size)), tiny_tokenizer(), name=f"tiny-v{vocab_size}")
    return engine, build_step("auto", engine.methods,
                              {"drafters": "qspec", "draft_weights": "int8", **options})


@needs_int8
def test_auto_drafts_through_the_reduced_head_where_lm_head_is_most_bytes():
    engine, step = _auto_step(8192, draft_vocab=512)
    assert head_share(engine.executor) > 0.6
    (model,) = step.models
    assert model.name == "qspec[v512]" and model.drafter.policy.vocab.size == 512
    _, full = _auto_step(8192, draft_vocab=0)
    (full_model,) = full.models
    assert full_model.name == "qspec" and full_model.drafter.policy.vocab is None
    # priced with the reduced head: a fraction of the full head's draft cost
    assert model.draft_cost < 0.5 * full_model.draft_cost
    reference = engine.generate(PROMPT, max_new_tokens=24).token_ids
    result = engine.generate(PROMPT, method="auto", max_new_tokens=24, drafters="qspec",
                             draft_weights="int8", draft_vocab=512)
    assert result.token_ids == reference and "qspec[v512]" in result.stats.drafters


@needs_int8
def test_auto_keeps_the_full_head_where_lm_head_is_a_small_share():
    engine, step = _auto_step(VOCAB, draft_vocab=64)
    assert head_share(engine.executor) < 0.4
    (model,) = step.models
    assert model.name == "qspec" and model.drafter.policy.vocab is None
