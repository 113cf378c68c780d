"""``selfspec serve --ray`` and ``selfspec batch --ray`` on a local Ray cluster (2 CPUs) with a
tiny random model: replicas answer as one server does, requests sharing a prompt prefix go
to one replica, a killed replica's place is taken, and the Ray Data job equals the
in-process one and resumes. Skipped without Ray (``pip install 'selfspec[ray]'``)."""

from __future__ import annotations

import importlib.util
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import selfspec
from selfspec.batch.jobs import BatchRequest, GenerationSettings
from selfspec.batch.local import run_local
from selfspec.cluster.metrics import PUSH_PERIOD_S
from selfspec.cluster.options import RayServeOptions
from selfspec.serving.config import ServeConfig

from tiny import save_tiny

# Ray itself is imported by the tests that run (``ray``), not at collection: every xdist
# worker collects this file, one runs it, and importing Ray costs seconds.
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'selfspec[ray]')", allow_module_level=True)


@pytest.fixture(scope="module")
def ray():
    """The ``ray`` module with Serve and Data (skips if either is missing)."""
    pytest.importorskip("ray.serve", reason="pip install 'selfspec[ray]'")
    pytest.importorskip("ray.data", reason="pip install 'selfspec[ray]'")
    import ray

    return ray

PROMPTS = ["def add(a, b):\n", "x = 1\ny = ", "for i in range(", "abcabcabc", "import os\n"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ray):
    """A local Ray cluster of 2 CPUs and the tiny model saved as a local directory."""
    model = save_tiny(tmp_path_factory.mktemp("model"), "llama", seed=3)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield str(model)
    ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        return json.loads(r.read())


def test_rendezvous_order_is_stable_and_moves_only_a_removed_replicas_keys():
    from selfspec.cluster.placement import rendezvous_order

    ids = ["a", "b", "c", "d"]
    keys = [f"system prompt {i}" for i in range(200)]
    first = {k: rendezvous_order(k, ids)[0] for k in keys}
    assert first == {k: rendezvous_order(k, list(reversed(ids)))[0] for k in keys}
    assert len(set(first.values())) == 4  # every replica wins some prefixes
    after = {k: rendezvous_order(k, ["a", "b", "d"])[0] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "c")


def test_serve_run_takes_the_commands_options(ray):
    from selfspec.cli import ray_app
    from selfspec.errors import InvalidArgumentError

    assert ray_app({"model": "m", "replicas": "2", "no_affinity": "true"}) is not None
    with pytest.raises(InvalidArgumentError, match="--replicaz"):
        ray_app({"replicaz": "2"})
    with pytest.raises(InvalidArgumentError, match="--replicas"):
        ray_app({"replicas": "two"})
    with pytest.raises(InvalidArgumentError, match="--max-replicas"):
        ray_app({"min_replicas": "2"})
    with pytest.raises(InvalidArgumentError, match="--prefill-chunk"):
        ray_app({"prefill_chunk": "0"})


def test_serve_ray_passes_the_prefill_chunk_to_every_replicas_engine(ray):
    """``--prefill-chunk`` reaches the ``selfspec.load`` arguments each replica loads with
    (so its executor's chunk and its prefix cache's block size)."""
    from selfspec.cli import build_parser
    from selfspec.serving.cli import ray_plan

    args = build_parser().parse_args(["serve", "--ray", "--model", "m", "--prefill-chunk",
                                      "64"])
    load, _, _, app = ray_plan(args)
    assert load["prefill_chunk"] == 64 and app is not None


def test_replicas_answer_as_one_server_route_by_prefix_and_survive_a_kill(cluster, ray):
    from ray import serve

    from selfspec.cluster.serve_app import APP_NAME, build_application

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # ar: no latency model to measure in the replicas (the methods' parity is tested in-process);
    # a short drain: serve.shutdown() waits it out for the replicas
    config = ServeConfig(model_name="tiny", method="ar", max_batch=2, max_queue=8,
                         drain_seconds=1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application({"model": cluster, "dtype": "fp32"}, config,
                                    RayServeOptions(replicas=2, threads=1)),
                  name=APP_NAME, route_prefix="/")
        assert _health(base)["replicas"] == {"ready": 2, "total": 2}
        engine = selfspec.load(cluster, dtype="fp32", show_progress=False)
        for prompt in PROMPTS:  # greedy: the same text as the engine in-process
            want = engine.generate(prompt, "ar", max_new_tokens=12).text
            status, _, body = _post(base + "/v1/completions",
                                    {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                     "temperature": 0})
            assert status == 200 and json.loads(body)["choices"][0]["text"] == want
            status, _, body = _post(base + "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "stream": True})
            chunks = [json.loads(line[6:]) for line in body.decode().splitlines()
                      if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == want
        status, _, body = _post(base + "/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404 and "not served here" in body.decode()  # the app's own errors
        # prompts hash to replicas: 5 land on one replica 1 time in 16, so ask on until both
        # have answered (16 more prompts: 1 in 65,536)
        seen, asked = set(), 0
        while len(seen) < 2 and asked < 16:
            seen.add(_post(base + "/v1/completions", {
                "model": "tiny", "prompt": f"{asked} apples", "max_tokens": 1})[1]
                ["x-selfspec-replica"])
            asked += 1
        want = 2 * len(PROMPTS) + asked  # completions answered 200 so far
        # every replica pushes its metrics each PUSH_PERIOD_S; on a loaded machine a push can
        # come late, so wait until both have pushed every answer (fixed sleeps failed)
        deadline = time.monotonic() + 10 * PUSH_PERIOD_S
        while True:
            answered = _answered_completions(base)
            done = (len({s.labels["replica"] for s in answered}) == 2
                    and sum(s.value for s in answered) >= want)
            if done or time.monotonic() > deadline:
                break
            time.sleep(PUSH_PERIOD_S / 2)
        assert len({s.labels["replica"] for s in answered}) == 2  # both replicas, labelled
        assert sum(s.value for s in answered) >= want
        shared = "You are a careful assistant. " * 12  # > AFFINITY_CHARS
        served = {_post(base + "/v1/completions", {
            "model": "tiny", "prompt": shared + f"Question {i}?", "max_tokens": 2})[1]
            ["x-selfspec-replica"] for i in range(6)}
        assert len(served) == 1  # one replica holds the shared prefix
        before = _engine_replicas(ray)
        _kill_one_replica(ray)
        for prompt in PROMPTS:  # the survivor answers every request
            status, _, _ = _post(base + "/v1/completions",
                                 {"model": "tiny", "prompt": prompt, "max_tokens": 4})
            assert status == 200
        deadline = time.monotonic() + 60
        while not _engine_replicas(ray) - before and time.monotonic() < deadline:
            time.sleep(0.5)
        # Ray Serve started a replacement replica (the suite does not wait for its model load)
        assert _engine_replicas(ray) - before
    finally:
        serve.shutdown()


def _answered_completions(base: str) -> list:
    """The ``selfspec_http_requests_total`` samples of ``/v1/completions`` (parsing checks the
    exposition is valid)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    return [s for f in families for s in f.samples
            if s.name == "selfspec_http_requests_total"
            and s.labels["endpoint"] == "/v1/completions"]


def _engine_replicas(ray) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "SelfspecEngine" in a["name"]}


def _kill_one_replica(ray) -> None:
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if "SelfspecEngine" in a["name"]]
    assert len(replicas) == 2
    actor = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    ray.kill(actor, no_restart=True)


def test_the_ray_data_job_equals_the_in_process_one(cluster):
    from selfspec.batch.ray_data import run_ray

    settings = GenerationSettings(
        method="ar", options={}, max_new_tokens=10, temperature=0.0, top_k=0, top_p=1.0,
        seed=None, stop=(), response_format=None, presence_penalty=0.0,
        frequency_penalty=0.0, logprobs=None)
    requests = [BatchRequest(i, PROMPTS[i % len(PROMPTS)] + str(i), None, settings)
                for i in range(12)]
    on_ray: list[dict] = []
    run_ray(requests, on_ray.append, load={"model": cluster, "dtype": "fp32"}, batch_size=4,
            concurrency=2, threads=1)
    local: list[dict] = []
    run_local(selfspec.load(cluster, dtype="fp32", show_progress=False), requests,
              local.append, batch_size=4)
    assert sorted(r["id"] for r in on_ray) == list(range(12))  # each exactly once
    assert {r["id"]: r["token_ids"] for r in on_ray} == {r["id"]: r["token_ids"] for r in local}
