"""What ``selfspec serve`` exports for Prometheus (``GET /metrics``, text format) and the
acceptance summary each response carries in ``usage.selfspec``.

Every metric lives in the app's own :class:`ServerMetrics` registry (never the process-wide
default one: two apps in one process count apart). Names follow Prometheus conventions
(counters end in ``_total``, durations are ``_seconds``); the speculative-decoding counters
mirror vLLM's ``vllm:spec_decode_*``. Labels take bounded values only: ``method`` is a
registered method name (anything else is counted as ``"other"``; the server refuses unknown
methods with a 400 before they reach the scheduler), ``endpoint`` a route of the app (any
other path is ``"other"``), ``status`` an HTTP status code, ``drafter`` a drafter name from
the code (``ar``, ``ngram``, the model drafters), ``position`` ``0 .. max_position - 1``
(later draft positions count under ``"<max_position>+"``), ``finish_reason`` one of the
loop's reasons, ``cancelled`` or ``error``.

HTTP:

- ``selfspec_http_requests_total{endpoint, status}``: responses sent, error bodies (400,
  401, 404, 413, 429, 500) included; a stream counts once, with the status it started with.

Scheduler (current values, read at scrape time):

- ``selfspec_requests_running``: rows being decoded.
- ``selfspec_requests_waiting``: requests queued for a row.
- ``selfspec_prefix_cache_bytes`` / ``selfspec_prefix_cache_budget_bytes`` /
  ``selfspec_prefix_cache_evicted_blocks``: the prefix cache's KV kept now, its budget, and
  the blocks it dropped since it started (0 without ``--prefix-cache-mib``).

Requests, by ``method`` (measured on the worker thread; a request's clock starts when it is
queued):

- ``selfspec_requests_finished_total{method, finish_reason}``: rows that left the
  scheduler (a request of ``n`` choices counts ``n``); ``cancelled``: the client left,
  while the row decoded or while it still waited for one.
- ``selfspec_prompt_tokens_total{method}``: prompt tokens of the requests that got a first
  token (prefilled), once per request whatever its ``n`` (its ``usage.prompt_tokens``).
- ``selfspec_generation_tokens_total{method}``: tokens generated (the sum of the
  responses' ``usage.completion_tokens``, plus what cancelled or failed requests generated).
- ``selfspec_prompt_cached_tokens_total{method}``: of those, the tokens whose KV came from
  the prefix cache (``--prefix-cache-mib``) instead of a prefill (per request: its
  choices' largest, as ``usage.prompt_tokens_details.cached_tokens``).
- ``selfspec_time_to_first_token_seconds{method}``: queued → first token committed.
- ``selfspec_time_per_output_token_seconds{method}``: per request of >= 2 tokens, (last
  token − first token) / (tokens − 1); speculative steps commit several tokens at once, so
  this mean, not the gap between commits, is the decode speed a client sees.
- ``selfspec_e2e_request_latency_seconds{method}``: queued → finished, requests that
  finished (not cancelled, not failed).

Speculative decoding, by ``method``, summed over the scheduler's steps (the prefill's first
token is no step):

- ``selfspec_spec_decode_steps_total``: Step calls, one per row and iteration.
- ``selfspec_spec_decode_num_drafts_total``: steps that drafted >= 1 token.
- ``selfspec_spec_decode_num_draft_tokens_total`` / ``..._num_accepted_tokens_total``:
  draft tokens proposed / accepted by verification (acceptance rate = accepted / draft).
- ``selfspec_spec_decode_verifications_total``: verification forwards (mean accepted
  tokens = (accepted + verifications) / verifications, as in the glossary).
- ``selfspec_spec_decode_num_draft_tokens_per_pos_total{position}`` /
  ``..._num_accepted_tokens_per_pos_total{position}``: how often the draft token at
  ``position`` (0-based) was drafted / accepted; summed over positions they equal the two
  totals above.
- ``selfspec_spec_decode_drafter_steps_total{drafter}``: steps by the drafter that ran,
  for methods that choose one per step (``auto``: its choices; ``ngram`` reports ``ar`` for
  a step without a match).

Plus the serving process's own ``process_*`` metrics (CPU seconds, resident memory, open
files) where the platform has them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from selfspec.decoding.core.stats import GenerationStats, StepStats
from selfspec.errors import InvalidArgumentError, MissingDependencyError
from selfspec.methods.registry import METHODS
from selfspec.serving.scheduler import CancelledRequest

if TYPE_CHECKING:
    from selfspec.decoding.core.state import DecodeState
    from selfspec.serving.scheduler import Request, Scheduler

# Buckets (seconds) for CPU decoding: a small model's token takes milliseconds, a 7B model's
# tens to hundreds of ms, and a long prompt's prefill or a long answer tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
                   600.0)

OTHER = "other"


def method_label(method: str) -> str:
    """``method`` if it is a registered method, else ``"other"`` (bounded label values)."""
    return method if method in METHODS else OTHER


def acceptance_usage(method: str, *stats: GenerationStats) -> dict[str, Any]:
    """The ``usage.selfspec`` object of one response: how its draft tokens fared.

    Args:
        method: the method that generated it.
        stats: the finished statistics of its generations (one per choice), summed.

    Returns:
        ``{"method", "steps", "draft_tokens", "accepted_tokens", "verifications",
        "acceptance_rate" (accepted / draft, 0.0 without drafts), "mean_accepted_tokens"
        (tokens per verification, bonus token included; 0.0 without verification)}``, plus
        ``"drafters": {name: steps}`` for a method that chooses a drafter per step.
    """
    steps = sum(s.steps for s in stats)
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    verifications = sum(s.verifications for s in stats)
    out: dict[str, Any] = {
        "method": method, "steps": steps, "draft_tokens": drafted,
        "accepted_tokens": accepted, "verifications": verifications,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_tokens": (round((accepted + verifications) / verifications, 4)
                                 if verifications else 0.0)}
    drafters: dict[str, int] = {}
    for s in stats:
        for name, use in s.drafters.items():
            drafters[name] = drafters.get(name, 0) + use.steps
    if drafters:
        out["drafters"] = dict(sorted(drafters.items()))
    return out


@dataclass
class PromptCount:
    """What the metrics counted of one API request's prompt, shared by its ``n`` rows
    (:attr:`~selfspec.serving.scheduler.Request.group`): its tokens once, its cached tokens
    up to the largest of its choices (what its ``usage`` reports)."""

    counted: bool = False
    cached: int = 0


class ServerMetrics:
    """The server's Prometheus metrics (the module docstring lists them) in a registry of
    its own; the scheduler's :class:`~selfspec.serving.scheduler.SchedulerObserver`.

    Args:
        max_position: draft positions with a label of their own (>= 1); later positions
            count together under ``"<max_position>+"`` so that a client asking for long
            drafts cannot grow the label set.

    Raises:
        MissingDependencyError: ``prometheus-client`` is not installed.
        InvalidArgumentError: ``max_position < 1``.
    """

    def __init__(self, max_position: int = 32) -> None:
        try:
            from prometheus_client import (
                CollectorRegistry,
                Counter,
                Gauge,
                Histogram,
                ProcessCollector,
            )
        except ImportError as error:
            raise MissingDependencyError(
                "selfspec serve's /metrics needs prometheus-client: "
                "pip install 'selfspec[serve]'") from error
        if max_position < 1:
            raise InvalidArgumentError(f"max_position must be >= 1; got {max_position}")
        self.max_position = max_position
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.http_requests = Counter(
            "selfspec_http_requests", "HTTP responses sent, by route and status",
            ["endpoint", "status"], registry=r)
        self.running = Gauge("selfspec_requests_running", "rows being decoded", registry=r)
        self.waiting = Gauge("selfspec_requests_waiting", "requests queued for a row",
                             registry=r)
        self.cache_bytes = Gauge("selfspec_prefix_cache_bytes", "bytes of KV the prefix cache "
                                 "keeps now", registry=r)
        self.cache_budget = Gauge("selfspec_prefix_cache_budget_bytes",
                                  "the prefix cache's byte budget", registry=r)
        self.cache_evicted = Gauge("selfspec_prefix_cache_evicted_blocks",
                                   "blocks the prefix cache dropped since it started",
                                   registry=r)
        self.finished = Counter(
            "selfspec_requests_finished", "requests that left the scheduler, by finish reason",
            ["method", "finish_reason"], registry=r)
        self.cached_tokens = Counter(
            "selfspec_prompt_cached_tokens", "prompt tokens whose KV came from the prefix cache",
            ["method"], registry=self.registry)
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "prompt tokens prefilled",
                                     ["method"], registry=r)
        self.generation_tokens = Counter("selfspec_generation_tokens", "tokens generated",
                                         ["method"], registry=r)
        self.ttft = Histogram(
            "selfspec_time_to_first_token_seconds", "queued to first token, seconds",
            ["method"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "selfspec_time_per_output_token_seconds",
            "per request: (last token - first token) / (tokens - 1), seconds",
            ["method"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "selfspec_e2e_request_latency_seconds", "queued to finished, seconds",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("selfspec_spec_decode_steps", "decoding steps (one row each)",
                             ["method"], registry=r)
        self.num_drafts = Counter("selfspec_spec_decode_num_drafts",
                                  "steps that drafted at least one token", ["method"],
                                  registry=r)
        self.draft_tokens = Counter("selfspec_spec_decode_num_draft_tokens",
                                    "draft tokens proposed", ["method"], registry=r)
        self.accepted_tokens = Counter("selfspec_spec_decode_num_accepted_tokens",
                                       "draft tokens accepted", ["method"], registry=r)
        self.verifications = Counter("selfspec_spec_decode_verifications",
                                     "verification forwards", ["method"], registry=r)
        self.draft_per_pos = Counter(
            "selfspec_spec_decode_num_draft_tokens_per_pos",
            "draft tokens proposed at each draft position", ["method", "position"], registry=r)
        self.accepted_per_pos = Counter(
            "selfspec_spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each draft position", ["method", "position"], registry=r)
        self.drafter_steps = Counter(
            "selfspec_spec_decode_drafter_steps",
            "steps by the drafter that ran (methods that choose one per step)",
            ["method", "drafter"], registry=r)
        self._positions = [str(k) for k in range(max_position)] + [f"{max_position}+"]
        self._children: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ scrape
    def watch(self, scheduler: Scheduler) -> None:
        """Read ``scheduler``'s running rows and queue at each scrape."""
        self.running.set_function(lambda: scheduler.running)
        self.waiting.set_function(lambda: scheduler.waiting)
        cache = getattr(scheduler.engine, "prefix_cache", None)
        if cache is not None:
            self.cache_bytes.set_function(lambda: cache.bytes)
            self.cache_budget.set_function(lambda: cache.budget_bytes)
            self.cache_evicted.set_function(lambda: cache.stats.evicted_blocks)

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (``content_type``)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    @property
    def content_type(self) -> str:
        """The media type of :meth:`render`'s text."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ HTTP
    def response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response (``endpoint``: a route path or ``"other"``)."""
        self.http_requests.labels(endpoint, str(status)).inc()

    # ------------------------------------------------------------------ scheduler
    def on_submit(self, request: Request) -> None:
        """Start ``request``'s clock and wrap its ``on_tokens`` / ``on_done`` to count its
        tokens and time it. The wrappers run on the worker thread and count before they call
        the request's own callbacks, so no client sees a response the metrics miss."""
        method = method_label(request.method)
        generation_tokens = self.generation_tokens.labels(method)  # once, not per commit
        queued = time.perf_counter()
        first: float | None = None
        last = queued
        generated = 0
        on_tokens, on_done = request.on_tokens, request.on_done
        # The choices of one API request share its group: their one prompt counts once.
        group = request.group if request.group is not None else PromptCount()

        def tokens(ids: list[int]) -> None:
            nonlocal first, last, generated
            last = time.perf_counter()
            if first is None:
                first = last
                self._count_prompt(method, group, request)
                self.ttft.labels(method).observe(first - queued)
            generated += len(ids)
            generation_tokens.inc(len(ids))
            on_tokens(ids)

        def done(state: DecodeState | None, text: str, error: BaseException | None) -> None:
            if isinstance(error, CancelledRequest):
                reason = "cancelled"
            else:
                reason = "error" if error is not None or state is None else (
                    state.finish_reason or "length")
            self.finished.labels(method, reason).inc()
            if reason not in ("error", "cancelled"):
                self.e2e.labels(method).observe(time.perf_counter() - queued)
                if first is not None and generated >= 2:
                    self.tpot.labels(method).observe((last - first) / (generated - 1))
            on_done(state, text, error)

        request.on_tokens, request.on_done = tokens, done

    def _count_prompt(self, method: str, group: PromptCount, request: Request) -> None:
        """A row's first token: its request's prompt tokens unless a sibling counted them,
        and the cached ones up to the largest of its choices (worker thread only)."""
        if not group.counted:
            group.counted = True
            self.prompt_tokens.labels(method).inc(len(request.prompt_ids))
        cached = request.state.stats.cached_tokens if request.state is not None else 0
        if cached > group.cached:
            self.cached_tokens.labels(method).inc(cached - group.cached)
            group.cached = cached

    def on_step(self, method: str, stats: StepStats) -> None:
        """Count one row's step."""
        child = self._child
        method = method_label(method)
        child(self.steps, method).inc()
        if stats.num_drafted:
            child(self.num_drafts, method).inc()
            child(self.draft_tokens, method).inc(stats.num_drafted)
            child(self.accepted_tokens, method).inc(stats.num_accepted)
            self._per_position(self.draft_per_pos, method, stats.num_drafted)
            self._per_position(self.accepted_per_pos, method, stats.num_accepted)
        if stats.verified:
            child(self.verifications, method).inc()
        if stats.drafter:
            child(self.drafter_steps, method, stats.drafter).inc()

    def _per_position(self, counter: Any, method: str, count: int) -> None:
        # positions 0 .. count-1 each once; those past max_position fold into the last label
        for k in range(min(count, self.max_position)):
            self._child(counter, method, self._positions[k]).inc()
        if count > self.max_position:
            self._child(counter, method, self._positions[-1]).inc(count - self.max_position)

    def _child(self, metric: Any, *labels: str) -> Any:
        # metric.labels() takes a lock and checks the values at every call, and on_step runs
        # for every row at every step (~20 calls): look each labelled child up once
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


class HttpMetrics:
    """ASGI middleware counting every HTTP response with
    :meth:`ServerMetrics.response` when it starts (so it is counted before the client
    has it). An exception that escapes the app before a response started is counted as the
    500 the server's error handler answers.

    Args:
        app: the ASGI app it wraps.
        metrics: where to count.
        routes: the app's routes (read at each request: routes added later count too); a
            path that is none of theirs is counted as ``"other"``.
    """

    def __init__(self, app: Any, metrics: ServerMetrics, routes: Sequence[Any]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _endpoint(self, path: str) -> str:
        return path if any(getattr(r, "path", None) == path for r in self.routes) else OTHER

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.response(self._endpoint(scope["path"]), message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:  # not a cancellation: the server answers nothing for that
            if not started:
                self.metrics.response(self._endpoint(scope["path"]), 500)
            raise
