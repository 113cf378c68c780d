"""What the HTTP routes of ``selfspec serve`` share (:class:`Service`): the engine, the
scheduler, the drain and the metrics, and the steps of a generation request from its body
to its rows in the scheduler: parsing, the prompt's ids
(:func:`~selfspec.serving.prompt.prompt_ids`), the method and its options, the output
processing, the rows (one per choice) and their submission."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from selfspec.decoding.core.grammar import GrammarViolation
from selfspec.errors import InvalidArgumentError, MissingDependencyError
from selfspec.methods.registry import get_method
from selfspec.models.provision import selfspec_home
from selfspec.serving import assets
from selfspec.serving.auth import request_tenant
from selfspec.serving.body import read_json
from selfspec.serving.config import DEFAULT_TENANT, ServeConfig
from selfspec.serving.drain import Drain, Unavailable
from selfspec.serving.metrics import PromptCount, ServerMetrics
from selfspec.serving.prompt import prompt_ids
from selfspec.serving.protocol import (
    ApiError,
    ApiRequest,
    check_option_types,
    parse_request,
    sampling_seed,
)
from selfspec.serving.scheduler import QueueFullError, Request, Scheduler, ShutdownError
from selfspec.serving.tools import call_format, parse_tools

logger = logging.getLogger(__name__)

#: An event a row posts to its request's queue: ``("tokens", index, tokens, entries)`` or
#: ``("done", index, state, text, error)``; ``("gone",)`` when the client left
#: (:func:`watch_disconnect`).
Event = tuple
GONE: Event = ("gone",)


class Service:
    """The server's engine, scheduler, drain and metrics, and the checks and submission of
    a generation request.

    Args:
        engine: a loaded :class:`selfspec.SelfSpec`.
        config: how the server runs.

    Raises:
        InvalidArgumentError: the default method or its options are invalid for the model.
    """

    def __init__(self, engine: Any, config: ServeConfig) -> None:
        get_method(config.method).make_batch_step(engine.methods, config.method_options)
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(engine, max_batch=config.max_batch,
                                   max_queue=config.max_queue,
                                   max_batch_tokens=config.max_batch_tokens,
                                   observer=self.metrics,
                                   max_tenants=config.max_tenants)
        self.metrics.watch(self.scheduler)
        self.drain = Drain(self.scheduler, config.drain_seconds)
        self.assets_dir = (None if config.assets_dir is None
                           else Path(config.assets_dir).resolve())
        # The event loop's own tokenizer: a fast tokenizer's encode reconfigures its Rust
        # backend (truncation, padding) and must not run while the worker thread decodes.
        self.tokenizer = copy.deepcopy(engine.tokenizer)

    async def read_body(self, request: Any) -> Any:
        """The JSON body of a generation request, read within ``body_timeout`` seconds;
        a drain that ends first cuts the read too (:meth:`Drain.reading`), so a slow body
        never holds a shutdown.

        Raises:
            ApiError: 408 (code ``body_timeout``, the connection closed) when the body
                takes longer; 503 when the drain cut it; 400 / 413 as
                :func:`~selfspec.serving.body.read_json`.
        """
        seconds = self.config.body_timeout
        try:
            async with asyncio.timeout(seconds) as deadline:
                with self.drain.reading(deadline):
                    return await read_json(request, self.config.limits.max_body_bytes)
        except TimeoutError:
            if self.drain.draining:
                raise self.drain.refusal() from None
            error = ApiError(408, f"the request body did not arrive within {seconds:g} s "
                                  "(the server's body timeout)", code="body_timeout")
            error.headers = {"Connection": "close"}  # the rest of the body is not read
            raise error from None

    async def accept(self, request: Any, body: Any, chat: bool
                     ) -> tuple[ApiRequest, list[int], list[Request], asyncio.Queue]:
        """Check a generation request (its JSON ``body``, :meth:`read_body`) and submit its
        ``n`` choices (one row each) to the scheduler.

        Returns:
            The request, its prompt's ids, its rows and the queue their events arrive on.

        Raises:
            ApiError: 400 / 404 for the request itself, 429 when the queue is full,
                503 once the drain's bound has passed.
        """
        api = self.parse(body, chat)
        ids = prompt_ids(api, self.tokenizer, self.config.model_name, self.engine.vocab_size,
                         self.engine.executor.max_positions, self.config.limits)
        method, method_options = self.method_of(api)
        processing = self.processing_of(api, method, method_options)
        jobs, events = self.rows(api, ids, method, method_options, processing)
        tenant = self.tenant_of(request, body)
        for job in jobs:
            job.tenant = tenant
        self.submit(jobs)
        return api, ids, jobs, events

    def tenant_of(self, request: Any, body: Any) -> str | None:
        """Whose memory the request drafts from: its key's tenant (``request.state.tenant``,
        set by the route from :func:`~selfspec.serving.auth.authorize`), with the body's
        ``user`` inside it under ``tenant_from_user``; ``None`` (one memory for all) under
        ``share_history``."""
        if self.config.share_history:
            return None
        key_tenant = getattr(request.state, "tenant", DEFAULT_TENANT)
        return request_tenant(key_tenant, body.get("user") if isinstance(body, dict) else None,
                              self.config.tenant_from_user)

    def parse(self, body: Any, chat: bool) -> ApiRequest:
        """The validated request of ``body`` (chat: with its tools), for this server's model.

        Raises:
            ApiError: 400 for a bad parameter, 404 (code ``model_not_found``) for another
                model.
        """
        api = parse_request(body, chat, self.config.limits)
        if chat:
            tools = parse_tools(body)
            if tools is not None and tools.forced and api.response_format is not None:
                raise ApiError(400, "'response_format' cannot be combined with a tool_choice "
                                    "that forces a call (the call's schema is the format)",
                               param="response_format")
            api = dataclasses.replace(api, tools=tools)
        name = self.config.model_name
        if body["model"] != name:
            raise ApiError(404, f"the model {body['model']!r} is not served here; this server "
                                f"serves {name!r}", param="model", code="model_not_found")
        return api

    def method_of(self, api: ApiRequest) -> tuple[str, dict[str, Any]]:
        """The request's method and options; its asset options checked and resolved, and
        the assets it reads present, before the request is queued.

        Raises:
            ApiError: 400 (param ``selfspec``) for an unknown method or bad options, or
                the asset error of :func:`~selfspec.serving.assets.missing_asset`.
        """
        if api.method is None:
            return self.config.method, dict(self.config.method_options)  # checked at start
        executor = self.engine.executor
        try:
            spec = get_method(api.method)
            check_option_types(spec.name, spec.fields, api.method_options)
            values = assets.client_options(spec, api.method_options, self.assets_dir)
            options = spec.parse(values, executor)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="selfspec") from error
        missing = assets.missing_asset(spec, options, executor.name, self.assets_dir)
        if missing is not None:
            raise missing
        return api.method, values

    def processing_of(self, api: ApiRequest, method: str,
                      method_options: dict[str, Any]) -> Any:
        """The request's output processing (its ``response_format`` or a forced tool
        call's, penalties, logprobs), checked against its method.

        Raises:
            ApiError: 400 for an invalid or unavailable constraint, or processing asked
                of a method that picks tokens without verification (param ``selfspec``).
        """
        response_format = api.response_format
        if api.tools is not None and api.tools.forced:
            response_format = call_format(api.tools)
        try:
            processing = self.engine.processing(response_format, api.presence_penalty,
                                                api.frequency_penalty, api.logprobs)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="response_format"
                           if api.response_format is not None else None) from error
        except MissingDependencyError as error:
            raise ApiError(400, f"response_format is not available on this server: {error}",
                           param="response_format") from error
        if processing.active and not get_method(method).processes_logits_for(method_options):
            raise ApiError(400, f"method {method!r} with these options picks tokens without "
                                "verification, so response_format, penalties and logprobs "
                                "cannot apply; use a lossless method (auto, ar, ngram, ...)",
                           param="selfspec")
        return processing

    def rows(self, api: ApiRequest, ids: list[int], method: str,
             method_options: dict[str, Any], processing: Any
             ) -> tuple[list[Request], asyncio.Queue]:
        """The request's ``n`` rows, not yet submitted, and the queue their callbacks post
        :data:`Event` tuples to (from the worker thread, through the running event loop).

        Raises:
            ApiError: 400 for sampling options the engine refuses or a row over
                ``max_batch_tokens`` alone.
        """
        events: asyncio.Queue = asyncio.Queue()
        post = _poster(asyncio.get_running_loop(), events)
        group = PromptCount()  # the metrics count the choices' one prompt once
        jobs = []
        for index in range(api.n):
            # Choice i samples with seed + i: n choices of one seeded request differ from
            # each other, and each is reproducible.
            seed = None if api.seed is None else api.seed + index
            try:
                options = self.engine.decode_options(api.max_tokens, api.temperature,
                                                     api.top_k, api.top_p,
                                                     sampling_seed(seed), processing)
            except InvalidArgumentError as error:
                raise ApiError(400, str(error)) from error
            job = Request(prompt_ids=ids, options=options, method=method,
                          method_options=method_options, stop=api.stop, group=group)
            job.on_tokens = _token_poster(job, index, post)
            job.on_done = _done_poster(index, post)
            self.check_batch_tokens(job, len(ids), api.max_tokens)
            jobs.append(job)
        return jobs, events

    def check_batch_tokens(self, job: Request, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a row that alone may reach more KV positions than ``max_batch_tokens``.

        Raises:
            ApiError: 400 (param ``max_tokens``, code ``batch_tokens_exceeded``).
        """
        need = self.scheduler.positions(job)
        bound = self.config.max_batch_tokens
        if bound is not None and need > bound:
            raise ApiError(400, f"the prompt ({prompt_tokens} tokens) and max_tokens "
                                f"({max_tokens}) may reach {need} KV positions; this server "
                                f"decodes at most {bound} at once "
                                "(--max-batch-tokens). Lower max_tokens or shorten the prompt.",
                           param="max_tokens", code="batch_tokens_exceeded")

    def submit(self, jobs: list[Request]) -> None:
        """Submit every row of a request, or none (the submitted ones are cancelled).

        Raises:
            ApiError: 503 once the drain's bound has passed, 429 (code ``queue_full``) when
                the queue is full, 400 for a row the scheduler refuses.
        """
        self.drain.check_submit()
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except (QueueFullError, InvalidArgumentError) as error:
            self.cancel(jobs)
            if isinstance(error, QueueFullError):
                raise ApiError(429, f"the server is busy: {error}", type="rate_limit_error",
                               code="queue_full") from error
            raise ApiError(400, str(error)) from error

    def cancel(self, jobs: Sequence[Request]) -> None:
        """Cancel a request's rows (its client left, or it ended early): running rows leave
        at the next step, waiting ones leave the queue now
        (:meth:`~selfspec.serving.scheduler.Scheduler.cancel`); finished rows ignore it."""
        for job in jobs:
            self.scheduler.cancel(job)

    async def collect(self, request: Any, events: asyncio.Queue, jobs: list[Request]
                      ) -> dict[int, Event] | None:
        """Every row's ``"done"`` event by choice index, or ``None`` when the client left:
        a task watches the connection meanwhile (:func:`watch_disconnect`), since rows
        post events all the time; the rows are cancelled then, and on any other exit
        before the end.

        Raises:
            ApiError: the first row's failure (:meth:`failure`).
        """
        watcher = asyncio.create_task(watch_disconnect(request, events))
        try:
            finished: dict[int, Event] = {}
            while len(finished) < len(jobs):
                item = await events.get()
                if item is GONE:
                    self.cancel(jobs)
                    return None
                if item[0] == "done":
                    finished[item[1]] = item
                    if item[4] is not None:
                        raise self.failure(item[4])
        except BaseException:
            self.cancel(jobs)
            raise
        finally:
            watcher.cancel()
        return finished

    def failure(self, error: BaseException) -> ApiError:
        """What a client is told of ``error``, its request's failure in the scheduler: a
        503 on shutdown, the asset's error, a 400 for its own arguments, else a 500 whose
        cause goes to the server's log only."""
        if isinstance(error, ShutdownError):
            return Unavailable(f"{error}; retry", retry_after=1)
        unusable = assets.asset_error(error, selfspec_home(), self.assets_dir)
        if unusable is not None:
            logger.warning("a request's method cannot use its asset: %s", error)
            return unusable
        if isinstance(error, GrammarViolation):  # llguidance's doing; the operator may care
            logger.warning("a request's output constraint failed while decoding: %s", error)
        if isinstance(error, InvalidArgumentError):
            return ApiError(400, str(error))
        logger.error("generation failed: %r", error)
        return ApiError(500, "generation failed; see the server log", type="server_error")


async def watch_disconnect(request: Any, events: asyncio.Queue) -> None:
    """Post :data:`GONE` on ``events`` when the client disconnects: once the body is read,
    the ASGI ``receive`` channel's next message is ``http.disconnect`` (uvicorn sends it
    as soon as the connection closes). Cancel the task when the response is done."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            events.put_nowait(GONE)
            return


def _poster(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[Event], None]:
    """Puts an event on ``events`` from any thread, through ``loop``."""
    def post(item: Event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass
    return post


def _token_poster(job: Request, index: int, post: Callable[[Event], None]) -> Any:
    """``job.on_tokens``: posts ``("tokens", index, tokens, logprob entries or None)``
    (called on the worker thread, where the row's state is current)."""
    def on_tokens(tokens: list[int]) -> None:
        state = job.state
        entries = None
        if state is not None and state.processor is not None \
                and state.options.processing.logprobs is not None:
            entries = state.processor.logprobs[-len(tokens):]
        post(("tokens", index, tokens, entries))
    return on_tokens


def _done_poster(index: int, post: Callable[[Event], None]) -> Any:
    """``job.on_done``: posts ``("done", index, state, text, error)`` (worker thread)."""
    def on_done(state: Any, text: str, error: BaseException | None) -> None:
        post(("done", index, state, text, error))
    return on_done
