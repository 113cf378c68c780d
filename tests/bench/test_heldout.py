"""Held-out benchmarks: a bench run drops the prompts that a method's heads, thresholds or
probes saw (recorded on the head card), or keeps them and labels the run in-sample."""

from __future__ import annotations

import json

import pytest

from selfspec.api import from_pretrained_model
from selfspec.bench.heldout import check_held_out
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.spec import parse_methods
from selfspec.data import Prompt
from selfspec.errors import InvalidArgumentError
from selfspec.heads import ExitHeads, make_head, output_layer, save_heads
from selfspec.heads.card import PromptUse
from selfspec.heads.files import new_card

from tiny import tiny_model, tiny_tokenizer

PROMPTS = [Prompt("HumanEval/0", "def add(a, b):\n", chat=False),
           Prompt("HumanEval/1", "def sub(a, b):\n", chat=False)]


@pytest.fixture(scope="module")
def engine():
    return from_pretrained_model(tiny_model("llama", seed=3, num_layers=6), tiny_tokenizer(),
                                 "tiny-llama")


def _heads_file(engine, path, uses):
    """A lightweight head at layer 2 whose card lists ``uses``."""
    head = make_head("lightweight", 2, output_layer(engine)).prepare_inference()
    card = new_card(engine, "lightweight", [2])
    card.set_prompts(uses)
    save_heads(ExitHeads([2], [head], card), path)
    return path


def _run(engine, tmp_path, heads, **options):
    methods = parse_methods(f"ar,layerskip:exit_layer=2,draft_len=2,heads={heads}")
    opts = BenchOptions(dataset="humaneval", max_new_tokens=6, out_dir=tmp_path / "out",
                        bandwidth_mib=0, score=False, plots=False, **options)
    return run_benchmark(engine, methods, PROMPTS, opts)


def test_a_prompt_seen_in_training_is_dropped_by_default(engine, tmp_path):
    heads = _heads_file(engine, tmp_path / "h", [PromptUse("train", "humaneval", ["HumanEval/1"])])
    report = _run(engine, tmp_path, heads)
    assert report.info.n == 1 and report.info.dropped_prompts == ["HumanEval/1"]
    assert not report.info.in_sample
    assert {r.prompt_id for r in report.run.records} == {"HumanEval/0"}
    text = (tmp_path / "out" / "report.md").read_text()
    assert ("held out: all 1 prompts are unseen" in text
            and "1 of 2 prompts seen there were dropped" in text)
    assert "IN-SAMPLE" not in report.table


def test_a_dropped_prompt_is_replaced_by_the_next_held_out_one_up_to_n(engine, tmp_path):
    """With ``n``, the run keeps ``n`` held-out prompts: a seen one is replaced, not lost."""
    heads = _heads_file(engine, tmp_path / "h", [PromptUse("train", "humaneval", ["HumanEval/0"])])
    prompts = [PROMPTS[0], PROMPTS[1], Prompt("HumanEval/2", "def mul(a, b):\n", chat=False)]
    methods = parse_methods(f"ar,layerskip:exit_layer=2,draft_len=2,heads={heads}")
    opts = BenchOptions(dataset="humaneval", max_new_tokens=6, out_dir=tmp_path / "out",
                        bandwidth_mib=0, score=False, plots=False, n=1)
    report = run_benchmark(engine, methods, prompts, opts)
    assert report.info.n == 1 and report.info.dropped_prompts == ["HumanEval/0"]
    assert {r.prompt_id for r in report.run.records} == {"HumanEval/1"}  # not HumanEval/2
    assert "replaced by the next held-out ones (HumanEval/0)" in (
        tmp_path / "out" / "report.md").read_text()
    check = check_held_out(prompts, "humaneval", methods, engine.name, limit=5)
    assert [p.id for p in check.prompts] == ["HumanEval/1", "HumanEval/2"]  # all there are
    check = check_held_out(prompts, "humaneval", methods, engine.name, limit=2,
                           allow_in_sample=True)
    assert [p.id for p in check.prompts] == ["HumanEval/0", "HumanEval/1"]
    assert check.in_sample == ["HumanEval/0"] and check.dropped == []


def test_allow_in_sample_keeps_the_prompt_and_labels_the_run(engine, tmp_path):
    heads = _heads_file(engine, tmp_path / "h",
                        [PromptUse("calibration", "humaneval", ["HumanEval/0"])])
    report = _run(engine, tmp_path, heads, allow_in_sample=True)
    assert report.info.n == 2 and report.info.in_sample
    assert report.info.in_sample_prompts == ["HumanEval/0"] and report.info.dropped_prompts == []
    assert "IN-SAMPLE RUN" in report.table
    assert (tmp_path / "out" / "report.md").read_text().startswith(
        "# selfspec bench: tiny-llama on humaneval (IN-SAMPLE)")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["run"]["in_sample"] is True


def test_test_split_and_other_datasets_do_not_count_as_seen(engine, tmp_path):
    heads = _heads_file(engine, tmp_path / "h", [
        PromptUse("test", "humaneval", ["HumanEval/0"]),
        PromptUse("probe-eval", "humaneval", ["HumanEval/1"]),
        PromptUse("train", "stdlib", ["HumanEval/1"])])  # same id, another dataset
    report = _run(engine, tmp_path, heads)
    assert report.info.n == 2 and report.info.dropped_prompts == []


def test_every_prompt_seen_is_an_error_that_says_what_to_do(engine, tmp_path):
    heads = _heads_file(engine, tmp_path / "h", [
        PromptUse("probe-train", "humaneval", ["HumanEval/0", "HumanEval/1"])])
    with pytest.raises(InvalidArgumentError, match="--allow-in-sample"):
        _run(engine, tmp_path, heads)


def test_methods_without_head_files_need_no_check(engine):
    check = check_held_out(PROMPTS, "humaneval", parse_methods("ar,layerskip,dv,hf-ar"),
                           engine.name)
    assert check.files == {} and check.prompts == PROMPTS
    # default heads / probes are looked up (a missing file is skipped, its method fails later)
    check = check_held_out(PROMPTS, "humaneval", parse_methods("dssd,adaspeed-probe"), "nobody")
    assert check.prompts == PROMPTS


def test_a_card_of_another_format_does_not_load(engine, tmp_path):
    """Cards record their prompts from format 2 on; one of another format is refused (it
    cannot say which prompts it saw), with what to do."""
    from selfspec.errors import CorruptModelFileError
    from selfspec.heads.card import HeadCard
    from selfspec.heads.files import read_head_file

    card = new_card(engine, "lightweight", [2])
    data = card.to_dict()
    data["format_version"] = 1
    with pytest.raises(ValueError, match="train the heads again"):
        HeadCard.from_dict(data)
    path = _heads_file(engine, tmp_path / "h", [PromptUse("train", "humaneval", ["HumanEval/0"])])
    path = path if path.is_file() else path / "heads.safetensors"
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    card_data = json.loads(metadata["card"])
    card_data["format_version"] = 1
    save_file(tensors, str(path), metadata={**metadata, "card": json.dumps(card_data)})
    with pytest.raises(CorruptModelFileError, match="train the heads again"):
        read_head_file(path)