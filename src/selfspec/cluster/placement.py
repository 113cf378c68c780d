"""Where each routing prefix of ``selfspec serve --ray`` lives: rendezvous hashing with
bounded loads (:class:`PrefixPlacement`), pure Python, used by
:class:`~selfspec.cluster.routing.PrefixAffinityRouter` (which imports Ray Serve; this module
does not, so it is tested and imported without it).

Sources: Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM
ToN 1998), rendezvous hashing; Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing with
Bounded Loads" (SODA 2018), the bound.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping

MAX_PLACEMENTS = 65_536  # prefixes remembered; the least recently seen is forgotten first
CAPACITY_STAT = "prefix_cache_budget_bytes"  # the replicas' routing-stats key


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` by decreasing rendezvous weight ``blake2b(key, id)`` for ``key``."""
    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixPlacement:
    """Which replica each routing prefix lives on: rendezvous hashing with bounded loads.

    A prefix seen before stays on its replica while that replica is live. A new one (or one
    whose replica left) goes to the first replica of :func:`rendezvous_order` holding fewer
    than ``ceil(P * c_r / C)`` of the ``P`` placed prefixes (the new one counted), ``c_r``
    being the replica's capacity and ``C`` the live replicas' total; the bounds sum to at
    least ``P``, so some replica is always under its own.

    Args:
        max_placements: prefixes remembered (>= 1); past it the least recently seen is
            forgotten (it is placed anew if it comes back).
        bounded: ``False``: no bound, each prefix on its first rendezvous replica (plain
            rendezvous hashing, for comparison: ``scripts/ray_affinity_bench.py``).
    """

    def __init__(self, max_placements: int = MAX_PLACEMENTS, bounded: bool = True) -> None:
        self.max_placements = max_placements
        self.bounded = bounded
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._count: dict[str, int] = {}  # prefixes placed on each replica (kept in step)

    def place(self, key: str, capacity: Mapping[str, float]) -> str:
        """The replica for ``key`` among ``capacity``'s (replica id → capacity, > 0 each;
        non-empty), placing it when it is new.

        Raises:
            ValueError: ``capacity`` is empty.
        """
        if not capacity:
            raise ValueError("no replica to place a prefix on")
        owner = self._owner.get(key)
        if owner in capacity:
            self._owner.move_to_end(key)
            return owner
        if owner is not None:
            self._forget(key)
        load = {r: self._count.get(r, 0) for r in capacity}
        placed_total = sum(load.values()) + 1
        total = sum(capacity.values())
        order = rendezvous_order(key, list(capacity))
        owner = next((r for r in order if not self.bounded
                      or load[r] < math.ceil(placed_total * capacity[r] / total - 1e-9)),
                     order[0])
        self._owner[key] = owner
        self._count[owner] = self._count.get(owner, 0) + 1
        if len(self._owner) > self.max_placements:
            self._forget(next(iter(self._owner)))
        return owner

    def _forget(self, key: str) -> None:
        owner = self._owner.pop(key)
        self._count[owner] -= 1
        if not self._count[owner]:
            del self._count[owner]

    def counts(self) -> dict[str, int]:
        """Prefixes placed on each replica (including replicas that left)."""
        return dict(self._count)


def capacities(routing_stats: Mapping[str, Mapping | None]) -> dict[str, float]:
    """Each replica's prefix-cache budget from its routing stats (replica id → stats);
    a replica that reports none yet (or 0) counts as the mean of those that do, 1.0 each
    when none does."""
    def budget(stats: Mapping | None) -> float | None:
        value = (stats or {}).get(CAPACITY_STAT)
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    known = {i: b for i, stats in routing_stats.items() if (b := budget(stats)) is not None}
    fill = sum(known.values()) / len(known) if known else 1.0
    return {i: known.get(i, fill) for i in routing_stats}
