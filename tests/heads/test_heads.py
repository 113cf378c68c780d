"""Exit heads: modules, files, training, calibration (DSSD §3.4.1) and probes, on tiny models."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from selfspec import from_pretrained_model
from selfspec.errors import CorruptModelFileError, InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import (
    ExitHeads,
    HeadsModelMismatchError,
    HeadsNotFoundError,
    NotCalibratedError,
    confidences,
    load_heads,
    make_head,
    output_layer,
    save_heads,
    threshold,
    thresholds,
)
from selfspec.heads.files import new_card
from selfspec.methods.registry import build_step
from selfspec.training import default_layers, fit_probe, roc_auc
from selfspec.training.calibration import calibrate
from selfspec.training.corpus import CALIBRATION, TEST, TRAIN, CorpusItem, split_of
from selfspec.training.features import backbone_pass, load_features
from selfspec.training.placement import check_layers
from selfspec.training.train import TrainConfig, train_heads

from tiny import tiny_model, tiny_tokenizer

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Module-scoped fixtures are built before conftest's per-test thread setting applies;
    tiny tensors on a busy 2-core machine are many times slower with two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def executor(model):
    return LayerExecutor(model)


def _items(n: int = 60, length: int = 40, seed: int = 0) -> list[CorpusItem]:
    g = torch.Generator().manual_seed(seed)
    return [CorpusItem("synthetic", f"p{i}",
                       tuple(torch.randint(0, 256, (length,), generator=g).tolist()),
                       0, split_of(f"p{i}")) for i in range(n)]


@pytest.fixture(scope="module")
def features(executor):
    return backbone_pass(executor, _items(), [2, 4], progress=False)


@pytest.fixture(scope="module")
def trained(executor, features):
    return train_heads(output_layer(executor), features, [2, 4],
                       TrainConfig(epochs=4, lr=1e-2, batch_tokens=64), progress=False)


def _heads(executor, result) -> ExitHeads:
    card = new_card(executor.model, "lightweight", [h.layer for h in result.heads])
    return ExitHeads([h.layer for h in result.heads], result.heads, card)


# -------------------------------------------------------------------------- placement


def test_default_layers_follow_dssd_eq1():
    assert default_layers(30) == [6, 12, 18, 24]
    assert default_layers(24) == [4, 9, 14, 19]
    assert default_layers(6, num_heads=2) == [2, 4]
    assert default_layers(2) == [1]  # rounding collisions collapse


@pytest.mark.parametrize("layers", [[0], [6], [2, 2], [], [1.5]])
def test_check_layers_rejects_bad_layers(layers):
    with pytest.raises(InvalidArgumentError):
        check_layers(layers, 6)


# ---------------------------------------------------------------------------- modules


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lightweight_head_at_init_is_the_models_own_output(arch, dtype):
    ex = LayerExecutor(tiny_model(arch, dtype=dtype))
    head = make_head("lightweight", 3, output_layer(ex)).prepare_inference()
    hidden = torch.randn(2, 5, 64).to(dtype)
    with torch.inference_mode():
        assert torch.equal(head(hidden), ex.logits(hidden))
        rows = torch.tensor([3, 7, 255])
        assert torch.equal(head(hidden, vocab_rows=rows), ex.logits(hidden, vocab_rows=rows))


def test_full_head_copied_from_lm_head_equals_the_model_and_random_does_not(executor):
    out = output_layer(executor)
    hidden = torch.randn(1, 4, 64)
    with torch.no_grad():
        assert torch.equal(make_head("full", 2, out)(hidden), executor.logits(hidden))
        assert not torch.allclose(make_head("full", 2, out, init="random")(hidden),
                                  executor.logits(hidden))
    with pytest.raises(InvalidArgumentError):
        make_head("medusa", 2, out)


def test_confidence_metrics_on_known_distributions():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    c = confidences(logits)
    assert torch.allclose(c["max_prob"], torch.tensor([0.7, 1 / 3]))
    assert torch.allclose(c["margin"], torch.tensor([0.5, 0.0]), atol=1e-6)
    h = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert torch.allclose(c["entropy"], torch.tensor([-h, -math.log(3)]))
    # A one-hot distribution: 0 log 0 counts as 0, not NaN.
    assert confidences(torch.tensor([[0.0, -1e9, -1e9]]))["entropy"].item() == 0.0


# --------------------------------------------------------------------- AUC, thresholds


def test_roc_auc_on_hand_made_vectors():
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0]) == 1.0
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    # pairs (pos, neg): (0.8, 0.4) win, (0.8, 0.6) win, (0.3, 0.4) loss, (0.3, 0.6) loss
    assert roc_auc([0.8, 0.3, 0.4, 0.6], [1, 1, 0, 0]) == 0.5
    # ties count one half: (0.5,0.5) tie, (0.5,0.2) win, (0.9,0.5) win, (0.9,0.2) win
    assert roc_auc([0.5, 0.9, 0.5, 0.2], [1, 1, 0, 0]) == 3.5 / 4
    assert roc_auc([0.3, 0.3, 0.3], [1, 0, 1]) == 0.5
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))  # undefined: all correct
    assert math.isnan(roc_auc([0.1, 0.2], [0, 0]))
    with pytest.raises(InvalidArgumentError):
        roc_auc([], [])


def _paper_tau(scores, correct, eps):
    """DSSD §3.4.1 by brute force over candidate thresholds: the smallest value v such that
    among all samples with confidence >= v the proportion correct is >= eps."""
    for v in sorted(set(scores)):
        kept = [t for s, t in zip(scores, correct) if s >= v]
        if sum(kept) / len(kept) >= eps:
            return v
    return math.inf


def test_threshold_follows_the_paper_definition():
    # sorted: c = 0.1 0.2 0.3 0.4 0.5, t = 0 1 0 1 1; suffix precisions 3/5 3/4 2/3 2/2 1/1
    scores, correct = [0.3, 0.1, 0.5, 0.2, 0.4], [0, 0, 1, 1, 1]
    t = threshold(scores, correct, 0.6)
    assert (t.value, t.index, t.coverage, t.precision) == (0.1, 1, 1.0, 0.6)
    t = threshold(scores, correct, 0.7)
    assert (t.value, t.index, t.coverage, t.precision) == (0.2, 2, 0.8, 0.75)
    assert threshold(scores, correct, 0.8).value == 0.4  # 2/3 at 0.3 fails, 2/2 at 0.4
    assert threshold(scores, correct, 1.0).index == 4


def test_threshold_ties_count_every_equal_value():
    # sorted c = 0.1 0.2 0.2 0.3 with t = 1 0 1 1. The literal index formula could pick
    # ĵ = 3 (the second 0.2: suffix 2/2 = 1.0 >= 0.9) and τ = 0.2, but the rule c >= 0.2
    # then accepts both 0.2s (precision 2/3). Ties are evaluated as one group.
    t = threshold([0.1, 0.2, 0.2, 0.3], [1, 0, 1, 1], 0.9)
    assert (t.value, t.index, t.precision, t.coverage) == (0.3, 4, 1.0, 0.25)
    assert threshold([0.1, 0.2, 0.2, 0.3], [1, 1, 0, 1], 0.6).value == 0.1
    all_tied = threshold([0.5] * 4, [1, 1, 0, 1], 0.75)
    assert (all_tied.value, all_tied.index, all_tied.coverage) == (0.5, 1, 1.0)
    assert threshold([0.5] * 4, [1, 1, 0, 1], 0.8).value == math.inf


def test_threshold_all_correct_and_none_correct():
    t = threshold([0.4, 0.1, 0.7], [1, 1, 1], 1.0)
    assert (t.value, t.index, t.coverage, t.precision) == (0.1, 1, 1.0, 1.0)
    t = threshold([0.4, 0.1, 0.7], [0, 0, 0], 0.5)
    assert t.value == math.inf and t.index is None and t.coverage == 0.0 and math.isnan(t.precision)
    t = threshold([0.4, 0.1, 0.7], [0, 0, 0], 0.0)  # ε = 0 always exits
    assert (t.value, t.coverage) == (0.1, 1.0)


def test_thresholds_match_brute_force_on_random_vectors():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n = int(torch.randint(1, 15, (1,), generator=g))
        scores = (torch.randint(0, 5, (n,), generator=g) / 4).tolist()  # many ties
        correct = (torch.rand(n, generator=g) < 0.6).tolist()
        eps = [0.0, 0.25, 0.5, 0.6, 2 / 3, 0.75, 0.9, 1.0]
        got = [t.value for t in thresholds(scores, correct, eps)]
        assert got == [_paper_tau(scores, correct, e) for e in eps]


@pytest.mark.parametrize("eps", [-0.1, 1.5, float("nan")])
def test_threshold_rejects_bad_epsilon(eps):
    with pytest.raises(InvalidArgumentError):
        threshold([0.1], [1], eps)


# -------------------------------------------------------------------------- training


def test_training_lowers_kl_and_raises_agreement(trained):
    for before, after in zip(trained.before, trained.after):
        assert after.kl < 0.8 * before.kl
        assert after.agreement > before.agreement
    assert trained.loss_history[-1] < trained.loss_history[0]
    assert trained.train_tokens > 0 and trained.eval_tokens > 0


@pytest.mark.parametrize("config", [
    TrainConfig(kind="full", epochs=2, lr=1e-2, batch_tokens=64),
    TrainConfig(kind="full", init="random", epochs=2, lr=1e-2, batch_tokens=64),
    TrainConfig(loss="ce", epochs=2, lr=1e-2, batch_tokens=64),
    TrainConfig(kind="full", epochs=2, lr=1e-2, batch_tokens=64, loss_vocab=32),
    TrainConfig(loss="hybrid", kl_direction="reverse", epochs=2, lr=1e-2, batch_tokens=64,
                compute_dtype="fp32"),
])
def test_other_kinds_and_losses_train(executor, features, config):
    result = train_heads(output_layer(executor), features, [4], config, progress=False)
    assert result.loss_history[-1] < result.loss_history[0]


def test_train_config_validates():
    with pytest.raises(InvalidArgumentError):
        TrainConfig(loss="mse")
    with pytest.raises(InvalidArgumentError):
        TrainConfig(alpha=1.0)


# A restricted-vocabulary KL (TrainConfig.loss_vocab): our departure from AdaDecode §2.1's
# full-vocabulary KL, over the rows a reduced draft vocabulary of the same size keeps.


def test_restricted_kl_trains_on_the_draft_vocabulary_rows(executor, features):
    from selfspec.decoding.drafting.draft_vocab import frequent_rows

    eos = (255,)
    result = train_heads(output_layer(executor), features, [2, 4],
                         TrainConfig(epochs=4, lr=1e-2, batch_tokens=64, loss_vocab=32),
                         progress=False, eos_ids=eos)
    assert result.loss_history[-1] < 0.8 * result.loss_history[0]
    assert any(not torch.equal(h.transform, torch.eye(64)) for h in result.heads)
    # the rows: the 32 most frequent final-layer tokens of the training split, plus EOS ...
    train = features.teacher_token[features.indices(TRAIN)]
    expected = frequent_rows(torch.bincount(train, minlength=256), 32, eos).rows
    assert torch.equal(result.loss_rows, expected) and 32 <= result.loss_rows.numel() <= 33
    # ... which are exactly the rows draft_vocab=32 keeps with the counts the file stores
    heads = _heads(executor, result)
    calibrate(heads, features, epsilons=[0.9], draft_vocabs=[32], eos_ids=eos)
    assert torch.equal(frequent_rows(heads.token_counts, 32, eos).rows, result.loss_rows)
    # the full-vocabulary default is unchanged: no rows
    assert TrainConfig().loss_vocab == 0


def test_restricted_kl_equals_the_hand_computation():
    from torch import nn

    from selfspec.heads.modules import OutputLayer
    from selfspec.training.losses import Teacher, kl_divergence
    from selfspec.training.train import batch_loss, make_loss_vocab

    # E* [V=5, H=2], identity norm, T = [[1, 0], [0, 2]]: logits are easy to write down.
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    out = OutputLayer(nn.Identity(), weight, None)
    head = make_head("lightweight", 1, out, dtype=torch.float32)
    with torch.no_grad():
        head.transform.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    final = torch.tensor([[1.0, 2.0], [0.0, -1.0]])   # teacher logits E*·f
    hidden = torch.tensor([[2.0, 0.5], [1.0, 1.0]])   # head logits E*·T·h
    rows = torch.tensor([0, 2, 4])
    config = TrainConfig(compute_dtype="fp32", loss_vocab=3)
    loss = batch_loss([head], {1: hidden}, final, torch.zeros(2, dtype=torch.int64),
                      make_loss_vocab(out, rows), config)

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    teacher_rows = [[1.0, 3.0, -2.0], [0.0, -1.0, 1.0]]  # E*[rows]·f, by hand
    head_rows = [[2.0, 3.0, -1.0], [1.0, 3.0, -2.0]]     # E*[rows]·T·h, by hand
    hand = 0.0
    for zp, zq in zip(teacher_rows, head_rows):
        p, q = softmax(zp), softmax(zq)
        hand += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) / 2
    assert loss.item() == pytest.approx(hand, rel=1e-5)
    # a full head (its own copy of E*, no T) reads its own rows
    full_head = make_head("full", 1, out, dtype=torch.float32)
    full_loss = batch_loss([full_head], {1: hidden}, final, torch.zeros(2, dtype=torch.int64),
                           make_loss_vocab(out, rows), config)
    head_rows = [[2.0, 2.5, -0.5], [1.0, 2.0, -1.0]]      # E*[rows]·h, by hand
    hand_full = 0.0
    for zp, zq in zip(teacher_rows, head_rows):
        p, q = softmax(zp), softmax(zq)
        hand_full += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) / 2
    assert full_loss.item() == pytest.approx(hand_full, rel=1e-5)
    # it is not the full-vocabulary KL (the renormalisation matters)
    full = kl_divergence(head(hidden), Teacher.from_logits(final @ weight.T)).item()
    assert full != pytest.approx(hand, rel=1e-3)
    # and the full-vocabulary path gives the full KL
    assert batch_loss([head], {1: hidden}, final, torch.zeros(2, dtype=torch.int64),
                      make_loss_vocab(out, None),
                      TrainConfig(compute_dtype="fp32")).item() == pytest.approx(full, rel=1e-6)


def test_restricted_kl_options_are_checked(executor, features):
    with pytest.raises(InvalidArgumentError, match="loss_vocab"):
        TrainConfig(loss_vocab=-1)
    with pytest.raises(InvalidArgumentError, match="KL loss only"):
        TrainConfig(loss="hybrid", loss_vocab=64)
    with pytest.raises(InvalidArgumentError, match=r"loss_vocab must be in \[1, 256\]"):
        train_heads(output_layer(executor), features, [2], TrainConfig(loss_vocab=257),
                    progress=False)


def test_card_records_the_loss_vocabulary():
    from selfspec.heads.card import HeadCard, TrainingInfo

    card = new_card(tiny_model("llama"), "lightweight", [2])
    card.training = TrainingInfo(loss="kl", kl_direction="forward", alpha=0.5, data=["stdlib"],
                                 train_tokens=10, eval_tokens=5, epochs=1, lr=1e-3,
                                 batch_tokens=8, compute_dtype="fp32", feature_dtype="fp32",
                                 init="lm_head", seed=0, seconds=1.0, loss_vocab=16384)
    data = card.to_dict()
    assert HeadCard.from_dict(data).training.loss_vocab == 16384
    assert "16384 most frequent tokens" in card.training.loss_vocabulary()
    card.training.loss_vocab = 0
    assert card.training.loss_vocabulary() == "KL over the full vocabulary"


def test_splits_are_by_problem_and_stable():
    assert split_of("HumanEval/3") == split_of("HumanEval/3")
    splits = [split_of(f"HumanEval/{i}") for i in range(1000)]
    assert 0.75 < splits.count(TRAIN) / 1000 < 0.85
    assert splits.count(CALIBRATION) > 50 and splits.count(TEST) > 50


# ---------------------------------------------------------------------------- files


def test_save_load_roundtrip_gives_bit_exact_logits(executor, model, features, trained, tmp_path):
    heads = _heads(executor, trained)
    calibrate(heads, features, epsilons=[0.5, 0.9])
    path = save_heads(heads, tmp_path / "h")
    assert path == tmp_path / "h" / "heads.safetensors" and (tmp_path / "h" / "card.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as the umask allows, not mkstemp's 0600
    loaded = load_heads(tmp_path / "h", executor)
    assert loaded.layers == [2, 4] and loaded.card.kind == "lightweight"
    hidden = torch.randn(1, 6, 64)
    with torch.inference_mode():
        for mine, theirs in zip(heads.heads, loaded.heads):
            assert torch.equal(mine(hidden), theirs(hidden))
    assert loaded.thresholds(0.9, "entropy") == heads.thresholds(0.9, "entropy")
    assert len(loaded.thresholds(0.5, "max_prob")) == 2
    assert loaded.card.head_calibration(2).metric("entropy").thresholds[1].epsilon == 0.9
    # token counts for the draft vocabulary: the final layer's greedy tokens on train text
    train = features.teacher_token[features.indices(TRAIN)]
    assert torch.equal(heads.token_counts, torch.bincount(train, minlength=256))
    assert torch.equal(loaded.token_counts, heads.token_counts)
    vocab = build_step("layerskip", executor, {"exit_layer": 2, "heads": str(path),
                                                  "draft_vocab": 32})
    assert vocab is not None
    # also loads from the file path and from an HF model
    assert load_heads(path, model).layers == [2, 4]


def test_full_heads_roundtrip(executor, features, tmp_path):
    result = train_heads(output_layer(executor), features, [4],
                         TrainConfig(kind="full", epochs=1, batch_tokens=128), progress=False)
    card = new_card(executor, "full", [4])
    save_heads(ExitHeads([4], result.heads, card), tmp_path / "full.safetensors")
    loaded = load_heads(tmp_path / "full.safetensors", executor)
    hidden = torch.randn(1, 3, 64)
    with torch.inference_mode():
        assert torch.equal(loaded.heads[0](hidden), result.heads[0].eval()(hidden))


def test_uncalibrated_heads_say_so(executor, trained):
    with pytest.raises(NotCalibratedError, match="calibrate"):
        _heads(executor, trained).thresholds(0.9)


def test_heads_of_another_model_are_refused(executor, trained, tmp_path):
    save_heads(_heads(executor, trained), tmp_path)
    other = LayerExecutor(tiny_model("llama", seed=1))
    with pytest.raises(HeadsModelMismatchError, match="belong to model"):
        load_heads(tmp_path, other)
    deeper = LayerExecutor(tiny_model("llama", num_layers=8))
    with pytest.raises(HeadsModelMismatchError):
        load_heads(tmp_path, deeper)


def test_heads_load_onto_the_same_model_in_another_dtype(model, trained, tmp_path):
    ex = LayerExecutor(model)
    save_heads(_heads(ex, trained), tmp_path)
    bf16 = LayerExecutor(tiny_model("llama", dtype=torch.bfloat16))
    loaded = load_heads(tmp_path, bf16)
    assert loaded.heads[0].transform.dtype == torch.bfloat16


def test_truncated_or_foreign_head_file_is_corrupt(executor, trained, tmp_path):
    path = save_heads(_heads(executor, trained), tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelFileError, match="truncated or damaged"):
        load_heads(tmp_path, executor)
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(CorruptModelFileError):
        load_heads(tmp_path, executor)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(CorruptModelFileError, match="not a selfspec head file") as err:
        load_heads(tmp_path, executor)
    # A foreign safetensors file (say the model's own weights) is never to be deleted.
    assert "delete" not in str(err.value).lower()


def test_card_naming_a_layer_beyond_the_model_fails_at_load(executor, trained, tmp_path):
    heads = _heads(executor, trained)
    heads.layers[-1] = heads.card.layers[-1] = executor.num_layers + 10
    save_heads(heads, tmp_path)
    with pytest.raises(HeadsModelMismatchError,
                       match=f"exit head at layer {executor.num_layers + 10}"):
        load_heads(tmp_path, executor)


def test_exit_layer_without_a_head_is_an_error_not_an_lm_head_draft(executor, trained, tmp_path):
    path = save_heads(_heads(executor, trained), tmp_path)  # heads at layers 2 and 4
    with pytest.raises(InvalidArgumentError,
                       match=r"exit heads at layers \[2, 4\], not at exit layer 3"):
        build_step("layerskip", executor, {"exit_layer": 3, "heads": str(path)})
    with_head = build_step("layerskip", executor, {"exit_layer": 4, "heads": str(path)})
    assert with_head.drafter.policy.head is not None
    # Without exit_layer the head nearest 3/4 of the depth drafts (never the lm_head).
    default = build_step("layerskip", executor, {"heads": str(path)})
    assert default.drafter.policy.head is not None


def test_missing_default_heads_say_how_to_train(executor, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    engine = from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), "tiny-llama")
    with pytest.raises(HeadsNotFoundError, match="selfspec heads train --model tiny-llama"):
        load_heads("default", engine)
    with pytest.raises(HeadsNotFoundError, match="train-probe --model tiny-llama"):
        load_heads("default-probes", engine)


def test_a_bare_name_reads_a_folder_beside_the_default_heads(trained, tmp_path, monkeypatch):
    """``heads=lensstate`` finds ``$SELFSPEC_HOME/heads/<model>/lensstate``; a local folder of
    that name wins, and a write target (``save_heads``) keeps its own meaning."""
    from selfspec.heads.files import default_heads_dir, find_head_file, read_head_file

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    engine = from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), "tiny-llama")
    ex = engine.executor
    named = default_heads_dir("tiny-llama").parent / "mine"
    saved = save_heads(_heads(ex, trained), named)
    assert find_head_file("mine", "tiny-llama") == saved
    assert load_heads("mine", engine).layers == [2, 4]
    with pytest.raises(HeadsNotFoundError, match="where a bare name is looked up"):
        load_heads("other", engine)
    assert read_head_file("mine", "tiny-llama").card.layers == [2, 4]
    with pytest.raises(HeadsNotFoundError, match="where a bare name is looked up"):
        read_head_file("other", "tiny-llama")
    # A local folder of that name is what the name means.
    local = save_heads(_heads(ex, trained), tmp_path / "mine")
    assert find_head_file("mine", "tiny-llama").resolve() == local.resolve()
    # Names with folders are paths only.
    assert find_head_file("x/mine", "tiny-llama") == Path("x/mine/heads.safetensors")


# ------------------------------------------------------------------------ interrupts


def test_interrupted_training_leaves_the_old_file_intact(executor, features, trained, tmp_path,
                                                          monkeypatch):
    import selfspec.training.train as train_mod

    path = save_heads(_heads(executor, trained), tmp_path)
    before = path.read_bytes()
    calls = {"n": 0}
    real = train_mod.head_loss

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "head_loss", interrupting)
    with pytest.raises(KeyboardInterrupt):
        train_heads(output_layer(executor), features, [2, 4], TrainConfig(batch_tokens=64),
                    progress=False)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.json", "heads.safetensors"]


def test_interrupted_save_leaves_no_partial_file(executor, trained, tmp_path, monkeypatch):
    path = save_heads(_heads(executor, trained), tmp_path)
    before = path.read_bytes()
    real = Path.write_bytes

    def half_then_interrupt(self, data):  # the process is stopped halfway through the write
        real(self, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_heads(_heads(executor, trained), tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.json", "heads.safetensors"]
    assert load_heads(tmp_path, executor).layers == [2, 4]


def test_interrupted_feature_pass_writes_no_cache_file(executor, tmp_path, monkeypatch):
    import selfspec.training.features as features_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(features_mod, "backbone_pass", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_features(executor, _items(5), [2], tmp_path)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_feature_cache_is_reused_and_extended(executor, tmp_path, monkeypatch):
    import selfspec.training.features as features_mod

    items = _items(6)
    first = load_features(executor, items, [2], tmp_path, progress=False)
    passes = {"n": 0}
    real = features_mod.backbone_pass

    def counting(*args, **kwargs):
        passes["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(features_mod, "backbone_pass", counting)
    again = load_features(executor, items, [2], tmp_path, progress=False)
    assert passes["n"] == 0 and torch.equal(again.hidden[2], first.hidden[2])
    more = load_features(executor, items, [2, 4], tmp_path, progress=False)
    assert passes["n"] == 1 and torch.equal(more.hidden[2], first.hidden[2])
    assert torch.equal(more.teacher_token, first.teacher_token)


# ----------------------------------------------------------------------------- probes


def test_probe_learns_a_separable_task_above_chance():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2000, 32, generator=g) * 5 + 40  # large offsets, like real states
    direction = torch.randn(32, generator=g)
    accepted = (hidden - 40) @ direction > 2.0  # ~35% positives
    probe = fit_probe(7, hidden[:1500], accepted[:1500])
    prob = probe(hidden[1500:].unsqueeze(0))[0]
    assert prob.shape == (500,) and ((prob >= 0) & (prob <= 1)).all()
    accuracy = ((prob >= 0.5) == accepted[1500:]).float().mean().item()
    chance = max(accepted[1500:].float().mean().item(), 1 - accepted[1500:].float().mean().item())
    assert accuracy > chance + 0.2 and accuracy > 0.9


def test_probe_roundtrips_through_a_head_file(executor, tmp_path):
    probe = fit_probe(3, torch.randn(100, 64), torch.rand(100) > 0.5)
    container = ExitHeads([], [], new_card(executor, None, []), probes={3: probe})
    save_heads(container, tmp_path)
    loaded = load_heads(tmp_path, executor)
    hidden = torch.randn(1, 4, 64)
    assert torch.equal(loaded.probe_at(3)(hidden), probe(hidden))
    with pytest.raises(InvalidArgumentError, match="train-probe"):
        loaded.probe_at(5)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                        ("llama", torch.bfloat16)])
def test_batched_onpolicy_generation_is_each_prompts_greedy_answer(arch, dtype):
    """Batched on-policy generation gives every prompt of a ragged batch its own greedy
    continuation, cut after EOS; a prompt that cannot make EOS runs to the length cap."""
    from selfspec.training.onpolicy import generate_greedy_batch

    engine = from_pretrained_model(tiny_model(arch, seed=5, dtype=dtype), tiny_tokenizer(),
                                   name="tiny")
    prompts = [engine.encode(t) for t in ("def f(x):", "a", "Hello, world! Print it.",
                                          "x = [1, 2, 3]\nfor i in x:\n    print(i * 2)\n")]
    eos = max(engine.eos_token_ids)
    outputs = generate_greedy_batch(engine, prompts, max_new_tokens=24)
    for ids, new in zip(prompts, outputs, strict=True):
        ref = engine.generate(ids, max_new_tokens=24).token_ids
        assert new == ref
        assert len(new) == 24 or new[-1] == eos


def test_loaded_heads_do_not_change_when_their_file_is_rewritten_in_place(
        executor, features, trained, tmp_path):
    """safetensors maps files into memory: loaded heads must hold copies, or `cp` over a head
    file would silently change a running process's thresholds."""
    heads = _heads(executor, trained)
    calibrate(heads, features, epsilons=[0.9])
    path = save_heads(heads, tmp_path / "a")
    loaded = load_heads(path, executor)
    before = {layer: d.scores["entropy"].clone() for layer, d in loaded.calibration.items()}
    for data in heads.calibration.values():
        data.scores["entropy"] = torch.full_like(data.scores["entropy"], -50.0)
    other = save_heads(heads, tmp_path / "b")
    with open(path, "r+b") as f:  # in place, as cp does (same inode)
        f.write(other.read_bytes())
    reread = load_heads(path, executor)
    for layer, scores in before.items():
        assert torch.all(reread.calibration[layer].scores["entropy"] == -50.0)
        assert torch.equal(loaded.calibration[layer].scores["entropy"], scores)


def test_data_spec_weights_give_a_source_k_times_the_share(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from selfspec.training import corpus

    assert corpus.parse_data_spec("stdlib, onpolicy:stdlib*3") == ["stdlib", "onpolicy:stdlib*3"]
    assert corpus.source_weight("onpolicy:stdlib*3") == ("onpolicy:stdlib", 3)
    assert corpus.dataset_of("onpolicy:stdlib*3") == "stdlib"
    for bad, match in [("stdlib*0", "weight"), ("stdlib*x", "weight"),
                       ("stdlib,stdlib*2", "twice"), ("nope*2", "unknown")]:
        with pytest.raises(InvalidArgumentError, match=match):
            corpus.parse_data_spec(bad)
    budgets = []

    def record(prompts, budget, make, max_len):
        budgets.append(budget.tokens)
        return []

    monkeypatch.setattr(corpus, "select_items", record)
    monkeypatch.setattr(corpus, "load_dataset_prompts", lambda name: [])
    engine = SimpleNamespace(executor=SimpleNamespace(max_positions=64))
    corpus.build_corpus(engine, ["stdlib", "onpolicy:stdlib*3"], 4000, tmp_path, progress=False)
    assert budgets == [(1000, 250, 250), (3000, 750, 750)]
