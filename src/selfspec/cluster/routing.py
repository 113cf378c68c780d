"""Prefix-affinity routing for ``selfspec serve --ray``: :class:`PrefixAffinityRouter`.

A replica keeps the KV of earlier prompts (the prefix cache) and the n-gram history that
``auto`` drafts from; a router that spreads a conversation or a shared system prompt over
replicas throws both away. This router ranks the replicas for each request by rendezvous
(highest-random-weight) hashing of the request's first :data:`AFFINITY_CHARS` prompt
characters: requests sharing that prefix rank the same replica first, every router
instance (one per proxy and handle) agrees without shared state, and a replica added or
removed moves only the prefixes it wins or held. The first rank is that replica; when it is
full (``max_ongoing_requests``), Ray Serve falls to the second rank, every other replica,
and takes the least loaded of them.

Source: Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM
ToN 1998), rendezvous hashing.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

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


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` by decreasing rendezvous weight ``blake2b(key, id)`` for ``key``."""
    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: the replica that wins the prompt prefix's rendezvous hash
    first, the others after it (Ray takes the least loaded of a rank); requests without a
    prompt (``/health``, ``/v1/models``, ``/metrics``) go by Ray's power of two choices over
    all replicas."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        order = rendezvous_order(key, list(by_id))
        return [[by_id[order[0]]], [by_id[i] for i in order[1:]]]
