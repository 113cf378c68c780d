"""A generation request's answer as server-sent events: a chunk per text delta of each
choice (with its tokens' log probabilities), each choice's last chunk with its finish reason
(:func:`~selfspec.serving.choices.finish_choice`: with active tools the answer is sent whole
when done, as content and/or calls), the usage chunk when asked, then ``data: [DONE]``.
A failed row ends the stream with its error event and ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from selfspec.serving.choices import finish_choice, response_usage
from selfspec.serving.protocol import (
    ApiError,
    ApiRequest,
    ResponseIds,
    TextDeltas,
    TokenPieces,
    chunk_body,
    logprobs_body,
    usage_chunk,
)
from selfspec.serving.scheduler import Request

DONE = b"data: [DONE]\n\n"


def event(body: dict) -> bytes:
    """One server-sent event carrying ``body`` as JSON (UTF-8, not ASCII-escaped)."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


class ChunkWriter:
    """The chunks of one streamed response's ``n`` choices.

    Args:
        tokenizer: the event loop's tokenizer.
        api: the request.
        ids_of: the response's id, creation time and model.
        choices: how many choices (rows) it streams.
    """

    def __init__(self, tokenizer: Any, api: ApiRequest, ids_of: ResponseIds,
                 choices: int) -> None:
        self.tokenizer = tokenizer
        self.api = api
        self.ids_of = ids_of
        self.deltas = [TextDeltas(tokenizer, api.stop) for _ in range(choices)]
        self.tools_active = api.tools is not None and api.tools.active
        self.offsets = [0] * choices  # completions' text_offset of each choice's next token
        self.opened = [False] * choices  # a chunk with the role was sent
        # each choice's tokens' logprobs, sent with the text they make (none past its end)
        self.pieces = [TokenPieces(tokenizer) for _ in range(choices)]

    def opening(self) -> list[bytes]:
        """Chat: each choice's first chunk, the assistant's role alone; completions: none."""
        if not self.ids_of.chat:
            return []
        out = []
        for index in range(len(self.opened)):
            out.append(event(chunk_body(self.ids_of, "", None, role=True, index=index)))
            self.opened[index] = True
        return out

    def tokens(self, index: int, tokens: list[int], entries: list | None) -> bytes | None:
        """The chunk of choice ``index``'s newly committed ``tokens``, or ``None`` when they
        add no text yet (held back, or tools active: the answer may be calls)."""
        if self.tools_active:
            return None
        deltas = self.deltas[index]
        text = deltas.push(tokens)
        logprobs = None
        if entries is not None:
            self.pieces[index].add(entries)
            logprobs = self._logprobs(index, self.pieces[index].take(deltas.sent))
        if not text and logprobs is None:
            return None
        chunk = chunk_body(self.ids_of, text, None, role=not self.opened[index], index=index,
                           logprobs=logprobs)
        self.opened[index] = True
        return event(chunk)

    def finished(self, index: int, state: Any, text: str) -> list[bytes]:
        """The last chunks of choice ``index``, whose row finished with ``text``."""
        done = finish_choice(state, text, self.api.tools)
        out = []
        pieces = self.pieces[index]
        if self.tools_active:
            if done.entries is not None:
                pieces.add(done.entries)
            logprobs = self._logprobs(index, pieces.finish(len(text)))
            if done.calls or done.text or logprobs is not None:
                out.append(event(chunk_body(self.ids_of, done.text, None, index=index,
                                            logprobs=logprobs, calls=done.calls)))
            rest, logprobs = None, None
        else:
            rest = self.deltas[index].finish(text)
            logprobs = self._logprobs(index, pieces.finish(len(text)))
        out.append(event(chunk_body(self.ids_of, rest, done.finish_reason,
                                    role=not self.opened[index], index=index,
                                    logprobs=logprobs)))
        return out

    def _logprobs(self, index: int, pieces: list) -> dict | None:
        """The ``logprobs`` of ``pieces`` (:class:`TokenPieces`), ``None`` without any or
        when the request asked for none."""
        if self.api.logprobs is None or not pieces:
            return None
        body = logprobs_body(self.tokenizer, pieces, self.ids_of.chat, self.offsets[index])
        self.offsets[index] += sum(len(piece) for _, piece in pieces)
        return body


async def stream_events(writer: ChunkWriter, jobs: Sequence[Request], events: asyncio.Queue,
                        prompt_tokens: int, failure: Callable[[BaseException], ApiError],
                        cancel: Callable[[Sequence[Request]], None]) -> AsyncIterator[bytes]:
    """The response's events, from the rows' ``("tokens", ...)`` and ``("done", ...)``
    events on ``events`` until every row finished or one failed.

    Args:
        writer: the response's chunks.
        jobs: the request's rows, one per choice; cancelled with ``cancel`` when the
            stream ends (a disconnect ends it too; a finished row ignores it).
        events: what the rows' callbacks post (:class:`~selfspec.serving.service.Service`).
        prompt_tokens: the prompt's length, for the usage chunk.
        failure: what the client is told of a row's error.
        cancel: cancels the rows (:meth:`~selfspec.serving.service.Service.cancel`).
    """
    states: list[Any] = []
    try:
        for chunk in writer.opening():
            yield chunk
        while True:
            item = await events.get()
            if item[0] == "tokens":
                chunk = writer.tokens(*item[1:])
                if chunk is not None:
                    yield chunk
                continue
            _, index, state, text, error = item
            if error is not None:
                yield event(failure(error).body())
                break
            for chunk in writer.finished(index, state, text):
                yield chunk
            states.append(state)
            if len(states) == len(jobs):
                if writer.api.include_usage:
                    use = response_usage(prompt_tokens, jobs[0].method, states)
                    yield event(usage_chunk(writer.ids_of, use))
                break
        yield DONE
    finally:
        cancel(jobs)


class FixedTokenChunks:
    """A row-event queue whose ``("tokens", index, tokens, entries)`` events carry exactly
    ``size`` tokens each (a choice's last one, posted just before its ``"done"``, fewer): a
    stream's chunk sizes then no longer show how many drafts each decoding step accepted,
    the per-iteration side channel of Wei et al., "When Speculation Spills Secrets"
    (arXiv 2411.01076; its iteration-wise aggregation). ``--stream-chunk-tokens N``.

    Args:
        events: the rows' event queue (:class:`~selfspec.serving.service.Service`); only
            its ``get`` is used, as :func:`stream_events` does.
        size: tokens a chunk (>= 1).
    """

    def __init__(self, events: asyncio.Queue, size: int) -> None:
        self.events = events
        self.size = size
        self._tokens: dict[int, list[int]] = {}  # per choice, tokens not yet posted
        self._entries: dict[int, list | None] = {}  # their logprob entries, if any
        self._ready: list[tuple] = []

    async def get(self) -> tuple:
        """The next event, as :class:`asyncio.Queue`'s ``get``."""
        while not self._ready:
            item = await self.events.get()
            if item[0] == "tokens":
                self._add(*item[1:])
            else:
                self._flush(item[1], last=True)
                self._ready.append(item)
        return self._ready.pop(0)

    def _add(self, index: int, tokens: list[int], entries: list | None) -> None:
        self._tokens.setdefault(index, []).extend(tokens)
        if entries is not None:
            self._entries.setdefault(index, []).extend(entries)  # one entry a token
        self._flush(index, last=False)

    def _flush(self, index: int, last: bool) -> None:
        tokens, entries = self._tokens.get(index, []), self._entries.get(index)
        while len(tokens) >= self.size or (last and tokens):
            n = min(self.size, len(tokens))
            self._ready.append(("tokens", index, tokens[:n],
                                None if entries is None else entries[:n]))
            tokens = tokens[n:]
            entries = None if entries is None else entries[n:]
        self._tokens[index], self._entries[index] = tokens, entries
