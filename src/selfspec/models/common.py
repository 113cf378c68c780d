"""What the stages of model loading share: dtype names, architecture checks (of a config
object or of a directory's ``config.json``), and transformers' progress bars (a module of its
own, so no stage imports another's internals)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

from selfspec.errors import InvalidArgumentError, ModelNotFoundError
from selfspec.models import architecture

SUPPORTED_MODEL_TYPES = tuple(architecture.FAMILIES)

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(x: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16"|"bfloat16"|"fp32"|"float32"|"fp16"|"float16"`` (any case) or a torch dtype into
    a torch dtype.

    Raises:
        InvalidArgumentError: anything else; the message lists the choices.
    """
    if isinstance(x, torch.dtype) and x in _DTYPES.values():
        return x
    if isinstance(x, str) and x.lower() in _DTYPES:
        return _DTYPES[x.lower()]
    raise InvalidArgumentError(f"invalid dtype {x!r}: choose one of {', '.join(_DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"`` (used in cache
    paths)."""
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars (weight loading, GGUF de-quantisation) for a
    block.

    transformers keeps this switch globally; it is restored on exit.
    """
    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def check_model_type(model_type: str | None, source: str) -> None:
    """Raise unless ``model_type`` is one the executor can drive.

    Raises:
        UnsupportedArchitectureError: ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`
            (:func:`selfspec.models.architecture.check_model_type`).
    """
    architecture.check_model_type(model_type, source)


def check_config(config: PretrainedConfig, source: str) -> None:
    """Raise unless ``config`` describes an architecture the executor computes
    (:func:`selfspec.models.architecture.describe`).

    Raises:
        UnsupportedArchitectureError: unsupported ``model_type``, or a feature selfspec cannot
            compute yet (a sliding window shorter than the context: the per-layer KV cache
            keeps every position), named in the message.
    """
    architecture.describe(config, source)


def read_config(
    model_dir: Path, source: str, repair_hint: str | None = None
) -> PretrainedConfig:
    """Read and check ``model_dir/config.json`` without touching the weights.

    Args:
        model_dir: the model directory.
        source: model name used in messages.
        repair_hint: what to tell the user when the config is missing (default: what a model
            directory is).

    Raises:
        ModelNotFoundError: no readable ``config.json``.
        UnsupportedArchitectureError: see :func:`check_config`.
    """
    config_path = model_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        hint = repair_hint or "a model directory is one written by save_pretrained"
        raise ModelNotFoundError(f"{source}: cannot read {config_path} ({err}); {hint}") from err
    # Check the type before AutoConfig, which rejects types transformers does not know with a vaguer
    # message.
    check_model_type(raw.get("model_type"), source)
    config = AutoConfig.from_pretrained(model_dir)
    check_config(config, source)
    return config
