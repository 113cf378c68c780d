"""The last phase of the mixed load test (:mod:`selfspec.bench.serve_load.mix`): SIGTERM while
requests are in flight.

One request per client (free text, logprobs or ``n = 2``: a JSON answer is a few tokens
and might end before the signal); once the server's scheduler holds them (``/health``'s running and
waiting rows) the server gets SIGTERM, and each client goes on sending until the server is
gone. A request sent before the signal must finish normally and equal its reference, or,
only if it outlives ``--drain-seconds``, end with a ``shutting_down`` error event and
``[DONE]`` (a 503 when not streamed); a request sent after the signal must get a 503
``shutting_down`` or no connection; the process must exit 0 within the bound and a margin.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time

from selfspec.bench.serve_load.client import Session
from selfspec.bench.serve_load.kinds import Answer, RequestKind, check, rotation, start
from selfspec.bench.serve_load.report import DrainResult
from selfspec.bench.serve_load.server import scheduler_rows

#: Problems quoted in the report (the counts cover them all).
EXAMPLES = 20
#: uvicorn looks at a received signal at its next tick (every 0.1 s): requests sent later
#: than this after the signal must be refused.
SIGNAL_SETTLE_S = 0.2
#: How often a client sends a request after the signal, seconds.
LATE_INTERVAL_S = 0.25
#: Before the signal: how long to wait for the scheduler to hold every last request, seconds.
IN_FLIGHT_WAIT_S = 10.0
#: A request ended at the drain bound must end no earlier than this before it, seconds.
BOUND_SLACK_S = 0.5


async def drain_phase(session: Session, server: subprocess.Popen, port: int, clients: int,
                      seed: int, bound: float, margin: float) -> DrainResult:
    """One request per client, SIGTERM once the scheduler holds them, then requests until
    the server is gone (see the module docstring)."""
    result = DrainResult(bound_s=bound, margin_s=margin)
    order = rotation(seed + 1)
    long_order = [kind for kind in order if kind.source != "json"]  # the in-flight requests
    picks = [random.Random(f"{seed}:drain:{c}") for c in range(clients)]
    signalled = asyncio.Event()
    signal_at = 0.0
    answered = [False] * clients  # each client's request sent before the signal
    ends: list[float] = []

    def next_request(c: int, k: int, kinds: list[RequestKind]) -> tuple[RequestKind, int]:
        kind = kinds[(start(c, clients, len(kinds)) + k) % len(kinds)]
        return kind, picks[c].randrange(session.prompts.count(kind.source))

    async def one_client(c: int) -> None:
        kind, index = next_request(c, 0, long_order)
        answer = await session.send(kind, index)
        answered[c] = True
        done_at = time.perf_counter()
        after = None
        if signalled.is_set():
            ends.append(done_at)
            after = done_at - signal_at
        _judge_in_flight(result, kind, index, answer, session, after)
        await signalled.wait()
        await asyncio.sleep(max(0.0, signal_at + SIGNAL_SETTLE_S - time.perf_counter()))
        k = 1
        while server.poll() is None and time.perf_counter() < signal_at + bound + margin:
            kind, index = next_request(c, k, order)
            k += 1
            answer = await session.send(kind, index)
            result.late_sent += 1
            if answer.status == 503 and answer.error_code == "shutting_down":
                result.late_503 += 1
            elif answer.status is None:
                result.late_refused += 1
                break  # the socket is closed: the server is leaving
            elif answer.status == 200:
                result.late_accepted += 1
                _example(result, f"late {kind.name}: served after the signal")
            else:
                result.late_other += 1
                _example(result, f"late {kind.name}: status {answer.status}, {answer.error}")
            await asyncio.sleep(LATE_INTERVAL_S)

    tasks = [asyncio.create_task(one_client(c)) for c in range(clients)]
    result.sent = clients
    rows = sum(long_order[start(c, clients, len(long_order))].n for c in range(clients))
    wait_until = time.perf_counter() + IN_FLIGHT_WAIT_S
    while time.perf_counter() < wait_until and not all(answered):
        if await asyncio.to_thread(scheduler_rows, port) >= rows:
            break
        await asyncio.sleep(0.05)
    signal_at = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    signalled.set()
    result.in_flight = answered.count(False)
    try:
        result.exit_code = await asyncio.to_thread(server.wait, bound + margin)
        result.exit_s = time.perf_counter() - signal_at
    except subprocess.TimeoutExpired:
        result.exit_code = None
    await asyncio.gather(*tasks)
    result.drain_s = max(ends, default=signal_at) - signal_at
    return result


def _judge_in_flight(result: DrainResult, kind: RequestKind, index: int, answer: Answer,
                     session: Session, after_signal: float | None) -> None:
    """Count a request that was sent before the signal."""
    if answer.finished_normally:
        problems = check(kind, answer, session.references[(kind.source, index)],
                         session.schema(kind, index))
        if not problems:
            result.completed += 1
            return
        detail = "; ".join(f"{p.category}: {p.detail}" for p in problems)
    elif answer.error_code == "shutting_down" and after_signal is not None \
            and after_signal >= result.bound_s - BOUND_SLACK_S \
            and (answer.status == 503 or (answer.status == 200 and answer.done)):
        result.ended_at_bound += 1  # past the bound: an error event and [DONE], or a 503
        return
    else:
        detail = (f"status {answer.status}, error {answer.error!r}, [DONE] {answer.done}, "
                  f"finish reasons {[c.finish_reason for c in answer.choices.values()]}, "
                  f"ended {after_signal} s after the signal")
    result.failed += 1
    _example(result, f"in flight {kind.name} prompt {index}: {detail}")


def _example(result: DrainResult, text: str) -> None:
    if len(result.examples) < EXAMPLES:
        result.examples.append(text)
