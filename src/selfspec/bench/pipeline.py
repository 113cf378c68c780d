"""One benchmark run: prompts → runners → timed runs → scores → metrics → files.

The CLI (``selfspec bench``) parses arguments and loads the model, then calls
:func:`run_benchmark`; tests call it with a tiny model, a scripted runner factory or a fake
clock. Each generation is journaled in the output folder as it finishes
(:mod:`selfspec.bench.outdir`): an interrupted run leaves its finished generations and a
partial report, and ``resume`` finishes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.api import SelfSpec
from selfspec.bench import accuracy
from selfspec.bench.harness import BenchRun, ProgressEvent, run_bench
from selfspec.bench.heldout import HeldOutCheck, check_held_out
from selfspec.bench.metrics import MethodSummary, parity_flags, summarize
from selfspec.bench.outdir import (
    OutputMode,
    RunFolder,
    RunIdentity,
    check_out_dir,
    open_run_folder,
)
from selfspec.bench.plots import require_matplotlib, write_plots
from selfspec.bench.report import (
    MachineInfo,
    RunInfo,
    collect_machine_info,
    ensure_writable,
    markdown_report,
    markdown_table,
    now_iso,
    write_records,
    write_summary,
    write_text_atomic,
)
from selfspec.bench.roofline import Roofline, measure_bandwidth
from selfspec.bench.runners import (
    Clock,
    EncodedPrompt,
    Runner,
    RunSettings,
    make_runner,
)
from selfspec.bench.sandbox import Sandbox, find_sandbox
from selfspec.bench.spec import MethodConfig
from selfspec.data import Prompt
from selfspec.errors import InvalidArgumentError
from selfspec.executor.quant import FormatTiming

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchOptions:
    """Settings of one run (the same for every method).

    Attributes:
        dataset: dataset name, or a prompt file's ``file:<stem>`` label (for the header and
            the accuracy scorer).
        max_new_tokens: per prompt (>= 1).
        out_dir: where the files go (created; must be writable; must be missing or empty
            unless ``resume`` or ``overwrite``).
        temperature: 0 = greedy; > 0 = sampling, seeded with ``seed``.
        seed: sampling seed.
        top_p: nucleus mass when sampling (1 = off).
        warmup_prompts: prompts each method generates for, untimed, before the run.
        warmup_tokens: ``max_new_tokens`` of the warm-up generations.
        score: run the task-accuracy scorer on the outputs (HumanEval, GSM, json-extract).
        unsafe_run_code: with no sandbox on this machine, run HumanEval completions
            unsandboxed instead of refusing (:mod:`selfspec.bench.sandbox`).
        bandwidth_mib: buffer of the bandwidth measurement in MiB (0 = do not measure).
        plots: write the PNG plots.
        command: the command line, recorded in the report.
        allow_in_sample: keep prompts that a method's heads, thresholds or probes saw (the
            run is labelled in-sample); by default they are dropped (:mod:`.heldout`).
        resume: continue the interrupted run saved in ``out_dir`` (the settings must match
            the saved ones); the (method, prompt) pairs it finished are not run again.
        overwrite: remove ``out_dir``'s previous benchmark outputs first (refused when it
            holds files a benchmark run does not write).
        batch_size: prompts each method generates together (ragged batches; a row's wall
            time is its batch's divided by the rows, so tokens/s is the aggregate throughput).
        n: run the first ``n`` held-out prompts of those given, so a prompt dropped by the
            held-out check is replaced by the next one (``None`` = every prompt given).
    """

    dataset: str
    max_new_tokens: int
    out_dir: Path
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    warmup_prompts: int = 1
    warmup_tokens: int = 32
    score: bool = True
    unsafe_run_code: bool = False
    bandwidth_mib: int = 512
    plots: bool = True
    command: str = ""
    allow_in_sample: bool = False
    resume: bool = False
    overwrite: bool = False
    batch_size: int = 1
    n: int | None = None


@dataclass
class BenchReport:
    """Everything one run produced.

    Attributes:
        info: the header.
        run: the raw records and failures.
        summaries: one row per method.
        table: the markdown table (what the CLI prints).
        files: every file written.
    """

    info: RunInfo
    run: BenchRun
    summaries: list[MethodSummary]
    table: str
    files: list[Path] = field(default_factory=list)


def dtype_label(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bf16"`` (the CLI's spelling)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch."))


def encode_prompts(engine: SelfSpec, prompts: Sequence[Prompt]) -> list[EncodedPrompt]:
    """Tokenize every prompt once (chat template for chat prompts) and compile its output
    constraint (``meta["response_format"]``, e.g. ``json-extract``'s schemas) for the model,
    before any timing.

    Raises:
        PromptError: a chat dataset on a model without a chat template, an empty prompt.
        InvalidArgumentError: a constraint llguidance refuses for this model's vocabulary.
        MissingDependencyError: a constrained dataset without llguidance installed.
    """
    return [EncodedPrompt(p.id, engine.encode(p.text, chat=p.chat),
                          engine.grammar(p.meta.get("response_format")))
            for p in prompts]


def output_mode(options: BenchOptions) -> OutputMode:
    """What ``options`` ask to do with an existing output folder.

    Raises:
        InvalidArgumentError: both ``resume`` and ``overwrite``.
    """
    if options.resume and options.overwrite:
        raise InvalidArgumentError("--resume continues the run saved in a folder and "
                                   "--overwrite replaces it; pass one of them")
    if options.resume:
        return OutputMode.RESUME
    return OutputMode.OVERWRITE if options.overwrite else OutputMode.NEW


def run_identity(model: str, dtype: str, methods: Sequence[MethodConfig],
                 prompts: Sequence[Prompt], options: BenchOptions,
                 run_prompts: Sequence[Prompt] | None = None) -> RunIdentity:
    """The settings a resumed run must share with the saved one.

    Args:
        model: the model as asked for (``engine.name``); dtype: ``"bf16"``, ``"fp32"``, ...
        methods / prompts / options: as given to :func:`run_benchmark`.
        run_prompts: the prompts left after the held-out check (None: not known yet).
    """
    digest = hashlib.sha256(json.dumps([[p.id, p.text, p.chat] for p in prompts]).encode())
    return RunIdentity(
        model=model, dtype=dtype, dataset=options.dataset, prompts=tuple(p.id for p in prompts),
        prompts_sha256=digest.hexdigest(), methods=tuple(m.label for m in methods),
        max_new_tokens=options.max_new_tokens, temperature=float(options.temperature),
        top_p=float(options.top_p), seed=options.seed, warmup_prompts=options.warmup_prompts,
        warmup_tokens=options.warmup_tokens, allow_in_sample=options.allow_in_sample,
        torch_threads=torch.get_num_threads(),
        run_prompts=None if run_prompts is None else tuple(p.id for p in run_prompts),
        batch_size=options.batch_size)


def _assistant_loader(dtype: torch.dtype) -> Callable[[str], torch.nn.Module]:
    def load(name: str) -> torch.nn.Module:
        from selfspec.models.loading import load_model

        return load_model(name, dtype, show_progress=False).model.eval()
    return load


def score_outputs(run: BenchRun, prompts: Sequence[Prompt], dataset: str,
                  progress: Callable[[ProgressEvent], None] | None = None,
                  sandbox: Sandbox | None = None) -> None:
    """Set ``record.correct`` on every record of a dataset with an automatic scorer;
    generated code (HumanEval) runs in ``sandbox`` (default: the best one available)."""
    if accuracy.scorer(dataset) is None:
        return
    by_id = {p.id: p for p in prompts}
    for record in run.records:
        verdict = accuracy.score(dataset, by_id[record.prompt_id], record.output.text,
                                 sandbox=sandbox)
        record.correct = None if verdict is None else verdict.correct
        if progress:
            progress(ProgressEvent("score", record.method, record.prompt_id))


def run_benchmark(engine: SelfSpec, methods: Sequence[MethodConfig], prompts: Sequence[Prompt],
                  options: BenchOptions, *,
                  runner_factory: Callable[[MethodConfig], Runner] | None = None,
                  clock: Clock = time.perf_counter,
                  progress: Callable[[ProgressEvent], None] | None = None) -> BenchReport:
    """Benchmark ``methods`` on ``prompts`` and write the report files to ``options.out_dir``.

    Args:
        engine: the loaded model (selfspec methods and the transformers baselines use it).
        methods: rows of the report, in order (validated names and option names).
        prompts: the dataset prompts, the same for every method.
        options: run settings.
        runner_factory: builds each method's runner (default: :func:`make_runner` with
            ``clock``); tests pass scripted runners.
        clock: the stopwatch of the default runners.
        progress: called after each generation and each scored output.

    Returns:
        The report (its ``table`` is the markdown table).

    Prompts that the head files of ``methods`` saw in training, calibration or probe fitting
    are dropped first, or kept and labelled with ``options.allow_in_sample``
    (:func:`selfspec.bench.heldout.check_held_out`).

    Each generation is appended to ``journal.jsonl`` in ``options.out_dir`` as it finishes.
    If the run stops early (``KeyboardInterrupt``, any exception), the exception propagates
    after ``run.json`` is marked interrupted and partial ``records.jsonl``, ``summary.json``
    and ``report.md`` are written from what finished; ``options.resume`` continues it.

    Raises:
        InvalidArgumentError: no methods or prompts, every prompt in-sample, the output
            directory is not writable, is not empty (without ``resume`` / ``overwrite``),
            holds foreign files (``overwrite``), holds no unfinished run or one with other
            settings (``resume``), or another process is writing it.
        PromptError: a prompt the model cannot take (e.g. chat prompts without a chat template).
        MissingDependencyError: ``options.plots`` and matplotlib is not installed (checked first);
            a scorer's package (json-extract: ``jsonschema``) or llguidance for a constrained
            dataset is missing (before generating).
        SandboxUnavailableError: HumanEval scoring with no sandbox for its code and no
            ``unsafe_run_code`` (checked before generating).
    """
    sandbox, mode = _preflight(methods, prompts, options)
    held = _held_out(engine, methods, prompts, options)
    setup = _prepare(engine, methods, prompts, options, held, mode, runner_factory, clock)
    with open_run_folder(setup.out_dir, mode, setup.identity, planned=setup.planned,
                         command=options.command, started=now_iso()) as folder:
        run = BenchRun(methods=[m.label for m in methods],
                       records=list(folder.previous.records),
                       failures=dict(folder.previous.failures))

        def header(status: str) -> RunInfo:
            return _run_info(setup, folder, run, sandbox, status)

        try:
            info, summaries, files = _measure(setup, run, folder, header, sandbox, progress)
        except BaseException:
            _save_partial(folder, run, header("interrupted"), setup.greedy, setup.roofline)
            raise
        folder.set_status("complete")
    table = markdown_table(summaries)
    if held.is_in_sample:
        table += f"\n{held.describe(setup.total)}\n"
    return BenchReport(info, run, summaries, table, files)


def _preflight(methods: Sequence[MethodConfig], prompts: Sequence[Prompt],
               options: BenchOptions) -> tuple[Sandbox | None, OutputMode]:
    """The checks made before anything loads: methods and prompts given, matplotlib for
    plots, a sandbox for HumanEval's code and the dataset's scorer. Returns the sandbox
    (``None`` unless scoring runs code) and the output mode. Raises as :func:`run_benchmark`."""
    if not methods:
        raise InvalidArgumentError("no methods to benchmark")
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark on")
    mode = output_mode(options)
    if options.plots:
        require_matplotlib()
    # Scoring HumanEval runs the model's code: find the sandbox before generating anything.
    sandbox = (find_sandbox(options.unsafe_run_code)
               if options.score and accuracy.runs_code(options.dataset) else None)
    if options.score:
        accuracy.require_scorer(options.dataset)
    return sandbox, mode


def _held_out(engine: SelfSpec, methods: Sequence[MethodConfig], prompts: Sequence[Prompt],
              options: BenchOptions) -> HeldOutCheck:
    """The prompts the methods' head files did not see (:func:`check_held_out`), logging the
    dropped ones. Raises InvalidArgumentError when none is left."""
    held = check_held_out(prompts, options.dataset, methods, engine.name, options.allow_in_sample,
                          limit=options.n)
    if held.dropped:
        logger.warning("%s %d of %d prompts seen by %s in training/calibration (pass "
                       "--allow-in-sample to keep them and label the run in-sample)",
                       "replaced" if held.replaced else "dropped", len(held.dropped),
                       held.considered, ", ".join(held.sources))
    if not held.prompts:
        raise InvalidArgumentError(
            f"all {held.considered} prompts were seen in training or calibration by "
            f"{', '.join(held.sources)}; pick other prompts (--seed, --dataset, --prompts), "
            "heads trained on other data, or pass --allow-in-sample for an in-sample run")
    return held


@dataclass
class _Setup:
    """What :func:`run_benchmark` fixes before measuring (its steps share it)."""

    engine: SelfSpec
    options: BenchOptions
    methods: Sequence[MethodConfig]
    held: HeldOutCheck
    total: int  # prompts considered by the held-out check
    prompts: list[Prompt]  # the held-out prompts that run
    out_dir: Path
    dtype: str
    identity: RunIdentity
    encoded: list[EncodedPrompt]
    runners: list[Runner]
    roofline: Roofline | None
    settings: RunSettings
    machine: MachineInfo
    greedy: bool
    planned: int  # generations: methods × prompts


def _prepare(engine: SelfSpec, methods: Sequence[MethodConfig], prompts: Sequence[Prompt],
             options: BenchOptions, held: HeldOutCheck, mode: OutputMode,
             runner_factory: Callable[[MethodConfig], Runner] | None, clock: Clock) -> _Setup:
    """Check the output folder (before any measurement), encode the prompts, build the
    runners and measure the roofline's bandwidth (``options.bandwidth_mib > 0``)."""
    out_dir = Path(options.out_dir)
    dtype = dtype_label(engine.model.dtype)
    identity = run_identity(engine.name, dtype, methods, prompts, options, held.prompts)
    check_out_dir(out_dir, mode, identity)  # refused before any measurement
    ensure_writable(out_dir)
    total, prompts = held.considered, held.prompts
    encoded = encode_prompts(engine, prompts)
    if runner_factory is None:
        loader = _assistant_loader(engine.model.dtype)
        runner_factory = lambda m: make_runner(engine, m, clock, loader)
    runners = [runner_factory(m) for m in methods]
    roofline = None
    if options.bandwidth_mib > 0:
        bandwidth = measure_bandwidth(options.bandwidth_mib)
        roofline = Roofline(bandwidth, engine.executor.decode_weight_bytes(),
                            _method_bytes(runners))
        logger.info("bandwidth %.1f GB/s, roofline %.1f tok/s", bandwidth.gb_per_s,
                    roofline.tokens_per_s)
    settings = RunSettings(options.max_new_tokens, options.temperature, options.seed,
                           options.top_p, options.batch_size)
    machine = collect_machine_info()
    greedy = options.temperature == 0
    planned = len(methods) * len(prompts)
    return _Setup(engine, options, methods, held, total, prompts, out_dir, dtype, identity,
                  encoded, runners, roofline, settings, machine, greedy, planned)


def _run_info(setup: _Setup, folder: RunFolder, run: BenchRun, sandbox: Sandbox | None,
              status: str) -> RunInfo:
    """The report header of the run as it stands (``status``: complete or interrupted)."""
    engine, options, held = setup.engine, setup.options, setup.held
    return RunInfo(
        model=engine.name, dtype=setup.dtype, dataset=options.dataset, n=len(setup.prompts),
        max_new_tokens=options.max_new_tokens, temperature=options.temperature,
        seed=options.seed, top_p=options.top_p, machine=setup.machine, roofline=setup.roofline,
        date=folder.sessions[0], command=options.command, held_out=held.describe(setup.total),
        in_sample=held.is_in_sample, in_sample_prompts=held.in_sample,
        dropped_prompts=held.dropped, formats=engine.executor.formats.describe(),
        status=status, generations=len(run.records), planned=setup.planned,
        sessions=list(folder.sessions),
        sandbox=sandbox.describe() if sandbox is not None else "",
        batch_size=options.batch_size,
        draft_format=describe_draft_format(engine.executor.measured_draft_format))


def _measure(setup: _Setup, run: BenchRun, folder: RunFolder,
             header: Callable[[str], RunInfo], sandbox: Sandbox | None,
             progress: Callable[[ProgressEvent], None] | None
             ) -> tuple[RunInfo, list[MethodSummary], list[Path]]:
    """Generate (:func:`run_bench`, journalled into ``folder``), score, summarise and write
    records, plots, ``summary.json`` and ``report.md``. Returns (header, summaries, files)."""
    options, out_dir = setup.options, setup.out_dir
    run_bench(setup.runners, setup.encoded, setup.settings,
              warmup_prompts=options.warmup_prompts, warmup_tokens=options.warmup_tokens,
              progress=progress, run=run, sink=folder)
    if options.score:
        score_outputs(run, setup.prompts, options.dataset, progress, sandbox)
    summaries = summarize(run, greedy=setup.greedy, roofline=setup.roofline)
    info = header("complete")
    files = write_records(run, parity_flags(run, setup.greedy), out_dir)
    plots = write_plots(list(setup.methods), summaries, out_dir) if options.plots else []
    files += plots
    files.append(write_summary(info, summaries, out_dir))
    files.append(write_text_atomic(out_dir / "report.md",
                                   markdown_report(info, summaries, plots)))
    return info, summaries, files


def describe_draft_format(timing: FormatTiming | None) -> str:
    """One header line on the draft weight format ``draft_weights=auto`` measured fastest
    here (empty when no row asked for it): a run's rows drafted on that format."""
    if timing is None:
        return ""
    times = ", ".join(f"{fmt} {ms:.2f} ms" for fmt, ms in timing.ms.items())
    return (f"draft_weights=auto measured {timing.fastest} fastest on this machine"
            + (f" (one-row products over two layers: {times})" if times
               else " (the only quantized kernel here)"))


def _method_bytes(runners: Sequence[Runner]) -> dict[str, int]:
    """Weight bytes per token of each row that reads other weights than the run's model: a
    selfspec row on another decoding kernel (``ar:decode_kernel=int4``) or llama.cpp on its
    GGUF (a runner's ``weight_bytes_per_token``; a row whose bytes cannot be known here — no
    binding, a bad option, which its setup reports — keeps the model's)."""
    out: dict[str, int] = {}
    for runner in runners:
        count = getattr(runner, "weight_bytes_per_token", None)
        if count is None:
            continue
        try:
            nbytes = count()
        except InvalidArgumentError:
            continue
        if nbytes is not None:
            out[runner.config.label] = nbytes
    return out


def _save_partial(folder: RunFolder, run: BenchRun, info: RunInfo, greedy: bool,
                  roofline: Roofline | None) -> None:
    """Mark the run interrupted and write the report files of what finished (unscored: the
    scorer may have stopped half way)."""
    try:
        folder.set_status("interrupted")
        unscored = dataclasses.replace(
            run, records=[dataclasses.replace(r, correct=None) for r in run.records])
        summaries = summarize(unscored, greedy=greedy, roofline=roofline)
        write_records(unscored, parity_flags(unscored, greedy), folder.path)
        write_summary(info, summaries, folder.path)
        write_text_atomic(folder.path / "report.md", markdown_report(info, summaries, []))
    except Exception as err:  # noqa: BLE001 - the journal already holds every record
        logger.warning("could not write the partial report in %s: %s (journal.jsonl holds "
                       "every finished generation)", folder.path, err)
    logger.info("run interrupted after %d of %d generations; they are saved in %s",
                   info.generations, info.planned, folder.path)
