"""Per-layer product time of a model's bf16 matrices (random weights, 93.6 MB a layer for
Qwen2.5-1.5B, several layers so that each call reads from DRAM) on the bf16 kernel's
AVX512-BF16 and AMX builds and on oneDNN (F.linear), for T = 1..16 activation rows.

    python product_cost.py [qwen|smollm2]
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from selfspec.executor import bf16_rows as B

torch.set_num_threads(2)
SHAPES = {"qwen": ([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], 6),
          "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 60)}
shapes, L = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "qwen"]
layers = [[B._weight((torch.randn(n, k) * 0.02).bfloat16(), None) for n, k in shapes]
          for _ in range(L)]
kernels = {isa: B._library(isa).call for isa in ("avx512bf16", "amx")}
kernels["onednn"] = None


def per_layer_ms(fn, T):
    xs = {k: torch.randn(T, k).bfloat16() for _, k in shapes}

    def once():
        for layer in layers:
            for (_, k), packed in zip(shapes, layer):
                if fn is None:
                    F.linear(xs[k], packed.weight)
                else:
                    B._product(fn, xs[k], packed)
    once()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        once()
        times.append((time.perf_counter() - start) / L * 1e3)
    return statistics.median(times)


res = {(name, T): per_layer_ms(fn, T) for T in (1, 2, 4, 8, 16) for name, fn in kernels.items()}
print("| T | " + " | ".join(f"{n} ms (× T=1)" for n in kernels) + " |")
print("|---:|" + "---:|" * len(kernels))
for T in (1, 2, 4, 8, 16):
    print(f"| {T} | " + " | ".join(f"{res[(n, T)]:.2f} ({res[(n, T)] / res[(n, 1)]:.2f}×)"
                                   for n in kernels) + " |")
mb = sum(n * k for n, k in shapes) * 2 / 1e6
print(f"\nlayer bytes {mb:.1f} MB; GB/s at T = 1: "
      + ", ".join(f"{n} {mb / res[(n, 1)]:.1f}" for n in kernels))
