"""API keys with tenants: a non-ASCII key is a 401 (issue 76, fault 1), several keys from an
operator's keys file each name a tenant, and the ``user`` field a sub-tenant where the
operator says so."""

import json
import socket
import threading
import time

import pytest

import selfspec
from selfspec.errors import InvalidArgumentError
from selfspec.serving.auth import authorize, read_keys_file, request_tenant
from selfspec.serving.protocol import ApiError

from tiny import steady_latency, tiny_model, tiny_tokenizer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from selfspec.serving.app import ServeConfig, create_app  # noqa: E402 - needs FastAPI

KEY = "tenant-key"


def _serve(config, apps=None):
    """A real uvicorn server on 127.0.0.1 for ``config``: yields its port (its app appended
    to ``apps``)."""
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, config)
    if apps is not None:
        apps.append(app)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def server():
    """One key and a keys file's two."""
    yield from _serve(ServeConfig(model_name="tiny", method="ar", api_key=KEY,
                                  api_keys={"key-a": "alice", "key-b": "bob"}))


def _raw_get(port: int, path: str, authorization: bytes) -> tuple[int, bytes]:
    """(status, body) of a GET sent as raw bytes, so non-ASCII header bytes get through."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Authorization: " + authorization + b"\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("key", ["ééééé".encode("latin-1"), "ééééé".encode(), b"\xff\x80k"])
@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_a_non_ascii_key_is_a_401_not_a_500(server, key, path):
    status, body = _raw_get(server, path, b"Bearer " + key)
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_each_key_of_the_keys_file_and_the_api_key_pass(server):
    for key in (b"tenant-key", b"key-a", b"key-b"):
        assert _raw_get(server, "/v1/models", b"Bearer " + key)[0] == 200
    assert _raw_get(server, "/v1/models", b"Bearer key-c")[0] == 401


def test_authorize_names_the_keys_tenant_and_user_a_sub_tenant():
    keys = {"k1": "alice", "k2": "bob"}
    assert authorize({"authorization": "Bearer k2"}, keys) == "bob"
    assert authorize({"authorization": "bearer k1"}, keys) == "alice"
    assert authorize({}, {}) == "default" and authorize({}, None) == "default"
    assert authorize({"authorization": "Bearer one"}, "one") == "default"
    for bad in ("Bearer k3", "Basic k1", "", "Bearer \udcff"):
        with pytest.raises(ApiError) as error:
            authorize({"authorization": bad}, keys)
        assert error.value.status == 401
    assert request_tenant("alice", "u1", from_user=True) == "alice/u1"
    assert request_tenant("alice", "u1", from_user=False) == "alice"
    assert request_tenant("alice", None, from_user=True) == "alice"
    assert request_tenant("alice", {"x": 1}, from_user=True) == "alice"


def test_keys_file_lines_comments_and_errors(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# tenant key\n\nalice  sk-a\n  bob\tsk-b  \n", encoding="utf-8")
    assert read_keys_file(good) == {"sk-a": "alice", "sk-b": "bob"}
    for text, message in [("alice\n", "line 1: expected 'TENANT KEY'"),
                          ("a b c\n", "got 3 fields"),
                          ("al/ice k\n", "tenant name 'al/ice'"),
                          ("a k\nb k\n", "line 2: this key is already tenant 'a'"),
                          ("# nothing\n\n", "no keys in it")]:
        bad = tmp_path / "bad"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(InvalidArgumentError, match=message):
            read_keys_file(bad)
    with pytest.raises(InvalidArgumentError, match="cannot read it"):
        read_keys_file(tmp_path / "missing")


# ------------------------------------------------ history scoped by tenant (scheduler)
from selfspec.serving.scheduler import Request, Scheduler  # noqa: E402

PROMPT = "the quick brown fox jumps over"
TOKENS = 48
MARGIN = 10  # accepted drafts a history adds at least (~40 with it, ~16 without)


@pytest.fixture(scope="module")
def engine():
    return steady_latency(selfspec.from_pretrained_model(tiny_model("llama", seed=3),
                                                         tiny_tokenizer(), "tiny"))


def _submit(engine, scheduler, tenant, method):
    """(done event, outcome dict) of a greedy request of ``tenant``."""
    done, out = threading.Event(), {}

    def on_done(state, text, error):
        out.update(state=state, error=error)
        done.set()

    scheduler.submit(Request(prompt_ids=engine.encode(PROMPT),
                             options=engine.decode_options(TOKENS, 0.0, 0, 1.0, None),
                             method=method, method_options={}, tenant=tenant,
                             on_done=on_done))
    return done, out


def _run(engine, scheduler, pairs):
    """Submit ``pairs`` of (tenant, method) together (one batch); their finished states."""
    jobs = [_submit(engine, scheduler, tenant, method) for tenant, method in pairs]
    states = []
    for done, out in jobs:
        assert done.wait(120) and out["error"] is None
        states.append(out["state"])
    return states


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_a_tenant_drafts_from_its_own_history_only(engine, method):
    """Tenant a's second request drafts its whole continuation from a's first output; tenant
    b, in the same batch, drafts nothing from it; every output equals ar's."""
    (ar,) = _run(engine, _started(engine), [(None, "ar")])
    scheduler = _started(engine)
    try:
        (first,) = _run(engine, scheduler, [("a", method)])
        again, other = _run(engine, scheduler, [("a", method), ("b", method)])
        assert again.stats.accepted > other.stats.accepted + MARGIN
        for state in (first, again, other):
            assert state.tokens == ar.tokens
        assert len(scheduler.tenants.get("b").history) == len(ar.tokens)
        assert len(scheduler.tenants.get("a").history) > len(ar.tokens)
        assert len(engine.methods.history()) == 0  # the engine's own memory is untouched
    finally:
        scheduler.close()


def test_shared_history_and_tenant_bound(engine):
    """Requests without a tenant (``--share-history``) draft from one history; past
    ``max_tenants`` the least recently used tenant's memory is dropped."""
    scheduler = _started(engine, max_tenants=1)
    try:
        (first,) = _run(engine, scheduler, [(None, "ngram")])
        (again,) = _run(engine, scheduler, [(None, "ngram")])
        assert again.stats.accepted > first.stats.accepted + MARGIN
        _run(engine, scheduler, [("a", "ngram")])
        kept = scheduler.tenants.get("a")
        assert len(kept.history) > 0
        _run(engine, scheduler, [("b", "ngram")])
        assert len(scheduler.tenants) == 1
        (fresh,) = _run(engine, scheduler, [("a", "ngram")])  # a's memory was dropped
        assert fresh.stats.accepted + MARGIN < again.stats.accepted
        assert scheduler.tenants.get("a") is not kept
    finally:
        scheduler.close()
        engine.methods.use_memory(None)


def _started(engine, **options):
    scheduler = Scheduler(engine, max_batch=4, **options)
    scheduler.start()
    return scheduler


# ------------------------------------------------ fixed-size stream chunks
@pytest.fixture(scope="module")
def chunked():
    yield from _serve(ServeConfig(model_name="tiny", method="ngram", stream_chunk_tokens=5))


def test_stream_chunks_carry_fixed_token_counts(chunked):
    """--stream-chunk-tokens 5: every chunk of 23 tokens carries 5 (logprobs tokens), the
    last 3, whatever each step accepted."""
    import urllib.request

    body = {"model": "tiny", "prompt": "abcabcabcabc abc", "max_tokens": 23, "stream": True,
            "temperature": 0, "logprobs": 0, "n": 2}
    request = urllib.request.Request(f"http://127.0.0.1:{chunked}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        lines = [x for x in reply.read().decode().split("\n\n") if x.startswith("data: {")]
    sizes = {0: [], 1: []}
    for line in lines:
        choice = json.loads(line[6:])["choices"][0]
        if choice.get("logprobs"):
            sizes[choice["index"]].append(len(choice["logprobs"]["tokens"]))
    assert sizes == {0: [5, 5, 5, 5, 3], 1: [5, 5, 5, 5, 3]}


def test_a_request_tenant_is_its_keys_its_user_inside_it_or_none_when_shared():
    from types import SimpleNamespace

    from selfspec.serving.service import Service

    request = SimpleNamespace(state=SimpleNamespace(tenant="alice"))
    body = {"user": "u7"}

    def tenant(**config):
        service = SimpleNamespace(config=ServeConfig(model_name="tiny", **config))
        return Service.tenant_of(service, request, body)

    assert tenant() == "alice"
    assert tenant(tenant_from_user=True) == "alice/u7"
    assert tenant(share_history=True, tenant_from_user=True) is None
    assert Service.tenant_of(SimpleNamespace(config=ServeConfig(model_name="tiny")),
                             SimpleNamespace(state=SimpleNamespace()), body) == "default"


def test_over_http_each_key_and_user_drafts_from_its_own_tenant():
    """Requests with key-a (user x) and key-b land in tenants alice/x and bob; the same
    prompt's greedy output is the same for both."""
    import urllib.request

    apps = []
    serving = _serve(ServeConfig(model_name="tiny", method="ngram", api_keys={
        "key-a": "alice", "key-b": "bob"}, tenant_from_user=True), apps)
    port = next(serving)
    texts = []
    try:
        for key, user in [("key-a", "x"), ("key-b", None)]:
            body = {"model": "tiny", "prompt": "abcabcabcabc abc", "max_tokens": 16,
                    "temperature": 0, **({"user": user} if user else {})}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                texts.append(json.loads(reply.read())["choices"][0]["text"])
        tenants = apps[0].state.scheduler.tenants
        assert sorted(tenants._memories) == ["alice/x", "bob"]
        assert texts[0] == texts[1]
    finally:
        serving.close()
