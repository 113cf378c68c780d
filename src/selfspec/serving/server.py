"""uvicorn, as ``selfspec serve`` runs it: a draining shutdown and a header-read timeout.

uvicorn 0.29+ on SIGTERM / SIGINT closes the listening socket at once (new clients get
"connection refused"), waits ``timeout_graceful_shutdown`` for open connections and then
cancels them (a stream cut without ``finish_reason`` or ``[DONE]``), and re-raises the signal
after shutting down, so the process ends killed by it rather than with status 0.
:class:`DrainingServer` replaces its signal handling: the first signal starts
:meth:`~selfspec.serving.drain.Drain.run` (503s, in-flight requests finish, bounded), and only
then does uvicorn's own shutdown run, with nothing left to cut; the process exits 0.

uvicorn's h11 protocol has no timeout while a request's headers arrive: its keep-alive timer
runs only between requests and every byte received cancels it, so a client sending a header
line every few seconds (slowloris) holds a connection forever, as does one that connects and
sends nothing. :func:`header_timeout_protocol` closes a connection whose request line and
headers are not complete within the timeout from their first byte (or from the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from selfspec.serving.config import ServeConfig
from selfspec.serving.drain import Drain

logger = logging.getLogger(__name__)

#: After the drain: how long uvicorn waits for the last responses to be written, seconds.
FLUSH_SECONDS = 5


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request's headers.

    The deadline starts when the connection opens and, between requests, at the first byte
    of the next one (an idle keep-alive connection is uvicorn's ``timeout_keep_alive``'s);
    it ends when h11 has parsed the request line and headers. Subclass it with
    ``header_timeout`` set (:func:`header_timeout_protocol`).
    """

    header_timeout: float = ServeConfig.header_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_headers():
            self._arm()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            logger.info("closing a connection whose request headers took over %g s",
                        self.header_timeout)
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    """:class:`HeaderTimeoutProtocol` with a timeout of ``seconds``."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM / SIGINT drains (see the module docstring).

    Args:
        config: uvicorn's configuration.
        drain: the application's :class:`~selfspec.serving.drain.Drain`.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._signals = 0
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread's handlers
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # Unlike uvicorn, no re-raise of the signal: a drained shutdown is a clean exit.

    def _on_signal(self, sig: int, frame: Any) -> None:
        # A signal handler runs between bytecodes of the event loop's thread: only set
        # flags here; on_tick starts the drain.
        self._signals += 1
        if self._signals == 2:
            self.drain.hurry()
        elif self._signals > 2:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._signals and self._drain_task is None:
            logger.warning("shutting down: draining first")
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True


def run(app: Any, drain: Drain, host: str, port: int, log_level: str,
        header_timeout: float) -> None:
    """Serve ``app`` until a signal has drained it."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=header_timeout_protocol(header_timeout),
                            timeout_graceful_shutdown=FLUSH_SECONDS)
    DrainingServer(config, drain).run()
