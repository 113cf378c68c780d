"""Matrix-vector products for the decode path.

Decoding one token multiplies a ``[1, H]`` vector by every weight matrix, so the speed of the
whole model is the speed of these products. On CPU, oneDNN weights pre-packed into its
blocked layout stream faster than ``F.linear`` on plain row-major weights for
bf16/fp16. They agree with ``F.linear`` to bf16 precision, not always bit for bit; what
lossless decoding needs is that a verification block's rows equal one-token decoding's, which
:class:`PackedRowLimits` ensures. fp32 keeps ``F.linear``, the dtype used to check exactness
against transformers.

Bulk calls (prefill, long blocks) may compute in another format than the weights'
(:class:`selfspec.executor.cpu.ComputeFormats`): on CPUs that emulate bf16 a cast of the
weight to fp32 per call is several times faster than the emulated bf16 product. There, decoding and
verification use FBGEMM's fp16-weight kernel instead of the emulated bf16 one
(:mod:`selfspec.executor.fp16_rows`), whose cost hardly grows with the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.nn.functional as F

from selfspec.executor.fp16_rows import Fp16Rows
from selfspec.executor.row_consistency import PackedRowLimits, in_consistent_chunks

if TYPE_CHECKING:
    from selfspec.executor.bf16_rows import Bf16Rows
    from selfspec.executor.int4_rows import Int4Rows
    from selfspec.executor.w4a8 import W4A8Rows

RowsKernel = Union[Fp16Rows, "Int4Rows", "W4A8Rows", "Bf16Rows", "ChainRows"]

logger = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16)
_MISSING = object()


@dataclass(frozen=True)
class ChainedWeight:
    """A weight's copy for the kernel of a :class:`ChainRows` that took it."""

    kernel: Any
    copy: Any

    @property
    def nbytes(self) -> int | None:
        """Bytes one call reads, where the kernel's copy says (``None``: an opaque copy)."""
        nbytes = getattr(self.copy, "nbytes", None)
        return nbytes if isinstance(nbytes, int) else None


class ChainRows:
    """Several decoding kernels, each weight on the first that takes it (its ``prepack`` gives
    a copy, not ``None``): e.g. FBGEMM's fp16 kernel for matrices of at least 4 MiB, then
    selfspec's bf16 kernel for the rest (``--decode-kernel auto`` on CPUs that emulate bf16).
    Every weight stays on one kernel, so each row-consistent kernel keeps verification
    bit-identical to one-token decoding.

    Args:
        kernels: the kernels, in order of preference; each must serve bulk calls.
    """

    serves_bulk = True

    def __init__(self, *kernels: Any) -> None:
        if not all(k.serves_bulk for k in kernels):
            raise ValueError("ChainRows needs kernels that serve bulk calls")
        self.kernels = kernels

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> ChainedWeight | None:
        """The first kernel's copy of ``weight`` ``[N, K]``, or ``None`` if none takes it."""
        for kernel in self.kernels:
            copy = kernel.prepack(weight, bias)
            if copy is not None:
                return ChainedWeight(kernel, copy)
        return None

    def __call__(self, x: torch.Tensor, packed: ChainedWeight) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]``, row-consistent, on the kernel that took the weight."""
        return packed.kernel(x, packed.copy)

    def bulk(self, x: torch.Tensor, packed: ChainedWeight) -> torch.Tensor:
        """A bulk call on the kernel that took the weight."""
        return packed.kernel.bulk(x, packed.copy)

    def decode_bytes(self, packed: ChainedWeight, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes one call reads, as the kernel that took the weight counts them."""
        return packed.kernel.decode_bytes(packed.copy, weight, bias)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` ``[N, K]``; raises ``RuntimeError`` where this CPU
    has no packed kernel for its dtype (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _packed(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed product ``[..., K]`` → ``[..., N]`` of ``packed`` (a blocked copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _alone(rows: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``[M, K]`` → ``[M, N]``, each row computed as one-token decoding computes it (a call of
    two copies of the row: see :meth:`selfspec.executor.linear.Linear.__call__`)."""
    return torch.cat([_packed(row.expand(2, -1), packed, bias)[:1]
                      for row in rows.split(1)])


class Linear:
    """``y = x Wᵀ + b`` with the weight packed for oneDNN where that is exact and faster.

    Args:
        weight: ``[N, K]`` weight (kept by reference; a packed copy is added when used).
        bias: ``[N]`` or ``None``.
        pack: try packing (CPU, bf16/fp16, oneDNN available); falls back to ``F.linear``
            when the packed kernel is missing or disagrees with ``F.linear`` on a probe.
        bulk_dtype: the format of bulk calls (``None`` = the weight's own).
        rows: compute non-bulk calls (decoding, verification) with this kernel on its own copy
            of the weight (:class:`selfspec.executor.fp16_rows.Fp16Rows`: fp16;
            :class:`selfspec.executor.int4_rows.Int4Rows`: int4;
            :class:`selfspec.executor.w4a8.W4A8Rows`: w4a8); ``None`` or a weight it
            cannot take keeps the weight's own format. Bulk calls use it only where the kernel
            ``serves_bulk``.
        row_limits: the row-consistency table of the packed kernel, shared by the linears of
            one executor (``None``: this linear keeps its own).
        keep_packed: keep the oneDNN-packed copy while a ``rows`` kernel serves the non-bulk
            calls; ``False`` frees it then (under ``--dtype gguf`` that is most of a bf16
            copy of the model: bulk calls the kernel does not serve take ``F.linear``, which
            packs per call) and packs again at the first :meth:`set_rows` that leaves
            decoding to the weight's own product.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True,
                 bulk_dtype: torch.dtype | None = None, rows: RowsKernel | None = None,
                 row_limits: PackedRowLimits | None = None, keep_packed: bool = True) -> None:
        self.weight = weight
        self.bias = bias
        self.row_limits = row_limits if row_limits is not None else PackedRowLimits()
        self.bulk_dtype = None if bulk_dtype == weight.dtype else bulk_dtype
        self.packed: torch.Tensor | None = None
        self.keep_packed = keep_packed
        self._may_pack = pack and _can_pack(weight)
        self._pack_tried = False  # a failed packing is not retried
        self.rows: RowsKernel | None = None
        self.rows_weight: Any = None
        self._copies: list[tuple[RowsKernel, Any]] = []  # each kernel's copy, built once
        self._bind(rows)
        if keep_packed:  # else packed at the first set_rows that needs it (no transient copy)
            self._sync_packed()

    def set_rows(self, rows: RowsKernel | None) -> None:
        """Use (``rows``) or stop using (``None``) another kernel for non-bulk calls; pack the
        weight for oneDNN where its own product serves some calls (and free that copy where
        none does and ``keep_packed`` is ``False``)."""
        self._bind(rows)
        self._sync_packed()

    def _bind(self, rows: RowsKernel | None) -> None:
        self.rows, self.rows_weight = None, None
        if rows is not None and self.weight.device.type == "cpu":
            copy = next((c for k, c in self._copies if k is rows), _MISSING)
            if copy is _MISSING:
                copy = rows.prepack(self.weight, self.bias)
                self._copies.append((rows, copy))
            self.rows_weight = copy
            self.rows = rows if copy is not None else None

    def _sync_packed(self) -> None:
        # Without keep_packed, a kernel that serves the non-bulk calls leaves at most bulk
        # calls (prefill, long free blocks) to the dense product: F.linear reorders the
        # weight per call, which a block of that size amortizes, and no copy stays resident.
        if self.rows is not None and not self.keep_packed:
            self.packed, self._pack_tried = None, False
        elif (self.rows is None or not self.rows.serves_bulk) and self.packed is None \
                and self._may_pack and not self._pack_tried:
            self._pack_tried = True
            self.packed = _try_pack(self.weight, self.bias)

    @classmethod
    def of_rows(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: torch.Tensor, kernel: RowsKernel | None = None,
                row_limits: PackedRowLimits | None = None) -> Linear:
        """A packed copy of output rows ``rows`` ``[R]`` of ``weight`` ``[N, K]`` (and
        ``bias``): ``[..., K]`` → ``[..., R]``, on the fp16-weight ``kernel`` if given."""
        rows = rows.to(weight.device)
        return cls(weight.detach()[rows].contiguous(),
                   None if bias is None else bias.detach()[rows].contiguous(), rows=kernel,
                   row_limits=row_limits)

    @property
    def out_features(self) -> int:
        """N."""
        return self.weight.shape[0]

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight and bias one decoding call reads: the decoding kernel's copy where
        one serves (fp16: 2 bytes a weight; int4: codes + scales + offsets), else the
        weight's own."""
        if self.rows is not None:
            return self.rows.decode_bytes(self.rows_weight, self.weight, self.bias)
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + bias

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype; ``bulk=True`` computes in the bulk
        format, or on the fp16 copy without row padding (not bit-consistent with the
        non-bulk path: never for blocks that must match one-token decoding)."""
        if bulk and self.rows is not None and self.rows.serves_bulk:
            return self.rows.bulk(x, self.rows_weight)
        if bulk and self.bulk_dtype is not None:
            fmt = self.bulk_dtype
            bias = None if self.bias is None else self.bias.to(fmt)
            return F.linear(x.to(fmt), self.weight.to(fmt), bias).to(x.dtype)
        if self.rows is not None and not bulk:
            return self.rows(x, self.rows_weight)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if bulk:
            return _packed(x, self.packed, self.bias)
        if x.numel() == x.shape[-1]:
            # A single row takes oneDNN's matrix-vector kernel, which rounds some outputs
            # differently from the matrix-matrix kernel that verification's few rows take;
            # in bf16 that flips near-tied argmaxes between speculative and autoregressive
            # decoding. Two rows take the matrix-matrix kernel at the same memory traffic.
            pair = torch.cat([x, x], dim=-2) if x.dim() > 1 else torch.stack([x, x])
            out = _packed(pair, self.packed, self.bias)
            return out[..., :1, :] if x.dim() > 1 else out[0]
        out_features, in_features = self.weight.shape
        sizes = self.row_limits.limit_of(
            ("onednn", in_features, out_features, self.bias is not None),
            lambda b: _packed(b, self.packed, self.bias),
            lambda b: _alone(b, self.packed, self.bias), in_features, self.weight.dtype)
        return in_consistent_chunks(x, sizes, lambda b: _packed(b, self.packed, self.bias),
                                    lambda r: _alone(r, self.packed, self.bias))


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in _PACKABLE
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _try_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Packed weight, or ``None`` when the kernel is unavailable or wrong.

    The packed kernel need not round like ``F.linear`` (it does not for some shapes: a
    ``[1536, 8960]`` weight on a Xeon with AMX), since decoding and verification both go
    through it; it must only agree with ``F.linear`` to the format's precision."""
    try:
        packed = _reorder(weight)
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype,
                            generator=torch.Generator().manual_seed(0))
        got = _packed(probe, packed, bias).float()
        want = F.linear(probe, weight, bias).float()
        if torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6):
            return packed
        logger.warning("oneDNN packed linear disagrees with F.linear on a [%d, %d] weight; "
                       "using F.linear", *weight.shape)
    except (RuntimeError, AttributeError) as err:  # kernel missing in this torch build
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", err)
    return None
