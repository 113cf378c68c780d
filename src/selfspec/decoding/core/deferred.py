"""Positions whose deeper layers have not run yet, and the batched catch-up that runs them.

Early-exit drafting leaves each draft position at some layer: LayerSkip at ``exit_layer``,
DSSD and AdaDecode at a different layer per token. Before a token can run layer ``j`` its
predecessors must hold KV in layer ``j``, and verification needs every position at the last
layer. :class:`DeferredLayers` keeps, for each pending position, the hidden state after the
last layer it ran (LayerSkip's exit-query cache) and advances positions to a target layer in
as few :meth:`LayerExecutor.run_layers` calls as possible, batching positions that are at
the same layer (AdaDecode §2.2 runs the skipped layers of earlier tokens "in parallel" with
later ones; DSSD §4.3.1 does the same for drafted tokens).

Invariant (from the KV cache's no-gap rule): positions that reached a deeper layer come
before positions that stopped shallower, so the positions still at the shallowest layer
always form a suffix, which one batched call can extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.executor import KVCache, LayerExecutor


@dataclass
class _Pending:
    position: int
    token: int              # the token id fed at this position
    reached: int            # layers [0, reached) have run
    hidden: torch.Tensor    # [1, 1, H]: the hidden state leaving layer reached - 1


class DeferredLayers:
    """Pending positions of one speculative step and their hidden states.

    Args:
        executor: the model's executor.
        cache: the KV cache the positions write to.
    """

    def __init__(self, executor: LayerExecutor, cache: KVCache) -> None:
        self.executor = executor
        self.cache = cache
        self._pending: list[_Pending] = []
        self.layer_forwards = 0  # decoder-layer evaluations of one token each, cumulative
        # layer_batches[b - 1]: decoder-layer calls that ran b positions together (AdaDecode's
        # "sizes of the batched layer calls"), cumulative.
        self.layer_batches: list[int] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, token_id: int, position: int) -> None:
        """Make ``token_id`` at ``position`` pending at layer 0 (its embedding).

        Raises:
            AssertionError: ``position`` does not follow the last pending position.
        """
        if self._pending:
            assert position == self._pending[-1].position + 1, \
                "pending positions must be consecutive"
        self._pending.append(_Pending(position, token_id, 0, self.executor.embed_token(token_id)))

    def position(self, index: int = -1) -> int:
        """Sequence position of the ``index``-th pending position (default: the last)."""
        return self._pending[index].position

    def token(self, index: int = -1) -> int:
        """Token id fed at the ``index``-th pending position (default: the last)."""
        return self._pending[index].token

    def reached(self, index: int = -1) -> int:
        """Layers run so far by the ``index``-th pending position (default: the last)."""
        return self._pending[index].reached

    def advance(self, target: int) -> None:
        """Run every pending position that is short of layer ``target`` up to it
        (``[0, target)`` done), batching positions that stand at the same layer."""
        # Layers reached never increase along the pending positions (module doc), so the
        # shallowest form a suffix and the position before it bounds how far they go in one
        # call: no scan of every position (this runs ~15 times a token in SpecEE).
        pending = self._pending
        while pending and pending[-1].reached < target:
            low = pending[-1].reached
            first = len(pending) - 1
            while first and pending[first - 1].reached == low:
                first -= 1
            assert not first or pending[first - 1].reached > low, "pending layers must not increase"
            stop = target if not first else min(pending[first - 1].reached, target)
            group = pending[first:]
            num = len(group)
            hidden = group[0].hidden if num == 1 else torch.cat([p.hidden for p in group], 1)
            out = self.executor.run_layers_at(hidden, group[0].position, low, stop, self.cache)
            self.layer_forwards += num * (stop - low)
            if len(self.layer_batches) < num:
                self.layer_batches.extend([0] * (num - len(self.layer_batches)))
            self.layer_batches[num - 1] += stop - low
            if num == 1:
                group[0].hidden, group[0].reached = out, stop
            else:
                for i, p in enumerate(group):
                    p.hidden, p.reached = out[:, i: i + 1], stop

    def drop_completed(self) -> None:
        """Forget leading positions that have run every layer (nothing left to defer)."""
        last = self.executor.num_layers
        keep = 0
        while keep < len(self._pending) and self._pending[keep].reached == last:
            keep += 1
        del self._pending[:keep]

    def release_last(self) -> None:
        """Forget the last pending position without running its remaining layers: their KV
        was settled another way (SpecEE's propagated or masked KV, :mod:`skipped_kv`)."""
        del self._pending[-1]

    def hidden(self, index: int = -1) -> torch.Tensor:
        """``[1, 1, H]`` hidden state of the ``index``-th pending position (after the last
        layer it ran)."""
        return self._pending[index].hidden

    def stacked(self) -> torch.Tensor:
        """``[1, P, H]`` hidden states of all pending positions, in position order."""
        return torch.cat([p.hidden for p in self._pending], 1)
