"""Matrix backends: the number format / kernel family each weight matrix is multiplied with.

A *backend* serves one :class:`~selfspec.executor.linear.Linear`'s decoding and verification
products (and its bulk ones where it ``serves_bulk``) on its own copy of the weight:

* :class:`MatrixBackend` is what a kernel family provides (``prepack`` → a copy or ``None``,
  a row-consistent call, a bulk call, the bytes a call reads). selfspec's CPU families
  conform: :class:`~selfspec.executor.bf16_rows.Bf16Rows` (selfspec's AVX2 bf16 kernel),
  :class:`~selfspec.executor.fp16_rows.Fp16Rows` (FBGEMM fp16),
  :class:`~selfspec.executor.int4_rows.Int4Rows`, :class:`~selfspec.executor.w4a8.W4A8Rows`,
  :class:`~selfspec.executor.gguf_backend.GgufRows` (the GGUF file's own blocks),
  and :class:`~selfspec.executor.linear.ChainRows` (each weight on the first of several that
  takes it).
* :func:`select_backend` is the one place a family is chosen, as a function of the device
  and the format (``ComputeFormats.rows``): a family runs only on the device types
  :data:`BACKEND_DEVICES` lists for it (every one is CPU-only so far; a CUDA family adds its
  entry there). ``None`` leaves each matrix on the weights' own product (oneDNN-packed on
  CPU, ``F.linear`` elsewhere).
* :class:`BackendCache` keeps one backend object per (format, size threshold): a ``Linear``
  keeps each backend's copy of its weight, so the choice and the copy are made once per
  matrix, and switching kernels back and forth costs nothing after the first time.
* :func:`fused_backend` decides whether the fused sub-layer kernels
  (:mod:`selfspec.executor.fused_layers`) take a model's layers, and :func:`draft_copies`
  makes a draft view's quantized copies (:mod:`selfspec.executor.quant`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from selfspec.executor.bf16_rows import Bf16Rows
from selfspec.executor.fp16_rows import Fp16Rows
from selfspec.executor.linear import ChainedWeight, ChainRows, Linear

if TYPE_CHECKING:
    from selfspec.executor.attention import Attention
    from selfspec.executor.fused_layers import FusedLayers, LayerParts
    from selfspec.executor.weights import LayerWeights


@runtime_checkable
class MatrixBackend(Protocol):
    """What a number format / kernel family provides to serve a weight matrix.

    Attributes:
        serves_bulk: bulk calls (prefill, long blocks) also go to :meth:`bulk`; ``False``:
            they stay on the weights' own product.
    """

    serves_bulk: bool

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Any | None:
        """The backend's copy of ``weight`` ``[N, K]`` (and ``bias`` ``[N]``), or ``None``
        when it does not take this matrix (the matrix keeps the weights' own product).
        Called once per matrix and backend."""
        ...

    def __call__(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype, each row bit-identical to that row
        computed alone (decoding and verification)."""
        ...

    def bulk(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` for work that need not match one-token decoding."""
        ...

    def decode_bytes(self, packed: Any, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes of weight (and bias) one call on ``packed`` reads."""
        ...


#: The device types each decoding-kernel family (``ComputeFormats.rows``) runs on. A family
#: absent here (``"weights"``) is no backend: the weights' own product.
BACKEND_DEVICES: dict[str, tuple[str, ...]] = {
    "bf16": ("cpu",),
    "bf16+fp16": ("cpu",),
    "fp16": ("cpu",),
    "int4": ("cpu",),
    "w4a8": ("cpu",),
    "gguf": ("cpu",),
    "gguf+dense": ("cpu",),
}


def runs_on(rows: str, device: torch.device | str) -> bool:
    """Whether the kernel family ``rows`` runs on ``device`` (:data:`BACKEND_DEVICES`)."""
    return torch.device(device).type in BACKEND_DEVICES.get(rows, ())


def select_backend(device: torch.device | str, rows: str, min_bytes: int = 0,
                   max_rows: int = 64) -> MatrixBackend | None:
    """The backend of decoding and verification products for the format ``rows`` on
    ``device`` (a new object: :class:`BackendCache` keeps them).

    Args:
        device: where the weights are; a family runs only where :data:`BACKEND_DEVICES` says.
        rows: ``ComputeFormats.rows`` (:func:`selfspec.executor.cpu.choose_formats` has
            checked the kernel is available here).
        min_bytes: ``ComputeFormats.rows_min_bytes``: FBGEMM takes matrices from this size
            (under ``"bf16"``, for bulk copies only).
        max_rows: the longest call that must be row-consistent (verification blocks).

    Returns:
        The backend, or ``None``: every matrix keeps the weights' own product (``"weights"``,
        or a family that does not run on ``device``).

    Raises:
        RuntimeError: the family's kernel is missing in this build (a backend's constructor).
        InvalidArgumentError: ``"gguf"``: its backend is built from a GGUF file
            (:meth:`BackendCache.provide`), not here.
    """
    if not runs_on(rows, device):
        return None
    if rows.startswith("gguf"):
        from selfspec.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "decoding on GGUF blocks needs the GGUF file the model came from: load a registry "
            "model or a local .gguf with dtype 'gguf' (--dtype gguf)")
    if rows == "fp16":
        return Fp16Rows(max_rows, min_bytes)
    if rows in ("bf16", "bf16+fp16"):
        from selfspec.executor.cpu import native_bf16

        if rows == "bf16":
            return Bf16Rows(min_bytes or None, native_bulk=native_bf16())
        return ChainRows(Fp16Rows(max_rows, min_bytes), Bf16Rows(native_bulk=native_bf16()))
    if rows == "int4":
        from selfspec.executor.int4_rows import Int4Rows

        return Int4Rows(max_rows)
    if rows == "w4a8":
        from selfspec.executor.w4a8 import W4A8Rows

        return W4A8Rows()
    return None


class BackendCache:
    """One backend object per (format, size threshold) on one device, kept so that switching
    back finds each matrix's copy already built (a :class:`Linear` keeps its copy per
    backend object).

    Args:
        device: the weights' device.
        max_rows: the longest call that must be row-consistent.
    """

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.max_rows = max_rows
        self._backends: dict[tuple[str, int], MatrixBackend] = {}

    def provide(self, rows: str, backend: MatrixBackend) -> None:
        """Keep ``backend`` as the one of ``rows`` (any size threshold): for backends built
        from more than a format's name (``"gguf"``: from the file's blocks)."""
        self._backends[(rows, 0)] = backend

    def has(self, rows: str) -> bool:
        """Whether a backend of ``rows`` is kept (provided or built)."""
        return any(key[0] == rows for key in self._backends)

    def get(self, rows: str, min_bytes: int) -> MatrixBackend | None:
        """The backend of ``rows`` / ``min_bytes`` (:func:`select_backend`), built at its
        first request."""
        key = (rows, 0 if rows.startswith("gguf") else min_bytes)
        backend = self._backends.get(key)
        if backend is None:
            backend = select_backend(self.device, rows, min_bytes, self.max_rows)
            if backend is not None:
                self._backends[key] = backend
        return backend


def assign(matrices: Sequence[Linear], bulk_dtype: torch.dtype | None,
           backend: MatrixBackend | None, rebind: bool) -> None:
    """Point every matrix's bulk calls at ``bulk_dtype`` (``None``: the weights' format) and,
    with ``rebind``, its decoding calls at ``backend`` (each matrix prepacks its copy at the
    first request and keeps it)."""
    for lin in matrices:
        lin.bulk_dtype = bulk_dtype
        if rebind:
            lin.set_rows(backend)


@dataclass(frozen=True)
class DraftCopies:
    """A draft view's quantized matrices.

    Attributes:
        layers: one :class:`LayerWeights` per decoder layer, its four matrices quantized
            (norms shared).
        lm_head: ``lm_head`` quantized.
    """

    layers: list[LayerWeights]
    lm_head: Any


def draft_copies(layers: Sequence[LayerWeights], lm_head: Linear, fmt: str) -> DraftCopies:
    """Quantized copies (``fmt`` of :data:`selfspec.executor.quant.DRAFT_WEIGHT_FORMATS`) of
    every layer's matrices and of ``lm_head``.

    Raises:
        InvalidArgumentError: an unknown format, or int4 on an input size not a multiple of
            its group.
    """
    from selfspec.executor.quant import quantize_linear

    return DraftCopies(
        [w.map_matrices(lambda lin: quantize_linear(lin.weight, lin.bias, fmt)) for w in layers],
        quantize_linear(lm_head.weight, lm_head.bias, fmt))


def _fused_copy(lin: object) -> object:
    """The copy a fused kernel would read: a :class:`Linear`'s decoding backend copy (the
    chained kernel's own), or a draft view's quantized matrix itself."""
    copy = lin if not isinstance(lin, Linear) else lin.rows_weight
    return copy.copy if isinstance(copy, ChainedWeight) else copy


def fused_layer_reason(w: LayerWeights, act: str | None) -> str | None:
    """What the fused sub-layer kernels do not compute in layer ``w`` (MLP activation
    ``act``), by name, or ``None`` when they compute all of it: Llama's layer with what Qwen3
    and Gemma 3 add (per-head q/k norms, post-norms after pre-norms, a sliding window, a RoPE
    table per layer, GELU-tanh; :mod:`selfspec.executor.fused_layers`).
    :meth:`selfspec.models.architecture.Architecture.fused_reason` names the same features
    from the config."""
    from selfspec.executor.fused_layers import ACTIVATIONS

    missing = [name for name, on in (
        ("LayerNorm", w.layer_norm), ("a plain (non-gated) MLP", not w.gated),
        ("a parallel residual", w.parallel), ("partial rotary", w.rope_partial),
        ("no RoPE", not w.rope), ("q/k norms over the projection", w.qk_norm_whole),
        ("post-norms without pre-norms", w.attn_norm is None or w.mlp_norm is None),
        ("a residual multiplier", w.residual_scale != 1.0),
        (f"activation {act}", act not in ACTIVATIONS)) if on]
    return ", ".join(missing) or None


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A norm weight as the fused kernels read it: fp32, contiguous (bf16 → fp32 is exact)."""
    return None if t is None else t.detach().float().contiguous()


def fused_parts(w: LayerWeights, copies: Sequence[object], act: str) -> LayerParts:
    """Layer ``w`` as the fused kernels take it, on the matrix copies ``copies``
    (``(qkv, o, gate_up, down)``): its norms in fp32 and its features
    (:class:`selfspec.executor.fused_layers.LayerParts`)."""
    from selfspec.executor import fused_layers

    return fused_layers.LayerParts(
        _fp32(w.attn_norm), w.attn_norm_eps, copies[0], copies[1], _fp32(w.mlp_norm),
        w.mlp_norm_eps, copies[2], copies[3], q_norm=_fp32(w.q_norm), k_norm=_fp32(w.k_norm),
        qk_eps=w.qk_norm_eps, post_attn_norm=_fp32(w.post_attn_norm),
        post_mlp_norm=_fp32(w.post_mlp_norm), post_eps=w.post_norm_eps, window=w.window,
        act=act)


def fused_backend(layers: Sequence[LayerWeights], attention: Attention, dtype: torch.dtype,
                  device: torch.device, rope_dynamic: bool,
                  hidden_act: str | None) -> FusedLayers | None:
    """The decoder layers as fused sub-layer kernels when every projection decodes on one of
    selfspec's kernels that have them (all w4a8, all bf16, or all GGUF blocks of one build) and
    the layers are ones they take (CPU, bf16/fp32 hidden states, RoPE from a table, even
    ``head_dim``, no feature :func:`fused_layer_reason` names); else ``None``.

    Args:
        layers: the executor's layer weights (a draft view's quantized ones included).
        attention: the attention geometry (its ``scaling``: Gemma 3's
            ``query_pre_attn_scalar ** -0.5``).
        dtype: the hidden states' and KV cache's dtype.
        device: the weights' device (only ``cpu`` has fused kernels).
        rope_dynamic: the RoPE type depends on the length (no table).
        hidden_act: the MLP's activation (``Architecture.activation``).
    """
    from selfspec.executor import fused_layers

    if (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32)
            or rope_dynamic or attention.head_dim % 2
            or any(fused_layer_reason(w, hidden_act) for w in layers)):
        # Architecture.fused_reason says why, for `selfspec info` and the log.
        return None
    parts = [fused_parts(w, [_fused_copy(lin) for lin in w.matrices], str(hidden_act))
             for w in layers]
    kernel = fused_layers.kernel_of([m for p in parts for m in (p.qkv, p.o, p.gate_up,
                                                                 p.down)])
    isa = parts[0].qkv.isa if kernel == "gguf" else "auto"
    if kernel is None or not fused_layers.fused_available(kernel, isa):
        return None
    return fused_layers.FusedLayers(parts, attention.num_heads, attention.num_kv_heads,
                                    attention.head_dim, float(attention.scaling), dtype)
