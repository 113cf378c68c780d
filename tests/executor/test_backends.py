"""The executor as a core plus backends: each matrix's backend is chosen once, as a function
of (device, format); the executor's public entry points are the contract's."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from selfspec.executor import LayerExecutor, backends
from selfspec.executor import formats as formats_module
from selfspec.executor.backends import (
    BACKEND_DEVICES,
    BackendCache,
    MatrixBackend,
    runs_on,
    select_backend,
)
from selfspec.executor.bf16_rows import Bf16Rows, bf16_rows_available
from selfspec.executor.contract import Executor
from selfspec.executor.cpu import ComputeFormats
from selfspec.executor.fp16_rows import Fp16Rows, fbgemm_fp16_available
from selfspec.executor.int4_rows import Int4Rows, int4_available
from selfspec.executor.linear import ChainRows
from selfspec.executor.w4a8 import W4A8Rows, w4a8_available

from tiny import tiny_model

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _available(fmt: str) -> bool:
    return {"bf16": bf16_rows_available,
            "bf16+fp16": lambda: bf16_rows_available() and fbgemm_fp16_available(),
            "fp16": fbgemm_fp16_available, "int4": int4_available,
            "w4a8": w4a8_available}[fmt]()


@pytest.mark.parametrize("fmt", sorted(BACKEND_DEVICES))
def test_cpu_only_backends_are_never_chosen_for_another_device(fmt):
    for device in (torch.device("meta"), torch.device("cuda"), "cuda:1"):
        assert not runs_on(fmt, device)
        assert select_backend(device, fmt, 0, 64) is None
        assert BackendCache(torch.device(device), 64).get(fmt, 0) is None


@pytest.mark.parametrize("fmt", sorted(set(BACKEND_DEVICES) - {"gguf", "gguf+dense"}))
def test_the_backend_is_a_function_of_device_and_format(fmt):
    if not _available(fmt):
        pytest.skip(f"{fmt} kernel not available here")
    expected = {"bf16": Bf16Rows, "bf16+fp16": ChainRows, "fp16": Fp16Rows, "int4": Int4Rows,
                "w4a8": W4A8Rows}[fmt]
    backend = select_backend(torch.device("cpu"), fmt, 0, 64)
    assert type(backend) is expected and isinstance(backend, MatrixBackend)
    assert select_backend("cpu", "weights") is None
    cache = BackendCache(torch.device("cpu"), 64)
    assert cache.get(fmt, 0) is cache.get(fmt, 0)  # one object per (format, threshold)


def test_the_gguf_backend_is_provided_from_a_file_not_built_from_its_name():
    """``gguf`` is the one family built from more than its name (a file's blocks): asked
    for without one it is an error that says how to load, never a silent fallback; once
    provided, every threshold finds it."""
    from selfspec.errors import InvalidArgumentError

    for fmt in ("gguf", "gguf+dense"):
        with pytest.raises(InvalidArgumentError, match="dtype 'gguf'"):
            select_backend(torch.device("cpu"), fmt, 0, 64)
    cache = BackendCache(torch.device("cpu"), 64)
    assert not cache.has("gguf")
    backend = object()
    cache.provide("gguf", backend)
    assert cache.has("gguf") and cache.get("gguf", 4 << 20) is backend


def test_a_cpu_only_format_on_another_device_leaves_every_matrix_on_its_weights(monkeypatch):
    """The device seam: an executor records its weights' device, and a format whose kernels
    run only on CPUs gives no backend there (here: a model on the meta device asked for
    ``bf16`` rows, as a CUDA model would be until a CUDA backend registers)."""
    model = tiny_model("llama", dtype=torch.bfloat16).to("meta")
    chosen = []

    def formats(dtype, device, bulk, rows, largest_matrix_bytes=None):
        chosen.append(torch.device(device).type)
        return ComputeFormats(dtype, dtype, "test", "bf16", 0)

    monkeypatch.setattr(formats_module, "choose_formats", formats)
    ex = LayerExecutor(model)
    assert ex.device.type == "meta" and chosen == ["meta"]
    assert ex.formats.rows == "bf16" and ex.backend is None
    assert all(lin.rows is None and lin.packed is None
               for w in ex.layer_weights for lin in w.matrices)
    assert ex.output_weights.rows is None and ex.fused_layers() is None


@pytest.mark.parametrize("fmt", ["bf16", "int4", "w4a8"])
def test_each_matrix_is_prepacked_once_per_backend(fmt, monkeypatch):
    """Switching the decoding kernel back and forth reuses each matrix's copy: the choice
    (and the copy) is made once per matrix and backend."""
    if not _available(fmt):
        pytest.skip(f"{fmt} kernel not available here")
    calls = []
    kind = {"bf16": Bf16Rows, "int4": Int4Rows, "w4a8": W4A8Rows}[fmt]
    original = kind.prepack

    def counting(self, weight, bias):
        calls.append(weight.data_ptr())
        return original(self, weight, bias)

    monkeypatch.setattr(kind, "prepack", counting)
    ex = LayerExecutor(tiny_model("qwen2", dtype=torch.bfloat16), rows="weights")
    assert ex.backend is None and not calls
    ex.set_decode_kernel(fmt)
    first = ex.backend
    matrices = 4 * ex.num_layers + 1
    assert len(calls) == matrices == len(set(calls))
    ex.set_decode_kernel("weights")
    assert ex.backend is None
    ex.set_decode_kernel(fmt)
    assert ex.backend is first and len(calls) == matrices
    assert all(lin.rows is first for w in ex.layer_weights for lin in w.matrices)


def test_bytes_per_call_come_from_the_backend():
    """Byte accounting lives in the cost model and asks each matrix's backend."""
    from selfspec.executor import cost_model

    ex = LayerExecutor(tiny_model("qwen2", dtype=torch.bfloat16), rows="weights")
    weights = sum(lin.weight.numel() * 2 + (0 if lin.bias is None else lin.bias.numel() * 2)
                  for w in ex.layer_weights for lin in w.matrices)
    norms = sum(t.numel() * 2 for w in ex.layer_weights for t in (w.attn_norm, w.mlp_norm))
    head = ex.lm_head.weight.numel() * 2
    final = sum(p.numel() * 2 for p in ex.norm.parameters())
    assert cost_model.decode_weight_bytes(ex) == weights + norms + head + final
    assert ex.decode_weight_bytes() == cost_model.decode_weight_bytes(ex)
    assert ex.output_decode_bytes == cost_model.output_decode_bytes(ex) == head
    assert ex.decode_layer_bytes(1) == cost_model.decode_layer_bytes(ex, 1)
    if _available("int4"):
        ex.set_decode_kernel("int4")
        lin = ex.layer_weights[0].qkv
        assert lin.decode_bytes == lin.rows.decode_bytes(lin.rows_weight, lin.weight,
                                                         lin.bias) == lin.rows_weight.nbytes
        assert cost_model.decode_weight_bytes(ex) < weights + norms + head + final


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_lists_every_public_entry_point_with_its_signature():
    ex = LayerExecutor(tiny_model("llama"))
    members = _public(Executor) | set(Executor.__annotations__)
    public = _public(LayerExecutor) | {n for n in vars(ex) if not n.startswith("_")}
    assert public == members, (public - members, members - public)
    for name in _public(Executor):
        want = getattr(Executor, name)
        got = getattr(LayerExecutor, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
            continue
        assert _params(got) == _params(want), name


def test_the_design_doc_names_every_public_entry_point():
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## Executor contract", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)", section))
    members = _public(Executor) | set(Executor.__annotations__)
    assert members <= named, sorted(members - named)


def test_backends_module_keeps_cpu_kernels_behind_the_device_table():
    assert set(BACKEND_DEVICES) == {"bf16", "bf16+fp16", "fp16", "int4", "w4a8", "gguf",
                                    "gguf+dense"}
    assert all(devices == ("cpu",) for devices in BACKEND_DEVICES.values())
    assert backends.select_backend("cpu", "weights") is None
