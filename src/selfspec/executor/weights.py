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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from selfspec.errors import UnsupportedArchitectureError
from selfspec.executor.linear import Linear, PackedRowLimits
from selfspec.models.layouts import interleave_blocks, reorder_interleaved

if TYPE_CHECKING:
    from selfspec.models.architecture import Architecture

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
        q_norm / k_norm: ``[head_dim]`` (``qk_norm="head"``) or ``[Hq·hd]`` / ``[Hkv·hd]``
            (``"projection"``) RMSNorm weights applied before RoPE, or ``None``
            (:class:`~selfspec.models.architecture.Architecture` names the features).
        qk_norm_eps: their epsilon.
        qk_norm_whole: the q/k norms span the whole projection (OLMo 2), not each head.
        post_attn_norm / post_mlp_norm: ``[H]`` norms of each sub-layer's output before the
            residual add (OLMo 2), or ``None``; ``attn_norm`` / ``mlp_norm`` are ``None`` when
            a layer has no pre-norms.
        post_norm_eps: their epsilon.
        norm_weight_fp32: norms multiply their weight before the cast back (OLMo 2's
            ``(w · x̂).to(dtype)``) instead of after (Llama's ``w · x̂.to(dtype)``).
        rope: the layer applies RoPE (SmolLM3's no-RoPE layers do not).
        rope_partial: RoPE rotates only the first dims of each head (``partial_rotary_factor``
            < 1: the rotary module's rows are narrower than ``head_dim``; Phi-4-mini).
        residual_scale: each sub-layer's output is multiplied by it before the residual add
            (Granite's ``residual_multiplier``).
        window: the layer's sliding attention window ``W`` (a query at ``p`` sees keys
            ``p - W < k <= p``), or ``None`` for full attention.
        rope_kind: which RoPE table the layer reads: ``"default"``, or its layer type where
            the model has one table per layer type (Gemma 3's local base on sliding layers).
        attn_norm_bias / mlp_norm_bias: ``[H]`` the pre-norms' biases where they are
            LayerNorms (GPT-NeoX), else ``None``.
        layer_norm: the pre-norms are LayerNorms (``F.layer_norm`` with weight and bias, as
            ``nn.LayerNorm``), not RMSNorms.
        gated: ``gate_up`` holds gate then up (``down(act(gate) · up)``); ``False``: it holds
            the up projection alone (``[H]`` → ``[I]``) and the MLP is ``down(act(up))``.
        parallel: attention and MLP both read the layer's input, added together to it
            (``use_parallel_residual``).
        plain: Llama's layer (none of the above): what the fused kernels compute.

    Each matrix is called as ``m(x [..., K], bulk=False) -> [..., N]``.
    """

    attn_norm: torch.Tensor | None
    attn_norm_eps: float
    qkv: Any
    o: Any
    mlp_norm: torch.Tensor | None
    mlp_norm_eps: float
    gate_up: Any
    down: Any
    act: Callable[[torch.Tensor], torch.Tensor]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_whole: bool = False
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    post_norm_eps: float = 1e-6
    norm_weight_fp32: bool = False
    rope: bool = True
    rope_partial: bool = False
    residual_scale: float = 1.0
    window: int | None = None
    rope_kind: str = "default"
    attn_norm_bias: torch.Tensor | None = None
    mlp_norm_bias: torch.Tensor | None = None
    layer_norm: bool = False
    gated: bool = True
    parallel: bool = False

    @property
    def plain(self) -> bool:
        """Llama's layer: RMS pre-norms, no q/k or post norms, RoPE over the whole head, no
        residual multiplier, a gated MLP, sequential residuals."""
        return (self.q_norm is None and self.post_attn_norm is None
                and self.post_mlp_norm is None and self.attn_norm is not None
                and self.mlp_norm is not None and self.rope and not self.rope_partial
                and self.residual_scale == 1.0 and not self.norm_weight_fp32
                and self.window is None and self.rope_kind == "default"
                and not self.layer_norm and self.gated and not self.parallel)

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        """Every norm weight (and LayerNorm bias) the layer reads (pre, q/k and post norms
        it has)."""
        return tuple(t for t in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm,
                                 self.post_attn_norm, self.post_mlp_norm, self.attn_norm_bias,
                                 self.mlp_norm_bias) if t is not None)

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


def _slices(whole: torch.nn.Linear, sizes: list[int]) -> list[torch.nn.Linear]:
    """Linear modules whose weights are consecutive row blocks (views) of ``whole``'s, of
    ``sizes`` output features each (no bias: Phi-3's fused projections have none)."""
    parts = []
    for part in whole.weight.detach().split(sizes):
        lin = torch.nn.Linear(whole.in_features, part.shape[0], bias=False,
                              device=part.device, dtype=part.dtype)
        lin.weight = torch.nn.Parameter(part, requires_grad=False)
        parts.append(lin)
    return parts


def split_checkpoint_fused(layer: torch.nn.Module, config: Any) -> None:
    """Give a Phi-3 decoder layer the usual ``self_attn.{q,k,v}_proj`` and
    ``mlp.{gate,up}_proj`` / ``mlp.act_fn``, as views of its checkpoint's ``qkv_proj``
    (``[Hq·hd; Hkv·hd; Hkv·hd]`` rows) and ``gate_up_proj`` (``[I; I]``: gate, then up), the
    split of transformers' modeling_phi3 (``Phi3Attention.forward``, ``Phi3MLP.forward``),
    so every path sees a normal layer; the fused modules stay and still compute what they
    did (no copy; :func:`fuse` later points both at one tensor). Does nothing to a layer
    that already has ``q_proj``.

    Raises:
        UnsupportedArchitectureError: the fused projections carry biases.
    """
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "q_proj"):
        return
    if attn.qkv_proj.bias is not None or mlp.gate_up_proj.bias is not None:
        raise UnsupportedArchitectureError("fused qkv_proj / gate_up_proj with biases are not "
                                           "supported (Phi-3's have none)")
    hd, nkv = attn.head_dim, config.num_key_value_heads
    nq = config.num_attention_heads
    attn.q_proj, attn.k_proj, attn.v_proj = _slices(attn.qkv_proj, [nq * hd, nkv * hd, nkv * hd])
    inter = mlp.gate_up_proj.out_features // 2
    mlp.gate_proj, mlp.up_proj = _slices(mlp.gate_up_proj, [inter, inter])
    mlp.act_fn = mlp.activation_fn


def fuse(*linears: torch.nn.Linear, whole: torch.nn.Linear | None = None) -> torch.Tensor:
    """Concatenate the weights of ``linears`` along the output dimension and point each
    module's weight at its slice of the result, so the fused copy costs no extra memory and
    the HF modules still compute exactly what they did. ``whole``: the checkpoint-fused
    module the parts were split from (:func:`split_checkpoint_fused`), re-pointed at the
    result too, so its own copy is freed (the executor multiplies the parts in the order
    given, whatever the checkpoint's layout)."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    for lin, part in zip(linears, fused.split([lin.out_features for lin in linears])):
        lin.weight = torch.nn.Parameter(part, requires_grad=False)
    if whole is not None:
        whole.weight = torch.nn.Parameter(fused, requires_grad=False)
    return fused


class InterleavedQKV(torch.nn.Module):
    """GPT-NeoX's ``query_key_value`` on weights stored as q, k, v blocks: the product of
    those blocks with its output columns put back in the checkpoint's per-head order
    ([h0 q, h0 k, h0 v, h1 q, ...]), so the HF attention module still computes what it did
    (transformers' ``hf-ar`` runs it) while the executor multiplies the blocks, one copy.

    Args:
        weight: ``[3 · Hq · hd, H]`` q rows, then k, then v
            (:func:`selfspec.models.layouts.reorder_interleaved`).
        bias: ``[3 · Hq · hd]`` in that order, or ``None``.
        heads: ``Hq``.
    """

    #: Its weight holds q, k, v blocks (what :func:`selfspec.models.gguf_weights
    #: .check_against_model` reads, without importing the executor).
    qkv_blocks = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, heads: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.heads = heads
        self.out_features, self.in_features = weight.shape

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The checkpoint's per-head order (a ``save_pretrained`` of the model writes what
        transformers loads), not the blocks this module holds."""
        for name, t in (("weight", self.weight), ("bias", self.bias)):
            if t is not None:
                destination[prefix + name] = interleave_blocks(t, self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` → ``[..., 3 · Hq · hd]`` in the checkpoint's interleaved order."""
        out = F.linear(x, self.weight, self.bias)
        blocks = out.unflatten(-1, (3, self.heads, -1))             # [..., 3, Hq, hd]
        return blocks.transpose(-3, -2).flatten(-3)                 # [..., Hq, 3, hd]


def gpt_neox_layer_weights(layer: torch.nn.Module, pack: bool, limits: PackedRowLimits,
                           keep_packed: bool, arch: Architecture) -> LayerWeights:
    """The weights of a GPT-NeoX decoder layer (transformers' modeling_gpt_neox
    ``GPTNeoXLayer``): ``attention.query_key_value`` reordered into q, k, v blocks (the
    module replaced by an :class:`InterleavedQKV` on that copy, so the old one is freed),
    ``attention.dense``, ``mlp.dense_h_to_4h`` / ``dense_4h_to_h`` with their biases, the
    two LayerNorms with theirs, the residual as ``arch.parallel_residual`` says."""
    attn, mlp = layer.attention, layer.mlp
    opts = {"row_limits": limits, "keep_packed": keep_packed}
    heads = attn.config.num_attention_heads
    qkv = attn.query_key_value
    if isinstance(qkv, InterleavedQKV):  # a second executor on the same model
        weight, bias = qkv.weight, qkv.bias
    else:
        weight = reorder_interleaved(qkv.weight, heads)
        bias = None if qkv.bias is None else reorder_interleaved(qkv.bias, heads)
        attn.query_key_value = InterleavedQKV(weight, bias, heads)
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    dense, up, down = attn.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h
    return LayerWeights(
        attn_norm=ln1.weight, attn_norm_eps=ln1.eps, attn_norm_bias=ln1.bias,
        qkv=Linear(attn.query_key_value.weight, attn.query_key_value.bias, pack, **opts),
        o=Linear(dense.weight, dense.bias, pack, **opts),
        mlp_norm=ln2.weight, mlp_norm_eps=ln2.eps, mlp_norm_bias=ln2.bias,
        gate_up=Linear(up.weight, up.bias, pack, **opts),
        down=Linear(down.weight, down.bias, pack, **opts),
        act=mlp.act, layer_norm=arch.norm_kind == "layer", gated=arch.gated_mlp,
        parallel=arch.parallel_residual,
        rope_partial=arch.rotary_fraction != 1.0)


def layer_weights(layer: torch.nn.Module, pack: bool, limits: PackedRowLimits,
                  keep_packed: bool = True, arch: Architecture | None = None,
                  index: int = 0) -> LayerWeights:
    """The weights of HF decoder layer ``index`` (``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, its norms as ``arch`` places them; ``None``: Llama's),
    q/k/v and gate/up fused; ``pack``: keep oneDNN-packed copies, ``keep_packed``: also
    while a kernel serves every call (:class:`Linear`)."""
    if arch is not None and arch.qkv_interleaved:
        return gpt_neox_layer_weights(layer, pack, limits, keep_packed, arch)
    attn, mlp = layer.self_attn, layer.mlp
    opts = {"row_limits": limits, "keep_packed": keep_packed}
    whole = arch is not None and arch.checkpoint_fused  # Phi-3: split at load, one copy
    matrices = {
        "qkv": Linear(fuse(attn.q_proj, attn.k_proj, attn.v_proj,
                           whole=attn.qkv_proj if whole else None),
                      cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), pack, **opts),
        "o": Linear(attn.o_proj.weight, attn.o_proj.bias, pack, **opts),
        "gate_up": Linear(fuse(mlp.gate_proj, mlp.up_proj,
                               whole=mlp.gate_up_proj if whole else None),
                          cat_bias(mlp.gate_proj, mlp.up_proj), pack, **opts),
        "down": Linear(mlp.down_proj.weight, mlp.down_proj.bias, pack, **opts),
    }
    if arch is not None and arch.norm_placement == "both":  # Gemma 3: four norms a layer
        norms = {"attn_norm": layer.input_layernorm.weight,
                 "attn_norm_eps": _eps(layer.input_layernorm),
                 "mlp_norm": layer.pre_feedforward_layernorm.weight,
                 "mlp_norm_eps": _eps(layer.pre_feedforward_layernorm),
                 "post_attn_norm": layer.post_attention_layernorm.weight,
                 "post_mlp_norm": layer.post_feedforward_layernorm.weight,
                 "post_norm_eps": _eps(layer.post_attention_layernorm)}
    elif arch is not None and arch.norm_placement == "post":
        post_attn, post_mlp = layer.post_attention_layernorm, layer.post_feedforward_layernorm
        norms = {"attn_norm": None, "attn_norm_eps": 0.0, "mlp_norm": None,
                 "mlp_norm_eps": 0.0, "post_attn_norm": post_attn.weight,
                 "post_mlp_norm": post_mlp.weight, "post_norm_eps": post_attn.variance_epsilon}
    else:
        norms = {"attn_norm": layer.input_layernorm.weight,
                 "attn_norm_eps": layer.input_layernorm.variance_epsilon,
                 "mlp_norm": layer.post_attention_layernorm.weight,
                 "mlp_norm_eps": layer.post_attention_layernorm.variance_epsilon}
    if arch is not None and arch.qk_norm != "none":
        norms.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                     qk_norm_eps=_eps(attn.q_norm),
                     qk_norm_whole=arch.qk_norm == "projection")
    if arch is not None and arch.norm_kind == "rms_offset":
        # Gemma's x̂ · (1 + w) in float32 is OLMo 2's order with the weight 1 + w in float32
        # (modeling_gemma3.Gemma3RMSNorm: output * (1.0 + weight.float()), then type_as(x)).
        norms.update({key: _offset_weight(t) for key, t in norms.items()
                      if isinstance(t, torch.Tensor)})
    if arch is not None:
        norms.update(norm_weight_fp32=arch.norm_kind in ("rms_weight_fp32", "rms_offset"),
                     rope=arch.rope_layers[index], rope_partial=arch.rotary_fraction != 1.0,
                     residual_scale=arch.residual_multiplier,
                     window=arch.sliding_window[index],
                     rope_kind=arch.rope_kinds[index] if arch.rope_kinds else "default")
    return LayerWeights(act=mlp.act_fn, **matrices, **norms)


def _eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon``; Gemma's modules call it ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def _offset_weight(weight: torch.Tensor) -> torch.Tensor:
    """``1 + w`` in float32 (a copy of ``H`` values) of a Gemma norm weight ``[H]``."""
    return 1.0 + weight.detach().float()
