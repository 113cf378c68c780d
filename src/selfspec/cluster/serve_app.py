"""The Ray Serve application of ``selfspec serve --ray``: an ingress deployment
(:class:`~selfspec.cluster.forward.Forwarder`, no model) in front of engine replicas
(:class:`EngineServer`, one engine and selfspec's own FastAPI app each), routed by prompt
prefix (:class:`~selfspec.cluster.routing.PrefixAffinityRouter`) so a conversation keeps
finding its prefix cache and n-gram history.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from selfspec.cluster.forward import Forwarder, RoutedRequest, call_app
from selfspec.cluster.metrics import PUSH_PERIOD_S, MetricsHub, merge
from selfspec.cluster.options import RayServeOptions
from selfspec.errors import MissingDependencyError
from selfspec.serving.config import ServeConfig

logger = logging.getLogger(__name__)

APP_NAME = "selfspec"
ENGINE_DEPLOYMENT = "SelfspecEngine"
ROUTING_STATS_PERIOD_S = 2.0  # the replicas' cache budgets reach the router this often
_MISSING = "selfspec serve --ray needs Ray Serve: pip install 'selfspec[ray]'"


def import_serve():
    """``ray.serve``, or a clear error.

    Raises:
        MissingDependencyError: Ray Serve is not installed.
    """
    try:
        from ray import serve
    except ImportError as err:
        raise MissingDependencyError(_MISSING) from err
    return serve


class EngineServer:
    """One engine replica: the model loaded once, selfspec's FastAPI app (its scheduler
    running) answering the requests the ingress sends (:meth:`handle`).

    Args:
        load: :func:`selfspec.load`'s keyword arguments.
        config: the server's configuration (``model_name`` empty: the engine's name).
        threads: torch intra-op threads.
    """

    def __init__(self, load: Mapping[str, Any], config: ServeConfig, threads: int,
                 hub: Any = None) -> None:
        import torch

        import selfspec
        from selfspec.serving.app import create_app, warm_up

        torch.set_num_threads(threads)
        serve = import_serve()
        self.replica = serve.get_replica_context().replica_id.unique_id.encode()
        engine = selfspec.load(**load, show_progress=False)
        config = replace(config, model_name=config.model_name or engine.name)
        self.engine = engine
        self.app = create_app(engine, config)
        warm_up(engine, config.method, config.method_options)
        self.app.state.scheduler.start()
        self._stop = threading.Event()
        if hub is not None:
            threading.Thread(target=self._push_metrics, args=(hub,), daemon=True,
                             name="selfspec-metrics-push").start()

    def _push_metrics(self, hub: Any) -> None:
        """Push this replica's Prometheus text to the hub every ``PUSH_PERIOD_S``."""
        replica = self.replica.decode()
        while not self._stop.wait(PUSH_PERIOD_S):
            try:
                hub.put.remote(replica, self.app.state.metrics.render().decode()).result()
            except Exception as err:  # noqa: BLE001 - a hub restart must not end the replica
                logger.debug("metrics push failed: %s", err)

    def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve's hook, read by :class:`~selfspec.cluster.routing.PrefixAffinityRouter`:
        this replica's prefix-cache budget in bytes (0 without a cache)."""
        from selfspec.cluster.placement import CAPACITY_STAT

        cache = self.engine.prefix_cache
        return {CAPACITY_STAT: float(cache.budget_bytes if cache is not None else 0)}

    async def handle(self, request: RoutedRequest) -> AsyncIterator[dict]:
        """The app's ASGI messages answering ``request`` (a streaming handle call), the
        response headed ``x-selfspec-replica: ID``; a cancelled call tells the app its
        client left."""
        async for message in call_app(self.app, request, asyncio.Event()):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-selfspec-replica", self.replica)]
                message = {**message, "headers": headers}
            yield message

    def __del__(self) -> None:  # Ray Serve's replica shutdown hook
        if hasattr(self, "_stop"):
            self._stop.set()
        app = getattr(self, "app", None)
        if app is not None:
            app.state.scheduler.close()


class Ingress:
    """The HTTP entry: a :class:`Forwarder` over the engine deployment's handle."""

    def __init__(self, engine: Any, hub: Any, max_body_bytes: int) -> None:
        self._hub = hub

        def call(request: RoutedRequest):
            return engine.options(stream=True).handle.remote(request)

        from ray.serve.exceptions import BackPressureError

        self._app = Forwarder(call, max_body_bytes, self._replicas, self._metrics,
                              lambda err: not isinstance(err, BackPressureError))

    async def _replicas(self) -> dict[str, int]:
        return await asyncio.to_thread(replica_counts)

    async def _metrics(self) -> bytes:
        return merge(await self._hub.snapshot.remote())

    def __serve_build_asgi_app__(self) -> Forwarder:
        return self._app


def replica_counts() -> dict[str, int]:
    """The engine deployment's replicas: ``{"ready": running, "total": every state}``."""
    serve = import_serve()
    status = serve.status().applications.get(APP_NAME)
    if status is None or ENGINE_DEPLOYMENT not in status.deployments:
        return {"ready": 0, "total": 0}
    states = status.deployments[ENGINE_DEPLOYMENT].replica_states
    return {"ready": int(states.get("RUNNING", 0)), "total": int(sum(states.values()))}


def build_application(load: Mapping[str, Any], config: ServeConfig, options: RayServeOptions,
                      router_kwargs: Mapping[str, Any] | None = None):
    """The Ray Serve application (``serve.run`` takes it); ``router_kwargs`` go to the
    affinity router (:meth:`~selfspec.cluster.routing.PrefixAffinityRouter.initialize_state`).

    Requests in flight per replica are capped at ``max_batch + max_queue`` (what one server
    admits before its 429), and Ray queues at most ``max_queue`` more per replica before its
    503.
    """
    from selfspec.cluster.resources import engine_bytes

    serve = import_serve()
    need = engine_bytes(load)
    router = {}
    if options.affinity:
        router = {"request_router_config": {
            "request_router_class": "selfspec.cluster.routing:PrefixAffinityRouter",
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_router_kwargs": dict(router_kwargs or {})}}
    engine = serve.deployment(
        EngineServer, name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": options.threads, **({"memory": need} if need else {})},
        max_ongoing_requests=config.max_batch + config.max_queue,
        max_queued_requests=max(config.max_queue, 1),
        graceful_shutdown_timeout_s=config.drain_seconds,
        **options.scaling(config.max_batch), **router)
    hub = serve.deployment(MetricsHub, name="SelfspecMetrics", num_replicas=1,
                           ray_actor_options={"num_cpus": 0}).bind()
    ingress = serve.deployment(serve.ingress()(Ingress), name="SelfspecIngress",
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(dict(load), config, options.threads, hub), hub,
                        config.limits.max_body_bytes)


def run(load: Mapping[str, Any], config: ServeConfig, options: RayServeOptions,
        host: str, port: int) -> None:
    """Start (or join) the cluster, run the application on ``host:port`` until SIGTERM or
    SIGINT, then shut it down (replicas finish their requests for up to ``drain_seconds``).

    Raises:
        MissingDependencyError: Ray Serve is not installed.
        InvalidArgumentError: no node of the cluster has the memory one replica needs.
    """
    from selfspec.cluster.resources import check_fits, engine_bytes

    serve = import_serve()
    import ray

    if not ray.is_initialized():
        ray.init(address=options.address, include_dashboard=False)
    check_fits(ray, engine_bytes(load), "engine replica")
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(load, config, options), name=APP_NAME, route_prefix="/")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    serve.shutdown()
