"""Prefix placement of ``selfspec serve --ray``'s router (no cluster, no Ray: the placement
is pure Python, :mod:`selfspec.cluster.placement`)."""

from __future__ import annotations

from selfspec.cluster.placement import (
    CAPACITY_STAT,
    PrefixPlacement,
    capacities,
    rendezvous_order,
)

KEYS = [f"System {i}. You are a helpful assistant" for i in range(64)]


def test_placement_balances_prefixes_where_rendezvous_hashing_alone_does_not():
    ids = {"a": 1.0, "b": 1.0}
    for start in range(0, 64, 8):  # 8 sets of 8 prefixes on 2 replicas
        keys = KEYS[start:start + 8]
        placement = PrefixPlacement()
        owners = [placement.place(k, ids) for k in keys]
        assert sorted(placement.counts().values()) == [4, 4]
        assert owners == [placement.place(k, ids) for k in keys]  # sticky
    plain = [sum(rendezvous_order(k, list(ids))[0] == "a" for k in KEYS[s:s + 8])
             for s in range(0, 64, 8)]
    assert any(n != 4 for n in plain)  # what the bound fixes


def test_placement_follows_capacity_and_replaces_a_departed_replicas_prefixes():
    placement = PrefixPlacement()
    for k in KEYS[:30]:
        placement.place(k, {"a": 2.0, "b": 1.0})
    assert placement.counts() == {"a": 20, "b": 10}
    before = {k: placement.place(k, {"a": 2.0, "b": 1.0}) for k in KEYS[:30]}
    after = {k: placement.place(k, {"a": 2.0, "c": 1.0}) for k in KEYS[:30]}
    assert all(after[k] == "a" for k in before if before[k] == "a")  # a's stay put
    assert {after[k] for k in before if before[k] == "b"} <= {"a", "c"}
    assert placement.counts().get("c", 0) >= 8


def test_placement_forgets_the_least_recently_seen_prefix():
    placement = PrefixPlacement(max_placements=2)
    for k in KEYS[:3]:
        placement.place(k, {"a": 1.0})
    assert sum(placement.counts().values()) == 2


def test_capacities_fill_replicas_that_have_not_reported():
    assert capacities({"a": {CAPACITY_STAT: 4.0}, "b": {}, "c": None}) == {
        "a": 4.0, "b": 4.0, "c": 4.0}
    assert capacities({"a": {CAPACITY_STAT: 0}, "b": {}}) == {"a": 1.0, "b": 1.0}
