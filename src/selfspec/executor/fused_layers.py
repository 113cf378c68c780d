"""Whole decoder sub-layers in one kernel call each (``kernels/fused_layers.h``, built into
``kernels/w4a8_rows.cpp``, ``kernels/bf16_rows.cpp`` and ``kernels/gguf_rows.cpp``:
``selfspec_<kernel>_attention``, ``selfspec_<kernel>_mlp``), for executors whose every
projection decodes on one of selfspec's own kernels: ``w4a8`` (``--dtype w4a8``, the
``draft_view("w4a8")`` that ``qspec`` drafts on), ``bf16`` (bf16 models on CPUs that emulate
bf16, and on CPUs with native bf16 where the layers' matrices are small: SmolLM2-135M) or ``gguf``
(``--dtype gguf``: the GGUF file's own blocks, one build per ISA).

Why: with the products on these kernels, what is left of a decode step is some thirty small
torch operators a layer (RMSNorm in fp32 and back, RoPE, the cache write, SDPA, SiLU, the
residual adds): a sizeable share of a Qwen2.5-Coder-1.5B step in w4a8, and most of a
SmolLM2-135M step. Here an attention sub-layer (RMSNorm → qkv → [q/k norms →] RoPE → cache
append → attention → o → [post-norm →] residual) and an MLP sub-layer (RMSNorm → gate/up →
act(gate)·up → down → [post-norm →] residual) are each one call, the activations between
products staying in fp32.

Exactness: every row is computed as it would be alone (its own norm, the kernels'
row-independent products, attention over its own prefix), so a verification block equals
one-token decoding bit for bit and every lossless method stays exact relative to the model
decoding on these layers (``tests/executor/test_fused_layers.py``). Numerics differ slightly from
the
torch path (fp32 in between instead of rounding to the model's dtype after each operator), so
one decoding uses one path throughout: :class:`selfspec.executor.LayerExecutor` takes this
one for every non-bulk block that writes the cache (bulk blocks — prefill — stay on torch's
flash attention, shared by every method).

Supports Llama/Qwen2 decoder layers with SiLU MLPs and what Qwen3 and Gemma 3 add (per-head
q/k RMSNorms before RoPE, post-norms of each sub-layer's output, Gemma's ``1 + w`` norm
weights made in fp32 at load, GELU-tanh, a sliding window per layer, a RoPE table per layer
and any attention scale), bf16 or fp32 hidden states and KV cache, any head geometry the
kernels take (w4a8: input sizes multiples of 32; gguf: those of the blocks).
:func:`selfspec.executor.backends.fused_layer_reason` says what else a layer needs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.executor import bf16_rows, gguf_rows, w4a8
from selfspec.executor.bf16_rows import Bf16Weight
from selfspec.executor.gguf_rows import GgufMatrix
from selfspec.executor.w4a8 import W4A8Linear

_DTYPES = (torch.bfloat16, torch.float32)


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("minimum", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Bf16Matrix(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Segment(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("keys", "values", "capacity", "first_position", "first_row", "rows")]


class _AttentionArgs(ctypes.Structure):
    _fields_ = [("hidden_in", ctypes.c_void_p), ("hidden_out", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("qkv", ctypes.c_void_p),
                ("o", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("segments", ctypes.POINTER(_Segment)),
                *[(name, ctypes.c_int64) for name in
                  ("num_segments", "rows", "hidden", "heads", "kv_heads", "head_dim", "bf16")],
                ("eps", ctypes.c_float), ("scaling", ctypes.c_float),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("window", ctypes.c_int64)]


class _MlpArgs(ctypes.Structure):
    _fields_ = [("hidden_in", ctypes.c_void_p), ("hidden_out", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in ("rows", "hidden", "intermediate", "bf16")],
                ("eps", ctypes.c_float), ("post_norm", ctypes.c_void_p),
                ("post_eps", ctypes.c_float), ("act", ctypes.c_int64)]


#: The MLP activations the kernel computes (``act(gate) · up``), by ``config.hidden_act`` /
#: ``hidden_activation``, as its ``Activation`` codes: SiLU, and PyTorch's tanh-approximated
#: GELU (transformers' ``gelu_pytorch_tanh``, Gemma 3's).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


Matrix = W4A8Linear | Bf16Weight | GgufMatrix


def _matrix(m: Matrix) -> tuple[ctypes.Structure, int, int]:
    """The kernel's view of one matrix, and its (out, in) sizes."""
    if isinstance(m, W4A8Linear):
        return (_Weight(m.codes_ptr, m.scale_ptr, m.low_ptr, m.bias_ptr, m.out_features,
                        m.in_features), m.out_features, m.in_features)
    if isinstance(m, GgufMatrix):  # its struct lives (and keeps its segments) with it
        return m.fused, m.out_features, m.in_features
    n, k = m.weight.shape
    return _Bf16Matrix(m.weight_ptr, m.bias_ptr, n, k), n, k


def kernel_of(matrices: Sequence[object]) -> str | None:
    """``"w4a8"``, ``"bf16"`` or ``"gguf"`` when every matrix is that kernel's copy (for
    ``"gguf"``, of one ISA build), else ``None``."""
    if all(isinstance(m, W4A8Linear) for m in matrices):
        return "w4a8"
    if all(isinstance(m, Bf16Weight) for m in matrices):
        return "bf16"
    if all(isinstance(m, GgufMatrix) for m in matrices) and len(
            {m.isa for m in matrices}) == 1:
        return "gguf"
    return None


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the fused kernel takes it.

    Attributes:
        attn_norm / mlp_norm: ``[H]`` fp32 RMSNorm weights (``w``; Gemma's ``1 + w``).
        attn_eps / mlp_eps: their epsilons.
        qkv: ``[(Hq + 2 H_kv) head_dim, H]`` (q, k, v rows in that order), o ``[H, Hq head_dim]``,
            gate_up ``[2 I, H]`` (gate rows, then up rows), down ``[H, I]``: all w4a8 copies
            (:class:`W4A8Linear`), all bf16 ones (:class:`Bf16Weight`) or all GGUF blocks of
            one ISA build (:class:`GgufMatrix`).
        q_norm / k_norm: ``[head_dim]`` fp32 RMSNorm weights of each query / key head, applied
            before RoPE (Qwen3, Gemma 3: modeling_qwen3.Qwen3Attention), or ``None``.
        qk_eps: their epsilon.
        post_attn_norm / post_mlp_norm: ``[H]`` fp32 RMSNorm weights of each sub-layer's
            output before the residual add (Gemma 3's post_attention_layernorm,
            post_feedforward_layernorm), or ``None``.
        post_eps: their epsilon.
        window: the sliding window ``W`` (a query at ``p`` attends to keys
            ``p - W < k <= p``, transformers' ``sliding_window_causal``), or ``None``.
        act: the MLP's activation, a key of :data:`ACTIVATIONS`.
    """

    attn_norm: torch.Tensor
    attn_eps: float
    qkv: Matrix
    o: Matrix
    mlp_norm: torch.Tensor
    mlp_eps: float
    gate_up: Matrix
    down: Matrix
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    post_eps: float = 1e-6
    window: int | None = None
    act: str = "silu"

    def __post_init__(self) -> None:
        """Raises ValueError: a norm not fp32 contiguous of its size, one q/k norm without
        the other, or an activation not in :data:`ACTIVATIONS`."""
        for t in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm,
                  self.post_attn_norm, self.post_mlp_norm):
            if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()):
                raise ValueError("fused layers read fp32 contiguous norm weights")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("fused layers take q and k norms together")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"fused layers compute {', '.join(ACTIVATIONS)}, not {self.act}")


@dataclass(frozen=True)
class KVSegment:
    """Rows ``first_row .. first_row + rows - 1`` of a call: one sequence's consecutive tokens
    from position ``first_position``, whose keys and values go to (and are read from)
    ``keys`` / ``values``: one layer's storage ``[1, H_kv, capacity, head_dim]`` of a batch-1
    :class:`selfspec.executor.cache.KVCache`, already holding positions
    ``0 .. first_position - 1``."""

    keys: torch.Tensor
    values: torch.Tensor
    first_position: int
    first_row: int
    rows: int


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for the kernel's args (``None``: a null pointer)."""
    return None if t is None else t.data_ptr()


def _library(kernel: str, isa: str = "auto"):
    if kernel == "gguf":
        return gguf_rows.gguf_library(isa)
    return (w4a8._library() if kernel == "w4a8" else bf16_rows._library()).library


def fused_available(kernel: str = "w4a8", isa: str = "auto") -> bool:
    """Whether ``kernel``'s library (with its fused sub-layers) runs here; ``isa`` picks the
    gguf build (``"auto"``, ``"avx2"``, ``"avx512"``, ``"amx"``)."""
    return _library(kernel, isa) is not None


class FusedLayers:
    """A model's decoder layers on fused sub-layer kernels (module docstring).

    Args:
        layers: one :class:`LayerParts` per decoder layer, every matrix of one kernel.
        heads / kv_heads / head_dim: attention geometry (``heads`` a multiple of ``kv_heads``).
        scaling: the attention score scale (``head_dim ** -0.5`` for Llama/Qwen2; Gemma 3's
            ``query_pre_attn_scalar ** -0.5``).
        dtype: the hidden states' and KV cache's dtype, bf16 or fp32.

    Raises:
        RuntimeError: the kernel is not available here (check :func:`fused_available`).
        ValueError: another dtype, or matrices of mixed or other kernels.
    """

    def __init__(self, layers: Sequence[LayerParts], heads: int, kv_heads: int, head_dim: int,
                 scaling: float, dtype: torch.dtype) -> None:
        self._parts = list(layers)
        kernel = kernel_of([m for p in self._parts for m in (p.qkv, p.o, p.gate_up, p.down)])
        if kernel is None:
            raise ValueError("fused layers need every matrix on the w4a8, every one on the bf16 "
                             "or every one on one build of the gguf kernel")
        if dtype not in _DTYPES:
            raise ValueError(f"fused layers take bf16 or fp32, not {dtype}")
        lib = _library(kernel, self._parts[0].qkv.isa if kernel == "gguf" else "auto")
        if lib is None:
            raise RuntimeError(f"the {kernel} kernel is not available here")
        self.kernel = kernel
        self._attention_fn = getattr(lib, f"selfspec_{kernel}_attention")
        self._attention_fn.argtypes = [ctypes.POINTER(_AttentionArgs)]
        self._attention_fn.restype = None
        self._mlp_fn = getattr(lib, f"selfspec_{kernel}_mlp")
        self._mlp_fn.argtypes = [ctypes.POINTER(_MlpArgs)]
        self._mlp_fn.restype = None
        self.dtype = dtype
        bf16 = int(dtype == torch.bfloat16)
        self._keep: list[object] = []  # ctypes structs the args point into
        self._attention_args: list[_AttentionArgs] = []
        self._mlp_args: list[_MlpArgs] = []
        # The one segment of a one-sequence call (:meth:`attention_at`), refilled per call:
        # building a ctypes array per call cost more than the fields.
        self._one_segment = (_Segment * 1)()
        for part in self._parts:
            (qkv, _, _), (o, hidden, _), (gate_up, _, _), (down, _, inter) = (
                _matrix(m) for m in (part.qkv, part.o, part.gate_up, part.down))
            self._keep += [qkv, o, gate_up, down]
            self._attention_args.append(_AttentionArgs(
                norm=part.attn_norm.data_ptr(), qkv=ctypes.addressof(qkv),
                o=ctypes.addressof(o), hidden=hidden, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, bf16=bf16, eps=part.attn_eps, scaling=scaling,
                q_norm=_ptr(part.q_norm), k_norm=_ptr(part.k_norm),
                post_norm=_ptr(part.post_attn_norm), qk_eps=part.qk_eps,
                post_eps=part.post_eps, window=part.window or 0))
            self._mlp_args.append(_MlpArgs(
                norm=part.mlp_norm.data_ptr(), gate_up=ctypes.addressof(gate_up),
                down=ctypes.addressof(down), hidden=hidden, intermediate=inter, bf16=bf16,
                eps=part.mlp_eps, post_norm=_ptr(part.post_mlp_norm),
                post_eps=part.post_eps, act=ACTIVATIONS[part.act]))

    def attention(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  segments: Sequence[KVSegment]) -> torch.Tensor:
        """``hidden + attention_sublayer(hidden)`` for layer ``layer``.

        Args:
            hidden: ``[T, H]`` contiguous, in :attr:`dtype` (not modified).
            cos / sin: ``[T, head_dim]`` fp32 contiguous: each row's RoPE at its position,
                from layer ``layer``'s table (Gemma 3: its layer type's base).
            segments: the rows' sequences and caches, covering rows ``0 .. T-1``; their
                keys and values are written at their positions (the caller accounts the
                cache lengths) before any row attends.

        Returns:
            ``[T, H]`` in :attr:`dtype`.
        """
        segs = (_Segment * len(segments))(*[
            _Segment(s.keys.data_ptr(), s.values.data_ptr(), s.keys.shape[2], s.first_position,
                     s.first_row, s.rows) for s in segments])
        return self._attend(layer, hidden, cos, sin, segs, len(segments), torch.empty_like(hidden))

    def attention_at(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     first_position: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`attention` for one sequence: ``hidden`` ``[T, H]`` or ``[1, T, H]``
        (contiguous) is its consecutive tokens from ``first_position``, with that layer's
        storage ``keys`` / ``values`` (``[1, H_kv, capacity, head_dim]``, holding positions
        ``0 .. first_position - 1``). The same call as :meth:`attention` with one
        :class:`KVSegment`, without building one: the layer-by-layer decoding of SpecEE and
        AdaDecode makes ~15 such calls a token, so their Python counts.

        Args:
            out: where to write the result (``hidden``'s shape, not ``hidden``), or ``None``
                for a new tensor.

        Returns:
            ``out``, or a new tensor shaped as ``hidden``.
        """
        seg = self._one_segment[0]
        seg.keys, seg.values, seg.capacity = keys.data_ptr(), values.data_ptr(), keys.shape[2]
        seg.first_position, seg.first_row, seg.rows = first_position, 0, hidden.shape[-2]
        return self._attend(layer, hidden, cos, sin, self._one_segment, 1,
                            torch.empty_like(hidden) if out is None else out)

    def _attend(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: ctypes.Array, num_segments: int, out: torch.Tensor) -> torch.Tensor:
        """The attention kernel call of :meth:`attention` and :meth:`attention_at`."""
        args = self._attention_args[layer]
        args.hidden_in, args.hidden_out = hidden.data_ptr(), out.data_ptr()
        args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
        args.segments, args.num_segments, args.rows = segments, num_segments, hidden.shape[-2]
        self._attention_fn(ctypes.byref(args))
        return out

    def mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + mlp_sublayer(hidden)`` for layer ``layer``: ``[T, H]`` (or ``[1, T,
        H]``) → the same shape (``hidden`` contiguous in :attr:`dtype`, not modified)."""
        out = torch.empty_like(hidden)
        args = self._mlp_args[layer]
        args.hidden_in, args.hidden_out = hidden.data_ptr(), out.data_ptr()
        args.rows = hidden.shape[-2]
        self._mlp_fn(ctypes.byref(args))
        return out
