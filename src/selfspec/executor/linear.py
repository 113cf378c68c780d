"""Matrix-vector products for the decode path.

Decoding one token multiplies a ``[1, H]`` vector by every weight matrix, so the speed of the
whole model is the speed of these products. On CPU, oneDNN weights pre-packed into its
blocked layout stream about 1.5× faster than ``F.linear`` on plain row-major weights for
bf16/fp16 (measured on the 2-core dev machine: 15 vs 10 GB/s over one SmolLM2-135M token's
weights), and give bit-identical results. fp32 keeps ``F.linear``: there the packed kernel
rounds differently, and fp32 is the dtype used to check exactness against transformers.

Bulk calls (prefill, long blocks) may compute in another format than the weights'
(:class:`selfspec.executor.cpu.ComputeFormats`): on CPUs that emulate bf16 a cast of the
weight to fp32 per call is 5-8× faster than the emulated bf16 product. There, decoding and
verification use FBGEMM's fp16-weight kernel instead of the emulated bf16 one
(:mod:`selfspec.executor.fp16_rows`), whose cost hardly grows with the rows.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from selfspec.executor.fp16_rows import Fp16Rows

logger = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16)


class Linear:
    """``y = x Wᵀ + b`` with the weight packed for oneDNN where that is exact and faster.

    Args:
        weight: ``[N, K]`` weight (kept by reference; a packed copy is added when used).
        bias: ``[N]`` or ``None``.
        pack: try packing (CPU, bf16/fp16, oneDNN available); falls back to ``F.linear``
            when the packed kernel is missing or disagrees with ``F.linear`` on a probe.
        bulk_dtype: the format of bulk calls (``None`` = the weight's own).
        rows: compute non-bulk calls (decoding, verification) with this fp16-weight kernel
            (an extra fp16 copy of the weight); ``None`` or a weight it cannot take keeps the
            weight's own format.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True,
                 bulk_dtype: torch.dtype | None = None, rows: Fp16Rows | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.bulk_dtype = None if bulk_dtype == weight.dtype else bulk_dtype
        self.packed: torch.Tensor | None = None
        self.rows: Fp16Rows | None = None
        self.fp16: torch.Tensor | None = None
        self.set_rows(rows)
        if self.fp16 is None and pack and _can_pack(weight):
            self.packed = _try_pack(weight, bias)

    def set_rows(self, rows: Fp16Rows | None) -> None:
        """Use (``rows``) or stop using (``None``) the fp16-weight kernel for non-bulk calls."""
        self.rows, self.fp16 = None, None
        if rows is not None and self.weight.device.type == "cpu":
            self.fp16 = rows.prepack(self.weight, self.bias)
            self.rows = rows if self.fp16 is not None else None

    @classmethod
    def of_rows(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: torch.Tensor, kernel: Fp16Rows | None = None) -> Linear:
        """A packed copy of output rows ``rows`` ``[R]`` of ``weight`` ``[N, K]`` (and
        ``bias``): ``[..., K]`` → ``[..., R]``, on the fp16-weight ``kernel`` if given."""
        rows = rows.to(weight.device)
        return cls(weight.detach()[rows].contiguous(),
                   None if bias is None else bias.detach()[rows].contiguous(), rows=kernel)

    @property
    def out_features(self) -> int:
        """N."""
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype; ``bulk=True`` computes in the bulk
        format, or on the fp16 copy without row padding (not bit-consistent with the
        non-bulk path: never for blocks that must match one-token decoding)."""
        if bulk and self.rows is not None:
            return self.rows.bulk(x, self.fp16)
        if bulk and self.bulk_dtype is not None:
            fmt = self.bulk_dtype
            bias = None if self.bias is None else self.bias.to(fmt)
            return F.linear(x.to(fmt), self.weight.to(fmt), bias).to(x.dtype)
        if self.rows is not None:
            return self.rows(x, self.fp16)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.numel() == x.shape[-1]:
            # A single row takes oneDNN's matrix-vector kernel, which rounds some outputs
            # differently from the matrix-matrix kernel that verification's few rows take;
            # in bf16 that flips near-tied argmaxes between speculative and autoregressive
            # decoding. Two rows take the matrix-matrix kernel at the same memory traffic.
            pair = torch.cat([x, x], dim=-2) if x.dim() > 1 else torch.stack([x, x])
            out = torch.ops.mkldnn._linear_pointwise(pair, self.packed, self.bias, "none", [], "")
            return out[..., :1, :] if x.dim() > 1 else out[0]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in _PACKABLE
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _try_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Packed weight, or ``None`` when the kernel is unavailable or not bit-identical."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype,
                            generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        if torch.equal(got, F.linear(probe, weight, bias)):
            return packed
        logger.info("oneDNN packed linear differs from F.linear; using F.linear")
    except (RuntimeError, AttributeError) as err:  # kernel missing in this torch build
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", err)
    return None
