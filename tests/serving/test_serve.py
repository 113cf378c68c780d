"""`selfspec serve` as a real process on the default model, driven by the official `openai`
client: greedy outputs (streamed or not, completions and chat) equal `generate`'s, ragged
concurrent requests get their own tokens, and every error case answers an OpenAI-style body
with the right status (never a 500 with a traceback)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef softmax(x):",
           "Once upon a time"]


@pytest.fixture(scope="module")
def refused_start():
    """`selfspec serve` with a bad method option (test_server_refuses_bad_start_options),
    started with the module: it runs beside the server's start (`server` asks for it first)
    instead of after it, each process importing torch on its own core."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfspec.cli", "serve", "--method", "layerskip",
         "--exit-layer", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SELFSPEC_API_KEY": ""})
    yield proc
    if proc.poll() is None:  # the test failed before it ended
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def server(refused_start):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfspec.cli", "serve", "--model", MODEL, "--dtype", "fp32",
         "--port", str(port), "--api-key", KEY, "--method", "ar", "--max-batch", "2",
         "--max-queue", "1", "--max-prompt-tokens", "256", "--max-body-bytes", "20000",
         "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"selfspec serve exited: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert time.time() < deadline, "selfspec serve did not start"
            time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    assert "Traceback" not in err or "KeyboardInterrupt" in err, err[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(smollm2_fp32):
    return smollm2_fp32


def _post(url, body, key=KEY, raw=None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_completions_equal_generate_streamed_or_not(client, engine):
    model = client.models.list().data[0].id
    assert model == MODEL
    wants = {}
    for prompt in PROMPTS[:2]:
        want = wants[prompt] = engine.generate(prompt, max_new_tokens=16)
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                          temperature=0)
        assert reply.choices[0].text == want.text
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == len(want.token_ids)
        assert reply.usage.prompt_tokens == len(want.prompt_ids)
        chunks = list(client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    # per-request method override (methods that need no latency model: the server process
    # would measure one for minutes before answering; n-gram batches are tested in test_batch)
    for method in ("dv", "layerskip"):
        reply = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                          temperature=0,
                                          extra_body={"selfspec": {"method": method}})
        assert reply.choices[0].text == wants[PROMPTS[0]].text


def test_chat_and_stop_strings_equal_generate(client, engine):
    want = engine.generate("Name three colors.", max_new_tokens=30, chat=True)
    messages = [{"role": "user", "content": "Name three colors."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                           temperature=0)
    assert reply.choices[0].message.content == want.text
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text
    stop = engine.generate(PROMPTS[0], max_new_tokens=30, stop=["return"])
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30,
                                          temperature=0, stop=["return"], stream=stream)
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        assert text == stop.text and "return" not in text


def test_concurrent_requests_get_their_own_tokens(client, engine):
    want = [engine.generate(p, max_new_tokens=20).text for p in PROMPTS[:3]]

    def ask(prompt):
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    for _ in range(2):
        try:
            with ThreadPoolExecutor(3) as pool:  # 2 rows + 1 waiting: the server's limit
                got = list(pool.map(ask, PROMPTS[:3]))
            break
        except openai.RateLimitError:  # a previous test's row may still be leaving
            time.sleep(1)
    assert got == want


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 99}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "logprobs": 30}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 400}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "selfspec": {"method": "nope"}}, 400, "selfspec"),
    ({"model": MODEL, "prompt": "x", "selfspec": {"method": "layerskip",
                                                 "options": {"exit_layer": 99}}}, 400, "selfspec"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, reply = _post(server + path, body)
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and "Traceback" not in reply["error"]["message"]


def test_auth_json_size_route_and_queue_errors(server, client):
    code, reply = _post(server + "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"
    code, _ = _post(server + "/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong")
    assert code == 401
    code, reply = _post(server + "/v1/completions", None, raw=b"{not json")
    assert code == 400 and "JSON" in reply["error"]["message"]
    code, reply = _post(server + "/v1/completions", None, raw=b"[1, 2]")
    assert code == 400
    code, reply = _post(server + "/v1/completions", {"model": MODEL, "prompt": "x" * 30000})
    assert code == 413
    code, reply = _post(server + "/v1/nothing", {})
    assert code == 404 and "error" in reply
    with urllib.request.urlopen(server + "/health") as reply:  # no key needed
        assert json.loads(reply.read())["status"] == "ok"
    # 2 rows + 1 waiting fill the server; the next request is refused with 429, and clients
    # that disconnect free their rows.
    counting = [f"{start}, {start + 1}, {start + 2}, {start + 3}," for start in (1, 20, 300)]
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=1000,
                                         temperature=0, stream=True) for p in counting]
    for stream in streams[:2]:
        next(iter(stream))  # the rows run
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    for stream in streams:
        stream.close()
    deadline = time.time() + 60
    while True:
        with urllib.request.urlopen(server + "/health") as reply:
            health = json.loads(reply.read())
        if health["running"] == 0 and health["waiting"] == 0:
            break
        assert time.time() < deadline, health
        time.sleep(0.2)
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_server_refuses_bad_start_options(refused_start):
    _, stderr = refused_start.communicate(timeout=120)
    assert refused_start.returncode == 2 and "error:" in stderr
    assert "Traceback" not in stderr
