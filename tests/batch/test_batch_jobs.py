"""``selfspec batch``: request lines, the resumable results file, the in-process runner and
the command (on a tiny random model saved as a local model directory)."""

from __future__ import annotations

import json

import pytest

from selfspec.batch.jobs import BatchRequest, GenerationSettings, parse_request, read_requests
from selfspec.batch.local import batches, run_local
from selfspec.batch.results import ResultsFile
from selfspec.cli import main
from selfspec.errors import InvalidArgumentError

from tiny import save_tiny, tiny_model, tiny_tokenizer

DEFAULTS = GenerationSettings(
    method="ar", options={}, max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0,
    seed=None, stop=(), response_format=None, presence_penalty=0.0, frequency_penalty=0.0,
    logprobs=None)
PROMPTS = ["def add(a, b):\n", "x = 1\ny = ", "for i in range(", "Hello", "abcabcabc",
           "print(", "import os\n"]


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine():
    import selfspec

    return selfspec.from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(),
                                          name="tiny-llama")


def test_a_line_overrides_the_command_lines_settings():
    request = parse_request({"id": 3, "prompt": "x", "max_new_tokens": 5, "stop": "\n",
                             "method": "layerskip", "options": {"exit_layer": 2}},
                            DEFAULTS, "f:1")
    assert request.key == "3" and request.settings.max_new_tokens == 5
    assert request.settings.stop == ("\n",)
    assert request.settings.generate_kwargs()["exit_layer"] == 2
    assert BatchRequest.from_json(request.to_json()) == request


@pytest.mark.parametrize("line, match", [
    ([1], "JSON object"), ({"prompt": "x"}, "'id'"), ({"id": True, "prompt": "x"}, "'id'"),
    ({"id": 1}, "exactly one"), ({"id": 1, "prompt": "x", "messages": []}, "exactly one"),
    ({"id": 1, "messages": [{"role": "user"}]}, "messages"),
    ({"id": 1, "prompt": "x", "temprature": 1}, "unknown key.*temprature"),
    ({"id": 1, "prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"id": 1, "prompt": "x", "method": "nope"}, "nope"),
    ({"id": 1, "prompt": "x", "method": "layerskip", "options": {"exit_layr": 2}}, "exit_layr"),
])
def test_a_bad_line_is_one_error_naming_the_line(tmp_path, line, match):
    path = _write(tmp_path / "p.jsonl", [{"id": 0, "prompt": "ok"}, line])
    with pytest.raises(InvalidArgumentError, match=match) as err:
        read_requests(path, DEFAULTS)
    assert "p.jsonl:2" in str(err.value)


def test_duplicate_ids_and_bad_json_are_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="already used on line 1"):
        read_requests(_write(tmp_path / "d.jsonl", [{"id": "a", "prompt": "x"},
                                                    {"id": "a", "prompt": "y"}]), DEFAULTS)
    (tmp_path / "j.jsonl").write_text('{"id": 1, "prompt": "x"}\n{"id": 2,\n')
    with pytest.raises(InvalidArgumentError, match="j.jsonl:2: not JSON"):
        read_requests(tmp_path / "j.jsonl", DEFAULTS)


def test_requests_with_equal_settings_batch_together_in_order():
    lines = [{"id": i, "prompt": "x", **({"max_new_tokens": 3} if i % 2 else {})}
             for i in range(7)]
    requests = [parse_request(line, DEFAULTS, "f") for line in lines]
    groups = [[r.id for r in g] for g in batches(requests, 2)]
    assert groups == [[0, 2], [4, 6], [1, 3], [5]]


def test_the_results_file_resumes_and_cuts_an_unfinished_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 1, "text": "a"}\n{"id": "2", "text": "b"}\n{"id": 3, "te')
    with ResultsFile(path) as results:
        assert results.done == {"1", "2"}
        assert results.write({"id": 3, "text": "c"}) and not results.write({"id": 1})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [1, "2", 3]
    (tmp_path / "other.jsonl").write_text("not json\n")
    with pytest.raises(InvalidArgumentError, match="other.jsonl:1 is not a result line"):
        ResultsFile(tmp_path / "other.jsonl")


@pytest.mark.parametrize("method, options", [("ar", {}), ("ngram", {}),
                                             ("layerskip", {"exit_layer": 3, "draft_len": 3})])
def test_batch_records_equal_generate_for_each_prompt(engine, method, options):
    settings = GenerationSettings(**{**DEFAULTS.__dict__, "method": method, "options": options,
                                     "max_new_tokens": 16})
    requests = [BatchRequest(i, p, None, settings) for i, p in enumerate(PROMPTS)]
    requests.append(BatchRequest("chat", None, ({"role": "user", "content": "Hi"},), settings))
    records = []
    run_local(engine, requests, records.append, batch_size=3)
    assert sorted(r["id"] for r in records if r["id"] != "chat") == list(range(len(PROMPTS)))
    by_id = {r["id"]: r for r in records}
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate(prompt, method, max_new_tokens=16, **options)
        assert by_id[i]["token_ids"] == alone.token_ids and by_id[i]["text"] == alone.text
        assert by_id[i]["usage"]["completion_tokens"] == len(alone.token_ids)
    chat = engine.generate("Hi", method, max_new_tokens=16, chat=True, **options)
    assert by_id["chat"]["token_ids"] == chat.token_ids
    if method != "ar":  # the equality is not vacuous: drafts were made and accepted
        assert sum(r["stats"]["accepted"] for r in records) > 0


def test_a_request_that_cannot_run_records_its_error_and_the_rest_run(engine):
    settings = GenerationSettings(**{**DEFAULTS.__dict__, "max_new_tokens": 4})
    long = "x" * (engine.executor.max_positions + 5)
    requests = [BatchRequest(0, "ok", None, settings), BatchRequest(1, long, None, settings)]
    records = []
    run_local(engine, requests, records.append, batch_size=8)
    assert "error" not in records[0] and "PromptError" in records[1]["error"]


def test_the_command_resumes_where_a_killed_job_stopped(tmp_path, capsys):
    model = save_tiny(tmp_path / "model", "llama", seed=3)
    prompts = _write(tmp_path / "p.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(prompts), "--output", str(out), "--model", str(model), "--dtype",
            "fp32", "--method", "ar", "--max-new-tokens", "8", "--batch-size", "2"]
    assert main(argv) == 0
    full = out.read_text().splitlines()
    # as if killed after two results and in the middle of the third line
    out.write_text("\n".join(full[:2]) + "\n" + full[2][:10])
    capsys.readouterr()
    assert main(argv) == 0
    assert "2 already in" in capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == list(range(len(PROMPTS)))  # each exactly once
    assert {r["id"]: r["token_ids"] for r in lines} == {
        json.loads(line)["id"]: json.loads(line)["token_ids"] for line in full}
    assert main(argv[:1] + [str(tmp_path / "missing.jsonl")] + argv[2:]) == 2
    assert "cannot read the prompt file" in capsys.readouterr().err
