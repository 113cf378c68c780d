"""The text a corpus-ranked draft vocabulary counts tokens on (FR-Spec §3 ranks the draft's
vocabulary by token frequency in a corpus; :mod:`selfspec.decoding.drafting.corpus_vocab`).

Offline and held out from every benchmark set by construction: Python source files of this
interpreter's standard library that the ``stdlib`` dataset never takes a prompt from — the
test suite, IDLE, lib2to3, tkinter, unittest, the demos (:func:`selfspec.data.stdlib.skipped`)
— and the English of the library reference's topics (``pydoc_data/topics.py``, which holds no
function, so no prompt). HumanEval, MT-Bench, GSM, ShareGPT and json-extract share no text with
it. Files are taken in a fixed order (the topics first, then sorted by path) until
``max_bytes``; the :class:`CorpusInfo` names exactly what was read.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from selfspec.data.stdlib import prompts_of_file, skipped

#: Bytes of source the default corpus reads (about 2 M tokens of a 262k-token tokenizer;
#: seconds to count, once per tokenizer).
VOCAB_CORPUS_BYTES = 8 << 20
#: Characters per piece handed to the tokenizer (long files are split: a tokenizer's cost
#: grows with a piece's length, and counts barely change at the cuts).
PIECE_CHARS = 1 << 16
_TOPICS = ("pydoc_data", "topics.py")
NAME = "python-stdlib-held-out"


@dataclass(frozen=True)
class CorpusInfo:
    """What a corpus holds (recorded with the counts made on it).

    Attributes:
        name: :data:`NAME`.
        python: the interpreter version whose library it read.
        files: relative paths read, in order.
        bytes: their total size.
        digest: sha256 over each file's path and size (what a cache is keyed by).
    """

    name: str
    python: str
    files: tuple[str, ...]
    bytes: int
    digest: str

    def describe(self) -> str:
        """One line for logs and cards."""
        return (f"{self.name}: {len(self.files)} Python {self.python} library files "
                f"({self.bytes / 2**20:.1f} MiB) the stdlib dataset takes no prompt from")


def corpus_files(max_bytes: int = VOCAB_CORPUS_BYTES,
                 root: Path | None = None) -> tuple[Path, CorpusInfo]:
    """The files of the corpus under ``root`` (default: this interpreter's library), up to
    ``max_bytes`` of them: ``(root, info)``.

    Raises:
        ValueError: ``max_bytes`` < 1.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    topics = root.joinpath(*_TOPICS)
    candidates = ([topics] if topics.is_file() else []) + sorted(_skipped_files(root))
    chosen, total = [], 0
    for path in candidates:
        size = path.stat().st_size
        if total + size > max_bytes and chosen:
            break
        chosen.append(path)
        total += size
    rel = tuple(str(p.relative_to(root)) for p in chosen)
    digest = hashlib.sha256()
    for name, path in zip(rel, chosen):
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
    version = ".".join(map(str, sys.version_info[:3]))
    return root, CorpusInfo(NAME, version, rel, total, digest.hexdigest())


def _skipped_files(root: Path) -> Iterator[Path]:
    """The ``.py`` files under ``root`` the stdlib dataset skips, found by walking only the
    top-level entries it skips (never site-packages: installed packages are not the library,
    and walking them takes seconds)."""
    for entry in root.iterdir():
        if entry.name == "site-packages" or not skipped((entry.name,)):
            continue
        if entry.is_dir():
            yield from entry.rglob("*.py")
        elif entry.suffix == ".py":
            yield entry


def corpus_pieces(root: Path, info: CorpusInfo) -> Iterator[str]:
    """The corpus's text in pieces of up to :data:`PIECE_CHARS` characters, in order (a
    file that is not UTF-8, or that the stdlib dataset would take prompts from, is skipped:
    the topics file is checked, since it lies outside the skipped directories)."""
    for name in info.files:
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel = tuple(Path(name).parts)
        if not skipped(rel) and prompts_of_file(name, text):
            continue  # a held-out guarantee, not a filter that normally fires
        for start in range(0, len(text), PIECE_CHARS):
            yield text[start:start + PIECE_CHARS]
