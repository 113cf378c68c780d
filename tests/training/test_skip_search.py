"""SWIFT-style skip-set search (``selfspec heads search-skip``, ``--method swift``): the search
finds a known optimum, matchness scoring mirrors drafting, skip-set files round-trip and
refuse damage and other models, the benchmark reads their prompts, and ``swift`` gives
autoregressive greedy output on tiny random models."""

from __future__ import annotations

import json
import random

import pytest
import torch

from selfspec.api import from_pretrained_model
from selfspec.bench.heldout import check_held_out
from selfspec.bench.spec import parse_methods
from selfspec.cli import main
from selfspec.data import Prompt
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.errors import CorruptModelFileError, InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import SkipPlan
from selfspec.heads.card import PromptUse
from selfspec.heads.errors import HeadsModelMismatchError, HeadsNotFoundError
from selfspec.heads.skip_set import (
    load_skip_set,
    new_skip_set,
    read_skip_set,
    save_skip_set,
)
from selfspec.methods.registry import MethodContext, build_step, heads_files
from selfspec.training.corpus import CALIBRATION, split_of
from selfspec.training.skip_set_search import (
    CalibrationSequence,
    MatchnessScorer,
    SearchSettings,
    plan_of,
    search_skip_set,
    searchable_sublayers,
    skip_count,
    sublayers_of,
)

from tiny import run_step, tiny_model, tiny_tokenizer

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12, 200, 31, 8, 77, 150, 9, 41, 2, 19, 88, 120]
PLAN = SkipPlan(skip_attention=frozenset({1, 3}), skip_mlp=frozenset({2, 4}))


# ------------------------------------------------------------------ the search alone
@pytest.mark.parametrize("keep_ends", [True, False])
def test_search_finds_the_optimum_of_a_synthetic_score(keep_ends):
    """Score = overlap with a hidden best set: random search rarely hits it, swaps do."""
    num_layers = 6
    candidates = searchable_sublayers(num_layers, keep_ends)
    count = skip_count(len(candidates), 0.45)
    target = frozenset(random.Random(1).sample(candidates, count))
    calls = []

    def score(plan):
        calls.append(plan)
        return len(sublayers_of(plan) & target) / count

    settings = SearchSettings(trials=3, refine_steps=200, max_evaluations=500, keep_ends=keep_ends)
    result = search_skip_set(score, num_layers, settings)
    assert result.plan == plan_of(target) and result.score == 1.0
    assert result.num_skipped == count and result.candidates == candidates
    assert len(calls) == len(result.evaluations) <= 500
    assert len({sublayers_of(p) for p in calls}) == len(calls)  # never scored twice
    for e in result.evaluations:
        skipped = sublayers_of(e.plan)
        assert len(skipped) == count and skipped <= set(candidates)
    curve = [e.best for e in result.evaluations]
    assert curve == sorted(curve) and curve[-1] == 1.0
    assert [e.phase for e in result.evaluations[:3]] == ["random"] * 3
    if keep_ends:  # SWIFT's code never skips the first and the last layer
        assert all(sublayers_of(e.plan).isdisjoint({0, 1, 10, 11}) for e in result.evaluations)


def test_search_stops_at_a_local_optimum_and_is_seeded():
    def score(plan):  # every set equally good: no swap ever gains
        return 0.5

    result = search_skip_set(score, 4, SearchSettings(trials=2, refine_steps=1000,
                                                      max_evaluations=10_000))
    # 2 random sets, then every swap of the first one: a proven local optimum
    count, free = result.num_skipped, len(result.candidates) - result.num_skipped
    assert result.local_optimum
    assert len(result.evaluations) <= 2 + count * free
    random_only = SearchSettings(trials=4, refine_steps=0, seed=7)
    first = search_skip_set(lambda p: len(p.skip_mlp) / 10, 6, random_only)
    again = search_skip_set(lambda p: len(p.skip_mlp) / 10, 6, random_only)
    assert len(first.evaluations) == 4
    assert [e.plan for e in first.evaluations] == [e.plan for e in again.evaluations]


@pytest.mark.parametrize("settings,message", [
    (SearchSettings(skip_ratio=0.0), "skip_ratio"),
    (SearchSettings(skip_ratio=1.0), "skip_ratio"),
    (SearchSettings(trials=0), "trials"),
    (SearchSettings(trials=10, max_evaluations=5), "max_evaluations"),
    (SearchSettings(skip_ratio=0.01), "skips 0 of the"),
])
def test_search_refuses_bad_settings(settings, message):
    with pytest.raises(InvalidArgumentError, match=message):
        search_skip_set(lambda plan: 0.0, 6, settings)


# ------------------------------------------------------------- scoring on a tiny model
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def executor(request):
    return LayerExecutor(tiny_model(request.param, seed=4).float(), name=f"tiny-{request.param}")


@pytest.fixture(scope="module")
def ar_tokens(executor):
    return run_step(executor, ArStep(), PROMPT, max_new_tokens=40).tokens


@pytest.fixture(scope="module")
def sequences(executor, ar_tokens):
    second = [3, 9, 27, 81, 243, 1]
    second = run_step(executor, ArStep(), second, max_new_tokens=20).tokens
    return [CalibrationSequence(tuple(ar_tokens), len(PROMPT) - 1),
            CalibrationSequence(tuple(second), 5)]


def test_the_full_model_scores_one_and_plans_less(executor, sequences):
    scorer = MatchnessScorer(executor, sequences, window=8)
    assert scorer.num_positions == sum(s.num_scored for s in sequences) == 40 + 20
    assert scorer(SkipPlan()) == 1.0
    everything = SkipPlan(frozenset(range(6)), frozenset(range(6)))
    assert 0.0 <= scorer(everything) < 1.0
    assert 0.0 <= scorer(PLAN) <= 1.0


@pytest.mark.parametrize("window", [1, 3, 8])
def test_windows_mirror_drafting(executor, sequences, window):
    """A window's positions see the full model's KV before it and the plan's KV inside it:
    the same tokens as drafting through the plan on a cache the full model filled."""
    seq = sequences[0]
    ids = torch.tensor([seq.token_ids])
    n, L = ids.shape[1], executor.num_layers
    expected = 0
    with torch.inference_mode():
        full = executor.forward(ids, torch.arange(n)[None], executor.new_cache())[0].argmax(-1)
        for p in range(seq.score_from, n - 1, window):
            e = min(p + window, n - 1)
            cache = executor.new_cache()
            executor.forward(ids[:, :p], torch.arange(p)[None], cache)
            hidden = executor.run_layers(executor.embed(ids[:, p:e]), torch.arange(p, e)[None],
                                         0, L, cache, PLAN)  # writes the plan's KV, like a draft
            expected += int((executor.logits(hidden)[0].argmax(-1) == full[p:e]).sum())
    scorer = MatchnessScorer(executor, [seq], window=window)
    lengths = [p.cache.lengths() for p in scorer._prepared]
    assert scorer.matches(PLAN) == expected
    assert [p.cache.lengths() for p in scorer._prepared] == lengths  # read-only


def test_search_on_a_tiny_model_keeps_the_skip_count(executor, sequences):
    scorer = MatchnessScorer(executor, sequences, window=4)
    settings = SearchSettings(trials=4, refine_steps=4, max_evaluations=12)
    result = search_skip_set(scorer, executor.num_layers, settings)
    assert result.num_skipped == skip_count(2 * (executor.num_layers - 2), 0.45) == 4
    assert all(len(sublayers_of(e.plan)) == 4 for e in result.evaluations)
    assert result.score == max(e.score for e in result.evaluations) == scorer(result.plan)
    assert 4 <= len(result.evaluations) <= 12 and result.seconds > 0


def test_scorer_refuses_empty_calibration(executor):
    with pytest.raises(InvalidArgumentError, match="no calibration positions"):
        MatchnessScorer(executor, [CalibrationSequence((1, 2, 3), 2)])
    with pytest.raises(InvalidArgumentError, match="window"):
        MatchnessScorer(executor, [CalibrationSequence((1, 2, 3), 0)], window=0)


# ------------------------------------------------------------------- skip-set files
def _file(executor, path, plan=PLAN, uses=()):
    skip_set = new_skip_set(executor, plan, 0.625, "fp32", {"trials": 3}, list(uses))
    return save_skip_set(skip_set, path)


def test_skip_set_file_round_trip(executor, tmp_path):
    uses = [PromptUse("calibration", "stdlib", ["a.b", "c.d"])]
    path = _file(executor, tmp_path / "set.json", uses=uses)
    loaded = load_skip_set(path, executor)
    assert loaded.plan == PLAN and read_skip_set(path).plan == PLAN  # no model needed to read
    card = loaded.card
    assert card.model == executor.name and card.num_layers == 6 and card.score == 0.625
    assert card.dtype == "fp32" and card.search == {"trials": 3} and card.prompts == uses
    assert card.seen_prompts() == {"stdlib": {"a.b", "c.d"}} and card.created
    data = json.loads(path.read_text())
    assert data["format"] == "selfspec-skip-set" and data["skip_attention"] == [1, 3]
    assert data["skip_mlp"] == [2, 4] and data["fingerprint"]["config_sha256"]
    # a directory means its swift-skip.json
    assert _file(executor, tmp_path / "dir") == tmp_path / "dir" / "swift-skip.json"
    assert load_skip_set(tmp_path / "dir", executor).plan == PLAN


@pytest.mark.parametrize("damage,message", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: "", "not valid JSON"),
    (lambda text: json.dumps({"hello": 1}), "not a selfspec skip-set file"),
    (lambda text: text.replace('"skip_attention"', '"skip_attn"'), "missing field"),
    (lambda text: text.replace('"skip_mlp": [', '"skip_mlp": ["x", '), "list of layer indices"),
    (lambda text: text.replace('"skip_mlp": [', '"skip_mlp": [99, '), "outside"),
    (lambda text: text.replace('"format_version": 1', '"format_version": 99'), "newer"),
])
def test_damaged_skip_set_files_are_refused(executor, tmp_path, damage, message):
    path = _file(executor, tmp_path / "set.json")
    path.write_text(damage(path.read_text()))
    with pytest.raises(CorruptModelFileError, match=message) as err:
        load_skip_set(path, executor)
    assert "selfspec heads search-skip" in str(err.value)


def test_missing_skip_set_says_how_to_make_one(executor, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    with pytest.raises(HeadsNotFoundError, match=f"search-skip --model {executor.name}`"):
        load_skip_set("default", executor)
    with pytest.raises(HeadsNotFoundError, match="--out .*nothing.json"):
        load_skip_set(tmp_path / "nothing.json", executor)
    _file(executor, "default")
    assert (tmp_path / "home" / "heads" / executor.name / "swift-skip.json").is_file()
    assert load_skip_set("default", executor).plan == PLAN


def test_a_skip_set_of_another_model_is_refused(tmp_path):
    llama = LayerExecutor(tiny_model("llama", seed=4), name="tiny-llama")
    path = _file(llama, tmp_path / "set.json")
    other = LayerExecutor(tiny_model("llama", seed=5), name="other")  # same shape
    with pytest.raises(HeadsModelMismatchError, match="belongs to model 'tiny-llama'"):
        load_skip_set(path, other)
    shallow = LayerExecutor(tiny_model("llama", seed=4, num_layers=4), name="shallow")
    with pytest.raises(HeadsModelMismatchError, match="6-layer model"):
        load_skip_set(path, shallow)


# --------------------------------------------------------------------- the method
@pytest.mark.parametrize("confidence", [0.8, 0.01])
def test_swift_greedy_equals_autoregressive(executor, ar_tokens, tmp_path, confidence):
    path = _file(executor, tmp_path / "set.json")
    step = build_step("swift", MethodContext(executor),
                      {"skip_set": str(path), "confidence": confidence, "max_draft_len": 6})
    state = run_step(executor, step, PROMPT, max_new_tokens=40)
    assert state.tokens == ar_tokens
    assert state.stats.verifications > 0 and state.stats.drafted > 0
    # drafts run 2L - 4 sub-layers, verification D + 1 full tokens
    assert state.stats.sublayers == (state.stats.drafted * 8
                                     + 12 * (state.stats.drafted + state.stats.verifications))


def test_swift_through_the_api_with_a_searched_set(executor, ar_tokens, sequences, tmp_path):
    scorer = MatchnessScorer(executor, sequences, window=4)
    result = search_skip_set(scorer, executor.num_layers,
                             SearchSettings(trials=3, refine_steps=2, max_evaluations=6))
    path = save_skip_set(new_skip_set(executor, result.plan, result.score, "fp32"),
                         tmp_path / "set.json")
    engine = from_pretrained_model(executor.model, tiny_tokenizer(), executor.name)
    out = engine.generate(PROMPT, method="swift", skip_set=str(path), max_new_tokens=40)
    assert list(PROMPT) + out.token_ids == ar_tokens
    with pytest.raises(HeadsNotFoundError, match="search-skip"):
        engine.generate(PROMPT, method="swift", skip_set=str(tmp_path / "none.json"))


def test_the_benchmark_drops_the_prompts_a_skip_set_saw(executor, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    prompts = [Prompt("HumanEval/0", "def add(a, b):\n", chat=False),
               Prompt("HumanEval/1", "def sub(a, b):\n", chat=False)]
    path = _file(executor, tmp_path / "set.json",
                 uses=[PromptUse("calibration", "humaneval", ["HumanEval/1"])])
    assert heads_files("swift", {"skip_set": str(path)}) == [f"skip-set:{path}"]
    check = check_held_out(prompts, "humaneval", parse_methods(f"ar,swift:skip_set={path}"),
                           executor.name)
    assert check.dropped == ["HumanEval/1"] and [p.id for p in check.prompts] == ["HumanEval/0"]
    assert list(check.files) == [str(path)]
    # skip_set=default is the model's swift-skip.json; a missing file is skipped here
    assert check_held_out(prompts, "humaneval", parse_methods("swift"), executor.name).files == {}
    _file(executor, "default", uses=[PromptUse("calibration", "humaneval", ["HumanEval/0"])])
    check = check_held_out(prompts, "humaneval", parse_methods("swift"), executor.name)
    assert check.dropped == ["HumanEval/0"]


# ------------------------------------------------------------------------ the CLI
@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny-model"
    tiny_model("llama", seed=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_search_skip_command(capsys, tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    out_file = tmp_path / "swift.json"
    argv = ["heads", "search-skip", "--model", str(model_dir), "--dtype", "fp32", "--threads",
            "1", "--quiet", "--data", "stdlib", "--prompts", "3", "--max-new-tokens", "12",
            "--trials", "3", "--refine-steps", "3", "--max-evaluations", "8",
            "--out", str(out_file)]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "skip set: 4 of 12 sub-layers" in out and f"saved {out_file}" in out
    data = json.loads(out_file.read_text())
    assert data["num_layers"] == 6 and data["dtype"] == "fp32"
    assert len(data["skip_attention"]) + len(data["skip_mlp"]) == 4
    assert data["search"]["evaluations"] <= 8 and data["search"]["data"] == ["stdlib"]
    assert data["search"]["calibration_tokens"] == 3 * 12
    (use,) = data["prompts"]
    assert use["use"] == "calibration" and use["dataset"] == "stdlib" and len(use["ids"]) == 3
    assert all(split_of(i) == CALIBRATION for i in use["ids"])
    # the continuations went into the on-policy generation cache of `heads train`
    assert list((tmp_path / "home").rglob("stdlib-greedy-12.json"))

    assert main(["heads", "show", str(out_file)]) == 0
    assert "MLP skipped in layers" in capsys.readouterr().out

    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), str(model_dir))
    reference = engine.generate("def f(x):", max_new_tokens=16).token_ids
    result = engine.generate("def f(x):", method="swift", skip_set=str(out_file),
                             max_new_tokens=16)
    assert result.token_ids == reference


@pytest.mark.parametrize("extra,message", [
    (["--data", "wikipedia"], "unknown data source"),
    (["--skip-ratio", "1.5"], "--skip-ratio: must be a finite number in (0, 1)"),
    (["--prompts", "0"], "--prompts: must be an integer >= 1"),
    (["--trials", "50", "--max-evaluations", "10"], "max_evaluations"),
])
def test_search_skip_refuses_bad_options_before_loading(capsys, monkeypatch, extra, message):
    import selfspec

    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["heads", "search-skip", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
