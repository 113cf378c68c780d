"""``selfspec serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the
continuous-batching :class:`~selfspec.serving.scheduler.Scheduler`.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (the tokenizer's chat template), with ``stream`` as server-sent
events ending in ``data: [DONE]``, and ``GET /metrics`` (the Prometheus text format,
:mod:`~selfspec.serving.metrics`; it needs the API key too when one is set); a response's
``usage.selfspec`` tells how its draft tokens fared; ``GET /openapi.json`` is the
server's OpenAPI 3.1 document (:mod:`~selfspec.serving.openapi`; the key too, like
``/v1/models``). ``/health`` needs no key unless
``health_auth``: load balancers and orchestrators probe it without credentials, and it tells
only the model's name and the queue's length. Every error is an OpenAI-style body
(:class:`~selfspec.serving.protocol.ApiError`): 400 for malformed JSON (also nested too deep,
``NaN``, lone surrogates: :mod:`selfspec.serving.body`) or parameters, a method option
naming a file (:mod:`selfspec.serving.assets`), a method whose trained assets this server
lacks, or a request over ``max_batch_tokens`` alone; 401 for a missing or wrong
``--api-key``, 404 for an unknown model or route, 413 for a body over the limit, 429 when
``max_batch`` rows run and ``max_queue`` requests wait, 503 (``Retry-After``) while the
server drains on shutdown (:mod:`selfspec.serving.drain`); an unexpected failure is a 500
with a generic message (the traceback goes to the server's log, never to the client). A
request whose decoding fails fails alone (a 500 body, or a stream's error event and
``[DONE]``); the other rows of its batch go on. A client that disconnects cancels its
request: its row leaves the batch at the next step and its KV cache is freed.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects.

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.decoding.core.grammar import GrammarViolation
from selfspec.errors import InvalidArgumentError, MissingDependencyError, PromptError
from selfspec.methods.options import model_symbols
from selfspec.methods.registry import METHODS, get_method
from selfspec.models.provision import selfspec_home
from selfspec.serving import assets
from selfspec.serving.body import decode_json
from selfspec.serving.drain import Drain, Unavailable
from selfspec.serving.metrics import HttpMetrics, ServerMetrics, acceptance_usage
from selfspec.serving.openapi import openapi_document
from selfspec.serving.protocol import (
    FINISH_REASONS,
    ApiError,
    ApiRequest,
    Choice,
    Limits,
    ResponseIds,
    TextDeltas,
    check_option_types,
    check_prompt_length,
    chunk_body,
    logprobs_body,
    parse_request,
    response_body,
    sampling_seed,
    usage,
    usage_chunk,
)
from selfspec.serving.scheduler import QueueFullError, Request, Scheduler, ShutdownError
from selfspec.serving.tools import (
    call_format,
    hermes_messages,
    parse_answer,
    parse_tools,
    template_messages,
    template_takes_tools,
)
from selfspec.validation import check_text, check_token_ids
from selfspec.version import __version__

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs.

    Attributes:
        model_name: the name clients pass as ``model`` (``/v1/models`` lists it).
        method / method_options: the default method and its options (a request may
            override them in its ``selfspec`` field).
        api_key: required as ``Authorization: Bearer KEY`` when set.
        limits: body, prompt and ``max_tokens`` limits.
        max_batch: rows decoded together.
        max_queue: requests waiting for a row before 429.
        max_batch_tokens: KV positions (prompt + ``max_tokens`` per row) the running rows
            may reach together; ``None``: no bound but ``max_batch``.
        assets_dir: where a request's asset options (heads, skip sets) are looked up by
            bare name; ``None``: requests may name none (:mod:`selfspec.serving.assets`).
        health_auth: ``/health`` needs the API key too.
        drain_seconds: on shutdown, how long accepted requests may still run.
        header_timeout: seconds a client has to send a request's headers.
    """

    model_name: str
    method: str = "auto"
    method_options: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 8
    max_queue: int = 64
    max_batch_tokens: int | None = None
    assets_dir: Path | None = None
    health_auth: bool = False
    drain_seconds: float = 30.0
    header_timeout: float = 10.0


def create_app(engine: Any, config: ServeConfig) -> Any:
    """The ASGI application serving ``engine``.

    Raises:
        MissingDependencyError: FastAPI or prometheus-client is not installed
            (``pip install 'selfspec[serve]'``).
        InvalidArgumentError: the default method or its options are invalid for the model.
    """
    try:
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from jinja2 import TemplateError
        from starlette.exceptions import HTTPException
    except ImportError as error:
        raise MissingDependencyError(
            "selfspec serve needs FastAPI and uvicorn: pip install 'selfspec[serve]'") from error

    get_method(config.method).make_batch_step(engine.methods, config.method_options)
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, max_batch=config.max_batch, max_queue=config.max_queue,
                          max_batch_tokens=config.max_batch_tokens, observer=metrics)
    metrics.watch(scheduler)
    drain = Drain(scheduler, config.drain_seconds)
    assets_dir = None if config.assets_dir is None else Path(config.assets_dir).resolve()
    # The event loop's own tokenizer: a fast tokenizer's encode reconfigures its Rust backend
    # (truncation, padding) and must not run while the worker thread decodes with it.
    tokenizer = copy.deepcopy(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        warm_up(engine, config.method, config.method_options)
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    # FastAPI's own document would describe handlers that read raw JSON: none of the bodies.
    app = FastAPI(title="selfspec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    document = openapi_document(
        config.model_name, config.limits, engine.vocab_size, METHODS,
        model_symbols(engine.executor), api_key=config.api_key is not None,
        health_auth=config.health_auth, asset_names=assets_dir is not None,
        version=__version__)
    app.state.scheduler = scheduler
    app.state.drain = drain
    app.state.metrics = metrics
    app.add_middleware(HttpMetrics, metrics=metrics, routes=app.routes)

    def error_response(error: ApiError) -> JSONResponse:
        headers = dict(getattr(error, "headers", {}))  # Unavailable's Retry-After
        if error.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(error.body(), status_code=error.status, headers=headers or None)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HttpRequest, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(error.status_code, str(error.detail), type=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, str(error)))

    @app.exception_handler(Exception)
    async def _unexpected(request: HttpRequest, error: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(ApiError(500, "internal server error; see the server log",
                                       type="server_error"))

    def authorize(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), config.api_key):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def read_json(request: HttpRequest) -> Any:
        limit = config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
            chunks.append(chunk)
        return decode_json(b"".join(chunks))

    def prompt_ids(api: ApiRequest) -> list[int]:
        try:
            if api.chat:
                if not getattr(tokenizer, "chat_template", None):
                    raise ApiError(400, f"model {config.model_name!r} has no chat template; "
                                        "use /v1/completions", param="messages")
                tools = api.tools
                if template_takes_tools(tokenizer):
                    extra = ({"tools": list(tools.tools)} if tools is not None and tools.active
                             else {})
                    messages = template_messages(api.messages)
                else:
                    extra, messages = {}, hermes_messages(api.messages, tools)
                try:
                    ids = tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, tokenize=True,
                        return_dict=False, **extra)
                except TemplateError as error:  # the template refuses these messages
                    raise ApiError(400, f"the model's chat template refuses these messages: "
                                        f"{error}", param="messages") from error
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            elif api.prompt is not None:
                check_text("the prompt", api.prompt)
                ids = tokenizer(api.prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = api.prompt_ids
            ids = check_token_ids(list(ids), engine.vocab_size)
        except PromptError as error:
            raise ApiError(400, str(error), param="prompt") from error
        check_prompt_length(len(ids), config.limits, engine.executor.max_positions)
        return ids

    def method_of(api: ApiRequest) -> tuple[str, dict[str, Any]]:
        """The request's method and options; its asset options checked and resolved, and
        the assets it reads present, before the request is queued."""
        if api.method is None:
            return config.method, dict(config.method_options)  # checked at start
        try:
            spec = get_method(api.method)
            check_option_types(spec.name, spec.fields, api.method_options)
            values = assets.client_options(spec, api.method_options, assets_dir)
            options = spec.parse(values, engine.executor)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="selfspec") from error
        missing = assets.missing_asset(spec, options, engine.executor.name, assets_dir)
        if missing is not None:
            raise missing
        return api.method, values

    def check_batch_tokens(job: Request, prompt_tokens: int, max_tokens: int) -> None:
        need = scheduler.positions(job)
        if config.max_batch_tokens is not None and need > config.max_batch_tokens:
            raise ApiError(400, f"the prompt ({prompt_tokens} tokens) and max_tokens "
                                f"({max_tokens}) may reach {need} KV positions; this server "
                                f"decodes at most {config.max_batch_tokens} at once "
                                "(--max-batch-tokens). Lower max_tokens or shorten the prompt.",
                           param="max_tokens", code="batch_tokens_exceeded")

    async def complete(request: HttpRequest, chat: bool) -> Any:
        authorize(request)
        with drain.entering():  # 503 while draining; the drain waits for it meanwhile
            api, ids, jobs, events = await accept(request, chat)
        ids_of = ResponseIds(config.model_name, chat)
        if api.stream:
            return StreamingResponse(stream(api, jobs, events, ids_of, len(ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            finished: dict[int, tuple] = {}
            while len(finished) < len(jobs):
                item = await next_event(request, events, jobs)
                if item is None:
                    return None
                if item[0] == "done":
                    finished[item[1]] = item
                    if item[4] is not None:
                        raise failure(item[4])
        except BaseException:
            for job in jobs:
                job.cancelled.set()
            raise
        choices, generated, stats = [], 0, []
        for index, (_, _, state, text, _) in sorted(finished.items()):
            entries = logprob_entries(state)
            finish = FINISH_REASONS.get(state.finish_reason, "stop")
            calls = None
            if api.tools is not None and api.tools.active:
                answer = parse_answer(text, api.tools)
                text, calls = answer.content, answer.calls or None
                if calls:
                    finish = "tool_calls"
            choices.append(Choice(index, text, finish,
                                  None if entries is None else
                                  logprobs_body(tokenizer, entries, chat), calls))
            generated += state.num_generated
            stats.append(state.stats)
        cached = max(s.cached_tokens for s in stats)  # the choices share one prompt
        return response_body(ids_of, choices, usage(len(ids), generated, cached)
                             | {"selfspec": acceptance_usage(jobs[0].method, *stats)})

    async def accept(request: HttpRequest, chat: bool
                     ) -> tuple[ApiRequest, list[int], list[Request], asyncio.Queue]:
        """Read and check a generation request and submit its ``n`` choices (one row each)
        to the scheduler."""
        body = await read_json(request)
        api = parse_request(body, chat, config.limits)
        if chat:
            tools = parse_tools(body)
            if tools is not None and tools.forced and api.response_format is not None:
                raise ApiError(400, "'response_format' cannot be combined with a tool_choice "
                                    "that forces a call (the call's schema is the format)",
                               param="response_format")
            api = dataclasses.replace(api, tools=tools)
        if body["model"] != config.model_name:
            raise ApiError(404, f"the model {body['model']!r} is not served here; this server "
                                f"serves {config.model_name!r}", param="model",
                           code="model_not_found")
        ids = prompt_ids(api)
        method, method_options = method_of(api)
        processing = processing_of(api)
        if processing.active and not get_method(method).processes_logits_for(method_options):
            raise ApiError(400, f"method {method!r} with these options picks tokens without "
                                "verification, so response_format, penalties and logprobs "
                                "cannot apply; use a lossless method (auto, ar, ngram, ...)",
                           param="selfspec")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def post(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

        jobs = []
        for index in range(api.n):
            # Choice i samples with seed + i: n choices of one seeded request differ from
            # each other, and each is reproducible.
            seed = None if api.seed is None else api.seed + index
            try:
                options = engine.decode_options(api.max_tokens, api.temperature, api.top_k,
                                                api.top_p, sampling_seed(seed), processing)
            except InvalidArgumentError as error:
                raise ApiError(400, str(error)) from error
            job = Request(prompt_ids=ids, options=options, method=method,
                          method_options=method_options, stop=api.stop)
            job.on_tokens = _token_poster(job, index, post)
            job.on_done = (lambda state, text, error, index=index:
                           post(("done", index, state, text, error)))
            check_batch_tokens(job, len(ids), api.max_tokens)
            jobs.append(job)
        drain.check_submit()
        try:
            for job in jobs:
                scheduler.submit(job)
        except (QueueFullError, InvalidArgumentError) as error:
            for job in jobs:
                job.cancelled.set()
            if isinstance(error, QueueFullError):
                raise ApiError(429, f"the server is busy: {error}", type="rate_limit_error",
                               code="queue_full") from error
            raise ApiError(400, str(error)) from error
        return api, ids, jobs, events

    def processing_of(api: ApiRequest) -> Any:
        response_format = api.response_format
        if api.tools is not None and api.tools.forced:
            response_format = call_format(api.tools)
        try:
            return engine.processing(response_format, api.presence_penalty,
                                     api.frequency_penalty, api.logprobs)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="response_format"
                           if api.response_format is not None else None) from error
        except MissingDependencyError as error:
            raise ApiError(400, f"response_format is not available on this server: {error}",
                           param="response_format") from error

    async def next_event(request: HttpRequest, events: asyncio.Queue,
                         jobs: list[Request]) -> tuple | None:
        """The next event of the request's jobs, or ``None`` when the client left."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    for job in jobs:
                        job.cancelled.set()
                    return None

    def failure(error: BaseException) -> ApiError:
        """What a client is told of ``error``, its request's failure in the scheduler."""
        if isinstance(error, ShutdownError):
            return Unavailable(f"{error}; retry", retry_after=1)
        unusable = assets.asset_error(error, selfspec_home(), assets_dir)
        if unusable is not None:
            logger.warning("a request's method cannot use its asset: %s", error)
            return unusable
        if isinstance(error, GrammarViolation):  # llguidance's doing; the operator may care
            logger.warning("a request's output constraint failed while decoding: %s", error)
        if isinstance(error, InvalidArgumentError):
            return ApiError(400, str(error))
        logger.error("generation failed: %r", error)
        return ApiError(500, "generation failed; see the server log", type="server_error")

    async def stream(api: ApiRequest, jobs: list[Request], events: asyncio.Queue,
                     ids_of: ResponseIds, prompt_tokens: int) -> AsyncIterator[bytes]:
        deltas = [TextDeltas(tokenizer, api.stop) for _ in jobs]
        tools_active = api.tools is not None and api.tools.active
        offsets = [0] * len(jobs)  # completions' text_offset of each choice's next token
        opened = [False] * len(jobs)
        generated, stats, left = 0, [], len(jobs)

        def event(body: dict) -> bytes:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        def chunk_logprobs(index: int, entries: list | None) -> dict | None:
            if entries is None:
                return None
            body = logprobs_body(tokenizer, entries, ids_of.chat, offsets[index])
            offsets[index] += sum(len(t) for t in body.get("tokens", ()))
            return body

        try:
            if ids_of.chat:
                for index in range(len(jobs)):
                    yield event(chunk_body(ids_of, "", None, role=True, index=index))
                    opened[index] = True
            while True:
                item = await events.get()
                if item[0] == "tokens":
                    _, index, tokens, entries = item
                    if tools_active:  # the answer may be calls: sent whole when done
                        continue
                    text = deltas[index].push(tokens)
                    logprobs = chunk_logprobs(index, entries)
                    if text or logprobs is not None:
                        yield event(chunk_body(ids_of, text, None, role=not opened[index],
                                               index=index, logprobs=logprobs))
                        opened[index] = True
                else:
                    _, index, state, text, error = item
                    if error is not None:
                        yield event(failure(error).body())
                        break
                    finish = FINISH_REASONS.get(state.finish_reason, "stop")
                    if tools_active:
                        answer = parse_answer(text, api.tools)
                        entries = logprob_entries(state)
                        logprobs = chunk_logprobs(index, entries)
                        if answer.calls:
                            yield event(chunk_body(ids_of, answer.content, None, index=index,
                                                   logprobs=logprobs, calls=answer.calls))
                            finish = "tool_calls"
                        elif answer.content or logprobs is not None:
                            yield event(chunk_body(ids_of, answer.content, None, index=index,
                                                   logprobs=logprobs))
                        rest = None
                    else:
                        rest = deltas[index].finish(text)
                    yield event(chunk_body(ids_of, rest, finish, role=not opened[index],
                                           index=index))
                    generated += state.num_generated
                    stats.append(state.stats)
                    left -= 1
                    if not left:
                        if api.include_usage:
                            cached = max(s.cached_tokens for s in stats)
                            use = usage(prompt_tokens, generated, cached) | {
                                "selfspec": acceptance_usage(jobs[0].method, *stats)}
                            yield event(usage_chunk(ids_of, use))
                        break
            yield b"data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancelled.set()  # a disconnect ends here too; a finished job ignores it
    @app.get("/health")
    async def health(request: HttpRequest) -> Any:
        if config.health_auth:
            authorize(request)
        body = {"status": "draining" if drain.draining else "ok", "model": config.model_name,
                "running": scheduler.running, "waiting": scheduler.waiting}
        # 503 while draining: a load balancer's probe takes the replica out of rotation.
        return JSONResponse(body, status_code=503 if drain.draining else 200)

    @app.get("/metrics")
    async def metrics_text(request: HttpRequest) -> Response:
        # the key too: the metrics show the load and which methods clients use, and
        # Prometheus sends a bearer token (`authorization: {credentials_file: ...}`)
        authorize(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models(request: HttpRequest) -> dict:
        authorize(request)
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "selfspec",
            "selfspec": {"default_method": config.method,
                         "methods": sorted(METHODS),
                         "batched_methods": sorted(n for n, s in METHODS.items() if s.batched)},
        }]}

    @app.get("/openapi.json")
    async def openapi(request: HttpRequest) -> JSONResponse:
        authorize(request)  # like /v1/models: it names the model and the methods
        return JSONResponse(document)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Any:
        return await complete(request, chat=True)

    return app


def logprob_entries(state: Any) -> list | None:
    """The finished ``state``'s per-token log probabilities, or ``None`` when not asked."""
    processor = state.processor
    if state.options.processing.logprobs is None or processor is None:
        return None
    return list(processor.logprobs)


def _token_poster(job: Request, index: int, post: Any) -> Any:
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


def warm_up(engine: Any, method: str, options: dict[str, Any]) -> None:
    """A few tokens with ``method`` before the first request: one-time costs (the latency
    model measured on first use on a machine, kernel probes, first calls of each shape)
    are paid at start, not by a client's time to first token. The engine's memory of
    earlier generations is left as it was."""
    previous = engine.methods.use_memory(None)
    try:
        engine.generate("Hello", method=method, max_new_tokens=4, **options)
        engine.generate(["Hello", "Hi"], method=method, max_new_tokens=4, **options)
    finally:
        engine.methods.use_memory(previous)


def serve(engine: Any, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the server until SIGTERM or SIGINT, then drain (:mod:`selfspec.serving.drain`)
    and return.

    Raises:
        MissingDependencyError: FastAPI or uvicorn is not installed.
        InvalidArgumentError: see :func:`create_app`.
    """
    try:
        from selfspec.serving import server
    except ImportError as error:
        raise MissingDependencyError(
            "selfspec serve needs FastAPI and uvicorn: pip install 'selfspec[serve]'") from error
    app = create_app(engine, config)
    server.run(app, app.state.drain, host, port, log_level, config.header_timeout)
