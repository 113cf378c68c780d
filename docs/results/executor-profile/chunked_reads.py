"""How fast this machine streams weights when they come in decoder-sized pieces: the floor
under any one-token decoding kernel. Reads (``sum``) SmolLM2-135M's 120 layer matrices as
separate tensors, as views into one buffer, and as that one buffer, and prints GB/s.

    python docs/results/executor-profile/chunked_reads.py [--threads 2]
    THP_MEM_ALLOC_ENABLE=1 python docs/results/executor-profile/chunked_reads.py  # huge pages

The bench's roofline uses the one-buffer rate (512 MiB); a model's decoding reads the pieces.
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # SmolLM2: qkv, o, gate_up, down


def rate(tensors: list[torch.Tensor], repeats: int = 10) -> tuple[float, float]:
    """(ms per pass, GB/s) of reading every tensor once, best of three."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            for t in tensors:
                t.sum()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3, nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    pieces = [torch.randn(*s).bfloat16() for s in SHAPES]
    flat = torch.cat([p.flatten() for p in pieces])
    views, offset = [], 0
    for p in pieces:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    print(f"{flat.numel() * 2 / 1e6:.0f} MB in {len(pieces)} matrices")
    for label, tensors in (("separate tensors", pieces), ("views into one buffer", views),
                           ("one buffer", [flat])):
        ms, gbs = rate(tensors)
        print(f"{label:24s} {ms:6.2f} ms  {gbs:5.1f} GB/s")


if __name__ == "__main__":
    main()
