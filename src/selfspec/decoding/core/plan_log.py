"""What an adaptive method decided during one generation: each re-chosen draft (KnapSpec's
sub-layer plan and γ, CLaSp's skipped layers, DEL's exit layer and γ) with the throughput it
predicted and the throughput measured until the next decision (KnapSpec §5.2 compares TPT
with measured throughput; the benchmark reports both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PlanRecord:
    """One decision and how the steps after it went.

    Attributes:
        step: the Step call it was made before (0-based).
        context_len: committed tokens at that point.
        skipped_attention: attention sub-layers a draft token skips (0 for plain decoding).
        skipped_mlp: MLP sub-layers a draft token skips.
        draft_len: the draft length chosen (γ; 0 = plain decoding until the next decision).
        exit_layer: the exit layer of an early-exit draft (DEL), else ``None``.
        predicted_tps: the tokens per second the method predicted for its choice (KnapSpec's
            TPT, eq. 4), ``None`` for methods without a time model.
        measured_tps: tokens committed / wall time of the Step calls until the next decision
            (planning time excluded), ``None`` when no step ran.
        planning_ms: wall time of the decision itself.
        description: a short human-readable summary.
    """

    step: int
    context_len: int
    skipped_attention: int
    skipped_mlp: int
    draft_len: int
    exit_layer: int | None = None
    predicted_tps: float | None = None
    measured_tps: float | None = None
    planning_ms: float = 0.0
    description: str = ""


class PlanLog:
    """Decisions of one generation, each with the tokens and time of the steps it governed."""

    def __init__(self) -> None:
        self._records: list[PlanRecord] = []
        self._tokens: list[int] = []
        self._ms: list[float] = []

    def clear(self) -> None:
        """Forget everything (a new generation)."""
        self._records, self._tokens, self._ms = [], [], []

    def decide(self, record: PlanRecord) -> None:
        """A new decision: the following steps count towards it."""
        self._records.append(record)
        self._tokens.append(0)
        self._ms.append(0.0)

    def add(self, committed: int, ms: float) -> None:
        """One Step call after the latest decision: ``committed`` tokens in ``ms``."""
        if self._records:
            self._tokens[-1] += committed
            self._ms[-1] += ms

    def records(self) -> list[PlanRecord]:
        """Every decision with its measured tokens per second."""
        return [replace(r, measured_tps=(1e3 * t / ms if ms > 0 else None))
                for r, t, ms in zip(self._records, self._tokens, self._ms)]
