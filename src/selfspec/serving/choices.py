"""What a finished row becomes in a response, the same for a whole response and for a
stream's last chunks: its finish reason, its tool calls, its log probabilities
(:func:`finish_choice`) and the request's usage (:func:`response_usage`); :func:`response`
is a whole (not streamed) response of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from selfspec.serving.metrics import acceptance_usage
from selfspec.serving.protocol import (
    FINISH_REASONS,
    ApiRequest,
    Choice,
    ResponseIds,
    TokenPieces,
    logprobs_body,
    response_body,
    usage,
)
from selfspec.serving.tools import ToolRequest, parse_answer


@dataclass(frozen=True)
class FinishedChoice:
    """One choice's answer once its row finished.

    Attributes:
        text: the content (with active tools: the text outside the calls).
        finish_reason: OpenAI's (``"stop"``, ``"length"``, ``"tool_calls"``).
        calls: the tool calls parsed from the text, or ``None``.
        entries: the row's per-token log probability entries (every token committed,
            the end-of-sequence token too: :class:`~selfspec.serving.protocol.TokenPieces`
            keeps those of the text), or ``None`` when not asked.
    """

    text: str
    finish_reason: str
    calls: list | None
    entries: list | None


def finish_choice(state: Any, text: str, tools: ToolRequest | None) -> FinishedChoice:
    """The answer of a finished row.

    Args:
        state: the row's finished :class:`~selfspec.decoding.core.state.DecodeState`.
        text: its text, cut at a stop string.
        tools: the request's tools; when active the text is parsed for calls
            (:func:`~selfspec.serving.tools.parse_answer`) and a call makes the finish
            reason ``"tool_calls"``.
    """
    finish = FINISH_REASONS.get(state.finish_reason, "stop")
    calls = None
    if tools is not None and tools.active:
        answer = parse_answer(text, tools)
        text, calls = answer.content, answer.calls or None
        if calls:
            finish = "tool_calls"
    return FinishedChoice(text, finish, calls, logprob_entries(state))


def logprob_entries(state: Any) -> list | None:
    """The finished ``state``'s per-token log probabilities, or ``None`` when not asked."""
    processor = state.processor
    if state.options.processing.logprobs is None or processor is None:
        return None
    return list(processor.logprobs)


def response_usage(prompt_tokens: int, method: str, states: Sequence[Any]) -> dict:
    """A request's ``usage``: its prompt, every choice's tokens, the prefix cache's share
    and ``selfspec`` (how the draft tokens fared, :func:`acceptance_usage`).

    Args:
        prompt_tokens: the prompt's length, tokens (the choices share one prompt).
        method: the method the rows ran.
        states: every choice's finished state (at least one).
    """
    stats = [state.stats for state in states]
    generated = sum(state.num_generated for state in states)
    cached = max(s.cached_tokens for s in stats)  # the choices share one prompt
    return usage(prompt_tokens, generated, cached) | {
        "selfspec": acceptance_usage(method, *stats)}


def response(tokenizer: Any, api: ApiRequest, ids_of: ResponseIds, prompt_tokens: int,
             method: str, finished: Mapping[int, tuple]) -> dict:
    """The JSON body of a whole response.

    Args:
        tokenizer: the event loop's tokenizer (the log probabilities' token texts).
        api: the request.
        ids_of: the response's id, creation time and model.
        prompt_tokens: the prompt's length, tokens.
        method: the method the rows ran.
        finished: each choice's ``("done", index, state, text, None)`` event by index.
    """
    choices, states = [], []
    for index, (_, _, state, text, _) in sorted(finished.items()):
        done = finish_choice(state, text, api.tools)
        logprobs = None
        if done.entries is not None:
            pieces = TokenPieces(tokenizer)
            pieces.add(done.entries)
            logprobs = logprobs_body(tokenizer, pieces.finish(len(text)), ids_of.chat)
        choices.append(Choice(index, done.text, done.finish_reason, logprobs, done.calls))
        states.append(state)
    return response_body(ids_of, choices, response_usage(prompt_tokens, method, states))
