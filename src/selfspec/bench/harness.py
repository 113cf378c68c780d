"""The benchmark loop: warm-up, then every method on every prompt, interleaved.

Fairness rules (issue "Benchmark harness"): the same encoded prompts, ``max_new_tokens``,
sampling settings and model for every method; warm-up runs are not recorded; methods are
interleaved prompt by prompt (A B C A B C ...) so drift of the machine (thermal, other
processes) hits all of them alike. A method that raises is marked failed and skipped from
then on; the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from selfspec.bench.runners import EncodedPrompt, RunOutput, Runner, RunSettings

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
    """

    method: str
    prompt_id: str
    prompt_index: int
    prompt_tokens: int
    output: RunOutput
    correct: bool | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.output.token_ids)

    @property
    def tokens_per_s(self) -> float:
        wall = self.output.wall_time_s
        return self.new_tokens / wall if wall > 0 else 0.0


@dataclass(frozen=True)
class ProgressEvent:
    """Reported after each generation (warm-up included).

    Attributes:
        phase: ``"warmup"`` or ``"run"``.
        method: the method's label.
        prompt_id: the prompt's id.
        failed: True when this generation raised (the method is skipped from now on).
    """

    phase: str
    method: str
    prompt_id: str
    failed: bool = False


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
              progress: Callable[[ProgressEvent], None] | None = None) -> BenchRun:
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

    Returns:
        The records and the failures.
    """
    result = BenchRun(methods=[r.config.label for r in runners],
                      lossless={r.config.label: r.lossless for r in runners})
    alive: list[Runner] = []
    for runner in runners:
        try:
            runner.setup()
            alive.append(runner)
        except Exception as err:  # noqa: BLE001 - any failure marks this one method failed
            _fail(result, runner, err, "setup")
    warmup = RunSettings(min(warmup_tokens, settings.max_new_tokens), settings.temperature,
                         settings.seed)
    for prompt in prompts[:warmup_prompts]:
        for runner in list(alive):
            ok = _try_run(result, runner, prompt, warmup, "warm-up") is not None
            if not ok:
                alive.remove(runner)
            if progress:
                progress(ProgressEvent("warmup", runner.config.label, prompt.id, not ok))
    for index, prompt in enumerate(prompts):
        for runner in list(alive):
            output = _try_run(result, runner, prompt, settings, f"prompt {prompt.id}")
            if output is None:
                alive.remove(runner)
            else:
                result.records.append(PromptRecord(runner.config.label, prompt.id, index,
                                                   len(prompt.ids), output))
            if progress:
                progress(ProgressEvent("run", runner.config.label, prompt.id, output is None))
    return result


def _fail(result: BenchRun, runner: Runner, err: Exception, where: str) -> None:
    label = runner.config.label
    result.failures[label] = f"{where}: {_describe(err)}"
    logger.warning("method %s failed in %s: %s", label, where, _describe(err),
                   exc_info=logger.isEnabledFor(logging.DEBUG))


def _try_run(result: BenchRun, runner: Runner, prompt: EncodedPrompt, settings: RunSettings,
             where: str) -> RunOutput | None:
    try:
        return runner.run(prompt, settings)
    except Exception as err:  # noqa: BLE001 - any failure marks this one method failed
        _fail(result, runner, err, where)
        return None
