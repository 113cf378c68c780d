"""`selfspec serve` under hostile or unlucky conditions (issue 64): requests never make the
server open a path they name, malformed bodies and missing assets are 400s (not 500s), the
queue holds exactly max_batch running + max_queue waiting, a request's failure stays its
own, a KV budget bounds the batch, /health's key is the operator's choice, and SIGTERM
drains instead of cutting streams. In-process (FastAPI's TestClient on a tiny random model)
except the two checks that need a real process: the signal and the header timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

import selfspec
from selfspec.decoding.core.autoregressive import BatchArStep
from selfspec.decoding.core.state import DecodeOptions
from selfspec.errors import InvalidArgumentError
from selfspec.executor.plan import SkipPlan
from selfspec.heads.skip_set import new_skip_set, save_skip_set
from selfspec.methods.registry import METHODS
from selfspec.serving import scheduler as scheduler_module
from selfspec.serving.scheduler import QueueFullError, Request, Scheduler

from tiny import save_tiny, tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from selfspec.serving.app import ServeConfig, create_app  # noqa: E402

MODEL = "tiny"
PROMPTS = ["abcabcabc", "the cat sat on", "0123456789", "hello hello", "x"]
# String options that name no file: a new free-form string option must be declared here
# (with why) or as an asset, so no option that opens a file can slip past the server's check.
NOT_FILES = {("adadecode", "layers"): "a comma list of layer numbers",
             ("auto", "drafters"): "a comma list of drafter names"}


@pytest.fixture(scope="module")
def engine():
    return selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), MODEL)


@pytest.fixture(scope="module")
def singles(engine):
    return {p: engine.generate(p, max_new_tokens=24).token_ids for p in PROMPTS}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """No default heads or skip sets: a clean $SELFSPEC_HOME per test."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def assets_dir(engine, tmp_path_factory):
    """An operator's assets: a skip set of this model, and one of another model."""
    root = tmp_path_factory.mktemp("assets")
    plan = SkipPlan(frozenset({1}), frozenset({2}))
    save_skip_set(new_skip_set(engine, plan, 0.5, "fp32"), root / "mine.json")
    other = selfspec.from_pretrained_model(tiny_model("llama", seed=9), tiny_tokenizer(), "other")
    save_skip_set(new_skip_set(other, plan, 0.5, "fp32"), root / "other.json")
    return root


@contextmanager
def served(engine, **config):
    config = {"model_name": MODEL, "method": "ar", "max_batch": 4, "max_queue": 4, **config}
    with TestClient(create_app(engine, ServeConfig(**config)),
                    raise_server_exceptions=False) as client:
        yield client


def _body(prompt="hello", **fields):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


def _method(method, **options):
    return _body(selfspec={"method": method, "options": options})


def _assert_error(reply, status, code=None, contains=()):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    for text in contains:
        assert text in error["message"], error
    return error


def _events(text):
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


# ------------------------------------------------------------- 1. assets, never paths
# Every option naming a file (the test below checks this list against the declarations).
ASSET_OPTIONS = {*((m, "heads") for m in ("layerskip", "dv", "adaspeed", "adaspeed-probe", "dssd",
                                          "early-exit", "adadecode", "specee", "auto")),
                 ("swift", "skip_set")}


def test_every_option_naming_a_file_is_declared_an_asset():
    """Every string option of every method either has fixed choices, is declared an asset
    (the server's check covers it), or is listed above as naming no file."""
    declared = set()
    for name, spec in METHODS.items():
        for f in spec.fields:
            if f.info.asset is not None:
                declared.add((name, f.name))
                continue
            if f.type is not str or f.info.choices:
                continue  # numbers, booleans and fixed choices open nothing
            assert (name, f.name) in NOT_FILES, (
                f"{name}.{f.name} is a free-form string option: declare it "
                "option(..., asset=...) if it names a file, else list it in NOT_FILES")
            words = f.info.help.lower()
            assert not any(w in words for w in ("file", "path", "directory", "folder")), (
                f"{name}.{f.name}'s help speaks of files but it is not declared an asset")
    assert declared == ASSET_OPTIONS


@pytest.fixture(scope="module")
def outside(engine, tmp_path_factory):
    """A valid skip set outside any assets directory: a server that opened it would work."""
    path = tmp_path_factory.mktemp("outside") / "outside.json"
    return save_skip_set(new_skip_set(engine, SkipPlan(frozenset({1})), 0.5, "fp32"), path)


def test_requests_cannot_name_paths(engine, outside):
    with served(engine) as client:  # no assets directory: no file names at all
        for method, option in sorted(ASSET_OPTIONS):
            for value in (str(outside), "/etc/passwd", "mine.json"):
                reply = client.post("/v1/completions", json=_method(method, **{option: value}))
                error = _assert_error(reply, 400, "asset_not_allowed", [repr(option)])
                assert error["param"] == "selfspec"


def test_assets_dir_serves_bare_names_only(engine, assets_dir, outside):
    with served(engine, assets_dir=assets_dir) as client:
        for value in (str(outside), "../outside.json", f"../{assets_dir.name}/mine.json",
                      "sub/mine.json", "mine\\.json", "mine\0.json", "..", ".", "", "\x01"):
            reply = client.post("/v1/completions", json=_method("swift", skip_set=value))
            _assert_error(reply, 400, "asset_not_allowed", ["'skip_set'"])
        # A bare name is the operator's asset: swift (lossless) decodes ar's tokens with it.
        want = client.post("/v1/completions", json=_body(max_tokens=12)).json()
        reply = client.post("/v1/completions", json={**_method("swift", skip_set="mine.json"),
                                                     "max_tokens": 12})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want["choices"][0]["text"]


def test_operator_options_may_be_paths(engine, assets_dir):
    with served(engine, method="swift",
                method_options={"skip_set": str(assets_dir / "mine.json")}) as client:
        assert client.post("/v1/completions", json=_body()).status_code == 200


def _count_submits(client):
    scheduler = client.app.state.scheduler
    submitted, original = [], scheduler.submit
    scheduler.submit = lambda job: (submitted.append(job), original(job))[1]
    return submitted


def test_missing_assets_are_400_before_queueing(engine):
    with served(engine) as client:
        submitted = _count_submits(client)
        for method, option, hint in [("dssd", "heads", "selfspec heads train"),
                                     ("specee", "heads", "selfspec heads train"),
                                     ("adadecode", "heads", "selfspec heads train"),
                                     ("early-exit", "heads", "selfspec heads train"),
                                     ("adaspeed-probe", "heads", "selfspec heads train-probe"),
                                     ("swift", "skip_set", "selfspec heads search-skip")]:
            reply = client.post("/v1/completions", json=_method(method))
            _assert_error(reply, 400, "asset_missing", [repr(option), hint])
        assert submitted == []  # refused before the queue, so before any token


def test_absent_or_unusable_named_assets_are_400(engine, assets_dir):
    with served(engine, assets_dir=assets_dir) as client:
        submitted = _count_submits(client)
        reply = client.post("/v1/completions", json=_method("dssd", heads="absent"))
        _assert_error(reply, 400, "asset_missing", ["'absent'", "assets directory"])
        assert submitted == []
        # A skip set of another model: found, refused when loaded; no server path shown.
        reply = client.post("/v1/completions", json=_method("swift", skip_set="other.json"))
        error = _assert_error(reply, 400, "asset_unavailable", ["<assets-dir>"])
        assert str(assets_dir) not in error["message"]


# -------------------------------------------------------------- 2. bodies: 400 not 500
@pytest.mark.parametrize("raw,what", [
    (b"[" * 100_000 + b"]" * 100_000, "deeper"),
    (json.dumps(_body(stop=json.loads("[" * 40 + "]" * 40))).encode(), "deeper"),
    (b'{"model": "tiny", "prompt": "\\ud800"}', "surrogate"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "surrogate"),
    (b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', "surrogate"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "not valid JSON"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
], ids=["nested-100000", "nested-40-in-stop", "surrogate-prompt", "surrogate-stop",
        "surrogate-key", "nan", "5000-digits"])
def test_malformed_bodies_are_400(engine, raw, what):
    with served(engine) as client:
        _assert_error(client.post("/v1/completions", content=raw), 400, contains=[what])


def test_lone_surrogate_in_a_chat_message_is_400(engine):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    with served(engine) as client:
        error = _assert_error(client.post("/v1/chat/completions", content=raw), 400,
                              contains=["messages[0].content", "surrogate"])
        assert error["param"] == "messages"


def test_unexpected_errors_stay_500_with_a_generic_body(engine, monkeypatch):
    with served(engine) as client:
        monkeypatch.setattr(engine, "decode_options", lambda *a: 1 / 0)
        error = _assert_error(client.post("/v1/completions", json=_body()), 500)
        assert error["message"] == "internal server error; see the server log"


# --------------------------------------------------------------------- 3. queue bound
def _job(prompt_ids, max_new_tokens, **callbacks):
    return Request(prompt_ids=list(prompt_ids), options=DecodeOptions(max_new_tokens),
                   **callbacks)


def test_queue_holds_max_batch_running_plus_max_queue_waiting(engine, monkeypatch):
    """16 requests while the worker admits one slowly: 4 rows + 4 waiting are accepted,
    no more (the worker's request in prefill counted), and the 429 says so truly."""
    original = scheduler_module.begin
    monkeypatch.setattr(scheduler_module, "begin",
                        lambda state: (time.sleep(0.15), original(state))[1])
    scheduler = Scheduler(engine, max_batch=4, max_queue=4)
    scheduler.start()
    accepted, refused = 0, []
    try:
        for _ in range(16):
            try:
                scheduler.submit(_job([5, 6, 7], 400))
                accepted += 1
            except QueueFullError as error:
                refused.append(str(error))
            time.sleep(0.005)
    finally:
        scheduler.close()
    assert (accepted, len(refused)) == (8, 8)
    assert refused[0].startswith("4 requests are running (max_batch 4) and 4 waiting "
                                 "(max_queue 4)")


# ---------------------------------------------------------------- 7. failures isolated
def _collect(scheduler, prompt, engine, max_new_tokens=24, fail_at=None):
    ids = engine.tokenizer(prompt)["input_ids"]
    out = {"tokens": [], "error": None, "done": threading.Event()}

    def on_tokens(tokens):
        out["tokens"].extend(tokens)
        if fail_at is not None and len(out["tokens"]) >= fail_at:
            raise RuntimeError("planted failure in one request's callback")

    def on_done(state, text, error):
        out["error"] = error
        out["done"].set()

    job = _job(ids, max_new_tokens, on_tokens=on_tokens, on_done=on_done)
    scheduler.submit(job)
    return job, out


def test_a_failing_request_fails_alone(engine, singles, monkeypatch):
    """One request's callback raises, another's rows make the batched step raise: those two
    fail with their errors; the other rows of the same batches finish with their own tokens."""
    bad_prompt = engine.tokenizer(PROMPTS[3])["input_ids"]
    batched = BatchArStep.__call__

    def planted(self, states):
        if any(s.tokens[:len(bad_prompt)] == bad_prompt for s in states) and \
                any(s.num_generated >= 5 for s in states):
            raise RuntimeError("planted failure in a batched step")
        return batched(self, states)

    monkeypatch.setattr(BatchArStep, "__call__", planted)
    scheduler = Scheduler(engine, max_batch=5, max_queue=0)
    try:
        jobs = [_collect(scheduler, p, engine, fail_at=3 if i == 1 else None)
                for i, p in enumerate(PROMPTS)]
        scheduler.start()
        for _, out in jobs:
            assert out["done"].wait(60)
        assert scheduler.running == scheduler.waiting == 0
    finally:
        scheduler.close()
    for i, (prompt, (_, out)) in enumerate(zip(PROMPTS, jobs)):
        if i in (1, 3):
            assert isinstance(out["error"], RuntimeError), i
        else:
            assert out["error"] is None and out["tokens"] == singles[prompt], i


def test_a_failing_request_gets_a_500_or_an_error_event(engine, monkeypatch):
    batched = BatchArStep.__call__
    bad = engine.tokenizer("boom")["input_ids"]

    def planted(self, states):
        if any(s.tokens[:len(bad)] == bad for s in states):
            raise RuntimeError("planted failure")
        return batched(self, states)

    monkeypatch.setattr(BatchArStep, "__call__", planted)
    with served(engine) as client:
        error = _assert_error(client.post("/v1/completions", json=_body("boom")), 500)
        assert error["type"] == "server_error"
        reply = client.post("/v1/completions", json=_body("boom", stream=True))
        events = _events(reply.text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == \
            "server_error"
        assert client.post("/v1/completions", json=_body("fine")).status_code == 200


# ---------------------------------------------------------------- 8. KV token budget
def test_max_batch_tokens_bounds_the_running_rows(engine, singles):
    """Rows of 10 + 24 positions under a budget of 70: two run at once, the third waits
    (and then finishes with its own tokens), a fourth finds the queue full, and a request
    over the budget alone is refused."""
    scheduler = Scheduler(engine, max_batch=4, max_queue=1, max_batch_tokens=70)
    prompts = ["0123456789", "abcdefghij", "klmnopqrst"]
    active, most = set(), [0]

    def track(i):
        def on_tokens(tokens):
            active.add(i)
            most[0] = max(most[0], len(active))
        return on_tokens

    outs = []
    try:
        for i, p in enumerate(prompts):
            out = {"done": threading.Event(), "tokens": []}
            ids = engine.tokenizer(p)["input_ids"]
            assert len(ids) + 24 <= 35

            def on_done(state, text, error, i=i, out=out):
                active.discard(i)
                out["state"], out["error"] = state, error
                out["done"].set()

            scheduler.submit(_job(ids, 24, on_tokens=track(i), on_done=on_done))
            outs.append(out)
        assert (scheduler.running, scheduler.waiting) == (2, 1)
        with pytest.raises(QueueFullError, match="2 requests are running .*held\\) and 1 "
                                                 "waiting"):
            scheduler.submit(_job([1, 2], 10))
        with pytest.raises(InvalidArgumentError, match="max_batch_tokens 70"):
            scheduler.submit(_job([1] * 10, 61))
        scheduler.start()
        for out in outs:
            assert out["done"].wait(60) and out["error"] is None
    finally:
        scheduler.close()
    assert most[0] == 2
    for p, out in zip(prompts, outs):
        state = out["state"]
        assert state.tokens[state.prompt_len:] == engine.generate(p, max_new_tokens=24).token_ids


def test_a_request_over_max_batch_tokens_alone_is_400(engine):
    with served(engine, max_batch_tokens=50) as client:
        _assert_error(client.post("/v1/completions", json=_body(max_tokens=100)), 400,
                      "batch_tokens_exceeded", ["--max-batch-tokens", "50"])
        assert client.post("/v1/completions", json=_body(max_tokens=10)).status_code == 200


# ------------------------------------------------------------------- 6. /health's key
def test_health_is_open_by_default_and_keyed_with_health_auth(engine):
    with served(engine, api_key="k") as client:
        assert client.get("/health").json()["status"] == "ok"
    with served(engine, api_key="k", health_auth=True) as client:
        _assert_error(client.get("/health"), 401, "invalid_api_key")
        reply = client.get("/health", headers={"Authorization": "Bearer k"})
        assert reply.status_code == 200 and reply.json()["status"] == "ok"


# -------------------------------------------------------------- 4. drain (in-process)
def test_drain_finishes_in_flight_requests_and_ends_the_rest_at_the_bound(engine, monkeypatch):
    """Draining with a 1 s bound: new requests get 503 + Retry-After and /health 503
    "draining"; a stream that finishes in time ends normally, one that cannot ends with an
    error event; both end with [DONE]."""
    batched = BatchArStep.__call__
    monkeypatch.setattr(BatchArStep, "__call__",
                        lambda self, states: (time.sleep(0.01), batched(self, states))[1])
    with served(engine, drain_seconds=1.0) as client:
        drain, scheduler = client.app.state.drain, client.app.state.scheduler
        replies = {}

        def ask(name, max_tokens):
            replies[name] = client.post("/v1/completions",
                                        json=_body(name, max_tokens=max_tokens, stream=True))

        threads = [threading.Thread(target=ask, args=a) for a in (("short", 30), ("long", 450))]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while scheduler.running < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        drainer = threading.Thread(target=client.portal.call, args=(drain.run,))
        drainer.start()
        while not drain.draining:
            time.sleep(0.01)
        refused = client.post("/v1/completions", json=_body())
        _assert_error(refused, 503, "shutting_down")
        assert int(refused.headers["Retry-After"]) >= 1
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        drainer.join(30)
        for t in threads:
            t.join(30)
        assert drain.idle
    short, long = _events(replies["short"].text), _events(replies["long"].text)
    assert short[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "shutting_down"


# ------------------------------------------- 4 + 5. a real process: signal and timeouts
@pytest.fixture(scope="module")
def process(tmp_path_factory):
    """`selfspec serve` on a tiny model directory (a context long enough for a stream of
    500 tokens, a second or two), with a 1 s header timeout."""
    model = save_tiny(tmp_path_factory.mktemp("tiny-serve"), seed=3,
                      max_position_embeddings=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SELFSPEC_HOME": str(tmp_path_factory.mktemp("home"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfspec.cli", "serve", "--model", str(model), "--dtype",
         "fp32", "--port", str(port), "--method", "ar", "--threads", "1", "--max-tokens",
         "1000", "--drain-seconds", "20", "--header-timeout", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"selfspec serve exited: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert time.time() < deadline, "selfspec serve did not start"
            time.sleep(0.2)
    yield proc, port, str(model)
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_slow_headers_are_cut_at_the_header_timeout(process):
    _, port, _ = process
    silent = socket.create_connection(("127.0.0.1", port))  # connects, never sends
    opened = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = None
        while time.monotonic() - start < 5:  # a header line every 0.3 s, never the end
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                sock.settimeout(0.3)
                if sock.recv(64) == b"":
                    closed = time.monotonic() - start
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = time.monotonic() - start
                break
    assert closed is not None and 0.9 <= closed < 2.5, closed
    with silent:
        silent.settimeout(5)
        assert silent.recv(64) == b"" and time.monotonic() - opened < 2.5


def test_sigterm_drains_streams_refuses_new_requests_and_exits_0(process):
    proc, port, model = process
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 500, "temperature": 0,
                       "stream": True}).encode()
    stream = urllib.request.urlopen(urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}),
        timeout=60)
    assert stream.readline().startswith(b"data: {")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while True:  # draining within the next tick
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            assert time.monotonic() - start < 5
            time.sleep(0.02)
        except urllib.error.HTTPError as error:
            assert error.code == 503 and json.loads(error.read())["status"] == "draining"
            break
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=json.dumps({"model": model, "prompt": "x"}).encode(),
            headers={"Content-Type": "application/json"}), timeout=10)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"]
    events = _events(stream.read().decode())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=20 + 10) == 0
    assert time.monotonic() - start < 20
    assert "Traceback" not in proc.stderr.read()
