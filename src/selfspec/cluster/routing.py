"""Prefix-affinity routing for ``selfspec serve --ray``: :class:`PrefixAffinityRouter`.

A replica keeps the KV of earlier prompts (the prefix cache) and the n-gram history that
``auto`` drafts from; a router that spreads a conversation or a shared system prompt over
replicas throws both away. So each request's routing prefix (its first
:data:`AFFINITY_CHARS` prompt characters) is *placed* on one replica and stays there
(:class:`PrefixPlacement`): a new prefix goes to the first replica of its rendezvous
(highest-random-weight) order whose share of the placed prefixes is under its bound, the
bound being that replica's share of the cluster's prefix-cache capacity (consistent hashing
with bounded loads at a load factor of 1). Plain rendezvous hashing, without the bound,
splits prefixes unevenly (8 prefixes on 2 replicas: 5/3 as often as 4/4), and a replica given
more prefixes than its cache holds evicts them in turn and hits none. The first rank is the
prefix's replica; when it is full (``max_ongoing_requests``), Ray Serve falls to the second
rank, every other replica, and takes the least loaded of them.

Capacity: each replica reports its prefix cache's budget (``record_routing_stats`` of
:class:`~selfspec.cluster.serve_app.EngineServer`); replicas that report none count equal.
A replica that leaves takes its placements with it: their prefixes are placed anew when they
next come, and a replica that joins receives new prefixes until it holds its share. The
placements live in the router, one per proxy or handle (``selfspec serve --ray`` has one
ingress replica, so one router): several ingress replicas would each place the prefixes they
see, and a prefix placed differently by two of them costs its cache twice.

Sources: Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM
ToN 1998), rendezvous hashing; Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing with
Bounded Loads" (SODA 2018), the bound.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from selfspec.cluster.placement import (  # noqa: F401 (re-exported)
    CAPACITY_STAT,
    MAX_PLACEMENTS,
    PrefixPlacement,
    capacities,
    rendezvous_order,
)

AFFINITY_CHARS = 256  # prompts sharing this many leading characters share a replica


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    """The routing prefix of a request (its first argument's ``prompt`` attribute, cut to
    :data:`AFFINITY_CHARS`), or ``None`` for a request without a prompt."""
    if pending_request is None or not pending_request.args:
        return None
    prompt = getattr(pending_request.args[0], "prompt", None)
    if not isinstance(prompt, str) or not prompt:
        return None
    return prompt[:AFFINITY_CHARS]


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: the replica a prompt prefix is placed on
    (:class:`PrefixPlacement`) first, the others after it (Ray takes the least loaded of a
    rank); requests without a prompt (``/health``, ``/v1/models``, ``/metrics``) go by Ray's
    power of two choices over all replicas."""

    def initialize_state(self, **kwargs) -> None:
        """Ray Serve's hook (``request_router_kwargs``): start with no placements;
        ``max_placements`` and ``bounded`` as :class:`PrefixPlacement` takes them."""
        self.placement = PrefixPlacement(kwargs.get("max_placements", MAX_PLACEMENTS),
                                         kwargs.get("bounded", True))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        if not hasattr(self, "placement"):  # a Ray that does not call initialize_state
            self.initialize_state()
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        capacity = capacities({i: r.routing_stats for i, r in by_id.items()})
        owner = self.placement.place(key, capacity)
        return [[by_id[owner]], [r for i, r in by_id.items() if i != owner]]
