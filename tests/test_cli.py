"""The CLI turns selfspec errors into one clear line and exit status 2."""

import pytest

from selfspec.cli import main


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "no-such-model", "hi"], "smollm2-135m-instruct"),
    (["generate", "--top-p", "0", "hi"], "--top-p: must be a finite number in (0, 1]"),
    (["generate", "--temperature", "-1", "hi"],
     "--temperature: must be a finite number in [0, inf)"),
    (["generate", "--max-new-tokens", "0", "hi"], "--max-new-tokens: must be an integer >= 1"),
    (["generate", "--method", "medusa", "hi"], "known methods: ar, layerskip, dv, adaspeed"),
    (["models", "fetch", "no-such-model"], "known"),
    (["generate", "--method", "adadecode:gamma=1.5", "hi"], "gamma must be a number in [0, 1)"),
    (["generate", "--method", "adadecode:gamma=0.9", "--gamma", "0.8", "hi"], "give it once"),
    (["generate", "--method", "hf-prompt-lookup:draft_len=4", "hi"], "selfspec bench"),
    (["serve", "--method", "adadecode:gamma=2"], "gamma must be a number in [0, 1)"),
])
def test_errors_are_one_line_with_exit_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_models_list_names_the_registry(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out and "qwen2.5-coder-1.5b-instruct" in out


def test_generate_takes_a_bench_row_label_with_its_options():
    """`--method` accepts what a bench report's method column prints: the options it carries
    become the flags, so the best row of a report runs as it is."""
    import argparse

    from selfspec.cli import apply_method_spec

    args = argparse.Namespace(method="adadecode:draft_vocab=4096,gamma=0.9,decode_kernel=fp16",
                              draft_vocab=None, gamma=0.9, decode_kernel="auto")
    apply_method_spec(args)
    assert (args.method, args.draft_vocab, args.gamma, args.decode_kernel) == (
        "adadecode", 4096, 0.9, "fp16")


def test_models_latency_shows_and_remeasures_a_draft_views_own_model(monkeypatch, tmp_path, capsys):
    """`models latency --draft-weights int8` keeps the quantized draft copies' latencies in
    their own file (what knapspec:draft_weights=int8 decides by) and can re-measure them."""
    import types

    import selfspec
    from selfspec.executor import LayerExecutor
    from selfspec.executor.quant import quantized_kernels_available
    from selfspec.models import provision

    from tiny import tiny_model

    if not quantized_kernels_available("int8"):
        pytest.skip("no int8 kernel here")
    ex = LayerExecutor(tiny_model("llama", seed=4).float())
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: types.SimpleNamespace(executor=ex))
    monkeypatch.setattr(provision, "selfspec_home", lambda: tmp_path)
    assert main(["models", "latency", "--draft-weights", "int8"]) == 0
    first = capsys.readouterr().out
    assert "-draftint8-" in first and "measured now" in first
    assert main(["models", "latency", "--draft-weights", "int8"]) == 0
    assert "read (measured" in capsys.readouterr().out
    assert main(["models", "latency", "--draft-weights", "int8", "--remeasure"]) == 0
    assert "measured now" in capsys.readouterr().out
    assert len(list((tmp_path / "latency").iterdir())) == 1
