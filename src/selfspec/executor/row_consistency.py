"""Row consistency: which calls of a matrix-product kernel give every row of a block exactly
as that row alone (one-token decoding) computes it, so that verification of a block equals
decoding bit for bit. Shared by the decoding kernels that need a probe
(:mod:`selfspec.executor.linear`'s oneDNN path, :mod:`selfspec.executor.int4_rows`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowSizes:
    """The calls of a kernel that give every row as one-token decoding computes it, for one
    weight shape and thread count (found by :meth:`PackedRowLimits.limit_of`).

    Attributes:
        call_rows: ``call_rows[r]`` (``0 <= r <= max_rows``) = the rows of the call that
            computes a block of ``r`` rows: ``r`` where calls of ``r`` rows are
            row-consistent, else the fewest rows above ``r`` whose call, the block padded
            with zero rows, gives its rows exactly (checked by the probe), else ``0``: split
            the block.
        chunk: the most rows of one row-consistent call ``<= max_rows``; blocks without a
            consistent call split into chunks of it.
    """

    call_rows: tuple[int, ...]
    chunk: int


@dataclass
class PackedRowLimits:
    """How many rows one call of oneDNN's packed kernel may take with every row's result
    bit-identical to that row computed alone, per weight shape and thread count.

    Why: lossless verification needs each row of a verification block to equal one-token
    decoding bit for bit. oneDNN picks its kernel and blocking by shape: on an Intel Xeon with
    AMX (torch 2.13.0), a ``[1536, 8960]`` weight (Qwen2.5-1.5B's ``down_proj``) rounds rows
    differently in calls of 12-23 rows at 2 threads and of 28+ rows at 1 thread, a
    ``[512, 5632]`` one in every call of 12+ rows, while most shapes agree up to 64 rows; in
    bf16 that flipped near-tied argmaxes (75% greedy parity for ``qspec`` on HumanEval). So a
    probe at the first multi-row call of each (shape, bias, thread count) tries every call of
    2..``max_rows`` rows against the rows computed alone (:class:`RowSizes`). A block whose
    row count rounds differently is padded with zero rows up to the next count that does not
    (an output row depends only on its input row and on the call's shape, and the probe
    checks the padded call too): one read of the weight, where splitting the block (the
    fallback) reads it once a chunk. Verification of 17 rows on Qwen's ``down_proj`` split
    into 11 + 6 read its 27 MiB twice in each of 28 layers.

    Attributes:
        max_rows: the longest call that must be row-consistent (verification blocks).
    """

    max_rows: int = 64
    _limits: dict[tuple, RowSizes] = field(default_factory=dict, repr=False)

    def limit_of(self, shape: tuple, call: Callable[[torch.Tensor], torch.Tensor],
                 alone: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                 dtype: torch.dtype) -> RowSizes:
        """The calls of 2..``max_rows`` rows of ``call`` that give every row as ``alone``
        computes it (one-token decoding's way), directly or with zero-row padding, probed
        once per ``shape`` (a hashable key naming kernel and weight shape) and thread
        count."""
        key = (*shape, torch.get_num_threads())
        found = self._limits.get(key)
        if found is None:
            found = self._probe(call, alone, in_features, dtype)
            self._limits[key] = found
            if found.chunk < self.max_rows:
                padded = [r for r, n in enumerate(found.call_rows) if n > r]
                logger.info("%s: calls of up to %d rows are row-consistent at %d threads; "
                            "%d other block sizes are padded, longer blocks split", shape,
                            found.chunk, key[-1], len(padded))
        return found

    def _probe(self, call: Callable[[torch.Tensor], torch.Tensor],
               alone: Callable[[torch.Tensor], torch.Tensor], in_features: int,
               dtype: torch.dtype) -> RowSizes:
        probe = torch.randn(self.max_rows, in_features,
                            generator=torch.Generator().manual_seed(2)).to(dtype)
        want = alone(probe)
        good = [False, False] + [torch.equal(call(probe[:rows]), want[:rows])
                                 for rows in range(2, self.max_rows + 1)]
        call_rows = [0] * (self.max_rows + 1)
        for rows in range(2, self.max_rows + 1):
            if good[rows]:
                call_rows[rows] = rows
                continue
            above = next((n for n in range(rows + 1, self.max_rows + 1) if good[n]), 0)
            if above and torch.equal(call(pad_rows(probe[:rows], above))[:rows], want[:rows]):
                call_rows[rows] = above
        chunk = next((n for n in range(self.max_rows, 1, -1) if good[n]), 1)
        return RowSizes(tuple(call_rows), chunk)


def pad_rows(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """``flat`` ``[r, K]`` with zero rows appended up to ``rows``."""
    return torch.cat([flat, flat.new_zeros(rows - flat.shape[0], flat.shape[1])])


def in_consistent_chunks(x: torch.Tensor, sizes: RowSizes,
                         call: Callable[[torch.Tensor], torch.Tensor],
                         alone: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``call`` on ``x`` ``[..., K]`` → ``[..., N]`` where it is row-consistent
    (:meth:`PackedRowLimits.limit_of`): one call of the block's rows, or of the block padded
    with zero rows to a consistent count; else chunks of ``sizes.chunk`` rows, each computed
    the same way, a lone row as one-token decoding computes it (``alone``)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    target = sizes.call_rows[rows] if rows < len(sizes.call_rows) else 0
    if target == rows:
        return call(x)
    if target:
        return call(pad_rows(flat, target))[:rows].reshape(*x.shape[:-1], -1)
    # Split into pieces of the most rows a consistent call takes (each padded or split in
    # turn), fewer than the block's so that this ends; rows alone where no call is.
    piece = next((n for n in range(min(rows - 1, sizes.chunk), 1, -1)
                  if sizes.call_rows[n] == n), 1)
    if piece == 1:
        return alone(flat).reshape(*x.shape[:-1], -1)
    parts = [in_consistent_chunks(part, sizes, call, alone) for part in flat.split(piece)]
    return torch.cat(parts).reshape(*x.shape[:-1], -1)
