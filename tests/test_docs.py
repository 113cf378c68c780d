"""The documentation builds and its links lead somewhere.

- ``mkdocs build --strict`` over ``mkdocs.yml`` (the site of ``docs/``) passes: every page in
  the nav exists and no link mkdocs checks is broken (skipped where mkdocs-material is not
  installed: ``pip install -e ".[docs]"``).
- Every relative link in ``README.md`` and ``docs/*.md`` (the hand-written pages) points to a
  file that exists, or to a folder with a ``README.md``; every relative link in the run pages
  under ``docs/results/`` (reports, READMEs) points to a file or folder that exists.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULT_PAGES = sorted((REPO / "docs" / "results").rglob("*.md"))

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links and images in ``text`` that are relative paths
    (no scheme, not a bare ``#anchor``), without their ``#anchor``; code is skipped."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_relative_links_finds_links_outside_code():
    text = ("see [a](docs/a.md#x) and ![p](p.png) and [web](https://x.org) and [s](#top)\n"
            "`[no](inline.md)`\n```\n[no](fenced.md)\n```\n[b](b.md \"title\")\n")
    assert relative_links(text) == ["docs/a.md", "p.png", "b.md"]


def _broken(page: Path, any_folder: bool = False) -> list[str]:
    """The relative links of ``page`` that lead nowhere: to no file, and to no folder with a
    ``README.md`` (any folder with ``any_folder``)."""
    broken = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = (page.parent / target).resolve()
        if path.is_file() or (path.is_dir() and (any_folder or (path / "README.md").is_file())):
            continue
        broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_point_to_existing_files(page):
    assert _broken(page) == [], f"{page.relative_to(REPO)}: broken relative links"


@pytest.mark.parametrize("page", RESULT_PAGES, ids=[str(p.relative_to(REPO)) for p in RESULT_PAGES])
def test_result_pages_link_to_existing_files(page):
    assert _broken(page, any_folder=True) == [], f"{page.relative_to(REPO)}: broken links"


def test_readme_stays_short():
    """The README is what a newcomer reads in five minutes; the reference lives in docs/."""
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_ci_runs_the_readmes_test_command():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = ci.strip().splitlines()[-1]
    assert command.startswith("bash scripts/install_test_tools.sh && pip install")
    assert command in readme


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("material") is None,
                    reason='mkdocs-material is not installed (pip install -e ".[docs]")')
def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").is_file()
