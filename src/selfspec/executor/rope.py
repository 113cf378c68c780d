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

import logging
from dataclasses import dataclass

import torch

from selfspec.executor.sync import last_position, position_block

#: Positions per call of the rotary module when the table grows (a row comes from one call
#: of this shape, whatever the table's size; 32 x head_dim 128 is far under torch's
#: 32,768-element parallel grain, so one thread computes it).
TABLE_BLOCK = 32
_MAX_CALLS = 8  # rotary calls a block may take to come out the same twice in a row

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Fp32Table:
    """An fp32 copy of the table, and the model-dtype table it was made from."""

    source: torch.Tensor  # the model-dtype cos table the copy was made from
    cos: torch.Tensor     # [P, head_dim] fp32
    sin: torch.Tensor     # [P, head_dim] fp32


class RopeTable:
    """cos/sin rows for positions, grown on demand (doubling, at least 256 positions).

    **A row's bits never change, and do not depend on the table's size.** The rows are
    computed in calls of :data:`TABLE_BLOCK` positions (``[k·B, (k+1)·B)``, each call small
    enough to run on the calling thread alone), and growing the table computes only the new
    blocks. Why: torch splits an elementwise ``cos`` over a table between its threads, and
    the other thread's share can round differently. Measured on the 2-core AMX Xeon
    (Qwen2.5-1.5B, bf16 table): in about one process in five, the rows at positions 128-255
    of a 256-position table came out 1 bf16 ulp off in 22 entries. With the whole table
    rebuilt at each doubling, a generation that crossed position 256 switched tables midway,
    so ``ar`` (prefilled on the old table) and a method run after it (on the new one) held
    different keys for the same prompt, and one greedy near-tie flipped (issue 63's
    HumanEval/10 parity miss). The first call of a process can come out wrong even on one
    thread (4 processes with the model loaded gave 3 different first blocks, layer 0's keys
    then differing in 27 entries; an fp32 table built by a first call was off by up to 1.5e-4
    against fp64, later ones within 6e-8; the cause lies below torch's Python API and is not
    pinned down), so each block is computed until two calls in a row agree bit for bit: then
    6 processes of 6 gave the same keys and logits, one of them after a first call that
    differed from its second.

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
            self._grow(hidden, max(needed, 2 * self.cos.shape[0], 256))
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def _grow(self, hidden: torch.Tensor, size: int) -> None:
        """Extend the table to at least ``size`` positions, block by block (see the class
        docstring): the rows it holds are kept, the new ones computed in calls of
        :data:`TABLE_BLOCK` positions."""
        have = self.cos.shape[0]
        size = -(-size // TABLE_BLOCK) * TABLE_BLOCK
        cos_parts, sin_parts = ([self.cos], [self.sin]) if have else ([], [])
        for first in range(have, size, TABLE_BLOCK):
            block = torch.arange(first, first + TABLE_BLOCK, device=hidden.device).unsqueeze(0)
            cos, sin = self._agreed(hidden, block)
            cos_parts.append(cos[0])
            sin_parts.append(sin[0])
        self.cos, self.sin = torch.cat(cos_parts), torch.cat(sin_parts)

    def _agreed(self, hidden: torch.Tensor,
                block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos/sin for ``block``, called until two calls in a row agree bit
        for bit (see the class docstring: a first call has come out wrong)."""
        last = self.rotary_emb(hidden, block)
        for _ in range(_MAX_CALLS - 1):
            again = self.rotary_emb(hidden, block)
            if torch.equal(again[0], last[0]) and torch.equal(again[1], last[1]):
                return again
            logger.info("RoPE rows %d..%d differed between two calls of the rotary module; "
                        "calling it again", int(block[0, 0]), int(block[0, -1]))
            last = again
        logger.warning("RoPE rows %d..%d never came out the same twice in %d calls; using the "
                       "last", int(block[0, 0]), int(block[0, -1]), _MAX_CALLS)
        return last

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
        the fused path once per layer, and the table lookup of :meth:`rows` costs far more
        a call than a slice, a noticeable share of a small model's layer."""
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


class _TypedRotary(torch.nn.Module):
    """A rotary module that keeps one table per layer type (Gemma 3's
    ``rotary_emb(x, position_ids, layer_type)``) as a plain ``rotary_emb(x, position_ids)``
    for one layer type."""

    def __init__(self, rotary_emb: torch.nn.Module, layer_type: str) -> None:
        super().__init__()
        self.inner = rotary_emb
        self.layer_type = layer_type
        self.rope_type = getattr(rotary_emb, "rope_type", {}).get(layer_type, "default")

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.inner(x, position_ids, self.layer_type)


def layer_rope_tables(rotary_emb: torch.nn.Module,
                      kinds: tuple[str, ...]) -> tuple[RopeTable, list[RopeTable]]:
    """The RoPE tables of a model whose layers read ``kinds`` (``"default"``, or a layer
    type): one table per kind, shared by its layers; a layer type's from
    ``rotary_emb(x, positions, layer_type)`` (modeling_gemma3.Gemma3RotaryEmbedding).

    Returns:
        The main table (``"default"``'s, else ``"full_attention"``'s, else the first
        layer's: what the fused paths and CUDA graphs read, which refuse per-type tables)
        and ``[L]`` each layer's table.
    """
    tables: dict[str, RopeTable] = {}
    for kind in kinds:
        if kind not in tables:
            tables[kind] = (RopeTable(rotary_emb) if kind == "default"
                            else RopeTable(_TypedRotary(rotary_emb, kind)))
    main = tables.get("default") or tables.get("full_attention") or tables[kinds[0]]
    return main, [tables[kind] for kind in kinds]
