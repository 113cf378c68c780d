"""The results of the mixed load test (:mod:`selfspec.bench.serve_load.mix`) and its report:
``mixed.json`` (everything) and ``README.md`` (the figures and the verdict) in the output
directory."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from selfspec.bench.serve_load.kinds import CATEGORIES


@dataclass
class KindResult:
    """The requests of one kind during the load.

    Attributes:
        name: the kind.
        requests: responses received (whatever their outcome).
        choices: choices received.
        completion_tokens: their ``usage.completion_tokens``, summed.
        problems: responses' problems by category
        (:data:`~selfspec.bench.serve_load.kinds.CATEGORIES`).
        latency_ms_median / latency_ms_p90: sending to the end of the answer.
        ttft_ms_median: streams: sending to the first text.
        max_logprob_gap: the largest difference of a token's log probability from the
            reference's (batching moves the values a little; informational).
    """

    name: str
    requests: int = 0
    choices: int = 0
    completion_tokens: int = 0
    problems: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    latency_ms_median: float = 0.0
    latency_ms_p90: float = 0.0
    ttft_ms_median: float | None = None
    max_logprob_gap: float = 0.0


@dataclass
class LoadResult:
    """The load phase: ``clients`` clients sending back to back for ``seconds``.

    Attributes:
        requests / completion_tokens: over all kinds.
        tokens_per_s / requests_per_s: aggregate throughput.
        problems: responses' problems by category, over all kinds.
        bad_requests: responses with at least one problem.
        examples: the first problems found, with their kind and prompt.
        rss_mib_start / rss_mib_end / rss_mib_max: the server's resident memory.
    """

    clients: int
    seconds: float = 0.0
    requests: int = 0
    completion_tokens: int = 0
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    problems: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    bad_requests: int = 0
    kinds: list[KindResult] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    rss_mib_start: float = 0.0
    rss_mib_end: float = 0.0
    rss_mib_max: float = 0.0


@dataclass
class CountCheck:
    """One figure of ``/metrics`` and the clients' own count of it."""

    name: str
    server: float
    client: float

    @property
    def equal(self) -> bool:
        """Whether the two counts agree."""
        return self.server == self.client


@dataclass
class MetricsResult:
    """``/metrics`` scraped after the load (before the signal) against the clients' counts:
    ``selfspec_generation_tokens_total`` summed over methods, ``selfspec_http_requests_total``
    per endpoint and status, ``selfspec_requests_finished_total`` per finish reason as a
    client sees it (``eos`` and ``stop`` are ``stop``, ``length`` and ``context`` are
    ``length``)."""

    checks: list[CountCheck] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Every count agrees (and there was something to compare)."""
        return bool(self.checks) and all(c.equal for c in self.checks)


@dataclass
class DrainResult:
    """SIGTERM while requests are in flight.

    Attributes:
        bound_s: the server's ``--drain-seconds``; margin_s: the extra time the process may
            take to exit after it.
        sent: requests sent just before the signal; in_flight: those not finished at the signal.
        completed: finished normally (``finish_reason``, ``[DONE]``) and equal to their reference.
        ended_at_bound: ended with a ``shutting_down`` error event or 503 at the drain bound.
        failed: anything else (listed in ``examples``).
        drain_s: signal to the last of these requests' end.
        late_sent: requests sent after the signal; late_503 (``shutting_down``) and
            late_refused (no connection) are the expected answers, late_accepted (served
            anyway) and late_other are not.
        exit_code: the server's (``None``: it had not exited within bound + margin).
        exit_s: signal to the process's exit.
    """

    bound_s: float
    margin_s: float
    sent: int = 0
    in_flight: int = 0
    completed: int = 0
    ended_at_bound: int = 0
    failed: int = 0
    drain_s: float = 0.0
    late_sent: int = 0
    late_503: int = 0
    late_refused: int = 0
    late_accepted: int = 0
    late_other: int = 0
    exit_code: int | None = None
    exit_s: float | None = None
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Requests were in flight, none failed, every late one was refused, and the process
        exited 0 within the bound and its margin."""
        return (self.in_flight > 0 and self.failed == 0 and self.late_accepted == 0
                and self.late_other == 0 and self.exit_code == 0 and self.exit_s is not None
                and self.exit_s <= self.bound_s + self.margin_s)


@dataclass
class MixedResult:
    """The whole run.

    Attributes:
        args: the command line's arguments.
        date: when it started (ISO 8601, local time).
        machine: bench's :class:`~selfspec.bench.report.MachineInfo` fields (CPU, logical
            cores, versions) and the load averages at the start and the end
            (``load_start``, ``load_end``).
        model: the served model's name.
        references: lone requests taken as references (one per prompt and source).
        load / metrics / drain: the three phases.
        server_tracebacks: ``Traceback`` lines in the server's log.
        failures: why the run failed (empty: it passed).
    """

    args: dict[str, Any]
    date: str
    machine: dict[str, Any]
    model: str = ""
    references: int = 0
    load: LoadResult | None = None
    metrics: MetricsResult | None = None
    drain: DrainResult | None = None
    server_tracebacks: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No failure found."""
        return not self.failures

    def judge(self) -> None:
        """Fill :attr:`failures` from the phases' figures."""
        out = self.failures
        if self.load is not None and self.load.bad_requests:
            out.append(f"{self.load.bad_requests} responses of the load had problems: "
                       f"{_nonzero(self.load.problems)}")
        if self.metrics is not None and not self.metrics.equal:
            out.append("/metrics differs from the clients' counts: " + ", ".join(
                f"{c.name} {c.server:g} vs {c.client:g}" for c in self.metrics.checks
                if not c.equal))
        if self.drain is not None and not self.drain.ok:
            d = self.drain
            out.append(f"drain: {d.in_flight} in flight, {d.failed} failed, "
                       f"{d.late_accepted} late requests served, {d.late_other} late requests "
                       f"answered otherwise, exit code {d.exit_code} after {d.exit_s} s "
                       f"(bound {d.bound_s:g} + {d.margin_s:g} s)")
        if self.server_tracebacks:
            out.append(f"{self.server_tracebacks} tracebacks in the server's log")


def _nonzero(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"


def to_json(result: MixedResult) -> dict[str, Any]:
    """``result`` as JSON-ready data (with the derived verdicts)."""
    data = asdict(result)
    data["passed"] = result.passed
    if result.metrics is not None:
        data["metrics"]["equal"] = result.metrics.equal
    if result.drain is not None:
        data["drain"]["ok"] = result.drain.ok
    return data


def write_report(result: MixedResult, out: Path, command: str) -> None:
    """Write ``mixed.json`` and ``README.md`` into ``out`` (created if needed).

    Args:
        command: the command line that ran, quoted in the README.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed.json").write_text(json.dumps(to_json(result), indent=1) + "\n")
    (out / "README.md").write_text(readme(result, command))


def readme(result: MixedResult, command: str) -> str:
    """The README section of a run: the command, the figures by kind, the metrics against
    the clients' counts, the drain, and the verdict."""
    a, m = result.args, result.machine
    lines = [f"# Mixed load test of `selfspec serve` ({result.date[:10]})", "",
             f"{'**Passed**' if result.passed else '**Failed**'}: "
             + ("no failed, mixed-up or truncated response; /metrics equals the clients' own "
                "counts; SIGTERM drained in bound and the server exited 0."
                if result.passed else "; ".join(result.failures)), "",
             "```bash", command, "```", "",
             f"Model `{result.model}` ({a.get('dtype')}), method `{a.get('method')}`, "
             f"server `--threads {a.get('threads')} --max-batch {a.get('max_batch')} "
             f"--drain-seconds {a.get('drain_seconds'):g}`; {a.get('clients')} clients for "
             f"{a.get('duration'):g} s (seed {a.get('seed')}), max_tokens {a.get('max_tokens')} "
             f"(JSON {a.get('json_max_tokens')}). Machine: {m.get('logical_cores')} CPUs, "
             "load average "
             f"{m.get('load_start')} at the start and {m.get('load_end')} at the end (the "
             f"clients run on the same CPUs), torch {m.get('torch')}, Python {m.get('python')}.",
             "", f"Each kind's answers are compared with the lone answer to the same prompt "
             f"taken before the load ({result.references} references): text, finish reason, "
             "token count and, with logprobs, the tokens; JSON answers are parsed and validated "
             "against their schema (`jsonschema`); logprobs need one entry per completion "
             "token with 2 alternatives; n = 2 needs choices 0 and 1, both equal to the "
             "reference; a stream must end with `data: [DONE]`.", ""]
    load = result.load
    if load is not None:
        lines += ["## Load", "",
                  f"{load.requests} requests in {load.seconds:.0f} s "
                  f"({load.requests_per_s:.2f}/s), {load.completion_tokens} completion tokens "
                  f"({load.tokens_per_s:.1f} tok/s); {load.bad_requests} with problems "
                  f"({_nonzero(load.problems)}). Server RSS {load.rss_mib_start:.0f} → "
                  f"{load.rss_mib_end:.0f} MiB (max {load.rss_mib_max:.0f}).", "",
                  "| kind | requests | choices | completion tokens | failed | truncated | "
                  "mismatched | invalid JSON | bad logprobs | bad choices | latency median / "
                  "p90 ms | TTFT median ms | max logprob gap |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k in load.kinds:
            p = k.problems
            ttft = "" if k.ttft_ms_median is None else f"{k.ttft_ms_median:.0f}"
            lines.append(
                f"| {k.name} | {k.requests} | {k.choices} | {k.completion_tokens} | "
                f"{p['failed']} | {p['truncated']} | {p['mismatched']} | {p['invalid_json']} | "
                f"{p['bad_logprobs']} | {p['bad_choices']} | {k.latency_ms_median:.0f} / "
                f"{k.latency_ms_p90:.0f} | {ttft} | {k.max_logprob_gap:.2g} |")
        if load.examples:
            lines += ["", "First problems:", ""] + [f"- {e}" for e in load.examples]
        lines.append("")
    if result.metrics is not None:
        lines += ["## /metrics against the clients' counts (after the load, before SIGTERM)",
                  "", "| figure | /metrics | clients | equal |", "|---|---|---|---|"]
        lines += [f"| {c.name} | {c.server:g} | {c.client:g} | {'yes' if c.equal else '**no**'} |"
                  for c in result.metrics.checks]
        lines.append("")
    d = result.drain
    if d is not None:
        exit_s = "—" if d.exit_s is None else f"{d.exit_s:.2f} s"
        lines += ["## SIGTERM with requests in flight", "",
                  f"{d.sent} requests sent (one per client), {d.in_flight} still in flight at "
                  f"the signal: {d.completed} completed normally and equal to their reference, "
                  f"{d.ended_at_bound} ended at the drain bound, {d.failed} failed. Last one "
                  f"done {d.drain_s:.2f} s after the signal (bound {d.bound_s:g} s). "
                  f"{d.late_sent} requests sent after the signal: {d.late_503} got a 503 "
                  f"`shutting_down`, {d.late_refused} no connection, {d.late_accepted} were "
                  f"served, {d.late_other} something else. The server exited with status "
                  f"{d.exit_code} {exit_s} after the signal (allowed: {d.bound_s:g} + "
                  f"{d.margin_s:g} s).", ""]
        if d.examples:
            lines += ["Problems:", ""] + [f"- {e}" for e in d.examples] + [""]
    lines += [f"Tracebacks in the server's log (`server.log`): {result.server_tracebacks}.", ""]
    return "\n".join(lines)
