"""Load a model in one straight line, resolve → provision → load, each stage called once by
:func:`load_model`:

1. ``resolve.resolve(name)`` → :class:`ModelSource`: a registry entry, a local directory or a hub
   id;
2. ``provision.ensure_local(source, dtype)`` → :class:`LocalModel`: an intact local copy (cached,
   fetched, checked);
3. ``instantiate.instantiate(local, dtype)`` → :class:`LoadedModel`: transformers model +
   tokenizer, for the executor.
No stage calls back into an earlier one (only if a ``models fetch --force`` replaces the entry
mid-read do 2-3 rerun).
"""

from __future__ import annotations

import logging

import torch

from selfspec.errors import SelfSpecError
from selfspec.models.common import parse_dtype
from selfspec.models.instantiate import LoadedModel, instantiate
from selfspec.models.provision import LocalModel, ensure_local
from selfspec.models.resolve import ModelSource, resolve

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "LocalModel", "ModelSource", "load_model"]


def load_model(
    model: str, dtype: str | torch.dtype = "bf16", *, show_progress: bool = True
) -> LoadedModel:
    """Load a causal LM and its tokenizer, provisioning registry models on first use.

    ``model`` is tried, in order, as a registry name (see ``selfspec models list``), an existing
    local directory written by ``save_pretrained`` (safetensors weights + tokenizer), and a Hugging
    Face hub id ``owner/name`` (needs network access, or the model in the local Hugging Face cache).

    A registry model not cached in ``dtype`` is cast from a cached float32 copy when there is one,
    otherwise fetched and converted (see :func:`selfspec.models.provision.fetch`). Its cache entry's
    files are checked against the manifest before they are read.

    Args:
        model: registry name, local directory or hub id.
        dtype: ``"bf16"`` / ``"fp32"`` / ``"fp16"`` (or their long names, any case) or a torch
            dtype.
        show_progress: show download and conversion progress bars.

    Returns:
        The :class:`LoadedModel` (model in eval mode without gradients, tokenizer, name, path,
        dtype).

    Raises:
        InvalidArgumentError: bad ``dtype``.
        ModelNotFoundError: ``model`` is none of the three, the directory lacks
            config/weights/tokenizer, or the hub cannot be reached and the model is not cached
            locally.
        UnsupportedArchitectureError: the model is not Llama/Qwen2 or uses sliding-window attention.
        ProvisioningError: fetching a registry model failed (and its subclasses ChecksumError,
            CorruptModelFileError).
        CorruptModelFileError: a file of a registry cache entry is missing or differs from its
            record, or safetensors weights are truncated or unreadable.
    """
    torch_dtype = parse_dtype(dtype)
    source = resolve(model)
    local = ensure_local(source, torch_dtype, show_progress=show_progress)
    try:
        return instantiate(local, torch_dtype)
    except SelfSpecError:
        if not local.replaced():  # not a concurrent re-fetch: a real problem
            raise
    logger.info(
        "%s: the cache entry was replaced while it was being loaded; loading the new one",
        local.name,
    )
    return instantiate(ensure_local(source, torch_dtype, show_progress=show_progress), torch_dtype)
