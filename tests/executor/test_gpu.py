"""selfspec on GPUs, the device-generic part (docs/gpu.md): ``--device`` checks, one host
sync per step, the CUDA-graph runner's logic on the CPU, device-aware draft formats and
latency keys, schedule record/replay, the GPU check script's dry run. Tests marked ``cuda``
run only where a GPU is."""

from __future__ import annotations

import importlib.util
import json
import types
import warnings
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.cli import build_parser, device_kernels
from selfspec.decoding.core.sampling import choose_next
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.errors import ChecksumError, InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cache import CacheFullError, CacheShape, KVCache
from selfspec.executor.cuda_graphs import (
    CudaGraphRunner,
    attach_graphs,
    check_cuda_graphs,
    graph_sizes,
    static_forward,
)
from selfspec.executor.quant import check_draft_weights, draft_formats_on
from selfspec.executor.sync import SyncCounter, first_position, position_block
from selfspec.methods.registry import get_method
from selfspec.validation import check_device, check_device_memory

from tiny import VOCAB, steady_latency, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7] * 3
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------- device checks
def test_check_device_names_every_device_and_refuses_bad_ones():
    assert check_device("auto", cuda_available=False) == torch.device("cpu")
    assert check_device("auto", cuda_available=True) == torch.device("cuda", 0)
    assert check_device(" CPU ") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    assert check_device("cuda:1", cuda_available=True, device_count=2) == torch.device("cuda", 1)
    for bad in ("gpu", "cuda:x", "cuda:", "cuda:-1", "mps", ""):
        with pytest.raises(InvalidArgumentError, match="device must be one of"):
            check_device(bad, cuda_available=True, device_count=1)
    with pytest.raises(InvalidArgumentError, match="device must be one of"):
        check_device(3)
    with pytest.raises(InvalidArgumentError, match=r"no CUDA device: torch.cuda.is_available\(\) "
                                                   "is False; use --device cpu"):
        check_device("cuda", cuda_available=False)
    with pytest.raises(InvalidArgumentError, match="there is no GPU 2; this machine has 2"):
        check_device("cuda:2", cuda_available=True, device_count=2)


def test_a_model_that_does_not_fit_the_gpu_is_refused_before_it_moves():
    gib = 1 << 30
    check_device_memory(torch.device("cuda", 0), 4 * gib, free_bytes=10 * gib)
    with pytest.raises(InvalidArgumentError, match="does not fit on cuda:0.*16.00 GiB"):
        check_device_memory(torch.device("cuda", 0), 16 * gib, free_bytes=10 * gib)
    check_device_memory(torch.device("cpu"), 1 << 50)  # CPUs are not checked here


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_gpu_fails_before_anything_loads(monkeypatch):
    from selfspec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(InvalidArgumentError, match="no CUDA device"):
        selfspec.load("smollm2-135m-instruct", device="cuda")
    with pytest.raises(InvalidArgumentError, match="no CUDA device"):
        selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), device="cuda")
    with pytest.raises(InvalidArgumentError, match="cuda_graphs must be one of"):
        selfspec.load("smollm2-135m-instruct", device="cpu", cuda_graphs="yes")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--device", "cuda"])


def test_device_reaches_the_engine_and_every_command_takes_it():
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), "tiny",
                                            device="cpu")
    assert engine.device == engine.executor.device == torch.device("cpu")
    assert engine.executor.graphs is None  # never on the CPU
    out = engine.generate(PROMPT, "ngram", max_new_tokens=8)
    assert out.token_ids == engine.generate(PROMPT, "ar", max_new_tokens=8).token_ids
    parser = build_parser()
    for argv in (["generate", "hi"], ["bench"], ["serve"], ["heads", "train"],
                 ["models", "latency"], ["info"]):
        args = parser.parse_args([*argv, "--device", "cpu"])
        assert args.device == "cpu", argv
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--device", "cuda:x"])


def test_info_says_which_kernels_run_on_a_gpu(monkeypatch):
    cpu = "\n".join(device_kernels(torch.device("cpu")))
    assert "quantized draft formats" in cpu and "off (CUDA only)" in cpu
    assert "bf16 kernel (--decode-kernel bf16" in cpu  # its build, or why it is unavailable
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (100 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    gpu = "\n".join(device_kernels(torch.device("cuda", 0)))
    assert "NVIDIA H200" in gpu and "none on cuda" in gpu
    assert "do not run on cuda" in gpu and "torch.argmax" in gpu and "CUDA graphs" in gpu


def test_quantized_draft_formats_are_cpu_only():
    assert draft_formats_on("cuda") == []
    with pytest.raises(InvalidArgumentError, match="CPU only"):
        check_draft_weights("int8", torch.device("cuda", 0))


def test_latency_key_holds_the_device_so_cpu_and_gpu_timings_never_mix(monkeypatch):
    from selfspec.executor import cost_model

    cpu_ex = LayerExecutor(tiny_model("llama"))
    cpu_key = cost_model.machine_key(cpu_ex)
    monkeypatch.setattr(cost_model, "device_name", lambda device: "NVIDIA_H200")
    gpu_ex = types.SimpleNamespace(name=cpu_ex.name, config=cpu_ex.config, formats=None,
                                   draft_weights=None, dtype=cpu_ex.dtype, graphs=None,
                                   device=torch.device("cuda", 0))
    gpu_key = cost_model.machine_key(gpu_ex)
    assert gpu_key.endswith("-cuda-NVIDIA_H200") and gpu_key != cpu_key
    assert "cuda" not in cpu_key


# ------------------------------------------------------------------- one sync per step
def _state(engine, method):
    step = get_method(method).make_step(engine.methods, {})
    state = DecodeState(engine.executor, PROMPT, DecodeOptions(max_new_tokens=40))
    logits = state.prefill()
    state.commit([int(choose_next(logits, state.options.sampling, state.generator)[0])])
    step.start(state)
    return step, state


@torch.inference_mode()
def test_a_step_of_ar_or_ngram_copies_to_the_host_once():
    """Counting stand-in for CUDA's sync debug mode: every .item/.tolist/int()/bool()/.cpu
    on any tensor during one step. ar and ngram (verification included) need exactly one:
    the committed tokens (executor/sync.py: to_host); an early-exit drafter reads each draft
    token as it goes (its stop rule needs it), so layerskip needs D + 1."""
    engine = selfspec.from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), "tiny",
                                            device="cpu")
    for method in ("ar", "ngram"):
        step, state = _state(engine, method)
        drafted = 0
        for _ in range(5):
            with SyncCounter() as counter:
                stats = step(state)
            drafted += stats.num_drafted
            assert counter.total == 1, (method, dict(counter.counts))
        if method == "ngram":
            assert drafted > 0  # the repetitive prompt gives drafts: verification was counted
    step, state = _state(engine, "layerskip")
    for _ in range(3):
        with SyncCounter() as counter:
            stats = step(state)
        assert counter.total == stats.num_drafted + 1, dict(counter.counts)


def test_position_blocks_carry_their_start_on_the_host():
    block = position_block(7, 3, "cpu")
    assert block.tolist() == [[7, 8, 9]]
    with SyncCounter() as counter:
        assert first_position(block) == 7
    assert counter.total == 0
    assert first_position(torch.tensor([[4, 5]])) == 4  # untagged: read (a sync on a GPU)


@cuda
@needs_cuda
@torch.inference_mode()
def test_cuda_step_syncs_at_most_once():  # pragma: no cover - needs a GPU
    model = tiny_model("llama").cuda()
    engine = selfspec.from_pretrained_model(model, tiny_tokenizer(), "tiny", device="cuda")
    for method in ("ar", "ngram"):
        step, state = _state(engine, method)
        step(state)  # first calls: lazy inits, graph capture
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(state)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) <= 1, (method, [str(w.message) for w in syncs])


# ------------------------------------------------------------------- CUDA graphs (logic)
def test_graph_options_and_sizes():
    assert graph_sizes(4) == (1, 2, 3, 4)
    with pytest.raises(InvalidArgumentError):
        graph_sizes(0)
    assert check_cuda_graphs("auto", "cpu") == "auto"
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
        check_cuda_graphs("on", "cpu")
    ex = LayerExecutor(tiny_model("llama"))
    attach_graphs(ex, "auto")
    assert ex.graphs is None
    with pytest.raises(InvalidArgumentError, match="CUDA graphs need the model on a CUDA"):
        CudaGraphRunner(ex, replay="cuda")


def test_a_fixed_cache_never_reallocates():
    cache = KVCache(CacheShape(2, 1, 2, 4), torch.float32, "cpu", capacity=8, fixed=True)
    keys, _ = cache.storage()
    assert all(bool((k == 0).all()) for k in keys)  # zeroed: a graph reads every slot
    cache.hold(0, 6)
    assert cache.lengths() == [6, 6]
    with pytest.raises(CacheFullError):
        cache.hold(6, 3)
    cache.truncate(2)
    cache.claim(0, 2, 1)
    with pytest.raises(AssertionError):
        cache.hold(2, 1)  # layers of different lengths
    assert cache.storage()[0] is keys


@torch.inference_mode()
def test_static_forward_matches_the_eager_forward():
    ex = LayerExecutor(tiny_model("qwen2"))
    runner = CudaGraphRunner(ex, capacity=64, max_tokens=4, replay="eager")
    cache = ex.new_cache(capacity=64)
    ids = torch.tensor([PROMPT[:12]])
    ex.forward(ids[:, :9], position_block(0, 9, "cpu"), cache)
    want = ex.forward(ids[:, 9:], position_block(9, 3, "cpu"), cache)
    static = runner.cache
    ex.forward(ids[:, :9], position_block(0, 9, "cpu"), static)  # eager prefill, same cache
    keys, values = static.storage()
    got = static_forward(ex, ids[:, 9:], position_block(9, 3, "cpu"), keys, values,
                         torch.arange(64), ex.rope.cos, ex.rope.sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_graph_runner_replays_decoding_and_verification_and_counts_fallbacks():
    """The runner's bookkeeping on the CPU (replay="eager" stands in for a graph): greedy
    output equals the eager executor's, one-token steps and short verification blocks
    replay, the prefill and blocks beyond the captured sizes run eagerly, counted."""
    ex = LayerExecutor(tiny_model("llama"))
    engine = steady_latency(selfspec.from_pretrained_model(ex.model, tiny_tokenizer(), "tiny",
                                                           device="cpu"))
    want = {m: engine.generate(PROMPT, m, max_new_tokens=30).token_ids for m in ("ar", "ngram")}
    runner = CudaGraphRunner(engine.executor, capacity=256, max_tokens=3, replay="eager")
    engine.executor.graphs = runner
    try:
        for method in ("ar", "ngram"):
            got = engine.generate(PROMPT, method, max_new_tokens=30).token_ids
            assert got == want[method], method
    finally:
        engine.executor.graphs = None
    stats = runner.stats
    assert stats.replays[1] > 0 and set(stats.captured) <= {1, 2, 3}
    assert stats.fallbacks["prefill"] == 2
    assert any(reason.startswith("block of") for reason in stats.fallbacks)  # long drafts
    assert json.dumps(stats.to_dict())


def test_the_static_cache_serves_one_generation_at_a_time():
    ex = LayerExecutor(tiny_model("llama"))
    runner = CudaGraphRunner(ex, capacity=128, max_tokens=2, replay="eager")
    first = types.SimpleNamespace(done=False)
    assert runner.decode_cache(32, first) is runner.cache
    assert runner.decode_cache(32, types.SimpleNamespace(done=False)) is None
    first.done = True
    assert runner.decode_cache(32, types.SimpleNamespace(done=False)) is runner.cache
    assert runner.decode_cache(100, types.SimpleNamespace(done=False)) is None  # + overshoot
    assert runner.stats.fallbacks["static cache in use"] == 1
    assert runner.why_eager(1, 5, ex.new_cache(), 1, None) == "not the static cache"


# ------------------------------------------------------------------- schedules
def test_a_schedule_recorded_here_replays_with_the_same_tokens(tmp_path, monkeypatch):
    from selfspec.bench import schedule as schedule_module
    from selfspec.bench.schedule import Schedule, record_schedule, replay_schedule

    engine = steady_latency(selfspec.from_pretrained_model(tiny_model("llama"),
                                                           tiny_tokenizer(), "tiny",
                                                           device="cpu"))
    synced = []  # each replayed step's one host sync: the verification's argmax per fed token
    real_to_host = schedule_module.to_host
    monkeypatch.setattr(schedule_module, "to_host",
                        lambda t: synced.append(real_to_host(t)) or synced[-1])
    for method in ("ngram", "layerskip", "ar"):
        schedule = record_schedule(engine, PROMPT, method, max_new_tokens=24)
        assert sum(s.committed for s in schedule.steps) + 1 == len(schedule.output_ids)
        assert any(s.drafted for s in schedule.steps) == (method != "ar"), method
        loaded = Schedule.from_json(schedule.save(tmp_path / f"{method}.json").read_text())
        assert loaded == schedule
        synced.clear()
        timing = replay_schedule(engine.executor, loaded)
        assert timing.new_tokens == len(schedule.output_ids)
        assert len(timing.step_ms) == len(schedule.steps) and timing.tokens_per_s > 0
        # the replay computes the recorded tokens: each step's verification predicts the
        # tokens it commits (the first comes from the prefill)
        replayed = [schedule.output_ids[0]]
        for step, argmax in zip(schedule.steps, synced, strict=True):
            replayed += argmax[:step.committed]
        assert replayed == schedule.output_ids, method


# ------------------------------------------------------------------- parts and the script
def test_model_parts_join_only_when_every_part_is_intact(tmp_path):
    from selfspec.models.parts import join_parts, missing_parts, pack_file

    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 41)
    manifest = pack_file(source, tmp_path / "parts", part_bytes=4000, name="m")
    assert len(manifest.parts) == 3 and missing_parts(tmp_path / "parts") == []
    joined = join_parts(tmp_path / "parts", tmp_path / "joined.gguf")
    assert joined.read_bytes() == source.read_bytes()
    (tmp_path / "parts" / manifest.parts[1].file).write_bytes(b"x" * 4000)
    with pytest.raises(ChecksumError):
        join_parts(tmp_path / "parts", tmp_path / "again.gguf")
    (tmp_path / "parts" / manifest.parts[2].file).unlink()
    assert missing_parts(tmp_path / "parts") == [manifest.parts[2].file]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    status = script.main(["--out", str(tmp_path), "--device", "cpu", "--dry-run",
                          "--parity-methods", "ngram,layerskip",
                          "--timed-methods", "ar,ngram,hf-ar-compiled"])
    assert status == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {r["status"] for r in report["parity"]} == {"ok"}
    assert {r["dtype"] for r in report["parity"]} == {"fp32", "bf16"}
    rows = {(r["model"], r["method"]): r for r in report["timings"]}
    assert rows[("llama-3-8b-random", "ar")]["status"] == "ok"
    assert rows[("llama-3-8b-random", "ngram")]["same_as_ar"] is True
    compiled = rows[("qwen2.5-coder-1.5b-random", "hf-ar-compiled")]
    assert compiled["status"] == "skipped" and "CUDA only" in compiled["error"]
    assert "| ngram |" in (tmp_path / "gpu_check.md").read_text()
    assert VOCAB == 256


def test_bench_table_shows_peak_gpu_memory_only_when_measured():
    from selfspec.bench.memory import PeakGpu
    from selfspec.bench.metrics import MethodSummary
    from selfspec.bench.report import markdown_table

    assert PeakGpu.probe("cpu").read_mib() is None
    cpu = MethodSummary(method="ar", lossless=True)
    assert "peak GPU MiB" not in markdown_table([cpu])
    gpu = MethodSummary(method="ar", lossless=True, peak_gpu_mib=1234.4)
    table = markdown_table([gpu, MethodSummary(method="ngram", lossless=True, failed="boom")])
    header, _, row, failed = table.splitlines()
    assert "peak GPU MiB | status" in header and "| 1234 | ok" in row
    assert header.count("|") == row.count("|") == failed.count("|")
