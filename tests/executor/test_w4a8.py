"""selfspec's AVX2 W4A8 draft kernel (executor/w4a8.py, executor/kernels/w4a8_rows.cpp): it
computes exactly the integer arithmetic of its scheme (4-bit weight codes and 8-bit
activation codes per block of 32, fp32 scales), whatever the rows, threads and block count,
and drafting on it keeps the model's greedy tokens (tests/decoding/test_quant.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.errors import InvalidArgumentError
from selfspec.executor import w4a8
from selfspec.executor.w4a8 import W4A8Linear, dequantize_q4, kernel_layout, quantize_q4

needs_kernel = pytest.mark.skipif(
    not w4a8.w4a8_available(), reason=f"w4a8 kernel unavailable: {w4a8.w4a8_unavailable_reason()}")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The scheme in float64 from the same codes: per block, the activation codes' dot
    products with the weight codes and with the block's minimum, times the scales, summed over
    blocks."""
    codes, scale, low = quantize_q4(weight)
    n = weight.shape[0]
    halves = codes.reshape(n, -1, 16)
    q = torch.cat([halves & 0xF, halves >> 4], dim=-1).double()              # [N, KB, 32]
    xb = x.float().reshape(x.shape[0], -1, 32)
    top = xb.abs().amax(-1)                                                  # [T, KB]
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    xq = torch.round(xb * inv[..., None]).double()      # round half to even, as the kernel
    dots = torch.einsum("tbi,nbi->tnb", xq, q) * scale.double()[None]
    dots = dots + xq.sum(-1)[:, None, :] * low.double()[None]                 # fp16 → exact
    out = (dots * (top / 127).double()[:, None, :]).sum(-1)
    return out if bias is None else out + bias.double()


def test_q4_codes_round_trip_within_half_a_step():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    codes, scale, low = quantize_q4(w)
    assert codes.shape == (24, 48) and codes.dtype == torch.uint8 and scale.shape == (24, 3)
    assert scale.dtype == low.dtype == torch.float16
    back = dequantize_q4(codes, scale, low).reshape(24, 3, 32)
    blocks = w.reshape(24, 3, 32)
    # half a step, plus the fp16 rounding of the minimum and of 15 steps
    slack = 1e-3 * blocks.abs().amax(-1, keepdim=True)
    assert bool(((back - blocks).abs() <= scale.float()[..., None] / 2 + slack).all())
    assert torch.allclose(back.amin(-1), blocks.amin(-1), atol=2e-3)
    assert torch.allclose(back.amax(-1), blocks.amax(-1), atol=2e-3)
    const = quantize_q4(torch.full((1, 32), 0.25))            # a constant block: scale 0
    assert torch.equal(dequantize_q4(*const), torch.full((1, 32), 0.25))


def test_kernel_layout_interleaves_pairs_of_blocks_in_4_byte_chunks():
    codes = torch.arange(3 * 16, dtype=torch.uint8)[None]    # three blocks: one pair, one alone
    got = kernel_layout(codes)[0].tolist()
    pair = [c * 16 + g * 4 + i for g in range(4) for c in range(2) for i in range(4)]
    assert got == pair + list(range(32, 48))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 7), n=st.sampled_from([1, 2, 3, 17, 64]),
       bias=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 999))
def test_the_kernel_computes_the_scheme_exactly(rows, blocks, n, bias, bf16, seed):
    """Any block count (pairs and an odd last block), row count (one, two, groups of four),
    odd N, bias, fp32 or bf16 activations: the scheme's integer arithmetic to fp32 rounding,
    and each row of a call bit-identical to the row alone."""
    gen = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    weight = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    if bf16:
        x = x.bfloat16()
    lin = W4A8Linear(weight, b)
    got = lin(x)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    want = _reference(x, weight, b)
    tol = 1e-5 * (1 + want.abs().max().item()) if not bf16 else 1e-2 * (1 + want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= tol
    alone = torch.cat([lin(row) for row in x.split(1)])
    assert torch.equal(got, alone)


@needs_kernel
def test_thread_count_changes_no_bit():
    weight = torch.randn(301, 256) * 0.05
    x = torch.randn(3, 256)
    lin = W4A8Linear(weight, None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_inputs_of_other_shapes_and_dtypes():
    lin = W4A8Linear(torch.randn(8, 64), None)
    x = torch.randn(2, 3, 64)
    assert torch.equal(lin(x), lin(x.reshape(6, 64)).reshape(2, 3, 8))
    assert lin(x.half()).dtype == torch.float16                # through fp32
    assert torch.equal(lin(x[..., ::1].transpose(0, 1).contiguous().transpose(0, 1)),
                       lin(x))                                  # non-contiguous input
    assert torch.equal(lin(torch.zeros(1, 64)), torch.zeros(1, 8))


def test_input_size_must_be_a_multiple_of_the_block():
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        W4A8Linear(torch.randn(4, 48), None)


@needs_kernel
def test_a_changed_kernel_is_a_new_latency_key(monkeypatch):
    """Latency models measured on selfspec's own kernels name the kernel's source digest: an
    upgraded kernel is measured again instead of steering auto/knapspec with old timings."""
    from selfspec.executor import LayerExecutor, cost_model, native

    from tiny import tiny_model

    view = LayerExecutor(tiny_model("llama", seed=4).float()).draft_view("w4a8")
    before = cost_model.machine_key(view)
    assert f"-draftw4a8-{native.source_digest(w4a8.SOURCE)}-" in before
    monkeypatch.setattr(native, "source_digest", lambda name: "0" * 8)
    assert cost_model.machine_key(view) != before
