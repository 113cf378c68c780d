#!/usr/bin/env python
"""Prefix-cache hit rate and time to first token of ``selfspec serve --ray`` with and without
prefix-affinity routing (:mod:`selfspec.cluster.routing`).

Usage::

    python scripts/ray_affinity_bench.py                       # 2 replicas, 8 system prompts
    python scripts/ray_affinity_bench.py --replicas 4 --system-prompts 16 --rounds 3

Each run starts a local Ray cluster and the Ray Serve application twice (affinity on, then
``--no-affinity``), each replica with a prefix cache that holds about
``--system-prompts / --replicas`` system prompts (``--prefix-cache-mib``). The clients send
``--rounds`` rounds of chat requests: each of ``--system-prompts`` distinct system prompts of
about ``--prefix-tokens`` tokens of real text (docs/*.md), each with a new short question, in
a shuffled order (seeded). Reported per routing: the prefix-cache hit rate of the warm
requests (cached prompt tokens / prompt tokens, from each answer's
``usage.prompt_tokens_details``), and the median TTFT of cold (first round) and warm (later
rounds) requests, from the streams. Timings are wall clock: run where nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _system_prompts(count: int, tokens: int) -> list[str]:
    words = " ".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
    words = words.split()
    size = int(tokens * 0.75)  # about 0.75 words a token in English prose
    return [f"System {i}. " + " ".join(words[i * size:(i + 1) * size]) for i in range(count)]


def _stream(base: str, model: str, system: str, question: str) -> tuple[float, int, int]:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    start, ttft, usage = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get(
                    "content"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return ttft or float("nan"), usage["prompt_tokens"], cached


def _run(args, affinity: bool, systems: list[str]) -> dict:
    import ray
    from ray import serve

    from selfspec.cluster.options import RayServeOptions
    from selfspec.cluster.serve_app import APP_NAME, build_application
    from selfspec.serving.config import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=args.replicas * args.threads, include_dashboard=False,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    load = {"model": args.model, "dtype": args.dtype, "prefix_cache_mib": args.prefix_cache_mib}
    config = ServeConfig(model_name="m", method="ar", max_batch=2, max_queue=16)
    serve.run(build_application(load, config, RayServeOptions(
        replicas=args.replicas, threads=args.threads, affinity=affinity)),
        name=APP_NAME, route_prefix="/")
    rng = random.Random(args.seed)
    cold, warm, prompt, cached = [], [], 0, 0
    try:
        for round_ in range(args.rounds):
            order = list(range(len(systems)))
            rng.shuffle(order)
            for i in order:
                ttft, p, c = _stream(f"http://127.0.0.1:{port}", "m", systems[i],
                                     f"Question {round_}: what does part {i} describe?")
                (cold if round_ == 0 else warm).append(ttft)
                if round_:
                    prompt, cached = prompt + p, cached + c
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"hit_rate": cached / max(prompt, 1), "prompt_tokens": prompt / max(len(warm), 1),
            "cold_ttft_ms": 1e3 * statistics.median(cold),
            "warm_ttft_ms": 1e3 * statistics.median(warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefix-cache-mib", type=float, default=200,
                        help="per replica: ~6 SmolLM2 chat prompts of ~1,400 tokens (22.5 KiB "
                             "of bf16 KV a token)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    systems = _system_prompts(args.system_prompts, args.prefix_tokens)
    rows = {name: _run(args, affinity, systems)
            for name, affinity in (("affinity", True), ("no affinity", False))}
    print(f"{args.replicas} replicas x {args.threads} threads, {args.system_prompts} system "
          f"prompts of ~{args.prefix_tokens} tokens, {args.rounds} rounds, "
          f"prefix cache {args.prefix_cache_mib:g} MiB per replica, "
          f"{rows['affinity']['prompt_tokens']:.0f} prompt tokens a request")
    print("| routing | warm prefix-cache hit rate | cold TTFT ms | warm TTFT ms | cold/warm |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['hit_rate']:.1%} | {r['cold_ttft_ms']:.0f} | "
              f"{r['warm_ttft_ms']:.0f} | {r['cold_ttft_ms'] / r['warm_ttft_ms']:.1f}x |")


if __name__ == "__main__":
    main()
