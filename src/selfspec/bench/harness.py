"""The benchmark loop: warm-up, then every method on every prompt, interleaved.

Fairness rules (issue "Benchmark harness"): the same encoded prompts, ``max_new_tokens``,
sampling settings and model for every method; warm-up runs are not recorded; methods are
interleaved prompt by prompt (A B C A B C ...) so drift of the machine (thermal, other
processes) hits all of them alike. A method that raises is marked failed and skipped from
then on; the others go on.

Batches (``--batch-size N``): prompts go in groups of ``N``, each method generating a group
as one ragged batch (:meth:`Runner.run_batch`), methods interleaved group by group.

Crash safety: each record and failure goes to a :class:`RecordSink` (the run folder's
journal) as soon as it happens, and a run can start from the results of an earlier process
of the same run, skipping the (method, prompt) pairs it finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from selfspec.bench.memory import PeakGpu, PeakRss
from selfspec.bench.runners import EncodedPrompt, Runner, RunOutput, RunSettings
from selfspec.bench.spec import DECODE_KERNEL, reference_label

logger = logging.getLogger(__name__)


@dataclass
class PromptRecord:
    """One method's generation for one prompt (a line of the JSONL output).

    Attributes:
        method: the method's label (``name:key=value,...``).
        prompt_id: the dataset prompt id.
        prompt_index: the prompt's position in the run.
        prompt_tokens: prompt length in tokens.
        output: what the runner returned.
        correct: task accuracy of the output (None when not scored).
        peak_rss_mib: the process's peak resident memory during this generation in MiB
            (:mod:`selfspec.bench.memory`; None where it cannot be measured).
        peak_gpu_mib: peak GPU memory torch allocated during it in MiB (None off CUDA).
        forced_matches / forced_tokens: of ``ar``'s ``forced_tokens`` greedy tokens for this
            prompt, how many this row's model picks given ``ar``'s earlier tokens (teacher
            forcing, :mod:`selfspec.bench.agreement`); None unless the row is another model
            than ``ar`` (another decoding kernel, llama.cpp) in a greedy run.
    """

    method: str
    prompt_id: str
    prompt_index: int
    prompt_tokens: int
    output: RunOutput
    correct: bool | None = None
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    forced_matches: int | None = None
    forced_tokens: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.output.token_ids)

    @property
    def tokens_per_s(self) -> float:
        wall = self.output.wall_time_s
        return self.new_tokens / wall if wall > 0 else 0.0


@dataclass(frozen=True)
class ProgressEvent:
    """Reported after each generation (warm-up included), and once before the first.

    Attributes:
        phase: ``"start"`` (before anything runs), ``"warmup"``, ``"run"`` or ``"score"``.
        method: the method's label (``""`` for ``"start"``).
        prompt_id: the prompt's id (``""`` for ``"start"``).
        failed: True when this generation raised (the method is skipped from now on).
        total: for ``"start"``: the generations this call will run, warm-ups included
            (pairs an earlier process finished are not counted).
    """

    phase: str
    method: str
    prompt_id: str
    failed: bool = False
    total: int = 0


class RecordSink(Protocol):
    """Told of each result the moment it exists (e.g. a journal on disk)."""

    def record(self, record: PromptRecord) -> None: ...

    def failure(self, method: str, message: str) -> None: ...


@dataclass
class BenchRun:
    """The raw results of one benchmark run.

    Attributes:
        methods: method labels in run order (failed ones included).
        records: every recorded generation, in the order they ran.
        failures: label → error message of each method that failed.
        lossless: label → whether the method's greedy output should equal ``ar``'s.
    """

    methods: list[str]
    records: list[PromptRecord] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    lossless: dict[str, bool] = field(default_factory=dict)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip()


def run_bench(runners: Sequence[Runner], prompts: Sequence[EncodedPrompt], settings: RunSettings,
              *, warmup_prompts: int = 1, warmup_tokens: int = 32,
              progress: Callable[[ProgressEvent], None] | None = None,
              run: BenchRun | None = None, sink: RecordSink | None = None) -> BenchRun:
    """Run every method on every prompt, interleaved, after a warm-up.

    Args:
        runners: one per method, in report order.
        prompts: the encoded prompts, the same for every method.
        settings: max new tokens and sampling, the same for every method.
        warmup_prompts: how many of the first prompts each method generates for before
            timing starts (not recorded; 0 = no warm-up).
        warmup_tokens: ``max_new_tokens`` of the warm-up generations (at most
            ``settings.max_new_tokens``).
        progress: called after each generation (e.g. to advance a progress bar).
        run: the results of an earlier process of the same run, filled in place: its
            (method, prompt) pairs are skipped, its failed methods stay failed, and methods
            with nothing left to run are neither set up nor warmed up. If this call raises
            (``KeyboardInterrupt`` included), ``run`` holds everything that finished.
        sink: told of each record and failure as it happens.

    Returns:
        The records (in run order: prompt by prompt, methods in order) and the failures.
    """
    labels = [r.config.label for r in runners]
    result = _start_run(runners, labels, run)
    done = {(r.method, r.prompt_id) for r in result.records}
    todo = [r for r in runners if r.config.label not in result.failures
            and any((r.config.label, p.id) not in done for p in prompts)]
    warm = min(warmup_prompts, len(prompts))
    if progress:
        left = sum((r.config.label, p.id) not in done for r in todo for p in prompts)
        progress(ProgressEvent("start", "", "", total=left + warm * len(todo)))
    memory = PeakRss.probe()
    gpu = PeakGpu.probe()
    alive = _set_up(todo, result, sink)
    _warm_up(alive, prompts, warm, settings, warmup_tokens, result, sink, progress)
    for first in range(0, len(prompts), settings.batch_size):
        chunk = list(enumerate(prompts[first:first + settings.batch_size], first))
        for runner in list(alive):
            if not _run_chunk(runner, chunk, done, settings, (memory, gpu), result, sink,
                              progress):
                alive.remove(runner)
    order = {label: i for i, label in enumerate(labels)}
    result.records.sort(key=lambda r: (r.prompt_index, order.get(r.method, len(order))))
    if settings.temperature == 0:
        force_references(result, [r for r in alive if r.config.label not in result.failures],
                         prompts)
    return result


def _start_run(runners: Sequence[Runner], labels: list[str], run: BenchRun | None) -> BenchRun:
    """``run`` (an earlier process's results) or a new :class:`BenchRun`, with the methods
    and each row's lossless flag of this run."""
    result = run if run is not None else BenchRun(methods=labels)
    result.methods = labels
    # A row on another kernel is lossless only against ar on that kernel, if the run has it.
    result.lossless = {r.config.label: r.lossless and (
        DECODE_KERNEL not in r.config.options or reference_label(r.config.label, labels) != "ar")
        for r in runners}
    return result


def _set_up(todo: Sequence[Runner], result: BenchRun, sink: RecordSink | None) -> list[Runner]:
    """Set up each runner; one that raises is marked failed. Returns those set up."""
    alive: list[Runner] = []
    for runner in todo:
        try:
            runner.setup()
            alive.append(runner)
        except Exception as err:  # noqa: BLE001 - any failure marks this one method failed
            _fail(result, sink, runner, err, "setup")
    return alive


def _warm_up(alive: list[Runner], prompts: Sequence[EncodedPrompt], warm: int,
             settings: RunSettings, warmup_tokens: int, result: BenchRun, sink: RecordSink | None,
             progress: Callable[[ProgressEvent], None] | None) -> None:
    """Warm-up on the first ``warm`` prompts: each alone, then (batches) one batch, so
    batched shapes are warm too; not recorded. A runner that fails leaves ``alive``; the
    others then forget what they learnt from these prompts."""
    warmup = RunSettings(min(warmup_tokens, settings.max_new_tokens), settings.temperature,
                         settings.seed, settings.top_p, settings.batch_size)
    size = settings.batch_size
    warm_groups = [[p] for p in prompts[:warm]] + (
        [list(prompts[:size])] if warm and size > 1 else [])
    for group in warm_groups:
        for runner in list(alive):
            ok = _try_run(result, sink, runner, group, warmup, "warm-up") is not None
            if not ok:
                alive.remove(runner)
            if progress and len(group) == 1:
                progress(ProgressEvent("warmup", runner.config.label, group[0].id, not ok))
    for runner in alive:  # what a method learnt from the warm-up prompts is not measured
        forget = getattr(runner, "forget", None)
        if forget is not None:
            forget()


def _run_chunk(runner: Runner, chunk: list[tuple[int, EncodedPrompt]],
               done: set[tuple[str, str]], settings: RunSettings,
               probes: tuple[PeakRss, PeakGpu], result: BenchRun, sink: RecordSink | None,
               progress: Callable[[ProgressEvent], None] | None) -> bool:
    """Run ``runner`` on the (index, prompt) pairs of ``chunk`` it has not done, as one call,
    recording each output with the call's peak memory. Returns False when the call failed
    (the method is then failed), else True."""
    label = runner.config.label
    group = [(i, p) for i, p in chunk if (label, p.id) not in done]
    if not group:
        return True
    memory, gpu = probes
    memory.reset()
    gpu.reset()
    where = "prompt " + ", ".join(p.id for _, p in group)
    outputs = _try_run(result, sink, runner, [p for _, p in group], settings, where)
    if outputs is not None:
        peak, peak_gpu = memory.read_mib(), gpu.read_mib()
        for (index, prompt), output in zip(group, outputs):
            record = PromptRecord(label, prompt.id, index, len(prompt.ids), output,
                                  peak_rss_mib=peak, peak_gpu_mib=peak_gpu)
            result.records.append(record)
            if sink:
                sink.record(record)
    if progress:
        for _, prompt in group:
            progress(ProgressEvent("run", label, prompt.id, outputs is None))
    return outputs is not None


def force_references(result: BenchRun, runners: Sequence[Runner],
                     prompts: Sequence[EncodedPrompt]) -> None:
    """Fill in :attr:`PromptRecord.forced_matches` / ``forced_tokens`` of the records of each runner
    that measures it (``forced_choices``; rows whose reference is ``ar`` but that run another
    model: another decoding kernel, llama.cpp), after all timed generations. Records that
    already have it (an earlier process of the run) are kept. A runner that raises here
    keeps ``None`` (logged): agreement is a figure of the run, not a reason to fail it."""
    labels = [r.config.label for r in runners]
    by_id = {p.id: p for p in prompts}
    ar_tokens = {r.prompt_id: r.output.token_ids for r in result.records if r.method == "ar"}
    for runner in runners:
        force = getattr(runner, "forced_choices", None)
        label = runner.config.label
        if force is None or reference_label(label, labels + ["ar"]) != "ar" or label == "ar":
            continue
        for record in result.records:
            reference = ar_tokens.get(record.prompt_id)
            if (record.method != label or record.forced_tokens is not None or not reference
                    or record.prompt_id not in by_id):
                continue
            try:
                choices = force(list(by_id[record.prompt_id].ids), list(reference))
            except Exception as err:  # noqa: BLE001 - a missing figure, not a failed row
                logger.warning("teacher-forced agreement of %s failed: %s", label,
                               _describe(err))
                break
            if choices is None:
                break
            record.forced_matches = sum(a == b for a, b in zip(choices, reference))
            record.forced_tokens = len(reference)


def _fail(result: BenchRun, sink: RecordSink | None, runner: Runner, err: Exception,
          where: str) -> None:
    label = runner.config.label
    result.failures[label] = f"{where}: {_describe(err)}"
    if sink:
        sink.failure(label, result.failures[label])
    logger.warning("method %s failed in %s: %s", label, where, _describe(err),
                   exc_info=logger.isEnabledFor(logging.DEBUG))


def _try_run(result: BenchRun, sink: RecordSink | None, runner: Runner,
             prompts: Sequence[EncodedPrompt], settings: RunSettings,
             where: str) -> list[RunOutput] | None:
    """One output per prompt (``run`` alone at batch size 1, else ``run_batch``), or
    ``None`` when the runner raised (the method is marked failed)."""
    try:
        if settings.batch_size == 1 and len(prompts) == 1:
            return [runner.run(prompts[0], settings)]
        return runner.run_batch(list(prompts), settings)
    except Exception as err:  # noqa: BLE001 - any failure marks this one method failed
        _fail(result, sink, runner, err, where)
        return None
