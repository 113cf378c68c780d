"""The HTTP routes and error handlers of ``selfspec serve``
(:func:`~selfspec.serving.app.create_app` adds them). Each handler finds the
:class:`~selfspec.serving.service.Service` on ``request.app.state.service``. Needs FastAPI:
import it only once :func:`~selfspec.serving.app.create_app` has checked it is installed."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects.

import logging
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from selfspec.methods.registry import METHODS
from selfspec.serving.auth import authorize
from selfspec.serving.choices import response
from selfspec.serving.protocol import ApiError, ResponseIds
from selfspec.serving.service import Service
from selfspec.serving.streaming import ChunkWriter, FixedTokenChunks, stream_events

logger = logging.getLogger(__name__)

#: The status counted for a request whose client left before its response (nginx's 499,
#: "client closed request"): the client got none.
CLIENT_CLOSED = 499


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error with an OpenAI-style body: an :class:`ApiError` as it says,
    Starlette's (404 for an unknown route, 405, ...) and FastAPI's validation errors as 400s
    of that shape, anything else as a generic 500 (the traceback to the server's log)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(Exception, _unexpected)


def add_routes(app: FastAPI) -> None:
    """``GET /health``, ``/metrics``, ``/v1/models``, ``/openapi.json`` and
    ``POST /v1/completions``, ``/v1/chat/completions`` (the module docstring of
    :mod:`selfspec.serving.app` says what each answers)."""
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/openapi.json", openapi, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])


def error_response(error: ApiError) -> JSONResponse:
    """``error``'s JSON body with its status, its own headers (``Retry-After`` of a 503)
    and, for a 401, ``WWW-Authenticate: Bearer``."""
    headers = dict(getattr(error, "headers", {}))  # Unavailable's Retry-After
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


async def _api_error(request: HttpRequest, error: ApiError) -> JSONResponse:
    return error_response(error)


async def _http_error(request: HttpRequest, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(error.status_code, str(error.detail), type=kind))


async def _validation(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
    return error_response(ApiError(400, str(error)))


async def _unexpected(request: HttpRequest, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s", request.url.path)
    return error_response(ApiError(500, "internal server error; see the server log",
                                   type="server_error"))


def _service(request: HttpRequest) -> Service:
    return request.app.state.service


async def health(request: HttpRequest) -> Any:
    """The model's name and the queue's length; 503 while draining."""
    service = _service(request)
    if service.config.health_auth:
        authorize(request.headers, service.config.auth_keys())
    draining = service.drain.draining
    body = {"status": "draining" if draining else "ok", "model": service.config.model_name,
            "running": service.scheduler.running, "waiting": service.scheduler.waiting}
    # 503 while draining: a load balancer's probe takes the replica out of rotation.
    return JSONResponse(body, status_code=503 if draining else 200)


async def metrics_text(request: HttpRequest) -> Response:
    """The Prometheus text format of the server's metrics."""
    service = _service(request)
    # the key too: the metrics show the load and which methods clients use, and
    # Prometheus sends a bearer token (`authorization: {credentials_file: ...}`)
    authorize(request.headers, service.config.auth_keys())
    metrics = service.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


async def models(request: HttpRequest) -> dict:
    """The one model served, with its default method and the methods a request may name."""
    config = _service(request).config
    authorize(request.headers, config.auth_keys())
    return {"object": "list", "data": [{
        "id": config.model_name, "object": "model", "created": 0, "owned_by": "selfspec",
        "selfspec": {"default_method": config.method,
                     "methods": sorted(METHODS),
                     "batched_methods": sorted(n for n, s in METHODS.items() if s.batched)},
    }]}


async def openapi(request: HttpRequest) -> JSONResponse:
    """The server's OpenAPI document (``app.state.openapi``)."""
    # the key too, like /v1/models: it names the model and the methods
    authorize(request.headers, _service(request).config.auth_keys())
    return JSONResponse(request.app.state.openapi)


async def completions(request: HttpRequest) -> Any:
    """``POST /v1/completions``."""
    return await complete(request, chat=False)


async def chat_completions(request: HttpRequest) -> Any:
    """``POST /v1/chat/completions``."""
    return await complete(request, chat=True)


async def complete(request: HttpRequest, chat: bool) -> Any:
    """A generation request's response: a JSON body, an event stream, or an empty
    :data:`CLIENT_CLOSED` response (never read) when the client left before the end."""
    service = _service(request)
    request.state.tenant = authorize(request.headers, service.config.auth_keys())
    service.drain.check_open()  # 503 while draining, before any of the body is read
    body = await service.read_body(request)  # bounded; the drain does not wait for it
    with service.drain.entering():  # 503 while draining; the drain waits for it meanwhile
        api, ids, jobs, events = await service.accept(request, body, chat)
    ids_of = ResponseIds(service.config.model_name, chat)
    if api.stream:
        writer = ChunkWriter(service.tokenizer, api, ids_of, len(jobs))
        if service.config.stream_chunk_tokens is not None:
            events = FixedTokenChunks(events, service.config.stream_chunk_tokens)
        return StreamingResponse(stream_events(writer, jobs, events, len(ids), service.failure,
                                               service.cancel),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finished = await service.collect(request, events, jobs)
    if finished is None:  # nobody reads it; the metrics count what happened
        return Response(status_code=CLIENT_CLOSED)
    return response(service.tokenizer, api, ids_of, len(ids), jobs[0].method, finished)
