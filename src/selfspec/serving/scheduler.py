"""Continuous batching: requests join the running batch between steps and leave when done.

One worker thread owns the model. Each iteration it (1) drops cancelled rows, (2) admits
queued requests while fewer than ``max_batch`` rows run (prefill alone, first token), and
(3) advances every running row by one step: rows of the same method and options share one
:class:`~selfspec.decoding.auto.batch.BatchStep` (one batched forward for ar / ngram / auto; the
other methods run their rows in turn). Committed tokens reach each request's callback as
they come; a finished row calls its ``on_done`` and frees its KV cache.

The queue is bounded: :meth:`Scheduler.submit` raises :class:`QueueFullError` rather than
let waiting requests pile up (the server answers 429).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from selfspec.decoding.auto.batch import BatchStep, begin
from selfspec.decoding.core.loop import check_processing
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.core.stop_strings import StopStringSink
from selfspec.errors import InvalidArgumentError, SelfSpecError
from selfspec.methods.registry import get_method

logger = logging.getLogger(__name__)


class QueueFullError(SelfSpecError):
    """The scheduler's queue holds ``max_queue`` requests already; retry later."""


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


@dataclass
class _Row:
    request: Request
    state: DecodeState
    sink: StopStringSink
    key: tuple


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
        observer: told of each queued request and each row's step (``None``: nobody).

    Raises:
        InvalidArgumentError: bounds below their minimum.
    """

    def __init__(self, engine: Any, max_batch: int = 8, max_queue: int = 64,
                 observer: SchedulerObserver | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise InvalidArgumentError(
                f"max_batch must be >= 1 and max_queue >= 0; got {max_batch}, {max_queue}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.observer = observer
        self._queue: deque[Request] = deque()
        self._rows: list[_Row] = []
        self._steps: dict[tuple, BatchStep] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="selfspec-scheduler", daemon=True)
        self.steps_run = 0

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after its current step; waiting requests are failed."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    @property
    def running(self) -> int:
        """Rows being decoded."""
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Requests queued for a row."""
        return len(self._queue)

    def submit(self, request: Request) -> None:
        """Queue ``request``.

        Raises:
            QueueFullError: ``max_queue`` requests are waiting already.
            RuntimeError: the scheduler was closed.
        """
        with self._wake:
            if self._stop:
                raise RuntimeError("the scheduler is closed")
            free_rows = max(self.max_batch - len(self._rows), 0)
            if len(self._queue) >= self.max_queue + free_rows:
                raise QueueFullError(
                    f"{len(self._queue)} requests are waiting already (max_queue "
                    f"{self.max_queue}); retry later")
            if self.observer is not None:
                self.observer.on_submit(request)
            self._queue.append(request)
            self._wake.notify()

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stop and not self._queue and not self._rows:
                        self._wake.wait()
                    if self._stop:
                        break
                try:
                    self._iteration()
                except Exception:  # a method bug must not take the server down
                    logger.exception("scheduler iteration failed")
        for row in self._rows:
            self._finish(row, RuntimeError("the server is shutting down"))
        while self._queue:
            self._fail(self._queue.popleft(), RuntimeError("the server is shutting down"))

    def _iteration(self) -> None:
        for row in [r for r in self._rows if r.request.cancelled.is_set()]:
            row.state.finish_reason = row.state.finish_reason or "cancelled"
            self._finish(row)
        while len(self._rows) < self.max_batch:
            with self._wake:
                if not self._queue:
                    break
                request = self._queue.popleft()
            if not request.cancelled.is_set():
                self._admit(request)
        groups: dict[tuple, list[_Row]] = {}
        for row in self._rows:
            groups.setdefault(row.key, []).append(row)
        for key, rows in groups.items():
            step = self._steps[key]
            states = [r.state for r in rows]
            try:
                for state, stats in zip(states, step(states)):
                    state.stats.add(stats)
                    if self.observer is not None:  # the same stats as the response's usage
                        self.observer.on_step(key[0], stats)
            except Exception as error:
                logger.exception("a %s step failed", key[0])
                for row in rows:
                    self._finish(row, error)
                continue
            for row in rows:
                if row.state.done:
                    self._finish(row)
        self.steps_run += 1
        for key in [k for k in self._steps if not any(r.key == k for r in self._rows)]:
            del self._steps[key]

    def _admit(self, request: Request) -> None:
        try:
            spec = get_method(request.method)
            key = (request.method, tuple(sorted((k, str(v)) for k, v in
                                                request.method_options.items())))
            if key not in self._steps:
                self._steps[key] = spec.make_batch_step(self.engine.methods,
                                                        dict(request.method_options))
            sink = StopStringSink(self.engine.tokenizer, request.stop, None)

            def on_commit(tokens: list[int], sink: StopStringSink = sink) -> bool:
                stop = sink(tokens)
                request.on_tokens(tokens)
                return stop or request.cancelled.is_set()

            state = DecodeState(self.engine.executor, request.prompt_ids, request.options,
                                on_commit)
            check_processing(self._steps[key].processes_logits, state)
            request.state = state
            begin(state)
        except Exception as error:  # noqa: BLE001 - bad options, prompt too long, ...
            self._fail(request, error)
            return
        row = _Row(request, state, sink, key)
        if state.done:
            self._finish(row, joined=False)
            return
        self._steps[key].join(state)
        self._rows.append(row)

    def _finish(self, row: _Row, error: BaseException | None = None,
                joined: bool = True) -> None:
        if row in self._rows:
            self._rows.remove(row)
        step = self._steps.get(row.key)
        if step is not None and joined:
            try:
                step.leave(row.state)
            except Exception:
                logger.exception("leaving a row failed")
        state = row.state
        stats = state.finish()
        generated = state.tokens[state.prompt_len:]
        text = row.sink.cut(self.engine.tokenizer.decode(generated, skip_special_tokens=True))
        state.cache = None  # free the row's KV cache now, not when the client lets go
        logger.debug("request done: %d tokens, %s", stats.new_tokens, stats.finish_reason)
        try:
            row.request.on_done(state if error is None else None, text, error)
        except Exception:
            logger.exception("on_done failed")

    def _fail(self, request: Request, error: BaseException) -> None:
        try:
            request.on_done(None, "", error)
        except Exception:
            logger.exception("on_done failed")
