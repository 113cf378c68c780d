"""Layer-wise executor and per-layer KV cache."""

from selfspec.executor.cache import CacheShape, KVCache
from selfspec.executor.executor import SUPPORTED_MODEL_TYPES, LayerExecutor
from selfspec.executor.plan import SkipPlan

__all__ = ["CacheShape", "KVCache", "LayerExecutor", "SkipPlan", "SUPPORTED_MODEL_TYPES"]
