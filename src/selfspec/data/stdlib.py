"""Python standard-library functions as code-completion prompts (``stdlib``).

Each prompt is a documented function of the running interpreter's own standard library, cut
like a HumanEval problem: the signature and docstring are the prompt, the body is the
reference. It needs no package and shares no problem with HumanEval or any other benchmark
set, so exit heads, thresholds and probes trained on it are held out from every benchmark
prompt by construction (the default training data of ``selfspec heads train``).

Ids are ``stdlib/<module>.<qualname>`` (e.g. ``stdlib/textwrap.TextWrapper._split``). The set
depends on the Python version; the head card records the exact ids used.
"""

from __future__ import annotations

import ast
import logging
import sysconfig
from pathlib import Path

from selfspec.data.prompt import Prompt, select

logger = logging.getLogger(__name__)

# Packages of tests, demos, the IDE and vendored/deprecated code are not ordinary library
# code; site-packages is not the standard library.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo",
              "ensurepip", "tkinter", "__pycache__", "unittest"}
MIN_BODY_LINES, MAX_BODY_LINES = 3, 40
MAX_PROMPT_CHARS = 2000


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualname, node)`` of module-level functions and methods of module-level classes."""
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef) and not prefix:
            yield from _functions(node, node.name + ".")


def prompts_of_file(module: str, source: str) -> list[Prompt]:
    """The documented functions of one module's ``source``, as prompts.

    A function qualifies when its docstring is the first statement and the body after the
    docstring has ``MIN_BODY_LINES`` to ``MAX_BODY_LINES`` lines. Unparsable source gives none.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for qualname, node in _functions(tree):
        body = node.body
        if (len(body) < 2 or not isinstance(body[0], ast.Expr)
                or not isinstance(getattr(body[0], "value", None), ast.Constant)
                or not isinstance(body[0].value.value, str)):
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        split, end = body[0].end_lineno, node.end_lineno
        if end is None or split is None or not MIN_BODY_LINES <= end - split <= MAX_BODY_LINES:
            continue
        indent = len(lines[start]) - len(lines[start].lstrip())
        prompt = "".join(line[indent:] if line[:indent].isspace() else line
                         for line in lines[start:split])
        reference = "".join(line[indent:] if line[:indent].isspace() else line
                            for line in lines[split:end])
        if len(prompt) > MAX_PROMPT_CHARS or not reference.strip():
            continue
        out.append(Prompt(id=f"stdlib/{module}.{qualname}", text=prompt, chat=False,
                          reference=reference, meta={"module": module}))
    return out


def skipped(rel: tuple[str, ...]) -> bool:
    """Whether the file at ``rel`` (path parts under the standard library's root) is one
    this dataset never takes prompts from: tests, demos, the IDE, vendored code, private
    modules (what :mod:`selfspec.data.vocab_corpus` may count tokens on instead)."""
    return any(part in _SKIP_DIRS or part.startswith(("_", ".")) and part != "__init__.py"
               for part in rel)


def all_prompts(root: Path | None = None) -> list[Prompt]:
    """Every qualifying function of the standard library under ``root`` (default: this
    interpreter's), sorted by id (a few thousand; seconds to parse)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    prompts: dict[str, Prompt] = {}
    for path in sorted(root.rglob("*.py")):
        if skipped(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for p in prompts_of_file(_module_name(root, path), source):
            prompts.setdefault(p.id, p)  # a re-defined name (if/else variants): the first
    logger.debug("stdlib: %d prompts under %s", len(prompts), root)
    return [prompts[k] for k in sorted(prompts)]


def load(n: int | None, seed: int) -> list[Prompt]:
    """``n`` standard-library prompts (see :func:`selfspec.data.load_prompts`)."""
    return select(all_prompts(), n, seed, "stdlib")
