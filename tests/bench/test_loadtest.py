"""The mixed load test (issue 64): its checks catch what they must (a mixed-up, truncated or
malformed answer, a stream without ``[DONE]``, /metrics that differ from the clients'
counts), and a short run against a tiny saved model passes end to end, SIGTERM included."""

from __future__ import annotations

import json

import pytest

from selfspec.bench.serve_load.kinds import (
    BAD_CHOICES,
    BAD_LOGPROBS,
    INVALID_JSON,
    JSON_TASKS,
    KINDS,
    MISMATCHED,
    TRUNCATED,
    Answer,
    ChoiceAnswer,
    Prompts,
    StreamReader,
    check,
    read_body,
    rotation,
    start,
)
from selfspec.cli import main

from tiny import save_tiny

KIND = {k.name: k for k in KINDS}


def _reference(text="abc", tokens=("a", "b", "c"), finish="length"):
    answer = Answer(status=200, done=True, completion_tokens=len(tokens))
    answer.choices[0] = ChoiceAnswer(text, finish, list(tokens), [-0.5] * len(tokens),
                                     [2] * len(tokens))
    return answer


def _categories(problems):
    return {p.category for p in problems}


def test_rotation_is_seeded_and_asks_every_kind_early():
    assert rotation(3) == rotation(3) != rotation(4)
    for seed in range(4):
        order = rotation(seed)
        assert sorted(k.name for k in order) == sorted(2 * list(KIND))
        for clients, each in ((2, 4), (4, 2), (16, 1)):
            asked = {order[(start(c, clients, len(order)) + i) % len(order)].name
                     for c in range(clients) for i in range(each)}
            assert asked == set(KIND), (seed, clients)
    assert Prompts.first(2).keys() == [("chat", 0), ("chat", 1), ("completion", 0),
                                       ("completion", 1), ("json", 0), ("json", 1)]


def test_an_answer_equal_to_its_reference_has_no_problem():
    reference = _reference()
    body = {"choices": [{"index": i, "message": {"content": "abc"}, "finish_reason": "length"}
                        for i in range(2)], "usage": {"completion_tokens": 6}}
    assert check(KIND["n2-chat"], read_body(body, chat=True), reference) == []


def test_other_text_finish_or_token_count_is_mixed_up():
    reference = _reference()
    for text, finish, tokens in (("abd", "length", 3), ("abc", "stop", 3), ("abc", "length", 4)):
        body = {"choices": [{"index": 0, "message": {"content": text},
                             "finish_reason": finish}], "usage": {"completion_tokens": tokens}}
        assert _categories(check(KIND["chat"], read_body(body, True), reference)) == {MISMATCHED}


def _stream(lines, chat=True):
    reader = StreamReader(chat, 0.0, lambda: 1.0)
    reader.answer.status = 200
    for line in lines:
        reader.feed(line)
    return reader.answer


def _event(body):
    return "data: " + json.dumps(body)


def test_a_stream_needs_finish_reason_done_and_usage():
    reference = _reference()
    chunks = [_event({"choices": [{"index": 0, "delta": {"content": "ab"}}]}),
              _event({"choices": [{"index": 0, "delta": {"content": "c"},
                                   "finish_reason": "length"}]}),
              _event({"choices": [], "usage": {"completion_tokens": 3}})]
    whole = _stream(chunks + ["", "data: [DONE]"])
    assert whole.first_token_s == 1.0
    assert check(KIND["chat-stream"], whole, reference) == []
    cut = check(KIND["chat-stream"], _stream(chunks), reference)
    assert [p.detail for p in cut] == ["stream without data: [DONE]"]
    no_finish = _stream([chunks[0], _event({"choices": [{"index": 0, "delta": {"content": "c"}}]}),
                         chunks[2], "data: [DONE]"])
    assert _categories(check(KIND["chat-stream"], no_finish, reference)) == {TRUNCATED}
    no_usage = _stream(chunks[:2] + ["data: [DONE]"])
    assert [p.detail for p in check(KIND["chat-stream"], no_usage, reference)] == ["no usage"]


def test_an_error_event_is_recorded_with_its_code():
    answer = _stream([_event({"choices": [{"index": 0, "delta": {"content": "a"}}]}),
                      _event({"error": {"message": "bye", "code": "shutting_down"}}),
                      "data: [DONE]"])
    assert answer.error == "bye" and answer.error_code == "shutting_down" and answer.done
    assert not answer.finished_normally


def test_logprobs_need_one_entry_per_token_with_two_alternatives():
    reference = _reference()

    def answer(tokens, alternatives, usage=3):
        entries = [{"token": t, "logprob": -0.5, "top_logprobs": [
            {"token": t, "logprob": -0.5}] * a}
            for t, a in zip(tokens, alternatives, strict=False)]
        return _stream([_event({"choices": [{"index": 0, "delta": {"content": "abc"},
                                             "logprobs": {"content": entries},
                                             "finish_reason": "length"}]}),
                        _event({"choices": [], "usage": {"completion_tokens": usage}}),
                        "data: [DONE]"])

    kind = KIND["chat-logprobs-stream"]
    assert check(kind, answer("abc", [2, 2, 2]), reference) == []
    assert _categories(check(kind, answer("ab", [2, 2]), reference)) == {BAD_LOGPROBS,
                                                                          MISMATCHED}
    assert _categories(check(kind, answer("abc", [2, 1, 2]), reference)) == {BAD_LOGPROBS}
    # usage counts an answer's end-of-sequence token, its logprobs do not (not in the text)
    from selfspec.bench.serve_load.kinds import _check_logprobs

    for finish, problems in (("stop", []), ("length", [BAD_LOGPROBS])):
        got = answer("abc", [2, 2, 2], usage=4)
        got.choices[0].finish_reason = finish
        found = _check_logprobs(kind, 0, got.choices[0], reference.choices[0], got)
        assert [p.category for p in found] == problems
    assert _categories(check(kind, answer("abd", [2, 2, 2]), reference)) == {MISMATCHED}
    # completions: alternatives keyed by text, so fewer than asked is no problem
    completion = read_body({"choices": [{"index": 0, "text": "abc", "finish_reason": "length",
                                         "logprobs": {"tokens": list("abc"),
                                                      "token_logprobs": [-1.0] * 3,
                                                      "top_logprobs": [{"a": -1.0}] * 3}}],
                            "usage": {"completion_tokens": 3}}, chat=False)
    assert check(KIND["completion-logprobs"], completion, reference) == []


def test_n2_needs_choices_0_and_1():
    reference = _reference()
    body = {"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
            "usage": {"completion_tokens": 3}}
    problems = check(KIND["n2-completion-stream"], read_body(body, chat=False), reference)
    assert BAD_CHOICES in _categories(problems)


def test_json_answers_must_follow_their_schema():
    task = JSON_TASKS[0]  # person: name (string <= 16), age (0..120)
    for text, bad in (('{"name":"Al","age":31}', False), ('{"name":"Al","age":300}', True),
                      ('{"name":"Al"', True)):
        reference = _reference(text, tuple(text), "stop")
        body = {"choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop"}],
                "usage": {"completion_tokens": len(text)}}
        problems = check(KIND["json"], read_body(body, True), reference, task.schema)
        assert _categories(problems) == ({INVALID_JSON} if bad else set())


def test_metrics_are_compared_per_endpoint_status_and_reason():
    from selfspec.bench.serve_load.client import Tally
    from selfspec.bench.serve_load.mix import compare_metrics

    text = "\n".join([
        "# TYPE selfspec_generation_tokens counter",
        'selfspec_generation_tokens_total{method="ar"} 10.0',
        'selfspec_generation_tokens_total{method="auto"} 5.0',
        "# TYPE selfspec_http_requests counter",
        'selfspec_http_requests_total{endpoint="/v1/completions",status="200"} 3.0',
        'selfspec_http_requests_total{endpoint="/v1/completions",status="429"} 1.0',
        "# TYPE selfspec_requests_finished counter",
        'selfspec_requests_finished_total{finish_reason="eos",method="ar"} 2.0',
        'selfspec_requests_finished_total{finish_reason="length",method="ar"} 1.0', ""])
    tally = Tally()
    tally.generation_tokens = 15
    tally.http[("/v1/completions", 200)] = 3
    tally.http[("/v1/completions", 429)] = 1
    tally.finished.update({"stop": 2, "length": 1})
    assert compare_metrics(text, tally).equal
    tally.http[("/v1/chat/completions", 200)] = 1  # a response the server did not count
    result = compare_metrics(text, tally)
    assert not result.equal
    assert [c.name for c in result.checks if not c.equal] == [
        'selfspec_http_requests_total{endpoint="/v1/chat/completions",status="200"}']


def test_mixed_run_on_a_tiny_model_passes_and_drains(tmp_path):
    """2 clients for 4 s against a tiny random model: every kind asked, nothing failed,
    mixed up or truncated, /metrics equal to the clients' counts, SIGTERM with requests in
    flight drained and exited 0. The model is character-level and writes noise; the JSON
    schemas are bounded (enums, booleans, bounded integers, strings with maxLength), so
    its JSON answers end, and 96 tokens keep the last requests in flight at the signal."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("jsonschema")
    model = save_tiny(tmp_path / "tiny", seed=3, max_position_embeddings=1024)
    out = tmp_path / "out"
    code = main(["bench", "serve-mix", "--model", str(model), "--dtype", "fp32",
                 "--method", "ar", "--clients", "2", "--duration", "4", "--prompts", "2",
                 "--max-tokens", "96", "--threads", "1", "--drain-seconds", "20",
                 "--out", str(out)])
    data = json.loads((out / "mixed.json").read_text())
    assert code == 0, data["failures"]
    assert data["passed"] and data["references"] == 6
    load = data["load"]
    assert all(k["requests"] >= 1 for k in load["kinds"]), load["kinds"]
    assert load["bad_requests"] == 0 and not any(load["problems"].values())
    assert data["metrics"]["equal"] and len(data["metrics"]["checks"]) >= 5
    drain = data["drain"]
    assert drain["ok"] and drain["in_flight"] >= 1 and drain["failed"] == 0
    assert drain["exit_code"] == 0 and drain["late_accepted"] == 0
    assert "## SIGTERM with requests in flight" in (out / "README.md").read_text()
