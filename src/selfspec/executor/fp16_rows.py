"""fp16-weight matrix products for decoding and verification where bf16 is emulated.

Why: on x86 CPUs without native bf16 (AVX2 only) a bf16 ``F.linear`` converts as it
multiplies, and its cost grows with the rows: a forward of a few tokens costs about as
many one-token forwards, so verifying ``D`` draft tokens costs about ``D + 1`` decoding steps
and no self-speculative method can pay. FBGEMM's fp16 GEMM, shipped in every x86 PyTorch
wheel (``torch.ops.quantized.linear_dynamic_fp16``: weights stored as fp16, activations,
products and sums in fp32), reads the same bytes as bf16, is faster for one token and
costs little more for a few.

Numbers: a bf16 weight is exactly an fp16 value when ``2^-17 <= |w| <= 65504`` (bf16 has 8
significant bits, fp16 11 and a smaller exponent range); smaller weights round to fp16's
subnormal grid (error < 3e-8) and larger ones do not fit, in which case the weight keeps
the bf16 kernel. The products and sums are fp32, as in bf16 ``F.linear``, so outputs agree
with it to fp32 rounding (not bit for bit: the summation order differs).

Row consistency, which lossless verification rests on: FBGEMM splits a call's ``M`` rows
into groups, each run by a kernel specialised for 1..6 rows (AVX2; up to 14 on AVX-512,
from an autotuned table), and on fp32 inputs the 1- and 2-row kernels round differently
from the others. With bf16 or fp16 activations every product is exact in fp32 and the
kernels agree on this machine, but nothing promises that elsewhere, so a probe at first use
(per thread count, on inputs of the activations' format) finds, for each row count, a
padded count (repeating the last row) whose rows all equal the *canonical* result: the row
computed alone, or, where no padding reproduces that, the row computed as a group of
three. Where no padding works either, rows are computed one call each (slow, still exact).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

CANONICAL_CHOICES = (1, 3)  # a row's canonical result: computed in a group of this many rows
_PAD_SEARCH = 16     # look this far above M for a consistent padded row count
_FP16_MAX = 65504.0


def fbgemm_fp16_available() -> bool:
    """Whether this torch build has FBGEMM's fp16 linear (x86 CPU wheels do)."""
    try:
        return ("fbgemm" in torch.backends.quantized.supported_engines
                and hasattr(torch.ops.quantized, "linear_prepack_fp16")
                and hasattr(torch.ops.quantized, "linear_dynamic_fp16"))
    except (RuntimeError, AttributeError):
        return False


def bulk_copy(weight: torch.Tensor, bias: torch.Tensor | None,
              min_bytes: int = 0) -> torch.Tensor | None:
    """FBGEMM's packed fp16 copy of ``weight`` ``[N, K]`` (and ``bias`` ``[N]``) for bulk
    calls only (:func:`bulk_product`; no row-consistency probe: bulk work need not match
    one-token decoding), or ``None`` when the weight is under ``min_bytes`` or outside fp16's
    range."""
    w = weight.detach()
    if w.numel() * w.element_size() < min_bytes:
        return None
    if not bool(torch.isfinite(w).all()) or float(w.abs().max()) > _FP16_MAX:
        logger.info("a [%d, %d] weight exceeds fp16's range; it keeps the bf16 kernel",
                    *w.shape)
        return None
    b = None if bias is None else bias.detach().float()
    return torch.ops.quantized.linear_prepack_fp16(w.float(), b)


def bulk_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` → ``[..., N]`` in ``x``'s dtype in one FBGEMM call, without row padding:
    for prefill and other bulk work (much faster than casting bf16 weights to fp32 per
    call)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = torch.ops.quantized.linear_dynamic_fp16(flat, packed)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


class Fp16Rows:
    """Row-consistent fp16-weight products (see the module docstring).

    Args:
        max_rows: the largest row count that must be row-consistent (verification blocks:
            the executor's ``row_attention_max``); larger calls are computed in chunks.
        min_bytes: weights smaller than this are not taken (:meth:`prepack` returns ``None``).
        dtype: the activations' format (the probe's inputs are rounded to it).

    Raises:
        RuntimeError: FBGEMM's fp16 kernel is not in this torch build
            (check :func:`fbgemm_fp16_available` first).

    Attributes:
        serves_bulk: ``True``: bulk calls also use the fp16 copy (unpadded, :meth:`bulk`).
    """

    serves_bulk = True

    def __init__(self, max_rows: int = 64, min_bytes: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if not fbgemm_fp16_available():
            raise RuntimeError("FBGEMM's fp16 linear is not available in this torch build")
        self.max_rows = max(1, int(max_rows))
        self.min_bytes = int(min_bytes)
        self.dtype = dtype
        # thread count -> (canonical group size, padded row count per M)
        self._pads: dict[int, tuple[int, list[int]]] = {}

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """FBGEMM's packed fp16 copy of ``weight`` ``[N, K]`` (and ``bias`` ``[N]``), or
        ``None`` when the weight is under ``min_bytes``, does not fit fp16's range, or the
        packed kernel is not row-consistent on a probe of this weight's shape."""
        packed = bulk_copy(weight, bias, self.min_bytes)
        if packed is None:
            return None
        w = weight.detach()
        probe = torch.randn(15, w.shape[1],
                            generator=torch.Generator().manual_seed(1)).to(self.dtype).float()
        got = self._rows(probe, packed)
        want = torch.cat([self._canonical(row, packed) for row in probe])
        if not torch.equal(got, want):
            logger.info("FBGEMM fp16 rows are not consistent for a [%d, %d] weight; it keeps the "
                        "bf16 kernel", *w.shape)
            return None
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in ``x``'s dtype, each row bit-identical to the row
        computed alone (any row count, any position in the block)."""
        flat = x.reshape(-1, x.shape[-1]).float()
        out = self._rows(flat, packed)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def bulk(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` → ``[..., N]`` in one call, without row padding: for prefill and other
        bulk work that need not match one-token decoding bit for bit (FBGEMM's fp16 GEMM is
        also much faster there than casting bf16 weights to fp32 per call)."""
        return bulk_product(x, packed)

    def decode_bytes(self, packed: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> int:
        """Bytes one call reads: 2 a weight (FBGEMM's packed copy is opaque) and the bias."""
        return weight.numel() * 2 + (0 if bias is None else bias.numel() * bias.element_size())

    # ------------------------------------------------------------------ internals
    def _canonical(self, row: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``[K]`` → ``[1, N]``: the row's canonical result."""
        return _group(row, packed, self._pad_table()[0])

    def _rows(self, flat: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        rows = flat.shape[0]
        if rows > self.max_rows:
            return torch.cat([self._rows(part, packed)
                              for part in flat.split(self.max_rows)])
        padded = self._pad_table()[1][rows]
        if padded == 0:  # no consistent padding: one canonical call per row
            return torch.cat([self._canonical(row, packed) for row in flat])
        if padded > rows:
            flat = torch.cat([flat, flat[-1:].expand(padded - rows, -1)])
        return torch.ops.quantized.linear_dynamic_fp16(flat, packed)[:rows]

    def _pad_table(self) -> tuple[int, list[int]]:
        """``(canonical group size, padded row count per M)`` for the current thread count."""
        threads = torch.get_num_threads()
        table = self._pads.get(threads)
        if table is None:
            table = self._pads[threads] = _probe_pads(self.max_rows, self.dtype)
        return table


def _group(row: torch.Tensor, packed: torch.Tensor, size: int) -> torch.Tensor:
    """``[K]`` → ``[1, N]``: ``row`` computed in a group of ``size`` copies of itself."""
    block = row.reshape(1, -1).expand(size, -1).contiguous()
    return torch.ops.quantized.linear_dynamic_fp16(block, packed)[:1]


def _probe_pads(max_rows: int, dtype: torch.dtype) -> tuple[int, list[int]]:
    """The canonical group size (the first of :data:`CANONICAL_CHOICES` for which every row
    count has a consistent padding) and, for each row count ``M`` in ``[0, max_rows]``, the
    smallest padded count ``>= M`` (and ``>=`` the group size) whose first ``M`` rows equal
    their canonical results on random data in ``dtype`` (two draws, padded by repeating row
    ``M - 1`` as :class:`Fp16Rows` does), or 0 if none within :data:`_PAD_SEARCH`."""
    gen = torch.Generator().manual_seed(0)
    # K spans more than one of FBGEMM's K blocks and N is not a multiple of its column block.
    weight = torch.randn(72, 600, generator=gen).to(torch.float16).float()
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    data = torch.randn(2, max_rows + _PAD_SEARCH + 4, 600, generator=gen).to(dtype).float()
    for size in CANONICAL_CHOICES:
        table = _pads_for(size, max_rows, packed, data)
        if all(table[1:]):
            return size, table
    logger.warning("FBGEMM fp16: some row counts have no consistent padding; computing them "
                   "one row at a time")
    return size, table


def _pads_for(size: int, max_rows: int, packed: torch.Tensor,
              data: torch.Tensor) -> list[int]:
    canon = [torch.cat([_group(row, packed, size) for row in draw]) for draw in data]
    table = [0] * (max_rows + 1)
    for m in range(1, max_rows + 1):
        for padded in range(max(m, size), m + _PAD_SEARCH + 1):
            if all(torch.equal(torch.ops.quantized.linear_dynamic_fp16(
                    torch.cat([draw[:m], draw[m - 1:m].expand(padded - m, -1)]), packed)[:m],
                    ref[:m]) for draw, ref in zip(data, canon)):
                table[m] = padded
                break
    return table
