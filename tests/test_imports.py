"""The package's import graph has no cycle (DESIGN.md: data flows down, never up).

Every ``import`` of a ``selfspec`` module counts, at module level or inside a function (a
late import that only hides a cycle is still a cycle); imports under ``TYPE_CHECKING`` are
annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfspec

ROOT = Path(selfspec.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["selfspec", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module → the selfspec modules it imports (``from pkg import name`` resolves to the
    submodule ``pkg.name`` when one exists, else to ``pkg``)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_nodes(tree)
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("selfspec")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("selfspec"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        # a package's own __init__ importing its submodules is not a dependency on itself
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None``. A package and its
    ``__init__`` re-exports are edges like any other, except package → own submodule."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):  # a package importing its own submodule
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# ------------------------------------------------------------------------ layering
# DESIGN.md "Layers of the code": training is never imported by the code that decodes.
DECODE_TIME_PACKAGES = ("heads", "decoding", "executor", "methods", "models")
TRAINING = "selfspec.training"


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name an import in ``source`` (the text of ``module``) names.

    Stricter than :func:`import_graph`: ``from a import b`` counts as ``a`` and ``a.b``;
    relative imports are resolved; ``importlib.import_module("...")`` and
    ``__import__("...")`` with a literal name count; and imports under ``TYPE_CHECKING``
    count too (decoding code that names a training type still depends on training).
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names


def training_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The names under ``selfspec.training`` that ``source`` imports, sorted."""
    return sorted(n for n in imported_names(source, module, is_package)
                  if n == TRAINING or n.startswith(TRAINING + "."))


def test_training_imports_finds_every_form():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import selfspec.training.corpus\n"
        "from selfspec.training.pipeline import train\n"
        "from ..training import probe\n"
        "from .. import training\n"
        "if TYPE_CHECKING:\n"
        "    from selfspec.training.engine import Engine\n"
        "def late():\n"
        "    from selfspec import training as t\n"
        "    import importlib\n"
        "    importlib.import_module('selfspec.training.train')\n"
        "    __import__('selfspec.training.plots')\n")
    found = training_imports(source, "selfspec.heads.files")
    for name in ("selfspec.training.corpus", "selfspec.training.pipeline",
                 "selfspec.training.probe", "selfspec.training", "selfspec.training.engine",
                 "selfspec.training.train", "selfspec.training.plots"):
        assert name in found
    assert training_imports("from . import files\nfrom selfspec.heads import load_heads\n"
                            "import selfspec.trainingwheels\n", "selfspec.heads", True) == []
    assert _resolve("selfspec.heads", True, 1, "files") == "selfspec.heads.files"
    assert _resolve("selfspec.heads.files", False, 2, "training") == "selfspec.training"


def test_decoding_code_never_imports_training():
    """heads, decoding, executor, methods and models never import ``selfspec.training``,
    at module level, inside a function, or under ``TYPE_CHECKING``."""
    assert (ROOT / "training" / "__init__.py").is_file()
    offenders: dict[str, list[str]] = {}
    seen = dict.fromkeys(DECODE_TIME_PACKAGES, 0)
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        package = module.split(".")[1] if "." in module else ""
        if package not in seen:
            continue
        seen[package] += 1
        found = training_imports(path.read_text(encoding="utf-8"), module,
                                 path.name == "__init__.py")
        if found:
            offenders[module] = found
    assert all(seen.values()), f"no modules found for {[p for p, n in seen.items() if not n]}"
    assert not offenders, f"decode-time modules import training: {offenders}"
