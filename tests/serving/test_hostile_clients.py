"""`selfspec serve` against clients that leave, stall or send broken bodies (issue 76, faults
2, 3, 5-8), each on a real uvicorn server on 127.0.0.1 with a tiny random model: a
non-streamed request whose client leaves is cancelled; a slow body is cut with a 408 and holds
no drain; logprobs join to exactly the text; /metrics counts what clients saw; a broken body
is no 500; a second signal's streams say why they were cut."""

from __future__ import annotations

import contextlib
import json
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
def serving(engine, **config):
    """A real uvicorn server on 127.0.0.1: yields ``(port, app)``."""
    config = {"model_name": MODEL, "method": "ar", "api_key": KEY, "max_batch": 4,
              "max_queue": 4, "limits": Limits(max_tokens=2000),
              **config}
    app = create_app(engine, ServeConfig(**config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1], app
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
