"""``selfspec bench --prompts FILE.jsonl``: the loader's validation, reference scoring, and a
run on a prompt file (scripted runners, and the CLI on a tiny model)."""

from __future__ import annotations

import json

import pytest

import selfspec
from selfspec.bench import accuracy
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.runners import RunOutput
from selfspec.bench.spec import parse_method
from selfspec.cli import main
from selfspec.data import Prompt, load_prompt_file
from selfspec.data.promptfile import file_label
from selfspec.errors import InvalidArgumentError

from bench_helpers import ScriptedRunner
from bench_helpers import tiny_engine as _engine

VALID = [
    {"id": "code", "prompt": "def add(a, b):\n"},
    {"id": "chat", "prompt": "Name a colour.", "chat": True},
    {"id": "sum", "prompt": "2 + 2 =", "chat": False, "reference": "4"},
]


def _write(path, lines) -> str:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n", encoding="utf-8")
    return str(path)


def test_a_valid_file_loads_in_order_skipping_blank_lines(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [VALID[0], "", VALID[1], "   ", VALID[2], ""])
    prompts = load_prompt_file(path)
    assert prompts == [Prompt("code", "def add(a, b):\n", chat=False),
                       Prompt("chat", "Name a colour.", chat=True),
                       Prompt("sum", "2 + 2 =", chat=False, reference="4")]
    assert file_label(path) == "file:mine"


def test_utf8_text_and_a_byte_order_mark_are_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf"
                     + json.dumps({"id": "é", "prompt": "Grüß dich"}, ensure_ascii=False).encode())
    assert load_prompt_file(path) == [Prompt("é", "Grüß dich", chat=False)]


@pytest.mark.parametrize("line,field,message", [
    ("{not json", None, "invalid JSON"),
    ('["id", "prompt"]', None, "expected a JSON object with 'id' and 'prompt', got an array"),
    ({"prompt": "x"}, "id", "field 'id' is missing"),
    ({"id": "", "prompt": "x"}, "id", "field 'id' is empty"),
    ({"id": 3, "prompt": "x"}, "id", "field 'id' must be a string, got a number (3)"),
    ({"id": "b"}, "prompt", "field 'prompt' is missing"),
    ({"id": "b", "prompt": " \n "}, "prompt", "field 'prompt' is empty"),
    ({"id": "b", "prompt": "x", "chat": "yes"}, "chat",
     "field 'chat' must be true or false, got a string (\"yes\")"),
    ({"id": "b", "prompt": "x", "chat": 1}, "chat", "field 'chat' must be true or false"),
    ({"id": "b", "prompt": "x", "reference": 42}, "reference",
     "field 'reference' must be a string, got a number (42)"),
    ({"id": "b", "prompt": "x", "reference": None}, "reference",
     "field 'reference' must be a string, got null"),
    ({"id": "b", "prompt": "x", "promt": "y"}, "promt",
     "unknown field 'promt'; allowed fields: id, prompt, chat, reference"),
    ({"id": "a", "prompt": "again"}, "id", "duplicate id 'a' (first on line 1)"),
])
def test_a_malformed_line_names_the_file_the_line_and_the_field(tmp_path, line, field, message):
    path = _write(tmp_path / "bad.jsonl", [{"id": "a", "prompt": "ok"}, "", line,
                                           {"id": "c", "prompt": "never read"}])
    with pytest.raises(InvalidArgumentError) as err:
        load_prompt_file(path)
    text = str(err.value)
    assert f"prompt file {path!r}, line 3: " in text and message in text
    if field is not None:
        assert repr(field) in text


def test_invalid_utf8_is_refused_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(InvalidArgumentError, match=r"line 2: not valid UTF-8"):
        load_prompt_file(path)


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.jsonl", "cannot read prompt file"),
    (lambda d: d, "cannot read prompt file"),
    (lambda d: _write(d / "blank.jsonl", ["", "  "]), "holds no prompts"),
])
def test_a_missing_unreadable_or_empty_file_is_refused(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(InvalidArgumentError) as err:
        load_prompt_file(path)
    assert message in str(err.value) and str(path) in str(err.value)


# ---------------------------------------------------------------- scoring


@pytest.mark.parametrize("reference,text,correct", [
    ("4", "The answer is 4.", True),
    ("1,000", "#### 1000", True),
    ("-2.5", "so x = -2.50", True),
    ("4", "4 apples and 5 pears", False),  # the final number counts
    ("Paris", "  paris\nis the capital", True),
    ("Bonjour le monde", "bonjour   le\tmonde !", True),
    ("Paris", "The capital is Paris.", False),  # text references: the output starts with it
])
def test_references_are_scored_by_number_or_normalized_prefix(reference, text, correct):
    prompt = Prompt("q", "question", chat=True, reference=reference)
    assert accuracy.check_reference(prompt, text).correct is correct


def test_prompt_files_get_the_reference_scorer_whatever_their_name():
    assert accuracy.scorer("file:humaneval") is accuracy.check_reference
    assert accuracy.scorer("file:gsm") is accuracy.check_reference
    assert accuracy.scorer("humaneval") is accuracy.check_humaneval
    assert accuracy.scorer("mtbench") is None
    assert accuracy.score("file:x", Prompt("q", "question", chat=False), "anything") is None


# ---------------------------------------------------------------- runs on a prompt file


def test_a_run_on_a_prompt_file_writes_the_report_with_its_label(tmp_path):
    prompts = load_prompt_file(_write(tmp_path / "my-prompts.jsonl", VALID))
    texts = {"code": "    return a + b", "chat": "Blue.", "sum": " 4"}
    runner = ScriptedRunner("ar", {pid: RunOutput(token_ids=[1, 2], text=text, wall_time_s=0.5)
                                   for pid, text in texts.items()}, [])
    options = BenchOptions(dataset=file_label(tmp_path / "my-prompts.jsonl"), max_new_tokens=4,
                           out_dir=tmp_path / "out", bandwidth_mib=0, plots=False)
    report = run_benchmark(_engine(), [parse_method("ar")], prompts, options,
                           runner_factory=lambda m: runner)
    out = tmp_path / "out"
    assert "file:my-prompts, n = 3" in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["dataset"] == "file:my-prompts"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["question_id"]: r["correct"] for r in records} == {
        "code": None, "chat": None, "sum": True}
    assert report.summaries[0].accuracy == 1.0  # only the prompt with a reference is scored


def test_the_cli_runs_the_first_n_prompts_of_a_file(monkeypatch, capsys, tmp_path):
    path = _write(tmp_path / "mine.jsonl", VALID)
    engine = _engine()
    monkeypatch.setattr(selfspec, "load", lambda *args, **kwargs: engine)
    out = tmp_path / "results"
    code = main(["bench", "--prompts", path, "--n", "2", "--methods", "ar",
                 "--max-new-tokens", "3", "--warmup", "0", "--bandwidth-mib", "0",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("| method |")
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in records] == ["code", "chat"]
    assert "file:mine, n = 2" in (out / "report.md").read_text()
    assert (out / "speedup.png").exists()


def test_the_cli_refuses_prompts_with_a_dataset_and_bad_files_before_loading(
        monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("model loaded"))
    path = _write(tmp_path / "mine.jsonl", VALID)
    assert main(["bench", "--prompts", path, "--dataset", "gsm"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["bench", "--prompts", path, "--n", "4", "--methods", "ar"]) == 2
    assert "'file:mine' has 3 prompts; asked for n=4" in capsys.readouterr().err
    bad = _write(tmp_path / "bad.jsonl", [VALID[0], {"id": "x"}])
    assert main(["bench", "--prompts", bad, "--methods", "ar"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt file") and "line 2" in err and "'prompt'" in err
