"""Row consistency of the packed decoding kernel (``selfspec.executor.linear``).

Lossless verification needs each row of a verification block to equal one-token decoding
bit for bit. oneDNN's packed kernel does not promise that for every shape and row count (on a
Xeon with AMX a ``[1536, 8960]`` weight rounds calls of 12-23 rows differently), so the
kernel here is replaced by one that rounds differently from a given row count on, as such a
CPU does, and every block size must still give the rows of one-token decoding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec.executor import linear
from selfspec.executor.linear import Linear, PackedRowLimits


def _drifting_kernel(first_bad: int):
    """A packed-kernel stand-in (weight kept unpacked) whose calls of ``first_bad`` or more
    rows round their outputs differently from smaller calls."""
    def kernel(x, packed, bias):
        out = F.linear(x.float(), packed.float(), None if bias is None else bias.float())
        if x.reshape(-1, x.shape[-1]).shape[0] >= first_bad:
            out = out + out.abs() * 2.0 ** -9  # a last-bit difference in bf16
        return out.to(x.dtype)
    return kernel


@pytest.mark.parametrize("first_bad", [3, 12, 65])
def test_blocks_of_any_size_equal_one_row_decoding(monkeypatch: pytest.MonkeyPatch,
                                                   first_bad: int) -> None:
    monkeypatch.setattr(linear, "_packed", _drifting_kernel(first_bad))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).bfloat16()
    limits = PackedRowLimits(max_rows=64)
    lin = Linear(weight, None, pack=False, row_limits=limits)
    lin.packed = weight  # the stand-in kernel reads the plain weight
    x = torch.randn(70, 40, generator=gen).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
    for rows in (2, 3, 5, 11, 12, 13, 24, 64, 70):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    assert (limits._limits[("onednn", 40, 48, False, torch.get_num_threads())].chunk
            == min(first_bad - 1, 64))
    # One probe per shape and thread count, shared by every linear of that shape.
    other = Linear(weight.clone(), None, pack=False, row_limits=limits)
    other.packed = other.weight
    other(x[:5])
    assert len(limits._limits) == 1


def _window_kernel(bad: range, calls: list[int]):
    """A packed-kernel stand-in whose calls of ``bad`` row counts round differently (a Xeon
    with AMX: Qwen2.5-1.5B's ``down_proj`` in calls of 12-23 rows at 2 threads)."""
    def kernel(x, packed, bias):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        calls.append(rows)
        out = F.linear(x.float(), packed.float(), None if bias is None else bias.float())
        if rows in bad:
            out = out + out.abs() * 2.0 ** -9
        return out.to(x.dtype)
    return kernel


def test_blocks_of_an_inconsistent_size_are_padded_to_one_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of a row count that rounds differently takes one call padded to the next
    consistent count (one read of the weight), not a split into chunks (one read each)."""
    calls: list[int] = []
    monkeypatch.setattr(linear, "_packed", _window_kernel(range(12, 24), calls))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).bfloat16()
    limits = PackedRowLimits(max_rows=32)
    lin = Linear(weight, None, pack=False, row_limits=limits)
    lin.packed = weight
    x = torch.randn(80, 40, generator=gen).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(80)])
    lin(x[:2])  # the probe runs at the first multi-row call
    sizes = limits._limits[("onednn", 40, 48, False, torch.get_num_threads())]
    assert sizes.chunk == 32
    assert [sizes.call_rows[r] for r in (2, 11, 12, 17, 23, 24, 32)] == [2, 11, 24, 24, 24, 24, 32]
    for rows in (12, 17, 23):
        calls.clear()
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
        assert calls == [24], (rows, calls)
    calls.clear()
    assert torch.equal(lin(x[:77]), alone[:77])  # 32 + 32 + 13 (padded to 24)
    assert calls == [32, 32, 24]


def test_free_blocks_take_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def kernel(x, packed, bias):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return F.linear(x, packed, bias)

    monkeypatch.setattr(linear, "_packed", kernel)
    weight = torch.randn(8, 16).bfloat16()
    lin = Linear(weight, None, pack=False, row_limits=PackedRowLimits(max_rows=4))
    lin.packed = weight
    lin(torch.randn(100, 16).bfloat16(), bulk=True)  # prefill: no probe, no split
    assert calls == [100]


def test_a_packed_kernel_close_to_f_linear_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing is kept when the kernel agrees with F.linear to bf16 precision, not only bit
    for bit (verification and decoding both use it), and refused when it is wrong."""
    if not linear._can_pack(torch.zeros(4, 4, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN weight packing in this torch build")
    weight = torch.randn(32, 64).bfloat16()
    drift = _drifting_kernel(1)
    # The stand-in kernel reads the plain weight, so no real packing is needed (CPUs
    # without AVX-512 have none for bf16).
    monkeypatch.setattr(linear, "_reorder", lambda w: w)
    monkeypatch.setattr(linear, "_packed", lambda x, packed, bias: drift(x, weight, bias))
    assert linear._try_pack(weight, None) is not None
    monkeypatch.setattr(linear, "_packed", lambda x, p, b: torch.zeros(x.shape[0], 32,
                                                                      dtype=x.dtype))
    assert linear._try_pack(weight, None) is None
