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

from selfspec.errors import (
    InvalidArgumentError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

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
        UnsupportedArchitectureError: ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`.
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{source} has model_type {model_type!r}; "
            f"selfspec supports {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Use a model of one of these architectures (`selfspec models list` shows ready ones)."
        )


def check_config(config: PretrainedConfig, source: str) -> None:
    """Raise unless ``config`` describes a supported architecture with full attention on every
    layer.

    Raises:
        UnsupportedArchitectureError: unsupported ``model_type``, or sliding-window attention on
            some layer (the per-layer KV cache keeps every position; a sliding window would change
            the model's output).
    """
    check_model_type(config.model_type, source)
    layer_types = getattr(config, "layer_types", None)
    # Qwen2 derives layer_types from use_sliding_window/max_window_layers; trust it when present.
    if layer_types is not None:
        sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    else:
        sliding = (
            list(range(config.num_hidden_layers))
            if getattr(config, "use_sliding_window", False)
            else []
        )
    if sliding:
        raise UnsupportedArchitectureError(
            f"{source} uses sliding-window attention on layers "
            f"{sliding[:8]}{'...' if len(sliding) > 8 else ''}; "
            "selfspec supports full attention only. Set use_sliding_window=false in its "
            "config.json if the model was trained without a window."
        )


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
