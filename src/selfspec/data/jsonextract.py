"""``json-extract``: structured-output extraction tasks written for selfspec (no package).

Each prompt is a chat turn: an instruction, a short passage and the JSON schema of the answer
(:mod:`selfspec.data.jsonextract_tasks` holds the tasks). ``meta`` carries what the benchmark
needs: ``schema``, ``response_format`` (OpenAI's ``{"type": "json_schema", ...}``, which the
bench passes to every method, ``ar`` included, so decoding is constrained by it) and ``split``;
``reference`` is the expected answer as compact JSON. The scorer
(:func:`selfspec.bench.accuracy.check_json`) counts an output correct when it parses as JSON
and validates against the schema.

Split (docs/benchmark.md "Structured output"): the first :data:`HELD_OUT_SIZE` prompts are
the reported, held-out tasks; the last ones (:data:`CALIBRATION_IDS`) are for anything tuned
on this dataset. The benchmark's held-out check (:mod:`selfspec.bench.heldout`) treats the
calibration tasks as seen, so a run reports only held-out tasks unless ``--allow-in-sample``.
"""

from __future__ import annotations

import json
from typing import Any

from selfspec.data.jsonextract_tasks import CALIBRATION_TASKS, HELD_OUT_TASKS, JsonTask
from selfspec.data.prompt import Prompt, select

DATASET = "json-extract"
HELD_OUT_SIZE = len(HELD_OUT_TASKS)
CALIBRATION_IDS = frozenset(t.id for t in CALIBRATION_TASKS)


def response_format(task: JsonTask) -> dict[str, Any]:
    """The task's OpenAI ``response_format`` (``strict``: the schema closes every object)."""
    return {"type": "json_schema",
            "json_schema": {"name": task.name, "schema": task.schema, "strict": True}}


def prompt_text(task: JsonTask) -> str:
    """The user turn: the instruction, the passage and the schema (compact JSON), so the
    model knows the field names and types it is constrained to."""
    schema = json.dumps(task.schema, separators=(",", ":"), ensure_ascii=False)
    return (f"{task.instruction}\n\nText: {task.passage}\n\n"
            f"Answer with one JSON object that follows this JSON schema:\n{schema}")


def to_prompt(task: JsonTask, split: str) -> Prompt:
    """The :class:`Prompt` of ``task`` (``split``: ``"held-out"`` or ``"calibration"``)."""
    return Prompt(id=task.id, text=prompt_text(task), chat=True,
                  reference=json.dumps(task.reference, separators=(",", ":"),
                                       ensure_ascii=False),
                  meta={"schema": task.schema, "response_format": response_format(task),
                        "split": split})


def all_prompts() -> list[Prompt]:
    """Every task: the held-out ones first, then the calibration ones."""
    return ([to_prompt(t, "held-out") for t in HELD_OUT_TASKS]
            + [to_prompt(t, "calibration") for t in CALIBRATION_TASKS])


def calibration_prompts() -> list[Prompt]:
    """The calibration tasks only (for tuning; never in a reported run)."""
    return [to_prompt(t, "calibration") for t in CALIBRATION_TASKS]


def load(n: int | None, seed: int) -> list[Prompt]:
    """``n`` json-extract prompts (see :func:`selfspec.data.load_prompts`); with ``seed == 0``
    the first ``n`` are held-out tasks for ``n <= HELD_OUT_SIZE``."""
    return select(all_prompts(), n, seed, DATASET)
