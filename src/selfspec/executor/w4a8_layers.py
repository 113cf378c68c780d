"""Whole decoder sub-layers on w4a8 weights, one kernel call each (``kernels/w4a8_rows.cpp``:
``selfspec_w4a8_attention``, ``selfspec_w4a8_mlp``).

Why: with the products on 4-bit weights, what is left of a decode step is some thirty small
torch operators a layer (RMSNorm in fp32 and back, RoPE, the cache write, SDPA, SiLU, the
residual adds): 11.9 of 73–89 ms on Qwen2.5-Coder-1.5B (2-core AVX2 EPYC, 2 threads), against
~5 ms for llama.cpp's whole non-matmul work. Here an attention sub-layer (RMSNorm → qkv →
RoPE → cache append → attention → o → residual) and an MLP sub-layer (RMSNorm → gate/up →
SiLU·up → down → residual) are each one call into the kernel, the activations between
products staying in fp32.

Exactness: every row is computed as it would be alone (its own norm, the kernel's
row-independent products, attention over its own prefix), so a verification block equals
one-token decoding bit for bit and every lossless method stays exact relative to the model
decoding on this kernel (``tests/test_w4a8_layers.py``). Numerics differ slightly from the
torch path (fp32 in between instead of rounding to the model's dtype after each operator),
so one decoding uses one path throughout: :class:`selfspec.executor.LayerExecutor` takes this
one for every non-bulk block it can (bulk blocks — prefill — stay on torch's flash attention,
shared by every method).

Supports Llama/Qwen2 decoder layers with SiLU MLPs, bf16 or fp32 hidden states and KV cache,
any head geometry whose projections the w4a8 kernel takes (input sizes multiples of 32).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.executor.w4a8 import W4A8Linear, _library

_DTYPES = (torch.bfloat16, torch.float32)


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("minimum", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Segment(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("keys", "values", "capacity", "first_position", "first_row", "rows")]


class _AttentionArgs(ctypes.Structure):
    _fields_ = [("hidden_in", ctypes.c_void_p), ("hidden_out", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("qkv", ctypes.POINTER(_Weight)),
                ("o", ctypes.POINTER(_Weight)), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("segments", ctypes.POINTER(_Segment)),
                *[(name, ctypes.c_int64) for name in
                  ("num_segments", "rows", "hidden", "heads", "kv_heads", "head_dim", "bf16")],
                ("eps", ctypes.c_float), ("scaling", ctypes.c_float)]


class _MlpArgs(ctypes.Structure):
    _fields_ = [("hidden_in", ctypes.c_void_p), ("hidden_out", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("gate_up", ctypes.POINTER(_Weight)),
                ("down", ctypes.POINTER(_Weight)),
                *[(name, ctypes.c_int64) for name in ("rows", "hidden", "intermediate", "bf16")],
                ("eps", ctypes.c_float)]


def _weight(lin: W4A8Linear) -> _Weight:
    return _Weight(lin.codes_ptr, lin.scale_ptr, lin.low_ptr, lin.bias_ptr,
                   lin.out_features, lin.in_features)


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the fused kernel takes it.

    Attributes:
        attn_norm / mlp_norm: ``[H]`` RMSNorm weights in the model's dtype.
        attn_eps / mlp_eps: their epsilons.
        qkv: ``[(Hq + 2 H_kv) head_dim, H]`` (q, k, v rows in that order), o ``[H, Hq head_dim]``,
            gate_up ``[2 I, H]`` (gate rows, then up rows), down ``[H, I]``.
    """

    attn_norm: torch.Tensor
    attn_eps: float
    qkv: W4A8Linear
    o: W4A8Linear
    mlp_norm: torch.Tensor
    mlp_eps: float
    gate_up: W4A8Linear
    down: W4A8Linear


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


def fused_available() -> bool:
    """Whether the kernel (with its fused sub-layers) runs here."""
    return _library().library is not None


class FusedLayers:
    """A model's decoder layers on the fused w4a8 sub-layer kernels (module docstring).

    Args:
        layers: one :class:`LayerParts` per decoder layer.
        heads / kv_heads / head_dim: attention geometry (``heads`` a multiple of ``kv_heads``).
        scaling: the attention score scale (``head_dim ** -0.5`` for Llama/Qwen2).
        dtype: the hidden states' and KV cache's dtype, bf16 or fp32.

    Raises:
        RuntimeError: the kernel is not available here (check :func:`fused_available`).
        ValueError: another dtype.
    """

    def __init__(self, layers: Sequence[LayerParts], heads: int, kv_heads: int, head_dim: int,
                 scaling: float, dtype: torch.dtype) -> None:
        lib = _library().library
        if lib is None:
            raise RuntimeError(f"the w4a8 kernel is not available: {_library().reason}")
        if dtype not in _DTYPES:
            raise ValueError(f"fused w4a8 layers take bf16 or fp32, not {dtype}")
        self._attention_fn = lib.selfspec_w4a8_attention
        self._attention_fn.argtypes = [ctypes.POINTER(_AttentionArgs)]
        self._attention_fn.restype = None
        self._mlp_fn = lib.selfspec_w4a8_mlp
        self._mlp_fn.argtypes = [ctypes.POINTER(_MlpArgs)]
        self._mlp_fn.restype = None
        self.dtype = dtype
        self.head_dim = head_dim
        bf16 = int(dtype == torch.bfloat16)
        self._parts = list(layers)
        self._keep: list[object] = []  # ctypes structs the args point into
        self._attention_args: list[_AttentionArgs] = []
        self._mlp_args: list[_MlpArgs] = []
        for part in self._parts:
            qkv, o, gate_up, down = (_weight(part.qkv), _weight(part.o), _weight(part.gate_up),
                                     _weight(part.down))
            self._keep += [qkv, o, gate_up, down]
            self._attention_args.append(_AttentionArgs(
                norm=part.attn_norm.data_ptr(), qkv=ctypes.pointer(qkv), o=ctypes.pointer(o),
                hidden=part.o.out_features, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                bf16=bf16, eps=part.attn_eps, scaling=scaling))
            self._mlp_args.append(_MlpArgs(
                norm=part.mlp_norm.data_ptr(), gate_up=ctypes.pointer(gate_up),
                down=ctypes.pointer(down), hidden=part.down.out_features,
                intermediate=part.down.in_features, bf16=bf16, eps=part.mlp_eps))

    def attention(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  segments: Sequence[KVSegment]) -> torch.Tensor:
        """``hidden + attention_sublayer(hidden)`` for layer ``layer``.

        Args:
            hidden: ``[T, H]`` contiguous, in :attr:`dtype` (not modified).
            cos / sin: ``[T, head_dim]`` fp32 contiguous: each row's RoPE at its position.
            segments: the rows' sequences and caches, covering rows ``0 .. T-1``; their
                keys and values are written at their positions (the caller accounts the
                cache lengths) before any row attends.

        Returns:
            ``[T, H]`` in :attr:`dtype`.
        """
        out = torch.empty_like(hidden)
        segs = (_Segment * len(segments))(*[
            _Segment(s.keys.data_ptr(), s.values.data_ptr(), s.keys.shape[2], s.first_position,
                     s.first_row, s.rows) for s in segments])
        args = self._attention_args[layer]
        args.hidden_in, args.hidden_out = hidden.data_ptr(), out.data_ptr()
        args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
        args.segments, args.num_segments, args.rows = segs, len(segments), hidden.shape[0]
        self._attention_fn(ctypes.byref(args))
        return out

    def mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + mlp_sublayer(hidden)`` for layer ``layer``: ``[T, H]`` → ``[T, H]``
        (``hidden`` contiguous in :attr:`dtype`, not modified)."""
        out = torch.empty_like(hidden)
        args = self._mlp_args[layer]
        args.hidden_in, args.hidden_out = hidden.data_ptr(), out.data_ptr()
        args.rows = hidden.shape[0]
        self._mlp_fn(ctypes.byref(args))
        return out
