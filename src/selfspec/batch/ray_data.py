"""Running ``selfspec batch`` on Ray Data: the requests as a dataset, ``map_batches`` over a
pool of actors that each load one engine (:class:`EngineActor`), the records streamed back
to the driver, which alone writes the results file (so a killed actor loses nothing already
written, and Ray's retry of its batch cannot write an id twice).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from selfspec.batch.jobs import BatchRequest
from selfspec.batch.local import batches, run_batch
from selfspec.errors import MissingDependencyError

_MISSING = "selfspec batch --ray needs Ray Data: pip install 'selfspec[ray]'"


def import_ray():
    """``ray`` with Ray Data, or a clear error.

    Raises:
        MissingDependencyError: Ray (with its ``data`` extra) is not installed.
    """
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(_MISSING) from err
    return ray


class EngineActor:
    """One Ray Data actor: an engine loaded once, running batches of request rows.

    Args:
        load: :func:`selfspec.load`'s keyword arguments.
        threads: torch intra-op threads (the actor's ``num_cpus``).
    """

    def __init__(self, load: Mapping[str, Any], threads: int) -> None:
        import torch

        import selfspec

        torch.set_num_threads(threads)
        self.engine = selfspec.load(**load, show_progress=False)

    def __call__(self, rows: Mapping[str, Any]) -> dict[str, Any]:
        """``rows["request"]``: ``[B]`` JSON texts (:meth:`BatchRequest.to_json`) → ``{"record":
        [B] JSON texts}``, one result record per request."""
        import numpy as np

        requests = [BatchRequest.from_json(text) for text in rows["request"]]
        records = []
        for group in batches(requests, len(requests)):
            records.extend(run_batch(self.engine, group))
        return {"record": np.array([json.dumps(r, ensure_ascii=False) for r in records],
                                   dtype=object)}


def run_ray(requests: Sequence[BatchRequest], write: Callable[[dict], Any], *,
            load: Mapping[str, Any], batch_size: int, concurrency: int, threads: int,
            address: str | None = None) -> None:
    """Run every request on ``concurrency`` Ray actors (``threads`` CPUs each), passing each
    record to ``write`` in the driver as it comes back.

    Args:
        requests: the requests still to run.
        write: called with each record (a dict).
        load: :func:`selfspec.load`'s keyword arguments, for every actor.
        batch_size: requests per ``map_batches`` batch (one ragged batch per equal settings).
        concurrency: actors in the pool.
        threads: CPUs (torch threads) of each actor.
        address: a running cluster's address (``ray start --head``'s); ``None`` joins the
            one ``RAY_ADDRESS`` names, or starts a local one.

    Raises:
        MissingDependencyError: Ray Data is not installed.
        InvalidArgumentError: no node of the cluster has the memory one engine needs.
    """
    from selfspec.cluster.resources import check_fits, engine_bytes

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    need = engine_bytes(load)
    check_fits(ray, need, "batch actor (one engine)")
    items = [{"request": r.to_json()} for r in requests]
    blocks = max(1, -(-len(items) // batch_size))
    dataset = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
        EngineActor, fn_constructor_kwargs={"load": dict(load), "threads": threads},
        batch_size=batch_size, concurrency=concurrency, num_cpus=threads,
        **({"memory": need} if need else {}))
    for row in dataset.iter_rows():
        write(json.loads(row["record"]))
