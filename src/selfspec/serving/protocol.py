"""The OpenAI completions / chat completions protocol: request validation, response and
stream-chunk bodies, error bodies. Pure functions of JSON values (no HTTP here).

Field meanings follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``): ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature`` in [0, 2] (default 1), ``top_p`` in (0, 1], ``seed``, ``stop`` (a string or up
to 4), ``n`` (choices, each a row of the running batch), ``stream`` (+
``stream_options.include_usage``), ``presence_penalty`` / ``frequency_penalty`` in [-2, 2],
``logprobs`` (completions: the number of alternatives, 0-20; chat: a bool, with
``top_logprobs`` 0-20), ``response_format`` (``text``, ``json_object``, ``json_schema``;
selfspec adds ``{"type": "regex", "regex": ...}`` and ``{"type": "lark", "lark": ...}``; on
completions too), ``finish_reason`` ``"stop"`` (EOS or a stop string) or ``"length"``
(``max_tokens`` or the model's context), ``usage``. selfspec's own choice of method rides in
an extra field::

    {"selfspec": {"method": "ngram", "options": {"max_draft_len": 8}}}

(``extra_body=`` in the ``openai`` client). Parameters selfspec cannot honour (``echo``,
``best_of`` other than ``n``, ``suffix``, ``logit_bias``) are refused with a 400 instead of
being silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The log probability answered for a token that cannot be generated (OpenAI's value).
IMPOSSIBLE_LOGPROB = -9999.0

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                  "cancelled": "stop"}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "user", "logprobs", "presence_penalty", "frequency_penalty",
           "logit_bias", "selfspec", "top_k"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_COMPLETION_FIELDS |= {"response_format"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                          "response_format", "parallel_tool_calls", "tools", "tool_choice"}
_FORMATS = ("text", "json_object", "json_schema", "regex", "lark")
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {...}}``.

    Args:
        status: HTTP status.
        message: what went wrong and what to do.
        type: OpenAI error type (``invalid_request_error``, ...).
        param: the offending parameter, if any.
        code: a short machine-readable code, if any.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the server accepts.

    Attributes:
        max_body_bytes: largest request body.
        max_prompt_tokens: longest prompt (after the chat template), tokens.
        max_tokens: largest ``max_tokens``.
        default_max_tokens: ``max_tokens`` when a request gives none (completions: OpenAI's
            16 unless this is smaller; chat: this).
        max_n: most choices (``n``) one request may ask for.
    """

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    default_max_tokens: int = 256
    max_n: int = 8


@dataclass(frozen=True)
class ApiRequest:
    """A validated completions or chat completions request.

    Attributes:
        chat: a chat completions request (``messages``).
        prompt: the text prompt, or ``None`` when token ids were given.
        prompt_ids: token ids given directly, or ``None``.
        messages: the chat messages (``{"role", "content"}`` with string content).
        max_tokens / temperature / top_p / top_k / seed / stop / stream / include_usage: as
            in the OpenAI API.
        method / method_options: selfspec's method for this request (``None``: the
            server's).
        n: choices to generate (each a row of the batch).
        logprobs: ``None`` (none), or the number of alternatives per token (0-20).
        presence_penalty / frequency_penalty: OpenAI's penalties.
        response_format: the structured-output constraint, or ``None``.
        tools: the request's tools (:class:`~selfspec.serving.tools.ToolRequest`), or
            ``None``.
    """

    chat: bool
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    method: str | None = None
    method_options: Mapping[str, Any] = field(default_factory=dict)
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: Mapping[str, Any] | None = None
    tools: Any = None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _number(body: Mapping, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number; got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(f"'{name}' must be in {bracket}{low}, {high}]; got {value}", name)
    return float(value)


def _integer(body: Mapping, name: str, default: int | None, low: int,
             high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has numbers: 2.0 is the integer 2 (as in JSON Schema)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer; got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise _bad(f"'{name}' must be {bound}; got {value}", name)
    return value


def _same(value: Any, allowed: Sequence[Any]) -> bool:
    """``value`` is one of ``allowed`` with its JSON type too (``0 == False`` in Python, and
    ``1.0 == 1``)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def _unsupported(body: Mapping, name: str, allowed: Sequence[Any]) -> None:
    if name in body and not _same(body[name], allowed):
        raise _bad(f"'{name}'={body[name]!r} is not supported by selfspec serve "
                   f"(supported: {', '.join(map(repr, allowed))})", name)


_KINDS = {str: "a string", bool: "a boolean", dict: "an object"}


def check_types(value: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]], where: str,
                param: str) -> None:
    """Check the optional fields of ``value`` the server does not use (a message's ``name``,
    a tool's ``description``, ...) against their OpenAI types (``null`` passes): a client's
    mistake is a 400, not silently accepted.

    Raises:
        ApiError: 400 naming ``where.field``.
    """
    for name, types in fields.items():
        item = value.get(name)
        if item is not None and not (type(item) in types):
            kinds = " or ".join(_KINDS[t] for t in types)
            raise _bad(f"{where}.{name} must be {kinds}; got {item!r}", param)


def _absent_as(value: Any, default: Any) -> Any:
    """``default`` when ``value`` is ``None`` (JSON ``null`` or missing), else ``value``."""
    return default if value is None else value


def _stop(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > 4:
        raise _bad(f"'stop' takes at most 4 strings; got {len(stop)}", "stop")
    return tuple(s for s in stop if s)


def _prompt(body: Mapping) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt given as a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty", "prompt")
        return prompt, None
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("selfspec serve takes one prompt per request; send the prompts as separate "
                   "(concurrent) requests", "prompt")
    raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _messages(body: Mapping) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects",
                   "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {role!r}",
                       "messages")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    and c.get("type") in (None, "function") for c in calls):
                raise _bad(f"messages[{i}].tool_calls must be a list of {{\"function\": "
                           "{\"name\", \"arguments\"}} on an assistant message", "messages")
            for j, call in enumerate(calls):
                check_types(call, {"id": (str,)}, f"messages[{i}].tool_calls[{j}]", "messages")
                check_types(call["function"], {"arguments": (str, dict)},
                            f"messages[{i}].tool_calls[{j}].function", "messages")
            if content is None:
                content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}].content parts must be text parts "
                           "({'type': 'text', 'text': ...})", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", "messages")
        check_types(message, {"name": (str,)}, f"messages[{i}]", "messages")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": content}
        if calls is not None:
            entry["tool_calls"] = calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise _bad(f"messages[{i}].tool_call_id must be a string", "messages")
            entry["tool_call_id"] = call_id
        out.append(entry)
    return out


def parse_request(body: Any, chat: bool, limits: Limits) -> ApiRequest:
    """Validate a request body.

    Args:
        body: the decoded JSON body.
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        limits: the server's limits.

    Returns:
        :class:`ApiRequest`.

    Raises:
        ApiError: 400 with the parameter at fault for anything malformed or unsupported.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    if not isinstance(body.get("model"), str):
        raise _bad("'model' must be given as a string (see /v1/models)", "model")
    n = _integer(body, "n", 1, 1, limits.max_n)
    _unsupported(body, "echo", (None, False))
    if _integer(body, "best_of", n, 1, limits.max_n) != n:
        raise _bad(f"'best_of' is not supported apart from best_of = n ({n})", "best_of")
    _unsupported(body, "suffix", (None,))
    _unsupported(body, "logit_bias", (None, {}))
    logprobs = _logprobs(body, chat)
    response_format = _response_format(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    # `null` is "not given" (as everywhere); other falsy values (0, "", false) are errors.
    options = _absent_as(body.get("stream_options"), {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("'user' must be a string", "user")
    default = limits.default_max_tokens if chat else min(16, limits.default_max_tokens)
    max_tokens = _integer(body, "max_tokens", default, 1, limits.max_tokens)
    if chat:  # the newer name wins; both are checked
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1, limits.max_tokens)
    extra = _absent_as(body.get("selfspec"), {})
    if not isinstance(extra, dict) or set(extra) - {"method", "options"}:
        raise _bad("'selfspec' must be {\"method\": name, \"options\": {...}}", "selfspec")
    method = extra.get("method")
    method_options = _absent_as(extra.get("options"), {})
    if method is not None and not isinstance(method, str):
        raise _bad("'selfspec.method' must be a method name (GET /v1/models lists them)",
                   "selfspec")
    if not isinstance(method_options, dict):
        raise _bad("'selfspec.options' must be an object of option values", "selfspec")
    if method is None and method_options:
        # The server's method and options are the operator's: options alone would be
        # silently dropped.
        raise _bad("'selfspec.options' needs 'selfspec.method' (the method they are for)",
                   "selfspec")
    common = {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "top_k": _integer(body, "top_k", 0, 0),
        "seed": _integer(body, "seed", None, -(2 ** 63), 2 ** 63 - 1),
        "stop": _stop(body), "stream": stream, "include_usage": bool(options.get("include_usage")),
        "method": method, "method_options": method_options, "n": n, "logprobs": logprobs,
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "response_format": response_format}
    if chat:  # tools: parsed by selfspec.serving.tools.parse_tools (the app sets them)
        return ApiRequest(chat=True, messages=_messages(body), **common)
    prompt, ids = _prompt(body)
    return ApiRequest(chat=False, prompt=prompt, prompt_ids=ids, **common)


def _logprobs(body: Mapping, chat: bool) -> int | None:
    """Alternatives per token, or ``None``: completions take ``logprobs: int``, chat takes
    ``logprobs: bool`` and ``top_logprobs: int`` (which needs ``logprobs: true``)."""
    if not chat:
        return _integer(body, "logprobs", None, 0, 20)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("'logprobs' must be a boolean on chat completions (top_logprobs gives the "
                   "number of alternatives)", "logprobs")
    top = _integer(body, "top_logprobs", None, 0, 20)
    if top is not None and not wanted:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _response_format(body: Mapping) -> Mapping[str, Any] | None:
    """The ``response_format`` object (its schema is checked when compiled), or ``None``."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in _FORMATS:
        raise _bad(f"'response_format' must be an object with 'type' one of "
                   f"{', '.join(_FORMATS)}", "response_format")
    wrapper = value.get("json_schema") if value["type"] == "json_schema" else None
    if isinstance(wrapper, dict):  # its schema is checked when compiled
        check_types(wrapper, {"name": (str,), "description": (str,), "strict": (bool,)},
                    "response_format.json_schema", "response_format")
    return None if value["type"] == "text" else value


def check_prompt_length(num_tokens: int, limits: Limits, context: int) -> None:
    """Refuse a prompt over the server's limit or filling the model's context.

    Raises:
        ApiError: 400, code ``context_length_exceeded``.
    """
    if num_tokens > limits.max_prompt_tokens or num_tokens >= context:
        limit = min(limits.max_prompt_tokens, context - 1)
        raise ApiError(400, f"the prompt has {num_tokens} tokens; this server takes at most "
                            f"{limit}. Shorten the prompt.", param="prompt",
                       code="context_length_exceeded")


def sampling_seed(seed: int | None) -> int | None:
    """OpenAI seeds may be negative or 64-bit; torch generators take ``[0, 2^64)``."""
    return None if seed is None else seed % (2 ** 64)


@dataclass
class ResponseIds:
    """The id, creation time and model name every chunk of one response repeats."""

    model: str
    chat: bool
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The ``usage`` object (``prompt_tokens_details.cached_tokens``: prompt tokens whose KV
    came from the prefix cache, as OpenAI reports its prompt caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Choice:
    """One finished choice of a response.

    Attributes:
        index: its place among the request's ``n`` choices.
        text: the generated text (cut at a stop string).
        finish: the OpenAI finish reason.
        logprobs: the OpenAI ``logprobs`` object (:func:`logprobs_body`), or ``None``.
        tool_calls: OpenAI ``tool_calls`` entries (chat), or ``None``.
    """

    index: int
    text: str | None
    finish: str
    logprobs: dict | None = None
    tool_calls: list[dict] | None = None


def response_body(ids: ResponseIds, choices: Sequence[Choice], use: dict) -> dict:
    """A non-streamed response with ``choices`` in index order."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        if ids.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            out.append({"index": c.index, "message": message, "logprobs": c.logprobs,
                        "finish_reason": c.finish})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": c.logprobs,
                        "finish_reason": c.finish})
    kind = "chat.completion" if ids.chat else "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model,
            "choices": out, "usage": use}


def chunk_body(ids: ResponseIds, text: str | None, finish: str | None,
               role: bool = False, index: int = 0, logprobs: dict | None = None,
               calls: list[dict] | None = None) -> dict:
    """One streamed chunk of choice ``index``: a text delta, its tokens' ``logprobs``, tool
    calls (chat; each whole, with its ``index``) and/or the finish reason."""
    if ids.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish}
        kind = "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model,
            "choices": [choice]}


def logprobs_body(tokenizer: Any, pieces: Sequence[tuple[Any, str]], chat: bool,
                  text_offset: int = 0) -> dict:
    """The OpenAI ``logprobs`` object of generated tokens.

    Args:
        tokenizer: the model's tokenizer (an alternative's text is its decoding alone).
        pieces: each token's :class:`~selfspec.decoding.core.processors.TokenLogprob` and
            the text it adds to the answer (:class:`TokenPieces`): the tokens' texts join
            to exactly the answer's text.
        chat: chat shape (``{"content": [{token, logprob, bytes, top_logprobs}]}``) or
            completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
            ``text_offset``).
        text_offset: completions: the character offset of the first token's text.
    """
    def text(token: int) -> str:
        return tokenizer.decode([token])

    def lp(value: float) -> float:
        # A token a grammar forbids has log probability -inf, which JSON cannot carry
        # (a 500, or -Infinity in a stream): OpenAI's "as good as impossible" -9999.0.
        return value if math.isfinite(value) else IMPOSSIBLE_LOGPROB

    if chat:
        return {"content": [{
            "token": piece, "logprob": lp(e.logprob), "bytes": list(piece.encode("utf-8")),
            "top_logprobs": [{"token": text(t), "logprob": lp(value),
                              "bytes": list(text(t).encode("utf-8"))} for t, value in e.top]}
            for e, piece in pieces]}
    offsets = []
    for _, piece in pieces:
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": [piece for _, piece in pieces],
            "token_logprobs": [lp(e.logprob) for e, _ in pieces],
            "top_logprobs": [{text(t): lp(value) for t, value in e.top} for e, _ in pieces],
            "text_offset": offsets}


class TokenPieces:
    """Pairs generated tokens' log probability entries with the text each adds to the
    answer, so that a response's logprob tokens join to exactly its text (as OpenAI's do).

    A token's text is decoded incrementally (with the token before it as context, as
    vLLM's detokenizer does): a token ending inside a multi-byte character adds ``""`` and
    the token completing it the whole character. Special tokens (the end-of-sequence token)
    are left out: the answer's text skips them. Tokens past the answer's end (a stop
    string's) are left out when :meth:`finish` is told the text's length; a token across
    that end keeps the part inside it.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        self.ids: list[int] = []
        self.prefix = 0  # decoding context starts here ...
        self.read = 0  # ... and the text up to here is given out
        self.pending: list[tuple[Any, str]] = []
        self.covered = 0  # characters of the text the pieces given out cover

    def add(self, entries: Sequence[Any]) -> None:
        """Append the entries of newly committed tokens."""
        for entry in entries:
            self.ids.append(entry.token)
            if entry.token in self.special:
                continue
            self.pending.append((entry, self._piece()))

    def _piece(self) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # no whole character yet: a later token adds it
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def take(self, length: int) -> list[tuple[Any, str]]:
        """The pieces not given out yet whose text lies within the answer's first
        ``length`` characters (a stream: the text sent so far)."""
        out = []
        while self.pending and self.covered + len(self.pending[0][1]) <= length:
            entry, piece = self.pending.pop(0)
            out.append((entry, piece))
            self.covered += len(piece)
        return out

    def finish(self, length: int) -> list[tuple[Any, str]]:
        """The rest of the pieces of an answer of ``length`` characters."""
        out = self.take(length)
        if self.pending and self.covered < length:
            entry, piece = self.pending[0]
            out.append((entry, piece[:length - self.covered]))
            self.covered = length
        self.pending.clear()
        return out


def usage_chunk(ids: ResponseIds, use: dict) -> dict:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if ids.chat else "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model,
            "choices": [], "usage": use}


class TextDeltas:
    """Turns committed token ids into text deltas for streaming.

    The text streamed is always a prefix of the final text: a delta is held back while the
    decoded text ends in an incomplete UTF-8 sequence, and the last ``len(longest stop) - 1``
    characters are held back while a stop string could still be forming (the final text is
    cut before it, and no client must see it).

    Args:
        tokenizer: the model's tokenizer.
        stop: the request's stop strings.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, tokens: list[int]) -> str:
        """The new text that is safe to send after ``tokens`` were committed."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            if s in text:
                text = text[: text.index(s)]
        if text.endswith("\ufffd"):
            return ""
        safe = len(text) - self.holdback
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the generation's text, cut at a stop string)."""
        delta = final_text[self.sent:]
        self.sent = len(final_text)
        return delta


def check_option_types(method: str, fields: Sequence[Any], values: Mapping[str, Any]) -> None:
    """Refuse a request's method option given as text where the option is a number or a
    boolean: the options' parser reads text the way command lines and benchmark specs write
    it (``"8"``, ``"yes"``), but over HTTP an option is a JSON value of its type (what
    ``/openapi.json`` documents).

    Args:
        method: the method's name (for the message).
        fields: its :class:`~selfspec.methods.options.OptionField` list.
        values: the options the request gave.

    Raises:
        ApiError: 400 (param ``selfspec``) naming the option.
    """
    kinds = {int: "an integer", float: "a number", bool: "true or false"}
    for option in fields:
        value = values.get(option.name)
        if isinstance(value, str) and option.type in kinds:
            raise _bad(f"method {method!r}: option {option.name!r} must be "
                       f"{kinds[option.type]} (a JSON value, not text); got {value!r}",
                       "selfspec")

