"""An engine that no Ray node can hold is one clear error before a job or a deployment
starts (cluster/resources.py)."""

from __future__ import annotations

import pytest

from selfspec.cluster.resources import check_fits, engine_bytes
from selfspec.errors import InvalidArgumentError

from tiny import save_tiny


class _Cluster:
    def __init__(self, *memory: int) -> None:
        self._nodes = [{"Alive": True, "Resources": {"memory": m}} for m in memory]
        self._nodes.append({"Alive": False, "Resources": {"memory": 1 << 40}})  # a dead node

    def nodes(self):
        return self._nodes


def test_the_engines_size_comes_from_its_safetensors(tmp_path):
    model = save_tiny(tmp_path / "m", "llama")
    fp32, bf16 = engine_bytes({"model": str(model), "dtype": "fp32"}), engine_bytes(
        {"model": str(model), "dtype": "bf16"})
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))  # stored in fp32
    assert fp32 == pytest.approx(1.3 * weights, rel=0.02) and bf16 == pytest.approx(fp32 / 2)
    assert engine_bytes({"model": "some-org/not-fetched", "dtype": "bf16"}) is None


def test_a_model_no_node_holds_is_refused_naming_both_sizes():
    check_fits(_Cluster(8 << 30, 2 << 30), 6 << 30, "engine replica")
    check_fits(_Cluster(), None, "engine replica")  # size unknown: Ray decides
    with pytest.raises(InvalidArgumentError, match=r"needs about 6\.0 GiB.*offers 4\.0 GiB"):
        check_fits(_Cluster(4 << 30, 2 << 30), 6 << 30, "engine replica")
