"""One Step call under a re-planning Step's latest decision (KnapSpec, CLaSp, DEL)."""

from __future__ import annotations

import time
from dataclasses import replace

from selfspec.decoding.core.history import CommittedWindow
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.plan_log import PlanLog
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats


def governed_call(step: Step, state: DecodeState, plan_ms: float, plan_log: PlanLog,
                  window: CommittedWindow) -> StepStats:
    """One call of ``step`` under the latest decision of a re-planning Step (KnapSpec,
    CLaSp, DEL): its tokens and time count towards that decision and the history window, and
    ``plan_ms`` (the planning that preceded it, drafting overhead) is added to its
    ``draft_ms``."""
    t0 = time.perf_counter()
    stats = step(state)
    plan_log.add(stats.committed, (time.perf_counter() - t0) * 1e3)
    window.add(stats.committed)
    return replace(stats, draft_ms=stats.draft_ms + plan_ms) if plan_ms else stats
