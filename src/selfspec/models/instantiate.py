"""Stage 3 of loading a model: build the transformers model and tokenizer from a local directory.

:func:`instantiate` reads the directory :mod:`selfspec.models.provision` made sure of (a
``save_pretrained`` layout: ``config.json``, safetensors weights, tokenizer files) and returns
the :class:`LoadedModel` the API hands to the executor. Whatever the source, the model is
loaded from safetensors only (never pickle), with SDPA attention, in eval mode, with gradients
off. The architecture is checked from ``config.json`` before any weight is read: the executor
drives only the model types in :data:`~selfspec.models.common.SUPPORTED_MODEL_TYPES`, with
full attention on every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from selfspec.errors import CorruptModelFileError, ModelNotFoundError
from selfspec.models.common import read_config, transformers_progress
from selfspec.models.provision import LocalModel


@dataclass
class LoadedModel:
    """A model ready for the executor.

    Attributes:
        model: the Hugging Face causal LM, in eval mode, ``requires_grad`` off, SDPA attention.
        tokenizer: its tokenizer.
        name: what the user asked for (registry name, directory or hub id).
        path: directory the weights were read from (cache entry version, local dir, hub snapshot).
        dtype: dtype of the floating-point weights.
        gguf: the local ``.gguf`` file the model was converted from (``--model FILE.gguf``),
            else ``None`` (a registry model's GGUF is fetched on request:
            :func:`selfspec.models.gguf_cache.fetch_gguf`).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path | None
    dtype: torch.dtype
    gguf: Path | None = None


def instantiate(local: LocalModel, dtype: torch.dtype) -> LoadedModel:
    """Load the model in ``local.path`` (safetensors weights + tokenizer), checking its config
    first.

    Args:
        local: the local copy (directory, name for messages, what to advise when a file is bad).
        dtype: dtype to load (cast if the files hold another one).

    Returns:
        The :class:`LoadedModel`, named ``local.name``, with ``path`` ``local.path``.

    Raises:
        ModelNotFoundError: no readable config.json, no safetensors weights, or no tokenizer in
            the directory.
        UnsupportedArchitectureError: see :func:`selfspec.models.common.check_config`.
        CorruptModelFileError: the safetensors files are truncated or unreadable.
    """
    model_dir, source, repair_hint = local.path, local.name, local.repair_hint
    config = read_config(model_dir, source, repair_hint)
    if not any(model_dir.glob("*.safetensors")):
        hint = repair_hint or (
            "selfspec never loads pickled weights (pytorch_model.bin); re-save the model with "
            "model.save_pretrained(dir) to write safetensors"
        )
        raise ModelNotFoundError(f"{source}: no *.safetensors weights in {model_dir}; {hint}.")
    tokenizer = _load_tokenizer(model_dir, source, repair_hint)
    hint = repair_hint or f"re-save the model to {model_dir} with save_pretrained"
    try:
        # Local safetensors load in seconds at most: no progress bar.
        with transformers_progress(False):
            model = AutoModelForCausalLM.from_pretrained(
                model_dir,
                config=config,
                dtype=dtype,
                attn_implementation="sdpa",
                use_safetensors=True,
            )
    except (SafetensorError, OSError, EOFError) as err:
        raise CorruptModelFileError(
            f"{source}: cannot read the weights in {model_dir} ({err}); {hint}"
        ) from err
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source, path=model_dir, dtype=dtype,
                       gguf=local.gguf)


def _load_tokenizer(
    model_dir: Path, source: str, repair_hint: str | None
) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model; ModelNotFoundError if there is none."""
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as err:
        hint = repair_hint or "save one there with tokenizer.save_pretrained(dir)"
        raise ModelNotFoundError(
            f"{source}: no usable tokenizer in {model_dir} ({err}); {hint}"
        ) from err
