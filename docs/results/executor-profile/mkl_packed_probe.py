"""MKL's packed fp32 GEMV (what inductor's freezing uses for fp32 linears) against F.linear on
one row, with the size of the packed copy: the kernel behind HF compiled+frozen's 1.2x on
AVX2 fp32 (see README, "torch.compile ... does not pay").

    python docs/results/executor-profile/mkl_packed_probe.py [THREADS]

Shapes: SmolLM2-135M lm_head and gate/up, Qwen2.5-1.5B gate/up and lm_head. Random fp32
weights; best of 5 passes of 20 calls each, after a warm-up.
"""

import sys
import time

import torch
import torch.nn.functional as F


def best_ms(fn, calls: int = 20, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    shapes = {"smollm2 lm_head": (49152, 576), "smollm2 gate/up": (3072, 576),
              "qwen1.5b gate/up": (17920, 1536), "qwen1.5b lm_head": (151936, 1536)}
    print("| matrix | F.linear ms | MKL packed ms | speedup | packed copy / weight |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k) * 0.02
        x = torch.randn(1, k)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
        plain = best_ms(lambda: F.linear(x, weight))
        mkl = best_ms(lambda: torch.ops.mkl._mkl_linear(x, packed, weight, None, 1))
        print(f"| {name} [{n}, {k}] | {plain:.2f} | {mkl:.2f} | {plain / mkl:.2f}x | "
              f"{packed.numel() / weight.numel():.2f}x |")
        del weight, packed


if __name__ == "__main__":
    main()
