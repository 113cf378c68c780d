#!/usr/bin/env python
"""A replica of ``selfspec serve --ray`` killed under load: what each client gets.

Usage::

    python scripts/ray_fault_load.py                      # 16 clients, 2 replicas, 1 killed
    python scripts/ray_fault_load.py --clients 8 --requests 2 --json report.json

A local Ray cluster runs the application with ``--replicas`` engine replicas (``ar``, one
thread each). ``--clients`` threads each send ``--requests`` greedy completions of their
own prompts (every other client streams), each with a client timeout (``--timeout``: a
request that hangs shows as a timeout, not as a hung script). Once ``--kill-after``
requests have completed, one engine replica is killed (``ray.kill`` of its actor) with
requests in flight on it. Reported:

- completed requests, and whether each text equals the in-process engine's greedy text for
  its own prompt (an answer equal to another prompt's is counted mixed up);
- requests that failed, with the error the client got (the ingress sends a request whose
  replica died before answering once more, headed ``x-selfspec-retried: 1``; otherwise a 503,
  or a stream's error event);
- client timeouts (hangs);
- seconds until ``/health`` reports every replica ready again (the replacement).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

WORDS = ("the river", "a small house", "seven cats", "an old map", "the last train",
         "a quiet garden", "two friends", "the winter sea")


def _prompt(client: int, i: int) -> str:
    return f"Story {client}-{i}. Once upon a time, {WORDS[(client + i) % len(WORDS)]}"


def _complete(base: str, prompt: str, max_tokens: int, stream: bool, timeout: float) -> dict:
    """One completion: ``{"status", "text" | "error", "replica", "retried"}``."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            head = {"status": r.status, "replica": r.headers.get("x-selfspec-replica"),
                    "retried": r.headers.get("x-selfspec-retried") == "1"}
            raw = r.read().decode()
    except urllib.error.HTTPError as err:
        return {"status": err.code, "error": err.read().decode()[:300]}
    except (TimeoutError, socket.timeout):
        return {"status": "timeout"}
    except (urllib.error.URLError, ConnectionError) as err:
        return {"status": "connection", "error": str(err)[:300]}
    if not stream:
        return {**head, "text": json.loads(raw)["choices"][0]["text"]}
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return {**head, "status": "stream error", "error": errors[0]["message"]}
    return {**head, "text": "".join(c["choices"][0]["text"] for c in chunks)}


def _engine_replicas(ray) -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "SelfspecEngine" in a["name"]]


def _ready(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return json.loads(r.read())["replicas"]["ready"]
    except (OSError, ValueError, KeyError):
        return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kill-after", type=int, default=8,
                        help="completed requests before the kill")
    parser.add_argument("--timeout", type=float, default=180, help="client timeout, s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import ray
    from ray import serve

    import selfspec
    from selfspec.cluster.options import RayServeOptions
    from selfspec.cluster.serve_app import APP_NAME, build_application
    from selfspec.serving.config import ServeConfig

    jobs = [(c, i) for c in range(args.clients) for i in range(args.requests)]
    engine = selfspec.load(args.model, dtype=args.dtype, show_progress=False)
    # one ragged batch: each row is the generation its prompt gets alone (greedy)
    results = engine.generate_batch([_prompt(*job) for job in jobs], "ar",
                                    max_new_tokens=args.max_tokens)
    want = {job: r.text for job, r in zip(jobs, results)}
    del engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServeConfig(model_name="m", method="ar", max_batch=4, max_queue=8)
    serve.run(build_application({"model": args.model, "dtype": args.dtype}, config,
                                RayServeOptions(replicas=args.replicas, threads=1)),
              name=APP_NAME, route_prefix="/")
    results: dict = {}
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(args.requests):
            result = _complete(base, _prompt(c, i), args.max_tokens, c % 2 == 1, args.timeout)
            with lock:
                results[c, i] = result
            done.release()

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for _ in range(args.kill_after):
        done.acquire()
    victim = _engine_replicas(ray)[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    killed_at = time.monotonic() - start
    with lock:
        before_kill = len(results)
    for t in threads:
        t.join()
    load_s = time.monotonic() - start
    back = None
    while time.monotonic() - start < load_s + 180:
        if _ready(base) == args.replicas:
            back = time.monotonic() - start - killed_at
            break
        time.sleep(1)
    serve.shutdown()
    ray.shutdown()

    texts = {want[j]: j for j in jobs}
    rows = {"completed": 0, "equal to in-process": 0, "mixed up": 0, "other text": 0,
            "retried": 0, "failed": 0, "timeouts": 0}
    errors: dict[str, int] = {}
    for job in jobs:
        r = results[job]
        if r["status"] == 200:
            rows["completed"] += 1
            rows["retried"] += r["retried"]
            if r["text"] == want[job]:
                rows["equal to in-process"] += 1
            elif r["text"] in texts:
                rows["mixed up"] += 1
            else:
                rows["other text"] += 1
        elif r["status"] == "timeout":
            rows["timeouts"] += 1
        else:
            rows["failed"] += 1
            key = f"{r['status']}: {r.get('error', '')[:160]}"
            errors[key] = errors.get(key, 0) + 1
    report = {"requests": len(jobs), **rows, "errors": errors,
              "killed_at_s": round(killed_at, 1), "completed_before_kill": before_kill,
              "load_s": round(load_s, 1),
              "replacement_ready_s_after_kill": None if back is None else round(back, 1),
              "setup": vars(args) | {"json": str(args.json)}}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
