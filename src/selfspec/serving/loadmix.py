"""Mixed load test of ``selfspec serve`` (issue 64), ending with SIGTERM (not a unit test).

Starts a server process and, in order:

1. takes a reference for every prompt: its greedy answer to a lone request (with log
   probabilities, so that token lists can be compared);
2. runs ``--clients`` clients for ``--duration`` seconds, each sending greedy requests back
   to back, picking kinds (:mod:`selfspec.serving.loadkinds`: free-text chat streamed and
   not, JSON schema streamed and not, completions with ``logprobs``, chat with
   ``top_logprobs``, ``n = 2``) in a fixed seeded rotation; every answer is checked against
   its reference (none failed, mixed up, truncated; JSON valid; logprobs shaped);
3. scrapes ``/metrics`` (``prometheus_client.parser``) and compares generated tokens, HTTP
   responses per endpoint and status, and finished choices per reason with the clients'
   own counts: they must be equal;
4. sends one more request per client, SIGTERMs the server while they are in flight, and
   keeps sending: the in-flight ones must finish normally (or, past ``--drain-seconds``,
   end with a ``shutting_down`` error), the later ones get a 503 or no connection, and the
   process exits 0 within the bound plus ``--exit-margin``.

Writes ``mixed.json``, ``README.md`` and ``server.log`` into ``--out``; exit status 0 when
everything held, 1 when something did not, 2 when the run could not start::

    python -m selfspec.serving.loadmix --model smollm2-135m-instruct --clients 16 \\
        --duration 600 --threads 2 --out docs/results/serve-load-2026-12-01

(also ``python -m selfspec.serving.loadtest --mixed ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.cli_args import threads_arg
from selfspec.serving.loadkinds import (
    CATEGORIES,
    KINDS,
    Answer,
    Limits,
    Prompts,
    RequestKind,
    StreamReader,
    check,
    count_problems,
    max_logprob_gap,
    read_body,
    request_params,
    rotation,
    start,
)
from selfspec.serving.loadreport import (
    CountCheck,
    DrainResult,
    KindResult,
    LoadResult,
    MetricsResult,
    MixedResult,
    write_report,
)
from selfspec.serving.loadtest import free_port, method_body, rss_mib

#: Packages the run needs (module: why), checked before anything starts.
NEEDS = {"openai": "the clients", "fastapi": "the server", "uvicorn": "the server",
         "prometheus_client": "/metrics and its parser", "llguidance": "json_schema",
         "jsonschema": "validating JSON answers"}
#: Problems quoted in the report (the counts cover them all).
EXAMPLES = 20
#: uvicorn looks at a received signal at its next tick (every 0.1 s): requests sent later
#: than this after the signal must be refused.
SIGNAL_SETTLE_S = 0.2
#: How often a client sends a request after the signal, seconds.
LATE_INTERVAL_S = 0.25
#: Before the signal: how long to wait for the scheduler to hold every last request, seconds.
IN_FLIGHT_WAIT_S = 10.0
#: A request ended at the drain bound must end no earlier than this before it, seconds.
BOUND_SLACK_S = 0.5


# --------------------------------------------------------------------------- clients
@dataclass
class Tally:
    """What the clients counted themselves, to compare with ``/metrics``.

    Attributes:
        http: responses received, by ``(endpoint, status)``.
        generation_tokens: ``usage.completion_tokens`` of every answer, summed.
        finished: choices received with a ``finish_reason``, by reason.
    """

    http: Counter = field(default_factory=Counter)
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)

    def response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response."""
        self.http[(endpoint, status)] += 1

    def answered(self, answer: Answer) -> None:
        """Count an answer's tokens and finished choices."""
        if answer.status == 200:
            self.generation_tokens += answer.completion_tokens or 0
            for choice in answer.choices.values():
                if choice.finish_reason is not None:
                    self.finished[choice.finish_reason] += 1


class Session:
    """The clients' connection to the server and what they share.

    Args:
        client: an ``openai.AsyncOpenAI`` client (no retries).
        model: the served model's name.
        prompts / limits: what the kinds ask.
        selfspec: each request's ``selfspec`` field (method and options).
        tally: where every response is counted.
    """

    def __init__(self, client: Any, model: str, prompts: Prompts, limits: Limits,
                 selfspec: dict, tally: Tally) -> None:
        self.client = client
        self.model = model
        self.prompts = prompts
        self.limits = limits
        self.selfspec = selfspec
        self.tally = tally
        self.references: dict[tuple[str, int], Answer] = {}

    def schema(self, kind: RequestKind, index: int) -> dict | None:
        """The JSON schema of a json kind's prompt, else ``None``."""
        return self.prompts.json[index].schema if kind.source == "json" else None

    async def send(self, kind: RequestKind, index: int, logprobs: bool | None = None) -> Answer:
        """Send ``kind`` on prompt ``index`` and read its whole answer (raw: a stream's
        lines as sent, so that a missing ``[DONE]`` shows), counting it in the tally."""
        import openai

        params = request_params(kind, self.prompts, index, self.model, self.limits,
                                self.selfspec, logprobs)
        resource = self.client.chat.completions if kind.chat else self.client.completions
        started = time.perf_counter()
        reader = StreamReader(kind.chat, started, time.perf_counter)
        answer = reader.answer
        try:
            async with resource.with_streaming_response.create(**params) as response:
                self.tally.response(kind.endpoint, response.status_code)
                answer.status = response.status_code
                if kind.stream:
                    async for line in response.iter_lines():
                        reader.feed(line)
                else:
                    answer = read_body(await response.json(), kind.chat, response.status_code)
        except openai.APIStatusError as error:
            self.tally.response(kind.endpoint, error.status_code)
            answer = Answer(status=error.status_code)
            body = error.body
            answer.set_error(body if isinstance(body, dict) and "error" in body
                             else {"error": body} if isinstance(body, dict) else str(error))
        except openai.APIConnectionError as error:  # refused, or cut before a response
            answer.error = f"{type(error).__name__}: {error.__cause__ or error}"[:300]
        except Exception as error:  # noqa: BLE001 - a stream cut midway: reported
            answer.done = False
            answer.error = f"{type(error).__name__}: {error}"[:300]
        answer.seconds = time.perf_counter() - started
        self.tally.answered(answer)
        return answer


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


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int | None, str]:
    """``GET path``: the status and the body's text; ``None`` when no answer came."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (OSError, urllib.error.URLError):
        return None, ""


def compare_metrics(text: str, tally: Tally) -> MetricsResult:
    """``/metrics``' text against the clients' counts (see
    :class:`~selfspec.serving.loadreport.MetricsResult`)."""
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


async def drain_phase(session: Session, server: subprocess.Popen, port: int, clients: int,
                      seed: int, bound: float, margin: float) -> DrainResult:
    """One request per client, SIGTERM once the scheduler holds them, then requests until
    the server is gone (see the module docstring)."""
    result = DrainResult(bound_s=bound, margin_s=margin)
    order = rotation(seed + 1)
    picks = [random.Random(f"{seed}:drain:{c}") for c in range(clients)]
    signalled = asyncio.Event()
    signal_at = 0.0
    answered = [False] * clients  # each client's request sent before the signal
    ends: list[float] = []

    def next_request(c: int, k: int) -> tuple[RequestKind, int]:
        kind = order[(start(c, clients, len(order)) + k) % len(order)]
        return kind, picks[c].randrange(session.prompts.count(kind.source))

    async def one_client(c: int) -> None:
        kind, index = next_request(c, 0)
        answer = await session.send(kind, index)
        answered[c] = True
        done_at = time.perf_counter()
        after = None
        if signalled.is_set():
            ends.append(done_at)
            after = done_at - signal_at
        _judge_in_flight(result, kind, index, answer, session, after)
        await signalled.wait()
        await asyncio.sleep(max(0.0, signal_at + SIGNAL_SETTLE_S - time.perf_counter()))
        k = 1
        while server.poll() is None and time.perf_counter() < signal_at + bound + margin:
            kind, index = next_request(c, k)
            k += 1
            answer = await session.send(kind, index)
            result.late_sent += 1
            if answer.status == 503 and answer.error_code == "shutting_down":
                result.late_503 += 1
            elif answer.status is None:
                result.late_refused += 1
                break  # the socket is closed: the server is leaving
            elif answer.status == 200:
                result.late_accepted += 1
                _example(result, f"late {kind.name}: served after the signal")
            else:
                result.late_other += 1
                _example(result, f"late {kind.name}: status {answer.status}, {answer.error}")
            await asyncio.sleep(LATE_INTERVAL_S)

    tasks = [asyncio.create_task(one_client(c)) for c in range(clients)]
    result.sent = clients
    rows = sum(next_request(c, 0)[0].n for c in range(clients))
    wait_until = time.perf_counter() + IN_FLIGHT_WAIT_S
    while time.perf_counter() < wait_until and not all(answered):
        if await asyncio.to_thread(_scheduler_rows, port) >= rows:
            break
        await asyncio.sleep(0.05)
    signal_at = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    signalled.set()
    result.in_flight = answered.count(False)
    try:
        result.exit_code = await asyncio.to_thread(server.wait, bound + margin)
        result.exit_s = time.perf_counter() - signal_at
    except subprocess.TimeoutExpired:
        result.exit_code = None
    await asyncio.gather(*tasks)
    result.drain_s = max(ends, default=signal_at) - signal_at
    return result


def _scheduler_rows(port: int) -> int:
    """Rows the server's scheduler holds (running and waiting), from ``/health``; -1 when
    it does not say."""
    status, body = http_get(port, "/health")
    if status != 200:
        return -1
    health = json.loads(body)
    return health["running"] + health["waiting"]


def _judge_in_flight(result: DrainResult, kind: RequestKind, index: int, answer: Answer,
                     session: Session, after_signal: float | None) -> None:
    """Count a request that was sent before the signal."""
    if answer.finished_normally:
        problems = check(kind, answer, session.references[(kind.source, index)],
                         session.schema(kind, index))
        if not problems:
            result.completed += 1
            return
        detail = "; ".join(f"{p.category}: {p.detail}" for p in problems)
    elif answer.error_code == "shutting_down" and after_signal is not None \
            and after_signal >= result.bound_s - BOUND_SLACK_S \
            and (answer.status == 503 or (answer.status == 200 and answer.done)):
        result.ended_at_bound += 1  # past the bound: an error event and [DONE], or a 503
        return
    else:
        detail = (f"status {answer.status}, error {answer.error!r}, [DONE] {answer.done}, "
                  f"finish reasons {[c.finish_reason for c in answer.choices.values()]}, "
                  f"ended {after_signal} s after the signal")
    result.failed += 1
    _example(result, f"in flight {kind.name} prompt {index}: {detail}")


def _example(result: DrainResult, text: str) -> None:
    if len(result.examples) < EXAMPLES:
        result.examples.append(text)


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
         f"done {d.drain_s:.2f} s after SIGTERM; exit {d.exit_code} after {d.exit_s} s")


def _say(text: str) -> None:
    print(f"[loadmix {time.strftime('%H:%M:%S')}] {text}", flush=True)


# --------------------------------------------------------------------------- the command
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a registry name, a local model directory or a hub id")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--method", default="auto", help="the method every request names")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of load before the signal (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="the kinds' rotation and prompts")
    parser.add_argument("--prompts", type=int, default=4,
                        help="prompts per source (chat, completion, JSON), at most 8, 8, 4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-max-tokens", type=int, default=160)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=threads_arg(), default=os.cpu_count() or 1)
    parser.add_argument("--drain-seconds", type=float, default=30.0,
                        help="the server's --drain-seconds (default 30)")
    parser.add_argument("--exit-margin", type=float, default=20.0,
                        help="seconds the server may take to exit after the drain bound "
                             "(ending requests, flushing; default 20)")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=f"docs/results/serve-load-{today}")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.prompts < 1:
        parser.error("--clients and --prompts must be >= 1 and --duration > 0")
    return args


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
    out = Path(args.out).resolve()
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


def model_problem(model: str, dtype: str) -> str | None:
    """Why ``model`` cannot be served without a download, or ``None``. A registry model
    needs its cache entry (in ``dtype``, or float32 to cast); a directory its
    ``config.json``; a hub id is left to the server."""
    from selfspec.errors import SelfSpecError
    from selfspec.models.provision import is_cached
    from selfspec.models.resolve import resolve

    try:
        source = resolve(model)
        if source.kind == "registry" and not (is_cached(model, dtype)
                                              or is_cached(model, "fp32")):
            return (f"{model} is not in the model cache ($SELFSPEC_HOME): run "
                    f"`selfspec models fetch {model}` first")
    except SelfSpecError as error:
        return str(error)
    if source.kind == "directory" and not (Path(model) / "config.json").is_file():
        return f"{model} has no config.json"
    return None


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


def machine(load: str = "load_start") -> dict[str, Any]:
    """What the figures depend on: CPUs, the load average, versions."""
    import torch

    return {"cpus": os.cpu_count(), load: _load_average(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the mixed load test; exit status 0 passed, 1 failed, 2 could not run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    problems = preflight(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    tally = Tally()
    result = MixedResult(args=vars(args), date=datetime.datetime.now().isoformat(
        timespec="seconds"), machine=machine())
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
    result.machine["load_end"] = _load_average()
    result.server_tracebacks = (out / "server.log").read_text(errors="replace").count(
        "Traceback")
    result.judge()
    command = "python -m selfspec.serving.loadmix " + shlex.join(argv)
    write_report(result, out, command)
    print(f"wrote {out}/README.md, mixed.json, server.log: "
          f"{'passed' if result.passed else 'FAILED: ' + '; '.join(result.failures)}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
