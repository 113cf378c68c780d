"""The small types every layer-running entry point of the executor shares (docs/design.md
"Executor contract"): which sub-layers a run skips, the per-sub-layer observer, the head
signature, the row count from which a block may run in the bulk format, and the prefill's
chunk.

They live apart from :mod:`selfspec.executor.executor` so that the modules the executor
delegates to (and :mod:`selfspec.executor.cost_model`, which measures it) can name them
without importing the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# observe(layer_idx, sublayer, hidden [B, T, H]): called after each sub-layer ("attention",
# "mlp") of run_layers; skipped sub-layers pass the unchanged hidden state.
Observer = Callable[[int, str, torch.Tensor], None]

# A head maps final-layer-style hidden states [B, T, H] to logits; ``vocab_rows`` restricts
# the output to those vocabulary ids. Exit heads (a later issue) implement this signature.
Head = Callable[..., torch.Tensor]

# Bulk calls of fewer rows stay in the weights' format: at 4 rows the cast of a bf16 weight to
# fp32 already pays on an AVX2 CPU.
BULK_MIN_ROWS = 4

# A prompt's prefill runs in calls over fixed chunks of absolute positions [k·C, (k+1)·C)
# (LayerExecutor.prefill): a position's keys and values then come from the same calls however
# long the prompt is, so a prefix cache's copy is bit for bit what a full prefill computes.
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class SkipPlan:
    """Which sub-layers to skip, per layer (KnapSpec drafts with a subset of sub-layers).

    Attributes:
        skip_attention: layer indices whose attention sub-layer is skipped (writes no KV).
        skip_mlp: layer indices whose MLP sub-layer is skipped.
    """

    skip_attention: frozenset[int] = field(default_factory=frozenset)
    skip_mlp: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_flags(cls, attention: Sequence[bool], mlp: Sequence[bool]) -> SkipPlan:
        """Build a plan from per-layer booleans (True = skip)."""
        return cls(frozenset(i for i, s in enumerate(attention) if s),
                   frozenset(i for i, s in enumerate(mlp) if s))
