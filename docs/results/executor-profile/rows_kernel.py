"""Cost of one forward over M new tokens (decoding: M=1; verifying a draft of D: M=D+1) with
each decoding kernel (`--decode-kernel weights|fp16|bf16|auto`; auto = FBGEMM fp16 for
matrices >= 4 MiB, selfspec's bf16 kernel for the rest, on CPUs that emulate bf16), in one
process, best of 3.

    python docs/results/executor-profile/rows_kernel.py [--model M] [--steps 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

import selfspec


def forward_ms(ex, rows: int, steps: int) -> float:
    """Mean ms of ``steps`` forwards of ``rows`` new tokens after a 4-token prefix."""
    cache = ex.new_cache(capacity=4 + rows * (steps + 1))
    with torch.inference_mode():
        ex.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache)
        ids = torch.full((1, rows), 5)
        ex.forward(ids, (4 + torch.arange(rows))[None], cache)  # warm-up
        start = time.perf_counter()
        for i in range(1, steps + 1):
            ex.forward(ids, (4 + i * rows + torch.arange(rows))[None], cache)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype="bf16", show_progress=False)
    ex = engine.executor
    kernels, sizes = ("weights", "fp16", "bf16", "auto"), (1, 2, 5, 8)
    best: dict[tuple[str, int], float] = {}
    for _ in range(3):
        for kernel in kernels:
            ex.set_bulk("auto", kernel)
            for m in sizes:
                ms = forward_ms(ex, m, args.steps)
                best[kernel, m] = min(best.get((kernel, m), ms), ms)
    print(f"# {args.model}, bf16, {args.threads} threads: ms per forward of M new tokens\n")
    print("| kernel | " + " | ".join(f"M={m}" for m in sizes) + " | M=5 / M=1 |")
    print("|---|" + "---:|" * (len(sizes) + 1))
    for kernel in kernels:
        cells = " | ".join(f"{best[kernel, m]:.1f}" for m in sizes)
        print(f"| {kernel} | {cells} | {best[kernel, 5] / best[kernel, 1]:.2f} |")


if __name__ == "__main__":
    main()
