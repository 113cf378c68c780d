"""What a benchmark run writes: per-prompt JSONL, a summary JSON and a markdown report.

``records.jsonl`` has one line per (method, prompt); besides selfspec's own fields each line
carries Spec-Bench's ``choices[0]`` fields (``new_tokens``, ``wall_time``,
``accept_lengths``) and ``model_id`` = the method, and ``specbench/<method>.jsonl`` holds
one method's lines each, so Spec-Bench's ``evaluation/speed.py`` reads them as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from selfspec.bench.harness import BenchRun, PromptRecord
from selfspec.bench.metrics import MethodSummary
from selfspec.bench.roofline import Roofline
from selfspec.bench.runners import RunOutput
from selfspec.decoding.core.plan_log import PlanRecord
from selfspec.errors import InvalidArgumentError


@dataclass(frozen=True)
class MachineInfo:
    """Where the run happened.

    Attributes:
        cpu: CPU model name.
        logical_cores: logical CPUs the OS reports.
        torch_threads: torch intra-op threads used for the run.
        platform: OS and architecture.
        python / torch / transformers / selfspec: versions.
        capability: the CPU's number-format abilities (:meth:`CpuInfo.summary`).
    """

    cpu: str
    logical_cores: int
    torch_threads: int
    platform: str
    python: str
    torch: str
    transformers: str
    selfspec: str
    capability: str = ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def collect_machine_info() -> MachineInfo:
    """Describe this machine, its torch thread count and the library versions."""
    import transformers

    from selfspec.executor.cpu import detect_cpu
    from selfspec.version import __version__

    return MachineInfo(cpu=_cpu_model(), logical_cores=os.cpu_count() or 0,
                       torch_threads=torch.get_num_threads(),
                       platform=f"{platform.system()} {platform.release()} {platform.machine()}",
                       python=platform.python_version(), torch=torch.__version__,
                       transformers=transformers.__version__, selfspec=__version__,
                       capability=detect_cpu().summary())


@dataclass(frozen=True)
class RunInfo:
    """The report header: what was run, where, when.

    Attributes:
        model / dtype / dataset: what was benchmarked.
        n: prompts per method; max_new_tokens: per prompt; temperature / seed: sampling.
        machine: CPU, threads and versions.
        roofline: measured bandwidth and weight bytes per token (None if not measured).
        date: ISO 8601 UTC time the run started.
        command: the command line, for reproduction.
        formats: the executor's number formats (:meth:`ComputeFormats.describe`).
        held_out: one line on how the prompts relate to the heads' training data.
        in_sample: True when prompts seen in training/calibration were kept.
        in_sample_prompts / dropped_prompts: ids of the seen prompts, and of those dropped.
        status: ``"complete"``, or ``"interrupted"`` for the partial report of a run that
            stopped early (no accuracy, no plots).
        generations / planned: generations recorded, and planned (methods × prompts).
        sessions: ISO start times of the processes that ran it (more than one: resumed).
        sandbox: what isolated generated code while it was scored (empty: none ran).
        batch_size: prompts generated together (tokens/s is then the aggregate throughput).
        draft_format: what ``draft_weights=auto`` measured on this machine (the format
            chosen and each format's time), empty when no row asked for it.
    """

    model: str
    dtype: str
    dataset: str
    n: int
    max_new_tokens: int
    temperature: float
    seed: int
    machine: MachineInfo
    roofline: Roofline | None
    date: str
    command: str = ""
    top_p: float = 1.0
    held_out: str = ""
    in_sample: bool = False
    in_sample_prompts: list[str] = dataclasses.field(default_factory=list)
    dropped_prompts: list[str] = dataclasses.field(default_factory=list)
    formats: str = ""
    status: str = "complete"
    generations: int = 0
    planned: int = 0
    sessions: list[str] = dataclasses.field(default_factory=list)
    sandbox: str = ""
    batch_size: int = 1
    draft_format: str = ""

    @property
    def partial(self) -> bool:
        """True for the report of an interrupted run."""
        return self.status != "complete"


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def ensure_writable(out_dir: Path) -> Path:
    """Create ``out_dir`` (and parents) and check a file can be written in it.

    Raises:
        InvalidArgumentError: the directory cannot be created or written to.
    """
    probe = out_dir / ".selfspec-write-test"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise InvalidArgumentError(
            f"cannot write benchmark results to {out_dir}: {err.strerror or err}; "
            "pass --out with a writable directory") from None
    return out_dir


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``path`` through a temporary file renamed over it, so a crash leaves the old
    file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def record_json(record: PromptRecord, matches_ar: bool | None) -> dict[str, Any]:
    """One JSONL line: selfspec's fields plus Spec-Bench's ``choices`` / ``model_id``."""
    o = record.output
    return {
        "method": record.method, "model_id": record.method,
        "question_id": record.prompt_id, "prompt_index": record.prompt_index,
        "prompt_tokens": record.prompt_tokens, "new_tokens": record.new_tokens,
        "wall_time": o.wall_time_s, "tokens_per_s": record.tokens_per_s, "ttft_ms": o.ttft_ms,
        "accept_lengths": o.accept_lengths, "drafted": o.drafted, "accepted": o.accepted,
        "verifications": o.verifications, "draft_ms": o.draft_ms, "verify_ms": o.verify_ms,
        "layer_forwards": o.layer_forwards, "finish_reason": o.finish_reason,
        "exit_tokens": o.exit_tokens, "exit_layer_total": o.exit_layer_total,
        "matches_ar": matches_ar, "correct": record.correct,
        "peak_rss_mib": record.peak_rss_mib, "peak_gpu_mib": record.peak_gpu_mib,
        "forced_matches": record.forced_matches, "forced_tokens": record.forced_tokens,
        "plans": [dataclasses.asdict(p) for p in o.plans], "layer_batches": o.layer_batches,
        "exit_counts": o.exit_counts, "predictor_ms": o.predictor_ms, "kv_ms": o.kv_ms,
        "drafter_steps": o.drafter_steps, "token_ids": o.token_ids, "text": o.text,
        "choices": [{"index": 0, "turns": [o.text], "new_tokens": [record.new_tokens],
                     "wall_time": [o.wall_time_s], "accept_lengths": o.accept_lengths}],
    }


def record_from_json(data: dict[str, Any]) -> PromptRecord:
    """The record a :func:`record_json` line holds (``matches_ar`` is not kept: it is
    recomputed from the whole run).

    Raises:
        KeyError, TypeError, ValueError: ``data`` is not such a line.
    """
    output = RunOutput(
        token_ids=[int(t) for t in data["token_ids"]], text=data["text"],
        wall_time_s=data["wall_time"], ttft_ms=data["ttft_ms"],
        accept_lengths=data["accept_lengths"], drafted=data["drafted"],
        accepted=data["accepted"], verifications=data["verifications"],
        draft_ms=data["draft_ms"], verify_ms=data["verify_ms"],
        layer_forwards=data["layer_forwards"], finish_reason=data["finish_reason"],
        exit_tokens=data["exit_tokens"], exit_layer_total=data["exit_layer_total"],
        plans=[PlanRecord(**p) for p in data["plans"]], layer_batches=data["layer_batches"],
        exit_counts=data["exit_counts"], predictor_ms=data["predictor_ms"], kv_ms=data["kv_ms"],
        drafter_steps={str(k): int(v) for k, v in data.get("drafter_steps", {}).items()})
    return PromptRecord(data["method"], data["question_id"], data["prompt_index"],
                        data["prompt_tokens"], output, data.get("correct"),
                        data.get("peak_rss_mib"), data.get("peak_gpu_mib"),
                        data.get("forced_matches"), data.get("forced_tokens"))


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", label)


def write_records(run: BenchRun, parity: dict[tuple[str, str], bool], out_dir: Path) -> list[Path]:
    """Write ``records.jsonl`` and ``specbench/<method>.jsonl`` (methods in run order, each
    method's prompts in prompt order; each file replaced atomically); returns the paths."""
    lines: dict[str, list[str]] = {m: [] for m in run.methods}
    for r in sorted(run.records, key=lambda r: r.prompt_index):
        lines[r.method].append(json.dumps(record_json(r, parity.get((r.method, r.prompt_id)))))
    paths = [write_text_atomic(out_dir / "records.jsonl",
                               "".join(line + "\n" for m in run.methods for line in lines[m]))]
    spec_dir = out_dir / "specbench"
    spec_dir.mkdir(exist_ok=True)
    for method, method_lines in lines.items():
        if method_lines:
            paths.append(write_text_atomic(spec_dir / f"{_safe_name(method)}.jsonl",
                                           "".join(line + "\n" for line in method_lines)))
    return paths


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


TABLE_COLUMNS = ("method", "tok/s", "median tok/s", "speedup vs ar", "speedup vs hf-ar",
                 "decoding vs ar",
                 "mean accepted", "acceptance", "exit layer", "drafts / token", "layer batch",
                 "draft / verify", "predictor / KV",
                 "layer fwd / token", "parity", "prefix = ar", "forced = ar", "accuracy",
                 "roofline",
                 "peak RSS MiB", "status")


def table_row(s: MethodSummary) -> list[str]:
    """The cells of ``s``'s table row, in :data:`TABLE_COLUMNS` order."""
    if s.failed:
        return [f"`{s.method}`"] + ["–"] * (len(TABLE_COLUMNS) - 2) + [
            "FAILED: " + s.failed.replace("|", "\\|").replace("\n", " ")]
    split = ("–" if s.draft_share is None and s.verify_share is None
             else f"{_pct(s.draft_share)} / {_pct(s.verify_share)}")
    overhead = ("–" if s.predictor_share is None
                else f"{100 * s.predictor_share:.1f}% / {100 * (s.kv_share or 0):.1f}%")
    return [f"`{s.method}`", _fmt(s.tokens_per_s, ".1f"), _fmt(s.median_tokens_per_s, ".1f"),
            _fmt(s.speedup_vs_ar, ".2f", "×"), _fmt(s.speedup_vs_hf_ar, ".2f", "×"),
            _fmt(s.decode_speedup_vs_ar, ".2f", "×"),
            _fmt(s.mean_accepted, ".2f"), _pct(s.acceptance_rate), _fmt(s.mean_exit_layer, ".1f"),
            _fmt(s.draft_rate, ".2f"), _fmt(s.mean_layer_batch, ".2f"), split, overhead,
            _fmt(s.layer_forwards_per_token, ".1f"), _pct(s.parity), _pct(s.ar_prefix),
            _pct(s.forced_agreement), _pct(s.accuracy),
            _pct(s.roofline_fraction), _fmt(s.peak_rss_mib, ".0f"),
            "ok" if s.lossless else "ok (lossy)"]


def markdown_table(summaries: list[MethodSummary]) -> str:
    """The summary table in GitHub markdown (with a "peak GPU MiB" column before the status
    when a method ran on CUDA)."""
    columns = list(TABLE_COLUMNS)
    cells = [table_row(s) for s in summaries]
    if any(getattr(s, "peak_gpu_mib", None) is not None for s in summaries):
        columns.insert(-1, "peak GPU MiB")
        for s, row in zip(summaries, cells):
            row.insert(-1, "–" if s.failed else _fmt(s.peak_gpu_mib, ".0f"))
    rows = [columns, ["---"] + ["---:"] * (len(columns) - 2) + ["---"]]
    rows += cells
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


PLAN_COLUMNS = ("method", "decisions / prompt", "speculating", "skipped attention",
                "skipped MLP", "predicted tok/s", "measured tok/s", "planning")


def plans_table(summaries: list[MethodSummary]) -> str:
    """The draft decisions of adaptive methods (empty when no method made any)."""
    rows = [[f"`{s.method}`", f"{p.per_prompt:.1f}", _pct(p.speculating),
             _fmt(p.mean_skipped_attention, ".1f"), _fmt(p.mean_skipped_mlp, ".1f"),
             _fmt(p.predicted_tps, ".1f"), _fmt(p.measured_tps, ".1f"), _pct(p.planning_share)]
            for s in summaries if (p := s.plans) is not None]
    if not rows:
        return ""
    head = [list(PLAN_COLUMNS), ["---"] + ["---:"] * (len(PLAN_COLUMNS) - 1)]
    return ("\n## Draft plans\n\nMethods that re-choose their draft during generation: "
            "decisions per prompt, the share that chose to draft (the rest decode plainly "
            "until the next one), sub-layers the chosen drafts skip (a skipped layer counts "
            "once in each column), predicted tokens per second (KnapSpec's TPT, eq. 4; – "
            "without a time model) against tokens per second measured over the steps each "
            "decision governed (planning excluded), and planning time as a share of wall "
            "time.\n\n"
            + "\n".join("| " + " | ".join(r) + " |" for r in head + rows) + "\n")


def exit_histograms(summaries: list[MethodSummary]) -> str:
    """The exit-layer histogram of each method whose tokens exit at more than one layer
    (lossy early exit, SpecEE; empty when none)."""
    rows = []
    for s in summaries:
        counts = s.exit_histogram
        total = sum(counts)
        if total and sum(1 for c in counts if c) > 1:
            cells = ", ".join(f"{layer}: {100 * c / total:.0f}%"
                              for layer, c in enumerate(counts) if c)
            rows.append(f"| `{s.method}` | {total} | {cells} |")
    return _share_section("Exit layers", "Share of the tokens predicted after each number of "
                          "layers (the last = every layer ran).", "tokens", "layers", rows)


def _share_section(title: str, intro: str, count: str, key: str, rows: list[str]) -> str:
    """A report section: ``title``, ``intro`` and a ``method | count | key: share`` table
    (empty without rows)."""
    if not rows:
        return ""
    return (f"\n## {title}\n\n{intro}\n\n| method | {count} | {key}: share |\n"
            "| --- | ---: | --- |\n" + "\n".join(rows) + "\n")


def drafter_mix(summaries: list[MethodSummary]) -> str:
    """The share of steps each drafter ran, for methods that choose one per step (``auto``;
    empty when none)."""
    rows = []
    for s in summaries:
        total = sum(s.drafter_steps.values())
        if total:
            cells = ", ".join(f"{name}: {100 * n / total:.0f}%"
                              for name, n in sorted(s.drafter_steps.items(),
                                                    key=lambda kv: -kv[1]))
            rows.append(f"| `{s.method}` | {total} | {cells} |")
    return _share_section("Drafters chosen", "Share of the decoding steps each drafter ran "
                          "(`ar` = a plain decoding step: no draft was predicted to pay).",
                          "steps", "drafter", rows)


def markdown_header(info: RunInfo) -> str:
    """The report header: model, dtype, dataset, machine, versions, bandwidth, date."""
    m = info.machine
    lines = [
        f"# selfspec bench: {info.model} on {info.dataset}"
        + (" (IN-SAMPLE)" if info.in_sample else "")
        + (" (PARTIAL: INTERRUPTED)" if info.partial else ""), "",
        f"- model: `{info.model}`, dtype {info.dtype}"
        + (f" ({info.formats})" if info.formats else ""),
        f"- dataset: {info.dataset}, n = {info.n} prompts, max new tokens {info.max_new_tokens}, "
        + ("greedy" if info.temperature == 0
           else f"temperature {info.temperature}"
           + (f", top-p {info.top_p}" if info.top_p < 1 else "") + f", seed {info.seed}")
        + (f"; batches of {info.batch_size} prompts (tokens/s = aggregate throughput of a "
           "batch; a prompt's wall time = its batch's / its rows)" if info.batch_size > 1
           else ""),
        (f"- machine: {m.cpu}, {m.logical_cores} logical cores, torch threads "
         f"{m.torch_threads}, {m.platform}" + (f"; {m.capability}" if m.capability else "")),
        (f"- versions: python {m.python}, torch {m.torch}, transformers {m.transformers}, "
         f"selfspec {m.selfspec}"),
    ]
    if info.roofline is not None:
        r = info.roofline
        lines.append(
            f"- memory bandwidth (measured, {r.bandwidth.buffer_bytes >> 20} MiB float32 sum, best "
            f"of {r.bandwidth.repeats}, {r.bandwidth.threads} threads): "
            f"{r.bandwidth.gb_per_s:.1f} GB/s; weights read per token "
            f"{r.weight_bytes / 1e6:.1f} MB; roofline {r.tokens_per_s:.1f} tok/s"
            + "".join(f"; `{m}` reads {b / 1e6:.1f} MB" for m, b in r.method_bytes.items()))
    if info.draft_format:
        lines.append(f"- {info.draft_format}")
    if info.held_out:
        lines.append(f"- {info.held_out}")
    if info.sandbox:
        lines.append(f"- generated code scored in: {info.sandbox}")
    if info.partial:
        lines.append(f"- **partial**: the run was interrupted after {info.generations} of "
                     f"{info.planned} generations; this report covers those only (accuracy "
                     "not scored, no plots); continue it with `selfspec bench` and the same "
                     "options plus `--resume <this folder>`")
    if len(info.sessions) > 1:
        lines.append(f"- resumed: generated by {len(info.sessions)} processes (started "
                     f"{', '.join(info.sessions)}); their timings are mixed in every rate and "
                     "speedup, so a change of machine load between them shows in the numbers")
    lines.append(f"- date: {info.date}")
    if info.command:
        lines.append(f"- command: `{info.command}`")
    return "\n".join(lines) + "\n"


_NOTES = """\
tok/s = all new tokens / all wall time (prefill included); speedups are ratios of tok/s in
this run; decoding vs ar = the same ratio after each prompt's first token (the shared prefill
left out); mean accepted = tokens committed per verification (bonus token included);
acceptance = accepted / drafted draft tokens; exit layer = mean layer of exit-layer
predictions (draft tokens; every token of a lossy early exit); drafts / token = draft tokens
per generated token (AdaDecode's early-prediction rate); layer batch = mean positions per
decoder-layer call of drafters that batch deferred layers; draft / verify = share of
wall time; predictor / KV = SpecEE's candidates + predictors and its skipped-layer KV
writes, as shares of wall time; parity = share of prompts whose greedy output equals `ar`'s; \
prefix = ar = mean
share of `ar`'s output repeated before the first differing token; forced = ar = share of
`ar`'s tokens that a row running another model (another decoding kernel, llama.cpp) picks
when given `ar`'s earlier tokens (teacher forcing); accuracy = HumanEval pass@1,
GSM exact match, json-extract's share of outputs that parse as JSON and validate against their
schema (every method, `ar` included, decodes under it), or a prompt file's reference match; \
roofline = tok/s over bandwidth / weight
bytes per token. – = not applicable or not known (transformers does not expose its
drafted-token counts).
"""


def markdown_report(info: RunInfo, summaries: list[MethodSummary], plots: list[Path]) -> str:
    """The whole ``report.md``: header, table, notes, plot links."""
    parts = [markdown_header(info), markdown_table(summaries), _NOTES]
    plans = plans_table(summaries)
    if plans:
        parts.append(plans)
    exits = exit_histograms(summaries)
    if exits:
        parts.append(exits)
    mix = drafter_mix(summaries)
    if mix:
        parts.append(mix)
    parts += [f"![{p.stem}]({p.name})\n" for p in plots]
    return "\n".join(parts)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    return value


def write_summary(info: RunInfo, summaries: list[MethodSummary], out_dir: Path) -> Path:
    """Write ``summary.json``: the header and every method's metrics."""
    roofline = None
    if info.roofline is not None:
        roofline = {"bandwidth_gb_per_s": info.roofline.bandwidth.gb_per_s,
                    "weight_bytes_per_token": info.roofline.weight_bytes,
                    "method_weight_bytes_per_token": dict(info.roofline.method_bytes),
                    "roofline_tokens_per_s": info.roofline.tokens_per_s,
                    "measurement": _jsonable(info.roofline.bandwidth)}
    header = {k: v for k, v in _jsonable(info).items() if k != "roofline"}
    payload = {"run": header, "roofline": roofline,
               "methods": [_jsonable(s) for s in summaries]}
    return write_text_atomic(out_dir / "summary.json", json.dumps(payload, indent=2) + "\n")
