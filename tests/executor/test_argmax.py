"""The greedy argmax kernel (selfspec.executor.argmax) equals torch.argmax bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.decoding.core.sampling import SamplingConfig, choose_next
from selfspec.executor import argmax as argmax_mod
from selfspec.executor.argmax import MIN_LENGTH, argmax_available, argmax_last

needs_kernel = pytest.mark.skipif(not argmax_available(), reason="argmax kernel unavailable here")


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), extra=st.integers(0, 70), levels=st.integers(1, 6),
       bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_kernel_equals_torch_argmax_with_ties_and_tails(rows, extra, levels, bf16, seed):
    # Few distinct values, so most rows have their maximum many times: the first must win.
    gen = torch.Generator().manual_seed(seed)
    n = MIN_LENGTH + extra
    x = torch.randint(-levels, levels + 1, (rows, n), generator=gen).float()
    x[0, torch.randint(0, n, (3,), generator=gen)] = float("inf") if seed % 3 == 0 else 0.0
    if bf16:
        x = x.bfloat16()
    assert torch.equal(argmax_mod._call(argmax_mod._library().call, x), x.argmax(dim=-1))
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_minus_inf_rows_nan_rows_and_views_follow_torch(dtype):
    x = torch.randn(3, 2, 151_936).to(dtype)
    x[0, 0] = float("-inf")                  # torch: index 0
    x[1, 1, 77_777] = float("nan")           # torch: the NaN's index (left to torch)
    x[2, 0, 5] = x[2, 0, 150_000] = 1e4      # a tie far apart: the first
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    strided = x[:, 0]                        # rows of a view, not adjacent in memory
    assert torch.equal(argmax_last(strided), strided.argmax(dim=-1))
    with_nan = x[1]
    assert int(argmax_last(with_nan)[1]) == 77_777


def test_what_the_kernel_does_not_take_goes_to_torch():
    short = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert argmax_last(short).tolist() == [1]
    half = torch.randn(2, MIN_LENGTH).half()
    assert torch.equal(argmax_last(half), half.argmax(dim=-1))
    transposed = torch.randn(MIN_LENGTH, 3).t()  # last dimension not contiguous
    assert torch.equal(argmax_last(transposed), transposed.argmax(dim=-1))


def test_greedy_choose_next_picks_the_first_maximum():
    logits = torch.zeros(2, 2 * MIN_LENGTH, dtype=torch.bfloat16)
    logits[0, [9, 4000, 8000]] = 5.0
    logits[1, -1] = 1.0
    assert choose_next(logits, SamplingConfig()).tolist() == [9, 2 * MIN_LENGTH - 1]
