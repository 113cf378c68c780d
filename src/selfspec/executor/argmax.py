"""Greedy decoding's argmax over logits on a compiled AVX2 kernel (``kernels/argmax.cpp``).

Why: torch's CPU ``argmax`` over a Qwen2.5 row of 151,936 logits costs several times its
``amax``, a noticeable share of a small model's decoding step, paid once a token by every
greedy method and once per position a verification checks. The kernel makes one
single-threaded pass of 8-lane compares.

Same result as ``torch.argmax(dim=-1)`` (the first index of the largest value), bit for bit;
a row holding a NaN, and anything the kernel does not take (another device or dtype, a last
dimension that is not contiguous, short rows, no compiler), goes to torch.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from selfspec.executor import native

SOURCE = "argmax.cpp"
MIN_LENGTH = 4096  # shorter rows: torch's own call is as fast


@cache
def _library() -> native.Kernel:
    return native.load(SOURCE, "selfspec_argmax_rows", [ctypes.c_void_p] + [ctypes.c_int64] * 4
                       + [ctypes.c_void_p, ctypes.c_void_p], _probe)


def argmax_available() -> bool:
    """Whether the kernel is built (or can be) and passed its probe here."""
    return _library().call is not None


def argmax_last(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``: ``[..., V]`` → ``[...]`` int64, the first index of
    each row's largest value, on the kernel where it takes the tensor (CPU, bf16 or fp32,
    ``V >= MIN_LENGTH``, contiguous rows), else on torch."""
    n = logits.shape[-1] if logits.dim() else 0
    if (n < MIN_LENGTH or logits.device.type != "cpu" or logits.stride(-1) != 1
            or logits.dtype not in (torch.bfloat16, torch.float32)):
        return logits.argmax(dim=-1)
    fn = _library().call
    if fn is None:
        return logits.argmax(dim=-1)
    return _call(fn, logits)


def _call(fn, logits: torch.Tensor) -> torch.Tensor:
    rows = logits.reshape(-1, logits.shape[-1])  # a view for rows evenly strided
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    status = ctypes.c_int64(0)
    fn(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
       int(rows.dtype == torch.bfloat16), out.data_ptr(), ctypes.byref(status))
    if status.value:  # a row with a NaN: torch's answer is the NaN's index
        return logits.argmax(dim=-1)
    return out.view(logits.shape[:-1])


def _probe(fn) -> str:
    """Check the kernel against ``torch.argmax`` on random rows with ties, ``-inf`` rows and
    tails (``""`` when it agrees)."""
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 8, 31, 32, 45, 4099):
            x = torch.randint(-3, 4, (5, n), generator=gen).to(dtype)  # many ties
            x[1] = float("-inf")
            x[2, n // 2:] = 9.0
            if not torch.equal(_call(fn, x), x.argmax(dim=-1)):
                return f"differs from torch.argmax on {dtype} rows of {n}"
    return ""
