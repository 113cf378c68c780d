"""How ``selfspec serve`` runs: :class:`ServeConfig`, the one place its defaults are stated
(the command line, :class:`~selfspec.serving.scheduler.Scheduler` and the header deadline
read them from here; the request limits' defaults are
:class:`~selfspec.serving.protocol.Limits`')."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.serving.protocol import Limits

DEFAULT_TENANT = "default"  # the tenant of --api-key, and of every request without keys


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs.

    Attributes:
        model_name: the name clients pass as ``model`` (``/v1/models`` lists it).
        method / method_options: the default method and its options (a request may
            override them in its ``selfspec`` field).
        api_key: required as ``Authorization: Bearer KEY`` when set.
        limits: body, prompt and ``max_tokens`` limits.
        max_batch: rows decoded together.
        max_queue: requests waiting for a row before 429.
        max_batch_tokens: KV positions (prompt + ``max_tokens`` per row) the running rows
            may reach together; ``None``: no bound but ``max_batch``.
        assets_dir: where a request's asset options (heads, skip sets) are looked up by
            bare name; ``None``: requests may name none (:mod:`selfspec.serving.assets`).
        health_auth: ``/health`` needs the API key too.
        drain_seconds: on shutdown, how long accepted requests may still run.
        header_timeout: seconds a client has to send a request's headers.
        body_timeout: seconds a client has to send a request's body, once its headers
            are in (then a 408 and the connection closed).
        api_keys: more keys, key -> tenant name (``--api-keys-file``,
            :func:`~selfspec.serving.auth.read_keys_file`); with ``api_key`` (tenant
            ``default``) the keys a request may send.
        tenant_from_user: the request's ``user`` field names a tenant inside its key's.
        share_history: every tenant drafts from one shared history (the side channel of
            docs/serving.md, "Tenants and history"); default: each tenant its own.
        max_tenants: tenants' memories kept (least recently used dropped first).
        stream_chunk_tokens: a stream's chunks carry this many tokens each (the last fewer);
            ``None``: each decoding step's tokens as they come.
    """

    model_name: str
    method: str = "auto"
    method_options: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 8
    max_queue: int = 64
    max_batch_tokens: int | None = None
    assets_dir: Path | None = None
    health_auth: bool = False
    drain_seconds: float = 30.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    # --- tenants (H2) ---
    api_keys: Mapping[str, str] = field(default_factory=dict)
    tenant_from_user: bool = False
    share_history: bool = False
    max_tenants: int = 64
    stream_chunk_tokens: int | None = None

    def auth_keys(self) -> dict[str, str]:
        """Every key a request may send -> its tenant (empty: no key needed)."""
        keys = dict(self.api_keys)
        if self.api_key is not None:
            keys[self.api_key] = DEFAULT_TENANT
        return keys
