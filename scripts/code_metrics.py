#!/usr/bin/env python
"""Size of selfspec's code as a reader meets it: the largest modules and functions, nested
closures, long lines and the tracked bytes of docs/results.

Usage::

    python scripts/code_metrics.py                 # the working tree
    python scripts/code_metrics.py --rev e5cc16d   # a commit (read with git, nothing checked out)
    python scripts/code_metrics.py --json out.json

A function's size is its lines from ``def`` to its last statement (decorators and docstring
included); a closure is a function defined inside another function. Only ``src/`` counts.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from dataclasses import asdict, dataclass


@dataclass
class Function:
    """One function: ``path:qualname``, its lines and the closures nested in it."""

    name: str
    lines: int
    closures: int


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def _sources(rev: str | None) -> dict[str, str]:
    """``{path: text}`` of every ``src/**.py`` at ``rev`` (the working tree when ``None``)."""
    if rev is None:
        paths = _git("ls-files", "--cached", "--others", "--exclude-standard", "src").split()
        out = {}
        for p in paths:
            if p.endswith(".py"):
                try:
                    with open(p, encoding="utf-8") as f:
                        out[p] = f.read()
                except FileNotFoundError:  # deleted in the tree, not yet in the index
                    pass
        return out
    paths = _git("ls-tree", "-r", "--name-only", rev, "src").split()
    return {p: _git("show", f"{rev}:{p}") for p in paths if p.endswith(".py")}


def _functions(path: str, tree: ast.AST) -> list[Function]:
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str, inside: bool) -> int:
        closures = 0
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = visit(child, f"{prefix}{child.name}.", True)
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append(Function(f"{path}:{prefix}{child.name}",
                                      child.end_lineno - start + 1, inner))
                closures += (1 if inside else 0) + inner
            elif isinstance(child, ast.ClassDef):
                closures += visit(child, f"{prefix}{child.name}.", inside)
            else:
                closures += visit(child, prefix, inside)
        return closures

    visit(tree, "", False)
    return found


def _results_bytes(rev: str | None) -> tuple[int, int]:
    """(files, bytes) tracked under docs/results at ``rev`` (the index when ``None``)."""
    if rev is None:
        rows = _git("ls-files", "-s", "docs/results").splitlines()
        sizes = _batch_sizes([r.split()[1] for r in rows])
    else:
        rows = _git("ls-tree", "-r", "-l", rev, "docs/results").splitlines()
        sizes = [int(r.split()[3]) for r in rows]
    return len(sizes), sum(sizes)


def _batch_sizes(objects: list[str]) -> list[int]:
    out = subprocess.run(["git", "cat-file", "--batch-check=%(objectsize)"],
                         input="\n".join(objects),
                         check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def measure(rev: str | None, top: int) -> dict:
    """The metrics of ``rev`` (or the working tree) as a JSON-able dict."""
    sources = _sources(rev)
    functions: list[Function] = []
    for path, text in sources.items():
        functions += _functions(path, ast.parse(text, filename=path))
    modules = sorted(((p, t.count("\n")) for p, t in sources.items()), key=lambda x: -x[1])
    long_lines = sum(len(line) > 100 for t in sources.values() for line in t.splitlines())
    files, size = _results_bytes(rev)
    functions.sort(key=lambda f: -f.lines)
    return {
        "rev": rev or "working tree",
        "source_lines": sum(n for _, n in modules),
        "modules": len(modules),
        "largest_modules": modules[:top],
        "largest_functions": [asdict(f) for f in functions[:top]],
        "functions_over_80_lines": sum(f.lines > 80 for f in functions),
        "most_closures": [asdict(f) for f in sorted(functions, key=lambda f: -f.closures)[:5]],
        "lines_over_100_chars": long_lines,
        "docs_results": {"files": files, "bytes": size},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=None, help="a commit (default: the working tree)")
    parser.add_argument("--top", type=int, default=12, help="rows of each list (default 12)")
    parser.add_argument("--json", default=None, help="also write the metrics to this file")
    args = parser.parse_args()
    m = measure(args.rev, args.top)
    print(f"{m['rev']}: {m['source_lines']} source lines in {m['modules']} modules; "
          f"{m['functions_over_80_lines']} functions over 80 lines; "
          f"{m['lines_over_100_chars']} lines over 100 characters; docs/results "
          f"{m['docs_results']['files']} files, {m['docs_results']['bytes'] / 2**20:.1f} MiB")
    print("largest modules:")
    for path, n in m["largest_modules"]:
        print(f"  {n:6d}  {path}")
    print("largest functions (lines, closures inside):")
    for f in m["largest_functions"]:
        print(f"  {f['lines']:6d} {f['closures']:3d}  {f['name']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(m, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
