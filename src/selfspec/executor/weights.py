"""One decoder layer's weights as the executor multiplies them.

q/k/v and gate/up projections are concatenated once at load time (one product each instead
of three and two); the HF modules are re-pointed at slices of the fused tensors, so the fused
copy costs no extra memory and the modules still compute exactly what they did. Each of the
four matrices is a :class:`~selfspec.executor.linear.Linear` (its decoding backend chosen once
per matrix, :mod:`selfspec.executor.backends`) or, in a draft view, a quantized copy
(:func:`selfspec.executor.quant.quantize_linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from selfspec.executor.linear import Linear, PackedRowLimits

#: The names of a layer's four matrices, in the order the fused kernels take them.
MATRICES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights, arranged for few kernel launches per token.

    Attributes:
        attn_norm / mlp_norm: ``[H]`` RMSNorm weights (the HF modules' own tensors).
        attn_norm_eps / mlp_norm_eps: their epsilons.
        qkv: ``[H]`` → ``[(Hq + 2 Hkv) * head_dim]`` (q, k, v outputs in that order).
        o: ``[Hq * head_dim]`` → ``[H]``.
        gate_up: ``[H]`` → ``[2 I]`` (gate outputs, then up).
        down: ``[I]`` → ``[H]``.
        act: the MLP's activation (the HF module's ``act_fn``).

    Each matrix is called as ``m(x [..., K], bulk=False) -> [..., N]``.
    """

    attn_norm: torch.Tensor
    attn_norm_eps: float
    qkv: Any
    o: Any
    mlp_norm: torch.Tensor
    mlp_norm_eps: float
    gate_up: Any
    down: Any
    act: Callable[[torch.Tensor], torch.Tensor]

    @property
    def matrices(self) -> tuple[Any, Any, Any, Any]:
        """``(qkv, o, gate_up, down)``."""
        return self.qkv, self.o, self.gate_up, self.down

    def map_matrices(self, fn: Callable[[Any], Any]) -> LayerWeights:
        """These weights with each matrix replaced by ``fn(matrix)`` (norms shared)."""
        return replace(self, **{name: fn(getattr(self, name)) for name in MATRICES})


def cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The biases of ``linears`` concatenated (zeros for those without), or ``None`` when
    none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None
                      else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                       device=lin.weight.device) for lin in linears])


def fuse(*linears: torch.nn.Linear) -> torch.Tensor:
    """Concatenate the weights of ``linears`` along the output dimension and point each
    module's weight at its slice of the result, so the fused copy costs no extra memory and
    the HF modules still compute exactly what they did."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    for lin, part in zip(linears, fused.split([lin.out_features for lin in linears])):
        lin.weight = torch.nn.Parameter(part, requires_grad=False)
    return fused


def layer_weights(layer: torch.nn.Module, pack: bool, limits: PackedRowLimits,
                  keep_packed: bool = True) -> LayerWeights:
    """The weights of one HF decoder layer (``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), q/k/v
    and gate/up fused; ``pack``: keep oneDNN-packed copies, ``keep_packed``: also while a
    kernel serves every call (:class:`Linear`)."""
    attn, mlp = layer.self_attn, layer.mlp
    opts = {"row_limits": limits, "keep_packed": keep_packed}
    return LayerWeights(
        attn_norm=layer.input_layernorm.weight,
        attn_norm_eps=layer.input_layernorm.variance_epsilon,
        qkv=Linear(fuse(attn.q_proj, attn.k_proj, attn.v_proj),
                   cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), pack, **opts),
        o=Linear(attn.o_proj.weight, attn.o_proj.bias, pack, **opts),
        mlp_norm=layer.post_attention_layernorm.weight,
        mlp_norm_eps=layer.post_attention_layernorm.variance_epsilon,
        gate_up=Linear(fuse(mlp.gate_proj, mlp.up_proj), cat_bias(mlp.gate_proj, mlp.up_proj),
                       pack, **opts),
        down=Linear(mlp.down_proj.weight, mlp.down_proj.bias, pack, **opts),
        act=mlp.act_fn)
