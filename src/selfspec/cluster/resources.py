"""What one engine needs from a Ray node, checked before a job or a deployment starts: a
replica or actor that no node can hold would otherwise wait unscheduled (or die loading)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidArgumentError

_BYTES_PER_PARAM = {"fp32": 4.0, "float32": 4.0}  # every other weight format: 2 (bf16 / fp16)
_OVERHEAD = 1.3  # KV cache, activations, packed copies, the interpreter and torch itself
_GIB = 1 << 30


def _weights_dir(model: str | None) -> Path | None:
    """A directory of the model's safetensors: a local directory, or a registry model's
    cache entry in any dtype; ``None`` when there is none yet (a hub id, a model not fetched)."""
    from selfspec.models.provision import selfspec_home
    from selfspec.models.registry import DEFAULT_MODEL, REGISTRY

    model = model or DEFAULT_MODEL
    if Path(model).is_dir():
        return Path(model)
    if model in REGISTRY:
        for entry in sorted((selfspec_home() / "models" / model).glob("*")):
            if entry.is_dir() and any(entry.glob("*.safetensors")):
                return entry
    return None


def engine_bytes(load: Mapping[str, Any]) -> int | None:
    """About how many bytes of memory one engine loaded with ``load`` (:func:`selfspec.load`'s
    keyword arguments) takes: its parameter count (read from the safetensors headers) times
    the bytes a parameter takes in its weight format, plus overhead; ``None`` when the
    weights are not on this machine yet."""
    from safetensors import safe_open

    directory = _weights_dir(load.get("model"))
    if directory is None:
        return None
    params = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                numel = 1
                for dim in f.get_slice(key).get_shape():
                    numel *= dim
                params += numel
    per_param = _BYTES_PER_PARAM.get(str(load.get("dtype") or "bf16"), 2.0)
    return int(params * per_param * _OVERHEAD)


def check_fits(ray: Any, need: int | None, what: str) -> None:
    """Raise unless some live node of the cluster offers ``need`` bytes of memory to actors.

    Raises:
        InvalidArgumentError: no node can hold one ``what`` (the message gives both sizes).
    """
    if need is None:
        return
    offers = [n.get("Resources", {}).get("memory", 0) for n in ray.nodes() if n.get("Alive")]
    largest = max(offers, default=0)
    if need > largest:
        raise InvalidArgumentError(
            f"one {what} needs about {need / _GIB:.1f} GiB of memory and the largest node of the "
            f"Ray cluster offers {largest / _GIB:.1f} GiB to actors: add a larger node, or load "
            "a smaller weight format (--dtype bf16, gguf)")

