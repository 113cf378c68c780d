#!/usr/bin/env python
"""``selfspec serve --ray`` on a two-node local cluster, and autoscaling under a burst.

Usage::

    python scripts/ray_cluster_check.py two-node      # 2 nodes x 1 CPU, 1 replica on each
    python scripts/ray_cluster_check.py autoscale     # --min-replicas 1 --max-replicas 2
    python scripts/ray_cluster_check.py two-node --json two-node.json

``two-node``: ``ray.cluster_utils.Cluster`` starts a head and a second node of 1 CPU each on
this machine; the application's 2 engine replicas take 1 CPU each, so one runs on each node
(the script reads each replica actor's node from the GCS's actor table). Each request of a set
(completions and chats, every other one streamed) is answered greedily; reported: the
answers equal to the in-process engine's, and which replica and node answered.

``autoscale``: one local node of 2 CPUs, ``min_replicas 1, max_replicas 2``, a target of 1
request in flight per replica, short look-back and delays (``RayServeOptions.autoscaling``,
so the run takes about two minutes, not Ray's 10-minute scale-down default). Idle, then
``--clients`` clients send requests for ``--burst-s`` seconds, then idle again; ``/health``'s
replica counts are recorded every second.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["def add(a, b):\n", "The capital of France is", "Once upon a time, a fox",
           "import os\nimport sys\n", "1, 2, 3, 4,", "Q: What is rain?\nA:"]
CHATS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about snow."]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(base: str, path: str, body: dict) -> tuple[str, str]:
    """The answer's text and replica (a stream's deltas joined)."""
    request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        replica, raw = r.headers.get("x-selfspec-replica"), r.read().decode()
    chat = path.endswith("chat/completions")

    def text(choice: dict) -> str:
        if not body.get("stream"):
            return choice["message"]["content"] if chat else choice["text"]
        return (choice["delta"].get("content") or "") if chat else choice["text"]

    if not body.get("stream"):
        return text(json.loads(raw)["choices"][0]), replica
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return "".join(text(c["choices"][0]) for c in chunks if c.get("choices")), replica


def _health(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return json.loads(r.read())["replicas"]
    except (OSError, ValueError, KeyError):
        return {"ready": None, "total": None}


def _app(args, options):
    from ray import serve

    from selfspec.cluster.serve_app import APP_NAME, build_application
    from selfspec.serving.config import ServeConfig

    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServeConfig(model_name="m", method=args.method, max_batch=2, max_queue=8)
    serve.run(build_application({"model": args.model, "dtype": args.dtype}, config, options),
              name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def two_node(args) -> dict:
    """Two nodes of 1 CPU, a replica on each, every answer against the in-process engine."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    import selfspec
    from selfspec.cluster.options import RayServeOptions

    engine = selfspec.load(args.model, dtype=args.dtype, show_progress=False)
    tok = engine.tokenizer
    cases = []
    for i, p in enumerate(PROMPTS):
        want = engine.generate(p, args.method, max_new_tokens=args.max_tokens).text
        cases.append(("/v1/completions", {"prompt": p, "stream": i % 2 == 1}, want))
    for i, q in enumerate(CHATS):
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        want = engine.generate(ids, args.method, max_new_tokens=args.max_tokens).text
        cases.append(("/v1/chat/completions",
                      {"messages": [{"role": "user", "content": q}], "stream": i % 2 == 0},
                      want))
    del engine
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        base = _app(args, RayServeOptions(replicas=2, threads=1))
        nodes = _replica_nodes(ray)
        answers = []
        for path, body, want in cases:
            text, replica = _post(base, path, {"model": "m", "max_tokens": args.max_tokens,
                                               "temperature": 0, **body})
            answers.append({"path": path, "stream": body["stream"], "replica": replica,
                            "equal": text == want})
        health = _health(base)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return {"nodes": 2, "replica_nodes": nodes, "health": health,
            "distinct_replica_nodes": len(set(nodes.values())),
            "requests": len(answers), "equal": sum(a["equal"] for a in answers),
            "replicas_answering": len({a["replica"] for a in answers}), "answers": answers}


def _replica_nodes(ray) -> dict[str, str]:
    """Each live engine replica actor's node id (from the GCS's actor table)."""
    from ray._private.state import actors

    return {info["Name"].rsplit("#", 1)[-1]: info["Address"]["NodeID"][:12]
            for info in actors().values()
            if "SelfspecEngine" in (info.get("Name") or "") and info.get("State") == "ALIVE"}


def autoscale(args) -> dict:
    """Replica counts over an idle → burst → idle run."""
    import ray
    from ray import serve

    from selfspec.cluster.options import RayServeOptions

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    options = RayServeOptions(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1, threads=1,
        autoscaling={"upscale_delay_s": 3, "downscale_delay_s": 15, "look_back_period_s": 5,
                     "metrics_interval_s": 1})
    base = _app(args, options)
    timeline, stop = [], threading.Event()
    start = time.monotonic()

    def watch() -> None:
        while not stop.is_set():
            timeline.append((round(time.monotonic() - start, 1), _health(base)))
            time.sleep(1)

    def client(c: int, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            _post(base, "/v1/completions", {"model": "m", "prompt": f"{c}.{i} Once upon a",
                                            "max_tokens": args.max_tokens, "temperature": 0})
            i += 1

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        time.sleep(args.idle_s)
        burst_at = time.monotonic() - start
        until = time.monotonic() + args.burst_s
        clients = [threading.Thread(target=client, args=(c, until)) for c in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        burst_end = time.monotonic() - start
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline:
            if timeline and timeline[-1][1].get("total") == 1 and timeline[-1][0] > burst_end:
                break
            time.sleep(1)
        time.sleep(2)
    finally:
        stop.set()
        watcher.join()
        serve.shutdown()
        ray.shutdown()
    changes = [timeline[0]] + [b for a, b in zip(timeline, timeline[1:]) if a[1] != b[1]]
    peak = max((h.get("ready") or 0) for _, h in timeline)
    return {"burst_s": [round(burst_at, 1), round(burst_end, 1)], "peak_ready": peak,
            "final": timeline[-1], "changes": changes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("two-node", "autoscale"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--method", default="ar")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--clients", type=int, default=6, help="autoscale: burst clients")
    parser.add_argument("--idle-s", type=float, default=5)
    parser.add_argument("--burst-s", type=float, default=45)
    parser.add_argument("--settle-s", type=float, default=90,
                        help="autoscale: the longest wait for the scale-down")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = two_node(args) if args.check == "two-node" else autoscale(args)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
