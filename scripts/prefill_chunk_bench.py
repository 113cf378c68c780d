#!/usr/bin/env python
"""Prefill throughput (prompt tokens/s of a cold prefill) by the executor's prefill chunk
(``selfspec serve --prefill-chunk``, ``selfspec.load(prefill_chunk=)``).

Usage::

    PYTHONPATH=src python scripts/prefill_chunk_bench.py                     # fp32 and bf16
    PYTHONPATH=src python scripts/prefill_chunk_bench.py --chunks 32,64,128,256 --tokens 2000

:meth:`~selfspec.executor.LayerExecutor.prefill` runs a prompt in calls over fixed chunks of
absolute positions, and the prefix cache keeps whole chunks, so a smaller chunk makes warm
turns faster (``scripts/prefix_cache_ttft.py``) and this prefill slower: smaller products,
and one attention call over the whole cache per chunk. Each ``--dtypes`` entry loads the
model once; every round times each chunk size once, in a rotated order, so a burst of
another process slows one round of every size rather than every repeat of one; the table
gives the fastest of ``--rounds`` rounds and its ratio to the largest chunk.

Timings are wall clock: read the ratios, and give the machine's load beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import selfspec
from selfspec.decoding.core.state import DecodeOptions, DecodeState

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(engine: selfspec.SelfSpec, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of docs/design.md (real text)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"docs/design.md holds {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def prefill_seconds(engine: selfspec.SelfSpec, ids: list[int], chunk: int) -> float:
    """Wall-clock seconds of one cold prefill of ``ids`` in chunks of ``chunk`` positions."""
    engine.executor.prefill_chunk = chunk
    state = DecodeState(engine.executor, ids, DecodeOptions(max_new_tokens=1))
    with torch.inference_mode():
        start = time.perf_counter()
        state.prefill()
        return time.perf_counter() - start


def bench_dtype(dtype: str, chunks: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Fastest prefill tokens/s of each chunk size for one dtype (interleaved rounds)."""
    engine = selfspec.load(args.model, dtype=dtype, show_progress=False)
    ids = prompt_ids(engine, args.tokens)
    best = {c: float("inf") for c in chunks}
    for c in chunks:  # one-time costs (packing, allocation) out of the timings
        prefill_seconds(engine, ids[:2 * c], c)
    for r in range(args.rounds):
        for c in chunks[r % len(chunks):] + chunks[:r % len(chunks)]:
            best[c] = min(best[c], prefill_seconds(engine, ids, c))
    return {c: args.tokens / best[c] for c in chunks}


def main() -> int:
    """Print one table of tokens/s per dtype and chunk size; exit status 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated (default fp32,bf16)")
    parser.add_argument("--chunks", default="64,128,256",
                        help="comma-separated chunk sizes (default 64,128,256)")
    parser.add_argument("--tokens", type=int, default=1075, help="prompt tokens (default 1075)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunks = sorted(int(c) for c in args.chunks.split(","))
    print(f"{args.model}, {args.tokens}-token prompt, {args.threads} thread(s), fastest of "
          f"{args.rounds} interleaved rounds; load before: {os.getloadavg()[0]:.2f}\n")
    print("| dtype | " + " | ".join(f"chunk {c} tok/s" for c in chunks) + " | "
          + " | ".join(f"{c} / {chunks[-1]}" for c in chunks[:-1]) + " |")
    print("|---" * (2 * len(chunks)) + "|")
    for dtype in args.dtypes.split(","):
        rate = bench_dtype(dtype.strip(), chunks, args)
        print(f"| {dtype} | " + " | ".join(f"{rate[c]:.0f}" for c in chunks) + " | "
              + " | ".join(f"{rate[c] / rate[chunks[-1]]:.2f}" for c in chunks[:-1]) + " |",
              flush=True)
    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
