"""An HTTP request passed from the Ray Serve ingress to an engine replica, and the ASGI calls
on both sides: :class:`Forwarder` (the ingress's ASGI app: reads the request, sends it to a
replica, relays the response as it streams) and :func:`call_app` (the replica runs
selfspec's own FastAPI app on it). Every route, check, stream and error of ``selfspec
serve`` is the replica's app's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_ROUTING_CHARS = 8192  # prompt characters the router matches prefixes on
RETRIES = 1  # a request whose replica failed before answering is sent again this often


@dataclass(frozen=True)
class RoutedRequest:
    """One HTTP request, whole.

    Attributes:
        method, path, query_string, headers: the ASGI scope's (headers as raw byte pairs).
        body: the request body.
        prompt: the text the router matches prefixes on (:func:`routing_text`); Ray Serve's
            ``PrefixCacheAffinityRouter`` reads this attribute.
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prompt: str


def routing_text(body: bytes) -> str:
    """The start of a generation request's prompt: a chat's message contents joined, or a
    completion's prompt text; ``""`` for any other body (it is routed by load alone)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(obj, dict):
        return ""
    messages, prompt = obj.get("messages"), obj.get("prompt")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        text = "\n".join(p for p in parts if isinstance(p, str))
    elif isinstance(prompt, str):
        text = prompt
    else:
        return ""
    return text[:_ROUTING_CHARS]


async def call_app(app: Any, request: RoutedRequest,
                   disconnected: asyncio.Event) -> AsyncIterator[dict]:
    """Run the ASGI ``app`` on ``request``: its ``http.response.start`` and
    ``http.response.body`` messages as it sends them. ``disconnected`` set: the app's next
    ``receive`` says the client left (its cancellation path)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query_string,
             "root_path": "", "headers": [list(h) for h in request.headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
        await task
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


class Forwarder:
    """The ingress's ASGI app: each HTTP request read whole (at most ``max_body_bytes``, else
    a 413 as the server gives), sent to an engine replica through ``call`` and its response
    relayed as the replica's app sends it; a client that leaves cancels the call.

    Args:
        call: ``RoutedRequest`` → async iterator of the replica's ASGI messages (a Ray Serve
            streaming handle call).
        max_body_bytes: the server's body limit.
        health: async, the replicas' readiness (``{"ready": n, "total": m}``), added to
            ``/health``'s answer.
        metrics: async, every replica's metrics as one Prometheus text
            (:func:`selfspec.cluster.metrics.merge`), answering ``/metrics`` in place of the
            one replica's text once that replica's app let the request through (its API-key
            check).
        retryable: whether a call that failed with this error before answering is sent
            once more (``None``: every error; the ingress excludes Ray Serve's
            ``BackPressureError``, a full queue).
    """

    def __init__(self, call: Callable[[RoutedRequest], AsyncIterator[dict]],
                 max_body_bytes: int,
                 health: Callable[[], Awaitable[dict]] | None = None,
                 metrics: Callable[[], Awaitable[bytes]] | None = None,
                 retryable: Callable[[Exception], bool] | None = None) -> None:
        self.call = call
        self.retryable = retryable or (lambda err: True)
        self.max_body_bytes = max_body_bytes
        self.rewrites = {"/health": health and self._with_replicas,
                         "/metrics": metrics and self._merged_metrics}
        self.health = health
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await self._body(receive)
        if body is None:
            await _error(send, 413, f"the body exceeds {self.max_body_bytes} bytes")
            return
        request = RoutedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
                                body, routing_text(body))
        if (rewrite := self.rewrites.get(scope["path"])) is not None:
            await self._rewritten(request, send, rewrite)
            return
        relay = asyncio.create_task(self._relay(request, send))
        left = asyncio.create_task(_wait_disconnect(receive))
        done, _ = await asyncio.wait({relay, left}, return_when=asyncio.FIRST_COMPLETED)
        for task in (relay, left):
            if task not in done:
                task.cancel()
        if relay in done:
            relay.result()

    async def _body(self, receive: Callable) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _relay(self, request: RoutedRequest, send: Callable) -> None:
        """Relay the replica's answer. A call that fails before the replica sent anything
        (a replica that died with the request queued or mid-generation: a non-streamed
        answer is sent whole at its end) is sent once more, where the router then sends it
        (Ray Serve drops a dead replica from its choices); failing again, or failing after
        the answer started, the client gets a clear error (:func:`_failed`). A response
        sent again is headed ``x-selfspec-retried: 1``."""
        for attempt in range(RETRIES + 1):
            messages = aiter(self.call(request))
            started = False
            while True:
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    return
                except Exception as err:  # noqa: BLE001 - Ray's errors for a dead replica vary
                    if started or attempt == RETRIES or not self.retryable(err):
                        await _failed(send, started, err)
                        return
                    logger.warning("replica call failed before answering (%s); sent again",
                                   err)
                    break
                if attempt and message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-selfspec-retried", b"1")]}
                started = True
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    return  # answered whole: a replica dying after this loses nothing

    async def _rewritten(self, request: RoutedRequest, send: Callable,
                         rewrite: Callable[[bytes], Awaitable[bytes]]) -> None:
        """The replica's answer to ``request``, its body rewritten when it is a 200."""
        messages = [m async for m in self.call(request)]
        start = messages[0]
        body = b"".join(m.get("body", b"") for m in messages[1:])
        if start.get("status") == 200:
            body = await rewrite(body)
        headers = [(k, v) for k, v in start["headers"] if bytes(k).lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _with_replicas(self, body: bytes) -> bytes:
        try:
            answer = json.loads(body)
            answer["replicas"] = await self.health()
            return json.dumps(answer).encode()
        except (ValueError, TypeError) as err:  # not the app's JSON: relayed as it is
            logger.debug("health answer not extended: %s", err)
            return body

    async def _merged_metrics(self, body: bytes) -> bytes:
        return await self.metrics()


async def _wait_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Callable, send: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _error(send: Callable, status: int, message: str,
                 type: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": type,
                                 "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _failed(send: Callable, started: bool, err: Exception) -> None:
    """Tell the client its replica failed: a 503 before the answer started; after it (a
    stream), an error event and ``[DONE]``, as the app ends a stream whose row failed."""
    message = (f"the request failed on its replica ({type(err).__name__}: "
               f"{str(err)[:200]}); retry it")
    logger.warning("replica call failed: %s", err)
    if not started:
        await _error(send, 503, message, "server_error")
        return
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": None}}
    await send({"type": "http.response.body", "more_body": False,
                "body": b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"})
