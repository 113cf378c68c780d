"""Crash safety of selfspec bench: the journal, interrupted runs, --resume, --overwrite and
the refusal to overwrite a folder silently (issue 18, Build item 4).

Scripted runners (bench_helpers) make the records exact; a shared call counter raises
KeyboardInterrupt on a chosen generation, as Ctrl-C would.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from filelock import FileLock

import selfspec
from selfspec.bench import outdir, runners
from selfspec.bench.harness import PromptRecord
from selfspec.bench.outdir import JOURNAL_FILE, LOCK_FILE, RUN_FILE
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.report import record_from_json, record_json
from selfspec.bench.spec import parse_method, parse_sweep
from selfspec.cli import main
from selfspec.data import Prompt
from selfspec.decoding.core.plan_log import PlanRecord
from selfspec.errors import InvalidArgumentError, SelfSpecError

from bench_helpers import ScriptedRunner, tiny_engine
from bench_helpers import run_output as _out

PROMPTS = [Prompt(f"q{i}", f"def f{i}(x):\n", chat=False) for i in range(5)]
SKIP = "layerskip:exit_layer=3"
SKIP_FILE = "layerskip_exit_layer=3.jsonl"  # specbench/<method>.jsonl


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


class Interrupter:
    """Counts generations across runners; raises KeyboardInterrupt on call ``at``."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.calls = at, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


class Runner(ScriptedRunner):
    def __init__(self, label, outputs, log, interrupter, **kwargs):
        super().__init__(label, outputs, log, **kwargs)
        self.interrupter = interrupter

    def run(self, prompt, settings):
        self.interrupter()
        return super().run(prompt, settings)


def _outputs(label: str) -> dict:
    """ar: 3 tokens per prompt; layerskip: differs from ar on odd prompts (parity < 1)."""
    outs = {}
    for i, p in enumerate(PROMPTS):
        tokens = [i, i + 1, i + 2] if label == "ar" or i % 2 == 0 else [i, 99]
        outs[p.id] = _out(tokens, 0.5 + 0.1 * i, drafted=4, accepted=2, verifications=2,
                          layer_forwards=10)
    return outs


def _bench(engine, out, labels=("ar", SKIP), *, at=None, log=None, fail=None, **options):
    log = [] if log is None else log
    interrupter = Interrupter(at)
    scripted = {label: Runner(label, _outputs(label), log, interrupter,
                              fail_on=(fail or {}).get(label)) for label in labels}
    settings = {"dataset": "file:mine", "max_new_tokens": 8, "out_dir": out, "bandwidth_mib": 0,
                "score": False, "plots": False, "warmup_prompts": 1, **options}
    return run_benchmark(engine, [parse_method(label) for label in labels], PROMPTS,
                         BenchOptions(**settings), runner_factory=lambda m: scripted[m.label])


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _interrupted(engine, out, finished=4, **kwargs):
    """A run of 2 methods × 5 prompts (1 warm-up prompt) stopped after ``finished`` records."""
    with pytest.raises(KeyboardInterrupt):
        _bench(engine, out, at=2 + finished + 1, **kwargs)


# ---------------------------------------------------------------- interrupt


def test_an_interrupt_keeps_the_finished_generations_and_a_partial_report(engine, tmp_path):
    out = tmp_path / "out"
    _interrupted(engine, out, finished=4)
    journal = _lines(out / JOURNAL_FILE)
    assert [(x["method"], x["question_id"]) for x in journal] == [
        ("ar", "q0"), (SKIP, "q0"), ("ar", "q1"), (SKIP, "q1")]
    assert len(_lines(out / "records.jsonl")) == 4
    assert [x["matches_ar"] for x in _lines(out / "specbench" / SKIP_FILE)] == [True, False]
    state = json.loads((out / RUN_FILE).read_text())
    assert state["status"] == "interrupted" and state["planned"] == 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["status"] == "interrupted" and summary["run"]["generations"] == 4
    assert [m["prompts"] for m in summary["methods"]] == [2, 2]
    report = (out / "report.md").read_text()
    assert "(PARTIAL: INTERRUPTED)" in report and "interrupted after 4 of 10 generations" in report
    with FileLock(out / LOCK_FILE, timeout=0):  # released
        pass


def test_a_crash_in_the_middle_also_keeps_what_finished(engine, tmp_path):
    out = tmp_path / "out"
    events = []

    def progress(event):
        events.append(event)
        if len([e for e in events if e.phase == "run"]) == 3:
            raise RuntimeError("disk on fire")

    scripted = {label: Runner(label, _outputs(label), [], Interrupter()) for label in ("ar", SKIP)}
    options = BenchOptions(dataset="file:mine", max_new_tokens=8, out_dir=out, bandwidth_mib=0,
                           score=False, plots=False, warmup_prompts=0)
    with pytest.raises(RuntimeError, match="disk on fire"):
        run_benchmark(engine, [parse_method("ar"), parse_method(SKIP)], PROMPTS, options,
                      runner_factory=lambda m: scripted[m.label], progress=progress)
    assert events[0].phase == "start" and events[0].total == 10
    assert len(_lines(out / JOURNAL_FILE)) == 3 and len(_lines(out / "records.jsonl")) == 3
    assert json.loads((out / RUN_FILE).read_text())["status"] == "interrupted"


def test_each_record_is_on_disk_before_the_next_generation_starts(engine, tmp_path):
    out = tmp_path / "out"
    seen = []

    class Watch(Interrupter):
        def __call__(self):
            seen.append(len((out / JOURNAL_FILE).read_text().splitlines()))

    scripted = {label: Runner(label, _outputs(label), [], Watch()) for label in ("ar", SKIP)}
    options = BenchOptions(dataset="file:mine", max_new_tokens=8, out_dir=out, bandwidth_mib=0,
                           score=False, plots=False, warmup_prompts=0)
    run_benchmark(engine, [parse_method("ar"), parse_method(SKIP)], PROMPTS, options,
                  runner_factory=lambda m: scripted[m.label])
    assert seen == list(range(10))


# ---------------------------------------------------------------- resume


def test_resume_finishes_the_run_as_one_run_would(engine, tmp_path, monkeypatch):
    from selfspec.bench.memory import PeakRss

    # Peak memory is a measurement like a timing (it varies run to run): leave it out here.
    monkeypatch.setattr(PeakRss, "probe", classmethod(lambda cls: cls(available=False)))
    whole = _bench(engine, tmp_path / "whole")
    out = tmp_path / "out"
    _interrupted(engine, out, finished=3)
    log: list = []
    resumed = _bench(engine, out, resume=True, log=log)
    # warm-up again (a new process), then only the 7 pairs the first process did not finish
    assert log[:2] == [("ar", "q0", 8), (SKIP, "q0", 8)]
    assert [(m, p) for m, p, _ in log[2:]] == [(SKIP, "q1")] + [
        (m, f"q{i}") for i in range(2, 5) for m in ("ar", SKIP)]
    assert (out / "records.jsonl").read_text() == (tmp_path / "whole" / "records.jsonl").read_text()
    for name in ("ar.jsonl", SKIP_FILE):
        assert (out / "specbench" / name).read_text() == (
            tmp_path / "whole" / "specbench" / name).read_text()
    assert resumed.summaries == whole.summaries
    assert [(r.method, r.prompt_id) for r in resumed.run.records] == [
        (r.method, r.prompt_id) for r in whole.run.records]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"] == json.loads(
        (tmp_path / "whole" / "summary.json").read_text())["methods"]
    assert summary["run"]["status"] == "complete" and len(summary["run"]["sessions"]) == 2
    report = (out / "report.md").read_text()
    assert "resumed: generated by 2 processes" in report and "timings are mixed" in report
    assert "PARTIAL" not in report
    assert json.loads((out / RUN_FILE).read_text())["status"] == "complete"


def test_a_method_that_failed_stays_failed_when_resumed(engine, tmp_path):
    out = tmp_path / "out"
    _interrupted(engine, out, finished=4, fail={SKIP: "q1"})  # SKIP fails on q1
    log: list = []
    report = _bench(engine, out, resume=True, log=log)
    assert all(method == "ar" for method, _, _ in log)
    ar, skip = report.summaries
    assert skip.failed == "prompt q1: RuntimeError: boom" and skip.prompts == 0
    assert ar.prompts == 5 and ar.failed is None


@pytest.mark.parametrize("cut", [40, -1])  # mid-line; just before the newline
def test_a_line_cut_short_by_a_crash_is_dropped_and_that_generation_runs_again(engine, tmp_path,
                                                                             cut):
    out = tmp_path / "out"
    _interrupted(engine, out, finished=4)
    journal = out / JOURNAL_FILE
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:3]) + lines[3][:cut])  # killed while writing the 4th
    log: list = []
    _bench(engine, out, resume=True, log=log)
    assert ((SKIP, "q1", 8) in log) == (cut == 40)  # a whole line without its newline is kept
    assert len(_lines(out / "records.jsonl")) == 10 and len(_lines(journal)) == 10


def test_a_resume_with_other_settings_is_refused_and_changes_nothing(engine, tmp_path):
    out = tmp_path / "out"
    _interrupted(engine, out, finished=4)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    log: list = []
    with pytest.raises(InvalidArgumentError) as err:
        _bench(engine, out, ("ar",), resume=True, max_new_tokens=16, log=log)
    message = str(err.value)
    assert f"cannot resume {out}" in message
    assert "max_new_tokens (saved 8, now 16)" in message
    assert f"methods (saved [ar, {SKIP}] (2), now [ar] (1))" in message
    assert "--overwrite" in message and "temperature" not in message
    assert log == []
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("setup,expected", [
    ("missing", "holds no run.json"),
    ("complete", "its run is complete (10 generations)"),
])
def test_nothing_to_resume_is_refused(engine, tmp_path, setup, expected):
    out = tmp_path / "out"
    if setup == "complete":
        _bench(engine, out)
    with pytest.raises(InvalidArgumentError,
                       match=expected.replace("(", r"\(").replace(")", r"\)")):
        _bench(engine, out, resume=True)


def test_a_folder_another_process_writes_is_refused(engine, tmp_path):
    out = tmp_path / "out"
    _interrupted(engine, out, finished=2)
    lock = FileLock(out / LOCK_FILE)
    lock.acquire()
    try:
        with pytest.raises(InvalidArgumentError, match="another selfspec bench process"):
            _bench(engine, out, resume=True)
    finally:
        lock.release()


# ---------------------------------------------------------------- never overwrite silently


def test_a_rerun_into_a_non_empty_out_is_refused(engine, tmp_path):
    out = tmp_path / "out"
    _bench(engine, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(InvalidArgumentError) as err:
        _bench(engine, out)
    assert "already holds a complete selfspec bench run" in str(err.value)
    assert "--overwrite" in str(err.value) and "new --out" in str(err.value)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    interrupted = tmp_path / "stopped"
    _interrupted(engine, interrupted, finished=4)
    with pytest.raises(InvalidArgumentError, match=r"unfinished .* \(4 of 10 generations "
                                                   r"recorded\); continue it with --resume"):
        _bench(engine, interrupted)


def test_overwrite_removes_the_stale_files_of_a_run_with_other_methods(engine, tmp_path):
    out = tmp_path / "out"
    sweep = [m.label for m in parse_sweep("layerskip:exit_layer=2,4")]
    _bench(engine, out, ("ar", SKIP, *sweep), plots=True)
    assert len(list((out / "specbench").iterdir())) == 4 and (out / "speedup.png").exists()
    assert outdir.foreign_entries(out) == []  # every file a run writes is a known output
    report = _bench(engine, out, ("ar",), overwrite=True)
    assert [p.name for p in (out / "specbench").iterdir()] == ["ar.jsonl"]
    assert not list(out.glob("*.png"))
    assert {x["method"] for x in _lines(out / "records.jsonl")} == {"ar"}
    assert [s.method for s in report.summaries] == ["ar"]
    assert json.loads((out / RUN_FILE).read_text())["settings"]["methods"] == ["ar"]


def test_results_of_a_run_without_a_journal_are_refused_then_overwritten(engine, tmp_path):
    """Folders written before the journal existed: only known output names, no run.json."""
    out = tmp_path / "out"
    (out / "specbench").mkdir(parents=True)
    for name in ("records.jsonl", "summary.json", "report.md", "speedup.png",
                 "specbench/dv.jsonl"):
        (out / name).write_text("old")
    with pytest.raises(InvalidArgumentError, match="already holds selfspec bench results; "
                                                   "pass --overwrite"):
        _bench(engine, out)
    _bench(engine, out, overwrite=True)
    assert sorted(p.name for p in (out / "specbench").iterdir()) == ["ar.jsonl", SKIP_FILE]
    assert not (out / "speedup.png").exists() and len(_lines(out / "records.jsonl")) == 10


@pytest.mark.parametrize("foreign", ["notes.txt", "specbench/README", "data/x.csv"])
def test_a_folder_with_foreign_files_is_never_wiped(engine, tmp_path, foreign):
    out = tmp_path / "out"
    _bench(engine, out)
    (out / foreign).parent.mkdir(exist_ok=True)
    (out / foreign).write_text("mine")
    files = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(InvalidArgumentError) as err:
        _bench(engine, out, ("ar",), overwrite=True)
    assert "--overwrite refused" in str(err.value) and foreign.split("/x")[0] in str(err.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == files
    assert (out / foreign).read_text() == "mine"


def test_a_non_empty_folder_of_other_files_is_refused(engine, tmp_path):
    (tmp_path / "thesis.tex").write_text("")
    with pytest.raises(InvalidArgumentError, match=r"is not empty \(it holds thesis.tex\)"):
        _bench(engine, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]


def test_new_folders_claimed_in_the_same_second_differ(tmp_path):
    base = tmp_path / "out" / "model-humaneval-20250101-120000"
    first, second = outdir.claim_new_dir(base), outdir.claim_new_dir(base)
    assert first == base and second.name == base.name + "-2"
    assert first.is_dir() and second.is_dir()


def test_records_read_back_equal_what_was_written():
    plan = PlanRecord(step=0, context_len=5, skipped_attention=2, skipped_mlp=1, draft_len=3,
                      predicted_tps=12.5, measured_tps=11.0, planning_ms=0.25, description="x")
    output = _out([3, 1, 4], 0.75, ttft_ms=12.5, accept_lengths=[2, 1], drafted=3, accepted=1,
                  verifications=2, draft_ms=1.5, verify_ms=2.5, layer_forwards=7.5,
                  finish_reason="eos", exit_tokens=3, exit_layer_total=6, plans=[plan],
                  layer_batches=[4, 1], exit_counts=[0, 2, 1], predictor_ms=0.5, kv_ms=0.125)
    record = PromptRecord("dv:gamma=0.5", "HumanEval/3", 2, 17, output, correct=True)
    assert record_from_json(json.loads(json.dumps(record_json(record, False)))) == record


# ---------------------------------------------------------------- CLI


def _prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}():"}) + "\n"
                            for i in range(2)))
    return str(path)


def _cli(capsys, *args):
    code = main(["bench", *args])
    captured = capsys.readouterr()
    return code, captured.err


def test_cli_interrupt_prints_how_to_resume_and_resume_finishes(monkeypatch, capsys, tmp_path,
                                                                engine):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: engine)
    out = tmp_path / "results"
    args = ["--model", "tiny-llama", "--dtype", "fp32", "--prompts", _prompt_file(tmp_path),
            "--methods", "ar,hf-ar", "--max-new-tokens", "3", "--warmup", "0",
            "--bandwidth-mib", "0", "--no-plots"]
    real_run, calls = runners.SelfSpecRunner.run, []

    def run(self, prompt, settings):
        calls.append(prompt.id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(self, prompt, settings)

    monkeypatch.setattr(runners.SelfSpecRunner, "run", run)
    monkeypatch.setattr(sys, "argv", ["selfspec", "bench", *args, "--out", str(out)])
    code, err = _cli(capsys, *args, "--out", str(out))
    assert code == 130
    assert f"stopped: 2 of 4 generations finished; they are saved in {out}" in err
    assert f"continue with: selfspec bench {shlex.join(args)} --resume {out}\n" in err
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert len(_lines(out / "records.jsonl")) == 2  # ar p0, hf-ar p0

    code, err = _cli(capsys, *args, "--out", str(out))
    assert code == 2 and f"--resume {out}" in err and "2 of 4 generations recorded" in err
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("model loaded"))
    code, err = _cli(capsys, *args, "--max-new-tokens", "4", "--resume", str(out))
    assert code == 2 and "max_new_tokens (saved 3, now 4)" in err
    assert len(err.strip().splitlines()) == 1

    monkeypatch.setattr(selfspec, "load", lambda *a, **k: engine)
    code, err = _cli(capsys, *args, "--resume", str(out))
    assert code == 0, err
    assert "resumed: 2 processes" in err
    assert [(x["method"], x["question_id"]) for x in _lines(out / "records.jsonl")] == [
        ("ar", "p0"), ("ar", "p1"), ("hf-ar", "p0"), ("hf-ar", "p1")]
    code, err = _cli(capsys, *args, "--out", str(out))
    assert code == 2 and "already holds a complete selfspec bench run" in err


@pytest.mark.parametrize("flags,message", [
    (["--overwrite"], "--overwrite needs --out DIR"),
    (["--out", "a", "--resume", "b"], "--resume DIR names the output folder; drop --out"),
])
def test_cli_refuses_contradictory_output_flags(monkeypatch, capsys, tmp_path, flags, message):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("model loaded"))
    code, err = _cli(capsys, "--prompts", _prompt_file(tmp_path), "--no-plots", *flags)
    assert code == 2 and message in err


def test_errors_are_selfspec_errors():
    assert issubclass(InvalidArgumentError, SelfSpecError)
