"""Where the time of one-token decoding goes: torch profiler over `ar` on a real model.

    python docs/results/executor-profile/profile_ar.py [--model M] [--dtype bf16] [--tokens 64] [--threads 2] [--tag T]

Prints (and writes profile-<model>-<dtype>[-<tag>].md beside this script; the tag names the
machine, so one machine's profile does not overwrite another's) the wall time per token,
the time inside ATen operators (self time, by operator type) and the remainder: Python and
dispatch overhead outside any operator.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import selfspec

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the output file (the machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = selfspec.load(args.model, dtype=args.dtype, show_progress=False)
    gen = {"max_new_tokens": args.tokens, "method": "ar"}
    engine.generate(PROMPT, **gen)  # warm-up
    t0 = time.perf_counter()
    plain = engine.generate(PROMPT, **gen)
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(PROMPT, **gen)
    events = prof.key_averages()
    total_self_us = sum(e.self_cpu_time_total for e in events)
    n = plain.stats.new_tokens
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    per_tok_ms = 1e3 * wall / n
    lines = [(f"# `ar` decode profile: {args.model}, {args.dtype}, {args.threads} threads, "
              f"{n} tokens\n"),
             f"- unprofiled: {n / wall:.1f} tok/s, {per_tok_ms:.2f} ms per token (prefill included)",
             (f"- profiled run: operator self time {total_self_us / 1e3 / n:.2f} ms per token "
              "(the profiler adds its own per-call cost, so shares are what to read)\n"),
             "| operator | calls / token | self ms / token | share of operator time |",
             "|---|---:|---:|---:|"]
    for e in rows:
        lines.append(f"| `{e.key}` | {e.count / n:.0f} | {e.self_cpu_time_total / 1e3 / n:.3f} | "
                     f"{100 * e.self_cpu_time_total / total_self_us:.1f}% |")
    calls = sum(e.count for e in events) / n
    lines.append(f"\n{calls:.0f} operator calls per token.")
    text = "\n".join(lines) + "\n"
    print(text)
    tag = f"-{args.tag}" if args.tag else ""
    out = Path(__file__).with_name(f"profile-{args.model}-{args.dtype}{tag}.md")
    out.write_text(text)


if __name__ == "__main__":
    main()
