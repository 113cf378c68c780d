"""Mixed load test of ``selfspec serve`` (issue 64), ending with SIGTERM (not a unit test):
``selfspec bench serve-mix``.

Starts a server process and, in order:

1. takes a reference for every prompt: its greedy answer to a lone request (with log
   probabilities, so that token lists can be compared);
2. runs ``--clients`` clients for ``--duration`` seconds, each sending greedy requests back
   to back, picking kinds (:mod:`selfspec.bench.serve_load.kinds`: free-text chat streamed and
   not, JSON schema streamed and not, completions with ``logprobs``, chat with
   ``top_logprobs``, ``n = 2``) in a fixed seeded rotation; every answer is checked against
   its reference (none failed, mixed up, truncated; JSON valid; logprobs shaped);
3. scrapes ``/metrics`` (``prometheus_client.parser``) and compares generated tokens, HTTP
   responses per endpoint and status, and finished choices per reason with the clients'
   own counts: they must be equal;
4. sends one more request per client (free text, logprobs or ``n = 2``), SIGTERMs the
   server while they are in flight, and keeps sending: the in-flight ones must finish
   normally (or, past ``--drain-seconds``, end with a ``shutting_down`` error), the later
   ones get a 503 or no connection, and the process exits 0 within the bound plus
   ``--exit-margin`` (:mod:`selfspec.bench.serve_load.drain`).

Writes ``mixed.json``, ``README.md`` and ``server.log`` into ``--out`` (default: a new
``out/bench/serve-mix-MODEL-TIME``); exit status 0 when everything held, 1 when something did
not, 2 when the run could not start::

    selfspec bench serve-mix --model smollm2-135m-instruct --clients 16 --duration 600 \\
        --threads 2 --out out/bench/serve-mix-smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from selfspec.bench.serve_load.client import Session, Tally
from selfspec.bench.serve_load.drain import EXAMPLES, drain_phase
from selfspec.bench.serve_load.kinds import (
    CATEGORIES,
    KINDS,
    Answer,
    Limits,
    Prompts,
    check,
    count_problems,
    max_logprob_gap,
    rotation,
    start,
)
from selfspec.bench.serve_load.report import (
    CountCheck,
    KindResult,
    LoadResult,
    MetricsResult,
    MixedResult,
    write_report,
)
from selfspec.bench.serve_load.server import (
    OUTPUT_ROOT,
    command_line,
    free_port,
    http_get,
    load_average,
    method_body,
    model_problem,
    output_folder,
    rss_mib,
)
from selfspec.cli_args import (
    add_dtype_argument,
    add_threads_argument,
    float_arg,
    int_arg,
    weight_dtypes,
)

#: Packages the run needs (module: why), checked before anything starts.
NEEDS = {"openai": "the clients", "fastapi": "the server", "uvicorn": "the server",
         "prometheus_client": "/metrics and its parser", "llguidance": "json_schema",
         "jsonschema": "validating JSON answers"}


# --------------------------------------------------------------------------- phases
async def take_references(session: Session) -> list[str]:
    """A lone request per prompt of each source (with log probabilities); the problems
    (a reference that is not a complete 200 makes the run meaningless)."""
    plain = {k.source: k for k in KINDS if k.n == 1 and not k.stream}
    problems = []
    for source, index in session.prompts.keys():
        answer = await session.send(plain[source], index, logprobs=True)
        if not answer.finished_normally or answer.completion_tokens is None:
            problems.append(f"the reference of {source} prompt {index} failed: status "
                            f"{answer.status}, {answer.error}")
        session.references[(source, index)] = answer
    return problems


class KindStats:
    """Accumulates one kind's :class:`KindResult` during the load."""

    def __init__(self, name: str) -> None:
        self.result = KindResult(name)
        self.latencies: list[float] = []
        self.ttfts: list[float] = []

    def add(self, answer: Answer, problems: dict[str, int], gap: float) -> None:
        """Count one answer."""
        r = self.result
        r.requests += 1
        r.choices += len(answer.choices)
        r.completion_tokens += answer.completion_tokens or 0
        for category, count in problems.items():
            r.problems[category] += count
        r.max_logprob_gap = max(r.max_logprob_gap, gap)
        self.latencies.append(answer.seconds * 1e3)
        if answer.first_token_s is not None:
            self.ttfts.append(answer.first_token_s * 1e3)

    def finish(self) -> KindResult:
        """The result, with its percentiles."""
        r = self.result
        r.latency_ms_median, r.latency_ms_p90 = _quantile(self.latencies, 0.5), _quantile(
            self.latencies, 0.9)
        r.ttft_ms_median = _quantile(self.ttfts, 0.5) if self.ttfts else None
        return r


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load_phase(session: Session, clients: int, duration: float, seed: int,
                     pid: int) -> LoadResult:
    """``clients`` clients sending back to back for ``duration`` seconds; each finishes the
    request it is in when the time is up."""
    order = rotation(seed)
    stats = {kind.name: KindStats(kind.name) for kind in KINDS}
    result = LoadResult(clients, rss_mib_start=rss_mib(pid))
    rss = [result.rss_mib_start]
    began = time.perf_counter()
    end_at = began + duration

    async def one_client(c: int) -> None:
        pick = random.Random(f"{seed}:{c}")  # this client's prompts, the same every run
        k = start(c, clients, len(order))
        while time.perf_counter() < end_at:
            kind = order[k % len(order)]
            k += 1
            index = pick.randrange(session.prompts.count(kind.source))
            answer = await session.send(kind, index)
            reference = session.references[(kind.source, index)]
            problems = check(kind, answer, reference, session.schema(kind, index))
            stats[kind.name].add(answer, count_problems(problems),
                                 max_logprob_gap(answer, reference))
            if problems:
                result.bad_requests += 1
                for problem in problems:
                    if len(result.examples) < EXAMPLES:
                        result.examples.append(f"{kind.name} prompt {index}: "
                                               f"{problem.category}: {problem.detail}")

    async def sample_memory() -> None:
        while time.perf_counter() < end_at:
            rss.append(rss_mib(pid))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample_memory(), *(one_client(c) for c in range(clients)))
    result.seconds = time.perf_counter() - began
    result.kinds = [s.finish() for s in stats.values()]
    for k in result.kinds:
        result.requests += k.requests
        result.completion_tokens += k.completion_tokens
        for category in CATEGORIES:
            result.problems[category] += k.problems[category]
    result.tokens_per_s = result.completion_tokens / result.seconds
    result.requests_per_s = result.requests / result.seconds
    result.rss_mib_end = rss_mib(pid)
    result.rss_mib_max = max(rss + [result.rss_mib_end])
    return result


def compare_metrics(text: str, tally: Tally) -> MetricsResult:
    """``/metrics``' text against the clients' counts (see
    :class:`~selfspec.bench.serve_load.report.MetricsResult`)."""
    from prometheus_client.parser import text_string_to_metric_families

    tokens = 0.0
    http: Counter = Counter()
    finished: Counter = Counter()
    as_client = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "selfspec_generation_tokens_total":
                tokens += sample.value
            elif sample.name == "selfspec_http_requests_total":
                http[(sample.labels["endpoint"], int(sample.labels["status"]))] += sample.value
            elif sample.name == "selfspec_requests_finished_total":
                reason = sample.labels["finish_reason"]
                finished[as_client.get(reason, reason)] += sample.value
    result = MetricsResult([CountCheck("selfspec_generation_tokens_total (sum over methods)",
                                       tokens, tally.generation_tokens)])
    for endpoint, status in sorted(set(http) | set(tally.http)):
        result.checks.append(CountCheck(
            f'selfspec_http_requests_total{{endpoint="{endpoint}",status="{status}"}}',
            http[(endpoint, status)], tally.http[(endpoint, status)]))
    for reason in sorted(set(finished) | set(tally.finished)):
        result.checks.append(CountCheck(
            f'selfspec_requests_finished_total as finish_reason "{reason}" (choices)',
            finished[reason], tally.finished[reason]))
    return result


async def run(args: argparse.Namespace, port: int, server: subprocess.Popen, tally: Tally,
              result: MixedResult) -> None:
    """The three phases (module docstring) against the started ``server``, into ``result``."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="load-test",
                                max_retries=0, timeout=600)
    models = await client.models.list()
    tally.response("/v1/models", 200)
    result.model = models.data[0].id
    session = Session(client, result.model, Prompts.first(args.prompts),
                      Limits(args.max_tokens, args.json_max_tokens), method_body(args.method),
                      tally)
    problems = await take_references(session)
    result.references = len(session.references)
    if problems:
        result.failures.extend(problems)
        return
    _say(f"{result.references} references taken; {args.clients} clients for "
         f"{args.duration:g} s")
    result.load = await load_phase(session, args.clients, args.duration, args.seed, server.pid)
    load = result.load
    _say(f"load: {load.requests} requests, {load.tokens_per_s:.1f} tok/s, "
         f"{load.bad_requests} with problems")
    status, text = await asyncio.to_thread(http_get, port, "/metrics")
    if status != 200:
        result.failures.append(f"GET /metrics answered {status}")
        return
    result.metrics = compare_metrics(text, tally)
    tally.response("/metrics", 200)
    _say(f"metrics equal to the clients' counts: {result.metrics.equal}")
    result.drain = await drain_phase(session, server, port, args.clients, args.seed,
                                     args.drain_seconds, args.exit_margin)
    d = result.drain
    _say(f"drain: {d.in_flight} in flight, {d.completed} completed, {d.failed} failed, last "
         f"done {d.drain_s:.2f} s after SIGTERM; exit {d.exit_code} after "
         f"{'-' if d.exit_s is None else f'{d.exit_s:.2f}'} s")


def _say(text: str) -> None:
    print(f"[serve-mix {time.strftime('%H:%M:%S')}] {text}", flush=True)


# --------------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``selfspec bench serve-mix`` to ``parser``. ``--clients`` and
    ``--prompts`` (>= 1) and ``--duration`` (> 0) are checked as they are parsed."""
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a registry name, a local model directory or a hub id")
    add_dtype_argument(parser, choices=weight_dtypes(), help="the server's --dtype (default bf16)")
    parser.add_argument("--method", default="auto", help="the method every request names")
    parser.add_argument("--clients", type=int_arg(1), default=16)
    parser.add_argument("--duration", type=float_arg(0.0, low_open=True), default=600.0,
                        help="seconds of load before the signal (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="the kinds' rotation and prompts")
    parser.add_argument("--prompts", type=int_arg(1), default=8,
                        help="prompts per source (chat, completion, JSON; there are 8, 8 and 4): "
                             "more make a row that got another's tokens likelier to show, "
                             "each costs a lone reference request first (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-max-tokens", type=int, default=160)
    parser.add_argument("--max-batch", type=int, default=16)
    add_threads_argument(parser, help="the server's --threads (default: every core)",
                         default=os.cpu_count() or 1)
    parser.add_argument("--drain-seconds", type=float, default=30.0,
                        help="the server's --drain-seconds (default 30)")
    parser.add_argument("--exit-margin", type=float, default=20.0,
                        help="seconds the server may take to exit after the drain bound "
                             "(ending requests, flushing; default 20)")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new out/bench/serve-mix-MODEL-TIME)")


def preflight(args: argparse.Namespace) -> list[str]:
    """What would stop the run, found before anything starts: packages, the model, disk,
    the port."""
    found = []
    for module, why in NEEDS.items():
        try:
            __import__(module)
        except ImportError:
            found.append(f"{module} is missing ({why}): pip install -e '.[test]'")
    problem = model_problem(args.model, args.dtype)
    if problem:
        found.append(problem)
    out = Path(args.out or OUTPUT_ROOT).resolve()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if shutil.disk_usage(existing).free < 1 << 30:
        found.append(f"less than 1 GiB free on {existing}")
    if args.port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", args.port))
            except OSError as error:
                found.append(f"port {args.port} is not free: {error}")
    return found


def start_server(args: argparse.Namespace, port: int, log: Any) -> subprocess.Popen:
    """``selfspec serve`` as the run needs it, its output into ``log``."""
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--model", args.model,
               "--dtype", args.dtype, "--port", str(port), "--method", args.method,
               "--max-batch", str(args.max_batch), "--max-queue", "256", "--threads",
               str(args.threads), "--drain-seconds", f"{args.drain_seconds:g}",
               "--max-tokens", str(max(args.max_tokens, args.json_max_tokens))]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(server: subprocess.Popen, port: int, tally: Tally, timeout: float) -> str | None:
    """Wait for ``GET /health``'s 200 (counted in ``tally``); why not, or ``None``."""
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            return f"the server exited with status {server.returncode}; see server.log"
        status, _ = http_get(port, "/health", timeout=2)
        if status is not None:
            tally.response("/health", status)
            if status == 200:
                return None
        if time.monotonic() > deadline:
            return f"the server did not start in {timeout:g} s"
        time.sleep(0.2)


def run_mixed(args: argparse.Namespace) -> int:
    """Run the mixed load test with the flags of :func:`add_arguments`; exit status 0
    passed, 1 failed, 2 could not run (the reasons on stderr)."""
    problems = preflight(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    out = output_folder(args.out, "serve-mix", args.model)
    args.out = str(out)
    port = args.port or free_port()
    tally = Tally()
    result = MixedResult(args=vars(args), date=datetime.datetime.now().isoformat(
        timespec="seconds"), machine=machine_info())
    with open(out / "server.log", "w") as log:
        server = start_server(args, port, log)
        try:
            why = wait_ready(server, port, tally, args.start_timeout)
            if why is not None:
                print(f"error: {why}", file=sys.stderr)
                return 2
            _say(f"server ready on port {port}")
            asyncio.run(run(args, port, server, tally, result))
        finally:
            if server.poll() is None:  # the drain phase did not end it
                server.kill()
                server.wait()
    result.machine["load_end"] = load_average()
    result.server_tracebacks = (out / "server.log").read_text(errors="replace").count(
        "Traceback")
    result.judge()
    write_report(result, out, command_line("serve-mix", args))
    print(f"wrote {out}/README.md, mixed.json, server.log: "
          f"{'passed' if result.passed else 'FAILED: ' + '; '.join(result.failures)}")
    return 0 if result.passed else 1


def machine_info() -> dict[str, Any]:
    """bench's description of the machine (:func:`selfspec.bench.report.collect_machine_info`)
    and the load average at the start (``load_start``; ``load_end`` is added at the end)."""
    from selfspec.bench.report import collect_machine_info

    return {**dataclasses.asdict(collect_machine_info()), "load_start": load_average()}
