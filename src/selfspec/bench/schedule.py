"""Record a method's schedule on one machine, replay it on another to time it.

A *schedule* is what a generation did step by step, independent of the hardware: per step,
the tokens drafted, the layers each draft token ran (its exit layer; 0 for an n-gram draft,
which runs none), the tokens accepted and committed. Acceptance depends only on the model and
the prompt (greedy decoding is deterministic), so a schedule recorded on a CPU holds on a GPU;
only the time of each step differs. :func:`replay_schedule` re-runs the schedule's shapes
on any executor (the same layer ranges, block sizes, cache rollbacks and one host sync per
step) and times it — how a method would run on a GPU, measured without re-deciding anything
there.

The replay's verification runs every layer over the ``D + 1`` fed tokens (what ngram, qspec
and the skip drafters do); LayerSkip / D&V verification resumes from the draft's exit-layer
states, so the replay over-counts its verification by ``D · e`` layer-token passes (``e`` the
exit layer). Drafting replays each draft token through its exit layer and the output head,
one token at a time.

A library module, not a command: :func:`record_schedule` is called from your own code on the
machine that records (docs/gpu.md), and the GPU check (``python scripts/gpu_check.py``)
replays what it finds with :func:`replay_schedule`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.executor.cost_model import synchronize
from selfspec.executor.sync import device_tensor, position_block, to_host

SCHEDULE_VERSION = 1


@dataclass(frozen=True)
class ScheduleStep:
    """One step of a recorded generation.

    Attributes:
        drafted: draft tokens ``D`` (0 for a plain decoding step).
        accepted: draft tokens accepted.
        committed: tokens committed (accepted + 1, fewer at a limit).
        exit_layers: layers each draft token ran (``D`` ints; 0 = no model layer).
        verified: whether the step verified a draft with the full model.
    """

    drafted: int
    accepted: int
    committed: int
    exit_layers: tuple[int, ...] = ()
    verified: bool = False


@dataclass
class Schedule:
    """A generation's schedule (JSON with :meth:`to_json` / :meth:`from_json`)."""

    model: str
    method: str
    num_layers: int
    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[ScheduleStep] = field(default_factory=list)
    recorded_on: str = ""
    tokens_per_s: float = 0.0
    version: int = SCHEDULE_VERSION

    def to_json(self) -> str:
        """The schedule as JSON text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """A schedule from :meth:`to_json`'s text.

        Raises:
            ValueError: not a schedule of this version.
        """
        data = json.loads(text)
        if data.get("version") != SCHEDULE_VERSION:
            raise ValueError(f"not a selfspec schedule of version {SCHEDULE_VERSION}")
        data["steps"] = [ScheduleStep(**{**s, "exit_layers": tuple(s["exit_layers"])})
                         for s in data["steps"]]
        return cls(**data)

    def save(self, path: Path | str) -> Path:
        """Write to ``path`` (parents created); returns it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


class _Recording:
    """A Step wrapper that records each call's statistics."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.steps: list[ScheduleStep] = []

    def __getattr__(self, name: str) -> Any:  # prefill_observer and other optional hooks
        return getattr(self.step, name)

    def start(self, state: Any) -> None:
        """Start the wrapped step on ``state``."""
        self.step.start(state)

    def __call__(self, state: Any) -> Any:
        stats = self.step(state)
        exits = tuple(int(e) for e in stats.exit_layers)
        if len(exits) != stats.num_drafted:
            exits = (exits + (0,) * stats.num_drafted)[: stats.num_drafted]
        self.steps.append(ScheduleStep(stats.num_drafted, stats.num_accepted, stats.committed,
                                       exits, bool(stats.verified)))
        return stats


@torch.inference_mode()
def record_schedule(engine: Any, prompt: str | Sequence[int], method: str = "ar", *,
                    max_new_tokens: int = 128, chat: bool = False,
                    **options: Any) -> Schedule:
    """Generate greedily with ``method`` and record its schedule.

    Args:
        engine: a :class:`selfspec.SelfSpec`.
        prompt: text or token ids.
        method / options: the method and its options.
        max_new_tokens: the budget.

    Raises:
        InvalidArgumentError, PromptError: as :meth:`selfspec.SelfSpec.generate`.
    """
    from selfspec.decoding.core import loop
    from selfspec.decoding.core.state import DecodeState
    from selfspec.executor.cost_model import device_name
    from selfspec.methods.registry import get_method

    decode = engine.decode_options(max_new_tokens, 0.0, 0, 1.0, None)
    ids = engine.encode(prompt, chat=chat)
    step = _Recording(get_method(method).make_step(engine.methods, options))
    state = DecodeState(engine.executor, ids, decode)
    stats = loop.run(state, step)
    device = engine.executor.device
    return Schedule(model=engine.name, method=method, num_layers=engine.executor.num_layers,
                    prompt_ids=list(ids), output_ids=state.tokens[len(ids):],
                    steps=step.steps, recorded_on=f"{device.type}:{device_name(device)}",
                    tokens_per_s=stats.tokens_per_s)


@dataclass
class ReplayTiming:
    """What :func:`replay_schedule` measured.

    Attributes:
        total_ms: prefill excluded, every step included (synchronized at the end).
        step_ms: per step (each ends in its one host sync).
        new_tokens: tokens the schedule committed.
        tokens_per_s: ``new_tokens / total``.
        device: where it ran.
    """

    total_ms: float
    step_ms: list[float]
    new_tokens: int
    tokens_per_s: float
    device: str


@torch.inference_mode()
def replay_schedule(executor: Any, schedule: Schedule) -> ReplayTiming:
    """Run ``schedule``'s shapes on ``executor`` and time them (see the module doc).

    Raises:
        ValueError: the schedule is for a model with another number of layers.
    """
    ex = executor
    if schedule.num_layers != ex.num_layers:
        raise ValueError(f"the schedule is for {schedule.num_layers} layers; the executor "
                         f"has {ex.num_layers}")
    tokens = list(schedule.prompt_ids) + list(schedule.output_ids)
    tokens = [t if 0 <= t < ex.vocab_size else 0 for t in tokens]
    capacity = len(tokens) + 80
    graphs = getattr(ex, "graphs", None)
    cache = graphs.decode_cache(capacity, schedule) if graphs is not None else None
    cache = cache or ex.new_cache(capacity=capacity)
    n = len(schedule.prompt_ids)
    ex.forward(device_tensor([tokens[:n]], ex.device), position_block(0, n, ex.device), cache,
               last_only=True)
    n += 1  # the first token comes from the prefill's logits
    synchronize(ex.device)
    step_ms = []
    start_all = time.perf_counter()
    for step in schedule.steps:
        t0 = time.perf_counter()
        start = n - 1  # the last committed token has run through no layer yet
        fed = tokens[start:start + step.drafted + 1]
        fed += [0] * (step.drafted + 1 - len(fed))
        for i, exit_layer in enumerate(step.exit_layers):
            if exit_layer <= 0:
                continue
            hidden = ex.embed(device_tensor([[fed[i]]], ex.device))
            hidden = ex.run_layers(hidden, position_block(start + i, 1, ex.device), 0,
                                   min(exit_layer, ex.num_layers), cache)
            ex.logits(hidden).argmax(dim=-1)  # the exit head's choice (read by the drafter)
        cache.truncate(start)
        ids = device_tensor([fed], ex.device)
        logits = ex.forward(ids, position_block(start, len(fed), ex.device), cache)
        to_host(logits[0].argmax(dim=-1))  # the step's one sync
        cache.truncate(n + step.accepted)
        n += step.committed
        step_ms.append((time.perf_counter() - t0) * 1e3)
    synchronize(ex.device)
    total = (time.perf_counter() - start_all) * 1e3
    new_tokens = 1 + sum(s.committed for s in schedule.steps)
    return ReplayTiming(total, step_ms, new_tokens,
                        new_tokens / (total / 1e3) if total > 0 else 0.0, str(ex.device))
