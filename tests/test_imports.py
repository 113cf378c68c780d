"""The package's import graph has no cycle and its layers import downwards only
(data flows down, never up; docs/design.md "Layers").

Every ``import`` of a ``selfspec`` module counts: at module level, inside a function (a late
import that only hides a cycle is still a cycle), under ``TYPE_CHECKING`` (a cycle of type
names is a design cycle: the shared types belong in a module both sides import), and edges
out of the package root (``from selfspec import x`` runs ``selfspec/__init__``, which
imports the API and everything below it) like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfspec

ROOT = Path(selfspec.__file__).parent


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the modules of the package at ``root`` it imports (``from pkg import name``
    resolves to the submodule ``pkg.name`` when one exists, else to ``pkg``)."""
    package = root.name
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names
                            if a.name == package or a.name.startswith(package + ".")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and (node.module == package or node.module.startswith(package + ".")):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None``. Every edge counts,
    a package's ``__init__`` importing its own submodules included (it runs them)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "planted"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_a_cycle_through_the_package_root_is_found(tmp_path):
    """The runtime cycle ``selfspec → api → ... → heads.files → selfspec`` (a late
    ``from selfspec import __version__``) was invisible while edges out of the root were
    skipped."""
    root = _plant(tmp_path, {
        "__init__.py": "from planted.api import load\n__version__ = '1'\n",
        "api.py": "from planted.heads import files\ndef load(): ...\n",
        "heads/__init__.py": "",
        "heads/files.py": "def save():\n    from planted import __version__\n",
    })
    cycle = find_cycle(import_graph(root))
    assert cycle is not None and "planted" in cycle and "planted.heads.files" in cycle


def test_a_typing_only_cycle_is_found(tmp_path):
    root = _plant(tmp_path, {
        "state.py": "from planted.stats import Stats\nclass State: ...\n",
        "stats.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from planted.state import State\nclass Stats: ...\n"),
    })
    assert find_cycle(import_graph(root)) in (
        ["planted.state", "planted.stats", "planted.state"],
        ["planted.stats", "planted.state", "planted.stats"])


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# Layers, lowest first (docs/design.md "Layers"): a module imports only from its own layer
# and the layers below. Foundations (errors, version, extras, validation's pure checks)
# are below everything.
LAYERS = (
    ("errors", "version", "extras", "validation"),
    ("models", "data"),
    ("executor",),
    ("heads",),
    ("decoding",),
    ("methods",),
    ("api", "", "cli_args"),  # "" = the package root, which re-exports the API
    ("training",),
    ("bench", "serving", "batch", "cluster"),
    ("cli",),
)
# decoding/'s packages, lowest first: core imports no other decoding package; auto composes
# all of them. ``memory`` (what an engine learns across generations) sits with the n-gram
# lookup it stores.
DECODING_LAYERS = (
    ("core",),
    ("drafting",),
    ("planning",),
    ("ngram", "memory"),
    ("specee", "knapspec", "adadecode"),
    ("auto",),
)


def _part(module: str, depth: int) -> str:
    parts = module.split(".")
    return parts[depth] if len(parts) > depth else ""


def upward_edges(graph: dict[str, set[str]], layers, depth: int = 1, within: str = "selfspec"):
    """``(importer, imported)`` pairs under ``within`` whose imported module's part at
    ``depth`` sits in a higher layer than the importer's."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    found = []
    for module, targets in graph.items():
        if not (module == within or module.startswith(within + ".")):
            continue
        mine = rank.get(_part(module, depth))
        assert mine is not None or module == within, f"{module}: not in any layer"
        for target in targets:
            if target.startswith(within + ".") or target == within:
                theirs = rank.get(_part(target, depth))
                if mine is not None and theirs is not None and theirs > mine:
                    found.append((module, target))
    return sorted(found)


def test_layers_import_downwards_only():
    assert upward_edges(import_graph(), LAYERS) == []


def test_decoding_packages_import_downwards_only():
    graph = import_graph()
    assert upward_edges(graph, DECODING_LAYERS, depth=2, within="selfspec.decoding") == []


def test_an_upward_import_is_found():
    graph = {"selfspec.methods.x": {"selfspec.bench.spec"}, "selfspec.bench.spec": set()}
    assert upward_edges(graph, LAYERS) == [("selfspec.methods.x", "selfspec.bench.spec")]


# ------------------------------------------------------------------------ layering
# docs/design.md "Layers": training is never imported by the code that decodes.
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
