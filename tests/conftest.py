import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Make tests/tiny.py importable as `tiny` from every test module.
sys.path.insert(0, str(Path(__file__).parent))

# Under pytest-xdist (the README's `-n 2`) every worker runs single-threaded: two workers keep
# both cores busy, and a second intra-op thread per worker would spin against the other
# worker's (OpenMP's busy wait), making the real-model tests 2-5x slower.
_DEFAULT_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else torch.get_num_threads()


def pytest_configure(config):
    """Tiny-model tests run single-threaded: on tensors this small, waking a second
    intra-op thread costs far more than it saves (tens of times slower on a 2-core VM).
    Set here, not only per test, so module-scoped fixtures (models, trained heads) get it."""
    torch.set_num_threads(1)
    _plant_rule()


def _plant_rule():
    """``scripts/mutation_check.py`` sets ``SELFSPEC_PLANT_RULE`` to plant a wrong
    speculative-sampling rule (tests/mutations.py) for the whole session; unset, nothing."""
    rule = os.environ.get("SELFSPEC_PLANT_RULE")
    if rule:
        from mutations import plant

        plant(pytest.MonkeyPatch(), rule)


REAL_MODEL = "smollm2-135m-instruct"
_prefetch: subprocess.Popen | None = None


def pytest_collection_finish(session):
    """The tests are collected: freeze what exists, fetch the real model if it is needed."""
    _freeze_collected()
    _prefetch_real_model(session)


def _freeze_collected():
    """What exists once the tests are collected (torch, transformers, selfspec, the test
    modules: ~0.4 M objects) lives for the whole session. Frozen, it is out of the cyclic
    collector's reach: its full passes (each ~0.2 s over all of that) then scan only what
    the tests create."""
    gc.collect()
    gc.freeze()


def _prefetch_real_model(session):
    """On a machine without the real model's cache entry (a fresh CI machine), fetch it in a
    background process as soon as the selected tests are known to need it: the download
    waits on the network and the conversion takes a core that the single-threaded
    tiny-model tests leave idle, so the first test on the real model (the fetch is ~25 s)
    usually finds it ready. The tests' own ``fetch``/``load`` take the entry's lock and wait
    for this fetch, then find the entry cached (provision's concurrent-fetch rule); if it
    failed, they fetch themselves and report the error."""
    global _prefetch
    if session.config.option.collectonly or not any(
            item.get_closest_marker("real_model") for item in session.items):
        return
    import selfspec
    from selfspec.models import is_cached

    if is_cached(REAL_MODEL, "fp32"):
        return
    # The selfspec these tests import (a checkout on PYTHONPATH or an install), one thread,
    # and a lower priority: it should take only what the tests leave idle.
    src = str(Path(selfspec.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    nice = shutil.which("nice")
    _prefetch = subprocess.Popen(
        [*([nice, "-n", "10"] if nice else []), sys.executable, "-c",
         f"from selfspec.models import fetch; fetch({REAL_MODEL!r}, 'fp32', show_progress=False)"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def pytest_unconfigure(config):
    """A fetch still running when the tests end (none needed it yet) is stopped; the next
    fetch removes what it left (provision's leftovers rule)."""
    if _prefetch is not None and _prefetch.poll() is None:
        _prefetch.terminate()
        _prefetch.wait()


@pytest.fixture(autouse=True, scope="session")
def _latency_cache(tmp_path_factory):
    """Latency models that methods measure during tests go to a temporary directory, not to
    the user's ``$SELFSPEC_HOME/latency``: a tiny random model's file from an earlier run would
    otherwise be read back (tests would depend on what ran before) and files named after
    pytest's temporary model paths would pile up there.

    They are measured lightly (two context lengths, three repeats, verification sizes up to
    the 16/17-row step only, which covers the default draft lengths of ``auto`` and KnapSpec;
    beyond, the fitted per-token cost): a latency model only steers which drafts run, never
    the tokens (every method's output is checked against ``ar``), and the full measurement
    of the real model costs minutes of the suite (the verification table alone ~6 s of CPU
    for each kernel of it measured). Tests of the measurement itself import
    ``measure_latency`` directly and get the full one."""
    import functools

    from selfspec.executor import cost_model
    from selfspec.executor.cost_model import cached_latency
    from selfspec.methods import base

    home = tmp_path_factory.mktemp("selfspec-home")
    light = functools.partial(cost_model.measure_latency, lengths=(64, 256), repeats=3,
                              verify_tokens=(1, 2, 4, 8, 16, 17))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost_model, "measure_latency", light)
        patch.setattr(base, "cached_latency",
                      lambda executor, _home: cached_latency(executor, home))
        yield


@pytest.fixture(autouse=True, scope="session")
def _stdlib_prompts_parsed_once():
    """The ``stdlib`` prompt set (every documented function of this interpreter's standard
    library: ~2.5 s of parsing) is built once per session and handed out as a new list each
    time: the heads, skip-search and training-data tests that train or calibrate on it
    would otherwise each parse the standard library again. Its selection rules are tested on
    ``prompts_of_file`` directly (test_training_data)."""
    from selfspec.data import stdlib

    built = {}
    parse = stdlib.all_prompts

    def all_prompts(root=None):
        key = None if root is None else str(root)
        if key not in built:
            built[key] = parse(root)
        return list(built[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stdlib, "all_prompts", all_prompts)
        yield


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real default model in fp32, loaded once for the whole session (tests that change
    the engine's settings load their own)."""
    import selfspec

    return selfspec.load(REAL_MODEL, dtype="fp32", show_progress=False)


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The real default model in bf16 (the float32 entry cast, as ``selfspec.load`` does),
    loaded once for the whole session. Tests that switch its kernels take it through
    test_real_model's ``bf16_engine``, which puts the load's settings back."""
    import selfspec

    return selfspec.load(REAL_MODEL, dtype="bf16", show_progress=False)


@pytest.fixture(autouse=True)
def _threads(request):
    """Tests on the real model run with the default thread count."""
    if not request.node.get_closest_marker("real_model"):
        yield
        return
    torch.set_num_threads(_DEFAULT_THREADS)
    yield
    torch.set_num_threads(1)
