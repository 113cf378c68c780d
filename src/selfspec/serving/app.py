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

The pieces: :class:`~selfspec.serving.config.ServeConfig` (how it runs),
:class:`~selfspec.serving.service.Service` (the engine, scheduler, drain and metrics, and a
generation request's checks and submission), :mod:`~selfspec.serving.routes` (the handlers),
:mod:`~selfspec.serving.choices` and :mod:`~selfspec.serving.streaming` (a finished row as a
response or as a stream's chunks).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from selfspec.errors import MissingDependencyError
from selfspec.methods.options import model_symbols
from selfspec.methods.registry import METHODS
from selfspec.serving.config import ServeConfig
from selfspec.serving.metrics import HttpMetrics
from selfspec.serving.openapi import openapi_document
from selfspec.version import __version__

__all__ = ["ServeConfig", "create_app", "serve", "warm_up"]

_MISSING = "selfspec serve needs FastAPI and uvicorn: pip install 'selfspec[serve]'"


def create_app(engine: Any, config: ServeConfig) -> Any:
    """The ASGI application serving ``engine``; ``app.state.service`` is its
    :class:`~selfspec.serving.service.Service` (``app.state.scheduler``, ``.drain`` and
    ``.metrics`` its parts), ``app.state.openapi`` its OpenAPI document.

    Raises:
        MissingDependencyError: FastAPI or prometheus-client is not installed
            (``pip install 'selfspec[serve]'``).
        InvalidArgumentError: the default method or its options are invalid for the model.
    """
    try:
        import fastapi
        import jinja2  # noqa: F401 - the chat templates' errors
        import starlette  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(_MISSING) from error
    # These need FastAPI and jinja2, present now.
    from selfspec.serving import routes
    from selfspec.serving.service import Service

    service = Service(engine, config)
    # FastAPI's own document would describe handlers that read raw JSON: none of the bodies.
    app = fastapi.FastAPI(title="selfspec", lifespan=_lifespan, docs_url=None,
                          redoc_url=None, openapi_url=None)
    app.state.openapi = openapi_document(
        config.model_name, config.limits, engine.vocab_size, METHODS,
        model_symbols(engine.executor), api_key=bool(config.auth_keys()),
        health_auth=config.health_auth, asset_names=service.assets_dir is not None,
        version=__version__)
    app.state.service = service
    app.state.scheduler = service.scheduler
    app.state.drain = service.drain
    app.state.metrics = service.metrics
    app.add_middleware(HttpMetrics, metrics=service.metrics, routes=app.routes)
    routes.add_error_handlers(app)
    routes.add_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    """Warm the default method up and run the scheduler while the app serves."""
    service = app.state.service
    warm_up(service.engine, service.config.method, service.config.method_options)
    service.scheduler.start()
    try:
        yield
    finally:
        service.scheduler.close()


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
        raise MissingDependencyError(_MISSING) from error
    app = create_app(engine, config)
    server.run(app, app.state.drain, host, port, log_level, config.header_timeout)
