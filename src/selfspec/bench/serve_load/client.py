"""The clients of the mixed load test (:mod:`selfspec.bench.serve_load.mix`): they send the
kinds of :mod:`selfspec.bench.serve_load.kinds` with the official ``openai`` client, read the
answers raw, and count what they received to compare with the server's ``/metrics``."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from selfspec.bench.serve_load.kinds import (
    Answer,
    Limits,
    Prompts,
    RequestKind,
    StreamReader,
    read_body,
    request_params,
)


@dataclass
class Tally:
    """What the clients counted themselves, to compare with ``/metrics``.

    Attributes:
        http: responses received, by ``(endpoint, status)``.
        generation_tokens: ``usage.completion_tokens`` of every answer, summed.
        finished: choices received with a ``finish_reason``, by reason.
    """

    http: Counter = field(default_factory=Counter)
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)

    def response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response."""
        self.http[(endpoint, status)] += 1

    def answered(self, answer: Answer) -> None:
        """Count an answer's tokens and finished choices."""
        if answer.status == 200:
            self.generation_tokens += answer.completion_tokens or 0
            for choice in answer.choices.values():
                if choice.finish_reason is not None:
                    self.finished[choice.finish_reason] += 1


class Session:
    """The clients' connection to the server and what they share.

    Args:
        client: an ``openai.AsyncOpenAI`` client (no retries).
        model: the served model's name.
        prompts / limits: what the kinds ask.
        selfspec: each request's ``selfspec`` field (method and options).
        tally: where every response is counted.
    """

    def __init__(self, client: Any, model: str, prompts: Prompts, limits: Limits,
                 selfspec: dict, tally: Tally) -> None:
        self.client = client
        self.model = model
        self.prompts = prompts
        self.limits = limits
        self.selfspec = selfspec
        self.tally = tally
        self.references: dict[tuple[str, int], Answer] = {}

    def schema(self, kind: RequestKind, index: int) -> dict | None:
        """The JSON schema of a json kind's prompt, else ``None``."""
        return self.prompts.json[index].schema if kind.source == "json" else None

    async def send(self, kind: RequestKind, index: int, logprobs: bool | None = None) -> Answer:
        """Send ``kind`` on prompt ``index`` and read its whole answer (raw: a stream's
        lines as sent, so that a missing ``[DONE]`` shows), counting it in the tally."""
        import openai

        params = request_params(kind, self.prompts, index, self.model, self.limits,
                                self.selfspec, logprobs)
        resource = self.client.chat.completions if kind.chat else self.client.completions
        started = time.perf_counter()
        reader = StreamReader(kind.chat, started, time.perf_counter)
        answer = reader.answer
        try:
            async with resource.with_streaming_response.create(**params) as response:
                self.tally.response(kind.endpoint, response.status_code)
                answer.status = response.status_code
                if kind.stream:
                    async for line in response.iter_lines():
                        reader.feed(line)
                else:
                    answer = read_body(await response.json(), kind.chat, response.status_code)
        except openai.APIStatusError as error:
            self.tally.response(kind.endpoint, error.status_code)
            answer = Answer(status=error.status_code)
            body = error.body
            answer.set_error(body if isinstance(body, dict) and "error" in body
                             else {"error": body} if isinstance(body, dict) else str(error))
        except openai.APIConnectionError as error:  # refused, or cut before a response
            answer.error = f"{type(error).__name__}: {error.__cause__ or error}"[:300]
        except Exception as error:  # noqa: BLE001 - a stream cut midway: reported
            answer.done = False
            answer.error = f"{type(error).__name__}: {error}"[:300]
        answer.seconds = time.perf_counter() - started
        self.tally.answered(answer)
        return answer
