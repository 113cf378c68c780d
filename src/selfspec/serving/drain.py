"""Graceful shutdown of the server: drain, then end what is left, then exit.

On SIGTERM (or Ctrl+C) the server (:mod:`selfspec.serving.server`) calls :meth:`Drain.run`:

1. draining: new generation requests get a 503 with ``Retry-After`` and an OpenAI error
   body, ``/health`` answers 503 ``{"status": "draining"}`` so a load balancer stops sending;
   the listening socket stays open meanwhile (a refused connection tells a client less);
2. requests already accepted run to their end, streams with their ``finish_reason`` and
   ``data: [DONE]``, for at most ``drain_seconds``;
3. at that bound the requests still running or waiting are ended by the scheduler with
   :class:`~selfspec.serving.scheduler.ShutdownError`: a stream gets an error event and
   ``data: [DONE]``, a plain request a 503 body (never a silently cut connection);
4. then the server closes its socket, lets the last responses flush and exits with status 0.

A second signal ends the drain at once (step 3 now); uvicorn's own handling would close the
socket at the first signal and cut streams after its graceful-shutdown timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from selfspec.serving.protocol import ApiError
from selfspec.serving.scheduler import ShutdownError

logger = logging.getLogger(__name__)

#: How often the drain looks whether every request has finished, seconds.
POLL_SECONDS = 0.05
#: After the bound: how long ended requests may take to leave the scheduler (their current
#: step finishes first), seconds.
END_SECONDS = 10.0


class Unavailable(ApiError):
    """A 503 with a ``Retry-After`` header (seconds).

    Args:
        message: what is wrong and what to do.
        retry_after: seconds after which a retry may succeed.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(503, message, type="server_error", code="shutting_down")
        self.headers = {"Retry-After": str(retry_after)}


class Drain:
    """Whether the server drains, and the requests it still owes an answer.

    Args:
        scheduler: the server's :class:`~selfspec.serving.scheduler.Scheduler`.
        seconds: how long accepted requests may run once draining began (>= 0).
    """

    def __init__(self, scheduler: Any, seconds: float) -> None:
        self.scheduler = scheduler
        self.seconds = seconds
        self.draining = False
        self.ended = False  # the bound passed: requests still running were ended
        self._deadline = math.inf
        self._entering = 0  # requests past the draining check, not yet in the scheduler
        self._readers: set[asyncio.Timeout] = set()  # deadlines of bodies being read
        self._hurried: float | None = None  # when a second signal cut the drain short

    def refusal(self) -> Unavailable:
        """The 503 a new generation request gets while draining (``Retry-After``: the time
        left to the drain's bound, at least 1 s)."""
        left = self._deadline - time.monotonic()
        return Unavailable("the server is shutting down and takes no new requests; retry "
                           "(another replica, or this one once it is back)",
                           max(1, math.ceil(left)) if math.isfinite(left) else 1)

    def check_open(self) -> None:
        """Refuse a new generation request while draining.

        Raises:
            Unavailable: 503 while draining.
        """
        if self.draining:
            raise self.refusal()

    @contextmanager
    def reading(self, deadline: asyncio.Timeout) -> Iterator[None]:
        """Around the read of a request's body (not counted by the drain, which would
        otherwise wait on a client sending a byte at a time): when the drain ends,
        ``deadline`` is moved to now, so the read ends too."""
        self._readers.add(deadline)
        try:
            yield
        finally:
            self._readers.discard(deadline)

    @contextmanager
    def entering(self) -> Iterator[None]:
        """Around a generation request from its start to its submission to the scheduler:
        refused once draining began, and counted meanwhile so that the drain waits for it.

        Raises:
            Unavailable: 503 while draining.
        """
        if self.draining:
            raise self.refusal()
        self._entering += 1
        try:
            yield
        finally:
            self._entering -= 1

    def check_submit(self) -> None:
        """Right before submitting: a request that entered before draining may still run,
        but none is accepted after the bound.

        Raises:
            Unavailable: 503 once the bound has passed.
        """
        if self.ended:
            raise self.refusal()

    @property
    def idle(self) -> bool:
        """No request is entering, running or waiting."""
        return (self._entering == 0 and self.scheduler.running == 0
                and self.scheduler.waiting == 0)

    def hurry(self) -> None:
        """End the drain now (a second signal): requests still running are ended."""
        now = time.monotonic()
        self._hurried = now if self._hurried is None else self._hurried
        self._deadline = now

    async def run(self) -> None:
        """Drain (see the module docstring); returns when no request is left to answer or,
        after the bound, when the ended ones have left (at most :data:`END_SECONDS` more).
        Bodies still being read are cut when it returns (:meth:`reading`)."""
        started = time.monotonic()
        if not self.draining:
            self.draining = True
            self._deadline = min(self._deadline, started + self.seconds)
        logger.warning("draining: %d requests running, %d waiting; at most %.0f s",
                       self.scheduler.running, self.scheduler.waiting, self.seconds)
        try:
            await self._wait(started)
        finally:
            now = asyncio.get_running_loop().time()
            for deadline in list(self._readers):
                deadline.reschedule(now)

    async def _wait(self, started: float) -> None:
        while not self.idle and time.monotonic() < self._deadline:
            await asyncio.sleep(POLL_SECONDS)
        if self.idle:
            return
        self.ended = True
        logger.warning("drain bound reached: ending %d running and %d waiting requests",
                       self.scheduler.running, self.scheduler.waiting)
        self.scheduler.abort(ShutdownError(self._reason(started)))
        end = time.monotonic() + END_SECONDS
        while not self.idle and time.monotonic() < end:
            await asyncio.sleep(POLL_SECONDS)

    def _reason(self, started: float) -> str:
        """What the requests ended at the bound are told."""
        if self._hurried is not None:
            return (f"the server is shutting down: a second signal ended its drain after "
                    f"{max(0.0, self._hurried - started):.1f} s (of the {self.seconds:g} s "
                    "it allows), before the request finished")
        return (f"the server is shutting down: the request did not finish within the "
                f"{self.seconds:g} s it had to drain")
