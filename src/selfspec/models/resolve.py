"""Stage 1 of loading a model: what does the name the user gave mean?

:func:`resolve` turns ``--model`` / ``selfspec.load(model=...)`` into a :class:`ModelSource`
without touching the network or the cache: a registry name, else an existing local directory,
else a Hugging Face hub id ``owner/name``. Nothing is downloaded or read here; making a copy
local is :mod:`selfspec.models.provision`'s job, loading it :mod:`selfspec.models.instantiate`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from selfspec.errors import ModelNotFoundError
from selfspec.models.registry import REGISTRY, ModelSpec

# Hub repo ids are "owner/name" with letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

SourceKind = Literal["registry", "directory", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, as :func:`resolve` found it.

    Attributes:
        name: what the user asked for (registry name, directory as given, or hub id); the
            loaded model carries it and messages name it.
        kind: ``"registry"``, ``"directory"``, ``"gguf"`` (a local ``.gguf`` file) or ``"hub"``.
        spec: the registry entry (``kind == "registry"``), else ``None``.
        path: the local directory or ``.gguf`` file, ``~`` expanded (``kind`` ``"directory"`` /
            ``"gguf"``), else ``None``.
    """

    name: str
    kind: SourceKind
    spec: ModelSpec | None = None
    path: Path | None = None


def resolve(model: str) -> ModelSource:
    """Say what ``model`` names, trying in order a registry name, a local directory, a local
    ``.gguf`` file and a hub id.

    A hub id is ``owner/name``; a path that exists but is not a directory is never one.

    Args:
        model: registry name (see ``selfspec models list``), directory written by
            ``save_pretrained``, a ``.gguf`` file, or Hugging Face hub id.

    Returns:
        The :class:`ModelSource`.

    Raises:
        ModelNotFoundError: ``model`` is none of the three; the message lists the registry.
    """
    if model in REGISTRY:
        return ModelSource(name=model, kind="registry", spec=REGISTRY[model])
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(name=model, kind="directory", path=path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name=model, kind="gguf", path=path)
    if _HUB_ID.match(model) and not path.exists():
        return ModelSource(name=model, kind="hub")
    raise ModelNotFoundError(
        f"{model!r} is not a registry model ({', '.join(REGISTRY)}), "
        "an existing local model directory, "
        "a .gguf file, or a Hugging Face hub id 'owner/name'. "
        "Run `selfspec models list` to see the registry."
    )
