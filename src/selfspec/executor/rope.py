"""Rotary position embeddings for the executor: cos/sin rows from a table built once with the
model's own rotary module (no RoPE formula of selfspec's own), in the three shapes the
executor's paths read.

* :meth:`RopeTable.lookup` — ``[B, T, 1, head_dim]`` in the model's dtype for any position
  tensor (the torch path: :meth:`LayerExecutor.run_layers`, ``propagate_kv``);
* :meth:`RopeTable.rows` — ``[N, head_dim]`` fp32 for a ragged batch's positions (the fused
  path of ``run_rows``);
* :meth:`RopeTable.span` — ``[num, head_dim]`` fp32 for consecutive positions, as views of an
  fp32 copy of the table (the fused path of ``run_layers`` / ``run_layers_at``).

RoPE variants whose frequencies depend on the sequence length (``dynamic``) cannot use a
table: :meth:`lookup` calls the rotary module each time, and the fused paths, which need a
table, are not built for them (:attr:`RopeTable.dynamic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.executor.sync import last_position, position_block


@dataclass(frozen=True)
class _Fp32Table:
    """An fp32 copy of the table, and the model-dtype table it was made from."""

    source: torch.Tensor  # the model-dtype cos table the copy was made from
    cos: torch.Tensor     # [P, head_dim] fp32
    sin: torch.Tensor     # [P, head_dim] fp32


class RopeTable:
    """cos/sin rows for positions, grown on demand (doubling, at least 256 positions).

    Args:
        rotary_emb: the model's rotary module (``rotary_emb(x, position_ids) -> (cos, sin)``,
            each ``[B, T, head_dim]``).
    """

    def __init__(self, rotary_emb: torch.nn.Module) -> None:
        self.rotary_emb = rotary_emb
        self.dynamic = "dynamic" in str(getattr(rotary_emb, "rope_type", ""))
        self.cos = torch.empty(0)   # [P, head_dim], the model's dtype
        self.sin = torch.empty(0)
        self._fp32: _Fp32Table | None = None
        # (table, pos0, num, cos, sin) of the last span: a token's layer calls share its rows
        self._span_last: tuple | None = None

    def lookup(self, hidden: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, T, 1, head_dim]`` for ``positions`` ``[B, T]`` (int64), in
        ``hidden``'s dtype and device (``hidden`` ``[B, T, H]`` only gives those), from the
        table (rebuilt per call for RoPE types that depend on length)."""
        if self.dynamic:
            cos, sin = self.rotary_emb(hidden, positions)
            return cos.unsqueeze(2), sin.unsqueeze(2)
        needed = last_position(positions) + 1  # no sync for tagged position blocks
        if needed > self.cos.shape[0]:
            size = max(needed, 2 * self.cos.shape[0], 256)
            table = torch.arange(size, device=hidden.device).unsqueeze(0)
            cos, sin = self.rotary_emb(hidden, table)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def rows(self, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` fp32, contiguous, for ``positions`` ``[1, N]``."""
        cos, sin = self.lookup(hidden, positions)
        return cos[0, :, 0].float().contiguous(), sin[0, :, 0].float().contiguous()

    def span(self, hidden: torch.Tensor, pos0: int,
             num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num, head_dim]`` fp32 for the consecutive positions ``pos0 ..
        pos0 + num - 1``: views of an fp32 copy of the table, the same values as
        :meth:`rows`. Why: methods that run a token layer by layer (SpecEE, AdaDecode) call
        the fused path once per layer, and the table lookup of :meth:`rows` cost ~70 µs a
        call against ~2 µs for a slice (a 0.5B layer is ~1.6 ms)."""
        made = self._fp32
        if made is None or made.source is not self.cos or pos0 + num > made.cos.shape[0]:
            # grows the table if short
            self.lookup(hidden, position_block(pos0 + num - 1, 1, hidden.device))
            made = _Fp32Table(self.cos, self.cos.float().contiguous(),
                              self.sin.float().contiguous())
            self._fp32 = made
        last = self._span_last  # a token's layer calls share its rows: slice once
        if last is not None and last[0] is made and last[1] == pos0 and last[2] == num:
            return last[3], last[4]
        cos, sin = made.cos[pos0:pos0 + num], made.sin[pos0:pos0 + num]
        self._span_last = (made, pos0, num, cos, sin)
        return cos, sin
