"""The Ray Serve ingress's relay (:class:`selfspec.cluster.forward.Forwarder`) when the
replica call fails: sent once more before anything was answered, a clear error otherwise.
No cluster: the replica call is a fake async generator."""

from __future__ import annotations

import asyncio
import json

from selfspec.cluster.forward import Forwarder

START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream")]}


def _serve(calls) -> list[dict]:
    """The messages the Forwarder sends for one POST, the replica calls answering as
    ``calls`` (one async-generator function per attempt) say."""
    attempts = iter(calls)
    sent: list[dict] = []
    body = json.dumps({"prompt": "hi"}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b""}
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(Forwarder(lambda request: next(attempts)(), 1 << 20)(scope, receive, send))
    return sent


async def _dies():
    raise RuntimeError("ActorDiedError: the replica died")
    yield  # an async generator


async def _answers():
    yield START
    yield {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": False}


async def _dies_after_answering():
    async for message in _answers():
        yield message
    raise RuntimeError("ActorDiedError: the replica died")


async def _dies_mid_stream():
    yield START
    yield {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    raise RuntimeError("ActorDiedError: the replica died")


def test_a_call_that_failed_before_answering_is_sent_once_more():
    sent = _serve([_dies, _answers])
    assert sent[0]["status"] == 200 and (b"x-selfspec-retried", b"1") in sent[0]["headers"]
    assert sent[-1] == {"type": "http.response.body", "body": b"data: {}\n\n",
                        "more_body": False}


def test_a_replica_dying_after_its_whole_answer_changes_nothing():
    assert _serve([_dies_after_answering]) == _serve([_answers])


def test_a_second_failure_answers_503_and_one_mid_stream_an_error_event():
    sent = _serve([_dies, _dies])
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["type"] == "server_error"
    sent = _serve([_dies_mid_stream])
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2
    last = sent[-1]["body"].decode()
    assert '"server_error"' in last and last.endswith("data: [DONE]\n\n")
    assert not sent[-1]["more_body"]
