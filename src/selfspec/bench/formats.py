"""``selfspec bench-cpu``: what the choice of number formats does on this CPU.

For one model and weight dtype it measures, in one process, each kind of work twice: with
every matrix product in the weights' format (what selfspec did before it chose formats per
shape) and with the automatic choice (:mod:`selfspec.executor.cpu`):

- prefill tokens/s for prompts of the given lengths (random token ids; speed does not depend
  on the text; best of up to 3 runs within 10 s),
- ``ar`` decoding tokens/s after a short real prompt (prefill excluded; median of 3),
- one ``selfspec heads train`` optimiser step (seconds; four lightweight heads at
  ``floor(k·L/5)``, 256 tokens, KL over the full vocabulary: the CLI's defaults), with bf16
  autocast (before) and the automatic compute dtype (after), plus the float32 reference,
- batched on-policy generation tokens/s (16 prompts).

With ``--isa native,avx2`` the same measurement also runs in a child process restricted to
AVX2 kernels (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``), so the behaviour of CPUs
without native bf16 can be measured on a machine that has it (issue "Fast on every CPU").
The switches restrict oneDNN and ATen only: FBGEMM (the fp16 decoding kernel) keeps the
machine's own instructions, and PyTorch still sends bf16 products to oneDNN where the CPU has
AVX-512 (oneDNN then runs them with AVX2 conversions, cheaper than a real AVX2-only CPU's
emulation), so the restricted run approximates such a CPU rather
than equals it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from selfspec.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

ISA_ENV = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
DECODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@dataclass
class FormatTimings:
    """One configuration's measurements (``nan`` = not measured).

    Attributes:
        label: ``"weights format"`` (before) or ``"auto"`` (after).
        formats: :meth:`ComputeFormats.describe` of the executor.
        train_compute: compute dtype of the training step.
        prefill_tok_s: ``{prompt length: tokens/s}``.
        decode_tok_s: ``ar`` tokens/s after the prefill.
        train_step_s: seconds per heads-training step.
        onpolicy_tok_s: batched greedy generation tokens/s (all rows).
    """

    label: str
    formats: str
    train_compute: str
    prefill_tok_s: dict[int, float] = field(default_factory=dict)
    decode_tok_s: float = math.nan
    train_step_s: float = math.nan
    onpolicy_tok_s: float = math.nan


@dataclass
class FormatsReport:
    """Everything one ``bench-cpu`` process measured.

    Attributes:
        isa: ``"native"`` or ``"avx2"`` (the kernel restriction in force).
        model / dtype / threads: what ran.
        cpu: :meth:`CpuInfo.to_dict`.
        rows: before and after.
        fp32_train_step_s: the training step in float32 (reference for the target).
    """

    isa: str
    model: str
    dtype: str
    threads: int
    cpu: dict[str, object]
    rows: list[FormatTimings]
    fp32_train_step_s: float = math.nan


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def measure_prefill(executor: object, length: int, seed: int = 0, budget_s: float = 10.0) -> float:
    """Tokens/s of a prefill of ``length`` random tokens (after a 16-token warm-up): the best
    of up to 3 runs while the time spent stays under ``budget_s``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, executor.vocab_size, (1, length), generator=gen)
    pos = torch.arange(length).unsqueeze(0)
    executor.forward(ids[:, :16], pos[:, :16], executor.new_cache(1, 16), last_only=True)
    times: list[float] = []
    while len(times) < 3 and (not times or sum(times) + times[0] <= budget_s):
        times.append(_timed(lambda: executor.forward(ids, pos, executor.new_cache(1, length),
                                                     last_only=True)))
    return length / min(times)


def measure_decode(engine: object, new_tokens: int, repeats: int = 3) -> float:
    """``ar`` tokens/s after the prefill, on :data:`DECODE_PROMPT` (greedy): the median of
    ``repeats`` generations (one-token decoding is short and noisy)."""
    engine.generate(DECODE_PROMPT, method="ar", max_new_tokens=4, chat=True)  # warm-up
    rates = []
    for _ in range(repeats):
        stats = engine.generate(DECODE_PROMPT, method="ar", max_new_tokens=new_tokens,
                                chat=True).stats
        seconds = (stats.total_ms - stats.ttft_ms) / 1e3
        rates.append((stats.new_tokens - 1) / seconds if seconds > 0 else math.nan)
    return statistics.median(rates)


def measure_train_step(engine: object, compute_dtype: str, steps: int = 3,
                       batch_tokens: int = 256, features_fp32: bool = False) -> float:
    """Seconds per heads-training optimiser step (mean of ``steps`` after a warm-up step),
    on random hidden states shaped as the model's (the cost does not depend on the values)."""
    from selfspec.heads.modules import output_layer
    from selfspec.training.corpus import TRAIN
    from selfspec.training.features import FeatureSet
    from selfspec.training.train import TrainConfig, train_heads

    ex = engine.executor
    layers = [k * ex.num_layers // 5 for k in range(1, 5)]
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if features_fp32 else ex.dtype
    hidden_size = engine.model.config.hidden_size

    def random_features(n: int) -> FeatureSet:
        def states() -> torch.Tensor:
            return torch.randn(n, hidden_size, generator=gen).to(dtype)

        return FeatureSet(
            hidden={layer: states() for layer in layers}, final=states(),
            teacher_token=torch.randint(0, ex.vocab_size, (n,), generator=gen),
            labels=torch.randint(0, ex.vocab_size, (n,), generator=gen),
            split=torch.full((n,), TRAIN, dtype=torch.int8),
            source=torch.zeros(n, dtype=torch.int16), sources=["random"])

    config = TrainConfig(epochs=1, batch_tokens=batch_tokens, compute_dtype=compute_dtype,
                         lr=1e-4)
    train_heads(output_layer(engine), random_features(batch_tokens), layers, config,
                progress=False, eval_splits=())  # warm-up step, not timed
    timed = train_heads(output_layer(engine), random_features(batch_tokens * steps), layers,
                        config, progress=False, eval_splits=())
    return timed.seconds / max(timed.steps, 1)


def measure_onpolicy(engine: object, batch: int = 16, new_tokens: int = 32) -> float:
    """Batched greedy generation tokens/s (``batch`` chat prompts × ``new_tokens``)."""
    from selfspec.training.onpolicy import generate_greedy_batch

    prompts = [engine.encode(f"Write a Python function number {i} that sorts a list.", chat=True)
               for i in range(batch)]
    generate_greedy_batch(engine, prompts[:2], 2)  # warm-up
    start = time.perf_counter()
    out = generate_greedy_batch(engine, prompts, new_tokens)
    return sum(len(o) for o in out) / (time.perf_counter() - start)


def measure(model: str | None, dtype: str, lengths: Sequence[int], decode_tokens: int = 64,
            train_steps: int = 3, onpolicy: bool = True, isa: str = "native") -> FormatsReport:
    """Measure before (weights format) and after (automatic formats) in this process.

    Raises:
        InvalidArgumentError: a prompt length outside ``[16, context]``.
    """
    import selfspec
    from selfspec.executor.cpu import detect_cpu, fast_matmul_dtype

    engine = selfspec.load(model, dtype=dtype, show_progress=False)
    ex = engine.executor
    for length in lengths:
        if not 16 <= length <= ex.max_positions:
            raise InvalidArgumentError(
                f"prompt length {length} is outside [16, {ex.max_positions}] for {engine.name}")
    rows = []
    # "before" is every product in the weights' format, decoding included: the fp16 decoding
    # kernel (issue "executor") came after this comparison's baseline and also serves bulk
    # calls, so it must be off there too.
    for label, bulk, compute in (
        ("weights format", "weights", "bf16" if dtype == "bf16" else "fp32"),
        ("auto", "auto", fast_matmul_dtype()),
    ):
        formats = ex.set_bulk(bulk, rows=bulk)
        row = FormatTimings(label, formats.describe(), compute)
        logger.info("measuring %s: %s", label, row.formats)
        for length in lengths:
            row.prefill_tok_s[length] = measure_prefill(ex, length)
            logger.info("  prefill %d: %.0f tok/s", length, row.prefill_tok_s[length])
        row.decode_tok_s = measure_decode(engine, decode_tokens)
        if train_steps:
            row.train_step_s = measure_train_step(engine, compute, train_steps)
        if onpolicy:
            row.onpolicy_tok_s = measure_onpolicy(engine)
        logger.info("  decode %.1f tok/s, train step %.2f s, on-policy %.1f tok/s",
                    row.decode_tok_s, row.train_step_s, row.onpolicy_tok_s)
        rows.append(row)
    ex.set_bulk("auto", rows="auto")
    fp32_step = (measure_train_step(engine, "fp32", train_steps, features_fp32=True)
                 if train_steps else math.nan)
    return FormatsReport(isa=isa, model=engine.name, dtype=dtype, threads=torch.get_num_threads(),
                         cpu=detect_cpu().to_dict(), rows=rows, fp32_train_step_s=fp32_step)


def run_isa(isa: str, argv: Sequence[str], out: Path) -> FormatsReport:
    """Run ``selfspec bench-cpu argv --isa native --json OUT`` in a child process with the
    kernel restriction of ``isa`` (:data:`ISA_ENV`) and read its report.

    Raises:
        InvalidArgumentError: unknown ``isa``; RuntimeError: the child failed.
    """
    if isa not in ISA_ENV:
        raise InvalidArgumentError(f"--isa must be among {sorted(ISA_ENV)}, got {isa!r}")
    env = {**os.environ, **ISA_ENV[isa]}
    cmd = [sys.executable, "-m", "selfspec.cli", "bench-cpu", *argv, "--isa", "native",
           "--json", str(out), "--label", isa]
    logger.info("running %s with %s", " ".join(cmd), ISA_ENV[isa] or "no restriction")
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench-cpu under --isa {isa} failed (exit {done.returncode})")
    return load_report(out)


def save_report(report: FormatsReport, path: Path) -> None:
    """Write ``report`` as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2) + "\n")


def load_report(path: Path) -> FormatsReport:
    """Read a report written by :func:`save_report`."""
    data = json.loads(path.read_text())
    rows = [FormatTimings(**{**r, "prefill_tok_s": {int(k): v
                                                    for k, v in r["prefill_tok_s"].items()}})
            for r in data.pop("rows")]
    return FormatsReport(rows=rows, **data)


def _fmt(value: float, digits: int = 0) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown(reports: Sequence[FormatsReport]) -> str:
    """One table over all reports: a row per (ISA, before/after), then the ratios."""
    if not reports:
        return ""
    lengths = sorted({n for r in reports for row in r.rows for n in row.prefill_tok_s})
    head = (["kernels", "formats", *[f"prefill {n} tok/s" for n in lengths], "decode tok/s",
             "train step s (compute)", "on-policy tok/s"])
    first = reports[0]
    lines = [f"model `{first.model}`, weights {first.dtype}, {first.threads} threads", ""]
    for r in reports:
        cpu = r.cpu
        lines.append(f"- {r.isa}: {cpu.get('model') or cpu.get('arch')}, ATen "
                     f"{cpu.get('aten_capability')}"
                     + (f", ONEDNN_MAX_CPU_ISA={cpu['onednn_max_isa']}"
                        if cpu.get('onednn_max_isa') else "")
                     + f", flags {' '.join(cpu.get('flags') or ()) or 'none'}, "
                     "bf16 matrix products "
                     f"{'native' if cpu.get('native_bf16') else 'emulated'}; float32 training "
                     f"step {_fmt(r.fp32_train_step_s, 2)} s")
    lines += ["", "| " + " | ".join(head) + " |", "|" + " --- |" * 2 + " ---: |" * (len(head) - 2)]
    for r in reports:
        for row in r.rows:
            lines.append("| " + " | ".join([
                r.isa, f"{row.label}: {row.formats}",
                *[_fmt(row.prefill_tok_s.get(n, math.nan)) for n in lengths],
                _fmt(row.decode_tok_s, 1), f"{_fmt(row.train_step_s, 2)} ({row.train_compute})",
                _fmt(row.onpolicy_tok_s, 1)]) + " |")
        if len(r.rows) == 2:
            before, after = r.rows

            def ratio(a: float, b: float) -> str:
                return "–" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}×"

            lines.append("| " + " | ".join([
                r.isa, "**after / before**",
                *[ratio(after.prefill_tok_s.get(n, math.nan), before.prefill_tok_s.get(n, math.nan))
                  for n in lengths],
                ratio(after.decode_tok_s, before.decode_tok_s),
                ratio(before.train_step_s, after.train_step_s) + " faster",
                ratio(after.onpolicy_tok_s, before.onpolicy_tok_s)]) + " |")
    return "\n".join(lines) + "\n"
