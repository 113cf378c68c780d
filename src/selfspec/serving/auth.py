"""The server's API key check (``Authorization: Bearer KEY``)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from selfspec.serving.protocol import ApiError


def authorize(headers: Mapping[str, str], api_key: str | None) -> None:
    """Check a request's ``Authorization`` header against ``api_key``.

    Args:
        headers: the request's headers (case-insensitive keys, as Starlette's).
        api_key: the server's key; ``None``: every request passes.

    Raises:
        ApiError: 401 (code ``invalid_api_key``) for a missing header, another scheme or
            another key (compared in constant time).
    """
    if api_key is None:
        return
    given = headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), api_key):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key")
