"""Drafting under a grammar (decoding/ngram/constrained.py, grammar.DraftGuide, the exit
drafter's masked picks and forced tokens): n-gram drafts are cut to what the grammar allows
and extended with what it forces, model drafters draft valid tokens and insert forced ones
without a draft forward each, and all of it stays lossless (greedy = constrained ar;
sampling reproduces the processed distribution)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.processors import LogitsProcessing, LogitsProcessor
from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter, exit_plan
from selfspec.decoding.drafting.stop_rules import ConstantStopRule
from selfspec.decoding.ngram.constrained import FORCED_KEY, constrain
from selfspec.decoding.ngram.lookup import NgramProposal

from tiny import global_rng, run_step, tiny_model, tiny_tokenizer

pytest.importorskip("llguidance")

SCHEMA = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
    "type": "object", "additionalProperties": False, "required": ["flag", "colour"],
    "properties": {"flag": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}}}}}


@pytest.fixture(scope="module")
def engine():
    return selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(),
                                          "tiny-llama")


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _processor(engine, committed=""):
    proc = LogitsProcessor(LogitsProcessing(grammar=engine.grammar(SCHEMA)), engine.vocab_size)
    if committed:
        proc.commit(_ids(engine, committed), None)
    return proc


def test_forced_tokens_follow_the_grammar_without_moving_it(engine):
    proc = _processor(engine)
    decode = engine.tokenizer.decode
    assert decode(proc.forced_tokens()) == '{"flag":'
    proc.commit(_ids(engine, '{"flag":'), None)
    assert proc.forced_tokens() == []  # true or false: nothing forced
    assert decode(proc.forced_tokens(_ids(engine, "t"))) == 'rue,"colour":"'
    assert decode(proc.forced_tokens(_ids(engine, 'false,"colour":"g'), limit=3)) == "ree"
    assert proc.forced_tokens(_ids(engine, "x")) == []  # a forbidden token: nothing
    assert proc.valid_prefix(_ids(engine, "tx")) == 1  # the matcher stayed where it was
    guide = proc.draft_guide()
    guide.advance(_ids(engine, "f")[0])
    assert decode(guide.forced_tokens(8)) == 'alse,"co'
    assert proc.valid_prefix(_ids(engine, "tru")) == 3  # the guide is a copy


def test_constrain_cuts_copies_to_the_grammar_and_appends_what_it_forces(engine):
    proc = _processor(engine, '{"flag":')
    copied = NgramProposal(_ids(engine, "truexyz"), [1.0] * 7, 3, "context")
    out = constrain([copied], proc, 16)
    assert engine.tokenizer.decode(out.tokens) == 'true,"colour":"'
    assert (out.copied, out.source, out.match_len) == (4, "context", 3)
    bad = NgramProposal(_ids(engine, "xx"), [1.0, 1.0], 4, "history")
    assert constrain([bad, copied], proc, 16).source == "context"  # the next valid one
    assert constrain([bad], proc, 16) is None
    forced = constrain([copied], _processor(engine), 4)  # at the start: forced tokens first
    assert engine.tokenizer.decode(forced.tokens) == '{"fl' and forced.forced == 4
    assert (forced.source, 0) == FORCED_KEY
    assert constrain([copied], None, 16) is copied  # no grammar: unchanged


def test_model_drafts_are_valid_and_forced_tokens_skip_the_draft_forward(engine, monkeypatch):
    ex = engine.executor
    prompt = engine.encode("abc")
    options = dict(max_new_tokens=30, eos_token_ids=engine.eos_token_ids,
                   processing=LogitsProcessing(grammar=engine.grammar(SCHEMA)))
    ar = run_step(ex, ArStep(), prompt, **options).tokens
    assert ar[-1] in engine.eos_token_ids  # the schema completed
    calls = []
    drafter = SkipPlanDrafter(ex, exit_plan(ex, 2), ConstantStopRule(12))
    original = drafter.policy.choose_fed
    monkeypatch.setattr(drafter.policy, "choose_fed",
                        lambda deferred, fed, *a: calls.append(fed) or original(deferred, fed, *a))
    state = run_step(ex, SpeculativeStep(drafter), prompt, **options)
    assert state.tokens == ar and state.stats.drafted > 0
    assert max(calls) > 1  # forced tokens ran together with the next draft position


def _exact(executor, prompt, config, processing, length, eos):
    """Exact distribution of continuations of up to ``length`` tokens (ending at ``eos``)
    under the processed target."""
    dist = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            nxt = {}
            for prefix, mass in dist.items():
                if prefix and prefix[-1] in eos:
                    nxt[prefix] = mass
                    continue
                proc = LogitsProcessor(processing, executor.vocab_size)
                proc.commit(list(prefix), None)
                ids = torch.tensor([list(prompt) + list(prefix)])
                logits = executor.forward(ids, torch.arange(ids.shape[1])[None],
                                          executor.new_cache())[0, -1:]
                probs = logits_to_probs(proc.apply(logits), config)[0]
                for tok in torch.nonzero(probs).flatten().tolist():
                    nxt[prefix + (tok,)] = mass * float(probs[tok])
            dist = nxt
    return dist


def test_masked_model_drafts_with_forced_tokens_keep_the_sampled_distribution():
    engine = selfspec.from_pretrained_model(tiny_model("llama", seed=8, num_layers=2),
                                            tiny_tokenizer(), "tiny")
    ex = engine.executor
    prompt = engine.encode("ab-ab-ab-a")
    # After "a" the grammar forces "b-": forced tokens inside sampled model drafts.
    processing = LogitsProcessing(grammar=engine.grammar(
        {"type": "regex", "regex": "(ab-|c){1,6}"}))
    config = SamplingConfig(temperature=1.0, top_k=3)
    length = 5
    eos = engine.eos_token_ids
    exact = _exact(ex, prompt, config, processing, length, eos)
    n, drafted, counts = 300, 0, Counter()
    drafter = SkipPlanDrafter(ex, exit_plan(ex, 1), ConstantStopRule(4))
    fed = []
    original = drafter.policy.choose_fed
    drafter.policy.choose_fed = lambda d, k, *a: fed.append(k) or original(d, k, *a)
    with torch.inference_mode():
        for seed in range(n):
            state = DecodeState(ex, prompt, DecodeOptions(
                max_new_tokens=length, processing=processing, eos_token_ids=eos,
                sampling=SamplingConfig(temperature=1.0, top_k=3, seed=global_rng(seed))))
            from selfspec.decoding.core import loop
            loop.run(state, SpeculativeStep(drafter))
            counts[tuple(state.tokens[len(prompt):])] += 1
            drafted += state.stats.drafted
    assert drafted > n and max(fed) > 1  # model drafts with forced tokens inside
    eps = math.sqrt((len(exact) * math.log(2) + math.log(1e6)) / (2 * n))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    tv += 0.5 * sum(v / n for c, v in counts.items() if c not in exact)
    assert tv < eps, f"TV {tv:.3f} >= bound {eps:.3f}"
