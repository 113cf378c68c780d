"""int4-weight matrix products for decoding and verification (``--decode-kernel int4``, also
``--dtype int4``): the model itself runs with 4-bit weights.

Why: one-token decoding reads every weight once, so 4-bit weights read a quarter of bf16's
bytes. On an Intel Xeon with AMX torch's CPU int4 kernel
(``aten::_weight_int4pack_mm_for_cpu``, group 32) multiplies one row by a matrix in well under
half the time of oneDNN's packed bf16. Its cost grows with the rows (at 5 rows it is slower
than bf16), so prefill and other bulk blocks keep the bf16 weights
(:class:`selfspec.executor.linear.Linear` routes them there): this kernel serves decoding and
verification only.

Numbers: weights are quantized group-wise (32 inputs per scale and offset, asymmetric min/max,
:func:`selfspec.executor.quant.quantize_int4`), activations stay bf16. That is lossy against
the bf16 model (the bench reports greedy agreement and pass@1), and every lossless method is
exact relative to this int4 model: verification blocks go through the same kernel as
one-token decoding, row-consistent by the probe of :class:`PackedRowLimits` (rows of a call whose
count rounds differently are split off). The registry models come from GGUF files that are
themselves 4-bit (Q4_1, Q4_K): their de-quantised weights are affine per block of 32, which
this quantizer recovers closely wherever a block's codes span 0-15.

A weight whose input size is not a multiple of 32 keeps the bf16 kernel.
"""

from __future__ import annotations

import torch

from selfspec.executor.quant import INT4_GROUP, Int4Linear, quantized_kernels_available
from selfspec.executor.row_consistency import PackedRowLimits, in_consistent_chunks


def int4_available() -> bool:
    """Whether this torch build has the CPU int4 kernel."""
    return quantized_kernels_available("int4")


class Int4Rows:
    """Row-consistent int4-weight products for the non-bulk calls of
    :class:`selfspec.executor.linear.Linear` (see the module docstring).

    Args:
        max_rows: the longest call that must be row-consistent (verification blocks).

    Attributes:
        serves_bulk: ``False``: bulk calls stay on the weights' own kernel.
    """

    serves_bulk = False

    def __init__(self, max_rows: int = 64) -> None:
        self.limits = PackedRowLimits(max_rows)

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear | None:
        """An int4 copy of ``weight`` ``[N, K]``, or ``None`` when ``K`` is not a multiple of
        the group (the weight keeps its own kernel)."""
        if weight.shape[1] % INT4_GROUP:
            return None
        return Int4Linear(weight, bias, INT4_GROUP)

    def __call__(self, x: torch.Tensor, packed: Int4Linear) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype, each row bit-identical to the row
        computed alone."""
        if x.reshape(-1, x.shape[-1]).shape[0] == 1:
            return packed(x)
        def alone(block: torch.Tensor) -> torch.Tensor:
            return torch.cat([packed(r) for r in block.split(1)])

        sizes = self.limits.limit_of(
            ("int4", packed.in_features, packed.out_features, packed.bias is not None),
            packed, alone, packed.in_features, torch.bfloat16)
        return in_consistent_chunks(x, sizes, packed, alone)

    def bulk(self, x: torch.Tensor, packed: Int4Linear) -> torch.Tensor:
        """One call, no row splitting (unused by :class:`Linear`, which sends bulk calls to
        the bf16 weights, see :attr:`serves_bulk`)."""
        return packed(x)

    def decode_bytes(self, packed: Int4Linear, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes one call reads (codes, scales, offsets and bias: :attr:`Int4Linear.nbytes`)."""
        return packed.nbytes
