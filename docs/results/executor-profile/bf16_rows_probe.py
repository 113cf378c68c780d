"""µs per call of one weight matrix times M activation rows, from DRAM (distinct copies of the
weight, ~200 MB in all, taken in turn), for bf16 `F.linear`, FBGEMM's fp16 kernel and
selfspec's AVX2 bf16 kernel (`src/selfspec/executor/bf16_rows.py`), best of 3 rounds.

    python docs/results/executor-profile/bf16_rows_probe.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from selfspec.executor.bf16_rows import Bf16Rows
from selfspec.executor.fp16_rows import Fp16Rows

SHAPES = {  # [N, K]
    "SmolLM2 qkv": (960, 576), "SmolLM2 gate/up": (3072, 576), "SmolLM2 down": (576, 1536),
    "SmolLM2 lm_head": (49152, 576), "Qwen 1.5B gate/up": (17920, 1536),
    "Qwen 1.5B down": (1536, 8960),
}
ROWS = (1, 2, 5, 8)


def per_call_us(fn, copies, x, seconds: float = 0.25) -> float:
    for w in copies[:2]:
        fn(x, w)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for w in copies:
            fn(x, w)
        calls += len(copies)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ours, fp16 = Bf16Rows(), Fp16Rows(max_rows=16)
    print(f"# µs per call from DRAM, {args.threads} threads (bf16 F.linear / FBGEMM fp16 / "
          "selfspec bf16)\n")
    print("| matrix | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for name, (n, k) in SHAPES.items():
        count = max(2, 200_000_000 // (n * k * 2))
        weights = [(torch.randn(n, k) * 0.05).bfloat16() for _ in range(count)]
        kernels = {
            "bf16": ([w for w in weights], lambda x, w: F.linear(x, w)),
            "fp16": ([fp16.prepack(w, None) for w in weights], lambda x, p: fp16(x, p)),
            "ours": ([ours.prepack(w, None) for w in weights], lambda x, p: ours(x, p)),
        }
        cells = []
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            best = {}
            for _ in range(3):
                for kname, (copies, fn) in kernels.items():
                    us = per_call_us(fn, copies, x)
                    best[kname] = min(best.get(kname, us), us)
            cells.append(" / ".join(f"{best[kn]:.0f}" for kn in ("bf16", "fp16", "ours")))
        print(f"| {name} [{n}, {k}] | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
