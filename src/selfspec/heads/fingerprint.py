"""Which model a head file belongs to: a fingerprint of the config and output weights.

Heads read one model's hidden states and (lightweight heads) reuse its ``lm_head``, so
loading them into another model must fail loudly. The fingerprint has three parts:

- ``config_sha256``: sha256 of the architecture fields of the config (not the dtype);
- ``weights_sha256``: sha256 of ``lm_head`` and the final norm weight rounded to bfloat16,
  so a bf16 load and an fp32 load of the same checkpoint usually hash alike;
- ``sketch``: a few random projections of those weights in float32. Matching compares the
  sketches with a relative tolerance, because a checkpoint converted to another dtype can
  round differently (double rounding through fp16, a GGUF de-quantised in bf16 vs fp32):
  the same weights then differ by ~1e-3 relative, another model's by O(1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from selfspec.heads.modules import OutputLayer

_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "rms_norm_eps", "rope_theta", "rope_parameters", "tie_word_embeddings",
                  "max_position_embeddings", "hidden_act")
_SKETCH_SIZE = 8
_SKETCH_RTOL = 1e-2  # bf16 rounding moves the sketch by ~1e-3 relative; other models by ~1


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of a model as far as exit heads are concerned (see the module doc).

    Attributes:
        config_sha256: hex sha256 of the architecture config fields.
        weights_sha256: hex sha256 of ``lm_head`` (+ bias) and final-norm weights in bf16.
        sketch: ``_SKETCH_SIZE`` float32 random projections of the same weights.
    """

    config_sha256: str
    weights_sha256: str
    sketch: tuple[float, ...]

    def matches(self, other: ModelFingerprint) -> bool:
        """Same config, and same weights up to dtype rounding."""
        if self.config_sha256 != other.config_sha256:
            return False
        if self.weights_sha256 == other.weights_sha256:
            return True
        a = torch.tensor(self.sketch, dtype=torch.float64)
        b = torch.tensor(other.sketch, dtype=torch.float64)
        if a.shape != b.shape:
            return False
        return bool(torch.linalg.vector_norm(a - b) <= _SKETCH_RTOL * torch.linalg.vector_norm(a))

    def short(self) -> str:
        """A 12-character id for messages."""
        return f"{self.config_sha256[:6]}{self.weights_sha256[:6]}"

    def to_dict(self) -> dict:
        return {**asdict(self), "sketch": list(self.sketch)}

    @classmethod
    def from_dict(cls, data: dict) -> ModelFingerprint:
        return cls(str(data["config_sha256"]), str(data["weights_sha256"]),
                   tuple(float(x) for x in data["sketch"]))


def _config_fields(config: object) -> dict:
    fields = {}
    for name in _CONFIG_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, dict):
            value = {k: v for k, v in sorted(value.items())
                     if isinstance(v, (int, float, str, bool))}
        fields[name] = value
    return fields


def fingerprint(config: object, out: OutputLayer) -> ModelFingerprint:
    """Fingerprint of a model from its HF ``config`` and :class:`OutputLayer`."""
    config_json = json.dumps(_config_fields(config), sort_keys=True, default=str)
    tensors = [out.weight] + ([out.bias] if out.bias is not None else [])
    tensors += [p for _, p in sorted(out.norm.state_dict().items())]
    digest = hashlib.sha256()
    for tensor in tensors:
        data = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(data.view(torch.int16).numpy().tobytes())
    generator = torch.Generator().manual_seed(20240611)
    sketch = torch.zeros(_SKETCH_SIZE, dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().to("cpu", torch.float32).reshape(tensor.shape[0], -1)
        proj = torch.randn(flat.shape[1], _SKETCH_SIZE, generator=generator)  # [H, S]
        signs = torch.randint(0, 2, (flat.shape[0],), generator=generator).float() * 2 - 1
        sketch += (signs @ (flat @ proj)).double()  # [S]
    return ModelFingerprint(hashlib.sha256(config_json.encode()).hexdigest(), digest.hexdigest(),
                            tuple(sketch.tolist()))
