"""A Llama 3.x GGUF's RoPE scaling, which llama.cpp stores as a ``rope_freqs`` tensor, turned
back into the ``rope_parameters`` transformers computes it from.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.generate_extra_tensors``)
writes Llama 3's frequency scaling as one factor per rotary pair, ``r_i = θ_i / θ'_i`` (a
rotation of pair ``i`` uses ``θ_i / r_i``), not as metadata, and transformers' GGUF loader
drops the tensor: the converted model would run with unscaled RoPE, close at short positions
and wrong as the context grows. Llama 3's scaling (Meta's ``apply_scaling``, transformers'
``_compute_llama3_parameters``) is ``1 / r = (1 - s) / factor + s`` with
``s = clamp((L·θ/2π - low) / (high - low), 0, 1)`` (``L`` the original context), so ``factor``
is the largest ``r`` and the pairs between the two ends give ``s`` as a linear function of
``θ``; the parameters found are checked by computing the factors back with transformers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from selfspec.errors import UnsupportedArchitectureError

#: Llama 3.x's original context and frequency bands (every released 3.1 / 3.2 / 3.3 model).
LLAMA3_DEFAULTS = {"original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0}
_RTOL = 1e-4  # the tensor is float32; llama.cpp computes it in float64


def read_rope_freqs(path: Path) -> np.ndarray | None:
    """The ``rope_freqs.weight`` tensor of a GGUF file (``[head_dim / 2]`` float), or
    ``None`` when the file has none."""
    reader = gguf.GGUFReader(path)
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    return None


def _llama3_factors(config: Any, params: dict) -> np.ndarray:
    """transformers' own Llama 3 factors ``θ_i / θ'_i`` for ``params`` on ``config``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    trial = config.__class__.from_dict(config.to_dict())
    trial.rope_parameters = params
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, torch.device("cpu"))
    dim = 2 * scaled.shape[0]  # transformers' default RoPE (the "default" rope_type)
    plain = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    return (plain.double() / scaled.double()).numpy()


def _fit(factors: np.ndarray, theta: np.ndarray, context: int) -> dict:
    """``low_freq_factor`` / ``high_freq_factor`` from the pairs between the bands (at least
    two), for the original context ``context``; the defaults when fewer."""
    factor = float(factors.max())
    middle = (factors > 1 + _RTOL) & (factors < factor * (1 - _RTOL))
    if middle.sum() < 2:
        return {**LLAMA3_DEFAULTS, "original_max_position_embeddings": context}
    s = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
    slope, offset = np.polyfit(theta[middle], s, 1)  # s = slope·θ + offset
    width = context / (2 * math.pi * slope)         # high - low
    low = -offset * width
    return {"original_max_position_embeddings": context, "low_freq_factor": float(low),
            "high_freq_factor": float(low + width)}


def gguf_rope_parameters(path: Path, config: Any, source: str) -> dict | None:
    """The ``rope_parameters`` a GGUF's ``rope_freqs`` tensor stands for
    (:func:`rope_parameters_from_freqs`), or ``None`` when it has none or they are all 1.

    Raises:
        UnsupportedArchitectureError: see :func:`rope_parameters_from_freqs`.
    """
    factors = read_rope_freqs(path)
    if factors is None:
        return None
    arch = str(gguf.GGUFReader(path).fields["general.architecture"].contents())
    return rope_parameters_from_freqs(config, factors, original_context(path, arch), source)


def rope_parameters_from_freqs(config: Any, factors: np.ndarray, context: int | None = None,
                               source: str = "the GGUF") -> dict | None:
    """The Llama 3 ``rope_parameters`` whose factors are ``factors``, or ``None`` when every
    factor is 1 (no scaling).

    Args:
        config: the config transformers read from the file (``rope_parameters["rope_theta"]``,
            ``head_dim``).
        factors: ``[head_dim / 2]`` the file's ``rope_freqs``.
        context: the original context ``L`` when the file states it
            (``llama.rope.scaling.original_context_length``), else Llama 3's 8192.
        source: the model's name, for messages.

    Raises:
        UnsupportedArchitectureError: factors that no Llama 3 scaling gives (checked with
            transformers' own computation), naming ``rope_freqs``.
    """
    if np.allclose(factors, 1.0, rtol=0, atol=_RTOL):
        return None
    base = dict(config.rope_parameters or {})
    rope_theta = float(base.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = 2 * factors.shape[0]
    theta = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    fit = _fit(factors, theta, context or LLAMA3_DEFAULTS["original_max_position_embeddings"])
    params = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": float(factors.max()),
              **fit}
    got = _llama3_factors(config, params)
    if got.shape != factors.shape or not np.allclose(got, factors, rtol=_RTOL, atol=0):
        raise UnsupportedArchitectureError(
            f"{source}: its rope_freqs tensor (RoPE frequency factors {factors.round(4)[:6]}...) "
            "is no Llama 3 RoPE scaling selfspec can express: not supported")
    return params


def original_context(path: Path, arch: str) -> int | None:
    """``<arch>.rope.scaling.original_context_length`` of a GGUF file, if it states one."""
    field = gguf.GGUFReader(path).fields.get(f"{arch}.rope.scaling.original_context_length")
    return None if field is None else int(field.parts[field.data[0]][0])
