"""The prompt type and how a fixed number of prompts is chosen from a set."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from selfspec.errors import InvalidArgumentError


@dataclass(frozen=True)
class Prompt:
    """One prompt of a dataset.

    Attributes:
        id: stable id within the dataset (``"HumanEval/0"``, ``"mtbench/81"``,
            ``"gsm_symbolic/0"``, ``"sharegpt/QWJhYvA_0"``).
        text: the prompt text (for chat prompts, the user turn's content).
        chat: True = apply the model's chat template with ``text`` as a user turn;
            False = continue ``text`` as raw text (HumanEval code completion).
        reference: a reference answer when the dataset has one (HumanEval canonical
            solution, MT-Bench reference answer, GSM worked answer, ShareGPT's gpt reply).
        meta: dataset-specific fields (HumanEval ``test`` and ``entry_point``, MT-Bench
            ``category``, GSM numeric ``answer``, ...).
    """

    id: str
    text: str
    chat: bool
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def select(prompts: list[Prompt], n: int | None, seed: int, dataset: str) -> list[Prompt]:
    """Pick ``n`` prompts of a fixed dataset: the first ``n`` in the dataset's own order for
    ``seed == 0`` (HumanEval/0..n-1, as papers report), a seeded random sample otherwise.

    Raises:
        InvalidArgumentError: ``n < 1`` or ``n`` larger than the dataset.
    """
    if n is None:
        n = len(prompts)
    check_n(n, dataset)
    if n > len(prompts):
        raise InvalidArgumentError(
            f"dataset {dataset!r} has {len(prompts)} prompts; asked for n={n}. "
            f"Use n <= {len(prompts)}")
    if seed == 0:
        return prompts[:n]
    return random.Random(seed).sample(prompts, n)


def with_reserve(prompts: list[Prompt], n: int | None, seed: int, dataset: str) -> list[Prompt]:
    """:func:`select`'s ``n`` prompts first, then every other prompt of ``prompts`` (in their
    own order for ``seed == 0``, seeded-shuffled otherwise): the order from which a benchmark
    takes replacements for prompts it must drop (``selfspec bench`` drops those that trained
    a method's heads), so that ``n`` prompts still run.

    Raises:
        InvalidArgumentError: as :func:`select`.
    """
    first = select(prompts, n, seed, dataset)
    chosen = {p.id for p in first}
    rest = [p for p in prompts if p.id not in chosen]
    if seed != 0:
        random.Random(seed).shuffle(rest)
    return first + rest


def check_n(n: int, dataset: str) -> None:
    """Raise :class:`InvalidArgumentError` unless ``n >= 1``."""
    if n < 1:
        raise InvalidArgumentError(f"n must be >= 1 prompts of {dataset!r}, got {n}")
