"""The server's API key check (``Authorization: Bearer KEY``) and its tenants.

A tenant is who a key belongs to: the operator's one ``--api-key`` is the tenant ``default``;
a keys file (``--api-keys-file``, read once at start, :func:`read_keys_file`) names one per
key. The n-gram history and learnt estimates a request drafts from are its tenant's
(docs/serving.md, "Tenants and history").
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from selfspec.errors import InvalidArgumentError
from selfspec.serving.config import DEFAULT_TENANT
from selfspec.serving.protocol import ApiError

logger = logging.getLogger(__name__)

_TENANT_NAME = re.compile(r"[A-Za-z0-9_.@:-]{1,64}")


def _bytes(text: str) -> bytes:
    """``text`` as bytes for a constant-time compare: any code point (a Latin-1 header
    byte, a surrogate from the OS) is encoded, so ``hmac.compare_digest`` never raises."""
    return text.encode("utf-8", "surrogatepass")


def authorize(headers: Mapping[str, str], keys: Mapping[str, str] | str | None) -> str:
    """Check a request's ``Authorization`` header and name its tenant.

    Args:
        headers: the request's headers (case-insensitive keys, as Starlette's; their values
            Latin-1 decoded, so any byte may appear).
        keys: key -> tenant name; a bare ``str``: one key, tenant :data:`DEFAULT_TENANT`;
            ``None`` or empty: every request passes as :data:`DEFAULT_TENANT`.

    Returns:
        the tenant the key names.

    Raises:
        ApiError: 401 (code ``invalid_api_key``) for a missing header, another scheme or
            a key that is none of ``keys`` (each compared in constant time, all of them).
    """
    if isinstance(keys, str):
        keys = {keys: DEFAULT_TENANT}
    if not keys:
        return DEFAULT_TENANT
    scheme, _, given = headers.get("authorization", "").partition(" ")
    given_bytes = _bytes(given.strip())
    tenant = None
    for key, name in keys.items():  # no early exit: the time does not say which key matched
        if hmac.compare_digest(given_bytes, _bytes(key)) and tenant is None:
            tenant = name
    if scheme.lower() != "bearer" or tenant is None:
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key")
    return tenant


def request_tenant(key_tenant: str, user: object, from_user: bool) -> str:
    """The tenant whose history a request drafts from.

    Args:
        key_tenant: the tenant of the request's key (:func:`authorize`).
        user: the request's OpenAI ``user`` field (any JSON value; only a non-empty
            ``str`` names a sub-tenant).
        from_user: the operator's ``--tenant-from-user``: the ``user`` field names a tenant
            inside the key's (``key_tenant/user``), never another key's.
    """
    if from_user and isinstance(user, str) and user:
        return f"{key_tenant}/{user}"
    return key_tenant


def read_keys_file(path: str | Path) -> dict[str, str]:
    """The keys of an operator's keys file: one ``TENANT KEY`` a line (whitespace between;
    ``#`` starts a comment line; blank lines skipped).

    Returns:
        key -> tenant name.

    Raises:
        InvalidArgumentError: the file cannot be read, a line is not two fields, a tenant
            name is not 1-64 of ``A-Za-z0-9_.@:-``, or a key appears twice.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"--api-keys-file {path}: cannot read it ({error})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"--api-keys-file {path}, line {number}"
        if len(fields) != 2:
            raise InvalidArgumentError(f"{where}: expected 'TENANT KEY', got {len(fields)} "
                                       "fields")
        tenant, key = fields
        if not _TENANT_NAME.fullmatch(tenant):
            raise InvalidArgumentError(f"{where}: tenant name {tenant!r} is not 1-64 of "
                                       "A-Za-z0-9_.@:-")
        if key in keys:
            raise InvalidArgumentError(f"{where}: this key is already tenant {keys[key]!r}'s")
        keys[key] = tenant
    if not keys:
        raise InvalidArgumentError(f"--api-keys-file {path}: no keys in it")
    logger.info("read %d API keys (%d tenants) from %s", len(keys), len(set(keys.values())),
                path)
    return keys
