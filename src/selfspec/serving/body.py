"""Decoding a request body into JSON values every later step can handle.

``json.loads`` alone lets through bodies that fail later with a 500: nesting deep enough to
raise ``RecursionError`` (in ``json.loads`` itself, or later in ``repr``, ``json.dumps`` or
any recursive walk of the value), ``NaN`` / ``Infinity`` (not JSON, accepted by Python),
integers over Python's 4300-digit conversion limit (a ``ValueError``), and lone UTF-16
surrogates (``"\\ud800"``: valid JSON escapes, but no tokenizer can encode them, and no
response quoting them can be written as UTF-8). :func:`decode_json` refuses all of them
with a 400 that says what is wrong and where; :func:`read_json` reads a request's body
under the size limit first.
"""

from __future__ import annotations

import json
import re
from typing import Any

from selfspec.serving.protocol import ApiError

#: Deepest nesting accepted: an OpenAI body needs 5 (messages[i].content[j].text); the
#: bound keeps every recursive walk of the value far from Python's recursion limit.
MAX_DEPTH = 32

_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """The JSON value of ``raw`` (UTF-8, -16 or -32), checked as the module docstring says.

    Raises:
        ApiError: 400 for invalid JSON, nesting deeper than :data:`MAX_DEPTH`, or a lone
            surrogate in a string or key (the message names where).
    """
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels") \
            from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, int digits, NaN
        raise ApiError(400, f"the request body is not valid JSON: {error}") from error
    check_value(value)
    return value


async def read_json(request: Any, limit: int) -> Any:
    """The JSON value of an HTTP request's body, read as it streams in.

    Args:
        request: a Starlette request (its ``headers`` and ``stream()`` are read).
        limit: the largest body accepted, bytes (``Limits.max_body_bytes``).

    Raises:
        ApiError: 413 when ``Content-Length`` says more than ``limit`` or more arrives
            (checked per chunk, so an oversized body is never held whole); 400 when the
            connection ends before the body does (a client gone, or a malformed chunked
            body, which uvicorn answers with its own 400: no server error either way); 400
            as :func:`decode_json`.
    """
    from starlette.requests import ClientDisconnect  # the serve extra's; FastAPI needs it

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, f"the connection ended after {size} bytes of the request body, "
                            "before its end") from None
    return decode_json(b"".join(chunks))


def check_value(value: Any) -> None:
    """Check a decoded JSON value's depth and strings without recursion.

    Raises:
        ApiError: 400, see :func:`decode_json`.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, where or "the body")
                stack.append((child, f"{where}.{key}" if where else key, depth + 1))
        else:
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, where: str) -> None:
    match = _SURROGATE.search(text)
    if match is not None:
        raise ApiError(
            400, f"{where or 'the body'} holds a lone UTF-16 surrogate "
                 f"({ascii(match.group())}) at character {match.start()}: it is not Unicode "
                 "text and cannot be tokenized; send valid Unicode (a surrogate pair escapes "
                 "one character above U+FFFF)", param=where.split(".")[0].split("[")[0] or None)
