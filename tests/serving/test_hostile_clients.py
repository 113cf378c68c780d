"""`selfspec serve` against clients that leave, stall or send broken bodies (issue 76, faults
2, 3, 5-8), each on a real uvicorn server on 127.0.0.1 with a tiny random model: a
non-streamed request whose client leaves is cancelled; a slow body is cut with a 408 and holds
no drain; logprobs join to exactly the text; /metrics counts what clients saw; a broken body
is no 500; a second signal's streams say why they were cut."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import selfspec
from selfspec.decoding.core.autoregressive import BatchArStep

from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from selfspec.serving import server as server_module  # noqa: E402 - needs uvicorn
from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI
from selfspec.serving.protocol import Limits  # noqa: E402

MODEL = "tiny"
KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: A step's extra time on the patched BatchArStep: a long request stays in flight seconds.
STEP_SECONDS = 0.01


@pytest.fixture(scope="module")
def engine():
    return selfspec.from_pretrained_model(tiny_model("llama", max_position_embeddings=4096),
                                          tiny_tokenizer(), name=MODEL)


@pytest.fixture
def slow_steps(monkeypatch):
    """Every ar step takes STEP_SECONDS longer (the server runs in this process)."""
    batched = BatchArStep.__call__
    monkeypatch.setattr(BatchArStep, "__call__", lambda self, states: (
        time.sleep(STEP_SECONDS), batched(self, states))[1])


@contextlib.contextmanager
def serving(engine, draining=False, **config):
    """A real uvicorn server on 127.0.0.1 (``draining``: selfspec's
    :class:`~selfspec.serving.server.DrainingServer`, yielded too): yields ``(port, app)``
    or ``(port, app, server, thread)``."""
    config = {"model_name": MODEL, "method": "ar", "api_key": KEY, "max_batch": 4,
              "max_queue": 4, "limits": Limits(max_tokens=2000),
              **config}
    app = create_app(engine, ServeConfig(**config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv_config = uvicorn.Config(app, log_level="critical",
                               timeout_graceful_shutdown=server_module.FLUSH_SECONDS)
    uv = (server_module.DrainingServer(uv_config, app.state.drain) if draining
          else uvicorn.Server(uv_config))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield (sock.getsockname()[1], app, uv, thread) if draining else (
            sock.getsockname()[1], app)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _call(port, path, body=None):
    """(status, body bytes) of a GET (``body`` None) or a JSON POST."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _metrics(port):
    """``{(sample name, ((label, value), ...)): value}`` of ``/metrics``."""
    status, text = _call(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text.decode())
            for s in family.samples}


def _sum(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and labels.items() <= dict(ls).items())


def _raw_request(port, path, body: dict, extra_headers: bytes = b"") -> socket.socket:
    """A POST sent whole on a raw socket, left open (the caller reads or closes it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n" + extra_headers
                 + b"\r\n" + data)
    return sock


def _read_until(sock, marker: bytes) -> bytes:
    """What ``sock`` receives up to and including ``marker`` (and what came with it)."""
    got = b""
    while marker not in got:
        chunk = sock.recv(4096)
        assert chunk, f"closed before {marker!r}: {got[-500:]!r}"
        got += chunk
    return got


def _until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _long(**fields):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "temperature": 0, **fields}


# ------------------------------------------------ fault 2: a non-streamed client leaves
def test_a_non_streamed_request_whose_client_leaves_is_cancelled(engine, slow_steps):
    with serving(engine) as (port, app):
        scheduler = app.state.scheduler
        sock = _raw_request(port, "/v1/completions", _long())
        _until(lambda: scheduler.running == 1)
        time.sleep(0.3)  # decoding: its row posts events all the time
        sock.close()
        _until(lambda: scheduler.running == 0, seconds=3)  # 1500 steps would take 15 s
        _until(lambda: _sum(_metrics(port), "selfspec_requests_finished_total",
                            finish_reason="cancelled") == 1)
        samples = _metrics(port)
        assert _sum(samples, "selfspec_requests_finished_total") == 1
        assert _sum(samples, "selfspec_generation_tokens_total") < 1000
        assert _sum(samples, "selfspec_http_requests_total", endpoint="/v1/completions") == \
            _sum(samples, "selfspec_http_requests_total", status="499") == 1
        assert _sum(samples, "selfspec_e2e_request_latency_seconds_count") == 0


# ------------------------------------------------------- fault 6: /metrics = what clients saw
def test_a_cancelled_stream_counts_cancelled_outside_the_latency(engine, slow_steps):
    with serving(engine) as (port, app):
        sock = _raw_request(port, "/v1/completions", _long(stream=True))
        _read_until(sock, b"data: {")
        sock.close()
        scheduler = app.state.scheduler
        _until(lambda: scheduler.running == 0, seconds=3)
        _until(lambda: _sum(_metrics(port), "selfspec_requests_finished_total") == 1)
        samples = _metrics(port)
        assert _sum(samples, "selfspec_requests_finished_total", finish_reason="cancelled") == 1
        assert _sum(samples, "selfspec_e2e_request_latency_seconds_count") == 0
        assert _sum(samples, "selfspec_time_per_output_token_seconds_count") == 0


def test_an_n2_prompt_counts_once(engine):
    with serving(engine) as (port, _):
        for path, body in (("/v1/completions", {"prompt": "hello there"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hello there"}]})):
            before = _sum(_metrics(port), "selfspec_prompt_tokens_total")
            status, raw = _call(port, path, {"model": MODEL, "max_tokens": 4, "n": 2,
                                             "temperature": 0, **body})
            assert status == 200, raw
            counted = _sum(_metrics(port), "selfspec_prompt_tokens_total") - before
            assert counted == json.loads(raw)["usage"]["prompt_tokens"]


def test_queued_requests_whose_clients_left_leave_the_queue_at_once(engine, slow_steps):
    with serving(engine, max_batch=1) as (port, app):
        scheduler = app.state.scheduler
        running = _raw_request(port, "/v1/completions", _long())
        _until(lambda: scheduler.running == 1)
        waiting = [_raw_request(port, "/v1/completions", _long(max_tokens=5)) for _ in range(3)]
        _until(lambda: scheduler.waiting == 3)
        for sock in waiting:
            sock.close()
        _until(lambda: scheduler.waiting == 0, seconds=2)  # the running one has 10 s to go
        assert json.loads(_call(port, "/health")[1])["waiting"] == 0
        assert scheduler.running == 1
        _until(lambda: _sum(_metrics(port), "selfspec_requests_finished_total",
                            finish_reason="cancelled") == 3)
        _until(lambda: _sum(_metrics(port), "selfspec_http_requests_total", status="499") == 3)
        # only the running request was prefilled ("hello": 5 tokens)
        assert _sum(_metrics(port), "selfspec_prompt_tokens_total") == 5
        running.close()
        _until(lambda: scheduler.running == 0, seconds=3)


# ------------------------------------------------------------ fault 3: a body sent slowly
def _slow_body(port, declared=122):
    """Headers of a POST declaring ``declared`` body bytes, then one byte: the caller sends
    the rest a byte at a time, or never."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                 + str(declared).encode() + b"\r\n\r\n{")
    return sock


def _answer(sock, seconds):
    """What the server sent before closing ``sock`` (sending a byte each 0.2 s meanwhile),
    and when it closed, seconds from now; ``None`` if still open after ``seconds``."""
    start, got = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(b" ")
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return got, time.monotonic() - start
        if not chunk:
            return got, time.monotonic() - start
        got += chunk
    return got, None


def test_a_slow_body_is_cut_with_a_408_at_the_body_timeout(engine):
    with serving(engine, body_timeout=1.0) as (port, _):
        with _slow_body(port) as sock:
            got, closed = _answer(sock, seconds=6)
        assert got.startswith(b"HTTP/1.1 408"), got
        assert b"body_timeout" in got
        assert closed is not None and closed < 3.0, closed
        assert _sum(_metrics(port), "selfspec_http_requests_total", status="408") == 1


def test_a_slow_body_holds_no_drain(engine):
    """No request runs: a drain ends at once though a client is sending its body a byte at
    a time; that client gets a 503, and the server stops."""
    with serving(engine, draining=True, drain_seconds=20) as (port, app, uv, thread):
        with _slow_body(port) as sock:
            time.sleep(0.3)
            start = time.monotonic()
            uv._on_signal(signal.SIGTERM, None)  # what a SIGTERM does (flags only)
            got, closed = _answer(sock, seconds=8)
            thread.join(timeout=10)
            stopped = time.monotonic() - start
        assert got.startswith(b"HTTP/1.1 503"), got
        assert closed is not None and closed < 2.0, closed
        assert not thread.is_alive() and stopped < 4.0, stopped


# ------------------------------------------- fault 7: a broken body is no server error
@pytest.mark.parametrize("what", ["malformed chunks", "disconnect mid-body"])
def test_a_broken_body_is_no_500_and_no_traceback(engine, caplog, what):
    with serving(engine) as (port, app):
        with caplog.at_level(logging.ERROR):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + KEY.encode() + b"\r\nContent-Type: application/json\r\n")
            if what == "malformed chunks":
                sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nZZ\r\n")
                got = sock.recv(4096)
                assert got.startswith(b"HTTP/1.1 400"), got
            else:
                sock.sendall(head + b"Content-Length: 122\r\n\r\n{\"model\": ")
                time.sleep(0.3)
            sock.close()
            time.sleep(0.5)
            samples = _metrics(port)
        assert _sum(samples, "selfspec_http_requests_total", status="500") == 0
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert not any("Traceback" in r.getMessage() or r.exc_info for r in caplog.records)


# --------------------------------------------- fault 8: a second signal's error text
def test_a_second_signal_ends_streams_saying_so(engine, slow_steps):
    with serving(engine, draining=True, drain_seconds=30) as (port, app, uv, thread):
        sock = _raw_request(port, "/v1/completions", _long(stream=True))
        got = _read_until(sock, b"data: {")
        uv._on_signal(signal.SIGTERM, None)
        _until(lambda: app.state.drain.draining)
        time.sleep(0.3)
        uv._on_signal(signal.SIGTERM, None)
        sock.settimeout(15)
        while b"data: [DONE]" not in got:
            chunk = sock.recv(65536)
            assert chunk, got[-500:]
            got += chunk
        sock.close()
        thread.join(timeout=15)
    events = [line[6:] for line in got.decode().split("\n") if line.startswith("data: {")]
    message = json.loads(events[-1])["error"]["message"]
    assert "second signal" in message and "30 s it had to drain" not in message, message


# ------------------------------------- fault 5: logprob tokens join to exactly the text
def _logprob_tokens(body, chat):
    """The logprob tokens of a response or of a stream's chunks, and its text."""
    tokens, text = [], ""
    for choice in body:
        logprobs = choice.get("logprobs")
        if chat:
            text += (choice.get("message") or choice.get("delta") or {}).get("content") or ""
            tokens += [c["token"] for c in (logprobs or {}).get("content") or ()]
            assert all(bytes(c["bytes"]).decode() == c["token"]
                       for c in (logprobs or {}).get("content") or ())
        else:
            text += choice.get("text") or ""
            tokens += (logprobs or {}).get("tokens") or []
    return tokens, text


def _ask(port, chat, stream, **fields):
    body = {"model": MODEL, "temperature": 0, "stream": stream, **fields}
    if chat:
        body.update(messages=[{"role": "user", "content": "ab"}], logprobs=True,
                    top_logprobs=2)
    else:
        body.update(prompt="ab", logprobs=2)
    status, raw = _call(port, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 200, raw
    if not stream:
        reply = json.loads(raw)
        return (*_logprob_tokens(reply["choices"], chat), reply["choices"][0]["finish_reason"])
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n")
              if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return (*_logprob_tokens(choices, chat), choices[-1]["finish_reason"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_logprob_tokens_join_to_the_text_without_eos_or_stop(engine, chat, stream):
    with serving(engine) as (port, _):
        # The regex ends the answer: the grammar allows only the end-of-sequence token then.
        tokens, text, finish = _ask(port, chat, stream, max_tokens=10,
                                    response_format={"type": "regex", "regex": "abba"})
        assert (text, finish) == ("abba", "stop")
        assert tokens == ["a", "b", "b", "a"]  # not "</s>"
        free, _, _ = _ask(port, chat, False, max_tokens=16)
        full = "".join(free)
        assert len(full) >= 7, full
        stop = full[5:7]
        tokens, text, finish = _ask(port, chat, stream, max_tokens=16, stop=[stop])
        assert text == full[:full.index(stop)] and finish == "stop"
        assert "".join(tokens) == text
