"""Integrity of registry cache entries: what a fetch records, what a load and ``models verify``
check.

A fetch records, in the entry's manifest (``selfspec_manifest.json``, key ``"files"``), the size
and sha256 of every file of the entry (config, weights, tokenizer, chat template...), hashing
them right after the conversion. Three depths of check read that record:

- :attr:`Depth.SIZES` (whether ``selfspec models fetch`` without ``--force`` must fetch again):
  every recorded file exists with its recorded size.
- :attr:`Depth.LOAD` (every load of a registry entry, and ``selfspec models list``, which so
  shows what a load would find): the sizes, and the sha256 of

  * every file below :data:`HASH_ALWAYS_BYTES` (64 MiB: config and tokenizer files, hashed in
    milliseconds), always;
  * every larger file (the weights) unless the entry's stamp file (``selfspec_verified.json``)
    says it hashed correctly while it had the size, ``mtime_ns``, ``ctime_ns`` and inode it has
    now, and that stamp was taken more than :data:`RACY_WINDOW_NS` (2 s) after the file's last
    change. Any write to a file, even one byte in place, moves its mtime and ctime (the ctime
    cannot be set back from user space); the 2 s margin covers file-system timestamps that
    tick coarsely (a write in the same tick as the stamp could otherwise leave them equal; git
    calls this the "racy clean" case), so a file changed after its stamp is hashed again
    before it is used, and an unchanged one costs one ``stat``. Hashing reads every byte of
    the weights (seconds for a model of a few GB), so paying it on every load would double
    the load time of the larger models for no gain. A file younger than the margin is hashed and
    not stamped, so the first load after a fetch hashes the weights once more.

  The stamp is written after each successful hash of a large file (best effort: in a
  read-only cache every load hashes). What it cannot see is damage that changes no metadata (a
  failing disk); ``selfspec models verify`` hashes everything and finds that.
- :attr:`Depth.FULL` (``selfspec models verify``): every file hashed, as a fetch does when it
  records them.

A manifest that records no files is unreadable, so its entry is corrupt like any other damage.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.errors import CorruptModelFileError
from selfspec.models.common import dtype_name

logger = logging.getLogger(__name__)

MANIFEST_NAME = "selfspec_manifest.json"
STAMP_NAME = "selfspec_verified.json"
HASH_ALWAYS_BYTES = 64 << 20
RACY_WINDOW_NS = 2_000_000_000
_NOT_RECORDED = (MANIFEST_NAME, STAMP_NAME)
_SHORT_HASH = 16
_CLI_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Depth(enum.Enum):
    """How far :func:`check_entry` goes (see the module docstring)."""

    SIZES = "sizes"
    LOAD = "load"
    FULL = "full"


@dataclass(frozen=True)
class FileRecord:
    """One file of an entry as the fetch that wrote it recorded it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class FileProblem:
    """One way an entry's file differs from its record.

    Attributes:
        name: the file, relative to the entry.
        kind: ``"missing"``, ``"size"``, ``"sha256"`` or ``"unreadable"`` (the manifest itself).
        expected: recorded size or sha256 (empty for missing/unreadable).
        actual: found size or sha256, or the reason it could not be read.
    """

    name: str
    kind: str
    expected: str = ""
    actual: str = ""

    def describe(self) -> str:
        """One phrase for messages, e.g. ``"model.safetensors has 100 bytes, expected 4096"``."""
        if self.kind == "missing":
            return f"{self.name} is missing"
        if self.kind == "size":
            return f"{self.name} has {self.actual} bytes, expected {self.expected}"
        if self.kind == "sha256":
            return (f"{self.name} has sha256 {self.actual[:_SHORT_HASH]}... "
                    f"(expected {self.expected[:_SHORT_HASH]}...)")
        return f"{self.name} is unreadable ({self.actual})"


@dataclass(frozen=True)
class EntryCheck:
    """Outcome of :func:`check_entry`.

    Attributes:
        entry: the entry directory checked.
        depth: how far the check went.
        records: the recorded files (empty when the manifest is unreadable).
        problems: what differs from the record (empty when intact).
    """

    entry: Path
    depth: Depth
    records: tuple[FileRecord, ...]
    problems: tuple[FileProblem, ...]

    @property
    def status(self) -> str:
        """``"corrupt"`` or ``"ok"``."""
        return "corrupt" if self.problems else "ok"


def fetch_command(name: str, dtype: torch.dtype) -> str:
    """The command that replaces the cache entry of ``name`` in ``dtype``."""
    return (
        f"selfspec models fetch {name} --dtype {_CLI_DTYPE.get(dtype, dtype_name(dtype))} --force"
    )


def hash_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``.

    Raises:
        OSError: the file cannot be read.
    """
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_files(entry: Path) -> dict[str, dict[str, int | str]]:
    """Size and sha256 of every file under ``entry`` but the manifest and the stamp, for the
    manifest.

    Returns:
        ``{relative posix path: {"size": bytes, "sha256": hex}}``, sorted by path.

    Raises:
        OSError: a file cannot be read.
    """
    files = sorted(p for p in entry.rglob("*") if p.is_file() and p.name not in _NOT_RECORDED)
    return {
        p.relative_to(entry).as_posix(): {"size": p.stat().st_size, "sha256": hash_file(p)}
        for p in files
    }


def check_entry(entry: Path, depth: Depth) -> EntryCheck:
    """Compare the files of cache entry ``entry`` with its manifest's record, as far as ``depth``
    says.

    Never raises for a damaged entry: a missing or unparsable manifest, a missing, resized or
    changed file are all reported in :attr:`EntryCheck.problems`.
    """
    try:
        records = _read_records(entry / MANIFEST_NAME)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        return EntryCheck(
            entry, depth, (), (FileProblem(MANIFEST_NAME, "unreadable", actual=str(err)),)
        )
    stamps = _read_stamp(entry) if depth is Depth.LOAD else {}
    fresh: dict[str, dict[str, int | str]] = {}
    problems = []
    for record in records:
        path = entry / record.name
        try:
            stat = path.stat()
        except OSError:
            problems.append(FileProblem(record.name, "missing"))
            continue
        if stat.st_size != record.size:
            problems.append(FileProblem(record.name, "size", str(record.size), str(stat.st_size)))
            continue
        if depth is Depth.SIZES or (
            depth is Depth.LOAD and record.size >= HASH_ALWAYS_BYTES
            and _stamp_vouches(stamps.get(record.name), stat, record.sha256)
        ):
            continue
        checked_ns = time.time_ns()
        try:
            actual = hash_file(path)
        except OSError as err:
            problems.append(FileProblem(record.name, "unreadable", actual=str(err)))
            continue
        if actual != record.sha256:
            problems.append(FileProblem(record.name, "sha256", record.sha256, actual))
        elif record.size >= HASH_ALWAYS_BYTES and stat.st_ctime_ns < checked_ns - RACY_WINDOW_NS:
            fresh[record.name] = {**_stat_fields(stat), "sha256": actual, "checked_ns": checked_ns}
    if fresh:
        _write_stamp(entry, {**_read_stamp(entry), **fresh})
    return EntryCheck(entry, depth, records, tuple(problems))


def require_intact(entry: Path, name: str, dtype: torch.dtype) -> EntryCheck:
    """Check ``entry`` (the cache entry of registry model ``name`` in ``dtype``) before it is
    loaded.

    Raises:
        CorruptModelFileError: a recorded file is missing, has another size or another sha256, or
            the manifest is unreadable; the message names the file and the command that re-fetches.
    """
    check = check_entry(entry, Depth.LOAD)
    if check.problems:
        raise CorruptModelFileError(
            f"the cache entry of {name} ({dtype_name(dtype)}) at {entry} is damaged: "
            f"{'; '.join(p.describe() for p in check.problems)}. "
            f"Run `{fetch_command(name, dtype)}` to fetch "
            "it again (`selfspec models verify` checks every cached entry)."
        )
    return check


def _read_records(manifest_path: Path) -> tuple[FileRecord, ...]:
    """The manifest's file records.

    Raises:
        OSError, ValueError, TypeError, KeyError, AttributeError: the manifest is missing, not
            JSON, records no files, or records them in another shape.
    """
    manifest = json.loads(manifest_path.read_text())
    files = manifest.get("files")
    if files is None:
        raise ValueError("the manifest records no files")
    records = tuple(FileRecord(str(n), int(v["size"]), str(v["sha256"])) for n, v in files.items())
    if not records:
        raise ValueError("the manifest's file list is empty")
    for record in records:  # names stay inside the entry
        if Path(record.name).is_absolute() or ".." in Path(record.name).parts:
            raise ValueError(f"the manifest names a file outside the entry: {record.name!r}")
    return records


def _stat_fields(stat: os.stat_result) -> dict[str, int]:
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
    }


def _stamp_vouches(stamp: object, stat: os.stat_result, sha256: str) -> bool:
    """Whether ``stamp`` says the file, unchanged since (``stat``), hashed to ``sha256`` after it
    settled."""
    if not isinstance(stamp, dict) or stamp.get("sha256") != sha256:
        return False
    fields = _stat_fields(stat)
    checked_ns = stamp.get("checked_ns")
    return (all(stamp.get(key) == value for key, value in fields.items())
            and isinstance(checked_ns, int)
            and stat.st_ctime_ns < checked_ns - RACY_WINDOW_NS)


def _read_stamp(entry: Path) -> dict[str, dict[str, int | str]]:
    """The stamp file's records; empty when it is missing or unreadable (files are then hashed)."""
    try:
        stamps = json.loads((entry / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _write_stamp(entry: Path, stamps: dict[str, dict[str, int | str]]) -> None:
    """Replace the stamp file in one step; a failure (read-only cache) only means hashing next
    time."""
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(dir=entry, prefix=f".{STAMP_NAME}.")
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            json.dump(stamps, f, indent=1)
        os.replace(tmp, entry / STAMP_NAME)
    except OSError as err:
        logger.debug(
            "cannot write %s in %s (%s); large files will be hashed on every load",
            STAMP_NAME, entry, err,
        )
        if tmp is not None:
            tmp.unlink(missing_ok=True)
