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
from tiny import tiny_model, tiny_tokenizer

import selfspec

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
    return selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(),
                                          name=MODEL)


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
