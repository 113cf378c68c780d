#!/usr/bin/env python
"""Microbenchmark of the GGUF rows kernel (selfspec.executor.gguf_rows) against selfspec's own
w4a8 kernel (selfspec.executor.w4a8) on Qwen2.5-1.5B's shapes.

Usage::

    python scripts/gguf_rows_bench.py [--threads 2] [--repeat 20] [--type Q8_0]

Shapes: gate_up [17920, 1536] Q4_K, down [1536, 8960] Q6_K, qkv [2048, 1536] as Q4_K q and k
(1536 + 256 rows) and Q6_K v (256 rows), blocks quantized from random normal weights
(gguf_quantize.quantize_blocks); w4a8 on the same float weights. bf16 inputs, as in decoding.
``--type`` puts every segment in one type instead (e.g. Q8_0, as the registry's Qwen GGUFs).

Prints, per shape and kernel (gguf rows with each available build, w4a8): bytes one call reads,
GB/s for one-token products (those bytes / the time), the least µs of a call (over --repeat
batches) of M = 1, 4, 8 and 16 rows, and the cost of M = 8 and 16 rows in one-row calls
(µs(M) / µs(1)).
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from selfspec.executor import gguf_rows, w4a8
from selfspec.executor.gguf_quantize import quantize_blocks
from selfspec.executor.gguf_rows import GgufMatrix, GgufSegment

T = gguf.GGMLQuantizationType
SHAPES = {  # name: (in_features, [(rows, type), ...])
    "gate_up": (1536, [(17920, T.Q4_K)]),
    "down": (8960, [(1536, T.Q6_K)]),
    "qkv": (1536, [(1536, T.Q4_K), (256, T.Q4_K), (256, T.Q6_K)]),
}
ROWS = (1, 4, 8, 16)


def _best_us(fn, x, repeat: int) -> float:
    """The least over ``repeat`` batches of the mean µs of a call (a batch lasts ~5 ms): on a
    machine shared with other jobs the least is the kernel's own cost, a median is not."""
    fn(x)
    start = time.perf_counter()
    fn(x)
    once = time.perf_counter() - start
    calls = max(1, int(0.005 / max(once, 1e-6)))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e6


def main() -> None:
    """Print, per shape and kernel (each available GGUF rows build, w4a8), the bytes a call
    reads, GB/s and the µs of calls of 1 … 16 rows (the module docstring's table)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--type", choices=[t.name for t in gguf_rows.GGUF_ROW_TYPES],
                        help="one type for every segment (default: the K-quant mix above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = [isa for isa in gguf_rows.ISAS if gguf_rows.gguf_rows_available(isa)]
    print(f"threads {args.threads}; gguf rows builds: {', '.join(isas) or 'none'} "
          f"(auto: {gguf_rows.chosen_isa()}); w4a8: "
          f"{'yes' if w4a8.w4a8_available() else w4a8.w4a8_unavailable_reason()}")
    header = f"{'shape':8} {'kernel':12} {'MB':>7} {'GB/s':>6} " + " ".join(
        f"{'M=' + str(m) + ' µs':>10}" for m in ROWS) + f" {'x8/x1':>6} {'x16/x1':>6}"
    print(header)
    gen = torch.Generator().manual_seed(0)
    for name, (k, parts) in SHAPES.items():
        if args.type:
            parts = [(n, T[args.type]) for n, _ in parts]
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, _ in parts]
        kernels = {}
        segments = [GgufSegment(t, quantize_blocks(w, t))
                    for w, (_, t) in zip(weights, parts, strict=False)]
        for isa in isas:
            kernels[f"gguf {isa}"] = GgufMatrix(segments, k, isa=isa)
        if w4a8.w4a8_available():
            kernels["w4a8"] = w4a8.W4A8Linear(torch.cat(weights), None)
        for label, kernel in kernels.items():
            us = {m: _best_us(kernel, torch.randn(m, k, generator=gen).bfloat16(), args.repeat)
                  for m in ROWS}
            gbs = kernel.nbytes / (us[1] * 1e-6) / 1e9
            print(f"{name:8} {label:12} {kernel.nbytes / 1e6:7.2f} {gbs:6.1f} "
                  + " ".join(f"{us[m]:10.0f}" for m in ROWS)
                  + f" {us[8] / us[1]:6.2f} {us[16] / us[1]:6.2f}")


if __name__ == "__main__":
    main()
