"""How ``selfspec serve`` runs: :class:`ServeConfig`, the one place its defaults are stated
(the command line, :class:`~selfspec.serving.scheduler.Scheduler` and the header deadline
read them from here; the request limits' defaults are
:class:`~selfspec.serving.protocol.Limits`')."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.serving.protocol import Limits


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
