"""`selfspec serve` fuzzed over its own OpenAPI document (`GET /openapi.json`) with
schemathesis, in process (ASGI) on a tiny random model: requests inside the document and
outside it (negative data), checked for no 5xx, responses (JSON and each event of a stream)
inside the document, documented status codes and content types, requests outside the
document refused, and streams that end (`data: [DONE]`) within the timeout; plus the
document's request fields against protocol.py's, and the regressions the fuzzer found.

Bounded and derandomized in the suite (a few seconds). The longer run of docs/serving.md:
`SELFSPEC_FUZZ_EXAMPLES=2000 python -m pytest tests/serving/test_fuzz.py -k test_api`, or against a
running server (`SELFSPEC_FUZZ_URL=http://127.0.0.1:8000`, started with
`--api-key $SELFSPEC_FUZZ_KEY`), as `scripts/fuzz_serve.py` does."""

import json
import os

import pytest

import selfspec

from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
schemathesis = pytest.importorskip("schemathesis")

from selfspec.methods.registry import METHODS  # noqa: E402
from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI
from selfspec.serving.openapi import openapi_document  # noqa: E402
from selfspec.serving.protocol import (  # noqa: E402
    _CHAT_FIELDS,
    _COMPLETION_FIELDS,
    IMPOSSIBLE_LOGPROB,
    ApiError,
    Limits,
    parse_request,
)

MODEL = os.environ.get("SELFSPEC_FUZZ_MODEL", "tiny")  # the served name, with SELFSPEC_FUZZ_URL
KEY = os.environ.get("SELFSPEC_FUZZ_KEY", "fuzz-key")
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Small limits: every generation the fuzzer asks for takes milliseconds.
LIMITS = Limits(max_tokens=6, default_max_tokens=6, max_prompt_tokens=2047, max_n=2)
#: Examples per operation; the suite's default keeps the test to seconds.
EXAMPLES = int(os.environ.get("SELFSPEC_FUZZ_EXAMPLES", "20"))
#: Seconds a response (a whole stream too) may take before the connection counts as hung.
TIMEOUT = float(os.environ.get("SELFSPEC_FUZZ_TIMEOUT", "30"))
#: A running server to fuzz instead of the in-process app (the longer run).
URL = os.environ.get("SELFSPEC_FUZZ_URL")
#: Fuzz with schemathesis's coverage phase too (boundary values of every field): the longer
#: run does; in the suite it would take most of a minute.
COVERAGE = os.environ.get("SELFSPEC_FUZZ_COVERAGE", "0") == "1"


@pytest.fixture(scope="module")
def app():
    # 2048 positions: the character-level tokenizer spells the tools' system block out.
    engine = selfspec.from_pretrained_model(
        tiny_model("llama", max_position_embeddings=2048), tiny_tokenizer(), name=MODEL)
    return create_app(engine, ServeConfig(model_name=MODEL, method="ar", api_key=KEY,
                                          limits=LIMITS, max_batch=4))


@pytest.fixture(scope="module")
def api_schema(request):
    if URL is None:
        loaded = schemathesis.openapi.from_asgi("/openapi.json", request.getfixturevalue("app"),
                                                headers=AUTH)
    else:
        loaded = schemathesis.openapi.from_url(URL.rstrip("/") + "/openapi.json", headers=AUTH)
    loaded.config.seed = 20260515
    loaded.config.update(headers=AUTH, request_timeout=TIMEOUT)
    # schemathesis reads 20 events of a stream by default; n choices of max_tokens take more.
    loaded.config.max_stream_events = 10_000
    loaded.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        max_examples=EXAMPLES, deterministic=True, database="none")
    loaded.config.phases.coverage.enabled = COVERAGE
    return loaded


def stream_ends(ctx, response, case):
    """A stream ends with ``data: [DONE]`` before the timeout: schemathesis keeps a stream
    cut at its deadline as a response, so a hung stream would pass its own checks."""
    if "text/event-stream" not in response.headers.get("content-type", [""])[0]:
        return None
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert not response.stream_cut_short, f"the stream did not end within {TIMEOUT} s"
    assert events and events[-1] == "data: [DONE]", f"the stream ended without [DONE]: {events}"
    return True


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_api(case):
    checks = schemathesis.checks
    # A request that hangs raises requests' ReadTimeout after TIMEOUT seconds.
    case.call_and_validate(headers=AUTH, timeout=TIMEOUT, checks=[
        checks.not_a_server_error, checks.status_code_conformance,
        checks.content_type_conformance, checks.response_schema_conformance,
        checks.negative_data_rejection, stream_ends])


# ------------------------------------------------------------------ the document is true


def _document():
    return openapi_document(MODEL, LIMITS, 256, METHODS, {}, api_key=True)


def test_request_fields_equal_protocol():
    """Every field protocol.py accepts is in the document, and no other."""
    schemas = _document()["components"]["schemas"]
    assert set(schemas["CompletionRequest"]["properties"]) == _COMPLETION_FIELDS
    assert set(schemas["ChatCompletionRequest"]["properties"]) == _CHAT_FIELDS


def test_methods_and_their_options_are_documented():
    """``selfspec.method`` is any registered method, with exactly its options."""
    variants = _document()["components"]["schemas"]["Selfspec"]["anyOf"][0]["anyOf"]
    documented = {v["properties"]["method"].get("const"): v for v in variants}
    assert set(documented) == set(METHODS) | {None}
    for name, spec in METHODS.items():
        options = documented[name]["properties"]["options"]["anyOf"][0]["properties"]
        assert list(options) == list(spec.option_names), name


# ----------------------------------------------------------- regressions the fuzzer found

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, param", [
    ({"stream_options": 0}, "stream_options"),          # falsy, was taken as {}
    ({"selfspec": False}, "selfspec"),
    ({"selfspec": {"method": "ar", "options": False}}, "selfspec"),
    ({"selfspec": {"options": {"max_draft_len": 4}}}, "selfspec"),  # was silently dropped
    ({"user": 5}, "user"),
    ({"max_tokens": "x", "max_completion_tokens": 4}, "max_tokens"),  # was not checked
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": 1, "function": {"name": "f"}}]}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": {}}}]}, "tools"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": 1, "schema": {}}}}, "response_format"),
])
def test_malformed_fields_are_refused(extra, param):
    from selfspec.serving.tools import parse_tools

    body = CHAT | extra
    with pytest.raises(ApiError) as error:
        parse_request(body, chat=True, limits=LIMITS)
        parse_tools(body)
    assert error.value.status == 400 and error.value.param == param


@pytest.mark.parametrize("extra, param", [
    ({"echo": 0}, "echo"),                              # 0 == False in Python
    ({"best_of": True}, "best_of"),                     # True == 1
])
def test_json_types_are_not_python_equalities(extra, param):
    with pytest.raises(ApiError) as error:
        parse_request({"model": MODEL, "prompt": "a"} | extra, chat=False, limits=LIMITS)
    assert error.value.param == param


def test_integral_numbers_are_integers():
    # JSON (and JSON Schema) has numbers: 2.0 is the integer 2.
    api = parse_request(CHAT | {"n": 2.0, "max_completion_tokens": 3.0, "seed": -7.0},
                        chat=True, limits=LIMITS)
    assert (api.n, api.max_tokens, api.seed) == (2, 3, -7)
    with pytest.raises(ApiError):
        parse_request(CHAT | {"n": 1.5}, chat=True, limits=LIMITS)


def _post(api_schema, path, body):
    case = api_schema[path]["POST"].Case(body={"model": MODEL, **body})
    return case.call_and_validate(headers=AUTH, timeout=TIMEOUT, checks=[
        schemathesis.checks.not_a_server_error, schemathesis.checks.response_schema_conformance,
        stream_ends])


@pytest.mark.skipif(URL is not None, reason="in-process regressions")
def test_forbidden_alternatives_have_a_finite_logprob(api_schema):
    # A grammar gives forbidden tokens -inf, which JSON cannot carry: a 500 without a stream,
    # -Infinity (not JSON) in one. OpenAI answers -9999.0.
    body = {"prompt": "ab", "max_tokens": 3, "temperature": 0, "logprobs": 5,
            "response_format": {"type": "regex", "regex": "[ab]+"}}
    reply = _post(api_schema, "/v1/completions", body).json()
    alternatives = reply["choices"][0]["logprobs"]["top_logprobs"][0]
    assert IMPOSSIBLE_LOGPROB in alternatives.values() and len(alternatives) == 5
    stream = _post(api_schema, "/v1/completions", body | {"stream": True}).text
    assert "Infinity" not in stream and str(IMPOSSIBLE_LOGPROB) in stream


@pytest.mark.skipif(URL is not None, reason="in-process regressions")
def test_a_constraint_the_tokenizer_cannot_follow_is_a_400(api_schema):
    # The tiny tokenizer spells no "é": llguidance refuses the token its mask allowed (on
    # SmolLM2 a regex of U+5F06A does the same). Was a 500, and a 500 event in a stream.
    body = {"prompt": "ab", "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "regex", "regex": "aé"}}
    response = _post(api_schema, "/v1/completions", body)
    assert response.status_code == 400
    assert "cannot be followed" in response.json()["error"]["message"]
    events = _post(api_schema, "/v1/completions", body | {"stream": True}).text.split("\n\n")
    error = json.loads(events[-3].removeprefix("data: "))
    assert "cannot be followed" in error["error"]["message"] and events[-2] == "data: [DONE]"


@pytest.mark.skipif(URL is not None, reason="in-process regressions")
@pytest.mark.parametrize("options", [{"max_draft_len": "4"}, {"history": "yes"},
                                     {"min_share": "0.5"}])
def test_method_options_are_json_values_not_text(api_schema, options):
    # The options' parser reads command-line text ("4", "yes"): over HTTP that was accepted
    # although /openapi.json documents the JSON types.
    response = _post(api_schema, "/v1/completions", {
        "prompt": "ab", "max_tokens": 2, "selfspec": {"method": "ngram", "options": options}})
    assert response.status_code == 400 and "not text" in response.json()["error"]["message"]


@pytest.mark.skipif(URL is not None, reason="in-process regressions")
def test_tiny_temperature_and_top_p_sample(api_schema):
    # 5e-324 is 0 in float32: a division by 0 and an empty nucleus (NaN), each a 500.
    for extra in ({"temperature": 5e-324}, {"top_p": 5e-324}):
        response = _post(api_schema, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3}
                         | extra)
        assert response.status_code == 200, extra


def test_the_scheduler_starts_again_after_close(app):
    # schemathesis ends an ASGI app's lifespan after each test and starts it again: the
    # second start raised "threads can only be started once".
    import threading

    from selfspec.serving.scheduler import Request, Scheduler

    engine = app.state.scheduler.engine
    scheduler = Scheduler(engine, max_batch=1, max_queue=1)
    for _ in range(2):
        scheduler.start()
        done = threading.Event()
        scheduler.submit(Request(prompt_ids=[1, 2, 3],
                                 options=engine.decode_options(3, 0.0, 0, 1.0, None),
                                 on_done=lambda state, text, error, done=done: done.set()))
        assert done.wait(30)
        scheduler.close()


def test_a_hung_stream_fails_the_fuzz():
    """The fuzz's own check: a stream that never ends is a failure (schemathesis alone keeps
    what such a stream sent before its deadline as a good response)."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    hung = FastAPI(openapi_url=None)

    @hung.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            yield b"data: {}\n\n"
            await asyncio.sleep(3600)
        return StreamingResponse(events(), media_type="text/event-stream")

    @hung.get("/openapi.json")
    async def document() -> dict:
        return {"openapi": "3.1.0", "info": {"title": "hung", "version": "0"}, "paths": {
            "/stream": {"get": {"responses": {"200": {"description": "events", "content": {
                "text/event-stream": {"schema": {"type": "object"}}}}}}}}}

    loaded = schemathesis.openapi.from_asgi("/openapi.json", hung)
    response = loaded["/stream"]["GET"].Case().call(timeout=0.5)
    with pytest.raises(AssertionError, match="did not end"):
        stream_ends(None, response, None)


def test_a_row_failing_in_a_batched_step_fails_alone(app):
    # Found by the fuzz against a server process (n = 6 and a regex the tokenizer cannot
    # follow): the batched step ran the forward of every row, then failed committing one;
    # the rows after it kept KV past their tokens, and their solo reruns failed too (500s).
    import threading

    from selfspec.decoding.core.grammar import GrammarViolation
    from selfspec.serving.scheduler import Request, Scheduler

    engine = app.state.scheduler.engine
    alone = engine.generate("xyz", max_new_tokens=8).token_ids
    scheduler = Scheduler(engine, max_batch=3, max_queue=0)
    done, errors, tokens = threading.Event(), {}, {}

    def request(name, prompt, response_format=None):
        def on_done(state, text, error):  # on the worker thread, one request after another
            errors[name] = error
            tokens[name] = None if state is None else state.tokens[state.prompt_len:]
            if len(errors) == 3:
                done.set()
        processing = engine.processing(response_format)
        return Request(prompt_ids=engine.tokenizer(prompt)["input_ids"],
                       options=engine.decode_options(8, 0.0, 0, 1.0, None, processing),
                       on_done=on_done)

    # Submitted before the worker starts: one batch, the failing row first.
    scheduler.submit(request("broken", "ab", {"type": "regex", "regex": "abé"}))
    scheduler.submit(request("first", "xyz"))
    scheduler.submit(request("second", "xyz"))
    scheduler.start()
    try:
        assert done.wait(60)
    finally:
        scheduler.close()
    assert isinstance(errors["broken"], GrammarViolation)
    assert errors["first"] is None and errors["second"] is None
    assert tokens["first"] == tokens["second"] == alone


# ------------------------------------------------------- raw HTTP: what schemathesis cannot
#: The raw server's header and body timeouts, seconds: short, so the slow cases end within
#: the suite's budget (a server at SELFSPEC_FUZZ_URL must be started with these).
RAW_TIMEOUT = float(os.environ.get("SELFSPEC_FUZZ_RAW_TIMEOUT", "0.5"))
_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
_BODY = json.dumps({"model": MODEL, "prompt": "ab", "max_tokens": 2}).encode()


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _sized(body: bytes, declared: int | None = None) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % (len(body) if declared is None else declared) + body


#: name -> (what is sent: bytes, or a list of (bytes, seconds to wait before; None bytes:
#: the client closes), the first status expected (None: any but a 5xx, or no answer))
RAW_CASES = {
    "chunked": (_HEAD + _AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                + _chunked(_BODY[:7], _BODY[7:]), 200),
    "chunked-malformed": (_HEAD + _AUTH + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n"
                          b"ZZ\r\n", 400),
    "chunked-truncated": ([(_HEAD + _AUTH + b"Transfer-Encoding: chunked\r\n\r\n64\r\n{\"mo", 0),
                           (None, 0.1)], None),
    "chunked-bad-json": (_HEAD + _AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                         + _chunked(b"{\"model\": [[["), 400),
    "length-short": ([(_HEAD + _AUTH + _sized(_BODY[:10], 122), 0), (None, 0.1)], None),
    "length-short-wait": (_HEAD + _AUTH + _sized(_BODY[:10], 122), 408),
    "length-long": (_HEAD + _AUTH + _sized(_BODY + b" " * 40, len(_BODY)), 200),
    "length-not-a-number": (_HEAD + _AUTH + b"Content-Length: 12a\r\n\r\n{}", 400),
    "length-and-chunked": (_HEAD + _AUTH + b"Content-Length: 4\r\nTransfer-Encoding: chunked"
                           b"\r\n\r\n" + _chunked(_BODY), None),
    "body-not-utf8": (_HEAD + _AUTH + _sized(b"\xff\xfe{\x00"), 400),
    "slow-body": ([(_HEAD + _AUTH + b"Content-Length: 122\r\n\r\n{", 0)]
                  + [(b" ", 0.15)] * 8, 408),
    "slow-headers": ([(b"POST /v1/completions HTTP/1.1\r\n", 0)]
                     + [(b"X-Slow: 1\r\n", 0.15)] * 8, None),
    "auth-latin-1": (_HEAD + b"Authorization: Bearer \xe9\xe9\xe9\r\n" + _sized(_BODY), 401),
    "auth-utf-8": (_HEAD + b"Authorization: Bearer \xc3\xa9\xc3\xa9\r\n" + _sized(_BODY), 401),
    "header-non-ascii": (_HEAD + _AUTH + b"X-Note: caf\xc3\xa9 \xff\r\n" + _sized(_BODY), 200),
    "header-name-bad": (_HEAD + _AUTH + b"X Bad\xc3\xa9: 1\r\n" + _sized(_BODY), 400),
    "path-non-ascii": (b"POST /v1/compl\xc3\xa9tions HTTP/1.1\r\nHost: x\r\n" + _AUTH
                       + _sized(_BODY), None),
    "header-huge": (_HEAD + _AUTH + b"X-Big: " + b"a" * 70_000 + b"\r\n" + _sized(_BODY), None),
    "expect-continue": (_HEAD + _AUTH + b"Expect: 100-continue\r\n" + _sized(_BODY), None),
    "pipelined": ((_HEAD + _AUTH + _sized(_BODY)) * 2, 200),
    "http-1.0": (b"GET /health HTTP/1.0\r\n\r\n", 200),
    "not-http": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(40)), None),
}


@pytest.fixture(scope="module")
def raw_server():
    """A real uvicorn server (selfspec's header timeout) with short timeouts: its port
    (SELFSPEC_FUZZ_URL's, a server on 127.0.0.1, when set)."""
    import socket
    import threading
    import time
    from urllib.parse import urlsplit

    if URL is not None:
        yield urlsplit(URL).port
        return
    uvicorn = pytest.importorskip("uvicorn")
    from selfspec.serving.server import header_timeout_protocol

    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name=MODEL)
    app = create_app(engine, ServeConfig(model_name=MODEL, method="ar", api_key=KEY,
                                         limits=LIMITS, max_batch=4, body_timeout=RAW_TIMEOUT))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical",
                                           http=header_timeout_protocol(RAW_TIMEOUT)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def _send_raw(port: int, sent, seconds: float = max(3.0, 4 * RAW_TIMEOUT)) -> bytes:
    """What the server answers to ``sent`` (see RAW_CASES; ``None`` as the last step: the
    client closes the connection there) until it closes the connection, nothing more
    comes for half a second after an answer began, or ``seconds`` pass."""
    import socket
    import time

    steps = [(sent, 0.0)] if isinstance(sent, bytes) else sent
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        try:
            for data, wait in steps:
                time.sleep(wait)
                if data is None:
                    return b""  # truncated: the client leaves mid-request
                sock.sendall(data)
        except OSError:  # closed while we were still sending: read what it said
            pass
        sock.settimeout(0.5)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                if got:
                    break
                continue
            except OSError:  # reset
                break
            if not chunk:
                break
            got += chunk
    return got


def test_raw_http_cases_get_no_server_error(raw_server, caplog):
    """Chunked, slow, truncated and non-ASCII requests as raw bytes, all at once: none is
    a 5xx or logs an error, each documented answer is the one expected, and the server
    still answers /health and counts no 500."""
    import logging
    import re
    from concurrent.futures import ThreadPoolExecutor

    with caplog.at_level(logging.ERROR), ThreadPoolExecutor(len(RAW_CASES)) as pool:
        answers = dict(zip(RAW_CASES, pool.map(
            lambda case: _send_raw(raw_server, case[0]), RAW_CASES.values()), strict=True))
    for name, (_, expected) in RAW_CASES.items():
        statuses = [int(s) for s in re.findall(rb"^HTTP/1\.[01] (\d{3})", answers[name], re.M)]
        assert not any(s >= 500 for s in statuses), (name, answers[name][:300])
        if expected is not None:
            assert statuses and statuses[0] == expected, (name, answers[name][:300])
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    health = _send_raw(raw_server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert health.startswith(b"HTTP/1.1 200"), health
    metrics = _send_raw(raw_server, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        + _AUTH + b"\r\n")
    assert metrics.startswith(b"HTTP/1.1 200") and b'status="500"' not in metrics
