import sys
from pathlib import Path

import pytest
import torch

# Make tests/tiny.py importable as `tiny` from every test module.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny-model tests run single-threaded: on tensors this small, waking a second
    intra-op thread costs far more than it saves (tens of times slower on a 2-core VM).
    Tests on the real model keep the default thread count."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
