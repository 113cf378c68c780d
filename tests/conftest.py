import sys
from pathlib import Path

import pytest
import torch

# Make tests/tiny.py importable as `tiny` from every test module.
sys.path.insert(0, str(Path(__file__).parent))

_DEFAULT_THREADS = torch.get_num_threads()


def pytest_configure(config):
    """Tiny-model tests run single-threaded: on tensors this small, waking a second
    intra-op thread costs far more than it saves (tens of times slower on a 2-core VM).
    Set here, not only per test, so module-scoped fixtures (models, trained heads) get it."""
    torch.set_num_threads(1)


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
        patch.setattr(base, "cached_latency", lambda executor, _home: cached_latency(executor, home))
        yield


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real default model in fp32, loaded once for the whole session (tests that change
    the engine's settings load their own)."""
    import selfspec

    return selfspec.load("smollm2-135m-instruct", dtype="fp32", show_progress=False)


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The real default model in bf16 (the float32 entry cast, as ``selfspec.load`` does),
    loaded once for the whole session. Tests that switch its kernels take it through
    test_real_model's ``bf16_engine``, which puts the load's settings back."""
    import selfspec

    return selfspec.load("smollm2-135m-instruct", dtype="bf16", show_progress=False)


@pytest.fixture(autouse=True)
def _threads(request):
    """Tests on the real model run with the default thread count."""
    if not request.node.get_closest_marker("real_model"):
        yield
        return
    torch.set_num_threads(_DEFAULT_THREADS)
    yield
    torch.set_num_threads(1)
