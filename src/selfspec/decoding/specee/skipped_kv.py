"""What happens to the KV cache of the layers an early-exited token skipped: the decision that
sets the speed of lossy early exit (SpecEE, CALM, DSSD §3.4.2).

A token that exits at layer ``e`` has no keys and values in layers ``[e, L)``, yet later tokens
attend to it there. Three policies, one interface (:class:`SkippedKV`):

- ``deferred`` (:class:`DeferredKV`): the token stays pending at ``e``; when a later token needs
  layer ``j`` the pending tokens run it first, batched with it (AdaDecode §2.2's deferred
  layers). The KV is exact, so the only loss is the emitted tokens themselves; the skipped
  layers are computed anyway, only in fewer, wider calls (cheap rows on a CPU).
- ``propagate`` (:class:`PropagatedKV`): CALM's state propagation (Schuster et al. 2022,
  §3.3): layer ``j``'s K/V are its ``k_proj``/``v_proj`` of the exit hidden state
  (:meth:`LayerExecutor.propagate_kv`), about 2% of a layer each. Approximate KV, real saving.
- ``skip`` (:class:`MaskedKV`): what the public SpecEE code does: nothing is written, later
  tokens attend only to the tokens that reached the layer (masked slots,
  :meth:`KVCache.append_masked`). No cost, approximate attention.

Every policy keeps the cache invariants (per-layer lengths without gaps).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.executor import KVCache, LayerExecutor

KV_POLICIES = ("deferred", "propagate", "skip")


class SkippedKV(Protocol):
    """Runs one token at a time through the layers and settles the KV of layers it skips.

    Attributes:
        layer_forwards: decoder-layer evaluations of one position each, cumulative.
        layer_batches: ``layer_batches[b-1]`` = layer calls of ``b`` positions, cumulative.
        fill_ms: time spent writing the skipped layers' KV (propagation), cumulative, ms.
    """

    layer_forwards: int
    layer_batches: list[int]
    fill_ms: float

    def begin(self, token_id: int, position: int) -> None:
        """Start ``token_id`` at ``position`` at layer 0 (its embedding)."""

    def advance(self, target: int) -> torch.Tensor:
        """Run the current token (and whatever it needs first) to ``target`` layers done;
        returns its hidden state ``[1, 1, H]`` leaving layer ``target - 1``."""

    def stop(self, exit_layer: int) -> None:
        """The current token exits after ``exit_layer`` layers: settle
        layers ``[exit_layer, L)``."""

    def finish(self) -> None:
        """The current token ran every layer."""


class DeferredKV:
    """``deferred``: skipped layers run later, batched with the next token (exact KV).

    The other policies reuse its layer running (:class:`DeferredLayers`) and settle the
    skipped layers as soon as the token exits, so no position stays pending between tokens.
    """

    def __init__(self, executor: LayerExecutor, cache: KVCache) -> None:
        self.executor = executor
        self.cache = cache
        self._deferred = DeferredLayers(executor, cache)
        self.fill_ms = 0.0

    @property
    def layer_forwards(self) -> int:
        return self._deferred.layer_forwards

    @property
    def layer_batches(self) -> list[int]:
        return self._deferred.layer_batches

    def begin(self, token_id: int, position: int) -> None:
        self._deferred.add(token_id, position)

    def advance(self, target: int) -> torch.Tensor:
        self._deferred.advance(target)
        return self._deferred.hidden()

    def stop(self, exit_layer: int) -> None:
        """Nothing now: the token stays pending at ``exit_layer`` until a later token needs a
        deeper layer."""

    def finish(self) -> None:
        self._deferred.drop_completed()


class _SettledKV(DeferredKV):
    """Writes the skipped layers' KV when the token exits, then forgets the position."""

    def stop(self, exit_layer: int) -> None:
        assert exit_layer == self._deferred.reached(), "a token exits at the layer it reached"
        t0 = time.perf_counter()
        self._fill(self._deferred.hidden(), self._deferred.position(), exit_layer)
        self._deferred.release_last()
        self.fill_ms += (time.perf_counter() - t0) * 1e3

    def _fill(self, hidden: torch.Tensor, position: int, exit_layer: int) -> None:
        raise NotImplementedError


class PropagatedKV(_SettledKV):
    """``propagate``: the skipped layers' K/V from the exit hidden state (CALM §3.3)."""

    def _fill(self, hidden: torch.Tensor, position: int, exit_layer: int) -> None:
        positions = torch.tensor([[position]], device=hidden.device)
        self.executor.propagate_kv(hidden, positions, exit_layer, self.executor.num_layers,
                                   self.cache)


class MaskedKV(_SettledKV):
    """``skip``: the skipped layers hold a masked slot; later tokens do not attend to it
    there (the public SpecEE code)."""

    def _fill(self, hidden: torch.Tensor, position: int, exit_layer: int) -> None:
        for layer in range(exit_layer, self.executor.num_layers):
            self.cache.append_masked(layer, position)


def make_skipped_kv(policy: str, executor: LayerExecutor, cache: KVCache) -> SkippedKV:
    """The :class:`SkippedKV` named ``policy`` (one of :data:`KV_POLICIES`).

    Raises:
        ValueError: unknown policy (method options validate it before this).
    """
    classes = {"deferred": DeferredKV, "propagate": PropagatedKV, "skip": MaskedKV}
    if policy not in classes:
        raise ValueError(f"unknown KV policy {policy!r}; choose one of {KV_POLICIES}")
    return classes[policy](executor, cache)
