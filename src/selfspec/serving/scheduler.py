"""Continuous batching: requests join the running batch between steps and leave when done.

One worker thread owns the model. Each iteration it (1) drops cancelled rows, (2) admits
the requests that hold a row (prefill alone, first token), and (3) advances every running
row by one step: rows of the same method and options share one
:class:`~selfspec.decoding.core.batch.BatchStep` (one batched forward for ar / ngram / auto; the
other methods run their rows in turn). Committed tokens reach each request's callback as
they come; a finished row calls its ``on_done`` and frees its KV cache.

Rows are held from submission: :meth:`Scheduler.submit` gives a request a row at once when
one of the ``max_batch`` is free (and, with ``max_batch_tokens``, the KV positions it may
reach fit beside the other rows'), else queues it, first come first served; a row that
finishes hands itself to the head of the queue. So at most ``max_batch`` requests run and
``max_queue`` wait, exactly; beyond that :class:`QueueFullError` (the server answers 429)
rather than let waiting requests pile up.

A failure stays with its request where the request can be told: a token callback that
raises ends its own row only, and when a batched step raises the scheduler runs that
step's rows one at a time, so only the rows that fail alone fail (each with its own
``on_done`` error); the others continue with exactly their own tokens.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from selfspec.decoding.core.batch import BatchStep, begin
from selfspec.decoding.core.loop import check_processing
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.stop_strings import StopStringSink
from selfspec.decoding.memory import TenantMemories
from selfspec.errors import InvalidArgumentError, SelfSpecError
from selfspec.methods.registry import get_method
from selfspec.serving.config import ServeConfig

logger = logging.getLogger(__name__)


def _log_failure(error: Exception, message: str, *args: Any) -> None:
    """Log a step's failure: a request's own arguments refused while decoding (an
    :class:`InvalidArgumentError`, e.g. a constraint its tokenizer cannot follow) as a
    warning, anything else (a bug) as an error with its traceback."""
    if isinstance(error, InvalidArgumentError):
        logger.warning(message + ": %s", *args, error)
    else:
        logger.exception(message, *args)


class QueueFullError(SelfSpecError):
    """The scheduler's queue holds ``max_queue`` requests already; retry later."""


class ShutdownError(SelfSpecError):
    """The request was ended because the server is shutting down."""


_LEFT = "the client left before the request started"


class CancelledRequest(SelfSpecError):
    """The request was cancelled (its client left) before it got a row: it ends with this
    error and no state; the metrics count it ``cancelled``."""


@dataclass
class Request:
    """One generation submitted to the :class:`Scheduler`.

    Attributes:
        prompt_ids: the prompt's token ids.
        options: limits and sampling.
        method: a registered method name.
        method_options: its options (validated when the request is admitted).
        stop: stop strings.
        on_tokens: called from the worker thread with each batch of committed token ids.
        on_done: called once from the worker thread with the finished :class:`DecodeState`
            and the text cut at a stop string, or with an exception (``state`` is then
            ``None``).
        cancelled: set it (e.g. the client disconnected) to end the request at the next
            step; ``on_done`` then reports finish reason ``"cancelled"``.
        state: the row's :class:`DecodeState` once admitted (read it from the callbacks,
            which run on the worker thread), else ``None``.
        tenant: whose memory (n-gram history, drafter estimates) the row drafts from and
            adds to; ``None``: the engine's own, shared by every such request.
        group: shared by the rows of one API request (its ``n`` choices; ``None``: a row
            alone), so that the metrics count their one prompt once.
    """

    prompt_ids: list[int]
    options: DecodeOptions
    method: str = "ar"
    method_options: Mapping[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] = lambda tokens: None
    on_done: Callable[[DecodeState | None, str, BaseException | None], None] = (
        lambda state, text, error: None)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: DecodeState | None = None
    tenant: str | None = None
    group: Any = None


@dataclass
class _Row:
    request: Request
    state: DecodeState
    sink: StopStringSink
    key: tuple
    failures: list[BaseException] = field(default_factory=list)  # this row's own errors


class SchedulerObserver(Protocol):
    """What the scheduler reports as it works (the server's metrics,
    :class:`~selfspec.serving.metrics.ServerMetrics`); called from the thread named."""

    def on_submit(self, request: Request) -> None:
        """``request`` was queued (caller's thread); it may wrap the request's callbacks."""

    def on_step(self, method: str, stats: StepStats) -> None:
        """One row of ``method`` made one step (worker thread)."""


class Scheduler:
    """A worker thread running continuous batching over one engine.

    Args:
        engine: a loaded :class:`selfspec.SelfSpec`.
        max_batch: rows decoded together at most (>= 1).
        max_queue: requests waiting for a row at most (>= 0); more are refused.
        max_batch_tokens: KV positions the running rows may reach together at most (each
            row: its prompt + ``max_new_tokens``, capped by the model's context), or
            ``None``: no bound but ``max_batch``.
        observer: told of each queued request and each row's step (``None``: nobody).
        max_tenants: tenants' memories kept (:class:`TenantMemories`, least recently used
            dropped).

    The bounds' defaults are :class:`~selfspec.serving.config.ServeConfig`'s.

    Raises:
        InvalidArgumentError: bounds below their minimum.
    """

    def __init__(self, engine: Any, max_batch: int = ServeConfig.max_batch,
                 max_queue: int = ServeConfig.max_queue,
                 max_batch_tokens: int | None = ServeConfig.max_batch_tokens,
                 observer: SchedulerObserver | None = None,
                 max_tenants: int = ServeConfig.max_tenants) -> None:
        if max_batch < 1 or max_queue < 0 or (max_batch_tokens is not None
                                               and max_batch_tokens < 1):
            raise InvalidArgumentError(
                f"max_batch and max_batch_tokens must be >= 1 and max_queue >= 0; got "
                f"{max_batch}, {max_batch_tokens}, {max_queue}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.observer = observer
        self.tenants = TenantMemories(max_tenants)
        self._queue: deque[Request] = deque()  # waiting for a row
        self._ready: deque[Request] = deque()  # holding a row, not admitted yet
        self._held: dict[int, int] = {}  # id(request) -> KV positions, for each row held
        self._held_tokens = 0
        self._abort: BaseException | None = None
        self._rows: list[_Row] = []
        self._steps: dict[tuple, BatchStep] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="selfspec-scheduler", daemon=True)
        self.steps_run = 0

    def start(self) -> None:
        """Start the worker thread, again after :meth:`close` too: an ASGI app's lifespan
        may start more than once (a test client per test, schemathesis).

        Raises:
            RuntimeError: the worker runs already.
        """
        if self._thread.is_alive():
            raise RuntimeError("the scheduler's worker runs already")
        if self._thread.ident is not None:  # a thread runs only once: a new worker
            with self._wake:
                self._stop = False
            self._thread = threading.Thread(target=self._run, name="selfspec-scheduler",
                                            daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after its current step; running and waiting requests are failed
        with :class:`ShutdownError`."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        elif self._thread.ident is None:  # never started: no worker will answer them
            self._end_all(ShutdownError("the server is shutting down"))

    def abort(self, error: BaseException) -> None:
        """End every request running or waiting now with ``error`` (their ``on_done``),
        after the worker's current step; the scheduler keeps serving later requests."""
        with self._wake:
            self._abort = error
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Cancel ``request`` (its client left): a running row leaves at the next step with
        finish reason ``"cancelled"``; a request still waiting for a row leaves the queue now
        and ends with :class:`CancelledRequest` (its ``on_done``, on the caller's thread)."""
        request.cancelled.set()
        with self._wake:
            gone = self._drop_cancelled()
            self._wake.notify()
        self._end_cancelled(gone)

    @property
    def running(self) -> int:
        """Rows held: being decoded, or about to be admitted."""
        return len(self._held)

    @property
    def waiting(self) -> int:
        """Requests queued for a row."""
        return len(self._queue)

    @property
    def held_tokens(self) -> int:
        """KV positions the rows held may reach together (see ``max_batch_tokens``)."""
        return self._held_tokens

    def positions(self, request: Request) -> int:
        """The KV positions ``request``'s row may reach: prompt + ``max_new_tokens``,
        capped by the model's context."""
        need = len(request.prompt_ids) + request.options.max_new_tokens
        return min(need, self.engine.executor.max_positions)

    def submit(self, request: Request) -> None:
        """Give ``request`` a row now if one is free (and its KV positions fit), else queue it.

        Raises:
            InvalidArgumentError: the request alone needs more than ``max_batch_tokens``.
            QueueFullError: ``max_queue`` requests are waiting already (the message gives
                the numbers running and waiting, and the bounds).
            RuntimeError: the scheduler was closed.
        """
        need = self.positions(request)
        if self.max_batch_tokens is not None and need > self.max_batch_tokens:
            raise InvalidArgumentError(
                f"the request may reach {need} KV positions (prompt + max_tokens), over "
                f"max_batch_tokens {self.max_batch_tokens}")
        with self._wake:
            if self._stop:
                raise RuntimeError("the scheduler is closed")
            gone = self._drop_cancelled()  # requests whose clients left hold no place
            run_now = not self._queue and self._fits(need)
            full = not run_now and len(self._queue) >= self.max_queue
            if not full:
                if self.observer is not None:  # before the worker can see the request
                    self.observer.on_submit(request)
                if run_now:
                    self._hold(request, need)
                    self._ready.append(request)
                else:
                    self._queue.append(request)
                self._wake.notify()
        self._end_cancelled(gone)
        if full:
            raise QueueFullError(self._busy())

    def _drop_cancelled(self) -> list[Request]:
        """Take the cancelled requests out of the queue (under ``_wake``)."""
        gone = [r for r in self._queue if r.cancelled.is_set()]
        if gone:
            self._queue = deque(r for r in self._queue if not r.cancelled.is_set())
        return gone

    def _end_cancelled(self, requests: list[Request]) -> None:
        """End requests taken out of the queue (not under ``_wake``: ``on_done`` runs)."""
        for request in requests:
            try:
                request.on_done(None, "", CancelledRequest(_LEFT))
            except Exception:
                logger.exception("on_done failed")

    def _busy(self) -> str:
        tokens = ("" if self.max_batch_tokens is None else
                  f", {self._held_tokens} of max_batch_tokens {self.max_batch_tokens} held")
        return (f"{len(self._held)} requests are running (max_batch {self.max_batch}{tokens}) "
                f"and {len(self._queue)} waiting (max_queue {self.max_queue}); retry later")

    # --------------------------------------------------------- rows held (under _wake)
    def _fits(self, need: int) -> bool:
        return len(self._held) < self.max_batch and (
            self.max_batch_tokens is None or self._held_tokens + need <= self.max_batch_tokens)

    def _hold(self, request: Request, need: int) -> None:
        self._held[id(request)] = need
        self._held_tokens += need

    def _release(self, request: Request) -> None:
        """Free ``request``'s row (if it holds one) and give rows to the head of the queue
        while they fit (first come, first served: a large request is not overtaken)."""
        with self._wake:
            self._held_tokens -= self._held.pop(id(request), 0)
            gone = self._drop_cancelled()
            while self._queue:
                head = self._queue[0]
                need = self.positions(head)
                if not self._fits(need):
                    break
                self._hold(self._queue.popleft(), need)
                self._ready.append(head)
            self._wake.notify()
        self._end_cancelled(gone)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while (not self._stop and self._abort is None and not self._ready
                           and not self._rows):
                        self._wake.wait()
                    if self._stop:
                        break
                try:
                    self._iteration()
                except Exception:  # a method bug must not take the server down
                    logger.exception("scheduler iteration failed")
        self._end_all(ShutdownError("the server is shutting down"))

    def _end_all(self, error: BaseException) -> None:
        """Fail every row and every request holding or waiting for one with ``error``."""
        for row in list(self._rows):
            self._finish(row, error)
        with self._wake:
            pending = [*self._ready, *self._queue]
            self._ready.clear()
            self._queue.clear()
        for request in pending:
            self._fail(request, error)

    def _iteration(self) -> None:
        with self._wake:
            error, self._abort = self._abort, None
        if error is not None:
            self._end_all(error)
            return
        for row in [r for r in self._rows if r.request.cancelled.is_set()]:
            row.state.finish_reason = row.state.finish_reason or "cancelled"
            self._finish(row)
        while True:
            with self._wake:
                if not self._ready:
                    break
                request = self._ready.popleft()
            if request.cancelled.is_set():
                self._fail(request, CancelledRequest(_LEFT))
            else:
                self._admit(request)
        groups: dict[tuple, list[_Row]] = {}
        for row in self._rows:
            groups.setdefault(row.key, []).append(row)
        for key, rows in groups.items():
            self._advance(key, rows)
        self.steps_run += 1
        for key in [k for k in self._steps if not any(r.key == k for r in self._rows)]:
            del self._steps[key]

    def _advance(self, key: tuple, rows: list[_Row]) -> None:
        """One step of ``rows`` (one method and options); a row whose processing fails is
        finished with its error, the others go on."""
        step = self._steps[key]
        if step.batched and len(rows) > 1:
            try:
                for row, stats in zip(rows, step([r.state for r in rows]), strict=False):
                    self._add_stats(key, row, stats)
                self._settle(rows)
                return
            except Exception as error:
                # Which row made a shared forward fail is unknown: run each row alone (a row
                # the failed step advanced already just takes one more step; its tokens are
                # still its own), so only the rows that fail alone fail.
                _log_failure(error, "a batched %s step failed; running its rows one at a "
                                    "time", key[0])
                for row in rows:
                    # The step may have run the forward of rows it did not commit (a row's
                    # grammar refusing its token fails the step after the forward): their KV
                    # holds positions past their tokens. Batched steps run whole-model
                    # forwards, so a row's KV at a step's start is its tokens but the last.
                    row.state.cache.truncate(row.state.seq_len - 1)
        for row in rows:
            if row.state.done or row.failures:
                continue
            try:
                for stats in step([row.state]):
                    self._add_stats(key, row, stats)
            except Exception as error:
                _log_failure(error, "a %s step failed for one request", key[0])
                row.failures.append(error)
        self._settle(rows)

    def _add_stats(self, key: tuple, row: _Row, stats: StepStats) -> None:
        row.state.stats.add(stats)
        if self.observer is not None:  # the same stats as the response's usage
            self.observer.on_step(key[0], stats)

    def _settle(self, rows: list[_Row]) -> None:
        for row in rows:
            if row.failures:
                self._finish(row, row.failures[0])
            elif row.state.done:
                self._finish(row)

    @contextmanager
    def _memory_of(self, request: Request) -> Iterator[None]:
        """While inside, the engine's methods draft from (and add to) ``request``'s
        tenant's memory; the engine's own without a tenant (worker thread only)."""
        if request.tenant is None:
            yield
            return
        methods = self.engine.methods
        previous = methods.use_memory(self.tenants.get(request.tenant))
        try:
            yield
        finally:
            methods.use_memory(previous)

    def _admit(self, request: Request) -> None:
        with self._memory_of(request):
            self._admit_row(request)

    def _admit_row(self, request: Request) -> None:
        try:
            spec = get_method(request.method)
            key = (request.method, tuple(sorted((k, str(v)) for k, v in
                                                request.method_options.items())))
            if key not in self._steps:
                self._steps[key] = spec.make_batch_step(self.engine.methods,
                                                        dict(request.method_options))
            sink = StopStringSink(self.engine.tokenizer, request.stop, None)
            failures: list[BaseException] = []

            def on_commit(tokens: list[int], sink: StopStringSink = sink) -> bool:
                # Inside a batched step: an error here must end this row, not the step.
                try:
                    stop = sink(tokens)
                    request.on_tokens(tokens)
                except Exception as error:
                    logger.exception("a request's token callback failed")
                    failures.append(error)
                    return True
                if not stop and request.cancelled.is_set():
                    # Returning True alone would read as a stop string: say why it ends.
                    state = request.state
                    if state is not None and state.finish_reason is None:
                        state.finish_reason = "cancelled"
                    return True
                return stop

            state = DecodeState(self.engine.executor, request.prompt_ids, request.options,
                                on_commit, prefix_cache=getattr(self.engine, "prefix_cache", None))
            check_processing(self._steps[key].processes_logits, state)
            request.state = state
            begin(state)
            row = _Row(request, state, sink, key, failures)
            if not state.done and not failures:
                self._steps[key].join(state)
        except Exception as error:  # noqa: BLE001 - bad options, prompt too long, ...
            self._fail(request, error)
            return
        if state.done or failures:
            self._finish(row, failures[0] if failures else None, joined=False)
            return
        self._rows.append(row)

    def _finish(self, row: _Row, error: BaseException | None = None,
                joined: bool = True) -> None:
        if row in self._rows:
            self._rows.remove(row)
        step = self._steps.get(row.key)
        if step is not None and joined:
            try:
                with self._memory_of(row.request):
                    step.leave(row.state)
            except Exception:
                logger.exception("leaving a row failed")
        state = row.state
        stats = state.finish()
        text = ""
        if error is None:
            try:
                generated = state.tokens[state.prompt_len:]
                text = row.sink.cut(self.engine.tokenizer.decode(generated,
                                                                 skip_special_tokens=True))
            except Exception as failure:
                logger.exception("decoding a finished request's text failed")
                error = failure
        state.cache = None  # free the row's KV cache now, not when the client lets go
        logger.debug("request done: %d tokens, %s", stats.new_tokens, stats.finish_reason)
        self._release(row.request)  # before on_done: its caller may submit again at once
        try:
            row.request.on_done(state if error is None else None, text, error)
        except Exception:
            logger.exception("on_done failed")

    def _fail(self, request: Request, error: BaseException) -> None:
        self._release(request)
        try:
            request.on_done(None, "", error)
        except Exception:
            logger.exception("on_done failed")
