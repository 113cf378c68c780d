"""`selfspec serve` with output processing, in process on a tiny random model through the
official `openai` client: response_format (regex, JSON schema) equals constrained
`generate`, logprobs in both OpenAI shapes equal `generate`'s, n > 1 as rows of the batch
(streamed and not), penalties, and bad constraints answered with a 400 before any token."""

import json
import math
import socket
import threading
import time

import pytest

import selfspec

from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI

MODEL = "tiny"
PROMPT = "abcabc-abc-abc-ab"
REGEX = {"type": "regex", "regex": "[a-c]{2,5}(-[a-c]{2,5}){1,3}"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "tag"],
          "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}}}


@pytest.fixture(scope="module")
def engine():
    # 2048 positions: the character-level tokenizer spells the tools' system block out
    engine = selfspec.from_pretrained_model(
        tiny_model("llama", seed=3, max_position_embeddings=2048), tiny_tokenizer(), name=MODEL)
    engine.executor.prefill_chunk = 16  # prefix-cache blocks a short prompt fills
    engine.use_prefix_cache(8)
    return engine


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, ServeConfig(model_name=MODEL, method="auto",
                                         method_options={"drafters": "ngram"}, max_batch=4))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def test_response_format_equals_constrained_generate(client, engine):
    ref = engine.generate(PROMPT, max_new_tokens=32, response_format=REGEX)
    for method in ("ar", "ngram", "auto"):
        reply = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
            extra_body={"response_format": REGEX,
                        "selfspec": {"method": method, "options":
                                     {"drafters": "ngram"} if method == "auto" else {}}})
        assert reply.choices[0].text == ref.text, method
    schema_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    ref = engine.generate(PROMPT, chat=True, max_new_tokens=40, response_format=schema_format)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
        temperature=0, response_format=schema_format)
    assert reply.choices[0].message.content == ref.text
    assert set(json.loads(ref.text)) == {"ok", "tag"}


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "r"}},
    {"type": "regex", "regex": "(("},
    {"type": "yaml"},
])
def test_bad_response_formats_are_400_before_any_token(client, response_format):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                response_format=response_format, stream=stream)
        assert caught.value.body["param"] == "response_format"


def test_logprobs_in_both_shapes_equal_generate(client, engine):
    ref = engine.generate(PROMPT, method="ar", max_new_tokens=12, logprobs=3)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == reply.choices[0].text == ref.text
    for got, want in zip(lp.token_logprobs, ref.logprobs):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2)
    ref = engine.generate(PROMPT, chat=True, max_new_tokens=8, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs],
                                                         abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    # Streamed: the chunks' logprobs together are the non-streamed ones.
    streamed = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            temperature=0, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]


def test_n_choices_are_rows_streamed_or_not(client, engine):
    # ar: its batched rows draw exactly what a single ar generation draws with that seed.
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3,
                                      temperature=1.0, seed=11,
                                      extra_body={"selfspec": {"method": "ar"}})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for c in reply.choices:  # choice i samples with seed + i
        assert c.text == engine.generate(PROMPT, max_new_tokens=16, temperature=1.0,
                                         seed=11 + c.index).text
    assert reply.usage.completion_tokens == sum(
        len(engine.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=11 + i).token_ids)
        for i in range(3))
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, n=2,
            temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    ref = engine.generate(PROMPT, chat=True, max_new_tokens=12).text
    assert texts == {0: ref, 1: ref} and finished == {0, 1}


def test_penalties_equal_generate(client, engine):
    ref = engine.generate(PROMPT, max_new_tokens=24, presence_penalty=0.8,
                          frequency_penalty=0.6)
    assert ref.text != engine.generate(PROMPT, max_new_tokens=24).text
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      presence_penalty=0.8, frequency_penalty=0.6)
    assert reply.choices[0].text == ref.text


@pytest.mark.parametrize("body,param", [
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 1, "selfspec": {"method": "specee"}}, "selfspec"),  # lossy: no processing
])
def test_bad_processing_parameters_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="ab", max_tokens=4, extra_body=body)
    assert caught.value.body["param"] == param


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_forced_tool_calls_are_well_formed_streamed_or_not(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for choice, names in (({"type": "function", "function": {"name": "get_weather"}},
                           {"get_weather"}), ("required", {"get_weather", "get_time"})):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=60, temperature=0,
            tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.function.name in names and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome")
        streamed = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=60, temperature=0,
            tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, stream=True))
        calls = [c for chunk in streamed for ch in chunk.choices
                 for c in (ch.delta.tool_calls or [])]
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (call.function.name, call.function.arguments)]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_and_earlier_calls_reach_the_template(client, engine):
    from selfspec.serving.tools import ToolRequest, hermes_messages, parse_answer

    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                           tools=[WEATHER])
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    rendered = hermes_messages(history, ToolRequest((WEATHER,)))
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and "Rome" in rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    answer = parse_answer('Sure. <tool_call>\n{"name": "get_weather", "arguments": '
                          '{"city": "Paris"}}\n</tool_call>', ToolRequest((WEATHER,)))
    assert answer.content == "Sure." and json.loads(
        answer.calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parse_answer("no call", ToolRequest((WEATHER,))).calls == []


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param


def test_a_shared_prefix_is_reported_cached_in_usage_and_metrics(client):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    prefix = "the cat sat on the mat; " * 3  # 72 characters: 4 blocks of 16
    first = client.completions.create(model=MODEL, prompt=prefix + "a", max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prefix + "b", max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert (first.usage.prompt_tokens_details.cached_tokens
            <= second.usage.prompt_tokens_details.cached_tokens)
    with urllib.request.urlopen(str(client.base_url).replace("/v1/", "/metrics")) as reply:
        text = reply.read().decode()
    cached = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "selfspec_prompt_cached_tokens_total")
    assert cached >= second.usage.prompt_tokens_details.cached_tokens
