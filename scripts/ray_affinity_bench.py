#!/usr/bin/env python
"""Prefix-cache hit rate and time to first token of ``selfspec serve --ray`` by routing:
prefix placement (the default, :mod:`selfspec.cluster.routing`), plain rendezvous hashing
(what the router did before its bound) and Ray's load-only routing (``--no-affinity``).

Usage::

    python scripts/ray_affinity_bench.py                    # 2 replicas x 4 system prompts each
    python scripts/ray_affinity_bench.py --routings rendezvous   # the router before its bound
    python scripts/ray_affinity_bench.py --replicas 4 --prompts-per-replica 2 --rounds 3
    python scripts/ray_affinity_bench.py --prefill-chunk 64 256  # by prefix-cache block size

The system prompts are ``--replicas x --prompts-per-replica`` distinct texts of
``--prefix-tokens`` tokens each (docs/*.md, cut by the model's tokenizer), and each replica's
prefix cache (``--prefix-cache-mib``, default: sized here) holds exactly
``--prompts-per-replica`` of them: together they fill, and do not overflow, the replicas'
caches. A system prompt's footprint is the whole blocks one request keeps (its shared
prefix, and the blocks past it that hold the question) plus the question's blocks of the
request before it (LRU evicts those first while the next request comes), plus half a block.
One client sends ``--rounds`` rounds of chat requests, one per system prompt with a new short
question, in a shuffled order (seeded); the first round
is cold. Reported per routing, for the warm rounds:

- token hit rate: cached prompt tokens / prompt tokens (``usage.prompt_tokens_details``);
- hit rate of the reusable prefix: cached tokens / the tokens a cache can reuse at all (the
  shared prefix's whole blocks of ``--prefill-chunk`` tokens, at most ``prompt - 1`` tokens:
  a cache of unbounded size on one replica reaches 100%);
- the median TTFT (from the stream) of cold and warm requests;
- per replica: the system prompts it answered and the blocks its cache evicted (``/metrics``).

With several ``--prefill-chunk`` sizes (``selfspec serve --prefill-chunk``: the replicas'
prefill chunk and prefix-cache block), every routing runs at each, the sizes alternating.

Timings are wall clock: read the ratios.
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

from prometheus_client.parser import text_string_to_metric_families

from selfspec.executor.plan import PREFILL_CHUNK

REPO = Path(__file__).resolve().parents[1]
ROUTINGS = {"placement": (True, True), "rendezvous": (True, False), "load only": (False, False)}


def _system_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    words = " ".join(" ".join(p.read_text(encoding="utf-8").split())
                     for p in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    if len(ids) < count * tokens:
        raise SystemExit(f"docs/*.md hold {len(ids)} tokens, fewer than {count} x {tokens}")
    return [f"System {i}. " + tokenizer.decode(ids[i * tokens:(i + 1) * tokens])
            for i in range(count)]


def _messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _question(round_: int, i: int) -> str:
    return f"Question {round_}: what does part {i} describe?"


def _ids(tokenizer, system: str, question: str) -> list[int]:
    return tokenizer.apply_chat_template(_messages(system, question), add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _prompt_len(tokenizer, system: str, question: str) -> int:
    return len(_ids(tokenizer, system, question))


def _reusable(tokenizer, system: str, question: str, block: int) -> int:
    """Tokens of this request a prefix cache can reuse: the whole blocks of what it shares
    with the same system prompt under another question, at most ``len - 1``."""
    mine = _ids(tokenizer, system, question)
    other = _ids(tokenizer, system, "A different question, for reference.")
    common = next((k for k, (a, b) in enumerate(zip(mine, other)) if a != b),
                  min(len(mine), len(other)))
    return min(common, len(mine) - 1) // block * block


def _stream(base: str, system: str, question: str) -> tuple[float, int, int, str]:
    body = {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": _messages(system, question)}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    start, ttft, usage = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        replica = response.headers.get("x-selfspec-replica", "?")
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get(
                    "content"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return ttft or float("nan"), usage["prompt_tokens"], cached, replica


def _evictions(base: str) -> dict[str, float]:
    """Blocks each replica's prefix cache evicted (the merged ``/metrics``)."""
    time.sleep(2.5)  # one metrics push period (selfspec.cluster.metrics.PUSH_PERIOD_S)
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "selfspec_prefix_cache_evicted_blocks" for s in f.samples}


def _run(args, routing: str, chunk: int, systems: list[str], reusable: dict,
         cache_mib: float) -> dict:
    import ray
    from ray import serve

    from selfspec.cluster.options import RayServeOptions
    from selfspec.cluster.serve_app import APP_NAME, build_application
    from selfspec.serving.config import ServeConfig

    affinity, bounded = ROUTINGS[routing]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=args.replicas * args.threads, include_dashboard=False,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    load = {"model": args.model, "dtype": args.dtype, "prefix_cache_mib": cache_mib,
            "prefill_chunk": chunk}
    config = ServeConfig(model_name="m", method="ar", max_batch=2, max_queue=16)
    serve.run(build_application(load, config, RayServeOptions(
        replicas=args.replicas, threads=args.threads, affinity=affinity),
        router_kwargs={"bounded": bounded}), name=APP_NAME, route_prefix="/")
    rng = random.Random(args.seed)
    cold, warm, prompt, cached, bound, served = [], [], 0, 0, 0, {}
    try:
        for round_ in range(args.rounds):
            order = list(range(len(systems)))
            rng.shuffle(order)
            for i in order:
                ttft, p, c, replica = _stream(base, systems[i], _question(round_, i))
                served.setdefault(replica, set()).add(i)
                (cold if round_ == 0 else warm).append(ttft)
                if round_:
                    prompt, cached = prompt + p, cached + c
                    bound += reusable[chunk, round_, i]
        evicted = _evictions(base)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"hit_rate": cached / max(prompt, 1), "reusable_hit_rate": cached / max(bound, 1),
            "prompt_tokens": prompt / max(len(warm), 1),
            "cold_ttft_ms": 1e3 * statistics.median(cold),
            "warm_ttft_ms": 1e3 * statistics.median(warm),
            "replicas": {r: {"system_prompts": sorted(s), "evicted_blocks": evicted.get(r)}
                         for r, s in sorted(served.items())}}


def _block_mib(engine, text: str, chunk: int) -> float:
    """MiB of one ``chunk``-token prefix-cache block of this model and dtype (measured on one
    prompt)."""
    engine.executor.prefill_chunk = chunk
    cache = engine.use_prefix_cache(4096)
    engine.generate(text, "ar", max_new_tokens=1)
    return cache.bytes / cache.num_blocks / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts-per-replica", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefix-cache-mib", type=float, default=None,
                        help="per replica (default: --prompts-per-replica system prompts' "
                             "reusable blocks plus half a block)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routings", nargs="+", default=["placement", "load only"],
                        choices=ROUTINGS, help="rendezvous: the router before its bound")
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[PREFILL_CHUNK],
                        help="the replicas' prefill chunk and prefix-cache block size; several "
                             f"run in turn (default {PREFILL_CHUNK})")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    import selfspec

    engine = selfspec.load(args.model, dtype=args.dtype, show_progress=False)
    tokenizer = engine.tokenizer
    systems = _system_prompts(tokenizer, args.replicas * args.prompts_per_replica,
                              args.prefix_tokens)
    reusable = {(c, r, i): _reusable(tokenizer, s, _question(r, i), c)
                for c in args.prefill_chunk for r in range(args.rounds)
                for i, s in enumerate(systems)}
    stored = {(r, i): _prompt_len(tokenizer, s, _question(r, i))
              for r in range(args.rounds) for i, s in enumerate(systems)}
    mib = {}
    for c in args.prefill_chunk:
        shared = max(v for k, v in reusable.items() if k[0] == c) // c
        kept = max(stored.values()) // c
        footprint = kept + (kept - shared)
        mib[c] = args.prefix_cache_mib if args.prefix_cache_mib is not None else (
            (args.prompts_per_replica * footprint + 0.5) * _block_mib(engine, systems[0], c))
    del engine
    rows = {(c, name): _run(args, name, c, systems, reusable, mib[c])
            for c in args.prefill_chunk for name in args.routings}
    first = next(iter(rows.values()))
    head = (f"{args.replicas} replicas x {args.threads} threads, {len(systems)} system prompts "
            f"of {args.prefix_tokens} tokens, {args.rounds} rounds, prefix cache per replica "
            + ", ".join(f"{mib[c]:.1f} MiB at chunk {c}" for c in args.prefill_chunk)
            + f", {first['prompt_tokens']:.0f} prompt tokens a request")
    print(head)
    print("| chunk | routing | warm token hit rate | hit rate of the reusable prefix | "
          "cold TTFT ms | warm TTFT ms | cold/warm | system prompts per replica | "
          "evicted blocks |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---|")
    for (c, name), r in rows.items():
        per = " / ".join(str(len(v["system_prompts"])) for v in r["replicas"].values())
        ev = " / ".join(f"{v['evicted_blocks']:.0f}" if v["evicted_blocks"] is not None
                        else "?" for v in r["replicas"].values())
        print(f"| {c} | {name} | {r['hit_rate']:.1%} | {r['reusable_hit_rate']:.1%} | "
              f"{r['cold_ttft_ms']:.0f} | {r['warm_ttft_ms']:.0f} | "
              f"{r['cold_ttft_ms'] / r['warm_ttft_ms']:.1f}x | {per} | {ev} |")
    if args.json:
        out = {"setup": head, "rows": {f"chunk {c}, {n}": r for (c, n), r in rows.items()}}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
