"""Structured output end to end: the json-extract dataset (valid schemas and references, a
calibration split the held-out check drops), its scorer, the bench decoding every prompt
under its own schema (lossless methods = constrained ar; baselines that cannot constrain
refuse in one line), per-row constraints in a batch, and `selfspec generate --json-schema /
--regex / --grammar / --logprobs / penalties` (bad input refused before the model loads)."""

from __future__ import annotations

import json
import re
import sys

import pytest

import selfspec
from selfspec.bench.accuracy import check_json
from selfspec.bench.heldout import check_held_out
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.spec import parse_methods
from selfspec.cli import main
from selfspec.data import bench_size, calibration_ids, load_prompts
from selfspec.data.jsonextract import CALIBRATION_IDS, HELD_OUT_SIZE, calibration_prompts
from selfspec.errors import InvalidArgumentError

from tiny import save_tiny, tiny_model, tiny_tokenizer

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green", "blue"]}}}


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("json-extract")


@pytest.fixture(scope="module")
def engine():
    # The tiny tokenizer is one character per token: a prompt with its schema is ~900 tokens.
    return selfspec.from_pretrained_model(
        tiny_model("llama", seed=3, max_position_embeddings=2048), tiny_tokenizer(), "tiny-llama")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-model"), seed=3)


# ------------------------------------------------------------------------- the dataset


def test_every_task_has_a_valid_schema_that_its_reference_satisfies(prompts):
    from selfspec.decoding.core.grammar import check_response_format

    assert len(prompts) == 24 and len({p.id for p in prompts}) == 24
    kinds = set()
    for p in prompts:
        schema = p.meta["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(json.loads(p.reference), schema)
        check_response_format(p.meta["response_format"])  # llguidance accepts it
        assert p.meta["response_format"]["json_schema"]["schema"] is schema
        assert p.chat and json.dumps(schema, separators=(",", ":")) in p.text
        fields = schema["properties"]
        assert 3 <= len(fields) <= 8, p.id
        assert schema["required"] == list(fields) and schema["additionalProperties"] is False
        for spec in fields.values():
            kinds.add("enum" if "enum" in spec else spec["type"])
            if spec.get("type") == "array":
                assert spec["items"]["type"] == "string" and "maxItems" in spec
    assert kinds == {"string", "integer", "number", "boolean", "enum", "array", "object"}
    assert sum("object" in {f.get("type") for f in p.meta["schema"]["properties"].values()}
               for p in prompts) >= 3


def test_the_calibration_split_is_disjoint_from_the_held_out_one_and_last(prompts):
    held = [p for p in prompts if p.meta["split"] == "held-out"]
    assert len(held) == HELD_OUT_SIZE == bench_size("json-extract") == 20
    assert bench_size("humaneval") == 10 and calibration_ids("humaneval") == frozenset()
    assert calibration_ids("json-extract") == CALIBRATION_IDS
    assert {p.id for p in calibration_prompts()} == CALIBRATION_IDS
    assert not CALIBRATION_IDS & {p.id for p in held}
    assert [p.id for p in prompts[HELD_OUT_SIZE:]] == [p.id for p in calibration_prompts()]


def test_the_held_out_check_drops_the_calibration_split(prompts):
    methods = parse_methods("ar,ngram")
    held = check_held_out(prompts, "json-extract", methods, "tiny-llama")
    assert {p.id for p in held.prompts} == {p.id for p in prompts[:HELD_OUT_SIZE]}
    assert set(held.dropped) == CALIBRATION_IDS
    assert "calibration split" in held.describe(len(prompts)) and not held.is_in_sample
    kept = check_held_out(prompts, "json-extract", methods, "tiny-llama", allow_in_sample=True)
    assert len(kept.prompts) == 24 and kept.is_in_sample
    first = check_held_out(prompts, "json-extract", methods, "tiny-llama", limit=HELD_OUT_SIZE)
    assert not first.dropped and first.describe(HELD_OUT_SIZE).startswith("held out: all 20")


def test_the_scorer_accepts_valid_json_only(prompts):
    p = prompts[0]
    assert check_json(p, p.reference).correct
    assert check_json(p, p.reference[:-1]).detail.startswith("not JSON")
    wrong = dict(json.loads(p.reference), currency="YEN")
    verdict = check_json(p, json.dumps(wrong))
    assert not verdict.correct and "currency" in verdict.detail


# ------------------------------------------------------------------------- the bench


def test_the_bench_decodes_every_prompt_under_its_schema(engine, prompts, tmp_path):
    methods = parse_methods("ar,ngram,auto:drafters=ngram,hf-ar")
    options = BenchOptions(dataset="json-extract", max_new_tokens=20, out_dir=tmp_path,
                           bandwidth_mib=0, plots=False, warmup_prompts=0, n=2)
    report = run_benchmark(engine, methods, prompts, options)
    by = {s.method: s for s in report.summaries}
    assert "cannot decode under this dataset's JSON schemas" in by["hf-ar"].failed
    for label in ("ar", "ngram", "auto:drafters=ngram"):
        s = by[label]
        assert s.failed is None and s.parity == 1.0 and s.accuracy is not None, label
    texts = [r.output.text for r in report.run.records]
    assert len(texts) == 6 and all(t.startswith('{"') for t in texts)  # the schema's keys
    assert {r.prompt_id for r in report.run.records} == {p.id for p in prompts[:2]}
    assert "held out: all 2 prompts" in report.info.held_out


def test_a_batch_takes_one_constraint_per_row(engine):
    rows = ["abc", "the cat sat on the mat"]
    formats = [{"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
               {"type": "regex", "regex": "[a-c]{2,5}"}]
    alone = [engine.generate(p, max_new_tokens=30, response_format=f).token_ids
             for p, f in zip(rows, formats)]
    for method in ("ar", "ngram"):
        together = engine.generate(rows, method=method, max_new_tokens=30,
                                   response_format=formats)
        assert [r.token_ids for r in together] == alone, method
    with pytest.raises(InvalidArgumentError, match="one per prompt"):
        engine.generate(rows, response_format=formats[:1])


def test_bench_refuses_json_extract_without_jsonschema_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    code = main(["bench", "--dataset", "json-extract", "--methods", "ar", "--no-plots",
                 "--model", "no-such-model"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: 'jsonschema' is not installed")
    assert "selfspec[bench]" in err and "--no-accuracy" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------- the CLI


def test_generate_with_a_json_schema_prints_valid_json_and_logprobs(model_dir, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = ["generate", "--model", str(model_dir), "--json-schema", str(schema),
            "--logprobs", "2", "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
            "--max-new-tokens", "40"]
    assert main([*argv, "--method", "ngram", "--compare-ar", "abc"]) == 0
    out, err = capsys.readouterr()
    jsonschema.validate(json.loads(out), SCHEMA)
    assert "mean logprob" in err and "logprobs (natural log; token, logprob, top 2)" in err
    assert "outputs identical" in err and "-inf" not in err
    assert main(["generate", "--model", str(model_dir), "--regex", "[a-c]{2,5}",
                 "--max-new-tokens", "8", "abc"]) == 0
    assert re.fullmatch("[a-c]{2,5}", capsys.readouterr().out.strip())


@pytest.mark.parametrize("flags,message", [
    (["--json-schema", "{schema}"],
     "--json-schema {schema}: invalid json_schema: Invalid type: strin"),
    (["--json-schema", "{notjson}"], "not JSON (Expecting property name"),
    (["--json-schema", "{array}"], "a JSON schema is a JSON object, got an array"),
    (["--json-schema", "{missing}"], "cannot read the file (No such file or directory)"),
    (["--regex", "(("], "--regex: invalid regex:"),
    (["--grammar", "{lark}"], "invalid lark:"),
    (["--json-object", "--regex", "a"], "not allowed with argument --json-object"),
    (["--logprobs", "21"], "--logprobs: must be an integer in [0, 20]"),
    (["--frequency-penalty", "nan"], "--frequency-penalty: must be a finite number in [-2, 2]"),
])
def test_generate_refuses_bad_constraints_in_one_line_before_loading(
        flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    files = {"schema": '{"type": "strin"}', "notjson": "{bad", "array": "[1, 2]",
             "lark": "start: foo\nfoo: 'a'+ | bar"}
    paths = {"missing": str(tmp_path / "missing.json")}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        paths[name] = str(tmp_path / name)
    argv = ["generate", "--model", "no-such-model", *[f.format(**paths) for f in flags], "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(**paths) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
