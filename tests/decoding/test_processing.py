"""Output processing (decoding/core/processors.py, grammar.py): every lossless method gives
exactly constrained / penalised `ar`'s greedy tokens and the same log probabilities, drafts
the grammar forbids are rejected without touching the matcher, speculative sampling
reproduces the processed distribution, and bad constraints fail before any token."""

import json
import math
import re
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.batch import run_batch
from selfspec.decoding.core.processors import LogitsProcessing, LogitsProcessor, Penalties
from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.decoding.core.speculative import DraftOutput, SpeculativeStep, TargetOutput
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.ngram.batch import BatchNgramStep
from selfspec.decoding.ngram.drafter import NgramSettings
from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import LatencyModel
from selfspec.methods.registry import METHODS

from tiny import VOCAB, run_step, tiny_model, tiny_tokenizer

pytest.importorskip("llguidance")

NO_HEADS = {"adadecode": {"heads": "none", "gamma": 0.0}, "auto": {"drafters": "ngram"}}
SKIPPED = {"dssd", "adaspeed-probe", "swift"}  # need trained heads / a searched skip set
LOSSLESS = [name for name, spec in METHODS.items()
            if spec.lossless_for(spec.options()) and name not in SKIPPED]
REGEX = {"type": "regex", "regex": "[a-c]{2,5}(-[a-c]{2,5}){1,3}"}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
    "type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                    "maximum": 99},
                   "tag": {"enum": ["red", "green", "blue"]}}}}}
PROMPTS = ["abcabcabc-abc-ab", "the cat sat on the mat; the cat sat on"]


@pytest.fixture(scope="module")
def engine():
    return selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(),
                                          "tiny-llama")


@pytest.fixture(scope="module")
def reference(engine):
    """Constrained and penalised `ar` on every prompt: token ids and logprobs."""
    out = {}
    for fmt in ("regex", "schema"):
        for prompt in PROMPTS:
            r = engine.generate(prompt, max_new_tokens=40, logprobs=3,
                                response_format=REGEX if fmt == "regex" else SCHEMA,
                                presence_penalty=0.7, frequency_penalty=0.3)
            out[fmt, prompt] = r
    return out


def test_constrained_ar_output_follows_the_grammar(reference):
    # where the grammar forces a token, the forbidden alternatives come with -inf
    assert any(lp.top[-1][1] == -math.inf for r in reference.values() for lp in r.logprobs)
    for (fmt, _), r in reference.items():
        assert r.stats.finish_reason == "eos", r.text
        if fmt == "regex":
            assert re.fullmatch(REGEX["regex"], r.text), r.text
        else:
            value = json.loads(r.text)
            assert set(value) == {"ok", "n", "tag"} and value["tag"] in ("red", "green", "blue")
            assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
        assert [lp.token for lp in r.logprobs] == r.token_ids
        assert all(lp.top[0][1] >= lp.logprob - 1e-6 and len(lp.top) == 3 for lp in r.logprobs)


@pytest.mark.parametrize("method", LOSSLESS)
def test_every_lossless_method_equals_constrained_ar(engine, reference, method):
    drafted = 0
    for (fmt, prompt), ref in reference.items():
        r = engine.generate(prompt, method=method, max_new_tokens=40, logprobs=3,
                            response_format=REGEX if fmt == "regex" else SCHEMA,
                            presence_penalty=0.7, frequency_penalty=0.3,
                            **NO_HEADS.get(method, {}))
        assert r.token_ids == ref.token_ids, (method, fmt, prompt)
        drafted += r.stats.drafted
        for a, b in zip(r.logprobs, ref.logprobs, strict=False):
            assert a.token == b.token and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert drafted > 0 or method in ("ar", "knapspec")  # knapspec may plan no draft here


def test_batched_rows_equal_their_constrained_single_runs(engine, reference):
    for method in ("ar", "ngram", "auto", "layerskip"):
        results = engine.generate(PROMPTS, method=method, max_new_tokens=40,
                                  response_format=REGEX, presence_penalty=0.7,
                                  frequency_penalty=0.3, **NO_HEADS.get(method, {}))
        assert [r.token_ids for r in results] == [reference["regex", p].token_ids
                                                  for p in PROMPTS], method


def test_penalties_change_the_output_and_auto_keeps_ar_tokens(engine):
    prompt = "the cat sat on the mat; the cat sat on"
    plain = engine.generate(prompt, max_new_tokens=32).token_ids
    ar = engine.generate(prompt, max_new_tokens=32, frequency_penalty=1.5).token_ids
    assert ar != plain
    for method in ("ngram", "auto", "dv"):
        assert engine.generate(prompt, method=method, max_new_tokens=32, frequency_penalty=1.5,
                               **NO_HEADS.get(method, {})).token_ids == ar


class ScriptedDrafter:
    """Drafts a fixed list of tokens (valid, then one the grammar forbids, then more)."""

    stop_rule = None

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, state):
        ids = torch.tensor(self.tokens)
        return DraftOutput(list(self.tokens), ids, None, [0] * len(self.tokens))

    def target_logits(self, state, draft):
        ex = state.executor
        ids = torch.tensor([[state.tokens[-1], *draft.tokens]])
        pos = state.positions(state.seq_len - 1, ids.shape[1])
        return TargetOutput(ex.forward(ids, pos, state.cache)[0], 0)

    def update(self, stats):
        pass


def test_a_draft_rejected_mid_grammar_leaves_the_matcher_on_the_committed_tokens(engine):
    tok = engine.tokenizer
    grammar = engine.grammar(REGEX)
    prompt = engine.encode("abc")
    options = DecodeOptions(max_new_tokens=12, eos_token_ids=engine.eos_token_ids,
                            processing=LogitsProcessing(grammar=grammar))
    reference = run_step(engine.executor, ArStep(), prompt, max_new_tokens=12,
                         eos_token_ids=engine.eos_token_ids,
                         processing=LogitsProcessing(grammar=grammar)).tokens
    first = reference[len(prompt)]
    # After the first token: a valid token, a forbidden one ("z"), then valid-looking ones.
    draft = [reference[len(prompt) + 1], tok.convert_tokens_to_ids("z"), *tok.encode("ab")]
    state = DecodeState(engine.executor, prompt, options)
    with torch.inference_mode():
        logits = state.process(state.prefill())
        state.commit([first], logits)
        stats = SpeculativeStep(ScriptedDrafter(draft))(state)
    assert stats.num_drafted == 4 and stats.num_accepted <= 1
    assert state.tokens == reference[: state.seq_len]
    # The matcher followed the committed tokens only: its next mask equals a fresh matcher's
    # after the same tokens.
    fresh = grammar.matcher()
    fresh.commit(state.tokens[len(prompt):])
    assert torch.equal(state.processor.matcher.masks([], 1), fresh.masks([], 1))


def _exact(executor, prompt, config, processing, length):
    """Exact distribution of ``length``-token continuations under the processed target."""
    dist = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            nxt = {}
            for prefix, mass in dist.items():
                proc = LogitsProcessor(processing, executor.vocab_size)
                for t in prefix:
                    proc.commit([t], None)
                ids = torch.tensor([list(prompt) + list(prefix)])
                logits = executor.forward(ids, torch.arange(ids.shape[1])[None],
                                          executor.new_cache())[0, -1:]
                probs = logits_to_probs(proc.apply(logits), config)[0]
                for tok in torch.nonzero(probs).flatten().tolist():
                    nxt[prefix + (tok,)] = mass * float(probs[tok])
            dist = nxt
    return dist


def test_speculative_sampling_reproduces_the_processed_distribution():
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=8, num_layers=2),
                                            tiny_tokenizer(), "tiny")
    executor = engine.executor
    prompt = engine.encode("ab-ab-ab-ab-a")
    processing = LogitsProcessing(Penalties(presence=0.5, frequency=0.5),
                                  engine.grammar({"type": "regex", "regex": "[ab-]{1,8}"}))
    config = SamplingConfig(temperature=1.0, top_k=3)
    exact = _exact(executor, prompt, config, processing, 3)
    latency = LatencyModel(2, 0.0, 1.0, 1.0, 1.0, verify_token_ms=0.05)
    n, rows, drafted = 1200, 40, 0
    counts = Counter()
    for batch in range(n // rows):
        step = BatchNgramStep(executor, latency, NgramSettings(min_ngram=1, min_share=0.0,
                                                               prior=0.9))
        states = [DecodeState(executor, prompt, DecodeOptions(
            max_new_tokens=3, processing=processing,
            sampling=SamplingConfig(temperature=1.0, top_k=3, seed=batch * rows + r)))
            for r in range(rows)]
        with torch.inference_mode():
            run_batch(states, step)
        for s in states:
            counts[tuple(s.tokens[len(prompt):])] += 1
            drafted += s.stats.drafted
    assert drafted > n // 4
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
    assert VOCAB == 256


@pytest.mark.parametrize("response_format,match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "strin"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "regex", "regex": "(("}, "regex"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "xml"),
    ("json", "object"),
])
def test_bad_constraints_fail_before_any_token(engine, response_format, match):
    with pytest.raises(InvalidArgumentError, match=match):
        engine.generate("abc", max_new_tokens=4, response_format=response_format)


@pytest.mark.parametrize("kwargs,match", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_processing_values_are_refused(engine, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        engine.generate("abc", max_new_tokens=4, **kwargs)


def test_lossy_specee_refuses_processing_before_it_runs(engine):
    from selfspec.decoding.core.loop import check_processing
    from selfspec.decoding.specee.step import SpecEEStep

    assert not SpecEEStep.processes_logits
    state = DecodeState(engine.executor, [1, 2], DecodeOptions(
        processing=LogitsProcessing(logprobs=0)))
    with pytest.raises(InvalidArgumentError, match="lossless"):
        check_processing(SpecEEStep.processes_logits, state)
