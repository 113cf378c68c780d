"""How ``selfspec serve --ray`` scales: :class:`RayServeOptions`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selfspec.errors import InvalidArgumentError


@dataclass(frozen=True)
class RayServeOptions:
    """Replicas, autoscaling and routing of the Ray Serve application.

    Attributes:
        replicas: engine replicas when not autoscaling.
        min_replicas / max_replicas: autoscale between these (both set, or neither).
        target_ongoing_requests: the autoscaler's target of requests in flight per replica
            (``None``: the server's ``max_batch``).
        threads: CPUs (torch threads) each replica takes.
        affinity: route requests whose prompts share a prefix to one replica, where its
            prefix cache and n-gram history live
            (:class:`~selfspec.cluster.routing.PrefixAffinityRouter`); ``False``: Ray's
            power-of-two-choices router.
        address: a running cluster's address; ``None``: ``$RAY_ADDRESS`` or a local cluster.
        autoscaling: more of Ray Serve's ``autoscaling_config`` (``upscale_delay_s``,
            ``downscale_delay_s``, ``look_back_period_s``, ...; Ray's defaults otherwise,
            e.g. 600 s before a scale-down); no command-line option sets them.
    """

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    threads: int = 1
    affinity: bool = True
    address: str | None = None
    autoscaling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InvalidArgumentError("give both --min-replicas and --max-replicas to "
                                       "autoscale, or neither (a fixed --replicas)")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise InvalidArgumentError(
                f"--min-replicas {self.min_replicas} must be at least 1 and at most "
                f"--max-replicas {self.max_replicas}")

    def scaling(self, max_batch: int) -> dict[str, Any]:
        """The engine deployment's ``num_replicas`` / ``autoscaling_config`` options."""
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        target = self.target_ongoing_requests or max_batch
        return {"autoscaling_config": {**self.autoscaling,
                                       "min_replicas": self.min_replicas,
                                       "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": target}}
