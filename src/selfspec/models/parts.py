"""A model file in parts, for machines that can only receive files of a limited size (a
GPU machine without network, reached through transfers of at most 64 MiB each).

``selfspec models pack NAME --part-mib 60 --out DIR`` splits a registry model's verified
GGUF (``selfspec models fetch NAME --gguf``) into ``DIR/<file>.partNN`` and writes
``DIR/manifest.json`` (the file's name, size and sha256, each part's size and sha256, the
registry model it came from). On the other side :func:`join_parts` checks every part
against the manifest, joins them and checks the whole file; :func:`unpack_model` then
converts the GGUF into a model directory ``selfspec.load`` takes
(:func:`selfspec.models.provision.convert_gguf`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from selfspec.errors import ChecksumError, InvalidArgumentError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Part:
    """One part: its file name (in the manifest's directory), bytes and sha256."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class PartsManifest:
    """What :func:`pack_file` wrote."""

    name: str            # the registry model (or the file's stem)
    file: str            # the joined file's name
    bytes: int
    sha256: str
    parts: tuple[Part, ...]

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, directory: Path) -> PartsManifest:
        """The manifest in ``directory``.

        Raises:
            InvalidArgumentError: no readable manifest there.
        """
        try:
            data = json.loads((Path(directory) / MANIFEST).read_text())
            data["parts"] = tuple(Part(**p) for p in data["parts"])
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise InvalidArgumentError(
                f"{directory} holds no readable {MANIFEST} of model parts ({err}); make one "
                "with `selfspec models pack NAME --out DIR`") from None


def pack_file(path: Path, out_dir: Path, part_bytes: int, name: str | None = None) -> PartsManifest:
    """Split ``path`` into parts of at most ``part_bytes`` in ``out_dir`` with a manifest.

    Raises:
        InvalidArgumentError: ``part_bytes < 1`` or ``path`` missing.
    """
    path, out_dir = Path(path), Path(out_dir)
    if part_bytes < 1:
        raise InvalidArgumentError(f"a part must hold at least one byte; got {part_bytes}")
    if not path.is_file():
        raise InvalidArgumentError(f"{path} is not a file")
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    parts = []
    with path.open("rb") as f:
        index = 0
        while True:
            data = f.read(part_bytes)
            if not data:
                break
            whole.update(data)
            part = out_dir / f"{path.name}.part{index:02d}"
            part.write_bytes(data)
            parts.append(Part(part.name, len(data), hashlib.sha256(data).hexdigest()))
            index += 1
    manifest = PartsManifest(name or path.stem, path.name, path.stat().st_size,
                             whole.hexdigest(), tuple(parts))
    (out_dir / MANIFEST).write_text(manifest.to_json())
    return manifest


def missing_parts(directory: Path) -> list[str]:
    """Parts the manifest in ``directory`` names that are not there (or have another size);
    ``[MANIFEST]`` when it is missing itself."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        return [MANIFEST]
    manifest = PartsManifest.read(directory)
    return [p.file for p in manifest.parts
            if not (directory / p.file).is_file() or (directory / p.file).stat().st_size != p.bytes]


def join_parts(directory: Path, out: Path | None = None) -> Path:
    """Check every part of ``directory``'s manifest, join them into ``out`` (default: the
    manifest's file name in ``directory``) and check the whole file's sha256.

    Raises:
        InvalidArgumentError: no manifest, or a part is missing.
        ChecksumError: a part or the joined file differs from the manifest.
    """
    directory = Path(directory)
    manifest = PartsManifest.read(directory)
    missing = missing_parts(directory)
    if missing:
        raise InvalidArgumentError(f"{directory}: parts missing or short: {', '.join(missing)}")
    out = Path(out) if out is not None else directory / manifest.file
    whole = hashlib.sha256()
    tmp = out.with_name(out.name + ".joining")
    with tmp.open("wb") as f:
        for part in manifest.parts:
            data = (directory / part.file).read_bytes()
            if hashlib.sha256(data).hexdigest() != part.sha256:
                tmp.unlink()
                raise ChecksumError(f"{part.file}: sha256 differs from the manifest "
                                    "(copy it again)")
            whole.update(data)
            f.write(data)
    if whole.hexdigest() != manifest.sha256:
        tmp.unlink()
        raise ChecksumError(f"{manifest.file}: the joined parts' sha256 differs from the "
                            "manifest")
    tmp.replace(out)
    return out


def pack_model(name: str, out_dir: Path, part_mib: int = 60) -> PartsManifest:
    """``selfspec models pack``: the registry model ``name``'s verified GGUF (fetched if
    not kept yet) in parts of ``part_mib`` MiB.

    Raises:
        ModelNotFoundError: not a registry model; ProvisioningError: fetching failed.
    """
    from selfspec.models.gguf_cache import fetch_gguf
    from selfspec.models.registry import get_spec

    spec = get_spec(name)
    path = Path(fetch_gguf(spec.name))
    manifest = pack_file(path, out_dir, part_mib << 20, spec.name)
    if manifest.sha256 != spec.sha256:
        raise ChecksumError(f"{path}: sha256 differs from the registry's for {spec.name}")
    return manifest


def unpack_model(directory: Path, out_dir: Path, dtype: str = "bf16") -> Path:
    """Join and verify the parts in ``directory``, convert the GGUF into a model directory
    ``out_dir`` (``selfspec.load(str(out_dir))`` takes it); returns ``out_dir``. Needs the
    ``gguf`` and ``accelerate`` packages (no network).

    Raises:
        InvalidArgumentError, ChecksumError: see :func:`join_parts`.
        ProvisioningError, CorruptModelFileError: the conversion failed.
    """
    from selfspec.models.common import parse_dtype
    from selfspec.models.provision import convert_gguf

    manifest = PartsManifest.read(directory)
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    gguf = join_parts(directory)
    convert_gguf(gguf, out_dir, parse_dtype(dtype), source=manifest.name, show_progress=False)
    return out_dir
